"""The real FSDP2 ``shard()`` at 64, 512 and 1024 ranks (and HSDP 128 x 8), in this one process.

torch's fake process group lets this process be any rank of any world size; the model stays on
the meta device, so each case takes a fraction of a second.  Every case destroys its group.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from fsdp_bridge.backends.fsdp2 import local_shape
from fsdp_bridge.cli import main
from fsdp_bridge.config import BridgeConfig
from fsdp_bridge.errors import ConfigError
from fsdp_bridge.estimate import build_meta_model, fake_process_group, plan_at_scale

# Llama-7B widths with GQA (k/v: 8 heads x 128 = 1024 rows) and sizes that do not divide the
# shard counts: intermediate 11008 = 10.75 x 1024 and vocab 32001 leave the last ranks with a
# short chunk or none.  Two layers: every layer has the same shapes.
SPEC = (
    "llama:hidden_size=4096,intermediate_size=11008,num_hidden_layers=2,num_attention_heads=32,"
    "num_key_value_heads=8,vocab_size=32001"
)

CASES = [
    # (world size, strategy, hybrid_shape, ranks beyond the first and last)
    (64, "full_shard", None, ()),
    (512, "full_shard", None, (507, 508)),
    (1024, "full_shard", None, (1000,)),
    (1024, "hybrid_shard", (128, 8), (6, 1021)),
]


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Iterator[None]:
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("world", "strategy", "hybrid", "extra"),
    CASES,
    ids=[f"{w}-{s}" + (f"-{h[0]}x{h[1]}" if h else "") for w, s, h, _ in CASES],
)
def test_shard_plan_matches_estimate_exactly(
    world: int, strategy: str, hybrid: tuple[int, int] | None, extra: tuple[int, ...]
) -> None:
    config = BridgeConfig(backend="fsdp2", strategy=strategy, hybrid_shape=hybrid)
    ranks = (0, *extra, world - 1)
    plan = plan_at_scale(SPEC, config, world_size=world, ranks=ranks)
    assert plan.matches, "\n".join(plan.mismatches)

    shard = hybrid[1] if hybrid else world
    est = plan.estimate
    assert est.mesh == (hybrid or (world,)) and est.shard_size == shard
    full = {n: tuple(p.shape) for n, p in build_meta_model(SPEC).named_parameters()}
    for r in plan.ranks:
        assert r.rank in ranks and r.mesh == est.mesh
        assert r.shard_index == r.rank % shard
        assert sorted(r.units) == ["(root)", "model.layers.0", "model.layers.1"]
        # Local shapes are torch.chunk's on dim 0, checked independently of the estimator.
        for name, shape in full.items():
            chunks = torch.empty(shape[0], 0, device="meta").chunk(shard)
            rows = chunks[r.shard_index].shape[0] if r.shard_index < len(chunks) else 0
            assert r.local_shapes[name] == (rows, *shape[1:]), (r.rank, name)
        # Every rank allocates rank 0's chunk (FSDP2 pads): the estimator's bytes, exactly.
        assert r.allocated_bytes == est.params
        assert r.local_bytes <= est.params
    first, last = plan.ranks[0], plan.ranks[-1]
    assert first.local_bytes == est.params  # shard 0 is the fullest
    # Gradients are sharded like the parameters; AdamW: two states per element plus a step each.
    assert est.grads == est.params
    assert est.optimizer == 2 * est.params + 4 * len(full)
    if world == 1024 and not hybrid:
        # 11008 rows on 1024 ranks: 11 rows each up to rank 999, 8 on rank 1000, none after.
        assert local_shape((11008, 4096), 1024, 1000) == (8, 4096)
        assert last.local_shapes["model.layers.0.mlp.up_proj.weight"] == (0, 4096)
        assert last.local_shapes["model.layers.0.self_attn.k_proj.weight"] == (1, 4096)
        assert last.local_bytes < est.params


@pytest.mark.parametrize("rows", [1, 5, 6, 10, 127, 128, 129, 1024, 11008, 32001])
@pytest.mark.parametrize("shard", [1, 2, 3, 4, 8, 64, 1024])
def test_local_shape_is_torch_chunk(rows: int, shard: int) -> None:
    chunks = torch.empty(rows, 3, device="meta").chunk(shard)
    for index in range(shard):
        want = tuple(chunks[index].shape) if index < len(chunks) else (0, 3)
        assert local_shape((rows, 3), shard, index) == want
    assert sum(local_shape((rows, 3), shard, i)[0] for i in range(shard)) == rows
    assert local_shape((), shard, 0) == ()
    assert math.prod(local_shape((rows, 3), shard, 0)) * shard >= rows * 3


def test_plan_at_scale_refuses_what_it_cannot_plan() -> None:
    with pytest.raises(ConfigError, match=r"backend: got 'fsdp1'; allowed: fsdp2") as err:
        plan_at_scale(SPEC, BridgeConfig(backend="fsdp1"), world_size=0, ranks=[5])
    text = str(err.value)
    assert "world_size: got 0" in text and "ranks: got [5]" in text
    with torch.device("cpu"):
        real = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match=r"model: got 'Linear'; allowed: a model on the meta device"):
        plan_at_scale(real, BridgeConfig(backend="fsdp2"), world_size=8)
    with pytest.raises(ConfigError, match=r"nodes: got 3; allowed: a divisor of the world size \(8\)"):
        plan_at_scale(SPEC, BridgeConfig(backend="fsdp2"), world_size=8, nodes=3)


def test_fake_process_group_refuses_a_live_group_and_cleans_up() -> None:
    with fake_process_group(rank=5, world_size=16):
        assert (dist.get_rank(), dist.get_world_size()) == (5, 16)
        with pytest.raises(ConfigError, match=r"process group: got 'fake with 16 ranks'"):
            plan_at_scale(SPEC, BridgeConfig(backend="fsdp2"), world_size=8)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="boom"), fake_process_group(rank=0, world_size=4):
        raise RuntimeError("boom")
    assert not dist.is_initialized()


def test_cli_fake_world_checks_every_fsdp2_row(capsys: pytest.CaptureFixture[str]) -> None:
    spec = (
        "llama:hidden_size=256,intermediate_size=688,num_hidden_layers=2,num_attention_heads=4,"
        "num_key_value_heads=2,vocab_size=1001"
    )
    rc = main(
        [
            "estimate",
            spec,
            "--world-size",
            "512",
            "--nodes",
            "64",
            "--strategy",
            "full_shard,hybrid_shard",
            "--fake-world",
            "--activation-checkpointing",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "fake world: fsdp2 full_shard: shard() on ranks 0 and 511 of 512 = estimate" in out
    assert "fake world: fsdp2 hybrid_shard: shard() on ranks 0 and 511 of 512 = estimate" in out
    assert "fake world: fsdp1" not in out
    assert "fsdp_bridge: full_shard on fsdp2" not in out + err  # the planned ranks log no shard() report
    rc = main(
        [
            "estimate",
            spec,
            "--world-size",
            "64",
            "--backend",
            "fsdp2",
            "--strategy",
            "full_shard",
            "--fake-world",
            "--json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["fake_world"] == [
        {
            "backend": "fsdp2",
            "strategy": "full_shard",
            "ranks": [0, 63],
            "mesh": [64],
            "matches": True,
            "mismatches": [],
        }
    ]
