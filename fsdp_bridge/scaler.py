"""``fsdp_bridge.GradScaler``: fp16 loss scaling that is right on both backends.

On the fsdp1 backend each rank's gradients are its FSDP1 flat-parameter shards: an inf in one rank's
shard is seen by that rank alone, so the overflow check has to be summed over the ranks or one rank
skips a step the others take. torch's ``ShardedGradScaler`` does that sum (over ``process_group``,
the default group when ``None``). On the fsdp2 backend the gradients are DTensors, whose unscale op
already reduces the check over their mesh; the extra sum over the group changes nothing there (an
inf anywhere is an inf everywhere either way). So one class serves both, with the arguments of
torch's ``ShardedGradScaler``; plain ``torch.amp.GradScaler`` is right on fsdp2 only.
"""

from __future__ import annotations

from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

__all__ = ["GradScaler"]


class GradScaler(ShardedGradScaler):
    """Loss scaler for a model made by :func:`fsdp_bridge.shard` on either backend.

    Same arguments as torch's ``ShardedGradScaler`` (``device="cuda"``, ``init_scale``, ``backoff_factor``,
    ``growth_factor``, ``growth_interval``, ``enabled``, ``process_group``) and the same use as
    ``torch.amp.GradScaler``: ``scaler.scale(loss).backward()``, ``scaler.step(optimizer)``,
    ``scaler.update()``. ``unscale_`` (called by ``step``) sums the overflow check over ``process_group``
    (``None``: the default group), so every rank skips the same steps: on fsdp1, where each rank holds
    its own flat-parameter shard of the gradients, and on fsdp2 (DTensor gradients). Pass the group the
    model is sharded over when that is not every rank and other groups step at other times.
    """
