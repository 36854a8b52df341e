"""Damaged checkpoints are refused, naming the file and the problem, and nothing is loaded.

Cases: a missing shard, a truncated shard, DCP metadata from another run of the same model,
a description (fsdp_bridge.json) from another run, a checkpoint of a different model, and,
with the description re-written to match as an attacker would: a zeroed shard, a corrupt
training state, a corrupt RNG file of rank 1 only, an optimizer tensor of the wrong shape in
a full checkpoint.  After each refusal, on every rank, the model's parameters are
bit-identical to what they were.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import fsdp_bridge
from fsdp_bridge.checkpoint import CheckpointError
from fsdp_bridge.testing import run_distributed
from fsdp_bridge.testing.damage import redescribe, zero_file
from fsdp_bridge.testing.models import build_tiny, sample_batch


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _damage_and_load(root: str) -> dict[str, str]:
    rank = dist.get_rank()
    base = Path(root)
    config = fsdp_bridge.BridgeConfig(backend="fsdp2")
    model = fsdp_bridge.shard(build_tiny("llama", seed=0), config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for name in ("a", "b"):  # two saves of the same model: files of one fit the other's shapes
        model(**sample_batch(seed=rank)).loss.backward()
        opt.step()
        opt.zero_grad()
        fsdp_bridge.save_checkpoint(base / name, model, opt, state={"step": 1})
    fsdp_bridge.save_checkpoint(base / "full", model, opt, kind="full", state={"step": 1})
    gpt2 = fsdp_bridge.shard(build_tiny("gpt2"), fsdp_bridge.BridgeConfig(backend="fsdp2"))
    fsdp_bridge.save_checkpoint(base / "gpt2", gpt2, torch.optim.AdamW(gpt2.parameters()))
    dist.barrier()

    cases = {
        "missing_shard": lambda d: next((d / "dcp").glob("*.distcp")).unlink(),
        "truncated_shard": lambda d: (lambda f: f.write_bytes(f.read_bytes()[:100]))(
            next((d / "dcp").glob("*.distcp"))
        ),
        "metadata_from_other_run": lambda d: shutil.copy(base / "b" / "dcp" / ".metadata", d / "dcp" / ".metadata"),
        "description_from_other_run": lambda d: shutil.copy(base / "b" / "fsdp_bridge.json", d / "fsdp_bridge.json"),
        "other_model": None,
        # The description re-written to match (redescribe): only the readers' own checks stand.
        "zeroed_shard": lambda d: zero_file(next((d / "dcp").glob("*.distcp"))),
        "corrupt_train_state": lambda d: (d / "train_state.json").write_text('"not a dict"'),
        "corrupt_rng_of_rank_1": lambda d: (d / "rng" / "rank_00001.json").write_text('{"python": 1}'),
        "optimizer_tensor_wrong_shape": _wrong_shape_optimizer_tensor,
    }
    redescribed = {"zeroed_shard", "corrupt_train_state", "corrupt_rng_of_rank_1", "optimizer_tensor_wrong_shape"}
    victim = build_tiny("llama", seed=9)
    target = fsdp_bridge.shard(victim, config)
    target_opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
    before = _full(target)
    out: dict[str, str] = {}
    for label, damage in cases.items():
        path = base / "gpt2" if damage is None else base / label
        if damage is not None:
            if rank == 0:
                shutil.copytree(base / ("full" if label == "optimizer_tensor_wrong_shape" else "a"), path)
                damage(path)
                if label in redescribed:
                    redescribe(path)
            dist.barrier()
        try:
            fsdp_bridge.load_checkpoint(path, target, target_opt)
            out[label] = "loaded"
        except CheckpointError as err:
            out[label] = str(err)
        after = _full(target)
        out[f"{label}_untouched"] = str(all(torch.equal(before[k], after[k]) for k in before))
    # The undamaged checkpoints still load.
    fsdp_bridge.load_checkpoint(base / "b", target, target_opt)
    out["b_loads"] = str(not all(torch.equal(before[k], v) for k, v in _full(target).items()))
    out["description"] = json.dumps(sorted(json.loads((base / "a" / "fsdp_bridge.json").read_text())["digests"]))
    return out


def _wrong_shape_optimizer_tensor(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "optimizer.safetensors"))
    key = next(k for k in sorted(tensors) if k.endswith("/exp_avg") and tensors[k].ndim == 2)
    tensors[key] = tensors[key].reshape(-1)[: tensors[key].numel() // 2].reshape(2, -1).contiguous()
    save_file(tensors, str(d / "optimizer.safetensors"), metadata={"format": "pt"})


def test_damaged_checkpoints_are_refused_and_nothing_is_loaded(tmp_path: Path) -> None:
    for r in run_distributed(_damage_and_load, 2, args=(str(tmp_path),)):
        assert "dcp/__0_0.distcp: missing" in r["missing_shard"] and "missing_shard" in r["missing_shard"]
        assert "(truncated or overwritten)" in r["truncated_shard"]
        assert (
            "dcp/.metadata: content differs from the file this checkpoint was saved with"
            in r["metadata_from_other_run"]
        )
        assert "content differs" in r["description_from_other_run"]
        assert "missing model keys" in r["other_model"] and "gpt2" in r["other_model"]
        assert "dcp: cannot be read" in r["zeroed_shard"]
        assert "train_state.json" in r["corrupt_train_state"]
        assert "rank 1: reading the training state and RNG failed" in r["corrupt_rng_of_rank_1"]
        assert "rank_00001.json" in r["corrupt_rng_of_rank_1"]
        assert "exp_avg: shape [2, " in r["optimizer_tensor_wrong_shape"]
        for label in (
            "missing_shard",
            "truncated_shard",
            "metadata_from_other_run",
            "description_from_other_run",
            "other_model",
            "zeroed_shard",
            "corrupt_train_state",
            "corrupt_rng_of_rank_1",
            "optimizer_tensor_wrong_shape",
        ):
            assert r[f"{label}_untouched"] == "True", f"{label}: the model changed although the load was refused"
        assert r["b_loads"] == "True"
        assert "dcp/.metadata" in r["description"]


def _flip_and_load(root: str) -> dict[str, str]:
    """Tensor files above 1 MiB: one flipped byte in a shard (sharded save, 2 ranks) or in the
    safetensors file (full save) is refused on every rank, with the model untouched."""
    base = Path(root)
    model = fsdp_bridge.shard(
        torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8)),
        fsdp_bridge.BridgeConfig(backend="fsdp2"),
    )
    fsdp_bridge.save_checkpoint(base / "sharded", model)
    fsdp_bridge.save_checkpoint(base / "full", model, kind="full")
    meta = json.loads((base / "sharded" / "fsdp_bridge.json").read_text())
    dist.barrier()
    if dist.get_rank() == 0:
        for target in (base / "sharded" / "dcp" / "__1_0.distcp", base / "full" / "model.safetensors"):
            data = bytearray(target.read_bytes())
            data[len(data) // 2] ^= 0x01
            target.write_bytes(bytes(data))
    dist.barrier()
    before = _full(model)
    out = {"recorded": ",".join(sorted(meta.get("checksums", {})))}
    for name in ("sharded", "full"):
        try:
            fsdp_bridge.load_checkpoint(base / name, model)
            out[name] = "loaded"
        except CheckpointError as err:
            out[name] = str(err)
    after = _full(model)
    out["untouched"] = str(all(torch.equal(before[k], after[k]) for k in before))
    return out


def test_a_flipped_byte_in_a_large_tensor_file_is_refused_on_every_rank(tmp_path: Path) -> None:
    for rank, out in enumerate(run_distributed(_flip_and_load, 2, args=(str(tmp_path),))):
        # each rank's shard file is checksummed (by the rank that wrote it)
        assert out["recorded"] == "dcp/__0_0.distcp,dcp/__1_0.distcp", out["recorded"]
        for name, damaged in (("sharded", "dcp/__1_0.distcp"), ("full", "model.safetensors")):
            assert damaged in out[name] and "CRC32C differs" in out[name], (rank, name, out[name])
        assert out["untouched"] == "True", rank


@pytest.mark.parametrize("algorithm", [None, "crc32", "crc32c"])
def test_content_checksums_of_either_algorithm_are_verified(tmp_path: Path, algorithm: str | None) -> None:
    """New checkpoints record CRC-32C; one saved before (no ``checksum_algorithm``: zlib's CRC-32)
    is verified with its own algorithm, and a flipped byte is caught by either."""
    import zlib

    import google_crc32c

    from fsdp_bridge.checkpoint._formats import Detected, Kind, verify_manifest

    data = bytearray(os.urandom(3 << 20))
    (tmp_path / "w.bin").write_bytes(data)
    crc = zlib.crc32(data) if algorithm in (None, "crc32") else google_crc32c.value(bytes(data))
    meta = {"files": {"w.bin": len(data)}, "checksums": {"w.bin": crc}}
    if algorithm is not None:
        meta["checksum_algorithm"] = algorithm
    verify_manifest(Detected(Kind.SHARDED, tmp_path, meta))  # intact: accepted
    data[len(data) // 2] ^= 0x01
    (tmp_path / "w.bin").write_bytes(data)
    with pytest.raises(CheckpointError, match=f"w.bin: content is damaged \\({(algorithm or 'crc32').upper()} differs"):
        verify_manifest(Detected(Kind.SHARDED, tmp_path, meta))
