"""Every shell command in README.md and docs/*.md runs as written, or is listed here with why not.

Commands run in a scratch copy of the repository's examples and fixtures, in the order the
document gives them (so ``cp ... train.py`` then ``fsdp-bridge migrate code train.py`` works),
with this environment's ``fsdp-bridge`` and ``python`` first on PATH.  A command that needs a
GPU, names a placeholder (``my.yaml``, ``MODEL``) or takes minutes is listed in ``NOT_RUN`` with
the reason and, where one exists, the test that covers it; a ``NOT_RUN`` entry the docs no longer
contain fails the test, so the list stays true.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

NOT_RUN: dict[str, str] = {
    "make train": "creates the environment and trains (what `.ci/run` does); the job: test_train_run.py",
    "make test": "the test suite itself (`.ci/run`)",
    "python examples/ray_train.py examples/tiny_cpu.yaml max_steps=40 output_dir=runs/ray-tiny": "starts Ray and "
    "trains on 2 workers (minutes on 2 cores); test_launchers.py runs the example (slow-marked)",
    "fsdp-bridge compare examples/compare/tiny_llama.yaml --reference --strategies all --nproc-per-node 4": "minutes on 2 cores; test_compare.py runs the same engine on every strategy",
    "pip install torch==2.13.0": "changes the environment (CI installs it)",
    "pip install -e .": "changes the environment (CI installs it)",
    "pip install -e '.[plot]'": "changes the environment",
    "fsdp-bridge train": "the default job, run by test_train_run.py::test_default_job_runs_end_to_end_through_the_cli",
    "fsdp-bridge train examples/tiny_cpu.yaml max_steps=20 optim.lr=1e-3": "a 20-step training run; overrides are tested in test_train_config.py, training in test_train_run.py",
    "fsdp-bridge train examples/tiny_cpu.yaml --backend fsdp1": "a training run; test_train_run.py trains both backends",
    "fsdp-bridge train examples/lora_tiny_llama.yaml": "a training run; tests/test_train_lora.py runs this example",
    "fsdp-bridge train examples/finetune_gpt2.yaml": "needs a Hugging Face GPT-2 directory (a download)",
    "fsdp-bridge train my.yaml --nproc-per-node 8": "8 GPUs; my.yaml is your config",
    "fsdp-bridge train my.yaml --resume": "my.yaml is your config; resume: test_train_run.py",
    "torchrun --nproc-per-node 8 -m fsdp_bridge train my.yaml": "8 GPUs; my.yaml is your config",
    "fsdp-bridge train my.yaml --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-endpoint HEAD:29500 --rdzv-id JOB": "two machines (HEAD is the first node's address); two nodes on one machine: test_multinode.py",
    "fsdp-bridge train my.yaml --nnodes 2 --node-rank 1 --nproc-per-node 8 --rdzv-endpoint HEAD:29500 --rdzv-id JOB": "two machines (HEAD is the first node's address); two nodes on one machine: test_multinode.py",
    "fsdp-bridge train --nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:29500 --rdzv-id demo "
    "bridge.strategy=hybrid_shard &": "one of two launchers that must run together (one in the background): "
    "test_multinode.py runs both, on a free port, and stops them on failure",
    "fsdp-bridge train --nnodes 2 --node-rank 1 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:29500 --rdzv-id demo "
    "bridge.strategy=hybrid_shard": "the other of the two launchers above: test_multinode.py",
    "fsdp-bridge estimate MODEL --world-size N [--nodes K] [--strategy S|all] [--backend fsdp1|fsdp2|all] "
    "[--mixed-precision fp32|bf16|fp16] [--cpu-offload] [--optimizer adamw|adam|sgd|sgd-nomomentum|adagrad|rmsprop] "
    "[--wrap auto|none|ClassA,ClassB] [--batch B --seq-len S] [--activation-checkpointing] "
    "[--device-memory 80GiB] [--fake-world] [--json]": "the synopsis (placeholders)",
    "OMP_NUM_THREADS=1 python benchmarks/plan_at_scale.py": "40 s; test_fake_world.py plans the same worlds",
    "fsdp-bridge migrate verify <checkout>/distributed/tensor_parallelism --nproc-per-node 4 -- fsdp_tp_example.py": "needs a checkout of pytorch/examples (a download); 2.5 minutes at 4 ranks",
    "fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/dpo.py": "needs a checkout of eric-mitchell/direct-preference-optimization (a download) and torch 2.14.1 on CPU",
    "fsdp-bridge migrate verify <checkout>/distributed/FSDP -- benchmarks/public_trainers/t5.py": "needs a checkout of pytorch/examples (a download) and torch 2.14.1 on CPU",
    "fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/torchtitan.py": "needs a checkout of pytorch/torchtitan at ab5d918 (a download)",
    "python benchmarks/run.py": "the full benchmark suite (minutes)",
    "python benchmarks/run.py --quick": "a benchmark run (about a minute)",
    "OMP_NUM_THREADS=1 python benchmarks/no_shard.py": "a benchmark (about a minute on 2 cores)",
    "OMP_NUM_THREADS=1 python benchmarks/peak_breakdown.py --strategy no_shard": "a benchmark (15 s on 2 cores); LiveBytes' sites: test_estimate.py",
    "OMP_NUM_THREADS=1 python benchmarks/no_shard.py --mixed-precision bf16": "a benchmark (about a minute on 2 cores); what it shows: test_core_distributed.py::test_no_shard_on_fsdp2_holds_one_units_copy_not_the_models",
    "python benchmarks/gpu.py --repeats 1 --steps 6 --out benchmarks/results-gpu.json": "needs a CUDA GPU (exits 2 without one); the GPU paths: test_gpu.py (CUDA-marked)",
    "python benchmarks/gpu.py --modes bf16 --repeats 3 --steps 6": "needs a CUDA GPU (exits 2 without one)",
    "python benchmarks/gpu.py --quick": "needs a CUDA GPU (exits 2 without one)",
    "python benchmarks/gpu.py --quick --modes bf16": "needs a CUDA GPU (exits 2 without one)",
    "python -m pytest tests/test_reliability_faults.py tests/test_reliability_checkpoints.py "
    "tests/test_config_properties.py tests/test_bad_inputs.py tests/test_checkpoint_description_fuzz.py": "part of this test suite",
    "python -m pytest -m slow": "the slow tests (minutes)",
    "fsdp-bridge inspect s3://bucket/run/checkpoints/step_100": "needs an S3 bucket and credentials; "
    "inspect at a URL: test_checkpoint_objstore.py (memory://) and test_checkpoint_s3.py (moto's S3 server)",
    "fsdp-bridge convert s3://bucket/run/checkpoints/step_100 s3://bucket/export --to hf": "needs an S3 bucket "
    "and credentials; convert at URLs: test_checkpoint_objstore.py",
    "fsdp-bridge migrate code src/ --diff --target torch": "src/ is your tree; --target torch: test_migrate_target_torch.py",
    "fsdp-bridge migrate code src/ --fix --target torch": "src/ is your tree; --target torch: test_migrate_target_torch.py",
    "fsdp-bridge migrate verify src/ --target torch -- train.py": "src/ and train.py are yours; "
    "verify --target torch: test_migrate_target_torch.py runs a fixture before and after",
    "OMP_NUM_THREADS=1 python benchmarks/compile.py --fresh-cache": "a benchmark (a minute or more: a cold "
    "inductor compile); compile's losses: test_compile.py (slow tier)",
    "python benchmarks/compile.py --device cuda": "needs a CUDA GPU (exits 2 without one)",
    "OMP_NUM_THREADS=1 python benchmarks/async_save.py --docs docs/performance.md": "a benchmark (minutes) that "
    "rewrites docs/performance.md; async saves in both modes: test_checkpoint_async.py",
    "OMP_NUM_THREADS=1 python benchmarks/pretrained_memory.py --world-size 2 --hidden 768 --layers 6": "a benchmark (minutes); load_pretrained itself: test_checkpoint.py",
    "python benchmarks/convert_memory.py --hidden 768 --layers 6": "a benchmark (a minute); streamed convert itself: test_checkpoint_formats.py",
    "OMP_NUM_THREADS=1 python benchmarks/sharded_load.py --world-size 2 --hidden 768 --layers 6": "a benchmark (minutes); sharded loads themselves: test_checkpoint.py",
    "fsdp-bridge inspect ckpt/step_100": "ckpt/step_100 is your checkpoint; inspect: test_checkpoint_formats.py",
    "fsdp-bridge inspect ckpt/step_100 --json": "ckpt/step_100 is your checkpoint; inspect: test_checkpoint_formats.py",
    "fsdp-bridge convert ckpt/step_100 export --to hf": "your checkpoint; convert: test_checkpoint_formats.py",
    "fsdp-bridge convert export ckpt/resharded --to sharded": "your checkpoint; convert: test_checkpoint_formats.py",
    "fsdp-bridge convert ckpt/step_100 model.pt --to torch": "your checkpoint; convert: test_checkpoint_formats.py",
    "fsdp-bridge convert fsdp1_dcp_dir export --to hf --hf-config path/to/config.json": "placeholders (an FSDP1 DCP directory); test_checkpoint_formats.py::test_plain_fsdp1_checkpoints_load_and_convert",
    "fsdp-bridge compare examples/compare/tiny_llama.yaml --steps 5 --strategies all --nproc-per-node 4 --reference "
    "--out docs/compare-example": "regenerates docs/compare-example (minutes); the engine: test_compare.py",
    "fsdp-bridge compare examples/compare/tiny_llama.yaml --strategies full_shard --steps 3 --override fsdp2.lr=2e-3 "
    "--out /tmp/planted": "exits 1 by design (a planted difference); test_compare.py checks the verdict",
    "echo $?": "prints the previous command's exit code",
    "pytest examples/test_user_parity.py": "the user test example (both backends, about a minute); "
    "test_testing_plugin.py runs it",
    "pytest examples/test_user_parity.py --fsdp-backends fsdp2": "as above, one backend",
    "HYPOTHESIS_PROFILE=thorough python -m pytest tests/test_config_properties.py "
    "tests/test_checkpoint_description_fuzz.py": "the thorough property runs (minutes)",
}

# Commands whose documented exit code is not 0: `migrate code` reports with 1 while TODOs remain.
EXIT_1_ALLOWED = re.compile(r"^fsdp-bridge migrate code \S+( --diff)?$")


def _commands(path: Path) -> list[str]:
    """Shell commands of a document's bash/sh/console blocks, continuation lines joined, comments cut."""
    out: list[str] = []
    block: str | None = None
    pending = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        fence = re.match(r"^```(\w*)", line)
        if fence:
            block = None if block is not None else fence.group(1)
            continue
        if block not in ("bash", "sh", "shell", "console"):
            continue
        if pending:
            text = line.strip()
        elif block == "console":
            if not line.startswith("$ "):
                continue  # output
            text = line[2:].strip()
        else:
            text = line.strip()
            if not text or text.startswith("#"):
                continue
        text = re.sub(r"\s+#\s.*$", "", text)
        if text.endswith("\\"):
            pending += text[:-1].strip() + " "
            continue
        out.append(" ".join((pending + text).split()))
        pending = ""
    return out


def _all_commands() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), c) for p in DOCS for c in _commands(p)]


def test_every_not_run_entry_is_still_in_the_docs() -> None:
    documented = {c for _, c in _all_commands()}
    stale = sorted(set(NOT_RUN) - documented)
    assert not stale, f"NOT_RUN lists commands the docs no longer give: {stale}"


@pytest.mark.parametrize("doc", [str(p.relative_to(ROOT)) for p in DOCS if any(c not in NOT_RUN for c in _commands(p))])
def test_documented_commands_run_as_written(doc: str, tmp_path: Path) -> None:
    for name in ("examples", "tests/fixtures", "benchmarks"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}
    for command in _commands(ROOT / doc):
        if command in NOT_RUN:
            continue
        result = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        allowed = {0, 1} if EXIT_1_ALLOWED.match(command) else {0}
        assert result.returncode in allowed, (
            f"{doc}: `{command}` exited {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        )
        assert "Traceback" not in result.stderr, f"{doc}: `{command}`\n{result.stderr[-2000:]}"
