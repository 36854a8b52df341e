"""Drives the FSDP1 trainer of ahxt/mini-llm-pretraining (``train_fsdp.py`` at f9a4d34) on CPU ranks, with no
download.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the checkout and once in the copy that
``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/minillm.py

The trainer builds its own ``LlamaForCausalLM`` (``modeling_llama.py``: HF's Llama cut down, loss in the
forward) from ``AutoConfig.from_pretrained(--model_name)`` in bf16 (``_from_config(torch_dtype=bfloat16)``,
seeded alike on every rank by ``transformers.set_seed``), compiles it (``torch.compile``), then wraps it in
one ``FSDP(model, **fsdp_config)``: ``FULL_SHARD``, ``MixedPrecision`` in bf16 (parameters, reduction,
buffers), ``use_orig_params=True``, ``device_id=torch.cuda.current_device()`` and a
``transformer_auto_wrap_policy`` over ``transformers``' ``LlamaDecoderLayer``, not the class its model is
made of, so that no block becomes a unit of its own: the root is the only one, as in the trainer. It builds a
fused AdamW, accumulates gradients under ``model.no_sync()``, clips with ``model.clip_grad_norm_``, steps a
cosine schedule, evaluates, and saves the model as a full state dict under ``FSDP.state_dict_type(...,
FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True))`` through ``save_pretrained``
(``model.safetensors``, which ``verify`` compares) with the tokenizer. This driver runs its
``train_fsdp.py`` as ``__main__`` with its own command line: sequences of 32 tokens, 2 per rank and micro
step, 2 micro steps per optimizer step (the first under ``no_sync``), 3 optimizer steps (``--max_steps``;
the trainer's loop makes one more ``no_sync`` backward before it stops: 7 losses per rank), a 2-step
warmup to a learning rate of 1e-3, weight decay 0.1, an evaluation of the validation split before training
and at step 2, checkpoints at step 2 and at the end (``outputs/<model name>/<run id>/step_2`` and
``step_final``), ``sdpa`` attention (the default, FlashAttention 3, is a GPU kernel). What the trainer reads
from elsewhere is made here:

* the config of ``meta-llama/Llama-3.2-1B`` and its tokenizer (hub downloads, ``AutoConfig`` and
  ``AutoTokenizer.from_pretrained``) are a miniature of that config (2 layers of 32 dimensions, 4 heads and 2
  key/value heads, llama3 RoPE scaling, tied embeddings) and a word-level tokenizer of the sample text
  shipped in ``fsdp_bridge/data``, answered for the name the driver passes (``--model_name``,
  ``--tokenizer_name``); its vocabulary is the model's, so ``resize_token_embeddings`` changes nothing;
* its FineWeb-Edu caches (``datasets.load_from_disk``, rows of ``input_ids``: 33 tokens, input and shifted
  target) are passages of that text: 32 training rows, 8 validation rows (``datasets`` is a stub when not
  installed); ``wandb`` (rank 0 logs to it) is a stub when not installed;
* its model class spells its tied weights as transformers 4 did (``_tied_weights_keys = ["lm_head.weight"]``);
  transformers 5 reads a mapping, and the same tie is given in that spelling
  (``{"lm_head.weight": "embed_tokens.weight"}``);
* the run's id (``uuid.uuid4().hex[:8]``, a folder of the output path) is the same in both runs, so that
  ``verify`` finds the two runs' checkpoints at the same path;
* ``torch.compile(model)`` returns the model itself. Under ``verify``'s CPU shims it runs
  (``MINILLM_KEEP_COMPILE=1`` keeps it): the losses then agree within bf16 tolerance (some a bf16 step
  apart: the compiled graphs of FSDP1's flat parameters and FSDP2's differ), and the saved files differ by
  name: FSDP1's state dict of the compiled module names each key ``_orig_mod.x``, the migrated
  ``get_model_state_dict`` ``x`` (the report notes it at the ``torch.compile`` line). Compiled or not, the
  computation is the same model's;
* its checkpoints take the full state dict with ``offload_to_cpu=True``: with the shards on the CPU, FSDP1's
  ``FlatParamHandle.to_cpu()`` "moves" the gathered flat parameter to where it already is (no copy) and then
  frees that storage, which the state dict's views still point to, and rank 0 dies of a segmentation fault
  while taking the state dict (pytorch/pytorch issue 188989, as in ``allamo.py``). Here
  ``FSDP.state_dict_type`` takes such a config without the offload, which means nothing on the CPU (only
  the FSDP1 run calls it; the migrated code takes the state dict with ``get_model_state_dict``);
  ``MINILLM_KEEP_OFFLOAD=1`` keeps it.

bf16 as the trainer has it (model, ``MixedPrecision``, losses): FSDP1 runs it on CPU gloo ranks, so the
losses are compared with bf16's tolerance (they agree bit for bit here).
"""

from __future__ import annotations

import os
import runpy
import sys
import uuid
from types import SimpleNamespace
from typing import Any

import torch
import transformers
from _common import full_state_dicts_without_offload, sample_words, stub_missing

NAME = "sample-text/tiny-llama-3.2"
"""What ``--model_name`` and ``--tokenizer_name`` name: the config and tokenizer made here."""
SEQUENCE_LENGTH = 32
TRAIN_DIR, VAL_DIR = "data/sample_text/train", "data/sample_text/validation"
SPECIALS = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]


def _unused(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("not part of this run")


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer of the sample text (the trainer's Llama 3 tokenizer is a hub download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate([*SPECIALS, *sorted(set(sample_words()))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token=SPECIALS[1], eos_token=SPECIALS[2]
    )


def _config(vocab_size: int) -> transformers.LlamaConfig:
    """Llama 3.2 1B's config in miniature: 2 layers of 32 dimensions, grouped-query attention (4 heads, 2
    key/value heads), llama3 RoPE scaling, tied embeddings."""
    return transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )


def _hub_is_here() -> None:
    """``AutoConfig`` and ``AutoTokenizer.from_pretrained(NAME)`` answer with what is made here."""
    vocab_size = len(_tokenizer())
    config_from_pretrained = transformers.AutoConfig.from_pretrained
    tokenizer_from_pretrained = transformers.AutoTokenizer.from_pretrained

    def auto_config(name: str, *args: Any, **kwargs: Any) -> Any:
        return _config(vocab_size) if name == NAME else config_from_pretrained(name, *args, **kwargs)

    def auto_tokenizer(name: str, *args: Any, model_max_length: int | None = None, **kwargs: Any) -> Any:
        if name != NAME:
            return tokenizer_from_pretrained(name, *args, model_max_length=model_max_length, **kwargs)
        made = _tokenizer()
        made.model_max_length = model_max_length or SEQUENCE_LENGTH
        made.padding_side = kwargs.get("padding_side", "right")
        return made

    transformers.AutoConfig.from_pretrained = auto_config  # type: ignore[method-assign]
    transformers.AutoTokenizer.from_pretrained = auto_tokenizer  # type: ignore[method-assign]


def _rows(tokenizer: transformers.PreTrainedTokenizerFast, start: int, count: int) -> list[dict[str, list[int]]]:
    """``count`` sequences of ``SEQUENCE_LENGTH + 1`` token ids (input and shifted target) from the sample
    text, the rows of the trainer's tokenized FineWeb cache."""
    ids = tokenizer(" ".join(sample_words()))["input_ids"]
    n = SEQUENCE_LENGTH + 1
    return [{"input_ids": ids[(start + i) * n : (start + i + 1) * n]} for i in range(count)]


def _datasets() -> None:
    tokenizer = _tokenizer()
    splits = {TRAIN_DIR: _rows(tokenizer, 0, 32), VAL_DIR: _rows(tokenizer, 32, 8)}

    def load_from_disk(path: str, *args: Any, **kwargs: Any) -> Any:
        return splits[path]

    stub_missing({"datasets": {"load_from_disk": _unused}})
    import datasets

    datasets.load_from_disk = load_from_disk  # type: ignore[attr-defined]


def _ties_of_its_time() -> None:
    """``_tied_weights_keys = ["lm_head.weight"]`` (transformers 4's list) in transformers 5's spelling."""
    import modeling_llama

    modeling_llama.LlamaForCausalLM._tied_weights_keys = {"lm_head.weight": "embed_tokens.weight"}


def _same_run_id() -> None:
    """The run's id (``uuid.uuid4().hex[:8]``, a folder of the output path) the same in both runs."""
    uuid4 = uuid.uuid4

    def fixed_for_the_trainer() -> uuid.UUID:
        if sys._getframe(1).f_globals.get("__name__") == "__main__":
            return uuid.UUID(int=0x5A5A)
        return uuid4()

    uuid.uuid4 = fixed_for_the_trainer  # type: ignore[assignment]


def _not_compiled() -> None:
    """``torch.compile(model)`` before wrapping returns the model itself (see the module docstring)."""
    torch.compile = lambda model=None, *args, **kwargs: model  # type: ignore[assignment]


def main() -> None:
    if os.environ.get("MINILLM_KEEP_OFFLOAD") != "1":
        full_state_dicts_without_offload()
    if os.environ.get("MINILLM_KEEP_COMPILE") != "1":
        _not_compiled()
    stub_missing({"wandb": {"init": lambda *a, **k: SimpleNamespace(), "log": lambda *a, **k: None}})
    _datasets()
    _hub_is_here()
    _ties_of_its_time()
    _same_run_id()
    sys.argv = [
        "train_fsdp.py",
        *("--model_name", NAME, "--tokenizer_name", NAME),
        *("--sequence_length", str(SEQUENCE_LENGTH), "--attn_impl", "sdpa"),
        *("--train_data_cache_dir", TRAIN_DIR, "--val_data_cache_dir", VAL_DIR, "--output_dir", "./outputs"),
        *("--micro_batch_size", "2", "--val_batch_size", "2", "--acc_steps", "2", "--max_steps", "3"),
        *("--val_steps", "2", "--save_steps", "2", "--warmup_steps", "2", "--lr", "1e-3", "--weight_decay", "0.1"),
    ]
    runpy.run_path("train_fsdp.py", run_name="__main__")


if __name__ == "__main__":
    main()
