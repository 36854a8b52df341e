"""The pytest plugin as a user meets it: a test file outside the package, run by pytest."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "test_user_parity.py"

FAILING = """
import pytest
import torch.distributed as dist


def _fails_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("planted failure on rank " + str(dist.get_rank()))
    return dist.get_rank()


@pytest.mark.distributed(world_size=2)
def test_marker_rank_fails():
    _fails_on_rank_one()


def test_fixture_rank_fails(run_on_ranks):
    run_on_ranks(_fails_on_rank_one, 2)


@pytest.mark.distributed(world_size=0)
def test_bad_marker():
    pass
"""


def test_user_test_file_passes_and_failing_rank_is_reported(tmp_path):
    shutil.copy(EXAMPLE, tmp_path / "test_user_parity.py")
    (tmp_path / "test_failing_rank.py").write_text(FAILING)
    # A fresh pytest in a directory outside the package: only the installed plugin is there.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-rA",
            "-p",
            "no:cacheprovider",
            "--fsdp-backends",
            "fsdp2",
            "test_user_parity.py",
            "test_failing_rank.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    for name in ("test_backends_train_alike", "test_forward_matches_unsharded[fsdp2]", "test_run_on_ranks"):
        assert f"PASSED test_user_parity.py::{name}" in out, out
    assert "test_forward_matches_unsharded[fsdp1]" not in out  # --fsdp-backends chose the parametrisation
    for name in ("test_marker_rank_fails", "test_fixture_rank_fails", "test_bad_marker"):
        assert f"FAILED test_failing_rank.py::{name}" in out, out
    # Rank 1's own traceback, with the failing line and the exception, appears in pytest's output.
    assert out.count("--- rank 1 ---") >= 2
    assert out.count("ValueError: planted failure on rank 1") >= 2
    assert 'raise ValueError("planted failure on rank " + str(dist.get_rank()))' in out
    assert "failed on ranks [1]" in out
    assert "@pytest.mark.distributed: world_size=0 is not an integer >= 1" in out
