"""Peak host memory per rank: pretrained weights into a sharded model, naive vs meta-device.

    python benchmarks/pretrained_memory.py --world-size 2 --hidden 768 --layers 6

naive: every rank runs ``AutoModelForCausalLM.from_pretrained`` (a whole model per
rank) and then ``fsdp_bridge.shard``.  meta: ``fsdp_bridge.load_pretrained`` builds
the model on the meta device, shards it, and rank 0 alone reads the safetensors and
broadcasts; the other ranks only ever hold their shards.

Each method runs in fresh processes.  After the imports the kernel's peak-RSS mark is
reset (``/proc/self/clear_refs``); the figure is that peak (``VmHWM``) minus the resident
size after imports, per rank.  (``ru_maxrss`` is not used: a spawned child inherits
its parent's peak from before ``exec``.)  Linux only.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import psutil


def _rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size (VmHWM) to the current one


def _peak_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


def _run(method: str, path: str, chunk_numel: int | None) -> dict[str, float]:
    import torch  # noqa: F401  (imports count towards the baseline, not the load)
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import fsdp_bridge
    import fsdp_bridge.checkpoint._api as ckpt_api

    hf_logging.disable_progress_bar()  # "Loading weights" bars would interleave with the figures

    if chunk_numel:  # rank 0 reads and broadcasts this many elements per round
        ckpt_api._CHUNK_NUMEL = chunk_numel
    config = fsdp_bridge.BridgeConfig(backend="fsdp2", wrap="auto", device="cpu")
    hf_config = AutoConfig.from_pretrained(path)
    _reset_peak()
    base = _rss_mib()
    if method == "naive":
        model = AutoModelForCausalLM.from_pretrained(path)
        model = fsdp_bridge.shard(model, config)
    else:
        model = fsdp_bridge.load_pretrained(lambda: AutoModelForCausalLM.from_config(hf_config), path, config)
    local = fsdp_bridge.get_bridge(model).local_numel()
    return {"base": base, "peak": _peak_mib(), "local_params": local}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument(
        "--chunk-numel",
        type=int,
        default=None,
        help="elements per broadcast round of the meta path (default: the library's, 256Mi)",
    )
    args = parser.parse_args()
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

    from transformers import AutoModelForCausalLM, LlamaConfig

    from fsdp_bridge.testing import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        cfg = LlamaConfig(
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=max(1, args.hidden // 64),
            vocab_size=args.vocab,
            tie_word_embeddings=False,
        )
        model = AutoModelForCausalLM.from_config(cfg)
        n = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp)
        del model
        size = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors")) / 2**20
        print(
            f"Llama {args.layers}x{args.hidden}, vocab {args.vocab}: {n / 1e6:.1f}M parameters, "
            f"{size:.0f} MiB fp32 safetensors; world size {args.world_size}"
        )
        print(f"{'method':<8} {'rank':>4} {'after imports MiB':>18} {'peak MiB':>9} {'peak - imports MiB':>19}")
        for method in ("naive", "meta"):
            results = run_distributed(_run, args.world_size, args=(method, tmp, args.chunk_numel), timeout_s=900)
            for rank, r in enumerate(results):
                print(f"{method:<8} {rank:>4} {r['base']:>18.0f} {r['peak']:>9.0f} {r['peak'] - r['base']:>19.0f}")


if __name__ == "__main__":
    main()
