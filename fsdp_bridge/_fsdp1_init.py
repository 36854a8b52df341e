"""FSDP1's initialisation of meta-device modules, for configs made by ``BridgeConfig.from_fsdp1``.

FSDP1 materialises a model built on the meta device itself, on every rank, when each unit is
wrapped: with ``param_init_fn(module)`` for every module of the unit, or, without one, with
``module.to_empty(device, recurse=False); module.reset_parameters()`` for every module that holds
tensors of its own. Units are wrapped children before parents and each one's modules are visited
breadth-first, not entering units wrapped already or ignored modules, so random initialisers draw
in that order. Without ``sync_module_states`` each rank keeps what it drew (FSDP1 code seeds every
rank alike for that). This module does the same before the bridge shards, so a migrated model starts
from the weights FSDP1 would have given it, on either backend. (Ranks seeded differently would hold
different full tensors; each keeps its own shard of its own draw, and FSDP1's flat-parameter shards
are not FSDP2's per-parameter ones, so only then the two differ.)
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

import torch
from torch import nn

from fsdp_bridge.errors import Problem

__all__ = ["materialize_like_fsdp1", "reset_parameters_problems"]


def _own_states(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def reset_parameters_problems(model: nn.Module) -> list[Problem]:
    """Modules with meta-device tensors of their own and no ``reset_parameters`` (FSDP1 raises)."""
    missing = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if any(t.is_meta for t in _own_states(m)) and not callable(getattr(m, "reset_parameters", None))
        }
    )
    if not missing:
        return []
    return [
        Problem(
            "param_init_fn",
            f"None, with meta-device modules that have no reset_parameters(): {', '.join(missing)}",
            "a param_init_fn, or reset_parameters() on every module holding meta-device tensors",
            "pass FSDP1's param_init_fn (e.g. lambda m: m.to_empty(device=..., recurse=False) and your init), "
            "or build the model on a real device, or set sync_module_states=True with real weights on rank 0",
        )
    ]


def _breadth_first(root: nn.Module, skip: set[nn.Module]) -> list[nn.Module]:
    order: list[nn.Module] = []
    queue = collections.deque([root])
    seen = {root}
    while queue:
        module = queue.popleft()
        order.append(module)
        for child in module.children():
            if child not in seen and child not in skip:
                seen.add(child)
                queue.append(child)
    return order


def materialize_like_fsdp1(
    model: nn.Module,
    units: Iterable[nn.Module],
    ignored_modules: Iterable[nn.Module],
    ignored_params: Iterable[nn.Parameter],
    init: Callable[[nn.Module], object] | None,
    device: torch.device,
) -> None:
    """Give ``model``'s meta-device tensors the values FSDP1 would: unit by unit (``units`` in post-order,
    then the root), ``init`` on each module of a unit that holds meta tensors, or ``reset_parameters``."""
    ignored = set(ignored_modules)
    ignored_ids = {id(p) for p in ignored_params} | {id(p) for m in ignored for p in m.parameters()}
    done: set[nn.Module] = set()
    inside_done: set[int] = set()
    for unit in [*units, model]:
        managed = [p for p in unit.parameters() if id(p) not in ignored_ids and id(p) not in inside_done]
        buffers = [b for m in unit.modules() if m not in ignored for b in m.buffers(recurse=False)]
        if any(p.is_meta for p in managed) or any(b.is_meta for b in buffers):
            modules = _breadth_first(unit, done | ignored)
            for module in modules:
                if init is not None:
                    init(module)  # as FSDP1 calls it: not under no_grad
                elif _own_states(module):
                    with torch.no_grad():
                        module.to_empty(device=device, recurse=False)
                        module.reset_parameters()  # type: ignore[operator]
        done.add(unit)
        inside_done |= {id(p) for p in unit.parameters()}
