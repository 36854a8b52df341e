"""Starting ranks with PyTorch's elastic launcher (what ``torchrun`` runs): the one launcher of
``fsdp-bridge train`` and ``fsdp-bridge compare``.

:func:`elastic_run` starts ``nproc_per_node`` ranks on this node (meeting other nodes' ranks
through torchrun's c10d rendezvous when ``nnodes > 1``), runs a function in each and returns
their results. Each rank records an exception with its time, so a failure is reported as the
rank that failed first (with its traceback) and the ranks that failed because of it, or as the
rank that stopped answering while the others waited for it. A :class:`ConfigError` a rank finds
is printed once, by rank 0, and every rank exits with code 2.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_bridge.errors import ConfigError, Problem

__all__ = [
    "CONFIG_ERROR_EXIT",
    "PROGRESS_ENV",
    "LaunchFailed",
    "LaunchInterrupted",
    "LaunchOptions",
    "elastic_run",
    "env_from_slurm",
    "existing_launch",
    "first_slurm_host",
    "mark_progress",
    "node_rank_problems",
    "record_failure",
    "restart_count",
    "slurm_rank_env",
]

CONFIG_ERROR_EXIT = 2


@dataclass(frozen=True)
class LaunchOptions:
    """How many ranks to start and where they meet (torchrun's flags of the same names)."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int | None = None
    """This node's index in ``0..nnodes-1`` (None: let the rendezvous decide).  With the c10d
    rendezvous, node 0 hosts the rendezvous store at ``rdzv_endpoint`` (so the endpoint must be
    node 0's address) and the others connect to it; the global ranks are still assigned by the
    rendezvous.  With the static rendezvous it is the node's group rank, as in torchrun."""
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_backend: str = "c10d"
    max_restarts: int = 0
    """Restarts of every rank after one dies; each restart resumes from the latest checkpoint."""


def node_rank_problems(node_rank: int | None, nnodes: int) -> list[Problem]:
    """What is wrong with ``--node-rank`` for ``--nnodes`` (empty: nothing)."""
    if node_rank is None or 0 <= node_rank < nnodes:
        return []
    fix = (
        (
            "number the nodes from 0: --node-rank 0 on the node at --rdzv-endpoint, "
            f"1 .. {nnodes - 1} on the others (or drop --node-rank)"
        )
        if nnodes > 1
        else "drop --node-rank on one node, or pass --nnodes N (and --rdzv-endpoint, --rdzv-id) on each of N nodes"
    )
    return [Problem("--node-rank", node_rank, f"0 .. {nnodes - 1} (one below --nnodes {nnodes})", fix)]


def existing_launch(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is already one rank of a launch that set up the ranks.

    The rules (``env`` defaults to ``os.environ``):

    - ``RANK`` and ``WORLD_SIZE`` set: torchrun, Kubeflow's PyTorchJob, TorchX, Ray Train
      (which also initialises the default process group itself) or any launcher that exports
      torch's ``env://`` variables;
    - ``SLURM_PROCID`` with ``SLURM_NTASKS`` > 1 and no ``RANK``: one ``srun`` task per rank
      (:func:`slurm_rank_env` maps SLURM's variables to torch's).

    A process group that is already initialised is joined whatever the environment says
    (:func:`fsdp_bridge.distributed.init_distributed`).
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return True
    return "SLURM_PROCID" in env and _int(env.get("SLURM_NTASKS"), 1) > 1


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def first_slurm_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list (``gpu[03-04,07],cpu1`` -> ``gpu03``), None if empty.

    The same host ``scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1`` prints, without
    running ``scontrol``: the first name of the list, with each bracketed range replaced by its
    first value (zero padding kept).
    """
    host, depth = "", 0
    for char in nodelist.strip():
        if char == "," and depth == 0:
            break
        depth += (char == "[") - (char == "]")
        host += char
    while "[" in host and "]" in host:
        head, _, rest = host.partition("[")
        ranges, _, tail = rest.partition("]")
        host = head + ranges.split(",")[0].split("-")[0] + tail
    return host or None


def _tasks_on_node(tasks_per_node: str, node: int) -> int | None:
    """Tasks on node ``node`` from SLURM's ``2(x3),1`` notation (None if it cannot be read)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        value, _, times = part.partition("(x")
        try:
            counts += [int(value)] * (int(times.rstrip(")")) if times else 1)
        except ValueError:
            return None
    return counts[node] if 0 <= node < len(counts) else None


def slurm_rank_env(env: Mapping[str, str]) -> dict[str, str]:
    """torch's ``env://`` variables for an ``srun`` task, from SLURM's (empty: nothing to add).

    Only for a task of an ``srun`` with more than one task and no ``RANK``/``WORLD_SIZE`` of its
    own (torchrun under srun sets those: they win). ``RANK`` = ``SLURM_PROCID``, ``WORLD_SIZE`` =
    ``SLURM_NTASKS``, ``LOCAL_RANK`` = ``SLURM_LOCALID``, ``LOCAL_WORLD_SIZE`` = this node's tasks;
    ``MASTER_ADDR``, only where unset, = ``SLURM_LAUNCH_NODE_IPADDR`` (the node srun ran on), else
    the first host of ``SLURM_STEP_NODELIST``/``SLURM_JOB_NODELIST``; ``MASTER_PORT``, only where
    unset, = 29500.

    Raises:
        ConfigError: no ``MASTER_ADDR`` and nothing to derive it from.
    """
    if ("RANK" in env and "WORLD_SIZE" in env) or not existing_launch(env):
        return {}
    tasks = _int(env.get("SLURM_NTASKS"), 1)
    nodes = max(1, _int(env.get("SLURM_NNODES"), 1))
    node = _int(env.get("SLURM_NODEID"), 0)
    per_node = _tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")), node)
    added = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": str(tasks),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(per_node if per_node is not None else max(1, tasks // nodes)),
    }
    if "MASTER_ADDR" not in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        addr = env.get("SLURM_LAUNCH_NODE_IPADDR") or first_slurm_host(nodelist)
        if not addr:
            raise ConfigError(
                [
                    Problem(
                        "MASTER_ADDR",
                        None,
                        "the address of the node that runs rank 0 (unset, and SLURM gave neither "
                        "SLURM_LAUNCH_NODE_IPADDR nor a node list)",
                        "export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1) "
                        "in the sbatch script (see examples/hsdp_2x8.sbatch)",
                    )
                ]
            )
        added["MASTER_ADDR"] = addr
    if "MASTER_PORT" not in env:
        added["MASTER_PORT"] = "29500"
    return {k: v for k, v in added.items() if k not in env or k in ("RANK", "WORLD_SIZE")}


def env_from_slurm() -> None:
    """Set torch's ``env://`` variables from SLURM's in an ``srun`` task (:func:`slurm_rank_env`)."""
    os.environ.update(slurm_rank_env(os.environ))


PROGRESS_ENV = "FSDP_BRIDGE_PROGRESS_DIR"
"""Set by :func:`run_rank` for the launched ranks: where :func:`mark_progress` writes."""


def mark_progress(step: int) -> None:
    """Record that this rank started ``step`` (one small file per rank, read by the launcher
    when the job fails, to name a rank that stopped answering)."""
    directory = os.environ.get(PROGRESS_ENV)
    if directory:
        rank = os.environ.get("RANK", "0")
        record = {"step": step, "time": time.time(), "attempt": restart_count()}
        with contextlib.suppress(OSError):
            Path(directory, f"progress{rank}.json").write_text(json.dumps(record))


def restart_count() -> int:
    """How many times the elastic agent has restarted this job's ranks (0 on the first attempt)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def record_failure() -> None:
    """Record the exception being handled on this launched rank, with its time (call it in an
    ``except`` block before any cleanup that can wait on the other ranks, so the first failure is
    told from the failures it caused). The first record of a rank and attempt is kept."""
    directory = os.environ.get(PROGRESS_ENV)
    if not directory:
        return
    rank, attempt = int(os.environ.get("RANK", "0")), restart_count()
    path = Path(directory) / f"rank{rank}-attempt{attempt}.json"
    if path.exists():
        return
    failure = {"time": time.time(), "rank": rank, "attempt": attempt, "traceback": traceback.format_exc()}
    with contextlib.suppress(OSError):
        path.write_text(json.dumps(failure))


def _read_failures(failure_dir: Path) -> list[dict[str, Any]]:
    failures = []
    for path in failure_dir.glob("rank*.json"):
        try:
            failures.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return failures


def _restarts_note(failure_dir: Path, restarts: int, name: str) -> str | None:
    """What earlier attempts died of, for a job the elastic agent restarted."""
    firsts: dict[int, dict[str, Any]] = {}
    for f in sorted(_read_failures(failure_dir), key=lambda f: f["time"]):
        firsts.setdefault(int(f.get("attempt", 0)), f)
    if not firsts:
        return None
    lines = [
        f"attempt {a}: rank {f['rank']} failed ({str(f['traceback']).strip().splitlines()[-1]})"
        for a, f in sorted(firsts.items())
    ]
    return (
        f"fsdp-bridge {name}: restarted {len(firsts)} time(s) of --max-restarts {restarts}"
        + (", each from the latest checkpoint; " if name == "train" else "; ")
        + "; ".join(lines)
    )


_WAITED = ("timed out", "timeout", "connection reset", "connection closed", "broken pipe")
"""How a collective that waited for a silent peer ends, in gloo's and NCCL's errors."""


def _silent_ranks(failure_dir: Path, failed: set[int], first_traceback: str, attempt: int) -> str | None:
    """A sentence naming the ranks that stopped answering, when the ranks that failed did so
    waiting for them: they started this attempt's training (progress recorded) but never raised."""
    if not any(w in first_traceback.lower() for w in _WAITED):
        return None
    progress: dict[int, dict[str, float]] = {}
    for path in failure_dir.glob("progress*.json"):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            if int(record.get("attempt", 0)) == attempt:
                progress[int(path.stem.removeprefix("progress"))] = record
    silent = sorted(set(progress) - failed)
    if not silent:
        return None
    now = time.time()
    seen = "; ".join(
        f"rank {r} last started step {int(progress[r]['step'])}, {now - progress[r]['time']:.0f} s before the job ended"
        for r in silent
    )
    waiting = ", ".join(str(r) for r in sorted(failed))
    return (
        f"rank {', '.join(map(str, silent))} stopped answering ({seen}); rank {waiting} failed waiting for it "
        "in a collective. Look at what that rank was doing (a data loader, a deadlock, a slow file system); "
        "timeout_s sets how long the others wait."
    )


def _root_cause(failure_dir: Path) -> tuple[int, str, list[int], int] | None:
    """(first failed rank, its traceback, the ranks that failed after it, the attempt), from the
    failures recorded in the last attempt."""
    failures = _read_failures(failure_dir)
    if not failures:
        return None
    last = max(int(f.get("attempt", 0)) for f in failures)
    failures = sorted((f for f in failures if int(f.get("attempt", 0)) == last), key=lambda f: f["time"])
    first = failures[0]
    return int(first["rank"]), str(first["traceback"]), sorted(int(f["rank"]) for f in failures[1:]), last


class LaunchInterrupted(Exception):
    """SIGTERM/SIGINT reached the launcher; torch's agent passed it on to the ranks."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


class LaunchFailed(Exception):
    """Ranks failed. ``codes``: their exit codes; ``explanation``: which rank failed first and why
    (None when the ranks left no Python exception, e.g. a signal, or a ConfigError rank 0 printed)."""

    def __init__(self, codes: set[int], ranks: list[int], explanation: str | None) -> None:
        super().__init__(explanation or f"rank {', '.join(map(str, ranks))} failed (exit codes {sorted(codes)})")
        self.codes, self.ranks, self.explanation = codes, ranks, explanation


def _entry(fn: Callable[..., Any], args: tuple[Any, ...], name: str, failure_dir: str) -> Any:
    """What each launched rank runs (module level: it is pickled into spawned processes)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_recorded)(fn, args, name, failure_dir)


def _recorded(fn: Callable[..., Any], args: tuple[Any, ...], name: str, failure_dir: str) -> Any:
    os.environ[PROGRESS_ENV] = failure_dir
    try:
        return fn(*args)
    except ConfigError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"fsdp-bridge {name}: {err}", file=sys.stderr, flush=True)
        sys.exit(CONFIG_ERROR_EXIT)
    except SystemExit:
        raise
    except BaseException:
        record_failure()
        raise


def elastic_run(
    fn: Callable[..., Any], args: tuple[Any, ...], options: LaunchOptions, *, name: str, verbosity: str = "normal"
) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``options.nproc_per_node`` new ranks of this node; return each local
    rank's result. ``fn`` must be importable (module level). The ranks set up their own process
    group from the environment (``fsdp_bridge.init_distributed``).

    Raises:
        ConfigError: the launch options are inconsistent (checked before anything starts).
        LaunchInterrupted: SIGTERM/SIGINT reached the launcher.
        LaunchFailed: ranks failed; its ``explanation`` names the rank that failed first.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    problems = node_rank_problems(options.node_rank, options.nnodes)
    if problems:
        raise ConfigError(problems)
    if options.nnodes > 1 and not options.rdzv_endpoint:
        raise ConfigError(
            [
                Problem(
                    "--rdzv-endpoint",
                    None,
                    "HOST:PORT of the first node when --nnodes > 1",
                    "e.g. --rdzv-endpoint $MASTER_ADDR:29500 (see examples/hsdp_2x8.sbatch)",
                )
            ]
        )
    run_id = options.rdzv_id or os.environ.get("SLURM_JOB_ID")
    if options.nnodes > 1 and not run_id:
        raise ConfigError(
            [
                Problem(
                    "--rdzv-id",
                    None,
                    "the same job id on every node when --nnodes > 1",
                    "pass --rdzv-id $SLURM_JOB_ID (or any string shared by the nodes)",
                )
            ]
        )
    if verbosity != "verbose":
        logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)  # its shutdown notices: -v
    # torchrun's default is 1 thread per rank; on CPU share the cores instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // options.nproc_per_node)))
    rdzv_configs: dict[str, Any] = {}
    if options.node_rank is not None:
        if options.rdzv_backend == "static":
            rdzv_configs["rank"] = options.node_rank
        elif options.rdzv_backend == "c10d":
            # Without it, every agent whose host name matches the endpoint tries to host the
            # store (and all but one fall back to a client): node 0 hosts it, by rank not by race.
            rdzv_configs["is_host"] = options.node_rank == 0
    launch_config = LaunchConfig(
        min_nodes=options.nnodes,
        max_nodes=options.nnodes,
        nproc_per_node=options.nproc_per_node,
        run_id=run_id or f"fsdp-bridge-{uuid.uuid4().hex[:8]}",
        rdzv_backend=options.rdzv_backend,
        rdzv_endpoint=options.rdzv_endpoint or "localhost:0",
        rdzv_configs=rdzv_configs,
        max_restarts=options.max_restarts,
        start_method="spawn",
    )
    with tempfile.TemporaryDirectory(prefix=f"fsdp-bridge-{name}-failures-") as failure_dir, _own_signal_handlers():
        try:
            values = elastic_launch(launch_config, _entry)(fn, args, name, failure_dir)
        except SignalException as err:
            raise LaunchInterrupted(int(err.sigval)) from None
        except ChildFailedError as err:
            codes = {f.exitcode for f in err.failures.values()}
            raise LaunchFailed(codes, sorted(err.failures), _explain(Path(failure_dir), name)) from None
        note = _restarts_note(Path(failure_dir), options.max_restarts, name) if options.max_restarts else None
        if note is not None:
            print(note, file=sys.stderr)
    return dict(values)


@contextlib.contextmanager
def _own_signal_handlers() -> Iterator[None]:
    """Put back the caller's signal handlers: torch's launcher installs its own for SIGTERM, SIGINT,
    SIGHUP and SIGQUIT (to stop the ranks) and leaves them, which a caller in the same process
    (a test, a notebook) would otherwise keep."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in names if hasattr(signal, n))}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def _explain(failure_dir: Path, name: str) -> str | None:
    cause = _root_cause(failure_dir)
    if cause is None:  # killed without a Python exception (e.g. a signal), or a ConfigError
        return None
    rank, tb, after, attempt = cause
    silent = _silent_ranks(failure_dir, {rank, *after}, tb, attempt)
    if silent is not None:
        last = tb.rstrip().splitlines()[-1] if tb.strip() else ""
        return f"fsdp-bridge {name}: {silent} Rank {rank}'s error: {last}"
    then = f"; rank {', '.join(map(str, after))} failed after it" if after else ""
    return f"fsdp-bridge {name}: rank {rank} failed first{then}. Rank {rank}'s traceback:\n{tb.rstrip()}"
