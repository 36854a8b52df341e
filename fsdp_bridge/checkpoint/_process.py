"""torch's checkpoint process, as the process mode of ``save_checkpoint_async`` uses it.

torch (``AsyncCheckpointerType.PROCESS``) keeps one checkpoint process per Python process, made on
the first process-mode save, and offers no public call to end it or to say which process group
it was made in.  This module ends it (:func:`stop_checkpoint_process`), replaces it when the
process group changed (:func:`prepare_checkpoint_process`), and makes room among the open files
for the shared-memory copy it reads (:func:`fit_open_files`).  What it reads of torch's private
module (``torch/distributed/checkpoint/_async_process_executor.py``: the ``_CHECKPOINT_PROCESS``
global, its ``_send`` and ``_save_process``, the ``TERMINATE`` request) is as of torch 2.7-2.14,
and falls back to torch's own shutdown where it is missing.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["checkpoint_process", "fit_open_files", "prepare_checkpoint_process", "stop_checkpoint_process"]

logger = logging.getLogger("fsdp_bridge.checkpoint")

# torch keeps one checkpoint process per Python process (made on the first process-mode save,
# in the process group of that moment) and offers no public call to end it.  The default group it
# was made in, so a save in a later process group (destroy + init again, another world size)
# replaces it instead of writing with a group of the old world.
_PROCESS_MADE_IN: list[Any] = [None]


_FD_MARGIN = 256  # files the process opens besides the staged copy (data, logs, sockets) after the check


def _tensors(state: Any) -> int:
    """How many tensors a nested state dict holds (an FSDP1 ShardedTensor: its local shards)."""
    if isinstance(state, dict):
        return sum(_tensors(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensors(v) for v in state)
    if isinstance(state, torch.Tensor):
        return 1
    local_shards = getattr(state, "local_shards", None)
    return len(local_shards()) if callable(local_shards) else 0


def fit_open_files(state: dict[str, Any]) -> None:
    """Make room for the process mode's staged copy among this process's open files.

    Where torch shares memory through file descriptors (its default on Linux), every tensor of
    the shared staged copy stays an open file, here and in the checkpoint process (which inherits
    this process's limits when it is spawned): a model of a few hundred parameters with AdamW
    passes the common soft limit of 1024.  The soft limit is raised to the hard one when needed.

    Args:
        state: the state dict about to be staged.

    Raises:
        ValueError: even the hard limit is too low: names the numbers and the fixes.
    """
    import resource

    import torch.multiprocessing as torch_mp

    if torch_mp.get_sharing_strategy() != "file_descriptor":
        return  # shared through named files: no descriptor kept per tensor
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 0
    tensors = _tensors(state)
    needed = open_now + tensors + _FD_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    if hard != resource.RLIM_INFINITY and needed > hard:
        raise ValueError(
            f"mode='process' keeps each of the {tensors} tensors of the staged state open as a shared-memory file, "
            f"and this process may open at most {hard} files ({open_now} open now; ulimit -Hn): raise the hard "
            f"limit to at least {needed} (ulimit -n {needed} in the launching shell, LimitNOFILE in a systemd "
            "unit, ulimits in a container), or save with mode='thread'"
        )
    raised = hard if hard != resource.RLIM_INFINITY else needed
    resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    logger.info(
        "raised the open-file limit from %d to %d: the staged copy for the checkpoint process holds %d tensors",
        soft,
        raised,
        tensors,
    )


def _stop_request() -> Any:
    from torch.distributed.checkpoint import _async_process_executor as executor

    return executor._CheckpointSaveProcessControlOpts.TERMINATE


def checkpoint_process() -> Any:
    # torch 2.7-2.14: torch/distributed/checkpoint/_async_process_executor.py keeps it in the
    # module global _CHECKPOINT_PROCESS; a torch without it has nothing for us to end.
    from torch.distributed.checkpoint import _async_process_executor as executor

    return getattr(executor, "_CHECKPOINT_PROCESS", None)


def stop_checkpoint_process() -> None:
    """End torch's checkpoint process of this rank, if there is one (no save may be in flight).

    It is asked to stop (it leaves its gloo group), then killed if it is still there after 10 s; the next
    process-mode save starts a new one.  Local to this rank: call it on every rank alike."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = checkpoint_process()
    if process is None:
        return
    executor._CHECKPOINT_PROCESS = None  # type: ignore[attr-defined]
    _PROCESS_MADE_IN[0] = None
    # torch's own request (what its __del__ sends), given 10 s rather than __del__'s 5: the process
    # unmaps the shared staged copy and leaves its gloo group first.  Ended either way.
    child = getattr(process, "_save_process", None)
    if child is None or not hasattr(process, "_send"):  # another torch: its own shutdown
        process.__del__()
        return
    try:
        if child.is_alive():
            process._send(_stop_request())
            child.join(timeout=10)
    except OSError:  # it is gone already (the pipe is closed)
        pass
    finally:
        if child.is_alive():
            child.kill()
        child.join()


def prepare_checkpoint_process() -> None:
    """Before a process-mode save (every rank alike, with the same history of process groups): a
    checkpoint process made in an earlier process group would write with that group's ranks, so
    it is ended and torch makes a new one in this group."""
    if checkpoint_process() is not None and _PROCESS_MADE_IN[0] is not dist.group.WORLD:
        stop_checkpoint_process()
    if checkpoint_process() is None:
        _PROCESS_MADE_IN[0] = dist.group.WORLD
