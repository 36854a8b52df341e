"""`fsdp-bridge compare`: parity across every strategy, a planted divergence, job validation, report files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from fsdp_bridge import BridgeConfig, ConfigError
from fsdp_bridge.cli import main
from fsdp_bridge.compare import (
    CompareJob,
    PairVerdict,
    ParityReport,
    RunResult,
    StepDiff,
    StepRecord,
    backend_differences,
    tolerance_for,
    write_report,
)
from fsdp_bridge.testing import assert_backend_parity, rank_batches
from fsdp_bridge.testing.models import build_tiny

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "compare" / "tiny_llama.yaml"


ALL_STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"]


@pytest.mark.parametrize(
    "strategies",
    [
        # one that reshards after forward and a 2D-mesh one that keeps parameters: the suite's sibling
        "full_shard,hybrid_shard_zero2",
        pytest.param("all", marks=pytest.mark.slow),  # 11 runs of 4 ranks on 2 cores
    ],
)
def test_compare_strategies_both_backends_and_reference_fp32(tmp_path, capsys, strategies):
    out = tmp_path / "report"
    rc = main(
        [
            "compare",
            str(EXAMPLE),
            "--strategies",
            strategies,
            "--reference",
            "--nproc-per-node",
            "4",
            "--steps",
            "2",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] is True and report["world_size"] == 4
    chosen = ALL_STRATEGIES if strategies == "all" else strategies.split(",")
    names = {r["name"] for r in report["runs"]}
    assert names == {"reference"} | {f"{b}/{s}" for s in chosen for b in ("fsdp1", "fsdp2")}
    assert len(report["pairs"]) == 3 * len(chosen)  # each run vs the reference, fsdp2 vs fsdp1 per strategy
    for pair in report["pairs"]:
        assert pair["ok"] and pair["first_divergent_step"] is None
        assert pair["tolerance"]["name"] == "fp32"
        assert pair["max_param_diff"] is not None and pair["max_param_diff"] <= 1e-5
    for run in report["runs"]:
        assert len(run["steps"]) == 2
        assert all(b is not None and b > 0 for b in run["peak_memory_bytes"])
        assert run["memory_kind"].startswith("peak RSS")
    ref_bytes = next(r for r in report["runs"] if r["name"] == "reference")["sharded_bytes"][0]
    full = next(r for r in report["runs"] if r["name"] == "fsdp2/full_shard")["sharded_bytes"]
    assert len(full) == 4 and sum(full) == ref_bytes  # FULL_SHARD holds 1/4 per rank (no padding in FSDP2)
    assert "PARITY" in printed and "PARITY FAILED" not in printed
    md = (out / "report.md").read_text()
    assert "fsdp-bridge compare" in md and f"--strategies {strategies}" in md and "### Verdicts" in md
    assert "gradient averaging" in md  # the backend differences are explained


def test_planted_divergence_is_detected_and_named(tmp_path, capsys):
    out = tmp_path / "report"
    rc = main(
        [
            "compare",
            str(EXAMPLE),
            "--strategies",
            "full_shard",
            "--steps",
            "2",
            "--override",
            "fsdp2.lr=2e-3",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 1
    report = json.loads((out / "report.json").read_text())
    (pair,) = report["pairs"]
    assert (pair["a"], pair["b"], pair["ok"], pair["first_divergent_step"]) == (
        "fsdp2/full_shard",
        "fsdp1/full_shard",
        False,
        1,
    )
    assert [r["lr"] for r in report["runs"]] == [1e-3, 2e-3]
    assert "fsdp2/full_shard vs fsdp1/full_shard: DIVERGED at step 1" in printed
    assert printed.rstrip().splitlines()[-3] == "PARITY FAILED"


class _ScaleOneRunsSecondStep:
    """A loss that is 1.5x on the 8th call: runs go reference, fsdp1, fsdp2 (3 steps each), so
    fsdp2's second step is planted and every earlier step of every run is untouched."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, model, batch):
        self.calls += 1
        loss = model(**batch).loss
        return loss * 1.5 if self.calls == 8 else loss


def _planted_in_process() -> str:
    try:
        assert_backend_parity(
            lambda: build_tiny("llama", seed=0),
            rank_batches("llama", steps=3),
            BridgeConfig(strategy="shard_grad_op", device="cpu"),
            loss_fn=_ScaleOneRunsSecondStep(),
        )
    except AssertionError as err:
        return str(err)
    return "no AssertionError"


def test_assert_backend_parity_names_first_diverging_step(run_on_ranks):
    message = run_on_ranks(_planted_in_process, 2)[0]
    headline = message.splitlines()[0]  # the failing pairs only, then the full report
    assert headline.startswith("backend parity failed: ") and "fsdp1/shard_grad_op vs reference" not in headline
    assert "fsdp2/shard_grad_op vs reference: DIVERGED at step 2" in headline
    assert "fsdp2/shard_grad_op vs fsdp1/shard_grad_op: DIVERGED at step 2" in headline
    assert "fsdp1/shard_grad_op vs reference: PARITY" in message and "PARITY FAILED" in message


# -- the job file -------------------------------------------------------------------------


def _job(**changes):
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(changes)
    return data


def test_job_runs_from_example():
    job = CompareJob.from_dict(_job())
    specs = job.run_specs()
    assert [s.name for s in specs] == [
        "fsdp1/full_shard",
        "fsdp2/full_shard",
        "fsdp1/shard_grad_op",
        "fsdp2/shard_grad_op",
        "fsdp1/no_shard",
        "fsdp2/no_shard",
    ]
    assert all(s.config is not None and s.config.hybrid_shape is None for s in specs)
    hybrid = CompareJob.from_dict(_job(compare={"strategies": ["hybrid_shard"], "reference": True}))
    assert [s.name for s in hybrid.run_specs()] == ["reference", "fsdp1/hybrid_shard", "fsdp2/hybrid_shard"]
    assert hybrid.run_specs()[1].config.hybrid_shape == (2, 2)
    # Every rank gets different batches, the same in every run.
    assert not (job.batches(0)[0]["input_ids"] == job.batches(1)[0]["input_ids"]).all()
    assert (job.batches(1)[1]["input_ids"] == job.batches(1)[1]["input_ids"]).all()


def test_job_errors_name_key_value_and_fix():
    with pytest.raises(ConfigError, match=r"optimm: .*unknown key; did you mean 'optim'"):
        CompareJob.from_dict(_job(optimm={"lr": 1}))
    with pytest.raises(ConfigError, match=r"compare\.strategies: got 'zero3'; allowed: full_shard"):
        CompareJob.from_dict(_job(compare={"strategies": ["zero3"]}))
    with pytest.raises(ConfigError, match=r"compare\.overrides\.fsdp3: .*a run name: fsdp1, fsdp2, reference"):
        CompareJob.from_dict(_job(compare={"overrides": {"fsdp3": {"lr": 1}}}))
    with pytest.raises(ConfigError, match=r"compare\.overrides\.reference\.mixed_precision: .*known keys are lr"):
        CompareJob.from_dict(_job(compare={"overrides": {"reference": {"mixed_precision": "bf16"}}}))
    with pytest.raises(ConfigError, match=r"fsdp1/full_shard: bridge\.backward_prefetch: got 'sideways'"):
        CompareJob.from_dict(_job(bridge={"backward_prefetch": "sideways"}))
    with pytest.raises(ConfigError, match=r"model\.family: got 'llama9'.*a transformers model_type.*did you mean"):
        CompareJob.from_dict(_job(model={"family": "llama9"}))
    with pytest.raises(ConfigError, match=r"at least two runs to compare.*set reference: true"):
        CompareJob.from_dict(_job(compare={"backends": ["fsdp2"], "strategies": ["full_shard"]}))
    with pytest.raises(ConfigError) as info:  # every problem at once
        CompareJob.from_dict(_job(max_steps=0, data={"seq_len": "long"}))
    assert {p.key for p in info.value.problems} == {"max_steps", "data.seq_len"}


def test_cli_rejects_bad_job_before_spawning(tmp_path, capsys):
    bad = tmp_path / "job.yaml"
    bad.write_text(yaml.safe_dump(_job(compare={"nproc_per_node": 0})))
    assert main(["compare", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "compare.nproc_per_node: got 0; allowed: an integer >= 1" in capsys.readouterr().err
    assert main(["compare", str(EXAMPLE), "--override", "fsdp2lr=1", "--out", str(tmp_path / "o")]) == 2
    assert "--override: got 'fsdp2lr=1'; allowed: RUN.KEY=VALUE" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# -- report pieces --------------------------------------------------------------------------


def _tiny_report(ok: bool) -> ParityReport:
    def run(name: str, losses: list[float]) -> RunResult:
        steps = [StepRecord(step=i + 1, loss=v, grad_norm=1.0, time_s=0.01) for i, v in enumerate(losses)]
        return RunResult(
            name=name,
            backend=name.split("/")[0],
            strategy="full_shard",
            config=None,
            lr=1e-3,
            steps=steps,
            setup_time_s=0.1,
            peak_memory_bytes=[2**20, 2**20],
            memory_kind="peak RSS",
            sharded_bytes=[100, 100],
        )

    tol = tolerance_for(BridgeConfig().mixed_precision)
    diffs = [
        StepDiff(step=1, loss_diff=0.0, grad_norm_diff=0.0, max_param_diff=0.0, ok=True),
        StepDiff(step=2, loss_diff=0.5, grad_norm_diff=0.0, max_param_diff=1e-3, ok=ok),
    ]
    pair = PairVerdict(
        a="fsdp2/full_shard", b="fsdp1/full_shard", tolerance=tol, steps=diffs, first_divergent_step=None if ok else 2
    )
    return ParityReport(
        runs=[run("fsdp1/full_shard", [4.0, 3.5]), run("fsdp2/full_shard", [4.0, 4.0])],
        pairs=[pair],
        world_size=2,
        device="cpu",
    )


def test_report_files_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    paths = write_report(_tiny_report(ok=False), tmp_path, command="fsdp-bridge compare job.yaml")
    assert paths["png"] is None and not (tmp_path / "report.png").exists()
    data = json.loads(paths["json"].read_text())
    assert data["ok"] is False and data["pairs"][0]["first_divergent_step"] == 2
    md = paths["md"].read_text()
    assert "fsdp2/full_shard vs fsdp1/full_shard: DIVERGED at step 2" in md and "report.png" not in md


def test_report_png_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_report(_tiny_report(ok=True), tmp_path)
    assert paths["png"] is not None and paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![loss and differences per step](report.png)" in paths["md"].read_text()


def test_differences_name_the_settings_that_change_numbers():
    fp32 = {d.setting.split(" =")[0] for d in backend_differences(BridgeConfig(), device_type="cpu")}
    assert {"strategy", "backward_prefetch", "gradient averaging"} <= fp32
    assert "mixed_precision" not in fp32  # nothing is cast in fp32, so nothing differs
    assert not fp32 & {"cpu_offload", "sync_module_states", "reshard_after_forward"}  # unset: the same on both
    offload = backend_differences(BridgeConfig(cpu_offload=True), device_type="cuda")
    assert any(d.setting == "cpu_offload = True" for d in offload)
    bf16 = backend_differences(BridgeConfig(mixed_precision="bf16"), device_type="cpu")
    assert any(d.setting.startswith("mixed_precision") for d in bf16)
    assert not any(d.setting == "gradient averaging" for d in backend_differences(BridgeConfig(), world_size=1))


# -- "my model": a Hugging Face directory, any model_type, a Python builder ------------------

_BUILDER_MODULE = """
import torch
from torch import nn


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x, y):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return {"loss": nn.functional.mse_loss(self.head(x).squeeze(-1), y)}


def build():
    return Regressor()


def batch(size, seq_len, seed):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(size, 8, generator=g), "y": torch.randn(size, generator=g)}
"""


def _my_model_jobs(tmp_path: Path) -> dict[str, dict]:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir = tmp_path / "phi3"
    config = AutoConfig.for_model(
        "phi3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(hf_dir)
    (tmp_path / "my_models.py").write_text(_BUILDER_MODULE)
    common = {"data": {"seq_len": 8}, "max_steps": 2, "compare": {"reference": True, "strategies": ["full_shard"]}}
    return {
        "path": {**common, "model": {"path": str(hf_dir)}},
        "model_type": {
            **common,
            "model": {
                "config": {
                    "model_type": "gpt_neox",
                    "vocab_size": 64,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "max_position_embeddings": 64,
                }
            },
        },
        "builder": {
            **common,
            "model": {"builder": "my_models:build", "batch": "my_models:batch"},
            "bridge": {"wrap": {"min_num_params": 50}},
        },
    }


def _run_my_model_jobs(jobs: dict[str, dict]) -> dict[str, tuple[bool, list[str]]]:
    from fsdp_bridge.compare import run_job

    out = {}
    for name, data in jobs.items():
        report = run_job(CompareJob.from_dict(data, allow_builder=True))
        out[name] = (report.ok, [run.name for run in report.runs])
    return out


def test_compare_my_model_from_a_directory_a_model_type_and_a_builder(tmp_path, monkeypatch, run_on_ranks):
    monkeypatch.syspath_prepend(str(tmp_path))
    jobs = _my_model_jobs(tmp_path)
    result = run_on_ranks(_run_my_model_jobs, 2, jobs)[0]
    for name in jobs:
        ok, runs = result[name]
        assert ok, name
        assert runs == ["reference", "fsdp1/full_shard", "fsdp2/full_shard"], name


def test_a_builder_imports_code_only_when_allowed(tmp_path, monkeypatch, capsys):
    """model.builder / model.batch name code to import and call: refused unless the caller opts in,
    before anything is imported (the module would record its import in a file)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "planted.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').close()\ndef build():\n    raise SystemExit('called')\n"
    )
    data = {"model": {"builder": "planted:build", "batch": "planted:build"}, "compare": {"reference": True}}
    with pytest.raises(ConfigError, match=r"model\.builder: got 'planted:build'.*--allow-builder"):
        CompareJob.from_dict(data)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    assert main(["compare", str(job)]) == 2
    assert "model.batch: got 'planted:build'" in capsys.readouterr().err
    assert not (tmp_path / "imported").exists()
    assert CompareJob.from_dict(data, allow_builder=True).builder == "planted:build"  # allowed: imported
    assert (tmp_path / "imported").exists()


def test_my_model_mistakes_are_named_before_spawning(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    jobs = _my_model_jobs(tmp_path)
    job = CompareJob.from_dict(jobs["path"])
    assert job.batches(0)[0]["input_ids"].max() < 64  # tokens from the directory's vocabulary
    with pytest.raises(ConfigError, match=r"model\.path: got '.*nowhere'; allowed: a Hugging Face model directory"):
        CompareJob.from_dict({**jobs["path"], "model": {"path": str(tmp_path / "nowhere")}})
    with pytest.raises(ConfigError, match=r"model\.builder: got 'my_models:missing'.*has no attribute 'missing'"):
        CompareJob.from_dict({**jobs["builder"], "model": {"builder": "my_models:missing"}}, allow_builder=True)
    with pytest.raises(ConfigError, match=r"model\.builder: got 'not a spec'; allowed: module:function"):
        CompareJob.from_dict({**jobs["builder"], "model": {"builder": "not a spec"}}, allow_builder=True)
    with pytest.raises(ConfigError, match=r"model\.config: got .*gpt_neox.*a valid transformers gpt_neox config"):
        CompareJob.from_dict(
            {
                **jobs["model_type"],
                "model": {"config": {"model_type": "gpt_neox", "hidden_size": 30, "num_attention_heads": 4}},
            }
        )
    with pytest.raises(ConfigError, match=r"model: got .*; allowed: one of model\.family \(\+ config\), model\.path"):
        CompareJob.from_dict({**jobs["path"], "model": {"path": jobs["path"]["model"]["path"], "family": "llama"}})
