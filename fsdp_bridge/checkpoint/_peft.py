"""PEFT (LoRA) exports of a sharded model: an adapter directory, or the base with adapters merged.

``kind="adapter"`` writes what ``peft.PeftModel.from_pretrained(base, path)`` loads
(``adapter_config.json`` + ``adapter_model.safetensors``); ``kind="merged"`` writes a plain
Hugging Face directory of the base model with the adapters merged into its weights, which
``from_pretrained`` loads without peft.  Both gather the full state once (every rank takes
part), and rank 0 writes into a hidden staging directory published by one rename.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from fsdp_bridge._lora import has_4bit
from fsdp_bridge.checkpoint._atomic import SaveLock, partial_path, publish
from fsdp_bridge.checkpoint._formats import CheckpointError

__all__ = ["PEFT_KINDS", "find_peft_model", "is_adapter_dir", "load_adapter", "save_peft"]

PEFT_KINDS = ("adapter", "merged")
PeftKind = Literal["adapter", "merged"]
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def find_peft_model(model: nn.Module) -> Any | None:
    """The ``peft.PeftModel`` inside ``model`` (the model itself, or under a wrapper), if any."""
    try:
        from peft import PeftModel
    except ImportError:
        return None
    return next((m for m in model.modules() if isinstance(m, PeftModel)), None)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _check_destination(path: Path) -> None:
    """Only an earlier export of the same kind may be replaced: never a user's directory."""
    if not path.exists():
        return
    ours = (path / "adapter_config.json").is_file() or (path / "config.json").is_file()
    if not path.is_dir() or not ours:
        raise CheckpointError(
            path,
            "exists and is not an adapter or Hugging Face model directory; refusing to "
            "replace it (choose a new path or remove it yourself)",
        )


def save_peft(
    path: str | os.PathLike[str], model: nn.Module, kind: PeftKind, *, full_state_dict: Any, max_shard_size: int | str
) -> Path:
    """Write ``model``'s adapters (or the merged model) to ``path``; call on every rank.

    ``full_state_dict`` are the options of a gathered state dict for ``model``'s backend.
    """
    peft_model = find_peft_model(model)
    if peft_model is None:
        raise CheckpointError(
            path,
            f"kind={kind!r} needs a PEFT model (peft.get_peft_model(base, LoraConfig(...)) "
            "before fsdp_bridge.shard); this model has no adapters: use kind='full'",
        )
    target = Path(path)
    quantized = has_4bit(peft_model)
    if quantized and kind == "merged":
        raise CheckpointError(
            path,
            "kind='merged' of a model with a 4-bit (bitsandbytes) base: its weights are NF4/FP4 codes, "
            "and adapters merged into them would be rounded to 4 bits; save kind='adapter', then in one "
            "process load the base unquantized (from_pretrained without quantization_config), "
            "PeftModel.from_pretrained(base, adapter_dir).merge_and_unload(), and save_pretrained that",
        )
    _check_destination(target)
    state = get_model_state_dict(model, options=full_state_dict)  # collective: every rank

    def write() -> None:  # rank 0, under the path's save lock
        if _rank() != 0:
            return
        with SaveLock(target):
            staging = partial_path(target)
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
            if kind == "adapter":
                # A 4-bit base's packed codes do not fit the unquantized rebuild: only the adapters go in.
                _write_adapter(peft_model, tensors, staging, adapters_only=quantized)
            else:
                _write_merged(peft_model, tensors, staging, max_shard_size=max_shard_size)
            publish(staging, target)  # the previous export moved aside, deleted once this one is in place

    from fsdp_bridge.checkpoint._api import _on_every_rank

    # A failure on rank 0 (a full disk, another save of this path) reaches every rank at once.
    _on_every_rank(target, f"writing the {kind} export (rank 0)", write)
    state.clear()  # the gathered full state: freed now, not when the caller's frame ends
    return target


def _write_adapter(
    peft_model: Any, state: dict[str, torch.Tensor], directory: Path, *, adapters_only: bool = False
) -> None:
    fresh = _rebuild(peft_model, state, directory, adapters_only=adapters_only)
    fresh.save_pretrained(str(directory), safe_serialization=True)
    missing = [name for name in ADAPTER_FILES if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(directory, f"peft wrote no {', '.join(missing)}")


def _write_merged(
    peft_model: Any, state: dict[str, torch.Tensor], directory: Path, *, max_shard_size: int | str
) -> None:
    merged = _rebuild(peft_model, state, directory).merge_and_unload()
    merged.save_pretrained(str(directory), safe_serialization=True, max_shard_size=max_shard_size)


def _rebuild(peft_model: Any, state: dict[str, torch.Tensor], directory: Path, *, adapters_only: bool = False) -> Any:
    """A plain PEFT model (no FSDP wrappers) holding the gathered weights, on the CPU.

    PEFT finds adapter weights by walking module names, which FSDP1's wrappers change;
    a fresh model built on the meta device and given the gathered tensors (no copy) is
    exactly what a plain PEFT user would save. ``adapters_only``: only the trainable tensors
    are given (and required); the base stays on the meta device.
    """
    from peft import get_peft_model

    base = peft_model.get_base_model()
    with torch.device("meta"):
        fresh_base = type(base)(base.config)
    names = list(peft_model.peft_config)
    fresh = get_peft_model(fresh_base, peft_model.peft_config[names[0]], adapter_name=names[0])
    for name in names[1:]:
        fresh.add_adapter(name, peft_model.peft_config[name])
    if adapters_only:
        trainable = {n for n, p in fresh.named_parameters() if p.requires_grad}
        state = {k: v for k, v in state.items() if k in trainable}
    missing, unexpected = fresh.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not _is_nonpersistent_buffer(fresh, k)]
    if adapters_only:
        missing = [k for k in missing if k in trainable]
    if missing or unexpected:
        raise CheckpointError(
            directory,
            f"the gathered weights do not fit the PEFT model: missing {missing[:5]}, unexpected {unexpected[:5]}",
        )
    _materialize_buffers(fresh, base)
    fresh.tie_weights()  # tied embeddings share one tensor again after assign=True
    return fresh


def _is_nonpersistent_buffer(model: nn.Module, key: str) -> bool:
    module_name, _, buffer_name = key.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return buffer_name in getattr(module, "_non_persistent_buffers_set", set())


def _materialize_buffers(fresh: nn.Module, original: nn.Module) -> None:
    """Copy non-persistent buffers (e.g. rotary inverse frequencies) from the original model."""
    originals = dict(original.named_buffers())
    base: nn.Module = fresh.get_base_model()  # type: ignore[operator]
    for name, buf in list(base.named_buffers()):
        if buf.is_meta:
            module_name, _, buffer_name = name.rpartition(".")
            module = base.get_submodule(module_name) if module_name else base
            source = originals.get(name)
            value = (
                source.detach().to("cpu").clone()
                if source is not None and not source.is_meta
                else torch.zeros(buf.shape, dtype=buf.dtype)
            )
            module._buffers[buffer_name] = value


def is_adapter_dir(path: Path) -> bool:
    """A PEFT adapter directory (``save_pretrained`` of a ``PeftModel``, or ``kind="adapter"``)."""
    return path.is_dir() and all((path / name).is_file() for name in ADAPTER_FILES)


def load_adapter(path: Path, model: nn.Module) -> None:
    """Load a PEFT adapter directory's weights into the adapters of a (sharded) PEFT model; call on
    every rank. The base weights are not touched. Every adapter tensor must name an adapter
    parameter of ``model`` with the same shape, checked before anything is copied.

    Raises:
        CheckpointError: ``model`` has no adapters, or the adapter does not fit them.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    peft_model = find_peft_model(model)
    if peft_model is None:
        raise CheckpointError(
            path,
            "is a PEFT adapter directory; load it into a PEFT model "
            "(peft.get_peft_model(base, LoraConfig(...)) before fsdp_bridge.shard)",
        )
    name = peft_model.active_adapter
    name = name[0] if isinstance(name, list) else name
    try:
        tensors = load_file(str(path / "adapter_model.safetensors"))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(path, f"adapter_model.safetensors cannot be read ({err})") from None
    template: dict[str, Any] = dict(get_model_state_dict(model))  # names (wrapper prefixes removed), global shapes
    by_saved_name = {k.replace(f".{name}.", "."): k for k in template if f".{name}." in k}
    unknown = sorted(k for k in tensors if k not in by_saved_name)
    misfit = sorted(
        f"{k}: {tuple(v.shape)} in the file, {tuple(template[by_saved_name[k]].shape)} in the model"
        for k, v in tensors.items()
        if k in by_saved_name and tuple(v.shape) != tuple(template[by_saved_name[k]].shape)
    )
    if unknown or misfit:
        raise CheckpointError(
            path,
            [*(f"{k}: no such adapter parameter in the model (adapter {name!r})" for k in unknown[:10]), *misfit[:10]],
        )
    mapped: dict[str, Any] = {by_saved_name[k]: v for k, v in tensors.items()}
    set_model_state_dict(model, mapped, options=StateDictOptions(full_state_dict=True, strict=False))
