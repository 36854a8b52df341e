"""FSDP1's wrapper settings (``.sharding_strategy``, ``.mixed_precision``) read on either backend: what code
migrated from FSDP1 reads instead of those attributes, which ``FSDPModule`` does not have."""

from __future__ import annotations

from typing import Any, cast

from torch import nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, MixedPrecision

from fsdp_bridge.api import Bridge, bridge_of

__all__ = ["FSDP1Settings", "fsdp1_settings"]


class FSDP1Settings:
    """What FSDP1's wrapper answers for ``.sharding_strategy`` and ``.mixed_precision``, read when asked (see
    :func:`fsdp1_settings`); for an object :func:`shard` did not make, the object's own attribute."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def _bridge(self) -> Bridge | None:
        if isinstance(self._module, FullyShardedDataParallel):
            return None  # FSDP1's own attributes are FSDP1's answer
        return bridge_of(self._module)

    @property
    def sharding_strategy(self) -> torch_fsdp.ShardingStrategy:
        """torch's FSDP1 ``ShardingStrategy`` member: ``NO_SHARD`` when the shard group has one rank, as FSDP1."""
        bridge = self._bridge()
        if bridge is None and isinstance(self._module, FSDPModule):
            return _fsdp2_strategy(self._module)  # sharded by torch's own fully_shard (--target torch code)
        if bridge is None:
            return cast(torch_fsdp.ShardingStrategy, self._module.sharding_strategy)
        name = bridge.config.strategy.name
        if bridge.mesh.size(bridge.mesh.ndim - 1) == 1:
            return torch_fsdp.ShardingStrategy.NO_SHARD  # FSDP1 clamps any strategy to NO_SHARD on one rank
        return torch_fsdp.ShardingStrategy[("_" if name == "HYBRID_SHARD_ZERO2" else "") + name]

    @property
    def mixed_precision(self) -> MixedPrecision:
        """torch's FSDP1 ``MixedPrecision``; all fields ``None`` when none was set (FSDP1's is never ``None``)."""
        bridge = self._bridge()
        if bridge is None:
            return cast(MixedPrecision, self._module.mixed_precision)
        mp = bridge.config.mixed_precision
        if not mp.enabled:
            return MixedPrecision()
        return MixedPrecision(
            param_dtype=mp.param_dtype,
            reduce_dtype=mp.reduce_dtype,
            buffer_dtype=mp.buffer_dtype,
            cast_forward_inputs=mp.cast_forward_inputs,
            cast_root_forward_inputs=mp.cast_root_forward_inputs,
        )


def _fsdp2_strategy(module: FSDPModule) -> torch_fsdp.ShardingStrategy:
    """FSDP1's name for how torch's ``fully_shard`` sharded ``module``: from its mesh (a shard group of one rank
    is NO_SHARD, a 2D mesh HYBRID) and whether it reshards after forward (read from FSDP2's state). A root
    answers for its units, as FSDP1's root does: the root itself stays gathered after forward under either
    strategy (FSDP1 keeps it for the backward that follows; torch's own lazy init and the generated helpers
    set it so)."""
    units = [m for m in cast(nn.Module, module).modules() if m is not module and isinstance(m, FSDPModule)]
    try:
        group = (units[0] if units else module)._get_fsdp_state()._fsdp_param_group
    except AssertionError:  # several parameter groups on the unit (torch 2.13 asks for one): its first's mesh
        group = None
    if group is None:  # nothing of its own it shards
        return torch_fsdp.ShardingStrategy.NO_SHARD
    mesh = group.mesh_info.mesh
    if mesh.size(mesh.ndim - 1) == 1:
        return torch_fsdp.ShardingStrategy.NO_SHARD
    reshards = bool(group.post_forward_mesh_info is not None)
    if mesh.ndim == 2:
        hybrid = torch_fsdp.ShardingStrategy.HYBRID_SHARD
        return hybrid if reshards else torch_fsdp.ShardingStrategy._HYBRID_SHARD_ZERO2
    return torch_fsdp.ShardingStrategy.FULL_SHARD if reshards else torch_fsdp.ShardingStrategy.SHARD_GRAD_OP


def fsdp1_settings(module: Any) -> FSDP1Settings:
    """FSDP1's ``module.sharding_strategy`` and ``module.mixed_precision``, on either backend: what migrated
    code reads instead of those attributes, which ``FSDPModule`` does not have.

    For a model returned by :func:`shard` or any unit in it, what FSDP1 would say for its config; for a module
    torch's own ``fully_shard`` sharded, the strategy its mesh and resharding amount to; for an
    FSDP1 wrapper (or any other object: a test's stand-in) its own attribute, so a read that worked before
    the migration works after it, and one that raised ``AttributeError`` still does.

    Args:
        module: a model returned by :func:`shard`, a unit sharded in it, a ``FullyShardedDataParallel``, or
            any object with those attributes.

    Returns:
        An object whose ``.sharding_strategy`` and ``.mixed_precision`` are read when accessed, as torch's
        FSDP1 types with FSDP1's member and field names.
    """
    return FSDP1Settings(module)
