"""FSDP1's EMA update over flat-parameter handles -> ``fsdp_bridge.ema_update_``.

Diffusion and multimodal trainers step an EMA copy of the model, sharded by the same call, with FSDP1's
private handles::

    ema_handles = traversal_utils._get_fsdp_handles(ema_model)
    new_handles = traversal_utils._get_fsdp_handles(model)
    assert len(ema_handles) == len(new_handles)
    ema_params, new_params = [], []
    for ema_handle, new_handle in zip(ema_handles, new_handles):
        if ema_handle.flat_param is not None and new_handle.flat_param.requires_grad:
            ema_params.append(ema_handle.flat_param.data)
            new_params.append(new_handle.flat_param.data.to(dtype=ema_handle.flat_param.dtype))
    torch._foreach_mul_(ema_params, decay)
    torch._foreach_add_(ema_params, new_params, alpha=1 - decay)

On FSDP2 ``_get_fsdp_handles`` finds nothing, so the loop does nothing and the EMA silently never moves. The
run of statements becomes ``fsdp_bridge.ema_update_(ema_model, model, decay)``, which pairs the two models'
parameters (their local shards) and runs the same two foreach operations on either backend. Rewritten only
where every statement is one of those above, in that order (the assert and the list spellings may vary):
the handles come from FSDP1's own ``_get_fsdp_handles`` (which proves the models FSDP1's), the ``requires_grad``
test is on the model's handle, the averaged list takes the EMA's flat parameters and the other the model's
(cast to the EMA's dtype or not), ``alpha`` is ``1 - decay`` of the same ``decay``, and none of the run's
names is read after it. Any other shape keeps its TODOs."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
from libcst.metadata import QualifiedNameProvider

from fsdp_bridge.migrate._analysis import code_of, walk
from fsdp_bridge.migrate._scan_base import ScannerBase

HANDLES = "torch.distributed.fsdp._traversal_utils._get_fsdp_handles"

NOTE = (
    ": pairs the two models' parameters in order and steps each trainable one's local shard with the same "
    "torch._foreach_mul_ / _foreach_add_ on both backends (fsdp1: FSDP1's parameters or their views into the "
    "flat shards; fsdp2: each DTensor's local shard); a frozen parameter that shared a unit with trainable ones "
    "is no longer averaged (it does not change, so its EMA keeps its value)"
)


def _simple(stmt: cst.BaseStatement) -> cst.BaseSmallStatement | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        return stmt.body[0]
    return None


def _pure(expr: cst.BaseExpression) -> bool:
    """A name, an attribute chain or a number: reading it twice or once is the same."""
    if isinstance(expr, (cst.Name, cst.Integer, cst.Float)):
        return True
    return isinstance(expr, cst.Attribute) and _pure(expr.value)


class EmaFixer(ScannerBase):
    """The EMA run of statements over two models' FSDP1 handles -> ``fsdp_bridge.ema_update_``."""

    def _plan_ema(self, body: Sequence[cst.BaseStatement]) -> None:
        if not self.uses_fsdp1 or self.planning:
            return
        for i in range(len(body)):
            found = self._ema_run(body, i)
            if found is None:
                continue
            loop, run, code, what = found
            self.whole_loops.add(id(loop))
            self.stmt_rewrites[id(loop)] = code
            for stmt in run:
                self.consumed_nodes.update(id(n) for n in walk(stmt))
                if stmt is not loop:
                    self.removed_stmts.add(id(stmt))
            self.needs_imports.add(("fsdp_bridge", None))
            self._record(loop, what, code + NOTE, True)

    def _handles_of(self, stmt: cst.BaseStatement) -> tuple[str, cst.BaseExpression] | None:
        """``H = ..._get_fsdp_handles(model)`` -> (H, model)."""
        assign = _simple(stmt)
        if not (isinstance(assign, cst.Assign) and len(assign.targets) == 1):
            return None
        target, call = assign.targets[0].target, assign.value
        if not (isinstance(target, cst.Name) and isinstance(call, cst.Call) and len(call.args) == 1):
            return None
        if call.args[0].keyword is not None or call.args[0].star or not _pure(call.args[0].value):
            return None
        if not any(q.name == HANDLES for q in self.get_metadata(QualifiedNameProvider, call.func, set())):
            return None
        return target.value, call.args[0].value

    def _ema_run(
        self, body: Sequence[cst.BaseStatement], i: int
    ) -> tuple[cst.For, list[cst.BaseStatement], str, str] | None:
        first = self._handles_of(body[i])
        second = self._handles_of(body[i + 1]) if i + 1 < len(body) else None
        if first is None or second is None or first[0] == second[0]:
            return None
        handles = {first[0]: first[1], second[0]: second[1]}
        k = i + 2
        lists: set[str] = set()
        while k < len(body) and not isinstance(body[k], cst.For):
            small = _simple(body[k])
            if isinstance(small, cst.Assert) and self._same_length(small.test, set(handles)):
                k += 1
                continue
            names = _empty_lists(small)
            if names is None:
                return None
            lists |= names
            k += 1
        if k + 2 >= len(body) or len(lists) != 2:
            return None
        loop = body[k]
        if not isinstance(loop, cst.For):
            return None
        pairing = self._pairing(loop, handles, lists)
        if pairing is None:
            return None
        averaged, current, ema_handles, new_handles = pairing
        decay = self._foreach(body[k + 1], body[k + 2], averaged, current)
        if decay is None:
            return None
        run = list(body[i : k + 3])
        local = {*handles, *lists, *(n.value for n in walk(loop.target) if isinstance(n, cst.Name))}
        if not self._names_stay_in(run, local):
            return None
        ema, model = code_of(handles[ema_handles]), code_of(handles[new_handles])
        code = f"fsdp_bridge.ema_update_({ema}, {model}, {code_of(decay)})"
        what = (
            f"_get_fsdp_handles({ema}) / _get_fsdp_handles({model}) + torch._foreach_mul_ / _foreach_add_ over "
            "their flat parameters (an EMA update)"
        )
        return loop, run, code, what

    @staticmethod
    def _same_length(test: cst.BaseExpression, handles: set[str]) -> bool:
        """``len(H1) == len(H2)``."""
        if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1):
            return False
        if not isinstance(test.comparisons[0].operator, cst.Equal):
            return False
        sides = {code_of(test.left), code_of(test.comparisons[0].comparator)}
        return sides == {f"len({h})" for h in handles}

    def _pairing(
        self, loop: cst.For, handles: dict[str, cst.BaseExpression], lists: set[str]
    ) -> tuple[str, str, str, str] | None:
        """``for e, n in zip(H1, H2): if <tests>: A.append(e.flat_param.data); B.append(n.flat_param.data...)``
        -> (A, B, the EMA's handles, the model's handles)."""
        it = loop.iter
        if loop.orelse is not None or not (isinstance(it, cst.Call) and code_of(it.func) == "zip"):
            return None
        if len(it.args) != 2 or any(a.keyword is not None or a.star for a in it.args):
            return None
        sources = [code_of(a.value) for a in it.args]
        target = loop.target
        if not (isinstance(target, cst.Tuple) and len(target.elements) == 2):
            return None
        names = [code_of(e.value) for e in target.elements]
        if set(sources) != set(handles) or not all(isinstance(e.value, cst.Name) for e in target.elements):
            return None
        of = dict(zip(names, sources, strict=True))  # loop name -> its handles
        stmts = list(loop.body.body) if isinstance(loop.body, cst.IndentedBlock) else []
        if len(stmts) != 1 or not isinstance(stmts[0], cst.If) or stmts[0].orelse is not None:
            return None
        guard = stmts[0]
        inner = list(guard.body.body) if isinstance(guard.body, cst.IndentedBlock) else []
        if len(inner) != 2:
            return None
        appends = [_append(s) for s in inner]
        if any(a is None for a in appends):
            return None
        (list_a, value_a), (list_b, value_b) = (a for a in appends if a is not None)
        if {list_a, list_b} != lists:
            return None
        ema = next((n for n in names if value_a == f"{n}.flat_param.data"), None)
        if ema is None:
            return None
        new = names[1 - names.index(ema)]
        casts = {
            f"{new}.flat_param.data",
            f"{new}.flat_param.data.to(dtype={ema}.flat_param.dtype)",
            f"{new}.flat_param.data.to({ema}.flat_param.dtype)",
        }
        if value_b not in casts or not _guard(guard.test, ema, new):
            return None
        return list_a, list_b, of[ema], of[new]

    @staticmethod
    def _foreach(
        mul: cst.BaseStatement, add: cst.BaseStatement, averaged: str, current: str
    ) -> cst.BaseExpression | None:
        """``torch._foreach_mul_(A, d)`` then ``torch._foreach_add_(A, B, alpha=1 - d)`` -> d."""
        first, second = _simple(mul), _simple(add)
        if not (isinstance(first, cst.Expr) and isinstance(second, cst.Expr)):
            return None
        m, a = first.value, second.value
        if not (isinstance(m, cst.Call) and isinstance(a, cst.Call)):
            return None
        if code_of(m.func) != "torch._foreach_mul_" or code_of(a.func) != "torch._foreach_add_":
            return None
        if len(m.args) != 2 or any(x.keyword is not None or x.star for x in m.args):
            return None
        if len(a.args) != 3 or any(x.star for x in a.args) or a.args[0].keyword or a.args[1].keyword:
            return None
        if a.args[2].keyword is None or a.args[2].keyword.value != "alpha":
            return None
        if code_of(m.args[0].value) != averaged or code_of(a.args[0].value) != averaged:
            return None
        if code_of(a.args[1].value) != current:
            return None
        decay = m.args[1].value
        if not _pure(decay):
            return None
        alpha = code_of(a.args[2].value).replace(" ", "").removeprefix("(").removesuffix(")")
        if alpha not in (f"1-{code_of(decay)}", f"1.0-{code_of(decay)}"):
            return None
        return decay


def _empty_lists(small: cst.BaseSmallStatement | None) -> set[str] | None:
    """``A = []`` or ``A, B = [], []`` (``list()`` too) -> the names; anything else -> None."""
    if not (isinstance(small, cst.Assign) and len(small.targets) == 1):
        return None
    target, value = small.targets[0].target, small.value
    if isinstance(target, cst.Name) and code_of(value) in ("[]", "list()"):
        return {target.value}
    if isinstance(target, cst.Tuple) and isinstance(value, cst.Tuple) and len(target.elements) == len(value.elements):
        names = [e.value for e in target.elements]
        if all(isinstance(n, cst.Name) for n in names) and all(
            code_of(e.value) in ("[]", "list()") for e in value.elements
        ):
            return {n.value for n in names if isinstance(n, cst.Name)}
    return None


def _append(stmt: cst.BaseStatement) -> tuple[str, str] | None:
    """``A.append(value)`` -> (A, value)."""
    small = _simple(stmt)
    if not (isinstance(small, cst.Expr) and isinstance(small.value, cst.Call)):
        return None
    call = small.value
    if not (isinstance(call.func, cst.Attribute) and call.func.attr.value == "append"):
        return None
    if not isinstance(call.func.value, cst.Name) or len(call.args) != 1 or call.args[0].keyword or call.args[0].star:
        return None
    return call.func.value.value, code_of(call.args[0].value)


def _guard(test: cst.BaseExpression, ema: str, new: str) -> bool:
    """A conjunction of ``X.flat_param is not None`` tests with ``<new>.flat_param.requires_grad`` among them."""
    parts: list[cst.BaseExpression] = []

    def split(expr: cst.BaseExpression) -> None:
        if isinstance(expr, cst.BooleanOperation) and isinstance(expr.operator, cst.And):
            split(expr.left)
            split(expr.right)
        else:
            parts.append(expr)

    split(test)
    texts = [code_of(p).replace(" ", "") for p in parts]
    allowed = {f"{h}.flat_paramisnotNone" for h in (ema, new)} | {f"{new}.flat_param.requires_grad"}
    return f"{new}.flat_param.requires_grad" in texts and set(texts) <= allowed
