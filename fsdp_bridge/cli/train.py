"""``fsdp-bridge train [CONFIG.yaml] [key=value ...] [--nproc-per-node N] [--backend fsdp1|fsdp2] [--resume]``

Trains the model described by one YAML file.  Without a config it runs the built-in
job: a tiny Llama-style model on the small English corpus shipped with the package,
2 ranks on CPU, under 30 seconds on 2 cores.  ``key=value`` overrides use dotted keys
(``optim.lr=1e-3 bridge.strategy=shard_grad_op max_steps=20``).

The config is checked completely before any process starts.  The ranks are started
with PyTorch's elastic launcher (what torchrun runs); inside an existing launch
(torchrun, or srun with one task per rank) this process is one rank.  Multi-node:
run it once per node with --nnodes, --node-rank, --rdzv-endpoint and --rdzv-id
(torchrun's rendezvous flags), e.g. from srun in an sbatch script (examples/hsdp_2x8.sbatch).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.strategy import Backend


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "train",
        help="train a model from one YAML file (default: a tiny built-in CPU job)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "items",
        nargs="*",
        metavar="[CONFIG.yaml] [key=value ...]",
        help="a training YAML (default: the built-in tiny job), then dotted key=value overrides",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="ranks to start on this node (default: one per GPU, or 2 on CPU)",
    )
    p.add_argument("--backend", choices=[b.value for b in Backend], default=None, help="override bridge.backend")
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in output_dir (same as resume=auto)"
    )
    loud = p.add_mutually_exclusive_group()
    loud.add_argument("-q", "--quiet", action="store_true", help="no progress bar: print only the summary")
    loud.add_argument(
        "-v", "--verbose", action="store_true", help="also print what each bridge option became, and every checkpoint"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config (and the mesh for the world size) and print it; train nothing",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="when a rank dies, restart every rank up to N times; each restart resumes from the "
        "latest checkpoint in output_dir (default 0: the job fails)",
    )
    multi = p.add_argument_group("multi-node (torchrun's rendezvous flags)")
    multi.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    multi.add_argument(
        "--node-rank",
        type=int,
        default=None,
        metavar="I",
        help="this node's index, 0 .. nnodes-1; node 0 hosts the rendezvous at --rdzv-endpoint "
        "(default: the first agent on the endpoint's host)",
    )
    multi.add_argument(
        "--rdzv-endpoint", default=None, metavar="HOST:PORT", help="where the nodes meet (the first node's address)"
    )
    multi.add_argument("--rdzv-id", default=None, help="a job id shared by all nodes (default: $SLURM_JOB_ID)")
    multi.add_argument("--rdzv-backend", default="c10d", help="rendezvous backend (default c10d)")
    p.set_defaults(func=run)


def _split_items(items: list[str]) -> tuple[str | None, list[str]]:
    if items and "=" not in items[0]:
        return items[0], items[1:]
    stray = [i for i in items[1:] if "=" not in i]
    if stray:
        raise ConfigError(
            [
                Problem(
                    "override",
                    stray[0],
                    "key=value (the config file comes first)",
                    "put CONFIG.yaml before the overrides",
                )
            ]
        )
    return None, items


def _default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _finished_step(config: object) -> int | None:
    """The step of a resumed run that already reached max_steps (None: there is work to do)."""
    from fsdp_bridge.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints
    from fsdp_bridge.checkpoint._formats import read_meta

    resume, max_steps = getattr(config, "resume", False), getattr(config, "max_steps", 0)
    if resume is False:
        return None
    output_dir = str(getattr(config, "output_dir", "."))
    root: Path | str = Path(output_dir) / "checkpoints"
    if "://" in output_dir:  # a run at a URL: its checkpoints and their steps are listed there
        root = f"{output_dir.rstrip('/')}/checkpoints"
        latest_url = latest_checkpoint(root) if resume in (True, "auto") else None
        return next((s for s, p in list_checkpoints(root) if p == latest_url and s >= max_steps), None)
    latest = latest_checkpoint(root) if resume in (True, "auto") else Path(str(resume))
    if latest is None:
        return None
    try:
        step = read_meta(Path(latest)).get("step")
    except (CheckpointError, OSError):
        return None  # the ranks report a damaged checkpoint with its reason
    return step if isinstance(step, int) and step >= max_steps else None


def run(args: argparse.Namespace) -> int:
    from fsdp_bridge.train._config import load_train_config

    path, overrides = _split_items(list(args.items))
    if args.resume:
        overrides.append("resume=auto")
    # The config is read and checked before torch loads ("a bad config fails at once"): only then the rest.
    config = load_train_config(path, overrides, backend=args.backend)

    from fsdp_bridge.train._launch import LaunchOptions, existing_launch, launch, node_rank_problems, run_rank
    from fsdp_bridge.train._preflight import preflight

    verbosity = "quiet" if args.quiet else "verbose" if args.verbose else "normal"
    launched = args.nproc_per_node is not None or args.nnodes > 1
    inside = existing_launch() and not launched
    launch_problems = [
        Problem(flag, value, "an integer >= 1")
        for flag, value in (("--nproc-per-node", args.nproc_per_node), ("--nnodes", args.nnodes))
        if value is not None and value < 1
    ]
    if args.max_restarts < 0:
        launch_problems.append(
            Problem(
                "--max-restarts",
                args.max_restarts,
                "an integer >= 0",
                "e.g. --max-restarts 3 (0: a dead rank ends the job)",
            )
        )
    if args.max_restarts and inside:
        launch_problems.append(
            Problem(
                "--max-restarts",
                args.max_restarts,
                "0 inside an existing launch",
                "give torchrun its own --max-restarts (fsdp-bridge train resumes from the "
                "latest checkpoint on each restart either way)",
            )
        )
    if not launch_problems:
        launch_problems = node_rank_problems(args.node_rank, args.nnodes)
    if launch_problems:
        raise ConfigError(launch_problems)
    if inside:
        world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    else:
        local = args.nproc_per_node or _default_nproc()
        world = local * args.nnodes
    device = "cuda" if config.bridge.device == "cuda" else None
    notes = preflight(config, world_size=world, local_world_size=local, device_type=device)
    done = _finished_step(config)
    if done is not None:
        print(
            f"fsdp-bridge train: {config.output_dir} is complete: its latest checkpoint is at step {done} of "
            f"max_steps={config.max_steps}; nothing to do (raise max_steps=... to train further)"
        )
        return 0
    if args.dry_run:
        print(config.to_yaml(), end="")
        print(f"# ok: {world} ranks ({args.nnodes if not inside else '?'} node(s)); {'; '.join(notes)}")
        return 0
    config_dict = config.to_dict()
    if inside:
        return run_rank(config_dict, verbosity)
    options = LaunchOptions(
        nproc_per_node=local,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        rdzv_backend=args.rdzv_backend,
        max_restarts=args.max_restarts,
    )
    code = launch(config_dict, options, verbosity=verbosity)
    sys.stdout.flush()
    return code
