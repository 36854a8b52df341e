"""LoRA from a config section (``peft:``), and the check that a 4-bit (QLoRA) base can run where it is asked to.

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

import functools
import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdp_bridge.errors import ConfigError, Problem

if TYPE_CHECKING:  # torch is imported by the functions that need it: the config parser stays light
    from torch import nn

__all__ = [
    "PEFT_INSTALL",
    "PeftConfig",
    "apply_lora",
    "base_weight_name",
    "bitsandbytes_4bit_problem",
    "frozen_4bit_weights",
    "has_4bit",
    "is_4bit",
    "keep_4bit_weights_in_place",
    "peft_problems",
    "quantization_problems",
    "reset_adapters",
    "train_quantization_problems",
]

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
        """The ``peft.LoraConfig`` of this section (a causal language model task).

        Returns:
            A ``peft.LoraConfig`` with this section's rank, alpha, dropout and target modules.
        """
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
# A PEFT model over a base whose weights are read after sharding
# ----------------------------------------------------------------------------------

_ADAPTER_CONTAINERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
_PEFT_PREFIX = "base_model.model."


def base_weight_name(name: str) -> str | None:
    """The name a PEFT (LoRA) model's state-dict entry has in its base model, or None for the
    adapters' own entries: ``base_model.model.x.q_proj.base_layer.weight`` -> ``x.q_proj.weight``;
    ``modules_to_save`` copies and their ``original_module`` map to the module they copy."""
    parts = name.split(".")
    if any(part in _ADAPTER_CONTAINERS for part in parts):
        return None
    if not name.startswith(_PEFT_PREFIX):
        return name
    kept: list[str] = []
    skip = 0
    for i, part in enumerate(parts[2:]):
        if skip:
            skip -= 1
            continue
        if part in ("base_layer", "original_module"):
            continue
        if part == "modules_to_save" and i + 3 < len(parts):  # modules_to_save.<adapter name>.
            skip = 1
            continue
        kept.append(part)
    return ".".join(kept)


def reset_adapters(model: nn.Module, *, only_meta: bool = False) -> dict[str, Any]:
    """Initialise the LoRA adapters of ``model`` as peft does (``reset_lora_parameters``: A as an
    ``nn.Linear``, B zero), in module order with torch's current RNG; adapters on the meta device
    are first given CPU memory. ``only_meta``: leave adapters that already hold values alone.
    Returns the name -> value of every adapter parameter (what to put back after sharding).

    Raises:
        ValueError: an adapter on the meta device whose initialisation needs the base weights
            (PiSSA, OLoRA, LoftQ, EVA, CorDA, DoRA's magnitude): load the base first.
    """
    import torch
    from torch import nn

    for module in model.modules():
        reset = getattr(module, "reset_lora_parameters", None)
        lora_a = getattr(module, "lora_A", None)
        if reset is None or not isinstance(lora_a, nn.ModuleDict):
            continue
        names = [*lora_a.keys(), *getattr(module, "lora_embedding_A", {}).keys()]
        for adapter in names:
            items = [getattr(module, c)[adapter] for c in _ADAPTER_CONTAINERS if adapter in getattr(module, c, {})]
            tensors = [t for item in items for t in (item.parameters() if isinstance(item, nn.Module) else [item])]
            on_meta = any(t.is_meta for t in tensors)
            if only_meta and not on_meta:
                continue
            init = _init_of(model, adapter)
            if init not in (True, "gaussian") or adapter in getattr(module, "lora_magnitude_vector", {}):
                if not on_meta:
                    continue  # it was initialised from the base's real weights: keep it
                raise ValueError(
                    f"LoRA adapter {adapter!r} (init_lora_weights={init!r}, DoRA: "
                    f"{adapter in getattr(module, 'lora_magnitude_vector', {})}) is initialised from the base "
                    "weights, which are read after sharding; load the base first (from_pretrained) or use "
                    "init_lora_weights=True"
                )
            for container in _ADAPTER_CONTAINERS:
                holder = getattr(module, container, None)
                if holder is None or adapter not in holder:
                    continue
                item = holder[adapter]
                if isinstance(item, nn.Module):
                    item.to_empty(device="cpu")
                elif item.is_meta:
                    holder[adapter] = nn.Parameter(
                        torch.empty(item.shape, dtype=item.dtype), requires_grad=item.requires_grad
                    )
            reset(adapter, init)
    return {
        name: p.detach().clone()
        for name, p in model.named_parameters()
        if any(part in _ADAPTER_CONTAINERS for part in name.split("."))
    }


def _init_of(model: nn.Module, adapter: str) -> Any:
    """The ``init_lora_weights`` of ``adapter`` in the PEFT model (or the module holding its configs)."""
    configs: Any = next((m.peft_config for m in model.modules() if hasattr(m, "peft_config")), {})
    config = configs.get(adapter) if isinstance(configs, Mapping) else None
    return getattr(config, "init_lora_weights", True) if config is not None else True


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


@functools.cache
def bitsandbytes_4bit_problem(device_type: str) -> str | None:
    """Why bitsandbytes cannot run 4-bit weights on ``device_type``, or None when it can.

    CUDA is bitsandbytes' home. For any other device the installed bitsandbytes is asked to do what
    a QLoRA step does (quantize, dequantize, a 4-bit matmul) on a 64x64 tensor: bitsandbytes 0.50
    does all three on CPU; older releases have no CPU 4-bit kernels and fail here, not mid-run.
    """
    if device_type == "cuda":
        return None
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbf
    except ImportError:
        return "bitsandbytes is not installed"
    import torch

    try:
        weight = torch.linspace(-1, 1, 64 * 64, device=device_type, dtype=torch.bfloat16).reshape(64, 64)
        packed, state = bnbf.quantize_4bit(weight, quant_type="nf4", quant_storage=torch.bfloat16)
        bnbf.dequantize_4bit(packed, state)
        bnb.matmul_4bit(torch.ones(2, 64, device=device_type, dtype=torch.bfloat16), packed.t(), state)
    except Exception as err:  # any failure means: not usable here
        version = getattr(bnb, "__version__", "?")
        return f"bitsandbytes {version} cannot run 4-bit weights on {device_type} ({type(err).__name__}: {err})"
    return None


def has_4bit(model: nn.Module) -> bool:
    """Whether any module of ``model`` (a PEFT wrapper's base included) is a bitsandbytes 4-bit model."""
    return any(is_4bit(m) for m in model.modules())


def parameter_adapters(model: nn.Module) -> list[str]:
    """Names of the modules where peft puts LoRA on a parameter rather than a layer (its ``ParamWrapper``:
    ``target_parameters``, and the fused expert tensors of mixture-of-experts blocks that
    ``target_modules="all-linear"`` reaches). peft registers a parametrization on the base parameter at
    every forward."""
    return [name for name, module in model.named_modules() if type(module).__name__ == "ParamWrapper"]


def frozen_4bit_weights(model: nn.Module) -> list[str]:
    """The (wrapper-free) names of the 4-bit layers' packed weights in ``model``: frozen, rebuilt from
    the base's pretrained directory, and left out of sharded checkpoints (with their quantization
    state entries, ``<name>.absmax`` & co.)."""
    from fsdp_bridge._names import strip_wrapper_prefixes

    names = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "quant_state") and getattr(module, "quant_storage", None) is not None and weight is not None:
            if not weight.requires_grad:
                names.append(strip_wrapper_prefixes(f"{name}.weight" if name else "weight"))
    return names


def keep_4bit_weights_in_place(model: nn.Module) -> int:
    """Turn off bitsandbytes' CPU repacking of 4-bit weights; returns how many layers it was on for.

    On a CPU with AVX512-BF16, bitsandbytes 0.50's ``Linear4bit.forward`` in eval mode without
    gradients replaces ``weight.data`` by a CPU-specific layout and marks its quantization state so.
    On a sharded model the weight is FSDP's unsharded view: the next unshard brings the original
    layout back under a state that says otherwise (wrong outputs, then an assertion in
    ``state_dict``). The flag is per layer (``support_avx512bf16_for_cpu``); training is unaffected.
    """
    count = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010 (bitsandbytes' attribute)
            count += 1
    return count


def train_quantization_problems(obj: Any, key: str) -> list[Problem]:
    """``fsdp-bridge train`` refuses 4-bit bases on every device: it does not quantize (``model.path``
    is read in slices into an unquantized model, and a ``model.config`` build is never quantized:
    only ``from_pretrained(quantization_config=...)`` quantizes)."""
    modules = list(obj.modules()) if callable(getattr(obj, "modules", None)) else [obj]
    if not any(is_4bit(m) for m in modules):
        return []
    return [
        Problem(
            key,
            "4-bit quantized (bitsandbytes load_in_4bit)",
            "an unquantized base for fsdp-bridge train",
            "fsdp-bridge train does not quantize (it reads the weights in slices into an unquantized "
            "model); fine-tune a 4-bit base from Python: from_pretrained(path, quantization_config="
            "BitsAndBytesConfig(load_in_4bit=True, ...)), peft.get_peft_model, fsdp_bridge.shard, then "
            "save_checkpoint(kind='sharded' to resume, kind='adapter' to export); or drop quantization_config",
        )
    ]


def quantization_problems(obj: Any, device_type: str, key: str = "model") -> list[Problem]:
    """A problem when a 4-bit quantized model (QLoRA) is to run on a device bitsandbytes cannot use.

    ``obj`` is a model (any module in it may carry the flag, e.g. under a PEFT wrapper), a
    transformers config or a config mapping. CUDA always passes; another device passes when the
    installed bitsandbytes runs 4-bit there (:func:`bitsandbytes_4bit_problem`: 0.50 does on CPU).
    """
    if device_type == "cuda":
        return []
    modules = list(obj.modules()) if callable(getattr(obj, "modules", None)) else [obj]
    if not any(is_4bit(m) for m in modules):
        return []
    why = bitsandbytes_4bit_problem(device_type)
    if why is None:
        return []
    return [
        Problem(
            key,
            "4-bit quantized (bitsandbytes load_in_4bit)",
            f"a model that runs on {device_type}",
            f"{why}: install bitsandbytes>=0.50 (its CPU backend runs 4-bit weights; "
            "pip install 'fsdp-bridge[qlora]'), run on GPUs (bridge.device: cuda), "
            "or load the base without quantization_config",
        )
    ]
