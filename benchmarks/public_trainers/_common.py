"""What the drivers in this folder share: the package's sample text, stubs for unused imports, and FSDP1's full
state dict without its CPU offload.

The drivers run with this folder on ``sys.path`` (``fsdp-bridge migrate verify`` puts the driver's
directory there), so they import this module by its name.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from importlib.resources import files
from typing import Any


def sample_words() -> list[str]:
    """The words of the sample text shipped in ``fsdp_bridge/data``."""
    return files("fsdp_bridge").joinpath("data/sample_corpus.txt").read_text().split()


def stub_missing(stubs: dict[str, dict[str, Any]]) -> None:
    """A module with ``attrs`` for each name in ``stubs`` that is not installed (imported by a trainer for
    what the run does not use). Each has a spec: libraries that probe for a module (transformers) need one."""
    for name, attrs in stubs.items():
        try:
            __import__(name)
        except ImportError:
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            module.__dict__.update(attrs)
            sys.modules[name] = module


def full_state_dicts_without_offload() -> None:
    """``FSDP.state_dict_type`` given ``FullStateDictConfig(offload_to_cpu=True, ...)`` takes it without the
    offload, which means nothing on the CPU: with the shards there, FSDP1's ``FlatParamHandle.to_cpu()`` "moves"
    the gathered flat parameter to where it already is and frees that storage, which the state dict's views
    still point to (pytorch/pytorch issue 188989: a segmentation fault on rank 0). Only FSDP1 code calls it."""
    from torch.distributed.fsdp import FullStateDictConfig
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    state_dict_type = FSDP.state_dict_type

    def on_the_cpu_already(module: Any, kind: Any, state_dict_config: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(state_dict_config, FullStateDictConfig) and state_dict_config.offload_to_cpu:
            state_dict_config = FullStateDictConfig(offload_to_cpu=False, rank0_only=state_dict_config.rank0_only)
        return state_dict_type(module, kind, state_dict_config, *args, **kwargs)

    FSDP.state_dict_type = staticmethod(on_the_cpu_already)  # type: ignore[assignment]


def full_optim_state_dicts_without_offload() -> None:
    """``FSDP.optim_state_dict`` under a full type whose optimizer config offloads to the CPU (FSDP1's default
    ``FullOptimStateDictConfig()`` included) takes it without the offload, which means nothing on the CPU: with
    ``use_orig_params=True`` and the shards on the CPU, FSDP1's "offloaded" copy of ``exp_avg`` is read after its
    storage is reused, and the saved ``exp_avg`` values are wrong (``exp_avg_sq`` and the weights right; 2 gloo
    ranks, AdamW, torch 2.13: up to 0.7 apart from a single-process reference, exact without the offload). Only
    FSDP1 code calls it."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    optim_state_dict = FSDP.optim_state_dict

    def on_the_cpu_already(model: Any, optim: Any, *args: Any, **kwargs: Any) -> Any:
        settings = FSDP.get_state_dict_type(model)
        config = settings.optim_state_dict_config
        if settings.state_dict_type != StateDictType.FULL_STATE_DICT or not config.offload_to_cpu:
            return optim_state_dict(model, optim, *args, **kwargs)
        kept = FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=getattr(config, "rank0_only", False))
        FSDP.set_state_dict_type(model, settings.state_dict_type, settings.state_dict_config, kept)
        try:
            return optim_state_dict(model, optim, *args, **kwargs)
        finally:
            FSDP.set_state_dict_type(model, settings.state_dict_type, settings.state_dict_config, config)

    FSDP.optim_state_dict = staticmethod(on_the_cpu_already)  # type: ignore[assignment]
