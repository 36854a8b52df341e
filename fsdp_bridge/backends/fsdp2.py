"""FSDP2: ``torch.distributed.fsdp.fully_shard`` (per-parameter DTensor sharding)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp_bridge.backends.base import ShardPlan
from fsdp_bridge.strategy import Backend

__all__ = ["FSDP2Backend"]


def _top_level_units(units: list[nn.Module]) -> list[nn.Module]:
    """Units not nested in another unit, in forward (registration) order."""
    nested = {id(c) for u in units for c in u.modules() if c is not u}
    return [u for u in units if id(u) not in nested]


class FSDP2Backend:
    backend = Backend.FSDP2

    def shard(self, model: nn.Module, plan: ShardPlan) -> nn.Module:
        config = plan.config
        mp = config.mixed_precision
        if mp.buffer_dtype is not None:
            # FSDP2 does not manage buffers; emulate FSDP1's buffer_dtype with one cast.
            for module in model.modules():
                for name, buf in module._buffers.items():
                    if buf is not None and buf.is_floating_point():
                        module._buffers[name] = buf.to(mp.buffer_dtype)
        full_state = None
        if config.sync_module_states and dist.get_rank() == 0:
            # Rank 0's weights are the source of truth; keep them to broadcast after sharding.
            # References, not copies, on CPU: fully_shard puts new sharded tensors in the module,
            # so these keep the full values alive without a second copy of the model.
            full_state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}

        common = dict(
            mesh=plan.mesh,
            mp_policy=MixedPrecisionPolicy(
                param_dtype=mp.param_dtype,
                reduce_dtype=mp.reduce_dtype,
                output_dtype=mp.output_dtype,
                cast_forward_inputs=mp.cast_forward_inputs,
            ),
            offload_policy=(
                CPUOffloadPolicy(pin_memory=True) if config.cpu_offload and plan.device.type != "cpu" else OffloadPolicy()
            ),
            ignored_params=plan.ignored_params or None,
        )
        for unit in plan.units:  # children before parents
            fully_shard(unit, reshard_after_forward=plan.reshard_after_forward(is_root=False), **common)
        fully_shard(model, reshard_after_forward=plan.reshard_after_forward(is_root=True), **common)

        if config.forward_prefetch:
            ordered = _top_level_units(plan.units)
            for unit, following in zip(ordered, ordered[1:], strict=False):
                assert isinstance(unit, FSDPModule) and isinstance(following, FSDPModule)
                unit.set_modules_to_forward_prefetch([following])

        if plan.has_meta:
            model.to_empty(device=plan.device)
        if config.sync_module_states:
            self._broadcast_from_rank0(model, full_state, plan)
        return model

    @staticmethod
    def _broadcast_from_rank0(model: nn.Module, full_state: dict[str, torch.Tensor] | None, plan: ShardPlan) -> None:
        set_model_state_dict(
            model,
            full_state or {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False),
        )
        # Buffers are not sharded by FSDP2, and non-persistent ones (e.g. RoPE inv_freq)
        # are not in the state dict at all: broadcast every buffer.
        for buf in model.buffers():
            dist.broadcast(buf.data if buf.device == plan.device else buf.data.to(plan.device), src=0)

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
    def summon_full_params(self, model: nn.Module, *, writeback: bool) -> Iterator[None]:
        with _full_params(model, writeback=writeback):
            yield

    def local_numel(self, model: nn.Module) -> int:
        return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())


@contextmanager
def _no_sync(model: nn.Module) -> Iterator[None]:
    assert isinstance(model, FSDPModule)
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@contextmanager
def _full_params(model: nn.Module, *, writeback: bool) -> Iterator[None]:
    """Swap every DTensor parameter for a full copy; on exit restore (and write back shards)."""
    swapped: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
    full_of: dict[int, nn.Parameter] = {}  # tied parameters share one full copy
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor):
                if id(param) not in full_of:
                    full_of[id(param)] = nn.Parameter(param.full_tensor(), requires_grad=param.requires_grad)
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
