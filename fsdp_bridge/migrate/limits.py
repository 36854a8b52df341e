"""Bounds on a source file before the codemod parses it.

libcst's native parser has no guard of its own: about 1,500 nested calls overflow its stack
(the process dies with a segmentation fault) and a 50 MB file exhausts memory (about 450 MB of
memory and half a minute of parsing per MiB). :func:`read_source` refuses such a file with a
:class:`SourceLimitError` before libcst sees it, so the driver reports it and goes on to the next
file. The bounds are CPython's own: code nested deeper does not compile anyway.
"""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

__all__ = ["MAX_INDENT", "MAX_NESTING", "MAX_SOURCE_BYTES", "SourceLimitError", "read_source"]

MAX_SOURCE_BYTES = 1 << 20
"""The largest file the codemod reads (1 MiB; training scripts are a few tens of KiB)."""
MAX_NESTING = 200
"""The deepest nesting of brackets (CPython refuses more: "too many nested parentheses")."""
MAX_INDENT = 100
"""The deepest nesting of indented blocks (CPython refuses more: "too many levels of indentation")."""
_OPENERS = "([{"


class SourceLimitError(ValueError):
    """A source file over the codemod's bounds; the message names the file, the bound and the fix."""


def _too_deep(code: str) -> str | None:
    """Why ``code`` nests deeper than the bounds (None when it does not), from its tokens: brackets
    inside strings and comments do not count. Stops at the first token past a bound."""
    if sum(code.count(c) for c in _OPENERS) <= MAX_NESTING and code.count("\n") <= MAX_INDENT:
        return None  # too few brackets and lines to nest past a bound: no need to tokenize
    depth = indent = 0
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.OP and tok.string in _OPENERS:
                depth += 1
                if depth > MAX_NESTING:
                    return f"brackets nested more than {MAX_NESTING} deep (line {tok.start[0]})"
            elif tok.type == tokenize.OP and tok.string in ")]}":
                depth = max(depth - 1, 0)
            elif tok.type == tokenize.INDENT:
                indent += 1
                if indent > MAX_INDENT:
                    return f"blocks indented more than {MAX_INDENT} levels deep (line {tok.start[0]})"
            elif tok.type == tokenize.DEDENT:
                indent -= 1
    except (tokenize.TokenError, SyntaxError) as err:  # unbalanced, or the tokenizer's own bounds
        return f"not valid Python 3: the tokenizer stopped ({err})"
    return None


def read_source(path: Path) -> str:
    """The text of ``path`` (UTF-8), refused before it is parsed when it is over the bounds.

    Raises:
        SourceLimitError: the file is over :data:`MAX_SOURCE_BYTES` (checked before reading it),
            or nests deeper than :data:`MAX_NESTING` brackets or :data:`MAX_INDENT` blocks.
        OSError, UnicodeDecodeError: the file cannot be read as UTF-8 text.
    """
    size = path.stat().st_size
    if size > MAX_SOURCE_BYTES:
        raise SourceLimitError(
            f"{size:,} bytes, over the codemod's limit of {MAX_SOURCE_BYTES:,} bytes "
            "(a training script is far smaller: is this generated code or data?); migrate it by hand"
        )
    with open(path, encoding="utf-8", newline="") as f:  # line endings as written (CRLF files stay CRLF)
        code = f.read(MAX_SOURCE_BYTES + 1)  # the file may have grown since the stat
    if len(code.encode("utf-8")) > MAX_SOURCE_BYTES:
        raise SourceLimitError(f"over the codemod's limit of {MAX_SOURCE_BYTES:,} bytes; migrate it by hand")
    why = _too_deep(code)
    if why is not None and why.startswith("not valid"):
        raise SourceLimitError(f"{why}; fix the file or migrate it by hand")
    if why is not None:
        raise SourceLimitError(
            f"{why}, past what the parser handles safely and what CPython compiles; "
            "flatten that code (name the intermediate values) or migrate the file by hand"
        )
    return code


NOTEBOOK_SCAN_BYTES = 64 * 1024 * 1024
"""How much of a Jupyter notebook :func:`notebook_uses_fsdp1` reads (outputs and images make them large)."""


def notebook_uses_fsdp1(path: Path) -> bool:
    """Whether a Jupyter notebook names FSDP1's wrapper (``FullyShardedDataParallel``) in its first
    :data:`NOTEBOOK_SCAN_BYTES`, read in blocks (never executed, never parsed as JSON)."""
    needle = b"FullyShardedDataParallel"
    tail = b""
    try:
        with open(path, "rb") as f:
            for _ in range(NOTEBOOK_SCAN_BYTES // (1 << 20)):
                block = f.read(1 << 20)
                if not block:
                    return False
                if needle in tail + block:
                    return True
                tail = block[-len(needle) :]
    except OSError:
        return False
    return False
