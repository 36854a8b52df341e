"""What a checkpoint is on disk: kinds, the metadata file, detection and validation.

Every checkpoint fsdp_bridge writes is a directory holding ``fsdp_bridge.json``,
written last, which names the kind, where it was saved from and the size of every file.
Directories written by other tools are recognised too: a plain DCP directory (a
``.metadata`` file), a Hugging Face model directory, or one ``torch.save`` file.

DCP's own reader unpickles its ``.metadata`` file and non-tensor items; here the
metadata is built by a bounded interpreter of its pickle opcodes that only makes fresh DCP
metadata objects (:mod:`fsdp_bridge._dcp_metadata`), and non-tensor items are read
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import math
import os
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdp_bridge._dcp_metadata import SafeDCPReader, SafeLoadPlanner, load_dcp_metadata, safe_child
from fsdp_bridge._names import strip_wrapper_prefixes
from fsdp_bridge.errors import CheckpointError

__all__ = [
    "CHECKSUM",
    "META_FILE",
    "CheckpointError",
    "Detected",
    "Kind",
    "SafeDCPReader",
    "SafeLoadPlanner",
    "checksum_of",
    "checksum_of_stream",
    "checksums",
    "dcp_tensor_shapes",
    "detect",
    "failure_text",
    "load_dcp_metadata",
    "param_stats",
    "parse_meta",
    "read_dcp",
    "read_meta",
    "safe_child",
    "strip_wrapper_prefixes",
    "verify_manifest",
    "without_process_group",
]

CHECKSUM = "crc32c"
"""What new checkpoints record (``checksum_algorithm``): CRC-32C, with the CPU's CRC instruction
through google-crc32c (about 2x zlib's CRC-32 here). Checkpoints without the field have zlib's
CRC-32 and are verified with it."""
CHECKSUM_ALGORITHMS = ("crc32c", "crc32")


FORMAT = "fsdp_bridge.checkpoint"
FORMAT_VERSION = 2
"""What new descriptions are written as. 2: the description carries ``description_sha256``, the
SHA-256 of its own canonical JSON, and every integrity field is required. 1 (written by earlier
development versions, unreleased): read with ``files``, ``digests`` and ``checksums`` required (every version-1 writer
since checksums were added wrote them); its own bytes are not protected."""
READ_VERSIONS = (1, 2)
SELF_DIGEST = "description_sha256"
MAX_DESCRIPTION_BYTES = 64 << 20
"""Largest ``fsdp_bridge.json`` read (a description of 100,000 files is about 20 MiB)."""
META_FILE = "fsdp_bridge.json"
STATE_FILE = "train_state.json"
RNG_DIR = "rng"
DCP_DIR = "dcp"
OPTIM_TENSORS = "optimizer.safetensors"
OPTIM_JSON = "optimizer.json"
PARTIAL_SUFFIX = ".partial"


class Kind(str, enum.Enum):
    """What a path holds."""

    SHARDED = "sharded"
    """fsdp_bridge sharded checkpoint: a DCP directory plus training state."""
    FULL = "full"
    """fsdp_bridge full checkpoint: a Hugging Face model directory plus training state."""
    HF = "hf"
    """A Hugging Face model directory not written by fsdp_bridge (weights only)."""
    DCP = "dcp"
    """A DCP directory written by plain PyTorch code (e.g. FSDP1 ``SHARDED_STATE_DICT``)."""
    TORCH = "torch"
    """One ``torch.save`` file of a full state dict (e.g. FSDP1 ``FULL_STATE_DICT``)."""


@dataclass
class Detected:
    """The result of :func:`detect`."""

    kind: Kind
    path: Path
    meta: dict[str, Any] = field(default_factory=dict)
    """Contents of ``fsdp_bridge.json`` (empty for checkpoints from other tools)."""

    @property
    def dcp_dir(self) -> Path:
        return self.path / DCP_DIR if self.kind is Kind.SHARDED else self.path


def _is_hf_dir(path: Path) -> bool:
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()


def detect(path: str | os.PathLike[str]) -> Detected:
    """Find out what ``path`` holds, refusing incomplete or unknown layouts with a clear error.

    Args:
        path: a checkpoint directory or file.

    Returns:
        A :class:`Detected`: the kind, the path to read (the previous copy where an overwrite
        was interrupted) and the contents of ``fsdp_bridge.json`` (empty for other tools').

    Raises:
        CheckpointError: ``path`` does not exist, is an interrupted save, or holds no layout
            this package reads; the message names what is missing.
    """
    p = Path(path)
    if not p.exists():
        old = p.with_name("." + p.name + ".old")
        if (old / META_FILE).is_file():
            # A save over this path was interrupted between moving the previous checkpoint
            # aside and putting the new one in place: the previous one is complete.
            return Detected(Kind(read_meta(old)["kind"]), old, read_meta(old))
        partial = p.with_name("." + p.name + PARTIAL_SUFFIX)
        hint = f"; {partial} is left from an interrupted save and is not a checkpoint" if partial.exists() else ""
        raise CheckpointError(p, f"does not exist{hint}")
    if p.is_file():
        if p.suffix == ".safetensors":
            return Detected(Kind.HF, p)
        return Detected(Kind.TORCH, p)
    if p.name.endswith(PARTIAL_SUFFIX):
        raise CheckpointError(
            p,
            "is an incomplete checkpoint (a save was interrupted before it was published); "
            "load the previous checkpoint instead, or delete this directory",
        )
    meta_path = p / META_FILE
    if meta_path.is_file():
        meta = read_meta(p)
        return Detected(Kind(meta["kind"]), p, meta)
    if (p / DCP_DIR).is_dir():
        raise CheckpointError(p, f"{META_FILE} is missing: the save did not finish; this checkpoint is incomplete")
    if (p / ".metadata").is_file():
        return Detected(Kind.DCP, p)
    if _is_hf_dir(p):
        return Detected(Kind.HF, p)
    for name in ("pytorch_model.bin", "model.pt", "model.pth"):
        if (p / name).is_file():
            return Detected(Kind.TORCH, p / name)
    raise CheckpointError(
        p,
        f"not a checkpoint: no {META_FILE}, no DCP .metadata, no model.safetensors "
        "(or model.safetensors.index.json) and no pytorch_model.bin; "
        "pass a directory written by fsdp_bridge.save_checkpoint, a DCP directory, "
        "a Hugging Face model directory or a torch.save file",
    )


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < 2**63


def _is_str_map(value: Any, values: Callable[[Any], bool]) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and values(v) for k, v in value.items())


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


# Every field something reads, with what it must be; anything else in a description is refused
# here, before a reader can trip over it (the fuzz test in tests/test_checkpoint_description_fuzz.py).
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "version": (_is_int, "an integer >= 0"),
    SELF_DIGEST: (lambda v: isinstance(v, str) and len(v) == 64, "a SHA-256 hex digest"),
    "step": (_optional(_is_int), "an integer >= 0 or null"),
    "world_size": (lambda v: _is_int(v, 1), "an integer >= 1"),
    "files": (lambda v: _is_str_map(v, _is_int), "a mapping of file name to size in bytes"),
    "digests": (lambda v: _is_str_map(v, _is_str), "a mapping of file name to SHA-256 hex digest"),
    "checksums": (lambda v: _is_str_map(v, _is_int), "a mapping of file name to the checksum of its content"),
    "checksum_algorithm": (lambda v: v in CHECKSUM_ALGORITHMS, "crc32c or crc32"),
    "tied": (
        lambda v: isinstance(v, list) and all(isinstance(g, list) and all(map(_is_str, g)) for g in v),
        "a list of lists of parameter names",
    ),
    "params": (
        _optional(
            lambda v: (
                isinstance(v, dict)
                and _is_int(v.get("numel", 0))
                and _is_int(v.get("tensors", 0))
                and _is_str_map(v.get("dtypes", {}), _is_int)
            )
        ),
        "a mapping with numel, tensors (integers) and dtypes (name to count)",
    ),
    "has_optimizer": (lambda v: isinstance(v, bool), "true or false"),
    "hf_config": (_optional(lambda v: isinstance(v, bool)), "true, false or null"),
    "bridge_config": (_optional(lambda v: isinstance(v, dict)), "a mapping or null"),
    "converted_from": (
        _optional(lambda v: isinstance(v, dict) and _is_str(v.get("path")) and _is_str(v.get("kind"))),
        "a mapping with path and kind (strings) or null",
    ),
    **{
        key: (_optional(_is_str), "a string or null")
        for key in ("kind", "backend", "model_class", "torch_version", "fsdp_bridge_version", "saved_at", "format")
    },
}


# What each version's description must hold (the rest of _FIELDS may be absent).
_REQUIRED = {
    1: ("format", "version", "kind", "files", "digests", "checksums"),
    2: (
        "format",
        "version",
        "kind",
        "files",
        "digests",
        "checksums",
        "checksum_algorithm",
        "world_size",
        "has_optimizer",
        SELF_DIGEST,
    ),
}


def description_digest(meta: Mapping[str, Any]) -> str:
    """SHA-256 of a description's canonical JSON (sorted keys, no spaces), without its own digest."""
    body = {k: v for k, v in meta.items() if k != SELF_DIGEST}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def read_meta(path: Path) -> dict[str, Any]:
    """Read and check ``fsdp_bridge.json`` of a checkpoint directory.

    Refused (:class:`CheckpointError` naming the file): over :data:`MAX_DESCRIPTION_BYTES`
    (before reading), not JSON, not a description, a version this package does not read, its
    own SHA-256 differing (version 2), an unknown key, a field of the wrong type, a required
    field missing, or a listed file without a digest or checksum."""
    meta_path = path / META_FILE
    damaged = _DAMAGED
    try:
        with open(meta_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_DESCRIPTION_BYTES:
                raise CheckpointError(
                    meta_path,
                    f"is {size} bytes, over the {MAX_DESCRIPTION_BYTES}-byte limit for a checkpoint description; "
                    f"it is not one fsdp_bridge wrote: {damaged}",
                )
            raw = f.read(MAX_DESCRIPTION_BYTES + 1)
        if len(raw) > MAX_DESCRIPTION_BYTES:
            raise CheckpointError(meta_path, f"is over the {MAX_DESCRIPTION_BYTES}-byte limit; {damaged}")
    except OSError as err:
        raise CheckpointError(meta_path, f"cannot be read as JSON ({err}); the checkpoint is corrupt") from err
    return parse_meta(raw, meta_path)


_DAMAGED = "the description is damaged or was edited; use another checkpoint"


def parse_meta(raw: bytes, meta_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check the bytes of a ``fsdp_bridge.json`` (read from ``meta_path``, named in errors) as
    :func:`read_meta` does, for a description read from anywhere (an object store)."""
    damaged = _DAMAGED
    if len(raw) > MAX_DESCRIPTION_BYTES:
        raise CheckpointError(meta_path, f"is over the {MAX_DESCRIPTION_BYTES}-byte limit; {damaged}")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as err:
        raise CheckpointError(meta_path, f"cannot be read as JSON ({err}); the checkpoint is corrupt") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(meta_path, f"is not an fsdp_bridge checkpoint description (format != {FORMAT!r})")
    version: Any = meta.get("version")
    if _is_int(version) and version > FORMAT_VERSION:
        raise CheckpointError(
            meta_path,
            f"format version {version} is newer than this fsdp_bridge reads ({FORMAT_VERSION}); upgrade fsdp_bridge",
        )
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise CheckpointError(
            meta_path, [f"field version: {version!r:.40}, expected one of {list(READ_VERSIONS)}", damaged]
        )
    try:
        own = description_digest(meta) if version >= 2 else None
    except (ValueError, RecursionError) as err:  # nested deeper than the encoder goes
        raise CheckpointError(meta_path, f"cannot be checked ({type(err).__name__}); {damaged}") from None
    if version >= 2 and meta.get(SELF_DIGEST) != own:
        raise CheckpointError(
            meta_path,
            f"content differs from what was saved (its {SELF_DIGEST} does not match: flipped, zeroed or "
            f"edited bytes); {damaged}",
        )
    unknown = sorted(k for k in meta if k not in _FIELDS or (k == SELF_DIGEST and version < 2))
    wrong = [f"unknown field {k!r:.60} (known: {', '.join(sorted(_FIELDS))})" for k in unknown[:5]]
    wrong += [
        f"field {key}: {type(meta[key]).__name__} ({meta[key]!r:.40}), expected {what}"
        for key, (check, what) in _FIELDS.items()
        if key in meta and not check(meta[key])
    ]
    missing = [key for key in _REQUIRED[version] if key not in meta]
    wrong += [f"field {key} is missing (required in version {version})" for key in missing]
    if not wrong:
        files, covered = meta["files"], {**meta["digests"], **meta["checksums"]}
        bare = [rel for rel in sorted(files) if rel not in covered]
        stray = [rel for rel in sorted(covered) if rel not in files]
        wrong += [f"{rel!r:.80} is listed without a digest or checksum" for rel in bare[:5]]
        wrong += [f"{rel!r:.80} has a digest or checksum but is not listed" for rel in stray[:5]]
        if meta.get("kind") == Kind.SHARDED.value and f"{DCP_DIR}/.metadata" not in files:
            wrong.append(f"a sharded checkpoint's description does not list {DCP_DIR}/.metadata")
    if wrong:
        raise CheckpointError(meta_path, [*wrong, damaged])
    if meta.get("kind") not in (Kind.SHARDED.value, Kind.FULL.value):
        raise CheckpointError(meta_path, f"kind {meta.get('kind')!r} is not one of sharded, full")
    return meta


def verify_manifest(detected: Detected, *, part: tuple[int, int] = (0, 1), contents: bool = True) -> None:
    """Every file listed in ``fsdp_bridge.json`` exists with the recorded size, the small
    description files (DCP ``.metadata``, JSON, index) have the recorded SHA-256, and the tensor
    files the recorded CRC-32C (CRC-32 for checkpoints saved before it; flipped, zeroed or
    overwritten bytes). For a sharded checkpoint, DCP's ``.metadata`` is parsed and every file it
    names, and every file in ``dcp/``, must be listed with a digest or checksum.

    ``part=(i, n)``: read the contents of every n-th file from the i-th only (each rank of a load
    checks its share; sizes and existence are checked for all). ``contents=False``: no file's
    content is read but DCP's ``.metadata`` (the cheap check :func:`latest_checkpoint` makes)."""
    files = detected.meta.get("files", {})
    recorded = detected.meta.get("digests", {})
    checksums = detected.meta.get("checksums", {})
    algorithm = detected.meta.get("checksum_algorithm", "crc32")  # written before the field: zlib's CRC-32
    index, count = part
    problems = []
    for i, (rel, size) in enumerate(sorted(files.items())):
        f = safe_child(detected.path, rel)
        mine = contents and i % count == index
        try:
            if not f.is_file():
                problems.append(f"{rel}: missing")
            elif f.stat().st_size != size:
                problems.append(f"{rel}: size {f.stat().st_size} bytes, expected {size} (truncated or overwritten)")
            elif mine and rel in recorded and _sha256(f) != recorded[rel]:
                problems.append(
                    f"{rel}: content differs from the file this checkpoint was saved with "
                    "(copied from another run or checkpoint?)"
                )
            elif mine and rel in checksums and checksum_of(f, algorithm) != checksums[rel]:
                problems.append(
                    f"{rel}: content is damaged ({algorithm.upper()} differs from the one recorded at save: "
                    "flipped, zeroed or overwritten bytes); use another checkpoint"
                )
        except OSError as err:  # a name too long for the file system, a directory where a file was
            problems.append(f"{rel!r:.80}: cannot be read ({err.strerror or err})")
    if detected.kind is Kind.SHARDED and f"{DCP_DIR}/.metadata" in files:
        problems += _unlisted_dcp_files(detected, files, {**recorded, **checksums})
    if problems:
        raise CheckpointError(detected.path, problems)


def _unlisted_dcp_files(detected: Detected, files: Mapping[str, int], covered: Mapping[str, Any]) -> list[str]:
    """Every file in ``dcp/`` and every file DCP's metadata names is listed with a digest or
    checksum: none is read unchecked (the metadata is parsed here, so damage to it is seen too)."""
    dcp_dir = detected.path / DCP_DIR
    problems = []
    named = {f"{DCP_DIR}/{f.name}" for f in dcp_dir.iterdir()} if dcp_dir.is_dir() else set()
    try:
        metadata = load_dcp_metadata(dcp_dir / ".metadata")
    except CheckpointError as err:
        return [str(err)]
    named |= {f"{DCP_DIR}/{info.relative_path}" for info in (metadata.storage_data or {}).values()}
    for rel in sorted(named):
        if rel not in files or rel not in covered:
            problems.append(
                f"{rel}: not listed in {META_FILE} with a checksum (added after the save, or the description "
                "was edited); it would be read unchecked: use another checkpoint"
            )
    return problems[:5]


DIGEST_MAX_BYTES = 1 << 20
"""Files up to this size get a SHA-256 in the description, larger ones (tensor data) a CRC-32C."""
_DIGEST_MAX_BYTES = DIGEST_MAX_BYTES


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def checksum_of(path: Path, algorithm: str = CHECKSUM, chunk: int = 1 << 20) -> int:
    """The ``algorithm`` checksum (``crc32c`` or ``crc32``) of a file's content, read in chunks."""
    with open(path, "rb") as f:
        return checksum_of_stream(f, algorithm, chunk)


def checksum_of_stream(f: BinaryIO, algorithm: str = CHECKSUM, chunk: int = 1 << 20) -> int:
    """The ``algorithm`` checksum of what is left to read in ``f``, read in chunks."""
    if algorithm == "crc32c":
        import google_crc32c

        crc32c = google_crc32c.Checksum()
        while block := f.read(chunk):
            crc32c.update(block)
        return int.from_bytes(crc32c.digest(), "big")
    crc = 0
    while block := f.read(chunk):
        crc = zlib.crc32(block, crc)
    return crc


def checksums(root: Path, files: Iterable[Path] | None = None) -> dict[str, int]:
    """CRC-32C of the tensor files (those above the SHA-256 size limit) under ``root``, or of ``files``."""
    chosen = sorted(root.rglob("*")) if files is None else sorted(files)
    return {
        str(f.relative_to(root)): checksum_of(f) for f in chosen if f.is_file() and f.stat().st_size > _DIGEST_MAX_BYTES
    }


def digests(root: Path) -> dict[str, str]:
    """SHA-256 of every small file under ``root`` (descriptions, not tensor data: cheap to hash,
    and what a file from another run of the same model would differ in, e.g. DCP's save id)."""
    return {
        str(f.relative_to(root)): _sha256(f)
        for f in sorted(root.rglob("*"))
        if f.is_file() and f.stat().st_size <= _DIGEST_MAX_BYTES
    }


def manifest(root: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``root``."""
    return {str(f.relative_to(root)): f.stat().st_size for f in sorted(root.rglob("*")) if f.is_file()}


# --------------------------------------------------------------------------------------
# DCP without unpickling arbitrary objects
# --------------------------------------------------------------------------------------

# DCP's ``.metadata`` is never unpickled: fsdp_bridge._dcp_metadata builds it with a bounded
# interpreter of the pickle opcodes that can only make fresh DCP metadata objects (the reader
# and the planner live there, below the backends, which read users' DCP directories too).


@contextlib.contextmanager
def without_process_group() -> Iterator[None]:
    """Around a DCP call made without a process group on purpose: DCP warns that it assumes
    one process, which is what was asked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def read_dcp(state_dict: dict[str, Any], dcp_dir: Path | str, *, no_dist: bool = False, reader: Any = None) -> None:
    """``dcp.load`` into ``state_dict`` through the safe reader (``reader``, default
    :class:`SafeDCPReader` of ``dcp_dir``) and planner.

    Whatever the read raises (a zeroed or damaged shard makes ``torch.load`` fail inside DCP,
    which reports it as ``CheckpointException``, a ``BaseException``) becomes one
    :class:`CheckpointError`; DCP already shares a failure on one rank with every rank.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with without_process_group() if no_dist else contextlib.nullcontext():
            dcp.load(
                state_dict,
                storage_reader=reader if reader is not None else SafeDCPReader(str(dcp_dir)),
                planner=SafeLoadPlanner(),
                no_dist=no_dist,
            )
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:
        raise CheckpointError(
            dcp_dir, f"cannot be read ({failure_text(err)}); a shard is damaged or overwritten: use another checkpoint"
        ) from None


def failure_text(err: BaseException) -> str:
    """One line naming what failed: for DCP's CheckpointException, each rank's own exception
    (its str() is a formatted traceback)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, pair in sorted(failures.items()):
            exc = pair[0] if isinstance(pair, tuple) else pair
            text = " ".join(str(exc).split())
            if "weights_only" in text or "Unsupported operand" in text:
                text = "torch.load refused the stored bytes: they are not a tensor or value torch wrote"
            parts.append(f"rank {rank}: {type(exc).__name__}: {text[:200]}")
        return "; ".join(parts)
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def dcp_tensor_shapes(dcp_dir: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Flattened key -> (global shape, dtype) of every tensor in a DCP directory."""
    metadata = load_dcp_metadata(dcp_dir / ".metadata")
    return {
        key: (tuple(item.size), item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def compare_keys(
    path: Path | str,
    found: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    *,
    what: str = "model",
    allow_missing: Iterable[str] = (),
) -> None:
    """Raise :class:`CheckpointError` listing missing and unexpected keys and shape mismatches."""
    allowed = set(allow_missing)
    missing = sorted(k for k in expected if k not in found and k not in allowed)
    unexpected = sorted(k for k in found if k not in expected)
    shapes = sorted(
        f"{k}: checkpoint has shape {list(found[k])}, the {what} has {list(expected[k])}"
        for k in expected
        if k in found and tuple(found[k]) != tuple(expected[k])
    )
    problems = []
    if missing:
        problems.append(f"missing {what} keys ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected {what} keys ({len(unexpected)}): {', '.join(unexpected)}")
    problems.extend(f"shape mismatch {s}" for s in shapes)
    if problems:
        raise CheckpointError(path, problems)


def param_stats(shapes: Mapping[str, tuple[tuple[int, ...], str]], tied: Iterable[Iterable[str]]) -> dict[str, Any]:
    """The description's ``params``: element count (tied aliases once), elements per dtype, tensors."""
    aliases = {n for group in tied for n in list(group)[1:]}
    count = 0
    dtypes: dict[str, int] = {}
    for key, (shape, dtype) in shapes.items():
        if key in aliases:
            continue
        n = math.prod(shape)
        count += n
        dtypes[dtype] = dtypes.get(dtype, 0) + n
    return {"numel": count, "dtypes": dtypes, "tensors": len(shapes)}
