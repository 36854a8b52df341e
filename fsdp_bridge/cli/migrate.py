"""``fsdp-bridge migrate config|code|verify``

config: reads an FSDP1 config (accelerate YAML, Trainer ``fsdp`` + ``fsdp_config``, or a
bridge YAML with backend fsdp1) and writes the FSDP2 bridge YAML (plus an accelerate YAML
with ``fsdp_version: 2`` for accelerate sources) and a per-option report
``<DST stem>.migration.md``; the report is printed too.

code: reports every FSDP1 construct in Python files (file:line, construct, replacement);
``--fix`` rewrites the mechanical cases and leaves ``TODO(fsdp-bridge)`` comments on the rest;
``--diff`` prints the rewrite without writing; ``--target torch`` writes plain FSDP2 code instead of the
bridge's calls.  Exit code 1 when constructs remain
(without --fix), 0 otherwise.

    fsdp-bridge migrate config accelerate_fsdp1.yaml -o fsdp2.yaml
    fsdp-bridge migrate config fsdp_config.json --fsdp "hybrid_shard auto_wrap"
    fsdp-bridge migrate code train.py --diff
    fsdp-bridge migrate code src/ --fix

verify: runs a script under torchrun in a copy of the FSDP1 tree and in a migrated copy, and
compares the loss of every backward() and every saved tensor: PARITY (0) or DIVERGED (1).

    fsdp-bridge migrate verify src/ --nproc-per-node 2 -- train.py --steps 3
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
    inner = p.add_subparsers(dest="migrate_command", metavar="{config,code,verify}")
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
    k.add_argument(
        "--target",
        choices=("bridge", "torch"),
        default="bridge",
        help="what --fix writes: fsdp_bridge's calls (default), or plain FSDP2 code (torch's fully_shard, "
        "MixedPrecisionPolicy, DCP state dicts) with a generated _fsdp2_helpers.py beside the files; "
        "what it cannot write in plain torch stays on fsdp_bridge with a TODO",
    )
    k.set_defaults(func=run_code)
    v = inner.add_parser(
        "verify",
        help="run a script before and after migration; compare every loss and saved tensor",
        usage="fsdp-bridge migrate verify DIR [--nproc-per-node N] [--migrated DIR2] [--target bridge|torch] "
        "[options] -- SCRIPT [ARGS...]",
        description="Run SCRIPT under torchrun in a copy of DIR (FSDP1) and in a migrated copy (migrate code --fix "
        "on a copy, or --migrated DIR2), same seed; record the loss of every backward() on every rank and the "
        "tensors of every file the script saves; print them side by side and a verdict. Exit code: 0 PARITY, "
        "1 DIVERGED (the first differing step and values), 2 error (the original script failed, bad arguments). "
        "Nothing is written outside a temporary directory.",
    )
    v.add_argument("dir", help="the directory of the FSDP1 code")
    v.add_argument("--nproc-per-node", type=int, default=2, help="ranks for each run (default 2)")
    v.add_argument("--migrated", default=None, help="an already migrated copy of DIR (default: --fix on a copy)")
    v.add_argument(
        "--target",
        choices=("bridge", "torch"),
        default="bridge",
        help="what --fix writes in the copy: fsdp_bridge's calls (default) or plain FSDP2 code",
    )
    v.add_argument("--seed", type=int, default=0, help="the global seed set before each run (default 0)")
    v.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: by the loss dtype)")
    v.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: by the loss dtype)")
    v.add_argument("--timeout", type=float, default=None, help="seconds each run may take")
    v.set_defaults(func=run_verify, script_command=[])
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
        report, results = migrate_paths(args.paths, fix=args.fix and not args.diff, target=args.target)
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


def run_verify(args: argparse.Namespace) -> int:
    from fsdp_bridge.migrate.verify import RunFailed, verify

    command = args.script_command
    if not command:
        raise ConfigError(
            [
                Problem(
                    "SCRIPT",
                    None,
                    "the training script after --, relative to DIR (or a driver file)",
                    "e.g. fsdp-bridge migrate verify DIR -- train.py --steps 3",
                )
            ]
        )
    try:
        result = verify(
            args.dir,
            command[0],
            command[1:],
            nproc_per_node=args.nproc_per_node,
            migrated=args.migrated,
            seed=args.seed,
            rtol=args.rtol,
            atol=args.atol,
            timeout=args.timeout,
            target=args.target,
        )
    except RunFailed as err:
        print(f"fsdp-bridge migrate verify: {err}", file=sys.stderr)
        return 2
    if result.fix_report:
        print(result.fix_report)
    print(result.format())
    return 0 if result.parity else 1
