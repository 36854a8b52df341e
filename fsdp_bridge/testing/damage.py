"""Damage checkpoints the way an attacker or a bad disk would, for reliability tests.

An attacker who edits a file of a checkpoint also rewrites ``fsdp_bridge.json`` so that the
recorded sizes and digests match (:func:`redescribe`): what is left to refuse the file is the
reader's own check of its content.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from fsdp_bridge.checkpoint._formats import SELF_DIGEST, checksum_of, description_digest

__all__ = ["describe", "redescribe", "zero_file"]


def describe(checkpoint: str | os.PathLike[str], *, step: int | None, kind: str = "full") -> dict[str, Any]:
    """Write a valid ``fsdp_bridge.json`` for whatever ``checkpoint`` (created if missing) holds, as
    a save of ``step`` would: for tests of code that lists or picks checkpoints."""
    from fsdp_bridge.checkpoint._description import Description

    root = Path(checkpoint)
    root.mkdir(parents=True, exist_ok=True)
    return Description(
        kind=kind,
        backend=None,
        world_size=1,
        step=step,
        bridge_config=None,
        model_class=None,
        hf_config=False,
        has_optimizer=False,
        tied=[],
        params={"numel": 0, "tensors": 0, "dtypes": {}},
    ).write(root)


def redescribe(checkpoint: str | os.PathLike[str]) -> None:
    """Record the current size, SHA-256 and checksum (CRC-32C) of every file the description lists, and
    the description's own SHA-256 (what an attacker who rewrites the description would do)."""
    root = Path(checkpoint)
    meta = json.loads((root / "fsdp_bridge.json").read_text())
    for rel in meta.get("files", {}):
        data = (root / rel).read_bytes()
        meta["files"][rel] = len(data)
        if rel in meta.get("digests", {}):
            meta["digests"][rel] = hashlib.sha256(data).hexdigest()
        if rel in meta.get("checksums", {}):
            meta["checksums"][rel] = checksum_of(root / rel, meta.get("checksum_algorithm", "crc32"))
    if SELF_DIGEST in meta:
        meta[SELF_DIGEST] = description_digest(meta)
    (root / "fsdp_bridge.json").write_text(json.dumps(meta, indent=2))


def zero_file(path: str | os.PathLike[str]) -> None:
    """Overwrite ``path`` with zero bytes of the same length (a block device that lost its data)."""
    p = Path(path)
    p.write_bytes(bytes(p.stat().st_size))
