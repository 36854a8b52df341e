"""Hugging Face model directories: consolidated safetensors (+ index) and ``config.json``.

Written with ``huggingface_hub.split_torch_state_dict_into_shards`` and
``safetensors.torch.save_file``: the same layout ``save_pretrained`` produces and
``from_pretrained`` reads.  Tied parameters (GPT-2's ``lm_head.weight`` = ``wte.weight``)
are stored once, under the name that comes first in the model, as Hugging Face does.
The full optimizer state sits beside the weights as ``optimizer.safetensors`` (tensors)
and ``optimizer.json`` (hyper-parameters and non-tensor state).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fsdp_bridge.checkpoint._formats import OPTIM_JSON, OPTIM_TENSORS, CheckpointError, safe_child

__all__ = [
    "drop_tied_aliases",
    "read_hf_shapes",
    "read_hf_weights",
    "read_optimizer",
    "write_hf_config",
    "write_hf_weights",
    "write_optimizer",
]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEFAULT_MAX_SHARD_SIZE = "5GB"


def drop_tied_aliases(state_dict: dict[str, torch.Tensor], tied: Iterable[Iterable[str]]) -> dict[str, torch.Tensor]:
    """Keep one name per tied group (the first), as ``save_pretrained`` does."""
    drop = {name for group in tied for name in list(group)[1:]}
    return {k: v for k, v in state_dict.items() if k not in drop}


def write_hf_weights(
    directory: Path, state_dict: dict[str, torch.Tensor], *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
) -> list[str]:
    """Write safetensors shards (and the index when there is more than one); return the file names."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(state_dict, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        shard = {n: state_dict[n].detach().contiguous().cpu() for n in names}
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {**split.metadata}, "weight_map": split.tensor_to_filename}
        (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return list(split.filename_to_tensors)


def write_hf_config(directory: Path, model: torch.nn.Module) -> bool:
    """Write ``config.json`` (and ``generation_config.json``) of a transformers model; False if it has none."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return False
    config.save_pretrained(str(directory))
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        try:
            gen.save_pretrained(str(directory))
        except (ValueError, TypeError):  # an inconsistent generation config must not fail the save
            pass
    return True


def _weight_files(directory: Path) -> list[Path]:
    if directory.is_file():
        return [directory]
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(index, f"is not a valid safetensors index ({err})") from err
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(index, "weight_map is not a mapping of tensor names to file names")
        files = [safe_child(directory, name) for name in sorted(set(weight_map.values()))]
    else:
        files = [safe_child(directory, SINGLE)]  # a symlink to a file elsewhere is refused
    for f in files:
        if not f.is_file():
            raise CheckpointError(f, "missing: the weights listed in the index are not all present")
    return files


def read_hf_shapes(directory: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype name) from the safetensors headers only (no tensor data is read)."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in _weight_files(directory):
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    sl = handle.get_slice(name)
                    out[name] = (tuple(sl.get_shape()), str(sl.get_dtype()))
        except Exception as err:  # safetensors raises its own SafetensorError for corrupt headers
            raise CheckpointError(f, f"is not a readable safetensors file ({err}); truncated or corrupt") from err
    return out


class WeightReader:
    """Reads tensors of a Hugging Face directory one at a time (no whole-model copy)."""

    def __init__(self, directory: Path) -> None:
        self.files = _weight_files(directory)
        self._where: dict[str, Path] = {}
        for f in self.files:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    self._where[name] = f

    def get(self, name: str) -> torch.Tensor:
        f = self._where[name]
        try:
            with safe_open(str(f), framework="pt") as handle:
                return handle.get_tensor(name)
        except Exception as err:
            raise CheckpointError(f, f"cannot read tensor {name} ({err}); truncated or corrupt") from err


def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory (or one .safetensors file), on CPU."""
    out: dict[str, torch.Tensor] = {}
    for f in _weight_files(directory):
        try:
            out.update(load_file(str(f)))
        except Exception as err:
            raise CheckpointError(f, f"cannot be read ({err}); truncated or corrupt") from err
    return out


def _jsonable(value: Any, where: str) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if value is None or isinstance(value, (bool, int, float, str, list, dict)):
        return value
    raise CheckpointError(
        where,
        f"optimizer value of type {type(value).__name__} cannot be stored; "
        "only tensors, numbers, strings, lists and dicts are supported",
    )


def write_optimizer(directory: Path, osd: dict[str, Any]) -> None:
    """Write a full optimizer state dict ({"state": {fqn: {...}}, "param_groups": [...]})."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, entries in osd.get("state", {}).items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{fqn}/{name}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(fqn, {})[name] = _jsonable(value, f"state.{fqn}.{name}")
    groups = [{k: _jsonable(v, f"param_groups.{k}") for k, v in g.items()} for g in osd.get("param_groups", [])]
    save_file(tensors, str(directory / OPTIM_TENSORS), metadata={"format": "pt"})
    (directory / OPTIM_JSON).write_text(json.dumps({"param_groups": groups, "scalars": scalars}, indent=2) + "\n")


def read_optimizer(directory: Path) -> dict[str, Any]:
    """Read back what :func:`write_optimizer` wrote; anything else is a :class:`CheckpointError`."""
    try:
        tensors = load_file(str(directory / OPTIM_TENSORS))
    except Exception as err:
        raise CheckpointError(directory / OPTIM_TENSORS, f"cannot be read ({err}); truncated or corrupt") from err
    where = directory / OPTIM_JSON
    try:
        extra = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(where, f"cannot be read ({err})") from err
    problems = []
    if not isinstance(extra, dict):
        problems.append(f"holds a JSON {type(extra).__name__}, expected an object with param_groups and scalars")
        extra = {}
    groups = extra.get("param_groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        problems.append(f"param_groups: got {groups!r:.60}, expected a list of groups, each with a params list")
    scalars = extra.get("scalars", {})
    if not isinstance(scalars, dict) or not all(isinstance(v, dict) for v in scalars.values()):
        problems.append(f"scalars: got {scalars!r:.60}, expected a mapping of parameter name to values")
    if problems:
        raise CheckpointError(
            where,
            [
                *problems,
                "the optimizer state is damaged; load without the optimizer "
                "(load_checkpoint(path, model)) or use another checkpoint",
            ],
        )
    state: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        fqn, _, name = key.rpartition("/")
        state.setdefault(fqn, {})[name] = value
    for fqn, entries in scalars.items():
        state.setdefault(fqn, {}).update(entries)
    return {"state": state, "param_groups": groups}
