"""Checkpoints at fsspec URLs in one process: memory:// and file://. Two ranks on a real S3
endpoint are in tests/test_checkpoint_s3.py."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import fsdp_bridge
from fsdp_bridge.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, rotate_checkpoints
from fsdp_bridge.checkpoint._atomic import OWNER_TEXT
from fsdp_bridge.testing.models import build_tiny, sample_batch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def root() -> Iterator[str]:
    """A fresh memory:// prefix, removed after the test."""
    name = f"/objstore-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(name):
        fs.rm(name, recursive=True)


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_tiny("llama", seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(**sample_batch("llama", seed=seed)).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def _objects(url: str) -> dict[str, bytes]:
    fs, path = fsspec.core.url_to_fs(url)
    return {p[len(path) + 1 :]: fs.cat_file(p) for p in fs.find(path)}


def test_save_load_latest_and_rotation_on_memory(root: str) -> None:
    model, optimizer = _model(seed=0)
    for step in (1, 2, 3):
        got = fsdp_bridge.save_checkpoint(
            f"{root}/ckpt/step_{step:08d}", model, optimizer, state={"step": step}, keep_last=2
        )
        assert str(got).endswith(f"step_{step:08d}")
    # Rotation left the two newest; nothing else under the root (no staging prefix, no leftovers).
    assert [s for s, _ in list_checkpoints(f"{root}/ckpt")] == [2, 3]
    assert {k.split("/")[1] for k in _objects(root)} == {"step_00000002", "step_00000003"}
    latest = latest_checkpoint(f"{root}/ckpt")
    assert latest == f"memory://{root[len('memory://') :]}/ckpt/step_00000003"
    other, other_opt = _model(seed=5)
    assert not _same(model, other)
    assert fsdp_bridge.load_checkpoint(latest, other, other_opt) == {"step": 3}
    assert _same(model, other)
    assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


def test_a_prefix_without_a_description_is_not_a_checkpoint(root: str) -> None:
    """The description is the commit marker: a save that died before writing it left nothing
    latest_checkpoint returns or load_checkpoint reads."""
    model, _ = _model()
    fsdp_bridge.save_checkpoint(f"{root}/step_00000001", model, state={"step": 1})
    fsdp_bridge.save_checkpoint(f"{root}/step_00000002", model, state={"step": 2})
    fs = fsspec.filesystem("memory")
    fs.rm_file(f"{root[len('memory://') :]}/step_00000002/fsdp_bridge.json")
    assert latest_checkpoint(root).endswith("step_00000001")
    with pytest.raises(CheckpointError, match=r"no fsdp_bridge\.json"):
        fsdp_bridge.load_checkpoint(f"{root}/step_00000002", model)


def test_a_damaged_shard_is_refused_naming_it(root: str) -> None:
    model, _ = _model()
    url = f"{root}/step_00000001"
    fsdp_bridge.save_checkpoint(url, model)
    fs, path = fsspec.core.url_to_fs(url)
    shard = f"{path}/dcp/__0_0.distcp"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    other, _ = _model(seed=5)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"dcp/__0_0\.distcp: content (is damaged|differs)"):
        fsdp_bridge.load_checkpoint(url, other)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())  # untouched


def test_a_users_objects_are_never_replaced_or_rotated(root: str) -> None:
    model, _ = _model()
    fs, path = fsspec.core.url_to_fs(root)
    fs.pipe_file(f"{path}/mine/notes.txt", b"keep me")
    with pytest.raises(CheckpointError, match="may be your objects"):
        fsdp_bridge.save_checkpoint(f"{root}/mine", model)
    assert fs.cat_file(f"{path}/mine/notes.txt") == b"keep me"
    # A checkpoint copied in by hand without its owner object is listed but never rotated out.
    fsdp_bridge.save_checkpoint(f"{root}/step_00000001", model, state={"step": 1})
    fs.rm_file(f"{path}/step_00000001/.fsdp_bridge.owner")
    for step in (2, 3):
        fsdp_bridge.save_checkpoint(f"{root}/step_{step:08d}", model, state={"step": step}, keep_last=1)
    assert [s for s, _ in list_checkpoints(root)] == [1, 3]
    assert rotate_checkpoints(root, 1) == []


def test_overwriting_a_checkpoint_and_a_killed_saves_leftovers(root: str) -> None:
    model, _ = _model()
    url = f"{root}/last"
    fsdp_bridge.save_checkpoint(url, model, state={"step": 1})
    fs, path = fsspec.core.url_to_fs(root)
    fs.pipe_file(f"{path}/.last.partial/.fsdp_bridge.owner", OWNER_TEXT)
    fs.pipe_file(f"{path}/.last.partial/dcp/__0_0.distcp", b"half")  # what a killed save left
    other, _ = _model(seed=3)
    fsdp_bridge.save_checkpoint(url, other, state={"step": 2})
    assert fsdp_bridge.load_checkpoint(url, model) == {"step": 2}
    assert _same(model, other)
    assert not fs.exists(f"{path}/.last.partial")


def test_a_second_save_taking_over_the_staging_prefix_is_not_published(root: str) -> None:
    from fsdp_bridge.checkpoint import _remote

    model, _ = _model()
    real = _remote.publish

    def taken_over(staging: Any, dest: Any, meta: Any, *, claim: bytes) -> None:
        (staging / ".fsdp_bridge.claim").write_bytes(b"save of another job\n")
        real(staging, dest, meta, claim=claim)

    _remote.publish = taken_over  # type: ignore[assignment]
    try:
        with pytest.raises(CheckpointError, match="another save of this path took over"):
            fsdp_bridge.save_checkpoint(f"{root}/step_00000001", model)
    finally:
        _remote.publish = real  # type: ignore[assignment]
    assert latest_checkpoint(root) is None


def test_a_full_checkpoint_at_a_url(root: str) -> None:
    """kind="full" is assembled locally, uploaded and published with its description last; a load
    fetches a local copy and checks it as any directory."""
    model, optimizer = _model(seed=0)
    for step in (1, 2):
        fsdp_bridge.save_checkpoint(
            f"{root}/step_{step:08d}", model, optimizer, kind="full", state={"step": step}, keep_last=1
        )
    names = set(_objects(f"{root}/step_00000002"))
    assert {"model.safetensors", "config.json", "fsdp_bridge.json", ".fsdp_bridge.owner"} <= names
    assert [s for s, _ in list_checkpoints(root)] == [2]
    other, other_opt = _model(seed=5)
    assert fsdp_bridge.load_checkpoint(latest_checkpoint(root), other, other_opt) == {"step": 2}
    assert _same(model, other)


def test_urls_refuse_what_they_do_not_support(root: str) -> None:
    model, _ = _model()
    with pytest.raises(CheckpointError, match="kind='merged' cannot be saved to a URL"):
        fsdp_bridge.save_checkpoint(f"{root}/export", model, kind="merged")
    with pytest.raises(CheckpointError, match=r"not installed|fsspec"):
        fsdp_bridge.save_checkpoint("nosuchproto://bucket/x", model)
    with pytest.raises(CheckpointError, match="writes local directories only"):
        fsdp_bridge.save_checkpoint_async(f"{root}/step_00000001", model)
    assert not Path("memory:").exists()  # never mistaken for a local path


def test_a_file_url_leaves_no_empty_directories(tmp_path: Path) -> None:
    """file:// goes through fsspec's local file system: directories are made and removed around
    the objects (two ranks writing their own objects run on S3 in tests/test_checkpoint_s3.py)."""
    model, optimizer = _model(seed=0)
    url = f"file://{tmp_path}/ckpt"
    for step in (1, 2):
        fsdp_bridge.save_checkpoint(f"{url}/step_{step:08d}", model, optimizer, state={"step": step}, keep_last=1)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000002"]
    other, other_opt = _model(seed=5)
    assert fsdp_bridge.load_checkpoint(latest_checkpoint(url), other, other_opt) == {"step": 2}
    assert _same(model, other)


def test_inspect_and_convert_at_urls(root: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp_bridge.checkpoint import convert_checkpoint, inspect_checkpoint
    from fsdp_bridge.cli import main

    model, optimizer = _model(seed=0)
    url = f"{root}/step_00000001"
    fsdp_bridge.save_checkpoint(url, model, optimizer, state={"step": 1})
    info = inspect_checkpoint(url)
    assert (info["path"], info["kind"], info["step"], info["has_optimizer"]) == (url, "sharded", 1, True)
    assert main(["inspect", url]) == 0
    assert url in capsys.readouterr().out
    # URL -> URL (published there as a save is) and URL -> local directory.
    assert convert_checkpoint(url, f"{root}/hf", to="hf") == f"{root}/hf"
    assert inspect_checkpoint(f"{root}/hf")["converted_from"] == {"path": url, "kind": "sharded"}
    assert main(["convert", url, str(tmp_path / "sharded"), "--to", "sharded"]) == 0
    for converted in (f"{root}/hf", tmp_path / "sharded"):
        other, other_opt = _model(seed=5)
        assert fsdp_bridge.load_checkpoint(converted, other, other_opt) == {"step": 1}
        assert _same(model, other)
    with pytest.raises(CheckpointError, match="--to torch writes one local file"):
        convert_checkpoint(url, f"{root}/model.pt", to="torch")


def test_the_train_command_sees_a_finished_run_at_a_url(root: str) -> None:
    from types import SimpleNamespace

    from fsdp_bridge.cli.train import _finished_step

    model, _ = _model()
    fsdp_bridge.save_checkpoint(f"{root}/run/checkpoints/step_00000006", model, state={"step": 6})
    assert _finished_step(SimpleNamespace(resume="auto", max_steps=6, output_dir=f"{root}/run")) == 6
    assert _finished_step(SimpleNamespace(resume="auto", max_steps=8, output_dir=f"{root}/run")) is None


def test_a_staging_prefix_created_by_another_save_meanwhile_is_refused(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner object is a conditional put: a save that finds it created since it cleaned the
    staging prefix (another save of the same path started) refuses instead of mixing objects."""
    from fsdp_bridge.checkpoint import _remote

    model, _ = _model()
    fs, path = fsspec.core.url_to_fs(root)
    fs.pipe_file(f"{path}/.step_00000001.partial/.fsdp_bridge.owner", OWNER_TEXT)
    monkeypatch.setattr(_remote, "_remove", lambda where, role: None)  # the other save's claim lands after it
    with pytest.raises(CheckpointError, match="is being saved by another process"):
        fsdp_bridge.save_checkpoint(f"{root}/step_00000001", model)
    assert fs.cat_file(f"{path}/.step_00000001.partial/.fsdp_bridge.owner") == OWNER_TEXT
