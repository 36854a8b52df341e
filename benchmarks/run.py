"""fsdp_bridge benchmark suite: bridge vs hand-written PyTorch, FSDP1 vs FSDP2, checkpoints, loading.

    python benchmarks/run.py                 # full CPU suite: world sizes 1/2/4, two model sizes
    python benchmarks/run.py --quick         # a couple of minutes: world size 2, small model (prints only)
    python benchmarks/run.py --plot docs/performance.png --out benchmarks/results.json

Every figure is a median over ``--repeats`` repeats; the runs being compared are
interleaved inside one job: bridge and plain models of a configuration live side by
side and their training steps alternate (ABBA...), FSDP1 and FSDP2 run in the same
job, and which goes first alternates per repeat, so that a noisy machine slows both
alike.  Results go to a JSON file and a
table on stdout.  Peak memory on CPU is the peak of live tensor bytes
(:class:`fsdp_bridge.estimate.LiveBytes`), on CUDA ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fsdp_bridge
from fsdp_bridge.estimate import LiveBytes, storage_bytes
from fsdp_bridge.testing import run_distributed
from fsdp_bridge.testing.models import tiny_config

SIZES: dict[str, dict[str, int]] = {
    "small": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "medium": dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
}
# Loading is measured with a bigger model, so that the weights dominate process noise.
LOADING_SIZE = dict(
    vocab_size=8192,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=12,
    num_key_value_heads=4,
)
STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")
BACKENDS = ("fsdp1", "fsdp2")
BATCH, SEQ = 4, 64


# ---------------------------------------------------------------------------------
# Models and the two ways of sharding them
# ---------------------------------------------------------------------------------


def build_model(size: str, *, seed: int = 0) -> nn.Module:
    from transformers import AutoModelForCausalLM

    sizes = LOADING_SIZE if size == "loading" else SIZES[size]
    config = tiny_config("llama", max_position_embeddings=SEQ, tie_word_embeddings=False, **sizes)
    config._attn_implementation = "eager"
    config.use_cache = False
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def hybrid_shape(world: int) -> tuple[int, int]:
    replicate = 2 if world % 2 == 0 else 1
    return (replicate, world // replicate)


def shard_bridge(model: nn.Module, backend: str, strategy: str) -> nn.Module:
    shape = hybrid_shape(dist.get_world_size()) if strategy.startswith("hybrid") else None
    config = fsdp_bridge.BridgeConfig(backend=backend, strategy=strategy, device="cpu", hybrid_shape=shape)
    return fsdp_bridge.shard(model, config)


def shard_plain(model: nn.Module, backend: str, strategy: str) -> nn.Module:
    """The same configuration written by hand against PyTorch, as its tutorials do."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    world = dist.get_world_size()
    hybrid = strategy.startswith("hybrid")
    if backend == "fsdp1":
        from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mesh = (
            init_device_mesh("cpu", hybrid_shape(world), mesh_dim_names=("replicate", "shard"))
            if hybrid
            else init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        )
        torch_strategy = {"hybrid_shard_zero2": ShardingStrategy._HYBRID_SHARD_ZERO2}.get(
            strategy, getattr(ShardingStrategy, strategy.upper(), None)
        )
        return FSDP(
            model,
            sharding_strategy=torch_strategy,
            auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            limit_all_gathers=True,
            device_id=torch.device("cpu"),
            device_mesh=mesh,
            use_orig_params=True,
        )
    from torch.distributed.fsdp import fully_shard

    if hybrid:
        mesh = init_device_mesh("cpu", hybrid_shape(world), mesh_dim_names=("replicate", "shard"))
    elif strategy == "no_shard":
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    # On a one-rank shard group (NO_SHARD, world size 1, HYBRID with one rank per shard group) every
    # unit reshards, root included, as the bridge does: that only frees FSDP2's one-rank copy.
    one_rank = mesh.size(mesh.ndim - 1) == 1
    reshard = one_rank or strategy in ("full_shard", "hybrid_shard")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=one_rank)
    return model


# ---------------------------------------------------------------------------------
# Measurements inside one rank
# ---------------------------------------------------------------------------------


def _batch(size: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    ids = torch.randint(0, SIZES[size]["vocab_size"], (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> None:
    opt.zero_grad()
    model(**batch).loss.backward()
    opt.step()


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return out, time.perf_counter() - t0


def _prepare(size: str, backend: str, strategy: str, way: str) -> dict[str, Any]:
    """Shard one configuration (timed) and take one step: the optimizer state exists after it."""
    shard = shard_bridge if way == "bridge" else shard_plain
    model = build_model(size)
    model, setup = _timed(lambda: shard(model, backend, strategy))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return {"model": model, "opt": opt, "setup_s": setup}


def _peak_step(run: dict[str, Any], batch: dict[str, torch.Tensor]) -> float:
    """Peak tensor bytes of one step on this rank: what is held, plus what the step allocates."""
    model, opt = run["model"], run["opt"]
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    held = [*model.parameters(), *model.buffers(), *state]
    with LiveBytes("cpu", ignore=held) as live:
        _step(model, opt, batch)
    return float(storage_bytes(held) + live.peak)


def measure_pair(size: str, backend: str, strategy: str, steps: int, first: str) -> dict[str, dict[str, Any]]:
    """Bridge and plain side by side: setups in order ``first``, then their steps alternating.

    Both models live at once, so each timed step of one is next to a step of the other:
    a burst of load from elsewhere on the machine hits both.
    """
    order = (first, "plain" if first == "bridge" else "bridge")
    batch = _batch(size)
    runs = {way: _prepare(size, backend, strategy, way) for way in order}
    for way in order:
        _step(runs[way]["model"], runs[way]["opt"], batch)  # warm-up; creates optimizer state
    peaks = {way: _peak_step(runs[way], batch) for way in order}
    times: dict[str, list[float]] = {way: [] for way in order}
    for i in range(steps):
        for way in order if i % 2 == 0 else order[::-1]:
            _, t = _timed(lambda w=way: _step(runs[w]["model"], runs[w]["opt"], batch))
            times[way].append(t)
    return {
        way: {"setup_s": runs[way]["setup_s"], "step_times_s": times[way], "peak_bytes": peaks[way]} for way in order
    }


def training_job(cases: list[tuple[str, str, str]], repeats: int, steps: int) -> list[dict[str, Any]]:
    """Every case, bridge and plain interleaved (which goes first alternates per repeat)."""
    out: list[dict[str, Any]] = []
    for size, _, backend in cases[:: max(1, len(cases) // 2)]:  # warm-up: imports, first mesh, allocator
        measure_pair(size, backend, "full_shard", 1, "bridge")
        gc.collect()
    for repeat in range(repeats):
        for size, strategy, backend in cases:
            pair = measure_pair(size, backend, strategy, steps, "bridge" if repeat % 2 == 0 else "plain")
            gc.collect()  # the previous models are freed before the next ones are timed
            for way, m in pair.items():
                out.append({"size": size, "strategy": strategy, "backend": backend, "way": way, "repeat": repeat, **m})
    return out


# ---------------------------------------------------------------------------------
# Checkpoints: fsdp_bridge.save_checkpoint / load_checkpoint / save_checkpoint_async
# ---------------------------------------------------------------------------------


def checkpoint_job(size: str, root: str, repeats: int) -> list[dict[str, Any]]:
    save, load = fsdp_bridge.save_checkpoint, fsdp_bridge.load_checkpoint
    model = shard_bridge(build_model(size), "fsdp2", "full_shard")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = _batch(size)
    _step(model, opt, batch)
    rank = dist.get_rank()
    out: list[dict[str, Any]] = []
    for repeat in range(repeats):
        # Plain reference: the full state gathered to rank 0, torch.save / torch.load there.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        def plain_save(path: str) -> None:
            msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                torch.save({"model": msd, "optim": osd}, path)

        def plain_load(path: str) -> None:
            if rank == 0:
                torch.load(path, weights_only=False)

        plain_path = os.path.join(root, f"plain-{repeat}.pt")
        _, t_ps = _timed(lambda p=plain_path: plain_save(p))
        _, t_pl = _timed(lambda p=plain_path: plain_load(p))
        row = {"repeat": repeat, "plain_save_s": t_ps, "plain_load_s": t_pl}
        for kind in ("sharded", "full"):
            path = os.path.join(root, f"{kind}-{repeat}")
            _, t_s = _timed(lambda p=path, k=kind: save(p, model, opt, kind=k))
            _, t_l = _timed(lambda p=path: load(p, model, opt))
            row[f"{kind}_save_s"], row[f"{kind}_load_s"] = t_s, t_l
        path = os.path.join(root, f"async-{repeat}")
        _, t_sync = _timed(lambda p=path + "-sync": save(p, model, opt, kind="sharded"))
        # Stall: how long training is blocked before the next step can start.
        pending, stall = _timed(lambda p=path: fsdp_bridge.save_checkpoint_async(p, model, opt))
        _step(model, opt, batch)
        pending.wait()
        row.update(sync_save_s=t_sync, async_stall_s=stall)
        out.append(row)
    return out


# ---------------------------------------------------------------------------------
# Loading pretrained weights: meta-device path vs a full model on every rank
# ---------------------------------------------------------------------------------


class _RssPeak:
    """Peak resident set size of this process while in the block, sampled every millisecond
    (``ru_maxrss`` is a lifetime maximum: imports before the block would hide it)."""

    def __enter__(self) -> _RssPeak:
        import threading

        self.base = self.peak = self._now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _now() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._now())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._now())


def loading_job(model_dir: str, way: str) -> dict[str, int]:
    from transformers import AutoConfig, AutoModelForCausalLM

    # Imports (transformers' model code, safetensors) and a first shard() happen before the
    # baseline: their memory is the same on both paths and is not the weights'.
    fsdp_bridge.shard(build_model("small"), fsdp_bridge.BridgeConfig(device="cpu"))
    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gc.collect()
    rank = dist.get_rank()
    dist.barrier()
    with _RssPeak() as rss:
        if way == "meta" and rank != 0:
            config = AutoConfig.from_pretrained(model_dir)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        bridge_config = fsdp_bridge.BridgeConfig(
            strategy="full_shard", backend="fsdp2", device="cpu", sync_module_states=(way == "meta")
        )
        model = fsdp_bridge.shard(model, bridge_config)
        dist.barrier()
    return {"rss_delta": rss.peak - rss.base, "local_bytes": storage_bytes(model.parameters())}


# ---------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def summarise_training(raw: list[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    rows = []
    keys = sorted(
        {(r["size"], r["strategy"], r["backend"]) for r in raw},
        key=lambda k: (list(SIZES).index(k[0]), STRATEGIES.index(k[1]), k[2]),
    )
    for size, strategy, backend in keys:
        sel = {
            w: [r for r in raw if (r["size"], r["strategy"], r["backend"], r["way"]) == (size, strategy, backend, w)]
            for w in ("bridge", "plain")
        }
        row: dict[str, Any] = {"world": world, "size": size, "strategy": strategy, "backend": backend}
        for w in ("bridge", "plain"):
            for r in sel[w]:
                r.setdefault("step_s", median(r["step_times_s"]))
        for metric in ("step_s", "setup_s", "peak_bytes"):
            if metric == "step_s":  # the median over every timed step of every repeat
                b, p = (median([t for r in sel[w] for t in r["step_times_s"]]) for w in ("bridge", "plain"))
            else:
                b, p = (median([r[metric] for r in sel[w]]) for w in ("bridge", "plain"))
            row[f"{metric}_bridge"], row[f"{metric}_plain"], row[f"{metric}_ratio"] = b, p, b / p
        rows.append(row)
    return rows


def training_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'world':>5} {'size':<7} {'strategy':<19} {'backend':<7} {'step ms b/p':>15} {'ratio':>6} "
        f"{'setup ms b/p':>15} {'ratio':>6} {'peak KiB b/p':>17} {'ratio':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['world']:>5} {r['size']:<7} {r['strategy']:<19} {r['backend']:<7} "
            f"{r['step_s_bridge'] * 1e3:>7.1f}/{r['step_s_plain'] * 1e3:<7.1f} {r['step_s_ratio']:>6.3f} "
            f"{r['setup_s_bridge'] * 1e3:>7.1f}/{r['setup_s_plain'] * 1e3:<7.1f} {r['setup_s_ratio']:>6.3f} "
            f"{r['peak_bytes_bridge'] / 1024:>8.0f}/{r['peak_bytes_plain'] / 1024:<8.0f} {r['peak_bytes_ratio']:>6.3f}"
        )
    return "\n".join(lines)


def backend_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'world':>5} {'size':<7} {'strategy':<19} {'step ms fsdp1/fsdp2':>20} {'fsdp2/fsdp1':>11} "
        f"{'peak KiB fsdp1/fsdp2':>21} {'fsdp2/fsdp1':>11}"
    ]
    by = {(r["world"], r["size"], r["strategy"], r["backend"]): r for r in rows}
    for (world, size, strategy, backend), r1 in by.items():
        r2 = by.get((world, size, strategy, "fsdp2"))
        if backend != "fsdp1" or r2 is None:
            continue
        lines.append(
            f"{world:>5} {size:<7} {strategy:<19} "
            f"{r1['step_s_bridge'] * 1e3:>9.1f}/{r2['step_s_bridge'] * 1e3:<9.1f} "
            f"{r2['step_s_bridge'] / r1['step_s_bridge']:>11.3f} "
            f"{r1['peak_bytes_bridge'] / 1024:>10.0f}/{r2['peak_bytes_bridge'] / 1024:<10.0f} "
            f"{r2['peak_bytes_bridge'] / r1['peak_bytes_bridge']:>11.3f}"
        )
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_at_start": os.getloadavg(),
    }


def plot(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install 'fsdp-bridge[plot]')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world = max(r["world"] for r in rows)
    size = next(s for s in reversed(SIZES) if any(r["size"] == s for r in rows))
    sel = [r for r in rows if r["world"] == world and r["size"] == size]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    labels = list(dict.fromkeys(r["strategy"] for r in sel))
    width = 0.2
    for ax, metric, scale, unit in (
        (axes[0], "step_s", 1e3, "step time (ms)"),
        (axes[1], "peak_bytes", 1 / 2**20, "peak tensor memory per rank (MiB)"),
    ):
        for i, (backend, way) in enumerate((b, w) for b in BACKENDS for w in ("plain", "bridge")):
            vals = [
                next((r[f"{metric}_{way}"] * scale for r in sel if r["strategy"] == s and r["backend"] == backend), 0.0)
                for s in labels
            ]
            ax.bar([x + (i - 1.5) * width for x in range(len(labels))], vals, width, label=f"{backend} {way}")
        ax.set_xticks(range(len(labels)), labels, rotation=20)
        ax.set_ylabel(unit)
    axes[0].legend()
    fig.suptitle(f"fsdp_bridge vs hand-written PyTorch: llama '{size}', {world} gloo ranks on CPU (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="world size 2, small model, 2 repeats")
    ap.add_argument("--world-sizes", default=None, help="comma list (default 1,2,4; quick: 2)")
    ap.add_argument("--sizes", default=None, help="comma list of " + ", ".join(SIZES))
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--repeats", type=int, default=None, help="repeats per configuration (default 3; quick: 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per repeat (default 5; quick: 3)")
    ap.add_argument("--skip", default="", help="parts to skip: training, checkpoint, loading")
    ap.add_argument(
        "--out",
        default=None,
        help="results JSON (default: benchmarks/results.json for a full run; --quick writes no file unless given one)",
    )
    ap.add_argument("--plot", default=None, help="write a PNG of step time and memory per strategy")
    args = ap.parse_args(argv)
    if args.out is None and not args.quick:
        args.out = "benchmarks/results.json"
    _quiet_transformers()
    worlds = [int(w) for w in (args.world_sizes or ("2" if args.quick else "1,2,4")).split(",")]
    sizes = (args.sizes or ("small" if args.quick else "small,medium")).split(",")
    repeats = args.repeats or (2 if args.quick else 3)
    steps = args.steps or (3 if args.quick else 5)
    strategies = args.strategies.split(",")
    skip = set(filter(None, args.skip.split(",")))
    threads = 1
    result: dict[str, Any] = {
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "machine": machine(),
        "batch": BATCH,
        "seq_len": SEQ,
        "sizes": SIZES,
        "repeats": repeats,
        "steps": steps,
        "threads_per_rank": threads,
    }
    print(f"machine: {result['machine']}")

    if "training" not in skip:
        rows, raw_all = [], {}
        for world in worlds:
            cases = [(s, st, b) for s in sizes for st in strategies for b in BACKENDS]
            t0 = time.time()
            per_rank = run_distributed(
                training_job, world, args=(cases, repeats, steps), timeout_s=3600, threads_per_rank=threads
            )
            raw = per_rank[0]  # collectives keep ranks in step; setup/step are barrier-to-barrier
            for i, r in enumerate(raw):
                r["peak_bytes"] = max(rank[i]["peak_bytes"] for rank in per_rank)  # the fullest rank
            raw_all[world] = raw
            rows.extend(summarise_training(raw, world))
            print(
                f"world {world}: {len(cases)} configurations x 2 ways x {repeats} repeats in {time.time() - t0:.0f} s",
                flush=True,
            )
            result["training"], result["training_raw"] = rows, raw_all  # partial results survive a kill
            _write(args.out, result)
        result["training"] = rows
        result["training_raw"] = raw_all
        print("\nbridge vs plain PyTorch (b/p = bridge/plain, medians)\n" + training_table(rows))
        print("\nFSDP1 vs FSDP2 through the bridge (same job)\n" + backend_table(rows))
        if args.plot:
            plot(rows, args.plot)
            print(f"plot: {args.plot}")

    if "checkpoint" not in skip:
        with tempfile.TemporaryDirectory() as root:
            raw = run_distributed(
                checkpoint_job, 2, args=(sizes[-1], root, repeats), timeout_s=1800, threads_per_rank=threads
            )[0]
        med = {k: median([r[k] for r in raw]) for k in raw[0] if k != "repeat"}
        result["checkpoint"] = {"raw": raw, "median": med, "world": 2, "size": sizes[-1]}
        print("\ncheckpoints at 2 ranks (medians, s): " + ", ".join(f"{k} {v:.4f}" for k, v in med.items()))
        for kind in ("sharded", "full"):
            print(
                f"  {kind}: save/torch.save {med[f'{kind}_save_s'] / med['plain_save_s']:.2f}, "
                f"load/torch.load {med[f'{kind}_load_s'] / med['plain_load_s']:.2f}"
            )
        print(f"  async save stall / sync save: {med['async_stall_s'] / med['sync_save_s']:.2f}")

    if "loading" not in skip:
        world = max(w for w in worlds if w >= 1)
        world = max(world, 2)
        size = "loading"
        with tempfile.TemporaryDirectory() as root:
            build_model(size).save_pretrained(root)
            per_way = {}
            for repeat in range(repeats):
                for way in ("meta", "full") if repeat % 2 == 0 else ("full", "meta"):
                    res = run_distributed(loading_job, world, args=(root, way), timeout_s=600, threads_per_rank=threads)
                    per_way.setdefault(way, []).append(res)
        model_bytes = sum(p.numel() * 4 for p in build_model(size).parameters())
        from fsdp_bridge.estimate import build_meta_model, model_units

        meta = build_meta_model(
            tiny_config("llama", max_position_embeddings=SEQ, tie_word_embeddings=False, **LOADING_SIZE)
        )
        unit = max(u.numel for u in model_units(meta, fsdp_bridge.BridgeConfig()) if u.name != "(root)") * 4
        bound = (model_bytes / world + unit) * 1.10
        summary = {}
        for way, runs in per_way.items():
            summary[way] = [median([run[r]["rss_delta"] for run in runs]) for r in range(world)]
        result["loading"] = {
            "world": world,
            "size": size,
            "model_bytes": model_bytes,
            "unit_bytes": unit,
            "target_bytes": bound,
            "rss_delta_by_rank": summary,
        }
        print(
            f"\npretrained loading at {world} ranks, model {model_bytes / 2**20:.2f} MiB, largest unit "
            f"{unit / 2**20:.2f} MiB: peak RSS growth per rank (MiB, medians)"
        )
        for way, vals in summary.items():
            print(f"  {way:<5} " + " ".join(f"rank{r}={v / 2**20:.1f}" for r, v in enumerate(vals)))
        print(f"  target for non-zero ranks (meta path): <= {bound / 2**20:.2f} MiB")

    if _write(args.out, result):
        print(f"\nresults: {args.out}")
    return 0


def _quiet_transformers() -> None:
    """No transformers / hub progress bars in benchmark output (ranks inherit it through the env)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _write(path: str | None, result: dict[str, Any]) -> bool:
    if path is None:
        return False
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1, default=str))
    return True


if __name__ == "__main__":
    sys.exit(main())
