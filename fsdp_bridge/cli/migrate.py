"""``fsdp-bridge migrate config SRC [-o DST] [--fsdp "..."]`` and ``fsdp-bridge migrate code PATH... [--fix] [--diff]``

config: reads an FSDP1 config (accelerate YAML, Trainer ``fsdp`` + ``fsdp_config``, or a
bridge YAML with backend fsdp1) and writes the FSDP2 bridge YAML (plus an accelerate YAML
with ``fsdp_version: 2`` for accelerate sources) and a per-option report
``<DST stem>.migration.md``; the report is printed too.

code: reports every FSDP1 construct in Python files (file:line, construct, replacement);
``--fix`` rewrites the mechanical cases and leaves ``TODO(fsdp-bridge)`` comments on the rest;
``--diff`` prints the rewrite without writing.  Exit code 1 when constructs remain
(without --fix), 0 otherwise.

    fsdp-bridge migrate config accelerate_fsdp1.yaml -o fsdp2.yaml
    fsdp-bridge migrate config fsdp_config.json --fsdp "hybrid_shard auto_wrap"
    fsdp-bridge migrate code train.py --diff
    fsdp-bridge migrate code src/ --fix
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fsdp_bridge._paths import unwritable_reason
from fsdp_bridge.errors import ConfigError, Problem


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "migrate",
        help="migrate FSDP1 configs and code to FSDP2",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inner = p.add_subparsers(dest="migrate_command", metavar="{config,code}")
    c = inner.add_parser("config", help="convert an FSDP1 config to FSDP2, with a per-option report")
    c.add_argument("src", help="accelerate YAML, Trainer arguments JSON/YAML, fsdp_config JSON, or bridge YAML")
    c.add_argument("-o", "--output", default=None, help="bridge YAML to write (default: SRC stem + .fsdp2.yaml)")
    c.add_argument(
        "--fsdp",
        default=None,
        help='the Trainer\'s fsdp option string when SRC is its fsdp_config JSON (e.g. "full_shard auto_wrap")',
    )
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=run_config)
    k = inner.add_parser(
        "code",
        help="find FSDP1 API use in Python files; --fix rewrites it",
        description="Find FSDP1 API use in Python files; --fix rewrites them (all files or none). "
        "Exit code: 0 fully migrated (or nothing to migrate), 1 TODOs or skipped "
        "files remain (listed), 2 error.",
    )
    k.add_argument("paths", nargs="+", help="Python files or directories")
    k.add_argument("--fix", action="store_true", help="rewrite the files")
    k.add_argument("--diff", action="store_true", help="print the rewrite as a unified diff; write nothing")
    k.set_defaults(func=run_code)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_config(args: argparse.Namespace) -> int:
    from fsdp_bridge.migrate._config import default_output, migrate_config, write_outputs

    if not args.src or not Path(args.src).is_file():
        raise ConfigError(
            [
                Problem(
                    "SRC",
                    args.src,
                    "an FSDP1 config file (accelerate YAML, Trainer fsdp_config "
                    "JSON, or a bridge YAML with backend fsdp1)",
                    "pass the path of that file",
                )
            ]
        )
    dst = Path(args.output) if args.output else default_output(args.src)
    reason = unwritable_reason(dst)
    if reason is not None:  # before reading the source: say where the output cannot go
        raise ConfigError(
            [
                Problem(
                    "-o/--output", str(dst), "a file in a writable directory", f"{reason}; pass -o with a writable path"
                )
            ]
        )
    migration = migrate_config(args.src, fsdp=args.fsdp)
    try:
        write_outputs(migration, dst)
    except OSError as err:
        raise ConfigError(
            [
                Problem(
                    "-o/--output",
                    str(dst),
                    "a file in a writable directory",
                    f"writing failed ({err}); pass -o with a writable path",
                )
            ]
        ) from None
    if args.json:
        print(json.dumps(migration.report.to_dict(), indent=2))
    else:
        print(migration.report.format())
    return 0


def run_code(args: argparse.Namespace) -> int:
    try:
        from fsdp_bridge.migrate._code import migrate_paths
    except ImportError as err:  # libcst missing
        print(f"fsdp-bridge migrate code needs libcst: pip install 'fsdp-bridge[migrate]' ({err})", file=sys.stderr)
        return 2
    missing = [repr(p) if not p else p for p in args.paths if not p or not Path(p).exists()]
    if missing:
        print(f"fsdp-bridge migrate code: no such file or directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    from fsdp_bridge.migrate._code import MigrationWriteError

    try:
        report, results = migrate_paths(args.paths, fix=args.fix and not args.diff)
    except MigrationWriteError as err:
        print(f"fsdp-bridge migrate code: {err}", file=sys.stderr)
        return 2
    if args.diff:
        for r in results:
            if r.changed:
                sys.stdout.write(r.diff())
    print(report.format())
    if args.fix and not args.diff:
        for path in report.changed:
            print(f"rewrote {path}")
    # 0: fully migrated (or nothing to migrate); 1: TODOs or skipped files remain (listed above),
    # the TODO(fsdp-bridge) comments an earlier --fix left in the files included.
    fixed = args.fix and not args.diff
    remaining = report.todos if fixed else report.findings
    if fixed and report.todo_comments and not report.todos:
        left = ", ".join(f"{path} ({n})" for path, n in report.todo_comments.items())
        print(f"TODO(fsdp-bridge) comments still in the files: {left}")
    return 1 if (remaining or report.skipped or (fixed and report.todo_comments)) else 0
