"""BridgeConfig: parsing, normalisation, YAML round trip and every error message."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy

import fsdp_bridge
from fsdp_bridge import Backend, BackwardPrefetch, BridgeConfig, ConfigError, ShardingStrategy
from fsdp_bridge.distributed import plan_mesh
from fsdp_bridge.strategy import parse_enum


def test_two_field_config_has_sensible_defaults() -> None:
    config = BridgeConfig(strategy="FULL_SHARD", backend="fsdp2")
    assert config.strategy is ShardingStrategy.FULL_SHARD
    assert config.backend is Backend.FSDP2
    assert config.wrap.mode == "auto"
    assert config.backward_prefetch is BackwardPrefetch.PRE
    assert not config.mixed_precision.enabled
    assert config.device == "auto"


@pytest.mark.parametrize(
    ("spelling", "expected"),
    [
        ("full_shard", ShardingStrategy.FULL_SHARD),
        ("FULL_SHARD", ShardingStrategy.FULL_SHARD),
        ("Shard-Grad-Op", ShardingStrategy.SHARD_GRAD_OP),
        ("hybrid_shard_zero2", ShardingStrategy.HYBRID_SHARD_ZERO2),
        ("_HYBRID_SHARD_ZERO2", ShardingStrategy.HYBRID_SHARD_ZERO2),
        (TorchShardingStrategy.NO_SHARD, ShardingStrategy.NO_SHARD),
        (TorchShardingStrategy._HYBRID_SHARD_ZERO2, ShardingStrategy.HYBRID_SHARD_ZERO2),
        ("ShardingStrategy.HYBRID_SHARD", ShardingStrategy.HYBRID_SHARD),
    ],
)
def test_strategy_spellings(spelling: object, expected: ShardingStrategy) -> None:
    assert parse_enum(ShardingStrategy, spelling) is expected
    assert BridgeConfig(strategy=spelling).strategy is expected  # type: ignore[arg-type]


def test_torch_backward_prefetch_members_and_none() -> None:
    assert parse_enum(BackwardPrefetch, TorchBackwardPrefetch.BACKWARD_POST) is BackwardPrefetch.POST
    assert parse_enum(BackwardPrefetch, "BACKWARD_PRE") is BackwardPrefetch.PRE
    assert BridgeConfig(backend="fsdp1", backward_prefetch=None).backward_prefetch is BackwardPrefetch.NONE  # type: ignore[arg-type]


def test_mixed_precision_presets_and_dtypes() -> None:
    bf16 = BridgeConfig(mixed_precision="bf16").mixed_precision  # type: ignore[arg-type]
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.buffer_dtype) == (torch.bfloat16, torch.float32, None)
    custom = BridgeConfig(
        mixed_precision={
            "param_dtype": "bf16",
            "reduce_dtype": "torch.float32",
            "buffer_dtype": "bfloat16",
            "output_dtype": "fp32",
            "cast_forward_inputs": False,
        }  # type: ignore[arg-type]
    ).mixed_precision
    assert custom.buffer_dtype is torch.bfloat16 and custom.output_dtype is torch.float32
    assert not custom.cast_forward_inputs
    assert not BridgeConfig(mixed_precision="fp32").mixed_precision.enabled  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("wrap", "mode"),
    [
        ("auto", "auto"),
        ("none", "none"),
        (None, "none"),
        (["LlamaDecoderLayer"], "classes"),
        ("LlamaDecoderLayer", "classes"),
        ({"min_num_params": 1000}, "min_params"),
        (lambda m: False, "callable"),
        ({"classes": ["GPT2Block"]}, "classes"),
        ([torch.nn.Linear], "classes"),
    ],
)
def test_wrap_spellings(wrap: object, mode: str) -> None:
    assert BridgeConfig(wrap=wrap).wrap.mode == mode  # type: ignore[arg-type]


def test_a_float_size_threshold_counts_as_fsdp1s_comparison() -> None:
    # FSDP1 code passes min_num_params=1e9 (a float) to size_based_auto_wrap_policy, which only compares a
    # count with it: taken, as the smallest count that reaches it.
    assert BridgeConfig(wrap={"min_num_params": 1e9}).wrap.min_num_params == 1_000_000_000
    assert BridgeConfig(wrap={"min_num_params": 2.5}).wrap.min_num_params == 3


def full_config() -> BridgeConfig:
    return BridgeConfig(
        strategy="hybrid_shard",
        backend="fsdp2",
        mixed_precision={"param_dtype": "bf16", "reduce_dtype": "fp32"},
        wrap=["LlamaDecoderLayer"],
        backward_prefetch="pre",
        forward_prefetch=True,
        limit_all_gathers=False,
        cpu_offload=True,
        activation_checkpointing=True,
        sync_module_states=True,
        reshard_after_forward=2,
        hybrid_shape=[2, 4],
        ignored_modules=["lm_head"],
        device="cpu",  # type: ignore[arg-type]
    )


def test_yaml_round_trip_is_exact(tmp_path) -> None:
    for config in (BridgeConfig(), full_config(), BridgeConfig(wrap={"min_num_params": 10}, mixed_precision="bf16")):
        path = tmp_path / "c.yaml"
        path.write_text(config.to_yaml())
        assert fsdp_bridge.load_config(path) == config
        assert BridgeConfig.from_dict(yaml.safe_load(config.to_yaml())) == config


def test_load_config_reads_bridge_section_of_training_yaml(tmp_path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text("model: {type: llama}\nbridge:\n  strategy: shard_grad_op\n  backend: fsdp1\n")
    config = fsdp_bridge.load_config(path)
    assert (config.strategy, config.backend) == (ShardingStrategy.SHARD_GRAD_OP, Backend.FSDP1)


# ---------------------------------------------------------------- every error message


def test_all_problems_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        BridgeConfig.from_dict({"strategy": "zero3", "backend": "fsdp3", "devise": "cpu", "forward_prefetch": "yes"})
    message = str(info.value)
    assert "4 problems" in message
    assert "strategy: got 'zero3'; allowed: full_shard, shard_grad_op, no_shard, hybrid_shard" in message
    assert "backend: got 'fsdp3'; allowed: fsdp1, fsdp2" in message
    assert "devise: got 'cpu'; allowed: known keys are" in message and "did you mean 'device'?" in message
    assert "forward_prefetch: got 'yes'; allowed: true, false, or an integer >= 1 (units ahead, fsdp2)" in message
    assert {p.key for p in info.value.problems} == {"strategy", "backend", "devise", "forward_prefetch"}


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"mixed_precision": "int8"}, r"mixed_precision: got 'int8'; allowed: a preset \(fp32, bf16, fp16\)"),
        (
            {"mixed_precision": {"param_dtype": "float8"}},
            r"mixed_precision.param_dtype: got 'float8'; allowed: float32",
        ),
        ({"mixed_precision": {"param": "bf16"}}, r"mixed_precision.param: .*unknown key; did you mean 'param_dtype'"),
        (
            {"mixed_precision": {"cast_forward_inputs": 1}},
            r"mixed_precision.cast_forward_inputs: got 1; allowed: true or false",
        ),
        ({"wrap": 3}, r"wrap: got 3; allowed: 'auto'"),
        ({"wrap": []}, r"wrap: got \[\]; .*give at least one class name, or 'none'"),
        ({"wrap": ["not a class"]}, r"wrap\[\]: got 'not a class'; allowed: module class names"),
        ({"wrap": {"min_num_params": 0}}, r"wrap.min_num_params: got 0; allowed: a number >= 1"),
        ({"wrap": {"min_num_params": float("nan")}}, r"wrap.min_num_params: got nan; allowed: a number >= 1"),
        ({"wrap": {"min_params": 10}}, r"wrap.min_params: .*did you mean 'min_num_params'"),
        ({"wrap": {"min_num_params": 5, "classes": ["A"]}}, r"allowed: exactly one of min_num_params or classes"),
        ({"backward_prefetch": "later"}, r"backward_prefetch: got 'later'; allowed: pre, post, none"),
        ({"reshard_after_forward": 0}, r"reshard_after_forward: got 0; allowed: null \(from the strategy\)"),
        ({"reshard_after_forward": "yes"}, r"reshard_after_forward: got 'yes'"),
        ({"hybrid_shape": [2]}, r"hybrid_shape: got \[2\]; allowed: null or \[replicate, shard\]"),
        ({"hybrid_shape": [2, 2]}, r"hybrid_shape: .*Fix: remove hybrid_shape, or set strategy: hybrid_shard"),
        ({"ignored_modules": [1]}, r"ignored_modules: got \[1\]; allowed: a list of module paths"),
        ({"device": "tpu"}, r"device: got 'tpu'; allowed: auto, cuda, cpu"),
        ({"cpu_offload": "no"}, r"cpu_offload: got 'no'; allowed: true or false"),
        # Combinations a backend cannot honour: refused at config time, with the alternative.
        (
            {"backend": "fsdp2", "backward_prefetch": "post"},
            r"backward_prefetch: got 'post'; allowed: on fsdp2: pre, none, integer N \(units ahead\)\. "
            r"Fix: fsdp2 cannot do this: .*Use backward_prefetch: pre",
        ),
        ({"backward_prefetch": 0}, r"backward_prefetch: got 0; allowed: pre, post, none, or an integer >= 1"),
        ({"forward_prefetch": -1}, r"forward_prefetch: got -1; allowed: true, false, or an integer >= 1"),
        (
            {"backend": "fsdp1", "forward_prefetch": 2},
            r"forward_prefetch: got 2; allowed: on fsdp1: true, false\. Fix: fsdp1 cannot do this: FSDP1 prefetches "
            r"exactly one unit ahead and has no depth setting; use forward_prefetch: true .*or backend: fsdp2",
        ),
        (
            {"backend": "fsdp1", "backward_prefetch": 1},
            r"backward_prefetch: got 1; allowed: on fsdp1: pre, post, none\. .*use backward_prefetch: pre",
        ),
        ({"backend": "fsdp1", "reshard_after_forward": 2}, r"FSDP1 cannot reshard to a smaller group"),
        ({"float8": "e4m3"}, r"float8: got 'e4m3'; allowed: false, tensorwise or rowwise"),
        (
            {"float8": "rowwise", "device": "cpu"},
            r"float8: got 'rowwise'; allowed: on fsdp2: false, tensorwise / rowwise, on a GPU\. Fix: .*need a CUDA "
            r"GPU of compute capability 8\.9\+ .*there are none on CPU: remove float8",
        ),
        (
            {"float8": "tensorwise", "backend": "fsdp1", "device": "cuda"},
            r"float8: got 'tensorwise'; .*FSDP1 flattens each unit's parameters .* use backend: fsdp2",
        ),
        ({"compile": "yes"}, r"compile: got 'yes'; allowed: true, false, or a mapping of torch\.compile options"),
        ({"compile": {"mode": "reduce-overhead"}}, r"compile: .*CUDA graphs replay fixed buffers.*use mode: default"),
        ({"compile": True, "wrap": "none"}, r"compile: got 'True'.*compile is regional: .*wrap: none has none"),
        (
            {"backend": "fsdp1", "strategy": "full_shard", "reshard_after_forward": False},
            r"FSDP1 ties resharding to the strategy; choose the strategy instead",
        ),
        (["not", "a", "mapping"], r"config: got \['not', 'a', 'mapping'\]; allowed: a mapping of BridgeConfig keys"),
    ],
)
def test_error_messages(data: object, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        BridgeConfig.from_dict(data)  # type: ignore[arg-type]


def test_backend_combinations_that_are_fine() -> None:
    BridgeConfig(backend="fsdp1", backward_prefetch="post")  # FSDP1 has it
    BridgeConfig(backend="fsdp2", forward_prefetch=2, backward_prefetch=3)  # FSDP2 takes a depth
    BridgeConfig(backend="fsdp2", reshard_after_forward=False)  # FSDP2 overrides the strategy
    BridgeConfig(backend="fsdp1", strategy="shard_grad_op", reshard_after_forward=False)  # agrees: not needed


def test_replace_names_an_unknown_field_like_from_dict() -> None:
    config = BridgeConfig()
    with pytest.raises(ConfigError, match=r"stratgy: got 'full_shard'.*unknown key; did you mean 'strategy'"):
        config.replace(stratgy="full_shard")
    with pytest.raises(ConfigError, match=r"strategy: got 'bogus'"):
        config.replace(strategy="bogus")
    assert config.replace(strategy="shard_grad_op").strategy is ShardingStrategy.SHARD_GRAD_OP


def test_callable_wrap_cannot_be_serialised() -> None:
    with pytest.raises(ConfigError, match="callable wrap policies exist only in Python"):
        BridgeConfig(wrap=lambda m: True).to_dict()  # type: ignore[arg-type]


def test_yaml_cannot_construct_python_objects(tmp_path) -> None:
    path = tmp_path / "evil.yaml"
    path.write_text("wrap: !!python/name:os.system\n")
    with pytest.raises(ConfigError, match=r"yaml: got .*allowed: valid YAML"):
        fsdp_bridge.load_config(path)


def test_missing_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"path: got .*nope\.yaml'; allowed: a readable YAML file"):
        fsdp_bridge.load_config(tmp_path / "nope.yaml")


# ---------------------------------------------------------------- mesh planning (no collective)


def test_mesh_shapes() -> None:
    assert plan_mesh(BridgeConfig(), 4).shape == (4,)
    assert plan_mesh(BridgeConfig(strategy="no_shard", backend="fsdp2"), 4).shape == (4, 1)
    assert plan_mesh(BridgeConfig(strategy="no_shard", backend="fsdp1"), 4).shape == (4,)
    assert plan_mesh(BridgeConfig(strategy="hybrid_shard"), 16, local_world_size=8).shape == (2, 8)
    assert plan_mesh(BridgeConfig(strategy="hybrid_shard", hybrid_shape=[4, 2]), 8).shape == (4, 2)  # type: ignore[arg-type]


def test_mesh_errors() -> None:
    with pytest.raises(
        ConfigError, match=r"hybrid_shape: got \[2, 2\]; allowed: two integers whose product is the world size \(8\)"
    ):
        plan_mesh(BridgeConfig(strategy="hybrid_shard", hybrid_shape=[2, 2]), 8)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"ranks per node \(3\) does not divide the world size \(8\)"):
        plan_mesh(BridgeConfig(strategy="hybrid_shard"), 8, local_world_size=3)
    with pytest.raises(
        ConfigError, match=r"reshard_after_forward: got 3; allowed: a divisor of the shard group size \(4\)"
    ):
        plan_mesh(BridgeConfig(reshard_after_forward=3), 4)


def test_cuda_requested_without_gpus() -> None:
    from fsdp_bridge.distributed import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=r"device: got 'cuda'; allowed: auto or cpu on a machine without CUDA"):
        resolve_device("cuda")
    assert resolve_device("auto").type == "cpu"


@pytest.mark.parametrize(
    "text",
    [
        "wrap: 'lambda m: True'",
        'wrap: \'__import__("os").system("true")\'',
        "wrap: {min_num_params: '10**9'}",
        "ignored_modules: ['os.system(1)']",
    ],
)
def test_yaml_values_are_never_evaluated(tmp_path, text: str) -> None:
    # Strings stay strings: a callable wrap policy exists only when passed from Python.
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    try:
        config = fsdp_bridge.load_config(path)
    except ConfigError:
        return
    assert config.wrap.mode != "callable"
    assert all(isinstance(name, str) for name in config.ignored_modules)


_BOMB = (
    "a: &a [x, x, x, x, x, x, x, x, x]\n"
    + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))
    + "strategy: *i\n"
)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (_BOMB.encode(), r"expands to more than 100,000 values through its aliases"),
        (("strategy: " + "[" * 20000 + "]" * 20000 + "\n").encode(), r"nested more than 64 levels deep"),
        (("hybrid_shape: [" + "9" * 5001 + ", 1]\n").encode(), r"an integer of 5001 digits"),
        ("strategy: caf\xe9\n".encode("latin-1"), r"a UTF-8 text file"),
        (
            b"strategy: full_shard\nbackend: fsdp2\nstrategy: no_shard\n",
            r"duplicate key 'strategy' \(line 3, first on line 1\): the second would silently win",
        ),
    ],
)
def test_hostile_yaml_is_refused_quickly_by_every_reader(tmp_path: Path, content: bytes, expected: str) -> None:
    import time

    from fsdp_bridge.migrate import migrate_config
    from fsdp_bridge.train import load_train_config

    path = tmp_path / "hostile.yaml"
    path.write_bytes(content)
    start = time.perf_counter()
    for read in (fsdp_bridge.load_config, load_train_config, migrate_config):
        with pytest.raises(ConfigError, match=expected if "UTF-8" not in expected else r"UTF-8"):
            read(path)
    assert time.perf_counter() - start < 10  # a 391-byte alias bomb ran for minutes before


def test_a_cuda_rank_without_local_rank_uses_the_device_it_set(monkeypatch: pytest.MonkeyPatch) -> None:
    # mp.spawn'd ranks call torch.cuda.set_device(rank) and set no LOCAL_RANK: each keeps its own GPU (FSDP1's
    # torch.cuda.current_device()), where every rank once took cuda:0. A launcher's LOCAL_RANK still decides.
    from fsdp_bridge import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert distributed.resolve_device("cuda") == torch.device("cuda", 2)
    # a model already moved to its GPU (model.to(rank), no set_device): FSDP1 computes where its parameters are
    assert distributed.resolve_device("auto", placed=torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert distributed.resolve_device("cuda", placed=torch.device("cpu")) == torch.device("cuda", 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.resolve_device("cuda") == torch.device("cuda", 1)
    assert distributed.resolve_device("cuda", placed=torch.device("cuda", 3)) == torch.device("cuda", 1)
    # the process set its own GPU (a mapping of its own: local rank 1 -> cuda:2) and put the model there: FSDP1
    # computed there (llama2.c's FSDP fine-tuner), where cuda:LOCAL_RANK once moved the model away from its inputs
    assert distributed.resolve_device("auto", placed=torch.device("cuda", 2)) == torch.device("cuda", 2)
    # a process that CUDA_VISIBLE_DEVICES shows one GPU (set per rank) computes on it, whatever its LOCAL_RANK;
    # without that variable, or with more GPUs, a LOCAL_RANK past them is refused
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ConfigError, match="LOCAL_RANK: got 3"):  # two ranks on a one-GPU machine
        distributed.resolve_device("cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert distributed.resolve_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="LOCAL_RANK: got 3"):
        distributed.resolve_device("cuda")
