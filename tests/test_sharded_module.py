"""fsdp_bridge.ShardedModule: what migrated code's FSDP1 class became where it was a value (a validator's type,
a tuple for isinstance, Optional[FSDP]). isinstance is is_sharded; never instantiated. One process: a plain
module, stand-ins of FSDP1's wrapper and of torch's own fully_shard, and pydantic's isinstance schema (models
sharded by shard() on both backends are checked in tests/test_any_module.py's spawn)."""

from __future__ import annotations

from typing import Annotated, Any

import pytest
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

import fsdp_bridge
from fsdp_bridge import ShardedModule


def _fsdp1_stand_in() -> nn.Module:
    unit = nn.Linear(2, 2)
    unit.__class__ = type("Wrapped", (FullyShardedDataParallel,), {})  # FSDP1's wrapper without a process group
    return unit


def _torch_fully_shard_stand_in() -> nn.Module:
    unit = nn.Linear(2, 2)
    unit.__class__ = type("TorchSharded", (FSDPModule, nn.Linear), {})  # torch's own fully_shard, not shard()
    return unit


def test_isinstance_is_is_sharded() -> None:
    for module in (nn.Linear(2, 2), _fsdp1_stand_in(), _torch_fully_shard_stand_in(), object(), None):
        assert isinstance(module, ShardedModule) is fsdp_bridge.is_sharded(module)
    assert isinstance(_fsdp1_stand_in(), ShardedModule)
    assert not isinstance(nn.Linear(2, 2), ShardedModule)
    # torch's own fully_shard keeps its own path, as FSDP1's isinstance(m, FSDP) said for it
    assert not isinstance(_torch_fully_shard_stand_in(), ShardedModule)
    # in tuples and unions, as FSDP1 code kept its class
    assert isinstance(_fsdp1_stand_in(), (nn.Sequential, ShardedModule))
    assert isinstance(None, ShardedModule | None) and not isinstance(nn.Linear(2, 2), ShardedModule | None)


def test_issubclass_takes_both_backends_classes() -> None:
    assert issubclass(FullyShardedDataParallel, ShardedModule)
    assert issubclass(type(_fsdp1_stand_in()), ShardedModule)
    assert issubclass(FSDPModule, ShardedModule) and issubclass(type(_torch_fully_shard_stand_in()), ShardedModule)
    assert issubclass(ShardedModule, ShardedModule) and issubclass(ShardedModule, nn.Module)
    assert not issubclass(nn.Linear, ShardedModule) and not issubclass(
        nn.parallel.DistributedDataParallel, ShardedModule
    )


def test_calling_it_says_what_to_use() -> None:
    with pytest.raises(TypeError, match=r"not a wrapper: got a call ShardedModule\(...\).*fsdp_bridge\.shard\(model"):
        ShardedModule()
    with pytest.raises(TypeError, match=r"fsdp_bridge\.shard"):
        ShardedModule(nn.Linear(2, 2))


def test_a_pydantic_field_validated_with_isinstance() -> None:
    pydantic = pytest.importorskip("pydantic")
    from pydantic_core import core_schema

    class InstanceOf:
        """A validator of one's own: the field's value must be an instance of ``kind``."""

        def __init__(self, kind: type) -> None:
            self.kind = kind

        def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
            return core_schema.is_instance_schema(self.kind)

    class Holder(pydantic.BaseModel):
        model: Annotated[ShardedModule, InstanceOf(ShardedModule)]

    wrapped = _fsdp1_stand_in()
    assert Holder(model=wrapped).model is wrapped
    for refused in (nn.Linear(2, 2), _torch_fully_shard_stand_in()):
        with pytest.raises(pydantic.ValidationError, match="instance of ShardedModule"):
            Holder(model=refused)
