"""Testing helpers: run code on N ranks, build tiny models, compare backends.

The pytest plugin (:mod:`fsdp_bridge.testing.plugin`, loaded automatically) adds the
``distributed`` marker, the ``run_on_ranks`` fixture and the ``fsdp_backend`` /
``fsdp_strategy`` parametrisation; see docs/testing.md.

The parity helpers are imported on first use, so that loading the plugin (which pytest
does in every session) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsdp_bridge.testing._spawn import RankFailure, run_distributed

if TYPE_CHECKING:
    from fsdp_bridge.testing.parity import (
        TOLERANCES,
        ParityReport,
        Tolerance,
        assert_backend_parity,
        rank_batches,
        tolerance_for,
    )

__all__ = [
    "TOLERANCES",
    "ParityReport",
    "RankFailure",
    "Tolerance",
    "assert_backend_parity",
    "rank_batches",
    "run_distributed",
    "tolerance_for",
]

_PARITY = {"TOLERANCES", "ParityReport", "Tolerance", "assert_backend_parity", "rank_batches", "tolerance_for"}


def __getattr__(name: str) -> Any:
    if name in _PARITY:
        from fsdp_bridge.testing import parity

        return getattr(parity, name)
    raise AttributeError(f"module 'fsdp_bridge.testing' has no attribute {name!r}")
