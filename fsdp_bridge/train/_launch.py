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

import json
import os
import shlex
import signal
import sys
from typing import Any

from fsdp_bridge._launch import (
    CONFIG_ERROR_EXIT,
    LaunchFailed,
    LaunchInterrupted,
    LaunchOptions,
    elastic_run,
    env_from_slurm,
    existing_launch,
    mark_progress,
    node_rank_problems,
    record_failure,
    restart_count,
)
from fsdp_bridge.errors import ConfigError
from fsdp_bridge.train._rundir import local_dir

__all__ = [
    "LaunchOptions",
    "existing_launch",
    "launch",
    "mark_progress",
    "node_rank_problems",
    "restart_count",
    "run_rank",
]


def run_rank(config_dict: dict[str, Any], verbosity: str, launched: bool = False) -> int:
    """Train as one rank of the current launch; return the exit code (0, or 2 for a ConfigError).

    ``launched``: started by :func:`launch` (whose launcher records a failure and reports a
    stop by signal); otherwise (torchrun, srun) a stop is reported here.
    """
    import torch
    import torch.distributed as dist

    from fsdp_bridge.train._config import TrainConfig
    from fsdp_bridge.train._loop import RunStopped, train

    rank = int(os.environ.get("RANK", "0"))
    attempt = restart_count()
    if attempt:
        # Restarted by the elastic agent after a rank died: carry on from the latest checkpoint.
        config_dict = {**config_dict, "resume": "auto"}
    try:
        env_from_slurm()
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
        if not launched and rank == 0:  # launched by torchrun or srun: say it here
            print(stopped_message(config_dict["output_dir"]), file=sys.stderr, flush=True)
        return 128 + stop.signum
    except BaseException:
        record_failure()  # before destroy_process_group, which can wait for the other ranks
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def stopped_message(output_dir: str) -> str:
    """One line: where a signal stopped the run and the command that resumes it."""
    from fsdp_bridge.train._loop import STOPPED

    try:
        info = json.loads((local_dir(output_dir) / STOPPED).read_text())
    except (OSError, ValueError):
        return "fsdp-bridge train: stopped by a signal before a checkpoint was written"
    argv = [a for a in sys.argv[1:] if a != "--resume"]
    command = shlex.join(["fsdp-bridge", *argv, "--resume"])
    return (
        f"fsdp-bridge train: stopped by {info['signal']} at step {info['step']} of {info['max_steps']}; "
        f"checkpoint {info['checkpoint']}. Resume with: {command}"
    )


def _train_rank(config_dict: dict[str, Any], verbosity: str) -> None:
    """What each rank :func:`launch` starts runs (module level: pickled into spawned processes)."""
    code = run_rank(config_dict, verbosity, launched=True)
    if code:
        sys.exit(code)


def launch(config_dict: dict[str, Any], options: LaunchOptions, *, verbosity: str) -> int:
    """Start the ranks of this node with the elastic launcher; return the job's exit code."""
    from fsdp_bridge.train._loop import STOPPED

    stopped = local_dir(config_dict["output_dir"]) / STOPPED
    stopped.unlink(missing_ok=True)
    try:
        elastic_run(_train_rank, (config_dict, verbosity), options, name="train", verbosity=verbosity)
    except LaunchInterrupted as err:
        # SIGTERM/SIGINT reached the launcher: torch's agent passes it on to the ranks,
        # which stop together at the next step boundary and save (within its 30 s wait).
        print(stopped_message(config_dict["output_dir"]), file=sys.stderr)
        return 128 + err.signum
    except LaunchFailed as err:
        if err.codes == {CONFIG_ERROR_EXIT}:
            return CONFIG_ERROR_EXIT  # rank 0 printed the problems
        if stopped.exists() and err.codes <= {128 + int(signal.SIGTERM), 128 + int(signal.SIGINT)}:
            print(stopped_message(config_dict["output_dir"]), file=sys.stderr)  # ranks signalled directly
            return max(err.codes)
        if err.explanation is None:  # killed without a Python exception (e.g. a signal)
            print(
                f"fsdp-bridge train: rank {', '.join(map(str, err.ranks))} failed (exit code "
                f"{', '.join(map(str, sorted(err.codes)))}); see the log above",
                file=sys.stderr,
            )
            return 1
        print(err.explanation, file=sys.stderr)
        return 1
    return 0
