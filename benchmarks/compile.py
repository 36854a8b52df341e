"""Eager vs ``compile: true`` (and float8 where the GPU has it), per backend, as ratios in one run.

Each way trains the same Llama (``benchmarks/run.py``'s sizes) on the same batch through the bridge;
per way: the first step's time (with ``compile``, inductor compiling each wrap unit: the one-off
cost), the median of the following steps, the peak of live tensor bytes of one step on a rank
(on a GPU, ``torch.cuda.max_memory_allocated``; on CPU ``LiveBytes``, which sees what runs through
torch's dispatcher and not the buffers inside compiled code, so compiled ways show none) and the
first losses (compile must give eager's within fp32 tolerance). Ratios are against eager on the
same backend. The first compiled way pays the cold compile; later ways compile the same unit code
and reuse inductor's cache, so their first step is short.

    OMP_NUM_THREADS=1 python benchmarks/compile.py                    # CPU: 2 gloo ranks, the 'medium' Llama
    python benchmarks/compile.py --device cuda --size medium          # one GPU (NCCL, world size 1), bf16, + float8

Inductor's cache lives under the temporary directory: the first run of a machine pays the full
compile; later runs of the same shapes start from the cache (``--fresh-cache`` measures the cold one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import run as suite

import fsdp_bridge
from fsdp_bridge.testing import run_distributed


def _ways(device: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, BridgeConfig keywords) of every way measured on ``device``."""
    ways: list[tuple[str, dict[str, Any]]] = []
    for backend in ("fsdp1", "fsdp2"):
        base: dict[str, Any] = {"backend": backend, "device": device}
        if device == "cuda":
            base["mixed_precision"] = "bf16"
        ways.append((f"{backend} eager", base))
        ways.append((f"{backend} compile", {**base, "compile": True}))
    if device == "cuda" and torch.cuda.get_device_capability() >= (8, 9):
        fp8 = {"backend": "fsdp2", "device": device, "mixed_precision": "bf16", "float8": "tensorwise"}
        ways.append(("fsdp2 float8", fp8))
        ways.append(("fsdp2 float8 + compile", {**fp8, "compile": True}))
    return ways


def _batch(size: str, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in suite._batch(size).items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def job(size: str, steps: int, device_name: str) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device()) if device_name == "cuda" else torch.device("cpu")
    batch = _batch(size, device)
    out: dict[str, Any] = {}
    for name, kwargs in _ways(device_name):
        model = fsdp_bridge.shard(suite.build_model(size), fsdp_bridge.BridgeConfig(**kwargs))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, times = [], []
        for _ in range(steps + 1):
            _sync(device)
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
            _sync(device)
            times.append(time.perf_counter() - t0)
        peak: float | None = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            suite._step(model, opt, batch)
            torch.cuda.synchronize()
            peak = float(torch.cuda.max_memory_allocated())
        elif not kwargs.get("compile"):
            peak = suite._peak_step({"model": model, "opt": opt}, batch)
        out[name] = {"first_s": times[0], "step_s": statistics.median(times[1:]), "peak_bytes": peak, "losses": losses}
        del model, opt
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(suite.SIZES), default="medium")
    parser.add_argument("--steps", type=int, default=8, help="timed steps after the first (the median is printed)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--fresh-cache", action="store_true", help="a new inductor cache: the cold compile")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA GPU here", file=sys.stderr)
        return 2
    if args.fresh_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    suite._quiet_transformers()
    world, backend = (1, "nccl") if args.device == "cuda" else (2, "gloo")
    started = time.perf_counter()
    results = run_distributed(job, world, args=(args.size, args.steps, args.device), backend=backend, timeout_s=1800)
    r0 = results[0]
    print(
        f"{args.size} Llama, {world} {backend} rank(s) on {args.device}, torch {torch.__version__}, "
        f"{args.steps} timed steps, {time.perf_counter() - started:.0f} s in all"
    )
    print(
        f"{'way':24s} {'first step s':>12s} {'step ms':>8s} {'vs eager':>9s} {'peak MiB':>9s} {'vs eager':>9s}  losses"
    )
    for name, r in r0.items():
        eager = r0[name.split(" ")[0] + " eager"]
        peak = "      n/a       n/a"
        if r["peak_bytes"] is not None:
            peak = f"{r['peak_bytes'] / 2**20:9.1f} {r['peak_bytes'] / eager['peak_bytes']:9.3f}"
        print(
            f"{name:24s} {r['first_s']:12.2f} {r['step_s'] * 1e3:8.1f} {r['step_s'] / eager['step_s']:9.3f} {peak}  "
            + " ".join(f"{x:.5f}" for x in r["losses"][:3])
        )
    if args.device == "cpu":
        print("float8: not measured (CPU; it needs a GPU of compute capability 8.9+)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
