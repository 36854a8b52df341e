"""Distributed tests of your own model with the fsdp_bridge pytest plugin: copy this file.

    pytest examples/test_user_parity.py                       # CPU, gloo, 2 ranks per test
    pytest examples/test_user_parity.py --fsdp-backends fsdp2  # one backend only

The plugin is installed with fsdp-bridge (pytest11 entry point); nothing to configure.
Replace build_model() and batches() with your model and data.  Test functions that run
on ranks must live at module level (they are pickled by reference into the ranks).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_bridge import BridgeConfig, shard
from fsdp_bridge.testing import assert_backend_parity, rank_batches
from fsdp_bridge.testing.models import build_tiny


def build_model() -> torch.nn.Module:
    """Your model; the same call must give the same architecture on every rank."""
    return build_tiny("llama", seed=0)


# 1. FSDP1 and FSDP2 train the model like a non-sharded replica with averaged gradients.
@pytest.mark.distributed(world_size=2)
def test_backends_train_alike():
    report = assert_backend_parity(
        build_model,
        rank_batches("llama", steps=2),  # this rank's batches, one per step
        BridgeConfig(strategy="full_shard", device="cpu"),
        reference=True,
    )
    # assert_backend_parity already failed the test if any pair diverged; the report has the numbers.
    pair = report.pair("fsdp2/full_shard", "fsdp1/full_shard")
    assert pair.ok and pair.max_param_diff is not None


# 2. One body, every backend: fsdp_backend is parametrised by the plugin (--fsdp-backends).
@pytest.mark.distributed(world_size=2)
def test_forward_matches_unsharded(fsdp_backend):
    batch = rank_batches("llama", steps=1)[0]
    expected = build_model()(**batch).logits
    model = shard(build_model(), BridgeConfig(backend=fsdp_backend, device="cpu"))
    torch.testing.assert_close(model(**batch).logits, expected)


# 3. Several checks in one spawn: run_on_ranks runs a module-level function on N ranks.
def _world_and_rank() -> tuple[int, int]:
    return dist.get_world_size(), dist.get_rank()


def test_run_on_ranks(run_on_ranks):
    assert run_on_ranks(_world_and_rank, 2) == [(2, 0), (2, 1)]
