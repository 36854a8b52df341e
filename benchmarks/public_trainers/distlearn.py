"""Drives the FSDP1 trainer of arisel117/DistributedLearning (``main_fsdp.py`` at 0d89307) on CPU ranks.

Run by ``fsdp-bridge migrate verify`` under ``torchrun``, once in the repository and once in the copy that
``fsdp-bridge migrate code --fix`` rewrote::

    fsdp-bridge migrate verify <checkout> -- benchmarks/public_trainers/distlearn.py

The trainer fits one ``Linear(10, 10)`` to 1000 random pairs (a ``TensorDataset`` it draws itself after seeding),
wrapped in ``FSDP(module=model, auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=5),
cpu_offload=CPUOffload(offload_params=True))``, with SGD (momentum, weight decay) and a ``StepLR`` schedule, for
its fixed ten epochs, then takes ``model.state_dict()`` on every rank (FSDP1's default: the full state dict; the
save after it is commented out). This driver calls its ``main(args)`` with its argument defaults but a batch of
50 and no loader workers (ten steps per rank and epoch at 2 ranks). It is written for GPUs: here
``torch.cuda.Event`` is a clock that needs no GPU, ``tensor.cuda()`` leaves the tensor on the CPU, and the
offload is off in every run (FSDP1's ``CPUOffload`` and FSDP2's ``CPUOffloadPolicy`` pin host memory, which needs
an accelerator; on a CPU-only run the bridge's ``cpu_offload=True`` offloads nothing by itself);
``verify``'s own shims do the rest (the NCCL group on gloo, ``set_device`` doing nothing, ``.to(rank)`` the CPU).
Float32 throughout, so the two runs can agree bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed.fsdp as fsdp
from _common import CpuEvent, load_trainer

fsdp_cpu_offload = fsdp.CPUOffload


def main() -> None:
    if not torch.cuda.is_available():
        torch.cuda.Event = CpuEvent  # type: ignore[assignment,misc]
        torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
        # nothing to offload to on a CPU: FSDP1 (and FSDP2's CPUOffloadPolicy) would pin host memory, which
        # needs an accelerator; the bridge's cpu_offload=True offloads nothing there by itself
        fsdp.CPUOffload = lambda *args, **kwargs: fsdp_cpu_offload(offload_params=False)  # type: ignore[misc]
        fsdp.CPUOffloadPolicy = lambda *args, **kwargs: fsdp.OffloadPolicy()  # type: ignore[misc]
    args = SimpleNamespace(lr=0.01, epoch=10, batch_size=50, num_workers=0, seed=42)
    load_trainer("main_fsdp.py", "distlearn_fsdp_trainer").main(args)


if __name__ == "__main__":
    main()
