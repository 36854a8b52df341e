"""Checkpoint formats: Hugging Face export, pretrained loading, plain-PyTorch FSDP1 inputs,
the convert/inspect CLI, crash safety and the errors for bad checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import fsdp_bridge
from fsdp_bridge.checkpoint import CheckpointError
from fsdp_bridge.cli import main as cli
from fsdp_bridge.testing import RankFailure, run_distributed
from fsdp_bridge.testing.damage import describe
from fsdp_bridge.testing.models import build_tiny, sample_batch

IDS = torch.arange(4, 20).reshape(2, 8)


def _logits(model: torch.nn.Module) -> Any:
    model.eval()
    with torch.no_grad():
        # NumPy: tensors returned from a rank would live in shared memory freed at its exit.
        return model(input_ids=IDS).logits.numpy().copy()


def _config(backend: str) -> fsdp_bridge.BridgeConfig:
    return fsdp_bridge.BridgeConfig(backend=backend, wrap="auto", device="cpu")


# --------------------------------------------------------------------------------------
# Hugging Face export and pretrained loading
# --------------------------------------------------------------------------------------

CASES = (("gpt2", "fsdp2"), ("gpt2", "fsdp1"), ("llama", "fsdp1"), ("llama", "fsdp2"))


def _export_and_pretrained(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for family, backend in CASES:
        model = fsdp_bridge.shard(build_tiny(family, seed=1), _config(backend))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(**sample_batch(family, seed=dist.get_rank())).loss.backward()
        optimizer.step()
        fsdp_bridge.save_checkpoint(
            Path(root) / f"hf_{family}_{backend}",
            model,
            kind="full",
            max_shard_size="20KB" if family == "llama" else "5GB",
        )
        out[f"hf_{family}_{backend}"] = _logits(model)
        if backend == "fsdp2":
            # the model's own save_pretrained, given its full weights (it cannot write DTensor shards)
            fsdp_bridge.save_pretrained(model, Path(root) / f"sp_{family}_{backend}")
            out[f"sp_{family}_{backend}"] = out[f"hf_{family}_{backend}"]
    _lora_save_pretrained(root)

    # load_pretrained: a plain Hugging Face directory (one file for GPT-2, tied; an index and
    # several files for Llama) into a model built on the meta device, each rank reading its
    # slices; and a torch.save file, which rank 0 reads and broadcasts in rounds.
    import fsdp_bridge.checkpoint._load_files as ckpt_api

    ckpt_api._CHUNK_NUMEL = 4000
    for family in ("gpt2", "llama"):
        plain = build_tiny(family, seed=11)
        if dist.get_rank() == 0:
            plain.save_pretrained(Path(root) / f"pre_{family}", max_shard_size="20KB" if family == "llama" else "5GB")
            torch.save(plain.state_dict(), Path(root) / f"pre_{family}.pt")
        dist.barrier()
        assert (Path(root) / "pre_llama" / "model.safetensors.index.json").is_file() or family == "gpt2"
        want = _logits(plain)
        for backend in ("fsdp1", "fsdp2"):
            from transformers import AutoModelForCausalLM

            for source in (f"pre_{family}", f"pre_{family}.pt"):
                sharded = fsdp_bridge.load_pretrained(
                    lambda c=plain.config: AutoModelForCausalLM.from_config(c), Path(root) / source, _config(backend)
                )
                np.testing.assert_array_equal(_logits(sharded), want)
                local = fsdp_bridge.get_bridge(sharded).local_numel()
                assert local < sum(p.numel() for p in plain.parameters())
    return out


def _lora_save_pretrained(root: str) -> None:
    """PEFT's save_pretrained of a LoRA model sharded on fsdp2 writes the adapter as it was before sharding."""
    from peft import LoraConfig, PeftModel, get_peft_model

    lora = get_peft_model(build_tiny("llama", seed=3), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_()  # PEFT starts B at zero: a save that lost it would still compare equal
    want = {n: p.detach().clone() for n, p in lora.named_parameters() if "lora_" in n}
    fsdp_bridge.save_pretrained(fsdp_bridge.shard(lora, _config("fsdp2")), Path(root) / "sp_lora")
    again = PeftModel.from_pretrained(build_tiny("llama", seed=4), Path(root) / "sp_lora")
    got = {n: p for n, p in again.named_parameters() if "lora_" in n}
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


_FRESH = r"""
import sys, json, torch
sys.modules["fsdp_bridge"] = None          # prove the directory loads without fsdp_bridge
from transformers import AutoModelForCausalLM
out = {}
for name in json.loads(sys.argv[1]):
    model = AutoModelForCausalLM.from_pretrained(sys.argv[2] + "/" + name, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        out[name] = model(input_ids=torch.arange(4, 20).reshape(2, 8)).logits.tolist()
json.dump(out, open(sys.argv[3], "w"))
"""


def test_full_checkpoint_loads_with_from_pretrained(tmp_path: Path) -> None:
    """A full checkpoint is a Hugging Face directory: from_pretrained in a fresh process gives
    the sharded model's logits, tied (GPT-2) and untied (Llama), saved from either backend; so does what
    fsdp_bridge.save_pretrained has the model's own save_pretrained write on fsdp2."""
    sharded = run_distributed(_export_and_pretrained, 2, args=(str(tmp_path),), timeout_s=600)[0]
    assert (tmp_path / "hf_llama_fsdp1" / "model.safetensors.index.json").is_file()  # split at 20KB
    assert (tmp_path / "hf_gpt2_fsdp2" / "model.safetensors").is_file()
    result = tmp_path / "logits.json"
    names = [f"hf_{f}_{b}" for f, b in CASES] + [f"sp_{f}_{b}" for f, b in CASES if b == "fsdp2"]
    subprocess.run(
        [sys.executable, "-c", _FRESH, json.dumps(names), str(tmp_path), str(result)],
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    fresh = json.loads(result.read_text())
    for name in names:
        torch.testing.assert_close(torch.tensor(fresh[name]), torch.from_numpy(sharded[name]))


# --------------------------------------------------------------------------------------
# checkpoints written by plain FSDP1 code
# --------------------------------------------------------------------------------------


def _plain_fsdp1_save(root: str) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = build_tiny("llama", seed=5)
    model.config.use_cache = False  # recomputed layers must not fill the KV cache twice
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(**sample_batch("llama", seed=dist.get_rank())).loss.backward()
    optimizer.step()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        full = model.state_dict()
    if dist.get_rank() == 0:
        torch.save(full, Path(root) / "plain_full.pt")
        # Names as the wrapped modules spell them, as some training scripts save them.
        prefixed = {
            "_fsdp_wrapped_module."
            + k.replace("layers.0.", "layers.0._fsdp_wrapped_module._checkpoint_wrapped_module."): v
            for k, v in full.items()
        }
        torch.save(prefixed, Path(root) / "plain_prefixed.pt")
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(Path(root) / "plain_dcp"))
    return len(full)


def _load_plain(root: str, paths: list[str]) -> int:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    want = torch.load(Path(root) / "plain_full.pt", weights_only=True)
    checked = 0
    for backend in ("fsdp1", "fsdp2"):
        for name in paths:
            model = fsdp_bridge.shard(build_tiny("llama", seed=9), _config(backend))
            assert fsdp_bridge.load_checkpoint(Path(root) / name, model) == {}
            got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            assert set(got) == set(want), name
            for k in want:
                assert torch.equal(got[k], want[k]), (name, backend, k)
            checked += 1
    return checked


def test_plain_fsdp1_checkpoints_load_and_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """FSDP1 FULL_STATE_DICT torch.save files (with and without wrapper prefixes) and a
    SHARDED_STATE_DICT DCP directory load through the bridge and convert with the CLI."""
    root = str(tmp_path)
    run_distributed(_plain_fsdp1_save, 2, args=(root,))
    build_tiny("llama").config.save_pretrained(tmp_path / "cfg")
    assert (
        cli(
            [
                "convert",
                str(tmp_path / "plain_dcp"),
                str(tmp_path / "conv_hf"),
                "--to",
                "hf",
                "--hf-config",
                str(tmp_path / "cfg"),
            ]
        )
        == 0
    )
    assert cli(["convert", str(tmp_path / "plain_prefixed.pt"), str(tmp_path / "conv_sharded"), "--to", "sharded"]) == 0
    assert cli(["convert", str(tmp_path / "conv_sharded"), str(tmp_path / "conv.pt"), "--to", "torch"]) == 0
    assert cli(["inspect", str(tmp_path / "plain_dcp")]) == 0
    assert "kind:         dcp" in capsys.readouterr().out
    assert cli(["inspect", str(tmp_path / "conv_sharded"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "sharded" and info["converted_from"]["kind"] == "torch"
    assert info["params"]["dtypes"] == {"float32": info["params"]["numel"]}

    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "conv_hf")
    want = torch.load(tmp_path / "plain_full.pt", weights_only=True)
    for k, v in hf_model.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert torch.load(tmp_path / "conv.pt", weights_only=True).keys() == want.keys()

    names = ["plain_full.pt", "plain_prefixed.pt", "plain_dcp", "conv_hf", "conv_sharded", "conv.pt"]
    assert run_distributed(_load_plain, 2, args=(root, names))[0] == 2 * len(names)


# --------------------------------------------------------------------------------------
# crash safety and refused checkpoints
# --------------------------------------------------------------------------------------


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _save_then_die(root: str, where: str) -> None:
    model = fsdp_bridge.shard(build_tiny("llama", seed=2), _config("fsdp2"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if not (Path(root) / "good").exists():
        fsdp_bridge.save_checkpoint(Path(root) / "good", model, optimizer, state={"step": 1})
    model(**sample_batch("llama", seed=dist.get_rank())).loss.backward()
    optimizer.step()
    if where == "write" and dist.get_rank() == 1:
        from torch.distributed.checkpoint import FileSystemWriter

        original = FileSystemWriter.write_data

        def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
            original(self, plan, planner).wait()
            _die()

        FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
        target = "new"
    elif where == "publish" and dist.get_rank() == 0:
        import fsdp_bridge.checkpoint._atomic as atomic

        real_replace = atomic.os.replace

        def replace_then_die(src: Any, dst: Any) -> None:
            real_replace(src, dst)
            if Path(dst).name == ".good.old":  # the previous checkpoint has just been moved aside
                _die()

        atomic.os.replace = replace_then_die  # type: ignore[assignment]
        target = "good"
    else:
        target = "new" if where == "write" else "good"
    fsdp_bridge.save_checkpoint(Path(root) / target, model, optimizer, state={"step": 2})


def _load_after_crash(root: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = fsdp_bridge.shard(build_tiny("llama", seed=8), _config("fsdp1"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = fsdp_bridge.load_checkpoint(Path(root) / "good", model, optimizer)
    errors = {}
    for name in ("new", ".new.partial"):
        with pytest.raises(CheckpointError) as info:
            fsdp_bridge.load_checkpoint(Path(root) / name, model)
        errors[name] = str(info.value)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    reference = build_tiny("llama", seed=2).state_dict()
    same = all(torch.equal(full[k], reference[k]) for k in reference)
    return {"state": state, "errors": errors, "same": same, "latest": str(fsdp_bridge.latest_checkpoint(root))}


@pytest.mark.parametrize("where", ["write", "publish"])
def test_killed_rank_leaves_previous_checkpoint(tmp_path: Path, where: str) -> None:
    """A rank killed while writing, or rank 0 killed mid-publish over the previous checkpoint:
    the previous checkpoint still loads (same weights, same state), the partial one is refused."""
    with pytest.raises(RankFailure, match=r"exited with code -9|closed by peer|reset by peer"):
        run_distributed(_save_then_die, 2, args=(str(tmp_path), where), timeout_s=300)
    assert (tmp_path / ".new.partial").is_dir() if where == "write" else (tmp_path / ".good.old").is_dir()
    if where == "publish":  # killed between the two renames: the previous checkpoint is complete aside
        (tmp_path / ".new.partial").mkdir()  # and give the loader an interrupted save to refuse
    out = run_distributed(_load_after_crash, 2, args=(str(tmp_path),))[0]
    assert out["state"] == {"step": 1} and out["same"]
    assert (
        "does not exist; " in out["errors"]["new"]
        and ".new.partial is left from an interrupted save" in out["errors"]["new"]
    )
    assert "is an incomplete checkpoint (a save was interrupted" in out["errors"][".new.partial"]


def _save_loop(root: str, delay_s: float) -> None:
    import random
    import threading

    model = fsdp_bridge.shard(build_tiny("llama", seed=2), _config("fsdp2"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if dist.get_rank() == random.Random(delay_s).randrange(2):
        threading.Timer(delay_s, _die).start()
    start = (fsdp_bridge.checkpoint.list_checkpoints(root) or [(0, None)])[-1][0]
    for step in range(start + 1, start + 50):
        fsdp_bridge.save_checkpoint(
            Path(root) / f"step_{step:04d}",
            model,
            optimizer,
            kind="sharded" if step % 2 else "full",
            state={"step": step},
            keep_last=2,
        )


@pytest.mark.slow
def test_kill_at_random_moments(tmp_path: Path) -> None:
    """A rank SIGKILLed at a random moment of a save loop, again and again: the latest complete
    checkpoint always reads back whole, and interrupted saves are refused."""
    import random

    from fsdp_bridge.checkpoint._convert import read_full

    rng = random.Random(0)
    for _ in range(8):
        try:
            run_distributed(_save_loop, 2, args=(str(tmp_path), rng.uniform(8.0, 20.0)), timeout_s=300)
        except RankFailure:
            pass
        latest = fsdp_bridge.latest_checkpoint(tmp_path)
        assert latest is not None
        assert read_full(latest).model  # manifest verified, every tensor readable
        for partial in tmp_path.glob(".*.partial"):
            with pytest.raises(CheckpointError, match="incomplete checkpoint"):
                fsdp_bridge.checkpoint.detect(partial)
        assert len(fsdp_bridge.checkpoint.list_checkpoints(tmp_path)) <= 2


def _bad_checkpoints(root: str) -> dict[str, str]:
    errors: dict[str, str] = {}

    def expect(label: str, fn: Any) -> None:
        try:
            fn()
        except (CheckpointError, ValueError, TypeError) as err:
            errors[label] = f"{type(err).__name__}: {err}"
        else:
            errors[label] = "no error"

    llama = fsdp_bridge.shard(build_tiny("llama"), _config("fsdp2"))
    fsdp_bridge.save_checkpoint(Path(root) / "weights_only", llama, kind="sharded")
    optimizer = torch.optim.AdamW(llama.parameters())
    expect("no_optim", lambda: fsdp_bridge.load_checkpoint(Path(root) / "weights_only", llama, optimizer))
    gpt2 = fsdp_bridge.shard(build_tiny("gpt2"), _config("fsdp1"))
    expect("keys", lambda: fsdp_bridge.load_checkpoint(Path(root) / "weights_only", gpt2))
    wide = fsdp_bridge.shard(build_tiny("llama", intermediate_size=48), _config("fsdp1"))
    expect("shapes", lambda: fsdp_bridge.load_checkpoint(Path(root) / "weights_only", wide))
    fsdp_bridge.save_checkpoint(Path(root) / "full", llama, kind="full")
    expect("full_shapes", lambda: fsdp_bridge.load_checkpoint(Path(root) / "full", wide))
    expect("bad_state", lambda: fsdp_bridge.save_checkpoint(Path(root) / "x", llama, state={"t": torch.ones(2)}))
    expect("bad_kind", lambda: fsdp_bridge.save_checkpoint(Path(root) / "x", llama, kind="hf"))  # type: ignore[arg-type]
    dist.barrier()
    if dist.get_rank() == 0:  # truncate one shard file of a published checkpoint
        victim = sorted((Path(root) / "weights_only" / "dcp").glob("*.distcp"))[0]
        os.truncate(victim, victim.stat().st_size // 2)
        weights = Path(root) / "full" / "model.safetensors"
        os.truncate(weights, weights.stat().st_size - 10)
    dist.barrier()
    expect("truncated", lambda: fsdp_bridge.load_checkpoint(Path(root) / "weights_only", llama))
    expect("truncated_full", lambda: fsdp_bridge.load_checkpoint(Path(root) / "full", llama))
    # keep-last-K rotation, and the latest checkpoint by step
    for step in (10, 20, 30):
        fsdp_bridge.save_checkpoint(Path(root) / "runs" / f"step_{step}", llama, state={"step": step}, keep_last=2)
    errors["kept"] = ",".join(sorted(p.name for p in (Path(root) / "runs").iterdir()))
    errors["latest"] = Path(str(fsdp_bridge.latest_checkpoint(Path(root) / "runs"))).name
    return errors


def test_bad_checkpoints_are_refused_with_the_file_and_problem(tmp_path: Path) -> None:
    e = run_distributed(_bad_checkpoints, 2, args=(str(tmp_path),))[0]
    assert "holds no optimizer state" in e["no_optim"]
    assert "missing model keys (" in e["keys"] and "transformer.h.0.attn.c_attn.weight" in e["keys"]
    assert "unexpected model keys (" in e["keys"] and "model.embed_tokens.weight" in e["keys"]
    assert "weights_only/dcp" in e["keys"]
    assert (
        "shape mismatch model.layers.0.mlp.gate_proj.weight: checkpoint has shape [64, 32], the model has [48, 32]"
    ) in e["shapes"]
    assert "full: " in e["full_shapes"] and "shape mismatch model.layers.0.mlp.up_proj.weight" in e["full_shapes"]
    assert "state['t']: a " in e["bad_state"] or "state['t']: Tensor" in e["bad_state"]
    assert "kind must be 'sharded', 'full', 'adapter' or 'merged' (got 'hf')" in e["bad_kind"]
    assert "__0_0.distcp: size" in e["truncated"] and "(truncated or overwritten)" in e["truncated"]
    assert "model.safetensors: size" in e["truncated_full"]
    assert e["kept"] == "step_20,step_30" and e["latest"] == "step_30"


def test_pretrained_fits_and_sliced_loading_in_one_process(tmp_path: Path) -> None:
    """pretrained_fits (which train uses to pick the sliced load) reads headers only: exact names
    and shapes, a tied name stored once; anything else falls back to from_pretrained."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    for family in ("gpt2", "llama"):
        plain = build_tiny(family, seed=3)
        plain.save_pretrained(tmp_path / family)
        with init_empty_weights(include_buffers=False):
            meta = AutoModelForCausalLM.from_config(plain.config)
        meta.tie_weights()
        assert fsdp_bridge.checkpoint.pretrained_fits(tmp_path / family, meta)
        # Without a process group each "rank" reads everything: the plain load of a directory.
        fresh = build_tiny(family, seed=4)
        assert fsdp_bridge.load_checkpoint(tmp_path / family, fresh) == {}
        for (name, a), b in zip(plain.state_dict().items(), fresh.state_dict().values(), strict=True):
            assert torch.equal(a, b), name
    plain.model.save_pretrained(tmp_path / "base")  # a LlamaModel: names without "model."
    torch.save(plain.state_dict(), tmp_path / "sd.pt")
    for path in (tmp_path / "base", tmp_path / "sd.pt", tmp_path / "missing"):
        assert not fsdp_bridge.checkpoint.pretrained_fits(path, meta), path
    with init_empty_weights(include_buffers=False):
        wider = AutoModelForCausalLM.from_config(build_tiny("llama", intermediate_size=48).config)
    assert not fsdp_bridge.checkpoint.pretrained_fits(tmp_path / "llama", wider)


def test_convert_to_hf_streams_the_exact_state(tmp_path: Path) -> None:
    """sharded -> hf reads a batch of tensors at a time and writes safetensors header-first:
    the weights (several files + index) and optimizer tensors are bit for bit the saved ones."""
    from safetensors.torch import load_file

    from fsdp_bridge.checkpoint import _hf

    specs = {
        "a": torch.randn(5, 3),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.tensor(3.5),
        "d": torch.arange(4),
    }
    _hf.write_safetensors_streamed(
        tmp_path / "t.safetensors",
        {k: (tuple(v.shape), v.dtype) for k, v in specs.items()},
        lambda names: {n: specs[n] for n in names},
        batch_bytes=20,  # one or two tensors per batch
    )
    back = load_file(tmp_path / "t.safetensors")
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in specs.items())

    model = build_tiny("llama", seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(**sample_batch("llama", seed=0)).loss.backward()
    optimizer.step()
    fsdp_bridge.save_checkpoint(tmp_path / "sharded", model, optimizer)
    out = fsdp_bridge.checkpoint.convert_checkpoint(
        tmp_path / "sharded", tmp_path / "hf", to="hf", max_shard_size="30KB"
    )
    assert (out / "model.safetensors.index.json").is_file()
    weights = _hf.read_hf_weights(out)
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    saved = _hf.read_optimizer(out)
    names = [n for n, _ in model.named_parameters()]
    for i, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(saved["state"][names[i]][key], value), (names[i], key)
    assert json.loads((out / "fsdp_bridge.json").read_text())["has_optimizer"] is True
    # --hf-config ORIGINAL_DIR: back into the original's files; an index naming files elsewhere
    # (user input) is not followed.
    model.save_pretrained(tmp_path / "original", max_shard_size="50KB")
    back = fsdp_bridge.checkpoint.convert_checkpoint(
        tmp_path / "sharded", tmp_path / "back", to="hf", hf_config=tmp_path / "original"
    )
    assert _hf.read_weight_map(back) == _hf.read_weight_map(tmp_path / "original")
    assert all(torch.equal(_hf.read_hf_weights(back)[k], v) for k, v in model.state_dict().items())
    index = json.loads((tmp_path / "original" / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: "../escaped.safetensors" for k in index["weight_map"]}
    (tmp_path / "original" / "model.safetensors.index.json").write_text(json.dumps(index))
    fsdp_bridge.checkpoint.convert_checkpoint(
        tmp_path / "sharded", tmp_path / "back2", to="hf", hf_config=tmp_path / "original"
    )
    assert not (tmp_path / "escaped.safetensors").exists() and (tmp_path / "back2" / "model.safetensors").is_file()


def test_offline_errors_and_metadata_safety(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        fsdp_bridge.checkpoint.inspect_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"not a checkpoint: no fsdp_bridge\.json"):
        fsdp_bridge.checkpoint.detect(tmp_path / "empty")
    # A DCP .metadata that would run code when unpickled is refused.
    evil = tmp_path / "evil"
    evil.mkdir()
    import pickle

    class Boom:
        def __reduce__(self) -> Any:
            return (os.system, ("echo pwned",))

    (evil / ".metadata").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(CheckpointError, match=r"refusing to load (posix|os)\.system"):
        fsdp_bridge.checkpoint.inspect_checkpoint(evil)
    # A torch file holding arbitrary objects is refused (weights_only=True).
    torch.save({"w": Boom()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="weights_only=True"):
        fsdp_bridge.checkpoint.inspect_checkpoint(tmp_path / "evil.pt")
    # An index naming a file outside the directory is refused.
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
    with pytest.raises(CheckpointError, match="names a file outside its directory"):
        fsdp_bridge.checkpoint.inspect_checkpoint(hf_dir)
    assert cli(["inspect", str(tmp_path / "nope")]) == 2
    with pytest.raises(ValueError, match="keep must be an integer >= 1"):
        fsdp_bridge.rotate_checkpoints(tmp_path, keep=0)
    with pytest.raises(fsdp_bridge.ConfigError, match=r"to: got 'safetensors'; allowed: hf, sharded, torch"):
        fsdp_bridge.checkpoint.convert_checkpoint(hf_dir, tmp_path / "out", to="safetensors")  # type: ignore[arg-type]


def _global_call_pickle(module: str, name: str, arg: str) -> bytes:
    """Protocol-4 bytes that resolve ``module``/``name`` with STACK_GLOBAL and call it with ``arg``."""

    def text(s: str) -> bytes:
        raw = s.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    # PROTO 4, module, name, STACK_GLOBAL, (arg,) TUPLE1, REDUCE, STOP
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(arg) + b"\x85" + b"R" + b"."


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("torch.distributed.checkpoint.filesystem", "os.system"),
        ("torch.distributed.checkpoint.metadata", "os.system"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo.__init__.__globals__.get"),
        ("pathlib", "os.system"),
        ("torch.serialization", "os.system"),
        ("torch", "os.system"),
        ("collections", "OrderedDict.__init__"),
        ("builtins", "eval"),
        ("os", "system"),
    ],
)
def test_dcp_metadata_never_resolves_dotted_or_unlisted_names(tmp_path: Path, module: str, name: str) -> None:
    # Pickle protocol 4 resolves a dotted name by attribute traversal: an allow-list by module
    # prefix let ("torch.distributed.checkpoint.filesystem", "os.system") through to a shell.
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / ".metadata").write_bytes(_global_call_pickle(module, name, f"touch {marker}"))
    with pytest.raises(CheckpointError, match=r"refusing to load .* from DCP metadata"):
        fsdp_bridge.checkpoint.inspect_checkpoint(evil)
    assert cli(["inspect", str(evil)]) == 2
    assert cli(["convert", str(evil), str(tmp_path / "out"), "--to", "torch"]) == 2
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_dcp_metadata_reader_accepts_what_dcp_writes(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from fsdp_bridge.checkpoint._formats import load_dcp_metadata

    state = {"w": torch.randn(3, 4), "h": torch.zeros(2, dtype=torch.bfloat16), "step": 3, "nested": {"a": [1, 2]}}
    dcp.save(state, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    metadata = load_dcp_metadata(tmp_path / "d" / ".metadata")
    assert metadata.state_dict_metadata["w"].size == torch.Size([3, 4])
    assert metadata.state_dict_metadata["h"].properties.dtype == torch.bfloat16


@pytest.mark.parametrize("payload", [b"", b"\x80\x04", b"\x80\x04K\x01\x85.", b"garbage" * 10, b"\x80\x04]" * 5000])
def test_damaged_dcp_metadata_is_a_checkpoint_error(tmp_path: Path, payload: bytes) -> None:
    from fsdp_bridge.checkpoint._formats import load_dcp_metadata

    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        load_dcp_metadata(tmp_path / ".metadata")


def test_nothing_that_is_not_a_checkpoint_is_ever_replaced(tmp_path: Path) -> None:
    # A directory of the user's files, named as a destination, is refused before anything runs.
    user = tmp_path / "my_project"
    user.mkdir()
    (user / "notes.txt").write_text("precious")
    with pytest.raises(CheckpointError, match=r"my_project: exists and is not an fsdp_bridge checkpoint .*notes\.txt"):
        fsdp_bridge.save_checkpoint(user, torch.nn.Linear(2, 2))
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    torch.save(torch.nn.Linear(2, 2).state_dict(), src_dir / "model.pt")
    src = src_dir / "model.pt"
    assert cli(["convert", str(src), str(user), "--to", "sharded"]) == 2
    assert (user / "notes.txt").read_text() == "precious" and sorted(p.name for p in user.iterdir()) == ["notes.txt"]
    # Converting into the source's own directory, or a directory holding it, would destroy it.
    with pytest.raises(CheckpointError, match=r"is a directory holding the source"):
        fsdp_bridge.checkpoint.convert_checkpoint(src, tmp_path, to="sharded")
    with pytest.raises(CheckpointError, match=r"is inside the source"):
        fsdp_bridge.checkpoint.convert_checkpoint(src_dir, src_dir / "out", to="sharded")
    # --to torch never overwrites a file; a real conversion still works into a new path.
    other = tmp_path / "other.pt"
    other.write_text("not yours")
    assert cli(["convert", str(src), str(other), "--to", "torch"]) == 2 and other.read_text() == "not yours"
    assert cli(["convert", str(src), str(tmp_path / "fresh"), "--to", "sharded"]) == 0
    assert cli(["convert", str(src), str(tmp_path / "fresh"), "--to", "sharded"]) == 0  # ours: replaced
    assert src.is_file() and (user / "notes.txt").is_file()


def test_paths_never_leave_the_checkpoint_directory(tmp_path: Path) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    from fsdp_bridge.checkpoint._formats import load_dcp_metadata

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    metadata = load_dcp_metadata(tmp_path / "d" / ".metadata")
    for target in ("../elsewhere/x.distcp", "/etc/passwd"):
        for info in metadata.storage_data.values():
            info.relative_path = target
        (tmp_path / "d" / ".metadata").write_bytes(pickle.dumps(metadata))
        with pytest.raises(CheckpointError, match=r"names a file outside its directory"):
            fsdp_bridge.checkpoint.inspect_checkpoint(tmp_path / "d")
    # A symlinked model.safetensors pointing elsewhere is refused.
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(outside / "model.safetensors"))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").symlink_to(outside / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"names a file outside its directory"):
        fsdp_bridge.checkpoint.inspect_checkpoint(hf)


def test_latest_checkpoint_survives_an_interrupted_overwrite_and_a_damaged_sibling(tmp_path: Path, caplog) -> None:
    def ckpt(name: str, step: int, **extra: object) -> Path:
        d = tmp_path / name
        meta = describe(d, step=step)
        if extra:
            (d / "fsdp_bridge.json").write_text(json.dumps({**meta, **extra}))
        return d

    ckpt("step_1", 1)
    ckpt("step_2", 2)
    ckpt("step_3", 3, version="1")  # a wrong type in its description
    assert fsdp_bridge.latest_checkpoint(tmp_path) == tmp_path / "step_2"  # skipped, not raised
    assert "skipping" in caplog.text and "field version: '1'" in caplog.text
    with pytest.raises(CheckpointError, match=r"field version: '1', expected one of \[1, 2\]"):
        fsdp_bridge.checkpoint.detect(tmp_path / "step_3")
    # A kill between the two renames of an overwrite of step_4: .step_4.old is the only complete copy.
    ckpt(".step_4.old", 4)
    assert fsdp_bridge.latest_checkpoint(tmp_path) == tmp_path / ".step_4.old"
    ckpt("step_4", 4)  # once step_4 is back, the leftover copy is not a checkpoint of its own
    assert fsdp_bridge.latest_checkpoint(tmp_path) == tmp_path / "step_4"


_HOLD_LOCK = """
import sys, time
from pathlib import Path
from fsdp_bridge.checkpoint._atomic import SaveLock
SaveLock(Path(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(120)
"""


def _wait_for_exit(pid: int) -> None:
    import time

    for _ in range(200):  # not our child here: poll until the process is gone (a zombie holds no lock)
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)


def _save_while_locked(root: str, holder: int) -> dict[str, str]:
    model = fsdp_bridge.shard(build_tiny("llama", seed=2), _config("fsdp2"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    errors = {}
    for kind in ("sharded", "full", "async"):
        with pytest.raises(CheckpointError) as info:
            if kind == "async":
                fsdp_bridge.save_checkpoint_async(Path(root) / "ckpt", model, optimizer).wait()
            else:
                fsdp_bridge.save_checkpoint(Path(root) / "ckpt", model, optimizer, kind=kind)  # type: ignore[arg-type]
        errors[kind] = str(info.value)
    dist.barrier()
    if dist.get_rank() == 0:
        os.kill(holder, signal.SIGKILL)  # the other save dies: the OS releases its lock
        _wait_for_exit(holder)
    dist.barrier()
    fsdp_bridge.save_checkpoint(Path(root) / "ckpt", model, optimizer, state={"step": 3})
    pending = fsdp_bridge.save_checkpoint_async(Path(root) / "ckpt2", model, optimizer, state={"step": 4})
    pending.wait()
    dist.barrier()
    return errors


def test_a_path_another_process_is_saving_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Two jobs saving one path at once would mix their files in one staging directory: while
    another process holds the path's save lock, sharded, full and async saves are refused on
    every rank, naming that process; once it is killed the OS frees the lock and saves succeed,
    leaving no lock file behind."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(tmp_path / "ckpt")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        results = run_distributed(_save_while_locked, 2, args=(str(tmp_path), holder.pid))
    finally:
        holder.kill()
        holder.wait()
    for errors in results:
        for kind, text in errors.items():
            assert f"is being saved by another process (pid {holder.pid} on " in text, (kind, text)
    assert [p.name for _, p in fsdp_bridge.checkpoint.list_checkpoints(tmp_path)] == ["ckpt", "ckpt2"]
    assert not list(tmp_path.glob(".*.lock")) and not list(tmp_path.glob(".*.partial"))
    with pytest.raises(CheckpointError, match="is being saved by another process"):
        from fsdp_bridge.checkpoint._atomic import SaveLock

        first = SaveLock(tmp_path / "x").acquire()
        try:
            SaveLock(tmp_path / "x").acquire()
        finally:
            first.release()
