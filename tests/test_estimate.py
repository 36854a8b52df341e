"""Estimator arithmetic on the meta device (no process group, no weights)."""

from __future__ import annotations

import json

import pytest
import torch

from fsdp_bridge.cli import main
from fsdp_bridge.config import BridgeConfig
from fsdp_bridge.errors import ConfigError
from fsdp_bridge.estimate import (
    LiveBytes,
    build_meta_model,
    estimate,
    estimate_memory,
    format_table,
    load_model_config,
    model_units,
)
from fsdp_bridge.estimate.report import parse_bytes

LLAMA2_7B = (
    "llama:hidden_size=4096,intermediate_size=11008,num_hidden_layers=32,num_attention_heads=32,"
    "num_key_value_heads=32,vocab_size=32000"
)
SMALL = "llama:hidden_size=64,intermediate_size=128,num_hidden_layers=3,num_attention_heads=4,vocab_size=256"


def test_llama2_7b_full_shard_fp32_adamw_is_16_bytes_per_parameter_over_8() -> None:
    rows = estimate(LLAMA2_7B, world_size=8, strategies=["full_shard"], backends=["fsdp1", "fsdp2"])
    model = build_meta_model(LLAMA2_7B)
    n = sum(p.numel() for p in model.parameters())
    assert n == 6_738_415_616  # Llama-2-7B
    assert all(p.is_meta for p in model.parameters())
    for row in rows:
        # 4 (fp32 params) + 4 (grads) + 8 (AdamW exp_avg, exp_avg_sq), over 8 ranks; the
        # rest is padding and AdamW's scalar step tensors, a few KiB.
        assert row.sharded_state == pytest.approx(16 * n / 8, rel=1e-5)
        assert row.params == row.grads == pytest.approx(4 * n / 8, rel=1e-5)


def test_units_follow_resolve_wrap_and_sum_to_the_model() -> None:
    model = build_meta_model(SMALL)
    units = model_units(model, BridgeConfig())
    assert [u.name for u in units] == ["model.layers.0", "model.layers.1", "model.layers.2", "(root)"]
    assert sum(u.numel for u in units) == sum(p.numel() for p in model.parameters())
    assert len(model_units(model, BridgeConfig(wrap="none"))) == 1


def test_strategies_scale_as_expected() -> None:
    rows = {(r.backend, r.strategy): r for r in estimate(SMALL, world_size=4, nodes=2)}
    full = rows["fsdp2", "full_shard"]
    assert rows["fsdp2", "no_shard"].params == pytest.approx(4 * full.params, rel=0.01)
    hybrid = rows["fsdp2", "hybrid_shard"]
    assert hybrid.mesh == (2, 2) and hybrid.params == pytest.approx(2 * full.params, rel=0.01)
    # ZeRO-2 keeps every unit gathered; ZeRO-3 only the root and two units.
    assert rows["fsdp2", "shard_grad_op"].unsharded > full.unsharded
    # FSDP1 at world size 1 runs NO_SHARD: nothing to gather, nothing sharded.
    (one,) = estimate(SMALL, world_size=1, strategies=["full_shard"], backends=["fsdp1"])
    assert one.unsharded < full.unsharded and any("NO_SHARD" in n for n in one.notes)


def test_mixed_precision_offload_and_checkpointing() -> None:
    base = estimate(SMALL, world_size=2, strategies=["full_shard"], backends=["fsdp2"], batch=2, seq_len=32)[0]
    bf16 = estimate(
        SMALL,
        world_size=2,
        strategies=["full_shard"],
        backends=["fsdp2"],
        batch=2,
        seq_len=32,
        base=BridgeConfig(mixed_precision="bf16"),
    )[0]
    assert bf16.params == base.params  # fp32 master weights
    assert bf16.unsharded < base.unsharded and bf16.activations < base.activations
    ac = estimate(
        SMALL,
        world_size=2,
        strategies=["full_shard"],
        backends=["fsdp2"],
        batch=2,
        seq_len=32,
        base=BridgeConfig(activation_checkpointing=True),
    )[0]
    assert ac.activations < base.activations
    off = estimate(
        SMALL, world_size=2, strategies=["full_shard"], backends=["fsdp2"], base=BridgeConfig(cpu_offload=True)
    )[0]
    assert off.params == off.grads == off.optimizer == 0 and off.host == base.sharded_state


def test_optimizers() -> None:
    model = build_meta_model(SMALL)
    config = BridgeConfig()
    adamw = estimate_memory(model, config, world_size=2)
    sgd = estimate_memory(model, config, world_size=2, optimizer="sgd")
    plain = estimate_memory(model, config, world_size=2, optimizer="sgd-nomomentum")
    assert sgd.optimizer == sgd.params and plain.optimizer == 0
    assert adamw.optimizer > 2 * adamw.params  # + step scalars
    with pytest.raises(ConfigError, match=r"optimizer: got 'lamb'; allowed: adamw, adam"):
        estimate_memory(model, config, world_size=2, optimizer="lamb")
    with pytest.raises(ConfigError, match=r"nodes: got 3; allowed: a divisor of the world size \(4\)"):
        estimate_memory(model, config, world_size=4, nodes=3)


def test_device_memory_marks_what_fits() -> None:
    rows = estimate(LLAMA2_7B, world_size=8, device_memory=parse_bytes("80GiB"))
    fits = {(r.backend, r.strategy): r.fits for r in rows}
    assert fits["fsdp2", "full_shard"] is True and fits["fsdp2", "no_shard"] is False
    assert "NO" in format_table(rows)


def test_parse_bytes_and_model_specs(tmp_path) -> None:
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1.5 GB") == 1_500_000_000 and parse_bytes("12") == 12
    with pytest.raises(ConfigError, match=r"device_memory: got '80 parsecs'; allowed: a size such as 80GiB"):
        parse_bytes("80 parsecs")
    cfg = load_model_config(SMALL)
    (tmp_path / "m").mkdir()
    cfg.save_pretrained(tmp_path / "m")
    (tmp_path / "c.yaml").write_text(
        "model_type: llama\nhidden_size: 64\nintermediate_size: 128\n"
        "num_hidden_layers: 3\nnum_attention_heads: 4\nvocab_size: 256\n"
    )
    sizes = {
        sum(p.numel() for p in build_meta_model(s).parameters())
        for s in (SMALL, str(tmp_path / "m"), str(tmp_path / "m" / "config.json"), str(tmp_path / "c.yaml"))
    }
    assert len(sizes) == 1
    with pytest.raises(ConfigError, match=r"model: got 'llama:hidden_size'; allowed: TYPE:key=value"):
        load_model_config("llama:hidden_size")
    with pytest.raises(ConfigError, match=r"model: got .*; allowed: a directory with a config.json"):
        load_model_config(str(tmp_path))
    with pytest.raises(ConfigError, match=r"model: got 'nosuchmodel'; allowed: a model_type transformers knows"):
        load_model_config("nosuchmodel")
    with pytest.raises(ConfigError, match=r"batch/seq_len: got \(2, None\); allowed: both or neither"):
        estimate(SMALL, world_size=2, batch=2)


def test_live_bytes_counts_new_storages_once() -> None:
    keep = torch.zeros(100)
    with LiveBytes("cpu", ignore=[keep]) as live:
        a = torch.ones(256)  # 1 KiB
        b = a.view(16, 16)  # a view: nothing new
        keep.add_(1)
        c = torch.ones(512)
        del c
    assert live.peak == 256 * 4 + 512 * 4 and live.current == 256 * 4
    del a, b


def test_cli_table_and_json(capsys) -> None:
    assert (
        main(
            [
                "estimate",
                SMALL,
                "--world-size",
                "2",
                "--strategy",
                "full_shard,no_shard",
                "--backend",
                "fsdp2",
                "--batch",
                "2",
                "--seq-len",
                "16",
                "--device-memory",
                "1GiB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "full_shard" in out and "no_shard" in out and "yes" in out
    assert main(["estimate", SMALL, "--world-size", "4", "--nodes", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["rows"]) == 10
    hybrid = next(r for r in data["rows"] if r["strategy"] == "hybrid_shard" and r["backend"] == "fsdp1")
    assert hybrid["mesh"] == [2, 2]
    assert hybrid["sharded_state"] == hybrid["params"] + hybrid["grads"] + hybrid["optimizer"]
    assert main(["estimate", SMALL, "--world-size", "2", "--strategy", "quarter_shard"]) == 2
    assert "strategy: got 'quarter_shard'" in capsys.readouterr().err


def test_attention_that_needs_data_is_refused_with_a_fix() -> None:
    with pytest.raises(ConfigError, match=r"attn_implementation: got 'sdpa'; allowed: eager .* Fix: use --attn eager"):
        estimate(SMALL, world_size=2, batch=1, seq_len=8, attn_implementation="sdpa")


@pytest.mark.parametrize(
    "spec",
    [
        "bert:hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64,vocab_size=128",
        "electra:hidden_size=32,embedding_size=16,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64,"
        "vocab_size=128",
        "t5:d_model=32,num_layers=1,num_heads=2,d_ff=64,d_kv=16,vocab_size=128",
    ],
)
def test_activations_of_encoder_and_encoder_decoder_models(spec: str) -> None:
    # An all-ones mask makes bidirectional models ask the data whether it can be skipped,
    # and T5 shifts labels with a start token small configs leave unset: both used to fail.
    report = estimate(spec, world_size=2, batch=2, seq_len=8, attn_implementation="eager")
    assert report and all(row.activations > 0 for row in report)


def test_live_bytes_counts_storage_resizes() -> None:
    # FSDP frees a gathered parameter with storage.resize_(0) while autograd still holds views
    # of it, and allocates it again with resize_(n): no operator reports either.
    before, own = torch.UntypedStorage.resize_, dict(vars(torch.UntypedStorage))
    kept = torch.zeros(64)  # exists before the mode: counted once it grows inside it
    kept.untyped_storage().resize_(0)
    with LiveBytes("cpu") as live:
        a = torch.ones(256)  # 1 KiB
        view = a[:8]  # what autograd would save
        a.untyped_storage().resize_(0)
        assert live.current == 0 and view.untyped_storage() is not None
        kept.untyped_storage().resize_(64 * 4)
        assert live.current == 64 * 4
        a.untyped_storage().resize_(256 * 4)
        assert live.current == live.peak == 256 * 4 + 64 * 4
        kept.untyped_storage().resize_(0)
    assert live.current == 256 * 4
    assert torch.UntypedStorage.resize_ is before and dict(vars(torch.UntypedStorage)) == own  # unwrapped
    del a, view


def test_no_shard_keeps_one_units_working_copy_at_a_time() -> None:
    # FSDP2 copies a unit's parameters into separate buffers even on a shard group of one; NO_SHARD
    # units reshard after forward, so the root's copy and one other unit's are alive at once.
    model = build_meta_model(SMALL)
    units = model_units(model, BridgeConfig())
    root, layer = units[-1].numel * 4, max(u.numel for u in units[:-1]) * 4
    (row,) = estimate(SMALL, world_size=2, strategies=["no_shard"], backends=["fsdp2"])
    assert row.unsharded == root + layer + layer  # + the unit's gradient, unreduced
    # FSDP1 holds a one-rank flat parameter as it is: nothing gathered, only the gradient.
    (fsdp1,) = estimate(SMALL, world_size=2, strategies=["no_shard"], backends=["fsdp1"])
    assert fsdp1.unsharded == layer


def test_live_bytes_names_what_is_alive_at_the_peak() -> None:
    def make_big() -> torch.Tensor:
        return torch.ones(1024)

    with LiveBytes("cpu", sites=True) as live:
        small = torch.zeros(16)
        big = make_big()
        del big
        torch.zeros(8)
    (big_site, small_site) = live.peak_sites
    assert live.peak_sites[big_site] == 1024 * 4 and live.peak_sites[small_site] == 16 * 4
    assert big_site.startswith("aten.ones.default ") and big_site.endswith("(make_big)")
    assert "test_estimate.py:" in small_site and "aten.zeros" in small_site
    del small
