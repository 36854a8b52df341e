"""The tokenizer of a training job: the model directory's, a given one, or a built-in BPE.

The built-in tokenizer is a byte-level BPE (``tokenizers``) trained at run time on the
training text, so the default job needs no download.  Rank 0 trains and saves it into
the output directory; the other ranks load that copy, so every rank uses the same
vocabulary.  On resume the saved copy is reused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.train._config import TrainConfig

__all__ = ["EOS", "load_tokenizer"]

EOS = "<|endoftext|>"
_SAVED = "tokenizer.json"


def _train_builtin(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=None, model_max_length=1 << 30
    )


def load_tokenizer(config: TrainConfig, texts: list[str], output_dir: Path) -> Any:
    """The tokenizer for ``config`` (collective when the built-in one is trained)."""
    from transformers import AutoTokenizer

    source = config.model.tokenizer or config.model.path
    if source is not None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as err:
            key = "model.tokenizer" if config.model.tokenizer else "model.path"
            raise ConfigError(
                [
                    Problem(
                        key,
                        source,
                        "a directory with tokenizer files (tokenizer.json, ...)",
                        f"{err}".splitlines()[0] if str(err) else "",
                    )
                ]
            ) from None
    else:
        saved = output_dir / "tokenizer"
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0 and not (saved / _SAVED).exists():
            _train_builtin(texts, config.model.tokenizer_vocab_size).save_pretrained(saved)
        if dist.is_initialized():
            dist.barrier()
        tokenizer = AutoTokenizer.from_pretrained(saved)
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            [
                Problem(
                    "model.tokenizer",
                    source,
                    "a tokenizer with an EOS token",
                    "documents are joined with EOS when packed; set eos_token in its config",
                )
            ]
        )
    return tokenizer
