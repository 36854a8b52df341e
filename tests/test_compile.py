"""``compile``: each wrap unit compiled before sharding trains like eager on both backends.

One spawn of 2 gloo ranks, both backends, a tiny Llama: inductor compiles on CPU with the system C++
compiler. Marked slow: the first compile of the two backends' units takes minutes on 2 shared cores
(inductor caches under the temp directory afterwards).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdp_bridge
from fsdp_bridge import BridgeConfig
from fsdp_bridge.testing import TOLERANCES
from fsdp_bridge.testing.models import build_tiny, sample_batch

pytestmark = pytest.mark.slow


def _losses(config: BridgeConfig, steps: int = 3) -> list[float]:
    model = fsdp_bridge.shard(build_tiny("llama", seed=0), config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss = model(**sample_batch("llama", seed=100 * step + dist.get_rank())).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _compiled_and_eager() -> dict[str, list[float]]:
    out = {}
    for backend in ("fsdp1", "fsdp2"):
        eager = BridgeConfig(backend=backend, device="cpu")
        out[f"{backend}/eager"] = _losses(eager)
        out[f"{backend}/compile"] = _losses(eager.replace(compile=True))
    return out


def test_compiled_units_give_the_eager_losses_on_both_backends(run_on_ranks) -> None:
    result = run_on_ranks(_compiled_and_eager, 2, timeout_s=900)[0]
    tol = TOLERANCES["fp32"]
    for backend in ("fsdp1", "fsdp2"):
        eager, compiled = result[f"{backend}/eager"], result[f"{backend}/compile"]
        torch.testing.assert_close(compiled, eager, rtol=tol.loss_rtol, atol=tol.loss_atol)
        assert len(set(eager)) == len(eager)  # three different steps, not one loss repeated
