"""Loads from the files of a whole state (a Hugging Face directory, a ``torch.save`` file): rank 0 reads
and broadcasts in rounds, or every rank reads only the slices its shards hold.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

from fsdp_bridge._lora import base_weight_name
from fsdp_bridge._optim_state import init_step_undone
from fsdp_bridge.checkpoint import _hf, _peft
from fsdp_bridge.checkpoint._formats import CheckpointError, Detected, Kind, strip_wrapper_prefixes
from fsdp_bridge.checkpoint._model_state import (
    aliases_to_fill,
    bridge_of,
    full_state_options,
    global_shapes,
    size_of,
    template_of,
)
from fsdp_bridge.checkpoint._optim_groups import group_problems
from fsdp_bridge.checkpoint._ranks import agree_on, rank_world

__all__ = ["base_names", "full_shapes", "load_full", "load_hf_sliced", "read_torch_file", "tied_in_files"]


def read_torch_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises several types for truncated or non-torch files
        raise CheckpointError(
            path,
            f"cannot be read with torch.load(weights_only=True) ({err}); "
            "it is truncated, corrupt, or holds arbitrary Python objects",
        ) from err
    if not isinstance(obj, dict):
        raise CheckpointError(path, f"holds a {type(obj).__name__}, expected a state dict (a dict of tensors)")
    optim = None
    if isinstance(obj.get("model"), dict):
        optim = obj.get("optimizer", obj.get("optim"))
        obj = obj["model"]
    sd = {strip_wrapper_prefixes(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    return sd, optim if isinstance(optim, dict) else None


def full_shapes(detected: Detected) -> dict[str, tuple[int, ...]]:
    if detected.kind is Kind.TORCH:
        sd, _ = read_torch_file(detected.path)
        return {k: tuple(v.shape) for k, v in sd.items()}
    return {k: shape for k, (shape, _) in _hf.read_hf_shapes(detected.path).items()}


_CHUNK_NUMEL = 256 * 2**20
"""Full loads broadcast about this many elements per round (1 GiB of fp32), so that rank 0
holds one chunk of the checkpoint at a time rather than all of it.  Each round is one
set_model_state_dict call (for FSDP1 one unshard of every unit), hence not smaller."""


def _chunks(found: Mapping[str, tuple[int, ...]], tied: list[list[str]]) -> list[list[str]]:
    """Checkpoint names in rounds of about _CHUNK_NUMEL elements; tied aliases join their source."""
    fill = aliases_to_fill(tied, set(found))
    rounds: list[list[str]] = [[]]
    size = 0
    for name, shape in found.items():
        if size and size + math.prod(shape) > _CHUNK_NUMEL:
            rounds.append([])
            size = 0
        rounds[-1].append(name)
        rounds[-1].extend(alias for alias, source in fill.items() if source == name)
        size += math.prod(shape)
    return rounds


def _optimizer_misfit(
    osd: Mapping[str, Any], optimizer: torch.optim.Optimizer, shapes: Mapping[str, tuple[int, ...]]
) -> str | None:
    """Why a full optimizer state dict cannot be loaded into ``optimizer`` of a model whose
    parameters have the (global) ``shapes`` (None if it can).  torch's ``load_state_dict``
    checks none of the per-parameter tensors: a wrong shape would load and fail at the step."""
    groups = osd.get("param_groups")
    if not isinstance(groups, list) or not isinstance(osd.get("state"), dict):
        return "the optimizer state has no param_groups list or no state mapping"
    if len(groups) != len(optimizer.param_groups):
        return (
            f"the optimizer state has {len(groups)} parameter group(s), the optimizer "
            f"{len(optimizer.param_groups)}; build the optimizer with the groups it was saved with"
        )
    for i, (saved, ours) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        params = saved.get("params") if isinstance(saved, dict) else None
        if not isinstance(params, list) or len(params) != len(ours["params"]):
            return (
                f"parameter group {i} holds {len(params) if isinstance(params, list) else params!r} "
                f"parameter(s) in the checkpoint, {len(ours['params'])} in the optimizer"
            )
    wrong = group_problems(groups, optimizer, shapes)
    by_key: Mapping[Any, tuple[int, ...]] = shapes
    if osd["state"] and all(isinstance(k, int) for k in osd["state"]):
        # optimizer.state_dict() keys parameters by position (torch loads those as they are)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        by_key = {i: tuple(p.shape) for i, p in enumerate(params)}
    for fqn, entries in osd["state"].items():
        if fqn not in by_key or not isinstance(entries, dict):
            wrong.append(f"state for {fqn!r:.80}, which is not a parameter of the model")
            continue
        for name, value in entries.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0 and tuple(value.shape) != tuple(by_key[fqn]):
                wrong.append(f"{fqn}.{name}: shape {list(value.shape)}, the parameter has {list(by_key[fqn])}")
    if wrong:
        return "; ".join(wrong[:5]) + (f"; and {len(wrong) - 5} more" if len(wrong) > 5 else "")
    return None


def load_full(
    detected: Detected,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    template: dict[str, Any],
    tied: list[list[str]],
    found: Mapping[str, tuple[int, ...]],
) -> None:
    """Rank 0 reads the consolidated weights a chunk at a time; each chunk is broadcast and
    every rank keeps its shard.  ``found`` (names and shapes from the headers) is known on
    every rank, so every rank runs the same rounds.  Everything that can be refused (the
    files, the optimizer state) is checked before the first tensor is copied into the model;
    after the headers are checked, safetensors data cannot fail to read (any bytes are values)."""
    with contextlib.ExitStack() as files:  # rank 0's weight files, open while the rounds run
        rank, _ = rank_world()
        get: Callable[[str], torch.Tensor] | None = None
        osd: dict[str, Any] = {}
        error = None
        if rank == 0:
            try:
                if detected.kind is Kind.TORCH:
                    sd_all, torch_osd = read_torch_file(detected.path)  # memory-mapped
                    osd = torch_osd or {}
                    get = sd_all.__getitem__
                else:
                    get = files.enter_context(_hf.WeightReader(detected.path)).get
                    if optimizer is not None and detected.meta.get("has_optimizer"):
                        osd = _hf.read_optimizer(detected.path)
                if optimizer is not None and not osd:
                    error = "holds no optimizer state; call load_checkpoint(path, model) without the optimizer"
                elif optimizer is not None:
                    misfit = _optimizer_misfit(osd, optimizer, {k: size_of(v) for k, v in template.items()})
                    error = None if misfit is None else f"does not fit the optimizer: {misfit}"
            except CheckpointError as err:
                error = f"{err.path}: {'; '.join(err.problems)}"
        error = agree_on(error)
        if error is not None:
            raise CheckpointError(detected.path, error)
        distributed = dist.is_initialized()
        if optimizer is not None:  # first: if torch refuses it, the model is still untouched
            try:
                with init_step_undone(optimizer, reading=False):
                    set_optimizer_state_dict(
                        model, optimizer, osd, options=full_state_options(model, broadcast_from_rank0=distributed)
                    )
            except (KeyError, ValueError, TypeError, RuntimeError) as err:
                raise CheckpointError(
                    detected.path, f"the optimizer state does not fit the optimizer ({type(err).__name__}: {err})"
                ) from None
        fill = aliases_to_fill(tied, set(found))
        options = full_state_options(model, broadcast_from_rank0=distributed, strict=False)
        for names in _chunks(found, tied):
            sd: dict[str, Any] = {}
            if get is not None:
                for name in names:
                    value = get(fill.get(name, name))
                    if name in template and value.dtype != template[name].dtype:  # e.g. bf16 weights, fp32 model
                        value = value.to(template[name].dtype)
                    sd[name] = value
            set_model_state_dict(model, sd, options=options)
            del sd


def load_hf_sliced(
    directory: Path,
    model: nn.Module,
    tied: list[list[str]],
    found: Mapping[str, tuple[int, ...]],
    *,
    names: Mapping[str, str] | None = None,
) -> None:
    """Every rank reads only the slices of the safetensors files that its shards hold, straight
    into them: no rank holds more of the checkpoint than its shards and one tensor in flight.
    Names and shapes are checked before (the headers); after that safetensors data cannot fail
    to read (any bytes are values), so writing in place keeps a refused load all or nothing.
    ``names``: model name -> name in the files (a PEFT model over its base's directory; entries
    without one, the adapters, are left as they are)."""

    def file_of(name: str) -> str | None:
        return name if names is None else names.get(name)

    fill = aliases_to_fill(tied if names is None else tied_in_files(tied, names), set(found))
    bridge = bridge_of(model)
    if bridge is not None:
        with _hf.WeightReader(directory) as reader:

            def read_rows(name: str, start: int, stop: int) -> torch.Tensor | None:
                stored = file_of(name)
                return None if stored is None else reader.rows(fill.get(stored, stored), start, stop)

            filled = bridge.impl.load_local(bridge.model, read_rows)
            if filled is not None:
                with torch.no_grad():  # buffers are whole on every rank
                    for name, buf in bridge.model.named_buffers():
                        stored = file_of(strip_wrapper_prefixes(name))
                        if stored is not None and (stored in found or stored in fill):
                            buf.copy_(reader.get(fill.get(stored, stored)))
                            filled.add(strip_wrapper_prefixes(name))
                if set(found) <= {file_of(n) for n in filled}:
                    return
                # Some weights are outside every unit (ignored modules): DCP reads them all.
    template = template_of(model)
    request: dict[str, Any] = {}  # name in the files -> this rank's shard of one model entry
    readers: dict[str, str] = {}  # model name -> name in the files
    for name, value in template.items():
        stored = file_of(name)
        if stored is None:
            continue
        readers[name] = stored
        if stored in found and stored not in request:
            request[stored] = value  # this rank's shards themselves
    _hf.read_hf_slices(request, directory)
    for alias, source in fill.items():  # a tied name stored once
        request[alias] = request[source]
    loaded = {name: request[stored] for name, stored in readers.items() if stored in request}
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=names is None))


def base_names(model: nn.Module, found: Mapping[str, tuple[int, ...]]) -> dict[str, str] | None:
    """For a PEFT model whose names are not those of the files: model name -> the base model's
    name, for every entry that is not an adapter's (None: the names are the model's own)."""
    own = global_shapes(model)
    if set(found) <= set(own) or not any(k.startswith("base_model.model.") for k in own):
        return None
    if _peft.find_peft_model(model) is None:
        return None
    return {k: base for k in own if (base := base_weight_name(k)) is not None}


def tied_in_files(tied: list[list[str]], names: Mapping[str, str]) -> list[list[str]]:
    groups = [list(dict.fromkeys(names[n] for n in group if n in names)) for group in tied]
    return [g for g in groups if len(g) > 1]
