"""FSDP1's private internals used to free a unit's gathered parameters -> ``fsdp_bridge.reshard``.

FSDP1 keeps the root's parameters gathered after forward for the backward that follows; code that ran an
evaluation forward under ``torch.no_grad()`` frees them with torch's private ``_reshard`` and the unit's
flat-parameter handles (pytorch/pytorch issue 117742)::

    for unit in FSDP.fsdp_modules(model):
        if unit._has_params and unit.sharding_strategy is not ShardingStrategy.NO_SHARD:
            _reshard(unit, unit._handle, True)

The whole ``if`` serves only that free, so it becomes ``fsdp_bridge.reshard(unit, recurse=False)``,
which does on fsdp1 what ``_reshard`` does for units with parameters that are not NO_SHARD, on fsdp2
``FSDPModule.reshard()``, and nothing for a module that is no unit. Rewritten only where every part of
the statement is proven to serve the free: its tests are FSDP1's own (``_has_params``, NO_SHARD
excluded, ``isinstance(unit, FSDP)`` or a helper of the file made of those, ``hasattr(unit, "_handles")``
choosing between two branches that both free), its assignments are locals read nowhere else (the
handles, the list of True), ``continue`` only skips to the end of the loop, and every call is
``_reshard(unit, ..., True)`` or a read. Anything else reading ``_handle``/``_handles``/``flat_param``
keeps its TODO."""

from __future__ import annotations

import os
from collections.abc import Sequence

import libcst as cst
from libcst.metadata import QualifiedNameProvider

from fsdp_bridge.migrate._analysis import code_of, short, walk
from fsdp_bridge.migrate._names import FSDP, FSDP_METHODS, unpatched
from fsdp_bridge.migrate._scan_base import ScannerBase

RESHARD = "torch.distributed.fsdp._runtime_utils._reshard"

READS = ("_get_padded_unsharded_flat_param", "_typed_storage", "untyped_storage", "_size", "size", "nbytes", "numel")
"""Methods only read what a handle holds (no effect): the already-freed test of some trees."""

ALLOWED_NAMES = ("True", "False", "None", "len", "hasattr")


class InternalsFixer(ScannerBase):
    """``if <FSDP1's own tests>: _reshard(unit, handle(s), True)`` -> ``fsdp_bridge.reshard(unit, recurse=False)``;
    calls into the tree's copies of torch's FSDP1 code reported."""

    def _record_vendored_call(self, node: cst.Call, copy: str) -> None:
        """A call of a function of ``copy``, a copy of torch's FSDP1 code kept in the tree (left as it is, see
        ``_vendored``): it works on FSDP1 models only, and the models the rewritten code makes are FSDP2's."""
        name = code_of(node.func).rsplit(".", 1)[-1]
        where = os.path.relpath(copy, os.path.dirname(self.path) or ".")
        own = name if name in FSDP_METHODS else unpatched(name)  # fixed_full_optim_state_dict: FSDP1's own
        same = (
            f"if it does what FSDP1's FSDP.{own}(...) does, call that instead and run --fix again (it is "
            "rewritten to FSDP2's form); "
            if own in FSDP_METHODS
            else ""
        )
        self._record(
            node,
            f"{short(code_of(node.func), 40)}(...)",
            f"not rewritten: {name} is defined in {where}, a copy of torch's FSDP1 code kept in this tree, which "
            f"works on FSDP1 models only (flat parameters, FSDP1's state) and fails on the FSDP2 models the "
            f"rewritten code makes; {same}optimizer state on FSDP2: fsdp_bridge.save_checkpoint / load_checkpoint, "
            "or torch.distributed.checkpoint.state_dict's get_/set_optimizer_state_dict",
            False,
        )

    def _plan_free(self, node: cst.If) -> bool:
        """Plan the rewrite of ``node`` (and mark it consumed); False where it is not the free idiom."""
        if not self.uses_fsdp1 or self.planning:
            return False
        calls = [n for n in walk(node) if isinstance(n, cst.Call) and self._is_reshard(n.func)]
        if not calls or not calls[0].args:
            return False
        unit = code_of(calls[0].args[0].value)
        if not isinstance(calls[0].args[0].value, cst.Name):
            return False
        locals_ = self._locals(node)
        if locals_ is None or not self._names_stay_in((node,), locals_):
            return False
        proven = [False]
        if not self._free_if(node, unit, locals_, proven, top=True):
            return False
        if not proven[0] and self._fsdp1_wrapper(node, calls[0].args[0].value) != "fsdp1":
            return False
        self.needs_imports.add(("fsdp_bridge", None))
        code = f"fsdp_bridge.reshard({unit}, recurse=False)"
        self.stmt_rewrites[id(node)] = code
        self.consumed_nodes.update(id(n) for n in walk(node))
        self._record(
            node,
            f"if ...: _reshard({unit}, ...) (FSDP1's private free of a unit's gathered parameters)",
            f"{code}: frees what the unit holds gathered on both backends (fsdp1: FSDP1's _reshard for a unit "
            "with parameters that is not NO_SHARD; fsdp2: FSDPModule.reshard())",
            True,
        )
        return True

    # -- the statement ------------------------------------------------------------------
    def _is_reshard(self, func: cst.BaseExpression) -> bool:
        return any(q.name == RESHARD for q in self.get_metadata(QualifiedNameProvider, func, set()))

    def _locals(self, node: cst.If) -> set[str] | None:
        """Names assigned inside ``node`` (plain names only); None where something else is assigned."""
        names: set[str] = set()
        for n in walk(node):
            if isinstance(n, (cst.AugAssign, cst.NamedExpr, cst.Global, cst.Nonlocal, cst.Del)):
                return None
            if isinstance(n, cst.Assign):
                for t in n.targets:
                    if not isinstance(t.target, cst.Name):
                        return None
                    names.add(t.target.value)
            elif isinstance(n, cst.AnnAssign):
                if not isinstance(n.target, cst.Name) or n.value is None:
                    return None
                names.add(n.target.value)
        return names

    def _last_in_loop(self, node: cst.CSTNode) -> bool:
        """``node`` is the last statement of the innermost enclosing ``for`` (``continue`` there ends the body)."""
        for stmt in reversed(self.stmt_stack[:-1]):
            if isinstance(stmt, cst.For) and isinstance(stmt.body, cst.IndentedBlock):
                return bool(stmt.body.body) and stmt.body.body[-1] is node
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef, cst.While, cst.With)):
                return False
        return False

    def _free_if(self, node: cst.If, unit: str, locals_: set[str], proven: list[bool], *, top: bool) -> bool:
        test = node.test
        if top and isinstance(test, cst.Call) and code_of(test.func) == "hasattr" and len(test.args) == 2:
            # ``hasattr(unit, "_handles")`` choosing between torch versions: both branches must free.
            if code_of(test.args[0].value) != unit or not isinstance(node.orelse, cst.Else):
                return False
            return self._free_block(node.body, unit, locals_, proven) and self._free_block(
                node.orelse.body, unit, locals_, proven
            )
        if node.orelse is not None or not self._free_guard(test, unit, proven):
            return False
        return self._free_block(node.body, unit, locals_, proven)

    def _free_block(self, body: cst.BaseSuite, unit: str, locals_: set[str], proven: list[bool]) -> bool:
        if not isinstance(body, cst.IndentedBlock) or not body.body:
            return False
        *before, last = body.body
        for stmt in before:
            if isinstance(stmt, cst.If):
                # ``if not handle: continue`` / ``if storage_size == 0: continue``: nothing to free there
                if not (
                    stmt.orelse is None
                    and self._inert(stmt.test, unit, locals_)
                    and isinstance(stmt.body, cst.IndentedBlock)
                    and len(stmt.body.body) == 1
                    and m_continue(stmt.body.body[0])
                    and self._last_in_loop(self._current_if())
                ):
                    return False
            elif not (
                isinstance(stmt, cst.SimpleStatementLine)
                and all(
                    isinstance(s, (cst.Assign, cst.AnnAssign))
                    and s.value is not None
                    and self._inert(s.value, unit, locals_)
                    for s in stmt.body
                )
            ):
                return False
        if not (
            isinstance(last, cst.SimpleStatementLine) and len(last.body) == 1 and isinstance(last.body[0], cst.Expr)
        ):
            return False
        call = last.body[0].value
        if not (isinstance(call, cst.Call) and self._is_reshard(call.func) and len(call.args) == 3):
            return False
        first, handles, free = (a.value for a in call.args)
        if any(a.keyword is not None or a.star for a in call.args) or code_of(first) != unit:
            return False
        if not self._inert(handles, unit, locals_):
            return False
        if isinstance(free, cst.Name) and free.value in locals_:
            return self._trues(free.value)
        return code_of(free) == "True" or (self._all_true(free) and self._inert(free, unit, locals_))

    def _current_if(self) -> cst.CSTNode:
        return self.stmt_stack[-1]

    def _trues(self, name: str) -> bool:
        """``name`` is assigned only a list of True (``[True for h in handles]``, ``[True] * len(handles)``)."""
        values = [
            n.value
            for n in walk(self._current_if())
            if isinstance(n, cst.Assign) and any(code_of(t.target) == name for t in n.targets)
        ]
        return bool(values) and all(self._all_true(v) for v in values)

    @staticmethod
    def _all_true(value: cst.BaseExpression) -> bool:
        """``[True for h in handles]`` or ``[True] * len(handles)``: FSDP1's free flag per handle."""
        return (isinstance(value, cst.ListComp) and code_of(value.elt) == "True") or (
            isinstance(value, cst.BinaryOperation)
            and isinstance(value.operator, cst.Multiply)
            and code_of(value.left) == "[True]"
        )

    # -- expressions -------------------------------------------------------------------
    def _inert(self, expr: cst.BaseExpression, unit: str, locals_: set[str]) -> bool:
        """Only reads: the unit, the statement's locals, constants, FSDP1's read-only handle methods."""
        for n in walk(expr):
            if isinstance(n, cst.Call):
                func = n.func
                if isinstance(func, cst.Name) and func.value in ("len", "hasattr"):
                    continue
                if not (isinstance(func, cst.Attribute) and func.attr.value in READS and not n.args):
                    return False
            elif isinstance(n, (cst.Lambda, cst.Await, cst.Yield, cst.NamedExpr)):
                return False
        names = {
            n.value for n in walk(expr) if isinstance(n, cst.Name) and not self._attr_name(expr, n)
        } - self._comp_targets(expr)
        return names <= {unit, *locals_, *ALLOWED_NAMES}

    @staticmethod
    def _attr_name(expr: cst.BaseExpression, name: cst.Name) -> bool:
        return any(isinstance(n, cst.Attribute) and n.attr is name for n in walk(expr))

    @staticmethod
    def _comp_targets(expr: cst.BaseExpression) -> set[str]:
        return {n.target.value for n in walk(expr) if isinstance(n, cst.CompFor) and isinstance(n.target, cst.Name)}

    def _free_guard(self, test: cst.BaseExpression, unit: str, proven: list[bool], depth: int = 0) -> bool:
        """A conjunction of FSDP1's own tests on ``unit``: what ``fsdp_bridge.reshard`` skips by itself."""
        if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
            return self._free_guard(test.left, unit, proven, depth) and self._free_guard(
                test.right, unit, proven, depth
            )
        if isinstance(test, cst.Attribute) and code_of(test) == f"{unit}._has_params":
            return True
        if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
            left, target = code_of(test.left), test.comparisons[0]
            right = code_of(target.comparator)
            if isinstance(target.operator, cst.IsNot) or isinstance(target.operator, cst.NotEqual):
                if left == f"{unit}.sharding_strategy" and self._no_shard(target.comparator):
                    return True
                if left == f"{unit}.sharding_strategy.name" and right in ('"NO_SHARD"', "'NO_SHARD'"):
                    return True
            return False
        if isinstance(test, cst.Call) and len(test.args) >= 1 and code_of(test.args[0].value) == unit:
            if code_of(test.func) == "isinstance" and len(test.args) == 2:
                if self._qn(test.args[1].value) == (FSDP, ""):
                    proven[0] = True
                    return True
                return False
            if isinstance(test.func, cst.Name) and len(test.args) == 1 and depth < 3:
                return self._free_predicate(test.func.value, proven, depth + 1)
        return False

    def _no_shard(self, expr: cst.BaseExpression) -> bool:
        return any(
            q.name.endswith("ShardingStrategy.NO_SHARD") for q in self.get_metadata(QualifiedNameProvider, expr, set())
        )

    def _free_predicate(self, name: str, proven: list[bool], depth: int) -> bool:
        """A function of this file with one parameter whose body is ``return <FSDP1's own tests on it>``."""
        if self.module is None:
            return False
        defs = [n for n in self.module.body if isinstance(n, cst.FunctionDef) and n.name.value == name]
        if len(defs) != 1:
            return False
        fn = defs[0]
        params = fn.params
        if len(params.params) != 1 or isinstance(params.star_arg, (cst.Param, cst.ParamStar)) or params.kwonly_params:
            return False
        if params.star_kwarg is not None or fn.decorators:
            return False
        body = fn.body.body if isinstance(fn.body, cst.IndentedBlock) else ()
        stmts = [s for s in body if not (isinstance(s, cst.SimpleStatementLine) and isinstance(s.body[0], cst.Expr))]
        if len(stmts) != 1 or not isinstance(stmts[0], cst.SimpleStatementLine):
            return False
        ret = stmts[0].body[0]
        if not isinstance(ret, cst.Return) or ret.value is None:
            return False
        return self._free_guard(ret.value, params.params[0].name.value, proven, depth)


def m_continue(stmt: cst.BaseStatement) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Continue)


LAZY_INIT = "torch.distributed.fsdp._runtime_utils._lazy_init"
FREE_STORAGE = "torch.distributed.utils._free_storage"


class StorageFixer(ScannerBase):
    """FSDP1's private moves and frees of a model's flat-parameter storage -> ``fsdp_bridge.move_shards`` /
    ``fsdp_bridge.free_shards``. Rewritten only where every statement serves that purpose::

        _lazy_init(model, model)
        for handle in model._all_handles:
            if handle._offload_params:
                continue
            flat_param = handle.flat_param
            handle.flat_param_to(device, non_blocking=...)
            flat_param._local_shard = flat_param.data

    becomes ``fsdp_bridge.move_shards(model, device, non_blocking=...)``, and::

        for m in model.modules():
            if isinstance(m, FSDP):
                _free_storage(m._handle.flat_param.data)

    becomes ``fsdp_bridge.free_shards(model)``. ``_lazy_init`` and ``._all_handles`` exist only on FSDP1's root,
    and ``isinstance(m, FSDP)`` names FSDP1's wrapper: the code proves the model is FSDP1's. Any other
    statement in the loop, or a name of the loop read after it, keeps the TODOs."""

    def _plan_storage(self, body: Sequence[cst.BaseStatement]) -> None:
        if not self.uses_fsdp1 or self.planning:
            return
        for i, stmt in enumerate(body):
            if not isinstance(stmt, cst.For) or id(stmt) in self.whole_loops:
                continue
            if i > 0 and (move := self._move_loop(body[i - 1], stmt)) is not None:
                code, what = move
                self.removed_stmts.add(id(body[i - 1]))
                self.consumed_nodes.update(id(n) for n in walk(body[i - 1]))
            elif (free := self._free_loop(stmt)) is not None:
                code, what = free
            else:
                continue
            self.whole_loops.add(id(stmt))
            self.stmt_rewrites[id(stmt)] = code
            self.consumed_nodes.update(id(n) for n in walk(stmt))
            self.needs_imports.add(("fsdp_bridge", None))
            self._record(stmt, what, code + _STORAGE_NOTES[code.split("(", 1)[0]], True)

    def _qname(self, func: cst.BaseExpression, name: str) -> bool:
        return any(q.name == name for q in self.get_metadata(QualifiedNameProvider, func, set()))

    def _move_loop(self, before: cst.BaseStatement, loop: cst.For) -> tuple[str, str] | None:
        if not (isinstance(before, cst.SimpleStatementLine) and len(before.body) == 1):
            return None
        init = before.body[0]
        if not (isinstance(init, cst.Expr) and isinstance(init.value, cst.Call)):
            return None
        call = init.value
        if not self._qname(call.func, LAZY_INIT) or len(call.args) != 2 or any(a.keyword or a.star for a in call.args):
            return None
        model = code_of(call.args[0].value)
        if code_of(call.args[1].value) != model or not isinstance(call.args[0].value, (cst.Name, cst.Attribute)):
            return None
        if code_of(loop.iter) != f"{model}._all_handles" or not isinstance(loop.target, cst.Name) or loop.orelse:
            return None
        handle = loop.target.value
        stmts = list(loop.body.body) if isinstance(loop.body, cst.IndentedBlock) else []
        if len(stmts) not in (3, 4):
            return None
        skip = stmts.pop(0)
        if not (
            isinstance(skip, cst.If)
            and skip.orelse is None
            and code_of(skip.test) == f"{handle}._offload_params"
            and isinstance(skip.body, cst.IndentedBlock)
            and len(skip.body.body) == 1
            and m_continue(skip.body.body[0])
        ):
            return None
        flat = f"{handle}.flat_param"
        names = {handle}
        if len(stmts) == 3:
            alias = _simple(stmts.pop(0))
            if not (isinstance(alias, cst.Assign) and len(alias.targets) == 1):
                return None
            if not isinstance(alias.targets[0].target, cst.Name) or code_of(alias.value) != flat:
                return None
            flat = alias.targets[0].target.value
            names.add(flat)
        move, keep = (_simple(s) for s in stmts)
        if not (isinstance(move, cst.Expr) and isinstance(move.value, cst.Call)):
            return None
        to = move.value
        if code_of(to.func) != f"{handle}.flat_param_to" or not to.args or to.args[0].keyword or to.args[0].star:
            return None
        device = to.args[0].value
        rest = to.args[1:]
        if len(rest) > 1 or (rest and (rest[0].keyword is None or rest[0].keyword.value != "non_blocking")):
            return None
        if any(isinstance(n, cst.Name) and n.value in names for n in walk(device)):
            return None
        if not (isinstance(keep, cst.Assign) and len(keep.targets) == 1):
            return None
        if code_of(keep.targets[0].target) != f"{flat}._local_shard" or code_of(keep.value) != f"{flat}.data":
            return None
        if not self._names_stay_in((loop,), names):
            return None
        args = [model, code_of(device)] + [f"non_blocking={code_of(rest[0].value)}" for _ in rest]
        code = f"fsdp_bridge.move_shards({', '.join(args)})"
        return code, f"_lazy_init({model}, {model}) + for {handle} in {model}._all_handles: flat_param_to(...)"

    def _free_loop(self, loop: cst.For) -> tuple[str, str] | None:
        if not isinstance(loop.target, cst.Name) or loop.orelse or not isinstance(loop.iter, cst.Call):
            return None
        it = loop.iter
        if not (isinstance(it.func, cst.Attribute) and it.func.attr.value == "modules" and not it.args):
            return None
        model = code_of(it.func.value)
        if not isinstance(it.func.value, (cst.Name, cst.Attribute)):
            return None
        unit = loop.target.value
        stmts = list(loop.body.body) if isinstance(loop.body, cst.IndentedBlock) else []
        if len(stmts) != 1 or not isinstance(stmts[0], cst.If) or stmts[0].orelse is not None:
            return None
        test = stmts[0].test
        if not (
            isinstance(test, cst.Call)
            and code_of(test.func) == "isinstance"
            and len(test.args) == 2
            and code_of(test.args[0].value) == unit
            and self._qn(test.args[1].value) == (FSDP, "")
        ):
            return None
        inner = stmts[0].body.body if isinstance(stmts[0].body, cst.IndentedBlock) else []
        if len(inner) != 1:
            return None
        free = _simple(inner[0])
        if not (isinstance(free, cst.Expr) and isinstance(free.value, cst.Call)):
            return None
        call = free.value
        if not self._qname(call.func, FREE_STORAGE) or len(call.args) != 1 or call.args[0].keyword:
            return None
        if code_of(call.args[0].value) != f"{unit}._handle.flat_param.data":
            return None
        if not self._names_stay_in((loop,), {unit}):
            return None
        return f"fsdp_bridge.free_shards({model})", (
            f"for {unit} in {model}.modules(): _free_storage({unit}._handle.flat_param.data)"
        )


def _simple(stmt: cst.BaseStatement) -> cst.BaseSmallStatement | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        return stmt.body[0]
    return None


_STORAGE_NOTES = {
    "fsdp_bridge.move_shards": ": moves the parameter shards on both backends (fsdp1: FSDP1's own steps, handles under "
    "CPU offload skipped; fsdp2: FSDP2's _apply on the sharded parameters, units under CPUOffloadPolicy skipped)",
    "fsdp_bridge.free_shards": ": releases the shards' storage on both backends (fsdp1: each unit's flat parameter; "
    "fsdp2: reshard, then each sharded parameter's local storage)",
}
