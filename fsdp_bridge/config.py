"""`BridgeConfig`: one typed, frozen configuration for both FSDP backends.

Fields accept either the typed value or its string spelling, normalised once here::

    BridgeConfig(strategy="FULL_SHARD", backend="fsdp2")
    BridgeConfig(mixed_precision="bf16", wrap=["LlamaDecoderLayer"], backward_prefetch="pre")

YAML is only a serialisation of the same fields (:func:`load_config`,
:meth:`BridgeConfig.to_dict`).  Every problem found (unknown keys, bad values,
combinations a backend cannot honour) is reported together in one
:class:`~fsdp_bridge.errors.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, cast

import yaml

from fsdp_bridge._schema import enum_spec, normalise, parse_section, spec, unknown_key
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.strategy import Backend, BackwardPrefetch, ShardingStrategy, parse_enum

if TYPE_CHECKING:
    import torch
    from torch import nn

    TorchDtype: TypeAlias = torch.dtype
    ModuleFilter: TypeAlias = Callable[[nn.Module], bool]
else:
    # This module imports no torch, so that a config (a YAML file, `fsdp-bridge train`'s) is read and its errors
    # reported before torch loads: the annotations the schema engine resolves at run time name these instead
    # (dtype fields are read by their own parser, declared with the field).
    TorchDtype = Any
    ModuleFilter = Callable[[Any], bool]

__all__ = [
    "BridgeConfig",
    "CompileConfig",
    "MixedPrecisionConfig",
    "WrapPolicy",
    "load_config",
    "parse_dtype",
    "read_yaml_file",
]

Device = Literal["auto", "cuda", "cpu"]
DEVICES: tuple[str, ...] = ("auto", "cuda", "cpu")

_DTYPES: dict[str, str] = {  # spelling -> the torch attribute
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
_DTYPE_NAMES = "float32 (fp32), bfloat16 (bf16), float16 (fp16)"


def parse_dtype(value: object) -> torch.dtype:
    """Parse a dtype spelling (``"bf16"``, ``"torch.bfloat16"``, ``torch.bfloat16``)."""
    loaded = sys.modules.get("torch")  # a torch.dtype exists only once torch is loaded
    if loaded is not None and isinstance(value, loaded.dtype) and dtype_name(value) in _DTYPES.values():
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in _DTYPES:
            import torch

            return cast("torch.dtype", getattr(torch, _DTYPES[key]))
    raise ValueError(f"{value!r} is not a floating dtype; allowed: {_DTYPE_NAMES}")


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _parse_optional_dtype(value: object, key: str, problems: list[Problem]) -> torch.dtype | None:
    return None if value is None else parse_dtype(value)


_DTYPE_SPEC = spec(f"{_DTYPE_NAMES} or null", _parse_optional_dtype)


# ----------------------------------------------------------------------------------
# Mixed precision
# ----------------------------------------------------------------------------------

logger = logging.getLogger("fsdp_bridge")

_MP_PRESETS: dict[str, dict[str, str]] = {  # field -> dtype name (torch is loaded only for a preset's dtypes)
    # Full precision: no mixed precision at all.
    "fp32": {},
    # bf16 compute, fp32 gradient reduction (torchtitan's default: reductions in
    # bf16 lose precision as the world grows).  Buffers stay fp32 (e.g. RoPE inv_freq).
    "bf16": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
    # fp16 compute needs a gradient scaler (torch.amp.GradScaler) in the user's loop.
    "fp16": {"param_dtype": "float16", "reduce_dtype": "float32"},
}
_MP_ALIASES = {"no": "fp32", "none": "fp32", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _parse_class_names(value: object, key: str, problems: list[Problem]) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, (list, tuple)):
        # classes (Python) by their names: a base class's name covers its subclasses, as isinstance does
        value = tuple(v.__name__ if isinstance(v, type) else v for v in value)
    if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{value!r} is not a list of module class names")
    return value


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionConfig:
    """Dtypes for compute, gradient reduction, outputs and buffers.

    ``None`` for a dtype means "keep the original dtype".  Build it from a preset
    with ``MixedPrecisionConfig.preset("bf16")`` or give the dtypes.
    """

    param_dtype: TorchDtype | None = field(default=None, metadata=_DTYPE_SPEC)
    """Dtype of the gathered parameters used in forward/backward (compute dtype)."""
    reduce_dtype: TorchDtype | None = field(default=None, metadata=_DTYPE_SPEC)
    """Dtype in which gradients are reduced across ranks (defaults to ``param_dtype``)."""
    output_dtype: TorchDtype | None = field(default=None, metadata=_DTYPE_SPEC)
    """Dtype the root module's floating-point outputs are cast to."""
    buffer_dtype: TorchDtype | None = field(default=None, metadata=_DTYPE_SPEC)
    """Dtype buffers are cast to (FSDP1 does it in forward; on FSDP2 it is emulated)."""
    cast_forward_inputs: bool = True
    """Cast floating-point forward inputs of each unit to ``param_dtype``."""
    cast_root_forward_inputs: bool = True
    """Cast the root's floating-point forward inputs to ``param_dtype`` (FSDP1's option of that name);
    with ``cast_forward_inputs: false`` only the root casts, FSDP1's default."""
    full_precision_modules: tuple[str, ...] | None = field(
        default=None,
        metadata=spec(
            "null (FSDP1's default: BatchNorm when the model has wrap units) or a list of module class names "
            "(a base class's name covers its subclasses: _BatchNorm)",
            _parse_class_names,
            summary="null or a list of strings",
        ),
    )
    """Modules of these classes stay in full precision (FSDP1's ``MixedPrecision._module_classes_to_ignore``):
    each is a unit of its own without mixed precision, its floating-point inputs cast to float32 and its
    outputs back to the dtype its inputs had. ``None``: FSDP1's default, BatchNorm modules (``_BatchNorm``)
    when the model has wrap units (FSDP1: an auto-wrap policy), else none; ``[]``: every module computes in
    ``param_dtype``."""

    @property
    def enabled(self) -> bool:
        return any(d is not None for d in (self.param_dtype, self.reduce_dtype, self.output_dtype, self.buffer_dtype))

    @classmethod
    def preset(cls, name: str) -> MixedPrecisionConfig:
        """The dtypes a named preset stands for.

        Args:
            name: a preset name (``fp32``, ``bf16``, ``fp16`` ..., any case) or one of its aliases.

        Returns:
            The preset's :class:`MixedPrecisionConfig`.

        Raises:
            ValueError: ``name`` is not a preset; the message lists the presets.
        """
        key = _MP_ALIASES.get(name.strip().lower(), name.strip().lower())
        if key not in _MP_PRESETS:
            raise ValueError(f"{name!r} is not a mixed-precision preset; allowed: {', '.join(_MP_PRESETS)}")
        return cls(**{field: parse_dtype(dtype) for field, dtype in _MP_PRESETS[key].items()})  # type: ignore[arg-type]

    def to_spelling(self) -> str | dict[str, Any]:
        """How a YAML file writes this policy.

        Returns:
            The preset name where the dtypes are a preset's, else a mapping of dtype names,
            ``cast_forward_inputs`` and ``cast_root_forward_inputs``.
        """
        for name in _MP_PRESETS:
            if self == MixedPrecisionConfig.preset(name):
                return name
        out: dict[str, Any] = {
            f.name: dtype_name(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name.endswith("_dtype")
        }
        out["cast_forward_inputs"] = self.cast_forward_inputs
        out["cast_root_forward_inputs"] = self.cast_root_forward_inputs
        if self.full_precision_modules is not None:
            out["full_precision_modules"] = list(self.full_precision_modules)
        return out


_MP_ALLOWED = f"a preset ({', '.join(_MP_PRESETS)}) or a mapping of dtypes"


def _parse_mixed_precision(value: object, key: str, problems: list[Problem]) -> MixedPrecisionConfig:
    if isinstance(value, MixedPrecisionConfig):
        return value
    if value is None:
        return MixedPrecisionConfig()
    if isinstance(value, str):
        return MixedPrecisionConfig.preset(value)  # ValueError: reported with _MP_ALLOWED
    if isinstance(value, Mapping):
        return MixedPrecisionConfig(**parse_section(MixedPrecisionConfig, value, problems, prefix=f"{key}."))
    raise ValueError(f"{value!r} is not a mixed-precision setting")


# ----------------------------------------------------------------------------------
# Wrap policy
# ----------------------------------------------------------------------------------

WrapMode = Literal["auto", "classes", "min_params", "callable", "none"]
_WRAP_ALLOWED = (
    "'auto' (the model's _no_split_modules, else the children of its ModuleLists), "
    "'none' (root only), a list of module class names, {min_num_params: N}, {classes: [names], absent_ok: true} "
    "(classes the model may lack), or a callable (Python only)"
)


@dataclass(frozen=True, kw_only=True)
class WrapPolicy:
    """Which submodules become their own FSDP unit (FSDP1 auto-wrap; FSDP2 bottom-up ``fully_shard``).

    The policy is resolved to a concrete list of modules once (:mod:`fsdp_bridge.wrap`),
    and both backends shard exactly those modules, then the root.
    """

    mode: WrapMode = "auto"
    """How units are chosen: ``auto``, ``classes``, ``min_params``, ``callable`` or ``none``."""
    classes: tuple[str, ...] = ()
    """Module class names to wrap (``mode="classes"``)."""
    min_num_params: int = 0
    """Wrap a module once its not-yet-wrapped parameters reach this count (``mode="min_params"``),
    with FSDP1's ``size_based_auto_wrap_policy`` semantics."""
    fn: ModuleFilter | None = field(default=None, compare=False)
    """``fn(module) -> bool`` chooses the units (``mode="callable"``); cannot come from YAML."""
    absent_ok: bool = field(default=False, compare=False)
    """The classes were given as Python classes, as FSDP1's policies take them (``isinstance``: a class the
    model lacks wraps nothing, as in FSDP1); names given as text must be in the model (a misspelling is refused)."""

    def to_spelling(self) -> object:
        """How a YAML file writes this policy.

        Returns:
            ``"auto"`` / ``"none"``, a list of class names (``{"classes": [...], "absent_ok": True}`` when the
            model may lack some), or ``{"min_num_params": N}``.

        Raises:
            ConfigError: a callable policy, which has no YAML spelling.
        """
        if self.mode == "classes":
            return {"classes": list(self.classes), "absent_ok": True} if self.absent_ok else list(self.classes)
        if self.mode == "min_params":
            return {"min_num_params": self.min_num_params}
        if self.mode == "callable":
            raise ConfigError(
                [Problem("wrap", self.fn, "a YAML-serialisable policy", "callable wrap policies exist only in Python")]
            )
        return self.mode


def _parse_wrap(value: object, key: str, problems: list[Problem]) -> WrapPolicy:
    if isinstance(value, WrapPolicy):
        return value
    if value is None:
        return WrapPolicy(mode="none")
    if isinstance(value, str):
        return _wrap_from_text(value)
    if isinstance(value, (list, tuple)):
        return _wrap_from_classes(value, key, problems)
    if isinstance(value, Mapping):
        return _wrap_from_mapping(value, key, problems)
    if callable(value):
        return WrapPolicy(mode="callable", fn=cast("ModuleFilter", value))
    raise ValueError(f"{value!r} is not a wrap policy")


def _wrap_from_text(value: str) -> WrapPolicy:
    text = value.strip().lower()
    if text in ("auto", "none"):
        return WrapPolicy(mode=cast(WrapMode, text))
    # A single class name is a common spelling: "LlamaDecoderLayer" or "A,B".
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if names and all(n.isidentifier() for n in names):
        return WrapPolicy(mode="classes", classes=names)
    raise ValueError(f"{value!r} is not a wrap policy")


def _wrap_from_classes(value: Sequence[object], key: str, problems: list[Problem]) -> WrapPolicy:
    names: list[str] = []
    for item in value:
        loaded = sys.modules.get("torch.nn")  # an nn.Module class exists only once torch is loaded
        if isinstance(item, type) and loaded is not None and issubclass(item, loaded.Module):
            names.append(item.__name__)
        elif isinstance(item, str) and item.strip().isidentifier():
            names.append(item.strip())
        else:
            problems.append(Problem(f"{key}[]", item, "module class names (identifiers) or nn.Module classes"))
    if not value:
        problems.append(Problem(key, value, _WRAP_ALLOWED, "give at least one class name, or 'none'"))
    given_as_classes = bool(value) and all(isinstance(item, type) for item in value)
    return WrapPolicy(mode="classes", classes=tuple(names), absent_ok=given_as_classes)


def _wrap_from_mapping(value: Mapping[str, Any], key: str, problems: list[Problem]) -> WrapPolicy:
    valid = ["min_num_params", "classes", "absent_ok"]
    unknown = [k for k in value if k not in valid]
    problems.extend(unknown_key(f"{key}.{k}", value[k], valid) for k in unknown)
    if "min_num_params" in value and "classes" in value:
        problems.append(Problem(key, dict(value), "exactly one of min_num_params or classes"))
    if "min_num_params" in value:
        n = value["min_num_params"]
        if (
            isinstance(n, bool)
            or not isinstance(n, (int, float))
            or (isinstance(n, float) and not math.isfinite(n))
            or n < 1
        ):
            problems.append(Problem(f"{key}.min_num_params", n, "a number >= 1 (an integer, or a float such as 1e8)"))
            return WrapPolicy()
        # FSDP1's size policy compares a count with the number (`numel >= min_num_params`): a float as 1e9 is
        # what FSDP1 code often passes, and the smallest count that reaches it is its ceiling.
        return WrapPolicy(mode="min_params", min_num_params=math.ceil(n))
    absent_ok = value.get("absent_ok", False)
    if not isinstance(absent_ok, bool):
        problems.append(Problem(f"{key}.absent_ok", absent_ok, "true or false"))
    elif absent_ok and "classes" not in value:
        problems.append(Problem(f"{key}.absent_ok", absent_ok, "absent_ok only beside classes", "add classes: [...]"))
    if "classes" in value:
        policy = _wrap_from_classes(list(value["classes"] or []), key, problems)
        return dataclasses.replace(policy, absent_ok=True) if absent_ok is True else policy
    if not unknown:
        problems.append(Problem(key, dict(value), _WRAP_ALLOWED))
    return WrapPolicy()


# ----------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


@dataclass(frozen=True, kw_only=True)
class CompileConfig:
    """``torch.compile`` of each wrap unit before it is sharded (regional compilation: one compiled
    region per unit, FSDP's communication between them). ``BridgeConfig(compile=True)`` or a mapping
    of the options below."""

    enabled: bool = False
    """Compile each wrap unit (``unit.compile(...)``) before sharding."""
    mode: CompileMode | None = None
    """torch.compile's ``mode``; null: torch's default."""
    fullgraph: bool = False
    """torch.compile's ``fullgraph``: fail on a graph break instead of splitting the region."""
    dynamic: bool | None = None
    """torch.compile's ``dynamic``: null lets torch decide, true / false force dynamic / static shapes."""

    def options(self) -> dict[str, Any]:
        """The keyword arguments for ``torch.compile`` / ``nn.Module.compile``.

        Returns:
            ``fullgraph`` and ``dynamic``, and ``mode`` when one is set (else torch's default).
        """
        out: dict[str, Any] = {"fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.mode is not None:
            out["mode"] = self.mode
        return out

    def to_spelling(self) -> bool | dict[str, Any]:
        """How a YAML file writes it.

        Returns:
            ``False``, ``True`` (compiled with torch's defaults) or the mapping of options.
        """
        if not self.enabled or self == CompileConfig(enabled=True):
            return self.enabled
        return {"mode": self.mode, "fullgraph": self.fullgraph, "dynamic": self.dynamic}


Float8Recipe = Literal["tensorwise", "rowwise"]
FLOAT8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")


def _parse_float8(value: object, key: str, problems: list[Problem]) -> str | None:
    if value is None or value is False:
        return None
    if isinstance(value, str) and value.strip().lower() in FLOAT8_RECIPES:
        return value.strip().lower()
    raise ValueError(f"{value!r} is not a float8 recipe")


_COMPILE_ALLOWED = "true, false, or a mapping of torch.compile options (mode, fullgraph, dynamic)"


def _parse_compile(value: object, key: str, problems: list[Problem]) -> CompileConfig:
    if isinstance(value, CompileConfig):
        return value
    if value is None or isinstance(value, bool):
        return CompileConfig(enabled=bool(value))
    if isinstance(value, Mapping):
        fields = parse_section(CompileConfig, value, problems, prefix=f"{key}.")
        fields.setdefault("enabled", True)  # writing the options asks for compilation
        return CompileConfig(**fields)
    raise ValueError(f"{value!r} is not a compile setting")


# ----------------------------------------------------------------------------------
# The config
# ----------------------------------------------------------------------------------


def _parse_reshard(value: object, key: str, problems: list[Problem]) -> bool | int | None:
    if value is None or isinstance(value, bool) or (isinstance(value, int) and value >= 1):
        return value
    raise ValueError(f"{value!r} is not a reshard-after-forward setting")


_BACKWARD_PREFETCH_ALLOWED = "pre, post, none, or an integer >= 1 (units ahead, fsdp2)"
_FORWARD_PREFETCH_ALLOWED = "true, false, or an integer >= 1 (units ahead, fsdp2)"


def _prefetch_depth(value: object) -> int | None:
    """``value`` as a number of units (an int, not a bool), or None when it is not one."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"{value!r} is not a number of units ahead (an integer >= 1)")
        return value
    return None


def _parse_backward_prefetch(value: object, key: str, problems: list[Problem]) -> BackwardPrefetch | int:
    depth = _prefetch_depth(value)
    return depth if depth is not None else parse_enum(BackwardPrefetch, value)


def _parse_forward_prefetch(value: object, key: str, problems: list[Problem]) -> bool | int:
    depth = _prefetch_depth(value)
    if depth is not None:
        return depth
    if isinstance(value, bool):
        return value
    raise ValueError(f"{value!r} is not a forward prefetch setting")


def _parse_hybrid_shape(value: object, key: str, problems: list[Problem]) -> tuple[int, int] | None:
    if value is None:
        return None
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in value)
    ):
        raise ValueError(f"{value!r} is not a (replicate, shard) shape")
    return (value[0], value[1])


def _parse_ignored(value: object, key: str, problems: list[Problem]) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{value!r} is not a list of module names")
    return tuple(value)


def _parse_device(value: object, key: str, problems: list[Problem]) -> str:
    if isinstance(value, str) and value.strip().lower() in DEVICES:
        return value.strip().lower()
    raise ValueError(f"{value!r} is not a device")


MixedPrecisionLike: TypeAlias = "MixedPrecisionConfig | str | Mapping[str, Any] | None"
"""A :class:`MixedPrecisionConfig`, a preset name (``"bf16"``) or a mapping of its fields."""
WrapLike: TypeAlias = (
    "WrapPolicy | str | Sequence[str | type[nn.Module]] | Mapping[str, Any] | Callable[[nn.Module], bool] | None"
)
"""A :class:`WrapPolicy`, ``"auto"``/``"none"``, class names or classes, ``{min_num_params: N}`` or a callable."""


@dataclass(frozen=True, kw_only=True)
class BridgeConfig:
    """How to shard a model, independent of the backend that does it.

    Every field has a default; ``BridgeConfig(strategy="FULL_SHARD", backend="fsdp2")``
    shards a Hugging Face model well (its ``_no_split_modules`` become the units).
    Values that a backend cannot honour raise :class:`ConfigError` here, before any
    process group exists; see ``fsdp-bridge explain`` for what each option becomes.
    """

    strategy: ShardingStrategy = field(default=ShardingStrategy.FULL_SHARD, metadata=enum_spec(ShardingStrategy))
    """Sharding strategy: full_shard, shard_grad_op, no_shard, hybrid_shard, hybrid_shard_zero2."""
    backend: Backend = field(default=Backend.FSDP2, metadata=enum_spec(Backend))
    """Backend that runs the model: fsdp1 (FullyShardedDataParallel) or fsdp2 (fully_shard)."""
    mixed_precision: MixedPrecisionConfig = field(
        default_factory=MixedPrecisionConfig, metadata=spec(_MP_ALLOWED, _parse_mixed_precision)
    )
    """A preset (fp32, bf16, fp16) or a mapping of param/reduce/output/buffer dtypes."""
    wrap: WrapPolicy = field(
        default_factory=WrapPolicy,
        metadata=spec(_WRAP_ALLOWED, _parse_wrap, summary="auto, none, a list of class names or {min_num_params: N}"),
    )
    """Units to shard separately: auto, none, a list of class names, {min_num_params: N}, or a callable."""
    backward_prefetch: BackwardPrefetch | int = field(
        default=BackwardPrefetch.PRE,
        metadata=spec(_BACKWARD_PREFETCH_ALLOWED, _parse_backward_prefetch, summary=_BACKWARD_PREFETCH_ALLOWED),
    )
    """Backward all-gather prefetch: pre, post, none, or how many units ahead (an integer >= 1, FSDP2)."""
    forward_prefetch: bool | int = field(
        default=False,
        metadata=spec(_FORWARD_PREFETCH_ALLOWED, _parse_forward_prefetch, summary=_FORWARD_PREFETCH_ALLOWED),
    )
    """Prefetch the next unit's all-gather during forward (true), or how many units ahead (an integer >= 1, FSDP2)."""
    limit_all_gathers: bool = True
    """FSDP1's rate limiter on in-flight all-gathers (FSDP2 does not need one)."""
    cpu_offload: bool = False
    """Keep sharded parameters and gradients on CPU, optimizer step on CPU."""
    activation_checkpointing: bool = False
    """Recompute each unit's activations in backward instead of storing them."""
    sync_module_states: bool = False
    """Take every rank's initial weights from rank 0 (other ranks may build on the meta device)."""
    reshard_after_forward: bool | int | None = field(
        default=None,
        metadata=spec(
            "null (from the strategy), true, false, or an integer >= 1",
            _parse_reshard,
            summary="true or false or an integer or null",
        ),
    )
    """Override the strategy's reshard-after-forward: true, false, or a smaller group size (FSDP2)."""
    hybrid_shape: tuple[int, int] | None = field(
        default=None,
        metadata=spec(
            "null or [replicate, shard], two integers >= 1 whose product is the world size",
            _parse_hybrid_shape,
            summary="a list of 2 integers or null",
        ),
    )
    """(replicate, shard) mesh for HYBRID_*; default: shard within a node, replicate across nodes."""
    ignored_modules: tuple[str, ...] = field(
        default=(),
        metadata=spec(
            "a list of module paths (e.g. lm_head), class names or parameter paths",
            _parse_ignored,
            summary="a list of strings",
        ),
    )
    """Module names (dotted paths) or class names whose parameters are not sharded and whose gradients
    are not reduced across ranks; a parameter's dotted path ignores that parameter alone (FSDP1's
    ``ignored_states`` of parameters)."""
    device: Device = field(
        default="auto", metadata=spec(", ".join(DEVICES), _parse_device, summary=f"one of {', '.join(DEVICES)}")
    )
    """auto (CUDA with NCCL when available, else CPU with gloo), cuda or cpu."""
    compile: CompileConfig = field(
        default_factory=CompileConfig,
        metadata=spec(_COMPILE_ALLOWED, _parse_compile, summary="true, false or {mode, fullgraph, dynamic}"),
    )
    """torch.compile each wrap unit before sharding: true, or a mapping of mode, fullgraph, dynamic."""
    float8: Float8Recipe | None = field(
        default=None,
        metadata=spec("false, tensorwise or rowwise", _parse_float8, summary="false, tensorwise or rowwise"),
    )
    """torchao float8 training of the units' linear layers (FSDP2 on a GPU with float8 matmuls): tensorwise
    (float8 all-gather) or rowwise; false: off."""

    if TYPE_CHECKING:
        # What the constructor accepts: the typed values, or the spellings users write (normalised
        # once in __post_init__, after which every field holds its annotated type).
        def __init__(
            self,
            *,
            strategy: ShardingStrategy | str = ...,
            backend: Backend | str = ...,
            mixed_precision: MixedPrecisionLike = ...,
            wrap: WrapLike = ...,
            backward_prefetch: BackwardPrefetch | str | int | None = ...,
            forward_prefetch: bool | int = ...,
            limit_all_gathers: bool = ...,
            cpu_offload: bool = ...,
            activation_checkpointing: bool = ...,
            sync_module_states: bool = ...,
            reshard_after_forward: bool | int | None = ...,
            hybrid_shape: tuple[int, int] | Sequence[int] | None = ...,
            ignored_modules: Sequence[str] | str | None = ...,
            device: Device | str = ...,
            compile: CompileConfig | bool | Mapping[str, Any] | None = ...,
            float8: Float8Recipe | bool | None = ...,
        ) -> None: ...

    def __post_init__(self) -> None:
        problems: list[Problem] = []
        normalise(self, problems)  # frozen: every field parsed in place once, here
        if self.hybrid_shape is not None and not self.strategy.is_hybrid:
            problems.append(
                Problem(
                    "hybrid_shape",
                    list(self.hybrid_shape),
                    "null unless strategy is hybrid_shard or hybrid_shard_zero2",
                    f"remove hybrid_shape, or set strategy: hybrid_shard (strategy is {self.strategy.value})",
                )
            )
        if not problems:
            # Only a well-formed config can be checked against the backend's table.
            from fsdp_bridge.mapping import unsupported_problems

            problems.extend(unsupported_problems(self, self.backend))
        if problems:
            raise ConfigError(problems)

    # -- serialisation ---------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain, YAML-safe values; ``BridgeConfig.from_dict(c.to_dict()) == c``.

        Returns:
            Every field by name, enums as their values and policies as their YAML spellings.

        Raises:
            ConfigError: a callable wrap policy, which has no YAML spelling.
        """
        return {
            "strategy": self.strategy.value,
            "backend": self.backend.value,
            "mixed_precision": self.mixed_precision.to_spelling(),
            "wrap": self.wrap.to_spelling(),
            "backward_prefetch": (
                self.backward_prefetch.value
                if isinstance(self.backward_prefetch, BackwardPrefetch)
                else self.backward_prefetch
            ),
            "forward_prefetch": self.forward_prefetch,
            "limit_all_gathers": self.limit_all_gathers,
            "cpu_offload": self.cpu_offload,
            "activation_checkpointing": self.activation_checkpointing,
            "sync_module_states": self.sync_module_states,
            "reshard_after_forward": self.reshard_after_forward,
            "hybrid_shape": list(self.hybrid_shape) if self.hybrid_shape else None,
            "ignored_modules": list(self.ignored_modules),
            "device": self.device,
            "compile": self.compile.to_spelling(),
            "float8": self.float8 or False,
        }

    def to_yaml(self) -> str:
        """The config as a YAML document (what :func:`fsdp_bridge.load_config` reads back).

        Returns:
            :meth:`to_dict` dumped as YAML, fields in declaration order.

        Raises:
            ConfigError: a callable wrap policy, which has no YAML spelling.
        """
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def field_names(cls) -> list[str]:
        """The keys a bridge config accepts.

        Returns:
            The field names, in declaration order.
        """
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, source: str | None = None) -> BridgeConfig:
        """Build a config from a mapping (e.g. parsed YAML), reporting every problem at once.

        Args:
            data: field name -> value, values as YAML writes them or as the field types; None
                or empty gives the defaults.
            source: where ``data`` came from (a file name), named in the error.

        Returns:
            The config.

        Raises:
            ConfigError: every unknown key (with "did you mean") and every bad value, together.
        """
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError([Problem("config", data, "a mapping of BridgeConfig keys")], source=source)
        valid = cls.field_names()
        problems = [unknown_key(str(k), v, valid) for k, v in data.items() if k not in valid]
        known = {k: v for k, v in data.items() if k in valid}
        try:
            config = cls(**known)
        except ConfigError as err:
            raise ConfigError([*problems, *err.problems], source=source) from None
        if problems:
            raise ConfigError(problems, source=source)
        return config

    def replace(self, **changes: Any) -> BridgeConfig:
        """A copy with some fields changed (validated like a new config).

        Args:
            **changes: field name -> new value, in any spelling the constructor accepts.

        Returns:
            The new config; this one is unchanged.

        Raises:
            ConfigError: a name that is not a field (with "did you mean"), or a new value that
                is not valid for its field.
        """
        valid = self.field_names()
        unknown = [unknown_key(k, v, valid) for k, v in changes.items() if k not in valid]
        if unknown:
            raise ConfigError(unknown)
        replaced = dataclasses.replace(self, **changes)
        for carried in (_FSDP1_MESH, _FSDP1_INIT, _FSDP1_IGNORED):  # what from_fsdp1 was given beside the fields
            if hasattr(self, carried):
                object.__setattr__(replaced, carried, getattr(self, carried))
        return replaced

    @classmethod
    def from_fsdp1(cls, *fsdp1_args: Any, backend: Backend | str = Backend.FSDP2, **fsdp1_kwargs: Any) -> BridgeConfig:
        """The config meaning what FSDP1's constructor arguments mean, for ``backend``.

        Takes ``FullyShardedDataParallel``'s keyword arguments with FSDP1's own run-time
        objects as values (a torch ``ShardingStrategy`` member, ``MixedPrecision``,
        ``CPUOffload``, ``BackwardPrefetch``, any auto-wrap policy: ``functools.partial`` of
        ``transformer_auto_wrap_policy`` / ``size_based_auto_wrap_policy`` /
        ``lambda_auto_wrap_policy``, ``ModuleWrapPolicy``, ``CustomPolicy``, ``_or_policy``
        combinations or a policy function), so code that builds them in helper modules
        keeps doing so::

            model = fsdp_bridge.shard(model, fsdp_bridge.BridgeConfig.from_fsdp1(
                sharding_strategy=cfg.sharding_strategy, auto_wrap_policy=my_policy,
                mixed_precision=mp_policy, device_id=torch.cuda.current_device()), mesh=device_mesh)

        Args:
            *fsdp1_args: FSDP1's positional arguments after ``module`` (``process_group``,
                ``sharding_strategy``, ``cpu_offload``, ... in its constructor's order), so that
                ``FSDP(module, *args, **kwargs)`` becomes ``shard(module, BridgeConfig.from_fsdp1(*args,
                **kwargs))``.
            backend: the backend to run on (FSDP2 by default: this is the migration path).
            **fsdp1_kwargs: FSDP1 constructor arguments other than ``module``. A model built on
                the meta device without ``sync_module_states`` is materialised as FSDP1 does it, on
                every rank: ``param_init_fn(module)`` for each module of each unit (units children
                first, modules breadth-first), or ``reset_parameters()`` without one. A ``device_mesh``,
                or a ``process_group`` other than every rank's (a group, or HYBRID_SHARD's pair),
                goes with the returned config (not a field: it is not saved or compared) and is
                the mesh :func:`fsdp_bridge.shard` and :func:`fsdp_bridge.enable_wrap` use when
                given none (a group through :func:`fsdp_bridge.mesh_from_process_group`), so
                ``**kwargs`` dicts that hold them work unchanged. ``ignored_modules`` /
                ``ignored_states`` given as module or parameter objects go with the config too and
                are named in the model by :func:`fsdp_bridge.shard`. ``backward_prefetch=None``, or any
                value other than FSDP1's two BackwardPrefetch members (``True``, a string), is no backward
                prefetch (FSDP1's meaning) on both backends, with a note for the latter; ``BACKWARD_POST``
                becomes FSDP2's (pre) timing there, with a note (the same numbers).

        Returns:
            A validated config; wrap policies keep FSDP1's semantics exactly.

        Raises:
            ConfigError: for arguments that have no meaning on ``backend`` (the same
                errors as a YAML config), or that belong elsewhere, each with the fix.
        """
        # What FSDP1's arguments mean lives in its own module (below this one: it makes plain field values);
        # imported here so that reading a YAML config does not import FSDP1's classes.
        from fsdp_bridge.fsdp1_compat import (
            positional_fsdp1_arguments,
            runtime_ignored_objects,
            runtime_mesh_arguments,
            translate_fsdp1_kwargs,
        )

        if fsdp1_args:
            fsdp1_kwargs = positional_fsdp1_arguments(fsdp1_args, fsdp1_kwargs)
        kwargs, carried = runtime_mesh_arguments(fsdp1_kwargs)
        kwargs, ignored_objects = runtime_ignored_objects(kwargs)
        values, notes = translate_fsdp1_kwargs(kwargs)
        post = getattr(values.get("backward_prefetch"), "name", None) == "BACKWARD_POST"
        if post and Backend(backend) is Backend.FSDP2:
            # the same numbers at another moment: as migrate code writes a literal BACKWARD_POST
            values["backward_prefetch"] = "pre"
            notes.append(
                "BackwardPrefetch.BACKWARD_POST has no FSDP2 form: FSDP2 gathers the next unit's parameters "
                "before the current unit's gradients are computed (BACKWARD_PRE's timing): the same numbers, "
                "the gather issued earlier (a little more memory)"
            )
        for note in notes:
            logger.info("from_fsdp1: %s", note)
        config = cls(backend=backend, **values)  # type: ignore[arg-type]
        if carried is not None:
            logger.info("from_fsdp1: %s -> the mesh shard() uses when given none", carried[0])
            object.__setattr__(config, _FSDP1_MESH, carried)
        # FSDP1 materialises meta-device modules itself (param_init_fn, else reset_parameters): kept for shard().
        object.__setattr__(config, _FSDP1_INIT, (kwargs.get("param_init_fn"),))
        if ignored_objects:
            # FSDP1's module or parameter objects: named in shard(), where the model is known.
            object.__setattr__(config, _FSDP1_IGNORED, ignored_objects)
        return config


_FSDP1_MESH = "_fsdp1_mesh"
"""Attribute of a config from :meth:`BridgeConfig.from_fsdp1`: ``(argument name, device mesh or process
group)`` given there, for :func:`fsdp1_mesh`."""


_FSDP1_INIT = "_fsdp1_init"
"""Attribute of a config from :meth:`BridgeConfig.from_fsdp1`: ``(param_init_fn or None,)``, FSDP1's rule for
meta-device modules (see :func:`fsdp1_init`)."""


_FSDP1_IGNORED = "_fsdp1_ignored"
"""Attribute of a config from :meth:`BridgeConfig.from_fsdp1`: the module or parameter objects given as
``ignored_modules`` / ``ignored_states`` (FSDP1's form), for :func:`carried_ignored`."""


def carried_ignored(config: BridgeConfig) -> tuple[object, ...]:
    """The ignored module or parameter objects :meth:`BridgeConfig.from_fsdp1` was given (FSDP1's form of
    ``ignored_modules`` / ``ignored_states``): ``shard()`` names them in the model it shards."""
    return cast("tuple[object, ...]", getattr(config, _FSDP1_IGNORED, ()))


def with_ignored_names(config: BridgeConfig, names: Sequence[str]) -> BridgeConfig:
    """``config`` with ``names`` (the paths of its :func:`carried_ignored` objects) added to
    ``ignored_modules``, and the objects dropped: named once, not again if the result is reused."""
    named = config.replace(ignored_modules=(*config.ignored_modules, *names))
    object.__delattr__(named, _FSDP1_IGNORED)
    return named


def fsdp1_init(config: BridgeConfig) -> tuple[Any] | None:
    """``(param_init_fn or None,)`` when ``config`` comes from :meth:`BridgeConfig.from_fsdp1`: a model on the
    meta device is then materialised as FSDP1 does (``param_init_fn`` on each module, else
    ``reset_parameters``) on every rank, before ``sync_module_states`` broadcasts rank 0's; None for other
    configs (they need ``sync_module_states`` and real weights on rank 0)."""
    return cast("tuple[Any] | None", getattr(config, _FSDP1_INIT, None))


def fsdp1_mesh(config: BridgeConfig) -> tuple[str, Any] | None:
    """``(argument name, device mesh or process group)`` when ``config`` comes from :meth:`BridgeConfig.from_fsdp1`
    given a ``device_mesh`` or a ``process_group`` (see :func:`fsdp_bridge.distributed.carried_mesh`); None
    otherwise."""
    return cast("tuple[str, Any] | None", getattr(config, _FSDP1_MESH, None))


_YAML_MAX_BYTES = 16 << 20
_YAML_MAX_ALIASES = 100
_YAML_MAX_DEPTH = 64
_YAML_MAX_INT_DIGITS = 30
_YAML_MAX_NODES = 100_000


class YamlLimitError(yaml.YAMLError):
    """YAML text over a configuration's bounds (aliases, nesting, values, integer digits)."""


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (no tag builds Python objects) with the limits a config needs: a
    handful of aliases (a 1 KB alias bomb otherwise expands into gigabytes once walked),
    bounded nesting, integers of at most 30 digits, and no duplicate keys (the second would
    silently win)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._aliases = 0
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > _YAML_MAX_ALIASES:
                raise YamlLimitError(f"more than {_YAML_MAX_ALIASES} aliases (*name): not a configuration")
        self._depth += 1
        try:
            if self._depth > _YAML_MAX_DEPTH:
                raise YamlLimitError(f"nested more than {_YAML_MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Any:
        node = super().compose_document()
        sizes: dict[int, int] = {}

        def expanded(n: Any) -> int:  # nodes once aliases are expanded (shared nodes counted once each)
            if id(n) not in sizes:
                sizes[id(n)] = 0  # a cycle counts as nothing more
                children = n.value if isinstance(n.value, list) else []
                total = 1
                for child in children:
                    total += sum(expanded(c) for c in child) if isinstance(child, tuple) else expanded(child)
                    if total > _YAML_MAX_NODES:
                        break
                sizes[id(n)] = total
            return sizes[id(n)]

        if node is not None and expanded(node) > _YAML_MAX_NODES:
            raise YamlLimitError(f"expands to more than {_YAML_MAX_NODES:,} values through its aliases (*name)")
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise YamlLimitError(
                    f"duplicate key {key!r} (line {key_node.start_mark.line + 1}, first on line "
                    f"{seen[key] + 1}): the second would silently win"
                )
            if isinstance(key, str | int | float | bool):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: Any) -> int:
        digits = sum(ch.isdigit() for ch in str(node.value))
        if digits > _YAML_MAX_INT_DIGITS:
            raise YamlLimitError(f"an integer of {digits} digits (line {node.start_mark.line + 1})")
        return super().construct_yaml_int(node)  # type: ignore[no-any-return]


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def load_bounded_yaml(text: str) -> Any:
    """Parse YAML text with the bounds of :func:`safe_yaml_load` (safe tags only), raising its
    errors as they are: for callers that treat text which is not YAML as a plain string
    (command-line overrides) but must still refuse text over the bounds.

    Raises:
        YamlLimitError: the text is over a bound (e.g. an integer of more than 30 digits).
        yaml.YAMLError: the text is not YAML.
    """
    try:
        return yaml.load(text, Loader=_BoundedLoader)
    except RecursionError:
        raise YamlLimitError(f"nested more than {_YAML_MAX_DEPTH} levels deep") from None


def safe_yaml_load(text: str, *, source: str = "<string>") -> Any:
    """Parse YAML text for a configuration: safe tags only, bounded, duplicate keys refused.

    Raises:
        ConfigError: naming ``source`` and what is wrong.
    """
    try:
        return yaml.load(text, Loader=_BoundedLoader)
    except yaml.YAMLError as err:
        raise ConfigError(
            [Problem("yaml", source, "valid YAML for a configuration", " ".join(str(err).split())[:500])]
        ) from None
    except (RecursionError, ValueError, MemoryError) as err:
        raise ConfigError(
            [Problem("yaml", source, "valid YAML for a configuration", f"{type(err).__name__}: {str(err)[:300]}")]
        ) from None


def read_yaml_file(path: str | os.PathLike[str], *, key: str = "path") -> Any:
    """The data in a YAML file, read by :func:`safe_yaml_load` (no tag can build Python objects).

    Raises:
        ConfigError: the file is unreadable (``key`` names it in the message), too large, not
            UTF-8, or not acceptable YAML.
    """
    path = Path(path)
    try:
        if path.stat().st_size > _YAML_MAX_BYTES:
            raise ConfigError([Problem(key, str(path), f"a YAML file of at most {_YAML_MAX_BYTES >> 20} MiB")])
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError([Problem(key, str(path), "a readable YAML file", str(err))]) from None
    except UnicodeDecodeError as err:
        raise ConfigError([Problem(key, str(path), "a UTF-8 text file", str(err))]) from None
    return safe_yaml_load(text, source=str(path))


def load_config(path: str | os.PathLike[str], *, overrides: Mapping[str, Any] | None = None) -> BridgeConfig:
    """Load a :class:`BridgeConfig` from a YAML file.

    The file is either a bridge config at top level, or a training config whose
    ``bridge:`` section holds it.  ``overrides`` replace keys after loading.
    YAML is read with ``yaml.safe_load``: no tag can construct Python objects.

    Args:
        path: a YAML file.
        overrides: keys to replace after loading (``{"strategy": "hybrid_shard"}``).

    Returns:
        The validated :class:`BridgeConfig`.

    Raises:
        ConfigError: listing every problem in the file (unknown keys, wrong values), or a file
            that cannot be read or is not bounded YAML.
    """
    path = Path(path)
    data = read_yaml_file(path)
    if isinstance(data, Mapping) and isinstance(data.get("bridge"), Mapping):
        data = data["bridge"]
    data = dict(data or {}) if isinstance(data, Mapping) else data
    if overrides and isinstance(data, dict):
        data.update(overrides)
    return BridgeConfig.from_dict(data, source=str(path))
