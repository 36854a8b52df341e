"""Static checks: lint, types, and generated docs in sync with the code's mapping table."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
    reason="ruff is in the test extra",
)
def test_ruff_clean() -> None:
    out = run(sys.executable, "-m", "ruff", "check", "fsdp_bridge", "tests", "examples", "benchmarks")
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_clean() -> None:
    out = run(sys.executable, "-m", "mypy")
    assert out.returncode == 0, out.stdout + out.stderr


def test_generated_doc_blocks_are_current() -> None:
    out = run(sys.executable, "-m", "fsdp_bridge.docgen", "--check")
    assert out.returncode == 0, out.stderr
