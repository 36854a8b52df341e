"""fsdp-bridge's training job inside Ray Train workers: Ray starts the ranks, train() joins them.

    pip install 'fsdp-bridge[ray]'
    python examples/ray_train.py                                    # the built-in job, 2 CPU workers
    python examples/ray_train.py examples/tiny_cpu.yaml max_steps=40 --workers 2
    RAY_ADDRESS=auto python examples/ray_train.py job.yaml --gpu    # on a running Ray cluster, NCCL

Each worker of a ``TorchTrainer`` calls :func:`fsdp_bridge.train.train` with the same config.
Ray Train has already initialised the default process group (gloo for CPU workers, NCCL with
``use_gpu``) and exported ``RANK``/``WORLD_SIZE``: ``train()`` joins that group and starts no
ranks of its own (a config whose ``bridge.device`` the group does not serve is refused, naming
the fix). The run directory is ``output_dir`` of the config, as with ``fsdp-bridge train``: one
path every worker sees (one machine, or a shared file system), or an object-store URL
(``output_dir=s3://bucket/run``, ``gs://``, ``az://``: install the matching fsspec driver, e.g.
``fsdp-bridge[s3]``) where the workers write their checkpoints and rank 0 the run's files.

After a worker fails, ``FailureConfig(max_failures=1)`` makes Ray start the workers again; the
config has ``resume: auto``, so the new attempt continues from the latest checkpoint in
``output_dir`` (data position, optimizer state and RNG streams restored) and ends as an
uninterrupted run would. Each worker reports every step's figures to ``ray.train.report``
(``train/loss``, ``train/lr``, ``eval/loss`` on evaluation steps, ...: the tags of the
``logging:`` sinks, through ``train(..., on_metrics=...)``), then the run's final figures.

Without ``RAY_ADDRESS`` a local Ray instance is started on 127.0.0.1 only (Ray resolves
``127.0.0.1`` to the machine's interface address unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
its single-machine mode, is set before Ray is imported: this script sets it).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """What every Ray Train worker runs: the job's ``train()``, then its figures to Ray."""
    import ray.train

    from fsdp_bridge.train import TrainConfig, train

    def report(step: int, metrics: dict[str, float]) -> None:
        # Called on every worker after each optimizer step: Ray needs the same number of reports from each.
        ray.train.report({"step": step, **metrics})

    config = TrainConfig.from_dict(loop_config["config"])
    result = train(config, verbosity=loop_config.get("verbosity", "normal"), on_metrics=report)  # type: ignore[arg-type]
    # The run's final figures (metrics.jsonl in output_dir holds every step's too).
    ray.train.report(
        {
            "step": result.steps,
            "tokens": result.tokens,
            "loss": result.final_loss,
            "eval_loss": result.eval_loss,
            "best_eval_loss": result.best_eval_loss,
            "checkpoint": result.checkpoint,
            "resumed_from": result.resumed_from,
        }
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the job on ``--workers`` Ray Train workers; return the run's summary (``summary.json``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="*", help="CONFIG.yaml and/or key=value overrides")
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers (ranks)")
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker (NCCL); default CPU (gloo)")
    parser.add_argument("--max-failures", type=int, default=1, help="restarts after a worker fails")
    parser.add_argument("--storage-path", default=None, help="Ray Train's run storage (default ~/ray_results)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    if not os.environ.get("RAY_ADDRESS"):
        # Ray's single-machine mode: every address (the workers', the gloo rendezvous) is 127.0.0.1.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import fsspec
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from fsdp_bridge.train import load_train_config

    path = next((i for i in args.items if "=" not in i), None)
    overrides = [i for i in args.items if "=" in i]
    config = load_train_config(path, [*overrides, "resume=auto"])  # a bad config fails here, before Ray starts
    # Every worker must see the same run directory: an absolute path, whatever the workers' cwd
    # (a URL is one already).
    config_dict = config.to_dict()
    if "://" not in config.output_dir:
        config_dict["output_dir"] = str(Path(config.output_dir).resolve())

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init()
        else:  # a local instance, reachable from this machine only
            ray.init(num_cpus=args.workers, include_dashboard=False, _node_ip_address="127.0.0.1")
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": config_dict, "verbosity": "quiet" if args.quiet else "normal"},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
        run_config=RunConfig(
            name=config_dict["output_dir"].rstrip("/").rsplit("/", 1)[-1],
            storage_path=None if args.storage_path is None else str(Path(args.storage_path).resolve()),
            failure_config=FailureConfig(max_failures=args.max_failures),
        ),
    )
    trainer.fit()  # raises ray.train.TrainingFailedError once the failures exceed max_failures
    with fsspec.open(config_dict["output_dir"].rstrip("/") + "/summary.json", "r") as f:  # a path or a URL
        summary: dict[str, Any] = json.load(f)
    print(json.dumps({"summary": summary}))
    return summary


if __name__ == "__main__":
    main()
