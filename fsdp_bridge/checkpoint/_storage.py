"""Checkpoint locations given as fsspec URLs (``s3://bucket/run``, ``gs://``, ``az://``,
``memory://``, ``file://``): the few operations the checkpoint code needs on an object store.

A location is a URL when it is a ``str`` holding ``"://"`` (:func:`is_url`); anything else is a
local path and goes through the local code (renames, ``flock``) unchanged. :class:`Remote` is one
key prefix or object in an fsspec file system; :class:`SafeFsspecReader` is DCP's fsspec reader
with ``.metadata`` parsed by :mod:`fsdp_bridge._dcp_metadata` (never unpickled), every file it names
inside the checkpoint's prefix.
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from fsdp_bridge._dcp_metadata import LIMITS, parse_dcp_metadata
from fsdp_bridge.errors import CheckpointError

__all__ = ["Remote", "SafeFsspecReader", "dcp_writer", "is_url"]


def is_url(path: object) -> bool:
    """Whether ``path`` names an fsspec location (a string with ``"://"``, ``file://`` included)."""
    return isinstance(path, str) and "://" in path


_EXTRAS = "pip install 'fsdp_bridge[s3]' for s3:// (s3fs), gcsfs for gs://, adlfs for az://"


class Remote:
    """One object or key prefix (a "directory") in an fsspec file system."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs = fs
        self.path = path.rstrip("/") or "/"

    @classmethod
    def of(cls, url: str) -> Remote:
        """The location of ``url``; raises :class:`CheckpointError` when fsspec cannot open it."""
        from fsspec.core import url_to_fs

        try:
            fs, path = url_to_fs(url)
        except ImportError as err:
            raise CheckpointError(
                url, f"needs a file system package that is not installed ({err}); {_EXTRAS}"
            ) from None
        except ValueError as err:
            raise CheckpointError(
                url, f"is not a URL fsspec knows ({err}); give s3://, gs://, az://, file:// ..."
            ) from None
        return cls(fs, path)

    @property
    def url(self) -> str:
        return str(self.fs.unstrip_protocol(self.path))

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Remote({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Remote) and other.fs is self.fs and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    def __truediv__(self, relative: str) -> Remote:
        return Remote(self.fs, f"{self.path}/{relative}")

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> Remote:
        return Remote(self.fs, self.path.rsplit("/", 1)[0] or "/")

    def with_name(self, name: str) -> Remote:
        return self.parent / name

    def _fresh(self) -> None:
        # Another rank or process may have written since this process listed: never answer from
        # fsspec's listing cache.
        self.fs.invalidate_cache()

    def is_file(self) -> bool:
        self._fresh()
        try:
            return bool(self.fs.isfile(self.path))
        except (OSError, ValueError):
            return False

    def files(self) -> dict[str, int]:
        """Every object under this prefix: name relative to it -> size in bytes (empty if none)."""
        self._fresh()
        try:
            found = self.fs.find(self.path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        prefix = self.path.rstrip("/") + "/"
        out = {}
        for full, info in found.items():
            full = full.rstrip("/")
            if full.startswith(prefix) and info.get("type", "file") == "file":
                out[full[len(prefix) :]] = int(info.get("size") or 0)
        return out

    def children(self) -> list[str]:
        """The names directly under this prefix (objects and sub-prefixes), sorted."""
        self._fresh()
        try:
            listed = self.fs.ls(self.path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        prefix = self.path.rstrip("/") + "/"
        return sorted({p.rstrip("/")[len(prefix) :] for p in listed if p.rstrip("/").startswith(prefix)} - {""})

    def size(self) -> int:
        self._fresh()
        return int(self.fs.size(self.path))

    def read_bytes(self, limit: int | None = None) -> bytes:
        """The object's bytes (at most ``limit + 1`` of them when a limit is given)."""
        with self.fs.open(self.path, "rb") as f:
            return bytes(f.read() if limit is None else f.read(limit + 1))

    def open(self, mode: str = "rb") -> Any:
        if "w" in mode or "x" in mode:
            self._parents()
        return self.fs.open(self.path, mode)

    def write_bytes(self, data: bytes, *, exclusive: bool = False) -> None:
        """Write the object; ``exclusive``: only if none exists (a conditional put where the
        store has one; raises ``FileExistsError`` otherwise)."""
        self._parents()
        if exclusive:
            self.fs.pipe_file(self.path, data, mode="create")
        else:
            self.fs.pipe_file(self.path, data)

    def _parents(self) -> None:
        from fsspec.implementations.local import LocalFileSystem

        if isinstance(self.fs, LocalFileSystem):  # object stores have no directories to make
            self.fs.makedirs(self.parent.path, exist_ok=True)

    def put_file(self, local: os.PathLike[str] | str) -> None:
        """Upload the local file ``local`` to this object."""
        self._parents()
        self.fs.put_file(os.fspath(local), self.path)

    def get_file(self, local: os.PathLike[str] | str) -> None:
        """Download this object to the local file ``local``."""
        self.fs.get_file(self.path, os.fspath(local))

    def copy_to(self, other: Remote) -> None:
        """Copy this object to ``other`` (on the store itself where it can: S3's CopyObject)."""
        other._parents()
        self.fs.copy(self.path, other.path)

    def remove(self) -> None:
        """Delete this object (absent already is fine)."""
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            pass

    def remove_empty_prefix(self) -> None:
        """Delete what is left of this prefix when it holds no object (local directories,
        memory:// pseudo-directories); a prefix with any object in it is left alone."""
        if self.files():
            return
        try:
            if self.fs.exists(self.path):
                self.fs.rm(self.path, recursive=True)
        except (FileNotFoundError, OSError):
            pass
        self._fresh()


def dcp_writer(directory: Remote) -> FsspecWriter:
    """DCP's fsspec writer for ``directory``: one file per rank, written straight to the store."""
    return FsspecWriter(directory.url)


class SafeFsspecReader(FsspecReader):
    """DCP's fsspec reader whose ``.metadata`` is parsed without unpickling, every file it names
    being a plain name inside the checkpoint's prefix."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        return load_remote_dcp_metadata(Remote.of(os.fspath(self.path)) / ".metadata")


def load_remote_dcp_metadata(where: Remote) -> dcp_metadata.Metadata:
    """DCP ``Metadata`` of a ``.metadata`` object (bounded, never unpickled; every file it names
    in the same prefix)."""
    try:
        size = where.size()
    except FileNotFoundError:
        raise CheckpointError(where.url, "missing: the DCP directory is incomplete") from None
    except OSError as err:
        raise CheckpointError(where.url, f"cannot be read ({err})") from None
    if size > LIMITS.max_bytes:
        raise CheckpointError(where.url, f"is {size} bytes, over the {LIMITS.max_bytes}-byte limit for DCP metadata")
    metadata = parse_dcp_metadata(where.read_bytes(LIMITS.max_bytes), where.url)  # type: ignore[arg-type]
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if (
            not isinstance(relative, str)
            or not relative
            or "/" in relative
            or "\\" in relative
            or relative in (".", "..")
        ):
            raise CheckpointError(where.url, f"names a file outside its directory ({relative!r:.80}); refusing it")
    return metadata
