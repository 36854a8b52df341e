"""FSDP1-format checkpoints: a file that saves or loads FSDP1's sharded or local state gets one note in
the report (at the first such place; no TODO comment) saying how checkpoints already written carry
across to the migrated code, and that flat-parameter (``LOCAL_STATE_DICT``) shards cannot be resumed
as they are."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider

from fsdp_bridge.migrate._analysis import code_of
from fsdp_bridge.migrate._names import FSDP
from fsdp_bridge.migrate._report import CodeFinding
from fsdp_bridge.migrate._scan_base import ScannerBase

FSDP1_SHARDED_NAMES = (
    "SHARDED_STATE_DICT",
    "LOCAL_STATE_DICT",
    "ShardedStateDictConfig",
    "LocalStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
)
"""FSDP1 names (from ``torch.distributed.fsdp``) that choose its sharded or local (flat-parameter) state."""

DCP_CALLS = ("save", "load", "save_state_dict", "load_state_dict", "async_save")
"""``torch.distributed.checkpoint`` functions that write or read a checkpoint directory."""

CHECKPOINT_NOTE = (
    "checkpoints written by this FSDP1 code carry across: a DCP directory (SHARDED_STATE_DICT) or a torch.save "
    "file of a full state dict -> `fsdp-bridge convert SRC DST --to sharded` (an fsdp_bridge sharded checkpoint, "
    "loadable at any world size on either backend; fsdp_bridge.load_checkpoint reads the originals too; "
    "docs/checkpoints.md); the migrated code cannot resume FSDP1's flat-parameter checkpoints "
    "(LOCAL_STATE_DICT shards) directly, nor convert them: save them again from the FSDP1 code as sharded "
    "or full first"
)


class CheckpointNoteFixer(ScannerBase):
    """One note per file that saves or loads FSDP1 sharded / local state (in the report only)."""

    checkpoint_noted = False

    def _note_fsdp1_checkpoint(self, node: cst.CSTNode) -> None:
        """Record the note at ``node`` when it is the file's first FSDP1 sharded/local checkpoint use."""
        if self.planning or self.checkpoint_noted:
            return
        target = node.func if isinstance(node, cst.Call) else node
        names = [q.name for q in self.get_metadata(QualifiedNameProvider, target, set())]
        what = None
        if (
            isinstance(node, cst.Call)
            and self._qn(node.func) == (FSDP, "optim_state_dict")
            and any("torch.save(" in line for line in self.lines)
            and not any(  # a full state dict (FSDP1's default inside such a block): nothing FSDP1-only in it
                isinstance(stmt, cst.With) and "FULL_STATE_DICT" in code_of(stmt.items[0]) for stmt in self.stmt_stack
            )
        ):
            what = "FSDP.optim_state_dict(...) saved with torch.save"
        for name in names:
            parts = name.split(".")
            if name.startswith("torch.distributed.fsdp") and parts[-1] in FSDP1_SHARDED_NAMES:
                what = parts[-1]
            elif (
                isinstance(node, cst.Call)
                # FSDP1's wrapper in the code (not fully_shard; a comment's mention, such as a TODO this codemod
                # wrote, is none: a second run must report what the first did)
                and any("FullyShardedDataParallel" in line.split("#", 1)[0] for line in self.lines)
                and name.startswith("torch.distributed.checkpoint")
                and parts[-1] in DCP_CALLS
                and not name.startswith("torch.distributed.checkpoint.state_dict")
            ):
                what = f"torch.distributed.checkpoint.{parts[-1]}(...) with an FSDP1 model"
        if what is None:
            return
        self.checkpoint_noted = True
        construct = f"FSDP1-format checkpoint ({what})"
        pos = self.get_metadata(PositionProvider, node)
        # A note in the report, not a TODO in the file: the code is migrated by the other fixers; what it
        # already wrote is the reader's to carry across.
        self.findings.append(
            CodeFinding(self.path, pos.start.line, pos.start.column, construct, CHECKPOINT_NOTE, True, note=True)
        )
