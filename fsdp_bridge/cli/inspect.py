"""``fsdp-bridge inspect PATH [--json]``

Shows what a checkpoint holds without loading its tensors: its kind, the backend and
world size it was saved from, the step, the parameter count and dtypes, its size on
disk, the bridge config and the Hugging Face config.  A checkpoint that is incomplete,
truncated or corrupt is reported with the file at fault (exit code 2).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "inspect",
        help="describe a checkpoint (kind, backend, world size, step, sizes)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", help="a checkpoint directory or file, or the fsspec URL of an fsdp_bridge checkpoint")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_info(info: dict[str, Any]) -> str:
    params = info.get("params") or {}
    dtypes = ", ".join(f"{k} {v:,}" for k, v in sorted(params.get("dtypes", {}).items()))
    lines = [
        f"path:         {info['path']}",
        f"kind:         {info['kind']}",
        f"saved from:   backend {info.get('backend') or 'unknown'}, world size {info.get('world_size') or 'unknown'}",
        f"step:         {info.get('step') if info.get('step') is not None else 'unknown'}",
        f"parameters:   {params.get('numel', 0):,} in {params.get('tensors', 0)} tensors ({dtypes})",
        f"optimizer:    {'yes' if info.get('has_optimizer') else 'no'}",
        f"size on disk: {_human(info['size_bytes'])}",
    ]
    if info.get("model_class"):
        lines.append(f"model class:  {info['model_class']}")
    if info.get("hf_config"):
        lines.append(f"hf config:    {json.dumps(info['hf_config'])}")
    if info.get("bridge_config"):
        lines.append(f"bridge:       {json.dumps(info['bridge_config'])}")
    if info.get("converted_from"):
        lines.append(f"converted:    from {info['converted_from']['kind']} {info['converted_from']['path']}")
    if info.get("saved_at"):
        lines.append(f"saved at:     {info['saved_at']} (torch {info.get('torch_version')})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from fsdp_bridge.checkpoint._convert import inspect_checkpoint

    info = inspect_checkpoint(args.path)  # CheckpointError: printed by the command's handler, exit code 2
    print(json.dumps(info, indent=2, default=str) if args.json else format_info(info))
    return 0
