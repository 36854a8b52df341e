"""What ``migrate config`` reads and returns: the FSDP1 source's options and the migration result.

Kept apart from the readers (``_config``) and the accelerate writer (``_accelerate``) so that both
use these types without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fsdp_bridge.config import BridgeConfig
from fsdp_bridge.migrate._report import ConfigReport

__all__ = ["Fsdp1Source", "Migration", "SourceOption"]


@dataclass(frozen=True)
class SourceOption:
    """One option of the source, tied to a BridgeConfig field or a table option."""

    key: str
    """As the source spells it."""
    value: object
    """As given (or the tool's default, when ``default`` is true)."""
    option: str
    """A BridgeConfig field (``strategy``) or a table option with no field (``use_orig_params``)."""
    default: bool = False
    """Not set in the source; the tool's default is what FSDP1 ran with."""
    ignored_because: str = ""
    """Set when the source tool itself ignores the key (e.g. min_num_params with transformer wrap)."""


@dataclass
class Fsdp1Source:
    kind: str
    path: str
    fields: dict[str, Any] = field(default_factory=dict)
    options: list[SourceOption] = field(default_factory=list)
    table_values: dict[str, object] = field(default_factory=dict)
    """Values of table-only options (state_dict_type, use_orig_params, ...)."""
    raw: dict[str, Any] = field(default_factory=dict)
    """The whole source document (accelerate: re-emitted with the FSDP2 fsdp_config)."""
    notes: list[str] = field(default_factory=list)
    """What the report must say about the source beyond its rows (e.g. what ``bf16: auto`` meant)."""
    used: set[str] = field(default_factory=set)
    """Top-level keys of the source read by the migration; every other key is reported as not used."""

    def record(self, key: str, option: str, value: object, *, default: bool = False, ignored: str = "") -> None:
        """Note a source key for the report (in the order the report lists them)."""
        self.options.append(SourceOption(key, value, option, default, ignored))


@dataclass
class Migration:
    """The result of :func:`migrate_config`."""

    source: Fsdp1Source
    fsdp1: BridgeConfig
    """What the source ran, as a bridge config on FSDP1."""
    fsdp2: BridgeConfig
    """The FSDP2 equivalent (written as the bridge YAML)."""
    report: ConfigReport
    accelerate: dict[str, Any] | None = None
    """The accelerate FSDP2 YAML document (accelerate sources only)."""
