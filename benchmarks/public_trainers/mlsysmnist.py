"""Drives the FSDP1 MNIST trainer of MaxwellJryao/MLSys (``distributed/fsdp.py`` at 58382a1) on CPU ranks, with no
download.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the repository and once in the copy that
``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/mlsysmnist.py

The trainer (the shape of PyTorch's FSDP MNIST tutorial, started by ``torchrun``) builds a two-convolution ``Net``,
wraps it in ``FSDP(model)`` (one unit), trains it with Adadelta and a ``StepLR`` schedule, evaluates it after each
epoch (both sums all-reduced over the ranks) and, with ``--save-model``, takes ``model.state_dict()`` on every
rank (FSDP1's default: the full state dict) and saves it from rank 0 to ``mnist_cnn.pt``, which ``verify``
compares. This driver calls its ``fsdp_main(args)`` with the trainer's argument defaults but a batch of 32, two
epochs and ``--save-model``. What it reads from elsewhere is made here, the same in both runs:

* ``torchvision`` (not installed here) is a stub whose ``datasets.MNIST`` holds 256 training and 64 test images
  of seeded noise with seeded labels (four steps per rank and epoch at 2 ranks), and whose ``transforms`` apply
  ``Normalize`` as torchvision does to a tensor (``ToTensor`` is the identity: the images are tensors already);
* ``torch.cuda.Event`` (it times the training with CUDA events) is a clock that needs no GPU.

``verify``'s own shims do the rest on a machine without CUDA: the NCCL group is made on gloo, ``set_device`` does
nothing, a GPU index given as a device (``.to(rank)``) is the CPU and the data loaders do not pin memory.
Float32 throughout, so the two runs can agree bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from _common import CpuEvent, load_trainer, mnist_stub, stub_missing

TRAIN, TEST = 256, 64


def main() -> None:
    stub_missing({"torchvision": mnist_stub(TRAIN, TEST)})
    if not torch.cuda.is_available():
        torch.cuda.Event = CpuEvent  # type: ignore[assignment,misc]
    args = SimpleNamespace(batch_size=32, test_batch_size=64, epochs=2, lr=1.0, gamma=0.7, seed=1, save_model=True)
    torch.manual_seed(args.seed)
    load_trainer("distributed/fsdp.py", "mlsys_fsdp_trainer").fsdp_main(args)


if __name__ == "__main__":
    main()
