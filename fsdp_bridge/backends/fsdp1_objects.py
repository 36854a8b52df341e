"""FSDP1's state-dict API on either backend: ``state_dict_type``, ``optim_state_dict``, ``full_state_dict`` ...

FSDP1 code that saves and loads through ``FullyShardedDataParallel``'s static methods and state-dict contexts
calls these instead (``fsdp-bridge migrate code --fix`` writes them): on FSDP1 they are FSDP1's own calls, on
FSDP2 the ``torch.distributed.checkpoint.state_dict`` calls that mean the same thing. FSDP1's constructor
arguments are read in :mod:`fsdp_bridge.fsdp1_compat`.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import weakref
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from fsdp_bridge._optim_state import init_step_undone
from fsdp_bridge.backends._common import whole
from fsdp_bridge.errors import ConfigError, Problem

__all__ = [
    "full_optim_state_dict",
    "full_state_dict",
    "load_sharded_optimizer_state_dict",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "set_state_dict_type",
    "state_dict_options",
    "state_dict_type",
]


def state_dict_options(
    state_dict_type: object,
    state_dict_config: object = None,
    optim_state_dict_config: object = None,
    *,
    optimizer: bool = False,
    load: bool = False,
    strict: bool = True,
    model: nn.Module | None = None,
) -> Any:
    """torch's ``StateDictOptions`` meaning what FSDP1's ``state_dict_type`` settings meant.

    ``migrate code --fix`` writes this where a ``with FSDP.state_dict_type(model, sd_type, cfg, optim_cfg):``
    block's type or configs are known only at run time: the block's ``model.state_dict()`` becomes
    ``get_model_state_dict(model, options=state_dict_options(sd_type, cfg, optim_cfg))``, which works on
    FSDP1 and FSDP2 models alike.

    Args:
        state_dict_type: a ``torch.distributed.fsdp.StateDictType`` member or its name.
        state_dict_config: ``FullStateDictConfig``/``ShardedStateDictConfig`` (or None: FSDP1's defaults).
        optim_state_dict_config: ``FullOptimStateDictConfig``/``ShardedOptimStateDictConfig`` (or None).
        optimizer: options for the optimizer's state dict (read ``optim_state_dict_config``).
        load: options for loading (``set_*_state_dict``): a full optimizer state with ``rank0_only=True`` is
            read on rank 0 only and sent to the other ranks (``broadcast_from_rank0=True``: what they pass is
            ignored, as in FSDP1). FSDP1 loads a full model state dict from each rank's own dict; under a
            ``rank0_only`` model config a dict the block built from ``state_dict()`` is whole on rank 0 only,
            and torch's load of different dicts per rank pairs tensors across ranks, so it is sent from rank 0
            too (the same values where every rank read the same file).
        strict: ``load_state_dict``'s ``strict`` (loading only).
        model: the model loaded (loading only). One sharded over a process group of some ranks (each data-parallel
            group of a model-parallel layout holding its own slice) is not sent from world rank 0: each rank's own
            dict is loaded, as FSDP1 loads it, its shards taken from its group's first rank (every rank of a group
            holds the same slice).

    Returns:
        ``StateDictOptions``: FULL_STATE_DICT -> ``full_state_dict=True`` (with ``cpu_offload=True``
        when the config says ``rank0_only=True``: rank 0 gets a CPU copy, the others an empty dict, as
        in FSDP1); SHARDED_STATE_DICT -> sharded (DTensor) values, on CPU when ``offload_to_cpu=True``.
        ``offload_to_cpu=True`` with ``rank0_only=False`` on a full state dict gives full tensors on
        every rank on the model's device (torch's options have no every-rank CPU copy); move them with
        ``.cpu()`` if you relied on that.

    Raises:
        ConfigError: LOCAL_STATE_DICT (FSDP1's flat-parameter shards have no FSDP2 form), a value
            that is not a state-dict type, or a config of another class than FSDP1 takes for that type
            (``FullStateDictConfig`` / ``FullOptimStateDictConfig`` for FULL_STATE_DICT, the Sharded ones for
            SHARDED_STATE_DICT; FSDP1 refuses any other).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    name = getattr(state_dict_type, "name", state_dict_type)
    if name == "LOCAL_STATE_DICT":
        raise ConfigError(
            [
                Problem(
                    "state_dict_type",
                    state_dict_type,
                    "FULL_STATE_DICT or SHARDED_STATE_DICT",
                    "save SHARDED_STATE_DICT instead (fsdp_bridge.save_checkpoint or "
                    "get_model_state_dict + dcp.save); to carry a local checkpoint, load it in "
                    "FSDP1, save it sharded, then `fsdp-bridge convert`",
                )
            ]
        )
    if name not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        raise ConfigError(
            [
                Problem(
                    "state_dict_type",
                    state_dict_type,
                    "a torch.distributed.fsdp.StateDictType member: FULL_STATE_DICT or SHARDED_STATE_DICT",
                    "pass StateDictType.FULL_STATE_DICT or StateDictType.SHARDED_STATE_DICT",
                )
            ]
        )
    _check_config_types(str(name), state_dict_config, optim_state_dict_config)
    config = optim_state_dict_config if optimizer else state_dict_config
    full = name == "FULL_STATE_DICT"
    if load:
        broadcast = full and bool(getattr(config, "rank0_only", False)) and (model is None or _spans_world(model))
        return StateDictOptions(full_state_dict=full, broadcast_from_rank0=broadcast, strict=strict)
    # no config given: FSDP1's defaults (ShardedStateDictConfig() on the device, ShardedOptimStateDictConfig() on CPU)
    offload = bool(getattr(config, "offload_to_cpu", optimizer))
    if full:
        return StateDictOptions(full_state_dict=True, cpu_offload=bool(getattr(config, "rank0_only", False)))
    return StateDictOptions(cpu_offload=offload)


def _check_config_types(name: str, config: object, optim_config: object) -> None:
    """FSDP1's check of a state-dict type's configs (exactly its own classes, or None), raised as a ConfigError
    before any collective: a ``LocalStateDictConfig`` passed as a FULL_STATE_DICT's optimizer config made FSDP1
    raise, and read by attribute here it would let the block run on FSDP2."""
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
    )

    expected = {
        "FULL_STATE_DICT": (FullStateDictConfig, FullOptimStateDictConfig),
        "SHARDED_STATE_DICT": (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    }[name]
    problems = [
        Problem(
            key,
            type(value).__name__,
            f"None or {cls.__name__} for {name} (FSDP1 refuses any other type)",
            f"pass {cls.__name__}(...) as {key}, or leave it out",
        )
        for key, value, cls in (
            ("state_dict_config", config, expected[0]),
            ("optim_state_dict_config", optim_config, expected[1]),
        )
        if value is not None and type(value) is not cls
    ]
    if problems:
        raise ConfigError(problems)


def held_module(model: Any) -> Any:
    """``model`` itself, or for an object that is not an ``nn.Module`` but hands ``modules()`` on to one (a
    trainer's model class forwarding attribute reads to the module it holds) that module: the first of its
    ``modules()``, the root."""
    if isinstance(model, nn.Module) or not callable(getattr(model, "modules", None)):
        return model
    root = next(iter(model.modules()), None)
    return root if isinstance(root, nn.Module) else model


def _is_fsdp1(module: nn.Module) -> bool:
    from fsdp_bridge.backends import backend_inside
    from fsdp_bridge.strategy import Backend

    return backend_inside(module) is Backend.FSDP1


# Modules inside a bridge state_dict_type context -> (save, optimizer save, optimizer load) options.
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, tuple[Any, Any, Any]] = weakref.WeakKeyDictionary()
# FSDP2/unsharded modules -> the (type, config, optimizer config) in force (a persistent setting or a block's).
_SETTINGS: weakref.WeakKeyDictionary[nn.Module, tuple[object, object, object]] = weakref.WeakKeyDictionary()


def state_dict_type(
    module: nn.Module,
    state_dict_type: object,
    state_dict_config: object = None,
    optim_state_dict_config: object = None,
) -> AbstractContextManager[None]:
    """FSDP1's ``FSDP.state_dict_type(module, type, config, optim_config)`` context for both backends.

    ``migrate code --fix`` writes this where FSDP1's context is made in one place and entered in
    another (a helper returning it, ``with ctx:`` elsewhere), or where its block holds no call the
    codemod rewrites in place. It can be made and entered later, as FSDP1's can.

    On a model holding FSDP1 units it is FSDP1's own context, unchanged. Otherwise (FSDP2 units, or a
    module that is not sharded) entering it checks the type (``LOCAL_STATE_DICT`` is refused with a
    ``ConfigError`` on every rank, before any collective) and, until the block ends, makes
    ``module.state_dict()`` and ``module.load_state_dict(sd, strict)`` those of the type, through
    torch's ``get_model_state_dict`` / ``set_model_state_dict`` with :func:`state_dict_options`
    (FULL_STATE_DICT: full tensors, with ``rank0_only`` a CPU copy on rank 0 only; SHARDED_STATE_DICT:
    DTensor shards); :func:`optim_state_dict` called inside the block gives the optimizer's state
    for the same type, as ``FSDP.optim_state_dict`` does. The module ``torch.compile``'s wrapper holds
    (``_orig_mod``, what code unwrapping the model in the block reaches) takes the type too.

    Args:
        module: the model (its root) whose state dicts the block takes.
        state_dict_type: a ``torch.distributed.fsdp.StateDictType`` member or its name.
        state_dict_config: ``FullStateDictConfig`` / ``ShardedStateDictConfig`` or None.
        optim_state_dict_config: ``FullOptimStateDictConfig`` / ``ShardedOptimStateDictConfig`` or None.

    Returns:
        A context manager (entered with ``with``), not yet entered.

    Raises:
        ConfigError: on entering, for LOCAL_STATE_DICT (no FSDP2 form) or a value that is not a
            state-dict type, on FSDP2 or unsharded modules.
    """
    return _StateDictContext(module, state_dict_type, state_dict_config, optim_state_dict_config)


class _StateDictContext:
    def __init__(
        self,
        module: nn.Module,
        state_dict_type: object,
        state_dict_config: object = None,
        optim_state_dict_config: object = None,
    ) -> None:
        self.module = module
        self.args = (state_dict_type, state_dict_config, optim_state_dict_config)
        # One entry per open block (nested or entered again): what to put back when it ends.
        self._stack: list[tuple[Any, list[tuple[nn.Module, dict[str, Any], tuple[Any, Any]]]]] = []

    def __enter__(self) -> None:
        if _is_fsdp1(self.module):
            from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

            kind, *configs = self.args
            if isinstance(kind, str):
                kind = StateDictType[kind]
            fsdp1 = FullyShardedDataParallel.state_dict_type(self.module, kind, *configs)  # type: ignore[arg-type]
            fsdp1.__enter__()
            self._stack.append((fsdp1, []))
            return
        saved: list[tuple[nn.Module, dict[str, Any], tuple[Any, Any]]] = []
        for module in self._covered():
            kept: dict[str, Any] = {
                k: module.__dict__[k] for k in ("state_dict", "load_state_dict") if k in module.__dict__
            }
            saved.append((module, kept, (_ACTIVE.get(module), _SETTINGS.get(module))))
        for module in self._covered():
            _install(module, self.args)
        self._stack.append((None, saved))

    def _covered(self) -> list[nn.Module]:
        """The model, and the module torch.compile's wrapper of it holds (``_orig_mod``, which code unwrapping
        the model reaches: ``unwrap_model(model).state_dict()`` in the block)."""
        inner = self.module.__dict__.get("_modules", {}).get("_orig_mod")
        return [self.module, inner] if isinstance(inner, nn.Module) else [self.module]

    def __exit__(self, *exc: object) -> None:
        fsdp1, saved = self._stack.pop()
        if fsdp1 is not None:
            fsdp1.__exit__(*exc)
            return
        for module, kept, previous in saved:
            for key in ("state_dict", "load_state_dict"):
                module.__dict__.pop(key, None)
            module.__dict__.update(kept)  # an enclosing block's, the persistent setting's, or the module's own
            for table, value in zip((_ACTIVE, _SETTINGS), previous, strict=True):
                if value is None:
                    table.pop(module, None)
                else:
                    table[module] = value


def _called_by_torchs_api(depth: int = 2) -> bool:
    """The installed ``state_dict`` / ``load_state_dict`` was called by torch's state-dict API
    (``get_model_state_dict(model, options=...)`` in the user's code): torch's options decide there, as they
    override FSDP1's state-dict types; the module's own method answers. ``depth``: frames up to the one asking
    (this function's caller is the installed method)."""
    caller = sys._getframe(depth)
    return str(caller.f_globals.get("__name__", "")).startswith("torch.distributed.checkpoint")


def _install(module: nn.Module, args: tuple[object, object, object]) -> None:
    """Make ``module.state_dict()`` / ``load_state_dict(sd, strict)`` and the optimizer-state functions those
    of the state-dict type ``args`` (type, config, optimizer config) on an FSDP2 or unsharded module. The
    type is checked first (``ConfigError`` before anything changes)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    save = state_dict_options(*args)
    options = (
        save,
        state_dict_options(*args, optimizer=True),
        state_dict_options(*args, optimizer=True, load=True),
    )
    own = type(module)
    inside = [False]  # torch's functions call the module's own state_dict / load_state_dict
    # FULL_STATE_DICT with rank0_only: FSDP1 gives the state to the first rank of the group the model is sharded
    # over (each model-parallel slice's data-parallel group saves its slice); torch's cpu_offload, to world rank 0
    rank0_only = getattr(args[0], "name", args[0]) == "FULL_STATE_DICT" and bool(getattr(args[1], "rank0_only", False))

    def state_dict(*pos: Any, **kw: Any) -> dict[str, Any]:
        if pos or kw or inside[0] or _called_by_torchs_api():  # destination / prefix / keep_vars: nn.Module's own
            return own.state_dict(module, *pos, **kw)  # type: ignore[no-any-return]
        inside[0] = True
        try:
            if rank0_only:
                keep = _keeps_full_state(module)
                state = _gathered(get_model_state_dict(module), keep, bool(getattr(args[1], "offload_to_cpu", False)))
                return state if keep else {}
            return get_model_state_dict(module, options=save)
        finally:
            inside[0] = False

    def load_state_dict(state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        if assign or inside[0] or _called_by_torchs_api():
            return own.load_state_dict(module, state_dict, strict, assign)
        inside[0] = True
        try:
            options = state_dict_options(*args, load=True, strict=strict, model=module)
            return set_model_state_dict(module, dict(state_dict), options=options)
        finally:
            inside[0] = False

    module.__dict__["state_dict"] = state_dict
    module.__dict__["load_state_dict"] = load_state_dict
    _ACTIVE[module] = options
    _SETTINGS[module] = args


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: object,
    state_dict_config: object = None,
    optim_state_dict_config: object = None,
) -> Any:
    """FSDP1's persistent ``FSDP.set_state_dict_type(module, type, config, optim_config)`` for both backends.

    ``migrate code --fix`` writes this for FSDP1's call whose type or configs are known only at run time
    (a variable, an attribute, a setting of the user's own). On a model holding FSDP1 units it is FSDP1's
    own call. On FSDP2 units it replaces any earlier setting of ``module`` by this one until the next
    call: ``module.state_dict()`` / ``module.load_state_dict(sd, strict)`` and :func:`optim_state_dict` /
    :func:`optim_state_dict_to_load` give and take that type's state, as inside a :func:`state_dict_type`
    block (a block entered later wins inside it and puts this setting back when it ends). torch's own
    ``get_model_state_dict`` / ``set_model_state_dict`` are not affected (their options decide, as they override
    FSDP1's types). A module holding no FSDP units at all is left as FSDP1's call leaves it: unchanged.

    Args:
        module: the model (its root) whose state-dict type is set.
        state_dict_type: a ``torch.distributed.fsdp.StateDictType`` member or its name.
        state_dict_config: ``FullStateDictConfig`` / ``ShardedStateDictConfig`` or None.
        optim_state_dict_config: ``FullOptimStateDictConfig`` / ``ShardedOptimStateDictConfig`` or None.

    Returns:
        ``torch.distributed.fsdp.StateDictSettings`` of the setting it replaces, as FSDP1 returns
        (FSDP1's default, FULL_STATE_DICT with default configs, where none was set).

    Raises:
        ConfigError: LOCAL_STATE_DICT on FSDP2 units (FSDP1's flat-parameter shards have no FSDP2 form),
            or a value that is not a state-dict type; raised before anything changes, on every rank.
    """
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        FullyShardedDataParallel,
        StateDictSettings,
        StateDictType,
    )

    from fsdp_bridge.backends import backend_inside

    backend = backend_inside(module)
    if backend is None or _is_fsdp1(module):
        kind = StateDictType[state_dict_type] if isinstance(state_dict_type, str) else state_dict_type
        return FullyShardedDataParallel.set_state_dict_type(
            module,
            kind,  # type: ignore[arg-type]
            state_dict_config,  # type: ignore[arg-type]
            optim_state_dict_config,  # type: ignore[arg-type]
        )
    kind, config, optim_config = _SETTINGS.get(
        module, (StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())
    )
    if isinstance(kind, str):
        kind = StateDictType[kind]
    _install(module, (state_dict_type, state_dict_config, optim_state_dict_config))
    return StateDictSettings(kind, config, optim_config)  # type: ignore[arg-type]


def _torch_optimizer(optim: object) -> torch.optim.Optimizer:
    """``optim`` itself, or the torch optimizer inside a trainer's optimizer wrapper.

    FSDP1's optimizer-state functions read only ``optim.param_groups``, so code passes them its own wrapper
    around a torch optimizer; torch's ``get_/set_optimizer_state_dict`` need the optimizer itself. The one
    taken is an attribute of the wrapper (nested wrappers too) whose ``param_groups`` is the wrapper's own list,
    so its state is the wrapper's.

    Raises:
        ConfigError: no such optimizer in the wrapper (before any collective, on every rank alike).
    """
    groups = getattr(optim, "param_groups", None)
    todo: list[object] = [optim]
    seen: set[int] = set()
    while todo:
        obj = todo.pop()
        if isinstance(obj, torch.optim.Optimizer) and obj.param_groups is groups:
            return obj
        if id(obj) in seen or len(seen) > 64 or not hasattr(obj, "__dict__"):
            continue
        seen.add(id(obj))
        todo.extend(v for v in vars(obj).values() if getattr(v, "param_groups", None) is groups)
    raise ConfigError(
        [
            Problem(
                key="optim",
                value=type(optim).__name__,
                allowed="a torch.optim.Optimizer, or a wrapper holding one whose param_groups it shares",
                fix="pass the torch optimizer itself (the one the wrapper steps)",
            )
        ]
    )


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    group: Any = None,
) -> dict[str, Any]:
    """FSDP1's ``FSDP.optim_state_dict(model, optim, optim_state_dict=None, group=None)`` for both backends.

    On a model holding FSDP1 units it is FSDP1's own call, given every argument. Otherwise it is torch's
    ``get_optimizer_state_dict`` with the settings of the :class:`state_dict_type` block ``model`` is in
    (or of :func:`set_state_dict_type`), or, outside any, FSDP1's default type. A full type keeps FSDP1's
    optimizer config: ``FullOptimStateDictConfig()`` (also when none was given) is a CPU copy on every rank,
    gathered one tensor at a time (:func:`full_optim_state_dict`), not the whole state on every GPU.
    FSDP1's signature is kept whole so that code passing its arguments through ``**kwargs`` keeps working:
    an argument FSDP1 does not take is a ``TypeError`` as there.

    Args:
        model: the sharded model (the root given to :func:`state_dict_type`).
        optim: its optimizer, or a wrapper holding it (FSDP1 reads only param_groups, so takes both).
        optim_state_dict: FSDP1's stand-in for ``optim.state_dict()``; on FSDP2 only None (the state is read
            from the optimizer itself).
        group: the process group the model is sharded over (None: the default group); on FSDP2 only that
            group's ranks, the model's own.

    Returns:
        The optimizer's state dict keyed by parameter names: full tensors, or DTensor shards under
        SHARDED_STATE_DICT (with ``rank0_only``, an empty dict on the other ranks), as FSDP1 gives.

    Raises:
        ConfigError: on FSDP2, ``optim_state_dict`` given, or ``group`` not the model's own (before any
            collective, on every rank alike).
    """
    if _is_fsdp1(model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel.optim_state_dict(model, optim, optim_state_dict, group)
    _only_fsdp1_defaults(model, optim_state_dict, group)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    kind, _, optim_config = _SETTINGS.get(model, ("FULL_STATE_DICT", None, None))
    if getattr(kind, "name", kind) == "FULL_STATE_DICT":
        # FSDP1's FullOptimStateDictConfig defaults: offload_to_cpu=True, rank0_only=False
        return full_optim_state_dict(
            model,
            optim,
            rank0_only=bool(getattr(optim_config, "rank0_only", False)),
            offload_to_cpu=bool(getattr(optim_config, "offload_to_cpu", True)),
        )
    active = _ACTIVE[model]
    inner = _torch_optimizer(optim)
    with init_step_undone(inner, reading=True):
        return get_optimizer_state_dict(model, inner, options=active[1])


def _only_fsdp1_defaults(model: nn.Module, optim_state_dict: object, group: Any) -> None:
    """FSDP1's ``optim_state_dict=`` and ``group=`` of ``FSDP.optim_state_dict`` on an FSDP2 model: only what
    torch's ``get_optimizer_state_dict`` does too (the optimizer's own state, the model's own group)."""
    problems = []
    if optim_state_dict is not None:
        problems.append(
            Problem(
                key="optim_state_dict",
                value=type(optim_state_dict).__name__,
                allowed="None: on FSDP2 the state is read from the optimizer itself",
                fix="drop the argument where it is optim.state_dict(); to save another state, load it into the "
                "optimizer first (optim.load_state_dict)",
            )
        )
    if group is not None and torch.distributed.is_initialized():
        ranks = sorted(torch.distributed.get_process_group_ranks(group))
        own = _shard_group_ranks(model)
        if own is not None and ranks != own:
            problems.append(
                Problem(
                    key="group",
                    value=f"a process group of ranks {ranks}",
                    allowed=f"None or the group the model is sharded over (ranks {own})",
                    fix="drop group=: the state is gathered over the model's own mesh",
                )
            )
    if problems:
        raise ConfigError(problems)


def _shard_group_ranks(model: nn.Module) -> list[int] | None:
    """The ranks this rank shards the model's first DTensor parameter with (its mesh's last dimension, the
    shard group under HYBRID_SHARD); None when it has no DTensor parameter."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            return sorted(torch.distributed.get_process_group_ranks(mesh.get_group(mesh.ndim - 1)))
    return None


def _keeps_full_state(model: nn.Module) -> bool:
    """FSDP1's ``rank0_only``: rank 0 of the group the model is sharded over (of each shard group under
    HYBRID_SHARD), read from the mesh of its first DTensor parameter; world rank 0 when none."""
    from torch.distributed.tensor import DTensor, Shard

    for p in model.parameters():
        if isinstance(p, DTensor):
            mesh, coordinate = p.device_mesh, p.device_mesh.get_coordinate()
            if coordinate is None:
                return False
            sharded = [d for d, placement in enumerate(p.placements) if isinstance(placement, Shard)]
            return all(coordinate[d] == 0 for d in (sharded or range(mesh.ndim)))
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _spans_world(model: nn.Module) -> bool:
    """Whether ``model`` is sharded over every rank (the mesh of its first DTensor parameter; True when it has none
    or no process group runs)."""
    from torch.distributed.tensor import DTensor

    if not torch.distributed.is_initialized():
        return True
    for p in model.parameters():
        if isinstance(p, DTensor):
            return bool(p.device_mesh.size() == torch.distributed.get_world_size())
    return True


def _gathered(state: Any, keep: bool, offload_to_cpu: bool) -> Any:
    """Every DTensor in ``state`` made whole (a collective on every rank, one tensor at a time)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        full = whole(state)
        return (full.cpu() if offload_to_cpu else full) if keep else None
    if isinstance(state, torch.Tensor):
        return (state.detach().cpu() if offload_to_cpu else state.detach()) if keep else None
    if isinstance(state, Mapping):
        return {k: _gathered(v, keep, offload_to_cpu) for k, v in state.items()}
    if isinstance(state, list):
        return [_gathered(v, keep, offload_to_cpu) for v in state]
    return state


def full_state_dict(model: nn.Module, *, rank0_only: bool = False, offload_to_cpu: bool = False) -> dict[str, Any]:
    """FSDP1's FULL_STATE_DICT ``model.state_dict()`` for both backends, ``rank0_only`` included.

    ``migrate code --fix`` writes this for ``with FSDP.state_dict_type(model, FULL_STATE_DICT,
    FullStateDictConfig(rank0_only=True, ...)): model.state_dict()`` in a tree that shards over a
    process group of some ranks (the data-parallel group of a model-parallel layout): FSDP1 gives the
    full state to each group's first rank, which saves its slice; torch's ``StateDictOptions(cpu_offload=
    True)`` gives it to world rank 0 only. On an FSDP1 model it is FSDP1's own call.

    Args:
        model: the sharded model.
        rank0_only: only the first rank of the group the model is sharded over gets the state (of
            each shard group under HYBRID_SHARD, as in FSDP1); the others get an empty dict.
        offload_to_cpu: the values are CPU copies (gathered one tensor at a time, so the device holds
            one full tensor at a time).

    Returns:
        Parameter and buffer names (no wrapper prefixes) to full tensors.
    """
    model = held_module(model)
    if _is_fsdp1(model):
        from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType

        config = FullStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=rank0_only)
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    keep = not rank0_only or _keeps_full_state(model)
    with _module_own_state_dict(model):  # a type set on it earlier does not apply, as FSDP1's block overrides it
        state = _gathered(get_model_state_dict(model), keep, offload_to_cpu)
    return state if keep else {}


@contextmanager
def _module_own_state_dict(module: nn.Module) -> Iterator[None]:
    """``module``'s own ``state_dict`` / ``load_state_dict`` for the block, not those a bridge ``set_state_dict_type``
    installed on it (torch's state-dict functions call them): a full state taken here is the full state whatever
    type the module was set to, as FSDP1's ``state_dict_type`` block overrides a persistent setting."""
    names: tuple[str, ...] = ("state_dict", "load_state_dict")
    saved: dict[str, Any] = {k: module.__dict__.pop(k) for k in names if k in module.__dict__}
    try:
        yield
    finally:
        module.__dict__.update(saved)


def full_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, *, rank0_only: bool = True, offload_to_cpu: bool = True
) -> dict[str, Any]:
    """FSDP1's full optimizer state (``FSDP.full_optim_state_dict``, or ``FSDP.optim_state_dict`` under
    FULL_STATE_DICT) for both backends, with FSDP1's ``rank0_only``: see :func:`full_state_dict`.

    Args:
        model: the sharded model.
        optim: its optimizer, or a wrapper holding it (FSDP1 reads only param_groups, so takes both).
        rank0_only: only the first rank of the model's group gets the state (FSDP1's default here).
        offload_to_cpu: the values are CPU copies.

    Returns:
        The optimizer's state dict keyed by parameter names, full tensors (empty on the other ranks
        with ``rank0_only``).
    """
    if _is_fsdp1(model):
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullyShardedDataParallel, StateDictType

        config = FullOptimStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=rank0_only)
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, None, config):
            return FullyShardedDataParallel.optim_state_dict(model, optim)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    keep = not rank0_only or _keeps_full_state(model)
    inner = _torch_optimizer(optim)
    with _module_own_state_dict(model), init_step_undone(inner, reading=True):
        state = _gathered(get_optimizer_state_dict(model, inner), keep, offload_to_cpu)
    return state if keep else {}


def _unshared(optim_state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``optim_state_dict`` with a copy of each tensor more than one parameter's state holds: FSDP1's state gives
    every parameter of a flat parameter the same ``step`` tensor (torch.save keeps the sharing), and loaded as it
    is, one optimizer step would add 1 to it once per parameter."""
    state = dict(optim_state_dict)
    if not isinstance(state.get("state"), Mapping):
        return state
    seen: set[int] = set()
    per_param: dict[Any, Any] = {}
    for key, entry in state["state"].items():
        if isinstance(entry, Mapping):
            entry = dict(entry)
            for name, value in entry.items():
                if isinstance(value, torch.Tensor):
                    if id(value) in seen:
                        entry[name] = value.clone()
                    seen.add(id(value))
        per_param[key] = entry
    state["state"] = per_param
    return state


def _uncompiled(name: str) -> str:
    """``name`` without torch.compile's ``_orig_mod`` components (``_orig_mod.layer.weight`` -> ``layer.weight``;
    ``enc_orig_mod.weight`` is left as it is)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _without_compile_prefix(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with torch.compile's ``_orig_mod.`` taken out of its parameter names: FSDP1's optimizer state of a
    compiled model names them so, torch's state-dict API never does (its names are the module's own), and with
    ``strict=False`` a state under the other names would load nothing, silently."""
    entries = state.get("state")
    if not isinstance(entries, Mapping) or not any(isinstance(k, str) and _uncompiled(k) != k for k in entries):
        return state
    state = dict(state)
    state["state"] = {_uncompiled(k) if isinstance(k, str) else k: v for k, v in entries.items()}
    groups = state.get("param_groups")
    if isinstance(groups, list):
        state["param_groups"] = [
            {
                **g,
                "params": [_uncompiled(p) if isinstance(p, str) else p for p in g.get("params", [])],
            }
            if isinstance(g, Mapping)
            else g
            for g in groups
        ]
    return state


def optim_state_dict_to_load(
    model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Mapping[str, Any] | None, options: Any = None
) -> dict[str, Any]:
    """FSDP1's ``FSDP.optim_state_dict_to_load`` for code that loads the result afterwards.

    ``migrate code --fix`` writes this where the result of ``FSDP.optim_state_dict_to_load(...)`` is
    kept in a variable (``osd = ...; ...; optim.load_state_dict(osd)``). torch's public API has no
    pure conversion: this loads ``optim_state_dict`` into ``optim`` with
    ``set_optimizer_state_dict`` (works on FSDP1 and FSDP2 models) and returns ``optim.state_dict()``,
    so a later ``optim.load_state_dict(result)`` loads the same state again and changes nothing.

    Args:
        model: the sharded model the optimizer belongs to.
        optim: its optimizer, or a wrapper holding it (FSDP1 reads only param_groups, so takes both).
        optim_state_dict: the state as FSDP1 saved it (full or sharded, keyed by parameter names). With
            ``options.broadcast_from_rank0`` (FSDP1's ``FullOptimStateDictConfig(rank0_only=True)``) only
            rank 0's is read, and the other ranks may pass None, as FSDP1 allows.
        options: ``StateDictOptions`` (``state_dict_options(...)`` in a migrated state-dict block);
            None means a full state dict, FSDP1's default state-dict type.

    Returns:
        ``optim.state_dict()`` after loading.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    inner = _torch_optimizer(optim)  # a wrapper's optimizer (FSDP1's reads only its param_groups)
    if options is None and (active := _ACTIVE.get(model)) is not None:
        options = active[2]  # inside fsdp_bridge.state_dict_type: that block's type
    if options is None:
        # FSDP1 takes full or sharded values whatever the state-dict type (it gathers sharded ones):
        # DTensor values (load_sharded_optimizer_state_dict's on FSDP2) are loaded as sharded state.
        options = StateDictOptions(full_state_dict=not _holds_dtensor(optim_state_dict))
    # FSDP1 loads a state that holds nothing for some parameters (a unit that never had a gradient, so its
    # optimizer made no state): torch's strict check would refuse it.
    if isinstance(options, StateDictOptions) and options.strict:
        options = dataclasses.replace(options, strict=False)
    # FSDP1 ignores what the other ranks pass when rank 0's state is broadcast (rank0_only).
    others = bool(getattr(options, "broadcast_from_rank0", False)) and torch.distributed.get_rank() != 0
    state = {} if optim_state_dict is None or others else _without_compile_prefix(_unshared(optim_state_dict))
    empty = [g for g in inner.param_groups if not g["params"]]
    if len(empty) < 2:
        with init_step_undone(inner, reading=False):
            set_optimizer_state_dict(model, inner, state, options=options)
        return optim.state_dict()
    # torch's set_optimizer_state_dict matches groups by their parameters and refuses more than one group
    # without any (a frozen part's groups), which FSDP1 loads: those are set aside while it loads, then put
    # back in their places with the hyperparameters saved for them.
    saved_empty = [g for g in state.get("param_groups", ()) if not g.get("params")]
    if "param_groups" in state:
        state["param_groups"] = [g for g in state["param_groups"] if g.get("params")]
    order = [bool(g["params"]) for g in inner.param_groups]
    inner.param_groups = [g for g in inner.param_groups if g["params"]]
    try:
        with init_step_undone(inner, reading=False):
            set_optimizer_state_dict(model, inner, state, options=options)
    finally:
        loaded = iter(inner.param_groups)
        inner.param_groups = [next(loaded) if has_params else empty.pop(0) for has_params in order]
    if len(saved_empty) == len([h for h in order if not h]):
        for group, saved in zip([g for g in inner.param_groups if not g["params"]], saved_empty, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
    return optim.state_dict()


def _holds_dtensor(state: object) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return True
    if isinstance(state, Mapping):
        return any(_holds_dtensor(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(_holds_dtensor(v) for v in state)
    return False


def load_sharded_optimizer_state_dict(
    model_state_dict: Mapping[str, Any], optimizer_key: str, storage_reader: Any, planner: Any = None
) -> dict[str, Any]:
    """torch's ``load_sharded_optimizer_state_dict`` for models sharded by FSDP1 or FSDP2.

    ``migrate code --fix`` writes this in place of
    ``torch.distributed.checkpoint.optimizer.load_sharded_optimizer_state_dict``, same arguments.
    torch's function builds FSDP1 ``ShardedTensor`` templates; when ``model_state_dict`` holds
    FSDP2's DTensors, each optimizer-state tensor of a parameter is read into a DTensor laid out like
    that parameter (so each rank reads only its shard), other tensors (``step``) whole, and
    non-tensor entries (``param_groups``) as saved. A checkpoint written by FSDP1 or by FSDP2 loads
    either way. Pass the result's ``[optimizer_key]`` to :func:`optim_state_dict_to_load` (or
    ``set_optimizer_state_dict``).

    Args:
        model_state_dict: the sharded model's state dict (``model.state_dict()`` or
            ``get_model_state_dict(model)``).
        optimizer_key: the key the optimizer state was saved under.
        storage_reader: a ``torch.distributed.checkpoint`` storage reader (``FileSystemReader(path)``).
            torch's ``FileSystemReader`` is read without unpickling: its ``.metadata`` by the
            project's bounded parser (never a pickle), every file it names inside the directory.
        planner: a load planner (default: torch's, reading non-tensor items with
            ``torch.load(weights_only=True)``).

    Returns:
        ``{optimizer_key: optimizer state dict}``, keyed by parameter names as FSDP1 saved it.

    Raises:
        CheckpointError: the directory's ``.metadata`` is not DCP metadata this version reads
            (anything that would run code or reach an existing object when unpickled included).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.tensor import DTensor

    from fsdp_bridge._dcp_metadata import SafeLoadPlanner, safe_storage_reader

    # torch's FileSystemReader unpickles .metadata and its default planner the non-tensor items:
    # the directory is read by the project's parser and with torch.load(weights_only=True) instead.
    storage_reader = safe_storage_reader(storage_reader)
    if planner is None:
        planner = SafeLoadPlanner()
    if not any(isinstance(v, DTensor) for v in model_state_dict.values()):
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict as fsdp1_load

        return fsdp1_load(dict(model_state_dict), optimizer_key, storage_reader, planner)
    metadata = storage_reader.read_metadata()
    state: dict[str, Any] = {}
    for key, value in metadata.state_dict_metadata.items():
        path = metadata.planner_data[key]
        if path[0] != optimizer_key:
            continue
        if isinstance(value, BytesStorageMetadata):
            _set_path(state, path, "<bytes>")  # replaced by the saved object
            continue
        param = model_state_dict.get(str(path[2])) if len(path) == 4 and path[1] == "state" else None
        dtype = value.properties.dtype
        if isinstance(param, DTensor) and tuple(param.shape) == tuple(value.size):
            local = torch.empty(param.to_local().shape, dtype=dtype, device=param.to_local().device)
            template: object = DTensor.from_local(
                local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        else:
            template = torch.empty(tuple(value.size), dtype=dtype)
        _set_path(state, path, template)
    dcp.load(state, storage_reader=storage_reader, planner=planner)
    return state


def _set_path(root: dict[str, Any], path: tuple[Any, ...], value: object) -> None:
    """Put ``value`` at DCP's flattening path ``path`` (an int is a list index, as DCP flattens lists)."""
    node: Any = root
    for part, following in itertools.pairwise(path):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            node.extend([None] * (part + 1 - len(node)))
            if node[part] is None:
                node[part] = empty
            node = node[part]
        else:
            node = node.setdefault(part, empty)
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value
