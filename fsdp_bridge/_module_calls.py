"""``no_sync`` and ``clip_grad_norm_`` for modules :func:`fsdp_bridge.shard` did not make.

Migrated code calls ``fsdp_bridge.no_sync(m)`` / ``fsdp_bridge.clip_grad_norm_(m, ...)`` where the
original called ``m.no_sync()`` / ``m.clip_grad_norm_(...)``, and in code written for several backends
``m`` may be anything: an FSDP1 wrapper made by torch directly, a DDP module, a module sharded with
torch's own ``fully_shard``, or a plain module. Each gets what its own call does, so a rewrite never
turns working code into an error:

- ``FullyShardedDataParallel``: its ``no_sync()`` and ``clip_grad_norm_()`` (through ``torch.compile``'s wrapper
  of it too);
- ``DistributedDataParallel``: its ``no_sync()``; ``torch.nn.utils.clip_grad_norm_`` over its parameters;
- torch's ``fully_shard`` (an ``FSDPModule``, or a module holding them): ``set_requires_gradient_sync(False)``,
  True again on exit (under HSDP the all-reduce waits too); torch's clip over the DTensor gradients, the
  global norm returned as a plain tensor (as FSDP1 returns it);
- a module with a ``no_sync()`` of its own (thunder's jitted modules, ``torch.compile``'s wrapper, which hands
  the name to the DDP or FSDP1 module inside it): that ``no_sync()``;
- a module with a ``clip_grad_norm_`` of its own (fairscale's ``FullyShardedDataParallel``, a trainer's engine):
  that ``clip_grad_norm_(max_norm, norm_type)``;
- any other module: nothing to do; ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from fsdp_bridge.errors import ConfigError, Problem

__all__ = ["module_clip_grad_norm_", "module_no_sync"]


def _outermost(model: nn.Module, kind: type | tuple[type, ...]) -> list[nn.Module]:
    """The modules of ``kind`` in ``model`` not nested in another of ``kind``."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, kind):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found


@contextmanager
def _gradient_sync_off(units: list[nn.Module]) -> Iterator[None]:
    for unit in units:
        assert isinstance(unit, FSDPModule)
        unit.set_requires_gradient_sync(False)  # every unit under it too; HSDP's all-reduce as well
    try:
        yield
    finally:
        for unit in units:
            assert isinstance(unit, FSDPModule)
            unit.set_requires_gradient_sync(True)


@contextmanager
def _each(contexts: list[AbstractContextManager[None]]) -> Iterator[None]:
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def module_no_sync(model: nn.Module) -> AbstractContextManager[None]:
    """What ``model``'s own ``no_sync()`` does (see the module's table); never raises for a module.

    Args:
        model: any module.

    Returns:
        A context manager; backward inside it accumulates gradients without reducing them.
    """
    if isinstance(model, (FullyShardedDataParallel, DistributedDataParallel)):
        return model.no_sync()
    if isinstance(model, FSDPModule):
        return _gradient_sync_off([model])
    own = getattr(model, "no_sync", None)
    if callable(own):
        # Another library's module with its own switch (thunder's jitted module; torch.compile's wrapper hands
        # the name to the DDP or FSDP1 module inside it): the original code called that.
        return own()  # type: ignore[no-any-return]
    # A module holding sharded parts (torch's fully_shard or FSDP1 on its children only): each
    # outermost part stops syncing, as each part's own call would make it; else nothing to sync.
    fsdp2 = _outermost(model, FSDPModule)
    fsdp1 = [m for m in _outermost(model, FullyShardedDataParallel) if isinstance(m, FullyShardedDataParallel)]
    contexts: list[AbstractContextManager[None]] = [m.no_sync() for m in fsdp1]
    if fsdp2:
        contexts.append(_gradient_sync_off(fsdp2))
    return _each(contexts) if contexts else nullcontext()


def module_clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """What ``model``'s own gradient clipping does (see the module's table); a collective for sharded
    modules.

    Args:
        model: any module.
        max_norm: the largest total norm allowed.
        norm_type: the p of the p-norm (``inf`` for the largest absolute value).

    Returns:
        The total norm before clipping as a plain tensor (for sharded gradients: the global norm, the
        same on every rank, as FSDP1 returns it).

    Raises:
        ConfigError: ``model`` holds FSDP1 wrappers but is not one (FSDP1 clips from its root only).
    """
    if isinstance(model, FullyShardedDataParallel):
        return model.clip_grad_norm_(max_norm, norm_type)
    if isinstance(inner := getattr(model, "_orig_mod", None), FullyShardedDataParallel):
        # torch.compile's wrapper of an FSDP1 root hands the name to it: the original code called FSDP1's clip
        return inner.clip_grad_norm_(max_norm, norm_type)
    if _outermost(model, FullyShardedDataParallel):
        raise ConfigError(
            [
                Problem(
                    "clip_grad_norm_",
                    f"{type(model).__name__} holding FullyShardedDataParallel modules",
                    "the FullyShardedDataParallel root, or a module with no FSDP1 wrapper inside",
                    "pass the root FullyShardedDataParallel module (FSDP1 clips from its root only; a plain "
                    "clip over its shards would use each rank's local norm)",
                )
            ]
        )
    own = getattr(type(model), "clip_grad_norm_", None)
    if callable(own) and not isinstance(model, (FSDPModule, DistributedDataParallel)):
        # a wrapper with a clipping of its own (fairscale's FullyShardedDataParallel, a trainer's engine): the
        # global norm it knows how to take (torch's clip over its shards would use each rank's local norm)
        return model.clip_grad_norm_(max_norm, norm_type)  # type: ignore[operator]
    params = [p for p in model.parameters() if p.grad is not None]
    sharded = [p for p in params if isinstance(p.grad, DTensor)]
    offloaded = any(p.grad.device.type != p.grad.device_mesh.device_type for p in sharded)  # type: ignore[union-attr]
    meshes = {id(p.grad.device_mesh) for p in sharded}  # type: ignore[union-attr]
    if sharded and (len(sharded) < len(params) or offloaded or len(meshes) > 1):
        # DTensor gradients beside plain ones (parameters left out of fully_shard), or on several meshes
        # (tensor-parallel weights on (dp, tp), the rest on dp): torch's clip cannot mix them; the FSDP2
        # backend's clip takes the norm of each kind and combines them. Gradients in host memory
        # (CPUOffloadPolicy) over a CUDA mesh: it reduces their norm on the mesh's device.
        from fsdp_bridge.backends import get_backend
        from fsdp_bridge.strategy import Backend

        return get_backend(Backend.FSDP2).clip_grad_norm_(model, float(max_norm), float(norm_type))
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    # Over DTensor gradients torch returns a replicated DTensor: the global norm, made a plain tensor.
    return total.full_tensor() if isinstance(total, DTensor) else total
