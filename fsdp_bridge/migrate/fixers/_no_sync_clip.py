"""The FSDP1 wrapper's gradient methods: ``model.no_sync()`` and ``model.clip_grad_norm_(...)``
(not DDP's ``no_sync``, not torch's or another library's ``clip_grad_norm_``)."""

from __future__ import annotations

import os

import libcst as cst
from libcst.metadata import QualifiedNameProvider

from fsdp_bridge.migrate._analysis import code_of, short
from fsdp_bridge.migrate._names import NAMES
from fsdp_bridge.migrate._scan_base import ScannerBase


class NoSyncClipFixer(ScannerBase):
    """The wrapper's no_sync and clip_grad_norm_."""

    def _plan_wrapper_method_call(self, node: cst.Call, func: cst.BaseExpression, hit: tuple[str, str] | None) -> None:
        """The FSDP1 wrapper's no_sync() and clip_grad_norm_(...)."""
        if isinstance(func, cst.Attribute) and func.attr.value in ("no_sync", "clip_grad_norm_") and hit is None:
            qn = {q.name for q in self.get_metadata(QualifiedNameProvider, func, set())}
            if any(q.startswith(("torch.nn", "fsdp_bridge")) for q in qn) or code_of(func.value) == "fsdp_bridge":
                return  # torch.nn.utils.clip_grad_norm_ works on FSDP2; fsdp_bridge's are the rewrites
            if self._ddp_tested(func.value):
                return  # DDP's no_sync (the code tells DDP apart), not FSDP1's
            name = func.attr.value
            if (where := self.dispatch.own_methods.get(name)) is not None and self._fsdp1_wrapper(
                node, func.value, by_calls=False
            ) != "fsdp1":
                if code_of(func.value) == "self" and self.classes:
                    return  # the class's own method
                recv = code_of(func.value)
                # relative to this file: the same text wherever the tree is (--fix stays idempotent on a copy)
                where = where if where == self.path else os.path.relpath(where, os.path.dirname(self.path) or ".")
                self._record(
                    node,
                    f"{short(recv, 40)}.{name}(...)",
                    f"not rewritten: this tree defines its own {name} (in {where}), so this call may be that one; "
                    f"if {short(recv, 40)} is the FSDP1-wrapped model, write fsdp_bridge.{name}({short(recv, 40)}"
                    f"{', ...' if node.args else ''}) (FSDP2 modules have no {name}); if it is your own, keep it",
                    False,
                )
                return
            if func.attr.value == "no_sync" and not node.args:
                self.fixable_calls[id(node)] = "method"
                self._record(node, f"{code_of(func.value)}.no_sync()", NAMES["no_sync"], True)
                return
            if func.attr.value == "clip_grad_norm_" and node.args:
                self.fixable_calls[id(node)] = "method"
                self._record(node, f"{code_of(func.value)}.clip_grad_norm_(...)", NAMES["clip_grad_norm_"], True)
                return
