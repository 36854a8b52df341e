"""Steps both backends share (kept here so neither backend module imports the other)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from fsdp_bridge.distributed import broadcast_in_place

__all__ = ["broadcast_from_rank0", "compile_units", "rank0_full_state", "state_entries"]


def rank0_full_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """On rank 0, the unsharded model's state on CPU (the source of truth); else None.

    References, not copies, for tensors already on CPU: sharding puts new tensors in the
    module, so these keep the full values alive without a second copy of the model.
    """
    if dist.get_rank() != 0:
        return None
    return {k: v.detach().to("cpu") for k, v in model.state_dict().items()}


def broadcast_from_rank0(model: nn.Module, full_state: dict[str, torch.Tensor] | None, device: torch.device) -> None:
    """Give every rank rank 0's weights in the already-sharded ``model``.

    Each rank receives only its shards (``broadcast_from_rank0``).  Buffers are not
    sharded, and non-persistent ones (e.g. RoPE ``inv_freq``) are not in the state
    dict at all, so every buffer is broadcast as well.
    """
    set_model_state_dict(
        model,
        cast(dict[str, Any], full_state or {}),
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False),
    )
    for buf in model.buffers():
        broadcast_in_place(buf.data, device, src=0)


def move_ignored_to(plan: Any, device: torch.device) -> None:
    """Move what ``ignored_modules`` names to the run's device.

    Neither torch's FSDP1 (``device_id``) nor ``fully_shard`` moves the states it does not manage:
    they would stay where the model was built (the CPU) while the rest computes on the GPU.
    """
    if device.type == "meta":
        return
    for module in plan.ignored_modules:
        if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            module.to(device)
    for param in plan.ignored_params:
        if not param.is_meta and param.device != device:
            param.data = param.data.to(device)


def buffer_shapes(model: nn.Module, clean: Callable[[str], str]) -> dict[str, tuple[int, ...]]:
    """Clean name -> shape of the persistent buffers (those a state dict holds); never sharded."""
    shapes = {}
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                shapes[clean(f"{prefix}.{name}" if prefix else name)] = tuple(buf.shape)
    return shapes


_FLAT_PARAM = "_flat_param"  # FSDP1 registers each unit's flat parameter under this name


def state_entries(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is a buffer) of each entry ``module.state_dict()`` would hold, in its
    order (tied names each), without running the backends' state-dict hooks (FSDP1's gather)."""
    for name, param in module._parameters.items():
        if param is not None and name != _FLAT_PARAM:
            yield prefix + name, param, False
    for name, buf in module._buffers.items():
        if buf is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, buf, True
    for name, child in module._modules.items():
        if child is not None:
            yield from state_entries(child, f"{prefix}{name}.")


def compile_units(units: list[nn.Module], options: dict[str, Any] | None) -> None:
    """``unit.compile(**options)`` on each unit, before the backend shards it (regional compilation:
    torch compiles each unit's forward at its first call; the backend's hooks run between the regions).
    Nothing when ``options`` is None."""
    if options is not None:
        for unit in units:
            unit.compile(**options)


def whole(tensor: Any) -> torch.Tensor:
    """``tensor.full_tensor()`` of a DTensor (a collective), its shard moved first to the device its mesh
    reduces on where they differ: FSDP2's CPU offload keeps shards and gradients in host memory while the
    mesh (an NCCL group, with no CPU backend) is CUDA's, as torch's own state-dict gathering does."""
    if tensor.device.type != tensor.device_mesh.device_type:
        tensor = tensor.to(tensor.device_mesh.device_type)
    return cast(torch.Tensor, tensor.full_tensor())
