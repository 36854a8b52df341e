"""Exceptions raised by fsdp_bridge.

Every user-facing error names what was wrong, the value given, what is allowed and
the fix.  :class:`ConfigError` collects *all* problems found in one configuration so
that a user fixes them in one round instead of one per launch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CheckpointError", "ConfigError", "Problem"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a configuration."""

    key: str
    """The config key (dotted for nested keys, e.g. ``mixed_precision.param_dtype``)."""
    value: object
    """The value that was given."""
    allowed: str
    """What would have been accepted."""
    fix: str = ""
    """How to fix it, when that is more than "use an allowed value"."""

    def __str__(self) -> str:
        text = f"{self.key}: got {self.value!r}; allowed: {self.allowed}"
        if self.fix:
            text += f". Fix: {self.fix}"
        return text


class ConfigError(ValueError):
    """A configuration (or a configuration/model/environment combination) is invalid.

    ``problems`` lists every problem that was found; the message shows all of them.
    It subclasses :class:`ValueError` so that generic handlers still catch it.
    """

    def __init__(self, problems: Iterable[Problem] | str, *, source: str | None = None) -> None:
        if isinstance(problems, str):
            problems = [Problem(key="config", value=None, allowed="", fix=problems)]
        self.problems: tuple[Problem, ...] = tuple(problems)
        self.source = source
        where = f" in {source}" if source else ""
        count = len(self.problems)
        head = f"invalid fsdp_bridge configuration{where} ({count} problem{'s' * (count != 1)}):"
        super().__init__("\n".join([head, *(f"  - {p}" for p in self.problems)]))


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model.

    ``path`` is the file or directory at fault; ``problems`` lists every problem found.
    """

    def __init__(self, path: str | os.PathLike[str], problems: Iterable[str] | str) -> None:
        self.path = str(path)
        self.problems: tuple[str, ...] = (problems,) if isinstance(problems, str) else tuple(problems)
        lines = [
            f"checkpoint {self.path}: "
            + (self.problems[0] if len(self.problems) == 1 else f"{len(self.problems)} problems:")
        ]
        if len(self.problems) > 1:
            lines.extend(f"  - {p}" for p in self.problems)
        super().__init__("\n".join(lines))
