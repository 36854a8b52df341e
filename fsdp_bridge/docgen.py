"""Generated blocks in the docs, from the code: the mapping table, the config fields, the API.

    python -m fsdp_bridge.docgen          # rewrite the blocks in place
    python -m fsdp_bridge.docgen --check  # exit 1 if any block is stale (the tests do this)

A block sits between ``<!-- BEGIN GENERATED: name -->`` and ``<!-- END GENERATED: name -->``.
"""

from __future__ import annotations

import argparse
import ast
import enum
import importlib
import inspect
import itertools
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_bridge.mapping import TABLE

__all__ = ["API_FACES", "BLOCKS", "api_reference_markdown", "render", "stale_blocks"]


def strategy_table_markdown() -> str:
    """The strategy x backend table as Markdown (embedded in the README)."""
    lines = ["| strategy | FSDP1 | FSDP2 |", "| --- | --- | --- |"]
    for r in TABLE:
        if r.option == "strategy":
            fsdp2 = f"{r.fsdp2.outcome.value}: {r.fsdp2.text}"
            lines.append(f"| `{r.case}` | {r.fsdp1.text} | {fsdp2} |")
    return "\n".join(lines)


def migration_table_markdown() -> str:
    """The full FSDP1 -> FSDP2 table as Markdown (``docs/migration.md`` embeds it)."""
    lines = [
        "| option | case | FSDP1 | FSDP1 under fsdp_bridge | FSDP2 outcome | FSDP2 under fsdp_bridge |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in TABLE:
        cells = [r.option, r.case, f"`{r.fsdp1_api}`", r.fsdp1.text, r.fsdp2.outcome.value, r.fsdp2.text]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def config_reference_markdown() -> str:
    """Every training and bridge config field with type, default and meaning."""
    from fsdp_bridge.train import field_reference

    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in field_reference():
        cells = [f"`{f.key}`", f.type, f"`{f.default}`" if f.default else "", f.doc]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


# The package faces: the modules users import from.  Everything else is an implementation
# module, free to change.  tests/test_static.py checks that every subpackage is listed.
API_FACES: tuple[str, ...] = (
    "fsdp_bridge",
    "fsdp_bridge.checkpoint",
    "fsdp_bridge.train",
    "fsdp_bridge.compare",
    "fsdp_bridge.testing",
    "fsdp_bridge.estimate",
    "fsdp_bridge.migrate",
    "fsdp_bridge.hf",
    "fsdp_bridge.lightning",
    "fsdp_bridge.backends",
    "fsdp_bridge.cli",
)

_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")  # reST :func:`x` / :class:`~a.b.X` -> `x` / `X`


def _first_paragraph(doc: str) -> str:
    """The first paragraph of a docstring as one Markdown line (reST roles become code spans)."""
    para = inspect.cleandoc(doc).split("\n\n", 1)[0]
    text = " ".join(line.strip() for line in para.splitlines())
    return _ROLE.sub(lambda m: f"`{m.group(2).rpartition('.')[2] if m.group(1) else m.group(2)}`", text)


class _Annotation:
    """An annotation kept as the source wrote it (``from __future__ import annotations``), shown unquoted."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class _Default:
    """A default shown by its repr, without a memory address (stable output)."""

    def __init__(self, value: object) -> None:
        text = re.sub(r"<(\w+\.\w+): [^>]*>", r"\1", repr(value))  # <Backend.FSDP2: 'fsdp2'> -> Backend.FSDP2
        self.text = re.sub(r" at 0x[0-9a-f]+", "", text)

    def __repr__(self) -> str:
        return self.text


def _signature(obj: Any) -> str | None:
    """``(a: int, *, b: str = 'x') -> bool`` as written in the source, or None where there is none."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None

    def plain(annotation: object) -> object:
        if annotation is inspect.Parameter.empty:
            return annotation
        return _Annotation(annotation if isinstance(annotation, str) else inspect.formatannotation(annotation))

    params = [
        p.replace(
            annotation=plain(p.annotation),
            default=p.default if p.default is inspect.Parameter.empty else _Default(p.default),
        )
        for p in sig.parameters.values()
    ]
    ret = sig.return_annotation
    if inspect.isclass(obj):
        ret = inspect.Signature.empty
    return str(sig.replace(parameters=params, return_annotation=plain(ret)))


def _sources(face: str) -> dict[str, str]:
    """Name -> the module a face (or any module) imports it from."""
    module = importlib.import_module(face)
    path = Path(inspect.getfile(module))
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update({a.asname or a.name: node.module for a in node.names})
    return found


def _attribute_doc(module_name: str, name: str) -> tuple[str, str] | None:
    """(source of the assigned value, the string literal under it) of a module-level constant."""
    module = importlib.import_module(module_name)
    source = Path(inspect.getfile(module)).read_text(encoding="utf-8")
    body = ast.parse(source).body
    for stmt, after in itertools.pairwise(body):
        targets = (
            stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        )
        if not any(isinstance(t, ast.Name) and t.id == name for t in targets):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            if isinstance(stmt, ast.AnnAssign):
                shown = f": {ast.get_source_segment(source, stmt.annotation)}"
            else:
                assert isinstance(stmt, ast.Assign)
                value = ast.get_source_segment(source, stmt.value) or ""
                shown = f" = {value}" if len(value) <= 60 and "\n" not in value else ""
            return shown, after.value.value
    origin = _sources(module_name).get(name)  # imported there: follow it to where it is assigned
    return _attribute_doc(origin, name) if origin and origin != module_name else None


def _own_doc(obj: Any) -> str | None:
    """The docstring ``obj`` itself carries (not one inherited, nor a dataclass's generated one)."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
        return None if not doc or doc.startswith(f"{obj.__name__}(") else doc
    return inspect.getdoc(obj) if inspect.isfunction(obj) or inspect.isbuiltin(obj) else None


def _entry(face: str, name: str, obj: Any, source: str) -> list[str]:
    lines = [f"### `{face}.{name}`", ""]
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        doc = _own_doc(obj)
        head = f"class {name}"
        members = ", ".join(f"`{m.name}`" for m in obj)
    elif inspect.isclass(obj):
        doc, members = _own_doc(obj), ""
        sig = None if getattr(obj, "_is_protocol", False) else _signature(obj)
        head = f"class {name}{sig or ''}"
    elif callable(obj):
        doc, members = _own_doc(obj), ""
        head = f"{name}{_signature(obj) or '(...)'}"
    else:
        found = _attribute_doc(source, name)
        if found is None:
            raise ValueError(
                f"{face}.{name} (defined in {source}) has no docstring: put a string literal on the line under "
                "its assignment, or drop it from the face's __all__"
            )
        shown, doc = found
        head, members = f"{name}{shown}", ""
    if not doc:
        raise ValueError(f"{face}.{name} (defined in {source}) has no docstring of its own: write one")
    lines += ["```python", head, "```", "", _first_paragraph(doc)]
    if members:
        lines += ["", f"Members: {members}."]
    elif inspect.isclass(obj):
        public = [
            a
            for a, v in vars(obj).items()
            if not a.startswith("_") and (inspect.isfunction(v) or isinstance(v, (staticmethod, classmethod, property)))
        ]
        if public:
            lines += ["", "Methods and properties: " + ", ".join(f"`{a}`" for a in public) + "."]
    return [*lines, ""]


def api_reference_markdown() -> str:
    """One section per package face: every name in its ``__all__``, its signature and the first
    paragraph of its docstring.

    Returns:
        The Markdown of the ``api-reference`` block of docs/api.md.

    Raises:
        ValueError: an exported name has no docstring of its own (constants: a string literal
            under the assignment), so the reference would have a hole.
    """
    out: list[str] = []
    holes: list[str] = []
    for face in API_FACES:
        module = importlib.import_module(face)
        sources = _sources(face)
        out += [f"## `{face}`", "", _first_paragraph(module.__doc__ or ""), ""]
        for name in module.__all__:
            try:
                out += _entry(face, name, getattr(module, name), sources.get(name, face))
            except ValueError as err:
                holes.append(str(err))
    if holes:
        raise ValueError("; ".join(holes))
    return "\n".join(out).rstrip("\n")


BLOCKS: dict[str, Callable[[], str]] = {
    "strategy-table": strategy_table_markdown,
    "migration-table": migration_table_markdown,
    "config-reference": config_reference_markdown,
    "api-reference": api_reference_markdown,
}
_BLOCK = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- END GENERATED: (?P=name) -->)", re.S
)


def render(text: str) -> str:
    """``text`` with every generated block rewritten."""

    def fill(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in BLOCKS:
            raise KeyError(f"unknown generated block {name!r}; known: {', '.join(BLOCKS)}")
        return f"{m.group(1)}{BLOCKS[name]()}\n{m.group(4)}"

    return _BLOCK.sub(fill, text)


def stale_blocks(paths: list[Path]) -> list[Path]:
    return [p for p in paths if render(p.read_text()) != p.read_text()]


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(prog="python -m fsdp_bridge.docgen", description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    paths = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    paths = [p for p in paths if p.exists() and "BEGIN GENERATED" in p.read_text()]
    stale = stale_blocks(paths)
    if args.check:
        for p in stale:
            print(f"stale generated block in {p}; run python -m fsdp_bridge.docgen", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(render(p.read_text()))
        print(f"updated {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
