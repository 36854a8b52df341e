"""The shared analysis of a source tree for ``migrate code``: where each name comes from (FSDP1's
qualified names), what other files of the tree define (:class:`Dispatch`), the planned conversion of a
constructor call, and small helpers over libcst nodes."""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import libcst as cst
import libcst.matchers as m
from libcst.metadata import (
    FunctionScope,
    GlobalScope,
    MetadataWrapper,
    PositionProvider,
    QualifiedName,
    QualifiedNameProvider,
    QualifiedNameSource,
    ScopeProvider,
)

from fsdp_bridge.migrate._names import FSDP, FSDP_METHODS, NAMES, TODO


def resolve_fsdp(qnames: Iterable[Any]) -> tuple[str, str] | None:
    """(kind, member) for an FSDP1 qualified name, e.g. ("FullyShardedDataParallel", "state_dict_type")."""
    for q in qnames:
        name: str = q.name
        if not name.startswith("torch.distributed."):
            continue
        if name == "torch.distributed.fsdp.wrap.wrap":
            return "wrap", ""  # the module path holds "wrap" too: only the function itself is this name
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in NAMES and part not in FSDP_METHODS and (part != "wrap" or i == len(parts) - 1):
                rest = parts[i + 1 :]
                return part, rest[0] if rest else ""
    return None


ALIAS_ASSIGN = re.compile(r"^[ \t]*\w+[ \t]*=[ \t]*(?:[\w.]*\.)?FullyShardedDataParallel[ \t]*(?:#.*)?$", re.M)


@dataclass
class ClassAliases:
    """``FSDP = FullyShardedDataParallel`` (module or function level, the name never bound again in that
    scope): every use of the name stands for FSDP1's class, as with ``import ... as FSDP``."""

    names: dict[int, frozenset[QualifiedName]] = field(default_factory=dict)
    """id(Name or Attribute through an alias) -> the qualified names it stands for (torch's)."""
    assignments: dict[int, tuple[str, int, str]] = field(default_factory=dict)
    """id(the alias's Assign) -> (the alias, its line, the code of its value)."""


_PARSED: OrderedDict[str, MetadataWrapper] = OrderedDict()
"""The last few files parsed, by source text: each is read by several passes (the tree-wide analyses, then its
own migration), and parsing and resolving its scopes and qualified names is most of what a pass costs."""
_PARSED_KEPT = 8
_ALIASES: dict[int, tuple[MetadataWrapper, ClassAliases]] = {}  # id(a wrapper _PARSED keeps) -> its aliases


def parsed(code: str) -> MetadataWrapper:
    """``code`` parsed, in a wrapper whose resolved metadata the passes over the same text share (it raises
    what ``cst.parse_module`` raises). The passes only read the tree; a rewrite builds a new one."""
    wrapper = _PARSED.pop(code, None)
    if wrapper is None:
        wrapper = MetadataWrapper(cst.parse_module(code), unsafe_skip_copy=True)
    _PARSED[code] = wrapper
    while len(_PARSED) > _PARSED_KEPT:
        _ALIASES.pop(id(_PARSED.popitem(last=False)[1]), None)
    return wrapper


def class_aliases(wrapper: MetadataWrapper) -> ClassAliases:
    """The aliases of FSDP1's wrapper class a module binds (see :class:`ClassAliases`); a name assigned twice
    in its scope (re-bound, assigned in another branch, declared ``global`` and assigned elsewhere) is not one.
    Found once per wrapper that :func:`parsed` keeps."""
    known = _ALIASES.get(id(wrapper))
    if known is not None and known[0] is wrapper:
        return known[1]
    found = _class_aliases(wrapper)
    if any(w is wrapper for w in _PARSED.values()):
        _ALIASES[id(wrapper)] = (wrapper, found)
    return found


def _class_aliases(wrapper: MetadataWrapper) -> ClassAliases:
    found = ClassAliases()
    code = wrapper.module.code
    if RIVAL_IMPORT.search(code) is not None:
        _rival_branches(wrapper, found)
    if ALIAS_ASSIGN.search(code) is None:
        _extend_to_attributes(wrapper, found)
        return found
    scopes = wrapper.resolve(ScopeProvider)
    qualified = wrapper.resolve(QualifiedNameProvider)
    for node in walk(wrapper.module):
        if not (
            isinstance(node, cst.Assign) and len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name)
        ):
            continue
        names = qualified.get(node.value, set())
        names = names() if callable(names) else names  # libcst resolves some lazily
        classes = frozenset(
            QualifiedName(q.name, QualifiedNameSource.IMPORT) for q in names if resolve_fsdp([q]) == (FSDP, "")
        )
        target = cast(cst.Name, node.targets[0].target)
        scope = scopes.get(target)
        scope = scope() if callable(scope) else scope
        if not classes or not isinstance(scope, (GlobalScope, FunctionScope)):
            continue
        bindings = scope.assignments[target.value]
        if len(bindings) != 1:
            continue
        line = wrapper.resolve(PositionProvider)[node].start.line
        found.assignments[id(node)] = (target.value, line, code_of(node.value))
        for access in next(iter(bindings)).references:
            found.names[id(access.node)] = classes
    _extend_to_attributes(wrapper, found)
    return found


def _extend_to_attributes(wrapper: MetadataWrapper, found: ClassAliases) -> None:
    """``FSDP.state_dict_type`` where ``FSDP`` is in ``found``: the member of what the name stands for."""
    if not found.names:
        return
    for node in walk(wrapper.module):
        base: cst.BaseExpression = node if isinstance(node, cst.Attribute) else cst.Name("_")
        parts: list[str] = []
        while isinstance(base, cst.Attribute):
            parts.insert(0, base.attr.value)
            base = base.value
        if parts and id(base) in found.names:
            found.names[id(node)] = frozenset(
                QualifiedName(".".join([q.name, *parts]), q.source) for q in found.names[id(base)]
            )


RIVALS = ("torch_xla.distributed.fsdp.", "fairscale.nn.")
"""Other libraries' FSDP classes that code imports under FSDP1's name in a ``try``/``except ImportError``."""
RIVAL_IMPORT = re.compile(r"^\s*(?:from|import)\s+(?:torch_xla\.distributed\.fsdp|fairscale\.nn)\b", re.M)


def _rival_branches(wrapper: MetadataWrapper, found: ClassAliases) -> None:
    """``try: import torch_xla... as xm; from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as
    FSDP`` / ``except ImportError: from torch.distributed.fsdp import FullyShardedDataParallel as FSDP; xm =
    None``: ``FSDP`` names either class. Under ``if xm:`` (a name only the rival's side imports; ``is not None``,
    ``not``, ``else`` too) it is the other library's: its uses there resolve to that class alone, not FSDP1's."""
    qualified = wrapper.resolve(QualifiedNameProvider)

    def qnames(node: cst.CSTNode) -> set[QualifiedName]:
        names = qualified.get(node, set())
        return set(names() if callable(names) else names)

    def imported(block: Sequence[cst.BaseStatement] | Sequence[cst.BaseSmallStatement]) -> dict[str, str]:
        """name -> the module or object it imports, for the imports of ``block``."""
        bound: dict[str, str] = {}
        for stmt in block:
            for small in stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ():
                if isinstance(small, cst.Import):
                    for a in small.names:
                        dotted = code_of(a.name)
                        bound[code_of(a.asname.name) if a.asname else dotted.split(".")[0]] = dotted
                elif isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
                    origin = code_of(small.module) if small.module is not None else ""
                    for a in small.names:
                        bound[code_of(a.asname.name) if a.asname else code_of(a.name)] = f"{origin}.{code_of(a.name)}"
        return bound

    guards: set[str] = set()
    for stmt in wrapper.module.body:
        if not isinstance(stmt, cst.Try):
            continue
        sides = [imported(stmt.body.body), *(imported(h.body.body) for h in stmt.handlers)]
        for i, side in enumerate(sides):
            rival = {n for n, what in side.items() if what.startswith(RIVALS)}
            others = [o for j, o in enumerate(sides) if j != i]
            if any(any(n in o and o[n].startswith("torch.distributed.fsdp") for o in others) for n in rival):
                guards |= {n for n, what in side.items() if n not in rival and all(n not in o for o in others)}
    if not guards:
        return

    def rival_side(test: cst.BaseExpression) -> bool | None:
        """True: the test holds where the rival is imported; False: where it is not; None: not such a test."""
        if isinstance(test, cst.Name) and test.value in guards:
            return True
        if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
            inner = rival_side(test.expression)
            return None if inner is None else not inner
        if (
            isinstance(test, cst.Comparison)
            and isinstance(test.left, cst.Name)
            and test.left.value in guards
            and len(test.comparisons) == 1
            and m.matches(test.comparisons[0].comparator, m.Name("None"))
        ):
            op = test.comparisons[0].operator
            return True if isinstance(op, cst.IsNot) else False if isinstance(op, cst.Is) else None
        return None

    for node in walk(wrapper.module):
        if not isinstance(node, cst.If) or (holds := rival_side(node.test)) is None:
            continue
        branch = node.body if holds else node.orelse
        if branch is None:
            continue
        for n in walk(branch):
            if isinstance(n, cst.Name) and (names := qnames(n)):
                theirs = {q for q in names if q.name.startswith(RIVALS)}
                if theirs and any(resolve_fsdp([q]) is not None for q in names):
                    found.names[id(n)] = frozenset(theirs)


def fsdp1_class_reexports(code: str, path: str) -> dict[str, str]:
    """The names by which other files may import FSDP1's class from this file (``Dispatch.reexports``): a
    module-level ``from torch.distributed.fsdp[...] import FullyShardedDataParallel [as X]``, read without
    parsing."""
    found: dict[str, str] = {}
    for match in REEXPORTED_CLASS.finditer(code):
        module, names = match.group(1), match.group(2).replace("(", " ").replace(")", " ").replace("\\", " ")
        for part in names.split(","):
            words = part.split("#", 1)[0].split()
            if not words or words[0] != FSDP:
                continue
            alias = words[2] if len(words) == 3 and words[1] == "as" else FSDP
            for name in module_suffixes(path, [alias]):
                found[name] = f"{module}.{FSDP}"
    return found


REEXPORTED_CLASS = re.compile(r"^from\s+(torch\.distributed\.fsdp(?:\.[\w.]+)?)\s+import\s+(\([^)]*\)|[^\n]*)", re.M)
"""A module-level import from torch's FSDP package (its names, parenthesized over lines or on one line)."""


def with_reexports(wrapper: MetadataWrapper, aliases: ClassAliases, reexports: dict[str, str]) -> ClassAliases:
    """``aliases`` and the names of this module imported from another file of the tree that binds FSDP1's class
    (``from utils.distributed import FSDP``; ``from ..optim import fsdp`` then ``fsdp.FSDP``; see
    ``Dispatch.reexports``): ``FSDP.state_dict_type(...)`` there is FSDP1's own, as where the file imports it
    from torch."""
    if not reexports:
        return aliases
    qualified = wrapper.resolve(QualifiedNameProvider)
    found = ClassAliases(names=dict(aliases.names), assignments=aliases.assignments)
    added = False
    for node in walk(wrapper.module):
        if not isinstance(node, (cst.Name, cst.Attribute)) or id(node) in found.names:
            continue
        names = qualified.get(node, set())
        names = names() if callable(names) else names
        torch_names = frozenset(
            QualifiedName(torch_name, QualifiedNameSource.IMPORT)
            for q in names
            if q.source is QualifiedNameSource.IMPORT and (torch_name := _reexported(q.name, reexports)) is not None
        )
        if torch_names:
            found.names[id(node)] = torch_names
            added = True
    return found if added else aliases


def _reexported(name: str, reexports: dict[str, str]) -> str | None:
    """Torch's qualified name for ``name`` (as libcst resolves it: ``utils.distributed.FSDP``, a member
    ``utils.distributed.FSDP.state_dict_type``, a module's attribute ``..optim.fsdp.FSDP``) where it reaches FSDP1's
    class through a file of the tree, else None."""
    name = name.lstrip(".")
    if name in reexports:
        return reexports[name]
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:i])
        if head in reexports:
            return ".".join([reexports[head], *parts[i:]])
    return None


class FollowsAliases(cst.CSTVisitor):
    """A visitor whose qualified names see through the module's aliases of FSDP1's class
    (:func:`class_aliases`): ``FSDP(...)``, ``FSDP.optim_state_dict`` resolve to torch's names."""

    aliases: ClassAliases = ClassAliases()

    def get_metadata(self, key: Any, node: cst.CSTNode, *default: Any) -> Any:
        if key is QualifiedNameProvider and (names := self.aliases.names.get(id(node))) is not None:
            return names
        return super().get_metadata(key, node, *default)


@dataclass
class Dispatch:
    """Functions of the migrated tree that tell the two backends apart, found by reading their bodies.

    ``versions``: ``def f(m)`` with ``if isinstance(m, FSDP): return 1`` and ``if isinstance(m, FSDPModule):
    return 2`` (the two literals); ``fsdp2_tests``: predicates true only for FSDP2 modules (every ``return``
    gives a bool literal or an ``isinstance(..., FSDPModule)`` test, and FSDP1's class is not mentioned).
    """

    versions: dict[str, tuple[int, int]] = field(default_factory=dict)
    fsdp2_tests: set[str] = field(default_factory=set)
    own_methods: dict[str, str] = field(default_factory=dict)  # "clip_grad_norm_" -> the file defining the tree's own
    sets_state_dict_type: str | None = None  # a file of the tree that calls FSDP.set_state_dict_type
    unfollowed_set_state_dict_type: str | None = None
    """A file of the tree with a ``set_state_dict_type`` call not rewritten to fsdp_bridge's (a LOCAL or SHARDED
    type written out, a receiver not shown to be FSDP1's): the state-dict calls that follow the type stay TODOs."""
    bridge_sets_state_dict_type: str | None = None
    """A file of the tree with a ``set_state_dict_type`` call that becomes ``fsdp_bridge.set_state_dict_type``
    whatever else the tree holds (FULL_STATE_DICT, or a type known only at run time): SHARDED ones then become
    the bridge's too (see :func:`bridge_set_state_dict_type`)."""
    makes_state_dict_context: str | None = None  # a file of the tree that calls FSDP.state_dict_type
    group_fsdp: str | None = None  # a file of the tree passing process_group= (FSDP over some ranks)
    asks_backend: str | None = None
    """A file of the tree calling ``get_backend`` (``"cuda:nccl,cpu:gloo"`` would not compare equal to ``"nccl"``)."""
    mixed_precision: str | None = None
    """A file of the tree passing FSDP1 a ``mixed_precision=`` other than ``None`` (FSDP2's unshard then gathers
    in its ``param_dtype``, where FSDP1's ``summon_full_params`` gathered full precision)."""
    offloads_params: str | None = None
    """A file of the tree wrapping with ``CPUOffload(offload_params=True)`` (FSDP2's gradients are then CPU
    DTensors, whose collectives need a CPU backend in the process group)."""
    subclasses_fsdp1: str | None = None  # a file of the tree defining a subclass of FSDP1's wrapper (stays FSDP1)
    keeps_fsdp1: str | None = None
    """A file of the tree that picks FSDP1's class by a conditional expression and calls it
    (``(FSDP if ok else Plain)(m, ...)``): left as written, its models stay FSDP1's, which ``--target torch``'s
    plain-torch helpers (for fully_shard's models) do not serve."""
    wraps_fsdp1: str | None = None
    """A file of the tree that names FSDP1's wrapper in its code (comments aside), or calls ``fsdp_bridge.shard``
    (after ``--fix``): the tree makes FSDP1 models, which a duck-typed test elsewhere
    (``hasattr(m, "clip_grad_norm_")``) may be meant for."""
    constructs_fsdp1: str | None = None
    """A file of the tree that makes FSDP1 models itself (``FSDP(...)``, ``partial(FSDP, ...)``,
    ``wrapper_cls=FSDP``; ``fsdp_bridge.shard(...)`` after ``--fix``). A tree with none is handed its FSDP1 models
    by a library (accelerate's FSDP plugin, a Trainer), which may keep making FSDP1 models after the migration."""
    tests_lightning_strategy: str | None = None
    """A file of the tree that names Lightning's ``FSDPStrategy`` other than to import or call it (``isinstance(
    fabric.strategy, FSDPStrategy)``, a subclass): code there tells the strategies apart, and goes the other way
    once the strategy is another class, so ``FSDPStrategy(...)`` is not rewritten."""
    imported_names: set[str] = field(default_factory=set)
    from_imports: set[str] = field(default_factory=set)
    reexports: dict[str, str] = field(default_factory=dict)
    """A name a file of the tree binds by importing torch's FSDP1 class (``from torch.distributed.fsdp import
    FullyShardedDataParallel as FSDP``), as other files import it (``utils.distributed.FSDP``, see
    :func:`module_suffixes`) -> torch's qualified name: ``from utils.distributed import FSDP`` is FSDP1's class."""
    """``module.name`` for every ``from module import name`` of the tree (``module.*`` for a star import;
    leading dots of a relative import dropped): a file's FSDP1 import another file takes from it
    (``from .grad_reduce import *`` then ``isinstance(m, FSDP)``) is kept (see :func:`module_suffixes`)."""
    """Every name some file of the tree imports with ``from ... import NAME``: a module-level variable of that
    name may be used by another file, so its assignment is never removed."""
    fsdp1_factories: set[str] = field(default_factory=set)
    """Functions of the tree that return FSDP1's wrapper (``-> FullyShardedDataParallel``, ``return FSDP(...)``),
    on some path at least, by every dotted suffix of their module path (``wrapped_model.load_model``,
    ``finetune.wrapped_model.load_model``): a file that imports one is handed an FSDP1 model (in their own file the
    usual evidence applies)."""
    fsdp1_sure_factories: set[str] = field(default_factory=set)
    """Those of ``fsdp1_factories`` that return FSDP1's wrapper on every path (see :func:`fsdp1_returns`): their
    result is one, as ``FSDP(...)``'s is. The others (``model = FSDP(model)`` in one branch, ``DDP(model)`` in
    another, then ``return model``) may hand back something else, whose ``.module`` must stay."""

    fsdp1_predicates: set[str] = field(default_factory=set)
    """Top-level functions of the tree whose every ``return`` is ``isinstance(<first parameter>, FSDP)``, by every
    dotted suffix of their module path (as ``fsdp1_factories``): a file that imports one tests for FSDP1's
    wrapper with it (``if is_fsdp_wrapped(model): model.module``)."""

    vendored_functions: dict[str, str] = field(default_factory=dict)
    """Top-level functions of the tree's copies of torch's FSDP1 code (see ``_vendored``), by every dotted suffix
    of their module path as in ``fsdp1_factories`` -> the copy's file: they work on FSDP1 models only."""

    fsdp1_results: dict[str, set[int]] = field(default_factory=dict)
    """Functions of the tree by name -> the positions of their result that are FSDP1 models (-1: the whole
    result): ``return FSDP(...)``, ``return model`` or ``return model, optimizer`` after ``model = FSDP(...)``."""
    fsdp1_args: set[str] = field(default_factory=set)
    """``"train:1"`` / ``"train:model"``: a call in the tree passes a model it wrapped with ``FSDP(...)`` just
    above as that argument of a function of that name (see :func:`find_fsdp1_arguments`)."""

    fsdp1_methods: set[str] = field(default_factory=set)
    """Names of the methods a call of the tree makes on a model it wrapped with ``FSDP(...)`` just above
    (``model = FSDP(model)`` then ``model.configure_optimizers(...)``): FSDP1's wrapper hands the call to the
    wrapped module, whose ``self.parameters()`` there are FSDP1's flat ones (see :func:`find_fsdp1_arguments`)."""

    fsdp1_attributes: dict[str, set[str]] = field(default_factory=dict)
    """Classes of the tree by name -> the attributes their methods assign ``self.attr = FSDP(...)`` /
    ``wrap(...)``: a subclass (in another file too) reads ``self.attr`` as an FSDP1 model."""

    instance_attributes: dict[str, dict[str, set[str]]] = field(default_factory=dict)
    """Classes of the tree by name -> attributes that code outside them assigns a wrapper on an instance
    (``trainer = Trainer(...)`` then ``trainer.model = FSDP(trainer.model)``) -> what wraps it there ("fsdp1",
    "ddp"): the class's methods then read ``self.model`` as that wrapper (see
    :func:`find_instance_attributes`)."""
    own_attributes: set[str] = field(default_factory=set)
    """Names of FSDP1's internals (``flat_param``, ``_handle``, ...) that a class of the tree assigns itself
    (``self.flat_param = torch.cat(...)``): a read of such a name is taken for the tree's own attribute."""
    data_swappers: set[str] = field(default_factory=set)
    """Functions of the tree (by name) that loop over their first argument and assign each element's ``.data``
    (``for p in params: p.data = p._fp32_copy``): handed a model's parameters, they swap the tensors behind
    them (see :func:`find_data_swappers`)."""
    param_pairers: dict[str, set[tuple[tuple[int, str], tuple[int, str]]]] = field(default_factory=dict)
    """Functions of the tree (by name) that pair the parameters of two of their arguments element for element
    (``for t, s in zip(tgt.parameters(), src.parameters())``, an EMA update or copy) -> the positions of those two
    arguments and their names (``self`` not counted; see :func:`find_param_pairers`)."""
    subclassed: set[str] = field(default_factory=set)
    """Names of the classes some class of the tree derives from (the last part of each base): a subclass may
    assign an attribute its base's methods read (see ``subclassed_names``)."""
    unit_holders: set[str] = field(default_factory=set)
    """Top-level functions of the tree (by every dotted suffix of their module path, as ``fsdp1_factories``) that
    wrap parts of a module with FSDP1 and return the module itself
    (``model.add_module(name, wrap(child))``, ``model.head = FSDP(model.head)``, then ``return model.cuda()``): a
    plain root holding FSDP1 units, whose ``state_dict()`` FSDP1 gives full (see :func:`find_unit_holders`)."""
    defined_twice: set[str] = field(default_factory=set)
    """Top-level functions of the tree defined in more than one file (``train_one_epoch`` of each training
    script): a call of one of them does not say which one it reaches."""
    classes_twice: set[str] = field(default_factory=set)
    """Top-level classes of the tree defined in more than one file (a ``BaseTrainer`` in ``train.py`` and in
    ``basetrain.py``)."""
    base_imports: dict[str, set[str]] = field(default_factory=dict)
    """Base classes handed an FSDP1 model by ``super().__init__(model=...)`` (see ``fsdp1_args``) -> the dotted
    names the subclasses' files import them as (``basetrain.BaseTrainer``): of two classes of that name, the one
    in that module is handed the model."""

    def merge(self, other: Dispatch) -> None:
        self.versions.update(other.versions)
        self.subclassed |= other.subclassed
        self.data_swappers |= other.data_swappers
        for name, pairs in other.param_pairers.items():
            self.param_pairers.setdefault(name, set()).update(pairs)
        self.own_attributes |= other.own_attributes
        self.defined_twice |= other.defined_twice
        self.classes_twice |= other.classes_twice
        for cls, modules in other.base_imports.items():
            self.base_imports.setdefault(cls, set()).update(modules)
        self.fsdp1_args |= other.fsdp1_args
        self.fsdp1_methods |= other.fsdp1_methods
        for name, positions in other.fsdp1_results.items():
            self.fsdp1_results.setdefault(name, set()).update(positions)
        self.fsdp1_factories |= other.fsdp1_factories
        self.fsdp1_sure_factories |= other.fsdp1_sure_factories
        self.unit_holders |= other.unit_holders
        self.fsdp1_predicates |= other.fsdp1_predicates
        for name, where in other.vendored_functions.items():
            self.vendored_functions.setdefault(name, where)
        self.imported_names |= other.imported_names
        self.from_imports |= other.from_imports
        for name, torch_name in other.reexports.items():
            self.reexports.setdefault(name, torch_name)
        self.fsdp2_tests |= other.fsdp2_tests
        self.sets_state_dict_type = self.sets_state_dict_type or other.sets_state_dict_type
        self.unfollowed_set_state_dict_type = (
            self.unfollowed_set_state_dict_type or other.unfollowed_set_state_dict_type
        )
        self.bridge_sets_state_dict_type = self.bridge_sets_state_dict_type or other.bridge_sets_state_dict_type
        self.makes_state_dict_context = self.makes_state_dict_context or other.makes_state_dict_context
        self.group_fsdp = self.group_fsdp or other.group_fsdp
        self.offloads_params = self.offloads_params or other.offloads_params
        self.mixed_precision = self.mixed_precision or other.mixed_precision
        self.asks_backend = self.asks_backend or other.asks_backend
        self.subclasses_fsdp1 = self.subclasses_fsdp1 or other.subclasses_fsdp1
        self.wraps_fsdp1 = self.wraps_fsdp1 or other.wraps_fsdp1
        self.constructs_fsdp1 = self.constructs_fsdp1 or other.constructs_fsdp1
        self.keeps_fsdp1 = self.keeps_fsdp1 or other.keeps_fsdp1
        self.tests_lightning_strategy = self.tests_lightning_strategy or other.tests_lightning_strategy
        for name, where in other.own_methods.items():
            self.own_methods.setdefault(name, where)
        for cls, attrs in other.fsdp1_attributes.items():
            self.fsdp1_attributes.setdefault(cls, set()).update(attrs)
        for cls, kinds_of in other.instance_attributes.items():
            for attr, kinds in kinds_of.items():
                self.instance_attributes.setdefault(cls, {}).setdefault(attr, set()).update(kinds)


OTHER_ACCELERATOR = re.compile(
    r"\btorch\.(xpu|npu|hpu|mlu)\b|[\"'](xpu|npu|hpu|mlu)[:\"']|^\s*import\s+(torch_npu|habana_frameworks)\b"
    r"|\bis_(?:torch_)?(xpu|npu|hpu|mlu)_available\b",  # a portable picker's test (verl's, accelerate's, transformers')
    re.M,
)
_DEVICE_STRING = re.compile(r"^[rbuRBUfF]?[\"'](xpu|npu|hpu|mlu)(:[^\"']*)?[\"']$")


def other_accelerator(code: str) -> str | None:
    """The first non-CUDA accelerator the code runs on (``torch.xpu``, ``"xpu:0"``, ``device_type = "npu"``,
    ``import torch_npu``, a test such as ``is_npu_available``), as the code names it; None where it names none
    (comments, and strings that are not a device, such as a docstring mentioning XPUs, do not count)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return None
    middle = getattr(tokenize, "FSTRING_MIDDLE", None)  # f"xpu:{rank}" is split into parts from Python 3.12
    kept = [
        f'"{t.string}"' if t.type == middle else t.string
        for t in tokens
        if t.type != tokenize.COMMENT
        and (
            t.type not in (tokenize.STRING, middle)
            or _DEVICE_STRING.match(t.string if t.type != middle else f'"{t.string}"')
        )
    ]
    found = OTHER_ACCELERATOR.search(" ".join(kept).replace(" . ", ".").replace(" .", ".").replace(". ", "."))
    if found is None:
        return None
    name = next(g for g in found.groups() if g)
    return "npu" if name == "torch_npu" else "hpu" if name == "habana_frameworks" else name


OWN_METHOD_NAMES = ("clip_grad_norm_", "no_sync", "set_state_dict_type")
INTERNAL_METHOD_NAMES = ("_handle", "_handles", "_flat_param", "flat_param", "_has_params")
"""FSDP1-only attribute names (read on an object, proof it is FSDP1's wrapper) that a class of the tree may
define as a method of its own (a signal handler's ``_handle``): then a read of one proves nothing."""
OVERRIDDEN_IN_WRAPPER_SUBCLASS = ("set_state_dict_type",)  # a subclass of FSDP1's wrapper may override it too

STATE_DICT_TYPE_CALL = re.compile(r"(?<!set_)state_dict_type\(")


def finds_state_dict_context(code: str) -> bool:
    """The file calls ``FSDP.state_dict_type`` (rewritten to fsdp_bridge's; a LOCAL_STATE_DICT one stays
    a TODO of its own, so the tree is not reported migrated)."""
    return STATE_DICT_TYPE_CALL.search(code) is not None


def calls_set_state_dict_type(code: str) -> bool:
    """Whether the file calls ``set_state_dict_type(...)`` (``FSDP.set_state_dict_type(model, ...)``): the name
    followed by an opening parenthesis in the code itself; a docstring, string or comment mentioning it, or a
    ``def set_state_dict_type(`` of the file's own, is not a call. A TODO this codemod wrote saying the file
    calls it counts: ``--fix`` may have deleted the call (a SHARDED_STATE_DICT statement), and a second run
    must read the file as the first did."""
    if "set_state_dict_type" not in code:
        return False
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return SET_STATE_DICT_TYPE_CALL.search(code) is not None  # unreadable here: keep the textual answer
    if any(
        t.type == tokenize.COMMENT and TODO in t.string and f"{OWN_FILE} calls FSDP.set_state_dict_type" in t.string
        for t in tokens
    ):
        return True
    skipped = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    tokens = [t for t in tokens if t.type not in skipped]
    return any(
        t.type == tokenize.NAME
        and t.string == "set_state_dict_type"
        and i + 1 < len(tokens)
        and tokens[i + 1].string == "("
        and not (i > 0 and tokens[i - 1].string == "def")
        for i, t in enumerate(tokens)
    )


_CITED_SET_STATE_DICT_TYPE = re.compile(
    r"#\s*" + re.escape(TODO) + r": .*?not rewritten: (\S.*?) calls FSDP\.set_state_dict_type, so this"
)


def cited_set_state_dict_type(code: str) -> str | None:
    """The other file a TODO this codemod wrote in ``code`` names as calling ``FSDP.set_state_dict_type``
    (``not rewritten: <file> calls FSDP.set_state_dict_type, so this ...``), or None. A second ``--fix`` names
    the same file: the first may have deleted that call (a SHARDED_STATE_DICT statement), and the TODO must
    then read as it did."""
    if TODO not in code:
        return None
    for match in _CITED_SET_STATE_DICT_TYPE.finditer(code):
        if match.group(1) != OWN_FILE:
            return match.group(1)
    return None


@functools.lru_cache(maxsize=4)  # each file is asked three times in a row (bridge, unfollowed alone and mixed)
def _set_state_dict_type_kinds(code: str) -> frozenset[str]:
    """What the file's ``set_state_dict_type(...)`` calls are: "odd" (one ``--fix`` leaves as it is: through a
    receiver that is neither FSDP1's class, by a name the file binds to it, ``fsdp_bridge``, nor the model passed
    as its own first argument; star arguments; LOCAL_STATE_DICT, which has no FSDP2 form; or a file that cannot
    be parsed), "sharded" (SHARDED_STATE_DICT written out), "bridge" (any other type: FULL_STATE_DICT, or one
    known only at run time, which becomes ``fsdp_bridge.set_state_dict_type``)."""
    if not calls_set_state_dict_type(code):
        return frozenset()
    try:
        module = cst.parse_module(code)
    except cst.ParserSyntaxError:
        return frozenset({"odd"})
    names = {"FullyShardedDataParallel", "fsdp_bridge"}
    names.update(re.findall(r"\bFullyShardedDataParallel\s+as\s+(\w+)", code))
    names.update(re.findall(r"^\s*(\w+)\s*=\s*(?:[\w.]*\.)?FullyShardedDataParallel\s*$", code, re.M))
    kinds: set[str] = set()
    for node in walk(module):
        if not (
            isinstance(node, cst.Call)
            and isinstance(node.func, cst.Attribute)
            and node.func.attr.value == "set_state_dict_type"
        ):
            continue
        receiver = code_of(node.func.value)
        args = [code_of(a.value) for a in node.args]
        if (
            any(a.star for a in node.args)
            or len(args) < 2
            or any("LOCAL_STATE_DICT" in a for a in args)
            or (receiver.split(".")[-1] not in names and receiver != args[0])
        ):
            kinds.add("odd")
        elif any("SHARDED_STATE_DICT" in a for a in args):
            # a SHARDED set whose configs change what the state holds (the model's offloaded to the CPU, configs
            # known at run time) is the bridge's, which follows them; a plain one is deleted
            kinds.add("sharded" if _plain_sharded_configs(node) else "bridge")
        else:
            kinds.add("bridge")
    return frozenset(kinds)


_LITERAL_CONFIG = re.compile(r"[\w.]+\((?:\s*\w+\s*=\s*(?:True|False)\s*,?)*\s*\)")
"""A config written out with literal flags (``ShardedStateDictConfig(offload_to_cpu=False)``), by any name."""


def _plain_sharded_configs(call: cst.Call) -> bool:
    """Whether ``set_state_dict_type(m, SHARDED_STATE_DICT, cfg, optim_cfg)``'s configs are none, ``None`` or
    written out with nothing a deleted call would lose: ``ShardedStateDictConfig()`` (``offload_to_cpu=False``)
    and an optimizer config of literal flags (its ``offload_to_cpu`` is written where the state is taken)."""
    named = named_args(call, ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config"))
    if named is None:
        return False
    for key in ("state_dict_config", "optim_state_dict_config"):
        text = " ".join(code_of(named[key]).split()) if key in named else "None"
        if text == "None":
            continue
        if _LITERAL_CONFIG.fullmatch(text) is None:
            return False
        if key == "state_dict_config" and re.search(r"offload_to_cpu\s*=\s*True", text):
            return False
    return True


def bridge_set_state_dict_type(code: str) -> bool:
    """Whether the file has a ``set_state_dict_type(...)`` call ``--fix`` makes (or made)
    ``fsdp_bridge.set_state_dict_type(...)`` whatever else the tree holds: a FULL_STATE_DICT one, or one whose
    type is known only at run time. In a tree with one, a SHARDED_STATE_DICT call is made the bridge's too (not
    deleted): the model's state dicts then follow whichever type was set last, as FSDP1's do."""
    return "bridge" in _set_state_dict_type_kinds(code)


def unfollowed_set_state_dict_type(code: str, *, sharded_followed: bool = False) -> bool:
    """Whether the file has a ``set_state_dict_type(...)`` call that ``--fix`` does not make
    ``fsdp_bridge.set_state_dict_type(...)``: an "odd" one (see ``_set_state_dict_type_kinds``: a LOCAL type, a
    receiver not shown to be FSDP1's class or the model itself), or a SHARDED one, deleted or left as it is,
    unless ``sharded_followed`` (the tree has a :func:`bridge_set_state_dict_type` call, so SHARDED ones become
    the bridge's too). A file that cannot be parsed counts as such a call, and so does a TODO this codemod
    wrote for a call that follows such a type: a second ``--fix`` must read the tree as the first did (a
    deleted SHARDED call leaves no call behind)."""
    if TODO in code and "calls FSDP.set_state_dict_type, so this" in code:
        return True
    kinds = _set_state_dict_type_kinds(code)
    return "odd" in kinds or ("sharded" in kinds and not sharded_followed)


def self_spelled_set_state_dict_type(code: str) -> bool:
    """Whether the file calls ``x.set_state_dict_type(x, ...)`` (FSDP1's static method through the model
    itself): rewritten only when the tree defines no ``set_state_dict_type`` of its own (see
    ``find_own_methods``), so a tree that does counts the call as not followed."""
    return SELF_SPELLED.search(code) is not None


SELF_SPELLED = re.compile(r"([A-Za-z_][\w.]*)\s*\.\s*set_state_dict_type\s*\(\s*\1\s*,")
OWN_FILE = "this file"  # how a TODO names the file's own FSDP.set_state_dict_type call
SET_STATE_DICT_TYPE_CALL = re.compile(r"\bset_state_dict_type\s*\(")

GROUP_ARG = re.compile(r"\b(?:process_group|device_mesh)\s*=\s*(?!None\s*[,)\n])")


BRIDGE_MESH_ARG = re.compile(r"[(,]\s*mesh=(?!None\s*[,)\n]|_fsdp2_helpers\.data_parallel_mesh\(\"\w+\"\))")
"""``mesh=X`` passed to ``fsdp_bridge.shard`` (or a mesh given to ``--target torch``'s helper), not ``None``."""

OFFLOADS_PARAMS = re.compile(r"\bCPUOffload\(\s*(offload_params\s*=\s*)?True\s*\)")
_COMMENT = re.compile(r"#[^\n]*")


def offloads_params(code: str) -> bool:
    """Whether FSDP1 code offloads parameters with a literal ``CPUOffload(offload_params=True)`` (comments aside)."""
    return "FullyShardedDataParallel" in code and OFFLOADS_PARAMS.search(_COMMENT.sub("", code)) is not None


def asks_backend(code: str) -> bool:
    """Whether code asks a process group for its backend (``dist.get_backend()``; comments aside)."""
    return "get_backend" in code and re.search(r"\bget_backend\s*\(", _COMMENT.sub("", code)) is not None


MIXED_PRECISION_ARG = re.compile(r"(?<![.\w])(mixed_precision|mp_policy)\s*=(?!=)\s*(?!(?:None|False)\b)\S")


def passes_mixed_precision(code: str) -> bool:
    """Whether FSDP1 code passes ``mixed_precision=`` something other than ``None`` or ``False`` (comments aside),
    or code a first ``--fix`` wrote from it does (``BridgeConfig.from_fsdp1(..., mixed_precision=...)``,
    ``fully_shard``'s ``mp_policy=``), so that a second ``--fix`` decides as the first did."""
    sharded = any(s in code for s in ("FullyShardedDataParallel", "fsdp_bridge", "fully_shard", "_fsdp2_helpers"))
    return sharded and MIXED_PRECISION_ARG.search(_COMMENT.sub("", code)) is not None


def passes_group(code: str) -> bool:
    """Whether FSDP1 code passes a process group or a device mesh (the data-parallel group or sub-mesh of a
    model-parallel layout, whose first rank FSDP1's ``rank0_only`` means; HYBRID's pair); ``None`` written out
    and a commented-out ``# process_group=...`` are not one, ``None if single else group`` is."""
    if "fsdp_bridge.mesh_from_process_group(" in code:
        return True  # a grouped FSDP(...) an earlier --fix wrote for the bridge (a second --fix sees the same tree)
    if "fsdp_bridge.shard(" in code and BRIDGE_MESH_ARG.search(_COMMENT.sub("", code)) is not None:
        return True  # FSDP(..., device_mesh=m) as an earlier --fix wrote it: fsdp_bridge.shard(..., mesh=m)
    if "FullyShardedDataParallel" not in code or GROUP_ARG.search(code) is None:
        return False
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return True  # unreadable here: keep the textual answer
    return GROUP_ARG.search(" ".join(t.string for t in tokens if t.type != tokenize.COMMENT)) is not None


WRAPPER_SUBCLASS = re.compile(
    r"^[ \t]*class\s+(\w+)\s*\((?:[^()]*,)?\s*(?:[\w.]*\.)?(?:FullyShardedDataParallel|FSDP)\s*[,)]", re.M
)


def wrapper_subclasses(code: str) -> set[str]:
    """The names of the file's subclasses of FSDP1's wrapper (see :func:`subclasses_wrapper`)."""
    if "FullyShardedDataParallel" not in code:
        return set()
    return set(WRAPPER_SUBCLASS.findall(code))


CHOSEN_CLASS = re.compile(
    r"\(\s*(?:FSDP|FullyShardedDataParallel)\s+if\b[^\n]*?\belse\b[^\n]*?\)\s*\("
    r"|\belse\s+(?:FSDP|FullyShardedDataParallel)\s*\)\s*\("
)


def chooses_wrapper(code: str) -> bool:
    """Whether the file calls FSDP1's class picked by a conditional expression (``(FSDP if ok else X)(m)``)."""
    return "FullyShardedDataParallel" in code and CHOSEN_CLASS.search(code) is not None


def names_wrapper(code: str) -> bool:
    """Whether the file's code (comments aside) names FSDP1's wrapper class, or shards with ``fsdp_bridge.shard``
    (the same tree after ``--fix``: a second run reports what the first did)."""
    lines = (line.split("#", 1)[0] for line in code.splitlines())
    return any("FullyShardedDataParallel" in text or "fsdp_bridge.shard(" in text for text in lines)


def tests_lightning_strategy(code: str) -> bool:
    """Whether the file names ``FSDPStrategy`` other than in an import, a call of it or an annotation: an
    ``isinstance`` test, a subclass, a comparison of types (see ``Dispatch.tests_lightning_strategy``)."""
    if "FSDPStrategy" not in code:
        return False
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):  # unparsable: reported when the file itself is migrated
        return False
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            skipped.add(id(node.func))
        elif isinstance(node, (ast.AnnAssign, ast.arg)) and node.annotation is not None:
            skipped.update(id(n) for n in ast.walk(node.annotation))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            skipped.update(id(n) for n in ast.walk(node.returns))
    return any(
        id(node) not in skipped
        and (
            (isinstance(node, ast.Name) and node.id == "FSDPStrategy")
            or (isinstance(node, ast.Attribute) and node.attr == "FSDPStrategy")
        )
        for node in ast.walk(tree)
    )


_WRAPPER_NAMES = ("FullyShardedDataParallel", "FSDP")


def constructs_wrapper(code: str) -> bool:
    """Whether the file's code makes FSDP1 models (see ``Dispatch.constructs_fsdp1``): a call of
    ``FullyShardedDataParallel`` / ``FSDP`` (or an attribute so named), ``partial(FSDP, ...)``,
    ``wrapper_cls=FSDP``, or ``fsdp_bridge.shard(...)``. Read by those spellings, names not resolved: another
    alias reads as none, which only keeps code as it is."""
    if "FullyShardedDataParallel" not in code and "fsdp_bridge.shard(" not in code:
        return False
    try:
        module = parsed(code).module
    except Exception:  # unparsable: reported when the file itself is migrated
        return False

    def wrapper(expr: cst.BaseExpression) -> bool:
        name = expr.attr.value if isinstance(expr, cst.Attribute) else expr.value if isinstance(expr, cst.Name) else ""
        return name in _WRAPPER_NAMES

    for n in walk(module):
        if isinstance(n, cst.Call) and (
            wrapper(n.func)
            or code_of(n.func) == "fsdp_bridge.shard"
            or (code_of(n.func).rsplit(".", 1)[-1] == "partial" and n.args and wrapper(n.args[0].value))
        ):
            return True
        if isinstance(n, cst.Arg) and n.keyword is not None and n.keyword.value == "wrapper_cls" and wrapper(n.value):
            return True
    return False


def subclasses_wrapper(code: str) -> bool:
    """Whether the file defines a subclass of FSDP1's wrapper (``class Mine(FullyShardedDataParallel):``): the
    codemod leaves it a TODO, so the models it makes stay FSDP1's."""
    return "FullyShardedDataParallel" in code and WRAPPER_SUBCLASS.search(code) is not None


CLASS_BASES = re.compile(r"^[ \t]*class[ \t]+\w+[ \t]*\(([^)]*)\)", re.M)


def find_data_swappers(code: str) -> set[str]:
    """Functions of a file that assign ``.data`` of the elements of their first argument in a loop (see
    ``Dispatch.data_swappers``); read only where ``.data =`` is written at all."""
    if re.search(r"\.data\s*=[^=]", code) is None:
        return set()
    try:
        module = parsed(code).module
    except Exception:  # unparsable: reported when the file itself is migrated
        return set()
    found: set[str] = set()
    for fn in walk(module):
        if not isinstance(fn, cst.FunctionDef):
            continue
        params = [p.name.value for p in (*fn.params.posonly_params, *fn.params.params) if p.name.value != "self"]
        if not params:
            continue
        for loop in walk(fn.body):
            if not (
                isinstance(loop, cst.For) and isinstance(loop.target, cst.Name) and code_of(loop.iter) == params[0]
            ):
                continue
            element = loop.target.value
            if any(
                isinstance(n, cst.AssignTarget)
                and m.matches(n.target, m.Attribute(value=m.Name(element), attr=m.Name("data")))
                for n in walk(loop.body)
            ):
                found.add(fn.name.value)
    return found


PARAMETER_LISTS = ("parameters", "named_parameters")


def find_param_pairers(code: str) -> dict[str, set[tuple[tuple[int, str], tuple[int, str]]]]:
    """Functions of a file that zip the parameters of two of their arguments (see ``Dispatch.param_pairers``);
    read only where ``zip(`` and ``parameters()`` are written at all."""
    if "zip(" not in code or "parameters()" not in code:
        return {}
    try:
        module = parsed(code).module
    except Exception:  # unparsable: reported when the file itself is migrated
        return {}
    found: dict[str, set[tuple[tuple[int, str], tuple[int, str]]]] = {}
    for fn in walk(module):
        if not isinstance(fn, cst.FunctionDef):
            continue
        params = [p.name.value for p in (*fn.params.posonly_params, *fn.params.params) if p.name.value != "self"]
        if len(params) < 2:
            continue
        for call in walk(fn.body):
            if not (isinstance(call, cst.Call) and m.matches(call.func, m.Name("zip")) and len(call.args) >= 2):
                continue
            owners = []
            for a in call.args[:2]:
                v = a.value
                if (
                    isinstance(v, cst.Call)
                    and isinstance(v.func, cst.Attribute)
                    and v.func.attr.value in PARAMETER_LISTS
                    and isinstance(v.func.value, cst.Name)
                    and v.func.value.value in params
                ):
                    owners.append(params.index(v.func.value.value))
            if len(owners) == 2 and owners[0] != owners[1]:
                i, j = sorted(owners)
                found.setdefault(fn.name.value, set()).add(((i, params[i]), (j, params[j])))
    return found


def subclassed_names(code: str) -> set[str]:
    """The classes the file's classes derive from, by the last part of each base's name (read without
    parsing: an over-approximation, which only withholds proofs)."""
    names: set[str] = set()
    for bases in CLASS_BASES.findall(code):
        for base in bases.split(","):
            base = base.strip()
            if base and "=" not in base:
                names.add(base.split("[", 1)[0].rsplit(".", 1)[-1].strip())
    return names


def find_fsdp1_factories(wrapper: MetadataWrapper, path: str) -> tuple[set[str], set[str]]:
    """Top-level functions of a file that return FSDP1's wrapper: annotated so, or returning ``FSDP(...)``
    (directly or through a name assigned from it in the function), on some path and on every path (see
    ``Dispatch.fsdp1_factories`` and ``fsdp1_sure_factories``)."""
    some: list[str] = []
    every: list[str] = []
    found_aliases = class_aliases(wrapper)

    class V(FollowsAliases):
        aliases = found_aliases

        METADATA_DEPENDENCIES = (QualifiedNameProvider,)

        def is_fsdp1(self, node: cst.CSTNode) -> bool:
            return resolve_fsdp(self.get_metadata(QualifiedNameProvider, node, set())) == (FSDP, "")

        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            if node.returns is not None and self.is_fsdp1(node.returns.annotation):
                some.append(node.name.value)
                every.append(node.name.value)
                return False
            on_some, on_every = fsdp1_returns(node, self.is_fsdp1)
            if on_some:
                some.append(node.name.value)
            if on_every:
                every.append(node.name.value)
            return False  # nested functions and methods are not reached by an import

    wrapper.visit(V())
    return module_suffixes(path, some), module_suffixes(path, every)


def find_unit_holders(wrapper: MetadataWrapper) -> set[str]:
    """``Dispatch.unit_holders`` of one file: top-level functions that give a part of a module FSDP1's wrapper
    (``X.add_module(name, wrap(child))`` / ``FSDP(child)``, ``setattr(X, name, ...)``, ``X.attr = FSDP(...)``)
    and return ``X`` (or ``X.cuda()``, ``X.to(...)``: a call of a method of it)."""
    found: set[str] = set()
    found_aliases = class_aliases(wrapper)

    class V(FollowsAliases):
        aliases = found_aliases

        METADATA_DEPENDENCIES = (QualifiedNameProvider,)

        def wraps(self, value: cst.BaseExpression | None) -> bool:
            return isinstance(value, cst.Call) and resolve_fsdp(
                self.get_metadata(QualifiedNameProvider, value.func, set())
            ) in ((FSDP, ""), ("wrap", ""))

        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            holders: set[str] = set()
            for n in walk(node.body):
                if isinstance(n, cst.Assign) and self.wraps(n.value):
                    holders |= {
                        code_of(t.target.value)
                        for t in n.targets
                        if isinstance(t.target, cst.Attribute) and isinstance(t.target.value, cst.Name)
                    }
                elif (
                    isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value == "add_module"
                ):
                    if len(n.args) == 2 and self.wraps(n.args[1].value) and isinstance(n.func.value, cst.Name):
                        holders.add(n.func.value.value)
                elif isinstance(n, cst.Call) and m.matches(n.func, m.Name("setattr")) and len(n.args) == 3:
                    if self.wraps(n.args[2].value) and isinstance(n.args[0].value, cst.Name):
                        holders.add(code_of(n.args[0].value))
            for r in walk(node.body):
                if not isinstance(r, cst.Return) or r.value is None:
                    continue
                value = r.value
                while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute):
                    value = value.func.value  # model.cuda(), model.to(device)
                if isinstance(value, cst.Name) and value.value in holders:
                    found.add(node.name.value)
            return False

    wrapper.visit(V())
    return found


def tests_fsdp1(fn: cst.FunctionDef, qualified: Callable[[cst.CSTNode], Any]) -> bool:
    """``fn``'s every ``return`` is ``isinstance(<its first parameter>, FSDP)`` (``qualified``: a node's
    qualified names)."""
    if not fn.params.params:
        return False
    first = fn.params.params[0].name.value
    returns = [r for r in walk(fn.body) if isinstance(r, cst.Return)]
    return bool(returns) and all(
        isinstance(r.value, cst.Call)
        and m.matches(r.value.func, m.Name("isinstance"))
        and len(r.value.args) == 2
        and m.matches(r.value.args[0].value, m.Name(first))
        and resolve_fsdp(qualified(r.value.args[1].value)) == (FSDP, "")
        for r in returns
    )


def find_fsdp1_predicates(wrapper: MetadataWrapper, path: str) -> set[str]:
    """``Dispatch.fsdp1_predicates`` of one file."""
    found: set[str] = set()
    found_aliases = class_aliases(wrapper)

    class V(FollowsAliases):
        aliases = found_aliases

        METADATA_DEPENDENCIES = (QualifiedNameProvider,)

        def visit_Module(self, node: cst.Module) -> None:
            for fn in node.body:
                if isinstance(fn, cst.FunctionDef) and tests_fsdp1(
                    fn, lambda n: self.get_metadata(QualifiedNameProvider, n, set())
                ):
                    found.add(fn.name.value)

    wrapper.visit(V())
    return module_suffixes(path, found)


def fsdp1_returns(fn: cst.FunctionDef, is_fsdp1: Callable[[cst.CSTNode], bool]) -> tuple[bool, bool]:
    """Whether ``fn`` returns FSDP1's wrapper (``return FSDP(...)``, or a name assigned ``FSDP(...)`` in it) on
    some path, and on every path: each ``return`` gives ``FSDP(...)`` or a name bound to it by a statement
    the return is sure to follow (in its own block or one around it, not in a branch of an ``if`` above it:
    ``if fsdp: model = FSDP(model)`` ``else: model = DDP(model)`` ``return model`` is FSDP1's on one path
    only). ``is_fsdp1`` tells whether a call's function is FSDP1's wrapper class."""
    made = {
        code_of(t.target)
        for n in walk(fn.body)
        if isinstance(n, cst.Assign) and isinstance(n.value, cst.Call) and is_fsdp1(n.value.func)
        for t in n.targets
    }
    verdicts: list[tuple[bool, bool]] = []  # per return: (FSDP1's on some path, on every path)

    def block(stmts: Sequence[cst.CSTNode], bound: set[str]) -> None:
        bound = set(bound)  # what a branch binds stays in the branch
        for stmt in stmts:
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                continue
            if isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    if isinstance(small, cst.Assign):
                        wraps = isinstance(small.value, cst.Call) and is_fsdp1(small.value.func)
                        for t in small.targets:
                            names = {code_of(x) for x in walk(t.target) if isinstance(x, (cst.Name, cst.Attribute))}
                            bound.difference_update(names)
                            if wraps:
                                bound.add(code_of(t.target))
                    elif isinstance(small, cst.Return) and small.value is not None:
                        v = small.value
                        direct = isinstance(v, cst.Call) and is_fsdp1(v.func)
                        verdicts.append((direct or code_of(v) in made, direct or code_of(v) in bound))
                continue
            for suite in _suites(stmt):
                block(suite, bound)

    if isinstance(fn.body, cst.IndentedBlock):
        block(fn.body.body, set())
    else:  # def f(m): return FSDP(m)
        block([cst.SimpleStatementLine(body=cast(cst.SimpleStatementSuite, fn.body).body)], set())
    return any(s for s, _ in verdicts), bool(verdicts) and all(e for _, e in verdicts)


def _suites(stmt: cst.CSTNode) -> Iterator[Sequence[cst.CSTNode]]:
    """The statement lists of a compound statement (``if``'s body, its ``elif``s and ``else``, a ``try``'s
    handlers, ...); a one-line suite's small statements come as one line."""
    for child in stmt.children:
        if isinstance(child, cst.IndentedBlock):
            yield child.body
        elif isinstance(child, cst.SimpleStatementSuite):
            yield [cst.SimpleStatementLine(body=child.body)]
        elif isinstance(
            child, (cst.BaseCompoundStatement, cst.Else, cst.Finally, cst.ExceptHandler, cst.ExceptStarHandler)
        ):
            yield from _suites(child)


def module_suffixes(path: str, names: Iterable[str]) -> set[str]:
    """``names`` of the file at ``path`` as other files may import them: by every dotted suffix of its module
    path (``load_model`` of ``src/finetune/wrapped_model.py``: ``wrapped_model.load_model``,
    ``finetune.wrapped_model.load_model``, ...), and of its package's path of two parts or more
    (``src.finetune.load_model``, re-exported by the package)."""
    parts = [p for p in Path(path).with_suffix("").parts if p not in ("/", "")]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    found = {".".join([*parts[-k:], name]) for name in names for k in range(1, min(len(parts), 6) + 1)}
    # and as its package re-exports them (``from .distributed import get_model`` in the package's __init__,
    # imported as ``pkg.utils.distributed.get_model``)
    package = parts[:-1]
    return found | {".".join([*package[-k:], name]) for name in names for k in range(2, min(len(package), 6) + 1)}


def top_level_functions(code: str) -> list[str]:
    """The names of the file's top-level functions (none when it does not parse)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return []
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def top_level_classes(code: str) -> list[str]:
    """The names of the file's top-level classes (none when it does not parse)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return []
    return [n.name for n in tree.body if isinstance(n, ast.ClassDef)]


def find_fsdp1_attributes(wrapper: MetadataWrapper) -> dict[str, set[str]]:
    """The classes of a file whose methods assign ``self.attr = FSDP(...)`` / ``wrap(...)``, with those
    attributes (``Dispatch.fsdp1_attributes``)."""
    found: dict[str, set[str]] = {}
    found_aliases = class_aliases(wrapper)

    class V(FollowsAliases):
        aliases = found_aliases

        METADATA_DEPENDENCIES = (QualifiedNameProvider,)

        def visit_ClassDef(self, node: cst.ClassDef) -> None:
            for n in walk(node.body):
                if not (isinstance(n, cst.Assign) and isinstance(n.value, cst.Call)):
                    continue
                made = resolve_fsdp(self.get_metadata(QualifiedNameProvider, n.value.func, set()))
                if made not in ((FSDP, ""), ("wrap", "")):
                    continue
                for t in n.targets:
                    target = t.target
                    if (
                        isinstance(target, cst.Attribute)
                        and isinstance(target.value, cst.Name)
                        and target.value.value == "self"
                    ):
                        found.setdefault(node.name.value, set()).add(target.attr.value)

    wrapper.visit(V())
    return found


def wrapper_kinds_named(quals: Iterable[Any]) -> set[str]:
    """The wrappers qualified names ``quals`` name: "fsdp1" (FSDP1's class or ``wrap``), "ddp"
    (DistributedDataParallel)."""
    quals = list(quals)
    found = set()
    if resolve_fsdp(quals) in ((FSDP, ""), ("wrap", "")):
        found.add("fsdp1")
    if any(q.name.startswith("torch.nn.parallel.") and q.name.endswith(".DistributedDataParallel") for q in quals):
        found.add("ddp")
    return found


def find_instance_attributes(wrapper: MetadataWrapper) -> dict[str, dict[str, set[str]]]:
    """``Dispatch.instance_attributes`` of a file: in each function (and at module level), ``x = Cls(...)``
    (keyed by the callee's last name: a class of the tree by that name reads it) and then
    ``x.attr = FSDP(...)`` / ``wrap(...)`` (``DDP(...)`` too, beside one), the wrapper kept on the instance for
    ``Cls``'s methods to read as ``self.attr``."""
    found: dict[str, dict[str, set[str]]] = {}
    found_aliases = class_aliases(wrapper)

    class V(FollowsAliases):
        aliases = found_aliases

        METADATA_DEPENDENCIES = (QualifiedNameProvider,)

        def kinds(self, value: cst.BaseExpression) -> set[str]:
            return {
                k
                for x in walk(value)
                if isinstance(x, (cst.Name, cst.Attribute))
                for k in wrapper_kinds_named(self.get_metadata(QualifiedNameProvider, x, set()))
            }

        def scan(self, body: Sequence[cst.CSTNode]) -> None:
            made: dict[str, str] = {}  # instance name -> its class
            for stmt in in_source_order(body):
                for n in walk(stmt):
                    if not isinstance(n, cst.Assign):
                        continue
                    for t in n.targets:
                        target = t.target
                        if isinstance(target, cst.Name) and isinstance(n.value, cst.Call):
                            cls = code_of(n.value.func).rsplit(".", 1)[-1]
                            if not self.kinds(n.value.func):
                                made[target.value] = cls
                            else:
                                made.pop(target.value, None)
                        elif isinstance(target, cst.Name):
                            made.pop(target.value, None)
                        elif (
                            isinstance(target, cst.Attribute)
                            and isinstance(target.value, cst.Name)
                            and target.value.value in made
                            and (kinds := self.kinds(n.value))
                        ):
                            cls = made[target.value.value]
                            found.setdefault(cls, {}).setdefault(target.attr.value, set()).update(kinds)

        def visit_Module(self, node: cst.Module) -> None:
            self.scan([s for s in node.body if not isinstance(s, (cst.FunctionDef, cst.ClassDef))])

        def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
            if isinstance(node.body, cst.IndentedBlock):
                self.scan(node.body.body)

    wrapper.visit(V())
    return {cls: attrs for cls, attrs in found.items() if any("fsdp1" in k for k in attrs.values())}


def find_fsdp1_arguments(wrapper: MetadataWrapper, known: Dispatch | None = None) -> Dispatch:
    """Arguments a file passes an FSDP1 model as: in each function (and at module level), a name assigned
    ``FSDP(...)`` / ``wrap(...)`` (or that element of what a function returns: ``return model``,
    ``return model, optimizer``) in an earlier statement, then passed to ``f(...)`` / ``x.f(...)``, gives
    ``"f:<position>"`` or ``"f:<keyword>"`` (``Dispatch.fsdp1_args``; what the functions return:
    ``Dispatch.fsdp1_results``).

    ``known``: what other files of the tree showed (see :func:`handed_across_files`): their functions' FSDP1
    results count as ``FSDP(...)`` here, and a parameter a call of the tree passes an FSDP1 model as is one in
    its function's body, so a model made in one file and handed on through another is followed."""
    found: set[str] = set()
    methods: set[str] = set()  # methods called on such a model (Dispatch.fsdp1_methods)
    returns: dict[str, set[int]] = {}  # function -> positions of its result that are FSDP1 models
    if known is not None:
        for name, positions in known.fsdp1_results.items():
            returns.setdefault(name, set()).update(positions)
    handed = known.fsdp1_args if known is not None else set()
    imported_from: dict[str, set[str]] = {}  # a base class -> where this file imports it from
    found_aliases = class_aliases(wrapper)

    class V(FollowsAliases):
        aliases = found_aliases

        METADATA_DEPENDENCIES = (QualifiedNameProvider,)

        def __init__(self, record: bool) -> None:
            super().__init__()
            self.record = record
            self.classes: list[str] = []
            self.bases: list[list[str]] = []

        def visit_ClassDef(self, node: cst.ClassDef) -> None:
            self.classes.append(node.name.value)
            self.bases.append([code_of(b.value).rsplit(".", 1)[-1] for b in node.bases if b.keyword is None])
            if self.record:
                for b in node.bases:
                    for q in self.get_metadata(QualifiedNameProvider, b.value, set()):
                        if q.source == QualifiedNameSource.IMPORT:
                            imported_from.setdefault(q.name.rsplit(".", 1)[-1], set()).add(q.name.lstrip("."))

        def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
            self.classes.pop()
            self.bases.pop()

        def callees(self, call: cst.Call) -> list[str]:
            """The names a call of a function is recorded under: its own (``train(model)`` -> ``train``); for
            ``super().__init__(model=...)`` in a class, each base class's (``BaseTrainer``: the base's
            ``__init__`` is handed the model, see :func:`called_as`)."""
            if (
                self.bases
                and m.matches(call.func, m.Attribute(value=m.Call(func=m.Name("super")), attr=m.Name("__init__")))
                and self.bases[-1]
            ):
                return list(self.bases[-1])
            return [code_of(call.func).rsplit(".", 1)[-1]]

        def wraps(self, value: cst.BaseExpression) -> set[int]:
            """Positions of ``value``'s result that are FSDP1 models (-1: all of it)."""
            if not isinstance(value, cst.Call):
                return set()
            if resolve_fsdp(self.get_metadata(QualifiedNameProvider, value.func, set())) in ((FSDP, ""), ("wrap", "")):
                return {-1}
            return returns.get(code_of(value.func).rsplit(".", 1)[-1], set())

        def scan(self, body: Sequence[cst.CSTNode], fn: str | None, params: Sequence[str] = ()) -> None:
            wrapped = handed_parameters(fn, params, handed) if fn is not None else set()
            for stmt in in_source_order(body):
                for n in walk(stmt):
                    if (
                        self.record
                        and isinstance(n, cst.Call)
                        and isinstance(n.func, cst.Attribute)
                        and code_of(n.func.value) in wrapped
                        and not n.func.attr.value.startswith("__")
                    ):
                        methods.add(n.func.attr.value)
                    if self.record and isinstance(n, cst.Call) and wrapped:
                        positional = [a for a in n.args if a.keyword is None and not a.star]
                        for callee in self.callees(n):
                            for i, a in enumerate(positional):
                                if code_of(a.value) in wrapped:
                                    found.add(f"{callee}:{i}")
                            for a in n.args:
                                if a.keyword is not None and code_of(a.value) in wrapped:
                                    found.add(f"{callee}:{a.keyword.value}")
                    if fn is not None and isinstance(n, cst.Return) and n.value is not None:
                        elements = n.value.elements if isinstance(n.value, cst.Tuple) else None
                        if elements is None and (code_of(n.value) in wrapped or -1 in self.wraps(n.value)):
                            returns.setdefault(fn, set()).add(-1)
                        for i, e in enumerate(elements or ()):
                            if code_of(e.value) in wrapped or -1 in self.wraps(e.value):
                                returns.setdefault(fn, set()).add(i)
                for n in walk(stmt):
                    if isinstance(n, cst.Assign):
                        value, targets = n.value, [t.target for t in n.targets]
                    elif isinstance(n, cst.AnnAssign) and n.value is not None:  # self.model: nn.Module = FSDP(...)
                        value, targets = n.value, [n.target]
                    else:
                        continue
                    positions = self.wraps(value)
                    if isinstance(value, cst.IfExp) and (
                        {code_of(value.body), code_of(value.orelse)} & wrapped
                        or -1 in self.wraps(value.body) | self.wraps(value.orelse)
                    ):
                        # ``m = model if fsdp else model.module``, ``model = FSDP(model) if distributed else
                        # model.to(rank)``: FSDP1's model on one branch
                        positions = {-1}
                    for target in targets:
                        if -1 in positions:
                            wrapped.add(code_of(target))
                        elif isinstance(target, cst.Tuple):
                            wrapped.update(code_of(e.value) for i, e in enumerate(target.elements) if i in positions)

        def visit_Module(self, node: cst.Module) -> None:
            self.scan([s for s in node.body if not isinstance(s, (cst.FunctionDef, cst.ClassDef))], None)

        def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
            if isinstance(node.body, cst.IndentedBlock):
                name = called_as(node.name.value, self.classes[-1] if self.classes else None)
                self.scan(node.body.body, name, [p.name.value for p in node.params.params])

    wrapper.visit(V(record=False))  # what the file's functions return first
    wrapper.visit(V(record=True))
    handed_bases = {a.split(":", 1)[0] for a in found}
    return Dispatch(
        fsdp1_args=found,
        fsdp1_methods=methods,
        fsdp1_results=returns,
        base_imports={c: where for c, where in imported_from.items() if c in handed_bases},
    )


def in_source_order(body: Sequence[cst.CSTNode]) -> Iterator[cst.CSTNode]:
    """The statements of ``body`` one by one, the bodies of compound statements (``if``, ``for``, ``with``,
    ``try``, ...) opened up in the order the code runs them, so that ``model = FSDP(...)`` inside
    ``if __name__ == "__main__":`` counts for the calls below it in the same block (function and class
    definitions are kept whole); a compound statement's header (its test, iterable or context managers)
    comes first."""
    for stmt in body:
        if isinstance(stmt, (cst.SimpleStatementLine, cst.FunctionDef, cst.ClassDef)) or not isinstance(
            stmt, (cst.BaseCompoundStatement, cst.Else, cst.Finally, cst.ExceptHandler, cst.ExceptStarHandler)
        ):
            yield stmt
            continue
        for child in stmt.children:
            if isinstance(child, cst.IndentedBlock):
                yield from in_source_order(child.body)
            elif isinstance(child, cst.SimpleStatementSuite):
                yield from child.body
            elif isinstance(child, (cst.BaseCompoundStatement, cst.Else, cst.Finally, cst.ExceptHandler)):
                yield from in_source_order([child])
            else:
                yield child


def called_as(fn: str, cls: str | None) -> str:
    """The name a call of function ``fn`` (a method of class ``cls``, if any) is written with: the class's
    for ``__init__`` (``EMA(model)`` hands ``model`` to ``EMA.__init__``), else its own."""
    return cls if fn == "__init__" and cls is not None else fn


def handed_parameters(fn: str, params: Sequence[str], handed: set[str]) -> set[str]:
    """The parameters of function ``fn`` (``params`` as written, ``self`` / ``cls`` first for a method) that
    a call of the tree passes an FSDP1 model as (``"fn:<position>"`` / ``"fn:<keyword>"``, see
    ``Dispatch.fsdp1_args``)."""
    if not handed:
        return set()
    positional = list(params[1:] if params and params[0] in ("self", "cls") else params)
    return {p for p in params if f"{fn}:{p}" in handed or (p in positional and f"{fn}:{positional.index(p)}" in handed)}


def handed_across_files(codes: dict[str, str], dispatch: Dispatch) -> None:
    """Follow FSDP1 models across the files of a tree (``codes``: path -> source): a file that calls a
    function another file showed returns one (``model, device = wrap_model(...)`` in ``train.py``) and hands
    it on (``executor.train(model, ...)``) makes that function's parameter an FSDP1 model in its body
    (``model.no_sync`` in ``executor.py``), and so on down the calls. ``dispatch.fsdp1_args`` and
    ``fsdp1_results`` grow in place, a few rounds at most (a chain of calls rarely runs deeper)."""
    for _ in range(3):
        names = set(dispatch.fsdp1_results) | {a.split(":", 1)[0] for a in dispatch.fsdp1_args}
        if not names:
            return
        called = re.compile(r"\b(?:" + "|".join(sorted(map(re.escape, names))) + r")\(")
        before = (set(dispatch.fsdp1_args), {k: set(v) for k, v in dispatch.fsdp1_results.items()})
        for code in codes.values():
            if called.search(code) is None:
                continue
            try:
                wrapper = parsed(code)
            except Exception:  # unparsable: reported when the file itself is migrated
                continue
            dispatch.merge(find_fsdp1_arguments(wrapper, dispatch))
        if (dispatch.fsdp1_args, dispatch.fsdp1_results) == before:
            return


def find_own_methods(code: str, path: str) -> dict[str, str]:
    """``clip_grad_norm_`` / ``no_sync`` / ``set_state_dict_type`` (and ``INTERNAL_METHOD_NAMES``, as methods
    only) the tree defines itself: a method of a class
    that does not subclass FSDP1's wrapper (``set_state_dict_type``: of any class, a subclass of the wrapper
    included, whose override may do something else), or a function set as an attribute
    (``self.clip_grad_norm_ = fn``). A call ``x.clip_grad_norm_(...)`` elsewhere may then be that one, not
    FSDP1's."""
    if not any(f"def {n}" in code or f".{n} =" in code for n in OWN_METHOD_NAMES) and not any(
        f"def {n}(" in code for n in INTERNAL_METHOD_NAMES
    ):
        return {}
    found: dict[str, str] = {}
    wrapper = parsed(code)
    found_aliases = class_aliases(wrapper)

    class V(FollowsAliases):
        aliases = found_aliases

        METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider)

        def __init__(self) -> None:
            super().__init__()
            self.scopes: list[str] = []  # "class", "fsdp1 class" (subclasses FSDP1's wrapper) or "def"

        def visit_ClassDef(self, node: cst.ClassDef) -> None:
            bases = [resolve_fsdp(self.get_metadata(QualifiedNameProvider, b.value, set())) for b in node.bases]
            self.scopes.append("fsdp1 class" if (FSDP, "") in bases else "class")

        def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
            self.scopes.pop()

        def _add(self, name: str, node: cst.CSTNode) -> None:
            found.setdefault(name, path)  # no line: a rewrite above it would move it (--fix must be idempotent)

        def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
            name = node.name.value
            scope = self.scopes[-1] if self.scopes else None
            if (
                (name in OWN_METHOD_NAMES or name in INTERNAL_METHOD_NAMES)
                and (scope == "class" or (scope == "fsdp1 class" and name in OVERRIDDEN_IN_WRAPPER_SUBCLASS))
                and not is_stub(node)
            ):
                self._add(name, node)  # a method (a nested function counts once set as an attribute)
            self.scopes.append("def")

        def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
            self.scopes.pop()

        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            if isinstance(node.target, cst.Attribute) and node.target.attr.value in OWN_METHOD_NAMES:
                self._add(node.target.attr.value, node)

    wrapper.visit(V())
    return found


def is_fsdp2_class(qnames: Iterable[Any]) -> bool:
    return any(q.name.startswith("torch.distributed.") and q.name.endswith(".FSDPModule") for q in qnames)


def find_dispatch(wrapper: MetadataWrapper) -> Dispatch:
    """The backend-dispatch functions defined in one module (see :class:`Dispatch`)."""
    found = Dispatch()
    found_aliases = class_aliases(wrapper)

    class V(FollowsAliases):
        aliases = found_aliases

        METADATA_DEPENDENCIES = (QualifiedNameProvider,)

        def kind(self, cls: cst.CSTNode) -> str | None:
            q = self.get_metadata(QualifiedNameProvider, cls, set())
            if resolve_fsdp(q) == (FSDP, ""):
                return "fsdp1"
            return "fsdp2" if is_fsdp2_class(q) else None

        def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
            params = [p.name.value for p in node.params.params if p.name.value not in ("self", "cls")]
            if not params:
                return
            literal: dict[str, int] = {}
            classes: set[str] = set()
            for n in walk(node.body):
                if isinstance(n, (cst.Name, cst.Attribute)) and (k := self.kind(n)) is not None:
                    classes.add(k)
                test = m.Call(func=m.Name("isinstance"), args=[m.Arg(m.Name(params[0])), m.Arg()])
                if not (isinstance(n, cst.If) and m.matches(n.test, test)):
                    continue
                body: Sequence[cst.CSTNode] = n.body.body
                if len(body) == 1 and isinstance(body[0], cst.SimpleStatementLine):
                    body = body[0].body
                if (
                    len(body) == 1
                    and isinstance(ret := body[0], cst.Return)
                    and isinstance(ret.value, cst.Integer)
                    and (k := self.kind(cast(cst.Call, n.test).args[1].value)) is not None
                ):
                    literal.setdefault(k, int(ret.value.value.replace("_", ""), 0))
            if len(literal) == 2 and literal["fsdp1"] != literal["fsdp2"]:
                found.versions[node.name.value] = (literal["fsdp1"], literal["fsdp2"])
            elif classes == {"fsdp2"}:
                returns = [n for n in walk(node.body) if isinstance(n, cst.Return)]
                if returns and all(
                    r.value is not None
                    and (
                        m.matches(r.value, m.Name("True") | m.Name("False"))
                        or m.matches(r.value, m.Call(func=m.Name("isinstance")))
                    )
                    for r in returns
                ):
                    found.fsdp2_tests.add(node.name.value)

    wrapper.visit(V())
    return found


@dataclass(frozen=True)
class Region:
    """Source span FSDP2 modules never enter, and the test that routes them away."""

    start: tuple[int, int]
    end: tuple[int, int]
    guard: str
    line: int

    def text(self) -> str:
        return (
            f"kept as is: FSDP2 modules never run this code (it is behind `{short(self.guard)}`, line "
            f"{self.line}; the code has its own FSDP2 path), and FSDP1 modules run it as before"
        )


@dataclass
class Conversion:
    """How one FSDP(...) call becomes fsdp_bridge.shard(...), or why it cannot."""

    config_args: list[cst.Arg] = field(default_factory=list)
    module: cst.BaseExpression | None = None
    mesh: cst.BaseExpression | None = None
    blockers: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    consumed: list[str] = field(default_factory=list)
    """Variables (policies built beforehand) that the new config replaces."""
    indent: str = ""
    """Indentation of the statement holding the call (for a multi-line rewrite)."""
    kwarg_cases: list[tuple[cst.Arg, str | None]] = field(default_factory=list)
    kwarg_became: dict[int, str] = field(default_factory=dict)
    """id(FSDP1 keyword argument) -> what it became in ``shard(...)`` (``strategy="hybrid_shard"``), for the report."""
    report_notes: list[str] = field(default_factory=list)
    runtime: list[tuple[str, str]] | None = None
    """``(FSDP1 keyword, "*" or "**", source)`` for ``BridgeConfig.from_fsdp1(...)``: the values stay the
    user's own expressions and are translated when the code runs."""
    arg_comments: list[tuple[list[str], str | None]] = field(default_factory=list)
    """For each entry of ``runtime``: the comments on the lines before its argument and after it."""
    slot_comments: dict[str, tuple[list[str], str | None]] = field(default_factory=dict)
    """Comments written around the FSDP(...) arguments, by what they became in ``shard(...)``:
    ``"module"``, ``"mesh"`` or a BridgeConfig keyword (comments of an argument that became nothing
    go before the next one that did, or after the last)."""


def make_arg(name: str, value: cst.BaseExpression) -> cst.Arg:
    return cst.Arg(
        value=value,
        keyword=cst.Name(name),
        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
    )


def make_str(value: str) -> cst.SimpleString:
    return cst.SimpleString(f'"{value}"')


def code_of(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


def model_and_optim(call: cst.Call) -> tuple[str, str] | None:
    """``FSDP.optim_state_dict(model, optim)`` (positional or keyword; nothing else given): their code."""
    named = named_args(call, ("model", "optim", "optim_state_dict", "group"))
    if named is None or set(named) != {"model", "optim"}:
        return None
    return code_of(named["model"]), code_of(named["optim"])


def assign_target(stmt: cst.CSTNode) -> str | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign):
        targets = stmt.body[0].targets
        if len(targets) == 1 and isinstance(targets[0].target, (cst.Name, cst.Attribute)):
            return code_of(targets[0].target)
    return None


def assign_value(stmt: cst.CSTNode) -> cst.BaseExpression | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign):
        return stmt.body[0].value
    return None


def is_stub(fn: cst.FunctionDef) -> bool:
    """A declaration only (a Protocol or abstract method): its body is a docstring, ``...``, ``pass``
    or ``raise NotImplementedError``."""
    body = fn.body.body if isinstance(fn.body, cst.IndentedBlock) else [fn.body]
    if any(isinstance(stmt, cst.BaseCompoundStatement) for stmt in body):
        return False  # an if/with/for/... body does something (its .body is a block, not statements)
    smalls = [x for stmt in body for x in getattr(stmt, "body", [])]
    return all(
        (isinstance(x, cst.Expr) and isinstance(x.value, (cst.Ellipsis, cst.SimpleString, cst.ConcatenatedString)))
        or isinstance(x, cst.Pass)
        or (isinstance(x, cst.Raise) and "NotImplementedError" in code_of(x))
        for x in smalls
    )


def exits(body: cst.BaseSuite) -> bool:
    """The block ends in return / raise / continue / break."""
    last = body.body[-1] if isinstance(body, cst.IndentedBlock) and body.body else None
    if isinstance(body, cst.SimpleStatementSuite):
        return bool(body.body) and isinstance(body.body[-1], (cst.Return, cst.Raise, cst.Continue, cst.Break))
    return (
        isinstance(last, cst.SimpleStatementLine)
        and bool(last.body)
        and isinstance(last.body[-1], (cst.Return, cst.Raise, cst.Continue, cst.Break))
    )


_CHILDREN: dict[int, tuple[cst.CSTNode, Sequence[cst.CSTNode]]] = {}
"""``id(node)`` -> (the node, its children): libcst computes ``children`` by visiting the node each time it is
asked (most of a large file's migration time); nodes are immutable, and each entry holds its node, so an id
is not reused while it is cached."""
_CHILDREN_LIMIT = 4_000_000


def children(node: cst.CSTNode) -> Sequence[cst.CSTNode]:
    """``node.children``, computed once per node."""
    entry = _CHILDREN.get(id(node))
    if entry is not None and entry[0] is node:
        return entry[1]
    if len(_CHILDREN) >= _CHILDREN_LIMIT:
        _CHILDREN.clear()  # a cache only: the trees already migrated are not read again
    kids = node.children
    _CHILDREN[id(node)] = (node, kids)
    return kids


def walk(node: cst.CSTNode) -> Iterable[cst.CSTNode]:
    """``node`` and every node below it, in source order (pre-order)."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(children(n)))


def names_from(scope: cst.CSTNode, seeds: set[str], *, back: bool = False) -> set[str]:
    """``seeds`` and every name ``scope`` assigns from an expression using one of them (``t = f(n)``), through
    up to three steps; with ``back``, also a name a plain assignment of one of them reads (``w = model`` with
    ``w`` among them adds ``model``)."""
    pairs = [
        (t.target.value, a.value)
        for a in walk(scope)
        if isinstance(a, cst.Assign)
        for t in a.targets
        if isinstance(t.target, cst.Name)
    ]
    names = set(seeds)
    for _ in range(3):
        for target, value in pairs:
            if any(isinstance(n, cst.Name) and n.value in names for n in walk(value)):
                names.add(target)
            elif back and target in names and isinstance(value, cst.Name):
                names.add(value.value)
    return names


def used_only_in(scope: cst.CSTNode, nodes: Iterable[cst.CSTNode], names: set[str]) -> bool:
    """No name of ``names`` appears in ``scope`` outside ``nodes`` (statements of that scope)."""
    inside = {id(n) for node in nodes for n in walk(node)}
    return not any(isinstance(n, cst.Name) and n.value in names and id(n) not in inside for n in walk(scope))


def class_list(expr: cst.BaseExpression) -> cst.BaseExpression:
    if isinstance(expr, (cst.Set, cst.List, cst.Tuple)):
        return cst.List([cst.Element(e.value) for e in expr.elements])
    return cst.parse_expression(f"list({code_of(expr)})")


class Collector(cst.CSTVisitor):
    """Single assignments ``name = expr`` (module or function level) and how often each name appears."""

    def __init__(self) -> None:
        super().__init__()
        self.assigned: dict[str, list[cst.BaseExpression]] = {}
        self.uses: dict[str, int] = {}

    def visit_Assign(self, node: cst.Assign) -> None:
        if len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name):
            self.assigned.setdefault(node.targets[0].target.value, []).append(node.value)
        else:  # ``a = b = v``, ``a, b = f()``: no name here is bound to that value alone (never inlined)
            for t in node.targets:
                for n in walk(t.target):
                    if isinstance(n, cst.Name):
                        self.assigned.setdefault(n.value, []).extend((node.value, node.value))

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        # ``mp: Optional[MixedPrecision] = None`` then ``mp = MixedPrecision(...)`` in a branch: two bindings
        if isinstance(node.target, cst.Name) and node.value is not None:
            self.assigned.setdefault(node.target.value, []).append(node.value)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        if isinstance(node.target, cst.Name):
            self.assigned.setdefault(node.target.value, []).append(node.value)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        # ``def save(model, policy=None): if not policy: policy = FullStateDictConfig(...)``: the parameter is a
        # binding too (what the caller passes), so the assignment is not the name's one value
        params = node.params
        names = {p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)}
        for n in walk(node.body):
            if (
                isinstance(n, cst.Assign)
                and len(n.targets) == 1
                and isinstance(n.targets[0].target, cst.Name)
                and n.targets[0].target.value in names
            ):
                self.assigned.setdefault(n.targets[0].target.value, []).append(n.value)

    def visit_Name(self, node: cst.Name) -> None:
        self.uses[node.value] = self.uses.get(node.value, 0) + 1

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)  # ``f(policy=policy)``: the keyword names no variable
        return False


def named_args(call: cst.Call, names: Sequence[str]) -> dict[str, cst.BaseExpression] | None:
    """A call's arguments by parameter name (positional ones in ``names`` order); None with ``*``/``**``."""
    out: dict[str, cst.BaseExpression] = {}
    for i, a in enumerate(call.args):
        if a.star:
            return None
        if a.keyword is not None:
            out[a.keyword.value] = a.value
        elif i < len(names):
            out[names[i]] = a.value
        else:
            return None
    return out


def short(code: str, limit: int = 60) -> str:
    one = " ".join(code.split())
    return one if len(one) <= limit else one[: limit - 3] + "..."


_FROM_IMPORT = re.compile(r"^[ \t]*from[ \t]+[\w.]+[ \t]+import[ \t]+\(?([\w, \t\n]+?)\)?[ \t]*(?:#.*)?$", re.M)


_FROM_MODULE_IMPORT = re.compile(
    r"^[ \t]*from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(\*|\(?[\w, \t\n]+?\)?)[ \t]*(?:#.*)?$", re.M
)


def from_imports(code: str) -> set[str]:
    """``Dispatch.from_imports`` of one file, read without parsing (as :func:`imported_names`)."""
    found: set[str] = set()
    for _dots, module, names in _FROM_MODULE_IMPORT.findall(code):
        if not module:
            continue
        for part in names.strip("()").replace("\n", ",").split(","):
            words = part.split()
            if words:
                found.add(f"{module}.{words[0]}")
    return found


def imported_names(code: str) -> set[str]:
    """The names ``from X import a, b as c`` statements of ``code`` import (``a``, ``b``): a cheap
    over-approximation, read without parsing (a name in a string that looks like an import counts too)."""
    names: set[str] = set()
    for group in _FROM_IMPORT.findall(code):
        for part in group.replace("\n", ",").split(","):
            words = part.split()
            if words:
                names.add(words[0])
    return names
