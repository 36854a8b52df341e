"""The backend registry: the only place that chooses an implementation by name."""

from __future__ import annotations

from collections.abc import Collection

from fsdp_bridge.backends.base import BackendImpl, ShardPlan
from fsdp_bridge.strategy import Backend

__all__ = ["BackendImpl", "ShardPlan", "backend_inside", "get_backend", "model_class_name", "sharded_by"]


def get_backend(backend: Backend) -> BackendImpl:
    """The implementation of ``backend`` (imported lazily: FSDP1 and FSDP2 pull in different torch modules).

    Args:
        backend: which FSDP.

    Returns:
        A new :class:`BackendImpl` for it.
    """
    if backend is Backend.FSDP1:
        from fsdp_bridge.backends.fsdp1 import FSDP1Backend

        return FSDP1Backend()
    from fsdp_bridge.backends.fsdp2 import FSDP2Backend

    return FSDP2Backend()


def backend_inside(model: object) -> Backend | None:
    """The backend whose modules ``model`` is or holds, for calls on a part of a sharded model.

    Args:
        model: anything; an ``nn.Module``, or an object that hands ``modules()`` on to one (a trainer's
            model class forwarding attribute reads to the module it holds, which FSDP1's own
            ``state_dict_type`` and ``fsdp_modules`` take too), can hold FSDP modules.

    Returns:
        ``Backend.FSDP1`` for FSDP1 wrappers, ``Backend.FSDP2`` for ``fully_shard`` modules or
        DTensor parameters (the first found in ``model.modules()`` order), None for neither.
    """
    from torch import nn
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    if isinstance(model, nn.Module):
        modules = model.modules()
    else:
        found = getattr(model, "modules", None)
        modules = found() if callable(found) else iter(())
    for module in modules:
        if not isinstance(module, nn.Module):
            return None
        if isinstance(module, FullyShardedDataParallel):
            return Backend.FSDP1
        if isinstance(module, FSDPModule) or any(isinstance(p, DTensor) for p in module._parameters.values()):
            return Backend.FSDP2
    return None


def sharded_by(model: object, skip: Collection[object] = ()) -> str | None:
    """Which FSDP already wraps ``model`` or one of its submodules (raw torch calls), if any.

    Args:
        model: anything; only an ``nn.Module`` can hold FSDP modules.
        skip: modules sharded by the bridge itself; they and everything under them are not looked at.

    Returns:
        ``"FullyShardedDataParallel (FSDP1) (at <name>)"`` or ``"fully_shard (FSDP2) (at <name>)"``
        for the first such module, None when there is none.
    """
    from torch import nn
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if not isinstance(model, nn.Module):
        return None
    skipped = {id(m) for unit in skip if isinstance(unit, nn.Module) for m in unit.modules()}
    for name, module in model.named_modules():
        if id(module) in skipped:
            continue
        where = f" (at {name})" if name else ""
        if isinstance(module, FullyShardedDataParallel):
            return f"FullyShardedDataParallel (FSDP1){where}"
        if isinstance(module, FSDPModule):
            return f"fully_shard (FSDP2){where}"
    return None


def model_class_name(model: object) -> str:
    """The class name of the user's model, whichever FSDP sharded it: FSDP1 returns a
    ``FullyShardedDataParallel`` wrapper holding it as ``.module``; FSDP2's ``fully_shard``
    changes its class to a subclass named ``FSDP<Cls>``.  Recorded in checkpoint descriptions.

    Args:
        model: a module, sharded by either backend or not at all.

    Returns:
        The name of the user's class (``LlamaForCausalLM``, never ``FSDPLlamaForCausalLM``).
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        model = model.module
    cls = type(model)
    if isinstance(model, FSDPModule):
        cls = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    return cls.__name__
