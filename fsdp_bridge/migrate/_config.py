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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fsdp_bridge.config import BridgeConfig, safe_yaml_load
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.mapping import TABLE, Outcome, translate
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


@dataclass(frozen=True)
class SourceOption:
    """One option of the source, tied to a BridgeConfig field or a table option."""

    key: str
    """As the source spells it."""
    value: object
    """As given (or the tool's default, when ``default`` is true)."""
    option: str
    """A BridgeConfig field (``strategy``) or a table option with no field (``use_orig_params``)."""
    default: bool = False
    """Not set in the source; the tool's default is what FSDP1 ran with."""
    ignored_because: str = ""
    """Set when the source tool itself ignores the key (e.g. min_num_params with transformer wrap)."""


@dataclass
class Fsdp1Source:
    kind: str
    path: str
    fields: dict[str, Any] = field(default_factory=dict)
    options: list[SourceOption] = field(default_factory=list)
    table_values: dict[str, object] = field(default_factory=dict)
    """Values of table-only options (state_dict_type, use_orig_params, ...)."""
    raw: dict[str, Any] = field(default_factory=dict)
    """The whole source document (accelerate: re-emitted with the FSDP2 fsdp_config)."""


@dataclass
class Migration:
    """The result of :func:`migrate_config`."""

    source: Fsdp1Source
    fsdp1: BridgeConfig
    """What the source ran, as a bridge config on FSDP1."""
    fsdp2: BridgeConfig
    """The FSDP2 equivalent (written as the bridge YAML)."""
    report: ConfigReport
    accelerate: dict[str, Any] | None = None
    """The accelerate FSDP2 YAML document (accelerate sources only)."""


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


_ACCELERATE_KEYS: dict[str, str] = {
    # fsdp_config key -> BridgeConfig field or table option
    "fsdp_sharding_strategy": "strategy",
    "fsdp_reshard_after_forward": "strategy",  # FSDP1 configs from newer accelerate: a strategy name
    "fsdp_auto_wrap_policy": "wrap",
    "fsdp_transformer_layer_cls_to_wrap": "wrap",
    "fsdp_min_num_params": "wrap",
    "fsdp_backward_prefetch": "backward_prefetch",
    "fsdp_backward_prefetch_policy": "backward_prefetch",  # older accelerate
    "fsdp_forward_prefetch": "forward_prefetch",
    "fsdp_offload_params": "cpu_offload",
    "fsdp_state_dict_type": "state_dict_type",
    "fsdp_sync_module_states": "sync_module_states",
    "fsdp_use_orig_params": "use_orig_params",
    "fsdp_cpu_ram_efficient_loading": "cpu_ram_efficient_loading",
    "fsdp_activation_checkpointing": "activation_checkpointing",
    "fsdp_ignored_modules": "ignored_modules",
    "fsdp_limit_all_gathers": "limit_all_gathers",
    "fsdp_version": "",
}


def parse_accelerate(data: Mapping[str, Any], path: str) -> Fsdp1Source:
    """An accelerate config YAML with ``fsdp_version`` 1 (or none)."""
    problems = _Problems()
    fsdp = dict(data.get("fsdp_config") or {})
    src = Fsdp1Source(kind="accelerate", path=path, raw=copy.deepcopy(dict(data)))
    version = fsdp.get("fsdp_version", 1)
    if str(version) != "1":
        problems.add(
            "fsdp_config.fsdp_version",
            version,
            "1 (an FSDP1 config)",
            "this config is already FSDP2; nothing to migrate",
        )
    for key in fsdp:
        if key not in _ACCELERATE_KEYS:
            problems.add(
                f"fsdp_config.{key}",
                fsdp[key],
                f"accelerate FSDP1 keys: {', '.join(_ACCELERATE_KEYS)}",
                "remove it, or check its spelling",
            )
    if problems:
        raise ConfigError(problems, source=path)

    def opt(key: str, option: str, value: object, *, default: bool = False, ignored: str = "") -> None:
        src.options.append(SourceOption(key, value, option, default, ignored))

    # strategy: fsdp_sharding_strategy wins over an FSDP1-style fsdp_reshard_after_forward (as accelerate does)
    strategy = ShardingStrategy.FULL_SHARD
    for key in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
        if key in fsdp:
            parsed = _strategy(f"fsdp_config.{key}", fsdp[key], problems)
            if key == "fsdp_reshard_after_forward" and "fsdp_sharding_strategy" in fsdp:
                opt(key, "strategy", fsdp[key], ignored="accelerate uses fsdp_sharding_strategy when both are set")
                continue
            strategy = parsed or strategy
            opt(key, "strategy", fsdp[key])
    if not any(k in fsdp for k in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward")):
        opt("fsdp_sharding_strategy", "strategy", "FULL_SHARD", default=True)
    src.fields["strategy"] = strategy

    policy = None
    if "fsdp_auto_wrap_policy" in fsdp:
        policy = _numbered(
            "fsdp_config.fsdp_auto_wrap_policy", fsdp["fsdp_auto_wrap_policy"], ACCELERATE_WRAP, problems
        )
        opt("fsdp_auto_wrap_policy", "wrap", fsdp["fsdp_auto_wrap_policy"])
    else:
        opt("fsdp_auto_wrap_policy", "wrap", "NO_WRAP", default=True)
    classes = None
    if "fsdp_transformer_layer_cls_to_wrap" in fsdp:
        classes = _class_list(
            "fsdp_config.fsdp_transformer_layer_cls_to_wrap", fsdp["fsdp_transformer_layer_cls_to_wrap"], problems
        )
        ignored = "" if policy == "TRANSFORMER_BASED_WRAP" else "accelerate reads it only with TRANSFORMER_BASED_WRAP"
        opt("fsdp_transformer_layer_cls_to_wrap", "wrap", fsdp["fsdp_transformer_layer_cls_to_wrap"], ignored=ignored)
    min_params = None
    if "fsdp_min_num_params" in fsdp:
        raw_min = fsdp["fsdp_min_num_params"]
        if isinstance(raw_min, bool) or not str(raw_min).strip().isdigit():
            problems.add("fsdp_config.fsdp_min_num_params", raw_min, "an integer >= 0")
        else:
            min_params = int(str(raw_min).strip())
        ignored = "" if policy == "SIZE_BASED_WRAP" else "accelerate reads it only with SIZE_BASED_WRAP"
        opt("fsdp_min_num_params", "wrap", raw_min, ignored=ignored)
    src.fields["wrap"] = _wrap(policy, classes, min_params)

    prefetch_keys = [k for k in ("fsdp_backward_prefetch", "fsdp_backward_prefetch_policy") if k in fsdp]
    for key in prefetch_keys:
        parsed_prefetch = _prefetch(f"fsdp_config.{key}", fsdp[key], problems)
        if parsed_prefetch is not None:
            src.fields["backward_prefetch"] = parsed_prefetch
        opt(key, "backward_prefetch", fsdp[key])
    if not prefetch_keys:
        # accelerate's FSDP1 default is no backward prefetch.
        src.fields["backward_prefetch"] = BackwardPrefetch.NONE
        opt("fsdp_backward_prefetch", "backward_prefetch", "NO_PREFETCH", default=True)

    for key, name in (
        ("fsdp_forward_prefetch", "forward_prefetch"),
        ("fsdp_offload_params", "cpu_offload"),
        ("fsdp_sync_module_states", "sync_module_states"),
        ("fsdp_activation_checkpointing", "activation_checkpointing"),
        ("fsdp_limit_all_gathers", "limit_all_gathers"),
    ):
        if key in fsdp:
            src.fields[name] = _bool(f"fsdp_config.{key}", fsdp[key], problems)
            opt(key, name, fsdp[key])
    for key, name in (
        ("fsdp_use_orig_params", "use_orig_params"),
        ("fsdp_cpu_ram_efficient_loading", "cpu_ram_efficient_loading"),
    ):
        if key in fsdp:
            src.table_values[name] = _bool(f"fsdp_config.{key}", fsdp[key], problems)
            opt(key, name, fsdp[key])
    if src.table_values.get("cpu_ram_efficient_loading"):
        src.fields["sync_module_states"] = True  # accelerate forces it on (FSDP1)
    if "fsdp_state_dict_type" in fsdp:
        src.table_values["state_dict_type"] = _numbered(
            "fsdp_config.fsdp_state_dict_type", fsdp["fsdp_state_dict_type"], ACCELERATE_STATE_DICT, problems
        )
        opt("fsdp_state_dict_type", "state_dict_type", fsdp["fsdp_state_dict_type"])
    if fsdp.get("fsdp_ignored_modules") is not None:
        src.fields["ignored_modules"] = _class_list(
            "fsdp_config.fsdp_ignored_modules", fsdp["fsdp_ignored_modules"], problems
        )
        opt("fsdp_ignored_modules", "ignored_modules", fsdp["fsdp_ignored_modules"])
    if "mixed_precision" in data:
        src.fields["mixed_precision"] = _mixed_precision("mixed_precision", data["mixed_precision"], problems)
        opt("mixed_precision", "mixed_precision", data["mixed_precision"])
    if problems:
        raise ConfigError(problems, source=path)
    return src


_TRAINER_KEYS: dict[str, str] = {
    "version": "",
    "min_num_params": "wrap",
    "transformer_layer_cls_to_wrap": "wrap",
    "auto_wrap_policy": "wrap",
    "cpu_offload": "cpu_offload",
    "cpu_ram_efficient_loading": "cpu_ram_efficient_loading",
    "state_dict_type": "state_dict_type",
    "activation_checkpointing": "activation_checkpointing",
    "reshard_after_forward": "strategy",
    "forward_prefetch": "forward_prefetch",
    "backward_prefetch": "backward_prefetch",
    "use_orig_params": "use_orig_params",
    "sync_module_states": "sync_module_states",
    "limit_all_gathers": "limit_all_gathers",
    "xla": "",
    "xla_fsdp_v2": "",
    "xla_fsdp_grad_ckpt": "",
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
    items = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, (list, tuple)) else None
    if items is None:
        problems.add("fsdp", fsdp, f"a string or list of: {', '.join(_TRAINER_ITEMS)}")
        items = []
    for item in items:
        if item not in _TRAINER_ITEMS:
            problems.add("fsdp", item, ", ".join(_TRAINER_ITEMS))
    for key in cfg:
        if key not in _TRAINER_KEYS:
            problems.add(
                f"fsdp_config.{key}",
                cfg[key],
                f"Trainer fsdp_config keys: {', '.join(_TRAINER_KEYS)}",
                "remove it, or check its spelling",
            )
    if str(cfg.get("version", 1)) != "1":
        problems.add(
            "fsdp_config.version",
            cfg["version"],
            "1 (an FSDP1 config)",
            "this config is already FSDP2; nothing to migrate",
        )
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

    def opt(key: str, option: str, value: object, *, default: bool = False, ignored: str = "") -> None:
        src.options.append(SourceOption(key, value, option, default, ignored))

    strategies = [i for i in items if i not in ("offload", "auto_wrap")]
    strategy = ShardingStrategy.FULL_SHARD
    for item in strategies:
        strategy = parse_enum(ShardingStrategy, item)
        opt(f"fsdp: {item}", "strategy", item)
    if "reshard_after_forward" in cfg:
        if strategies:
            opt(
                "fsdp_config.reshard_after_forward",
                "strategy",
                cfg["reshard_after_forward"],
                ignored="the fsdp option string's strategy is applied first (setdefault)",
            )
        else:
            strategy = (
                _strategy("fsdp_config.reshard_after_forward", cfg["reshard_after_forward"], problems) or strategy
            )
            opt("fsdp_config.reshard_after_forward", "strategy", cfg["reshard_after_forward"])
    if not strategies and "reshard_after_forward" not in cfg:
        opt("fsdp: (no strategy)", "strategy", "full_shard", default=True)
    src.fields["strategy"] = strategy

    if "offload" in items:
        src.fields["cpu_offload"] = True
        opt("fsdp: offload", "cpu_offload", "offload")
    if "cpu_offload" in cfg:
        src.fields["cpu_offload"] = src.fields.get("cpu_offload") or _bool(
            "fsdp_config.cpu_offload", cfg["cpu_offload"], problems
        )
        opt("fsdp_config.cpu_offload", "cpu_offload", cfg["cpu_offload"])

    # transformers' FSDP1 rule: min_num_params > 0 (and no layer classes) selects SIZE_BASED_WRAP,
    # otherwise TRANSFORMER_BASED_WRAP ("auto_wrap" is a no-op since v5).
    sized = str(cfg.get("min_num_params", "0")).strip() not in ("0", "") and "transformer_layer_cls_to_wrap" not in cfg
    default_policy = "SIZE_BASED_WRAP" if sized else "TRANSFORMER_BASED_WRAP"
    policy = _numbered(
        "fsdp_config.auto_wrap_policy", cfg.get("auto_wrap_policy", default_policy), ACCELERATE_WRAP, problems
    )
    if "auto_wrap" in items:
        opt("fsdp: auto_wrap", "wrap", "auto_wrap")
    if "auto_wrap_policy" in cfg:
        opt("fsdp_config.auto_wrap_policy", "wrap", cfg["auto_wrap_policy"])
    elif "auto_wrap" not in items:
        opt("fsdp_config.auto_wrap_policy", "wrap", default_policy, default=True)
    classes = None
    if "transformer_layer_cls_to_wrap" in cfg:
        classes = _class_list(
            "fsdp_config.transformer_layer_cls_to_wrap", cfg["transformer_layer_cls_to_wrap"], problems
        )
        opt(
            "fsdp_config.transformer_layer_cls_to_wrap",
            "wrap",
            cfg["transformer_layer_cls_to_wrap"],
            ignored="" if policy == "TRANSFORMER_BASED_WRAP" else "read only with TRANSFORMER_BASED_WRAP",
        )
    min_params = None
    if "min_num_params" in cfg:
        raw_min = cfg["min_num_params"]
        if isinstance(raw_min, bool) or not str(raw_min).strip().isdigit():
            problems.add("fsdp_config.min_num_params", raw_min, "an integer >= 0")
        else:
            min_params = int(str(raw_min).strip())
        opt(
            "fsdp_config.min_num_params",
            "wrap",
            raw_min,
            ignored="" if policy == "SIZE_BASED_WRAP" else "read only with SIZE_BASED_WRAP",
        )
    src.fields["wrap"] = _wrap(policy, classes, min_params)

    if "backward_prefetch" in cfg:
        src.fields["backward_prefetch"] = (
            _prefetch("fsdp_config.backward_prefetch", cfg["backward_prefetch"], problems) or BackwardPrefetch.NONE
        )
        opt("fsdp_config.backward_prefetch", "backward_prefetch", cfg["backward_prefetch"])
    else:
        src.fields["backward_prefetch"] = BackwardPrefetch.NONE  # transformers' FSDP1 default: NO_PREFETCH
        opt("fsdp_config.backward_prefetch", "backward_prefetch", "NO_PREFETCH", default=True)
    # transformers' FSDP1 defaults: sync_module_states true, use_orig_params true.
    defaults = {"sync_module_states": True, "use_orig_params": True}
    for key, name in (
        ("forward_prefetch", "forward_prefetch"),
        ("sync_module_states", "sync_module_states"),
        ("activation_checkpointing", "activation_checkpointing"),
        ("limit_all_gathers", "limit_all_gathers"),
    ):
        if key in cfg:
            src.fields[name] = _bool(f"fsdp_config.{key}", cfg[key], problems)
            opt(f"fsdp_config.{key}", name, cfg[key])
        elif key in defaults:
            src.fields[name] = defaults[key]
            opt(f"fsdp_config.{key}", name, defaults[key], default=True)
    for key in ("use_orig_params", "cpu_ram_efficient_loading"):
        if key in cfg:
            src.table_values[key] = _bool(f"fsdp_config.{key}", cfg[key], problems)
            opt(f"fsdp_config.{key}", key, cfg[key])
    if src.table_values.get("cpu_ram_efficient_loading"):
        src.fields["sync_module_states"] = True
    if "state_dict_type" in cfg:
        src.table_values["state_dict_type"] = _numbered(
            "fsdp_config.state_dict_type", cfg["state_dict_type"], ACCELERATE_STATE_DICT, problems
        )
        opt("fsdp_config.state_dict_type", "state_dict_type", cfg["state_dict_type"])
    for flag in ("bf16", "fp16"):
        if str(training_args.get(flag, "")).strip().lower() in ("true", "1", "yes"):
            src.fields["mixed_precision"] = _mixed_precision(flag, flag, problems)
            opt(flag, "mixed_precision", training_args[flag])
    if problems:
        raise ConfigError(problems, source=path)
    return src


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

    ``fsdp``: the Trainer's ``fsdp`` option string, when ``path`` is its ``fsdp_config`` JSON.
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
    if (
        "fsdp" in data
        and isinstance(data.get("fsdp_config") or {}, Mapping)
        and _accelerate_style(data.get("fsdp_config") or {})
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
        tokens = shlex.split(text.replace("\\\n", " "), comments=True)
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
    merged: dict[str, Any] = {"fsdp_config": fsdp_config}
    for flag in ("bf16", "fp16"):
        if data.get(flag) is True:
            merged["mixed_precision"] = flag
    src = parse_accelerate(merged, path)
    src.kind = "axolotl"
    src.raw = dict(data)
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
    """Read an FSDP1 config and work out its FSDP2 equivalent and the per-option report."""
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
            report.rows.append(
                OptionRow(o.key, value, Status.NOT_NEEDED, "-", f"ignored by the source too: {o.ignored_because}")
            )
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
    report.notes.append(f"backend: fsdp1 -> fsdp2 (bridge YAML); {_strategy_note(fsdp2)}")
    if fallbacks:
        report.notes.append(
            "no FSDP2 equivalent, replaced by the nearest FSDP2 behaviour: "
            + ", ".join(f"{k} -> {_show(v)}" for k, v in fallbacks.items())
        )
    migration = Migration(source=src, fsdp1=fsdp1, fsdp2=fsdp2, report=report)
    if src.kind == "accelerate":
        from fsdp_bridge.migrate._accelerate import accelerate_fsdp2

        migration.accelerate = accelerate_fsdp2(migration)
    return migration


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
    and the report as ``<dst stem>.migration.md``.  Returns the paths written."""
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
