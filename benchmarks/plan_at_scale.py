"""Per-rank sharded state of Llama-shaped 7B, 70B and 405B at 64, 512 and 1024 ranks, checked.

    OMP_NUM_THREADS=1 python benchmarks/plan_at_scale.py > table.md

For every model and world size, FULL_SHARD (1D mesh) and HYBRID_SHARD with 8 ranks per node
(HSDP, e.g. 128 x 8 at 1024 ranks), on FSDP2, fp32 parameters, AdamW: the estimator's bytes per
rank, and :func:`fsdp_bridge.estimate.plan_at_scale`'s check that the real ``shard()``, run as
the first and the last rank of a fake world on the meta device, gives every parameter the
local shape the estimator assumed and allocates exactly the estimated parameter bytes.  Whole
models (every layer), no weights; about a minute on one CPU core.  Prints a Markdown table
(the one in ``docs/performance.md``); ``--json PATH`` also writes the figures.
"""

from __future__ import annotations

import argparse
import json
import time

from fsdp_bridge.config import BridgeConfig
from fsdp_bridge.estimate import build_meta_model, load_model_config, plan_at_scale

MODELS = {
    "7B (Llama 2)": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    ),
    "70B (Llama 2)": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
    ),
    "70B (Llama 3)": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "405B (Llama 3.1)": dict(
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
}
WORLDS = (64, 512, 1024)
PER_NODE = 8


def _spec(sizes: dict[str, int]) -> str:
    return "llama:" + ",".join(f"{k}={v}" for k, v in sizes.items())


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()

    rows = []
    print(
        "| model | parameters | ranks | mesh | params / rank | grads / rank | AdamW / rank | sharded state / rank "
        "| last rank's shard (unpadded) | shard() = estimate |"
    )
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    start = time.perf_counter()
    for label, sizes in MODELS.items():
        model = build_meta_model(load_model_config(_spec(sizes)), attn_implementation="eager")
        n = sum(p.numel() for p in model.parameters())
        for world in WORLDS:
            for strategy, hybrid in (("full_shard", None), ("hybrid_shard", (world // PER_NODE, PER_NODE))):
                config = BridgeConfig(backend="fsdp2", strategy=strategy, hybrid_shape=hybrid)
                plan = plan_at_scale(model, config, world_size=world)
                est, last = plan.estimate, plan.ranks[-1]
                exact = "exact" if plan.matches else "NO: " + "; ".join(plan.mismatches[:3])
                print(
                    f"| {label} | {n / 1e9:.2f} B | {world} | {'x'.join(map(str, est.mesh))} | {_gib(est.params)} "
                    f"| {_gib(est.grads)} | {_gib(est.optimizer)} | {_gib(est.sharded_state)} "
                    f"| {_gib(last.local_bytes)} | {exact} |",
                    flush=True,
                )
                rows.append(
                    {
                        "model": label,
                        "sizes": sizes,
                        "parameters": n,
                        "world_size": world,
                        "strategy": strategy,
                        "mesh": list(est.mesh),
                        "params": est.params,
                        "grads": est.grads,
                        "optimizer": est.optimizer,
                        "sharded_state": est.sharded_state,
                        "ranks": {
                            r.rank: {"local_bytes": r.local_bytes, "allocated_bytes": r.allocated_bytes}
                            for r in plan.ranks
                        },
                        "mismatches": list(plan.mismatches),
                    }
                )
    print(f"\nfigures in GiB (2^30 bytes); {len(rows)} configurations in {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    if any(r["mismatches"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
