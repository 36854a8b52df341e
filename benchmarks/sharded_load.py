"""Sharded load cost: ``load_checkpoint`` against the floor and against torch.load.

    python benchmarks/sharded_load.py --world-size 2 --hidden 768 --layers 6 [--backend fsdp1]

One run, fresh processes, gloo CPU ranks; a Llama model sharded with ``--backend``, AdamW after
one step (model + two moments), saved once with ``save_checkpoint(kind="sharded")``.  Timed per
repeat, in alternating order, medians reported (the slowest rank of each repeat):

- ``dcp.load by hand``: what a user writes with torch alone, the floor:
  ``get_model_state_dict``/``get_optimizer_state_dict``, ``dcp.load`` of the checkpoint's own
  ``dcp/`` directory into them, ``set_model_state_dict``/``set_optimizer_state_dict``;
- ``torch.load + set_state_dict``: rank 0 ``torch.load``s one file of the full state (written by
  ``torch.save`` from ``get_state_dict(full_state_dict=True, cpu_offload=True)``) and every rank
  takes its shards with ``set_{optimizer,model}_state_dict(..., broadcast_from_rank0=True)``;
- ``load_checkpoint``: fsdp_bridge (checks names and shapes, verifies checksums, reads training
  state and RNG, loads all or nothing); and with ``all_or_nothing=False`` (straight into the live
  state, after the same checks).

Then the time of ``load_checkpoint``'s steps on rank 0 (cProfile, cumulative seconds).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

STEPS = (
    ("verify_manifest", "verifying checksums"),
    ("read_side_files", "training state and RNG"),
    ("_template", "model state dict (template)"),
    ("_dcp_key_map", "names and shapes"),
    ("get_optimizer_state_dict", "optimizer state dict (template)"),
    ("_scratch", "scratch copies (all or nothing)"),
    ("read_dcp", "dcp.load"),
    ("set_optimizer_state_dict", "set_optimizer_state_dict"),
    ("set_model_state_dict", "set_model_state_dict"),
)


def _run(root: str, hidden: int, layers: int, backend: str, repeats: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from transformers import AutoModelForCausalLM, LlamaConfig

    import fsdp_bridge

    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        vocab_size=32000,
    )
    torch.manual_seed(0)
    model = fsdp_bridge.shard(
        AutoModelForCausalLM.from_config(cfg), fsdp_bridge.BridgeConfig(backend=backend, wrap="auto", device="cpu")
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 32000, (1, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    rank = dist.get_rank()
    path = Path(root) / "ckpt"
    fsdp_bridge.save_checkpoint(path, model, optimizer)
    full_file = Path(root) / "full.pt"
    offload = backend == "fsdp2"  # cpu_offload gathers on rank 0 only; it crashes FSDP1 on CPU (torch 2.13)
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, full_file)
    del msd, osd
    dist.barrier()

    def by_hand() -> None:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])

    def torch_load() -> None:
        full = torch.load(full_file, weights_only=True) if rank == 0 else {"model": {}, "optim": {}}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(model, optimizer, full["optim"], options=options)
        set_model_state_dict(model, full["model"], options=options)

    def ours() -> None:
        fsdp_bridge.load_checkpoint(path, model, optimizer)

    def ours_in_place() -> None:
        fsdp_bridge.load_checkpoint(path, model, optimizer, all_or_nothing=False)

    ways = {
        "dcp.load by hand": by_hand,
        "torch.load + set_*_state_dict": torch_load,
        "load_checkpoint": ours,
        "load_checkpoint(all_or_nothing=False)": ours_in_place,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for repeat in range(repeats):
        order = list(ways) if repeat % 2 == 0 else list(reversed(ways))
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            ways[name]()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    profile = cProfile.Profile()
    profile.enable()
    ours()
    profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    steps = {}
    for func, label in STEPS:
        seconds = sum(row[3] for (_, _, name), row in stats.items() if name == func)
        steps[label] = seconds
    return {"times": {k: statistics.median(v) for k, v in times.items()}, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--backend", choices=("fsdp1", "fsdp2"), default="fsdp2")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

    from fsdp_bridge.testing import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(
            _run, args.world_size, args=(tmp, args.hidden, args.layers, args.backend, args.repeats), timeout_s=1800
        )
    floor = max(r["times"]["dcp.load by hand"] for r in results)
    print(
        f"Llama {args.layers}x{args.hidden} + AdamW state, {args.backend}, world size {args.world_size}; "
        f"median of {args.repeats}, slowest rank, seconds"
    )
    print(f"{'way':<40} {'seconds':>8} {'/ dcp.load by hand':>19}")
    for name in results[0]["times"]:
        seconds = max(r["times"][name] for r in results)
        print(f"{name:<40} {seconds:>8.3f} {seconds / floor:>19.2f}")
    print("\nload_checkpoint's steps on rank 0 (cProfile, cumulative seconds; profiling slows calls down):")
    for label, seconds in results[0]["steps"].items():
        print(f"  {label:<34} {seconds:>7.3f}")


if __name__ == "__main__":
    main()
