"""NO_SHARD on FSDP2: the bridge's (world, 1) mesh against torch's FSDP2-based ``replicate()``,
with FSDP1's NO_SHARD as the yardstick (issue: FSDP2 NO_SHARD peaked above FSDP1).

On a shard group of one, FSDP2 still copies each unit's parameters into separate all-gather
outputs when it runs it; the bridge reshards every NO_SHARD unit after forward so that only
the units in use hold that copy.  ``replicate()`` cannot: it is built without a post-forward
mesh, and its ``set_reshard_after_forward`` raises (torch 2.13).

    OMP_NUM_THREADS=1 python benchmarks/no_shard.py                          # 2 gloo ranks, the 'medium' Llama
    OMP_NUM_THREADS=1 python benchmarks/no_shard.py --mixed-precision bf16   # bf16 parameters, fp32 reduce

Per way: the peak of live tensor bytes of one training step on a rank (parameters, gradients and
optimizer state held, plus what the step allocates; ``LiveBytes``), the median step time, and the
losses of the first steps (the three ways must agree).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import run as suite

import fsdp_bridge
from fsdp_bridge.testing import run_distributed

WAYS = ("fsdp1-no_shard", "fsdp2-no_shard (world, 1) mesh", "fsdp2 replicate()")


def _build(way: str, size: str, mixed_precision: str | None) -> torch.nn.Module:
    model = suite.build_model(size)
    for backend in ("fsdp1", "fsdp2"):
        if way.startswith(backend) and "replicate" not in way:
            config = fsdp_bridge.BridgeConfig(
                backend=backend, strategy="no_shard", device="cpu", mixed_precision=mixed_precision
            )
            return fsdp_bridge.shard(model, config)
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("replicate",))
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if mixed_precision else None,
        reduce_dtype=torch.float32 if mixed_precision else None,
    )
    for layer in model.model.layers:
        replicate(layer, mesh=mesh, mp_policy=policy)
    replicate(model, mesh=mesh, mp_policy=policy)
    return model


def job(size: str, steps: int, mixed_precision: str | None) -> dict[str, Any]:
    batch = suite._batch(size)
    out: dict[str, Any] = {}
    for way in WAYS:
        model = _build(way, size, mixed_precision)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        peak = suite._peak_step({"model": model, "opt": opt}, batch)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            suite._step(model, opt, batch)
            times.append(time.perf_counter() - t0)
        out[way] = {"peak_bytes": peak, "step_s": statistics.median(times), "losses": losses}
        del model, opt
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixed-precision", choices=["bf16"], default=None, help="bridge spelling; fp32 if omitted")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per way (the median is printed)")
    args = parser.parse_args()
    suite._quiet_transformers()
    results = run_distributed(job, 2, args=("medium", args.steps, args.mixed_precision), timeout_s=900)
    base = results[0][WAYS[0]]["peak_bytes"]
    print(f"{'way':32s} {'peak MiB (rank 0)':>18s} {'vs fsdp1':>9s} {'step ms':>8s}  losses")
    for way in WAYS:
        r = results[0][way]
        print(
            f"{way:32s} {r['peak_bytes'] / 2**20:18.2f} {r['peak_bytes'] / base:9.3f} {r['step_s'] * 1e3:8.1f}  "
            + " ".join(f"{x:.6f}" for x in r["losses"])
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
