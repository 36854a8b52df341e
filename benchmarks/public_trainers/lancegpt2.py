"""Drives the FSDP1 GPT-2 pre-training example of lancedb/lance-deeplearning-recipes
(``examples/fsdp-llm-pretraining`` at 212825c) on CPU ranks, with no download.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the example's directory and once in the copy
that ``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout>/examples/fsdp-llm-pretraining -- benchmarks/public_trainers/lancegpt2.py

The example (``train.py``, with everything else in ``utils.py``, which ``train.py`` imports with ``import *``)
starts one process per GPU with ``mp.spawn``; each builds GPT-2 from ``CONFIG_MAPPING["gpt2"]()``, wraps it in
``FSDP(model, auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=100),
cpu_offload=CPUOffload(offload_params=True))``, trains it with AdamW and a ``StepLR`` schedule over windows of
256 tokens of a Lance dataset, each rank its own half, and with ``--save-model`` saves ``model.state_dict()``
(FSDP1's default: the full state dict, on every rank) from rank 0 to ``gpt2.pt``, which ``verify`` compares.
This driver calls its ``fsdp_main(rank, world_size, args)`` on each rank ``torchrun`` started (``mp.spawn``'s
job), with the example's argument defaults and ``--save-model``. What it reads from elsewhere is made here, the
same in both runs:

* ``wikitext_100K.lance`` (a Lance dataset of token ids made by another notebook): a stub ``lance`` module whose
  dataset answers ``count_rows()`` and ``take(indices).to_pylist()`` from the sample text shipped in
  ``fsdp_bridge/data``, each word's id its rank in a sorted vocabulary; 16640 rows, so that each rank draws 32
  windows, two batches of 16 per epoch (4 optimizer steps per rank over the example's 2 epochs);
* GPT-2 small (124M parameters): ``CONFIG_MAPPING["gpt2"]`` gives a GPT-2 of 2 layers of 32 dimensions and 2
  heads, its vocabulary the sample text's, 256 positions;
* ``torch.cuda.Event`` (it times the training with CUDA events) is a clock that needs no GPU;
* FSDP1's ``CPUOffload(offload_params=True)`` fails on CPU ranks (it pins each flat parameter's shard, which
  needs an accelerator, and its backward ends by synchronizing the device's stream, which a CPU stream cannot):
  on a machine without CUDA the reference run's ``FSDP(...)`` gets ``cpu_offload=None``, which on the CPU, where
  the parameters already live, is the same computation (the migrated run's bridge offloads nothing on the CPU
  either, and says so; under ``--target torch`` the rewrite's ``CPUOffloadPolicy(pin_memory=True)``, which pins
  too, is ``OffloadPolicy()`` here, nothing offloaded);
* the sampler shuffles its windows with NumPy's global generator, which ``verify`` does not seed: seeded here;
* its ``setup`` sets ``MASTER_PORT`` to 12355 and passes the rank and world size, as ``mp.spawn``'s children need:
  under ``torchrun``, whose agent's store is on another port, rank 0 would wait there for a store that its
  ``TORCHELASTIC_USE_AGENT_STORE`` tells it not to start, so that variable is removed and rank 0 starts the store.

The example's learning rate (1.0, as it has it: the tutorial it follows used Adadelta) is kept; float32
throughout, so the two runs can agree bit for bit. They do not, as ``verify`` shows (DIVERGED from the second
loss): GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight``, and FSDP1's size-based policy (100
parameters) makes each of the two modules a unit of its own, each flattening its own copy of the tied weight,
so from the first step FSDP1 trains two copies; the migrated wrap keeps the tie (one unit holds both). With
``LANCEGPT2_UNTIE=1`` the GPT-2 here is built untied (``tie_word_embeddings=False``) in both runs, and the two
runs agree bit for bit.
"""

from __future__ import annotations

import os
import sys
import time
from types import ModuleType, SimpleNamespace

import numpy as np
import torch
import transformers
from _common import sample_words
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import OffloadPolicy

WORDS = sample_words()
VOCAB = {w: i for i, w in enumerate(sorted(set(WORDS)))}
ROWS = 16640


class _Rows:
    def __init__(self, rows: list[dict[str, int]]) -> None:
        self.rows = rows

    def to_pylist(self) -> list[dict[str, int]]:
        return self.rows


class _Dataset:
    """What the example uses of a Lance dataset of token ids: ``count_rows`` and ``take``."""

    def count_rows(self) -> int:
        return ROWS

    def take(self, indices: object) -> _Rows:
        return _Rows([{"input_ids": VOCAB[WORDS[int(i) % len(WORDS)]]} for i in indices])  # type: ignore[attr-defined]


class _Event:
    """``torch.cuda.Event(enable_timing=True)`` without a GPU: ``record`` and ``elapsed_time`` in ms."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.at = 0.0

    def record(self, *args: object) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: _Event) -> float:
        return (end.at - self.at) * 1000.0


def _small_gpt2() -> transformers.GPT2Config:
    untie = os.environ.get("LANCEGPT2_UNTIE") == "1"
    return transformers.GPT2Config(
        vocab_size=len(VOCAB), n_positions=256, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=not untie
    )


def main() -> None:
    lance = ModuleType("lance")
    lance.dataset = lambda path: _Dataset()  # type: ignore[attr-defined]
    sys.modules["lance"] = lance
    transformers.CONFIG_MAPPING.register("gpt2", _small_gpt2, exist_ok=True)
    if not torch.cuda.is_available():
        torch.cuda.Event = _Event  # type: ignore[assignment,misc]
        fsdp1_init = FSDP.__init__

        def without_offload(self: FSDP, *args: object, **kwargs: object) -> None:
            kwargs["cpu_offload"] = None
            fsdp1_init(self, *args, **kwargs)

        FSDP.__init__ = without_offload  # type: ignore[method-assign]
        torch.distributed.fsdp.CPUOffloadPolicy = lambda *args, **kwargs: OffloadPolicy()  # type: ignore[misc]
    np.random.seed(0)
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    import utils

    args = SimpleNamespace(
        batch_size=16, test_batch_size=1000, epochs=2, lr=1.0, gamma=0.7, no_cuda=False, seed=1, save_model=True
    )
    torch.manual_seed(args.seed)
    utils.fsdp_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()
