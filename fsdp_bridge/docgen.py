"""Generated blocks in the docs, from the code's single mapping table.

    python -m fsdp_bridge.docgen          # rewrite the blocks in place
    python -m fsdp_bridge.docgen --check  # exit 1 if any block is stale (the tests do this)

A block sits between ``<!-- BEGIN GENERATED: name -->`` and ``<!-- END GENERATED: name -->``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from fsdp_bridge.mapping import migration_table_markdown, strategy_table_markdown

__all__ = ["BLOCKS", "render", "stale_blocks"]


def config_reference_markdown() -> str:
    """Every training and bridge config field with type, default and meaning."""
    from fsdp_bridge.train import field_reference

    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in field_reference():
        cells = [f"`{f.key}`", f.type, f"`{f.default}`" if f.default else "", f.doc]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


BLOCKS: dict[str, Callable[[], str]] = {
    "strategy-table": strategy_table_markdown,
    "migration-table": migration_table_markdown,
    "config-reference": config_reference_markdown,
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
