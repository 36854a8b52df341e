"""Starting the ranks: PyTorch's elastic launcher (what ``torchrun`` runs), or an existing launch.

- Inside ``torchrun`` (``RANK``/``WORLD_SIZE`` set) or an ``srun`` with one task per
  rank (``SLURM_PROCID``/``SLURM_NTASKS``, ``MASTER_ADDR`` exported by the batch
  script), this process is one rank: it trains in place.
- Otherwise ``torch.distributed.launcher.api.elastic_launch`` starts
  ``nproc_per_node`` ranks here; with ``nnodes > 1`` they meet the other nodes'
  ranks through torchrun's c10d rendezvous (``rdzv_endpoint``, ``rdzv_id``).

The configuration is validated by the caller before any process is started; a
:class:`ConfigError` a rank finds later (e.g. data too short) is printed once, by
rank 0, and every rank exits with code 2.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_bridge.errors import ConfigError, Problem

__all__ = ["LaunchOptions", "existing_launch", "launch", "node_rank_problems", "run_rank"]

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


def existing_launch(env: dict[str, str] | None = None) -> bool:
    """Whether this process is already one rank of a launch (torchrun, or srun with a task per rank)."""
    env = dict(os.environ) if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return True
    return "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1


def _env_from_slurm() -> None:
    """Set torchrun's variables from SLURM's when srun started one task per rank."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env:
        return
    if "MASTER_ADDR" not in env:
        raise ConfigError(
            [
                Problem(
                    "MASTER_ADDR",
                    None,
                    "the host name of the first node of the job",
                    "export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1) "
                    "in the sbatch script (see examples/hsdp_2x8.sbatch)",
                )
            ]
        )
    tasks, nodes = int(env["SLURM_NTASKS"]), int(env.get("SLURM_NNODES", "1"))
    env.update(
        RANK=env["SLURM_PROCID"],
        WORLD_SIZE=str(tasks),
        LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
        LOCAL_WORLD_SIZE=env.get("SLURM_NTASKS_PER_NODE", str(tasks // max(1, nodes))).split("(")[0],
    )
    env.setdefault("MASTER_PORT", "29500")


def run_rank(config_dict: dict[str, Any], verbosity: str, failure_dir: str | None = None) -> int:
    """Train as one rank of the current launch; return the exit code (0, or 2 for a ConfigError).

    With ``failure_dir`` (set by :func:`launch`), an exception is also recorded there with
    its time, so the launcher can tell the rank that failed first from the ranks that
    failed because it did (a peer's crash surfaces in the others as a collective error).
    """
    import torch
    import torch.distributed as dist

    from fsdp_bridge.train._config import TrainConfig
    from fsdp_bridge.train._loop import RunStopped, train

    rank = int(os.environ.get("RANK", "0"))
    if failure_dir is not None:
        os.environ[PROGRESS_ENV] = failure_dir
    attempt = restart_count()
    if attempt:
        # Restarted by the elastic agent after a rank died: carry on from the latest checkpoint.
        config_dict = {**config_dict, "resume": "auto"}
    try:
        _env_from_slurm()
        rank = int(os.environ.get("RANK", "0"))
        if attempt and rank == 0 and verbosity != "quiet":
            print(
                f"fsdp-bridge train: restart {attempt}: resuming from the latest checkpoint in "
                f"{config_dict['output_dir']}",
                file=sys.stderr,
                flush=True,
            )
        if "OMP_NUM_THREADS" not in os.environ:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        train(TrainConfig.from_dict(config_dict), verbosity=verbosity)  # type: ignore[arg-type]
        return 0
    except ConfigError as err:
        if rank == 0:
            print(f"fsdp-bridge train: {err}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT
    except RunStopped as stop:
        if failure_dir is None and rank == 0:  # launched by torchrun or srun: say it here
            print(stopped_message(config_dict["output_dir"]), file=sys.stderr, flush=True)
        return 128 + stop.signum
    except BaseException:
        if failure_dir is not None:
            _record_failure(Path(failure_dir), rank)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def stopped_message(output_dir: str) -> str:
    """One line: where a signal stopped the run and the command that resumes it."""
    from fsdp_bridge.train._loop import STOPPED

    try:
        info = json.loads((Path(output_dir) / STOPPED).read_text())
    except (OSError, ValueError):
        return "fsdp-bridge train: stopped by a signal before a checkpoint was written"
    argv = [a for a in sys.argv[1:] if a != "--resume"]
    command = shlex.join(["fsdp-bridge", *argv, "--resume"])
    return (
        f"fsdp-bridge train: stopped by {info['signal']} at step {info['step']} of {info['max_steps']}; "
        f"checkpoint {info['checkpoint']}. Resume with: {command}"
    )


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


def _record_failure(failure_dir: Path, rank: int) -> None:
    attempt = restart_count()
    failure = {"time": time.time(), "rank": rank, "attempt": attempt, "traceback": traceback.format_exc()}
    (failure_dir / f"rank{rank}-attempt{attempt}.json").write_text(json.dumps(failure))


def _read_failures(failure_dir: Path) -> list[dict[str, Any]]:
    failures = []
    for path in failure_dir.glob("rank*.json"):
        try:
            failures.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return failures


def _restarts_note(failure_dir: Path, restarts: int) -> str | None:
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
        f"fsdp-bridge train: restarted {len(firsts)} time(s) of --max-restarts {restarts}, each from the latest "
        "checkpoint; " + "; ".join(lines)
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


def _elastic_entry(config_dict: dict[str, Any], verbosity: str, failure_dir: str) -> None:
    """What each launched rank runs (module level: it is pickled into spawned processes)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    code = record(run_rank)(config_dict, verbosity, failure_dir)
    if code:
        sys.exit(code)


def launch(config_dict: dict[str, Any], options: LaunchOptions, *, verbosity: str) -> int:
    """Start the ranks of this node with the elastic launcher; return the job's exit code."""
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
    from fsdp_bridge.train._loop import STOPPED

    stopped = Path(config_dict["output_dir"]) / STOPPED
    stopped.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="fsdp-bridge-failures-") as failure_dir:
        try:
            elastic_launch(launch_config, _elastic_entry)(config_dict, verbosity, failure_dir)
        except SignalException as err:
            # SIGTERM/SIGINT reached the launcher: torch's agent passes it on to the ranks,
            # which stop together at the next step boundary and save (within its 30 s wait).
            print(stopped_message(config_dict["output_dir"]), file=sys.stderr)
            return 128 + int(err.sigval)
        except ChildFailedError as err:
            codes = {f.exitcode for f in err.failures.values()}
            if codes == {CONFIG_ERROR_EXIT}:
                return CONFIG_ERROR_EXIT  # rank 0 printed the problems
            if stopped.exists() and codes <= {128 + int(signal.SIGTERM), 128 + int(signal.SIGINT)}:
                print(stopped_message(config_dict["output_dir"]), file=sys.stderr)  # ranks signalled directly
                return max(codes)
            cause = _root_cause(Path(failure_dir))
            if cause is None:  # killed without a Python exception (e.g. a signal)
                ranks = ", ".join(str(r) for r in sorted(err.failures))
                print(
                    f"fsdp-bridge train: rank {ranks} failed (exit code {', '.join(map(str, sorted(codes)))}); "
                    "see the log above",
                    file=sys.stderr,
                )
                return 1
            rank, tb, after, attempt = cause
            silent = _silent_ranks(Path(failure_dir), {rank, *after}, tb, attempt)
            if silent is not None:
                last = tb.rstrip().splitlines()[-1] if tb.strip() else ""
                print(f"fsdp-bridge train: {silent} Rank {rank}'s error: {last}", file=sys.stderr)
                return 1
            then = f"; rank {', '.join(map(str, after))} failed after it" if after else ""
            print(
                f"fsdp-bridge train: rank {rank} failed first{then}. Rank {rank}'s traceback:\n{tb.rstrip()}",
                file=sys.stderr,
            )
            return 1
        note = _restarts_note(Path(failure_dir), options.max_restarts) if options.max_restarts else None
        if note is not None:
            print(note, file=sys.stderr)
    return 0
