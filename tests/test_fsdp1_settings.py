"""fsdp_bridge.fsdp1_settings: what FSDP1's ``model.sharding_strategy`` / ``model.mixed_precision`` say, for a
model shard() returned and its units, the same on both backends (on fsdp1 they are FSDP1's own attributes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

import fsdp_bridge
from fsdp_bridge import BridgeConfig


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 2))


def _blocks(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return recurse or isinstance(module, nn.Sequential)


CASES: dict[str, dict[str, Any]] = {
    "full": {},
    "zero2_bf16": {
        "sharding_strategy": ShardingStrategy.SHARD_GRAD_OP,
        "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    },
    "replicated": {"sharding_strategy": ShardingStrategy.NO_SHARD},
    "hybrid": {"sharding_strategy": ShardingStrategy.HYBRID_SHARD},
}


def _answers() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case, kwargs in CASES.items():
        for backend in ("fsdp1", "fsdp2"):
            config = BridgeConfig.from_fsdp1(
                backend=backend, auto_wrap_policy=_blocks, device_id=torch.device("cpu"), **kwargs
            )
            model = fsdp_bridge.shard(_net(), config)
            seen = []
            for module in (model, model[1]):
                settings = fsdp_bridge.fsdp1_settings(module)
                mp = settings.mixed_precision
                seen.append((settings.sharding_strategy.name, mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype))
            out[f"{case} {backend}"] = seen
    # modules torch's own fully_shard sharded (code migrated with --target torch keeps fsdp1_settings)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    for name, shape, reshard in (
        ("full", (2,), True),
        ("zero2", (2,), False),
        ("hybrid", (1, 2), True),
        ("replicated", (2, 1), True),
    ):
        net = _net()
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape) :])
        fully_shard(net[1], mesh=mesh, reshard_after_forward=reshard)
        fully_shard(net, mesh=mesh, reshard_after_forward=False)  # a root kept gathered, as FSDP1's and the helpers'
        out[f"torch {name}"] = [fsdp_bridge.fsdp1_settings(m).sharding_strategy.name for m in (net, net[1])]
    return out


def test_both_backends_answer_what_fsdp1_says(run_on_ranks: Any) -> None:
    for answers in run_on_ranks(_answers, world_size=2):
        for case in CASES:
            # on fsdp1 the model is FSDP1's wrapper: its own attributes are FSDP1's answer
            assert answers[f"{case} fsdp2"] == answers[f"{case} fsdp1"], case
        assert answers["full fsdp2"][0] == ("FULL_SHARD", None, None, None)
        assert answers["zero2_bf16 fsdp2"][1] == ("SHARD_GRAD_OP", torch.bfloat16, torch.float32, None)
        assert answers["torch full"] == ["FULL_SHARD"] * 2 and answers["torch zero2"] == ["SHARD_GRAD_OP"] * 2
        assert answers["torch hybrid"] == ["HYBRID_SHARD"] * 2 and answers["torch replicated"] == ["NO_SHARD"] * 2


def test_another_object_gives_its_own_attribute_as_the_read_did() -> None:
    # a stand-in with the attribute (a test's mock of the wrapper) keeps working; a module without it raises
    # AttributeError as the original read did
    stand_in = type("StandIn", (), {"sharding_strategy": "mine"})()
    assert fsdp_bridge.fsdp1_settings(stand_in).sharding_strategy == "mine"
    with pytest.raises(AttributeError, match="mixed_precision"):
        _ = fsdp_bridge.fsdp1_settings(nn.Linear(2, 2)).mixed_precision
