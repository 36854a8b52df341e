"""Damage checkpoints the way an attacker or a bad disk would, for reliability tests.

An attacker who edits a file of a checkpoint also rewrites ``fsdp_bridge.json`` so that the
recorded sizes and digests match (:func:`redescribe`): what is left to refuse the file is the
reader's own check of its content.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from fsdp_bridge.checkpoint._formats import checksum_of

__all__ = ["redescribe", "zero_file"]


def redescribe(checkpoint: str | os.PathLike[str]) -> None:
    """Record the current size, SHA-256 and checksum (CRC-32C) of every file the description lists (what an
    attacker who rewrites the description would do)."""
    root = Path(checkpoint)
    meta = json.loads((root / "fsdp_bridge.json").read_text())
    for rel in meta.get("files", {}):
        data = (root / rel).read_bytes()
        meta["files"][rel] = len(data)
        if rel in meta.get("digests", {}):
            meta["digests"][rel] = hashlib.sha256(data).hexdigest()
        if rel in meta.get("checksums", {}):
            meta["checksums"][rel] = checksum_of(root / rel, meta.get("checksum_algorithm", "crc32"))
    (root / "fsdp_bridge.json").write_text(json.dumps(meta, indent=2))


def zero_file(path: str | os.PathLike[str]) -> None:
    """Overwrite ``path`` with zero bytes of the same length (a block device that lost its data)."""
    p = Path(path)
    p.write_bytes(bytes(p.stat().st_size))
