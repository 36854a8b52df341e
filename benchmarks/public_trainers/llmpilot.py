"""Drives the FSDP1 MNIST trainer of wzy816/llm-pilot (``fsdp_mnist.py`` at c62bfde) on CPU ranks, with no download.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the repository and once in the copy that
``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/llmpilot.py

The trainer (PyTorch's FSDP MNIST tutorial, started with ``mp.spawn``) builds a two-convolution ``Net``, wraps
it in ``FSDP(model, auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=2000))`` (``fc1`` a
unit of its own, the rest the root's), trains it with Adadelta and a ``StepLR`` schedule, evaluates it after each
epoch, counts its parameters on rank 0 (``param.numel()``: the shards on FSDP1, the whole tensors on FSDP2, a
printed number only), then takes ``model.state_dict()`` on every rank (FSDP1's default: the full state dict) and
saves it from rank 0 to ``data/fsdp_mnist.<dt>.pt``, which ``verify`` compares. This driver calls its
``fsdp_main(rank, config)`` on each rank that ``torchrun`` started, with a batch of 32, a test batch of 64, two
epochs and a fixed ``dt``. What it reads from elsewhere is made here, the same in both runs: ``torchvision``
(not installed here) is a stub whose ``datasets.MNIST`` holds 256 training and 64 test images of seeded noise,
and ``wandb`` logs nothing. The trainer sets ``MASTER_PORT=12355`` itself, so its rank 0 serves the
rendezvous store there (not ``torchrun``'s agent). ``verify``'s own shims do the rest on a machine without CUDA
(the NCCL group on gloo, ``set_device`` doing nothing, ``.to(rank)`` the CPU, no pinned memory). Float32
throughout, so the two runs can agree bit for bit.
"""

from __future__ import annotations

import os

import torch
from _common import load_trainer, mnist_stub, stub_missing


def main() -> None:
    stub_missing({"torchvision": mnist_stub(256, 64)})
    nothing = lambda *args, **kwargs: None
    stub_missing({"wandb": {"init": nothing, "log": nothing, "finish": nothing}})
    trainer = load_trainer("fsdp_mnist.py", "llmpilot_fsdp_mnist")
    os.makedirs("data", exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # the trainer sets MASTER_PORT itself (12355): rank 0 serves the store there, not torchrun's agent
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    config = trainer.NetConfig(batch_size=32, test_batch_size=64, epochs=2, seed=1, dt="verify", world_size=world)
    torch.manual_seed(config.seed)
    trainer.fsdp_main(rank, config)


if __name__ == "__main__":
    main()
