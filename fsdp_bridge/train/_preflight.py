"""Checks that need the file system or the world size, run before any process is started."""

from __future__ import annotations

import difflib
import json
import logging
from pathlib import Path

from fsdp_bridge._lora import apply_lora, train_quantization_problems
from fsdp_bridge._paths import unwritable_reason
from fsdp_bridge.distributed import plan_mesh
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.mapping import unsupported_problems
from fsdp_bridge.train._config import TrainConfig
from fsdp_bridge.train._data import resolve_files
from fsdp_bridge.train._loggers import logging_problems
from fsdp_bridge.train._rundir import RunDir

__all__ = ["preflight"]

logger = logging.getLogger("fsdp_bridge.train")

_JSONL_LINES_CHECKED = 1000
"""Lines of each JSONL file read on the launcher (every line is read again by the ranks)."""


def preflight(
    config: TrainConfig,
    *,
    world_size: int | None = None,
    local_world_size: int | None = None,
    device_type: str | None = None,
) -> list[str]:
    """Raise ConfigError for what would fail once the ranks run; return notes for the user.

    Checks the data files exist, the model directory exists, the package of every enabled
    ``logging:`` sink is installed, a fresh run does not write over another run's checkpoints,
    and (given the world size) that the strategy's mesh fits it and the backend supports every
    option on ``device_type``.

    Args:
        config: the training job.
        world_size: ranks the job will run on; None skips the mesh check.
        local_world_size: ranks per node (for hybrid shapes); default ``LOCAL_WORLD_SIZE``
            from the environment, else ``world_size``.
        device_type: ``"cpu"`` or ``"cuda"``; None skips the check that the backend supports
            every option there.

    Returns:
        Notes for the user: what was found about the model, the mesh planned.

    Raises:
        ConfigError: every problem found, together.
    """
    from fsdp_bridge.checkpoint import latest_checkpoint

    problems: list[Problem] = []
    try:
        resolve_files(config.data)
    except ConfigError as err:
        problems.extend(err.problems)
    for key, value in (("model.path", config.model.path), ("model.tokenizer", config.model.tokenizer)):
        if value is not None and not Path(value).is_dir():
            problems.append(
                Problem(
                    key,
                    value,
                    "an existing Hugging Face directory",
                    "download or save the model there first (save_pretrained)",
                )
            )
    problems.extend(_jsonl_problems(config))
    problems.extend(logging_problems(config.logging))
    if (
        isinstance(config.resume, str)
        and config.resume != "auto"
        and "://" not in config.resume  # a URL: the load checks it
        and not Path(config.resume).exists()
    ):
        problems.append(
            Problem(
                "resume",
                config.resume,
                "false, auto, or an existing checkpoint directory",
                "pass --resume (auto) to continue from the latest checkpoint in output_dir",
            )
        )
    if not problems:
        model_problems, model_notes = _model_problems(config, device_type)
        problems.extend(model_problems)
    else:
        model_notes = []
    run = RunDir(config.output_dir)
    reason = None if run.url else unwritable_reason(Path(config.output_dir) / "checkpoints")
    if reason is not None:
        problems.append(
            Problem(
                "output_dir",
                config.output_dir,
                "a directory this user can write",
                f"{reason}; pass output_dir=PATH with a writable location",
            )
        )
    root = run.checkpoints
    existing = latest_checkpoint(root) if reason is None else None
    if config.resume is False and existing is not None:
        problems.append(
            Problem(
                "resume",
                False,
                "auto (or --resume) when output_dir holds checkpoints",
                f"{root} already holds {Path(existing).name}: pass --resume to continue it, or choose another "
                "output_dir",
            )
        )
    notes: list[str] = list(model_notes)
    if world_size is not None:
        try:
            mesh = plan_mesh(config.bridge, world_size, local_world_size=local_world_size)
            notes.append(f"mesh {mesh.shape} ({', '.join(mesh.dim_names)}) for {world_size} ranks")
        except ConfigError as err:
            problems.extend(err.problems)
    if device_type is not None:
        problems.extend(unsupported_problems(config.bridge, config.bridge.backend, device_type=device_type))
    if problems:
        raise ConfigError(problems)
    return notes


def _jsonl_problems(config: TrainConfig) -> list[Problem]:
    """The first lines of every JSONL file are JSON objects holding ``data.text_key``."""
    try:
        files = resolve_files(config.data)
    except ConfigError:
        return []  # reported by the caller
    key = config.data.text_key
    for path in files:
        if path.suffix != ".jsonl":
            continue
        try:
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if number > _JSONL_LINES_CHECKED:
                        break
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if not isinstance(record, dict) or not isinstance(record.get(key), str):
                        found = sorted(record)[:10] if isinstance(record, dict) else type(record).__name__
                        return [
                            Problem(
                                "data.text_key",
                                key,
                                f"a string field of every record in {path}",
                                f"line {number} has no string {key!r} (its keys: {found}); set "
                                "data.text_key to the field holding the text",
                            )
                        ]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            return [Problem("data.files", str(path), "UTF-8 JSON Lines, one object per line", str(err))]
    return []


def _model_problems(config: TrainConfig, device_type: str | None = None) -> tuple[list[Problem], list[str]]:
    """Build the model on the meta device and run one forward of a micro-batch there.

    Catches what would otherwise fail on every rank after launch: an unknown
    ``model_type`` (with the closest known ones), sizes the model refuses (heads that do
    not divide the hidden size), ``seq_len`` beyond learned position embeddings.  No
    memory is allocated for weights or activations.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    m = config.model
    notes: list[str] = []
    if m.config is not None:
        kwargs = dict(m.config)
        model_type = kwargs.pop("model_type")
        if model_type not in CONFIG_MAPPING_NAMES:
            close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING_NAMES), n=3)
            fix = f"did you mean {', '.join(map(repr, close))}?" if close else "see transformers' model list"
            return [
                Problem(
                    "model.config.model_type",
                    model_type,
                    "a transformers model type (llama, gpt2, qwen2, mistral, ...)",
                    fix,
                )
            ], notes
        kwargs.setdefault("vocab_size", m.tokenizer_vocab_size)
        key = "model.config"
        try:
            hf_config = AutoConfig.for_model(model_type, **kwargs)
        except Exception as err:  # transformers validates sizes in the config's constructor
            return [Problem(key, model_type, f"a valid transformers {model_type} config", _first_line(err))], notes
    else:
        key = "model.path"
        try:
            hf_config = AutoConfig.from_pretrained(str(m.path), local_files_only=True)
        except Exception as err:
            return [Problem(key, m.path, "a Hugging Face model directory (config.json)", _first_line(err))], notes
    hf_config._attn_implementation = m.attn_implementation
    if device_type is not None:
        quantized = train_quantization_problems(hf_config, key)
        if quantized:
            return quantized, notes
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except Exception as err:
        return [
            Problem(
                key,
                getattr(hf_config, "model_type", "?"),
                "a causal language model transformers can build with these sizes",
                _first_line(err),
            )
        ], notes
    if config.peft is not None:
        try:
            model = apply_lora(model, config.peft)  # target_modules that match nothing are named here
        except ConfigError as err:
            return list(err.problems), notes
    seq_len = config.data.seq_len
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and ("position" in name or name.endswith("wpe")):
            if module.num_embeddings < seq_len:
                return [
                    Problem(
                        "data.seq_len",
                        seq_len,
                        f"at most {module.num_embeddings} (the size of {name}: learned position embeddings)",
                        "use a smaller seq_len or a model with more positions",
                    )
                ], notes
    limit = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(limit, int) and limit < seq_len:
        notes.append(
            f"data.seq_len {seq_len} exceeds max_position_embeddings {limit}: positions beyond it were never trained"
        )
    ids = torch.zeros(config.micro_batch_size, seq_len, dtype=torch.long, device="meta")
    try:
        with torch.no_grad():
            model(input_ids=ids, labels=ids)
    except Exception as err:
        text = _first_line(err)
        if "meta" in text.lower() or isinstance(err, NotImplementedError):
            # The model does something the meta device cannot (a data-dependent op): it is
            # checked on the ranks at the first step instead.
            notes.append(f"meta-device forward skipped ({text})")
        else:
            return [
                Problem(
                    key,
                    getattr(hf_config, "model_type", "?"),
                    f"a model whose forward runs on a micro-batch of {config.micro_batch_size} x {seq_len} tokens",
                    text,
                )
            ], notes
    return [], notes


def _first_line(err: BaseException) -> str:
    """The message of ``err`` in one line (validators wrap the real reason on a second line)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    text = lines[0] if len(lines) == 1 or not lines[0].endswith(":") else f"{lines[0]} {lines[1]}"
    return text if len(text) <= 300 else text[:297] + "..."
