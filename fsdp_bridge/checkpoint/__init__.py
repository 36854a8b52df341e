"""Checkpoints that behave the same on FSDP1 and FSDP2, at any world size.

    fsdp_bridge.save_checkpoint("ckpt/step_100", model, optimizer, kind="sharded", state={"step": 100})
    state = fsdp_bridge.load_checkpoint("ckpt/step_100", model, optimizer)
    fsdp_bridge.save_checkpoint("export", model, kind="full")     # a Hugging Face directory

See docs/checkpoints.md for the formats and guarantees, and ``fsdp-bridge convert`` /
``fsdp-bridge inspect`` for offline work.
"""

from fsdp_bridge.checkpoint._async import AsyncCheckpoint, AsyncCheckpointer, checkpointer_of, save_checkpoint_async
from fsdp_bridge.checkpoint._convert import convert_checkpoint, inspect_checkpoint
from fsdp_bridge.checkpoint._formats import CheckpointError, Kind, detect
from fsdp_bridge.checkpoint._load import load_checkpoint
from fsdp_bridge.checkpoint._model_state import full_state_options
from fsdp_bridge.checkpoint._pretrained import load_pretrained, pretrained_fits
from fsdp_bridge.checkpoint._remote import latest_checkpoint, list_checkpoints, rotate_checkpoints
from fsdp_bridge.checkpoint._save import save_checkpoint

__all__ = [
    "AsyncCheckpoint",
    "AsyncCheckpointer",
    "CheckpointError",
    "Kind",
    "checkpointer_of",
    "convert_checkpoint",
    "detect",
    "full_state_options",
    "inspect_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_pretrained",
    "pretrained_fits",
    "rotate_checkpoints",
    "save_checkpoint",
    "save_checkpoint_async",
]
