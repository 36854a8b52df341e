"""A/B the backends: run one short training on FSDP1, FSDP2 (and a reference) and compare.

    fsdp-bridge compare job.yaml --reference          # CLI (see docs/compare.md)

    from fsdp_bridge.compare import CompareJob, run_job   # on every rank of a launched job
    report = run_job(CompareJob.from_dict({...}))

The engine behind :func:`run_job` (``fsdp_bridge.compare.engine``) is also what
``fsdp_bridge.testing.assert_backend_parity`` uses in tests.
"""

from __future__ import annotations

import torch.distributed as dist

from fsdp_bridge.compare.differences import backend_differences
from fsdp_bridge.compare.engine import run_parity
from fsdp_bridge.compare.job import CompareJob, load_job, read_job
from fsdp_bridge.compare.output import plot_report, write_report
from fsdp_bridge.compare.report import (
    TOLERANCES,
    Difference,
    PairVerdict,
    ParityReport,
    RunResult,
    StepDiff,
    StepRecord,
    Tolerance,
    tolerance_for,
)

__all__ = [
    "TOLERANCES",
    "CompareJob",
    "Difference",
    "PairVerdict",
    "ParityReport",
    "RunResult",
    "StepDiff",
    "StepRecord",
    "Tolerance",
    "backend_differences",
    "load_job",
    "plot_report",
    "read_job",
    "run_job",
    "tolerance_for",
    "write_report",
]


def run_job(job: CompareJob, *, param_diff: bool = True) -> ParityReport:
    """Run ``job`` on the current process group (collective: every rank calls it); the group is
    set up from the environment first if needed (torchrun's ranks: each gets its own batches).

    Args:
        job: the parsed job.
        param_diff: compare full parameters after every step.

    Returns:
        The :class:`ParityReport`.
    """
    from fsdp_bridge.distributed import init_distributed

    init_distributed(job.device())
    rank = dist.get_rank()
    return run_parity(
        job.build_model,
        job.batches(rank),
        job.run_specs(),
        optimizer_fn=job.optimizer,
        grad_clip=job.grad_clip,
        param_diff=param_diff,
        device=job.device(),
    )
