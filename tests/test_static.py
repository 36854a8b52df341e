"""Static checks: generated docs in sync with the code's mapping table, plain --help.

Lint (ruff) and types (mypy) run beside the tests in `make test` / `.ci/run`, not inside pytest.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_generated_doc_blocks_are_current() -> None:
    out = run(sys.executable, "-m", "fsdp_bridge.docgen", "--check")
    assert out.returncode == 0, out.stderr


def test_api_reference_lists_every_face_and_refuses_an_undocumented_name(monkeypatch) -> None:
    """docs/api.md (the api-reference block, kept current by the test above) covers every package
    face, and the generator refuses an exported name without a docstring instead of leaving a hole."""
    import importlib

    import pytest

    import fsdp_bridge.hf
    from fsdp_bridge import docgen

    subpackages = {f"fsdp_bridge.{p.parent.name}" for p in (ROOT / "fsdp_bridge").glob("*/__init__.py")}
    assert sorted(subpackages - set(docgen.API_FACES)) == [], "add the new subpackage to docgen.API_FACES"
    doc = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    for face in docgen.API_FACES:
        names = importlib.import_module(face).__all__
        assert [n for n in names if f"### `{face}.{n}`" not in doc] == [], face

    def undocumented(model: object) -> object:
        return model

    undocumented.__doc__ = None
    monkeypatch.setattr(fsdp_bridge.hf, "undocumented", undocumented, raising=False)
    monkeypatch.setattr(fsdp_bridge.hf, "__all__", [*fsdp_bridge.hf.__all__, "undocumented"])
    with pytest.raises(ValueError, match=r"fsdp_bridge\.hf\.undocumented .*has no docstring"):
        docgen.api_reference_markdown()


def test_help_is_plain_text_and_every_subcommand_describes_itself(capsys) -> None:
    from fsdp_bridge.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parsers = dict(sub.choices)
    migrate_sub = next(a for a in parsers["migrate"]._actions if isinstance(a, argparse._SubParsersAction))
    parsers.update({f"migrate {k}": v for k, v in migrate_sub.choices.items()})
    for name, p in parsers.items():
        text = p.format_help()
        assert "``" not in text, name
        assert p.description, f"{name} --help has no description"


def test_architecture_doc_names_every_module_and_only_modules() -> None:
    """docs/architecture.md's module table is the map of the tree: a new module must appear in it."""
    import re

    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = doc.split("## Every module", 1)[1].split("\n## ", 1)[0]
    first_cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    named = {path for cell in first_cells for path in re.findall(r"`([\w/]+\.py)`", cell)}
    package = ROOT / "fsdp_bridge"
    modules = {p.relative_to(package).as_posix() for p in package.rglob("*.py")}
    assert sorted(modules - named) == [], "modules missing from docs/architecture.md's module table"
    assert sorted(named - modules) == [], "paths in docs/architecture.md's module table that are not modules"


def test_every_module_is_in_a_layer_of_the_import_contract() -> None:
    """A module the layers contract does not name escapes it: every top-level module and subpackage of
    fsdp_bridge is in exactly one layer (pyproject.toml, checked by lint-imports in `make lint`)."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["id"] == "layers")["layers"]
    named = [name.strip() for layer in layers for name in layer.split("|")]
    package = ROOT / "fsdp_bridge"
    present = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    present |= {p.parent.name for p in package.glob("*/__init__.py")}
    assert sorted(present - set(named)) == [], "modules missing from the layers contract in pyproject.toml"
    assert len(named) == len(set(named)), "a module named in two layers"
