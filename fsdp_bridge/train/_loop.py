"""The training loop of ``fsdp-bridge train``, usable on its own: ``train(config)`` on every rank.

    import fsdp_bridge.train as ft
    config = ft.load_train_config("examples/tiny_cpu.yaml", ["max_steps=20"])
    result = ft.train(config)              # under torchrun: every rank calls it

It builds the tokenizer, data, model and optimizer, shards the model with
:func:`fsdp_bridge.shard`, then trains with gradient accumulation (no gradient reduction
until the last micro-batch), global-norm clipping, warm-up + decay of the learning
rate, periodic evaluation on held-out data and checkpoints.  Rank 0 shows a progress
bar and writes ``metrics.jsonl`` (and TensorBoard / MLflow / W&B, as the ``logging:`` section
says); the other ranks stay silent unless they fail.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import signal
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_bridge import checkpoint as ckpt
from fsdp_bridge._faults import maybe_fail
from fsdp_bridge._launch import mark_progress
from fsdp_bridge._lora import apply_lora, reset_adapters, train_quantization_problems
from fsdp_bridge.api import clip_grad_norm_, get_bridge, no_sync, shard
from fsdp_bridge.config import parse_dtype
from fsdp_bridge.distributed import agree, init_distributed
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.train._config import TrainConfig
from fsdp_bridge.train._data import PackedData, read_documents
from fsdp_bridge.train._loggers import (
    CallbackSink,
    MetricsSink,
    close_sinks,
    log_to_sinks,
    logging_problems,
    metric_tags,
    open_sinks,
)
from fsdp_bridge.train._progress import Progress
from fsdp_bridge.train._rundir import RunDir
from fsdp_bridge.train._tokenizer import load_tokenizer

__all__ = ["STOPPED", "RunStopped", "TrainResult", "Verbosity", "lr_at", "train"]

Verbosity = Literal["quiet", "normal", "verbose"]
logger = logging.getLogger("fsdp_bridge.train")

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CONFIG = "train_config.yaml"
STOPPED = "stopped.json"
"""Written by rank 0 when a signal stopped the run: the step, the checkpoint and the signal."""


class RunStopped(Exception):
    """A signal stopped the run at a step boundary, after every rank saved its checkpoint."""

    def __init__(self, signum: int, step: int, checkpoint: str | None) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; checkpoint {checkpoint}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


@dataclass
class TrainResult:
    """What a run did (meaningful on rank 0; other ranks return the same numbers)."""

    steps: int
    """Optimizer steps completed, including steps before a resume."""
    tokens: int
    """Training tokens consumed by all ranks, including before a resume."""
    wall_time_s: float
    """Wall time of this run (from the start of ``train`` to the end)."""
    final_loss: float | None
    """Training loss of the last step of this run."""
    eval_loss: float | None
    """Held-out loss at the last evaluation."""
    best_eval_loss: float | None
    """Lowest held-out loss seen (across resumes)."""
    checkpoint: str | None
    """The last checkpoint written or loaded."""
    output_dir: str
    resumed_from: str | None = None
    optimizer_bytes: int | None = None
    """This rank's optimizer state (local shards of every state tensor), rank 0's figure."""
    full_finetune_optimizer_bytes: int | None = None
    """The same optimizer's state for every parameter of the model on this rank (what full
    fine-tuning would hold): compare with ``optimizer_bytes`` for a LoRA run."""


def optimizer_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes of ``optimizer``'s state on this rank, the same for every parameter of ``model``).

    Per-element states (AdamW's two moments) scale with each parameter's local shard; scalar
    states (``step``) are one per parameter. The second figure applies the per-element bytes of
    the trained parameters to all of them, frozen ones included."""
    from fsdp_bridge.estimate import storage_bytes
    from fsdp_bridge.estimate.tracker import local_tensor as local

    per_element = scalars = trained_numel = 0
    for p, state in optimizer.state.items():
        tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
        per_element += storage_bytes(v for v in tensors if v.dim() > 0)
        scalars += storage_bytes(v for v in tensors if v.dim() == 0)
        trained_numel += local(p).numel() if isinstance(p, torch.Tensor) else 0
    params = list(model.parameters())
    all_numel = sum(local(p).numel() for p in params)
    per_param_scalar = scalars // max(1, len(optimizer.state))
    full = (per_element * all_numel) // max(1, trained_numel) + per_param_scalar * len(params)
    return per_element + scalars, full


def lr_at(config: TrainConfig, step: int) -> float:
    """Learning rate of optimizer step number ``step + 1`` (``step`` steps already taken).

    Args:
        config: the training config (``optim.lr`` and the ``schedule`` section).
        step: optimizer steps already taken.

    Returns:
        Linear warm-up to ``optim.lr``, then constant, linear or cosine decay to
        ``min_lr_ratio`` of it at ``decay_steps`` (default ``max_steps``).
    """
    peak = config.optim.lr
    sched = config.schedule
    if step < sched.warmup_steps:
        return peak * (step + 1) / sched.warmup_steps
    if sched.decay == "constant":
        return peak
    end = sched.decay_steps or config.max_steps
    progress = min(1.0, (step - sched.warmup_steps) / max(1, end - sched.warmup_steps))
    floor = sched.min_lr_ratio
    if sched.decay == "linear":
        return peak * (1.0 - (1.0 - floor) * progress)
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------


def build_model(
    config: TrainConfig, tokenizer: Any, *, device_type: str | None = None, weights: bool = True
) -> nn.Module:
    """The (unsharded) model, identical on every rank: from ``model.path`` or ``model.config``.

    With ``device_type``, a 4-bit quantized base is refused (ConfigError) before its weights are
    loaded: the trainer's whole-model checkpoints cannot hold one.  The ``peft:`` section is applied by the caller.
    ``weights=False`` builds a ``model.path`` model on the meta device (buffers real, tied
    parameters tied) for :func:`~fsdp_bridge.load_pretrained` to fill after sharding.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    m = config.model
    dtype = parse_dtype(m.dtype)
    torch.manual_seed(config.seed)
    if m.path is not None:
        if device_type is not None:
            try:
                problems = train_quantization_problems(AutoConfig.from_pretrained(m.path), "model.path")
            except (OSError, ValueError):
                problems = []  # from_pretrained below names what is wrong with the directory
            if problems:
                raise ConfigError(problems)
        try:
            if weights:
                model = AutoModelForCausalLM.from_pretrained(m.path, attn_implementation=m.attn_implementation)
            else:
                from accelerate import init_empty_weights

                hf_config = AutoConfig.from_pretrained(m.path)
                with init_empty_weights(include_buffers=False):
                    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=m.attn_implementation)
                model.tie_weights()  # init_empty_weights unties shared parameters
        except (OSError, ValueError) as err:
            raise ConfigError(
                [
                    Problem(
                        "model.path",
                        m.path,
                        "a Hugging Face model directory (config.json + weights)",
                        str(err).splitlines()[0] if str(err) else "",
                    )
                ]
            ) from None
    else:
        assert m.config is not None  # checked by TrainConfig
        kwargs = dict(m.config)
        model_type = kwargs.pop("model_type")
        kwargs.setdefault("vocab_size", len(tokenizer))
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            kwargs.setdefault(key, tokenizer.eos_token_id)
        try:
            hf_config = AutoConfig.for_model(model_type, **kwargs)
            hf_config._attn_implementation = m.attn_implementation
            model = AutoModelForCausalLM.from_config(hf_config)
        except (ValueError, KeyError, TypeError) as err:
            raise ConfigError(
                [
                    Problem(
                        "model.config",
                        dict(m.config),
                        "a transformers config for a causal LM",
                        str(err).splitlines()[0] if str(err) else "",
                    )
                ]
            ) from None
        if hf_config.vocab_size < len(tokenizer):
            raise ConfigError(
                [
                    Problem(
                        "model.config.vocab_size",
                        hf_config.vocab_size,
                        f">= the tokenizer's vocabulary ({len(tokenizer)})",
                        "remove vocab_size to take it from the tokenizer",
                    )
                ]
            )
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False
    return model.to(dtype)  # type: ignore[arg-type]


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    o = config.optim
    params = [p for p in model.parameters() if p.requires_grad]
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    return torch.optim.AdamW(
        params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, **adamw_kernel(params)
    )


def adamw_kernel(params: Sequence[torch.Tensor]) -> dict[str, bool]:
    """The fastest AdamW implementation torch has for ``params``, by torch's own device rules.

    ``{"fused": True}`` where every parameter is a floating-point tensor on a device torch has fused
    optimizer kernels for (CPU and CUDA among them; DTensor shards included: checked on torch 2.13 CPU,
    the same losses as the per-parameter loop in fp32 on both backends); else ``{"foreach": True}`` where
    torch has foreach kernels for the device; else ``{}`` (torch's default). Parameters of two kinds,
    DTensor shards beside plain tensors (FSDP2 with ``ignored_modules``), get ``{"foreach": False}``, the
    per-parameter loop: both kernels refuse the mix in one group (torch would pick foreach on CUDA).

    Args:
        params: the parameters of the optimizer's one group.

    Returns:
        The keyword to pass to ``torch.optim.AdamW``.
    """
    try:  # torch's list of devices with fused / foreach optimizer kernels (torch/utils/_foreach_utils.py, 2.1+)
        from torch.utils._foreach_utils import (
            _get_foreach_kernels_supported_devices,
            _get_fused_kernels_supported_devices,
        )
    except ImportError:
        return {}
    if not params:
        return {}
    if len({isinstance(p, DTensor) for p in params}) > 1:
        return {"foreach": False}
    devices = {p.device.type for p in params}
    if all(torch.is_floating_point(p) for p in params) and devices <= set(_get_fused_kernels_supported_devices()):
        return {"fused": True}
    if devices <= set(_get_foreach_kernels_supported_devices()):
        return {"foreach": True}
    return {}


def rank_seed(seed: int, rank: int, step: int) -> int:
    """The seed of rank ``rank``'s RNG stream (dropout) from optimizer step ``step`` on.

    ``seed + 1 + rank`` for a run from the start (as before resumes at other world sizes
    existed); a resume at another world size starts new streams from a hash of the three, so
    they do not replay the masks of the first steps.
    """
    if step == 0:
        return seed + 1 + rank
    digest = hashlib.sha256(f"fsdp-bridge rank stream {seed} {rank} {step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # < 2**63: any torch.manual_seed accepts it


def _resize_note(state: dict[str, Any], world: int, samples_per_step: int) -> str | None:
    """What a resume at another world size keeps and what it cannot, or None at the same size."""
    saved_world = state.get("world_size")
    if saved_world is None or int(saved_world) == world:
        return None
    saved_samples = state.get("samples_per_step")
    position = int(state["data_position"])
    note = (
        f"resumed at {world} rank{'s' * (world > 1)} from a checkpoint saved at {saved_world}: the data "
        f"continues at global sample {position} (none repeated or skipped)"
    )
    if saved_samples is not None and int(saved_samples) != samples_per_step:
        note += (
            f"; the global batch is {samples_per_step} sequences per step (was {saved_samples}): steps from "
            f"here take that many, the learning-rate schedule follows the step count"
        )
    return note + "; per-rank RNG streams (dropout) are new ones, not the saved ranks'"


def _memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _resolve_resume(config: TrainConfig, root: Path | str) -> Path | str | None:
    resume = config.resume
    existing = ckpt.latest_checkpoint(root)
    if resume is False:
        if existing is not None:
            raise ConfigError(
                [
                    Problem(
                        "resume",
                        False,
                        "auto (or --resume) when output_dir holds checkpoints",
                        f"{root} already holds {Path(existing).name}: pass --resume to continue it, or "
                        "choose another output_dir",
                    )
                ]
            )
        return None
    if resume is True or resume == "auto":
        return existing
    if "://" in str(resume):
        return str(resume)  # a checkpoint at a URL: the load checks it, on every rank
    path = Path(str(resume))
    try:
        ckpt.detect(path)
    except ckpt.CheckpointError as err:
        allowed = "false, auto, or a checkpoint directory"
        raise ConfigError([Problem("resume", str(resume), allowed, str(err))]) from None
    return path


def _configure_output(rank: int, verbosity: Verbosity) -> None:
    import transformers

    # transformers' own bars ("Loading weights", "Writing model shards") would interleave with
    # the run's progress bar and metrics, at every verbosity.
    transformers.utils.logging.disable_progress_bar()
    if rank != 0 or verbosity == "quiet":
        transformers.logging.set_verbosity_error()
        logging.getLogger("fsdp_bridge").setLevel(logging.WARNING)
        warnings.filterwarnings("ignore")
    elif verbosity == "normal":
        transformers.logging.set_verbosity_warning()
        logging.getLogger("fsdp_bridge").setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", category=FutureWarning)
    else:
        logging.getLogger("fsdp_bridge").setLevel(logging.INFO)


class _StopRequests:
    """SIGTERM (preemption) and SIGINT (Ctrl-C) ask the run to stop at the next step boundary.

    The handler only records the signal; ranks agree on stopping with the step's loss
    all-reduce, so every rank stops after the same step, saves one checkpoint together
    and exits, instead of dying mid-collective with a traceback.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopRequests:
        import threading

        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = self.received or signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _mean_and_stop(loss: torch.Tensor, stop: int, world: int) -> tuple[float, int]:
    """The mean loss over ranks, and the signal some rank received (0: none), in one all-reduce.

    Counts per signal rather than signal numbers, so a sum still names the signal: SIGINT
    (a person at the terminal) wins over SIGTERM.
    """
    values = torch.tensor(
        [float(loss), float(stop == signal.SIGTERM), float(stop == signal.SIGINT)], dtype=torch.float64
    )
    if world > 1:
        dist.all_reduce(values)
    signum = int(signal.SIGINT) if values[2] > 0 else int(signal.SIGTERM) if values[1] > 0 else 0
    return float(values[0]) / world, signum


@torch.no_grad()
def evaluate(model: nn.Module, data: PackedData, config: TrainConfig, device: torch.device) -> float | None:
    """Mean loss over the held-out sequences of all ranks."""
    batches = data.eval_batches(config.micro_batch_size)
    if not batches:
        return None
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for batch, counted in batches:
        batch = batch.to(device)
        labels = batch.clone()
        labels[counted:] = -100  # padding rows (held-out count not a multiple of the world size)
        loss = model(input_ids=batch, labels=labels).loss  # every rank runs the forward: FSDP's collectives
        if counted:
            total += torch.tensor([float(loss) * counted, counted], dtype=torch.float64)
    model.train()
    if dist.get_world_size() > 1:
        dist.all_reduce(total)
    return float(total[0] / total[1])


# ----------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------


def train(
    config: TrainConfig,
    *,
    verbosity: Verbosity = "normal",
    on_metrics: Callable[[int, dict[str, float]], object] | None = None,
) -> TrainResult:
    """Run ``config`` on this rank (call on every rank; initialises the process group if needed).

    Args:
        config: the training job.
        verbosity: ``"quiet"``, ``"normal"`` or ``"verbose"`` output on rank 0.
        on_metrics: called as ``on_metrics(step, metrics)`` after each optimizer step, on every rank
            (each rank's own ``train/tokens_per_s``, ``train/step_time_s``, ``train/memory_mb``; the
            losses, ``train/lr`` and ``train/grad_norm`` are the same on all), with the tags the
            ``logging:`` sinks use (``train/loss``, ``eval/loss`` on evaluation steps, ...): e.g.
            ``lambda step, m: ray.train.report({"step": step, **m})`` inside a Ray Train worker.

    Returns:
        What the run did (steps, tokens, time, losses, where it wrote).

    Raises:
        RunStopped: SIGTERM or SIGINT stopped the run at a step boundary, after every rank saved
            a checkpoint to resume from.
        ConfigError: a problem found before the first collective (data, model, backend, the
            package of a ``logging:`` sink not installed).
    """
    start = time.perf_counter()
    missing = logging_problems(config.logging)  # the same on every rank: raised before any collective
    if missing:
        raise ConfigError(missing)
    device = init_distributed(config.bridge.device, timeout_s=config.timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    _configure_output(rank, verbosity)
    run = RunDir(config.output_dir)  # at a URL: a local copy uploaded by rank 0
    out = run.local
    # Where a `once` fault records that it fired: kept across attempts (a URL run's local copy is
    # emptied when the run starts again).
    fault_dir = out if run.url is None else out.with_name(out.name + ".faults")
    ckpt_root = run.checkpoints
    resume_from = _resolve_resume(config, ckpt_root)  # same answer on every rank: before any collective
    if rank == 0:
        run.reset()
        out.mkdir(parents=True, exist_ok=True)
        if resume_from is not None:
            run.pull(METRICS, "tokenizer")
        (out / CONFIG).write_text(config.to_yaml())
        run.push(CONFIG)
    dist.barrier()

    docs = read_documents(config.data)
    tokenizer = load_tokenizer(config, docs, out)
    if rank == 0 and run.url and (out / "tokenizer").is_dir():
        run.push("tokenizer")  # the built-in one: a run resumed after a kill reads the same
    data = PackedData.build(docs, tokenizer, config.data, seed=config.seed, rank=rank, world_size=world)
    # A pretrained model is built on the meta device and each rank reads only its slices of the
    # weights after sharding (LoRA adapters included: they are not in the base's files).
    pretrained = config.model.path
    sliced = pretrained is not None
    model = build_model(config, tokenizer, device_type=device.type, weights=not sliced)
    if pretrained is not None and sliced and not ckpt.pretrained_fits(pretrained, model):
        model = build_model(config, tokenizer, device_type=device.type)  # names differ: transformers maps them
        sliced = False
    n_params = sum(p.numel() for p in model.parameters())
    model_name = type(model).__name__
    lora_note = ""
    if config.peft is not None:
        model = apply_lora(model, config.peft)
        torch.manual_seed(config.seed)
        reset_adapters(model)  # the same adapters whether the base is read before or after sharding
        n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        lora_note = f" + LoRA r={config.peft.r} ({n_trainable:,} trainable)"
    maybe_fail("shard", run_dir=fault_dir)
    if pretrained is not None and sliced:
        sharded = ckpt.load_pretrained(model, pretrained, config.bridge)
    else:
        sharded = shard(model, config.bridge)
    sharded.train()  # from_pretrained returns a model in eval mode: dropout would be off until the first eval
    optimizer = build_optimizer(sharded, config)
    torch.manual_seed(rank_seed(config.seed, rank, 0))  # per-rank stream (dropout), saved with every checkpoint

    step, position, tokens, best_eval = 0, 0, 0, math.inf
    last_ckpt: str | None = None
    samples_per_step = world * config.micro_batch_size * config.grad_accum
    resized: str | None = None
    if resume_from is not None:
        state = ckpt.load_checkpoint(resume_from, sharded, optimizer)
        step, position, tokens = int(state["step"]), int(state["data_position"]), int(state["tokens"])
        best_eval = float(state.get("best_eval_loss") or math.inf)
        last_ckpt = str(resume_from)
        resized = _resize_note(state, world, samples_per_step)
        if resized is not None:
            # The saved per-rank RNG streams belong to the old ranks (load_checkpoint restores them
            # only at the same world size): new streams, from the seed, the rank and the step.
            torch.manual_seed(rank_seed(config.seed, rank, step))

    global_tokens_per_step = config.tokens_per_step * world
    progress = Progress(
        out / METRICS,
        enabled=rank == 0,
        verbosity=verbosity,
        total=config.max_steps,
        initial=step,
        resumed=resume_from is not None,
    )
    bridge = get_bridge(sharded)
    progress.header(
        f"fsdp-bridge train: {model_name} ({n_params / 1e6:.2f}M parameters){lora_note}, "
        f"{config.bridge.strategy.value} on {config.bridge.backend.value}, {world} rank{'s' * (world > 1)} "
        f"on {device.type}, {global_tokens_per_step} tokens/step, {len(data.train)} train / "
        f"{len(data.held_out)} held-out sequences of {config.data.seq_len}",
        detail=bridge.describe(),
        resumed=f"resumed from {resume_from} at step {step}" if resume_from is not None else None,
    )
    if resized is not None:
        progress.note(resized)

    sinks: list[MetricsSink] = []
    sink_problems: list[Problem] = []
    try:
        sinks = open_sinks(config, out, rank=rank, resumed_step=step if resume_from is not None else None)
    except ConfigError as err:  # a tracking server that refuses rank 0: every rank stops here, together
        sink_problems.extend(err.problems)
    agree(sink_problems)
    if on_metrics is not None:
        sinks.append(CallbackSink(on_metrics))

    eval_loss: float | None = None
    final_loss: float | None = None
    stopped_by = 0
    mbs, accum = config.micro_batch_size, config.grad_accum
    background = config.checkpoint.async_mode
    pending: ckpt.AsyncCheckpoint | None = None  # an interval checkpoint being written in the background
    stops = _StopRequests()
    ended = False  # the loop reached max_steps or a requested stop, without an error
    try:
        stops.__enter__()
        while step < config.max_steps:
            mark_progress(step + 1)
            t0 = time.perf_counter()
            lr = lr_at(config, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), dtype=torch.float32)
            for micro in range(accum):
                batch = data.micro_batch(position, mbs).to(device)
                position += world * mbs
                sync = micro == accum - 1
                with contextlib.nullcontext() if sync else no_sync(sharded):
                    loss = sharded(input_ids=batch, labels=batch).loss
                    (loss / accum).backward()
                if micro == 0:
                    maybe_fail(f"step:{step + 1}", run_dir=fault_dir)
                loss_sum += loss.detach().float().cpu()
            grad_norm = clip_grad_norm_(sharded, config.optim.grad_clip) if config.optim.grad_clip else None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens += global_tokens_per_step
            final_loss, stopped_by = _mean_and_stop(loss_sum / accum, stops.received, world)
            step_time = time.perf_counter() - t0
            record: dict[str, Any] = {
                "step": step,
                "loss": final_loss,
                "lr": lr,
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "tokens": tokens,
                "tokens_per_s": global_tokens_per_step / step_time,
                "step_time_s": step_time,
                "memory_mb": _memory_mb(device),
            }
            last = step == config.max_steps
            if config.data.eval_sequences and (last or (config.eval_interval and step % config.eval_interval == 0)):
                eval_loss = evaluate(sharded, data, config, device)
                if eval_loss is not None:
                    record["eval_loss"] = eval_loss
                    best_eval = min(best_eval, eval_loss)
            progress.step(record)
            if sinks:
                log_to_sinks(sinks, step, metric_tags(record))
            interval = config.checkpoint.interval
            if (interval and step % interval == 0) or (last and config.checkpoint.at_end) or stopped_by:
                state = {
                    "step": step,
                    "data_position": position,
                    "tokens": tokens,
                    "best_eval_loss": None if math.isinf(best_eval) else best_eval,
                    "world_size": world,
                    "samples_per_step": samples_per_step,
                }
                maybe_fail(f"checkpoint:{step}", run_dir=fault_dir)
                if pending is not None:  # one save at a time; its failure stops the run here
                    last_ckpt, pending = str(pending.wait()), None
                target = f"{ckpt_root}/step_{step:08d}" if run.url else Path(ckpt_root) / f"step_{step:08d}"
                if background != "off" and not last and not stopped_by:
                    # The end-of-run and the stop checkpoints are written before going on: the
                    # run ends (or the launcher resumes) from them.
                    pending = ckpt.save_checkpoint_async(
                        target,
                        sharded,
                        optimizer,
                        state=state,
                        keep_last=config.checkpoint.keep_last,
                        mode=background,
                    )
                    progress.note(f"step {step}: checkpoint staged, written in the background", verbose_only=True)
                else:
                    path = ckpt.save_checkpoint(
                        target,
                        sharded,
                        optimizer,
                        kind=config.checkpoint.kind,
                        state=state,
                        keep_last=config.checkpoint.keep_last,
                    )
                    last_ckpt = str(path)
                    if rank == 0 and run.url:
                        run.push(METRICS)  # the records up to the checkpoint a resumed run starts from
                    progress.note(f"step {step}: checkpoint written to {path}", verbose_only=True)
            if stopped_by and not last:
                break
        if background != "off":
            if pending is not None:
                last_ckpt, pending = str(pending.wait()), None
            ckpt.checkpointer_of(sharded).close()  # its host copy, its group, torch's checkpoint process
        ended = True
    except BaseException:
        if background != "off":
            _settle_background_save(sharded, config.timeout_s)
        raise
    finally:
        stops.__exit__()
        progress.close()
        close_sinks(sinks, failed=not ended)

    if stopped_by and step < config.max_steps:
        # Preempted or interrupted: the checkpoint of this step is written; the launcher
        # reads this file to say where the run stopped and how to resume it.
        if rank == 0:
            (out / STOPPED).write_text(
                json.dumps(
                    {
                        "step": step,
                        "max_steps": config.max_steps,
                        "checkpoint": last_ckpt,
                        "signal": signal.Signals(stopped_by).name,
                    }
                )
            )
            run.push(METRICS, STOPPED)
        dist.barrier()
        raise RunStopped(stopped_by, step, last_ckpt)

    if config.peft is not None:
        export_peft(sharded, tokenizer, out, merged=config.checkpoint.export_hf)
    elif config.checkpoint.export_hf:
        export_hf(sharded, tokenizer, out)
    result = TrainResult(
        steps=step,
        tokens=tokens,
        wall_time_s=time.perf_counter() - start,
        final_loss=final_loss,
        eval_loss=eval_loss,
        best_eval_loss=None if math.isinf(best_eval) else best_eval,
        checkpoint=last_ckpt,
        output_dir=run.url or str(out),
        resumed_from=str(resume_from) if resume_from else None,
    )
    result.optimizer_bytes, result.full_finetune_optimizer_bytes = optimizer_state_bytes(sharded, optimizer)
    if rank == 0:
        (out / STOPPED).unlink(missing_ok=True)  # an earlier stop of this run is resumed and done
        (out / SUMMARY).write_text(json.dumps(asdict(result), indent=1))
        run.discard(STOPPED)
        run.push()  # at a URL: config, metrics, summary, tokenizer and the exported model
        progress.summary(result, exported=config.checkpoint.export_hf, lora=config.peft is not None)
    return result


def _settle_background_save(model: nn.Module, timeout_s: float) -> None:
    """On a run that is failing: give the save in flight up to ``timeout_s`` to end (a checkpoint
    written by then is published and complete), then free what async saves hold.  Never raises:
    the error that stopped the run is the one to report; this save's own failure is logged."""
    checkpointer = ckpt.checkpointer_of(model)
    try:
        if checkpointer.pending is not None:
            checkpointer.pending.wait(timeout_s)
        checkpointer.close()
    except BaseException as err:  # logged: the run's own error follows
        logger.warning("the checkpoint being written in the background did not complete: %s", err)


ADAPTER = "adapter"
MERGED = "merged"


def export_peft(sharded: nn.Module, tokenizer: Any, out: Path, *, merged: bool) -> None:
    """A LoRA run's exports: ``out/adapter`` (``PeftModel.from_pretrained(base, out/adapter)``) and, with
    ``merged``, ``out/merged`` (the base with the adapters merged, a plain Hugging Face directory)."""
    targets = [(out / ADAPTER, "adapter")] + ([(out / MERGED, "merged")] if merged else [])
    for path, kind in targets:
        ckpt.save_checkpoint(path, sharded, kind=kind)  # type: ignore[arg-type]
        if dist.get_rank() == 0:
            tokenizer.save_pretrained(path)
    dist.barrier()


_HF_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")


def export_hf(sharded: nn.Module, tokenizer: Any, out: Path) -> None:
    """Write the trained weights, config and tokenizer to ``out`` as a Hugging Face directory.

    The weights go through ``save_checkpoint(kind="full")`` (every rank writes its shard's bytes
    into the safetensors files: no rank holds the whole model) into a staging directory inside
    ``out``; rank 0 then moves the model files into ``out`` (an earlier export's weight files are
    removed first) and writes the tokenizer."""
    import shutil

    staging = out / "export-staging"
    ckpt.save_checkpoint(staging, sharded, kind="full")
    if dist.get_rank() == 0:
        for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
            old.unlink(missing_ok=True)
        for f in staging.iterdir():
            if f.name in _HF_FILES or (f.name.startswith("model") and f.name.endswith(".safetensors")):
                f.replace(out / f.name)
        shutil.rmtree(staging)
        tokenizer.save_pretrained(out)
    dist.barrier()
