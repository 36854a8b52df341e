"""The training YAML: validation before launch, overrides, examples, docs, schedule and data order."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from fsdp_bridge.cli import main
from fsdp_bridge.errors import ConfigError
from fsdp_bridge.testing.damage import describe
from fsdp_bridge.train import TrainConfig, default_config_path, field_reference, load_train_config, lr_at, preflight
from fsdp_bridge.train._data import PackedData
from fsdp_bridge.train._launch import existing_launch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Fail the test if the CLI tries to start or become a rank."""
    import fsdp_bridge.train._launch as launch_mod

    started: list[object] = []

    def refuse(*args: object, **kwargs: object) -> int:
        started.append(args)
        raise AssertionError("a process was launched")

    monkeypatch.setattr(launch_mod, "launch", refuse)
    monkeypatch.setattr(launch_mod, "run_rank", refuse)
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    return started


def test_unknown_key_is_named_with_a_suggestion_and_nothing_is_launched(tmp_path, no_launch, capsys) -> None:
    path = _write(tmp_path, "model: {config: {model_type: llama}}\ndata: {seq_lenn: 64}\nmax_step: 3\n")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "data.seq_lenn: got 64" in err and "did you mean 'seq_len'?" in err
    assert "max_step: got 3" in err and "did you mean 'max_steps'?" in err
    assert no_launch == []


def test_wrong_types_and_values_are_all_reported_together(tmp_path) -> None:
    path = _write(
        tmp_path,
        "model: {path: ./m}\noptim: {lr: fast, betas: [0.9]}\nmicro_batch_size: 1.5\n"
        "grad_accum: 0\nbridge: {strategy: zero3}\ncheckpoint: {kind: half}\n",
    )
    with pytest.raises(ConfigError) as info:
        load_train_config(path)
    text = str(info.value)
    assert re.search(r"optim\.lr: got 'fast'; allowed: a number", text)
    assert re.search(r"optim\.betas: got \[0\.9\]; allowed: a list of 2 numbers", text)
    assert re.search(r"micro_batch_size: got 1\.5; allowed: an integer", text)
    assert re.search(r"bridge\.strategy: got 'zero3'", text)
    assert re.search(r"checkpoint\.kind: got 'half'; allowed: one of sharded, full", text)
    # grad_accum=0 is a value problem, found once the types are right.
    with pytest.raises(ConfigError, match=r"grad_accum: got 0; allowed: an integer >= 1"):
        load_train_config(
            path,
            [
                "optim.lr=1e-3",
                "optim.betas=[0.9,0.99]",
                "micro_batch_size=2",
                "bridge.strategy=full_shard",
                "checkpoint.kind=full",
            ],
        )


def test_missing_model_fails_before_launch_with_exit_code_2(tmp_path, no_launch, capsys) -> None:
    path = _write(tmp_path, "data: {files: [sample]}\nmax_steps: 5\n")
    assert main(["train", str(path)]) == 2
    assert re.search(r"  - model: got None; allowed: a model: section", capsys.readouterr().err)
    with pytest.raises(ConfigError, match=r"model: got None; allowed: model\.path .* or model\.config"):
        load_train_config(_write(tmp_path, "model: {}\n"))
    with pytest.raises(ConfigError, match=r"model\.config\.model_type: got None"):
        load_train_config(_write(tmp_path, "model: {config: {hidden_size: 8}}\n"))
    assert no_launch == []


def test_files_checkpoints_and_mesh_are_checked_before_launch(tmp_path, no_launch, capsys) -> None:
    path = _write(
        tmp_path,
        f"model: {{config: {{model_type: llama}}}}\ndata: {{files: [{tmp_path}/none/*.txt]}}\n"
        f"output_dir: {tmp_path}/out\nbridge: {{strategy: hybrid_shard, hybrid_shape: [2, 3]}}\n",
    )
    assert main(["train", str(path), "--nproc-per-node", "4"]) == 2
    err = capsys.readouterr().err
    assert "data.files: got '" in err and "none/*.txt" in err
    assert "hybrid_shape: got [2, 3]; allowed: two integers whose product is the world size (4)" in err
    # A fresh run refuses to write over another run's checkpoints.
    describe(tmp_path / "out/checkpoints/step_00000003", step=3)
    config = load_train_config(path, ["data.files=[sample]", "bridge.strategy=full_shard", "bridge.hybrid_shape=null"])
    with pytest.raises(ConfigError, match=r"resume: got False; .* already holds step_00000003: pass --resume"):
        preflight(config)
    preflight(dataclasses.replace(config, resume="auto"))
    assert no_launch == []


def test_bad_yaml_through_the_real_command_exits_2(tmp_path) -> None:
    path = _write(tmp_path, "model: {config: {model_type: llama}}\noptim: {lr: [1]}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_bridge", "train", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 2
    assert "optim.lr: got [1]; allowed: a number" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_overrides_backend_flag_and_round_trip(tmp_path) -> None:
    config = load_train_config(
        None,
        [
            "optim.lr=1e-3",
            "bridge.strategy=shard_grad_op",
            "max_steps=20",
            "data.files=[a.txt,b.jsonl]",
            "optim.grad_clip=null",
            "resume=auto",
        ],
        backend="fsdp1",
    )
    assert config.optim.lr == 1e-3 and config.max_steps == 20 and config.optim.grad_clip is None
    assert config.bridge.strategy.value == "shard_grad_op" and config.bridge.backend.value == "fsdp1"
    assert config.data.files == ("a.txt", "b.jsonl") and config.resume == "auto"
    assert TrainConfig.from_dict(yaml.safe_load(config.to_yaml())) == config
    with pytest.raises(ConfigError, match=r"override: got 'max_steps'; allowed: key=value"):
        load_train_config(None, ["max_steps"])
    with pytest.raises(ConfigError, match=r"optim\.lrr: got 0\.1; .* did you mean 'lr'\?"):
        load_train_config(None, ["optim.lrr=0.1"])


def test_checkpoint_async_is_written_async_in_yaml() -> None:
    # `async` is a Python keyword: the field is async_mode, its YAML key (and override, error, doc) is async.
    config = load_train_config(None, ["checkpoint.async=process"])
    assert config.checkpoint.async_mode == "process"
    dumped = yaml.safe_load(config.to_yaml())["checkpoint"]
    assert dumped["async"] == "process" and "async_mode" not in dumped
    assert TrainConfig.from_dict(yaml.safe_load(config.to_yaml())) == config
    assert load_train_config(None, []).checkpoint.async_mode == "off"
    assert load_train_config(None, ["checkpoint.async=off"]).checkpoint.async_mode == "off"  # YAML reads off as false
    with pytest.raises(ConfigError) as info:
        load_train_config(None, ["checkpoint.async=proces", "checkpoint.asyn=thread", "checkpoint.async_mode=thread"])
    text = str(info.value)
    assert "checkpoint.async: got 'proces'; allowed: one of off, thread, process" in text
    assert "checkpoint.asyn: got 'thread'" in text and "did you mean 'async'?" in text
    assert "checkpoint.async_mode: got 'thread'" in text
    with pytest.raises(
        ConfigError, match=r"checkpoint\.async: got 'thread'; allowed: off when checkpoint\.kind is full"
    ):
        load_train_config(None, ["checkpoint.async=thread", "checkpoint.kind=full"])
    with pytest.raises(ConfigError, match=r"checkpoint\.async: got 'process'; allowed: off when output_dir is a URL"):
        load_train_config(None, ["checkpoint.async=process", "output_dir=s3://bucket/run"])
    assert any(row.key == "checkpoint.async" for row in field_reference())


def test_every_example_yaml_starts_with_its_command_and_is_valid(tmp_path, monkeypatch) -> None:
    # Training examples (bridge-only YAMLs for `fsdp-bridge explain` are checked elsewhere).
    yamls = [p for p in sorted(EXAMPLES.glob("*.yaml")) if "\nmodel:" in p.read_text()] + [default_config_path()]
    assert len(yamls) >= 5
    for path in yamls:
        first = path.read_text().splitlines()[0]
        assert re.match(r"# (fsdp-bridge train|sbatch)( |$)", first), (path, first)
        load_train_config(path)
    # The example copy of the built-in job is the built-in job.
    builtin = load_train_config(None)
    assert dataclasses.replace(load_train_config(EXAMPLES / "tiny_cpu.yaml"), output_dir=builtin.output_dir) == builtin
    # The first line is a command that runs: check it (and its ranks' mesh) with --dry-run, in a copy of the
    # examples and not in the checkout, where the quickstart's run may have left checkpoints in runs/tiny-cpu.
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    for path in (EXAMPLES / "ab_fsdp1_fsdp2.yaml", EXAMPLES / "tiny_cpu.yaml"):
        argv = shlex.split(path.read_text().splitlines()[0][2:])[1:]
        assert main([*argv, "--dry-run"]) == 0


def test_slurm_and_torchrun_commands_of_the_hsdp_example_are_valid(tmp_path, monkeypatch, capsys) -> None:
    script = (EXAMPLES / "hsdp_2x8.sbatch").read_text()
    assert re.search(r"#SBATCH --nodes=2\b", script) and re.search(r"#SBATCH --gpus-per-node=8\b", script)
    # The data and tokenizer the example names, so that the file checks pass here.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data/train").mkdir(parents=True)
    (tmp_path / "data/train/part0.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "tokenizers/llama").mkdir(parents=True)
    env = {"SLURM_JOB_ID": "42", "HEAD_NODE": "node001"}
    srun = next(line for line in script.splitlines() if line.startswith("srun fsdp-bridge train"))
    argv = [
        a.replace("$SLURM_JOB_ID", env["SLURM_JOB_ID"]).replace("$HEAD_NODE", env["HEAD_NODE"])
        for a in shlex.split(srun)[2:]
    ]
    argv = [str(EXAMPLES / "hsdp_2x8.yaml") if a == "examples/hsdp_2x8.yaml" else a for a in argv]
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# ok: 16 ranks" in out and "mesh (2, 8) (replicate, shard)" in out
    torchrun = next(line for line in script.splitlines() if line.startswith("# srun torchrun"))
    parts = shlex.split(torchrun[2:])
    assert parts[parts.index("--nnodes") + 1] == "2" and parts[parts.index("--nproc-per-node") + 1] == "8"
    assert parts[parts.index("-m") + 1 :][:2] == ["fsdp_bridge", "train"]
    # Inside torchrun each process is one rank: the same config is valid at world 16, 8 per node.
    config = load_train_config(EXAMPLES / "hsdp_2x8.yaml")
    assert preflight(config, world_size=16, local_world_size=8, device_type="cuda") == [
        "mesh (2, 8) (replicate, shard) for 16 ranks"
    ]
    with pytest.raises(ConfigError, match=r"hybrid_shape: got \[2, 8\]; allowed: two integers whose product"):
        preflight(config, world_size=8, local_world_size=8)


def test_existing_launch_is_detected_from_torchrun_or_srun_variables() -> None:
    assert existing_launch({"RANK": "0", "WORLD_SIZE": "2"})
    assert existing_launch({"SLURM_PROCID": "3", "SLURM_NTASKS": "16"})
    assert not existing_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert not existing_launch({})


def test_docs_list_every_config_field() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = {m.group(1) for m in re.finditer(r"^\| `([a-z0-9_.]+)` \|", text, re.M)}  # float8: digits too
    missing = [f.key for f in field_reference() if f.key not in rows]
    assert not missing, f"docs/configuration.md lacks {missing}: run python -m fsdp_bridge.docgen"
    assert all(f.doc for f in field_reference()), "every config field needs a docstring"
    assert (ROOT / "docs" / "quickstart.md").is_file()


def test_learning_rate_schedule() -> None:
    config = load_train_config(
        None, ["optim.lr=1.0", "schedule.warmup_steps=4", "max_steps=14", "schedule.min_lr_ratio=0.1"]
    )
    lrs = [lr_at(config, s) for s in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and math.isclose(lrs[-1], 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.9)))
    assert all(a >= b for a, b in itertools.pairwise(lrs[3:]))
    linear = load_train_config(
        None,
        [
            "optim.lr=1.0",
            "schedule.decay=linear",
            "max_steps=10",
            "schedule.warmup_steps=0",
            "schedule.min_lr_ratio=0.0",
        ],
    )
    assert [lr_at(linear, s) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]


class _Tok:
    eos_token_id = 0

    def __call__(self, docs: list[str], **_: object) -> dict[str, list[list[int]]]:
        return {"input_ids": [[ord(c) for c in d] for d in docs]}


def test_data_is_packed_split_and_sharded_without_overlap() -> None:
    from fsdp_bridge.train import DataConfig

    # 202 distinct tokens with the two EOS: every packed sequence is different.
    docs = ["".join(chr(200 + i) for i in range(100)), "".join(chr(400 + i) for i in range(100))]
    cfg = DataConfig(seq_len=10, eval_sequences=5)
    ranks = [PackedData.build(docs, _Tok(), cfg, seed=3, rank=r, world_size=2) for r in range(2)]
    assert ranks[0].train.shape == (15, 10) and ranks[0].held_out.shape == (5, 10)  # at any world size
    assert int(ranks[0].train[0, 0]) == 200 and int(ranks[0].train.view(-1)[100]) == 0  # EOS between docs
    # One epoch = 15 samples: 2 steps of 2 ranks x 4 cover every training sequence, the 16th starts epoch 2.
    seen = [ranks[r].micro_batch(pos, 4) for pos in (0, 8) for r in range(2)]
    rows = {tuple(row.tolist()) for batch in seen for row in batch}
    assert len(rows) == 15
    # The order is a function of the position only (what resume relies on), and changes by epoch.
    again = PackedData.build(docs, _Tok(), cfg, seed=3, rank=1, world_size=2)
    assert bool((again.micro_batch(8, 4) == ranks[1].micro_batch(8, 4)).all())
    assert not bool((ranks[0].micro_batch(16, 4) == ranks[0].micro_batch(0, 4)).all())
    # 5 held-out rows on 2 ranks: 3 and 2, rank 1's batch padded with a row that does not count.
    evals = [r.eval_batches(3) for r in ranks]
    assert [(len(b), counted) for b, counted in evals[0]] == [(3, 3)]
    assert [(len(b), counted) for b, counted in evals[1]] == [(3, 2)]
    with pytest.raises(ConfigError, match=r"data\.seq_len: got 500; allowed: a length that leaves training"):
        PackedData.build(docs, _Tok(), DataConfig(seq_len=500, eval_sequences=0), seed=0, rank=0, world_size=2)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.config.model_type=lama"], r"model\.config\.model_type: got 'lama'.*did you mean 'llama'"),
        (
            ["model.config.hidden_size=100", "model.config.num_attention_heads=3"],
            r"model\.config: got 'llama'.*not a multiple of the number of attention heads",
        ),
        (
            ["model.config.model_type=gpt2", "model.config.hidden_size=100", "model.config.num_attention_heads=3"],
            r"model\.config: got 'gpt2'.*divisible by num_heads",
        ),
        (
            ["model.config.model_type=gpt2", "model.config.max_position_embeddings=64"],
            r"data\.seq_len: got 128; allowed: at most 64 \(the size of transformer\.wpe",
        ),
        (["optim.lr=.nan"], r"optim\.lr: got nan; allowed: a finite number > 0"),
        (["optim.lr=.inf"], r"optim\.lr: got inf; allowed: a finite number > 0"),
        (["optim.weight_decay=-0.1"], r"optim\.weight_decay: got -0\.1"),
        (["optim.eps=-1"], r"optim\.eps: got -1\.0"),
        (["optim.grad_clip=.nan"], r"optim\.grad_clip: got nan"),
        (["timeout_s=.inf"], r"timeout_s: got inf; allowed: a number of seconds in \(0, 604800"),
        (["seed=100000000000000000000000000000"], r"seed: got 10+; allowed: an integer in \[0, 4294967295\]"),
        # The YAML file's bounds hold for overrides too (Python's int() would refuse 5000 digits with a traceback).
        (
            ["max_steps=" + "9" * 5000],
            r"max_steps: got '9{40}\.\.\.'; allowed: a YAML value .*an integer of 5000 digits",
        ),
        (["data.files=" + "[" * 5000], r"data\.files: got '\[{40}\.\.\.'; .*nested more than 64 levels deep"),
        (["micro_batch_size=100000000000"], r"micro_batch_size: got 100000000000; allowed: micro_batch_size \* "),
        (["model.tokenizer_vocab_size=1000000000"], r"model\.tokenizer_vocab_size: got 1000000000"),
        (["resume=/nonexistent/ckpt"], r"resume: got '/nonexistent/ckpt'; allowed: .*existing checkpoint"),
    ],
)
def test_preflight_catches_mistakes_before_any_rank_starts(tmp_path, no_launch, capsys, overrides, expected) -> None:
    assert main(["train", "--dry-run", f"output_dir={tmp_path}/out", *overrides]) == 2
    assert re.search(expected, capsys.readouterr().err)
    assert no_launch == []


def test_preflight_reads_jsonl_keys_launch_flags_and_points_to_moved_keys(tmp_path, no_launch, capsys) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "one"}\n{"content": "two"}\n')
    assert main(["train", "--dry-run", f"output_dir={tmp_path}/out", f"data.files=[{data}]"]) == 2
    err = capsys.readouterr().err
    assert "data.text_key: got 'text'" in err and "line 2 has no string 'text' (its keys: ['content'])" in err
    assert main(["train", "--dry-run", f"output_dir={tmp_path}/out", "--nnodes", "0"]) == 2
    assert "--nnodes: got 0; allowed: an integer >= 1" in capsys.readouterr().err
    with pytest.raises(ConfigError) as info:
        load_train_config(
            _write(tmp_path, "model: {config: {model_type: llama}}\nlr: 1.0e-3\noptim: {learning_rate: 1.0e-3}\n")
        )
    assert "lr: got 0.001" in str(info.value) and str(info.value).count("did you mean 'optim.lr'?") == 2
    # The built-in job passes, with the mesh in the notes; a model the meta device cannot run is a note, not an error.
    assert main(["train", "--dry-run", f"output_dir={tmp_path}/out"]) == 0
    assert "# ok: 2 ranks" in capsys.readouterr().out
    assert no_launch == []


def test_warmup_longer_than_the_run_is_warned_about(caplog) -> None:
    with caplog.at_level("WARNING", logger="fsdp_bridge.train"):
        load_train_config(None, ["max_steps=5", "schedule.warmup_steps=10"])
    assert "schedule.warmup_steps (10) > max_steps (5)" in caplog.text


def test_training_defaults_are_the_fast_ones() -> None:
    from fsdp_bridge.train import ModelConfig

    assert ModelConfig().attn_implementation == "sdpa"


def test_adamw_takes_the_fastest_kernel_torch_has_for_the_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    import fsdp_bridge.train._loop as loop

    cpu = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3, dtype=torch.bfloat16))]
    assert loop.adamw_kernel(cpu) == {"fused": True}  # torch has fused AdamW on CPU (checked on 2.13 with DTensors)
    meta = [nn.Parameter(torch.ones(2, device="meta"))]
    assert loop.adamw_kernel(meta) == {}  # neither kernel: torch's default
    assert loop.adamw_kernel([]) == {}

    class Shard(torch.Tensor):  # stands for DTensor: FSDP2's shards beside plain ignored parameters
        pass

    monkeypatch.setattr(loop, "DTensor", Shard)
    mixed = [cpu[0], torch.ones(2).as_subclass(Shard)]
    assert loop.adamw_kernel(mixed) == {"foreach": False}  # both kernels refuse the mix
    assert loop.adamw_kernel(mixed[1:]) == {"fused": True}
