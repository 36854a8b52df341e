"""Fault injection for reliability tests: make one rank fail at a named point of a training run.

    FSDP_BRIDGE_FAULT=1:step:3 fsdp-bridge train job.yaml    # rank 1 raises during step 3

Points the trainer passes: ``shard`` (just before sharding), ``step:N`` (after the first
backward of step N, so the other ranks are inside collectives), ``checkpoint:N`` (as the
checkpoint of step N is written).  Nothing happens unless the variable is set; it exists
so that tests can prove a failing rank stops the others in bounded time.

Called by the trainer; :mod:`fsdp_bridge.testing.faults` re-exports it for tests.
"""

from __future__ import annotations

import os

__all__ = ["ENV", "InjectedFault", "maybe_fail"]

ENV = "FSDP_BRIDGE_FAULT"


class InjectedFault(RuntimeError):
    """Raised by :func:`maybe_fail` on the rank and at the point named in ``FSDP_BRIDGE_FAULT``."""


def maybe_fail(point: str) -> None:
    """Raise :class:`InjectedFault` if ``FSDP_BRIDGE_FAULT`` names this rank and ``point``."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    rank, _, target = spec.partition(":")
    if rank.strip() == os.environ.get("RANK", "0") and target.strip() == point:
        raise InjectedFault(f"injected fault on rank {rank} at {point} ({ENV}={spec})")
