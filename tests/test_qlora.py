"""QLoRA: LoRA on a bitsandbytes 4-bit base, sharded on both backends.

bitsandbytes 0.50 runs 4-bit weights on CPU, so the same check runs here on gloo (2 ranks) and
on a GPU (CUDA-marked, one rank): FSDP1 = FSDP2 = an unsharded QLoRA reference with averaged
gradients, the packed 4-bit base untouched by training, greedy generation equal to the
reference's, the adapter export loaded by ``PeftModel.from_pretrained`` onto a fresh 4-bit base
with the sharded model's logits, that adapter loaded back into a fresh sharded model, and
a sharded checkpoint (all but the frozen 4-bit weights) resumed on both backends, and full and
merged exports of a 4-bit model refused with the reason.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fsdp_bridge
from fsdp_bridge import Backend, BridgeConfig
from fsdp_bridge._lora import bitsandbytes_4bit_problem, keep_4bit_weights_in_place
from fsdp_bridge.testing import run_distributed
from fsdp_bridge.testing.models import build_tiny, sample_batch

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

STEPS = 3
PROMPT = [[5, 6, 7, 8]]


def _load_4bit(base_dir: str, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,  # FSDP shards a float storage, not uint8 codes
    )
    model = AutoModelForCausalLM.from_pretrained(
        base_dir, quantization_config=quant, dtype=torch.bfloat16, device_map={"": device}
    )
    keep_4bit_weights_in_place(model)  # the same kernels sharded or not (shard() does this itself)
    return model


def _qlora(base_dir: str, device: torch.device, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(_load_4bit(base_dir, device), config)


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


def _qlora_ranks(base_dir: str, out_dir: str, device_type: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    prompt = torch.tensor(PROMPT, device=device)
    out: dict[str, Any] = {}
    try:  # FSDP1 keeps bitsandbytes' swapped weights only when it reshards after forward over 2+ ranks
        fsdp_bridge.shard(_qlora(base_dir, device), BridgeConfig(backend="fsdp1", strategy="shard_grad_op"))
        out["fsdp1 shard_grad_op"] = "accepted"
    except fsdp_bridge.ConfigError as err:
        out["fsdp1 shard_grad_op"] = str(err)
    # One rank: FSDP1 runs NO_SHARD whatever it is asked, and is refused the same way.
    backends = list(Backend) if world > 1 else [Backend.FSDP2]
    for backend in backends:
        name = backend.value
        reference = _qlora(base_dir, device)
        reference.eval()  # no dropout anywhere; generation below in the same mode
        ref_tokens = reference.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
        sharded = fsdp_bridge.shard(_qlora(base_dir, device), BridgeConfig(backend=backend, device=device_type))
        sharded.eval()
        base_before = [_local(p) for p in sharded.parameters() if not p.requires_grad]
        opt = torch.optim.AdamW([p for p in sharded.parameters() if p.requires_grad], lr=1e-2)
        ref_params = [p for p in reference.parameters() if p.requires_grad]
        ref_opt = torch.optim.AdamW(ref_params, lr=1e-2)
        losses, ref_losses = [], []
        batch = {k: v.to(device) for k, v in sample_batch(batch=2, seq=8, seed=(42 + rank) * 1000).items()}
        for _ in range(STEPS):  # one batch per rank: the loss must fall
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
        out[f"{name} losses"] = (losses, ref_losses)
        base_after = [_local(p) for p in sharded.parameters() if not p.requires_grad]
        out[f"{name} base untouched"] = len(base_before) > 0 and all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(base_before, base_after, strict=True)
        )  # bytes: packed 4-bit codes seen as bf16 include NaN patterns
        optimizer_tensors = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        out[f"{name} optimizer state only for adapters"] = len(opt.state) == len(ref_opt.state) > 0
        out[f"{name} optimizer state dtype"] = sorted({str(v.dtype) for v in optimizer_tensors})
        with torch.no_grad():
            logits = sharded(input_ids=prompt).logits.float().cpu()
            ref_logits = reference(input_ids=prompt).logits.float().cpu()
        out[f"{name} logits vs reference"] = (logits - ref_logits).abs().max().item()
        out[f"{name} tokens"] = (
            sharded.generate(input_ids=prompt, max_new_tokens=4, do_sample=False).tolist(),
            reference.generate(input_ids=prompt, max_new_tokens=4, do_sample=False).tolist(),
            ref_tokens.tolist(),
        )
        adapter_dir = Path(out_dir) / f"{name}-adapter"
        fsdp_bridge.save_checkpoint(adapter_dir, sharded, kind="adapter")
        if rank == 0:  # the adapter in a plain process's way: a fresh 4-bit base + PeftModel.from_pretrained
            plain = peft.PeftModel.from_pretrained(_load_4bit(base_dir, device), str(adapter_dir)).eval()
            with torch.no_grad():
                plain_logits = plain(input_ids=prompt).logits.float().cpu()
            out[f"{name} adapter logits vs sharded"] = (plain_logits - logits).abs().max().item()
        # The adapter back into a fresh sharded QLoRA model on the other backend: the same logits.
        other = Backend.FSDP1 if backend is Backend.FSDP2 and world > 1 else Backend.FSDP2
        fresh = fsdp_bridge.shard(_qlora(base_dir, device), BridgeConfig(backend=other, device=device_type)).eval()
        fsdp_bridge.load_checkpoint(adapter_dir, fresh)
        with torch.no_grad():
            fresh_logits = fresh(input_ids=prompt).logits.float().cpu()
        out[f"{name} adapter into another model"] = (fresh_logits - logits).abs().max().item()
        # A sharded checkpoint (everything but the frozen 4-bit weights) resumed into a fresh QLoRA
        # model with other adapters, on the same backend and on the other: the next step agrees.
        sharded_path = Path(out_dir) / f"{name}-sharded"
        fsdp_bridge.save_checkpoint(sharded_path, sharded, opt, state={"step": STEPS})
        next_losses = []
        for target in (backend, other):
            resumed = fsdp_bridge.shard(
                _qlora(base_dir, device, seed=5), BridgeConfig(backend=target, device=device_type)
            )
            resumed_opt = torch.optim.AdamW([p for p in resumed.parameters() if p.requires_grad], lr=1e-2)
            state = fsdp_bridge.load_checkpoint(sharded_path, resumed, resumed_opt)
            loss = resumed(**batch).loss
            loss.backward()
            resumed_opt.step()
            resumed_opt.zero_grad()
            next_losses.append((state.get("step"), loss.item(), resumed(**batch).loss.item()))
            del resumed, resumed_opt
        loss = sharded(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out[f"{name} resumed"] = ((STEPS, loss.item(), sharded(**batch).loss.item()), next_losses)
        refusals = []
        for kind in ("full", "merged"):
            try:
                fsdp_bridge.save_checkpoint(Path(out_dir) / f"{name}-{kind}", sharded, opt, kind=kind)  # type: ignore[arg-type]
                refusals.append(f"{kind}: saved")
            except fsdp_bridge.CheckpointError as err:
                refusals.append(f"{kind}: {err}")
        out[f"{name} refusals"] = refusals
        del sharded, fresh, reference
    return out


def _check(out: dict[str, Any], *, atol: float, logits_atol: float) -> None:
    refused = out["fsdp1 shard_grad_op"]
    assert "backend: got 'fsdp1'" in refused and "use backend: fsdp2" in refused, refused
    for backend in [b for b in ("fsdp1", "fsdp2") if f"{b} losses" in out]:
        losses, ref_losses = out[f"{backend} losses"]
        # the same 4-bit kernels sharded or not; only the gradient averaging differs
        torch.testing.assert_close(losses, ref_losses, rtol=1.3e-6, atol=atol, msg=backend)
        assert losses[-1] < losses[0], (backend, losses)
        assert out[f"{backend} base untouched"], backend
        assert out[f"{backend} optimizer state only for adapters"], backend
        assert out[f"{backend} optimizer state dtype"] == ["torch.float32"], out  # fp32 adapters
        assert out[f"{backend} logits vs reference"] <= logits_atol, out
        tokens, ref_tokens, _ = out[f"{backend} tokens"]
        assert tokens == ref_tokens, (backend, tokens, ref_tokens)
        if f"{backend} adapter logits vs sharded" in out:
            assert out[f"{backend} adapter logits vs sharded"] <= logits_atol, out
        assert out[f"{backend} adapter into another model"] <= logits_atol, out
        original, (same, other) = out[f"{backend} resumed"]
        assert same == original, (backend, same, original)  # the same backend: bit for bit
        torch.testing.assert_close(other, original, rtol=1.3e-6, atol=atol, msg=backend)
        full, merged = out[f"{backend} refusals"]
        assert "4-bit (bitsandbytes) base" in full and "kind='sharded'" in full, full
        assert "kind='merged' of a model with a 4-bit (bitsandbytes) base" in merged, merged
    if "fsdp1 losses" in out:
        torch.testing.assert_close(out["fsdp1 losses"][0], out["fsdp2 losses"][0], rtol=1.3e-6, atol=atol)


def _base_dir(tmp_path: Path) -> str:
    base = build_tiny("llama", seed=0)
    base.save_pretrained(tmp_path / "base")
    return str(tmp_path / "base")


def test_qlora_on_cpu_matches_an_unsharded_reference_on_both_backends(tmp_path: Path) -> None:
    why = bitsandbytes_4bit_problem("cpu")
    if why is not None:
        pytest.skip(why)
    out = run_distributed(_qlora_ranks, 2, args=(_base_dir(tmp_path), str(tmp_path), "cpu"), timeout_s=300)
    for rank_out in out:
        assert "fsdp1 losses" in rank_out and "fsdp2 losses" in rank_out
        _check(rank_out, atol=1e-5, logits_atol=1e-5)  # measured: equal bit for bit


@pytest.mark.cuda
def test_qlora_on_cuda(tmp_path: Path) -> None:
    """One GPU: FSDP2 (FSDP1 on one rank is NO_SHARD, refused for 4-bit bases)."""
    (out,) = run_distributed(_qlora_ranks, 1, args=(_base_dir(tmp_path), str(tmp_path), "cuda"), backend="nccl")
    _check(out, atol=2e-2, logits_atol=0.1)  # bf16 CUDA kernels need not be deterministic


def test_a_4bit_base_is_refused_where_bitsandbytes_cannot_run_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a bitsandbytes that runs 4-bit on the device, shard() refuses the model, naming why."""
    from fsdp_bridge import _lora

    base = build_tiny("llama", seed=0)
    base.is_loaded_in_4bit = True  # what transformers sets on a bitsandbytes 4-bit model
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    monkeypatch.setattr(_lora, "bitsandbytes_4bit_problem", lambda device: "bitsandbytes 0.44.1 cannot run ...")
    (problem,) = _lora.quantization_problems(model, "cpu")
    text = str(fsdp_bridge.ConfigError([problem]))
    assert "model: got '4-bit quantized (bitsandbytes load_in_4bit)'" in text, text
    assert "bitsandbytes 0.44.1 cannot run" in text and "install bitsandbytes>=0.50" in text, text
    assert _lora.quantization_problems(model, "cuda") == []
    monkeypatch.undo()
    assert _lora.quantization_problems(build_tiny("llama", seed=0), "cpu") == []  # not 4-bit: nothing to say
