"""``p.data = <expression>`` in a loop over an FSDP1 model's parameters (an EMA copy stepped by hand).

FSDP1's parameters are flat plain tensors: assigning ``.data`` swaps the rank's shard (the next all-gather reads
it). FSDP2's are DTensors, whose ``.data`` assignment changes nothing FSDP2 reads: the local shard stays, and the
model keeps its old values without an error (an EMA that never moves). Written in place
(``p.data.copy_(<expression>)``) the update reaches the shard on both, and on a plain tensor it is the same
update: the rewrite is made only where the expression is arithmetic over tensors and numbers (a new tensor of the
parameter's shape and dtype, not an alias of another tensor and not a cast); other assignments are TODOs.
"""

from __future__ import annotations

import libcst as cst

from fsdp_bridge.migrate._analysis import code_of, short, walk
from fsdp_bridge.migrate._names import INTERNAL_ATTRS
from fsdp_bridge.migrate._scan_base import ScannerBase

WHY = (
    "FSDP1's parameters are plain (flat) tensors, so assigning .data swapped the rank's shard; FSDP2's are "
    "DTensors, whose .data assignment leaves the local shard FSDP2 gathers as it was, with no error (the values "
    "never change)"
)


def _fresh_arithmetic(expr: cst.BaseExpression) -> bool:
    """``expr`` is arithmetic (``a * x.data + (1 - a) * y.data``) over names, attributes and numbers: a new
    tensor of its operands' shape and dtype, neither an alias of one nor a cast."""
    if isinstance(expr, cst.BinaryOperation):
        return _leaf_or_arithmetic(expr.left) and _leaf_or_arithmetic(expr.right)
    if isinstance(expr, cst.UnaryOperation):
        return _leaf_or_arithmetic(expr.expression)
    return False


def _leaf_or_arithmetic(expr: cst.BaseExpression) -> bool:
    if isinstance(expr, (cst.Name, cst.Integer, cst.Float)):
        return True
    if isinstance(expr, cst.Attribute):
        return isinstance(expr.value, (cst.Name, cst.Attribute)) and _leaf_or_arithmetic(expr.value)
    return _fresh_arithmetic(expr)


def _parameter_owner(call: cst.BaseExpression, lister: str) -> cst.BaseExpression | None:
    """``X.<lister>()`` (``parameters`` / ``named_parameters``) -> ``X``."""
    if (
        isinstance(call, cst.Call)
        and isinstance(call.func, cst.Attribute)
        and call.func.attr.value == lister
        and not call.args
    ):
        return call.func.value
    return None


def _bound_parameters(loop: cst.For) -> dict[str, cst.BaseExpression]:
    """The loop's names bound to a model's parameters -> that model: ``for p in m.parameters()``,
    ``for n, p in m.named_parameters()``, ``for p, q in zip(a.parameters(), b.parameters())``."""
    target, it = loop.target, loop.iter
    if isinstance(target, cst.Name) and (owner := _parameter_owner(it, "parameters")) is not None:
        return {target.value: owner}
    if isinstance(target, cst.Tuple) and (owner := _parameter_owner(it, "named_parameters")) is not None:
        p = target.elements[1].value if len(target.elements) == 2 else None
        return {p.value: owner} if isinstance(p, cst.Name) else {}
    if not (isinstance(it, cst.Call) and code_of(it.func) == "zip" and isinstance(target, cst.Tuple)):
        return {}
    if len(target.elements) != len(it.args) or any(a.keyword or a.star for a in it.args):
        return {}
    bound: dict[str, cst.BaseExpression] = {}
    for element, arg in zip(target.elements, it.args, strict=True):
        owner = _parameter_owner(arg.value, "parameters")
        if owner is not None and isinstance(element.value, cst.Name):
            bound[element.value.value] = owner
    return bound


class DataAssignFixer(ScannerBase):
    """``p.data = ...`` for ``p`` among an FSDP1 model's parameters -> ``p.data.copy_(...)`` (or a TODO)."""

    def _plan_data_assign(self, node: cst.Assign) -> None:
        if self.planning or len(node.targets) != 1 or len(self.stmt_stack) < 2:
            return
        target = node.targets[0].target
        if not (
            isinstance(target, cst.Attribute) and target.attr.value == "data" and isinstance(target.value, cst.Name)
        ):
            return
        if any(isinstance(n, cst.Attribute) and n.attr.value in INTERNAL_ATTRS for n in walk(node.value)):
            return  # an FSDP1 internal read (p.data = p._local_shard): that read is the TODO
        stmt = self.stmt_stack[-1]
        if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and stmt.body[0] is node):
            return
        name = target.value.value
        owner = None
        for enclosing in reversed(self.stmt_stack[:-1]):
            if isinstance(enclosing, (cst.FunctionDef, cst.ClassDef)):
                return
            if isinstance(enclosing, cst.For):
                owner = _bound_parameters(enclosing).get(name)
                binds = any(isinstance(n, cst.Name) and n.value == name for n in walk(enclosing.target))
                if owner is not None or binds:
                    break  # the innermost loop binding the name decides
        if owner is None or not self._shown_fsdp1(node, owner):
            return
        whose = short(code_of(owner), 30)
        construct = f"{short(code_of(target), 30)} = {short(code_of(node.value), 40)} (over {whose}'s parameters)"
        if _fresh_arithmetic(node.value):
            code = f"{code_of(target)}.copy_({code_of(node.value)})"
            self.stmt_rewrites[id(stmt)] = code
            self._record(
                node,
                construct,
                f"{code}: {WHY}; written in place, the update reaches the shard on both backends (and on a plain "
                "tensor it is the same update: the expression is a new tensor of the parameter's shape and dtype)",
                True,
            )
        else:
            self._record(
                node,
                construct,
                f"not rewritten: {WHY}. Write into the parameter in place ({code_of(target)}.copy_(...), same "
                "shape and dtype; a cast cannot be made this way: FSDP2 casts for compute with "
                "MixedPrecisionPolicy)",
                False,
            )
