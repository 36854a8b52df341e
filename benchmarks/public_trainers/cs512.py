"""Drives the FSDP1 trainer of Arvid-pku/CS512-FSDP (``run_fsdp.py --fsdp-impl torch`` at 05f5c40) on CPU ranks.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the checkout and once in the copy that
``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/cs512.py
    fsdp-bridge migrate verify <checkout> --target torch -- benchmarks/public_trainers/cs512.py

The trainer (``fsdp_trainer/train.py``) builds a small pre-norm ``nn.TransformerEncoder`` language model with
tied embeddings, seeded alike on every rank, and wraps it in one ``FSDP(...)`` built from its config: a
``transformer_auto_wrap_policy`` over ``nn.TransformerEncoderLayer``, ``FULL_SHARD``, ``sync_module_states``,
``MixedPrecision`` in the run's precision (parameters, reduction and buffers), ``limit_all_gathers`` and
``use_orig_params=True``; on the CPU it passes no ``device_id``. It builds AdamW over the wrapped model's
parameters, trains on a synthetic modular-addition task it generates itself (no data to download), clips with
``fsdp_model.clip_grad_norm_``, averages the logged loss over the ranks, and saves a checkpoint every
``ckpt_every`` steps: the model's full state dict under ``FSDP.state_dict_type(..., FULL_STATE_DICT,
FullStateDictConfig(offload_to_cpu=True, rank0_only=True))`` and ``FSDP.optim_state_dict`` with a full,
rank-0-only optimizer config, ``torch.save`` on rank 0, which ``verify`` compares.

This driver runs ``run_fsdp.py`` as ``__main__`` with ``--config`` pointing at a JSON file it writes to a
temporary folder outside the tree: the trainer's defaults with a model of 2 layers of 32 dimensions (2 heads,
a vocabulary of 256, sequences of 16), 32 samples, batches of 4 per rank (4 optimizer steps per rank, one
epoch), no dropout (the trainer seeds each rank alike, so dropout masks would match too, but none keeps the
comparison about the sharding), no data-loader workers, ``gloo`` as its ``runtime.backend`` and a checkpoint
after steps 2 and 4. ``CS512_PRECISION`` picks ``runtime.mixed_precision``: ``fp32`` by default (bit for bit
where the reduction order allows), or the trainer's default ``bf16`` (FSDP1's ``MixedPrecision`` in bf16 on
the CPU, compared at bf16's tolerance). What the CPU needs, alike in both runs:

* FSDP1's ``sync_module_states=True`` refuses weights on the CPU ("requires them to be on GPU", a check before
  its broadcast) although gloo broadcasts them from there: the check is left out
  (``torch.distributed.fsdp._init_utils._check_module_states_for_sync_module_states``, which only the FSDP1
  run calls), and rank 0's weights are broadcast as on a GPU;
* ``FullStateDictConfig(offload_to_cpu=True, ...)`` with the shards on the CPU makes FSDP1 free the gathered
  storage its state dict still points to (a segmentation fault on rank 0 at the first checkpoint,
  pytorch/pytorch issue 188989): ``_common.full_state_dicts_without_offload`` drops the offload, which means
  nothing on the CPU (only FSDP1 code calls ``FSDP.state_dict_type``);
* ``FSDP.optim_state_dict`` under FSDP1's default ``FullOptimStateDictConfig()`` (``offload_to_cpu=True``) with
  ``use_orig_params=True`` and the shards on the CPU saves wrong ``exp_avg`` values (the weights and
  ``exp_avg_sq`` right): ``_common.full_optim_state_dicts_without_offload`` drops that offload too.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import shutil
import sys
import tempfile

from _common import full_optim_state_dicts_without_offload, full_state_dicts_without_offload

MODEL = {
    "vocab_size": 256,
    "embed_dim": 32,
    "num_layers": 2,
    "num_heads": 2,
    "ff_hidden_dim": 64,
    "dropout": 0.0,
    "max_seq_len": 16,
    "tie_embedding_weights": True,
}
DATA = {"total_samples": 32, "seq_len": 16, "vocab_size": 256, "num_workers": 0, "pattern_period": 3}


def _config(directory: str) -> str:
    path = os.path.join(directory, "cs512.json")
    config = {
        "model": MODEL,
        "data": DATA,
        "optim": {"lr": 1e-3, "warmup_steps": 1, "max_steps": 8},
        "runtime": {
            "backend": "gloo",
            "log_every": 1,
            "ckpt_every": 2,
            "ckpt_dir": "checkpoints",
            "mixed_precision": os.environ.get("CS512_PRECISION", "fp32"),
        },
        "fsdp": {"implementation": "torch", "activation_checkpointing": False},
        "epochs": 1,
        "batch_size_per_device": 4,
    }
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def _module_states_synced_on_the_cpu() -> None:
    """FSDP1's ``sync_module_states=True`` broadcasts rank 0's weights from the CPU (see the module docstring)."""
    from torch.distributed.fsdp import _init_utils

    _init_utils._check_module_states_for_sync_module_states = lambda module_states: None


def main() -> None:
    directory = tempfile.mkdtemp(prefix="cs512-")
    atexit.register(shutil.rmtree, directory, True)
    _module_states_synced_on_the_cpu()
    full_state_dicts_without_offload()
    full_optim_state_dicts_without_offload()
    sys.argv = ["run_fsdp.py", "--config", _config(directory)]
    runpy.run_path("run_fsdp.py", run_name="__main__")


if __name__ == "__main__":
    main()
