"""`TrainConfig`: everything ``fsdp-bridge train`` needs, from one YAML file.

    model:   {path: ./gpt2}                 # or {config: {model_type: llama, hidden_size: 64, ...}}
    data:    {files: [train.jsonl], seq_len: 512}
    optim:   {lr: 3.0e-4}
    schedule: {warmup_steps: 100}
    max_steps: 1000
    bridge:  {strategy: full_shard, backend: fsdp2}

YAML is only a serialisation of these frozen dataclasses.  :meth:`TrainConfig.from_dict`
checks every key and type, then the values, and reports every problem found in one
:class:`~fsdp_bridge.errors.ConfigError` naming the dotted key (``optim.lr``).
``key=value`` overrides (:func:`apply_overrides`) edit the mapping before that check.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from fsdp_bridge._lora import PeftConfig, peft_problems, train_quantization_problems
from fsdp_bridge._schema import (
    Check,
    FieldDoc,
    at_least,
    check_problems,
    checks,
    field_names,
    field_rows,
    finite,
    key_of,
    parse_section,
    spec,
    yaml_key,
)
from fsdp_bridge.config import BridgeConfig, YamlLimitError, load_bounded_yaml, read_yaml_file
from fsdp_bridge.errors import ConfigError, Problem

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "PeftConfig",
    "ScheduleConfig",
    "TrainConfig",
    "apply_overrides",
    "default_config_path",
    "field_reference",
    "load_train_config",
    "parse_peft_section",
]

logger = logging.getLogger("fsdp_bridge.train")

MAX_SEED = 2**32 - 1
"""Seeds are used by torch and by per-rank offsets; numpy-style 32-bit seeds fit every consumer."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""A process-group timeout beyond a week is a typo (``.inf`` overflows torch's timeout)."""
MAX_TOKENIZER_VOCAB = 1 << 20
"""The built-in BPE trainer aborts (out of memory, in Rust) far above real vocabulary sizes."""
MAX_MICRO_BATCH_TOKENS = 2**31 - 1
"""Tokens in one micro-batch on one rank: beyond int32 indexing no model runs."""

SAMPLE = "sample"
"""The name of the small English corpus shipped inside the package (``data.files: sample``)."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The model to train: a Hugging Face directory, or a transformers config built from scratch."""

    path: str | None = None
    """A Hugging Face model directory (config.json, weights, tokenizer files) to fine-tune. The model is
    built on the meta device and each rank reads only its shards' slices of the weights, the base of a
    ``peft:`` run too (with names that differ from the model's, the whole model is loaded on every rank
    first)."""
    config: dict[str, Any] | None = None
    """A transformers config to train from scratch: ``model_type`` plus sizes (hidden_size, num_hidden_layers, ...).
    ``vocab_size`` is taken from the tokenizer when not given."""
    tokenizer: str | None = None
    """A tokenizer directory; null: the model directory's own, or for ``config`` models the built-in byte-level
    BPE trained on the training files (no download)."""
    tokenizer_vocab_size: int = field(
        default=1024,
        metadata=checks(
            Check(lambda v: v >= 300, "an integer >= 300", "the built-in tokenizer needs 256 byte tokens plus merges"),
            Check(
                lambda v: v <= MAX_TOKENIZER_VOCAB,
                f"an integer in [300, {MAX_TOKENIZER_VOCAB}]",
                "the built-in tokenizer is trained on the run's data; real vocabularies are 32k-256k",
            ),
        ),
    )
    """Vocabulary size of the built-in BPE tokenizer (only when it is used)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the model's weights (compute dtype under mixed precision is ``bridge.mixed_precision``)."""
    attn_implementation: str = "sdpa"
    """transformers attention implementation: sdpa (torch's fused attention, the fast default), eager (the
    reference math, materialises the attention matrix), flash_attention_2."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Training text: tokenized with the model's tokenizer and packed into fixed-length sequences."""

    files: tuple[str, ...] = field(
        default=(SAMPLE,), metadata=checks(Check(bool, "at least one file, glob pattern or 'sample'"))
    )
    """Text (.txt: one document per file) or JSONL (.jsonl: one document per line) files or glob patterns;
    ``sample`` is the small English corpus shipped with the package."""
    text_key: str = "text"
    """The field of each JSONL record that holds the text."""
    seq_len: int = field(default=128, metadata=checks(at_least(2)))
    """Tokens per packed training sequence (documents are joined with the EOS token and cut to this length)."""
    eval_sequences: int = field(default=32, metadata=checks(at_least(0)))
    """Packed sequences held out from the end of the data for evaluation, the same at any world size (the
    ranks share them; none is dropped); 0 disables evaluation."""


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The optimizer (its state is sharded with the parameters)."""

    name: Literal["adamw", "sgd"] = "adamw"
    """``adamw`` (torch.optim.AdamW) or ``sgd`` (torch.optim.SGD with momentum)."""
    lr: float = field(default=3.0e-4, metadata=checks(finite(lambda v: v > 0, "a finite number > 0")))
    """Peak learning rate, reached at the end of the warm-up."""
    weight_decay: float = field(default=0.0, metadata=checks(finite(lambda v: v >= 0, "a finite number >= 0")))
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    betas: tuple[float, float] = field(
        default=(0.9, 0.95), metadata=checks(Check(lambda v: all(0 <= b < 1 for b in v), "two numbers in [0, 1)"))
    )
    """AdamW's (beta1, beta2)."""
    eps: float = field(default=1.0e-8, metadata=checks(finite(lambda v: v > 0, "a finite number > 0")))
    """AdamW's epsilon."""
    momentum: float = field(default=0.9, metadata=checks(finite(lambda v: 0 <= v < 1, "a number in [0, 1)")))
    """SGD momentum."""
    grad_clip: float | None = field(
        default=1.0, metadata=checks(finite(lambda v: v > 0, "null or a finite number > 0"))
    )
    """Clip gradients to this global norm (over all shards) before each step; null disables clipping."""


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """Learning-rate schedule: linear warm-up, then decay."""

    warmup_steps: int = field(default=0, metadata=checks(at_least(0)))
    """Steps of linear warm-up from 0 to ``optim.lr``."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape of the decay after warm-up, down to ``min_lr_ratio * optim.lr``."""
    decay_steps: int | None = field(default=None, metadata=checks(at_least(1, optional=True)))
    """Step at which the decay ends; null: ``max_steps``. Set it to stop a run early without changing its
    schedule."""
    min_lr_ratio: float = field(default=0.1, metadata=checks(finite(lambda v: 0 <= v <= 1, "a number in [0, 1]")))
    """Final learning rate as a fraction of ``optim.lr``."""


def _async_mode(value: Any, key: str, problems: list[Problem]) -> str:
    # YAML 1.1 reads an unquoted off as false.
    if value is False:
        return "off"
    if value in ("off", "thread", "process"):
        return str(value)
    raise ValueError(value)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When and how checkpoints are written under ``output_dir/checkpoints``."""

    interval: int | None = field(default=None, metadata=checks(at_least(1, optional=True)))
    """Steps between checkpoints; null: only at the end of training."""
    kind: Literal["sharded", "full"] = "sharded"
    """``sharded``: every rank writes its shards (torch.distributed.checkpoint, reshardable on load);
    ``full``: gathered to rank 0 into one file."""
    keep_last: int | None = field(default=2, metadata=checks(at_least(1, optional=True)))
    """Keep only the newest N checkpoints; null keeps all."""
    at_end: bool = True
    """Write a checkpoint after the last step."""
    export_hf: bool = True
    """After training, write the model as a Hugging Face directory (config.json, model.safetensors, tokenizer)
    into ``output_dir``, loadable with ``AutoModelForCausalLM.from_pretrained(output_dir)``."""
    async_mode: Literal["off", "thread", "process"] = field(
        default="off",
        metadata={
            **yaml_key("async"),
            **spec("one of off, thread, process", _async_mode, fix="e.g. checkpoint: {async: process}"),
        },
    )
    """YAML key ``async`` (the attribute is ``async_mode``). ``off``: interval checkpoints are written before
    training goes on; ``thread`` / ``process``: they are staged in host memory and written in the background by
    a thread or by torch's checkpoint process (one per rank, started with the first save), while training goes
    on (``save_checkpoint_async``). The run waits for a save in flight before the next one, the end-of-run
    checkpoint, the export and exit. Needs ``kind: sharded``."""


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Where rank 0 sends each step's metrics besides ``metrics.jsonl`` (which is always written).

    The tag names are documented in docs/configuration.md (``train/loss``, ``eval/loss``, ...).  MLflow and
    Weights & Biases are optional extras (``pip install 'fsdp-bridge[mlflow]'``, ``[wandb]``): a run that enables
    one whose package is missing is refused before it starts."""

    tensorboard: bool = False
    """Write TensorBoard event files under ``output_dir/tensorboard/`` (``tensorboard --logdir
    output_dir/tensorboard``); needs the ``tensorboard`` package (extra ``tensorboard``)."""
    mlflow: bool = False
    """Log to an MLflow run (extra ``mlflow``): the tracking server of ``mlflow_tracking_uri``, else MLflow's own
    default (``MLFLOW_TRACKING_URI``, or ``./mlruns``)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (``http://host:5000``, ``file:./mlruns``); null: MLflow's default."""
    mlflow_experiment: str | None = None
    """MLflow experiment name (created if missing); null: MLflow's default experiment."""
    wandb: bool = False
    """Log to a Weights & Biases run (extra ``wandb``), with the training config as the run's config; its local
    files go under ``output_dir/wandb/``."""
    wandb_project: str | None = None
    """W&B project; null: W&B's default (``WANDB_PROJECT``, else its own)."""
    wandb_entity: str | None = None
    """W&B entity (user or team); null: the logged-in user's default."""
    run_name: str | None = None
    """Name of the MLflow and W&B runs; null: the last part of ``output_dir``."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training job.  Only ``model`` is required; every other field has a default."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model (``model.path`` or ``model.config``)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and held-out data."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    micro_batch_size: int = field(default=8, metadata=checks(at_least(1)))
    """Sequences per rank per forward/backward."""
    grad_accum: int = field(default=1, metadata=checks(at_least(1)))
    """Micro-batches accumulated (without gradient reduction) before each optimizer step."""
    max_steps: int = field(default=100, metadata=checks(at_least(1)))
    """Optimizer steps to train for (counted from the start of the run, including resumed steps)."""
    eval_interval: int | None = field(default=50, metadata=checks(at_least(1, optional=True)))
    """Steps between evaluations on the held-out data (and one after the last step); null: only at the end."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics sinks besides ``metrics.jsonl``: TensorBoard, MLflow, Weights & Biases."""
    peft: PeftConfig | None = None
    """LoRA: train adapters on the frozen model (``peft.get_peft_model`` before sharding); the adapter directory
    is written to ``output_dir/adapter``. null: train every weight."""
    seed: int = field(default=0, metadata=checks(Check(lambda v: 0 <= v <= MAX_SEED, f"an integer in [0, {MAX_SEED}]")))
    """Seed of the model's initialisation, the data order and every rank's RNG."""
    output_dir: str = field(default="runs/fsdp-bridge", metadata=checks(Check(bool, "a directory path or URL")))
    """Directory for train_config.yaml, metrics.jsonl, summary.json, checkpoints/ and the exported model;
    or an fsspec URL (``s3://bucket/run``): checkpoints are published there, the other files uploaded."""
    resume: bool | str = field(
        default=False, metadata=checks(Check(lambda v: v != "", "false, auto, or a checkpoint path"))
    )
    """false; ``auto`` (or true): continue from the latest checkpoint in ``output_dir`` if there is one;
    or the path of a checkpoint to continue from."""
    timeout_s: float = field(
        default=600.0,
        metadata=checks(
            Check(
                lambda v: 0 < v <= MAX_TIMEOUT_S,
                f"a number of seconds in (0, {MAX_TIMEOUT_S}]",
                "e.g. timeout_s: 600 (a rank silent for longer than this ends the run)",
            )
        ),
    )
    """Process-group timeout in seconds: if a rank stops answering (hung, or died outside the
    launcher's watch), the others fail with a timeout error after this long instead of waiting forever."""
    bridge: BridgeConfig = field(default_factory=BridgeConfig)
    """How the model is sharded (FSDP1 or FSDP2): see the bridge fields below."""

    def __post_init__(self) -> None:
        problems = _value_problems(self)
        if problems:
            raise ConfigError(problems)

    # -- serialisation ---------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, source: str | None = None) -> TrainConfig:
        """Build a config from a mapping (parsed YAML), reporting every problem at once.

        Args:
            data: the training YAML as a mapping (``model:``, ``data:``, ``bridge:`` ...).
            source: where ``data`` came from (a file name), named in the error.

        Returns:
            The config.

        Raises:
            ConfigError: a missing ``model:`` section, every unknown key (with "did you mean")
                and every bad value, together.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(
                [Problem("config", data, "a mapping of training keys (model:, data:, ...)")], source=source
            )
        problems: list[Problem] = []
        if "model" not in data:
            problems.append(
                Problem(
                    "model",
                    None,
                    "a model: section with model.path or model.config",
                    "add e.g. model: {path: ./my-hf-model}",
                )
            )
        kwargs = parse_section(cls, data, problems, elsewhere=_ELSEWHERE)
        try:
            config = cls(**kwargs)
        except ConfigError as err:
            known = {p.key for p in problems}
            problems.extend(p for p in err.problems if p.key not in known)
            config = None
        if problems or config is None:
            raise ConfigError(problems, source=source)
        return config

    def to_dict(self) -> dict[str, Any]:
        """Plain, YAML-safe values; ``TrainConfig.from_dict(c.to_dict()) == c``.

        Returns:
            Every section by name, the ``bridge:`` section as :meth:`BridgeConfig.to_dict` writes it.
        """
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, BridgeConfig):
                out[f.name] = value.to_dict()
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                out[f.name] = {
                    key_of(g): list(v) if isinstance(v, tuple) else v
                    for g, v in ((g, dataclasses.asdict(value)[g.name]) for g in dataclasses.fields(value))
                }
            else:
                out[f.name] = value
        return out

    def to_yaml(self) -> str:
        """The config as a training YAML (what a run writes to ``output_dir/train_config.yaml``).

        Returns:
            :meth:`to_dict` dumped as YAML, fields in declaration order.
        """
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step on one rank."""
        return self.micro_batch_size * self.grad_accum * self.data.seq_len


# ----------------------------------------------------------------------------------
# Checks on values (types are checked while parsing)
# ----------------------------------------------------------------------------------


def _value_problems(c: TrainConfig) -> list[Problem]:
    """The rules declared on each field (:func:`check_problems`), then those between fields."""
    p = check_problems(c)
    p += _model_problems(c.model)
    if c.micro_batch_size * c.data.seq_len > MAX_MICRO_BATCH_TOKENS:
        p.append(
            Problem(
                "micro_batch_size",
                c.micro_batch_size,
                f"micro_batch_size * data.seq_len <= {MAX_MICRO_BATCH_TOKENS} (got "
                f"{c.micro_batch_size} * {c.data.seq_len})",
                "use a smaller micro-batch and grad_accum for a larger effective batch",
            )
        )
    if c.checkpoint.async_mode != "off" and c.checkpoint.kind != "sharded":
        p.append(
            Problem(
                "checkpoint.async",
                c.checkpoint.async_mode,
                "off when checkpoint.kind is full (asynchronous saves write sharded checkpoints)",
                "set checkpoint.kind: sharded, or checkpoint.async: off",
            )
        )
    if c.checkpoint.async_mode != "off" and "://" in c.output_dir:
        p.append(
            Problem(
                "checkpoint.async",
                c.checkpoint.async_mode,
                f"off when output_dir is a URL ({c.output_dir!r}): asynchronous saves write to a local or "
                "shared file system only",
                "set checkpoint.async: off (object-store saves are synchronous), or a local output_dir",
            )
        )
    if c.peft is not None:
        p.extend(peft_problems(c.peft, "peft"))
    if c.model.config is not None:
        p.extend(train_quantization_problems(c.model.config, "model.config.quantization_config"))
    if c.schedule.warmup_steps > c.max_steps:
        logger.warning(
            "schedule.warmup_steps (%d) > max_steps (%d): the learning rate never reaches optim.lr",
            c.schedule.warmup_steps,
            c.max_steps,
        )
    return p


def _model_problems(m: ModelConfig) -> list[Problem]:
    p: list[Problem] = []
    if m.path is None and m.config is None:
        p.append(
            Problem(
                "model",
                None,
                "model.path (a Hugging Face directory) or model.config (from scratch)",
                "add model: {path: ./my-model} or model: {config: {model_type: llama, ...}}",
            )
        )
    if m.path is not None and m.config is not None:
        p.append(
            Problem(
                "model.config",
                "...",
                "null when model.path is given",
                "give either model.path or model.config, not both",
            )
        )
    if m.config is not None and not isinstance(m.config.get("model_type"), str):
        p.append(
            Problem(
                "model.config.model_type",
                m.config.get("model_type"),
                "a transformers model type such as llama, gpt2, qwen2, mistral",
            )
        )
    return p


# ----------------------------------------------------------------------------------
# Parsing a mapping into the dataclasses, with type checks
# ----------------------------------------------------------------------------------

_ELSEWHERE = {
    "lr": "optim.lr",
    "learning_rate": "optim.lr",
    "optim.learning_rate": "optim.lr",
    "weight_decay": "optim.weight_decay",
    "optim.optimizer": "optim.name",
    "warmup_steps": "schedule.warmup_steps",
    "optim.warmup_steps": "schedule.warmup_steps",
    "batch_size": "micro_batch_size",
    "seq_len": "data.seq_len",
    "gradient_accumulation_steps": "grad_accum",
    "num_steps": "max_steps",
    "lora": "peft",
    "tensorboard": "logging.tensorboard",
    "wandb": "logging.wandb",
    "mlflow": "logging.mlflow",
    "report_to": "logging",
    "peft.rank": "peft.r",
    "peft.lora_r": "peft.r",
    "peft.lora_alpha": "peft.alpha",
    "peft.lora_dropout": "peft.dropout",
}
"""Keys people write from other trainers' configs, and where this config keeps them."""


def parse_peft_section(value: Any, key: str = "peft") -> tuple[PeftConfig | None, list[Problem]]:
    """A ``peft:`` section (null: none) parsed and checked as in the training config, for other jobs' YAML."""
    if value is None:
        return None, []
    if not isinstance(value, Mapping):
        return None, [Problem(key, value, f"a mapping of {', '.join(field_names(PeftConfig))}, or null")]
    problems: list[Problem] = []
    kwargs = parse_section(PeftConfig, value, problems, prefix=f"{key}.", elsewhere=_ELSEWHERE)
    section = PeftConfig(**kwargs)  # the keys that parsed; their values are checked too, all reported together
    problems += peft_problems(section, key)
    return (None if problems else section), problems


# ----------------------------------------------------------------------------------
# YAML files and command-line overrides
# ----------------------------------------------------------------------------------


def default_config_path() -> Path:
    """The YAML of the built-in job that ``fsdp-bridge train`` runs without a config.

    Returns:
        Its path inside the installed package.
    """
    return Path(__file__).resolve().parents[1] / "data" / "tiny_llama.yaml"


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML file (``yaml.safe_load``: no tag can build Python objects)."""
    data = read_yaml_file(path, key="config")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            [Problem("config", data, "a mapping of training keys (model:, data:, ...)")], source=str(path)
        )
    return data


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``data`` with ``key=value`` overrides applied (dotted keys, values parsed as YAML).

    ``optim.lr=1e-3 bridge.strategy=shard_grad_op data.files=[a.txt,b.txt]``.  Unknown
    keys are not rejected here but by :meth:`TrainConfig.from_dict`, with the others.

    Args:
        data: the YAML mapping (not changed).
        overrides: ``key=value`` strings, applied in order; ``1e-3`` is read as a number.

    Returns:
        A new mapping with the overrides set (missing sections created).

    Raises:
        ConfigError: every override that is not ``key=value`` with a dotted key, together.
    """
    out: dict[str, Any] = _deep_copy(data)
    problems: list[Problem] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(Problem("override", item, "key=value with a dotted key, e.g. optim.lr=1e-3"))
            continue
        try:
            value = load_bounded_yaml(raw) if raw.strip() else None  # the YAML file's bounds
        except YamlLimitError as err:
            problems.append(
                Problem(
                    key,
                    f"{raw[:40]}..." if len(raw) > 40 else raw,
                    "a YAML value within the bounds of a config file",
                    f"it holds {err}; pass a smaller value",
                )
            )
            continue
        except yaml.YAMLError:
            value = raw  # a plain string such as a path with a colon
        # "1e-3" is a string for YAML 1.1; a number is what anyone typing it means.
        if isinstance(value, str):
            try:
                value = float(value) if any(ch in value.lower() for ch in ".e") else value
            except ValueError:
                pass
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    if problems:
        raise ConfigError(problems)
    return out


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def load_train_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), *, backend: str | None = None
) -> TrainConfig:
    """Load a training YAML (the built-in default when ``path`` is None) with overrides.

    Args:
        path: the YAML file; None loads the built-in job (:func:`default_config_path`).
        overrides: ``key=value`` strings (:func:`apply_overrides`).
        backend: sets ``bridge.backend`` (the ``--backend`` flag), after the overrides.

    Returns:
        The validated :class:`TrainConfig`.

    Raises:
        ConfigError: the file cannot be read as a YAML mapping, a malformed override, or every
            unknown key and bad value of the result, together.
    """
    source = Path(path) if path is not None else default_config_path()
    data = read_yaml(source)
    data = apply_overrides(data, overrides)
    if backend is not None:
        data = apply_overrides(data, [f"bridge.backend={backend}"])
    return TrainConfig.from_dict(data, source=str(source))


# ----------------------------------------------------------------------------------
# Reference of every field (docs/configuration.md is generated from it)
# ----------------------------------------------------------------------------------


def field_reference() -> list[FieldDoc]:
    """Every field of the training config and of its ``bridge:`` section, with type, default and meaning.

    Returns:
        One row per field (``docs/configuration.md`` is generated from them), ``model`` first.
    """
    rows = field_rows(TrainConfig)
    # The model was marked required above only by its check; say so in the reference.
    rows[0] = dataclasses.replace(rows[0], default="required")
    return rows
