"""FSDP1-format checkpoints: a file that saves or loads FSDP1's sharded or local state gets one note in
the report (at the first such place; no TODO comment) saying how checkpoints already written carry
across to the migrated code, and that flat-parameter (``LOCAL_STATE_DICT``) shards cannot be resumed
as they are."""

from __future__ import annotations

import re
from typing import cast

import libcst as cst
import libcst.matchers as m
from libcst.metadata import PositionProvider, QualifiedNameProvider

from fsdp_bridge.migrate._analysis import code_of, resolve_fsdp, short, walk
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
    "checkpoints written by this FSDP1 code carry across: a DCP directory of a SHARDED_STATE_DICT names the "
    "model's parameters as FSDP2's state dict does, so the migrated code's own DCP load of the model reads it as "
    "it is; for fsdp_bridge's loader, a DCP directory or a "
    "torch.save file of a full state dict -> `fsdp-bridge convert SRC DST --to sharded` (an fsdp_bridge sharded "
    "checkpoint, loadable at any world size on either backend; fsdp_bridge.load_checkpoint reads the originals "
    "too; docs/checkpoints.md); the migrated code cannot resume FSDP1's flat-parameter checkpoints "
    "(LOCAL_STATE_DICT shards) directly, nor convert them, nor per-rank torch.save files of a "
    "SHARDED_STATE_DICT (FSDP1's ShardedTensor values, which FSDP2 modules refuse): save them again from the "
    "FSDP1 code as a DCP directory or a full state dict first"
)

COMPILED_NAMES = (
    "left as it is; FSDP1's state dicts of a module compiled with torch.compile (before or after the wrap) name "
    "every key with its '_orig_mod.' prefix, and so do the checkpoints this code wrote; the migrated state-dict "
    "calls (get_model_state_dict / set_model_state_dict, which fsdp_bridge's full_state_dict and state_dict_type "
    "rewrites use) name them without it: checkpoints written before the migration load after removing "
    "'_orig_mod.' from their keys (fsdp-bridge migrate verify names the difference)"
)
"""The note at ``model = torch.compile(model)`` where FSDP1 wraps the same model and the file takes state dicts."""

_STATE_DICT_WORDS = ("state_dict_type", "StateDictType", "optim_state_dict", "full_state_dict")

OPTIMIZER_STATE = (
    "left as it is; its layout changes: FSDP1's optimizer over flat parameters holds one state per flat "
    "parameter (this rank's slice of it; views with use_orig_params=True), FSDP2's one per original parameter "
    "(DTensor shards): the values agree element for element, but an optimizer state saved so before the "
    "migration does not load into the migrated optimizer (load_state_dict takes it, then the first step() "
    "raises on plain tensors beside DTensors); for a state that loads at any world size and on either backend save "
    "fsdp_bridge.optim_state_dict(model, optimizer) (full) or use fsdp_bridge.save_checkpoint"
)
"""The note at ``optimizer.state_dict()`` beside an FSDP1 model's state-dict block (a checkpoint of both)."""


class CheckpointNoteFixer(ScannerBase):
    """One note per file that saves or loads FSDP1 sharded / local state (in the report only)."""

    checkpoint_noted = False
    optimizer_state_noted = False

    def _note_optimizer_state(self, node: cst.Call) -> None:
        """``optimizer.state_dict()`` (a receiver named for an optimizer) in a function that also takes an FSDP1
        model's state dict with FSDP1's state-dict calls, its result not handed to FSDP1's optimizer-state
        functions: the optimizer's own state goes into the checkpoint, whose layout changes on FSDP2 (one note
        per file, see :data:`OPTIMIZER_STATE`)."""
        if self.planning or self.optimizer_state_noted or node.args:
            return  # (beside the FSDP1-format checkpoint note too, which speaks of the model's state only)
        func = node.func
        if not isinstance(func, cst.Attribute) or func.attr.value != "state_dict":
            return
        receiver = code_of(func.value)
        last = receiver.rsplit(".", 1)[-1].lower()
        if "optim" not in last and last not in ("opt", "optim") and not re.search(r"(^|_)opt(_|$)", last):
            return
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        calls = [c for c in walk(scope) if isinstance(c, cst.Call)] if scope is not None else []
        quals = [resolve_fsdp(self.get_metadata(QualifiedNameProvider, c.func, set())) for c in calls]
        if any(q is not None and "optim" in q[1] for q in quals):
            return  # FSDP1's optimizer-state functions read it (FSDP.optim_state_dict(m, o, o.state_dict()))
        takes_model_state = any(q is not None and q[1] in ("state_dict_type", "set_state_dict_type") for q in quals)
        # or saved with torch.save in a file that wraps its models with FSDP1 (a script's checkpoint of its own)
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        saved = (
            self.uses_fsdp1
            and self.dispatch.wraps_fsdp1 is not None
            and stmt is not None
            and any(
                isinstance(c, cst.Call) and code_of(c.func) == "torch.save" and any(n is node for n in walk(c))
                for c in walk(stmt)
            )
        )
        if not (takes_model_state or saved):
            return  # no FSDP1 model's state dict taken here
        self.optimizer_state_noted = True
        pos = self.get_metadata(PositionProvider, node)
        construct = f"{short(receiver, 30)}.state_dict() saved " + (
            "beside an FSDP1 model's state dict" if takes_model_state else "with torch.save beside FSDP1 models"
        )
        self.findings.append(
            CodeFinding(self.path, pos.start.line, pos.start.column, construct, OPTIMIZER_STATE, True, note=True)
        )

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

    def _note_compiled_wrap(self, node: cst.Call) -> None:
        """``m = torch.compile(m)`` in a scope where FSDP1 wraps ``m`` (either order), in a file that takes
        state dicts with FSDP1's calls: a note on the ``_orig_mod.`` key prefix (see :data:`COMPILED_NAMES`)."""
        if self.planning or not node.args or not self.stmt_stack:
            return
        if "torch.compile" not in {q.name for q in self.get_metadata(QualifiedNameProvider, node.func, set())}:
            return
        stmt = self.stmt_stack[-1]
        assign = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and stmt.body else None
        if not isinstance(assign, cst.Assign) or assign.value is not node or len(assign.targets) != 1:
            return
        names = {code_of(assign.targets[0].target), code_of(node.args[0].value)}
        text = COMPILED_NAMES
        if not any(w in line.split("#", 1)[0] for line in self.lines for w in _STATE_DICT_WORDS):
            # the state dicts taken in another file of the tree (a checkpoint module handed the compiled model)
            where = self.dispatch.makes_state_dict_context or self.dispatch.sets_state_dict_type
            if where is None:
                return
            text = f"{COMPILED_NAMES}; this tree takes them with FSDP1's state-dict calls in {where}"
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        if scope is None or not any(
            isinstance(c, cst.Call)
            and c.args
            and (
                (
                    code_of(c.args[0].value) in names
                    and resolve_fsdp(self.get_metadata(QualifiedNameProvider, c.func, set())) == (FSDP, "")
                )
                or (  # a function of the tree that wraps it (``model = make_fsdp(args, model)``)
                    any(code_of(a.value) in names for a in c.args)
                    and self._fsdp1_factory(self.get_metadata(QualifiedNameProvider, c.func, set()))
                )
            )
            for c in walk(scope)
        ):
            return
        construct = f"torch.compile({code_of(node.args[0].value)}) of a model FSDP1 wraps"
        compiled_at = self.get_metadata(PositionProvider, node).start.line
        named = next(
            (
                c
                for c in walk(scope)
                if isinstance(c, cst.Call)
                and m.matches(c.func, m.Attribute(attr=m.Name("named_parameters")))
                and code_of(cast(cst.Attribute, c.func).value) == code_of(assign.targets[0].target)
                and self.get_metadata(PositionProvider, c).start.line > compiled_at
            ),
            None,
        )
        if named is not None:
            # names taken from the compiled model carry '_orig_mod.', which the migrated state dicts' keys lack
            self._record(
                node,
                f"{construct}, whose named_parameters() names are kept (line "
                f"{self.get_metadata(PositionProvider, named).start.line} before --fix)",
                f"not rewritten: {COMPILED_NAMES.removeprefix('left as it is; ')}. The names this code takes from "
                "the compiled model's named_parameters() carry '_orig_mod.' and so no longer match the migrated "
                "state dicts' keys (a lookup or a check of them fails at the first checkpoint): take them from "
                f"{code_of(node.args[0].value)} before it is compiled (or from its ._orig_mod), or strip "
                "'_orig_mod.' from them",
                False,
            )
            return
        pos = self.get_metadata(PositionProvider, node)
        self.findings.append(CodeFinding(self.path, pos.start.line, pos.start.column, construct, text, True, note=True))
