"""Two nodes on one machine: two torchrun agents (and two `fsdp-bridge train` launchers) meet through
the c10d rendezvous on 127.0.0.1, 2 ranks each, and train HYBRID_SHARD on the default mesh
(nodes x local ranks = (2, 2)) exactly like a reference.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_bridge.testing import run_distributed
from fsdp_bridge.testing.models import build_tiny, sample_batch

# PyTorch's float32 tolerances for distributed parity (see torch's FSDP tests).
RTOL, ATOL = 1.3e-6, 1e-5
WORKER = Path(__file__).parent / "fixtures" / "multinode_hsdp.py"
TIMEOUT_S = 240
STEPS, LR = 3, 1e-2
TINY_JOB = [
    "bridge.strategy=hybrid_shard",
    "max_steps=3",
    "eval_interval=3",
    "checkpoint.interval=3",
    "schedule.warmup_steps=1",
    "model.config.hidden_size=64",
    "model.config.num_hidden_layers=2",
    "data.seq_len=64",
    "data.eval_sequences=8",
    "micro_batch_size=2",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun's workers run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill(proc: subprocess.Popen[str]) -> None:
    """End a launcher and everything it started: SIGTERM (the agent stops its ranks), then SIGKILL."""
    if proc.poll() is None:
        below = _descendants(proc.pid)
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        for pid in [proc.pid, *below, *_descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def _started(commands: list[list[str]], cwd: Path) -> Iterator[list[subprocess.Popen[str]]]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    procs: list[subprocess.Popen[str]] = []
    try:
        for cmd in commands:
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
            )
        yield procs
    finally:
        for proc in procs:
            _kill(proc)


def _run_nodes(
    commands: list[list[str]], cwd: Path, meanwhile: Callable[[], Any] | None = None
) -> tuple[list[str], Any]:
    """Run the launchers together (and ``meanwhile()`` here while they run); fail (killing all of
    them) unless every one exits 0 in time.  Returns their outputs and what ``meanwhile`` returned."""
    with _started(commands, cwd) as procs:
        deadline = time.monotonic() + TIMEOUT_S
        during = meanwhile() if meanwhile is not None else None
        outputs = []
        for i, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"launcher {i} still running after {TIMEOUT_S} s: {commands[i]}") from None
            assert proc.returncode == 0, f"launcher {i} exited {proc.returncode}: {commands[i]}\n{out[-4000:]}"
            outputs.append(out)
    return outputs, during


def _two_nodes(tail: list[str], head: list[str]) -> list[list[str]]:
    port, run_id = _free_port(), f"mn-{uuid.uuid4().hex[:8]}"
    return [
        [
            *head,
            "--nnodes",
            "2",
            "--node-rank",
            str(i),
            "--nproc-per-node",
            "2",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            run_id,
            *tail,
        ]
        for i in (0, 1)
    ]


def _reference(world: int, steps: int, lr: float) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """One process: each step, every rank's batch through one model, gradients averaged."""
    model = build_tiny("llama", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses: list[list[float]] = [[] for _ in range(world)]
    for step in range(steps):
        for rank in range(world):
            loss = model(**sample_batch("llama", seed=(42 + rank) * 1000 + step)).loss
            (loss / world).backward()
            losses[rank].append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, model.state_dict()


def test_two_torchrun_agents_train_hybrid_shard_on_the_default_mesh_like_the_reference(tmp_path: Path) -> None:
    head = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d"]
    _run_nodes(_two_nodes([str(WORKER), str(tmp_path), str(STEPS), str(LR)], head), tmp_path)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, rec in enumerate(records):
        env = rec["env"]
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == ("4", "2", "2"), env
        # The default hybrid mesh is (nodes, ranks per node): shard within a node, replicate across.
        assert rec["mesh_shape"] == [2, 2] and rec["mesh_dims"] == ["replicate", "shard"], rec
        node_ranks = [r for r in range(4) if records[r]["env"]["GROUP_RANK"] == env["GROUP_RANK"]]
        assert rec["shard_group"] == node_ranks, (rank, rec["shard_group"], node_ranks)
    ref_losses, ref_state = _reference(4, STEPS, LR)
    for rank, rec in enumerate(records):
        assert torch.allclose(torch.tensor(rec["losses"]), torch.tensor(ref_losses[rank]), rtol=RTOL, atol=ATOL), (
            rank,
            rec["losses"],
            ref_losses[rank],
        )
    state = torch.load(tmp_path / "final.pt")
    for key, ref in ref_state.items():
        assert torch.allclose(state[key], ref, rtol=RTOL, atol=ATOL), (
            f"{key}: drifted from the reference by {(state[key] - ref).abs().max().item():.3g}"
        )


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _one_node(overrides: list[str]) -> str:
    """One rank of the one-node run: train the same job in place; rank 0 returns what shard() logged."""
    import io
    import logging

    from fsdp_bridge.train import load_train_config, train

    log = io.StringIO()
    logging.getLogger("fsdp_bridge").addHandler(logging.StreamHandler(log))
    train(load_train_config(None, overrides), verbosity="verbose")
    return log.getvalue()


@pytest.mark.slow  # three launches; two agents on one machine: the test above
def test_fsdp_bridge_train_on_two_nodes_matches_one_node_with_the_same_mesh(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "fsdp_bridge", "train", "-v"]
    # The same job on one node, 4 ranks, with the same (2, 2) mesh pinned: the same numbers.  It trains
    # through train() on 4 ranks started here (the CLI launcher itself is tested by the two nodes and by
    # test_train_run.py), while the two nodes run: the start-up overlaps.
    one_node = [*TINY_JOB, "bridge.hybrid_shape=[2,2]", f"output_dir={tmp_path / 'one'}"]
    (node0, _), (one, *_) = _run_nodes(
        _two_nodes([*TINY_JOB, f"output_dir={tmp_path / 'two'}"], cli),
        tmp_path,
        lambda: run_distributed(_one_node, 4, args=(one_node,), timeout_s=TIMEOUT_S),
    )
    assert "mesh (2, 2) on cpu" in node0 and "done: 3 steps" in node0, node0[-3000:]
    assert "mesh (2, 2) on cpu" in one, one[-3000:]
    multi, single = _metrics(tmp_path / "two"), _metrics(tmp_path / "one")
    assert [r["step"] for r in multi] == [1, 2, 3]
    for key in ("loss", "grad_norm", "eval_loss"):
        got = [r[key] for r in multi if key in r]
        want = [r[key] for r in single if key in r]
        assert got and torch.allclose(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL), (key, got, want)


def test_node_rank_outside_the_nodes_is_refused_before_anything_starts(capsys: Any) -> None:
    from fsdp_bridge.cli import main

    code = main(["train", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "x"])
    err = capsys.readouterr().err
    assert code == 2 and "--node-rank: got 2; allowed: 0 .. 1 (one below --nnodes 2)" in err, err
    assert "--node-rank 0 on the node at --rdzv-endpoint" in err, err
    assert main(["train", "--node-rank", "1", "--dry-run"]) == 2
    assert "drop --node-rank on one node, or pass --nnodes N" in capsys.readouterr().err
