"""The enums users choose from: sharding strategy, backend and backward prefetch.

Parsing is done once, at the edge (:func:`parse_enum`): YAML spellings are accepted
case-insensitively with ``-`` or ``_``, and torch's own
``torch.distributed.fsdp.ShardingStrategy`` / ``BackwardPrefetch`` members are
accepted as well.
"""

from __future__ import annotations

import enum
from typing import TypeVar

__all__ = ["FSDP1_PARAMETERS", "Backend", "BackwardPrefetch", "ShardingStrategy", "parse_enum"]


class ShardingStrategy(enum.Enum):
    """How parameters, gradients and optimizer state are split across ranks."""

    FULL_SHARD = "full_shard"
    """ZeRO-3: parameters, gradients and optimizer state sharded; parameters
    re-gathered for backward."""
    SHARD_GRAD_OP = "shard_grad_op"
    """ZeRO-2: gradients and optimizer state sharded; parameters stay gathered
    between forward and backward."""
    NO_SHARD = "no_shard"
    """Full replication with gradient all-reduce (what DDP does)."""
    HYBRID_SHARD = "hybrid_shard"
    """FULL_SHARD within a shard group, replicated across groups (HSDP)."""
    HYBRID_SHARD_ZERO2 = "hybrid_shard_zero2"
    """SHARD_GRAD_OP within a shard group, replicated across groups."""

    @property
    def is_hybrid(self) -> bool:
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)

    @property
    def reshards_after_forward(self) -> bool:
        """Whether non-root units free their gathered parameters after forward."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


class Backend(enum.Enum):
    """Which PyTorch FSDP implementation runs the model."""

    FSDP1 = "fsdp1"
    """``torch.distributed.fsdp.FullyShardedDataParallel`` (flat-parameter wrapper)."""
    FSDP2 = "fsdp2"
    """``torch.distributed.fsdp.fully_shard`` (per-parameter DTensor sharding)."""


class BackwardPrefetch(enum.Enum):
    """When the next unit's parameters are all-gathered during backward."""

    PRE = "pre"
    """Before the current unit's gradient computation (FSDP1 BACKWARD_PRE)."""
    POST = "post"
    """After the current unit's gradient computation (FSDP1 BACKWARD_POST)."""
    NONE = "none"
    """No prefetch: gather each unit only when its backward starts."""


# torch's own enum member names that differ from ours.
_ALIASES: dict[str, str] = {
    "_hybrid_shard_zero2": "hybrid_shard_zero2",
    "backward_pre": "pre",
    "backward_post": "post",
}

E = TypeVar("E", bound=enum.Enum)


def _spelling(value: object) -> str | None:
    """Normalise a user spelling to our enum values, or None if it is not a string-like."""
    if isinstance(value, enum.Enum):
        # Our own enums and torch's (torch's members have int values, so use the name).
        value = value.name
    if not isinstance(value, str):
        return None
    text = value.strip().lower().replace("-", "_")
    for prefix in ("shardingstrategy.", "backwardprefetch.", "backend."):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return _ALIASES.get(text, text)


def parse_enum(enum_cls: type[E], value: object) -> E:
    """Parse ``value`` into ``enum_cls``.

    Accepts a member of ``enum_cls``, its value or name in any case with ``-`` or
    ``_``, and torch's equivalently named enum members.  ``None`` is accepted for
    :class:`BackwardPrefetch` and means ``NONE`` (as FSDP1's ``backward_prefetch=None``), and for
    :class:`ShardingStrategy`, where it means ``FULL_SHARD`` (as FSDP1's ``sharding_strategy=None``: a value
    migrated code passes on as it was given, ``{1: ..., 3: ...}.get(zero)``).

    Raises:
        ValueError: naming the value and the allowed spellings.
    """
    if isinstance(value, enum_cls):
        return value
    if value is None and enum_cls is BackwardPrefetch:
        return enum_cls("none")
    if value is None and enum_cls is ShardingStrategy:
        return enum_cls("full_shard")
    text = _spelling(value)
    if text is not None:
        for member in enum_cls:
            if text in (member.value, member.name.lower()):
                return member
    allowed = ", ".join(m.value for m in enum_cls)
    raise ValueError(f"{value!r} is not a {enum_cls.__name__}; allowed: {allowed}")


def allowed_values(enum_cls: type[enum.Enum]) -> str:
    """The allowed spellings of ``enum_cls`` for error messages."""
    return ", ".join(m.value for m in enum_cls)


FSDP1_PARAMETERS = (
    "module",
    "process_group",
    "sharding_strategy",
    "cpu_offload",
    "auto_wrap_policy",
    "backward_prefetch",
    "mixed_precision",
    "ignored_modules",
    "param_init_fn",
    "device_id",
    "sync_module_states",
    "forward_prefetch",
    "limit_all_gathers",
    "use_orig_params",
    "ignored_states",
    "device_mesh",
)
"""``FullyShardedDataParallel.__init__``'s parameters in their order (torch 2.8-2.14): read by
``BridgeConfig.from_fsdp1(*args)`` and by the codemod (which imports no torch)."""
