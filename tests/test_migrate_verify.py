"""``fsdp-bridge migrate verify``: the comparison in one process, then two real before/after runs.

The runs (2 gloo ranks each, under torchrun) are one test: a correct rewrite gives PARITY (exit 0); a
script whose loss reads ``p.numel()`` (a shard on FSDP1, the global size on FSDP2) is rewritten right by
the codemod and still gives DIVERGED at its first step (exit 1): what only running both can show; so does a
script that seeds each rank's weights differently, and verify names that cause.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_bridge.cli import main
from fsdp_bridge.migrate.verify import TOLERANCES, VerifyResult, compare_losses
from fsdp_bridge.migrate.verify import _compare_saved as compare_saved

FIXTURES = Path(__file__).parent / "fixtures"


def _run(values: list[float], dtype: str = "float32") -> dict[int, list[tuple[float, str]]]:
    return {0: [(v, dtype) for v in values], 1: [(v + 1, dtype) for v in values]}


def test_equal_losses_agree_with_the_dtype_tolerance() -> None:
    diff, rtol, atol = compare_losses(_run([1.0, 0.5]), _run([1.0 + 1e-7, 0.5]))
    assert diff is None
    assert (rtol, atol) == TOLERANCES["float32"]
    diff, rtol, _ = compare_losses(_run([1.0], "bfloat16"), _run([1.01], "bfloat16"))
    assert diff is None and rtol == TOLERANCES["bfloat16"][0]


def test_the_first_differing_step_rank_and_values_are_named() -> None:
    after = _run([1.0, 0.5, 0.25])
    after[1][1] = (1.75, "float32")
    diff, _, _ = compare_losses(_run([1.0, 0.5, 0.25]), after)
    assert diff is not None and (diff.rank, diff.step, diff.before, diff.after) == (1, 1, 1.5, 1.75)
    result = VerifyResult(_run([1.0, 0.5, 0.25]), after, diff)
    assert not result.parity
    assert "DIVERGED at step 1 on rank 1: FSDP1 1.5, migrated 1.75" in result.format()


def test_saved_tensors_off_by_a_little_after_bit_equal_losses_are_pointed_at() -> None:
    """PARITY stands (within the tolerance), but losses equal bit for bit beside saved tensors that are not is said:
    the shape of an EMA copy that never moved (each step moves it by a thousandth of the model's change)."""
    same = VerifyResult(_run([1.0, 0.5]), _run([1.0, 0.5]), None, rtol=1e-6, atol=1e-5, saved_inexact=3)
    assert same.parity and "yet 3 saved tensor(s) did not" in same.format()
    assert "PARITY" in same.format().splitlines()[-1]
    close = VerifyResult(_run([1.0, 0.5]), _run([1.0, 0.5 + 1e-8]), None, rtol=1e-6, atol=1e-5, saved_inexact=3)
    exact = VerifyResult(_run([1.0, 0.5]), _run([1.0, 0.5]), None, rtol=1e-6, atol=1e-5)
    assert "saved tensor(s) did not" not in close.format() + exact.format()


def test_fewer_losses_nan_dtype_change_and_no_loss_at_all_diverge() -> None:
    diff, _, _ = compare_losses(_run([1.0, 0.5]), _run([1.0]))
    assert diff is not None and diff.step == 1 and "FSDP1 recorded 2 losses, the migrated script 1" in diff.what
    diff, _, _ = compare_losses(_run([float("nan")]), _run([float("nan")]))
    assert diff is not None and diff.step == 0
    diff, _, _ = compare_losses(_run([1.0]), _run([1.0], "bfloat16"))
    assert diff is not None and "loss dtype float32 became bfloat16" in diff.what
    diff, _, _ = compare_losses({0: []}, {0: []})
    assert diff is not None and "no one-element loss" in diff.what
    diff, _, _ = compare_losses(_run([1.0]), _run([1.5]), rtol=0.6)
    assert diff is None  # a given tolerance wins


def test_saved_tensors_compared_within_fp32_tolerance(tmp_path: Path) -> None:
    before, after = tmp_path / "a", tmp_path / "b"
    before.mkdir(), after.mkdir()
    w = torch.arange(6, dtype=torch.float32)
    torch.save({"model": {"w": w}, "step": 3}, before / "ck.pt")
    torch.save({"model": {"w": w + 1e-9}, "step": 3}, after / "ck.pt")
    problems, lines, _ = compare_saved(before, after, {Path("ck.pt")})
    assert problems == [] and "1 tensors compared" in lines[0]
    torch.save({"model": {"w": w + 1.0}, "step": 4}, after / "ck.pt")
    torch.save({"x": w}, after / "extra.pt")
    problems, _, _ = compare_saved(before, after, {Path("ck.pt")})
    assert problems == [
        "ck.pt: model.w differs beyond rtol 1.3e-06, atol 1e-05",
        "ck.pt: step = 3 vs 4",
        "extra.pt: saved by the migrated script only",
    ]


def test_saved_names_that_differ_only_by_the_compile_prefix_are_named_once_and_compared(tmp_path: Path) -> None:
    # FSDP1's state dict of a module compiled before the wrap names keys "_orig_mod.x"; torch's DCP
    # state-dict functions drop the prefix. One line says so; the values are still compared.
    before, after = tmp_path / "a", tmp_path / "b"
    before.mkdir(), after.mkdir()
    w = torch.arange(6, dtype=torch.float32)
    torch.save({"_orig_mod.w": w, "_orig_mod.b": w[:2]}, before / "ck.pt")
    torch.save({"w": w, "b": w[:2] + 1}, after / "ck.pt")
    problems, lines, _ = compare_saved(before, after, {Path("ck.pt")})
    assert problems == [
        "ck.pt: 2 name(s) differ only by torch.compile's '_orig_mod.' prefix, in FSDP1's (compared without it "
        "below; a checkpoint of the other run loads after removing it)",
        "ck.pt: b differs beyond rtol 1.3e-06, atol 1e-05",
    ]
    assert lines == ["ck.pt: 2 tensors compared, 1 bit for bit, 1 within tolerance or not (largest difference 1)"]


def test_a_failed_run_shows_the_traceback_chained_to_the_first_one() -> None:
    from fsdp_bridge.migrate.verify import _first_traceback

    stderr = (
        "[rank0]: noise\n"
        'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n'
        "    from . import helpers\nImportError: attempted relative import with no known parent package\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        'Traceback (most recent call last):\n  File "train.py", line 5, in <module>\n'
        "    import helpers\nModuleNotFoundError: No module named 'helpers'\n"
        'Traceback (most recent call last):\n  File "/x/torch/distributed/run.py", line 9, in main\n'
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError\n"
    )
    shown = _first_traceback(stderr)
    assert "attempted relative import" in shown and "No module named 'helpers'" in shown
    assert "ChildFailedError" not in shown


def test_arguments_refused_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migrate", "verify", str(tmp_path)]) == 2
    assert "SCRIPT: got None; allowed: the training script after --" in capsys.readouterr().err
    assert main(["migrate", "verify", str(tmp_path / "nope"), "--", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "DIR: got" in err and "SCRIPT: got 'train.py'" in err
    with pytest.raises(SystemExit, match="2"):  # only verify takes a command after --
        main(["migrate", "code", str(tmp_path), "--", "x"])
    assert "unrecognized arguments: -- x" in capsys.readouterr().err


def test_parity_of_a_right_rewrite_and_divergence_it_cannot_see(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(FIXTURES / "migrate" / "grad_accum.py", tree)
    shutil.copy(FIXTURES / "migrate_verify" / "numel_penalty.py", tree)
    shutil.copy(FIXTURES / "migrate_verify" / "rank_seeded.py", tree)
    before = sorted((p.name, p.read_bytes()) for p in tree.iterdir())

    assert main(["migrate", "verify", str(tree), "--timeout", "300", "--", "grad_accum.py"]) == 0
    out = capsys.readouterr().out
    assert "[fix] model.no_sync() -> fsdp_bridge.no_sync(model)" in out
    assert "PARITY: 9 losses on each of 2 rank(s) agree (rtol 1.3e-06, atol 1e-05)" in out
    assert "note:" not in out  # every rank builds the same model

    code = main(["migrate", "verify", str(tree), "--nproc-per-node", "2", "--", "numel_penalty.py", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 1
    assert "DIVERGED at step 0 on rank 0" in out
    assert "note:" not in out  # the same model on every rank: the cause is the loss's numel()

    # Each rank seeds its own weights: FSDP1 and FSDP2 assemble different models from the ranks' copies.
    code = main(["migrate", "verify", str(tree), "--", "rank_seeded.py", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 1 and "DIVERGED at step 0 on rank 0" in out
    assert (
        "note: when FSDP(...) wrapped the model, rank 0's copy of 4 of its 4 parameters differed from another "
        "rank's (first: 0.weight, 0.bias, 2.weight) and sync_module_states was off"
    ) in " ".join(out.split())
    assert sorted((p.name, p.read_bytes()) for p in tree.iterdir()) == before  # the user's tree is never written


def test_cpu_shims_show_the_script_an_accelerator_and_torchs_own_modules_none(tmp_path: Path) -> None:
    # Dynamo, told an accelerator is there, asks it for a stream at the first compiled call and fails on a
    # machine with none: torch's own modules see the machine as it is, the script (and its libraries) one.
    probe = (
        "import torch\n"
        "from fsdp_bridge.migrate.verify_runner import _install_cpu_shims\n"
        "_install_cpu_shims()\n"
        "inside = {'__name__': 'torch._dynamo.variables.streams', 'torch': torch}\n"
        "exec('seen = torch.accelerator.is_available()', inside)\n"
        "print(torch.accelerator.is_available(), inside['seen'], torch.accelerator.current_accelerator())\n"
        "x = torch.ones(2)\n"
        "forms = [1, 'cuda', 'cuda:1', torch.device('cuda', 1)]\n"
        "print(*(x.to(d).device.type for d in forms), x.to(device=torch.device('cuda:0')).device.type)\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "with torch.device('meta'):\n    m = torch.nn.Linear(2, 2)\n"
        "print(m.to_empty(device=1).weight.device.type, init_device_mesh.__name__)\n"
    )
    script = tmp_path / "probe.py"
    script.write_text(probe)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    shown, moved, empty = done.stdout.splitlines()
    assert shown.split() == ["True", str(torch.accelerator.is_available()), "cpu"]
    assert moved.split() == ["cpu"] * 5  # a GPU named as an index, a string or a torch.device is the CPU
    assert empty.split() == ["cpu", "mesh_on_cpu"]  # FSDP1's param_init_fn target; a CUDA mesh of CPU ranks
