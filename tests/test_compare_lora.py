"""`fsdp-bridge compare` with a `peft:` section: a LoRA run A/B'd on FSDP1 vs FSDP2 (and the reference)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_bridge import ConfigError
from fsdp_bridge.compare import CompareJob

pytest.importorskip("peft")

JOB: dict[str, Any] = {
    "model": {"family": "llama"},
    "data": {"seq_len": 16},
    "optim": {"lr": 1.0e-2},
    "micro_batch_size": 2,
    "max_steps": 4,
    "seed": 0,
    "compare": {"strategies": ["full_shard"], "backends": ["fsdp1", "fsdp2"], "reference": True},
    "bridge": {"mixed_precision": "fp32", "device": "cpu"},
    "peft": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
}


def _lora_job(data: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from fsdp_bridge.compare import run_job

    job = CompareJob.from_dict(data)
    model = job.build_model()
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    report = run_job(job)
    losses = {run.name: [s.loss for s in run.steps] for run in report.runs}
    return {"rank": dist.get_rank(), "ok": report.ok, "losses": losses, "trainable": trainable}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks on 2 cores: slow
def test_lora_job_gives_equal_losses_on_both_backends(run_on_ranks, world: int) -> None:
    """2 ranks: FULL_SHARD; 4 ranks: FULL_SHARD and HYBRID_SHARD on a (2, 2) mesh. Every run equals
    the unsharded PEFT reference with averaged gradients (fp32 tolerance)."""
    job = dict(JOB)
    if world == 4:
        job["compare"] = {**JOB["compare"], "strategies": ["full_shard", "hybrid_shard"]}
        job["bridge"] = {**JOB["bridge"], "hybrid_shape": [2, 2]}
    result = run_on_ranks(_lora_job, world, job)[0]
    assert result["trainable"] and all("lora_" in n for n in result["trainable"]), result["trainable"]
    losses = result["losses"]
    strategies = job["compare"]["strategies"]
    assert set(losses) == {"reference"} | {f"{b}/{s}" for b in ("fsdp1", "fsdp2") for s in strategies}, losses
    for s in strategies:
        torch.testing.assert_close(losses[f"fsdp1/{s}"], losses[f"fsdp2/{s}"], rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(losses[f"fsdp2/{s}"], losses["reference"], rtol=1.3e-6, atol=1e-5)
    assert result["ok"]


def test_lora_job_errors_name_key_value_and_fix() -> None:
    with pytest.raises(ConfigError) as err:
        CompareJob.from_dict({**JOB, "peft": {"r": 0, "rank": 4, "dropout": 2.0}})
    text = str(err.value)
    assert "peft.r: got 0; allowed: an integer >= 1" in text and "peft.rank" in text, text
    assert "peft.dropout: got 2.0; allowed: a number in [0, 1)" in text, text
    with pytest.raises(
        ConfigError,
        match=r"peft.target_modules: got \['qproj'\]; allowed: names of modules in "
        r"LlamaForCausalLM",
    ):
        CompareJob.from_dict({**JOB, "peft": {"target_modules": ["qproj"]}})
    with pytest.raises(ConfigError, match=r"peft: got 3; allowed: a mapping of r, alpha"):
        CompareJob.from_dict({**JOB, "peft": 3})
    assert CompareJob.from_dict({**JOB, "peft": None}).peft is None
