"""Hugging Face transformers integration: wrap units, KV cache, tied embeddings.

Nothing here imports transformers at module import time: the bridge shards any
``nn.Module``; these helpers only recognise what a ``PreTrainedModel`` carries.
"""

from __future__ import annotations

from torch import nn

# Defined with the wrap units (the core reads these conventions of a model's own attributes without knowing
# transformers); exported here with the rest of the Hugging Face helpers.
from fsdp_bridge.wrap import disable_kv_cache, no_split_module_classes

__all__ = ["disable_kv_cache", "is_hf_model", "no_split_module_classes", "tied_parameter_names"]


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (checked without importing transformers).

    Args:
        model: any module.

    Returns:
        True when a class named ``PreTrainedModel`` is among its bases.
    """
    return any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)


def tied_parameter_names(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (e.g. embed_tokens and lm_head).

    Args:
        model: any module.

    Returns:
        One list of names per shared parameter, in ``named_parameters`` order; empty when none is tied.
    """
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]
