"""CUDA tests (world size 1, NCCL): skipped cleanly on machines without a GPU."""

from __future__ import annotations

import pytest
import torch

import fsdp_bridge
from fsdp_bridge import BridgeConfig
from fsdp_bridge.testing import run_distributed
from fsdp_bridge.testing.models import build_tiny, sample_batch

pytestmark = pytest.mark.cuda


def _cuda_train(backend: str, mixed_precision: str, cpu_offload: bool, ac: bool) -> list[float]:
    config = BridgeConfig(
        backend=backend,
        mixed_precision=mixed_precision,
        cpu_offload=cpu_offload,
        activation_checkpointing=ac,
        device="cuda",
    )
    model = fsdp_bridge.shard(build_tiny("llama", seed=0), config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = {k: v.cuda() for k, v in sample_batch().items()}
    losses = []
    for _ in range(4):
        loss = model(**batch).loss
        loss.backward()
        fsdp_bridge.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize(("mixed_precision", "cpu_offload", "ac"), [("fp32", False, False), ("bf16", True, True)])
def test_cuda_trains(backend: str, mixed_precision: str, cpu_offload: bool, ac: bool) -> None:
    (losses,) = run_distributed(_cuda_train, 1, args=(backend, mixed_precision, cpu_offload, ac), backend="nccl")
    assert losses[-1] < losses[0]
