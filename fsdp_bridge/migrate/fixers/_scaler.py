"""``ShardedGradScaler`` named without being called (passed on, aliased, in an annotation)."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider

from fsdp_bridge.migrate._analysis import code_of
from fsdp_bridge.migrate._names import SCALER_TEXT
from fsdp_bridge.migrate._report import CodeFinding
from fsdp_bridge.migrate._scan_base import ScannerBase

_AMP_SCALERS = frozenset(
    {
        "torch.amp.GradScaler",
        "torch.amp.grad_scaler.GradScaler",
        "torch.cuda.amp.GradScaler",
        "torch.cuda.amp.grad_scaler.GradScaler",
    }
)
PLAIN_SCALER = (
    "left as it is; its meaning changes: on FSDP1's flat-shard gradients (plain tensors) this scaler checks each "
    "rank's own shard for an overflow, so one rank may skip a step another takes (FSDP1 pairs with "
    "ShardedGradScaler, which sums the check over the ranks); on FSDP2 the gradients are DTensors and the check "
    "covers the whole model, so every rank skips the same steps. With CPU offload that check is a collective on "
    "CPU tensors (a CPU backend in the process group)"
)


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

    def _note_plain_scaler(self, node: cst.Call) -> None:
        """torch's own ``GradScaler(...)`` (``torch.amp`` / ``torch.cuda.amp``) in a file that wraps models with
        FSDP1: a note (see :data:`PLAIN_SCALER`)."""
        if self.planning or not self.uses_fsdp1 or self.dispatch.wraps_fsdp1 is None:
            return
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, node.func, set())}
        if not names & _AMP_SCALERS:
            return
        pos = self.get_metadata(PositionProvider, node).start
        construct = f"{code_of(node.func)}(...) (torch's scaler, beside an FSDP1 model)"
        self.findings.append(CodeFinding(self.path, pos.line, pos.column, construct, PLAIN_SCALER, True, note=True))
