"""Regenerate the option table in ``docs/migration.md`` from the mapping table.

    python -m fsdp_bridge.migrate.docs            # rewrite docs/migration.md in place
    python -m fsdp_bridge.migrate.docs --check    # exit 1 when the file is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdp_bridge.mapping import migration_table_markdown

BEGIN = "<!-- BEGIN GENERATED: fsdp_bridge.mapping.migration_table_markdown() -->"
END = "<!-- END GENERATED -->"
DEFAULT = Path(__file__).resolve().parents[2] / "docs" / "migration.md"


def render(text: str) -> str:
    """``text`` with the generated block replaced by the current table."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"the markers {BEGIN!r} and {END!r} are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{migration_table_markdown()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", default=str(DEFAULT))
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    path = Path(args.path)
    text = path.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{path} is out of date: run python -m fsdp_bridge.migrate.docs", file=sys.stderr)
            return 1
        return 0
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
