"""Copies of torch's own modules kept inside a codebase (a patched FSDP1 ``_optim_utils.py``, a
``torch/distributed/checkpoint/state_dict.py`` pinned to another torch), told apart from code that
merely uses FSDP1.

A file that defines several of the private functions of the FSDP1 modules it imports from (torch's own
``_flatten_optim_state_dict`` written out again, with a fix, beside ``from torch.distributed.fsdp._optim_utils
import ...``; or renamed so as to say so, ``fixed_flatten_optim_state_dict``) is a patched copy of parts of them,
and is reported the same way.

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

from fsdp_bridge.migrate._names import unpatched

__all__ = ["VendoredModule", "vendored_torch_module"]

MIN_SHARED = 5
"""Top-level functions and classes a file must share with the torch module of its name."""

MIN_PATCHED = 3
"""Private functions a file must define under the names of the FSDP1 modules' it imports from (their top-level
functions and their classes' methods) to be a patched copy of parts of them."""


class VendoredModule:
    """A file found to be a copy of the torch module ``module`` (``partial``: of some of the private functions of
    the modules ``module`` names, comma-separated)."""

    def __init__(self, module: str, shared: list[str], partial: bool = False) -> None:
        self.module = module
        self.shared = shared
        self.partial = partial

    @property
    def construct(self) -> str:
        if self.partial:
            return f"a patched copy of private FSDP1 functions of torch's {self.module} ({', '.join(self.shared)})"
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
def _parsed(path: Path) -> ast.Module | None:
    """A torch source, parsed once (None where it cannot be read or parsed)."""
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _top_level_names(path: Path) -> frozenset[str]:
    tree = _parsed(path)
    return frozenset() if tree is None else _defined(tree)


@functools.cache
def _private_names(path: Path) -> frozenset[str]:
    """The private top-level functions and classes of a torch source, and its classes' private methods."""
    tree = _parsed(path)
    if tree is None:
        return frozenset()
    names = set(_defined(tree))
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names.update(_defined(ast.Module(body=node.body, type_ignores=[])))
    return frozenset(n for n in names if _private(n))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _imported_fsdp1_sources(torch_dir: Path, tree: ast.Module) -> dict[str, Path]:
    """The FSDP1 modules (``torch.distributed.fsdp.*``, not its FSDP2 package) the file imports names from."""
    found: dict[str, Path] = {}
    for node in ast.walk(tree):
        module = node.module if isinstance(node, ast.ImportFrom) and node.level == 0 else None
        if not module or not module.startswith("torch.distributed.fsdp.") or "._fully_shard" in module:
            continue
        source = torch_dir.joinpath(*module.split(".")[1:]).with_suffix(".py")
        if source.is_file():
            found[module] = source
    return found


def _as_torch_names(name: str) -> set[str]:
    """The private torch names a function of a patched copy may stand for: its own (``_broadcast_state``), and,
    without a word that says it is patched (see ``_names.unpatched``), that name with one leading underscore
    (``fixed_flatten_optim_state_dict`` -> ``_flatten_optim_state_dict``)."""
    found = {name} if _private(name) else set()
    if (stem := unpatched(name)) is not None:
        found.add(f"_{stem}")
    return found


def _patched_copy(torch_dir: Path, tree: ast.Module) -> VendoredModule | None:
    """At least :data:`MIN_PATCHED` private functions the file defines under the names of functions of the
    FSDP1 modules it imports from (as they are, or with a word that says they are patched, see
    :func:`_as_torch_names`): a patched copy of parts of them."""
    mine: dict[str, str] = {}  # a torch private name -> the file's function that copies it
    for own in sorted(_defined(tree)):
        for name in _as_torch_names(own):
            mine.setdefault(name, own)
    by_module = {
        module: sorted(mine[n] for n in set(mine) & _private_names(source))
        for module, source in sorted(_imported_fsdp1_sources(torch_dir, tree).items())
    }
    shared = sorted({n for names in by_module.values() for n in names})
    if len(shared) < MIN_PATCHED:
        return None
    return VendoredModule(", ".join(m for m, names in by_module.items() if names), shared, partial=True)


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
    :data:`MIN_SHARED` of that module's top-level functions and classes, or the FSDP1 modules it copies parts
    of (see :func:`_patched_copy`); else ``None``."""
    torch_dir = _torch_dir()
    if torch_dir is None or Path(path).suffix != ".py":
        return None
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return None
    mine = _defined(tree)
    for candidate in _candidates(torch_dir, path):
        shared = sorted(mine & _top_level_names(candidate))
        if len(shared) >= MIN_SHARED:
            module = ".".join(("torch", *candidate.relative_to(torch_dir).with_suffix("").parts))
            return VendoredModule(module, shared)
    shared = sorted(mine & _fsdp1_package_names(torch_dir))
    if len(shared) >= MIN_SHARED and mine & FSDP1_CORE_CLASSES:
        # an older torch's FSDP1 module under any name (fully_sharded_data_parallel_fix.py): its names moved
        # between torch's modules since, so it is matched against the whole package
        return VendoredModule("torch.distributed.fsdp", shared)
    return _patched_copy(torch_dir, tree)


FSDP1_CORE_CLASSES = frozenset({"FullyShardedDataParallel", "FlatParameter", "FlatParamHandle", "_ExecOrderData"})
"""Classes only a copy of FSDP1's own modules defines (with :data:`MIN_SHARED` of the package's names)."""


@functools.cache
def _fsdp1_package_names(torch_dir: Path) -> frozenset[str]:
    """The top-level functions and classes of every module of torch's FSDP1 package (its FSDP2 modules aside)."""
    names: set[str] = set()
    for source in sorted((torch_dir / "distributed" / "fsdp").glob("*.py")):
        names |= _top_level_names(source)
    return frozenset(names)
