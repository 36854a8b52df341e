"""What an asynchronous checkpoint costs training: the stall and the background time of
``save_checkpoint`` (sync) and ``save_checkpoint_async(mode="thread" | "process")``.

    OMP_NUM_THREADS=1 python benchmarks/async_save.py                     # 64 MiB of weights + AdamW, 2 ranks
    OMP_NUM_THREADS=1 python benchmarks/async_save.py --mib 32 --repeats 2  # a quick look
    OMP_NUM_THREADS=1 python benchmarks/async_save.py --docs docs/performance.md   # also write the figures there

The model is fp32 ``Linear(2048, 2048)`` layers (16 MiB each) sharded with FSDP2 over gloo ranks on
this machine's CPU, trained with AdamW, so a checkpoint holds three times ``--mib`` (weights and two
moments).  For each mode, interleaved per repeat (the order rotates, so a noisy machine slows all
alike), every figure the slowest rank's and the median over repeats:

- stall: how long the call blocks training (sync: the whole save; async: staging the state);
- background: from the call's return until ``wait()`` returns with training idle (the write, the
  checksums and, on rank 0, the publication);
- steps during the save: the mean time of ``--steps`` training steps run right after the call, over
  the mean time of the same steps with no save in flight (what the writer takes from training).

The first save of each mode is a warm-up, reported apart: it builds the host copy of the state
and, for the process mode, spawns torch's checkpoint process.  Pinned staging needs CUDA: on a
CPU-only machine the host copy is pageable (thread) or shared (process) memory.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fsdp_bridge
from fsdp_bridge.checkpoint import checkpointer_of
from fsdp_bridge.testing import run_distributed

MODES = ("sync", "thread", "process")
BEGIN = "<!-- async-save figures: written by benchmarks/async_save.py -->"
END = "<!-- end of async-save figures -->"


def _build(mib: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(max(1, mib // 16))))
    return fsdp_bridge.shard(model, fsdp_bridge.BridgeConfig(backend="fsdp2", device="cpu"))


def _slowest(seconds: float) -> float:
    box = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box.item())


def _job(root: str, mib: int, repeats: int, steps: int) -> dict[str, Any]:
    model = _build(mib)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, 2048, generator=torch.Generator().manual_seed(dist.get_rank()))

    def step() -> None:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def steps_s() -> float:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return statistics.mean(times)

    step()  # the optimizer state exists
    count = dict.fromkeys(MODES, 0)

    def save(mode: str) -> tuple[float, Any]:
        count[mode] += 1
        path = Path(root) / mode / f"step_{count[mode]:06d}"
        t0 = time.perf_counter()
        if mode == "sync":
            fsdp_bridge.save_checkpoint(path, model, opt, keep_last=1)
            return time.perf_counter() - t0, None
        pending = fsdp_bridge.save_checkpoint_async(path, model, opt, keep_last=1, mode=mode)  # type: ignore[arg-type]
        return time.perf_counter() - t0, pending

    def stall_and_background(mode: str) -> tuple[float, float]:
        dist.barrier()
        stall, pending = save(mode)
        t1 = time.perf_counter()
        if pending is not None:
            pending.wait()
        return _slowest(stall), _slowest(time.perf_counter() - t1 if pending is not None else 0.0)

    warm = {mode: stall_and_background(mode) for mode in MODES}
    rows: list[dict[str, Any]] = []
    for repeat in range(repeats):
        dist.barrier()
        base = _slowest(steps_s())
        for mode in MODES[repeat % 3 :] + MODES[: repeat % 3]:
            stall, background = stall_and_background(mode)
            row = {"repeat": repeat, "mode": mode, "stall_s": stall, "background_s": background}
            if mode != "sync":
                dist.barrier()
                _, pending = save(mode)
                row["steps_ratio"] = _slowest(steps_s()) / base
                pending.wait()
            rows.append(row)
    checkpointer_of(model).close()  # frees the host copy, ends the checkpoint process
    state_mib = 3 * sum(p.numel() for p in model.parameters()) * 4 / 2**20  # weights + AdamW moments, fp32
    return {"warm": warm, "rows": rows, "state_mib": state_mib}


def _median(rows: list[dict[str, Any]], mode: str, key: str) -> float:
    return statistics.median(r[key] for r in rows if r["mode"] == mode and key in r)


def _table(result: dict[str, Any], *, world: int, steps: int, repeats: int) -> str:
    rows, warm = result["rows"], result["warm"]
    sync = _median(rows, "sync", "stall_s")
    lines = [
        f"{result['state_mib']:.0f} MiB of state (fp32 weights + AdamW moments), FSDP2, {world} gloo ranks on CPU, "
        f"torch {torch.__version__}, {os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f} at the end); "
        f"medians of {repeats}, slowest rank; "
        f"steps: {steps} training steps right after the call, against the same steps with no save in flight.",
        "",
        "| mode | stall s | stall / sync save | background s | background / sync save | steps during the save "
        "/ without | first save: stall, background s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode in MODES:
        stall, background = _median(rows, mode, "stall_s"), _median(rows, mode, "background_s")
        steps_ratio = "-" if mode == "sync" else f"{_median(rows, mode, 'steps_ratio'):.2f}"
        label = "sync `save_checkpoint`" if mode == "sync" else f'`save_checkpoint_async(mode="{mode}")`'
        first = warm[mode]
        lines.append(
            f"| {label} | {stall:.3f} | {stall / sync:.2f} | {background:.3f} | {background / sync:.2f} | "
            f"{steps_ratio} | {first[0]:.3f}, {first[1]:.3f} |"
        )
    return "\n".join(lines)


def _write_docs(path: Path, table: str, command: str) -> None:
    text = path.read_text()
    block = f"{BEGIN}\n\n```bash\n{command}\n```\n\n{table}\n\n{END}"
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path}: no block between {BEGIN!r} and {END!r} to replace: add the two lines first")
    path.write_text(pattern.sub(lambda _m: block, text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB of fp32 weights (the state is 3x with AdamW)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="training steps timed right after each async call")
    parser.add_argument("--docs", type=Path, help="write the table into this Markdown file's async-save block")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fsdp-bridge-async-") as root:
        results = run_distributed(
            _job, args.world_size, args=(root, args.mib, args.repeats, args.steps), timeout_s=1800
        )
    table = _table(results[0], world=args.world_size, steps=args.steps, repeats=args.repeats)
    print(table)
    if args.docs is not None:
        argv_text = " ".join(argv if argv is not None else sys.argv[1:])
        _write_docs(args.docs, table, f"OMP_NUM_THREADS=1 python benchmarks/async_save.py {argv_text}".strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
