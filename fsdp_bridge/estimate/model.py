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
import yaml
from torch import nn

from fsdp_bridge.errors import ConfigError, Problem

__all__ = ["build_meta_model", "load_model_config"]

_SPEC_HELP = ("a Hugging Face model directory, a config file (.json/.yaml with model_type), "
              "or TYPE:key=value,... (e.g. llama:hidden_size=4096,num_hidden_layers=32)")


def _from_mapping(data: object, source: str) -> Any:
    from transformers import AutoConfig

    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError([Problem("model", source, "a transformers config with a model_type key", _SPEC_HELP)])
    data = dict(data)
    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as err:
        raise ConfigError([Problem("model", source, "a model_type transformers knows", str(err))]) from None


def _parse_sizes(text: str, source: str) -> dict[str, Any]:
    sizes: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError([Problem("model", source, "TYPE:key=value,key=value", f"cannot read {item!r}")])
        sizes[key.strip()] = yaml.safe_load(value)
    return sizes


def load_model_config(spec: str, **overrides: Any) -> Any:
    """The transformers config named by ``spec`` (see the module docstring)."""
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError([Problem("model", spec, "a directory with a config.json", _SPEC_HELP)])
        data = json.loads((path / "config.json").read_text())
        config = _from_mapping(data, spec)
    elif path.is_file():
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        config = _from_mapping(data, spec)
    else:
        model_type, _, sizes = spec.partition(":")
        config = _from_mapping({"model_type": model_type.strip(), **_parse_sizes(sizes, spec)}, spec)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _builders() -> list[Callable[[Any], nn.Module]]:
    import transformers as tf

    return [tf.AutoModelForCausalLM.from_config, tf.AutoModelForSeq2SeqLM.from_config,
            tf.AutoModelForMaskedLM.from_config, tf.AutoModel.from_config]


def build_meta_model(spec: str | Any, *, dtype: torch.dtype = torch.float32,
                     attn_implementation: str | None = None) -> nn.Module:
    """The model of ``spec`` (a spec string or a transformers config) on the meta device.

    The head is chosen like a training script would: causal LM, else seq2seq LM,
    else masked LM, else the bare model.
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
    raise ConfigError([Problem("model", getattr(config, "model_type", spec), "a model type transformers can build",
                               "; ".join(errors))])
