"""The hyperparameters and parameter names of saved optimizer groups, checked before loading.

torch's ``load_state_dict`` copies every value of a saved group into the optimizer as it is:
``lr: "fast"`` or ``betas: [2, 3, 4]`` from a damaged ``optimizer.json`` would load and only
fail inside ``optimizer.step()``, and a group whose ``params`` name no parameter of the model
would load "successfully" while restoring nothing.  Each saved value is checked against the
kind of value the optimizer holds under the same key (a number for a number, a pair for a
pair, a bool for a bool), with the ranges every torch optimizer requires of the common keys.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import torch

__all__ = ["group_problems"]

# Common keys whose values torch's optimizers require to be >= 0 (betas: each in [0, 1)).
_NON_NEGATIVE = ("lr", "eps", "weight_decay", "momentum", "dampening", "lr_decay", "initial_accumulator_value")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _value_problem(key: str, saved: Any, ours: Any) -> str | None:
    """Why ``saved`` cannot stand where the optimizer holds ``ours`` (None when it can)."""
    if isinstance(ours, bool):
        return None if isinstance(saved, bool) else "a bool (true or false)"
    if isinstance(ours, (int, float)) or (isinstance(ours, torch.Tensor) and ours.numel() == 1):
        if isinstance(saved, torch.Tensor) and saved.numel() == 1 and not saved.dtype.is_complex:
            saved = saved.item()  # an lr (or beta) kept as a tensor is saved as one
        if not _is_number(saved):
            return "a finite number"
        if key in _NON_NEGATIVE and saved < 0:
            return "a number >= 0"
        return None
    if isinstance(ours, (tuple, list)):
        if not isinstance(saved, (tuple, list)) or len(saved) != len(ours):
            return f"a list of {len(ours)} value(s) like {list(ours)!r}"
        for s, o in zip(saved, ours, strict=True):
            if _value_problem(key, s, o) is not None:
                return f"a list of {len(ours)} value(s) like {list(ours)!r}"
        if key == "betas" and not all(0 <= b < 1 for b in saved):
            return "a list of values each in [0, 1)"
        return None
    if isinstance(ours, str):
        return None if isinstance(saved, str) else "a string"
    if ours is None:  # e.g. foreach/fused: None, a bool or a number may have been saved
        return None if saved is None or isinstance(saved, (bool, int, float, str)) else "null, a bool or a number"
    return None  # a value of a kind this check does not know: torch's own checks decide


def group_problems(
    saved_groups: Sequence[Any], optimizer: torch.optim.Optimizer, names: Collection[str] | None = None
) -> list[str]:
    """What is wrong with the saved ``param_groups`` for ``optimizer``: hyperparameters of the
    wrong kind or range (naming the group, key and value), and ``params`` naming no parameter
    of the model (``names``: the model's parameter names; positional int ids are not checked)."""
    problems: list[str] = []
    for i, (saved, ours) in enumerate(zip(saved_groups, optimizer.param_groups, strict=False)):
        if not isinstance(saved, dict):
            problems.append(f"param_groups[{i}]: got {saved!r:.60}, expected a mapping of hyperparameters")
            continue
        for key, value in saved.items():
            if key == "params" or key not in ours:
                continue
            expected = _value_problem(key, value, ours[key])
            if expected is not None:
                problems.append(f"param_groups[{i}].{key}: got {value!r:.60}, expected {expected}")
        params = saved.get("params")
        if names is not None and isinstance(params, list):
            unknown = [p for p in params if isinstance(p, str) and p not in names]
            if unknown:
                problems.append(
                    f"param_groups[{i}].params: {len(unknown)} name(s) that are no parameter of the model "
                    f"({', '.join(repr(u) for u in unknown[:3])}{', ...' if len(unknown) > 3 else ''}); "
                    "its state would restore nothing"
                )
    return problems
