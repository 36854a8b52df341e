"""A public FSDP1 training script before and after ``fsdp-bridge migrate code --fix``, on CPU ranks.

Copies the script's directory, rewrites the copy with ``--fix`` (no hand edits), runs both with
``torchrun`` on gloo and compares the loss of every step (the value of each one-element tensor
that ``backward()`` is called on) on rank 0:

    python benchmarks/public_trainer_parity.py DIR SCRIPT [--nproc 4]

Checked with the FSDP+TP example of pytorch/examples at the commit before it moved to FSDP2
(``distributed/tensor_parallelism/fsdp_tp_example.py``, 8c1555d; a (dp=2, tp=2) mesh, FSDP1 on the
``dp`` sub-mesh): see docs/migration.md.

Scripts written for GPUs run here unchanged, through the same shims in both runs: the accelerator
reports the CPU device (and one per rank); FSDP1 gets ``device_id=cpu`` when none is given (it refuses
a CPU-only machine otherwise); ``scaled_dot_product_attention`` on DTensors sharded over heads runs
on each rank's heads (DTensor has no sharding rule for the CPU kernel); the global seed is fixed
before the script runs (scripts that draw weights unseeded would differ run to run).
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

RUNNER = r"""
import json, os, runpy, sys
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor

script, out = os.path.abspath(sys.argv[1]), sys.argv[2]
sys.path.insert(0, os.path.dirname(script))
world = int(os.environ["WORLD_SIZE"])
torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cpu")
torch.accelerator.is_available = lambda: True
torch.accelerator.device_count = lambda: world

_fsdp1_init = FullyShardedDataParallel.__init__
def _fsdp1_on_cpu(self, *args, **kwargs):
    kwargs.setdefault("device_id", torch.device("cpu"))
    _fsdp1_init(self, *args, **kwargs)
FullyShardedDataParallel.__init__ = _fsdp1_on_cpu

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
os.chdir(os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
if int(os.environ["RANK"]) == 0:
    with open(out, "w") as f:
        json.dump(losses, f)
"""


def _run(script: Path, out: Path, nproc: int, workdir: Path) -> list[float]:
    runner = workdir / "runner.py"
    runner.write_text(RUNNER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]
    proc = subprocess.run([*cmd, str(runner), str(script), str(out)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{script} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return list(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="the directory holding the FSDP1 script and its modules")
    parser.add_argument("script", help="the training script, relative to DIR")
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fsdp-bridge-parity-") as tmp:
        work = Path(tmp)
        after = work / "after"
        shutil.copytree(args.dir, after)
        fix = subprocess.run(
            [sys.executable, "-m", "fsdp_bridge", "migrate", "code", "--fix", str(after)],
            capture_output=True,
            text=True,
        )
        print(fix.stdout, end="")
        if fix.returncode == 2:
            sys.exit(f"migrate code --fix failed:\n{fix.stderr}")
        before = _run((args.dir / args.script).resolve(), work / "before.json", args.nproc, work)
        rewritten = _run(after / args.script, work / "after.json", args.nproc, work)
    if not before or len(before) != len(rewritten):
        sys.exit(f"steps differ: FSDP1 recorded {len(before)} losses, the rewritten script {len(rewritten)}")
    worst = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(before, rewritten, strict=True))
    for step, (a, b) in enumerate(zip(before, rewritten, strict=True)):
        print(f"step {step}: FSDP1 {a!r}  after --fix (FSDP2) {b!r}")
    print(f"{len(before)} steps, largest relative difference {worst:.3g}")
    sys.exit(0 if worst <= 1.3e-6 else 1)


if __name__ == "__main__":
    main()
