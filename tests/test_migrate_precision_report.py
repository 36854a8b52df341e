"""What ``migrate code`` reports: the value each argument had and what it became; constructs it must not miss
(Lightning's FSDP1 strategy, FSDP1 attributes of a model prepared elsewhere, FSDP1-format checkpoints)."""

from __future__ import annotations

from pathlib import Path

from fsdp_bridge.migrate._code import migrate_paths, migrate_source
from fsdp_bridge.migrate._report import CodeReport

FIXTURES = Path(__file__).parent / "fixtures" / "migrate" / "precision"


def _migrate(name: str):  # type: ignore[no-untyped-def]
    return migrate_source((FIXTURES / name).read_text(), name)


def test_each_argument_line_shows_its_source_value_and_what_it_became() -> None:
    result = _migrate("report_values.py")
    by_line = {f.line: f for f in result.findings}
    strategy, wrap, device = by_line[17], by_line[18], by_line[19]
    assert strategy.construct == "sharding_strategy=ShardingStrategy.HYBRID_SHARD"
    assert strategy.replacement.startswith('strategy="hybrid_shard": 2D mesh (replicate, shard)')
    # A policy built in a variable: the report names the variable and the value it holds.
    assert wrap.construct == (
        "auto_wrap_policy=small_units (= functools.partial(size_based_auto_wrap_policy, min_num_params=1000))"
    )
    assert wrap.replacement.startswith('wrap={"min_num_params": 1000}: fully_shard on each resolved unit')
    assert device.construct == 'device_id=torch.device("cpu")' and device.replacement.startswith('device="cpu": ')
    line = next(f.format() for f in result.findings if f.line == 17)
    assert 'sharding_strategy=ShardingStrategy.HYBRID_SHARD -> strategy="hybrid_shard": 2D mesh' in line


def test_report_values_leave_the_rewritten_file_as_it_was() -> None:
    fixed = _migrate("report_values.py").fixed
    assert 'strategy="hybrid_shard"' in fixed and 'wrap={"min_num_params": 1000}' in fixed
    assert "TODO(fsdp-bridge)" not in fixed


def test_lightning_fsdp_strategy_is_reported_with_each_argument_in_bridge_terms() -> None:
    source = (FIXTURES / "lightning_strategy.py").read_text()
    # --target torch: no Lightning strategy written; a TODO naming the ways to FSDP2 and what each argument becomes
    result = migrate_source(source, "lightning_strategy.py", target="torch")
    by_line = {f.line: f for f in result.findings}
    strategy = by_line[18]
    assert strategy.construct == "FSDPStrategy(...) (Lightning's FSDP1 strategy)" and not strategy.fixable
    assert "ModelParallelStrategy" in strategy.replacement and "configure_model" in strategy.replacement
    assert "fsdp_bridge.shard(self.model" in strategy.replacement
    # each argument: a note saying what it becomes, part of the strategy's one TODO (one construct, one decision)
    part = " (part of the strategy's TODO above)"
    assert (by_line[19].construct, by_line[19].replacement) == (
        'sharding_strategy="HYBRID_SHARD"',
        'strategy="hybrid_shard"' + part,
    )
    assert (by_line[20].construct, by_line[20].replacement) == ("auto_wrap_policy={Block}", "wrap=[Block]" + part)
    assert by_line[21].replacement.startswith("activation_checkpointing=True with wrap=[Block]")
    assert by_line[22].replacement.startswith("ModelParallelStrategy(save_distributed_checkpoint=True)")
    assert 'fsdp_bridge.save_checkpoint(path, model, kind="sharded")' in by_line[22].replacement
    assert by_line[23].replacement == "cpu_offload=False" + part
    assert all(by_line[n].note for n in range(19, 24)) and [f for f in result.findings if not f.note] == [strategy]
    # --fix: one TODO above the statement, naming every argument; the code itself is left as it is.
    fixed = result.fixed
    (todo,) = [line for line in fixed.splitlines() if "TODO(fsdp-bridge)" in line]
    assert 'sharding_strategy="HYBRID_SHARD" -> strategy="hybrid_shard"' in todo
    assert fixed.replace(todo + "\n", "") == result.original
    assert migrate_source(fixed, "again.py", target="torch").fixed == fixed  # a second --fix changes nothing

    # the default target: the Trainer's own FSDP2 strategy of the bridge, the same arguments
    result = _migrate("lightning_strategy.py")
    by_line = {f.line: f for f in result.findings}
    assert by_line[18].fixable and "fsdp_bridge.lightning.TrainerStrategy(...)" in by_line[18].replacement
    assert by_line[22].replacement.startswith('kept: state_dict_type="sharded"')
    assert by_line[19].replacement == 'strategy="hybrid_shard" (part of the strategy\'s rewrite above)'
    assert "strategy = fsdp_bridge.lightning.TrainerStrategy(\n" in result.fixed
    assert "TODO" not in result.fixed and "FSDPStrategy" not in result.fixed
    assert migrate_source(result.fixed, "again.py").fixed == result.fixed


def test_lightning_strategy_by_name_and_fabric_strategy_object() -> None:
    result = _migrate("lightning_fabric_string.py")
    found = {(f.line, f.construct, f.fixable) for f in result.findings}
    assert found == {
        (14, 'Fabric(strategy="fsdp_cpu_offload") (Lightning\'s FSDP1 strategy)', True),
        (15, "FabricFSDP(...) (Lightning's FSDP1 strategy)", True),
        (15, 'state_dict_type="full"', True),
    }, found  # not strategy="ddp", not DDPStrategy(), not the tree's own Trainer(strategy="fsdp")
    # Fabric's: the same arguments to the bridge's Fabric strategy; the aliased import, now unused, goes
    assert "TODO(fsdp-bridge)" not in result.fixed and "FabricFSDP" not in result.fixed
    assert "strategy=fsdp_bridge.lightning.FabricStrategy(cpu_offload=True))" in result.fixed
    assert 'strategy=fsdp_bridge.lightning.FabricStrategy(state_dict_type="full"))' in result.fixed
    assert 'Fabric(devices=2, strategy="ddp")' in result.fixed and "import fsdp_bridge.lightning\n" in result.fixed
    assert migrate_source(result.fixed, "again.py").fixed == result.fixed
    torch = migrate_source(result.original, "t.py", target="torch")  # no Lightning strategy written there
    assert torch.fixed.count("TODO(fsdp-bridge)") == 2 and "not rewritten: --target torch" in torch.fixed


def test_fsdp1_sharded_checkpoints_get_one_convert_note_per_file() -> None:
    result = _migrate("sharded_checkpoints.py")
    notes = [f for f in result.findings if f.construct.startswith("FSDP1-format checkpoint")]
    assert [(f.line, f.construct) for f in notes] == [(12, "FSDP1-format checkpoint (SHARDED_STATE_DICT)")]
    (note,) = notes
    assert note.note and "`fsdp-bridge convert SRC DST --to sharded`" in note.replacement
    assert "cannot resume FSDP1's flat-parameter checkpoints (LOCAL_STATE_DICT shards) directly" in note.replacement
    assert note.format().startswith("sharded_checkpoints.py:12:38: [note] FSDP1-format checkpoint (SHARDED_STATE_DICT)")
    report = CodeReport(findings=result.findings)
    assert note not in report.todos  # nothing left to do in the code: --fix rewrote every construct
    assert report.format().endswith(
        "6 FSDP1 construct(s): 6 rewritable by --fix, 0 left with TODO(fsdp-bridge); 1 note(s)"
    )
    assert (
        "TODO(fsdp-bridge)" not in result.fixed and "FSDP1-format" not in result.fixed
    )  # the report's, not the file's


def test_dcp_with_torchs_own_fully_shard_gets_no_checkpoint_note() -> None:
    result = _migrate("fsdp2_dcp_lookalike.py")
    assert result.findings == [] and result.fixed == result.original


def test_fsdp1_attributes_of_a_model_prepared_elsewhere_get_todos_naming_the_bridge() -> None:
    result = _migrate("prepared_elsewhere.py")
    found = {(f.line, f.construct.split(" (")[0]): f for f in result.findings}
    assert set(found) == {
        (5, "model._fsdp_wrapped_module"),
        (7, "model.sharding_strategy"),
        (8, "model.mixed_precision"),
        (10, "model.params"),
    }  # engine.sharding_strategy (line 16) is not shown to be FSDP1's
    # The wrapped module is the same object on FSDP1's wrapper (whoever made it) and on FSDP2: rewritten.
    assert found[5, "model._fsdp_wrapped_module"].fixable
    assert found[5, "model._fsdp_wrapped_module"].replacement.startswith("fsdp_bridge.unwrapped(model): ")
    assert not any(f.fixable for key, f in found.items() if key[0] != 5)
    assert "fsdp_bridge.get_bridge(model).config.strategy" in found[7, "model.sharding_strategy"].replacement
    assert "fsdp_bridge.get_bridge(model).config.mixed_precision" in found[8, "model.mixed_precision"].replacement
    fixed = result.fixed
    assert fixed.count("# TODO(fsdp-bridge): ") == 3
    kept = [line for line in fixed.splitlines() if "TODO" not in line]
    assert kept[1] == "import fsdp_bridge" and "    inner = fsdp_bridge.unwrapped(model)" in kept
    # the guarded read in run_blocks (line 21) is left as it is
    assert [line for line in kept if "unwrapped" not in line and line != "import fsdp_bridge"] == [
        line for line in result.original.splitlines() if "inner = " not in line
    ]
    assert migrate_source(fixed, "again.py").fixed == fixed  # a second --fix changes nothing


def test_an_attribute_of_ones_own_named_like_an_fsdp1_internal_is_not_reported() -> None:
    # _handles here is a list of hook handles this class assigns itself, not FSDP1's FlatParamHandles.
    code = (
        "class HookSet:\n"
        "    def __init__(self, layer):\n"
        "        self.layer = layer\n"
        "        self._handles: list = []\n\n"
        "    def attach(self, fn):\n"
        "        self._handles.append(self.layer.register_forward_hook(fn))\n\n"
        "    def detach(self):\n"
        "        for h in self._handles:\n"
        "            h.remove()\n"
    )
    result = migrate_source(code, "hooks.py")
    assert result.findings == [] and result.fixed == code


def test_a_method_of_ones_own_named_like_an_fsdp1_internal_is_not_reported(tmp_path: Path) -> None:
    # A signal handler's own _handle method, read in its class and, in a test, on an instance made elsewhere.
    (tmp_path / "signals.py").write_text(
        "import signal\n\n\n"
        "class Handler:\n"
        "    def install(self):\n"
        "        signal.signal(signal.SIGTERM, self._handle)\n\n"
        "    def _handle(self, signum, frame):\n"
        "        self.stopped = signum\n"
    )
    (tmp_path / "test_signals.py").write_text(
        "import signal\n\n\ndef check(handler):\n    assert signal.getsignal(signal.SIGTERM) == handler._handle\n"
    )
    report, results = migrate_paths([tmp_path])
    assert report.findings == [] and all(not r.changed for r in results)


def test_a_second_fix_adds_no_todo_once_the_fsdp1_import_is_gone() -> None:
    # The first --fix removes the import, so the second sees a model "prepared elsewhere": same TODO, not two.
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "class Runner:\n"
        "    def __init__(self, net):\n"
        "        self.net = FSDP(net)\n\n"
        "    def after_step(self):\n"
        "        self.net._handle.reshard(True)\n"
    )
    fixed = migrate_source(code, "runner.py").fixed
    assert "FullyShardedDataParallel" not in fixed and fixed.count("# TODO(fsdp-bridge): self.net._handle") == 1
    again = migrate_source(fixed, "runner.py")
    assert again.fixed == fixed
    assert [f.construct for f in again.findings if not f.fixable] == [
        "self.net._handle (an FSDP1 internal of a model prepared elsewhere)"
    ]  # still counted as not handled


def test_flat_parameters_of_guarded_units_get_a_todo_and_a_params_attribute_of_ones_own_none() -> None:
    result = _migrate("flat_params_of_units.py")
    todos = {(f.line, f.construct) for f in result.findings if not f.fixable}
    assert (12, "module.params (an FSDP1 wrapper attribute)") in todos
    assert (13, "param._is_flat_param (an FSDP1 internal)") in todos
    assert not any(f.line >= 17 for f in result.findings)  # Averager's own .params
    assert "# TODO(fsdp-bridge): module.params" in result.fixed


def test_a_flat_parameters_local_shard_moved_by_hand_is_a_todo() -> None:
    # offloading by FSDP1's flat parameters (p._local_shard, p.data = p.data.to(...)): FSDP2's DTensor parameters
    # have no _local_shard, and setting .data does not move their shard
    code = (
        "import torch\nfrom torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def offload(model: FSDP):\n"
        "    for p in model.parameters():\n"
        "        p._local_shard = p.data.to('cpu')\n"
        "        p.data = p._local_shard\n"
    )
    result = migrate_source(code, "offload.py")
    todos = [f for f in result.findings if not f.fixable and "_local_shard" in f.construct]
    assert len(todos) == 2 and "fsdp_bridge.move_shards(model, device)" in todos[0].replacement


def test_fsdp1_attributes_read_under_an_enclosing_hasattr_test_are_not_reported() -> None:
    # An unwrapping loop: each branch reads an attribute only where the object has it, so on FSDP2 (no wrapper)
    # the FSDP1 branch is skipped and the code already runs; the DDP branch's .module must keep working.
    source = (
        "def innermost(net):\n"
        "    while True:\n"
        '        if hasattr(net, "module"):\n'
        "            net = net.module\n"
        '        elif hasattr(net, "_fsdp_wrapped_module") and net is not None:\n'
        "            net = net._fsdp_wrapped_module\n"
        "        else:\n"
        "            return net\n"
    )
    result = migrate_source(source, "unwrap.py")
    assert result.findings == [] and result.fixed == source
    # Guards that do not guard the read: the else branch of the test, a negated test, another attribute.
    unguarded = (
        "def peel(net, other):\n"
        '    if hasattr(net, "_fsdp_wrapped_module"):\n'
        "        pass\n"
        "    else:\n"
        "        a = net._fsdp_wrapped_module\n"
        '    if not hasattr(net, "_fsdp_wrapped_module"):\n'
        "        b = net._fsdp_wrapped_module\n"
        '    if hasattr(other, "_fsdp_wrapped_module"):\n'
        "        c = net._fsdp_wrapped_module\n"
        "    return a, b, c\n"
    )
    lines = sorted(f.line for f in migrate_source(unguarded, "peel.py").findings)
    assert lines == [5, 7, 9]
    # A branch doing FSDP1 work through its internals would silently do nothing on FSDP2: still reported.
    internal = 'def drop(net):\n    if hasattr(net, "_handle"):\n        h = net._handle\n        h.reshard(True)\n'
    assert [f.line for f in migrate_source(internal, "drop.py").findings] == [3]


def test_a_context_of_a_kept_subclass_of_the_wrapper_is_named_fsdp1s_own_not_rewritten() -> None:
    # The subclass of FSDP1's wrapper stays FSDP1's (a TODO), and so does its state_dict_type block: the report
    # must not say the block was rewritten to fsdp_bridge.state_dict_type. The optimizer-state call inside it is
    # fsdp_bridge.optim_state_dict, FSDP1's own call on the FSDP1 model, which follows the block's type.
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType\n\n\n"
        "class TracedWrapper(FullyShardedDataParallel):\n"
        "    pass\n\n\n"
        "def gather(model: TracedWrapper, opt):\n"
        "    with TracedWrapper.state_dict_type(model, StateDictType.FULL_STATE_DICT):\n"
        "        weights = model.state_dict()\n"
        "        state = FullyShardedDataParallel.optim_state_dict(model, opt)\n"
        "    return weights, state\n"
    )
    result = migrate_source(code, "wrapper.py")
    by_construct = {f.construct: f for f in result.findings}
    optim = by_construct["FSDP.optim_state_dict(...)"]
    assert optim.fixable and optim.replacement.startswith("fsdp_bridge.optim_state_dict(model, opt): inside")
    assert "FSDP1's own context (TracedWrapper subclasses FSDP1's wrapper" in optim.replacement
    assert "rewritten to fsdp_bridge.state_dict_type" not in optim.replacement
    assert "TracedWrapper.state_dict_type(model, StateDictType.FULL_STATE_DICT)" in result.fixed
    assert not any("rewritten" in f.replacement and "blocks" in f.replacement for f in result.findings)


def test_torchs_clip_over_an_fsdp1_models_parameters_is_kept_with_a_note_on_its_changed_meaning() -> None:
    # On FSDP1 torch's clip sees each rank's flat shards (a per-rank norm); on FSDP2 the DTensor parameters give
    # the global norm. The call stays (it is right on FSDP2), and the report says the clipping changes. A plain
    # module's (or an unproven object's) clip is nobody's business.
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def step(module, other, loss):\n"
        "    model = FSDP(module)\n"
        "    loss.backward()\n"
        "    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "    torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)\n"
        "    grads = [p for p in model.parameters() if p.requires_grad]\n"
        "    torch.nn.utils.clip_grad_norm_(grads, 1.0)\n"
        "    mine = [p for p in other.parameters() if p.requires_grad]\n"
        "    torch.nn.utils.clip_grad_norm_(mine, 1.0)\n"
        "    chosen = list(other.parameters()) if norm else [p for p in model.parameters()]\n"
        "    torch.nn.utils.clip_grad_norm_(chosen, 1.0)  # one branch's list: not followed\n"
        "    return norm\n"
    )
    result = migrate_source(code, "step.py")
    note, listed = [f for f in result.findings if f.note]  # a list taken from the parameters too, not other's
    assert listed.construct == "torch.nn.utils.clip_grad_norm_(grads, ...)" and listed.line == 11
    assert note.construct == "torch.nn.utils.clip_grad_norm_(model.parameters(), ...)" and note.line == 8
    assert "each rank clips by the norm of its own shard" in note.replacement
    assert "fsdp_bridge.clip_grad_norm_(model, max_norm) takes both" in note.replacement
    torch_note = next(f for f in migrate_source(code, "step.py", target="torch").findings if f.line == 8 and f.note)
    assert "_fsdp2_helpers.clip_grad_norm_(model, max_norm) takes both" in torch_note.replacement
    assert "fsdp_bridge" not in torch_note.replacement  # the torch target drops the library
    assert "    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n" in result.fixed
    assert "TODO" not in result.fixed


def test_shape_reads_over_an_fsdp1_models_parameters_are_kept_with_a_note_on_their_changed_meaning() -> None:
    # After FSDP1 wraps a model its parameters are 1-D shards (or views into one): a weight-decay rule on ndim
    # or a numel() count over them changes on FSDP2's full-shape DTensors. Reported where the model is proven
    # FSDP1's (here: handed to a function by the wrapping one), not before it is wrapped, not for plain modules,
    # not where summon_full_params gathers them: a count is a note, a group split by shape a TODO (FSDP1 put
    # every parameter in one group, FSDP2 splits them as written).
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def groups(vla, other):\n"
        "    decay = [p for n, p in vla.named_parameters() if p.ndim > 1]\n"
        "    plain = [p for n, p in other.named_parameters() if p.ndim > 1]\n"
        "    for p in vla.parameters():\n"
        "        p.requires_grad_(True)\n"
        "    return decay, plain\n\n\n"
        "def setup(model, head):\n"
        "    before = sum(p.numel() for p in model.parameters())\n"
        "    model = FSDP(model, use_orig_params=True)\n"
        "    after = sum(p.numel() for p in model.parameters())\n"
        "    with FSDP.summon_full_params(model):\n"
        "        gathered = sum(p.numel() for p in model.parameters())\n"
        "    return groups(model, head), before, after, gathered\n"
    )
    result = migrate_source(code, "groups.py")
    notes = {f.line: f for f in result.findings if f.note}
    assert sorted(notes) == [16], notes
    assert notes[16].construct == "model.parameters() read as p.numel"
    assert "1-D" in notes[16].replacement and "DTensors with the full shape" in notes[16].replacement
    (split,) = [f for f in result.findings if not f.fixable]
    assert (split.line, split.construct) == (6, "vla.named_parameters() split into groups by p.ndim")
    assert "FSDP1 put them all in one group" in split.replacement
    assert result.fixed.count("TODO") == 1 and "p.ndim > 1" in result.fixed


def test_a_model_kept_by_an_annotated_assignment_is_followed_into_the_function_it_is_handed_to(
    tmp_path: Path,
) -> None:
    # A public trainer keeps the wrapped model with an annotation (``self.model: nn.Module = wrap(...)``, beside a
    # plain model on one rank count) and hands it to an optimizer builder whose weight-decay rule reads ndim: FSDP1's
    # flat views are 1-D (no decay at all), FSDP2's DTensors keep their shape. The note was missed for the
    # annotated form.
    (tmp_path / "wrap.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def wrap_model(model):\n"
        "    wrapped = FSDP(model, use_orig_params=True)\n"
        "    return wrapped\n"
    )
    (tmp_path / "optim.py").write_text(
        "import torch\n\n\n"
        "def build_optimizer(model, wd):\n"
        "    decay = [p for p in model.parameters() if p.dim() >= 2]\n"
        "    return torch.optim.AdamW([{'params': decay, 'weight_decay': wd}])\n"
    )
    (tmp_path / "trainer.py").write_text(
        "import torch\n"
        "from optim import build_optimizer\n"
        "from wrap import wrap_model\n\n\n"
        "class Trainer:\n"
        "    def __init__(self, model, dp):\n"
        "        if dp > 1:\n"
        "            self.model: torch.nn.Module = wrap_model(model)\n"
        "        else:\n"
        "            self.model = model\n"
        "        self.optimizer = build_optimizer(self.model, 0.1)\n"
    )
    report, _ = migrate_paths([tmp_path])
    (split,) = [f for f in report.findings if not f.fixable]
    assert (Path(split.path).name, split.line, split.construct) == (
        "optim.py",
        5,
        "model.parameters() split into groups by p.dim",
    )


def test_a_numel_count_added_across_ranks_is_a_todo_and_a_printed_one_a_note() -> None:
    # FSDP1's parameters are this rank's shard: the all_reduce of the counts gave the model's size. FSDP2's
    # numel() is global already, so the all_reduce multiplies it by the world size. A count only printed stays a
    # note (a different number, no wrong computation built on it).
    source = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def main(net, world):\n"
        "    model = FSDP(net, use_orig_params=True)\n"
        "    local_n = sum(p.numel() for p in model.parameters())\n"
        "    n_tensor = torch.tensor([local_n], dtype=torch.long)\n"
        "    dist.all_reduce(n_tensor, op=dist.ReduceOp.SUM)\n"
        "    total = sum(p.numel() for p in model.parameters())\n"
        "    print(total)\n"
        "    return int(n_tensor.item())\n"
    )
    result = migrate_source(source, "count.py")
    found = [(f.line, f.fixable, f.note) for f in result.findings if "numel" in f.construct]
    assert found == [(8, False, False), (11, True, True)]
    (todo,) = [f for f in result.findings if not f.fixable]
    assert todo.construct.endswith("added across ranks (dist.all_reduce(n_tensor, op=dist.ReduceOp.SUM))")
    assert "p.to_local().numel()" in todo.replacement
    assert "    # TODO(fsdp-bridge): model.parameters() counted by p.numel()" in result.fixed


def test_a_method_called_on_the_fsdp1_model_that_groups_parameters_by_ndim_gets_a_note(tmp_path: Path) -> None:
    # nanoGPT's configure_optimizers, called on the wrapped model (weipipe): FSDP1's wrapper hands the call to the
    # module, whose parameters there are flat and 1-D (nothing decayed), FSDP2's keep their shapes. A method of the
    # same name never called on an FSDP1 model gets nothing.
    (tmp_path / "model.py").write_text(
        "from torch import nn\n\n\n"
        "class GPT(nn.Module):\n"
        "    def configure_optimizers(self, wd):\n"
        "        params = {n: p for n, p in self.named_parameters()}\n"
        "        decay = [p for p in params.values() if p.dim() >= 2]\n"
        "        return [{'params': decay, 'weight_decay': wd}]\n\n\n"
        "    def forward(self, x):\n"
        "        params = {n: p for n, p in self.named_parameters()}\n"
        "        return x.view(x.shape[0], -1), [p for p in params.values() if p.dim() > 1]\n\n\n"
        "class Other(nn.Module):\n"
        "    def groups(self):\n"
        "        params = {n: p for n, p in self.named_parameters()}\n"
        "        return [p for p in params.values() if p.dim() >= 2]\n"
    )
    (tmp_path / "train.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from model import GPT\n\n"
        "model = FSDP(GPT())\n"
        "groups = model.configure_optimizers(0.1)\n"
        "out = model.forward(1)\n"
    )
    report, _ = migrate_paths([tmp_path])
    (note,) = [f for f in report.findings if f.note]
    assert (Path(note.path).name, note.line) == ("model.py", 6)
    assert (
        note.construct
        == "self.named_parameters() in configure_optimizers(), which reads .dim (called on the FSDP1 model)"
    )


def test_fsdp1s_wrapper_told_by_its_class_name_becomes_is_sharded(tmp_path: Path) -> None:
    # caspo tells FSDP1's wrapper by `module.__class__.__name__ == "FullyShardedDataParallel"`: the bridge's models
    # keep the user's class name, so every FSDP branch was skipped after the rewrite (save_pretrained on DTensor
    # shards crashed). is_sharded is True for FSDP1 wrappers too, so the test keeps its meaning there; idempotent.
    (tmp_path / "wrap.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\ndef wrap(m):\n    return FSDP(m)\n"
    )
    (tmp_path / "util.py").write_text(
        "def is_fsdp(module):\n"
        "    return module.__class__.__name__ == 'FullyShardedDataParallel'\n\n\n"
        "def plain(m):\n"
        "    return type(m).__name__ != 'FullyShardedDataParallel'\n"
    )
    report, _ = migrate_paths([tmp_path], fix=True)
    fixed = (tmp_path / "util.py").read_text()
    assert (
        "    return fsdp_bridge.is_sharded(module)\n" in fixed and "    return not fsdp_bridge.is_sharded(m)\n" in fixed
    )
    assert all(f.fixable for f in report.findings)
    again, _ = migrate_paths([tmp_path], fix=True)
    assert again.changed == []


def test_a_bitsandbytes_optimizer_over_an_fsdp1_model_is_a_todo() -> None:
    # Its update kernels take plain tensors (FSDP1's flat shards); FSDP2's DTensors fail inside them (akabeko's
    # default AdamW8bit): a TODO where the optimizer takes the wrapped model's parameters, none for a plain model.
    code = (
        "import bitsandbytes as bnb\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def setup(model, plain):\n"
        "    model = FSDP(model)\n"
        "    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)\n"
        "    other = bnb.optim.AdamW8bit(plain.parameters(), lr=1e-3)\n"
        "    return optimizer, other\n"
    )
    result = migrate_source(code, "bnb_opt.py")
    (todo,) = [f for f in result.findings if not f.fixable]
    assert (todo.line, todo.construct) == (7, "bnb.optim.AdamW8bit(...)")
    assert "BridgeConfig(backend='fsdp1')" in todo.replacement
    assert result.fixed.count("TODO(fsdp-bridge)") == 1


def test_a_hand_written_gradient_norm_summed_over_ranks_gets_a_note() -> None:
    # A tree's own global grad norm: each rank's norm of its FSDP1 flat-shard gradients, squared and summed with
    # all_reduce. On FSDP2 the gradients are DTensors, the norm one too, and the collective refuses it at the first
    # step. Noted where the reduced value comes from `.grad` and a norm (here or through a function of the file);
    # not for a loss, nor for code already written for DTensors (`to_local`).
    code = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def shard_norm(net):\n"
        "    acc = 0.0\n"
        "    for w in net.parameters():\n"
        "        if w.grad is not None:\n"
        "            acc += torch.linalg.vector_norm(w.grad) ** 2\n"
        "    return acc\n\n\n"
        "def global_norm(net):\n"
        "    sq = shard_norm(net).detach()\n"
        "    dist.all_reduce(sq)\n"
        "    return sq.sqrt()\n\n\n"
        "def step(model, params, loss):\n"
        "    grads = [p.grad for p in params if p.grad is not None]\n"
        "    total = torch.nn.utils.get_total_norm(grads)\n"
        "    dist.all_reduce(total)\n"
        "    local = sum(g.to_local().norm() ** 2 for g in grads)\n"
        "    dist.all_reduce(local)\n"
        "    dist.all_reduce(loss)\n"
        "    squares = torch.zeros(())\n"
        "    for p in params:\n"
        "        squares += p.grad.float().square().sum()\n"
        "    dist.all_reduce(squares)\n"
        "    return FSDP(model)\n"
    )
    result = migrate_source(code, "norms.py")
    notes = {f.line: f for f in result.findings if f.note}
    assert sorted(notes) == [16, 23, 30], notes  # a norm's square written out counts too
    assert notes[16].construct == "dist.all_reduce(sq) (a value made from gradients)"
    assert notes[23].construct == "dist.all_reduce(total) (a value made from gradients)"
    assert "DTensors" in notes[16].replacement and "p.grad.to_local()" in notes[16].replacement
    assert "TODO" not in result.fixed


def test_name_rules_over_an_fsdp1_models_parameters_are_kept_with_a_note_on_the_flat_names() -> None:
    # FSDP1's default flat parameters are named `_flat_param`: a no-decay rule on names ("bias", "norm") matched
    # none of them, so every flat parameter decayed; on FSDP2 the rule applies to the model's names. Noted on the
    # wrapped model's parameters (a comprehension and a loop, `in` and `endswith`), not on a plain module's.
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def setup(net, head):\n"
        "    model = FSDP(net)\n"
        "    skip = ('bias', 'norm')\n"
        "    quiet = [p for n, p in model.named_parameters() if any(s in n for s in skip)]\n"
        "    loud = []\n"
        "    for key, w in model.named_parameters():\n"
        "        if not key.endswith('.scale'):\n"
        "            loud.append(w)\n"
        "    mine = [p for n, p in head.named_parameters() if 'bias' in n]\n"
        "    return torch.optim.AdamW([{'params': loud}, {'params': quiet, 'weight_decay': 0.0}]), mine\n\n\n"
        "def groups(model, decay_names):\n"
        "    return [p for n, p in model.named_parameters() if n in decay_names]\n\n\n"
        "def build(net, names):\n"
        "    wrapped = FSDP(net)\n"
        "    return groups(wrapped, names)\n"
    )
    result = migrate_source(code, "groups.py")
    notes = {f.line: f for f in result.findings if f.note}
    assert sorted(notes) == [8, 10, 18], notes
    # the name looked up among names, in a function handed the wrapped model
    assert notes[18].construct == "model.named_parameters() names tested (n in decay_names)"
    assert notes[8].construct == "model.named_parameters() names tested (s in n)"
    assert notes[10].construct == "model.named_parameters() names tested (key.endswith('.scale'))"
    assert "`_flat_param`" in notes[8].replacement and "the optimizer's groups change" in notes[8].replacement
    assert "any(s in n for s in skip)" in result.fixed and "TODO" not in result.fixed
    # a submodule read from the wrapped model (model.model) holds the flat parameters of the units nested in it
    inner = migrate_source(
        "import torch\nfrom torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def stage_two(net, norm):\n"
        "    model = FSDP(net)\n"
        "    for name, param in model.model.named_parameters():\n"
        "        param.requires_grad = 'lm_head' in name\n"
        "    torch.nn.utils.clip_grad_norm_(model.model.parameters(), norm)\n",
        "inner.py",
    )
    inner_notes = {f.line: f.construct for f in inner.findings if f.note}
    assert inner_notes[7] == "model.model.named_parameters() names tested ('lm_head' in name)", inner_notes
    assert 9 in inner_notes, inner_notes


def test_collectives_over_an_fsdp1_models_parameters_get_a_todo_and_the_clip_note_names_the_dtensor_norm() -> None:
    # FSDP2's parameters (and their .data / .grad) are DTensors, which torch.distributed's collectives refuse
    # (checked: NotImplementedError "c10d.allreduce_.default does not have a sharding strategy"): each collective
    # over an FSDP1 model's parameters is a TODO. Not before the wrap (a broadcast from rank 0 there is plain
    # tensors), not over another module's parameters, not inside summon_full_params (gathered, plain).
    code = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def run(model, ddp):\n"
        "    for p in model.parameters():\n"
        "        dist.broadcast(p.data, 0)\n"
        "    model = FSDP(model)\n"
        "    for name, p in model.named_parameters():\n"
        "        dist.all_reduce(p.grad.data)\n"
        "    dist.all_reduce_coalesced(list(model.parameters()))\n"
        "    for p in ddp.parameters():\n"
        "        dist.all_reduce(p.grad)\n"
        "    with FSDP.summon_full_params(model):\n"
        "        for p in model.parameters():\n"
        "            dist.broadcast(p.data, 0)\n"
        "    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "    return f'{norm:.3f}'\n"
    )
    result = migrate_source(code, "avg.py")
    todos = {f.line: f for f in result.findings if not f.fixable and not f.note}
    assert sorted(todos) == [11, 12], todos
    assert todos[11].construct == "dist.all_reduce(p.grad.data) over FSDP1 parameters"
    assert todos[12].construct == "dist.all_reduce_coalesced(list(model.parameters())) over FSDP1 parameters"
    assert "p.to_local()" in todos[11].replacement and "NotImplementedError" in todos[11].replacement
    assert result.fixed.count("# TODO(fsdp-bridge): dist.") == 2
    (note,) = [f for f in result.findings if f.note]
    assert "norm.full_tensor()" in note.replacement


def test_a_subclass_of_lightnings_fsdp_strategy_is_reported() -> None:
    # The subclass hands its FSDP1 arguments to Lightning through super().__init__: Lightning still wraps the
    # model in FSDP1 after --fix, so the class gets the strategy's TODO; a class of another base does not.
    code = (
        "import torch\n"
        "from lightning.pytorch.strategies import FSDPStrategy, DDPStrategy\n"
        "from torch.distributed.fsdp import MixedPrecision\n\n\n"
        "class HalfStrategy(FSDPStrategy):\n"
        "    def __init__(self, **kwargs):\n"
        '        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)\n'
        "        super().__init__(**kwargs)\n\n\n"
        "class PlainStrategy(DDPStrategy):\n"
        "    pass\n"
    )
    result = migrate_source(code, "strategies.py")
    (todo,) = [f for f in result.findings if not f.fixable and not f.note]
    assert todo.construct == "class HalfStrategy(FSDPStrategy) (a subclass of Lightning's FSDP1 strategy)"
    assert todo.line == 6 and "ModelParallelStrategy" in todo.replacement
    assert "read by Lightning, not by fsdp_bridge" in todo.replacement
    assert "# TODO(fsdp-bridge): class HalfStrategy(FSDPStrategy)" in result.fixed
    assert result.fixed.count("TODO(fsdp-bridge)") == 1
    # The FSDP1 value it builds goes to Lightning: a note, not a construct the bridge handles.
    (value,) = [f for f in result.findings if f.construct == "MixedPrecision"]
    assert value.note and "Lightning's FSDPStrategy of this file reads it" in value.replacement
    assert migrate_source(result.fixed, "again.py").fixed == result.fixed


def test_fsdp1s_rekeying_of_an_optimizer_state_is_reported() -> None:
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, OptimStateKeyType\n\n\n"
        "def load(net, opt, saved):\n"
        "    model = FSDP(net)\n"
        "    by_name = FSDP.rekey_optim_state_dict(saved, OptimStateKeyType.PARAM_NAME, model)\n"
        "    opt.load_state_dict(by_name)\n"
        "    return model\n"
    )
    result = migrate_source(code, "load.py")
    (todo,) = [f for f in result.findings if f.construct == "FSDP.rekey_optim_state_dict"]
    assert not todo.fixable and todo.line == 6 and "set_optimizer_state_dict" in todo.replacement
    assert "# TODO(fsdp-bridge): FSDP.rekey_optim_state_dict" in result.fixed


def test_the_wrapped_module_of_a_unit_reached_by_index_is_rewritten_with_what_it_holds() -> None:
    # X._fsdp_wrapped_module on any expression (a unit of a list, a call's result), with a forwarded read
    # inside it rewritten too: fsdp_bridge.unwrapped of the rewritten expression.
    code = (
        "def first_block(trainer):\n"
        "    blocks = trainer.model._fsdp_wrapped_module.layers\n"
        "    return blocks[0]._fsdp_wrapped_module, trainer.model._fsdp_wrapped_module.layers[1]._fsdp_wrapped_module\n"
    )
    result = migrate_source(code, "probe.py")
    assert all(f.fixable for f in result.findings) and len(result.findings) == 4
    assert "    blocks = trainer.model.layers\n" in result.fixed
    assert (
        "    return fsdp_bridge.unwrapped(blocks[0]), fsdp_bridge.unwrapped(trainer.model.layers[1])\n" in result.fixed
    )
    assert migrate_source(result.fixed, "probe.py").fixed == result.fixed


def test_a_model_compiled_and_wrapped_by_fsdp1_gets_a_note_on_the_compile_prefix_of_its_keys() -> None:
    # FSDP1's state dict of a compiled module names keys "_orig_mod.x"; the DCP state-dict functions the
    # rewrites use drop the prefix (seen on mini-llm-pretraining's checkpoints under migrate verify).
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType\n\n\n"
        "def setup(model, other):\n"
        "    model = torch.compile(model)\n"
        "    other = torch.compile(other)\n"
        "    model = FSDP(model)\n"
        "    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):\n"
        "        return model.state_dict()\n"
    )
    result = migrate_source(code, "compiled.py")
    (note,) = [f for f in result.findings if f.note]
    assert note.construct == "torch.compile(model) of a model FSDP1 wraps" and note.line == 6
    assert "'_orig_mod.'" in note.replacement
    assert "    model = torch.compile(model)\n" in result.fixed
    no_state = code.split("    with FSDP")[0].replace(", StateDictType", "") + "    return model\n"
    assert not [f for f in migrate_source(no_state, "p.py").findings if f.note]


def test_a_duck_typed_test_for_fsdp1s_clip_lets_the_bridges_models_in_or_is_a_todo(tmp_path: Path) -> None:
    # A helper of the tree tells FSDP1's wrapper by its method; the bridge's FSDP2 models lack it, so the other
    # branch would run: torch's clip over DTensors returns a DTensor norm (a crash where the caller makes it a
    # tensor). Where the guarded call becomes fsdp_bridge's (the model handed is FSDP1's), the test lets the
    # bridge's models in; where nothing shows it, a TODO. ``m.no_sync()`` under its test is always rewritten
    # (fsdp_bridge.no_sync is any object's own call; on FSDP2 the other branch reduced every micro-step, whose
    # rounding a verify run of a public trainer showed); another object's no_sync(model) keeps a note. Idempotent.
    (tmp_path / "train.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from helpers import clip\n\n\n"
        "def main(model):\n"
        "    model = FSDP(model)\n"
        "    return clip(model, 1.0)\n"
    )
    helper = (
        "import contextlib\n"
        "import torch\n\n\n"
        "def clip(module, n):\n"
        "    if hasattr(module, 'clip_grad_norm_'):  # FSDP\n"
        "        return module.clip_grad_norm_(n)\n"
        "    return torch.nn.utils.clip_grad_norm_(module.parameters(), n)\n\n\n"
        "def other(module, n):\n"
        "    return module.clip_grad_norm_(n) if hasattr(module, 'clip_grad_norm_') else None\n\n\n"
        "def sync(module):\n"
        "    return module.no_sync() if hasattr(module, 'no_sync') else contextlib.nullcontext()\n\n\n"
        "def sync_by(accelerator, module):\n"
        "    return accelerator.no_sync(module) if hasattr(accelerator, 'no_sync') else contextlib.nullcontext()\n\n\n"
        "def switch(engine):\n"
        "    if hasattr(engine, 'no_sync'):\n"
        "        engine.no_sync()  # called, not entered: another object's own switch\n"
    )
    (tmp_path / "helpers.py").write_text(helper)
    report, _ = migrate_paths([tmp_path], fix=True)
    ducks = {(f.line, f.fixable, f.note) for f in report.findings if "told by its method" in f.construct}
    assert ducks == {(6, True, False), (12, False, False), (16, True, False), (20, True, True), (24, True, True)}
    # the notes: no backward() in the file (inference under no_sync): nothing changes there
    (note,) = [f for f in report.findings if f.line == 20 and "told by its method" in f.construct]
    assert "this file calls no backward(), and no_sync acts only in backward" in note.replacement
    fixed = (tmp_path / "helpers.py").read_text()
    assert (
        '    return fsdp_bridge.no_sync(module) if (hasattr(module, "no_sync") or fsdp_bridge.is_sharded(module)) '
        "else contextlib.nullcontext()\n"
    ) in fixed
    assert "    return accelerator.no_sync(module) if hasattr(accelerator, 'no_sync') else" in fixed
    assert "        engine.no_sync()  # called" in fixed  # --target torch's helper is a context: the call would go
    assert '    if (hasattr(module, "clip_grad_norm_") or fsdp_bridge.is_sharded(module)):  # FSDP\n' in fixed
    assert "        return fsdp_bridge.clip_grad_norm_(module, n)\n" in fixed
    assert fixed.count("write fsdp_bridge.clip_grad_norm_(module, max_norm) for both branches") == 1
    migrate_paths([tmp_path], fix=True)
    assert (tmp_path / "helpers.py").read_text() == fixed
    # a backward in the file: the other branch reduces every micro-step on FSDP2, which the note says
    (tmp_path / "helpers.py").write_text(helper + "\n\ndef step(loss):\n    loss.backward()\n")
    report, _ = migrate_paths([tmp_path])
    (note,) = [f for f in report.findings if f.line == 20 and "told by its method" in f.construct]
    assert "gradients reduced at every micro-step" in note.replacement
    # a tree that makes no FSDP1 model: nobody's business
    (tmp_path / "train.py").unlink()
    (tmp_path / "helpers.py").write_text(helper)
    plain, _ = migrate_paths([tmp_path])
    assert plain.findings == []


def test_an_attribute_assigned_a_plain_module_above_in_the_same_method_is_not_taken_for_the_wrapper() -> None:
    # The class wraps self.dit in another method; here it was just built (a from_pretrained), so its load and
    # its parameter count are the plain module's: no TODO, no note. A method call of the instance between
    # (which could wrap it) keeps the class-wide evidence.
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType\n\n\n"
        "class Trainer:\n"
        "    def configure(self, path):\n"
        "        self.dit = Model.from_pretrained(path)\n"
        "        self.dit.load_state_dict(torch.load(path))\n"
        "        n = sum(p.numel() for p in self.dit.parameters())\n"
        "        self.wrap()\n"
        "        m = sum(p.numel() for p in self.dit.parameters())\n"
        "        return n, m\n\n"
        "    def wrap(self):\n"
        "        self.dit = FSDP(self.dit)\n"
        "        FSDP.set_state_dict_type(self.dit, StateDictType.FULL_STATE_DICT)\n"
    )
    result = migrate_source(code, "trainer.py")
    lines = sorted(f.line for f in result.findings if f.line < 13)
    assert lines == [11], result.findings
    assert "        self.dit.load_state_dict(torch.load(path))\n" in result.fixed


def test_an_optimizer_state_taken_just_above_is_fsdp1s_default_and_the_call_follows_the_set_type() -> None:
    # states = optimizer.state_dict(); FSDP.optim_state_dict(model=..., optim=..., optim_state_dict=states) is
    # the optimizer's own state: the bridge's call (which follows the type set above) reads the same.
    code = (
        "from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType, FullStateDictConfig\n\n\n"
        "def states(model: FullyShardedDataParallel, optimizer, other):\n"
        "    FullyShardedDataParallel.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig())\n"
        "    states = optimizer.state_dict()\n"
        "    states = FullyShardedDataParallel.optim_state_dict(model=model, optim=optimizer, optim_state_dict=states)\n"
        "    moved = FullyShardedDataParallel.optim_state_dict(model, optimizer, other)\n"
        "    return states, moved\n"
    )
    result = migrate_source(code, "opt.py")
    assert "    states = fsdp_bridge.optim_state_dict(model, optimizer)\n" in result.fixed
    todo = [f for f in result.findings if not f.fixable]
    assert [f.line for f in todo] == [8] and "optim_state_dict=other is not shown" in todo[0].replacement


def test_getattr_of_fsdp1s_methods_is_a_todo_without_a_default_and_a_note_with_one(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def main(model):\n"
        "    return FSDP(model)\n"
    )
    (tmp_path / "step.py").write_text(
        "def step(module, loss):\n"
        "    ctx = getattr(module, 'no_sync', None)\n"
        "    clip = getattr(module, 'clip_grad_norm_')\n"
        "    return ctx, clip\n"
    )
    report, _ = migrate_paths([tmp_path])
    found = {(f.line, f.fixable, f.note) for f in report.findings if f.path.endswith("step.py")}
    assert found == {(2, True, True), (3, False, False)}, report.findings


def test_an_optimizers_own_state_saved_beside_an_fsdp1_models_state_dict_gets_a_note_on_its_layout() -> None:
    # FSDP1's optimizer over flat parameters holds flat-shard state; FSDP2's per-parameter DTensor state: an old
    # checkpoint's optimizer state does not load after the migration (seen with migrate verify on a public
    # trainer). Once per file; not where FSDP1's optimizer-state functions read that state.
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType\n\n\n"
        "def save(model, optimizer, path):\n"
        "    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):\n"
        "        state = model.state_dict()\n"
        "    torch.save({'model': state, 'optimizer': optimizer.state_dict()}, path)\n\n\n"
        "def save_optim(model, optimizer, path):\n"
        "    FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)\n"
        "    torch.save(FSDP.optim_state_dict(model, optimizer, optimizer.state_dict()), path)\n"
    )
    result = migrate_source(code, "ckpt.py")
    (note,) = [f for f in result.findings if f.note and "saved beside" in f.construct]
    assert note.line == 8 and note.construct == "optimizer.state_dict() saved beside an FSDP1 model's state dict"
    assert "fsdp_bridge.optim_state_dict(model, optimizer)" in note.replacement
    # a script's own checkpoint: torch.save of the optimizer's state at module level, in a file wrapping with FSDP1
    script = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n"
        "model = FSDP(torch.nn.Linear(2, 2))\n"
        "optimizer = torch.optim.AdamW(model.parameters())\n"
        "scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)\n"
        "torch.save({'optimizer': optimizer.state_dict(), 'scheduler': scheduler.state_dict()}, 'state.pt')\n"
        "print(optimizer.state_dict())\n"
    )
    notes = [f for f in migrate_source(script, "train.py").findings if f.note]
    assert [(f.line, f.construct) for f in notes] == [
        (7, "optimizer.state_dict() saved with torch.save beside FSDP1 models")
    ]


def test_a_model_chosen_by_a_conditional_expression_is_followed_into_the_functions_it_is_handed_to(
    tmp_path: Path,
) -> None:
    # m = model if fsdp else model.module: FSDP1's model on one branch; a weight-decay split in another file
    # reads p.ndim over its parameters (1-D flat shards on FSDP1: no decay at all there). Seen on a public DiT
    # trainer whose migrate verify diverged by exactly that.
    (tmp_path / "train.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from groups import split\n\n\n"
        "def main(net, fsdp):\n"
        "    model = FSDP(net)\n"
        "    for_opt = model if fsdp else model.module\n"
        "    return split(for_opt)\n"
    )
    (tmp_path / "groups.py").write_text(
        "def split(model):\n    return [p for n, p in model.named_parameters() if p.ndim > 1]\n"
    )
    report, _ = migrate_paths([tmp_path])
    todos = [(f.path.rsplit("/", 1)[-1], f.line) for f in report.findings if not f.fixable]
    assert todos == [("groups.py", 2)], report.findings


def test_the_fsdp2_test_of_a_guarded_state_dict_looks_inside_torch_compiles_wrapper() -> None:
    # torch.compile's OptimizedModule around the sharded model is no FSDPModule: the guard tests its _orig_mod,
    # else a compiled run took the plain branch and saved one rank's shards.
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n\n\n"
        "def run(model, fsdp, compile, path):\n"
        "    if fsdp:\n"
        "        model = FSDP(model)\n"
        "    else:\n"
        "        model = DDP(model)\n"
        "    if compile:\n"
        "        model = torch.compile(model)\n"
        "    torch.save(model.state_dict(), path)\n"
    )
    fixed = migrate_source(code, "run.py").fixed
    assert (
        "if isinstance(model, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in model.modules()) else model.state_dict()"
        in fixed
    )
    assert migrate_source(fixed, "run.py").fixed == fixed


def test_comments_above_a_removed_fsdp1_import_stay_and_an_enable_wrap_with_overrides_stays_fsdp1s() -> None:
    # The user's commented-out lines above an FSDP1 import the rewrite removes are kept; a wrap(m, **overrides)
    # under torch's enable_wrap cannot run inside fsdp_bridge.enable_wrap, so the whole block stays FSDP1's.
    code = (
        "import torch\n"
        "# torch.backends.cuda.enable_flash_sdp(False)\n\n"
        "# FSDP below\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.distributed.fsdp.wrap import enable_wrap, wrap\n\n\n"
        "def run(net, head):\n"
        "    model = FSDP(net)\n"
        "    with enable_wrap(wrapper_cls=FSDP, limit_all_gathers=True):\n"
        "        head = wrap(head, use_orig_params=True)\n"
        "    return model, head\n"
    )
    result = migrate_source(code, "run.py")
    assert "# torch.backends.cuda.enable_flash_sdp(False)\n" in result.fixed
    assert "    with enable_wrap(wrapper_cls=FSDP, limit_all_gathers=True):\n" in result.fixed
    assert "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n" in result.fixed
    todos = sorted(f.construct for f in result.findings if not f.fixable)
    assert todos == ["enable_wrap(...)", "wrap(...)"], result.findings
    plain = code.replace("    with enable_wrap(wrapper_cls=FSDP, limit_all_gathers=True):\n", "    if True:\n")
    plain = plain.replace("wrap(head, use_orig_params=True)", "head")
    fixed = migrate_source(plain, "run.py").fixed
    assert (
        "# torch.backends.cuda.enable_flash_sdp(False)\n\n# FSDP below\n" in fixed
        and "import FullyShardedDataParallel" not in fixed
    )


def test_lightning_backward_prefetch_and_a_checkpointing_policy_without_a_wrap_policy_are_named() -> None:
    # FSDPStrategy(backward_prefetch=None) is no prefetch (its text once read 'backward_prefetch= (BACKWARD_PRE ->
    # "pre")'); a checkpointing policy on a strategy with no auto_wrap_policy needs wrap= for the bridge's units.
    code = (
        "from lightning.pytorch.strategies import FSDPStrategy\n"
        "from torch.distributed.fsdp import BackwardPrefetch\n\n"
        "a = FSDPStrategy(activation_checkpointing_policy=blocks, backward_prefetch=None)\n"
        "b = FSDPStrategy(auto_wrap_policy=policy, activation_checkpointing_policy=blocks,\n"
        "                 backward_prefetch=BackwardPrefetch.BACKWARD_POST)\n"
    )
    notes = {(f.line, f.construct): f.replacement for f in migrate_source(code, "l.py").findings if f.note}
    assert notes[(4, "backward_prefetch=None")].startswith('backward_prefetch="none" (no prefetch')
    assert "give wrap= the classes the policy names" in notes[(4, "activation_checkpointing_policy=blocks")]
    assert "give wrap=" not in notes[(5, "activation_checkpointing_policy=blocks")]
    assert notes[(6, "backward_prefetch=BackwardPrefetch.BACKWARD_POST")].startswith('backward_prefetch="pre" (FSDP2')


def test_ray_trains_fsdp_strategy_and_a_subclass_of_it_are_reported() -> None:
    # Ray Train's RayFSDPStrategy is Lightning's FSDPStrategy (FSDP1 inside Lightning): a trainer built on a subclass
    # of it was reported as migrated while it still trained on FSDP1.
    code = (
        "from ray.train.lightning import RayFSDPStrategy\n\n\n"
        "class Custom(RayFSDPStrategy):\n"
        "    pass\n\n\n"
        "def build(policy):\n"
        "    return RayFSDPStrategy(auto_wrap_policy=policy)\n"
    )
    todos = [(f.line, f.construct) for f in migrate_source(code, "train.py").findings if not f.fixable]
    assert todos == [
        (4, "class Custom(RayFSDPStrategy) (a subclass of Lightning's FSDP1 strategy)"),
        (9, "RayFSDPStrategy(...) (Lightning's FSDP1 strategy)"),
    ]


def test_torchs_own_scaler_beside_an_fsdp1_model_gets_a_note() -> None:
    # torch.amp's scaler checks each rank's flat shard alone on FSDP1 (ranks may step apart), the whole model on
    # FSDP2: a note where the file wraps a model with FSDP1, none in a file that does not.
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def setup(net):\n"
        "    model = FSDP(net)\n"
        "    return model, torch.cuda.amp.GradScaler(), torch.amp.GradScaler('cuda')\n"
    )
    result = migrate_source(code, "amp.py")
    notes = [(f.line, f.construct) for f in result.findings if f.note]
    assert notes == [
        (7, "torch.cuda.amp.GradScaler(...) (torch's scaler, beside an FSDP1 model)"),
        (7, "torch.amp.GradScaler(...) (torch's scaler, beside an FSDP1 model)"),
    ]
    assert "every rank skips the same steps" in next(f.replacement for f in result.findings if f.note)
    plain = migrate_source("import torch\n\nscaler = torch.amp.GradScaler('cuda')\n", "plain.py")
    assert not plain.findings


def test_torchs_clip_over_a_model_with_ignored_parameters_is_a_todo() -> None:
    # FSDP(model, ignored_states=[...]): those parameters stay plain beside FSDP2's DTensors, and torch's clip over
    # both raises at the first step: a TODO naming the bridge's clip (one global norm over both kinds)
    code = (
        "import torch\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def step(module, lora, loss):\n"
        "    model = FSDP(module, ignored_states=list(lora.parameters()))\n"
        "    loss.backward()\n"
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
    )
    result = migrate_source(code, "step.py")
    (todo,) = [f for f in result.findings if f.construct.startswith("torch.nn.utils.clip_grad_norm_")]
    assert not todo.fixable and not todo.note and "fsdp_bridge.clip_grad_norm_(model, max_norm)" in todo.replacement
    assert "# TODO(fsdp-bridge)" in result.fixed


def test_an_fsdp1_test_around_a_norm_summed_by_hand_is_kept() -> None:
    # `if isinstance(model, FSDP):` around a gradient norm summed over the ranks with dist.all_reduce (FSDP1's
    # flat shards): as fsdp_bridge.is_sharded it sent FSDP2 models into a collective over DTensors, which raised
    # at the first step; kept, FSDP2 models take the other branch, whose norm of DTensor gradients is global.
    code = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def grad_norm(model):\n"
        "    if isinstance(model, FSDP):\n"
        "        total = torch.zeros(())\n"
        "        for p in model.parameters():\n"
        "            total = total + p.grad.float().norm() ** 2\n"
        "        dist.all_reduce(total)\n"
        "        return total.sqrt()\n"
        "    return torch.stack([p.grad.norm() for p in model.parameters()]).norm()\n\n\n"
        "def check(model):\n"
        "    return isinstance(model, FSDP)\n\n\n"
        "def build(m):\n"
        "    return FSDP(m)\n"
    )
    result = migrate_source(code, "norm.py")
    kept = next(f for f in result.findings if f.line == 7)
    assert kept.fixable and kept.replacement.startswith("kept as is: its branch sums a gradient norm")
    assert "    if isinstance(model, FSDP):\n" in result.fixed
    assert "    return fsdp_bridge.is_sharded(model)\n" in result.fixed  # elsewhere the test is rewritten
    # no other branch for FSDP2 models (the norm logged, a clip inside): the test is rewritten as usual, the
    # collective keeps its note (kept, FSDP2 models would skip the branch's work silently)
    alone = code.replace("        return total.sqrt()\n", "        print(total.sqrt())\n").replace(
        "    return torch.stack([p.grad.norm() for p in model.parameters()]).norm()\n", ""
    )
    assert "    if fsdp_bridge.is_sharded(model):\n" in migrate_source(alone, "norm.py").fixed
