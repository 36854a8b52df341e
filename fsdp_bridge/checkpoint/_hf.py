"""Hugging Face model directories: consolidated safetensors (+ index) and ``config.json``.

Written with ``huggingface_hub.split_torch_state_dict_into_shards`` and
``safetensors.torch.save_file``: the same layout ``save_pretrained`` produces and
``from_pretrained`` reads.  Tied parameters (GPT-2's ``lm_head.weight`` = ``wte.weight``)
are stored once, under the name that comes first in the model, as Hugging Face does.
The full optimizer state sits beside the weights as ``optimizer.safetensors`` (tensors)
and ``optimizer.json`` (hyper-parameters and non-tensor state).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

from fsdp_bridge.backends.base import FlatPiece, FlatTensor
from fsdp_bridge.checkpoint._formats import (
    OPTIM_JSON,
    OPTIM_TENSORS,
    CheckpointError,
    safe_child,
    without_process_group,
)

__all__ = [
    "FullExport",
    "drop_tied_aliases",
    "file_of_each",
    "layout_fits",
    "parse_size",
    "plan_files",
    "read_hf_shapes",
    "read_hf_slices",
    "read_hf_weights",
    "read_optimizer",
    "read_weight_map",
    "write_hf_config",
    "write_hf_weights",
    "write_index",
    "write_optimizer",
    "write_optimizer_json",
    "write_safetensors_streamed",
]

_V = TypeVar("_V")

INDEX = "model.safetensors.index.json"
_SUFFIX = ".safetensors"
SINGLE = "model.safetensors"
DEFAULT_MAX_SHARD_SIZE = "5GB"


def drop_tied_aliases(state_dict: dict[str, _V], tied: Iterable[Iterable[str]]) -> dict[str, _V]:
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


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes from an int or ``save_pretrained``'s spelling ("5GB" = 5 * 10**9, "20KiB", "500MB")."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(size), flags=re.IGNORECASE)
    if not isinstance(size, (int, str)) or isinstance(size, bool) or match is None or float(match[1]) <= 0:
        raise ValueError(
            f"max_shard_size must be a positive number of bytes or a size such as '5GB' or '500MiB' (got {size!r})"
        )
    return int(float(match[1]) * _UNITS[(match[2] or "").upper()])


def file_of_each(sizes: Mapping[str, int], max_shard_size: int) -> dict[str, int]:
    """Name -> 1-based file number, filling each file in state-dict order up to ``max_shard_size``
    (a tensor larger than that gets a file of its own), as ``save_pretrained`` does."""
    index: dict[str, int] = {}
    number, used = 1, 0
    for name, size in sizes.items():
        if used and used + size > max_shard_size:
            number, used = number + 1, 0
        index[name] = number
        used += size
    return index


_PIECE_BYTES = 128 * 2**20
"""Each rank writes its slices in groups of about this many bytes (of full tensors): torch's
safetensors writer holds a rank's whole share of one file in memory while it writes it."""


_WHOLE = (torch.Tensor, torch.nn.Parameter)


def _size_of(value: Any) -> int:
    if isinstance(value, FlatTensor):
        return value.nbytes
    return math.prod(value.size()) * value.element_size()


class FullExport:
    """A Hugging Face directory (weights, and the optimizer's full state) from sharded state
    dicts, without gathering them: no rank holds more than its shards, one piece of them and one
    full tensor.  Three steps, each followed by the caller's agreement on errors so that a
    failure on one rank never leaves another inside a collective:

    1. :meth:`write_pieces` (every rank, collective): each rank writes the slices it holds
       (``dcp.save`` with torch's ``HuggingFaceStorageWriter``) into ``.pieces/``; the files of
       :class:`~fsdp_bridge.backends.base.FlatTensor` values get their header (shared out);
    2. :meth:`assemble` (every rank, local): the output files are shared out among the ranks and
       each assembles its own one tensor at a time from the pieces (torch's
       ``_consolidate_safetensors_files``, the step its ``HuggingFaceStorageWriter`` runs on rank 0);
       each rank writes its :class:`~fsdp_bridge.backends.base.FlatTensor` pieces in place (a
       flat range of a tensor is one byte range of the file: no pieces, no assembly);
    3. :meth:`finish` (rank 0): the index (or ``model.safetensors`` alone), ``optimizer.json``,
       the pieces removed.

    Files: ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` of at most
    ``max_shard_size`` + ``model.safetensors.index.json``, as ``save_pretrained`` writes them;
    ``optimizer.safetensors`` + ``optimizer.json`` as :func:`write_optimizer` writes them.
    Optimizer tensors are named ``fqn/name``, which no parameter name contains.  Both ways give
    the same bytes: the header is written as torch's assembly writes it.
    """

    def __init__(
        self,
        directory: Path,
        model: Mapping[str, Any],
        optimizer: dict[str, Any] | None,
        *,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        layout: Mapping[str, str] | None = None,
    ) -> None:
        self.directory = directory
        self.optimizer = optimizer
        optim_tensors, self.optim_scalars = _split_optimizer_state(optimizer) if optimizer else ({}, {})
        every = {**model, **optim_tensors}
        self.flat = {k: v for k, v in every.items() if isinstance(v, FlatTensor)}
        self.tensors = {k: v for k, v in every.items() if k not in self.flat}
        # The files the weights were loaded from, when they name exactly these tensors and only
        # plain safetensors file names (an index is user input: nothing may point elsewhere).
        self.weight_sizes = {k: _size_of(v) for k, v in model.items()}
        self.file_name, self.indexed = plan_files(self.weight_sizes, max_shard_size, layout)
        self.file_name.update(dict.fromkeys(optim_tensors, OPTIM_TENSORS))
        self._write_whole_files_in_place()
        self.flat_files = sorted({self.file_name[k] for k in self.flat})
        mixed = set(self.flat_files) & {self.file_name[k] for k in self.tensors}
        if mixed:
            raise RuntimeError(f"internal: files {sorted(mixed)} would hold tensors written both ways")
        # 0-dim tensors (an optimizer's step, a scalar parameter) come out of torch's assembly as
        # zeros: its sub-tensor copy writes nothing for shape [] (checked on 2.13.0 and 2.14.1; reported and
        # fixed in a downstream copy, NVIDIA-NeMo/Automodel#301).  Rank 0 writes their bytes itself:
        # harmless where torch wrote them right.  tests/test_zero_dim_params.py exports one.
        self.scalars = {
            k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in self.tensors.items() if v.dim() == 0
        }

    def _write_whole_files_in_place(self) -> None:
        """Files holding only whole tensors (a model that is not sharded; plain tensors beside
        :class:`~fsdp_bridge.backends.base.FlatTensor` values) are written in place by rank 0:
        torch's writer would keep one rank's copy of each anyway, and its assembly cannot write
        integer or bool tensors (``torch.finfo`` of their dtype, torch 2.13 and 2.14.1;
        pytorch/pytorch#192485).  Those that still go through it are refused before anything is
        written."""
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        # Anything but a plain tensor (DTensor, ShardedTensor) holds part of the tensor only.
        sharded_files = {self.file_name[k] for k, v in self.tensors.items() if type(v) not in _WHOLE}
        for name in [k for k in self.tensors if self.file_name[k] not in sharded_files]:
            value = self.tensors.pop(name).detach()
            pieces = (FlatPiece(0, value.reshape(-1).contiguous()),) if rank == 0 and value.numel() else ()
            self.flat[name] = FlatTensor(tuple(value.shape), value.dtype, pieces)
        for name, value in self.tensors.items():
            if not (value.is_floating_point() or value.is_complex()):
                raise CheckpointError(
                    self.directory,
                    f"{name} has dtype {value.dtype} and shares {self.file_name[name]} with tensors "
                    "sharded in a layout that no rank writes in place, so torch's safetensors assembly "
                    "writes the file, and it writes floating point tensors only (pytorch/pytorch#192485); "
                    "save kind='sharded' (DCP stores any dtype), or shard the model with "
                    "fsdp_bridge.shard (FSDP1, or FSDP2 splitting dim 0) so every rank writes its own rows",
                )

    @property
    def _pieces(self) -> Path:
        return self.directory / ".pieces"

    def write_pieces(self, rank: int = 0, world: int = 1) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if self.tensors:  # the same on every rank: dcp.save is collective
            piece_of = file_of_each({k: _size_of(v) for k, v in self.tensors.items()}, _PIECE_BYTES)
            writer = HuggingFaceStorageWriter(str(self._pieces), fqn_to_index_mapping=piece_of, save_distributed=True)
            single = not dist.is_initialized()
            with without_process_group() if single else contextlib.nullcontext():
                dcp.save(self.tensors, storage_writer=writer, no_dist=single)
        for name in self.flat_files[rank::world]:
            _write_flat_header(self.directory / name, {k: self.flat[k] for k, f in self.file_name.items() if f == name})

    def assemble(self, rank: int, world: int) -> None:
        from torch.distributed.checkpoint._consolidate_hf_safetensors import _consolidate_safetensors_files

        outputs = sorted(set(self.file_name.values()) - set(self.flat_files))
        mine = set(outputs[rank::world])
        mapping = {k: name for k, name in self.file_name.items() if name in mine}
        if mapping:
            _consolidate_safetensors_files(
                input_dir=str(self._pieces), output_dir=str(self.directory), fqn_to_file_mapping=mapping, num_threads=1
            )
        for name in self.flat_files:
            _write_flat_pieces(self.directory / name, {k: self.flat[k] for k, f in self.file_name.items() if f == name})

    def finish(self) -> None:
        for name, value in self.scalars.items():
            _write_tensor_bytes(self.directory / self.file_name[name], name, value)
        if self._pieces.exists():  # none when every tensor was written in place
            shutil.rmtree(self._pieces)
        if self.indexed:
            write_index(self.directory, {k: self.file_name[k] for k in self.weight_sizes}, self.weight_sizes)
        if self.optimizer is not None:
            if not (self.directory / OPTIM_TENSORS).exists():  # an optimizer with no tensor state yet
                save_file({}, str(self.directory / OPTIM_TENSORS), metadata={"format": "pt"})
            write_optimizer_json(self.directory, self.optimizer, self.optim_scalars)


def _flat_layout(path: Path, tensors: Mapping[str, FlatTensor]) -> tuple[bytes, dict[str, int]]:
    """The header of a safetensors file of ``tensors`` (in order), byte for byte as torch's
    assembly writes it (no ``__metadata__``, no padding), and each tensor's data offset."""
    header: dict[str, Any] = {}
    starts: dict[str, int] = {}
    offset = 0
    for name, value in tensors.items():
        if value.dtype not in _DTYPE_NAMES:
            raise CheckpointError(
                path,
                f"{name} has dtype {value.dtype}, which safetensors cannot store; "
                f"supported: {', '.join(str(d) for d in _DTYPE_NAMES)}; cast it or save kind='sharded'",
            )
        header[name] = {
            "shape": list(value.shape),
            "dtype": _DTYPE_NAMES[value.dtype],
            "data_offsets": [offset, offset + value.nbytes],
        }
        starts[name] = offset
        offset += value.nbytes
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw, starts


def _write_flat_header(path: Path, tensors: Mapping[str, FlatTensor]) -> None:
    head, _ = _flat_layout(path, tensors)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + sum(v.nbytes for v in tensors.values()))


_WRITE_BYTES = 64 * 2**20
"""Pieces on an accelerator are copied to the host this many bytes at a time."""


def _write_flat_pieces(path: Path, tensors: Mapping[str, FlatTensor]) -> None:
    """Write this rank's pieces of ``tensors`` into their places in ``path`` (header written)."""
    head, starts = _flat_layout(path, tensors)
    fd = os.open(path, os.O_WRONLY)
    try:
        for name, value in tensors.items():
            itemsize = value.dtype.itemsize
            for piece in value.pieces:
                data = piece.data.detach().reshape(-1)
                step = max(1, _WRITE_BYTES // itemsize)
                for i in range(0, data.numel(), step):
                    chunk = data[i : i + step].to("cpu").contiguous().view(torch.uint8).numpy()
                    view = chunk.data  # a memoryview of the tensor's bytes (no copy)
                    at = len(head) + starts[name] + (piece.start + i) * itemsize
                    while view:
                        written = os.pwrite(fd, view, at)
                        view, at = view[written:], at + written
    finally:
        os.close(fd)


_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors_streamed(
    path: Path,
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    read: Callable[[list[str]], Mapping[str, torch.Tensor]],
    *,
    batch_bytes: int = 64 * 2**20,
) -> None:
    """A safetensors file of tensors ``specs`` (name -> shape, dtype), written a batch at a time:
    the header first (it only needs shapes and dtypes), then each batch of about ``batch_bytes``
    that ``read(names)`` returns, in order.  ``safetensors.torch.save_file`` needs every tensor of
    the file in memory at once."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, dtype) in specs.items():
        if dtype not in _DTYPE_NAMES:
            raise CheckpointError(path, f"{name} has dtype {dtype}, which this writer cannot store")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    sizes = {name: math.prod(shape) * dtype.itemsize for name, (shape, dtype) in specs.items()}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        batches: list[list[str]] = [[]]
        used = 0
        for name in specs:
            if batches[-1] and used + sizes[name] > batch_bytes:
                batches.append([])
                used = 0
            batches[-1].append(name)
            used += sizes[name]
        for batch in batches:
            tensors = read(batch) if batch else {}
            for name in batch:
                f.write(tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def plan_files(
    sizes: Mapping[str, int], max_shard_size: int | str, layout: Mapping[str, str] | None = None
) -> tuple[dict[str, str], bool]:
    """Each weight's file, and whether the directory needs an index: the files of ``layout`` (a
    source's weight map) when it fits, else ``save_pretrained``'s: ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_size`` filled in order."""
    if layout is not None and layout_fits(layout, sizes):
        return {k: layout[k] for k in sizes}, True
    file_of = file_of_each(sizes, parse_size(max_shard_size))
    files = max(file_of.values(), default=1)
    if files == 1:
        return dict.fromkeys(sizes, SINGLE), False
    return {k: f"model-{i:05d}-of-{files:05d}{_SUFFIX}" for k, i in file_of.items()}, True


def write_index(directory: Path, weight_map: Mapping[str, str], sizes: Mapping[str, int]) -> None:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it."""
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(weight_map)}
    (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def layout_fits(layout: Mapping[str, str], names: Iterable[str]) -> bool:
    """Whether a safetensors index (name -> file) names exactly ``names``, in plain safetensors
    file names only: an index is user input, and nothing written may point elsewhere."""

    def plain(name: str) -> bool:
        return name == Path(name).name and name.endswith(_SUFFIX) and not name.startswith(".") and name != OPTIM_TENSORS

    return set(layout) == set(names) and all(plain(n) for n in layout.values())


def _write_tensor_bytes(path: Path, name: str, value: torch.Tensor) -> None:
    """Overwrite the data of tensor ``name`` in safetensors file ``path`` (same shape and dtype)."""
    data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        start, end = json.loads(f.read(length))[name]["data_offsets"]
        if end - start != len(data):
            raise CheckpointError(path, f"{name} takes {end - start} bytes in the file, the tensor {len(data)}")
        f.seek(8 + length + start)
        f.write(data)


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


def read_weight_map(directory: Path) -> dict[str, str] | None:
    """Tensor name -> file name from a directory's safetensors index (None without one)."""
    index = directory / INDEX
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(index, f"is not a valid safetensors index ({err})") from err
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(index, "weight_map is not a mapping of tensor names to file names")
    return weight_map


def _weight_files(directory: Path) -> list[Path]:
    if directory.is_file():
        return [directory]
    weight_map = read_weight_map(directory)
    if weight_map is not None:
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
    """Tensors of a Hugging Face directory from its files, opened once (memory-mapped): ``get``
    reads a whole tensor, ``rows(name, start, stop)`` only ``tensor[start:stop]``; neither holds
    more than what it returns.  A context manager (closing the files)."""

    def __init__(self, directory: Path) -> None:
        self._stack = contextlib.ExitStack()
        self._handle: dict[str, Any] = {}
        self._file: dict[str, Path] = {}
        for f in _weight_files(directory):
            handle = self._stack.enter_context(safe_open(str(f), framework="pt"))
            for name in handle.keys():
                self._handle[name], self._file[name] = handle, f

    def __enter__(self) -> WeightReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handle[name].get_tensor(name)
        except Exception as err:
            raise CheckpointError(self._file[name], f"cannot read tensor {name} ({err}); truncated or corrupt") from err

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        piece = self._handle[name].get_slice(name)
        return piece[start:stop] if piece.get_shape() else piece[...]


def read_hf_slices(state_dict: dict[str, Any], directory: Path) -> None:
    """Fill ``state_dict`` (sharded values: DTensors, ShardedTensors, or plain tensors) from a
    Hugging Face directory, each rank reading only the slices of the safetensors files that its
    values hold (``dcp.load`` with torch's ``HuggingFaceStorageReader``); call on every rank.

    Values take the state dict's dtypes (bf16 files into an fp32 model are cast as they are
    copied).  Only the weight files of the directory (the index's, or ``model.safetensors``)
    are read; names must already be checked against the headers (:func:`read_hf_shapes`).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = _WeightFilesReader(directory, _weight_files(directory))
    try:
        single = not dist.is_initialized()
        with without_process_group() if single else contextlib.nullcontext():
            dcp.load(state_dict, storage_reader=reader, no_dist=single)
    except (Exception, CheckpointException) as err:
        failures = getattr(err, "failures", None)
        cause = "; ".join(f"rank {r}: {e}" for r, e in failures.items()) if isinstance(failures, dict) else err
        raise CheckpointError(directory, f"cannot be read ({cause}); a weight file is truncated or corrupt") from None


class _WeightFilesReader(HuggingFaceStorageReader):
    """torch's ``HuggingFaceStorageReader`` restricted to the directory's weight files: it would
    otherwise index every ``*.safetensors`` beside them (an optimizer or adapter file)."""

    def __init__(self, directory: Path, files: list[Path]) -> None:
        super().__init__(str(directory))
        self._allowed = {str(f.resolve()) for f in files}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = super().read_metadata(*args, **kwargs)
        storage = metadata.storage_data
        drop = {
            index for index, info in storage.items() if str(Path(info.relative_path).resolve()) not in self._allowed
        }
        kept = {index.fqn for index in storage if index not in drop}
        for index in drop:
            del storage[index]
        for name in [n for n in metadata.state_dict_metadata if n not in kept]:
            del metadata.state_dict_metadata[name]
        return metadata


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


def _split_optimizer_state(osd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``{"fqn/name": tensor}`` and the non-tensor per-parameter values of an optimizer state dict."""
    tensors: dict[str, Any] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, entries in osd.get("state", {}).items():
        for name, value in entries.items():
            if isinstance(value, (torch.Tensor, FlatTensor)):
                tensors[f"{fqn}/{name}"] = value
            else:
                scalars.setdefault(fqn, {})[name] = _jsonable(value, f"state.{fqn}.{name}")
    return tensors, scalars


def write_optimizer_json(directory: Path, osd: dict[str, Any], scalars: dict[str, dict[str, Any]]) -> None:
    groups = [{k: _jsonable(v, f"param_groups.{k}") for k, v in g.items()} for g in osd.get("param_groups", [])]
    (directory / OPTIM_JSON).write_text(json.dumps({"param_groups": groups, "scalars": scalars}, indent=2) + "\n")


def write_optimizer(directory: Path, osd: dict[str, Any]) -> None:
    """Write a full optimizer state dict ({"state": {fqn: {...}}, "param_groups": [...]})."""
    tensors, scalars = _split_optimizer_state(osd)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(tensors, str(directory / OPTIM_TENSORS), metadata={"format": "pt"})
    write_optimizer_json(directory, osd, scalars)


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
