"""Which objects are FSDP1's: code that already tells the backends apart (regions FSDP2 modules
never reach), objects tested as DDP, and the wrapper kinds an object may hold."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import libcst as cst
import libcst.matchers as m
from libcst.metadata import PositionProvider, QualifiedNameProvider

from fsdp_bridge.migrate._analysis import (
    Region,
    code_of,
    exits,
    fsdp1_returns,
    is_fsdp2_class,
    resolve_fsdp,
    tests_fsdp1,
    walk,
    wrapper_kinds_named,
)
from fsdp_bridge.migrate._names import FSDP
from fsdp_bridge.migrate._scan_base import ScannerBase


class ObjectAnalysis(ScannerBase):
    """Which objects are FSDP1's, and code that tells the backends apart."""

    # -- code that already tells the backends apart ----------------------------------
    def _guard(self, test: cst.BaseExpression) -> tuple[str, bool, cst.Call | None] | None:
        """``(backend, pure, check)`` when ``test`` can hold only for modules of one backend: "fsdp1" or
        "fsdp2"; ``pure`` when it is that test alone (not one side of ``and``); ``check`` the
        ``isinstance(x, FSDP)`` call it rests on, if it does."""
        if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
            for side in (test.left, test.right):
                if (g := self._guard(side)) is not None:
                    return g[0], False, g[2]
            return None
        if isinstance(test, cst.Call) and m.matches(test.func, m.Name("isinstance")) and len(test.args) == 2:
            cls = test.args[1].value
            if self._qn(cls) == (FSDP, ""):
                return "fsdp1", True, test
            if is_fsdp2_class(self.get_metadata(QualifiedNameProvider, cls, set())):
                return "fsdp2", True, None
            return None
        if isinstance(test, cst.Call) and code_of(test.func).rsplit(".", 1)[-1] in self.dispatch.fsdp2_tests:
            return "fsdp2", True, None
        if (
            isinstance(test, cst.Comparison)
            and len(test.comparisons) == 1
            and isinstance(test.left, cst.Call)
            and isinstance(test.comparisons[0].operator, cst.Equal)
            and isinstance(comparator := test.comparisons[0].comparator, cst.Integer)
        ):
            versions = self.dispatch.versions.get(code_of(test.left.func).rsplit(".", 1)[-1])
            value = int(comparator.value.replace("_", ""), 0)
            if versions is not None and value in versions:
                return ("fsdp1" if value == versions[0] else "fsdp2"), True, None
        return None

    def _admitted(self, test: cst.BaseExpression, target: str) -> set[str]:
        """The backends ("fsdp1", "fsdp2") whose modules ``test`` may hold for ``target``, where it tests nothing
        but that: ``fsdp_version(target) > 0`` (``>=``, ``!=``, ``<``, ``<=``, ``==`` and ``in`` read against the
        tree's helper's two literals, see :class:`Dispatch`), ``isinstance(target, (FSDP, FSDPModule))``, an
        ``or`` of such tests, or an ``and`` with them; empty for anything else."""
        if isinstance(test, cst.BooleanOperation):
            left, right = self._admitted(test.left, target), self._admitted(test.right, target)
            if isinstance(test.operator, cst.Or):
                return left | right if left and right else set()
            return left & right if left and right else left or right  # ``and``: the sides that test target
        if isinstance(test, cst.Call) and code_of(test.func) == "fsdp_bridge.is_sharded":
            # what --fix writes for FSDP1's class beside FSDPModule
            return {"fsdp1"} if _tested(test) == target else set()
        if isinstance(test, cst.Call) and m.matches(test.func, m.Name("isinstance")) and len(test.args) == 2:
            classes = test.args[1].value
            if code_of(test.args[0].value) != target:
                return set()
            kinds = set()
            for el in classes.elements if isinstance(classes, cst.Tuple) else (cst.Element(classes),):
                if self._qn(el.value) == (FSDP, ""):
                    kinds.add("fsdp1")
                elif is_fsdp2_class(self.get_metadata(QualifiedNameProvider, el.value, set())):
                    kinds.add("fsdp2")
                else:
                    return set()  # another class (DDP's) too
            return kinds
        if (g := self._guard(test)) is not None and g[1]:
            return {g[0]} if _tested(test) == target else set()
        call, ops = test, None
        if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
            call, ops = test.left, test.comparisons[0]
        if not (
            isinstance(call, cst.Call)
            and len(call.args) == 1
            and code_of(call.args[0].value) == target
            and (versions := self.dispatch.versions.get(code_of(call.func).rsplit(".", 1)[-1])) is not None
        ):
            return set()
        return {
            kind
            for kind, v in zip(("fsdp1", "fsdp2"), versions, strict=True)
            if (bool(v) if ops is None else _holds(v, ops))  # ``if fsdp_version(m):``
        }

    def _guards_around(
        self, node: cst.CSTNode, *, conditional: bool
    ) -> Iterator[tuple[cst.BaseExpression, tuple[int, int]]]:
        """``(test, where its guarded body starts)`` for each ``if`` (a conditional expression too, with
        ``conditional``) and each ``and`` of the current function (or module) whose guarded part holds ``node``."""
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        if scope is None:
            return
        here = self.get_metadata(PositionProvider, node).start
        kinds = (cst.If, cst.IfExp) if conditional else (cst.If,)
        for n in walk(scope):
            body: cst.CSTNode
            if isinstance(n, kinds):
                test, body = n.test, n.body
            elif isinstance(n, cst.BooleanOperation) and isinstance(n.operator, cst.And):
                test, body = n.left, n.right
            else:
                continue
            span = self.get_metadata(PositionProvider, body)
            start = (span.start.line, span.start.column)
            if start <= (here.line, here.column) <= (span.end.line, span.end.column):
                yield test, start

    def _fsdp2_admitted_around(self, node: cst.CSTNode, target: str) -> str | None:
        """The test of the innermost ``if`` (or ``and``) around ``node`` that tests ``target``, as code, where it
        holds for torch's own ``fully_shard`` modules, those of FSDP1 too or not (see :meth:`_admitted`; ``--target
        torch`` writes ``isinstance(m, FSDPModule)`` for the first); None otherwise."""
        best: tuple[tuple[int, int], cst.BaseExpression] | None = None
        for test, start in self._guards_around(node, conditional=False):
            if any(code_of(x) == target for x in walk(test)) and (best is None or start > best[0]):
                best = (start, test)
        if best is None:
            return None
        return code_of(best[1]) if "fsdp2" in self._admitted(best[1], target) else None

    def _add_region(self, first: cst.CSTNode, last: cst.CSTNode, guard: cst.BaseExpression) -> Region:
        start = self.get_metadata(PositionProvider, first).start
        end = self.get_metadata(PositionProvider, last).end
        region = Region(
            (start.line, start.column),
            (end.line, end.column),
            code_of(guard),
            self.get_metadata(PositionProvider, guard).start.line,
        )
        self.regions.append(region)
        return region

    def _in_region(self, node: cst.CSTNode) -> Region | None:
        if not self.regions:
            return None
        pos = self.get_metadata(PositionProvider, node).start
        return next((r for r in self.regions if r.start <= (pos.line, pos.column) <= r.end), None)

    def _plan_regions(self, module: cst.Module) -> None:
        """Find the code FSDP2 modules never reach in dual-backend code: branches of an if/elif chain that
        tests ``isinstance(x, FSDPModule)`` (or a helper of the tree that does, see :class:`Dispatch`)
        that come after that test or test FSDP1 themselves, and the rest of a block after
        ``if <FSDP2 test>: ... return``.  FSDP1 constructs there stay as written: after migration FSDP2
        modules take the code's own FSDP2 path, and an FSDP1 module (fsdp_bridge's fsdp1 backend) runs
        them as before, so rewriting them could only change the FSDP1 path."""
        for node in walk(module):
            if not isinstance(node, (cst.Module, cst.IndentedBlock)):
                continue
            stmts = node.body
            chains = [self._chain(stmt) for stmt in stmts if isinstance(stmt, cst.If)]
            # Separate ifs of one block (`if isinstance(m, FSDP): return 1` / `if isinstance(m, FSDPModule): ...`)
            # tell the backends apart as an if/elif chain does.
            block_dual = any(g is not None and g[0] == "fsdp2" for chain, _ in chains for _, _, g in chain)
            for chain, tail in chains:
                dual = block_dual
                routed: cst.BaseExpression | None = None
                for test, body, g in chain:
                    fsdp1 = g is not None and g[0] == "fsdp1" and (g[2] is None or dual)
                    if routed is not None or fsdp1:
                        self._add_region(body, body, routed if routed is not None else test)
                        if g is not None and g[2] is not None and dual:
                            self.kept_checks.add(id(g[2]))
                    if routed is None and g is not None and g[0] == "fsdp2" and g[1]:
                        routed = test
                if tail is not None and routed is not None:
                    self._add_region(tail, tail, routed)
            for i, stmt in enumerate(stmts[:-1]):
                if (
                    isinstance(stmt, cst.If)
                    and stmt.orelse is None
                    and (g := self._guard(stmt.test)) is not None
                    and g[0] == "fsdp2"
                    and g[1]
                    and exits(stmt.body)
                ):
                    self._add_region(stmts[i + 1], stmts[-1], stmt.test)
                    break

    def _chain(self, node: cst.If) -> tuple[list[tuple[cst.BaseExpression, cst.BaseSuite, Any]], cst.BaseSuite | None]:
        """An if/elif chain as (test, body, guard) triples, and its else body."""
        chain = []
        cur = node
        while isinstance(cur.orelse, cst.If):
            chain.append((cur.test, cur.body, self._guard(cur.test)))
            cur = cur.orelse
        chain.append((cur.test, cur.body, self._guard(cur.test)))
        return chain, cur.orelse.body if isinstance(cur.orelse, cst.Else) else None

    def _ddp_tested(self, obj: cst.BaseExpression) -> bool:
        """``obj`` is tested with ``isinstance(obj, DistributedDataParallel)`` in the enclosing function (or the
        module), and never with ``isinstance(obj, FSDP)``: its ``no_sync`` is DDP's, not FSDP1's."""
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        if scope is None:
            return False
        if id(scope) not in self.ddp_tests:
            ddp: set[str] = set()
            fsdp: set[str] = set()
            for n in walk(scope):
                if not (isinstance(n, cst.Call) and m.matches(n.func, m.Name("isinstance")) and len(n.args) == 2):
                    continue
                quals = [q for x in walk(n.args[1].value) for q in self.get_metadata(QualifiedNameProvider, x, set())]
                if any(
                    q.name.startswith("torch.nn.parallel.") and q.name.endswith(".DistributedDataParallel")
                    for q in quals
                ):
                    ddp.add(code_of(n.args[0].value))
                if any(resolve_fsdp([q]) == (FSDP, "") for q in quals):
                    fsdp.add(code_of(n.args[0].value))
            self.ddp_tests[id(scope)] = ddp - fsdp
        return code_of(obj) in self.ddp_tests[id(scope)]

    def _fsdp1_predicates(self) -> set[str]:
        """Functions of this file whose every ``return`` is ``isinstance(<first parameter>, FSDP)``."""
        if self.predicates is None:
            self.predicates = set()
            for n in walk(self.module) if self.module is not None else ():
                if isinstance(n, cst.FunctionDef) and tests_fsdp1(
                    n, lambda x: self.get_metadata(QualifiedNameProvider, x, set())
                ):
                    self.predicates.add(n.name.value)
        return self.predicates

    def _test_kinds(self, test: cst.BaseExpression, target: str) -> set[str]:
        """Wrapper kinds that ``test`` checks ``target`` for: ``isinstance(target, FSDP | DDP)`` (in ``or``/``and``
        combinations too) or a helper of this file that returns ``isinstance(x, FSDP)``; "not-fsdp1" for such a
        test under ``not`` (what it guards runs for every module but FSDP1's)."""
        kinds: set[str] = set()
        negated = {
            id(x)
            for n in walk(test)
            if isinstance(n, cst.UnaryOperation) and isinstance(n.operator, cst.Not)
            for x in walk(n.expression)
        }
        for n in walk(test):
            if not isinstance(n, cst.Call) or not n.args or code_of(n.args[0].value) != target:
                continue
            if m.matches(n.func, m.Name("isinstance")) and len(n.args) == 2:
                for x in walk(n.args[1].value):
                    quals = self.get_metadata(QualifiedNameProvider, x, set())
                    if resolve_fsdp(quals) == (FSDP, ""):
                        # ``not isinstance(x, FSDP)``: the code it guards runs for every other module
                        kinds.add("not-fsdp1" if id(n) in negated else "fsdp1")
                    if any(q.name.endswith(".DistributedDataParallel") for q in quals):
                        kinds.add("ddp")
            elif isinstance(n.func, cst.Name) and (
                n.func.value in self._fsdp1_predicates()
                or self._tree_predicate(self.get_metadata(QualifiedNameProvider, n.func, set()))
            ):
                kinds.add("not-fsdp1" if id(n) in negated else "fsdp1")
        return kinds

    def _isinstance_branch(self, node: cst.CSTNode, obj: cst.BaseExpression) -> set[str]:
        """The wrapper kinds tested for ``obj`` by the innermost guard holding ``node``: the body of an
        ``if``/``elif`` or of a conditional expression (or its ``else``, for a test of FSDP1's class alone), or
        what follows an ``and``."""
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        if scope is None:
            return set()
        target, here = code_of(obj), self.get_metadata(PositionProvider, node).start
        best: tuple[Any, set[str]] | None = None
        flipped = {"fsdp1": "not-fsdp1", "not-fsdp1": "fsdp1"}
        for n in walk(scope):
            guarded: list[tuple[cst.BaseExpression, cst.CSTNode, bool]] = []  # (test, body, in its else)
            if isinstance(n, cst.If):
                guarded.append((n.test, n.body, False))
                if isinstance(n.orelse, cst.Else):
                    guarded.append((n.test, n.orelse.body, True))
            elif isinstance(n, cst.IfExp):
                guarded += [(n.test, n.body, False), (n.test, n.orelse, True)]
            elif isinstance(n, cst.BooleanOperation) and isinstance(n.operator, cst.And):
                guarded.append((n.left, n.right, False))
            for test, body, otherwise in guarded:
                span = self.get_metadata(PositionProvider, body)
                start, end = (span.start.line, span.start.column), (span.end.line, span.end.column)
                if not start <= (here.line, here.column) <= end:
                    continue
                kinds = self._test_kinds(test, target)
                if otherwise:
                    # ``else:`` of ``if isinstance(x, FSDP):`` runs for every module but FSDP1's (and the
                    # reverse); a test naming DDP too says nothing of its else
                    kinds = {flipped[k] for k in kinds} if len(kinds) == 1 and kinds <= set(flipped) else set()
                if kinds and (best is None or start > best[0]):
                    best = (start, kinds)
        return best[1] if best is not None else set()

    def _fsdp1_tested_around(self, node: cst.CSTNode) -> str | None:
        """The object an enclosing guard tests for FSDP1's wrapper (``if isinstance(lm_model, FSDP):`` around
        ``self.lm_model.module...``, the same model under another name), or None: the guard's test becomes
        ``fsdp_bridge.is_sharded(...)``, true for FSDP2's modules too, so what it guards runs for them."""
        for test, _ in self._guards_around(node, conditional=True):
            for call in walk(test):
                if (
                    isinstance(call, cst.Call)
                    and m.matches(call.func, m.Name("isinstance"))
                    and len(call.args) == 2
                    and "fsdp1" in self._test_kinds(test, code_of(call.args[0].value))
                ):
                    return code_of(call.args[0].value)
        return None

    def _fsdp1_wrapper(self, node: cst.CSTNode, obj: cst.BaseExpression, *, by_calls: bool = True) -> str:
        """Whether ``obj`` at ``node`` is FSDP1's wrapper: "fsdp1", "ambiguous" (DDP's too), or "" (not shown).

        A guard around ``node`` decides (``if isinstance(obj, FSDP):``, ``is_fsdp(obj) and ...``); else the
        function (for ``self.x``: the class) shows it: assigned ``FSDP(...)``/``wrap(...)`` above ``node``,
        ``assert isinstance(obj, FSDP)``, an ``obj: FSDP`` annotation, or FSDP1's ``clip_grad_norm_``
        called on it (DDP has none). DistributedDataParallel assigned or tested there makes it ambiguous."""
        branch = self._isinstance_branch(node, obj)
        if branch:
            if "fsdp1" not in branch:
                return ""  # tested as DDP, or as not FSDP1's wrapper
            return "fsdp1" if branch == {"fsdp1"} else "ambiguous"
        if self._plain_above(node, obj):
            return ""
        kinds = self._wrapper_kinds(obj, by_calls=by_calls, before=node)
        if "fsdp1" not in kinds:
            return ""
        return "ambiguous" if "ddp" in kinds else "fsdp1"

    def _plain_above(self, node: cst.CSTNode, obj: cst.BaseExpression) -> bool:
        """``self.x`` at ``node`` is the module before any wrap: this method assigns it above ``node`` (the last
        such assignment) a value with nothing of FSDP1's in it (``self.dit = Model.from_pretrained(...)``), and
        nothing between calls a method of the instance or hands the instance on (either could wrap it). The
        class's other methods may wrap ``self.x`` later; here it is still the plain module. Also where this method
        assigns nothing to ``self.x`` but is called only as ``self.method(...)`` from methods of the class at points
        where ``self.x`` is plain so (``__init__`` loading a snapshot into the model before wrapping it)."""
        target = code_of(obj)
        if not target.startswith("self.") or not self.functions:
            return False
        fn = self.functions[-1]
        at = self.get_metadata(PositionProvider, node).start
        plain = self._plain_at(fn, (at.line, at.column), target, calls_allowed=())
        if plain is not None:
            return plain
        if len(self.functions) != 1 or not self.classes or self.module is None:
            return False
        name = fn.name.value
        mentions = re.findall(rf"(?:\bdef\s+|self\.|\W|^){re.escape(name)}\b", self.module.code, re.M)
        if self.classes[-1].name.value in self.dispatch.subclassed or len(mentions) != 1 + len(
            re.findall(rf"\bself\.{re.escape(name)}\(", self.module.code)
        ):
            return False  # reached otherwise too (another receiver, a reference, a subclass): not shown plain
        callers = [
            (caller, n)
            for caller in walk(self.classes[-1])
            if isinstance(caller, cst.FunctionDef)
            for n in walk(caller)
            if isinstance(n, cst.Call)
            and m.matches(n.func, m.Attribute(value=m.Name("self"), attr=m.Name(fn.name.value)))
        ]
        if not callers or any(caller is fn for caller, _ in callers):
            return False
        for caller, call in callers:
            start = self.get_metadata(PositionProvider, call).start
            if not self._plain_at(caller, (start.line, start.column), target, calls_allowed=(call,)):
                return False
        return True

    def _plain_elsewhere(self, node: cst.CSTNode, obj: cst.BaseExpression) -> bool:
        """``self.x`` at ``node`` is FSDP1's by its class alone: this method neither tests nor assigns it above, and
        some method of the class assigns it a plain value too (``self.model = model`` in ``__init__``, wrapped later):
        a method the class calls before the wrap (a resume from ``__init__``) sees the plain module."""
        target = code_of(obj)
        if not target.startswith("self.") or not self.functions or not self.classes:
            return False
        if self._isinstance_branch(node, obj):
            return False
        at = self.get_metadata(PositionProvider, node).start
        if self._plain_at(self.functions[-1], (at.line, at.column), target, calls_allowed=()) is not None:
            return False  # this method assigns it above: that value decides
        for n in walk(self.classes[-1]):
            if isinstance(n, cst.Assign) and any(code_of(t.target) == target for t in n.targets):
                if not self._fsdp1_value(n.value) and not m.matches(n.value, m.Name("None")):
                    return True
        return False

    def _fsdp1_value(self, value: cst.BaseExpression) -> bool:
        """Whether an assigned value may be an FSDP1 model: it calls FSDP1's class (or its ``wrap``), a factory of
        the tree returning one, or a method of this class that makes one."""
        makers = self._local_fsdp1_makers()
        for x in walk(value):
            quals = self.get_metadata(QualifiedNameProvider, x, set())
            if resolve_fsdp(quals) in ((FSDP, ""), ("wrap", "")) or self._fsdp1_factory(quals):
                return True
            if isinstance(x, cst.Call) and code_of(x.func).removeprefix("self.") in makers:
                return True
        return False

    def _plain_at(
        self, fn: cst.FunctionDef, here: tuple[int, int], target: str, *, calls_allowed: tuple[cst.Call, ...]
    ) -> bool | None:
        """``target`` (``self.x``) at ``here`` in ``fn``: True where ``fn`` last assigned it a plain value above and
        nothing between (but ``calls_allowed``) calls a method of the instance or hands it on; False where it
        assigned an FSDP1 value or something between may wrap it; None where ``fn`` assigns it nothing above."""
        last: tuple[tuple[int, int], cst.BaseExpression] | None = None
        for n in walk(fn):
            if isinstance(n, cst.Assign) and any(code_of(t.target) == target for t in n.targets):
                start = self.get_metadata(PositionProvider, n).start
                if (start.line, start.column) < here and (last is None or (start.line, start.column) > last[0]):
                    last = ((start.line, start.column), n.value)
        if last is None:
            return None
        if self._fsdp1_value(last[1]):
            return False
        for n in walk(fn):
            if not isinstance(n, cst.Call) or any(n is c for c in calls_allowed):
                continue
            start = self.get_metadata(PositionProvider, n).start
            if not last[0] < (start.line, start.column) < here:
                continue
            own_method = isinstance(n.func, cst.Attribute) and m.matches(n.func.value, m.Name("self"))
            if own_method or any(m.matches(a.value, m.Name("self")) for a in n.args):
                return False
        return True

    def _wrapper_kinds(
        self, obj: cst.BaseExpression, *, by_calls: bool = True, before: cst.CSTNode | None = None
    ) -> set[str]:
        """See :meth:`_fsdp1_wrapper` (the evidence outside guards)."""
        target = code_of(obj)
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        if target.startswith("self.") and self.classes:
            scope = self.classes[-1]
        elif isinstance(obj, cst.Name) and len(self.functions) > 1 and not _binds_name(self.functions[-1], target):
            # a nested function reading its enclosing function's variable (``ar`` in ``def train_step():`` under
            # ``main``, where ``ar = fsdp_wrap(...)``): the enclosing function's evidence, whenever assigned
            scope, before = self.functions[-2], None
        if scope is None:
            return set()
        limit = None
        if before is not None and isinstance(scope, (cst.FunctionDef, cst.Module)):
            # An assignment counts only above ``before``: ``model.load_state_dict(sd)`` then
            # ``model = FSDP(model)`` loads into the plain module (module-level code too: a script's
            # ``if __name__ == "__main__":`` block).
            limit = self.get_metadata(PositionProvider, before).start
        if isinstance(scope, cst.ClassDef) and before is not None and self.functions:
            # self.x = FSDP(...) further down this method, and not above: here it is the module not yet wrapped
            # (decided here for this position, before the class-wide answer below, which is kept for every other)
            at = self.get_metadata(PositionProvider, before).start
            assigned = [
                self.get_metadata(PositionProvider, n).start
                for n in walk(self.functions[-1])
                if isinstance(n, cst.Assign) and any(code_of(t.target) == target for t in n.targets)
            ]
            if assigned and all((p.line, p.column) > (at.line, at.column) for p in assigned):
                return set()
        key = (id(scope), f"{target} {by_calls} {(limit.line, limit.column) if limit else ''}")
        if key in self.wrapper_kinds:
            return self.wrapper_kinds[key]

        kind = self._value_kinds
        if (held := self._held_by_instance(obj, scope)) is not None:
            self.wrapper_kinds[key] = held
            return held

        rebound: list[tuple[int, int]] = []  # where ``target`` is assigned below ``before``
        if limit is not None:
            for n in walk(scope):
                if isinstance(n, cst.Assign) and any(code_of(t.target) == target for t in n.targets):
                    start = self.get_metadata(PositionProvider, n).start
                    if (start.line, start.column) > (limit.line, limit.column):
                        rebound.append((start.line, start.column))

        def same_object(call: cst.CSTNode) -> bool:
            """No assignment to ``target`` between ``before`` and ``call``: ``model.load_state_dict(sd)``,
            then ``model = FSDP(model)``, then ``model.clip_grad_norm_(1.0)`` clips another object."""
            at = self.get_metadata(PositionProvider, call).start
            return not any(r < (at.line, at.column) for r in rebound)

        kinds: set[str] = set()
        scopes = [scope, *self._base_classes_here(scope, target)] if isinstance(scope, cst.ClassDef) else [scope]
        # ``accelerator = Accelerator(...)`` (another class's object) then ``accelerator.clip_grad_norm_(...)``:
        # that call is the other class's method, no sign of FSDP1's wrapper
        built_otherwise = any(
            isinstance(n, cst.Assign)
            and isinstance(n.value, cst.Call)
            and any(code_of(t.target) == target for t in n.targets)
            and code_of(n.value.func).rsplit(".", 1)[-1][:1].isupper()
            and not kind(n.value.func)
            for s in scopes
            for n in walk(s)
        )
        for n in (x for s in scopes for x in walk(s)):
            if limit is not None and isinstance(n, (cst.IndentedBlock, cst.Module)):
                # Assigned in a statement that ends above ``before``, in a block that holds it: not in a sibling
                # branch (``if fsdp1: m = FSDP(m)`` then ``elif fsdp2: m.state_dict()`` is the plain module).
                span = self.get_metadata(PositionProvider, n)
                if (
                    not (span.start.line, span.start.column)
                    <= (limit.line, limit.column)
                    <= (
                        span.end.line,
                        span.end.column,
                    )
                ):
                    continue
                for stmt in n.body:  # statements that end before it (an if/else above: either branch's value)
                    end = self.get_metadata(PositionProvider, stmt).end
                    if (end.line, end.column) > (limit.line, limit.column):
                        continue
                    if (
                        isinstance(stmt, cst.If)
                        and isinstance(stmt.test, cst.UnaryOperation)
                        and isinstance(stmt.test.operator, cst.Not)
                        and exits(stmt.body)
                    ):
                        kinds |= self._test_kinds(stmt.test.expression, target)  # ``if not isinstance(x, FSDP): raise``
                    for small in walk(stmt):
                        if (
                            isinstance(small, cst.Assign)
                            and isinstance(small.value, (cst.Call, cst.IfExp))
                            and any(code_of(t.target) == target for t in small.targets)
                        ):
                            kinds |= kind(_made_by(small.value))
            elif limit is None and isinstance(n, cst.Assign) and isinstance(n.value, (cst.Call, cst.IfExp)):
                if any(code_of(t.target) == target for t in n.targets):
                    kinds |= kind(_made_by(n.value))
            elif isinstance(n, cst.Assert):
                kinds |= self._test_kinds(n.test, target)
            elif (
                isinstance(n, (cst.For, cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp))
                and before is not None
            ):
                # ``for m in FSDP.fsdp_modules(model):`` (or a comprehension): m is an FSDP1 unit in there
                loops: list[cst.For | cst.CompFor] = []
                part: cst.For | cst.CompFor | None = n if isinstance(n, cst.For) else n.for_in
                while part is not None:
                    loops.append(part)
                    part = part.inner_for_in if isinstance(part, cst.CompFor) else None
                span, at = self.get_metadata(PositionProvider, n), self.get_metadata(PositionProvider, before).start
                if (span.start.line, span.start.column) <= (at.line, at.column) <= (
                    span.end.line,
                    span.end.column,
                ) and any(
                    code_of(loop.target) == target
                    and isinstance(loop.iter, cst.Call)
                    and self._qn(loop.iter.func) == (FSDP, "fsdp_modules")
                    for loop in loops
                ):
                    kinds.add("fsdp1")
            elif isinstance(n, cst.Call):
                f = n.func
                if m.matches(f, m.Name("isinstance")) and len(n.args) == 2 and code_of(n.args[0].value) == target:
                    kinds |= kind(n.args[1].value) & {"ddp"}  # an FSDP test decides only inside its guard
                elif (
                    by_calls
                    and not built_otherwise
                    and isinstance(f, cst.Attribute)
                    and f.attr.value == "clip_grad_norm_"
                    and code_of(f.value) == target
                    and "clip_grad_norm_" not in self.dispatch.own_methods
                    and same_object(n)
                ):
                    kinds.add("fsdp1")  # DDP has no clip_grad_norm_
            elif isinstance(n, cst.Param) and n.name.value == target and n.annotation is not None:
                kinds |= kind(n.annotation.annotation)
                if "fsdp1" in kinds and _names_others(n.annotation.annotation, self):
                    kinds.add("ddp")  # ``Union[nn.Module, FSDP]``: FSDP1's wrapper on some path, any module on others
        if isinstance(scope, cst.ClassDef) and target.count(".") == 1 and self._handed_in(scope, target[5:]):
            kinds.add("fsdp1")
        elif (
            isinstance(scope, cst.ClassDef)
            and target.count(".") == 1
            and self._handed_in(scope, target[5:], among=True)
        ):
            kinds |= {"fsdp1", "ddp"}  # ``Union[nn.Module, FSDP]``: FSDP1's wrapper on some path, any module on others
        if isinstance(scope, cst.ClassDef) and target.count(".") == 1:
            # ``trainer = Trainer(...)`` and ``trainer.model = FSDP(trainer.model)`` in some file of the tree
            kinds |= self.dispatch.instance_attributes.get(scope.name.value, {}).get(target[5:], set())
        if isinstance(scope, cst.ClassDef) and target.count(".") == 1 and isinstance(scope.body, cst.IndentedBlock):
            # A field declared in the class body (``model: FSDP``, a dataclass's): the type of self.model.
            for stmt in scope.body.body:
                for small in stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ():
                    if isinstance(small, cst.AnnAssign) and m.matches(small.target, m.Name(target[5:])):
                        kinds |= kind(small.annotation.annotation)
        self.wrapper_kinds[key] = kinds
        return kinds

    def _held_by_instance(self, obj: cst.BaseExpression, scope: cst.CSTNode) -> set[str] | None:
        """``trainer.model`` where this scope assigns ``trainer = FineTuner(...)`` (once, and nothing else to it)
        and the tree's class ``FineTuner`` assigns ``self.model = FSDP(...)`` in its methods
        (``Dispatch.fsdp1_attributes``): that wrapper's kinds ("ddp" too where the class, in this file, also
        assigns DDP's to it); None where ``obj`` is not such an attribute."""
        if not (
            isinstance(obj, cst.Attribute)
            and isinstance(obj.value, cst.Name)
            and obj.value.value not in ("self", "cls")
        ):
            return None
        name, attr = obj.value.value, obj.attr.value
        values = [
            n.value
            for n in walk(scope)
            if isinstance(n, (cst.Assign, cst.AnnAssign, cst.AugAssign))
            and any(
                code_of(t) == name for t in ([x.target for x in n.targets] if isinstance(n, cst.Assign) else [n.target])
            )
        ]
        if len(values) != 1 or not isinstance(values[0], cst.Call):
            return None
        cls = code_of(values[0].func).rsplit(".", 1)[-1]
        if attr not in self.dispatch.fsdp1_attributes.get(cls, ()):
            return None
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, values[0].func, set())}
        if any(n.split(".", 1)[0] in _LIBRARIES for n in names):
            return None  # ``transformers.Trainer(...)``: a library's class of the same name as the tree's
        kinds = {"fsdp1"}
        for c in walk(self.module) if self.module is not None else ():
            if isinstance(c, cst.ClassDef) and c.name.value == cls:
                for n in walk(c.body):
                    if isinstance(n, cst.Assign) and any(code_of(t.target) == f"self.{attr}" for t in n.targets):
                        made = (
                            self._value_kinds(_made_by(n.value))
                            if isinstance(n.value, (cst.Call, cst.IfExp))
                            else set()
                        )
                        kinds |= made if "fsdp1" in made else made | {"ddp"}  # another value on some path
        return kinds

    def _value_kinds(self, expr: cst.BaseExpression) -> set[str]:
        """The wrappers an expression makes ("fsdp1", "ddp"): FSDP1's or DDP's class, a wrapper factory of this
        file (``partial(FSDP, ...)``, a function returning one) or of the tree (FSDP1's on every path)."""
        found = set()
        if code_of(expr).removeprefix("self.") in self._local_fsdp1_makers():
            found.add("fsdp1")
        for x in walk(expr):
            quals = self.get_metadata(QualifiedNameProvider, x, set())
            found |= wrapper_kinds_named(quals)
            if self._fsdp1_factory(quals, every_path=True):
                found.add("fsdp1")
        if isinstance(expr, cst.IfExp):
            # ``wrap_fsdp(m) if fsdp else wrap_ddp(m)``: each branch's maker (a function of this file too); FSDP1's
            # on one branch only is FSDP1's wrapper on one path, something else on the other ("ddp": ambiguous)
            sides = [
                self._value_kinds(_made_by(b) if isinstance(b, (cst.Call, cst.IfExp)) else b)
                for b in (expr.body, expr.orelse)
            ]
            if any("fsdp1" in k for k in sides):
                found |= {"fsdp1", *sides[0], *sides[1]}
                if not all("fsdp1" in k for k in sides):
                    found.add("ddp")
        return found

    def _other_path_above(self, node: cst.CSTNode, obj: cst.BaseExpression) -> bool:
        """A branch above ``node`` in this function gives ``obj`` a value that is not FSDP1's wrapper: ``if
        use_fsdp: net = load_fsdp(...) else: net = load_ddp(...)``, or such an assignment in a branch after the
        wrap. FSDP1's wrapper is then shown on one path only (``net.module`` may be DDP's)."""
        target = code_of(obj)
        scope = self.functions[-1] if self.functions else self.module
        if scope is None:
            return False
        at = self.get_metadata(PositionProvider, node).start
        here = (at.line, at.column)

        def assignments(block: cst.CSTNode) -> list[tuple[tuple[int, int], bool]]:
            found = []
            for n in walk(block):
                if isinstance(n, cst.Assign) and any(code_of(t.target) == target for t in n.targets):
                    start = self.get_metadata(PositionProvider, n).start
                    if (start.line, start.column) >= here:
                        continue
                    value = _made_by(n.value) if isinstance(n.value, (cst.Call, cst.IfExp)) else n.value
                    kinds = self._value_kinds(value)
                    if not kinds and any(
                        isinstance(x, (cst.Name, cst.Attribute)) and code_of(x) == target for x in walk(n.value)
                    ):
                        continue  # made from the object itself (``net = torch.compile(net)``): still that object
                    found.append(((start.line, start.column), "fsdp1" in kinds))
            return found

        every = assignments(scope)
        first_wrap = min((p for p, is_fsdp1 in every if is_fsdp1), default=None)
        if first_wrap is None:
            return False
        for n in walk(scope):
            if not isinstance(n, cst.If):
                continue
            branches: list[cst.BaseSuite] = []
            part: cst.If | cst.Else | None = n
            while part is not None:  # if / elif ... / else
                branches.append(part.body)
                part = part.orelse if isinstance(part, cst.If) else None
            made = [assignments(b) for b in branches]
            if any(any(f for _, f in a) for a in made) and any(a and not any(f for _, f in a) for a in made):
                return True  # FSDP1's wrapper in one branch, something else in another
            if any(p > first_wrap and not f for a in made for p, f in a):
                return True  # a branch after the wrap assigns something else
        return False

    def _base_classes_here(self, cls: cst.ClassDef, target: str) -> list[cst.ClassDef]:
        """The classes of this file ``cls`` derives from (theirs too), when ``cls`` never binds ``target``
        (``self.a.b``) nor a prefix of it (``self.a``): their methods' ``self.a.b = FSDP(...)`` made the
        object ``cls``'s methods read (a base's ``shard()`` run by the subclass)."""
        prefixes = {".".join(target.split(".")[:k]) for k in range(2, target.count(".") + 2)}

        def binds_target(c: cst.ClassDef) -> bool:
            return any(
                code_of(t) in prefixes
                for n in walk(c.body)
                for t in (
                    [x.target for x in n.targets]
                    if isinstance(n, cst.Assign)
                    else [n.target]
                    if isinstance(n, (cst.AnnAssign, cst.AugAssign))
                    else []
                )
            )

        if self.module is None or binds_target(cls):
            return []
        here = {s.name.value: s for s in self.module.body if isinstance(s, cst.ClassDef)}
        found: list[cst.ClassDef] = []
        todo = [code_of(b.value).rsplit(".", 1)[-1] for b in cls.bases]
        while todo:
            base = here.get(todo.pop())
            if base is None or base is cls or any(base is f for f in found):
                continue
            found.append(base)
            todo.extend(code_of(b.value).rsplit(".", 1)[-1] for b in base.bases)
        return found

    def _handed_in(self, cls: cst.ClassDef, attr: str, *, among: bool = False) -> bool:
        """Every assignment of ``self.<attr>`` in ``cls`` is ``self.<attr> = p`` with ``p`` a parameter of that
        method annotated with FSDP1's class (``def __init__(self, model: FSDP)``), never bound again there; no
        other assignment (augmented, unpacked, ``setattr``, a class attribute) and no subclass in the tree
        (which could assign it too). ``among``: an annotation that names FSDP1's class among others
        (``Union[nn.Module, FSDP]``, ``FSDP | None``) counts too (FSDP1's wrapper on some path)."""
        if cls.name.value in self.dispatch.subclassed or f"setattr(self, {attr!r}" in code_of(cls).replace('"', "'"):
            return False
        own = m.Attribute(value=m.Name("self"), attr=m.Name(attr))
        proofs = 0
        for stmt in cls.body.body if isinstance(cls.body, cst.IndentedBlock) else ():
            if isinstance(stmt, cst.SimpleStatementLine) and any(binds(small, attr) for small in stmt.body):
                return False  # a class attribute of that name
        for fn in (n for n in walk(cls) if isinstance(n, cst.FunctionDef)):
            annotated = {
                p.name.value
                for p in [*fn.params.params, *fn.params.kwonly_params, *fn.params.posonly_params]
                if p.annotation is not None
                and (
                    self._qn(p.annotation.annotation) == (FSDP, "")
                    or (
                        among
                        and any(
                            isinstance(x, (cst.Name, cst.Attribute)) and self._qn(x) == (FSDP, "")
                            for x in walk(p.annotation.annotation)
                        )
                    )
                )
            }
            for n in walk(fn.body):
                if isinstance(n, cst.AugAssign) and m.matches(n.target, own):
                    return False
                if isinstance(n, cst.AnnAssign) and m.matches(n.target, own) and n.value is not None:
                    value: cst.BaseExpression | None = n.value
                elif isinstance(n, cst.Assign) and any(any(m.matches(x, own) for x in walk(t)) for t in n.targets):
                    paired = _paired_value(n, own)
                    if paired is None:
                        return False  # unpacked from one value, or chained with another target
                    value = paired
                else:
                    continue
                if not (isinstance(value, cst.Name) and value.value in annotated):
                    return False
                if any(binds(a, value.value) for a in walk(fn.body)):
                    return False  # the parameter is bound again in the method
                proofs += 1
        return proofs > 0

    def _local_fsdp1_makers(self) -> set[str]:
        """Names of this file that make FSDP1 wrappers when called: a variable assigned once from
        ``functools.partial(FSDP, ...)``, a function (or method) whose every ``return`` gives ``FSDP(...)``
        (directly or through a name assigned from it on the return's path: see ``fsdp1_returns``)."""
        if self.local_makers is None:
            found: set[str] = set()
            for name, value in self.assignments.items():
                if (
                    isinstance(value, cst.Call)
                    and code_of(value.func).split(".")[-1] == "partial"
                    and value.args
                    and resolve_fsdp(self.get_metadata(QualifiedNameProvider, value.args[0].value, set())) == (FSDP, "")
                ):
                    found.add(name)
            for n in walk(self.module) if self.module is not None else ():
                if isinstance(n, cst.FunctionDef) and fsdp1_returns(n, lambda f: self._qn(f) == (FSDP, ""))[1]:
                    found.add(n.name.value)
            self.local_makers = found
        return self.local_makers


def binds(node: cst.CSTNode, name: str) -> bool:
    """``node`` is an assignment (plain, augmented, annotated with a value) that binds the name ``name``."""
    if isinstance(node, cst.Assign):
        targets: list[cst.BaseExpression] = [t.target for t in node.targets]
    elif isinstance(node, (cst.AugAssign, cst.AnnAssign)):
        targets = [node.target] if not (isinstance(node, cst.AnnAssign) and node.value is None) else []
    else:
        return False
    while targets:
        t = targets.pop()
        if m.matches(t, m.Name(name)):
            return True
        if isinstance(t, (cst.Tuple, cst.List)):
            # the names it unpacks into (``self.o, x = ...`` binds x, not the attribute named x of self)
            targets.extend(e.value for e in t.elements)
        elif isinstance(t, cst.StarredElement):
            targets.append(t.value)
    return False


_LIBRARIES = frozenset(
    {"transformers", "accelerate", "lightning", "pytorch_lightning", "trl", "peft", "deepspeed", "torch", "composer"}
)
"""Libraries whose classes may share a name with a class of the tree (``Trainer``)."""


def _paired_value(n: cst.Assign, own: Any) -> cst.BaseExpression | None:
    """The value ``n`` assigns to the target ``own`` matches: ``self.x = v``, or its element of a pairwise
    unpacking (``self.o, self.x = o, v``); None where it is unpacked from one value or chained."""
    if len(n.targets) != 1:
        return None
    target = n.targets[0].target
    if m.matches(target, own):
        return n.value
    if (
        isinstance(target, cst.Tuple)
        and isinstance(n.value, cst.Tuple)
        and len(target.elements) == len(n.value.elements)
        and not any(isinstance(e, cst.StarredElement) for e in (*target.elements, *n.value.elements))
    ):
        found = [v.value for t, v in zip(target.elements, n.value.elements, strict=True) if m.matches(t.value, own)]
        return found[0] if len(found) == 1 else None
    return None


def _names_others(annotation: cst.BaseExpression, scanner: Any) -> bool:
    """An annotation naming FSDP1's class among other types: ``Union[nn.Module, FSDP]`` or ``nn.Module | FSDP``
    (``Optional[FSDP]`` and ``FSDP | None`` name it alone)."""
    members: list[cst.BaseExpression] = []
    if isinstance(annotation, cst.Subscript) and code_of(annotation.value).rsplit(".", 1)[-1] == "Union":
        members = [e.slice.value for e in annotation.slice if isinstance(e.slice, cst.Index)]
    elif isinstance(annotation, cst.BinaryOperation) and isinstance(annotation.operator, cst.BitOr):
        stack: list[cst.BaseExpression] = [annotation]
        while stack:
            x = stack.pop()
            if isinstance(x, cst.BinaryOperation) and isinstance(x.operator, cst.BitOr):
                stack += [x.left, x.right]
            else:
                members.append(x)
    others = [x for x in members if not m.matches(x, m.Name("None")) and "fsdp1" not in scanner._value_kinds(x)]
    return bool(others)


def _made_by(value: cst.Call | cst.IfExp) -> cst.BaseExpression:
    """What made an assigned value: a call's callee; for ``FSDP(m) if fsdp else DDP(m)`` the whole expression
    (either branch's maker: FSDP1's wrapper on one path, DDP's on the other)."""
    return value.func if isinstance(value, cst.Call) else value


def _binds_name(fn: cst.FunctionDef, name: str) -> bool:
    """``fn`` binds ``name`` itself: a parameter, or assigned in its body (a nested function's own aside)."""
    params = fn.params
    if any(p.name.value == name for p in [*params.params, *params.kwonly_params, *params.posonly_params]):
        return True
    for n in walk(fn.body):
        targets: list[cst.BaseExpression] = []
        if isinstance(n, cst.Assign):
            targets = [t.target for t in n.targets]
        elif isinstance(n, (cst.AnnAssign, cst.AugAssign, cst.For)):
            targets = [n.target]
        elif isinstance(n, cst.WithItem) and n.asname is not None:
            targets = [n.asname.name]
        elif isinstance(n, (cst.Nonlocal, cst.Global)):
            continue
        if any(isinstance(x, cst.Name) and x.value == name for t in targets for x in walk(t)):
            return True
    return False


def _tested(test: cst.BaseExpression) -> str | None:
    """The object a one-argument test (``isinstance(x, C)``, ``is_fsdp2(x)``) tests, as code."""
    if isinstance(test, cst.Call) and test.args:
        return code_of(test.args[0].value)
    return None


def _holds(value: int, target: cst.ComparisonTarget) -> bool:
    """Whether ``value <op> <literal>`` holds for an integer literal (or a tuple of them after ``in``); False for
    anything else."""
    op, right = target.operator, target.comparator
    if isinstance(op, (cst.In, cst.NotIn)):
        if not isinstance(right, (cst.Tuple, cst.List, cst.Set)):
            return False
        items = [e.value for e in right.elements]
        if not all(isinstance(i, cst.Integer) for i in items):
            return False
        inside = value in {int(i.value.replace("_", ""), 0) for i in items if isinstance(i, cst.Integer)}
        return inside if isinstance(op, cst.In) else not inside
    if not isinstance(right, cst.Integer):
        return False
    n = int(right.value.replace("_", ""), 0)
    checks: dict[type, bool] = {
        cst.GreaterThan: value > n,
        cst.GreaterThanEqual: value >= n,
        cst.LessThan: value < n,
        cst.LessThanEqual: value <= n,
        cst.Equal: value == n,
        cst.NotEqual: value != n,
    }
    return checks.get(type(op), False)
