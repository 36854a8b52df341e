"""What ``migrate code --fix`` writes for state dicts, summon, constructor arguments and wrap policies:
FSDP1's meaning kept, or a TODO saying why (one-process tests of ``migrate_source``)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from fsdp_bridge.migrate._code import TODO, migrate_paths, migrate_source

FIXTURES = Path(__file__).parent / "fixtures" / "migrate" / "precision"


def _fix(name: str) -> str:
    path = FIXTURES / name
    fixed = migrate_source(path.read_text(), str(path)).fixed
    compile(fixed, str(path), "exec")
    assert migrate_source(fixed, str(path)).fixed == fixed  # idempotent
    return fixed


def _between(code: str, start: str, end: str | None = None) -> str:
    tail = code[code.index(start) :]
    return tail if end is None else tail[: tail.index(end)]


def test_backward_prefetch_none_keeps_fsdp1_meaning_without_todo() -> None:
    fixed = _fix("prefetch_none.py")
    static = _between(fixed, "def build_plain", "def build_post")
    assert 'backward_prefetch="none"' in static and TODO not in static
    runtime = _between(fixed, "def build_runtime")
    assert 'backward_prefetch="none"' in runtime and TODO not in runtime
    post = _between(fixed, "def build_post", "def build_runtime")
    assert 'backward_prefetch="pre"' in post and TODO in post  # BACKWARD_POST has no FSDP2 order
    assert "refused on FSDP2" not in "\n".join(
        f.replacement for f in migrate_source((FIXTURES / "prefetch_none.py").read_text()).findings
    )


def test_a_policy_still_used_elsewhere_keeps_its_assignment_and_imports() -> None:
    fixed = _fix("policy_still_used.py")
    assert 'wrap={"min_num_params": 2048}' in fixed
    assert "LAYER_POLICY = functools.partial(size_based_auto_wrap_policy, min_num_params=2048)" in fixed
    assert "import functools" in fixed and "import size_based_auto_wrap_policy" in fixed
    namespace: dict[str, object] = {}
    exec(compile(fixed, "policy_still_used.py", "exec"), namespace)
    assert callable(namespace["settings"]().__getitem__("wrap"))  # type: ignore[operator]


def test_a_module_level_policy_imported_by_another_file_is_kept(tmp_path: Path) -> None:
    (tmp_path / "shared_cfg.py").write_text(
        "import functools\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy\n\n"
        "BLOCK_POLICY = functools.partial(size_based_auto_wrap_policy, min_num_params=64)\n\n\n"
        "def make(net):\n"
        "    return FSDP(net, auto_wrap_policy=BLOCK_POLICY)\n"
    )
    (tmp_path / "consumer.py").write_text("from shared_cfg import BLOCK_POLICY\n\nprint(BLOCK_POLICY)\n")
    by_path = {Path(r.path).name: r for r in migrate_paths([tmp_path])[1]}
    fixed = by_path["shared_cfg.py"].fixed
    assert "BLOCK_POLICY = functools.partial(" in fixed and "fsdp_bridge.shard(" in fixed
    assert "import size_based_auto_wrap_policy" in fixed


def test_an_fsdp2_name_imported_for_another_file_is_kept(tmp_path: Path) -> None:
    # sharding_helpers.py imports FSDP2's policy only for others (``from sharding_helpers import ...``): it
    # was never used here, so the rewrite of the FSDP1 call must not take it away (an ImportError there).
    (tmp_path / "sharding_helpers.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.distributed.fsdp import MixedPrecisionPolicy, ShardingStrategy\n\n\n"
        "def wrap_block(block):\n"
        "    return FSDP(block)\n"
    )
    (tmp_path / "runner.py").write_text("from sharding_helpers import MixedPrecisionPolicy, wrap_block\n")
    by_path = {Path(r.path).name: r for r in migrate_paths([tmp_path])[1]}
    fixed = by_path["sharding_helpers.py"].fixed
    assert "fsdp_bridge.shard(block" in fixed and "FullyShardedDataParallel" not in fixed
    assert "MixedPrecisionPolicy" in fixed  # imported by runner.py
    assert "ShardingStrategy" not in fixed  # an FSDP1 name no code uses: removed as before
    namespace: dict[str, object] = {}
    exec(compile(fixed, "sharding_helpers.py", "exec"), namespace)
    assert "MixedPrecisionPolicy" in namespace


def test_summon_with_parameters_held_across_it_gets_a_todo_not_a_rewrite() -> None:
    fixed = _fix("summon_held_params.py")
    # held: the context's model's own parameters, those of a module inside it, or of the model around it
    for held in ("def export_weights", "def export_named", "def export_inner", "def export_outer"):
        body = _between(fixed, held, "\ndef ")
        assert "with FSDP.summon_full_params(" in body
        assert TODO in body and "FSDP2 keeps no parameter identity" in body
    # parameters of another model (local.averaged vs sharded.averaged): the context does not touch them
    for fresh, model in (
        ("export_fresh", "model"),
        ("export_counted", "model"),
        ("compare_replicas", "sharded.averaged"),
    ):
        body = _between(fixed, f"def {fresh}")
        body = body[: body.index("\ndef ")] if "\ndef " in body else body
        assert f"with fsdp_bridge.summon_full_params({model}, writeback=True):" in body and TODO not in body


def test_a_second_fsdp1_root_keeps_fsdp1_full_state_dicts() -> None:
    fixed = _fix("ema_state.py")
    full = "options=StateDictOptions(full_state_dict=True)"
    # made by a partial(FSDP, ...) wrapper; inside the context made for another model (which covers that one only)
    assert f"teacher_weights = get_model_state_dict(self.teacher, {full})" in fixed
    assert "weights = self.student.state_dict()" in fixed  # its own context: fsdp_bridge.state_dict_type
    # made by a function of this file that returns FSDP(...)
    assert f'"s": get_model_state_dict(self.shadow, {full})' in fixed
    assert f'set_model_state_dict(self.teacher, blob["t"], {full})' in fixed
    assert f'set_model_state_dict(self.shadow, blob["s"], {full})' in fixed


SUBCLASS_SAVE = """
import torch
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class Runner:
    def wrap(self):
        self.pair.encoder = FSDP(self.pair.encoder)
        self.pair.scorer = FSDP(self.pair.scorer)


class ScoringRunner(Runner):
    def save(self, path):
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(self.pair.encoder, StateDictType.FULL_STATE_DICT, state_dict_config=cfg):
            enc = self.pair.encoder.state_dict()
            scorer = self.pair.scorer.state_dict()
        torch.save((enc, scorer), path)


class RebuiltRunner(Runner):
    def wrap(self):
        self.pair = torch.nn.Module()

    def save(self, path):
        torch.save(self.pair.scorer.state_dict(), path)
"""


def test_a_second_root_made_by_the_base_class_keeps_fsdp1_full_state_dicts() -> None:
    fixed = migrate_source(SUBCLASS_SAVE, "runner.py").fixed
    full = "options=StateDictOptions(full_state_dict=True)"
    # the base class of this file wrapped self.pair.scorer itself: outside its own context it is a full state dict
    assert f"scorer = get_model_state_dict(self.pair.scorer, {full})" in fixed
    # a subclass that binds self.pair itself holds another object: left alone
    assert "torch.save(self.pair.scorer.state_dict(), path)" in fixed
    assert migrate_source(fixed, "runner.py").fixed == fixed


HANDED_SHADOW = """
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

SAVE_CFG = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)


class Keeper:
    def __init__(self, net, shadow, opt, sched):
        self.net, self.shadow, self.opt, self.sched = net, shadow, opt, sched

    def dump(self, path, reader):
        with FSDP.state_dict_type(self.net, StateDictType.FULL_STATE_DICT, SAVE_CFG):
            blob = {"net": self.net.state_dict(), "shadow": self.shadow.state_dict()}
            blob["opt"] = self.opt.state_dict()
            blob["sched"] = self.sched.state_dict()
            dcp.load_state_dict(blob, reader)
        torch.save(blob, path)

    def undump(self, blob):
        with FSDP.state_dict_type(self.net, StateDictType.FULL_STATE_DICT, SAVE_CFG):
            self.net.load_state_dict(blob["net"])
            self.shadow.load_state_dict(blob["shadow"], strict=False)
"""


def test_another_root_in_a_state_dict_block_keeps_fsdp1_full_state_dicts_once_fsdp2() -> None:
    fixed = migrate_source(HANDED_SHADOW, "keeper.py").fixed
    compile(fixed, "keeper.py", "exec")
    full = "options=StateDictOptions(full_state_dict=True)"
    # the context covers self.net only: self.shadow (wrapped elsewhere, maybe) kept FSDP1's default full state
    assert (
        f'"shadow": (get_model_state_dict(self.shadow, {full}) if isinstance(self.shadow, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in self.shadow.modules()) '
        "else self.shadow.state_dict())" in fixed
    )
    assert (
        '(set_model_state_dict(self.shadow, blob["shadow"], options=StateDictOptions(full_state_dict=True, '
        'strict=False)) if isinstance(self.shadow, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in self.shadow.modules()) else self.shadow.load_state_dict(blob["shadow"], '
        "strict=False))" in fixed
    )
    assert "dcp.load_state_dict(blob, reader)" in fixed and "isinstance(dcp" not in fixed  # a module's function
    assert 'blob["opt"] = self.opt.state_dict()' in fixed and 'blob["sched"] = self.sched.state_dict()' in fixed
    assert "from torch.distributed.fsdp import FSDPModule" in fixed and TODO not in fixed
    assert migrate_source(fixed, "keeper.py").fixed == fixed
    # a file that also uses FSDP2 cannot tell an FSDP1 root from an FSDP2 module: a TODO, code kept
    dual = migrate_source("from torch.distributed.fsdp import fully_shard\n" + HANDED_SHADOW, "keeper.py").fixed
    assert '"shadow": self.shadow.state_dict()' in dual and "get_model_state_dict(self.shadow" not in dual
    assert TODO in dual and "may be an FSDP1 root" in dual


NEGATED_GUARD = """
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class Holder:
    def __init__(self, net):
        self.net = FSDP(net)

    def inner(self):
        if not isinstance(self.net, FSDP):
            return self.net.module
        return self.net

    def weights(self):
        if not isinstance(self.net, FSDP):
            return self.net.state_dict()
        return self.net.state_dict()
"""


def test_a_state_dict_guarded_by_not_isinstance_fsdp_keeps_the_other_modules_path() -> None:
    fixed = migrate_source(NEGATED_GUARD, "holder.py").fixed
    full = "options=StateDictOptions(full_state_dict=True)"
    # the guarded branch runs for DDP, torch's own fully_shard modules and plain ones: their own state_dict stays
    guarded = _between(fixed, "def weights", "\n        return")
    assert "return self.net.state_dict()" in guarded and "get_model_state_dict" not in guarded
    assert "return self.net.module" in _between(fixed, "def inner", "def weights")  # DDP's wrapped module
    # past the guard only FSDP1's wrapper arrives: its default full state dict
    assert fixed.rstrip().endswith(f"return get_model_state_dict(self.net, {full})")


def test_a_persistent_sharded_type_keeps_later_state_calls_sharded() -> None:
    fixed = _fix("persistent_sharded.py")
    saved = _between(fixed, "def save_sharded", "def optimizer_state_of")
    assert "set_state_dict_type" not in saved
    assert '"model": get_model_state_dict(model, options=StateDictOptions())' in saved
    # the optimizer's shards on the CPU: FSDP1's default ShardedOptimStateDictConfig(offload_to_cpu=True)
    assert '"opt": get_optimizer_state_dict(model, opt, options=StateDictOptions(cpu_offload=True))' in saved
    # another function: the type is set at run time, so no guess
    elsewhere = _between(fixed, "def optimizer_state_of", "def weights_of")
    assert TODO in elsewhere and "return FSDP.optim_state_dict(model, opt)" in elsewhere
    weights = _between(fixed, "def weights_of", "def fresh_full")
    assert TODO in weights and "return model.state_dict()" in weights
    # a model made here whose type was never set: FSDP1's default, full
    fresh = _between(fixed, "def fresh_full")
    assert "fsdp_bridge.full_optim_state_dict(model, opt, rank0_only=False, offload_to_cpu=True)" in fresh
    assert TODO not in fresh


LOAD_BEFORE_WRAP = """\
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def wrap_net(net):
    return FSDP(
        net,
        # process_group=groups.data_parallel(),
        use_orig_params=True,
    )


def run(net, weights, out):
    if dist.get_rank() == 0:
        net.load_state_dict(torch.load(weights), strict=True)
    net = wrap_net(net)
    net.clip_grad_norm_(1.0)
    cfg = FullStateDictConfig(rank0_only=True, offload_to_cpu=True)
    with FSDP.state_dict_type(net, StateDictType.FULL_STATE_DICT, cfg):
        sd = net.state_dict()
    torch.save(sd, out)
"""


def test_a_load_into_the_plain_module_before_it_is_wrapped_is_left_alone() -> None:
    # The clip after ``net = wrap_net(net)`` is on the new object: no evidence about the load above it.
    result = migrate_source(LOAD_BEFORE_WRAP, "load_before_wrap.py")
    fixed = result.fixed
    compile(fixed, "load_before_wrap.py", "exec")
    assert "        net.load_state_dict(torch.load(weights), strict=True)\n" in fixed
    assert not any(f.line == 18 for f in result.findings)
    assert "fsdp_bridge.clip_grad_norm_(net, 1.0)" in fixed
    assert migrate_source(fixed, "load_before_wrap.py").fixed == fixed


def test_a_process_group_in_a_comment_is_not_a_model_parallel_layout() -> None:
    # Only a real ``process_group=`` argument means FSDP over some ranks; a commented-out one is not.
    fixed = migrate_source(LOAD_BEFORE_WRAP, "load_before_wrap.py").fixed
    assert "get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))" in fixed
    assert "fsdp_bridge.full_state_dict" not in fixed


def test_todos_naming_another_file_do_not_depend_on_the_directory_given(tmp_path: Path) -> None:
    # A TODO names the file that sets the state-dict type relative to the directory scanned: the same tree
    # scanned as ``a/tree`` and as ``b/c/tree`` gets the same comments, so a second --fix from elsewhere adds none.
    outputs = []
    for where in ("a/tree", "b/c/tree"):
        root = tmp_path / where
        (root / "ckpt").mkdir(parents=True)
        (root / "ckpt" / "setter.py").write_text(
            "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
            "from torch.distributed.fsdp import StateDictType\n\n\n"
            "def use_sharded(net):\n"
            "    FSDP.set_state_dict_type(net, StateDictType.SHARDED_STATE_DICT)\n"
        )
        (root / "optim_io.py").write_text(
            "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
            "def optim_state(net, opt):\n"
            "    return FSDP.optim_state_dict(net, opt)\n"
        )
        by_path = {Path(r.path).name: r for r in migrate_paths([root])[1]}
        outputs.append(by_path["optim_io.py"].fixed)
    assert "ckpt/setter.py calls FSDP.set_state_dict_type" in outputs[0]
    assert outputs[0] == outputs[1]


def test_a_todo_naming_a_call_the_first_fix_deleted_reads_the_same_after_a_second_fix(tmp_path: Path) -> None:
    # --fix deletes a SHARDED_STATE_DICT set_state_dict_type (FSDP2's state_dict() is sharded already). A TODO in
    # another file named that call's file; a second --fix no longer saw the call, named another file that still
    # calls it (a LOCAL one, kept), or none, and rewrote the comment: the output was not idempotent.
    (tmp_path / "a_sharded.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.distributed.fsdp import StateDictType\n\n\n"
        "def use_sharded(net):\n"
        "    FSDP.set_state_dict_type(net, StateDictType.SHARDED_STATE_DICT)\n"
    )
    (tmp_path / "b_local.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.distributed.fsdp import StateDictType\n\n\n"
        "def use_local(net):\n"
        "    FSDP.set_state_dict_type(net, StateDictType.LOCAL_STATE_DICT)\n"
    )
    (tmp_path / "optim_io.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def optim_state(net, opt):\n"
        "    return FSDP.optim_state_dict(net, opt)\n"
    )
    migrate_paths([tmp_path], fix=True)
    first = {p.name: p.read_text() for p in tmp_path.glob("*.py")}
    assert "set_state_dict_type" not in first["a_sharded.py"]  # deleted
    assert "a_sharded.py calls FSDP.set_state_dict_type" in first["optim_io.py"]
    migrate_paths([tmp_path], fix=True)
    assert {p.name: p.read_text() for p in tmp_path.glob("*.py")} == first


def test_a_full_state_whose_config_is_known_at_run_time_keeps_fsdp1s_offload_and_rank0_only() -> None:
    # torch's options cannot give every rank a CPU copy (offload_to_cpu=True, rank0_only=False): the model's
    # state goes through fsdp_bridge.full_state_dict with the config's own flags, never a device-side copy.
    code = textwrap.dedent(
        """
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, FullStateDictConfig, StateDictType

        def keep(module, rank0_only=False):
            cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only)
            with FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT, cfg):
                return module.state_dict()

        def save(module, flag):
            with FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=flag)):
                sd = module.state_dict()
            torch.save(sd, "m.pt")
        """
    )
    fixed = migrate_source(code, "keep.py").fixed
    assert (
        "return fsdp_bridge.full_state_dict(module, rank0_only=cfg.rank0_only, offload_to_cpu=cfg.offload_to_cpu)"
        in fixed
    )
    assert "sd = fsdp_bridge.full_state_dict(module, rank0_only=False, offload_to_cpu=flag)" in fixed
    assert "get_model_state_dict" not in fixed and migrate_source(fixed, "keep.py").fixed == fixed

    # the optimizer's config bound twice in the function (its flags read when the code runs): the report says so,
    # not FSDP1's default (every rank a copy), and names no other call
    optim = textwrap.dedent(
        """\
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, FullOptimStateDictConfig, StateDictType

        def save(policy, optimizer):
            save_policy = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)
            save_policy = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
            with FSDP.state_dict_type(policy, StateDictType.FULL_STATE_DICT, optim_state_dict_config=save_policy):
                osd = FSDP.optim_state_dict(policy, optimizer)
            torch.save(osd, "o.pt")
        """
    )
    result = migrate_source(optim, "optim.py")
    assert "rank0_only=save_policy.rank0_only, offload_to_cpu=save_policy.offload_to_cpu)" in result.fixed
    (block,) = [f for f in result.findings if f.construct.startswith("FSDP.state_dict_type")]
    assert "its config's rank0_only and offload_to_cpu as FSDP1 reads them when the code runs" in block.replacement
    assert "every rank a CPU copy" not in block.replacement and "other calls" not in block.replacement


def test_only_a_real_set_state_dict_type_call_counts_and_the_files_own_is_named(tmp_path: Path) -> None:
    # A docstring or comment that mentions FSDP.set_state_dict_type sets nothing: no TODO comes from it. A file
    # that calls it is named by its own TODO ("this file"), not the first file of the tree mentioning the name.
    (tmp_path / "a_saver.py").write_text(
        "def save(net, path):\n"
        '    """Pick the state dict type first with `FSDP.set_state_dict_type(net, ...)`."""\n'
        "    # FSDP.set_state_dict_type(net, StateDictType.SHARDED_STATE_DICT) before calling this\n"
        "    return path\n"
    )
    body = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.distributed.fsdp import StateDictType\n\n\n"
        "def optim_state(net, opt):\n"
        "    return FSDP.optim_state_dict(net, opt)\n"
    )
    (tmp_path / "optim_io.py").write_text(body)
    by_path = {Path(r.path).name: r for r in migrate_paths([tmp_path])[1]}
    fixed = by_path["optim_io.py"].fixed
    assert "set_state_dict_type" not in fixed and TODO not in fixed
    assert "fsdp_bridge.full_optim_state_dict(net, opt" in fixed
    (tmp_path / "optim_io.py").write_text(
        body + "\n\ndef use_sharded(net):\n    FSDP.set_state_dict_type(net, StateDictType.SHARDED_STATE_DICT)\n"
    )
    by_path = {Path(r.path).name: r for r in migrate_paths([tmp_path])[1]}
    fixed = by_path["optim_io.py"].fixed
    assert "this file calls FSDP.set_state_dict_type" in fixed and "a_saver.py" not in fixed


RUNTIME_TYPE = """\
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def prepare(net, kind, cfg, optim_cfg):
    model = FSDP(net)
    if kind:
        FSDP.set_state_dict_type(model, kind, cfg, optim_cfg)
    return model


def prepare_own(model: FSDP, settings):
    model.set_state_dict_type(model, settings.kind, settings.cfg)
    return model


class OptimizerState:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        return FSDP.optim_state_dict(self.model, self.optimizer)

    def load_state_dict(self, sd):
        self.optimizer.load_state_dict(FSDP.optim_state_dict_to_load(self.model, self.optimizer, sd))
"""

LOCAL_BESIDE = """
def save_local(model: FSDP, path):
    FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)
    try:
        pass
    finally:
        FSDP.set_state_dict_type(model, StateDictType.LOCAL_STATE_DICT)
"""


def test_a_type_set_at_run_time_is_followed_by_the_bridge_calls() -> None:
    result = migrate_source(RUNTIME_TYPE, "runtime.py")
    fixed = result.fixed
    assert migrate_source(fixed, "runtime.py").fixed == fixed  # idempotent
    assert "fsdp_bridge.set_state_dict_type(model, kind, cfg, optim_cfg)" in fixed
    assert "fsdp_bridge.set_state_dict_type(model, settings.kind, settings.cfg)" in fixed  # the model's own spelling
    assert "return fsdp_bridge.optim_state_dict(self.model, self.optimizer)" in fixed
    assert "fsdp_bridge.optim_state_dict_to_load(self.model, self.optimizer, sd)" in fixed
    assert TODO not in fixed and "FSDP.set_state_dict_type" not in fixed
    line = next(f for f in result.findings if f.construct == "FSDP.optim_state_dict(...)")
    assert line.fixable and "follows fsdp_bridge.set_state_dict_type at run time" in line.replacement
    assert "LOCAL_STATE_DICT refused on FSDP2" in line.replacement


def test_the_models_own_spelling_is_rewritten_only_on_a_model_shown_to_be_fsdp1s() -> None:
    # x.set_state_dict_type(x, ...) is FSDP1's static method only when x is FSDP1's wrapper: an unannotated
    # parameter may be anything, so its call stays with a TODO that says what to write.
    code = RUNTIME_TYPE.replace("def prepare_own(model: FSDP, settings):", "def prepare_own(model, settings):")
    result = migrate_source(code, "runtime.py")
    fixed = result.fixed
    assert "fsdp_bridge.set_state_dict_type(model, kind, cfg, optim_cfg)" in fixed  # the class's spelling
    assert "    model.set_state_dict_type(model, settings.kind, settings.cfg)" in fixed
    todo = next(f for f in result.findings if f.construct == "model.set_state_dict_type(model, ...)")
    assert not todo.fixable and "nothing here shows model is FSDP1's wrapper" in todo.replacement
    assert "write fsdp_bridge.set_state_dict_type(model, ...)" in todo.replacement
    assert migrate_source(fixed, "runtime.py").fixed == fixed  # idempotent


def test_a_tree_with_its_own_set_state_dict_type_keeps_the_models_spelling_and_what_follows_it(
    tmp_path: Path,
) -> None:
    # A subclass of the wrapper overriding set_state_dict_type (in another file of the tree): a model's
    # x.set_state_dict_type(x, ...) may reach that override, so it is not rewritten, even on a model shown to
    # be FSDP1's, and the optimizer-state calls that would follow fsdp_bridge's type stay FSDP1's too.
    (tmp_path / "wrappers.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel\n\n\n"
        "class LoggedFSDP(FullyShardedDataParallel):\n"
        "    @staticmethod\n"
        "    def set_state_dict_type(module, kind, cfg=None, optim_cfg=None):\n"
        "        print('state dict type', kind)\n"
        "        return FullyShardedDataParallel.set_state_dict_type(module, kind, cfg, optim_cfg)\n"
    )
    (tmp_path / "runtime.py").write_text(
        RUNTIME_TYPE.replace("    if kind:\n        FSDP.set_state_dict_type(model, kind, cfg, optim_cfg)\n", "")
    )
    report, _ = migrate_paths([str(tmp_path)], fix=True)
    fixed = (tmp_path / "runtime.py").read_text()
    assert "    model.set_state_dict_type(model, settings.kind, settings.cfg)" in fixed
    assert "this tree defines its own set_state_dict_type (in wrappers.py)" in fixed, fixed
    assert (
        "fsdp_bridge.set_state_dict_type(model, settings" not in fixed and "fsdp_bridge.optim_state_dict" not in fixed
    )
    assert "return FSDP.optim_state_dict(self.model, self.optimizer)" in fixed
    # the load reads the state as the type set at run time says (full or sharded): not rewritten as full
    assert "self.optimizer.load_state_dict(FSDP.optim_state_dict_to_load(self.model, self.optimizer, sd))" in fixed
    assert "set_optimizer_state_dict" not in fixed.replace("load it with set_optimizer_state_dict", "")
    assert not any(f.fixable for f in report.findings if "set_state_dict_type" in f.construct)


def test_a_local_type_beside_keeps_every_set_and_the_calls_that_follow_them_todo() -> None:
    code = RUNTIME_TYPE.replace("import torch\n", "import torch\nfrom torch.distributed.fsdp import StateDictType\n")
    fixed = migrate_source(code + LOCAL_BESIDE, "beside.py").fixed
    assert "fsdp_bridge.set_state_dict_type" not in fixed and "fsdp_bridge.optim_state_dict(" not in fixed
    assert "FSDP.set_state_dict_type(model, kind, cfg, optim_cfg)" in fixed
    assert "FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)" in fixed  # not half of the pair
    assert "return FSDP.optim_state_dict(self.model, self.optimizer)" in fixed
    assert fixed.count(TODO) >= 3


def test_target_torch_keeps_the_persistent_type_as_a_reported_bridge_call() -> None:
    result = migrate_source(RUNTIME_TYPE, "runtime.py", target="torch")
    assert "fsdp_bridge.set_state_dict_type(model, kind, cfg, optim_cfg)" in result.fixed
    kept = [f for f in result.findings if "set_state_dict_type" in f.construct and not f.fixable]
    assert kept and "plain torch has no persistent state-dict type" in kept[0].replacement


FLAGS_FROM_THE_COMMAND_LINE = """\
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def wrap_net(net, opts):
    return FSDP(
        net,
        limit_all_gathers=opts.throttle,  # an argparse int, 0 or 1
        forward_prefetch=opts.prefetch,
        sync_module_states=True,
        device_id=torch.device("cpu"),
    )
"""


def test_flags_fsdp1_reads_as_truths_keep_that_meaning() -> None:
    import argparse
    import re

    import torch

    import fsdp_bridge

    fixed = migrate_source(FLAGS_FROM_THE_COMMAND_LINE, "flags.py").fixed
    assert "limit_all_gathers=bool(opts.throttle)" in fixed
    assert "forward_prefetch=bool(opts.prefetch)" in fixed
    assert "sync_module_states=True," in fixed  # a literal stays as written
    assert migrate_source(fixed, "flags.py").fixed == fixed
    config = fixed[fixed.index("fsdp_bridge.BridgeConfig(") :]
    config = config[: config.index("\n        ),") + len("\n        )")]
    config = re.sub(r"#[^\n]*", "", config)
    # FSDP1 takes 1 as True and 2 as True (not a prefetch depth); both must build the config FSDP1 meant
    opts = argparse.Namespace(throttle=1, prefetch=2)
    built = eval(config, {"fsdp_bridge": fsdp_bridge, "torch": torch, "opts": opts})
    assert built.limit_all_gathers is True and built.forward_prefetch is True and built.sync_module_states is True


def test_optimizer_state_in_a_group_full_block_keeps_fsdp1s_cpu_offload_default() -> None:
    """In a FULL_STATE_DICT block, FSDP1's optimizer config defaults to FullOptimStateDictConfig(), whose
    offload_to_cpu is True (unlike FullStateDictConfig's): the full optimizer state lands on the CPU."""
    from fsdp_bridge.migrate._analysis import Dispatch

    code = textwrap.dedent(
        """
        import torch
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


        def export(net, opt, path):
            with FSDP.state_dict_type(net, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
                torch.save({"net": net.state_dict(), "opt": FSDP.optim_state_dict(net, opt)}, path)


        def export_rank0(net, opt, path):
            with FSDP.state_dict_type(
                net, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True),
                FullOptimStateDictConfig(rank0_only=True),
            ):
                torch.save({"net": net.state_dict(), "opt": FSDP.optim_state_dict(net, opt)}, path)
        """
    )
    fixed = migrate_source(code, "/srv/t/export.py", dispatch=Dispatch(group_fsdp="/srv/t/train.py")).fixed
    assert TODO not in fixed, fixed
    assert "fsdp_bridge.full_optim_state_dict(net, opt, rank0_only=False, offload_to_cpu=True)" in fixed, fixed
    assert "fsdp_bridge.full_optim_state_dict(net, opt, rank0_only=True, offload_to_cpu=True)" in fixed, fixed
    assert fixed.count("fsdp_bridge.full_state_dict(net, rank0_only=True, offload_to_cpu=False)") == 2, fixed


def test_optimizer_state_in_a_sharded_block_keeps_fsdp1s_cpu_offload_default() -> None:
    """ShardedOptimStateDictConfig's offload_to_cpu defaults to True (ShardedStateDictConfig's to False)."""
    code = textwrap.dedent(
        """
        import torch
        from torch.distributed.fsdp import StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


        def export(net, opt, path):
            net = FSDP(net)
            with FSDP.state_dict_type(net, StateDictType.SHARDED_STATE_DICT):
                torch.save({"net": net.state_dict(), "opt": FSDP.optim_state_dict(net, opt)}, path)
        """
    )
    fixed = migrate_source(code, "export.py").fixed
    assert TODO not in fixed, fixed
    assert "get_model_state_dict(net, options=StateDictOptions())" in fixed, fixed
    assert "get_optimizer_state_dict(net, opt, options=StateDictOptions(cpu_offload=True))" in fixed, fixed


def test_a_tree_setting_several_types_makes_every_call_the_bridges_and_keeps_what_follows_them() -> None:
    fixed = _fix("persistent_mixed.py")
    code = "\n".join(line for line in fixed.splitlines() if not line.lstrip().startswith("#"))
    assert "FSDP.set_state_dict_type" not in code and "FullyShardedDataParallel" not in code
    assert code.count("fsdp_bridge.set_state_dict_type(model, ") == 3  # SHARDED too: not deleted here
    saved = _between(fixed, "def save_full", "def restore")
    # made by a function that sets its type, then set FULL above: both calls kept, they follow the setting
    assert "    shards = model.state_dict()\n" in saved and "    torch.save(model.state_dict(), path)\n" in saved
    restored = _between(fixed, "def restore", "def weights_of")
    assert "    model.load_state_dict(state)\n" in restored and TODO not in restored
    assert "return fsdp_bridge.optim_state_dict(model, opt)" in restored
    # nothing shows whether this model's type was set: a TODO naming both outcomes
    weights = _between(fixed, "def weights_of")
    assert TODO in weights and "return model.state_dict()" in weights
    assert "if it is, keep this call; if not, FSDP1 gave a full state dict" in weights
    result = migrate_source((FIXTURES / "persistent_mixed.py").read_text(), "persistent_mixed.py")
    assert [f.line for f in result.findings if not f.fixable] == [37]


GROUP_EMA = """
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def build(net, ema_net, mesh):
    return FSDP(net, device_mesh=mesh), FSDP(ema_net, device_mesh=mesh)


class Trainer:
    def save(self):
        cfg = FullStateDictConfig(rank0_only=True, offload_to_cpu=True)
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT, cfg):
            state = {"model": self.model.state_dict(), "ema": self.ema.state_dict()}
        return state

    def load(self, state, cfg):
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT, cfg):
            self.model.load_state_dict(state["model"])
            self.ema.load_state_dict(state["ema"])
"""


def test_another_roots_state_in_a_block_of_a_tree_sharding_over_a_mesh_keeps_fsdp1s_default() -> None:
    # device_mesh= makes the tree one that shards over some ranks (rank0_only: each group's first rank), and
    # FSDP1's contexts cover the model they are given only: the EMA copy's state dicts stay full ones.
    fixed = migrate_source(GROUP_EMA, "trainer.py").fixed
    assert '"model": fsdp_bridge.full_state_dict(self.model, rank0_only=True, offload_to_cpu=True)' in fixed
    assert (
        '"ema": (get_model_state_dict(self.ema, options=StateDictOptions(full_state_dict=True)) '
        "if isinstance(self.ema, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in self.ema.modules()) else self.ema.state_dict())"
    ) in fixed
    assert (
        '(set_model_state_dict(self.ema, state["ema"], options=StateDictOptions(full_state_dict=True)) '
        'if isinstance(self.ema, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in self.ema.modules()) else self.ema.load_state_dict(state["ema"]))'
    ) in fixed
    assert migrate_source(fixed, "trainer.py").fixed == fixed


def test_a_handed_models_state_dict_inside_its_own_state_dict_type_block_is_the_blocks() -> None:
    # bench(model, ...) is handed an FSDP1 model; its LOCAL block decides the state_dict() in it (one construct,
    # not a second report line for the call as a handed model's default full state dict)
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType\n\n\n"
        "def bench(model, path):\n"
        "    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):\n"
        "        torch.save(model.state_dict(), path)\n\n\n"
        "def main(net, path):\n"
        "    model = FSDP(net)\n"
        "    bench(model, path)\n"
    )
    found = [f.construct for f in migrate_source(code, "bench.py").findings if not f.note]
    assert found == ["FSDP.state_dict_type(LOCAL_STATE_DICT)", "FSDP(...)"]


def test_fsdp1s_legacy_sharded_optimizer_state_stays_on_the_cpu() -> None:
    # FSDP.sharded_optim_state_dict offloads its shards to the CPU (FSDP1's implementation default)
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def save(model, opt):\n    return FSDP.sharded_optim_state_dict(model, opt)\n"
    )
    fixed = migrate_source(code, "legacy.py").fixed
    assert "return get_optimizer_state_dict(model, opt, options=StateDictOptions(cpu_offload=True))" in fixed
    assert TODO not in fixed


def test_optimizer_state_after_a_persistent_sharded_type_follows_its_optimizer_config() -> None:
    # FSDP1's ShardedOptimStateDictConfig() (also when none is given) has offload_to_cpu=True: CPU shards
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType\n"
        "from torch.distributed.fsdp import ShardedOptimStateDictConfig as OptCfg\n\n\n"
        "def save(net, opt):\n"
        "    model = FSDP(net)\n"
        "    FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)\n"
        "    a = FSDP.optim_state_dict(model, opt)\n"
        "    FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT, None, OptCfg(offload_to_cpu=False))\n"
        "    b = FSDP.optim_state_dict(model, opt)\n"
        "    FSDP.set_state_dict_type(\n"
        "        model, StateDictType.SHARDED_STATE_DICT, optim_state_dict_config=OptCfg(offload_to_cpu=True)\n"
        "    )\n"
        "    c = FSDP.optim_state_dict(model, opt)\n"
        "    return a, b, c\n"
    )
    fixed = migrate_source(code, "persistent.py").fixed
    assert "a = get_optimizer_state_dict(model, opt, options=StateDictOptions(cpu_offload=True))" in fixed
    assert "b = get_optimizer_state_dict(model, opt, options=StateDictOptions())" in fixed
    assert "c = get_optimizer_state_dict(model, opt, options=StateDictOptions(cpu_offload=True))" in fixed
    assert "set_state_dict_type" not in fixed and TODO not in fixed and "FSDP" not in fixed
    assert migrate_source(fixed, "persistent.py").fixed == fixed


def test_a_units_own_parameters_changed_in_place_are_not_summoned_without_writeback() -> None:
    # FSDP1's summon_full_params(recurse=False) writes changes back by default; FSDP2's unshard() loses them
    code = textwrap.dedent(
        """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


        def sample(net, prompt):
            model = FSDP(net)
            with FSDP.summon_full_params(model, recurse=False):
                out = model.generate(prompt)
            with FSDP.summon_full_params(model, recurse=False):
                for p in model.parameters():
                    p += 1
            with FSDP.summon_full_params(model, recurse=False):
                model.head.weight.data = model.head.weight.data.half().float()
            with FSDP.summon_full_params(model, recurse=False, writeback=False):
                model.head.weight.zero_()
            with FSDP.summon_full_params(model, recurse=False):
                logits = model(prompt)[:, -1]
                logits.div_(0.7)
            return out
        """
    )
    result = migrate_source(code, "sample.py")
    by_line = {f.line: f for f in result.findings if f.construct == "FSDP.summon_full_params(...)"}
    # nothing written, writeback=False given, a tensor of the block's own scaled in place: rewritten
    assert by_line[7].fixable and by_line[14].fixable and by_line[16].fixable, by_line
    for line, write in ((9, "p"), (12, "model.head.weight.data")):
        assert not by_line[line].fixable and f"changes parameters in place ({write})" in by_line[line].replacement
        assert "summon_full_params(model, writeback=True)" in by_line[line].replacement
    assert result.fixed.count("with fsdp_bridge.summon_full_params(model, recurse=False") == 3
    assert migrate_source(result.fixed, "sample.py").fixed == result.fixed


def test_a_load_conversion_whose_result_is_dropped_says_fsdp1_loaded_nothing() -> None:
    # FSDP.optim_state_dict_to_load(...) as a statement: FSDP1 converts and the result is dropped (nothing loaded);
    # the bridge's call loads it, so the rewrite carries a TODO that says which to keep
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def resume(net, opt, state):\n"
        "    model = FSDP(net)\n"
        "    FSDP.optim_state_dict_to_load(model=model, optim=opt, optim_state_dict=state)\n"
        "    kept = FSDP.optim_state_dict_to_load(model, opt, state)\n"
        "    opt.load_state_dict(kept)\n"
    )
    result = migrate_source(code, "resume.py")
    dropped = [f for f in result.findings if f.construct.endswith("(its result unused)")]
    assert [f.line for f in dropped] == [6] and not dropped[0].fixable
    assert "FSDP1 loaded nothing into the optimizer here" in dropped[0].replacement
    assert "    fsdp_bridge.optim_state_dict_to_load(model, opt, state)\n" in result.fixed
    assert result.fixed.count(TODO) == 1
    assert migrate_source(result.fixed, "resume.py").fixed == result.fixed
    # load_directly=False is FSDP1's default (nothing loaded: the TODO); load_directly=True loads, as the bridge
    for flag, todos in (("False", 1), ("True", 0)):
        given = code.replace("optim_state_dict=state)", f"optim_state_dict=state, load_directly={flag})")
        assert migrate_source(given, "resume.py").fixed.count(TODO) == todos, flag


def test_a_sharded_type_set_with_an_offloading_config_becomes_the_bridges_and_is_followed() -> None:
    # set once at set-up with offload_to_cpu=True (CPU shards), taken in the checkpoint functions: the set becomes
    # fsdp_bridge's (it keeps the configs) and the later calls follow it at run time (were TODOs)
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType\n"
        "from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig\n\n\n"
        "def setup(net):\n"
        "    model = FSDP(net)\n"
        "    FSDP.set_state_dict_type(\n"
        "        model,\n"
        "        StateDictType.SHARDED_STATE_DICT,\n"
        "        state_dict_config=ShardedStateDictConfig(offload_to_cpu=True),\n"
        "        optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=True),\n"
        "    )\n"
        "    return model\n\n\n"
        "def save(model, opt):\n"
        "    return {'model': model.state_dict(), 'optim': FSDP.optim_state_dict(model, opt)}\n\n\n"
        "def load(model, opt, osd):\n"
        "    opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, osd))\n"
    )
    result = migrate_source(code, "ckpt.py")
    assert TODO not in result.fixed, result.fixed
    assert "    fsdp_bridge.set_state_dict_type(\n" in result.fixed
    assert "'optim': fsdp_bridge.optim_state_dict(model, opt)" in result.fixed
    assert "fsdp_bridge.optim_state_dict_to_load(model, opt, osd)" in result.fixed
    assert migrate_source(result.fixed, "ckpt.py").fixed == result.fixed


def test_an_optimizer_loaded_inside_a_state_dict_type_block_is_not_taken_for_a_model() -> None:
    # value.load_state_dict(flat_osd) where value is the optimizer handed to FSDP.optim_state_dict_to_load: the
    # optimizer's own load, not another FSDP1 root's state dict
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType\n\n\n"
        "def load(model, items, kind, osd):\n"
        "    for key, value in items:\n"
        "        if key == 'model':\n"
        "            with FSDP.state_dict_type(value, kind):\n"
        "                sd = value.state_dict()\n"
        "        else:\n"
        "            with FSDP.state_dict_type(model, kind):\n"
        "                flat = FSDP.optim_state_dict_to_load(model, value, osd)\n"
        "                value.load_state_dict(flat)\n"
    )
    result = migrate_source(code, "load.py")
    assert not [f for f in result.findings if f.construct.startswith("value.load_state_dict")]
    assert "    value.load_state_dict(flat)\n" in result.fixed and "FSDPModule" not in result.fixed


def test_an_fsdp1_import_another_file_takes_with_a_star_import_is_kept(tmp_path: Path) -> None:
    # A pipeline module takes FSDP1's class through `from .reduce import *` and tests isinstance(m, FSDP); the
    # rewrites leave reduce.py without a use of it, but removing the import made every step raise NameError there.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "reduce.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.distributed.fsdp import ShardingStrategy\n\n\n"
        "def build(m):\n    return FSDP(m)\n"
    )
    (pkg / "pipe.py").write_text("from .reduce import *\n\n\ndef is_unit(m):\n    return isinstance(m, FSDP)\n")
    (pkg / "named.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.distributed.fsdp import ShardingStrategy\n\n\n"
        "def build(m):\n    return FSDP(m)\n"
    )
    (pkg / "user.py").write_text("from pkg.named import ShardingStrategy\n")
    report, _ = migrate_paths([tmp_path], fix=True)
    reduce = (pkg / "reduce.py").read_text()
    assert "import FullyShardedDataParallel as FSDP\n" in reduce and "fsdp_bridge.shard(m" in reduce
    assert "import ShardingStrategy\n" in reduce
    named = (pkg / "named.py").read_text()
    assert "FullyShardedDataParallel" not in named and "import ShardingStrategy\n" in named  # the name user.py takes
    kept = [f for f in report.findings if f.note and f.replacement.startswith("kept: another file")]
    assert [(Path(f.path).name, f.line) for f in kept] == [("named.py", 2), ("reduce.py", 1), ("reduce.py", 2)]
    migrate_paths([tmp_path], fix=True)
    assert (pkg / "reduce.py").read_text() == reduce


def test_a_unit_iterated_inside_a_models_state_dict_context_is_a_todo() -> None:
    # Inside `with FSDP.state_dict_type(model, FULL, FullStateDictConfig(rank0_only=True, ...))`, a loop over the
    # model's modules saves each FSDP1 unit's state_dict(): the context covers those units (rank 0 only, CPU). The
    # default full state dict written for it gave every rank a GPU copy and had all of them save.
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullStateDictConfig, StateDictType\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def save(model, blocks, path):\n"
        "    cfg = FullStateDictConfig(rank0_only=True, offload_to_cpu=True)\n"
        "    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):\n"
        "        for block in blocks:\n"
        "            for name, m in block.named_modules():\n"
        "                if not isinstance(m, FSDP):\n"
        "                    continue\n"
        "                sd = m.state_dict()\n"
        "                if sd:\n"
        "                    torch.save(sd, path + name)\n"
    )
    result = migrate_source(code, "ckpt.py")
    (todo,) = [f for f in result.findings if not f.fixable]
    assert (todo.line, todo.construct) == (13, "m.state_dict()")
    assert "FSDP1's context sets the type of that model's FSDP units too" in todo.replacement
    assert "                sd = m.state_dict()\n" in result.fixed
    assert migrate_source(result.fixed, "ckpt.py").fixed == result.fixed


def test_the_wrapped_modules_own_state_dict_is_a_todo_outside_a_summon() -> None:
    # FSDP1's wrapped module holds this rank's flat shard: `model.module.state_dict()` saved on rank 0 was never the
    # model's weights, and its rewrite (the module itself on FSDP2) saved DTensor shards instead: a TODO naming the
    # full-state call. Inside summon_full_params the wrapped module holds the full parameters: rewritten.
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def train(net, path, rank):\n"
        "    model = FSDP(net)\n"
        "    if rank == 0:\n"
        "        torch.save(model.module.state_dict(), path)\n"
        "    with FSDP.summon_full_params(model):\n"
        "        return model.module.state_dict()\n"
    )
    result = migrate_source(code, "train.py")
    (todo,) = [f for f in result.findings if not f.fixable]
    assert (todo.line, todo.construct) == (8, "model.module.state_dict() (the wrapped module's own state dict)")
    assert "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))" in (
        todo.replacement
    )
    assert "        torch.save(model.module.state_dict(), path)\n" in result.fixed
    assert "        return fsdp_bridge.unwrapped(model).state_dict()\n" in result.fixed


def test_the_wrapped_modules_state_dict_on_a_model_fsdp1_made_on_one_path_only_is_unwrapped(tmp_path: Path) -> None:
    # `net` comes from the tree's FSDP1 factory on one branch and from another (a DDP loader) on the other; the read
    # sits in the DDP branch of a later test. The flat-shard TODO would be false there: the read is unwrapped, which
    # gives DDP's module on DDP and the module itself on FSDP2.
    lib = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def build_sharded(net):\n"
        "    return FSDP(net)\n"
    )
    code = (
        "import torch\n"
        "from lib import build_sharded\n"
        "from loaders import build_replicated\n\n\n"
        "def main(sharded, make):\n"
        "    if sharded:\n"
        "        net = build_sharded(make())\n"
        "    else:\n"
        "        net = build_replicated(make())\n"
        "    if not sharded:\n"
        "        state = net.module.state_dict()\n"
        "        torch.save(state, 'ema.pt')\n"
    )
    (tmp_path / "lib.py").write_text(lib)
    (tmp_path / "main.py").write_text(code)
    main = {Path(r.path).name: r for r in migrate_paths([tmp_path])[1]}["main.py"]
    assert not [f for f in main.findings if not f.fixable and "own state dict" in f.construct]
    assert "        state = fsdp_bridge.unwrapped(net).state_dict()\n" in main.fixed


def test_a_state_dict_taken_under_a_rank_test_is_a_todo() -> None:
    # A full state dict gathered under `if local_rank == 0:` (FSDP1 got away with it only where a forward just before
    # left its units gathered): on FSDP2 get_model_state_dict is a collective, so the rewrite hung rank 0. The
    # same block taken on every rank and saved under the test is rewritten.
    code = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch.distributed.fsdp import FullStateDictConfig, StateDictType\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def train(net, path, local_rank):\n"
        "    model = FSDP(net)\n"
        "    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)\n"
        "    if local_rank == 0:\n"
        "        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):\n"
        "            sd = model.state_dict()\n"
        "        torch.save(sd, path)\n"
        "    if dist.get_rank() == 0:\n"
        "        torch.save(model.state_dict(), path)\n"
        "    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):\n"
        "        sd = model.state_dict()\n"
        "    if dist.get_rank() == 0:\n"
        "        torch.save(sd, path)\n"
    )
    result = migrate_source(code, "train.py")
    todos = [(f.line, f.construct) for f in result.findings if not f.fixable]
    assert todos == [
        (11, "FSDP.state_dict_type(FULL_STATE_DICT)"),
        (12, "model.state_dict()"),
        (15, "model.state_dict()"),
    ]
    assert all("under `if " in f.replacement for f in result.findings if not f.fixable)
    # the last block: every rank gathers, rank 0 keeps the CPU copy
    assert (
        "    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))\n"
        in result.fixed
    )


def test_a_plain_root_whose_parts_a_function_of_the_tree_wrapped_saves_full_tensors(tmp_path: Path) -> None:
    # build() wraps each child of the model with FSDP1's `wrap` (or assigns a wrapped head) and returns the model
    # itself, plain: FSDP1's units give full tensors to its state_dict(); FSDP2's would give DTensor shards. The
    # guarded full-state form tests every module of it.
    (tmp_path / "units.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.distributed.fsdp.wrap import enable_wrap, wrap\n\n\n"
        "def build(net):\n"
        "    with enable_wrap(wrapper_cls=FSDP):\n"
        "        for name, child in net.named_children():\n"
        "            net.add_module(name, wrap(child))\n"
        "    return net.cpu()\n\n\n"
        "def build_head(net):\n"
        "    net.head = FSDP(net.head)\n"
        "    return net\n"
    )
    (tmp_path / "run.py").write_text(
        "import torch\n"
        "from units import build, build_head\n\n\n"
        "def main(make, other):\n"
        "    model = build(make())\n"
        "    torch.save(model.state_dict(), 'a.pt')\n"
        "    second = build_head(make())\n"
        "    second.load_state_dict(torch.load('a.pt'))\n"
        "    torch.save(other.state_dict(), 'b.pt')\n"
    )
    run = {Path(r.path).name: r for r in migrate_paths([tmp_path])[1]}["run.py"]
    assert (
        "    torch.save((get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) "
        "if isinstance(model, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in model.modules()) else model.state_dict()), 'a.pt')\n"
    ) in run.fixed
    assert "    second.load_state_dict" not in run.fixed and "set_model_state_dict(second, " in run.fixed
    assert "    torch.save(other.state_dict(), 'b.pt')\n" in run.fixed
    assert migrate_source(run.fixed, "run.py").fixed == run.fixed


def test_a_models_state_dict_inside_its_own_summon_is_kept() -> None:
    # Inside summon_full_params(model) the parameters are the full tensors and model.state_dict() gives them on
    # both backends, a local call: kept as written (no rewrite to a gathering call, no rank-test TODO).
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def ema(net, copy, rank):\n"
        "    model = FSDP(net)\n"
        "    if rank == 0:\n"
        "        with FSDP.summon_full_params(model):\n"
        "            copy.load_state_dict(model.state_dict())\n"
        "    return model.state_dict()\n"
    )
    result = migrate_source(code, "ema.py")
    kept = [f for f in result.findings if f.line == 8]
    assert [(f.fixable, f.construct) for f in kept] == [(True, "model.state_dict()")]
    assert kept[0].replacement.startswith("kept as is: inside summon_full_params(model)")
    assert "            copy.load_state_dict(model.state_dict())\n" in result.fixed
    assert "    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))\n" in result.fixed
    assert "TODO" not in result.fixed


def test_an_optimizers_own_load_is_never_taken_for_a_models() -> None:
    # restore(obj) is handed the FSDP1 model by one call of the tree; load_opt(optimizer, sd) sits beside it and
    # is handed an optimizer: its load_state_dict stays the optimizer's (no model-state rewrite, no guard).
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def load_opt(optimizer, sd):\n"
        "    optimizer.load_state_dict(sd)\n\n\n"
        "def restore(obj, sd):\n"
        "    obj.load_state_dict(sd)\n\n\n"
        "def main(net, opt, sd):\n"
        "    model = FSDP(net)\n"
        "    restore(model, sd)\n"
        "    load_opt(model, sd)\n"
    )
    fixed = migrate_source(code, "resume.py").fixed
    assert "    optimizer.load_state_dict(sd)\n" in fixed
    assert "    (set_model_state_dict(obj, sd, options=StateDictOptions(full_state_dict=True)) if isinstance(obj" in (
        fixed
    )


def test_a_compiled_copy_of_the_fsdp1_model_keeps_the_flat_shard_todo() -> None:
    # `net = torch.compile(net)` in a branch after the wrap is still the FSDP1 model: its .module.state_dict()
    # keeps the flat-shard TODO (only another wrapper on another path makes it the unwrap rewrite)
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def main(net, compile_it):\n"
        "    net = FSDP(net)\n"
        "    if compile_it:\n"
        "        net = torch.compile(net)\n"
        "    torch.save(net.module.state_dict(), 'x.pt')\n"
    )
    result = migrate_source(code, "cm.py")
    assert [(f.line, f.construct) for f in result.findings if not f.fixable] == [
        (9, "net.module.state_dict() (the wrapped module's own state dict)")
    ]


def test_a_summon_of_one_unit_does_not_keep_the_state_dict_and_opt_models_are_models() -> None:
    # recurse=False is FSDP2's unshard (its state dict reshards): the model's state_dict() there is rewritten as
    # outside the block. A model named opt_model is a model.
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def main(net, opt_model):\n"
        "    model = FSDP(net)\n"
        "    with FSDP.summon_full_params(model, recurse=False):\n"
        "        own = model.state_dict()\n"
        "    opt_model = FSDP(opt_model)\n"
        "    return own, opt_model.state_dict()\n"
    )
    fixed = migrate_source(code, "units.py").fixed
    assert "        own = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))\n" in fixed
    assert "    return own, get_model_state_dict(opt_model, options=StateDictOptions(full_state_dict=True))\n" in fixed


def test_the_model_unwrapped_inside_its_own_state_dict_type_block_keeps_its_call(tmp_path: Path) -> None:
    # m = unwrap_model(model) in FSDP.state_dict_type(model, FULL, rank0_only): m.state_dict() is the block's
    # model (its compiled inner module too), whose type the bridge's context sets; torch's full-state call
    # written over it crashed every rank but 0 (the context's rank0_only state was empty there)
    code = textwrap.dedent(
        """
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


        def unwrap_model(m):
            while hasattr(m, "module"):
                m = m.module
            return m


        def save(model, ema: FSDP, rank):
            model = FSDP(model)
            cfg = FullStateDictConfig(rank0_only=True, offload_to_cpu=True)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                m = unwrap_model(model)
                state = m.state_dict()
                other = ema.state_dict()
            if rank == 0:  # the model itself (`model = FSDP(model)` is not "made from" it): the rank-guard TODO
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                    again = model.state_dict()
            return state, other, again
        """
    )
    (tmp_path / "save.py").write_text(code)
    report, (result,) = migrate_paths([tmp_path], fix=True)
    assert "with fsdp_bridge.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):" in result.fixed
    assert "        state = m.state_dict()\n" in result.fixed
    (kept,) = [f for f in report.findings if f.construct == "m.state_dict()"]
    assert kept.fixable and "made from model" in kept.replacement
    assert not [f for f in report.findings if f.construct == "model.state_dict()" and "made from" in f.replacement]
    assert "get_model_state_dict(ema, options=StateDictOptions(full_state_dict=True))" in result.fixed  # another root


def test_a_state_dict_inside_a_units_own_summon_is_a_todo() -> None:
    # summon_full_params(layer, recurse=False) then layer.module.state_dict(): FSDP1's gathered tensors; on FSDP2
    # recurse=False is unshard(), inside which state_dict() still gives DTensor shards; around a forward it is kept
    code = textwrap.dedent(
        """
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


        def export(model: FSDP, layer: FSDP, x):
            with FSDP.summon_full_params(layer, recurse=False, writeback=False):
                sd = {k: v.cpu() for k, v in layer.module.state_dict().items()}
            with FSDP.summon_full_params(model, recurse=False, writeback=False):
                out = model.generate(x)
            return sd, out
        """
    )
    result = migrate_source(code, "export.py")
    todo, kept = [f for f in result.findings if f.construct == "FSDP.summon_full_params(...)"]
    assert not todo.fixable and "drop recurse=False" in todo.replacement
    assert kept.fixable and "fsdp_bridge.summon_full_params(model, recurse=False" in result.fixed


def test_a_state_dict_of_an_instances_fsdp1_attribute_keeps_fsdp1s_full_meaning(tmp_path: Path) -> None:
    # `trainer = FineTuner(...)` whose class assigns `self.model = FSDP(...)`: `trainer.model.state_dict()` outside
    # the class was FSDP1's full state dict, left as it was (DTensor shards on FSDP2, rank 0 saved its own). Another
    # class's `.model` is not touched; a class that assigns DDP's wrapper to the same attribute too is both.
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n\n\n"
        "class FineTuner:\n"
        "    def __init__(self, model):\n"
        "        self.model = FSDP(model, use_orig_params=True)\n\n\n"
        "class Either:\n"
        "    def __init__(self, model, fsdp):\n"
        "        if fsdp:\n"
        "            self.model = FSDP(model)\n"
        "        else:\n"
        "            self.model = DDP(model)\n\n\n"
        "def loop(net, other, path):\n"
        "    trainer = FineTuner(net)\n"
        "    state = trainer.model.state_dict()\n"
        "    plain = other.model.state_dict()\n"
        "    either = Either(net, True)\n"
        "    both = either.model.state_dict()\n"
        "    torch.save(state, path)\n"
    )
    (tmp_path / "finetune.py").write_text(code)
    migrate_paths([tmp_path], fix=True)
    fixed = (tmp_path / "finetune.py").read_text()
    assert "state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))" in fixed
    assert "plain = other.model.state_dict()" in fixed
    # a library's class of the same name is not the tree's: its `.model` is left as it is
    (tmp_path / "hf.py").write_text(
        "import transformers\n\n\ndef run(args):\n    trainer = transformers.FineTuner(args)\n"
        "    return trainer.model.state_dict()\n"
    )
    migrate_paths([tmp_path], fix=True)
    assert "    return trainer.model.state_dict()\n" in (tmp_path / "hf.py").read_text()
    # DDP's on the other path: FSDP2's full state where the model is sharded, DDP's own state_dict otherwise
    assert "if isinstance(either.model, torch.nn.Module) and any(isinstance(m, FSDPModule)" in fixed
    assert "else either.model.state_dict())" in fixed


def test_a_compiled_models_checkpoint_module_in_another_file_gets_the_prefix_note_and_its_orig_mod_load(
    tmp_path: Path,
) -> None:
    # torch.compile after the wrap in the trainer, the state dicts in a checkpoint module: FSDP1's keys carried
    # `_orig_mod.`, the migrated calls' do not; the note is at the compile line, naming the other file. That
    # module's `model._orig_mod.load_state_dict(sd)` (the compiled model's FSDP1 wrapper) keeps FSDP1's full meaning.
    (tmp_path / "ckpt.py").write_text(
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType\n\n\n"
        "def load(model, path, compiled):\n"
        "    sd = torch.load(path)\n"
        "    if compiled:\n"
        "        model._orig_mod.load_state_dict(sd)\n"
        "    else:\n"
        "        model.load_state_dict(sd)\n\n\n"
        "def save(model):\n"
        "    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):\n"
        "        return model.state_dict()\n"
    )
    (tmp_path / "train.py").write_text(
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from ckpt import load, save\n\n\n"
        "def main(model, path):\n"
        "    model = FSDP(model)\n"
        "    model = torch.compile(model)\n"
        "    load(model, path, True)\n"
        "    return save(model)\n"
    )
    report, _ = migrate_paths([tmp_path], fix=True)
    (note,) = [f for f in report.findings if f.note and f.path.endswith("train.py")]
    assert note.line == 8 and note.construct == "torch.compile(model) of a model FSDP1 wraps"
    assert note.replacement.endswith("this tree takes them with FSDP1's state-dict calls in ckpt.py")
    fixed = (tmp_path / "ckpt.py").read_text()
    assert "(set_model_state_dict(model._orig_mod, sd, options=StateDictOptions(full_state_dict=True" in fixed


def test_a_summon_by_keyword_for_rank_0_keeps_its_save_and_a_load_inside_one_is_a_todo() -> None:
    # FSDP.summon_full_params(module=model, rank0_only=True, ...) around a rank-0 save: the bridge's summon (the
    # module by position) with the state_dict() kept, which gives rank 0 the full tensors there (torch's full-state
    # call would be a collective inside the rank-0 block). A load inside a summon is rewritten to torch's full-state
    # load, which needs no gather and fails inside the bridge's summon: that summon is a TODO saying to drop it.
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def save(net, is_main, path):\n"
        "    model = FSDP(net)\n"
        "    with FSDP.summon_full_params(module=model, rank0_only=True, writeback=False, offload_to_cpu=True):\n"
        "        if is_main:\n"
        "            torch.save(model.state_dict(), path)\n"
        "    with FSDP.summon_full_params(module=model):\n"
        "        model.load_state_dict(torch.load(path))\n"
    )
    result = migrate_source(code, "ckpt.py")
    fixed = result.fixed
    assert "with fsdp_bridge.summon_full_params(model, rank0_only=True, writeback=False, offload_to_cpu=True):" in fixed
    assert "            torch.save(model.state_dict(), path)\n" in fixed
    (todo,) = [f for f in result.findings if not f.fixable]
    assert todo.line == 10 and "model.load_state_dict(...) inside it loaded into the gathered" in todo.replacement
    assert "    with FSDP.summon_full_params(module=model):\n" in fixed
    assert "set_model_state_dict(model, torch.load(path), options=StateDictOptions(full_state_dict=True))" in fixed


def test_a_parameter_annotated_with_fsdp1s_class_among_others_gets_the_guarded_state_dict() -> None:
    # `model: Union[nn.Module, FSDP]` in a function whose `if not use_fsdp:` branch saves a plain, compiled or DDP
    # model: torch's full-state call there dropped `_orig_mod.` / `module.` from the keys; the guarded form keeps
    # the model's own call for anything but a sharded model. `Optional[FSDP]` names FSDP1's class alone.
    code = (
        "from typing import Optional, Union\n"
        "from torch import nn\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def save(model: Union[nn.Module, FSDP], use_fsdp: bool):\n"
        "    if not use_fsdp:\n"
        "        return model.state_dict()\n\n\n"
        "def save_sharded(model: Optional[FSDP]):\n"
        "    return model.state_dict()\n"
    )
    fixed = migrate_source(code, "ckpt.py").fixed
    assert "if isinstance(model, torch.nn.Module) and any(isinstance(m, FSDPModule)" in fixed
    assert "else model.state_dict())\n" in fixed
    assert "    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))\n" in fixed


def test_an_optimizer_built_before_a_wrap_on_one_branch_is_a_todo() -> None:
    # The wrap in the same block moves the optimizer after it; a wrap under `if use_fsdp:` cannot take it along
    # (the other branch uses it too): a TODO at the optimizer, naming the wrap's line.
    code = textwrap.dedent(
        """\
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


        def main(use_fsdp):
            model = torch.nn.Linear(4, 4)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            if use_fsdp:
                model = FSDP(model)
            return model, optimizer


        def fine():
            model = torch.nn.Linear(4, 4)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model = FSDP(model)
            return model, optimizer
        """
    )
    result = migrate_source(code, "train.py")
    todos = [f for f in result.findings if not f.fixable]
    assert [(f.line, "(line 9 before --fix)" in f.replacement) for f in todos] == [(7, True)]
    fixed = result.fixed
    assert f"    # {TODO}: torch.optim.AdamW(" in fixed and migrate_source(fixed, "train.py").fixed == fixed
    fine = _between(fixed, "def fine")
    assert fine.index("fsdp_bridge.shard(") < fine.index("optimizer = torch.optim.AdamW") and TODO not in fine


def test_optimizer_state_with_arguments_through_kwargs_goes_to_the_bridges_fsdp1_signature() -> None:
    # A feature test fills the keywords at run time: the bridge's optim_state_dict takes FSDP1's whole signature
    # (a keyword FSDP1 lacks stays a TypeError); the torch target keeps the bridge's call and says why.
    code = textwrap.dedent(
        """\
        import inspect
        import torch
        from torch.distributed.fsdp import FullOptimStateDictConfig
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        HAS_CFG = "optim_state_dict_cfg" in inspect.signature(FSDP.optim_state_dict).parameters


        def save(model, optimizer):
            model = FSDP(model)
            kwargs = {}
            if HAS_CFG:
                kwargs["optim_state_dict_cfg"] = FullOptimStateDictConfig(rank0_only=True)
            torch.save(FSDP.optim_state_dict(model, optimizer, **kwargs), "optim.pt")
        """
    )
    result = migrate_source(code, "train.py")
    assert "torch.save(fsdp_bridge.optim_state_dict(model, optimizer, **kwargs)" in result.fixed
    rewritten = [f for f in result.findings if f.construct == "FSDP.optim_state_dict(...)"]
    assert [(f.line, f.fixable) for f in rewritten] == [(14, True)]
    assert "optim_state_dict=None" in rewritten[0].replacement
    assert [f.line for f in result.findings if not f.fixable] == [6]  # the signature read stays a TODO
    assert migrate_source(result.fixed, "train.py").fixed == result.fixed
    torch_target = migrate_source(code, "train.py", target="torch").fixed
    assert "fsdp_bridge.optim_state_dict(model, optimizer, **kwargs)" in torch_target
    assert "come through ** and are known only when the code runs" in torch_target


def test_a_block_saving_only_the_optimizer_state_reports_the_optimizers_options() -> None:
    # FullOptimStateDictConfig(rank0_only=True) is written as cpu_offload=True (rank 0 alone); the report showed
    # the model's options, which read as every rank.
    code = textwrap.dedent(
        """\
        from torch.distributed.fsdp import FullOptimStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


        def optim_state(model: FSDP, optimizer):
            cfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, None, cfg):
                return FSDP.optim_state_dict(model, optimizer)
        """
    )
    result = migrate_source(code, "ckpt.py")
    block = next(f for f in result.findings if f.construct == "FSDP.state_dict_type(FULL_STATE_DICT)")
    written = "options=StateDictOptions(full_state_dict=True, cpu_offload=True)"
    assert written in result.fixed and written in block.replacement, block.replacement


def test_a_load_in_a_method_the_class_may_run_before_its_wrap_keeps_the_plain_path() -> None:
    # __init__ keeps the plain model, resumes it (through a helper method), then wraps it with FSDP1: the load
    # runs on the plain module, whose own strict load refuses a checkpoint missing a weight (torch's full-state
    # load would keep the current value). It becomes torch's load only where the model holds FSDP2 units.
    code = textwrap.dedent(
        """\
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


        class Trainer:
            def __init__(self, model, path):
                self.model = model
                if path:
                    self.resume(path)
                self.model = FSDP(model)

            def resume(self, path):
                self._load(torch.load(path))

            def _load(self, state):
                self.model.load_state_dict(state)
        """
    )
    fixed = migrate_source(code, "trainer.py").fixed
    load = next(line for line in fixed.splitlines() if "set_model_state_dict(self.model" in line)
    assert "any(isinstance(m, FSDPModule) for m in self.model.modules())" in load
    assert load.endswith("else self.model.load_state_dict(state))"), load
    assert migrate_source(fixed, "trainer.py").fixed == fixed


def test_the_static_method_called_through_the_model_without_it_is_a_todo() -> None:
    # model.set_state_dict_type(StateDictType.FULL_STATE_DICT, cfg): FSDP1 reads the type as the module (it raises
    # there too); FSDP2's module has no such method. A TODO saying what to write, and nothing else changed.
    code = RUNTIME_TYPE.replace(
        "model.set_state_dict_type(model, settings.kind, settings.cfg)",
        "model.set_state_dict_type(settings.kind, settings.cfg)",
    )
    result = migrate_source(code, "runtime.py")
    todo = next(f for f in result.findings if f.construct == "model.set_state_dict_type(settings.kind, ...)")
    assert not todo.fixable and "FSDP1 takes settings.kind for the module" in todo.replacement
    assert "    model.set_state_dict_type(settings.kind, settings.cfg)\n" in result.fixed
    unshown = code.replace("def prepare_own(model: FSDP, settings):", "def prepare_own(model, settings):")
    assert not any("settings.kind, ...)" in f.construct for f in migrate_source(unshown, "runtime.py").findings)


def test_a_config_two_unwrapped_blocks_share_goes_with_the_last_of_them() -> None:
    # EfficientMoE's checkpoint: one FullStateDictConfig for the model's block and the EMA copy's; both become
    # get_model_state_dict, so nothing uses the config (nor its import) any more. A use left elsewhere keeps it.
    code = textwrap.dedent(
        """\
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, FullStateDictConfig, StateDictType


        def save(model, ema):
            model = FSDP(model)
            ema = FSDP(ema)
            full_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full_cfg):
                a = model.state_dict()
            with FSDP.state_dict_type(ema, StateDictType.FULL_STATE_DICT, full_cfg):
                b = ema.state_dict()
            return a, b
        """
    )
    fixed = migrate_source(code, "ckpt.py").fixed
    assert "FullStateDictConfig" not in fixed and fixed.count("get_model_state_dict(") == 2  # its import gone too
    kept = migrate_source(code.replace("    return a, b", "    print(full_cfg)\n    return a, b"), "ckpt.py").fixed
    assert "    full_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)\n" in kept


ONE_RANK_SAMPLING = """\
import torch
from contextlib import nullcontext
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def sample(model, prompts, rank):
    if isinstance(model, FSDP):
        wrapper = model
        raw_model = model.module
        ctx = FSDP.summon_full_params(wrapper, recurse=True, writeback=False, rank0_only=True)
    else:
        raw_model = model
        ctx = nullcontext()
    with ctx:
        if rank == 0:
            with torch.no_grad():
                return raw_model.generate(prompts)


def export(model, rank):
    with FSDP.summon_full_params(model, rank0_only=True):
        if rank == 0:
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, "x.pt")
"""


def test_a_forward_on_rank_0_alone_inside_a_rank0_only_summon_is_a_todo() -> None:
    # SoundOmni's sampling: every rank enters summon_full_params(rank0_only=True), rank 0 alone runs the wrapped
    # module. FSDP1 gathers nothing more there; FSDP2's units all-gather in their forward, which the other ranks
    # never join (a hang, checked on 2 gloo ranks). A rank-0 state dict in such a context is no forward: rewritten.
    for target in ("bridge", "torch"):
        result = migrate_source(ONE_RANK_SAMPLING, "sample.py", target=target)
        found = {f.line: f for f in result.findings if f.construct == "FSDP.summon_full_params(...)"}
        assert not found[10].fixable and found[10].replacement.startswith(
            "a forward on one rank inside it (raw_model.generate(...) under `if rank == 0`)"
        )
        assert "ctx = FSDP.summon_full_params(wrapper, recurse=True, writeback=False, rank0_only=True)" in result.fixed
        assert found[21].fixable
        assert migrate_source(result.fixed, "sample.py", target=target).fixed == result.fixed
