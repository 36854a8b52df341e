"""The FSDP1 constructor, ``functools.partial(FSDP, ...)``, ``enable_wrap`` / ``wrap``, and the
per-argument findings of a conversion."""

from __future__ import annotations

import re
from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m
from libcst.metadata import PositionProvider, QualifiedNameProvider

from fsdp_bridge.migrate._analysis import Conversion, code_of, make_arg, make_str, other_accelerator, short, walk
from fsdp_bridge.migrate._names import (
    FSDP,
    FSDP1_POSITIONAL,
    IGNORED_KWARGS,
    KWARG_OPTION,
    NAMES,
    OLD_WRAP_KWARG,
    STRATEGIES,
    fsdp2_any,
    fsdp2_case,
)
from fsdp_bridge.migrate._render import closing_comments, comments_around, runtime_lines, runtime_names
from fsdp_bridge.migrate._report import CodeFinding
from fsdp_bridge.migrate._scan_base import ScannerBase
from fsdp_bridge.migrate.fixers._lightning import LIGHTNING_PACKAGES


def without_comments(node: cst.BaseExpression) -> str:
    """An expression's source text without its comments (a report line is one line)."""
    one = " ".join(re.sub(r"#[^\n]*", "", code_of(node)).split())
    return re.sub(r",?\s+([)\]}])", r"\1", re.sub(r"([(\[{])\s+", r"\1", one))  # f( a, ) -> f(a)


FSDP1_ONLY_USERS = {
    "prepare_te_modules_for_fsdp": "Transformer Engine's prepare_te_modules_for_fsdp, which takes FSDP1's wrapper "
    "only (it asserts isinstance(root, FullyShardedDataParallel) and reads each FSDP1 unit's process group)",
}
"""Functions of other libraries that take an FSDP1 wrapper and refuse anything else: a model handed to one stays
FSDP1's (its ``FSDP(...)`` gets a TODO)."""

FOLLOWED_KWARGS = ("auto_wrap_policy", "mixed_precision", "cpu_offload", "sharding_strategy", "backward_prefetch")
"""Arguments whose value, a variable assigned once in the file, is read through the variable."""


LIGHTNING_MODEL_HOOKS = ("configure_model", "configure_sharded_model")
"""A LightningModule's hooks where a model is sharded by hand under the run's strategy."""


class ConstructorFixer(ScannerBase):
    """The FSDP1 constructor and manual wrapping."""

    def _plan_wrap_call(
        self, node: cst.Call, func: cst.BaseExpression, hit: tuple[str, str] | None
    ) -> tuple[bool, bool | None]:
        """torch's enable_wrap / wrap; (handled, what visit_Call returns)."""
        if hit == ("enable_wrap", ""):
            if not self._plan_enable_wrap(node):
                self._record(node, "enable_wrap(...)", NAMES["enable_wrap"], False)
                self._consume(node)  # its wrapper_cls=FSDP is part of this construct
            return True, False
        if hit == ("wrap", "") and id(func) not in self.consumed_nodes:
            if self._under_torch_enable_wrap():
                self._consume(func)
                self._record(
                    node,
                    f"{code_of(func)}(...)",
                    "not rewritten: it runs under torch's enable_wrap above, which is not rewritten (see its "
                    "TODO); rewrite both together: fsdp_bridge.enable_wrap(fsdp_bridge.BridgeConfig.from_fsdp1("
                    "**kwargs)) and fsdp_bridge.wrap_module(module)",
                    False,
                )
                return True, None
            if len(node.args) == 1 and node.args[0].keyword is None and node.args[0].star == "":
                self.expr_rewrites[id(func)] = "fsdp_bridge.wrap_module"
                self.needs_imports.add(("fsdp_bridge", None))
                self._consume(func)
                self._record(
                    node,
                    f"{code_of(func)}(...)",
                    "fsdp_bridge.wrap_module(module): inside fsdp_bridge.enable_wrap it shards the module as a unit "
                    "of its own (FSDP2: fully_shard on it), outside it returns the module unchanged, as FSDP1's "
                    "wrap; a module sharded already is returned as it is, so wrap(wrap(m)) is wrap(m)",
                    True,
                )
                return True, None  # its argument may be another wrap(...)
            self._consume(func)
            self._record(
                node,
                f"{code_of(func)}(...)",
                "not rewritten: wrap(module, **overrides) changes enable_wrap's arguments for one module; write "
                "fsdp_bridge.ManualWrap(fsdp_bridge.BridgeConfig.from_fsdp1(**{**<enable_wrap's arguments>, "
                "**overrides})).wrap(module) (inside fsdp_bridge.enable_wrap torch's wrap refuses overrides)",
                False,
            )
            return True, None
        return False, None

    # -- FSDP(...) -----------------------------------------------------------------
    def _plan_fsdp(self, call: cst.Call) -> None:
        consumed_before = set(self.consumed_nodes)
        recorded = len(self.findings)
        conv = self._plan_static(call)
        runtime = None
        if conv.blockers:
            runtime = self._plan_runtime(call, conv)
        if runtime is not None:
            # Values known only when the code runs: keep them, and let the bridge translate them.
            self.consumed_nodes = consumed_before
            for a in call.args:
                self._consume(a.value)
            self._consume(call.func)
            conv.blockers, conv.consumed, conv.runtime = [], [], runtime
        if (
            user := self._fsdp1_only_user(call)
            or self._in_lightning_strategy()
            or self._units_wrapped_by_class()
            or self._other_accelerator(call)
        ) is not None:
            # The wrapper is handed to a function that takes FSDP1's only: the call stays, with a TODO.
            self.consumed_nodes = consumed_before
            for a in call.args:
                self._consume(a.value)
            self._consume(call.func)
            conv.blockers, conv.consumed, conv.runtime = [user], [], None
        self.conversions[id(call)] = conv
        fixable = not conv.blockers
        if isinstance(chosen := call.func, cst.IfExp) and (branch := self._chosen_fsdp1_branch(chosen)) is not None:
            # (FSDP if ok else Plain)(m, **kw) -> (fsdp_bridge.shard(m, ...) if ok else Plain(m, **kw)): the other
            # class still takes every argument as written, so nothing they name goes (nor is reported as gone)
            self.consumed_nodes = consumed_before
            if not fixable:  # left as written: the class's own TODO says how to split the call
                del self.conversions[id(call)]
                del self.findings[recorded:]
                return
            self._consume(chosen.body if branch == "body" else chosen.orelse)
            self.chosen_calls[id(call)] = branch
        elif fixable and conv.runtime is None:
            for name in set(conv.consumed):  # each use the call's arguments make of it, counted once
                here = sum(1 for n in walk(call) if isinstance(n, cst.Name) and n.value == name)
                self.inlined_uses[name] = self.inlined_uses.get(name, 0) + here
            kept = {name for name in conv.consumed if self.name_uses.get(name, 0) > 2}
            grown = True
            while grown:  # a kept assignment keeps the assignments its value reads (`policy = Wrap(classes)`)
                read = {
                    n.value
                    for name in kept
                    for n in walk(self.assignments[name])
                    if isinstance(n, cst.Name) and n.value in conv.consumed
                }
                grown = not read <= kept
                kept |= read
            for name in conv.consumed:
                if name in kept:
                    # Used elsewhere too (or imported by another file): the assignment stays, and with it
                    # everything its value names (the imports of the policy function, functools).
                    for node in walk(self.assignments[name]):
                        if id(node) not in consumed_before:
                            self.consumed_nodes.discard(id(node))
                    continue
                self.consumed_nodes.add(id(self.assignments[name]))
        if conv.runtime is not None:
            self._record(call, f"{code_of(call.func)}(...)", self._runtime_text(conv), True)
            rewritten = dict(conv.runtime or [])
            for a in call.args:
                kw = a.keyword.value if a.keyword is not None else None
                if kw is None or kw in ("module", "device_mesh"):
                    continue
                if kw == "backward_prefetch" and rewritten.get(kw) == '"pre"':
                    continue  # reported with its TODO above
                self._runtime_kwarg_finding(a, call.args)
            return
        text = NAMES[FSDP] if fixable else "not rewritten: " + "; ".join(conv.blockers)
        self._record(call, f"{code_of(call.func)}(...)", text, fixable)
        for a, case in conv.kwarg_cases:
            self._kwarg_finding(a, case, fixable, conv.kwarg_became.get(id(a)))
        for note in conv.report_notes:
            self._record(call, "backward_prefetch", note, False)

    def _chosen_fsdp1_branch(self, func: cst.BaseExpression) -> str | None:
        """``"body"`` / ``"orelse"``: the branch of a called conditional expression (``(FSDP if ok else
        Plain)(m, ...)``) that is FSDP1's class, where the other is not; None for any other callee."""
        if not isinstance(func, cst.IfExp):
            return None
        body, orelse = (self._qn(b) == (FSDP, "") for b in (func.body, func.orelse))
        if body == orelse:
            return None
        return "body" if body else "orelse"

    def settle_inlined(self) -> None:
        """Once every ``FSDP(...)`` is planned: a variable whose every use was written out into rewritten calls
        (a wrap policy or MixedPrecision given to two wrappers) goes too; one used anywhere else (another call,
        a same-named variable elsewhere in the file, an import by another file) stays, as do the variables its
        value reads (they may be copied, not written out)."""
        for name, inlined in self.inlined_uses.items():
            if name in self.assignments and inlined >= self.name_uses.get(name, 0) - 1:
                for node in walk(self.assignments[name]):
                    self.consumed_nodes.add(id(node))

    def _in_lightning_strategy(self) -> str | None:
        """Why an ``FSDP(...)`` in a method of a subclass of Lightning's FSDP1 strategy stays FSDP1's (None
        elsewhere): the methods it inherits (state dicts, optimizer state, checkpoints) call FSDP1's API on the
        model it makes, so the call moves to the bridge with the class as a whole, not alone."""
        for cls in reversed(self.classes):
            for base in cls.bases:
                if self._lightning_name(base.value, "FSDPStrategy") is not None:
                    return (
                        f"{cls.name.value} subclasses Lightning's FSDP1 strategy, whose inherited methods (state "
                        "dicts, optimizer state, checkpoints) call FSDP1's API on the model this call makes: it stays "
                        "FSDP1's until the class as a whole moves to the bridge (see the TODO on the class)"
                    )
        method = self.functions[-1].name.value if self.functions else None
        if self.classes and method in LIGHTNING_MODEL_HOOKS and self._imports_lightning():
            return (
                f"{method}() of a Lightning module: Lightning's FSDP1 strategy (FSDPStrategy) leaves the module "
                "alone only when it already holds FSDP1 wrappers (isinstance(m, FullyShardedDataParallel)), and "
                "wraps the whole module in FSDP1 otherwise, the parts sharded by FSDP2 here included; it stays "
                "FSDP1's until the run's strategy moves off FSDPStrategy (see the TODO on FSDPStrategy(...))"
            )
        return None

    def _imports_lightning(self) -> bool:
        """Whether the file imports a Lightning package (``lightning``, ``pytorch_lightning``, ...)."""
        for node in walk(self.module) if self.module is not None else ():
            if isinstance(node, cst.ImportFrom) and node.module is not None:
                if code_of(node.module).split(".")[0] in LIGHTNING_PACKAGES:
                    return True
            elif isinstance(node, cst.Import):
                if any(code_of(a.name).split(".")[0] in LIGHTNING_PACKAGES for a in node.names):
                    return True
        return False

    def _fsdp1_only_user(self, call: cst.Call) -> str | None:
        """Why ``x = FSDP(...)`` must stay FSDP1's: ``x`` is handed, in the same function, to a function of
        another library that takes FSDP1's wrapper only (``FSDP1_ONLY_USERS``); None when it is not."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if not (
            isinstance(stmt, cst.SimpleStatementLine)
            and len(stmt.body) == 1
            and isinstance(stmt.body[0], cst.Assign)
            and stmt.body[0].value is call
            and len(stmt.body[0].targets) == 1
        ):
            return None
        target = code_of(stmt.body[0].targets[0].target)
        scope = self.functions[-1] if self.functions else self.module
        for n in walk(scope) if scope is not None else ():
            if not (isinstance(n, cst.Call) and n.args and code_of(n.args[0].value) == target):
                continue
            name = code_of(n.func).rsplit(".", 1)[-1]
            if name in FSDP1_ONLY_USERS:
                return (
                    f"{target} is handed to {FSDP1_ONLY_USERS[name]}; keep FSDP1 here, or drop that call where "
                    "the model moves to FSDP2"
                )
        return None

    def _units_wrapped_by_class(self) -> str | None:
        """Why every ``FSDP(...)`` of this file stays FSDP1's: the file hands FSDP1's class to a call as a value
        (``_recursive_wrap(module, policy, wrapper_cls=FSDP)``, a wrap helper of its own), which wraps modules
        with FSDP1 and stays as it is; a root made by ``fsdp_bridge.shard`` over such units is refused. None when
        it does not (``isinstance`` tests, ``functools.partial(FSDP, ...)`` and ``enable_wrap`` have rewrites or
        reports of their own)."""
        if self.module is None:
            return None
        if self._wrapped_by_class is None:
            self._wrapped_by_class = ""
            for n in walk(self.module):
                callee = code_of(n.func).rsplit(".", 1)[-1] if isinstance(n, cst.Call) else ""
                if not isinstance(n, cst.Call) or callee in ("issubclass", "partial") or "instance" in callee.lower():
                    continue  # tests (isinstance, assertIsInstance) and partial(FSDP, ...) wrap nothing here
                if self._qn(n.func) in (("enable_wrap", ""), ("wrap", "")):
                    continue
                # the class itself (a name), not a model it makes: ``Policy(FSDP(model), ...)`` hands on a wrapper
                if any(
                    isinstance(a.value, (cst.Name, cst.Attribute)) and self._qn(a.value) == (FSDP, "") for a in n.args
                ):
                    self._wrapped_by_class = (
                        f"this file hands FSDP1's class to {short(code_of(n.func), 40)}(...), which "
                        "wraps modules with FSDP1 and stays as it is; fsdp_bridge.shard refuses a model holding "
                        "FSDP1 units, so this call stays FSDP1's too: move both to FSDP2 together (fsdp_bridge."
                        "enable_wrap(fsdp_bridge.BridgeConfig.from_fsdp1(**kwargs)) with fsdp_bridge.wrap_module on "
                        "each unit, then fsdp_bridge.shard on the root)"
                    )
                    break
        return self._wrapped_by_class or None

    def _plan_partial(self, node: cst.Call) -> bool:
        """``functools.partial(FSDP, **kwargs)`` (a wrapper applied later as ``wrapper(module)``) ->
        ``functools.partial(fsdp_bridge.shard, config=fsdp_bridge.BridgeConfig.from_fsdp1(**kwargs))``."""
        if not (
            len(node.args) >= 1
            and node.args[0].keyword is None
            and node.args[0].star == ""
            and self._qn(node.args[0].value) == (FSDP, "")
            and any(q.name == "functools.partial" for q in self.get_metadata(QualifiedNameProvider, node.func, set()))
        ):
            return False
        self.uses_fsdp1 = True
        self.partials.add(id(node))
        self._consume(node.func)
        for a in node.args:
            self._consume(a.value)
        construct = f"{code_of(node.func)}({code_of(node.args[0].value)}, ...)"
        rest = node.args[1:]
        blockers = [
            f"{code_of(a.value)}: positional arguments after FSDP (the module is given when the wrapper is called)"
            for a in rest
            if a.keyword is None and a.star != "**"
        ] + [
            f"{a.keyword.value}=: module objects fixed in the wrapper; name them for the bridge: "
            "BridgeConfig(ignored_modules=['path.to.module' or 'ClassName'])"
            for a in rest
            if a.keyword is not None and a.keyword.value in ("module", *IGNORED_KWARGS)
        ]
        conv = Conversion()
        runtime = None
        if not blockers:
            probe = node.with_changes(args=[cst.Arg(cst.Name("module")), *rest])
            runtime = self._plan_runtime(probe, conv)
            blockers = conv.blockers
        if runtime is None:
            self._record(node, construct, "not rewritten: " + "; ".join(blockers), False)
            return True
        i1, i2 = "    ", "        "
        lines = [
            f"{code_of(node.func)}(",
            f"{i1}fsdp_bridge.shard,",
            f"{i1}config=fsdp_bridge.BridgeConfig.from_fsdp1(",
        ]
        conv.runtime = runtime
        lines += runtime_lines(conv, i2)
        lines.append(f"{i1}),")
        if conv.mesh is not None:
            lines.append(f"{i1}mesh={code_of(conv.mesh)},")
        lines.append(")")
        self.call_rewrites[id(node)] = "\n".join(lines)
        self.needs_imports.add(("fsdp_bridge", None))
        names = runtime_names(runtime)
        self._record(
            node,
            construct,
            f"{code_of(node.func)}(fsdp_bridge.shard, config=fsdp_bridge.BridgeConfig.from_fsdp1(...)"
            + (", mesh=...)" if conv.mesh is not None else ")")
            + f": calling it shards the module it is given; {', '.join(names) or 'no options'} kept as written and "
            "translated when the code runs (FSDP1's meaning, exactly)",
            True,
        )
        self._kept_kwarg_findings(rest, runtime)
        return True

    def _kept_kwarg_findings(self, args: Sequence[cst.Arg], runtime: list[tuple[str, str]]) -> None:
        """One report line per keyword argument kept for ``from_fsdp1`` (what its value becomes)."""
        prefetch = dict(runtime)
        for a in args:
            if a.keyword is None or a.keyword.value == "device_mesh":
                continue
            if a.keyword.value == "backward_prefetch" and prefetch.get("backward_prefetch") == '"pre"':
                continue  # reported with its TODO by _plan_runtime
            self._runtime_kwarg_finding(a, args)

    def _under_torch_enable_wrap(self) -> bool:
        """Inside ``with enable_wrap(...)`` of torch's that stays as it is (its wrap() must stay torch's)."""
        return any(
            isinstance(stmt, cst.With)
            and any(
                isinstance(item.item, cst.Call)
                and self._qn(item.item.func) == ("enable_wrap", "")
                and id(item.item) not in self.call_rewrites
                for item in stmt.items
            )
            for stmt in self.stmt_stack
        )

    def _plan_enable_wrap(self, node: cst.Call) -> bool:
        """``enable_wrap(wrapper_cls=FSDP, **kwargs)`` -> ``fsdp_bridge.enable_wrap(
        fsdp_bridge.BridgeConfig.from_fsdp1(**kwargs))`` (FSDP1's manual wrapping, same shape)."""
        cls = [a for a in node.args if a.keyword is not None and a.keyword.value == "wrapper_cls"]
        if len(cls) != 1 or self._qn(cls[0].value) != (FSDP, ""):
            return False  # another wrapper class (or one known only at run time): a TODO
        rest = [a for a in node.args if a is not cls[0]]
        if any(a.keyword is None and a.star != "**" for a in rest):
            return False
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if isinstance(stmt, cst.With) and any(
            isinstance(c, cst.Call)
            and self._qn(c.func) == ("wrap", "")
            and not (len(c.args) == 1 and c.args[0].keyword is None and c.args[0].star == "")
            for c in walk(stmt.body)
        ):
            # torch's wrap(m, **overrides) inside it stays torch's (a TODO): inside fsdp_bridge.enable_wrap it
            # would refuse them, so the block stays FSDP1's whole
            self._record(
                node,
                "enable_wrap(...)",
                "not rewritten: a wrap(module, **overrides) in its block stays torch's (see its TODO), and inside "
                "fsdp_bridge.enable_wrap torch's wrap refuses overrides: the block stays FSDP1's; write each "
                "wrap as fsdp_bridge.ManualWrap(fsdp_bridge.BridgeConfig.from_fsdp1(**{**<enable_wrap's "
                "arguments>, **overrides})).wrap(module) and drop the with, or move it to FSDP2 by hand",
                False,
            )
            self._consume(node)
            return True
        conv = Conversion()
        probe = node.with_changes(args=[cst.Arg(cst.Name("module")), *rest])
        runtime = self._plan_runtime(probe, conv)
        if runtime is None:
            self._record(node, "enable_wrap(...)", "not rewritten: " + "; ".join(conv.blockers), False)
            self._consume(node)
            return True
        self._consume(node.func)
        for a in node.args:
            self._consume(a.value)
        items = [f"{kw}{code}" if kw in ("*", "**") else f"{kw}={code}" for kw, code in runtime]
        config = f"fsdp_bridge.BridgeConfig.from_fsdp1({', '.join(items)})"
        mesh = f", mesh={code_of(conv.mesh)}" if conv.mesh is not None else ""
        code = f"fsdp_bridge.enable_wrap({config}{mesh})"
        if "\n" in code or len(code) > 100 or any(lead or trail for lead, trail in conv.arg_comments):
            i1, i2 = "    ", "        "
            conv.runtime = runtime
            lines = ["fsdp_bridge.enable_wrap(", f"{i1}fsdp_bridge.BridgeConfig.from_fsdp1("]
            lines += runtime_lines(conv, i2)
            lines.append(f"{i1}),")
            if conv.mesh is not None:
                lines.append(f"{i1}mesh={code_of(conv.mesh)},")
            lines.append(")")
            code = "\n".join(lines)
        self.call_rewrites[id(node)] = code
        self.needs_imports.add(("fsdp_bridge", None))
        names = runtime_names(runtime)
        self._record(
            node,
            "enable_wrap(...)",
            "fsdp_bridge.enable_wrap(fsdp_bridge.BridgeConfig.from_fsdp1(...)"
            + (", mesh=...)" if conv.mesh is not None else ")")
            + f": fsdp_bridge.wrap_module(m) inside it shards m as a unit with that config; "
            f"{', '.join(names) or 'no options'} kept as written and translated when the code runs (FSDP1's "
            "meaning, exactly); a later fsdp_bridge.shard of the whole model keeps those units",
            True,
        )
        self._kept_kwarg_findings(rest, runtime)
        return True

    def _other_accelerator(self, call: cst.Call) -> str | None:
        """Why ``call`` stays FSDP1's under the bridge target: it is given a ``device_id`` in a file that also runs
        on an accelerator other than CUDA (XPU, NPU, HPU, MLU), where fsdp_bridge does not shard; None otherwise."""
        device = next((a for a in call.args if a.keyword is not None and a.keyword.value == "device_id"), None)
        if self.target != "bridge" or device is None or (acc := other_accelerator(self.code)) is None:
            return None
        return (
            f"device_id={short(code_of(device.value), 40)}: this file runs on {acc} (named in it), and fsdp_bridge "
            "shards on CUDA or CPU only; "
            "--target torch writes torch's fully_shard over a mesh of the machine's accelerator"
        )

    def _plan_runtime(self, call: cst.Call, static: Conversion) -> list[tuple[str, str]] | None:
        """FSDP1's arguments by name for ``BridgeConfig.from_fsdp1``; None when they cannot be named."""
        out: list[tuple[str, str]] = []
        static.arg_comments = []
        static.slot_comments = {}

        def add(kw: str, code: str) -> None:  # an argument kept, with the comments written around it
            out.append((kw, code))
            static.arg_comments.append(comments_around(call, i))

        for i, a in enumerate(call.args):
            if a.star == "*":
                before = call.args[:i]
                if i != 1 or before[0].keyword is not None or before[0].star or out:
                    static.blockers.append(f"*{code_of(a.value)}: positional arguments unpacked at run time")
                    return None
                # FSDP(module, *args, ...): from_fsdp1 takes FSDP1's positional arguments after module in order
                add("*", code_of(a.value))
                continue
            if a.keyword is None and not a.star and out and out[0][0] == "*":
                static.blockers.append(f"{short(code_of(a.value), 40)}: a positional argument after *args")
                return None
            if a.star == "**":
                add("**", code_of(a.value))
                continue
            name = a.keyword.value if a.keyword else (FSDP1_POSITIONAL[i] if i < len(FSDP1_POSITIONAL) else None)
            if name is None:
                static.blockers.append(f"positional argument {i + 1}: FullyShardedDataParallel takes no more")
                return None
            if name == OLD_WRAP_KWARG:  # kept as written, a value the bridge reads would be torch 1.11's
                static.blockers = [
                    f"{name}={short(code_of(a.value), 40)}: torch 1.11's name of auto_wrap_policy, with other "
                    "arguments known only when the code runs; rename it auto_wrap_policy (and torch 1.11's "
                    "default_auto_wrap_policy size_based_auto_wrap_policy) and run --fix again"
                ]
                return None
            if name not in FSDP1_POSITIONAL and name != "ignored_parameters":  # the only reason shown
                static.blockers = [f"{name}={short(code_of(a.value), 40)}: not an argument of FullyShardedDataParallel"]
                return None
            if name in ("module", "device_mesh"):  # out of the config: their comments go with them
                static.module, static.mesh = (a.value, static.mesh) if name == "module" else (static.module, a.value)
                lead, trail = comments_around(call, i)
                if lead or trail:
                    static.slot_comments["module" if name == "module" else "mesh"] = (lead, trail)
            elif name == "process_group" and not m.matches(a.value, m.Name("None")):
                # FSDP2 shards over a DeviceMesh: the group (a data-parallel group of a model-parallel
                # setup, or HYBRID_SHARD's pair) becomes one when the code runs, passed as shard(mesh=).
                if any(b.keyword is not None and b.keyword.value == "device_mesh" for b in call.args):
                    static.blockers.append("process_group= with device_mesh=: FSDP1 takes one of them; drop one")
                    return None
                self.needs_imports.add(("fsdp_bridge", None))
                static.mesh = cst.parse_expression(f"fsdp_bridge.mesh_from_process_group({code_of(a.value)})")
            elif name in IGNORED_KWARGS and not m.matches(a.value, m.Name("None")):
                # modules or parameters (torch 2.0's ignored_parameters: ignored_states of parameters)
                names = self._module_paths(a.value, static.module)
                code = None
                if names is not None:
                    code = repr(names)
                elif static.module is not None:  # module objects known at run time: their paths, then
                    self.needs_imports.add(("fsdp_bridge", None))
                    code = f"fsdp_bridge.module_names({code_of(static.module)}, {code_of(a.value)})"
                earlier = next((k for k, (kw, _) in enumerate(out) if kw == "ignored_modules"), None)
                if code is not None and earlier is not None:
                    # ignored_states= and ignored_modules= both written (FSDP1 takes one of them not None when it
                    # runs): one keyword holding both lists, each empty for None
                    out[earlier] = ("ignored_modules", f"{out[earlier][1]} + {code}")
                elif code is not None:
                    add("ignored_modules", code)
                else:
                    static.blockers.append(
                        f"{name}={code_of(a.value)}: name the modules for the bridge: "
                        "BridgeConfig(ignored_modules=['path.to.module' or 'ClassName'])"
                    )
                    return None
            elif name == "backward_prefetch" and self._member(a.value, "BackwardPrefetch") != "BACKWARD_PRE":
                member = "NONE" if m.matches(a.value, m.Name("None")) else self._member(a.value, "BackwardPrefetch")
                if member == "NONE":  # FSDP1's "no prefetch" runs on FSDP2 (each unit prefetches itself)
                    add(name, '"none"')
                elif member == "BACKWARD_POST":
                    # FSDP2 has one backward order (BACKWARD_PRE's): say so where it changes.
                    note = f"backward_prefetch={code_of(a.value)} has no FSDP2 equivalent; using 'pre': " + fsdp2_case(
                        "backward_prefetch", "post"
                    )
                    self._record(a, "backward_prefetch", note, False)
                    add(name, '"pre"')
                else:
                    add(name, code_of(a.value))
            else:
                add(name, code_of(a.value))
        if static.module is None:
            return None
        return out

    def _module_paths(self, value: cst.BaseExpression, module: cst.BaseExpression | None) -> list[str] | None:
        """``[model.lm_head, model.model.embed]`` -> ``["lm_head", "model.embed"]`` when every entry is an
        attribute path under the module being wrapped."""
        if module is None or not isinstance(value, (cst.List, cst.Tuple, cst.Set)):
            return None
        root = code_of(module)
        names = []
        for element in value.elements:
            text = code_of(element.value)
            if not text.startswith(root + ".") or not all(p.isidentifier() for p in text[len(root) + 1 :].split(".")):
                return None
            names.append(text[len(root) + 1 :])
        return names

    def _runtime_text(self, conv: Conversion) -> str:
        names = runtime_names(conv.runtime or [])
        return (
            "fsdp_bridge.shard(model, fsdp_bridge.BridgeConfig.from_fsdp1(...)"
            + (", mesh=...)" if conv.mesh is not None else ")")
            + f": {', '.join(names) or 'no options'} kept as written and translated when the code runs "
            "(FSDP1's meaning, exactly; print fsdp_bridge.get_bridge(model).report for what each became)"
        )

    def _runtime_kwarg_finding(self, a: cst.Arg, siblings: Sequence[cst.Arg] = ()) -> None:
        kw = a.keyword.value if a.keyword else ""
        pos = self.get_metadata(PositionProvider, a)
        value = code_of(a.value)
        sync = [code_of(b.value) for b in siblings if b.keyword is not None and b.keyword.value == "sync_module_states"]
        if self._plan_param_init_fn(a, kw, value, sync):
            return
        described = self._describe_value(kw, a.value)
        group = [b for b in siblings if b.keyword is not None and b.keyword.value == "process_group"]
        if kw == "sharding_strategy" and group and code_of(group[0].value) != "None":
            # The mesh is the process group's (mesh_from_process_group), not one over every rank.
            described = described.replace("mesh over all ranks", "mesh over the ranks of process_group=")
        self.findings.append(
            CodeFinding(self.path, pos.start.line, pos.start.column, f"{kw}={short(value)}", described, True)
        )

    def _built_on_meta(self, module: cst.BaseExpression, *, always: bool = False) -> bool:
        """``module`` is a name this function assigns inside ``with torch.device("meta"):`` (on some path:
        ``if args.meta_init: with torch.device("meta"): m = Net()``); ``always``: in a ``with`` that no ``if`` of the
        function holds (every rank builds it there, rank 0 included)."""
        if not isinstance(module, cst.Name) or not self.functions:
            return False
        branched = {
            id(w) for n in walk(self.functions[-1]) if isinstance(n, cst.If) for w in walk(n) if isinstance(w, cst.With)
        }
        for w in walk(self.functions[-1]):
            if always and id(w) in branched:
                continue
            if not isinstance(w, cst.With) or not any(
                isinstance(i.item, cst.Call)
                and code_of(i.item.func) in ("torch.device", "device")
                and i.item.args
                and code_of(i.item.args[0].value).strip("'\"") == "meta"
                for i in w.items
            ):
                continue
            if any(
                isinstance(n, cst.Assign) and any(m.matches(t.target, m.Name(module.value)) for t in n.targets)
                for n in walk(w.body)
            ):
                return True
        return False

    def _plan_static(self, call: cst.Call) -> Conversion:
        conv = Conversion()
        self._consume(call.func)
        line = self.lines[self.get_metadata(PositionProvider, call).start.line - 1]
        conv.indent = line[: len(line) - len(line.lstrip())]
        config: list[cst.Arg] = [make_arg("backend", make_str("fsdp2"))]
        strategy_name: str | None = "full_shard"
        has_wrap = False
        notes_for_report: list[str] = []
        kwarg_nodes: list[tuple[cst.Arg, str | None]] = []
        bare_policies: list[cst.BaseExpression] = []
        pending: list[str] = []  # comments of arguments that became nothing, for the next slot
        for i, a in enumerate(call.args):
            kw = a.keyword.value if a.keyword else None
            if kw == OLD_WRAP_KWARG:
                kw = "auto_wrap_policy"  # torch 1.11's name of it
            if a.star:
                conv.blockers.append(f"{a.star}{code_of(a.value)}: arguments unpacked at run time")
                continue
            before = (len(config), conv.mesh)
            lead, trail = comments_around(call, i)
            pending += lead
            if (kw is None and i == 0) or kw == "module":
                conv.module = a.value
                if pending or trail:
                    conv.slot_comments["module"] = (pending, trail)
                pending = []
                given = {b.keyword.value for b in call.args if b.keyword is not None}
                if (self._built_on_meta(a.value) and not given & {"param_init_fn", "sync_module_states"}) or (
                    self._built_on_meta(a.value, always=True) and "param_init_fn" not in given
                ):
                    # FSDP1 materialises meta-device modules itself (each module's reset_parameters(), unit by
                    # unit; with sync_module_states rank 0's are then broadcast, so a model on meta on every rank,
                    # rank 0 included, is materialised too); BridgeConfig.from_fsdp1 does the same, a config
                    # written out would refuse the model
                    conv.blockers.append(
                        f"{short(code_of(a.value), 40)} is built on the meta device, which FSDP1 materialises "
                        "with each module's reset_parameters()"
                    )
                continue
            if kw is None:
                conv.blockers.append(f"positional argument {i + 1} ({code_of(a.value)}): pass it by keyword")
                continue
            kwarg_nodes.append((a, None))
            value = self._follow(a.value, conv) if kw in FOLLOWED_KWARGS else a.value
            if kw == "sharding_strategy":
                member = self._member(value, "ShardingStrategy")
                if m.matches(value, m.Name("None")):
                    member = "FULL_SHARD"  # FSDP1 takes None as its default, FULL_SHARD
                if member in STRATEGIES:
                    strategy_name = STRATEGIES[member]
                    kwarg_nodes[-1] = (a, strategy_name)
                    config.append(make_arg("strategy", make_str(strategy_name)))
                    self._consume(value)
                else:
                    strategy_name = None
                    config.append(make_arg("strategy", value))  # torch's enum is accepted at run time
            elif kw == "auto_wrap_policy":
                wrap = self._wrap(value, conv)
                if wrap is not None:
                    kwarg_nodes[-1] = (
                        a,
                        "none" if code_of(wrap) == '"none"' else "auto / classes / min_num_params / callable",
                    )
                    config.append(make_arg("wrap", wrap))
                    has_wrap = True
                    if isinstance(value, cst.Call):
                        self._consume(value)
                    else:  # the policy named bare: consumed only where the call is rewritten (below)
                        bare_policies.append(value)
            elif kw == "mixed_precision" and code_of(value) in ("None", "False"):
                # FSDP1 reads `mixed_precision or MixedPrecision()`: full precision, the config's default
                kwarg_nodes[-1] = (a, "fp32 (off)")
                self._consume(value)
            elif kw == "mixed_precision":
                mp = self._mixed_precision(value, conv)
                if mp is not None:
                    kwarg_nodes[-1] = (a, "param/reduce dtypes")
                    config.append(make_arg("mixed_precision", mp))
                    self._consume(value)
            elif kw == "cpu_offload":
                off = self._cpu_offload(value, conv)
                if off is not None:
                    config.append(make_arg("cpu_offload", off))
                    self._consume(value)
            elif kw == "backward_prefetch":
                member = "NONE" if m.matches(value, m.Name("None")) else self._member(value, "BackwardPrefetch")
                if member in ("BACKWARD_PRE", "NONE"):  # FSDP1's meaning on FSDP2 (NONE: no prefetch, emulated)
                    case = "pre" if member == "BACKWARD_PRE" else "none"
                    kwarg_nodes[-1] = (a, case)
                    self._consume(value)
                    config.append(make_arg("backward_prefetch", make_str(case)))
                elif member == "BACKWARD_POST":
                    self._consume(value)
                    note = f"backward_prefetch={code_of(a.value)} has no FSDP2 equivalent; using 'pre': " + fsdp2_case(
                        "backward_prefetch", "post"
                    )
                    conv.notes.append(note)
                    notes_for_report.append(note)
                    config.append(make_arg("backward_prefetch", make_str("pre")))
                else:
                    conv.blockers.append(f"backward_prefetch={code_of(a.value)}: not a BackwardPrefetch member")
            elif kw in ("forward_prefetch", "limit_all_gathers", "sync_module_states"):
                literal = code_of(a.value)
                # FSDP1 reads these as truths (an argparse int 0/1 included); BridgeConfig takes a bool, and
                # an int forward_prefetch is the bridge's own prefetch depth: bool() keeps FSDP1's meaning.
                flag = a.value if literal in ("True", "False") else cst.Call(cst.Name("bool"), [cst.Arg(a.value)])
                config.append(make_arg(kw, flag))
                kwarg_nodes[-1] = (
                    a,
                    "any" if kw == "limit_all_gathers" else literal.lower() if literal in ("True", "False") else None,
                )
            elif kw == "use_orig_params":
                pass  # FSDP2 parameters are always the original ones
            elif kw == "device_id":
                config.append(make_arg("device", make_str("cpu" if "cpu" in code_of(a.value) else "auto")))
            elif kw == "device_mesh":
                conv.mesh = a.value
            else:
                conv.blockers.append(
                    f"{kw}={code_of(a.value)}: no mechanical BridgeConfig equivalent "
                    f"({fsdp2_any(KWARG_OPTION.get(kw, kw))})"
                )
            slot = (  # what this argument became (the module's comments are taken above)
                "mesh"
                if conv.mesh is not before[1]
                else code_of(config[-1].keyword)
                if len(config) > before[0] and config[-1].keyword is not None
                else None
            )
            became = (
                [  # a value passed on as written says nothing new
                    code_of(arg)
                    for arg in config[before[0] :]
                    if code_of(arg.value) not in (code_of(a.value), code_of(value))
                ]
                + (
                    [f"mesh={short(code_of(conv.mesh), 40)}"]
                    if conv.mesh is not before[1] and conv.mesh is not None
                    else []
                )
            )
            if became:
                conv.kwarg_became[id(a)] = short(", ".join(became), 80)
            if slot is not None:
                if pending or trail:
                    conv.slot_comments[slot] = (pending, trail)
                pending = []
            elif trail:
                pending.append(trail)
        pending += closing_comments(call)
        if pending:
            conv.slot_comments[""] = (pending, None)
        if not has_wrap:
            config.append(make_arg("wrap", make_str("none")))
        if conv.mesh is not None:
            if strategy_name is None:
                conv.blockers.append("device_mesh with a strategy known only at run time: pass mesh= by hand")
            elif strategy_name.startswith("hybrid") and not any(isinstance(n, cst.Call) for n in walk(conv.mesh)):
                # shard() takes a given mesh's shape anyway; a mesh made by a call (init_device_mesh(...)) is not
                # written twice: a second call would build a second mesh and its process groups
                config.append(make_arg("hybrid_shape", cst.parse_expression(f"tuple({code_of(conv.mesh)}.shape)")))
        if conv.module is None:
            conv.blockers.append("no module argument")
        if not conv.blockers:
            for value in bare_policies:
                self._consume(value)
        conv.config_args = config
        conv.kwarg_cases = kwarg_nodes
        conv.report_notes = notes_for_report
        return conv

    def _kwarg_finding(self, a: cst.Arg, case: str | None, fixable: bool, became: str | None = None) -> None:
        """One report line per argument: the value the source gave, what it became, and what that means."""
        kw = a.keyword.value if a.keyword else ""
        option = KWARG_OPTION.get(kw, kw)
        pos = self.get_metadata(PositionProvider, a)
        # Arguments are reported, not given TODOs of their own: the call's TODO lists the blockers.
        text = fsdp2_case(option, case) if case else self._describe_value(kw, a.value)
        if became is not None and fixable:
            text = f"{became}: {text}"
        construct = f"{kw}={short(without_comments(a.value))}"
        followed = kw in FOLLOWED_KWARGS or kw == OLD_WRAP_KWARG
        if isinstance(a.value, cst.Name) and a.value.value in self.assignments and followed:
            held = self.assignments[a.value.value]
            construct += f" (= {short(without_comments(held), 80)})"  # the value the name holds
        self.findings.append(CodeFinding(self.path, pos.start.line, pos.start.column, construct, text, fixable))
