"""``ShardedGradScaler`` named without being called (passed on, aliased, in an annotation)."""

from __future__ import annotations

import libcst as cst

from fsdp_bridge.migrate._analysis import code_of
from fsdp_bridge.migrate._names import fsdp2_any
from fsdp_bridge.migrate._scan_base import ScannerBase


class ScalerFixer(ScannerBase):
    """ShardedGradScaler."""

    def _plan_scaler_class(self, node: cst.BaseExpression) -> bool:
        """FSDP1's ShardedGradScaler named but not called here (passed on, aliased, an annotation)."""
        self.needs_imports.add(("torch", None))
        self.expr_rewrites[id(node)] = "torch.amp.GradScaler"
        if self.annotation_depth:  # a type annotation: the scaler FSDP2 code makes
            self._record(node, f"{code_of(node)} (a type annotation)", "torch.amp.GradScaler", True)
            return False
        # The class itself, passed on or re-exported (``GradScaler = ShardedGradScaler``): same constructor
        # arguments but process_group.
        self._record(
            node,
            f"{code_of(node)} (the class, not called here)",
            "torch.amp.GradScaler: the same constructor arguments except process_group= (a call that passes it "
            f"fails with TypeError; FSDP2 needs no group) ({fsdp2_any('ShardedGradScaler')})",
            True,
        )
        return False
