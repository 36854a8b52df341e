"""``fsdp-bridge compare JOB.yaml [--steps N] [--strategies S,..] [--backends fsdp1,fsdp2] [--reference]
[--nproc-per-node N] [--override RUN.KEY=VALUE] [--out DIR]``

Runs the same short training on each backend (and with --reference a non-sharded
replica with averaged gradients) from the same initial weights, seed and batches, and
reports per step the loss, gradient norm and largest parameter difference; per run the
peak memory, parameter bytes per rank, step and setup time; a verdict per pair with
tolerances chosen by precision; and the backend defaults that can make numbers differ.

Writes report.json, report.md and report.png (with the optional matplotlib) into --out.
Exit code: 0 parity, 1 parity failed, 2 invalid job, 3 a rank failed (the rank that failed
first and its traceback are printed).  Starts --nproc-per-node ranks with the elastic launcher
``fsdp-bridge train`` uses (gloo on CPU, NCCL with one GPU per rank); under torchrun it uses
the launched ranks.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import TYPE_CHECKING

from fsdp_bridge.errors import ConfigError, Problem

if TYPE_CHECKING:
    from fsdp_bridge.compare import CompareJob, ParityReport


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "compare",
        help="A/B the backends: same training on FSDP1, FSDP2 (and a reference)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="a compare job YAML (see docs/compare.md)")
    p.add_argument("--steps", type=int, help="optimizer steps per run (max_steps)")
    p.add_argument("--strategies", help="comma-separated strategies, e.g. full_shard,shard_grad_op; 'all' for all 5")
    p.add_argument("--backends", help="comma-separated backends (default fsdp1,fsdp2)")
    p.add_argument(
        "--reference", action="store_true", default=None, help="also run a non-sharded replica with averaged gradients"
    )
    p.add_argument("--nproc-per-node", type=int, help="ranks to spawn on this machine")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="RUN.KEY=VALUE",
        help="change one run, e.g. fsdp2.lr=2e-3 or fsdp1.mixed_precision=bf16 (repeatable)",
    )
    p.add_argument(
        "--allow-builder",
        action="store_true",
        help="let the job's model.builder / model.batch import and call the Python code they name "
        "(refused without this flag: nothing a YAML names is imported unless you say so)",
    )
    p.add_argument("--out", default="compare-report", help="directory for report.json/.md/.png (default %(default)s)")
    p.add_argument(
        "--no-param-diff",
        action="store_true",
        help="skip gathering full parameters every step (rank 0 keeps a copy per run and step)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds a rank waits for a silent peer in a collective before the run fails (default %(default)s)",
    )
    p.set_defaults(func=run)


def apply_flags(data: dict, args: argparse.Namespace) -> dict:
    """The job mapping with the command-line flags applied (flags win over the file)."""
    data = dict(data)
    compare = dict(data.get("compare") or {})
    if args.steps is not None:
        data["max_steps"] = args.steps
    if args.strategies:
        compare["strategies"] = (
            "full_shard,shard_grad_op,no_shard,hybrid_shard,hybrid_shard_zero2"
            if args.strategies.strip() == "all"
            else args.strategies
        )
    if args.backends:
        compare["backends"] = args.backends
    if args.reference:
        compare["reference"] = True
    if args.nproc_per_node is not None:
        compare["nproc_per_node"] = args.nproc_per_node
    overrides = {k: dict(v) for k, v in (compare.get("overrides") or {}).items()}
    problems = []
    for item in args.override:
        target, sep, value = item.partition("=")
        run_name, dot, key = target.partition(".")
        if not sep or not dot or not key:
            problems.append(Problem("--override", item, "RUN.KEY=VALUE, e.g. fsdp2.lr=2e-3"))
            continue
        overrides.setdefault(run_name, {})[key] = _scalar(value)
    if problems:
        raise ConfigError(problems)
    if overrides:
        compare["overrides"] = overrides
    data["compare"] = compare
    return data


def _scalar(text: str) -> object:
    """A command-line value: a number when it reads as one (``2e-3`` included), else YAML."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    import yaml

    return yaml.safe_load(text)


RANK_FAILED_EXIT = 3


def _rank_main(job: CompareJob, param_diff: bool, timeout_s: float) -> ParityReport:
    """One launched rank (module level: pickled into the spawned processes)."""
    from fsdp_bridge.compare import run_job
    from fsdp_bridge.distributed import init_distributed

    init_distributed(job.device(), timeout_s=timeout_s)
    return run_job(job, param_diff=param_diff)


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `fsdp-bridge --help` must not pay for torch.
    from fsdp_bridge.compare import CompareJob, read_job, write_report

    job = CompareJob.from_dict(
        apply_flags(read_job(args.config), args), source=args.config, allow_builder=args.allow_builder
    )
    command = _command(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun: use those ranks
        report = _rank_main(job, not args.no_param_diff, args.timeout)
        if int(os.environ["RANK"]) != 0:
            return 0 if report.ok else 1
    else:
        from fsdp_bridge._launch import CONFIG_ERROR_EXIT, LaunchFailed, LaunchOptions, elastic_run

        world = _ranks(job)
        try:
            report = elastic_run(
                _rank_main,
                (job, not args.no_param_diff, args.timeout),
                LaunchOptions(nproc_per_node=world),
                name="compare",
            )[0]
        except LaunchFailed as err:
            if err.codes == {CONFIG_ERROR_EXIT}:
                return CONFIG_ERROR_EXIT  # rank 0 printed the problems
            print(
                err.explanation
                or f"fsdp-bridge compare: rank {', '.join(map(str, err.ranks))} failed (exit codes "
                f"{sorted(err.codes)}); see the log above",
                file=sys.stderr,
            )
            return RANK_FAILED_EXIT
    print(report.format())
    paths = write_report(report, args.out, command=command, job=job.to_dict())
    print(
        "\nwrote "
        + ", ".join(str(p) for p in paths.values() if p is not None)
        + ("" if paths["png"] else " (no plot: pip install 'fsdp-bridge[plot]' for report.png)")
    )
    return 0 if report.ok else 1


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (for the report)."""
    parts = ["fsdp-bridge", "compare", args.config]
    for flag, value in (
        ("--steps", args.steps),
        ("--strategies", args.strategies),
        ("--backends", args.backends),
        ("--nproc-per-node", args.nproc_per_node),
    ):
        if value is not None:
            parts += [flag, str(value)]
    if args.reference:
        parts.append("--reference")
    if args.allow_builder:
        parts.append("--allow-builder")
    for item in args.override:
        parts += ["--override", item]
    parts += ["--out", args.out]
    if args.no_param_diff:
        parts.append("--no-param-diff")
    return " ".join(shlex.quote(p) for p in parts)


def _ranks(job: CompareJob) -> int:
    """The ranks to start: gloo on CPU, NCCL with one GPU per rank (checked before anything starts)."""
    import torch

    world = job.nproc_per_node
    device = job.device()
    gpus = torch.cuda.device_count()
    if device == "cuda" or (device == "auto" and gpus > 0):
        if gpus < world:
            raise ConfigError(
                [
                    Problem(
                        "compare.nproc_per_node",
                        world,
                        f"at most {gpus} (GPUs on this machine)",
                        "lower --nproc-per-node, or set bridge.device: cpu",
                    )
                ]
            )
    return world
