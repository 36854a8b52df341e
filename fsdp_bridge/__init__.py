"""fsdp_bridge: one interface over PyTorch's two FSDP implementations.

    import fsdp_bridge
    config = fsdp_bridge.BridgeConfig(strategy="full_shard", backend="fsdp2")
    model = fsdp_bridge.shard(model, config)          # FSDP1 or FSDP2, same call
    optimizer = torch.optim.AdamW(model.parameters())

Run under ``torchrun --nproc-per-node 2 script.py`` (gloo on CPU, NCCL on GPUs).

The names below are loaded on first use (PEP 562), so ``import fsdp_bridge`` costs
about what ``import torch`` does and ``fsdp-bridge --help`` starts without torch;
type checkers and IDEs see the real definitions through the ``TYPE_CHECKING`` imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from fsdp_bridge._version import __version__

if TYPE_CHECKING:
    from fsdp_bridge._ema import ema_update_
    from fsdp_bridge._fsdp1_settings import FSDP1Settings, fsdp1_settings
    from fsdp_bridge._manual_wrap import ManualWrap, enable_wrap, wrap_module
    from fsdp_bridge._shard_storage import free_shards, move_shards
    from fsdp_bridge._sharded_module import ShardedModule
    from fsdp_bridge.api import (
        Bridge,
        bridge_of,
        clip_grad_norm_,
        defer_all_reduce,
        get_bridge,
        is_sharded,
        no_sync,
        reshard,
        save_pretrained,
        shard,
        summon_full_params,
        unwrapped,
    )
    from fsdp_bridge.backends.fsdp1_objects import (
        full_optim_state_dict,
        full_state_dict,
        load_sharded_optimizer_state_dict,
        optim_state_dict,
        optim_state_dict_to_load,
        set_state_dict_type,
        state_dict_options,
        state_dict_type,
    )
    from fsdp_bridge.checkpoint import (
        latest_checkpoint,
        load_checkpoint,
        load_pretrained,
        rotate_checkpoints,
        save_checkpoint,
        save_checkpoint_async,
    )
    from fsdp_bridge.config import BridgeConfig, CompileConfig, MixedPrecisionConfig, WrapPolicy, load_config
    from fsdp_bridge.distributed import init_distributed, mesh_from_process_group
    from fsdp_bridge.errors import CheckpointError, ConfigError, Problem
    from fsdp_bridge.mapping import Outcome, TranslationReport, translate
    from fsdp_bridge.scaler import GradScaler
    from fsdp_bridge.strategy import Backend, BackwardPrefetch, ShardingStrategy
    from fsdp_bridge.wrap import module_names

# Public name -> the module that defines it.  Kept in step with the TYPE_CHECKING imports
# above and with ``__all__`` by tests/test_imports.py.
_EXPORTS: dict[str, str] = {
    "Backend": "fsdp_bridge.strategy",
    "BackwardPrefetch": "fsdp_bridge.strategy",
    "Bridge": "fsdp_bridge.api",
    "BridgeConfig": "fsdp_bridge.config",
    "CheckpointError": "fsdp_bridge.errors",
    "CompileConfig": "fsdp_bridge.config",
    "ConfigError": "fsdp_bridge.errors",
    "GradScaler": "fsdp_bridge.scaler",
    "ManualWrap": "fsdp_bridge._manual_wrap",
    "MixedPrecisionConfig": "fsdp_bridge.config",
    "Outcome": "fsdp_bridge.mapping",
    "Problem": "fsdp_bridge.errors",
    "ShardedModule": "fsdp_bridge._sharded_module",
    "ShardingStrategy": "fsdp_bridge.strategy",
    "TranslationReport": "fsdp_bridge.mapping",
    "WrapPolicy": "fsdp_bridge.config",
    "clip_grad_norm_": "fsdp_bridge.api",
    "defer_all_reduce": "fsdp_bridge.api",
    "ema_update_": "fsdp_bridge._ema",
    "enable_wrap": "fsdp_bridge._manual_wrap",
    "bridge_of": "fsdp_bridge.api",
    "get_bridge": "fsdp_bridge.api",
    "fsdp1_settings": "fsdp_bridge._fsdp1_settings",
    "free_shards": "fsdp_bridge._shard_storage",
    "FSDP1Settings": "fsdp_bridge._fsdp1_settings",
    "is_sharded": "fsdp_bridge.api",
    "full_optim_state_dict": "fsdp_bridge.backends.fsdp1_objects",
    "full_state_dict": "fsdp_bridge.backends.fsdp1_objects",
    "init_distributed": "fsdp_bridge.distributed",
    "latest_checkpoint": "fsdp_bridge.checkpoint",
    "load_checkpoint": "fsdp_bridge.checkpoint",
    "load_config": "fsdp_bridge.config",
    "load_pretrained": "fsdp_bridge.checkpoint",
    "load_sharded_optimizer_state_dict": "fsdp_bridge.backends.fsdp1_objects",
    "mesh_from_process_group": "fsdp_bridge.distributed",
    "move_shards": "fsdp_bridge._shard_storage",
    "module_names": "fsdp_bridge.wrap",
    "no_sync": "fsdp_bridge.api",
    "optim_state_dict": "fsdp_bridge.backends.fsdp1_objects",
    "optim_state_dict_to_load": "fsdp_bridge.backends.fsdp1_objects",
    "rotate_checkpoints": "fsdp_bridge.checkpoint",
    "save_checkpoint": "fsdp_bridge.checkpoint",
    "save_pretrained": "fsdp_bridge.api",
    "save_checkpoint_async": "fsdp_bridge.checkpoint",
    "set_state_dict_type": "fsdp_bridge.backends.fsdp1_objects",
    "shard": "fsdp_bridge.api",
    "state_dict_options": "fsdp_bridge.backends.fsdp1_objects",
    "state_dict_type": "fsdp_bridge.backends.fsdp1_objects",
    "reshard": "fsdp_bridge.api",
    "summon_full_params": "fsdp_bridge.api",
    "unwrapped": "fsdp_bridge.api",
    "translate": "fsdp_bridge.mapping",
    "wrap_module": "fsdp_bridge._manual_wrap",
}

__all__ = [
    "Backend",
    "BackwardPrefetch",
    "Bridge",
    "BridgeConfig",
    "CheckpointError",
    "CompileConfig",
    "ConfigError",
    "FSDP1Settings",
    "GradScaler",
    "ManualWrap",
    "MixedPrecisionConfig",
    "Outcome",
    "Problem",
    "ShardedModule",
    "ShardingStrategy",
    "TranslationReport",
    "WrapPolicy",
    "__version__",
    "bridge_of",
    "clip_grad_norm_",
    "defer_all_reduce",
    "ema_update_",
    "enable_wrap",
    "free_shards",
    "fsdp1_settings",
    "full_optim_state_dict",
    "full_state_dict",
    "get_bridge",
    "init_distributed",
    "is_sharded",
    "latest_checkpoint",
    "load_checkpoint",
    "load_config",
    "load_pretrained",
    "load_sharded_optimizer_state_dict",
    "mesh_from_process_group",
    "module_names",
    "move_shards",
    "no_sync",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "reshard",
    "rotate_checkpoints",
    "save_checkpoint",
    "save_checkpoint_async",
    "save_pretrained",
    "set_state_dict_type",
    "shard",
    "state_dict_options",
    "state_dict_type",
    "summon_full_params",
    "translate",
    "unwrapped",
    "wrap_module",
]


# Hidden from type checkers: with a visible module ``__getattr__``, mypy would accept any
# misspelt ``fsdp_bridge.<name>``; the TYPE_CHECKING imports above give it the real ones.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'fsdp_bridge' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups skip this function
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
