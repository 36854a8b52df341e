"""``fsdp_bridge.json``: what a checkpoint holds, written last by one builder for every writer.

:func:`~fsdp_bridge.checkpoint._formats.read_meta` reads and validates it; :class:`Description`
is the only place that writes it (``save_checkpoint``, ``save_checkpoint_async`` and
``convert`` all go through :meth:`Description.write`), so the fields cannot drift apart.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdp_bridge._version import __version__
from fsdp_bridge.checkpoint._atomic import write_json_durably
from fsdp_bridge.checkpoint._formats import (
    CHECKSUM,
    FORMAT,
    FORMAT_VERSION,
    META_FILE,
    SELF_DIGEST,
    checksums,
    description_digest,
    digests,
    manifest,
)

__all__ = ["Description"]


@dataclass(frozen=True, kw_only=True)
class Description:
    """The fields a writer knows; :meth:`write` adds the format, versions, time and the size,
    SHA-256 (small files) and CRC-32C (tensor files) of every file in the directory, and the
    SHA-256 of the description itself (``description_sha256``)."""

    kind: str
    backend: str | None
    world_size: int
    step: int | None
    bridge_config: dict[str, Any] | None
    model_class: str | None
    hf_config: bool
    has_optimizer: bool
    tied: list[list[str]]
    params: dict[str, Any]
    converted_from: dict[str, str] | None = None

    def write(self, directory: Path, *, known_checksums: dict[str, int] | None = None) -> dict[str, Any]:
        """Write ``directory/fsdp_bridge.json`` durably, once every other file is in place; return it.

        ``known_checksums``: CRC-32Cs the writing ranks already computed (each of its own files,
        in parallel); the rest are computed here."""
        known = known_checksums or {}
        rest = [f for f in directory.rglob("*") if str(f.relative_to(directory)) not in known]
        meta = self.build(
            files=manifest(directory),
            digests=digests(directory),
            checksums={**checksums(directory, rest), **known},
        )
        write_json_durably(directory / META_FILE, meta)
        return meta

    def build(self, *, files: dict[str, int], digests: dict[str, str], checksums: dict[str, int]) -> dict[str, Any]:
        """The description of a directory whose files (relative name -> size), SHA-256 of the
        small ones and CRC-32C of the others are given (a directory anywhere: an object store)."""
        meta: dict[str, Any] = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "kind": self.kind,
            "backend": self.backend,
            "world_size": self.world_size,
            "step": self.step,
            "bridge_config": self.bridge_config,
            "model_class": self.model_class,
            "hf_config": self.hf_config,
            "has_optimizer": self.has_optimizer,
            "tied": self.tied,
            "params": self.params,
            "torch_version": torch.__version__,
            "fsdp_bridge_version": __version__,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "files": dict(sorted(files.items())),
            "digests": dict(sorted(digests.items())),
            "checksums": dict(sorted(checksums.items())),
            "checksum_algorithm": CHECKSUM,
        }
        if self.converted_from is not None:
            meta["converted_from"] = self.converted_from
        meta[SELF_DIGEST] = description_digest(meta)  # a flipped bit anywhere in it is seen at read
        return meta
