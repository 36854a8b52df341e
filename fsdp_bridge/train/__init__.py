"""``fsdp-bridge train`` as a library: configuration, the training loop and the launcher.

    from fsdp_bridge.train import load_train_config, train
    config = load_train_config("examples/tiny_cpu.yaml", ["max_steps=20", "bridge.backend=fsdp1"])
    result = train(config)        # on every rank (torchrun), or in one process (world size 1)

The command line (``fsdp-bridge train CONFIG.yaml [key=value ...]``) validates the
config, then starts the ranks through PyTorch's elastic launcher (or runs inside an
existing torchrun/srun launch) and calls :func:`train` on each.
"""

from fsdp_bridge.train._config import (
    CheckpointConfig,
    DataConfig,
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

__all__ = [
    "CheckpointConfig",
    "DataConfig",
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
