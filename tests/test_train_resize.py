"""Resuming at another world size: the same training sequences in the same order, the same global
data position, a note of what cannot be kept (the ranks' RNG streams)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fsdp_bridge.testing import run_distributed
from fsdp_bridge.train import DataConfig
from fsdp_bridge.train._data import PackedData
from fsdp_bridge.train._loop import _resize_note, rank_seed


class _Tok:
    eos_token_id = 0

    def __call__(self, docs: list[str], **_: object) -> dict[str, list[list[int]]]:
        return {"input_ids": [[ord(c) for c in d] for d in docs]}


DOCS = ["".join(chr(200 + i) for i in range(150)), "".join(chr(400 + i) for i in range(150))]


def test_the_training_stream_does_not_depend_on_the_world_size() -> None:
    # 302 tokens -> 30 sequences of 10; 5 held out (not a multiple of 2 or 4: before, 4 were held
    # out at 2 and 4 ranks and 5 at 1, so the training set and its order changed with the world size).
    cfg = DataConfig(seq_len=10, eval_sequences=5)
    by_world = {
        w: [PackedData.build(DOCS, _Tok(), cfg, seed=7, rank=r, world_size=w) for r in range(w)] for w in (1, 2, 4)
    }
    for w, ranks in by_world.items():
        assert ranks[0].train.shape == (25, 10) and ranks[0].held_out.shape == (5, 10), w
        assert bool((ranks[0].train == by_world[1][0].train).all())

    # A global batch of 8 sequences: 1 rank x 4 x accum 2 = 2 ranks x 4 x 1 = 4 ranks x 2 x 1.
    # The loop's arithmetic: micro-batch k of a step starts at position + k * world * mbs.
    def step_rows(ranks: list[PackedData], position: int, mbs: int, accum: int) -> list[int]:
        world, rows = len(ranks), []
        for micro in range(accum):
            start = position + micro * world * mbs
            for rank in ranks:
                rows += [int(row[0]) for row in rank.micro_batch(start, mbs)]
        return rows

    for position in (0, 8, 24):  # 24: across the epoch boundary (25 sequences)
        one = step_rows(by_world[1], position, 4, 2)
        assert step_rows(by_world[2], position, 4, 1) == one
        assert step_rows(by_world[4], position, 2, 1) == one
    # Every held-out row is evaluated once at any world size; ranks run as many forwards.
    for w, ranks in by_world.items():
        shares = [rank.eval_batches(2) for rank in ranks]
        assert len({len(share) for share in shares}) == 1, w
        counted = sorted(int(b[i, 0]) for share in shares for b, n in share for i in range(n))
        assert counted == sorted(int(row[0]) for row in by_world[1][0].held_out), w


def test_a_resume_at_another_world_size_says_what_it_keeps() -> None:
    state: dict[str, Any] = {"data_position": 64, "world_size": 2, "samples_per_step": 16}
    assert _resize_note(state, 2, 16) is None
    assert _resize_note({"data_position": 64}, 4, 16) is None  # saved before world_size was recorded
    same = _resize_note(state, 1, 16)
    assert same is not None and "continues at global sample 64 (none repeated or skipped)" in same
    assert "global batch" not in same and "RNG streams (dropout) are new ones" in same
    changed = _resize_note(state, 4, 32)
    assert changed is not None and "the global batch is 32 sequences per step (was 16)" in changed
    assert rank_seed(0, 1, 0) == 2  # a fresh run's streams are unchanged
    seeds = {rank_seed(0, r, s) for r in range(4) for s in range(1, 50)}
    assert len(seeds) == 4 * 49 and all(0 <= x < 2**63 for x in seeds)


TINY = [
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.num_hidden_layers=2",
    "model.tokenizer_vocab_size=400",
    "data.seq_len=32",
    "data.eval_sequences=5",  # a multiple of neither 2 nor 4
    "eval_interval=2",
    "checkpoint.interval=2",
    "checkpoint.keep_last=null",
    "checkpoint.export_hf=false",
    "schedule.warmup_steps=1",
    "bridge.device=cpu",
]


def _train_recording(jobs: list[tuple[str, list[str], str]]) -> list[float | None]:
    """train() on this rank for each (output_dir, overrides, record) job, writing the training
    sequences each micro-batch reads to ``record``; the eval losses."""
    from fsdp_bridge.train import load_train_config, train

    original = PackedData.micro_batch
    losses = []
    for out, overrides, record in jobs:

        def micro_batch(self: PackedData, position: int, mbs: int, record: str = record) -> Any:
            ids = self.sample_ids(position + self.rank * mbs, mbs)
            with open(f"{record}.rank{self.rank}", "a") as fh:
                fh.write(json.dumps({"position": position, "first": position + self.rank * mbs, "ids": ids}) + "\n")
            return original(self, position, mbs)

        PackedData.micro_batch = micro_batch  # type: ignore[method-assign]
        try:
            config = load_train_config(None, [*TINY, f"output_dir={out}", *overrides])
            losses.append(train(config, verbosity="quiet").eval_loss)
        finally:
            PackedData.micro_batch = original  # type: ignore[method-assign]
    return losses


def _sequences_by_step(record: Path, samples_per_step: int) -> dict[int, list[int]]:
    """Step -> the sorted training sequences the ranks read in it, from every rank's record."""
    steps: dict[int, list[int]] = {}
    for path in record.parent.glob(record.name + ".rank*"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            steps.setdefault(entry["position"] // samples_per_step + 1, []).extend(entry["ids"])
    return {step: sorted(ids) for step, ids in sorted(steps.items())}


def _by_sample(record: Path) -> dict[int, int]:
    """Global sample index -> the training sequence read there, from every rank's record."""
    out: dict[int, int] = {}
    for path in record.parent.glob(record.name + ".rank*"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            out.update({entry["first"] + i: seq for i, seq in enumerate(entry["ids"])})
    return out


def _losses(run: Path) -> dict[int, dict[str, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {int(r["step"]): r for r in records}


def test_saved_at_2_ranks_resumed_at_1_reads_what_an_uninterrupted_run_reads(tmp_path: Path) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    # 2 ranks x micro-batch 2: 4 sequences a step, 6 steps uninterrupted; the same job stopped at step 2.
    jobs = [
        (str(whole), ["micro_batch_size=2", "max_steps=6"], str(tmp_path / "w")),
        (str(split), ["micro_batch_size=2", "max_steps=2"], str(tmp_path / "a")),
    ]
    run_distributed(_train_recording, 2, args=(jobs,), timeout_s=300)
    # Resumed at 1 rank with the same global batch: micro-batch 2, grad_accum 2.
    resume = ["micro_batch_size=2", "grad_accum=2", "max_steps=6", "resume=auto"]
    # And from the same checkpoint with half the global batch (2 sequences a step), into another directory.
    halved = ["micro_batch_size=2", "max_steps=6", f"resume={split / 'checkpoints' / 'step_00000002'}"]
    halved += ["checkpoint.interval=null", "checkpoint.at_end=false", "eval_interval=null"]  # only the reads matter
    jobs = [(str(split), resume, str(tmp_path / "b")), (str(tmp_path / "halved"), halved, str(tmp_path / "h"))]
    ((resumed_eval, _),) = run_distributed(_train_recording, 1, args=(jobs,), timeout_s=300)
    expected = _sequences_by_step(tmp_path / "w", 4)
    got = {**_sequences_by_step(tmp_path / "a", 4), **_sequences_by_step(tmp_path / "b", 4)}
    assert list(expected) == list(range(1, 7))
    assert got == expected
    # fp32, no dropout in the tiny Llama: the same math in another order of additions (one rank
    # accumulating two micro-batches instead of two ranks averaging), so close, not bit-equal.
    a, b = _losses(whole), _losses(split)
    assert sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-4), step
        assert b[step]["tokens"] == a[step]["tokens"]
    # Every held-out sequence is evaluated at either world size: the same eval loss.
    assert b[6]["eval_loss"] == pytest.approx(a[6]["eval_loss"], rel=1e-4)
    assert resumed_eval == pytest.approx(a[6]["eval_loss"], rel=1e-4)
    # Half the global batch: the 4 remaining steps read global samples 8 .. 15, the ones the
    # uninterrupted run read next (in steps 3 and 4): none repeated, none skipped.
    halved_samples, whole_samples = _by_sample(tmp_path / "h"), _by_sample(tmp_path / "w")
    assert sorted(halved_samples) == list(range(8, 16))
    assert halved_samples == {i: whole_samples[i] for i in range(8, 16)}
