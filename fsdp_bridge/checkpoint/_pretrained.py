"""``load_pretrained`` / ``pretrained_fits``: pretrained weights into a sharded model, each rank reading
only what its shards hold.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import set_model_state_dict

from fsdp_bridge import hf
from fsdp_bridge._lora import reset_adapters
from fsdp_bridge.checkpoint import _hf
from fsdp_bridge.checkpoint._formats import CheckpointError, Kind, detect, strip_wrapper_prefixes
from fsdp_bridge.checkpoint._load import load_checkpoint
from fsdp_bridge.checkpoint._load_files import base_names, tied_in_files
from fsdp_bridge.checkpoint._model_state import aliases_to_fill, bridge_of, full_state_options, tied_groups
from fsdp_bridge.checkpoint._save import remember_layout

__all__ = ["load_pretrained", "pretrained_fits"]


def pretrained_fits(path: str | os.PathLike[str], model: nn.Module) -> bool:
    """Whether ``path`` is a Hugging Face directory whose tensor names and shapes are exactly those
    of ``model`` (unsharded, e.g. on the meta device; a tied name may be stored once), so that
    :func:`load_pretrained` can fill it.  Reads the safetensors headers only.

    Args:
        path: a directory (or anything else, which does not fit).
        model: the model to fill, not yet sharded; a PEFT model is matched by its base's names.

    Returns:
        True when every stored tensor is one of the model's with its shape and every model
        tensor is stored (or tied to one that is); False otherwise, also for a path that is not
        a complete checkpoint.
    """
    try:
        detected = detect(path)
        if detected.kind not in (Kind.HF, Kind.FULL) or not detected.path.is_dir():
            return False
        found = {k: shape for k, (shape, _) in _hf.read_hf_shapes(detected.path).items()}
    except CheckpointError:
        return False
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = tied_groups(model)
    names = base_names(model, found)
    if names is not None:  # a PEFT model over this base: its adapters are not in the files
        expected = {names[k]: shape for k, shape in expected.items() if k in names}
        tied = tied_in_files(tied, names)
    allowed = aliases_to_fill(tied, set(found))
    if not set(found) <= set(expected):
        return False
    return all(found[k] == shape if k in found else k in allowed for k, shape in expected.items())


def load_pretrained(
    model_or_builder: nn.Module | Callable[[], nn.Module],
    path: str | os.PathLike[str],
    config: Any = None,
    *,
    mesh: Any = None,
) -> nn.Module:
    """Shard a model and fill it with weights from ``path`` without a full copy per rank.

    ``model_or_builder`` is a model built on the meta device, or a zero-argument callable
    that builds one (it is called under ``accelerate.init_empty_weights`` so that
    parameters take no memory while buffers stay real), or an already sharded model.
    The model is sharded with ``config`` (a :class:`~fsdp_bridge.BridgeConfig`), then each rank
    reads from a Hugging Face directory (single-file or indexed) only the slices its shards hold,
    straight into them: no rank holds a full copy.  Other kinds :func:`load_checkpoint` reads
    are read as it reads them (a ``torch.save`` file: rank 0 reads, in broadcast rounds).
    Returns the sharded model.

    Args:
        model_or_builder: a meta-device model, a zero-argument builder, or a sharded model.
        path: a Hugging Face directory or any checkpoint :func:`load_checkpoint` reads.
        config: the :class:`~fsdp_bridge.BridgeConfig` to shard with (default ``BridgeConfig()``).
        mesh: passed to :func:`~fsdp_bridge.shard`.

    Returns:
        The sharded model holding the weights.

    Raises:
        CheckpointError: the weights do not fit the model, or cannot be read.
        ConfigError: from :func:`~fsdp_bridge.shard`.
    """
    from fsdp_bridge.api import shard, weights_loaded_after_shard

    if bridge_of(model_or_builder) is not None:  # type: ignore[arg-type]
        load_checkpoint(path, model_or_builder, restore_rng=False)  # type: ignore[arg-type]
        remember_layout(model_or_builder, path)  # type: ignore[arg-type]
        return model_or_builder  # type: ignore[return-value]
    if isinstance(model_or_builder, nn.Module):
        model = model_or_builder
    elif callable(model_or_builder):
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            model = model_or_builder()
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"the builder passed to load_pretrained returned {type(model).__name__}, expected an nn.Module"
            )
        # init_empty_weights re-creates each parameter on the meta device, which unties
        # shared ones (GPT-2's lm_head / wte): tie them again as the model's config says (the
        # Hugging Face model itself, or the base under a PEFT wrapper).
        hf_model = next((m for m in model.modules() if hf.is_hf_model(m)), None)
        tie = getattr(hf_model, "tie_weights", None)
        if callable(tie):
            tie()
    else:
        raise TypeError(
            f"model_or_builder must be an nn.Module or a callable returning one (got {type(model_or_builder).__name__})"
        )
    detect(path)  # a missing or incomplete path fails before sharding
    persistent = set(model.state_dict().keys())
    meta_buffers = [n for n, b in model.named_buffers() if b.is_meta and n not in persistent]
    if meta_buffers:
        raise ValueError(
            f"buffers {', '.join(meta_buffers)} are on the meta device and are not stored in checkpoints, so "
            "they cannot be filled; build the model with accelerate.init_empty_weights(include_buffers=False) "
            "or pass a builder: load_pretrained(lambda: AutoModelForCausalLM.from_config(cfg), path, config)"
        )
    # Buffers that checkpoints do not hold (e.g. RoPE inv_freq): keep their values across sharding,
    # which turns meta modules into uninitialised memory.
    kept = {n: b.detach().clone() for n, b in model.named_buffers() if n not in persistent}
    # LoRA adapters of a PEFT model built on the meta device are not in the base's files: they are
    # initialised here as peft does (torch's current RNG) and put in after the base is read.
    adapters = reset_adapters(model, only_meta=True)
    with weights_loaded_after_shard():
        sharded = shard(model, config, mesh=mesh)
    load_checkpoint(path, sharded, restore_rng=False)
    remember_layout(sharded, path)
    with torch.no_grad():
        for name, buf in sharded.named_buffers():
            clean = strip_wrapper_prefixes(name)
            if clean in kept:
                buf.copy_(kept[clean].to(buf.device))
    if adapters:
        _put_whole(sharded, adapters)
    return sharded


def _put_whole(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy whole tensors (the same on every rank) into this rank's shards of ``model``: by the
    backend's local fill where it has one (FSDP1's full state dict would gather every unit)."""
    bridge = bridge_of(model)
    filled: set[str] = set()
    if bridge is not None:

        def read_rows(name: str, start: int, stop: int) -> torch.Tensor | None:
            value = tensors.get(name)
            return None if value is None else (value.reshape(1) if value.dim() == 0 else value[start:stop])

        filled = bridge.impl.load_local(bridge.model, read_rows) or set()
    rest: dict[str, Any] = {k: v for k, v in tensors.items() if k not in filled}
    if rest:
        set_model_state_dict(model, rest, options=full_state_options(model, strict=False))
