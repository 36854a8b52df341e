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
        layers re-wrap the weight FSDP hands them) with this strategy and shard-group size.

        Args:
            reshards_after_forward: whether the unit frees its gathered parameters after forward.
            shard_size: ranks in one shard group.

        Returns:
            True where such a layer still trains correctly on this backend.
        """
        ...

    def no_shard_mesh_shape(self, world_size: int) -> tuple[int, ...]:
        """The mesh NO_SHARD runs on: FSDP1 has the strategy natively (1D); FSDP2 replicates on (world, 1).

        Args:
            world_size: ranks in the job.

        Returns:
            The mesh shape.
        """
        ...

    def shard_numel(self, shapes: Sequence[tuple[int, ...]], shard: int, compute_bytes: int) -> int:
        """Elements of one unit (parameters of ``shapes``) held by the fullest rank of a shard
        group of ``shard`` ranks, padding included.  Used by the memory estimator.

        Args:
            shapes: the shapes of the unit's parameters.
            shard: ranks in one shard group.
            compute_bytes: bytes per element of the compute dtype (FSDP1 aligns each parameter to 16 bytes).

        Returns:
            The number of elements.
        """
        ...

    def gathers_full_copy(self, shard: int, *, mixed_precision: bool) -> bool:
        """Whether running a unit allocates a gathered copy of its parameters (estimator).

        Args:
            shard: ranks in one shard group.
            mixed_precision: parameters are cast to another dtype for compute.

        Returns:
            True where a full copy of the unit is allocated while it runs.
        """
        ...

    def shard(self, model: nn.Module, plan: ShardPlan) -> nn.Module:
        """Shard ``model`` in place as planned.

        Args:
            model: the user's module, on its device or on meta.
            plan: every decision already taken (:func:`fsdp_bridge.plan.resolve_plan`).

        Returns:
            The module the user keeps calling (FSDP1: the root wrapper; FSDP2: ``model`` itself).
        """
        ...

    def reshard_as_inner_unit(self, module: nn.Module) -> bool:
        """Make a sharded ``module`` free its gathered parameters after forward even when it runs
        as a root, as FSDP1's inner wrapper of ``wrap(wrap(m))`` does; False where the backend
        cannot change it after sharding.

        Args:
            module: a module this backend sharded.

        Returns:
            Whether the change was made.
        """
        ...

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        """Accumulate gradients locally (no reduction) inside the context.

        Args:
            model: the sharded model.

        Returns:
            The context manager.
        """
        ...

    def defer_all_reduce(self, model: nn.Module) -> AbstractContextManager[None]:
        """Inside the context, backward reduce-scatters gradients but defers the all-reduce across
        replicas to the first backward after it (asked only where the plan says the backend can).

        Args:
            model: the sharded model.

        Returns:
            The context manager.
        """
        ...

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip gradients by their global norm across all shards and replicas (collective).

        Args:
            model: the sharded model.
            max_norm: the largest norm left after clipping.
            norm_type: the p of the p-norm (``inf`` for the largest absolute value).

        Returns:
            The total norm before clipping, the same on every rank.
        """
        ...

    def summon_full_params(
        self,
        model: nn.Module,
        *,
        writeback: bool,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
        root: bool = False,
    ) -> AbstractContextManager[None]:
        """Inside the context, the model's parameters are full, unsharded tensors (on rank 0 only
        with ``rank0_only``; CPU copies with ``offload_to_cpu``).

        Args:
            model: the sharded model.
            writeback: copy changes made inside the context back to the shards on exit.
            rank0_only: only rank 0 gets the full parameters.
            offload_to_cpu: the full parameters are CPU copies.
            with_grads: the parameters' ``.grad`` are full too (written back with ``writeback``).
            root: ``model`` is the root of its sharded model (the one :func:`fsdp_bridge.shard` returned):
                a forward inside the context may be its first.

        Returns:
            The context manager (collective on entry and exit).
        """
        ...

    def own_params(self, module: nn.Module) -> AbstractContextManager[None]:
        """Inside the context, the parameters ``module``'s own unit manages are gathered, not those
        of units nested in it (FSDP1's ``summon_full_params(recurse=False)``), so that its forward
        (``generate``) may run inside; a module that is not a unit gathers nothing.

        Args:
            module: a unit of a sharded model, or any module under one.

        Returns:
            The context manager (collective on entry and exit for a unit).
        """
        ...

    def reshard(self, module: nn.Module, *, recurse: bool) -> None:
        """Free the unsharded parameters ``module``'s units hold gathered (after an evaluation forward
        under ``torch.no_grad()``, say); the next forward gathers them again. Local: no collective.

        Args:
            module: a unit of a sharded model, a whole sharded model, or any module under one.
            recurse: every unit under ``module`` (itself included); False: ``module``'s own unit only.

        Returns:
            Nothing; units without parameters, NO_SHARD units (FSDP1) and modules that are no unit
            are left as they are.
        """
        ...

    def local_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """The parameter data this rank holds: its shards (no padding), one tensor per parameter.

        Args:
            model: the sharded model.

        Returns:
            One tensor per parameter, in ``parameters()`` order; empty where this rank holds none of it.
        """
        ...

    def global_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        """Clean name -> full shape of every entry of the model's state dict (tied names each),
        without building one (FSDP1's sharded state dict gathers every unit).

        Args:
            model: the sharded model.

        Returns:
            The full shape of each state-dict entry, keyed by its clean name.
        """
        ...

    def load_local(
        self, model: nn.Module, read_rows: Callable[[str, int, int], torch.Tensor | None]
    ) -> set[str] | None:
        """Copy into this rank's shards the part of each parameter it holds, reading rows
        ``[start, stop)`` (along dim 0; a 0-dim parameter: ``(name, 0, 1)``) of the parameter
        named ``name`` (its clean name) with ``read_rows``, which returns None for a parameter the
        checkpoint does not hold (left as it is); no communication.

        Args:
            model: the sharded model.
            read_rows: ``(name, start, stop) -> tensor`` of those rows, or None.

        Returns:
            The names handled, or None when the backend leaves this to DCP (sharded state dicts).
        """
        ...

    def export_pieces(self, model: nn.Module) -> dict[str, FlatTensor] | None:
        """Clean name -> what this rank writes of each tensor of the model's state dict (tied
        names each, in state-dict order) in a full export, without communication and without
        building a state dict.

        Args:
            model: the sharded model.

        Returns:
            The pieces keyed by clean name, or None when the backend's sharded state dict serves (DCP).
        """
        ...

    def export_optimizer_pieces(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The optimizer's full state as a full export writes it: ``{"state": {fqn: {name:
        FlatTensor or value}}, "param_groups": [...]}``, shaped like ``get_optimizer_state_dict``'s
        (same names and order); or None where the backend's optimizer state dict serves.  Collective:
        every rank calls it, and every rank gets None or every rank a dict.

        Args:
            model: the sharded model.
            optimizer: an optimizer over its parameters.

        Returns:
            The state as described, or None.
        """
        ...
