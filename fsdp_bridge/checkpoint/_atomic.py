"""Crash-safe publication of checkpoint directories, rotation, and finding the latest.

A save writes into ``.NAME.partial`` beside the destination.  Only when every rank has
finished does rank 0 write ``fsdp_bridge.json`` (with the size of every file), flush it
to disk and rename the directory to ``NAME``.  A crash or kill at any moment therefore
leaves either the previous checkpoint or the new one, never a half-written ``NAME``.

Rank 0 holds an exclusive lock on ``.NAME.lock`` (``flock``) from creating the staging
directory until the checkpoint is published, so a second job saving the same path at the same
time is refused instead of writing into the same staging directory.  The operating system
releases the lock when its process dies: a killed save never leaves the path locked.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Any

from fsdp_bridge.checkpoint._formats import META_FILE, PARTIAL_SUFFIX, CheckpointError, read_meta

logger = logging.getLogger("fsdp_bridge.checkpoint")

__all__ = ["SaveLock", "latest_checkpoint", "list_checkpoints", "partial_path", "publish", "rotate_checkpoints"]


def partial_path(path: Path) -> Path:
    """The staging directory a save of ``path`` writes into."""
    return path.with_name("." + path.name + PARTIAL_SUFFIX)


class SaveLock:
    """An exclusive claim on saving ``path`` (one process: rank 0), released by :meth:`release`
    (or at the end of a ``with SaveLock(path):`` block) or by the operating system when the
    process dies."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = path.with_name("." + path.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> SaveLock:
        """Take the lock, or raise :class:`CheckpointError` naming the process that holds it."""
        try:
            import fcntl
        except ImportError:  # no flock on this platform: saves are not protected against each other
            return self
        self.file.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown process"
                os.close(fd)
                raise CheckpointError(
                    self.path,
                    f"is being saved by another process ({holder}); two saves of one "
                    "path would mix their files: wait for that save, or save this "
                    "one to another path",
                ) from None
            try:
                ours = os.fstat(fd).st_ino == os.stat(self.file).st_ino
            except FileNotFoundError:
                ours = False
            if ours:  # not a lock file its last holder unlinked while we were opening it
                os.ftruncate(fd, 0)
                now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
                os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {now}".encode())
                self._fd = fd
                return self
            os.close(fd)
        raise CheckpointError(
            self.path,
            f"could not lock {self.file.name}: it was replaced repeatedly; is another job saving this path in a loop?",
        )

    def __enter__(self) -> SaveLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Remove the lock file and release the lock (idempotent)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            self.file.unlink(missing_ok=True)  # under the lock: a waiting opener sees the inode change
        finally:
            os.close(fd)  # closing releases the flock


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # not every filesystem supports fsync on directories
        pass
    finally:
        os.close(fd)


def write_json_durably(path: Path, obj: Any) -> None:
    """Write JSON to ``path`` through a temporary file, fsync'd, then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_replaceable(path: Path) -> None:
    """Refuse to replace ``path`` unless it is absent or an fsdp_bridge checkpoint.

    Publishing moves an existing destination aside and deletes it: that must never be a
    directory of the user's files (or a file) that happens to have the name given.
    """
    from fsdp_bridge.checkpoint._formats import META_FILE, CheckpointError, read_meta

    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not path.is_dir():
        raise CheckpointError(
            path,
            "exists and is not a checkpoint directory; refusing to replace it "
            "(choose a new path, or remove it yourself)",
        )
    if not (path / META_FILE).is_file():
        contents = sorted(p.name for p in path.iterdir())[:5]
        if not contents:
            return  # an empty directory holds nothing to lose
        raise CheckpointError(
            path,
            f"exists and is not an fsdp_bridge checkpoint (no {META_FILE}; it holds "
            f"{', '.join(contents)}{', ...' if len(contents) == 5 else ''}); refusing to "
            "replace it: choose a new path, or remove it yourself",
        )
    read_meta(path)  # a damaged description is refused too: it is not provably ours


def check_not_nested(src: Path, dst: Path) -> None:
    """``dst`` must be neither ``src``, nor inside it, nor a directory containing it."""
    from fsdp_bridge.checkpoint._formats import CheckpointError

    def resolve(path: Path) -> Path:
        try:
            return path.resolve()
        except (OSError, RuntimeError) as err:  # a symlink loop (RuntimeError before Python 3.13)
            raise CheckpointError(path, f"cannot be resolved ({err}); pass a path that is not a symlink loop") from None

    s, d = resolve(src), resolve(dst)
    if d == s or d.is_relative_to(s) or s.is_relative_to(d):
        where = (
            "the source" if d == s else "inside the source" if d.is_relative_to(s) else "a directory holding the source"
        )
        raise CheckpointError(dst, f"is {where} {src}; replacing it would destroy the source: choose a path outside it")


def publish(staging: Path, path: Path) -> None:
    """Move the finished ``staging`` directory to ``path`` (rank 0 only, after a barrier).

    An existing ``path`` is first renamed aside and deleted only once the new one is in
    place, so an interruption leaves a complete checkpoint at ``path`` or at ``.NAME.old``.
    """
    for f in staging.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(staging)
    old = path.with_name("." + path.name + ".old")
    if old.exists() and path.exists():
        shutil.rmtree(old)
    elif old.exists():  # an earlier publish died after moving the previous checkpoint aside
        os.replace(old, path)
    if path.exists():
        os.replace(path, old)
    os.replace(staging, path)
    _fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete fsdp_bridge checkpoints directly under ``root`` as ``(step, path)``, oldest first.

    Directories without ``fsdp_bridge.json`` (interrupted saves, other files) are skipped.
    Checkpoints without a step sort first, by modification time.

    Args:
        root: the directory the checkpoints were saved under (``output_dir/checkpoints``).

    Returns:
        ``(step, path)`` pairs, oldest first (step -1 where none was recorded); empty when
        ``root`` is not a directory.
    """
    r = Path(root)
    if not r.is_dir():
        return []
    found: list[tuple[int, float, Path]] = []
    names = {c.name for c in r.iterdir()}
    for child in r.iterdir():
        if child.name.startswith("."):
            # ``.NAME.old`` is the only complete copy when a kill struck between the two renames
            # of an overwrite (NAME itself is then missing): it counts as NAME.
            stem = child.name[1:].removesuffix(".old")
            if not (child.name.endswith(".old") and stem not in names and (child / META_FILE).is_file()):
                continue
        elif not (child / META_FILE).is_file():
            continue
        try:
            meta = read_meta(child)
        except CheckpointError as err:
            logger.warning("skipping %s: %s", child, err)  # one damaged sibling must not hide the others
            continue
        step = meta.get("step")
        found.append((step if isinstance(step, int) else -1, (child / META_FILE).stat().st_mtime, child))
    found.sort(key=lambda t: (t[0], t[1], t[2].name))
    return [(step, p) for step, _, p in found]


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint under ``root`` with the highest step (``None`` if there is none).

    Args:
        root: the directory holding checkpoint directories (e.g. a run's ``output_dir``).

    Returns:
        The path of the newest complete checkpoint, or None. A ``.NAME.old`` left by a kill
        during an overwrite counts. A checkpoint whose description is damaged, a listed file
        missing or of another size, or whose DCP metadata does not parse is skipped with a
        warning naming why, and the next older one is returned (file contents are not read here:
        the load verifies them).
    """
    from fsdp_bridge.checkpoint._formats import detect, verify_manifest

    for _, path in reversed(list_checkpoints(root)):
        try:
            # Cheap checks only: the description, every listed file present with its size, DCP's
            # metadata parsed; contents are verified by the load itself.
            verify_manifest(detect(path), contents=False)
        except CheckpointError as err:
            logger.warning("skipping %s, falling back to an older checkpoint: %s", path, err)
            continue
        return path
    return None


def rotate_checkpoints(root: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints under ``root``; return what was deleted.

    Call it on one rank (``save_checkpoint(..., keep_last=K)`` does, on rank 0).  Only
    directories holding ``fsdp_bridge.json`` are ever deleted.

    Args:
        root: the directory holding checkpoint directories.
        keep: how many of the newest to keep (at least 1).

    Returns:
        The paths deleted.

    Raises:
        ValueError: ``keep`` is not an integer >= 1.
    """
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"keep must be an integer >= 1 (got {keep!r}); use keep=1 to keep only the newest")
    ckpts = list_checkpoints(root)
    doomed = [p for _, p in ckpts[:-keep]]
    for p in doomed:
        # Rename first: a crash mid-delete then leaves a dot-directory, never a broken checkpoint.
        trash = p.with_name("." + p.name + ".deleting")
        os.replace(p, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed
