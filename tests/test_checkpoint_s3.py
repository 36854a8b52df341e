"""Checkpoints on a real S3 endpoint: moto's server on 127.0.0.1 (a free port), reached through
s3fs as any S3 service is; two gloo ranks save, rotate and resume, and a damaged object is refused
naming it. One server for the module, stopped at the end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import s3fs
import torch
import torch.distributed as dist

import fsdp_bridge
from fsdp_bridge.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints
from fsdp_bridge.testing import run_distributed
from fsdp_bridge.testing.models import build_tiny, sample_batch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

_BUCKET = "fsdp-bridge-test"  # made by the s3_env fixture (conftest.py)


def _ranks_save_rotate_resume(root: str) -> bool:
    config = fsdp_bridge.BridgeConfig(backend="fsdp2", wrap="auto", device="cpu")
    model = fsdp_bridge.shard(build_tiny("llama", seed=0), config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in (1, 2):
        model(**sample_batch("llama", seed=10 * step + dist.get_rank())).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        fsdp_bridge.save_checkpoint(f"{root}/step_{step:08d}", model, optimizer, state={"step": step}, keep_last=1)
    latest = latest_checkpoint(root)
    assert latest == f"{root}/step_00000002", latest
    other = fsdp_bridge.shard(build_tiny("llama", seed=4), config)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    assert fsdp_bridge.load_checkpoint(latest, other, other_opt) == {"step": 2}
    same = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(model.parameters(), other.parameters(), strict=True)
    )
    # Training goes on identically from the resumed state.
    batch = sample_batch("llama", seed=99 + dist.get_rank())
    losses = []
    for m, opt in ((model, optimizer), (other, other_opt)):
        m(**batch).loss.backward()
        opt.step()
        losses.append(m(**batch).loss.item())
    return same and losses[0] == losses[1]


def _on_each_rank(root: str, url: str, tmp: str) -> tuple[bool, str | None]:
    """Both scenarios in one spawn of two ranks (the ranks' start-up is most of the cost)."""
    return _ranks_save_rotate_resume(root), _train_to_s3_and_resume(url, tmp)


def test_checkpoints_and_a_train_run_on_s3(s3_env: dict[str, str], tmp_path: Path) -> None:
    base = f"{_BUCKET}/{tmp_path.name}"  # a prefix of this run's own: a rerun starts from an empty one
    root = f"s3://{base}/run/checkpoints"
    url = f"s3://{base}/train-run"
    results = run_distributed(_on_each_rank, 2, args=(root, url, str(tmp_path)), env=s3_env, timeout_s=300)
    assert [same for same, _ in results] == [True, True]
    _check_checkpoints(base, root)
    _check_train_run(base, url, results[0][1])
    assert [p.name for p in (tmp_path / "fsdp_bridge-runs").iterdir()] != []  # the local copy was there


def _check_checkpoints(base: str, root: str) -> None:
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    # Rotation kept the newest; no staging prefix is left.
    assert [s for s, _ in list_checkpoints(root)] == [2]
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(f"{base}/run/checkpoints")] == ["step_00000002"]
    # Resume in one process from the two ranks' shards.
    model = build_tiny("llama", seed=6)
    assert fsdp_bridge.load_checkpoint(f"{root}/step_00000002", model) == {"step": 2}
    # One shard object changed on the store: the load names it, and the model is untouched.
    shard = f"{base}/run/checkpoints/step_00000002/dcp/__1_0.distcp"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(shard, bytes(data))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"dcp/__1_0\.distcp: content (is damaged|differs)"):
        fsdp_bridge.load_checkpoint(f"{root}/step_00000002", build_tiny("llama", seed=6))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # A user's objects at the destination are refused, never replaced.
    fs.pipe_file(f"{base}/run/notes/readme.txt", b"mine")
    with pytest.raises(CheckpointError, match="may be your objects"):
        fsdp_bridge.save_checkpoint(f"s3://{base}/run/notes", model)
    assert fs.cat_file(f"{base}/run/notes/readme.txt") == b"mine"


_TINY_RUN = [
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.num_hidden_layers=2",
    "model.tokenizer_vocab_size=400",
    "data.seq_len=32",
    "data.eval_sequences=8",
    "micro_batch_size=2",
    "eval_interval=2",
    "checkpoint.interval=2",
    "checkpoint.kind=full",  # two ranks assemble it locally, rank 0 publishes it; sharded runs above
]


def _train_to_s3_and_resume(url: str, tmp: str) -> str | None:
    import tempfile

    from fsdp_bridge.train import load_train_config, train

    tempfile.tempdir = tmp  # the run's local copy goes under the test's directory

    first = train(load_train_config(None, [*_TINY_RUN, f"output_dir={url}", "max_steps=4"]), verbosity="quiet")
    resumed = train(
        load_train_config(None, [*_TINY_RUN, f"output_dir={url}", "max_steps=6", "resume=auto"]), verbosity="quiet"
    )
    assert first.checkpoint == f"{url}/checkpoints/step_00000004", first.checkpoint
    return resumed.resumed_from


def _check_train_run(base: str, url: str, resumed_from: str | None) -> None:
    """The run's files are in the bucket, and the second run resumed from the first's checkpoint there."""
    assert resumed_from == f"{url}/checkpoints/step_00000004", resumed_from
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    names = {p[len(f"{base}/train-run/") :] for p in fs.find(f"{base}/train-run")}
    for expected in (
        "train_config.yaml",
        "metrics.jsonl",
        "summary.json",
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "checkpoints/step_00000006/fsdp_bridge.json",
        "checkpoints/step_00000006/model.safetensors",
    ):
        assert expected in names, (expected, sorted(names))
    assert not any(n.startswith("checkpoints/.") for n in names), sorted(names)  # no staging left
    steps = [json.loads(line)["step"] for line in fs.cat_file(f"{base}/train-run/metrics.jsonl").splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6], steps
    assert json.loads(fs.cat_file(f"{base}/train-run/summary.json"))["output_dir"] == url
