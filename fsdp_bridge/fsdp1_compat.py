"""What FSDP1's constructor arguments mean, as bridge config values (``BridgeConfig.from_fsdp1``).

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

This module turns FSDP1's objects into plain field values (what a YAML file would hold) and knows nothing of
the config type: it sits below ``config.py`` in the layers (pyproject.toml), and ``BridgeConfig.from_fsdp1`` is
the constructor that hands its values to the config's own validation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch
from torch.distributed.fsdp import CPUOffload, MixedPrecision
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.strategy import FSDP1_PARAMETERS

__all__ = [
    "FSDP1_KWARGS",
    "describe_policy",
    "fsdp1_policy_units",
    "positional_fsdp1_arguments",
    "runtime_ignored_objects",
    "runtime_mesh_arguments",
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

FSDP1_POSITIONAL = FSDP1_PARAMETERS[1:]
"""FullyShardedDataParallel's parameters after ``module``, in its constructor's order (positional arguments
of :meth:`BridgeConfig.from_fsdp1`, as ``FSDP(module, *args, **kwargs)`` passes them)."""


def positional_fsdp1_arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` with FSDP1's positional arguments after ``module`` named (:data:`FSDP1_POSITIONAL`).

    Raises:
        ConfigError: more positional arguments than FSDP1 takes, or one also given by keyword.
    """
    problems: list[Problem] = []
    if len(args) > len(FSDP1_POSITIONAL):
        problems.append(
            Problem(
                "positional arguments",
                len(args),
                f"at most {len(FSDP1_POSITIONAL)} after the module ({', '.join(FSDP1_POSITIONAL)})",
                "pass the module to shard(), the rest as FSDP1 takes them",
            )
        )
    named = dict(zip(FSDP1_POSITIONAL, args, strict=False))
    problems += [
        Problem(key, kwargs[key], "one value, by position or by keyword", f"drop {key}= or the positional argument")
        for key in named
        if key in kwargs
    ]
    if problems:
        raise ConfigError(problems)
    return {**named, **kwargs}


_SIZE_BASED_DEFAULT = 100_000_000  # size_based_auto_wrap_policy's own default min_num_params


def _partial_of(policy: object, fn: Callable[..., Any]) -> functools.partial[Any] | None:
    return policy if isinstance(policy, functools.partial) and policy.func is fn else None


def _class_names(classes: Iterable[object]) -> tuple[str, ...]:
    return tuple(sorted(c.__name__ if isinstance(c, type) else str(c) for c in classes))


def _in_stable_order(classes: Iterable[object]) -> list[object]:
    """FSDP1's class set as a list in the same order in every process: a set's order follows the classes' hashes
    (their addresses), which differ between ranks, and ``shard()`` compares the config across ranks."""
    return sorted(
        classes,
        key=lambda c: (
            (getattr(c, "__module__", ""), getattr(c, "__qualname__", str(c))) if isinstance(c, type) else ("", str(c))
        ),
    )


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
        if inner:
            return f"{name}(policies=[{inner}])"
        args = ", ".join(f"{k}={_stable_text(v)}" for k, v in sorted(policy.keywords.items()))
        return f"{name}({args})"
    return getattr(policy, "__qualname__", type(policy).__name__)


def _stable_text(value: object) -> str:
    """``value`` as text that is the same in every process: a set of classes (``_module_wrap_policy``'s
    ``module_classes``) in name order, where its own repr follows the classes' addresses, which differ between
    ranks (``shard()`` compares the config's text across ranks)."""
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, set | frozenset):
        return "{" + ", ".join(sorted(_stable_text(v) for v in value)) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_stable_text(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return (
            "{"
            + ", ".join(f"{k!r}: {_stable_text(v)}" for k, v in sorted(value.items(), key=lambda kv: repr(kv[0])))
            + "}"
        )
    if isinstance(value, functools.partial):
        args = ", ".join(f"{k}={_stable_text(v)}" for k, v in sorted(value.keywords.items()))
        return f"{_stable_text(value.func)}({args})"
    text = getattr(value, "__qualname__", None) or repr(value)
    return type(value).__qualname__ if " at 0x" in text else text  # an object's address differs per rank


def _wrap_value(policy: object, problems: list[Problem]) -> object:
    """The bridge ``wrap`` value meaning what ``policy`` means to FSDP1."""
    if policy is None:
        return "none"
    if (p := _partial_of(policy, transformer_auto_wrap_policy)) is not None:
        classes = p.keywords.get("transformer_layer_cls")
        if not classes:
            problems.append(Problem("auto_wrap_policy", describe_policy(policy), "transformer_layer_cls={LayerClass}"))
            return "none"
        return _in_stable_order(classes)
    if (p := _partial_of(policy, size_based_auto_wrap_policy)) is not None:
        extra = {k: v for k, v in p.keywords.items() if k != "min_num_params"}
        if not extra:
            return {"min_num_params": p.keywords.get("min_num_params", _SIZE_BASED_DEFAULT)}  # the config checks it
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
        return _in_stable_order(policy._module_classes)
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
    children left over. It runs on the unsharded model: a policy that ignores ``nonwrapped_numel`` and
    counts ``module.parameters()`` itself sees wrapped children whole here, where FSDP1 (which shards each
    child as it wraps it) showed it the children's shards, so such a policy may choose more units than
    FSDP1 did (FSDP1's choice then depends on the world size); the numbers trained are the same.
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
    # FSDP1 reads `mixed_precision or MixedPrecision()`: any false value (None, False) is full precision
    if not mp:
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
    # FSDP1 reads `cpu_offload or CPUOffload()`: any false value (None, False) is no offload
    if not offload:
        return False
    if not isinstance(offload, CPUOffload):
        problems.append(Problem("cpu_offload", offload, "None, False or CPUOffload(offload_params=...)"))
        return False
    return bool(offload.offload_params)


def _init_notes(kwargs: Mapping[str, Any]) -> list[str]:
    """What the report says about ``use_orig_params`` and ``param_init_fn``, which have no config field."""
    notes: list[str] = []
    if "use_orig_params" in kwargs and not kwargs["use_orig_params"]:
        notes.append(
            "use_orig_params=False: the bridge keeps original parameters on both backends (FSDP2 always "
            "does); optimizers see the model's own parameters"
        )
    if kwargs.get("param_init_fn") is not None:
        # FSDP1 calls param_init_fn only on modules that hold meta-device tensors; shard() does the same, in
        # FSDP1's order, before sharding (and then broadcasts rank 0's weights under sync_module_states).
        notes.append(
            "param_init_fn: called as FSDP1 calls it, on each rank's meta-device modules only, in FSDP1's "
            "order, before sharding"
        )
    return notes


def _backward_prefetch_value(value: object, notes: list[str]) -> object:
    """FSDP1's meaning of ``backward_prefetch=value``: FSDP1 compares it with its two BackwardPrefetch members,
    so None and any other value (``True``, a string, a number) prefetch nothing."""
    if value is None or isinstance(value, TorchBackwardPrefetch):
        return value
    notes.append(
        f"backward_prefetch={value!r}: FSDP1 prefetches only for BackwardPrefetch.BACKWARD_PRE / BACKWARD_POST "
        "and takes any other value as no prefetch; kept as none (write BackwardPrefetch.BACKWARD_PRE for "
        "FSDP2's usual overlap)"
    )
    return None


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
        # FSDP1 reads `sharding_strategy or ShardingStrategy.FULL_SHARD`: any false value is FULL_SHARD
        out["strategy"] = "full_shard" if not kwargs["sharding_strategy"] else kwargs["sharding_strategy"]
    # FSDP1 without a policy wraps only the root
    out["wrap"] = _wrap_value(kwargs["auto_wrap_policy"], problems) if "auto_wrap_policy" in kwargs else "none"
    notes = _init_notes(kwargs)
    init_fn = kwargs.get("param_init_fn")
    if init_fn is not None and not callable(init_fn):
        # FSDP1 refuses it only once a meta-device module reaches it; refused here, before any collective
        problems.append(
            Problem(
                "param_init_fn",
                init_fn,
                "None, or a function to be called on each module holding meta-device tensors (FSDP1 expects it "
                "to be callable)",
                "pass a function taking the module (lambda m: m.to_empty(device=..., recurse=False)), or drop it",
            )
        )
    if "mixed_precision" in kwargs:
        out["mixed_precision"] = _mixed_precision_value(kwargs["mixed_precision"], problems)
        mp = kwargs["mixed_precision"]
        if isinstance(mp, MixedPrecision) and isinstance(out["mixed_precision"], dict):
            # FSDP1 keeps these classes (BatchNorm by default) in full precision under an auto-wrap policy only
            policy = kwargs.get("auto_wrap_policy") is not None
            kept = _class_names(mp._module_classes_to_ignore) if policy else ()
            out["mixed_precision"]["full_precision_modules"] = kept
    if "cpu_offload" in kwargs:
        out["cpu_offload"] = _cpu_offload_value(kwargs["cpu_offload"], problems)
    if "backward_prefetch" in kwargs:
        out["backward_prefetch"] = _backward_prefetch_value(kwargs["backward_prefetch"], notes)
    for key in ("forward_prefetch", "limit_all_gathers", "sync_module_states"):
        if key in kwargs:
            out[key] = bool(kwargs[key])
    if "device_id" in kwargs:
        out["device"] = _device_value(kwargs["device_id"], problems)
    ignored = _ignored_value(kwargs, problems)
    if ignored is not None:
        out["ignored_modules"] = ignored
    problems += _process_group_problems(kwargs.get("process_group"))
    if problems:
        raise ConfigError(problems)
    return out, notes
