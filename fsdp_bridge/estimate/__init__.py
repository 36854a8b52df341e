"""Memory estimates per rank for every strategy and backend, without a process group.

    from fsdp_bridge.estimate import estimate, format_table
    rows = estimate("llama:hidden_size=4096,num_hidden_layers=32", world_size=8)
    print(format_table(rows))

The model is built on the meta device; the wrap units are the ones ``shard()``
would create (:func:`fsdp_bridge.wrap.resolve_wrap`).  CLI: ``fsdp-bridge estimate``.
"""

from fsdp_bridge.estimate.memory import OPTIMIZERS, RankMemory, Unit, estimate_memory, measure_activations, model_units
from fsdp_bridge.estimate.model import build_meta_model, load_model_config
from fsdp_bridge.estimate.report import estimate, format_bytes, format_table, parse_bytes
from fsdp_bridge.estimate.tracker import LiveBytes, storage_bytes

__all__ = [
    "OPTIMIZERS",
    "LiveBytes",
    "RankMemory",
    "Unit",
    "build_meta_model",
    "estimate",
    "estimate_memory",
    "format_bytes",
    "format_table",
    "load_model_config",
    "measure_activations",
    "model_units",
    "parse_bytes",
    "storage_bytes",
]
