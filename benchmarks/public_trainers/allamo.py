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
an evaluation of one batch every second iteration, so that the best checkpoint (model and
optimizer) is saved twice, and the final model checkpoint at the end, in the run's ``out`` folder, which
``verify`` compares. What the trainer reads from elsewhere is made here:

* its training file (``<data_dir>/<dataset>/train.*.bin``, the ``uint16`` token stream of its
  ``prepare_datasets.py``) holds the sample text shipped in ``fsdp_bridge/data`` as ids of a word-level
  vocabulary (the model's ``vocab_size``), written to a temporary folder of each rank (outside the tree:
  ``verify`` compares every ``.bin`` the script leaves there). No validation file: the trainer asks whether
  its validation split has data before loading any file, finds none, and evaluates on the training split;
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
* its checkpoints take the full state dict with ``offload_to_cpu=True``: with the shards on the CPU, FSDP1's
  ``FlatParamHandle.to_cpu()`` "moves" the gathered flat parameter to where it already is (no copy) and then
  frees that storage, which the state dict's views still point to; the clone that follows reads freed memory
  (a segmentation fault of rank 0 with ``use_orig_params=True``, "storage of size 0" without; pytorch/pytorch
  issue 188989). Here ``FullStateDictConfig`` keeps ``rank0_only`` and drops ``offload_to_cpu``, which means
  nothing on the CPU, in both runs (the migrated code reads the same config); ``ALLAMO_KEEP_OFFLOAD=1`` keeps
  it;
* ``FSDP.full_optim_state_dict`` (rank 0's copy, offloaded to the CPU) gathers each optimizer state of a unit
  (``exp_avg``, then ``exp_avg_sq``) into one buffer it reuses, and keeps ``.cpu()`` of each parameter's
  view of it: on the CPU that is the view itself, not a copy, so every state ends up holding the last one
  gathered (FSDP1's checkpoint has ``exp_avg == exp_avg_sq``; on a GPU ``.cpu()`` copies). Here each state is
  copied as it is taken (a wrapper around FSDP1's private ``_optim_utils._unflatten_orig_param_states``,
  which only the FSDP1 run calls); ``ALLAMO_KEEP_OPTIM_ALIAS=1`` leaves it out;
* ``wandb`` (imported, not used with ``wandb_log`` off) and ``joblib`` (read for its ``.alm`` files only)
  are stubs when they are not installed.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import shutil
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
    """The sample text as token ids, in the trainer's ``.bin`` format: 80 sequences of 33 tokens (input and
    shifted target of 32), each rank taking every second one. Returns the vocabulary size."""
    words = sample_words()
    vocab = {w: i for i, w in enumerate(sorted(set(words)))}
    ids = np.array([vocab[w] for w in words[: 80 * 33]], dtype=np.uint16)
    folder = os.path.join(directory, DATASET)
    os.makedirs(folder)
    ids.tofile(os.path.join(folder, "train.000.bin"))
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
    """``FullStateDictConfig(offload_to_cpu=True, rank0_only=True)`` without the offload (see the module
    docstring)."""
    import allamo.trainer.fsdp_trainer as fsdp_trainer

    config = fsdp_trainer.FullStateDictConfig

    def on_the_cpu_already(offload_to_cpu: bool = False, rank0_only: bool = False) -> Any:
        return config(offload_to_cpu=False, rank0_only=rank0_only)

    fsdp_trainer.FullStateDictConfig = on_the_cpu_already


def _optimizer_states_copied() -> None:
    """Each optimizer state FSDP1 gathers to the CPU copied before its buffer is reused (see the module
    docstring)."""
    from torch.distributed.fsdp import _optim_utils

    unflatten = _optim_utils._unflatten_orig_param_states

    def copied(
        fsdp_param_info: Any,
        output_states: dict[str, dict[str, Any]],
        state_name: str,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        unflatten(fsdp_param_info, output_states, state_name, *args, **kwargs)
        for states in output_states.values():
            value = states.get(state_name)
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                states[state_name] = value.clone()

    _optim_utils._unflatten_orig_param_states = copied


def main() -> None:
    os.makedirs("out", exist_ok=True)  # rank 0's log file goes there before the trainer makes the folder
    directory = tempfile.mkdtemp(prefix="allamo-data-")
    atexit.register(shutil.rmtree, directory, True)
    config = _config(directory, _datasets(directory))
    sys.argv = ["fsdp_train.py", "--config", config]

    stub_missing(STUBS)
    _accelerator_is_the_cpu()
    if os.environ.get("ALLAMO_KEEP_OFFLOAD") != "1":
        _state_dicts_without_offload()
    if os.environ.get("ALLAMO_KEEP_OPTIM_ALIAS") != "1":
        _optimizer_states_copied()
    if os.environ.get("ALLAMO_KEEP_RANK_SEED") != "1":
        _same_weights_on_every_rank()
    runpy.run_path("fsdp_train.py", run_name="__main__")


if __name__ == "__main__":
    main()
