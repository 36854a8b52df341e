"""Lint and the tests do not depend on what the documented commands leave in the checkout.

A new user follows the README and the quickstart in order (a training run writes ``runs/tiny-cpu``, the
migration example copies an FSDP1 script to ``train.py`` and rewrites it), then runs ``make test``. This runs
that flow in a copy of the repository, then checks what ``make lint`` runs (without a cache) and the tests that
look at the working directory, started as a shell starts a background job (SIGINT ignored).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINTED = ("fsdp_bridge", "tests", "examples", "benchmarks")
# Tests that read the working directory or depend on the signal disposition they inherit.
SENSITIVE = (
    "tests/test_train_config.py::test_every_example_yaml_starts_with_its_command_and_is_valid",
    "tests/test_train_run.py::test_stop_requests_become_one_agreed_signal",
)


def _readme_block(heading: str) -> list[str]:
    """The commands of the first bash block under ``heading`` in README.md, comments cut."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split(f"## {heading}\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, heading
    return [re.sub(r"\s+#\s.*$", "", line).strip() for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_flow_leaves_lint_and_tests_as_they_were(tmp_path: Path) -> None:
    copy = tmp_path / "checkout"
    for name in LINTED:
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__", ".ruff_cache"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, copy / name)
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": str(copy),
        "OMP_NUM_THREADS": "1",
    }

    def sh(command: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", command], cwd=copy, env=env, capture_output=True, text=True, timeout=600, **kwargs
        )

    # The flow. The quickstart's run of the example job, cut to one step on one rank (its leftovers are the
    # same: runs/tiny-cpu with a checkpoint), then the README's migration example as written.
    ran = sh("fsdp-bridge train examples/tiny_cpu.yaml max_steps=1 checkpoint.interval=1 --nproc-per-node 1")
    assert ran.returncode == 0, ran.stderr[-2000:]
    for command in _readme_block("Migrating from FSDP1"):
        ran = sh(command)
        allowed = {0, 1} if command.endswith("--diff") else {0}  # --diff exits 1 when there is a rewrite to show
        assert ran.returncode in allowed, f"`{command}`: {ran.stderr[-2000:]}"
    assert (copy / "train.py").is_file() and (copy / "runs/tiny-cpu/checkpoints").is_dir()

    # What `make lint` runs through ruff, with no cache to hide a difference.
    for command in ("ruff check --no-cache", "ruff format --check --no-cache"):
        ran = sh(f"{sys.executable} -m {command} {' '.join(LINTED)}")
        assert ran.returncode == 0, f"{command}: {ran.stdout[-2000:]}"

    # The tests that look at the checkout, started the way a shell starts a background job.
    ran = sh(
        f"{sys.executable} -m pytest -q -p no:cacheprovider {' '.join(SENSITIVE)}",
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert "2 passed" in ran.stdout
