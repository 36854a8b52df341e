"""FSDP on the data-parallel sub-mesh of a (dp, tp) mesh, tensor parallel on the other dimension."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp_bridge
from fsdp_bridge import BridgeConfig, ConfigError
from fsdp_bridge.migrate._torch_helpers import HELPERS_NAME, HELPERS_SOURCE


class FeedForward(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(FeedForward() for _ in range(2))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _tp_model(tp_mesh: Any) -> Net:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _train(model: nn.Module, dp_rank: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(42 + dp_rank)  # the same batch across a tp group
    losses = []
    for _ in range(3):
        x, y = torch.randn(4, 16, generator=g), torch.randint(0, 3, (4,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _dp_tp() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    out: dict[str, Any] = {}
    plain = _tp_model(tp)
    for block in plain.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(plain, mesh=dp)
    out["plain"] = _train(plain, dp.get_local_rank())
    for backend in ("fsdp1", "fsdp2"):
        bridged = fsdp_bridge.shard(_tp_model(tp), BridgeConfig(backend=backend, wrap=["FeedForward"]), mesh=dp)
        out[backend] = _train(bridged, dp.get_local_rank())
    # sync_module_states on the sub-mesh: each dp group takes its first rank's weights (FSDP1's meaning
    # for its process group), every tp rank keeping its own slice.
    drifted = _tp_model(tp)
    if dp.get_local_rank() != 0:
        with torch.no_grad():
            for p in drifted.parameters():
                (p.to_local() if isinstance(p, DTensor) else p).add_(0.5)
    synced = fsdp_bridge.shard(drifted, BridgeConfig(wrap=["FeedForward"], sync_module_states=True), mesh=dp)
    out["synced"] = _train(synced, dp.get_local_rank())
    # clipping over gradients on two meshes ((dp, tp) for the tensor-parallel weights, dp for the rest): the
    # global norm, on the bridge's FSDP2 model, torch's own fully_shard model and --target torch's helper
    helpers = types.ModuleType(HELPERS_NAME)
    exec(compile(HELPERS_SOURCE, f"{HELPERS_NAME}.py", "exec"), helpers.__dict__)
    for name, clip, model in (
        (
            "bridge",
            fsdp_bridge.clip_grad_norm_,
            fsdp_bridge.shard(_tp_model(tp), BridgeConfig(wrap=["FeedForward"]), mesh=dp),
        ),
        ("torch", fsdp_bridge.clip_grad_norm_, _tp_model(tp)),
        ("helpers", helpers.clip_grad_norm_, _tp_model(tp)),
    ):
        if name != "bridge":
            for block in model.blocks:
                fully_shard(block, mesh=dp)
            fully_shard(model, mesh=dp)
        g = torch.Generator().manual_seed(42 + dp.get_local_rank())
        nn.functional.cross_entropy(
            model(torch.randn(4, 16, generator=g)), torch.randint(0, 3, (4,), generator=g)
        ).backward()
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
        reference = torch.stack([g.float().norm() for g in grads]).norm()
        norm = clip(model, 0.05)
        clipped = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
        out[f"clip {name}"] = (
            float(norm),
            float(reference),
            max(float((c - g * 0.05 / (reference + 1e-6)).abs().max()) for c, g in zip(clipped, grads, strict=True)),
        )
    # NO_SHARD over FSDP1's process group of one model-parallel slice ({0, 2} and {1, 3}: disjoint groups of part
    # of the world): its replicate mesh is made on every rank alike (each slice's own calls hung), and trains as
    # FULL_SHARD over the same ranks does
    slices = []
    for strategy, mesh in (("no_shard", fsdp_bridge.mesh_from_process_group(dp.get_group())), ("full_shard", dp)):
        torch.manual_seed(0)
        slices.append(_train(fsdp_bridge.shard(Net(), BridgeConfig(strategy=strategy), mesh=mesh), dp.get_local_rank()))
    out["no_shard_slices"] = slices
    try:
        fsdp_bridge.shard(_tp_model(tp), BridgeConfig(strategy="hybrid_shard"), mesh=dp)
    except ConfigError as err:
        out["hybrid_error"] = str(err)
    dist.barrier()
    return out


def test_fsdp_on_the_dp_sub_mesh_of_a_tensor_parallel_model(run_on_ranks) -> None:
    for r in run_on_ranks(_dp_tp, 4):
        torch.testing.assert_close(r["fsdp2"], r["plain"], rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(r["fsdp1"], r["plain"], rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(r["synced"], r["plain"], rtol=1.3e-6, atol=1e-5)
        assert "mesh: got 'DeviceMesh(2,)'; allowed: a 2D (replicate, shard) data-parallel mesh" in r["hybrid_error"]
        no_shard, full_shard = r["no_shard_slices"]
        torch.testing.assert_close(no_shard, full_shard, rtol=1.3e-6, atol=1e-5)
        for name in ("bridge", "torch", "helpers"):
            norm, reference, gap = r[f"clip {name}"]
            assert norm == pytest.approx(reference, rel=1e-5) and gap < 1e-6, (name, norm, reference, gap)
