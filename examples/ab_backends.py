"""A plain PyTorch training loop on fsdp_bridge, run through both backends.

    torchrun --nproc-per-node 2 examples/ab_backends.py

Trains a tiny Llama (built from a config, no download) for a few steps with FSDP1 and
then FSDP2, from the same weights and the same batches, and prints the losses side by
side.  On CPU the ranks talk over gloo; with GPUs (one per rank) over NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import fsdp_bridge
from fsdp_bridge.testing.models import build_tiny, sample_batch


def train(backend: str, steps: int = 5, accumulation: int = 2) -> list[float]:
    config = fsdp_bridge.BridgeConfig(strategy="full_shard", backend=backend)
    model = fsdp_bridge.shard(build_tiny("llama", seed=0), config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    device = fsdp_bridge.get_bridge(model).device
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accumulation):
            batch = {k: v.to(device) for k, v in sample_batch(seed=100 * step + 10 * micro + dist.get_rank()).items()}
            last = micro == accumulation - 1
            # Accumulate without communication, synchronise on the last micro-batch.
            with fsdp_bridge.no_sync(model) if not last else torch.enable_grad():
                loss = model(**batch).loss / accumulation
                loss.backward()
            total += loss.item()
        fsdp_bridge.clip_grad_norm_(model, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def main() -> None:
    results = {backend: train(backend) for backend in ("fsdp1", "fsdp2")}
    if dist.get_rank() == 0:
        print(f"{'step':>4}  {'FSDP1 loss':>12}  {'FSDP2 loss':>12}  {'difference':>10}")
        for step, (a, b) in enumerate(zip(results["fsdp1"], results["fsdp2"], strict=True)):
            print(f"{step:>4}  {a:>12.6f}  {b:>12.6f}  {abs(a - b):>10.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
