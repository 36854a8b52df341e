"""The trainer's only door to checkpoints: save, load, find the latest, rotate.

The trainer calls exactly these four functions.  They have the signatures of the
library's checkpoint API (``fsdp_bridge.save_checkpoint`` / ``load_checkpoint`` /
``latest_checkpoint``); until that API lands, this module implements them with a
minimal ``torch.distributed.checkpoint`` layout, so replacing it is a change to this
file only.

Layout of one checkpoint directory (written under ``<name>.tmp`` and renamed when every
rank has finished, so a crash never leaves a half-written checkpoint that looks whole):

- ``kind: sharded``: DCP files holding ``{"model": ..., "optim": ...}`` as returned by
  ``get_state_dict`` (original parameter names, reshardable to any world size);
- ``kind: full``: ``full.pt``, the gathered model and optimizer state dicts (rank 0);
- ``rng_rank<R>.pt``: each rank's torch / CUDA / Python RNG state;
- ``meta.json``: kind, world size and the caller's ``state`` (JSON: step, data position...).
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from fsdp_bridge.errors import ConfigError, Problem

__all__ = ["checkpoint_name", "full_state_options", "latest_checkpoint", "load_checkpoint", "prune_checkpoints",
           "save_checkpoint"]

_META = "meta.json"
_FULL = "full.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def full_state_options(model: nn.Module) -> StateDictOptions:
    """Options for a gathered (full) state dict of ``model``.

    Gathered tensors are moved to CPU only when the model is on an accelerator: on a
    CPU-only run, FSDP1's offloading path of the full state dict crashes (torch 2.13)
    and there is nothing to offload anyway.
    """
    on_accelerator = any(p.device.type != "cpu" for p in model.parameters())
    return StateDictOptions(full_state_dict=True, cpu_offload=on_accelerator)


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    kind: Literal["sharded", "full"] = "sharded", state: dict[str, Any] | None = None) -> Path:
    """Save model, optimizer, every rank's RNG and ``state`` (JSON-serialisable) to ``path``.

    Collective: call on every rank.  Returns ``path``.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    optimizers = [optimizer] if optimizer is not None else []
    if kind == "sharded":
        model_sd, optim_sd = get_state_dict(model, optimizers)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    else:
        model_sd, optim_sd = get_state_dict(model, optimizers, options=full_state_options(model))
        if rank == 0:
            torch.save({"model": model_sd, "optim": optim_sd}, tmp / _FULL)
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        meta = {"kind": kind, "world_size": world, "state": state or {}}
        (tmp / _META).write_text(json.dumps(meta, indent=1))
    _barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    _barrier()
    return path


def load_checkpoint(path: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load what :func:`save_checkpoint` wrote into ``model`` (and ``optimizer``); restore this
    rank's RNG; return the saved ``state``.  Collective: call on every rank."""
    path = Path(path)
    meta_file = path / _META
    if not meta_file.is_file():
        raise ConfigError([Problem("resume", str(path), "a checkpoint directory written by fsdp-bridge train",
                                   f"{meta_file} is missing")])
    meta = json.loads(meta_file.read_text())
    optimizers = [optimizer] if optimizer is not None else []
    if meta["kind"] == "sharded":
        model_sd, optim_sd = get_state_dict(model, optimizers)
        loaded: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=str(path))
        set_state_dict(model, optimizers, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    else:
        full = torch.load(path / _FULL, weights_only=True, map_location="cpu")
        set_state_dict(model, optimizers, model_state_dict=full["model"], optim_state_dict=full["optim"],
                       options=StateDictOptions(full_state_dict=True))
    rng_file = path / f"rng_rank{_rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return dict(meta["state"])


def _steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / _META).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint directory under ``root``, or None."""
    steps = _steps(Path(root))
    return steps[-1][1] if steps else None


def prune_checkpoints(root: str | Path, keep_last: int | None) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints under ``root`` (rank 0 only); return the deleted."""
    if keep_last is None or _rank() != 0:
        return []
    old = [p for _, p in _steps(Path(root))[:-keep_last]]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old
