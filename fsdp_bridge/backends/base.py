"""The small interface every backend implements (it executes a :class:`~fsdp_bridge.plan.ShardPlan`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from fsdp_bridge.plan import ShardPlan
from fsdp_bridge.strategy import Backend

__all__ = ["BackendImpl", "FlatPiece", "FlatTensor", "ShardPlan"]


@dataclass(frozen=True)
class FlatPiece:
    """Elements ``[start, start + data.numel())`` of a tensor flattened in row-major order:
    one contiguous byte range of the tensor's data in a safetensors file."""

    start: int
    data: torch.Tensor
    """1-D, contiguous; a view of the rank's shard where it can be (on any device)."""


@dataclass(frozen=True)
class FlatTensor:
    """A state-dict entry as one rank writes it in a full export: its full shape and dtype, and
    the pieces this rank writes.  Over all ranks the pieces cover every element exactly once."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[FlatPiece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class BackendImpl(Protocol):
    """One FSDP implementation.  Only :mod:`fsdp_bridge.backends` chooses between them."""

    backend: Backend
    one_dtype_per_unit: bool
    """Every unit must hold parameters of one dtype (FSDP1 flattens a unit into one tensor); the
    bridge then makes the modules owning another dtype units of their own."""

    parametrizes_in_forward: bool
    """A module may register a parametrization on its own parameter during forward (peft's LoRA on a
    parameter does, at every call)."""

    def keeps_swapped_parameters(self, reshards_after_forward: bool, shard_size: int) -> bool:
        """Whether a layer may replace its own parameter object during forward (bitsandbytes' 4-bit
        layers re-wrap the weight FSDP hands them) with this strategy and shard-group size."""
        ...

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

    def reshard_as_inner_unit(self, module: nn.Module) -> bool:
        """Make a sharded ``module`` free its gathered parameters after forward even when it runs
        as a root, as FSDP1's inner wrapper of ``wrap(wrap(m))`` does; False where the backend
        cannot change it after sharding."""
        ...

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        """Accumulate gradients locally (no reduction) inside the context."""
        ...

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip gradients by their global norm across all shards and replicas; return that norm."""
        ...

    def summon_full_params(
        self, model: nn.Module, *, writeback: bool, rank0_only: bool = False, offload_to_cpu: bool = False
    ) -> AbstractContextManager[None]:
        """Inside the context, the model's parameters are full, unsharded tensors (on rank 0 only
        with ``rank0_only``; CPU copies with ``offload_to_cpu``)."""
        ...

    def local_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """The parameter data this rank holds: its shards (no padding), one tensor per parameter."""
        ...

    def global_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """Clean name -> full shape of every entry of the model's state dict (tied names each),
        without building one (FSDP1's sharded state dict gathers every unit)."""
        ...

    def load_local(
        self, model: nn.Module, read_rows: Callable[[str, int, int], torch.Tensor | None]
    ) -> set[str] | None:
        """Copy into this rank's shards the part of each parameter it holds, reading rows
        ``[start, stop)`` (along dim 0; a 0-dim parameter: ``(name, 0, 1)``) of the parameter
        named ``name`` (its clean name) with ``read_rows``, which returns None for a parameter the
        checkpoint does not hold (left as it is); no communication.  Returns the names handled,
        or None when the backend leaves this to DCP (sharded state dicts)."""
        ...

    def export_pieces(self, model: nn.Module) -> dict[str, FlatTensor] | None:
        """Clean name -> what this rank writes of each tensor of the model's state dict (tied
        names each, in state-dict order) in a full export, without communication and without
        building a state dict; or None when the backend's sharded state dict serves (DCP)."""
        ...

    def export_optimizer_pieces(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The optimizer's full state as a full export writes it: ``{"state": {fqn: {name:
        FlatTensor or value}}, "param_groups": [...]}``, shaped like ``get_optimizer_state_dict``'s
        (same names and order); or None where the backend's optimizer state dict serves.  Collective:
        every rank calls it, and every rank gets None or every rank a dict."""
        ...
