"""Peak host memory of ``convert --to hf`` from a sharded checkpoint, streamed vs read whole.

    python benchmarks/convert_memory.py --hidden 768 --layers 6

A Llama model with AdamW state (model + two moments) is saved with ``save_checkpoint``; then, each
in a fresh process: ``convert_checkpoint(..., to="hf")`` (reads a batch of tensors at a time and
writes safetensors header-first), and the whole-state way (``read_full`` + ``save_file``, what
convert did before).  Memory: the peak of the process's anonymous resident memory (``RssAnon``,
sampled every millisecond) above its value before the conversion.  Linux only.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from pathlib import Path


def _convert(way: str, src: str, dst: str, queue: mp.Queue) -> None:
    from pretrained_memory import _AnonPeak

    from fsdp_bridge.checkpoint import _hf, convert_checkpoint
    from fsdp_bridge.checkpoint._convert import read_full

    start = time.perf_counter()
    with _AnonPeak() as anon:  # the sampler of pretrained_memory.py, beside this script
        if way == "streamed":
            convert_checkpoint(src, dst, to="hf")
        else:
            full = read_full(src)
            Path(dst).mkdir()
            _hf.write_hf_weights(Path(dst), full.model)
            assert full.optimizer is not None
            _hf.write_optimizer(Path(dst), full.optimizer)
    seconds = time.perf_counter() - start
    queue.put((anon.peak - anon.base, seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import fsdp_bridge

    cfg = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        vocab_size=32000,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 32000, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        fsdp_bridge.save_checkpoint(Path(tmp) / "sharded", model, optimizer)
        del model, optimizer
        print(f"Llama {args.layers}x{args.hidden}: {size:.0f} MiB of parameters, {3 * size:.0f} MiB with AdamW state")
        print(f"{'way':<34} {'RssAnon peak MiB':>17} {'/ model':>8} {'seconds':>8}")
        context = mp.get_context("spawn")
        for way, label in (("whole", "read whole + save_file (before)"), ("streamed", "convert_checkpoint(to='hf')")):
            queue = context.Queue()
            process = context.Process(
                target=_convert, args=(way, str(Path(tmp) / "sharded"), str(Path(tmp) / way), queue)
            )
            process.start()
            peak, seconds = queue.get()
            process.join()
            print(f"{label:<34} {peak:>17.0f} {peak / size:>8.2f} {seconds:>8.2f}")


if __name__ == "__main__":
    main()
