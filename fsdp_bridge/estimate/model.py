"""Turn the ``MODEL`` argument of ``fsdp-bridge estimate`` into a model on the meta device.

``MODEL`` is one of:

* a Hugging Face model directory (its ``config.json`` is read; no weights are touched),
* a config file (``.json`` or ``.yaml``) holding a transformers config with ``model_type``,
* a transformers model type with sizes: ``llama:hidden_size=4096,num_hidden_layers=32``.

The model is built on the meta device: no memory is allocated for its weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_bridge.config import safe_yaml_load
from fsdp_bridge.errors import ConfigError, Problem

__all__ = ["build_meta_model", "load_model_config"]

_SPEC_HELP = (
    "a Hugging Face model directory, a config file (.json/.yaml with model_type), "
    "or TYPE:key=value,... (e.g. llama:hidden_size=4096,num_hidden_layers=32)"
)


# Sizes a transformers config names (across model families); each must be a positive integer,
# and the counts no larger than any real model needs (10^8 layers would take hours to build).
_SIZES = (
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "n_embd",
    "n_positions",
    "n_inner",
    "d_model",
    "d_ff",
    "d_kv",
    "head_dim",
    "embedding_size",
    "ffn_dim",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
)
_COUNTS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "n_layer",
    "n_head",
    "num_layers",
    "num_heads",
    "num_decoder_layers",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "num_local_experts",
    "num_experts",
)
_MAX_SIZE = 2**24
_MAX_COUNT = 4096


def _size_problems(data: dict[str, Any], source: str) -> list[Problem]:
    problems = []
    for key in (*_SIZES, *_COUNTS):
        if key not in data or data[key] is None:
            continue
        value = data[key]
        limit = _MAX_COUNT if key in _COUNTS else _MAX_SIZE
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
            problems.append(Problem(f"model.{key}", value, f"an integer from 1 to {limit:,}", f"fix {key} in {source}"))
    return problems


def _from_mapping(data: object, source: str) -> Any:
    from transformers import AutoConfig

    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError([Problem("model", source, "a transformers config with a model_type key", _SPEC_HELP)])
    data = dict(data)
    problems = _size_problems(data, source)
    if problems:
        raise ConfigError(problems)
    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except Exception as err:  # unknown model_type (ValueError), or the config class refusing a value
        text = " ".join(str(err).split())[:400]
        raise ConfigError(
            [Problem("model", source, "a model_type transformers knows, with values its config accepts", text)]
        ) from None


def _read_mapping(path: Path, source: str) -> object:
    """A config file's data: JSON for .json, otherwise the bounded YAML reader."""
    from fsdp_bridge.config import read_yaml_file

    if path.suffix != ".json":
        return read_yaml_file(path, key="model")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError([Problem("model", source, "a readable JSON transformers config", str(err)[:300])]) from None


def _parse_sizes(text: str, source: str) -> dict[str, Any]:
    sizes: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError([Problem("model", source, "TYPE:key=value,key=value", f"cannot read {item!r}")])
        sizes[key.strip()] = safe_yaml_load(value, source=source)
    return sizes


def load_model_config(spec: str, **overrides: Any) -> Any:
    """The transformers config named by ``spec`` (see the module docstring).

    Args:
        spec: a model directory, a config file, or ``TYPE:key=value,...``.
        **overrides: config attributes set after reading.

    Returns:
        The transformers ``PretrainedConfig``.

    Raises:
        ConfigError: a directory without ``config.json``, an unreadable file, an unknown model
            type, or sizes that are not positive integers in range.
    """
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError([Problem("model", spec, "a directory with a config.json", _SPEC_HELP)])
        config = _from_mapping(_read_mapping(path / "config.json", spec), spec)
    elif path.is_file():
        config = _from_mapping(_read_mapping(path, spec), spec)
    else:
        model_type, _, sizes = spec.partition(":")
        config = _from_mapping({"model_type": model_type.strip(), **_parse_sizes(sizes, spec)}, spec)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _builders() -> list[Callable[[Any], nn.Module]]:
    import transformers as tf

    return [
        tf.AutoModelForCausalLM.from_config,
        tf.AutoModelForSeq2SeqLM.from_config,
        tf.AutoModelForMaskedLM.from_config,
        tf.AutoModel.from_config,
    ]


def build_meta_model(
    spec: str | Any, *, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None
) -> nn.Module:
    """The model of ``spec`` (a spec string or a transformers config) on the meta device.

    The head is chosen like a training script would: causal LM, else seq2seq LM,
    else masked LM, else the bare model.

    Args:
        spec: a ``MODEL`` spec (see the module docstring) or a transformers config.
        dtype: the parameters' dtype.
        attn_implementation: set on the config (``"eager"`` for :func:`measure_activations`);
            None keeps the config's.

    Returns:
        The model on the meta device (no memory allocated for its weights).

    Raises:
        ConfigError: the spec cannot be read, transformers cannot build the model type, or the
            sizes do not make a valid model (the error transformers gave is named).
    """
    config = load_model_config(spec) if isinstance(spec, str) else spec
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    errors: list[str] = []
    for build in _builders():
        try:
            with torch.device("meta"):
                return build(config).to(dtype)
        except ValueError as err:  # this head does not exist for this model type
            errors.append(str(err).splitlines()[0])
        except (TypeError, RuntimeError, AttributeError, ZeroDivisionError) as err:  # sizes the model cannot use
            raise ConfigError(
                [
                    Problem(
                        "model",
                        getattr(config, "model_type", spec),
                        "sizes this model type can be built with",
                        f"{type(err).__name__}: {' '.join(str(err).split())[:300]}",
                    )
                ]
            ) from None
    raise ConfigError(
        [
            Problem(
                "model", getattr(config, "model_type", spec), "a model type transformers can build", "; ".join(errors)
            )
        ]
    )
