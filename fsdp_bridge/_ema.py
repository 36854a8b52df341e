"""Step an exponential moving average (EMA) copy of a sharded model towards the model, on either backend.

Diffusion and multimodal trainers keep an EMA copy of the model, sharded by the same call as the model, and
update it after each optimizer step on each rank's shards alone (no collective): FSDP1 code pairs the two
models' flat-parameter handles through FSDP1's private ``_get_fsdp_handles`` and runs
``torch._foreach_mul_(ema, decay)`` then ``torch._foreach_add_(ema, new, alpha=1 - decay)`` on the flat
parameters of the model's units that train. FSDP2 has no handles and no flat parameters: each parameter is
its own DTensor. Two models sharded alike hold matching shards, parameter by parameter, on either backend, so
the same two operations over the pairs of local shards give the same average element by element.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ema_update_"]


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``param``, sharing its storage: a DTensor's local tensor, else the tensor's data
    (FSDP1's flat parameter, or a view into it; a whole parameter of DDP or an unsharded model)."""
    return param.to_local() if isinstance(param, DTensor) else param.data


def _pairs(ema_model: nn.Module, model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The two models' parameters in order, checked to hold matching shards (before anything is written)."""
    ema = list(ema_model.named_parameters())
    new = list(model.named_parameters())
    fix = (
        "shard the EMA copy by the same call as the model (the same class, wrap units, strategy and mesh), "
        "so that its parameters pair with the model's in order"
    )
    if len(ema) != len(new):
        raise ValueError(
            f"fsdp_bridge.ema_update_: the EMA model has {len(ema)} parameters and the model {len(new)}; the "
            f"two must have as many, pairing shard with shard: {fix}"
        )
    for (ema_name, ema_param), (name, param) in zip(ema, new, strict=True):
        if isinstance(ema_param, DTensor) != isinstance(param, DTensor) or (
            isinstance(ema_param, DTensor)
            and isinstance(param, DTensor)
            and (ema_param.placements != param.placements or ema_param.device_mesh != param.device_mesh)
        ):
            raise ValueError(
                f"fsdp_bridge.ema_update_: the EMA model's parameter {ema_name!r} is sharded otherwise than the "
                f"model's {name!r} ({_layout(ema_param)} against {_layout(param)}): {fix}"
            )
        if _local(ema_param).shape != _local(param).shape:
            raise ValueError(
                f"fsdp_bridge.ema_update_: the EMA model's parameter {ema_name!r} holds a shard of shape "
                f"{tuple(_local(ema_param).shape)} on this rank and the model's {name!r} one of "
                f"{tuple(_local(param).shape)}; the two must match: {fix}"
            )
    return [(ema_param, param) for (_, ema_param), (_, param) in zip(ema, new, strict=True)]


def _layout(param: torch.Tensor) -> str:
    if isinstance(param, DTensor):
        return f"a DTensor {tuple(param.placements)} over mesh {param.device_mesh.mesh.tolist()}"
    return "a plain tensor"


@torch.no_grad()
def ema_update_(ema_model: nn.Module, model: nn.Module, decay: float) -> None:
    """Step ``ema_model`` towards ``model`` in place: ``ema = decay * ema + (1 - decay) * model`` on each
    rank's shards, the FSDP1 idiom over ``_get_fsdp_handles`` and flat parameters, on either backend.

    The two models' parameters are paired in order; for each parameter of ``model`` that requires
    gradients, the EMA's local shard is multiplied by ``decay`` and ``(1 - decay)`` times the model's shard
    (cast to the EMA's dtype) is added, with ``torch._foreach_mul_`` and ``torch._foreach_add_`` as the
    FSDP1 code does. Local to the rank (no collective); buffers are left alone, as that code leaves them.
    One difference: FSDP1 code tests ``requires_grad`` on a unit's flat parameter, which requires gradients
    when any parameter of the unit does (``use_orig_params=True``), so a frozen parameter sharing a unit with
    trainable ones was averaged too; here a frozen parameter is skipped (it does not change, so its EMA
    keeps the value it had).

    Args:
        ema_model: the EMA copy, sharded by the same call as ``model`` (returned by :func:`fsdp_bridge.shard`,
            FSDP1 made by torch, torch's ``fully_shard``, DDP or an unsharded module); its parameters need
            not require gradients.
        model: the model being trained, sharded alike.
        decay: the weight the average keeps at each step (``0.9999``: a slow average).

    Returns:
        Nothing: the EMA model's shards hold the new average.

    Raises:
        ValueError: the two models do not pair shard with shard (another number of parameters, a parameter
            sharded otherwise, or a local shard of another shape); nothing is written then.
    """
    ema_shards: list[torch.Tensor] = []
    new_shards: list[torch.Tensor] = []
    for ema_param, param in _pairs(ema_model, model):
        if not param.requires_grad:
            continue
        ema_local = _local(ema_param)
        ema_shards.append(ema_local)
        new_shards.append(_local(param).to(dtype=ema_local.dtype))
    if not ema_shards:
        return
    torch._foreach_mul_(ema_shards, decay)
    torch._foreach_add_(ema_shards, new_shards, alpha=1 - decay)
