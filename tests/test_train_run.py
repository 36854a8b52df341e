"""`fsdp-bridge train` end to end: the built-in job through the real CLI, exact resume, fine-tuning."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fsdp_bridge.testing import run_distributed

# A small model and short sequences: each train() call below takes a few seconds.
TINY = [
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.num_hidden_layers=2",
    "model.tokenizer_vocab_size=400",
    "data.seq_len=32",
    "data.eval_sequences=8",
    "micro_batch_size=2",
    "eval_interval=2",
    "checkpoint.keep_last=null",
]


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_default_job_runs_end_to_end_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsdp_bridge",
            "train",
            f"output_dir={out}",
            "max_steps=12",
            "eval_interval=6",
            "checkpoint.interval=6",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(1, 13))
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 1.0, losses  # from ~6.9 (uniform over 1024 tokens) clearly down
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0], evals
    for key in ("lr", "tokens_per_s", "step_time_s", "memory_mb", "grad_norm"):
        assert all(r[key] is not None and r[key] > 0 for r in records), key
    # Rank 0 alone speaks: the header is printed once; the summary names the checkpoint.
    assert proc.stderr.count("fsdp-bridge train: LlamaForCausalLM") == 1, proc.stderr
    assert "done: 12 steps, 24,576 tokens" in proc.stdout and "step_00000012" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["best_eval_loss"] == min(evals)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000006", "step_00000012"]
    # The config actually used is written, and reloads to the same config.
    from fsdp_bridge.train import TrainConfig, load_train_config

    used = load_train_config(out / "train_config.yaml")
    assert used == load_train_config(
        None, [f"output_dir={out}", "max_steps=12", "eval_interval=6", "checkpoint.interval=6"]
    )
    assert isinstance(used, TrainConfig)
    # The output directory is a Hugging Face model directory with the trained weights.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("Once there was a baker called Anna", return_tensors="pt")["input_ids"]
    assert float(model(input_ids=ids, labels=ids).loss.detach()) < 6.0


def _tiny_config(out: Path, *extra: str) -> Any:
    from fsdp_bridge.train import load_train_config

    return load_train_config(None, [*TINY, f"output_dir={out}", *extra])


def _resume_and_finetune(root: str) -> dict[str, Any]:
    """On every rank: uninterrupted vs interrupted+resumed runs (both backends), then a GPT-2 fine-tune."""
    import torch.distributed as dist

    from fsdp_bridge.train import train

    base = Path(root)
    results: dict[str, Any] = {}
    # The FSDP2 run's split is cut after step 5; its last checkpoint (step 4) was an interval save
    # written in the background by torch's checkpoint process (checkpoint.async: process).
    background = ["max_steps=5", "checkpoint.interval=4", "checkpoint.at_end=false", "checkpoint.async=process"]
    for backend, kind, accum, split in (("fsdp2", "sharded", 2, background), ("fsdp1", "full", 1, ["max_steps=4"])):
        common = [
            f"bridge.backend={backend}",
            f"checkpoint.kind={kind}",
            f"grad_accum={accum}",
            "schedule.warmup_steps=2",
            "schedule.decay_steps=8",
        ]
        whole = train(_tiny_config(base / f"{backend}-whole", *common, "max_steps=8"), verbosity="quiet")
        # Interrupted after step 4 (its last checkpoint) or 5, then resumed to step 8.
        first = train(_tiny_config(base / f"{backend}-split", *common, *split), verbosity="quiet")
        from fsdp_bridge.checkpoint import _process

        ended = _process.checkpoint_process() is None  # the run ended its checkpoint process
        resumed = train(
            _tiny_config(base / f"{backend}-split", *common, "max_steps=8", "resume=auto"), verbosity="quiet"
        )
        results[backend] = {
            "whole": whole.final_loss,
            "resumed": resumed.final_loss,
            "resumed_from": resumed.resumed_from,
            "first_checkpoint": first.checkpoint,
            "process_ended": ended,
        }
    # Fine-tune a GPT-2 style directory with tied embeddings.
    ckpt_dir = base / "gpt2-dir"
    if dist.get_rank() == 0:
        from fsdp_bridge.testing.models import build_tiny
        from fsdp_bridge.train._tokenizer import _train_builtin

        tokenizer = _train_builtin(["Once there was a miller called David who lived near the library."] * 50, 300)
        model = build_tiny("gpt2", n_positions=64, vocab_size=len(tokenizer), tie_word_embeddings=True)
        model.save_pretrained(ckpt_dir)
        tokenizer.save_pretrained(ckpt_dir)
    dist.barrier()
    from fsdp_bridge.train import load_train_config

    example = Path(__file__).resolve().parents[1] / "examples" / "finetune_gpt2.yaml"
    overrides = [
        f"model.path={ckpt_dir}",
        "model.attn_implementation=eager",
        "data.seq_len=32",
        "max_steps=3",
        "eval_interval=3",
        "micro_batch_size=2",
        "grad_accum=1",
        "schedule.warmup_steps=0",
        "bridge.device=cpu",
    ]
    config = load_train_config(example, [*overrides, f"output_dir={base / 'gpt2-run'}"])
    # The model is built on the meta device and each rank reads its slices of the weights; the
    # same run with the whole model from from_pretrained on every rank is identical.
    from fsdp_bridge import checkpoint

    sliced: list[bool] = []
    load_pretrained = checkpoint.load_pretrained
    checkpoint.load_pretrained = lambda *args, **kwargs: sliced.append(True) or load_pretrained(*args, **kwargs)
    try:
        ft = train(config, verbosity="quiet")
    finally:
        checkpoint.load_pretrained = load_pretrained
    results["gpt2"] = {"steps": ft.steps, "eval_loss": ft.eval_loss, "sliced": sliced == [True]}
    fits, checkpoint.pretrained_fits = checkpoint.pretrained_fits, lambda *args: False
    try:
        import dataclasses

        whole = train(dataclasses.replace(config, output_dir=str(base / "gpt2-run-whole")), verbosity="quiet")
    finally:
        checkpoint.pretrained_fits = fits
    results["gpt2"]["same_as_from_pretrained"] = (whole.final_loss, whole.eval_loss) == (ft.final_loss, ft.eval_loss)
    # LoRA over the same directory: the base is read in slices too (the adapters are not in its
    # files), and the run is the one that reads the whole base first, bit for bit.
    lora = load_train_config(
        example, [*overrides, f"output_dir={base / 'gpt2-lora'}", "peft.r=4", "peft.target_modules=[c_attn]"]
    )
    sliced.clear()
    checkpoint.load_pretrained = lambda *args, **kwargs: sliced.append(True) or load_pretrained(*args, **kwargs)
    try:
        lora_run = train(lora, verbosity="quiet")
    finally:
        checkpoint.load_pretrained = load_pretrained
    fits, checkpoint.pretrained_fits = checkpoint.pretrained_fits, lambda *args: False
    try:
        lora_whole = train(dataclasses.replace(lora, output_dir=str(base / "gpt2-lora-whole")), verbosity="quiet")
    finally:
        checkpoint.pretrained_fits = fits
    results["gpt2_lora"] = {
        "sliced": sliced == [True],
        "same_as_from_pretrained": (lora_run.final_loss, lora_run.eval_loss)
        == (lora_whole.final_loss, lora_whole.eval_loss),
    }
    return results


def test_interrupted_and_resumed_matches_uninterrupted_step_for_step(tmp_path: Path) -> None:
    results = run_distributed(_resume_and_finetune, 2, args=(str(tmp_path),), timeout_s=400)
    for backend in ("fsdp2", "fsdp1"):
        whole = _metrics(tmp_path / f"{backend}-whole")
        split = _metrics(tmp_path / f"{backend}-split")
        assert [r["step"] for r in split] == list(range(1, 9))
        for a, b in zip(whole, split, strict=True):
            # Bit for bit in fp32 on gloo: same weights, optimizer state, data position and RNG.
            assert a["loss"] == b["loss"], (backend, a, b)
            assert a["grad_norm"] == b["grad_norm"] and a["lr"] == b["lr"] and a["tokens"] == b["tokens"]
            assert a.get("eval_loss") == b.get("eval_loss")
        assert results[0][backend]["resumed_from"].endswith("step_00000004")
        assert results[0][backend]["first_checkpoint"].endswith("step_00000004")
        assert results[0][backend]["process_ended"]
        assert results[0][backend]["whole"] == results[0][backend]["resumed"]
    assert results[0]["gpt2"]["steps"] == 3 and results[0]["gpt2"]["eval_loss"] is not None
    assert results[0]["gpt2"]["same_as_from_pretrained"] and results[0]["gpt2"]["sliced"]
    assert results[0]["gpt2_lora"] == {"sliced": True, "same_as_from_pretrained": True}, results[0]["gpt2_lora"]
    losses = [[r["loss"] for r in _metrics(tmp_path / name)] for name in ("gpt2-run", "gpt2-run-whole")]
    assert losses[0] == losses[1] and len(losses[0]) == 3
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2-run")
    assert exported.lm_head.weight.data_ptr() == exported.transformer.wte.weight.data_ptr()  # still tied


def _plain_loop(path: str) -> list[list[float]]:
    spec = importlib.util.spec_from_file_location("plain_loop", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [module.main(backend=b, steps=6, accum=2) for b in ("fsdp1", "fsdp2")]


@pytest.mark.timeout(300)
def test_plain_python_loop_example_trains_identically_on_both_backends() -> None:
    path = Path(__file__).resolve().parents[1] / "examples" / "plain_loop.py"
    fsdp1, fsdp2 = run_distributed(_plain_loop, 2, args=(str(path),), timeout_s=240)[0]
    assert fsdp1 == pytest.approx(fsdp2, rel=1e-5, abs=1e-6)
    assert fsdp1[-1] < fsdp1[0] - 0.5


def _cli_as_a_rank(argv: list[str]) -> int:
    """``fsdp-bridge ARGV`` in a rank of a launch (RANK and WORLD_SIZE set): it trains in place."""
    from fsdp_bridge.cli import main

    return main(argv)


def test_sigterm_saves_at_the_next_step_and_names_the_resume_command(tmp_path: Path, monkeypatch, capsys) -> None:
    import signal
    import time

    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "fsdp_bridge", "train", f"output_dir={out}", "max_steps=500", "-q", *TINY]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and len(_metrics(out)) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # what a scheduler sends to preempt a job
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr[-3000:]
    stopped = json.loads((out / "stopped.json").read_text())
    step = stopped["step"]
    line = next(x for x in stderr.splitlines() if x.startswith("fsdp-bridge train: stopped by SIGTERM"))
    assert f"at step {step} of 500" in line and f"step_{step:08d}" in line and line.endswith("--resume")
    assert (out / "checkpoints" / f"step_{step:08d}" / "fsdp_bridge.json").is_file()
    assert not (out / "summary.json").exists()
    # The command it names resumes from that step (here to two more steps): run as each of 2 ranks runs
    # it under torchrun (the launcher itself was exercised above).
    codes = run_distributed(_cli_as_a_rank, 2, args=([*cmd[3:], "--resume", f"max_steps={step + 2}"],), timeout_s=300)
    assert codes == [0, 0], codes
    assert [r["step"] for r in _metrics(out)] == list(range(1, step + 3))
    assert json.loads((out / "summary.json").read_text())["steps"] == step + 2
    assert not (out / "stopped.json").exists()
    # --resume on the finished run: said so, nothing launched, nothing rewritten (the same command,
    # in this process: it must return before launching anything).
    import fsdp_bridge.train._launch as launch_mod
    from fsdp_bridge.cli import main

    def refuse(*args: object, **kwargs: object) -> int:
        raise AssertionError("a process was launched")

    monkeypatch.setattr(launch_mod, "launch", refuse)
    monkeypatch.setattr(launch_mod, "run_rank", refuse)
    summary, metrics = (out / "summary.json").read_bytes(), (out / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main([*cmd[3:], "--resume", f"max_steps={step + 2}"]) == 0
    assert f"is complete: its latest checkpoint is at step {step + 2}" in capsys.readouterr().out
    assert (out / "summary.json").read_bytes() == summary and (out / "metrics.jsonl").read_bytes() == metrics


def test_stop_requests_become_one_agreed_signal() -> None:
    import signal

    import torch

    from fsdp_bridge.train._loop import _mean_and_stop, _StopRequests

    # Python's own Ctrl-C handler before, whatever this process inherited (a shell starts a background job with
    # SIGINT ignored): the check below is that the handler in place before is the one put back.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with _StopRequests() as stops:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: recorded, no KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)
            assert stops.received == signal.SIGINT
        assert _mean_and_stop(torch.tensor(2.0), stops.received, 1) == (2.0, int(signal.SIGINT))
        assert _mean_and_stop(torch.tensor(2.0), 0, 1) == (2.0, 0)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_a_failing_run_gives_its_background_save_time_and_raises_its_own_error(monkeypatch, caplog) -> None:
    import torch

    from fsdp_bridge import checkpoint
    from fsdp_bridge.train import _loop

    calls: list[object] = []

    class Pending:
        def wait(self, timeout: float | None = None) -> None:
            calls.append(("wait", timeout))

    class Checkpointer:
        pending = Pending()

        def close(self) -> None:
            calls.append("close")
            raise checkpoint.CheckpointError(Path("ckpt/step_00000002"), "the background save failed: rank 1: boom")

    monkeypatch.setattr(checkpoint, "checkpointer_of", lambda model: Checkpointer())
    _loop._settle_background_save(torch.nn.Linear(2, 2), 12.5)  # never raises: the run's own error follows
    assert calls == [("wait", 12.5), "close"]
    assert "did not complete: checkpoint ckpt/step_00000002: the background save failed: rank 1: boom" in caplog.text
