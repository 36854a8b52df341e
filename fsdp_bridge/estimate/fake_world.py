"""Run the real ``shard()`` at a world size we cannot launch, and check the estimator against it.

    from fsdp_bridge import BridgeConfig
    from fsdp_bridge.estimate import plan_at_scale
    plan = plan_at_scale("llama:hidden_size=8192,num_hidden_layers=2,...", BridgeConfig(backend="fsdp2"),
                         world_size=1024)
    assert plan.matches, plan.mismatches

For each rank asked for, one process (this one) joins torch's *fake* process group as that
rank of ``world_size`` ranks: collectives return at once without communicating, so
:func:`fsdp_bridge.shard` builds the mesh, resolves the wrap units and calls ``fully_shard``
exactly as it would on that rank of a real job.  The model stays on the meta device, so each
rank's DTensor shards have their true shapes and no memory.  The fake group is destroyed
after each rank.  ``benchmarks/plan_at_scale.py`` prints the table in ``docs/performance.md``.

Only FSDP2 is planned this way (FSDP1 must materialise its flat parameters); its estimate
is checked against real runs in ``tests/test_estimate_validation.py``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_bridge.backends.fsdp2 import local_shape
from fsdp_bridge.config import BridgeConfig
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.estimate.memory import RankMemory, estimate_memory, model_units
from fsdp_bridge.estimate.model import build_meta_model, load_model_config
from fsdp_bridge.estimate.tracker import storage_bytes
from fsdp_bridge.strategy import Backend

__all__ = ["RankPlan", "ScalePlan", "fake_process_group", "plan_at_scale"]

_MAX_WORLD = 2**20
# activation_checkpointing wraps each unit: its parameters' names gain this segment.
_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


@contextmanager
def fake_process_group(*, rank: int, world_size: int) -> Iterator[None]:
    """This process is ``rank`` of ``world_size`` in torch's fake process group for the block.

    Collectives return immediately and move no data: use it only to plan (shapes, meshes).
    The group is destroyed on exit, so later code (or tests) start clean.

    Args:
        rank: this process's rank.
        world_size: the world size to pretend.

    Yields:
        Nothing; inside the block ``torch.distributed`` reports that rank and world size.

    Raises:
        ConfigError: a process group is already initialised in this process.
    """
    if dist.is_initialized():
        raise ConfigError(
            [
                Problem(
                    "process group",
                    f"{dist.get_backend()} with {dist.get_world_size()} ranks",
                    "no process group in this process",
                    "plan at a fake world size in a process that has not called "
                    "init_process_group (e.g. a subprocess), or destroy the group first",
                )
            ]
        )
    # Private torch import, on purpose: torch registers the "fake" backend only when this module
    # is imported.  torch 2.13 (run) and 2.14.1 (read from the wheel) import it themselves only
    # when init_process_group("fake") gets no store; with any store it raises "Unknown c10d
    # backend type FAKE" unless imported.  2.14 moved FakeStore to C++ and re-exports it here.
    # Importing it explicitly keeps the registration independent of that detail; the
    # ImportError branch is the version gate should a later torch move or drop the module.
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as err:  # pragma: no cover - depends on the torch build
        import torch

        raise ConfigError(
            [
                Problem(
                    "torch",
                    torch.__version__,
                    "a torch with the fake process group "
                    "(torch.testing._internal.distributed.fake_pg, present in 2.13 and 2.14)",
                    f"install torch 2.13 or 2.14 to plan at a fake world size ({err})",
                )
            ]
        ) from None
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class RankPlan:
    """What ``shard()`` gave one rank of the fake world, and what the estimator predicted for it."""

    rank: int
    shard_index: int
    """The rank's coordinate on the mesh's shard dimension (HSDP: ``rank % shard``)."""
    mesh: tuple[int, ...]
    units: tuple[str, ...]
    """Modules ``fully_shard`` was applied to, parents first (the root is ``"(root)"``)."""
    local_shapes: dict[str, tuple[int, ...]]
    """``to_local()`` shape of every parameter on this rank."""
    expected_shapes: dict[str, tuple[int, ...]]
    """The estimator's shape for the same parameter (:func:`fsdp_bridge.backends.fsdp2.local_shape`)."""
    local_bytes: int
    """Bytes of the local shards (no padding)."""
    allocated_bytes: int
    """Bytes of the storages behind the local shards (padded to the largest chunk)."""


@dataclass(frozen=True)
class ScalePlan:
    """The estimate for ``config`` at ``world_size`` and the ranks planned with the real ``shard()``."""

    world_size: int
    config: BridgeConfig
    estimate: RankMemory
    ranks: tuple[RankPlan, ...]
    units: tuple[str, ...]
    """Wrap units the estimator assumed, root last."""
    mismatches: tuple[str, ...] = field(default=())
    """Every difference between the estimate and a planned rank (empty: exact agreement)."""

    @property
    def matches(self) -> bool:
        return not self.mismatches


def _check(plan: RankPlan, estimate: RankMemory, units: Sequence[str]) -> list[str]:
    out: list[str] = []
    where = f"rank {plan.rank}"
    if plan.mesh != estimate.mesh:
        out.append(f"{where}: mesh {plan.mesh}, estimated {estimate.mesh}")
    if sorted(plan.units) != sorted(units):
        out.append(f"{where}: fully_shard applied to {sorted(plan.units)}, estimated units {sorted(units)}")
    if set(plan.local_shapes) != set(plan.expected_shapes):
        out.append(f"{where}: parameters differ: {sorted(set(plan.local_shapes) ^ set(plan.expected_shapes))}")
    for name, shape in plan.local_shapes.items():
        want = plan.expected_shapes.get(name)
        if want is not None and shape != want:
            out.append(f"{where}: {name} local shape {shape}, estimated {want}")
    if plan.allocated_bytes != estimate.params:
        out.append(f"{where}: allocated shard bytes {plan.allocated_bytes:,}, estimated params {estimate.params:,}")
    if plan.shard_index == 0 and plan.local_bytes != estimate.params:
        out.append(
            f"{where}: local shard bytes {plan.local_bytes:,}, estimated params {estimate.params:,} "
            "(shard 0 holds the largest chunk of every parameter)"
        )
    return out


@contextmanager
def _quiet() -> Iterator[None]:
    """shard() logs its report on rank 0 of the real job; a plan is not one."""
    logger = logging.getLogger("fsdp_bridge")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _plan_rank(model: nn.Module, config: BridgeConfig, *, rank: int, world_size: int) -> RankPlan:
    from fsdp_bridge.api import get_bridge, plan_on_meta, shard

    full = {n: tuple(p.shape) for n, p in model.named_parameters()}  # before shard() replaces them
    with fake_process_group(rank=rank, world_size=world_size), plan_on_meta(), _quiet():
        sharded = shard(model, config)
        bridge = get_bridge(sharded)
        mesh = bridge.mesh
        shard_index = mesh.get_local_rank(mesh.ndim - 1)
        shard_size = mesh.shape[-1]
        # What fully_shard was really applied to (named as model_units names them).
        units = tuple(
            n.replace(_CHECKPOINT_PREFIX, "") or "(root)"
            for n, m in sharded.named_modules()
            if isinstance(m, FSDPModule)
        )
        local: dict[str, tuple[int, ...]] = {}
        tensors = []
        for name, p in sharded.named_parameters():
            t = p.to_local() if isinstance(p, DTensor) else p.detach()
            local[name.replace(_CHECKPOINT_PREFIX, "")] = tuple(t.shape)
            tensors.append(t)
        local_bytes = sum(t.numel() * t.element_size() for t in tensors)
        allocated = storage_bytes(tensors)
        plan_mesh = tuple(mesh.shape)
    expected = {n: local_shape(s, shard_size, shard_index) for n, s in full.items()}
    return RankPlan(
        rank=rank,
        shard_index=shard_index,
        mesh=plan_mesh,
        units=units,
        local_shapes=local,
        expected_shapes=expected,
        local_bytes=local_bytes,
        allocated_bytes=allocated,
    )


def plan_at_scale(
    model: str | nn.Module,
    config: BridgeConfig,
    *,
    world_size: int,
    nodes: int = 1,
    ranks: Sequence[int] | None = None,
    optimizer: str = "adamw",
) -> ScalePlan:
    """Estimate ``config`` at ``world_size`` and check it against the real ``shard()`` on ``ranks``.

    Args:
        model: a spec (see :mod:`fsdp_bridge.estimate.model`) or a module on the meta device
            (each rank shards its own deep copy).
        config: an FSDP2 configuration; ``hybrid_shape`` gives the HSDP mesh (else ``nodes``).
            ``sync_module_states`` is ignored: nothing is materialised.
        world_size: ranks of the fake world.
        nodes: nodes, for HYBRID_* without ``hybrid_shape`` (the shard group is one node).
        ranks: the ranks to plan (default: the first and the last).
        optimizer: the optimizer whose state the estimate counts.

    Returns:
        The estimate, each planned rank's wrap units, mesh and local shapes, and every
        mismatch between them (``ScalePlan.matches``).

    Raises:
        ConfigError: the backend is not FSDP2, a size or rank is out of range, the model is
            not on the meta device, or a process group is already initialised.
    """
    problems: list[Problem] = []
    if config.backend is not Backend.FSDP2:
        problems.append(
            Problem(
                "backend",
                config.backend.value,
                "fsdp2",
                "plan at scale with backend: fsdp2 (FSDP1 must allocate its flat parameters; "
                "its estimate is checked against real runs in tests/test_estimate_validation.py)",
            )
        )
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= _MAX_WORLD:
        problems.append(Problem("world_size", world_size, f"an integer from 1 to {_MAX_WORLD:,}"))
        world_size = 1
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1 or world_size % nodes:
        problems.append(Problem("nodes", nodes, f"a divisor of the world size ({world_size})"))
    chosen = tuple(ranks) if ranks is not None else tuple(sorted({0, world_size - 1}))
    bad = [r for r in chosen if not isinstance(r, int) or not 0 <= r < world_size]
    if bad or not chosen:
        problems.append(Problem("ranks", list(chosen), f"one or more ranks from 0 to {world_size - 1}"))
    module = (
        build_meta_model(load_model_config(model), attn_implementation="eager") if isinstance(model, str) else model
    )
    if any(not t.is_meta for t in (*module.parameters(), *module.buffers())):
        problems.append(
            Problem(
                "model",
                type(module).__name__,
                "a model on the meta device",
                "build it under `with torch.device('meta'):` (or pass a spec string)",
            )
        )
    if problems:
        raise ConfigError(problems)
    config = config.replace(sync_module_states=False)
    if config.strategy.is_hybrid and config.hybrid_shape is None:  # shard() would read LOCAL_WORLD_SIZE
        config = config.replace(hybrid_shape=(nodes, world_size // nodes))
    estimate = estimate_memory(module, config, world_size=world_size, nodes=nodes, optimizer=optimizer)
    units = tuple(u.name for u in model_units(module, config))
    planned: list[RankPlan] = []
    mismatches: list[str] = []
    for rank in chosen:
        plan = _plan_rank(copy.deepcopy(module), config, rank=rank, world_size=world_size)
        planned.append(plan)
        mismatches.extend(_check(plan, estimate, units))
    return ScalePlan(
        world_size=world_size,
        config=config,
        estimate=estimate,
        ranks=tuple(planned),
        units=units,
        mismatches=tuple(mismatches),
    )
