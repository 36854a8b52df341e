"""Precision of the call and type-test rewrites: ``x.no_sync()`` / ``x.clip_grad_norm_(...)`` are rewritten only
where the code shows ``x`` is FSDP1's wrapper, methods of the same name elsewhere are left alone, and code
that already serves several backends keeps each backend's path."""

from __future__ import annotations

import textwrap
from pathlib import Path

import libcst as cst

from fsdp_bridge.migrate._code import migrate_paths, migrate_source

PRECISION = Path(__file__).parent / "fixtures" / "migrate" / "precision"


def _migrate(name: str):  # type: ignore[no-untyped-def]
    result = migrate_source((PRECISION / name).read_text(), name)
    cst.parse_module(result.fixed)  # the output is valid Python
    again = migrate_source(result.fixed, name)
    assert again.fixed == result.fixed, "a second --fix changes nothing"
    return result


def _line(fixed: str, text: str) -> str:
    hits = [line.strip() for line in fixed.splitlines() if text in line and not line.lstrip().startswith("#")]
    assert len(hits) == 1, (text, hits)
    return hits[0]


def test_own_methods_with_blocks_are_scanned_not_skipped() -> None:
    # A class's own no_sync / clip_grad_norm_ whose body opens with with/for/if made the scan raise
    # TypeError and the file was skipped whole.
    result = _migrate("own_methods.py")
    assert "fsdp_bridge.shard(module" in result.fixed
    assert "def no_sync(self, model):" in result.fixed
    assert "def clip_grad_norm_(self, parameters, max_norm):" in result.fixed


def test_another_objects_methods_are_not_rewritten() -> None:
    fixed = _migrate("foreign_receiver.py").fixed
    # the helper's own methods: the model is their argument, parameters come first
    assert _line(fixed, "helper.no_sync(") == "with self.helper.no_sync(self.net):"
    assert _line(fixed, "(params, 1.0)") == "self.helper.clip_grad_norm_(params, 1.0)"
    assert _line(fixed, "max_norm=1.0") == "self.helper.clip_grad_norm_(self.net.parameters(), max_norm=1.0)"
    assert "fsdp_bridge.clip_grad_norm_(self.helper" not in fixed


def test_proven_wrappers_are_rewritten_unknown_receivers_get_a_todo() -> None:
    result = _migrate("foreign_receiver.py")
    fixed = result.fixed
    # constructed in the class, annotated as FSDP: rewritten
    assert _line(fixed, "self.net, 1.0") == "fsdp_bridge.clip_grad_norm_(self.net, 1.0)"
    assert "with fsdp_bridge.no_sync(self.net):" in fixed
    assert "with fsdp_bridge.no_sync(model):" in fixed
    assert "return fsdp_bridge.clip_grad_norm_(model, 2.0)" in fixed
    # nothing shows what runner is: kept, with a TODO saying why
    assert _line(fixed, "runner.no_sync") == "with runner.no_sync():"
    assert _line(fixed, "runner.clip_grad_norm_") == "runner.clip_grad_norm_(0.5)"
    todos = [f for f in result.findings if not f.fixable and f.construct.startswith("runner.")]
    assert len(todos) == 2
    assert all("nothing here shows runner is FSDP1's wrapper" in f.replacement for f in todos)


def test_dual_backend_tests_keep_each_backends_path() -> None:
    result = _migrate("dual_paths.py")
    fixed = result.fixed
    # the FSDP1 predicate stays distinct from the tree's FSDP2 one
    assert "def is_fsdp1(m):\n    return fsdp_bridge.is_sharded(m)" in fixed
    assert "def is_fsdp2(m):\n    return isinstance(m, FSDPModule)" in fixed
    # no (FSDPModule, FSDPModule): FSDP1's class becomes the bridge's test beside the other classes
    assert "if (isinstance(m, FSDPModule) or fsdp_bridge.is_sharded(m)):" in fixed
    assert "(isinstance(module, DDP) or fsdp_bridge.is_sharded(module)) and not sync" in fixed
    assert "if fsdp_bridge.is_sharded(module):\n        return fsdp_bridge.clip_grad_norm_(module, limit)" in fixed
    no_sync = next(f for f in result.findings if f.construct == "module.no_sync()")
    assert "DistributedDataParallel" in no_sync.replacement
    assert "FullyShardedDataParallel" not in fixed and "FSDPModule, FSDPModule" not in fixed

    # Run the migrated functions on each kind of module: each takes the path its original took.
    from unittest import mock

    import torch
    from torch import nn
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    namespace: dict[str, object] = {}
    exec(compile(fixed, "dual_paths.py", "exec"), namespace)
    torch_unit = nn.Linear(2, 2)
    torch_unit.__class__ = type("TorchSharded", (FSDPModule, nn.Linear), {})  # torch's own fully_shard
    fsdp1 = mock.MagicMock(spec=FullyShardedDataParallel)  # FSDP1 (shard()'s fsdp1 backend, or torch's)
    fsdp1.clip_grad_norm_.return_value = torch.tensor(5.0)
    plain = nn.Linear(2, 2)
    is_fsdp1, is_fsdp2, clip, shard_once = (namespace[n] for n in ("is_fsdp1", "is_fsdp2", "clip", "shard_once"))
    assert (is_fsdp1(fsdp1), is_fsdp2(fsdp1)) == (True, False)  # type: ignore[operator]
    assert (is_fsdp1(torch_unit), is_fsdp2(torch_unit)) == (False, True)  # type: ignore[operator]
    assert (is_fsdp1(plain), is_fsdp2(plain)) == (False, False)  # type: ignore[operator]
    assert clip(fsdp1, 1.0).item() == 5.0  # type: ignore[operator]
    fsdp1.clip_grad_norm_.assert_called_once_with(1.0, 2.0)
    assert shard_once(fsdp1) is fsdp1 and shard_once(torch_unit) is torch_unit  # type: ignore[operator]


def test_is_sharded_in_one_process() -> None:
    from unittest import mock

    from torch import nn
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    import fsdp_bridge

    torch_unit = nn.Linear(2, 2)
    torch_unit.__class__ = type("TorchSharded", (FSDPModule, nn.Linear), {})
    assert fsdp_bridge.is_sharded(mock.MagicMock(spec=FullyShardedDataParallel))
    assert not fsdp_bridge.is_sharded(torch_unit)  # torch's own fully_shard, not made by shard()
    assert not fsdp_bridge.is_sharded(nn.Linear(2, 2))
    assert not fsdp_bridge.is_sharded("a string")


def test_a_model_handed_over_by_the_tree_is_shown_fsdp1() -> None:
    result = _migrate("handed_over.py")
    fixed = result.fixed
    # loop(3, model, ...) with model from build(), which returns FSDP(...) first: net is FSDP1's wrapper
    assert "with fsdp_bridge.no_sync(net):" in fixed
    assert "fsdp_bridge.clip_grad_norm_(net, 1.0)" in fixed
    # self.body = wrap(...) in the class: net.body is a unit; nothing wraps tail
    assert "fsdp_bridge.clip_grad_norm_(net.body, 1.0)" in fixed
    assert _line(fixed, "net.tail.clip_grad_norm_") == "net.tail.clip_grad_norm_(1.0)"
    todos = [f for f in result.findings if not f.fixable]
    assert [f.construct for f in todos] == ["net.tail.clip_grad_norm_(...)"]
    # save(model, ...) hands it on too: its state_dict() stays FSDP1's full one on FSDP2, and a module another
    # call may hand save() keeps its own call
    assert (
        "torch.save((get_model_state_dict(net, options=StateDictOptions(full_state_dict=True)) "
        "if isinstance(net, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in net.modules()) else net.state_dict()), path)"
        in fixed
    )


def test_a_model_from_a_factory_of_the_file_is_shown_fsdp1() -> None:
    # model, optimizer = build(): build returns FSDP(...) as its first element
    assert "    with fsdp_bridge.no_sync(model):" in _migrate("handed_over.py").fixed


def test_a_tree_that_subclasses_the_wrapper_gets_the_bridges_scaler_too(tmp_path: Path) -> None:
    # The subclass stays FSDP1 (a TODO), so its gradients stay flat shards: fsdp_bridge.GradScaler all-reduces
    # the overflow check as ShardedGradScaler does (torch.amp.GradScaler would not), so it is right there too.
    (tmp_path / "wrappers.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel\n\n\n"
        "class TracedSharded(FullyShardedDataParallel):\n"
        "    pass\n"
    )
    (tmp_path / "scaling.py").write_text(
        "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n\n\n"
        "def make_scaler(sharded):\n"
        "    kind = ShardedGradScaler if sharded else None\n"
        "    return kind, ShardedGradScaler(init_scale=1024.0)\n"
    )
    by_path = {Path(r.path).name: r for r in migrate_paths([tmp_path])[1]}
    scaling = by_path["scaling.py"]
    assert "kind = fsdp_bridge.GradScaler if sharded else None" in scaling.fixed
    assert "return kind, fsdp_bridge.GradScaler(init_scale=1024.0)" in scaling.fixed
    assert "ShardedGradScaler" not in scaling.fixed
    assert len(scaling.findings) == 2 and all(f.fixable for f in scaling.findings)


def test_unittest_type_assertions_become_is_sharded() -> None:
    # self.assertIsInstance(m, FSDP) in a TestCase was left with a TODO naming FSDPModule (which would fail for a
    # model sharded on the fsdp1 backend); it tests what isinstance(m, FSDP) tests, so it is rewritten the same way.
    result = _migrate("unittest_asserts.py")
    fixed = result.fixed
    # Recorder's and Audit's own methods (Audit's base is named ...TestCase but is no TestCase): kept, with TODOs
    assert fixed.count("        self.assertIsInstance(model, FSDP)\n") == 2
    assert _line(fixed, "assertTrue(fsdp_bridge.is_sharded(model))") == "self.assertTrue(fsdp_bridge.is_sharded(model))"
    assert _line(fixed, "(block)") == 'self.assertTrue(fsdp_bridge.is_sharded(block), "each block is a unit")'
    assert (
        _line(fixed, "(head)")
        == 'self.assertFalse(fsdp_bridge.is_sharded(head), msg="the head stays in the root unit")'
    )
    assert (
        _line(fixed, "nn.Sequential) or")
        == "self.assertTrue(isinstance(model, nn.Sequential) or fsdp_bridge.is_sharded(model))"
    )
    # an object that is not a plain name or attribute (evaluated once by the assertion): a TODO, as for isinstance
    body = _line(fixed, "get_submodule")
    assert body == 'self.assertIsInstance(model.get_submodule("body"), (FSDP, nn.Sequential))'
    todos = sorted(f.construct for f in result.findings if not f.fixable)
    assert todos == ["FSDP", "FSDP", "self.assertIsInstance(..., (FSDP, nn.Sequential))"]
    kept = next(f for f in result.findings if not f.fixable and f.construct.startswith("self.assertIsInstance"))
    assert "self.assertTrue(isinstance(x, (nn.Sequential)) or fsdp_bridge.is_sharded(x))" in kept.replacement

    # The migrated assertions hold for an FSDP1 wrapper and fail for a plain module, as the originals did.
    from unittest import mock

    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel

    namespace: dict[str, object] = {}
    exec(compile(fixed, "unittest_asserts.py", "exec"), namespace)
    case = namespace["WrapChecks"]("check_wrapped")  # type: ignore[operator]
    fsdp1 = mock.MagicMock(spec=FullyShardedDataParallel)
    case.check_wrapped(fsdp1, [fsdp1], nn.Linear(2, 2))
    for model, blocks, head in ((nn.Linear(2, 2), [], nn.Linear(2, 2)), (fsdp1, [fsdp1], fsdp1)):
        try:
            case.check_wrapped(model, blocks, head)
        except AssertionError:
            continue
        raise AssertionError(f"the migrated assertions passed for {model!r}, {head!r}")


def test_the_module_inside_fsdp1s_wrapper_is_unwrapped_on_either_backend() -> None:
    # unit._fsdp_wrapped_module taken itself: on the fsdp1 backend the unit is still FSDP1's wrapper, so dropping
    # the attribute (as for a forwarded read) would hand the wrapper where the inner module was meant.
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "\n"
        "def tag(wrapped):\n"
        "    for unit in FSDP.fsdp_modules(wrapped):\n"
        "        inner = unit._fsdp_wrapped_module\n"
        "        inner.__dict__['outer'] = unit\n"
        "        sd = unit._fsdp_wrapped_module.state_dict()\n"
        "    return wrapped._fsdp_wrapped_module.depth, sd\n"
    )
    fixed = migrate_source(code, "tag.py").fixed
    assert "inner = fsdp_bridge.unwrapped(unit)\n" in fixed
    assert "sd = fsdp_bridge.unwrapped(unit).state_dict()\n" in fixed
    assert "return wrapped.depth, sd\n" in fixed  # a name the wrapper forwards: the same on both backends
    assert "TODO" not in fixed and migrate_source(fixed, "tag.py").fixed == fixed

    from unittest import mock

    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel

    import fsdp_bridge

    inner = nn.Linear(2, 2)
    fsdp1 = mock.MagicMock(spec=FullyShardedDataParallel)
    fsdp1._fsdp_wrapped_module = inner
    assert fsdp_bridge.unwrapped(fsdp1) is inner and fsdp_bridge.unwrapped(inner) is inner
    # a .module rewrite may meet DDP's wrapper on another path (a public trainer's DDP branch): its module
    assert fsdp_bridge.unwrapped(nn.DataParallel(inner)) is inner
    ddp = mock.MagicMock(spec=nn.parallel.DistributedDataParallel)
    ddp.module = inner
    assert fsdp_bridge.unwrapped(ddp) is inner


def test_a_communication_hook_on_an_fsdp1_wrapper_gets_a_todo() -> None:
    # FSDP1's register_comm_hook(state, hook) replaces each unit's gradient reduction; FSDPModule has no such
    # method, so the migrated model raised AttributeError there with no word in the report.
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "\n"
        "class Runner(torch.nn.Module):\n"
        "    def __init__(self, net):\n"
        "        super().__init__()\n"
        "        self.inner = FSDP(net)\n"
        "\n"
        "def build(net, hook):\n"
        "    sharded = FSDP(net)\n"
        "    sharded.register_comm_hook(None, hook)\n"
        "    runner = Runner(net)\n"
        "    runner.inner.register_comm_hook(None, hook)\n"
        "    return sharded\n"
        "\n"
        "def replicate(net, hook):\n"
        "    plain = DDP(net)\n"
        "    plain.register_comm_hook(None, hook)\n"
        "    return plain\n"
    )
    result = migrate_source(code, "hooks.py")
    todos = [f for f in result.findings if not f.fixable and "register_comm_hook" in f.construct]
    assert [f.construct for f in todos] == ["sharded.register_comm_hook(...)", "runner.inner.register_comm_hook(...)"]
    assert all("FSDPModule has no register_comm_hook" in f.replacement for f in todos)
    assert result.fixed.count("# TODO(fsdp-bridge): sharded.register_comm_hook") == 1
    assert "plain.register_comm_hook(None, hook)" in result.fixed  # DDP's own hook stays, unreported
    assert migrate_source(result.fixed, "hooks.py").fixed == result.fixed
    # one of DDP's hooks handed to FSDP1 (called hook(state, grad) there) never ran: the TODO says to remove it
    powersgd = code.replace(
        "import torch\n",
        "import torch\nfrom torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD\n",
    )
    powersgd = powersgd.replace(
        "sharded.register_comm_hook(None, hook)", "sharded.register_comm_hook(None, powerSGD.powerSGD_hook)"
    )
    todo = next(f for f in migrate_source(powersgd, "hooks.py").findings if f.construct.startswith("sharded."))
    assert "DDP communication hook" in todo.replacement and "remove the call" in todo.replacement


def test_the_wrapped_module_in_a_tree_keeping_a_subclass_of_the_wrapper_is_unwrapped_not_dropped() -> None:
    # A subclass of FSDP1's wrapper stays FSDP1's (a TODO), and its models reach a function guarded by
    # isinstance(m, FSDP): there m.module is still the module inside the wrapper, so dropping .module would hand
    # the wrapper itself on. fsdp_bridge.unwrapped(m) is right on both.
    guarded = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def inner(m):\n"
        "    if isinstance(m, FSDP):\n"
        "        return m.module\n"
        "    return m\n"
    )
    kept = "\n\nclass TracedFSDP(FSDP):\n    def forward(self, *args):\n        return super().forward(*args)\n"
    fixed = migrate_source(guarded + kept, "wrappers.py").fixed
    assert "        return fsdp_bridge.unwrapped(m)\n" in fixed
    assert migrate_source(fixed, "wrappers.py").fixed == fixed
    plain = migrate_source(guarded, "inner.py").fixed  # no subclass kept: the same, right on either backend
    assert "        return fsdp_bridge.unwrapped(m)\n" in plain


def test_the_wrapped_module_of_a_model_wrapped_outside_the_tree_is_unwrapped_not_dropped() -> None:
    # A training library outside the tree wraps the model with FSDP1 and hands it to the tree's callback, which
    # tells the cases apart with isinstance. --fix cannot change that library: the model stays FSDP1's wrapper
    # there, and state.model.model.module must still be the module inside it (dropping .module handed the wrapper
    # on, so save_pretrained and the config check then read the wrapper). A name the wrapper hands on to the
    # module it wraps (.config) reads the same without .module on both.
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "class SaveCallback:\n"
        "    def on_save(self, state, path):\n"
        "        if isinstance(state.model.model, FSDP):\n"
        "            original = state.model.model.module\n"
        "            config = state.model.model.module.config\n"
        "        else:\n"
        "            original = state.model.model\n"
        "            config = original.config\n"
        "        original.save_pretrained(path)\n"
        "        return config\n"
    )
    result = migrate_source(code, "callbacks.py")
    assert "            original = fsdp_bridge.unwrapped(state.model.model)\n" in result.fixed
    assert "            config = state.model.model.config\n" in result.fixed
    assert "            original = state.model.model\n" in result.fixed  # the other branch, untouched
    assert all(f.fixable for f in result.findings) and "TODO" not in result.fixed
    assert migrate_source(result.fixed, "callbacks.py").fixed == result.fixed
    torch_target = migrate_source(code, "callbacks.py", target="torch").fixed
    assert "fsdp_bridge" not in torch_target and "            original = state.model.model\n" in torch_target

    from types import SimpleNamespace
    from unittest import mock

    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel

    namespace: dict = {}
    exec(compile(result.fixed, "callbacks.py", "exec"), namespace)
    saved = []
    inner = nn.Linear(2, 2)
    inner.config = "the model's config"
    inner.save_pretrained = saved.append
    fsdp1 = mock.MagicMock(spec=FullyShardedDataParallel)  # what the library outside the tree made
    fsdp1._fsdp_wrapped_module, fsdp1.config = inner, inner.config  # FSDP1 hands .config to the inner module
    assert namespace["SaveCallback"]().on_save(SimpleNamespace(model=SimpleNamespace(model=fsdp1)), "out") == (
        "the model's config"
    )
    assert saved == ["out"]


def test_a_model_a_base_class_in_another_file_wraps_is_fsdp1s_in_its_subclasses(tmp_path: Path) -> None:
    # A worker base class keeps its FSDP1 model in self.model; a trainer subclass in another file clips it. The
    # call is FSDP1's (FSDP2 modules have no clip_grad_norm_: left as it was, it raises AttributeError). A subclass
    # that assigns self.model itself shows nothing about it.
    (tmp_path / "base.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "class ShardedWorker:\n    def build(self, net):\n        self.model = FSDP(net)\n"
    )
    (tmp_path / "trainer.py").write_text(
        "from base import ShardedWorker\n\n\n"
        "class Trainer(ShardedWorker):\n"
        "    def step(self, loss, max_norm):\n"
        "        loss.backward()\n"
        "        self.model.clip_grad_norm_(max_norm=max_norm)\n\n\n"
        "class Rebuilt(ShardedWorker):\n"
        "    def build(self, net):\n"
        "        self.model = net\n\n"
        "    def step(self, max_norm):\n"
        "        self.model.clip_grad_norm_(max_norm=max_norm)\n"
    )
    report, _ = migrate_paths([tmp_path], fix=True)
    fixed = (tmp_path / "trainer.py").read_text()
    assert "        fsdp_bridge.clip_grad_norm_(self.model, max_norm=max_norm)\n" in fixed
    assert "        self.model.clip_grad_norm_(max_norm=max_norm)\n" in fixed  # Rebuilt's, a TODO above it
    assert [f.line for f in report.findings if f.construct == "self.model.clip_grad_norm_(...)" and not f.fixable] == [
        15
    ]
    migrate_paths([tmp_path], fix=True)
    assert (tmp_path / "trainer.py").read_text() == fixed


def test_a_model_declared_fsdp1_by_a_class_field_annotation_is_fsdp1s_in_its_methods() -> None:
    # A dataclass declares its field as FSDP1's wrapper (``runner: FSDP``) and a method reads the wrapper's
    # data-parallel group from self.runner: FSDPModule has none (AttributeError after migration), so the read is
    # reported. The same name declared with another type in another class shows nothing.
    code = (
        "from dataclasses import dataclass\n\n"
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "@dataclass\n"
        "class Loop:\n"
        "    runner: FSDP\n"
        "    steps: int = 0\n\n"
        "    def group(self):\n"
        "        return self.runner.process_group\n\n\n"
        "@dataclass\n"
        "class Other:\n"
        "    runner: torch.nn.Module\n\n"
        "    def group(self):\n"
        "        return self.runner.process_group\n"
    )
    result = migrate_source(code, "loop.py")
    todos = [f for f in result.findings if not f.fixable and "process_group" in f.construct]
    assert [(f.line, f.construct) for f in todos] == [(13, "self.runner.process_group (an FSDP1 wrapper attribute)")]
    assert "FSDPModule has no process_group" in todos[0].replacement
    assert result.fixed.count("# TODO(fsdp-bridge): self.runner.process_group") == 1
    assert migrate_source(result.fixed, "loop.py").fixed == result.fixed


def test_fsdp1s_class_spelled_out_in_full_is_rewritten_in_the_first_check_of_a_file_too() -> None:
    # A file that imports no FSDP1 name and spells the class out (torch.distributed.fsdp.FullyShardedDataParallel)
    # was seen as FSDP1 code only from its first such name on: that first isinstance stayed a TODO calling the
    # tuple "kept for a later isinstance", while the same test further down was rewritten.
    code = (
        "import torch\n"
        "from torch import nn\n\n\n"
        "def all_wrapped(units):\n"
        "    return all(map(lambda u: isinstance(u, (torch.distributed.fsdp.FullyShardedDataParallel,\n"
        "                                            nn.parallel.DistributedDataParallel)), units))\n\n\n"
        "def one_wrapped(unit):\n"
        "    return isinstance(unit, (torch.distributed.fsdp.FullyShardedDataParallel, nn.parallel.DistributedDataParallel))\n"
    )
    result = migrate_source(code, "checks.py")
    rewritten = "(isinstance(u, nn.parallel.DistributedDataParallel) or fsdp_bridge.is_sharded(u))"
    assert rewritten in result.fixed
    assert "(isinstance(unit, nn.parallel.DistributedDataParallel) or fsdp_bridge.is_sharded(unit))" in result.fixed
    assert all(f.fixable for f in result.findings) and "TODO" not in result.fixed
    assert migrate_source(result.fixed, "checks.py").fixed == result.fixed


def test_a_wrapper_handed_to_a_function_that_takes_fsdp1s_only_stays_fsdp1s() -> None:
    # Transformer Engine's prepare_te_modules_for_fsdp asserts its argument is FSDP1's wrapper: that model
    # stays FSDP1's, with a TODO; a model of another function is rewritten as usual.
    code = (
        "import transformer_engine\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel\n\n\n"
        "def build(net, shard_activations):\n"
        "    wrapped = FullyShardedDataParallel(net)\n"
        "    if shard_activations:\n"
        "        transformer_engine.pytorch.distributed.prepare_te_modules_for_fsdp(wrapped)\n"
        "    return wrapped\n\n\n"
        "def other(net):\n"
        "    plain = FullyShardedDataParallel(net)\n"
        "    return plain\n"
    )
    result = migrate_source(code, "te_build.py")
    (kept,) = [f for f in result.findings if not f.fixable]
    assert kept.line == 6 and "prepare_te_modules_for_fsdp, which takes FSDP1's wrapper only" in kept.replacement
    assert "    wrapped = FullyShardedDataParallel(net)\n" in result.fixed
    assert "plain = fsdp_bridge.shard(net" in result.fixed
    assert migrate_source(result.fixed, "te_build.py").fixed == result.fixed


def test_a_bound_no_sync_is_rewritten_only_where_the_model_is_fsdp1s() -> None:
    result = _migrate("bound_no_sync.py")
    fixed = result.fixed
    # handed the model fit() wrapped: calling the value gives the bridge's context, as FSDP1's method did
    assert _line(fixed, "quiet =") == (
        "quiet = functools.partial(fsdp_bridge.no_sync, model) if (i + 1) % every else contextlib.nullcontext"
    )
    assert "import functools" in fixed
    # nothing shows what engine is: kept, a TODO that names the rewrite to write if it is the FSDP1 model
    assert _line(fixed, "engine.no_sync") == "return contextlib.nullcontext if last else engine.no_sync"
    (todo,) = [f for f in result.findings if not f.fixable]
    assert todo.construct == "engine.no_sync (not called here)"
    assert "functools.partial(fsdp_bridge.no_sync, engine)" in todo.replacement
    # DDP's own, told apart by the code: untouched, not reported
    assert _line(fixed, "return model.no_sync") == "return model.no_sync"
    assert not [f for f in result.findings if f.line == 32]
    # called later with the model as its argument: accelerate's no_sync(model), not FSDP1's; not reported
    assert _line(fixed, "accelerator.no_sync") == "hold = contextlib.nullcontext if last else accelerator.no_sync"
    assert not [f for f in result.findings if f.line == 37]


def test_accelerates_fsdp1_plugin_is_a_todo_and_its_values_are_notes() -> None:
    result = _migrate("accelerate_plugin.py")
    todos = [f for f in result.findings if not f.fixable]
    assert [f.construct for f in todos] == ["FullyShardedDataParallelPlugin(...) (accelerate's FSDP1 plugin)"]
    assert "FSDP_VERSION" in todos[0].replacement and "fsdp_version=2" in todos[0].replacement
    notes = {f.construct for f in result.findings if f.note}
    assert notes == {
        "transformer_auto_wrap_policy",
        "BackwardPrefetch.BACKWARD_PRE",
        "ShardingStrategy",
        "CPUOffload",
    }  # accelerate reads them, not the bridge
    assert all("accelerate's FullyShardedDataParallelPlugin" in f.replacement for f in result.findings if f.note)
    # wraps() only tests the class with isinstance: the bridge's class tests FSDP1 wrappers and FSDP2 modules
    assert _line(result.fixed, "if not wraps(") == "if not wraps(model, fsdp_bridge.ShardedModule):"
    assert "fsdp_version=2, reshard_after_forward=True" in result.fixed  # FSDP2's plugin: nothing to say
    # --target torch: accelerate may still hand over FSDP1's wrapper, so the run-time test stays the bridge's
    lowered = migrate_source((PRECISION / "accelerate_plugin.py").read_text(), "p.py", target="torch").fixed
    assert _line(lowered, "if not wraps(") == "if not wraps(model, fsdp_bridge.ShardedModule):"


def test_accelerates_plugin_built_from_a_kwargs_dict_without_a_version_is_a_todo() -> None:
    # fsdp_kwargs filled key by key, never with fsdp_version: accelerate's FSDP1 default (the notes on the policy
    # and CPUOffload point at this TODO); a dict that may carry fsdp_version says nothing
    code = (
        "import functools\n"
        "from accelerate.utils import FullyShardedDataParallelPlugin\n"
        "from torch.distributed.fsdp import CPUOffload\n"
        "from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy\n\n\n"
        "def plugin(n, offload):\n"
        "    fsdp_kwargs = {}\n"
        "    fsdp_kwargs['auto_wrap_policy'] = functools.partial(size_based_auto_wrap_policy, min_num_params=n)\n"
        "    if offload:\n"
        "        fsdp_kwargs['cpu_offload'] = CPUOffload(offload_params=True)\n"
        "    return FullyShardedDataParallelPlugin(**fsdp_kwargs)\n\n\n"
        "def versioned(v):\n"
        "    kw = {'fsdp_version': v}\n"
        "    return FullyShardedDataParallelPlugin(**kw)\n"
    )
    result = migrate_source(code, "p.py")
    todos = [f for f in result.findings if not f.fixable]
    assert [(f.line, f.construct) for f in todos] == [
        (12, "FullyShardedDataParallelPlugin(...) (accelerate's FSDP1 plugin)")
    ]
    assert "# TODO(fsdp-bridge)" in result.fixed


def test_a_model_from_a_function_returning_fsdp1s_wrapper_on_one_path() -> None:
    result = _migrate("factory_results.py")
    fixed = result.fixed
    # .module: the module inside FSDP1's wrapper, the module itself on FSDP2, DDP's (or DeepSpeed's) own otherwise;
    # written in an assignment's target too (x.module.head = ... reads x.module)
    inner = "(fsdp_bridge.unwrapped(model) if fsdp_bridge.is_sharded(model) else model.module)"
    assert _line(fixed, ".head = torch.compile(") == f"{inner}.head = torch.compile({inner}.head)"
    # forward(): FSDP2 gathers in the hooks a call runs; in the function it is handed to as well
    assert _line(fixed, "loss = ") == "loss = model(batch).mean()"
    assert _line(fixed, "return model(batch)") == "return model(batch)"
    assert (
        _line(fixed, "return model.forward(batch)")
        == "return model.forward(batch)  # nothing shows what this is: left alone"
    )
    # torch's clip over the model's parameters: a note (FSDP1 clipped each rank's shard by its own norm)
    notes = [f for f in result.findings if f.note]
    assert [f.construct for f in notes] == ["torch.nn.utils.clip_grad_norm_(model.parameters(), ...)"]


def test_a_multi_line_scaler_keeps_its_layout_and_a_root_check_is_a_todo() -> None:
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n\n\n"
        "def scaler(scale):\n"
        "    return ShardedGradScaler(\n"
        "        init_scale=scale,\n"
        "        growth_factor=2.0,  # doubles\n"
        "    )\n\n\n"
        "def clip(module, max_norm):\n"
        "    if isinstance(module, FSDP):\n"
        "        if not module.check_is_root():\n"
        "            raise ValueError('root only')\n"
        "        return module.clip_grad_norm_(max_norm)\n"
    )
    result = migrate_source(code, "scaler.py")  # was skipped: the rewrite wrote ",\n," and did not parse
    assert "    return fsdp_bridge.GradScaler(\n        init_scale=scale,\n        growth_factor=2.0,  # doubles\n" in (
        result.fixed
    )
    todos = [f for f in result.findings if not f.fixable]
    assert [f.construct for f in todos] == ["module.check_is_root (an FSDP1 wrapper attribute)"]
    assert migrate_source(result.fixed, "scaler.py").fixed == result.fixed


def test_a_model_fairseq2_wraps_keeps_the_bridges_type_test_under_target_torch() -> None:
    code = (
        "from fairseq2.nn.fsdp import to_fsdp\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def is_fsdp(model):\n"
        "    return isinstance(model, FSDP)\n"
    )
    lowered = migrate_source(code, "trainer.py", target="torch").fixed
    assert "return fsdp_bridge.is_sharded(model)" in lowered  # fairseq2's to_fsdp hands over FSDP1's wrapper


def test_a_rebinding_of_a_factory_made_model_to_its_module_is_rewritten_too() -> None:
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def wrap(m, on):\n"
        "    if on:\n"
        "        m = FSDP(m)\n"
        "    return m, on\n\n\n"
        "def run(m):\n"
        "    model, x = wrap(m, True)\n"
        "    model = model.module\n"
        "    return model\n"
    )
    fixed = migrate_source(code, "rebind.py").fixed  # model = model.module (the node's own assignment) counts
    assert "model = (fsdp_bridge.unwrapped(model) if fsdp_bridge.is_sharded(model) else model.module)" in fixed


def test_block_classes_computed_by_code_stay_in_their_variable() -> None:
    # layer_cls = get_cls(model): written again in the wrap, the call would run a second time (after the model
    # changed, or printing again); a set of class names written out is inlined
    code = (
        "from functools import partial\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy\n"
        "from model import Block, Wrapper, get_cls\n\n\n"
        "def build(model):\n"
        "    layer_cls = {type(model.layers[0])}\n"
        "    model = Wrapper(model)\n"
        "    policy = partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_cls)\n"
        "    return FSDP(model, auto_wrap_policy=policy)\n\n\n"
        "def build2(model):\n"
        "    found = get_cls(model)\n"
        "    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy(found))\n\n\n"
        "def build3(model):\n"
        "    blocks = {Block}\n"
        "    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy(blocks))\n"
    )
    fixed = migrate_source(code, "build.py").fixed
    assert "    layer_cls = {type(model.layers[0])}\n" in fixed and "wrap=list(layer_cls)" in fixed
    assert "    found = get_cls(model)\n" in fixed and "wrap=list(found)" in fixed
    assert "blocks = " not in fixed and "wrap=[Block]" in fixed
    assert migrate_source(fixed, "build.py").fixed == fixed


def test_a_model_another_file_wraps_on_an_instance_is_fsdp1s_in_the_classs_methods(tmp_path: Path) -> None:
    # A script builds a trainer, then swaps its model for FSDP1's wrapper (``trainer.model = FSDP(trainer.model)``);
    # the trainer's own methods save and load self.model. On FSDP2 those state dicts would be one rank's shards (a
    # silent partial checkpoint), so they are FSDP1's full state dicts here, as for a model wrapped in the class
    # itself. A method that assigns self.model a plain module above its load reads the plain one; another class
    # with an attribute of the same name shows nothing.
    (tmp_path / "trainer.py").write_text(
        "import torch\n\n\n"
        "class trainer_cls:\n"
        "    def __init__(self, net):\n"
        "        self.model = net\n\n"
        "    def save(self, path):\n"
        "        torch.save({'model': self.model.state_dict()}, path)\n\n"
        "    def clip(self):\n"
        "        return self.model.clip_grad_norm_(1.0)\n\n"
        "    def rebuild(self, net, path):\n"
        "        self.model = net\n"
        "        self.model.load_state_dict(torch.load(path)['model'])\n\n\n"
        "class Other:\n"
        "    def save(self, path):\n"
        "        torch.save(self.model.state_dict(), path)\n"
    )
    (tmp_path / "train.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n"
        "from trainer import trainer_cls\n\n\n"
        "def main(net):\n"
        "    run = trainer_cls(net)\n"
        "    run.model = FSDP(run.model, use_orig_params=True)\n"
        "    run.save('ckpt.pt')\n"
    )
    report, _ = migrate_paths([tmp_path], fix=True)
    fixed = (tmp_path / "trainer.py").read_text()
    assert (
        "torch.save({'model': get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))}"
        in fixed
    )
    assert "        return fsdp_bridge.clip_grad_norm_(self.model, 1.0)\n" in fixed
    assert "        self.model.load_state_dict(torch.load(path)['model'])\n" in fixed  # the plain module assigned above
    assert "        torch.save(self.model.state_dict(), path)\n" in fixed  # Other's
    assert sorted(f.line for f in report.findings if f.path.endswith("trainer.py")) == [9, 12]
    migrate_paths([tmp_path], fix=True)
    assert (tmp_path / "trainer.py").read_text() == fixed


def test_a_root_over_units_a_call_wraps_with_fsdp1s_class_stays_fsdp1s() -> None:
    # A parallelism library wraps its blocks by handing FSDP1's class to torch's private _recursive_wrap (left as
    # it is), then wraps the root with FSDP(...) in another function. fsdp_bridge.shard refuses a model holding
    # FSDP1 units, so the root's rewrite raised ConfigError at start-up: it stays FSDP1's, with a TODO saying why.
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.distributed.fsdp.wrap import _recursive_wrap\n\n\n"
        "def apply_units(model, policy, args):\n"
        "    _recursive_wrap(model, policy, wrapper_cls=FSDP, ignored_modules=set(), ignored_params=set(), **args)\n"
        "    return model\n\n\n"
        "def root(model, args):\n"
        "    return FSDP(model, **args)\n"
    )
    result = migrate_source(code, "parallel.py")
    todos = {(f.line, f.construct): f.replacement for f in result.findings if not f.fixable}
    assert todos[(6, "FSDP (FSDP1's class handed to _recursive_wrap(...))")].startswith(
        "not rewritten: _recursive_wrap wraps modules with FSDP1's class"
    )
    assert "hands FSDP1's class to _recursive_wrap(...), which wraps" in todos[(11, "FSDP(...)")]
    assert migrate_source(result.fixed, "parallel.py").fixed == result.fixed  # no line number in the TODO
    assert "    return FSDP(model, **args)\n" in result.fixed and "import fsdp_bridge" not in result.fixed


def test_a_wrapper_made_inside_another_call_is_not_fsdp1s_class_handed_on() -> None:
    # Holder(FSDP(model, ...), ...) hands on the model FSDP1 made, not FSDP1's class: each call is rewritten, where
    # the scan for a class given to a wrap helper of the tree's own took the call for the class and left both TODOs.
    code = (
        "import functools\n"
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision\n"
        "from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy\n"
        "from blocks import Block, build, Holder\n\n\n"
        "def setup(device):\n"
        "    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})\n"
        "    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)\n"
        "    ref = Holder(FSDP(build(),\n"
        "                      auto_wrap_policy=policy,\n"
        "                      mixed_precision=bf16,\n"
        "                      use_orig_params=True,\n"
        "                      device_id=device), False)\n"
        "    return ref, Holder(FSDP(build(), auto_wrap_policy=policy, device_id=device), True)\n"
    )
    result = migrate_source(code, "train.py")
    assert [f for f in result.findings if not f.fixable] == []
    assert result.fixed.count("Holder(fsdp_bridge.shard(\n        build(),\n") == 2
    # the policy and the MixedPrecision both calls were given are written out into each and go, with the imports
    assert "policy =" not in result.fixed and "bf16 =" not in result.fixed
    assert "torch.distributed.fsdp" not in result.fixed and "functools" not in result.fixed
    assert result.fixed.count("wrap=[Block],") == 2 and result.fixed.count('"param_dtype": torch.bfloat16,') == 1
    compile(result.fixed, "train.py", "exec")
    assert migrate_source(result.fixed, "train.py").fixed == result.fixed
    # a use left elsewhere keeps the variable (and its import) where it is
    logged = migrate_source(code + "    print(bf16)\n", "train.py").fixed
    assert "    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)\n" in logged
    assert "from torch.distributed.fsdp import MixedPrecision\n" in logged and "policy =" not in logged


def test_an_fsdp1_test_imported_from_another_file_guards_module_reads(tmp_path: Path) -> None:
    # utils/fsdp.py defines is_fsdp_wrapped(m) (isinstance(m, FSDP)); a weight syncer in another file imports it
    # inside a method and reads model.module under it. The file named nothing of FSDP1's, so the read was not
    # reported, and after --fix (the test becomes fsdp_bridge.is_sharded) every sync raised AttributeError.
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "fsdp.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def wrap(model):\n    return FSDP(model)\n\n\n"
        "def is_fsdp_wrapped(model):\n    return isinstance(model, FSDP)\n"
    )
    (tmp_path / "syncer.py").write_text(
        "class Syncer:\n"
        "    def push(self, model):\n"
        "        from utils.fsdp import is_fsdp_wrapped\n\n"
        "        unwrapped = model\n"
        "        if is_fsdp_wrapped(model):\n"
        "            unwrapped = model.module\n"
        "        return unwrapped.config\n"
    )
    migrate_paths([tmp_path], fix=True)
    fixed = (tmp_path / "syncer.py").read_text()
    assert "            unwrapped = fsdp_bridge.unwrapped(model)\n" in fixed and fixed.startswith(
        "import fsdp_bridge\n"
    )
    migrate_paths([tmp_path], fix=True)
    assert (tmp_path / "syncer.py").read_text() == fixed


def test_a_scripts_load_above_its_wrap_at_module_level_is_the_plain_modules() -> None:
    # A script's `if __name__ == "__main__":` block loads a checkpoint into the plain generator, then wraps it: the
    # load is nn.Module's (left as it is); the save below the wrap is FSDP1's full state dict.
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n"
        "if __name__ == '__main__':\n"
        "    generator = torch.nn.Linear(2, 2)\n"
        "    generator.load_state_dict(torch.load('g.pt'))\n"
        "    generator = FSDP(generator)\n"
        "    torch.save(generator.state_dict(), 'y.pt')\n"
    )
    result = migrate_source(code, "train.py")
    assert "    generator.load_state_dict(torch.load('g.pt'))\n" in result.fixed
    assert [f.line for f in result.findings if "state_dict" in f.construct] == [8]


def test_a_nested_function_reads_its_enclosing_functions_fsdp1_model() -> None:
    # A training step defined inside main reads main's `ar = FSDP(...)`: its `ar.module` was not reported (the step
    # raised AttributeError on FSDP2 after --fix); a nested function binding a name of its own shows nothing.
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def main(model, batches):\n"
        "    ar = FSDP(model)\n\n"
        "    def train_step(x):\n"
        "        inner = ar.module\n"
        "        ar(x).sum().backward()\n"
        "        return inner\n\n"
        "    def other(ar):\n"
        "        return ar.module\n\n"
        "    for x in batches:\n"
        "        train_step(x)\n"
    )
    result = migrate_source(code, "train.py")
    assert "        inner = fsdp_bridge.unwrapped(ar)\n" in result.fixed
    assert "        return ar.module\n" in result.fixed


def test_a_model_made_by_either_of_two_local_makers_and_modules_under_a_hasattr_guard() -> None:
    # model = wrap_fsdp(...) if fsdp else wrap_ddp(...): FSDP1's on one path, so its clip_grad_norm_ (FSDP1's
    # method, under the FSDP branch) becomes the bridge's, which takes any module; `model.module if
    # hasattr(model, "module") else model` already works on FSDP2 (no .module there) and on DDP: kept
    code = textwrap.dedent(
        """
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.nn.parallel import DistributedDataParallel as DDP


        def wrap_fsdp(net):
            return FSDP(net)


        def wrap_ddp(net):
            return DDP(net)


        def train(net, fsdp, batch):
            model = wrap_fsdp(net) if fsdp else wrap_ddp(net)
            model(batch).sum().backward()
            if fsdp:
                model.clip_grad_norm_(1.0)
            core = model.module if hasattr(model, "module") else model
            if hasattr(model, "module"):
                core = model.module
            return core
        """
    )
    for target in ("bridge", "torch"):
        result = migrate_source(code, "train.py", target=target)
        assert "        model.clip_grad_norm_(1.0)" not in result.fixed
        assert 'core = model.module if hasattr(model, "module") else model\n' in result.fixed
        assert "        core = model.module\n" in result.fixed
        kept = [f for f in result.findings if f.construct == "model.module (the wrapped module)"]
        assert len(kept) == 2 and all(f.fixable and "kept as is" in f.replacement for f in kept)
    assert "fsdp_bridge.clip_grad_norm_(model, 1.0)" in migrate_source(code, "train.py").fixed


def test_a_test_that_fsdp1s_guarded_import_worked_is_kept() -> None:
    # try: from torch.distributed.fsdp import FullyShardedDataParallel as FSDP / except ImportError: FSDP = None,
    # then `FSDP is not None and isinstance(m, FSDP)`: the None test stays (no TODO), the isinstance is rewritten
    code = textwrap.dedent(
        """
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        except ImportError:
            FSDP = None


        def sharded(m):
            return FSDP is not None and isinstance(m, FSDP)
        """
    )
    result = migrate_source(code, "guard.py")
    assert "return FSDP is not None and fsdp_bridge.is_sharded(m)" in result.fixed
    assert "TODO" not in result.fixed
    (kept,) = [f for f in result.findings if f.construct == "FSDP is (not) None"]
    assert kept.fixable


def test_no_sync_in_the_branch_beside_a_ddp_test_is_reported() -> None:
    # `if fsdp and offload: m.no_sync() elif isinstance(m, DDP): m.no_sync()`: the DDP test elsewhere in the
    # function once made every `m.no_sync()` there DDP's, so the first branch (FSDP1's) went unreported and
    # raised AttributeError on FSDP2; it is a TODO now, and the DDP branch stays as it is.
    code = (
        "import contextlib\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "class Trainer:\n"
        "    def step(self, fsdp, offload):\n"
        "        if fsdp and offload:\n"
        "            ctx = self.policy.base_model.no_sync()\n"
        "        elif isinstance(self.policy.base_model, DDP):\n"
        "            ctx = self.policy.base_model.no_sync()\n"
        "        else:\n"
        "            ctx = contextlib.nullcontext()\n"
        "        return ctx\n\n"
        "    def build(self, m):\n"
        "        return FSDP(m)\n"
    )
    result = migrate_source(code, "rl.py")
    (todo,) = [f for f in result.findings if not f.fixable]
    assert todo.line == 9 and todo.construct == "self.policy.base_model.no_sync()", todo
    assert "            ctx = self.policy.base_model.no_sync()\n        else:" in result.fixed
    # a negated DDP test decides nothing here: its else branch is DDP's own no_sync (left as it is, no TODO)
    negated = code.replace(
        "        if fsdp and offload:\n            ctx = self.policy.base_model.no_sync()\n"
        "        elif isinstance(self.policy.base_model, DDP):\n",
        "        if not isinstance(self.policy.base_model, DDP):\n            ctx = None\n        elif fsdp:\n",
    )
    assert not [f for f in migrate_source(negated, "rl.py").findings if not f.fixable]


def test_summon_under_a_test_admitting_both_backends_keeps_fsdp2_modules_ungathered() -> None:
    """FSDP1's static ``summon_full_params`` gathers nothing for torch's own fully_shard modules. Under a test
    that holds for them too, the bridge's (which gathers them) would change what the block costs or sees."""
    result = _migrate("summon_both.py")
    fixed = result.fixed
    by_line = {f.line: f for f in result.findings}
    # The block reads DTensors itself: the context goes, its body stays one level out.
    assert "        if wrapper_generation(block) > 0:\n            for key, value in block.state_dict()" in fixed
    assert "the context goes, its block stays: `wrapper_generation(block) > 0`" in by_line[22].replacement
    assert by_line[22].fixable and "full_tensor()" in by_line[22].replacement
    # The block reads plain tensors (norms): a TODO, FSDP1's call kept.
    assert not by_line[33].fixable and "isinstance(model, (FSDP, FSDPModule))" in by_line[33].replacement
    assert _line(fixed, "summon_full_params(model):") == "with FSDP.summon_full_params(model):"
    # Another item in the same `with`: a TODO (the block cannot go while the other item stays).
    assert not by_line[40].fixable and "wrapper_generation(model) != 0" in by_line[40].replacement
    # A test for FSDP1 alone: its branch is FSDP1's path, kept as is.
    assert by_line[47].replacement.startswith("kept as is")
    code = [line for line in fixed.splitlines() if not line.lstrip().startswith("#")]
    assert not any("fsdp_bridge.summon_full_params" in line for line in code)

    # --target torch: the same, and a second --fix changes nothing (its guard reads isinstance(m, FSDPModule)).
    source = (PRECISION / "summon_both.py").read_text()
    plain = migrate_source(source, "summon_both.py", target="torch").fixed
    assert migrate_source(plain, "summon_both.py", target="torch").fixed == plain
    assert "        if wrapper_generation(block) > 0:\n            for key, value in block.state_dict()" in plain
    assert "summon_full_params(model, writeback=True)" not in plain
    assert "    if (isinstance(model, FSDPModule)):\n" in plain  # not the same test twice

    # Run the rewritten helper on a torch fully_shard-like module: the block runs ungathered, as before.
    import torch
    from torch import nn
    from torch.distributed.fsdp import FSDPModule

    namespace: dict[str, object] = {}
    exec(compile(fixed, "summon_both.py", "exec"), namespace)
    inner = nn.Linear(2, 2)
    inner.__class__ = type("TorchSharded", (FSDPModule, nn.Linear), {})
    inner.register_buffer("adapter_scale", torch.ones(2))
    model = nn.Sequential(inner)
    weights = namespace["adapter_weights"](model)  # type: ignore[operator]
    assert list(weights) == ["0.adapter_scale"]


def test_fsdp1_members_without_a_rewrite_are_todos_not_passed_over() -> None:
    """A member of FSDP1's class that the migration does not rewrite (``FSDP.flatten_sharded_optim_state_dict``,
    any other) and FSDP1's execution-order record are listed with a TODO: they were passed over silently."""
    source = textwrap.dedent("""\
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        def resume(model, optim, sharded):
            model = FSDP(model)
            flat = FSDP.flatten_sharded_optim_state_dict(sharded, model, optim)
            optim.load_state_dict(flat)
            FSDP.register_comm_hook(model, None, print)
            order = model._exec_order_data
            return FSDP.__name__, order
        """)
    result = migrate_source(source, "resume.py")
    todos = {f.construct: f.replacement for f in result.findings if not f.fixable}
    assert "set_optimizer_state_dict(model, optimizer, sd)" in todos["FSDP.flatten_sharded_optim_state_dict"]
    assert todos["FSDP.register_comm_hook"].startswith("not rewritten: FullyShardedDataParallel.register_comm_hook")
    assert "set_modules_to_forward_prefetch" in todos["model._exec_order_data (an FSDP1 internal)"]
    assert not any("__name__" in c for c in todos)


def test_fsdp1_static_methods_imported_from_the_package_are_said_to_fail() -> None:
    """``from torch.distributed.fsdp import state_dict_type`` raises ImportError (FSDP1's is a static method of the
    wrapper): a TODO at the import, and the state dicts in its block are not said to be rewritten."""
    source = textwrap.dedent("""\
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType, state_dict_type

        def save(model):
            model = FSDP(model)
            with state_dict_type(model, StateDictType.FULL_STATE_DICT):
                return model.state_dict()

        def save_right(model):
            model = FSDP(model)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                return model.state_dict()
        """)
    result = migrate_source(source, "save.py")
    todos = {f.line: f.replacement for f in result.findings if not f.fixable}
    assert todos[2].startswith("not rewritten: torch.distributed.fsdp has no state_dict_type (the import raises")
    assert todos[7].startswith("not rewritten: it runs inside `with state_dict_type(model,")
    assert 12 not in todos and "get_model_state_dict(model" in result.fixed  # FSDP1's own context: rewritten


def test_an_optimizer_moved_after_the_wrap_takes_its_scheduler_along() -> None:
    # a scheduler built on the optimizer between it and the wrap moves with it (left behind it would name an
    # optimizer not built yet); a use that cannot move (a call, or a name the wrap reads) keeps both with a TODO
    source = textwrap.dedent("""\
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        def main(model, n):
            optimizer = torch.optim.AdamW(model.parameters(), fused=True)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0)
            out = n * 2
            model = FSDP(model, use_orig_params=True)
            return model, optimizer, scheduler, out

        def logged(model):
            optimizer = torch.optim.AdamW(model.parameters())
            print(optimizer)
            model = FSDP(model)
            return model, optimizer

        def averaged(model, EMA):
            optimizer = torch.optim.AdamW(model.parameters())
            ema = EMA(model, optimizer)
            model = FSDP(model)
            return model, optimizer, ema
        """)
    for target in ("bridge", "torch"):
        result = migrate_source(source, "train.py", target=target)
        body = result.fixed.split("def main")[1].split("def logged")[0].splitlines()
        assert [line.strip().split(" =")[0] for line in body[1:3]] == ["out", "model"]
        assert body[-4].strip().startswith("optimizer = torch.optim.AdamW(model.parameters(), fused=True)")
        assert body[-3].strip().startswith("scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer")
        moved = next(f for f in result.findings if f.line == 5)
        assert moved.fixable and "(with what uses it there: torch.optim.lr_scheduler.LambdaLR" in moved.replacement
        kept = next(f for f in result.findings if f.line == 12)
        assert not kept.fixable and "cannot move with it" in kept.replacement
        assert "    # TODO(fsdp-bridge): torch.optim.AdamW(...) before FSDP(...)" in result.fixed
        # a use that names the model would take the wrapped one after the move: both stay, with the TODO
        averaged = next(f for f in result.findings if f.line == 18)
        assert not averaged.fixable and "cannot move with it" in averaged.replacement
        assert migrate_source(result.fixed, "train.py", target=target).fixed == result.fixed


def test_an_optimizer_the_model_builds_before_its_wrap_is_a_todo() -> None:
    """nanoGPT's ``optimizer = model.configure_optimizers(...)`` above ``if use_fsdp: model = FSDP(model)``: the
    optimizer holds the parameters the wrap replaces. A TODO (the tree's own method is not moved)."""
    source = textwrap.dedent("""\
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        def train(model, use_fsdp, build_optimizer):
            optimizer = model.configure_optimizers(0.1, 1e-3)
            other_optimizer = build_optimizer(model)
            scheduler = model.make_scheduler()
            if use_fsdp:
                model = FSDP(model)
            return model, optimizer, other_optimizer, scheduler
        """)
    result = migrate_source(source, "train.py")
    todos = {f.line: f.replacement for f in result.findings if not f.fixable}
    assert set(todos) == {4, 5}
    assert todos[4].startswith("this optimizer is built from model's parameters before the wrap `model = FSDP(model")
    assert "model.configure_optimizers(0.1, 1e-3)" in result.fixed  # left where it is


def test_state_dict_hooks_and_parameter_data_swaps_are_todos(tmp_path: Path) -> None:
    """A file registering a state-dict hook (merged LoRA keys that are no attributes, which torch's
    get_model_state_dict refuses) keeps model.state_dict() with a TODO; a function of the tree assigning
    each parameter's ``.data`` (a hand-made fp32 master copy) handed FSDP1's parameters is a TODO at the call."""
    (tmp_path / "precision.py").write_text(
        textwrap.dedent("""\
            import torch

            def upcast(params, dtype):
                with torch.no_grad():
                    for p in params:
                        p._low = p.data
                        p.data = p._master
            """)
    )
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""\
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from precision import upcast

            def merged(module, state, prefix, local_metadata):
                state[prefix + "weight"] = state.pop(prefix + "lora")
                return state

            def step(model, optimizer):
                model = FSDP(model)
                upcast(model.parameters(), None)
                optimizer.step()
                model.inner._register_state_dict_hook(merged)
                return model.state_dict()
            """)
    )
    report, _ = migrate_paths([tmp_path], fix=False)
    todos = {f.line: f.replacement for f in report.findings if not f.fixable}
    assert todos[10].startswith("not rewritten: upcast assigns each parameter's .data")
    assert todos[13].startswith("not rewritten: this file registers a state-dict hook (_register_state_dict_hook)")


def test_wrapped_module_loads_and_the_trees_own_internal_names(tmp_path: Path) -> None:
    """``model.module.load_state_dict(sd)`` on FSDP1's wrapper loaded this rank's flat shard (FSDP1's layout): a
    TODO, not ``fsdp_bridge.unwrapped(model).load_state_dict``. A name of FSDP1's internals that a class of the
    tree assigns itself (``self.flat_param = torch.cat(...)``) is the tree's attribute: no TODO where it is read."""
    (tmp_path / "flat.py").write_text(
        textwrap.dedent("""\
            import torch

            class Packed(torch.nn.Module):
                def __init__(self, params):
                    super().__init__()
                    self.flat_param = torch.cat([p.reshape(-1) for p in params])
            """)
    )
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""\
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            def resume(model, path, packed):
                model = FSDP(model)
                model.module.load_state_dict(torch.load(path))
                return packed.flat_param.numel()
            """)
    )
    report, _ = migrate_paths([tmp_path], fix=False)
    todos = {f.line: f for f in report.findings if not f.fixable}
    assert set(todos) == {6}
    assert todos[6].construct == "model.module.load_state_dict() (the wrapped module's own state dict)"
    assert "set_model_state_dict(model, sd" in todos[6].replacement


def test_an_unwrap_lowered_by_the_torch_target_is_left_on_a_second_fix() -> None:
    source = textwrap.dedent("""\
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        def build(model) -> FSDP:
            return FSDP(model, use_orig_params=True)

        def unwrap(module: torch.nn.Module) -> torch.nn.Module:
            if hasattr(module, "_fsdp_wrapped_module"):
                return module._fsdp_wrapped_module
            if hasattr(module, "module"):
                return module.module
            return module
        """)
    once = migrate_source(source, "unwrap.py", target="torch").fixed
    assert migrate_source(once, "unwrap.py", target="torch").fixed == once


def test_the_wrappers_module_internals_are_reported() -> None:
    source = textwrap.dedent("""\
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.fully_sharded_data_parallel import TrainingState, _get_grad_norm

        def clip(model):
            model = FSDP(model)
            model._assert_state(TrainingState.IDLE)
            handles = model._all_handles
            return _get_grad_norm(model.parameters(), 2.0), handles
        """)
    todos = {f.construct for f in migrate_source(source, "clip.py").findings if not f.fixable}
    assert "model._assert_state (an FSDP1 internal)" in todos
    assert "model._all_handles (an FSDP1 internal)" in todos
    assert any(c.startswith("TrainingState (") for c in todos)
    assert any(c.startswith("_get_grad_norm (") for c in todos)


def test_apex_kernels_in_a_tree_wrapping_fsdp1_are_todos(tmp_path: Path) -> None:
    (tmp_path / "fused.py").write_text(
        textwrap.dedent("""\
            import torch
            from apex.multi_tensor_apply import multi_tensor_applier

            class MyFusedAdam(torch.optim.Optimizer):
                def step(self, closure=None):
                    multi_tensor_applier(self.kernel, self.overflow, [[], []], 1e-3)
            """)
    )
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""\
            from apex.optimizers import FusedAdam
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            def build(model):
                model = FSDP(model)
                return FusedAdam(model.parameters(), lr=1e-4)
            """)
    )
    report, _ = migrate_paths([tmp_path], fix=False)
    todos = {(Path(f.path).name, f.line): f.replacement for f in report.findings if not f.fixable}
    assert todos[("fused.py", 6)].startswith("not rewritten: apex's multi-tensor kernels")
    assert "torch.optim.AdamW(..., fused=True)" in todos[("train.py", 6)]


def test_parameters_of_models_on_different_meshes_paired_are_todos(tmp_path: Path) -> None:
    """A function of the tree zipping two models' parameters (an EMA update), handed a hybrid-sharded model and
    an EMA copy this file wraps over one group of its mesh: FSDP1's flat shards lined up; FSDP2's DTensors sit on
    a 2-D and a 1-D mesh and mixing them raises, so the call is a TODO. Two models wrapped alike stay quiet."""
    (tmp_path / "averaging.py").write_text(
        textwrap.dedent("""\
            import torch

            class Averager:
                def blend(self, live, shadow, decay=0.99):
                    for s, p in zip(shadow.parameters(), live.parameters()):
                        s.mul_(decay).add_(p.detach(), alpha=1 - decay)

                def load(self, source, target):
                    for t, s in zip(target.parameters(), source.parameters()):
                        t.data.copy_(s.data)
            """)
    )
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""\
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
            from averaging import Averager

            class Runner:
                def build(self, net, shadow, mesh, kind):
                    self.shadow = FSDP(shadow, process_group=mesh.get_group(mesh_dim=1))
                    self.net = FSDP(net, sharding_strategy=kind, process_group=(mesh.get_group(1), mesh.get_group(0)))
                    self.twin = FSDP(shadow, process_group=mesh.get_group(mesh_dim=1))
                    self.avg = Averager()

                def after_step(self):
                    self.avg.blend(self.net, self.shadow)
                    self.avg.load(target=self.net, source=self.shadow)
                    self.avg.blend(self.twin, self.shadow)
            """)
    )
    report, _ = migrate_paths([tmp_path], fix=False)
    todos = {f.line: f for f in report.findings if not f.fixable}
    assert set(todos) == {12, 13}
    text = todos[12].replacement
    assert text.startswith("not rewritten: blend pairs the parameters of self.net and self.shadow")
    assert "self.shadow: 1-D over process_group=mesh.get_group(mesh_dim=1)" in text
    assert "p.to_local()" in text
    assert todos[13].construct.startswith("self.avg.load(")


def test_sums_of_parameter_reductions_are_todos(tmp_path: Path) -> None:
    """``total += torch.norm(p.data)`` over an FSDP1 model's parameters added up this rank's flat shards; on FSDP2
    the reduction of a DTensor is a DTensor, and adding it into a plain tensor raises: a TODO. A sum reading
    ``to_local()`` already, or one over another model's parameters, stays quiet."""
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""\
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            def metrics(net, plain):
                net = FSDP(net)
                total = torch.tensor(0.0)
                for p in net.parameters():
                    total += torch.norm(p.data.float(), p=2)
                for name, p in net.named_parameters():
                    total += p.grad.pow(2).sum()
                for p in net.parameters():
                    total += p.to_local().norm()
                for p in plain.parameters():
                    total += p.norm()
                for name, p in net.module.blocks.named_parameters():
                    total += torch.sum(p ** 2) * 0.1
                return total
            """)
    )
    report, _ = migrate_paths([tmp_path], fix=False)
    todos = {f.line: f for f in report.findings if not f.fixable}
    assert set(todos) == {8, 10, 16}
    assert todos[8].construct == "+= torch.norm(p.data.float(), p=2) over FSDP1 parameters"
    assert "p.to_local()" in todos[8].replacement


def test_a_weight_decay_split_by_shape_over_fsdp1_parameters_is_a_todo(tmp_path: Path) -> None:
    """``if p.ndim <= 1: no_decay.append(p) else: decay.append(p)`` over an FSDP1 model's parameters (1-D flat
    shards or views: FSDP1 decayed nothing) splits them as written on FSDP2: a TODO, not only a note."""
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""\
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            def build(net):
                net = FSDP(net, use_orig_params=True)
                decay, no_decay = [], []
                for name, p in net.named_parameters():
                    if p.ndim <= 1 or name.endswith(".bias"):
                        no_decay.append(p)
                    else:
                        decay.append(p)
                sizes = [p.numel() for p in net.parameters()]
                return torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]), sizes
            """)
    )
    report, _ = migrate_paths([tmp_path], fix=False)
    todos = {f.line: f for f in report.findings if not f.fixable}
    assert set(todos) == {7}
    assert todos[7].construct == "net.named_parameters() split into groups by p.ndim"
    assert [f.line for f in report.findings if f.note] == [12]


def test_state_dict_of_a_module_unwrapped_under_hasattr_is_a_todo(tmp_path: Path) -> None:
    """``raw = model.module if hasattr(model, "module") else model`` then ``raw.state_dict()`` in a helper handed
    FSDP1's model: FSDP1's wrapped module held this rank's flat shard, FSDP2's model gives DTensor shards; neither
    is the full state dict the helper means to save: a TODO, not "kept as is"."""
    (tmp_path / "ckpt.py").write_text(
        textwrap.dedent("""\
            import torch

            def save(model, path):
                raw = model.module if hasattr(model, "module") else model
                torch.save({"model": raw.state_dict()}, path)

            def name_of(model):
                inner = model.module if hasattr(model, "module") else model
                return type(inner).__name__
            """)
    )
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""\
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from ckpt import name_of, save

            def main(net):
                model = FSDP(net)
                save(model, "out.pt")
                return name_of(model)
            """)
    )
    report, _ = migrate_paths([tmp_path], fix=False)
    found: dict[int, list] = {}
    for f in report.findings:
        if f.path.endswith("ckpt.py"):
            found.setdefault(f.line, []).append(f)
    ((kept,), (todo,)) = found[4], found[5]
    assert not todo.fixable and todo.construct.startswith("raw.state_dict() after raw = model.module if hasattr")
    assert "get_model_state_dict(model" in todo.replacement
    assert kept.fixable and kept.replacement.startswith("kept as is")
    fixed = migrate_paths([tmp_path], fix=True)[1]
    text = next(r.fixed for r in fixed if r.path.endswith("ckpt.py"))
    assert (
        '    # TODO(fsdp-bridge): raw.state_dict() after raw = model.module if hasattr(model, "module") else model'
        in text
    )
    assert text.index("TODO(fsdp-bridge): raw.state_dict()") > text.index("    raw = model.module")
    ((other,),) = [found[8]]
    assert other.fixable and other.replacement.startswith("kept as is")


def test_state_dict_of_a_module_unwrapped_on_the_fsdp_flag_is_a_todo_beside_the_unwrap(tmp_path: Path) -> None:
    """``raw = model.module if distributed else model`` in a script whose distributed path is FSDP1 (DDP only
    imported, its call commented out): the unwrap becomes fsdp_bridge.unwrapped(model) (the line runs on FSDP2),
    and ``raw.state_dict()`` gets a TODO (FSDP1's flat shard then, DTensor shards now)."""
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            model = torch.nn.Linear(2, 2)
            distributed = True
            if distributed:
                # model = DDP(model)
                model = FSDP(model)
            raw = model.module if distributed else model
            torch.save(raw.state_dict(), "ckpt.pt")
            """)
    )
    report, _ = migrate_paths([tmp_path], fix=True)
    fixed = (tmp_path / "train.py").read_text()
    assert "raw = fsdp_bridge.unwrapped(model) if distributed else model\n" in fixed
    todos = [f for f in report.findings if not f.fixable]
    assert [(f.line, f.construct.split(" after")[0]) for f in todos] == [(11, "raw.state_dict()")]
    assert fixed.index("# TODO(fsdp-bridge): raw.state_dict()") > fixed.index("raw = fsdp_bridge.unwrapped(model)")
    # the branches the other way round: the same TODO, the conditional named as written
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""\
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            def save(model: FSDP, plain: bool) -> None:
                raw = model if plain else model.module
                torch.save(raw.state_dict(), "ckpt.pt")
            """)
    )
    report, _ = migrate_paths([tmp_path], fix=False)
    todos = [f for f in report.findings if not f.fixable]
    assert [(f.line, f.construct) for f in todos] == [
        (6, "raw.state_dict() after raw = model if plain else model.module")
    ]
    # used only where the same flag picks the model itself (the else of ``if distributed:``, the body of ``if not
    # distributed:``): no wrapper there, nothing to say; a flag set again after the unwrap keeps the TODO
    script = """\
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = torch.nn.Linear(2, 2)
        distributed = True
        if distributed:
            model = FSDP(model)
        raw = model.module if distributed else model
        if distributed:
            pass
        else:
            torch.save(raw.state_dict(), "ckpt.pt")
        if not distributed:
            torch.save(raw.state_dict(), "ckpt.pt")
        """
    (tmp_path / "train.py").write_text(textwrap.dedent(script))
    report, _ = migrate_paths([tmp_path], fix=False)
    assert [f.line for f in report.findings if not f.fixable] == []
    (tmp_path / "train.py").write_text(
        textwrap.dedent(script).replace("if not distributed:", "distributed = False\nif not distributed:")
    )
    report, _ = migrate_paths([tmp_path], fix=False)
    assert [f.line for f in report.findings if not f.fixable] == [12]


def test_names_kept_from_a_compiled_model_a_factory_wraps_are_a_todo(tmp_path: Path) -> None:
    """``model = torch.compile(model)``, names taken from its named_parameters() (with '_orig_mod.'), then a
    function of the tree wraps it with FSDP1 and another file takes full state dicts: FSDP1's keys kept the prefix,
    the migrated state dicts' keys lack it, so the names no longer match: a TODO at the compile. Without names
    kept, the note reaches the compile through the factory too."""
    (tmp_path / "wrapping.py").write_text(
        textwrap.dedent("""\
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            def make_fsdp(args, model):
                return FSDP(model, use_orig_params=False)
            """)
    )
    (tmp_path / "ckpt.py").write_text(
        textwrap.dedent("""\
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

            def trainable(model, names):
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                    sd = model.state_dict()
                return {k: sd[k] for k in names}
            """)
    )
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""\
            import torch
            from ckpt import trainable
            from wrapping import make_fsdp

            def main(args, model, other):
                model = torch.compile(model)
                names = [n for n, p in model.named_parameters() if p.requires_grad]
                model = make_fsdp(args, model)
                other = torch.compile(other)
                other = make_fsdp(args, other)
                return trainable(model, names), other
            """)
    )
    report, _ = migrate_paths([tmp_path], fix=False)
    found = {f.line: f for f in report.findings if f.path.endswith("train.py")}
    assert not found[6].fixable
    assert "named_parameters() names are kept (line 7 before --fix)" in found[6].construct
    assert "take them from model before it is compiled" in found[6].replacement
    assert found[9].note and found[9].construct == "torch.compile(other) of a model FSDP1 wraps"


def test_fsdp1_imports_a_file_never_uses_are_removed_and_reported(tmp_path: Path) -> None:
    """A file importing FSDP1's names it never uses (all that ties it to FSDP1's module, which torch is removing):
    each import reported and dropped by --fix. Feature probes under try / if, names listed in ``__all__``, names
    another file takes from here and a package's ``__init__`` keep theirs."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from torch.distributed.fsdp import MixedPrecision\n")
    (tmp_path / "helpers.py").write_text(
        textwrap.dedent("""\
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, fully_shard
            from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
            from torch.distributed.fsdp import StateDictType

            try:
                from torch.distributed.fsdp import ShardingStrategy
                HAS_FSDP = True
            except ImportError:
                HAS_FSDP = False

            __all__ = ["StateDictType", "double"]

            def double(x):
                return 2 * x
            """)
    )
    (tmp_path / "user.py").write_text("from helpers import MixedPrecision\n\nprint(MixedPrecision)\n")
    report, _ = migrate_paths([tmp_path], fix=True)
    fixed = (tmp_path / "helpers.py").read_text()
    removed = sorted(f.construct for f in report.findings if f.path.endswith("helpers.py"))
    assert removed == [
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP (never used here)",
        "from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy (never used here)",
    ]
    assert "from torch.distributed.fsdp import MixedPrecision, fully_shard\n" in fixed
    assert "transformer_auto_wrap_policy" not in fixed and "FullyShardedDataParallel" not in fixed
    assert "from torch.distributed.fsdp import ShardingStrategy\n" in fixed
    assert "from torch.distributed.fsdp import StateDictType\n" in fixed
    assert (tmp_path / "pkg" / "__init__.py").read_text() == "from torch.distributed.fsdp import MixedPrecision\n"
    again, _ = migrate_paths([tmp_path], fix=True)
    assert (tmp_path / "helpers.py").read_text() == fixed
    assert not [f for f in again.findings if f.path.endswith("helpers.py")]


def test_a_module_method_on_the_constructed_wrapper_is_not_fsdp1s_class_member(tmp_path: Path) -> None:
    """``FSDP(model, ...).to(rank)``: nn.Module's ``to`` on the model made there (FSDP2's module has it), not a
    member of FSDP1's class: no TODO (it read as ``FSDP.to``)."""
    (tmp_path / "snippet.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n"
        "def build(m, rank):\n    return FSDP(m).to(rank)\n"
    )
    report, _ = migrate_paths([tmp_path], fix=True)
    assert not [f for f in report.findings if not f.fixable]
    assert "fsdp_bridge.shard(m, " in (tmp_path / "snippet.py").read_text()


def test_an_older_torchs_fsdp1_module_copied_under_another_name_is_one_construct(tmp_path: Path) -> None:
    """A tree keeping an older torch's FullyShardedDataParallel module under its own name
    (``fully_sharded_data_parallel_fix.py``): its names moved between torch's modules since, so it is matched
    against the whole package: one construct left as it is, not a TODO at each internal it reads."""
    names = ["ShardingStrategy", "MixedPrecision", "CPUOffload", "BackwardPrefetch", "StateDictType"]
    body = "".join(f"class {n}:\n    pass\n\n\n" for n in names)
    (tmp_path / "fully_sharded_data_parallel_fix.py").write_text(
        "import torch\n\n\n" + body + "class FullyShardedDataParallel(torch.nn.Module):\n"
        "    def _lazy_init(self):\n        for m in self.modules():\n            m._handles\n"
    )
    report, _ = migrate_paths([tmp_path])
    (finding,) = report.findings
    assert finding.construct == "a copy of torch's module torch.distributed.fsdp (6 of its functions and classes)"


def test_code_serving_both_layouts_is_kept_where_the_tree_makes_no_fsdp1_model(tmp_path: Path) -> None:
    """A verl-derived helper handed its models by a library (no ``FSDP(...)`` in the tree, which may keep making
    FSDP1 models after the migration): its summon under ``fsdp_version(m) > 0`` whose block reads DTensors itself
    stays (FSDP1's models need it, fully_shard's pass through), and FSDP1's prefixed names beside the same names
    unprefixed (a list serving both layouts) are kept, not turned into duplicates of the FSDP2 ones."""
    (tmp_path / "lora.py").write_text(
        textwrap.dedent("""\
            from torch.distributed.fsdp import FSDPModule
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            def fsdp_version(m):
                if isinstance(m, FSDP):
                    return 1
                elif isinstance(m, FSDPModule):
                    return 2
                return 0

            def units(model):
                found = []
                for name, module in model.named_modules():
                    if isinstance(module, FSDP):
                        found.append((name, "v1"))
                for name, module in model.named_modules():
                    if isinstance(module, FSDPModule):
                        found.append((name, "v2"))
                return found

            def collect(model):
                out = {}
                for prefix in ["_fsdp_wrapped_module.base.", "base."]:
                    for name, sub in model.named_modules():
                        if not name.startswith(prefix):
                            continue
                        if fsdp_version(sub) > 0:
                            with FSDP.summon_full_params(sub, writeback=False):
                                out.update({k: v.full_tensor() for k, v in sub.state_dict().items()})
                return out
            """)
    )
    report, _ = migrate_paths([tmp_path], fix=True)
    fixed = (tmp_path / "lora.py").read_text()
    assert 'for prefix in ["_fsdp_wrapped_module.base.", "base."]:' in fixed
    assert "with FSDP.summon_full_params(sub, writeback=False):" in fixed
    (summon,) = [f for f in report.findings if f.construct.startswith("FSDP.summon_full_params")]
    assert summon.fixable and summon.replacement.startswith("kept as is: no file of this tree makes an FSDP1 model")
    assert "        if isinstance(module, FSDP):\n" in fixed  # the v1 listing stays FSDP1's
    # the same file beside one that makes FSDP1 models: every module it admits is FSDP2's after --fix
    (tmp_path / "lora.py").write_text((tmp_path / "lora.py").read_text())
    (tmp_path / "build.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\ndef build(m):\n    return FSDP(m)\n"
    )
    again, _ = migrate_paths([tmp_path], fix=False)
    (summon,) = [f for f in again.findings if f.construct.startswith("FSDP.summon_full_params")]
    assert summon.replacement.startswith("the context goes, its block stays")


def test_a_copy_of_torchs_fsdp1_module_says_nothing_of_how_the_tree_shards(tmp_path: Path) -> None:
    """A copy of an older torch's FSDP1 module passes process groups internally; the tree's own code passes none:
    the torch target's GradScaler is torch's (no "the tree shards over process groups" TODO)."""
    names = ["ShardingStrategy", "MixedPrecision", "CPUOffload", "BackwardPrefetch", "StateDictType"]
    body = "".join(f"class {n}:\n    pass\n\n\n" for n in names)
    (tmp_path / "fully_sharded_data_parallel_fix.py").write_text(
        "import torch\nimport torch.distributed as dist\n\n\n"
        + body
        + "class FullyShardedDataParallel(torch.nn.Module):\n"
        "    def __init__(self, module, process_group=None):\n"
        "        super().__init__()\n        self.process_group = process_group or dist.new_group()\n"
    )
    (tmp_path / "train.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n\n\n"
        "def build(m):\n    return FSDP(m), ShardedGradScaler()\n"
    )
    report, _ = migrate_paths([tmp_path], target="torch")
    assert [f.construct for f in report.findings if not f.fixable] == []
    (scaler,) = [f for f in report.findings if f.construct.startswith("ShardedGradScaler")]
    assert scaler.replacement == "_fsdp2_helpers.GradScaler()"


def test_a_name_written_through_the_wrapped_module_keeps_the_unwrap() -> None:
    # FSDP1's wrapper hands reads of a name it does not define to the module (`model.module.n` reads as
    # `model.n`), never writes: `model.module.n += 1` became `model.n += 1`, which on the bridge's fsdp1 backend
    # set the wrapper's own attribute while the module's forward read its own (EfficientMoE's training_iters)
    source = textwrap.dedent("""\
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        def train(net, loader):
            model = FSDP(net)
            for x in loader:
                model.module.training_iters += 1
                model.module.note: int = 1
                print(model.module.training_iters)
        """)
    fixed = migrate_source(source, "train.py").fixed
    assert "        fsdp_bridge.unwrapped(model).training_iters += 1\n" in fixed
    assert "        fsdp_bridge.unwrapped(model).note: int = 1\n" in fixed
    assert "        print(model.training_iters)\n" in fixed
    assert migrate_source(fixed, "train.py").fixed == fixed


def test_an_unused_import_is_reported_on_the_line_its_name_is_written() -> None:
    # a name of a parenthesized import on its own line, a name imported twice on each of its lines (DanceGRPO's
    # report put them at 1:1 and twice on the first import's line)
    source = textwrap.dedent("""\
        import torch
        from torch.distributed.fsdp import (
            StateDictType,
            FullStateDictConfig,
        )
        from torch.distributed.fsdp import ShardingStrategy

        def f(x):
            return x

        from torch.distributed.fsdp import ShardingStrategy
        """)
    found = sorted((f.line, f.construct.split(" import ")[1]) for f in migrate_source(source, "imp.py").findings)
    assert found == [
        (3, "StateDictType (never used here)"),
        (4, "FullStateDictConfig (never used here)"),
        (6, "ShardingStrategy (never used here)"),
        (11, "ShardingStrategy (never used here)"),
    ]
