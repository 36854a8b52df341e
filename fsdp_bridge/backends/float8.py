"""torchao float8 training on FSDP2: the checks before sharding and the conversion of the units' layers.

torchao is optional (the ``float8`` extra): it is imported only when a config asks for float8 on a GPU.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from fsdp_bridge.errors import Problem

__all__ = ["convert_to_float8", "float8_problems"]

_MIN_CAPABILITY = (8, 9)  # float8 matmuls (torch._scaled_mm): Ada, Hopper and newer


def float8_problems(recipe: str | None, device: torch.device) -> list[Problem]:
    """What stops float8 training on this rank's GPU: torchao missing, or a GPU without float8 matmuls.

    Args:
        recipe: the config's ``float8`` (None: off, nothing to check).
        device: this rank's device (CPU is refused by the table's row already).

    Returns:
        The problems, empty when float8 can run.
    """
    if recipe is None or device.type != "cuda":
        return []
    problems = []
    if importlib.util.find_spec("torchao") is None:
        problems.append(
            Problem(
                "float8", recipe, "torchao installed", "pip install 'fsdp-bridge[float8]' (torchao), or remove float8"
            )
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < _MIN_CAPABILITY:
        problems.append(
            Problem(
                "float8",
                recipe,
                "a GPU of compute capability 8.9+ (Ada, Hopper or newer)",
                f"this GPU has {capability[0]}.{capability[1]}, without float8 matmuls: remove float8",
            )
        )
    return problems


def convert_to_float8(model: nn.Module, recipe: str, units: list[nn.Module]) -> None:
    """Swap the ``nn.Linear`` layers inside the units for torchao's float8 layers, before sharding.

    The units themselves and the root's own layers (e.g. ``lm_head``) stay as they are, as do layers whose
    dimensions are not multiples of 16 (float8 matmuls need them). ``tensorwise`` all-gathers the weights in
    float8 (``enable_fsdp_float8_all_gather``); ``rowwise`` takes torchao's recipe of that name.

    Args:
        model: the model about to be sharded.
        recipe: ``tensorwise`` or ``rowwise``.
        units: the wrap units.
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    unit_ids = {id(u) for u in units}
    inside = {id(m) for u in units for m in u.modules()} - unit_ids

    def wanted(module: nn.Module, fqn: str) -> bool:
        return (
            isinstance(module, nn.Linear)
            and id(module) in inside
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )

    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=wanted)
