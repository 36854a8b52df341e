"""``fsdp_bridge.lightning.FabricStrategy`` / ``TrainerStrategy``: Lightning Fabric's and PyTorch Lightning's
Trainer's FSDP1 strategy arguments on FSDP2, and the codemod that moves ``FSDPStrategy(...)`` to them only where
nothing else in the tree depends on the strategy's class.

The arguments are read in one process (no process group: the strategies read them when they are made); a
``migrate verify`` run each (2 gloo ranks under torchrun, each tree) checks a Fabric trainer and a Trainer script
written for Lightning's FSDP1 strategy give the same losses and checkpoint after ``--fix``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy

from fsdp_bridge.cli import main
from fsdp_bridge.errors import ConfigError
from fsdp_bridge.lightning import _PRECISION_DTYPES, FabricStrategy, TrainerStrategy
from fsdp_bridge.migrate._code import migrate_paths

FIXTURES = Path(__file__).parent / "fixtures"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


class Other(nn.Module):
    pass


def test_fsdp1_arguments_mean_what_lightnings_fsdp1_strategy_made_of_them() -> None:
    strategy = FabricStrategy(
        auto_wrap_policy={Block},
        activation_checkpointing_policy={Block},
        state_dict_type="full",
        limit_all_gathers=True,
        cpu_offload=False,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        sharding_strategy="shard_grad_op",
    )
    config = strategy.config
    assert config.strategy.value == "shard_grad_op" and config.backward_prefetch.value == "pre"
    assert config.activation_checkpointing is True and config.cpu_offload is False
    assert strategy._save_distributed_checkpoint is False  # state_dict_type="full": one file from rank 0
    assert FabricStrategy()._save_distributed_checkpoint is True  # Lightning's default "sharded"
    assert FabricStrategy().config.strategy.value == "full_shard"

    hybrid = FabricStrategy(sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=(2, 2)).config
    assert hybrid.strategy.value == "hybrid_shard" and hybrid.hybrid_shape == (2, 2)

    # classes to recompute other than the wrap units: torch's checkpoint wrapper on those classes, as Lightning does
    other = FabricStrategy(auto_wrap_policy={Block}, activation_checkpointing=[Other])
    assert other.config.activation_checkpointing is False and callable(other._checkpointing)
    assert other._checkpointing()["check_fn"](Other()) and not other._checkpointing()["check_fn"](Block())


def test_fabric_precision_is_lightnings_fsdp1_plugin_and_16_mixed_is_given_to_the_strategy() -> None:
    import lightning as L
    from lightning.fabric.plugins.precision import FSDPPrecision

    # the plugin Fabric makes of a name for other strategies becomes FSDP1's: its autocast, casts and dtypes
    for name, dtype in (("bf16-mixed", "bf16"), ("bf16-true", "bf16"), ("32-true", None), ("16-true", "fp16")):
        strategy = L.Fabric(accelerator="cpu", devices=1, strategy=FabricStrategy(), precision=name).strategy
        assert isinstance(strategy.precision, FSDPPrecision) and strategy.precision.precision == name
        assert _PRECISION_DTYPES[name] == dtype
    fp16 = FabricStrategy(precision=16)  # Lightning's older spelling
    assert fp16.precision.precision == "16-mixed" and fp16.precision.scaler is not None
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=fp16, precision="16-mixed")
    assert fabric.strategy.precision is fp16.precision
    with pytest.raises(ValueError, match=r"does not support `Fabric\(\.\.\., precision='16-mixed'\)`"):
        L.Fabric(accelerator="cpu", devices=1, strategy=FabricStrategy(), precision="16-mixed")  # Lightning's own
    with pytest.raises(ConfigError, match="precision: got '8-mixed'; allowed: 32-true, 16-true"):
        FabricStrategy(precision="8-mixed")


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"state_dict_type": "local"}, "state_dict_type: got 'local'; allowed: 'full' or 'sharded'"),
        ({"sharding_strategy": "zero3"}, "sharding_strategy: got 'zero3'; allowed: FULL_SHARD, SHARD_GRAD_OP"),
        ({"device_mesh": (2, 2)}, "device_mesh: got (2, 2); allowed: a (replicate, shard) pair only with a HYBRID_*"),
        ({"checkpoint_io": object()}, "Fix: drop checkpoint_io="),
        ({"param_init_fn": 42}, "param_init_fn"),
        (
            {"activation_checkpointing": Block, "activation_checkpointing_policy": {Block}},
            "Fix: drop activation_checkpointing= and keep activation_checkpointing_policy=",
        ),
    ],
)
def test_what_fsdp2_cannot_honour_is_refused_when_the_strategy_is_made(kwargs: dict[str, object], said: str) -> None:
    for strategy in (FabricStrategy, TrainerStrategy):
        with pytest.raises(ConfigError) as err:
            strategy(**kwargs)  # type: ignore[arg-type]
        assert said in str(err.value)


def test_the_trainers_strategy_reads_fsdp1_arguments_and_keeps_lightnings_fsdp1_precision_plugin() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import FSDPPrecision

    strategy = TrainerStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}, cpu_offload=True)
    assert strategy.config.wrap.classes == ("Block",) and strategy.config.activation_checkpointing is True
    assert strategy.config.cpu_offload is True
    assert strategy._save_distributed_checkpoint is False  # Lightning's FSDP1 default for the Trainer: "full"
    assert TrainerStrategy(state_dict_type="sharded")._save_distributed_checkpoint is True

    def made(strategy: TrainerStrategy, **kwargs: object) -> TrainerStrategy:
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, **kwargs)
        assert trainer.strategy is strategy
        return strategy

    # the plugin the Trainer makes of a name for other strategies becomes FSDP1's: its autocast, casts and dtypes
    for name in ("bf16-mixed", "bf16-true", "32-true", "16-true"):
        plugin = made(TrainerStrategy(), precision=name).precision_plugin
        assert isinstance(plugin, FSDPPrecision) and plugin.precision == name
    # fp16 autocast: the Trainer refuses it for an FSDP2 strategy, so the strategy is given it, and the Trainer none
    with pytest.raises(ValueError, match="does not support"):
        made(TrainerStrategy(), precision="16-mixed")
    fp16 = made(TrainerStrategy(precision_plugin=16)).precision_plugin
    assert fp16.precision == "16-mixed" and fp16.scaler is not None
    with pytest.raises(ConfigError, match="precision: got 'bf16-mixed'; allowed: the strategy's own"):
        made(TrainerStrategy(precision_plugin="16-mixed"), precision="bf16-mixed")


FABRIC = (
    "import lightning as L\n"
    "from lightning.fabric.strategies import FSDPStrategy, DDPStrategy\n\n\n"
    "def make(kind: str) -> L.Fabric:\n"
    "    if kind == 'ddp':\n"
    "        return L.Fabric(strategy=DDPStrategy())\n"
    "    return L.Fabric(strategy=FSDPStrategy(auto_wrap_policy={Block}, state_dict_type='full'))\n"
)


def _fix(tmp_path: Path, files: dict[str, str], target: str = "bridge") -> dict[str, str]:
    tree = tmp_path / target
    for name, text in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    migrate_paths([tree], fix=True, target=target)
    return {name: (tree / name).read_text() for name in files}


def test_fabrics_strategy_moves_alone_and_stays_where_the_tree_depends_on_its_class(tmp_path: Path) -> None:
    fixed = _fix(tmp_path / "alone", {"train.py": FABRIC})["train.py"]
    assert "strategy=fsdp_bridge.lightning.FabricStrategy(auto_wrap_policy={Block}, state_dict_type='full')" in fixed
    assert "from lightning.fabric.strategies import DDPStrategy\n" in fixed and "TODO" not in fixed

    # another file tells the strategies apart: the rewrite would send it down the other path
    tested = "from lightning.fabric.strategies import FSDPStrategy\n\n\ndef is_fsdp(f):\n"
    tested += "    return isinstance(f.strategy, FSDPStrategy)\n"
    kept = _fix(tmp_path / "tested", {"train.py": FABRIC, "util.py": tested})
    assert "not rewritten: util.py names FSDPStrategy" in kept["train.py"]
    assert "=FSDPStrategy(auto_wrap_policy" in kept["train.py"]

    # Lightning's FSDP1-only helpers from the strategy's module; fp16 autocast, which Fabric's FSDP2 strategy refuses
    overlap = FABRIC.replace("import FSDPStrategy, DDPStrategy", "import FSDPStrategy, DDPStrategy\n")
    overlap += "from lightning.fabric.strategies.fsdp import fsdp_overlap_step_with_backward\n"
    kept = _fix(tmp_path / "overlap", {"o.py": overlap, "train.py": FABRIC})  # its own file's strategy alone
    assert "not rewritten: this file imports fsdp_overlap_step_with_backward from Lightning's" in kept["o.py"]
    assert "fsdp_bridge.lightning.FabricStrategy(" in kept["train.py"]

    # fp16 autocast with a scaler: Fabric wants the FSDP2 strategy to bring the plugin, so it is given the precision
    fp16 = FABRIC.replace("state_dict_type='full'))", "state_dict_type='full'), precision='16-mixed')")
    fixed = _fix(tmp_path / "fp16", {"h.py": fp16})["h.py"]
    assert "FabricStrategy(auto_wrap_policy={Block}, state_dict_type='full', precision=\"16-mixed\")" in fixed
    # ... unless another Fabric of the file asks for something else: which one the strategy reaches is unknown
    apart = "import lightning as L\nfrom lightning.fabric.strategies import FSDPStrategy\n\n\ndef make():\n"
    apart += "    s = FSDPStrategy(\n        auto_wrap_policy={Block},\n    )\n"
    apart += "    return L.Fabric(strategy=s, precision='16-mixed')\n"
    fixed = _fix(tmp_path / "apart", {"h.py": apart})["h.py"]
    assert 'FabricStrategy(\n        auto_wrap_policy={Block},\n        precision="16-mixed",\n    )' in fixed
    # one argument a line, a commented-out one among them, no trailing comma: the layout and the comment kept once
    commented = apart.replace(
        "{Block},\n    )", "{Block},\n        # cpu_offload=True,\n        limit_all_gathers=True\n    )"
    )
    fixed = _fix(tmp_path / "commented", {"h.py": commented})["h.py"]
    assert '# cpu_offload=True,\n        limit_all_gathers=True,\n        precision="16-mixed"\n    )' in fixed
    assert fixed.count("# cpu_offload") == 1
    both = apart + "\n\ndef plain() -> L.Fabric:\n    return L.Fabric(precision='bf16-mixed')\n"
    fixed = _fix(tmp_path / "both", {"h.py": both})["h.py"]
    assert "but Fabric(precision='bf16-mixed') does not" in fixed and "s = FSDPStrategy(" in fixed
    # strategy="fsdp": that call's own precision, a literal or a value known when the code runs
    named = "import lightning as L\n\n\ndef make(p):\n    a = L.Fabric(strategy='fsdp', precision=16)\n"
    named += "    return a, L.Fabric(strategy='fsdp_cpu_offload', precision=p.precision)\n"
    fixed = _fix(tmp_path / "named", {"n.py": named})["n.py"]
    assert 'L.Fabric(strategy=fsdp_bridge.lightning.FabricStrategy(precision="16-mixed"), precision=16)' in fixed
    assert "FabricStrategy(precision=p.precision, cpu_offload=True), precision=p.precision)" in fixed
    # a precision the Fabric reads from a name bound before the strategy is made: the strategy is given it too
    bound = "import lightning as L\nfrom lightning.fabric.strategies import FSDPStrategy\n\n\n"
    bound += "def setup(precision=None):\n    precision = precision or pick()\n    strategy = FSDPStrategy()\n"
    bound += "    return L.Fabric(strategy=strategy, precision=precision)\n"
    fixed = _fix(tmp_path / "bound", {"b.py": bound})["b.py"]
    assert "strategy = fsdp_bridge.lightning.FabricStrategy(precision=precision)" in fixed
    later = bound.replace("    return L.Fabric", "    precision = 'bf16-mixed'\n    return L.Fabric")
    tree = tmp_path / "later"
    tree.mkdir()
    (tree / "b.py").write_text(later)
    found, _ = migrate_paths([tree], fix=True)
    assert "FabricStrategy()" in (tree / "b.py").read_text()
    assert any("give FabricStrategy precision= the same value" in f.replacement for f in found.findings)

    # another file calls FSDP1's own API (perhaps on the module Fabric wrapped)
    summon = "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\ndef gather(m):\n"
    summon += "    with FSDP.summon_full_params(m):\n        return [p.sum() for p in m.parameters()]\n"
    kept = _fix(tmp_path / "summon", {"train.py": FABRIC, "gather.py": summon})
    assert "not rewritten: gather.py calls FSDP1's FullyShardedDataParallel API" in kept["train.py"]

    # PyTorch Lightning's Trainer: its own strategy, the same arguments; fp16 autocast is the Trainer's argument
    trainer = FABRIC.replace("lightning.fabric.strategies", "lightning.pytorch.strategies").replace("Fabric", "Trainer")
    fixed = _fix(tmp_path / "pl", {"t.py": trainer})["t.py"]
    assert "strategy=fsdp_bridge.lightning.TrainerStrategy(auto_wrap_policy={Block}, state_dict_type='full')" in fixed
    assert "TODO" not in fixed
    fp16 = trainer.replace("state_dict_type='full'))", "state_dict_type='full'), precision=16)")
    fixed = _fix(tmp_path / "pl16", {"t.py": fp16})["t.py"]
    assert "not rewritten: this file's Trainer(precision=16) asks for fp16 autocast" in fixed
    assert "L.Trainer(strategy=FSDPStrategy(" in fixed
    named = "import lightning.pytorch as pl\n\n\ndef make(p):\n    return pl.Trainer(strategy='fsdp_cpu_offload', "
    named += "precision=p.precision)\n"
    tree = tmp_path / "plnamed"
    tree.mkdir()
    (tree / "n.py").write_text(named)
    found, _ = migrate_paths([tree], fix=True)
    fixed = (tree / "n.py").read_text()
    assert (
        "pl.Trainer(strategy=fsdp_bridge.lightning.TrainerStrategy(cpu_offload=True), precision=p.precision)" in fixed
    )
    assert any("give TrainerStrategy precision_plugin='16-mixed'" in f.replacement for f in found.findings)
    torch = _fix(tmp_path / "torch", {"train.py": FABRIC}, target="torch")["train.py"]
    assert "not rewritten: --target torch writes no Lightning strategy" in torch


def test_a_fabric_trainer_on_lightnings_fsdp1_strategy_gives_its_losses_after_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(FIXTURES / "migrate_verify" / "fabric_fsdp.py", tree)
    assert main(["migrate", "verify", str(tree), "--timeout", "300", "--", "fabric_fsdp.py", "--steps", "3"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "[fix] FSDPStrategy(...) (Lightning's FSDP1 strategy) -> fsdp_bridge.lightning.FabricStrategy(...)" in out
    assert 'the strategy is given precision="16-mixed" too' in out
    assert "PARITY: 3 losses on each of 2 rank(s) agree" in out
    # the full checkpoint fabric.save wrote (model and AdamW state, rank 0's file) compared tensor by tensor
    assert "fabric_checkpoint.pt: 88 tensors compared" in out and "saved files differ" not in out


def test_a_trainer_script_on_lightnings_fsdp1_strategy_gives_its_losses_after_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(FIXTURES / "migrate_verify" / "trainer_fsdp.py", tree)
    assert main(["migrate", "verify", str(tree), "--timeout", "300", "--", "trainer_fsdp.py", "--steps", "3"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "[fix] FSDPStrategy(...) (Lightning's FSDP1 strategy) -> fsdp_bridge.lightning.TrainerStrategy(...)" in out
    assert "PARITY: 3 losses on each of 2 rank(s) agree" in out
    # the Trainer's full checkpoint (model, AdamW state keyed as FSDP1's strategy keys it), rank 0's file
    assert "trainer_checkpoint.ckpt: 88 tensors compared, 88 bit for bit" in out and "saved files differ" not in out


TRAINER_AGAIN = """
import sys
import lightning.pytorch as pl
import torch
from torch import nn
from fsdp_bridge.lightning import TrainerStrategy


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.proj(x))


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.blocks(x))

    def training_step(self, batch, i):
        return ((self(batch[0]) - batch[1]) ** 2).mean()

    def validation_step(self, batch, i):
        self.log("val", ((self(batch[0]) - batch[1]) ** 2).mean())

    def predict_step(self, batch, i):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


torch.manual_seed(0)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4)
net = Net()
strategy = TrainerStrategy(auto_wrap_policy={Block}, process_group_backend="gloo")
trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(net, data)
(metrics,) = trainer.validate(net, data, verbose=False)
predicted = trainer.predict(net, data)
path = sys.argv[1]
trainer.save_checkpoint(path)
loaded = Net.load_from_checkpoint(path, weights_only=False)
with torch.no_grad():
    same = torch.allclose(torch.cat(predicted), loaded(torch.cat([b[0] for b in data])), atol=1e-6)
print("OK", sorted(metrics), len(predicted), same)
"""


def test_the_trainers_strategy_validates_and_predicts_after_fit_on_the_model_sharded_already(tmp_path: Path) -> None:
    # The Trainer sets its strategy up again for validate / predict after fit: the LightningModule is sharded
    # already and is not sharded twice (a ConfigError); its checkpoint loads into a plain module that predicts the
    # same. One process (world size 1), in a subprocess of its own (Lightning starts a process group).
    import subprocess
    import sys

    script = tmp_path / "again.py"
    script.write_text(TRAINER_AGAIN)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "net.ckpt")],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "OK ['val'] 4 True"
