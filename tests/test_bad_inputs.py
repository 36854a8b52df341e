"""Bad inputs on every CLI subcommand and on the checkpoint API: a clear error, never a traceback.

Each CLI case must exit with code 2 and print one message on stderr naming what was wrong,
the value, what is allowed and the fix.  Each damaged checkpoint is edited the way an
attacker would (the description re-written to match, :func:`fsdp_bridge.testing.damage.redescribe`),
so that only the readers' own checks stand.  A refused load leaves the model and the
optimizer exactly as they were.  docs/reliability.md lists every case with its outcome.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fsdp_bridge
from fsdp_bridge.checkpoint import CheckpointError, convert_checkpoint
from fsdp_bridge.checkpoint._formats import description_digest
from fsdp_bridge.cli import main
from fsdp_bridge.testing.damage import redescribe, zero_file
from fsdp_bridge.testing.models import build_tiny, sample_batch

TINY = "llama:hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,vocab_size=100"
LR, BETAS, WD = 1e-2, (0.8, 0.9), 0.123


def _optimizer(model: torch.nn.Module, lr: float = LR) -> torch.optim.Optimizer:
    """Two groups with different hyper-parameters: what convert must keep."""
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    rest = [p for n, p in model.named_parameters() if p.ndim <= 1]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0, "lr": lr / 2}], lr=lr, betas=BETAS
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One sharded and one full checkpoint of a trained tiny Llama (no process group)."""
    root = tmp_path_factory.mktemp("bad_inputs")
    model = build_tiny("llama", seed=0)
    opt = _optimizer(model)
    model(**sample_batch(seed=0)).loss.backward()
    opt.step()
    fsdp_bridge.save_checkpoint(root / "sharded", model, opt, state={"step": 1})
    fsdp_bridge.save_checkpoint(root / "full", model, opt, kind="full", state={"step": 1})
    (root / "a_file").write_text("not a directory\n")
    (root / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "broken.yaml").write_text("a: [\n")
    (root / "bad.json").write_bytes(b"\xff{")
    (root / "bridge.yaml").write_text("strategy: full_shard\n")
    (root / "empty_dir").mkdir()
    (root / "loop_a").symlink_to(root / "loop_b")
    (root / "loop_b").symlink_to(root / "loop_a")
    return root


def _damaged(root: Path, base: str, name: str, damage: Callable[[Path], object]) -> Path:
    path = root / name
    if not path.exists():
        shutil.copytree(root / base, path)
        damage(path)
        redescribe(path)
    return path


def _write(rel: str, data: bytes) -> Callable[[Path], object]:
    return lambda d: (d / rel).write_bytes(data)


def _wrong_shape_optimizer_tensor(d: Path) -> None:
    tensors = load_file(str(d / "optimizer.safetensors"))
    key = next(k for k in sorted(tensors) if k.endswith("/exp_avg") and tensors[k].ndim == 2)
    tensors[key] = tensors[key].reshape(-1)[: tensors[key].numel() // 2].reshape(2, -1).contiguous()
    save_file(tensors, str(d / "optimizer.safetensors"), metadata={"format": "pt"})


DAMAGE: dict[str, tuple[str, Callable[[Path], object]]] = {
    "optimizer_json_garbage": ("full", _write("optimizer.json", b"garbage{")),
    "optimizer_json_a_list": ("full", _write("optimizer.json", b"[1, 2]\n")),
    "optimizer_json_truncated": (
        "full",
        lambda d: (d / "optimizer.json").write_bytes((d / "optimizer.json").read_bytes()[:40]),
    ),
    "optimizer_json_no_param_groups": ("full", _write("optimizer.json", b'{"scalars": {}}')),
    "optimizer_tensor_wrong_shape": ("full", _wrong_shape_optimizer_tensor),
    "zeroed_safetensors": ("full", lambda d: zero_file(d / "model.safetensors")),
    "zeroed_dcp_shard": ("sharded", lambda d: zero_file(next((d / "dcp").glob("*.distcp")))),
    "train_state_garbage": ("sharded", _write("train_state.json", b"[1, 2")),
    "train_state_not_a_dict": ("sharded", _write("train_state.json", b'"x"')),
    "rng_state_wrong_shape": ("sharded", _write("rng/rank_00000.json", b'{"python": 1, "torch": "AAAA"}')),
}


# ----------------------------------------------------------------------------------------
# CLI: exit code 2, one message, no traceback
# ----------------------------------------------------------------------------------------


def _cli_cases(root: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (argv, substrings the message must hold)."""
    d = {name: str(_damaged(root, base, name, fn)) for name, (base, fn) in DAMAGE.items()}
    d["description_truncated"] = str(_damaged(root, "full", "description_truncated", lambda p: None))
    (Path(d["description_truncated"]) / "fsdp_bridge.json").write_bytes(
        (root / "full" / "fsdp_bridge.json").read_bytes()[:300]
    )
    d["description_wrong_type"] = str(_damaged(root, "full", "description_wrong_type", lambda p: None))
    meta = json.loads((root / "full" / "fsdp_bridge.json").read_text())
    wrong = {**meta, "params": [1]}
    wrong["description_sha256"] = description_digest(wrong)  # sealed again: the type check must catch it
    (Path(d["description_wrong_type"]) / "fsdp_bridge.json").write_text(json.dumps(wrong))
    out = str(root / "out")
    bad_out = str(root / "a_file" / "sub")
    sh, full = str(root / "sharded"), str(root / "full")
    return {
        "explain_backend_fsdp3": (
            ["explain", str(root / "bridge.yaml"), "--backend", "fsdp3"],
            ["--backend: got 'fsdp3'", "fsdp1, fsdp2 or both"],
        ),
        "estimate_negative_size": (
            ["estimate", "llama:hidden_size=-4", "--world-size", "2"],
            ["model.hidden_size: got -4", "an integer from 1"],
        ),
        "estimate_zero_layers": (
            ["estimate", "llama:num_hidden_layers=0", "--world-size", "2"],
            ["model.num_hidden_layers: got 0"],
        ),
        "estimate_absurd_layers": (
            ["estimate", "llama:num_hidden_layers=100000000", "--world-size", "2"],
            ["num_hidden_layers: got 100000000", "4,096"],
        ),
        "estimate_absurd_hidden_size": (
            ["estimate", "llama:hidden_size=99999999999999", "--world-size", "2"],
            ["hidden_size: got 99999999999999"],
        ),
        "estimate_size_not_a_number": (
            ["estimate", "llama:hidden_size=abc", "--world-size", "2"],
            ["hidden_size: got 'abc'"],
        ),
        "estimate_sizes_that_do_not_fit": (
            ["estimate", "llama:hidden_size=60,num_attention_heads=7", "--world-size", "2"],
            ["not a multiple"],
        ),
        "estimate_negative_batch": (
            ["estimate", TINY, "--world-size", "2", "--batch", "-1", "--seq-len", "4"],
            ["batch: got -1"],
        ),
        "estimate_zero_seq_len": (
            ["estimate", TINY, "--world-size", "2", "--batch", "1", "--seq-len", "0"],
            ["seq_len: got 0"],
        ),
        "estimate_overflowing_batch_and_seq_len": (
            ["estimate", TINY, "--world-size", "2", "--batch", "1000000", "--seq-len", "1000000"],
            ["batch/seq_len", "smaller"],
        ),
        "estimate_zero_world_size": (["estimate", TINY, "--world-size", "0"], ["world_size: got 0"]),
        "estimate_zero_device_memory": (
            ["estimate", TINY, "--world-size", "2", "--device-memory", "0"],
            ["device_memory: got 0"],
        ),
        "estimate_broken_yaml": (["estimate", str(root / "broken.yaml"), "--world-size", "2"], ["broken.yaml"]),
        "estimate_non_utf8_json": (["estimate", str(root / "bad.json"), "--world-size", "2"], ["bad.json"]),
        "convert_hf_config_not_a_config": (
            ["convert", sh, out, "--to", "hf", "--hf-config", str(root / "passwd")],
            ["hf_config: got", "passwd", "model_type"],
        ),
        "convert_hf_config_dir_without_one": (
            ["convert", sh, out, "--to", "hf", "--hf-config", str(root / "empty_dir")],
            ["hf_config", "config.json does not exist"],
        ),
        "convert_unwritable_destination_hf": (
            ["convert", sh, bad_out, "--to", "hf"],
            ["cannot be written", "is a file, not a directory"],
        ),
        "convert_unwritable_destination_sharded": (
            ["convert", full, bad_out, "--to", "sharded"],
            ["cannot be written"],
        ),
        "convert_unwritable_destination_torch": (
            ["convert", sh, bad_out + ".pt", "--to", "torch"],
            ["cannot be written"],
        ),
        **{
            f"convert_{name}": (["convert", d[name], out, "--to", "sharded"], [what])
            for name, what in (
                ("optimizer_json_garbage", "optimizer.json"),
                ("optimizer_json_a_list", "param_groups"),
                ("optimizer_json_truncated", "optimizer.json"),
                ("optimizer_json_no_param_groups", "param_groups"),
                ("zeroed_safetensors", "model.safetensors"),
                ("zeroed_dcp_shard", "dcp: cannot be read"),
                ("train_state_garbage", "train_state.json"),
                ("train_state_not_a_dict", "train_state.json"),
                ("rng_state_wrong_shape", "rank_00000.json"),
                ("description_truncated", "fsdp_bridge.json"),
                ("description_wrong_type", "field params"),
            )
        },
        "convert_symlink_loop_source": (
            ["convert", str(root / "loop_a"), out, "--to", "hf"],
            ["loop_a", "symlink loop"],
        ),
        "inspect_description_wrong_type": (["inspect", d["description_wrong_type"]], ["field params"]),
        "inspect_not_a_checkpoint": (["inspect", str(root / "passwd")], ["passwd"]),
        "migrate_config_unwritable_output": (
            ["migrate", "config", str(root / "bridge.yaml"), "-o", str(root / "a_file" / "x.yaml")],
            ["-o/--output", "is a file"],
        ),
        "migrate_config_empty_source": (["migrate", "config", ""], ["SRC: got ''"]),
        "migrate_code_empty_path": (["migrate", "code", ""], ["no such file or directory: ''"]),
        "train_unwritable_output_dir": (
            ["train", "--dry-run", f"output_dir={bad_out}"],
            ["output_dir: got", "is a file"],
        ),
        "train_negative_max_restarts": (
            ["train", "--dry-run", "--max-restarts", "-1"],
            ["--max-restarts: got -1", "an integer >= 0"],
        ),
    }


CLI_CASES = [
    "explain_backend_fsdp3",
    "estimate_negative_size",
    "estimate_zero_layers",
    "estimate_absurd_layers",
    "estimate_absurd_hidden_size",
    "estimate_size_not_a_number",
    "estimate_sizes_that_do_not_fit",
    "estimate_negative_batch",
    "estimate_zero_seq_len",
    "estimate_overflowing_batch_and_seq_len",
    "estimate_zero_world_size",
    "estimate_zero_device_memory",
    "estimate_broken_yaml",
    "estimate_non_utf8_json",
    "convert_hf_config_not_a_config",
    "convert_hf_config_dir_without_one",
    "convert_unwritable_destination_hf",
    "convert_unwritable_destination_sharded",
    "convert_unwritable_destination_torch",
    "convert_optimizer_json_garbage",
    "convert_optimizer_json_a_list",
    "convert_optimizer_json_truncated",
    "convert_optimizer_json_no_param_groups",
    "convert_zeroed_safetensors",
    "convert_zeroed_dcp_shard",
    "convert_train_state_garbage",
    "convert_train_state_not_a_dict",
    "convert_rng_state_wrong_shape",
    "convert_description_truncated",
    "convert_description_wrong_type",
    "convert_symlink_loop_source",
    "inspect_description_wrong_type",
    "inspect_not_a_checkpoint",
    "migrate_config_unwritable_output",
    "migrate_config_empty_source",
    "migrate_code_empty_path",
    "train_unwritable_output_dir",
    "train_negative_max_restarts",
]


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_bad_input_exits_2_with_one_message(case: str, saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv, expected = _cli_cases(saved)[case]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, f"{case}: exit code {code}\n{err}"
    assert "Traceback" not in err
    assert err.startswith(f"fsdp-bridge {argv[0]}"), err
    for text in expected:
        assert text in err, f"{case}: {text!r} not in {err!r}"
    assert not (saved / "out").exists(), "a refused conversion left its destination behind"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_output_directory_is_refused(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert main(["convert", str(saved / "sharded"), str(ro / "out"), "--to", "hf"]) == 2
        assert "not writable" in capsys.readouterr().err
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("where", ["a_file/sub", "/proc/fsdp_bridge_ckpt"])
def test_save_to_an_unwritable_place_names_why(where: str, saved: Path) -> None:
    path = saved / where if not where.startswith("/") else Path(where)
    if where.startswith("/proc") and not Path("/proc").is_dir():
        pytest.skip("no /proc")
    with pytest.raises(CheckpointError, match=r"cannot be written: .*(is a file, not a directory|kernel file system)"):
        fsdp_bridge.save_checkpoint(path, build_tiny("llama", seed=0))


# ----------------------------------------------------------------------------------------
# API: a refused load leaves the model and the optimizer untouched
# ----------------------------------------------------------------------------------------


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], str, dict]:
    osd = opt.state_dict()
    state = {f"{i}.{k}": v.clone() for i, s in osd["state"].items() for k, v in s.items() if torch.is_tensor(v)}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, json.dumps(osd["param_groups"]), state


def _same(a: tuple[dict[str, torch.Tensor], str, dict], b: tuple[dict[str, torch.Tensor], str, dict]) -> bool:
    return (
        a[0].keys() == b[0].keys()
        and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
        and a[1] == b[1]
        and a[2].keys() == b[2].keys()
        and all(torch.equal(a[2][k], b[2][k]) for k in a[2])
    )


LOAD_CASES = {
    "optimizer_json_a_list": "param_groups",
    "optimizer_json_no_param_groups": "param_groups",
    "optimizer_tensor_wrong_shape": "shape",
    "zeroed_dcp_shard": "dcp: cannot be read",
    "train_state_garbage": "train_state.json",
    "train_state_not_a_dict": "train_state.json",
    "rng_state_wrong_shape": "rank_00000.json",
}


@pytest.mark.parametrize("case", sorted(LOAD_CASES))
def test_a_refused_load_leaves_model_and_optimizer_untouched(case: str, saved: Path) -> None:
    base, damage = DAMAGE[case]
    path = _damaged(saved, base, case, damage)
    model = build_tiny("llama", seed=5)
    opt = _optimizer(model, lr=5.0)
    model(**sample_batch(seed=1)).loss.backward()
    opt.step()  # the optimizer has state of its own to lose
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match=LOAD_CASES[case]):
        fsdp_bridge.load_checkpoint(path, model, opt)
    assert _same(before, _snapshot(model, opt)), f"{case}: the load was refused but changed the model or optimizer"


def test_a_load_into_the_live_state_says_when_it_stopped_half_way(saved: Path) -> None:
    """all_or_nothing=False saves the copy of the shards; every check before reading still refuses
    with the model untouched; a shard that then fails to read says the load is partial."""
    model = build_tiny("llama", seed=5)
    opt = _optimizer(model, lr=5.0)
    before = _snapshot(model, opt)
    base, damage = DAMAGE["train_state_garbage"]
    path = _damaged(saved, base, "train_state_garbage", damage)
    with pytest.raises(CheckpointError, match=r"train_state\.json"):
        fsdp_bridge.load_checkpoint(path, model, opt, all_or_nothing=False)
    assert _same(before, _snapshot(model, opt))
    base, damage = DAMAGE["zeroed_dcp_shard"]
    path = _damaged(saved, base, "zeroed_dcp_shard", damage)
    with pytest.raises(CheckpointError, match="now hold part of it"):
        fsdp_bridge.load_checkpoint(path, model, opt, all_or_nothing=False)
    state = fsdp_bridge.load_checkpoint(saved / "sharded", model, opt, all_or_nothing=False)
    assert state == {"step": 1}


def test_an_optimizer_with_other_groups_is_refused_before_the_model_changes(saved: Path) -> None:
    model = build_tiny("llama", seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=5.0)  # one group; the checkpoint has two
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match=r"2 parameter group\(s\), the optimizer 1"):
        fsdp_bridge.load_checkpoint(saved / "full", model, opt)
    assert _same(before, _snapshot(model, opt))


# ----------------------------------------------------------------------------------------
# convert keeps the optimizer's param_groups
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("source", "target"), [("sharded", "hf"), ("sharded", "sharded"), ("full", "sharded")])
def test_convert_keeps_param_groups(source: str, target: str, saved: Path, tmp_path: Path) -> None:
    dst = convert_checkpoint(saved / source, tmp_path / "converted", to=target)  # type: ignore[arg-type]
    model = build_tiny("llama", seed=5)
    opt = _optimizer(model, lr=5.0)
    for group in opt.param_groups:
        group.update(betas=(0.1, 0.2), weight_decay=0.0)
    fsdp_bridge.load_checkpoint(dst, model, opt)
    got = [(g["lr"], tuple(g["betas"]), g["weight_decay"]) for g in opt.param_groups]
    assert got == [(LR, BETAS, WD), (LR / 2, BETAS, 0.0)]
    model(**sample_batch(seed=2)).loss.backward()
    opt.step()  # a converted state steps (it used to raise KeyError: 'betas')
