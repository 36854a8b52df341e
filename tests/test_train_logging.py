"""The ``logging:`` sinks of ``fsdp-bridge train``: TensorBoard read back, MLflow and W&B against fake modules,
a missing package refused before the run starts, and ``train(config, on_metrics=...)``."""

from __future__ import annotations

import json
import struct
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from fsdp_bridge.errors import ConfigError
from fsdp_bridge.testing import run_distributed

TINY = [
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.num_hidden_layers=2",
    "model.tokenizer_vocab_size=400",
    "data.seq_len=32",
    "data.eval_sequences=8",
    "micro_batch_size=2",
    "eval_interval=2",
    "checkpoint.export_hf=false",
]


def _config(out: Path, *extra: str) -> Any:
    from fsdp_bridge.train import load_train_config

    return load_train_config(None, [*TINY, f"output_dir={out}", *extra])


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _f32(value: float) -> float:
    """``value`` as TensorBoard stores a scalar (float32)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def _interrupted_then_resumed(root: str) -> tuple[list[tuple[int, dict[str, float]]], list[Any]]:
    """One rank: 3 steps (last checkpoint at step 2), then resumed from step 2 to step 5, TensorBoard on; then a
    run that fails at its first step, MLflow (a fake module) on."""
    from fsdp_bridge.train import train

    out = Path(root) / "run"
    common = ["logging.tensorboard=true", "checkpoint.interval=2", "checkpoint.at_end=false"]
    train(_config(out, *common, "max_steps=3"), verbosity="quiet")
    seen: list[tuple[int, dict[str, float]]] = []
    train(
        _config(out, *common, "max_steps=5", "resume=auto"),
        verbosity="quiet",
        on_metrics=lambda step, metrics: seen.append((step, metrics)),
    )
    fake = _Recorder("mlflow")
    sys.modules["mlflow"] = fake.module

    def fail(step: int, metrics: dict[str, float]) -> None:
        raise ValueError(f"failed at step {step}")

    failed = _config(Path(root) / "failed", "logging.mlflow=true", "max_steps=2", "checkpoint.at_end=false")
    try:
        train(failed, verbosity="quiet", on_metrics=fail)
    except ValueError as err:
        fake.calls.append(("raised", (str(err),), {}))
    return seen, [(name, args, kwargs) for name, args, kwargs in fake.calls if name != "log_params"]


def test_tensorboard_shows_one_point_per_step_equal_to_metrics_jsonl_across_a_resume(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seen, mlflow_calls = run_distributed(_interrupted_then_resumed, 1, args=(str(tmp_path),), timeout_s=300)[0]
    out = tmp_path / "run"
    records = _metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}
    assert set(scalars) == {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens",
        "train/tokens_per_s",
        "train/step_time_s",
        "train/memory_mb",
        "eval/loss",
    }
    # The first run's step 3 was run again after the resume: TensorBoard keeps only the second one.
    loss = scalars["train/loss"]
    assert [e.step for e in loss] == [1, 2, 3, 4, 5]
    assert [e.value for e in loss] == [_f32(r["loss"]) for r in records]
    for key, tag in (("lr", "train/lr"), ("grad_norm", "train/grad_norm"), ("memory_mb", "train/memory_mb")):
        assert [e.value for e in scalars[tag]] == [_f32(r[key]) for r in records], tag
    # Evaluations at steps 2 and 4 and at the last step; the first run's evaluation at its last step (3) is gone.
    assert [(e.step, e.value) for e in scalars["eval/loss"]] == [
        (r["step"], _f32(r["eval_loss"])) for r in records if "eval_loss" in r
    ]
    assert [e.step for e in scalars["eval/loss"]] == [2, 4, 5]
    # on_metrics saw the resumed run's steps with the same tags, at full precision.
    assert [step for step, _ in seen] == [3, 4, 5]
    for (step, metrics), record in zip(seen, records[2:], strict=True):
        assert step == record["step"]
        assert metrics["train/loss"] == record["loss"] and metrics["train/lr"] == record["lr"]
        assert ("eval/loss" in metrics) == ("eval_loss" in record)
    # A run that fails ends its MLflow run as failed, after logging the step it reached.
    assert [name for name, _, _ in mlflow_calls] == ["start_run", "log_metrics", "end_run", "raised"]
    assert mlflow_calls[1][2] == {"step": 1} and mlflow_calls[2][2] == {"status": "FAILED"}
    assert mlflow_calls[3][1] == ("failed at step 1",)


# ----------------------------------------------------------------------------------------------------------
# One process, no training: the sinks against fake service modules
# ----------------------------------------------------------------------------------------------------------


class _Recorder:
    """A fake module: every attribute is a function that records its call."""

    def __init__(self, name: str, returns: dict[str, Any] | None = None) -> None:
        self.module = types.ModuleType(name)
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        for attr in ("set_tracking_uri", "set_experiment", "start_run", "log_params", "log_metrics", "end_run", "init"):
            setattr(self.module, attr, self._recording(attr, (returns or {}).get(attr)))

    def _recording(self, attr: str, result: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((attr, args, kwargs))
            return result

        return call


def test_mlflow_sink_starts_a_run_logs_each_step_and_ends_it(tmp_path: Path, monkeypatch) -> None:
    from fsdp_bridge.train._loggers import close_sinks, metric_tags, open_sinks

    fake = _Recorder("mlflow")
    monkeypatch.setitem(sys.modules, "mlflow", fake.module)
    config = _config(
        tmp_path / "run",
        "logging.mlflow=true",
        "logging.mlflow_tracking_uri=http://127.0.0.1:5000",
        "logging.mlflow_experiment=tiny",
    )
    assert open_sinks(config, tmp_path / "run", rank=1, resumed_step=None) == []  # rank 0 alone writes
    assert fake.calls == []
    sinks = open_sinks(config, tmp_path / "run", rank=0, resumed_step=None)
    record = {"step": 1, "loss": 6.5, "lr": 1e-4, "grad_norm": None, "tokens": 64, "eval_loss": 6.25}
    for sink in sinks:
        sink.log(1, metric_tags(record))
    close_sinks(sinks)
    names = [name for name, _, _ in fake.calls]
    assert names == ["set_tracking_uri", "set_experiment", "start_run", "log_params", "log_metrics", "end_run"]
    assert fake.calls[5][2] == {"status": "FINISHED"}
    assert fake.calls[0][1] == ("http://127.0.0.1:5000",) and fake.calls[1][1] == ("tiny",)
    assert fake.calls[2][2] == {"run_name": "run"}
    params = fake.calls[3][1][0]
    assert params["optim.lr"] == config.optim.lr and params["logging.mlflow"] is True
    # grad_norm is null without clipping: left out, not logged as a number.
    assert fake.calls[4][1:] == (
        ({"train/loss": 6.5, "train/lr": 1e-4, "train/tokens": 64.0, "eval/loss": 6.25},),
        {"step": 1},
    )


def test_wandb_sink_initialises_a_run_with_the_config_logs_each_step_and_finishes(tmp_path: Path, monkeypatch) -> None:
    from fsdp_bridge.train._loggers import close_sinks, open_sinks

    run = _Recorder("run")
    run.module.log = run._recording("log", None)  # type: ignore[attr-defined]
    run.module.finish = run._recording("finish", None)  # type: ignore[attr-defined]
    fake = _Recorder("wandb", returns={"init": run.module})
    monkeypatch.setitem(sys.modules, "wandb", fake.module)
    out = tmp_path / "run"
    config = _config(out, "logging.wandb=true", "logging.wandb_project=tiny", "logging.run_name=first")
    sinks = open_sinks(config, out, rank=0, resumed_step=None)
    sinks[0].log(3, {"train/loss": 5.0})
    close_sinks(sinks)
    assert [name for name, _, _ in fake.calls] == ["init"]
    assert fake.calls[0][2] == {
        "project": "tiny",
        "entity": None,
        "name": "first",
        "config": config.to_dict(),
        "dir": str(out),
    }
    assert run.calls == [("log", ({"train/loss": 5.0},), {"step": 3}), ("finish", (), {"exit_code": 0})]
    assert (out / "wandb").is_dir()


def test_a_missing_package_is_refused_before_the_run_starts_naming_the_extra(tmp_path: Path, monkeypatch) -> None:
    import fsdp_bridge.train._loop as loop
    from fsdp_bridge.train import preflight, train

    for name in ("mlflow", "wandb"):
        monkeypatch.setitem(sys.modules, name, None)  # not importable, whether installed here or not
    config = _config(tmp_path / "run", "logging.mlflow=true", "logging.wandb=true")

    def no_process_group(*args: object, **kwargs: object) -> None:
        raise AssertionError("the process group was started")

    monkeypatch.setattr(loop, "init_distributed", no_process_group)
    for check in (lambda: train(config), lambda: preflight(config)):
        with pytest.raises(ConfigError) as err:
            check()
        text = str(err.value)
        assert "logging.mlflow" in text and "pip install 'fsdp-bridge[mlflow]'" in text, text
        assert "logging.wandb" in text and "pip install 'fsdp-bridge[wandb]'" in text, text
    assert not (tmp_path / "run").exists()


def test_a_sink_that_fails_to_open_is_named_and_those_opened_before_it_are_closed(tmp_path: Path, monkeypatch) -> None:
    import fsdp_bridge.train._loggers as loggers

    closed: list[str] = []

    class FakeBoard:
        def __init__(self, log_dir: Path, *, resumed_step: int | None) -> None:
            pass

        def log(self, step: int, metrics: Any) -> None:
            pass

        def close(self, *, failed: bool = False) -> None:
            closed.append("tensorboard")

    def refuse(**kwargs: Any) -> None:
        raise ConnectionError("connection refused by 127.0.0.1:5000")

    fake = _Recorder("mlflow")
    fake.module.start_run = refuse  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mlflow", fake.module)
    monkeypatch.setattr(loggers, "TensorBoardSink", FakeBoard)
    config = _config(tmp_path / "run", "logging.tensorboard=true", "logging.mlflow=true")
    with pytest.raises(
        ConfigError, match=r"logging\.mlflow.*ConnectionError: connection refused.*logging\.mlflow=false"
    ):
        loggers.open_sinks(config, tmp_path / "run", rank=0, resumed_step=None)
    assert closed == ["tensorboard"]


def test_a_service_sink_failing_mid_run_is_dropped_but_an_on_metrics_error_propagates(caplog) -> None:
    from fsdp_bridge.train._loggers import CallbackSink, log_to_sinks

    seen: list[int] = []

    class Flaky:
        def log(self, step: int, metrics: Any) -> None:
            raise OSError("tracking server went away")

        def close(self, *, failed: bool = False) -> None:
            seen.append(-1)

    sinks: list[Any] = [Flaky(), CallbackSink(lambda step, metrics: seen.append(step))]
    log_to_sinks(sinks, 1, {"train/loss": 1.0})
    log_to_sinks(sinks, 2, {"train/loss": 1.0})
    assert seen == [-1, 1, 2] and len(sinks) == 1  # closed once, dropped; the callable still called
    assert "step 1: the Flaky metrics sink failed (OSError: tracking server went away)" in caplog.text

    def broken(step: int, metrics: Any) -> None:
        raise ValueError("user code")

    with pytest.raises(ValueError, match="user code"):
        log_to_sinks([CallbackSink(broken)], 3, {})


def test_a_sink_that_fails_to_close_does_not_stop_the_others(caplog) -> None:
    from fsdp_bridge.train._loggers import CallbackSink, close_sinks

    closed: list[str] = []

    class Broken:
        def log(self, step: int, metrics: Any) -> None:
            pass

        def close(self, *, failed: bool = False) -> None:
            raise OSError("server went away")

    class Good(CallbackSink):
        def close(self, *, failed: bool = False) -> None:
            closed.append("good")

    close_sinks([Broken(), Good(lambda step, metrics: None)])
    assert closed == ["good"] and "server went away" in caplog.text


def test_logging_section_parses_and_names_keys_written_elsewhere(tmp_path: Path) -> None:
    from fsdp_bridge.train import LoggingConfig, TrainConfig

    config = _config(tmp_path, "logging.tensorboard=true")
    assert config.logging == LoggingConfig(tensorboard=True)
    assert TrainConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match=r"tensorboard.*logging\.tensorboard"):
        _config(tmp_path, "tensorboard=true")
    with pytest.raises(ConfigError, match=r"logging\.tensorbord.*tensorboard"):
        _config(tmp_path, "logging.tensorbord=true")
    with pytest.raises(ConfigError, match=r"logging\.wandb"):
        _config(tmp_path, "logging.wandb=maybe")
