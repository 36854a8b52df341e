"""fsdp_bridge.no_sync / clip_grad_norm_ / summon_full_params on modules shard() did not make.

Migrated code calls them where the original called the module's own method, and in code written for
several backends the module may be DDP, torch's own ``fully_shard``, FSDP1 made by torch, or plain:
each gets what its own call does. Dispatch is checked in one process; numerics at 2 gloo ranks (one spawn),
with fsdp_bridge.GradScaler's overflow agreement on both backends.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import fsdp_bridge
from fsdp_bridge import BridgeConfig, ConfigError, ShardedModule


class _LocalDDP(DistributedDataParallel):
    """A DDP module without a process group: its own no_sync() only flips a flag."""

    def __init__(self, module: nn.Module) -> None:
        nn.Module.__init__(self)
        self.module = module
        self.require_backward_grad_sync = True


class _Recording(FSDPModule):
    """What torch's fully_shard makes a module (an FSDPModule), recording set_requires_gradient_sync."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        self.sync_calls.append(requires_gradient_sync)


def _unit() -> Any:
    module = nn.Linear(2, 2)
    module.__class__ = type("FSDPLinear", (_Recording, nn.Linear), {})
    module.sync_calls = []
    return module


def _with_grads(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.grad = torch.full_like(p, 3.0)
    return module


def test_ddp_gets_its_own_no_sync_and_torchs_clip() -> None:
    ddp = _LocalDDP(_with_grads(nn.Linear(3, 2)))
    with fsdp_bridge.no_sync(ddp):
        assert ddp.require_backward_grad_sync is False
    assert ddp.require_backward_grad_sync is True
    reference = _with_grads(nn.Linear(3, 2))
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    assert torch.equal(fsdp_bridge.clip_grad_norm_(ddp, 1.0), expected)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ddp.parameters(), reference.parameters(), strict=True))
    with fsdp_bridge.summon_full_params(ddp):  # full already: nothing to do
        assert all(type(p) is nn.Parameter for p in ddp.parameters())


def test_plain_module_gets_nothing_to_sync_and_torchs_clip() -> None:
    model = _with_grads(nn.Linear(3, 2))
    with fsdp_bridge.no_sync(model):
        pass
    norm = fsdp_bridge.clip_grad_norm_(model, 0.5, norm_type=float("inf"))
    assert norm.item() == 3.0 and torch.allclose(model.weight.grad, torch.full((2, 3), 0.5), atol=1e-5)
    before = [p.detach().clone() for p in model.parameters()]
    # the block runs in the caller's grad mode, as FSDP1's: an in-place change of a parameter needs no_grad there
    with fsdp_bridge.summon_full_params(model, writeback=True, with_grads=True), torch.no_grad():
        model.weight.add_(1.0)
    assert torch.equal(model.weight, before[0] + 1.0)


def test_a_state_dict_type_block_covers_the_module_inside_torch_compiles_wrapper() -> None:
    # FSDP1 code unwraps the model inside the block (unwrap_model(model).state_dict()): torch.compile's wrapper
    # hands over _orig_mod, whose state dict takes the block's type too, and is its own again after the block
    inner = nn.Linear(3, 2)
    compiled = nn.Module()
    compiled.add_module("_orig_mod", inner)
    own = inner.state_dict()
    with fsdp_bridge.state_dict_type(compiled, "FULL_STATE_DICT"):
        assert "state_dict" in inner.__dict__ and "state_dict" in compiled.__dict__
        full = inner.state_dict()
    assert "state_dict" not in inner.__dict__ and "state_dict" not in compiled.__dict__
    assert sorted(full) == sorted(own) and all(torch.equal(full[k], own[k]) for k in own)


def test_torchs_state_dict_api_reads_the_modules_own_state_dict_under_a_persistent_type() -> None:
    # fsdp_bridge.set_state_dict_type installs the type's state_dict on the module; torch's get_model_state_dict
    # calls module.state_dict() inside, and took the installed one (a FULL rank0_only type gave it an empty dict on
    # every rank but 0, and torch raised there). On FSDP1 torch's options override a persistent type: torch's API
    # gets the module's own method; the user's own model.state_dict() still gets the type's.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import ShardedStateDictConfig, StateDictType

    from fsdp_bridge.backends import fsdp1_objects

    model = nn.Linear(3, 2)
    asked: list[bool] = []
    real = fsdp1_objects._called_by_torchs_api

    def recording() -> bool:
        answer = real(depth=3)  # one frame more: this recording function
        asked.append(answer)
        return answer

    with (
        fsdp_bridge.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()),
        mock.patch.object(fsdp1_objects, "_called_by_torchs_api", recording),
    ):
        theirs = get_model_state_dict(model)
        mine = model.state_dict()
    assert asked == [True, False], asked
    assert sorted(theirs) == sorted(mine) == ["bias", "weight"]


def test_a_full_optimizer_state_keeps_fsdp1s_optimizer_config() -> None:
    # FSDP1's FullOptimStateDictConfig() (also when a block or set_state_dict_type gives none) is a CPU copy on
    # every rank, gathered one tensor at a time: not torch's full_state_dict options (the whole state on every GPU)
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType

    from fsdp_bridge.backends import fsdp1_objects

    model = _with_grads(nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    full = StateDictType.FULL_STATE_DICT
    calls: list[tuple[bool, bool]] = []

    def recording(model: nn.Module, optim: Any, *, rank0_only: bool, offload_to_cpu: bool) -> dict[str, Any]:
        calls.append((rank0_only, offload_to_cpu))
        return {}

    with mock.patch.object(fsdp1_objects, "full_optim_state_dict", recording):
        fsdp_bridge.optim_state_dict(model, opt)  # no type set: FSDP1's default
        with fsdp_bridge.state_dict_type(model, full, FullStateDictConfig(rank0_only=True)):
            fsdp_bridge.optim_state_dict(model, opt)
        with fsdp_bridge.state_dict_type(
            model, full, None, FullOptimStateDictConfig(rank0_only=True, offload_to_cpu=False)
        ):
            fsdp_bridge.optim_state_dict(model, opt)
    assert calls == [(False, True), (False, True), (True, False)]
    state = fsdp_bridge.optim_state_dict(model, opt)
    assert sorted(state["state"]) == ["bias", "weight"] and state["state"]["weight"]["exp_avg"].device.type == "cpu"


def test_a_rank0_only_full_state_block_gives_the_state_to_each_groups_first_rank() -> None:
    # FSDP1's rank0_only is the first rank of the group the model is sharded over (each model-parallel slice's
    # data-parallel group saves its slice); torch's cpu_offload would give it to world rank 0 alone
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType

    from fsdp_bridge.backends import fsdp1_objects

    model = nn.Linear(3, 2)
    full = StateDictType.FULL_STATE_DICT
    for first, offload in ((True, True), (False, True), (True, False)):
        config = FullStateDictConfig(rank0_only=True, offload_to_cpu=offload)
        with mock.patch.object(fsdp1_objects, "_keeps_full_state", lambda m, first=first: first):
            with fsdp_bridge.state_dict_type(model, full, config):
                state = model.state_dict()
        if not first:
            assert state == {}
            continue
        assert sorted(state) == ["bias", "weight"] and torch.equal(state["weight"], model.weight)
        assert state["weight"].device.type == "cpu" and not state["weight"].requires_grad


class _OwnSwitch(nn.Module):
    """Another library's module (a jitted module) with a no_sync() of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)
        self.syncing = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True


class _Forwarding(nn.Module):
    """A wrapper that hands names it does not define to the module inside it, as torch.compile's does."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._orig_mod = inner

    def __getattr__(self, name: str) -> Any:
        if name == "_orig_mod":
            return super().__getattr__(name)
        return getattr(self._orig_mod, name)


def test_a_module_with_its_own_no_sync_gets_that() -> None:
    own = _OwnSwitch()
    with fsdp_bridge.no_sync(own):
        assert own.syncing is False
    assert own.syncing is True
    ddp = _LocalDDP(nn.Linear(3, 2))
    with fsdp_bridge.no_sync(_Forwarding(ddp)):  # torch.compile(DDP(m)).no_sync() is DDP's
        assert ddp.require_backward_grad_sync is False
    assert ddp.require_backward_grad_sync is True
    with fsdp_bridge.no_sync(_Forwarding(nn.Linear(2, 2))):  # nothing inside to stop: nothing to do
        pass


class _OwnClip(nn.Linear):
    """A wrapper with its own clipping (fairscale's FullyShardedDataParallel takes the global norm itself)."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self.clipped = (max_norm, norm_type)
        return torch.tensor(7.0)


def test_a_module_with_its_own_clip_gets_that() -> None:
    own = _OwnClip(2, 2)
    own.weight.grad = torch.full_like(own.weight, 100.0)
    assert fsdp_bridge.clip_grad_norm_(own, 1.0, 3.0).item() == 7.0
    assert own.clipped == (1.0, 3.0) and own.weight.grad.eq(100.0).all()  # not torch's clip over its parameters


def test_fsdp1_made_by_torch_gets_its_own_methods() -> None:
    fsdp1 = mock.MagicMock(spec=FullyShardedDataParallel)
    fsdp1.clip_grad_norm_.return_value = torch.tensor(2.0)
    assert fsdp_bridge.no_sync(fsdp1) is fsdp1.no_sync.return_value
    assert fsdp_bridge.clip_grad_norm_(fsdp1, 1.0, norm_type=1.0).item() == 2.0
    fsdp1.clip_grad_norm_.assert_called_once_with(1.0, 1.0)
    # torch.compile(FSDP(m)).clip_grad_norm_(n) reached FSDP1's through the compiled wrapper: so does the bridge's
    compiled = nn.Module()
    compiled.add_module("_orig_mod", fsdp1)
    assert fsdp_bridge.clip_grad_norm_(compiled, 0.5).item() == 2.0
    fsdp1.clip_grad_norm_.assert_called_with(0.5, 2.0)


def test_fully_shard_modules_stop_gradient_sync_and_take_it_up_again() -> None:
    unit = _unit()
    with fsdp_bridge.no_sync(unit):
        assert unit.sync_calls == [False]
    assert unit.sync_calls == [False, True]
    # fully_shard on the children only: each outermost unit, as each one's own call would
    holder = nn.Sequential(_unit(), nn.Sequential(_unit()))
    with pytest.raises(RuntimeError, match="inside"), fsdp_bridge.no_sync(holder):
        raise RuntimeError("inside")  # restored on the way out of an error too
    assert [holder[0].sync_calls, holder[1][0].sync_calls] == [[False, True], [False, True]]


def test_ema_update_skips_frozen_parameters_and_refuses_models_that_do_not_pair() -> None:
    """One process: the average over the trainable parameters only, in the EMA's dtype; two models whose
    parameters do not pair shard with shard are refused before anything is written."""
    ema, model = _net(1).double(), _net(2)
    model[0].bias.requires_grad_(False)
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    fsdp_bridge.ema_update_(ema, model, 0.75)
    after, new = ema.state_dict(), model.state_dict()
    assert torch.equal(after["0.bias"], before["0.bias"])  # frozen in the model: its average is kept
    for name in ("0.weight", "2.0.weight", "3.bias"):
        assert after[name].dtype == torch.float64
        assert torch.allclose(after[name], 0.75 * before[name] + 0.25 * new[name].double())
    model.requires_grad_(False)
    fsdp_bridge.ema_update_(ema, model, 0.5)  # nothing trains: nothing to average
    assert all(torch.equal(ema.state_dict()[k], after[k]) for k in after)
    with pytest.raises(ValueError, match=r"EMA model has 6 parameters and the model 4.*same call as the model"):
        fsdp_bridge.ema_update_(ema, nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), 0.9)
    other = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Sequential(nn.Linear(16, 8), nn.Tanh()), nn.Linear(8, 4))
    with pytest.raises(
        ValueError, match=r"'2.0.weight' holds a shard of shape \(16, 16\).*'2.0.weight' one of \(8, 16\)"
    ):
        fsdp_bridge.ema_update_(ema, other, 0.9)
    assert all(torch.equal(ema.state_dict()[k], after[k]) for k in after)


def test_a_module_holding_fsdp1_wrappers_is_refused_with_the_fix_for_clipping() -> None:
    class Wrapper(FullyShardedDataParallel):
        def __init__(self) -> None:
            nn.Module.__init__(self)

    holder = nn.Sequential(nn.Linear(2, 2))
    holder.add_module("inner", Wrapper())
    with pytest.raises(ConfigError, match=r"clip_grad_norm_: got 'Sequential holding FullyShardedDataParallel.*root"):
        fsdp_bridge.clip_grad_norm_(holder, 1.0)


# -- numerics at 2 gloo ranks: DDP and torch's fully_shard against their own calls ---------------------------


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4))


def _accumulate_and_clip(model: nn.Module, ours: bool, rank: int) -> tuple[list[torch.Tensor], float]:
    """Two micro-batches, the first without sync, then a clip: through fsdp_bridge or the module's own calls."""
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)]
    if ours:
        with fsdp_bridge.no_sync(model):
            model(batches[0]).square().mean().backward()
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            model(batches[0]).square().mean().backward()
    else:
        assert isinstance(model, FSDPModule)
        model.set_requires_gradient_sync(False)
        model(batches[0]).square().mean().backward()
        model.set_requires_gradient_sync(True)
    model(batches[1]).square().mean().backward()
    if ours:
        norm = fsdp_bridge.clip_grad_norm_(model, 0.05)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    if isinstance(norm, torch.distributed.tensor.DTensor):
        norm = norm.full_tensor()
    assert type(norm) is torch.Tensor  # a plain tensor, as FSDP1 returns it
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone() for p in model.parameters()]
    return grads, norm.item()


def _numerics() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for kind in ("ddp", "fully_shard"):
        runs = []
        for ours in (True, False):
            model = _net()
            if kind == "ddp":
                model = DistributedDataParallel(model)
            else:
                fully_shard(model[2])
                fully_shard(model)
            runs.append(_accumulate_and_clip(model, ours, rank))
        (grads, norm), (ref_grads, ref_norm) = runs
        out[kind] = (norm, ref_norm, all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True)))
    # summon_full_params on torch's fully_shard: full tensors inside, shards again after.
    model = _net()
    fully_shard(model)
    with fsdp_bridge.summon_full_params(model):
        out["summoned"] = [tuple(p.shape) for p in model.parameters() if type(p) is nn.Parameter]
    # is_sharded (what migrated code's isinstance(m, FSDP) became): torch's own fully_shard and DDP are not
    out["is_sharded_torch"] = (fsdp_bridge.is_sharded(model), fsdp_bridge.is_sharded(DistributedDataParallel(_net())))
    out["sharded_module_torch"] = (isinstance(model, ShardedModule), issubclass(type(model), ShardedModule))
    # The same spawn checks from_fsdp1's FSDP1 values on FSDP2 (test_from_fsdp1.py checks them in one process)
    # and what summon_full_params does to parameter objects taken before it.
    from torch.distributed.fsdp import BackwardPrefetch

    losses = []
    for kwargs in ({}, {"backward_prefetch": None}):
        model = fsdp_bridge.shard(_net(), BridgeConfig.from_fsdp1(auto_wrap_policy=_blocks, **kwargs))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            model(
                torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 10 + step))
            ).square().mean().backward()
            opt.step()
            opt.zero_grad()
        losses.append(model(torch.ones(2, 8)).sum().item())
        out["is_sharded_units"] = [name for name, m in model.named_modules() if fsdp_bridge.is_sharded(m)]
    out["prefetch_none_losses"] = losses
    del BackwardPrefetch
    net = _net()
    head = net[3]
    model = fsdp_bridge.shard(net, BridgeConfig.from_fsdp1(ignored_modules=[head, nn.Linear(1, 1)]))
    out["ignored"] = (fsdp_bridge.get_bridge(model).config.ignored_modules, type(head.weight).__name__)
    identity = {}
    for backend in ("fsdp2", "fsdp1"):
        model = fsdp_bridge.shard(_net(), BridgeConfig(backend=backend, wrap="none", device="cpu"))
        held = list(model.parameters())
        with fsdp_bridge.summon_full_params(model):
            inside = list(model.parameters())
            identity[backend] = (all(a is b for a, b in zip(held, inside, strict=True)), tuple(held[0].shape))
        out[f"is_sharded_{backend}"] = fsdp_bridge.is_sharded(model)
        # what migrated code's FSDP1 class as a value became: an instance on both backends, root and units
        out[f"sharded_module_{backend}"] = [n for n, m in model.named_modules() if isinstance(m, ShardedModule)]
    out["identity"] = identity
    out["holder_full_state"] = _full_state_through_a_holder()
    # FSDP1 code wrapping a layer, then the model (both become shard()): the layer, nested now, frees its
    # gathered parameters after forward as FSDP1's nested wrapper does; the root keeps them for backward
    net = _net()
    net[2] = fsdp_bridge.shard(net[2], BridgeConfig(backend="fsdp2", wrap="none", device="cpu"))
    model = fsdp_bridge.shard(net, BridgeConfig(backend="fsdp2", wrap="none", device="cpu"))
    model(torch.ones(2, 8)).sum()
    out["nested_resharded"] = (isinstance(model[2][0].weight, DTensor), isinstance(model[0].weight, DTensor))
    out["reshard"] = _reshard_after_eval(rank)
    out["storage"] = _move_and_free(rank)
    out["ema"] = _ema(rank)
    out["scaler"] = _scaler_overflow(rank)
    out["summon_grad"] = _loss_inside_summon()
    # a model's own state_dict() inside summon_full_params (left as written by migrate code): full plain tensors
    model = fsdp_bridge.shard(_net(), BridgeConfig.from_fsdp1(auto_wrap_policy=_blocks))
    with fsdp_bridge.summon_full_params(model):
        inside = model.state_dict()
    out["state_in_summon"] = sorted((k, type(v).__name__, tuple(v.shape)) for k, v in inside.items())
    return out


def _loss_inside_summon() -> tuple[bool, bool, bool]:
    """A loss computed inside summon_full_params from a plain trunk's activations and the gathered head, its
    backward after the block (FSDP1 runs the block in the caller's grad mode): the trunk's gradients are those
    of an unsharded run; the head's own gradients land on the gathered copies and are dropped."""
    torch.manual_seed(0)
    trunk, head = nn.Linear(8, 8), nn.Linear(8, 4)
    x = torch.randn(3, 8)
    ref_trunk, ref_head = nn.Linear(8, 8), nn.Linear(8, 4)
    ref_trunk.load_state_dict(trunk.state_dict())
    ref_head.load_state_dict(head.state_dict())
    ref_loss = ref_head(ref_trunk(x)).sum()
    ref_loss.backward()
    sharded = fsdp_bridge.shard(head, BridgeConfig(backend="fsdp2", wrap="none", device="cpu"))
    hidden = trunk(x)
    with fsdp_bridge.summon_full_params(sharded, writeback=True):
        loss = nn.functional.linear(hidden, sharded.weight, sharded.bias).sum()
    loss.backward()
    assert trunk.weight.grad is not None and ref_trunk.weight.grad is not None
    return (
        torch.allclose(trunk.weight.grad, ref_trunk.weight.grad),
        torch.allclose(loss.detach(), ref_loss.detach()),
        sharded.weight.grad is None,
    )


def _scaler_overflow(rank: int) -> dict[str, Any]:
    """An inf in rank 1's gradient shard only: does each rank step, and what scale follows? fsdp_bridge's
    GradScaler (what migrate code writes for ShardedGradScaler) against torch.amp.GradScaler, on both backends."""
    out: dict[str, Any] = {}
    for backend in ("fsdp1", "fsdp2"):
        for name, scaler_class in (("bridge", fsdp_bridge.GradScaler), ("torch_amp", torch.amp.GradScaler)):
            model = fsdp_bridge.shard(_net(), BridgeConfig(backend=backend, wrap="none", device="cpu"))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler = scaler_class("cpu", init_scale=4.0)
            scaler.scale(model(torch.ones(2, 8)).square().sum()).backward()
            local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
            if rank == 1:  # put by hand where fp16 autocast would overflow (CPU runs fp32)
                with torch.no_grad():
                    next(g for g in local if g is not None and g.numel()).view(-1)[0] = float("inf")
            before = [(p.to_local() if isinstance(p, DTensor) else p).clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            after = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
            stepped = not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            out[f"{backend}/{name}"] = (stepped, scaler.get_scale())
    return out


def _gathered_bytes(model: nn.Module) -> list[int]:
    """Bytes each unit holds unsharded: FSDP1's padded full flat parameter, FSDP2's registered full tensors."""
    if isinstance(model, FullyShardedDataParallel):
        units = FullyShardedDataParallel.fsdp_modules(model)
        return [u._handle.flat_param._full_param_padded.untyped_storage().nbytes() for u in units]
    return [p.untyped_storage().nbytes() for p in model.parameters() if type(p) is not DTensor]


def _reshard_after_eval(rank: int) -> dict[str, Any]:
    """fsdp_bridge.reshard after an evaluation forward under no_grad: the gathered parameters are freed
    (FSDP1's root and SHARD_GRAD_OP units, FSDP2 units that keep them) and the next train step matches
    a run without the call."""
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp import fully_shard

    def make(kind: str) -> nn.Module:
        model = _net()
        if kind == "fully_shard":  # torch's own, keeping its parameters gathered after forward (ZeRO-2)
            fully_shard(model[2], reshard_after_forward=False)
            return fully_shard(model, reshard_after_forward=False)
        if kind == "fsdp1_torch":
            return FullyShardedDataParallel(
                model,
                auto_wrap_policy=_blocks,
                sharding_strategy=TorchStrategy.SHARD_GRAD_OP,
                device_id=torch.device("cpu"),
                use_orig_params=True,
            )
        return fsdp_bridge.shard(model, BridgeConfig(backend=kind, device="cpu", wrap=["Sequential"]))

    out: dict[str, Any] = {}
    for kind in ("fsdp1", "fsdp2", "fully_shard", "fsdp1_torch"):
        runs = []
        for free in (True, False):
            model = make(kind)
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            fsdp_bridge.reshard(model)  # before any forward: nothing gathered, nothing to do
            with torch.no_grad():
                model(torch.ones(2, 8))
            held = sum(_gathered_bytes(model))
            if free:
                fsdp_bridge.reshard(model)
            left = sum(_gathered_bytes(model))
            losses = []
            for step in range(2):
                loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step)))
                loss = loss.square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            runs.append((held, left, losses))
        out[kind] = runs
    plain = _net()
    fsdp_bridge.reshard(plain)  # nothing sharded: nothing done
    out["plain_unchanged"] = all(
        torch.equal(a, b) for a, b in zip(plain.parameters(), _net().parameters(), strict=True)
    )
    return out


def _shard_bytes(model: nn.Module) -> int:
    """Bytes of storage behind this rank's shards: FSDP1's flat parameters, FSDP2's local DTensor tensors."""
    units = [u for u in model.modules() if isinstance(u, FullyShardedDataParallel) and u._handle is not None]
    if units:
        return sum(u._handle.flat_param.untyped_storage().nbytes() for u in units)
    return sum(p.to_local().untyped_storage().nbytes() for p in model.parameters() if isinstance(p, DTensor))


def _move_and_free(rank: int) -> dict[str, Any]:
    """fsdp_bridge.move_shards between train steps (cpu -> cpu here) leaves the training of a run without
    it unchanged, on every kind of model; fsdp_bridge.free_shards then releases the shards' storage."""
    from torch.distributed.fsdp import fully_shard

    def make(kind: str) -> nn.Module:
        model = _net()
        if kind == "fully_shard":
            fully_shard(model[2])
            return fully_shard(model)
        if kind == "fsdp1_torch":
            return FullyShardedDataParallel(
                model, auto_wrap_policy=_blocks, device_id=torch.device("cpu"), use_orig_params=True
            )
        if kind == "plain":
            return model
        return fsdp_bridge.shard(model, BridgeConfig(backend=kind, device="cpu", wrap=["Sequential"]))

    out: dict[str, Any] = {}
    for kind in ("fsdp1", "fsdp2", "fully_shard", "fsdp1_torch", "plain"):
        runs = []
        for move in (True, False):
            model = make(kind)
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            losses = []
            for step in range(3):
                loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step)))
                loss = loss.square().mean()
                loss.backward()
                if move and step == 1:  # gradients held across the move
                    fsdp_bridge.move_shards(model, "cpu")
                opt.step()
                opt.zero_grad()
                if move:
                    fsdp_bridge.move_shards(model, torch.device("cpu"), non_blocking=True)
                losses.append(loss.item())
            runs.append(losses)
            before = _shard_bytes(model)
            fsdp_bridge.free_shards(model)
            runs.append((before, _shard_bytes(model)))
        out[kind] = runs
    return out


def _handles_ema(ema_model: nn.Module, model: nn.Module, decay: float) -> None:
    """The FSDP1 idiom ``migrate code`` rewrites to fsdp_bridge.ema_update_: the two models' flat parameters
    paired through FSDP1's private handles, averaged with foreach operations on each rank's shards."""
    from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles

    averaged, current = [], []
    for mine, theirs in zip(_get_fsdp_handles(ema_model), _get_fsdp_handles(model), strict=True):
        if mine.flat_param is not None and theirs.flat_param.requires_grad:
            averaged.append(mine.flat_param.data)
            current.append(theirs.flat_param.data.to(dtype=mine.flat_param.dtype))
    torch._foreach_mul_(averaged, decay)
    torch._foreach_add_(averaged, current, alpha=1 - decay)


def _ema(rank: int) -> dict[str, Any]:
    """fsdp_bridge.ema_update_ after each step, on every kind of model: the EMA copy's full weights against
    the average of the model's full weights computed here; on FSDP1 made by torch, against the handles idiom;
    the plain-torch ema_update_ that ``--target torch`` writes in its helper module, against the bridge's."""
    import types

    from torch.distributed.fsdp import fully_shard

    from fsdp_bridge.migrate._code import migrate_source
    from fsdp_bridge.migrate._torch_helpers import HELPERS_NAME, HELPERS_SOURCE

    helpers = types.ModuleType(HELPERS_NAME)
    exec(compile(HELPERS_SOURCE, f"{HELPERS_NAME}.py", "exec"), helpers.__dict__)
    # the fixture's update_ema (p_ema.data = ...) as written, and as migrate code rewrites it (.data.copy_)
    source = (Path(__file__).parent / "fixtures" / "migrate" / "data_assign.py").read_text()
    as_written: dict[str, Any] = {}
    rewritten: dict[str, Any] = {}
    exec(compile(source, "data_assign.py", "exec"), as_written)
    exec(compile(migrate_source(source, "data_assign.py").fixed, "data_assign.py", "exec"), rewritten)

    def make(kind: str, ema: bool) -> nn.Module:
        model = _net()
        if ema:
            model.requires_grad_(False)  # as the trees do before sharding the copy
        if kind == "fully_shard":
            fully_shard(model[2])
            return fully_shard(model)
        if kind.startswith("fsdp1_torch"):
            return FullyShardedDataParallel(
                model, auto_wrap_policy=_blocks, device_id=torch.device("cpu"), use_orig_params=kind.endswith("orig")
            )
        if kind == "ddp":
            return model if ema else DistributedDataParallel(model)
        if kind == "plain":
            return model
        return fsdp_bridge.shard(model, BridgeConfig(backend=kind, device="cpu", wrap=["Sequential"]))

    out: dict[str, Any] = {}
    for kind in ("fsdp1", "fsdp2", "fully_shard", "fsdp1_torch_orig", "fsdp1_torch_flat", "ddp", "plain"):
        model, ema = make(kind, False), make(kind, True)
        idiom = make(kind, True) if kind.startswith("fsdp1_torch") else None
        plain_torch = make(kind, True)
        by_copy, by_assignment = make(kind, True), make(kind, True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        reference = {k: v.clone() for k, v in fsdp_bridge.full_state_dict(ema).items()}
        for step in range(3):
            loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step)))
            loss.square().mean().backward()
            opt.step()
            opt.zero_grad()
            fsdp_bridge.ema_update_(ema, model, 0.9)
            if idiom is not None:
                _handles_ema(idiom, model, 0.9)
            helpers.ema_update_(plain_torch, model, 0.9)
            rewritten["update_ema"](model, by_copy, 0.9)
            as_written["update_ema"](model, by_assignment, 0.9)
            full = fsdp_bridge.full_state_dict(model)
            for name, value in reference.items():
                value.mul_(0.9).add_(full[name], alpha=0.1)
        got = fsdp_bridge.full_state_dict(ema)
        moved = max((got[k] - full[k]).abs().max().item() for k in reference)  # the average lags the model
        off = max((got[k] - reference[k]).abs().max().item() for k in reference)
        same_as_idiom = None
        if idiom is not None:
            theirs = fsdp_bridge.full_state_dict(idiom)
            same_as_idiom = all(torch.equal(got[k], theirs[k]) for k in reference)
        written = fsdp_bridge.full_state_dict(plain_torch)
        same_as_torch_target = all(torch.equal(got[k], written[k]) for k in reference)
        copied, assigned = fsdp_bridge.full_state_dict(by_copy), fsdp_bridge.full_state_dict(by_assignment)
        data_copy_off = max((copied[k] - reference[k]).abs().max().item() for k in reference)
        assignment_off = max((assigned[k] - reference[k]).abs().max().item() for k in reference)
        out[kind] = (
            sorted(got) == sorted(reference),
            off,
            moved > 0,
            same_as_idiom,
            same_as_torch_target,
            (data_copy_off, assignment_off),
        )
    return out


def _blocks(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return recurse or isinstance(module, nn.Sequential)


class _Holder:
    """A trainer's model class that is not an nn.Module and hands attribute reads on to the model it holds."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["model"], name)


def _full_state_through_a_holder() -> bool:
    """fsdp_bridge.full_state_dict on such a holder of an FSDP1 model (what ``migrate code`` writes for
    ``FSDP.state_dict_type(holder, FULL_STATE_DICT, ...)``): the held model's full state dict, not shards."""
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType

    model = FullyShardedDataParallel(_net(), device_id=torch.device("cpu"), use_orig_params=True)
    holder = _Holder(model)
    # (offload_to_cpu=True: FSDP1's own full state dict crashes a CPU gloo rank, torch 2.13)
    config = FullStateDictConfig(rank0_only=True)
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        reference = model.state_dict()
    got = fsdp_bridge.full_state_dict(holder, rank0_only=True)  # type: ignore[arg-type]
    return sorted(got) == sorted(reference) and all(torch.equal(got[k], reference[k]) for k in reference)


def test_ddp_and_fully_shard_numerics_match_their_own_calls(run_on_ranks: Any) -> None:
    results = run_on_ranks(_numerics, world_size=2)
    for kind in ("ddp", "fully_shard"):
        norms = {round(r[kind][0], 6) for r in results}
        assert len(norms) == 1, f"{kind}: the norm differs across ranks"
        for norm, ref_norm, same_grads in (r[kind] for r in results):
            assert norm == ref_norm and same_grads, kind
    assert results[0]["summoned"] == [(16, 8), (16,), (16, 16), (16,), (4, 16), (4,)]
    for r in results:
        # made by shard() on either backend, root and units: sharded; torch's own fully_shard and DDP: not
        assert r["is_sharded_fsdp2"] and r["is_sharded_fsdp1"]
        assert r["is_sharded_units"] == ["", "2"]
        assert r["is_sharded_torch"] == (False, False)
        # ShardedModule: isinstance is is_sharded (torch's own fully_shard not an instance; its class a subclass)
        assert r["sharded_module_fsdp2"] == r["sharded_module_fsdp1"] == [""]
        assert r["sharded_module_torch"] == (False, True)
    for r in results:
        # backward_prefetch=None (FSDP1: no prefetch) runs on FSDP2 and trains as the default does
        assert r["prefetch_none_losses"][0] == r["prefetch_none_losses"][1]
        # FSDP1 module objects given as ignored_modules: named in the model; one outside it left out
        assert r["ignored"] == (("3",), "Parameter")
        # summon_full_params: FSDP1 (use_orig_params) re-points the parameters held before the context;
        # FSDP2's are DTensors whose data live in slots: those objects stay shards inside (docs/bridge.md)
        assert r["identity"] == {"fsdp2": (False, (16, 8)), "fsdp1": (True, (16, 8))}
        assert r["holder_full_state"]  # not sharded tensors: the holder's model is found to be FSDP1's
        # a loss computed inside summon_full_params backpropagates after it, as on FSDP1
        assert r["summon_grad"] == (True, True, True)
        assert r["state_in_summon"] == [
            ("0.bias", "Tensor", (16,)),
            ("0.weight", "Tensor", (16, 8)),
            ("2.0.bias", "Tensor", (16,)),
            ("2.0.weight", "Tensor", (16, 16)),
            ("3.bias", "Tensor", (4,)),
            ("3.weight", "Tensor", (4, 16)),
        ]
        assert r["nested_resharded"] == (True, False)
        # reshard after an evaluation forward: what was held gathered is freed, the train steps that
        # follow are those of a run without it (FSDP2 through shard() reshards such a forward itself)
        for kind in ("fsdp1", "fsdp2", "fully_shard", "fsdp1_torch"):
            (held, left, losses), (held_ref, left_ref, ref_losses) = r["reshard"][kind]
            assert losses == ref_losses, kind
            assert left == 0 and held == held_ref and left_ref == held_ref, (kind, held, left, left_ref)
            assert held > 0 or kind == "fsdp2", kind
        assert r["reshard"]["plain_unchanged"]
        # move_shards between steps trains as a run without it; free_shards leaves no storage behind the shards
        for kind, (losses, (held, left), ref_losses, _) in r["storage"].items():
            assert losses == ref_losses, kind
            if kind != "plain":
                assert held > 0 and left == 0, (kind, held, left)
        # ema_update_ after each step: the EMA copy's full weights are the average of the model's, on every
        # kind of model; on FSDP1 made by torch, bit for bit what the handles idiom gives; the torch target's
        # helper gives the bridge's bit for bit
        # The tree's own EMA step over parameters(): as migrate code rewrites it (p_ema.data.copy_(...)) it
        # averages on every kind; as written (p_ema.data = ...) it never moves a DTensor parameter (FSDP2's)
        for kind, (same_keys, off, moved, same_as_idiom, same_as_torch_target, data) in r["ema"].items():
            assert same_keys and off < 1e-6 and moved and same_as_torch_target, (kind, off)
            assert same_as_idiom is (True if kind.startswith("fsdp1_torch") else None), kind
            data_copy_off, assignment_off = data
            assert data_copy_off < 1e-6, (kind, data)
            if kind in ("fsdp2", "fully_shard"):
                assert assignment_off > 1e-3, (kind, data)
            elif kind in ("fsdp1_torch_flat", "ddp", "plain"):
                assert assignment_off < 1e-6, (kind, data)
    # fsdp_bridge.GradScaler: the inf in rank 1's shard makes every rank skip the step and halve the scale, on
    # both backends. torch.amp.GradScaler agrees only on fsdp2 (DTensor gradients reduce the check); on fsdp1's
    # flat shards rank 0 steps while rank 1 skips.
    scaler = [r["scaler"] for r in results]
    for backend in ("fsdp1", "fsdp2"):
        assert [s[f"{backend}/bridge"] for s in scaler] == [(False, 2.0), (False, 2.0)], backend
    assert [s["fsdp2/torch_amp"] for s in scaler] == [(False, 2.0), (False, 2.0)]
    assert [s["fsdp1/torch_amp"] for s in scaler] == [(True, 4.0), (False, 2.0)]


# A one-rank gloo script leaves without interpreter finalisation: the FSDP modules it still holds keep the
# process group, whose destructor can abort the process at exit ("terminate called without an active
# exception"), a teardown race in torch, not the behaviour under test (the verify runner leaves the same way).
_LEAVE = """
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


def _run_one_rank(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "import os\n" + script + _LEAVE, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


_MISSING_STATE = """
import sys, torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import fsdp_bridge

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.idle = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)  # idle never gets a gradient: Adam keeps no state for it


def build():
    torch.manual_seed(0)
    m = TwoHeads()
    m.idle = FSDP(m.idle, device_id=torch.device("cpu"), use_orig_params=True)
    return FSDP(m, device_id=torch.device("cpu"), use_orig_params=True)


model = build()
optim = torch.optim.Adam(model.parameters(), lr=0.1)
model(torch.ones(2, 4)).sum().backward()
optim.step()
saved = FSDP.optim_state_dict(model, optim)
again = build()
fresh = torch.optim.Adam(again.parameters(), lr=0.1)
fresh.load_state_dict(fsdp_bridge.optim_state_dict_to_load(again, fresh, saved))
print(sorted(fresh.state_dict()["state"]) == sorted(optim.state_dict()["state"]))
"""


def test_an_optimizer_state_without_some_parameters_loads_as_fsdp1_loads_it(tmp_path: Path) -> None:
    # FSDP1's optim_state_dict_to_load takes a state that holds nothing for a parameter that never had a
    # gradient; torch's set_optimizer_state_dict refuses it unless strict=False.
    proc = _run_one_rank(_MISSING_STATE, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"


_NO_INIT_STEP = """
import sys, types, torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import fsdp_bridge
from fsdp_bridge.migrate._torch_helpers import HELPERS_SOURCE

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
helpers = types.ModuleType("_fsdp2_helpers")
exec(compile(HELPERS_SOURCE, "_fsdp2_helpers.py", "exec"), helpers.__dict__)


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def weights(model):
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


model = FSDP(build(), device_id=torch.device("cpu"), use_orig_params=True)
optim = torch.optim.AdamW(model.parameters(), lr=0.1, eps=0.0)  # eps=0: torch's init step divides 0 by 0
model(torch.ones(2, 4)).sum().backward()
optim.step()
saved = FSDP.optim_state_dict(model, optim)
for backend in ("fsdp1", "fsdp2", "helpers"):
    if backend == "helpers":
        again = helpers.shard_model(build(), mesh=helpers.data_parallel_mesh("full_shard", "cpu"))
    else:
        again = fsdp_bridge.shard(build(), fsdp_bridge.BridgeConfig(backend=backend, wrap="none"))
    fresh = torch.optim.AdamW(again.parameters(), lr=0.1, eps=0.0)
    before = weights(again)
    read = "-"
    if backend != "helpers":  # a save before the first step
        fsdp_bridge.full_optim_state_dict(again, fresh, rank0_only=False)
        read = all(torch.equal(a, b) for a, b in zip(before, weights(again))) and not fresh.state
    load = fsdp_bridge.optim_state_dict_to_load if backend != "helpers" else helpers.optim_state_dict_to_load
    fresh.load_state_dict(load(again, fresh, saved))
    loaded = all(torch.equal(a, b) for a, b in zip(before, weights(again)))
    steps = sorted(float(s["step"]) for s in fresh.state.values())
    print(backend, read, loaded, steps)
# FSDP1's state of a torch.compile'd model names parameters with `_orig_mod.`; torch's names never do: loaded
# under strict=False it once loaded nothing, silently
from fsdp_bridge.backends.fsdp1_objects import _uncompiled

assert [_uncompiled(n) for n in ("_orig_mod.0.weight", "enc_orig_mod.weight", "a._orig_mod.b")] == [
    "0.weight",
    "enc_orig_mod.weight",
    "a.b",
]
compiled = {
    "state": {"_orig_mod." + k: v for k, v in saved["state"].items()},
    "param_groups": [{**g, "params": ["_orig_mod." + p for p in g["params"]]} for g in saved["param_groups"]],
}
again = fsdp_bridge.shard(build(), fsdp_bridge.BridgeConfig(backend="fsdp2", wrap="none"))
fresh = torch.optim.AdamW(again.parameters(), lr=0.1, eps=0.0)
fresh.load_state_dict(fsdp_bridge.optim_state_dict_to_load(again, fresh, compiled))
print("compiled", sorted(float(s["step"]) for s in fresh.state.values()))
"""


def test_reading_or_loading_a_fresh_optimizers_state_leaves_the_parameters_as_fsdp1_does(tmp_path: Path) -> None:
    # torch's get_/set_optimizer_state_dict step an optimizer without state once (zero gradients, lr 0) to make
    # it: with AdamW(eps=0) that step wrote NaN into every parameter (0 / 0), and a read left the optimizer at
    # step 1. FSDP1 never steps it: the bridge (both backends) and the generated helpers put the parameters
    # back, and a read leaves the optimizer without state; the loaded state is the saved one (step 1).
    proc = _run_one_rank(_NO_INIT_STEP, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-4:] == [
        "fsdp1 True True [1.0, 1.0, 1.0, 1.0]",
        "fsdp2 True True [1.0, 1.0, 1.0, 1.0]",
        "helpers - True [1.0, 1.0, 1.0, 1.0]",
        "compiled [1.0, 1.0, 1.0, 1.0]",  # torch.compile's `_orig_mod.` names taken out: the saved state loads
    ]


_EMPTY_GROUPS = """
import sys, torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import fsdp_bridge

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)


def build():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    net[0].requires_grad_(False)  # a frozen backbone: its decay and no-decay groups hold nothing
    return net


def groups(model):
    weights = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("bias")]
    return [
        {"params": [], "weight_decay": 0.1},
        {"params": [], "weight_decay": 0.0},
        {"params": weights, "weight_decay": 0.1},
        {"params": biases, "weight_decay": 0.0},
    ]


def step(model, optim):
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


model = FSDP(build(), device_id=torch.device("cpu"), use_orig_params=True)
optim = torch.optim.AdamW(groups(model), lr=0.1)
step(model, optim)
for g in optim.param_groups:
    g["lr"] = 0.05  # a scheduler's value, saved with the state
saved = FSDP.optim_state_dict(model, optim)
for backend in ("fsdp1", "fsdp2"):
    again = fsdp_bridge.shard(build(), fsdp_bridge.BridgeConfig(backend=backend, wrap="none"))
    fresh = torch.optim.AdamW(groups(again), lr=0.1)
    fresh.load_state_dict(fsdp_bridge.optim_state_dict_to_load(again, fresh, saved))
    mine = fsdp_bridge.full_optim_state_dict(again, fresh, rank0_only=False)
    same = all(
        torch.equal(torch.as_tensor(v), torch.as_tensor(mine["state"][k][n]))
        for k, entry in saved["state"].items() for n, v in entry.items()
    )
    kept = [(len(g["params"]), g["weight_decay"], g["lr"]) for g in fresh.param_groups]
    print(backend, same and sorted(mine["state"]) == sorted(saved["state"]), kept)
"""


def test_an_optimizer_with_several_empty_groups_loads_as_fsdp1_loads_it(tmp_path: Path) -> None:
    # torch's set_optimizer_state_dict refuses more than one parameter group without parameters (a frozen
    # part's decay and no-decay groups), which FSDP1's optim_state_dict_to_load takes: each group stays in its
    # place, with the hyperparameters saved for it.
    proc = _run_one_rank(_EMPTY_GROUPS, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept = "[(0, 0.1, 0.05), (0, 0.0, 0.05), (2, 0.1, 0.05), (2, 0.0, 0.05)]"
    assert proc.stdout.strip().splitlines()[-2:] == [f"fsdp1 True {kept}", f"fsdp2 True {kept}"]


_WRAPPED_OPTIMIZER = """
import sys, torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import fsdp_bridge
from fsdp_bridge.errors import ConfigError

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)


class Steering:  # a trainer's optimizer wrapper: FSDP1's optimizer-state functions read only param_groups
    def __init__(self, inner):
        self.inner = inner

    @property
    def param_groups(self):
        return self.inner.param_groups

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, sd):
        self.inner.load_state_dict(sd)


def trained(model):
    opt = Steering(torch.optim.Adam(model.parameters(), lr=0.1))
    model(torch.ones(2, 4)).sum().backward()
    opt.inner.step()
    return opt


for backend in ("fsdp1", "fsdp2"):
    torch.manual_seed(0)
    model = fsdp_bridge.shard(nn.Linear(4, 4), fsdp_bridge.BridgeConfig(backend=backend, wrap="none"))
    opt = trained(model)
    full = fsdp_bridge.full_optim_state_dict(model, opt, rank0_only=False)
    same = fsdp_bridge.full_optim_state_dict(model, opt.inner, rank0_only=False)
    print(backend, "full", sorted(full["state"]) == sorted(same["state"]) != [])
    print(backend, "osd", sorted(fsdp_bridge.optim_state_dict(model, opt)["state"]) == sorted(same["state"]))
    model.zero_grad(set_to_none=True)  # torch makes a fresh optimizer's state only where no gradient is left
    fresh = Steering(torch.optim.Adam(model.parameters(), lr=0.1))
    fresh.load_state_dict(fsdp_bridge.optim_state_dict_to_load(model, fresh, full))
    print(backend, "load", sorted(fresh.inner.state_dict()["state"]) == sorted(opt.inner.state_dict()["state"]))
    stray = Steering(torch.optim.Adam(model.parameters(), lr=0.1))
    stray.inner = object()
    stray.__dict__["param_groups"] = opt.param_groups
    try:
        fsdp_bridge.optim_state_dict_to_load(model, stray, full)
    except ConfigError as e:
        print(backend, "refused", "param_groups" in str(e) and "Steering" in str(e))
"""


def test_an_optimizer_wrapper_is_taken_as_fsdp1_takes_it(tmp_path: Path) -> None:
    # FSDP1's full_optim_state_dict / optim_state_dict_to_load read only the optimizer's param_groups, so trainers
    # pass their own optimizer wrapper; torch's state-dict functions raised TypeError on it ("not iterable").
    proc = _run_one_rank(_WRAPPED_OPTIMIZER, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines == [f"{b} {what} True" for b in ("fsdp1", "fsdp2") for what in ("full", "osd", "load", "refused")]


def _clip_bf16_gradients() -> tuple[bool, str, bool]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(torch.bfloat16)
    grads = [torch.randn_like(p) * 3 for p in model.parameters()]
    model = fsdp_bridge.shard(model, BridgeConfig(backend="fsdp2", device="cpu", wrap="none"))
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = DTensor.from_local(g.clone(), p.device_mesh, p.placements)
    norm = fsdp_bridge.clip_grad_norm_(model, 1.0)
    # FSDP1's clip_grad_norm_: each gradient's norm in float32, the float32 coefficient cast to the gradients'
    # dtype, the norm returned in that dtype
    fp32 = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]))
    coef = torch.clamp(1.0 / (fp32 + 1e-6), max=1.0).to(torch.bfloat16)
    same = all(torch.equal(p.grad.to_local(), g * coef) for p, g in zip(model.parameters(), grads, strict=True))
    return same, str(norm.dtype), norm.item() == fp32.to(torch.bfloat16).item()


def test_bf16_gradients_are_clipped_with_fsdp1s_float32_norm() -> None:
    """torch's get_total_norm takes a bfloat16 gradient's norm in bfloat16 (off by up to 0.4%): FSDP1 does not."""
    from fsdp_bridge.testing import run_distributed

    assert run_distributed(_clip_bf16_gradients, 1) == [(True, "torch.bfloat16", True)]


def _full_state_after_a_persistent_rank0_type() -> tuple[int, int]:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType

    model = fsdp_bridge.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), BridgeConfig(device="cpu"))
    opt = torch.optim.AdamW(model.parameters())
    config = FullStateDictConfig(rank0_only=True, offload_to_cpu=True)
    fsdp_bridge.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, config)  # a load path sets it, persistent
    # a save block of its own afterwards (FSDP1's block overrides the setting): every rank gets the full state
    every = fsdp_bridge.full_state_dict(model, rank0_only=False)
    optim = fsdp_bridge.full_optim_state_dict(model, opt, rank0_only=False)
    return len(every), len(optim["param_groups"])


def test_a_full_state_taken_in_a_block_of_its_own_overrides_a_persistent_type() -> None:
    from fsdp_bridge.testing import run_distributed

    assert run_distributed(_full_state_after_a_persistent_rank0_type, 2) == [(4, 1), (4, 1)]


def test_state_dict_options_without_configs_keep_fsdp1s_defaults() -> None:
    # ShardedStateDictConfig() keeps the model's shards on the device; ShardedOptimStateDictConfig() offloads the
    # optimizer's to the CPU (also when a block gives no optimizer config)
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, StateDictType

    sharded = StateDictType.SHARDED_STATE_DICT
    assert not fsdp_bridge.state_dict_options(sharded).cpu_offload
    assert fsdp_bridge.state_dict_options(sharded, None, None, optimizer=True).cpu_offload
    off = ShardedOptimStateDictConfig(offload_to_cpu=False)
    assert not fsdp_bridge.state_dict_options(sharded, None, off, optimizer=True).cpu_offload


_SHARED_STEP = """
import sys, torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import fsdp_bridge

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
torch.manual_seed(0)
model = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), device_id=torch.device("cpu"))
optim = torch.optim.Adam(model.parameters(), lr=0.1)
model(torch.ones(2, 4)).sum().backward()
optim.step()
saved = FSDP.optim_state_dict(model, optim)
print(len({id(v["step"]) for v in saved["state"].values()}), len(saved["state"]))
torch.manual_seed(0)
again = fsdp_bridge.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), fsdp_bridge.BridgeConfig(wrap="none"))
fresh = torch.optim.Adam(again.parameters(), lr=0.1)
fresh.load_state_dict(fsdp_bridge.optim_state_dict_to_load(again, fresh, saved))
again(torch.ones(2, 4)).sum().backward()
fresh.step()
print(sorted(float(s["step"]) for s in fresh.state.values()))
"""


def test_fsdp1s_shared_step_tensor_is_loaded_as_one_step_per_parameter(tmp_path: Path) -> None:
    # FSDP1's optim_state_dict gives every parameter of a flat parameter the same `step` tensor; loaded as it was,
    # one step() added 1 to it once per parameter (Adam's bias correction then wrong: 5 after one step here).
    proc = _run_one_rank(_SHARED_STEP, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shared, steps = proc.stdout.strip().splitlines()[-2:]
    assert shared == "1 4" and steps == "[2.0, 2.0, 2.0, 2.0]"


def test_state_dict_configs_of_another_type_are_refused_as_fsdp1_refuses_them() -> None:
    # A LocalStateDictConfig handed as a FULL_STATE_DICT block's optimizer config made FSDP1 raise at the block;
    # read by attribute, the bridge let the block run on FSDP2 (a public trainer's save and load, never run before,
    # then restored rank 0's optimizer shards on every rank).
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        LocalStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )

    full = StateDictType.FULL_STATE_DICT
    with pytest.raises(ConfigError, match=r"optim_state_dict_config: got 'LocalStateDictConfig'"):
        fsdp_bridge.state_dict_options(full, FullStateDictConfig(), LocalStateDictConfig())
    with pytest.raises(ConfigError, match=r"state_dict_config: got 'ShardedStateDictConfig'; allowed: None or Full"):
        fsdp_bridge.state_dict_options(full, ShardedStateDictConfig())
    assert fsdp_bridge.state_dict_options(full, FullStateDictConfig(), FullOptimStateDictConfig()).full_state_dict


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        return (self.a if use_a else self.b)(x)


def _branches_on_each_backend() -> list[tuple[str, list[float]]]:
    import torch.distributed as dist

    out = []
    for backend in ("fsdp1", "fsdp2"):
        torch.manual_seed(0)
        model = fsdp_bridge.shard(_Branches(), BridgeConfig(backend=backend, device="cpu", wrap="none"))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
        for step in range(2):
            model(torch.ones(2, 4), use_a=(dist.get_rank() + step) % 2 == 0).sum().backward()
            opt.step()
            opt.zero_grad()
        full = fsdp_bridge.full_state_dict(model, rank0_only=False)
        out.append((backend, [round(float(v.sum()), 6) for v in full.values()]))
    return out


def test_ranks_using_different_parameters_train_as_on_fsdp1() -> None:
    # Ranks taking different branches (a routed expert, a modality present on some ranks): FSDP1 reduces each
    # unit's whole flat gradient, zeros for what a rank did not use, and steps every parameter; FSDP2 sent only
    # the gradients there were, so the ranks' reduce-scatters differed in size (gloo raised, NCCL would hang).
    # A parameter no rank uses gets a zero gradient as on FSDP1 (AdamW's decay moves it on both).
    from fsdp_bridge.testing import run_distributed

    (fsdp1, fsdp2), _ = run_distributed(_branches_on_each_backend, 2)
    assert fsdp1[0] == "fsdp1" and fsdp2[0] == "fsdp2"
    assert fsdp1[1] == pytest.approx(fsdp2[1], abs=1e-5)


def test_save_pretrained_is_the_modules_own_call_where_there_is_nothing_to_gather() -> None:
    """An unsharded module, FSDP1's wrapper (its call reaches the module inside), a call given its own state_dict=,
    and a model transformers sharded itself (its call gathers on every rank) get their own save_pretrained, on
    every rank as written; a fully_shard model's full state is gathered (2 gloo ranks:
    tests/test_checkpoint_formats.py)."""
    calls: list[tuple[object, dict[str, object]]] = []

    def record(self: nn.Module, directory: object, **kwargs: object) -> None:
        calls.append((directory, kwargs))

    plain = type("Saving", (nn.Linear,), {"save_pretrained": record})(2, 2)
    fsdp2 = _unit()
    fsdp2.__class__ = type("SavingFSDP", (type(fsdp2),), {"save_pretrained": record})
    own_gather = _unit()
    own_gather.__class__ = type("SavingFSDP", (type(own_gather),), {"save_pretrained": record})
    own_gather.config = mock.Mock(distributed_config=object())
    fsdp1 = mock.MagicMock(spec=FullyShardedDataParallel)
    fsdp1.save_pretrained = mock.Mock()  # what its __getattr__ finds on the module inside
    fsdp_bridge.save_pretrained(plain, "a", max_shard_size="1GB")
    fsdp_bridge.save_pretrained(fsdp2, "b", state_dict={"w": 1})
    fsdp_bridge.save_pretrained(own_gather, "c")
    fsdp_bridge.save_pretrained(fsdp1, "d", safe_serialization=False)
    assert calls == [("a", {"max_shard_size": "1GB"}), ("b", {"state_dict": {"w": 1}}), ("c", {})]
    fsdp1.save_pretrained.assert_called_once_with("d", safe_serialization=False)
