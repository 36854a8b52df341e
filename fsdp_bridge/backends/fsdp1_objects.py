"""FSDP1's own run-time objects, read as bridge config values (``BridgeConfig.from_fsdp1``).

A trainer that builds ``FullyShardedDataParallel(model, sharding_strategy=..., auto_wrap_policy=...,
mixed_precision=MixedPrecision(...), ...)`` from helper modules and config objects can pass
the same keyword arguments to :meth:`fsdp_bridge.BridgeConfig.from_fsdp1`: each value is
translated here into the bridge field that means the same thing, and whatever FSDP2 cannot
honour is refused by the bridge config's validation (the same errors as a YAML file).

Wrap policies keep FSDP1's semantics exactly: ``transformer_auto_wrap_policy`` and
``ModuleWrapPolicy`` become class lists, ``size_based_auto_wrap_policy(min_num_params=N)``
the size-based mode, ``lambda_auto_wrap_policy``/``CustomPolicy`` a predicate; any other
policy (``_or_policy`` combinations, a policy function of the user's own) is run by
:func:`fsdp1_policy_units`, FSDP1's recursion over the model, when the model is sharded.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from fsdp_bridge.errors import ConfigError, Problem

__all__ = [
    "FSDP1_KWARGS",
    "describe_policy",
    "fsdp1_policy_units",
    "full_optim_state_dict",
    "full_state_dict",
    "load_sharded_optimizer_state_dict",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "runtime_ignored_objects",
    "state_dict_options",
    "state_dict_type",
    "translate_fsdp1_kwargs",
]

FSDP1_KWARGS = (
    "sharding_strategy",
    "auto_wrap_policy",
    "mixed_precision",
    "cpu_offload",
    "backward_prefetch",
    "forward_prefetch",
    "limit_all_gathers",
    "use_orig_params",
    "sync_module_states",
    "param_init_fn",
    "device_id",
    "ignored_modules",
    "ignored_states",
    "process_group",
)
"""FullyShardedDataParallel's keyword arguments that :func:`translate_fsdp1_kwargs` reads."""

_SIZE_BASED_DEFAULT = 100_000_000  # size_based_auto_wrap_policy's own default min_num_params


def _partial_of(policy: object, fn: Callable[..., Any]) -> functools.partial[Any] | None:
    return policy if isinstance(policy, functools.partial) and policy.func is fn else None


def _class_names(classes: Iterable[object]) -> tuple[str, ...]:
    return tuple(sorted(c.__name__ if isinstance(c, type) else str(c) for c in classes))


def describe_policy(policy: object) -> str:
    """How a wrap policy reads in code, for reports: ``transformer_auto_wrap_policy(...)``."""
    if policy is None:
        return "None (the root is the only unit)"
    if (p := _partial_of(policy, transformer_auto_wrap_policy)) is not None:
        names = ", ".join(_class_names(p.keywords.get("transformer_layer_cls", ())))
        return f"transformer_auto_wrap_policy(transformer_layer_cls={{{names}}})"
    if (p := _partial_of(policy, size_based_auto_wrap_policy)) is not None:
        args = ", ".join(f"{k}={v!r}" for k, v in sorted(p.keywords.items()))
        return f"size_based_auto_wrap_policy({args or f'min_num_params={_SIZE_BASED_DEFAULT:_}'})"
    if (p := _partial_of(policy, lambda_auto_wrap_policy)) is not None:
        fn = p.keywords.get("lambda_fn")
        return f"lambda_auto_wrap_policy(lambda_fn={getattr(fn, '__qualname__', repr(fn))})"
    if isinstance(policy, ModuleWrapPolicy):
        return f"ModuleWrapPolicy({{{', '.join(_class_names(policy._module_classes))}}})"
    if isinstance(policy, CustomPolicy):
        return f"CustomPolicy({getattr(policy._lambda_fn, '__qualname__', repr(policy._lambda_fn))})"
    if isinstance(policy, functools.partial):
        inner = ", ".join(describe_policy(q) for q in policy.keywords.get("policies", ()))
        name = getattr(policy.func, "__name__", repr(policy.func))
        return f"{name}(policies=[{inner}])" if inner else f"{name}({policy.keywords})"
    return getattr(policy, "__qualname__", type(policy).__name__)


def _wrap_value(policy: object, problems: list[Problem]) -> object:
    """The bridge ``wrap`` value meaning what ``policy`` means to FSDP1."""
    if policy is None:
        return "none"
    if (p := _partial_of(policy, transformer_auto_wrap_policy)) is not None:
        classes = p.keywords.get("transformer_layer_cls")
        if not classes:
            problems.append(Problem("auto_wrap_policy", describe_policy(policy), "transformer_layer_cls={LayerClass}"))
            return "none"
        return [c for c in classes]
    if (p := _partial_of(policy, size_based_auto_wrap_policy)) is not None:
        extra = {k: v for k, v in p.keywords.items() if k != "min_num_params"}
        if not extra:
            return {"min_num_params": int(p.keywords.get("min_num_params", _SIZE_BASED_DEFAULT))}
        return _Fsdp1Policy(p)  # force_leaf_modules / exclude_wrap_modules: FSDP1's recursion
    if (p := _partial_of(policy, lambda_auto_wrap_policy)) is not None:
        fn = p.keywords.get("lambda_fn")
        if not callable(fn):
            problems.append(
                Problem("auto_wrap_policy", describe_policy(policy), "lambda_auto_wrap_policy(lambda_fn=f)")
            )
            return "none"
        return fn
    if isinstance(policy, ModuleWrapPolicy):
        return list(policy._module_classes)
    if isinstance(policy, CustomPolicy):
        lambda_fn = policy._lambda_fn

        def chosen(module: nn.Module) -> bool:
            result = lambda_fn(module)
            if isinstance(result, Mapping) and result:
                raise ConfigError(
                    [
                        Problem(
                            "auto_wrap_policy",
                            describe_policy(policy),
                            "a CustomPolicy whose function returns True or False",
                            f"it returned per-unit FSDP1 arguments {dict(result)} for "
                            f"{type(module).__name__}; FSDP2 units share one config",
                        )
                    ]
                )
            return bool(result)

        chosen.__qualname__ = describe_policy(policy)
        return chosen
    if callable(policy):
        return _Fsdp1Policy(policy)
    if callable(getattr(policy, "_run_policy", None)):
        return _Fsdp1PolicyObject(policy)  # a torch _Policy subclass of the user's own
    problems.append(
        Problem(
            "auto_wrap_policy",
            policy,
            "None, a functools.partial of a torch wrap policy, ModuleWrapPolicy, CustomPolicy or a policy function",
        )
    )
    return "none"


class _Fsdp1Policy:
    """A policy function FSDP1 calls as ``policy(module=, recurse=, nonwrapped_numel=)``."""

    def __init__(self, policy: Callable[..., Any]) -> None:
        self.policy = policy
        self.__qualname__ = describe_policy(policy)

    def __call__(self, module: nn.Module) -> bool:  # the bridge calls resolve_units instead
        raise TypeError("an FSDP1 policy function is resolved over the whole model (resolve_units)")

    def resolve_units(self, model: nn.Module, ignored: Iterable[nn.Module] = ()) -> list[nn.Module]:
        return fsdp1_policy_units(model, self.policy, ignored)


class _Fsdp1PolicyObject:
    """A policy object FSDP1 runs as ``policy._run_policy(root, ignored_modules, root_kwargs)`` (torch's
    ``_Policy`` interface, for subclasses of the user's own): the modules it returns are the units."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.__qualname__ = describe_policy(policy)

    def __call__(self, module: nn.Module) -> bool:  # the bridge calls resolve_units instead
        raise TypeError("an FSDP1 policy object is resolved over the whole model (resolve_units)")

    def resolve_units(self, model: nn.Module, ignored: Iterable[nn.Module] = ()) -> list[nn.Module]:
        chosen = self.policy._run_policy(model, set(ignored), {})
        overrides = {type(m).__name__: kw for m, kw in chosen.items() if kw}
        if overrides:
            raise ConfigError(
                [
                    Problem(
                        "auto_wrap_policy",
                        self.__qualname__,
                        "a policy that chooses modules without per-unit arguments",
                        f"it gave per-unit FSDP1 arguments {overrides}; FSDP2 units share one config",
                    )
                ]
            )
        return [m for m in model.modules() if m is not model and m in chosen]


def fsdp1_policy_units(
    model: nn.Module, policy: Callable[..., Any], ignored: Iterable[nn.Module] = ()
) -> list[nn.Module]:
    """The modules FSDP1's auto-wrap recursion would wrap in ``model`` (the root excluded).

    The same traversal as torch's ``_recursive_wrap``: a module is descended into when
    ``policy(recurse=True)`` says so, children first, and wrapped when
    ``policy(recurse=False, nonwrapped_numel=...)`` says so for the parameters its wrapped
    children left over.
    """
    ignored_modules = set(ignored)
    ignored_params = {p for m in ignored_modules for p in m.parameters()}
    units: list[nn.Module] = []

    def visit(module: nn.Module, is_root: bool) -> int:
        numel = sum(p.numel() for p in module.parameters() if p not in ignored_params)
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = sum(visit(child, False) for child in module.children() if child not in ignored_modules)
        if not is_root and policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped):
            units.append(module)
            return numel
        return wrapped

    visit(model, True)
    return units


def _device_value(device_id: object, problems: list[Problem]) -> str:
    if device_id is None:
        return "auto"
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        return "cuda"
    if isinstance(device_id, (torch.device, str)):
        kind = torch.device(device_id).type
        if kind in ("cuda", "cpu"):
            return kind
    problems.append(
        Problem(
            "device_id",
            device_id,
            "None, a CUDA device index, or torch.device('cuda'|'cpu')",
            "the bridge runs on CUDA or CPU only: leave device_id out (the device is then chosen like "
            "BridgeConfig(device='auto')) or pass a CUDA or CPU device",
        )
    )
    return "auto"


def _mixed_precision_value(mp: object, problems: list[Problem]) -> object:
    if mp is None:
        return "fp32"
    if not isinstance(mp, MixedPrecision):
        problems.append(Problem("mixed_precision", mp, "None or torch.distributed.fsdp.MixedPrecision(...)"))
        return "fp32"
    if mp.keep_low_precision_grads:
        problems.append(
            Problem(
                "mixed_precision.keep_low_precision_grads",
                True,
                "False",
                "FSDP2 keeps gradients in the parameters' dtype; drop keep_low_precision_grads",
            )
        )
    return {
        "param_dtype": mp.param_dtype,
        "reduce_dtype": mp.reduce_dtype,
        "buffer_dtype": mp.buffer_dtype,
        # FSDP1 casts the root's inputs by default and every unit's on request: both kept as they are
        # (FSDP2: the units' fully_shard calls cast with the first, the root's with either).
        "cast_forward_inputs": bool(mp.cast_forward_inputs),
        "cast_root_forward_inputs": bool(mp.cast_root_forward_inputs),
    }


def runtime_mesh_arguments(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, Any] | None]:
    """``kwargs`` without what stands for a mesh (``device_mesh``, or a ``process_group`` other than
    every rank's: a group, or HYBRID_SHARD's pair of groups), and that ``(name, value)`` if any.

    Raises:
        ConfigError: both are given (FSDP1 refuses that too).
    """
    import torch.distributed as dist

    rest = dict(kwargs)
    mesh = rest.pop("device_mesh", None)
    group = rest.get("process_group")
    groups = list(group) if isinstance(group, (tuple, list)) else [group]
    is_group = group is not None and all(isinstance(g, dist.ProcessGroup) for g in groups)
    if is_group and _process_group_problems(group):
        rest.pop("process_group")
    else:
        group = None
    if mesh is not None and group is not None:
        raise ConfigError([Problem("device_mesh", mesh, "device_mesh or process_group, not both", "pass one of them")])
    if mesh is not None:
        return rest, ("device_mesh", mesh)
    return rest, ("process_group", group) if group is not None else None


def _argument_problems(kwargs: Mapping[str, Any]) -> list[Problem]:
    """Arguments that are not FSDP1 constructor arguments the config can take."""
    problems: list[Problem] = []
    for key, value in kwargs.items():
        if key not in FSDP1_KWARGS:
            problems.append(
                Problem(
                    key,
                    value,
                    f"a FullyShardedDataParallel argument: {', '.join(FSDP1_KWARGS)}",
                    "remove it (module is shard()'s first argument)" if key == "module" else "",
                )
            )
    return problems


def _cpu_offload_value(offload: Any, problems: list[Problem]) -> bool:
    if offload is not None and not isinstance(offload, CPUOffload):
        problems.append(Problem("cpu_offload", offload, "None or CPUOffload(offload_params=...)"))
    return bool(offload is not None and offload.offload_params)


def _init_notes(kwargs: Mapping[str, Any]) -> list[str]:
    """What the report says about ``use_orig_params`` and ``param_init_fn``, which have no config field."""
    notes: list[str] = []
    if "use_orig_params" in kwargs and not kwargs["use_orig_params"]:
        notes.append(
            "use_orig_params=False: the bridge keeps original parameters on both backends (FSDP2 always "
            "does); optimizers see the model's own parameters"
        )
    if kwargs.get("param_init_fn") is not None and not kwargs.get("sync_module_states"):
        # FSDP1 calls param_init_fn only on modules that hold meta-device tensors; shard() refuses a meta-device
        # model without sync_module_states (before any collective), so a model built on a real device shards as
        # it did under FSDP1 and a meta one gets that error instead of a silent difference.
        notes.append(
            "param_init_fn without sync_module_states: FSDP1 calls it only for meta-device modules; the "
            "model here must be on a real device (a meta-device model is refused by shard() with the fix)"
        )
    elif kwargs.get("param_init_fn") is not None:
        notes.append(
            "param_init_fn is not called: meta-device tensors of ranks other than 0 are materialised and take "
            "rank 0's weights and dtypes (sync_module_states); rank 0 must hold real weights"
        )
    return notes


def _ignored_value(kwargs: Mapping[str, Any], problems: list[Problem]) -> tuple[str, ...] | None:
    """``ignored_modules`` (or ``ignored_states``) as names; None when not given or not names."""
    ignored = kwargs.get("ignored_modules") or kwargs.get("ignored_states")
    if ignored and all(isinstance(n, str) for n in ignored):
        return tuple(ignored)  # already names (the codemod writes them so)
    if ignored:
        problems.append(
            Problem(
                "ignored_modules",
                f"<{len(list(ignored))} module objects>",
                "module names: BridgeConfig(ignored_modules=['path.to.module', 'ClassName'])",
                "name the modules in the config; module objects are only known with the model",
            )
        )
    return None


def runtime_ignored_objects(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[object, ...]]:
    """``kwargs`` without ``ignored_modules`` / ``ignored_states`` given as module or parameter objects
    (FSDP1's form), and those objects: they go with the config and become names in ``shard()``, where the
    model is known (:func:`fsdp_bridge.module_names`).

    Raises:
        ConfigError: both arguments given (FSDP1 refuses that too), or an entry that is neither a module,
            a parameter nor a name.
    """
    rest = dict(kwargs)
    given = [k for k in ("ignored_modules", "ignored_states") if rest.get(k) is not None]
    if len(given) == 2:
        raise ConfigError(
            [Problem("ignored_states", "given with ignored_modules", "one of them", "pass only ignored_states")]
        )
    if not given:
        return rest, ()
    values = list(rest[given[0]])
    if all(isinstance(v, str) for v in values):
        return rest, ()
    bad = [v for v in values if not isinstance(v, (nn.Module, nn.Parameter))]
    if bad:
        raise ConfigError(
            [
                Problem(
                    given[0],
                    bad[0],
                    "modules or parameters of the model (FSDP1's form), or module names",
                    "pass e.g. [model.lm_head] or ['lm_head']",
                )
            ]
        )
    rest.pop(given[0])
    return rest, tuple(values)


def _process_group_problems(group: object) -> list[Problem]:
    """A process group other than every rank's has no config meaning (HYBRID_SHARD: a 2D mesh)."""
    if group is None:
        return []
    import torch.distributed as dist

    world_group = (
        isinstance(group, dist.ProcessGroup)
        and dist.is_initialized()
        and dist.get_world_size(group) == dist.get_world_size()
    )
    if world_group:
        return []
    return [
        Problem(
            "process_group",
            group,
            "None (every rank)",
            "leave process_group out of the config and pass shard(..., "
            "mesh=fsdp_bridge.mesh_from_process_group(group)): a 1D mesh over the group's ranks, "
            "or the 2D (replicate, shard) mesh of HYBRID_SHARD's (intra-node, inter-node) pair",
        )
    ]


def translate_fsdp1_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """BridgeConfig field values for FSDP1 constructor ``kwargs``, and notes for the report.

    Raises:
        ConfigError: listing every argument that has no bridge meaning, with the fix.
    """
    problems = _argument_problems(kwargs)
    if problems:
        raise ConfigError(problems)
    out: dict[str, Any] = {}
    if "sharding_strategy" in kwargs:
        out["strategy"] = "full_shard" if kwargs["sharding_strategy"] is None else kwargs["sharding_strategy"]
    # FSDP1 without a policy wraps only the root
    out["wrap"] = _wrap_value(kwargs["auto_wrap_policy"], problems) if "auto_wrap_policy" in kwargs else "none"
    if "mixed_precision" in kwargs:
        out["mixed_precision"] = _mixed_precision_value(kwargs["mixed_precision"], problems)
    if "cpu_offload" in kwargs:
        out["cpu_offload"] = _cpu_offload_value(kwargs["cpu_offload"], problems)
    if "backward_prefetch" in kwargs:
        out["backward_prefetch"] = kwargs["backward_prefetch"]  # None means no prefetch, as in FSDP1
    for key in ("forward_prefetch", "limit_all_gathers", "sync_module_states"):
        if key in kwargs:
            out[key] = bool(kwargs[key])
    notes = _init_notes(kwargs)
    mp = kwargs.get("mixed_precision")
    if isinstance(mp, MixedPrecision) and mp.param_dtype is not None and kwargs.get("auto_wrap_policy") is not None:
        kept = _class_names(mp._module_classes_to_ignore)
        if kept:  # FSDP1's default: BatchNorm
            notes.append(
                f"MixedPrecision keeps {', '.join(kept)} modules in full precision in FSDP1 (units of their own "
                "under an auto-wrap policy); the bridge runs them in param_dtype with the rest of their unit"
            )
    if "device_id" in kwargs:
        out["device"] = _device_value(kwargs["device_id"], problems)
    ignored = _ignored_value(kwargs, problems)
    if ignored is not None:
        out["ignored_modules"] = ignored
    problems += _process_group_problems(kwargs.get("process_group"))
    if problems:
        raise ConfigError(problems)
    return out, notes


def state_dict_options(
    state_dict_type: object,
    state_dict_config: object = None,
    optim_state_dict_config: object = None,
    *,
    optimizer: bool = False,
    load: bool = False,
    strict: bool = True,
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
        load: options for loading (``set_*_state_dict``): FSDP1 loads a full model state dict given on
            every rank, so neither ``rank0_only`` nor ``offload_to_cpu`` applies to it; a full optimizer
            state with ``rank0_only=True`` is read on rank 0 only and sent to the other ranks
            (``broadcast_from_rank0=True``: what they pass is ignored, as in FSDP1).
        strict: ``load_state_dict``'s ``strict`` (loading only).

    Returns:
        ``StateDictOptions``: FULL_STATE_DICT -> ``full_state_dict=True`` (with ``cpu_offload=True``
        when the config says ``rank0_only=True``: rank 0 gets a CPU copy, the others an empty dict, as
        in FSDP1); SHARDED_STATE_DICT -> sharded (DTensor) values, on CPU when ``offload_to_cpu=True``.
        ``offload_to_cpu=True`` with ``rank0_only=False`` on a full state dict gives full tensors on
        every rank on the model's device (torch's options have no every-rank CPU copy); move them with
        ``.cpu()`` if you relied on that.

    Raises:
        ConfigError: LOCAL_STATE_DICT (FSDP1's flat-parameter shards have no FSDP2 form) or a value
            that is not a state-dict type.
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
    config = optim_state_dict_config if optimizer else state_dict_config
    full = name == "FULL_STATE_DICT"
    if load:
        broadcast = full and optimizer and bool(getattr(config, "rank0_only", False))
        return StateDictOptions(full_state_dict=full, broadcast_from_rank0=broadcast, strict=strict)
    offload = bool(getattr(config, "offload_to_cpu", False))
    if full:
        return StateDictOptions(full_state_dict=True, cpu_offload=bool(getattr(config, "rank0_only", False)))
    return StateDictOptions(cpu_offload=offload)


def _is_fsdp1(module: nn.Module) -> bool:
    from fsdp_bridge.backends import backend_inside
    from fsdp_bridge.strategy import Backend

    return backend_inside(module) is Backend.FSDP1


# Modules inside a bridge state_dict_type context -> (save, optimizer save, optimizer load) options.
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, tuple[Any, Any, Any]] = weakref.WeakKeyDictionary()


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
    for the same type, as ``FSDP.optim_state_dict`` does.

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
        self._stack: list[tuple[Any, dict[str, Any], Any]] = []

    def __enter__(self) -> None:
        if _is_fsdp1(self.module):
            from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

            kind, *configs = self.args
            if isinstance(kind, str):
                kind = StateDictType[kind]
            fsdp1 = FullyShardedDataParallel.state_dict_type(self.module, kind, *configs)  # type: ignore[arg-type]
            fsdp1.__enter__()
            self._stack.append((fsdp1, {}, None))
            return
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        module, args = self.module, self.args
        save = state_dict_options(*args)
        options = (
            save,
            state_dict_options(*args, optimizer=True),
            state_dict_options(*args, optimizer=True, load=True),
        )
        own = type(module)
        inside = [False]  # torch's functions call the module's own state_dict / load_state_dict

        def state_dict(*pos: Any, **kw: Any) -> dict[str, Any]:
            if pos or kw or inside[0]:  # destination / prefix / keep_vars: nn.Module's own state_dict
                return own.state_dict(module, *pos, **kw)  # type: ignore[no-any-return]
            inside[0] = True
            try:
                return get_model_state_dict(module, options=save)
            finally:
                inside[0] = False

        def load_state_dict(state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
            if assign or inside[0]:
                return own.load_state_dict(module, state_dict, strict, assign)
            inside[0] = True
            try:
                options = state_dict_options(*args, load=True, strict=strict)
                return set_model_state_dict(module, dict(state_dict), options=options)
            finally:
                inside[0] = False

        saved: dict[str, Any] = {
            k: module.__dict__[k] for k in ("state_dict", "load_state_dict") if k in module.__dict__
        }
        self._stack.append((None, saved, _ACTIVE.get(module)))
        module.__dict__["state_dict"] = state_dict
        module.__dict__["load_state_dict"] = load_state_dict
        _ACTIVE[module] = options

    def __exit__(self, *exc: object) -> None:
        fsdp1, saved, previous = self._stack.pop()
        if fsdp1 is not None:
            fsdp1.__exit__(*exc)
            return
        for key in ("state_dict", "load_state_dict"):
            self.module.__dict__.pop(key, None)
        self.module.__dict__.update(saved)  # an enclosing block's, or the module's own
        if previous is None:
            _ACTIVE.pop(self.module, None)
        else:
            _ACTIVE[self.module] = previous


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """FSDP1's ``FSDP.optim_state_dict(model, optim)`` for both backends.

    On a model holding FSDP1 units it is FSDP1's own call. Otherwise it is torch's
    ``get_optimizer_state_dict`` with the options of the :class:`state_dict_type` block ``model`` is
    in, or, outside any, FSDP1's default type (FULL_STATE_DICT: full tensors on every rank).

    Args:
        model: the sharded model (the root given to :func:`state_dict_type`).
        optim: its optimizer.

    Returns:
        The optimizer's state dict keyed by parameter names: full tensors, or DTensor shards under
        SHARDED_STATE_DICT (with ``rank0_only``, an empty dict on the other ranks), as FSDP1 gives.
    """
    if _is_fsdp1(model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel.optim_state_dict(model, optim)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    active = _ACTIVE.get(model)
    options = active[1] if active is not None else StateDictOptions(full_state_dict=True)
    return get_optimizer_state_dict(model, optim, options=options)


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


def _gathered(state: Any, keep: bool, offload_to_cpu: bool) -> Any:
    """Every DTensor in ``state`` made whole (a collective on every rank, one tensor at a time)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        full = state.full_tensor()
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
    if _is_fsdp1(model):
        from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType

        config = FullStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=rank0_only)
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    keep = not rank0_only or _keeps_full_state(model)
    state = _gathered(get_model_state_dict(model), keep, offload_to_cpu)
    return state if keep else {}


def full_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, *, rank0_only: bool = True, offload_to_cpu: bool = True
) -> dict[str, Any]:
    """FSDP1's full optimizer state (``FSDP.full_optim_state_dict``, or ``FSDP.optim_state_dict`` under
    FULL_STATE_DICT) for both backends, with FSDP1's ``rank0_only``: see :func:`full_state_dict`.

    Args:
        model: the sharded model.
        optim: its optimizer.
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
    state = _gathered(get_optimizer_state_dict(model, optim), keep, offload_to_cpu)
    return state if keep else {}


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
        optim: its optimizer.
        optim_state_dict: the state as FSDP1 saved it (full or sharded, keyed by parameter names). With
            ``options.broadcast_from_rank0`` (FSDP1's ``FullOptimStateDictConfig(rank0_only=True)``) only
            rank 0's is read, and the other ranks may pass None, as FSDP1 allows.
        options: ``StateDictOptions`` (``state_dict_options(...)`` in a migrated state-dict block);
            None means a full state dict, FSDP1's default state-dict type.

    Returns:
        ``optim.state_dict()`` after loading.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if options is None and (active := _ACTIVE.get(model)) is not None:
        options = active[2]  # inside fsdp_bridge.state_dict_type: that block's type
    if options is None:
        # FSDP1 takes full or sharded values whatever the state-dict type (it gathers sharded ones):
        # DTensor values (load_sharded_optimizer_state_dict's on FSDP2) are loaded as sharded state.
        options = StateDictOptions(full_state_dict=not _holds_dtensor(optim_state_dict))
    # FSDP1 ignores what the other ranks pass when rank 0's state is broadcast (rank0_only).
    others = bool(getattr(options, "broadcast_from_rank0", False)) and torch.distributed.get_rank() != 0
    state = {} if optim_state_dict is None or others else dict(optim_state_dict)
    set_optimizer_state_dict(model, optim, state, options=options)
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
        planner: a load planner (torch's default when None).

    Returns:
        ``{optimizer_key: optimizer state dict}``, keyed by parameter names as FSDP1 saved it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.tensor import DTensor

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
