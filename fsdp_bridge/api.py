"""`shard()`: the one call that turns a model into a sharded model on either backend."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from fsdp_bridge._fsdp1_init import materialize_like_fsdp1, reset_parameters_problems
from fsdp_bridge._lora import has_4bit, keep_4bit_weights_in_place, parameter_adapters, quantization_problems
from fsdp_bridge._module_calls import module_clip_grad_norm_, module_no_sync
from fsdp_bridge._optimizer_check import record_replaced
from fsdp_bridge.backends import BackendImpl, backend_inside, get_backend, sharded_by
from fsdp_bridge.backends.float8 import float8_problems
from fsdp_bridge.config import BridgeConfig, carried_ignored, fsdp1_init, with_ignored_names
from fsdp_bridge.distributed import (
    MeshPlan,
    agree,
    average_gradients_over,
    broadcast_in_place,
    build_mesh,
    carried_mesh,
    init_distributed,
    named_hybrid_mesh,
    plan_mesh,
    plan_user_mesh,
    replication_mesh,
)
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.mapping import TranslationReport, full_precision_classes, show_value, translate, unsupported_problems
from fsdp_bridge.plan import ShardPlan, SyncMethod, resolve_plan
from fsdp_bridge.wrap import (
    WrapPlan,
    disable_kv_cache,
    full_precision_modules,
    in_post_order,
    module_names,
    one_dtype_per_unit,
    resolve_ignored,
    resolve_ignored_params,
    resolve_wrap,
)

__all__ = [
    "Bridge",
    "bridge_of",
    "clip_grad_norm_",
    "defer_all_reduce",
    "get_bridge",
    "is_sharded",
    "no_sync",
    "reshard",
    "save_pretrained",
    "shard",
    "summon_full_params",
    "unwrapped",
]

logger = logging.getLogger("fsdp_bridge")
_ATTR = "_fsdp_bridge"
# FSDP2 units made by shard() / wrap_module -> the Bridge of the model they are in
_UNITS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Bridge]] = weakref.WeakKeyDictionary()
# Set by fsdp_bridge.checkpoint.load_pretrained, which loads real weights right after
# shard(): a meta-device model then needs no sync_module_states.
_WEIGHTS_LOADED_AFTER: ContextVar[bool] = ContextVar("fsdp_bridge_weights_loaded_after", default=False)
# Set by fsdp_bridge.estimate.plan_at_scale: shard() runs at a fake world size and the
# model stays on the meta device (nothing is allocated, nothing is broadcast).
_PLAN_ON_META: ContextVar[bool] = ContextVar("fsdp_bridge_plan_on_meta", default=False)


@contextmanager
def weights_loaded_after_shard() -> Iterator[None]:
    """Inside the context, shard() accepts a meta-device model without sync_module_states."""
    token = _WEIGHTS_LOADED_AFTER.set(True)
    try:
        yield
    finally:
        _WEIGHTS_LOADED_AFTER.reset(token)


@contextmanager
def plan_on_meta() -> Iterator[None]:
    """Inside the context, shard() accepts a meta-device model without sync_module_states and
    leaves its shards on the meta device (planning: see fsdp_bridge.estimate.plan_at_scale)."""
    token = _PLAN_ON_META.set(True)
    try:
        with weights_loaded_after_shard():
            yield
    finally:
        _PLAN_ON_META.reset(token)


@dataclass
class Bridge:
    """What :func:`shard` knows about a sharded model; reach it with :func:`get_bridge`."""

    config: BridgeConfig
    impl: BackendImpl
    plan: ShardPlan
    wrap: WrapPlan
    model: nn.Module
    _noted_no_all_reduce: bool = field(default=False, init=False, repr=False)

    @property
    def report(self) -> TranslationReport:
        """What every option became on this backend (also logged once on rank 0)."""
        return self.plan.report

    @property
    def mesh(self) -> DeviceMesh:
        return self.plan.mesh

    @property
    def device(self) -> torch.device:
        return self.plan.device

    def no_sync(self) -> AbstractContextManager[None]:
        """Same as :func:`fsdp_bridge.no_sync` on this bridge's model.

        Returns:
            A context manager: backward inside it accumulates gradients locally.
        """
        return self.impl.no_sync(self.model)

    def defer_all_reduce(self) -> AbstractContextManager[None]:
        """Same as :func:`fsdp_bridge.defer_all_reduce` on this bridge's model.

        Returns:
            A context manager: backward inside it reduce-scatters, the all-reduce across replicas waits.

        Raises:
            ConfigError: the backend cannot defer only the all-reduce (FSDP1).
        """
        if not self.plan.defers_all_reduce():
            if not self._noted_no_all_reduce:
                self._noted_no_all_reduce = True
                logger.info(
                    "defer_all_reduce: mesh %s has no all-reduce across replicas; every micro-batch reduce-scatters "
                    "as without the context",
                    tuple(self.plan.mesh.shape),
                )
            return nullcontext()
        return self.impl.defer_all_reduce(self.model)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Same as :func:`fsdp_bridge.clip_grad_norm_` on this bridge's model (a collective).

        Args:
            max_norm: the largest global gradient norm kept.
            norm_type: which p-norm (``float("inf")`` for the max norm).

        Returns:
            The global norm before clipping, as a tensor.
        """
        return self.impl.clip_grad_norm_(self.model, float(max_norm), float(norm_type))

    def summon_full_params(
        self,
        *,
        writeback: bool = False,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> AbstractContextManager[None]:
        """The backend's gather of full parameters on this bridge's whole model (a collective);
        :func:`fsdp_bridge.summon_full_params` also takes a unit, and gathers with autograd off.

        Args:
            writeback: keep in-place changes made inside the context.
            rank0_only: only rank 0 sees full tensors.
            offload_to_cpu: the full tensors are CPU copies.
            with_grads: the parameters' gradients are full too.

        Returns:
            A context manager inside which parameters are full tensors.

        Raises:
            ConfigError: ``offload_to_cpu`` with FSDP1's NO_SHARD, which torch's FSDP1 does not
                support, or with ``with_grads`` (named with the fix).
        """
        _refuse_offloaded_grads(with_grads, offload_to_cpu)
        return self.impl.summon_full_params(
            self.model,
            writeback=writeback,
            rank0_only=rank0_only,
            offload_to_cpu=offload_to_cpu,
            with_grads=with_grads,
            root=True,
        )

    def local_numel(self) -> int:
        """Parameter elements held by this rank (for FULL_SHARD about 1/N of the model).

        Returns:
            The element count of this rank's shards, padding excluded.
        """
        return sum(t.numel() for t in self.impl.local_tensors(self.model))

    def local_bytes(self) -> int:
        """Parameter bytes held by this rank (sharded state, without padding).

        Returns:
            The bytes of this rank's shards.
        """
        return sum(t.numel() * t.element_size() for t in self.impl.local_tensors(self.model))

    def describe(self) -> str:
        """What :func:`shard` logs once on rank 0.

        Returns:
            The strategy, backend, mesh and device, the units, notes and the translation report.
        """
        lines = [
            f"fsdp_bridge: {self.config.strategy.value} on {self.config.backend.value}, "
            f"mesh {tuple(self.mesh.shape)} on {self.device}",
            f"units: {len(self.wrap.units)} ({self.wrap.source})",
        ]
        lines.extend(f"note: {n}" for n in self.wrap.notes)
        lines.append(self.report.format())
        return "\n".join(lines)


def get_bridge(model: nn.Module) -> Bridge:
    """The :class:`Bridge` of a model returned by :func:`shard`.

    Args:
        model: a model returned by :func:`shard`.

    Returns:
        Its :class:`Bridge`: config, plan, translation report and the backend's operations.

    Raises:
        TypeError: ``model`` was not sharded by :func:`shard`.
    """
    bridge = getattr(model, _ATTR, None)
    if not isinstance(bridge, Bridge):
        raise TypeError(
            f"{type(model).__name__} was not sharded by fsdp_bridge.shard(); call "
            "model = fsdp_bridge.shard(model, config) first and pass the returned model"
        )
    return bridge


def is_sharded(module: object) -> bool:
    """Whether ``module`` is sharded the way FSDP1 code's ``isinstance(module, FSDP)`` asks, on either backend.

    True for a model returned by :func:`shard` (or :func:`wrap_module`) and every unit sharded in it,
    on the fsdp1 backend (FSDP1 wrappers) and on fsdp2 (``FSDPModule`` units), and for any FSDP1
    ``FullyShardedDataParallel`` (made by torch directly too). False for DDP, plain modules and modules
    sharded with torch's own ``fully_shard`` outside :func:`shard`: code that tests
    ``isinstance(m, FSDPModule)`` for those keeps its own FSDP2 path.

    Args:
        module: anything.

    Returns:
        True when ``module`` is such a sharded model or unit.
    """
    if isinstance(module, FullyShardedDataParallel) or isinstance(getattr(module, _ATTR, None), Bridge):
        return True
    return isinstance(module, nn.Module) and module in _UNITS


def bridge_of(module: object) -> Bridge | None:
    """The :class:`Bridge` that ``module`` belongs to: a model returned by :func:`shard` or a unit sharded in it
    (either backend); ``None`` for anything else (plain modules, torch's own FSDP1 or ``fully_shard``).

    Args:
        module: anything.

    Returns:
        The model's :class:`Bridge`, or ``None``.
    """
    if not isinstance(module, nn.Module):
        return None
    unit = _UNITS.get(module)
    bridge = unit() if unit is not None else getattr(module, _ATTR, None)
    return bridge if isinstance(bridge, Bridge) else None


def unwrapped(module: nn.Module) -> nn.Module:
    """What FSDP1 code reads as ``module._fsdp_wrapped_module`` / ``module.module``, on either backend: the
    module an FSDP1 wrapper wraps (the fsdp1 backend's units, or torch's own FSDP1), the ``.module`` of
    DistributedDataParallel's and DataParallel's wrappers (code that unwraps "the wrapper" may be handed either),
    and the module itself for anything else (FSDP2 does not wrap: each unit is the module, an ``FSDPModule``).

    Args:
        module: a unit or model, sharded or not.

    Returns:
        The module inside the wrapper, else ``module``.
    """
    if isinstance(module, FullyShardedDataParallel):
        return cast(nn.Module, module._fsdp_wrapped_module)
    if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return cast(nn.Module, module.module)
    return module


def _has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def shard(model: nn.Module, config: BridgeConfig | None = None, *, mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard ``model`` with ``config`` on its backend and return the module to train.

    Call it on every rank with the same model and config.  The process group is
    initialised from the environment if needed (NCCL on CUDA, gloo on CPU; a
    single-process group when not launched).  Everything that can be checked is checked
    before the first collective; problems raise :class:`ConfigError` on every rank.

    Build the optimizer afterwards from ``model.parameters()``: an optimizer built before
    holds parameters that sharding replaced, and its first ``step()`` raises
    :class:`ConfigError` saying so (on FSDP2 it would otherwise train nothing).  Use
    :func:`no_sync`, :func:`clip_grad_norm_` and :func:`summon_full_params` (or
    ``get_bridge(model)``) the same way on both backends.

    Args:
        model: the model to shard (on CPU, a GPU or the meta device; a PEFT model too).
        config: how to shard it; default ``BridgeConfig()`` (FULL_SHARD on FSDP2).
        mesh: a DeviceMesh to shard over (e.g. the ``"dp"`` sub-mesh of a (dp, tp) mesh);
            default: built from the strategy and the world size.

    Returns:
        The sharded model (FSDP2: ``model`` itself, now an ``FSDPModule``; FSDP1: the
        ``FullyShardedDataParallel`` wrapper), with :func:`get_bridge` available on it.

    Raises:
        ConfigError: on every rank, before any collective, for anything the backend cannot do
            with this config, model or mesh, or when the ranks asked for different things.
        TypeError: ``config`` is not a :class:`BridgeConfig`.
    """
    if isinstance(config, BridgeConfig):
        mesh = carried_mesh(config, mesh)  # a device_mesh or process_group given to BridgeConfig.from_fsdp1
    return shard_module(model, config, mesh)


def _presharded(model: nn.Module) -> list[nn.Module]:
    """The outermost submodules of ``model`` that :func:`fsdp_bridge.wrap_module` sharded already."""
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(getattr(child, _ATTR, None), Bridge):
                out.append(child)
            else:
                visit(child)

    visit(model)
    return out


def _with_fsdp1_ignored(config: BridgeConfig, model: nn.Module) -> BridgeConfig:
    """``config`` with the ignored module or parameter objects given to ``BridgeConfig.from_fsdp1`` added to
    ``ignored_modules`` as their paths in ``model``; objects outside ``model`` are left out, as FSDP1 leaves
    them (they hold none of its parameters)."""
    objects = carried_ignored(config)
    if not objects:
        return config
    inside = {id(m) for m in model.modules()} | {id(p) for p in model.parameters()}
    names = module_names(model, [o for o in objects if id(o) in inside])
    return with_ignored_names(config, names)


def shard_module(
    model: nn.Module, config: BridgeConfig | None, mesh: DeviceMesh | None, *, as_unit: bool = False
) -> nn.Module:
    """:func:`shard` over ``mesh`` as given (not the one ``BridgeConfig.from_fsdp1`` may carry).

    ``as_unit``: ``model`` may be a unit of a larger model (manual wrapping), so whether it reshards after forward
    is decided when it runs, as FSDP1 decides it.  Submodules sharded already by manual wrapping stay as they are
    (units of this one), as FSDP1 leaves nested wrappers when it wraps their parent."""
    config = config or BridgeConfig()
    if not isinstance(config, BridgeConfig):
        raise TypeError(
            f"config must be a BridgeConfig (got {type(config).__name__}); "
            "use fsdp_bridge.load_config(path) or BridgeConfig.from_dict(mapping)"
        )
    config = _with_fsdp1_ignored(config, model)
    if hasattr(model, _ATTR):
        raise ConfigError(
            [Problem("model", type(model).__name__, "a model that is not sharded yet", "call shard() once per model")]
        )
    presharded = _presharded(model)
    wrapped_by = sharded_by(model, skip=presharded)
    if wrapped_by is not None:
        raise ConfigError(
            [
                Problem(
                    "model",
                    f"{type(model).__name__} already wrapped by {wrapped_by}",
                    "a model not yet wrapped by FSDP",
                    "pass the model to shard() instead of wrapping it yourself (for FSDP1 code: "
                    "fsdp_bridge.BridgeConfig.from_fsdp1(**your_fsdp_kwargs))",
                )
            ]
        )

    # FSDP1 computes on the GPU the model's parameters are on (model.to(rank) under mp.spawn, no LOCAL_RANK)
    placed = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)
    device = init_distributed(config.device, placed=placed)
    # Validation is local.  Most checks give the same answer on every rank; some depend on
    # what each rank holds (e.g. a model built on meta), so the outcome is shared with one
    # small all-gather and every rank raises the same error: no rank is left in a collective.
    problems: list[Problem] = []
    failure: BaseException | None = None
    try:
        validated = _validate(model, config, mesh, device, presharded)
    except ConfigError as err:
        problems.extend(err.problems)
    except Exception as err:  # unexpected: re-raised on this rank after the others are told
        failure = err
        problems.append(Problem("shard", type(err).__name__, "no error", str(err)))
    agree(problems, raise_here=failure is None, fingerprint=_fingerprint(model, config, mesh, presharded))
    if failure is not None:
        raise failure
    mesh_plan, ignored, wrap_plan, has_meta, report = validated
    init = fsdp1_init(config)
    if has_meta and init is not None and not _WEIGHTS_LOADED_AFTER.get():
        # FSDP1 code that builds on the meta device and lets FSDP1 initialise each rank (param_init_fn or
        # reset_parameters): the same modules, in FSDP1's order, before sharding; with sync_module_states
        # every rank then takes rank 0's, as FSDP1 does after initialising them.
        named = resolve_ignored_params(model, config.ignored_modules)
        materialize_like_fsdp1(model, wrap_plan.modules, [*ignored, *presharded], named, init[0], device)
        has_meta = False
    # every rank agreed on the config: all of them call it
    if config.sync_module_states and dist.get_world_size() > 1 and _take_rank0_dtypes(model, presharded):
        if get_backend(config.backend).one_dtype_per_unit:  # now with rank 0's dtypes: rank 0's units
            extra, notes = one_dtype_per_unit(model, wrap_plan.modules, [*ignored, *presharded])
            kept = [n for n in wrap_plan.notes if "(FSDP1 needs one dtype per unit)" not in n]
            wrap_plan.dtype_units, wrap_plan.notes = extra, [*kept, *notes]

    units = wrap_plan.modules
    if config.activation_checkpointing:
        units = checkpoint_units(model, units)
        if disable_kv_cache(model):
            wrap_plan.notes.append("use_cache=False: activation checkpointing recomputes layers")
    if wrap_plan.dtype_units:  # sharded on their own, not checkpointed: merged after AC
        units = in_post_order(model, [*units, *wrap_plan.dtype_units])
    full_precision = full_precision_modules(model, full_precision_classes(config), [*ignored, *presharded])
    if full_precision:  # units of their own, as FSDP1 wraps them
        units = in_post_order(model, [*units, *full_precision])

    if keep_4bit_weights_in_place(model):
        wrap_plan.notes.append(
            "bitsandbytes' CPU repacking of 4-bit weights turned off (it rewrites the unsharded weight in place)"
        )

    if mesh is not None and mesh.ndim == 1 and len(mesh_plan.shape) == 2:
        mesh = replication_mesh(mesh)  # first collective: NO_SHARD over the user's 1D mesh
    elif mesh is not None:
        mesh = named_hybrid_mesh(mesh)  # HYBRID over an unnamed 2D mesh, which FSDP2 refuses
    mesh = mesh or build_mesh(mesh_plan, device.type)  # first collective
    named_ignored = resolve_ignored_params(model, config.ignored_modules)
    ignored_ids = {id(p) for m in [*ignored, *presharded] for p in m.parameters()} | {id(p) for p in named_ignored}
    scalars = [p for p in model.parameters() if p.dim() == 0 and id(p) not in ignored_ids]
    plan = resolve_plan(
        config,
        report,
        device=device,
        mesh=mesh,
        units=units,
        ignored_modules=ignored,
        has_meta=has_meta,
        scalar_params=scalars,
        ignored_parameters=named_ignored,
        materialize=not _PLAN_ON_META.get(),
        shard_size=mesh_plan.shard,
    )
    plan.root_is_unit = as_unit
    plan.full_precision_units = full_precision
    if plan.sync is SyncMethod.BROADCAST and (presharded or (as_unit and not plan.has_meta)):
        # Before sharding, whole tensors: rank 0's state dict would gather units sharded already on rank 0
        # alone (they took rank 0's weights when they were sharded), and loading a state dict into an FSDP1
        # unit initialises it as a root, which a later root wrapper over it refuses.
        _broadcast_outside(model, presharded, device)
        plan.sync = SyncMethod.NONE
    if plan.sync is SyncMethod.BROADCAST and dist.is_initialized() and mesh.size() < dist.get_world_size():
        # A mesh over some ranks (the data-parallel group of a model-parallel setup): FSDP1 synchronises
        # within its group, from the group's first rank; rank 0 of the world would hand its own
        # model-parallel slice to every group.  Whole tensors, before sharding, within the mesh.
        # (_validate refused meta-device tensors here: every rank holds real ones.)
        _broadcast_within(model, mesh, device)
        plan.sync = SyncMethod.NONE
    for unit in presharded:
        # A unit sharded as a root before (FSDP1 code wrapping each layer, then the model): nested now, it
        # reshards after forward as its strategy says, as FSDP1's nested wrapper does.
        inner = getattr(unit, _ATTR)
        if inner.config.strategy.reshards_after_forward and inner.config.reshard_after_forward is None:
            inner.impl.reshard_as_inner_unit(unit)
    if presharded:
        paths = {id(m): n for n, m in model.named_modules()}
        wrap_plan.notes.append(
            f"{len(presharded)} units sharded already by fsdp_bridge.wrap_module kept as they are: "
            + ", ".join(paths.get(id(u), "?") for u in presharded[:4])
            + (", ..." if len(presharded) > 4 else "")
        )
    if scalars:
        names = [n for n, p in model.named_parameters() if any(p is q for q in scalars)]
        wrap_plan.notes.append(
            f"0-dim parameters kept whole on every rank, gradients averaged by the bridge "
            f"(neither backend shards scalars): {', '.join(names)}"
        )
    impl = get_backend(config.backend)
    before = list(model.parameters())
    sharded = impl.shard(model, plan)
    record_replaced(before, list(sharded.parameters()))  # an optimizer built before shard() is refused
    average_gradients_over(mesh, scalars)
    bridge = Bridge(config=config, impl=impl, plan=plan, wrap=wrap_plan, model=sharded)
    object.__setattr__(sharded, _ATTR, bridge)
    _UNITS.update({m: weakref.ref(bridge) for m in sharded.modules() if isinstance(m, FSDPModule)})
    if dist.get_rank() == 0 and logger.isEnabledFor(logging.INFO):  # describe() formats the whole report
        logger.info("%s", bridge.describe())
    return sharded


def _fingerprint(
    model: nn.Module, config: BridgeConfig, mesh: DeviceMesh | None, presharded: list[nn.Module]
) -> dict[str, str]:
    """What this rank asked shard() for: every rank must ask for the same (checked in agree())."""
    out = {f"config.{name}": show_value(getattr(config, name)) for name in BridgeConfig.field_names()}
    # Parameters of units sharded already have this rank's shapes (FSDP1's flat views): left out.
    inside = {id(p) for unit in presharded for p in unit.parameters()}
    # With sync_module_states every rank takes rank 0's tensors, dtypes included (FSDP1's param_init_fn
    # gave meta-device ranks rank 0's dtypes): dtypes are not compared then.
    dtype = (lambda p: "rank 0's") if config.sync_module_states else (lambda p: str(p.dtype))
    params = [(n, tuple(p.shape), dtype(p)) for n, p in model.named_parameters() if id(p) not in inside]
    out["model"] = (
        f"{type(model).__name__}, {len(params)} parameters, "
        f"{sum(math.prod(shape) for _, shape, _ in params):,} elements"
    )
    out["model.parameters"] = hashlib.sha256(repr(params).encode()).hexdigest()[:16]
    out["mesh"] = "built by fsdp_bridge" if mesh is None else f"{tuple(mesh.shape)} {mesh.mesh_dim_names}"
    if presharded:
        out["units sharded already"] = str(len(presharded))
    return out


def _take_rank0_dtypes(model: nn.Module, presharded: list[nn.Module]) -> bool:
    """Give this rank's parameters and buffers (outside ``presharded``) rank 0's dtypes; True if any changed.

    FSDP1 code builds the model on the meta device on the other ranks, often in another dtype, and
    its ``param_init_fn`` casts it (``m.to_empty(...); m.to(dtype)``); rank 0's values replace
    theirs anyway.  Tied parameters stay tied.
    """
    inside = {id(t) for unit in presharded for t in (*unit.parameters(), *unit.buffers())}
    tensors = [t for t in (*model.parameters(), *model.buffers()) if id(t) not in inside]
    tensors = list({id(t): t for t in tensors}.values())
    dtypes = [t.dtype for t in tensors]
    shared: list[object] = [dtypes]
    dist.broadcast_object_list(shared, src=0)
    wanted = cast(list[torch.dtype], shared[0])
    if wanted == dtypes or len(wanted) != len(dtypes):  # other names or shapes: refused by agree() already
        return False
    new: dict[int, torch.Tensor] = {}
    for t, target in zip(tensors, wanted, strict=True):
        if t.dtype != target:
            moved = t.detach().to(target)
            new[id(t)] = nn.Parameter(moved, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else moved
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None and id(p) in new:
                module._parameters[key] = cast(nn.Parameter, new[id(p)])
        for key, b in module._buffers.items():
            if b is not None and id(b) in new:
                module._buffers[key] = new[id(b)]
    return bool(new)


def _broadcast_outside(model: nn.Module, presharded: list[nn.Module], device: torch.device) -> None:
    """Rank 0's values of every parameter and buffer of ``model`` outside ``presharded``."""
    inside = {id(t) for unit in presharded for t in (*unit.parameters(), *unit.buffers())}
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if id(t) not in inside:
                broadcast_in_place(t.data, device, src=0)


def _broadcast_within(model: nn.Module, mesh: DeviceMesh, device: torch.device) -> None:
    """The values of the mesh's first rank in every parameter and buffer, on each rank of ``mesh``
    (its last dimension first, then the others: the first rank of each row, then of each column)."""
    with torch.no_grad():
        for dim in reversed(range(mesh.ndim)):
            group = mesh.get_group(dim)
            src = dist.get_process_group_ranks(group)[0]
            for t in (*model.parameters(), *model.buffers()):
                # A tensor-parallel DTensor: its local shard (the group's ranks hold the same slice).
                broadcast_in_place(t.to_local() if isinstance(t, DTensor) else t.data, device, src, group)


def _validate(
    model: nn.Module,
    config: BridgeConfig,
    mesh: DeviceMesh | None,
    device: torch.device,
    presharded: list[nn.Module],
) -> tuple[MeshPlan, list[nn.Module], WrapPlan, bool, TranslationReport]:
    """Every check that needs no communication; raises ConfigError listing all problems."""
    problems = unsupported_problems(config, config.backend, device_type=device.type)
    problems += _presharded_problems(model, config, presharded)
    problems += quantization_problems(model, device.type)  # QLoRA bases: only where bitsandbytes runs 4-bit
    if not any(p.key == "float8" for p in problems):  # where the table allows float8: torchao and the GPU
        problems += float8_problems(config.float8, device)
    mesh_plan = None
    try:
        mesh_plan = plan_user_mesh(config, mesh) if mesh is not None else plan_mesh(config, dist.get_world_size())
    except ConfigError as err:
        problems.extend(err.problems)
    if (
        mesh is not None
        and mesh.size() != dist.get_world_size()
        and config.sync_module_states
        and fsdp1_init(config) is None  # FSDP1 code: every rank initialises its meta tensors first
        and any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    ):
        problems.append(
            Problem(
                "sync_module_states",
                "True, with meta-device tensors and a sub-mesh",
                "real tensors on every rank when the mesh is a sub-mesh",
                "with a sub-mesh each data-parallel group takes its first rank's weights (FSDP1's "
                "meaning), so every rank must build the model on a real device; or load weights after "
                "shard() (fsdp_bridge.load_checkpoint)",
            )
        )
    if (
        mesh_plan is not None
        and has_4bit(model)
        and not get_backend(config.backend).keeps_swapped_parameters(
            config.strategy.reshards_after_forward, mesh_plan.shard
        )
    ):
        problems.append(
            Problem(
                "backend",
                config.backend.value,
                "fsdp2, or fsdp1 resharding after forward over 2+ ranks (FULL_SHARD, HYBRID_SHARD) for a 4-bit base",
                f"bitsandbytes' 4-bit layers replace their weight parameter in forward, which FSDP1 only "
                f"undoes when it reshards; with {config.strategy.name} over a shard group of {mesh_plan.shard} "
                "it keeps the replaced parameters and breaks (state dicts, the next backward): use backend: fsdp2",
            )
        )
    wrapped_parameters = parameter_adapters(model)
    if wrapped_parameters and not get_backend(config.backend).parametrizes_in_forward:
        shown = ", ".join(wrapped_parameters[:3]) + (
            f" and {len(wrapped_parameters) - 3} more" if len(wrapped_parameters) > 3 else ""
        )
        problems.append(
            Problem(
                "backend",
                config.backend.value,
                "fsdp2 for LoRA on parameters (peft's ParamWrapper)",
                f"peft puts LoRA on parameters in {shown} (target_parameters, or the fused expert tensors of a "
                "mixture-of-experts block that target_modules='all-linear' reaches) and re-parametrizes them at "
                "every forward, which FSDP1's flat-parameter views do not allow: use backend: fsdp2, or leave "
                "those parameters out of the LoRA config",
            )
        )
    ignored: list[nn.Module] = []
    try:
        ignored = [m for _, m in resolve_ignored(model, config.ignored_modules)] if config.ignored_modules else []
    except ConfigError as err:
        problems.extend(err.problems)
    wrap_plan = None
    try:
        wrap_plan = resolve_wrap(model, config.wrap, ignored=ignored)
        if get_backend(config.backend).one_dtype_per_unit:
            extra, notes = one_dtype_per_unit(model, wrap_plan.modules, [*ignored, *presharded])
            wrap_plan.dtype_units, wrap_plan.notes = extra, [*wrap_plan.notes, *notes]
    except ConfigError as err:
        problems.extend(err.problems)
    has_meta = _has_meta(model)
    if (
        has_meta
        and config.sync_module_states
        and fsdp1_init(config) is None  # FSDP1 code: every rank, rank 0 included, initialises them first
        and dist.get_rank() == 0
        and not _WEIGHTS_LOADED_AFTER.get()
        and (meta := [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta])
    ):
        problems.append(
            Problem(
                "sync_module_states",
                f"rank 0 holds meta-device tensors ({', '.join(meta[:3])}{', ...' if len(meta) > 3 else ''})",
                "real weights on rank 0: every rank takes rank 0's",
                "build or load the weights on rank 0 before shard(); FSDP1 code whose param_init_fn "
                "initialised them on every rank: run it on rank 0's modules first (for m in model.modules(): "
                "param_init_fn(m)), or build rank 0's model on a real device; or load a checkpoint after "
                "shard() (fsdp_bridge.load_checkpoint)",
            )
        )
    fsdp1_materializes = fsdp1_init(config) is not None  # FSDP1 initialises meta tensors on every rank
    if has_meta and presharded:
        inside = {id(t) for unit in presharded for t in (*unit.parameters(), *unit.buffers())}
        outside_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()) if id(t) not in inside)
        if outside_meta and fsdp1_materializes:
            pass  # FSDP1 materialises the rest when it wraps the parent: shard() does, below
        elif outside_meta:
            problems.append(
                Problem(
                    "model",
                    f"{type(model).__name__} with tensors on the meta device outside its units sharded already",
                    "real tensors outside the modules passed to fsdp_bridge.wrap_module",
                    "build the rest of the model on a real device, or wrap the meta-device modules "
                    "with fsdp_bridge.wrap_module as well",
                )
            )
        has_meta = outside_meta and fsdp1_materializes  # the units were materialised when they were sharded
    if has_meta and fsdp1_materializes:
        if fsdp1_init(config) == (None,):  # FSDP1 calls reset_parameters() on each module with meta tensors
            problems += reset_parameters_problems(model)
    elif has_meta and not config.sync_module_states and not _WEIGHTS_LOADED_AFTER.get():
        problems.append(
            Problem(
                "sync_module_states",
                False,
                "true when the model is on the meta device",
                "set sync_module_states: true and build real weights on rank 0 (or load a checkpoint after shard())",
            )
        )
    if wrap_plan is not None and config.activation_checkpointing and not wrap_plan.units:
        problems.append(
            Problem(
                "activation_checkpointing",
                True,
                "false when there are no wrap units",
                "choose wrap units (wrap: auto or class names) to checkpoint",
            )
        )
    if problems or mesh_plan is None or wrap_plan is None:
        raise ConfigError(problems)
    return mesh_plan, ignored, wrap_plan, has_meta, translate(config, device_type=device.type)


def _presharded_problems(model: nn.Module, config: BridgeConfig, presharded: list[nn.Module]) -> list[Problem]:
    """A model holding units sharded already by manual wrapping: what FSDP1 would refuse too."""
    if not presharded:
        return []
    names = {id(m): n for n, m in model.named_modules()}
    where = ", ".join(names.get(id(u), "?") for u in presharded[:3]) + (", ..." if len(presharded) > 3 else "")
    problems = []
    if config.wrap.mode != "none":
        problems.append(
            Problem(
                "wrap",
                show_value(config.wrap),
                "'none' when submodules are sharded already (by fsdp_bridge.wrap_module: " + where + ")",
                "drop the wrap policy (auto_wrap_policy) from this call: FSDP1 refuses auto-wrapping a model "
                "whose submodules are wrapped already; or pass every unit to fsdp_bridge.wrap_module",
            )
        )
    backends = sorted({get_bridge(u).config.backend.value for u in presharded} - {config.backend.value})
    if backends:
        problems.append(
            Problem(
                "backend",
                config.backend.value,
                f"{', '.join(backends)}, the backend of the submodules sharded already ({where})",
                "shard the units and the model on one backend (the same BridgeConfig.backend)",
            )
        )
    return problems


def checkpoint_units(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Wrap each unit in a non-reentrant checkpoint wrapper; return the wrappers as units."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    ids = {id(u) for u in units}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: id(m) in ids,
    )
    wrappers = {
        id(m._checkpoint_wrapped_module): m for m in model.modules() if hasattr(m, "_checkpoint_wrapped_module")
    }
    return [wrappers.get(id(u), u) for u in units]


def no_sync(model: nn.Module) -> AbstractContextManager[None]:
    """Inside the context, backward accumulates gradients without reducing them across ranks.

    Args:
        model: a model returned by :func:`shard`, or any other module, which gets what its own call
            does: an FSDP1 ``FullyShardedDataParallel`` or a DDP module its ``no_sync()``; a module
            sharded with torch's ``fully_shard`` (or holding such modules) ``set_requires_gradient_sync(False)``,
            True again on exit (under HSDP the all-reduce waits too); another module with a ``no_sync()``
            of its own (thunder's jitted module, ``torch.compile``'s wrapper of a DDP module) that; a plain
            module nothing.

    Returns:
        A context manager; the step after it reduces the accumulated gradients.
    """
    bridge = getattr(model, _ATTR, None)
    if isinstance(bridge, Bridge):
        return bridge.no_sync()
    return module_no_sync(model)


def defer_all_reduce(model: nn.Module) -> AbstractContextManager[None]:
    """Inside the context, backward still reduce-scatters each micro-batch's gradients within its shard
    group, but the all-reduce across replicas (HSDP) waits: the first backward after the context adds
    the kept partial sums in and all-reduces once. Gradient accumulation that keeps the reduce-scatter
    overlapped with backward while cutting the cross-replica traffic to once per step; :func:`no_sync`
    instead communicates nothing until the last micro-batch (and holds unsharded gradients meanwhile).

    On a mesh without replicas (1D: FULL_SHARD, SHARD_GRAD_OP) there is no all-reduce: the context
    changes nothing, noted once in the log. On FSDP2's NO_SHARD mesh ``(world, 1)`` the all-reduce is all
    the communication, so it defers like :func:`no_sync`.

    Args:
        model: a model returned by :func:`shard` on the fsdp2 backend.

    Returns:
        A context manager; run the last micro-batch's backward outside it.

    Raises:
        ConfigError: the model runs on fsdp1, which has no such switch (use :func:`no_sync`).
        TypeError: ``model`` was not sharded by :func:`shard`.
    """
    return get_bridge(model).defer_all_reduce()


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm (over all shards and replicas); return the norm.

    Args:
        model: a model returned by :func:`shard`, or any other module, which gets what its own clipping
            does: an FSDP1 ``FullyShardedDataParallel`` its ``clip_grad_norm_()``; a module sharded with
            torch's ``fully_shard`` torch's ``clip_grad_norm_`` over its DTensor gradients (the global
            norm returned as a plain tensor, as FSDP1 returns it); a module with a ``clip_grad_norm_`` of its
            own (fairscale's ``FullyShardedDataParallel``, a trainer's engine) that method; DDP and plain modules
            ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``.
        max_norm: the largest total norm allowed.
        norm_type: the p of the p-norm (``inf`` for the largest absolute value).

    Returns:
        The total norm before clipping, the same on every rank. For a model :func:`shard` made, FSDP1's
        arithmetic on both backends: each gradient's norm taken in float32, the float32 coefficient cast to
        each gradient's dtype before multiplying, the norm returned in the gradients' dtype (bfloat16
        gradients: a bfloat16 norm).

    Raises:
        ConfigError: ``model`` holds FSDP1 wrappers but is not one (FSDP1 clips from its root only).
    """
    bridge = getattr(model, _ATTR, None)
    if isinstance(bridge, Bridge):
        return bridge.clip_grad_norm_(max_norm, norm_type)
    return module_clip_grad_norm_(model, max_norm, norm_type)


def reshard(module: nn.Module, *, recurse: bool = True) -> None:
    """Free the full parameters a sharded model's units hold gathered, on either backend.

    FSDP1 keeps the root's parameters (SHARD_GRAD_OP: every unit's) gathered after forward for the
    backward that follows; after an evaluation forward under ``torch.no_grad()`` no backward comes,
    and FSDP1 code frees them with torch's private ``_reshard`` (pytorch/pytorch issue 117742) before
    updating the weights in place (an EMA or averaged copy) or to give the memory back. This call is
    that, with public names: on FSDP1 what ``_reshard`` does for each unit that has parameters and is
    not NO_SHARD; on FSDP2 ``FSDPModule.reshard()`` on each unit. The next forward gathers again.
    Local to the rank (no collective), so ranks need not call it together.

    Args:
        module: a model returned by :func:`shard`, a unit of one, or a module sharded by torch
            directly (``FullyShardedDataParallel`` or ``fully_shard``); a module holding no sharded
            unit (DDP, a plain module) has nothing gathered, and nothing is done.
        recurse: every unit under ``module``, itself included; False: ``module``'s own unit only (what
            ``_reshard(unit, unit._handle, True)`` frees), for code that visits each unit itself.

    Returns:
        Nothing.
    """
    backend = backend_inside(module)
    if backend is not None:
        get_backend(backend).reshard(module, recurse=recurse)


def _refuse_offloaded_grads(with_grads: bool, offload_to_cpu: bool) -> None:
    if with_grads and offload_to_cpu:
        raise ConfigError(
            [
                Problem(
                    "summon_full_params",
                    "with_grads=True, offload_to_cpu=True",
                    "with_grads=True without offload_to_cpu (torch's FSDP1 does not support the pair either)",
                    "drop offload_to_cpu and copy what you need with .cpu() inside the context",
                )
            ]
        )


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike[str], **kwargs: Any) -> None:
    """``model.save_pretrained(save_directory, **kwargs)`` (Hugging Face's, PEFT's) with the model's weights whole,
    on a model sharded with ``fully_shard`` too.

    Such a model's ``state_dict()`` holds DTensor shards, which ``save_pretrained`` cannot write: its full state
    dict is gathered here on every rank (a collective: call this on every rank, never under a rank test), rank 0
    writes it (``save_pretrained(..., state_dict=<the full state>)``; PEFT keeps the adapter's keys of it) and
    every rank waits until the files are there, as when each rank wrote its own copy. An FSDP1
    ``FullyShardedDataParallel`` (whose ``save_pretrained`` reaches the module inside it), a call given its own
    ``state_dict=``, a model transformers sharded itself (``config.distributed_config``: its call gathers on every
    rank) and any other module get their own call as written, on every rank.

    Args:
        model: the model whose ``save_pretrained`` writes (a ``PreTrainedModel``, a ``PeftModel``).
        save_directory: where it writes.
        **kwargs: the rest of its arguments (``safe_serialization``, ``max_shard_size``, ...).

    Returns:
        None, once the files are written (on every rank).
    """
    saver: Any = model  # transformers' or PEFT's model: nn.Module's typing knows no save_pretrained
    holds_fsdp2 = any(isinstance(m, FSDPModule) for m in model.modules())
    # transformers' own distributed save (a model it sharded itself) gathers inside the call, on every rank
    own_gather = getattr(getattr(model, "config", None), "distributed_config", None) is not None
    if isinstance(model, FullyShardedDataParallel) or not holds_fsdp2 or "state_dict" in kwargs or own_gather:
        saver.save_pretrained(save_directory, **kwargs)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dist.is_initialized() or dist.get_rank() == 0:
        saver.save_pretrained(save_directory, state_dict=state, **kwargs)
    if dist.is_initialized():
        dist.barrier()


@contextmanager
def summon_full_params(
    model: nn.Module,
    *,
    writeback: bool = False,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    recurse: bool = True,
    with_grads: bool = False,
) -> Iterator[None]:
    """Inside the context, parameters are full tensors, as FSDP1's ``summon_full_params`` gives them.

    The block runs in the caller's grad mode, as FSDP1's does (the gather and the write-back run with
    autograd off): a loss computed inside keeps its graph to the activations it reads. On FSDP2 the
    gathered copies' own gradients are dropped on exit; on the fsdp1 backend they behave as in torch's
    FSDP1 (a backward through them reaches the flat parameter's gradient, or fails with more than one
    rank): keep backward through the gathered parameters themselves out of the block.
    Every rank must enter the context (the gather is a collective), as with FSDP1.

    Args:
        model: a model returned by :func:`shard`, or a part of one, or a module sharded by torch
            directly (``fully_shard`` or ``FullyShardedDataParallel``, as migrated code may hold):
            only the parameters under it are gathered, as FSDP1's static ``summon_full_params``
            does for a submodule.
        writeback: keep in-place changes made inside the context (each rank's shard is updated).
        rank0_only: only rank 0 sees full tensors; the other ranks keep their shards (FSDP1 under
            HYBRID_SHARD also gathers on rank 0 of each shard group, as torch's FSDP1 does).
        offload_to_cpu: the full tensors are CPU copies.
        recurse: False gathers only the parameters ``model``'s own unit manages, not those of the
            units nested in it, as FSDP1's ``recurse=False`` (held around ``model.generate(...)``
            so that the root's embeddings and head are whole while the inner units gather their
            own). On FSDP2 it is the unit's ``unshard()`` / ``reshard()``: the parameters its
            forward gathers (in ``param_dtype`` under mixed precision), so forward may run inside;
            a module that is not a unit gathers nothing, as in FSDP1.
        with_grads: each parameter's ``.grad`` is the full gradient too (read inside, written back
            to the gradient shards with ``writeback``), as FSDP1's ``with_grads``.

    Yields:
        Nothing: inside the block the model's parameters are the full tensors.

    Raises:
        ConfigError: ``writeback=True`` with ``rank0_only=True`` (FSDP1 refuses it too: the other
            ranks would have nothing to write back), ``with_grads=True`` with ``offload_to_cpu=True``
            (as in FSDP1), or ``recurse=False`` with ``writeback``, ``rank0_only``, ``offload_to_cpu``
            or ``with_grads`` (FSDP2's unshard has no such forms), before any collective.
    A module that holds no sharded parameters (DDP, a plain module) is full already: the context
    gathers nothing for it, as FSDP1's static
    ``summon_full_params`` gathers nothing for such a module.

    Parameter objects taken before the context (``params = list(model.parameters())``) are the full
    tensors inside it on the FSDP1 backend (FSDP1 re-points their data); on FSDP2 they stay the sharded
    DTensors: read parameters from the model inside the context (``model.parameters()``,
    ``named_parameters()``, ``module.weight``). A DTensor keeps its data in slots, so the same objects
    cannot be made full tensors (``torch.utils.swap_tensors`` refuses, and re-pointing ``.data`` leaves
    a DTensor).
    """
    flags = {
        "writeback": writeback,
        "rank0_only": rank0_only,
        "offload_to_cpu": offload_to_cpu,
        "with_grads": with_grads,
    }
    if not recurse and any(flags.values()):
        given = ", ".join(f"{k}=True" for k, v in flags.items() if v)
        raise ConfigError(
            [
                Problem(
                    "summon_full_params",
                    f"recurse=False, {given}",
                    "recurse=False with writeback, rank0_only, offload_to_cpu and with_grads left False",
                    "drop recurse=False to gather (and write back, or offload) every parameter under the "
                    "module, or drop the other arguments to gather the unit's own parameters for a forward",
                )
            ]
        )
    _refuse_offloaded_grads(with_grads, offload_to_cpu)
    if writeback and rank0_only:
        raise ConfigError(
            [
                Problem(
                    "summon_full_params",
                    "writeback=True, rank0_only=True",
                    "writeback=True with rank0_only=False, or rank0_only=True without writeback",
                    "drop rank0_only to write changes back, or writeback to read on rank 0 only",
                )
            ]
        )
    bridge = getattr(model, _ATTR, None)
    if isinstance(bridge, Bridge):
        impl, target = bridge.impl, bridge.model
    else:
        backend = backend_inside(model)
        if backend is None:  # DDP or a plain module: its parameters are full already, as FSDP1 leaves them
            yield
            return
        impl, target = get_backend(backend), model
    if not recurse:
        with _gathered_without_grad(impl.own_params(target)):
            yield
        return
    gather = impl.summon_full_params(
        target,
        writeback=writeback,
        rank0_only=rank0_only,
        offload_to_cpu=offload_to_cpu,
        with_grads=with_grads,
        root=isinstance(bridge, Bridge),
    )
    with _gathered_without_grad(gather):
        yield


@contextmanager
def _gathered_without_grad(gather: AbstractContextManager[None]) -> Iterator[None]:
    """``gather`` entered and left with autograd off (torch's FSDP1 writes a unit's parameter views in place on
    the way out, refused under grad mode; the gathered copies are leaves of no graph), the block itself run in
    the caller's grad mode, as FSDP1's ``summon_full_params`` runs it: a loss computed inside from activations
    keeps its graph to them."""
    with torch.no_grad():
        gather.__enter__()
    try:
        yield
    except BaseException as error:
        with torch.no_grad():
            if not gather.__exit__(type(error), error, error.__traceback__):
                raise
    else:
        with torch.no_grad():
            gather.__exit__(None, None, None)
