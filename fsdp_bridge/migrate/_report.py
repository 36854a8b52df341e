"""What a migration found, option by option (config) or construct by construct (code).

Config rows take their outcome from :data:`fsdp_bridge.mapping.TABLE`: the table's
:class:`~fsdp_bridge.mapping.Outcome` on FSDP2 becomes the row's status (native ->
``mapped``, emulated -> ``emulated``, not needed -> ``not needed``, unsupported ->
``no equivalent``) and the table's text is the reason.
"""

from __future__ import annotations

import enum
import textwrap
from dataclasses import dataclass, field

from fsdp_bridge.mapping import Outcome

__all__ = ["CodeFinding", "CodeReport", "ConfigReport", "OptionRow", "Status", "status_of"]


class Status(enum.Enum):
    """What became of one FSDP1 option on FSDP2."""

    MAPPED = "mapped"
    """FSDP2 has the option (possibly under another name)."""
    EMULATED = "emulated"
    """FSDP2 lacks it; fsdp_bridge reproduces its meaning (the reason says how)."""
    NOT_NEEDED = "not needed"
    """FSDP2 has no work to do for it (the reason says why)."""
    NO_EQUIVALENT = "no equivalent"
    """FSDP2 cannot express it; the reason says what the output uses instead."""


_STATUS = {
    Outcome.NATIVE: Status.MAPPED,
    Outcome.EMULATED: Status.EMULATED,
    Outcome.NOT_NEEDED: Status.NOT_NEEDED,
    Outcome.UNSUPPORTED: Status.NO_EQUIVALENT,
}


def status_of(outcome: Outcome) -> Status:
    """The report status of a mapping-table outcome."""
    return _STATUS[outcome]


@dataclass(frozen=True)
class OptionRow:
    """One option of the source configuration."""

    key: str
    """The key as the source spells it (``fsdp_sharding_strategy``, ``fsdp[]``, ``strategy``)."""
    value: str
    """The value given, as text (``"(not set)"`` for a source default that matters)."""
    status: Status
    target: str
    """What it becomes in the bridge YAML (``strategy: hybrid_shard``) or ``-``."""
    reason: str
    """The mapping table's text for FSDP2 (how it is done, why it is not needed, or why not)."""
    accelerate: str | None = None
    """What it becomes in the accelerate FSDP2 YAML (accelerate sources only)."""


@dataclass
class ConfigReport:
    """The per-option account of one ``migrate config`` run."""

    source: str
    kind: str
    """``accelerate``, ``trainer`` or ``bridge``."""
    rows: list[OptionRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    def row(self, key: str) -> OptionRow:
        """The row of a source key.

        Args:
            key: the option's key as the source file spells it (``fsdp_sharding_strategy``).

        Returns:
            The :class:`OptionRow` of that key.

        Raises:
            KeyError: ``key`` is not in the report; the message names the keys that are.
        """
        for r in self.rows:
            if r.key == key:
                return r
        raise KeyError(f"{key!r} is not in the report; rows: {', '.join(r.key for r in self.rows)}")

    def format(self, *, width: int = 110) -> str:
        """Plain text: one block per option, then the notes and the files written.

        Args:
            width: the column at which reasons are wrapped.

        Returns:
            The report as lines of text (what ``fsdp-bridge migrate config`` prints).
        """
        lines = [f"FSDP1 -> FSDP2 migration of {self.source} ({self.kind} config)", ""]
        for r in self.rows:
            lines.append(f"{r.key}: {r.status.value.upper()}  ({r.value} -> {r.target})")
            lines.extend(textwrap.wrap(r.reason, width, initial_indent="    ", subsequent_indent="    "))
            if r.accelerate:
                lines.extend(
                    textwrap.wrap(
                        f"accelerate FSDP2: {r.accelerate}", width, initial_indent="    ", subsequent_indent="      "
                    )
                )
        if self.notes:
            lines.append("")
            for n in self.notes:
                lines.extend(textwrap.wrap(f"note: {n}", width, subsequent_indent="      "))
        if self.outputs:
            lines.append("")
            lines.extend(f"wrote {o}" for o in self.outputs)
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """The report as a Markdown table (written beside the output).

        Returns:
            A heading, one table row per option and the notes as a list, ending in a newline.
        """
        has_acc = any(r.accelerate is not None for r in self.rows)
        head = "| option | value | outcome | becomes | reason |" + (" accelerate FSDP2 |" if has_acc else "")
        sep = "| --- | --- | --- | --- | --- |" + (" --- |" if has_acc else "")
        lines = [f"# FSDP1 -> FSDP2 migration of `{self.source}` ({self.kind} config)", "", head, sep]
        for r in self.rows:
            cells = [f"`{r.key}`", f"`{r.value}`", r.status.value, f"`{r.target}`", r.reason]
            if has_acc:
                cells.append(r.accelerate or "")
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        if self.notes:
            lines.append("")
            lines.extend(f"- {n}" for n in self.notes)
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, object]:
        """The report as JSON-safe data.

        Returns:
            ``source``, ``kind``, ``rows`` (one mapping per option: key, value, status, target,
            reason, accelerate), ``notes`` and ``outputs``.
        """
        return {
            "source": self.source,
            "kind": self.kind,
            "rows": [
                {
                    "key": r.key,
                    "value": r.value,
                    "status": r.status.value,
                    "target": r.target,
                    "reason": r.reason,
                    "accelerate": r.accelerate,
                }
                for r in self.rows
            ],
            "notes": list(self.notes),
            "outputs": list(self.outputs),
        }


@dataclass(frozen=True)
class CodeFinding:
    """One FSDP1 construct found in a Python source."""

    path: str
    line: int
    column: int
    construct: str
    """What was found, e.g. ``FullyShardedDataParallel(...)`` or ``sharding_strategy=``."""
    replacement: str
    """Its FSDP2 / fsdp_bridge replacement."""
    fixable: bool
    """Whether ``--fix`` rewrites it (otherwise it gets a ``TODO(fsdp-bridge)`` comment)."""
    note: bool = False
    """A note for the reader, not a construct: nothing here to rewrite and no TODO comment (what to do with
    what the code already wrote, e.g. FSDP1-format checkpoints); ``fixable`` is True so it never counts as
    left to do."""

    def format(self) -> str:
        mark = "note" if self.note else "fix" if self.fixable else "todo"
        return f"{self.path}:{self.line}:{self.column + 1}: [{mark}] {self.construct} -> {self.replacement}"


@dataclass
class CodeReport:
    """Every construct found in the scanned files."""

    findings: list[CodeFinding] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    """Files rewritten (or that would be, with ``--diff``)."""
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """Files left untouched, with the reason (unreadable, not Python 3, a construct the codemod cannot handle)."""
    todo_comments: dict[str, int] = field(default_factory=dict)
    """``TODO(fsdp-bridge)`` comments per file after ``--fix`` (those an earlier run wrote included)."""

    @property
    def todos(self) -> list[CodeFinding]:
        return [f for f in self.findings if not f.fixable]

    def format(self) -> str:
        lines = [f.format() for f in self.findings]
        lines.extend(f"{path}: [skipped] {reason}" for path, reason in self.skipped)
        constructs = [f for f in self.findings if not f.note]
        n_fix = sum(f.fixable for f in constructs)
        n_notes = len(self.findings) - len(constructs)
        lines.append(
            f"{len(constructs)} FSDP1 construct(s): {n_fix} rewritable by --fix, "
            f"{len(constructs) - n_fix} left with TODO(fsdp-bridge)"
            + (f"; {n_notes} note(s)" if n_notes else "")
            + (f"; {len(self.skipped)} file(s) skipped" if self.skipped else "")
        )
        return "\n".join(lines)
