"""Checks that need the file system or the world size, run before any process is started."""

from __future__ import annotations

from pathlib import Path

from fsdp_bridge.distributed import plan_mesh
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.mapping import unsupported_problems
from fsdp_bridge.train._config import TrainConfig
from fsdp_bridge.train._data import resolve_files

__all__ = ["preflight"]


def preflight(config: TrainConfig, *, world_size: int | None = None, local_world_size: int | None = None,
              device_type: str | None = None) -> list[str]:
    """Raise ConfigError for what would fail once the ranks run; return notes for the user.

    Checks the data files exist, the model directory exists, a fresh run does not
    write over another run's checkpoints, and (given the world size) that the
    strategy's mesh fits it and the backend supports every option on ``device_type``.
    """
    from fsdp_bridge.train._ckpt import latest_checkpoint

    problems: list[Problem] = []
    try:
        resolve_files(config.data)
    except ConfigError as err:
        problems.extend(err.problems)
    for key, value in (("model.path", config.model.path), ("model.tokenizer", config.model.tokenizer)):
        if value is not None and not Path(value).is_dir():
            problems.append(Problem(key, value, "an existing Hugging Face directory",
                                    "download or save the model there first (save_pretrained)"))
    root = Path(config.output_dir) / "checkpoints"
    existing = latest_checkpoint(root)
    if config.resume is False and existing is not None:
        problems.append(Problem("resume", False, "auto (or --resume) when output_dir holds checkpoints",
                                f"{root} already holds {existing.name}: pass --resume to continue it, or choose "
                                "another output_dir"))
    notes: list[str] = []
    if world_size is not None:
        try:
            mesh = plan_mesh(config.bridge, world_size, local_world_size=local_world_size)
            notes.append(f"mesh {mesh.shape} ({', '.join(mesh.dim_names)}) for {world_size} ranks")
        except ConfigError as err:
            problems.extend(err.problems)
    if device_type is not None:
        problems.extend(unsupported_problems(config.bridge, config.bridge.backend, device_type=device_type))
    if problems:
        raise ConfigError(problems)
    return notes
