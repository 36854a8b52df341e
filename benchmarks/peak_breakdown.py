"""What is alive at the peak of one training step, per allocation site, on each backend.

    OMP_NUM_THREADS=1 python benchmarks/peak_breakdown.py --strategy no_shard
    OMP_NUM_THREADS=1 python benchmarks/peak_breakdown.py --strategy full_shard --mixed-precision bf16 --top 20

Gloo ranks on CPU, the benchmark suite's Llama (``--size``), AdamW. Each backend takes two steps
(optimizer state and FSDP's lazily made buffers exist after them), then one step under
``LiveBytes("cpu", sites=True)``. Printed for rank 0: the bytes held across steps (parameters,
buffers, optimizer state), the step's peak on top of them, and the storages alive at that peak
grouped by the operator and the Python line that allocated them (``storage.resize_`` is FSDP
allocating a freed buffer again). Gradients and activations are listed by the line that made
them; a line in torch's autograd engine is a backward operator.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import run as suite

import fsdp_bridge
from fsdp_bridge.estimate import LiveBytes, storage_bytes
from fsdp_bridge.testing import run_distributed

MiB = 2**20


def job(backends: list[str], strategy: str, size: str, mixed_precision: str | None, top: int) -> dict[str, Any]:
    batch = suite._batch(size)
    out: dict[str, Any] = {}
    for backend in backends:
        config = fsdp_bridge.BridgeConfig(
            backend=backend, strategy=strategy, device="cpu", mixed_precision=mixed_precision
        )
        model = fsdp_bridge.shard(suite.build_model(size), config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            suite._step(model, opt, batch)
        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        held = [*model.parameters(), *model.buffers(), *state]
        with LiveBytes("cpu", ignore=held, sites=True) as live:
            suite._step(model, opt, batch)
        out[backend] = {
            "held": storage_bytes(held),
            "peak": live.peak,
            "sites": list(live.peak_sites.items())[:top],
            "rest": sum(list(live.peak_sites.values())[top:]),
        }
        del model, opt
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="no_shard", help="a bridge strategy (default no_shard)")
    parser.add_argument("--backends", default="fsdp1,fsdp2", help="comma list (default fsdp1,fsdp2)")
    parser.add_argument("--size", choices=sorted(suite.SIZES), default="medium", help="model (default medium)")
    parser.add_argument("--mixed-precision", default=None, help="bridge spelling, e.g. bf16; fp32 if omitted")
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--top", type=int, default=12, help="sites to list per backend (default 12)")
    args = parser.parse_args()
    suite._quiet_transformers()
    backends = args.backends.split(",")
    results = run_distributed(
        job,
        args.world_size,
        args=(backends, args.strategy, args.size, args.mixed_precision, args.top),
        timeout_s=900,
    )
    for backend in backends:
        r = results[0][backend]
        print(
            f"== {backend} {args.strategy} ({args.mixed_precision or 'fp32'}), rank 0: held {r['held'] / MiB:.2f} MiB"
            f" + step peak {r['peak'] / MiB:.2f} MiB = {(r['held'] + r['peak']) / MiB:.2f} MiB; alive at the peak:"
        )
        for site, n in r["sites"]:
            print(f"  {n / MiB:8.3f} MiB  {site}")
        if r["rest"]:
            print(f"  {r['rest'] / MiB:8.3f} MiB  (other sites)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
