"""FSDP2: ``torch.distributed.fsdp.fully_shard`` (per-parameter DTensor sharding)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils.hooks import RemovableHandle

from fsdp_bridge._names import strip_wrapper_prefixes
from fsdp_bridge.backends._common import (
    broadcast_from_rank0,
    buffer_shapes,
    compile_units,
    move_ignored_to,
    rank0_full_state,
    state_entries,
    whole,
)
from fsdp_bridge.backends.base import FlatPiece, FlatTensor
from fsdp_bridge.backends.float8 import convert_to_float8
from fsdp_bridge.mapping import no_shard_mesh_shape
from fsdp_bridge.plan import ShardPlan, SyncMethod
from fsdp_bridge.strategy import Backend, BackwardPrefetch

__all__ = ["FSDP2Backend", "local_shape"]


def local_shape(shape: tuple[int, ...], shard: int, index: int) -> tuple[int, ...]:
    """The shape of ``to_local()`` of a parameter of ``shape`` on shard ``index`` of ``shard`` ranks.

    FSDP2 splits dim 0 as ``torch.chunk`` does: chunks of ``ceil(d0 / shard)`` rows, the
    last non-empty one shorter, then empty chunks (e.g. 10 rows on 4 ranks: 3, 3, 3, 1; 6 rows
    on 4 ranks: 2, 2, 2, 0).  Each rank's storage is padded to the first chunk's size.
    0-dim parameters are not sharded (the bridge keeps them whole on every rank).
    """
    if not shape or shard == 1:
        return shape
    rows = -(-shape[0] // shard)
    return (max(0, min(rows, shape[0] - index * rows)), *shape[1:])


def _top_level_units(units: list[nn.Module]) -> list[nn.Module]:
    """Units not nested in another unit, in forward (registration) order."""
    nested = {id(c) for u in units for c in u.modules() if c is not u}
    return [u for u in units if id(u) not in nested]


def _set_prefetch(plan: ShardPlan) -> None:
    """Explicit prefetch over the units not nested in another, in registration order (a layer stack's
    forward order): in forward each unit prefetches the next ``plan.forward_prefetch`` units, in backward
    the ``plan.backward_prefetch_units`` registered before it, nearest first. Nested units and the root
    keep FSDP2's implicit prefetch."""
    ordered = [cast(FSDPModule, u) for u in _top_level_units(plan.units)]
    for i, unit in enumerate(ordered):
        if plan.forward_prefetch and ordered[i + 1 : i + 1 + plan.forward_prefetch]:
            unit.set_modules_to_forward_prefetch(ordered[i + 1 : i + 1 + plan.forward_prefetch])
        if plan.backward_prefetch_units and i > 0:
            unit.set_modules_to_backward_prefetch(ordered[max(0, i - plan.backward_prefetch_units) : i][::-1])


_BUFFER_DTYPES = "_fsdp_bridge_buffer_dtypes"
"""Attribute of a module whose floating-point buffers the fsdp2 backend cast to ``buffer_dtype``: name -> the
dtype each had (what its state dict gives back, as FSDP1's does)."""


def _cast_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """FSDP1's ``buffer_dtype`` on FSDP2 (which does not manage buffers): the module's floating-point buffers
    cast once; its state dict gives them in the dtype they had, as FSDP1's state dicts do."""
    cast_from: dict[str, torch.dtype] = {}
    for name, buf in module._buffers.items():
        if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
            cast_from[name] = buf.dtype
            module._buffers[name] = buf.to(dtype)
    if not cast_from:
        return
    setattr(module, _BUFFER_DTYPES, cast_from)

    def back(_: nn.Module, state: dict[str, Any], prefix: str, _metadata: Any) -> None:
        for name, original in cast_from.items():
            value = state.get(prefix + name)
            if isinstance(value, torch.Tensor):
                state[prefix + name] = value.to(original)

    module.register_state_dict_post_hook(back)


def original_buffer_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """State-dict name -> the dtype of each buffer the fsdp2 backend cast to ``buffer_dtype`` (see
    :func:`_cast_buffers`), for writers that read the tensors without ``state_dict()``."""
    out: dict[str, torch.dtype] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, dtype in getattr(module, _BUFFER_DTYPES, {}).items():
            out[f"{prefix}.{name}" if prefix else name] = dtype
    return out


def keep_class_name(module: nn.Module) -> None:
    """FSDP2 gives a sharded module the class ``FSDP<Cls>``; FSDP1 leaves the module's class alone (it wraps
    it). Code that matches modules by class name after sharding (an activation-checkpointing ``check_fn``
    testing ``type(m).__name__``, accelerate's lookups of ``_no_split_modules``) then finds none: the class
    FSDP2 made keeps the name of the user's class (torch makes one per class, so it is named once)."""
    cls = type(module)
    base = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    if cls is not base and cls.__name__ != base.__name__:
        cls.__name__, cls.__qualname__ = base.__name__, base.__qualname__


def register_full_precision_casts(module: nn.Module) -> None:
    """FSDP1's hooks for a module kept in full precision (``MixedPrecision._module_classes_to_ignore``): its
    floating-point positional inputs are cast to float32, and its floating-point outputs back to the dtype
    those inputs had (when a cast happened), so the modules around it keep computing in low precision."""
    from torch.utils._pytree import tree_map

    came_in: dict[str, torch.dtype] = {}

    def to_float32(x: object) -> object:
        if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != torch.float32:
            came_in["dtype"] = x.dtype
            return x.to(torch.float32)
        return x

    def pre(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        came_in.clear()
        return cast(tuple[Any, ...], tree_map(to_float32, args))

    def post(_: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        dtype = came_in.get("dtype")
        if dtype is None:
            return output
        return tree_map(
            lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and torch.is_floating_point(x) else x, output
        )

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def _reshard_after_no_grad_forward(model: nn.Module, _args: object, _output: object) -> None:
    """Free the parameters a unit kept gathered after a forward run without gradients.

    FSDP1 keeps the root's (and SHARD_GRAD_OP's every unit's) gathered parameters after forward for
    the backward that follows, out of sight: the module's parameters stay the same Parameter
    objects. FSDP2 registers the gathered tensors on the modules in their place, and with no
    backward to free them (an evaluation or sampling step under ``torch.no_grad()``) they stay
    there: ``model.parameters()`` are then not the optimizer's DTensors, torch's
    ``get_optimizer_state_dict`` fails (KeyError) and a parameter update such as an EMA writes
    into a copy that is thrown away. Resharding here (what FSDP2's own ``state_dict()`` does first)
    costs one more all-gather of those units at the next forward."""
    if not torch.is_grad_enabled():
        _reshard_units(model)


def _reshard_units(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _reshard_after_generate(model: nn.Module) -> None:
    """Make ``model.generate`` (already wrapped by ``register_fsdp_forward_method``) reshard the
    units it left gathered when it returns: it runs the inner model, not the root's forward, so the
    root's hook (:func:`_reshard_after_no_grad_forward`) does not see it."""
    gathering: Callable[..., Any] = getattr(model, "generate")  # noqa: B009 (nn.Module's __getattr__ types it)

    @functools.wraps(gathering)
    def generate(*args: Any, **kwargs: Any) -> Any:
        try:
            return gathering(*args, **kwargs)
        finally:
            _reshard_units(model)

    setattr(model, "generate", generate)  # noqa: B010 (an instance attribute, as torch's wrapper is)


def _make_parameters_contiguous(model: nn.Module, ignored: Collection[nn.Parameter] | None) -> None:
    """fully_shard refuses a non-contiguous parameter (a ``channels_last`` convolution weight, a transposed
    view): each such parameter gets its values in the default, contiguous layout, in place (the Parameter
    object stays, so references to it still hold). FSDP1 does the same: its parameters become views of the
    flat parameter, contiguous whatever layout they had."""
    skip = {id(p) for p in ignored or ()}
    for param in model.parameters():
        if id(param) not in skip and not param.is_contiguous():
            param.data = param.data.contiguous()


class FSDP2Backend:
    backend = Backend.FSDP2
    one_dtype_per_unit = False  # per-parameter sharding: a unit may mix dtypes
    parametrizes_in_forward = True  # unsharded parameters are tensors of their own

    def keeps_swapped_parameters(self, reshards_after_forward: bool, shard_size: int) -> bool:
        return True  # it registers the unsharded parameters again at every unshard

    def no_shard_mesh_shape(self, world_size: int) -> tuple[int, ...]:
        return no_shard_mesh_shape(Backend.FSDP2, world_size)

    def shard_numel(self, shapes: Sequence[tuple[int, ...]], shard: int, compute_bytes: int) -> int:
        # Each parameter is split on dim 0 (torch.chunk sizes); every rank allocates the
        # largest chunk (rank 0's), the others' shards are views of that padded storage.
        return sum(math.prod(local_shape(s, shard, 0)) for s in shapes)

    def gathers_full_copy(self, shard: int, *, mixed_precision: bool) -> bool:
        return True  # all-gather outputs are separate buffers, even for a one-rank group

    def shard(self, model: nn.Module, plan: ShardPlan) -> nn.Module:
        precision = plan.precision
        full_precision = {id(m) for u in plan.full_precision_units for m in u.modules()}
        if precision.buffer_dtype is not None:
            # FSDP2 does not manage buffers: FSDP1's buffer_dtype is emulated with one cast (not in the units
            # kept in full precision, whose buffers FSDP1 leaves as they are).
            for module in (m for m in model.modules() if id(m) not in full_precision):
                _cast_buffers(module, precision.buffer_dtype)
        _make_parameters_contiguous(model, plan.ignored_params)
        full_state = rank0_full_state(model) if plan.sync is SyncMethod.BROADCAST else None

        unit_mp = MixedPrecisionPolicy(
            param_dtype=precision.param_dtype,
            reduce_dtype=precision.reduce_dtype,
            cast_forward_inputs=precision.cast_forward_inputs,
        )
        root_mp = dataclasses.replace(
            unit_mp,
            output_dtype=precision.root_output_dtype,
            # FSDP1's root casts with either option; FSDP2 has one per fully_shard call.
            cast_forward_inputs=precision.cast_forward_inputs or precision.cast_root_forward_inputs,
        )
        offload_policy = CPUOffloadPolicy(pin_memory=True) if plan.offload_params else OffloadPolicy()
        ignored = plan.ignored_params or None

        kept_full = {id(u) for u in plan.full_precision_units}

        def apply(module: nn.Module, *, is_root: bool) -> None:
            if id(module) in kept_full:  # FSDP1's _module_classes_to_ignore: no mixed precision, casts around it
                register_full_precision_casts(module)
            fully_shard(
                module,
                mesh=plan.mesh,
                reshard_after_forward=plan.reshard_after_forward(is_root=is_root),
                mp_policy=MixedPrecisionPolicy() if id(module) in kept_full else root_mp if is_root else unit_mp,
                offload_policy=offload_policy,
                ignored_params=ignored,
            )
            keep_class_name(module)

        if plan.float8 is not None:  # layers swapped before they are sharded (and compiled)
            convert_to_float8(model, plan.float8, plan.units)
        compile_units(plan.units, plan.compile_options)  # before sharding, as the table says
        for unit in plan.units:  # children before parents
            apply(unit, is_root=False)
        apply(model, is_root=True)
        keeps_gathered = any(plan.reshard_after_forward(is_root=r) is not True for r in (True, False))
        if keeps_gathered:
            model.register_forward_hook(_reshard_after_no_grad_forward)

        _set_prefetch(plan)
        if isinstance(model, FSDPModule) and hasattr(model, "set_reduce_scatter_unused_params"):  # torch 2.13+
            # FSDP1 reduces each unit's whole flat gradient: a parameter no rank used this step gets a zero
            # gradient (the optimizer steps it), and ranks that used different parameters (a routed expert, a
            # branch taken on some ranks) still exchange the same sizes. FSDP2 sends only the gradients there
            # are: its optimizer skipped such parameters, and differing ranks mismatched the reduce-scatter (a
            # size error on gloo, a hang on NCCL).
            model.set_reduce_scatter_unused_params(True)
        if plan.backward_prefetch is BackwardPrefetch.NONE:
            # FSDP1's backward_prefetch=None: each unit's explicit backward-prefetch list holds only itself,
            # gathered already when its backward starts, which turns off FSDP2's implicit prefetch of the
            # next unit (torch 2.6+: an empty list would keep the implicit one).
            for unit in [*plan.units, model]:
                assert isinstance(unit, FSDPModule)
                unit.set_modules_to_backward_prefetch([unit])

        if plan.has_meta and plan.materialize:
            model.to_empty(device=plan.device)
        move_ignored_to(plan, plan.device)
        if plan.sync is SyncMethod.BROADCAST:
            broadcast_from_rank0(model, full_state, plan.device)
        if callable(getattr(model, "generate", None)):
            # generate() calls the inner model's forward, not the root's: without this the
            # root's parameters (embeddings, final norm, head) stay sharded DTensors and the
            # first op mixes them with plain tensors. The hook unshards them for the call.
            register_fsdp_forward_method(model, "generate")
            if keeps_gathered:  # no backward follows generate(): free what it left gathered, as after forward
                _reshard_after_generate(model)
        return model

    def reshard_as_inner_unit(self, module: nn.Module) -> bool:
        if not isinstance(module, FSDPModule):
            return False
        module.set_reshard_after_forward(True, recurse=False)  # also honoured on a root (torch >= 2.8)
        return True

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        return _no_sync(model)

    def defer_all_reduce(self, model: nn.Module) -> AbstractContextManager[None]:
        return _defer_all_reduce(model)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        params = [p for p in model.parameters() if p.grad is not None]
        sharded = [p for p in params if isinstance(p.grad, DTensor)]
        local = [p for p in params if not isinstance(p.grad, DTensor)]  # ignored params
        norms: list[torch.Tensor] = []
        by_mesh: dict[int, list[torch.Tensor]] = {}
        for p in sharded:  # one norm per mesh: tensor-parallel weights live on a (dp, tp) mesh, the rest on dp
            assert isinstance(p.grad, DTensor)
            by_mesh.setdefault(id(p.grad.device_mesh), []).append(p.grad)
        for grads in by_mesh.values():
            # DTensor norms reduce over the shard dimension and stay replicated over
            # the replicate dimension (HSDP), so full_tensor() is the global norm.
            total = _fp32_norm(grads, norm_type)
            norms.append(whole(total) if isinstance(total, DTensor) else total)
        if local:
            norms.append(_fp32_norm([p.grad for p in local if p.grad is not None], norm_type))
        if not norms:
            return torch.tensor(0.0)
        device = norms[0].device  # the gradients' device, where FSDP1 returns the norm (a CUDA loss is stacked with it)
        stacked = torch.stack([n.to(device) for n in norms])
        total_norm = stacked.max() if norm_type == float("inf") else stacked.norm(norm_type)
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        # as FSDP1: the float32 coefficient cast to each gradient's dtype, then multiplied in (one host read per dtype)
        dtypes = {p.grad.dtype for p in params if p.grad is not None}
        scale = {dtype: coef.to(dtype).item() for dtype in dtypes}
        for p in params:
            assert p.grad is not None
            p.grad.mul_(scale[p.grad.dtype])
        # FSDP1 returns the norm in the gradients' promoted dtype (bfloat16 gradients: a bfloat16 norm)
        return total_norm.to(functools.reduce(torch.promote_types, sorted(dtypes, key=str)))

    def reshard(self, module: nn.Module, *, recurse: bool) -> None:
        for unit in module.modules() if recurse else [module]:
            if isinstance(unit, FSDPModule):
                unit.reshard()  # FSDPModule's own: frees what the unit holds gathered, registers the shards

    @contextmanager
    def own_params(self, module: nn.Module) -> Iterator[None]:
        if not isinstance(module, FSDPModule):  # not a unit: FSDP1 gathers nothing either
            yield
            return
        module.unshard()  # what the unit's forward gathers (param_dtype under mixed precision)
        try:
            yield
        finally:
            module.reshard()

    @contextmanager
    def summon_full_params(
        self,
        model: nn.Module,
        *,
        writeback: bool,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
        root: bool = False,
    ) -> Iterator[None]:
        with _full_params(
            model,
            writeback=writeback,
            rank0_only=rank0_only,
            offload_to_cpu=offload_to_cpu,
            with_grads=with_grads,
            root=root,
        ):
            yield

    def local_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        return [p.to_local() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]

    def global_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        params = model.named_parameters(remove_duplicate=False)
        shapes = {strip_wrapper_prefixes(n): tuple(p.shape) for n, p in params}  # a DTensor's shape is the full one
        return {**shapes, **buffer_shapes(model, strip_wrapper_prefixes)}

    def load_local(
        self, model: nn.Module, read_rows: Callable[[str, int, int], torch.Tensor | None]
    ) -> set[str] | None:
        return None  # DTensor state dicts: DCP's Hugging Face reader reads each rank's slices

    def export_pieces(self, model: nn.Module) -> dict[str, FlatTensor] | None:
        # A parameter sharded Shard(0) holds whole rows: one contiguous range of the flattened
        # parameter, hence one byte range of it in a safetensors file.  torch's safetensors path
        # would write these pieces to separate files and assemble them (a second copy on disk
        # and each file's share of the pieces in memory), and cannot assemble integer tensors.
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()  # the sharded parameters registered, as the state-dict hook does
        rank = dist.get_rank() if dist.is_initialized() else 0
        out: dict[str, FlatTensor] = {}
        buffer_dtypes = original_buffer_dtypes(model)
        for name, value, _ in state_entries(model):
            clean = strip_wrapper_prefixes(name)
            if isinstance(value, DTensor):
                rows = _Rows.of(value)
                if rows is None:  # a layout other than FSDP2's (row shards, replicas): DCP's writer
                    return None
                out[clean] = FlatTensor(tuple(value.shape), value.dtype, rows.pieces(value.to_local()))
                continue
            # Buffers and ignored parameters are whole on every rank and need not agree (BatchNorm
            # statistics are local): rank 0 writes its own, as torch's full state dict holds rank 0's.
            value = value.detach().to(buffer_dtypes.get(name, value.dtype))  # a buffer_dtype cast undone
            pieces = (FlatPiece(0, value.reshape(-1).contiguous()),) if rank == 0 and value.numel() else ()
            out[clean] = FlatTensor(tuple(value.shape), value.dtype, pieces)
        return out

    def export_optimizer_pieces(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        # State tensors shaped like their DTensor parameter (Adam's moments) are sharded like it:
        # the same rows, the same byte ranges.  Shaped like get_optimizer_state_dict's: parameters
        # named by their first name, states in the optimizer's order, each state's entries in theirs.
        # Every rank must lay the file out alike (one rank writes each header): the names, kinds
        # and dtypes are compared across ranks first (one all_gather_object).
        fqn_of = {id(p): strip_wrapper_prefixes(n) for n, p in model.named_parameters()}
        rank = dist.get_rank() if dist.is_initialized() else 0
        grouped = [p for group in optimizer.param_groups for p in group["params"]]
        supported = bool(optimizer.state) and all(id(p) in fqn_of for p in grouped)
        # (an empty state: torch's path initialises it with a step; a parameter not in the model)
        state: dict[str, dict[str, Any]] = {}
        layout: list[tuple[str, str, str]] = []
        for param, entries in optimizer.state.items() if supported else ():
            if not isinstance(param, DTensor) or id(param) not in fqn_of:  # an ignored parameter
                supported = False
                break
            rows = _Rows.of(param)
            if rows is None:  # another layout: torch's optimizer state dict
                supported = False
                break
            fqn = fqn_of[id(param)]
            entry = state[fqn] = {}
            for name, value in entries.items():
                if (
                    isinstance(value, DTensor)
                    and value.shape == param.shape
                    and value.placements == param.placements
                    and value.to_local().shape == param.to_local().shape
                ):
                    entry[name] = FlatTensor(tuple(value.shape), value.dtype, rows.pieces(value.to_local()))
                elif isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() == 0:
                    # Adam's step: the same on every rank; rank 0's is written.
                    value = value.detach().reshape(1)
                    entry[name] = FlatTensor((), value.dtype, (FlatPiece(0, value),) if rank == 0 else ())
                elif isinstance(value, torch.Tensor):
                    supported = False  # a state not shaped like the parameter (e.g. factored)
                else:
                    entry[name] = value
                kept = entry.get(name)
                layout.append((fqn, name, str(kept.dtype) if isinstance(kept, FlatTensor) else "value"))
        every: list[Any] = [(supported, layout)]
        if dist.is_initialized():  # every rank gets the same answer
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, (supported, layout))
        if not all(ok and seen == every[0][1] for ok, seen in every):
            return None
        groups = []
        for group in optimizer.param_groups:
            fqns = [fqn_of[id(p)] for p in group["params"]]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
        return {"state": state, "param_groups": groups}


def _fp32_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of ``grads`` together, each gradient's norm taken in float32 whatever its dtype (FSDP1's
    ``clip_grad_norm_`` does so: torch's ``get_total_norm`` would round a bfloat16 gradient's norm to bfloat16)."""
    norms = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Where this rank's shard of a DTensor sharded on dim 0 (FSDP2's ``Shard(0)``, replicated
    over the other mesh dimensions under HSDP) lies in the flattened tensor, and which part of
    it this rank writes in a full export: ranks holding the same rows (replicas) split them."""

    first: int
    """The element of the flattened tensor where the rows held start."""
    numel: int
    """Elements held (0: none; the last shards of an uneven split are short or empty)."""
    lo: int
    hi: int
    """The part of the local shard this rank writes, ``[lo, hi)`` of its elements."""

    @staticmethod
    def of(tensor: DTensor) -> _Rows | None:
        """None unless every placement is ``Replicate()`` or one exact ``Shard(0)``, and the local
        shard is as ``torch.chunk`` splits the rows (FSDP2's layout)."""
        mesh, placements = tensor.device_mesh, tensor.placements
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            return None
        shard_dims = [d for d, p in enumerate(placements) if type(p) is Shard]
        if len(shard_dims) > 1 or any(type(p) not in (Shard, Replicate) for p in placements):
            return None  # _StridedShard (a Shard subclass), Partial, several shard dimensions
        local = tensor.to_local()
        if not local.is_contiguous():
            return None
        shape, row_numel, start_row = tuple(tensor.shape), 1, 0
        if shard_dims:
            placement = placements[shard_dims[0]]
            assert isinstance(placement, Shard)
            if placement.dim != 0 or not shape:
                return None
            count, index = mesh.size(shard_dims[0]), coordinate[shard_dims[0]]
            if tuple(local.shape) != local_shape(shape, count, index):
                return None
            row_numel = math.prod(shape[1:])
            start_row = index * -(-shape[0] // count)
        elif tuple(local.shape) != shape:
            return None
        replica, replicas = 0, 1
        for d, p in enumerate(placements):
            if type(p) is Replicate:
                replica, replicas = replica * mesh.size(d) + coordinate[d], replicas * mesh.size(d)
        numel = local.numel()
        first = start_row * row_numel if numel else 0
        return _Rows(first, numel, replica * numel // replicas, (replica + 1) * numel // replicas)

    def pieces(self, local: torch.Tensor) -> tuple[FlatPiece, ...]:
        """What this rank writes of ``local`` (its shard of the tensor, or of one sharded like it)."""
        if self.lo >= self.hi:
            return ()
        flat = local.detach().reshape(-1)
        return (FlatPiece(self.first + self.lo, flat[self.lo : self.hi]),)


@contextmanager
def _no_sync(model: nn.Module) -> Iterator[None]:
    assert isinstance(model, FSDPModule)
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@contextmanager
def _defer_all_reduce(model: nn.Module) -> Iterator[None]:
    # Every unit (recurse): a unit's reduce-scatter output is kept as a partial sum until a backward
    # with the all-reduce on adds it in and all-reduces once.
    assert isinstance(model, FSDPModule)
    model.set_requires_all_reduce(False)
    try:
        yield
    finally:
        model.set_requires_all_reduce(True)


def _whole(tensor: DTensor) -> torch.Tensor:
    """``tensor`` gathered (a collective), never sharing memory with its shard."""
    full = whole(tensor)
    # Nothing to gather (NO_SHARD, one rank): full_tensor() is the shard itself.
    return full.clone() if full.data_ptr() == tensor.to_local().data_ptr() else full


def _write_shard(full: torch.Tensor, sharded: DTensor) -> None:
    """Copy this rank's part of ``full`` into ``sharded``: each rank takes its own shard of the
    (identical) full tensor, no communication."""
    local = distribute_tensor(full, sharded.device_mesh, sharded.placements, src_data_rank=None)
    sharded.to_local().copy_(local.to_local())


@contextmanager
def _full_params(
    model: nn.Module,
    *,
    writeback: bool,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
    root: bool = False,
) -> Iterator[None]:
    """Swap every DTensor parameter for a full copy; on exit restore (and write back shards).

    ``rank0_only``: every rank takes part in the gather (a collective), only rank 0 swaps.
    ``with_grads``: each copy's ``.grad`` is the full gradient (FSDP1's ``with_grads``).
    ``root``: ``model`` is the sharded model's root, whose first forward may run inside the block.
    """

    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        # a unit left gathered (reshard_after_forward=False after an evaluation forward) holds its unsharded
        # tensors: its sharded parameters registered first, so those are what is swapped and restored
        unit.reshard()
    swapped: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
    full_of: dict[int, nn.Parameter] = {}  # tied parameters share one full copy
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor):
                if id(param) not in full_of:
                    full = _whole(param)  # on every rank, once per parameter (tied ones too)
                    if offload_to_cpu:
                        full = full.cpu()
                    full_of[id(param)] = nn.Parameter(full, requires_grad=param.requires_grad)
                    if with_grads and isinstance(param.grad, DTensor):
                        full_of[id(param)].grad = _whole(param.grad)
                if keep:
                    module._parameters[name] = full_of[id(param)]
                    swapped.append((module, name, param, full_of[id(param)]))
    first: RemovableHandle | None = None
    if root and isinstance(model, FSDPModule) and model._get_fsdp_state()._is_root is None:
        # The model's first forward may run inside the block (an RL loop generating before its first training
        # step): FSDP2's lazy init then reads the parameters, which must be its own DTensors. Just before that
        # forward, put them back for the lazy init, then the full copies again.
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
        yield
    finally:
        if first is not None:
            first.remove()
        written: set[int] = set()
        for module, name, sharded, full in swapped:
            module._parameters[name] = sharded
            if writeback and id(sharded) not in written:
                written.add(id(sharded))
                assert isinstance(sharded, DTensor)
                with torch.no_grad():
                    _write_shard(full.detach(), sharded)
                    if with_grads and isinstance(sharded.grad, DTensor) and full.grad is not None:
                        _write_shard(full.grad, sharded.grad)
        for unit in units:
            # a forward run inside (generation between training steps) left units gathered under
            # reshard_after_forward=False: back to their sharded parameters, as FSDP2 expects before its next step
            unit.reshard()
