"""The backend registry: the only place that chooses an implementation by name."""

from __future__ import annotations

from fsdp_bridge.backends.base import BackendImpl, ShardPlan
from fsdp_bridge.strategy import Backend

__all__ = ["BackendImpl", "ShardPlan", "get_backend"]


def get_backend(backend: Backend) -> BackendImpl:
    """The implementation of ``backend`` (imported lazily: FSDP1 and FSDP2 pull in different torch modules)."""
    if backend is Backend.FSDP1:
        from fsdp_bridge.backends.fsdp1 import FSDP1Backend

        return FSDP1Backend()
    from fsdp_bridge.backends.fsdp2 import FSDP2Backend

    return FSDP2Backend()
