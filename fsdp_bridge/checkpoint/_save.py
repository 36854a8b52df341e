"""``save_checkpoint``: a sharded (DCP) checkpoint, a full Hugging Face directory, or a PEFT export,
the same call on FSDP1 and FSDP2.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from fsdp_bridge._optim_state import init_step_undone
from fsdp_bridge.checkpoint import _hf, _peft
from fsdp_bridge.checkpoint._atomic import series_prefix
from fsdp_bridge.checkpoint._formats import DCP_DIR, CheckpointError
from fsdp_bridge.checkpoint._model_state import (
    bridge_of,
    dtype_name,
    full_state_options,
    refuse_4bit,
    shapes_of,
    tied_groups,
    without_4bit,
)
from fsdp_bridge.checkpoint._publish import (
    check_save_args,
    check_save_name,
    describe_and_publish,
    fresh_staging,
    gather_checksums,
    own_checksums,
    release_save_lock,
)
from fsdp_bridge.checkpoint._ranks import agree_on, on_every_rank, rank_world
from fsdp_bridge.checkpoint._remote import (
    claim_staging,
    new_claim,
    rotate_checkpoints,
    save_sharded_to_url,
    upload_and_publish,
)
from fsdp_bridge.checkpoint._state import write_rng
from fsdp_bridge.checkpoint._storage import Remote, is_url

__all__ = ["SaveKind", "remember_layout", "save_checkpoint"]

SaveKind = Literal["sharded", "full", "adapter", "merged"]


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    kind: SaveKind = "sharded",
    state: dict[str, Any] | None = None,
    keep_last: int | None = None,
    max_shard_size: int | str | None = None,
) -> Path | str:
    """Save ``model`` (and ``optimizer``, ``state``) to ``path``; call on every rank.

    ``kind="sharded"``: a DCP directory in which each rank writes only its shard.
    ``kind="full"``: a Hugging Face model directory (``config.json`` + safetensors,
    split with an index above ``max_shard_size``) that ``from_pretrained`` loads, with the
    full optimizer state beside it when ``optimizer`` is given.
    ``kind="adapter"`` (a PEFT model): the adapter directory ``PeftModel.from_pretrained``
    loads; ``kind="merged"``: the base model with the adapters merged, as a Hugging Face
    directory. These two are exports: no optimizer, state or RNG.

    Both kinds also keep ``state`` (a JSON-serialisable dict: step, scheduler state,
    data position, ...), every rank's RNG states and the bridge config, and are written
    to ``.NAME.partial`` then published by an atomic rename once every rank has
    finished.  ``keep_last=K`` then deletes all but the K newest checkpoints beside it.
    Returns ``path``.

    ``path`` may be an fsspec URL (``s3://bucket/run/step_00000100``, ``memory://``, ``file://``):
    ``kind="sharded"`` is written to a staging prefix and published with its description written
    last (docs/checkpoints.md, "Object storage", says what holds there).

    Args:
        path: the checkpoint directory to write (replaced atomically if it is a checkpoint), or
            an fsspec URL (a ``str`` with ``"://"``).
        model: a model returned by :func:`~fsdp_bridge.shard`.
        optimizer: its optimizer, saved too when given (not for ``adapter``/``merged``).
        kind: ``"sharded"``, ``"full"``, ``"adapter"`` or ``"merged"``.
        state: a JSON-serialisable dict saved beside the weights.
        keep_last: after publishing, keep only the K newest checkpoints beside ``path``.
        max_shard_size: the largest safetensors file for ``kind="full"`` (``"5GB"`` or bytes).
            Default: the file layout of the directory :func:`load_pretrained` filled the model
            from, when it had an index and names the same tensors; otherwise ``"5GB"``.

    Returns:
        ``path`` (a ``Path``; at a URL, the URL).

    Raises:
        CheckpointError: on every rank, when ``path`` cannot be written or is not ours to replace.
    """
    if is_url(path):
        if kind == "sharded":
            return save_sharded_to_url(str(path), model, optimizer, state=state, keep_last=keep_last)
        if kind == "full":
            return _save_full_to_url(
                str(path), model, optimizer, state=state, keep_last=keep_last, max_shard_size=max_shard_size
            )
        raise CheckpointError(
            str(path),
            f"kind={kind!r} cannot be saved to a URL (only 'sharded' and 'full'); save it to a local "
            "directory and copy that to the store",
        )
    if kind == "adapter" or kind == "merged":
        return _peft.save_peft(
            path,
            model,
            kind,
            full_state_dict=full_state_options(model),
            max_shard_size=max_shard_size or _hf.DEFAULT_MAX_SHARD_SIZE,
        )
    if kind == "full":
        refuse_4bit(path, model, "kind='full' saves")
    if kind not in ("sharded", "full"):
        raise ValueError(
            f"kind must be 'sharded', 'full', 'adapter' or 'merged' (got {kind!r}); "
            "'sharded' for resuming, 'full' for a Hugging Face directory, 'adapter'/'merged' "
            "for a PEFT model's adapters or its base with them merged"
        )
    path = check_save_args(path, keep_last, state)
    rank, world = rank_world()
    try:
        return _save(
            path,
            model,
            optimizer,
            kind=kind,
            state=state,
            keep_last=keep_last,
            max_shard_size=max_shard_size,
            rank=rank,
            world=world,
        )
    finally:
        release_save_lock(path)


def _save(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    kind: str,
    state: dict[str, Any] | None,
    keep_last: int | None,
    max_shard_size: int | str | None,
    rank: int,
    world: int,
) -> Path:
    staging = on_every_rank(path, "creating the staging directory", lambda: fresh_staging(path, rank))

    tied = tied_groups(model)
    has_optimizer = optimizer is not None
    if kind == "sharded":
        msd = without_4bit(model, get_model_state_dict(model))
        to_save: dict[str, Any] = {"model": msd}
        if optimizer is not None:
            with init_step_undone(optimizer, reading=True):
                to_save["optim"] = get_optimizer_state_dict(model, optimizer)

        def write_sharded() -> dict[str, int]:
            dcp.save(to_save, storage_writer=dcp.FileSystemWriter(str(staging / DCP_DIR)))
            return own_checksums(staging, rank)  # each rank its own files, in parallel

        # dcp.save is collective: a write that fails on one rank is reported to every rank.
        known = gather_checksums(on_every_rank(path, "writing the sharded state (DCP)", write_sharded))
        shapes = shapes_of(msd)
    else:
        # The backend says which flat ranges of each tensor this rank holds (FSDP1's flat shards,
        # FSDP2's row shards), and those are written straight into the files.  Where it cannot
        # (other layouts), each rank writes the slices it holds and the ranks then assemble the
        # full files one tensor at a time.  No rank ever holds the full state.
        bridge = bridge_of(model)
        flat = bridge.impl.export_pieces(bridge.model) if bridge is not None else None
        weights: dict[str, Any]
        if flat is None:
            msd = get_model_state_dict(model)
            shapes = shapes_of(msd)
            weights = {k: v for k, v in msd.items() if isinstance(v, torch.Tensor)}
        else:
            msd = None
            shapes = {k: (v.shape, dtype_name(v.dtype)) for k, v in flat.items()}
            weights = dict(flat)
        osd = None
        if optimizer is not None:
            if flat is not None:  # collective: the same answer on every rank
                osd = bridge.impl.export_optimizer_pieces(bridge.model, optimizer)
            if osd is None:
                with init_step_undone(optimizer, reading=True):
                    osd = get_optimizer_state_dict(model, optimizer)
        tensors = _hf.drop_tied_aliases(weights, tied)
        layout = _SOURCE_LAYOUT.get(model) if max_shard_size is None else None
        export = _hf.FullExport(
            staging, tensors, osd, max_shard_size=max_shard_size or _hf.DEFAULT_MAX_SHARD_SIZE, layout=layout
        )
        # One agreement per step: a rank that fails must not leave the others in a collective.
        on_every_rank(path, "writing each rank's slices of the full state", lambda: export.write_pieces(rank, world))
        on_every_rank(path, "assembling the full state's files", lambda: export.assemble(rank, world))
        on_every_rank(path, "indexing the full state (rank 0)", lambda: export.finish() if rank == 0 else None)
        del msd, osd, tensors, weights, flat, export
        known = {}
    on_every_rank(path, "writing the RNG state", lambda: write_rng(staging, rank))  # + the barrier

    error = None
    if rank == 0:
        try:
            describe_and_publish(
                staging,
                path,
                model,
                kind=kind,
                state=state,
                world=world,
                shapes=shapes,
                tied=tied,
                has_optimizer=has_optimizer,
                keep_last=keep_last,
                known_checksums=known,
            )
        except Exception as err:  # tell the other ranks instead of leaving them in a barrier
            error = f"{type(err).__name__}: {err}"
            agree_on(error)
            raise
    error = agree_on(error)
    if error is not None:
        raise CheckpointError(path, f"rank 0 failed to publish the checkpoint: {error}")
    return path


_SOURCE_LAYOUT: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()
"""The safetensors index (name -> file) of the directory load_pretrained filled a model from:
a full export of that model writes the same files."""


def remember_layout(model: nn.Module, path: str | os.PathLike[str]) -> None:
    directory = Path(path)
    weight_map = _hf.read_weight_map(directory) if directory.is_dir() else None
    if weight_map is not None:
        _SOURCE_LAYOUT[model] = weight_map


def _save_full_to_url(
    url: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    state: dict[str, Any] | None,
    keep_last: int | None,
    max_shard_size: int | str | None,
) -> str:
    """``kind="full"`` to a URL: the staging prefix claimed first, the Hugging Face directory
    assembled by every rank in a local directory rank 0 makes (every rank must see it: one node,
    or ``TMPDIR`` on a shared file system), then uploaded and published by rank 0 as a sharded
    save to a URL is (description written last)."""
    dest = Remote.of(url)
    check_save_name(url, dest.name, keep_last, state)
    rank, _ = rank_world()
    claim = new_claim()
    on_every_rank(url, "claiming the staging prefix", lambda: claim_staging(dest, claim) if rank == 0 else None)
    box: list[str | None] = [tempfile.mkdtemp(prefix="fsdp_bridge_full_") if rank == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    tmp = Path(str(box[0]))

    def sees_it() -> None:
        if not tmp.is_dir():
            raise CheckpointError(
                url,
                f"kind='full' to a URL is assembled in a local directory every rank must see; rank 0 made "
                f"{tmp}, which this rank does not see: set TMPDIR to a directory all ranks share, or save "
                "kind='sharded' to the URL (each rank writes its own objects)",
            )

    try:
        on_every_rank(url, "finding the local directory of the full state", sees_it)
        local = Path(
            save_checkpoint(tmp / dest.name, model, optimizer, kind="full", state=state, max_shard_size=max_shard_size)
        )
        error = None
        if rank == 0:
            try:
                upload_and_publish(local, dest, claim)
                if keep_last is not None:
                    rotate_checkpoints(dest.parent.url, keep_last, prefix=series_prefix(dest.name) or "")
            except Exception as err:  # tell the other ranks instead of leaving them in a collective
                error = f"{type(err).__name__}: {err}"
                agree_on(error)
                raise
        error = agree_on(error)
        if error is not None:
            raise CheckpointError(url, f"rank 0 failed to publish the checkpoint: {error}")
    finally:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return url
