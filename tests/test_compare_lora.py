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


def test_lora_job_gives_equal_losses_on_both_backends(run_on_ranks) -> None:
    result = run_on_ranks(_lora_job, 2, JOB)[0]
    assert result["trainable"] and all("lora_" in n for n in result["trainable"]), result["trainable"]
    losses = result["losses"]
    assert set(losses) == {"reference", "fsdp1/full_shard", "fsdp2/full_shard"}, losses
    torch.testing.assert_close(losses["fsdp1/full_shard"], losses["fsdp2/full_shard"], rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(losses["fsdp2/full_shard"], losses["reference"], rtol=1.3e-6, atol=1e-5)
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
