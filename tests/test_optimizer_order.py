"""An optimizer built before shard(): refused at its first step where it would train nothing."""

from __future__ import annotations

import torch
import torch.distributed as dist

import fsdp_bridge
from fsdp_bridge import Backend, BridgeConfig, ConfigError
from fsdp_bridge.testing.models import build_tiny, sample_batch


def _optimizer_before_shard() -> dict[str, str]:
    rank = dist.get_rank()
    out: dict[str, str] = {}
    for backend in Backend:
        model = build_tiny("llama", seed=0)
        early = torch.optim.AdamW(model.parameters(), lr=1e-2)  # before shard(): legal in FSDP1
        sharded = fsdp_bridge.shard(model, BridgeConfig(backend=backend))
        batch = sample_batch("llama", batch=2, seq=8, seed=42 + rank)
        losses = []
        try:
            for _ in range(2):
                loss = sharded(**batch).loss
                loss.backward()
                early.step()
                early.zero_grad()
                losses.append(loss.item())
            out[backend.value] = f"trained: {losses[0] != losses[1]}"
        except ConfigError as err:
            out[backend.value] = str(err)
        late = torch.optim.AdamW(sharded.parameters(), lr=1e-2)  # after shard(): always fine
        sharded(**batch).loss.backward()
        late.step()
    # FSDP2 with an ignored module: DTensor parameters beside plain ones. torch's multi-tensor kernels (its
    # default on CUDA, asked for here) refuse the mix: refused at the first step, naming the fix, which works.
    from torch.distributed.tensor import DTensor

    sharded = fsdp_bridge.shard(build_tiny("llama", seed=0), BridgeConfig(ignored_modules=["lm_head"]))
    sharded(**sample_batch("llama", batch=2, seq=8, seed=42 + rank)).loss.backward()
    try:
        torch.optim.AdamW(sharded.parameters(), lr=1e-2, foreach=True).step()
        out["mixed"] = "no error"
    except ConfigError as err:
        out["mixed"] = str(err)
    params = list(sharded.parameters())
    groups = [
        {"params": [p for p in params if isinstance(p, DTensor)]},
        {"params": [p for p in params if not isinstance(p, DTensor)]},
    ]
    torch.optim.AdamW(groups, lr=1e-2, foreach=True).step()
    torch.optim.AdamW(params, lr=1e-2).step()  # the CPU's default: one tensor at a time
    # bitsandbytes' optimizer kernels have no DTensor rule: refused at the first step on FSDP2, naming the fix
    # (FSDP1's flat shards are plain tensors, which they step)
    import bitsandbytes as bnb

    for backend in Backend:
        sharded = fsdp_bridge.shard(build_tiny("llama", seed=0), BridgeConfig(backend=backend))
        sharded(**sample_batch("llama", batch=2, seq=8, seed=42 + rank)).loss.backward()
        try:
            bnb.optim.AdamW8bit(sharded.parameters(), lr=1e-2).step()
            out[f"bnb {backend.value}"] = "stepped"
        except ConfigError as err:
            out[f"bnb {backend.value}"] = str(err)
    return out


def test_an_optimizer_built_before_shard_is_refused_where_it_would_train_nothing(run_on_ranks) -> None:
    for result in run_on_ranks(_optimizer_before_shard, 2):  # every rank raises, at the same step
        assert result["fsdp1"] == "trained: True"  # FSDP1 keeps the original parameters (use_orig_params)
        assert "optimizer: got 'AdamW holding" in result["fsdp2"]
        assert "parameters from before shard()" in result["fsdp2"]
        assert "build the optimizer after fsdp_bridge.shard(model, ...)" in result["fsdp2"]
        assert "AdamW parameter group 0 mixing" in result["mixed"] and "with 1 plain tensors" in result["mixed"]
        assert "give the plain tensors a group of their own" in result["mixed"]
        assert result["bnb fsdp1"] == "stepped"
        assert "optimizer: got \"bitsandbytes' AdamW8bit over" in result["bnb fsdp2"]
        assert "BridgeConfig(backend='fsdp1')" in result["bnb fsdp2"]


def _already_wrapped() -> list[str]:
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    out = []
    fsdp1 = FullyShardedDataParallel(build_tiny("llama", seed=0), device_id=torch.device("cpu"))
    fsdp2 = build_tiny("llama", seed=0)
    fully_shard(fsdp2.model.layers[0])
    for model in (fsdp1, fsdp2):
        try:
            fsdp_bridge.shard(model, BridgeConfig())
            out.append("no error")
        except ConfigError as err:
            out.append(str(err))
    return out


def test_a_model_wrapped_by_raw_fsdp_is_refused_naming_it(run_on_ranks) -> None:
    fsdp1, fsdp2 = run_on_ranks(_already_wrapped, 2)[0]
    assert "already wrapped by FullyShardedDataParallel (FSDP1)" in fsdp1
    assert "already wrapped by fully_shard (FSDP2) (at model.layers.0)" in fsdp2
    assert "pass the model to shard() instead of wrapping it yourself" in fsdp2


def test_an_apex_optimizer_over_dtensor_parameters_is_refused_in_one_process() -> None:
    """apex's FusedAdam / FusedLAMB read raw storage in multi-tensor kernels, which a DTensor holds none of."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from fsdp_bridge._optimizer_check import _kernels_problem
    from fsdp_bridge.estimate import fake_process_group

    fused = type("FusedAdam", (torch.optim.SGD,), {"__module__": "apex.optimizers.fused_adam"})
    with fake_process_group(rank=0, world_size=2):
        mesh = init_device_mesh("cpu", (2,))
        param = torch.nn.Parameter(DTensor.from_local(torch.zeros(2, 4), mesh, [Shard(0)], run_check=False))
        problem = _kernels_problem(fused([param], lr=0.1))
    assert problem is not None and problem.value == "apex's FusedAdam over 1 sharded (DTensor) parameters"
    assert "BridgeConfig(backend='fsdp1')" in problem.fix
    assert _kernels_problem(fused([torch.nn.Parameter(torch.zeros(2))], lr=0.1)) is None  # plain tensors: FSDP1
