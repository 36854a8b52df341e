"""Metrics sinks: where each step's numbers go besides ``metrics.jsonl``.

One small protocol (:class:`MetricsSink`: ``log(step, metrics)`` then ``close(failed=...)``) with a sink per service,
chosen by the ``logging:`` section of the training config:

    logging: {tensorboard: true}          # event files under output_dir/tensorboard/
    logging: {mlflow: true, mlflow_experiment: tiny}
    logging: {wandb: true, wandb_project: tiny}

Each service's package is imported only when its sink is enabled; :func:`logging_problems` names a missing
one (and the extra to install) before the run starts.  Every sink gets the same tags (:func:`metric_tags`).
``train(config, on_metrics=fn)`` adds a :class:`CallbackSink` on every rank (Ray Train's ``report`` is called by
every worker); the services' sinks run on rank 0 only.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.train._config import LoggingConfig, TrainConfig

__all__ = [
    "TAGS",
    "TENSORBOARD_DIR",
    "CallbackSink",
    "MLflowSink",
    "MetricsSink",
    "TensorBoardSink",
    "WandbSink",
    "close_sinks",
    "log_to_sinks",
    "logging_problems",
    "metric_tags",
    "open_sinks",
]

logger = logging.getLogger("fsdp_bridge.train")

TENSORBOARD_DIR = "tensorboard"
"""The directory under ``output_dir`` that holds TensorBoard's event files."""

TAGS: dict[str, str] = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens": "train/tokens",
    "tokens_per_s": "train/tokens_per_s",
    "step_time_s": "train/step_time_s",
    "memory_mb": "train/memory_mb",
    "eval_loss": "eval/loss",
}
"""``metrics.jsonl`` key -> the tag every sink logs it under (docs/configuration.md lists them)."""

# (config field, importable module, pip extra) of each service whose package is optional.
_PACKAGES: tuple[tuple[str, str, str], ...] = (
    ("tensorboard", "tensorboard", "tensorboard"),
    ("mlflow", "mlflow", "mlflow"),
    ("wandb", "wandb", "wandb"),
)


class MetricsSink(Protocol):
    """Receives each optimizer step's metrics (tag -> value), then is closed once at the end of the run
    (``failed``: the run ended with an error; services that keep a run's status record it)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self, *, failed: bool = False) -> None: ...


def metric_tags(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a ``metrics.jsonl`` record under their tags (:data:`TAGS`); ``step`` and nulls left out.

    Args:
        record: one step's record (``loss``, ``lr``, ``grad_norm`` ... and ``eval_loss`` on evaluation steps).

    Returns:
        ``{"train/loss": ..., "train/lr": ..., "eval/loss": ...}`` as floats.
    """
    return {tag: float(record[key]) for key, tag in TAGS.items() if record.get(key) is not None}


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it."""
    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it are blocked
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def logging_problems(config: LoggingConfig) -> list[Problem]:
    """A problem for each enabled sink whose package is not installed (nothing is imported).

    Args:
        config: the ``logging:`` section.

    Returns:
        One problem per missing package, naming ``logging.KEY``, the package and the extra that installs it.
    """
    problems: list[Problem] = []
    for key, module, extra in _PACKAGES:
        if getattr(config, key) and not _installed(module):
            problems.append(
                Problem(
                    f"logging.{key}",
                    True,
                    f"false, or true with the {module!r} package installed",
                    f"pip install 'fsdp-bridge[{extra}]' (or set logging.{key}=false)",
                )
            )
    return problems


class TensorBoardSink:
    """Scalars in TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``).

    On a resume at step ``resumed_step`` the points logged after it by the interrupted run are purged
    (``purge_step``), so TensorBoard shows one point per step, as ``metrics.jsonl`` keeps one record per step.
    """

    def __init__(self, log_dir: Path, *, resumed_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resumed_step is None else resumed_step + 1
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for tag, value in metrics.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()  # a live TensorBoard shows every step as it ends

    def close(self, *, failed: bool = False) -> None:
        self._writer.close()


class MLflowSink:
    """Metrics of an MLflow run (``mlflow.start_run`` ... ``log_metrics`` ... ``end_run``)."""

    def __init__(self, config: LoggingConfig, *, run_name: str, params: Mapping[str, Any]) -> None:
        mlflow: Any = importlib.import_module("mlflow")
        self._mlflow = mlflow
        if config.mlflow_tracking_uri is not None:
            mlflow.set_tracking_uri(config.mlflow_tracking_uri)
        if config.mlflow_experiment is not None:
            mlflow.set_experiment(config.mlflow_experiment)
        mlflow.start_run(run_name=run_name)
        try:
            mlflow.log_params(dict(params))
        except BaseException:
            mlflow.end_run(status="FAILED")  # no run left active in this process
            raise

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._mlflow.log_metrics(dict(metrics), step=step)

    def close(self, *, failed: bool = False) -> None:
        self._mlflow.end_run(status="FAILED" if failed else "FINISHED")


class WandbSink:
    """Metrics of a Weights & Biases run (``wandb.init`` ... ``run.log`` ... ``run.finish``)."""

    def __init__(self, config: LoggingConfig, *, run_name: str, run_config: Mapping[str, Any], out: Path) -> None:
        wandb: Any = importlib.import_module("wandb")
        (out / "wandb").mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=config.wandb_project,
            entity=config.wandb_entity,
            name=run_name,
            config=dict(run_config),
            dir=str(out),
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self, *, failed: bool = False) -> None:
        self._run.finish(exit_code=1 if failed else 0)


class CallbackSink:
    """Calls ``fn(step, metrics)`` at each step (``train(config, on_metrics=fn)``); nothing to close."""

    def __init__(self, fn: Callable[[int, dict[str, float]], object]) -> None:
        self._fn = fn

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._fn(step, dict(metrics))

    def close(self, *, failed: bool = False) -> None:
        pass


_MAX_PARAM = 500


def _flat_params(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys -> plain values (MLflow params are flat strings)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.update(_flat_params(value, f"{prefix}{key}."))
        else:
            text = str(value)  # MLflow stores params as strings, refusing long ones (500 characters before 2.2)
            out[f"{prefix}{key}"] = value if len(text) <= _MAX_PARAM else text[: _MAX_PARAM - 3] + "..."
    return out


def open_sinks(config: TrainConfig, out: Path, *, rank: int, resumed_step: int | None) -> list[MetricsSink]:
    """The sinks the ``logging:`` section enables, opened on rank 0 (an empty list on the other ranks).

    Args:
        config: the training job (its ``logging:`` section; the whole config is the W&B run's config and the
            MLflow run's params).
        out: the run's ``output_dir``.
        rank: this process's rank.
        resumed_step: the step of the checkpoint this run resumed from; None for a fresh run.

    Returns:
        The open sinks; close them with :func:`close_sinks`.

    Raises:
        ConfigError: a sink failed to open (a tracking server that refuses the run, a directory that cannot be
            written), naming its ``logging.KEY`` and the service's error; the sinks opened before it are closed.
    """
    section = config.logging
    if rank != 0:
        return []
    run_name = section.run_name or out.resolve().name
    openers: list[tuple[str, str, Callable[[], MetricsSink]]] = []
    if section.tensorboard:
        log_dir = out / TENSORBOARD_DIR
        openers.append(
            ("tensorboard", f"event files in {log_dir}", lambda: TensorBoardSink(log_dir, resumed_step=resumed_step))
        )
    if section.mlflow:
        params = _flat_params(config.to_dict())
        openers.append(
            ("mlflow", "an MLflow run that starts", lambda: MLflowSink(section, run_name=run_name, params=params))
        )
    if section.wandb:
        openers.append(
            (
                "wandb",
                "a W&B run that starts (wandb.init)",
                lambda: WandbSink(section, run_name=run_name, run_config=config.to_dict(), out=out),
            )
        )
    sinks: list[MetricsSink] = []
    for key, allowed, opener in openers:
        try:
            sinks.append(opener())
        except Exception as err:
            close_sinks(sinks, failed=True)
            fix = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            raise ConfigError([Problem(f"logging.{key}", True, allowed, f"{fix}; or set logging.{key}=false")]) from err
        except BaseException:
            close_sinks(sinks, failed=True)
            raise
    return sinks


def log_to_sinks(sinks: list[MetricsSink], step: int, metrics: Mapping[str, float]) -> None:
    """``sink.log(step, metrics)`` for each sink, in order.

    A service's sink that fails (a tracking server gone away, a full disk) is logged, closed and dropped from
    ``sinks``: it runs on rank 0 only, so raising would leave the other ranks waiting in the next collective,
    and the run's own record (``metrics.jsonl``, checkpoints) goes on.  An ``on_metrics`` callable runs on every
    rank: its exceptions are the caller's and propagate.
    """
    for sink in list(sinks):
        try:
            sink.log(step, metrics)
        except Exception as err:
            if isinstance(sink, CallbackSink):
                raise
            logger.warning(
                "step %d: the %s metrics sink failed (%s: %s); it is closed and the run goes on without it",
                step,
                type(sink).__name__,
                type(err).__name__,
                err,
            )
            sinks.remove(sink)
            close_sinks([sink], failed=True)


def close_sinks(sinks: list[MetricsSink], *, failed: bool = False) -> None:
    """Close every sink (``failed``: the run ended with an error); one that fails to close is logged and the
    others are still closed."""
    for sink in sinks:
        try:
            sink.close(failed=failed)
        except Exception as err:  # a service that went away must not hide the run's own result or error
            logger.warning("closing the %s metrics sink failed: %s", type(sink).__name__, err)
