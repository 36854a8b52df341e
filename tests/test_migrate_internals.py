"""migrate code: FSDP1's private free of a unit's gathered parameters (``_reshard`` with the unit's handles)
becomes ``fsdp_bridge.reshard(unit, recurse=False)``; look-alikes keep their TODOs. One process; the call's
numerics are checked in tests/test_any_module.py."""

from __future__ import annotations

from pathlib import Path

import libcst as cst

from fsdp_bridge.migrate._code import migrate_source

INTERNALS = Path(__file__).parent / "fixtures" / "migrate" / "internals"


def _migrate(name: str):  # type: ignore[no-untyped-def]
    result = migrate_source((INTERNALS / name).read_text(), name)
    cst.parse_module(result.fixed)  # the output is valid Python
    assert migrate_source(result.fixed, name).fixed == result.fixed, "a second --fix changes nothing"
    return result


def _body(fixed: str, function: str) -> list[str]:
    module = cst.parse_module(fixed)
    fn = next(s for s in module.body if isinstance(s, cst.FunctionDef) and s.name.value == function)
    lines = [line.strip() for line in module.code_for_node(fn).splitlines() if line.strip()]
    return lines[lines.index(f"def {function}({module.code_for_node(fn.params)}):") + 1 :]


def test_each_free_statement_becomes_one_call() -> None:
    result = _migrate("free_units.py")
    fixes = [f for f in result.findings if "_reshard(" in f.construct]
    assert [(f.line, f.fixable) for f in fixes] == [(18, True), (26, True), (32, True)]
    assert not [f for f in result.findings if not f.fixable and f.line >= 17], "no TODO left in the helpers"
    assert _body(result.fixed, "release") == ["fsdp_bridge.reshard(x, recurse=False)"]
    loop = "for unit in [m for m in net.modules() if fsdp_bridge.is_sharded(m)]:"
    assert _body(result.fixed, "release_all") == [loop, "fsdp_bridge.reshard(unit, recurse=False)"]
    assert _body(result.fixed, "release_either_torch") == [loop, "fsdp_bridge.reshard(unit, recurse=False)"]
    assert "_runtime_utils" not in result.fixed  # the private import went with its last use


def test_look_alikes_keep_their_todos() -> None:
    original = (INTERNALS / "look_alikes.py").read_text()
    result = _migrate("look_alikes.py")
    assert "fsdp_bridge.reshard" not in result.fixed
    todo_lines = {f.line for f in result.findings if not f.fixable and "_reshard" in f.construct}
    calls = {i for i, line in enumerate(original.splitlines(), 1) if "_reshard(unit" in line}
    assert calls and calls <= todo_lines, sorted(calls - todo_lines)


def test_shard_moves_and_frees_become_one_call() -> None:
    result = _migrate("shard_storage.py")
    assert _body(result.fixed, "park") == ["fsdp_bridge.move_shards(trainer.net, where, non_blocking=True)"]
    assert _body(result.fixed, "park_plain") == ['fsdp_bridge.move_shards(net, "cpu")']
    assert _body(result.fixed, "drop") == ["fsdp_bridge.free_shards(net)", "del net", "torch.cuda.empty_cache()"]
    assert not [f for f in result.findings if not f.fixable], "no TODO left"
    assert "_runtime_utils" not in result.fixed  # _lazy_init's import went with its last use


def test_shard_move_and_free_look_alikes_keep_their_todos() -> None:
    result = _migrate("shard_storage_look_alikes.py")
    code = "\n".join(line for line in result.fixed.splitlines() if not line.lstrip().startswith("#"))
    assert "move_shards" not in code and "free_shards" not in code  # (the TODO texts may name them)
    todo_lines = {f.line for f in result.findings if not f.fixable}
    assert {8, 19, 29} <= todo_lines, sorted(todo_lines)  # each _lazy_init / flat parameter read keeps its TODO


def test_fsdp1s_private_root_flag_is_reported() -> None:
    # isinstance(m, FSDP) and m._is_root: FSDPModule has no _is_root (AttributeError on FSDP2)
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def root_of(model):\n"
        "    for m in model.modules():\n"
        "        if isinstance(m, FSDP) and m._is_root:\n"
        "            return m\n"
    )
    result = migrate_source(code, "roots.py")
    flag = next(f for f in result.findings if f.construct == "m._is_root (an FSDP1 internal)")
    assert not flag.fixable and "FSDPModule has no _is_root" in flag.replacement


def test_wrapper_attributes_of_a_model_given_to_fsdp1s_state_functions_are_reported() -> None:
    # save(model): FSDP.sharded_optim_state_dict(model, o) shows model holds FSDP1 units; its
    # .sharding_strategy / .process_group (FSDP1 wrapper attributes, none on FSDP2) are reported, not left silent
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def save(model, opt, rank):\n"
        "    osd = FSDP.sharded_optim_state_dict(model, opt)\n"
        "    if rank == 0 or model.sharding_strategy is None:\n"
        "        return osd, model.process_group\n"
    )
    result = migrate_source(code, "save.py")
    found = {f.construct: f for f in result.findings}
    for attr in ("sharding_strategy", "process_group"):
        todo = found[f"model.{attr} (an FSDP1 wrapper attribute)"]
        assert not todo.fixable and "given to FSDP.sharded_optim_state_dict(...) here" in todo.replacement


def test_local_state_dict_kept_as_a_value_that_reaches_a_state_function_is_a_todo() -> None:
    # chosen at run time and handed on: no FSDP2 form, so not claimed as read "with FSDP1's meaning"; a test of a
    # value against it stays a kept value
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType\n\n\n"
        "def save(model, decomposed, kind):\n"
        "    sd_type = StateDictType.LOCAL_STATE_DICT if decomposed else StateDictType.SHARDED_STATE_DICT\n"
        "    if kind is StateDictType.LOCAL_STATE_DICT:\n"
        "        pass\n"
        "    with FSDP.state_dict_type(model, sd_type):\n"
        "        return model.state_dict()\n"
    )
    found = [f for f in migrate_source(code, "save.py").findings if f.construct == "StateDictType.LOCAL_STATE_DICT"]
    assert [(f.line, f.fixable) for f in found] == [(5, False), (6, True)], found
    assert "LOCAL_STATE_DICT has no FSDP2 form" in found[0].replacement


def test_a_private_name_imported_from_two_modules_is_named_the_same_on_every_run() -> None:
    # `HandleTrainingState` imported from `_common_utils` and, in a version branch, from `_flat_param`: libcst gives
    # both qualified names as a set, whose order changes between processes, so the TODO text changed and a second
    # --fix wrote a second TODO (a public tree was not idempotent).
    from libcst.metadata import QualifiedName, QualifiedNameSource

    from fsdp_bridge.migrate._names import fsdp1_private

    names = [
        QualifiedName(f"torch.distributed.fsdp.{m}.HandleTrainingState", QualifiedNameSource.IMPORT)
        for m in ("_flat_param", "_common_utils")
    ]
    assert (
        fsdp1_private(names)
        == fsdp1_private(reversed(names))
        == "torch.distributed.fsdp._common_utils.HandleTrainingState"
    )


def test_an_ema_update_over_fsdp1s_handles_becomes_one_call() -> None:
    result = _migrate("ema_updates.py")
    fixes = [f for f in result.findings if "EMA update" in f.construct]
    assert [(f.line, f.fixable) for f in fixes] == [(25, True), (41, True)]
    assert "fsdp_bridge.ema_update_(shadow, net, rate): pairs the two models' parameters" in fixes[0].replacement
    assert _body(result.fixed, "step_shadow") == [
        '"""Move the shadow weights a little towards the trained ones."""',
        "# pair unit with unit",
        "fsdp_bridge.ema_update_(shadow, net, rate)",
        "return rate",
    ]
    # which handles were averaged decides the order, not the order of zip's arguments
    assert _body(result.fixed, "step_shadow_short") == [
        "a_units, b_units = None, None",
        "fsdp_bridge.ema_update_(trainer.shadow, trainer.net, trainer.rate)",
        "return a_units, b_units",
    ]
    assert not [f for f in result.findings if not f.fixable], "no TODO left"
    assert "_traversal_utils" not in result.fixed  # both spellings of the private import went with their uses
    lowered = migrate_source((INTERNALS / "ema_updates.py").read_text(), "ema_updates.py", target="torch")
    assert "_fsdp2_helpers.ema_update_(shadow, net, rate)" in lowered.fixed and "fsdp_bridge" not in lowered.fixed


def test_ema_look_alikes_keep_their_todos() -> None:
    # the frozen test on the EMA's own units, a shape check, another alpha, the lists read after the update,
    # a decay computed by a call (read twice): not the plain average
    result = _migrate("ema_look_alikes.py")
    assert "ema_update_" not in result.fixed
    todo_lines = {f.line for f in result.findings if not f.fixable and "_get_fsdp_handles" in f.construct}
    assert todo_lines == {9, 10, 22, 23, 36, 37, 49, 50, 63, 64}, sorted(todo_lines)
