"""Copies of torch's own modules kept inside a codebase (a patched FSDP1 ``_optim_utils.py``, a
``torch/distributed/checkpoint/state_dict.py`` pinned to another torch), told apart from code that
merely uses FSDP1.

Such a file is torch's implementation: FSDP1's internals (flat parameters, handles, private
helpers), or torch's own handling of FSDP1 and FSDP2 side by side, where rewriting
``isinstance(m, FSDP)`` would send FSDP2 modules down FSDP1's path.  The codemod reports it once,
as one construct, and leaves it as it is.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

__all__ = ["VendoredModule", "vendored_torch_module"]

MIN_SHARED = 5
"""Top-level functions and classes a file must share with the torch module of its name."""


class VendoredModule:
    """A file found to be a copy of the torch module ``module``."""

    def __init__(self, module: str, shared: list[str]) -> None:
        self.module = module
        self.shared = shared

    @property
    def construct(self) -> str:
        return f"a copy of torch's module {self.module} ({len(self.shared)} of its functions and classes)"

    @property
    def replacement(self) -> str:
        public = not any(part.startswith("_") for part in self.module.split("."))
        instead = f"import {self.module} from torch itself" if public else "FSDP2 needs none of FSDP1's internals"
        return (
            "left as it is: torch's own code (FSDP1 internals, or torch's handling of FSDP1 and FSDP2 alike), "
            "which a line-by-line rewrite would break. Once the code that uses it is migrated, remove the copy "
            f"(and any step that installs it into torch): {instead}; optimizer state on FSDP2: "
            "fsdp_bridge.save_checkpoint(path, model, optimizer) or "
            "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer)"
        )


@functools.cache
def _torch_dir() -> Path | None:
    """The installed torch package's directory, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


@functools.cache
def _top_level_names(path: Path) -> frozenset[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return frozenset()
    return _defined(tree)


def _defined(tree: ast.Module) -> frozenset[str]:
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return frozenset(node.name for node in tree.body if isinstance(node, kinds))


def _candidates(torch_dir: Path, path: str) -> list[Path]:
    """torch sources ``path`` may copy: the FSDP1 module of its name, and the module at the same
    place under ``torch/`` when the file sits in a ``torch/`` directory of its own."""
    parts = Path(path).parts
    stem = Path(path).stem
    fsdp = torch_dir / "distributed" / "fsdp"
    found = [fsdp / f"{stem}.py", fsdp / f"_{stem.lstrip('_')}.py"]
    if "torch" in parts[:-1]:
        last = len(parts) - 1 - parts[::-1].index("torch")
        found.append(torch_dir.joinpath(*parts[last + 1 :]))
    return [c for c in dict.fromkeys(found) if c.is_file()]


def vendored_torch_module(code: str, path: str) -> VendoredModule | None:
    """The torch module ``code`` copies (see :func:`_candidates`) when it defines at least
    :data:`MIN_SHARED` of that module's top-level functions and classes; else ``None``."""
    torch_dir = _torch_dir()
    if torch_dir is None or Path(path).suffix != ".py":
        return None
    candidates = _candidates(torch_dir, path)
    if not candidates:
        return None
    try:
        mine = _defined(ast.parse(code))
    except (SyntaxError, ValueError):
        return None
    for candidate in candidates:
        shared = sorted(mine & _top_level_names(candidate))
        if len(shared) >= MIN_SHARED:
            module = ".".join(("torch", *candidate.relative_to(torch_dir).with_suffix("").parts))
            return VendoredModule(module, shared)
    return None
