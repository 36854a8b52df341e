"""What each rank of ``fsdp-bridge migrate verify`` runs: the user's script, with every loss recorded.

Started by :func:`fsdp_bridge.migrate.verify.verify` under ``torchrun`` as
``python -m fsdp_bridge.migrate.verify_runner TREE SCRIPT OUT [--seed N] [--cpu-shims] -- ARGS...``:

* the value and dtype of every one-element tensor ``backward()`` is called on (``loss.backward()``,
  ``torch.autograd.backward(loss)``, a ``GradScaler``'s scaled loss) is recorded, in order, on every rank,
  and written to ``OUT/rank{N}.json`` when the script ends (also when it raises or calls ``sys.exit``);
* the global seed is fixed before the script runs (scripts that draw weights unseeded would differ run to
  run);
* the script runs as ``__main__`` with ``TREE`` and its own directory first on ``sys.path``, in ``TREE``,
  with ``sys.argv`` = ``[SCRIPT, *ARGS]``.

``--cpu-shims`` (chosen by ``verify`` when the machine has no accelerator) runs a script written for GPUs on
CPU ranks, identically in both runs: the accelerator reports the CPU (one per rank; torch's own modules,
Dynamo's among them, are told there is none, so ``torch.compile`` runs); NCCL process groups are made on gloo;
a device given as a GPU (an index, a CUDA ``torch.device`` or ``"cuda:N"``: ``tensor.to(rank)``,
``model.to(rank)``, ``module.to_empty(device=rank)``, FSDP1's ``device_id``, the same argument passed on to
``BridgeConfig.from_fsdp1``) is the CPU, and ``init_device_mesh("cuda", ...)`` a mesh of CPU ranks; FSDP1
gets ``device_id=cpu`` when given none; ``torch.cuda.set_device`` does nothing and
``torch.cuda.current_device()`` is the local rank; data loaders do not pin memory;
``scaled_dot_product_attention`` on DTensors sharded over heads runs on each rank's heads (DTensor has no sharding
rule for the CPU kernel); NCCL beside gloo (``"cuda:nccl,cpu:gloo"``) is gloo alone; FSDP1's full state dicts stay
where CPU parameters are (``offload_to_cpu`` crashes torch there); Lightning Fabric's and the Trainer's
``accelerator="cuda"`` is the CPU, where Lightning's FSDP1 strategy runs (Lightning refuses it on CPUs).

This module is run, never imported by the library.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import sys
from typing import Any


def _gpu_index(device: object) -> bool:
    """``device`` names a GPU: an index (``tensor.to(rank)``), a CUDA ``torch.device`` or a ``"cuda[:N]"`` string."""
    if isinstance(device, int):
        return not isinstance(device, bool)
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return type(device).__name__ == "device" and getattr(device, "type", None) == "cuda"


def _install_cpu_shims() -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    import fsdp_bridge

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cpu")  # type: ignore[assignment]

    def available_to_the_script() -> bool:
        # torch's own code sees the machine as it is: Dynamo, told an accelerator is there, asks it for a
        # stream at the first compiled call and fails ("Cannot access accelerator device when none is
        # available"); the script and the libraries it brings see one.
        return not str(sys._getframe(1).f_globals.get("__name__", "")).startswith("torch.")

    torch.accelerator.is_available = available_to_the_script  # type: ignore[assignment]
    torch.accelerator.device_count = lambda: world  # type: ignore[assignment]
    torch.cuda.set_device = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: local_rank  # type: ignore[assignment]

    loader_init = torch.utils.data.DataLoader.__init__

    def unpinned(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        loader_init(self, *args, **kwargs)

    torch.utils.data.DataLoader.__init__ = unpinned  # type: ignore[method-assign]

    init_process_group = dist.init_process_group

    def on_gloo(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        # NCCL alone, or beside gloo for CPU tensors ("cuda:nccl,cpu:gloo")
        on_nccl = backend is None or "nccl" in str(backend)
        return init_process_group("gloo" if on_nccl else backend, *args, **kwargs)

    dist.init_process_group = on_gloo  # type: ignore[assignment]

    tensor_to = torch.Tensor.to

    def index_to_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and _gpu_index(args[0]):
            args = ("cpu", *args[1:])
        if _gpu_index(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return tensor_to(self, *args, **kwargs)

    torch.Tensor.to = index_to_cpu  # type: ignore[assignment]

    module_to = torch.nn.Module.to

    def module_index_to_cpu(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if args and _gpu_index(args[0]):
            args = ("cpu", *args[1:])
        if _gpu_index(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return module_to(self, *args, **kwargs)

    torch.nn.Module.to = module_index_to_cpu  # type: ignore[assignment,method-assign]

    module_to_empty = torch.nn.Module.to_empty

    def to_empty_on_cpu(self: torch.nn.Module, *, device: Any, recurse: bool = True) -> Any:
        # FSDP1's param_init_fn of meta modules: mod.to_empty(device=torch.cuda.current_device(), ...)
        return module_to_empty(self, device="cpu" if _gpu_index(device) else device, recurse=recurse)

    torch.nn.Module.to_empty = to_empty_on_cpu  # type: ignore[method-assign]

    import torch.distributed.device_mesh as device_mesh

    init_device_mesh = device_mesh.init_device_mesh

    def mesh_on_cpu(device_type: str, *args: Any, **kwargs: Any) -> Any:
        # a CUDA mesh the script builds (and hands FSDP1, or fully_shard after --fix): one of CPU ranks
        return init_device_mesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    device_mesh.init_device_mesh = mesh_on_cpu  # type: ignore[assignment]

    fsdp1_init = FullyShardedDataParallel.__init__

    def fsdp1_on_cpu(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("device_id") is None or _gpu_index(kwargs["device_id"]):
            kwargs["device_id"] = torch.device("cpu")
        fsdp1_init(self, *args, **kwargs)

    FullyShardedDataParallel.__init__ = fsdp1_on_cpu  # type: ignore[method-assign]

    from_fsdp1 = fsdp_bridge.BridgeConfig.from_fsdp1.__func__  # type: ignore[attr-defined]

    def from_fsdp1_on_cpu(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if _gpu_index(kwargs.get("device_id")):
            kwargs["device_id"] = torch.device("cpu")
        return from_fsdp1(cls, *args, **kwargs)

    fsdp_bridge.BridgeConfig.from_fsdp1 = classmethod(from_fsdp1_on_cpu)  # type: ignore[assignment,method-assign]

    sdpa = F.scaled_dot_product_attention

    def sdpa_per_rank(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(q, DTensor):
            out = sdpa(q.to_local(), k.to_local(), v.to_local(), *args, **kwargs)
            return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)
        return sdpa(q, k, v, *args, **kwargs)

    F.scaled_dot_product_attention = sdpa_per_rank  # type: ignore[assignment]

    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

    for config in (FullStateDictConfig, FullOptimStateDictConfig):
        # FSDP1's full state dict copied to the CPU from CPU parameters crashes torch (a segfault, or "storage of
        # size 0"): they are on the CPU already
        config.__init__ = _kept_on_cpu(config.__init__)  # type: ignore[method-assign]
    sys.meta_path.insert(0, _LightningOnCpu())


def _kept_on_cpu(init: Any) -> Any:
    def kept(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.offload_to_cpu = False

    return kept


_LIGHTNING_CONNECTORS = {
    "lightning.fabric.connector": "_Connector",
    "lightning_fabric.connector": "_Connector",
    "lightning.pytorch.trainer.connectors.accelerator_connector": "_AcceleratorConnector",
    "pytorch_lightning.trainer.connectors.accelerator_connector": "_AcceleratorConnector",
}
"""The modules of Lightning Fabric's and PyTorch Lightning's Trainer's connectors, and the connector class."""


class _LightningOnCpu:
    """Once Lightning Fabric's or the Trainer's connector is imported: ``accelerator="cuda"`` / ``"gpu"`` is the
    CPU, and Lightning's FSDP1 strategy, refused on CPUs ("FSDP is only available on GPU", "requires a GPU
    accelerator"), runs there as torch's FSDP1 does (on gloo)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in _LIGHTNING_CONNECTORS:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        load = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            load(module)
            _lightning_on_cpu(getattr(module, _LIGHTNING_CONNECTORS[name]))

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _lightning_on_cpu(connector: Any) -> None:
    init = connector.__init__

    def on_cpu(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("accelerator") in ("cuda", "gpu"):
            kwargs["accelerator"] = "cpu"
        init(self, *args, **kwargs)

    check = connector._check_strategy_and_fallback

    def fsdp_on_cpu(self: Any) -> None:
        flag = self._accelerator_flag
        self._accelerator_flag = "cuda" if flag == "cpu" else flag
        try:
            check(self)
        finally:
            self._accelerator_flag = flag

    connector.__init__ = on_cpu
    connector._check_strategy_and_fallback = fsdp_on_cpu


def _compare_rank_copies(notes: dict[str, Any]) -> None:
    """At the outermost ``FSDP(...)`` without ``sync_module_states``, compare the ranks' copies of the
    module's parameters (a sum and a sum of squares each, over the group FSDP1 shards over) and record in
    ``notes["rank_copies"]`` how many differ and the first names: FSDP1 keeps each rank's shard of its own
    copy, FSDP2 cuts the copies elsewhere, so the two runs start from different models. Parameters on the
    meta device (FSDP1 initialises them), of nested FSDP1 units and of ignored modules are left out; two
    small all-reduces that every rank of the group joins, as it joins the constructor."""
    import inspect

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    fsdp1_init = FullyShardedDataParallel.__init__
    signature = inspect.signature(fsdp1_init)
    depth = [0]

    def group_of(bound: dict[str, Any]) -> Any:
        mesh = bound.get("device_mesh")
        if mesh is not None:
            return mesh.get_group(mesh.ndim - 1)  # the shard dimension (HYBRID's last)
        group = bound.get("process_group")
        return group[0] if isinstance(group, tuple) else group  # HYBRID's pair: the shard group

    def compare(module: Any, bound: dict[str, Any]) -> None:
        group = group_of(bound)
        if dist.get_world_size(group) < 2:
            return
        ignored = {id(p) for m in bound.get("ignored_modules") or () for p in m.parameters()}
        ignored |= {id(p) for m in module.modules() if isinstance(m, FullyShardedDataParallel) for p in m.parameters()}
        named = {id(p): (n, p) for n, p in module.named_parameters() if id(p) not in ignored}
        params = list(named.values())
        meta = int(any(p.is_meta for _, p in params))
        device: Any = "cpu"
        if dist.get_backend(group) == "nccl":  # the GPU this rank's FSDP1 computes on, as it picks it
            given = bound.get("device_id")
            placed = next((p.device for _, p in params if p.device.type == "cuda"), None)
            if isinstance(given, int) and not isinstance(given, bool):
                device = torch.device("cuda", given)
            elif isinstance(given, torch.device) and given.type == "cuda":
                device = given if given.index is not None else torch.device("cuda", torch.cuda.current_device())
            else:
                device = placed or torch.device("cuda", torch.cuda.current_device())
        count = torch.tensor([len(params), -len(params), meta], dtype=torch.float64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        if count[0] != -count[1] or not params or count[2] > 0:
            # the ranks hold different modules, or some rank builds on the meta device (FSDP1 initialises it):
            # nothing to compare value by value, and every rank sees that from the same all-reduce
            return
        stats = []
        for _, p in params:
            t = (p.to_local() if isinstance(p, DTensor) else p).detach().to(device, torch.float64)
            stats += [t.sum(), (t * t).sum()]
        values = torch.stack(stats)
        both = torch.cat([values, -values])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        high, low = both[: len(values)], -both[len(values) :]
        differ = [
            name for i, (name, _) in enumerate(params) if high[2 * i] != low[2 * i] or high[2 * i + 1] != low[2 * i + 1]
        ]
        if differ:
            notes["rank_copies"] = {"differ": len(differ), "total": len(params), "names": differ[:3]}

    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        if depth[0] == 0 and dist.is_initialized():
            try:
                bound = signature.bind(self, *args, **kwargs).arguments
            except TypeError:
                bound = None
            strategy = str(bound.get("sharding_strategy")) if bound is not None else ""
            if (
                bound is not None
                and not bound.get("sync_module_states")
                and "module" in bound
                and "NO_SHARD" not in strategy
            ):
                compare(bound["module"], bound)  # (NO_SHARD: every rank keeps its own whole copy on both)
        depth[0] += 1
        try:
            fsdp1_init(self, *args, **kwargs)
        finally:
            depth[0] -= 1

    FullyShardedDataParallel.__init__ = checked  # type: ignore[method-assign]


def _record_losses(out: str, notes: dict[str, Any]) -> None:
    import torch

    losses: list[list[Any]] = []

    def record(tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.numel() == 1 and tensor.is_floating_point():
            value = tensor.detach()
            if hasattr(value, "full_tensor"):  # a DTensor loss (loss parallelism): its global value
                value = value.full_tensor()
            losses.append([float(value.float().item()), str(tensor.dtype).removeprefix("torch.")])

    tensor_backward = torch.Tensor.backward
    autograd_backward = torch.autograd.backward
    inside = [False]  # Tensor.backward calls torch.autograd.backward: record once

    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        record(self)
        inside[0] = True
        try:
            return tensor_backward(self, *args, **kwargs)
        finally:
            inside[0] = False

    def autograd(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if not inside[0]:
            for tensor in tensors if isinstance(tensors, (list, tuple)) else [tensors]:
                record(tensor)
        return autograd_backward(tensors, *args, **kwargs)

    torch.Tensor.backward = backward  # type: ignore[method-assign]
    torch.autograd.backward = autograd  # type: ignore[assignment]

    def write() -> None:
        rank = int(os.environ.get("RANK", "0"))
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"losses": losses, **notes}, f)

    atexit.register(write)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fsdp_bridge.migrate.verify_runner")
    parser.add_argument("tree")
    parser.add_argument("script")
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-shims", action="store_true")
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    ns = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    tree, script = os.path.abspath(ns.tree), os.path.abspath(ns.script)
    sys.path[:0] = list(dict.fromkeys([tree, os.path.dirname(script)]))

    import torch

    notes: dict[str, Any] = {}
    _compare_rank_copies(notes)  # before the shims, which pass FSDP1 a CPU device_id
    if ns.cpu_shims:
        _install_cpu_shims()
    _record_losses(os.path.abspath(ns.out), notes)
    torch.manual_seed(ns.seed)
    os.chdir(tree)
    sys.argv = [script, *script_args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    # The script finished: run the exit handlers (its own, then the recording's), then leave without
    # interpreter finalisation. Objects the script keeps (FSDP modules) still hold the gloo process
    # group, whose destructor then runs while the peers are already gone and can abort the rank
    # ("terminate called without an active exception"): a teardown race, not the script's behaviour.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
