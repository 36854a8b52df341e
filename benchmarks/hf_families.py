"""Hugging Face families the test suite does not build, through both backends at 2 gloo ranks.

    OMP_NUM_THREADS=1 python benchmarks/hf_families.py              # every family below (~10 min)
    OMP_NUM_THREADS=1 python benchmarks/hf_families.py qwen3_moe jamba

Per family (a tiny config built offline, eager attention): FSDP1 and FSDP2 with FULL_SHARD against
an unsharded reference with averaged gradients over 3 steps (``assert_backend_parity``: fp32
tolerances), then on each backend a ``kind="full"`` export loaded back with ``from_pretrained``
(every tensor equal to the model's initial weights) and greedy ``generate`` on the sharded model
equal to the unsharded model's tokens. Prints one line per family and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fsdp_bridge
from fsdp_bridge import BridgeConfig
from fsdp_bridge.testing import run_distributed
from fsdp_bridge.testing.models import DECODER_SIZES, VOCAB
from fsdp_bridge.testing.parity import assert_backend_parity

_MOE = dict(num_experts=4, num_experts_per_tok=2)
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_moe": dict(
        DECODER_SIZES, **_MOE, moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[]
    ),
    "qwen3": dict(DECODER_SIZES, head_dim=8),
    "qwen3_moe": dict(DECODER_SIZES, **_MOE, head_dim=8, moe_intermediate_size=32, mlp_only_layers=[]),
    "olmoe": dict(DECODER_SIZES, **_MOE),
    "deepseek_v3": dict(
        DECODER_SIZES,
        num_key_value_heads=4,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
    ),
    "jamba": dict(
        DECODER_SIZES,
        num_experts=2,
        num_experts_per_tok=1,
        expert_layer_period=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        mamba_d_state=8,
        mamba_expand=2,
        use_mamba_kernels=False,
    ),
    "mamba": dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8),
    "gemma2": dict(DECODER_SIZES, head_dim=8, sliding_window=8),
    "gemma3_text": dict(DECODER_SIZES, head_dim=8, sliding_window=8),
    "olmo2": dict(DECODER_SIZES),
    "granite": dict(DECODER_SIZES),
    "starcoder2": dict(DECODER_SIZES),
    "stablelm": dict(DECODER_SIZES),
    "cohere": dict(DECODER_SIZES),
    "nemotron": dict(DECODER_SIZES, head_dim=8),
    "phi": dict(DECODER_SIZES, num_key_value_heads=4),
    "falcon": dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True),
    "bloom": dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4),
    "gptj": dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4),
    "gpt_bigcode": dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "bart": dict(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    ),
}
SEQ2SEQ = {"bart"}


def build(family: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config = AutoConfig.for_model(family, **CONFIGS[family])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    auto = AutoModelForSeq2SeqLM if family in SEQ2SEQ else AutoModelForCausalLM
    return auto.from_config(config)


def batches(family: str, rank: int, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed((42 + rank) * 1000 + step)
        ids = torch.randint(4, VOCAB, (2, 16), generator=g)
        labels = torch.randint(4, VOCAB, (2, 8), generator=g) if family in SEQ2SEQ else ids.clone()
        out.append({"input_ids": ids, "labels": labels})
    return out


def check(family: str, out_dir: str) -> list[str]:
    """On every rank: the checks of one family; returns one verdict per check."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    verdicts = []
    try:
        assert_backend_parity(lambda: build(family), batches(family, dist.get_rank()), BridgeConfig())
        verdicts.append("parity ok")
    except Exception as err:  # reported; the sweep goes on
        verdicts.append(f"parity FAILED ({type(err).__name__}: {str(err)[:300]})")
    auto = AutoModelForSeq2SeqLM if family in SEQ2SEQ else AutoModelForCausalLM
    prompt = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    for backend in ("fsdp1", "fsdp2"):
        try:
            reference = build(family).eval()
            model = fsdp_bridge.shard(build(family), BridgeConfig(backend=backend)).eval()
            path = Path(out_dir) / f"{family}-{backend}"
            fsdp_bridge.save_checkpoint(path, model, kind="full")
            dist.barrier()
            loaded = auto.from_pretrained(path).state_dict()
            differ = [k for k, v in reference.state_dict().items() if k not in loaded or not torch.equal(v, loaded[k])]
            with torch.no_grad():
                same = torch.equal(
                    model.generate(prompt, max_new_tokens=5, do_sample=False),
                    reference.generate(prompt, max_new_tokens=5, do_sample=False),
                )
            export = "export ok" if not differ else f"export FAILED ({differ[:3]})"
            verdicts.append(f"{backend}: {export}, generate {'ok' if same else 'FAILED'}")
        except Exception as err:  # reported; the sweep goes on
            verdicts.append(f"{backend}: FAILED ({type(err).__name__}: {str(err)[:300]})")
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", default=list(CONFIGS), help=f"default: {' '.join(CONFIGS)}")
    args = parser.parse_args(argv)
    failed = 0
    for family in args.families:
        if family not in CONFIGS:
            parser.error(f"unknown family {family!r}; known: {', '.join(CONFIGS)}")
        with tempfile.TemporaryDirectory() as tmp:
            verdicts = run_distributed(check, world_size=2, args=(family, tmp), timeout_s=600)[0]
        failed += any("FAILED" in v for v in verdicts)
        print(f"{family:12} {'; '.join(verdicts)}", flush=True)
    print(f"{len(args.families) - failed} of {len(args.families)} families passed every check")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
