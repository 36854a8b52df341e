"""Resolve a :class:`~fsdp_bridge.config.WrapPolicy` to the concrete modules to shard.

Both backends shard exactly the units resolved here (FSDP1 through a ``CustomPolicy``,
FSDP2 by calling ``fully_shard`` on each, bottom-up), so a model is split the same way
whichever backend runs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from fsdp_bridge.config import WrapPolicy
from fsdp_bridge.errors import ConfigError, Problem

__all__ = [
    "WrapPlan",
    "disable_kv_cache",
    "in_post_order",
    "module_names",
    "no_split_module_classes",
    "one_dtype_per_unit",
    "resolve_ignored",
    "resolve_ignored_params",
    "resolve_wrap",
]

# FSDP1's size-based policy never wraps containers and does not look inside these.
_NEVER_WRAP = (nn.ModuleList, nn.ModuleDict)
_FORCE_LEAF = (nn.MultiheadAttention,)


@dataclass
class WrapPlan:
    """The units to shard, in post-order (children before parents), root excluded."""

    units: list[tuple[str, nn.Module]]
    source: str
    """How the units were chosen, for the report."""
    notes: list[str] = field(default_factory=list)
    """Adjustments made (e.g. units merged to keep tied parameters together)."""
    dtype_units: list[nn.Module] = field(default_factory=list)
    """Modules made units of their own so that every unit holds one dtype (FSDP1; not in
    :attr:`units`, so activation checkpointing does not wrap them)."""

    @property
    def modules(self) -> list[nn.Module]:
        return [m for _, m in self.units]


def no_split_module_classes(model: nn.Module) -> list[str]:
    """The classes a Hugging Face model asks never to split, which ``wrap: auto`` makes units.

    Args:
        model: any module.

    Returns:
        The ``_no_split_modules`` class names of the model or of its first submodule that has
        them, without repeats; empty when none does.
    """
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if names:
            return list(dict.fromkeys(names))
    return []


def disable_kv_cache(model: nn.Module) -> bool:
    """Turn off the KV cache (activation checkpointing recomputes layers, and a cache
    filled twice would change shapes).

    Args:
        model: any module; every submodule whose ``config.use_cache`` is true gets it set to False.

    Returns:
        Whether anything was changed.
    """
    changed = False
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", False):
            config.use_cache = False
            changed = True
    return changed


def _module_classes(model: nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules()})


def _post_order(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in model.named_children():
        path = f"{prefix}.{name}" if prefix else name
        yield from _post_order(child, path)
        yield path, child


def _by_classes(model: nn.Module, classes: tuple[str, ...], *, subclasses: bool = False) -> list[tuple[str, nn.Module]]:
    """The modules whose class has one of the names ``classes`` (``subclasses``: or a base class of theirs, as
    FSDP1's class policies test with ``isinstance``), children before parents."""
    wanted = set(classes)
    return [(n, m) for n, m in _post_order(model) if wanted & _names_of(type(m), subclasses)]


def _names_of(cls: type, subclasses: bool) -> set[str]:
    """``cls``'s name, and with ``subclasses`` those of its base classes below ``nn.Module`` (``Module`` and
    ``object`` name every module: never a wrap class)."""
    if not subclasses:
        return {cls.__name__}
    return {c.__name__ for c in cls.__mro__ if c not in (nn.Module, object)}


def _by_min_params(model: nn.Module, min_num_params: int, ignored: set[nn.Parameter]) -> list[tuple[str, nn.Module]]:
    """FSDP1 ``size_based_auto_wrap_policy`` semantics: wrap children first; wrap a module
    when the parameters in its subtree not already in a wrapped child reach the minimum."""
    units: list[tuple[str, nn.Module]] = []

    def numel(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters() if p not in ignored)

    def visit(module: nn.Module, path: str) -> int:
        """Returns the number of parameters wrapped inside ``module`` (itself included)."""
        if isinstance(module, _FORCE_LEAF):
            wrapped = 0
        else:
            wrapped = sum(visit(c, f"{path}.{n}" if path else n) for n, c in module.named_children())
        remainder = numel(module) - wrapped
        if path and not isinstance(module, _NEVER_WRAP) and remainder >= min_num_params:
            units.append((path, module))
            return wrapped + remainder
        return wrapped

    visit(model, "")
    return units


def _repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of every ModuleList with two or more entries (transformer blocks)."""
    names = {n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) >= 2}
    return [(n, m) for n, m in _post_order(model) if n.rpartition(".")[0] in names and not isinstance(m, _NEVER_WRAP)]


def one_dtype_per_unit(
    model: nn.Module, units: list[nn.Module], ignored: list[nn.Module] | None = None
) -> tuple[list[nn.Module], list[str]]:
    """Modules to shard as units of their own so that every unit (the root too) holds parameters
    of one dtype, as FSDP1's flat parameters require: e.g. the fp32 LoRA adapters inside a bf16
    base model's layers.

    In each unit whose own parameters (those not in a nested unit) mix dtypes, the dtype holding
    most elements stays; the module directly owning each other parameter becomes a unit.

    Returns:
        The added modules (to merge with ``units`` in post-order) and a note for the report.

    Raises:
        ConfigError: when a module's own parameters mix dtypes (it cannot be split further).
    """
    unit_ids = {id(u) for u in units}
    skip = {id(p) for m in ignored or [] for p in m.parameters()}
    names = {id(m): n or "(root)" for n, m in model.named_modules()}
    owner: dict[int, nn.Module] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                owner.setdefault(id(p), m)

    def own_params(unit: nn.Module) -> list[nn.Parameter]:
        out: list[nn.Parameter] = []
        stack = [unit]
        while stack:
            m = stack.pop()
            out.extend(p for p in m._parameters.values() if p is not None and id(p) not in skip and p.dim() > 0)
            stack.extend(c for c in m.children() if id(c) not in unit_ids)
        return out

    added: dict[int, nn.Module] = {}
    problems: list[Problem] = []
    for unit in [*units, model]:
        params = list({id(p): p for p in own_params(unit)}.values())
        counts: dict[torch.dtype, int] = {}
        for p in params:
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
        if len(counts) < 2:
            continue
        keep = max(counts, key=lambda d: counts[d])
        for p in params:
            if p.dtype == keep:
                continue
            m = owner[id(p)]
            mixed = {q.dtype for q in m._parameters.values() if q is not None}
            if m is unit or len(mixed) > 1:
                problems.append(
                    Problem(
                        "model",
                        f"{names[id(m)]} holds {', '.join(sorted(map(str, mixed)))} parameters",
                        "one dtype per module's own parameters (FSDP1 flattens a unit's parameters into one tensor)",
                        f"cast {names[id(m)]} to one dtype, or use backend: fsdp2",
                    )
                )
                continue
            added[id(m)] = m
    if problems:
        raise ConfigError(list({(p.key, str(p.value)): p for p in problems}.values()))
    if not added:
        return [], []
    dtypes = sorted({str(p.dtype) for m in added.values() for p in m.parameters()})
    examples = ", ".join(names[i] for i in list(added)[:2])
    note = (
        f"{len(added)} modules holding {'/'.join(dtypes)} parameters inside units of another dtype made units "
        f"of their own (FSDP1 needs one dtype per unit): {examples}{', ...' if len(added) > 2 else ''}"
    )
    return list(added.values()), [note]


def full_precision_modules(model: nn.Module, classes: tuple[str, ...], outside: list[nn.Module]) -> list[nn.Module]:
    """The modules of ``model`` (root excluded) whose class, or a base class of it, has one of the names
    ``classes`` (FSDP1's ``_module_classes_to_ignore`` tests with isinstance), children before parents;
    none inside ``outside`` (ignored modules, units sharded already)."""
    if not classes:
        return []
    wanted = set(classes)
    skipped = {id(m) for o in outside for m in o.modules()}
    return [
        m for _, m in _post_order(model) if id(m) not in skipped and any(c.__name__ in wanted for c in type(m).__mro__)
    ]


def in_post_order(model: nn.Module, modules: list[nn.Module]) -> list[nn.Module]:
    """``modules`` (root excluded) ordered children before parents, as the backends shard them."""
    wanted = {id(m) for m in modules}
    return [m for _, m in _post_order(model) if id(m) in wanted]


def _keep_tied_together(
    model: nn.Module, units: list[tuple[str, nn.Module]]
) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """Drop units that would put one parameter into two sharding groups.

    torch >= 2.12 refuses a parameter shared by two ``fully_shard`` groups, and FSDP1
    would flatten it twice; dropping the unit lets the parameter fall to a common parent. A module
    reached by two paths (``model.lm_head`` also held as ``model.base.lm_head``) stays a unit of its own,
    as FSDP1 wraps it once: its parameters are in that one group whichever path calls it.
    """
    paths = {id(m): n for n, m in model.named_modules()}
    owners: dict[int, list[str]] = {}
    holders: dict[int, set[int]] = {}  # parameter -> the modules holding it
    for path, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(path)
                holders.setdefault(id(p), set()).add(id(module))
    shared = [(sorted(set(paths_)), holders[key]) for key, paths_ in owners.items() if len(set(paths_)) > 1]
    notes: list[str] = []
    if not shared:
        return units, notes

    def inside(path: str, unit: str) -> bool:
        return path == unit or path.startswith(unit + ".")

    unit_paths = [paths.get(id(m), n) for n, m in units]
    unit_ids = {paths.get(id(m), n): id(m) for n, m in units}
    dropped: set[str] = set()
    changed = True
    while changed:
        changed = False
        live = [u for u in unit_paths if u not in dropped]
        live_ids = {unit_ids[u] for u in live}
        for owner_paths, holding in shared:
            if len(holding) == 1 and holding <= live_ids:
                continue  # one module reached by several paths, a unit itself: its parameters are in its group
            for unit in live:
                holds = [inside(o, unit) for o in owner_paths]
                if any(holds) and not all(holds) and unit not in dropped:
                    dropped.add(unit)
                    changed = True
                    notes.append(
                        f"{unit} is not a unit of its own: it shares a parameter with "
                        f"{', '.join(o for o, h in zip(owner_paths, holds, strict=True) if not h)} (tied weights)"
                    )
    kept: list[tuple[str, nn.Module]] = []
    for n, m in units:  # a module reached by two paths is one unit
        if paths.get(id(m), n) not in dropped and all(m is not k for _, k in kept):
            kept.append((n, m))
    return kept, notes


def resolve_ignored(model: nn.Module, names: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """Modules named by path or class name; raises ConfigError for names that match nothing.
    Parameter paths (FSDP1's ``ignored_states`` may hold parameters) are left to
    :func:`resolve_ignored_params`."""
    found: list[tuple[str, nn.Module]] = []
    problems: list[Problem] = []
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    for name in names:
        hits = (
            [(name, modules[name])]
            if name in modules
            else [(n, m) for n, m in modules.items() if type(m).__name__ == name and n]
        )
        if not hits and name not in params:
            problems.append(
                Problem(
                    "ignored_modules",
                    name,
                    "a module path, class name or parameter path in the model",
                    f"the model's top-level modules are: {', '.join(n for n, _ in model.named_children())}",
                )
            )
        found.extend(hits)
    if problems:
        raise ConfigError(problems)
    return found


def resolve_ignored_params(model: nn.Module, names: tuple[str, ...]) -> list[nn.Parameter]:
    """The parameters named by path among ``names`` (not modules: FSDP1's ``ignored_states`` of
    parameters; FSDP2's ``ignored_params``)."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    return [params[n] for n in names if n in params and n not in modules]


def resolve_wrap(model: nn.Module, policy: WrapPolicy, *, ignored: list[nn.Module] | None = None) -> WrapPlan:
    """The units ``policy`` selects in ``model``.

    Raises:
        ConfigError: when named classes are not in the model (the message lists the
            classes it does contain and the model's ``_no_split_modules``).
    """
    ignored = ignored or []
    ignored_params = {p for m in ignored for p in m.parameters()}
    no_split = no_split_module_classes(model)
    if policy.mode == "none":
        units, source = [], "none: the root is the only unit"
    elif policy.mode == "auto":
        present = [c for c in no_split if any(type(m).__name__ == c for m in model.modules())]
        if present:
            units, source = _by_classes(model, tuple(present)), f"auto: _no_split_modules {present}"
        else:
            units, source = (
                _repeated_blocks(model),
                "auto: the entries of the model's ModuleLists (no _no_split_modules)",
            )
    elif policy.mode == "classes":
        present_classes = set(_module_classes(model))
        # a class name covers its subclasses, as FSDP1's isinstance does
        matched = set().union(*(_names_of(type(m), True) for m in model.modules()))
        missing = [c for c in policy.classes if c not in matched]
        if missing and not policy.absent_ok:
            hint = f"; its _no_split_modules are {no_split} (or use wrap: auto)" if no_split else "; or use wrap: auto"
            raise ConfigError(
                [
                    Problem(
                        "wrap",
                        c,
                        f"a module class the model contains: {', '.join(sorted(present_classes))}",
                        f"use one of the model's classes{hint}",
                    )
                    for c in missing
                ]
            )
        units, source = _by_classes(model, policy.classes, subclasses=True), f"classes {list(policy.classes)}"
        if missing:  # classes given as Python classes the model lacks: they wrap nothing, as in FSDP1
            source += f" ({', '.join(missing)} not in the model: nothing wrapped for them, as FSDP1's policy)"
    elif policy.mode == "min_params":
        units = _by_min_params(model, policy.min_num_params, ignored_params)
        source = f"min_num_params {policy.min_num_params}"
    else:
        assert policy.fn is not None  # guaranteed by the config parser
        fn = policy.fn
        resolve_units = getattr(fn, "resolve_units", None)
        if callable(resolve_units):
            # A policy that decides over the whole model (FSDP1's recursion, for a policy
            # function given to BridgeConfig.from_fsdp1), not module by module.
            chosen = {id(m) for m in resolve_units(model, ignored)}
            units = [(n, m) for n, m in _post_order(model) if id(m) in chosen]
        else:
            units = [(n, m) for n, m in _post_order(model) if fn(m)]
        source = f"callable {getattr(fn, '__qualname__', repr(fn))}"

    def in_ignored(path: str) -> bool:
        return any(path == ip or path.startswith(ip + ".") for ip, _ in ignored_named)

    ignored_named = [(n, m) for n, m in model.named_modules() if any(m is i for i in ignored)]
    units = [(n, m) for n, m in units if not in_ignored(n)]
    containers = [n for n, m in units if isinstance(m, _NEVER_WRAP)]
    units = [(n, m) for n, m in units if not isinstance(m, _NEVER_WRAP)]
    units, notes = _keep_tied_together(model, units)
    if containers:
        # FSDP1 wraps a ModuleList a policy function chooses (its entries, wrapped first, leave it nothing to
        # gather); fully_shard refuses a container that runs no forward of its own
        notes = [
            *notes,
            f"not units: {', '.join(containers)} (a ModuleList/ModuleDict runs no forward for fully_shard to hook; "
            "their entries chosen by the policy are units, anything else they hold goes to the enclosing unit)",
        ]
    return WrapPlan(units=units, source=source, notes=notes)


def module_names(model: nn.Module, modules: object) -> list[str]:
    """The paths in ``model`` of the given module objects, for ``BridgeConfig(ignored_modules=...)``.

    FSDP1 takes ``ignored_modules`` as module objects; the bridge's config takes names, so a
    config stays plain data. ``migrate code --fix`` writes
    ``ignored_modules=fsdp_bridge.module_names(model, <the FSDP1 value>)`` where the value is
    known only at run time.

    Args:
        model: the model about to be sharded.
        modules: module objects inside ``model`` (any iterable), or None. An object that is not in
            ``model`` is left out, as FSDP1 ignores it too (there is nothing of it to leave unsharded).

    Returns:
        Their dotted paths (``["lm_head", "model.embed_tokens"]``); empty for None.

    Raises:
        ConfigError: the model itself among them (FSDP1 would leave every parameter unsharded).
    """
    if modules is None:
        return []
    if isinstance(modules, (nn.Module, nn.Parameter)):
        modules = [modules]
    paths = {id(m): n for n, m in model.named_modules()}
    paths.update({id(p): n for n, p in model.named_parameters()})
    out: list[str] = []
    problems: list[Problem] = []
    for module in modules:  # type: ignore[attr-defined]
        name = paths.get(id(module))
        if name is None:
            continue  # not in this model: FSDP1 has nothing of it to ignore either
        if not name:
            problems.append(
                Problem(
                    "ignored_modules",
                    type(module).__name__,
                    "a submodule or parameter of the model being sharded (not the model itself)",
                    "pass modules or parameters taken from this model (e.g. model.lm_head), or their names",
                )
            )
        else:
            out.append(name)
    if problems:
        raise ConfigError(problems)
    return out
