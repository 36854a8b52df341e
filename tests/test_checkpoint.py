"""save_checkpoint / load_checkpoint: round trips, resume, cross-backend and cross-world-size loads.

Multi-rank on CPU with gloo.  Each spawned run does several checks to amortise start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import fsdp_bridge
from fsdp_bridge.testing import run_distributed
from fsdp_bridge.testing.models import build_tiny, sample_batch

BACKENDS = ("fsdp1", "fsdp2")


def _make(backend: str, family: str = "llama", seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    config = fsdp_bridge.BridgeConfig(backend=backend, wrap="auto", device="cpu")
    model = fsdp_bridge.shard(build_tiny(family, seed=seed), config)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, family: str = "llama") -> list[float]:
    losses = []
    for step in range(steps):
        batch = sample_batch(family, seed=100 * step + dist.get_rank())
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Full model and optimizer state as NumPy arrays (every rank gets a copy).

    NumPy, not tensors: tensors passed between processes go through shared memory that
    disappears when the rank exits."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    out = {"model": {k: v.numpy().copy() for k, v in get_model_state_dict(model, options=opts).items()}}
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer, options=opts)
        out["optim"] = {f"{fqn}/{k}": v.numpy().copy() for fqn, s in osd["state"].items() for k, v in s.items()}
    return out


def assert_same(got: dict[str, Any], want: dict[str, Any], label: str) -> None:
    for part in want:
        assert set(got[part]) == set(want[part]), f"{label}: {part} keys differ"
        for key, value in want[part].items():
            assert np.array_equal(got[part][key], value), f"{label}: {part} {key} differs"


# --------------------------------------------------------------------------------------
# round trip and cross-backend at one world size, and saves for the cross-world loads
# --------------------------------------------------------------------------------------


def _save_each(root: str, backends: tuple[str, ...]) -> dict[str, Any]:
    world = dist.get_world_size()
    refs = {}
    for backend in backends:
        model, optimizer = _make(backend)
        _train(model, optimizer, 2)
        for kind in ("sharded", "full"):
            name = f"{backend}_w{world}_{kind}"
            fsdp_bridge.save_checkpoint(Path(root) / name, model, optimizer, kind=kind, state={"step": 2, "name": name})
        refs[f"{backend}_w{world}"] = full_state(model, optimizer)
    return refs


def _load_each(root: str, refs: dict[str, Any], backends: tuple[str, ...]) -> list[str]:
    import fsdp_bridge.checkpoint._load_files as ckpt_api

    ckpt_api._CHUNK_NUMEL = 5000  # full loads then broadcast in several rounds, as for a large model
    checked = []
    for source, want in refs.items():
        for kind in ("sharded", "full"):
            for backend in backends:
                model, optimizer = _make(backend, seed=7)
                _train(model, optimizer, 1)  # different weights and optimizer state to overwrite
                # At world 2, straight into the live state (all_or_nothing=False): the same bits.
                state = fsdp_bridge.load_checkpoint(
                    Path(root) / f"{source}_{kind}", model, optimizer, all_or_nothing=dist.get_world_size() != 2
                )
                assert state == {"step": 2, "name": f"{source}_{kind}"}, state
                assert_same(
                    full_state(model, optimizer), want, f"{source}_{kind} -> {backend}_w{dist.get_world_size()}"
                )
                checked.append(f"{source}_{kind}->{backend}_w{dist.get_world_size()}")
    return checked


def _save_and_roundtrip(root: str, backends: tuple[str, ...]) -> dict[str, Any]:
    refs = _save_each(root, backends)
    checked = _load_each(root, refs, BACKENDS)
    return {"refs": refs, "checked": checked}


def _load_only(root: str, refs: dict[str, Any]) -> list[str]:
    return _load_each(root, refs, BACKENDS)


def _pretrained_in_and_out(root: str) -> list[str]:
    """A Hugging Face directory (several files) into each backend with the layouts whose shards
    differ (replicated, hybrid 2 x 2, offloaded), each rank reading only its slices; then
    ``kind="full"``, assembled from every rank's slices, must hold the same tensors bit for bit,
    in the same files."""
    from transformers import AutoModelForCausalLM

    from fsdp_bridge.checkpoint._hf import read_hf_weights, read_weight_map

    source = Path(root) / "pretrained"
    plain = build_tiny("llama", seed=11)
    if dist.get_rank() == 0:
        plain.save_pretrained(source, max_shard_size="30KB")
    dist.barrier()
    want = read_hf_weights(source)
    wrong = []
    for backend in BACKENDS:
        for strategy, offload in (("no_shard", False), ("hybrid_shard", True), ("full_shard", True)):
            config = fsdp_bridge.BridgeConfig(
                backend=backend,
                strategy=strategy,
                cpu_offload=offload,
                activation_checkpointing=strategy == "full_shard",  # wrapper names in the model
                device="cpu",
            )
            model = fsdp_bridge.load_pretrained(lambda: AutoModelForCausalLM.from_config(plain.config), source, config)
            out = Path(root) / f"export_{backend}_{strategy}_{offload}"
            # No max_shard_size: the files the weights came from (the source's index).
            fsdp_bridge.save_checkpoint(out, model, kind="full")
            got = read_hf_weights(out)
            if set(got) != set(want) or not all(torch.equal(got[k], want[k]) for k in want):
                wrong.append(out.name)
            if read_weight_map(out) != read_weight_map(source):
                wrong.append(f"{out.name}: file layout")
    return wrong


def _save_and_load(root: str, backends: tuple[str, ...], refs: dict[str, Any]) -> dict[str, Any]:
    own = _save_each(root, backends)
    checked = _load_each(root, {**refs, **own}, BACKENDS)
    # HYBRID 2 x 2 (the replicas split the writing) with AdamW, both backends: the full export
    # written in place is byte for byte the one written through torch's state dicts.
    in_place_wrong = []
    for backend in BACKENDS:
        config = fsdp_bridge.BridgeConfig(backend=backend, strategy="hybrid_shard", hybrid_shape=(2, 2), device="cpu")
        model = fsdp_bridge.shard(build_tiny("llama", seed=2), config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train(model, optimizer, 1)
        in_place_wrong += _export_both_ways(root, f"hybrid_{backend}", model, optimizer)
    return {
        "refs": own,
        "checked": checked,
        "pretrained_wrong": _pretrained_in_and_out(root),
        "in_place_wrong": in_place_wrong,
    }


def test_round_trip_and_cross_backend_matrix(tmp_path: Path) -> None:
    """Both kinds, both backends: bit-identical after save/load, also across backend and world size.

    Saves at world 2 (both backends) and world 4 (FSDP1); loads at world 2, 4 and 1 into both
    backends (the full 1/2/4 x 1/2/4 matrix is test_cross_world_matrix_full, marked slow).  At
    world 4 also: pretrained weights in and a full export out, bit for bit, across layouts, and
    the in-place full export of HYBRID 2 x 2 with AdamW (both backends) against torch's state dicts.
    """
    root = str(tmp_path)
    out2 = run_distributed(_save_and_roundtrip, 2, args=(root, BACKENDS), timeout_s=600)[0]
    assert len(out2["checked"]) == 2 * 2 * 2  # round trip + FSDP1 <-> FSDP2 at world 2, both kinds
    out4 = run_distributed(_save_and_load, 4, args=(root, ("fsdp1",), out2["refs"]), timeout_s=600)[0]
    checked = out4["checked"]
    assert out4["pretrained_wrong"] == []
    assert out4["in_place_wrong"] == []
    checked += run_distributed(_load_only, 2, args=(root, out4["refs"]), timeout_s=600)[0]
    checked += run_distributed(_load_only, 1, args=(root, {**out2["refs"], **out4["refs"]}), timeout_s=600)[0]
    for case in (
        "fsdp1_w4_sharded->fsdp2_w2",
        "fsdp2_w2_full->fsdp1_w4",
        "fsdp2_w2_sharded->fsdp2_w4",
        "fsdp1_w4_full->fsdp2_w1",
        "fsdp2_w2_sharded->fsdp1_w1",
        "fsdp1_w4_full->fsdp1_w2",
    ):
        assert case in checked, case


@pytest.mark.slow
def test_cross_world_matrix_full(tmp_path: Path) -> None:
    """Every (backend, world) in {fsdp1, fsdp2} x {1, 2, 4} saves; every one loads every checkpoint."""
    root = str(tmp_path)
    refs: dict[str, Any] = {}
    for world in (1, 2, 4):
        refs.update(run_distributed(_save_each, world, args=(root, BACKENDS), timeout_s=900)[0])
    for world in (1, 2, 4):
        checked = run_distributed(_load_only, world, args=(root, refs), timeout_s=900)[0]
        assert len(checked) == len(refs) * 2 * 2


# --------------------------------------------------------------------------------------
# resume
# --------------------------------------------------------------------------------------


def _resume_batch(step: int) -> dict[str, torch.Tensor]:
    # Drawn from the global RNG on purpose: resuming must restore every rank's RNG state.
    ids = torch.randint(4, 96, (2, 16))
    return {"input_ids": ids, "labels": ids.clone()}


def _resume_steps(model: Any, optimizer: Any, scheduler: Any, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        loss = model(**_resume_batch(step)).loss
        loss.backward()
        fsdp_bridge.clip_grad_norm_(model, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _resume_first(root: str) -> dict[str, dict[str, list[float]]]:
    out = {}
    for backend in BACKENDS:
        torch.manual_seed(1234 + dist.get_rank())
        model, optimizer = _make(backend)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=5)
        straight = _resume_steps(model, optimizer, scheduler, 0, 6)

        torch.manual_seed(1234 + dist.get_rank())
        model, optimizer = _make(backend)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=5)
        first = _resume_steps(model, optimizer, scheduler, 0, 3)
        state = {"step": 3, "scheduler": scheduler.state_dict(), "data": {"epoch": 0, "index": 3}}
        for kind in ("sharded", "full"):
            fsdp_bridge.save_checkpoint(Path(root) / f"{backend}_{kind}", model, optimizer, kind=kind, state=state)
        out[backend] = {"straight": straight, "first": first}
    return out


def _resume_second(root: str) -> dict[str, list[float]]:
    out = {}
    for backend in BACKENDS:
        for kind in ("sharded", "full"):
            torch.manual_seed(999)  # a different RNG state: the checkpoint must restore the saved one
            model, optimizer = _make(backend, seed=3)
            scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=5)
            state = fsdp_bridge.load_checkpoint(Path(root) / f"{backend}_{kind}", model, optimizer)
            scheduler.load_state_dict(state["scheduler"])
            assert state["step"] == 3 and state["data"] == {"epoch": 0, "index": 3}
            out[f"{backend}_{kind}"] = _resume_steps(model, optimizer, scheduler, state["step"], 6)
    return out


def test_resume_continues_exactly(tmp_path: Path) -> None:
    """6 steps straight == 3 steps, save, a new process group, load, 3 more steps: same losses,
    for both kinds and both backends (the data comes from the restored per-rank RNG)."""
    first = run_distributed(_resume_first, 2, args=(str(tmp_path),))
    second = run_distributed(_resume_second, 2, args=(str(tmp_path),))
    for rank in range(2):
        for backend in BACKENDS:
            straight = first[rank][backend]["straight"]
            assert first[rank][backend]["first"] == straight[:3]
            assert len(set(straight)) == 6
            for kind in ("sharded", "full"):
                assert second[rank][f"{backend}_{kind}"] == straight[3:], (backend, kind, rank)


class _WithBuffers(torch.nn.Module):
    """Persistent buffers (an int64 0-dim one among them), which FSDP1 casts to the mixed
    precision buffer dtype and its state dict casts back only where their unit holds parameters
    (``root_param``), a BatchNorm (FSDP1 makes it a unit of its own in full precision); the last
    layer is the one the tests ignore (neither sharded nor cast).  ``gain`` has one row: FSDP2's
    second rank holds none of it."""

    def __init__(self, root_param: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.gain = torch.nn.Parameter(torch.randn(1, 5)) if root_param else None
        self.inp = torch.nn.Linear(13, 37)
        self.norm = torch.nn.BatchNorm1d(37)
        self.mid = torch.nn.Linear(37, 29)
        self.out = torch.nn.Linear(29, 5)
        self.register_buffer("scale", torch.randn(7, 3))
        self.register_buffer("count", torch.tensor(5))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.out(self.mid(self.norm(self.inp(x))).float())
        return y * self.gain if self.gain is not None else y


def _export_both_ways(
    root: str, label: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, optimizer_in_place: bool = True
) -> list[str]:
    """A full export written in place (each rank's flat ranges under FSDP1, row shards under
    FSDP2) must be byte for byte the one written through torch's sharded state dicts (the backend
    methods switched off): weights, index, optimizer tensors and optimizer.json."""
    from fsdp_bridge.api import get_bridge

    bridge = get_bridge(model)
    impl = type(bridge.impl)
    wrong = []
    if bridge.impl.export_pieces(bridge.model) is None:
        wrong.append(f"{label}: the weights were not written in place")
    if (bridge.impl.export_optimizer_pieces(bridge.model, optimizer) is not None) != optimizer_in_place:
        wrong.append(f"{label}: the optimizer state went {'through torch' if optimizer_in_place else 'in place'}")
    fsdp_bridge.save_checkpoint(Path(root) / f"{label}_in_place", model, optimizer, kind="full", max_shard_size="40KB")
    saved = impl.export_pieces, impl.export_optimizer_pieces
    impl.export_pieces = lambda self, model: None  # type: ignore[method-assign]
    impl.export_optimizer_pieces = lambda self, model, optimizer: None  # type: ignore[method-assign]
    try:
        fsdp_bridge.save_checkpoint(Path(root) / f"{label}_torch", model, optimizer, kind="full", max_shard_size="40KB")
    finally:
        impl.export_pieces, impl.export_optimizer_pieces = saved  # type: ignore[method-assign]
    mine, torchs = Path(root) / f"{label}_in_place", Path(root) / f"{label}_torch"
    names = sorted(
        p.name for p in torchs.iterdir() if p.suffix in (".safetensors", ".json") and p.name != "fsdp_bridge.json"
    )
    if sorted(p.name for p in mine.glob("*.safetensors")) != [n for n in names if n.endswith(".safetensors")]:
        wrong.append(f"{label}: files")
    wrong += [f"{label}: {n}" for n in names if (mine / n).read_bytes() != (torchs / n).read_bytes()]
    return wrong


def _exports_in_place(root: str) -> list[str]:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from fsdp_bridge.api import get_bridge

    wrong: list[str] = []

    def trained(model: torch.nn.Module, optimizer: torch.optim.Optimizer, family: str | None) -> None:
        for step in range(2):
            if family is None:
                # The same data on every rank: the ignored layer and BatchNorm's statistics are
                # not synchronised, and the optimizer's DCP path writes one rank's copy of them.
                loss = model(torch.randn(4, 13, generator=torch.Generator().manual_seed(step))).sum()
            else:
                loss = model(**sample_batch(family, seed=10 * step + dist.get_rank())).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    # FSDP1: tied GPT-2 in several files with AdamW; Adagrad (state on every parameter from the
    # start, 'step' stays 0 on the rank whose shard misses a parameter) in two groups under
    # SHARD_GRAD_OP and activation checkpointing; NO_SHARD (ranks split the writing).  FSDP2:
    # tied GPT-2 offloaded to CPU; NO_SHARD (the (2, 1) mesh: replicas split the writing) with
    # bf16 mixed precision and activation checkpointing (wrapper names).
    for backend, family, strategy, extra in (
        ("fsdp1", "gpt2", "full_shard", {}),
        ("fsdp1", "llama", "shard_grad_op", {"activation_checkpointing": True}),
        ("fsdp1", "llama", "no_shard", {}),
        ("fsdp2", "gpt2", "full_shard", {"cpu_offload": True}),
        (
            "fsdp2",
            "llama",
            "no_shard",
            {
                "activation_checkpointing": True,
                "mixed_precision": fsdp_bridge.MixedPrecisionConfig(param_dtype=torch.bfloat16),
            },
        ),
    ):
        config = fsdp_bridge.BridgeConfig(backend=backend, strategy=strategy, device="cpu", **extra)
        model = fsdp_bridge.shard(build_tiny(family, seed=4), config)
        if family == "llama" and strategy == "shard_grad_op":
            decay = [p for n, p in model.named_parameters() if "norm" not in n]
            rest = [p for n, p in model.named_parameters() if "norm" in n]
            optimizer: torch.optim.Optimizer = torch.optim.Adagrad(
                [{"params": decay, "weight_decay": 0.01}, {"params": rest, "lr": 0.05}], lr=0.1
            )
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        trained(model, optimizer, family)
        # FSDP1 NO_SHARD keeps optimizer states shaped like the parameters: torch's path.
        in_place = (backend, strategy) != ("fsdp1", "no_shard")
        wrong += _export_both_ways(
            root, f"{backend}_{family}_{strategy}", model, optimizer, optimizer_in_place=in_place
        )
    # Mixed precision with buffers cast to bf16 (FSDP1 casts them back only where their unit
    # holds parameters), int64 buffers (torch's assembly cannot write them: against the full state
    # dicts instead), FULL_SHARD and NO_SHARD.  An ignored module (its optimizer state: torch's
    # optimizer state dict), except under FSDP2 FULL_SHARD, whose AdamW state goes in place with
    # the rest, a parameter of one row among them (rank 1 holds none of it).
    for backend, strategy, root_param, ignored in (
        ("fsdp1", "full_shard", True, True),
        ("fsdp1", "no_shard", False, True),
        ("fsdp2", "full_shard", True, False),
        ("fsdp2", "no_shard", False, True),
    ):
        config = fsdp_bridge.BridgeConfig(
            backend=backend,
            strategy=strategy,
            wrap=fsdp_bridge.WrapPolicy(mode="classes", classes=("Linear",)),
            mixed_precision=fsdp_bridge.MixedPrecisionConfig(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16),
            ignored_modules=("out",) if ignored else (),
            device="cpu",
        )
        model = fsdp_bridge.shard(_WithBuffers(root_param), config)
        if ignored:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        trained(model, optimizer, None)
        label = f"buffers_{backend}_{strategy}"
        bridge = get_bridge(model)
        if bridge.impl.export_pieces(bridge.model) is None:
            wrong.append(f"{label}: the weights were not written in place")
        if (bridge.impl.export_optimizer_pieces(bridge.model, optimizer) is None) != ignored:
            wrong.append(f"{label}: the optimizer state went {'the other way' if ignored else 'through torch'}")
        out = Path(root) / label
        fsdp_bridge.save_checkpoint(out, model, optimizer, kind="full")
        options = StateDictOptions(full_state_dict=True)
        want = get_model_state_dict(model, options=options)
        osd = get_optimizer_state_dict(model, optimizer, options=options)
        want.update({f"{fqn}/{k}": v for fqn, st in osd["state"].items() for k, v in st.items()})
        got = {**load_file(out / "model.safetensors"), **load_file(out / "optimizer.safetensors")}
        if set(got) != set(want):
            wrong.append(f"{label}: names {sorted(set(got) ^ set(want))}")
        for k in set(got) & set(want):
            if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k]):
                wrong.append(f"{label}: {k}")
    # Sharded by torch directly on dim 1 (a layout no rank writes in place): torch's assembly would
    # fail on BatchNorm's int64 counter, so the save is refused first, naming it and the fix.
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.BatchNorm1d(8))
    fully_shard(model, shard_placement_fn=lambda param: Shard(1) if param.dim() == 2 else None)
    try:
        fsdp_bridge.save_checkpoint(Path(root) / "dim1", model, kind="full")
        wrong.append("dim1: saved")
    except fsdp_bridge.CheckpointError as err:
        if "1.num_batches_tracked has dtype torch.int64" not in str(err) or "kind='sharded'" not in str(err):
            wrong.append(f"dim1: {err}")
    return wrong


def test_full_export_writes_shards_in_place(tmp_path: Path) -> None:
    assert run_distributed(_exports_in_place, 2, args=(str(tmp_path),), timeout_s=600) == [[], []]


def test_full_export_of_a_plain_model_with_integer_buffers(tmp_path: Path) -> None:
    """A model that is not sharded is written whole by rank 0, integer tensors included (torch's
    safetensors assembly cannot write BatchNorm's int64 counter)."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    fsdp_bridge.save_checkpoint(tmp_path / "plain", model, optimizer, kind="full")
    got = load_file(tmp_path / "plain" / "model.safetensors")
    want = model.state_dict()
    assert list(got) == list(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    assert got["1.num_batches_tracked"].item() == 1
    moments = load_file(tmp_path / "plain" / "optimizer.safetensors")
    assert torch.equal(moments["0.weight/exp_avg"], optimizer.state[model[0].weight]["exp_avg"])


def _buffer_dtypes_back() -> dict[str, Any]:
    """FSDP1's buffer_dtype: buffers computed in it, state dicts in the dtype they had; the fsdp2 backend's
    state dict, full export and fsdp_bridge.full_state_dict give them back the same way."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out: dict[str, Any] = {}
    for backend in ("fsdp1", "fsdp2"):
        model = fsdp_bridge.shard(
            _WithBuffers(root_param=True),
            fsdp_bridge.BridgeConfig(backend=backend, mixed_precision={"buffer_dtype": "bf16"}, wrap="none"),
        )
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        out[f"{backend} state dict"] = str(full["scale"].dtype)
        out[f"{backend} bridge full"] = str(fsdp_bridge.full_state_dict(model)["scale"].dtype)
        if backend == "fsdp2":
            out["fsdp2 live"] = str(model.scale.dtype)
            pieces = fsdp_bridge.get_bridge(model).impl.export_pieces(model)
            out["fsdp2 export"] = str(pieces["scale"].dtype) if pieces is not None else "none"
    return out


def test_buffers_cast_for_compute_are_saved_in_their_own_dtype(run_on_ranks) -> None:
    for result in run_on_ranks(_buffer_dtypes_back, 2):
        assert result["fsdp2 live"] == "torch.bfloat16"  # computed in buffer_dtype, as FSDP1 does
        for key in ("fsdp1 state dict", "fsdp2 state dict", "fsdp2 bridge full", "fsdp2 export"):
            assert result[key] == "torch.float32", (key, result)
