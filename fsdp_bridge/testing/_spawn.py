"""Run a function on N ranks in spawned processes (gloo on CPU, NCCL when asked).

    from fsdp_bridge.testing import run_distributed
    results = run_distributed(my_fn, world_size=2, args=(config,))   # one result per rank

``my_fn`` must be importable (a module-level function).  If any rank raises, the
others are stopped at once and :class:`RankFailure` carries every failing rank's
traceback; a run past ``timeout_s`` is killed and reported the same way, so a test
never hangs.  A gloo rendezvous whose connections break before the function ran on any rank
(a peer closing or resetting while the ranks connect, seen on loaded machines under parallel
test runs) is started again, up to three times in all, within the same ``timeout_s``.

Where the platform has it (Linux), gloo ranks are forked from a ``multiprocessing`` fork server
that imported torch (and the modules in ``preload``) once, instead of each rank importing
them again: a rank of a tiny CPU job starts in well under a second rather than several.
The fork server is started once per process and imports nothing but modules, so no thread
or process group exists when it forks.  Each rank still gets the caller's current
environment (multiprocessing passes the working directory, ``sys.path`` and ``__main__``),
as a freshly spawned one would.

Shared by ``fsdp-bridge compare`` and :mod:`fsdp_bridge.testing` (which re-exports it).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["RankFailure", "run_distributed"]

# Imported once by the fork server (a missing one is skipped).  What a rank of an FSDP job
# imports anyway: torch's distributed and FSDP packages, DCP, this package's core, and
# transformers' model base (every Hugging Face model imports it).
DEFAULT_PRELOAD: tuple[str, ...] = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "transformers.modeling_utils",
    "fsdp_bridge.api",
    "fsdp_bridge.checkpoint",
)


class RankFailure(RuntimeError):
    """One or more ranks failed; ``failures`` maps rank -> traceback text."""

    def __init__(self, failures: dict[int, str], world_size: int) -> None:
        self.failures = dict(sorted(failures.items()))
        parts = [f"{len(self.failures)} of {world_size} ranks failed:"]
        for rank, tb in self.failures.items():
            parts.append(f"--- rank {rank} ---\n{tb.rstrip()}")
        super().__init__("\n".join(parts))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _context(preload: Sequence[str], backend: str) -> Any:
    """The fork server where there is one (imports ``preload`` once), else spawn.

    NCCL ranks are spawned: a CUDA process must not be forked from one that may have touched the
    driver, and the GPU path is the one measured on real GPUs."""
    if backend == "nccl" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Only read when the server starts (the first call in this process); later calls reuse it.
    ctx.set_forkserver_preload(list(dict.fromkeys([*DEFAULT_PRELOAD, *preload])))
    return ctx


def _default_threads(world_size: int) -> int:
    """The caller's ``OMP_NUM_THREADS`` when it is a positive integer, else the cores shared out.

    More threads than cores to spare is far slower, not faster, for small CPU jobs: with two
    busy-waiting OpenMP threads on a loaded 2-core machine, 10 steps of a tiny model took 15 s
    instead of 0.05 s."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) >= 1:
        return int(value)
    return max(1, (os.cpu_count() or 1) // world_size)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    store_path: str,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    parent_env: dict[str, str],
    backend: str,
    results: Any,
    threads: int,
    env: dict[str, str],
) -> None:
    # The caller's environment as it is now (a fork server's is the one from when it started).
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(threads),
    )
    started = False  # set once the process group is up: a failure before it is the rendezvous's
    # A crash in native code (a segfault) reports nothing through ``results``: Python's stack of every
    # thread at the fault goes to a file beside the rendezvous store, read back into the failure.
    try:
        fault_file = open(_fault_path(store_path, rank), "w")  # open for the process's life
        faulthandler.enable(file=fault_file, all_threads=True)
    except OSError:  # no stack for a crash, then; everything else is reported as before
        pass
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        # Rendezvous through a file, not a TCP port picked in advance: another process could
        # take that port between the pick and the bind (EADDRINUSE under parallel test runs).
        dist.init_process_group(
            backend=backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
        if backend == "gloo":
            # Every rank's connections are up before any rank runs ``fn``: a rank whose peer lost the
            # rendezvous must not go on alone (its result would stop the rendezvous from being retried).
            dist.barrier()
        started = True
        try:
            value = fn(*args, **kwargs)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # report everything, including SystemExit/KeyboardInterrupt
        text = traceback.format_exc()
        results.put((rank, False, text if started else _RENDEZVOUS + text))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    threads_per_rank: int | None = None,
    env: dict[str, str] | None = None,
    preload: Sequence[str] = (),
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result, by rank.

    Each rank has the default process group initialised (``backend``: gloo, or nccl
    for one GPU per rank) and torchrun's environment variables set.

    Args:
        fn: a module-level (importable) function; it, ``args`` and ``kwargs`` must pickle.
        world_size: number of ranks, >= 1.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
        timeout_s: the whole run is killed and reported after this many seconds.
        threads_per_rank: torch threads per rank (default: the caller's ``OMP_NUM_THREADS``
            when set, as torchrun keeps it; else CPU count / world size).
        env: environment variables set in every rank on top of the caller's.
        preload: modules the fork server imports once besides :data:`DEFAULT_PRELOAD`;
            only the first call in a process starts the server, so later calls' lists
            cost nothing and gain nothing (ranks import what they need either way).

    Returns:
        ``fn``'s return value from each rank, ordered by rank.

    Raises:
        ValueError: ``world_size`` < 1.
        RankFailure: a rank raised, crashed or the run timed out (a gloo rendezvous that
            broke before ``fn`` ran is retried first); carries every failing rank's traceback.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context(preload, backend)
    port = _free_port()  # only exported as MASTER_PORT for code that reads it
    threads = threads_per_rank or _default_threads(world_size)
    deadline = time.monotonic() + timeout_s
    spec = (fn, tuple(args), dict(kwargs or {}), backend, threads, dict(env or {}))
    for attempt in range(1, _RENDEZVOUS_ATTEMPTS + 1):
        values, failures = _attempt(ctx, world_size, port, spec, deadline, timeout_s)
        if not failures:
            return [values[r] for r in range(world_size)]
        # Retry only a gloo rendezvous that broke before ``fn`` ran on any rank (a peer's
        # connection closed or reset while the ranks connected: seen under parallel test runs).
        retry = backend == "gloo" and not values and all(_lost_rendezvous(t) for t in failures.values())
        if not retry or attempt == _RENDEZVOUS_ATTEMPTS or time.monotonic() >= deadline:
            break
    raise RankFailure(failures, world_size)


# A failure text that starts with this came from ``init_process_group``, before ``fn`` ran.
_RENDEZVOUS = "(while the ranks connected, before the function ran)\n"
_RENDEZVOUS_ATTEMPTS = 3
_CONNECTION_LOST = ("Connection closed by peer", "Connection reset by peer", "Connection refused")


def _fault_path(store_path: str, rank: int) -> str:
    return f"{store_path}.fault{rank}"


def _crash_text(exitcode: int | None, store_path: str, rank: int) -> str:
    """What a rank that died without reporting left: its exit code and, after a fatal signal, the
    Python stack faulthandler wrote for each of its threads."""
    text = f"process exited with code {exitcode} without reporting"
    try:
        with open(_fault_path(store_path, rank)) as f:
            stack = f.read().strip()
    except OSError:
        stack = ""
    return f"{text}\n{stack}" if stack else text


def _lost_rendezvous(text: str) -> bool:
    return text.startswith(_RENDEZVOUS) and any(m in text for m in _CONNECTION_LOST)


def _attempt(
    ctx: Any, world_size: int, port: int, spec: tuple[Any, ...], deadline: float, timeout_s: float
) -> tuple[dict[int, Any], dict[int, str]]:
    """One start of every rank (its own rendezvous file); each rank's value, and each failure."""
    fn, args, kwargs, backend, threads, env = spec
    results = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="fsdp-bridge-store-")
    store_path = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                rank,
                world_size,
                port,
                store_path,
                fn,
                args,
                kwargs,
                dict(os.environ),
                backend,
                results,
                threads,
                env,
            ),
            # Not daemonic: a rank may start processes of its own (torch's checkpoint process for
            # process-based async saves); the finally below kills and joins every rank anyway.
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        while len(values) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                for rank in range(world_size):
                    if rank not in values and rank not in failures:
                        failures[rank] = f"timed out after {timeout_s:.0f} s (still running: killed)"
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in values and r not in failures
                ]
                for r in dead:
                    failures[r] = _crash_text(procs[r].exitcode, store_path, r)
                if failures:
                    # Give ranks that are about to report a moment, then stop the rest.
                    _drain(results, values, failures, grace_s=2.0)
                    break
                continue
            (values if ok else failures)[rank] = value
            if failures:
                _drain(results, values, failures, grace_s=2.0)
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        if failures:
            # A rank that crashed (e.g. a segfault) sends nothing: name it beside the ranks that did report.
            for r, p in enumerate(procs):
                if r not in values and r not in failures and p.exitcode not in (None, 0) and p.exitcode != -9:
                    failures[r] = _crash_text(p.exitcode, store_path, r)
        shutil.rmtree(store_dir, ignore_errors=True)
    return values, failures


def _drain(results: Any, values: dict[int, Any], failures: dict[int, str], *, grace_s: float) -> None:
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        try:
            rank, ok, value = results.get(timeout=max(0.0, end - time.monotonic()))
        except queue.Empty:
            return
        (values if ok else failures)[rank] = value
