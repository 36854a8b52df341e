"""FSDP1's LOCAL_STATE_DICT blocks saved and loaded per rank, and the optimizer-state calls given the
optimizer's own state or the default group by keyword (fsdp_bridge.migrate.fixers._local_state)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from fsdp_bridge.migrate._code import migrate_source

FIXTURE = Path(__file__).parent / "fixtures" / "migrate" / "local_state_dict.py"


def test_per_rank_local_blocks_lose_every_fsdp1_name_and_fix_once() -> None:
    # That the rewrite resumes like FSDP1 (2 gloo ranks, losses step for step) is checked in the spawn of
    # tests/test_migrate_code.py::test_rewritten_scripts_match_fsdp1_losses.
    result = migrate_source(FIXTURE.read_text(), FIXTURE.name)
    assert "StateDictType" not in result.fixed and "FSDP." not in result.fixed
    assert migrate_source(result.fixed, FIXTURE.name).fixed == result.fixed


LOCAL_TODOS = textwrap.dedent(
    """
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, LocalStateDictConfig, StateDictType

    CONFIGS = {"local": LocalStateDictConfig}


    class Keeper(Base):
        def state(self):
            with FSDP.state_dict_type(self.model, StateDictType.LOCAL_STATE_DICT):
                return self.model.state_dict()

        def restore(self, *args):
            with FSDP.state_dict_type(self.model, StateDictType.LOCAL_STATE_DICT):
                return super().restore(*args)

        def export(self, path):
            with FSDP.state_dict_type(self.model, StateDictType.LOCAL_STATE_DICT):
                sd = self.model.state_dict()
            torch.save(rename_flat_keys(sd), path)

        def take(self, sd):
            with FSDP.state_dict_type(self.model, StateDictType.LOCAL_STATE_DICT):
                self.model.load_state_dict(sd)
    """
)


def test_local_blocks_whose_state_may_meet_fsdp1_keys_stay_todos_saying_why() -> None:
    result = migrate_source(LOCAL_TODOS, "keeper.py")
    todos = {f.line: f.replacement for f in result.findings if not f.fixable}
    assert set(todos) == {5, 10, 14, 18, 23}, todos
    assert "returned, kept, or handed to code" in todos[10]
    assert "super().restore" in todos[14]
    assert "returned, kept, or handed to code" in todos[18]  # rename_flat_keys(sd) reads it first
    assert "does not come from torch.load" in todos[23]
    assert "StateDictOptions" not in result.fixed  # nothing rewritten, nothing imported
    # a registry of config classes: which type runs is chosen at run time
    assert todos[5].startswith("fsdp_bridge.save_checkpoint")
    assert all("fsdp-bridge convert" in todos[line] for line in (10, 14, 18, 23))
    assert result.fixed.count("StateDictType.LOCAL_STATE_DICT):") == 4
    assert migrate_source(result.fixed, "keeper.py").fixed == result.fixed


def test_a_local_block_keeps_the_note_about_fsdp1_local_checkpoints() -> None:
    result = migrate_source(FIXTURE.read_text(), FIXTURE.name)
    notes = [f for f in result.findings if f.construct.startswith("FSDP1-format checkpoint")]
    assert len(notes) == 1 and "LOCAL_STATE_DICT" in notes[0].construct
    assert "cannot resume FSDP1's flat-parameter checkpoints" in notes[0].replacement


KEYWORDS = textwrap.dedent(
    """
    import torch
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


    def save(model: FSDP, optimizer, path):
        with FSDP.state_dict_type(
            module=model,
            state_dict_type=StateDictType.FULL_STATE_DICT,
            state_dict_config=FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
            optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
        ):
            weights = model.state_dict()
            own = optimizer.state_dict()
            osd = FSDP.optim_state_dict(model=model, optim=optimizer, optim_state_dict=own)
        torch.save({"model": weights, "optim": osd}, path)


    def save_stale(model: FSDP, optimizer, path):
        own = optimizer.state_dict()
        optimizer.step()
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            osd = FSDP.optim_state_dict(model=model, optim=optimizer, optim_state_dict=own)
        torch.save(osd, path)


    def load(model: FSDP, optimizer, path, rank, group):
        full = torch.load(path) if rank == 0 else None
        sharded = FSDP.scatter_full_optim_state_dict(full_optim_state_dict=full, model=model, group=None)
        optimizer.load_state_dict(sharded)
        other = FSDP.scatter_full_optim_state_dict(full_optim_state_dict=full, model=model, group=group)
        optimizer.load_state_dict(other)
    """
)


def test_keyword_optimizer_calls_with_fsdp1s_defaults_are_rewritten_like_positional_ones() -> None:
    result = migrate_source(KEYWORDS, "ckpt.py")
    by_line = {f.line: f for f in result.findings}
    fixed = result.fixed
    # optim_state_dict= the optimizer's own state, taken just above: FSDP1's default for that argument
    assert by_line[8].fixable and "get_optimizer_state_dict" in by_line[8].replacement
    assert (
        "osd = get_optimizer_state_dict(model, optimizer, "
        "options=StateDictOptions(full_state_dict=True, cpu_offload=True))" in fixed
    )
    # the optimizer stepped between: the state given is not what FSDP1's default would take
    assert not by_line[24].fixable and "FULL_STATE_DICT" in by_line[24].replacement
    assert "FSDP.optim_state_dict(model=model, optim=optimizer, optim_state_dict=own)" in fixed
    # group=None is the default group; another group is not
    assert "sharded = fsdp_bridge.optim_state_dict_to_load(model, optimizer, full, options=" in fixed
    assert "broadcast_from_rank0=True" in fixed and by_line[30].fixable
    assert not by_line[32].fixable and "group" in by_line[32].replacement
    assert migrate_source(fixed, "ckpt.py").fixed == fixed


PAIR = textwrap.dedent(
    """
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType


    class Keeper(Base):
        def write(self, path):
            with FSDP.state_dict_type(self.model, StateDictType.LOCAL_STATE_DICT):
                data = {"model": self.model.state_dict()}
            torch.save(data, path)

        def read(self, path):
            with FSDP.state_dict_type(self.model, StateDictType.LOCAL_STATE_DICT):
                return super().read(path)
    """
)


def test_a_local_save_is_not_rewritten_while_its_load_stays_fsdp1s() -> None:
    # What one block saves the other loads: rewriting the save alone would write a format the kept load
    # cannot read (FSDP1's local load asserts on flat parameters), so both keep FSDP1's format.
    result = migrate_source(PAIR, "keeper.py")
    local = [f for f in result.findings if f.construct.startswith("FSDP.state_dict_type(LOCAL")]
    assert [f.fixable for f in local] == [False, False], local
    assert "in read() in this file stays FSDP1's" in local[0].replacement, local[0]
    assert (
        result.fixed.count("StateDictType.LOCAL_STATE_DICT):") == 2
        and migrate_source(result.fixed, "keeper.py").fixed == result.fixed
    )
    assert (
        "get_model_state_dict(self.model" not in result.fixed
        and "from torch.distributed.checkpoint" not in result.fixed
    )


def test_a_local_block_around_the_optimizers_own_state_is_dropped_with_the_checkpoint_note() -> None:
    # the block changes nothing on FSDP2 (the optimizer's own state is this rank's either way), but what the
    # FSDP1 code wrote in it (flat-parameter pieces) does not resume: the report says so once, and the optimizer's
    # own state's layout change beside it (the checkpoint note speaks of the model's state only)
    code = textwrap.dedent(
        """
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType


        def save(model: FSDP, optimizer, path):
            with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
                torch.save(optimizer.state_dict(), path)
        """
    )
    result = migrate_source(code, "saver.py")
    notes = [f for f in result.findings if f.note]
    assert [n.construct for n in notes] == [
        "FSDP1-format checkpoint (LOCAL_STATE_DICT)",
        "optimizer.state_dict() saved beside an FSDP1 model's state dict",
    ]
    assert "cannot resume FSDP1's flat-parameter checkpoints" in notes[0].replacement
    assert "state_dict_type" not in result.fixed and all(f.fixable for f in result.findings)


DCP_LOCAL = textwrap.dedent(
    """
    from torch.distributed._shard.checkpoint import FileSystemReader, FileSystemWriter, load_state_dict, save_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType


    def save_local(model, folder):
        writer = FileSystemWriter(folder)
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            state_dict = model.state_dict()
        save_state_dict(state_dict, writer)


    def load_local(model, folder):
        reader = FileSystemReader(folder)
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            state_dict = model.state_dict()
            load_state_dict(state_dict, reader)
            model.load_state_dict(state_dict)
    """
)


def test_local_blocks_saved_and_filled_with_dcp_become_the_sharded_state_dict() -> None:
    # The per-rank DCP checkpoint of torch's old FSDP examples (the _shard.checkpoint spelling): the state only
    # goes to DCP's save, or is filled in place by DCP's load and given back to the model in the block. The
    # migrated pair saves and resumes DTensor shards (tests/test_migrate_code.py runs the modern spelling).
    result = migrate_source(DCP_LOCAL, "ckpt.py")
    assert [f.line for f in result.findings if not f.fixable] == []
    assert (
        "    state_dict = get_model_state_dict(model, options=StateDictOptions())\n"
        "    save_state_dict(state_dict, writer)\n"
    ) in result.fixed
    assert (
        "    state_dict = get_model_state_dict(model, options=StateDictOptions())\n"
        "    load_state_dict(state_dict, reader)\n"
        "    set_model_state_dict(model, state_dict, options=StateDictOptions())\n"
    ) in result.fixed
    assert "FSDP" not in result.fixed and "StateDictType" not in result.fixed
    assert migrate_source(result.fixed, "ckpt.py").fixed == result.fixed
    # filled by DCP's load but never given back (FSDP1's local shards may not share the parameters' storage),
    # or given back outside the block (FSDP1's type is gone there): what the model ends up holding is not
    # provable, and both blocks stay FSDP1's (what one saves the other loads)
    for changed in (
        DCP_LOCAL.replace("        model.load_state_dict(state_dict)\n", ""),
        DCP_LOCAL.replace("        model.load_state_dict(state_dict)\n", "    model.load_state_dict(state_dict)\n"),
    ):
        kept = migrate_source(changed, "ckpt.py")
        todos = [f for f in kept.findings if not f.fixable]
        assert [f.construct for f in todos] == ["FSDP.state_dict_type(LOCAL_STATE_DICT)"] * 2, changed
        assert "DCP's in-place load" in todos[0].replacement and "fsdp-bridge convert" in todos[0].replacement
