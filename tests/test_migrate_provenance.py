"""Which objects are FSDP1's: aliases of the wrapper class (``Sharded = FullyShardedDataParallel``), models
handed to a constructor under an FSDP1 annotation, and the wrapper's settings read on proven FSDP1 objects."""

from __future__ import annotations

from pathlib import Path

from fsdp_bridge.migrate._code import migrate_paths, migrate_source


def _migrate(source: str, name: str = "snippet.py"):  # type: ignore[no-untyped-def]
    result = migrate_source(source, name)
    compile(result.fixed, name, "exec")
    assert migrate_source(result.fixed, name).fixed == result.fixed, "a second --fix changes nothing"
    return result


ALIASED = (
    "import torch\n"
    "from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType\n\n"
    "Sharded = FullyShardedDataParallel\n\n\n"
    "def build(net):\n"
    "    return Sharded(net, use_orig_params=True)\n\n\n"
    "def optim_state(net, opt):\n"
    "    with Sharded.state_dict_type(net, StateDictType.FULL_STATE_DICT):\n"
    "        weights = net.state_dict()\n"
    "    return weights, Sharded.optim_state_dict(net, opt)\n"
)


def test_calls_through_a_module_level_alias_are_rewritten_and_the_alias_removed() -> None:
    result = _migrate(ALIASED)
    fixed = result.fixed
    assert "fsdp_bridge.shard(net, fsdp_bridge.BridgeConfig(" in fixed
    assert "get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))" in fixed
    assert "fsdp_bridge.full_optim_state_dict(net, opt, rank0_only=False, offload_to_cpu=True)" in fixed
    assert "Sharded" not in fixed and "FullyShardedDataParallel" not in fixed  # no use remains: both gone
    assert all(f.fixable for f in result.findings)
    (alias,) = [f for f in result.findings if f.line == 4]
    assert alias.construct.startswith("Sharded = FullyShardedDataParallel") and "removed" in alias.replacement


def test_an_alias_spelt_in_full_inside_a_function_is_followed() -> None:
    source = (
        "import torch.distributed.fsdp\n\n\n"
        "def clip(net):\n"
        "    Wrap = torch.distributed.fsdp.FullyShardedDataParallel\n"
        "    net = Wrap(net)\n"
        "    with Wrap.summon_full_params(net):\n"
        "        pass\n"
        "    return net\n"
    )
    fixed = _migrate(source).fixed
    assert "net = fsdp_bridge.shard(net, " in fixed
    assert "with fsdp_bridge.summon_full_params(net" in fixed
    assert "Wrap" not in fixed


def test_an_alias_still_used_is_kept_and_reported() -> None:
    source = ALIASED + "\n\nREGISTRY = {'sharded': Sharded}\n"
    result = _migrate(source)
    assert "Sharded = FullyShardedDataParallel" in result.fixed
    (alias,) = [f for f in result.findings if f.line == 4]
    assert alias.fixable and alias.replacement.startswith("kept: Sharded is still used")
    assert "fsdp_bridge.full_optim_state_dict(net, opt" in result.fixed  # the calls through it are still rewritten
    assert any(not f.fixable and f.construct == "Sharded" for f in result.findings)  # the use left is listed


def test_a_name_bound_twice_is_not_an_alias() -> None:
    # Another branch binds the name to something else: calls through it may not be FSDP1's.
    source = (
        "from torch.distributed.fsdp import FullyShardedDataParallel\n\n"
        "if USE_FSDP:\n"
        "    Sharded = FullyShardedDataParallel\n"
        "else:\n"
        "    Sharded = None\n\n\n"
        "def optim_state(net, opt):\n"
        "    return Sharded.optim_state_dict(net, opt)\n"
    )
    result = _migrate(source)
    (finding,) = [f for f in result.findings if f.line == 4]
    assert not finding.fixable and "bound more than once" in finding.replacement
    assert "return Sharded.optim_state_dict(net, opt)" in result.fixed
    assert "get_optimizer_state_dict" not in result.fixed


def test_a_name_rebound_through_global_is_not_an_alias() -> None:
    source = (
        "from torch.distributed.fsdp import FullyShardedDataParallel\n\n"
        "Sharded = FullyShardedDataParallel\n\n\n"
        "def disable():\n"
        "    global Sharded\n"
        "    Sharded = None\n\n\n"
        "def build(net):\n"
        "    return Sharded(net)\n"
    )
    result = _migrate(source)
    assert "return Sharded(net)" in result.fixed
    assert "fsdp_bridge.shard" not in result.fixed


def test_an_alias_another_file_imports_is_kept_with_a_todo(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "wrappers.py").write_text(ALIASED)
    (tmp_path / "user.py").write_text("from wrappers import Sharded\n\n\ndef go(net):\n    return Sharded(net)\n")
    _report, results = migrate_paths([tmp_path])
    (wrappers,) = [r for r in results if r.path.endswith("wrappers.py")]
    (alias,) = [f for f in wrappers.findings if f.line == 4]
    assert not alias.fixable and "imports a name Sharded" in alias.replacement
    assert "# TODO(fsdp-bridge): Sharded = FullyShardedDataParallel" in wrappers.fixed
    assert "\nSharded = FullyShardedDataParallel\n" in wrappers.fixed
    migrate_paths([tmp_path], fix=True)
    once = (tmp_path / "wrappers.py").read_text()
    migrate_paths([tmp_path], fix=True)
    assert (tmp_path / "wrappers.py").read_text() == once
    assert once.count("# TODO(fsdp-bridge): Sharded = ") == 1


HANDED_IN = (
    "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
    "class NormKeeper:\n"
    "    def __init__(self, sharded: FSDP, limit: float) -> None:\n"
    "        self.sharded = sharded\n"
    "        self.limit = limit\n\n"
    "    def apply(self):\n"
    "        return self.sharded.clip_grad_norm_(max_norm=self.limit)\n"
)


def test_an_attribute_set_from_an_fsdp1_annotated_parameter_is_fsdp1() -> None:
    result = _migrate(HANDED_IN)
    assert "return fsdp_bridge.clip_grad_norm_(self.sharded, max_norm=self.limit)" in result.fixed
    assert all(f.fixable for f in result.findings)


def test_any_other_assignment_of_the_attribute_spoils_the_proof() -> None:
    spoilers = {
        "another method": "\n    def swap(self, other):\n        self.sharded = other\n",
        "unpacked from one value": "\n    def swap(self, pair: FSDP):\n        self.sharded, self.limit = pair\n",
        "chained": "\n    def swap(self, other: FSDP):\n        self.sharded = self.backup = other\n",
        "the parameter re-bound": "\n    def swap(self, other: FSDP):\n        other = other.module\n"
        "        self.sharded = other\n",
        "setattr": "\n    def swap(self, other):\n        setattr(self, 'sharded', other)\n",
        "a subclass in the file": "\n\nclass Other(NormKeeper):\n    pass\n",
    }
    for why, extra in spoilers.items():
        result = _migrate(HANDED_IN + extra)
        assert "self.sharded.clip_grad_norm_(max_norm=self.limit)" in result.fixed, why
        assert any(not f.fixable and f.construct.startswith("self.sharded.clip_grad_norm_") for f in result.findings)


def test_a_pairwise_unpacking_from_an_annotated_parameter_keeps_the_proof() -> None:
    # self.o, self.sharded = o, other with other: FSDP is self.sharded = other: FSDP1's wrapper still
    extra = "\n    def swap(self, other: FSDP):\n        self.limit, self.sharded = 1.0, other\n"
    assert "return fsdp_bridge.clip_grad_norm_(self.sharded, max_norm=self.limit)" in _migrate(HANDED_IN + extra).fixed


def test_a_subclass_in_another_file_spoils_the_proof(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "keeper.py").write_text(HANDED_IN)
    (tmp_path / "other.py").write_text("import keeper\n\n\nclass Mine(keeper.NormKeeper):\n    pass\n")
    _report, results = migrate_paths([tmp_path])
    (keeper,) = [r for r in results if r.path.endswith("keeper.py")]
    assert "self.sharded.clip_grad_norm_(max_norm=self.limit)" in keeper.fixed


SETTINGS_READ = (
    "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy\n\n\n"
    "def replicated(net: FSDP) -> bool:\n"
    "    return net.sharding_strategy is ShardingStrategy.NO_SHARD or net.sharding_strategy.name == 'HYBRID_SHARD'\n\n\n"
    "def compute_dtype(net: FSDP):\n"
    "    return net.mixed_precision.param_dtype, net.cpu_offload\n\n\n"
    "def unknown(engine):\n"
    "    return engine.sharding_strategy\n"
)


def test_settings_read_on_a_proven_wrapper_become_fsdp1_settings() -> None:
    result = _migrate(SETTINGS_READ)
    fixed = result.fixed
    assert (
        "return fsdp_bridge.fsdp1_settings(net).sharding_strategy is ShardingStrategy.NO_SHARD or "
        "fsdp_bridge.fsdp1_settings(net).sharding_strategy.name == 'HYBRID_SHARD'" in fixed
    )
    assert "return fsdp_bridge.fsdp1_settings(net).mixed_precision.param_dtype, net.cpu_offload" in fixed
    assert "return engine.sharding_strategy" in fixed  # nothing shows engine is FSDP1's
    (todo,) = [f for f in result.findings if not f.fixable]
    assert todo.construct.startswith("net.cpu_offload")  # no bridge function answers it: still a TODO


def test_target_torch_reports_the_settings_call_it_leaves_once() -> None:
    result = migrate_source(SETTINGS_READ, "settings.py", target="torch")
    kept = [f for f in result.findings if "kept on fsdp_bridge under --target torch" in f.replacement]
    assert len(kept) == 3  # each read's own line, a TODO naming the bridge call the output keeps
    assert all(f.replacement.startswith("fsdp_bridge.fsdp1_settings(") for f in kept)
    assert all(not f.fixable and "FSDPModule keeps no strategy" in f.replacement for f in kept)


def test_a_setting_read_in_a_private_idioms_condition_is_left_to_that_idiom() -> None:
    source = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy\n\n\n"
        "def free(model):\n"
        "    for unit in FSDP.fsdp_modules(model):\n"
        "        if unit._has_params and unit.sharding_strategy is not ShardingStrategy.NO_SHARD:\n"
        "            pass\n"
    )
    fixed = _migrate(source).fixed
    assert "if unit._has_params and unit.sharding_strategy is not ShardingStrategy.NO_SHARD:" in fixed
    assert "fsdp1_settings" not in fixed


MAIN_BLOCK = (
    "import torch\n"
    "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
    "def clip(model, max_norm):\n"
    "    return model.clip_grad_norm_(max_norm).item()\n\n\n"
    'if __name__ == "__main__":\n'
    "    model = FSDP(torch.nn.Linear(2, 2))\n"
    "    for step in range(3):\n"
    "        model(torch.randn(1, 2)).sum().backward()\n"
    "        if step:\n"
    "            norm = clip(model, 1.0)\n"
    "    plain = torch.nn.Linear(2, 2)\n"
    "    clip(plain, 1.0)\n"
)


def test_a_model_wrapped_in_the_main_block_is_followed_into_the_functions_it_is_handed_to() -> None:
    # the main block is one statement: the wrap above the call inside its loop counts, in the order the code
    # runs; the clip is the bridge's (which also takes the plain module handed to the same function)
    result = _migrate(MAIN_BLOCK)
    assert "return fsdp_bridge.clip_grad_norm_(model, max_norm).item()" in result.fixed
    assert all(f.fixable for f in result.findings)


def test_a_factory_re_exported_by_its_package_is_followed_and_its_model_handed_on(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # pkg/utils/__init__.py re-exports the factory; run.py imports it from the package and hands the model to
    # train(), whose .module read is then guarded (the model may be another wrapper on other paths)
    pkg = tmp_path / "pkg"
    (pkg / "utils").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "utils" / "__init__.py").write_text("from .dist import get_distributed_model\n")
    (pkg / "utils" / "dist.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def get_distributed_model(model):\n    return FSDP(model)\n"
    )
    (pkg / "run.py").write_text(
        "from pkg.utils import get_distributed_model\nfrom pkg.train import train\n\n\n"
        "def main(m):\n    model = get_distributed_model(m)\n    heads = model.module.num_heads\n"
        "    return train(model), heads\n"
    )
    (pkg / "train.py").write_text("def train(model):\n    return model.module.loss(1)\n")
    report, _ = migrate_paths([pkg], fix=True)
    assert "    heads = model.num_heads\n" in (pkg / "run.py").read_text()
    assert (
        "return (fsdp_bridge.unwrapped(model) if fsdp_bridge.is_sharded(model) else model.module).loss(1)"
        in (pkg / "train.py").read_text()
    )
    assert all(f.fixable for f in report.findings)

    # --target torch, a read inside summon_full_params: a second --fix leaves the unwrap the first one wrote
    (pkg / "utils" / "dist.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def get_distributed_model(model):\n    return FSDP(model)\n"
    )
    (pkg / "train.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def train(model):\n    with FSDP.summon_full_params(model, writeback=False):\n"
        "        return [n for n, p in model.module.named_parameters()]\n"
    )
    migrate_paths([pkg], fix=True, target="torch")
    once = (pkg / "train.py").read_text()
    assert "p in (model if isinstance(model, FSDPModule) else model.module).named_parameters()]" in once
    migrate_paths([pkg], fix=True, target="torch")
    assert (pkg / "train.py").read_text() == once


def test_a_module_read_in_a_function_another_file_also_defines_is_not_taken_as_fsdp1s(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # run_fsdp.py hands an FSDP1 model to its train_one_epoch; run_ddp.py defines its own train_one_epoch for a
    # DDP model: a call names a function, not the file, so the DDP script's .module read stays as written
    (tmp_path / "run_fsdp.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def train_one_epoch(model):\n    return model.module\n\n\n"
        "def main(m):\n    model = FSDP(m)\n    train_one_epoch(model)\n"
    )
    ddp = "def train_one_epoch(model):\n    return model.module\n"
    (tmp_path / "run_ddp.py").write_text(ddp)
    migrate_paths([tmp_path], fix=True)
    assert (tmp_path / "run_ddp.py").read_text() == ddp
    assert "fsdp_bridge.unwrapped(model)" in (tmp_path / "run_fsdp.py").read_text()


def test_the_else_of_an_fsdp1_test_keeps_the_other_modules_path() -> None:
    # if isinstance(model, FSDP): <FSDP1's full state> else: model.state_dict() -- the else runs for DDP and plain
    # modules, whose state_dict() stays as written (the full form would drop DDP's "module." key prefix)
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType\n\n\n"
        "def save(model):\n"
        "    if isinstance(model, FSDP):\n"
        "        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):\n"
        "            return model.state_dict()\n"
        "    else:\n"
        "        return model.state_dict()\n"
    )
    result = _migrate(code)
    assert result.fixed.endswith("    else:\n        return model.state_dict()\n")
    assert [f.line for f in result.findings] == [5, 6]


def test_a_factory_that_wraps_in_fsdp1_on_one_path_only_gets_guarded_module_reads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # dist.py's get_model returns FSDP1's wrapper or DDP's (one `return model` after an if/else): its result is
    # FSDP1's on one path only, so .module reads on it are guarded, and so are they when a sibling branch binds the
    # name to a DeepSpeed engine; sure.py's make() wraps on every path, so there .module goes
    (tmp_path / "dist.py").write_text(
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n\n\n"
        "def get_model(model, use_fsdp):\n"
        "    if use_fsdp:\n        model = FSDP(model)\n    else:\n        model = DDP(model)\n    return model\n\n\n"
        "def make(model):\n    model = model.float()\n    model = FSDP(model)\n    return model\n"
    )
    (tmp_path / "run.py").write_text(
        "import deepspeed\nfrom dist import get_model\n\n\n"
        "def main(m, fsdp, ds):\n"
        "    model = get_model(m, fsdp)\n    a = model.module.num_heads\n"
        "    if not ds:\n        net = get_model(m, fsdp)\n    else:\n"
        "        net, _, _, _ = deepspeed.initialize(model=m)\n"
        "    b = net.module.num_heads\n"
        "    return a, b\n"
    )
    (tmp_path / "sure.py").write_text(
        "from dist import make\n\n\ndef main(m):\n    model = make(m)\n    return model.module.x\n"
    )
    report, _ = migrate_paths([tmp_path], fix=True)
    run = (tmp_path / "run.py").read_text()
    assert "a = (fsdp_bridge.unwrapped(model) if fsdp_bridge.is_sharded(model) else model.module).num_heads" in run
    assert "b = (fsdp_bridge.unwrapped(net) if fsdp_bridge.is_sharded(net) else net.module).num_heads" in run
    assert "return model.x\n" in (tmp_path / "sure.py").read_text()
    texts = [f.replacement for f in report.findings if f.path.endswith("run.py")]
    assert len(texts) == 2 and all("returns FSDP1's wrapper on one path" in t for t in texts)


def test_fsdp1_arguments_passed_on_by_position_are_translated_at_run_time() -> None:
    # a wrapper class's FSDP(module, *args, **kwargs): from_fsdp1 takes FSDP1's positional order after module
    code = (
        "from torch import nn\nfrom torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "class Wrapper(nn.Module):\n"
        "    def __init__(self, module, *args, **kwargs):\n"
        "        super().__init__()\n"
        "        self.module = FSDP(module, *args, **kwargs)\n\n\n"
        "def later(module, group, *args):\n    return FSDP(module, group, *args)\n"
    )
    result = _migrate(code)
    assert "fsdp_bridge.BridgeConfig.from_fsdp1(\n                *args,\n                **kwargs,\n" in result.fixed
    # a positional argument before *args would land on another parameter when renamed: left with a TODO
    assert "return FSDP(module, group, *args)" in result.fixed
    assert [f.fixable for f in result.findings if f.construct.startswith("FSDP(")] == [True, False]


def test_another_classs_clip_grad_norm_is_no_sign_of_fsdp1(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # accelerate's Accelerator has clip_grad_norm_ and a mixed_precision string: in a file handed FSDP1 models
    # by a factory of the tree, the accelerator's attributes stay as written
    (tmp_path / "wrapping.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\ndef wrap_with_fsdp(m):\n"
        "    return FSDP(m)\n"
    )
    train = (
        "from accelerate import Accelerator\nfrom wrapping import wrap_with_fsdp\n\n\n"
        "def main(mp, model):\n    accelerator = Accelerator(mixed_precision=mp)\n    model = wrap_with_fsdp(model)\n"
        '    if accelerator.mixed_precision == "fp16":\n        pass\n'
        "    accelerator.clip_grad_norm_(model.parameters(), 1.0)\n"
    )
    (tmp_path / "train.py").write_text(train)
    report, _ = migrate_paths([tmp_path], fix=True)
    assert (tmp_path / "train.py").read_text() == train
    assert [f.path for f in report.findings] == [str(tmp_path / "wrapping.py")]


def test_a_lightning_strategy_subclass_keeps_its_own_fsdp1_wrap() -> None:
    # the subclass's _setup_model wraps with FSDP1; the state-dict and checkpoint methods it inherits from
    # Lightning call FSDP1's API on that model, so the call stays FSDP1's with the class (both TODOs)
    code = (
        "from lightning.pytorch.strategies import FSDPStrategy\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel\n\n\n"
        "class CPUInit(FSDPStrategy):\n"
        "    def _setup_model(self, model):\n"
        "        return FullyShardedDataParallel(module=model, **self.kwargs)\n"
    )
    result = _migrate(code)
    assert "return FullyShardedDataParallel(module=model, **self.kwargs)" in result.fixed
    wrap = next(f for f in result.findings if f.construct == "FullyShardedDataParallel(...)")
    assert not wrap.fixable and "CPUInit subclasses Lightning's FSDP1 strategy" in wrap.replacement


def test_a_lightning_modules_own_fsdp1_wrap_in_configure_model_stays_with_the_strategy() -> None:
    # under Lightning's FSDPStrategy, configure_model() shards parts by hand; the strategy leaves the module alone only
    # when it holds FSDP1 wrappers, so FSDP2 parts there would be wrapped again by FSDP1 (a crash at setup)
    code = (
        "import lightning.pytorch as pl\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "class Distill(pl.LightningModule):\n"
        "    def configure_model(self):\n"
        "        self.student = FSDP(self.student, **self.trainer.strategy.kwargs)\n\n"
        "    def other(self, net):\n"
        "        return FSDP(net)\n"
    )
    result = _migrate(code)
    assert "self.student = FSDP(self.student, **self.trainer.strategy.kwargs)" in result.fixed
    hook, other = [f for f in result.findings if f.construct == "FSDP(...)"]
    assert not hook.fixable and "configure_model() of a Lightning module" in hook.replacement
    assert other.fixable and "return fsdp_bridge.shard(net" in result.fixed  # not a Lightning hook


def test_a_module_read_under_another_names_fsdp1_test_gets_the_guarded_form() -> None:
    # if isinstance(lm_model, FSDP): self.lm_model.module.head = ... -- the same model by another name: the test
    # becomes is_sharded(lm_model) (true on FSDP2), so the .module read under it takes the guarded form; the module
    # set into a sharded model is a TODO (sharded by neither backend)
    code = (
        "from torch import nn\nfrom torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "class Reward(nn.Module):\n"
        "    def __init__(self, lm_model):\n"
        "        super().__init__()\n"
        "        self.lm_model = lm_model\n"
        "        if isinstance(lm_model, FSDP):\n"
        "            self.lm_model.module.head = nn.Linear(4, 1)\n"
        "        width = self.lm_model.module.width if isinstance(lm_model, FSDP) else 4\n"
    )
    result = _migrate(code)
    guarded = (
        "(fsdp_bridge.unwrapped(self.lm_model) if fsdp_bridge.is_sharded(self.lm_model) else self.lm_model.module)"
    )
    assert f"            {guarded}.head = nn.Linear(4, 1)\n" in result.fixed
    assert f"width = {guarded}.width if fsdp_bridge.is_sharded(lm_model) else 4" in result.fixed
    (todo,) = [f for f in result.findings if not f.fixable]
    assert "a module set into a sharded model" in todo.construct and "set it before the shard call" in todo.replacement


def test_a_search_for_the_nearest_unit_is_not_taken_for_an_unwrapping_loop() -> None:
    # while not isinstance(parent, FSDP): climb to the parent -- a search: is_sharded, not the unwrapping test
    # (which FSDP2's units never meet, so the climb ran past the root); an if that hands the module to an unwrap
    # call strips FSDP1's wrappers only (FSDP2's root and units have none)
    code = (
        "import operator\nfrom torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def nearest_unit(name, model):\n"
        "    parent = operator.attrgetter(name)(model)\n"
        "    while not isinstance(parent, FSDP):\n"
        '        name = ".".join(name.split(".")[:-1])\n'
        "        parent = operator.attrgetter(name)(model)\n"
        "    return parent\n\n\n"
        "def strip(model, accelerator, set_layer):\n"
        "    for name, module in model.named_modules():\n"
        "        if isinstance(module, FSDP):\n"
        "            set_layer(name, accelerator.unwrap_model(module), model)\n"
    )
    fixed = _migrate(code).fixed
    assert "    while not fsdp_bridge.is_sharded(parent):\n" in fixed
    assert "        if (fsdp_bridge.is_sharded(module) and fsdp_bridge.unwrapped(module) is not module):\n" in fixed


def test_forward_called_on_a_model_handed_by_another_file_becomes_a_call(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # run.py wraps the model and hands it to viz.show(mm=...), whose mm.forward(x) skipped FSDP2's gather hooks
    (tmp_path / "viz.py").write_text("def show(x, mm=None):\n    return mm.forward(x)\n")
    (tmp_path / "run.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\nfrom viz import show\n\n\n"
        "def main(net, x):\n    model = FSDP(net)\n    return show(x, mm=model)\n"
    )
    migrate_paths([tmp_path], fix=True)
    assert (tmp_path / "viz.py").read_text() == "def show(x, mm=None):\n    return mm(x)\n"


def test_a_model_kept_on_the_instance_by_a_method_it_is_handed_to_is_followed_to_the_other_methods(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    # trainer.prepare(model) stores the FSDP1 model another file made on self.model; the training step calls
    # self.model.no_sync() / clip_grad_norm_() in another method (FSDPModule has neither: a crash at the first step)
    (tmp_path / "train.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\nfrom trainer import Trainer\n\n\n"
        "def main(net):\n    model = FSDP(net)\n    trainer = Trainer()\n    trainer.prepare(model)\n"
    )
    trainer = (
        "class Trainer:\n"
        "    def __init__(self):\n        self.model = None\n\n"
        "    def prepare(self, model):\n        self.model = model\n\n"
        "    def step(self, batch):\n"
        "        with self.model.no_sync():\n            self.model(batch).backward()\n"
        "        return self.model.clip_grad_norm_(1.0)\n"
    )
    (tmp_path / "trainer.py").write_text(trainer)
    other = "class Other:\n    def set(self, model):\n        self.model = model\n        self.model = model.module\n\n"
    other += "    def step(self):\n        self.model.clip_grad_norm_(1.0)\n"
    (tmp_path / "other.py").write_text(other)
    migrate_paths([tmp_path], fix=True)
    fixed = (tmp_path / "trainer.py").read_text()
    assert "with fsdp_bridge.no_sync(self.model):" in fixed
    assert "return fsdp_bridge.clip_grad_norm_(self.model, 1.0)" in fixed
    assert (tmp_path / "other.py").read_text() == other  # set() is never handed the model; nothing shown there


def test_a_model_handed_to_the_base_class_by_super_init_is_followed_into_the_base_methods(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # FSDPTrainer wraps the model and hands it on with super().__init__(model=...): the base class (imported from
    # base.py) keeps it as self.model, and its training step clips with torch's clip over the FSDP1 model's
    # parameters (each rank's shard norm on FSDP1, the global norm on FSDP2): a note there. legacy.py defines
    # another BaseTrainer that nothing hands the model to: nothing said there.
    (tmp_path / "fsdp_trainer.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\nfrom base import BaseTrainer\n\n\n"
        "class FSDPTrainer(BaseTrainer):\n"
        "    def __init__(self, net, lr):\n"
        "        model = self._wrap(net)\n"
        "        super().__init__(model=model, lr=lr)\n\n"
        "    def _wrap(self, net):\n        return FSDP(net)\n"
    )
    base = (
        "import torch\n\n\n"
        "class BaseTrainer:\n"
        "    def __init__(self, model, lr):\n        self.model = model\n        self.lr = lr\n\n"
        "    def step(self, batch):\n"
        "        self.model(batch).sum().backward()\n"
        "        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)\n"
    )
    (tmp_path / "base.py").write_text(base)
    (tmp_path / "legacy.py").write_text(base)
    report, _ = migrate_paths([tmp_path], fix=True)
    notes = [f for f in report.findings if f.note]
    assert [Path(f.path).name for f in notes] == ["base.py"], notes
    assert "torch.nn.utils.clip_grad_norm_(self.model.parameters()" in notes[0].construct
    assert (tmp_path / "base.py").read_text() == base  # a note: the call stays
    assert (tmp_path / "legacy.py").read_text() == base


def test_state_dicts_of_a_model_kept_from_a_constructor_argument_are_full_on_the_fsdp2_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # main.py wraps the unet with a factory of another file on one branch and hands it to Trainer(unet=...), which
    # keeps it as self.unet: its resume load_state_dict took FSDP1's default full state dict (raises on FSDP2's
    # DTensors). A class whose model parameter is annotated Union[nn.Module, FSDP] is FSDP1's on some path too.
    (tmp_path / "wrapping.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "class Wrap:\n    @staticmethod\n    def wrap_unet(unet):\n        return FSDP(unet)\n"
    )
    (tmp_path / "main.py").write_text(
        "from wrapping import Wrap\nfrom trainer import Trainer\n\n\n"
        "def main(unet, fsdp):\n"
        "    if fsdp:\n        unet = Wrap.wrap_unet(unet)\n    else:\n        unet.cuda()\n"
        "    Trainer(unet=unet).resume('ckpt.pt')\n"
    )
    (tmp_path / "trainer.py").write_text(
        "import torch\n\n\n"
        "class Trainer:\n"
        "    def __init__(self, unet):\n        self.unet = unet\n\n"
        "    def resume(self, path):\n        self.unet.load_state_dict(torch.load(path)['unet'])\n"
    )
    (tmp_path / "typed.py").write_text(
        "from typing import Union\n\nimport torch\nfrom torch import nn\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "class Typed:\n"
        "    def __init__(self, model: Union[nn.Module, FSDP]):\n        self.model = model\n\n"
        "    def save(self, path):\n        torch.save(self.model.state_dict(), path)\n"
    )
    migrate_paths([tmp_path], fix=True)
    guarded = "any(isinstance(m, FSDPModule) for m in {0}.modules())"
    trainer = (tmp_path / "trainer.py").read_text()
    assert (
        "set_model_state_dict(self.unet, torch.load(path)['unet'], options=StateDictOptions(full_state_dict=True"
        in trainer
    )
    assert guarded.format("self.unet") in trainer and "else self.unet.load_state_dict(" in trainer  # the plain path
    typed = (tmp_path / "typed.py").read_text()
    assert "get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))" in typed
    assert guarded.format("self.model") in typed and "else self.model.state_dict()" in typed


def test_a_factory_reached_through_a_star_import_makes_its_result_an_fsdp1_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # run.py takes setup_model from `from pkg.utils import *`: its model.forward(x) skipped FSDP2's gather hooks
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "utils.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def setup_model(net):\n    model = FSDP(net)\n    return model\n"
    )
    run = "from pkg.utils import *\n\n\ndef main(net, x, other):\n    model = setup_model(net)\n"
    run += "    other.forward(x)\n    return model.forward(x)\n"
    (tmp_path / "run.py").write_text(run)
    migrate_paths([tmp_path], fix=True)
    assert (tmp_path / "run.py").read_text() == run.replace("return model.forward(x)", "return model(x)")


def test_scripts_that_each_define_a_function_of_the_same_name_keep_their_own_evidence(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Three training scripts, each with its own setup_model / save: the FSDP1 one's model is not the single-GPU
    # or DDP script's (their calls reach their own functions), and the FSDP1 script's tuple-unpacked model is
    # its factory's (its resume load becomes a full-state load).
    (tmp_path / "train_fsdp.py").write_text(
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def setup_model(net):\n"
        "    model = FSDP(net)\n"
        "    return model, 'tokenizer'\n\n\n"
        "def save(model, optimizer):\n"
        "    return optimizer.state_dict()\n\n\n"
        "def main(net, path):\n"
        "    model, tok = setup_model(net)\n"
        "    model.load_state_dict(torch.load(path))\n"
        "    return save(model, None)\n"
    )
    plain = (
        "import torch\n\n\n"
        "def setup_model(net):\n"
        "    return net, 'tokenizer'\n\n\n"
        "def save(model, optimizer):\n"
        "    return model.state_dict(), optimizer.state_dict()\n\n\n"
        "def main(net, opt):\n"
        "    model, tok = setup_model(net)\n"
        "    model.load_state_dict({})\n"
        "    return save(model, opt)\n"
    )
    (tmp_path / "train.py").write_text(plain)
    report, _ = migrate_paths([tmp_path], fix=True)
    assert not [f for f in report.findings if f.path.endswith("train.py") and not f.path.endswith("_fsdp.py")]
    assert (tmp_path / "train.py").read_text() == plain
    fixed = (tmp_path / "train_fsdp.py").read_text()
    assert "set_model_state_dict(model, torch.load(path), options=StateDictOptions(full_state_dict=True))" in fixed


def test_a_recursive_unwrap_returns_the_model_on_fsdp2_instead_of_recursing_forever(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # def module(m): return module(m.module) if wrapped: FSDP2's sharded model is the module itself and stays
    # sharded, so the recursion must stop there (checked at one gloo rank: fsdp2 and fsdp1 bridge models, DDP and
    # torch's FSDP1 wrapper give the module inside, or the model itself on FSDP2).
    (tmp_path / "train.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from utils import module\n\n\n"
        "def main(net):\n"
        "    model = FSDP(net)\n"
        "    return module(model)\n"
    )
    (tmp_path / "utils.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n\n\n"
        "def module(model):\n"
        "    if isinstance(model, (FSDP, DDP)):\n"
        "        return module(model.module)\n"
        "    return model\n"
    )
    migrate_paths([tmp_path], fix=True)
    fixed = (tmp_path / "utils.py").read_text()
    assert (
        "        return (model if fsdp_bridge.is_sharded(model) and fsdp_bridge.unwrapped(model) is model else "
        "module((fsdp_bridge.unwrapped(model) if fsdp_bridge.is_sharded(model) else model.module)))\n"
    ) in fixed
    migrate_paths([tmp_path], fix=True)
    assert (tmp_path / "utils.py").read_text() == fixed


def test_fsdp1s_class_chosen_by_a_conditional_expression_is_a_todo_and_its_models_stay_on_the_bridge(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # (FSDP if ok else Plain)(m, ...) whose arguments the bridge's call cannot take (process_group= with
    # device_mesh=) is FSDP1's constructor left as written: the model stays FSDP1's. Under --target torch the
    # summon of another file stays on fsdp_bridge (the plain-torch helper gathers fully_shard's DTensors only: on
    # FSDP1's flat-parameter views it gathered nothing). With arguments the bridge takes, the call is rewritten,
    # each class keeping its branch (below), and the summon of the model it makes is torch's.
    for arguments, kept in (("process_group=pg, device_mesh=mesh", True), ("use_orig_params=True", False)):
        (tmp_path / "train.py").write_text(
            "import torch.distributed as dist\n"
            "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
            "from loop import sample\n\n\n"
            "def main(net, Plain, pg, mesh):\n"
            f"    model = (FSDP if dist.is_initialized() else Plain)(net, {arguments})\n"
            "    return sample(model)\n"
        )
        (tmp_path / "loop.py").write_text(
            "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
            "def sample(model):\n"
            "    with FSDP.summon_full_params(model, writeback=False):\n"
            "        return model(1)\n"
        )
        report, _ = migrate_paths([tmp_path], fix=True, target="torch")
        todos = [f.construct for f in report.findings if f.path.endswith("train.py") and not f.fixable]
        loop = (tmp_path / "loop.py").read_text()
        if kept:
            assert todos == ["(FSDP if ... else ...)(...) (FSDP1's constructor chosen by a conditional expression)"]
            assert "with fsdp_bridge.summon_full_params(model, writeback=False):" in loop
            assert "_fsdp2_helpers" not in loop
        else:
            assert [f for f in report.findings if not f.fixable] == []
            assert "with _fsdp2_helpers.summon_full_params(model, writeback=False):" in loop


CHOSEN = (
    "import torch.distributed as dist\n"
    "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy\n"
    "from loop import sample\n\n\n"
    "def main(net, Plain, Block, hybrid):\n"
    "    policy = lambda module, recurse, **_: recurse or isinstance(module, Block)\n"
    "    model: FSDP = (FSDP if dist.is_initialized() else Plain)(\n"
    "        net,\n"
    "        auto_wrap_policy=policy,\n"
    "        sharding_strategy=ShardingStrategy.HYBRID_SHARD if hybrid else ShardingStrategy.NO_SHARD,  # FULL\n"
    "        use_orig_params=True,\n"
    "    )\n"
    "    plain = (Plain if hybrid else FSDP)(net, use_orig_params=True).eval()\n"
    "    return sample(model), plain\n"
)


def test_fsdp1s_class_chosen_by_a_conditional_expression_becomes_the_bridges_call_in_its_own_branch() -> None:
    # (FSDP if ok else Plain)(m, **kw) is FSDP(m, **kw) if ok else Plain(m, **kw): FSDP1's branch becomes the
    # bridge's call, the other class keeps every argument as written (a variable, FSDP1's enum, a comment), so
    # nothing they name goes; parenthesised, so a method called on the result applies to either branch.
    result = migrate_source(CHOSEN, "train.py")
    assert [f for f in result.findings if not f.fixable] == []
    assert (
        "    model: fsdp_bridge.ShardedModule = (fsdp_bridge.shard(\n"
        "        net,\n"
        "        fsdp_bridge.BridgeConfig.from_fsdp1(\n"
        "            auto_wrap_policy=policy,\n"
        "            sharding_strategy=ShardingStrategy.HYBRID_SHARD if hybrid else ShardingStrategy.NO_SHARD,  # FULL\n"
        "            use_orig_params=True,\n"
        "        ),\n"
        "    ) if dist.is_initialized() else Plain(\n"
        "        net,\n"
        "        auto_wrap_policy=policy,\n"
        "        sharding_strategy=ShardingStrategy.HYBRID_SHARD if hybrid else ShardingStrategy.NO_SHARD,  # FULL\n"
        "        use_orig_params=True,\n"
        "    ))\n"
    ) in result.fixed
    assert "    policy = lambda module" in result.fixed and "import FullyShardedDataParallel" not in result.fixed
    assert "from torch.distributed.fsdp import ShardingStrategy\n" in result.fixed
    assert "    plain = (Plain(net, use_orig_params=True) if hybrid else fsdp_bridge.shard(" in result.fixed
    assert result.fixed.count(".eval()") == 1
    compile(result.fixed, "train.py", "exec")
    assert migrate_source(result.fixed, "train.py").fixed == result.fixed
    # --target torch: the call of settings known at run time stays on the bridge (its TODO, as anywhere), the
    # other is torch's fully_shard
    lowered = migrate_source(CHOSEN, "train.py", target="torch")
    assert [f.line for f in lowered.findings if not f.fixable] == [8]
    assert "    ) if dist.is_initialized() else Plain(\n" in lowered.fixed
    assert "    plain = (Plain(net, use_orig_params=True) if hybrid else _fsdp2_helpers.shard_model(" in lowered.fixed
    compile(lowered.fixed, "train.py", "exec")


def test_a_scripts_own_evidence_follows_its_calls_down_when_other_scripts_define_the_same_names(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # main -> validate(model) -> evaluate(model): each script defines both, so only this file's evidence counts,
    # and it must still reach evaluate through validate (a public trainer's evaluate_func lost its rewrite).
    fsdp = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def evaluate(net):\n"
        "    return net.forward(1)\n\n\n"
        "def validate(net):\n"
        "    return evaluate(net)\n\n\n"
        "def main(model):\n"
        "    model = FSDP(model)\n"
        "    return validate(model)\n"
    )
    (tmp_path / "a.py").write_text(fsdp)
    (tmp_path / "b.py").write_text(fsdp.replace("    model = FSDP(model)\n", ""))
    migrate_paths([tmp_path], fix=True)
    assert "    return net(1)\n" in (tmp_path / "a.py").read_text()
    assert "    return net.forward(1)\n" in (tmp_path / "b.py").read_text()


def test_fsdp1s_class_imported_from_a_file_of_the_tree_is_fsdp1s_there_too(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # utils/distributed.py imports FSDP1's class and wraps with it; the trainer imports the class from there (not
    # from torch) and calls FSDP.state_dict_type / optim_state_dict / optim_state_dict_to_load on the models the
    # factory made: FSDP1's own API (left as it was, they would fail on FSDP2 models), migrated as in a file that
    # imports the class from torch
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "__init__.py").write_text("")
    (tmp_path / "utils" / "distributed.py").write_text(
        "from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType\n\n\n"
        "def fsdp_wrap(module):\n    return FSDP(module)\n"
    )
    (tmp_path / "train.py").write_text(
        "import torch\n"
        "from utils.distributed import fsdp_wrap, FSDP\n"
        "from torch.distributed.fsdp import StateDictType, FullStateDictConfig, FullOptimStateDictConfig\n\n\n"
        "class Trainer:\n"
        "    def __init__(self, model, opt, raw):\n"
        "        self.model = model\n"
        "        self.model.generator.load_state_dict(raw['plain'])\n"
        "        self.model.generator = fsdp_wrap(self.model.generator)\n"
        "        self.opt = opt\n"
        "        self.model.generator.load_state_dict(raw['model'], strict=True)\n"
        "        self.opt.load_state_dict(FSDP.optim_state_dict_to_load(self.model.generator, self.opt, raw['opt']))\n\n"
        "    def save(self):\n"
        "        with FSDP.state_dict_type(\n"
        "            self.model.generator,\n"
        "            StateDictType.FULL_STATE_DICT,\n"
        "            FullStateDictConfig(rank0_only=True, offload_to_cpu=True),\n"
        "            FullOptimStateDictConfig(rank0_only=True, offload_to_cpu=True),\n"
        "        ):\n"
        "            sd = self.model.generator.state_dict()\n"
        "            osd = FSDP.optim_state_dict(self.model.generator, self.opt)\n"
        "        torch.save({'model': sd, 'opt': osd}, 'x.pt')\n"
    )
    report, _ = migrate_paths([tmp_path], fix=True)
    fixed = (tmp_path / "train.py").read_text()
    assert "FSDP." not in fixed and all(f.fixable for f in report.findings)
    # the load before the wrap is the plain module's; the one after takes FSDP1's full state dict
    assert "        self.model.generator.load_state_dict(raw['plain'])\n" in fixed
    assert (
        "set_model_state_dict(self.model.generator, raw['model'], options=StateDictOptions(full_state_dict=True"
        in fixed
    )
    assert "set_optimizer_state_dict(self.model.generator, self.opt, raw['opt'], options=" in fixed
    assert "sd = get_model_state_dict(self.model.generator, options=StateDictOptions(full_state_dict=True" in fixed
    assert "osd = get_optimizer_state_dict(self.model.generator, self.opt, options=" in fixed
    (note,) = [f for f in report.findings if f.note and "imports FSDP from this module" in f.replacement]
    assert "its uses there are migrated as FSDP1's class" in note.replacement
    migrate_paths([tmp_path], fix=True)
    assert (tmp_path / "train.py").read_text() == fixed


def test_an_attribute_set_from_a_parameter_annotated_with_fsdp1s_class_is_its_wrapper_on_some_path() -> None:
    # ``self.optimizer, self.model = optimizer, model`` in __init__ with ``model: Union[nn.Module, FSDP]``: the
    # class's clip under ``if self.zero:`` is FSDP1's wrapper's there (the tree's FSDP(...) becomes the bridge's,
    # whose models have no clip_grad_norm_ of their own): fsdp_bridge.clip_grad_norm_, which takes any module
    code = (
        "from typing import Union\n"
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "class AmpOptimizer:\n"
        "    def __init__(self, optimizer, model_maybe_fsdp: Union[torch.nn.Module, FSDP], zero: bool):\n"
        "        self.optimizer, self.model_maybe_fsdp = optimizer, model_maybe_fsdp\n"
        "        self.zero = zero\n\n"
        "    def step(self, c):\n"
        "        if self.zero:\n"
        "            return self.model_maybe_fsdp.clip_grad_norm_(c)\n"
        "        return torch.nn.utils.clip_grad_norm_(self.model_maybe_fsdp.parameters(), c)\n"
    )
    result = migrate_source(code, "amp_opt.py")
    assert "            return fsdp_bridge.clip_grad_norm_(self.model_maybe_fsdp, c)\n" in result.fixed
    assert all(f.fixable for f in result.findings)
    # not annotated: nothing shows it (a TODO, as before)
    plain = migrate_source(code.replace(": Union[torch.nn.Module, FSDP]", ""), "amp_opt.py")
    assert "self.model_maybe_fsdp.clip_grad_norm_(c)" in plain.fixed and "TODO(fsdp-bridge)" in plain.fixed


def test_fsdp1s_class_read_off_a_module_of_the_tree_is_fsdp1s(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # ``from ..optim import fsdp`` and ``isinstance(model, fsdp.FSDP)`` / ``List[fsdp.FSDP]``, fsdp.py importing the
    # class from torch: FSDP1's class there too (the test and the annotation were not reported)
    (tmp_path / "pkg" / "optim").mkdir(parents=True)
    (tmp_path / "pkg" / "solvers").mkdir()
    for init in ("pkg", "pkg/optim", "pkg/solvers"):
        (tmp_path / init / "__init__.py").write_text("")
    (tmp_path / "pkg" / "optim" / "fsdp.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\ndef wrap(m):\n    return FSDP(m)\n"
    )
    (tmp_path / "pkg" / "solvers" / "base.py").write_text(
        "import typing as tp\nfrom ..optim import fsdp\n\n\nclass Solver:\n    def __init__(self):\n"
        "        self.units: tp.List[fsdp.FSDP] = []\n\n    def register(self, model):\n"
        "        if isinstance(model, fsdp.FSDP):\n            self.units.append(model)\n"
    )
    report, _ = migrate_paths([tmp_path], fix=True)
    base = (tmp_path / "pkg" / "solvers" / "base.py").read_text()
    assert "self.units: tp.List[fsdp_bridge.ShardedModule] = []" in base
    assert "        if fsdp_bridge.is_sharded(model):\n" in base and all(f.fixable for f in report.findings)
