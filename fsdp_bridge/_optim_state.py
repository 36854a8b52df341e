"""torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` make the state of an optimizer that has
none (no step yet, no gradients) by stepping it once, with zero gradients and the learning rate set to 0. That
step is not always a no-op: Adam and AdamW with ``eps=0`` divide 0 by 0 and write NaN into every parameter, and
an optimizer that computes its own rate (``lr=None``, a relative step) moves them. The state it leaves (step 1,
zero moments) also shifts the bias correction of every later step. FSDP1's optimizer state-dict calls never
step the optimizer. :func:`init_step_undone` puts the parameters back as they were and, for a read, leaves the
optimizer without state again, so that saving before the first step (or loading into a fresh optimizer) changes
nothing of the training that follows in this process. The state a read returns is torch's (step 1, zero
moments): a run resumed from a checkpoint saved before the first step starts from it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["init_step_undone"]


def _each(optimizer: Any) -> list[torch.optim.Optimizer]:
    """torch's state-dict calls take one optimizer or several."""
    return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)


def _stepped_by_torch(optimizer: torch.optim.Optimizer) -> bool:
    """Whether torch's state-dict calls would step ``optimizer`` to make its state (its ``_init_optim_state``:
    no state yet, and no parameter with a gradient)."""
    if optimizer.state:
        return False
    return all(p.grad is None for group in optimizer.param_groups for p in group["params"])


@contextlib.contextmanager
def init_step_undone(optimizer: Any, *, reading: bool) -> Iterator[None]:
    """Around one of torch's optimizer state-dict calls: where torch steps ``optimizer`` to make its state, the
    parameters get their values back afterwards (this rank's shard of each: one more copy of it meanwhile), and
    after a read (``reading=True``: ``get_optimizer_state_dict``) the optimizer has no state again; a load
    (``set_optimizer_state_dict``) keeps the state it loaded."""
    stepped = [o for o in _each(optimizer) if _stepped_by_torch(o)]
    if not stepped:
        yield
        return
    params = list({id(p): p for o in stepped for group in o.param_groups for p in group["params"]}.values())
    with torch.no_grad():
        saved = [_local(p).clone() for p in params]
    try:
        yield
    finally:
        with torch.no_grad():
            for param, value in zip(params, saved, strict=True):
                _local(param).copy_(value)
        if reading:
            for o in stepped:
                o.state.clear()


def _local(param: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's values of ``param`` (a DTensor's local shard)."""
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) else param
