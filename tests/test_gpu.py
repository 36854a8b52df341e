"""CUDA tests (world size 1, NCCL): skipped cleanly on machines without a GPU."""

from __future__ import annotations

from typing import Any

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


def _cuda_fsdp1_migration(device: str = "cuda") -> dict[str, object]:
    """FSDP1 as users write it on a GPU, against what ``--fix`` turns it into, in one spawn.

    The raw ``FullyShardedDataParallel`` with its own runtime objects (bf16 ``MixedPrecision``
    with FSDP1's root-only input casting, a ``transformer_auto_wrap_policy`` partial,
    ``device_id``), then the same arguments through ``BridgeConfig.from_fsdp1`` on both backends;
    a parameter ignored by path; a no-gradient forward and ``generate`` before the optimizer's
    state dict; ``summon_full_params(recurse=False)``; the data-parallel sub-mesh of a (dp, tp)
    mesh and a mesh built from a process group, each with ``sync_module_states``.
    """
    import functools

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    out: dict[str, object] = {}
    optim_state_keys: list[int] = []
    out["optim_state_keys"] = optim_state_keys
    batch = {k: v.to(device) for k, v in sample_batch().items()}
    prompt = batch["input_ids"][:1, :4]

    def kwargs() -> dict[str, object]:
        return dict(
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            device_id=torch.cuda.current_device() if device == "cuda" else torch.device("cpu"),
            use_orig_params=True,
        )

    def train(model: torch.nn.Module, steps: int = 3) -> list[float]:
        from torch.distributed.tensor import DTensor

        params = list(model.parameters())
        kinds = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
        if all(kinds):  # FSDP2 with an ignored parameter: torch's foreach kernels (CUDA's default) refuse the mix
            try:
                torch.optim.AdamW(params, lr=1e-2).step()
                out["mixed_refused"] = "no error"
            except fsdp_bridge.ConfigError as err:
                out["mixed_refused"] = str(err)
        opt = torch.optim.AdamW([{"params": group} for group in kinds if group], lr=1e-2)
        losses = []
        for _ in range(steps):
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        # A forward without gradients and a generate() leave the parameters the optimizer's.
        with torch.no_grad():
            model(**batch)
        if not isinstance(model, FullyShardedDataParallel):  # FSDP1's root generates under summon_full_params only
            model.generate(input_ids=prompt, max_new_tokens=2, do_sample=False)  # type: ignore[operator]
        optim_state_keys.append(len(get_optimizer_state_dict(model, opt)["state"]))
        return losses

    def sample(summon: Any) -> object:
        # FSDP1 with bf16 compute and fp32 parameters: under summon_full_params(recurse=False) the root's own
        # parameters are whole in fp32 and its units' in bf16, and torch's FSDP1 casts no unit's inputs.
        try:
            with summon:
                return tuple(model.generate(input_ids=prompt, max_new_tokens=2, do_sample=False).shape)  # type: ignore[operator]
        except RuntimeError as err:
            return "dtype mismatch" if "dtype" in str(err) else str(err)

    model = FullyShardedDataParallel(build_tiny("llama", seed=0), **kwargs())  # type: ignore[arg-type]
    out["raw"] = train(model)
    out["recurse_false_raw"] = sample(
        FullyShardedDataParallel.summon_full_params(model, recurse=False, writeback=False)
    )
    for backend in ("fsdp1", "fsdp2"):
        config = BridgeConfig.from_fsdp1(backend=backend, **kwargs())
        model = fsdp_bridge.shard(build_tiny("llama", seed=0), config)
        out[f"bridge_{backend}"] = train(model)
        out[f"recurse_false_{backend}"] = sample(fsdp_bridge.summon_full_params(model, recurse=False))
        base = BridgeConfig(backend=backend, device=device, sync_module_states=True)
        model = fsdp_bridge.shard(build_tiny("llama", seed=0), base.replace(ignored_modules=["model.norm.weight"]))
        norm = [p for n, p in model.named_parameters() if n.endswith("model.norm.weight")]
        out[f"ignored_{backend}"] = [p.device.type == device and p.numel() == 32 for p in norm] == [True] and len(
            train(model, 2)
        ) == 2
        mesh = init_device_mesh(device, (1, 1), mesh_dim_names=("dp", "tp"))
        out[f"submesh_{backend}"] = train(fsdp_bridge.shard(build_tiny("llama", seed=0), base, mesh=mesh["dp"]), 2)
        group_mesh = fsdp_bridge.mesh_from_process_group(dist.new_group([0]))
        out[f"group_{backend}"] = train(fsdp_bridge.shard(build_tiny("llama", seed=0), base, mesh=group_mesh), 2)
    return out


def test_cuda_fsdp1_arguments_migrate() -> None:
    (out,) = run_distributed(_cuda_fsdp1_migration, 1, backend="nccl")
    # bf16 compute: the same model, data and seed through FSDP1 and the bridge on either backend.
    for backend in ("fsdp1", "fsdp2"):
        torch.testing.assert_close(out[f"bridge_{backend}"], out["raw"], rtol=2e-2, atol=2e-2)
        assert out[f"ignored_{backend}"]
        for key in (f"submesh_{backend}", f"group_{backend}"):
            losses = out[key]
            assert isinstance(losses, list) and losses[-1] < losses[0], key
    # Generation under summon_full_params(recurse=False): the bridge's FSDP1 does what torch's does; FSDP2
    # gathers the root in bf16 (its unshard), so the same call generates.
    assert out["recurse_false_fsdp1"] == out["recurse_false_raw"]
    assert out["recurse_false_fsdp2"] == (1, 6)
    if torch.cuda.is_available():  # not on the CPU (one tensor at a time there)
        assert "give the plain tensors a group of their own" in str(out["mixed_refused"])
    keys = out["optim_state_keys"]
    assert isinstance(keys, list) and len(set(keys)) == 1 and keys[0] > 0, keys


def _float8_losses(recipe: str | None) -> list[float]:
    config = BridgeConfig(backend="fsdp2", mixed_precision="bf16", float8=recipe, device="cuda")
    model = fsdp_bridge.shard(build_tiny("llama", seed=0), config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = {k: v.cuda() for k, v in sample_batch().items()}
    losses = []
    for _ in range(4):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_trains_like_bf16_where_the_gpu_has_float8(recipe: str) -> None:
    pytest.importorskip("torchao")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need a GPU of compute capability 8.9+")
    (float8,) = run_distributed(_float8_losses, 1, args=(recipe,), backend="nccl")
    (bf16,) = run_distributed(_float8_losses, 1, args=(None,), backend="nccl")
    assert float8[-1] < float8[0]
    # float8 keeps 3-4 significant bits per element, scaled per tensor or row: a few percent of the loss.
    torch.testing.assert_close(float8, bf16, rtol=5e-2, atol=0)
