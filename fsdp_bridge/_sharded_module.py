"""``fsdp_bridge.ShardedModule``: the class FSDP1 code names where it asks "is this a sharded model" at run time.

FSDP1 code uses ``FullyShardedDataParallel`` itself as a value: a pydantic field type with a validator doing
``isinstance`` (``Annotated[FSDP, InstanceOf(FSDP)]``), ``Optional[FSDP]`` aliases, annotations. On the bridge's
fsdp2 backend the model is no FSDP1 wrapper, and torch's ``FSDPModule`` in its place would refuse the models the
fsdp1 backend makes. ``ShardedModule`` answers
both: ``isinstance(x, ShardedModule)`` is :func:`fsdp_bridge.is_sharded` (models made by :func:`shard` and
their units on either backend, and FSDP1 wrappers), and the class is never instantiated.
"""

from __future__ import annotations

from typing import Any, NoReturn

from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

from fsdp_bridge.api import is_sharded

__all__ = ["ShardedModule"]


class _ShardedModuleType(type):
    """The metaclass: ``isinstance`` asks :func:`is_sharded`; ``issubclass`` asks the two backends' classes."""

    def __instancecheck__(cls, instance: object) -> bool:
        return is_sharded(instance)

    def __subclasscheck__(cls, subclass: type) -> bool:
        if subclass is cls:
            return True
        return isinstance(subclass, type) and issubclass(subclass, (FullyShardedDataParallel, FSDPModule))

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            "fsdp_bridge.ShardedModule is a type to test against (isinstance(model, fsdp_bridge.ShardedModule), "
            "an annotation, a pydantic field type), not a wrapper: got a call ShardedModule(...). Shard a model "
            "with model = fsdp_bridge.shard(model, fsdp_bridge.BridgeConfig(...)), which returns a ShardedModule "
            "instance on either backend"
        )


class ShardedModule(nn.Module, metaclass=_ShardedModuleType):
    """The type of a sharded model on either backend, for ``isinstance`` checks, annotations and validators.

    ``isinstance(x, ShardedModule)`` is exactly :func:`fsdp_bridge.is_sharded` ``(x)``: True for a model returned
    by :func:`shard` and every unit sharded in it (FSDP1 wrappers on the fsdp1 backend, ``FSDPModule`` units on
    fsdp2) and for FSDP1's ``FullyShardedDataParallel`` made by torch directly; False for plain modules, DDP and
    modules sharded with torch's own ``fully_shard`` outside :func:`shard` (as FSDP1's ``isinstance(m, FSDP)``
    was for those). Where FSDP1 code used its wrapper class as a type (``Annotated[FSDP, Validator(FSDP)]``,
    ``Optional[FSDP]``, annotations), this class takes its place; ``migrate code --target torch`` writes torch's
    ``FSDPModule`` for it. A tuple of wrapper classes (``WRAPPERS = (DDP, FSDP)``) is not rewritten: code it
    guards often reads the wrapper's ``.module``, which an FSDP2 model has not.

    ``issubclass(C, ShardedModule)`` is True for FSDP1's ``FullyShardedDataParallel`` and ``FSDPModule`` and
    their subclasses. A class cannot tell a unit of :func:`shard` from one of torch's own ``fully_shard`` (both
    are ``FSDPModule`` classes): test instances with ``isinstance``.

    Raises:
        TypeError: when called; shard a model with :func:`shard` instead.
    """
