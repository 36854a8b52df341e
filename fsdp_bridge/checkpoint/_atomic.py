"""Crash-safe publication of checkpoint directories, rotation, and finding the latest.

A save writes into ``.NAME.partial`` beside the destination.  Only when every rank has
finished does rank 0 write ``fsdp_bridge.json`` (with the size of every file), flush it
to disk and rename the directory to ``NAME``.  A crash or kill at any moment therefore
leaves either the previous checkpoint or the new one, never a half-written ``NAME``.

Rank 0 holds an exclusive lock on ``.NAME.lock`` (``flock``) from creating the staging
directory until the checkpoint is published, so a second job saving the same path at the same
time is refused instead of writing into the same staging directory.  The operating system
releases the lock when its process dies: a killed save never leaves the path locked.  The lock
file is opened without following symlinks and only reused when it is a lock file of ours.

Nothing is deleted or replaced unless it is provably ours: every staging directory gets the
owner file ``.fsdp_bridge.owner`` before anything else (it stays in the published directory),
and a directory beside ``NAME`` (``.NAME.partial``, ``.NAME.old``, ``.NAME.deleting``) or at
``NAME`` itself is only removed when it holds that file or a valid ``fsdp_bridge.json`` (or is
empty).  Removal deletes those proofs last, so an interrupted removal never leaves a directory
that is no longer provably ours.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import shutil
import socket
import stat
from pathlib import Path
from typing import Any

from fsdp_bridge.checkpoint._formats import META_FILE, PARTIAL_SUFFIX, CheckpointError, read_meta

logger = logging.getLogger("fsdp_bridge.checkpoint")

__all__ = [
    "OWNER_FILE",
    "OWNER_TEXT",
    "SaveLock",
    "check_replaceable",
    "clean_leftovers",
    "is_ours",
    "latest_checkpoint",
    "list_checkpoints",
    "make_staging",
    "partial_path",
    "publish",
    "remove_ours",
    "rotate_checkpoints",
    "series_prefix",
]

OWNER_FILE = ".fsdp_bridge.owner"
"""Written first into every staging directory (and kept in what is published): the proof that a
directory was created by a save of this package, so that a later save may replace or delete it."""
OWNER_TEXT = b"fsdp_bridge: created by a save; fsdp_bridge may replace or delete this directory\n"
_LEFTOVER_SUFFIXES = (PARTIAL_SUFFIX, ".old", ".deleting")
_LOCK_TEXT = re.compile(rb"pid \d+ on .* since \S+")


def partial_path(path: Path) -> Path:
    """The staging directory a save of ``path`` writes into."""
    return path.with_name("." + path.name + PARTIAL_SUFFIX)


def make_staging(staging: Path) -> None:
    """Create the staging directory ``staging`` (absent or removed before) with the owner file in it."""
    staging.mkdir(parents=True)
    fd = os.open(staging / OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        os.write(fd, OWNER_TEXT)
    finally:
        os.close(fd)


def _is_empty_dir(path: Path) -> bool:
    return not path.is_symlink() and path.is_dir() and next(path.iterdir(), None) is None


def is_ours(path: Path) -> bool:
    """Whether ``path`` is a directory this package provably wrote: it holds the owner file, or a
    ``fsdp_bridge.json`` that reads as a valid description (checkpoints saved before the owner
    file existed). A symlink is never ours."""
    if path.is_symlink() or not path.is_dir():
        return False
    owner = path / OWNER_FILE
    if not owner.is_symlink() and owner.is_file():
        try:
            with open(owner, "rb") as f:
                if f.read(len(OWNER_TEXT) + 1) == OWNER_TEXT:
                    return True
        except OSError:
            pass
    meta = path / META_FILE
    if meta.is_symlink() or not meta.is_file():
        return False
    try:
        read_meta(path)
    except CheckpointError:
        return False
    return True


def _not_ours(path: Path, role: str) -> CheckpointError:
    try:
        held = sorted(p.name for p in path.iterdir())[:5] if path.is_dir() and not path.is_symlink() else []
    except OSError:
        held = []
    what = (
        "a symlink"
        if path.is_symlink()
        else f"a directory holding {', '.join(held)}{', ...' if len(held) == 5 else ''}"
        if held
        else "not a directory"
        if path.exists()
        else "unreadable"
    )
    return CheckpointError(
        path,
        f"is {role}, but it is {what}, with no complete {OWNER_FILE} and no valid {META_FILE}, so it may be "
        "your files and is not replaced or deleted: move it away (or remove it yourself), or save to another path",
    )


def remove_ours(path: Path, role: str = "in the way of a save") -> None:
    """Delete the directory ``path`` if it is ours (:func:`is_ours`) or empty; refuse otherwise.

    The owner file and the description are deleted last: an interruption leaves either a
    directory that is still provably ours, or an empty one.

    Raises:
        CheckpointError: ``path`` exists and is not provably ours (nothing is deleted).
    """
    if not path.exists() and not path.is_symlink():
        return
    if not (is_ours(path) or _is_empty_dir(path)):
        raise _not_ours(path, role)
    proofs = (META_FILE, OWNER_FILE)
    for child in path.iterdir():
        if child.name in proofs:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    for name in proofs:
        (path / name).unlink(missing_ok=True)
    path.rmdir()


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
            fd = _open_lock_file(self.file)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown process"
                unlinked = not _same_file(fd, self.file)
                os.close(fd)
                if unlinked:  # its holder (or a clean-up) removed it meanwhile: open the new one
                    continue
                raise CheckpointError(
                    self.path,
                    f"is being saved by another process ({holder}); two saves of one "
                    "path would mix their files: wait for that save, or save this "
                    "one to another path",
                ) from None
            if _same_file(fd, self.file):  # not a lock file its last holder unlinked while we were opening it
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


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino)


def _refuse_lock(file: Path, why: str) -> CheckpointError:
    return CheckpointError(
        file,
        f"{why}; the save lock is never followed or written through: remove {file.name} yourself "
        "(it is not a file of this package), then save again",
    )


def _open_lock_file(file: Path) -> int:
    """Open (or create) the lock file without following a symlink at its name, and only when it
    is a lock file of ours: a regular file with one link, empty or naming its last holder."""
    try:
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        if file.is_symlink():
            raise _refuse_lock(file, f"is a symlink (to {os.readlink(file)!r})") from None
        raise CheckpointError(file, f"cannot be opened as a lock file ({err.strerror})") from None
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_nlink != 1:
        problem = f"is a file with {st.st_nlink} hard links"
    elif st.st_size > 4096:
        problem = f"is a file of {st.st_size} bytes"
    else:
        content = os.pread(fd, 4096, 0).strip()
        if content and not _LOCK_TEXT.fullmatch(content):
            problem = "holds something other than a lock's 'pid ... on ... since ...' line"
    if problem is not None:
        os.close(fd)
        raise _refuse_lock(file, problem)
    return fd


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


def check_replaceable(path: Path, *, staging: bool = True) -> None:
    """Refuse to save to ``path`` unless it is absent, empty or provably ours (:func:`is_ours`),
    and the names a save uses beside it (``.NAME.partial``, ``.NAME.old``, ``.NAME.deleting``)
    are absent or provably ours too.

    ``staging=False`` leaves ``.NAME.partial`` out: for a check on every rank while rank 0 may
    already be emptying and refilling it (rank 0 checks it under the save lock before that).

    Publishing moves an existing destination aside and deletes it: that must never be a
    directory of the user's files (or a file) that happens to have the name given, such as the
    base model's own directory given as the destination of an adapter export.

    Raises:
        CheckpointError: naming the path in the way, what it holds and the fix.
    """
    if path.exists() or path.is_symlink():
        if path.is_symlink() or not path.is_dir():
            raise CheckpointError(
                path,
                "exists and is not a checkpoint directory; refusing to replace it "
                "(choose a new path, or remove it yourself)",
            )
        if not (is_ours(path) or _is_empty_dir(path)):
            contents = sorted(p.name for p in path.iterdir())[:5]
            raise CheckpointError(
                path,
                f"exists and is not an fsdp_bridge checkpoint or export (no valid {META_FILE} and no "
                f"{OWNER_FILE}; it holds {', '.join(contents)}{', ...' if len(contents) == 5 else ''}); "
                "refusing to replace it, since saving there would delete these files: choose a new "
                "path, or remove it yourself",
            )
    for suffix in _LEFTOVER_SUFFIXES if staging else _LEFTOVER_SUFFIXES[1:]:
        beside = path.with_name("." + path.name + suffix)
        if (beside.exists() or beside.is_symlink()) and not (is_ours(beside) or _is_empty_dir(beside)):
            raise _not_ours(beside, f"where a save of {path.name} keeps its {suffix[1:]} copy")


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
    Only what is provably ours (:func:`is_ours`) is moved aside or deleted.

    Raises:
        CheckpointError: ``path`` or ``.NAME.old`` is in the way and not provably ours.
    """
    for f in staging.rglob("*"):
        if f.is_file() and not f.is_symlink():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(staging)
    old = path.with_name("." + path.name + ".old")
    present = path.exists() or path.is_symlink()
    if present and not (is_ours(path) or _is_empty_dir(path)):
        raise _not_ours(path, "the destination of this save")
    if old.exists() or old.is_symlink():
        if present:
            remove_ours(old, "the previous copy of a checkpoint being replaced")
        elif is_ours(old):  # an earlier publish died after moving the previous checkpoint aside
            os.replace(old, path)
            present = True
        else:
            raise _not_ours(old, "where the previous copy of a checkpoint is moved aside")
    if present:
        os.replace(path, old)
    os.replace(staging, path)
    _fsync_dir(path.parent)
    try:
        remove_ours(old, "the previous copy of a checkpoint being replaced")
    except OSError as err:  # the new checkpoint is in place: a leftover copy is cleaned by a later save
        logger.warning("could not delete %s: %s", old, err)


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


def series_prefix(name: str) -> str | None:
    """The series a checkpoint name belongs to: what precedes its trailing step number
    (``"step_"`` for ``step_00000100``), or None when the name does not end in digits."""
    match = re.fullmatch(r"(.*?)\d+", name)
    return match.group(1) if match else None


def _lock_is_leftover(file: Path) -> bool:
    """A ``.NAME.lock`` of ours that no live process holds (its holder was killed), taken and
    removed under its own lock; anything else is left alone."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size > 4096:
            return False
        content = os.pread(fd, 4096, 0).strip()
        if content and not _LOCK_TEXT.fullmatch(content):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held: a save of that path is running
        if _same_file(fd, file):
            file.unlink()  # under the lock: an opener waiting on this inode sees it replaced
            return True
        return False
    finally:
        os.close(fd)


def clean_leftovers(root: str | os.PathLike[str]) -> list[Path]:
    """Delete what killed saves left directly under ``root`` and no live save uses: ``.NAME.deleting``
    directories that are provably ours (or empty), and ``.NAME.lock`` files of ours held by no
    process. Anything else (a user's files at those names) is left alone. Returns what was deleted."""
    r = Path(root)
    if not r.is_dir():
        return []
    removed: list[Path] = []
    for child in sorted(r.iterdir()):
        if not child.name.startswith("."):
            continue
        if child.name.endswith(".deleting") and not child.is_symlink() and (is_ours(child) or _is_empty_dir(child)):
            try:
                remove_ours(child)
                removed.append(child)
            except (OSError, CheckpointError) as err:
                logger.warning("could not delete %s: %s", child, err)
        elif child.name.endswith(".lock") and _lock_is_leftover(child):
            removed.append(child)
    return removed


def rotate_checkpoints(root: str | os.PathLike[str], keep: int, *, prefix: str = "step_") -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints of one series under ``root``; return
    what was deleted.

    Call it on one rank (``save_checkpoint(..., keep_last=K)`` does, on rank 0, for the series of
    the path saved).  Only checkpoints named ``<prefix><digits>`` (``step_00000100``) holding a
    valid ``fsdp_bridge.json`` are counted and deleted: ``last/``, ``best/`` or any other name
    beside them is never touched.  Leftovers of killed saves (:func:`clean_leftovers`) go too.

    Args:
        root: the directory holding checkpoint directories.
        keep: how many of the newest to keep (at least 1).
        prefix: the series: what precedes the step number in the names (default ``"step_"``).

    Returns:
        The paths deleted.

    Raises:
        ValueError: ``keep`` is not an integer >= 1.
    """
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"keep must be an integer >= 1 (got {keep!r}); use keep=1 to keep only the newest")
    series = re.compile(re.escape(prefix) + r"\d+")
    ckpts = [(step, p) for step, p in list_checkpoints(root) if series.fullmatch(p.name)]
    doomed = [p for _, p in ckpts[:-keep]]
    deleted: list[Path] = []
    for p in doomed:
        # Rename first: a crash mid-delete then leaves a dot-directory, never a broken checkpoint.
        trash = p.with_name("." + p.name + ".deleting")
        try:
            remove_ours(trash)
            os.replace(p, trash)
            remove_ours(trash)
        except (OSError, CheckpointError) as err:  # the new checkpoint is saved: report, go on
            logger.warning("did not delete old checkpoint %s: %s", p, err)
            continue
        deleted.append(p)
    clean_leftovers(root)
    return deleted
