"""``load_checkpoint``: any supported kind into a model (and optimizer), the same call on FSDP1 and FSDP2.

Built on ``torch.distributed.checkpoint`` (DCP) and its state-dict API
(``get_model_state_dict`` & co.), whose keys are the original parameter names on both
backends: that is what lets a checkpoint saved under one backend and world size load
under the other backend and any world size.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fsdp_bridge._lora import has_4bit
from fsdp_bridge._optim_state import init_step_undone
from fsdp_bridge.checkpoint import _peft
from fsdp_bridge.checkpoint._formats import (
    DCP_DIR,
    META_FILE,
    CheckpointError,
    Kind,
    compare_keys,
    dcp_tensor_shapes,
    detect,
    read_dcp,
    strip_wrapper_prefixes,
    verify_manifest,
)
from fsdp_bridge.checkpoint._load_files import base_names, full_shapes, load_full, load_hf_sliced, tied_in_files
from fsdp_bridge.checkpoint._model_state import (
    aliases_to_fill,
    global_shapes,
    refuse_4bit,
    size_of,
    template_of,
    tied_groups,
)
from fsdp_bridge.checkpoint._optim_groups import group_problems
from fsdp_bridge.checkpoint._ranks import on_every_rank, rank_world
from fsdp_bridge.checkpoint._remote import download, read_remote_meta, read_remote_side_files, verify_remote
from fsdp_bridge.checkpoint._state import read_rng, read_state
from fsdp_bridge.checkpoint._state import restore_rng as restore_rng_states
from fsdp_bridge.checkpoint._storage import Remote, SafeFsspecReader, is_url, load_remote_dcp_metadata

__all__ = ["load_checkpoint"]

logger = logging.getLogger("fsdp_bridge")


def _load_dcp(
    dcp_dir: Path | str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    key_map: dict[str, str],
    template: dict[str, Any],
    tied: list[list[str]],
    with_optim: bool,
    all_or_nothing: bool = True,
    reader: Any = None,
) -> None:
    """Read a DCP directory into this rank's shards (DCP reshards to the current world).

    ``all_or_nothing``: everything is read into new tensors first (one more copy of this rank's
    shards while loading), so a shard that fails to read leaves the model and the optimizer as
    they were; otherwise straight into the live state."""
    fresh = _scratch if all_or_nothing else (lambda value: value)
    to_load: dict[str, Any] = {stored: fresh(template[ours]) for stored, ours in key_map.items()}
    if with_optim and optimizer is not None:
        with init_step_undone(optimizer, reading=True):
            to_load["optim"] = fresh(get_optimizer_state_dict(model, optimizer))
    try:
        read_dcp(to_load, dcp_dir, reader=reader)
    except CheckpointError as err:
        if all_or_nothing:
            raise
        raise CheckpointError(
            err.path,
            [*err.problems, "loaded with all_or_nothing=False: the model and optimizer now hold part of it"],
        ) from None
    loaded = {ours: to_load[stored] for stored, ours in key_map.items()}
    for alias, source in aliases_to_fill(tied, set(loaded)).items():  # a tied name stored once
        loaded[alias] = loaded[source]
    if with_optim and optimizer is not None:  # first: if torch refuses it, the model is still untouched
        problems = group_problems(to_load["optim"].get("param_groups", []), optimizer, template)
        if problems:
            raise CheckpointError(dcp_dir, [*problems, "the optimizer state is damaged: load without the optimizer"])
        try:
            with init_step_undone(optimizer, reading=False):
                set_optimizer_state_dict(model, optimizer, to_load["optim"])
        except (KeyError, ValueError, TypeError, RuntimeError) as err:
            raise CheckpointError(
                dcp_dir, f"the optimizer state does not fit the optimizer ({type(err).__name__}: {err})"
            ) from None
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=not has_4bit(model)))


def _scratch(value: Any) -> Any:
    """The same structure with every tensor replaced by an uninitialised one of its shape and
    placement (DTensors stay DTensors), for DCP to read into instead of the live state."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, dict):
        return {k: _scratch(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scratch(v) for v in value]
    return value


def _dcp_key_map(
    kind: Kind,
    where: Path | str,
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    template: dict[str, Any],
    tied: list[list[str]],
) -> tuple[dict[str, str], bool]:
    """stored DCP key -> model key, after checking names and shapes; and whether optimizer keys exist."""
    model_keys = {k: v for k, v in shapes.items() if not k.startswith("optim.")}
    has_optim = len(model_keys) != len(shapes)
    # fsdp_bridge nests the model under "model."; plain DCP code does either.  Pick the
    # reading whose names match the model's best.
    plain = {k: strip_wrapper_prefixes(k) for k in model_keys}
    nested = {k: strip_wrapper_prefixes(k.removeprefix("model.")) for k in model_keys}
    if kind is Kind.SHARDED:
        key_map = nested
    else:
        key_map = max((plain, nested), key=lambda m: len(set(m.values()) & set(template)))
    found = {key_map[k]: v[0] for k, v in model_keys.items()}
    expected = {k: size_of(v) for k, v in template.items()}
    compare_keys(where, found, expected, allow_missing=aliases_to_fill(tied, set(found)))
    # A tied alias missing on disk is filled by loading its source into the same tensor.
    return key_map, has_optim


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
    all_or_nothing: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint of any supported kind into ``model`` (and ``optimizer``); call on every rank.

    The kind is detected from what is on disk: an fsdp_bridge sharded or full
    checkpoint, a plain DCP directory, a Hugging Face directory, a ``torch.save`` file, or a
    PEFT adapter directory (into a PEFT model's adapters; the base is untouched)
    (FSDP1 wrapper prefixes such as ``_fsdp_wrapped_module.`` are removed).  Any backend
    and world size may have saved it.  Names and shapes are checked on every rank before
    anything is loaded; problems raise :class:`CheckpointError` listing every missing and
    unexpected key and every shape mismatch.  All or nothing: the training state, every
    rank's RNG file and the optimizer state are read and checked, and sharded checkpoints
    read whole, before the first tensor is copied, so a refused load leaves ``model`` and
    ``optimizer`` as they were.

    Returns the training ``state`` saved with the checkpoint (``{}`` if none).  Each
    rank's RNG states are restored when the world size matches the one saved from.

    Args:
        path: the checkpoint (directory or file), or an fsspec URL of a sharded checkpoint
            (``s3://bucket/run/checkpoints/step_00000100``).
        model: a model returned by :func:`~fsdp_bridge.shard` (or a plain module).
        optimizer: its optimizer, to restore its state too.
        restore_rng: restore each rank's RNG states when the world size matches.
        all_or_nothing: read sharded checkpoints into new tensors before copying them in (the
            default), so that a shard that fails to read leaves the model and optimizer as they
            were; False reads straight into the live state, saving that copy of this rank's
            shards of model and optimizer (and its time): every check before reading still runs,
            but a shard that then fails to read leaves a partial load, and the error says so.

    Returns:
        The training ``state`` saved with the checkpoint (``{}`` if none).

    Raises:
        CheckpointError: on every rank, for a missing, damaged or mismatched checkpoint; the
            model and optimizer are unchanged.
    """
    if is_url(path):
        return _load_url(str(path), model, optimizer, restore_rng=restore_rng, all_or_nothing=all_or_nothing)
    if _peft.is_adapter_dir(Path(path)) and not (Path(path) / META_FILE).is_file():
        # A PEFT adapter directory: its weights go into the model's adapters (no state, no optimizer).
        on_every_rank(Path(path), "loading the adapter", lambda: _peft.load_adapter(Path(path), model))
        return {}
    detected = detect(path)
    if detected.kind is not Kind.SHARDED:
        refuse_4bit(path, model, f"load_checkpoint() of a {detected.kind.value} checkpoint loads")
    part = rank_world()
    if detected.kind in (Kind.SHARDED, Kind.FULL):
        # Each rank reads the contents of its share of the files; a damaged one refuses the load everywhere.
        on_every_rank(detected.path, "verifying the checkpoint's files", lambda: verify_manifest(detected, part=part))
    elif detected.kind is Kind.HF and detected.path.is_dir():
        # A merged export carries the checksums of its files (fsdp_bridge_export.json): verified the same way.
        on_every_rank(
            detected.path, "verifying the export's files", lambda: _peft.verify_export(detected.path, part=part)
        )
    if optimizer is not None and detected.kind in (Kind.SHARDED, Kind.FULL) and not detected.meta.get("has_optimizer"):
        raise CheckpointError(
            detected.path,
            "holds no optimizer state (it was saved without an optimizer); "
            "call load_checkpoint(path, model) without the optimizer",
        )
    rank, world = rank_world()
    ours = detected.kind in (Kind.SHARDED, Kind.FULL)
    saved_world = detected.meta.get("world_size")

    def read_side_files() -> tuple[dict[str, Any], dict[str, Any] | None]:
        # Before any tensor is copied: a corrupt state or RNG file (even on one rank) refuses the
        # whole load on every rank, with the model untouched.
        state = read_state(detected.path) if ours else {}
        rng = read_rng(detected.path, rank) if ours and restore_rng and saved_world == world else None
        return state, rng

    state, rng = on_every_rank(detected.path, "reading the training state and RNG", read_side_files)
    tied = tied_groups(model)
    if detected.kind in (Kind.SHARDED, Kind.DCP):
        template = template_of(model)
        key_map, has_optim = _dcp_key_map(
            detected.kind, detected.dcp_dir, dcp_tensor_shapes(detected.dcp_dir), template, tied
        )
        if optimizer is not None and not has_optim:
            raise CheckpointError(
                detected.dcp_dir,
                "holds no optimizer keys ('optim.*'); call load_checkpoint(path, model) without the optimizer",
            )
        _load_dcp(
            detected.dcp_dir,
            model,
            optimizer,
            key_map,
            template,
            tied,
            with_optim=has_optim,
            all_or_nothing=all_or_nothing,
        )
        # Tied aliases stored only once resolve through the shared parameter.
    else:
        found = full_shapes(detected)
        sliced = optimizer is None and detected.kind in (Kind.HF, Kind.FULL) and detected.path.is_dir()
        names = base_names(model, found) if sliced else None
        expected = global_shapes(model)
        if names is not None:  # a PEFT model filled from its base's directory: the adapters stay
            expected = {names[k]: shape for k, shape in expected.items() if k in names}
        file_tied = tied if names is None else tied_in_files(tied, names)
        compare_keys(detected.path, found, expected, allow_missing=aliases_to_fill(file_tied, set(found)))
        if sliced:
            load_hf_sliced(detected.path, model, tied, found, names=names)
        else:
            load_full(detected, model, optimizer, template_of(model), tied, found)

    if not ours:
        return {}
    if restore_rng:
        if rng is not None:
            restore_rng_states(rng)
        elif rank == 0:
            logger.warning("fsdp_bridge: RNG states not restored (saved at world size %s, now %s)", saved_world, world)
    return state


def _load_url(
    url: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, restore_rng: bool, all_or_nothing: bool
) -> dict[str, Any]:
    """``load_checkpoint`` of a sharded checkpoint at an fsspec URL: the same checks, in the same
    order, on the objects (DCP reads through the safe fsspec reader)."""
    where = Remote.of(url)
    meta = on_every_rank(url, "reading the checkpoint's description", lambda: read_remote_meta(where))
    if meta["kind"] != Kind.SHARDED.value:
        # A full checkpoint (Hugging Face files): each rank fetches a local copy (its listed objects,
        # then its description) and loads that with every check of a local load.
        with tempfile.TemporaryDirectory(prefix="fsdp_bridge_load_") as tmp:
            local = on_every_rank(url, "fetching the checkpoint", lambda: download(where, Path(tmp)))
            return load_checkpoint(local, model, optimizer, restore_rng=restore_rng, all_or_nothing=all_or_nothing)
    part = rank_world()
    on_every_rank(url, "verifying the checkpoint's objects", lambda: verify_remote(where, meta, part=part))
    if optimizer is not None and not meta.get("has_optimizer"):
        raise CheckpointError(
            url,
            "holds no optimizer state (it was saved without an optimizer); "
            "call load_checkpoint(path, model) without the optimizer",
        )
    rank, world = part
    saved_world = meta.get("world_size")
    with_rng = restore_rng and saved_world == world
    state, rng = on_every_rank(
        url, "reading the training state and RNG", lambda: read_remote_side_files(where, rank, rng=with_rng)
    )
    tied = tied_groups(model)
    template = template_of(model)
    dcp_dir = where / DCP_DIR
    metadata = on_every_rank(url, "reading DCP's metadata", lambda: load_remote_dcp_metadata(dcp_dir / ".metadata"))
    shapes = {
        key: (tuple(item.size), item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }
    key_map, has_optim = _dcp_key_map(Kind.SHARDED, dcp_dir.url, shapes, template, tied)
    if optimizer is not None and not has_optim:
        raise CheckpointError(
            dcp_dir.url, "holds no optimizer keys ('optim.*'); call load_checkpoint(path, model) without the optimizer"
        )
    _load_dcp(
        dcp_dir.url,
        model,
        optimizer,
        key_map,
        template,
        tied,
        with_optim=has_optim,
        all_or_nothing=all_or_nothing,
        reader=SafeFsspecReader(dcp_dir.url),
    )
    if restore_rng:
        if rng is not None:
            restore_rng_states(rng)
        elif rank == 0:
            logger.warning("fsdp_bridge: RNG states not restored (saved at world size %s, now %s)", saved_world, world)
    return state
