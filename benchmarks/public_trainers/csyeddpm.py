"""Drives the FSDP1 DDPM trainer of Leo-AO-99/CSYE7105_FINAL (``fsdp_benchmark.py`` at b996bbc) on CPU ranks, with
no download.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the repository and once in the copy that
``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/csyeddpm.py

The trainer (started with ``mp.spawn``) builds two class-conditional U-Net diffusion models, wraps each in
``FSDP(..., auto_wrap_policy=ModuleWrapPolicy({GroupNorm, Conv2d, Linear}), mixed_precision=MixedPrecision(
param_dtype=float32, reduce_dtype=float16, buffer_dtype=float32), sharding_strategy=FULL_SHARD)`` (every
normalisation, convolution and linear layer a unit of its own), copies the first into the second through
``model.state_dict()`` (FSDP1's default: the full state dict), trains the first with Adam and, after each step,
moves the second towards it over ``parameters()`` (an EMA on each rank's flat shards on FSDP1, on DTensors on
FSDP2). The loss samples its timesteps and noise from torch's global generator, so both runs draw the same ones.
Gradients are reduced in float16: ``verify`` compares the losses with float16's tolerance.

This driver calls its ``fsdp_main(rank, world_size, args)`` on each rank ``torchrun`` started, for one epoch
with a batch of 4 and no checkpoint (the trainer's save runs ``state_dict()`` on rank 0 alone, a collective the
other ranks never join, so its interval is set past the run). What it reads from elsewhere is made here, the same
in both runs:

* the model is the trainer's own CIFAR-10 configuration made small: two resolution levels of 16 and 32 channels
  (attention at the second), one residual block each, 4 groups, 100 timesteps;
* ``torchvision`` (not installed here) is a stub, and the trainer's ``get_cifar10_datasets`` gives 32 seeded
  noise images of 3x32x32 with seeded labels (four steps per rank at 2 ranks);
* the data loader runs without worker processes (the trainer asks for four).
* before the trainer's ``cleanup`` destroys the process group, the EMA model's full parameters are gathered on
  every rank (``fsdp_bridge.summon_full_params``, which takes FSDP1's wrapper and the bridge's model alike) and
  saved from rank 0 to ``ema.pt``, which ``verify`` compares: the EMA is the part of the run the losses do not
  show.

``verify``'s own shims do the rest on a machine without CUDA: the NCCL group is made on gloo, ``set_device`` does
nothing, a GPU index given as a device (``.to(rank)``) is the CPU and the data loader does not pin memory. The
trainer sets ``MASTER_PORT=47239`` itself, so its rank 0 serves the rendezvous store there (not ``torchrun``'s
agent).
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch
from _common import load_trainer, mnist_stub, stub_missing

import fsdp_bridge

IMAGES = 32


def _noise_images(data_augmentation: bool = True, download: bool = True) -> tuple[object, object]:
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(IMAGES, 3, 32, 32, generator=generator) * 2 - 1
    labels = torch.randint(0, 10, (IMAGES,), generator=generator)
    data = torch.utils.data.TensorDataset(images, labels)
    return data, data


def _no_workers(*args: Any, **kwargs: Any) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    return torch.utils.data.DataLoader(*args, **{**kwargs, "num_workers": 0})


def _saving_the_ema(trainer: Any) -> None:
    """The trainer's ``update_ema`` remembers the EMA model; its ``cleanup`` first saves that model's full
    parameters to ``ema.pt`` from rank 0 (gathered on every rank with ``fsdp_bridge.summon_full_params``, which
    takes FSDP1's wrapper and the bridge's model alike), so that ``verify`` compares the EMA both runs made."""
    update_ema, cleanup, seen = trainer.update_ema, trainer.cleanup, {}

    def remembering(model: torch.nn.Module, ema_model: torch.nn.Module, alpha: float = 0.9999) -> None:
        seen["model"], seen["ema"] = model, ema_model
        update_ema(model, ema_model, alpha)

    def saving() -> None:
        for key, module in seen.items():
            with fsdp_bridge.summon_full_params(module):
                full = {name: p.detach().clone() for name, p in module.named_parameters()}
            if int(os.environ["RANK"]) == 0:
                torch.save(full, f"{key}.pt")
        cleanup()

    trainer.update_ema, trainer.cleanup = remembering, saving


def main() -> None:
    stub_missing({"torchvision": mnist_stub(0, 0)})
    trainer = load_trainer("fsdp_benchmark.py", "csye_fsdp_benchmark")
    from ddpm.config import LayerConfig  # the tree's own package, on sys.path once the trainer is loaded

    config = trainer.cifar10_config
    config.num_timesteps = 100
    res = config.res_net_config
    res.base_channels, res.time_emb_dim, res.num_res_blocks, res.num_groups = 16, 16, 1, 4
    res.layers_config = [LayerConfig(channel_mult=1, use_attention=False), LayerConfig(2, True)]
    trainer.get_cifar10_datasets = _noise_images
    trainer.DataLoader = _no_workers
    _saving_the_ema(trainer)
    # the trainer sets MASTER_PORT itself: rank 0 serves the store there, not torchrun's agent
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    args = SimpleNamespace(max_epochs=1, batch_size=4, load_cpt=None, lr=1e-3, interval=1000, s=False)
    torch.manual_seed(0)
    trainer.fsdp_main(rank, world, args)


if __name__ == "__main__":
    main()
