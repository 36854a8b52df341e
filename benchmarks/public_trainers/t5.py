"""Drives the FSDP T5 example of pytorch/examples (``distributed/FSDP``) on CPU ranks, with no download.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the example's own directory and once in
the copy that ``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout>/distributed/FSDP -- benchmarks/public_trainers/t5.py

The example (at 8c1555d, before it moved to FSDP2) is a multi-file project: ``T5_training.py`` takes
its wrap policy and mixed precision from the ``policies`` package, its strategy and checkpoint type
from ``configs`` dataclasses, its train and validation loops from ``utils``, and saves with the
``model_checkpointing`` helpers (a full state dict under ``FSDP.state_dict_type`` and
``FSDP.full_optim_state_dict``, ``torch.save`` on rank 0). This driver calls its ``fsdp_main`` on every
rank with the example's own defaults, except that a checkpoint is saved (``train_config.save_model``,
``fsdp_config.save_optimizer``; the example's config names no folder or file names for it, so they
are given here). What the example reads from a hub is made here:

* ``T5ForConditionalGeneration.from_pretrained`` reads a 2-layer T5 built from a config and saved to a
  temporary directory, ``T5Tokenizer.from_pretrained`` a small unigram vocabulary of the sample text
  shipped in ``fsdp_bridge/data``;
* the WikiHow articles (``nlp.load_dataset('wikihow', ...)``, a manual download) are 40 passages of
  that text with a short headline each;
* modules it imports and this run does not use are stubs when they are not installed (``nlp``,
  pandas, ``pkg_resources``); for transformers 5, ``transformers.AdamW`` (imported, unused) is torch's
  and the tokenizer's ``batch_encode_plus`` (used by its dataset) calls the tokenizer, as it did.

On a machine without CUDA the example chooses fp32 itself (its bf16 check needs CUDA and NCCL), so the
two runs can agree bit for bit.
"""

from __future__ import annotations

import collections
import sys
import tempfile
from types import SimpleNamespace

import torch
import transformers
from _common import sample_words, stub_missing

WORDS = sample_words()


class _Rows:
    """What the example uses of an ``nlp`` dataset split: ``shape``, ``select`` and rows by index."""

    def __init__(self, rows: list[dict[str, str]]) -> None:
        self.rows = rows
        self.shape = (len(rows), 2)

    def select(self, indices: list[int]) -> _Rows:
        return _Rows([self.rows[i] for i in indices if i < len(self.rows)])

    def __getitem__(self, index: int) -> dict[str, str]:
        return self.rows[index]


def _articles(split: str) -> _Rows:
    start, count = (0, 32) if split == "train" else (4000, 8)
    rows = []
    for i in range(start, start + count * 50, 50):
        rows.append({"text": " ".join(WORDS[i : i + 40]), "headline": " ".join(WORDS[i + 40 : i + 48])})
    return _Rows(rows)


def _load_dataset(name: str, *args: object, split: str | None = None, **kwargs: object) -> object:
    if split is None:
        return {"train": _articles("train"), "validation": _articles("validation")}
    return _articles(split)


def _stub_missing_modules() -> None:
    import packaging.version

    stubs = {
        "nlp": {"load_dataset": _load_dataset},
        "pandas": {},
        "pkg_resources": {"packaging": SimpleNamespace(version=packaging.version)},
    }
    stub_missing(stubs)
    # The example's `import transformers.models.t5.modeling_t5` puts a new lazy `transformers` module in
    # sys.modules: import it first, then give that module the name.
    import transformers.models.t5.modeling_t5  # noqa: F401

    try:
        from transformers import AdamW  # noqa: F401
    except ImportError:
        sys.modules["transformers"].AdamW = torch.optim.AdamW  # type: ignore[attr-defined]
    tokenizer_class = sys.modules["transformers"].T5Tokenizer
    if not hasattr(tokenizer_class, "batch_encode_plus"):  # gone in transformers 5: calling it does the same
        tokenizer_class.batch_encode_plus = tokenizer_class.__call__


def _pretrained(directory: str) -> None:
    """A T5 and its tokenizer saved where ``from_pretrained`` reads them (the same on every rank)."""
    common = [w for w, _ in collections.Counter(WORDS).most_common(300)]
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -float(i + 1)) for i, w in enumerate(common)]
    pieces += [(c, -1000.0) for c in sorted(set("".join(WORDS)))]
    tokenizer = transformers.T5Tokenizer(vocab=pieces, extra_ids=0)
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=len(tokenizer),
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    transformers.T5ForConditionalGeneration(config).save_pretrained(directory)


def main() -> None:
    pretrained = tempfile.mkdtemp(prefix="t5-pretrained-")
    _pretrained(pretrained)
    _stub_missing_modules()
    import T5_training
    from configs import fsdp_config, train_config

    train_config.model_name = pretrained
    train_config.save_model = True
    fsdp_config.save_optimizer = True
    fsdp_config.checkpoint_folder = "checkpoints"
    fsdp_config.model_save_name = "t5"
    fsdp_config.optimizer_name = "optimizer"
    fsdp_config.verbose = False
    args = SimpleNamespace(batch_size=4, test_batch_size=4, epochs=2, seed=1, track_memory=False, run_validation=True)
    torch.manual_seed(args.seed)
    T5_training.fsdp_main(args)


if __name__ == "__main__":
    main()
