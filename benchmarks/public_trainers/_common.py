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
