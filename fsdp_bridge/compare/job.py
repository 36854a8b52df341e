"""The compare job: one YAML describing a short training run to repeat on every backend.

    # fsdp-bridge compare examples/compare/tiny_llama.yaml
    model: {family: llama}          # a tiny family of fsdp_bridge.testing.models, config: overrides sizes
                                    # or {path: ./my-model} (a Hugging Face directory, its weights),
                                    # {config: {model_type: phi3, hidden_size: 64, ...}} (any transformers type),
                                    # {builder: "my_pkg.models:build", batch: "my_pkg.models:batch"}
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
    peft: {r: 8, alpha: 16, target_modules: [q_proj, v_proj]}   # optional: LoRA on the frozen model

The keys model/data/optim/micro_batch_size/max_steps/seed/bridge have the names of the
training YAML (``fsdp-bridge train``); ``compare:`` holds what only a comparison needs.
Unknown keys are refused, naming the key and the known ones; every problem is reported
in one :class:`~fsdp_bridge.errors.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from fsdp_bridge._lora import PeftConfig, apply_lora
from fsdp_bridge._schema import field_spec, parse_layout, spec, unknown_key
from fsdp_bridge._tiny_models import FAMILIES, build_tiny, sample_batch
from fsdp_bridge.compare.engine import REFERENCE, RunSpec
from fsdp_bridge.config import BridgeConfig, read_yaml_file
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.strategy import Backend, ShardingStrategy, allowed_values, parse_enum

E = TypeVar("E", bound=enum.Enum)

__all__ = ["CompareJob", "load_job", "read_job"]

_OVERRIDE_KEYS = ("lr",)
"""Run-level keys an override may set besides BridgeConfig fields."""
_OVERRIDES_ALLOWED = f"a mapping keyed by {', '.join([*(b.value for b in Backend), REFERENCE])}"
_FAMILY_ALLOWED = f"a tiny family ({', '.join(FAMILIES)}) or a transformers model_type"
_PEFT_ALLOWED = f"a mapping of {', '.join(f.name for f in dataclasses.fields(PeftConfig))}, or null"
_COUNT = "an integer >= 1"


# -- how each key of the job file is read (the schema engine reports what they refuse) --------------


def _parse_count(value: Any, key: str, problems: list[Problem]) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{value!r} is not a count")
    return value


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is not a number")
    return float(value)


def _parse_positive(value: Any, key: str, problems: list[Problem]) -> float:
    if not _number(value) > 0:
        raise ValueError(f"{value!r} is not > 0")
    return float(value)


def _parse_optional_positive(value: Any, key: str, problems: list[Problem]) -> float | None:
    return None if value is None else _parse_positive(value, key, problems)


def _parse_non_negative(value: Any, key: str, problems: list[Problem]) -> float:
    if not _number(value) >= 0:
        raise ValueError(f"{value!r} is not >= 0")
    return float(value)


def _parse_model_config(value: Any, key: str, problems: list[Problem]) -> dict[str, Any]:
    if not isinstance(value or {}, Mapping):
        raise ValueError(f"{value!r} is not a mapping")
    return dict(value or {})


def _parse_model_dir(value: Any, key: str, problems: list[Problem]) -> str | None:
    if value is not None and not (isinstance(value, str) and (Path(value) / "config.json").is_file()):
        raise ValueError(f"{value!r} is not a model directory")
    return value  # type: ignore[no-any-return]


def _parse_import_spec(value: Any, key: str, problems: list[Problem]) -> str | None:
    if value is not None and not (isinstance(value, str) and _is_import_spec(value)):
        raise ValueError(f"{value!r} is not module:function")
    return value  # type: ignore[no-any-return]


def _import_spec(at: str) -> dict[str, Any]:
    allowed = "module:function (an importable module and a function in it)"
    return spec(allowed, _parse_import_spec, fix="e.g. my_pkg.models:build", at=at)


def _enum_list_spec(enum_cls: type[E], at: str) -> dict[str, Any]:
    """A list (or comma-separated text) of ``enum_cls`` values; each bad item is its own problem."""

    def parse(value: Any, key: str, problems: list[Problem]) -> tuple[E, ...]:
        values = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
        items = values if isinstance(values, (list, tuple)) else [values]
        parsed: list[E] = []
        for item in items:
            try:
                parsed.append(parse_enum(enum_cls, item))
            except ValueError:
                problems.append(Problem(key, item, allowed_values(enum_cls)))
        if not items:
            problems.append(Problem(key, values, f"a non-empty list of {allowed_values(enum_cls)}"))
        return tuple(dict.fromkeys(parsed))

    return spec(allowed_values(enum_cls), parse, at=at)


def _parse_overrides(value: object, key: str, problems: list[Problem]) -> dict[str, dict[str, Any]]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{value!r} is not a mapping")
    runs = [*(b.value for b in Backend), REFERENCE]
    out: dict[str, dict[str, Any]] = {}
    valid = [*_OVERRIDE_KEYS, *(f for f in BridgeConfig.field_names() if f not in ("backend", "strategy"))]
    for run, changes in value.items():
        if run not in runs:
            problems.append(Problem(f"{key}.{run}", changes, f"a run name: {', '.join(runs)}"))
            continue
        if not isinstance(changes, Mapping):
            problems.append(Problem(f"{key}.{run}", changes, f"a mapping of {', '.join(valid)}"))
            continue
        allowed = list(_OVERRIDE_KEYS) if run == REFERENCE else valid
        for k, v in changes.items():
            if k not in allowed:
                problems.append(unknown_key(f"{key}.{run}.{k}", v, allowed))
            elif k == "lr" and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                problems.append(Problem(f"{key}.{run}.lr", v, "a number > 0"))
        out[str(run)] = dict(changes)
    return out


def _parse_bridge_section(value: Any, key: str, problems: list[Problem]) -> dict[str, Any]:
    if not isinstance(value or {}, Mapping):
        raise ValueError(f"{value!r} is not a mapping")
    return dict(value or {})  # checked per run, with each run's backend and strategy (run_specs)


def _parse_peft(value: Any, key: str, problems: list[Problem]) -> PeftConfig | None:
    from fsdp_bridge.train._config import parse_peft_section  # one schema for the section, as in train

    section, found = parse_peft_section(value, key)
    problems += found
    return section


@dataclass(frozen=True, kw_only=True)
class CompareJob:
    """A comparison: the model, data and optimizer of a short run, and which runs to make."""

    family: str = field(default="llama", metadata=spec(_FAMILY_ALLOWED, at="model.family"))
    """A tiny model family of :mod:`fsdp_bridge.testing.models` (``model.family``), or any transformers
    ``model_type`` (``model.config.model_type``) built from ``model.config`` as given."""
    model_config: dict[str, Any] = field(
        default_factory=dict,
        metadata=spec("a mapping of transformers config values", _parse_model_config, at="model.config"),
    )
    """transformers config values: over the tiny sizes for a tiny family, the whole config otherwise."""
    model_path: str | None = field(
        default=None,
        metadata=spec(
            "a Hugging Face model directory with a config.json",
            _parse_model_dir,
            fix="save it with model.save_pretrained(DIR)",
            at="model.path",
        ),
    )
    """A Hugging Face model directory (``model.path``): its config and weights; overrides ``family``."""
    builder: str | None = field(default=None, metadata=_import_spec("model.builder"))
    """``module:function`` returning the model (``model.builder``), called with the seed set."""
    batch_fn: str | None = field(default=None, metadata=_import_spec("model.batch"))
    """``module:function(batch, seq_len, seed) -> dict`` making one step's inputs (``model.batch``);
    default: random tokens with labels for the model's head (causal, masked or seq2seq LM)."""
    seq_len: int = field(default=16, metadata=spec(_COUNT, _parse_count, at="data.seq_len"))
    """Tokens per sequence (``data.seq_len``)."""
    lr: float = field(default=1e-3, metadata=spec("a number > 0", _parse_positive, at="optim.lr"))
    """AdamW learning rate (``optim.lr``)."""
    weight_decay: float = field(
        default=0.0, metadata=spec("a number >= 0", _parse_non_negative, at="optim.weight_decay")
    )
    """AdamW weight decay (``optim.weight_decay``)."""
    grad_clip: float | None = field(
        default=None, metadata=spec("a number > 0", _parse_optional_positive, at="optim.grad_clip")
    )
    """Clip gradients to this global norm before each step (``optim.grad_clip``); null: no clipping."""
    micro_batch_size: int = field(default=2, metadata=spec(_COUNT, _parse_count))
    """Sequences per rank and step."""
    max_steps: int = field(default=5, metadata=spec(_COUNT, _parse_count))
    """Optimizer steps per run."""
    seed: int = 0
    """Seeds the initial weights; rank r's batches use seed + 42 + r (PyTorch's parity-test convention)."""
    strategies: tuple[ShardingStrategy, ...] = field(
        default=(), metadata=_enum_list_spec(ShardingStrategy, "compare.strategies")
    )
    """Strategies to run (``compare.strategies``); empty: the bridge config's strategy."""
    backends: tuple[Backend, ...] = field(default=tuple(Backend), metadata=_enum_list_spec(Backend, "compare.backends"))
    """Backends to run each strategy on (``compare.backends``)."""
    reference: bool = field(default=False, metadata=spec("true or false", at="compare.reference"))
    """Also run the non-sharded reference with averaged gradients (``compare.reference``)."""
    nproc_per_node: int = field(default=2, metadata=spec(_COUNT, _parse_count, at="compare.nproc_per_node"))
    """Ranks to spawn on this machine (``compare.nproc_per_node``)."""
    overrides: dict[str, dict[str, Any]] = field(
        default_factory=dict, metadata=spec(_OVERRIDES_ALLOWED, _parse_overrides, at="compare.overrides")
    )
    """Per-run changes keyed by backend or ``reference`` (``compare.overrides``): ``lr`` or bridge fields."""
    bridge: dict[str, Any] = field(
        default_factory=dict, metadata=spec("a mapping of BridgeConfig fields", _parse_bridge_section)
    )
    """The bridge section (BridgeConfig fields); ``backend`` and ``strategy`` are set per run."""
    peft: PeftConfig | None = field(default=None, metadata=spec(_PEFT_ALLOWED, _parse_peft))
    """LoRA adapters on the frozen model in every run (``peft:``, the training YAML's section); null: none."""

    # -- building the runs ------------------------------------------------------------

    def run_specs(self) -> list[RunSpec]:
        """The reference (when asked) and one run per strategy and backend, validated here.

        Returns:
            The runs, each with its bridge config and learning rate (per-backend overrides applied).

        Raises:
            ConfigError: every run whose bridge settings (its overrides applied) do not parse,
                together, each named ``<backend>/<strategy>: bridge.<key>``.
        """
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
                    problems += [
                        dataclasses.replace(p, key=f"{backend.value}/{strategy.value}: bridge.{p.key}")
                        for p in err.problems
                    ]
                    continue
                specs.append(RunSpec.sharded(config, lr))
        if problems:
            raise ConfigError(problems)
        return specs

    def device(self) -> str:
        """The job's ``bridge.device``.

        Returns:
            ``"auto"``, ``"cpu"`` or ``"cuda"``.
        """
        return str(self.bridge.get("device", "auto"))

    def build_model(self) -> nn.Module:
        """The model of every run (the same seed gives the same weights), with the LoRA adapters of ``peft``.

        Returns:
            The unsharded model: from ``model.builder``, ``model.path`` or a tiny ``model.family``.
        """
        model = self._build_base()
        if self.peft is not None:
            torch.manual_seed(self.seed)
            model = apply_lora(model, self.peft)
        return model

    def _build_base(self) -> nn.Module:
        if self.builder is not None:
            torch.manual_seed(self.seed)
            model = _import(self.builder, "model.builder")()
            if not isinstance(model, nn.Module):
                raise ConfigError(
                    [
                        Problem(
                            "model.builder",
                            self.builder,
                            "a function returning an nn.Module",
                            f"it returned a {type(model).__name__}",
                        )
                    ]
                )
            return model
        if self.model_path is None and self.family in FAMILIES:
            return build_tiny(self.family, seed=self.seed, **self.model_config)
        return _build_hf(self.model_path, self.family, self.model_config, seed=self.seed)

    def check_model(self) -> None:
        """Everything about the model that can fail, checked before any process starts:
        the builder and batch functions import, a config builds, the head is a language model.

        Returns:
            None.

        Raises:
            ConfigError: a builder or batch function that does not import, a model config that
                does not build, a head that is not a language model, LoRA targets matching
                nothing; each named by its ``model.*`` or ``peft.*`` key.
        """
        for name, key in ((self.builder, "model.builder"), (self.batch_fn, "model.batch")):
            if name is not None:
                _import(name, key)
        if self.builder is None and (self.model_path is not None or self.family not in FAMILIES):
            _head_class(_hf_config(self.model_path, self.family, self.model_config))
        if self.peft is not None and self.builder is None and self.model_path is None:
            with torch.device("meta"):  # target_modules that match nothing are named here, with no memory used
                apply_lora(self._build_base(), self.peft)

    def batches(self, rank: int) -> list[dict[str, torch.Tensor]]:
        """Rank ``rank``'s batches, one per step (the same in every run).

        Args:
            rank: the rank whose batches to make (seed ``seed + 42 + rank``).

        Returns:
            ``max_steps`` batches from ``model.batch``, the tiny family's sampler, or random
            tokens shaped for the model's head.
        """
        base = (self.seed + 42 + rank) * 100_003
        if self.batch_fn is not None:
            fn = _import(self.batch_fn, "model.batch")
            return [fn(self.micro_batch_size, self.seq_len, base + step) for step in range(self.max_steps)]
        if self.builder is None and self.model_path is None and self.family in FAMILIES:
            return [
                sample_batch(self.family, batch=self.micro_batch_size, seq=self.seq_len, seed=base + step)
                for step in range(self.max_steps)
            ]
        kind, vocab = _head_and_vocab(self)
        return [
            _token_batch(kind, vocab, batch=self.micro_batch_size, seq=self.seq_len, seed=base + step)
            for step in range(self.max_steps)
        ]

    def optimizer(self, params: Any, lr: float) -> torch.optim.Optimizer:
        """The optimizer of every run.

        Args:
            params: the parameters to optimize (the trainable ones).
            lr: the run's learning rate.

        Returns:
            AdamW with the job's ``optim.weight_decay``.
        """
        return torch.optim.AdamW(params, lr=lr, weight_decay=self.weight_decay)

    def to_dict(self) -> dict[str, Any]:
        """The job as JSON-safe data (recorded in ``report.json``).

        Returns:
            Every field by name, enums as their values.
        """
        out = dataclasses.asdict(self)
        out["strategies"] = [s.value for s in self.strategies]
        out["backends"] = [b.value for b in self.backends]
        if self.peft is not None:
            out["peft"] = {k: list(v) if isinstance(v, tuple) else v for k, v in out["peft"].items()}
        return out

    # -- parsing ----------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, source: str | None = None, allow_builder: bool = False
    ) -> CompareJob:
        """Parse the YAML mapping; every problem is reported at once.

        Args:
            data: the job YAML as a mapping (``model``, ``data``, ``optim``, ``compare``, ``bridge``).
            source: where ``data`` came from (a file name), named in the error.
            allow_builder: let ``model.builder`` / ``model.batch`` import and call the code they
                name (``fsdp-bridge compare --allow-builder``); refused otherwise, before any import.

        Returns:
            The job.

        Raises:
            ConfigError: every unknown key (with "did you mean") and every bad value, together;
                ``model.builder`` or ``model.batch`` without ``allow_builder``.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(
                [Problem("job", data, "a mapping with model, data, optim, compare, bridge ...")], source=source
            )
        problems: list[Problem] = []
        model = data.get("model") or {}
        if isinstance(model, str):
            model = {"family": model}
        if not isinstance(model, Mapping):
            keys = [at.removeprefix("model.") for at in _places(cls) if at.startswith("model.")]
            problems.append(
                Problem("model", model, f"a family name ({', '.join(FAMILIES)}) or a mapping of {', '.join(keys)}")
            )
            model = {}
        if not allow_builder:
            problems += _code_not_allowed(model)
            if problems:  # nothing named by the file is imported
                raise ConfigError(problems, source=source)
        kw = parse_layout(cls, {**data, "model": model}, problems)
        problems += _model_problems(model, kw)
        if problems:
            raise ConfigError(problems, source=source)
        job = cls(**kw)
        try:
            job.check_model()
            job.run_specs()  # validates the bridge section of every run now, before any process starts
        except ConfigError as err:
            raise ConfigError(err.problems, source=source) from None
        if not job.reference and len(job.run_specs()) < 2:
            raise ConfigError(
                [
                    Problem(
                        "compare",
                        {"backends": [b.value for b in job.backends], "reference": False},
                        "at least two runs to compare",
                        "list both backends, or set reference: true (--reference)",
                    )
                ],
                source=source,
            )
        return job


def _code_not_allowed(model: Mapping[str, Any]) -> list[Problem]:
    """``model.builder`` / ``model.batch`` given while importing code from the job is not allowed."""
    return [
        Problem(
            f"model.{key}",
            model[key],
            "a model.builder or model.batch only when importing the code a job names is allowed",
            f"this job would import and call {model[key]!r}; if you trust it, run "
            "`fsdp-bridge compare JOB --allow-builder` (or CompareJob.from_dict(data, allow_builder=True), "
            "load_job(path, allow_builder=True)); otherwise use model.path, model.config or model.family",
        )
        for key in ("builder", "batch")
        if model.get(key) is not None
    ]


def _places(cls: type) -> list[str]:
    """Where each field sits in the job file (``model.path``), in field order."""
    return [getattr(field_spec(f), "at", None) or f.name for f in dataclasses.fields(cls)]


def _model_problems(model: Mapping[str, Any], kw: dict[str, Any]) -> list[Problem]:
    """What the model keys say together (each key's own value is checked by its field's parser).

    Sets ``kw["family"]`` from ``model.config.model_type`` when no family is given.
    """
    problems: list[Problem] = []
    sources = [k for k in ("path", "builder") if k in model]
    if len(sources) > 1 or (sources and "family" in model):
        problems.append(
            Problem(
                "model",
                dict(model),
                "one of model.family (+ config), model.path, model.builder",
                "keep the one that names your model",
            )
        )
    if "batch" in model and "builder" not in model and "path" not in model:
        problems.append(
            Problem(
                "model.batch",
                model["batch"],
                "only with model.builder or model.path",
                "tiny families and model types make their own batches",
            )
        )
    config = dict(kw.get("model_config", {}))
    model_type = config.pop("model_type", "llama")
    kw["model_config"] = config
    if "family" in model:
        if "family" not in kw:
            return problems  # reported by the field's parser
    else:
        kw["family"] = model_type
    family = kw["family"]
    key = "model.family" if "family" in model else "model.config.model_type"
    if not isinstance(family, str):
        problems.append(Problem(key, family, _FAMILY_ALLOWED))
    elif "path" not in model and "builder" not in model and family not in FAMILIES:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if family not in CONFIG_MAPPING_NAMES:
            close = difflib.get_close_matches(family, [*FAMILIES, *CONFIG_MAPPING_NAMES], n=3)
            fix = (
                f"did you mean {', '.join(map(repr, close))}?"
                if close
                else "or give model.path (a Hugging Face directory) or model.builder"
            )
            problems.append(Problem(key, family, _FAMILY_ALLOWED, fix))
    return problems


def _is_import_spec(spec: str) -> bool:
    module, sep, name = spec.partition(":")
    return bool(sep) and all(part.isidentifier() for part in module.split(".")) and name.isidentifier()


def _import(spec: str, key: str) -> Any:
    """The function named by ``module:function`` (the user's own code, imported as asked)."""
    module_name, _, name = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: the user's package from where they run
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            [Problem(key, spec, "module:function, importable from the working directory or PYTHONPATH", str(err))]
        ) from None
    if not callable(fn):
        raise ConfigError([Problem(key, spec, "a function", f"{name} is a {type(fn).__name__}")])
    return fn


def _hf_config(path: str | None, model_type: str, values: Mapping[str, Any]) -> Any:
    from transformers import AutoConfig

    if path is not None:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        try:
            config = AutoConfig.for_model(model_type, **values)
        except Exception as err:
            reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            raise ConfigError(
                [
                    Problem(
                        "model.config",
                        dict(values, model_type=model_type),
                        f"a valid transformers {model_type} config",
                        reason,
                    )
                ]
            ) from None
    config._attn_implementation = "eager"  # deterministic, the same kernels on every backend
    return config


def _head_class(config: Any) -> Any:
    import transformers as tf

    for auto in (tf.AutoModelForCausalLM, tf.AutoModelForSeq2SeqLM, tf.AutoModelForMaskedLM):
        if type(config) in auto._model_mapping:
            return auto
    raise ConfigError(
        [
            Problem(
                "model",
                getattr(config, "model_type", "?"),
                "a causal, masked or seq2seq language model (compare trains it on token batches)",
                "use model.builder and model.batch for other models",
            )
        ]
    )


def _build_hf(path: str | None, model_type: str, values: Mapping[str, Any], *, seed: int) -> nn.Module:
    config = _hf_config(path, model_type, values)
    auto = _head_class(config)
    torch.manual_seed(seed)
    if path is not None:
        return auto.from_pretrained(path, config=config)
    return auto.from_config(config)


def _head_and_vocab(job: CompareJob) -> tuple[str, int]:
    import transformers as tf

    if job.builder is not None:
        config = getattr(job.build_model(), "config", None)
        if config is None or not isinstance(getattr(config, "vocab_size", None), int):
            raise ConfigError(
                [
                    Problem(
                        "model.batch",
                        None,
                        "module:function making one step's inputs",
                        "the builder's model has no Hugging Face config to make token batches from",
                    )
                ]
            )
    else:
        config = _hf_config(job.model_path, job.family, job.model_config)
    auto = _head_class(config)
    kind = {tf.AutoModelForSeq2SeqLM: "seq2seq", tf.AutoModelForMaskedLM: "masked"}.get(auto, "causal")
    return kind, int(config.vocab_size)


def _token_batch(kind: str, vocab: int, *, batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """Random token inputs with labels for a causal, masked or seq2seq language model."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (batch, seq), generator=g)
    if kind == "seq2seq":
        return {"input_ids": ids, "labels": torch.randint(4, vocab, (batch, max(1, seq // 2)), generator=g)}
    if kind == "masked":
        labels = torch.full_like(ids, -100)
        mask = torch.rand(ids.shape, generator=g) < 0.3
        mask[:, 0] = True
        labels[mask] = ids[mask]
        return {"input_ids": ids.masked_fill(mask, 3), "labels": labels}
    return {"input_ids": ids, "labels": ids.clone()}


def read_job(path: str | Path) -> dict[str, Any]:
    """The YAML mapping of a job file (parse it with :meth:`CompareJob.from_dict`).

    Args:
        path: the job file.

    Returns:
        Its mapping (empty for an empty file).

    Raises:
        ConfigError: the file cannot be read or parsed, or holds something other than a mapping.
    """
    path = Path(path)
    data = read_yaml_file(path, key="config")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            [Problem("job", data, "a mapping with model, data, optim, compare, bridge ...")], source=str(path)
        )
    return data


def load_job(path: str | Path, *, allow_builder: bool = False) -> CompareJob:
    """Read a compare job YAML (see the module docstring for its keys).

    Args:
        path: the job file.
        allow_builder: let its ``model.builder`` / ``model.batch`` import and call the code they name.

    Returns:
        The parsed job.

    Raises:
        ConfigError: as :func:`read_job` and :meth:`CompareJob.from_dict`.
    """
    return CompareJob.from_dict(read_job(path), source=str(path), allow_builder=allow_builder)
