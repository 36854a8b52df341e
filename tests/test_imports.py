"""Import boundaries: what ``import fsdp_bridge`` and ``fsdp-bridge --help`` load, and who imports ``testing``.

Each check runs in a fresh interpreter (``sys.modules`` of this pytest process already holds
torch and more), and checks which modules got loaded, never how long it took.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fsdp_bridge"

# Loaded by the functions that use them, never by `import fsdp_bridge` or by `--help`.
HEAVY = ("torch", "transformers", "accelerate", "tqdm", "matplotlib", "peft", "safetensors", "libcst")
# Never imported at the top of a module of the package: only inside the function that needs them.
FUNCTION_LEVEL_ONLY = ("transformers", "accelerate", "peft", "tqdm", "matplotlib")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _loaded(code: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter; it must print one JSON object last."""
    out = _python(code)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


_HEAVY_LOADED = f"sorted(m for m in {HEAVY!r} if m in sys.modules)"


def test_import_fsdp_bridge_loads_no_heavy_dependency() -> None:
    result = _loaded(f"import json, sys\nimport fsdp_bridge\nprint(json.dumps({{'loaded': {_HEAVY_LOADED}}}))")
    assert result["loaded"] == []


def test_every_public_name_resolves_and_is_listed() -> None:
    code = """
import json, sys
import fsdp_bridge
listed = dir(fsdp_bridge)
missing_from_dir = [n for n in fsdp_bridge.__all__ if n not in listed]
kinds = {n: type(getattr(fsdp_bridge, n)).__name__ for n in fsdp_bridge.__all__}
try:
    fsdp_bridge.no_such_name
    unknown = "resolved"
except AttributeError as err:
    unknown = str(err)
print(json.dumps({"all": fsdp_bridge.__all__, "exports": sorted(fsdp_bridge._EXPORTS),
                  "missing_from_dir": missing_from_dir, "kinds": kinds, "unknown": unknown}))
"""
    result = _loaded(code)
    assert result["missing_from_dir"] == []
    assert "no attribute 'no_such_name'" in str(result["unknown"])
    names = result["all"]
    assert isinstance(names, list) and len(names) == len(set(names))
    # Every lazily loaded name is public, and every public name but __version__ is loaded lazily.
    assert sorted(set(names) - {"__version__"}) == result["exports"]
    assert isinstance(result["kinds"], dict) and set(result["kinds"]) == set(names)


def test_type_checking_imports_match_the_lazy_table() -> None:
    """mypy and IDEs read the TYPE_CHECKING imports; the runtime reads _EXPORTS: they must agree."""
    import fsdp_bridge

    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    seen: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module
                for alias in stmt.names:
                    seen[alias.asname or alias.name] = stmt.module
    assert seen == fsdp_bridge._EXPORTS


def test_help_of_every_subcommand_runs_without_torch() -> None:
    code = f"""
import contextlib, io, json, sys
from fsdp_bridge.cli import build_parser, main

def subcommands(parser):
    import argparse
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {{}}

parser = build_parser()
commands = [[]]
for name, child in subcommands(parser).items():
    commands.append([name])
    commands += [[name, inner] for inner in subcommands(child)]
codes, heads = {{}}, {{}}
for argv in commands:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*argv, "--help"])
            code = None
        except SystemExit as exc:
            code = exc.code
    key = " ".join(argv) or "(top)"
    codes[key] = code
    heads[key] = out.getvalue()[:6]
print(json.dumps({{"codes": codes, "heads": heads, "loaded": {_HEAVY_LOADED}}}))
"""
    result = _loaded(code)
    codes, heads = result["codes"], result["heads"]
    assert isinstance(codes, dict) and isinstance(heads, dict)
    assert {"(top)", "train", "compare", "convert", "estimate", "migrate config"} <= set(codes)
    assert all(c == 0 for c in codes.values()), codes
    assert all(h == "usage:" for h in heads.values()), heads
    assert result["loaded"] == []


def test_a_bad_train_config_is_reported_before_torch_loads(tmp_path) -> None:
    """`fsdp-bridge train` reads and checks the YAML and the overrides before torch is imported ("a bad config
    fails at once"), read off -X importtime of the process that reported the errors."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("bridge:\n  strategy: full_shrad\nmax_stepz: 3\n")
    for argv in ([str(bad)], ["max_stepz=3", "bridge.backend=fsdp3"]):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "fsdp_bridge", "train", *argv],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 2, out.stderr
        assert "did you mean 'max_steps'?" in out.stderr
        imported = {
            line.rpartition("|")[2].strip() for line in out.stderr.splitlines() if line.startswith("import time:")
        }
        assert "fsdp_bridge.train._config" in imported
        assert sorted(m for m in imported if m.split(".")[0] in HEAVY) == [], argv


def test_the_command_line_entry_point_imports_no_torch() -> None:
    """`python -m fsdp_bridge --help` (what the fsdp-bridge script runs), read off -X importtime."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fsdp_bridge", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: fsdp-bridge")
    imported = {line.rpartition("|")[2].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "fsdp_bridge.cli" in imported
    assert sorted(m for m in imported if m.split(".")[0] in HEAVY) == []


def test_cli_light_copies_match_their_sources() -> None:
    """Choices the parsers offer without importing torch agree with the code that uses them."""
    from fsdp_bridge.checkpoint._convert import TARGETS
    from fsdp_bridge.cli import convert, estimate
    from fsdp_bridge.estimate import OPTIMIZERS

    assert convert.TARGETS == TARGETS
    assert estimate.OPTIMIZER_NAMES == tuple(OPTIMIZERS)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(source: str, package: str) -> list[tuple[str, int, bool]]:
    """(absolute module, line, runs at import time) for every import in ``source``, a module of
    ``package``; relative imports are resolved, ``from a import b`` yields both ``a`` and ``a.b``."""
    tree = ast.parse(source)
    # Statements run when the module is imported: its body, and blocks directly in it
    # (try/if), except `if TYPE_CHECKING:`.
    eager: set[int] = set()
    for node in tree.body:
        if not _is_type_checking(node):
            eager.add(id(node))
            if isinstance(node, (ast.If, ast.Try)):
                eager.update(id(n) for n in ast.walk(node) if not isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in eager) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append((module, node.lineno, id(node) in eager))
            found += [(f"{module}.{alias.name}", node.lineno, id(node) in eager) for alias in node.names]
    return found


def _production_imports() -> list[tuple[str, str, int, bool]]:
    """(file, module, line, at import time) for every import in fsdp_bridge/ outside testing/."""
    rows = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "testing":
            continue
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        rows += [(str(path.relative_to(ROOT)), *row) for row in _imports(path.read_text(), package)]
    return rows


def _is_testing(module: str) -> bool:
    return module == "fsdp_bridge.testing" or module.startswith("fsdp_bridge.testing.")


def test_production_code_never_imports_testing() -> None:
    offenders = [
        f"{file}:{line} imports {module}" for file, module, line, _ in _production_imports() if _is_testing(module)
    ]
    assert offenders == []


def test_heavy_dependencies_are_imported_inside_functions() -> None:
    offenders = [
        f"{file}:{line} imports {module} when the module is imported"
        for file, module, line, eager in _production_imports()
        if eager and module.split(".")[0] in FUNCTION_LEVEL_ONLY
    ]
    assert offenders == []


@pytest.mark.parametrize(
    ("source", "module", "eager"),
    [
        ("from fsdp_bridge.testing import run_distributed\n", "fsdp_bridge.testing", True),
        ("import fsdp_bridge.testing.models\n", "fsdp_bridge.testing.models", True),
        ("from fsdp_bridge import testing\n", "fsdp_bridge.testing", True),
        ("from .. import testing\n", "fsdp_bridge.testing", True),
        ("def f():\n    from ..testing.faults import maybe_fail\n", "fsdp_bridge.testing.faults", False),
        ("try:\n    import transformers\nexcept ImportError:\n    pass\n", "transformers", True),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tqdm\n", "tqdm", False),
    ],
)
def test_the_import_scan_sees_every_spelling(source: str, module: str, eager: bool) -> None:
    """The two scans above would pass vacuously if they missed a way of writing an import."""
    found = {(m, e) for m, _, e in _imports(source, "fsdp_bridge.train")}
    assert (module, eager) in found


def _raises_itself(fn: Any) -> bool:
    """Whether ``fn``'s own body (not a nested function) has a ``raise`` of an exception."""
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    todo = list(tree.body[0].body)  # type: ignore[attr-defined]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Raise) and node.exc is not None:
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return False


def _exported_callables() -> list[tuple[str, Any]]:
    """Every function the package faces (those docs/api.md documents) export, and the public
    methods of the classes they export."""
    import importlib
    import inspect

    from fsdp_bridge.docgen import API_FACES

    out: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for face in API_FACES:
        module = importlib.import_module(face)
        for name in module.__all__:
            obj = getattr(module, name)
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if inspect.isclass(obj):
                for attr, value in vars(obj).items():
                    if isinstance(value, (staticmethod, classmethod)):
                        value = value.__func__
                    if not attr.startswith("_") and inspect.isfunction(value):
                        out.append((f"{face}.{name}.{attr}", value))
            elif callable(obj):
                out.append((f"{face}.{name}", obj))
    return out


def test_every_exported_function_documents_args_returns_and_raises() -> None:
    """The next engineer reads the contract in the docstring: Args, Returns, and Raises where it raises."""
    import inspect

    missing = []
    callables = _exported_callables()
    assert "fsdp_bridge.BridgeConfig.from_dict" in dict(callables)
    assert "fsdp_bridge.checkpoint.convert_checkpoint" in dict(callables)
    assert {"fsdp_bridge.migrate.migrate_config", "fsdp_bridge.hf.is_hf_model", "fsdp_bridge.cli.main"} <= set(
        dict(callables)
    )
    assert "fsdp_bridge.backends.BackendImpl.shard" in dict(callables)
    for name, obj in callables:
        doc = inspect.getdoc(obj) or ""
        params = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]
        if params and "Args:" not in doc:
            missing.append(f"{name}: Args")
        if "Returns:" not in doc and "Yields:" not in doc:
            missing.append(f"{name}: Returns")
        if _raises_itself(obj) and "Raises:" not in doc:
            missing.append(f"{name}: Raises")
    assert not missing, missing


def test_the_raise_scan_sees_a_raise_and_skips_nested_functions() -> None:
    def raises() -> None:
        if True:
            raise ValueError("x")

    def nested_only() -> None:
        def inner() -> None:
            raise ValueError("x")

    assert _raises_itself(raises)
    assert not _raises_itself(nested_only)


def test_examples_use_only_public_names() -> None:
    """Examples are what users copy: no private module (``fsdp_bridge.train._data``) nor private name."""
    offenders = []
    for path in sorted((ROOT / "examples").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fsdp_bridge":
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "fsdp_bridge"]
            else:
                continue
            if any(part.startswith("_") for name in names for part in name.split(".")):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
