"""save_checkpoint_async: training goes on during the write; what is saved is the state at the call."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import fsdp_bridge
from fsdp_bridge.testing import run_distributed
from fsdp_bridge.testing.models import build_tiny, sample_batch


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _async_round_trip(
    root: str, backend: str, mode: str, *, restart: bool = True, models: list[torch.nn.Module] | None = None
) -> dict[str, object]:
    config = fsdp_bridge.BridgeConfig(backend=backend)
    model = fsdp_bridge.shard(build_tiny("llama"), config)
    if models is not None:
        models.append(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step() -> None:
        model(**sample_batch(seed=dist.get_rank())).loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    at_call = _full(model)
    loop_state = {"step": 1}
    pending = fsdp_bridge.save_checkpoint_async(
        Path(root) / "step_1", model, opt, state=loop_state, keep_last=1, mode=mode
    )
    step()  # training continues while the checkpoint is written
    loop_state["step"] = 2  # and the loop updates its own state dict, as loops do
    changed = not all(torch.equal(at_call[k], v) for k, v in _full(model).items())
    path = pending.wait()
    dist.barrier()
    restored = fsdp_bridge.shard(build_tiny("llama", seed=3), config)
    state = fsdp_bridge.load_checkpoint(path, restored)
    same = all(torch.equal(at_call[k], v) for k, v in _full(restored).items())
    out = {
        "changed": changed,
        "same": same,
        "state": state,
        "done": pending.done(),
        "latest": str(fsdp_bridge.latest_checkpoint(root)),
    }
    # The model's checkpointer: a second save refills the same host copy; close() waits and frees
    # the writer's group and the copy, and a save after it makes new ones.
    from fsdp_bridge.checkpoint import checkpointer_of

    checkpointer = checkpointer_of(model)
    group = checkpointer.group()
    for name in ("step_2", "step_3"):
        if name == "step_3" and restart:
            checkpointer.close()
        step()
        at_call = _full(model)
        path = fsdp_bridge.save_checkpoint_async(Path(root) / name, model, opt, state={"step": 2}, mode=mode).wait()
        dist.barrier()  # rank 0 publishes after its own part
        fsdp_bridge.load_checkpoint(path, restored)
        out[f"{name}_same"] = all(torch.equal(at_call[k], v) for k, v in _full(restored).items())
    out["failed_on_rank_1"] = _async_save_failing_on_rank_1(root, model, mode)
    if restart:
        out["new_group_after_close"] = checkpointer.group() is not group
        checkpointer.close()
    return out


class _FullDiskWriter(dcp.FileSystemWriter):
    """Rank 1's writer: its disk is full (importable, so torch's checkpoint process can unpickle it)."""

    def write_data(self, plan: object, planner: object) -> object:
        raise OSError(errno.ENOSPC, "No space left on device")


def _async_save_failing_on_rank_1(root: str, model: torch.nn.Module, mode: str) -> str:
    """A save whose background write fails on rank 1: every rank's wait() raises, naming rank 1,
    and nothing is published (only the dot-named partial is left)."""
    from fsdp_bridge.checkpoint import _async

    real = _async.dcp.FileSystemWriter
    if dist.get_rank() == 1:
        _async.dcp.FileSystemWriter = _FullDiskWriter  # type: ignore[misc]
    try:
        pending = fsdp_bridge.save_checkpoint_async(Path(root) / "step_9", model, mode=mode)
    finally:
        _async.dcp.FileSystemWriter = real  # type: ignore[misc]
    try:
        pending.wait()
    except fsdp_bridge.CheckpointError as err:
        dist.barrier()
        assert not (Path(root) / "step_9").exists() and (Path(root) / ".step_9.partial").is_dir()
        assert fsdp_bridge.latest_checkpoint(root) == Path(root) / "step_3"
        return str(err)
    return "no error"


def _check_round_trip(r: dict[str, object], root: Path) -> None:
    assert r["changed"], "the test must train between the call and the write"
    assert r["same"], "the checkpoint must hold the weights as of the call, bit for bit"
    assert r["state"] == {"step": 1} and r["done"]
    assert r["step_2_same"] and r["step_3_same"]
    assert r["latest"] == str(root / "step_1")
    assert "the background save failed: rank 1: OSError: [Errno 28] No space left on device" in str(
        r["failed_on_rank_1"]
    )


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_async_save_captures_the_state_at_the_call(tmp_path: Path, backend: str) -> None:
    for r in run_distributed(_async_round_trip, 2, args=(str(tmp_path), backend, "thread")):
        _check_round_trip(r, tmp_path)
        assert r["new_group_after_close"]


def _process_round_trips(root: str) -> dict[str, object]:
    from fsdp_bridge.checkpoint import _process, checkpointer_of

    out: dict[str, object] = {}
    models: list[torch.nn.Module] = []
    for backend in ("fsdp1", "fsdp2"):  # one checkpoint process per rank serves both models
        out[backend] = _async_round_trip(f"{root}/{backend}", backend, "process", restart=False, models=models)
    process = _process.checkpoint_process()
    out["one_process"] = process is not None and process._save_process.is_alive()
    for model in models:
        checkpointer_of(model).close()  # waits, frees the host copy, ends the checkpoint process
    out["ended"] = _process.checkpoint_process() is None and not process._save_process.is_alive()
    return out


def test_process_async_save_keeps_every_guarantee_of_thread_saves(tmp_path: Path) -> None:
    # Grouped: spawning torch's checkpoint process costs an import of torch per rank, paid once here.
    for r in run_distributed(_process_round_trips, 2, args=(str(tmp_path),), timeout_s=240):
        for backend in ("fsdp1", "fsdp2"):
            _check_round_trip(r[backend], tmp_path / backend)  # type: ignore[arg-type]
        assert r["one_process"] and r["ended"]


def test_async_mode_is_checked_before_anything_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"mode must be one of 'thread', 'process' \(got 'processes'\)"):
        fsdp_bridge.save_checkpoint_async(tmp_path / "ckpt", torch.nn.Linear(2, 2), mode="processes")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
    # A daemonic rank (multiprocessing's daemon=True) may not start torch's checkpoint process: said before anything.
    import multiprocessing
    from types import SimpleNamespace

    monkeypatch.setattr(multiprocessing, "current_process", lambda: SimpleNamespace(daemon=True))
    with pytest.raises(ValueError, match=r"daemonic .* start the ranks with daemon=False .* or use mode='thread'"):
        fsdp_bridge.save_checkpoint_async(tmp_path / "ckpt", torch.nn.Linear(2, 2), mode="process")
    assert list(tmp_path.iterdir()) == []


def _save_fails_on_one_rank(root: str) -> dict[str, object]:
    import errno
    import time

    import fsdp_bridge.checkpoint._save as api

    model = fsdp_bridge.shard(build_tiny("llama", seed=0), fsdp_bridge.BridgeConfig(backend="fsdp2"))
    out: dict[str, object] = {}
    from torch.distributed.checkpoint import _consolidate_hf_safetensors as assembly

    real_rng, real_assemble = api.write_rng, assembly._consolidate_safetensors_files

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    # Rank 1's disk is full while it writes its RNG file (sharded save) ...
    api.write_rng = full_disk if dist.get_rank() == 1 else real_rng  # type: ignore[assignment]
    start = time.monotonic()
    try:
        fsdp_bridge.save_checkpoint(Path(root) / "a", model)
    except fsdp_bridge.CheckpointError as err:
        out["sharded"] = str(err)
    api.write_rng = real_rng  # type: ignore[assignment]
    # ... and rank 0's while it writes its rows into the full weights' files (FSDP2, in place) ...
    from fsdp_bridge.checkpoint import _hf

    real_in_place = _hf._write_flat_pieces
    if dist.get_rank() == 0:
        _hf._write_flat_pieces = full_disk  # type: ignore[assignment]
    try:
        fsdp_bridge.save_checkpoint(Path(root) / "b", model, kind="full")
    except fsdp_bridge.CheckpointError as err:
        out["full"] = str(err)
    _hf._write_flat_pieces = real_in_place
    # ... and, on FSDP1 (each rank writes its flat ranges into the files in place), rank 1's ...
    if dist.get_rank() == 1:
        _hf._write_flat_pieces = full_disk  # type: ignore[assignment]
    fsdp1 = fsdp_bridge.shard(build_tiny("llama", seed=0), fsdp_bridge.BridgeConfig(backend="fsdp1"))
    try:
        fsdp_bridge.save_checkpoint(Path(root) / "d", fsdp1, kind="full")
    except fsdp_bridge.CheckpointError as err:
        out["full_fsdp1"] = str(err)
    _hf._write_flat_pieces = real_in_place
    # ... and rank 0's while it assembles a file from every rank's slices (a model torch sharded
    # on dim 1, which no rank writes in place).
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    dim1 = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Linear(8, 4))
    fully_shard(dim1, shard_placement_fn=lambda param: Shard(1) if param.dim() == 2 else None)
    if dist.get_rank() == 0:
        assembly._consolidate_safetensors_files = full_disk  # type: ignore[assignment]
    try:
        fsdp_bridge.save_checkpoint(Path(root) / "e", dim1, kind="full")
    except fsdp_bridge.CheckpointError as err:
        out["full_assembly"] = str(err)
    assembly._consolidate_safetensors_files = real_assemble
    out["seconds"] = time.monotonic() - start
    fsdp_bridge.save_checkpoint(Path(root) / "c", model)  # the group is still usable
    return out


def test_a_save_failing_on_one_rank_fails_every_rank_promptly(tmp_path: Path) -> None:
    for r in run_distributed(_save_fails_on_one_rank, 2, args=(str(tmp_path),), timeout_s=180):
        assert "rank 1: writing the RNG state failed: OSError: [Errno 28] No space left on device" in r["sharded"]
        assert "rank 0: assembling the full state's files failed: OSError: [Errno 28] No space" in r["full"]
        assert "rank 1: assembling the full state's files failed: OSError: [Errno 28] No space" in r["full_fsdp1"]
        assert "rank 0: assembling the full state's files failed: OSError: [Errno 28] No space" in r["full_assembly"]
        assert r["seconds"] < 60  # not the process-group timeout (600 s)
    assert fsdp_bridge.latest_checkpoint(tmp_path) == tmp_path / "c"


def test_the_process_mode_makes_room_for_its_shared_copy_among_open_files(monkeypatch: pytest.MonkeyPatch) -> None:
    # Linux shares each tensor of the staged copy as an open file: 1,600 tensors (a 400-parameter model with
    # AdamW) pass the common soft limit of 1024, so the soft limit is raised to the hard one ...
    import resource

    from fsdp_bridge.checkpoint._process import fit_open_files

    state = {"model": {f"w{i}": torch.zeros(1) for i in range(400)}, "optim": {"state": [[torch.zeros(1)] * 3] * 400}}
    limits = [(1024, 4096)]
    monkeypatch.setattr(resource, "getrlimit", lambda _which: limits[-1])
    monkeypatch.setattr(resource, "setrlimit", lambda _which, value: limits.append(value))
    fit_open_files(state)
    assert limits[-1] == (4096, 4096)
    # ... and where even the hard limit is too low, the error says so with the numbers and the fixes.
    limits.append((1024, 1500))
    with pytest.raises(
        ValueError, match=r"each of the 1600 tensors .* at most 1500 files .*ulimit -n \d+ .* mode='thread'"
    ):
        fit_open_files(state)
    limits.append((1024, 1500))
    fit_open_files({"model": {"w": torch.zeros(1)}})  # room enough: nothing changed
    assert limits[-1] == (1024, 1500)
