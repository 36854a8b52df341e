"""Testing helpers: run code on N ranks, build tiny models, compare backends."""

from fsdp_bridge.testing.spawn import RankFailure, run_distributed

__all__ = ["RankFailure", "run_distributed"]
