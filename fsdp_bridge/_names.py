"""Original parameter names under the wrappers FSDP1, activation checkpointing and torch.compile
insert (``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``, ``_orig_mod.``): one rule for
the backends, checkpoints and compare."""

from __future__ import annotations

__all__ = ["WRAPPER_PREFIXES", "strip_wrapper_prefixes"]

WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def strip_wrapper_prefixes(key: str) -> str:
    """``model._fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.w`` -> ``model.layers.0.w``."""
    for prefix in WRAPPER_PREFIXES:
        key = key.replace(prefix, "")
    return key
