"""The small module ``migrate code --fix --target torch`` writes into the user's tree (``_fsdp2_helpers.py``).

It holds, in plain torch, what FSDP1 did for the user and ``fully_shard`` does not: the mesh of a sharding
strategy (NO_SHARD's ``(world, 1)`` mesh, HYBRID's 2D one), the wrap policy resolved into a loop over the
modules, ``fully_shard`` bottom-up then on the root with FSDP1's reshard-after-forward rule, buffer casts,
explicit prefetch, rank-0 weight sync, and ``no_sync``.  The decisions mirror what ``fsdp_bridge.shard`` does on
FSDP2 (``fsdp_bridge/backends/fsdp2.py``, ``fsdp_bridge/wrap.py``, ``fsdp_bridge/plan.py``); the test
``tests/test_migrate_target_torch.py`` checks the two agree.
"""

from __future__ import annotations

HELPERS_NAME = "_fsdp2_helpers"
"""The generated module's name (``<name>.py`` beside the files that use it)."""

HELPERS_MARKER = "# Written by `fsdp-bridge migrate code --fix --target torch`."
"""The generated file's first line: a file of that name without it is the user's own, never overwritten."""

HELPERS_SOURCE = f'''{HELPERS_MARKER}
"""Plain PyTorch (FSDP2) set-up written in place of FullyShardedDataParallel's arguments.

FSDP2 (``torch.distributed.fsdp.fully_shard``) has no wrap policy, no sharding-strategy enum and no
``no_sync()``: these functions do what FSDP1 did for them. Only torch is imported; edit freely.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

_NEVER_WRAP = (nn.ModuleList, nn.ModuleDict)  # containers run no forward of their own
_FORCE_LEAF = (nn.MultiheadAttention,)  # size_based_auto_wrap_policy never wraps inside these


def device_type() -> str:
    """The accelerator's device type, or "cpu" on a machine without one."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cpu"


def data_parallel_mesh(strategy: str, device: str | None = None, mesh: DeviceMesh | None = None) -> DeviceMesh:
    """The mesh FSDP1's sharding strategy stands for on FSDP2.

    full_shard / shard_grad_op: 1D over every rank. no_shard: (world, 1), replicate over every rank and
    shard over groups of one (NO_SHARD's meaning; reshard_after_forward=False alone would be ZeRO-2).
    hybrid_shard / hybrid_shard_zero2: 2D (replicate across nodes, shard within a node), from
    LOCAL_WORLD_SIZE. A mesh given to FSDP1 (device_mesh=) is used as it is; for no_shard a 1D one becomes
    (n, 1) over its own ranks (replicated over them only, as FSDP1 did), and a 2D one without dimension names
    (which FSDP1 takes and fully_shard refuses) gets the names (replicate, shard), over the same groups.
    """
    if mesh is not None and strategy == "no_shard" and mesh.ndim == 1:
        return _replicated_over(mesh)
    if mesh is not None and mesh.ndim == 2 and mesh.mesh_dim_names is None:
        groups = [mesh.get_group(0), mesh.get_group(1)]
        return DeviceMesh.from_group(groups, mesh.device_type, mesh=mesh.mesh, mesh_dim_names=("replicate", "shard"))
    if mesh is not None:
        return mesh
    device = device or device_type()
    world = dist.get_world_size()
    if strategy == "no_shard":
        return init_device_mesh(device, (world, 1), mesh_dim_names=("replicate", "shard"))
    if strategy.startswith("hybrid"):
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if per_node <= 0 or world % per_node:
            raise ValueError(
                f"{{strategy}}: LOCAL_WORLD_SIZE={{per_node}} does not divide the world size {{world}}; "
                "pass the 2D mesh yourself: init_device_mesh(device, (replicas, shard_size))"
            )
        return init_device_mesh(device, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device, (world,))


def _replicated_over(mesh: DeviceMesh) -> DeviceMesh:
    """(n, 1) (replicate, shard) over a 1D mesh's ranks: from the mesh itself where torch can (its parent
    mesh kept, for parameters that are DTensors of a sibling dimension), else from its process group."""
    size = mesh.size()
    if hasattr(mesh, "_unflatten"):  # torch's private API, 2.8+
        try:
            return mesh._unflatten(0, (size, 1), ("replicate", "shard"))
        except (RuntimeError, ValueError, NotImplementedError):
            pass
    singles, _ = dist.new_subgroups_by_enumeration([[r] for r in range(dist.get_world_size())])
    ranks = torch.tensor(mesh.mesh.flatten().tolist(), dtype=torch.int).view(size, 1)
    return DeviceMesh.from_group(
        [mesh.get_group(0), singles], mesh.device_type, mesh=ranks, mesh_dim_names=("replicate", "shard")
    )


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
        yield child


def units_of_classes(model: nn.Module, classes: Sequence[type[nn.Module]]) -> list[nn.Module]:
    """transformer_auto_wrap_policy / ModuleWrapPolicy: every submodule of these classes, children first."""
    wanted = tuple(classes)
    return [m for m in _post_order(model) if isinstance(m, wanted)]


def units_of_size(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """size_based_auto_wrap_policy: children first; a module is a unit when the parameters of its subtree
    not already in a unit below it reach min_num_params."""
    units: list[nn.Module] = []

    def visit(module: nn.Module, is_root: bool) -> int:
        wrapped = 0 if isinstance(module, _FORCE_LEAF) else sum(visit(c, False) for c in module.children())
        remainder = sum(p.numel() for p in module.parameters()) - wrapped
        if not is_root and not isinstance(module, _NEVER_WRAP) and remainder >= min_num_params:
            units.append(module)
            return wrapped + remainder
        return wrapped

    visit(model, True)
    return units


def _keep_tied_together(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Drop units that would put one parameter into two fully_shard groups (tied weights): torch refuses
    it, and the parameter falls to a common parent instead."""
    owners: dict[int, set[int]] = {{}}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(id(module))
    shared = [o for o in owners.values() if len(o) > 1]
    kept = list(units)
    changed = True
    while changed:
        changed = False
        for unit in list(kept):
            inside = {{id(m) for m in unit.modules()}}
            if any(o & inside and not o <= inside for o in shared):
                kept.remove(unit)
                changed = True
    return kept


def _top_level(units: list[nn.Module]) -> list[nn.Module]:
    nested = {{id(c) for u in units for c in u.modules() if c is not u}}
    return [u for u in units if id(u) not in nested]


def _reshard_after_no_grad_forward(model: nn.Module, _args: object, _output: object) -> None:
    # A unit that keeps its parameters gathered after forward for the backward that follows frees
    # them when no backward follows (an evaluation under torch.no_grad()), as FSDP1 does.
    if not torch.is_grad_enabled():
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def compute_where_placed(model: nn.Module) -> None:
    """FSDP1 computes on its device_id or on the GPU the model's parameters are on (model.to(rank) under
    mp.spawn, no torch.cuda.set_device); fully_shard on torch.cuda.current_device(), which is GPU 0 on every
    rank unless the code set it: make this rank's GPU the current one, cuda:LOCAL_RANK under a launcher (GPU 0
    where CUDA_VISIBLE_DEVICES shows the process one GPU), else the parameters' GPU; a GPU other than 0 that the
    process made current and put the model on stays (a mapping of its own)."""
    placed = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)
    given = os.environ.get("LOCAL_RANK")
    if (
        placed is not None
        and placed.index not in (None, 0)
        and torch.cuda.is_available()
        and placed.index == torch.cuda.current_device()
    ):
        return  # the process chose this GPU itself (set_device to a mapping of its own) and put the model there
    if given is not None and torch.cuda.is_available():
        local_rank = int(given)
        if local_rank > 0 and torch.cuda.device_count() == 1 and os.environ.get("CUDA_VISIBLE_DEVICES"):
            local_rank = 0
        torch.cuda.set_device(local_rank)
    elif placed is not None and placed.index is not None:
        torch.cuda.set_device(placed)


def shard_model(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    wrap_classes: Sequence[type[nn.Module]] = (),
    wrap_min_num_params: int | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    cast_root_forward_inputs: bool = True,
    buffer_dtype: torch.dtype | None = None,
    offload_policy: OffloadPolicy | None = None,
    forward_prefetch: bool = False,
    backward_prefetch: bool = True,
    sync_module_states: bool = False,
) -> nn.Module:
    """fully_shard on each unit (children first), then on the root, with FSDP1's settings.

    wrap_classes: FSDP1's transformer_auto_wrap_policy / ModuleWrapPolicy classes; wrap_min_num_params:
    its size_based_auto_wrap_policy(min_num_params=); neither: the root is the only unit.

    reshard_after_forward: the units' (FULL_SHARD / HYBRID_SHARD True, SHARD_GRAD_OP False); the root keeps
    its parameters for the backward that follows, as FSDP1's root does; on a shard group of one rank every
    module reshards (nothing is sharded, it frees the working copy). cast_root_forward_inputs: FSDP1's root
    casts its floating-point inputs to param_dtype. buffer_dtype: FSDP1's MixedPrecision(buffer_dtype=),
    one cast (FSDP2 does not manage buffers). forward_prefetch: each top-level unit prefetches the next in
    forward. backward_prefetch=False: FSDP1's backward_prefetch=None (no prefetch in backward).
    sync_module_states: every rank gets rank 0's weights (FSDP1's sync_module_states=True).
    """
    compute_where_placed(model)
    mp_policy = mp_policy or MixedPrecisionPolicy()
    root_policy = MixedPrecisionPolicy(
        param_dtype=mp_policy.param_dtype,
        reduce_dtype=mp_policy.reduce_dtype,
        output_dtype=mp_policy.output_dtype,
        cast_forward_inputs=mp_policy.cast_forward_inputs or cast_root_forward_inputs,
    )
    offload_policy = offload_policy or OffloadPolicy()
    if buffer_dtype is not None:
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.is_floating_point():
                    module._buffers[name] = buf.to(buffer_dtype)
    full_state = None
    if sync_module_states and dist.get_rank() == 0:
        full_state = {{k: v.detach().to("cpu") for k, v in model.state_dict().items()}}
    one_rank_groups = mesh.size(mesh.ndim - 1) == 1
    units = units_of_classes(model, wrap_classes) if wrap_classes else []
    if wrap_min_num_params is not None:
        units = units_of_size(model, wrap_min_num_params)
    units = _keep_tied_together(model, [u for u in units if u is not model])
    for param in model.parameters():  # fully_shard refuses non-contiguous ones (channels_last); FSDP1 flattened them
        if not param.is_contiguous():
            param.data = param.data.contiguous()
    for unit in units:  # children before parents
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward or one_rank_groups,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
        )
    fully_shard(
        model, mesh=mesh, reshard_after_forward=one_rank_groups, mp_policy=root_policy, offload_policy=offload_policy
    )
    if not one_rank_groups:  # the root (and SHARD_GRAD_OP's units) keep parameters gathered after forward
        model.register_forward_hook(_reshard_after_no_grad_forward)
    top = [u for u in _top_level(units) if isinstance(u, FSDPModule)]
    if forward_prefetch:
        for unit, following in zip(top, top[1:]):
            unit.set_modules_to_forward_prefetch([following])
    if not backward_prefetch:
        # Each unit's backward prefetch list holds only itself: no unit is gathered ahead of its turn.
        for unit in [*units, model]:
            if isinstance(unit, FSDPModule):
                unit.set_modules_to_backward_prefetch([unit])
    if sync_module_states:
        set_model_state_dict(
            model,
            full_state or {{}},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False),
        )
        for buf in model.buffers():  # buffers are not sharded, and non-persistent ones are not in the state
            dist.broadcast(buf.data, src=0)
    return model


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """FSDP1's model.clip_grad_norm_(max_norm, norm_type): the global norm over the model's gradients (shards
    and replicas; one norm per mesh, since tensor-parallel weights live on a (dp, tp) mesh and the rest on dp,
    then combined), every gradient scaled by max_norm / norm when it is larger; the norm is returned as a
    plain tensor in the gradients' dtype, as FSDP1 returns it (each gradient's norm taken in float32). A model
    with a clip_grad_norm_ of its own (an FSDP1 wrapper the migration left as it was, compiled or not) gets
    that."""
    own = getattr(model, "clip_grad_norm_", None)
    if callable(own):
        return own(max_norm, norm_type)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    by_mesh: dict[int, list[torch.Tensor]] = {{}}
    for grad in grads:
        by_mesh.setdefault(id(grad.device_mesh) if isinstance(grad, DTensor) else -1, []).append(grad)
    norms = []
    for group in by_mesh.values():
        # each gradient's norm in float32, as FSDP1 takes it (bfloat16 gradients' norms are not rounded)
        each = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in group]
        norm = torch.linalg.vector_norm(torch.stack(each), norm_type)
        if isinstance(norm, DTensor):
            if norm.device.type != norm.device_mesh.device_type:  # CPU offload over a CUDA (NCCL) mesh
                norm = norm.to(norm.device_mesh.device_type)
            norm = norm.full_tensor()
        norms.append(norm)
    device = norms[0].device
    stacked = torch.stack([n.float().to(device) for n in norms])
    total = stacked.max() if norm_type == float("inf") else stacked.norm(norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    scale = {{g.dtype: 0.0 for g in grads}}
    for dtype in scale:  # the coefficient in each gradient dtype, as FSDP1 multiplies (one host read per dtype)
        scale[dtype] = coef.to(dtype).item()
    for grad in grads:
        grad.mul_(scale[grad.dtype])
    dtype = grads[0].dtype
    for other in scale:
        dtype = torch.promote_types(dtype, other)
    return total.to(dtype)  # FSDP1 returns the norm in the gradients' dtype


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler, for FSDP1's ShardedGradScaler: FSDP2's DTensor gradients agree on an overflow over
    their own mesh, and float16 gradients (parameters kept in float16, no mixed precision) are unscaled too, as
    ShardedGradScaler unscales them (torch.amp.GradScaler refuses them)."""

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """FSDP1's model.no_sync(): backward inside accumulates gradients without reducing them across ranks.
    A module that is no FSDP2 module (DDP, ...) gets its own no_sync()."""
    if not isinstance(model, FSDPModule):
        own = getattr(model, "no_sync", None)
        with own() if callable(own) else contextlib.nullcontext():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _whole(tensor: DTensor) -> torch.Tensor:
    """The full tensor (a collective), never sharing memory with the shard; a shard kept in host memory
    (CPU offload over a CUDA mesh) is moved to the mesh's device to be gathered."""
    if tensor.device.type != tensor.device_mesh.device_type:
        tensor = tensor.to(tensor.device_mesh.device_type)
    full = tensor.full_tensor()
    return full.clone() if full.data_ptr() == tensor.to_local().data_ptr() else full


@contextlib.contextmanager
def summon_full_params(
    model: nn.Module,
    *,
    writeback: bool = False,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    recurse: bool = True,
    with_grads: bool = False,
) -> Iterator[None]:
    """FSDP1's FSDP.summon_full_params(model, ...) for a model sharded with fully_shard. Every rank must enter it
    (the gather is a collective); the block runs in the caller's grad mode, as FSDP1's does.

    Inside, the model's parameters are full tensors: new objects, so read them from the model inside the block
    (a list of parameters taken before it still holds the shards). writeback=True copies each rank's part of
    what changed back into its shards on exit; rank0_only: only rank 0 gets full tensors; offload_to_cpu: they
    are CPU copies; with_grads: each one's .grad is the full gradient too. recurse=False is the unit's own
    unshard() / reshard() (what its forward gathers), so forward and generate may run inside. A module that is
    not sharded is full already: nothing is gathered."""
    if not recurse and (writeback or rank0_only or offload_to_cpu or with_grads):
        raise ValueError(
            "summon_full_params: recurse=False with writeback, rank0_only, offload_to_cpu or with_grads; FSDP2's "
            "unshard() has no such forms: drop recurse=False to gather every parameter under the module"
        )
    if writeback and rank0_only:
        raise ValueError("summon_full_params: writeback=True with rank0_only=True (FSDP1 refuses the pair too)")
    if with_grads and offload_to_cpu:
        raise ValueError("summon_full_params: with_grads=True with offload_to_cpu=True (FSDP1 refuses the pair too)")
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not recurse:
        if isinstance(model, FSDPModule):
            model.unshard()
        try:
            yield
        finally:
            if isinstance(model, FSDPModule):
                model.reshard()
        return
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    for unit in units:
        unit.reshard()  # a unit left gathered after a forward: its sharded parameters registered first
    swapped: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
    full_of: dict[int, nn.Parameter] = {{}}  # tied parameters share one full copy
    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if not isinstance(param, DTensor):
                    continue
                if id(param) not in full_of:
                    full = _whole(param)
                    full_of[id(param)] = nn.Parameter(full.cpu() if offload_to_cpu else full, param.requires_grad)
                    if with_grads and isinstance(param.grad, DTensor):
                        full_of[id(param)].grad = _whole(param.grad)
                if keep:
                    module._parameters[name] = full_of[id(param)]
                    swapped.append((module, name, param, full_of[id(param)]))
    first = None
    if isinstance(model, FSDPModule) and model._get_fsdp_state()._is_root is None:
        # The model's first forward may run in the block (generation before the first training step): FSDP2's
        # lazy init then reads the parameters, which must be its own. Put them back for it, then the full copies.
        state = model._get_fsdp_state()

        def before_first_forward(*_: object) -> None:
            if state._is_root is None:
                for module, name, sharded, _full in swapped:
                    module._parameters[name] = sharded
                state._lazy_init()
                for module, name, _sharded, full in swapped:
                    module._parameters[name] = full

        first = model.register_forward_pre_hook(before_first_forward, prepend=True)
    try:
        yield  # in the caller's grad mode, as FSDP1 runs the block (a loss made inside keeps its graph)
    finally:
        if first is not None:
            first.remove()
        written: set[int] = set()
        with torch.no_grad():
            for module, name, sharded, full in swapped:
                module._parameters[name] = sharded
                if writeback and id(sharded) not in written:
                    written.add(id(sharded))
                    _write_shard(full.detach(), sharded)
                    if with_grads and isinstance(sharded.grad, DTensor) and full.grad is not None:
                        _write_shard(full.grad, sharded.grad)
        for unit in units:
            unit.reshard()  # a forward run inside left units gathered: back to their shards


def _write_shard(full: torch.Tensor, sharded: DTensor) -> None:
    """This rank's part of ``full`` copied into ``sharded`` (every rank holds the same full tensor)."""
    local = distribute_tensor(full, sharded.device_mesh, sharded.placements, src_data_rank=None)
    sharded.to_local().copy_(local.to_local())


def _holds_dtensor(state: object) -> bool:
    if isinstance(state, DTensor):
        return True
    if isinstance(state, Mapping):
        return any(_holds_dtensor(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(_holds_dtensor(v) for v in state)
    return False


@contextlib.contextmanager
def _init_step_undone(optim: torch.optim.Optimizer) -> Iterator[None]:
    """torch's set_optimizer_state_dict makes the state of an optimizer without any by stepping it once (zero
    gradients, lr 0); Adam's eps=0 then writes NaN into the parameters (0 / 0) and an optimizer that computes
    its own rate moves them. Their values are put back (FSDP1's load never steps the optimizer)."""
    stepped = not optim.state and all(p.grad is None for g in optim.param_groups for p in g["params"])
    params = list({{id(p): p for g in optim.param_groups for p in g["params"]}}.values()) if stepped else []
    with torch.no_grad():
        saved = [(p.to_local() if isinstance(p, DTensor) else p).clone() for p in params]
    try:
        yield
    finally:
        with torch.no_grad():
            for param, value in zip(params, saved, strict=True):
                (param.to_local() if isinstance(param, DTensor) else param).copy_(value)


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: Mapping[str, Any] | None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """FSDP1's FSDP.optim_state_dict_to_load(model, optim, osd) for code that loads the result afterwards: torch
    has no pure conversion, so this loads the state into the optimizer (set_optimizer_state_dict) and returns
    optim.state_dict(), which a later optim.load_state_dict(...) loads again, changing nothing.

    options None: a full state (FSDP1's default type), or a sharded one where its values are DTensors. As in
    FSDP1, a state holding nothing for some parameters loads (strict=False), and with broadcast_from_rank0 only
    rank 0's is read (the other ranks may pass None). Optimizer groups without parameters (a frozen part's),
    which torch's loader refuses when there are several, are set aside while it loads and then restored."""
    if options is None:
        options = StateDictOptions(full_state_dict=not _holds_dtensor(optim_state_dict))
    options = dataclasses.replace(options, strict=False)
    others = options.broadcast_from_rank0 and dist.is_initialized() and dist.get_rank() != 0
    state = {{}} if optim_state_dict is None or others else dict(optim_state_dict)
    if isinstance(state.get("state"), Mapping):
        # FSDP1's state gives every parameter of a flat parameter one shared `step` tensor: a copy each, or
        # one step() would add 1 to it once per parameter
        seen = set()
        state["state"] = {{key: dict(entry) for key, entry in state["state"].items()}}
        for entry in state["state"].values():
            for name, value in entry.items():
                if isinstance(value, torch.Tensor):
                    if id(value) in seen:
                        entry[name] = value.clone()
                    seen.add(id(value))
    empty = [g for g in optim.param_groups if not g["params"]]
    if len(empty) < 2:
        with _init_step_undone(optim):
            set_optimizer_state_dict(model, optim, state, options=options)
        return optim.state_dict()
    saved_empty = [g for g in state.get("param_groups", ()) if not g.get("params")]
    if "param_groups" in state:
        state["param_groups"] = [g for g in state["param_groups"] if g.get("params")]
    order = [bool(g["params"]) for g in optim.param_groups]
    optim.param_groups = [g for g in optim.param_groups if g["params"]]
    try:
        with _init_step_undone(optim):
            set_optimizer_state_dict(model, optim, state, options=options)
    finally:
        loaded = iter(optim.param_groups)
        optim.param_groups = [next(loaded) if has_params else empty.pop(0) for has_params in order]
    if len(saved_empty) == len([h for h in order if not h]):
        for group, saved in zip([g for g in optim.param_groups if not g["params"]], saved_empty, strict=True):
            group.update({{k: v for k, v in saved.items() if k != "params"}})
    return optim.state_dict()


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike[str], **kwargs: Any) -> None:
    """model.save_pretrained(save_directory, **kwargs) (Hugging Face's, PEFT's) with the weights whole: a
    fully_shard model's state_dict() holds DTensor shards, which save_pretrained cannot write, so its full state
    is gathered on every rank (a collective: call this on every rank), rank 0 writes it (state_dict=; PEFT keeps
    its adapter's keys) and every rank waits for the files. Any other module, or a call given its own
    state_dict=, gets its own call."""
    own_gather = getattr(getattr(model, "config", None), "distributed_config", None) is not None
    if "state_dict" in kwargs or own_gather or not any(isinstance(m, FSDPModule) for m in model.modules()):
        model.save_pretrained(save_directory, **kwargs)
        return
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(save_directory, state_dict=state, **kwargs)
    if dist.is_initialized():
        dist.barrier()


@torch.no_grad()
def ema_update_(ema_model: nn.Module, model: nn.Module, decay: float) -> None:
    """FSDP1's EMA update over _get_fsdp_handles and flat parameters: ema = decay * ema + (1 - decay) * model
    on this rank's shards (no collective). The two models, sharded by the same call, are paired parameter by
    parameter (a DTensor's local shard); each parameter of model that requires gradients is stepped with the
    same torch._foreach_mul_ / _foreach_add_ (a frozen one keeps its average). Buffers are left alone."""
    ema_params, params = list(ema_model.parameters()), list(model.parameters())
    if len(ema_params) != len(params):
        raise ValueError(f"ema_update_: the EMA model has {{len(ema_params)}} parameters and the model "
                         f"{{len(params)}}; shard the EMA copy by the same call as the model")
    averaged, current = [], []
    for ema_param, param in zip(ema_params, params):
        if not param.requires_grad:
            continue
        mine = ema_param.to_local() if isinstance(ema_param, DTensor) else ema_param.data
        theirs = param.to_local() if isinstance(param, DTensor) else param.data
        if mine.shape != theirs.shape:
            raise ValueError(f"ema_update_: a shard of shape {{tuple(mine.shape)}} paired with one of "
                             f"{{tuple(theirs.shape)}}; shard the EMA copy by the same call as the model")
        averaged.append(mine)
        current.append(theirs.to(dtype=mine.dtype))
    if averaged:
        torch._foreach_mul_(averaged, decay)
        torch._foreach_add_(averaged, current, alpha=1 - decay)
'''
