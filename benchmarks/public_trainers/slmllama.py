"""Drives the FSDP1 LLaMA trainer of Sumeet2807/LLMs (``slm/models/lm.py`` at 97aa72b) on CPU ranks, with no
download.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the repository and once in the copy that
``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/slmllama.py

The tree's ``LanguageModel`` builds its own LLaMA (``slm/models/llama.py``: embedding, transformer blocks, RMSNorm,
output layer) from ``ModelArgs``, wraps it in ``FSDP(model, auto_wrap_policy=partial(transformer_auto_wrap_policy,
transformer_layer_cls={TransformerBlock}), mixed_precision=<bf16 where CUDA has it, else None>,
device_id=torch.cuda.current_device())`` in its ``fsdp()``, and trains it with AdamW in its ``train()``: each
batch of sentences tokenized, padded with id 32000, cross-entropy over the positions that are not padding. This
driver does what the tree's ``fsdp_trun.py`` does around those calls: a small model (dim 32, 2 blocks, 2 heads,
sequences of 16 tokens), one epoch over 64 sentences of the sample text shipped with fsdp_bridge (a
``DistributedSampler``, batches of 4 per rank: eight steps at 2 ranks), then saves the trained model's full
parameters from rank 0 to ``trained.pt`` (gathered on every rank with ``fsdp_bridge.summon_full_params``, which
takes FSDP1's wrapper and the bridge's model alike), which ``verify`` compares. What it reads from elsewhere is
made here, the same in both runs:

* the tokenizer (the tree's script loads Mistral's from the Hub) is one of bytes, with 32001 ids so that the
  trainer's padding id is a row of the embedding;
* ``fairscale``, ``sentencepiece`` and ``torchsummary`` (imported by modules the trainer imports, not used by the
  run) are stubs, and the trainer's ``SummaryWriter`` writes nothing;
* the model is built on the CPU (``device="cpu"``: the tree's script passes the rank, a GPU).

Float32 throughout (the trainer picks bf16 only where CUDA and NCCL have it), so the two runs can agree bit for bit.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import types
from typing import Any

import torch
from _common import sample_sentences, stub_missing

import fsdp_bridge

VOCAB = 32001  # the trainer pads with id 32000


class _Bytes:
    """A tokenizer of UTF-8 bytes with ``len() == VOCAB``."""

    def __len__(self) -> int:
        return VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


class _Silent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        pass


def _stub_packages() -> None:
    nothing = lambda *args, **kwargs: None
    stub_missing({"torchsummary": {"summary": nothing}, "sentencepiece": {"SentencePieceProcessor": _Silent}})
    # the tree's llama/ package (Meta's model-parallel LLaMA, not the one trained) imports fairscale's layers
    names = {
        "fairscale.nn.model_parallel.initialize": dict.fromkeys(
            ("get_model_parallel_rank", "initialize_model_parallel", "model_parallel_is_initialized"), nothing
        ),
        "fairscale.nn.model_parallel.layers": dict.fromkeys(
            ("ColumnParallelLinear", "ParallelEmbedding", "RowParallelLinear"), _Silent
        ),
    }
    for package in ("fairscale", "fairscale.nn", "fairscale.nn.model_parallel", *names):
        if package in sys.modules:
            continue
        module = types.ModuleType(package)
        module.__spec__ = importlib.machinery.ModuleSpec(package, None, is_package=package not in names)
        if package not in names:
            module.__path__ = []
        module.__dict__.update(names.get(package, {}))
        sys.modules[package] = module


def main() -> None:
    _stub_packages()
    # imported as the tree's fsdp_trun.py imports it (the tree first on sys.path): slm/models/ holds a llama.py of
    # its own, which would hide the tree's llama package were that folder put first
    lm_module = importlib.import_module("slm.models.lm")
    from slm.models.llama import ModelArgs

    lm_module.SummaryWriter = _Silent
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo")
    args = ModelArgs()
    args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.multiple_of = 32, 2, 2, None, 8
    args.ffn_dim_multiplier, args.norm_eps = None, 1e-5
    torch.manual_seed(0)
    lm = lm_module.LanguageModel(args, _Bytes(), max_seq_len=16, bsz=4, verbose=False, device="cpu")
    lm.fsdp()
    sentences = sample_sentences()[:64]
    sampler = torch.utils.data.DistributedSampler(sentences, num_replicas=world, rank=rank, shuffle=False)
    loader = torch.utils.data.DataLoader(sentences, batch_size=4, sampler=sampler)
    lm.train(loader, sampler=sampler, epochs=1)
    with fsdp_bridge.summon_full_params(lm.model):
        full = {name: p.detach().clone() for name, p in lm.model.named_parameters()}
    if rank == 0:
        torch.save(full, "trained.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
