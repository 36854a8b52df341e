"""``fsdp-bridge convert SRC DST --to hf|sharded|torch [--hf-config PATH] [--max-shard-size 5GB]``

Converts a checkpoint of any kind fsdp_bridge reads (an fsdp_bridge sharded or full
checkpoint, a plain DCP directory, a Hugging Face directory, a torch.save file) into:

  hf       a Hugging Face model directory (config.json + safetensors) for from_pretrained
  sharded  an fsdp_bridge sharded DCP directory, loadable at any world size and backend
  torch    one torch.save file of the model state dict (model.load_state_dict(torch.load(...)))

Runs in one process, without a process group; the whole model is held in memory once.
DST is written through a temporary sibling and renamed into place when complete.
"""

from __future__ import annotations

import argparse

# fsdp_bridge.checkpoint._convert.TARGETS, copied so that `--help` does not import torch
# (tests/test_imports.py checks the two agree).
TARGETS: tuple[str, ...] = ("hf", "sharded", "torch")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "convert",
        help="convert a checkpoint between sharded, Hugging Face and torch formats",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", help="the checkpoint to read (directory, file, or fsspec URL of an fsdp_bridge checkpoint)")
    p.add_argument("dst", help="where to write (a directory or URL for hf/sharded, a file for torch)")
    p.add_argument("--to", required=True, choices=TARGETS, help="the kind to write")
    p.add_argument(
        "--hf-config",
        default=None,
        help="config.json (or a directory holding one) to write beside hf weights when SRC has none; "
        "a directory's safetensors index also gives --to hf its file layout (the original model's files)",
    )
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file for --to hf (default 5GB)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fsdp_bridge.checkpoint._convert import convert_checkpoint
    from fsdp_bridge.errors import CheckpointError, ConfigError

    try:
        dst = convert_checkpoint(
            args.src, args.dst, to=args.to, hf_config=args.hf_config, max_shard_size=args.max_shard_size
        )
    except (CheckpointError, ConfigError):
        raise  # printed by the command's one error handler (exit code 2)
    except ValueError as err:  # e.g. an unreadable --max-shard-size, refused by huggingface_hub
        raise ConfigError(str(err)) from None
    print(f"wrote {args.to} checkpoint {dst}")
    return 0
