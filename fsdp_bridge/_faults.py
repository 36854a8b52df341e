"""Fault injection for reliability tests: make one rank fail at a named point of a training run.

    FSDP_BRIDGE_FAULT=1:step:3 fsdp-bridge train job.yaml        # rank 1 raises during step 3
    FSDP_BRIDGE_FAULT=1:step:3:hang fsdp-bridge train job.yaml   # rank 1 stops answering there
    FSDP_BRIDGE_FAULT=1:step:3:once fsdp-bridge train job.yaml --max-restarts 1   # only before a restart

Points the trainer passes: ``shard`` (just before sharding), ``step:N`` (after the first
backward of step N, so the other ranks are inside collectives), ``checkpoint:N`` (as the
checkpoint of step N is written).  With ``:hang`` the rank neither raises nor returns: it
sleeps until a signal ends it (SIGTERM's default action, so the launcher's stop is prompt), as a
rank stuck in a data loader or a deadlock would.  Nothing happens unless the variable is set; it
exists so that tests can prove a failing rank stops the others in bounded time, and that a hung
rank is the one named.

``once``: the fault fires on the first attempt only. An elastic restart says so itself
(``TORCHELASTIC_RESTART_COUNT``); launchers that restart workers without telling them (Ray Train's
``FailureConfig``, a Kubernetes pod restarted) are recognised by a marker the firing rank leaves in
the run's output directory (``.fault-fired-rank<R>-<point>``; for a run at a URL, in a directory
beside its local copy, which a new attempt empties) when the trainer passes ``run_dir``.

Called by the trainer; :mod:`fsdp_bridge.testing.faults` re-exports it for tests.
"""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_bridge._launch import restart_count

__all__ = ["ENV", "InjectedFault", "maybe_fail"]

ENV = "FSDP_BRIDGE_FAULT"


class InjectedFault(RuntimeError):
    """Raised by :func:`maybe_fail` on the rank and at the point named in ``FSDP_BRIDGE_FAULT``."""


def maybe_fail(point: str, *, run_dir: str | Path | None = None) -> None:
    """Raise :class:`InjectedFault` if ``FSDP_BRIDGE_FAULT`` names this rank and ``point``.

    ``run_dir``: the run's output directory, where a ``once`` fault records that it fired.
    """
    spec = os.environ.get(ENV)
    if not spec:
        return
    rank, _, target = spec.partition(":")
    parts = target.strip().split(":")
    modifiers = set()
    while parts and parts[-1] in ("hang", "once"):
        modifiers.add(parts.pop())
    if rank.strip() != os.environ.get("RANK", "0") or ":".join(parts) != point:
        return
    if "once" in modifiers:
        if restart_count():
            return  # a restarted job gets past the point
        if run_dir is not None:
            marker = Path(run_dir) / f".fault-fired-rank{rank.strip()}-{point.replace(':', '-')}"
            if marker.exists():
                return  # fired in an earlier attempt of this run
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    hang = "hang" in modifiers
    if not hang:
        raise InjectedFault(f"injected fault on rank {rank} at {point} ({ENV}={spec})")
    import signal
    import time

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the trainer's handler would only record it
    while True:
        time.sleep(3600)
