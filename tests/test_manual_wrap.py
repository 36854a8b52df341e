"""fsdp_bridge.enable_wrap / wrap_module: FSDP1's manual wrapping (enable_wrap + wrap) on both backends."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_bridge
from fsdp_bridge import Backend, BridgeConfig, ConfigError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def test_outside_the_context_wrap_module_returns_the_module_and_contexts_do_not_nest() -> None:
    from torch.distributed.fsdp.wrap import wrap as torch_wrap

    net = Net()
    assert fsdp_bridge.wrap_module(net) is net  # FSDP1's wrap outside enable_wrap: no-op
    with fsdp_bridge.enable_wrap(BridgeConfig()) as ctx:
        assert isinstance(ctx, fsdp_bridge.ManualWrap)
        with pytest.raises(ConfigError, match=r"enable_wrap: .*one enable_wrap context at a time.*NotImplementedError"):
            with fsdp_bridge.enable_wrap(BridgeConfig()):
                pass
        with pytest.raises(TypeError, match=r"wrap_module takes an nn.Module \(got NoneType\)"):
            fsdp_bridge.wrap_module(None)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"wrap: got \"torch's wrap\(module, sharding_strategy=...\)\""):
            torch_wrap(net, sharding_strategy=None)  # per-module overrides: refused, never silently dropped
    assert fsdp_bridge.wrap_module(net) is net and torch_wrap(net) is net  # both contexts are closed
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import enable_wrap

    with enable_wrap(wrapper_cls=FullyShardedDataParallel):  # a half-migrated file would leave it unsharded
        with pytest.raises(ConfigError, match=r"wrap_module: got \"called inside torch's enable_wrap\""):
            fsdp_bridge.wrap_module(net)
    with pytest.raises(TypeError, match=r"config must be a BridgeConfig \(got dict\).*from_fsdp1\(\*\*fsdp_kwargs\)"):
        fsdp_bridge.enable_wrap({"sharding_strategy": "FULL_SHARD"})  # type: ignore[arg-type]


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    with fsdp_bridge.summon_full_params(model):
        return {
            n.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", ""): p.detach().clone()
            for n, p in model.named_parameters()
        }


def _units_then_root() -> dict[str, Any]:
    from torch.distributed.fsdp.wrap import wrap

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for backend in Backend:
        torch.manual_seed(100)
        reference = {n: p.detach().clone() for n, p in Net().named_parameters()}  # rank 0's weights
        torch.manual_seed(100 + rank)  # every rank builds other weights: sync_module_states must fix them
        net = Net()
        config = BridgeConfig.from_fsdp1(backend=backend, sync_module_states=True, device_id=torch.device("cpu"))
        with fsdp_bridge.enable_wrap(config) as ctx:
            first = fsdp_bridge.wrap_module(net.blocks[0])
            again = fsdp_bridge.wrap_module(first)
            net.blocks = nn.ModuleList([first, *(fsdp_bridge.wrap_module(b) for b in net.blocks[1:])])
            net.head = ctx.wrap(net.head)
            net.norm = wrap(net.norm)  # torch's own wrap (code not migrated) shards through the context too
        unit_mesh = ctx.mesh
        try:
            fsdp_bridge.shard(net, BridgeConfig(backend=backend, wrap="auto", sync_module_states=True))
            refused = ""
        except ConfigError as err:
            refused = str(err)
        model = fsdp_bridge.shard(net, config)
        bridge = fsdp_bridge.get_bridge(model)
        full = _full_params(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).square().mean()
        loss.backward()
        norm = fsdp_bridge.clip_grad_norm_(model, 1e9)
        optimizer.step()
        out[backend.value] = {
            "torch_wrap": fsdp_bridge.get_bridge(net.norm).config == config,
            "idempotent": again is first,
            "same_mesh": unit_mesh is not None and fsdp_bridge.get_bridge(first).mesh is unit_mesh,
            "synced": sorted(full) == sorted(reference) and all(torch.equal(full[n], reference[n]) for n in full),
            "units": bridge.wrap.units,
            "notes": bridge.wrap.notes,
            "refused": refused,
            "norm": float(norm),
        }
    return out


def test_units_take_rank0_weights_and_a_root_keeps_them(run_on_ranks) -> None:
    results = run_on_ranks(_units_then_root, 2)
    for backend in ("fsdp1", "fsdp2"):
        for result in results:
            r = result[backend]
            assert r["idempotent"] and r["same_mesh"] and r["synced"] and r["torch_wrap"], (backend, r)
            assert r["units"] == []  # the root's own wrap plan: the manual units are kept as they are
            assert "5 units sharded already by fsdp_bridge.wrap_module kept as they are: blocks.0," in r["notes"][0]
            assert "wrap: got 'auto'" in r["refused"] and "FSDP1 refuses auto-wrapping" in r["refused"], r
            assert "blocks.0, blocks.1, blocks.2, ..." in r["refused"], r
        assert results[0][backend]["norm"] == pytest.approx(results[1][backend]["norm"])  # one global norm


def _reshard_decisions() -> dict[str, str]:
    from torch.distributed.tensor import DTensor

    def after_forward(module: nn.Module) -> str:  # sharded again after forward, or still gathered
        return "resharded" if isinstance(next(module.parameters()), DTensor) else "gathered"

    out: dict[str, str] = {}
    config = BridgeConfig(wrap="none", device="cpu")
    net = Net()
    with fsdp_bridge.enable_wrap(config):
        net.embed = fsdp_bridge.wrap_module(net.embed)
        net.head = fsdp_bridge.wrap_module(fsdp_bridge.wrap_module(net.head))
    loss = net(torch.randn(2, 8)).sum()
    out["single"], out["double"] = after_forward(net.embed), after_forward(net.head)
    loss.backward()
    net = Net()
    with fsdp_bridge.enable_wrap(config):
        net.embed = fsdp_bridge.wrap_module(net.embed)
    model = fsdp_bridge.shard(net, config)
    model(torch.randn(2, 8)).sum().backward()
    loss = model(torch.randn(2, 8)).sum()
    out["under a root"], out["the root"] = after_forward(model.embed), after_forward(model.head)
    loss.backward()

    net = Net()
    with fsdp_bridge.enable_wrap(BridgeConfig(backend="fsdp1", wrap="none", device="cpu")):
        net.head = fsdp_bridge.wrap_module(net.head)
    try:
        fsdp_bridge.shard(net, BridgeConfig(backend="fsdp2", wrap="none", device="cpu"))
        out["mixed"] = "no error"
    except ConfigError as err:
        out["mixed"] = str(err)
    return out


def test_units_reshard_as_fsdp1_decides_and_one_backend_is_required(run_on_ranks) -> None:
    # Two ranks: on a shard group of one every unit reshards (nothing to communicate), whatever FSDP1 does.
    for result in run_on_ranks(_reshard_decisions, 2):
        # FSDP1: a lone unit is a root and keeps its parameters for backward; wrap(wrap(m))'s inner unit
        # and a unit under a root free them after forward
        assert result["single"] == "gathered" and result["double"] == "resharded", result
        assert result["under a root"] == "resharded" and result["the root"] == "gathered", result
        message = result["mixed"]
        assert "backend: got 'fsdp2'; allowed: fsdp1, the backend of the submodules sharded already (head)" in message
        assert "shard the units and the model on one backend" in message
