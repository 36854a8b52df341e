"""One-GPU benchmark: the bridge against hand-written FSDP1/FSDP2 and an unsharded model, on CUDA.

    python benchmarks/gpu.py                       # ~250M-parameter Llama, 4 modes, 2 repeats
    python benchmarks/gpu.py --quick               # smaller model, 1 repeat (a smoke run)
    python benchmarks/gpu.py --modes bf16+ac --repeats 3   # one mode
    python benchmarks/gpu.py --out benchmarks/results-gpu.json

World size 1 (NCCL cannot put two ranks on one GPU). For each mode (fp32; bf16 mixed precision;
bf16 + activation checkpointing; bf16 + CPU offload) it runs, one after the other so that peak
memory is each run's own:

* ``bridge-fsdp1`` / ``bridge-fsdp2``: ``fsdp_bridge.shard`` with the mode's config;
* ``plain-fsdp1`` / ``plain-fsdp2``: the same configuration written against torch by hand;
* ``single``: the model on the GPU with no FSDP (bf16 through ``torch.autocast``, AC through
  ``gradient_checkpointing_enable``; no offload mode).

Each figure is the median step time over ``--steps`` timed steps after warm-up, and
``torch.cuda.max_memory_allocated`` over those steps minus what was allocated before the run's
model was built (torch's FSDP1 keeps a deleted model's parameters alive; that belongs to earlier
runs). The bridge's own memory estimate (``fsdp_bridge.estimate``, model shapes and a meta-device
forward) is printed next to the measured
peak of the bridge runs. Ratios are against the hand-written run of the same backend, in the same
job; which way goes first alternates per repeat.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import fsdp_bridge
from fsdp_bridge.testing import run_distributed

SIZES: dict[str, dict[str, int]] = {
    "quick": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
    "medium": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
    ),
}
MODES: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"mixed_precision": "bf16"},
    "bf16+ac": {"mixed_precision": "bf16", "activation_checkpointing": True},
    "bf16+offload": {"mixed_precision": "bf16", "cpu_offload": True},
}
WAYS = ("bridge-fsdp1", "plain-fsdp1", "bridge-fsdp2", "plain-fsdp2", "single")


def build_model(size: str, seq: int) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from fsdp_bridge.testing.models import tiny_config

    config = tiny_config("llama", max_position_embeddings=seq, tie_word_embeddings=False, **SIZES[size])
    config._attn_implementation = "eager"
    config.use_cache = False
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def shard_plain(model: nn.Module, backend: str, mode: dict[str, Any]) -> nn.Module:
    """The mode written against torch by hand, as its tutorials do."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    bf16 = mode.get("mixed_precision") == "bf16"
    if mode.get("activation_checkpointing"):
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    if backend == "fsdp1":
        from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            limit_all_gathers=True,
            mixed_precision=MixedPrecision(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16
            )
            if bf16
            else None,
            cpu_offload=CPUOffload(offload_params=True) if mode.get("cpu_offload") else None,
            device_id=torch.cuda.current_device(),
            use_orig_params=True,
        )
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    offload = CPUOffloadPolicy() if mode.get("cpu_offload") else OffloadPolicy()
    if not mode.get("cpu_offload"):
        model.cuda()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
    return model


def prepare(way: str, size: str, seq: int, mode: dict[str, Any]) -> tuple[nn.Module, Callable[[], Any]]:
    """The model of ``way`` and a zero-argument context factory for its forward (autocast for single)."""
    import contextlib

    model = build_model(size, seq)
    if way.startswith("bridge-"):
        config = fsdp_bridge.BridgeConfig(backend=way.split("-")[1], device="cuda", **mode)
        return fsdp_bridge.shard(model, config), contextlib.nullcontext
    if way.startswith("plain-"):
        return shard_plain(model, way.split("-")[1], mode), contextlib.nullcontext
    if mode.get("activation_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.cuda()
    if mode.get("mixed_precision") == "bf16":
        return model, lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return model, contextlib.nullcontext


def measure(way: str, size: str, mode_name: str, batch: int, seq: int, steps: int) -> dict[str, Any]:
    mode = MODES[mode_name]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    # torch's FSDP1 keeps the parameters of a deleted model alive:
    # what is allocated now belongs to earlier runs and is not counted.
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    model, ctx = prepare(way, size, seq, mode)
    torch.cuda.synchronize()
    setup = time.perf_counter() - t0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SIZES[size]["vocab_size"], (batch, seq), generator=g).cuda()
    losses, times = [], []

    def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> float:
        opt.zero_grad(set_to_none=True)
        with ctx():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return float(loss.detach())

    for _ in range(2):  # warm-up: kernels, allocator, optimizer state
        losses.append(step())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        t = time.perf_counter()
        losses.append(step())  # float() synchronises
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() - base
    del model, opt, step
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "way": way,
        "mode": mode_name,
        "setup_s": setup,
        "step_s": statistics.median(times),
        "peak_bytes": peak,
        "left_from_earlier_runs_bytes": base,
        "losses": losses,
    }


def estimated_peaks(size: str, batch: int, seq: int) -> dict[tuple[str, str], int]:
    from fsdp_bridge.estimate import estimate

    with torch.device("meta"):
        meta = build_model(size, seq)
    out = {}
    for mode_name, mode in MODES.items():
        base = fsdp_bridge.BridgeConfig(device="cuda", **mode)
        for row in estimate(meta, world_size=1, strategies=["full_shard"], base=base, batch=batch, seq_len=seq):
            out[(f"bridge-{row.backend}", mode_name)] = row.peak  # device bytes (offloaded state excluded)
    return out


def job(size: str, batch: int, seq: int, steps: int, repeats: int, modes: list[str]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for repeat in range(repeats):
        for mode_name in modes:
            ways = [w for w in WAYS if not (w == "single" and "offload" in mode_name)]
            for way in ways if repeat % 2 == 0 else ways[::-1]:
                rows.append({**measure(way, size, mode_name, batch, seq, steps), "repeat": repeat})
                print(
                    f"  {mode_name:13s} {way:13s} {rows[-1]['step_s'] * 1e3:8.1f} ms "
                    f"{rows[-1]['peak_bytes'] / 2**30:7.2f} GiB",
                    flush=True,
                )
    estimates = {f"{w}/{m}": v for (w, m), v in estimated_peaks(size, batch, seq).items()}
    return {"rows": rows, "estimates": estimates}


def summarise(result: dict[str, Any]) -> str:
    rows, est = result["rows"], result["estimates"]
    lines = [
        f"{'mode':13s} {'way':13s} {'step ms':>8s} {'vs plain':>8s} {'peak GiB':>9s} {'vs plain':>8s} "
        f"{'est GiB':>8s} {'est/meas':>8s}  first/last loss"
    ]
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["mode"], r["way"]), []).append(r)
    for (mode, way), rs in by.items():
        step = statistics.median(r["step_s"] for r in rs)
        peak = max(r["peak_bytes"] for r in rs)
        plain = by.get((mode, way.replace("bridge", "plain")))
        ratio_t = ratio_m = ""
        if way.startswith("bridge") and plain:
            ratio_t = f"{step / statistics.median(r['step_s'] for r in plain):.3f}"
            ratio_m = f"{peak / max(r['peak_bytes'] for r in plain):.3f}"
        e = est.get(f"{way}/{mode}")
        lines.append(
            f"{mode:13s} {way:13s} {step * 1e3:8.1f} {ratio_t:>8s} {peak / 2**30:9.2f} {ratio_m:>8s} "
            f"{'' if e is None else f'{e / 2**30:8.2f}':>8s} {'' if e is None else f'{e / peak:8.3f}':>8s}"
            f"  {rs[0]['losses'][0]:.4f}/{rs[0]['losses'][-1]:.4f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, one repeat")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--out", help="write the raw results and the table to this JSON file")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; allowed: {', '.join(MODES)}")
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    size, repeats = ("quick", 1) if args.quick else ("medium", args.repeats)
    n_params = sum(p.numel() for p in build_model(size, args.seq).parameters())
    print(
        f"{torch.cuda.get_device_name()} torch {torch.__version__}: Llama {n_params / 1e6:.0f}M parameters, "
        f"batch {args.batch} x {args.seq} tokens, {args.steps} timed steps, {repeats} repeat(s)",
        flush=True,
    )
    (result,) = run_distributed(
        job, 1, args=(size, args.batch, args.seq, args.steps, repeats, modes), backend="nccl", timeout_s=3000
    )
    table = summarise(result)
    print(table)
    if args.out:
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "params": n_params,
            "batch": args.batch,
            "seq": args.seq,
            "steps": args.steps,
            "repeats": repeats,
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, **result, "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
