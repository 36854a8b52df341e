"""``fsdp-bridge migrate verify``: run a script before and after migration and compare what it computes.

The codemod rewrites what it can prove; what it cannot see (a loss that reads ``p.numel()``, a shard on
FSDP1 and the global size on FSDP2; a log of parameter norms; a helper in another package) only shows
when the code runs. ``verify`` runs the script under ``torchrun`` in a copy of the original tree (FSDP1)
and in a copy of the migrated one (``migrate code --fix`` on a copy, unless ``migrated`` is given), with
the same seed, records the loss of every ``backward()`` on every rank
(:mod:`fsdp_bridge.migrate.verify_runner`), compares them with a tolerance chosen from the loss's dtype,
then compares the tensors of every file both runs saved (``.pt``, ``.pth``, ``.bin``, ``.safetensors``).
Neither the user's trees nor anything outside a temporary directory is written.

    fsdp-bridge migrate verify examples/ --nproc-per-node 2 -- train.py --steps 3
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_bridge.errors import ConfigError, Problem

__all__ = ["TOLERANCES", "RunFailed", "VerifyResult", "compare_losses", "verify"]

TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-7),
    "float32": (1.3e-6, 1e-5),
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
}
"""``(rtol, atol)`` by the loss's dtype: torch.testing's defaults for each floating type. Two values agree
when ``|a - b| <= atol + rtol * |a|``."""

SAVED_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")
"""Files compared after the runs: what ``torch.save`` (and Lightning's ``.ckpt``) and safetensors write."""


class RunFailed(RuntimeError):
    """The script failed in the original tree: there is nothing to compare against."""


@dataclass(frozen=True)
class Difference:
    """The first place the two runs disagree."""

    rank: int
    step: int
    before: float | None
    after: float | None
    what: str


@dataclass
class VerifyResult:
    """Both runs' losses by rank, the verdict and what it rests on."""

    before: dict[int, list[tuple[float, str]]]
    after: dict[int, list[tuple[float, str]]]
    difference: Difference | None
    saved_problems: list[str] = field(default_factory=list)
    saved_lines: list[str] = field(default_factory=list)
    saved_inexact: int = 0
    """Saved tensors of both runs that are not equal bit for bit (within the tolerance or not)."""
    migrated_failure: str | None = None
    rtol: float | None = None
    atol: float | None = None
    fix_report: str = ""
    notes: list[str] = field(default_factory=list)
    """What the original run showed that explains a divergence (the ranks' copies of the model differed)."""

    @property
    def parity(self) -> bool:
        return self.migrated_failure is None and self.difference is None and not self.saved_problems

    def format(self, max_rows: int = 40) -> str:
        """Losses side by side (rank 0, and the rank that differs), then the verdict."""
        lines: list[str] = []
        ranks = sorted({0} | ({self.difference.rank} if self.difference else set()))
        for rank in ranks:
            a, b = self.before.get(rank, []), self.after.get(rank, [])
            if not a and not b:
                continue
            lines.append(f"rank {rank}:")
            lines.append(f"{'step':>6}  {'FSDP1 (original)':>22}  {'migrated':>22}  {'difference':>11}")
            shown = range(max(len(a), len(b)))
            for step in shown[:max_rows]:
                x = a[step][0] if step < len(a) else None
                y = b[step][0] if step < len(b) else None
                diff = f"{abs(x - y):.3e}" if x is not None and y is not None else "-"
                lines.append(f"{step:>6}  {_num(x):>22}  {_num(y):>22}  {diff:>11}")
            if len(shown) > max_rows:
                lines.append(f"   ... {len(shown) - max_rows} more steps")
        lines.extend(self.saved_lines)
        lines.extend(f"saved files differ: {p}" for p in self.saved_problems)
        if self.parity and self.saved_inexact and self._losses_bit_for_bit():
            lines.append(
                f"note: every loss agreed bit for bit, yet {self.saved_inexact} saved tensor(s) did not: the runs "
                "did the same arithmetic up to the last loss, so a tensor that differs after it points at a change "
                "the losses cannot show (an update that never reached a parameter, an EMA copy that never moved); "
                "compare those tensors before trusting the verdict"
            )
        if not self.parity:  # (a checkpoint loaded over the differing weights gives parity: nothing to explain)
            lines.extend(self.notes)
        lines.append(self.verdict())
        return "\n".join(lines)

    def _losses_bit_for_bit(self) -> bool:
        return bool(self.before) and all(
            [x for x, _ in self.before[rank]] == [y for y, _ in self.after.get(rank, [])] for rank in self.before
        )

    def verdict(self) -> str:
        steps = max((len(v) for v in self.before.values()), default=0)
        if self.migrated_failure is not None:
            return f"DIVERGED: the migrated script failed\n{self.migrated_failure}"
        if self.difference is not None:
            d = self.difference
            return (
                f"DIVERGED at step {d.step} on rank {d.rank}: FSDP1 {_num(d.before)}, migrated {_num(d.after)} "
                f"({d.what})"
            )
        if self.saved_problems:
            return f"DIVERGED: {len(self.saved_problems)} difference(s) in saved files"
        tol = f"rtol {self.rtol:g}, atol {self.atol:g}" if self.rtol is not None else "no losses"
        return f"PARITY: {steps} losses on each of {len(self.before)} rank(s) agree ({tol})"


def _num(x: float | None) -> str:
    return "-" if x is None else repr(x)


def compare_losses(
    before: dict[int, list[tuple[float, str]]],
    after: dict[int, list[tuple[float, str]]],
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> tuple[Difference | None, float | None, float | None]:
    """The first disagreement between two runs' losses, and the tolerances used.

    Tolerances not given come from :data:`TOLERANCES` by the widest (least precise) loss dtype recorded.

    Returns:
        ``(difference or None, rtol, atol)``.
    """
    dtypes = {dtype for run in (before, after) for losses in run.values() for _, dtype in losses}
    widest = max(dtypes, key=lambda d: TOLERANCES.get(d, TOLERANCES["float32"])[0], default="float32")
    default_rtol, default_atol = TOLERANCES.get(widest, TOLERANCES["float32"])
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    if not any(before.values()):
        return Difference(0, 0, None, None, "the original script called backward() on no one-element loss"), rtol, atol
    for rank in sorted(before.keys() | after.keys()):
        a, b = before.get(rank, []), after.get(rank, [])
        for step, ((x, xd), (y, yd)) in enumerate(zip(a, b, strict=False)):
            if xd != yd:
                return Difference(rank, step, x, y, f"loss dtype {xd} became {yd}"), rtol, atol
            if not abs(x - y) <= atol + rtol * abs(x):  # NaN never agrees
                return Difference(rank, step, x, y, f"beyond rtol {rtol:g}, atol {atol:g}"), rtol, atol
        if len(a) != len(b):
            step = min(len(a), len(b))
            first = a[step][0] if step < len(a) else None
            second = b[step][0] if step < len(b) else None
            what = f"FSDP1 recorded {len(a)} losses, the migrated script {len(b)}"
            return Difference(rank, step, first, second, what), rtol, atol
    return None, rtol, atol


def verify(
    tree: str | os.PathLike[str],
    script: str | os.PathLike[str],
    script_args: Sequence[str] = (),
    *,
    nproc_per_node: int = 2,
    migrated: str | os.PathLike[str] | None = None,
    seed: int = 0,
    rtol: float | None = None,
    atol: float | None = None,
    cpu_shims: bool | None = None,
    timeout: float | None = None,
    target: str = "bridge",
) -> VerifyResult:
    """Run ``script`` in ``tree`` and in its migration, and compare losses and saved tensors.

    Args:
        tree: the directory of the FSDP1 code (copied; never written).
        script: the training script, relative to ``tree`` (or, if not there, to the working directory)
            or absolute. A script outside ``tree`` is a driver: it runs with the tree's copy first on
            ``sys.path`` and calls the tree's functions.
        script_args: the script's own arguments (the same in both runs).
        nproc_per_node: ranks ``torchrun`` starts for each run.
        migrated: an already migrated copy of ``tree`` (copied; never written). Without it a copy of
            ``tree`` is rewritten by ``migrate code --fix``.
        seed: the global seed set before each run.
        rtol, atol: tolerances for losses; by default from the loss dtype (:data:`TOLERANCES`).
        cpu_shims: run a GPU script on CPU ranks (see :mod:`fsdp_bridge.migrate.verify_runner`); by
            default when no CUDA device is available.
        timeout: seconds each run may take.
        target: what ``migrate code --fix`` writes in the copy (``"bridge"`` or ``"torch"``: plain FSDP2
            code); ignored with ``migrated``.

    Returns:
        A :class:`VerifyResult`; ``result.parity`` is the verdict.

    Raises:
        ConfigError: a path or count that cannot work, before anything runs.
        RunFailed: the original script failed (its first traceback in the message).
    """
    tree_path = Path(tree)
    problems = []
    if not tree_path.is_dir():
        problems.append(Problem("DIR", str(tree), "a directory holding the FSDP1 code", "pass that directory"))
    script_path = Path(script) if Path(script).is_absolute() else tree_path / script
    if not script_path.is_file() and Path(script).is_file():  # a driver of the caller's, outside the tree
        script_path = Path(script).resolve()
    if not script_path.is_file():
        problems.append(
            Problem("SCRIPT", str(script), "a Python file, relative to DIR or absolute", "pass the training script")
        )
    if migrated is not None and not Path(migrated).is_dir():
        problems.append(
            Problem("--migrated", str(migrated), "a directory: the migrated copy of DIR", "pass it, or leave it out")
        )
    if nproc_per_node < 1:
        problems.append(Problem("--nproc-per-node", nproc_per_node, "an integer >= 1", "pass e.g. 2"))
    if target not in ("bridge", "torch"):
        problems.append(Problem("--target", target, "bridge or torch", "pass --target bridge or --target torch"))
    if problems:
        raise ConfigError(problems)
    if cpu_shims is None:
        cpu_shims = not _cuda_available()
    inside = _relative(script_path, tree_path)
    with tempfile.TemporaryDirectory(prefix="fsdp-bridge-verify-") as tmp:
        work = Path(tmp)
        before, after = work / "before", work / "after"
        shutil.copytree(tree_path, before, symlinks=True)
        shutil.copytree(Path(migrated) if migrated is not None else tree_path, after, symlinks=True)
        fix_report = "" if migrated is not None else _fix(after, target)
        shipped = _saved_files(before)
        run_before = _script_in(before, inside, script_path)
        run_after = _script_in(after, inside, script_path)
        env = _environment(cpu_shims)
        common: dict[str, Any] = {"nproc": nproc_per_node, "seed": seed, "cpu_shims": cpu_shims, "env": env}
        losses_before, failure, notes = _run(before, run_before, script_args, work / "out-before", timeout, **common)
        if failure is not None:
            raise RunFailed(f"{script} failed in the original tree (FSDP1):\n{failure}")
        losses_after, failure, _ = _run(after, run_after, script_args, work / "out-after", timeout, **common)
        result = VerifyResult(
            losses_before, losses_after, None, fix_report=fix_report, migrated_failure=failure, notes=notes
        )
        if failure is None:
            result.difference, result.rtol, result.atol = compare_losses(
                losses_before, losses_after, rtol=rtol, atol=atol
            )
            new = _saved_files(before) - shipped
            result.saved_problems, result.saved_lines, result.saved_inexact = _compare_saved(before, after, new)
    return result


def _relative(script: Path, tree: Path) -> Path | None:
    try:
        return script.resolve().relative_to(tree.resolve())
    except ValueError:
        return None


def _script_in(copy: Path, inside: Path | None, script: Path) -> Path:
    """The script to run for one copy: its own copy, or the driver outside the tree."""
    return copy / inside if inside is not None else script.resolve()


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _fix(tree: Path, target: str) -> str:
    from fsdp_bridge.migrate._code import migrate_paths

    report, _ = migrate_paths([str(tree)], fix=True, target=target)
    return report.format().replace(str(tree) + os.sep, "")


def _environment(cpu_shims: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # the runs import this package as the caller does, wherever it is installed or checked out
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    if cpu_shims:
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    return env


def _run(
    tree: Path,
    script: Path,
    script_args: Sequence[str],
    out: Path,
    timeout: float | None,
    *,
    nproc: int,
    seed: int,
    cpu_shims: bool,
    env: dict[str, str],
) -> tuple[dict[int, list[tuple[float, str]]], str | None, list[str]]:
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone"]
    cmd += ["-m", "fsdp_bridge.migrate.verify_runner", str(tree), str(script), str(out), "--seed", str(seed)]
    cmd += ["--cpu-shims"] if cpu_shims else []
    cmd += ["--", *script_args]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tree)
    except subprocess.TimeoutExpired:
        return {}, f"did not finish in {timeout:g} s", []
    if proc.returncode != 0:
        return {}, f"exit {proc.returncode}:\n{_first_traceback(proc.stderr)}", []
    losses: dict[int, list[tuple[float, str]]] = {}
    notes: list[str] = []
    for rank in range(nproc):
        path = out / f"rank{rank}.json"
        if path.is_file():
            recorded = json.loads(path.read_text())
            losses[rank] = [(float(v), str(d)) for v, d in recorded["losses"]]
            copies = recorded.get("rank_copies")
            if copies and not notes:
                notes.append(_rank_copies_text(rank, copies))
    return losses, None, notes


def _rank_copies_text(rank: int, copies: dict[str, Any]) -> str:
    """What ``verify_runner`` found at FSDP(...): the ranks' copies of the model differed before sharding."""
    names = ", ".join(str(n) for n in copies.get("names", []))
    return (
        f"note: when FSDP(...) wrapped the model, rank {rank}'s copy of {copies.get('differ')} of its "
        f"{copies.get('total')} parameters differed from another rank's (first: {names}) and sync_module_states "
        "was off: FSDP1 keeps each rank's shard of its own copy, FSDP2 cuts the copies elsewhere, so the two "
        "runs train different models from the first step. Build the model from the same seed on every rank "
        "(a seed that depends on the rank set only after it is built) or pass "
        "sync_module_states=True, then verify again"
    )


_CHAINED = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause",
)
"""How Python joins a traceback to the one raised while handling it: the error that ended the run is the last."""


def _first_traceback(stderr: str) -> str:
    """What the failing ranks printed: the first traceback not torchrun's own (its summary says less), with the
    tracebacks chained to it (an ImportError handled by another import that failed too: the last is the one
    that ended the run)."""
    head = "Traceback (most recent call last):"
    blocks = stderr.split(head)
    for i, block in enumerate(blocks[1:], start=1):
        if "torch/distributed/run.py" not in block and "elastic" not in block.split("\n", 3)[1]:
            text = head + block
            while i + 1 < len(blocks) and any(marker in block.rstrip()[-200:] for marker in _CHAINED):
                i += 1
                block = blocks[i]
                text += head + block
            return text[-6000:]
    return blocks[0][-4000:] or stderr[-4000:]


def _saved_files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.suffix in SAVED_SUFFIXES and p.is_file()}


def _leaves(value: object, prefix: str = "") -> dict[str, object]:
    """Every leaf of a saved object by its path (``model.layers.0.weight``, ``step``)."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _leaves(item, f"{prefix}{key}.").items()}
    if isinstance(value, (list, tuple)):
        if prefix.endswith(".params.") and "param_groups." in prefix and all(isinstance(v, str) for v in value):
            value = sorted(value)  # an optimizer state dict's parameter names: loaders match them by name
        return {k: v for i, item in enumerate(value) for k, v in _leaves(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}


def _load(path: Path) -> dict[str, object]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return dict(load_file(str(path)))
    import torch

    return _leaves(torch.load(path, map_location="cpu", weights_only=True))


_COMPILE_PREFIX = "_orig_mod."


def _without_compile_prefix(a: dict[str, Any], b: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str]:
    """When the two files' names differ only by torch.compile's ``_orig_mod.`` (FSDP1's state dict of a
    compiled module has it; torch's DCP state-dict functions drop it), both without it and a line saying so
    (a ``{rel}`` placeholder for the file), so that the values are still compared; else as given and ""."""
    if a.keys() == b.keys():
        return a, b, ""
    strip = {k: k.replace(_COMPILE_PREFIX, "") for k in (*a, *b)}
    a2, b2 = {strip[k]: v for k, v in a.items()}, {strip[k]: v for k, v in b.items()}
    if len(a2) != len(a) or len(b2) != len(b) or a2.keys() != b2.keys():
        return a, b, ""
    whose = "FSDP1's" if any(_COMPILE_PREFIX in k for k in a) else "the migrated script's"
    count = sum(_COMPILE_PREFIX in k for k in (*a, *b))
    return (
        a2,
        b2,
        (
            f"{{rel}}: {count} name(s) differ only by torch.compile's {_COMPILE_PREFIX!r} prefix, in {whose} "
            "(compared without it below; a checkpoint of the other run loads after removing it)"
        ),
    )


def _compare_saved(before: Path, after: Path, new: set[Path]) -> tuple[list[str], list[str], int]:
    """Differences between the files the two runs saved (same relative paths), a line per file, and the number of
    tensors not equal bit for bit."""
    import torch

    rtol, atol = TOLERANCES["float32"]
    problems: list[str] = []
    lines: list[str] = []
    not_exact = 0
    for rel in sorted(new):
        if not (after / rel).exists():
            problems.append(f"{rel}: saved by FSDP1 only")
            continue
        try:
            a, b = _load(before / rel), _load(after / rel)
        except Exception as err:  # not a tensor file after all (a .bin of something else): say so, go on
            lines.append(f"{rel}: not compared ({type(err).__name__}: {err})")
            continue
        a, b, renamed = _without_compile_prefix(a, b)
        if renamed:
            problems.append(renamed.format(rel=rel))
        tensors = inexact = 0
        worst = 0.0
        for key in sorted(a.keys() | b.keys()):
            x, y = a.get(key), b.get(key)
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                tensors += 1
                if x.shape != y.shape or x.dtype != y.dtype:
                    problems.append(f"{rel}: {key} is {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
                elif not torch.equal(x, y):
                    inexact += 1
                    worst = max(worst, (x.double() - y.double()).abs().max().item())
                    if not torch.allclose(x.double(), y.double(), rtol=rtol, atol=atol):
                        problems.append(f"{rel}: {key} differs beyond rtol {rtol}, atol {atol}")
            elif key not in a or key not in b:
                problems.append(f"{rel}: {key} saved by {'FSDP1' if key in a else 'the migrated script'} only")
            elif x != y and not (isinstance(x, float) and isinstance(y, float) and abs(x - y) <= rtol * abs(x)):
                problems.append(f"{rel}: {key} = {x!r} vs {y!r}")
        exact = f"{tensors - inexact} bit for bit" + (
            f", {inexact} within tolerance or not (largest difference {worst:.3g})" if inexact else ""
        )
        lines.append(f"{rel}: {tensors} tensors compared, {exact}")
        not_exact += inexact
    for rel in sorted(_saved_files(after) - new - _saved_files(before)):
        problems.append(f"{rel}: saved by the migrated script only")
    return problems, lines, not_exact
