"""Drives the FSDP1 trainer of Varun-Dudipala/flextrain (``examples/gpt2_training`` at 1ae5fda) on CPU ranks,
with no download.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the checkout and once in the copy that
``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/flextrain.py

The library's ``DistributedTrainer`` (``flextrain/core/trainer.py``) wraps the model by its config's
``distributed.strategy``: for ``fsdp``, ``FSDPWrapper.wrap`` (``flextrain/core/fsdp_wrapper.py``) makes one
``FSDP(model, ...)`` with the ``ShardingStrategy`` named in the config, ``MixedPrecision`` in bf16
(parameters, reduction, buffers), ``use_orig_params=True``, ``limit_all_gathers`` and no wrap policy (the
root is the only unit). It builds AdamW from the wrapped model's parameters and a cosine schedule, runs a
health check (an ``all_gather``) before every batch, accumulates gradients, clips with
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``, and saves through its ``CheckpointManager``
(``flextrain/checkpoint/manager.py``): the model as a full state dict under ``FSDP.state_dict_type(...,
FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True))``, with the optimizer's and the
schedule's own ``state_dict()``, one ``torch.save`` (``checkpoints/checkpoint_step<N>_<time>.pt``, which
``verify`` compares) written by a pool of I/O threads. This driver runs the example's ``train_gpt2.py`` as
``__main__`` (``runpy.run_module``: it imports its model relatively): its GPT-2 (``model.py``, the
project's own, tied embeddings, dropout 0.1) built from a config, its random-token dataset (sequences of 512
ids of GPT-2's 50257, drawn unseeded: the same on every rank under ``verify``'s seed), 3 optimizer steps of 2
micro steps of 4 sequences per rank (6 losses per rank), checkpoints at step 2 and at the end (step 3). What
the example leaves out or reads from elsewhere is made here, the same in both runs (``import flextrain``
here is the project's package: ``verify`` puts the tree before this file's folder on ``sys.path``):

* it never starts a process group (``DistributedTrainer`` then trains one process alone, unwrapped): here
  ``dist.init_process_group("nccl")`` is called first, as a launcher script would (``verify`` makes it gloo);
* it builds ``Config()``, the defaults (``strategy: ddp``), and leaves its ``config.yaml`` beside it
  (``strategy: fsdp``, FULL_SHARD by default, bf16, micro batches of 4, 2 accumulation steps, warmup 500,
  async checkpoints, the last 3 kept) unread: here ``Config()`` is that file. PyYAML reads its
  ``learning_rate: 3e-4`` as the string ``"3e-4"`` (YAML 1.1 floats need a dot) and the config's validation
  fails comparing it with 0 (``load_config`` raises TypeError): it is read as the float the example then
  assigns anyway;
* ``create_gpt2_model("small")`` builds GPT-2 small (124M parameters): here its ``GPT2Config`` defaults to 2
  layers of 32 dimensions, 2 heads, an MLP of 128 (vocabulary, positions and dropout as the project has
  them); the example's own 1000 steps, logging every 10 and a checkpoint every 100 are 3, 1 and 2
  (set on the config when the trainer is built, after the example's assignments);
* the trainer calls ``CheckpointManager.save`` without ``is_fsdp=True``, so every rank but 0 returns at once
  and rank 0 alone enters the full state dict's all-gather while rank 1 runs the next health check: gloo
  aborts ("Received data size doesn't match expected size", 1666464 vs 2), and NCCL would hang. Here every
  rank saves with ``is_fsdp=True`` (the manager's own flag for this) and the ranks other than 0 get a storage
  backend that writes nothing (with the flag alone they would write their empty model state to rank 0's
  path); ``FLEXTRAIN_KEEP_RANK0_SAVE=1`` keeps the trainer's call;
* checkpoint names carry the time of the save (``datetime.now()``): here the same time in both runs, so that
  ``verify`` finds the two runs' files at the same path;
* its checkpoints take the full state dict with ``offload_to_cpu=True``: with the shards on the CPU, FSDP1's
  ``FlatParamHandle.to_cpu()`` "moves" the gathered flat parameter to where it already is (no copy) and then
  frees that storage, which the state dict's views still point to, and rank 0 dies of a segmentation fault
  (pytorch/pytorch issue 188989, as in ``allamo.py`` and ``minillm.py``). Here ``FSDP.state_dict_type`` takes
  such a config without the offload, which means nothing on the CPU (only the FSDP1 run calls it; the
  migrated code reads the same config and offloads); ``FLEXTRAIN_KEEP_OFFLOAD=1`` keeps it.

bf16 as the config has it (``MixedPrecision``; on the CPU the trainer's ``autocast("cuda")`` and
``GradScaler("cuda")`` disable themselves, in both runs): the losses are compared with bf16's tolerance. On
random tokens they stay at ln 50257 (10.875 in bf16, recorded divided by the 2 accumulation steps), so the
checkpoints, fp32 weights after 3 AdamW steps, carry the comparison. Two things change with the migration
and are left as they are:

* the checkpoint's ``optimizer.state_dict()`` is rank 0's own state: on FSDP1 the one slice of the flat
  parameter rank 0 holds (833232 elements of ``wte.weight``, no state for the 27 other parameters), on FSDP2
  a DTensor shard of every parameter (rows 0 to 25128 of each). ``verify`` reports each of these states as a
  difference; where the two layouts overlap the values are the same;
* ``torch.nn.utils.clip_grad_norm_`` over an FSDP1 model's parameters takes the norm of each rank's shard,
  over FSDP2's DTensors the whole model's (logged ``grad_norm`` 0.078 against 0.193 at step 1). Both stay
  under the config's ``max_grad_norm`` of 1.0 here, so neither run clips.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import os
import runpy
from typing import Any

import torch.distributed as dist
from _common import full_state_dicts_without_offload

EXAMPLE = "examples.gpt2_training"
CONFIG = "examples/gpt2_training/config.yaml"
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128}
MAX_STEPS, SAVE_INTERVAL, LOG_INTERVAL = 3, 2, 1
STAMP = datetime.datetime(2025, 1, 1)
"""The time in every checkpoint's name."""


def _config_of_the_example() -> None:
    """``Config()`` is the example's ``config.yaml``, its learning rate read as a number (see the module
    docstring)."""
    import flextrain
    import yaml

    config = flextrain.Config

    def from_the_example_file() -> Any:
        with open(CONFIG) as f:
            data = yaml.safe_load(f)
        data["training"]["learning_rate"] = float(data["training"]["learning_rate"])
        made = config.from_dict(data)
        made.validate()
        return made

    flextrain.Config = from_the_example_file


def _tiny_model() -> None:
    """``create_gpt2_model`` builds its GPT-2 from a config of 2 layers of 32 dimensions."""
    model = importlib.import_module(f"{EXAMPLE}.model")
    model.GPT2Config = functools.partial(model.GPT2Config, **TINY)


def _short_run() -> None:
    """The trainer built with the run's steps, logging and checkpoint intervals (the example assigns its
    own just before)."""
    import flextrain

    trainer = flextrain.DistributedTrainer

    class ShortRun(trainer):  # type: ignore[misc,valid-type]
        def __init__(self, model: Any, config: Any, *args: Any, **kwargs: Any) -> None:
            config.training.max_steps = MAX_STEPS
            config.training.save_interval = SAVE_INTERVAL
            config.training.log_interval = LOG_INTERVAL
            super().__init__(model, config, *args, **kwargs)

    flextrain.DistributedTrainer = ShortRun


class _Nowhere:
    """A storage backend that writes nothing: the checkpoints of the ranks other than 0."""

    def save(self, state: Any, path: Any) -> None:
        pass

    def load(self, path: Any) -> Any:
        raise FileNotFoundError(path)

    def exists(self, path: Any) -> bool:
        return False

    def delete(self, path: Any) -> None:
        pass


def _every_rank_gathers() -> None:
    """Every rank saves with ``is_fsdp=True`` and only rank 0 writes (see the module docstring)."""
    import flextrain.checkpoint.manager as manager

    storage = manager.create_storage_backend
    save = manager.CheckpointManager.save

    def rank0_writes(*args: Any, **kwargs: Any) -> Any:
        return storage(*args, **kwargs) if dist.get_rank() == 0 else _Nowhere()

    def on_every_rank(self: Any, *args: Any, **kwargs: Any) -> Any:
        return save(self, *args, **{**kwargs, "is_fsdp": True})

    manager.create_storage_backend = rank0_writes
    manager.CheckpointManager.save = on_every_rank


def _same_file_names() -> None:
    """``datetime.now()``, read by ``CheckpointManager.save`` for the file's name, is ``STAMP`` during the
    call."""
    from flextrain.checkpoint.manager import CheckpointManager

    save = CheckpointManager.save
    real = datetime.datetime

    class Stamp(real):  # type: ignore[misc,valid-type]
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return STAMP

    def stamped_alike(self: Any, *args: Any, **kwargs: Any) -> Any:
        datetime.datetime = Stamp  # type: ignore[misc]
        try:
            return save(self, *args, **kwargs)
        finally:
            datetime.datetime = real  # type: ignore[misc]

    CheckpointManager.save = stamped_alike


def main() -> None:
    dist.init_process_group("nccl")
    _config_of_the_example()
    _tiny_model()
    _short_run()
    if os.environ.get("FLEXTRAIN_KEEP_RANK0_SAVE") != "1":
        _every_rank_gathers()
    if os.environ.get("FLEXTRAIN_KEEP_OFFLOAD") != "1":
        full_state_dicts_without_offload()
    _same_file_names()
    runpy.run_module(f"{EXAMPLE}.train_gpt2", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
