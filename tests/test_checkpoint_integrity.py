"""One flipped bit in a checkpoint's description never turns its integrity checks off.

The description (``fsdp_bridge.json``) carries the SHA-256 of its own canonical JSON; its
integrity fields are required; unknown keys are refused; every file DCP would read is listed
with a digest or checksum; a description too large to be one is refused before it is read; and
``latest_checkpoint`` falls back past a damaged newest checkpoint."""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdp_bridge
from fsdp_bridge.checkpoint import CheckpointError, detect, inspect_checkpoint, latest_checkpoint
from fsdp_bridge.checkpoint._formats import META_FILE, description_digest, read_meta, verify_manifest


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("integrity")
    model = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Linear(600, 4))  # a shard over 1 MiB
    fsdp_bridge.save_checkpoint(root / "step_1", model, state={"step": 1})
    return root / "step_1"


def copy(saved: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    return Path(shutil.copytree(saved, tmp_path / name))


def rewrite(path: Path, meta: dict[str, Any], *, seal: bool) -> None:
    if seal:
        meta = {**meta, "description_sha256": description_digest(meta)}
    (path / META_FILE).write_text(json.dumps(meta, indent=2))


def test_the_description_is_sealed_and_every_file_covered(saved: Path) -> None:
    meta = read_meta(saved)
    assert meta["version"] == 2 and meta["description_sha256"] == description_digest(meta)
    assert set(meta["files"]) == set(meta["digests"]) | set(meta["checksums"])
    assert "dcp/__0_0.distcp" in meta["checksums"] and "dcp/.metadata" in meta["digests"]


def test_a_flipped_bit_anywhere_in_the_description_is_refused(saved: Path, tmp_path: Path) -> None:
    path = copy(saved, tmp_path)
    original = (path / META_FILE).read_bytes()
    meta = read_meta(path)
    rng = random.Random(0)
    for _ in range(300):
        at, bit = rng.randrange(len(original)), rng.randrange(8)
        data = bytearray(original)
        data[at] ^= 1 << bit
        (path / META_FILE).write_bytes(bytes(data))
        try:
            again = read_meta(path)
        except CheckpointError as err:
            assert "fsdp_bridge.json" in str(err)
            continue
        assert again == meta, (at, bit)  # only a flip that changes nothing (e.g. \u00e9 -> \u00E9) is read


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda m: {("digesus" if k == "digests" else k): v for k, v in m.items()}, r"unknown field 'digesus'"),
        (lambda m: {k: v for k, v in m.items() if k != "checksums"}, r"field checksums is missing"),
        (lambda m: {**m, "checksums": {}}, r"'dcp/__0_0.distcp' is listed without a digest or checksum"),
        (lambda m: {**m, "extra": 1}, r"unknown field 'extra'"),
        (lambda m: {**m, "version": 0}, r"field version: 0, expected one of \[1, 2\]"),
        (lambda m: {**m, "version": 3}, r"format version 3 is newer"),
    ],
)
@pytest.mark.parametrize("seal", [False, True])
def test_integrity_fields_are_required_even_when_resealed(
    saved: Path, tmp_path: Path, edit: Any, match: str, seal: bool
) -> None:
    path = copy(saved, tmp_path)
    meta = {k: v for k, v in read_meta(path).items() if k != "description_sha256"}
    rewrite(path, edit(meta), seal=seal)
    with pytest.raises(CheckpointError, match=match if seal or "version" in match else r"description_sha256 does not"):
        read_meta(path)


def test_version_1_descriptions_load_with_their_integrity_fields_required(saved: Path, tmp_path: Path) -> None:
    path = copy(saved, tmp_path)
    meta = {k: v for k, v in read_meta(path).items() if k != "description_sha256"}
    rewrite(path, {**meta, "version": 1}, seal=False)  # what this package wrote before version 2
    assert detect(path).meta["version"] == 1
    verify_manifest(detect(path))
    rewrite(path, {k: v for k, v in meta.items() if k != "digests"} | {"version": 1}, seal=False)
    with pytest.raises(CheckpointError, match=r"field digests is missing \(required in version 1\)"):
        read_meta(path)


def test_a_dcp_file_not_listed_is_refused(saved: Path, tmp_path: Path) -> None:
    path = copy(saved, tmp_path)
    meta = {k: v for k, v in read_meta(path).items() if k != "description_sha256"}
    for key in ("files", "checksums"):
        meta[key] = {k: v for k, v in meta[key].items() if k != "dcp/__0_0.distcp"}
    rewrite(path, meta, seal=True)  # a consistent description that leaves the shard out
    with pytest.raises(CheckpointError, match=r"dcp/__0_0.distcp: not listed in fsdp_bridge.json"):
        verify_manifest(detect(path))
    with pytest.raises(CheckpointError, match=r"not listed"):
        fsdp_bridge.load_checkpoint(path, torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Linear(600, 4)))
    # A file added to dcp/ after the save is refused too.
    path2 = copy(saved, tmp_path, "added")
    (path2 / "dcp" / "__9_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"dcp/__9_0.distcp: not listed"):
        verify_manifest(detect(path2))


def test_inspect_reads_and_checks_the_dcp_metadata(saved: Path, tmp_path: Path) -> None:
    from fsdp_bridge.testing.damage import redescribe

    path = copy(saved, tmp_path)
    # A poisoned .metadata, with the description rewritten to match it: inspect used to say fine.
    (path / "dcp" / ".metadata").write_bytes(b"\x80\x04\x8c\x07pathlib\x8c\tPosixPath\x93N}\x86b.")
    redescribe(path)
    with pytest.raises(CheckpointError, match=r"dcp/\.metadata: is not DCP metadata"):
        inspect_checkpoint(path)


def test_a_huge_description_is_refused_before_it_is_read(saved: Path, tmp_path: Path) -> None:
    path = copy(saved, tmp_path)
    with open(path / META_FILE, "r+b") as f:
        f.truncate(6 << 30)  # sparse: 6 GiB on paper; reading it was a MemoryError
    with pytest.raises(CheckpointError, match=r"is 6442450944 bytes, over the 67108864-byte limit"):
        detect(path)


def test_latest_checkpoint_falls_back_past_a_damaged_newest(saved: Path, tmp_path: Path, caplog) -> None:
    root = tmp_path / "run"
    copy(saved, root, "step_1")
    newest = copy(saved, root, "step_2")
    meta = read_meta(newest)
    rewrite(newest, {**{k: v for k, v in meta.items() if k != "description_sha256"}, "step": 2}, seal=True)
    assert latest_checkpoint(root) == newest
    shard = newest / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated: cheap to see (the size)
    with caplog.at_level(logging.WARNING, logger="fsdp_bridge"):
        assert latest_checkpoint(root) == root / "step_1"
    assert "skipping" in caplog.text and "step_2" in caplog.text and "truncated" in caplog.text
    (newest / "dcp" / "__0_0.distcp").unlink()
    assert latest_checkpoint(root) == root / "step_1"


def test_a_failed_async_save_raises_checkpoint_error_not_a_base_exception(tmp_path: Path) -> None:
    import traceback
    from concurrent.futures import Future

    from torch.distributed.checkpoint.api import CheckpointException

    from fsdp_bridge.checkpoint._async import AsyncCheckpoint

    future: Future[object] = Future()
    pending = AsyncCheckpoint(tmp_path / "ckpt", future, None)
    disk_full = OSError(28, "No space left on device")
    future.set_exception(CheckpointException("save failed", {1: (disk_full, traceback.StackSummary())}))
    with pytest.raises(
        CheckpointError, match=r"ckpt: the background save failed: rank 1: OSError: \[Errno 28\]"
    ) as err:
        pending.wait()  # was torch's CheckpointException, which `except Exception` does not catch
    assert isinstance(err.value.__cause__, CheckpointException)
    publish_failed: Future[object] = Future()
    future2 = AsyncCheckpoint(tmp_path / "b", publish_failed, lambda: (_ for _ in ()).throw(OSError(5, "I/O error")))
    publish_failed.set_result(None)
    with pytest.raises(CheckpointError, match=r"b: the background save failed: OSError: \[Errno 5\] I/O error"):
        future2.wait()


def test_an_async_save_that_cannot_start_raises_checkpoint_error(tmp_path: Path, monkeypatch) -> None:
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    import fsdp_bridge.checkpoint._async as async_module

    def planning_fails(*args: object, **kwargs: object) -> None:
        raise CheckpointException("planning failed", {0: (ValueError("bad plan"), traceback.StackSummary())})

    monkeypatch.setattr(async_module, "_start", planning_fails)
    for _ in range(2):  # the path's save lock was released: the second try fails the same way
        with pytest.raises(CheckpointError, match=r"ckpt: the save could not start: rank 0: ValueError: bad plan"):
            async_module.save_checkpoint_async(tmp_path / "ckpt", torch.nn.Linear(2, 2))
