"""Drives the FSDP1 trainer of chrisociepa/allamo (``fsdp_train.py`` at e0d6a79) on CPU ranks, with no download.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the checkout and once in the copy that
``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/allamo.py

The trainer (``allamo/trainer/fsdp_trainer.py``, ``FSDPTrainer``) builds its LLaMA-style
``AllamoTransformer`` on every rank and wraps it in ``allamo/fsdp_utils.py`` with one ``FSDP(model,
**fsdp_config)``: the config is a dict built there (``transformer_auto_wrap_policy`` over
``SelfAttentionBlock``, a ``ShardingStrategy`` looked up by name, ``MixedPrecision`` in the run's dtype,
``BACKWARD_PRE``, ``limit_all_gathers``, ``use_orig_params=True``, ``device_id`` from
``torch.cuda.current_device()``). It then builds its AdamW from the unwrapped model's parameters, clips with
``model.clip_grad_norm_``, and saves checkpoints as a full state dict under ``FSDP.state_dict_type(...,
FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True))`` and a full optimizer state
from ``FSDP.full_optim_state_dict`` (``torch.save`` on rank 0). This driver runs its ``fsdp_train.py`` as
``__main__`` with a JSON config of its own (``--config``): a 2-layer model (32 dimensions, 2 heads, blocks of
32 tokens), 5 optimizer steps (iterations 0 to 4) of 2 sequences per rank, fp32 (``dtype: float32``: no
``MixedPrecision`` casts, the trainer's GradScaler disabled), a constant learning rate, clipping at 1.0,
an evaluation every second iteration (one batch per split), so that the best checkpoint (model and
optimizer) is saved twice, and the final model checkpoint at the end, in the run's ``out`` folder, which
``verify`` compares. What the trainer reads from elsewhere is made here:

* its dataset files (``<data_dir>/<dataset>/train.*.bin`` and ``val.*.bin``, the ``uint16`` token streams of
  its ``prepare_datasets.py``) hold the sample text shipped in ``fsdp_bridge/data`` as ids of a word-level
  vocabulary (the model's ``vocab_size``), written to a temporary folder of each rank (outside the tree:
  ``verify`` compares every ``.bin`` the script leaves there);
* it names the accelerator outright: ``init_torch`` sets ``config.device = f"cuda:{local_rank}"`` after
  starting the process group, and batches and metrics go to that device (pinned first). On this machine
  that device is the CPU, for both runs alike (``verify`` adds its own shims for process groups,
  ``torch.cuda.set_device`` and the ``device_id`` FSDP1 is given);
* it seeds every rank with ``seed + rank`` before building the model (``configure_torch``) and passes no
  ``sync_module_states``: each rank draws different full weights and FSDP1 keeps the rank's own slice of its
  own draw, cut from the flat parameter of each unit. FSDP2 cuts each parameter along its first dimension
  instead, so no FSDP2 code holds FSDP1's patchwork of the two draws. The model is built here under the
  config's seed on every rank (``torch.random.fork_rng``, so what the trainer draws later, its evaluation
  batches, is drawn as before); with ``ALLAMO_KEEP_RANK_SEED=1`` the trainer's own per-rank draw is kept,
  and the two runs start from different weights;
* ``wandb`` (imported, not used with ``wandb_log`` off) and ``joblib`` (read for its ``.alm`` files only)
  are stubs when they are not installed.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
from typing import Any

import numpy as np
import torch
from _common import sample_words, stub_missing

SEED = 1337
DATASET = "sample_text"


def _unused(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("not part of this run")


STUBS = {
    "wandb": {"init": _unused, "log": _unused},
    "joblib": {"load": _unused, "dump": _unused},
}


def _datasets(directory: str) -> int:
    """The sample text as token ids, in the trainer's ``.bin`` format: 80 sequences of 33 tokens for
    training, 16 for validation (each rank takes every second one). Returns the vocabulary size."""
    words = sample_words()
    vocab = {w: i for i, w in enumerate(sorted(set(words)))}
    ids = np.array([vocab[w] for w in words], dtype=np.uint16)
    folder = os.path.join(directory, DATASET)
    os.makedirs(folder)
    ids[: 80 * 33].tofile(os.path.join(folder, "train.000.bin"))
    ids[80 * 33 : 96 * 33].tofile(os.path.join(folder, "val.000.bin"))
    return len(vocab)


def _config(directory: str, vocab_size: int) -> str:
    config = {
        "init_from": "scratch",
        "seed": SEED,
        "data_dir": directory,
        "dataset": DATASET,
        "out_dir": os.path.abspath("out"),
        "device": "cpu",
        "backend": "gloo",
        "dtype": "float32",
        "compile": False,
        "wandb_log": False,
        "fsdp_sharding_strategy": "FULL_SHARD",
        "vocab_size": vocab_size,
        "block_size": 32,
        "n_layer": 2,
        "n_head": 2,
        "head_size": 16,
        "n_embd": 32,
        "intermediate_size": 64,
        "batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_iters": 4,
        "learning_rate": 1e-3,
        "decay_lr": False,
        "warmup_iters": 0,
        "weight_decay": 0.1,
        "grad_clip": 1.0,
        "eval_interval": 2,
        "eval_iters": 1,
        "log_interval": 1,
        "checkpoint_interval": 0,
        "save_best_checkpoint": True,
        "save_optimizer_checkpoint": True,
    }
    path = os.path.join(directory, "allamo_cpu.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def _accelerator_is_the_cpu() -> None:
    """``init_torch`` names the rank's GPU as the run's device once the process group is up: here the CPU."""
    import allamo.trainer.base as base

    init_torch = base.init_torch

    def init_torch_on_cpu(train_ctx: Any, config: Any, distributed: bool = True) -> None:
        init_torch(train_ctx, config, distributed=distributed)
        config.device = "cpu"

    base.init_torch = init_torch_on_cpu


def _same_weights_on_every_rank() -> None:
    """The model built under the config's seed on every rank (see the module docstring), the trainer's
    per-rank random stream left as it was."""
    import allamo.trainer.fsdp_trainer as fsdp_trainer

    build = fsdp_trainer.AllamoTransformer

    def built_alike(model_config: Any) -> Any:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            return build(model_config)

    fsdp_trainer.AllamoTransformer = built_alike


def _state_dicts_without_offload() -> None:
    import allamo.trainer.fsdp_trainer as fsdp_trainer

    config = fsdp_trainer.FullStateDictConfig

    def on_the_cpu_already(offload_to_cpu: bool = False, rank0_only: bool = False) -> Any:
        return config(offload_to_cpu=False, rank0_only=rank0_only)

    fsdp_trainer.FullStateDictConfig = on_the_cpu_already


def main() -> None:
    os.makedirs("out", exist_ok=True)  # rank 0's log file goes there before the trainer makes the folder
    directory = tempfile.mkdtemp(prefix="allamo-data-")
    config = _config(directory, _datasets(directory))
    sys.argv = ["fsdp_train.py", "--config", config]

    stub_missing(STUBS)
    _accelerator_is_the_cpu()
    if os.environ.get("ALLAMO_KEEP_OFFLOAD") != "1":
        _state_dicts_without_offload()
    if os.environ.get("ALLAMO_KEEP_RANK_SEED") != "1":
        _same_weights_on_every_rank()
    runpy.run_path("fsdp_train.py", run_name="__main__")


if __name__ == "__main__":
    main()
