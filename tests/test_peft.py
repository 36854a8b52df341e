"""LoRA (peft) on both backends: parity with an unsharded PEFT reference, frozen base weights,
generation on the sharded model, adapter / merged exports loaded without fsdp_bridge, and a
sharded checkpoint of the run resumed on the other backend. Decoder-only (Llama), tied
embeddings (GPT-2) and encoder-decoder (T5)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fsdp_bridge
from fsdp_bridge import Backend, BridgeConfig
from fsdp_bridge.testing.models import build_tiny, sample_batch

peft = pytest.importorskip("peft")

FAMILIES = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"], "t5": ["q", "v"]}  # gpt2: tied; t5: enc-dec
NO_DROPOUT = {
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "t5": {"dropout_rate": 0.0},
}  # the same math in both runs
STEPS = 3
PROMPT = [[5, 6, 7, 8]]


def _lora(family: str, seed: int = 0) -> Any:
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=FAMILIES[family], init_lora_weights=False
    )  # non-zero B: adapters change outputs from step 0
    return peft.get_peft_model(build_tiny(family, seed=seed, **NO_DROPOUT.get(family, {})), config)


def _logits_inputs(family: str) -> dict[str, torch.Tensor]:
    prompt = torch.tensor(PROMPT)
    return {"input_ids": prompt, "decoder_input_ids": prompt} if family == "t5" else {"input_ids": prompt}


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _lora_ranks(out_dir: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, Any] = {}
    for family in FAMILIES:
        for backend in Backend:
            name = f"{family}/{backend.value}"
            reference = _lora(family)
            model = copy.deepcopy(reference)
            frozen = {k: v.clone() for k, v in reference.state_dict().items() if "lora_" not in k}
            ref_tokens = reference.generate(input_ids=torch.tensor(PROMPT), max_new_tokens=4, do_sample=False)
            sharded = fsdp_bridge.shard(model, BridgeConfig(strategy="full_shard", backend=backend, wrap="auto"))
            tokens_before = sharded.generate(input_ids=torch.tensor(PROMPT), max_new_tokens=4, do_sample=False)
            opt = torch.optim.AdamW([p for p in sharded.parameters() if p.requires_grad], lr=1e-2)
            ref_params = [p for p in reference.parameters() if p.requires_grad]
            ref_opt = torch.optim.AdamW(ref_params, lr=1e-2)
            losses, ref_losses = [], []
            for step in range(STEPS):
                batch = sample_batch(family, batch=2, seq=8, seed=(42 + rank) * 1000 + step)
                loss = sharded(**batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                ref_loss = reference(**batch).loss
                ref_loss.backward()
                for p in ref_params:  # the reference: gradients averaged over ranks
                    dist.all_reduce(p.grad)
                    p.grad /= world
                ref_opt.step()
                ref_opt.zero_grad()
                losses.append(loss.item())
                ref_losses.append(ref_loss.item())
            full = _full(sharded)
            torch.testing.assert_close(losses, ref_losses, rtol=1.3e-6, atol=1e-5, msg=name)
            assert all(torch.equal(full[k], v) for k, v in frozen.items()), f"{name}: a frozen weight changed"
            ref_state = reference.state_dict()
            for k, v in full.items():
                if "lora_" in k:
                    torch.testing.assert_close(v, ref_state[k], rtol=1.3e-6, atol=1e-5, msg=f"{name}: {k}")
            ref_after = reference.generate(input_ids=torch.tensor(PROMPT), max_new_tokens=4, do_sample=False)
            tokens_after = sharded.generate(input_ids=torch.tensor(PROMPT), max_new_tokens=4, do_sample=False)
            state_numel = sum(
                getattr(v, "_local_tensor", v).numel()
                for s in opt.state.values()
                for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0
            )  # this rank's shard
            fsdp_bridge.save_checkpoint(Path(out_dir) / f"{family}-{backend.value}-adapter", sharded, kind="adapter")
            fsdp_bridge.save_checkpoint(Path(out_dir) / f"{family}-{backend.value}-merged", sharded, kind="merged")
            # A sharded checkpoint of the PEFT run (adapters, frozen base, optimizer) resumed on the other
            # backend, into a model built from other weights: the same state, and the next step agrees.
            sharded_path = Path(out_dir) / f"{family}-{backend.value}-sharded"
            fsdp_bridge.save_checkpoint(sharded_path, sharded, opt, state={"step": STEPS})
            other = Backend.FSDP2 if backend is Backend.FSDP1 else Backend.FSDP1
            resumed = fsdp_bridge.shard(
                _lora(family, seed=5), BridgeConfig(strategy="full_shard", backend=other, wrap="auto")
            )
            resumed_opt = torch.optim.AdamW([p for p in resumed.parameters() if p.requires_grad], lr=1e-2)
            state = fsdp_bridge.load_checkpoint(sharded_path, resumed, resumed_opt)
            loaded = _full(resumed)
            # And on the same backend: the resumed run is the original one, bit for bit.
            same = fsdp_bridge.shard(
                _lora(family, seed=7), BridgeConfig(strategy="full_shard", backend=backend, wrap="auto")
            )
            same_opt = torch.optim.AdamW([p for p in same.parameters() if p.requires_grad], lr=1e-2)
            fsdp_bridge.load_checkpoint(sharded_path, same, same_opt)
            batch = sample_batch(family, batch=2, seq=8, seed=(42 + rank) * 1000 + STEPS)
            next_losses = []
            for m, o in ((sharded, opt), (resumed, resumed_opt), (same, same_opt)):
                loss = m(**batch).loss
                loss.backward()
                o.step()
                o.zero_grad()
                next_losses.append(loss.item())
            torch.testing.assert_close(next_losses[1], next_losses[0], rtol=1.3e-6, atol=1e-5, msg=name)
            assert next_losses[2] == next_losses[0], (name, next_losses)
            after_same, after_orig = _full(same), _full(sharded)
            assert all(torch.equal(after_same[k], v) for k, v in after_orig.items()), name
            assert state["step"] == STEPS and all(torch.equal(loaded[k], v) for k, v in full.items()), name
            # The adapter directory loaded into a fresh sharded PEFT model on the other backend: its
            # adapters become the trained ones, its own base stays.
            fresh = fsdp_bridge.shard(_lora(family, seed=6), BridgeConfig(backend=other, wrap="auto"))
            fresh_base = {k: v for k, v in _full(fresh).items() if "lora_" not in k}
            assert fsdp_bridge.load_checkpoint(Path(out_dir) / f"{family}-{backend.value}-adapter", fresh) == {}
            after = _full(fresh)
            assert all(torch.equal(after[k], v) for k, v in full.items() if "lora_" in k), name
            assert all(torch.equal(after[k], v) for k, v in fresh_base.items()), name
            if rank == 0:
                with torch.no_grad():
                    reference.eval()
                    logits = reference(**_logits_inputs(family)).logits
                torch.save(logits, Path(out_dir) / f"{family}-{backend.value}-logits.pt")
            total = torch.tensor([state_numel])
            dist.all_reduce(total)
            results[name] = {
                "tokens": [ref_tokens.tolist(), tokens_before.tolist(), ref_after.tolist(), tokens_after.tolist()],
                "trainable": sum(p.numel() for p in ref_params),
                "all": sum(p.numel() for p in reference.parameters()),
                "optimizer_numel": int(total),
            }
    # A frozen base stored in bf16 with fp32 adapters (peft upcasts them): one block then holds two
    # dtypes; FSDP1 gets the adapters as units of their own, FSDP2 takes it as it is.
    for backend in Backend:
        model = peft.get_peft_model(
            build_tiny("llama", seed=0).to(torch.bfloat16),
            peft.LoraConfig(r=4, lora_alpha=8, target_modules=FAMILIES["llama"], init_lora_weights=False),
        )
        frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
        adapters = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
        sharded = fsdp_bridge.shard(model, BridgeConfig(backend=backend, wrap="auto"))
        opt = torch.optim.AdamW([p for p in sharded.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for step in range(STEPS):
            loss = sharded(**sample_batch("llama", batch=2, seq=8, seed=(42 + rank) * 1000 + step)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        full = _full(sharded)
        results[f"bf16-base/{backend.value}"] = {
            "losses": losses,
            "dtypes": sorted({f"{'lora' if 'lora_' in k else 'base'}:{v.dtype}" for k, v in full.items()}),
            "frozen_same": all(torch.equal(full[k], v) for k, v in frozen.items()),
            "adapters_trained": all(not torch.equal(full[k], v) for k, v in adapters.items()),
            "notes": fsdp_bridge.get_bridge(sharded).wrap.notes,
        }
    return results


_PLAIN_LOAD = """
import json, sys
sys.modules["fsdp_bridge"] = None  # a plain process: fsdp_bridge cannot be imported
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

out, names = sys.argv[1], sys.argv[2:]
prompt = torch.tensor([[5, 6, 7, 8]])
diffs = {}
for name in names:  # FAMILY/BACKEND
    family, backend = name.split("/")
    expected = torch.load(f"{out}/{family}-{backend}-logits.pt")
    inputs = {"input_ids": prompt, "decoder_input_ids": prompt} if family == "t5" else {"input_ids": prompt}
    auto = AutoModelForSeq2SeqLM if family == "t5" else AutoModelForCausalLM
    base = auto.from_pretrained(f"{out}/{family}-base", attn_implementation="eager")
    adapted = PeftModel.from_pretrained(base, f"{out}/{family}-{backend}-adapter").eval()
    merged = auto.from_pretrained(f"{out}/{family}-{backend}-merged", attn_implementation="eager").eval()
    with torch.no_grad():
        a, m = adapted(**inputs).logits, merged(**inputs).logits
    diffs[name] = {"adapter": (a - expected).abs().max().item(), "merged": (m - expected).abs().max().item()}
print(json.dumps(diffs))
"""


def test_lora_trains_generates_and_exports_on_both_backends(tmp_path: Path, run_on_ranks) -> None:
    for family in FAMILIES:
        build_tiny(family, seed=0, **NO_DROPOUT.get(family, {})).save_pretrained(tmp_path / f"{family}-base")
    results = run_on_ranks(_lora_ranks, 2, str(tmp_path))[0]
    bf16 = {b: results.pop(f"bf16-base/{b}") for b in ("fsdp1", "fsdp2")}
    for r in bf16.values():
        assert r["dtypes"] == ["base:torch.bfloat16", "lora:torch.float32"] and r["frozen_same"], r
        assert r["adapters_trained"], r
    assert any("made units of their own (FSDP1 needs one dtype per unit)" in n for n in bf16["fsdp1"]["notes"])
    assert not any("one dtype per unit" in n for n in bf16["fsdp2"]["notes"])
    torch.testing.assert_close(bf16["fsdp1"]["losses"], bf16["fsdp2"]["losses"], rtol=1.6e-2, atol=1e-3)
    for name, r in results.items():
        ref_before, before, ref_after, after = r["tokens"]
        assert before == ref_before and after == ref_after, name  # greedy tokens equal the unsharded model's
        # Optimizer state exists for the adapters only: AdamW's two moments of each trainable parameter.
        assert r["optimizer_numel"] == 2 * r["trainable"] and r["trainable"] < r["all"] / 6, name
    # One plain process (no fsdp_bridge) loads every export: a fresh base + adapter, and the merged model.
    proc = subprocess.run(
        [sys.executable, "-c", _PLAIN_LOAD, str(tmp_path), *results],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    all_diffs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(all_diffs) == set(results)
    for name, diffs in all_diffs.items():
        family, backend = name.split("/")
        assert diffs["adapter"] <= 1e-5 and diffs["merged"] <= 1e-4, (name, diffs)
        assert json.loads((tmp_path / f"{family}-{backend}-adapter" / "adapter_config.json").read_text())["r"] == 4


def test_adapter_export_needs_adapters_and_load_pretrained_fills_a_peft_models_base(
    tmp_path: Path, run_on_ranks
) -> None:
    """One spawn: kind='adapter' of a model without adapters is refused; load_pretrained of a PEFT
    model built on the meta device reads its base from the base's directory in slices (names
    mapped through base_layer / modules_to_save) and initialises the adapters as peft does; LoRA on
    a mixture-of-experts model's expert parameters (FSDP2 only)."""
    for family in ("llama", "gpt2"):  # gpt2: tied embeddings
        build_tiny(family, seed=3).save_pretrained(tmp_path / family)
    for rank_out in run_on_ranks(_no_adapters_and_peft_base, 2, str(tmp_path)):
        assert "kind='adapter' needs a PEFT model" in rank_out["errors"]
        experts = rank_out.pop("experts")
        assert "fsdp2 for LoRA on parameters (peft's ParamWrapper)" in experts["fsdp1"], experts
        assert experts["wrapped"] >= 4 and experts["trains"], experts
        assert experts.get("adapter diff", 0.0) <= 1e-5, experts
        for name, checks in rank_out.items():
            if name != "errors":
                assert checks == {"base equal": True, "adapters equal": True, "trains": True}, (name, checks)


def _no_adapters_and_peft_base(out_dir: str) -> dict[str, Any]:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp_bridge._lora import base_weight_name, reset_adapters

    out: dict[str, Any] = {}
    model = fsdp_bridge.shard(build_tiny("llama", seed=0), BridgeConfig(backend="fsdp2"))
    try:
        fsdp_bridge.save_checkpoint(Path(out_dir) / "x", model, kind="adapter")
        out["errors"] = "no error"
    except fsdp_bridge.CheckpointError as err:
        out["errors"] = str(err)
    for family, save in (("llama", ["lm_head"]), ("gpt2", None)):
        directory = Path(out_dir) / family
        lora = peft.LoraConfig(r=4, target_modules=FAMILIES[family], modules_to_save=save)
        hf_config = AutoConfig.from_pretrained(directory)
        files = load_file(str(directory / "model.safetensors"))
        # The reference: the base read whole, then the adapters initialised from the same seed.
        reference = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), lora)
        torch.manual_seed(11)
        expected = reset_adapters(reference)
        for backend in Backend:
            torch.manual_seed(11)
            sharded = fsdp_bridge.load_pretrained(
                lambda: peft.get_peft_model(AutoModelForCausalLM.from_config(hf_config), lora),  # noqa: B023
                directory,
                BridgeConfig(backend=backend),
            )
            full = _full(sharded)
            base = {k: base_weight_name(k) for k in full}
            checks = {
                "base equal": all(torch.equal(v, files[base[k]]) for k, v in full.items() if base[k] in files),
                "adapters equal": all(torch.equal(full[k], v) for k, v in expected.items()),
            }
            opt = torch.optim.AdamW([p for p in sharded.parameters() if p.requires_grad], lr=1e-2)
            batch = sample_batch(family, batch=2, seq=8, seed=dist.get_rank())
            losses = []
            for _ in range(3):
                loss = sharded(**batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            checks["trains"] = losses[-1] < losses[0]
            out[f"{family}/{backend.value}"] = checks
    out["experts"] = _lora_on_expert_parameters(out_dir)
    return out


def _moe_lora() -> Any:
    """A tiny Mixtral with LoRA everywhere peft's "all-linear" reaches: the fused expert tensors and
    the router are parameters, which peft adapts through its ParamWrapper."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(build_tiny("mixtral"), lora)


def _lora_on_expert_parameters(out_dir: str) -> dict[str, Any]:
    """LoRA on a mixture-of-experts model's expert parameters: FSDP1 refuses it before any
    collective; FSDP2 trains it like the unsharded reference and its adapter export loads in peft."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    try:
        fsdp_bridge.shard(_moe_lora(), BridgeConfig(backend="fsdp1"))
        out["fsdp1"] = "no error"
    except fsdp_bridge.ConfigError as err:
        out["fsdp1"] = str(err)
    reference = _moe_lora()
    sharded = fsdp_bridge.shard(copy.deepcopy(reference), BridgeConfig(backend="fsdp2"))
    out["wrapped"] = sum(type(m).__name__ == "ParamWrapper" for m in reference.modules())
    opt = torch.optim.AdamW([p for p in sharded.parameters() if p.requires_grad], lr=1e-2)
    ref_params = [p for p in reference.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2)
    losses, ref_losses = [], []
    batch = sample_batch("llama", batch=2, seq=8, seed=42 + rank)  # one batch: the loss must fall
    for _ in range(STEPS):
        for model, optimizer, record in ((sharded, opt, losses), (reference, ref_opt, ref_losses)):
            loss = model(**batch).loss
            loss.backward()
            if model is reference:
                for p in ref_params:
                    dist.all_reduce(p.grad)
                    p.grad /= world
            optimizer.step()
            optimizer.zero_grad()
            record.append(loss.item())
    torch.testing.assert_close(losses, ref_losses, rtol=1.3e-6, atol=1e-5)
    path = Path(out_dir) / "experts-adapter"
    fsdp_bridge.save_checkpoint(path, sharded, kind="adapter")
    prompt = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = sharded.eval()(input_ids=prompt).logits
    if rank == 0:
        loaded = peft.PeftModel.from_pretrained(build_tiny("mixtral"), path).eval()
        with torch.no_grad():
            out["adapter diff"] = (loaded(input_ids=prompt).logits - logits).abs().max().item()
    out["trains"] = losses[-1] < losses[0]
    return out


def test_an_adapter_that_does_not_fit_is_refused_naming_keys(tmp_path: Path) -> None:
    """Loading a PEFT adapter directory needs a PEFT model with the same adapters: a plain model
    and adapters on other modules are refused before anything is copied."""
    from fsdp_bridge.checkpoint import CheckpointError

    _lora("llama").save_pretrained(tmp_path / "adapter")
    with pytest.raises(CheckpointError, match="load it into a PEFT model"):
        fsdp_bridge.load_checkpoint(tmp_path / "adapter", build_tiny("llama", seed=0))
    other = peft.get_peft_model(build_tiny("llama", seed=0), peft.LoraConfig(r=4, target_modules=["k_proj"]))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"q_proj\.lora_A\.weight: no such adapter parameter"):
        fsdp_bridge.load_checkpoint(tmp_path / "adapter", other)
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in before.items())
