"""Wrap-unit resolution, the mapping table and `fsdp-bridge explain` (no process group)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from fsdp_bridge import Backend, BridgeConfig, ConfigError, Outcome, translate
from fsdp_bridge.cli import main
from fsdp_bridge.config import WrapPolicy
from fsdp_bridge.mapping import CONFIG_OPTIONS, TABLE
from fsdp_bridge.testing.models import FAMILIES, build_tiny
from fsdp_bridge.wrap import module_names, resolve_ignored, resolve_ignored_params, resolve_wrap

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("family", "unit_class", "count"),
    [
        ("llama", "LlamaDecoderLayer", 2),
        ("gpt2", "GPT2Block", 2),
        ("t5", "T5Block", 4),
        ("bert", "BertLayer", 2),
        ("opt", "OPTDecoderLayer", 2),
        ("gemma", "GemmaDecoderLayer", 2),
    ],
)
def test_auto_wrap_picks_transformer_blocks(family: str, unit_class: str, count: int) -> None:
    plan = resolve_wrap(build_tiny(family), WrapPolicy())
    assert [type(m).__name__ for m in plan.modules] == [unit_class] * count
    assert plan.source.startswith("auto")


def test_tied_embeddings_never_split_across_units() -> None:
    model = build_tiny("gpt2")  # wte is tied to lm_head
    plan = resolve_wrap(model, WrapPolicy(mode="classes", classes=("Embedding", "GPT2Block")))
    names = [n for n, _ in plan.units]
    assert "transformer.wte" not in names and "transformer.wpe" in names
    assert any("transformer.wte is not a unit of its own" in note and "lm_head" in note for note in plan.notes)


def test_a_module_reached_by_two_paths_stays_a_unit_of_its_own() -> None:
    # model.head is also held as model.body.head (one module, two paths): FSDP1 wraps it once, and its weight is
    # in that one group whichever path calls it, so it stays a unit (it was merged into the root, whose
    # parameters a method other than forward never gathers)
    body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model = nn.Module()
    model.body = body
    model.head = nn.Linear(4, 3)
    body.head = model.head
    plan = resolve_wrap(model, WrapPolicy(mode="classes", classes=("Linear",)))
    assert sorted(n for n, _ in plan.units) == ["body.0", "body.1", "body.head"] and not plan.notes
    # the parent holding one of its paths stays a unit too: the shared module's parameters are in its own group
    plan = resolve_wrap(model, WrapPolicy(mode="classes", classes=("Linear", "Sequential")))
    assert sorted(n for n, _ in plan.units) == ["body", "body.0", "body.1", "body.head"] and not plan.notes


def test_min_num_params_follows_fsdp1_size_policy() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 2)), nn.Linear(2, 2))
    plan = resolve_wrap(model, WrapPolicy(mode="min_params", min_num_params=100))
    # 110-parameter leaves are wrapped; the inner Sequential's remainder (22) is not; nor is the 6-param leaf.
    assert [n for n, _ in plan.units] == ["0", "1.0"]


def test_callable_and_none_policies() -> None:
    model = build_tiny("llama")
    assert resolve_wrap(model, WrapPolicy(mode="none")).units == []
    plan = resolve_wrap(model, WrapPolicy(mode="callable", fn=lambda m: isinstance(m, nn.Embedding)))
    assert [n for n, _ in plan.units] == ["model.embed_tokens"]


def test_plain_module_without_no_split_modules_wraps_modulelist_entries() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    assert [n for n, _ in resolve_wrap(model, WrapPolicy()).units] == ["1.0", "1.1"]


def test_wrap_class_not_in_model_lists_what_it_has() -> None:
    with pytest.raises(
        ConfigError,
        match=r"wrap: got 'LlamaLayer'; allowed: a module class the model contains: .*"
        r"LlamaDecoderLayer.*its _no_split_modules are \['LlamaDecoderLayer'\]",
    ):
        resolve_wrap(build_tiny("llama"), WrapPolicy(mode="classes", classes=("LlamaLayer",)))


def test_ignored_modules_resolve_and_errors() -> None:
    model = build_tiny("llama")
    assert [n for n, _ in resolve_ignored(model, ("lm_head",))] == ["lm_head"]
    assert len(resolve_ignored(model, ("LlamaRMSNorm",))) == 5
    with pytest.raises(ConfigError, match="ignored_modules: got 'head'; allowed: a module path, class name or param"):
        resolve_ignored(model, ("head",))
    # A parameter path is not a module: resolve_ignored_params takes it.
    assert resolve_ignored(model, ("model.norm.weight",)) == []
    assert resolve_ignored_params(model, ("lm_head", "model.norm.weight")) == [model.model.norm.weight]
    assert module_names(model, [model.model.norm.weight, model.lm_head]) == ["model.norm.weight", "lm_head"]
    plan = resolve_wrap(model, WrapPolicy(), ignored=[model.model.layers[0]])
    assert [n for n, _ in plan.units] == ["model.layers.1"]


def test_table_covers_every_config_field_and_backend() -> None:
    fields = set(BridgeConfig.field_names()) - {"backend"}  # the selector, not an option
    options = {o.split(".")[0] for o in CONFIG_OPTIONS}
    assert fields == options, (
        f"fields without a mapping rule: {fields - options}; rules without a field: {options - fields}"
    )
    for rule in TABLE:
        for backend in Backend:
            assert rule.for_backend(backend).text, f"{rule.option}/{rule.case} has no text for {backend}"


def test_no_shard_keeps_its_meaning_on_fsdp2() -> None:
    report = translate(BridgeConfig(strategy="no_shard"), Backend.FSDP2)
    entry = next(e for e in report.entries if e.option == "strategy")
    assert entry.outcome is Outcome.EMULATED and "all-reduced" in entry.text and "not ZeRO-2" in entry.text


def test_cpu_offload_on_cpu_is_not_needed_on_both_backends() -> None:
    for backend in Backend:
        report = translate(BridgeConfig(cpu_offload=True, backend=backend), backend, device_type="cpu")
        entry = next(e for e in report.entries if e.option == "cpu_offload")
        assert entry.outcome is Outcome.NOT_NEEDED and "accelerator" in entry.text


def test_every_option_value_gets_exactly_one_outcome() -> None:
    for backend in Backend:
        report = translate(BridgeConfig(backend="fsdp1", backward_prefetch="post"), backend)
        options = [e.option for e in report.entries]
        assert len(options) == len(set(options))


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
# `fsdp-bridge explain` through the CLI's main in this process (the console entry point itself
# runs in test_imports.py and test_doc_commands.py).
def test_explain_prints_table_for_every_example(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["explain", str(example)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "fsdp1:" in out.out and "fsdp2:" in out.out and "strategy" in out.out


def test_explain_flags_options_the_other_backend_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("backend: fsdp1\nbackward_prefetch: post\n")
    code = main(["explain", str(path), "--backend", "fsdp2"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "! backward_prefetch is refused on fsdp2" in out.out
    bad = tmp_path / "bad.yaml"
    bad.write_text("backend: fsdp2\nbackward_prefetch: post\nstrategy: zero\n")
    code = main(["explain", str(bad)])
    assert code == 2 and "strategy: got 'zero'" in capsys.readouterr().err


def test_families_list() -> None:
    assert set(FAMILIES) == {"llama", "qwen2", "mistral", "mixtral", "gpt2", "opt", "gemma", "bert", "t5"}


class _Base(nn.Linear):
    pass


class _Sub(_Base):
    pass


class _Absent(nn.Module):
    pass


def test_classes_wrap_their_subclasses_and_absent_python_classes_wrap_nothing() -> None:
    # FSDP1's ModuleWrapPolicy / transformer_auto_wrap_policy test isinstance: a base class covers its subclasses,
    # and a class the model lacks wraps nothing (a model holds one family's block of several named)
    model = nn.Sequential(_Sub(2, 2), nn.Sequential(_Sub(2, 2)), nn.Linear(2, 2))
    config = BridgeConfig(wrap=[_Base, _Absent])
    assert config.wrap.absent_ok
    plan = resolve_wrap(model, config.wrap)
    assert [n for n, _ in plan.units] == ["0", "1.0"]
    assert "_Absent not in the model" in plan.source
    # names given as text must be in the model: a misspelling is refused, naming what the model has
    with pytest.raises(ConfigError, match="_Absent"):
        resolve_wrap(model, BridgeConfig(wrap=["_Base", "_Absent"]).wrap)
    assert [n for n, _ in resolve_wrap(model, BridgeConfig(wrap=["_Base"]).wrap).units] == ["0", "1.0"]
    with pytest.raises(ConfigError, match="Module"):  # every module's base: never a wrap class
        resolve_wrap(model, BridgeConfig(wrap=["Module"]).wrap)


def test_classes_the_model_may_lack_keep_that_in_yaml_and_back() -> None:
    # A config made from Python classes (absent ones allowed, as FSDP1's policies) and written to YAML reads
    # back with the same leniency; text names stay strict; absent_ok alone, or not a bool, is refused.
    config = BridgeConfig(wrap=[_Base, _Absent])
    assert config.wrap.to_spelling() == {"classes": ["_Base", "_Absent"], "absent_ok": True}
    again = BridgeConfig.from_dict(config.to_dict())
    assert again.wrap.absent_ok and again.wrap.classes == ("_Base", "_Absent")
    model = nn.Sequential(_Sub(2, 2), nn.Linear(2, 2))
    assert [n for n, _ in resolve_wrap(model, again.wrap).units] == ["0"]
    assert BridgeConfig(wrap=["_Base"]).wrap.to_spelling() == ["_Base"]
    assert not BridgeConfig.from_dict({"wrap": {"classes": ["_Base"]}}).wrap.absent_ok
    with pytest.raises(ConfigError, match="absent_ok only beside classes"):
        BridgeConfig.from_dict({"wrap": {"absent_ok": True}})
    with pytest.raises(ConfigError, match="true or false"):
        BridgeConfig.from_dict({"wrap": {"classes": ["_Base"], "absent_ok": "yes"}})
