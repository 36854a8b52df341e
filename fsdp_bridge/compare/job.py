"""The compare job: one YAML describing a short training run to repeat on every backend.

    # fsdp-bridge compare examples/compare/tiny_llama.yaml
    model: {family: llama}          # a tiny family of fsdp_bridge.testing.models, config: overrides sizes
    data: {seq_len: 16}             # random token batches, different on every rank and step
    optim: {lr: 1.0e-3}             # AdamW
    micro_batch_size: 2             # per rank
    max_steps: 5
    seed: 0
    compare:
      strategies: [full_shard, shard_grad_op, no_shard]
      backends: [fsdp1, fsdp2]
      reference: true
      nproc_per_node: 2
      overrides: {fsdp2: {lr: 2.0e-3}}   # per-run changes (lr, or bridge fields)
    bridge: {mixed_precision: fp32}

The keys model/data/optim/micro_batch_size/max_steps/seed/bridge have the names of the
training YAML (``fsdp-bridge train``); ``compare:`` holds what only a comparison needs.
Unknown keys are refused, naming the key and the known ones; every problem is reported
in one :class:`~fsdp_bridge.errors.ConfigError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_bridge.compare.engine import REFERENCE, RunSpec
from fsdp_bridge.config import BridgeConfig, _unknown_key, read_yaml_file
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.strategy import Backend, ShardingStrategy, allowed_values, parse_enum
from fsdp_bridge.testing.models import FAMILIES, build_tiny, sample_batch

__all__ = ["CompareJob", "load_job", "read_job"]

_OVERRIDE_KEYS = ("lr",)
"""Run-level keys an override may set besides BridgeConfig fields."""


@dataclass(frozen=True, kw_only=True)
class CompareJob:
    """A comparison: the model, data and optimizer of a short run, and which runs to make."""

    family: str = "llama"
    """A tiny model family of :mod:`fsdp_bridge.testing.models` (``model.family``, or ``model.config.model_type``)."""
    model_config: dict[str, Any] = field(default_factory=dict)
    """transformers config values overriding the tiny sizes (``model.config``)."""
    seq_len: int = 16
    """Tokens per sequence (``data.seq_len``)."""
    micro_batch_size: int = 2
    """Sequences per rank and step."""
    max_steps: int = 5
    """Optimizer steps per run."""
    seed: int = 0
    """Seeds the initial weights; rank r's batches use seed + 42 + r (PyTorch's parity-test convention)."""
    lr: float = 1e-3
    """AdamW learning rate (``optim.lr``)."""
    weight_decay: float = 0.0
    """AdamW weight decay (``optim.weight_decay``)."""
    grad_clip: float | None = None
    """Clip gradients to this global norm before each step (``optim.grad_clip``); null: no clipping."""
    strategies: tuple[ShardingStrategy, ...] = ()
    """Strategies to run (``compare.strategies``); empty: the bridge config's strategy."""
    backends: tuple[Backend, ...] = (Backend.FSDP1, Backend.FSDP2)
    """Backends to run each strategy on (``compare.backends``)."""
    reference: bool = False
    """Also run the non-sharded reference with averaged gradients (``compare.reference``)."""
    nproc_per_node: int = 2
    """Ranks to spawn on this machine (``compare.nproc_per_node``)."""
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-run changes keyed by backend or ``reference`` (``compare.overrides``): ``lr`` or bridge fields."""
    bridge: dict[str, Any] = field(default_factory=dict)
    """The bridge section (BridgeConfig fields); ``backend`` and ``strategy`` are set per run."""

    # -- building the runs ------------------------------------------------------------

    def run_specs(self) -> list[RunSpec]:
        """The reference (when asked) and one run per strategy and backend, validated here."""
        problems: list[Problem] = []
        specs: list[RunSpec] = []
        if self.reference:
            ref = self.overrides.get(REFERENCE, {})
            specs.append(RunSpec.reference(float(ref.get("lr", self.lr))))
        base = dict(self.bridge)
        strategies = self.strategies or (parse_enum(ShardingStrategy, base.get("strategy", "full_shard")),)
        for strategy in strategies:
            for backend in self.backends:
                over = dict(self.overrides.get(backend.value, {}))
                lr = float(over.pop("lr", self.lr))
                data = {**base, **over, "strategy": strategy.value, "backend": backend.value}
                if not strategy.is_hybrid:
                    # hybrid_shape belongs to the hybrid strategies only; a list mixing them keeps it for those.
                    data.pop("hybrid_shape", None)
                try:
                    config = BridgeConfig.from_dict(data)
                except ConfigError as err:
                    problems += [dataclasses.replace(p, key=f"{backend.value}/{strategy.value}: bridge.{p.key}")
                                 for p in err.problems]
                    continue
                specs.append(RunSpec.sharded(config, lr))
        if problems:
            raise ConfigError(problems)
        return specs

    def device(self) -> str:
        return str(self.bridge.get("device", "auto"))

    def build_model(self) -> nn.Module:
        """The model of every run (the same seed gives the same weights)."""
        return build_tiny(self.family, seed=self.seed, **self.model_config)

    def batches(self, rank: int) -> list[dict[str, torch.Tensor]]:
        """Rank ``rank``'s batches, one per step (the same in every run)."""
        base = (self.seed + 42 + rank) * 100_003
        return [sample_batch(self.family, batch=self.micro_batch_size, seq=self.seq_len, seed=base + step)
                for step in range(self.max_steps)]

    def optimizer(self, params: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr, weight_decay=self.weight_decay)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["strategies"] = [s.value for s in self.strategies]
        out["backends"] = [b.value for b in self.backends]
        return out

    # -- parsing ----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str | None = None) -> CompareJob:
        """Parse the YAML mapping; every problem is reported at once."""
        problems: list[Problem] = []
        if not isinstance(data, Mapping):
            raise ConfigError([Problem("job", data, "a mapping with model, data, optim, compare, bridge ...")],
                              source=source)
        top = ["model", "data", "optim", "micro_batch_size", "max_steps", "seed", "compare", "bridge"]
        problems += [_unknown_key(str(k), v, top) for k, v in data.items() if k not in top]
        kw: dict[str, Any] = {}

        model = data.get("model", {})
        if isinstance(model, str):
            model = {"family": model}
        if not isinstance(model, Mapping):
            problems.append(Problem("model", model, f"a family name ({', '.join(FAMILIES)}) or {{family, config}}"))
            model = {}
        problems += [_unknown_key(f"model.{k}", v, ["family", "config"]) for k, v in model.items()
                     if k not in ("family", "config")]
        config = dict(model.get("config") or {})
        family = model.get("family", config.pop("model_type", "llama"))
        if family not in FAMILIES:
            problems.append(Problem("model.family", family, ", ".join(FAMILIES),
                                    "compare builds tiny models offline; pick one of these families"))
        kw["family"], kw["model_config"] = family, config

        section = _section(data, "data", ["seq_len"], problems)
        kw.update(_ints(section, {"seq_len": "data.seq_len"}, problems))
        kw.update(_ints(data, {"micro_batch_size": "micro_batch_size", "max_steps": "max_steps"}, problems))
        if "seed" in data:
            if isinstance(data["seed"], int) and not isinstance(data["seed"], bool):
                kw["seed"] = data["seed"]
            else:
                problems.append(Problem("seed", data["seed"], "an integer"))

        optim = _section(data, "optim", ["lr", "weight_decay", "grad_clip"], problems)
        for key in ("lr", "weight_decay", "grad_clip"):
            if key in optim:
                value = optim[key]
                if value is None and key == "grad_clip":
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                        key != "weight_decay" and value == 0):
                    problems.append(Problem(f"optim.{key}", value, "a number > 0" if key != "weight_decay"
                                            else "a number >= 0"))
                else:
                    kw[key] = float(value)

        comp = _section(data, "compare", ["strategies", "backends", "reference", "nproc_per_node", "overrides"],
                        problems)
        for key, enum_cls in (("strategies", ShardingStrategy), ("backends", Backend)):
            if key in comp:
                values = comp[key]
                values = [v.strip() for v in values.split(",")] if isinstance(values, str) else values
                parsed = []
                for v in values if isinstance(values, (list, tuple)) else [values]:
                    try:
                        parsed.append(parse_enum(enum_cls, v))  # type: ignore[type-var]
                    except ValueError:
                        problems.append(Problem(f"compare.{key}", v, allowed_values(enum_cls)))
                if not parsed and not problems:
                    problems.append(Problem(f"compare.{key}", values,
                                            f"a non-empty list of {allowed_values(enum_cls)}"))
                kw[key] = tuple(dict.fromkeys(parsed))
        if "reference" in comp:
            if isinstance(comp["reference"], bool):
                kw["reference"] = comp["reference"]
            else:
                problems.append(Problem("compare.reference", comp["reference"], "true or false"))
        kw.update(_ints(comp, {"nproc_per_node": "compare.nproc_per_node"}, problems))
        kw["overrides"] = _overrides(comp.get("overrides") or {}, problems)

        bridge = data.get("bridge") or {}
        if not isinstance(bridge, Mapping):
            problems.append(Problem("bridge", bridge, "a mapping of BridgeConfig fields"))
            bridge = {}
        kw["bridge"] = dict(bridge)
        if problems:
            raise ConfigError(problems, source=source)
        job = cls(**kw)
        try:
            job.run_specs()  # validates the bridge section of every run now, before any process starts
        except ConfigError as err:
            raise ConfigError(err.problems, source=source) from None
        if not job.reference and len(job.run_specs()) < 2:
            raise ConfigError([Problem("compare", {"backends": [b.value for b in job.backends], "reference": False},
                                       "at least two runs to compare",
                                       "list both backends, or set reference: true (--reference)")], source=source)
        return job


def _section(data: Mapping[str, Any], key: str, valid: list[str], problems: list[Problem]) -> Mapping[str, Any]:
    section = data.get(key) or {}
    if not isinstance(section, Mapping):
        problems.append(Problem(key, section, f"a mapping with keys {', '.join(valid)}"))
        return {}
    problems += [_unknown_key(f"{key}.{k}", v, valid) for k, v in section.items() if k not in valid]
    return section


def _ints(section: Mapping[str, Any], keys: dict[str, str], problems: list[Problem]) -> dict[str, int]:
    out = {}
    for key, dotted in keys.items():
        if key in section:
            value = section[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(Problem(dotted, value, "an integer >= 1"))
            else:
                out[key] = value
    return out


def _overrides(value: object, problems: list[Problem]) -> dict[str, dict[str, Any]]:
    runs = [b.value for b in Backend] + [REFERENCE]
    if not isinstance(value, Mapping):
        problems.append(Problem("compare.overrides", value, f"a mapping keyed by {', '.join(runs)}"))
        return {}
    out: dict[str, dict[str, Any]] = {}
    valid = [*_OVERRIDE_KEYS, *(f for f in BridgeConfig.field_names() if f not in ("backend", "strategy"))]
    for run, changes in value.items():
        if run not in runs:
            problems.append(Problem(f"compare.overrides.{run}", changes, f"a run name: {', '.join(runs)}"))
            continue
        if not isinstance(changes, Mapping):
            problems.append(Problem(f"compare.overrides.{run}", changes, f"a mapping of {', '.join(valid)}"))
            continue
        allowed = list(_OVERRIDE_KEYS) if run == REFERENCE else valid
        for k, v in changes.items():
            if k not in allowed:
                problems.append(_unknown_key(f"compare.overrides.{run}.{k}", v, allowed))
            elif k == "lr" and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                problems.append(Problem(f"compare.overrides.{run}.lr", v, "a number > 0"))
        out[str(run)] = dict(changes)
    return out


def read_job(path: str | Path) -> dict[str, Any]:
    """The YAML mapping of a job file (parse it with :meth:`CompareJob.from_dict`)."""
    path = Path(path)
    data = read_yaml_file(path, key="config")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([Problem("job", data, "a mapping with model, data, optim, compare, bridge ...")],
                          source=str(path))
    return data


def load_job(path: str | Path) -> CompareJob:
    """Read a compare job YAML (see the module docstring for its keys)."""
    return CompareJob.from_dict(read_job(path), source=str(path))
