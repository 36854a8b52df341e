"""LoRA in `fsdp-bridge train`: the `peft:` section, examples/lora_tiny_llama.yaml through the CLI on
2 gloo ranks, the adapter loaded by peft, and 4-bit (QLoRA) bases refused on CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_bridge import ConfigError
from fsdp_bridge._lora import is_4bit, quantization_problems
from fsdp_bridge.train import load_train_config, preflight

peft = pytest.importorskip("peft")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lora_tiny_llama.yaml"


def test_lora_example_trains_through_the_cli_and_its_adapter_loads_in_peft(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_bridge", "train", str(EXAMPLE), f"output_dir={out}", "--nproc-per-node", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (
        "LlamaForCausalLM (0.14M parameters) + LoRA r=8 (7,168 trainable)" in proc.stderr
        and "2 ranks on cpu" in proc.stderr
    ), proc.stderr[-2000:]
    # Optimizer state: AdamW's two fp32 moments of rank 0's share of the 7,168 adapter elements, plus a
    # step scalar per adapter tensor; full fine-tuning would hold the moments of every local element.
    summary = json.loads((out / "summary.json").read_text())
    opt_bytes, full_bytes = summary["optimizer_bytes"], summary["full_finetune_optimizer_bytes"]
    assert 2 * 4 * 7168 / 2 <= opt_bytes < 2 * 4 * 7168 and opt_bytes < full_bytes / 10, summary
    assert f"optimizer state on rank 0: {opt_bytes / 2**10:,.1f} KiB; full fine-tuning" in proc.stdout, proc.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
    adapter = out / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert (
        saved["r"] == 8
        and saved["lora_alpha"] == 16
        and sorted(saved["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    )

    # The base is the run's own from-scratch model (same seed): rebuild it as the run did, load the adapter.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_bridge.train._loop import build_model

    config = load_train_config(EXAMPLE, [f"output_dir={out}"])
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    base = build_model(config, tokenizer)
    untrained = {k: v.clone() for k, v in base.state_dict().items()}
    adapted = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", attn_implementation="eager").eval()
    ids = tokenizer("Once there was a baker called Anna", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, m = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
        plain = adapted.get_base_model()
        with adapted.disable_adapter():
            b = plain(input_ids=ids).logits
    torch.testing.assert_close(a, m, rtol=1e-4, atol=1e-4)
    assert (a - b).abs().max() > 1e-4  # the adapters changed the model
    # Only the adapted projections differ in the merged model: the rest of the base stayed frozen.
    merged_state = merged.state_dict()
    changed = {k for k, v in untrained.items() if not torch.equal(merged_state[k], v)}
    assert changed and all(k.rsplit(".", 2)[-2] in {"q_proj", "k_proj", "v_proj", "o_proj"} for k in changed), changed


def test_peft_section_errors_name_the_value_what_is_allowed_and_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        load_train_config(
            EXAMPLE,
            [
                "peft.r=0",
                "peft.alpha=-1",
                "peft.dropout=1.5",
                "peft.rank=4",
                "peft.lora_alpha=8",
                "peft.target_modules=[]",
            ],
        )
    text = str(err.value)
    assert "6 problems" in text, text
    assert "peft.r: got 0; allowed: an integer >= 1" in text
    assert "peft.alpha: got -1.0; allowed: a finite number > 0" in text
    assert "peft.dropout: got 1.5; allowed: a number in [0, 1)" in text
    assert "peft.rank" in text and "did you mean 'peft.r'?" in text
    assert "did you mean 'peft.alpha'?" in text
    assert "peft.target_modules: got []" in text
    with pytest.raises(ConfigError, match=r"peft: got 3; allowed: a mapping of r, alpha, dropout"):
        load_train_config(EXAMPLE, ["peft=3"])
    with pytest.raises(ConfigError, match=r"peft.target_modules: got \[1, 2\]; allowed: a list of strings or null"):
        load_train_config(EXAMPLE, ["peft.target_modules=[1,2]"])
    assert load_train_config(EXAMPLE, ["peft="]).peft is None  # null: a full fine-tune
    config = load_train_config(EXAMPLE, ["peft.target_modules=all-linear"])
    assert config.peft is not None and config.peft.lora_config().target_modules == "all-linear"


def test_preflight_names_target_modules_that_match_nothing_and_4bit_bases_on_cpu(tmp_path: Path) -> None:
    config = load_train_config(EXAMPLE, [f"output_dir={tmp_path}", "peft.target_modules=[qproj]"])
    with pytest.raises(
        ConfigError,
        match=r"peft.target_modules: got \['qproj'\]; allowed: names of modules in "
        r"LlamaForCausalLM: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj",
    ):
        preflight(config, world_size=2, device_type="cpu")
    # The trainer refuses a 4-bit base on any device, when the config is read.
    with pytest.raises(ConfigError, match=r"model.config.quantization_config: .*fsdp-bridge train does not quantize"):
        load_train_config(
            EXAMPLE,
            [f"output_dir={tmp_path}", "bridge.device=auto", "model.config.quantization_config={load_in_4bit: true}"],
        )
    assert preflight(load_train_config(EXAMPLE, [f"output_dir={tmp_path}"]), world_size=2, device_type="cpu")


def test_peft_not_installed_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import fsdp_bridge._lora as lora

    monkeypatch.setattr(lora, "peft_available", lambda: False)
    with pytest.raises(ConfigError, match=r"peft: .*allowed: the peft package installed\. Fix: pip install peft"):
        load_train_config(EXAMPLE)


def test_4bit_bases_are_refused_by_the_trainer_naming_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"model.config.quantization_config: .*4-bit.*kind='adapter'"):
        load_train_config(
            EXAMPLE, ["model.config.quantization_config={load_in_4bit: true, quant_method: bitsandbytes}"]
        )
    from fsdp_bridge.testing.models import build_tiny

    model = build_tiny("llama", seed=0)
    assert not is_4bit(model) and quantization_problems(model, "cpu") == []
    model.is_loaded_in_4bit = True  # what transformers sets on a bitsandbytes 4-bit model
    import fsdp_bridge._lora as lora

    monkeypatch.setattr(lora, "bitsandbytes_4bit_problem", lambda device: "bitsandbytes 0.44 cannot run it")
    (problem,) = quantization_problems(model, "cpu")
    assert "install bitsandbytes>=0.50" in problem.fix and problem.key == "model"
    assert quantization_problems(model, "cuda") == []
    wrapped = peft.get_peft_model(build_tiny("llama", seed=0), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    wrapped.get_base_model().config.quantization_config = {"load_in_4bit": True}
    assert len(quantization_problems(wrapped, "cpu")) == 1  # found under the PEFT wrapper
