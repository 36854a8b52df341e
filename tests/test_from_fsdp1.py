"""BridgeConfig.from_fsdp1: FSDP1's own run-time objects translated with FSDP1's meaning."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _or_policy,
    _Policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

import fsdp_bridge
from fsdp_bridge import BridgeConfig, ConfigError
from fsdp_bridge.config import carried_ignored, fsdp1_init
from fsdp_bridge.fsdp1_compat import describe_policy, fsdp1_policy_units
from fsdp_bridge.mapping import full_precision_classes
from fsdp_bridge.strategy import FSDP1_PARAMETERS
from fsdp_bridge.testing.models import build_tiny, sample_batch
from fsdp_bridge.wrap import resolve_wrap


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(16, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(torch.tanh(self.attn(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _unit_names(model: nn.Module, config: BridgeConfig) -> list[str]:
    return [name for name, _ in resolve_wrap(model, config.wrap).units]


def test_values_translate_with_fsdp1_meaning() -> None:
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    config = BridgeConfig.from_fsdp1(
        sharding_strategy=TorchStrategy.HYBRID_SHARD,
        mixed_precision=mp,
        cpu_offload=CPUOffload(offload_params=True),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=True,
        limit_all_gathers=False,
        use_orig_params=True,
        sync_module_states=True,
        device_id=torch.device("cuda", 0),
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    )
    assert config.strategy.value == "hybrid_shard" and config.backend.value == "fsdp2"
    assert (
        config.mixed_precision.param_dtype == torch.bfloat16 and config.mixed_precision.buffer_dtype == torch.bfloat16
    )
    assert config.mixed_precision.reduce_dtype == torch.float32
    # FSDP1's defaults: the root casts its inputs, the other units do not.
    assert not config.mixed_precision.cast_forward_inputs and config.mixed_precision.cast_root_forward_inputs
    assert config.cpu_offload and config.forward_prefetch and not config.limit_all_gathers
    assert config.sync_module_states and config.device == "cuda"
    assert config.wrap.mode == "classes" and config.wrap.classes == ("Block",)
    # FSDP1's defaults: no policy wraps only the root, None prefetch means none.
    plain = BridgeConfig.from_fsdp1(backend="fsdp1", backward_prefetch=None)
    assert plain.wrap.mode == "none" and plain.backward_prefetch.value == "none"
    assert BridgeConfig.from_fsdp1(sharding_strategy=TorchStrategy.NO_SHARD).strategy.value == "no_shard"


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (
            functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
            ["blocks.0", "blocks.1", "blocks.2"],
        ),
        (ModuleWrapPolicy({Block}), ["blocks.0", "blocks.1", "blocks.2"]),
        (
            functools.partial(size_based_auto_wrap_policy, min_num_params=600),
            ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"],
        ),
        (
            functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Sequential)),
            ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"],
        ),
        (CustomPolicy(lambda m: isinstance(m, Block)), ["blocks.0", "blocks.1", "blocks.2"]),
        (
            functools.partial(
                _or_policy,
                policies=[
                    functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
                    functools.partial(
                        lambda_auto_wrap_policy,
                        lambda_fn=lambda m: m.__class__.__name__ == "Linear" and m.out_features == 4,
                    ),
                ],
            ),
            ["blocks.0", "blocks.1", "blocks.2", "head"],
        ),
    ],
)
def test_wrap_policies_choose_the_units_fsdp1_chooses(policy: Any, expected: list[str]) -> None:
    model = Net()
    config = BridgeConfig.from_fsdp1(auto_wrap_policy=policy)
    assert _unit_names(model, config) == expected
    # The recursion the bridge runs for policy functions is FSDP1's own: it agrees with every policy.
    names = {id(m): n for n, m in model.named_modules()}
    if callable(policy) and not isinstance(policy, CustomPolicy):
        assert sorted(names[id(m)] for m in fsdp1_policy_units(model, policy)) == expected
    assert describe_policy(policy).split("(")[0] in {
        "transformer_auto_wrap_policy",
        "ModuleWrapPolicy",
        "size_based_auto_wrap_policy",
        "lambda_auto_wrap_policy",
        "CustomPolicy",
        "_or_policy",
    }


def test_a_container_a_policy_function_chooses_is_not_a_unit() -> None:
    # A size policy of the user's own that wraps anything over a size: FSDP1 wraps the ModuleList too (its blocks,
    # wrapped first, leave it nothing); fully_shard refuses a container with no forward, so it is left out
    def big(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or sum(p.numel() for p in module.parameters()) > 600

    model = Net()
    plan = resolve_wrap(model, BridgeConfig.from_fsdp1(auto_wrap_policy=big).wrap)
    names = [n for n, _ in plan.units]
    assert "blocks" not in names and {"blocks.0", "blocks.1", "blocks.2"} <= set(names)
    assert any("not units: blocks" in note for note in plan.notes)


def test_the_report_names_the_policy() -> None:
    policy = functools.partial(_or_policy, policies=[ModuleWrapPolicy({Block})])
    report = fsdp_bridge.translate(BridgeConfig.from_fsdp1(auto_wrap_policy=policy), device_type="cpu")
    wrap = next(e for e in report.to_dict()["entries"] if e["option"] == "wrap")  # type: ignore[union-attr]
    assert wrap["value"] == "callable _or_policy(policies=[ModuleWrapPolicy({Block})])"


def test_a_partial_policys_class_set_reads_the_same_on_every_rank() -> None:
    # _or_policy over partial(_module_wrap_policy, module_classes={...}) (a VLM's projector classes): the set's
    # own repr follows the classes' addresses, so the config's text (which shard() compares across ranks) once
    # differed between processes and every rank refused the config
    from torch.distributed.fsdp.wrap import _module_wrap_policy

    class Zeta(nn.Module):
        pass

    class Alpha(nn.Module):
        pass

    for classes in ({Zeta, Alpha, Block}, {Block, Alpha, Zeta}, frozenset({Alpha, Zeta, Block})):
        inner = functools.partial(_module_wrap_policy, module_classes=classes)
        policy = functools.partial(_or_policy, policies=[inner])
        assert (
            describe_policy(policy) == "_or_policy(policies=[_module_wrap_policy(module_classes={Alpha, Block, Zeta})])"
        )

    class Rule:  # a callable object: its repr carries its address, which differs per rank
        def __call__(self, module: nn.Module) -> bool:
            return False

    odd = functools.partial(_or_policy, policies=[functools.partial(_module_wrap_policy, module_classes=Rule())])
    assert " at 0x" not in describe_policy(odd) and "Rule" in describe_policy(odd)


def test_a_class_set_gives_the_same_wrap_on_every_rank() -> None:
    # a set's order follows the classes' hashes (their addresses), which differ between processes, and shard()
    # compares the config across ranks: the classes come in one order whatever order they are given in
    class Zeta(nn.Module):
        pass

    class Alpha(nn.Module):
        pass

    for classes in ([Zeta, Alpha], [Alpha, Zeta]):
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=classes)
        assert BridgeConfig.from_fsdp1(auto_wrap_policy=policy).wrap.classes == ("Alpha", "Zeta")
        assert BridgeConfig.from_fsdp1(auto_wrap_policy=ModuleWrapPolicy(classes)).wrap.classes == ("Alpha", "Zeta")


def test_positional_arguments_take_fsdp1s_order() -> None:
    # FSDP(module, *args, **kwargs) passes FSDP1's parameters after module by position: from_fsdp1 takes them so
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    args = (
        None,
        TorchStrategy.SHARD_GRAD_OP,
        CPUOffload(offload_params=False),
        None,
        BackwardPrefetch.BACKWARD_PRE,
        mp,
    )
    assert BridgeConfig.from_fsdp1(*args, use_orig_params=True) == BridgeConfig.from_fsdp1(
        sharding_strategy=TorchStrategy.SHARD_GRAD_OP,
        cpu_offload=CPUOffload(offload_params=False),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        mixed_precision=mp,
        use_orig_params=True,
    )
    with pytest.raises(ConfigError, match=r"sharding_strategy: got .*; allowed: one value, by position or by keyword"):
        BridgeConfig.from_fsdp1(None, TorchStrategy.FULL_SHARD, sharding_strategy=TorchStrategy.NO_SHARD)
    with pytest.raises(ConfigError, match=r"positional arguments: got 16; allowed: at most 15 after the module"):
        BridgeConfig.from_fsdp1(*([None] * 16))


def test_what_has_no_meaning_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"module: .*a FullyShardedDataParallel argument"):
        BridgeConfig.from_fsdp1(module=nn.Linear(1, 1))
    with pytest.raises(ConfigError, match=r"keep_low_precision_grads: got True"):
        BridgeConfig.from_fsdp1(
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)
        )
    # param_init_fn: FSDP1 calls it only on meta-device modules, and so does shard(); a real-device model is
    # accepted as it is.
    BridgeConfig.from_fsdp1(param_init_fn=lambda m: m.to_empty(device="cpu"))
    with pytest.raises(ConfigError, match=r"ignored_states: got 'given with ignored_modules'"):
        BridgeConfig.from_fsdp1(ignored_modules=[nn.Linear(1, 1)], ignored_states=[nn.Linear(1, 1)])
    # BACKWARD_POST has no FSDP2 form: FSDP2's (pre) timing there, the same numbers (a YAML 'post' is refused);
    # FSDP1 itself runs it.
    post = BackwardPrefetch.BACKWARD_POST
    assert BridgeConfig.from_fsdp1(backward_prefetch=post).backward_prefetch.value == "pre"
    assert BridgeConfig.from_fsdp1(backend="fsdp1", backward_prefetch=post).backward_prefetch.value == "post"
    with pytest.raises(ConfigError, match=r"backward_prefetch: got 'post'"):
        BridgeConfig(backward_prefetch="post")
    # FSDP1 compares backward_prefetch with its two members: True, a string or a number prefetch nothing there
    for odd in (True, False, "BACKWARD_PRE", 2):
        assert BridgeConfig.from_fsdp1(backward_prefetch=odd).backward_prefetch.value == "none"
    with pytest.raises(ConfigError, match=r"per-unit FSDP1 arguments"):
        config = BridgeConfig.from_fsdp1(
            auto_wrap_policy=CustomPolicy(
                lambda m: {"sharding_strategy": TorchStrategy.SHARD_GRAD_OP} if isinstance(m, Block) else False
            )
        )
        resolve_wrap(Net(), config.wrap)


# -- every FullyShardedDataParallel.__init__ argument, every value FSDP1 accepts ---------------------------------

_LINEAR = nn.Linear(2, 2)
_PARAM = nn.Parameter(torch.zeros(2))
_NO_EQUIVALENT = "no equivalent"  # a value the config refuses, with the reason and the fix


def _fields(**expected: Any) -> Any:
    def check(config: BridgeConfig) -> None:
        got = {k: getattr(config, k) for k in expected}
        got = {k: v.value if hasattr(v, "value") and not isinstance(v, torch.dtype) else v for k, v in got.items()}
        assert got == expected

    return check


def _precision(**expected: Any) -> Any:
    def check(config: BridgeConfig) -> None:
        assert {k: getattr(config.mixed_precision, k) for k in expected} == expected

    return check


class _BlockPolicy(_Policy):
    """A torch _Policy subclass of a user's own (FSDP1 runs its _run_policy)."""

    def _run_policy(self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict) -> dict:
        return {m: {} for m in root_module.modules() if isinstance(m, Block)}


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (argument, value, backend) -> a check of the config, or (_NO_EQUIVALENT, pattern of the ConfigError)
FSDP1_VALUES: list[tuple[str, Any, Any]] = [
    ("process_group", None, _fields()),
    ("sharding_strategy", None, _fields(strategy="full_shard")),
    *[("sharding_strategy", s, _fields(strategy=s.name.lower().lstrip("_"))) for s in TorchStrategy],
    ("cpu_offload", None, _fields(cpu_offload=False)),
    ("cpu_offload", CPUOffload(), _fields(cpu_offload=False)),
    ("cpu_offload", CPUOffload(offload_params=True), _fields(cpu_offload=True)),
    ("auto_wrap_policy", None, lambda c: c.wrap.mode == "none"),
    (
        "auto_wrap_policy",
        ModuleWrapPolicy({Block}),
        lambda c: _unit_names(Net(), c) == [f"blocks.{i}" for i in range(3)],
    ),
    ("auto_wrap_policy", CustomPolicy(lambda m: isinstance(m, Block)), lambda c: len(_unit_names(Net(), c)) == 3),
    ("auto_wrap_policy", functools.partial(size_based_auto_wrap_policy, min_num_params=100), lambda c: c.wrap.mode),
    ("auto_wrap_policy", _BlockPolicy(), lambda c: _unit_names(Net(), c) == [f"blocks.{i}" for i in range(3)]),
    ("backward_prefetch", None, _fields(backward_prefetch="none")),
    ("backward_prefetch", BackwardPrefetch.BACKWARD_PRE, _fields(backward_prefetch="pre")),
    (
        "backward_prefetch",
        BackwardPrefetch.BACKWARD_POST,
        lambda c: c.backward_prefetch.value == ("pre" if c.backend.value == "fsdp2" else "post"),
    ),
    ("mixed_precision", None, _precision(param_dtype=None, reduce_dtype=None, buffer_dtype=None)),
    ("mixed_precision", MixedPrecision(), _precision(param_dtype=None, reduce_dtype=None, buffer_dtype=None)),
    ("mixed_precision", MixedPrecision(param_dtype=BF16), _precision(param_dtype=BF16, reduce_dtype=None)),
    ("mixed_precision", MixedPrecision(reduce_dtype=FP32), _precision(param_dtype=None, reduce_dtype=FP32)),
    ("mixed_precision", MixedPrecision(buffer_dtype=BF16), _precision(buffer_dtype=BF16)),
    ("mixed_precision", MixedPrecision(FP16, FP16, FP16), _precision(param_dtype=FP16, buffer_dtype=FP16)),
    ("mixed_precision", MixedPrecision(cast_forward_inputs=True), _precision(cast_forward_inputs=True)),
    ("mixed_precision", MixedPrecision(cast_root_forward_inputs=False), _precision(cast_root_forward_inputs=False)),
    (
        "mixed_precision",
        MixedPrecision(param_dtype=BF16, keep_low_precision_grads=True),
        (_NO_EQUIVALENT, r"keep_low_precision_grads: got True.*FSDP2 keeps gradients in the parameters' dtype"),
    ),
    ("ignored_modules", None, _fields(ignored_modules=())),
    ("ignored_modules", [], _fields(ignored_modules=())),
    ("ignored_modules", [_LINEAR], lambda c: carried_ignored(c) == (_LINEAR,)),
    ("param_init_fn", None, _fields()),
    ("param_init_fn", lambda m: None, lambda c: fsdp1_init(c) is not None),
    ("device_id", None, _fields(device="auto")),
    ("device_id", 0, _fields(device="cuda")),
    ("device_id", torch.device("cpu"), _fields(device="cpu")),
    ("device_id", torch.device("cuda", 1), _fields(device="cuda")),
    ("device_id", "cuda:0", _fields(device="cuda")),
    ("device_id", torch.device("xpu"), (_NO_EQUIVALENT, r"device_id: got device\(type='xpu'\).*CUDA or CPU only")),
    *[("sync_module_states", v, _fields(sync_module_states=bool(v))) for v in (False, True)],
    *[("forward_prefetch", v, _fields(forward_prefetch=v)) for v in (False, True)],
    *[("limit_all_gathers", v, _fields(limit_all_gathers=v)) for v in (False, True)],
    *[("use_orig_params", v, _fields()) for v in (False, True)],
    ("ignored_states", None, _fields(ignored_modules=())),
    ("ignored_states", [_PARAM], lambda c: carried_ignored(c) == (_PARAM,)),
    ("ignored_states", [_LINEAR], lambda c: carried_ignored(c) == (_LINEAR,)),
    ("device_mesh", None, _fields()),
]


def _case(value: object) -> str:
    """A stable test id for a value (no object addresses)."""
    if isinstance(value, list):
        return f"[{', '.join(type(v).__name__ for v in value)}]"
    text = repr(value)
    return type(value).__name__ if " at 0x" in text else text[:60]


def test_the_table_covers_every_fsdp1_argument() -> None:
    import inspect

    from torch.distributed.fsdp import FullyShardedDataParallel

    arguments = set(inspect.signature(FullyShardedDataParallel.__init__).parameters) - {"self", "module"}
    assert arguments == {name for name, _, _ in FSDP1_VALUES}
    # the order positional arguments take (from_fsdp1(*args), the codemod's FSDP(module, a, b))
    order = [n for n in inspect.signature(FullyShardedDataParallel.__init__).parameters if n != "self"]
    assert tuple(order) == FSDP1_PARAMETERS


@pytest.mark.parametrize("backend", ["fsdp2", "fsdp1"])
@pytest.mark.parametrize(
    ("argument", "value", "expected"), FSDP1_VALUES, ids=[f"{a}={_case(v)}" for a, v, _ in FSDP1_VALUES]
)
def test_every_value_fsdp1_accepts_translates_or_is_refused_with_the_reason(
    argument: str, value: Any, expected: Any, backend: str
) -> None:
    if isinstance(expected, tuple):
        _, pattern = expected
        with pytest.raises(ConfigError, match=pattern):
            BridgeConfig.from_fsdp1(backend=backend, **{argument: value})
        return
    config = BridgeConfig.from_fsdp1(backend=backend, **{argument: value})
    assert expected(config) is not False


# -- the same kwargs through raw FSDP1 and through the bridge on FSDP2 (2 gloo ranks) ----------


def _kwargs() -> dict[str, Any]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return dict(
        sharding_strategy=TorchStrategy.FULL_SHARD,
        auto_wrap_policy=functools.partial(
            _or_policy,
            policies=[
                functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}),
                functools.partial(size_based_auto_wrap_policy, min_num_params=10_000),
            ],
        ),
        mixed_precision=MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        limit_all_gathers=True,
        use_orig_params=True,
    )


def _train(model: nn.Module, rank: int, optimizers: list[torch.optim.Optimizer] | None = None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if optimizers is not None:
        optimizers.append(opt)
    losses = []
    for step in range(3):
        loss = model(**sample_batch("llama", batch=2, seq=8, seed=(42 + rank) * 100 + step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _raw_vs_bridge() -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    rank = dist.get_rank()
    raw_model = build_tiny("llama", seed=0)
    raw = FullyShardedDataParallel(raw_model, device_id=torch.device("cpu"), **_kwargs())
    raw_units = sorted(
        n.replace("_fsdp_wrapped_module.", "")
        for n, m in raw.named_modules()
        if isinstance(m, FullyShardedDataParallel) and m is not raw
    )
    opts: list[torch.optim.Optimizer] = []
    raw_losses = _train(raw, rank, opts)
    bridged = fsdp_bridge.shard(build_tiny("llama", seed=0), BridgeConfig.from_fsdp1(**_kwargs()))
    bridge_units = sorted(n for n, _ in fsdp_bridge.get_bridge(bridged).wrap.units)
    bridge_losses = _train(bridged, rank, opts)
    states = _state_dict_contexts(raw, bridged, *opts)
    on_fsdp1 = fsdp_bridge.shard(build_tiny("llama", seed=0), BridgeConfig.from_fsdp1(backend="fsdp1", **_kwargs()))
    _train(on_fsdp1, rank)
    # Generation under FSDP1's summon_full_params(recurse=False) (the root's own parameters gathered,
    # the units gathering theirs), and under the bridge's on both backends (which --fix writes).
    prompt = sample_batch("llama", batch=1, seq=4, seed=rank)["input_ids"]
    greedy = dict(do_sample=False, min_new_tokens=3, max_new_tokens=3)
    with FullyShardedDataParallel.summon_full_params(raw, writeback=False, recurse=False):
        raw_tokens = raw.generate(prompt, **greedy).tolist()
    tokens = []
    for model in (bridged, on_fsdp1):
        with fsdp_bridge.summon_full_params(model, recurse=False):
            tokens.append(model.generate(prompt, **greedy).tolist())  # type: ignore[operator]
    with fsdp_bridge.summon_full_params(bridged, recurse=False):  # FSDP2: the root's own are whole, not the units'
        kinds = {n.split(".")[1]: type(p).__name__ for n, p in bridged.named_parameters()}
    # FSDP1's device_mesh / process_group inside a **kwargs dict: from_fsdp1 keeps them for shard() and enable_wrap.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    carried = {}
    for name, value in (("device_mesh", mesh), ("process_group", dist.new_group(list(range(dist.get_world_size()))))):
        config = BridgeConfig.from_fsdp1(**{**_kwargs(), name: value})
        carried[name] = _train(fsdp_bridge.shard(build_tiny("llama", seed=0), config), rank)
    config = BridgeConfig.from_fsdp1(**{**_kwargs(), "device_mesh": mesh})
    with fsdp_bridge.enable_wrap(config.replace(wrap="none")) as wrap:  # replace() keeps the mesh
        manual = build_tiny("llama", seed=0)
        manual.model.layers = torch.nn.ModuleList(wrap.wrap(layer) for layer in manual.model.layers)
        carried["enable_wrap_mesh"] = fsdp_bridge.get_bridge(manual.model.layers[0]).mesh is mesh
    try:
        fsdp_bridge.shard(build_tiny("llama", seed=0), config, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        carried["twice"] = "no error"
    except ConfigError as err:
        carried["twice"] = str(err)
    return {
        "states": states,
        "raw_units": raw_units,
        "bridge_units": bridge_units,
        "raw": raw_losses,
        "bridge": bridge_losses,
        "raw_tokens": raw_tokens,
        "tokens": tokens,
        "kinds": kinds,
        "carried": carried,
    }


def _state_dict_contexts(
    raw: nn.Module, bridged: nn.Module, raw_opt: torch.optim.Optimizer, opt: torch.optim.Optimizer
) -> dict[str, Any]:
    """FSDP1's state_dict_type context on raw FSDP1 next to fsdp_bridge.state_dict_type on FSDP2, the
    latter made in one place and entered in another (as a helper returning the context does)."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    full = StateDictType.FULL_STATE_DICT
    cfg, optim_cfg = FullStateDictConfig(rank0_only=True), FullOptimStateDictConfig(rank0_only=True)
    with FSDP.state_dict_type(raw, full, cfg, optim_cfg):
        raw_sd, raw_osd = raw.state_dict(), FSDP.optim_state_dict(raw, raw_opt)
    ctx = fsdp_bridge.state_dict_type(bridged, full, cfg, optim_cfg)
    with ctx:
        sd, osd = bridged.state_dict(), fsdp_bridge.optim_state_dict(bridged, opt)
    out: dict[str, Any] = {"full_keys": (sorted(raw_sd), sorted(sd)), "restored": "state_dict" in bridged.__dict__}
    # fsdp_bridge.full_state_dict / full_optim_state_dict: the same state, gathered one tensor at a time.
    every = fsdp_bridge.full_state_dict(bridged, offload_to_cpu=True)
    rank0 = fsdp_bridge.full_state_dict(bridged, rank0_only=True)
    full_osd = fsdp_bridge.full_optim_state_dict(bridged, opt)
    out["helpers"] = (
        sorted(every) == sorted(bridged.state_dict()) and all(v.device.type == "cpu" for v in every.values()),
        (rank0 == {}) if dist.get_rank() else all(torch.equal(rank0[k], sd[k]) for k in sd),
        (full_osd == {}) if dist.get_rank() else sorted(full_osd["state"]) == sorted(osd["state"]),
    )
    # FSDP1's gathered optimizer state on gloo gives exp_avg equal to exp_avg_sq (a torch bug on CPU):
    # exp_avg is checked against the bridge's own optimizer, exp_avg_sq against FSDP1's.
    own = {n: opt.state[p]["exp_avg"].full_tensor() for n, p in bridged.named_parameters()}
    if raw_sd:
        out["full_max_diff"] = max((raw_sd[k].float() - sd[k].float()).abs().max().item() for k in raw_sd)
        out["optim_max_diff"] = max(
            max(
                (raw_osd["state"][k]["exp_avg_sq"] - osd["state"][k]["exp_avg_sq"]).abs().max().item(),
                (own[k] - osd["state"][k]["exp_avg"]).abs().max().item(),
            )
            for k in raw_osd["state"]
        )
        out["optim_keys"] = (sorted(raw_osd["state"]), sorted(osd["state"]))
    else:
        out["others_empty"] = (sd, osd.get("state", {}))
    sharded = fsdp_bridge.state_dict_type(bridged, StateDictType.SHARDED_STATE_DICT)
    with sharded:
        shards = {k: v.clone() for k, v in bridged.state_dict().items()}  # the values share the parameters' memory
        out["sharded_dtensors"] = sum(isinstance(v, DTensor) for v in shards.values())
        before = {k: v.full_tensor().clone() for k, v in shards.items() if isinstance(v, DTensor)}
        with torch.no_grad():
            for p in bridged.parameters():
                p.zero_()
        bridged.load_state_dict(shards)  # FSDP1's strict load of its own sharded state dict
    after = fsdp_bridge.optim_state_dict(bridged, opt)  # outside a block: FSDP1's default, full on every rank
    out["sharded_round_trip"] = all(
        torch.equal(v, dict(bridged.named_parameters())[k].full_tensor()) for k, v in before.items()
    )
    out["default_full"] = not any(isinstance(v, DTensor) for s in after["state"].values() for v in s.values())
    # FSDP1's whole signature (code passes its arguments through **kwargs): its own group taken, the rest refused
    # before any collective with the argument named, a keyword FSDP1 lacks a TypeError as on FSDP1.
    again = fsdp_bridge.optim_state_dict(bridged, opt, **{"optim_state_dict": None, "group": dist.group.WORLD})
    out["fsdp1_signature"] = [sorted(again["state"]) == sorted(after["state"])]
    single = dist.new_group([0])
    for extra in ({"optim_state_dict": opt.state_dict()}, {"group": single}, {"optim_state_dict_cfg": None}):
        try:
            fsdp_bridge.optim_state_dict(bridged, opt, **extra)
            out["fsdp1_signature"].append("taken")
        except (ConfigError, TypeError) as err:
            out["fsdp1_signature"].append(f"{type(err).__name__}: {err}")
    # Nested blocks (and one entered twice) each put back what was there: the outer type, then nothing.
    full_ctx = fsdp_bridge.state_dict_type(bridged, full)
    with sharded:
        with full_ctx, full_ctx:
            inner = bridged.state_dict()
        outer = bridged.state_dict()
    out["nested"] = (
        not any(isinstance(v, DTensor) for v in inner.values())
        and all(isinstance(v, DTensor) for k, v in outer.items() if k in before)
        and "state_dict" not in bridged.__dict__
    )
    try:
        with fsdp_bridge.state_dict_type(bridged, StateDictType.LOCAL_STATE_DICT):
            out["local"] = "entered"
    except ConfigError as err:
        out["local"] = str(err)
    out["persistent"] = _persistent_types(raw, bridged, raw_opt, opt)
    return out


def _persistent_types(
    raw: nn.Module, bridged: nn.Module, raw_opt: torch.optim.Optimizer, opt: torch.optim.Optimizer
) -> dict[str, Any]:
    """fsdp_bridge.set_state_dict_type, SHARDED then FULL: on FSDP2 the same state dicts as the bridge's
    state_dict_type block gives; on FSDP1 FSDP1's own call (the same as FSDP1's context gives)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictSettings, StateDictType
    from torch.distributed.tensor import DTensor

    def states(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        return model.state_dict(), fsdp_bridge.optim_state_dict(model, optim)

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, dict):
            return isinstance(b, dict) and sorted(a) == sorted(b) and all(same(a[k], b[k]) for k in a)
        if isinstance(a, DTensor):
            return isinstance(b, DTensor) and torch.equal(a.to_local(), b.to_local())
        if hasattr(a, "local_tensor"):  # FSDP1's ShardedTensor
            return type(a) is type(b) and torch.equal(a.local_tensor(), b.local_tensor())
        if isinstance(a, torch.Tensor):
            return type(b) is type(a) and torch.equal(a, b)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        if not isinstance(a, (bool, int, float, str, type(None))):
            raise TypeError(f"{type(a)} {type(b)}")
        return bool(a == b)

    sharded, full = StateDictType.SHARDED_STATE_DICT, StateDictType.FULL_STATE_DICT
    out: dict[str, Any] = {}
    for name, model, optim in (("fsdp2", bridged, opt), ("fsdp1", raw, raw_opt)):
        block: list[Any] = []
        for kind in (sharded, full):
            with fsdp_bridge.state_dict_type(model, kind):
                block.append(states(model, optim))
        first = fsdp_bridge.set_state_dict_type(model, sharded)
        persistent = [states(model, optim)]
        with fsdp_bridge.state_dict_type(model, full):  # a block wins inside it, then the setting is back
            inner = states(model, optim)
        after_block = states(model, optim)
        second = fsdp_bridge.set_state_dict_type(model, full)
        persistent.append(states(model, optim))
        out[name] = {
            "sharded": same(block[0], persistent[0]) and same(after_block, persistent[0]),
            "full": same(block[1], persistent[1]) and same(block[1], inner),
            "dtensors": sum(isinstance(v, DTensor) for v in persistent[0][0].values()),
            "returned": [
                (type(s).__name__, s.state_dict_type.name if isinstance(s, StateDictSettings) else None)
                for s in (first, second)
            ],
        }
    out["fsdp1_current"] = FSDP.get_state_dict_type(raw).state_dict_type.name
    try:
        fsdp_bridge.set_state_dict_type(bridged, StateDictType.LOCAL_STATE_DICT)
        out["local"] = "set"
    except ConfigError as err:
        out["local"] = str(err)
    out["after_local"] = not any(isinstance(v, DTensor) for v in bridged.state_dict().values())
    return out


def test_raw_fsdp1_and_the_bridge_on_fsdp2_wrap_and_train_alike(run_on_ranks) -> None:
    for rank, result in enumerate(run_on_ranks(_raw_vs_bridge, 2)):
        states = result["states"]
        assert states["helpers"] == (True, True, True), states["helpers"]
        assert states["full_keys"][0] == states["full_keys"][1] and states["restored"] is False, states
        if rank == 0:
            assert states["full_max_diff"] < 1e-5 and states["optim_max_diff"] < 1e-5, states
            assert states["optim_keys"][0] == states["optim_keys"][1] and states["optim_keys"][0], states
        else:  # rank0_only: the other ranks get empty dicts, as from FSDP1
            assert states["full_keys"] == ([], []) and states["others_empty"] == ({}, {}), states
        assert states["sharded_dtensors"] > 0 and states["sharded_round_trip"] is True, states
        assert states["default_full"] is True and "LOCAL_STATE_DICT" in states["local"], states
        taken, given, group, unknown = states["fsdp1_signature"]
        assert taken is True and "ConfigError" in given and "optim_state_dict" in given, states["fsdp1_signature"]
        assert "ConfigError" in group and "ranks [0]" in group and "ranks [0, 1]" in group, group
        assert unknown.startswith("TypeError") and "optim_state_dict_cfg" in unknown, unknown
        assert states["nested"] is True, states
        persistent = states["persistent"]
        for backend in ("fsdp2", "fsdp1"):
            assert persistent[backend]["sharded"] and persistent[backend]["full"], (backend, persistent)
            assert persistent[backend]["returned"] == [
                ("StateDictSettings", "FULL_STATE_DICT"),
                ("StateDictSettings", "SHARDED_STATE_DICT"),
            ], persistent
        assert persistent["fsdp2"]["dtensors"] > 0 and persistent["fsdp1_current"] == "FULL_STATE_DICT", persistent
        assert "LOCAL_STATE_DICT" in persistent["local"] and "SHARDED_STATE_DICT" in persistent["local"], persistent
        assert persistent["after_local"] is True, persistent  # refused before anything changed: still FULL
        assert result["bridge_units"] == result["raw_units"] and result["raw_units"], result
        torch.testing.assert_close(result["bridge"], result["raw"], rtol=1.3e-6, atol=1e-5)
        assert result["tokens"] == [result["raw_tokens"]] * 2 and len(result["raw_tokens"][0]) == 7
        assert result["kinds"]["embed_tokens"] == "Parameter" and result["kinds"]["layers"] == "DTensor", result
        carried = result["carried"]
        assert carried["device_mesh"] == carried["process_group"] == result["bridge"]
        assert carried["enable_wrap_mesh"] is True
        assert "shard(..., mesh=...) and BridgeConfig.from_fsdp1(device_mesh=...)" in carried["twice"]


def test_state_dict_options_mean_what_fsdp1_state_dict_settings_meant() -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )

    full, sharded = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT
    options = fsdp_bridge.state_dict_options
    assert options(full) == StateDictOptions(full_state_dict=True)
    rank0 = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    assert options(full, rank0) == StateDictOptions(full_state_dict=True, cpu_offload=True)
    # a load under rank0_only: rank 0's dict, sent to the others (a state_dict() in the block is empty elsewhere)
    assert options(full, rank0, load=True) == StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # the optimizer reads its own config
    assert options(full, rank0, FullOptimStateDictConfig(), optimizer=True) == StateDictOptions(full_state_dict=True)
    assert options(sharded, ShardedStateDictConfig(offload_to_cpu=True)) == StateDictOptions(cpu_offload=True)
    assert options("SHARDED_STATE_DICT") == StateDictOptions()
    with pytest.raises(ConfigError, match=r"state_dict_type: .*LOCAL_STATE_DICT.*convert"):
        options(StateDictType.LOCAL_STATE_DICT)
    with pytest.raises(ConfigError, match=r"state_dict_type: got 'full'.*FULL_STATE_DICT or SHARDED_STATE_DICT"):
        options("full")


def test_module_names_turns_fsdp1_module_objects_into_config_names() -> None:
    net = Net()
    names = fsdp_bridge.module_names(net, [net.head, *net.blocks[:1]])
    assert names == ["head", "blocks.0"]
    config = BridgeConfig.from_fsdp1(ignored_modules=names)
    assert config.ignored_modules == ("head", "blocks.0")
    assert fsdp_bridge.module_names(net, None) == []
    # a module outside the model: FSDP1 has nothing of it to ignore, and neither has the bridge
    assert fsdp_bridge.module_names(net, [nn.Linear(2, 2), net.head]) == ["head"]
    with pytest.raises(ConfigError, match=r"ignored_modules: got 'Net'.*a submodule or parameter of the model being"):
        fsdp_bridge.module_names(net, [net])


# -- param_init_fn + sync_module_states: meta-device ranks (2 gloo ranks) ----------------------------


def _bf16_but_head(net: nn.Module) -> nn.Module:
    net.to(torch.bfloat16)
    net.head.float()
    return net


def _meta_ranks() -> dict[str, Any]:
    """FSDP1 fine-tuning code's shape: rank 0 loads bf16 weights, the others build fp32 on meta and
    rely on param_init_fn (to_empty + a cast) and sync_module_states."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}

    def param_init_fn(module: nn.Module) -> None:
        module.to_empty(device="cpu", recurse=False)
        module.to(torch.bfloat16)

    for backend in ("fsdp2", "fsdp1"):
        torch.manual_seed(0)
        reference = {n: p.detach().clone() for n, p in _bf16_but_head(Net()).named_parameters()}
        if rank == 0:
            torch.manual_seed(0)
            net = _bf16_but_head(Net())  # FSDP1: the fp32 head becomes a unit of its own
        else:
            with torch.device("meta"):
                net = Net()  # float32, as the model class builds it
        kwargs = dict(sync_module_states=True, device_id=torch.device("cpu"), use_orig_params=True)
        config = BridgeConfig.from_fsdp1(backend=backend, param_init_fn=param_init_fn if rank else None, **kwargs)
        model = fsdp_bridge.shard(net, config)
        with fsdp_bridge.summon_full_params(model):
            full = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
        out[backend] = sorted(full) == sorted(reference) and all(
            full[n].dtype == reference[n].dtype and torch.equal(full[n], reference[n]) for n in reference
        )
    # Without sync_module_states FSDP1 initialises every rank's meta-device modules itself (param_init_fn, or
    # reset_parameters), unit by unit: the bridge does it in the same order, so the same seed draws the same
    # numbers (FSDP1 code seeds every rank alike: a rank's shards come from its own draw).
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    def init_fn(module: nn.Module) -> None:
        module.to_empty(device="cpu", recurse=False)
        if isinstance(module, nn.Linear):
            with torch.no_grad():
                module.reset_parameters()

    def full(model: nn.Module, summon: Any) -> dict[str, torch.Tensor]:
        with summon:
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}

    for name, fn in (("param_init_fn", init_fn), ("reset_parameters", None)):
        fsdp1_kwargs = dict(auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"), param_init_fn=fn)
        torch.manual_seed(100)
        with torch.device("meta"):
            raw = FullyShardedDataParallel(Net(), use_orig_params=True, **fsdp1_kwargs)
        want = full(raw, FullyShardedDataParallel.summon_full_params(raw))
        for backend in ("fsdp2", "fsdp1"):
            torch.manual_seed(100)
            with torch.device("meta"):
                net = Net()
            model = fsdp_bridge.shard(net, BridgeConfig.from_fsdp1(backend=backend, **fsdp1_kwargs))
            got = full(model, fsdp_bridge.summon_full_params(model))
            out[f"{name} {backend}"] = sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
        torch.manual_seed(100)
        out[f"{name} initialised"] = not torch.equal(want["embed.weight"], Net().embed.weight)  # FSDP1 drew anew
    # FSDP1's manual wrapping of a meta-device model with a **dict holding device_mesh and param_init_fn
    # (early torchtitan's shape): each wrap() materialises its module, the outer one the rest.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp.wrap import enable_wrap, wrap

    fsdp_config = {"device_mesh": init_device_mesh("cpu", (2,)), "param_init_fn": init_fn, "use_orig_params": True}
    torch.manual_seed(100)
    with torch.device("meta"):
        raw_net = Net()
    with enable_wrap(wrapper_cls=FullyShardedDataParallel, device_id=torch.device("cpu"), **fsdp_config):
        for i, block in enumerate(raw_net.blocks):
            raw_net.blocks[i] = wrap(block)
        raw = wrap(raw_net)
    want = full(raw, FullyShardedDataParallel.summon_full_params(raw))
    for backend in ("fsdp2", "fsdp1"):
        torch.manual_seed(100)
        with torch.device("meta"):
            net = Net()
        with fsdp_bridge.enable_wrap(BridgeConfig.from_fsdp1(backend=backend, **fsdp_config)):
            for i, block in enumerate(net.blocks):
                net.blocks[i] = fsdp_bridge.wrap_module(block)
            model = fsdp_bridge.wrap_module(net)
        got = full(model, fsdp_bridge.summon_full_params(model))
        out[f"manual {backend}"] = sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    # Every rank on meta, rank 0 too, with sync_module_states (a pretraining run from scratch): FSDP1 initialises
    # each rank's modules (reset_parameters here), then every rank takes rank 0's; the bridge does the same.
    # (FSDP1 itself refuses sync_module_states without a GPU: the reference is rank 0's draw, FSDP1's
    # initialisation number for number as checked above, which every rank must end with.)
    policy = ModuleWrapPolicy({Block})
    torch.manual_seed(100)
    with torch.device("meta"):
        net = Net()
    first = fsdp_bridge.shard(net, BridgeConfig.from_fsdp1(auto_wrap_policy=policy, device_id=torch.device("cpu")))
    want = full(first, fsdp_bridge.summon_full_params(first))
    for backend in ("fsdp2", "fsdp1"):
        torch.manual_seed(100 + rank)  # the ranks draw different numbers: only rank 0's may survive
        with torch.device("meta"):
            everywhere = Net()
        config = BridgeConfig.from_fsdp1(backend=backend, auto_wrap_policy=policy, **kwargs)
        model = fsdp_bridge.shard(everywhere, config)
        got = full(model, fsdp_bridge.summon_full_params(model))
        out[f"rank 0 on meta {backend}"] = sorted(got) == sorted(want) and all(
            torch.equal(got[n], want[n]) for n in want
        )
    # A config of the bridge's own (not FSDP1 code) still refuses it: nothing says how to initialise them.
    with torch.device("meta"):
        everywhere = Net()
    try:
        fsdp_bridge.shard(everywhere, BridgeConfig(sync_module_states=True, device="cpu"))
        out["rank 0 on meta"] = "no error"
    except ConfigError as err:
        out["rank 0 on meta"] = str(err)
    return out


def test_meta_device_ranks_take_rank0_weights_and_dtypes(run_on_ranks) -> None:
    for result in run_on_ranks(_meta_ranks, 2):
        assert result["fsdp2"] and result["fsdp1"], result
        for key in ("param_init_fn fsdp2", "param_init_fn fsdp1", "reset_parameters fsdp2", "reset_parameters fsdp1"):
            assert result[key], key  # FSDP1's own initialisation of meta-device modules, number for number
        assert result["param_init_fn initialised"]  # in FSDP1's order (units first), not the constructor's
        assert result["manual fsdp2"] and result["manual fsdp1"]
        assert result["rank 0 on meta fsdp2"] and result["rank 0 on meta fsdp1"]
        message = result["rank 0 on meta"]
        assert "sync_module_states: got 'rank 0 holds meta-device tensors (embed.weight, embed.bias, " in message
        assert "run it on rank 0's modules first" in message


def test_fsdp1s_full_precision_classes_are_carried(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="fsdp_bridge")
    BridgeConfig.from_fsdp1(
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16), auto_wrap_policy=ModuleWrapPolicy({Block})
    )
    assert "MixedPrecision keeps _BatchNorm modules" not in caplog.text  # kept in full precision now, as FSDP1 does
    kept = BridgeConfig.from_fsdp1(
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16), auto_wrap_policy=ModuleWrapPolicy({Block})
    )
    assert kept.mixed_precision.full_precision_modules == ("_BatchNorm",)
    root_only = BridgeConfig.from_fsdp1(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    assert root_only.mixed_precision.full_precision_modules == ()  # FSDP1 overrides them under a policy only


class _NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(self.norm(torch.tanh(self.lin(x))))


def _full_precision_modules() -> dict[str, Any]:
    """FSDP1's MixedPrecision(_module_classes_to_ignore=...) under an auto-wrap policy (here LayerNorm, and its
    default BatchNorm alone) through raw FSDP1 and through the bridge on both backends: the same losses, and the
    modules kept in full precision see float32 inputs and hand back bfloat16; FSDP2 units keep their class name."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    rank = dist.get_rank()
    cases = {
        "layernorm": MixedPrecision(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            _module_classes_to_ignore=(nn.LayerNorm, nn.BatchNorm1d),  # BatchNorm in bf16 fails on FSDP1 too
        ),
        "batchnorm (default)": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }
    out: dict[str, Any] = {}

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), _NormBlock(), _NormBlock(), nn.Linear(16, 4))

    def run(model: nn.Module, watched: type[nn.Module]) -> tuple[list[float], set[str]]:
        seen: set[str] = set()
        for m in model.modules():
            if isinstance(m, watched):
                m.register_forward_hook(lambda _m, a, o: seen.add(f"{a[0].dtype}->{o.dtype}"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            loss = model(torch.randn(6, 8, generator=gen)).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, seen

    for name, mp in cases.items():
        kwargs = dict(auto_wrap_policy=ModuleWrapPolicy({_NormBlock}), mixed_precision=mp, use_orig_params=True)
        watched = nn.LayerNorm if name == "layernorm" else nn.BatchNorm1d
        raw = FullyShardedDataParallel(build(), device_id=torch.device("cpu"), **kwargs)  # type: ignore[arg-type]
        out[f"{name} fsdp1 raw"] = run(raw, watched)
        for backend in ("fsdp1", "fsdp2"):
            bridged = fsdp_bridge.shard(build(), BridgeConfig.from_fsdp1(backend=backend, **kwargs))
            out[f"{name} {backend}"] = run(bridged, watched)
    # the bridge's own spelling: BatchNorm kept by default where there are wrap units, as FSDP1 does
    model = fsdp_bridge.shard(build(), BridgeConfig(mixed_precision="bf16", wrap=["_NormBlock"]))
    out["default"] = run(model, nn.BatchNorm1d)[1]
    # FSDP2 names a sharded module's class FSDP<Cls>, FSDP1 leaves it alone: the bridge keeps the user's class
    # name, so a check_fn matching by name after sharding (as FSDP1 code applies checkpointing) finds the units
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
    )

    for backend in ("fsdp1", "fsdp2"):
        model = fsdp_bridge.shard(build(), BridgeConfig(backend=backend, wrap=["_NormBlock"]))
        apply_activation_checkpointing(model, check_fn=lambda m: type(m).__name__ == "_NormBlock")
        out[f"checkpointed by name {backend}"] = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
    return out


def test_modules_fsdp1_keeps_in_full_precision_stay_so_on_both_backends(run_on_ranks) -> None:
    for result in run_on_ranks(_full_precision_modules, 2):
        for case in ("layernorm", "batchnorm (default)"):
            raw_losses, raw_seen = result[f"{case} fsdp1 raw"]
            assert raw_seen == {"torch.float32->torch.bfloat16"}, (case, raw_seen)
            for backend in ("fsdp1", "fsdp2"):
                losses, seen = result[f"{case} {backend}"]
                assert seen == raw_seen, (case, backend, seen)
                assert losses == pytest.approx(raw_losses, rel=1e-3), (case, backend, losses, raw_losses)
        assert result["default"] == {"torch.float32->torch.bfloat16"}
        assert result["checkpointed by name fsdp1"] == result["checkpointed by name fsdp2"] == 2
    # without wrap units FSDP1 keeps no module in full precision (its override runs under a policy only)
    assert full_precision_classes(BridgeConfig(mixed_precision="bf16", wrap="none")) == ()
    assert full_precision_classes(BridgeConfig(mixed_precision="bf16", wrap=["Block"])) == ("_BatchNorm",)
    assert full_precision_classes(BridgeConfig(wrap=["Block"])) == ()  # no mixed precision: nothing to keep
    listed = BridgeConfig(mixed_precision={"param_dtype": "bfloat16", "full_precision_modules": [nn.LayerNorm]})
    assert full_precision_classes(listed) == ("LayerNorm",)


def test_false_values_fsdp1_takes_as_its_defaults() -> None:
    # FSDP1 reads `cpu_offload or CPUOffload()` and `sharding_strategy or FULL_SHARD`: cpu_offload=False raised
    # AttributeError in from_fsdp1 (a public VLA trainer failed at start-up), and a literal sharding_strategy=None
    # was written as BridgeConfig(strategy=None), a ConfigError.
    config = BridgeConfig.from_fsdp1(cpu_offload=False, sharding_strategy=None)
    assert config.cpu_offload is False and config.strategy.value == "full_shard"
    with pytest.raises(ConfigError, match=r"cpu_offload: got True; allowed: None, False or CPUOffload"):
        BridgeConfig.from_fsdp1(cpu_offload=True)
    from fsdp_bridge.migrate._code import migrate_source

    fixed = migrate_source(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n"
        "def build(m):\n    return FSDP(m, sharding_strategy=None, limit_all_gathers=True)\n",
        "b.py",
    ).fixed
    assert 'strategy="full_shard"' in fixed and "strategy=None" not in fixed
    # a value passed on as written, None when the code runs ({1: HYBRID_SHARD, ...}.get(zero) for another zero):
    # FSDP1's FULL_SHARD too, not a ConfigError
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    assert BridgeConfig(strategy={1: TorchStrategy.HYBRID_SHARD}.get(3)).strategy.value == "full_shard"


def test_mixed_precision_false_is_full_precision_as_fsdp1_reads_it() -> None:
    # FSDP1 reads `mixed_precision or MixedPrecision()`: a public multi-node trainer passes mixed_precision=False,
    # which from_fsdp1 refused (ConfigError on every rank); a literal False or None is full precision, written
    # as the config's default (nothing for the torch target to keep on the bridge).
    config = BridgeConfig.from_fsdp1(mixed_precision=False, sharding_strategy=False)
    assert config == BridgeConfig.from_fsdp1()
    from fsdp_bridge.migrate._code import migrate_source

    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n"
        "def build(m):\n    return FSDP(m, mixed_precision=False, cpu_offload=False)\n"
    )
    result = migrate_source(code, "b.py")
    assert "from_fsdp1" not in result.fixed and "mixed_precision" not in result.fixed
    (row,) = [f for f in result.findings if f.construct == "mixed_precision=False"]
    assert row.replacement == "default MixedPrecisionPolicy (no casts)"
    torch_fixed = migrate_source(code, "b.py", target="torch").fixed
    assert "fsdp_bridge" not in torch_fixed and "TODO" not in torch_fixed


def test_a_param_init_fn_that_cannot_be_called_is_refused_before_sharding() -> None:
    """FSDP1 refuses ``param_init_fn=42`` (ValueError, "to be callable") only once a meta-device module reaches
    it; the bridge refuses it when the config is made, naming the value and the fix."""
    with pytest.raises(ConfigError, match=r"param_init_fn: got 42.*to be callable.*Fix: pass a function"):
        BridgeConfig.from_fsdp1(param_init_fn=42)
    assert BridgeConfig.from_fsdp1(param_init_fn=lambda m: None).backend.value == "fsdp2"
