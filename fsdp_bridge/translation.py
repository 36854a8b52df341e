"""What the translation table says, as data: the four outcomes, one translation, and the report of a config.

:mod:`fsdp_bridge.mapping` holds the table and builds :class:`TranslationReport` objects from it
(:func:`fsdp_bridge.mapping.translate`); this module holds only the types, so the table can grow without
the report's code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from fsdp_bridge.strategy import Backend

__all__ = ["Entry", "Outcome", "Translation", "TranslationReport", "show_value"]


class Outcome(enum.Enum):
    """What a backend does with one option's value: the four outcomes of the translation table."""

    NATIVE = "native"
    """The backend has the option; it is passed through."""
    EMULATED = "emulated"
    """The backend lacks the option; fsdp_bridge reproduces its meaning (the text says how)."""
    NOT_NEEDED = "not needed"
    """The option has no work to do on this backend or device (the text says why)."""
    UNSUPPORTED = "unsupported"
    """Refused with a ConfigError (the text gives the reason and the alternative)."""


@dataclass(frozen=True)
class Translation:
    outcome: Outcome
    text: str


@dataclass(frozen=True)
class Entry:
    option: str
    case: str
    value: object
    outcome: Outcome
    text: str


@dataclass(frozen=True)
class TranslationReport:
    """What one backend does with every option of a config (:func:`translate`): one entry per option."""

    backend: Backend
    entries: tuple[Entry, ...]

    @property
    def unsupported(self) -> tuple[Entry, ...]:
        return tuple(e for e in self.entries if e.outcome is Outcome.UNSUPPORTED)

    def entry(self, option: str) -> Entry:
        """The row that ``option`` matched (every config option matches exactly one).

        Args:
            option: a config option as the table names it (``cpu_offload``,
                ``mixed_precision.buffer_dtype``).

        Returns:
            Its :class:`Entry`: the value, the case matched, the outcome and what happens.

        Raises:
            KeyError: ``option`` is not in this report; the message lists the options that are.
        """
        for e in self.entries:
            if e.option == option:
                return e
        raise KeyError(f"no entry for option {option!r}; options are {', '.join(e.option for e in self.entries)}")

    def outcome(self, option: str) -> Outcome:
        """What the table says ``option`` becomes on this backend and device.

        Args:
            option: a config option as the table names it.

        Returns:
            The matched row's :class:`Outcome`.

        Raises:
            KeyError: ``option`` is not in this report.
        """
        return self.entry(option).outcome

    def format(self, *, width: int = 100) -> str:
        """A plain-text table (one row per option), as ``fsdp-bridge explain`` prints it.

        Args:
            width: the line width the last column wraps to (at least 30 characters are kept for it).

        Returns:
            The table, headed by the backend's name.
        """
        import textwrap

        rows = [(e.option, show_value(e.value), e.outcome.value, e.text) for e in self.entries]
        w0 = max(len("option"), *(len(r[0]) for r in rows))
        w1 = min(24, max(len("value"), *(len(r[1]) for r in rows)))
        w2 = max(len("outcome"), *(len(r[2]) for r in rows))
        text_w = max(30, width - w0 - w1 - w2 - 6)
        lines = [
            f"{self.backend.value}:",
            f"{'option':<{w0}}  {'value':<{w1}}  {'outcome':<{w2}}  what happens",
            f"{'-' * w0}  {'-' * w1}  {'-' * w2}  {'-' * 12}",
        ]
        for opt, val, outcome, text in rows:
            wrapped = textwrap.wrap(text, text_w) or [""]
            lines.append(f"{opt:<{w0}}  {val[:w1]:<{w1}}  {outcome:<{w2}}  {wrapped[0]}")
            lines.extend(f"{'':<{w0}}  {'':<{w1}}  {'':<{w2}}  {more}" for more in wrapped[1:])
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        """The report as JSON-safe data (what ``fsdp-bridge explain --json`` prints).

        Returns:
            ``{"backend": ..., "entries": [{"option", "case", "value", "outcome", "text"}, ...]}``.
        """
        return {
            "backend": self.backend.value,
            "entries": [
                {
                    "option": e.option,
                    "case": e.case,
                    "value": show_value(e.value),
                    "outcome": e.outcome.value,
                    "text": e.text,
                }
                for e in self.entries
            ],
        }


def show_value(value: object) -> str:
    """A config value as the report prints it (enum values, YAML spellings, named callables)."""
    if isinstance(value, enum.Enum):
        return str(value.value)
    if hasattr(value, "to_spelling"):
        try:
            return str(value.to_spelling())
        except Exception:  # a callable wrap policy has no YAML spelling: name it
            fn = getattr(value, "fn", None)
            return f"callable {getattr(fn, '__qualname__', type(fn).__name__)}"
    return str(value)
