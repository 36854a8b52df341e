"""Drives the FSDP1 GPT-2 trainer of ARJ8102/llm_train (``scripts/train_fsdp.py`` at 245656a) on CPU ranks, with no
download.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the repository and once in the copy that
``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/llmtrain.py

The trainer (which falls back to gloo and the CPU by itself) loads GPT-2 with ``from_pretrained``, wraps it in
``FSDP(model)`` (one unit), trains it with AdamW behind a disabled ``GradScaler`` on wikitext cut into blocks of
128 tokens, and after each epoch takes the full state dict inside ``FSDP.state_dict_type(FULL_STATE_DICT,
FullStateDictConfig(offload_to_cpu=True, rank0_only=True))``, loads it on rank 0 into a fresh ``from_pretrained``
copy (``strict=True``: the tied head's key included) and writes it with ``save_pretrained`` to
``checkpoints/fsdp/epoch-N``, whose ``model.safetensors`` ``verify`` compares. This driver calls its ``main()``
with two epochs of four steps (``MAX_STEPS_PER_EPOCH = 3``). What it reads from a hub is made here, the same in
both runs:

* ``gpt2`` is a 2-layer GPT-2 built from a config and saved to a temporary directory, its tokenizer a byte-level
  BPE trained on the sample text shipped in ``fsdp_bridge/data``;
* ``datasets`` (not installed here) is a stub whose ``load_dataset`` gives that text as a ``train`` split of
  lines, with the ``map(..., batched=True, remove_columns=...)`` the trainer calls (one batch: the whole split);
* FSDP1's full state dict is taken without its CPU offload, which on the CPU frees the storage its views point to
  (``_common.full_state_dicts_without_offload``; FSDP1's run only).

Float32 throughout, so the two runs can agree bit for bit.
"""

from __future__ import annotations

import tempfile
from typing import Any

from _common import full_state_dicts_without_offload, load_trainer, sample_sentences, save_tiny_gpt2, stub_missing


class _Split:
    """A split of a ``datasets`` dataset: named columns of equal length."""

    def __init__(self, columns: dict[str, list[Any]]) -> None:
        self.columns = columns

    def map(self, fn: Any, batched: bool = False, remove_columns: list[str] | None = None) -> _Split:
        assert batched, "the trainer maps in batches"
        kept = {k: v for k, v in self.columns.items() if k not in (remove_columns or [])}
        return _Split({**kept, **fn(dict(self.columns))})

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {k: v[index] for k, v in self.columns.items()}


class _Splits(dict):  # type: ignore[type-arg]
    def map(self, fn: Any, **kwargs: Any) -> _Splits:
        return _Splits({name: split.map(fn, **kwargs) for name, split in self.items()})


def _load_dataset(name: str, subset: str | None = None, **_: object) -> _Splits:
    return _Splits(train=_Split({"text": [" " + s for s in sample_sentences()[:400]]}))


def main() -> None:
    stub_missing({"datasets": {"load_dataset": _load_dataset}})
    pretrained = tempfile.mkdtemp(prefix="llmtrain-gpt2-")
    save_tiny_gpt2(pretrained)
    trainer = load_trainer("scripts/train_fsdp.py", "llmtrain_fsdp_trainer")
    if hasattr(trainer, "FSDP"):  # the FSDP1 run
        full_state_dicts_without_offload()
    trainer.MODEL_NAME = pretrained
    trainer.MAX_STEPS_PER_EPOCH = 3
    trainer.EPOCHS = 2
    trainer.main()


if __name__ == "__main__":
    main()
