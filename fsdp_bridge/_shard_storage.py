"""Move a sharded model's parameter shards to another device, or free their storage, on either backend.

Reinforcement-learning trainers hand the accelerator's memory to a rollout engine between training steps.
FSDP1 code does it through FSDP1's internals: ``_lazy_init(model, model)``, then for each of the root's
flat-parameter handles that CPU offload does not already keep on the CPU, ``handle.flat_param_to(device)``
and ``flat_param._local_shard = flat_param.data`` (so the next reshard points back to the moved shard);
and, before dropping a model, ``_free_storage(unit._handle.flat_param.data)`` for each unit. Each module
gets what that code does for it:

- ``FullyShardedDataParallel`` (the fsdp1 backend, or FSDP1 made by torch): exactly those steps, on each
  outermost FSDP1 module in the model;
- torch's ``fully_shard`` (the fsdp2 backend too): FSDP2's own ``nn.Module._apply`` override (what
  ``module.to(device)`` runs: reshard first, then re-register the moved local shards and their padding)
  applied to the sharded parameters (DTensors) and the gradients they hold, nothing else: buffers and
  parameters outside ``fully_shard`` stay where they are, as FSDP1 moves only its flat parameters.
  Parameters of units under ``CPUOffloadPolicy`` stay on the CPU (FSDP1 skips handles that offload).
  Freeing: ``reshard()`` (the gathered copies), then each shard's storage resized to zero;
- DDP and plain modules: ``model.to(device)`` to move; nothing to free (FSDP1 code frees only its units).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, fully_shard
from torch.distributed.tensor import DTensor

__all__ = ["free_shards", "move_shards"]


def _outermost_fsdp1(model: nn.Module) -> list[FullyShardedDataParallel]:
    found: list[FullyShardedDataParallel] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, FullyShardedDataParallel):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def _fsdp1_move(root: FullyShardedDataParallel, device: torch.device | str, non_blocking: bool) -> None:
    # FSDP1's own steps (torch.distributed.fsdp, private since FSDP1 has no public form of them; present in
    # every torch the project supports): the lazy init builds the root's list of handles.
    from torch.distributed.fsdp._runtime_utils import _lazy_init

    _lazy_init(root, root)
    for handle in root._all_handles:
        if handle._offload_params:  # CPU offload keeps these shards on the CPU itself
            continue
        flat_param = handle.flat_param
        handle.flat_param_to(device, non_blocking=non_blocking)
        flat_param._local_shard = flat_param.data  # the next reshard points the flat parameter here


def _offloaded(model: nn.Module) -> set[int]:
    """ids of the parameters of ``fully_shard`` units under ``CPUOffloadPolicy`` (FSDP2 keeps them on the CPU)."""
    ids: set[int] = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        # FSDP2 exposes its offload policy only on its per-unit state (torch 2.6-2.13: FSDPParam.offload_to_cpu).
        state = fully_shard.state(module)  # type: ignore[attr-defined]
        for group in getattr(state, "_fsdp_param_groups", ()):
            for fsdp_param in group.fsdp_params:
                if fsdp_param.offload_to_cpu:
                    ids.add(id(fsdp_param.sharded_param))
    return ids


def _fsdp2_shards(model: nn.Module) -> list[nn.Parameter]:
    offloaded = _offloaded(model)
    return [p for p in model.parameters() if isinstance(p, DTensor) and id(p) not in offloaded]


def move_shards(model: nn.Module, device: torch.device | str | int, *, non_blocking: bool = False) -> None:
    """Move the parameter shards of ``model`` to ``device`` (and back later): FSDP1 code's
    ``_lazy_init`` + ``handle.flat_param_to(device)`` loop over the root's handles, on either backend.

    Between training steps the shards can live on the CPU while another engine uses the accelerator;
    move them back before the next forward. Local to the rank (no collective). The optimizer's state is
    not moved (move it yourself, as FSDP1 code does).

    Args:
        model: a model returned by :func:`fsdp_bridge.shard` or any other module: FSDP1 (the fsdp1 backend,
            or made by torch) gets FSDP1's own steps for each outermost wrapper, handles under CPU offload
            skipped; torch's ``fully_shard`` (the fsdp2 backend too) has its sharded parameters and their
            gradients moved through FSDP2's ``_apply`` override (what ``module.to`` runs), units under
            ``CPUOffloadPolicy`` skipped, buffers left in place; DDP and plain modules ``model.to(device)``.
        device: where the shards go (``"cpu"``, ``"cuda"``, a ``torch.device`` or a device index).
        non_blocking: copy asynchronously where the devices allow it (pinned CPU memory).

    Returns:
        Nothing: the model's shards are on ``device``.
    """
    target = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    fsdp1 = _outermost_fsdp1(model)
    for root in fsdp1:
        _fsdp1_move(root, target, non_blocking)
    shards = _fsdp2_shards(model)
    if shards:
        ids = {id(p) for p in shards} | {id(p.grad) for p in shards if p.grad is not None}

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(target, non_blocking=non_blocking) if id(t) in ids else t

        # FSDPModule._apply reshards, applies, then re-registers each unit's moved local shards.
        model._apply(move)
    elif not fsdp1:
        model.to(target, non_blocking=non_blocking)


def free_shards(model: nn.Module) -> None:
    """Release the storage of ``model``'s parameter shards before the model is dropped: FSDP1 code's
    ``_free_storage(unit._handle.flat_param.data)`` for each unit, on either backend.

    The model cannot run afterwards (its parameters have no storage); drop it. Local to the rank.

    Args:
        model: a model returned by :func:`fsdp_bridge.shard` or any other module: each FSDP1 unit's flat
            parameter data freed (units without parameters skipped); under torch's ``fully_shard``
            (the fsdp2 backend too) each unit resharded, then every sharded parameter's local storage
            resized to zero; DDP and plain modules hold no shards: nothing is done (FSDP1 code frees
            its units only).

    Returns:
        Nothing.
    """
    for module in model.modules():
        if isinstance(module, FullyShardedDataParallel):
            handle = module._handle
            if handle is not None:
                data = handle.flat_param.data
                if data.untyped_storage().size() > 0:
                    data.untyped_storage().resize_(0)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.reshard()
    for p in model.parameters():
        if isinstance(p, DTensor):
            local = p.to_local()
            if local.untyped_storage().size() > 0:
                local.untyped_storage().resize_(0)
