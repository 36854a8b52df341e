"""A save deletes or replaces only what is provably its own, and never writes through a symlink.

One process, milliseconds each: exports (adapter, merged) and checkpoints onto a user's
directory; user directories at the names a save keeps beside its destination (``.NAME.partial``,
``.NAME.old``, ``.NAME.deleting``); symlinks and hard links planted at ``.NAME.lock``; rotation
beside ``last/`` and ``best/``; leftovers of killed saves; PEFT adapter files that are damaged,
symlinked out of their directory, missing tensors or of another dtype; merged exports whose files are
damaged, missing, renamed, added or symlinked; optimizer groups whose
hyperparameters are of the wrong kind or whose parameters are not the model's.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdp_bridge
from fsdp_bridge.checkpoint import CheckpointError
from fsdp_bridge.testing.models import build_tiny

USER_FILES = {"config.json": "{}", "tokenizer.json": "{}", "training_notes.txt": "do not lose"}


def _user_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    for name, text in USER_FILES.items():
        (path / name).write_text(text)
    return path


def _intact(path: Path) -> bool:
    return all((path / name).read_text() == text for name, text in USER_FILES.items())


def _model() -> torch.nn.Module:
    return build_tiny("llama", seed=0)


@pytest.fixture(scope="module")
def lora() -> Any:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(build_tiny("llama", seed=0), config)


@pytest.mark.parametrize("kind", ["adapter", "merged"])
def test_an_export_onto_the_base_models_directory_is_refused(tmp_path: Path, lora: Any, kind: str) -> None:
    base = _user_dir(tmp_path / "base")
    with pytest.raises(CheckpointError, match=r"not an fsdp_bridge checkpoint or export .*config\.json.*refusing"):
        fsdp_bridge.save_checkpoint(base, lora, kind=kind)
    assert _intact(base) and sorted(os.listdir(base)) == sorted(USER_FILES)
    assert not list(tmp_path.glob(".*"))


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_checkpoint_onto_a_users_directory_is_refused(tmp_path: Path, kind: str) -> None:
    base = _user_dir(tmp_path / "base")
    with pytest.raises(CheckpointError, match="refusing to replace it"):
        fsdp_bridge.save_checkpoint(base, _model(), kind=kind)
    assert _intact(base)


def test_an_export_replaces_an_earlier_export_of_its_own(tmp_path: Path, lora: Any) -> None:
    for kind in ("adapter", "merged", "adapter"):
        fsdp_bridge.save_checkpoint(tmp_path / "out", lora, kind=kind)
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path)) == ["out"]  # nothing left beside it


@pytest.mark.parametrize("suffix", [".partial", ".old", ".deleting"])
def test_a_users_directory_beside_the_destination_is_never_deleted(tmp_path: Path, suffix: str) -> None:
    fsdp_bridge.save_checkpoint(tmp_path / "ckpt", _model())
    user = _user_dir(tmp_path / f".ckpt{suffix}")
    with pytest.raises(CheckpointError, match=rf"\.ckpt{suffix}: is where a save of ckpt keeps .*may be your files"):
        fsdp_bridge.save_checkpoint(tmp_path / "ckpt", _model())
    assert _intact(user)
    fsdp_bridge.load_checkpoint(tmp_path / "ckpt", _model())  # the earlier checkpoint is untouched


def test_the_every_rank_check_leaves_the_staging_directory_to_rank_0(tmp_path: Path) -> None:
    """Rank 0 may be making ``.NAME.partial`` (its owner file created, not yet written) while the
    other ranks check the destination: they must not refuse it; rank 0 checks it under the lock."""
    from fsdp_bridge.checkpoint._publish import check_save_args

    (tmp_path / ".ckpt.partial").mkdir()
    (tmp_path / ".ckpt.partial" / ".fsdp_bridge.owner").touch()
    assert check_save_args(tmp_path / "ckpt", None, None) == tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match=r"\.ckpt\.partial: is where a save of ckpt keeps its partial copy"):
        fsdp_bridge.save_checkpoint(tmp_path / "ckpt", _model())  # rank 0's own check, under the lock
    assert sorted(os.listdir(tmp_path / ".ckpt.partial")) == [".fsdp_bridge.owner"]


def test_leftovers_of_our_own_killed_saves_are_replaced(tmp_path: Path) -> None:
    fsdp_bridge.save_checkpoint(tmp_path / "ckpt", _model())
    (tmp_path / ".ckpt.partial").mkdir()
    (tmp_path / ".ckpt.partial" / ".fsdp_bridge.owner").write_bytes(
        (tmp_path / "ckpt" / ".fsdp_bridge.owner").read_bytes()
    )
    (tmp_path / ".ckpt.partial" / "half_written").write_text("x")
    fsdp_bridge.save_checkpoint(tmp_path / "ckpt", _model())  # a killed save of ours: cleaned
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.parametrize("target", ["user_file", "dangling", "hard_link"])
def test_the_lock_never_writes_through_a_link(tmp_path: Path, target: str) -> None:
    victim = tmp_path / "victim.txt"
    lock = tmp_path / ".ckpt.lock"
    if target == "hard_link":
        victim.write_text("precious")
        os.link(victim, lock)
    else:
        if target == "user_file":
            victim.write_text("precious")
        lock.symlink_to(victim)
    why = "is a file with 2 hard links" if target == "hard_link" else "is a symlink"
    with pytest.raises(CheckpointError, match=rf"\.ckpt\.lock: {why}.*never followed or written through"):
        fsdp_bridge.save_checkpoint(tmp_path / "ckpt", _model())
    if target == "dangling":
        assert not victim.exists()
    else:
        assert victim.read_text() == "precious"
    assert not (tmp_path / "ckpt").exists()


def test_a_lock_file_that_is_not_a_lock_is_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / ".ckpt.lock").write_text("a user's notes")
    with pytest.raises(CheckpointError, match=r"\.ckpt\.lock: holds something other than a lock"):
        fsdp_bridge.save_checkpoint(tmp_path / "ckpt", _model())
    assert (tmp_path / ".ckpt.lock").read_text() == "a user's notes"


def test_rotation_deletes_only_its_own_series(tmp_path: Path) -> None:
    model = _model()
    for name in ("last", "best", "other_7"):
        fsdp_bridge.save_checkpoint(tmp_path / name, model, state={"step": 0})
    for step in range(1, 5):
        fsdp_bridge.save_checkpoint(tmp_path / f"step_{step:04d}", model, state={"step": step}, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["best", "last", "other_7", "step_0003", "step_0004"]
    with pytest.raises(ValueError, match="'last' does not end in a step number"):
        fsdp_bridge.save_checkpoint(tmp_path / "last", model, keep_last=2)


def test_leftovers_of_killed_saves_are_cleaned_only_when_ours_and_free(tmp_path: Path) -> None:
    model = _model()
    fsdp_bridge.save_checkpoint(tmp_path / "step_1", model, state={"step": 1})
    owner = (tmp_path / "step_1" / ".fsdp_bridge.owner").read_bytes()
    ours = tmp_path / ".step_0.deleting"  # a kill struck in the middle of a rotation
    (ours / "dcp").mkdir(parents=True)
    (ours / ".fsdp_bridge.owner").write_bytes(owner)
    (tmp_path / ".step_9.lock").write_text("pid 12345 on host since 2026-01-01T00:00:00+00:00")  # holder killed
    user = _user_dir(tmp_path / ".notes.deleting")
    (tmp_path / ".held.lock").write_text("pid 1 on host since 2026-01-01T00:00:00+00:00")
    (tmp_path / ".mine.lock").write_text("not a lock")
    held = os.open(tmp_path / ".held.lock", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # a live save of "held"
    try:
        fsdp_bridge.save_checkpoint(tmp_path / "step_2", model, state={"step": 2}, keep_last=1)
    finally:
        os.close(held)
    assert sorted(os.listdir(tmp_path)) == [".held.lock", ".mine.lock", ".notes.deleting", "step_2"]
    assert _intact(user)


# --------------------------------------------------------------------------------------
# PEFT adapter directories
# --------------------------------------------------------------------------------------


def _adapter(tmp_path: Path, lora: Any) -> Path:
    return fsdp_bridge.save_checkpoint(tmp_path / "adapter", lora, kind="adapter")


def _refused_unchanged(path: Path, lora: Any, match: str) -> None:
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    with pytest.raises(CheckpointError, match=match):
        fsdp_bridge.load_checkpoint(path, lora)
    assert all(torch.equal(v, lora.state_dict()[k]) for k, v in before.items())


def test_an_adapter_export_carries_checksums_verified_on_load(tmp_path: Path, lora: Any) -> None:
    path = _adapter(tmp_path, lora)
    assert fsdp_bridge.load_checkpoint(path, lora) == {}
    weights = path / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    _refused_unchanged(path, lora, r"adapter_model\.safetensors: content differs from the crc32c recorded")
    (path / "fsdp_bridge_export.json").unlink()  # integrity cannot be switched off by deleting it
    _refused_unchanged(path, lora, r"is an export of fsdp_bridge .* fsdp_bridge_export\.json is missing")


def _flip_last_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))


def _link_out(path: Path) -> None:
    outside = path.parent.parent / "elsewhere.json"
    path.rename(outside)
    path.symlink_to(outside)


MERGED_DAMAGE = {
    "flipped": (lambda p: _flip_last_bytes(p / "model.safetensors"), r"model\.safetensors: content differs"),
    "missing": (lambda p: (p / "generation_config.json").unlink(), r"generation_config\.json: listed in .*, missing"),
    "renamed": (
        lambda p: (p / "generation_config.json").rename(p / "generation.json"),
        r"generation\.json: not listed in fsdp_bridge_export\.json \(renamed or added after saving\)",
    ),
    "added": (lambda p: (p / "extra.bin").write_bytes(b"x"), r"extra\.bin: not listed"),
    "symlinked": (lambda p: _link_out(p / "generation_config.json"), r"generation_config\.json: a symlink"),
}


@pytest.mark.parametrize("damage", sorted(MERGED_DAMAGE))
def test_a_merged_export_is_verified_on_load(tmp_path: Path, lora: Any, damage: str) -> None:
    path = fsdp_bridge.save_checkpoint(tmp_path / "merged", lora, kind="merged")
    model = _model()
    assert fsdp_bridge.load_checkpoint(path, model) == {}
    change, match = MERGED_DAMAGE[damage]
    change(path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=match):
        fsdp_bridge.load_checkpoint(path, model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_an_adapter_file_symlinked_out_of_its_directory_is_refused(tmp_path: Path, lora: Any) -> None:
    path = _adapter(tmp_path, lora)
    outside = tmp_path / "elsewhere.safetensors"
    (path / "adapter_model.safetensors").rename(outside)
    (path / "adapter_model.safetensors").symlink_to(outside)
    _refused_unchanged(path, lora, r"adapter_model\.safetensors: is a symlink to .*outside the adapter directory")


def _rewrite(path: Path, change: Any) -> None:
    from safetensors.torch import load_file, save_file

    weights = path / "adapter_model.safetensors"
    save_file(change(load_file(str(weights))), str(weights))


@pytest.mark.parametrize("how", ["half", "none"])
def test_an_adapter_missing_tensors_is_refused_naming_them(tmp_path: Path, lora: Any, how: str) -> None:
    lora.save_pretrained(tmp_path / "plain")  # PEFT's own directory: no checksums to trip on first
    _rewrite(tmp_path / "plain", lambda t: {k: t[k] for k in sorted(t)[: len(t) // 2]} if how == "half" else {})
    _refused_unchanged(tmp_path / "plain", lora, r"layers\.1\.self_attn\.v_proj\.lora_B\.weight: missing from the file")


def test_an_adapter_of_another_dtype_is_refused_not_cast(tmp_path: Path, lora: Any) -> None:
    lora.save_pretrained(tmp_path / "plain")
    _rewrite(tmp_path / "plain", lambda t: {k: (v * 100).to(torch.int64) for k, v in t.items()})
    _refused_unchanged(tmp_path / "plain", lora, r"lora_A\.weight: int64 in the file, float32 in the model \(not cast")


# --------------------------------------------------------------------------------------
# optimizer.json: hyperparameters and parameter names checked on load
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_with_optimizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    return fsdp_bridge.save_checkpoint(tmp_path_factory.mktemp("opt") / "full", model, opt, kind="full")


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("lr", "fast", r"param_groups\[0\]\.lr: got 'fast', expected a finite number"),
        ("betas", [2, 3, 4], r"param_groups\[0\]\.betas: got \[2, 3, 4\], expected a list of 2 value"),
        ("betas", [2.0, 3.0], r"param_groups\[0\]\.betas: got \[2\.0, 3\.0\], expected a list of values each in"),
        ("weight_decay", None, r"param_groups\[0\]\.weight_decay: got None, expected a finite number"),
        (
            "params",
            ["no.such.parameter"],
            r"param_groups\[0\]\.params: 21 name\(s\) that are no parameter of the model \(.no\.such\.parameter.",
        ),
    ],
)
def test_optimizer_groups_are_type_checked_on_load(
    tmp_path: Path, full_with_optimizer: Path, key: str, value: Any, match: str
) -> None:
    import json
    import shutil

    from fsdp_bridge.testing.damage import redescribe

    path = Path(shutil.copytree(full_with_optimizer, tmp_path / "full"))
    extra = json.loads((path / "optimizer.json").read_text())
    if key == "params":  # as many names as the group has parameters, none of them the model's
        value = [f"no.such.parameter.{i}" for i in range(len(extra["param_groups"][0]["params"]))]
        value[0] = "no.such.parameter"
    extra["param_groups"][0][key] = value
    (path / "optimizer.json").write_text(json.dumps(extra))
    redescribe(path)  # as an attacker would: only the reader's own checks stand
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=match):
        fsdp_bridge.load_checkpoint(path, model, opt)
    assert opt.param_groups[0]["lr"] == 1e-3 and not opt.state
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_generated_damage_to_adapter_directories_is_refused_in_bounded_time(tmp_path: Path, lora: Any) -> None:
    """Random damage to an adapter export (bytes flipped anywhere, truncation, appended bytes, its
    description edited): every case is refused with a CheckpointError, within seconds, and the
    model is unchanged. The same damage to peft's own directory (no checksums) gives a CheckpointError
    or a load of well-formed values, never another exception."""
    import json
    import random
    import shutil
    import time

    rng = random.Random(27)
    export = _adapter(tmp_path, lora)
    lora.save_pretrained(tmp_path / "plain")
    pristine = {k: v.clone() for k, v in lora.state_dict().items()}

    def damage(directory: Path) -> None:
        how = rng.choice(["flip", "truncate", "append", "description", "key"])
        description = directory / "fsdp_bridge_export.json"
        if how in ("description", "key") and description.is_file():
            record = json.loads(description.read_text())
            if how == "key":  # a key renamed (one bit), deleted or added
                record[rng.choice(["filez", "checksum_algorithn", "extra"])] = record.pop(rng.choice(list(record)))
            else:
                entry = record["files"]["adapter_model.safetensors"]
                entry[rng.choice(["size", "checksum"])] = rng.choice([0, 1, 2**40, -1, "x", None])
            description.write_text(json.dumps(record))
            return
        weights = directory / "adapter_model.safetensors"
        data = bytearray(weights.read_bytes())
        if how == "truncate":
            data = data[: rng.randrange(len(data))]
        elif how == "append":
            data += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        else:
            for _ in range(rng.randrange(1, 4)):
                at = rng.randrange(min(len(data), 400) if rng.random() < 0.5 else len(data))  # header or anywhere
                data[at] ^= 1 << rng.randrange(8)
        weights.write_bytes(bytes(data))

    for case in range(24):
        for source, checked in ((export, True), (tmp_path / "plain", False)):
            target = tmp_path / f"case{case}_{source.name}"
            shutil.copytree(source, target)
            damage(target)
            start = time.perf_counter()
            try:
                fsdp_bridge.load_checkpoint(target, lora)
            except CheckpointError:
                pass
            else:
                assert not checked, f"case {case}: damage to an export loaded"
            assert time.perf_counter() - start < 10, f"case {case}: took {time.perf_counter() - start:.1f} s"
            if checked:
                assert all(torch.equal(v, lora.state_dict()[k]) for k, v in pristine.items()), case
            lora.load_state_dict(pristine)
