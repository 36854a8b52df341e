"""Fault injection for reliability tests: make one rank fail at a named point of a training run.

    FSDP_BRIDGE_FAULT=1:step:3 fsdp-bridge train job.yaml    # rank 1 raises during step 3

The implementation lives in :mod:`fsdp_bridge._faults`, which the trainer calls: production
code never imports ``fsdp_bridge.testing``.
"""

from fsdp_bridge._faults import ENV, InjectedFault, maybe_fail

__all__ = ["ENV", "InjectedFault", "maybe_fail"]
