"""``save_checkpoint`` / ``load_checkpoint`` / ``load_pretrained``: the same calls on FSDP1 and FSDP2.

Built on ``torch.distributed.checkpoint`` (DCP) and its state-dict API
(``get_model_state_dict`` & co.), whose keys are the original parameter names on both
backends: that is what lets a checkpoint saved under one backend and world size load
under the other backend and any world size.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fsdp_bridge import hf
from fsdp_bridge._lora import base_weight_name, frozen_4bit_weights, has_4bit, reset_adapters
from fsdp_bridge._paths import unwritable_reason
from fsdp_bridge.backends import model_class_name
from fsdp_bridge.checkpoint import _hf, _peft
from fsdp_bridge.checkpoint._atomic import (
    SaveLock,
    check_replaceable,
    make_staging,
    partial_path,
    publish,
    remove_ours,
    rotate_checkpoints,
    series_prefix,
)
from fsdp_bridge.checkpoint._description import Description
from fsdp_bridge.checkpoint._formats import (
    DCP_DIR,
    META_FILE,
    CheckpointError,
    Detected,
    Kind,
    checksums,
    compare_keys,
    dcp_tensor_shapes,
    detect,
    failure_text,
    param_stats,
    read_dcp,
    strip_wrapper_prefixes,
    verify_manifest,
)
from fsdp_bridge.checkpoint._optim_groups import group_problems
from fsdp_bridge.checkpoint._state import check_state, read_rng, read_state, write_rng, write_state
from fsdp_bridge.checkpoint._state import restore_rng as _restore_rng_states

__all__ = ["load_checkpoint", "load_pretrained", "save_checkpoint"]

logger = logging.getLogger("fsdp_bridge")
SaveKind = Literal["sharded", "full", "adapter", "merged"]


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agree_on(error: str | None) -> str | None:
    """Rank 0's error message (or None), known to every rank: one small broadcast."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    box: list[str | None] = [error]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _on_every_rank(path: Path, what: str, fn: Callable[[], Any]) -> Any:
    """Run this rank's part of a save; if it fails on any rank, every rank raises the same error.

    The outcome is shared in one small all-reduce (failures are gathered only when there is
    one), which also serves as the barrier after the step: a full disk or a read-only
    directory on one rank can no longer leave the others waiting for the process-group timeout.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    error: str | None = None
    result = None
    try:
        result = fn()
    except CheckpointError as err:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            raise  # already names the file and the problem
        error = str(err)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        error = failure_text(err)  # DCP's: each failing rank's own exception
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()):
            errors: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            raise CheckpointError(path, [f"rank {r}: {what} failed: {e}" for r, e in enumerate(errors) if e])
    elif error is not None:
        raise CheckpointError(path, f"{what} failed: {error}")
    return result


def _bridge(model: nn.Module) -> Any:
    from fsdp_bridge.api import get_bridge

    try:
        return get_bridge(model)
    except TypeError:
        return None


def _device(model: nn.Module) -> torch.device:
    bridge = _bridge(model)
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


def _tied_groups(model: nn.Module) -> list[list[str]]:
    groups = []
    for names in hf.tied_parameter_names(model):
        clean = list(dict.fromkeys(strip_wrapper_prefixes(n) for n in names))
        if len(clean) > 1:
            groups.append(clean)
    return groups


def _size(value: Any) -> tuple[int, ...]:
    return tuple(value.size()) if hasattr(value, "size") else ()


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _shapes(state_dict: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (global shape, dtype name) of the tensors in a (sharded or full) state dict."""
    return {k: (_size(v), _dtype_name(v.dtype)) for k, v in state_dict.items() if hasattr(v, "dtype")}


# --------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------


def _describe_and_publish(
    staging: Path,
    path: Path,
    model: nn.Module,
    *,
    kind: str,
    state: dict[str, Any] | None,
    world: int,
    shapes: dict[str, tuple[tuple[int, ...], str]],
    tied: list[list[str]],
    has_optimizer: bool,
    keep_last: int | None,
    known_checksums: dict[str, int] | None = None,
) -> None:
    """Rank 0, once every rank's files are in ``staging``: state, config, description, publish, rotate.

    ``known_checksums``: CRC-32Cs the writing ranks already computed (each of its own files, in
    parallel); rank 0 computes the rest."""
    bridge = _bridge(model)
    write_state(staging, state)
    has_config = _hf.write_hf_config(staging, model)
    Description(
        kind=kind,
        backend=bridge.config.backend.value if bridge is not None else None,
        world_size=world,
        step=(state or {}).get("step"),
        bridge_config=bridge.config.to_dict() if bridge is not None else None,
        model_class=model_class_name(model),
        hf_config=has_config,
        has_optimizer=has_optimizer,
        tied=tied,
        params=param_stats(shapes, tied),
    ).write(staging, known_checksums=known_checksums)
    publish(staging, path)
    if keep_last is not None:
        rotate_checkpoints(path.parent, keep_last, prefix=series_prefix(path.name) or "")


def _own_checksums(staging: Path, rank: int) -> dict[str, int]:
    """CRC-32C of the DCP files this rank wrote (``__<rank>_<i>.distcp``), read back from the page cache."""
    return checksums(staging, (staging / DCP_DIR).glob(f"__{rank}_*.distcp"))


def _gather_checksums(mine: dict[str, int]) -> dict[str, int]:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return mine
    gathered: list[dict[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {k: v for part in gathered for k, v in (part or {}).items()}


_HELD: dict[Path, SaveLock] = {}
"""Rank 0's save locks, by checkpoint path, from :func:`_fresh_staging` to :func:`release_save_lock`."""


def _fresh_staging(path: Path, rank: int) -> Path:
    """The staging directory of ``path``, emptied by rank 0 under the path's save lock (call a
    barrier after it; rank 0 calls :func:`release_save_lock` once the save is published or failed)."""
    staging = partial_path(path)
    reason = unwritable_reason(path)
    if reason is not None:
        raise CheckpointError(path, f"cannot be written: {reason}; save to a directory this user can write")
    if rank == 0:
        _HELD[path] = SaveLock(path).acquire()  # refused while another process saves this path
        remove_ours(staging, "the staging directory of this save")  # left by an earlier save that was killed
        make_staging(staging)
    return staging


def release_save_lock(path: Path) -> None:
    """Release the save lock :func:`_fresh_staging` took for ``path`` on this process, if any."""
    lock = _HELD.pop(path, None)
    if lock is not None:
        lock.release()


def _check_save_args(path: str | os.PathLike[str], keep_last: int | None, state: dict[str, Any] | None) -> Path:
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise ValueError(f"keep_last must be None or an integer >= 1 (got {keep_last!r})")
    check_state(state)
    path = Path(path)
    if path.name.startswith(".") or path.name in ("", ".."):
        raise ValueError(
            f"path {str(path)!r} must name a directory that does not start with '.' "
            "(dot-names are reserved for interrupted saves)"
        )
    if keep_last is not None and series_prefix(path.name) is None:
        raise ValueError(
            f"keep_last={keep_last} rotates checkpoints named by step, but {path.name!r} does not end in a "
            f"step number: name it like step_00000100 (checkpoints of the same prefix and any other number "
            "are rotated; other names beside it are never deleted), or drop keep_last"
        )
    check_replaceable(path)  # every rank, before any collective: never replace the user's files
    return path


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    kind: SaveKind = "sharded",
    state: dict[str, Any] | None = None,
    keep_last: int | None = None,
    max_shard_size: int | str | None = None,
) -> Path:
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

    Args:
        path: the checkpoint directory to write (replaced atomically if it is a checkpoint).
        model: a model returned by :func:`~fsdp_bridge.shard`.
        optimizer: its optimizer, saved too when given (not for ``adapter``/``merged``).
        kind: ``"sharded"``, ``"full"``, ``"adapter"`` or ``"merged"``.
        state: a JSON-serialisable dict saved beside the weights.
        keep_last: after publishing, keep only the K newest checkpoints beside ``path``.
        max_shard_size: the largest safetensors file for ``kind="full"`` (``"5GB"`` or bytes).
            Default: the file layout of the directory :func:`load_pretrained` filled the model
            from, when it had an index and names the same tensors; otherwise ``"5GB"``.

    Returns:
        ``path``.

    Raises:
        CheckpointError: on every rank, when ``path`` cannot be written or is not ours to replace.
    """
    if kind == "adapter" or kind == "merged":
        return _peft.save_peft(
            path,
            model,
            kind,
            full_state_dict=full_state_options(model),
            max_shard_size=max_shard_size or _hf.DEFAULT_MAX_SHARD_SIZE,
        )
    if kind == "full":
        _refuse_4bit(path, model, "kind='full' saves")
    if kind not in ("sharded", "full"):
        raise ValueError(
            f"kind must be 'sharded', 'full', 'adapter' or 'merged' (got {kind!r}); "
            "'sharded' for resuming, 'full' for a Hugging Face directory, 'adapter'/'merged' "
            "for a PEFT model's adapters or its base with them merged"
        )
    path = _check_save_args(path, keep_last, state)
    rank, world = _rank_world()
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


def _refuse_4bit(path: str | os.PathLike[str], model: nn.Module, what: str) -> None:
    """Whole-model files of a 4-bit (bitsandbytes) model are refused: torch's state dicts do not
    carry bitsandbytes' quantization state through either backend (FSDP2 drops it, so the packed
    codes would come back under another layer's scales), and the frozen base is already on disk.
    Sharded checkpoints leave the 4-bit weights out instead (:func:`_without_4bit`)."""
    if has_4bit(model):
        raise CheckpointError(
            path,
            f"{what} the whole model, and this model has a 4-bit (bitsandbytes) base whose quantization "
            "state torch's state dicts do not carry; with a frozen 4-bit base, save kind='sharded' (to "
            "resume: everything but the 4-bit weights) or kind='adapter', and rebuild the base from its "
            "pretrained directory",
        )


def _without_4bit(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without the frozen 4-bit weights of ``model`` and their quantization-state entries:
    what a sharded checkpoint of a QLoRA model holds (the base is rebuilt from its directory)."""
    if not has_4bit(model):
        return state
    names = frozen_4bit_weights(model)
    return {k: v for k, v in state.items() if not any(k == n or k.startswith(n + ".") for n in names)}


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
    staging = _on_every_rank(path, "creating the staging directory", lambda: _fresh_staging(path, rank))

    tied = _tied_groups(model)
    has_optimizer = optimizer is not None
    if kind == "sharded":
        msd = _without_4bit(model, get_model_state_dict(model))
        to_save: dict[str, Any] = {"model": msd}
        if optimizer is not None:
            to_save["optim"] = get_optimizer_state_dict(model, optimizer)

        def write_sharded() -> dict[str, int]:
            dcp.save(to_save, storage_writer=dcp.FileSystemWriter(str(staging / DCP_DIR)))
            return _own_checksums(staging, rank)  # each rank its own files, in parallel

        # dcp.save is collective: a write that fails on one rank is reported to every rank.
        known = _gather_checksums(_on_every_rank(path, "writing the sharded state (DCP)", write_sharded))
        shapes = _shapes(msd)
    else:
        # The backend says which flat ranges of each tensor this rank holds (FSDP1's flat shards,
        # FSDP2's row shards), and those are written straight into the files.  Where it cannot
        # (other layouts), each rank writes the slices it holds and the ranks then assemble the
        # full files one tensor at a time.  No rank ever holds the full state.
        bridge = _bridge(model)
        flat = bridge.impl.export_pieces(bridge.model) if bridge is not None else None
        weights: dict[str, Any]
        if flat is None:
            msd = get_model_state_dict(model)
            shapes = _shapes(msd)
            weights = {k: v for k, v in msd.items() if isinstance(v, torch.Tensor)}
        else:
            msd = None
            shapes = {k: (v.shape, _dtype_name(v.dtype)) for k, v in flat.items()}
            weights = dict(flat)
        osd = None
        if optimizer is not None:
            if flat is not None:  # collective: the same answer on every rank
                osd = bridge.impl.export_optimizer_pieces(bridge.model, optimizer)
            if osd is None:
                osd = get_optimizer_state_dict(model, optimizer)
        tensors = _hf.drop_tied_aliases(weights, tied)
        layout = _SOURCE_LAYOUT.get(model) if max_shard_size is None else None
        export = _hf.FullExport(
            staging, tensors, osd, max_shard_size=max_shard_size or _hf.DEFAULT_MAX_SHARD_SIZE, layout=layout
        )
        # One agreement per step: a rank that fails must not leave the others in a collective.
        _on_every_rank(path, "writing each rank's slices of the full state", lambda: export.write_pieces(rank, world))
        _on_every_rank(path, "assembling the full state's files", lambda: export.assemble(rank, world))
        _on_every_rank(path, "indexing the full state (rank 0)", lambda: export.finish() if rank == 0 else None)
        del msd, osd, tensors, weights, flat, export
        known = {}
    _on_every_rank(path, "writing the RNG state", lambda: write_rng(staging, rank))  # + the barrier

    error = None
    if rank == 0:
        try:
            _describe_and_publish(
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
            _agree_on(error)
            raise
    error = _agree_on(error)
    if error is not None:
        raise CheckpointError(path, f"rank 0 failed to publish the checkpoint: {error}")
    return path


# --------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------


def _template(model: nn.Module) -> dict[str, Any]:
    return _without_4bit(model, get_model_state_dict(model))


def _global_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Name -> full shape of each state-dict entry, without building the state dict."""
    bridge = _bridge(model)
    if bridge is not None:
        return bridge.impl.global_shapes(bridge.model)
    return {k: _size(v) for k, v in model.state_dict().items()}


def _aliases_to_fill(tied: list[list[str]], present: set[str]) -> dict[str, str]:
    """alias -> source for tied names missing from a checkpoint whose partner is present."""
    fill = {}
    for group in tied:
        source = next((n for n in group if n in present), None)
        if source is not None:
            for name in group:
                if name not in present:
                    fill[name] = source
    return fill


def _read_torch_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
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


def _full_shapes(detected: Detected) -> dict[str, tuple[int, ...]]:
    if detected.kind is Kind.TORCH:
        sd, _ = _read_torch_file(detected.path)
        return {k: tuple(v.shape) for k, v in sd.items()}
    return {k: shape for k, (shape, _) in _hf.read_hf_shapes(detected.path).items()}


_CHUNK_NUMEL = 256 * 2**20
"""Full loads broadcast about this many elements per round (1 GiB of fp32), so that rank 0
holds one chunk of the checkpoint at a time rather than all of it.  Each round is one
set_model_state_dict call (for FSDP1 one unshard of every unit), hence not smaller."""


def _chunks(found: Mapping[str, tuple[int, ...]], tied: list[list[str]]) -> list[list[str]]:
    """Checkpoint names in rounds of about _CHUNK_NUMEL elements; tied aliases join their source."""
    fill = _aliases_to_fill(tied, set(found))
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


def _load_full(
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
        rank, _ = _rank_world()
        get: Callable[[str], torch.Tensor] | None = None
        osd: dict[str, Any] = {}
        error = None
        if rank == 0:
            try:
                if detected.kind is Kind.TORCH:
                    sd_all, torch_osd = _read_torch_file(detected.path)  # memory-mapped
                    osd = torch_osd or {}
                    get = sd_all.__getitem__
                else:
                    get = files.enter_context(_hf.WeightReader(detected.path)).get
                    if optimizer is not None and detected.meta.get("has_optimizer"):
                        osd = _hf.read_optimizer(detected.path)
                if optimizer is not None and not osd:
                    error = "holds no optimizer state; call load_checkpoint(path, model) without the optimizer"
                elif optimizer is not None:
                    misfit = _optimizer_misfit(osd, optimizer, {k: _size(v) for k, v in template.items()})
                    error = None if misfit is None else f"does not fit the optimizer: {misfit}"
            except CheckpointError as err:
                error = f"{err.path}: {'; '.join(err.problems)}"
        error = _agree_on(error)
        if error is not None:
            raise CheckpointError(detected.path, error)
        distributed = dist.is_initialized()
        if optimizer is not None:  # first: if torch refuses it, the model is still untouched
            try:
                set_optimizer_state_dict(
                    model, optimizer, osd, options=full_state_options(model, broadcast_from_rank0=distributed)
                )
            except (KeyError, ValueError, TypeError, RuntimeError) as err:
                raise CheckpointError(
                    detected.path, f"the optimizer state does not fit the optimizer ({type(err).__name__}: {err})"
                ) from None
        fill = _aliases_to_fill(tied, set(found))
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


def _load_hf_sliced(
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

    fill = _aliases_to_fill(tied if names is None else _tied_in_files(tied, names), set(found))
    bridge = _bridge(model)
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
    template = _template(model)
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


def _base_names(model: nn.Module, found: Mapping[str, tuple[int, ...]]) -> dict[str, str] | None:
    """For a PEFT model whose names are not those of the files: model name -> the base model's
    name, for every entry that is not an adapter's (None: the names are the model's own)."""
    own = _global_shapes(model)
    if set(found) <= set(own) or not any(k.startswith("base_model.model.") for k in own):
        return None
    if _peft.find_peft_model(model) is None:
        return None
    return {k: base for k in own if (base := base_weight_name(k)) is not None}


def _tied_in_files(tied: list[list[str]], names: Mapping[str, str]) -> list[list[str]]:
    groups = [list(dict.fromkeys(names[n] for n in group if n in names)) for group in tied]
    return [g for g in groups if len(g) > 1]


def _load_dcp(
    dcp_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    key_map: dict[str, str],
    template: dict[str, Any],
    tied: list[list[str]],
    with_optim: bool,
    all_or_nothing: bool = True,
) -> None:
    """Read a DCP directory into this rank's shards (DCP reshards to the current world).

    ``all_or_nothing``: everything is read into new tensors first (one more copy of this rank's
    shards while loading), so a shard that fails to read leaves the model and the optimizer as
    they were; otherwise straight into the live state."""
    fresh = _scratch if all_or_nothing else (lambda value: value)
    to_load: dict[str, Any] = {stored: fresh(template[ours]) for stored, ours in key_map.items()}
    if with_optim and optimizer is not None:
        to_load["optim"] = fresh(get_optimizer_state_dict(model, optimizer))
    try:
        read_dcp(to_load, dcp_dir)
    except CheckpointError as err:
        if all_or_nothing:
            raise
        raise CheckpointError(
            err.path,
            [*err.problems, "loaded with all_or_nothing=False: the model and optimizer now hold part of it"],
        ) from None
    loaded = {ours: to_load[stored] for stored, ours in key_map.items()}
    for alias, source in _aliases_to_fill(tied, set(loaded)).items():  # a tied name stored once
        loaded[alias] = loaded[source]
    if with_optim and optimizer is not None:  # first: if torch refuses it, the model is still untouched
        problems = group_problems(to_load["optim"].get("param_groups", []), optimizer, template)
        if problems:
            raise CheckpointError(dcp_dir, [*problems, "the optimizer state is damaged: load without the optimizer"])
        try:
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


def _dcp_key_map(detected: Detected, template: dict[str, Any], tied: list[list[str]]) -> tuple[dict[str, str], bool]:
    """stored DCP key -> model key, after checking names and shapes; and whether optimizer keys exist."""
    shapes = dcp_tensor_shapes(detected.dcp_dir)
    model_keys = {k: v for k, v in shapes.items() if not k.startswith("optim.")}
    has_optim = len(model_keys) != len(shapes)
    # fsdp_bridge nests the model under "model."; plain DCP code does either.  Pick the
    # reading whose names match the model's best.
    plain = {k: strip_wrapper_prefixes(k) for k in model_keys}
    nested = {k: strip_wrapper_prefixes(k.removeprefix("model.")) for k in model_keys}
    if detected.kind is Kind.SHARDED:
        key_map = nested
    else:
        key_map = max((plain, nested), key=lambda m: len(set(m.values()) & set(template)))
    found = {key_map[k]: v[0] for k, v in model_keys.items()}
    expected = {k: _size(v) for k, v in template.items()}
    compare_keys(detected.dcp_dir, found, expected, allow_missing=_aliases_to_fill(tied, set(found)))
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
        path: the checkpoint (directory or file).
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
    if _peft.is_adapter_dir(Path(path)) and not (Path(path) / META_FILE).is_file():
        # A PEFT adapter directory: its weights go into the model's adapters (no state, no optimizer).
        _on_every_rank(Path(path), "loading the adapter", lambda: _peft.load_adapter(Path(path), model))
        return {}
    detected = detect(path)
    if detected.kind is not Kind.SHARDED:
        _refuse_4bit(path, model, f"load_checkpoint() of a {detected.kind.value} checkpoint loads")
    if detected.kind in (Kind.SHARDED, Kind.FULL):
        # Each rank reads the contents of its share of the files; a damaged one refuses the load everywhere.
        part = _rank_world()
        _on_every_rank(detected.path, "verifying the checkpoint's files", lambda: verify_manifest(detected, part=part))
    if optimizer is not None and detected.kind in (Kind.SHARDED, Kind.FULL) and not detected.meta.get("has_optimizer"):
        raise CheckpointError(
            detected.path,
            "holds no optimizer state (it was saved without an optimizer); "
            "call load_checkpoint(path, model) without the optimizer",
        )
    rank, world = _rank_world()
    ours = detected.kind in (Kind.SHARDED, Kind.FULL)
    saved_world = detected.meta.get("world_size")

    def read_side_files() -> tuple[dict[str, Any], dict[str, Any] | None]:
        # Before any tensor is copied: a corrupt state or RNG file (even on one rank) refuses the
        # whole load on every rank, with the model untouched.
        state = read_state(detected.path) if ours else {}
        rng = read_rng(detected.path, rank) if ours and restore_rng and saved_world == world else None
        return state, rng

    state, rng = _on_every_rank(detected.path, "reading the training state and RNG", read_side_files)
    tied = _tied_groups(model)
    if detected.kind in (Kind.SHARDED, Kind.DCP):
        template = _template(model)
        key_map, has_optim = _dcp_key_map(detected, template, tied)
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
        found = _full_shapes(detected)
        sliced = optimizer is None and detected.kind in (Kind.HF, Kind.FULL) and detected.path.is_dir()
        names = _base_names(model, found) if sliced else None
        expected = _global_shapes(model)
        if names is not None:  # a PEFT model filled from its base's directory: the adapters stay
            expected = {names[k]: shape for k, shape in expected.items() if k in names}
        file_tied = tied if names is None else _tied_in_files(tied, names)
        compare_keys(detected.path, found, expected, allow_missing=_aliases_to_fill(file_tied, set(found)))
        if sliced:
            _load_hf_sliced(detected.path, model, tied, found, names=names)
        else:
            _load_full(detected, model, optimizer, _template(model), tied, found)

    if not ours:
        return {}
    if restore_rng:
        if rng is not None:
            _restore_rng_states(rng)
        elif rank == 0:
            logger.warning("fsdp_bridge: RNG states not restored (saved at world size %s, now %s)", saved_world, world)
    return state


# --------------------------------------------------------------------------------------
# pretrained weights into a sharded model
# --------------------------------------------------------------------------------------


def _remember_layout(model: nn.Module, path: str | os.PathLike[str]) -> None:
    directory = Path(path)
    weight_map = _hf.read_weight_map(directory) if directory.is_dir() else None
    if weight_map is not None:
        _SOURCE_LAYOUT[model] = weight_map


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
    tied = _tied_groups(model)
    names = _base_names(model, found)
    if names is not None:  # a PEFT model over this base: its adapters are not in the files
        expected = {names[k]: shape for k, shape in expected.items() if k in names}
        tied = _tied_in_files(tied, names)
    allowed = _aliases_to_fill(tied, set(found))
    if not set(found) <= set(expected):
        return False
    return all(found[k] == shape if k in found else k in allowed for k, shape in expected.items())


_SOURCE_LAYOUT: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()
"""The safetensors index (name -> file) of the directory load_pretrained filled a model from:
a full export of that model writes the same files."""


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

    if _bridge(model_or_builder) is not None:  # type: ignore[arg-type]
        load_checkpoint(path, model_or_builder, restore_rng=False)  # type: ignore[arg-type]
        _remember_layout(model_or_builder, path)  # type: ignore[arg-type]
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
    _remember_layout(sharded, path)
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
    bridge = _bridge(model)
    filled: set[str] = set()
    if bridge is not None:

        def read_rows(name: str, start: int, stop: int) -> torch.Tensor | None:
            value = tensors.get(name)
            return None if value is None else (value.reshape(1) if value.dim() == 0 else value[start:stop])

        filled = bridge.impl.load_local(bridge.model, read_rows) or set()
    rest: dict[str, Any] = {k: v for k, v in tensors.items() if k not in filled}
    if rest:
        set_model_state_dict(model, rest, options=full_state_options(model, strict=False))
