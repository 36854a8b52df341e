"""FSDP1: ``torch.distributed.fsdp.FullyShardedDataParallel``."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch as TorchBackwardPrefetch,
)
from torch.distributed.fsdp import (
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
)
from torch.distributed.fsdp import (
    ShardingStrategy as TorchShardingStrategy,
)
from torch.distributed.fsdp._runtime_utils import _reshard  # reshard_unit says why
from torch.distributed.fsdp.wrap import CustomPolicy

from fsdp_bridge._names import strip_wrapper_prefixes
from fsdp_bridge.backends._common import (
    broadcast_from_rank0,
    buffer_shapes,
    compile_units,
    move_ignored_to,
    rank0_full_state,
    state_entries,
)
from fsdp_bridge.backends.base import FlatPiece, FlatTensor
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.mapping import no_shard_mesh_shape
from fsdp_bridge.plan import ShardPlan, SyncMethod
from fsdp_bridge.strategy import Backend, BackwardPrefetch, ShardingStrategy

__all__ = ["FSDP1Backend"]

_STRATEGIES = {
    ShardingStrategy.FULL_SHARD: TorchShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP: TorchShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD: TorchShardingStrategy.NO_SHARD,
    ShardingStrategy.HYBRID_SHARD: TorchShardingStrategy.HYBRID_SHARD,
    ShardingStrategy.HYBRID_SHARD_ZERO2: TorchShardingStrategy._HYBRID_SHARD_ZERO2,
}
_PREFETCH = {
    BackwardPrefetch.PRE: TorchBackwardPrefetch.BACKWARD_PRE,
    BackwardPrefetch.POST: TorchBackwardPrefetch.BACKWARD_POST,
    BackwardPrefetch.NONE: None,
}


def _enable_generate(wrapped: FullyShardedDataParallel, model: nn.Module) -> None:
    """Make ``wrapped.generate(...)`` work: it reaches the inner model's ``generate``, which
    calls the inner forward, so the root's own flat parameter (embeddings, final norm, head)
    would stay sharded. Gather only the root's parameters for the call; the wrapped units
    gather themselves in their forward as in training."""
    inner: Callable[..., Any] = getattr(model, "generate")  # noqa: B009 (nn.Module types attributes as Tensor)

    @functools.wraps(inner)
    def generate(*args: Any, **kwargs: Any) -> Any:
        with own_params(wrapped):
            return inner(*args, **kwargs)

    wrapped.__dict__["generate"] = generate


_OWN_GATHERED: set[int] = set()  # units whose own parameters own_params holds gathered now


@contextmanager
def own_params(wrapped: FullyShardedDataParallel) -> Iterator[None]:
    """FSDP1's ``summon_full_params(wrapped, recurse=False)``, re-entrant: migrated code holds it
    around ``generate``, which gathers the same parameters again (torch refuses a nested summon)."""
    if id(wrapped) in _OWN_GATHERED:
        yield
        return
    _OWN_GATHERED.add(id(wrapped))
    try:
        with FullyShardedDataParallel.summon_full_params(wrapped, recurse=False, writeback=False):
            yield
    finally:
        _OWN_GATHERED.discard(id(wrapped))


def reshard_unit(unit: FullyShardedDataParallel) -> None:
    """Free the unit's unsharded flat parameter as FSDP1 does after forward: torch's private
    ``_reshard(unit, handle, True)`` (one handle per unit since torch 2.1; checked on 2.13-2.14), the
    call FSDP1 code makes to drop what an evaluation forward under ``torch.no_grad()`` left gathered
    (pytorch/pytorch issue 117742: the root keeps its parameters gathered for a backward that never
    comes). Skipped as that code skips it: a unit without parameters, a NO_SHARD unit (its flat
    parameter is the only copy), and a unit that has not run yet (nothing gathered, and torch's
    buffers for it do not exist before the first forward)."""
    handle = unit._handle
    if handle is None or unit.sharding_strategy is TorchShardingStrategy.NO_SHARD:
        return
    if getattr(handle.flat_param, "_full_param_padded", None) is None:
        return
    _reshard(unit, handle, True)


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensors inside outputs (tensors, sequences, mappings, ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):  # includes transformers' ModelOutput (an OrderedDict)
        for key in list(obj.keys()):
            obj[key] = cast_floating(obj[key], dtype)
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(cast_floating(v, dtype) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floating(v, dtype) for v in obj)
    return obj


class _MetaMaterializer:
    """FSDP1 ``param_init_fn`` giving meta tensors uninitialised memory on ``device``.

    Unlike ``module.to_empty``, a parameter shared by several modules (tied embeddings)
    becomes one new parameter, so the tie survives; the values come from a checkpoint
    or from ``sync_module_states``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(meta) -> (meta, real)

    def __call__(self, module: nn.Module) -> None:
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in self.done:
                real = nn.Parameter(torch.empty_like(param, device=self.device), requires_grad=param.requires_grad)
                self.done[id(param)] = (param, real)
            module._parameters[name] = self.done[id(param)][1]
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty_like(buf, device=self.device)


class FSDP1Backend:
    backend = Backend.FSDP1
    one_dtype_per_unit = True
    # With use_orig_params=True each parameter is one of the views FSDP1 splits its flat parameter into;
    # torch.nn.utils.parametrize writes the parameter in place when it registers a parametrization, which
    # autograd refuses for such views ("Output 0 of View is a view and its base ... modified inplace";
    # torch 2.13, peft 0.21).
    parametrizes_in_forward = False

    def keeps_swapped_parameters(self, reshards_after_forward: bool, shard_size: int) -> bool:
        # FSDP1 points each original parameter at its flat parameter again only when it reshards;
        # parameters kept unsharded after forward (NO_SHARD, SHARD_GRAD_OP, ZeRO-2, or a shard group of
        # one, where FSDP1 falls back to NO_SHARD) must be the objects it made.
        return reshards_after_forward and shard_size > 1

    def no_shard_mesh_shape(self, world_size: int) -> tuple[int, ...]:
        return no_shard_mesh_shape(Backend.FSDP1, world_size)

    def shard_numel(self, shapes: Sequence[tuple[int, ...]], shard: int, compute_bytes: int) -> int:
        # One flat parameter per unit; with use_orig_params=True each parameter starts at an
        # address aligned to 16 bytes of the compute dtype; the flat parameter is split evenly.
        numel = sum(math.prod(s) for s in shapes)
        if shard == 1:
            return numel
        aligned, total = 16 // compute_bytes, 0
        for shape in shapes:
            if total % aligned:
                total += aligned - total % aligned
            total += math.prod(shape)
        return -(-total // shard)

    def gathers_full_copy(self, shard: int, *, mixed_precision: bool) -> bool:
        # A one-rank flat parameter already is the full parameter, unless it is cast.
        return shard > 1 or mixed_precision

    def shard(self, model: nn.Module, plan: ShardPlan) -> nn.Module:
        precision = plan.precision
        units = {id(m) for m in plan.units}
        mixed_precision = None
        if precision.enabled:
            mixed_precision = MixedPrecision(
                param_dtype=precision.param_dtype,
                reduce_dtype=precision.reduce_dtype,
                buffer_dtype=precision.buffer_dtype,
                cast_forward_inputs=precision.cast_forward_inputs,
                cast_root_forward_inputs=precision.cast_root_forward_inputs,
                # FSDP1 wraps modules of these classes on their own, in full precision (its default, BatchNorm,
                # only when they are asked for: the same modules as on FSDP2)
                _module_classes_to_ignore=tuple({type(m) for m in plan.full_precision_units}),
            )
        compile_units(plan.units, plan.compile_options)  # before sharding, as the table says
        device = plan.device
        full_state = rank0_full_state(model) if plan.sync is SyncMethod.BROADCAST else None
        # A device mesh (1D, or 2D for HYBRID_*) rather than process groups: sharded
        # state dicts then hold DTensors, like FSDP2's.
        kwargs: dict[str, Any] = {"device_mesh": plan.mesh}
        if plan.has_meta:
            kwargs["param_init_fn"] = _MetaMaterializer(device)
        with warnings.catch_warnings():
            # NO_SHARD was chosen deliberately; FSDP1's advice to use DDP is noise here.
            warnings.filterwarnings("ignore", message=".*NO_SHARD.*", category=FutureWarning)
            wrapped = FullyShardedDataParallel(
                model,
                sharding_strategy=_STRATEGIES[plan.strategy],
                auto_wrap_policy=CustomPolicy(lambda m: id(m) in units) if units else None,
                backward_prefetch=_PREFETCH[plan.backward_prefetch],
                forward_prefetch=plan.forward_prefetch > 0,  # the table allows 0 or 1 here
                limit_all_gathers=plan.limit_all_gathers,
                cpu_offload=CPUOffload(offload_params=True) if plan.offload_params else None,
                mixed_precision=mixed_precision,
                sync_module_states=plan.sync is SyncMethod.BACKEND,
                device_id=device,
                # FSDP1 takes ignored parameters only through ignored_states (not with ignored_modules).
                ignored_modules=None if plan.ignored_states else plan.ignored_modules or None,
                ignored_states=plan.ignored_states,  # type: ignore[arg-type]
                use_orig_params=True,
                **kwargs,
            )
        move_ignored_to(plan, device)
        if plan.sync is SyncMethod.BROADCAST:
            broadcast_from_rank0(wrapped, full_state, device)
        if precision.root_output_dtype is not None:
            out_dtype = precision.root_output_dtype
            wrapped.register_forward_hook(lambda _m, _i, out: cast_floating(out, out_dtype))
        if callable(getattr(model, "generate", None)):
            _enable_generate(wrapped, model)
        return wrapped

    def reshard_as_inner_unit(self, module: nn.Module) -> bool:
        return False  # FSDP1 decides it from nesting when it first runs: only a real nested wrapper changes it

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        assert isinstance(model, FullyShardedDataParallel)
        return model.no_sync()

    def defer_all_reduce(self, model: nn.Module) -> AbstractContextManager[None]:
        # The plan refuses it first (the table's defer_all_reduce row); kept as a guard.
        raise ConfigError(
            [Problem("defer_all_reduce", "fsdp1", "a model sharded with backend: fsdp2", "use fsdp_bridge.no_sync")]
        )

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        assert isinstance(model, FullyShardedDataParallel)
        return model.clip_grad_norm_(max_norm, norm_type)

    def own_params(self, module: nn.Module) -> AbstractContextManager[None]:
        return own_params(module) if isinstance(module, FullyShardedDataParallel) else nullcontext()

    def reshard(self, module: nn.Module, *, recurse: bool) -> None:
        if recurse:
            units = FullyShardedDataParallel.fsdp_modules(module)
        else:
            units = [module] if isinstance(module, FullyShardedDataParallel) else []
        for unit in units:
            reshard_unit(unit)

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
        # FSDP1 keeps in-place changes even with writeback=False when the gathered
        # parameter shares storage with the shard (NO_SHARD, world size 1).  The bridge
        # promises they are discarded, so restore this rank's shards (a shard-sized copy).
        if offload_to_cpu and getattr(model, "sharding_strategy", None) is TorchShardingStrategy.NO_SHARD:
            # torch's FSDP1 raises NotImplementedError here; say it before anything is gathered.
            raise ConfigError(
                [
                    Problem(
                        "summon_full_params",
                        "offload_to_cpu=True",
                        "offload_to_cpu=False with NO_SHARD on FSDP1 (torch's FSDP1 does not support it)",
                        "drop offload_to_cpu: with NO_SHARD every rank already holds full parameters "
                        "(copy them with .cpu() inside the context), or use backend fsdp2",
                    )
                ]
            )
        saved = None if writeback else [t.clone() for t in self.local_tensors(model)]
        with FullyShardedDataParallel.summon_full_params(
            model,
            writeback=writeback,
            recurse=True,
            rank0_only=rank0_only,
            offload_to_cpu=offload_to_cpu,
            with_grads=with_grads,
        ):
            yield
        if saved is not None:
            with torch.no_grad():
                for current, old in zip(self.local_tensors(model), saved, strict=True):
                    # .data: a unit's parameters are views of one split of its flat parameter,
                    # which autograd does not let be written in place through the view itself.
                    current.data.copy_(old)

    def local_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        # With use_orig_params=True each original parameter is a view of this rank's
        # part of the flat shard (empty when it lies on another rank).
        return [p.detach() for p in model.parameters()]

    def global_shapes(self, model: nn.Module) -> dict[str, tuple[int, ...]]:
        # The original parameters are views of flat shards; their full shapes live in the flat
        # parameters, and a tied parameter's other names in its shared-parameter records.
        names = {id(m): n for n, m in model.named_modules()}
        shapes: dict[str, tuple[int, ...]] = {}
        for unit in FullyShardedDataParallel.fsdp_modules(model):
            if unit._handle is None:
                continue
            flat = unit._handle.flat_param
            prefix = names[id(unit)]

            def full(relative: str, prefix: str = prefix) -> str:
                return strip_wrapper_prefixes(f"{prefix}.{relative}" if prefix else relative)

            for fqn, shape in zip(flat._fqns, flat._shapes, strict=True):
                shapes[full(fqn)] = tuple(shape)
            for shared in flat._shared_param_infos:
                source = f"{shared.prim_module_name}.{shared.prim_param_name}".lstrip(".")
                shapes[full(f"{shared.module_name}.{shared.param_name}".lstrip("."))] = shapes[full(source)]
        return {**shapes, **buffer_shapes(model, strip_wrapper_prefixes)}

    def load_local(
        self, model: nn.Module, read_rows: Callable[[str, int, int], torch.Tensor | None]
    ) -> set[str] | None:
        # A unit's flat parameter is its parameters flattened and concatenated; this rank holds
        # one contiguous range of it.  FlatParameter._shard_param_infos says, per parameter, which
        # elements of the (flattened) parameter lie in that range and where: read the rows that
        # cover them and copy.  FSDP1's sharded state dict would gather each unit instead.
        names = {id(m): n for n, m in model.named_modules()}
        filled: set[str] = set()
        with torch.no_grad():
            for unit in FullyShardedDataParallel.fsdp_modules(model):
                handle = unit._handle
                if handle is None:
                    continue
                flat = handle.flat_param
                prefix = names[id(unit)]
                for info, fqn, shape in zip(flat._shard_param_infos, flat._fqns, flat._shapes, strict=True):
                    name = strip_wrapper_prefixes(f"{prefix}.{fqn}" if prefix else fqn)
                    filled.add(name)
                    first, last = info.intra_param_start_idx, info.intra_param_end_idx  # inclusive
                    offset = info.offset_in_shard
                    if not info.in_shard or first is None or last is None or offset is None:
                        continue
                    row = math.prod(shape[1:]) if len(shape) else 1
                    start = first // row
                    read = read_rows(name, start, last // row + 1)
                    if read is None:  # not in the checkpoint: left as it is
                        continue
                    rows = read.reshape(-1)
                    piece = rows[first - start * row : last - start * row + 1]
                    flat.data[offset : offset + piece.numel()].copy_(piece)
        return filled

    def export_pieces(self, model: nn.Module) -> dict[str, FlatTensor] | None:
        # The inverse of load_local: each parameter's part of this rank's flat shard is one
        # contiguous range of the flattened parameter, hence one byte range of it in a
        # safetensors file.  FSDP1's sharded state dict would gather every unit and copy out
        # row-chunks instead (1.8x the memory target).
        names = {id(m): n for n, m in model.named_modules()}
        slots, of_param = _flat_slots(model, names)
        # Buffers and parameters outside every unit (ignored modules, scalar parameters) are whole
        # on every rank, and need not agree (ignored modules are not synchronised, BatchNorm
        # statistics are local): rank 0 writes its own, as torch's full state dict holds rank 0's.
        rank = dist.get_rank() if dist.is_initialized() else 0
        orig_dtype = _buffers_state_dicts_restore(model, names)
        out: dict[str, FlatTensor] = {}
        for name, value, is_buffer in state_entries(model):
            clean = strip_wrapper_prefixes(name)
            slot = slots.get(clean)
            if slot is None and not is_buffer and id(value) in of_param:
                slot = of_param[id(value)][1]
            if slot is not None:  # a view of a flat shard, not the whole parameter
                out[clean] = FlatTensor(slot.shape, slot.local.dtype, slot.pieces(slot.held(slot.local)))
                continue
            value = value.detach()
            if is_buffer and clean in orig_dtype:  # FSDP1 cast it to the buffer dtype
                value = value.to(orig_dtype[clean])
            pieces = (FlatPiece(0, value.reshape(-1).contiguous()),) if rank == 0 and value.numel() else ()
            out[clean] = FlatTensor(tuple(value.shape), value.dtype, pieces)
        return out

    def export_optimizer_pieces(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        # With use_orig_params each state tensor of a parameter (Adam's moments) covers the same
        # elements as the parameter's part of the flat shard: the same byte ranges.  FSDP1's
        # optimizer state dict would gather each parameter's state and copy out row-chunks.
        # Ranks hold state only for parameters their shard touches, so what each rank holds is
        # agreed first (one all_gather_object of names, kinds and dtypes).
        names = {id(m): n for n, m in model.named_modules()}
        _, of_param = _flat_slots(model, names)
        mine: dict[str, dict[str, Any]] = {}
        empty: set[str] = set()  # parameters whose state tensors hold no element on this rank
        supported = True
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in of_param:
                    supported = False  # outside every unit: torch's optimizer state dict
                    continue
                fqn, slot = of_param[id(param)]
                for name, value in optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() == 0:
                        mine.setdefault(fqn, {})[name] = ("scalar", value.dtype)
                    elif isinstance(value, torch.Tensor) and value.shape == (slot.numel,):
                        mine.setdefault(fqn, {})[name] = ("flat", value.dtype)
                        if not slot.numel:
                            empty.add(fqn)
                    elif isinstance(value, torch.Tensor):
                        supported = False  # a state not shaped like the parameter (e.g. factored)
                    else:
                        mine.setdefault(fqn, {})[name] = ("value", value)
        every: list[Any] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.all_gather_object(every, (supported, mine, empty))
        else:
            every[0] = (supported, mine, empty)
        if not all(ok for ok, _, _ in every):
            return None
        rank = dist.get_rank() if dist.is_initialized() else 0
        param_of: dict[str, nn.Parameter] = {}
        groups = []
        for group in optimizer.param_groups:
            fqns = [of_param[id(p)][0] for p in group["params"]]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
            param_of.update(zip(fqns, group["params"], strict=True))
        state: dict[str, dict[str, Any]] = {}
        for fqn in _optimizer_state_order(every, {k: of_param[id(p)][1] for k, p in param_of.items()}):
            slot, local = of_param[id(param_of[fqn])][1], optimizer.state.get(param_of[fqn], {})
            held = [r for r, (_, states, _) in enumerate(every) if fqn in states]
            source = held[0]
            if slot.gathered:  # FSDP1 takes values and 0-dim tensors from the last rank holding elements
                source = ([r for r in held if fqn not in every[r][2]] or held)[-1]
            kinds: dict[str, tuple[str, Any]] = every[source][1][fqn]
            if slot.gathered:  # as FSDP1's gather orders them: values, 0-dim tensors, tensors, each by name
                kinds = {
                    n: kinds[n] for kind in ("value", "scalar", "flat") for n in sorted(kinds) if kinds[n][0] == kind
                }
            entry = state[fqn] = {}
            for name, (kind, detail) in kinds.items():
                if kind == "value":
                    entry[name] = detail
                elif kind == "scalar":  # written by the rank it is taken from
                    value = local[name].detach().reshape(1) if rank == source else None
                    entry[name] = FlatTensor((), detail, (FlatPiece(0, value),) if value is not None else ())
                else:
                    pieces = slot.pieces(local[name].detach()) if name in local else ()
                    entry[name] = FlatTensor(slot.shape, detail, pieces)
        return {"state": state, "param_groups": groups}


def _optimizer_state_order(every: list[Any], slots: dict[str, _Slot]) -> list[str]:
    """The parameters with optimizer state on some rank, in the order FSDP1's optimizer state
    dict lists them (torch 2.13 ``_optim_utils``): names sorted, then grouped by unit (units in
    the order of their first name, each unit's names sorted)."""
    names = sorted({fqn for _, states, _ in every for fqn in states})
    units: dict[int, list[str]] = {}
    for fqn in names:
        units.setdefault(id(slots[fqn].local), []).append(fqn)
    return [fqn for unit in units.values() for fqn in unit]


@dataclass(frozen=True)
class _Slot:
    """Where one parameter lies in this rank's flat shard ``local``, and which part of the
    shard this rank writes in a full export (``[lo, hi)``: ranks holding the same shard, under
    NO_SHARD or the replicas of HYBRID_*, split it between them, so each element is written once)."""

    shape: tuple[int, ...]
    local: torch.Tensor
    first: int
    """The element of the flattened parameter where the part held starts."""
    offset: int
    """Where that part starts in the flat shard."""
    numel: int
    """Elements held (0: none)."""
    lo: int
    hi: int
    gathered: bool
    """FSDP1's optimizer state dict gathers this unit's state (its shard group has several ranks)."""

    def held(self, local: torch.Tensor) -> torch.Tensor:
        return local[self.offset : self.offset + self.numel]

    def pieces(self, held: torch.Tensor) -> tuple[FlatPiece, ...]:
        """What this rank writes of ``held``: the part of the parameter (or of a state tensor
        shaped like it) that this rank holds, ``numel`` elements, 1-D."""
        start, stop = max(self.offset, self.lo), min(self.offset + self.numel, self.hi)
        if start >= stop:
            return ()
        return (FlatPiece(self.first + start - self.offset, held[start - self.offset : stop - self.offset]),)


def _flat_slots(model: nn.Module, names: dict[int, str]) -> tuple[dict[str, _Slot], dict[int, tuple[str, _Slot]]]:
    """Clean name -> slot of every parameter inside a unit (tied names each), and
    id(original parameter) -> (its first clean name, slot)."""
    slots: dict[str, _Slot] = {}
    of_param: dict[int, tuple[str, _Slot]] = {}
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        handle = unit._handle
        if handle is None:
            continue
        flat = handle.flat_param
        # The shard's own storage: flat.data points at the unsharded parameter while the unit
        # is unsharded; _local_shard exists from the lazy init on, and until then flat.data
        # is the shard.
        local = getattr(flat, "_local_shard", flat.data).detach()
        index, count = _replica(unit)
        lo, hi = index * local.numel() // count, (index + 1) * local.numel() // count
        gathered = unit.world_size > 1 and unit.sharding_strategy is not TorchShardingStrategy.NO_SHARD
        prefix = names[id(unit)]

        def full(relative: str, prefix: str = prefix) -> str:
            return strip_wrapper_prefixes(f"{prefix}.{relative}" if prefix else relative)

        # The original parameters (kept with use_orig_params), for names FSDP1 did not record.
        params: Sequence[nn.Parameter | None] = flat._params or [None] * len(flat._fqns)
        for info, fqn, shape, param in zip(flat._shard_param_infos, flat._fqns, flat._shapes, params, strict=True):
            first, offset = info.intra_param_start_idx, info.offset_in_shard
            if not info.in_shard or first is None or offset is None:
                first = offset = 0
            numel = (info.numel_in_shard or 0) if info.in_shard else 0
            slot = _Slot(tuple(shape), local, first, offset, numel, lo, hi, gathered)
            slots[full(fqn)] = slot
            if param is not None:
                of_param[id(param)] = (full(fqn), slot)
        for shared in flat._shared_param_infos:
            source = full(f"{shared.prim_module_name}.{shared.prim_param_name}".lstrip("."))
            slots[full(f"{shared.module_name}.{shared.param_name}".lstrip("."))] = slots[source]
    return slots, of_param


def _replica(unit: FullyShardedDataParallel) -> tuple[int, int]:
    """(this rank's index among the ranks that hold the same shard of ``unit``, their number)."""
    strategy = unit.sharding_strategy
    if strategy is TorchShardingStrategy.NO_SHARD:
        return unit.rank, unit.world_size
    if strategy in (TorchShardingStrategy.HYBRID_SHARD, TorchShardingStrategy._HYBRID_SHARD_ZERO2):
        group = unit._inter_node_pg
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _buffers_state_dicts_restore(model: nn.Module, names: dict[int, str]) -> dict[str, torch.dtype]:
    """Clean buffer name -> original dtype, for the buffers FSDP1's state dicts cast back from the
    mixed precision buffer dtype: those under a unit that has buffer mixed precision and a flat
    parameter of its own (its state-dict hook returns early without one, leaving them in the
    compute dtype), unless ignored there.  The export must give the bytes its state dict gives."""
    restore: dict[str, torch.dtype] = {}
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        if unit._handle is None or unit.mixed_precision.buffer_dtype is None:
            continue
        prefix = strip_wrapper_prefixes(names[id(unit)])
        ignored = unit._ignored_buffer_names
        for name, dtype in unit._buffer_name_to_orig_dtype.items():
            if name not in ignored:
                restore[f"{prefix}.{name}" if prefix else name] = dtype
    return restore
