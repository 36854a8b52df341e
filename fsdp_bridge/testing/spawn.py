"""Run a function on N ranks in spawned processes (gloo on CPU, NCCL when asked).

    from fsdp_bridge.testing import run_distributed
    results = run_distributed(my_fn, world_size=2, args=(config,))   # one result per rank

The implementation lives in :mod:`fsdp_bridge.testing._spawn`. The commands start their ranks
with the elastic launcher instead (:mod:`fsdp_bridge._launch`): production code never imports
``fsdp_bridge.testing``.
"""

from fsdp_bridge.testing._spawn import RankFailure, run_distributed

__all__ = ["RankFailure", "run_distributed"]
