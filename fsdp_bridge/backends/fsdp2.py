"""FSDP2: ``torch.distributed.fsdp.fully_shard`` (per-parameter DTensor sharding)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp_bridge._names import strip_wrapper_prefixes
from fsdp_bridge.backends._common import broadcast_from_rank0, buffer_shapes, rank0_full_state
from fsdp_bridge.backends.base import FlatTensor
from fsdp_bridge.plan import ShardPlan, SyncMethod
from fsdp_bridge.strategy import Backend

__all__ = ["FSDP2Backend", "local_shape"]


def local_shape(shape: tuple[int, ...], shard: int, index: int) -> tuple[int, ...]:
    """The shape of ``to_local()`` of a parameter of ``shape`` on shard ``index`` of ``shard`` ranks.

    FSDP2 splits dim 0 as ``torch.chunk`` does: chunks of ``ceil(d0 / shard)`` rows, the
    last non-empty one shorter, then empty chunks (e.g. 10 rows on 4 ranks: 3, 3, 3, 1; 6 rows
    on 4 ranks: 2, 2, 2, 0).  Each rank's storage is padded to the first chunk's size.
    0-dim parameters are not sharded (the bridge keeps them whole on every rank).
    """
    if not shape or shard == 1:
        return shape
    rows = -(-shape[0] // shard)
    return (max(0, min(rows, shape[0] - index * rows)), *shape[1:])


def _top_level_units(units: list[nn.Module]) -> list[nn.Module]:
    """Units not nested in another unit, in forward (registration) order."""
    nested = {id(c) for u in units for c in u.modules() if c is not u}
    return [u for u in units if id(u) not in nested]


class FSDP2Backend:
    backend = Backend.FSDP2
    one_dtype_per_unit = False  # per-parameter sharding: a unit may mix dtypes

    def keeps_swapped_parameters(self, reshards_after_forward: bool, shard_size: int) -> bool:
        return True  # it registers the unsharded parameters again at every unshard

    def no_shard_mesh_shape(self, world_size: int) -> tuple[int, ...]:
        # Replicate over every rank, shard over groups of one: NO_SHARD's meaning, not ZeRO-2.
        return (world_size, 1)

    def shard_numel(self, shapes: Sequence[tuple[int, ...]], shard: int, compute_bytes: int) -> int:
        # Each parameter is split on dim 0 (torch.chunk sizes); every rank allocates the
        # largest chunk (rank 0's), the others' shards are views of that padded storage.
        return sum(math.prod(local_shape(s, shard, 0)) for s in shapes)

    def gathers_full_copy(self, shard: int, *, mixed_precision: bool) -> bool:
        return True  # all-gather outputs are separate buffers, even for a one-rank group

    def shard(self, model: nn.Module, plan: ShardPlan) -> nn.Module:
        precision = plan.precision
        if precision.buffer_dtype is not None:
            # FSDP2 does not manage buffers: FSDP1's buffer_dtype is emulated with one cast.
            for module in model.modules():
                for name, buf in module._buffers.items():
                    if buf is not None and buf.is_floating_point():
                        module._buffers[name] = buf.to(precision.buffer_dtype)
        full_state = rank0_full_state(model) if plan.sync is SyncMethod.BROADCAST else None

        unit_mp = MixedPrecisionPolicy(
            param_dtype=precision.param_dtype,
            reduce_dtype=precision.reduce_dtype,
            cast_forward_inputs=precision.cast_forward_inputs,
        )
        root_mp = dataclasses.replace(unit_mp, output_dtype=precision.root_output_dtype)
        offload_policy = CPUOffloadPolicy(pin_memory=True) if plan.offload_params else OffloadPolicy()
        ignored = plan.ignored_params or None

        def apply(module: nn.Module, *, is_root: bool) -> None:
            fully_shard(
                module,
                mesh=plan.mesh,
                reshard_after_forward=plan.reshard_after_forward(is_root=is_root),
                mp_policy=root_mp if is_root else unit_mp,
                offload_policy=offload_policy,
                ignored_params=ignored,
            )

        for unit in plan.units:  # children before parents
            apply(unit, is_root=False)
        apply(model, is_root=True)

        if plan.forward_prefetch:
            ordered = _top_level_units(plan.units)
            for unit, following in itertools.pairwise(ordered):
                assert isinstance(unit, FSDPModule) and isinstance(following, FSDPModule)
                unit.set_modules_to_forward_prefetch([following])

        if plan.has_meta and plan.materialize:
            model.to_empty(device=plan.device)
        if plan.sync is SyncMethod.BROADCAST:
            broadcast_from_rank0(model, full_state, plan.device)
        if callable(getattr(model, "generate", None)):
            # generate() calls the inner model's forward, not the root's: without this the
            # root's parameters (embeddings, final norm, head) stay sharded DTensors and the
            # first op mixes them with plain tensors. The hook unshards them for the call.
            register_fsdp_forward_method(model, "generate")
        return model

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        return _no_sync(model)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        params = [p for p in model.parameters() if p.grad is not None]
        sharded = [p for p in params if isinstance(p.grad, DTensor)]
        local = [p for p in params if not isinstance(p.grad, DTensor)]  # ignored params
        norms: list[torch.Tensor] = []
        if sharded:
            # DTensor norms reduce over the shard dimension and stay replicated over
            # the replicate dimension (HSDP), so full_tensor() is the global norm.
            total = torch.nn.utils.get_total_norm([p.grad for p in sharded], norm_type)  # type: ignore[misc]
            norms.append(total.full_tensor() if isinstance(total, DTensor) else total)
        if local:
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in local], norm_type))  # type: ignore[misc]
        if not norms:
            return torch.tensor(0.0)
        stacked = torch.stack([n.float().cpu() for n in norms])
        total_norm = stacked.max() if norm_type == float("inf") else stacked.norm(norm_type)
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for p in params:
            assert p.grad is not None
            p.grad.mul_(coef.item())
        return total_norm

    @contextmanager
    def summon_full_params(
        self, model: nn.Module, *, writeback: bool, rank0_only: bool = False, offload_to_cpu: bool = False
    ) -> Iterator[None]:
        with _full_params(model, writeback=writeback, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu):
            yield

    def local_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        return [p.to_local() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]

    def global_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        params = model.named_parameters(remove_duplicate=False)
        shapes = {strip_wrapper_prefixes(n): tuple(p.shape) for n, p in params}  # a DTensor's shape is the full one
        return {**shapes, **buffer_shapes(model, strip_wrapper_prefixes)}

    def load_local(
        self, model: nn.Module, read_rows: Callable[[str, int, int], torch.Tensor | None]
    ) -> set[str] | None:
        return None  # DTensor state dicts: DCP's Hugging Face reader reads each rank's slices

    def export_pieces(self, model: nn.Module) -> dict[str, FlatTensor] | None:
        return None  # DTensor state dicts hold views of the shards: DCP's writer takes them as they are

    def export_optimizer_pieces(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        return None  # likewise


@contextmanager
def _no_sync(model: nn.Module) -> Iterator[None]:
    assert isinstance(model, FSDPModule)
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@contextmanager
def _full_params(
    model: nn.Module, *, writeback: bool, rank0_only: bool = False, offload_to_cpu: bool = False
) -> Iterator[None]:
    """Swap every DTensor parameter for a full copy; on exit restore (and write back shards).

    ``rank0_only``: every rank takes part in the gather (a collective), only rank 0 swaps.
    """
    import torch.distributed as dist

    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    swapped: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
    full_of: dict[int, nn.Parameter] = {}  # tied parameters share one full copy
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor):
                if id(param) not in full_of:
                    full = param.full_tensor()  # on every rank, once per parameter (tied ones too)
                    if full.data_ptr() == param.to_local().data_ptr():
                        # Nothing to gather (NO_SHARD, one rank): full_tensor() is the shard itself.
                        full = full.clone()
                    if offload_to_cpu:
                        full = full.cpu()
                    full_of[id(param)] = nn.Parameter(full, requires_grad=param.requires_grad)
                if keep:
                    module._parameters[name] = full_of[id(param)]
                    swapped.append((module, name, param, full_of[id(param)]))
    try:
        yield
    finally:
        written: set[int] = set()
        for module, name, sharded, full in swapped:
            module._parameters[name] = sharded
            if writeback and id(sharded) not in written:
                written.add(id(sharded))
                assert isinstance(sharded, DTensor)
                # Each rank takes its own shard of the (identical) full tensor: no communication.
                local = distribute_tensor(full.detach(), sharded.device_mesh, sharded.placements, src_data_rank=None)
                with torch.no_grad():
                    sharded.to_local().copy_(local.to_local())
