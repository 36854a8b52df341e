"""The accelerate side of ``migrate config``: an accelerate 1.x YAML with ``fsdp_version: 2``.

accelerate's FSDP2 plugin has fewer knobs than the bridge: no backward or forward
prefetch switch, no NO_SHARD, and hybrid sharding only through ``parallelism_config``
(fixed ``dp_replicate_size`` x ``dp_shard_size``).  Where it cannot keep an option's
meaning, the row says so and points to the bridge YAML, which can.  Keys follow
accelerate 1.15 (``accelerate/utils/launch.py``, ``commands/config/config_args.py``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

from fsdp_bridge.strategy import BackwardPrefetch, ShardingStrategy

if TYPE_CHECKING:
    from fsdp_bridge.migrate._migration import Migration

__all__ = ["accelerate_fsdp2"]

_CARRIED = (
    "fsdp_auto_wrap_policy",
    "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_min_num_params",
    "fsdp_offload_params",
    "fsdp_cpu_ram_efficient_loading",
    "fsdp_activation_checkpointing",
    "fsdp_ignored_modules",
)
_SEE_BRIDGE = "the bridge YAML keeps it"


def accelerate_fsdp2(m: Migration) -> dict[str, Any] | None:
    """The accelerate FSDP2 document for an accelerate source, or None when accelerate cannot
    express the strategy (the report's notes say why).  Fills each row's ``accelerate`` text."""
    raw = copy.deepcopy(m.source.raw)
    fsdp_in: dict[str, Any] = dict(raw.get("fsdp_config") or {})
    cfg = m.fsdp1
    strategy = cfg.strategy
    texts: dict[str, str] = {}

    if strategy is ShardingStrategy.NO_SHARD:
        # accelerate's ParallelismConfig calls dp_shard_size 1 with dp_replicate_size > 1 invalid and
        # points to DDP; DDP is exactly NO_SHARD's meaning (replicas, gradient all-reduce).
        raw.pop("fsdp_config", None)
        raw["distributed_type"] = "MULTI_GPU"
        for key in fsdp_in:
            texts[key] = "dropped: this accelerate YAML runs DDP (distributed_type: MULTI_GPU)"
        texts["fsdp_sharding_strategy"] = (
            "no equivalent in accelerate FSDP2 (reshard_after_forward: false would mean ZeRO-2); written as "
            f"DDP, distributed_type: MULTI_GPU, which is NO_SHARD's replication; {_SEE_BRIDGE} on FSDP2"
        )
        m.report.notes.append(
            "accelerate: NO_SHARD has no accelerate FSDP2 spelling that keeps its meaning; "
            "the accelerate YAML runs DDP (same replication and all-reduce); the bridge YAML "
            "keeps NO_SHARD on FSDP2 with a (world, 1) mesh"
        )
        _fill(m, texts)
        return raw

    out: dict[str, Any] = {"fsdp_version": 2, "fsdp_reshard_after_forward": strategy.reshards_after_forward}
    strategy_text = f"fsdp_reshard_after_forward: {str(strategy.reshards_after_forward).lower()}"
    if strategy.is_hybrid:
        machines, processes = raw.get("num_machines", 1), raw.get("num_processes")
        if cfg.hybrid_shape is not None:
            replicate, shard = cfg.hybrid_shape
        elif isinstance(machines, int) and isinstance(processes, int) and machines >= 1 and processes % machines == 0:
            replicate, shard = machines, processes // machines
        else:
            m.report.notes.append(
                f"accelerate: {strategy.name} needs parallelism_config dp_replicate_size x dp_shard_size on "
                f"accelerate FSDP2, computed from num_machines ({machines}) and num_processes ({processes}), "
                "which do not give it; no accelerate YAML written: use the bridge YAML (it shards within a node "
                "and replicates across nodes at run time)"
            )
            texts["fsdp_sharding_strategy"] = "not written: num_machines/num_processes missing; " + _SEE_BRIDGE
            _fill(m, texts)
            return None
        raw["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": replicate,
            "parallelism_config_dp_shard_size": shard,
        }
        strategy_text += (
            f" and parallelism_config dp_replicate_size={replicate}, dp_shard_size={shard} "
            "(HSDP: shard within a node, replicate across nodes); the sizes are fixed for this "
            "num_processes"
        )
    for key in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
        texts[key] = strategy_text

    for key in _CARRIED:
        if key in fsdp_in:
            out[key] = fsdp_in[key]
            texts[key] = f"{key}: kept"
    if "fsdp_state_dict_type" in fsdp_in:
        value = m.source.table_values.get("state_dict_type")
        out["fsdp_state_dict_type"] = "SHARDED_STATE_DICT" if value == "LOCAL_STATE_DICT" else value
        texts["fsdp_state_dict_type"] = f"fsdp_state_dict_type: {out['fsdp_state_dict_type']}" + (
            " (accelerate FSDP2 has no LOCAL_STATE_DICT)" if value == "LOCAL_STATE_DICT" else ""
        )

    prefetch_text = (
        "removed (accelerate FSDP2 has no backward_prefetch): FSDP2 always prefetches one unit, BACKWARD_PRE timing"
    )
    prefetch = cfg.backward_prefetch
    if prefetch is BackwardPrefetch.NONE:
        prefetch_text += (
            "; FSDP1 ran without backward prefetch, which accelerate's FSDP2 cannot express "
            "(the bridge YAML keeps it: backward_prefetch: none)"
        )
    elif prefetch is not BackwardPrefetch.PRE:
        name = prefetch.name if isinstance(prefetch, BackwardPrefetch) else f"a depth of {prefetch} units"
        prefetch_text += f"; FSDP1 ran with {name}, which FSDP2 cannot reproduce"
    texts["fsdp_backward_prefetch"] = texts["fsdp_backward_prefetch_policy"] = prefetch_text
    texts["fsdp_forward_prefetch"] = (
        "no equivalent: accelerate FSDP2 raises for forward_prefetch; dropped; the bridge YAML emulates it"
        if cfg.forward_prefetch
        else "removed (false is FSDP2's behaviour)"
    )
    texts["fsdp_use_orig_params"] = "removed: FSDP2 always uses the original parameters"
    texts["fsdp_sync_module_states"] = (
        "removed (accelerate FSDP2 rejects it); accelerate FSDP2 broadcasts rank 0's weights only with "
        "fsdp_cpu_ram_efficient_loading: true"
        + ("" if fsdp_in.get("fsdp_cpu_ram_efficient_loading") else "; set it if ranks build different initial weights")
    )
    if "mixed_precision" in raw:
        texts["mixed_precision"] = (
            f"mixed_precision: {raw['mixed_precision']} kept: accelerate FSDP2 sets "
            "MixedPrecisionPolicy(param, reduce, output dtype); it casts no buffers"
        )
    raw["fsdp_config"] = out
    _fill(m, texts)
    return raw


def _fill(m: Migration, texts: dict[str, str]) -> None:
    rows = []
    for row in m.report.rows:
        base = row.key.split(" (", 1)[0]
        rows.append(dataclasses.replace(row, accelerate=texts.get(base, "")) if base in texts else row)
    m.report.rows = rows
