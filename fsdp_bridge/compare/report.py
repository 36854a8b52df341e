"""What a comparison produces: per-step records, per-run figures, per-pair verdicts.

A :class:`ParityReport` holds every run (one per backend and strategy, plus the
optional non-sharded reference), the differences between pairs of runs at every step,
and a verdict per pair judged with the :class:`Tolerance` of the run's precision.
It renders as a terminal table (:meth:`ParityReport.format`), Markdown
(:meth:`ParityReport.markdown`) and JSON (:meth:`ParityReport.to_dict`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fsdp_bridge.config import MixedPrecisionConfig

__all__ = [
    "TOLERANCES",
    "Difference",
    "PairVerdict",
    "ParityReport",
    "RunResult",
    "StepDiff",
    "StepRecord",
    "Tolerance",
    "tolerance_for",
]


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """How far two runs may drift apart and still count as the same training.

    A step passes when ``|loss_a - loss_b| <= loss_atol + loss_rtol * |loss_b|``, the
    same for the gradient norm, and (when ``param_atol`` is set) every parameter element
    differs by at most ``param_atol + param_rtol * |p_b|``.  With ``param_atol=None`` the
    largest parameter difference is reported but not judged.
    """

    name: str
    """The precision this tolerance is for (``fp32``, ``bf16``, ``fp16``, or your own)."""
    loss_rtol: float
    loss_atol: float
    grad_norm_rtol: float
    grad_norm_atol: float
    param_rtol: float = 0.0
    param_atol: float | None = None
    why: str = ""
    """Where the numbers come from (shown in reports)."""

    def close(self, a: float, b: float, *, rtol: float, atol: float) -> bool:
        """Whether ``a`` is within ``atol + rtol * |b|`` of ``b`` (as ``torch.allclose`` judges).

        Args:
            a: one run's value.
            b: the value it is judged against.
            rtol: relative tolerance.
            atol: absolute tolerance.

        Returns:
            True when close; False when not, or when either is NaN.
        """
        if math.isnan(a) or math.isnan(b):
            return False
        return abs(a - b) <= atol + rtol * abs(b)

    def describe(self) -> str:
        """One line for reports.

        Returns:
            The loss, gradient-norm and parameter tolerances, and where they come from.
        """
        params = (
            "parameters not judged (reported only)"
            if self.param_atol is None
            else f"parameters rtol {self.param_rtol:g} atol {self.param_atol:g}"
        )
        return (
            f"loss rtol {self.loss_rtol:g} atol {self.loss_atol:g}; gradient norm rtol {self.grad_norm_rtol:g} "
            f"atol {self.grad_norm_atol:g}; {params}"
        )


_ADAM_SIGN = (
    "Parameters are not judged: AdamW divides each gradient element by its own running magnitude, so an element "
    "whose tiny gradient changes sign under low-precision rounding moves by 2*lr in one step (measured: 2.0e-3 at "
    "lr 1e-3 after one bf16 step against the fp32 reference). The largest element difference then measures "
    "rounding, not a bug; loss and gradient norm carry the verdict."
)

TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(
        name="fp32",
        loss_rtol=1.3e-6,
        loss_atol=1e-5,
        grad_norm_rtol=1.3e-6,
        grad_norm_atol=1e-5,
        param_rtol=1.3e-6,
        param_atol=1e-5,
        why="torch's float32 defaults (torch.testing.assert_close: rtol 1.3e-6, atol 1e-5), the tolerance "
        "PyTorch's own FSDP parity tests use.",
    ),
    "bf16": Tolerance(
        name="bf16",
        loss_rtol=1.6e-2,
        loss_atol=1e-3,
        grad_norm_rtol=1.6e-2,
        grad_norm_atol=1e-3,
        why="torch's bfloat16 rtol (1.6e-2): bf16 keeps 8 significant bits (relative step 3.9e-3), and the "
        "gradient sums are rounded in a different order by each run (measured on a tiny Llama over 4 AdamW "
        "steps against the fp32 reference: loss 2.7e-5 relative, gradient norm 2.4e-3 relative). " + _ADAM_SIGN,
    ),
    "fp16": Tolerance(
        name="fp16",
        loss_rtol=5e-3,
        loss_atol=1e-3,
        grad_norm_rtol=5e-3,
        grad_norm_atol=1e-3,
        why="float16 keeps 11 significant bits (relative step 9.8e-4); 5e-3 leaves room for the backends' "
        "different division of gradients before and after the reduction. " + _ADAM_SIGN,
    ),
}
"""The tolerance of each compute precision (``fp32``, ``bf16``, ``fp16``), each with the reason
for its bounds; :func:`tolerance_for` picks one for a mixed-precision config."""


def tolerance_for(mixed_precision: MixedPrecisionConfig) -> Tolerance:
    """The tolerance for a run computing in ``mixed_precision.param_dtype`` (fp32 when none).

    Args:
        mixed_precision: the run's mixed-precision policy.

    Returns:
        ``TOLERANCES["bf16"]``, ``["fp16"]`` or ``["fp32"]``.
    """
    dtype = mixed_precision.param_dtype
    if dtype == torch.bfloat16:
        return TOLERANCES["bf16"]
    if dtype == torch.float16:
        return TOLERANCES["fp16"]
    return TOLERANCES["fp32"]


@dataclass
class StepRecord:
    """One optimizer step of one run (values are the same on every rank)."""

    step: int
    """1-based step number."""
    loss: float
    """The loss averaged over ranks, before the step."""
    grad_norm: float
    """The global gradient norm (over all shards and replicas), before clipping."""
    time_s: float
    """Wall time of forward, backward and optimizer step on rank 0."""


@dataclass
class RunResult:
    """One training run: its steps and what it cost."""

    name: str
    """``reference`` or ``<backend>/<strategy>`` (e.g. ``fsdp2/full_shard``)."""
    backend: str
    """``fsdp1``, ``fsdp2`` or ``reference``."""
    strategy: str | None
    config: dict[str, Any] | None
    """The bridge config of the run (None for the reference)."""
    lr: float
    steps: list[StepRecord]
    setup_time_s: float
    """Model build, sharding and optimizer creation on rank 0."""
    peak_memory_bytes: list[int | None]
    """Peak memory per rank during the run (see ``memory_kind``)."""
    memory_kind: str
    """``cuda max_memory_allocated above the run's start`` or ``peak RSS (sampled)``."""
    sharded_bytes: list[int]
    """Parameter bytes held by each rank (its shards; the whole model for the reference)."""

    @property
    def mean_step_time_s(self) -> float:
        """Mean step time, leaving out the first step (it includes lazy initialisation)."""
        times = [s.time_s for s in self.steps[1:]] or [s.time_s for s in self.steps]
        return sum(times) / len(times) if times else float("nan")


@dataclass
class StepDiff:
    """How far two runs are apart after one step."""

    step: int
    loss_diff: float
    grad_norm_diff: float
    max_param_diff: float | None
    """Largest absolute difference of any parameter element after the step (None: not measured)."""
    ok: bool


@dataclass
class PairVerdict:
    """Whether run ``a`` trains like run ``b``."""

    a: str
    b: str
    tolerance: Tolerance
    steps: list[StepDiff]
    first_divergent_step: int | None
    """The first step outside the tolerance, or None when every step is within it."""

    @property
    def ok(self) -> bool:
        return self.first_divergent_step is None

    @property
    def max_loss_diff(self) -> float:
        return max((s.loss_diff for s in self.steps), default=0.0)

    @property
    def max_param_diff(self) -> float | None:
        values = [s.max_param_diff for s in self.steps if s.max_param_diff is not None]
        return max(values) if values else None

    def describe(self) -> str:
        """The verdict in one line.

        Returns:
            ``"a vs b: PARITY (...)"`` or ``"a vs b: DIVERGED at step N (...)"`` with the differences.
        """
        head = f"{self.a} vs {self.b}: "
        if self.ok:
            return head + f"PARITY ({self.tolerance.name} tolerance)"
        step = next(s for s in self.steps if s.step == self.first_divergent_step)
        what = [f"loss diff {step.loss_diff:.3g}", f"grad-norm diff {step.grad_norm_diff:.3g}"]
        if step.max_param_diff is not None:
            what.append(f"max param diff {step.max_param_diff:.3g}")
        return (
            head + f"DIVERGED at step {self.first_divergent_step} ({', '.join(what)}; {self.tolerance.name} tolerance)"
        )


@dataclass(frozen=True)
class Difference:
    """A setting that differs between the two backends for this config and can change the numbers."""

    setting: str
    fsdp1: str
    fsdp2: str
    effect: str


@dataclass
class ParityReport:
    """Every run, every pair's per-step differences and verdicts (see :meth:`format`)."""

    runs: list[RunResult]
    pairs: list[PairVerdict]
    world_size: int
    device: str
    differences: list[Difference] = field(default_factory=list)
    param_diff_seconds: float = 0.0
    """Time spent gathering full parameters to measure their differences (rank 0)."""

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.pairs)

    def run(self, name: str) -> RunResult:
        """The run called ``name``.

        Args:
            name: a run's name (``reference``, ``fsdp1/full_shard`` ...).

        Returns:
            Its :class:`RunResult`.

        Raises:
            KeyError: no run has that name; the message lists the runs.
        """
        for r in self.runs:
            if r.name == name:
                return r
        raise KeyError(f"no run named {name!r}; runs: {', '.join(r.name for r in self.runs)}")

    def pair(self, a: str, b: str) -> PairVerdict:
        """The verdict on runs ``a`` and ``b``, in either order.

        Args:
            a: one run's name.
            b: the other run's name.

        Returns:
            Their :class:`PairVerdict`.

        Raises:
            KeyError: the two were not compared; the message lists the pairs.
        """
        for p in self.pairs:
            if {p.a, p.b} == {a, b}:
                return p
        raise KeyError(f"no pair {a} vs {b}; pairs: {', '.join(f'{p.a} vs {p.b}' for p in self.pairs)}")

    # -- rendering ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-safe data (``report.json``).

        Returns:
            Runs with their per-step records, pairs with their verdicts, the differing settings.
        """

        def verdict(p: PairVerdict) -> dict[str, Any]:
            return {
                "a": p.a,
                "b": p.b,
                "ok": p.ok,
                "first_divergent_step": p.first_divergent_step,
                "max_loss_diff": p.max_loss_diff,
                "max_param_diff": p.max_param_diff,
                "tolerance": asdict(p.tolerance),
                "steps": [asdict(s) for s in p.steps],
            }

        return {
            "ok": self.ok,
            "world_size": self.world_size,
            "device": self.device,
            "param_diff_seconds": self.param_diff_seconds,
            "runs": [{**asdict(r), "mean_step_time_s": r.mean_step_time_s} for r in self.runs],
            "pairs": [verdict(p) for p in self.pairs],
            "differences": [asdict(d) for d in self.differences],
        }

    def _run_rows(self) -> list[list[str]]:
        rows = []
        for r in self.runs:
            peak = [_mib(b) for b in r.peak_memory_bytes]
            rows.append(
                [
                    r.name,
                    f"{r.lr:g}",
                    f"{r.steps[-1].loss:.6f}" if r.steps else "-",
                    " / ".join(peak),
                    " / ".join(_bytes(b) for b in r.sharded_bytes),
                    f"{r.mean_step_time_s * 1e3:.1f}",
                    f"{r.setup_time_s:.2f}",
                ]
            )
        return rows

    _RUN_HEAD = ("run", "lr", "final loss", "peak mem/rank (MiB)", "param bytes/rank", "step ms", "setup s")

    def _step_rows(self) -> list[list[str]]:
        rows = []
        for r in self.runs:
            rows += [
                [str(s.step), r.name, f"{s.loss:.7f}", f"{s.grad_norm:.6f}", f"{s.time_s * 1e3:.1f}"] for s in r.steps
            ]
        return sorted(rows, key=lambda row: int(row[0]))

    _STEP_HEAD = ("step", "run", "loss", "grad norm", "time ms")

    def _diff_rows(self) -> list[list[str]]:
        rows = []
        for p in self.pairs:
            for d in p.steps:
                rows.append(
                    [
                        str(d.step),
                        f"{p.a} vs {p.b}",
                        f"{d.loss_diff:.2e}",
                        f"{d.grad_norm_diff:.2e}",
                        "-" if d.max_param_diff is None else f"{d.max_param_diff:.2e}",
                        "ok" if d.ok else "DIVERGED",
                    ]
                )
        return sorted(rows, key=lambda row: int(row[0]))

    _DIFF_HEAD = ("step", "pair", "|d loss|", "|d grad norm|", "max |d param|", "within tolerance")

    def format(self) -> str:
        """The terminal report: runs, per-step values, verdicts, differing defaults.

        Returns:
            Plain-text tables, ending in ``PARITY`` or ``PARITY FAILED``.
        """
        mem_kind = self.runs[0].memory_kind if self.runs else ""
        out = [
            f"fsdp-bridge compare: {len(self.runs)} runs on {self.world_size} ranks ({self.device}); "
            f"peak memory = {mem_kind}",
            "",
            _table(list(self._RUN_HEAD), self._run_rows()),
            "",
        ]
        out += [
            "per step:",
            _table(list(self._STEP_HEAD), self._step_rows()),
            "",
            "differences per step:",
            _table(list(self._DIFF_HEAD), self._diff_rows()),
            "",
        ]
        out += ["verdicts:"] + [f"  {p.describe()}" for p in self.pairs]
        if self.differences:
            out += ["", "settings that differ between the backends and can change the numbers:"]
            out += [f"  - {d.setting}: fsdp1 {d.fsdp1}; fsdp2 {d.fsdp2}. {d.effect}" for d in self.differences]
        out += ["", "PARITY" if self.ok else "PARITY FAILED"]
        return "\n".join(out)

    def markdown(self) -> str:
        """The report as Markdown (tables, verdicts, tolerances, differing defaults).

        Returns:
            The text of ``report.md``.
        """
        mem_kind = self.runs[0].memory_kind if self.runs else ""
        out = [
            f"**Result: {'parity' if self.ok else 'parity FAILED'}** - {len(self.runs)} runs on "
            f"{self.world_size} ranks ({self.device}).",
            "",
            "### Runs",
            "",
            _md_table(list(self._RUN_HEAD), self._run_rows()),
            "",
            f"Peak memory is the {mem_kind} of each rank during the run; param bytes are the parameter "
            "elements each rank holds times their size. Step time is the mean over steps 2..N on rank 0.",
            "",
            "### Verdicts",
            "",
        ]
        out += [f"- {p.describe()}" for p in self.pairs]
        tols = {p.tolerance.name: p.tolerance for p in self.pairs}
        if tols:
            out += ["", "### Tolerances", ""]
            out += [f"- **{t.name}**: {t.describe()}. {t.why}" for t in tols.values()]
        out += [
            "",
            "### Per step",
            "",
            _md_table(list(self._STEP_HEAD), self._step_rows()),
            "",
            "### Differences per step",
            "",
            _md_table(list(self._DIFF_HEAD), self._diff_rows()),
        ]
        if self.differences:
            out += [
                "",
                "### Settings that differ between the backends",
                "",
                _md_table(
                    ["setting", "fsdp1", "fsdp2", "effect on the numbers"],
                    [[d.setting, d.fsdp1, d.fsdp2, d.effect] for d in self.differences],
                ),
            ]
        return "\n".join(out) + "\n"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    def esc(s: str) -> str:
        return s.replace("|", "\\|")

    lines = ["| " + " | ".join(map(esc, head)) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines)
