"""Hugging Face transformers integration: wrap units, KV cache, tied embeddings.

Nothing here imports transformers at module import time: the bridge shards any
``nn.Module``; these helpers only recognise what a ``PreTrainedModel`` carries.
"""

from __future__ import annotations

from torch import nn

__all__ = ["disable_kv_cache", "is_hf_model", "no_split_module_classes", "tied_parameter_names"]


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (checked without importing transformers).

    Args:
        model: any module.

    Returns:
        True when a class named ``PreTrainedModel`` is among its bases.
    """
    return any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)


def no_split_module_classes(model: nn.Module) -> list[str]:
    """The classes a Hugging Face model asks never to split, which ``wrap: auto`` makes units.

    Args:
        model: any module.

    Returns:
        The ``_no_split_modules`` class names of the model or of its first submodule that has
        them, without repeats; empty when none does.
    """
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if names:
            return list(dict.fromkeys(names))
    return []


def disable_kv_cache(model: nn.Module) -> bool:
    """Turn off the KV cache (activation checkpointing recomputes layers, and a cache
    filled twice would change shapes).

    Args:
        model: any module; every submodule whose ``config.use_cache`` is true gets it set to False.

    Returns:
        Whether anything was changed.
    """
    changed = False
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", False):
            config.use_cache = False
            changed = True
    return changed


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
