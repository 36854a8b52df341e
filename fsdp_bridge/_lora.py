"""LoRA from a config section (``peft:``), and the check that refuses 4-bit bases on CPU.

    peft:
      r: 8                              # rank of the low-rank update
      alpha: 16                         # scaling: alpha / r
      dropout: 0.0
      target_modules: [q_proj, v_proj]  # null: peft's default for the model type; all-linear: every Linear
      modules_to_save: []               # modules trained in full and saved with the adapter

The same section is read by ``fsdp-bridge train`` and ``fsdp-bridge compare``; the model is
wrapped with ``peft.get_peft_model`` before :func:`fsdp_bridge.shard`, so only the adapters
(and ``modules_to_save``) are trainable and hold optimizer state.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdp_bridge.errors import ConfigError, Problem

if TYPE_CHECKING:  # torch is imported by the functions that need it: the config parser stays light
    from torch import nn

__all__ = ["PEFT_INSTALL", "PeftConfig", "apply_lora", "is_4bit", "peft_problems", "quantization_problems"]

PEFT_INSTALL = "pip install peft (or pip install 'fsdp-bridge[peft]')"
ALL_LINEAR = "all-linear"
"""peft's spelling for "every Linear layer but the output head"."""


@dataclass(frozen=True, kw_only=True)
class PeftConfig:
    """LoRA adapters trained on a frozen base (``peft.LoraConfig``); needs the ``peft`` package."""

    r: int = 8
    """Rank of the low-rank update of each target module."""
    alpha: float = 16.0
    """LoRA alpha: the update is scaled by ``alpha / r``."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1)."""
    target_modules: tuple[str, ...] | None = None
    """Names (or name suffixes) of the modules to adapt, e.g. ``[q_proj, v_proj]``; ``all-linear``: every Linear
    layer except the output head; null: peft's default for the model type."""
    modules_to_save: tuple[str, ...] = ()
    """Modules trained in full (not adapted) and saved with the adapter, e.g. ``[lm_head]``."""

    def lora_config(self) -> Any:
        """The ``peft.LoraConfig`` of this section (a causal language model task)."""
        from peft import LoraConfig

        targets: str | list[str] | None = None
        if self.target_modules is not None:
            targets = ALL_LINEAR if self.target_modules == (ALL_LINEAR,) else list(self.target_modules)
        alpha: float | int = int(self.alpha) if float(self.alpha).is_integer() else self.alpha
        # peft annotates lora_alpha as int but only divides by it: a fractional alpha works and round-trips.
        return LoraConfig(
            task_type="CAUSAL_LM",
            r=self.r,
            lora_alpha=alpha,  # type: ignore[arg-type]
            lora_dropout=self.dropout,
            target_modules=targets,
            modules_to_save=list(self.modules_to_save) or None,
        )


def peft_available() -> bool:
    return importlib.util.find_spec("peft") is not None


def peft_problems(section: PeftConfig, key: str = "peft") -> list[Problem]:
    """Every problem with the values of a ``peft:`` section (types are checked by the parser)."""
    p: list[Problem] = []
    if not peft_available():
        p.append(Problem(key, "(section given)", "the peft package installed", PEFT_INSTALL))
    if section.r < 1:
        p.append(Problem(f"{key}.r", section.r, "an integer >= 1", "e.g. r: 8 (common ranks: 4 to 64)"))
    if not (section.alpha > 0 and math.isfinite(section.alpha)):
        p.append(Problem(f"{key}.alpha", section.alpha, "a finite number > 0", "e.g. alpha: 16 (often 2 * r)"))
    if not 0 <= section.dropout < 1:
        p.append(Problem(f"{key}.dropout", section.dropout, "a number in [0, 1)", "e.g. dropout: 0.05"))
    lists = (("target_modules", section.target_modules or ()), ("modules_to_save", section.modules_to_save))
    for name, values in lists:
        if any(not v.strip() for v in values):
            p.append(
                Problem(
                    f"{key}.{name}", list(values), "a list of module names (non-empty strings)", "e.g. [q_proj, v_proj]"
                )
            )
    if section.target_modules == ():
        p.append(
            Problem(
                f"{key}.target_modules",
                [],
                "null (peft's default for the model), all-linear, or a non-empty list of module names",
                "e.g. target_modules: [q_proj, v_proj]",
            )
        )
    return p


def apply_lora(model: nn.Module, section: PeftConfig, *, key: str = "peft") -> nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` (base frozen, adapters trainable).

    Raises:
        ConfigError: peft is not installed, or it cannot adapt this model with these settings
            (e.g. no module matches ``target_modules``): names the modules that could be.
    """
    if not peft_available():
        raise ConfigError([Problem(key, "(section given)", "the peft package installed", PEFT_INSTALL)])
    from peft import get_peft_model
    from torch import nn

    try:
        return get_peft_model(model, section.lora_config())  # type: ignore[arg-type, no-any-return]
    except ValueError as err:
        linear = sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        value = list(section.target_modules) if section.target_modules is not None else None
        raise ConfigError(
            [
                Problem(
                    f"{key}.target_modules",
                    value,
                    f"names of modules in {type(model).__name__}: {', '.join(linear)}",
                    f"peft: {reason}",
                )
            ]
        ) from None


# ----------------------------------------------------------------------------------
# 4-bit (bitsandbytes) bases
# ----------------------------------------------------------------------------------


def _as_mapping(value: Any) -> Mapping[str, Any]:
    if isinstance(value, Mapping):
        return value
    if hasattr(value, "to_dict"):
        out = value.to_dict()
        return out if isinstance(out, Mapping) else {}
    return dict(vars(value)) if hasattr(value, "__dict__") else {}


def is_4bit(obj: Any) -> bool:
    """Whether ``obj`` (a model, a transformers config or a config mapping) is a bitsandbytes 4-bit model."""
    if getattr(obj, "is_loaded_in_4bit", False) is True:
        return True
    config = obj if isinstance(obj, Mapping) else getattr(obj, "config", obj)
    quant = (
        config.get("quantization_config")
        if isinstance(config, Mapping)
        else getattr(config, "quantization_config", None)
    )
    if quant is None:
        return False
    return bool(_as_mapping(quant).get("load_in_4bit", False))


def quantization_problems(obj: Any, device_type: str, key: str = "model") -> list[Problem]:
    """A problem when a 4-bit quantized model (QLoRA) is to run on a device bitsandbytes cannot use.

    ``obj`` is a model (any module in it may carry the flag, e.g. under a PEFT wrapper), a
    transformers config or a config mapping.
    """
    if device_type == "cuda":
        return []
    modules = list(obj.modules()) if callable(getattr(obj, "modules", None)) else [obj]
    if not any(is_4bit(m) for m in modules):
        return []
    return [
        Problem(
            key,
            "4-bit quantized (bitsandbytes load_in_4bit)",
            f"a model that runs on {device_type}",
            f"bitsandbytes 4-bit weights (QLoRA) need CUDA and this run is on {device_type}: run on GPUs "
            "(bridge.device: cuda), or load the base without quantization_config for a CPU run",
        )
    ]
