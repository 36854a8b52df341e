"""The decision layer: each table row's decision in the plan, and the torch call each backend makes from it.

One process, no process group: ``resolve_plan`` is pure, and the backends' torch entry points
(``FullyShardedDataParallel``, ``fully_shard``) are replaced by recorders.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fsdp_bridge import BridgeConfig
from fsdp_bridge.backends import fsdp1 as fsdp1_module
from fsdp_bridge.backends import fsdp2 as fsdp2_module
from fsdp_bridge.errors import ConfigError
from fsdp_bridge.mapping import CONFIG_OPTIONS, TABLE, Context, Outcome, translate
from fsdp_bridge.plan import ShardPlan, SyncMethod, resolve_plan
from fsdp_bridge.strategy import Backend, BackwardPrefetch, ShardingStrategy

MESH: Any = object()  # the backends pass the mesh through; the recorders never look inside it


def _plan(config: BridgeConfig, device: str, units: list[nn.Module] | None = None) -> ShardPlan:
    report = translate(config, config.backend, device_type=device)
    return resolve_plan(
        config, report, device=torch.device(device), mesh=MESH, units=units or [], ignored_modules=[], has_meta=False
    )


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("sync", [False, True])
def test_offload_and_sync_follow_the_row_each_matched(backend: str, device: str, offload: bool, sync: bool) -> None:
    config = BridgeConfig(backend=backend, cpu_offload=offload, sync_module_states=sync)
    plan = _plan(config, device)
    offload_row = plan.report.entry("cpu_offload")
    sync_row = plan.report.entry("sync_module_states")
    # Offload happens exactly where the row says the backend does it natively.
    assert plan.offload_params is (offload and device == "cuda")
    assert plan.offload_params is (offload and offload_row.outcome is Outcome.NATIVE)
    if offload and device == "cpu":
        assert offload_row.outcome is Outcome.NOT_NEEDED and "nothing is offloaded" in offload_row.text
    # FSDP1's own sync only on an accelerator; everywhere else the bridge broadcasts.
    expected = (
        SyncMethod.NONE
        if not sync
        else SyncMethod.BACKEND
        if backend == "fsdp1" and device == "cuda"
        else SyncMethod.BROADCAST
    )
    assert plan.sync is expected
    assert (sync_row.outcome is Outcome.NATIVE) is (expected is SyncMethod.BACKEND or not sync)


def test_every_option_matches_one_row_for_defaults_and_set_values() -> None:
    configs = [
        BridgeConfig(),
        BridgeConfig(
            strategy="hybrid_shard",
            mixed_precision="bf16",
            cpu_offload=True,
            activation_checkpointing=True,
            sync_module_states=True,
            reshard_after_forward=False,
            forward_prefetch=True,
        ),
    ]
    for config in configs:
        for backend in Backend:
            for device in ("cpu", "cuda", None):
                report = translate(config, backend, device_type=device)
                options = [e.option for e in report.entries]
                assert len(options) == len(set(options))
                for option in (
                    "hybrid_shape",
                    "mixed_precision.output_dtype",
                    "mixed_precision.buffer_dtype",
                    "cpu_offload",
                    "activation_checkpointing",
                    "sync_module_states",
                    "ignored_modules",
                    "device",
                ):
                    assert option in options, f"{option} matched no row for {backend} on {device}"


# Values each config option is tried with: every strategy and prefetch, each preset and
# precision shape, every wrap spelling, the unset and set forms of the rest.
_OPTION_VALUES: dict[str, list[Any]] = {
    "strategy": [s.value for s in ShardingStrategy],
    "mixed_precision": [
        None,
        "bf16",
        "fp16",
        {"param_dtype": "bf16", "reduce_dtype": "fp32"},
        {"param_dtype": "bf16", "output_dtype": "fp32", "buffer_dtype": "bf16"},
        {"param_dtype": "bf16", "full_precision_modules": ["LayerNorm"]},
        {"param_dtype": "bf16", "full_precision_modules": []},
    ],
    "wrap": ["auto", "none", {"min_num_params": 100}, ["LlamaDecoderLayer"]],
    "backward_prefetch": [*(b.value for b in BackwardPrefetch), 2],
    "forward_prefetch": [False, True, 2],
    "limit_all_gathers": [False, True],
    "cpu_offload": [False, True],
    "activation_checkpointing": [False, True],
    "sync_module_states": [False, True],
    "reshard_after_forward": [None, True, False, 2],
    "hybrid_shape": [None, (2, 2)],
    "ignored_modules": [(), ("lm_head",)],
    "device": ["auto", "cpu", "cuda"],
    "float8": [None, "tensorwise", "rowwise"],
    "compile": [False, True, {"mode": "reduce-overhead"}, {"mode": "max-autotune-no-cudagraphs", "fullgraph": True}],
}


def _configs_to_match() -> list[BridgeConfig]:
    """The default, every option at each of its values, and each of those under every strategy."""
    variants: list[dict[str, Any]] = [{}]
    for option, values in _OPTION_VALUES.items():
        variants += [{option: v} for v in values]
        if option != "strategy":
            variants += [{"strategy": s, option: v} for s in _OPTION_VALUES["strategy"] for v in values]
    configs = []
    for fields in variants:
        try:
            configs.append(BridgeConfig(**fields))
        except ConfigError:
            continue  # a combination the config itself refuses (e.g. hybrid_shape without a hybrid strategy)
    return configs


def test_every_option_value_and_device_matches_exactly_one_rule() -> None:
    """translate() takes the first rule that matches; two matching rules would hide the second
    one's outcome from the report, explain and the plan, so the table may never overlap or leave a gap."""
    configs = _configs_to_match()
    assert len(configs) > 150  # the refused combinations must not empty the check
    assert set(CONFIG_OPTIONS) <= {
        "mixed_precision.output_dtype",
        "mixed_precision.buffer_dtype",
        "mixed_precision.full_precision_modules",
        *_OPTION_VALUES,
    }
    wrong = []
    for config in configs:
        for device in ("cpu", "cuda", None):
            context = Context(config=config, device_type=device)
            for option in CONFIG_OPTIONS:
                cases = [r.case for r in TABLE if r.option == option and r.when is not None and r.when(context)]
                if len(cases) != 1:
                    wrong.append(f"{option} on {device} matched {cases or 'no rule'} for {config.to_dict()}")
    assert not wrong, "\n".join(wrong[:10])


def test_precision_and_prefetch_are_read_from_the_config_once() -> None:
    config = BridgeConfig(
        mixed_precision={
            "param_dtype": "bf16",
            "reduce_dtype": "fp32",
            "output_dtype": "fp32",
            "buffer_dtype": "bf16",
            "cast_forward_inputs": False,
        },
        backward_prefetch="post",
        forward_prefetch=True,
        limit_all_gathers=False,
        strategy="shard_grad_op",
        backend="fsdp1",
    )
    plan = _plan(config, "cpu")
    p = plan.precision
    assert (p.param_dtype, p.reduce_dtype, p.root_output_dtype, p.buffer_dtype) == (
        torch.bfloat16,
        torch.float32,
        torch.float32,
        torch.bfloat16,
    )
    assert p.enabled and not p.cast_forward_inputs
    assert plan.backward_prefetch is BackwardPrefetch.POST and plan.forward_prefetch and not plan.limit_all_gathers
    assert plan.strategy is ShardingStrategy.SHARD_GRAD_OP
    assert not _plan(BridgeConfig(), "cpu").precision.enabled


@pytest.mark.parametrize(
    ("strategy", "override", "unit", "root"),
    [
        ("full_shard", None, True, False),  # the root stays gathered for the backward that follows
        ("shard_grad_op", None, False, False),
        ("hybrid_shard", None, True, False),
        # NO_SHARD frees FSDP2's one-rank working copy after every unit, whatever is asked
        ("no_shard", None, True, True),
        ("no_shard", False, True, True),
        ("full_shard", False, False, False),
        ("shard_grad_op", True, True, True),
    ],
)
def test_reshard_after_forward_per_unit(strategy: str, override: bool | None, unit: bool, root: bool) -> None:
    config = (
        BridgeConfig(strategy=strategy)
        if override is None
        else BridgeConfig(strategy=strategy, reshard_after_forward=override, backend="fsdp2")
    )
    plan = _plan(config, "cpu")
    assert plan.reshard_after_forward(is_root=False) is unit
    assert plan.reshard_after_forward(is_root=True) is root


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2"])
def test_a_shard_group_of_one_reshards_every_unit_unless_asked(strategy: str) -> None:
    """World size 1, or HYBRID with one rank per shard group: resharding communicates nothing and
    frees FSDP2's one-rank copy, so every unit (root included) reshards; an explicit setting wins."""

    def plan(**overrides: Any) -> ShardPlan:
        config = BridgeConfig(strategy=strategy, backend="fsdp2", **overrides)
        report = translate(config, config.backend, device_type="cpu")
        return resolve_plan(
            config,
            report,
            device=torch.device("cpu"),
            mesh=MESH,
            units=[],
            ignored_modules=[],
            has_meta=False,
            shard_size=1,
        )

    assert plan().reshard_after_forward(is_root=False) is True and plan().reshard_after_forward(is_root=True) is True
    asked = plan(reshard_after_forward=False)
    assert asked.reshard_after_forward(is_root=False) is False and asked.reshard_after_forward(is_root=True) is False


def _layers() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def test_fsdp1_is_called_with_what_the_plan_decided(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    def record(module: nn.Module, **kwargs: Any) -> nn.Module:
        calls.append(kwargs)
        return module

    monkeypatch.setattr(fsdp1_module, "FullyShardedDataParallel", record)
    model = _layers()
    config = BridgeConfig(
        backend="fsdp1",
        strategy="shard_grad_op",
        cpu_offload=True,
        sync_module_states=True,
        mixed_precision="bf16",
        backward_prefetch="post",
        limit_all_gathers=False,
    )
    fsdp1_module.FSDP1Backend().shard(model, _plan(config, "cuda", units=[model[0]]))
    (kw,) = calls
    from torch.distributed.fsdp import BackwardPrefetch as TorchPrefetch
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    assert kw["sharding_strategy"] is TorchStrategy.SHARD_GRAD_OP
    assert kw["cpu_offload"].offload_params is True
    assert kw["sync_module_states"] is True  # FSDP1's own, on an accelerator
    assert kw["mixed_precision"].param_dtype is torch.bfloat16
    assert kw["backward_prefetch"] is TorchPrefetch.BACKWARD_POST and kw["limit_all_gathers"] is False
    assert kw["device_mesh"] is MESH and kw["use_orig_params"] is True
    assert kw["auto_wrap_policy"]._lambda_fn(model[0]) and not kw["auto_wrap_policy"]._lambda_fn(model[1])

    calls.clear()
    fsdp1_module.FSDP1Backend().shard(_layers(), _plan(BridgeConfig(backend="fsdp1", cpu_offload=True), "cpu"))
    (kw,) = calls
    assert kw["cpu_offload"] is None and kw["mixed_precision"] is None and kw["sync_module_states"] is False
    assert kw["auto_wrap_policy"] is None


def test_fsdp2_is_called_with_what_the_plan_decided(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[nn.Module, dict[str, Any]]] = []

    def record(module: nn.Module, **kwargs: Any) -> nn.Module:
        calls.append((module, kwargs))
        return module

    monkeypatch.setattr(fsdp2_module, "fully_shard", record)
    model = _layers()
    config = BridgeConfig(
        backend="fsdp2", cpu_offload=True, mixed_precision={"param_dtype": "bf16", "output_dtype": "fp32"}
    )
    fsdp2_module.FSDP2Backend().shard(model, _plan(config, "cuda", units=[model[0], model[1]]))
    assert [m for m, _ in calls] == [model[0], model[1], model]  # children before the root
    (_, first), _, (_, root) = calls
    assert first["reshard_after_forward"] is True and root["reshard_after_forward"] is False
    assert first["mesh"] is MESH
    assert type(first["offload_policy"]).__name__ == "CPUOffloadPolicy" and first["offload_policy"].pin_memory
    assert first["mp_policy"].param_dtype is torch.bfloat16 and first["mp_policy"].output_dtype is None
    assert root["mp_policy"].output_dtype is torch.float32  # the root's outputs only

    calls.clear()
    fsdp2_module.FSDP2Backend().shard(_layers(), _plan(BridgeConfig(backend="fsdp2", cpu_offload=True), "cpu"))
    ((_, root),) = calls
    assert type(root["offload_policy"]).__name__ == "OffloadPolicy"  # not needed on a CPU run


def test_nccl_is_bound_to_the_rank_gpu_and_gloo_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_bridge import distributed

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(distributed, "resolve_device", lambda device, placed=None: torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    distributed.init_distributed("cuda")
    monkeypatch.setattr(distributed, "resolve_device", lambda device, placed=None: torch.device("cpu"))
    distributed.init_distributed("cpu")
    assert [(c["backend"], c["device_id"]) for c in calls] == [("nccl", torch.device("cuda", 1)), ("gloo", None)]


def test_fsdp1_units_hold_one_dtype_each() -> None:
    """A bf16 block holding fp32 adapters: the modules owning the fp32 parameters become units of
    their own; a module whose own parameters mix dtypes cannot be split and is refused, named."""
    from fsdp_bridge.errors import ConfigError
    from fsdp_bridge.wrap import in_post_order, one_dtype_per_unit

    block = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(torch.bfloat16)
    block.add_module("adapter", nn.Linear(4, 2))  # fp32, like peft's upcast lora_A/lora_B
    model = nn.Sequential(block, nn.Linear(4, 4))
    extra, notes = one_dtype_per_unit(model, [block])
    assert extra == [block.adapter] and "0.adapter" in notes[0] and "torch.float32" in notes[0]
    assert in_post_order(model, [block, *extra]) == [block.adapter, block]
    assert one_dtype_per_unit(model, [block, block.adapter]) == ([], [])
    block[0].bias = nn.Parameter(torch.zeros(4))  # fp32 bias on a bf16 weight: one module, two dtypes
    with pytest.raises(ConfigError, match=r"model: got '0.0 holds torch.bfloat16, torch.float32 parameters'"):
        one_dtype_per_unit(model, [block])


class FSDPStyleBlock(nn.Module):
    """A user class whose own name starts with "FSDP" (stripping a prefix would misname it)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


def test_model_class_name_sees_through_both_backends() -> None:
    """Checkpoint descriptions record the user's class, not FSDP1's wrapper or FSDP2's ``FSDP<Cls>``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    from fsdp_bridge.backends import model_class_name
    from fsdp_bridge.estimate import fake_process_group

    assert model_class_name(FSDPStyleBlock()) == "FSDPStyleBlock"
    with fake_process_group(rank=0, world_size=2):
        two = FSDPStyleBlock()
        fully_shard(two, mesh=init_device_mesh("cpu", (2,)))
        assert type(two).__name__ == "FSDPFSDPStyleBlock"
        assert model_class_name(two) == "FSDPStyleBlock"
        one = FullyShardedDataParallel(FSDPStyleBlock(), device_id=torch.device("cpu"), use_orig_params=True)
        assert model_class_name(one) == "FSDPStyleBlock"


class _Mesh:
    def __init__(self, *shape: int) -> None:
        self.shape = shape
        self.ndim = len(shape)

    def size(self, dim: int) -> int:
        return self.shape[dim]


@pytest.mark.parametrize(
    ("backend", "shape", "defers"),
    [("fsdp2", (2, 2), True), ("fsdp2", (4, 1), True), ("fsdp2", (1, 4), False), ("fsdp2", (4,), False)],
)
def test_defer_all_reduce_defers_where_there_are_replicas(backend: str, shape: tuple[int, ...], defers: bool) -> None:
    config = BridgeConfig(backend=backend)
    plan = resolve_plan(
        config,
        translate(config, device_type="cpu"),
        device=torch.device("cpu"),
        mesh=_Mesh(*shape),  # type: ignore[arg-type]
        units=[],
        ignored_modules=[],
        has_meta=False,
    )
    assert plan.defers_all_reduce() is defers


def test_defer_all_reduce_is_refused_on_fsdp1_with_the_reason() -> None:
    plan = _plan(BridgeConfig(backend="fsdp1", strategy="hybrid_shard"), "cpu")
    with pytest.raises(
        ConfigError,
        match=r"defer_all_reduce: got 'fsdp1'; allowed: a model sharded with backend: fsdp2\. Fix: FSDP1 cannot keep "
        r"the reduce-scatter per micro-batch and defer only the all-reduce across replicas; use "
        r"fsdp_bridge\.no_sync\(model\)",
    ):
        plan.defers_all_reduce()


def test_fsdp2_defers_the_all_reduce_of_every_unit_and_restores_it() -> None:
    calls: list[bool] = []

    class Sharded(fsdp2_module.FSDPModule, nn.Linear):
        def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
            assert recurse  # every unit, not only the root
            calls.append(requires_all_reduce)

    model = nn.Linear(2, 2)
    model.__class__ = Sharded  # as fully_shard does (FSDPModule.__new__ would build the plain class)
    with pytest.raises(RuntimeError, match="boom"), fsdp2_module.FSDP2Backend().defer_all_reduce(model):
        assert calls == [False]
        raise RuntimeError("boom")
    assert calls == [False, True]  # restored even when the block raises
