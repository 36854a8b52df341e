"""Offline conversion between checkpoint kinds, and inspection; no process group needed.

Reads any kind :func:`~fsdp_bridge.checkpoint.detect` recognises into full tensors in
this process, and writes a Hugging Face directory (``hf``), an fsdp_bridge sharded DCP
directory (``sharded``, loadable at any world size) or one ``torch.save`` file
(``torch``, the model state dict only).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from fsdp_bridge._paths import unwritable_reason
from fsdp_bridge.checkpoint import _hf
from fsdp_bridge.checkpoint._atomic import (
    SaveLock,
    check_not_nested,
    check_replaceable,
    make_staging,
    partial_path,
    publish,
    remove_ours,
)
from fsdp_bridge.checkpoint._description import Description
from fsdp_bridge.checkpoint._formats import (
    DCP_DIR,
    OPTIM_TENSORS,
    RNG_DIR,
    STATE_FILE,
    CheckpointError,
    Detected,
    Kind,
    detect,
    load_dcp_metadata,
    param_stats,
    read_dcp,
    strip_wrapper_prefixes,
    verify_manifest,
    without_process_group,
)
from fsdp_bridge.checkpoint._publish import check_save_name
from fsdp_bridge.checkpoint._remote import claim_staging, download, new_claim, upload_and_publish
from fsdp_bridge.checkpoint._state import read_rng, read_state
from fsdp_bridge.checkpoint._storage import Remote, is_url

__all__ = ["Target", "convert_checkpoint", "inspect_checkpoint", "read_full"]

Target = Literal["hf", "sharded", "torch"]
TARGETS: tuple[str, ...] = ("hf", "sharded", "torch")
_HF_CONFIG_FILES = ("config.json", "generation_config.json")


@dataclass
class FullCheckpoint:
    """A checkpoint read whole into memory."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    stream: _DCPStream | None = None
    """Instead of ``model``/``optimizer``: a DCP directory read a batch at a time."""


@dataclass
class _DCPStream:
    """A DCP directory read a batch of tensors at a time (for ``--to hf``): names, shapes and
    dtypes from its metadata; values only when written out."""

    dcp_dir: Path
    model: dict[str, tuple[str, tuple[int, ...], torch.dtype]]
    """parameter name -> (stored key, shape, dtype)"""
    optim_tensors: dict[str, tuple[str, tuple[int, ...], torch.dtype]]
    """``fqn/name`` (as in optimizer.safetensors) -> (stored key, shape, dtype)"""
    optim_objects: list[str]
    """stored keys of the optimizer's other items (param_groups, non-tensor state)"""

    @classmethod
    def open(cls, dcp_dir: Path) -> _DCPStream:
        metadata = load_dcp_metadata(dcp_dir / ".metadata")
        items = metadata.state_dict_metadata
        model_keys = [k for k in items if not k.startswith("optim.")]
        nested = bool(model_keys) and all(k.startswith("model.") for k in model_keys)
        stream = cls(dcp_dir, {}, {}, [])
        for key, item in items.items():
            spec = (key, tuple(item.size), item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
            if key.startswith("optim."):
                rest = key.removeprefix("optim.")
                if spec is not None and rest.startswith("state."):
                    fqn, _, name = rest.removeprefix("state.").rpartition(".")
                    stream.optim_tensors[f"{fqn}/{name}"] = spec
                else:
                    stream.optim_objects.append(key)
            elif spec is not None:
                stream.model[strip_wrapper_prefixes(key.removeprefix("model.") if nested else key)] = spec
        return stream

    @property
    def has_optimizer(self) -> bool:
        return bool(self.optim_tensors or self.optim_objects)

    def _read(self, specs: dict[str, tuple[str, tuple[int, ...], torch.dtype]], names: list[str]) -> dict[str, Any]:
        flat = {specs[n][0]: torch.empty(specs[n][1], dtype=specs[n][2]) for n in names}
        read_dcp(flat, self.dcp_dir, no_dist=True)
        return {n: flat[specs[n][0]] for n in names}

    def write_hf(
        self, staging: Path, tied: list[list[str]], max_shard_size: int | str, layout: dict[str, str] | None
    ) -> None:
        """The Hugging Face layout save_checkpoint(kind="full") writes, one batch of tensors in memory
        at a time; in the files of ``layout`` (an index's weight map) when it names these tensors."""
        aliases = {n for group in tied for n in group[1:]}
        weights = {n: spec for n, spec in self.model.items() if n not in aliases}
        sizes = {n: math.prod(shape) * dtype.itemsize for n, (_, shape, dtype) in weights.items()}
        names, indexed = _hf.plan_files(sizes, max_shard_size, layout)
        for file_name in dict.fromkeys(names.values()):
            specs = {n: weights[n][1:] for n in weights if names[n] == file_name}
            _hf.write_safetensors_streamed(staging / file_name, specs, lambda batch: self._read(weights, batch))
        if indexed:
            _hf.write_index(staging, names, sizes)
        if self.has_optimizer:
            flat: dict[str, Any] = dict.fromkeys(self.optim_objects)
            read_dcp(flat, self.dcp_dir, no_dist=True)
            osd = _unflatten_optim({k.removeprefix("optim."): v for k, v in flat.items()}) or {}
            scalars = {fqn: dict(entries) for fqn, entries in osd.get("state", {}).items() if entries}
            specs = {n: spec[1:] for n, spec in self.optim_tensors.items()}
            optim = self.optim_tensors
            _hf.write_safetensors_streamed(staging / OPTIM_TENSORS, specs, lambda batch: self._read(optim, batch))
            _hf.write_optimizer_json(staging, osd, scalars)

    def stats(self, tied: list[list[str]]) -> dict[str, Any]:
        shapes = {n: (shape, str(dtype).removeprefix("torch.")) for n, (_, shape, dtype) in self.model.items()}
        return param_stats(shapes, tied)


def _read_dcp_full(dcp_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every item of a DCP directory as full tensors (or objects), keyed by stored name."""
    metadata = load_dcp_metadata(dcp_dir / ".metadata")
    flat: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            flat[key] = torch.empty(item.size, dtype=item.properties.dtype)
        elif isinstance(item, BytesStorageMetadata):
            flat[key] = None
    read_dcp(flat, dcp_dir, no_dist=True)
    model = {k: v for k, v in flat.items() if not k.startswith("optim.")}
    optim = {k.removeprefix("optim."): v for k, v in flat.items() if k.startswith("optim.")}
    return model, optim


def _unflatten_optim(flat: dict[str, Any]) -> dict[str, Any] | None:
    if not flat:
        return None
    state: dict[str, dict[str, Any]] = {}
    numbered: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith("state."):
            fqn, _, name = key.removeprefix("state.").rpartition(".")
            state.setdefault(fqn, {})[name] = value
        elif key.startswith("param_groups."):
            # DCP flattens the list of groups one value at a time: param_groups.<i>.<name>
            index, _, name = key.removeprefix("param_groups.").partition(".")
            if index.isdigit() and name:
                numbered.setdefault(int(index), {})[name] = list(value) if isinstance(value, tuple) else value
    groups = flat.get("param_groups")
    if not isinstance(groups, list):
        groups = [numbered[i] for i in sorted(numbered)]
    return {"state": state, "param_groups": groups}


def _check_hf_config(config_path: Path) -> None:
    """``--hf-config`` must be a transformers config.json (or a directory holding one): it is
    copied beside the weights as ``config.json``, so anything else would be published as one."""
    from fsdp_bridge.errors import ConfigError, Problem

    allowed = "a transformers config.json (a JSON object with model_type), or a directory holding one"
    target = config_path / "config.json" if config_path.is_dir() else config_path
    if not target.is_file():
        raise ConfigError(
            [
                Problem(
                    "hf_config",
                    str(config_path),
                    allowed,
                    f"{target} does not exist; pass the config.json of the model's family",
                )
            ]
        )
    try:
        if target.stat().st_size > 16 << 20:
            raise ValueError("larger than 16 MiB")
        data = json.loads(target.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(
            [
                Problem(
                    "hf_config",
                    str(config_path),
                    allowed,
                    f"{target} is not a JSON file ({' '.join(str(err).split())[:200]})",
                )
            ]
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(
            [
                Problem(
                    "hf_config",
                    str(config_path),
                    allowed,
                    f"{target} holds JSON without a model_type key: not a transformers config",
                )
            ]
        )


def read_full(path: str | os.PathLike[str]) -> FullCheckpoint:
    """Read any checkpoint kind whole, in this process (no process group)."""
    detected = detect(path)
    if detected.kind in (Kind.SHARDED, Kind.FULL):
        verify_manifest(detected)
    meta = dict(detected.meta)
    if detected.kind in (Kind.SHARDED, Kind.DCP):
        stored, optim_flat = _read_dcp_full(detected.dcp_dir)
        nested = bool(stored) and all(k.startswith("model.") for k in stored)
        model = {
            strip_wrapper_prefixes(k.removeprefix("model.") if nested else k): v
            for k, v in stored.items()
            if isinstance(v, torch.Tensor)
        }
        optimizer = _unflatten_optim(optim_flat)
    elif detected.kind is Kind.TORCH:
        from fsdp_bridge.checkpoint._load_files import read_torch_file

        model, optimizer = read_torch_file(detected.path)
    else:
        model = _hf.read_hf_weights(detected.path)
        optimizer = _hf.read_optimizer(detected.path) if meta.get("has_optimizer") else None
    for group in meta.get("tied", []):
        source = next((n for n in group if n in model), None)
        for name in group:
            if source is not None and name not in model:
                model[name] = model[source]
    return FullCheckpoint(model, optimizer, meta)


def _copy_side_files(src: Detected, staging: Path, hf_config: Path | None) -> bool:
    """Copy config.json & co, training state and RNG states; True if a config.json was written."""
    config_src = hf_config if hf_config is not None else (src.path if src.path.is_dir() else None)
    if config_src is not None and config_src.is_file():
        shutil.copyfile(config_src, staging / "config.json")
    elif config_src is not None:
        for name in _HF_CONFIG_FILES:
            if (config_src / name).is_file():
                shutil.copyfile(config_src / name, staging / name)
    if src.kind in (Kind.SHARDED, Kind.FULL):
        if (src.path / STATE_FILE).is_file():
            shutil.copyfile(src.path / STATE_FILE, staging / STATE_FILE)
        if (src.path / RNG_DIR).is_dir():
            shutil.copytree(src.path / RNG_DIR, staging / RNG_DIR)
    return (staging / "config.json").is_file()


def _stats(model: dict[str, torch.Tensor], tied: list[list[str]]) -> dict[str, Any]:
    return param_stats({k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.items()}, tied)


def convert_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: Target,
    hf_config: str | os.PathLike[str] | None = None,
    max_shard_size: int | str = _hf.DEFAULT_MAX_SHARD_SIZE,
) -> Path | str:
    """Convert ``src`` (any kind) to ``dst`` of kind ``to`` in this process; return ``dst``.

    Args:
        src: a checkpoint of any kind (sharded, full, Hugging Face, plain DCP or torch file), or
            an fsspec URL of an fsdp_bridge checkpoint (fetched to a local copy first).
        dst: where to write; a directory that is not a checkpoint is never replaced. An fsspec
            URL for ``hf`` and ``sharded``: written locally, then published there.
        to: ``"hf"``, ``"sharded"`` or ``"torch"``.
        hf_config: a ``config.json`` (or a directory holding one) to put beside the weights
            when ``src`` carries none (plain DCP or torch files), so ``from_pretrained`` can
            load them; a directory with a safetensors index also gives ``hf`` its file layout.
        max_shard_size: the largest safetensors file of an ``hf`` output (bytes or ``"5GB"``).

    Returns:
        ``dst`` as a path (a URL as given).

    Raises:
        ConfigError: ``to`` is not one of the kinds above (a ``ValueError``, as before).
        CheckpointError: ``src`` is not a complete checkpoint, ``dst`` is inside ``src`` (or the
            reverse), ``dst`` already exists for ``to="torch"``, or a file cannot be written.
    """
    if to not in TARGETS:
        from fsdp_bridge.errors import ConfigError, Problem

        raise ConfigError(
            [Problem("to", to, ", ".join(TARGETS), "use one of these kinds (the choices of fsdp-bridge convert --to)")]
        )
    if is_url(src) or is_url(dst):
        return _convert_at_urls(str(src), str(dst), to=to, hf_config=hf_config, max_shard_size=max_shard_size)
    return _convert_local(src, dst, to=to, hf_config=hf_config, max_shard_size=max_shard_size, label=str(Path(src)))


def _convert_at_urls(
    src: str, dst: str, *, to: Target, hf_config: str | os.PathLike[str] | None, max_shard_size: int | str
) -> Path | str:
    """A conversion from or to an fsspec URL, through local copies: the source fetched (the objects
    its description lists), the result written locally, then uploaded and published at the URL as
    a save there is (description written last)."""
    with tempfile.TemporaryDirectory(prefix="fsdp_bridge_convert_") as tmp:
        local_src: str | Path = download(Remote.of(src), Path(tmp) / "src") if is_url(src) else src
        if not is_url(dst):
            return _convert_local(local_src, dst, to=to, hf_config=hf_config, max_shard_size=max_shard_size, label=src)
        if to == "torch":
            raise CheckpointError(
                dst, "--to torch writes one local file; convert to a local path, or --to hf or sharded to the URL"
            )
        dest = Remote.of(dst)
        check_save_name(dst, dest.name, None, None)
        claim = new_claim()
        claim_staging(dest, claim)
        local_dst = Path(tmp) / "dst" / dest.name
        _convert_local(local_src, local_dst, to=to, hf_config=hf_config, max_shard_size=max_shard_size, label=src)
        upload_and_publish(local_dst, dest, claim)
        return dst


def _convert_local(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: Target,
    hf_config: str | os.PathLike[str] | None,
    max_shard_size: int | str,
    label: str,
) -> Path:
    dst_path = Path(dst)
    check_not_nested(Path(src), dst_path)
    if to == "torch" and (dst_path.exists() or dst_path.is_symlink()):
        raise CheckpointError(
            dst_path,
            "exists; --to torch writes a new file and never replaces one: choose a new path, or remove it yourself",
        )
    if to != "torch":
        check_replaceable(dst_path)
    config_path = Path(hf_config) if hf_config is not None else None
    if config_path is not None:
        _check_hf_config(config_path)
    reason = unwritable_reason(dst_path)
    if reason is not None:  # before reading a possibly large source
        raise CheckpointError(dst_path, f"cannot be written: {reason}; choose a destination in a writable directory")
    detected = detect(src)
    if to == "hf" and detected.kind in (Kind.SHARDED, Kind.DCP):
        # Streamed: one batch of tensors in memory at a time, never the whole state.
        if detected.kind is Kind.SHARDED:
            verify_manifest(detected)
        full = FullCheckpoint({}, None, dict(detected.meta), stream=_DCPStream.open(detected.dcp_dir))
    else:
        full = read_full(src)
    if detected.kind in (Kind.SHARDED, Kind.FULL):  # copied as they are: refuse damaged ones now
        read_state(detected.path)
        for rank in range(int(full.meta.get("world_size") or 1)):
            read_rng(detected.path, rank)
    try:
        return _write_converted(
            detected, full, label, dst_path, to=to, config_path=config_path, max_shard_size=max_shard_size
        )
    except OSError as err:
        raise CheckpointError(
            dst_path, f"cannot be written ({err}); check free space and permissions, or choose another destination"
        ) from None


def _write_converted(
    detected: Detected,
    full: FullCheckpoint,
    src: str | os.PathLike[str],
    dst_path: Path,
    *,
    to: Target,
    config_path: Path | None,
    max_shard_size: int | str,
) -> Path:
    if to == "torch":
        dst_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst_path.with_name("." + dst_path.name + ".partial")
        try:
            torch.save(full.model, tmp)
        except RuntimeError as err:  # torch reports a file it cannot open as RuntimeError
            tmp.unlink(missing_ok=True)
            raise OSError(f"torch.save failed: {' '.join(str(err).split())[:200]}") from None
        os.replace(tmp, dst_path)
        return dst_path

    staging = partial_path(dst_path)
    with SaveLock(dst_path):  # refused while another process writes dst
        remove_ours(staging, "the staging directory of this conversion")  # left by a killed conversion
        make_staging(staging)
        try:
            _write_staging(detected, full, src, staging, to=to, config_path=config_path, max_shard_size=max_shard_size)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # a failed conversion leaves nothing behind
            raise
        publish(staging, dst_path)
    return dst_path


def _write_staging(
    detected: Detected,
    full: FullCheckpoint,
    src: str | os.PathLike[str],
    staging: Path,
    *,
    to: Target,
    config_path: Path | None,
    max_shard_size: int | str,
) -> None:
    tied = full.meta.get("tied", [])
    if full.stream is not None:
        # --hf-config ORIGINAL_DIR: back into the files the original model came in.
        layout = _hf.read_weight_map(config_path) if config_path is not None and config_path.is_dir() else None
        full.stream.write_hf(staging, tied, max_shard_size, layout)
    elif to == "hf":
        _hf.write_hf_weights(staging, _hf.drop_tied_aliases(full.model, tied), max_shard_size=max_shard_size)
        if full.optimizer is not None:
            _hf.write_optimizer(staging, full.optimizer)
    else:
        to_save: dict[str, Any] = {"model": full.model}
        if full.optimizer is not None:
            to_save["optim"] = full.optimizer
        with without_process_group():
            dcp.save(to_save, storage_writer=dcp.FileSystemWriter(str(staging / DCP_DIR)), no_dist=True)
    has_config = _copy_side_files(detected, staging, config_path)
    Description(
        kind="full" if to == "hf" else "sharded",
        backend=full.meta.get("backend"),
        world_size=full.meta.get("world_size", 1),
        step=full.meta.get("step"),
        bridge_config=full.meta.get("bridge_config"),
        model_class=full.meta.get("model_class"),
        hf_config=has_config,
        has_optimizer=full.optimizer is not None or (full.stream is not None and full.stream.has_optimizer),
        tied=tied,
        params=full.stream.stats(tied) if full.stream is not None else _stats(full.model, tied),
        converted_from={"path": str(src), "kind": detected.kind.value},
    ).write(staging)


def _disk_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def inspect_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a checkpoint holds, read from its metadata and headers (tensor data is not loaded
    except for ``torch.save`` files, which are memory-mapped).

    Args:
        path: a checkpoint directory or file of any kind, or the fsspec URL of an fsdp_bridge
            checkpoint.

    Returns:
        ``path``, ``kind``, ``size_bytes``, what ``fsdp_bridge.json`` records (backend, world
        size, step, model class, versions ...) where there is one, ``params`` (elements per
        dtype, tensor count) and the main fields of a ``config.json`` beside the weights (what
        ``fsdp-bridge inspect --json`` prints).

    Raises:
        CheckpointError: ``path`` is not a complete checkpoint, or a file it lists is missing
            or has another size.
    """
    if is_url(path):
        # An fsdp_bridge checkpoint at a URL: inspected from a local copy (every listed object is
        # fetched and verified, as a local inspection reads every file).
        with tempfile.TemporaryDirectory(prefix="fsdp_bridge_inspect_") as tmp:
            found = inspect_checkpoint(download(Remote.of(str(path)), Path(tmp)))
        return {**found, "path": str(path)}
    detected = detect(path)
    meta = detected.meta
    info: dict[str, Any] = {
        "path": str(detected.path),
        "kind": detected.kind.value,
        "size_bytes": _disk_size(detected.path),
    }
    if detected.kind in (Kind.SHARDED, Kind.FULL):
        verify_manifest(detected)
        for key in (
            "backend",
            "world_size",
            "step",
            "model_class",
            "has_optimizer",
            "saved_at",
            "torch_version",
            "fsdp_bridge_version",
            "converted_from",
            "bridge_config",
        ):
            info[key] = meta.get(key)
        info["params"] = meta.get("params")
    else:
        if detected.kind is Kind.DCP:
            metadata = load_dcp_metadata(detected.path / ".metadata")
            shapes = {
                k: (tuple(v.size), str(v.properties.dtype).removeprefix("torch."))
                for k, v in metadata.state_dict_metadata.items()
                if isinstance(v, TensorStorageMetadata)
            }
            info["has_optimizer"] = any(k.startswith("optim.") for k in shapes)
            shapes = {k: v for k, v in shapes.items() if not k.startswith("optim.")}
        elif detected.kind is Kind.TORCH:
            from fsdp_bridge.checkpoint._load_files import read_torch_file

            sd, osd = read_torch_file(detected.path)
            shapes = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()}
            info["has_optimizer"] = osd is not None
        else:
            shapes = {
                k: (s, d.lower().replace("f32", "float32").replace("bf16", "bfloat16").replace("f16", "float16"))
                for k, (s, d) in _hf.read_hf_shapes(detected.path).items()
            }
            info["has_optimizer"] = False
        dtypes: dict[str, int] = {}
        for shape, dtype in shapes.values():
            dtypes[dtype] = dtypes.get(dtype, 0) + math.prod(shape)
        info.update(backend=None, world_size=None, step=None)
        info["params"] = {"numel": sum(dtypes.values()), "dtypes": dtypes, "tensors": len(shapes)}
    config_dir = detected.path if detected.path.is_dir() else detected.path.parent
    if (config_dir / "config.json").is_file():
        try:
            hf_cfg = json.loads((config_dir / "config.json").read_text())
            info["hf_config"] = {
                k: hf_cfg.get(k)
                for k in ("model_type", "architectures", "hidden_size", "num_hidden_layers", "vocab_size")
                if k in hf_cfg
            }
        except ValueError:
            info["hf_config"] = "unreadable config.json"
    return info
