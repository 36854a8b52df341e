"""A rank that fails (in shard(), in a step, while checkpointing) stops the whole job in
bounded time, the launcher names the failed rank with its traceback, and the exit code is
non-zero.  Each case runs the real CLI, which launches its ranks with the elastic launcher.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fsdp_bridge.testing.faults import ENV

# The process-group timeout is far above the bound asserted below: the job must stop
# because the launcher saw the failure, not because a collective timed out.
TIMEOUT_S = 300
BOUND_S = 150


def tiny_job(tmp_path: Path, **overrides: object) -> Path:
    job = {
        "model": {
            "config": {
                "model_type": "llama",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            }
        },
        "data": {"seq_len": 32, "eval_sequences": 4},
        "micro_batch_size": 2,
        "max_steps": 4,
        "eval_interval": None,
        "checkpoint": {"interval": 2, "export_hf": False},
        "timeout_s": TIMEOUT_S,
        "output_dir": str(tmp_path / "run"),
        "bridge": {"strategy": "full_shard", "backend": "fsdp2"},
        **overrides,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _train_with_fault(tmp_path: Path, fault: str, **job: object) -> tuple[subprocess.CompletedProcess[str], float]:
    """The built-in CLI on the tiny job with ``FSDP_BRIDGE_FAULT=fault``: its result and wall time."""
    env = {**os.environ, ENV: fault, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_bridge", "train", str(tiny_job(tmp_path, **job)), "-q"],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
        cwd=tmp_path,
    )
    return out, time.monotonic() - start


# step:3 in the fast suite; the other injection points with the slow tests (`make test-slow`, run by .ci/run).
@pytest.mark.parametrize(
    "point",
    [pytest.param("shard", marks=pytest.mark.slow), "step:3", pytest.param("checkpoint:2", marks=pytest.mark.slow)],
)
def test_failing_rank_stops_the_job(tmp_path: Path, point: str) -> None:
    out, elapsed = _train_with_fault(tmp_path, f"1:{point}")
    assert out.returncode == 1, out.stdout + out.stderr
    assert elapsed < BOUND_S, f"took {elapsed:.0f} s: the other rank waited instead of being stopped"
    assert f"InjectedFault: injected fault on rank 1 at {point}" in out.stderr, out.stderr
    assert "rank 1 failed first" in out.stderr, out.stderr


@pytest.mark.slow  # a process-group timeout run to its end
def test_hung_rank_is_named_not_the_rank_that_timed_out_waiting(tmp_path: Path) -> None:
    """Rank 1 stops answering in step 2; rank 0's collective times out after timeout_s. The launcher
    names rank 1 (its last step, from the progress each rank records), not rank 0's timeout."""
    out, elapsed = _train_with_fault(tmp_path, "1:step:2:hang", timeout_s=6)
    assert out.returncode == 1, out.stdout + out.stderr
    assert elapsed < BOUND_S, f"took {elapsed:.0f} s"
    assert "rank 1 stopped answering (rank 1 last started step 2" in out.stderr, out.stderr
    assert "rank 0 failed waiting for it" in out.stderr and "failed first" not in out.stderr, out.stderr


def test_fault_spec_for_another_rank_or_point_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_bridge.testing.faults import InjectedFault, maybe_fail

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(ENV, "1:step:3")
    maybe_fail("step:3")
    monkeypatch.setenv(ENV, "0:step:2")
    maybe_fail("step:3")
    with pytest.raises(InjectedFault, match="injected fault on rank 0 at step:2"):
        maybe_fail("step:2")


def _losses(run_dir: Path) -> dict[int, float]:
    """The loss of each step in metrics.jsonl (a resumed step's last record counts)."""
    import json

    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record and "step" in record:
            out[int(record["step"])] = float(record["loss"])
    return out


@pytest.mark.slow  # three torchrun runs; resume itself: test_train_run.py
def test_a_rank_that_dies_is_restarted_and_the_run_matches_an_uninterrupted_one(tmp_path: Path) -> None:
    """--max-restarts 1: rank 1 dies in step 3 (after the checkpoint of step 2); the elastic agent
    restarts both ranks, which resume from that checkpoint by themselves and finish with the same
    loss at every step as a run that was never interrupted."""
    cmd = [sys.executable, "-m", "fsdp_bridge", "train", str(tiny_job(tmp_path)), "-q"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    whole = subprocess.run(
        [*cmd, f"output_dir={tmp_path / 'whole'}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
        cwd=tmp_path,
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    restarted = subprocess.run(
        [*cmd, f"output_dir={tmp_path / 'restarted'}", "--max-restarts", "1"],
        capture_output=True,
        text=True,
        env={**env, ENV: "1:step:3:once"},
        timeout=TIMEOUT_S,
        cwd=tmp_path,
    )
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "restarted 1 time(s) of --max-restarts 1" in restarted.stderr, restarted.stderr[-3000:]
    assert "attempt 0: rank 1 failed (" in restarted.stderr and "InjectedFault" in restarted.stderr
    assert _losses(tmp_path / "restarted") == _losses(tmp_path / "whole")
    assert sorted(_losses(tmp_path / "whole")) == [1, 2, 3, 4]
