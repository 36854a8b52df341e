"""Run the same training through several backends (and a reference) and compare them.

:func:`run_parity` is collective: call it on every rank of an initialised process
group (``fsdp-bridge compare`` and the pytest plugin spawn the ranks).  Every run starts
from the same initial weights (rank 0's, broadcast), sees the same batches and takes
the same optimizer steps; only the sharding differs.  The runs happen one after the
other in the same processes, so the only state they share is the process group.

The reference is the model PyTorch's own FSDP tests compare against: a plain,
unsharded copy on every rank whose gradients are all-reduced (averaged) before the
optimizer step, i.e. data-parallel training written out by hand.
"""

from __future__ import annotations

import gc
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_bridge._names import strip_wrapper_prefixes
from fsdp_bridge.api import clip_grad_norm_, get_bridge, shard, summon_full_params
from fsdp_bridge.compare.differences import backend_differences
from fsdp_bridge.compare.report import (
    PairVerdict,
    ParityReport,
    RunResult,
    StepDiff,
    StepRecord,
    Tolerance,
    tolerance_for,
)
from fsdp_bridge.config import BridgeConfig
from fsdp_bridge.distributed import init_distributed
from fsdp_bridge.errors import ConfigError, Problem

__all__ = ["REFERENCE", "LossFn", "OptimizerFn", "RunSpec", "default_loss", "default_optimizer", "run_parity"]

REFERENCE = "reference"

Batch = Mapping[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
OptimizerFn = Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]


def default_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``model(**batch)``'s loss: ``.loss`` (a Hugging Face model given labels), a ``"loss"``
    entry of a returned mapping, or a returned scalar tensor."""
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor) and out.dim() == 0:
        loss = out
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(
            [
                Problem(
                    "loss_fn",
                    None,
                    "a loss function, or a model returning its loss (.loss, a "
                    "'loss' entry, or a scalar tensor) for batches with labels",
                    "pass loss_fn=lambda model, batch: ...",
                )
            ]
        )
    return loss


def default_optimizer(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW with torch's defaults apart from ``lr`` and no weight decay."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One run of a comparison."""

    name: str
    """Shown in reports: ``reference`` or ``<backend>/<strategy>``."""
    config: BridgeConfig | None
    """How to shard; None for the non-sharded reference."""
    lr: float
    """Learning rate of this run (an override can make one run differ on purpose)."""

    @classmethod
    def reference(cls, lr: float) -> RunSpec:
        """The non-sharded reference run (gradients all-reduced and averaged).

        Args:
            lr: its learning rate.

        Returns:
            A run named ``reference`` with no bridge config.
        """
        return cls(name=REFERENCE, config=None, lr=lr)

    @classmethod
    def sharded(cls, config: BridgeConfig, lr: float) -> RunSpec:
        """A run sharded with ``config``.

        Args:
            config: the bridge config (its backend and strategy name the run).
            lr: its learning rate.

        Returns:
            A run named ``<backend>/<strategy>``.
        """
        return cls(name=f"{config.backend.value}/{config.strategy.value}", config=config, lr=lr)


@dataclass
class _Collected:
    """What rank 0 keeps of a run to compare it with the others."""

    result: RunResult
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Full parameters after each step (rank 0; empty when not measured)."""


def run_parity(
    model_fn: Callable[[], nn.Module],
    batches: Sequence[Batch],
    runs: Sequence[RunSpec],
    *,
    optimizer_fn: OptimizerFn = default_optimizer,
    loss_fn: LossFn = default_loss,
    grad_clip: float | None = None,
    tolerance: Tolerance | None = None,
    param_diff: bool = True,
    device: str | None = None,
) -> ParityReport:
    """Train every run in ``runs`` on ``batches`` (this rank's, one per step); compare them.

    Collective: call on every rank with the same ``runs``.  ``model_fn()`` builds the
    model; rank 0's first build gives the initial weights of every run.  Pairs compared:
    each sharded run against the reference (when one is in ``runs``), and the backends
    of the same strategy against each other.  ``tolerance`` overrides the one chosen by
    precision.  ``param_diff=False`` skips gathering full parameters after every step
    (rank 0 keeps one fp32 copy of the model per run and step).

    Args:
        model_fn: builds the model.
        batches: this rank's batches, one per step.
        runs: the runs (:meth:`RunSpec.reference`, :meth:`RunSpec.sharded`), distinct names.
        optimizer_fn: ``optimizer_fn(params, lr)`` builds each run's optimizer.
        loss_fn: ``loss_fn(model, batch)`` returns the loss.
        grad_clip: clip gradients to this global norm; None does not clip.
        tolerance: the tolerance of every pair; default by precision.
        param_diff: compare full parameters after every step.
        device: the device of the runs (``"auto"``, ``"cpu"``, ``"cuda"``); default the first
            sharded run's.

    Returns:
        The :class:`ParityReport` (it does not raise on divergence; see ``report.ok``).

    Raises:
        ConfigError: no runs, no batches, or two runs with one name.
    """
    if not runs:
        raise ConfigError([Problem("runs", [], "at least one run", "add backends or reference")])
    if not batches:
        raise ConfigError([Problem("batches", [], "at least one batch (one per step)")])
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ConfigError([Problem("runs", names, "runs with distinct names")])
    sharded = [r.config for r in runs if r.config is not None]
    dev = init_distributed(device or (sharded[0].device if sharded else "auto"))
    rank, world = dist.get_rank(), dist.get_world_size()

    initial, param_names = _initial_state(model_fn, dev)
    collected: list[_Collected] = []
    gather_s = 0.0
    for spec in runs:
        item, spent = _train_one(
            spec,
            model_fn,
            initial,
            batches,
            dev,
            optimizer_fn=optimizer_fn,
            loss_fn=loss_fn,
            grad_clip=grad_clip,
            param_names=param_names if param_diff else None,
        )
        collected.append(item)
        gather_s += spent

    report: ParityReport | None = None
    if rank == 0:
        report = ParityReport(
            runs=[c.result for c in collected],
            pairs=_pairs(collected, tolerance),
            world_size=world,
            device=str(dev),
            differences=backend_differences(sharded[0], device_type=dev.type, world_size=world) if sharded else [],
            param_diff_seconds=gather_s,
        )
    box: list[Any] = [report]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ----------------------------------------------------------------------------------
# One run
# ----------------------------------------------------------------------------------


def _initial_state(
    model_fn: Callable[[], nn.Module], device: torch.device
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Rank 0's initial weights on every rank (every run starts from exactly these), and the parameter names."""
    model = model_fn()
    names = [name for name, _ in model.named_parameters()]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    for key in sorted(state):
        tensor = state[key].to(device)
        dist.broadcast(tensor, src=0)
        state[key] = tensor.cpu()
    return state, names


def _train_one(
    spec: RunSpec,
    model_fn: Callable[[], nn.Module],
    initial: dict[str, torch.Tensor],
    batches: Sequence[Batch],
    device: torch.device,
    *,
    optimizer_fn: OptimizerFn,
    loss_fn: LossFn,
    grad_clip: float | None,
    param_names: list[str] | None,
) -> tuple[_Collected, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gc.collect()
    with _PeakMemory(device) as memory:
        t0 = _now(device)
        model = model_fn()
        model.load_state_dict(initial)
        if spec.config is None:
            model = model.to(device)
            held = sum(p.numel() * p.element_size() for p in model.parameters())
        else:
            model = shard(model, spec.config)
            held = get_bridge(model).local_numel() * next(model.parameters()).element_size()
        # Frozen parameters (a LoRA base) hold no optimizer state, as in a real fine-tune.
        optimizer = optimizer_fn([p for p in model.parameters() if p.requires_grad], spec.lr)
        setup_s = _now(device) - t0

        steps: list[StepRecord] = []
        snapshots: list[dict[str, torch.Tensor]] = []
        gather_s = 0.0
        max_norm = grad_clip if grad_clip is not None else math.inf
        for i, batch in enumerate(batches, start=1):
            t0 = _now(device)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model, {k: v.to(device) for k, v in batch.items()})
            loss.backward()
            if spec.config is None:
                _average_gradients(model, world)
                norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm)
            else:
                norm = clip_grad_norm_(model, max_norm)
            optimizer.step()
            step_s = _now(device) - t0
            mean_loss = loss.detach().float().clone()
            dist.all_reduce(mean_loss)
            steps.append(StepRecord(step=i, loss=mean_loss.item() / world, grad_norm=float(norm), time_s=step_s))
            if param_names is not None:
                t0 = time.perf_counter()
                full = _full_params(model, param_names, sharded=spec.config is not None)
                if rank == 0:
                    snapshots.append(full)
                gather_s += time.perf_counter() - t0
        del optimizer, model
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, memory.peak)
    held_all: list[Any] = [None] * world
    dist.all_gather_object(held_all, held)
    result = RunResult(
        name=spec.name,
        backend=spec.config.backend.value if spec.config else REFERENCE,
        strategy=spec.config.strategy.value if spec.config else None,
        config=spec.config.to_dict() if spec.config else None,
        lr=spec.lr,
        steps=steps,
        setup_time_s=setup_s,
        peak_memory_bytes=peaks,
        memory_kind=memory.kind,
        sharded_bytes=held_all,
    )
    return _Collected(result=result, params=snapshots), gather_s


def _average_gradients(model: nn.Module, world: int) -> None:
    """The reference's data parallelism: every gradient all-reduced and averaged."""
    for p in model.parameters():
        if not p.requires_grad:
            continue  # frozen (a LoRA base): no gradient on any rank
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad.div_(world)


def _full_params(model: nn.Module, names: list[str], *, sharded: bool) -> dict[str, torch.Tensor]:
    """fp32 CPU copies of every parameter by its original name (kept on rank 0 only)."""
    keep = dist.get_rank() == 0
    if not sharded:
        params = dict(model.named_parameters())
        return {n: params[n].detach().float().cpu().clone() for n in names} if keep else {}
    # Collective on both backends (the FSDP1 full state dict path is avoided: on CPU-only
    # torch < 2.14 its offload to CPU crashes, pytorch/pytorch#188989; see full_state_options).
    with summon_full_params(model):
        params = {strip_wrapper_prefixes(n): p for n, p in model.named_parameters()}
        return {n: params[n].detach().float().cpu().clone() for n in names if n in params} if keep else {}


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class _PeakMemory(AbstractContextManager["_PeakMemory"]):
    """Peak memory of this rank during the block: CUDA allocator peak, or sampled process RSS on CPU.

    On CUDA the figure is the allocator's peak minus what was allocated when the block began:
    torch's FSDP1 keeps parameters alive after the model is deleted, and that memory belongs
    to the earlier run.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._base = 0
        self.kind = (
            "cuda max_memory_allocated above the run's start"
            if device.type == "cuda"
            else "peak RSS (sampled every 2 ms)"
        )

    def __enter__(self) -> _PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = int(torch.cuda.memory_allocated(self.device))
            return self
        if _rss_bytes() is None:
            self.kind = "unavailable (no /proc and no psutil)"
            return self
        self.peak = _rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            rss = _rss_bytes()
            if rss is not None and (self.peak is None or rss > self.peak):
                self.peak = rss

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.peak = int(torch.cuda.max_memory_allocated(self.device)) - self._base
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            rss = _rss_bytes()
            if rss is not None and self.peak is not None:
                self.peak = max(self.peak, rss)


def _rss_bytes() -> int | None:
    """Resident set size of this process (Linux /proc, else psutil when installed)."""
    try:
        with open("/proc/self/statm") as fh:
            import os

            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


# ----------------------------------------------------------------------------------
# Comparing runs
# ----------------------------------------------------------------------------------


def _pairs(collected: list[_Collected], tolerance: Tolerance | None) -> list[PairVerdict]:
    """Each sharded run against the reference; backends of one strategy against each other."""
    by_name = {c.result.name: c for c in collected}
    ref = by_name.get(REFERENCE)
    pairs: list[tuple[_Collected, _Collected]] = []
    sharded = [c for c in collected if c.result.name != REFERENCE]
    if ref is not None:
        pairs += [(c, ref) for c in sharded]
    for i, a in enumerate(sharded):
        for b in sharded[i + 1 :]:
            if a.result.strategy == b.result.strategy:
                pairs.append((b, a))
    return [_verdict(a, b, tolerance or _looser(a, b)) for a, b in pairs]


def _looser(a: _Collected, b: _Collected) -> Tolerance:
    tols = [
        tolerance_for(BridgeConfig.from_dict(c.result.config).mixed_precision)
        for c in (a, b)
        if c.result.config is not None
    ]
    return max(tols, key=lambda t: t.loss_rtol)


def _verdict(a: _Collected, b: _Collected, tol: Tolerance) -> PairVerdict:
    diffs: list[StepDiff] = []
    first: int | None = None
    for i, (sa, sb) in enumerate(zip(a.result.steps, b.result.steps, strict=False)):
        max_dp: float | None = None
        params_ok = True
        if i < len(a.params) and i < len(b.params):
            max_dp, params_ok = _param_diff(a.params[i], b.params[i], tol)
        ok = (
            tol.close(sa.loss, sb.loss, rtol=tol.loss_rtol, atol=tol.loss_atol)
            and tol.close(sa.grad_norm, sb.grad_norm, rtol=tol.grad_norm_rtol, atol=tol.grad_norm_atol)
            and params_ok
        )
        diffs.append(
            StepDiff(
                step=sa.step,
                loss_diff=abs(sa.loss - sb.loss),
                grad_norm_diff=abs(sa.grad_norm - sb.grad_norm),
                max_param_diff=max_dp,
                ok=ok,
            )
        )
        if not ok and first is None:
            first = sa.step
    if len(a.result.steps) != len(b.result.steps) and first is None:
        first = min(len(a.result.steps), len(b.result.steps)) + 1
    return PairVerdict(a=a.result.name, b=b.result.name, tolerance=tol, steps=diffs, first_divergent_step=first)


def _param_diff(pa: dict[str, torch.Tensor], pb: dict[str, torch.Tensor], tol: Tolerance) -> tuple[float, bool]:
    worst, ok = 0.0, pa.keys() == pb.keys()
    for name, a in pa.items():
        b = pb.get(name)
        if b is None or a.shape != b.shape:
            return math.inf, False
        diff = (a - b).abs()
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        if tol.param_atol is not None and diff.numel():
            ok = ok and not bool((diff > tol.param_atol + tol.param_rtol * b.abs()).any())
    return worst, ok
