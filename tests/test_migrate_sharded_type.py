"""``migrate code``: FSDP1's wrapper class used as a type a value is checked against (a validator's class in
``Annotated``, ``Optional[FSDP]`` aliases, annotations) becomes ``fsdp_bridge.ShardedModule``;
``issubclass(type(m), FSDP)`` becomes ``fsdp_bridge.is_sharded(m)``; tuples kept in a variable, default
arguments and subclasses stay TODOs. One process: what the codemod writes, and the written code run."""

from __future__ import annotations

import types

import pytest
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

from fsdp_bridge.migrate._code import TODO, migrate_source

SOURCE = """\
from typing import Annotated, Optional, Union

import typing as t
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel as DDP


class MustBe:
    def __init__(self, kind):
        self.kind = kind

    def check(self, value):
        if not isinstance(value, self.kind):
            raise TypeError(f"want {self.kind.__name__}")
        return value


ShardedField = Annotated[FSDP, MustBe(FSDP)]
MaybeSharded = Optional[FSDP]
EitherKind = t.Union[FSDP, DDP]
Loose = FSDP | nn.Linear
WRAPPERS = (DDP, FSDP)


def field_check(value):
    return ShardedField.__metadata__[0].check(value)


def is_wrapped(m):
    return issubclass(type(m), FSDP)


def units(model: FSDP) -> list[Optional[FSDP]]:
    return [model]


def unwrap(m):
    if isinstance(m, WRAPPERS):
        return m.module
    return m
"""


def _fsdp1_stand_in() -> nn.Module:
    unit = nn.Linear(2, 2)
    unit.__class__ = type("Wrapped", (FullyShardedDataParallel,), {})
    return unit


def test_the_class_as_a_type_becomes_sharded_module() -> None:
    result = migrate_source(SOURCE, "types_as_values.py")
    fixed = result.fixed
    assert "ShardedField = Annotated[fsdp_bridge.ShardedModule, MustBe(fsdp_bridge.ShardedModule)]" in fixed
    assert "MaybeSharded = Optional[fsdp_bridge.ShardedModule]" in fixed
    assert "EitherKind = t.Union[fsdp_bridge.ShardedModule, DDP]" in fixed
    assert "Loose = fsdp_bridge.ShardedModule | nn.Linear" in fixed
    assert "return fsdp_bridge.is_sharded(m)" in fixed
    assert "def units(model: fsdp_bridge.ShardedModule) -> list[Optional[fsdp_bridge.ShardedModule]]:" in fixed
    # a tuple kept in a variable stays a TODO: the code it guards reads m.module, which FSDP2 modules lack
    assert "WRAPPERS = (DDP, FSDP)" in fixed and fixed.count(TODO) == 1
    (todo,) = [f for f in result.findings if not f.fixable]
    assert todo.line == 23 and "a tuple kept for a later isinstance" in todo.replacement
    fixed_lines = {f.line: f.replacement for f in result.findings if f.fixable}
    assert fixed_lines[19].startswith("fsdp_bridge.ShardedModule (isinstance(m, fsdp_bridge.ShardedModule) is")
    assert migrate_source(fixed, "types_as_values.py").fixed == fixed  # idempotent


def test_the_written_validator_accepts_what_is_sharded_only() -> None:
    fixed = migrate_source(SOURCE, "types_as_values.py").fixed
    code = types.ModuleType("types_as_values")
    exec(compile(fixed, "types_as_values.py", "exec"), code.__dict__)
    wrapped = _fsdp1_stand_in()
    assert code.field_check(wrapped) is wrapped and code.is_wrapped(wrapped)
    assert isinstance(wrapped, code.MaybeSharded) and isinstance(wrapped, code.Loose)
    torch_own = nn.Linear(2, 2)
    torch_own.__class__ = type("TorchSharded", (FSDPModule, nn.Linear), {})  # torch's own fully_shard
    for refused in (nn.Linear(2, 2), torch_own):
        with pytest.raises(TypeError, match="want ShardedModule"):
            code.field_check(refused)
        assert not code.is_wrapped(refused)


def test_look_alikes_are_not_rewritten() -> None:
    source = """\
from typing import Annotated, List
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class Mine(FSDP):
    pass


Listed = List[FSDP]
Wrapped = Annotated[int, FSDP]


def pick(m, kinds=(FSDP,)):
    return isinstance(m, kinds) or issubclass(m, FSDP)
"""
    result = migrate_source(source, "look_alikes.py")
    code = "\n".join(line for line in result.fixed.splitlines() if TODO not in line)
    assert "ShardedModule" not in code and "is_sharded" not in code
    # the subclass, List[...] (not a type tested at run time by the codemod's reading), Annotated metadata given
    # the class itself (not as a call's argument), the default argument and issubclass(m, ...) keep TODOs
    assert sorted(f.line for f in result.findings if not f.fixable) == [5, 9, 10, 13, 14]


def test_target_torch_writes_fsdp_module() -> None:
    result = migrate_source(SOURCE, "types_as_values.py", target="torch")
    code = result.fixed
    assert "ShardedField = Annotated[FSDPModule, MustBe(FSDPModule)]" in code
    assert "MaybeSharded = Optional[FSDPModule]" in code
    assert "return isinstance(m, FSDPModule)" in code
    assert "def units(model: FSDPModule) -> list[Optional[FSDPModule]]:" in code
    assert "fsdp_bridge.ShardedModule" not in "\n".join(line for line in code.splitlines() if TODO not in line)
    assert migrate_source(code, "types_as_values.py", target="torch").fixed == code
