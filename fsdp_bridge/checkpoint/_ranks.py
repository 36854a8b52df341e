"""Every rank's part of a checkpoint step: this rank and the world size, rank 0's verdict shared,
and a step that fails on one rank raising the same error on all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_bridge.checkpoint._formats import CheckpointError, failure_text

__all__ = ["agree_on", "on_every_rank", "rank_world"]


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def agree_on(error: str | None) -> str | None:
    """Rank 0's error message (or None), known to every rank: one small broadcast."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    box: list[str | None] = [error]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_every_rank(path: str | Path, what: str, fn: Callable[[], Any]) -> Any:
    """Run this rank's part of a save; if it fails on any rank, every rank raises the same error.

    The outcome is shared in one small all-reduce (failures are gathered only when there is
    one), which also serves as the barrier after the step: a full disk or a read-only
    directory on one rank can no longer leave the others waiting for the process-group timeout.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    error: str | None = None
    result = None
    try:
        result = fn()
    except CheckpointError as err:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            raise  # already names the file and the problem
        error = str(err)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        error = failure_text(err)  # DCP's: each failing rank's own exception
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()):
            errors: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            raise CheckpointError(path, [f"rank {r}: {what} failed: {e}" for r, e in enumerate(errors) if e])
    elif error is not None:
        raise CheckpointError(path, f"{what} failed: {error}")
    return result
