"""A public FSDP1 training script before and after ``fsdp-bridge migrate code --fix``, on CPU ranks.

Copies the script's tree twice, rewrites one copy with ``--fix`` (no hand edits), runs both with
``torchrun`` on gloo and compares the loss of every step (the value of each one-element tensor that
``backward()`` is called on) on rank 0, then every ``.pt`` file both runs saved (read with
``weights_only=True``), tensor by tensor (bit for bit, or within fp32's rtol 1.3e-6 and atol 1e-5):

    python benchmarks/public_trainer_parity.py DIR SCRIPT [--nproc 4]
    python benchmarks/public_trainer_parity.py DIR --driver FILE [--nproc 2]

SCRIPT is the training script, relative to DIR. A trainer whose entry point needs what a CPU machine
without network lacks (a hub model or dataset, a launcher that spawns one process per GPU) is run by a
driver of ours instead (``--driver``, run with the tree's copy first on ``sys.path``), which builds
what the trainer would download and calls the trainer's own functions; the drivers in
``benchmarks/public_trainers/`` say what they replace. Checked with the FSDP+TP example of
pytorch/examples at the commit before it moved to FSDP2 (``distributed/tensor_parallelism/
fsdp_tp_example.py``, 8c1555d; a (dp=2, tp=2) mesh, FSDP1 on the ``dp`` sub-mesh) and with the DPO
trainer of eric-mitchell/direct-preference-optimization (``public_trainers/dpo.py``): see
docs/migration.md.

Scripts written for GPUs run here unchanged, through the same shims in both runs: the accelerator
reports the CPU device (and one per rank); NCCL process groups are made on gloo; a device given as a GPU
index (``tensor.to(rank)``, FSDP1's ``device_id=rank`` and the same argument passed on to
``BridgeConfig.from_fsdp1``) is the CPU, FSDP1 gets ``device_id=cpu`` when none is given (it refuses a
CPU-only machine otherwise), ``torch.cuda.set_device`` does nothing and ``torch.cuda.current_device()``
is the local rank; data loaders do not pin memory (it is for copies to a GPU); ``scaled_dot_product_attention``
on DTensors sharded over heads runs on each rank's heads (DTensor has no sharding rule for the CPU
kernel); the global seed is fixed before the script runs (scripts that draw weights unseeded would
differ run to run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

RTOL, ATOL = 1.3e-6, 1e-5
"""fp32 tolerances for what is not bit for bit: losses (relative), saved tensors (``torch.allclose``)."""

RUNNER = r"""
import json, os, runpy, sys
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor

import torch.distributed as dist

tree, script, out = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3]
sys.path[:0] = list(dict.fromkeys([tree, os.path.dirname(script)]))
world = int(os.environ["WORLD_SIZE"])
torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cpu")
torch.accelerator.is_available = lambda: True
torch.accelerator.device_count = lambda: world
torch.cuda.set_device = lambda *a, **k: None
torch.cuda.current_device = lambda: int(os.environ.get("LOCAL_RANK", 0))

_loader_init = torch.utils.data.DataLoader.__init__
def _unpinned(self, *args, **kwargs):
    kwargs["pin_memory"] = False
    _loader_init(self, *args, **kwargs)
torch.utils.data.DataLoader.__init__ = _unpinned

def _gpu_index(device):
    return isinstance(device, int) and not isinstance(device, bool)

_init_process_group = dist.init_process_group
def _on_gloo(backend=None, *args, **kwargs):
    return _init_process_group("gloo" if backend in (None, "nccl") else backend, *args, **kwargs)
dist.init_process_group = _on_gloo

_to = torch.Tensor.to
def _index_to_cpu(self, *args, **kwargs):
    if args and _gpu_index(args[0]):
        args = ("cpu", *args[1:])
    if _gpu_index(kwargs.get("device")):
        kwargs["device"] = "cpu"
    return _to(self, *args, **kwargs)
torch.Tensor.to = _index_to_cpu

_fsdp1_init = FullyShardedDataParallel.__init__
def _fsdp1_on_cpu(self, *args, **kwargs):
    if kwargs.get("device_id") is None or _gpu_index(kwargs["device_id"]):
        kwargs["device_id"] = torch.device("cpu")
    _fsdp1_init(self, *args, **kwargs)
FullyShardedDataParallel.__init__ = _fsdp1_on_cpu

import fsdp_bridge
_from_fsdp1 = fsdp_bridge.BridgeConfig.from_fsdp1.__func__
def _from_fsdp1_on_cpu(cls, *args, **kwargs):
    if _gpu_index(kwargs.get("device_id")):
        kwargs["device_id"] = torch.device("cpu")
    return _from_fsdp1(cls, *args, **kwargs)
fsdp_bridge.BridgeConfig.from_fsdp1 = classmethod(_from_fsdp1_on_cpu)

_sdpa = F.scaled_dot_product_attention
def _sdpa_per_rank(q, k, v, *args, **kwargs):
    if isinstance(q, DTensor):
        o = _sdpa(q.to_local(), k.to_local(), v.to_local(), *args, **kwargs)
        return DTensor.from_local(o, q.device_mesh, q.placements, run_check=False)
    return _sdpa(q, k, v, *args, **kwargs)
F.scaled_dot_product_attention = _sdpa_per_rank

losses = []
_backward = torch.Tensor.backward
def _recording(self, *args, **kwargs):
    if self.numel() == 1:
        losses.append(float(self.detach().float()))
    return _backward(self, *args, **kwargs)
torch.Tensor.backward = _recording

torch.manual_seed(0)
os.chdir(tree)
runpy.run_path(script, run_name="__main__")
if int(os.environ["RANK"]) == 0:
    with open(out, "w") as f:
        json.dump(losses, f)
"""


def _run(tree: Path, script: Path, out: Path, nproc: int, workdir: Path) -> list[float]:
    runner = workdir / "runner.py"
    runner.write_text(RUNNER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]
    proc = subprocess.run(
        [*cmd, str(runner), str(tree), str(script), str(out)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        sys.exit(f"{script} failed in {tree} (exit {proc.returncode}):\n{_first_traceback(proc.stderr)}")
    return list(json.loads(out.read_text()))


def _first_traceback(stderr: str) -> str:
    """The first rank's traceback (torchrun's own summary follows it and says less)."""
    start = stderr.find("Traceback")
    end = stderr.find("Traceback", start + 1)
    return stderr[start : end if end > start else None][-6000:] if start >= 0 else stderr[-4000:]


def _leaves(value: object, prefix: str = "") -> dict[str, object]:
    """Every leaf of a saved object by its path (``state.h.0.attn.c_attn.weight``, ``step_idx``)."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _leaves(item, f"{prefix}{key}.").items()}
    if isinstance(value, (list, tuple)):
        if prefix.endswith(".params.") and "param_groups." in prefix and all(isinstance(v, str) for v in value):
            value = sorted(value)  # an optimizer state dict's parameter names: loaders match them by name
        return {k: v for i, item in enumerate(value) for k, v in _leaves(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}


def _compare_saved(before: Path, after: Path, new: set[Path]) -> list[str]:
    """Differences between the ``.pt`` files the two runs saved (the same relative paths)."""
    import torch

    problems = []
    saved = sorted(p.relative_to(before) for p in before.rglob("*.pt") if p.relative_to(before) in new)
    for rel in saved:
        if not (after / rel).exists():
            problems.append(f"{rel}: saved by FSDP1 only")
            continue
        a, b = (_leaves(torch.load(root / rel, weights_only=True)) for root in (before, after))
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
                    if not torch.allclose(x.double(), y.double(), rtol=RTOL, atol=ATOL):
                        problems.append(f"{rel}: {key} differs beyond rtol {RTOL}, atol {ATOL}")
            elif key not in a or key not in b:
                problems.append(f"{rel}: {key} saved by {'FSDP1' if key in a else 'the rewritten script'} only")
            elif x != y and not (isinstance(x, float) and isinstance(y, float) and abs(x - y) <= RTOL * abs(x)):
                problems.append(f"{rel}: {key} = {x!r} vs {y!r}")
        exact = f"{tensors - inexact} bit for bit" + (
            f", {inexact} not (largest difference {worst:.3g})" if inexact else ""
        )
        print(f"{rel}: {tensors} tensors compared, {exact}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="the directory holding the FSDP1 script and its modules")
    parser.add_argument("script", nargs="?", help="the training script, relative to DIR")
    parser.add_argument("--driver", type=Path, help="a driver of ours that calls the trainer (instead of SCRIPT)")
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    if (args.script is None) == (args.driver is None):
        parser.error("give SCRIPT or --driver FILE (one of them)")
    with tempfile.TemporaryDirectory(prefix="fsdp-bridge-parity-") as tmp:
        work = Path(tmp)
        before, after = work / "before", work / "after"
        shutil.copytree(args.dir, before)
        shutil.copytree(args.dir, after)
        shipped = {p.relative_to(before) for p in before.rglob("*.pt")}
        fix = subprocess.run(
            [sys.executable, "-m", "fsdp_bridge", "migrate", "code", "--fix", str(after)],
            capture_output=True,
            text=True,
        )
        print(fix.stdout, end="")
        if fix.returncode == 2:
            sys.exit(f"migrate code --fix failed:\n{fix.stderr}")
        driver = args.driver.resolve() if args.driver else None
        fsdp1 = _run(before, driver or before / args.script, work / "before.json", args.nproc, work)
        fsdp2 = _run(after, driver or after / args.script, work / "after.json", args.nproc, work)
        new = {p.relative_to(before) for p in before.rglob("*.pt")} - shipped
        saved_problems = _compare_saved(before, after, new)
    if not fsdp1 or len(fsdp1) != len(fsdp2):
        sys.exit(f"steps differ: FSDP1 recorded {len(fsdp1)} losses, the rewritten script {len(fsdp2)}")
    worst = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(fsdp1, fsdp2, strict=True))
    for step, (a, b) in enumerate(zip(fsdp1, fsdp2, strict=True)):
        print(f"step {step}: FSDP1 {a!r}  after --fix (FSDP2) {b!r}")
    print(f"{len(fsdp1)} steps, largest relative difference {worst:.3g}")
    for problem in saved_problems:
        print(f"saved files differ: {problem}")
    if new:
        verdict = f"{len(saved_problems)} difference(s)" if saved_problems else f"equal (rtol {RTOL}, atol {ATOL})"
        print(f"{len(new)} saved file(s): {verdict}")
    sys.exit(0 if worst <= RTOL and not saved_problems else 1)


if __name__ == "__main__":
    main()
