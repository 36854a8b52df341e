"""An optimizer built before ``shard()`` is refused at its first step, on every backend.

FSDP2 replaces every parameter of the modules it shards with a new ``DTensor`` parameter.
An optimizer built from the model's parameters before ``shard()`` keeps the old tensors,
which no forward or backward touches any more: it steps nothing and the model silently
does not train (FSDP1 with ``use_orig_params=True``, which the bridge always uses, keeps
the original parameter objects, so there it works). ``shard()`` records the parameters it
replaced; one process-wide optimizer step pre-hook checks each optimizer at its first step
and raises, naming the fix. Every rank builds its optimizer the same way, so every rank
raises at the same step, before any collective of that step. Later steps cost one lookup
in a weak set.

The same first-step check refuses a bitsandbytes optimizer (``AdamW8bit``, ``PagedAdamW8bit``, ...) or an apex one
(``FusedAdam``, ``FusedLAMB``) over FSDP2's DTensor parameters, whose custom update kernels have no DTensor rule
(they fail inside, naming a "mixed torch.Tensor and DTensor" call, or find no storage): on FSDP1 its flat shards
were plain tensors. It also refuses a parameter group that mixes
FSDP2's DTensor parameters with plain tensors (parameters in ``ignored_modules``, scalar parameters) when the
optimizer would use its multi-tensor (``foreach``) or fused kernels, which refuse that mix: torch's default on
CUDA. FSDP1's parameters are all plain tensors, so code that worked there fails on FSDP2 with an error from inside
the optimizer's kernels otherwise.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_bridge.errors import ConfigError, Problem

__all__ = ["forget_replaced", "record_replaced"]

_replaced: dict[int, weakref.ref[torch.Tensor]] = {}
"""id -> weak reference of each parameter shard() replaced (a tensor's ``==`` is elementwise, so not
a WeakSet); an entry goes when nothing, e.g. an optimizer, holds the parameter any more."""
_checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_lock = threading.Lock()
_hook: Any = None


def record_replaced(before: list[torch.nn.Parameter], after: list[torch.nn.Parameter]) -> None:
    """Remember the parameters of ``before`` that are not in ``after`` (and install the check once)."""
    global _hook
    kept = {id(p) for p in after}
    replaced = [p for p in before if id(p) not in kept]
    if not replaced:
        return
    with _lock:
        for p in replaced:
            _replaced[id(p)] = weakref.ref(p, functools.partial(_drop, id(p)))
        if _hook is None:
            _hook = register_optimizer_step_pre_hook(_check)


def _drop(key: int, ref: weakref.ref[torch.Tensor]) -> None:
    if _replaced.get(key) is ref:
        del _replaced[key]


def _is_replaced(p: torch.Tensor) -> bool:
    ref = _replaced.get(id(p))
    return ref is not None and ref() is p


def forget_replaced() -> None:
    """Drop the records (tests)."""
    with _lock:
        _replaced.clear()
        _checked.clear()


def _mixed_group_problem(optimizer: torch.optim.Optimizer) -> Problem | None:
    from torch.distributed.tensor import DTensor

    for index, group in enumerate(optimizer.param_groups):
        params = group["params"]
        plain = [p for p in params if not isinstance(p, DTensor)]
        if not plain or len(plain) == len(params):
            continue
        multi_tensor = group.get("foreach") or group.get("fused")
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            # torch's own optimizers (those with a foreach option) default to it on CUDA; others are not judged
            multi_tensor = any(p.device.type == "cuda" for p in params)
        if multi_tensor:
            name = type(optimizer).__name__
            return Problem(
                "optimizer",
                f"{name} parameter group {index} mixing {len(params) - len(plain)} sharded (DTensor) parameters "
                f"with {len(plain)} plain tensors (parameters in ignored_modules, or scalars FSDP2 cannot shard), "
                "stepped with foreach/fused kernels",
                "one kind of tensor per parameter group, or foreach=False",
                "give the plain tensors a group of their own: "
                f"torch.optim.{name}([{{'params': [p for p in model.parameters() if isinstance(p, DTensor)]}}, "
                f"{{'params': [p for p in model.parameters() if not isinstance(p, DTensor)]}}], ...) "
                "(DTensor from torch.distributed.tensor), or pass foreach=False; torch's multi-tensor kernels "
                "refuse the mix",
            )
    return None


def _kernels_problem(optimizer: torch.optim.Optimizer) -> Problem | None:
    """A bitsandbytes optimizer (8-bit, paged or 32-bit) or an apex one (``FusedAdam``, ``FusedLAMB``: multi-tensor
    kernels reading raw storage) over FSDP2's DTensor parameters: their update kernels have no DTensor rule, and
    fail at the step with an error from inside them (or read no storage at all)."""
    from torch.distributed.tensor import DTensor

    name = type(optimizer).__name__
    library = type(optimizer).__module__.split(".", 1)[0]
    if library not in ("bitsandbytes", "apex"):
        return None
    owner = "bitsandbytes'" if library == "bitsandbytes" else "apex's"
    sharded = sum(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])
    if not sharded:
        return None
    return Problem(
        "optimizer",
        f"{owner} {name} over {sharded} sharded (DTensor) parameters",
        "an optimizer whose update runs on DTensors (torch.optim's), or plain-tensor parameters",
        f"{owner} optimizer kernels take plain tensors only: shard this model with "
        "BridgeConfig(backend='fsdp1') (FSDP1's flat shards are plain tensors, as the FSDP1 code had them), "
        f"or step it with torch.optim (e.g. torch.optim.AdamW in place of {name})",
    )


def _check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _checked:
        return
    kernels = _kernels_problem(optimizer)
    if kernels is not None:
        raise ConfigError([kernels])
    mixed = _mixed_group_problem(optimizer)
    if mixed is not None:
        raise ConfigError([mixed])
    stale = sum(1 for group in optimizer.param_groups for p in group["params"] if _is_replaced(p))
    if stale:
        total = sum(len(group["params"]) for group in optimizer.param_groups)
        raise ConfigError(
            [
                Problem(
                    "optimizer",
                    f"{type(optimizer).__name__} holding {stale} of {total} parameters from before shard()",
                    "an optimizer built from the sharded model's parameters",
                    "build the optimizer after fsdp_bridge.shard(model, ...): optimizer = "
                    f"torch.optim.{type(optimizer).__name__}(model.parameters(), ...); the parameters it holds were "
                    "replaced by sharded ones, so stepping it would train nothing",
                )
            ]
        )
    _checked.add(optimizer)
