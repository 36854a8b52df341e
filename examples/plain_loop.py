"""A plain training loop on the library API, without the CLI or the training YAML.

    torchrun --nproc-per-node 2 examples/plain_loop.py                  # CPU, gloo
    torchrun --nproc-per-node 2 examples/plain_loop.py --backend fsdp1  # the other backend

It trains a tiny Llama-style model on the bytes of the sample corpus shipped with the
package (a byte is a token: no tokenizer needed), with gradient accumulation, clipping
and a sharded checkpoint, the same way on FSDP1 and FSDP2.
"""

from __future__ import annotations

import argparse
from importlib.resources import files

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import fsdp_bridge
from fsdp_bridge.train import DataConfig


def main(*, backend: str = "fsdp2", steps: int = 20, accum: int = 2, out: str | None = None) -> list[float]:
    config = fsdp_bridge.BridgeConfig(strategy="full_shard", backend=backend, device="cpu")
    torch.manual_seed(0)  # same initial weights on every rank
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            use_cache=False,
        )
    )
    model = fsdp_bridge.shard(model, config)  # starts the process group from torchrun's environment
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rank, world = dist.get_rank(), dist.get_world_size()

    corpus = files("fsdp_bridge") / "data" / "sample_corpus.txt"  # shipped inside the package
    data = torch.frombuffer(bytearray(corpus.read_bytes()), dtype=torch.uint8).long()
    seq, batch = DataConfig().seq_len, 4
    sequences = data[: len(data) // seq * seq].view(-1, seq)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(sequences), generator=g)

    losses = []
    for step in range(steps):
        for micro in range(accum):
            start = ((step * accum + micro) * world + rank) * batch
            ids = sequences[order[start : start + batch]]
            # Gradients are reduced across ranks only on the last micro-batch.
            ctx = fsdp_bridge.no_sync(model) if micro < accum - 1 else torch.enable_grad()
            with ctx:
                loss = model(input_ids=ids, labels=ids).loss
                (loss / accum).backward()
        fsdp_bridge.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        if rank == 0 and (step + 1) % 5 == 0:
            print(f"step {step + 1}: loss {float(loss):.4f}")

    if out is not None:  # a sharded checkpoint, loadable at any world size on either backend
        fsdp_bridge.save_checkpoint(out, model, optimizer, kind="sharded", state={"step": steps})
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="fsdp2", choices=["fsdp1", "fsdp2"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="runs/plain-loop-ckpt")
    args = parser.parse_args()
    main(backend=args.backend, steps=args.steps, out=args.out)
    dist.destroy_process_group()
