"""``fsdp-bridge explain CONFIG.yaml [--backend fsdp1|fsdp2|both] [--device cpu|cuda] [--json]``

Prints what every option of a config becomes on each backend: applied natively,
emulated (how), not needed (why) or unsupported (why, and what to use instead).
Exit code 0 when the config's own backend supports every option, 2 otherwise.
"""

from __future__ import annotations

import argparse
import json

from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.strategy import Backend, allowed_values, parse_enum


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "explain",
        help="show what each config option becomes on FSDP1 and FSDP2",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="a bridge YAML (or a training YAML with a bridge: section)")
    p.add_argument("--backend", default="both", help="fsdp1, fsdp2 or both (default)")
    p.add_argument(
        "--device",
        default=None,
        choices=["cpu", "cuda"],
        help="show device-dependent outcomes (e.g. cpu_offload) for this device",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _backends(value: str) -> list[Backend]:
    if value.strip().lower() == "both":
        return list(Backend)
    try:
        return [parse_enum(Backend, value)]
    except ValueError:
        raise ConfigError(
            [
                Problem(
                    "--backend",
                    value,
                    f"{allowed_values(Backend)} or both",
                    "e.g. --backend fsdp2, or leave it out to show both",
                )
            ]
        ) from None


def run(args: argparse.Namespace) -> int:
    backends = _backends(args.backend)  # before reading the config: a typo costs nothing
    from fsdp_bridge.config import load_config
    from fsdp_bridge.mapping import translate

    config = load_config(args.config)
    reports = [translate(config, b, device_type=args.device) for b in backends]
    if args.json:
        print(json.dumps({"config": config.to_dict(), "reports": [r.to_dict() for r in reports]}, indent=2))
    else:
        print(f"{args.config}: strategy {config.strategy.value}, configured backend {config.backend.value}\n")
        for report in reports:
            print(report.format())
            for entry in report.unsupported:
                print(f"  ! {entry.option} is refused on {report.backend.value}: {entry.text}")
            print()
    return 0
