"""CUDA tests (world size 1, NCCL): skipped cleanly on machines without a GPU."""

from __future__ import annotations

import pytest
import torch

import fsdp_bridge
from fsdp_bridge import BridgeConfig
from fsdp_bridge.testing import run_distributed
from fsdp_bridge.testing.models import build_tiny, sample_batch

pytestmark = pytest.mark.cuda


def _cuda_train(backend: str, mixed_precision: str, cpu_offload: bool, ac: bool) -> list[float]:
    config = BridgeConfig(
        backend=backend,
        mixed_precision=mixed_precision,
        cpu_offload=cpu_offload,
        activation_checkpointing=ac,
        device="cuda",
    )
    model = fsdp_bridge.shard(build_tiny("llama", seed=0), config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = {k: v.cuda() for k, v in sample_batch().items()}
    losses = []
    for _ in range(4):
        loss = model(**batch).loss
        loss.backward()
        fsdp_bridge.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize(("mixed_precision", "cpu_offload", "ac"), [("fp32", False, False), ("bf16", True, True)])
def test_cuda_trains(backend: str, mixed_precision: str, cpu_offload: bool, ac: bool) -> None:
    (losses,) = run_distributed(_cuda_train, 1, args=(backend, mixed_precision, cpu_offload, ac), backend="nccl")
    assert losses[-1] < losses[0]


def _cuda_paths(tmp: str) -> dict[str, object]:
    """Paths only a GPU reaches, in one spawn: FSDP1's own sync_module_states, CPU offload,
    bf16 parity of the backends, checkpoints carried across backends, LoRA."""
    out: dict[str, object] = {}
    batch = {k: v.cuda() for k, v in sample_batch().items()}
    reference = build_tiny("llama", seed=0).state_dict()

    def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.float() for k, v in sd.items()}

    models = {}
    for backend in ("fsdp1", "fsdp2"):
        config = BridgeConfig(backend=backend, device="cuda", sync_module_states=True, cpu_offload=True)
        model = fsdp_bridge.shard(build_tiny("llama", seed=0), config)
        plan = fsdp_bridge.get_bridge(model).plan
        out[f"{backend}_sync"] = plan.sync
        out[f"{backend}_offload"] = plan.offload_params
        out[f"{backend}_synced_equal"] = all(torch.equal(full(model)[k], reference[k]) for k in reference)
        models[backend] = model
    # bf16 parity: the same model, data and seed through both backends.
    losses = {}
    for backend in ("fsdp1", "fsdp2"):
        model = fsdp_bridge.shard(
            build_tiny("llama", seed=0), BridgeConfig(backend=backend, device="cuda", mixed_precision="bf16")
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[backend] = []
        for _ in range(3):
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[backend].append(loss.item())
        # A sharded and a full checkpoint of each, loaded into the other backend.
        fsdp_bridge.save_checkpoint(f"{tmp}/{backend}-sharded", model, opt)
        fsdp_bridge.save_checkpoint(f"{tmp}/{backend}-full", model, kind="full")
        models[backend] = model
    out["losses"] = losses
    for src, dst in (("fsdp1", "fsdp2"), ("fsdp2", "fsdp1")):
        for kind in ("sharded", "full"):
            target = fsdp_bridge.shard(
                build_tiny("llama", seed=1), BridgeConfig(backend=dst, device="cuda", mixed_precision="bf16")
            )
            fsdp_bridge.load_checkpoint(f"{tmp}/{src}-{kind}", target)
            want, got = full(models[src]), full(target)
            out[f"{src}->{dst} {kind} equal"] = all(torch.equal(want[k], got[k]) for k in want)
    # LoRA on both backends: trains, base frozen.
    try:
        import peft
    except ImportError:
        return out
    for backend in ("fsdp1", "fsdp2"):
        lora = peft.get_peft_model(
            build_tiny("llama", seed=0), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        )
        model = fsdp_bridge.shard(lora, BridgeConfig(backend=backend, device="cuda", mixed_precision="bf16"))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        first = last = 0.0
        for i in range(4):
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            first, last = (loss.item(), last) if i == 0 else (first, loss.item())
        out[f"lora_{backend}"] = (first, last)
    return out


def test_cuda_only_paths(tmp_path: object) -> None:
    from fsdp_bridge.plan import SyncMethod

    (out,) = run_distributed(_cuda_paths, 1, args=(str(tmp_path),), backend="nccl")
    assert out["fsdp1_sync"] is SyncMethod.BACKEND and out["fsdp2_sync"] is SyncMethod.BROADCAST
    assert out["fsdp1_offload"] and out["fsdp2_offload"]
    assert out["fsdp1_synced_equal"] and out["fsdp2_synced_equal"]
    losses = out["losses"]
    assert isinstance(losses, dict)
    torch.testing.assert_close(losses["fsdp1"], losses["fsdp2"], rtol=2e-2, atol=2e-2)  # bf16 compute
    for key in (
        "fsdp1->fsdp2 sharded equal",
        "fsdp1->fsdp2 full equal",
        "fsdp2->fsdp1 sharded equal",
        "fsdp2->fsdp1 full equal",
    ):
        assert out[key], key
    for backend in ("fsdp1", "fsdp2"):
        if f"lora_{backend}" in out:
            first, last = out[f"lora_{backend}"]  # type: ignore[misc]
            assert last < first
