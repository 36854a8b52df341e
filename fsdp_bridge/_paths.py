"""Whether a path can be written, asked before any work is done (or any rank is started)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["unwritable_reason"]


def unwritable_reason(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` (a file or directory to be created or replaced) cannot be written, or None.

    Looks at the nearest existing ancestor: it must be a directory this process may create
    entries in.  Catches a path under a regular file, a read-only directory or file system,
    and a parent that does not exist and cannot be created.
    """
    p = Path(os.path.abspath(path))
    ancestor = p.parent
    while not ancestor.exists():
        if ancestor.parent == ancestor:
            return f"no part of {p.parent} exists"
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is a file, not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{ancestor} is not writable by this user"
    if ancestor.resolve().parts[:2] in (("/", "proc"), ("/", "sys")):
        return f"{ancestor} is a kernel file system: files cannot be created in it"
    return None
