"""Lightning's FSDP1 strategy: ``FSDPStrategy(...)`` (Fabric and PyTorch Lightning) and ``strategy="fsdp"``
given to ``Trainer`` / ``Fabric``.  Lightning wraps the model in FullyShardedDataParallel itself, so the
strategy is what moves: to ``fsdp_bridge.lightning.FabricStrategy`` / ``TrainerStrategy`` (the same arguments
with FSDP1's meaning, on FSDP2), or, where the tree depends on the class or on FSDP1's API, a TODO naming what
each of its FSDP1 arguments is in the bridge's config, and the ways to FSDP2."""

from __future__ import annotations

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider, QualifiedNameSource

from fsdp_bridge.migrate._analysis import code_of, short, walk
from fsdp_bridge.migrate._names import STRATEGIES
from fsdp_bridge.migrate._report import CodeFinding
from fsdp_bridge.migrate._scan_base import ScannerBase

LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")
"""The packages Lightning ships under (the unified one, and the two standalone ones)."""

WAY_OUT = (
    "Lightning wraps the model in FSDP1 (FullyShardedDataParallel) itself; for FSDP2 use "
    "lightning's ModelParallelStrategy(data_parallel_size=<world size>, tensor_parallel_size=1) (its defaults "
    "give one data-parallel rank per node) and apply torch's fully_shard to the model in the LightningModule's "
    "configure_model (the mesh is self.device_mesh; Fabric: ModelParallelStrategy(parallelize_fn=lambda m, "
    "mesh: ...)), or, with that strategy, call fsdp_bridge.shard(self.model, fsdp_bridge.BridgeConfig(...), "
    'mesh=self.device_mesh["data_parallel"]) in configure_model (HYBRID_*: no mesh=, the bridge builds the 2D '
    "one, or a 2D (replicate, shard) mesh of your own; never under DDPStrategy: DDP would wrap the sharded "
    "model; arguments ModelParallelStrategy lacks, such as cluster_environment=, move to the Trainer's or "
    "Fabric's plugins). Lightning still saves the checkpoints: FSDPStrategy's default state_dict_type='full' writes "
    "one file, ModelParallelStrategy by default a DCP directory (save_distributed_checkpoint=False keeps one file, "
    "which code that torch.load()s a .ckpt needs); and the Trainer's precision='bf16-mixed' was FSDP1's "
    "MixedPrecision under FSDPStrategy (bf16 gathers and gradient reduction) but is autocast alone under "
    "ModelParallelStrategy (give mixed_precision=\"bf16\" to keep bf16 communication; '16-mixed' is refused there). "
    "Its FSDP1 arguments become these BridgeConfig keys: "
)

MOVED = (
    "fsdp_bridge.lightning.FabricStrategy(...): Lightning Fabric's FSDP2 strategy (its ModelParallelStrategy, one "
    "data-parallel dimension over every rank) whose model fsdp_bridge.shard shards; it takes FSDPStrategy's "
    "arguments with FSDP1's meaning (as BridgeConfig.from_fsdp1 reads them), and precision='bf16-mixed' keeps "
    "FSDP1's bf16 parameters, reduction and buffers (Lightning's FSDP1 precision plugin, its autocast and casts). "
    "fabric.save writes what state_dict_type says (FSDP2's DCP directory for 'sharded'); where the file's Fabric "
    "says precision='16-mixed' (fp16 autocast, FSDP1's ShardedGradScaler) the strategy is given "
    'precision="16-mixed" too, as Fabric asks of an FSDP2 strategy. Its arguments: '
)
"""The report of a rewritten ``FSDPStrategy(...)`` of Fabric."""

TRAINER_MOVED = (
    "fsdp_bridge.lightning.TrainerStrategy(...): PyTorch Lightning's FSDP2 strategy (its ModelParallelStrategy, "
    "one data-parallel dimension over every rank) that shards the whole LightningModule with fsdp_bridge.shard "
    "when the Trainer sets up, as FSDPStrategy wrapped it (no configure_model of your own needed), and runs "
    "training_step and the other steps inside the module's forward call as FSDPStrategy did; it takes "
    "FSDPStrategy's arguments with FSDP1's meaning (as BridgeConfig.from_fsdp1 reads them), keeps Lightning's "
    "FSDP1 precision plugin (precision='bf16-mixed': FSDP1's bf16 parameters, reduction and buffers) and "
    "state_dict_type='full' as its default (one checkpoint file, FSDP1's keys). Its arguments: "
)
"""The report of a rewritten ``FSDPStrategy(...)`` of the Trainer."""


def _bridge_class(fabric: bool) -> str:
    """The class of ``fsdp_bridge.lightning`` that a Fabric's (else a Trainer's) FSDP1 strategy becomes."""
    return "FabricStrategy" if fabric else "TrainerStrategy"


def _moved(fabric: bool) -> str:
    """The report of a rewritten Fabric (else Trainer) strategy."""
    return MOVED if fabric else TRAINER_MOVED


FABRIC_NAMES = ("fsdp", "fsdp_cpu_offload")
"""``Fabric(strategy=...)`` names of Lightning's FSDP1 strategy: its defaults, with CPU offload for the second."""

LIGHTNING_ARGS: dict[str, str] = {
    "sharding_strategy": 'strategy= (ShardingStrategy members lower-cased: FULL_SHARD -> "full_shard", ...)',
    "auto_wrap_policy": "wrap= (a set of block classes {Block} -> wrap=[Block], subclasses included and classes "
    "the model lacks skipped, as Lightning's ModuleWrapPolicy; an FSDP1 policy -> "
    "BridgeConfig.from_fsdp1(auto_wrap_policy=...), read when the code runs)",
    "cpu_offload": "cpu_offload=True (True or CPUOffload(offload_params=True))",
    "mixed_precision": "mixed_precision={param_dtype, reduce_dtype, buffer_dtype} (a MixedPrecision object -> "
    "BridgeConfig.from_fsdp1(mixed_precision=...)); Lightning's precision='bf16-mixed' / '16-mixed' -> "
    'mixed_precision="bf16" / "fp16"',
    "activation_checkpointing": "activation_checkpointing=True (recompute each wrapped unit in backward)",
    "activation_checkpointing_policy": "activation_checkpointing=True where a policy is given (the bridge "
    "checkpoints its wrap units: the same thing where the policy names the wrap classes; checkpointing other "
    "classes than the wrap units has no BridgeConfig form: torch's apply_activation_checkpointing after sharding)",
    "state_dict_type": "how Lightning writes checkpoints: 'full' -> ModelParallelStrategy("
    "save_distributed_checkpoint=False) (one file), 'sharded' -> save_distributed_checkpoint=True (its default, "
    'a DCP directory); outside Lightning\'s saving: fsdp_bridge.save_checkpoint(path, model, kind="full"|"sharded")',
    "device_mesh": 'shard(..., mesh=...) (a (replicate, shard) pair of sizes -> strategy="hybrid_shard", '
    "hybrid_shape=(replicate, shard))",
    "backward_prefetch": 'backward_prefetch= (BackwardPrefetch.BACKWARD_PRE -> "pre", None -> "none")',
    "forward_prefetch": "forward_prefetch=",
    "limit_all_gathers": "not needed: FSDP2 has no all-gather rate limiter",
    "sync_module_states": "sync_module_states=",
    "use_orig_params": "not needed: FSDP2 parameters are always the original ones",
}
"""``FSDPStrategy`` arguments that are FSDP1's, and what each is in the bridge's config."""


FP16 = 'precision="16-mixed"'
"""What a Fabric strategy of a file whose ``Fabric(...)`` says ``precision="16-mixed"`` is given: Fabric refuses the
precision for an FSDP2 strategy that brings no precision plugin of its own."""

FP16_NAMES = ("16-mixed", "16")
"""Lightning's names of fp16 autocast with a gradient scaler (``16`` as an integer too)."""


def _is_precision(a: cst.Arg) -> bool:
    return a.keyword is not None and a.keyword.value == "precision"


def _precision_text(call: cst.Call) -> str | None:
    """What ``call`` gives as ``precision=``: a literal's text, None where it gives none or an expression."""
    for a in call.args:
        if _is_precision(a):
            value = a.value
            if isinstance(value, cst.SimpleString):
                return str(value.evaluated_value)
            return value.value if isinstance(value, cst.Integer) else None
    return None


def _same_precision(fabric: cst.Call) -> str | None:
    """What a strategy made inside ``fabric`` (a ``Fabric(...)`` call) is given of its precision: ``precision=
    "16-mixed"`` where it says fp16 autocast, its value where that is known only when the code runs (a name or an
    attribute: the same value to both), None where the strategy needs nothing."""
    spelled = next((a.value for a in fabric.args if _is_precision(a)), None)
    if _precision_text(fabric) in FP16_NAMES:
        return FP16
    return f"precision={code_of(spelled)}" if isinstance(spelled, (cst.Name, cst.Attribute)) else None


class LightningFixer(ScannerBase):
    """Lightning's FSDPStrategy and strategy="fsdp": rewritten to ``fsdp_bridge.lightning``'s strategies, or
    reported with a TODO saying why not."""

    def _lightning_name(self, node: cst.BaseExpression, *classes: str) -> str | None:
        """The class of ``classes`` that ``node`` names, imported from a Lightning package."""
        for q in self.get_metadata(QualifiedNameProvider, node, set()):
            parts = q.name.split(".")
            if q.source is QualifiedNameSource.IMPORT and parts[0] in LIGHTNING_PACKAGES and parts[-1] in classes:
                return parts[-1]
            if (
                q.source is QualifiedNameSource.IMPORT
                and "FSDPStrategy" in classes
                and parts[0] == "ray"
                and parts[-1] == "RayFSDPStrategy"
            ):
                return parts[-1]  # Ray Train's subclass of Lightning's FSDPStrategy
        return None

    def _plan_lightning(self, node: cst.Call) -> bool:
        """Report ``FSDPStrategy(...)`` and ``Trainer/Fabric(strategy="fsdp...")``; True when it was one."""
        if self._lightning_name(node.func, "FSDPStrategy") is not None:
            given = [a for a in node.args if a.keyword is not None and a.keyword.value in LIGHTNING_ARGS]
            wraps = any(a.keyword.value == "auto_wrap_policy" for a in given if a.keyword is not None)
            self.fsdp1_elsewhere = True
            fabric, outer = self._strategy_place(node)
            blocker = self._strategy_blocker(node)
            meant = [(a, self._lightning_meaning(a, wraps, moved=blocker is None)) for a in given]
            if blocker is None:
                self.expr_rewrites[id(node.func)] = f"fsdp_bridge.lightning.{_bridge_class(fabric)}"
                self.needs_imports.add(("fsdp_bridge.lightning", None))
                self.lightning_drops.update(self._strategy_imports())
                if not fabric:
                    self._note_trainer_precision(node)
                elif any(_is_precision(a) for a in node.args):
                    pass
                elif outer is not None:  # Fabric(strategy=FSDPStrategy(...), ...): that call's precision
                    if (named := _same_precision(outer)) is not None:
                        self.arg_adds[id(node)] = named
                elif self._fp16("Fabric") is not None:
                    self.arg_adds[id(node)] = FP16
                elif (known := self._precision_bound_before(node)) is not None:
                    self.arg_adds[id(node)] = f"precision={known}"  # the value the Fabric reads, bound already
                else:
                    self._note_precision(
                        node,
                        "Fabric",
                        "if it is '16-mixed' (or 16) when the code runs, give FabricStrategy precision= the same "
                        "value: Fabric refuses fp16 autocast for an FSDP2 strategy without its own precision "
                        "plugin, and says so at start-up",
                    )
            self._record(
                node,
                f"{code_of(node.func)}(...) (Lightning's FSDP1 strategy)",
                (_moved(fabric) if blocker is None else f"not rewritten: {blocker}; " + WAY_OUT)
                + (
                    "; ".join(
                        f"{a.keyword.value if a.keyword else ''}={short(code_of(a.value), 40)} -> {text}"
                        for a, text in meant
                    )
                    if meant
                    else 'none given (FULL_SHARD -> strategy="full_shard", no wrap policy -> wrap="none")'
                ),
                blocker is None,
            )
            for a, text in meant:
                pos = self.get_metadata(PositionProvider, a)
                # Notes, not constructs of their own: the strategy's TODO names every argument and what it becomes.
                self.findings.append(
                    CodeFinding(
                        self.path,
                        pos.start.line,
                        pos.start.column,
                        f"{a.keyword.value if a.keyword else ''}={short(code_of(a.value))}",
                        f"{text} (part of the strategy's {'TODO' if blocker else 'rewrite'} above)",
                        True,
                        note=True,
                    )
                )
            return True
        cls = self._lightning_name(node.func, "Trainer", "Fabric")
        if cls is None:
            return False
        for a in node.args:
            if (
                a.keyword is not None
                and a.keyword.value == "strategy"
                and isinstance(a.value, cst.SimpleString)
                and str(a.value.evaluated_value).startswith("fsdp")
            ):
                self.fsdp1_elsewhere = True
                offload = "offload" in str(a.value.evaluated_value)
                blocker = self._lightning_blocker(cls == "Fabric", node)
                if blocker is None and str(a.value.evaluated_value) in FABRIC_NAMES:
                    own = [] if cls == "Trainer" or (same := _same_precision(node)) is None else [same]
                    self.expr_rewrites[id(a.value)] = (
                        f"fsdp_bridge.lightning.{_bridge_class(cls == 'Fabric')}("
                        + ", ".join([*own, "cpu_offload=True"] if offload else own)
                        + ")"
                    )
                    self.needs_imports.add(("fsdp_bridge.lightning", None))
                    if cls == "Trainer":
                        self._note_trainer_precision(node)
                self._record(
                    node,
                    f"{cls}(strategy={code_of(a.value)}) (Lightning's FSDP1 strategy)",
                    (
                        _moved(cls == "Fabric")
                        if id(a.value) in self.expr_rewrites
                        else f"not rewritten: {blocker or 'a strategy name Fabric registers for FSDP1 only'}; "
                        + WAY_OUT
                    )
                    + 'sharding_strategy FULL_SHARD -> strategy="full_shard"'
                    + ("; cpu offload -> cpu_offload=True" if offload else ""),
                    id(a.value) in self.expr_rewrites,
                )
                return True
        return False

    def _note_trainer_precision(self, at: cst.Call) -> None:
        """Where a ``Trainer(...)`` of this file reads its precision from an expression, note at ``at`` (the
        rewritten strategy) what to do if it is fp16 autocast when the code runs."""
        self._note_precision(
            at,
            "Trainer",
            "if it is '16-mixed' (or 16) when the code runs, give TrainerStrategy precision_plugin='16-mixed' and the "
            "Trainer no precision=: the Trainer refuses fp16 autocast for an FSDP2 strategy, and says so at start-up",
        )

    def _note_precision(self, at: cst.Call, cls: str, what: str) -> None:
        """A note at ``at`` (a rewritten strategy) saying ``what`` where a ``Fabric(...)`` / ``Trainer(...)`` of this
        file reads its precision from an expression (known when the code runs)."""
        if (told := self._precision_unknown(cls)) is None:
            return
        pos = self.get_metadata(PositionProvider, at)
        self.findings.append(CodeFinding(self.path, pos.start.line, pos.start.column, told, what, True, note=True))

    def _lightning_blocker(self, fabric: bool, named_in: cst.Call | None = None) -> str | None:
        """Why Lightning's FSDP1 strategy (``fabric``: Fabric's, else the Trainer's; ``named_in``: the Fabric call
        naming it as ``strategy="fsdp"``, else an ``FSDPStrategy(...)``) stays as it is, or None: Fabric's is
        rewritten to ``fsdp_bridge.lightning.FabricStrategy`` (the same arguments) when no code of the tree tells
        the strategies apart or calls FSDP1's API itself, perhaps on the module Lightning wraps."""
        if self.target == "torch":
            return (
                "--target torch writes no Lightning strategy (the default target rewrites Fabric's to "
                "fsdp_bridge.lightning.FabricStrategy, the same arguments on FSDP2)"
            )
        if not fabric and (fp16 := self._fp16("Trainer")) is not None:
            return (
                f"this file's {fp16} asks for fp16 autocast with a gradient scaler, which PyTorch Lightning's "
                "Trainer refuses for an FSDP2 strategy: give fsdp_bridge.lightning.TrainerStrategy(...) "
                "precision_plugin='16-mixed' and drop the Trainer's precision= (the strategy brings Lightning's "
                "FSDP1 precision plugin, its autocast and ShardedGradScaler), a change to the Trainer's arguments "
                "left to you"
            )
        if (
            fabric
            and named_in is None
            and (fp16 := self._fp16("Fabric")) is not None
            and (other := self._other_precision())
        ):
            return (
                f"this file's {fp16} asks for fp16 autocast with a gradient scaler, which FabricStrategy has to be "
                f"given too (precision='16-mixed'; Fabric refuses it for an FSDP2 strategy without), but {other} "
                "does not: which Fabric this strategy reaches is not known here"
            )
        if (helper := self._fsdp1_strategy_helper()) is not None:
            return f"this file imports {helper} from Lightning's FSDP1 strategy module, which serves FSDP1 alone"
        if self.dispatch.tests_lightning_strategy is not None:
            return (
                f"{self.dispatch.tests_lightning_strategy} names FSDPStrategy (an isinstance test or a subclass): "
                "code there takes the other path once the strategy is another class"
            )
        if self.dispatch.wraps_fsdp1 is not None:
            return (
                f"{self.dispatch.wraps_fsdp1} calls FSDP1's FullyShardedDataParallel API, perhaps on the module "
                "Lightning wraps, which would be FSDP2's after the rewrite"
            )
        return None

    def _fsdp1_strategy_helper(self) -> str | None:
        """A name other than ``FSDPStrategy`` this file imports from the module of Lightning's FSDP1 strategy
        (``fsdp_overlap_step_with_backward``, its state-dict helpers), or None."""
        for n in walk(self.module) if self.module is not None else ():
            if isinstance(n, cst.ImportFrom) and n.module is not None and not isinstance(n.names, cst.ImportStar):
                module = code_of(n.module)
                if module.split(".")[0] in LIGHTNING_PACKAGES and module.endswith(".strategies.fsdp"):
                    for a in n.names:
                        if code_of(a.name) != "FSDPStrategy":
                            return code_of(a.name)
        return None

    def _fabrics(self, cls: str = "Fabric") -> list[cst.Call]:
        """This file's ``Fabric(...)`` calls (``cls="Trainer"``: its PyTorch Lightning ``Trainer(...)`` calls)."""
        return [
            n
            for n in (walk(self.module) if self.module is not None else ())
            if isinstance(n, cst.Call) and self._lightning_name(n.func, cls) is not None
        ]

    def _fp16(self, cls: str) -> str | None:
        """A ``Fabric(precision="16-mixed")`` (or ``"16"``, ``16``; ``cls="Trainer"``: a ``Trainer(...)``'s) of this
        file, as written, or None."""
        for n in self._fabrics(cls):
            if _precision_text(n) in FP16_NAMES:
                return f"{cls}(precision={next(code_of(a.value) for a in n.args if _is_precision(a))})"
        return None

    def _precision_bound_before(self, strategy: cst.Call) -> str | None:
        """The name every ``Fabric(...)`` of this file reads its precision from, where each of them follows the
        ``FSDPStrategy(...)`` call in its function and the name is bound (a parameter, an assignment) only before
        that call: the strategy can be given the same value. None otherwise."""
        scope = self.functions[-1] if self.functions else self.module
        fabrics = self._fabrics()
        given = {
            code_of(a.value) for f in fabrics for a in f.args if _is_precision(a) and isinstance(a.value, cst.Name)
        }
        if scope is None or len(given) != 1 or any(_precision_text(f) is not None for f in fabrics):
            return None
        name = given.pop()
        line = self.get_metadata(PositionProvider, strategy).start.line
        inside = {id(n) for n in walk(scope)}
        if not all(
            id(f) in inside
            and self.get_metadata(PositionProvider, f).start.line > line
            and any(_is_precision(a) and code_of(a.value) == name for a in f.args)
            for f in fabrics
        ):
            return None
        for n in walk(scope):
            target = (
                n.target
                if isinstance(n, (cst.AssignTarget, cst.AnnAssign, cst.AugAssign, cst.For, cst.NamedExpr))
                else n.name
                if isinstance(n, cst.AsName)
                else None
            )
            if (
                target is not None
                and any(isinstance(t, cst.Name) and t.value == name for t in walk(target))
                and self.get_metadata(PositionProvider, n).start.line >= line
            ):
                return None
        return name

    def _precision_unknown(self, cls: str = "Fabric") -> str | None:
        """A ``Fabric(precision=<expression>)`` (``cls="Trainer"``: a ``Trainer(...)``'s) of this file (known when
        the code runs), as written, or None."""
        for n in self._fabrics(cls):
            given = [a for a in n.args if _is_precision(a)]
            if given and not isinstance(given[0].value, (cst.SimpleString, cst.Integer)):
                return f"{cls}(precision={short(code_of(given[0].value), 40)})"
        return None

    def _other_precision(self) -> str | None:
        """A ``Fabric(...)`` call of this file that does not say ``precision="16-mixed"``, as written, or None."""
        for n in self._fabrics():
            if _precision_text(n) not in FP16_NAMES:
                given = [a for a in n.args if _is_precision(a)]
                return f"Fabric(precision={code_of(given[0].value)})" if given else "a Fabric(...) without precision="
        return None

    def _lightning_moves(self) -> bool:
        """Every ``FSDPStrategy(...)`` of this file is rewritten (see ``_lightning_blocker``)."""
        calls = [
            n
            for n in (walk(self.module) if self.module is not None else ())
            if isinstance(n, cst.Call) and self._lightning_name(n.func, "FSDPStrategy") is not None
        ]
        return bool(calls) and all(self._strategy_blocker(c) is None for c in calls)

    def _strategy_blocker(self, call: cst.Call) -> str | None:
        """Why an ``FSDPStrategy(...)`` call stays as it is (see ``_lightning_blocker``), or None."""
        if self._lightning_name(call.func, "FSDPStrategy") == "RayFSDPStrategy":
            return (
                "Ray Train's subclass of Lightning's FSDP1 strategy, which takes its devices and ranks from Ray "
                "Train's context: the bridge's strategies do not"
            )
        return self._lightning_blocker(*self._strategy_place(call))

    def _strategy_place(self, call: cst.Call) -> tuple[bool, cst.Call | None]:
        """Of an ``FSDPStrategy(...)`` call: whether it is Fabric's (else the Trainer's), and the ``Fabric(...)``
        call it is an argument of, if any."""
        fabric = any(
            q.name.startswith(("lightning.fabric.", "lightning_fabric."))
            for q in self.get_metadata(QualifiedNameProvider, call.func, set())
        )
        return fabric, next((f for f in self._fabrics() if any(a.value is call for a in f.args)), None)

    def _strategy_imports(self) -> set[tuple[str, str, str | None]]:
        """``(module, "FSDPStrategy", alias)`` of this file's ``from <lightning package> import FSDPStrategy``."""
        found: set[tuple[str, str, str | None]] = set()
        for n in walk(self.module) if self.module is not None else ():
            if isinstance(n, cst.ImportFrom) and n.module is not None and not isinstance(n.names, cst.ImportStar):
                module = code_of(n.module)
                if module.split(".")[0] not in LIGHTNING_PACKAGES:
                    continue
                for a in n.names:
                    if code_of(a.name) == "FSDPStrategy":
                        alias = code_of(a.asname.name) if a.asname is not None else None
                        found.add((module, "FSDPStrategy", alias))
        return found

    def _lightning_strategy_here(self) -> bool:
        """This file builds or subclasses Lightning's FSDPStrategy: the FSDP1 values it makes go to Lightning."""
        if self.lightning_here is None:
            named: list[cst.BaseExpression] = []
            for n in walk(self.module) if self.module is not None else ():
                if isinstance(n, cst.Call):
                    named.append(n.func)
                elif isinstance(n, cst.ClassDef):
                    named.extend(b.value for b in n.bases)
            self.lightning_here = any(self._lightning_name(e, "FSDPStrategy") is not None for e in named)
        return self.lightning_here

    def _plan_lightning_subclass(self, node: cst.ClassDef) -> None:
        """Report ``class X(FSDPStrategy)``: a subclass of Lightning's FSDP1 strategy, which hands its FSDP1
        arguments to Lightning through ``super().__init__`` (often through ``**kwargs``), so Lightning still
        wraps the model in FSDP1 after ``--fix``."""
        for base in node.bases:
            cls = self._lightning_name(base.value, "FSDPStrategy")
            if cls is None:
                continue
            self.fsdp1_elsewhere = True
            self._record(
                base.value,
                f"class {node.name.value}({code_of(base.value)}) (a subclass of Lightning's FSDP1 strategy)",
                WAY_OUT
                + "those this class hands to FSDPStrategy or uses in its own FSDP(...) call (read them there: "
                + "sharding_strategy -> "
                + "strategy=, auto_wrap_policy -> wrap=, mixed_precision -> mixed_precision=, cpu_offload -> "
                + "cpu_offload=, backward_prefetch -> backward_prefetch=); what calls FSDP1 (its own methods and "
                + "the state-dict, optimizer-state and checkpoint methods it inherits from Lightning: FSDP(...), "
                + "FSDP.state_dict_type, FSDP.optim_state_dict, ...) stays FSDP1's until the class moves as a whole: "
                + "the FSDP1 values "
                + "this class builds (MixedPrecision, ShardingStrategy, wrap policies) are read by Lightning, not "
                + "by fsdp_bridge",
                False,
            )
            return

    def _lightning_meaning(self, a: cst.Arg, wraps: bool, moved: bool = False) -> str:
        """What an FSDP1 argument of FSDPStrategy is in the bridge's config, for the value it has (``wraps``: the
        strategy is given an ``auto_wrap_policy``; ``moved``: the strategy is rewritten to the bridge's, which
        takes ``state_dict_type`` as it is)."""
        kw = a.keyword.value if a.keyword is not None else ""
        text = LIGHTNING_ARGS[kw]
        if kw == "sharding_strategy":
            member = self._member(a.value, "ShardingStrategy")
            if member is None and isinstance(a.value, cst.SimpleString):
                member = str(a.value.evaluated_value)
            text = f'strategy="{STRATEGIES[member]}"' if member in STRATEGIES else LIGHTNING_ARGS[kw]
        elif kw in ("auto_wrap_policy", "activation_checkpointing_policy") and isinstance(a.value, cst.Set):
            classes = "[" + ", ".join(code_of(e.value) for e in a.value.elements) + "]"
            text = (
                f"wrap={classes}"
                if kw == "auto_wrap_policy"
                else f"activation_checkpointing=True with wrap={classes} (the bridge recomputes each wrap unit)"
            )
        elif kw == "activation_checkpointing" and code_of(a.value) != "None":
            text = (
                f"the classes {short(code_of(a.value), 40)} recomputed in backward (Lightning's spelling): "
                "activation_checkpointing=True where they are the wrap policy's classes (the bridge recomputes each "
                "wrap unit), else torch's checkpoint wrapper on them before sharding, as Lightning applies it"
            )
        elif kw in ("cpu_offload", "sync_module_states", "forward_prefetch") and (
            code_of(a.value) in ("True", "False")
        ):
            text = f"{kw}={code_of(a.value)}"
        elif kw in ("cpu_offload", "sync_module_states", "forward_prefetch") and (not isinstance(a.value, cst.Call)):
            # a value known when the code runs (a bool from the run's config): passed on as it is
            text = f"{kw}={short(code_of(a.value), 40)} (the same value, known when the code runs)"
        elif kw in ("activation_checkpointing", "activation_checkpointing_policy") and code_of(a.value) == "None":
            return "none: no activation checkpointing (activation_checkpointing=False)"
        elif kw == "activation_checkpointing_policy" and isinstance(a.value, cst.IfExp):
            text = (
                f"activation_checkpointing=({short(code_of(a.value.test), 40)}) (a policy only when that holds); "
                + LIGHTNING_ARGS[kw].removeprefix("activation_checkpointing=True where a policy is given ")
            )
        elif kw == "backward_prefetch":
            member = self._member(a.value, "BackwardPrefetch")
            if member == "BACKWARD_PRE":
                text = 'backward_prefetch="pre"'
            elif member == "BACKWARD_POST":
                text = 'backward_prefetch="pre" (FSDP2 has only BACKWARD_PRE\'s timing: the same numbers)'
            elif isinstance(a.value, (cst.Name, cst.SimpleString, cst.Integer)) and code_of(a.value) in (
                "None",
                "True",
                "False",
            ):
                text = 'backward_prefetch="none" (no prefetch: FSDP1 prefetches only for its BackwardPrefetch members)'
        elif kw == "state_dict_type" and moved:
            text = (
                f"kept: state_dict_type={short(code_of(a.value), 40)} ('full': one checkpoint file written by rank 0, "
                "FSDP1's keys; 'sharded': a DCP directory, loadable at any world size)"
            )
        elif kw == "state_dict_type" and isinstance(a.value, cst.SimpleString):
            kind = str(a.value.evaluated_value)
            text = (
                f"ModelParallelStrategy(save_distributed_checkpoint={kind == 'sharded'}) "
                + ("(a DCP directory, loadable at any world size)" if kind == "sharded" else "(one file)")
                + f'; outside Lightning\'s saving: fsdp_bridge.save_checkpoint(path, model, kind="{kind}")'
            )
        if kw == "activation_checkpointing_policy" and not wraps and not isinstance(a.value, cst.Set):
            text += (
                "; this strategy has no auto_wrap_policy, so give wrap= the classes the policy names (the bridge "
                "recomputes its wrap units)"
            )
        return text
