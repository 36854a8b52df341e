"""fsdp_bridge: one interface over PyTorch's two FSDP implementations.

    import fsdp_bridge
    config = fsdp_bridge.BridgeConfig(strategy="full_shard", backend="fsdp2")
    model = fsdp_bridge.shard(model, config)          # FSDP1 or FSDP2, same call
    optimizer = torch.optim.AdamW(model.parameters())

Run under ``torchrun --nproc-per-node 2 script.py`` (gloo on CPU, NCCL on GPUs).
"""

from fsdp_bridge._version import __version__
from fsdp_bridge.api import Bridge, clip_grad_norm_, get_bridge, no_sync, shard, summon_full_params
from fsdp_bridge.backends.fsdp1_objects import state_dict_options
from fsdp_bridge.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    load_pretrained,
    rotate_checkpoints,
    save_checkpoint,
    save_checkpoint_async,
)
from fsdp_bridge.config import BridgeConfig, MixedPrecisionConfig, WrapPolicy, load_config
from fsdp_bridge.distributed import init_distributed
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.mapping import Outcome, TranslationReport, translate
from fsdp_bridge.strategy import Backend, BackwardPrefetch, ShardingStrategy

__all__ = [
    "Backend",
    "BackwardPrefetch",
    "Bridge",
    "BridgeConfig",
    "CheckpointError",
    "ConfigError",
    "MixedPrecisionConfig",
    "Outcome",
    "Problem",
    "ShardingStrategy",
    "TranslationReport",
    "WrapPolicy",
    "__version__",
    "clip_grad_norm_",
    "get_bridge",
    "init_distributed",
    "latest_checkpoint",
    "load_checkpoint",
    "load_config",
    "load_pretrained",
    "no_sync",
    "rotate_checkpoints",
    "save_checkpoint",
    "save_checkpoint_async",
    "shard",
    "state_dict_options",
    "summon_full_params",
    "translate",
]
