"""The scanner's state and the helpers every fixer uses (recording a finding, resolving a name)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider, QualifiedNameSource

from fsdp_bridge.migrate._analysis import (
    Conversion,
    Dispatch,
    FollowsAliases,
    Region,
    code_of,
    resolve_fsdp,
    used_only_in,
    walk,
)
from fsdp_bridge.migrate._names import fsdp1_private
from fsdp_bridge.migrate._report import CodeFinding

DuckTest = tuple[cst.Call, cst.CSTNode, str, str, list[tuple[cst.Call, tuple[int, int]]], tuple[int, int]]
"""A duck-typed test (``hasattr(m, "no_sync")``): the call, its statement, ``m``, the method, the calls it guards
with their line and column, and its own line and column."""


class ScannerBase(FollowsAliases):
    """The scanner's state and shared helpers (see :class:`Scanner`)."""

    METADATA_DEPENDENCIES = (QualifiedNameProvider, PositionProvider)

    if TYPE_CHECKING:  # the fixers' methods other fixers call (each defined in its own module)

        def _in_region(self, node: cst.CSTNode) -> Region | None: ...
        def _plan_regions(self, module: cst.Module) -> None: ...
        def _ddp_tested(self, obj: cst.BaseExpression) -> bool: ...
        def _fsdp1_wrapper(self, node: cst.CSTNode, obj: cst.BaseExpression, *, by_calls: bool = True) -> str: ...
        def _other_path_above(self, node: cst.CSTNode, obj: cst.BaseExpression) -> bool: ...
        def _reference(self, node: cst.BaseExpression) -> bool: ...
        def _config_driven(self, node: cst.Call) -> None: ...
        def _plan_lightning(self, node: cst.Call) -> bool: ...
        def _plan_lightning_subclass(self, node: cst.ClassDef) -> None: ...
        def _lightning_name(self, node: cst.BaseExpression, *classes: str) -> str | None: ...
        def _lightning_strategy_here(self) -> bool: ...
        def _lightning_moves(self) -> bool: ...
        def _note_fsdp1_checkpoint(self, node: cst.CSTNode) -> None: ...
        def _note_local_clip(self, node: cst.Call) -> None: ...
        def _note_shard_shapes(self, node: cst.Call) -> None: ...
        def _note_param_collective(self, node: cst.Call) -> None: ...
        def _note_param_sum(self, node: cst.Call) -> None: ...
        def _note_compiled_wrap(self, node: cst.Call) -> None: ...
        def _note_duck_typed_wrapper(self, node: cst.Call) -> None: ...
        def settle_duck_tests(self) -> None: ...
        def _note_optimizer_state(self, node: cst.Call) -> None: ...
        def _note_plain_scaler(self, node: cst.Call) -> None: ...
        def _plan_offload_backend(self, node: cst.Call) -> None: ...
        def _note_rank_forward(self, node: cst.Call) -> None: ...
        def _module_source(self, node: cst.CSTNode, obj: cst.BaseExpression) -> str: ...
        def _note_fsdp1_attribute(self, node: cst.Attribute) -> None: ...
        def _plan_module_checks(self, node: cst.Call, hit: tuple[str, str] | None) -> bool: ...
        def _plan_state_dict_type_call(
            self, node: cst.Call, func: cst.BaseExpression, hit: tuple[str, str] | None
        ) -> bool: ...
        def _plan_set_state_dict_type(self, node: cst.Call, through_class: bool = True) -> bool: ...
        def _plan_self_spelled_set_state_dict_type(self, node: cst.Call, func: cst.Attribute) -> bool: ...
        def _handed_fsdp1(self, obj: cst.BaseExpression) -> str: ...
        def _kept_from_a_handed_parameter(self, cls: cst.ClassDef, attr: str) -> bool: ...
        def _handed_in(self, cls: cst.ClassDef, attr: str, *, among: bool = False) -> bool: ...
        def _handed_parameter(self, node: cst.CSTNode, obj: cst.BaseExpression) -> bool: ...
        def _isinstance_branch(self, node: cst.CSTNode, obj: cst.BaseExpression) -> set[str]: ...
        def _fsdp1_tested_around(self, node: cst.CSTNode) -> str | None: ...
        def _fsdp2_admitted_around(self, node: cst.CSTNode, target: str) -> str | None: ...
        def _plain_elsewhere(self, node: cst.CSTNode, obj: cst.BaseExpression) -> bool: ...
        def _assigned_here(self, node: cst.Attribute) -> bool: ...
        def _factory_result(self, node: cst.CSTNode, obj: cst.BaseExpression) -> str: ...
        def _made_by_factory(self, fn: cst.FunctionDef, name: str, before: cst.CSTNode | None = None) -> str: ...
        def _plan_block(self, body: Sequence[cst.BaseStatement]) -> None: ...
        def _plan_local_block(
            self,
            node: cst.With,
            model: str,
            cfg: cst.BaseExpression | None,
            optim_cfg: cst.BaseExpression | None,
        ) -> None: ...
        def _model_and_own_optim_state(self, call: cst.Call) -> tuple[str, str] | None: ...
        def _harmless_in_state_block(self, call: cst.Call) -> bool: ...
        def _takes_no_state_of(self, block: cst.With, model: str) -> bool: ...
        def _literal_config(self, cfg: cst.BaseExpression | None) -> bool: ...
        def _config_flag(self, cfg: cst.BaseExpression | None, name: str, default: bool) -> bool: ...
        def _unwrap_block(
            self,
            node: cst.With,
            rewrites: dict[int, str],
            configs: tuple[cst.BaseExpression | None, ...],
            kind: str,
            why: str,
        ) -> None: ...
        def _plan_plain_state_dict(self, node: cst.Call, func: cst.Attribute) -> bool: ...
        def _plan_save_pretrained(self, node: cst.Call, func: cst.Attribute) -> bool: ...
        def _own_narrow_load_state_dict(self) -> str | None: ...
        def _options(
            self, full: bool, *, cpu_offload: bool = False, broadcast: bool = False, offload: bool = False
        ) -> str: ...
        def _runtime_state_context(self) -> str | None: ...
        def _subclass_context(self, ctx: str) -> str | None: ...
        def _record_vendored_call(self, node: cst.Call, copy: str) -> None: ...
        def _persistent_type(self, node: cst.CSTNode, model: str) -> str | None: ...
        def _persistent_optim_offload(self, node: cst.CSTNode, model: str) -> bool: ...
        def _plan_wrap_call(
            self, node: cst.Call, func: cst.BaseExpression, hit: tuple[str, str] | None
        ) -> tuple[bool, bool | None]: ...
        def _plan_fsdp(self, call: cst.Call) -> None: ...
        def _chosen_fsdp1_branch(self, func: cst.BaseExpression) -> str | None: ...
        def _plan_partial(self, node: cst.Call) -> bool: ...
        def _plan_optim_state_call(
            self, node: cst.Call, func: cst.BaseExpression, hit: tuple[str, str] | None
        ) -> bool: ...
        def _plan_optimizer_order(self, body: Sequence[cst.BaseStatement]) -> None: ...
        def _note_kernel_optimizer(self, node: cst.Call) -> None: ...
        def _note_data_swap(self, node: cst.Call) -> None: ...
        def _note_paired_meshes(self, node: cst.Call) -> None: ...
        def _shown_fsdp1(self, node: cst.CSTNode, model: cst.BaseExpression) -> bool: ...
        def _optim_to_load(self, node: cst.Call, options: str | None) -> str | None: ...
        def _plan_optim_load(self, node: cst.Call) -> bool: ...
        def _plan_summon(
            self, node: cst.Call, func: cst.BaseExpression, hit: tuple[str, str] | None
        ) -> tuple[bool, bool | None]: ...
        def _plan_wrapper_method_call(
            self, node: cst.Call, func: cst.BaseExpression, hit: tuple[str, str] | None
        ) -> None: ...
        def _plan_scaler_class(self, node: cst.BaseExpression) -> bool: ...
        def _plan_param_init_fn(self, a: cst.Arg, kw: str, value: str, sync: list[str]) -> bool: ...
        def _describe_value(self, kw: str, value: cst.BaseExpression) -> str: ...
        def _member(self, value: cst.BaseExpression, enum_name: str) -> str | None: ...
        def _wrap(self, value: cst.BaseExpression, conv: Conversion) -> cst.BaseExpression | None: ...
        def _mixed_precision(self, value: cst.BaseExpression, conv: Conversion) -> cst.BaseExpression | None: ...
        def _cpu_offload(self, value: cst.BaseExpression, conv: Conversion) -> cst.BaseExpression | None: ...

    def __init__(
        self,
        path: str,
        code: str,
        assignments: dict[str, cst.BaseExpression],
        name_uses: dict[str, int],
        dispatch: Dispatch | None = None,
    ) -> None:
        super().__init__()
        self.path = path
        self.dispatch = dispatch or Dispatch()
        self.group_offload_noted: set[int] = set()  # statements told that rank0_only lost its CPU copy
        self.options_at: cst.CSTNode | None = None  # the state_dict_type block whose options are being written
        self.regions: list[Region] = []  # code FSDP2 modules never reach: FSDP1 constructs there stay as they are
        self.kept_checks: set[int] = set()  # id(isinstance(x, FSDP)) where it tells the backends apart
        self.code = code
        self.lines = code.splitlines()
        self.target = "bridge"  # what --fix writes ("torch": the torch target lowers the bridge's calls after)
        self.assignments = assignments
        self.name_uses = name_uses
        self.findings: list[CodeFinding] = []
        self.todos: dict[int, list[str]] = {}  # id(statement) -> TODO texts
        self.conversions: dict[int, Conversion] = {}  # id(FSDP call) -> conversion
        self.fixable_calls: dict[int, str] = {}  # id(call) -> "method" (no_sync, clip) or "summon"
        # hasattr(m, "clip_grad_norm_" / "no_sync"): (the call, its statement, m, the method, the calls
        # it guards, its line and column), settled once the report pass knows which of those are rewritten
        self.duck_tests: list[DuckTest] = []
        self.bare_no_sync: set[int] = set()  # statements calling m.no_sync() as a statement, not a context
        self.call_rewrites: dict[int, str] = {}  # id(call) -> replacement source (state dict API)
        self.stmt_rewrites: dict[int, str] = {}  # id(statement) -> the one statement replacing it
        self.whole_loops: set[int] = set()  # id(for loop) rewritten whole (StorageFixer, EmaFixer): none of it reported
        self.unwrap_withs: set[int] = set()  # state_dict_type blocks replaced by their (rewritten) body
        self.other_roots: set[int] = set()  # id(x.state_dict() call) in another model's unwrapped block
        self.context_makers: tuple[set[str], set[str]] | None = None  # see _made_context
        self.rewrites_backend = False  # init_process_group("nccl") -> a CPU backend beside it (offloaded parameters)
        self.rewrites_names = False  # "_fsdp_wrapped_module.x" -> "x" (a name under FSDP1's wrapper)
        self.needs_state_dict_api: set[str] = set()  # names to import from torch.distributed.checkpoint.state_dict
        self.needs_imports: set[tuple[str, str | None]] = set()  # (module, name) other rewrites use
        self.optimizer_moves: dict[int, int] = {}  # id(optimizer statement) -> id(the wrap statement it follows)
        self.name_rewrites: dict[int, str] = {}  # id(Name/Attribute) -> replacement (annotations)
        self.expr_rewrites: dict[int, str] = {}  # id(Attribute) -> replacement expression source
        self.arg_adds: dict[int, str] = {}  # id(call) -> a keyword argument's source appended to it
        self.called: set[int] = set()  # id(func) of every call
        self.functions: list[cst.FunctionDef] = []  # enclosing function definitions
        self.module: cst.Module | None = None
        self.ddp_tests: dict[int, set[str]] = {}  # id(function or module) -> objects tested as DDP there
        self.wrapper_kinds: dict[tuple[int, str], set[str]] = {}  # (id(scope), object) -> {"fsdp1", "ddp"}
        self.classes: list[cst.ClassDef] = []  # enclosing class definitions
        self.predicates: set[str] | None = None  # see _fsdp1_predicates
        self.local_makers: set[str] | None = None  # see _local_fsdp1_makers
        self.class_bases: set[int] = set()  # id(base expression) of every class definition
        self.partials: set[int] = set()  # id(functools.partial(FSDP, ...)) planned (rewritten or TODO)
        self._wrapped_by_class: str | None = None  # see ConstructorFixer._units_wrapped_by_class ("": none)
        self.annotation_depth = 0
        self.assign_target_depth = 0
        self.attr_drops: set[int] = set()  # id(Attribute) -> replaced by its value (FSDP1 wrapper internals)
        self.attr_unwraps: set[int] = set()  # id(X._fsdp_wrapped_module) -> fsdp_bridge.unwrapped(X)
        self.forwarded_reads: dict[int, str] = {}  # id(X._fsdp_wrapped_module | X.module) in X.<that>.name -> name
        self.removed_stmts: set[int] = set()  # id(statement) -> deleted (a no-op on FSDP2)
        self.inlined_uses: dict[str, int] = {}  # variable -> its uses written into rewritten FSDP(...) calls
        self.blocked_choice = False  # a (FSDP if ok else Plain)(...) left as written: its model stays FSDP1's
        self.chosen_calls: dict[int, str] = {}  # id((FSDP if ok else Plain)(...)) rewritten -> FSDP1's branch
        self.unwrapped_config_uses: dict[int, int] = {}  # id(a config's value) -> the unwrapped blocks using it
        self.planning = True
        self.consumed_partial = False
        self.consumed_nodes: set[int] = set()
        self.stmt_stack: list[cst.CSTNode] = []
        self.uses_fsdp1 = False
        self.lightning_here: bool | None = None  # see LightningFixer._lightning_strategy_here
        self.lightning_drops: set[tuple[str, str, str | None]] = set()  # FSDPStrategy imports unused after --fix
        self.accelerate_here: bool | None = None  # see ImportsFixer._accelerate_plugin_here
        self.fsdp1_elsewhere = (
            False  # FSDP1 set up elsewhere (Lightning, a model wrapped by another file): TODOs written
        )

    # -- helpers -------------------------------------------------------------------
    def _names_stay_in(self, nodes: Iterable[cst.CSTNode], names: set[str]) -> bool:
        """No name of ``names`` is used in the enclosing function (or the module) outside ``nodes``."""
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        return scope is not None and used_only_in(scope, nodes, names)

    def _fsdp1_factory(self, qnames: Iterable[Any], *, every_path: bool = False) -> bool:
        """A function of the migrated tree that returns FSDP1's wrapper (``Dispatch.fsdp1_factories``; with
        ``every_path``, on every path: ``fsdp1_sure_factories``)."""
        factories = self.dispatch.fsdp1_sure_factories if every_path else self.dispatch.fsdp1_factories
        return any(q.source is QualifiedNameSource.IMPORT and q.name.lstrip(".") in factories for q in qnames)

    def _star_factory(self, func: cst.BaseExpression, qnames: Iterable[Any]) -> bool:
        """``func`` is a bare name no import or definition of this file names (``qnames`` empty or builtin),
        and a ``from M import *`` of this file brings in a function of the tree returning FSDP1's wrapper
        (``M.func`` in ``Dispatch.fsdp1_factories``)."""
        if not isinstance(func, cst.Name) or any(
            q.source in (QualifiedNameSource.IMPORT, QualifiedNameSource.LOCAL) for q in qnames
        ):
            return False
        stars = [
            code_of(small.module).lstrip(".")
            for stmt in (self.module.body if self.module is not None else ())
            if isinstance(stmt, cst.SimpleStatementLine)
            for small in stmt.body
            if isinstance(small, cst.ImportFrom)
            and isinstance(small.names, cst.ImportStar)
            and small.module is not None
        ]
        return any(f"{star}.{func.value}" in self.dispatch.fsdp1_factories for star in stars if star)

    def _tree_predicate(self, qnames: Iterable[Any]) -> bool:
        """An imported function of the tree that tests for FSDP1's wrapper (``Dispatch.fsdp1_predicates``)."""
        tests = self.dispatch.fsdp1_predicates
        return any(q.source is QualifiedNameSource.IMPORT and q.name.lstrip(".") in tests for q in qnames)

    def _vendored_function(self, qnames: Iterable[Any]) -> str | None:
        """The file of the tree's copy of torch's FSDP1 code that defines the imported function ``qnames``
        names (``Dispatch.vendored_functions``), or None."""
        copies = self.dispatch.vendored_functions
        for q in qnames:
            if q.source is QualifiedNameSource.IMPORT and (where := copies.get(q.name.lstrip("."))) is not None:
                return where
        return None

    def _qn(self, node: cst.CSTNode) -> tuple[str, str] | None:
        return resolve_fsdp(self.get_metadata(QualifiedNameProvider, node, set()))

    def _private(self, node: cst.CSTNode) -> str | None:
        if isinstance(node, cst.Attribute) and self._private(node.value) is not None:
            return None  # reported at its module's name
        if isinstance(node, cst.Name) and self.module is not None:
            # ``def _helper(...)`` at the top of the file replaces an imported ``_helper`` of the same name: the
            # calls are the file's own function (often one written for FSDP2), not FSDP1's private one
            own = {s.name.value for s in self.module.body if isinstance(s, (cst.FunctionDef, cst.ClassDef))}
            if node.value in own:
                return None
        return fsdp1_private(self.get_metadata(QualifiedNameProvider, node, set()))

    def _in_summon(self) -> bool:
        """The statement is inside a ``summon_full_params`` block (FSDP1's parameters are whole there)."""
        return any(
            isinstance(w, cst.With) and any("summon_full_params" in code_of(i.item) for i in w.items)
            for w in self.stmt_stack
        )

    def _record(self, node: cst.CSTNode, construct: str, replacement: str, fixable: bool) -> None:
        pos = self.get_metadata(PositionProvider, node)
        # One line each: code quoted in the texts may span lines (a multi-line argument), and a
        # TODO comment must not (libcst refuses a comment with a line break in it).
        construct, replacement = " ".join(construct.split()), " ".join(replacement.split())
        self.findings.append(CodeFinding(self.path, pos.start.line, pos.start.column, construct, replacement, fixable))
        if not fixable and self.stmt_stack:
            self.todos.setdefault(id(self.stmt_stack[-1]), []).append(f"{construct}: {replacement}")

    def _rewrite_wrapped_module(self, node: cst.Attribute, label: str, whose: str) -> None:
        """``X._fsdp_wrapped_module`` -> ``fsdp_bridge.unwrapped(X)`` (X as rewritten inside it), and
        ``X._fsdp_wrapped_module.name`` for a name FSDP1's wrapper forwards to the module it wraps -> ``X.name``:
        both right on FSDP1's wrapper (``whose``: who made it) and on FSDP2, which does not wrap."""
        obj = code_of(node.value)
        self.needs_imports.add(("fsdp_bridge", None))
        if id(node) in self.forwarded_reads:
            self.attr_drops.add(id(node))
            text = (
                f"{obj}: FSDP1's wrapper hands .{self.forwarded_reads[id(node)]} to the module it wraps, and FSDP2 "
                "does not wrap (the module is itself, an FSDPModule)"
            )
        else:
            self.attr_unwraps.add(id(node))
            text = (
                f"fsdp_bridge.unwrapped({obj}): the module inside FSDP1's wrapper ({whose}), the module itself on "
                "FSDP2 (it does not wrap)"
            )
        self._record(node, f"{code_of(node)} ({label})", text, True)

    def _follow(self, expr: cst.BaseExpression, conv: Conversion) -> cst.BaseExpression:
        """A variable assigned once in this file stands for its value."""
        if isinstance(expr, cst.Name) and expr.value in self.assignments:
            conv.consumed.append(expr.value)
            return self.assignments[expr.value]
        return expr

    def _push(self, node: cst.CSTNode) -> None:
        self.stmt_stack.append(node)

    def _consume(self, value: cst.BaseExpression) -> None:
        for node in walk(value):
            self.consumed_nodes.add(id(node))
