"""``fsdp-bridge train`` as a library: configuration, the training loop and the launcher.

    from fsdp_bridge.train import load_train_config, train
    config = load_train_config("examples/tiny_cpu.yaml", ["max_steps=20", "bridge.backend=fsdp1"])
    result = train(config)        # on every rank (torchrun), or in one process (world size 1)
    train(config, on_metrics=lambda step, metrics: print(step, metrics["train/loss"]))  # every step, every rank

The command line (``fsdp-bridge train CONFIG.yaml [key=value ...]``) validates the
config, then starts the ranks through PyTorch's elastic launcher (or runs inside an
existing torchrun/srun launch) and calls :func:`train` on each.

The names below are loaded on first use (PEP 562), as in ``fsdp_bridge`` itself: reading and
checking a config (``load_train_config``) loads no torch, so ``fsdp-bridge train`` reports a bad
config before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdp_bridge.train._config import (
        CheckpointConfig,
        DataConfig,
        LoggingConfig,
        ModelConfig,
        OptimConfig,
        PeftConfig,
        ScheduleConfig,
        TrainConfig,
        apply_overrides,
        default_config_path,
        field_reference,
        load_train_config,
    )
    from fsdp_bridge.train._loop import TrainResult, lr_at, train
    from fsdp_bridge.train._preflight import preflight

# Public name -> the module that defines it; kept in step with the TYPE_CHECKING imports above by
# tests/test_imports.py.
_EXPORTS: dict[str, str] = {
    "CheckpointConfig": "fsdp_bridge.train._config",
    "DataConfig": "fsdp_bridge.train._config",
    "LoggingConfig": "fsdp_bridge.train._config",
    "ModelConfig": "fsdp_bridge.train._config",
    "OptimConfig": "fsdp_bridge.train._config",
    "PeftConfig": "fsdp_bridge.train._config",
    "ScheduleConfig": "fsdp_bridge.train._config",
    "TrainConfig": "fsdp_bridge.train._config",
    "TrainResult": "fsdp_bridge.train._loop",
    "apply_overrides": "fsdp_bridge.train._config",
    "default_config_path": "fsdp_bridge.train._config",
    "field_reference": "fsdp_bridge.train._config",
    "load_train_config": "fsdp_bridge.train._config",
    "lr_at": "fsdp_bridge.train._loop",
    "preflight": "fsdp_bridge.train._preflight",
    "train": "fsdp_bridge.train._loop",
}

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "PeftConfig",
    "ScheduleConfig",
    "TrainConfig",
    "TrainResult",
    "apply_overrides",
    "default_config_path",
    "field_reference",
    "load_train_config",
    "lr_at",
    "preflight",
    "train",
]


# Hidden from type checkers, as in fsdp_bridge/__init__.py: the TYPE_CHECKING imports give them the real names.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'fsdp_bridge.train' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups skip this function
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
