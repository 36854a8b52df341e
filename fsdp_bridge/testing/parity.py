"""Assert that FSDP1 and FSDP2 (and a non-sharded reference) train a model the same way.

Call :func:`assert_backend_parity` on every rank of a distributed test (the plugin's
``@pytest.mark.distributed`` or ``run_on_ranks`` start the ranks)::

    @pytest.mark.distributed(world_size=2)
    def test_my_model_trains_the_same():
        report = assert_backend_parity(build_my_model, rank_batches("llama", steps=3),
                                       BridgeConfig(strategy="full_shard"))
        assert report.pair("fsdp1/full_shard", "fsdp2/full_shard").max_param_diff == 0.0

Tolerances come from the precision of the config (:data:`TOLERANCES`): tight for fp32,
looser and documented for bf16/fp16; pass ``tolerance=Tolerance(...)`` to choose your own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_bridge.compare.engine import Batch, LossFn, OptimizerFn, RunSpec, default_loss, default_optimizer, run_parity
from fsdp_bridge.compare.report import TOLERANCES, PairVerdict, ParityReport, StepDiff, Tolerance, tolerance_for
from fsdp_bridge.config import BridgeConfig
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.strategy import Backend, ShardingStrategy, parse_enum

__all__ = [
    "TOLERANCES",
    "PairVerdict",
    "ParityReport",
    "StepDiff",
    "Tolerance",
    "assert_backend_parity",
    "rank_batches",
    "tolerance_for",
]


def rank_batches(
    family: str = "llama", *, steps: int = 3, batch: int = 2, seq: int = 16, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """This rank's batches for a tiny model of ``family``: one per step, different on every rank.

    Rank ``r`` draws from seed ``seed + 42 + r`` (PyTorch's parity-test convention), so the
    averaged gradient differs from any single rank's.

    Args:
        family: a tiny model family of :mod:`fsdp_bridge.testing.models` (its vocabulary).
        steps: how many batches.
        batch: sequences per batch.
        seq: tokens per sequence.
        seed: the base seed.

    Returns:
        ``steps`` batches of ``input_ids`` and ``labels``, shaped for the family's training loss.
    """
    from fsdp_bridge.testing.models import sample_batch

    rank = dist.get_rank() if dist.is_initialized() else 0
    base = (seed + 42 + rank) * 100_003
    return [sample_batch(family, batch=batch, seq=seq, seed=base + step) for step in range(steps)]


def assert_backend_parity(
    model_fn: Callable[[], nn.Module],
    batches: Sequence[Batch] | Callable[[int], Sequence[Batch]],
    config: BridgeConfig | Mapping[str, Any] | None = None,
    *,
    backends: Sequence[str | Backend] = tuple(Backend),
    strategies: Sequence[str | ShardingStrategy] | None = None,
    reference: bool = True,
    hybrid_shape: tuple[int, int] | None = None,
    lr: float = 1e-3,
    optimizer_fn: OptimizerFn = default_optimizer,
    loss_fn: LossFn = default_loss,
    grad_clip: float | None = None,
    tolerance: Tolerance | None = None,
    param_diff: bool = True,
) -> ParityReport:
    """Train ``model_fn()`` on every backend (and strategy) and the reference; fail unless they match.

    Collective: call it on every rank with the same arguments.  ``batches`` are this
    rank's batches, one per step (or ``batches(rank)`` returning them).  ``config`` gives
    every field but the backend (and the strategy, when ``strategies`` is given;
    ``hybrid_shape`` then applies to the hybrid ones).  All
    runs start from rank 0's weights of ``model_fn()`` and take ``len(batches)`` steps of
    ``optimizer_fn(params, lr)`` (AdamW by default) on ``loss_fn(model, batch)``
    (``model(**batch).loss`` by default).

    Args:
        model_fn: builds the model (called for every run; rank 0's initial weights are used).
        batches: this rank's batches, one per step, or ``batches(rank)`` returning them.
        config: the bridge config (or its YAML mapping) for every field but the backend and,
            with ``strategies``, the strategy; default ``BridgeConfig()``.
        backends: the backends to run (default: every one).
        strategies: strategies to run each backend with; default the config's.
        reference: also run an unsharded copy with averaged gradients, and compare to it.
        hybrid_shape: the (replicate, shard) shape of the hybrid strategies among ``strategies``.
        lr: the learning rate given to ``optimizer_fn``.
        optimizer_fn: ``optimizer_fn(params, lr)`` builds each run's optimizer.
        loss_fn: ``loss_fn(model, batch)`` returns the loss to backpropagate.
        grad_clip: clip gradients to this global norm in every run; None does not clip.
        tolerance: how close runs must stay; default by the precision
            (:func:`~fsdp_bridge.testing.tolerance_for`).
        param_diff: also compare the parameters after the last step.

    Returns:
        The :class:`ParityReport` (per-step losses, gradient norms, parameter differences and
        verdicts).

    Raises:
        AssertionError: a pair diverged; the message names the first diverging step and holds
            the report's table.
        ConfigError: an unknown backend or strategy, fewer than two runs to compare, or a
            config problem.
    """
    if isinstance(config, Mapping):
        config = BridgeConfig.from_dict(config)
    config = config or BridgeConfig()
    if callable(batches):
        batches = batches(dist.get_rank() if dist.is_initialized() else 0)
    try:
        backend_list = [parse_enum(Backend, b) for b in backends]
        strategy_list = [parse_enum(ShardingStrategy, s) for s in strategies] if strategies else [config.strategy]
    except ValueError as err:
        raise ConfigError([Problem("backends/strategies", f"{list(backends)} / {strategies}", str(err))]) from None
    runs = [RunSpec.reference(lr)] if reference else []
    for strategy in strategy_list:
        for backend in backend_list:
            changes: dict[str, Any] = {"strategy": strategy, "backend": backend}
            if strategy.is_hybrid and hybrid_shape is not None:
                changes["hybrid_shape"] = hybrid_shape
            elif not strategy.is_hybrid:
                changes["hybrid_shape"] = None
            runs.append(RunSpec.sharded(config.replace(**changes), lr))
    if len(runs) < 2:
        raise ConfigError(
            [
                Problem(
                    "backends",
                    [b.value for b in backend_list],
                    "at least two runs to compare",
                    "give two backends, or reference=True",
                )
            ]
        )
    report = run_parity(
        model_fn,
        batches,
        runs,
        optimizer_fn=optimizer_fn,
        loss_fn=loss_fn,
        grad_clip=grad_clip,
        tolerance=tolerance,
        param_diff=param_diff,
        device=config.device,
    )
    if not report.ok:
        failed = "; ".join(p.describe() for p in report.pairs if not p.ok)
        raise AssertionError(f"backend parity failed: {failed}\n\n{report.format()}")
    return report
