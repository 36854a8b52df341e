"""``migrate config``: read an FSDP1 configuration, write its FSDP2 equivalent and a per-option report.

Three sources are understood:

* an accelerate config YAML (``fsdp_config:`` with ``fsdp_*`` keys, ``mixed_precision``);
* Hugging Face Trainer arguments: the ``fsdp`` option string (``"hybrid_shard auto_wrap offload"``)
  plus the ``fsdp_config`` JSON, either together in one JSON/YAML file of training arguments
  or as ``--fsdp "..."`` with the ``fsdp_config`` JSON file as the source;
* a bridge YAML with ``backend: fsdp1``.

Each source is first read into an FSDP1 :class:`~fsdp_bridge.BridgeConfig` that holds the
source tool's *effective* settings (its defaults included: accelerate and the Trainer run FSDP1
without backward prefetch unless told otherwise).  What each option becomes on FSDP2 is then
read off :data:`fsdp_bridge.mapping.TABLE` through :func:`~fsdp_bridge.mapping.translate`; this
module holds no mapping of its own, only the spellings of the source tools.  Meaning is kept:
HYBRID_* stays hybrid (a 2D mesh), NO_SHARD stays replication.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fsdp_bridge.config import BridgeConfig, safe_yaml_load
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.mapping import TABLE, Outcome, translate
from fsdp_bridge.migrate._accelerate import accelerate_fsdp2
from fsdp_bridge.migrate._migration import Fsdp1Source, Migration, SourceOption
from fsdp_bridge.migrate._report import ConfigReport, OptionRow, Status, status_of
from fsdp_bridge.strategy import Backend, BackwardPrefetch, ShardingStrategy, parse_enum

__all__ = ["Migration", "migrate_config", "read_source", "write_outputs"]

# accelerate's own spellings (accelerate.utils.constants, 1.15): 1-based enum positions.
ACCELERATE_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
ACCELERATE_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
ACCELERATE_WRAP = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
ACCELERATE_STATE_DICT = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")

# The value used on FSDP2 when the table says an FSDP1 value has no FSDP2 equivalent.
_FALLBACK: dict[str, object] = {"backward_prefetch": BackwardPrefetch.PRE}


# ----------------------------------------------------------------------------------
# value parsing in the source tools' spellings
# ----------------------------------------------------------------------------------


class _Problems(list[Problem]):
    def add(self, key: str, value: object, allowed: str, fix: str = "") -> None:
        self.append(Problem(key, value, allowed, fix))


def _bool(key: str, value: object, problems: _Problems) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (str, int)) and str(value).strip().lower() in _TRUE + _FALSE:
        return str(value).strip().lower() in _TRUE
    problems.add(key, value, "true or false")
    return False


def _numbered(key: str, value: object, names: tuple[str, ...], problems: _Problems) -> str | None:
    """accelerate's fields take a name or its 1-based position (``4`` = HYBRID_SHARD)."""
    text = str(value).strip()
    if text.isdigit() and 1 <= int(text) <= len(names):
        return names[int(text) - 1]
    text = text.upper().removeprefix("SHARDINGSTRATEGY.").removeprefix("BACKWARDPREFETCH.")
    text = text.removeprefix("STATEDICTTYPE.").lstrip("_")
    if text in names:
        return text
    allowed = ", ".join(f"{n} ({i})" for i, n in enumerate(names, 1))
    problems.add(key, value, allowed)
    return None


def _strategy(key: str, value: object, problems: _Problems) -> ShardingStrategy | None:
    name = _numbered(key, value, ACCELERATE_STRATEGIES, problems)
    return None if name is None else parse_enum(ShardingStrategy, name)


def _prefetch(key: str, value: object, problems: _Problems) -> BackwardPrefetch | None:
    if value is None:
        return BackwardPrefetch.NONE
    name = _numbered(key, value, ACCELERATE_PREFETCH, problems)
    if name is None:
        return None
    return BackwardPrefetch.NONE if name == "NO_PREFETCH" else parse_enum(BackwardPrefetch, name)


def _mixed_precision(key: str, value: object, problems: _Problems) -> dict[str, str] | None:
    """accelerate / Trainer mixed precision with FSDP1: MixedPrecision(param, reduce and buffer dtype),
    all three in the chosen dtype (accelerate's FullyShardedDataParallelPlugin.set_mixed_precision)."""
    text = str(value).strip().lower()
    if text in ("no", "fp32", "none"):
        return None
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}.get(text)
    if dtype is None:
        problems.add(key, value, "no, fp16, bf16 or fp8")
        return None
    return {"param_dtype": dtype, "reduce_dtype": dtype, "buffer_dtype": dtype}


_NOT_FSDP_PRECISION = {
    "tf32": "TF32 matmuls (torch.backends.cuda.matmul.allow_tf32), set by the tool; not an FSDP option: unchanged",
    "bf16_full_eval": "evaluation runs the whole model in bf16 (the Trainer casts it); not an FSDP option: unchanged",
    "fp16_full_eval": "evaluation runs the whole model in fp16 (the Trainer casts it); not an FSDP option: unchanged",
    "half_precision_backend": "the Trainer's autocast backend; FSDP's mixed precision comes from bf16/fp16: unchanged",
    "torch_dtype": "the dtype the model is loaded in (its parameters' dtype on both backends), not a mixed-precision "
    "setting: unchanged",
    "bfloat16": "axolotl loads the model in bf16 (its parameters' dtype on both backends), not a mixed-precision "
    "setting: unchanged",
    "float16": "axolotl loads the model in fp16 (its parameters' dtype on both backends), not a mixed-precision "
    "setting: unchanged",
}
"""Precision keys of axolotl / Trainer arguments that are not FSDP's mixed precision: reported, not translated."""


def _precision_flags(data: Mapping[str, Any], src: Fsdp1Source, problems: _Problems, tool: str) -> None:
    """axolotl's and the Trainer's precision spellings -> FSDP1's MixedPrecision (what accelerate builds from
    them): ``bf16: true|auto``, ``fp16: true``, ``mixed_precision: bf16|fp16|no``; the precision keys that are
    not FSDP's mixed precision (``tf32``, ``torch_dtype``, ``bf16_full_eval``, ...) reported as such."""
    chosen: list[tuple[str, object, str]] = []  # (key, value as written, preset)
    for key in ("bf16", "fp16"):
        if key not in data or data[key] is None:
            continue
        value = data[key]
        if str(value).strip().lower() == "auto" and key == "bf16":
            chosen.append((key, value, "bf16"))
            who = "axolotl trains" if tool == "axolotl" else "axolotl's spelling, read here as axolotl reads it:"
            src.notes.append(
                f"bf16: auto: {who} in bf16 where the hardware supports it (bf16-capable GPUs), otherwise "
                "in fp16; the migrated config must be explicit and says bf16: write mixed_precision: fp16 for "
                "hardware without bf16"
            )
        elif _bool(key, value, problems):
            chosen.append((key, value, key))
        else:
            src.record(key, "", value, ignored=f"{key} off: no {key} mixed precision (the other flags decide)")
    if data.get("mixed_precision") is not None:
        value = data["mixed_precision"]
        preset = str(value).strip().lower()
        chosen.append(("mixed_precision", value, "fp32" if preset in ("no", "none", "fp32") else preset))
    presets = {preset for _, _, preset in chosen}
    if len(presets - {"fp32"}) > 1:
        given = ", ".join(f"{k}: {v}" for k, v, _ in chosen)
        problems.add(
            "bf16/fp16", given, "one of bf16 and fp16", f"{tool} refuses both too: keep the one you train with"
        )
        return
    for key, value, preset in chosen:
        src.fields["mixed_precision"] = _mixed_precision(key, preset, problems)
        src.record(key, "mixed_precision", value)
    if not chosen:
        src.fields["mixed_precision"] = None
        src.record("bf16", "mixed_precision", "false", default=True)
    for key, reason in _NOT_FSDP_PRECISION.items():
        if key in data:
            src.record(key, "", data[key], ignored=reason)


def _class_list(key: str, value: object, problems: _Problems) -> list[str]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) and i.strip().isidentifier() for i in items):
        problems.add(key, value, "module class names, as a list or comma-separated")
        return []
    return [i.strip() for i in items]


def _wrap(policy: str | None, classes: list[str] | None, min_params: int | None) -> object:
    """accelerate's auto-wrap semantics as a bridge ``wrap`` value.

    TRANSFORMER_BASED_WRAP without class names uses the model's ``_no_split_modules``
    (accelerate's ``set_auto_wrap_policy``), which is the bridge's ``wrap: auto``.
    """
    if policy == "TRANSFORMER_BASED_WRAP":
        return classes or "auto"
    if policy == "SIZE_BASED_WRAP":
        return {"min_num_params": min_params} if min_params else "none"
    return "none"


# ----------------------------------------------------------------------------------
# sources
# ----------------------------------------------------------------------------------


_UNSET: Any = object()


@dataclass(frozen=True)
class _Key:
    """One key of a source tool's FSDP1 config: the option it sets and how its value is read."""

    option: str
    """A BridgeConfig field, a table option with no field (``table``), or "" (no option)."""
    read: Callable[[str, object, _Problems], object] | None = None
    """Reader of a key that sets its option alone; None: read with the keys it combines with
    (strategy, wrap, prefetch, offload), by the source's own function."""
    table: bool = False
    """The option is a table option (``Fsdp1Source.table_values``), not a BridgeConfig field."""
    default: object = _UNSET
    """The source tool's value when the key is absent (reported as its default)."""
    skip_null: bool = False
    """A null value means the key is not set."""


def _state_dict_type(key: str, value: object, problems: _Problems) -> str | None:
    return _numbered(key, value, ACCELERATE_STATE_DICT, problems)


def _read_keys(
    keys: Mapping[str, _Key], cfg: Mapping[str, Any], src: Fsdp1Source, problems: _Problems, *, prefix: str, shown: str
) -> None:
    """Read every key with a reader, in the table's order: problems under ``prefix + key``, report
    rows under ``shown + key``."""
    for key, spec in keys.items():
        if spec.read is None:
            continue
        target = src.table_values if spec.table else src.fields
        if key in cfg and not (spec.skip_null and cfg[key] is None):
            target[spec.option] = spec.read(f"{prefix}{key}", cfg[key], problems)
            src.record(f"{shown}{key}", spec.option, cfg[key])
        elif key not in cfg and spec.default is not _UNSET:
            target[spec.option] = spec.default
            src.record(f"{shown}{key}", spec.option, spec.default, default=True)


def _unknown_source_keys(
    cfg: Mapping[str, Any], keys: Mapping[str, _Key], prefix: str, tool: str, problems: _Problems
) -> None:
    for key in cfg:
        if key not in keys:
            problems.add(
                f"{prefix}{key}", cfg[key], f"{tool} keys: {', '.join(keys)}", "remove it, or check its spelling"
            )


def _already_fsdp2(key: str, version: object, problems: _Problems) -> None:
    if str(version) != "1":
        problems.add(key, version, "1 (an FSDP1 config)", "this config is already FSDP2; nothing to migrate")


_ACCELERATE_KEYS: dict[str, _Key] = {
    # fsdp_config key -> BridgeConfig field or table option, in the order the report lists them
    "fsdp_sharding_strategy": _Key("strategy"),
    "fsdp_reshard_after_forward": _Key("strategy"),  # FSDP1 configs from newer accelerate: a strategy name
    "fsdp_auto_wrap_policy": _Key("wrap"),
    "fsdp_transformer_layer_cls_to_wrap": _Key("wrap"),
    "fsdp_min_num_params": _Key("wrap"),
    "fsdp_backward_prefetch": _Key("backward_prefetch"),
    "fsdp_backward_prefetch_policy": _Key("backward_prefetch"),  # older accelerate
    "fsdp_forward_prefetch": _Key("forward_prefetch", _bool),
    "fsdp_offload_params": _Key("cpu_offload", _bool),
    "fsdp_sync_module_states": _Key("sync_module_states", _bool),
    "fsdp_activation_checkpointing": _Key("activation_checkpointing", _bool),
    "fsdp_limit_all_gathers": _Key("limit_all_gathers", _bool),
    "fsdp_use_orig_params": _Key("use_orig_params", _bool, table=True),
    "fsdp_cpu_ram_efficient_loading": _Key("cpu_ram_efficient_loading", _bool, table=True),
    "fsdp_state_dict_type": _Key("state_dict_type", _state_dict_type, table=True),
    "fsdp_ignored_modules": _Key("ignored_modules", _class_list, skip_null=True),
    "fsdp_version": _Key(""),
}


def parse_accelerate(data: Mapping[str, Any], path: str) -> Fsdp1Source:
    """An accelerate config YAML with ``fsdp_version`` 1 (or none)."""
    problems = _Problems()
    fsdp = dict(data.get("fsdp_config") or {})
    src = Fsdp1Source(kind="accelerate", path=path, raw=copy.deepcopy(dict(data)))
    _already_fsdp2("fsdp_config.fsdp_version", fsdp.get("fsdp_version", 1), problems)
    _unknown_source_keys(fsdp, _ACCELERATE_KEYS, "fsdp_config.", "accelerate FSDP1", problems)
    if problems:
        raise ConfigError(problems, source=path)
    _accelerate_strategy(fsdp, src, problems)
    _accelerate_wrap(fsdp, src, problems)
    _accelerate_prefetch(fsdp, src, problems)
    _read_keys(_ACCELERATE_KEYS, fsdp, src, problems, prefix="fsdp_config.", shown="")
    if src.table_values.get("cpu_ram_efficient_loading"):
        src.fields["sync_module_states"] = True  # accelerate forces it on (FSDP1)
    if "mixed_precision" in data:
        src.fields["mixed_precision"] = _mixed_precision("mixed_precision", data["mixed_precision"], problems)
        src.record("mixed_precision", "mixed_precision", data["mixed_precision"])
    if "downcast_bf16" in data:
        reason = "accelerate reads it on TPUs only (XLA), not with torch FSDP: unchanged, carried into its YAML"
        src.record("downcast_bf16", "", data["downcast_bf16"], ignored=reason)
    src.used = {"fsdp_config", "mixed_precision", "downcast_bf16"}
    if problems:
        raise ConfigError(problems, source=path)
    return src


def _accelerate_strategy(fsdp: Mapping[str, Any], src: Fsdp1Source, problems: _Problems) -> None:
    """fsdp_sharding_strategy wins over an FSDP1-style fsdp_reshard_after_forward (as accelerate does)."""
    strategy = ShardingStrategy.FULL_SHARD
    for key in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
        if key in fsdp:
            parsed = _strategy(f"fsdp_config.{key}", fsdp[key], problems)
            if key == "fsdp_reshard_after_forward" and "fsdp_sharding_strategy" in fsdp:
                src.record(
                    key, "strategy", fsdp[key], ignored="accelerate uses fsdp_sharding_strategy when both are set"
                )
                continue
            strategy = parsed or strategy
            src.record(key, "strategy", fsdp[key])
    if not any(k in fsdp for k in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward")):
        src.record("fsdp_sharding_strategy", "strategy", "FULL_SHARD", default=True)
    src.fields["strategy"] = strategy


def _min_num_params(key: str, value: object, problems: _Problems) -> int | None:
    text = str(value).strip()
    if not isinstance(value, bool) and not text.isdigit():
        # 1e6 / 1000000.0: YAML reads `1e6` as a string, the tools read it as a number
        try:
            number = float(text)
        except ValueError:
            number = -1.0
        if number >= 0 and number == int(number):
            return int(number)
    if isinstance(value, bool) or not text.isdigit():
        problems.add(key, value, "an integer >= 0 (1000000 or 1e6)")
        return None
    return int(text)


def _accelerate_wrap(fsdp: Mapping[str, Any], src: Fsdp1Source, problems: _Problems) -> None:
    policy = None
    if "fsdp_auto_wrap_policy" in fsdp:
        policy = _numbered(
            "fsdp_config.fsdp_auto_wrap_policy", fsdp["fsdp_auto_wrap_policy"], ACCELERATE_WRAP, problems
        )
        src.record("fsdp_auto_wrap_policy", "wrap", fsdp["fsdp_auto_wrap_policy"])
    else:
        src.record("fsdp_auto_wrap_policy", "wrap", "NO_WRAP", default=True)
    classes = None
    if "fsdp_transformer_layer_cls_to_wrap" in fsdp:
        value = fsdp["fsdp_transformer_layer_cls_to_wrap"]
        classes = _class_list("fsdp_config.fsdp_transformer_layer_cls_to_wrap", value, problems)
        ignored = "" if policy == "TRANSFORMER_BASED_WRAP" else "accelerate reads it only with TRANSFORMER_BASED_WRAP"
        src.record("fsdp_transformer_layer_cls_to_wrap", "wrap", value, ignored=ignored)
    min_params = None
    if "fsdp_min_num_params" in fsdp:
        min_params = _min_num_params("fsdp_config.fsdp_min_num_params", fsdp["fsdp_min_num_params"], problems)
        ignored = "" if policy == "SIZE_BASED_WRAP" else "accelerate reads it only with SIZE_BASED_WRAP"
        src.record("fsdp_min_num_params", "wrap", fsdp["fsdp_min_num_params"], ignored=ignored)
    src.fields["wrap"] = _wrap(policy, classes, min_params)
    _show_policy_arguments(src, "fsdp_auto_wrap_policy", policy, classes, min_params)


def _show_policy_arguments(
    src: Fsdp1Source, key: str, policy: str | None, classes: list[str] | None, min_params: int | None
) -> None:
    """The auto-wrap policy's row shows the arguments the policy read, as in
    ``SIZE_BASED_WRAP (min_num_params=1000000)``: the report says which policy became which ``wrap``."""
    if policy == "TRANSFORMER_BASED_WRAP":
        arguments = f"transformer_layer_cls_to_wrap={','.join(classes)}" if classes else "model's _no_split_modules"
    elif policy == "SIZE_BASED_WRAP":
        arguments = f"min_num_params={min_params}" if min_params else "min_num_params not set: no wrapping"
    else:
        return
    for i, option in enumerate(src.options):
        if option.key == key and not option.ignored_because:
            shown = f"{_show(option.value)} ({arguments})"
            src.options[i] = SourceOption(option.key, shown, option.option, option.default)
            return


def _accelerate_prefetch(fsdp: Mapping[str, Any], src: Fsdp1Source, problems: _Problems) -> None:
    prefetch_keys = [k for k in ("fsdp_backward_prefetch", "fsdp_backward_prefetch_policy") if k in fsdp]
    for key in prefetch_keys:
        parsed = _prefetch(f"fsdp_config.{key}", fsdp[key], problems)
        if parsed is not None:
            src.fields["backward_prefetch"] = parsed
        src.record(key, "backward_prefetch", fsdp[key])
    if not prefetch_keys:
        # accelerate's FSDP1 default is no backward prefetch.
        src.fields["backward_prefetch"] = BackwardPrefetch.NONE
        src.record("fsdp_backward_prefetch", "backward_prefetch", "NO_PREFETCH", default=True)


_TRAINER_KEYS: dict[str, _Key] = {
    # fsdp_config key (without fsdp_) -> BridgeConfig field or table option, in the report's order.
    # Defaults are transformers' FSDP1 defaults (sync_module_states true).
    "version": _Key(""),
    "reshard_after_forward": _Key("strategy"),
    "cpu_offload": _Key("cpu_offload"),
    "min_num_params": _Key("wrap"),
    "transformer_layer_cls_to_wrap": _Key("wrap"),
    "auto_wrap_policy": _Key("wrap"),
    "backward_prefetch": _Key("backward_prefetch"),
    "forward_prefetch": _Key("forward_prefetch", _bool),
    "sync_module_states": _Key("sync_module_states", _bool, default=True),
    "activation_checkpointing": _Key("activation_checkpointing", _bool),
    "limit_all_gathers": _Key("limit_all_gathers", _bool),
    "use_orig_params": _Key("use_orig_params", _bool, table=True),
    "cpu_ram_efficient_loading": _Key("cpu_ram_efficient_loading", _bool, table=True),
    "state_dict_type": _Key("state_dict_type", _state_dict_type, table=True),
    "xla": _Key(""),
    "xla_fsdp_v2": _Key(""),
    "xla_fsdp_grad_ckpt": _Key(""),
}
_TRAINER_ITEMS = (
    "full_shard",
    "shard_grad_op",
    "no_shard",
    "hybrid_shard",
    "hybrid_shard_zero2",
    "offload",
    "auto_wrap",
)


def parse_trainer(
    fsdp: object, fsdp_config: Mapping[str, Any], path: str, *, training_args: Mapping[str, Any] | None = None
) -> Fsdp1Source:
    """Trainer arguments ``fsdp`` (string or list) and ``fsdp_config`` (keys with or without ``fsdp_``),
    read with the semantics of transformers' FSDP1 path (``fsdp_config["version"] = 1``)."""
    problems = _Problems()
    training_args = dict(training_args or {})
    cfg = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in dict(fsdp_config).items()}
    src = Fsdp1Source(kind="trainer", path=path, raw={"fsdp": fsdp, "fsdp_config": dict(fsdp_config), **training_args})
    items = _trainer_items(fsdp, problems)
    _unknown_source_keys(cfg, _TRAINER_KEYS, "fsdp_config.", "Trainer fsdp_config", problems)
    _already_fsdp2("fsdp_config.version", cfg.get("version", 1), problems)
    for key in ("xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt"):
        if key in cfg and _bool(f"fsdp_config.{key}", cfg[key], problems):
            problems.add(
                f"fsdp_config.{key}",
                cfg[key],
                "false",
                "XLA FSDP is not torch FSDP1; fsdp_bridge migrates torch's FullyShardedDataParallel",
            )
    if problems:
        raise ConfigError(problems, source=path)
    _trainer_strategy(items, cfg, src, problems)
    if "offload" in items:
        src.fields["cpu_offload"] = True
        src.record("fsdp: offload", "cpu_offload", "offload")
    if "cpu_offload" in cfg:
        src.fields["cpu_offload"] = src.fields.get("cpu_offload") or _bool(
            "fsdp_config.cpu_offload", cfg["cpu_offload"], problems
        )
        src.record("fsdp_config.cpu_offload", "cpu_offload", cfg["cpu_offload"])
    _trainer_wrap(items, cfg, src, problems)
    if "backward_prefetch" in cfg:
        src.fields["backward_prefetch"] = (
            _prefetch("fsdp_config.backward_prefetch", cfg["backward_prefetch"], problems) or BackwardPrefetch.NONE
        )
        src.record("fsdp_config.backward_prefetch", "backward_prefetch", cfg["backward_prefetch"])
    else:
        src.fields["backward_prefetch"] = BackwardPrefetch.NONE  # transformers' FSDP1 default: NO_PREFETCH
        src.record("fsdp_config.backward_prefetch", "backward_prefetch", "NO_PREFETCH", default=True)
    _read_keys(_TRAINER_KEYS, cfg, src, problems, prefix="fsdp_config.", shown="fsdp_config.")
    if src.table_values.get("cpu_ram_efficient_loading"):
        src.fields["sync_module_states"] = True
    if training_args:
        _precision_flags(training_args, src, problems, "the Trainer")
        src.used |= {"fsdp", "fsdp_config", "bf16", "fp16", "mixed_precision", *_NOT_FSDP_PRECISION}
        src.used |= set(_LEGACY_TRAINER_FLAGS)
    if problems:
        raise ConfigError(problems, source=path)
    return src


def _trainer_items(fsdp: object, problems: _Problems) -> list[Any]:
    """The words of the Trainer's ``fsdp`` option (a string or a list)."""
    items = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, (list, tuple)) else None
    if items is None:
        problems.add("fsdp", fsdp, f"a string or list of: {', '.join(_TRAINER_ITEMS)}")
        return []
    for item in items:
        if item not in _TRAINER_ITEMS:
            problems.add("fsdp", item, ", ".join(_TRAINER_ITEMS))
    return items


def _trainer_strategy(items: list[Any], cfg: Mapping[str, Any], src: Fsdp1Source, problems: _Problems) -> None:
    strategies = [i for i in items if i not in ("offload", "auto_wrap")]
    strategy = ShardingStrategy.FULL_SHARD
    for item in strategies:
        strategy = parse_enum(ShardingStrategy, item)
        src.record(f"fsdp: {item}", "strategy", item)
    if "reshard_after_forward" in cfg:
        value = cfg["reshard_after_forward"]
        if strategies:
            ignored = "the fsdp option string's strategy is applied first (setdefault)"
            src.record("fsdp_config.reshard_after_forward", "strategy", value, ignored=ignored)
        else:
            strategy = _strategy("fsdp_config.reshard_after_forward", value, problems) or strategy
            src.record("fsdp_config.reshard_after_forward", "strategy", value)
    if not strategies and "reshard_after_forward" not in cfg:
        src.record("fsdp: (no strategy)", "strategy", "full_shard", default=True)
    src.fields["strategy"] = strategy


def _trainer_wrap(items: list[Any], cfg: Mapping[str, Any], src: Fsdp1Source, problems: _Problems) -> None:
    # transformers' FSDP1 rule: min_num_params > 0 (and no layer classes) selects SIZE_BASED_WRAP,
    # otherwise TRANSFORMER_BASED_WRAP ("auto_wrap" is a no-op since v5).
    sized = str(cfg.get("min_num_params", "0")).strip() not in ("0", "") and "transformer_layer_cls_to_wrap" not in cfg
    default_policy = "SIZE_BASED_WRAP" if sized else "TRANSFORMER_BASED_WRAP"
    policy = _numbered(
        "fsdp_config.auto_wrap_policy", cfg.get("auto_wrap_policy", default_policy), ACCELERATE_WRAP, problems
    )
    if "auto_wrap" in items:
        src.record("fsdp: auto_wrap", "wrap", "auto_wrap")
    if "auto_wrap_policy" in cfg:
        src.record("fsdp_config.auto_wrap_policy", "wrap", cfg["auto_wrap_policy"])
    elif "auto_wrap" not in items:
        src.record("fsdp_config.auto_wrap_policy", "wrap", default_policy, default=True)
    classes = None
    if "transformer_layer_cls_to_wrap" in cfg:
        value = cfg["transformer_layer_cls_to_wrap"]
        classes = _class_list("fsdp_config.transformer_layer_cls_to_wrap", value, problems)
        ignored = "" if policy == "TRANSFORMER_BASED_WRAP" else "read only with TRANSFORMER_BASED_WRAP"
        src.record("fsdp_config.transformer_layer_cls_to_wrap", "wrap", value, ignored=ignored)
    min_params = None
    if "min_num_params" in cfg:
        min_params = _min_num_params("fsdp_config.min_num_params", cfg["min_num_params"], problems)
        ignored = "" if policy == "SIZE_BASED_WRAP" else "read only with SIZE_BASED_WRAP"
        src.record("fsdp_config.min_num_params", "wrap", cfg["min_num_params"], ignored=ignored)
    src.fields["wrap"] = _wrap(policy, classes, min_params)
    _show_policy_arguments(src, "fsdp_config.auto_wrap_policy", policy, classes, min_params)


def parse_bridge(data: Mapping[str, Any], path: str) -> Fsdp1Source:
    """A bridge YAML (fields at top level or under ``bridge:``) with ``backend: fsdp1``."""
    if isinstance(data.get("bridge"), Mapping):
        data = data["bridge"]
    config = BridgeConfig.from_dict(data, source=path)
    if config.backend is not Backend.FSDP1:
        raise ConfigError(
            [
                Problem(
                    "backend", config.backend.value, "fsdp1", "this config already runs on FSDP2; nothing to migrate"
                )
            ],
            source=path,
        )
    src = Fsdp1Source(kind="bridge", path=path, raw=dict(data))
    src.fields = {k: getattr(config, k) for k in BridgeConfig.field_names()}
    src.options = [SourceOption(k, v, k) for k, v in data.items() if k != "backend"]
    return src


def read_source(path: str | os.PathLike[str], *, fsdp: str | None = None) -> Fsdp1Source:
    """Read and recognise an FSDP1 configuration file.

    Args:
        path: an accelerate YAML, a Trainer ``fsdp_config`` JSON or command line, an axolotl YAML
            or a bridge YAML with ``backend: fsdp1``.
        fsdp: the Trainer's ``fsdp`` option string, when ``path`` is its ``fsdp_config`` JSON.

    Returns:
        The recognised source: its kind, the bridge fields read and one entry per option.

    Raises:
        ConfigError: the file cannot be read, is not a recognised FSDP1 config, or holds invalid values.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError([Problem("SRC", str(path), "a readable UTF-8 config file", str(err))]) from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError, ValueError) as err:
            raise ConfigError([Problem("SRC", str(path), "valid JSON", str(err)[:300])]) from None
    else:
        data = safe_yaml_load(text, source=str(path))
    if not isinstance(data, Mapping):
        if "--fsdp" in text:
            return parse_trainer_command(text, str(path), base=path.parent)
        raise ConfigError(
            [
                Problem(
                    "SRC",
                    str(path),
                    "a mapping (accelerate YAML, Trainer arguments, axolotl YAML, "
                    "bridge YAML) or a command line with Trainer --fsdp flags",
                )
            ]
        )
    if fsdp is not None:
        return parse_trainer(fsdp, data, str(path))
    axolotl_keys = ("base_model", "sequence_len", "micro_batch_size")  # axolotl's own, never TrainingArguments'
    if (
        "fsdp" in data
        and isinstance(data.get("fsdp_config") or {}, Mapping)
        and (_accelerate_style(data.get("fsdp_config") or {}) or any(k in data for k in axolotl_keys))
    ):
        return parse_axolotl(data, str(path))
    if "fsdp" in data and "fsdp_config" not in data:
        # TrainingArguments with the FSDP1-era flags and no fsdp_config (the most common recipes)
        return parse_trainer(data["fsdp"], _legacy_trainer_config(data), str(path), training_args=data)
    if "fsdp_config" in data and "fsdp" in data:
        fsdp_config = data["fsdp_config"] or {}
        if isinstance(fsdp_config, str):  # TrainingArguments accept a path to the JSON
            return parse_trainer(data["fsdp"], read_json(path.parent / fsdp_config), str(path), training_args=data)
        return parse_trainer(data["fsdp"], fsdp_config, str(path), training_args=data)
    if "fsdp_config" in data or "distributed_type" in data:
        return parse_accelerate(data, str(path))
    if "backend" in data or isinstance(data.get("bridge"), Mapping):
        return parse_bridge(data, str(path))
    raise ConfigError(
        [
            Problem(
                "SRC",
                str(path),
                "an accelerate config (with fsdp_config:), Trainer arguments (fsdp and fsdp_config), "
                "or a bridge YAML with backend: fsdp1",
                "for a Trainer fsdp_config JSON alone, pass the fsdp option string with --fsdp",
            )
        ]
    )


_LEGACY_TRAINER_FLAGS = {
    "fsdp_transformer_layer_cls_to_wrap": "transformer_layer_cls_to_wrap",
    "fsdp_min_num_params": "min_num_params",
}
"""TrainingArguments' FSDP1-era flags, which transformers moves into ``fsdp_config``."""


def _legacy_trainer_config(args: Mapping[str, Any]) -> dict[str, Any]:
    return {new: args[old] for old, new in _LEGACY_TRAINER_FLAGS.items() if args.get(old) not in (None, "", 0, "0")}


def parse_trainer_command(text: str, path: str, *, base: Path) -> Fsdp1Source:
    """A shell command or script launching a Trainer: ``--fsdp "full_shard auto_wrap"
    --fsdp_transformer_layer_cls_to_wrap X [--fsdp_config JSON_OR_PATH] [--bf16 True] ...``."""
    try:
        # a line continuation at the very end of the file (no newline after it) continues into nothing, as bash
        # reads it; shlex would refuse the lone backslash
        joined = text.replace("\\\n", " ")
        odd = (len(joined) - len(joined.rstrip("\\"))) % 2 == 1  # a lone backslash, not an escaped one
        tokens = shlex.split(joined[:-1] if odd else joined, comments=True)
    except ValueError as err:
        raise ConfigError([Problem("SRC", path, "a shell command line", str(err))]) from None
    args: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.startswith("--"):
            key, eq, value = token[2:].partition("=")
            if not eq:
                if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                    value, i = tokens[i + 1], i + 1
                else:
                    value = "true"  # a bare flag (--bf16)
            args[key.replace("-", "_")] = value
        i += 1
    if "fsdp" not in args:
        raise ConfigError(
            [
                Problem(
                    "SRC",
                    path,
                    'a command line with --fsdp "full_shard auto_wrap" (or another strategy)',
                    "no --fsdp flag found",
                )
            ]
        )
    fsdp_config: dict[str, Any] = {}
    raw_config = args.get("fsdp_config")
    if raw_config:
        if raw_config.lstrip().startswith("{"):
            try:
                fsdp_config = json.loads(raw_config)
            except json.JSONDecodeError as err:
                raise ConfigError(
                    [Problem("--fsdp_config", raw_config, "JSON or a path to a JSON file", str(err))]
                ) from None
        else:
            fsdp_config = read_json(base / raw_config)
    fsdp_config = {**_legacy_trainer_config(args), **fsdp_config}
    return parse_trainer(args["fsdp"], fsdp_config, path, training_args=args)


_AXOLOTL_ITEMS = {
    "full_shard": "FULL_SHARD",
    "shard_grad_op": "SHARD_GRAD_OP",
    "no_shard": "NO_SHARD",
    "hybrid_shard": "HYBRID_SHARD",
    "hybrid_shard_zero2": "_HYBRID_SHARD_ZERO2",
}


def _accelerate_style(fsdp_config: Mapping[str, Any]) -> bool:
    """axolotl's fsdp_config holds accelerate's keys (fsdp_offload_params, fsdp_sharding_strategy, ...)."""
    return any(k in _ACCELERATE_KEYS and k.removeprefix("fsdp_") not in _TRAINER_KEYS for k in fsdp_config)


def parse_axolotl(data: Mapping[str, Any], path: str) -> Fsdp1Source:
    """An axolotl YAML: a ``fsdp:`` list (strategy, offload, auto_wrap) and accelerate's keys under
    ``fsdp_config:``, which axolotl hands to accelerate. The list fills what the config leaves out."""
    fsdp_config = dict(data.get("fsdp_config") or {})
    raw = data.get("fsdp")
    items = raw.split() if isinstance(raw, str) else list(raw) if isinstance(raw, (list, tuple)) else []
    for item in items:
        item = str(item).strip().lower()
        if item in _AXOLOTL_ITEMS and "fsdp_sharding_strategy" not in fsdp_config:
            fsdp_config["fsdp_sharding_strategy"] = _AXOLOTL_ITEMS[item]
        elif item == "offload":
            if fsdp_config.get("fsdp_offload_params", True) is not True:
                raise ConfigError(
                    [
                        Problem(
                            "fsdp_config.fsdp_offload_params",
                            fsdp_config["fsdp_offload_params"],
                            "true, as the fsdp list asks for offload",
                            "the two disagree: remove 'offload' from fsdp, or set fsdp_offload_params: true",
                        )
                    ],
                    source=path,
                )
            fsdp_config["fsdp_offload_params"] = True
        elif item == "auto_wrap" and "fsdp_auto_wrap_policy" not in fsdp_config:
            fsdp_config["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
        elif item not in (*_AXOLOTL_ITEMS, "offload", "auto_wrap"):
            raise ConfigError(
                [Problem("fsdp", item, ", ".join((*_AXOLOTL_ITEMS, "offload", "auto_wrap")))], source=path
            )
    src = parse_accelerate({"fsdp_config": fsdp_config}, path)
    src.kind = "axolotl"
    src.raw = dict(data)
    problems = _Problems()
    _precision_flags(data, src, problems, "axolotl")  # axolotl hands bf16/fp16 to accelerate's mixed_precision
    if problems:
        raise ConfigError(problems, source=path)
    src.used = {"fsdp", "fsdp_config", "bf16", "fp16", "mixed_precision", *_NOT_FSDP_PRECISION}
    return src


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError([Problem("fsdp_config", str(path), "a readable JSON file", str(err))]) from None
    if not isinstance(data, dict):
        raise ConfigError([Problem("fsdp_config", str(path), "a JSON object")])
    return data


# ----------------------------------------------------------------------------------
# migration
# ----------------------------------------------------------------------------------


def _table_only(option: str) -> tuple[Outcome, str]:
    """FSDP2 outcome of an FSDP1 option with no BridgeConfig field, from the table."""
    for rule in TABLE:
        if rule.option == option and rule.when is None:
            return rule.fsdp2.outcome, rule.fsdp2.text
    raise KeyError(f"the mapping table has no row for {option!r}")  # a bug: every option here has a row


def _target(config: BridgeConfig, option: str) -> str:
    values = config.to_dict()
    return f"{option}: {json.dumps(values[option])}" if option in values else "-"


def _table_target(option: str, value: object) -> str:
    if option == "state_dict_type":
        kind = "full" if value == "FULL_STATE_DICT" else "sharded"
        return f'fsdp_bridge.save_checkpoint(..., kind="{kind}")'
    if option == "cpu_ram_efficient_loading":
        return "sync_module_states: true" if value else "-"
    return "-"


def migrate_config(path: str | os.PathLike[str], *, fsdp: str | None = None) -> Migration:
    """Read an FSDP1 config and work out its FSDP2 equivalent and the per-option report.

    Args:
        path: the FSDP1 config (accelerate YAML, Trainer ``fsdp_config`` JSON or command line,
            axolotl YAML, or a bridge YAML with ``backend: fsdp1``).
        fsdp: the Trainer's ``fsdp`` option string, when ``path`` is its ``fsdp_config`` JSON.

    Returns:
        The :class:`Migration`: the source read, the FSDP1 and FSDP2 ``BridgeConfig``, the
        per-option :class:`ConfigReport` and, for accelerate sources, the accelerate FSDP2 YAML.

    Raises:
        ConfigError: the file cannot be read or recognised, holds invalid values, or asks for
            something FSDP2 does not support and no substitute is known.
    """
    src = read_source(path, fsdp=fsdp)
    fields = dict(src.fields)
    fields["backend"] = Backend.FSDP1
    fsdp1 = BridgeConfig.from_dict(fields, source=src.path)

    fsdp1_on_2 = translate(fsdp1, Backend.FSDP2)
    fallbacks = {e.option: _FALLBACK[e.option] for e in fsdp1_on_2.unsupported if e.option in _FALLBACK}
    missing = [e for e in fsdp1_on_2.unsupported if e.option not in _FALLBACK]
    if missing:  # the table gained an unsupported FSDP2 case this module does not know a substitute for
        raise ConfigError(
            [Problem(e.option, str(e.value), "a value FSDP2 supports", e.text) for e in missing], source=src.path
        )
    fsdp2 = fsdp1.replace(backend=Backend.FSDP2, **fallbacks)

    report = ConfigReport(source=src.path, kind=src.kind)
    for o in src.options:
        value = f"(not set: {o.value})" if o.default else _show(o.value)
        if o.ignored_because:
            reason = o.ignored_because if not o.option else f"ignored by the source too: {o.ignored_because}"
            report.rows.append(OptionRow(o.key, value, Status.NOT_NEEDED, "-", reason))
            continue
        if o.option in BridgeConfig.field_names():
            # Sub-options left unset (mixed_precision.output_dtype: null) say nothing about the source.
            entries = [
                e
                for e in fsdp1_on_2.entries
                if e.option == o.option or (e.option.startswith(o.option + ".") and e.value is not None)
            ]
            for e in entries:
                key = o.key if e.option == o.option else f"{o.key} ({e.option})"
                report.rows.append(OptionRow(key, value, status_of(e.outcome), _target(fsdp2, o.option), e.text))
            if not entries:  # the table reports only options that change something: say so, never drop it
                report.rows.append(
                    OptionRow(
                        o.key,
                        value,
                        Status.MAPPED,
                        _target(fsdp2, o.option),
                        "the default on both backends: nothing to translate",
                    )
                )
        else:
            outcome, text = _table_only(o.option)
            target = _table_target(o.option, src.table_values.get(o.option))
            report.rows.append(OptionRow(o.key, value, status_of(outcome), target, text))
    report.rows.extend(_unused_rows(src))
    report.notes.extend(src.notes)
    report.notes.append(f"backend: fsdp1 -> fsdp2 (bridge YAML); {_strategy_note(fsdp2)}")
    if fallbacks:
        report.notes.append(
            "no FSDP2 equivalent, replaced by the nearest FSDP2 behaviour: "
            + ", ".join(f"{k} -> {_show(v)}" for k, v in fallbacks.items())
        )
    migration = Migration(source=src, fsdp1=fsdp1, fsdp2=fsdp2, report=report)
    if src.kind == "accelerate":
        migration.accelerate = accelerate_fsdp2(migration)
    return migration


def _unused_rows(src: Fsdp1Source) -> list[OptionRow]:
    """A row for every top-level key of the source the migration did not read: reported, never dropped."""
    if src.kind not in ("accelerate", "axolotl", "trainer"):
        return []  # a bridge YAML's keys are all fields (unknown ones are refused)
    where = {
        "accelerate": "carried unchanged into the accelerate FSDP2 YAML",
        "axolotl": "stays in axolotl's own config",
        "trainer": "stays in the Trainer's arguments",
    }[src.kind]
    rows = []
    for key, value in src.raw.items():
        if key not in src.used:
            reason = f"not an FSDP or mixed-precision setting: not read by the migration; {where}"
            rows.append(OptionRow(str(key), _show(value), Status.NOT_NEEDED, "-", reason))
    return rows


def _strategy_note(config: BridgeConfig) -> str:
    s = config.strategy
    if s is ShardingStrategy.NO_SHARD:
        return "NO_SHARD stays replication: a (world, 1) mesh, every rank holds the whole model"
    if s.is_hybrid:
        return f"{s.name} stays hybrid: a 2D (replicate, shard) mesh"
    return f"{s.name}: a 1D mesh"


def _show(value: object) -> str:
    if hasattr(value, "value") and not isinstance(value, (str, int)):
        return str(value.value)
    return str(value)


def _header(command: str) -> str:
    return f"# {command}\n# Written by `fsdp-bridge migrate config`; see the .migration.md report beside it.\n"


def write_outputs(migration: Migration, dst: str | os.PathLike[str]) -> list[str]:
    """Write the bridge YAML to ``dst``, the accelerate FSDP2 YAML beside it (accelerate sources),
    and the report as ``<dst stem>.migration.md``.

    Args:
        migration: what :func:`migrate_config` returned; its report's ``outputs`` are set.
        dst: the bridge YAML to write (its directory is created).

    Returns:
        The paths written, the bridge YAML first and the report last.
    """
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    dst.write_text(_header(f"fsdp-bridge explain {dst.name}") + migration.fsdp2.to_yaml())
    written.append(str(dst))
    if migration.accelerate is not None:
        acc = dst.with_name(dst.stem + ".accelerate.yaml")
        acc.write_text(
            _header(f"accelerate launch --config_file {acc.name} train.py")
            + yaml.safe_dump(migration.accelerate, sort_keys=False)
        )
        written.append(str(acc))
    report = dst.with_name(dst.stem + ".migration.md")
    migration.report.outputs = [*written, str(report)]
    report.write_text(migration.report.to_markdown())
    written.append(str(report))
    return written


def default_output(src: str | os.PathLike[str]) -> Path:
    """``train_fsdp1.yaml`` -> ``train_fsdp1.fsdp2.yaml`` beside it."""
    path = Path(src)
    return path.with_name(path.stem + ".fsdp2.yaml")
