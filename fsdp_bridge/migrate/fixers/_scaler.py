"""``ShardedGradScaler`` named without being called (passed on, aliased, in an annotation)."""

from __future__ import annotations

import libcst as cst

from fsdp_bridge.migrate._analysis import code_of
from fsdp_bridge.migrate._names import SCALER_TEXT
from fsdp_bridge.migrate._scan_base import ScannerBase


class ScalerFixer(ScannerBase):
    """ShardedGradScaler."""

    def _plan_scaler_class(self, node: cst.BaseExpression) -> bool:
        """FSDP1's ShardedGradScaler named but not called here (passed on, aliased, an annotation)."""
        self.needs_imports.add(("fsdp_bridge", None))
        self.expr_rewrites[id(node)] = "fsdp_bridge.GradScaler"
        if self.annotation_depth:  # a type annotation: the scaler the rewritten calls make
            self._record(node, f"{code_of(node)} (a type annotation)", "fsdp_bridge.GradScaler", True)
            return False
        # The class itself, passed on or re-exported (``GradScaler = ShardedGradScaler``): the bridge's class
        # takes the same constructor arguments, process_group= included.
        self._record(
            node,
            f"{code_of(node)} (the class, not called here)",
            f"fsdp_bridge.GradScaler: the same constructor arguments, process_group= included ({SCALER_TEXT})",
            True,
        )
        return False
