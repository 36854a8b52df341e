"""Ranks that ask shard() for different things all raise the same error, naming what differs."""

from __future__ import annotations

import torch.distributed as dist

import fsdp_bridge
from fsdp_bridge import BridgeConfig, ConfigError
from fsdp_bridge.testing.models import build_tiny


def _disagreeing_ranks() -> dict[str, str]:
    rank = dist.get_rank()
    cases = {
        "strategy": (BridgeConfig(strategy="full_shard"), BridgeConfig(strategy="no_shard"), {}),
        "backend": (BridgeConfig(backend="fsdp1"), BridgeConfig(backend="fsdp2"), {}),
        "model": (BridgeConfig(), BridgeConfig(), {"hidden_size": 48}),
    }
    out = {}
    for name, (config0, config1, sizes) in cases.items():
        model = build_tiny("llama", seed=0, **(sizes if rank == 1 else {}))
        try:
            fsdp_bridge.shard(model, config0 if rank == 0 else config1)
            out[name] = "no error"
        except ConfigError as err:
            out[name] = str(err)
    fsdp_bridge.shard(build_tiny("llama", seed=0), BridgeConfig())  # the group is still usable
    return out


def test_ranks_that_disagree_raise_the_same_error_naming_the_difference(run_on_ranks) -> None:
    r0, r1 = run_on_ranks(_disagreeing_ranks, 2)
    assert r0 == r1  # the same error on every rank
    assert "ranks disagree on config.strategy: got 'rank 0: full_shard; rank 1: no_shard'" in r0["strategy"]
    assert "ranks disagree on config.backend: got 'rank 0: fsdp1; rank 1: fsdp2'" in r0["backend"]
    assert "ranks disagree on model.parameters" in r0["model"]
    assert "every rank must call shard() with the same config and the same model" in r0["model"]
