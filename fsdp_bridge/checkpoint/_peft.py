"""PEFT (LoRA) exports of a sharded model: an adapter directory, or the base with adapters merged.

``kind="adapter"`` writes what ``peft.PeftModel.from_pretrained(base, path)`` loads
(``adapter_config.json`` + ``adapter_model.safetensors``); ``kind="merged"`` writes a plain
Hugging Face directory of the base model with the adapters merged into its weights, which
``from_pretrained`` loads without peft.  Both gather the full state once (every rank takes
part), and rank 0 writes into a hidden staging directory published by one rename.

Both exports also hold ``fsdp_bridge_export.json``, written last: the size and CRC-32C of every
file, checked when an adapter directory or a merged export is loaded (a flipped byte, a missing
or renamed file is refused, naming the file), and the owner file that lets a later export replace
this one. Loading an adapter also refuses a weights file that is a symlink out of the directory,
one that lacks tensors of the model's adapters (naming them), and tensors whose dtype differs from
the model's (never cast).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from fsdp_bridge._lora import has_4bit
from fsdp_bridge.checkpoint._atomic import (
    OWNER_FILE,
    SaveLock,
    check_replaceable,
    make_staging,
    partial_path,
    publish,
    remove_ours,
    write_json_durably,
)
from fsdp_bridge.checkpoint._formats import CHECKSUM, CheckpointError, checksum_of
from fsdp_bridge.checkpoint._ranks import on_every_rank

__all__ = ["PEFT_KINDS", "find_peft_model", "is_adapter_dir", "load_adapter", "save_peft", "verify_export"]

PEFT_KINDS = ("adapter", "merged")
PeftKind = Literal["adapter", "merged"]
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
EXPORT_FILE = "fsdp_bridge_export.json"
"""The description of an export: what it is and the size and checksum of every file."""
EXPORT_FORMAT = "fsdp_bridge.export"
_EXPORT_MAX_BYTES = 1 << 20


def find_peft_model(model: nn.Module) -> Any | None:
    """The ``peft.PeftModel`` inside ``model`` (the model itself, or under a wrapper), if any."""
    try:
        from peft import PeftModel
    except ImportError:
        return None
    return next((m for m in model.modules() if isinstance(m, PeftModel)), None)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _describe_export(directory: Path, kind: str) -> None:
    """Write ``directory/fsdp_bridge_export.json`` last: the kind, and the size and CRC-32C of every file."""
    files = {
        str(f.relative_to(directory)): {"size": f.stat().st_size, "checksum": checksum_of(f, CHECKSUM)}
        for f in sorted(directory.rglob("*"))
        if f.is_file() and not f.is_symlink() and f.name != EXPORT_FILE
    }
    record = {"format": EXPORT_FORMAT, "version": 1, "kind": kind, "checksum_algorithm": CHECKSUM, "files": files}
    write_json_durably(directory / EXPORT_FILE, record)


def _export_record(path: Path) -> dict[str, dict[str, int]] | None:
    """The ``files`` of ``path``'s export description (None when it has none: a directory
    PEFT wrote itself), each entry checked to be a size and a checksum."""
    file = path / EXPORT_FILE
    if not file.exists() and not file.is_symlink():
        return None
    if file.is_symlink() or not file.is_file() or file.stat().st_size > _EXPORT_MAX_BYTES:
        raise CheckpointError(file, f"must be a regular file of at most {_EXPORT_MAX_BYTES} bytes written by a save")
    try:
        record = json.loads(file.read_bytes())
    except (ValueError, RecursionError) as err:
        raise CheckpointError(file, f"is not valid JSON ({err}); the export is damaged: export it again") from None
    files = record.get("files") if isinstance(record, dict) else None
    well_formed = (
        isinstance(record, dict)
        and set(record) == {"format", "version", "kind", "checksum_algorithm", "files"}
        and record.get("format") == EXPORT_FORMAT
        and record.get("checksum_algorithm") == CHECKSUM
        and isinstance(files, dict)
        and all(
            isinstance(k, str)
            and isinstance(v, dict)
            and set(v) == {"size", "checksum"}
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v.values())
            for k, v in files.items()
        )
    )
    if not well_formed:
        raise CheckpointError(
            file,
            f"is not a valid export description (exactly format {EXPORT_FORMAT!r}, version, kind, "
            f"checksum_algorithm {CHECKSUM!r}, files: name -> {{size, checksum}}); the export is damaged: "
            "export it again",
        )
    return files  # type: ignore[return-value]


def _verify_adapter_files(path: Path) -> None:
    """The adapter files are inside ``path`` (no symlink out of it) and match the export description."""
    root = path.resolve()
    for name in ADAPTER_FILES:
        f = path / name
        if f.is_symlink() and not f.resolve().is_relative_to(root):
            raise CheckpointError(
                f,
                f"is a symlink to {os.readlink(f)!r}, outside the adapter directory; files of an adapter are "
                "read from inside it only: copy the file into the directory",
            )
    files = _export_record(path)
    if files is None and (path / OWNER_FILE).is_file():
        raise CheckpointError(
            path,
            f"is an export of fsdp_bridge (it holds {OWNER_FILE}) but its {EXPORT_FILE} is missing, so its "
            "checksums cannot be verified; the export is damaged: export it again",
        )
    if files is None:
        return  # written by PEFT itself: no checksums to verify
    problems = []
    for name in ADAPTER_FILES:
        entry = files.get(name)
        f = path / name
        if entry is None:
            problems.append(f"{name}: not listed in {EXPORT_FILE}")
        elif f.stat().st_size != entry["size"]:
            problems.append(f"{name}: {f.stat().st_size} bytes, {entry['size']} recorded")
        elif checksum_of(f, CHECKSUM) != entry["checksum"]:
            problems.append(f"{name}: content differs from the {CHECKSUM} recorded (damaged after saving)")
    if problems:
        raise CheckpointError(path, [*problems, "the adapter is damaged: export it again from a checkpoint"])


def verify_export(path: Path, *, part: tuple[int, int] = (0, 1)) -> None:
    """A directory holding an export description (a merged export: a Hugging Face directory) holds
    exactly the files it lists, each a regular file of the recorded size and checksum; a directory
    without one is left alone. ``part=(rank, world)``: names and sizes are checked on every rank, the
    contents of every ``world``-th file on this rank, so that the ranks share the reading.

    Raises:
        CheckpointError: a listed file is missing, a symlink, of another size or content, or a file
            is not listed (renamed or added after saving), naming each one.
    """
    files = _export_record(path)
    if files is None:
        return
    present = {
        str(f.relative_to(path)) for f in path.rglob("*") if (f.is_file() or f.is_symlink()) and f.name != EXPORT_FILE
    }
    problems = [f"{name}: listed in {EXPORT_FILE}, missing" for name in sorted(set(files) - present)]
    problems += [
        f"{name}: not listed in {EXPORT_FILE} (renamed or added after saving)" for name in sorted(present - set(files))
    ]
    rank, world = part
    for i, name in enumerate(sorted(set(files) & present)):
        f, entry = path / name, files[name]
        if f.is_symlink():
            problems.append(f"{name}: a symlink, where the export wrote a regular file")
        elif f.stat().st_size != entry["size"]:
            problems.append(f"{name}: {f.stat().st_size} bytes, {entry['size']} recorded")
        elif i % world == rank and checksum_of(f, CHECKSUM) != entry["checksum"]:
            problems.append(f"{name}: content differs from the {CHECKSUM} recorded (damaged after saving)")
    if problems:
        more = [f"and {len(problems) - 10} more"] if len(problems) > 10 else []
        raise CheckpointError(path, [*problems[:10], *more, "the export is damaged: export it again from a checkpoint"])


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
    check_replaceable(target)  # every rank, before the gather: never replace the user's files
    state = get_model_state_dict(model, options=full_state_dict)  # collective: every rank

    def write() -> None:  # rank 0, under the path's save lock
        if _rank() != 0:
            return
        with SaveLock(target):
            staging = partial_path(target)
            remove_ours(staging, "the staging directory of this export")  # left by a killed export
            make_staging(staging)
            tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
            if kind == "adapter":
                # A 4-bit base's packed codes do not fit the unquantized rebuild: only the adapters go in.
                _write_adapter(peft_model, tensors, staging, adapters_only=quantized)
            else:
                _write_merged(peft_model, tensors, staging, max_shard_size=max_shard_size)
            _describe_export(staging, kind)
            publish(staging, target)  # the previous export moved aside, deleted once this one is in place

    # A failure on rank 0 (a full disk, another save of this path) reaches every rank at once.
    on_every_rank(target, f"writing the {kind} export (rank 0)", write)
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
    parameter of ``model`` with the same shape and dtype, and every adapter parameter must have
    a tensor in the file, checked before anything is copied; the files must match the sizes and
    checksums of ``fsdp_bridge_export.json`` when the directory has one.

    Raises:
        CheckpointError: ``model`` has no adapters, the files are damaged, or the adapter does not fit them.
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
    _verify_adapter_files(path)
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
    missing = sorted(k for k in by_saved_name if k not in tensors)
    wrong_dtype = sorted(
        f"{k}: {str(v.dtype).removeprefix('torch.')} in the file, "
        f"{str(template[by_saved_name[k]].dtype).removeprefix('torch.')} in the model"
        for k, v in tensors.items()
        if k in by_saved_name and v.dtype != template[by_saved_name[k]].dtype
    )
    if unknown or misfit or missing or wrong_dtype:
        raise CheckpointError(
            path,
            [
                *(f"{k}: no such adapter parameter in the model (adapter {name!r})" for k in unknown[:10]),
                *misfit[:10],
                *(f"{k}: missing from the file (the model's adapter {name!r} has it)" for k in missing[:10]),
                *(f"... and {len(missing) - 10} more missing" for _ in range(len(missing) > 10)),
                *(f"{m} (not cast: save the adapter in the model's dtype)" for m in wrong_dtype[:10]),
            ],
        )
    mapped: dict[str, Any] = {by_saved_name[k]: v for k, v in tensors.items()}
    set_model_state_dict(model, mapped, options=StateDictOptions(full_state_dict=True, strict=False))
