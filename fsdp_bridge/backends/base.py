"""The small interface every backend implements, and the plan it is handed."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_bridge.config import BridgeConfig
from fsdp_bridge.mapping import TranslationReport
from fsdp_bridge.strategy import Backend, ShardingStrategy

__all__ = ["BackendImpl", "ShardPlan"]


@dataclass
class ShardPlan:
    """Everything resolved and validated before the backend touches the model."""

    config: BridgeConfig
    device: torch.device
    mesh: DeviceMesh
    units: list[nn.Module]
    """Modules to shard as their own unit, children before parents; root excluded."""
    ignored_modules: list[nn.Module]
    has_meta: bool
    """Some parameters or buffers are on the meta device (built without memory)."""
    report: TranslationReport
    scalar_params: list[nn.Parameter] = field(default_factory=list)
    """0-dim parameters (e.g. CLIP's ``logit_scale``): neither backend shards them, so they stay
    whole on every rank and their gradients are averaged by the bridge."""
    materialize: bool = True
    """Allocate a meta-device model on ``device`` after sharding.  False only for planning at a
    fake world size (:func:`fsdp_bridge.estimate.plan_at_scale`, FSDP2): the shards stay on meta."""

    def reshard_after_forward(self, *, is_root: bool) -> bool | int:
        """Per-unit reshard-after-forward, matching FSDP1: the root keeps its parameters
        gathered for the backward that immediately follows, unless overridden."""
        config = self.config
        if config.strategy is ShardingStrategy.NO_SHARD:
            return False
        if config.reshard_after_forward is not None:
            return config.reshard_after_forward
        return config.strategy.reshards_after_forward and not is_root

    @property
    def ignored_params(self) -> set[nn.Parameter]:
        return {p for m in self.ignored_modules for p in m.parameters()} | set(self.scalar_params)


class BackendImpl(Protocol):
    """One FSDP implementation.  Only :mod:`fsdp_bridge.backends` chooses between them."""

    backend: Backend

    def no_shard_mesh_shape(self, world_size: int) -> tuple[int, ...]:
        """The mesh NO_SHARD runs on: FSDP1 has the strategy natively (1D); FSDP2 replicates on (world, 1)."""
        ...

    def shard_numel(self, shapes: Sequence[tuple[int, ...]], shard: int, compute_bytes: int) -> int:
        """Elements of one unit (parameters of ``shapes``) held by the fullest rank of a shard
        group of ``shard`` ranks, padding included.  Used by the memory estimator."""
        ...

    def gathers_full_copy(self, shard: int, *, mixed_precision: bool) -> bool:
        """Whether running a unit allocates a gathered copy of its parameters (estimator)."""
        ...

    def shard(self, model: nn.Module, plan: ShardPlan) -> nn.Module:
        """Shard ``model`` in place as planned; return the module the user keeps calling."""
        ...

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        """Accumulate gradients locally (no reduction) inside the context."""
        ...

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip gradients by their global norm across all shards and replicas; return that norm."""
        ...

    def summon_full_params(self, model: nn.Module, *, writeback: bool, rank0_only: bool = False,
                           offload_to_cpu: bool = False) -> AbstractContextManager[None]:
        """Inside the context, the model's parameters are full, unsharded tensors (on rank 0 only
        with ``rank0_only``; CPU copies with ``offload_to_cpu``)."""
        ...

    def local_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """The parameter data this rank holds: its shards (no padding), one tensor per parameter."""
        ...
