"""Every row of the translation table, on each backend: what ``shard()`` asks torch for, in one process.

For each (option, case) of :data:`fsdp_bridge.mapping.TABLE` with a ``when`` and each backend,
:data:`EXPECTED` names a config that matches the row and the facts the row's text promises: the
arguments of ``FullyShardedDataParallel`` / ``fully_shard``, or what the bridge does around them
(a forward hook, buffers cast, rank 0's weights broadcast, checkpoint wrappers).  Unsupported
rows are refused by ``BridgeConfig`` with a ConfigError naming the option.

``shard()`` runs as it would on rank 0 of 6 ranks (2 per node) with the collectives out of the way:
the process group and the mesh are faked, torch's two FSDP entry points are recorders, and
rank 0's state broadcast only records that it happened.  Nothing is spawned.
"""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
from torch.distributed.fsdp import BackwardPrefetch as TorchPrefetch
from torch.distributed.fsdp import (
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

import fsdp_bridge.api as api
from fsdp_bridge import BridgeConfig
from fsdp_bridge.backends import fsdp1 as fsdp1_module
from fsdp_bridge.backends import fsdp2 as fsdp2_module
from fsdp_bridge.backends._common import rank0_full_state
from fsdp_bridge.errors import ConfigError
from fsdp_bridge.mapping import TABLE, Outcome, translate
from fsdp_bridge.strategy import Backend

WORLD, PER_NODE = 6, 2  # hybrid meshes are (3, 2): nodes x ranks per node, told apart from (2, 3)
BF16, FP32 = torch.bfloat16, torch.float32
CUDA1 = torch.device("cuda", 1)  # this rank's GPU on a faked machine with GPUs (LOCAL_RANK=1)


# -- the model -----------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x))


class Net(nn.Module):
    """Three blocks in a ModuleList (the units ``wrap: auto`` finds), a head, a floating-point and an
    integer buffer, and a Hugging Face-like ``config`` with the KV cache on.

    ``tied``: the head shares the first block's weight.  ``adapter``: bf16 blocks, the second
    holding an fp32 adapter, as peft upcasts LoRA weights in a bf16 model."""

    scale: torch.Tensor

    def __init__(self, variant: str = "plain") -> None:
        super().__init__()
        blocks = [Block() for _ in range(3)]
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(4, 4)
        if variant == "tied":
            self.head.weight = blocks[0].proj.weight
        if variant == "adapter":
            self.blocks.to(BF16)
            blocks[1].add_module("adapter", nn.Linear(4, 2))
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.config = SimpleNamespace(use_cache=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.scale)


# -- running shard() with recorders --------------------------------------------------------------


@dataclass(frozen=True)
class FakeMesh:
    """What build_mesh would have created (the recorders only pass it on)."""

    shape: tuple[int, ...]
    device_type: str
    mesh_dim_names: tuple[str, ...]

    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass
class Call:
    module: nn.Module
    kwargs: dict[str, Any]
    cls: str
    """The module's class name when torch was called on it."""


@dataclass
class Run:
    backend: Backend
    model: Net
    sharded: nn.Module
    calls: list[Call]
    events: list[str]
    forward_prefetch: list[tuple[Any, list[Any]]]
    backward_prefetch: list[tuple[Any, list[Any]]]
    meta_at_broadcast: list[bool]
    """Whether the model held meta tensors when rank 0's state was broadcast into it."""
    broadcast_keys: list[str]
    """The entries of rank 0's state broadcast."""
    process_group: dict[str, Any]
    warned: list[str]
    again: Callable[[int], Run]
    """The same shard() at another world size."""

    def path(self, module: nn.Module) -> str:
        if module is self.model:
            return "(root)"
        return next(n for n, m in self.model.named_modules() if m is module)

    def param_names(self, params: set[nn.Parameter]) -> list[str]:
        return sorted(n for n, p in self.model.named_parameters() if p in params)

    @property
    def fsdp1(self) -> dict[str, Any]:
        (call,) = self.calls  # FSDP1 is one constructor call on the root
        assert call.module is self.model
        return call.kwargs

    @property
    def fsdp1_units(self) -> list[nn.Module]:
        policy = self.fsdp1["auto_wrap_policy"]
        return [] if policy is None else [m for m in self.model.modules() if policy._lambda_fn(m)]

    @property
    def units(self) -> list[nn.Module]:
        if self.backend is Backend.FSDP1:
            return self.fsdp1_units
        assert self.calls[-1].module is self.model  # FSDP2: the root is sharded last
        return [c.module for c in self.calls[:-1]]


def _same(values: list[Any]) -> Any:
    """The value every call was given, or the list when they differ."""
    return values[0] if all(v == values[0] for v in values) else values


def _mesh(run: Run) -> FakeMesh:
    mesh: FakeMesh = run.fsdp1["device_mesh"] if run.backend is Backend.FSDP1 else run.calls[-1].kwargs["mesh"]
    return mesh


def _output_dtype(run: Run) -> torch.dtype:
    out: torch.Tensor = run.sharded(torch.ones(2, 4))
    return out.dtype


# What can be observed of a run, by name.  FSDP1's arguments are read by their own names.
FACTS: dict[str, Callable[[Run], Any]] = {
    "mesh": lambda r: _mesh(r).shape,
    "mesh dims": lambda r: _mesh(r).mesh_dim_names,
    "mesh device": lambda r: _mesh(r).device_type,
    "process group": lambda r: (r.process_group["backend"], r.process_group["device_id"]),
    # the modules sharded as units of their own (FSDP1: those its auto_wrap_policy selects)
    "units": lambda r: [r.path(m) for m in r.units],
    "unit classes": lambda r: sorted(
        {type(m).__name__ for m in r.units} if r.backend is Backend.FSDP1 else {c.cls for c in r.calls[:-1]}
    ),
    "checkpoint_impl": lambda r: _same([getattr(m, "checkpoint_impl", None) for m in r.units]),
    "use_cache": lambda r: r.model.config.use_cache,
    # FSDP2: one value per fully_shard call (units, then the root) or, where all agree, that value
    "fully_shard calls": lambda r: [r.path(c.module) for c in r.calls],
    "fully_shard arguments": lambda r: _same([sorted(c.kwargs) for c in r.calls]),
    "reshard_after_forward": lambda r: [c.kwargs["reshard_after_forward"] for c in r.calls],
    "reshard_after_forward at world size 1": lambda r: [c.kwargs["reshard_after_forward"] for c in r.again(1).calls],
    "mp_policy of units": lambda r: _same([c.kwargs["mp_policy"] for c in r.calls[:-1]]),
    "mp_policy of the root": lambda r: r.calls[-1].kwargs["mp_policy"],
    "offload_policy": lambda r: _same([c.kwargs["offload_policy"] for c in r.calls]),
    "ignored_params": lambda r: _same(
        [None if (p := c.kwargs["ignored_params"]) is None else r.param_names(p) for c in r.calls]
    ),
    "set_modules_to_forward_prefetch": lambda r: [(r.path(u), [r.path(m) for m in ms]) for u, ms in r.forward_prefetch],
    "set_modules_to_backward_prefetch": lambda r: [
        (r.path(u), [r.path(m) for m in ms]) for u, ms in r.backward_prefetch
    ],
    # around the torch call
    "events": lambda r: [e for i, e in enumerate(r.events) if i == 0 or r.events[i - 1] != e],  # fully_shard once
    "meta tensors at the broadcast": lambda r: r.meta_at_broadcast,
    "head entries broadcast": lambda r: sorted(k for k in r.broadcast_keys if k.startswith("head.")),
    "meta tensors after": lambda r: any(t.is_meta for t in (*r.model.parameters(), *r.model.buffers())),
    "buffers": lambda r: {n: b.dtype for n, b in r.model.named_buffers()},
    # FSDP1's emulated output cast; FSDP2's hook that frees the units a forward without gradients left gathered
    # is checked by test_migrate_code.py::test_fsdp2_units_reshard_after_a_forward_without_gradients.
    "forward hooks on the root": lambda r: sum(
        getattr(h, "__name__", "") != "_reshard_after_no_grad_forward" for h in r.sharded._forward_hooks.values()
    ),
    "output dtype": _output_dtype,
    "float8": lambda r: getattr(r.model, "float8_seen", None),  # (config, layers converted) by torchao
    # modules whose calls run through torch.compile (nn.Module.compile), before sharding
    "compiled": lambda r: [r.path(m) for m in r.model.modules() if m._compiled_call_impl is not None],
    "NO_SHARD warnings": lambda r: [w for w in r.warned if "NO_SHARD" in w],
}


def observe(run: Run, name: str) -> Any:
    """The fact ``name`` (a key of FACTS, or an argument FSDP1 was given) of ``run``."""
    if name in FACTS:
        return FACTS[name](run)
    assert run.backend is Backend.FSDP1, f"{name!r} is neither a fact (FACTS) nor an FSDP1 argument"
    value = run.fsdp1.get(name) if name == "param_init_fn" else run.fsdp1[name]  # given for meta models only
    if name == "ignored_modules" and value is not None:
        return [run.path(m) for m in value]
    if name == "ignored_states" and value is not None:  # modules by path, parameters by name
        return [
            run.path(m) if isinstance(m, nn.Module) and not isinstance(m, nn.Parameter) else run.param_names({m})[0]
            for m in value
        ]
    if name == "param_init_fn" and value is not None:
        return type(value).__name__
    return value


@dataclass(frozen=True)
class Expect:
    fields: dict[str, Any]
    """The config (besides ``backend``) that matches the row."""
    facts: dict[str, Any]
    """What shard() must have done: fact name (FACTS, or an FSDP1 argument) -> value."""
    gpus: bool = False
    """The machine has GPUs (faked): ``device: auto`` resolves to this rank's, cuda:1."""
    meta: bool = False
    """The model is built on the meta device, as FSDP1 code builds it on ranks > 0 (this is rank 1)."""
    model: str = "plain"
    """The variant of :class:`Net`: plain, tied or adapter."""
    torchao: bool = False
    """A recording stand-in for torchao is importable and the GPU has float8 matmuls (capability 9.0)."""


@dataclass(frozen=True)
class Refused:
    """The row is unsupported on the backend: ``BridgeConfig`` raises, naming the option."""

    fields: dict[str, Any]


def _fake_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchao.float8 as the bridge calls it: the conversion records, on the model, the config it was given
    and the layers its filter chose."""

    class Float8LinearConfig:
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs = kwargs

        @classmethod
        def from_recipe_name(cls, name: str) -> Float8LinearConfig:
            return cls(recipe_name=name)

    def convert_to_float8_training(model: nn.Module, *, config: Any, module_filter_fn: Any) -> nn.Module:
        chosen = [n for n, m in model.named_modules() if module_filter_fn(m, n)]
        model.float8_seen = (config.kwargs, chosen)  # type: ignore[assignment]
        return model

    package = types.ModuleType("torchao")
    package.__spec__ = importlib.machinery.ModuleSpec("torchao", None)
    float8 = types.ModuleType("torchao.float8")
    float8.Float8LinearConfig = Float8LinearConfig  # type: ignore[attr-defined]
    float8.convert_to_float8_training = convert_to_float8_training  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchao", package)
    monkeypatch.setitem(sys.modules, "torchao.float8", float8)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def _shard(monkeypatch: pytest.MonkeyPatch, backend: Backend, expect: Expect, world: int = WORLD) -> Run:
    """shard() on a fresh model as rank 0 (rank 1 for a meta-device model) of ``world`` ranks would
    run it, with torch's FSDP entry points, the process group, the mesh and the broadcast recorded."""
    calls: list[Call] = []
    events: list[str] = []
    forward: list[tuple[Any, list[Any]]] = []
    backward: list[tuple[Any, list[Any]]] = []
    unused: list[bool] = []
    meta_at_broadcast: list[bool] = []
    broadcast_keys: list[str] = []
    process_group: dict[str, Any] = {}
    rank = 1 if expect.meta else 0
    for name, value in [
        ("RANK", rank),
        ("WORLD_SIZE", world),
        ("LOCAL_RANK", 1),
        ("LOCAL_WORLD_SIZE", min(PER_NODE, world)),
    ]:
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: expect.gpus)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if expect.gpus else 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(api.dist, "is_initialized", lambda: False)  # whatever ran before in this process
    monkeypatch.setattr(api.dist, "init_process_group", lambda **kwargs: process_group.update(kwargs))
    monkeypatch.setattr(api.dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(api.dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(api.dist, "broadcast_object_list", lambda objects, src=0, group=None: None)  # dtypes agree
    monkeypatch.setattr(api, "build_mesh", lambda plan, device_type: FakeMesh(plan.shape, device_type, plan.dim_names))

    def has_meta(module: nn.Module) -> bool:
        return any(t.is_meta for t in (*module.parameters(), *module.buffers()))

    def take_rank0_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
        events.append("rank 0's state taken")
        return rank0_full_state(model)

    def broadcast(model: nn.Module, state: dict[str, torch.Tensor] | None, device: torch.device) -> None:
        events.append("broadcast from rank 0")
        meta_at_broadcast.append(has_meta(model))
        broadcast_keys.extend(state or {})

    for backend_module in (fsdp1_module, fsdp2_module):
        monkeypatch.setattr(backend_module, "rank0_full_state", take_rank0_state)
        monkeypatch.setattr(backend_module, "broadcast_from_rank0", broadcast)

    def fsdp1(module: nn.Module, **kwargs: Any) -> nn.Module:
        calls.append(Call(module, kwargs, type(module).__name__))
        events.append("FullyShardedDataParallel")
        if kwargs["sharding_strategy"] is TorchStrategy.NO_SHARD:  # as torch warns
            warnings.warn("NO_SHARD is deprecated: use DistributedDataParallel", FutureWarning, stacklevel=2)
        init = kwargs.get("param_init_fn")
        if init is not None:  # as torch: on each module holding meta tensors
            for m in module.modules():
                if any(t.is_meta for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))):
                    init(m)
        return module

    class Sharded(FSDPModule):
        """What fully_shard makes a module: an FSDPModule (here recording its prefetch settings)."""

        def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
            forward.append((self, list(modules)))

        def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
            backward.append((self, list(modules)))

        def set_reduce_scatter_unused_params(self, enabled: bool, *, recurse: bool = True) -> None:
            unused.append(enabled)  # FSDP1's zero gradients for unused parameters (tests/test_any_module.py runs it)

        def _apply(self, *args: Any, **kwargs: Any) -> Any:  # to_empty: FSDP2's would reshard first
            return nn.Module._apply(self, *args, **kwargs)  # type: ignore[arg-type]

    def fully_shard(module: nn.Module, **kwargs: Any) -> nn.Module:
        calls.append(Call(module, kwargs, type(module).__name__))
        events.append("fully_shard")
        module.__class__ = type(f"FSDP{type(module).__name__}", (Sharded, type(module)), {})
        return module

    if expect.torchao:
        _fake_torchao(monkeypatch)
    monkeypatch.setattr(fsdp1_module, "FullyShardedDataParallel", fsdp1)
    monkeypatch.setattr(fsdp2_module, "fully_shard", fully_shard)

    with torch.device("meta" if expect.meta else "cpu"):
        model = Net(expect.model)
    config = BridgeConfig(backend=backend.value, **expect.fields)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded = api.shard(model, config)
    return Run(
        backend=backend,
        model=model,
        sharded=sharded,
        calls=calls,
        events=events,
        forward_prefetch=forward,
        backward_prefetch=backward,
        meta_at_broadcast=meta_at_broadcast,
        broadcast_keys=broadcast_keys,
        process_group=process_group,
        warned=[str(w.message) for w in caught],
        again=lambda size: _shard(monkeypatch, backend, expect, size),
    )


BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]
ROOT = "(root)"
FULLY_SHARD_ARGUMENTS = ["ignored_params", "mesh", "mp_policy", "offload_policy", "reshard_after_forward"]
BUFFERS = {"scale": FP32, "count": torch.int64}
NO_CASTS = {"cast_forward_inputs": False, "cast_root_forward_inputs": False}
T, F = True, False


def fsdp1_precision(kept: tuple[type[nn.Module], ...] = (), **dtypes: Any) -> MixedPrecision:
    """FSDP1's MixedPrecision as the bridge builds it: every unit casts its inputs, as FSDP2's units do, and
    the classes kept in full precision are the config's (no BatchNorm in Net: FSDP1's default finds none)."""
    return MixedPrecision(
        **dtypes, cast_forward_inputs=True, cast_root_forward_inputs=True, _module_classes_to_ignore=kept
    )


SHARDED_BROADCAST = ["rank 0's state taken", "fully_shard", "broadcast from rank 0"]

# (option, case, backend) -> the config for the row and what the row's text promises.
# Every row of TABLE with a `when` needs an entry for each backend (test_every_row_has_an_expectation).
EXPECTED: dict[tuple[str, str, str], Expect | tuple[Expect, ...] | Refused] = {
    # -- strategy: FSDP1's ShardingStrategy; FSDP2's mesh and per-call reshard_after_forward (units, then the root)
    ("strategy", "full_shard", "fsdp1"): Expect(
        {"strategy": "full_shard"}, {"sharding_strategy": TorchStrategy.FULL_SHARD, "mesh": (6,)}
    ),
    ("strategy", "full_shard", "fsdp2"): Expect(
        {"strategy": "full_shard"},
        {
            "mesh": (6,),
            "reshard_after_forward": [T, T, T, F],
            "reshard_after_forward at world size 1": [T, T, T, T],
        },
    ),
    ("strategy", "shard_grad_op", "fsdp1"): Expect(
        {"strategy": "shard_grad_op"}, {"sharding_strategy": TorchStrategy.SHARD_GRAD_OP, "mesh": (6,)}
    ),
    ("strategy", "shard_grad_op", "fsdp2"): Expect(
        {"strategy": "shard_grad_op"},
        {
            "mesh": (6,),
            "reshard_after_forward": [F, F, F, F],
            "reshard_after_forward at world size 1": [T, T, T, T],
        },
    ),
    ("strategy", "no_shard", "fsdp1"): Expect(
        {"strategy": "no_shard"},
        {"sharding_strategy": TorchStrategy.NO_SHARD, "mesh": (6,), "NO_SHARD warnings": []},
    ),
    ("strategy", "no_shard", "fsdp2"): Expect(
        {"strategy": "no_shard"},
        {"mesh": (6, 1), "mesh dims": ("replicate", "shard"), "reshard_after_forward": [T, T, T, T]},
    ),
    ("strategy", "hybrid_shard", "fsdp1"): Expect(
        {"strategy": "hybrid_shard"},
        {"sharding_strategy": TorchStrategy.HYBRID_SHARD, "mesh": (3, 2), "mesh dims": ("replicate", "shard")},
    ),
    ("strategy", "hybrid_shard", "fsdp2"): Expect(
        {"strategy": "hybrid_shard"},
        {
            "mesh": (3, 2),
            "mesh dims": ("replicate", "shard"),
            "reshard_after_forward": [T, T, T, F],
            "reshard_after_forward at world size 1": [T, T, T, T],
        },
    ),
    ("strategy", "hybrid_shard_zero2", "fsdp1"): Expect(
        {"strategy": "hybrid_shard_zero2"},
        {"sharding_strategy": TorchStrategy._HYBRID_SHARD_ZERO2, "mesh": (3, 2)},
    ),
    ("strategy", "hybrid_shard_zero2", "fsdp2"): Expect(
        {"strategy": "hybrid_shard_zero2"},
        {
            "mesh": (3, 2),
            "reshard_after_forward": [F, F, F, F],
            "reshard_after_forward at world size 1": [T, T, T, T],
        },
    ),
    # -- hybrid_shape: (nodes, ranks per node) by default
    ("hybrid_shape", "default", "fsdp1"): Expect(
        {"strategy": "hybrid_shard"}, {"mesh": (3, 2), "mesh dims": ("replicate", "shard")}
    ),
    ("hybrid_shape", "default", "fsdp2"): Expect(
        {"strategy": "hybrid_shard"}, {"mesh": (3, 2), "mesh dims": ("replicate", "shard")}
    ),
    ("hybrid_shape", "[replicate, shard]", "fsdp1"): Expect(
        {"strategy": "hybrid_shard", "hybrid_shape": [2, 3]}, {"mesh": (2, 3), "mesh dims": ("replicate", "shard")}
    ),
    ("hybrid_shape", "[replicate, shard]", "fsdp2"): Expect(
        {"strategy": "hybrid_shard", "hybrid_shape": [2, 3]}, {"mesh": (2, 3), "mesh dims": ("replicate", "shard")}
    ),
    ("hybrid_shape", "null (not hybrid)", "fsdp1"): Expect({}, {"mesh": (6,), "mesh dims": ("shard",)}),
    ("hybrid_shape", "null (not hybrid)", "fsdp2"): Expect({}, {"mesh": (6,), "mesh dims": ("shard",)}),
    # -- wrap: the same units on both backends; a unit holding half of a tied pair is merged into its
    # parent; FSDP1 adds a unit for each module holding another dtype than its unit
    ("wrap", "none", "fsdp1"): Expect({"wrap": "none"}, {"auto_wrap_policy": None}),
    ("wrap", "none", "fsdp2"): Expect({"wrap": "none"}, {"fully_shard calls": [ROOT]}),
    ("wrap", "auto / classes / min_num_params / callable", "fsdp1"): (
        Expect({"wrap": ["Block"]}, {"units": ["blocks.1", "blocks.2"]}, model="tied"),
        Expect({"wrap": ["Block"]}, {"units": [*BLOCKS[:2], "blocks.1.adapter", "blocks.2"]}, model="adapter"),
    ),
    ("wrap", "auto / classes / min_num_params / callable", "fsdp2"): (
        Expect({"wrap": ["Block"]}, {"fully_shard calls": ["blocks.1", "blocks.2", ROOT]}, model="tied"),
        Expect({"wrap": ["Block"]}, {"fully_shard calls": [*BLOCKS, ROOT]}, model="adapter"),
    ),
    # -- mixed precision
    ("mixed_precision", "fp32 (off)", "fsdp1"): Expect({}, {"mixed_precision": None}),
    ("mixed_precision", "fp32 (off)", "fsdp2"): Expect(
        {}, {"mp_policy of units": MixedPrecisionPolicy(), "mp_policy of the root": MixedPrecisionPolicy()}
    ),
    ("mixed_precision", "param/reduce dtypes", "fsdp1"): (
        Expect(
            {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32", **NO_CASTS}},
            {
                "mixed_precision": MixedPrecision(
                    param_dtype=BF16,
                    reduce_dtype=FP32,
                    cast_forward_inputs=False,
                    cast_root_forward_inputs=False,
                    _module_classes_to_ignore=(),
                )
            },
        ),
        Expect(  # FSDP1's own default: the root casts its inputs, the other units do not
            {"mixed_precision": {"param_dtype": "bf16", "cast_forward_inputs": False}},
            {"mixed_precision": MixedPrecision(param_dtype=BF16, _module_classes_to_ignore=())},
        ),
    ),
    ("mixed_precision", "param/reduce dtypes", "fsdp2"): (
        Expect(
            {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32", **NO_CASTS}},
            {
                "mp_policy of units": MixedPrecisionPolicy(
                    param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=False
                ),
                "mp_policy of the root": MixedPrecisionPolicy(
                    param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=False
                ),
            },
        ),
        Expect(  # FSDP1's default on FSDP2: only the root's fully_shard casts
            {"mixed_precision": {"param_dtype": "bf16", "cast_forward_inputs": False}},
            {
                "mp_policy of units": MixedPrecisionPolicy(param_dtype=BF16, cast_forward_inputs=False),
                "mp_policy of the root": MixedPrecisionPolicy(param_dtype=BF16, cast_forward_inputs=True),
            },
        ),
    ),
    ("mixed_precision.output_dtype", "set", "fsdp1"): Expect(
        {"mixed_precision": {"param_dtype": "bf16", "output_dtype": "fp16"}},
        {
            "mixed_precision": fsdp1_precision(param_dtype=BF16),  # FSDP1 has no output dtype
            "forward hooks on the root": 1,
            "output dtype": torch.float16,  # the recorder leaves the model in fp32: the hook casts
        },
    ),
    ("mixed_precision.output_dtype", "set", "fsdp2"): Expect(
        {"mixed_precision": {"param_dtype": "bf16", "output_dtype": "fp16"}},
        {
            "mp_policy of units": MixedPrecisionPolicy(param_dtype=BF16),
            "mp_policy of the root": MixedPrecisionPolicy(param_dtype=BF16, output_dtype=torch.float16),
            "forward hooks on the root": 0,
        },
    ),
    ("mixed_precision.output_dtype", "null", "fsdp1"): Expect(
        {"mixed_precision": "bf16"}, {"forward hooks on the root": 0, "output dtype": FP32}
    ),
    ("mixed_precision.output_dtype", "null", "fsdp2"): Expect(
        {"mixed_precision": "bf16"},
        {"mp_policy of the root": MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32), "output dtype": FP32},
    ),
    ("mixed_precision.buffer_dtype", "set", "fsdp1"): Expect(
        {"mixed_precision": {"buffer_dtype": "bf16"}},
        {"mixed_precision": fsdp1_precision(buffer_dtype=BF16), "buffers": BUFFERS},  # FSDP1 casts in forward
    ),
    ("mixed_precision.buffer_dtype", "set", "fsdp2"): Expect(
        {"mixed_precision": {"buffer_dtype": "bf16"}},
        {"buffers": {"scale": BF16, "count": torch.int64}, "mp_policy of units": MixedPrecisionPolicy()},
    ),
    ("mixed_precision.buffer_dtype", "null", "fsdp1"): Expect(
        {"mixed_precision": "bf16"},
        {"mixed_precision": fsdp1_precision(param_dtype=BF16, reduce_dtype=FP32), "buffers": BUFFERS},
    ),
    ("mixed_precision.buffer_dtype", "null", "fsdp2"): Expect({"mixed_precision": "bf16"}, {"buffers": BUFFERS}),
    ("mixed_precision.full_precision_modules", "class names (null: BatchNorm when there are wrap units)", "fsdp1"): (
        Expect(
            {"mixed_precision": {"param_dtype": "bf16", "full_precision_modules": ["Block"]}},
            {
                "mixed_precision": fsdp1_precision((Block,), param_dtype=BF16),
                "units": ["blocks.0", "blocks.1", "blocks.2"],
            },
        )
    ),
    ("mixed_precision.full_precision_modules", "class names (null: BatchNorm when there are wrap units)", "fsdp2"): (
        Expect(
            {"mixed_precision": {"param_dtype": "bf16", "full_precision_modules": ["Block"]}},
            {
                "mp_policy of units": MixedPrecisionPolicy(),  # each block: no mixed precision, hooks cast around it
                "mp_policy of the root": MixedPrecisionPolicy(param_dtype=BF16),
                "units": ["blocks.0", "blocks.1", "blocks.2"],
            },
        )
    ),
    ("mixed_precision.full_precision_modules", "[] (none; null without wrap units)", "fsdp1"): Expect(
        {"mixed_precision": {"param_dtype": "bf16", "full_precision_modules": []}},
        {"mixed_precision": fsdp1_precision(param_dtype=BF16)},
    ),
    ("mixed_precision.full_precision_modules", "[] (none; null without wrap units)", "fsdp2"): Expect(
        {"mixed_precision": "bf16", "wrap": "none"},
        {"mp_policy of the root": MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32), "units": []},
    ),
    # -- prefetch and rate limiting
    ("backward_prefetch", "pre", "fsdp1"): Expect(
        {"backward_prefetch": "pre"}, {"backward_prefetch": TorchPrefetch.BACKWARD_PRE}
    ),
    ("backward_prefetch", "pre", "fsdp2"): Expect(
        {"backward_prefetch": "pre"},
        {"set_modules_to_backward_prefetch": [], "fully_shard arguments": FULLY_SHARD_ARGUMENTS},
    ),
    ("backward_prefetch", "post", "fsdp1"): Expect(
        {"backward_prefetch": "post"}, {"backward_prefetch": TorchPrefetch.BACKWARD_POST}
    ),
    ("backward_prefetch", "post", "fsdp2"): Refused({"backward_prefetch": "post"}),
    ("backward_prefetch", "none", "fsdp1"): Expect({"backward_prefetch": "none"}, {"backward_prefetch": None}),
    ("backward_prefetch", "none", "fsdp2"): Expect(  # each unit prefetches only itself: no implicit prefetch
        {"backward_prefetch": "none"},
        {
            "set_modules_to_backward_prefetch": [
                ("blocks.0", ["blocks.0"]),
                ("blocks.1", ["blocks.1"]),
                ("blocks.2", ["blocks.2"]),
                ("(root)", ["(root)"]),
            ]
        },
    ),
    ("backward_prefetch", "integer N (units ahead)", "fsdp1"): Refused({"backward_prefetch": 2}),
    ("backward_prefetch", "integer N (units ahead)", "fsdp2"): (
        Expect(
            {"backward_prefetch": 2, "wrap": ["Block", "Linear"]},  # nearest first: backward's order
            {
                "set_modules_to_backward_prefetch": [
                    ("blocks.1", ["blocks.0"]),
                    ("blocks.2", ["blocks.1", "blocks.0"]),
                    ("head", ["blocks.2", "blocks.1"]),
                ],
                "set_modules_to_forward_prefetch": [],
            },
        ),
        Expect(
            {"backward_prefetch": 1, "forward_prefetch": 1},
            {
                "set_modules_to_backward_prefetch": [("blocks.1", ["blocks.0"]), ("blocks.2", ["blocks.1"])],
                "set_modules_to_forward_prefetch": [("blocks.0", ["blocks.1"]), ("blocks.1", ["blocks.2"])],
            },
        ),
    ),
    ("forward_prefetch", "true", "fsdp1"): Expect({"forward_prefetch": True}, {"forward_prefetch": True}),
    ("forward_prefetch", "true", "fsdp2"): Expect(
        {"forward_prefetch": True, "wrap": ["Block", "Linear"]},  # units in units: only the outer ones prefetch
        {
            "fully_shard calls": [
                "blocks.0.proj",
                "blocks.0",
                "blocks.1.proj",
                "blocks.1",
                "blocks.2.proj",
                "blocks.2",
                "head",
                ROOT,
            ],
            "set_modules_to_forward_prefetch": [
                ("blocks.0", ["blocks.1"]),
                ("blocks.1", ["blocks.2"]),
                ("blocks.2", ["head"]),
            ],
        },
    ),
    ("forward_prefetch", "integer N (units ahead)", "fsdp1"): Refused({"forward_prefetch": 1}),
    ("forward_prefetch", "integer N (units ahead)", "fsdp2"): (
        Expect(
            {"forward_prefetch": 2, "wrap": ["Block", "Linear"]},  # nested units keep the implicit prefetch
            {
                "set_modules_to_forward_prefetch": [
                    ("blocks.0", ["blocks.1", "blocks.2"]),
                    ("blocks.1", ["blocks.2", "head"]),
                    ("blocks.2", ["head"]),
                ],
                "set_modules_to_backward_prefetch": [],
            },
        ),
        Expect(  # a depth beyond the last unit: what is left
            {"forward_prefetch": 9, "wrap": ["Block"]},
            {"set_modules_to_forward_prefetch": [("blocks.0", ["blocks.1", "blocks.2"]), ("blocks.1", ["blocks.2"])]},
        ),
    ),
    ("forward_prefetch", "false", "fsdp1"): Expect({"forward_prefetch": False}, {"forward_prefetch": False}),
    ("forward_prefetch", "false", "fsdp2"): Expect(
        {"forward_prefetch": False}, {"set_modules_to_forward_prefetch": []}
    ),
    ("limit_all_gathers", "any", "fsdp1"): Expect({"limit_all_gathers": False}, {"limit_all_gathers": False}),
    ("limit_all_gathers", "any", "fsdp2"): Expect(
        {"limit_all_gathers": False}, {"fully_shard arguments": FULLY_SHARD_ARGUMENTS}
    ),
    # -- offload, checkpointing, init
    ("cpu_offload", "true, on CPU", "fsdp1"): Expect({"cpu_offload": True}, {"cpu_offload": None}),
    ("cpu_offload", "true, on CPU", "fsdp2"): Expect({"cpu_offload": True}, {"offload_policy": OffloadPolicy()}),
    ("cpu_offload", "true, on an accelerator", "fsdp1"): Expect(
        {"cpu_offload": True}, {"cpu_offload": CPUOffload(offload_params=True)}, gpus=True
    ),
    ("cpu_offload", "true, on an accelerator", "fsdp2"): Expect(
        {"cpu_offload": True}, {"offload_policy": CPUOffloadPolicy(pin_memory=True)}, gpus=True
    ),
    ("cpu_offload", "false", "fsdp1"): Expect({}, {"cpu_offload": None}, gpus=True),
    ("cpu_offload", "false", "fsdp2"): Expect({}, {"offload_policy": OffloadPolicy()}, gpus=True),
    ("activation_checkpointing", "true", "fsdp1"): Expect(
        {"activation_checkpointing": True},
        {
            "units": BLOCKS,
            "unit classes": ["CheckpointWrapper"],
            "checkpoint_impl": CheckpointImpl.NO_REENTRANT,
            "use_cache": False,
        },
    ),
    ("activation_checkpointing", "true", "fsdp2"): Expect(
        {"activation_checkpointing": True},
        {
            "fully_shard calls": [*BLOCKS, ROOT],
            "unit classes": ["CheckpointWrapper"],
            "checkpoint_impl": CheckpointImpl.NO_REENTRANT,
            "use_cache": False,
        },
    ),
    ("activation_checkpointing", "false", "fsdp1"): Expect({}, {"unit classes": ["Block"], "use_cache": True}),
    ("activation_checkpointing", "false", "fsdp2"): Expect({}, {"unit classes": ["Block"], "use_cache": True}),
    ("sync_module_states", "true, on CPU", "fsdp1"): Expect(
        {"sync_module_states": True},
        {
            "sync_module_states": False,  # FSDP1's own refuses CPU tensors
            "param_init_fn": "_MetaMaterializer",
            "events": ["rank 0's state taken", "FullyShardedDataParallel", "broadcast from rank 0"],
            "meta tensors at the broadcast": [False],
        },
        meta=True,
    ),
    ("sync_module_states", "true, on CPU", "fsdp2"): Expect(
        {"sync_module_states": True},
        {"events": SHARDED_BROADCAST, "meta tensors at the broadcast": [False], "meta tensors after": False},
        meta=True,
    ),
    ("sync_module_states", "true, on an accelerator", "fsdp1"): Expect(
        {"sync_module_states": True},
        {"sync_module_states": True, "param_init_fn": None, "events": ["FullyShardedDataParallel"]},
        gpus=True,
    ),
    ("sync_module_states", "true, on an accelerator", "fsdp2"): Expect(
        {"sync_module_states": True}, {"events": SHARDED_BROADCAST}, gpus=True
    ),
    ("sync_module_states", "false", "fsdp1"): Expect(
        {}, {"sync_module_states": False, "events": ["FullyShardedDataParallel"]}
    ),
    ("sync_module_states", "false", "fsdp2"): Expect({}, {"events": ["fully_shard"]}),
    # -- reshard_after_forward (FSDP2: one value per fully_shard call, the root's last)
    ("reshard_after_forward", "null (from the strategy)", "fsdp1"): Expect(
        {}, {"sharding_strategy": TorchStrategy.FULL_SHARD}
    ),
    ("reshard_after_forward", "null (from the strategy)", "fsdp2"): Expect({}, {"reshard_after_forward": [T, T, T, F]}),
    ("reshard_after_forward", "no_shard + override", "fsdp1"): Expect(
        {"strategy": "no_shard", "reshard_after_forward": False}, {"sharding_strategy": TorchStrategy.NO_SHARD}
    ),
    ("reshard_after_forward", "no_shard + override", "fsdp2"): Expect(
        {"strategy": "no_shard", "reshard_after_forward": False}, {"reshard_after_forward": [T, T, T, T]}
    ),
    ("reshard_after_forward", "agrees with strategy", "fsdp1"): Expect(
        {"strategy": "full_shard", "reshard_after_forward": True}, {"sharding_strategy": TorchStrategy.FULL_SHARD}
    ),
    ("reshard_after_forward", "agrees with strategy", "fsdp2"): Expect(
        {"strategy": "full_shard", "reshard_after_forward": True}, {"reshard_after_forward": [T, T, T, T]}
    ),
    ("reshard_after_forward", "true/false against the strategy", "fsdp1"): Refused(
        {"strategy": "full_shard", "reshard_after_forward": False}
    ),
    ("reshard_after_forward", "true/false against the strategy", "fsdp2"): Expect(
        {"strategy": "full_shard", "reshard_after_forward": False}, {"reshard_after_forward": [F, F, F, F]}
    ),
    ("reshard_after_forward", "integer", "fsdp1"): Refused({"reshard_after_forward": 2}),
    ("reshard_after_forward", "integer", "fsdp2"): Expect(
        {"reshard_after_forward": 2}, {"reshard_after_forward": [2, 2, 2, 2]}
    ),
    # -- ignored modules
    ("ignored_modules", "set", "fsdp1"): (
        Expect(
            {"ignored_modules": ["head"], "sync_module_states": True},
            {"ignored_modules": ["head"], "head entries broadcast": ["head.bias", "head.weight"]},  # on CPU
        ),
        Expect(  # a parameter by path (FSDP1's ignored_states of parameters): only there, not beside modules
            {"ignored_modules": ["head", "blocks.0.proj.weight"]},
            {"ignored_modules": None, "ignored_states": ["head", "blocks.0.proj.weight"]},
        ),
    ),
    ("ignored_modules", "set", "fsdp2"): (
        Expect(
            {"ignored_modules": ["head"], "sync_module_states": True},
            {"ignored_params": ["head.bias", "head.weight"], "head entries broadcast": ["head.bias", "head.weight"]},
        ),
        Expect(
            {"ignored_modules": ["head", "blocks.0.proj.weight"]},
            {"ignored_params": ["blocks.0.proj.weight", "head.bias", "head.weight"]},
        ),
    ),
    ("ignored_modules", "none", "fsdp1"): Expect({}, {"ignored_modules": None}),
    ("ignored_modules", "none", "fsdp2"): Expect({}, {"ignored_params": None}),
    # -- device: the process group, FSDP1's device_id, the mesh's device type
    ("compile", "false", "fsdp1"): Expect({}, {"compiled": []}),
    ("compile", "false", "fsdp2"): Expect({}, {"compiled": []}),
    ("compile", "CUDA graph modes", "fsdp1"): Refused({"compile": {"mode": "reduce-overhead"}}),
    ("compile", "CUDA graph modes", "fsdp2"): Refused({"compile": {"mode": "max-autotune"}}),
    ("compile", "true, wrap: none", "fsdp1"): Refused({"compile": True, "wrap": "none"}),
    ("compile", "true, wrap: none", "fsdp2"): Refused({"compile": True, "wrap": "none"}),
    ("compile", "true / options", "fsdp1"): Expect(
        {"compile": True}, {"compiled": BLOCKS, "use_orig_params": True, "units": BLOCKS}
    ),
    ("compile", "true / options", "fsdp2"): Expect(
        {"compile": {"mode": "max-autotune-no-cudagraphs"}, "wrap": ["Block", "Linear"]},
        {
            "compiled": ["blocks.0", "blocks.0.proj", "blocks.1", "blocks.1.proj", "blocks.2", "blocks.2.proj", "head"],
            "fully_shard calls": [
                "blocks.0.proj",
                "blocks.0",
                "blocks.1.proj",
                "blocks.1",
                "blocks.2.proj",
                "blocks.2",
                "head",
                ROOT,
            ],
        },
    ),
    ("float8", "false", "fsdp1"): Expect({}, {"float8": None}),
    ("float8", "false", "fsdp2"): Expect({}, {"float8": None}),
    ("float8", "tensorwise / rowwise, on CPU", "fsdp1"): Refused({"float8": "rowwise", "device": "cpu"}),
    ("float8", "tensorwise / rowwise, on CPU", "fsdp2"): Refused({"float8": "tensorwise", "device": "cpu"}),
    ("float8", "tensorwise / rowwise, on a GPU", "fsdp1"): Refused({"float8": "tensorwise", "device": "cuda"}),
    ("float8", "tensorwise / rowwise, on a GPU", "fsdp2"): (
        # Net's layers are 4 wide (not multiples of 16): torchao is called, the filter keeps none of them
        Expect(
            {"float8": "tensorwise"}, {"float8": ({"enable_fsdp_float8_all_gather": True}, [])}, gpus=True, torchao=True
        ),
        Expect({"float8": "rowwise"}, {"float8": ({"recipe_name": "rowwise"}, [])}, gpus=True, torchao=True),
    ),
    ("device", "cpu", "fsdp1"): Expect(
        {"device": "cpu"},
        {"device_id": torch.device("cpu"), "process group": ("gloo", None), "mesh device": "cpu"},
        gpus=True,  # asked for even where GPUs are
    ),
    ("device", "cpu", "fsdp2"): Expect(
        {"device": "cpu"}, {"process group": ("gloo", None), "mesh device": "cpu"}, gpus=True
    ),
    ("device", "cuda", "fsdp1"): Expect(
        {"device": "cuda"}, {"device_id": CUDA1, "process group": ("nccl", CUDA1), "mesh device": "cuda"}, gpus=True
    ),
    ("device", "cuda", "fsdp2"): Expect(
        {"device": "cuda"}, {"process group": ("nccl", CUDA1), "mesh device": "cuda"}, gpus=True
    ),
    ("device", "auto", "fsdp1"): Expect(
        {}, {"device_id": CUDA1, "process group": ("nccl", CUDA1), "mesh device": "cuda"}, gpus=True
    ),
    ("device", "auto", "fsdp2"): Expect({}, {"process group": ("gloo", None), "mesh device": "cpu"}),
}

ROWS = [(r, b) for r in TABLE if r.when is not None for b in Backend]


def test_every_row_has_an_expectation_on_each_backend() -> None:
    """A row cannot join the table without saying what each backend is asked for."""
    rows = {(r.option, r.case, b.value) for r, b in ROWS}
    assert not rows - set(EXPECTED), f"rows with no expectation: {sorted(rows - set(EXPECTED))}"
    assert not set(EXPECTED) - rows, f"expectations for no row: {sorted(set(EXPECTED) - rows)}"


@pytest.mark.parametrize(
    ("option", "case", "backend"),
    [(r.option, r.case, b) for r, b in ROWS],
    ids=[f"{r.option}={r.case}-{b.value}" for r, b in ROWS],
)
def test_each_row_makes_the_torch_call_it_promises(
    option: str, case: str, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = EXPECTED.get((option, case, backend.value))
    assert expected is not None, "add the row to EXPECTED"
    outcome = next(r for r in TABLE if (r.option, r.case) == (option, case)).for_backend(backend).outcome
    if isinstance(expected, Refused):
        assert outcome is Outcome.UNSUPPORTED
        with pytest.raises(ConfigError) as refused:
            BridgeConfig(backend=backend.value, **expected.fields)
        assert option in [p.key for p in refused.value.problems]
        return
    assert outcome is not Outcome.UNSUPPORTED, "an unsupported row is Refused(...)"
    for expect in expected if isinstance(expected, tuple) else (expected,):
        config = BridgeConfig(backend=backend.value, **expect.fields)
        # The report gives `device` as the config spells it, every other option for the resolved device.
        device_type = None if option == "device" else "cuda" if expect.gpus else "cpu"
        assert translate(config, device_type=device_type).entry(option).case == case, "the config misses its row"
        run = _shard(monkeypatch, backend, expect)
        assert {name: observe(run, name) for name in expect.facts} == expect.facts, f"model {expect.model}"


def test_float8_converts_only_the_16_aligned_linear_layers_inside_units(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_bridge.backends.float8 import convert_to_float8

    _fake_torchao(monkeypatch)
    unit = nn.Sequential(nn.Linear(16, 32), nn.Linear(4, 16), nn.Sequential(nn.Linear(32, 16)))
    lone = nn.Linear(16, 16)  # a unit of its own: FSDP shards it as it is
    model = nn.Sequential(unit, lone, nn.Linear(16, 16))  # the last: the root's own layer (an lm_head)
    convert_to_float8(model, "tensorwise", [unit, lone])
    config, converted = model.float8_seen  # type: ignore[misc]
    assert config == {"enable_fsdp_float8_all_gather": True}
    assert converted == ["0.0", "0.2.0"]


def test_float8_needs_torchao_and_a_gpu_with_float8_matmuls(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_bridge.backends import float8

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(float8.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    problems = [str(p) for p in float8.float8_problems("rowwise", gpu)]
    assert problems == [
        "float8: got 'rowwise'; allowed: torchao installed. Fix: pip install 'fsdp-bridge[float8]' (torchao), "
        "or remove float8",
        "float8: got 'rowwise'; allowed: a GPU of compute capability 8.9+ (Ada, Hopper or newer). Fix: this GPU "
        "has 8.0, without float8 matmuls: remove float8",
    ]
    assert float8.float8_problems(None, gpu) == []  # off
    assert float8.float8_problems("rowwise", torch.device("cpu")) == []  # the table's CPU row refuses it
