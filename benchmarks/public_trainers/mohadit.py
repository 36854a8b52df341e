"""Drives the FSDP1 trainer of mohame54/Dit (``main.py --dist-mode fsdp`` at d7dc3ce) on CPU ranks, with no download.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the checkout and once in the copy that
``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/mohadit.py

The trainer (a class-conditional DiT trained by rectified flow on VAE latents) builds its ``DitModel`` from a
JSON config in ``fsdp_utils.load_fsdp_model`` (on the CPU, seeded alike on every rank by ``set_seed``) and wraps
it in one ``FSDP(model, **fsdp_kwargs)``: a ``transformer_auto_wrap_policy`` over ``DitBlock``, ``FULL_SHARD``,
``sync_module_states=True``, ``device_id=torch.cuda.current_device()`` and ``MixedPrecision`` in the run's
dtype (parameters and buffers, fp32 reduction, ``cast_forward_inputs``), no ``use_orig_params``. An EMA copy is
wrapped alike and given the model's weights through a full state dict (``copy_fsdp_model_state``). It builds a
fused AdamW over the wrapped model's parameters in two groups (weight decay for ``p.ndim >= 2``, none for the
rest: ``utils.build_adamw_param_groups``), steps a warmup-then-cosine schedule per optimizer step, trains each
step under ``torch.amp.autocast("cuda")``, clips with ``torch.nn.utils.clip_grad_norm_``, updates the EMA
parameter by parameter, evaluates every epoch, and saves checkpoints as full state dicts under
``FSDP.state_dict_type(..., FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True))``
(``model.pt``, ``ema.pt``) and ``FSDP.optim_state_dict`` (``optim.pt``), ``torch.save`` on rank 0, which
``verify`` compares, then samples a grid of images from the EMA model (every rank, a PNG on rank 0). This
driver runs its ``main.py`` as ``__main__`` with its own command line: ``--dist-mode fsdp``, bf16
(``--mp-dt bfloat16``, ``train.sh``'s), AdamW (``--use-moun False``, ``train.sh``'s), batches of 2 latents
per rank, 2 epochs of 3 optimizer steps (6 losses per rank), a learning rate of 1e-3 (``--lr``) after 2 warmup
steps (``--warmup-steps``; ``opt_config.json``'s 1000 would keep it near zero), a checkpoint every epoch
(``checkpoints/checkpoint_1`` and ``checkpoint_2``), samples of 2 steps, no FID and no upload to the hub.
What the trainer reads from elsewhere is made here:

* its model config (``--model-config``) is the shipped ``model_config.json`` in miniature (2 blocks of 32
  dimensions, 2 heads, patches of 4, its dropouts), at the latent size ``main.py`` samples at, (4, 32, 32);
* its data (``--data-dir-path``: ``train.csv`` and ``val.csv`` naming ``latent_vectors/*.npy``, VAE latents
  of CIFAR images from Google Drive) are 12 training and 4 validation latents drawn from a seeded generator
  with the mean and scale of ``train.sh``'s ``DATASET_MEAN`` and ``SCALE_CONSTANT`` (set, as ``train.sh``
  does, when not set), written to a temporary folder of each rank (outside the tree), the same on every rank;
* the VAE (``utils.get_vae``: ``AutoencoderKL.from_pretrained("stabilityai/sdxl-vae")``, a hub download) is a
  decoder without weights (the first three latent channels through ``tanh``); it only turns the samples into
  the PNG, which ``verify`` does not compare. ``diffusers``, ``torchvision`` and ``huggingface_hub`` (imported
  by ``utils.py``, not used otherwise) are stubs when they are not installed;
* it is written for CUDA devices, and here they are the CPU, alike in both runs: ``main.py`` asserts
  ``torch.cuda.is_available()`` (true when ``main.py`` asks, so its AdamW is fused, as on a GPU: torch has a
  fused CPU kernel), names ``torch.device(f"cuda:{local_rank}")`` as its device (tensors the trainer makes on
  it, the ``is_best`` flag it broadcasts and the sampler's noise, are made on the CPU: ``torch``'s factories
  given a CUDA ``device=``), and trains under ``torch.amp.autocast(device_type="cuda")`` (the CPU's autocast
  here, in bf16, as the trainer's is on its GPU; CUDA's would switch itself off on this machine);
  ``verify`` adds its own shims for process groups, ``torch.cuda.set_device`` and the ``device_id`` FSDP1 is
  given;
* FSDP1's ``sync_module_states=True`` refuses weights on the CPU ("requires them to be on GPU", a check
  before its broadcast) although gloo broadcasts them from there: the check is left out
  (``torch.distributed.fsdp._init_utils._check_module_states_for_sync_module_states``, which only the FSDP1
  run calls), and rank 0's weights are broadcast as on a GPU;
* its state dicts take the full state dict with ``offload_to_cpu=True``: with the shards on the CPU, FSDP1's
  ``FlatParamHandle.to_cpu()`` "moves" the gathered flat parameter to where it already is (no copy) and then
  frees that storage, which the state dict's views still point to; the next state dict reads freed memory
  ("storage of size 0" in ``copy_fsdp_model_state``, pytorch/pytorch issue 188989, as in ``allamo.py``). Here
  ``fsdp_utils.FullStateDictConfig`` keeps ``rank0_only`` and drops ``offload_to_cpu``, which means nothing on
  the CPU, in both runs (the migrated code reads the same config); ``MOHADIT_KEEP_OFFLOAD=1`` keeps it.

What the migration changes, and ``verify`` shows: FSDP1 without ``use_orig_params`` gives the optimizer one
1-D flat parameter per unit, so the trainer's ``p.ndim`` rule puts every parameter in the group without weight
decay; FSDP2's parameters keep their shapes, and 23 of them (those of two dimensions or more) get
``opt_config.json``'s weight decay of 1e-2. The losses still agree within float32's tolerance (a few 1e-7
apart), but the saved weights do not (up to 6e-4 apart after 6 steps) and the saved optimizer states'
``param_groups`` name other parameters in each group: DIVERGED, the migration's doing, which this driver leaves
as it is. With the weight decay set to 0 (not done here) the losses and every saved tensor agree bit for bit,
and only the ``param_groups`` lists differ. ``main.py``'s printed parameter count differs likewise: a rank's
flat shards against the whole model.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import shutil
import sys
import tempfile
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from _common import stub_missing

SEED = 1234
LATENT_SHAPE = (4, 32, 32)
"""What ``main.py`` generates its samples at (``latent_shape=(4, 32, 32)``, written there): the model's input."""
TRAIN_ROWS, VAL_ROWS = 12, 4
SCALE_CONSTANT, DATASET_MEAN = "0.15418", "0.49665"
"""``train.sh``'s defaults for the latent scaling the dataset applies (``SCALE_CONSTANT``, ``DATASET_MEAN``)."""
MODEL_CONFIG = {
    "freq_dim": 32,
    "hidden_dim": 32,
    "num_blocks": 2,
    "bias": True,
    "qkv_bias": False,
    "num_classes": 3,
    "tim_mlp_dim": 1,
    "max_freq": 10000,
    "num_heads": 2,
    "patch_size": 4,
    "mlp_fac": 2,
    "img_size": 32,
    "in_chs": 4,
    "out_chs": 4,
    "drop_rate": 0.2,
    "add_conv_final": False,
    "add_norm_embd": False,
    "use_gate_mlp": True,
    "mlp_bias": False,
    "flip_sin_to_cos": True,
    "label_drop_prob": 0.12,
}
"""The shipped ``model_config.json`` in miniature: 2 blocks of 32 dimensions, 2 heads, patches of 4."""


def _unused(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("not part of this run")


STUBS: dict[str, dict[str, Any]] = {
    "diffusers": {},
    "diffusers.models": {"AutoencoderKL": SimpleNamespace(from_pretrained=_unused)},
    "torchvision": {"transforms": SimpleNamespace(ToTensor=_unused)},
    "huggingface_hub": {"HfApi": _unused, "hf_hub_download": _unused},
}


def _data(directory: str) -> None:
    """Latents in the trainer's layout: ``train.csv`` and ``val.csv`` (``latent_vector_path``, ``label``) and
    ``latent_vectors/*.npy`` (raw latents, scaled by the dataset), the same on every rank."""
    rng = np.random.default_rng(SEED)
    os.makedirs(os.path.join(directory, "latent_vectors"))
    for split, start, count in (("train", 0, TRAIN_ROWS), ("val", TRAIN_ROWS, VAL_ROWS)):
        lines = ["latent_vector_path,label"]
        for i in range(start, start + count):
            path = f"latent_vectors/{i:04d}.npy"
            raw = float(DATASET_MEAN) + rng.standard_normal((1, *LATENT_SHAPE)) / float(SCALE_CONSTANT)
            np.save(os.path.join(directory, path), raw.astype(np.float32))
            lines.append(f"{path},{i % 3}")
        with open(os.path.join(directory, f"{split}.csv"), "w") as f:
            f.write("\n".join(lines) + "\n")
    with open(os.path.join(directory, "model_config.json"), "w") as f:
        json.dump(MODEL_CONFIG, f)


class _LatentPreview(torch.nn.Module):
    """The VAE's stand-in: no weights, latents ``(B, 4, H, W)`` to images ``(B, 3, H, W)`` in ``[-1, 1]``."""

    def decode(self, latents: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(sample=torch.tanh(latents[:, :3].float()))


def _vae_is_here() -> None:
    """``utils.get_vae`` answers with the stand-in (``main.py`` imports it from ``utils`` when it runs)."""
    import utils

    utils.get_vae = lambda model_id=None, rank=0: _LatentPreview().eval()


def _cuda_for_the_trainer() -> None:
    """``torch.cuda.is_available()`` is true when ``main.py`` asks."""
    is_available = torch.cuda.is_available

    def for_main(*args: Any, **kwargs: Any) -> bool:
        if sys._getframe(1).f_globals.get("__name__") == "__main__":
            return True
        return is_available()

    torch.cuda.is_available = for_main  # type: ignore[assignment]


def _names_cuda(device: object) -> bool:
    return (isinstance(device, torch.device) and device.type == "cuda") or (
        isinstance(device, str) and device.startswith("cuda")
    )


FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "linspace")
"""The tensor factories a ``device=`` of the trainer's (``cuda:<local rank>``) reaches: on the CPU here."""


def _cuda_is_the_cpu() -> None:
    """Tensors the trainer makes on its ``cuda:<local rank>`` device are made on the CPU."""
    for name in FACTORIES:
        factory = getattr(torch, name)

        def on_the_cpu(*args: Any, _factory: Any = factory, **kwargs: Any) -> Any:
            if _names_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return _factory(*args, **kwargs)

        setattr(torch, name, on_the_cpu)


def _autocast_on_the_cpu() -> None:
    """``torch.amp.autocast(device_type="cuda", ...)`` is the CPU's autocast (see the module docstring)."""
    autocast = torch.amp.autocast

    class on_the_cpu(autocast):  # type: ignore[misc,valid-type]
        def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
            super().__init__("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    torch.amp.autocast = on_the_cpu  # type: ignore[misc]


def _module_states_synced_on_the_cpu() -> None:
    """FSDP1's ``sync_module_states=True`` broadcasts rank 0's weights from the CPU (see the module docstring)."""
    from torch.distributed.fsdp import _init_utils

    _init_utils._check_module_states_for_sync_module_states = lambda module_states: None


def _state_dicts_without_offload() -> None:
    """``FullStateDictConfig(offload_to_cpu=True, ...)`` without the offload (see the module docstring)."""
    import fsdp_utils

    config = getattr(fsdp_utils, "FullStateDictConfig", None)
    if config is None:
        return

    def on_the_cpu_already(offload_to_cpu: bool = False, rank0_only: bool = False) -> Any:
        return config(offload_to_cpu=False, rank0_only=rank0_only)

    fsdp_utils.FullStateDictConfig = on_the_cpu_already


def main() -> None:
    directory = tempfile.mkdtemp(prefix="mohadit-data-")
    atexit.register(shutil.rmtree, directory, True)
    _data(directory)
    os.environ.setdefault("SCALE_CONSTANT", SCALE_CONSTANT)
    os.environ.setdefault("DATASET_MEAN", DATASET_MEAN)

    stub_missing(STUBS)
    _vae_is_here()
    _cuda_for_the_trainer()
    _cuda_is_the_cpu()
    _autocast_on_the_cpu()
    _module_states_synced_on_the_cpu()
    if os.environ.get("MOHADIT_KEEP_OFFLOAD") != "1":
        _state_dicts_without_offload()
    sys.argv = [
        "main.py",
        *("--dist-mode", "fsdp", "--mp-dt", "bfloat16", "--use-moun", "False"),
        *("--data-dir-path", directory, "--model-config", os.path.join(directory, "model_config.json")),
        *("--epochs", "2", "--train-batch-sz", "2", "--val-batch-sz", "2", "--num-workers", "0"),
        *("--lr", "1e-3", "--warmup-steps", "2", "--use-scheduler", "True", "--scheduler-type", "cosine"),
        *("--epoch-save-freq", "1", "--dir-path-save", "checkpoints", "--logs-save-dir", "logs"),
        *("--num-gen-steps", "2", "--fid-freq", "0", "--push-hub", "False", "--compile", "False"),
    ]
    runpy.run_path("main.py", run_name="__main__")


if __name__ == "__main__":
    main()
