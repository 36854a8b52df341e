"""Where a run's files go: ``output_dir`` itself, or, when it is an fsspec URL
(``s3://bucket/run``), a local working copy that rank 0 copies to the URL.

At a URL, checkpoints go straight to ``URL/checkpoints`` (``save_checkpoint`` publishes them
there); ``train_config.yaml``, ``metrics.jsonl`` (after every checkpoint and at the end),
``summary.json``, ``stopped.json``, the built-in tokenizer and the exported model are written to
the local copy first and uploaded by rank 0. A resumed run fetches ``metrics.jsonl`` and the
tokenizer from the URL first. The local copy is ``$TMPDIR/fsdp_bridge-runs/<hash of the URL>``,
emptied when a run starts (what a run resumes from comes from the URL), and the same on every
rank of a node (the built-in tokenizer is read there by every rank, so a run at a URL with the
built-in tokenizer keeps its ranks on one node).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["RunDir", "local_dir"]


def _is_url(path: str) -> bool:
    return "://" in path


def local_dir(output_dir: str) -> Path:
    """Where this node writes the run's files: ``output_dir``, or the local copy of a URL."""
    if not _is_url(output_dir):
        return Path(output_dir)
    digest = hashlib.sha256(output_dir.rstrip("/").encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "fsdp_bridge-runs" / digest


class RunDir:
    """The run's directory (``local``), its checkpoints' root and, for a URL, the uploads."""

    def __init__(self, output_dir: str) -> None:
        self.url = output_dir.rstrip("/") if _is_url(output_dir) else None
        self.local = local_dir(output_dir)
        self.checkpoints: Path | str = f"{self.url}/checkpoints" if self.url else self.local / "checkpoints"

    def _fs(self) -> tuple[Any, str]:
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(str(self.url))
        return fs, str(path)

    def reset(self) -> None:
        """Rank 0, at the start of a run at a URL: empty the local copy (left by an earlier run of
        the same URL on this node), so that the URL is the only source of what a run resumes from."""
        if self.url is not None and self.local.is_dir() and not self.local.is_symlink():
            shutil.rmtree(self.local)

    def pull(self, *names: str) -> None:
        """Fetch these files or directories from the URL into the local copy (a resumed run's
        metrics and tokenizer); nothing for a local run or what the URL does not hold."""
        if self.url is None:
            return
        fs, root = self._fs()
        fs.invalidate_cache()
        for name in names:
            remote = f"{root}/{name}"
            if fs.isfile(remote):
                (self.local / name).parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(remote, os.fspath(self.local / name))
            elif fs.isdir(remote):
                for obj in fs.find(remote):
                    target = self.local / name / obj[len(remote) + 1 :]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    fs.get_file(obj, os.fspath(target))

    def push(self, *names: str) -> None:
        """Upload these files or directories of the local copy to the URL (rank 0); nothing for a
        local run. ``push()`` with no name uploads everything in the local copy."""
        if self.url is None:
            return
        fs, root = self._fs()
        chosen = [self.local / n for n in names] if names else sorted(self.local.iterdir())
        for path in chosen:
            files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
            for f in files:
                fs.put_file(os.fspath(f), f"{root}/{f.relative_to(self.local).as_posix()}")

    def discard(self, name: str) -> None:
        """Delete one file of the run at the URL if it is there (an earlier stop's ``stopped.json``)."""
        if self.url is None:
            return
        fs, root = self._fs()
        try:
            fs.rm_file(f"{root}/{name}")
        except FileNotFoundError:
            pass
