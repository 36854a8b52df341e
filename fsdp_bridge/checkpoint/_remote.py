"""Checkpoints at fsspec URLs (``s3://``, ``gs://``, ``az://``, ``memory://``, ``file://``): saving,
publishing without rename, listing, rotation and the checks of a load.

An object store has no rename and no ``flock``, so a save to ``URL/NAME`` runs differently from a
save to a directory (docs/checkpoints.md states what holds):

* rank 0 claims the staging prefix ``URL/.NAME.partial/`` by writing the owner object
  ``.fsdp_bridge.owner`` first (a conditional put where the store has one, when the prefix is
  empty), then ``.fsdp_bridge.claim`` naming this save, which is read again before publishing:
  a second save of the same path that started meanwhile is refused there. One writer per path
  at a time is otherwise the user's responsibility (there is no lock a killed process would
  release);
* every rank writes its DCP files through DCP's fsspec writer and its RNG file into the staging
  prefix; each rank reads back its own DCP files for their CRC-32C;
* rank 0 writes the training state, describes every object (size, SHA-256 or CRC-32C) and
  publishes: ``NAME/`` is removed if it is ours (its description first), the staged objects are
  copied to ``NAME/`` (the owner object first) and the description ``fsdp_bridge.json`` is
  written LAST: it is the commit marker. A ``NAME/`` without a valid description is not a
  checkpoint to :func:`latest_checkpoint` or ``load_checkpoint``, so a reader sees no checkpoint
  or a complete one. The staging prefix is deleted after.

Nothing is deleted unless it carries the owner object (or a valid description, as on disk): a
user's objects at ``NAME/`` are refused, never replaced. Rotation deletes only checkpoints that
carry the owner object, the description first, the owner object last.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import uuid
from pathlib import Path
from typing import Any, overload

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from fsdp_bridge._optim_state import init_step_undone
from fsdp_bridge.backends import model_class_name
from fsdp_bridge.checkpoint import _atomic, _hf
from fsdp_bridge.checkpoint._atomic import OWNER_FILE, OWNER_TEXT, series_prefix
from fsdp_bridge.checkpoint._description import Description
from fsdp_bridge.checkpoint._formats import (
    DCP_DIR,
    DIGEST_MAX_BYTES,
    MAX_DESCRIPTION_BYTES,
    META_FILE,
    PARTIAL_SUFFIX,
    STATE_FILE,
    CheckpointError,
    checksum_of_stream,
    param_stats,
    parse_meta,
    read_meta,
    safe_child,
)
from fsdp_bridge.checkpoint._model_state import bridge_of, shapes_of, tied_groups, without_4bit
from fsdp_bridge.checkpoint._publish import check_save_name, gather_checksums
from fsdp_bridge.checkpoint._ranks import agree_on, on_every_rank, rank_world
from fsdp_bridge.checkpoint._state import parse_rng, parse_state, rng_name, rng_text, state_text
from fsdp_bridge.checkpoint._storage import Remote, dcp_writer, is_url, load_remote_dcp_metadata

logger = logging.getLogger("fsdp_bridge.checkpoint")

__all__ = [
    "claim_staging",
    "download",
    "latest_checkpoint",
    "list_checkpoints",
    "new_claim",
    "read_remote_meta",
    "read_remote_side_files",
    "rotate_checkpoints",
    "save_sharded_to_url",
    "upload_and_publish",
    "verify_remote",
]


# --------------------------------------------------------------------------------------
# what is ours, reading descriptions
# --------------------------------------------------------------------------------------


def _meta_or_none(where: Remote) -> dict[str, Any] | None:
    """The checked description of ``where``; None when it has none (raises when it is damaged)."""
    meta = where / META_FILE
    try:
        size = meta.size()
    except FileNotFoundError:
        return None
    if size > MAX_DESCRIPTION_BYTES:
        raise CheckpointError(meta.url, f"is {size} bytes, over the {MAX_DESCRIPTION_BYTES}-byte limit")
    return parse_meta(meta.read_bytes(MAX_DESCRIPTION_BYTES), meta.url)


def read_remote_meta(where: Remote) -> dict[str, Any]:
    """The description of the checkpoint at ``where``, checked like a local one."""
    meta = _meta_or_none(where)
    if meta is None:
        partial = where.with_name("." + where.name + PARTIAL_SUFFIX)
        hint = f"; {partial.url} holds an unfinished save" if partial.files() else ""
        raise CheckpointError(
            where.url,
            f"is not a checkpoint: it has no {META_FILE} (the description a save writes last to commit it){hint}; "
            "give a checkpoint saved by fsdp_bridge, or the latest_checkpoint() of its directory",
        )
    return meta


def _is_ours(where: Remote) -> bool:
    """The prefix carries our owner object, or a valid description."""
    try:
        if (where / OWNER_FILE).read_bytes(len(OWNER_TEXT)).startswith(OWNER_TEXT):
            return True
    except (FileNotFoundError, OSError):
        pass
    try:
        return _meta_or_none(where) is not None
    except CheckpointError:
        return False


def _not_ours(where: Remote, role: str, files: dict[str, int]) -> CheckpointError:
    held = sorted(files)[:5]
    return CheckpointError(
        where.url,
        f"is {role}, but it holds {', '.join(held)}{', ...' if len(files) > 5 else ''} with no complete {OWNER_FILE} "
        f"and no valid {META_FILE}, so it may be your objects and is not replaced or deleted: move them away "
        "(or delete them yourself), or save to another URL",
    )


def _remove(where: Remote, role: str) -> None:
    """Delete every object under ``where`` if it is ours; the description first (it stops being
    a checkpoint at once), the owner object last (an interruption leaves a prefix still ours)."""
    files = where.files()
    if not files:
        where.remove_empty_prefix()
        return
    if not _is_ours(where):
        raise _not_ours(where, role, files)
    order = [META_FILE, *sorted(f for f in files if f not in (META_FILE, OWNER_FILE)), OWNER_FILE]
    for rel in order:
        if rel in files:
            (where / rel).remove()
    where.remove_empty_prefix()


# --------------------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------------------


def save_sharded_to_url(
    url: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    state: dict[str, Any] | None,
    keep_last: int | None,
) -> str:
    """``save_checkpoint(url, kind="sharded")``: see the module's docstring; returns ``url``."""
    dest = Remote.of(url)
    check_save_name(url, dest.name, keep_last, state)
    staging = dest.with_name("." + dest.name + PARTIAL_SUFFIX)
    rank, world = rank_world()
    claim = new_claim()

    def prepare() -> None:
        if rank == 0:
            claim_staging(dest, claim)

    on_every_rank(url, "claiming the staging prefix", prepare)
    msd = without_4bit(model, get_model_state_dict(model))
    to_save: dict[str, Any] = {"model": msd}
    if optimizer is not None:
        with init_step_undone(optimizer, reading=True):
            to_save["optim"] = get_optimizer_state_dict(model, optimizer)

    def write_sharded() -> dict[str, int]:
        dcp.save(to_save, storage_writer=dcp_writer(staging / DCP_DIR))
        (staging / rng_name(rank)).write_bytes(rng_text().encode())
        mine = re.compile(rf"{DCP_DIR}/__{rank}_\d+\.distcp")
        return _checksums(staging, {rel: n for rel, n in staging.files().items() if mine.fullmatch(rel)})

    known = gather_checksums(on_every_rank(url, "writing the sharded state (DCP) and RNG", write_sharded))
    error = None
    if rank == 0:
        try:
            _describe_and_publish(
                staging,
                dest,
                model,
                state=state,
                world=world,
                shapes=shapes_of(msd),
                known=known,
                claim=claim,
                has_optimizer=optimizer is not None,
            )
            if keep_last is not None:
                rotate_checkpoints(dest.parent.url, keep_last, prefix=series_prefix(dest.name) or "")
        except Exception as err:  # tell the other ranks instead of leaving them in a collective
            error = f"{type(err).__name__}: {err}"
            agree_on(error)
            raise
    error = agree_on(error)
    if error is not None:
        raise CheckpointError(url, f"rank 0 failed to publish the checkpoint: {error}")
    return url


CLAIM_FILE = ".fsdp_bridge.claim"
"""In a staging prefix only (never published): the id of the save that claimed it."""


def new_claim() -> bytes:
    """The id of one save, written to the staging prefix it claims and read back before publishing."""
    return f"save {uuid.uuid4().hex}\n".encode()


def claim_staging(dest: Remote, claim: bytes) -> Remote:
    """Rank 0, before anything is written: refuse objects at ``dest`` that are not ours, delete a
    killed save's staging prefix of ours, and claim ``.NAME.partial/`` with the owner object
    (a conditional put: refused when another save created it first). Returns the staging prefix."""
    staging = dest.with_name("." + dest.name + PARTIAL_SUFFIX)
    present = dest.files()
    if present and not _is_ours(dest):
        raise _not_ours(dest, "the destination of this save", present)
    _remove(staging, f"where a save of {dest.name} keeps its partial copy")  # a killed save's leftovers
    try:
        (staging / OWNER_FILE).write_bytes(OWNER_TEXT, exclusive=True)
        (staging / CLAIM_FILE).write_bytes(claim)
    except FileExistsError:
        raise CheckpointError(
            dest.url,
            f"is being saved by another process (it created {staging.url} just now); two saves of one "
            "path would mix their objects: wait for that save, or save this one to another URL",
        ) from None
    return staging


def upload_and_publish(local: Path, dest: Remote, claim: bytes) -> None:
    """Rank 0: the complete local checkpoint ``local`` (checked by its description) uploaded to
    ``dest``'s claimed staging prefix, then published as a save to the URL is."""
    meta = read_meta(local)
    staging = dest.with_name("." + dest.name + PARTIAL_SUFFIX)
    for rel in sorted(meta["files"]):
        if rel != OWNER_FILE:
            (staging / rel).put_file(safe_child(local, rel))
    publish(staging, dest, meta, claim=claim)


def download(where: Remote, into: Path) -> Path:
    """A local copy of the committed checkpoint at ``where`` under ``into`` (its description read
    first; only the objects it lists are fetched, then the description): the local code then
    checks and reads it as any directory. Returns the copy."""
    try:
        raw = (where / META_FILE).read_bytes(MAX_DESCRIPTION_BYTES)
    except FileNotFoundError:
        read_remote_meta(where)  # raises, saying what is there instead
        raise
    meta = parse_meta(raw, (where / META_FILE).url)
    local = into / where.name
    local.mkdir(parents=True)
    for rel in sorted(meta["files"]):
        if rel.startswith("/") or ".." in rel.split("/") or "\\" in rel:
            raise CheckpointError(where.url, f"its description names an object outside it ({rel!r:.80}); refusing it")
        target = local / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            (where / rel).get_file(target)
        except FileNotFoundError:
            raise CheckpointError(where.url, f"{rel}: missing (listed in {META_FILE})") from None
    (local / META_FILE).write_bytes(raw)
    return local


def _checksums(root: Remote, files: dict[str, int]) -> dict[str, int]:
    """CRC-32C of the objects of ``files`` (relative name -> size) above the SHA-256 size limit."""
    out = {}
    for rel, size in files.items():
        if size > DIGEST_MAX_BYTES:
            with (root / rel).open("rb") as f:
                out[rel] = checksum_of_stream(f)
    return out


def _describe_and_publish(
    staging: Remote,
    dest: Remote,
    model: nn.Module,
    *,
    state: dict[str, Any] | None,
    world: int,
    shapes: dict[str, tuple[tuple[int, ...], str]],
    known: dict[str, int],
    claim: bytes,
    has_optimizer: bool,
) -> None:
    (staging / STATE_FILE).write_bytes(state_text(state).encode())
    with tempfile.TemporaryDirectory(prefix="fsdp_bridge_config_") as tmp:
        has_config = _hf.write_hf_config(Path(tmp), model)
        for f in sorted(Path(tmp).iterdir()):
            (staging / f.name).write_bytes(f.read_bytes())
    files = {rel: n for rel, n in staging.files().items() if rel not in (META_FILE, CLAIM_FILE)}
    digests = {
        rel: hashlib.sha256((staging / rel).read_bytes()).hexdigest()
        for rel, n in files.items()
        if n <= DIGEST_MAX_BYTES
    }
    checksums = {**_checksums(staging, {r: n for r, n in files.items() if r not in known}), **known}
    bridge = bridge_of(model)
    tied = tied_groups(model)
    meta = Description(
        kind="sharded",
        backend=bridge.config.backend.value if bridge is not None else None,
        world_size=world,
        step=(state or {}).get("step"),
        bridge_config=bridge.config.to_dict() if bridge is not None else None,
        model_class=model_class_name(model),
        hf_config=has_config,
        has_optimizer=has_optimizer,
        tied=tied,
        params=param_stats(shapes, tied),
    ).build(files=files, digests=digests, checksums=checksums)
    publish(staging, dest, meta, claim=claim)


def publish(staging: Remote, dest: Remote, meta: dict[str, Any], *, claim: bytes) -> None:
    """Copy the staged objects to ``dest`` and commit them with the description, written last."""
    try:
        owner = (staging / CLAIM_FILE).read_bytes(len(claim))
    except FileNotFoundError:
        owner = b""
    if owner != claim:
        raise CheckpointError(
            dest.url,
            f"another save of this path took over {staging.url} while this one was writing; two saves of one "
            "path at a time mix their objects: this one is not published. Save each path from one job at a time",
        )
    present = dest.files()
    if present:
        _remove(dest, "the destination of this save")  # its description first: no torn checkpoint is ever seen
    files = [OWNER_FILE, *sorted(rel for rel in meta["files"] if rel != OWNER_FILE)]
    for rel in files:
        (staging / rel).copy_to(dest / rel)
    text = json.dumps(meta, indent=2, sort_keys=True) + "\n"
    (dest / META_FILE).write_bytes(text.encode())  # the commit
    try:
        _remove(staging, "the staging prefix of this save")
    except (OSError, CheckpointError) as err:  # published: a leftover is removed by the next save
        logger.warning("could not delete %s: %s", staging.url, err)


# --------------------------------------------------------------------------------------
# listing, latest, rotation
# --------------------------------------------------------------------------------------


def _list_url(root: str) -> list[tuple[int, Remote]]:
    where = Remote.of(root)
    found: list[tuple[int, str, Remote]] = []
    for name in where.children():
        if name.startswith("."):
            continue
        try:
            meta = _meta_or_none(where / name)
        except CheckpointError as err:
            logger.warning("skipping %s: %s", (where / name).url, err)
            continue
        if meta is None:
            continue
        step = meta.get("step")
        found.append((step if isinstance(step, int) else -1, name, where / name))
    found.sort(key=lambda t: (t[0], t[1]))
    return [(step, p) for step, _, p in found]


@overload
def list_checkpoints(root: Path) -> list[tuple[int, Path]]: ...
@overload
def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path | str]]: ...
def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]] | list[tuple[int, Path | str]]:
    """Complete fsdp_bridge checkpoints directly under ``root`` as ``(step, path)``, oldest first.

    Directories without ``fsdp_bridge.json`` (interrupted saves, other files) are skipped.
    Checkpoints without a step sort first, by modification time (at a URL: by name).

    Args:
        root: the directory the checkpoints were saved under (``output_dir/checkpoints``), or
            an fsspec URL (``s3://bucket/run/checkpoints``).

    Returns:
        ``(step, path)`` pairs, oldest first (step -1 where none was recorded); empty when
        ``root`` is not a directory. At a URL each path is the checkpoint's URL (a ``str``).
    """
    if is_url(root):
        urls: list[tuple[int, Path | str]] = [(step, p.url) for step, p in _list_url(str(root))]
        return urls
    return _atomic.list_checkpoints(root)


@overload
def latest_checkpoint(root: Path) -> Path | None: ...
@overload
def latest_checkpoint(root: str | os.PathLike[str]) -> Path | str | None: ...
def latest_checkpoint(root: str | os.PathLike[str]) -> Path | str | None:
    """The complete checkpoint under ``root`` with the highest step (``None`` if there is none).

    Args:
        root: the directory holding checkpoint directories (e.g. a run's ``output_dir``), or an
            fsspec URL.

    Returns:
        The path of the newest complete checkpoint, or None (at a URL: its URL, a ``str``). A
        ``.NAME.old`` left by a kill during an overwrite counts. A checkpoint whose description
        is damaged, a listed file missing or of another size, or whose DCP metadata does not
        parse is skipped with a warning naming why, and the next older one is returned (file
        contents are not read here: the load verifies them).
    """
    if not is_url(root):
        return _atomic.latest_checkpoint(root)
    for _, where in reversed(_list_url(str(root))):
        try:
            verify_remote(where, read_remote_meta(where), contents=False)
        except CheckpointError as err:
            logger.warning("skipping %s, falling back to an older checkpoint: %s", where.url, err)
            continue
        return where.url
    return None


def rotate_checkpoints(root: str | os.PathLike[str], keep: int, *, prefix: str = "step_") -> list[Path | str]:
    """Delete all but the ``keep`` newest complete checkpoints of one series under ``root``; return
    what was deleted.

    Call it on one rank (``save_checkpoint(..., keep_last=K)`` does, on rank 0, for the series of
    the path saved).  Only checkpoints named ``<prefix><digits>`` (``step_00000100``) holding a
    valid ``fsdp_bridge.json`` are counted and deleted: ``last/``, ``best/`` or any other name
    beside them is never touched.  Leftovers of killed saves go too (local directories).  At a
    URL only checkpoints that carry the owner object ``.fsdp_bridge.owner`` are deleted.

    Args:
        root: the directory holding checkpoint directories, or an fsspec URL.
        keep: how many of the newest to keep (at least 1).
        prefix: the series: what precedes the step number in the names (default ``"step_"``).

    Returns:
        The paths deleted (at a URL: their URLs).

    Raises:
        ValueError: ``keep`` is not an integer >= 1.
    """
    if not is_url(root):
        return list(_atomic.rotate_checkpoints(root, keep, prefix=prefix))
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"keep must be an integer >= 1 (got {keep!r}); use keep=1 to keep only the newest")
    series = re.compile(re.escape(prefix) + r"\d+")
    ckpts = [p for _, p in _list_url(str(root)) if series.fullmatch(p.name)]
    deleted: list[Path | str] = []
    for where in ckpts[:-keep]:
        try:
            if not (where / OWNER_FILE).read_bytes(len(OWNER_TEXT)).startswith(OWNER_TEXT):
                raise CheckpointError(where.url, f"its {OWNER_FILE} is not ours")
            _remove(where, "an old checkpoint being rotated out")
        except (OSError, CheckpointError) as err:  # the new checkpoint is saved: report, go on
            logger.warning("did not delete old checkpoint %s: %s", where.url, err)
            continue
        deleted.append(where.url)
    return deleted


# --------------------------------------------------------------------------------------
# the checks of a load
# --------------------------------------------------------------------------------------


def verify_remote(
    where: Remote, meta: dict[str, Any], *, part: tuple[int, int] = (0, 1), contents: bool = True
) -> None:
    """:func:`~fsdp_bridge.checkpoint._formats.verify_manifest` for a checkpoint at a URL: every
    listed object present with its size, this rank's share of the contents with their SHA-256 or
    CRC, DCP's metadata parsed, and nothing in ``dcp/`` or named by it unlisted."""
    files = meta.get("files", {})
    recorded = meta.get("digests", {})
    checksums = meta.get("checksums", {})
    algorithm = meta.get("checksum_algorithm", "crc32")
    present = where.files()
    index, count = part
    problems = []
    for i, (rel, size) in enumerate(sorted(files.items())):
        mine = contents and i % count == index
        if rel.startswith("/") or ".." in rel.split("/") or "\\" in rel:
            problems.append(f"{rel!r:.80}: names an object outside the checkpoint; refusing it")
        elif rel not in present:
            problems.append(f"{rel}: missing")
        elif present[rel] != size:
            problems.append(f"{rel}: size {present[rel]} bytes, expected {size} (truncated or overwritten)")
        elif mine and rel in recorded and hashlib.sha256((where / rel).read_bytes()).hexdigest() != recorded[rel]:
            problems.append(
                f"{rel}: content differs from the file this checkpoint was saved with "
                "(copied from another run or checkpoint?)"
            )
        elif mine and rel in checksums:
            with (where / rel).open("rb") as f:
                if checksum_of_stream(f, algorithm) != checksums[rel]:
                    problems.append(
                        f"{rel}: content is damaged ({algorithm.upper()} differs from the one recorded at save: "
                        "flipped, zeroed or overwritten bytes); use another checkpoint"
                    )
    if meta.get("kind") == "sharded" and f"{DCP_DIR}/.metadata" in files and not problems:
        covered = {**recorded, **checksums}
        named = {rel for rel in present if rel.startswith(f"{DCP_DIR}/")}
        try:
            metadata = load_remote_dcp_metadata(where / DCP_DIR / ".metadata")
            named |= {f"{DCP_DIR}/{info.relative_path}" for info in (metadata.storage_data or {}).values()}
        except CheckpointError as err:
            problems.append(str(err))
        for rel in sorted(named):
            if rel not in files or rel not in covered:
                problems.append(
                    f"{rel}: not listed in {META_FILE} with a checksum (added after the save, or the description "
                    "was edited); it would be read unchecked: use another checkpoint"
                )
    if problems:
        raise CheckpointError(where.url, problems[:20])


def read_remote_side_files(where: Remote, rank: int, *, rng: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The training state and (``rng``) this rank's RNG states of a checkpoint at a URL."""
    state_obj = where / STATE_FILE
    try:
        state = parse_state(state_obj.read_bytes(MAX_DESCRIPTION_BYTES).decode("utf-8"), state_obj.url)
    except FileNotFoundError:
        state = {}
    except (OSError, ValueError) as err:
        raise CheckpointError(state_obj.url, f"cannot be read ({err}); the training state is corrupt") from None
    states = None
    if rng:
        rng_obj = where / rng_name(rank)
        try:
            states = parse_rng(rng_obj.read_bytes(MAX_DESCRIPTION_BYTES).decode("utf-8"), rng_obj.url)
        except FileNotFoundError:
            states = None
        except (OSError, ValueError) as err:
            raise CheckpointError(rng_obj.url, f"cannot be read ({err}); the RNG state is corrupt") from None
    return state, states
