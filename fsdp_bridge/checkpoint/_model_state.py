"""What a checkpoint asks of the model: its bridge, tied names, shapes and dtypes of a state dict, the
options of a gathered state dict, and what 4-bit (QLoRA) weights leave out.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp_bridge import hf
from fsdp_bridge._lora import frozen_4bit_weights, has_4bit
from fsdp_bridge.checkpoint._formats import CheckpointError, strip_wrapper_prefixes

__all__ = [
    "aliases_to_fill",
    "bridge_of",
    "dtype_name",
    "full_state_options",
    "global_shapes",
    "refuse_4bit",
    "shapes_of",
    "size_of",
    "template_of",
    "tied_groups",
    "without_4bit",
]


def bridge_of(model: nn.Module) -> Any:
    from fsdp_bridge.api import get_bridge

    try:
        return get_bridge(model)
    except TypeError:
        return None


def _device(model: nn.Module) -> torch.device:
    bridge = bridge_of(model)
    if bridge is not None:
        return bridge.device
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def full_state_options(model: nn.Module, **kw: Any) -> StateDictOptions:
    """Options for a gathered (full) state dict of a sharded ``model``.

    Args:
        model: a model returned by :func:`fsdp_bridge.shard` (or any module).
        **kw: further ``StateDictOptions`` fields (``strict``, ``broadcast_from_rank0`` ...).

    Returns:
        ``StateDictOptions(full_state_dict=True, cpu_offload=...)``: offloaded (and kept on rank 0
        only) where the model runs on an accelerator; not on a CPU run (see the comment below).
    """
    # cpu_offload gathers on rank 0 only, but FSDP1 on a CPU-only run crashes with it in torch
    # < 2.14: FlatParamHandle.to_cpu frees the storage of a flat parameter already on the CPU
    # (pytorch/pytorch#188989; 2.14.1's to_cpu skips the offload for a CPU flat parameter, read from
    # its source, not run).  Not gated on the version: on CPU the gathered copy is in host memory
    # anyway; with the fix, cpu_offload on CPU would only spare ranks other than 0 the full copy.
    return StateDictOptions(full_state_dict=True, cpu_offload=_device(model).type != "cpu", **kw)


def tied_groups(model: nn.Module) -> list[list[str]]:
    groups = []
    for names in hf.tied_parameter_names(model):
        clean = list(dict.fromkeys(strip_wrapper_prefixes(n) for n in names))
        if len(clean) > 1:
            groups.append(clean)
    return groups


def size_of(value: Any) -> tuple[int, ...]:
    return tuple(value.size()) if hasattr(value, "size") else ()


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def shapes_of(state_dict: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (global shape, dtype name) of the tensors in a (sharded or full) state dict."""
    return {k: (size_of(v), dtype_name(v.dtype)) for k, v in state_dict.items() if hasattr(v, "dtype")}


def refuse_4bit(path: str | os.PathLike[str], model: nn.Module, what: str) -> None:
    """Whole-model files of a 4-bit (bitsandbytes) model are refused: torch's state dicts do not
    carry bitsandbytes' quantization state through either backend (FSDP2 drops it, so the packed
    codes would come back under another layer's scales), and the frozen base is already on disk.
    Sharded checkpoints leave the 4-bit weights out instead (:func:`without_4bit`)."""
    if has_4bit(model):
        raise CheckpointError(
            path,
            f"{what} the whole model, and this model has a 4-bit (bitsandbytes) base whose quantization "
            "state torch's state dicts do not carry; with a frozen 4-bit base, save kind='sharded' (to "
            "resume: everything but the 4-bit weights) or kind='adapter', and rebuild the base from its "
            "pretrained directory",
        )


def without_4bit(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without the frozen 4-bit weights of ``model`` and their quantization-state entries:
    what a sharded checkpoint of a QLoRA model holds (the base is rebuilt from its directory)."""
    if not has_4bit(model):
        return state
    names = frozen_4bit_weights(model)
    return {k: v for k, v in state.items() if not any(k == n or k.startswith(n + ".") for n in names)}


def template_of(model: nn.Module) -> dict[str, Any]:
    return without_4bit(model, get_model_state_dict(model))


def global_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Name -> full shape of each state-dict entry, without building the state dict."""
    bridge = bridge_of(model)
    if bridge is not None:
        return bridge.impl.global_shapes(bridge.model)
    return {k: size_of(v) for k, v in model.state_dict().items()}


def aliases_to_fill(tied: list[list[str]], present: set[str]) -> dict[str, str]:
    """alias -> source for tied names missing from a checkpoint whose partner is present."""
    fill = {}
    for group in tied:
        source = next((n for n in group if n in present), None)
        if source is not None:
            for name in group:
                if name not in present:
                    fill[name] = source
    return fill
