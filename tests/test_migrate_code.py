"""``fsdp-bridge migrate code``: findings, rewrites, idempotence, and FSDP1 vs rewritten-FSDP2 losses."""

from __future__ import annotations

import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import libcst as cst
import pytest

import fsdp_bridge
from fsdp_bridge.migrate._code import TODO, migrate_source
from fsdp_bridge.testing import run_distributed

FIXTURES = Path(__file__).parent / "fixtures" / "migrate"
RUNNABLE = ["transformer_mp.py", "full_state_dict.py", "grad_accum.py", "hybrid_mesh.py"]
ALL = sorted(p.name for p in FIXTURES.glob("*.py"))
HAS_CHECKPOINT_API = hasattr(fsdp_bridge, "save_checkpoint") and hasattr(fsdp_bridge, "load_checkpoint")

# Every construct each fixture holds: (line, construct) pairs the report must contain.
EXPECTED: dict[str, set[tuple[int, str]]] = {
    "transformer_mp.py": {(54, "FSDP(...)"), (56, "auto_wrap_policy="), (57, "mixed_precision="),
                          (58, "sharding_strategy="), (59, "backward_prefetch="), (60, "device_id="),
                          (61, "use_orig_params="), (71, "model.clip_grad_norm_(...)")},
    "full_state_dict.py": {(34, "FullyShardedDataParallel(...)"), (36, "sharding_strategy="),
                           (37, "auto_wrap_policy="), (38, "device_id="),
                           (55, "FSDP.state_dict_type(FULL_STATE_DICT) save"),
                           (62, "FSDP.state_dict_type(FULL_STATE_DICT) load")},
    "grad_accum.py": {(33, "FSDP(...)"), (33, "auto_wrap_policy="), (34, "sharding_strategy="), (35, "device_id="),
                      (44, "model.no_sync()")},
    "hybrid_mesh.py": {(30, "FSDP(...)"), (32, "device_mesh="), (33, "sharding_strategy="), (34, "auto_wrap_policy="),
                       (35, "device_id="), (36, "forward_prefetch="), (37, "limit_all_gathers="),
                       (38, "sync_module_states="), (51, "FSDP.summon_full_params(...)")},
    "todo_constructs.py": {
        (24, "ShardedGradScaler"), (26, "FSDP(...)"), (28, "auto_wrap_policy="), (29, "ignored_modules="),
        (30, "cpu_offload="), (31, "backward_prefetch="), (32, "sharding_strategy="),
        (34, "apply_activation_checkpointing"), (39, "FSDP.state_dict_type"), (39, "StateDictType.SHARDED_STATE_DICT"),
        (39, "ShardedStateDictConfig"), (40, "FSDP.optim_state_dict"), (46, "FSDP.optim_state_dict_to_load"),
        (47, "FSDP"), (51, "FSDP(...)"), (52, "mixed_precision="), (53, "cpu_offload="), (54, "backward_prefetch="),
        (55, "sharding_strategy="),
    },
}


def _source(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.mark.parametrize("name", ALL)
def test_report_finds_every_construct(name: str) -> None:
    result = migrate_source(_source(name), name)
    found = {(f.line, f.construct) for f in result.findings}
    missing = EXPECTED[name] - found
    assert not missing, f"not reported: {sorted(missing)}; reported: {sorted(found)}"
    for f in result.findings:
        assert f.replacement, f


@pytest.mark.parametrize("name", ALL)
def test_fix_parses_is_idempotent_and_keeps_the_rest(name: str) -> None:
    original = _source(name)
    first = migrate_source(original, name)
    cst.parse_module(first.fixed)  # always parses
    compile(first.fixed, name, "exec")
    second = migrate_source(first.fixed, name)
    assert second.fixed == first.fixed, second.diff()
    # Comments and docstrings outside the rewritten expressions survive.
    for line in original.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or stripped.startswith('"""'):
            assert stripped in first.fixed, f"lost {stripped!r}"


def test_rewrites_runnable_fixtures_completely() -> None:
    for name in RUNNABLE:
        fixed = migrate_source(_source(name), name).fixed
        assert "torch.distributed.fsdp" not in fixed, name
        assert TODO not in fixed, name
        assert "import fsdp_bridge" in fixed
        assert "fsdp_bridge.shard(" in fixed


def test_todo_comments_are_precise() -> None:
    fixed = migrate_source(_source("todo_constructs.py")).fixed
    todos = [line.strip() for line in fixed.splitlines() if TODO in line]
    assert any("ShardedGradScaler" in t and "torch.amp.GradScaler" in t for t in todos), todos
    assert any("apply_activation_checkpointing" in t and "activation_checkpointing=True" in t for t in todos)
    assert any("FSDP.optim_state_dict" in t and "save_checkpoint" in t for t in todos)
    assert any("not rewritten" in t and "ignored_modules=" in t for t in todos), todos
    # backward_prefetch=BACKWARD_POST in a rewritten call: no FSDP2 equivalent, says what is used
    assert any("backward_prefetch" in t and "'pre'" in t for t in todos), todos
    # the NO_SHARD construction is rewritten and keeps replication
    assert 'strategy="no_shard"' in fixed
    assert "cpu_offload=True" in fixed


def test_fix_keeps_non_fsdp_files_untouched(tmp_path: Path) -> None:
    code = "import torch\n\nx = torch.nn.utils.clip_grad_norm_(params, 1.0)  # keep\nmodel.no_sync()\n"
    result = migrate_source(code)
    assert result.fixed == code and result.findings == []


def test_cli_diff_writes_nothing_and_fix_writes(tmp_path: Path) -> None:
    script = tmp_path / "grad_accum.py"
    shutil.copy(FIXTURES / "grad_accum.py", script)
    before = script.read_text()
    cli = [sys.executable, "-m", "fsdp_bridge", "migrate", "code"]
    out = subprocess.run([*cli, str(script), "--diff"], capture_output=True, text=True, check=False)
    assert out.returncode == 1, out.stderr
    assert "+    model = fsdp_bridge.shard(" in out.stdout and f"{script}:44:" in out.stdout
    assert script.read_text() == before
    out = subprocess.run([*cli, str(script), "--fix"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert f"rewrote {script}" in out.stdout
    assert script.read_text() == migrate_source(before).fixed
    out = subprocess.run([*cli, str(tmp_path / "missing.py")], capture_output=True, text=True, check=False)
    assert out.returncode == 2 and "no such file" in out.stderr


# -- FSDP1 script vs its rewrite, on gloo -------------------------------------------


def _strip_checkpoint_calls(code: str) -> str:
    """Only when fsdp_bridge.save_checkpoint/load_checkpoint are not importable yet."""
    lines = []
    for line in code.splitlines():
        stripped = line.strip()
        if stripped.startswith(("fsdp_bridge.save_checkpoint(", "fsdp_bridge.load_checkpoint(")):
            line = line[: len(line) - len(line.lstrip())] + "pass  # checkpoint API not available"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _run_pairs(pairs: list[tuple[str, str, dict[str, object]]]) -> list[tuple[list[float], list[float]]]:
    """On every rank: run each FSDP1 script's main(), then its rewrite's main()."""
    out = []
    for original, fixed, kwargs in pairs:
        fsdp1 = runpy.run_path(original, run_name="fsdp1_fixture")["main"](**kwargs)
        fsdp2 = runpy.run_path(fixed, run_name="fsdp2_fixture")["main"](**kwargs)
        out.append((fsdp1, fsdp2))
    return out


def _prepare(tmp_path: Path, name: str) -> tuple[str, str]:
    original = tmp_path / name
    shutil.copy(FIXTURES / name, original)
    fixed = migrate_source(original.read_text(), name).fixed
    if not HAS_CHECKPOINT_API:
        fixed = _strip_checkpoint_calls(fixed)
    fixed_path = tmp_path / f"fixed_{name}"
    fixed_path.write_text(fixed)
    return str(original), str(fixed_path)


def test_rewritten_scripts_match_fsdp1_losses(tmp_path: Path) -> None:
    env = {"OMP_NUM_THREADS": "1"}
    pairs = []
    for name in ("transformer_mp.py", "full_state_dict.py", "grad_accum.py"):
        original, fixed = _prepare(tmp_path, name)
        kwargs: dict[str, object] = {"ckpt_path": str(tmp_path / "model.pt")} if name == "full_state_dict.py" else {}
        pairs.append((original, fixed, kwargs))
    results = run_distributed(_run_pairs, world_size=2, args=(pairs,), env=env, timeout_s=240)
    for rank_results in results:
        (mp1, mp2), (sd1, sd2), (ga1, ga2) = rank_results
        # bf16 compute: FSDP1 and FSDP2 round the same math in different places
        assert mp2 == pytest.approx(mp1, rel=2e-2), (mp1, mp2)
        assert sd2 == pytest.approx(sd1, rel=1.3e-6, abs=1e-5), (sd1, sd2)
        assert ga2 == pytest.approx(ga1, rel=1.3e-6, abs=1e-5), (ga1, ga2)
        assert len(ga1) == 9 and len(sd1) == 5

    original, fixed = _prepare(tmp_path, "hybrid_mesh.py")
    (hy,) = run_distributed(_run_pairs, world_size=4, args=([(original, fixed, {})],), env=env, timeout_s=240)[0]
    assert hy[1] == pytest.approx(hy[0], rel=1.3e-6, abs=1e-5), hy
