"""The ``fsdp-bridge`` command.

Each subcommand lives in its own module exposing ``register(subparsers)``, which adds
its parser and sets ``func`` (``args -> exit code``).  ``_COMMANDS`` is the registry.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from fsdp_bridge._version import __version__
from fsdp_bridge.errors import CheckpointError, ConfigError

__all__ = ["main"]

_COMMANDS: tuple[str, ...] = ("explain", "train", "compare", "migrate", "convert", "inspect", "estimate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-bridge",
        description="Train with PyTorch FSDP through one interface over FSDP1 and FSDP2.",
    )
    parser.add_argument("--version", action="version", version=f"fsdp-bridge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(f"fsdp_bridge.cli.{name}").register(sub)
    _plain_help(parser)
    return parser


def _plain_help(parser: argparse.ArgumentParser) -> None:
    """Help for a terminal: module docstrings are reST (``code``); print code without the
    backticks, and give a subcommand with no description its one-line help."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, child in action.choices.items():
                if not child.description and helps.get(name):
                    child.description = helps[name]
                _plain_help(child)
    if parser.description:
        parser.description = parser.description.replace("``", "`")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``fsdp-bridge`` command.

    Args:
        argv: the arguments after the program name; None reads ``sys.argv``.

    Returns:
        The exit code: the command's (0 on success), 2 for a usage error, a ``ConfigError`` or
        ``CheckpointError`` (its message printed to stderr) or a failed file access.
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" is another program's command line (migrate verify's SCRIPT ARGS...).
    tail = None
    if "--" in argv:
        argv, tail = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    # Subcommands that take key=value items (train) accept them between options too.
    args, extra = parser.parse_known_args(argv)
    if tail is not None:
        if not hasattr(args, "script_command"):
            parser.error(f"unrecognized arguments: -- {' '.join(tail)}")
        args.script_command = tail
    if extra:
        if not hasattr(args, "items") or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.items = [*args.items, *extra]
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return int(args.func(args) or 0)
    except (ConfigError, CheckpointError) as err:
        print(f"fsdp-bridge {args.command}: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the environment refused a read or write the checks above could not foresee
        where = f" {err.filename}" if err.filename else ""
        print(
            f"fsdp-bridge {args.command}: cannot access{where}: {err.strerror or err}; check that the path "
            "exists, is the kind of file expected and is readable (or writable, for outputs)",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
