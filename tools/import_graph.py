"""Every import edge between fsdp_bridge's modules, function-level ones included, and the cycles they make.

Imports under ``if TYPE_CHECKING:`` are left out, as the import-linter contract leaves them out
(``exclude_type_checking_imports``): they name types for annotations and import nothing when the code runs.

    python tools/import_graph.py            # the cycles (strongly connected groups of modules), one per line
    python tools/import_graph.py --edges    # every edge: importer -> imported  (line)

Read from the source with ``ast`` (nothing is imported). ``lint-imports`` (the contract in pyproject.toml) is what CI
runs; this script is for looking at the graph while changing it.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "fsdp_bridge"


def module_names() -> dict[str, Path]:
    names: dict[str, Path] = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def edges(names: dict[str, Path]) -> list[tuple[str, str, int]]:
    found: list[tuple[str, str, int]] = []
    for module, path in names.items():
        is_package = path.name == "__init__.py"
        package = module if is_package else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {
            id(inner)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            for stmt in block.body
            for inner in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:  # annotations only: no import happens at run time
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join([*base, node.module] if node.module else base)
                else:
                    stem = node.module or ""
                # ``from package import submodule`` imports the submodule; ``from module import name``, the module.
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in names else stem for a in node.names]
            for target in targets:
                while target and target not in names:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    found.append((module, target, node.lineno))
    return sorted(set(found))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def main(argv: list[str]) -> int:
    names = module_names()
    found = edges(names)
    if "--edges" in argv:
        for importer, imported, line in found:
            print(f"{importer} -> {imported}  ({line})")
        return 0
    graph: dict[str, set[str]] = defaultdict(set)
    for name in names:
        graph[name]
    for importer, imported, _ in found:
        # A package's own __init__ importing its submodules (and the reverse, a submodule naming its package
        # for a sibling) is how Python packages are put together, not a cycle between layers.
        if importer == PACKAGE or imported == PACKAGE:
            continue
        graph[importer].add(imported)
    groups = cycles(graph)
    for group in groups:
        print(" <-> ".join(group))
    print(f"{len(groups)} cycle(s)")
    return 1 if groups else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
