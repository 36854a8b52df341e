"""Asynchronous sharded saves: training goes on while a background thread or process writes.

    pending = fsdp_bridge.save_checkpoint_async("ckpt/step_200", model, optimizer, state={"step": 200})
    ...                       # training continues
    pending.wait()            # before the next save, and before exiting

Built on ``torch.distributed.checkpoint.async_save``: the state dict is staged to host
memory before the call returns (so later optimizer steps do not change what is saved),
then written in the background, where the writer's collectives never touch the default group:

- ``mode="thread"`` (the default): a thread of this process, on a gloo group of its own.  It
  shares the interpreter with training (the GIL: serialising the files slows the steps a
  little) and starts at once.
- ``mode="process"``: torch's checkpoint process (``AsyncCheckpointerType.PROCESS``), one per
  rank, spawned on the first such save, with a gloo group of its own; the staged copy lives in
  shared memory, so handing it over copies nothing.  The first save pays the spawn (an import
  of torch, seconds); later saves reuse the process.

In both modes rank 0 then describes (checksums of every file) and publishes the checkpoint
(atomic rename, rotation) from a thread of this process, as soon as every rank's files are
written.  Until then the previous checkpoint is the latest one, and a crash leaves only a
dot-named partial directory.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import threading
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from fsdp_bridge._optim_state import init_step_undone
from fsdp_bridge.checkpoint._formats import DCP_DIR, CheckpointError, failure_text
from fsdp_bridge.checkpoint._model_state import shapes_of, tied_groups
from fsdp_bridge.checkpoint._process import fit_open_files, prepare_checkpoint_process, stop_checkpoint_process
from fsdp_bridge.checkpoint._publish import check_save_args, describe_and_publish, fresh_staging, release_save_lock
from fsdp_bridge.checkpoint._ranks import on_every_rank, rank_world
from fsdp_bridge.checkpoint._state import write_rng

__all__ = [
    "ASYNC_MODES",
    "AsyncCheckpoint",
    "AsyncCheckpointer",
    "AsyncMode",
    "checkpointer_of",
    "save_checkpoint_async",
]

AsyncMode = Literal["thread", "process"]
"""Where an asynchronous save is written: a thread of the training process, or torch's
checkpoint process (one per rank)."""
ASYNC_MODES: tuple[AsyncMode, ...] = ("thread", "process")


def check_mode(mode: object) -> AsyncMode:
    """``mode`` itself, or a ValueError naming the value, the choices and the fix (raised on every
    rank alike, before any collective)."""
    if mode not in ASYNC_MODES:
        raise ValueError(
            f"save_checkpoint_async: mode must be one of {', '.join(repr(m) for m in ASYNC_MODES)} (got {mode!r}): "
            "'thread' writes in a thread of this process, 'process' in torch's checkpoint process"
        )
    if mode == "process" and multiprocessing.current_process().daemon:
        raise ValueError(
            "save_checkpoint_async: mode='process' starts torch's checkpoint process, but this rank is a "
            "daemonic multiprocessing process, which may not have children: start the ranks with daemon=False "
            "(torchrun, torch.multiprocessing.spawn and fsdp_bridge.testing.run_distributed do), or use mode='thread'"
        )
    return cast("AsyncMode", mode)


def _new_stager(mode: AsyncMode) -> Any:
    """torch's public stager, blocking (the state is copied before the call returns), with its
    host copy kept for the next save.  Pinned only when CUDA exists (pinning needs it; torch
    ignores the flag with a warning otherwise, so on CPU the copy is plain pageable memory); in
    shared memory for the process mode, so the copy reaches torch's checkpoint process as a
    handle instead of being copied again into shared memory on every save."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=torch.cuda.is_available(),
            use_shared_memory=mode == "process",
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )


class AsyncCheckpointer:
    """What asynchronous saves of one model keep between calls: a gloo group over all ranks for
    the background writer (training collectives keep the default group), torch's stager with
    its host copy of the state, and the save in flight (whose host copy the next save reuses).

    The group belongs to the process group it was made in: after ``destroy_process_group`` and
    a new ``init_process_group`` the next save makes a new one.  :meth:`close` waits for the
    save in flight and frees the group and the host copy, and ends torch's checkpoint process if
    a process-mode save of this model used it (torch keeps one per process, for every model: close
    a checkpointer while another model's process-mode save is in flight and that save fails)."""

    def __init__(self) -> None:
        self._group: Any = None
        self._group_of: Any = None  # the default group self._group was made in
        self._stager: Any = None
        self._structure: Any = None  # mode, keys and shapes the stager's host copy was made for
        self._used_process = False
        self.pending: AsyncCheckpoint | None = None

    def group(self) -> Any:
        """The writer's gloo group (made collectively, on first use in each process group).

        Returns:
            The group, or None without a process group.
        """
        if not dist.is_initialized():
            return None
        if self._group is None or self._group_of is not dist.group.WORLD:
            self._group = dist.new_group(backend="gloo")
            self._group_of = dist.group.WORLD
        return self._group

    def stager(self, state: dict[str, Any], mode: AsyncMode = "thread") -> Any:
        """The stager, made again when the state's keys or shapes changed (a new optimizer) or
        the mode did (the process mode stages into shared memory).

        Args:
            state: the state dict about to be staged.
            mode: the mode of the save about to start.

        Returns:
            torch's ``DefaultStager``, holding the host copy the last save of this structure made.
        """
        structure = (mode, _structure(state))
        if self._stager is None or structure != self._structure:
            if self._stager is not None:
                self._stager.close()
            self._stager, self._structure = _new_stager(mode), structure
        return self._stager

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and published.

        Returns:
            None.

        Raises:
            CheckpointError: the background write failed (see :meth:`AsyncCheckpoint.wait`).
        """
        if self.pending is not None and not self.pending.done():
            self.pending.wait()

    def close(self) -> None:
        """Wait for the save in flight; free the host copy and the writer's group.

        Safe to call twice, and after the process group changed (the old group is not touched).

        Returns:
            None.

        Raises:
            CheckpointError: the background write failed; the resources are freed all the same.
        """
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
            if self._group is not None and self._group_of is dist.group.WORLD and dist.is_initialized():
                dist.destroy_process_group(self._group)
            if self._used_process:
                stop_checkpoint_process()
            self._group = self._group_of = self._stager = self._structure = None
            self._used_process = False


class AsyncCheckpoint:
    """A sharded checkpoint being written in the background."""

    def __init__(self, path: Path, future: Future[Any], finish: Any, release: Any = None) -> None:
        self.path = path
        self._future = future
        self._finish = finish
        self._release = release
        self._lock = threading.Lock()
        self._finished = False
        self._error: BaseException | None = None
        future.add_done_callback(lambda _f: self._complete())

    def _complete(self) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
            try:
                self._future.result()
                if self._finish is not None:
                    self._finish()
            except BaseException as err:  # surfaced by wait()
                self._error = err
            finally:
                if self._release is not None:
                    self._release()  # the path's save lock (rank 0), published or failed

    def done(self) -> bool:
        """Whether this rank's part is written (and, on rank 0, the checkpoint published).

        Returns:
            True once the background write finished, with or without an error.
        """
        return self._finished

    def wait(self, timeout: float | None = None) -> Path:
        """Block until this rank's part is written (rank 0: and published); return the path.

        Args:
            timeout: seconds to wait at most; None waits as long as it takes.

        Returns:
            The checkpoint's path.

        Raises:
            TimeoutError: ``timeout`` passed first (the write goes on).
            CheckpointError: the background write or the publication failed; the message names
                each failing rank's error (DCP's ``CheckpointException``, a ``BaseException``, an
                ``OSError`` of a full disk ... are its ``__cause__``).
        """
        try:
            self._future.result(timeout)
        except TimeoutError:
            raise  # the write goes on
        except BaseException:  # recorded by _complete (DCP's CheckpointException is a BaseException)
            pass
        self._complete()
        err = self._error
        if err is None:
            return self.path
        if isinstance(err, (CheckpointError, KeyboardInterrupt, SystemExit)):
            raise err
        # DCP's CheckpointException (one entry per failing rank), an OSError of a full disk, ...
        raise CheckpointError(self.path, f"the background save failed: {failure_text(err)}") from err


# One checkpointer per model: the staged host copy is made once and refilled on later saves.
_CHECKPOINTERS: weakref.WeakKeyDictionary[nn.Module, AsyncCheckpointer] = weakref.WeakKeyDictionary()


def checkpointer_of(model: nn.Module) -> AsyncCheckpointer:
    """The :class:`AsyncCheckpointer` that ``save_checkpoint_async`` uses for ``model``.

    Args:
        model: a sharded model (one checkpointer per model, dropped with the model).

    Returns:
        Its checkpointer, made on first use: ``.close()`` it to free the writer's group and the
        host copy of the state before the process group is destroyed.
    """
    if model not in _CHECKPOINTERS:
        _CHECKPOINTERS[model] = AsyncCheckpointer()
    return _CHECKPOINTERS[model]


def _structure(state: Any) -> Any:
    """Keys and tensor shapes of a nested state dict (a cached staging buffer must match them)."""
    if isinstance(state, dict):
        return tuple((k, _structure(v)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return tuple(_structure(v) for v in state)
    return tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__


def save_checkpoint_async(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    state: dict[str, Any] | None = None,
    keep_last: int | None = None,
    mode: AsyncMode = "thread",
) -> AsyncCheckpoint:
    """Start a sharded save of ``model`` (and ``optimizer``, ``state``); call on every rank.

    Returns once the state is staged in host memory; call ``.wait()`` on the result before
    the next save and before the process exits.  The checkpoint is the same as
    :func:`save_checkpoint` ``(kind="sharded")`` writes, and loads with :func:`load_checkpoint`.

    ``mode="process"`` writes in torch's checkpoint process instead of a thread: the training
    process keeps its interpreter to itself while the files are serialised and written, at the
    price of a spawned process per rank (started on the first such save, seconds; it re-imports
    the main module, so a script needs an ``if __name__ == "__main__":`` guard) and a staged copy
    in shared memory.  Same checkpoint, same guarantees.

    Args:
        path: the checkpoint directory to write.
        model: a model returned by :func:`~fsdp_bridge.shard`.
        optimizer: its optimizer, saved too when given.
        state: a JSON-serialisable dict, captured at the call.
        keep_last: after publishing, keep only the K newest checkpoints beside ``path``.
        mode: ``"thread"`` (default) or ``"process"``: where the files are written.

    Returns:
        An :class:`AsyncCheckpoint`; ``.wait()`` returns the published path or raises.

    Raises:
        ValueError: ``mode`` (or another argument) is not allowed; on every rank, before any collective.
        CheckpointError: on every rank, from ``.wait()``, when the save failed on any rank.
    """
    mode = check_mode(mode)
    path = check_save_args(path, keep_last, state)
    # The state as of this call, like the weights: a loop that keeps updating its dict must not
    # publish a step that does not match them (check_state has made sure it is plain JSON).
    state = copy.deepcopy(state)
    checkpointer = checkpointer_of(model)
    checkpointer.wait()  # the save in flight: its staged copy is the buffer this save reuses
    rank, world = rank_world()
    # Every rank learns of a staging failure on any rank here (before new_group, which would hang).
    staging = on_every_rank(path, "creating the staging directory", lambda: fresh_staging(path, rank))
    try:
        checkpointer.pending = _start(
            path,
            model,
            optimizer,
            staging,
            checkpointer,
            state=state,
            keep_last=keep_last,
            rank=rank,
            world=world,
            mode=mode,
        )
        return checkpointer.pending
    except BaseException as err:
        release_save_lock(path)
        if isinstance(err, (CheckpointError, KeyboardInterrupt, SystemExit)) or not isinstance(
            err, (Exception, CheckpointException)
        ):
            raise
        # DCP's planning step shares a failure with every rank as CheckpointException (a BaseException).
        raise CheckpointError(path, f"the save could not start: {failure_text(err)}") from err


def _start(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    staging: Path,
    checkpointer: AsyncCheckpointer,
    *,
    state: dict[str, Any] | None,
    keep_last: int | None,
    rank: int,
    world: int,
    mode: AsyncMode,
) -> AsyncCheckpoint:
    group = checkpointer.group()
    if mode == "process":
        prepare_checkpoint_process()  # one made in an earlier process group is replaced
        checkpointer._used_process = True

    tied = tied_groups(model)
    msd = get_model_state_dict(model)
    to_save: dict[str, Any] = {"model": msd}
    if optimizer is not None:
        with init_step_undone(optimizer, reading=True):
            to_save["optim"] = get_optimizer_state_dict(model, optimizer)
    shapes = shapes_of(msd)
    if mode == "process":
        # Every rank learns of a rank that cannot hold the shared copy, before async_save's collectives.
        on_every_rank(path, "making room for the staged copy", lambda: fit_open_files(to_save))
    write_rng(staging, rank)  # the RNG as of this call, like the weights
    future = dcp.async_save(
        to_save,
        storage_writer=dcp.FileSystemWriter(str(staging / DCP_DIR)),
        # The thread writes on this group; the process mode only uses it to agree on the
        # address of its own group's store (its writes run on that group).
        process_group=group,
        async_checkpointer_type=AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD,
        async_stager=checkpointer.stager(to_save, mode),
    )

    finish = None
    if rank == 0:
        # DCP's finish step gathers every rank's write results before rank 0's future
        # completes, so all files are in place when this runs.
        def finish() -> None:
            describe_and_publish(
                staging,
                path,
                model,
                kind="sharded",
                state=state,
                world=world,
                shapes=shapes,
                tied=tied,
                has_optimizer=optimizer is not None,
                keep_last=keep_last,
            )

    # With a blocking stager, async_save returns a concurrent Future in both modes.
    return AsyncCheckpoint(path, cast("Future[Any]", future), finish, lambda: release_save_lock(path))
