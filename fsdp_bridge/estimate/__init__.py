"""Memory estimates per rank for every strategy and backend, without a process group.

    from fsdp_bridge.estimate import estimate, format_table
    rows = estimate("llama:hidden_size=4096,num_hidden_layers=32", world_size=8)
    print(format_table(rows))

The model is built on the meta device; the wrap units are the ones ``shard()``
would create (:func:`fsdp_bridge.wrap.resolve_wrap`).  CLI: ``fsdp-bridge estimate``.
:func:`plan_at_scale` runs the real ``shard()`` as chosen ranks of a fake world
(e.g. 1024 ranks, in one process) and checks the estimate against their shards.
"""

from fsdp_bridge.estimate.fake_world import RankPlan, ScalePlan, fake_process_group, plan_at_scale
from fsdp_bridge.estimate.memory import OPTIMIZERS, RankMemory, Unit, estimate_memory, measure_activations, model_units
from fsdp_bridge.estimate.model import build_meta_model, load_model_config
from fsdp_bridge.estimate.report import estimate, format_table
from fsdp_bridge.estimate.tracker import LiveBytes, storage_bytes

__all__ = [
    "OPTIMIZERS",
    "LiveBytes",
    "RankMemory",
    "RankPlan",
    "ScalePlan",
    "Unit",
    "build_meta_model",
    "estimate",
    "estimate_memory",
    "fake_process_group",
    "format_table",
    "load_model_config",
    "measure_activations",
    "model_units",
    "plan_at_scale",
    "storage_bytes",
]
