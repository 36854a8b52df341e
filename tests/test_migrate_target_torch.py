"""``migrate code --fix --target torch``: plain FSDP2 code, one construct at a time (one process), the generated
helper module against the bridge's own decisions, and one FSDP1 script run before and after (2 gloo ranks)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_bridge.cli import main
from fsdp_bridge.config import WrapPolicy
from fsdp_bridge.migrate._code import TODO, migrate_paths, migrate_source
from fsdp_bridge.migrate._report import CodeReport
from fsdp_bridge.migrate._torch_helpers import HELPERS_MARKER, HELPERS_NAME, HELPERS_SOURCE
from fsdp_bridge.migrate._torch_target import imports_of
from fsdp_bridge.strategy import ShardingStrategy
from fsdp_bridge.wrap import resolve_wrap

FIXTURES = Path(__file__).parent / "fixtures"
FSDP2_NAMES = {"FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy", "fully_shard"}

HEAD = """\
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy
from functools import partial


class Block(nn.Module):
    pass


"""


def torch_target(body: str, path: str = "train.py") -> tuple[str, list[str]]:
    """The torch target's rewrite of ``HEAD + body`` and its report lines."""
    result = migrate_source(HEAD + textwrap.dedent(body), path, target="torch")
    return result.fixed, [f.format() for f in result.findings]


def assert_plain_torch(code: str) -> None:
    """Neither fsdp_bridge nor any FSDP1 name is imported."""
    for name in imports_of(code):
        assert not name.startswith("fsdp_bridge"), name
        if name.startswith("torch.distributed.fsdp"):
            assert name.rpartition(".")[2] in FSDP2_NAMES and name.count(".") == 3, name
    assert "fsdp_bridge." not in code and "FSDP(" not in code


def test_constructor_becomes_fully_shard_through_the_helper_module() -> None:
    code, report = torch_target(
        """
        model = FSDP(
            nn.Sequential(Block()),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,  # ZeRO-2
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
        """
    )
    assert_plain_torch(code)
    assert "import _fsdp2_helpers" in code
    assert "from torch.distributed.fsdp import MixedPrecisionPolicy" in code
    assert '_fsdp2_helpers.data_parallel_mesh("shard_grad_op", "cpu"),  # ZeRO-2' in code  # comments kept
    assert "wrap_classes=(Block,)" in code
    assert "reshard_after_forward=False" in code
    flat = " ".join(code.split())  # one argument per line when long
    assert (
        "mp_policy=MixedPrecisionPolicy( param_dtype=torch.bfloat16, reduce_dtype=torch.float32, "
        "cast_forward_inputs=False, )," in flat  # FSDP1's default: only the root casts its inputs
    )
    assert any("[fix] FSDP(...) -> _fsdp2_helpers.shard_model(...): torch's fully_shard" in r for r in report)
    assert not any("[todo]" in r for r in report)


@pytest.mark.parametrize(
    ("member", "strategy"),
    [("FULL_SHARD", "full_shard"), ("NO_SHARD", "no_shard"), ("HYBRID_SHARD", "hybrid_shard")],
)
def test_strategy_mesh_and_reshard_follow_the_mapping(member: str, strategy: str) -> None:
    code, _ = torch_target(f"model = FSDP(nn.Linear(2, 2), sharding_strategy=ShardingStrategy.{member})\n")
    assert_plain_torch(code)
    assert f'mesh=_fsdp2_helpers.data_parallel_mesh("{strategy}")' in code
    units = ShardingStrategy(strategy).reshards_after_forward or strategy == "no_shard"
    assert f"reshard_after_forward={units}" in code


def test_hybrid_with_a_device_mesh_passes_the_mesh() -> None:
    code, _ = torch_target(
        "model = FSDP(nn.Linear(2, 2), device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD)\n"
    )
    assert_plain_torch(code)
    assert "mesh=mesh," in code and "hybrid_shape" not in code


def test_size_policy_offload_prefetch_and_sync() -> None:
    code, _ = torch_target(
        """
        model = FSDP(
            nn.Linear(2, 2),
            auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=1000),
            cpu_offload=CPUOffload(offload_params=True),
            backward_prefetch=None,
            forward_prefetch=True,
            sync_module_states=True,
            limit_all_gathers=True,
        )
        """
    )
    assert_plain_torch(code)
    assert "wrap_min_num_params=1000" in code
    assert "offload_policy=CPUOffloadPolicy(pin_memory=True)" in code
    assert "backward_prefetch=False" in code
    assert "forward_prefetch=True" in code and "sync_module_states=True" in code
    assert "limit_all_gathers" not in code  # not needed on FSDP2


def test_offload_on_a_cpu_run_is_dropped_and_said() -> None:
    code, report = torch_target(
        'model = FSDP(nn.Linear(2, 2), cpu_offload=CPUOffload(offload_params=True), device_id=torch.device("cpu"))\n'
    )
    assert "offload_policy" not in code
    assert any("cpu_offload: not needed on a CPU run" in r for r in report)


def test_no_sync_clip_isinstance_and_state_dict() -> None:
    code, report = torch_target(
        """
        from torch.distributed.fsdp import StateDictType

        model = FSDP(nn.Linear(2, 2))
        with model.no_sync():
            model(torch.ones(2)).sum().backward()
        norm = model.clip_grad_norm_(1.0, 2.0)
        assert isinstance(model, FSDP)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            state = model.state_dict()
        """
    )
    assert_plain_torch(code)
    assert "with _fsdp2_helpers.no_sync(model):" in code
    assert "norm = _fsdp2_helpers.clip_grad_norm_(model, 1.0, 2.0)" in code
    assert "isinstance(model, FSDPModule)" in code
    assert "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True" in code
    assert not any("[todo]" in r for r in report)


def test_a_class_of_the_files_own_named_fsdpmodule_is_not_taken_for_torchs() -> None:
    # The file defines its own FSDPModule (a trainer class): importing torch's under that name would be
    # shadowed by the class, and every isinstance / annotation would test the trainer class instead.
    source = (
        "from torch import nn\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "class FSDPModule:\n"
        "    def build(self, net: nn.Module) -> None:\n"
        "        self.model = FSDP(net)\n\n"
        "    def check(self, part: FSDP) -> bool:\n"
        "        return isinstance(self.model, FSDP) and part is not None\n"
    )
    code = migrate_source(source, "trainer.py", target="torch").fixed
    assert "import torch.distributed.fsdp\n" in code and "import FSDPModule" not in code
    assert "isinstance(self.model, torch.distributed.fsdp.FSDPModule)" in code
    assert "part: torch.distributed.fsdp.FSDPModule" in code
    assert "class FSDPModule:" in code
    assert migrate_source(code, "trainer.py", target="torch").fixed == code


SCALERS = """
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def make(enabled: bool) -> ShardedGradScaler:
    return ShardedGradScaler(enabled=enabled)


scaler = ShardedGradScaler("cpu", 1024.0, 0.25, 4.0)
grouped = ShardedGradScaler(init_scale=8.0, process_group=group)
Scaler = ShardedGradScaler
default_group = ShardedGradScaler(enabled=True, process_group=None)
"""


def test_sharded_grad_scaler_is_the_bridges_and_plain_torchs_only_under_target_torch() -> None:
    # The bridge target: fsdp_bridge.GradScaler, right on the fsdp1 backend's flat shards too (torch.amp's
    # GradScaler would let one rank step alone there), with every argument kept, process_group= included.
    bridge = migrate_source(SCALERS, "s.py").fixed
    assert "def make(enabled: bool) -> fsdp_bridge.GradScaler:" in bridge
    assert "return fsdp_bridge.GradScaler(enabled=enabled)" in bridge
    assert 'scaler = fsdp_bridge.GradScaler("cpu", 1024.0, 0.25, 4.0)' in bridge
    assert "grouped = fsdp_bridge.GradScaler(init_scale=8.0, process_group=group)" in bridge
    assert "Scaler = fsdp_bridge.GradScaler\n" in bridge
    assert "ShardedGradScaler" not in bridge and "torch.amp" not in bridge and TODO not in bridge
    # The torch target: the helpers' torch.amp.GradScaler (float16 gradients unscaled, as ShardedGradScaler
    # does), its arguments past the device named (the two classes order backoff_factor and growth_factor
    # differently); a call with a group stays on the bridge with a TODO.
    result = migrate_source(SCALERS, "s.py", target="torch")
    code = result.fixed
    assert "def make(enabled: bool) -> _fsdp2_helpers.GradScaler:" in code
    assert "return _fsdp2_helpers.GradScaler(enabled=enabled)" in code
    assert 'scaler = _fsdp2_helpers.GradScaler("cpu", init_scale=1024.0, backoff_factor=0.25, growth_factor=4.0)' in (
        code
    )
    assert "Scaler = _fsdp2_helpers.GradScaler\n" in code
    assert "default_group = _fsdp2_helpers.GradScaler(enabled=True)\n" in code  # the default group: dropped
    assert "grouped = fsdp_bridge.GradScaler(init_scale=8.0, process_group=group)" in code
    assert f"# {TODO}: fsdp_bridge.GradScaler(...): kept on fsdp_bridge under --target torch: process_group=" in code
    assert [f.line for f in result.findings if not f.fixable] == [10]  # the grouped one
    assert migrate_source(code, "s.py", target="torch").fixed == code
    # A tree sharding over groups of some ranks (model-parallel slices): ShardedGradScaler agreed on an overflow
    # over every rank, FSDP2's gradients over their own mesh only: the bridge's scaler stays, with a TODO.
    grouped, lines = torch_target(
        "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n"
        "model = FSDP(nn.Linear(2, 2), process_group=dp_group)\nscaler = ShardedGradScaler()\n"
    )
    assert "scaler = fsdp_bridge.GradScaler()" in grouped
    assert migrate_source(grouped, "train.py", target="torch").fixed == grouped
    assert any("model-parallel slices could skip different steps" in line for line in lines)


def test_the_scaler_of_a_tree_whose_models_stay_fsdp1s_stays_on_the_bridge(tmp_path: Path) -> None:
    # The tree wraps with its own subclass of FSDP1's wrapper (left as written, a TODO): its models stay FSDP1's,
    # whose gradients are each rank's flat shard; torch.amp's scaler would check each shard alone for an overflow
    # (ranks skipping different steps), ShardedGradScaler agrees over the ranks: the bridge's scaler (its subclass).
    (tmp_path / "fsdp.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "class Wrapper(FSDP):\n    pass\n\n\ndef wrap(model):\n    return Wrapper(model)\n"
    )
    (tmp_path / "solver.py").write_text(
        "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n\n\n"
        "def make():\n    return ShardedGradScaler()\n"
    )
    migrate_paths([tmp_path], fix=True, target="torch")
    fixed = (tmp_path / "solver.py").read_text()
    assert "    return fsdp_bridge.GradScaler()\n" in fixed and "_fsdp2_helpers" not in fixed
    assert "kept on fsdp_bridge under --target torch: this file uses torch's FSDP1" in fixed
    assert "ShardedGradScaler) agrees on it over the ranks" in fixed
    migrate_paths([tmp_path], fix=True, target="torch")
    assert (tmp_path / "solver.py").read_text() == fixed


def test_what_it_cannot_write_stays_on_the_bridge_with_a_todo() -> None:
    code, report = torch_target(
        """
        model = FSDP(nn.Linear(2, 2), **settings)
        with FSDP.summon_full_params(model):
            pass
        """
    )
    assert "fsdp_bridge.BridgeConfig.from_fsdp1(" in code and "import fsdp_bridge" in code
    assert f"# {TODO}: fsdp_bridge.shard(...): kept on fsdp_bridge under --target torch: " in code
    # the summon is the helper module's (plain torch, for fully_shard's models)
    assert "with _fsdp2_helpers.summon_full_params(model, writeback=True):" in code
    todos = [r for r in report if "[todo]" in r and "kept on fsdp_bridge under --target torch" in r]
    assert len(todos) == 1, report  # the constructor's own line


def test_a_constructor_left_as_fsdp1s_keeps_the_bridges_unwrap() -> None:
    # An FSDP1 constructor the rewrite cannot make (an argument FSDP1 no longer has) stays FSDP1's under a TODO:
    # its model is FSDP1's wrapper, so `model.module` must still reach the module inside it; plain `model`
    # loaded a checkpoint into the wrapper and skipped the wrapper's own weights.
    code, report = torch_target(
        """
        model = FSDP(nn.Linear(2, 2), some_old_argument=1)
        inner = model.module
        """
    )
    assert "model = FSDP(nn.Linear(2, 2), some_old_argument=1)" in code
    assert "inner = fsdp_bridge.unwrapped(model)" in code and "inner = model\n" not in code
    assert any("torch's FSDP1 (kept as written in the tree" in r for r in report), report


def test_bridge_target_is_the_default_and_unchanged() -> None:
    source = HEAD + "model = FSDP(nn.Linear(2, 2))\n"
    assert migrate_source(source, "t.py").fixed == migrate_source(source, "t.py", target="bridge").fixed
    assert "fsdp_bridge.shard(" in migrate_source(source, "t.py").fixed
    with pytest.raises(ValueError, match="target='jax': allowed bridge, torch"):
        migrate_source(source, "t.py", target="jax")


@pytest.mark.parametrize(
    "body",
    [
        "model = FSDP(nn.Linear(2, 2))\nmodel.clip_grad_norm_(1.0)\n",
        # the helper module's summon_full_params(model, ...) is not taken for FSDP1's, called through an instance
        """\
        def full(model):
            if isinstance(model, FSDP):
                with FSDP.summon_full_params(model):
                    return model.state_dict()
            return model.state_dict()
        """,
        # nor its clip_grad_norm_(model, max_norm) for FSDP1's method called on an unproven receiver
        """\
        def step(model, optimizer):
            if isinstance(model, FSDP):
                norm = model.clip_grad_norm_(1.0)
            optimizer.step()
        """,
    ],
)
def test_output_is_stable_under_a_second_run(body: str) -> None:
    first, _ = torch_target(body)
    second = migrate_source(first, "train.py", target="torch")
    assert second.fixed == first and not second.findings


def test_helper_module_is_plain_torch_and_resolves_units_as_the_bridge() -> None:
    assert HELPERS_SOURCE.startswith(HELPERS_MARKER)
    assert all(
        n.split(".")[0] in ("__future__", "contextlib", "dataclasses", "os", "collections", "typing", "torch")
        for n in imports_of(HELPERS_SOURCE)
    )
    helpers = types.ModuleType(HELPERS_NAME)
    exec(compile(HELPERS_SOURCE, f"{HELPERS_NAME}.py", "exec"), helpers.__dict__)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    model = nn.Sequential(nn.Embedding(10, 8), nn.ModuleList([Layer(), Layer()]), nn.Linear(8, 10))
    for policy, units in [
        (WrapPolicy(mode="classes", classes=("Layer",)), helpers.units_of_classes(model, [Layer])),
        (WrapPolicy(mode="min_params", min_num_params=50), helpers.units_of_size(model, 50)),
    ]:
        expected = [m for _, m in resolve_wrap(model, policy).units]
        assert [id(m) for m in units] == [id(m) for m in expected]
    model[2].weight = model[0].weight  # tied: neither end may be a unit of its own
    kept = helpers._keep_tied_together(model, helpers.units_of_size(model, 50))
    assert model[0] not in kept and model[2] not in kept

    class OwnClip(nn.Linear):  # an FSDP1 wrapper the migration kept (a TODO): its own clip, global over its shards
        def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
            return max_norm * 10 + norm_type

    assert helpers.clip_grad_norm_(OwnClip(2, 2), 1.0) == 12.0


def test_helper_module_computes_where_the_models_parameters_are(monkeypatch: pytest.MonkeyPatch) -> None:
    # FSDP1 computes on the GPU the parameters are on (model.to(rank) under mp.spawn, no set_device);
    # fully_shard on the current device: the helper makes the parameters' GPU current, unless a launcher's
    # LOCAL_RANK decides (the bridge does the same in shard(), see test_core_config). Under a launcher it sets
    # cuda:LOCAL_RANK itself: a public trainer moving its model to cuda:LOCAL_RANK without set_device (FSDP1's
    # device_id chose the GPU) had every rank's fully_shard on cuda:0.
    helpers = types.ModuleType(HELPERS_NAME)
    exec(compile(HELPERS_SOURCE, f"{HELPERS_NAME}.py", "exec"), helpers.__dict__)
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    on_gpu = types.SimpleNamespace(parameters=lambda: iter([types.SimpleNamespace(device=torch.device("cuda", 3))]))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    helpers.compute_where_placed(nn.Linear(2, 2))  # on the CPU: nothing to choose
    helpers.compute_where_placed(on_gpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # nothing set: GPU 0 on every rank
    monkeypatch.setenv("LOCAL_RANK", "1")
    helpers.compute_where_placed(on_gpu)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU shown to each process
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    helpers.compute_where_placed(on_gpu)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # the process chose cuda:3 and put the model there
    helpers.compute_where_placed(on_gpu)
    assert chosen == [torch.device("cuda", 3), 1, 0]


def test_paths_write_the_helper_module_once_and_never_over_the_users(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(HEAD + "model = FSDP(nn.Linear(2, 2))\n")
    (tmp_path / "b.py").write_text(HEAD + "model = FSDP(nn.Linear(2, 2))\n")
    migrate_paths([tmp_path], fix=True, target="torch")
    assert (pkg / f"{HELPERS_NAME}.py").read_text() == HELPERS_SOURCE
    assert (tmp_path / f"{HELPERS_NAME}.py").read_text() == HELPERS_SOURCE
    assert "from . import _fsdp2_helpers" in (pkg / "a.py").read_text()
    assert "import _fsdp2_helpers" in (tmp_path / "b.py").read_text()
    report, _ = migrate_paths([tmp_path], fix=True, target="torch")
    assert report.changed == []  # idempotent

    own = tmp_path / "own"
    own.mkdir()
    (own / f"{HELPERS_NAME}.py").write_text("x = 1\n")
    (own / "c.py").write_text(HEAD + "model = FSDP(nn.Linear(2, 2))\n")
    report, _ = migrate_paths([own], fix=True, target="torch")
    assert (own / f"{HELPERS_NAME}.py").read_text() == "x = 1\n"
    assert "FSDP(" in (own / "c.py").read_text()
    assert any("exists and was not written by the codemod" in why for _, why in report.skipped)


def test_cli_target_torch_diff(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "t.py").write_text(HEAD + "model = FSDP(nn.Linear(2, 2))\n")
    assert main(["migrate", "code", str(tmp_path), "--diff", "--target", "torch"]) == 1  # constructs to fix
    out = capsys.readouterr().out
    assert "_fsdp2_helpers.shard_model(" in out and f"+{HELPERS_MARKER}" in out
    assert not (tmp_path / f"{HELPERS_NAME}.py").exists()  # --diff writes nothing


@pytest.mark.timeout(900)
def test_fsdp1_script_gives_the_same_losses_after_target_torch(tmp_path: Path) -> None:
    """FSDP1 before, plain FSDP2 after (`migrate verify --target torch`, 2 gloo ranks): equal losses and weights;
    the migrated tree imports no fsdp_bridge."""
    from fsdp_bridge.migrate.verify import verify

    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(FIXTURES / "migrate_eject" / "eject_train.py", tree)
    result = verify(tree, "eject_train.py", nproc_per_node=2, target="torch", timeout=600)
    assert result.parity, result.format()
    assert "[todo]" not in result.fix_report
    assert len(result.fix_report) > 0
    _, results = migrate_paths([tree / "eject_train.py"], target="torch")
    assert_plain_torch(results[0].fixed)


def _helpers_against_bridge() -> list[tuple[str, float]]:
    """On each rank: the generated shard_model against fsdp_bridge.shard with the same FSDP1 settings."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import fsdp_bridge

    helpers = types.ModuleType(HELPERS_NAME)
    exec(compile(HELPERS_SOURCE, f"{HELPERS_NAME}.py", "exec"), helpers.__dict__)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("scale", torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.lin(x) * self.scale

    def build() -> nn.Module:
        torch.manual_seed(dist.get_rank())  # different weights per rank: sync_module_states must fix them
        return nn.Sequential(nn.Linear(4, 8), Block(), Block(), nn.Linear(8, 1))

    def losses(model: nn.Module) -> list[float]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(7 + dist.get_rank())
        out = []
        for _ in range(3):
            loss = model(torch.randn(4, 4, generator=g)).float().square().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        with torch.no_grad():  # an evaluation step after training: parameters resharded as FSDP1 does
            out.append(model(torch.ones(2, 4)).float().sum().item())
        return out

    bf16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "buffer_dtype": torch.bfloat16}
    cases: list[tuple[dict[str, object], dict[str, object]]] = [
        ({"strategy": "no_shard", "forward_prefetch": True}, {"forward_prefetch": True}),
        (
            {
                "strategy": "hybrid_shard",
                "backward_prefetch": "none",
                "mixed_precision": {**bf16, "cast_forward_inputs": False},
            },
            {
                "backward_prefetch": False,
                "mp_policy": MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
                ),
                "buffer_dtype": torch.bfloat16,
            },
        ),
        ({"strategy": "shard_grad_op", "forward_prefetch": True}, {"forward_prefetch": True}),
    ]
    out = []
    for bridge, plain in cases:
        strategy = str(bridge["strategy"])
        config = fsdp_bridge.BridgeConfig(
            backend="fsdp2", wrap=[Block], device="cpu", sync_module_states=True, **bridge
        )  # type: ignore[arg-type]
        expected = losses(fsdp_bridge.shard(build(), config))
        got = losses(
            helpers.shard_model(
                build(),
                mesh=helpers.data_parallel_mesh(strategy, "cpu"),
                wrap_classes=(Block,),
                reshard_after_forward=ShardingStrategy(strategy).reshards_after_forward or strategy == "no_shard",
                sync_module_states=True,
                **plain,
            )
        )
        out.append((strategy, max(abs(a - b) for a, b in zip(expected, got, strict=True))))
    out.extend(_helper_summon_and_optimizer_load(helpers, build, Block))
    return out


def _helper_summon_and_optimizer_load(helpers: Any, build: Any, block: type) -> list[tuple[str, object]]:
    """The helper module's summon_full_params and optim_state_dict_to_load against the bridge's, on one model."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    import fsdp_bridge

    mesh = helpers.data_parallel_mesh("full_shard", "cpu")
    # the model's first forward inside the block (generation before the first step): FSDP2's lazy init runs on
    # its own parameters, and the next forward gives the same numbers
    fresh = helpers.shard_model(build(), mesh=mesh, wrap_classes=(block,), sync_module_states=True)
    with helpers.summon_full_params(fresh), torch.no_grad():
        inside = fresh(torch.ones(2, 4)).sum().item()
    first_forward = inside == fresh(torch.ones(2, 4)).sum().item()
    model = helpers.shard_model(build(), mesh=mesh, wrap_classes=(block,), sync_module_states=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 4)).square().mean().backward()
    optimizer.step()
    with fsdp_bridge.summon_full_params(model, with_grads=True):
        bridge = {n: (p.clone(), p.grad.clone()) for n, p in model.named_parameters()}
    with helpers.summon_full_params(model, with_grads=True):
        plain = {n: (p.clone(), p.grad.clone()) for n, p in model.named_parameters()}
        grad_mode = torch.is_grad_enabled()
    same = bridge.keys() == plain.keys() and all(torch.equal(bridge[n][i], plain[n][i]) for n in bridge for i in (0, 1))
    with helpers.summon_full_params(model, writeback=True), torch.no_grad():  # the caller's grad mode, as FSDP1's
        for p in model.parameters():
            p.mul_(2)
    with fsdp_bridge.summon_full_params(model):
        doubled = all(torch.equal(p, 2 * bridge[n][0]) for n, p in model.named_parameters())
    with helpers.summon_full_params(model, rank0_only=True, offload_to_cpu=True):
        full_here = not isinstance(model[0].weight, DTensor)
    with helpers.summon_full_params(model, recurse=False):  # the root unit's own: its first and last Linear
        own = [isinstance(w, DTensor) for w in (model[0].weight, model[1].lin.weight, model[3].weight)]
        model(torch.ones(2, 4))  # a forward runs inside
    full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    optimizer.zero_grad()  # a resume: no gradients yet (torch's loader initialises a fresh optimizer's state then)
    other = torch.optim.AdamW(model.parameters(), lr=1e-2)
    returned = helpers.optim_state_dict_to_load(model, other, full)
    loaded = get_optimizer_state_dict(model, other, options=StateDictOptions(full_state_dict=True))
    optimizer_same = returned == other.state_dict() and all(
        torch.equal(full["state"][k][s], loaded["state"][k][s]) for k in full["state"] for s in full["state"][k]
    )
    return [
        ("summon", same and grad_mode),
        ("first forward inside summon", first_forward),
        ("writeback", doubled),
        ("rank0_only", full_here == (dist.get_rank() == 0)),
        ("recurse=False", own),
        ("optim_state_dict_to_load", optimizer_same),
    ]


def test_helper_module_shards_as_the_bridge_does() -> None:
    """NO_SHARD's (world, 1) mesh, HYBRID's 2D mesh with bf16 and a buffer dtype, SHARD_GRAD_OP; forward
    prefetch, no backward prefetch, rank-0 sync, an evaluation forward: the same losses, bit for bit. Its
    summon_full_params and optim_state_dict_to_load give what the bridge's give."""
    from fsdp_bridge.testing import run_distributed

    for rank in run_distributed(_helpers_against_bridge, 2, env={"LOCAL_WORLD_SIZE": "2"}):
        assert rank == [
            ("no_shard", 0.0),
            ("hybrid_shard", 0.0),
            ("shard_grad_op", 0.0),
            ("summon", True),
            ("first forward inside summon", True),
            ("writeback", True),
            ("rank0_only", True),
            ("recurse=False", [False, True, False]),
            ("optim_state_dict_to_load", True),
        ]


def test_code_on_the_bridge_already_is_ejected_too() -> None:
    """An earlier --fix (bridge target) then --target torch gives what --target torch gives at once."""
    source = HEAD + textwrap.dedent(
        """
        model = FSDP(nn.Sequential(Block()), auto_wrap_policy=ModuleWrapPolicy({Block}))
        with model.no_sync():
            pass
        model.clip_grad_norm_(1.0)
        """
    )
    on_bridge = migrate_source(source, "t.py").fixed
    assert "fsdp_bridge.shard(" in on_bridge
    ejected = migrate_source(on_bridge, "t.py", target="torch").fixed
    direct = migrate_source(source, "t.py", target="torch").fixed
    assert_plain_torch(ejected)
    body = [line for line in direct.splitlines() if not line.startswith(("import", "from"))]
    assert [line for line in ejected.splitlines() if not line.startswith(("import", "from"))] == body


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ('strategy="full_shard"', "no wrap=: the bridge's default"),
        ('wrap="none", backend="fsdp1"', 'backend="fsdp1": only a config for FSDP2'),
        ('wrap=["Block"]', "class names, not classes"),
        ('wrap="none", forward_prefetch=2', "forward_prefetch=2: FSDP1 takes a bool"),
        ('wrap="none", mixed_precision="bf16"', 'mixed_precision="bf16": not a mapping'),
        ('wrap="none", reshard_after_forward=2', "reshard_after_forward=2: no plain-torch form"),
    ],
)
def test_bridge_code_of_its_own_that_has_no_plain_form_keeps_a_todo(config: str, why: str) -> None:
    source = f"import fsdp_bridge\nfrom torch import nn\n\nmodel = fsdp_bridge.shard(nn.Linear(2, 2), fsdp_bridge.BridgeConfig({config}))\n"
    result = migrate_source(source, "t.py", target="torch")
    assert "fsdp_bridge.shard(" in result.fixed and "import fsdp_bridge" in result.fixed
    (todo,) = [f for f in result.findings if not f.fixable]
    assert why in todo.replacement, todo.replacement
    assert f"# {TODO}: fsdp_bridge.shard(...): kept on fsdp_bridge under --target torch: " in result.fixed


def test_full_state_dicts_become_dcp_calls_where_their_meaning_is_dcps() -> None:
    head = "import fsdp_bridge\n\n"
    plain = migrate_source(
        head
        + "a = fsdp_bridge.full_state_dict(model)\n"
        + "b = fsdp_bridge.full_optim_state_dict(model, optim)\n"
        + "c = fsdp_bridge.full_state_dict(model, rank0_only=True, offload_to_cpu=True)\n"
        + "quiet = functools.partial(fsdp_bridge.no_sync, model)\n",
        "t.py",
        target="torch",
    ).fixed
    assert_plain_torch(plain)
    assert "a = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))" in plain
    assert (
        "b = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))"
        in plain
    )
    assert "c = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))" in plain
    assert "quiet = functools.partial(_fsdp2_helpers.no_sync, model)" in plain
    mixed = migrate_source(head + "s = fsdp_bridge.full_state_dict(model, rank0_only=True)\n", "t.py", target="torch")
    assert "fsdp_bridge.full_state_dict(" in mixed.fixed
    assert any("no option gives one without the other" in f.replacement for f in mixed.findings if not f.fixable)


def test_rank0_state_over_process_groups_keeps_the_bridge(tmp_path: Path) -> None:
    """FSDP1's rank0_only is per process group; DCP's cpu_offload gives world rank 0 alone."""
    (tmp_path / "wrap.py").write_text(HEAD + "model = FSDP(nn.Linear(2, 2), process_group=group)\n")
    (tmp_path / "save.py").write_text("import fsdp_bridge\n\nb = fsdp_bridge.full_optim_state_dict(model, optim)\n")
    report, results = migrate_paths([tmp_path], target="torch")
    saved = next(r for r in results if r.path.endswith("save.py"))
    assert "fsdp_bridge.full_optim_state_dict(model, optim)" in saved.fixed
    assert any("first rank of each group" in f.replacement for f in report.todos)


def test_a_full_state_read_on_world_rank_0_alone_becomes_rank_0s_cpu_copy(tmp_path: Path) -> None:
    """FSDP1's CPU copy on every rank (``FSDP.optim_state_dict``'s default), or on each group's first rank, read
    only under a test of world rank 0: DCP's ``cpu_offload=True`` (rank 0 alone) is what the code uses. A read on
    other ranks, a node-local rank test, a name assigned again or read in a nested function keep the bridge."""
    save = textwrap.dedent(
        """\
        import fsdp_bridge
        import torch

        def save(model, optim, rank, master_process):
            state = fsdp_bridge.full_optim_state_dict(model, optim, rank0_only=False, offload_to_cpu=True)
            if master_process and rank >= 0:
                torch.save(state, "o.pt")

        def save_grouped(model, optim):
            state = fsdp_bridge.full_state_dict(model, rank0_only=True, offload_to_cpu=True)
            if torch.distributed.get_rank() == 0:
                torch.save({"model": state}, "m.pt")

        def local(model, optim, local_rank):
            state = fsdp_bridge.full_optim_state_dict(model, optim, rank0_only=False, offload_to_cpu=True)
            if local_rank == 0:
                torch.save(state, "o.pt")

        def everywhere(model, optim, rank):
            state = fsdp_bridge.full_optim_state_dict(model, optim, rank0_only=False, offload_to_cpu=True)
            if rank == 0:
                torch.save(state, "o.pt")
            return state

        def again(model, optim, rank):
            state = fsdp_bridge.full_optim_state_dict(model, optim, rank0_only=False, offload_to_cpu=True)
            if rank == 0:
                state = {}
                torch.save(state, "o.pt")

        def nested(model, optim, rank):
            state = fsdp_bridge.full_optim_state_dict(model, optim, rank0_only=False, offload_to_cpu=True)
            if rank == 0:
                def later():
                    return state
                return later
        """
    )
    (tmp_path / "wrap.py").write_text(HEAD + "model = FSDP(nn.Linear(2, 2), process_group=group)\n")
    (tmp_path / "save.py").write_text(save)
    report, results = migrate_paths([tmp_path], target="torch")
    fixed = next(r for r in results if r.path.endswith("save.py")).fixed
    lowered = "get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))"
    assert fixed.count(lowered) == 1 and fixed.index(lowered) < fixed.index("def save_grouped")
    assert (
        "state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))" in fixed
    )
    code = "\n".join(line for line in fixed.splitlines() if not line.lstrip().startswith("#"))
    assert code.count("fsdp_bridge.full_optim_state_dict(") == 4  # local, everywhere, again, nested
    said = [f.format() for f in report.findings if f.path.endswith("save.py") and f.line == 5]
    assert any("the result is read only under `if master_process and rank >= 0:`" in line for line in said), said


def test_an_unwrap_on_a_flag_lowers_to_the_model_itself() -> None:
    code = "import fsdp_bridge\n\nraw = fsdp_bridge.unwrapped(model) if distributed else model  # the module\n"
    fixed = migrate_source(code, "t.py", target="torch").fixed
    assert fixed.strip() == "raw = model  # the module"
    called = "import fsdp_bridge\n\nraw = fsdp_bridge.unwrapped(model) if ready() else model\n"
    assert "raw = model if ready() else model" in migrate_source(called, "t.py", target="torch").fixed


def test_report_names_the_users_lines_and_what_the_file_holds() -> None:
    """Under --target torch each report line is at the construct's place in the user's file and names what
    the written file holds: plain torch, or the bridge call it stays on as a TODO (never a bridge call the
    output does not contain); the count line counts the constructs of the bridge target."""
    body = textwrap.dedent(
        """
        def run(model, optimizer, batches, settings):
            model = FSDP(
                model,
                auto_wrap_policy=ModuleWrapPolicy({Block}),
                sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
                device_id=torch.device("cpu"),
            )
            with model.no_sync():
                model(batches[0]).sum().backward()
            model.clip_grad_norm_(1.0)
            full = FSDP.full_optim_state_dict(model, optimizer)
            with FSDP.summon_full_params(model, writeback=False):
                print(sum(p.numel() for p in model.parameters()))
            return full
        """
    )
    code = HEAD + "import torch\n" + body
    bridge = migrate_source(code, "train.py")
    result = migrate_source(code, "train.py", target="torch")
    lines = code.splitlines()
    report = [f.format() for f in result.findings]
    assert len(result.findings) == len(bridge.findings)  # the same constructs, each once
    assert [(f.line, f.column) for f in result.findings] == [(f.line, f.column) for f in bridge.findings]
    for f in result.findings:
        assert not f.construct.startswith("--target torch"), f.format()
        if f.fixable:  # a [fix] line names no bridge call the output does not contain
            for call in re.findall(r"fsdp_bridge\.\w+", f.replacement):
                assert call in result.fixed, f.format()
    by_construct = {f.construct: f for f in result.findings}
    ctor = by_construct["FSDP(...)"]
    assert lines[ctor.line - 1][ctor.column :].startswith("FSDP(")  # the user's line and column
    assert ctor.fixable and ctor.replacement.startswith("_fsdp2_helpers.shard_model(")
    nosync = by_construct["model.no_sync()"]
    assert lines[nosync.line - 1][nosync.column :].startswith("model.no_sync()")
    assert nosync.replacement.startswith("_fsdp2_helpers.no_sync(model):")
    clip = next(f for f in result.findings if f.construct.startswith("model.clip_grad_norm_"))
    assert lines[clip.line - 1][clip.column :].startswith("model.clip_grad_norm_")
    assert clip.replacement.startswith("_fsdp2_helpers.clip_grad_norm_(model, 1.0):")
    state = next(f for f in result.findings if f.construct.startswith("FSDP.full_optim_state_dict"))
    assert lines[state.line - 1][state.column :].startswith("FSDP.full_optim_state_dict(")
    assert state.replacement.startswith("get_optimizer_state_dict(")
    assert (
        "get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))"
        in (result.fixed)
    )
    summon = next(f for f in result.findings if f.construct.startswith("FSDP.summon_full_params"))
    assert lines[summon.line - 1][summon.column :].startswith("FSDP.summon_full_params(")
    assert summon.fixable and "with _fsdp2_helpers.summon_full_params(model, writeback=False):" in result.fixed
    assert summon.replacement == "_fsdp2_helpers.summon_full_params(model, writeback=False)"
    strategy = next(f for f in result.findings if f.construct.startswith("sharding_strategy="))
    assert strategy.replacement.startswith(
        'mesh=_fsdp2_helpers.data_parallel_mesh("shard_grad_op", "cpu"), reshard_after_forward=False:'
    )
    wrap = next(f for f in result.findings if f.construct.startswith("auto_wrap_policy="))
    assert wrap.replacement.startswith("wrap_classes=(Block,):")
    n = len(bridge.findings)
    assert CodeReport(findings=result.findings).format().splitlines()[-1] == (
        f"{n} FSDP1 construct(s): {n} rewritable by --fix, 0 left with TODO(fsdp-bridge)"
    )
    assert len(report) == n


def test_shard_moves_and_frees_stay_reported_bridge_calls() -> None:
    """move_shards / free_shards have no plain-torch form written yet: each stays a bridge call with a TODO."""
    fixture = Path(__file__).parent / "fixtures" / "migrate" / "internals" / "shard_storage.py"
    result = migrate_source(fixture.read_text(), "shard_storage.py", target="torch")
    code = result.fixed
    assert f"# {TODO}: fsdp_bridge.move_shards(...): kept on fsdp_bridge under --target torch: " in code
    assert f"# {TODO}: fsdp_bridge.free_shards(...): kept on fsdp_bridge under --target torch: " in code
    todos = [f.format() for f in result.findings if not f.fixable]
    assert len(todos) == 3 and all("kept on fsdp_bridge under --target torch" in t for t in todos), todos


def test_a_file_in_a_folder_without_init_imports_the_helpers_as_a_script_and_as_a_namespace_module(
    tmp_path: Path,
) -> None:
    # A folder with no __init__.py holds scripts (python train.py) and modules of namespace packages (imported
    # as ns.train): the generated import works both ways.
    folder = tmp_path / "ns"
    folder.mkdir()
    code, _ = torch_target("model = FSDP(nn.Linear(2, 2))\n")
    lines = code.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("try:"))
    (folder / "train.py").write_text("\n".join(lines[start : start + 4]) + "\nprint(_fsdp2_helpers.WHERE)\n")
    (folder / f"{HELPERS_NAME}.py").write_text("WHERE = 'beside'\n")
    as_script = subprocess.run([sys.executable, "ns/train.py"], cwd=tmp_path, capture_output=True, text=True)
    as_module = subprocess.run([sys.executable, "-c", "import ns.train"], cwd=tmp_path, capture_output=True, text=True)
    assert as_script.stdout == as_module.stdout == "beside\n", (as_script.stderr, as_module.stderr)


def test_a_package_file_run_as_a_script_imports_the_helpers_both_ways(tmp_path: Path) -> None:
    # A file of a package with a __main__ guard is also run as a script (python pkg/train.py, torchrun
    # pkg/train.py), where a relative import fails: it gets the import that works both ways; so does one whose name
    # is no module name (train-fsdp.py) and one importing a file beside it absolutely (from lib import ...: run
    # from its folder, as weipipe's torchrun train-fsdp.py). A package file with none of these is only imported,
    # relatively.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    main_guard = '\n\nif __name__ == "__main__":\n    print(model)\n'
    (pkg / "run.py").write_text(HEAD + "model = FSDP(nn.Linear(2, 2))\n" + main_guard)
    (pkg / "lib.py").write_text(HEAD + "model = FSDP(nn.Linear(2, 2))\n")
    (pkg / "train-fsdp.py").write_text(HEAD + "model = FSDP(nn.Linear(2, 2))\n")
    (pkg / "script.py").write_text("from lib import nn\n" + HEAD + "model = FSDP(nn.Linear(2, 2))\n")
    migrate_paths([tmp_path], fix=True, target="torch")
    run, lib = (pkg / "run.py").read_text(), (pkg / "lib.py").read_text()
    assert "except ImportError:\n    import _fsdp2_helpers\n" in run
    for name in ("train-fsdp.py", "script.py"):
        assert "except ImportError:\n    import _fsdp2_helpers\n" in (pkg / name).read_text(), name
    assert "from . import _fsdp2_helpers" in lib and "except ImportError" not in lib
    report, _ = migrate_paths([tmp_path], fix=True, target="torch")
    assert report.changed == []  # idempotent


def test_state_dict_options_known_only_at_run_time_says_which_plain_options_to_write() -> None:
    # The bridge target reads FSDP1's state-dict configs at run time (a config object made elsewhere); plain
    # torch has no reader for them, so the call stays on the bridge, and the TODO says how to write it out.
    code = (
        "import fsdp_bridge\n"
        "from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict\n\n\n"
        "def save(model, optim, policy):\n"
        "    return get_optimizer_state_dict(\n"
        "        model, optim, options=fsdp_bridge.state_dict_options('FULL_STATE_DICT', None, policy, optimizer=True)\n"
        "    )\n"
    )
    result = migrate_source(code, "save.py", target="torch")
    (todo,) = [f for f in result.findings if "fsdp_bridge.state_dict_options" in f.construct]
    assert not todo.fixable and "write StateDictOptions(...) from the values passed here" in todo.replacement
    assert "no plain-torch form written for it yet" not in todo.replacement


def test_a_file_importing_a_library_that_wraps_in_fsdp1_keeps_the_bridges_type_test_and_unwrap() -> None:
    # A callback of a training library outside the tree: the library wraps the model in FSDP1's wrapper itself, so
    # it stays FSDP1's after --fix. isinstance(m, FSDPModule) was False for it (the FSDP1 branch was never taken) and
    # the unwrap was dropped (the wrapper handed on as the model); fsdp_bridge's forms serve both backends.
    code = (
        "from some_trainer_lib import Callback\n"
        "from {lib} import State\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "class Export(Callback):\n"
        "    def run(self, state: State):\n"
        "        if isinstance(state.model.model, FSDP):\n"
        "            return state.model.model.module\n"
        "        return state.model.model\n"
    )
    for lib in ("composer.core", "lightning.pytorch", "accelerate.state"):
        result = migrate_source(code.format(lib=lib), "export.py", target="torch")
        fixed = result.fixed
        assert "        if fsdp_bridge.is_sharded(state.model.model):\n" in fixed, fixed
        assert "            return fsdp_bridge.unwrapped(state.model.model)\n" in fixed
        code_lines = [line for line in fixed.splitlines() if not line.lstrip().startswith("#")]
        assert not any("FSDPModule" in line for line in code_lines) and "import fsdp_bridge" in code_lines
        assert fixed.count(f"# {TODO}: fsdp_bridge.") == 2 and f"this file uses {lib.split('.')[0]}," in fixed
        assert migrate_source(fixed, "export.py", target="torch").fixed == fixed
    # without such an import every model is fully_shard's after --fix: plain torch as before; accelerate's loading
    # utilities and helpers alone wrap nothing
    for lib in (
        "",
        "from accelerate import load_checkpoint_and_dispatch, init_empty_weights\n",
        "from accelerate.utils import is_peft_model\n",
    ):
        plain = migrate_source(code.replace("from {lib} import State\n", lib), "export.py", target="torch").fixed
        assert "isinstance(state.model.model, FSDPModule)" in plain and "fsdp_bridge" not in plain


def test_an_optimizer_load_under_a_state_dict_type_set_at_run_time_keeps_the_bridge() -> None:
    # the bridge's optim_state_dict_to_load follows a type set earlier (FULL with rank0_only: rank 0's broadcast);
    # the plain helper reads no such setting, so without options= the call stays the bridge's, with a TODO
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType\n"
        "from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig\n\n\n"
        "def setup(net):\n"
        "    model = FSDP(net)\n"
        "    FSDP.set_state_dict_type(\n"
        "        model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True),\n"
        "        FullOptimStateDictConfig(rank0_only=True),\n"
        "    )\n"
        "    return model\n\n\n"
        "def load(model, optim, path, rank):\n"
        "    osd = torch.load(path) if rank == 0 else None\n"
        "    sd = FSDP.optim_state_dict_to_load(model, optim, osd)\n"
        "    optim.load_state_dict(sd)\n"
    )
    result = migrate_source(code, "ckpt.py", target="torch")
    assert "sd = fsdp_bridge.optim_state_dict_to_load(model, optim, osd)" in result.fixed
    assert "this tree sets a state-dict type" in result.fixed


def test_an_fsdp1_test_stays_on_the_bridge_in_a_tree_keeping_a_subclass_of_the_wrapper(tmp_path: Path) -> None:
    # The tree keeps a subclass of FSDP1's wrapper (a TODO), so its models stay FSDP1's: `assert isinstance(model,
    # FSDP)` written as isinstance(model, FSDPModule) failed on every run; fsdp_bridge.is_sharded serves both.
    (tmp_path / "wrapper.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\nclass Sharded(FSDP):\n    pass\n"
    )
    (tmp_path / "model.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def check(model):\n    assert isinstance(model, FSDP)\n    return model\n"
    )
    migrate_paths([tmp_path], fix=True, target="torch")
    fixed = (tmp_path / "model.py").read_text()
    assert "    assert fsdp_bridge.is_sharded(model)\n" in fixed and "isinstance(model, FSDPModule)" not in fixed


def test_an_unwrap_under_a_test_of_several_wrappers_keeps_dataparallels_module() -> None:
    # `if isinstance(m, (DataParallel, DistributedDataParallel, FSDP)): m = m.module` (a lookup by module path):
    # the DDP test kept DDP's .module only, and under --target torch the unwrap of everything else became the
    # model itself, so a DataParallel model was looked up as its wrapper
    code, _ = torch_target(
        """
        from torch.nn import DataParallel
        from torch.nn.parallel import DistributedDataParallel

        def get_module(module, name):
            if not hasattr(module, name):
                if isinstance(module, (DataParallel, DistributedDataParallel, FSDP)):
                    module = module.module
            return getattr(module, name)

        def wrap(m):
            return FSDP(m)
        """
    )
    assert "module = (module if isinstance(module, FSDPModule) else module.module)" in code


def test_bridge_calls_inside_a_call_lowered_by_name_are_lowered_in_one_pass() -> None:
    # clip_grad_norm_ keeps its arguments as written: the bridge calls in them are lowered in the same --fix (a
    # second one lowered them: not idempotent)
    code = (
        "import fsdp_bridge\n\n\n"
        "def step(engine, model):\n"
        "    return fsdp_bridge.clip_grad_norm_(\n"
        "        (fsdp_bridge.unwrapped(engine) if fsdp_bridge.is_sharded(engine) else model), 1.0\n"
        "    )\n"
    )
    first = migrate_source(code, "step.py", target="torch").fixed
    assert "fsdp_bridge" not in first, first
    assert "_fsdp2_helpers.clip_grad_norm_(" in first and "isinstance(engine, " in first
    assert migrate_source(first, "step.py", target="torch").fixed == first
