"""Tiny Hugging Face models built offline from small configs (no download).

``build_tiny(family, seed=0)`` returns a freshly initialised model; the same seed
gives identical weights in every process.  ``sample_batch`` makes matching inputs.

Used by compare jobs; :mod:`fsdp_bridge.testing.models` re-exports it for tests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["DECODER_SIZES", "FAMILIES", "build_tiny", "sample_batch", "tiny_config"]

VOCAB = 96
FAMILIES: tuple[str, ...] = ("llama", "qwen2", "mistral", "mixtral", "gpt2", "opt", "gemma", "bert", "t5")

DECODER_SIZES: dict[str, int] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
"""The sizes of the tiny decoder-only families (Llama-shaped configs)."""


def tiny_config(family: str, **overrides: Any) -> Any:
    """A transformers config of ``family`` small enough for a CPU test."""
    from transformers import AutoConfig

    sizes: dict[str, dict[str, Any]] = {
        "llama": dict(DECODER_SIZES, tie_word_embeddings=False),
        "qwen2": dict(DECODER_SIZES),
        "mistral": dict(DECODER_SIZES, sliding_window=None),
        # mixture of experts: fused expert tensors (3-D parameters) and a router
        "mixtral": dict(DECODER_SIZES, sliding_window=None, num_local_experts=4, num_experts_per_tok=2),
        "gemma": dict(DECODER_SIZES, head_dim=8),
        "gpt2": dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64),
        "opt": dict(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
        ),
        "bert": dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),
        "t5": dict(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
        ),
    }
    if family not in sizes:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    kwargs = {**sizes[family], **overrides}
    return AutoConfig.for_model(family, **kwargs)


def build_tiny(
    family: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> nn.Module:
    """A tiny, randomly initialised model of ``family`` (same seed -> same weights)."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

    config = tiny_config(family, **overrides)
    # Eager attention: deterministic and the same kernels on every backend.
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    if family == "bert":
        model = AutoModelForMaskedLM.from_config(config)
    elif family == "t5":
        model = AutoModelForSeq2SeqLM.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype)


def sample_batch(family: str = "llama", *, batch: int = 2, seq: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random token inputs with labels for ``family``'s training loss."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (batch, seq), generator=g)
    if family == "t5":
        return {"input_ids": ids, "labels": torch.randint(4, VOCAB, (batch, seq // 2), generator=g)}
    if family == "bert":
        labels = torch.full_like(ids, -100)
        mask = torch.rand(ids.shape, generator=g) < 0.3
        mask[:, 0] = True
        labels[mask] = ids[mask]
        masked = ids.clone()
        masked[mask] = 3
        return {"input_ids": masked, "labels": labels}
    return {"input_ids": ids, "labels": ids.clone()}
