"""The frame of a save: its arguments checked, a fresh staging directory under the save lock, the
checksums of every rank's files, and rank 0's description, publication and rotation.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from fsdp_bridge._paths import unwritable_reason
from fsdp_bridge.backends import model_class_name
from fsdp_bridge.checkpoint import _hf
from fsdp_bridge.checkpoint._atomic import (
    SaveLock,
    check_replaceable,
    make_staging,
    partial_path,
    publish,
    remove_ours,
    rotate_checkpoints,
    series_prefix,
)
from fsdp_bridge.checkpoint._description import Description
from fsdp_bridge.checkpoint._formats import DCP_DIR, CheckpointError, checksums, param_stats
from fsdp_bridge.checkpoint._model_state import bridge_of
from fsdp_bridge.checkpoint._state import check_state, write_state

__all__ = [
    "check_save_args",
    "describe_and_publish",
    "fresh_staging",
    "gather_checksums",
    "own_checksums",
    "release_save_lock",
]


def describe_and_publish(
    staging: Path,
    path: Path,
    model: nn.Module,
    *,
    kind: str,
    state: dict[str, Any] | None,
    world: int,
    shapes: dict[str, tuple[tuple[int, ...], str]],
    tied: list[list[str]],
    has_optimizer: bool,
    keep_last: int | None,
    known_checksums: dict[str, int] | None = None,
) -> None:
    """Rank 0, once every rank's files are in ``staging``: state, config, description, publish, rotate.

    ``known_checksums``: CRC-32Cs the writing ranks already computed (each of its own files, in
    parallel); rank 0 computes the rest."""
    bridge = bridge_of(model)
    write_state(staging, state)
    has_config = _hf.write_hf_config(staging, model)
    Description(
        kind=kind,
        backend=bridge.config.backend.value if bridge is not None else None,
        world_size=world,
        step=(state or {}).get("step"),
        bridge_config=bridge.config.to_dict() if bridge is not None else None,
        model_class=model_class_name(model),
        hf_config=has_config,
        has_optimizer=has_optimizer,
        tied=tied,
        params=param_stats(shapes, tied),
    ).write(staging, known_checksums=known_checksums)
    publish(staging, path)
    if keep_last is not None:
        rotate_checkpoints(path.parent, keep_last, prefix=series_prefix(path.name) or "")


def own_checksums(staging: Path, rank: int) -> dict[str, int]:
    """CRC-32C of the DCP files this rank wrote (``__<rank>_<i>.distcp``), read back from the page cache."""
    return checksums(staging, (staging / DCP_DIR).glob(f"__{rank}_*.distcp"))


def gather_checksums(mine: dict[str, int]) -> dict[str, int]:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return mine
    gathered: list[dict[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {k: v for part in gathered for k, v in (part or {}).items()}


_HELD: dict[Path, SaveLock] = {}
"""Rank 0's save locks, by checkpoint path, from :func:`fresh_staging` to :func:`release_save_lock`."""


def fresh_staging(path: Path, rank: int) -> Path:
    """The staging directory of ``path``, emptied by rank 0 under the path's save lock (call a
    barrier after it; rank 0 calls :func:`release_save_lock` once the save is published or failed)."""
    staging = partial_path(path)
    reason = unwritable_reason(path)
    if reason is not None:
        raise CheckpointError(path, f"cannot be written: {reason}; save to a directory this user can write")
    if rank == 0:
        _HELD[path] = SaveLock(path).acquire()  # refused while another process saves this path
        # A partial copy left by an earlier save that was killed.
        remove_ours(staging, f"where a save of {path.name} keeps its partial copy")
        make_staging(staging)
    return staging


def release_save_lock(path: Path) -> None:
    """Release the save lock :func:`fresh_staging` took for ``path`` on this process, if any."""
    lock = _HELD.pop(path, None)
    if lock is not None:
        lock.release()


def check_save_args(path: str | os.PathLike[str], keep_last: int | None, state: dict[str, Any] | None) -> Path:
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise ValueError(f"keep_last must be None or an integer >= 1 (got {keep_last!r})")
    check_state(state)
    path = Path(path)
    if path.name.startswith(".") or path.name in ("", ".."):
        raise ValueError(
            f"path {str(path)!r} must name a directory that does not start with '.' "
            "(dot-names are reserved for interrupted saves)"
        )
    if keep_last is not None and series_prefix(path.name) is None:
        raise ValueError(
            f"keep_last={keep_last} rotates checkpoints named by step, but {path.name!r} does not end in a "
            f"step number: name it like step_00000100 (checkpoints of the same prefix and any other number "
            "are rotated; other names beside it are never deleted), or drop keep_last"
        )
    # Every rank, before any collective: never replace the user's files.  The staging directory is
    # left to rank 0's fresh_staging (under the save lock, its outcome shared with every rank): the
    # other ranks could otherwise catch it half made by rank 0 and refuse it as not ours.
    check_replaceable(path, staging=False)
    return path
