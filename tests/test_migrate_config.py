"""``fsdp-bridge migrate config``: every source, every option, the documented outcome; accelerate accepts the output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml

import fsdp_bridge
from fsdp_bridge import BridgeConfig, ConfigError, load_config
from fsdp_bridge.cli import main
from fsdp_bridge.docgen import render
from fsdp_bridge.migrate import Status, migrate_config, write_outputs

M, E, X, NE = Status.MAPPED, Status.EMULATED, Status.NOT_NEEDED, Status.NO_EQUIVALENT

ACCELERATE = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "FSDP",
    "downcast_bf16": "no",
    "fsdp_config": {
        "fsdp_activation_checkpointing": True,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_backward_prefetch": "BACKWARD_POST",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_forward_prefetch": True,
        "fsdp_min_num_params": 0,
        "fsdp_offload_params": True,
        "fsdp_sharding_strategy": 4,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_sync_module_states": True,
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_use_orig_params": True,
        "fsdp_ignored_modules": "lm_head",
        "fsdp_version": 1,
    },
    "machine_rank": 0,
    "main_training_function": "main",
    "mixed_precision": "bf16",
    "num_machines": 2,
    "num_processes": 16,
    "rdzv_backend": "static",
    "same_network": True,
    "use_cpu": False,
}


def _write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data) if path.suffix == ".json" else yaml.safe_dump(data))
    return path


def _statuses(report) -> dict[str, Status]:
    return {r.key: r.status for r in report.rows}


def _accelerate_plugin(path: Path) -> tuple[object, object, dict[str, str]]:
    """What `accelerate launch --config_file path` would build (accelerate 1.15's own loader)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    with mock.patch.dict(os.environ, env):
        if env.get("ACCELERATE_USE_FSDP") != "true":
            return None, None, env
        return FullyShardedDataParallelPlugin(), ParallelismConfig(), env


def test_accelerate_every_option(tmp_path: Path) -> None:
    src = _write(tmp_path / "fsdp1.yaml", ACCELERATE)
    m = migrate_config(src)
    assert _statuses(m.report) == {
        "fsdp_sharding_strategy": M,  # HYBRID_SHARD stays hybrid
        "fsdp_auto_wrap_policy": E,
        "fsdp_transformer_layer_cls_to_wrap": E,
        "fsdp_min_num_params": X,  # accelerate ignores it with transformer wrap
        "fsdp_backward_prefetch": NE,
        "fsdp_forward_prefetch": E,
        "fsdp_offload_params": M,
        "fsdp_sync_module_states": E,
        "fsdp_activation_checkpointing": M,
        "fsdp_use_orig_params": X,
        "fsdp_cpu_ram_efficient_loading": E,
        "fsdp_state_dict_type": M,
        "fsdp_ignored_modules": M,
        "mixed_precision": M,
        "downcast_bf16": X,  # TPU only
        "mixed_precision (mixed_precision.buffer_dtype)": E,
        # every other key is reported as not used (carried into the accelerate YAML), never dropped
        **dict.fromkeys((k for k in ACCELERATE if k not in ("fsdp_config", "mixed_precision", "downcast_bf16")), X),
    }
    assert "not read by the migration" in m.report.row("machine_rank").reason
    c = m.fsdp2
    assert (c.backend.value, c.strategy.value, c.wrap.classes, c.backward_prefetch.value) == (
        "fsdp2",
        "hybrid_shard",
        ("LlamaDecoderLayer",),
        "pre",
    )
    assert c.forward_prefetch and c.cpu_offload and c.sync_module_states and c.activation_checkpointing
    assert c.ignored_modules == ("lm_head",)
    assert str(c.mixed_precision.buffer_dtype) == "torch.bfloat16"
    assert "BACKWARD_PRE timing" in m.report.row("fsdp_backward_prefetch").reason

    written = write_outputs(m, tmp_path / "out" / "fsdp2.yaml")
    assert [Path(p).name for p in written] == ["fsdp2.yaml", "fsdp2.accelerate.yaml", "fsdp2.migration.md"]
    assert load_config(written[0]) == c
    acc = yaml.safe_load(Path(written[1]).read_text())
    assert acc["fsdp_config"]["fsdp_version"] == 2
    assert acc["parallelism_config"] == {
        "parallelism_config_dp_replicate_size": 2,
        "parallelism_config_dp_shard_size": 8,
    }
    for gone in (
        "fsdp_sharding_strategy",
        "fsdp_backward_prefetch",
        "fsdp_forward_prefetch",
        "fsdp_use_orig_params",
        "fsdp_sync_module_states",
    ):
        assert gone not in acc["fsdp_config"]
    plugin, parallel, _ = _accelerate_plugin(Path(written[1]))
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert (parallel.dp_replicate_size, parallel.dp_shard_size) == (2, 8)
    assert "forward_prefetch" in m.report.row("fsdp_forward_prefetch").accelerate
    report_md = Path(written[2]).read_text()
    assert "| `fsdp_backward_prefetch` | `BACKWARD_POST` | no equivalent |" in report_md


@pytest.mark.parametrize(
    ("strategy", "expected", "raf"),
    [
        ("1", "full_shard", True),
        ("SHARD_GRAD_OP", "shard_grad_op", False),
        (5, "hybrid_shard_zero2", False),
    ],
)
def test_accelerate_strategy_spellings(tmp_path: Path, strategy: object, expected: str, raf: bool) -> None:
    data = {
        "distributed_type": "FSDP",
        "num_machines": 1,
        "num_processes": 2,
        "fsdp_config": {
            "fsdp_sharding_strategy": strategy,
            "fsdp_backward_prefetch": "BACKWARD_PRE",
            "fsdp_version": 1,
        },
    }
    m = migrate_config(_write(tmp_path / "a.yaml", data))
    assert m.fsdp2.strategy.value == expected
    assert m.accelerate is not None and m.accelerate["fsdp_config"]["fsdp_reshard_after_forward"] is raf
    written = write_outputs(m, tmp_path / "b.yaml")
    plugin, _, _ = _accelerate_plugin(Path(written[1]))
    assert plugin.reshard_after_forward is raf
    assert _statuses(m.report)["fsdp_backward_prefetch"] is M


def test_accelerate_no_shard_keeps_replication(tmp_path: Path) -> None:
    data = {
        "distributed_type": "FSDP",
        "num_machines": 1,
        "num_processes": 4,
        "mixed_precision": "no",
        "fsdp_config": {"fsdp_sharding_strategy": "NO_SHARD", "fsdp_version": 1},
    }
    m = migrate_config(_write(tmp_path / "a.yaml", data))
    assert m.fsdp2.strategy.value == "no_shard"  # not reshard_after_forward=False (ZeRO-2)
    assert "(world, 1)" in m.report.row("fsdp_sharding_strategy").reason
    assert m.accelerate is not None and m.accelerate["distributed_type"] == "MULTI_GPU"
    assert "fsdp_config" not in m.accelerate
    assert any("DDP" in n for n in m.report.notes)
    # defaults accelerate ran FSDP1 with are reported too
    # accelerate's FSDP1 default (no backward prefetch) is kept: FSDP2 can now run without it
    assert m.report.row("fsdp_backward_prefetch").status is E and m.fsdp2.backward_prefetch.value == "none"
    assert m.report.row("fsdp_backward_prefetch").value.startswith("(not set")
    written = write_outputs(m, tmp_path / "b.yaml")
    plugin, _, env = _accelerate_plugin(Path(written[1]))
    assert plugin is None and env.get("ACCELERATE_USE_FSDP") != "true"


def test_accelerate_hybrid_without_sizes_writes_no_accelerate_yaml(tmp_path: Path) -> None:
    data = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "HYBRID_SHARD"}}
    m = migrate_config(_write(tmp_path / "a.yaml", data))
    assert m.accelerate is None and m.fsdp2.strategy.value == "hybrid_shard"
    assert any("use the bridge YAML" in n for n in m.report.notes)


def test_trainer_every_option(tmp_path: Path) -> None:
    args = {
        "output_dir": "out",
        "bf16": True,
        "fsdp": "hybrid_shard_zero2 offload auto_wrap",
        "fsdp_config": {
            "fsdp_version": 1,
            "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"],
            "backward_prefetch": "backward_pre",
            "forward_prefetch": False,
            "limit_all_gathers": True,
            "use_orig_params": False,
            "sync_module_states": True,
            "cpu_ram_efficient_loading": True,
            "activation_checkpointing": True,
            "state_dict_type": "FULL_STATE_DICT",
            "min_num_params": 0,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "xla": False,
        },
    }
    m = migrate_config(_write(tmp_path / "args.json", args))
    assert m.source.kind == "trainer" and m.accelerate is None
    assert _statuses(m.report) == {
        "fsdp: hybrid_shard_zero2": M,
        "fsdp: offload": M,
        "fsdp: auto_wrap": E,
        "fsdp_config.auto_wrap_policy": E,
        "fsdp_config.transformer_layer_cls_to_wrap": E,
        "fsdp_config.min_num_params": X,
        "fsdp_config.backward_prefetch": M,
        "fsdp_config.forward_prefetch": M,
        "fsdp_config.sync_module_states": E,
        "fsdp_config.activation_checkpointing": M,
        "fsdp_config.limit_all_gathers": X,
        "fsdp_config.use_orig_params": X,
        "fsdp_config.cpu_ram_efficient_loading": E,
        "fsdp_config.state_dict_type": M,
        "bf16": M,
        "bf16 (mixed_precision.buffer_dtype)": E,
        "output_dir": X,  # not an FSDP setting: reported as not used
    }
    assert m.fsdp2.strategy.value == "hybrid_shard_zero2" and m.fsdp2.cpu_offload
    assert m.report.row("fsdp_config.state_dict_type").target == 'fsdp_bridge.save_checkpoint(..., kind="full")'

    # the fsdp string given on the command line, fsdp_config JSON as the source
    cfg = _write(tmp_path / "fsdp_config.json", {"fsdp_transformer_layer_cls_to_wrap": "GPT2Block"})
    m2 = migrate_config(cfg, fsdp="no_shard")
    assert m2.fsdp2.strategy.value == "no_shard" and m2.fsdp2.wrap.classes == ("GPT2Block",)
    assert m2.report.row("fsdp_config.backward_prefetch").status is E  # transformers' FSDP1 default: none, kept


def test_bridge_yaml_every_option(tmp_path: Path) -> None:
    data = {
        "strategy": "hybrid_shard",
        "backend": "fsdp1",
        "mixed_precision": "bf16",
        "wrap": ["LlamaDecoderLayer"],
        "backward_prefetch": "none",
        "forward_prefetch": True,
        "limit_all_gathers": False,
        "cpu_offload": True,
        "activation_checkpointing": True,
        "sync_module_states": True,
        "reshard_after_forward": True,
        "hybrid_shape": [2, 4],
        "ignored_modules": ["lm_head"],
        "device": "cuda",
    }
    m = migrate_config(_write(tmp_path / "bridge.yaml", {"bridge": data}))
    assert _statuses(m.report) == {
        "strategy": M,
        "mixed_precision": M,
        "wrap": E,
        "backward_prefetch": E,  # none: no prefetch on FSDP2 too
        "forward_prefetch": E,
        "limit_all_gathers": X,
        "cpu_offload": M,
        "activation_checkpointing": M,
        "sync_module_states": E,
        "reshard_after_forward": M,
        "hybrid_shape": M,
        "ignored_modules": M,
        "device": M,
    }
    assert m.fsdp2 == BridgeConfig.from_dict({**data, "backend": "fsdp2"})


def test_errors_name_the_key(tmp_path: Path) -> None:
    bad = {
        "distributed_type": "FSDP",
        "fsdp_config": {"fsdp_sharding_stratgy": 1, "fsdp_offload_params": "maybe", "fsdp_backward_prefetch": "LATER"},
    }
    with pytest.raises(ConfigError, match=r"fsdp_config.fsdp_sharding_stratgy.*accelerate FSDP1 keys") as err:
        migrate_config(_write(tmp_path / "a.yaml", bad))
    del bad["fsdp_config"]["fsdp_sharding_stratgy"]
    expected = (
        r"(?s)fsdp_config.fsdp_backward_prefetch: got 'LATER'; allowed: BACKWARD_PRE \(1\).*"
        r"fsdp_config.fsdp_offload_params: got 'maybe'"
    )
    with pytest.raises(ConfigError, match=expected) as err:
        migrate_config(_write(tmp_path / "a.yaml", bad))
    assert len(err.value.problems) == 2
    with pytest.raises(ConfigError, match=r"fsdp_version: got 2.*already FSDP2"):
        migrate_config(_write(tmp_path / "b.yaml", {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}))
    with pytest.raises(ConfigError, match=r"backend: got 'fsdp2'.*already runs on FSDP2"):
        migrate_config(_write(tmp_path / "c.yaml", {"backend": "fsdp2"}))
    with pytest.raises(ConfigError, match=r"fsdp: got 'zero3'"):
        migrate_config(_write(tmp_path / "d.json", {"fsdp": "zero3", "fsdp_config": {}}))
    with pytest.raises(ConfigError, match=r"SRC: got .*pass the fsdp option string with --fsdp"):
        migrate_config(_write(tmp_path / "e.json", {"min_num_params": 3}))


def test_cli_prints_and_writes(tmp_path: Path) -> None:
    src = _write(tmp_path / "fsdp1.yaml", ACCELERATE)
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_bridge", "migrate", "config", str(src)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "fsdp_backward_prefetch: NO EQUIVALENT" in out.stdout
    assert (tmp_path / "fsdp1.fsdp2.yaml").exists() and (tmp_path / "fsdp1.fsdp2.migration.md").exists()
    assert (tmp_path / "fsdp1.fsdp2.accelerate.yaml").exists()
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_bridge", "migrate", "config", str(tmp_path / "nope.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 2 and "SRC: got" in out.stderr


def test_docs_table_is_generated_from_the_mapping() -> None:
    path = Path(__file__).resolve().parents[1] / "docs" / "migration.md"
    text = path.read_text()
    assert render(text) == text, "docs/migration.md is out of date: run python -m fsdp_bridge.docgen"


# -- configs as published recipes write them (fixtures of our own, one per spelling) -----------

CONFIGS = Path(__file__).parent / "fixtures" / "migrate_configs"
BF16 = {
    "param_dtype": "bfloat16",
    "reduce_dtype": "bfloat16",
    "output_dtype": None,
    "buffer_dtype": "bfloat16",
    "cast_forward_inputs": True,
    "cast_root_forward_inputs": True,
}
FP16 = {**BF16, "param_dtype": "float16", "reduce_dtype": "float16", "buffer_dtype": "float16"}
EXPECTED_CONFIGS = {
    "trainer_cmd_llama.sh": dict(
        strategy="full_shard", wrap=["LlamaDecoderLayer"], cpu_offload=False, mixed_precision=BF16
    ),
    "trainer_cmd_offload_size.sh": dict(
        strategy="shard_grad_op", wrap={"min_num_params": 5000000}, cpu_offload=True, mixed_precision=FP16
    ),
    "trainer_cmd_hybrid_config_file.sh": dict(
        strategy="hybrid_shard", wrap=["MistralDecoderLayer"], forward_prefetch=True, mixed_precision=BF16
    ),
    "trainer_args_legacy.json": dict(strategy="full_shard", wrap=["Qwen2DecoderLayer"], mixed_precision=BF16),
    "trainer_args_size_based.json": dict(
        strategy="full_shard", wrap={"min_num_params": 20000000}, cpu_offload=True, mixed_precision="fp32"
    ),
    "trainer_args_prefixed.yaml": dict(
        strategy="shard_grad_op", wrap=["GPTNeoXLayer"], activation_checkpointing=True, sync_module_states=True
    ),
    "axolotl_offload.yaml": dict(
        strategy="full_shard",
        wrap=["LlamaDecoderLayer"],
        cpu_offload=True,
        sync_module_states=True,
        limit_all_gathers=True,
        mixed_precision=BF16,
    ),
    "accelerate_hybrid_size.yaml": dict(
        strategy="hybrid_shard", wrap={"min_num_params": 100000000}, mixed_precision=BF16
    ),
    "accelerate_numbered_old.yaml": dict(strategy="shard_grad_op", wrap=["T5Block"], backward_prefetch="pre"),
    # precision spellings: axolotl's bf16: auto is bf16 (not fp32), fp16 flags, accelerate's mixed_precision
    "axolotl_bf16_auto.yaml": dict(strategy="full_shard", wrap=["MistralDecoderLayer"], mixed_precision=BF16),
    "axolotl_fp16_size.yaml": dict(
        strategy="hybrid_shard", wrap={"min_num_params": 1000000}, cpu_offload=True, mixed_precision=FP16
    ),
    "trainer_args_fp16_half_backend.json": dict(
        strategy="shard_grad_op", wrap=["GPTNeoXLayer"], forward_prefetch=True, mixed_precision=FP16
    ),
    "accelerate_fp16_hybrid_size.yaml": dict(
        strategy="hybrid_shard", wrap={"min_num_params": 2000000}, backward_prefetch="none", mixed_precision=FP16
    ),
}


def _input_keys(path: Path) -> set[str]:
    """The FSDP options a person wrote in the file (what must each show in the report)."""
    text = path.read_text()
    if path.suffix == ".sh":
        return {t[2:].split("=")[0] for t in text.split() if t.startswith("--fsdp")} - {"fsdp_config"}
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    cfg = data.get("fsdp_config") or {}
    keys = {k.removeprefix("fsdp_") for k in cfg} | {k.removeprefix("fsdp_") for k in data if k.startswith("fsdp_")}
    return keys - {"config"}


@pytest.mark.parametrize("name", sorted(EXPECTED_CONFIGS))
def test_published_config_spellings_migrate_without_dropping_options(name: str, tmp_path: Path) -> None:
    src = CONFIGS / name
    out = tmp_path / "bridge.yaml"
    assert main(["migrate", "config", str(src), "-o", str(out)]) == 0
    written = yaml.safe_load(out.read_text())
    for key, value in EXPECTED_CONFIGS[name].items():
        assert written[key] == value, (key, written[key])
    fsdp_bridge.load_config(out)  # loads as a bridge config
    assert main(["explain", str(out)]) == 0
    report = migrate_config(src).report
    reported = " ".join(r.key for r in report.rows)
    missing = [k for k in _input_keys(src) if k.removeprefix("fsdp_") not in reported]
    assert not missing, f"options not in the report: {missing}"


def test_axolotl_list_and_config_that_disagree_on_offload_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"fsdp_offload_params: got False; allowed: true, as the fsdp list asks"):
        migrate_config(CONFIGS / "axolotl_list_offload.yaml")


def test_a_command_line_without_fsdp_is_named() -> None:
    with pytest.raises(ConfigError, match=r"no --fsdp flag found"):
        from fsdp_bridge.migrate._config import parse_trainer_command

        parse_trainer_command("python train.py --bf16 True", "run.sh", base=Path("."))


def test_a_script_ending_in_a_line_continuation_is_read_as_bash_reads_it() -> None:
    # protap's launch scripts end with "--fsdp no_shard \" and no newline: bash runs them; shlex refused the
    # lone backslash ("No escaped character")
    from fsdp_bridge.migrate._config import parse_trainer_command

    source = parse_trainer_command(
        "torchrun train.py \\\n    --bf16 True \\\n    --fsdp no_shard \\", "run.sh", base=Path(".")
    )
    assert source.raw["fsdp"] == "no_shard" and source.raw["bf16"] == "True"


# -- precision spellings and keys the migration does not use ------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "axolotl_bf16_auto.yaml",
        "axolotl_fp16_size.yaml",
        "trainer_args_fp16_half_backend.json",
        "accelerate_fp16_hybrid_size.yaml",
        "axolotl_offload.yaml",
        "trainer_args_legacy.json",
    ],
)
def test_every_key_of_the_source_is_in_the_report(name: str) -> None:
    src = CONFIGS / name
    data = json.loads(src.read_text()) if src.suffix == ".json" else yaml.safe_load(src.read_text())
    report = migrate_config(src).report
    keys = {r.key.split(" (")[0].removeprefix("fsdp_config.") for r in report.rows}
    reported = keys | {k.removeprefix("fsdp_") for k in keys}
    # the fsdp list and fsdp_config are read key by key; Trainer flags named fsdp_* are reported under fsdp_config
    top = {k.removeprefix("fsdp_") for k in data if k not in ("fsdp", "fsdp_config")}
    nested = {k.removeprefix("fsdp_") for k in data.get("fsdp_config") or {}}
    assert not (top - reported), f"top-level keys not reported: {top - reported}"
    assert not (nested - reported), f"fsdp_config keys not reported: {nested - reported}"


def test_bf16_auto_is_bf16_and_the_report_says_it_meant_hardware_dependent() -> None:
    m = migrate_config(CONFIGS / "axolotl_bf16_auto.yaml")
    assert m.source.kind == "axolotl"
    assert m.fsdp2.mixed_precision.param_dtype == torch.bfloat16  # was silently fp32
    row = m.report.row("bf16")
    assert (row.value, row.status) == ("auto", M)
    assert any("bf16: auto" in n and "otherwise in fp16" in n for n in m.report.notes)
    assert m.report.row("tf32").status is X and "not an FSDP option" in m.report.row("tf32").reason
    assert "not read by the migration" in m.report.row("base_model").reason


def test_reports_show_the_value_each_construct_had() -> None:
    m = migrate_config(CONFIGS / "accelerate_fp16_hybrid_size.yaml")
    wrap = m.report.row("fsdp_auto_wrap_policy")
    assert (wrap.value, wrap.target) == (
        "SIZE_BASED_WRAP (min_num_params=2000000)",
        'wrap: {"min_num_params": 2000000}',
    )
    strategy = m.report.row("fsdp_sharding_strategy")
    assert (strategy.value, strategy.target) == ("HYBRID_SHARD", 'strategy: "hybrid_shard"')
    assert "2D mesh" in strategy.reason
    m = migrate_config(CONFIGS / "axolotl_bf16_auto.yaml")
    assert m.report.row("fsdp_auto_wrap_policy").value == (
        "TRANSFORMER_BASED_WRAP (transformer_layer_cls_to_wrap=MistralDecoderLayer)"
    )


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"bf16": "auto"}, "bfloat16"),
        ({"bf16": True, "fp16": False}, "bfloat16"),
        ({"bf16": "false", "fp16": "true"}, "float16"),
        ({"bf16": False}, None),
        ({"mixed_precision": "no"}, None),
        ({"mixed_precision": "bf16"}, "bfloat16"),
        ({"torch_dtype": "bfloat16", "bfloat16": True}, None),  # the model's dtype, not mixed precision
    ],
)
def test_axolotl_precision_spellings(flags: dict[str, object], expected: str | None, tmp_path: Path) -> None:
    data = {"base_model": "m", "fsdp": ["full_shard"], "fsdp_config": {"fsdp_offload_params": False}, **flags}
    m = migrate_config(_write(tmp_path / "axolotl.yaml", data))
    dtype = m.fsdp2.mixed_precision.param_dtype
    assert (None if dtype is None else str(dtype).removeprefix("torch.")) == expected
    for key in flags:
        assert m.report.row(key)


def test_bf16_and_fp16_together_are_refused(tmp_path: Path) -> None:
    args = {"output_dir": "o", "bf16": True, "fp16": True, "fsdp": "full_shard", "fsdp_config": {}}
    with pytest.raises(ConfigError, match=r"bf16/fp16: got 'bf16: True, fp16: True'; allowed: one of bf16 and fp16"):
        migrate_config(_write(tmp_path / "args.json", args))
