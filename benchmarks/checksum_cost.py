"""What checkpoint content verification costs: ``save_checkpoint`` against ``dcp.save`` alone and
``load_checkpoint`` against ``dcp.load`` alone, on one rank, files in the page cache.

    OMP_NUM_THREADS=1 python benchmarks/checksum_cost.py              # ~512 MiB model, median of 5
    OMP_NUM_THREADS=1 python benchmarks/checksum_cost.py --mib 64 --repeats 3   # a quick look

The model (FSDP2 on a 1-rank gloo group, fp32 ``Linear`` layers of 16 MiB) is saved and loaded
without an optimizer. Four timings per repeat, interleaved so that a noisy machine slows all alike:

- ``dcp.save``: ``get_model_state_dict`` + ``dcp.save`` into a fresh directory;
- ``save_checkpoint``: the same through fsdp_bridge (checksums, RNG, description, publish);
- ``dcp.load``: ``dcp.load`` into the model's state dict;
- ``load_checkpoint``: the same through fsdp_bridge (checks, reading into scratch tensors, set).

``save_checkpoint`` and ``load_checkpoint`` are also timed with content verification switched off
(checksums neither computed nor checked), so that the verification's own share is printed apart
from the rest of fsdp_bridge's work (publishing, reading into scratch tensors before setting).
``--chunk-kib N`` reads the files in blocks of N KiB to checksum them (the package's default otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import inspect
import os
import shutil
import socket
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import fsdp_bridge
from fsdp_bridge.checkpoint import _formats, _load


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _build(mib: int) -> nn.Module:
    layers = max(1, mib // 16)  # 2048 x 2048 fp32 = 16 MiB each
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(layers)))
    return fsdp_bridge.shard(model, fsdp_bridge.BridgeConfig(backend="fsdp2", device="cpu"))


@contextlib.contextmanager
def _checksums(chunk: int | None) -> Iterator[None]:
    """Content checksums read in blocks of ``chunk`` bytes; ``None``: neither computed at save
    (recorded as 0) nor checked at load (sizes are still checked)."""
    checksum_of, verify_manifest = _formats.checksum_of, _load.verify_manifest
    if chunk is None:
        _formats.checksum_of = lambda path, algorithm=_formats.CHECKSUM, chunk=0: 0  # type: ignore[assignment]
        _load.verify_manifest = lambda detected, **kwargs: None  # type: ignore[assignment]
    else:
        _formats.checksum_of = functools.partial(checksum_of, chunk=chunk)  # type: ignore[assignment]
    try:
        yield
    finally:
        _formats.checksum_of, _load.verify_manifest = checksum_of, verify_manifest  # type: ignore[assignment]


def _default_chunk() -> int:
    return int(inspect.signature(_formats.checksum_of).parameters["chunk"].default)


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """Wall-clock seconds and CPU seconds of this process (all its threads) of one call."""
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="model size in MiB of fp32 weights (default 512)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument(
        "--chunk-kib",
        type=int,
        default=0,
        help="read files in blocks of this many KiB to checksum them (default: the package's)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = _build(args.mib)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    root = Path(tempfile.mkdtemp(prefix="checksum_cost_", dir=args.dir))
    plain, ours = root / "plain", root / "ours"

    def plain_save() -> None:
        shutil.rmtree(plain, ignore_errors=True)
        dcp.save({"model": get_model_state_dict(model)}, storage_writer=dcp.FileSystemWriter(str(plain)))

    def plain_load() -> None:
        dcp.load({"model": get_model_state_dict(model)}, storage_reader=dcp.FileSystemReader(str(plain)))

    def our_save() -> None:
        fsdp_bridge.save_checkpoint(ours, model)

    def our_load() -> None:
        fsdp_bridge.load_checkpoint(ours, model)

    def with_checksums(chunk: int | None, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with _checksums(chunk):
                fn()

        return run

    chunk = args.chunk_kib << 10 if args.chunk_kib else None
    checked_save, checked_load = (
        (with_checksums(chunk, our_save), with_checksums(chunk, our_load)) if chunk else (our_save, our_load)
    )

    cases: dict[str, Callable[[], None]] = {
        "dcp.save": plain_save,
        "save_checkpoint": checked_save,
        "save_checkpoint, no verification": with_checksums(None, our_save),
        "dcp.load": plain_load,
        "load_checkpoint": checked_load,
        "load_checkpoint, no verification": with_checksums(None, our_load),
    }
    plain_save()
    our_save()
    for name, fn in cases.items():  # warm up: every file in the page cache, every code path imported
        if name == "load_checkpoint":
            our_save()  # the unchecked save wrote checksums of 0: load a checkpoint with real ones
        fn()
    our_save()  # the checkpoint the loads read has checksums
    times: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    for repeat in range(args.repeats):
        order = list(cases.items())
        if repeat % 2:
            order.reverse()
        for name, fn in order:
            if name == "load_checkpoint":
                our_save()  # the unchecked save may have run last: load a checkpoint with checksums
            wall, used = _timed(fn)
            times[name].append(wall)
            cpu[name].append(used)
    print(
        f"torch {torch.__version__}, model {size / 2**20:.0f} MiB fp32, 1 rank, {args.repeats} repeats, "
        f"checksum blocks of {(chunk or _default_chunk()) >> 10} KiB, "
        f"{len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"  {'seconds, median (min)':34s} {'wall':>14s} {'CPU':>14s}")
    for name in cases:
        print(
            f"  {name:34s} {statistics.median(times[name]):6.3f} ({min(times[name]):.3f}) "
            f"{statistics.median(cpu[name]):6.3f} ({min(cpu[name]):.3f})"
        )
    for stat in (statistics.median, min):
        w = {name: stat(t) for name, t in times.items()}
        c = {name: stat(t) for name, t in cpu.items()}
        print(
            f"{stat.__name__}: save_checkpoint / dcp.save {w['save_checkpoint'] / w['dcp.save']:.3f}, "
            f"load_checkpoint / dcp.load {w['load_checkpoint'] / w['dcp.load']:.3f}"
        )
        for step in ("save", "load"):
            on, off, plain_name = f"{step}_checkpoint", f"{step}_checkpoint, no verification", f"dcp.{step}"
            wall, used = w[on] - w[off], c[on] - c[off]
            print(
                f"  verification at {step}: wall {wall:+.3f} s = {wall / w[plain_name]:+.1%} of {plain_name}'s, "
                f"CPU {used:+.3f} s = {used / c[plain_name]:+.1%} of {plain_name}'s"
            )
    shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
