"""FSDP1 attributes read from a model prepared elsewhere: a file that never imports FSDP1 but reads
FSDP1-only internals of an object (``model._fsdp_wrapped_module``, ``._handle``, ``._flat_param``) is
handed an FSDP1 wrapper. ``X._fsdp_wrapped_module`` becomes ``fsdp_bridge.unwrapped(X)`` (``X.name`` for a
name the wrapper forwards), right on FSDP1's wrapper and on FSDP2; the other internals, and the wrapper's
settings read on the same object (``model.sharding_strategy``, ``.mixed_precision``, ...), get a TODO naming
what the bridge offers.
Files that import FSDP1 are covered by ``_imports`` (the wrapper is known there)."""

from __future__ import annotations

import re

import libcst as cst

from fsdp_bridge.migrate._analysis import code_of, walk
from fsdp_bridge.migrate._names import INTERNAL_ATTRS, TODO, WRAPPER_ATTRS
from fsdp_bridge.migrate._scan_base import ScannerBase

FSDP1_ONLY_ATTRS = ("_fsdp_wrapped_module", "_handle", "_handles", "_flat_param", "flat_param", "_has_params")
"""Attributes only FSDP1's wrapper has (no other torch module defines them): reading one proves the object is
FSDP1's."""

MORE_WRAPPER_ATTRS = {
    "module": "FSDP2 does not wrap: the sharded model is the module itself (drop .module)",
}
"""Wrapper attributes read on an object proven FSDP1's here (too common a name to report without proof)."""

BRIDGE_OFFERS = (
    "with fsdp_bridge, fsdp_bridge.get_bridge(model).config holds the settings the model was sharded with and "
    "fsdp_bridge.get_bridge(model).report what each became"
)


class ElsewhereAttributesFixer(ScannerBase):
    """FSDP1 attributes of a model this file did not wrap (the wrapped module rewritten, the rest TODOs)."""

    fsdp1_objects: dict[tuple[int, str], list[str]] | None = None
    """(id(enclosing function) or 0, object expression) -> the FSDP1-only attributes read on it there."""

    own_attributes: set[tuple[str, str]] | None = None
    """(object expression, attribute) assigned in this file (``self._handles: list = []``): the code's own
    attribute of that name, no proof of FSDP1's wrapper."""

    def _note_fsdp1_attribute(self, node: cst.Attribute) -> None:
        obj, attr = code_of(node.value), node.attr.value
        if self.planning and attr in FSDP1_ONLY_ATTRS and self._assigned_here(node):
            if self.own_attributes is None:
                self.own_attributes = set()
            self.own_attributes.add((obj, attr))
        if self.uses_fsdp1 or self.assign_target_depth:
            return
        if self._hasattr_guarded(obj, attr):
            return  # read only where the object has it: the code already runs without FSDP1's wrapper
        key = (id(self.functions[-1]) if self.functions else 0, obj)
        if self.planning:
            if attr in FSDP1_ONLY_ATTRS:
                if self.fsdp1_objects is None:
                    self.fsdp1_objects = {}
                self.fsdp1_objects.setdefault(key, []).append(attr)
            return
        own = self.own_attributes or set()
        ours = self.dispatch.own_methods  # a method of that name in the tree: maybe its own object's (a handler's)
        proof = next(
            (a for a in (self.fsdp1_objects or {}).get(key, []) if (obj, a) not in own and a not in ours), None
        )
        if proof is None or id(node) in self.called or (obj, attr) in own or attr in ours:
            return
        if proof in self.dispatch.own_attributes or attr in self.dispatch.own_attributes:
            return  # a class of the tree keeps an attribute of that name itself
        self.fsdp1_elsewhere = True
        if attr == "_fsdp_wrapped_module" and not any("fairscale" in line for line in self.lines):
            # Whoever wrapped it (a library that stays on FSDP1, or the bridge on either backend): the inner
            # module is fsdp_bridge.unwrapped(X) on FSDP1's wrapper, X itself on FSDP2 (it does not wrap). A
            # name the wrapper forwards (X._fsdp_wrapped_module.name) is X.name on both.
            self._rewrite_wrapped_module(node, "an FSDP1 internal of a model prepared elsewhere", "whoever wrapped it")
            return
        if attr in FSDP1_ONLY_ATTRS:
            self._record(
                node,
                f"{code_of(node)} (an FSDP1 internal of a model prepared elsewhere)",
                f"{INTERNAL_ATTRS[attr]}; {BRIDGE_OFFERS}",
                False,
            )
            if self._flagged(code_of(node)):
                self.todos[id(self.stmt_stack[-1])].pop()  # a first --fix wrote its TODO (with FSDP1's imports)
        elif attr in WRAPPER_ATTRS or attr in MORE_WRAPPER_ATTRS:
            self._record(
                node,
                f"{code_of(node)} (an FSDP1 wrapper attribute of a model prepared elsewhere: {obj}.{proof} is read "
                "here too)",
                f"FSDPModule has no {attr}; {WRAPPER_ATTRS.get(attr) or MORE_WRAPPER_ATTRS[attr]}",
                False,
            )

    def _assigned_here(self, node: cst.Attribute) -> bool:
        """``node`` is the whole target of an assignment (``x.attr = ...``, ``x.attr: T = ...``, ``x.attr += ...``)."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if not isinstance(stmt, cst.SimpleStatementLine):
            return False
        for small in stmt.body:
            if isinstance(small, cst.Assign) and any(t.target is node for t in small.targets):
                return True
            if isinstance(small, (cst.AnnAssign, cst.AugAssign)) and small.target is node:
                return True
        return False

    def _flagged(self, code: str) -> bool:
        """The statement already carries a TODO for ``code`` (written by an earlier --fix)."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        prefix = f"# {TODO}: {code} ("
        lines = getattr(stmt, "leading_lines", ())
        return any(line.comment is not None and line.comment.value.startswith(prefix) for line in lines)

    def _hasattr_guarded(self, obj: str, attr: str) -> bool:
        """``hasattr(obj, "attr")`` in the condition (or the statement) that reads ``obj.attr``, or the test of an
        ``if`` / ``elif`` / ``while`` (of the same function) whose body holds the statement, for the unwrapping
        attributes only: ``if hasattr(m, "_fsdp_wrapped_module"): m = m._fsdp_wrapped_module`` is skipped where
        the model is not FSDP1's wrapper."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if isinstance(stmt, (cst.If, cst.While)):
            text = code_of(stmt.test)
        elif isinstance(stmt, cst.SimpleStatementLine):
            text = code_of(stmt)
        else:
            return False
        if re.search(rf"hasattr\(\s*{re.escape(obj)}\s*,\s*['\"]{re.escape(attr)}['\"]\s*\)", text) is not None:
            return True
        if attr not in UNWRAPPING_ATTRS:
            return False  # a branch doing FSDP1 work through its internals would silently do nothing on FSDP2
        for outer in reversed(self.stmt_stack[:-1]):
            if isinstance(outer, (cst.FunctionDef, cst.ClassDef)):
                return False
            if (
                isinstance(outer, (cst.If, cst.While))
                and _requires_hasattr(outer.test, obj, attr)
                and any(n is stmt for n in walk(outer.body))
            ):
                return True
        return False


UNWRAPPING_ATTRS = ("module", "_fsdp_wrapped_module")
"""Attributes a guarded branch reads to unwrap a wrapper (DDP's or FSDP1's): FSDP2 does not wrap, so skipping the
branch where the model lacks them is what the code means; a branch reading FSDP1's internals is still reported."""


def _requires_hasattr(test: cst.BaseExpression, obj: str, attr: str) -> bool:
    """``test`` is true only where ``hasattr(obj, "attr")`` is: that call, or an ``and`` with it on one side."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return _requires_hasattr(test.left, obj, attr) or _requires_hasattr(test.right, obj, attr)
    return (
        isinstance(test, cst.Call)
        and code_of(test.func) == "hasattr"
        and len(test.args) == 2
        and code_of(test.args[0].value) == obj
        and isinstance(test.args[1].value, cst.SimpleString)
        and test.args[1].value.evaluated_value == attr
    )
