"""The report of ``migrate code --target torch``: every line at its place in the user's file, naming what the
written file holds.

The bridge pass reports each FSDP1 construct at its position in the user's file with the bridge call it
wrote; the torch pass (:mod:`fsdp_bridge.migrate._torch_target`) then rewrites bridge calls of the bridge
rewrite, whose lines are not the user's. Each bridge call the torch pass met is tied back to the finding
that wrote it: the lines of the user's file and of the bridge rewrite are aligned (an unchanged line is the
same line), and among the findings on the user's lines that the bridge rewrite changed around the call, the
call belongs to the first, in order, whose result names it (``fsdp_bridge.<name>``). That finding then says
what the call became in plain torch, or becomes a TODO naming the bridge call kept and why; the argument
findings inside a constructor whose ``shard`` call was lowered name the ``shard_model`` arguments they
became. A bridge call no finding wrote (code already on the bridge) gets a line of its own, at its line in
the user's file.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Sequence

from fsdp_bridge.migrate._report import CodeFinding
from fsdp_bridge.migrate._torch_helpers import HELPERS_NAME
from fsdp_bridge.migrate._torch_target import LoweredCall

__all__ = ["torch_findings"]

_WHAT = {
    "shard": f"torch's fully_shard on each unit (children first), then on the root ({HELPERS_NAME}.py, written "
    "beside the file)",
    "no_sync": "set_requires_gradient_sync(False) on the FSDP2 module, restored on exit (a DDP module's own no_sync())",
    "clip_grad_norm_": "torch's clip over the model's parameters (the global norm over DTensor gradients, "
    f"returned as a plain tensor, as FSDP1's; {HELPERS_NAME}.py)",
    "is_sharded": "torch's FSDP2 module class (fully_shard makes each unit one)",
    "ShardedModule": "torch's FSDP2 module class (fully_shard makes each unit one)",
    "full_state_dict": "torch's DCP state-dict API",
    "full_optim_state_dict": "torch's DCP state-dict API",
}
"""What each bridge call lowered to does, said after the code written."""

_LONG = 100
"""Code quoted longer than this is shortened to its callee (``_fsdp2_helpers.shard_model(...)``)."""


_NEAR = 5
"""How many lines from the changed lines around a bridge call its finding may lie (statements the bridge
pass moved)."""


class _Alignment:
    """The lines of the user's file against the bridge rewrite's."""

    def __init__(self, original: str, bridge: str) -> None:
        self.size = original.count("\n") + 1
        matcher = difflib.SequenceMatcher(None, original.splitlines(), bridge.splitlines(), autojunk=False)
        self.opcodes = matcher.get_opcodes()

    def origin(self, line: int) -> tuple[int, int, bool]:
        """The user's lines (first, last) that bridge-rewrite ``line`` stands for, and whether it is the
        same line unchanged."""
        j = line - 1
        for tag, i1, i2, j1, j2 in self.opcodes:
            if j1 <= j < j2:
                if tag == "equal":
                    return i1 + j - j1 + 1, i1 + j - j1 + 1, True
                return max(i1, 1) if i1 == i2 else i1 + 1, max(i2, i1 + 1), False
        return self.size, self.size, False


def _head(replacement: str) -> str:
    """The code a finding says it wrote: ``fsdp_bridge.no_sync(model)`` of ``fsdp_bridge.no_sync(model); it
    calls ...``."""
    return re.split(r" \(|: |; ", replacement, maxsplit=1)[0]


def _wrote(replacement: str) -> bool:
    """Whether a finding wrote code: ``kept: ... fsdp_bridge.BridgeConfig.from_fsdp1 reads it`` (a value left
    for a bridge call another finding wrote) wrote none."""
    return not replacement.startswith("kept")


def _short(code: str) -> str:
    return code if len(code) <= _LONG else f"{code.split('(')[0]}(...)"


def _lowered_text(finding: CodeFinding, calls: Sequence[LoweredCall]) -> str:
    """What the finding's construct became in plain torch: the code the bridge pass quoted with each bridge
    call replaced where it quoted the call itself, else the code written; then what it does."""
    head = _head(finding.replacement)
    if all(c.code in head for c in calls):
        for c in calls:
            head = head.replace(c.code, c.became)
        code = _short(head)
    else:
        code = "; ".join(_short(c.became) for c in calls)
    what = "; ".join(dict.fromkeys(_WHAT[c.name] for c in calls if c.name in _WHAT))
    notes = [n for c in calls for n in c.notes]
    return code + (f": {what}" if what else "") + "".join(f"; {n}" for n in notes)


def _kept_text(finding: CodeFinding, calls: Sequence[LoweredCall]) -> str:
    text = finding.replacement
    for c in calls:
        if not c.kept:
            text = text.replace(c.code, c.became)
    why = "; ".join(dict.fromkeys(f"{_short(c.code)}: {c.why}" for c in calls if c.kept))
    return f"{text} (kept on fsdp_bridge under --target torch: {why})"


def _setting_text(finding: CodeFinding, settings: Sequence[tuple[str, str, str]]) -> str | None:
    """An argument finding of a lowered constructor (``strategy="shard_grad_op": ...``): what it became in
    ``shard_model``, or None when it names no setting of the config."""
    for kw, value, became in settings:
        prefix = f"{kw}={value}"
        if finding.replacement.startswith(prefix):
            rest = finding.replacement[len(prefix) :]
            return (became or f"nothing in {HELPERS_NAME}.shard_model(...)") + rest
    return None


def torch_findings(
    path: str,
    original: str,
    bridge: str,
    findings: Sequence[CodeFinding],
    calls: Sequence[LoweredCall],
    spans: dict[tuple[int, int], tuple[int, int]],
) -> list[CodeFinding]:
    """The report lines of ``--target torch`` for one file.

    Args:
        path: the file, as the report names it.
        original: the user's source.
        bridge: the bridge rewrite of it (the text the torch pass lowered).
        findings: the bridge pass's findings (positions in ``original``).
        calls: every bridge call of ``bridge`` and what the torch pass made of it.
        spans: (line, column) -> (end line, end column) in ``original`` of each constructor call the bridge
            pass converted (its argument findings lie inside).

    Returns:
        The findings, sorted by position: each at its place in ``original``, naming the code written.
    """
    align = _Alignment(original, bridge)
    constructs = [i for i, f in enumerate(findings) if f.fixable and not f.note]
    owned: dict[int, list[LoweredCall]] = {}
    loose: list[CodeFinding] = []
    for call in calls:
        first, last, same = align.origin(call.line)
        owner = None
        if not same:  # a line the bridge pass wrote: the call is the next one its findings there name
            names = re.compile(rf"fsdp_bridge\.{re.escape(call.name)}(?![\w.])")
            named = [i for i in constructs if _wrote(findings[i].replacement) and names.search(findings[i].replacement)]
            near = [i for i in named if first <= findings[i].line <= last]
            if not near:  # statements moved by the bridge pass (an optimizer built after the shard call)
                near = sorted(
                    (
                        i
                        for i in named
                        if abs(findings[i].line - first) <= _NEAR or abs(findings[i].line - last) <= _NEAR
                    ),
                    key=lambda i: min(abs(findings[i].line - first), abs(findings[i].line - last)),
                )
            owner = next((i for i in near if i not in owned), near[0] if near else None)
        if owner is not None:
            owned.setdefault(owner, []).append(call)
            continue
        if call.inner:  # said by the line of the call it is inside
            continue
        column = call.column if same else 0
        construct = f"--target torch: fsdp_bridge.{call.name}" + ("" if call.code.endswith(call.name) else "(...)")
        if call.kept:
            loose.append(CodeFinding(path, first, column, construct, f"kept on fsdp_bridge: {call.why}", False))
        else:
            became = _short(call.became) + (f": {_WHAT[call.name]}" if call.name in _WHAT else "")
            became += "".join(f"; {n}" for n in call.notes)
            loose.append(CodeFinding(path, first, column, construct, became, True, note=True))
    out = list(findings)
    for i, mine in owned.items():
        f = findings[i]
        if any(c.kept for c in mine):
            out[i] = dataclasses.replace(f, replacement=_kept_text(f, mine), fixable=False)
            continue
        out[i] = dataclasses.replace(f, replacement=_lowered_text(f, mine))
        settings = [s for c in mine for s in c.settings]
        end = spans.get((f.line, f.column))
        if not settings or end is None:
            continue
        for k, inner in enumerate(findings):
            if k != i and (f.line, f.column) < (inner.line, inner.column) <= end:
                text = _setting_text(inner, settings)
                if text is not None:
                    out[k] = dataclasses.replace(inner, replacement=text)
    return sorted(out + loose, key=lambda f: (f.line, f.column))
