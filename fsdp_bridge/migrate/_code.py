"""``migrate code``: find FSDP1 API use in Python sources and rewrite the mechanical cases.

Sources are read as a concrete syntax tree (libcst), so a rewrite keeps every comment and
all formatting outside the rewritten expressions, and the output always parses.  Names
are resolved through the file's imports (``FSDP`` imported as an alias,
``torch.distributed.fsdp.FullyShardedDataParallel`` spelt in full, ...).

``--fix`` rewrites:

* ``FullyShardedDataParallel(model, ...)`` into ``fsdp_bridge.shard(model, fsdp_bridge.BridgeConfig(...))``
  when every argument has an equivalent config value (policies built in a variable are followed);
* ``model.no_sync()`` -> ``fsdp_bridge.no_sync(model)``, ``model.clip_grad_norm_(...)`` ->
  ``fsdp_bridge.clip_grad_norm_(model, ...)``, ``FSDP.summon_full_params(model, writeback=...)`` ->
  ``fsdp_bridge.summon_full_params(model, writeback=...)``;
* full-state-dict saving (``with FSDP.state_dict_type(model, FULL_STATE_DICT): sd = model.state_dict()``
  followed by ``torch.save`` on rank 0) -> ``fsdp_bridge.save_checkpoint(path, model, kind="full")``,
  and full-state-dict loading -> ``fsdp_bridge.load_checkpoint(path, model)``.

Everything else gets a ``# TODO(fsdp-bridge): ...`` comment above its statement naming the
replacement.  Running it again changes nothing.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor
from libcst.metadata import MetadataWrapper, PositionProvider, QualifiedNameProvider

from fsdp_bridge.mapping import TABLE
from fsdp_bridge.migrate._report import CodeFinding, CodeReport

__all__ = ["MigratedSource", "migrate_paths", "migrate_source"]

TODO = "TODO(fsdp-bridge)"
FSDP = "FullyShardedDataParallel"

# Names (last components of a torch.distributed qualified name) and their replacements.
# The texts come from the mapping table where it has a row for the construct.


def _fsdp2(option: str) -> str:
    for rule in TABLE:
        if rule.option == option:
            return rule.fsdp2.text
    raise KeyError(option)


_NAMES: dict[str, str] = {
    FSDP: "fsdp_bridge.shard(model, fsdp_bridge.BridgeConfig(...)) (FSDP2: fully_shard on each unit, then the root)",
    "transformer_auto_wrap_policy": "BridgeConfig(wrap=[LayerClass, ...])",
    "size_based_auto_wrap_policy": "BridgeConfig(wrap={'min_num_params': N})",
    "ModuleWrapPolicy": "BridgeConfig(wrap=[LayerClass, ...])",
    "CustomPolicy": "BridgeConfig(wrap=callable) (a function module -> bool)",
    "lambda_auto_wrap_policy": "BridgeConfig(wrap=callable) (a function module -> bool)",
    "state_dict_type": "fsdp_bridge.save_checkpoint(path, model, optimizer, kind='full'|'sharded') / "
                       "fsdp_bridge.load_checkpoint(path, model, optimizer); or " + _fsdp2("state_dict_type"),
    "set_state_dict_type": "fsdp_bridge.save_checkpoint / load_checkpoint; or " + _fsdp2("state_dict_type"),
    "StateDictType": "fsdp_bridge.save_checkpoint(..., kind='full'|'sharded')",
    "FullStateDictConfig": "fsdp_bridge.save_checkpoint(..., kind='full') (rank 0 writes, CPU copy)",
    "ShardedStateDictConfig": "fsdp_bridge.save_checkpoint(..., kind='sharded')",
    "LocalStateDictConfig": "fsdp_bridge.save_checkpoint(..., kind='sharded') (FSDP2 has no local state dict)",
    "FullOptimStateDictConfig": "fsdp_bridge.save_checkpoint(path, model, optimizer, kind='full')",
    "ShardedOptimStateDictConfig": "fsdp_bridge.save_checkpoint(path, model, optimizer, kind='sharded')",
    "summon_full_params": "fsdp_bridge.summon_full_params(model, writeback=...); " + _fsdp2("summon_full_params"),
    "no_sync": "fsdp_bridge.no_sync(model); " + _fsdp2("no_sync"),
    "clip_grad_norm_": "fsdp_bridge.clip_grad_norm_(model, max_norm); " + _fsdp2("clip_grad_norm_"),
    "optim_state_dict": "fsdp_bridge.save_checkpoint(path, model, optimizer) / "
                        "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer)",
    "optim_state_dict_to_load": "fsdp_bridge.load_checkpoint(path, model, optimizer) / "
                                "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict("
                                "model, optimizer, sd)",
    "full_optim_state_dict": "get_optimizer_state_dict(model, optimizer, "
                             "options=StateDictOptions(full_state_dict=True))",
    "sharded_optim_state_dict": "get_optimizer_state_dict(model, optimizer)",
    "shard_full_optim_state_dict": "set_optimizer_state_dict(model, optimizer, sd, "
                                   "options=StateDictOptions(full_state_dict=True))",
    "scatter_full_optim_state_dict": "set_optimizer_state_dict(model, optimizer, sd, "
                                     "options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))",
    "ShardedGradScaler": "torch.amp.GradScaler(...) (" + _fsdp2("ShardedGradScaler") + ")",
    "CPUOffload": "BridgeConfig(cpu_offload=True) (" + _fsdp2("cpu_offload") + ")",
    "MixedPrecision": "BridgeConfig(mixed_precision={'param_dtype': ..., 'reduce_dtype': ..., 'buffer_dtype': ...})",
    "BackwardPrefetch": "BridgeConfig(backward_prefetch='pre') (FSDP2 has only BACKWARD_PRE timing)",
    "ShardingStrategy": "BridgeConfig(strategy='full_shard'|'shard_grad_op'|'no_shard'|'hybrid_shard'|"
                        "'hybrid_shard_zero2')",
    "apply_activation_checkpointing": "BridgeConfig(activation_checkpointing=True) checkpoints every wrap unit; "
                                      "remove this call once the config has it",
}
_FSDP_METHODS = ("state_dict_type", "set_state_dict_type", "summon_full_params", "optim_state_dict",
                 "optim_state_dict_to_load", "full_optim_state_dict", "sharded_optim_state_dict",
                 "shard_full_optim_state_dict", "scatter_full_optim_state_dict", "clip_grad_norm_", "no_sync")
_STRATEGIES = {"FULL_SHARD": "full_shard", "SHARD_GRAD_OP": "shard_grad_op", "NO_SHARD": "no_shard",
               "HYBRID_SHARD": "hybrid_shard", "_HYBRID_SHARD_ZERO2": "hybrid_shard_zero2"}
_KWARG_OPTION = {"sharding_strategy": "strategy", "auto_wrap_policy": "wrap", "mixed_precision": "mixed_precision",
                 "backward_prefetch": "backward_prefetch", "forward_prefetch": "forward_prefetch",
                 "limit_all_gathers": "limit_all_gathers", "cpu_offload": "cpu_offload",
                 "sync_module_states": "sync_module_states", "use_orig_params": "use_orig_params",
                 "device_id": "device_id", "device_mesh": "process_group", "process_group": "process_group",
                 "ignored_modules": "ignored_modules", "param_init_fn": "param_init_fn"}


def _resolve(qnames: Iterable[Any]) -> tuple[str, str] | None:
    """(kind, member) for an FSDP1 qualified name, e.g. ("FullyShardedDataParallel", "state_dict_type")."""
    for q in qnames:
        name: str = q.name
        if not name.startswith("torch.distributed."):
            continue
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in _NAMES and part not in _FSDP_METHODS:
                rest = parts[i + 1:]
                return part, rest[0] if rest else ""
    return None


@dataclass
class _Conversion:
    """How one FSDP(...) call becomes fsdp_bridge.shard(...), or why it cannot."""

    config_args: list[cst.Arg] = field(default_factory=list)
    module: cst.BaseExpression | None = None
    mesh: cst.BaseExpression | None = None
    blockers: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    consumed: list[str] = field(default_factory=list)
    """Variables (policies built beforehand) that the new config replaces."""
    indent: str = ""
    """Indentation of the statement holding the call (for a multi-line rewrite)."""


def _arg(name: str, value: cst.BaseExpression) -> cst.Arg:
    return cst.Arg(value=value, keyword=cst.Name(name), equal=cst.AssignEqual(
        whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))


def _str(value: str) -> cst.SimpleString:
    return cst.SimpleString(f'"{value}"')


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


class _Scanner(cst.CSTVisitor):
    """Pass 1: find constructs, plan rewrites (nothing changes)."""

    METADATA_DEPENDENCIES = (QualifiedNameProvider, PositionProvider)

    def __init__(self, path: str, code: str, assignments: dict[str, cst.BaseExpression],
                 name_uses: dict[str, int]) -> None:
        super().__init__()
        self.path = path
        self.lines = code.splitlines()
        self.assignments = assignments
        self.name_uses = name_uses
        self.findings: list[CodeFinding] = []
        self.todos: dict[int, list[str]] = {}  # id(statement) -> TODO texts
        self.conversions: dict[int, _Conversion] = {}  # id(FSDP call) -> conversion
        self.fixable_calls: dict[int, str] = {}  # id(call) -> "method" (no_sync, clip) or "summon"
        self.checkpoint_withs: dict[int, tuple[str, cst.BaseExpression, cst.BaseExpression]] = {}
        self.remove_stmts: set[int] = set()  # torch.save statements folded into save_checkpoint
        self.planning = True
        self.consumed_partial = False
        self.consumed_nodes: set[int] = set()
        self.stmt_stack: list[cst.CSTNode] = []
        self.uses_fsdp1 = False

    # -- helpers -------------------------------------------------------------------
    def _qn(self, node: cst.CSTNode) -> tuple[str, str] | None:
        return _resolve(self.get_metadata(QualifiedNameProvider, node, set()))

    def _record(self, node: cst.CSTNode, construct: str, replacement: str, fixable: bool) -> None:
        pos = self.get_metadata(PositionProvider, node)
        self.findings.append(CodeFinding(self.path, pos.start.line, pos.start.column, construct, replacement, fixable))
        if not fixable and self.stmt_stack:
            self.todos.setdefault(id(self.stmt_stack[-1]), []).append(f"{construct}: {replacement}")

    def _follow(self, expr: cst.BaseExpression, conv: _Conversion) -> cst.BaseExpression:
        """A variable assigned once in this file stands for its value."""
        if isinstance(expr, cst.Name) and expr.value in self.assignments:
            conv.consumed.append(expr.value)
            return self.assignments[expr.value]
        return expr

    # -- statements ----------------------------------------------------------------
    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self.stmt_stack.append(node)

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine) -> None:
        self.stmt_stack.pop()

    def _push(self, node: cst.CSTNode) -> None:
        self.stmt_stack.append(node)

    def visit_With(self, node: cst.With) -> None:
        self._push(node)

    def visit_Module(self, node: cst.Module) -> None:
        if self.planning:
            self._plan_block(node.body)

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        if self.planning:
            self._plan_block(node.body)

    def leave_With(self, original_node: cst.With) -> None:
        self.stmt_stack.pop()

    def visit_If(self, node: cst.If) -> None:
        self._push(node)

    def leave_If(self, original_node: cst.If) -> None:
        self.stmt_stack.pop()

    def visit_For(self, node: cst.For) -> None:
        self._push(node)

    def leave_For(self, original_node: cst.For) -> None:
        self.stmt_stack.pop()

    def visit_While(self, node: cst.While) -> None:
        self._push(node)

    def leave_While(self, original_node: cst.While) -> None:
        self.stmt_stack.pop()

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        module = _code(node.module) if node.module else ""
        if module.startswith("torch.distributed.fsdp"):
            self.uses_fsdp1 = True
        return False

    # -- expressions ---------------------------------------------------------------
    def visit_Call(self, node: cst.Call) -> bool | None:
        func = node.func
        hit = self._qn(func)
        if hit is not None and hit[0] == FSDP and hit[1] == "":
            self.uses_fsdp1 = True
            if self.planning:
                self._plan_fsdp(node)
            return None
        if self.planning or not self.uses_fsdp1:
            return None
        if hit is not None and hit[0] == FSDP and hit[1] == "summon_full_params":
            ok = (len(node.args) >= 1 and node.args[0].keyword is None
                  and all(a.keyword is not None and a.keyword.value in ("writeback", "recurse") for a in node.args[1:])
                  and all(_code(a.value) == "True" for a in node.args[1:]
                          if a.keyword and a.keyword.value == "recurse"))
            if ok:
                self.fixable_calls[id(node)] = "summon"
            self._record(node, "FSDP.summon_full_params(...)", _NAMES["summon_full_params"], ok)
            return False if ok else None
        if isinstance(func, cst.Attribute) and func.attr.value in ("no_sync", "clip_grad_norm_") and hit is None:
            qn = {q.name for q in self.get_metadata(QualifiedNameProvider, func, set())}
            if any(q.startswith("torch.nn") for q in qn):
                return None  # torch.nn.utils.clip_grad_norm_ already works on FSDP2
            if func.attr.value == "no_sync" and not node.args:
                self.fixable_calls[id(node)] = "method"
                self._record(node, f"{_code(func.value)}.no_sync()", _NAMES["no_sync"], True)
                return None
            if func.attr.value == "clip_grad_norm_" and node.args:
                self.fixable_calls[id(node)] = "method"
                self._record(node, f"{_code(func.value)}.clip_grad_norm_(...)", _NAMES["clip_grad_norm_"], True)
                return None
        return None

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        return self._reference(node)

    def visit_Name(self, node: cst.Name) -> bool:
        return self._reference(node)

    def _reference(self, node: cst.BaseExpression) -> bool:
        if self.planning:
            return True
        hit = self._qn(node)
        if hit is None:
            return True
        self.uses_fsdp1 = True
        if id(node) in self.consumed_nodes:
            return False
        kind, member = hit
        if kind == FSDP and member == "":
            # FSDP(...) calls are handled in visit_Call; isinstance(x, FSDP) and the like land here.
            self._record(node, _code(node), "torch.distributed.fsdp.FSDPModule (FSDP2 modules are FSDPModule)", False)
            return False
        if kind == FSDP:
            if member in ("state_dict_type", "set_state_dict_type", "summon_full_params"):
                self._record(node, f"FSDP.{member}", _NAMES[member], False)
            elif member in _NAMES:
                self._record(node, f"FSDP.{member}", _NAMES[member], False)
            return False
        self._record(node, _code(node), _NAMES[kind], False)
        return False

    # -- FSDP(...) -----------------------------------------------------------------
    def _plan_fsdp(self, call: cst.Call) -> None:
        conv = _Conversion()
        self._consume(call.func)
        line = self.lines[self.get_metadata(PositionProvider, call).start.line - 1]
        conv.indent = line[: len(line) - len(line.lstrip())]
        config: list[cst.Arg] = [_arg("backend", _str("fsdp2"))]
        strategy_name: str | None = "full_shard"
        has_wrap = False
        notes_for_report: list[str] = []
        kwarg_nodes: list[tuple[cst.Arg, str | None]] = []
        for i, a in enumerate(call.args):
            kw = a.keyword.value if a.keyword else None
            if a.star:
                conv.blockers.append(f"{a.star}{_code(a.value)}: arguments unpacked at run time")
                continue
            if (kw is None and i == 0) or kw == "module":
                conv.module = a.value
                continue
            if kw is None:
                conv.blockers.append(f"positional argument {i + 1} ({_code(a.value)}): pass it by keyword")
                continue
            kwarg_nodes.append((a, None))
            value = self._follow(a.value, conv) if kw in ("auto_wrap_policy", "mixed_precision", "cpu_offload",
                                                         "sharding_strategy", "backward_prefetch") else a.value
            if kw == "sharding_strategy":
                member = self._member(value, "ShardingStrategy")
                if member in _STRATEGIES:
                    strategy_name = _STRATEGIES[member]
                    kwarg_nodes[-1] = (a, strategy_name)
                    config.append(_arg("strategy", _str(strategy_name)))
                    self._consume(value)
                else:
                    strategy_name = None
                    config.append(_arg("strategy", value))  # torch's enum is accepted at run time
            elif kw == "auto_wrap_policy":
                wrap = self._wrap(value, conv)
                if wrap is not None:
                    kwarg_nodes[-1] = (a, "none" if _code(wrap) == '"none"' else
                                       "auto / classes / min_num_params / callable")
                    config.append(_arg("wrap", wrap))
                    has_wrap = True
                    self._consume(value)
            elif kw == "mixed_precision":
                mp = self._mixed_precision(value, conv)
                if mp is not None:
                    kwarg_nodes[-1] = (a, "param/reduce dtypes")
                    config.append(_arg("mixed_precision", mp))
                    self._consume(value)
            elif kw == "cpu_offload":
                off = self._cpu_offload(value, conv)
                if off is not None:
                    config.append(_arg("cpu_offload", off))
                    self._consume(value)
            elif kw == "backward_prefetch":
                member = "NONE" if m.matches(value, m.Name("None")) else self._member(value, "BackwardPrefetch")
                if member == "BACKWARD_PRE":
                    kwarg_nodes[-1] = (a, "pre")
                    self._consume(value)
                elif member in ("BACKWARD_POST", "NONE"):
                    self._consume(value)
                    note = (f"backward_prefetch={_code(a.value)} has no FSDP2 equivalent; using 'pre': "
                            + _fsdp2_case("backward_prefetch", "post" if member == "BACKWARD_POST" else "none"))
                    conv.notes.append(note)
                    notes_for_report.append(note)
                else:
                    conv.blockers.append(f"backward_prefetch={_code(a.value)}: not a BackwardPrefetch member")
                config.append(_arg("backward_prefetch", _str("pre"))) if member in (
                    "BACKWARD_PRE", "BACKWARD_POST", "NONE") else None
            elif kw in ("forward_prefetch", "limit_all_gathers", "sync_module_states"):
                config.append(_arg(kw, a.value))
                literal = _code(a.value)
                kwarg_nodes[-1] = (a, "any" if kw == "limit_all_gathers" else literal.lower()
                                   if literal in ("True", "False") else None)
            elif kw == "use_orig_params":
                pass  # FSDP2 parameters are always the original ones
            elif kw == "device_id":
                config.append(_arg("device", _str("cpu" if "cpu" in _code(a.value) else "auto")))
            elif kw == "device_mesh":
                conv.mesh = a.value
            else:
                conv.blockers.append(f"{kw}={_code(a.value)}: no mechanical BridgeConfig equivalent "
                                     f"({_fsdp2_any(_KWARG_OPTION.get(kw, kw))})")
        if not has_wrap:
            config.append(_arg("wrap", _str("none")))
        if conv.mesh is not None:
            if strategy_name is None:
                conv.blockers.append("device_mesh with a strategy known only at run time: pass mesh= by hand")
            elif strategy_name == "no_shard":
                conv.mesh = None  # the bridge builds NO_SHARD's (world, 1) mesh itself
            elif strategy_name.startswith("hybrid"):
                config.append(_arg("hybrid_shape", cst.parse_expression(f"tuple({_code(conv.mesh)}.shape)")))
        if conv.module is None:
            conv.blockers.append("no module argument")
        conv.config_args = config
        self.conversions[id(call)] = conv
        fixable = not conv.blockers
        if fixable:
            for name in conv.consumed:
                if self.name_uses.get(name, 0) > 2:  # used elsewhere too: keep the assignment
                    continue
                self.consumed_nodes.add(id(self.assignments[name]))
        text = _NAMES[FSDP] if fixable else "not rewritten: " + "; ".join(conv.blockers)
        self._record(call, f"{_code(call.func)}(...)", text, fixable)
        for a, case in kwarg_nodes:
            self._kwarg_finding(a, case, fixable)
        for note in notes_for_report:
            self._record(call, "backward_prefetch", note, False)

    def _kwarg_finding(self, a: cst.Arg, case: str | None, fixable: bool) -> None:
        kw = a.keyword.value if a.keyword else ""
        option = _KWARG_OPTION.get(kw, kw)
        pos = self.get_metadata(PositionProvider, a)
        # Arguments are reported, not given TODOs of their own: the call's TODO lists the blockers.
        self.findings.append(CodeFinding(self.path, pos.start.line, pos.start.column, f"{kw}=",
                                         _fsdp2_case(option, case) if case else _fsdp2_any(option), fixable))

    def _member(self, value: cst.BaseExpression, enum_name: str) -> str | None:
        hit = self._qn(value)
        if hit is not None and hit[0] == enum_name:
            return hit[1]
        return None

    def _consume(self, value: cst.BaseExpression) -> None:
        for node in _walk(value):
            self.consumed_nodes.add(id(node))

    def _wrap(self, value: cst.BaseExpression, conv: _Conversion) -> cst.BaseExpression | None:
        if m.matches(value, m.Name("None")):
            return _str("none")
        if isinstance(value, cst.Call):
            hit = self._qn(value.func)
            fn_qn = {q.name for q in self.get_metadata(QualifiedNameProvider, value.func, set())}
            if "functools.partial" in fn_qn and value.args:
                self.consumed_partial = True
                inner = self._qn(value.args[0].value)
                kwargs = {a.keyword.value: a.value for a in value.args[1:] if a.keyword}
                if inner and inner[0] == "transformer_auto_wrap_policy" and "transformer_layer_cls" in kwargs:
                    return _class_list(self._follow(kwargs["transformer_layer_cls"], conv))
                if inner and inner[0] == "size_based_auto_wrap_policy" and set(kwargs) == {"min_num_params"}:
                    return cst.parse_expression(f'{{"min_num_params": {_code(kwargs["min_num_params"])}}}')
            if hit and hit[0] == "ModuleWrapPolicy" and len(value.args) == 1:
                return _class_list(self._follow(value.args[0].value, conv))
        conv.blockers.append(f"auto_wrap_policy={_code(value)}: only transformer_auto_wrap_policy, "
                             "size_based_auto_wrap_policy (min_num_params) and ModuleWrapPolicy are converted; "
                             "give BridgeConfig(wrap=callable) for the rest")
        return None

    def _mixed_precision(self, value: cst.BaseExpression, conv: _Conversion) -> cst.BaseExpression | None:
        if m.matches(value, m.Name("None")):
            return None
        if isinstance(value, cst.Call):
            hit = self._qn(value.func)
            if hit and hit[0] == "MixedPrecision" and all(a.keyword for a in value.args):
                items = []
                for a in value.args:
                    assert a.keyword is not None
                    kw = a.keyword.value
                    if kw in ("param_dtype", "reduce_dtype", "buffer_dtype", "cast_forward_inputs"):
                        items.append(f'"{kw}": {_code(a.value)}')
                    elif kw == "cast_root_forward_inputs":
                        continue  # FSDP2 casts the root's inputs whenever param_dtype is set
                    elif kw == "keep_low_precision_grads" and _code(a.value) == "False":
                        continue
                    else:
                        conv.blockers.append(f"MixedPrecision({kw}=...): {_fsdp2_any(kw)}")
                        return None
                return cst.parse_expression("{" + ", ".join(items) + "}")
        conv.blockers.append(f"mixed_precision={_code(value)}: not a MixedPrecision(...) call with keywords")
        return None

    def _cpu_offload(self, value: cst.BaseExpression, conv: _Conversion) -> cst.BaseExpression | None:
        if m.matches(value, m.Name("None")):
            return None
        if isinstance(value, cst.Call):
            hit = self._qn(value.func)
            if hit and hit[0] == "CPUOffload":
                if not value.args:
                    return cst.Name("False")
                if len(value.args) == 1 and (value.args[0].keyword is None
                                             or value.args[0].keyword.value == "offload_params"):
                    return value.args[0].value
        conv.blockers.append(f"cpu_offload={_code(value)}: not a CPUOffload(offload_params=...) call")
        return None

    # -- state dicts -----------------------------------------------------------------
    def _plan_block(self, body: Sequence[cst.BaseStatement]) -> None:
        for i, stmt in enumerate(body):
            if not isinstance(stmt, cst.With):
                continue
            plan = self._checkpoint_plan(stmt, body[i + 1] if i + 1 < len(body) else None)
            if plan is None:
                continue
            kind, arg, model, remove = plan
            self.checkpoint_withs[id(stmt)] = (kind, arg, model)
            if remove is not None:
                self.remove_stmts.add(id(remove))
            call = cast(cst.Call, stmt.items[0].item)
            self._consume(call)
            for extra in call.args[2:]:
                value = self._follow(extra.value, _Conversion())
                if value is not extra.value and self.name_uses.get(cast(cst.Name, extra.value).value, 0) <= 2:
                    self._consume(value)
            replacement = (f'fsdp_bridge.save_checkpoint({_code(arg)}, {_code(model)}, kind="full")' if kind == "save"
                           else f"fsdp_bridge.load_checkpoint({_code(arg)}, {_code(model)})")
            self._record(stmt, "FSDP.state_dict_type(FULL_STATE_DICT) " + kind, replacement, True)

    def _checkpoint_plan(self, node: cst.With, following: cst.BaseStatement | None
                         ) -> tuple[str, cst.BaseExpression, cst.BaseExpression, cst.BaseStatement | None] | None:
        """``with FSDP.state_dict_type(M, StateDictType.FULL_STATE_DICT[, cfg]):`` whose body is
        ``sd = M.state_dict()`` followed by ``torch.save(sd, PATH)`` (optionally under a rank test),
        or ``M.load_state_dict(torch.load(PATH, ...))``."""
        if len(node.items) != 1 or not isinstance(node.items[0].item, cst.Call):
            return None
        call = node.items[0].item
        if self._qn(call.func) != (FSDP, "state_dict_type") or len(call.args) < 2:
            return None
        if self._member(call.args[1].value, "StateDictType") != "FULL_STATE_DICT":
            return None
        model = call.args[0].value
        body = node.body.body if isinstance(node.body, cst.IndentedBlock) else ()
        if len(body) != 1 or not isinstance(body[0], cst.SimpleStatementLine) or len(body[0].body) != 1:
            return None
        stmt = body[0].body[0]
        load = m.Expr(m.Call(func=m.Attribute(attr=m.Name("load_state_dict")),
                             args=[m.Arg(m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("load"))))]))
        if m.matches(stmt, load):
            outer = cast(cst.Call, cast(cst.Expr, stmt).value)
            inner = cast(cst.Call, outer.args[0].value)
            if _code(cast(cst.Attribute, outer.func).value) == _code(model) and inner.args:
                return "load", inner.args[0].value, model, None
            return None
        save = m.Assign(targets=[m.AssignTarget(m.Name())],
                        value=m.Call(func=m.Attribute(attr=m.Name("state_dict")), args=[]))
        if m.matches(stmt, save) and following is not None:
            assign = cast(cst.Assign, stmt)
            if _code(cast(cst.Attribute, cast(cst.Call, assign.value).func).value) != _code(model):
                return None
            path = _torch_save_path(following, cast(cst.Name, assign.targets[0].target).value)
            if path is not None:
                return "save", path, model, following
        return None


def _walk(node: cst.CSTNode) -> Iterable[cst.CSTNode]:
    yield node
    for child in node.children:
        yield from _walk(child)


def _class_list(expr: cst.BaseExpression) -> cst.BaseExpression:
    if isinstance(expr, (cst.Set, cst.List, cst.Tuple)):
        return cst.List([cst.Element(e.value) for e in expr.elements])
    return cst.parse_expression(f"list({_code(expr)})")


def _fsdp2_any(option: str) -> str:
    texts = [r.fsdp2.text for r in TABLE if r.option == option]
    return texts[0] if texts else "see docs/migration.md"


def _fsdp2_case(option: str, case: str) -> str:
    for r in TABLE:
        if r.option == option and r.case == case:
            return r.fsdp2.text
    return _fsdp2_any(option)


class _Collector(cst.CSTVisitor):
    """Single assignments ``name = expr`` (module or function level) and how often each name appears."""

    def __init__(self) -> None:
        super().__init__()
        self.assigned: dict[str, list[cst.BaseExpression]] = {}
        self.uses: dict[str, int] = {}

    def visit_Assign(self, node: cst.Assign) -> None:
        if len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name):
            self.assigned.setdefault(node.targets[0].target.value, []).append(node.value)

    def visit_Name(self, node: cst.Name) -> None:
        self.uses[node.value] = self.uses.get(node.value, 0) + 1


class _Fixer(cst.CSTTransformer):
    """Pass 2: apply the planned rewrites and TODO comments."""

    def __init__(self, scan: _Scanner, assignment_stmts: dict[int, str]) -> None:
        super().__init__()
        self.scan = scan
        self.assignment_stmts = assignment_stmts  # id(value expr) -> name
        self.removed: dict[int, Any] = {}

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        conv = self.scan.conversions.get(id(original_node))
        if conv is not None and not conv.blockers:
            return _render_shard(conv)
        kind = self.scan.fixable_calls.get(id(original_node))
        if kind is not None:
            func = updated_node.func
            if kind == "method" and isinstance(func, cst.Attribute):
                target = cst.parse_expression(f"fsdp_bridge.{func.attr.value}")
                return updated_node.with_changes(func=target, args=_commas([cst.Arg(func.value), *updated_node.args]))
            return updated_node.with_changes(func=cst.parse_expression("fsdp_bridge.summon_full_params"))
        return updated_node

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine,
                                  updated_node: cst.SimpleStatementLine) -> Any:
        if id(original_node) in self.scan.remove_stmts:
            return self._remove(updated_node)
        if len(original_node.body) == 1 and isinstance(original_node.body[0], cst.Assign):
            value = original_node.body[0].value
            if id(value) in self.scan.consumed_nodes and id(value) in self.assignment_stmts:
                return self._remove(updated_node)
        return _with_todos(original_node, updated_node, self.scan.todos)

    def _remove(self, node: Any) -> Any:
        """Mark for removal; the enclosing block moves its comments to the next statement."""
        self.removed[id(node)] = node  # holding the node keeps its id unique until the block is rebuilt
        return node

    def _drop_removed(self, body: Sequence[Any]) -> list[Any]:
        out: list[Any] = []
        carry: list[cst.EmptyLine] = []
        for stmt in body:
            if id(stmt) in self.removed and self.removed[id(stmt)] is stmt:
                del self.removed[id(stmt)]
                carry.extend(stmt.leading_lines)
                continue
            if carry:
                stmt = stmt.with_changes(leading_lines=[*carry, *stmt.leading_lines])
                carry = []
            out.append(stmt)
        return out

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock) -> Any:
        body = self._drop_removed(updated_node.body)
        return updated_node.with_changes(body=body or [cst.SimpleStatementLine([cst.Pass()])])

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        return updated_node.with_changes(body=self._drop_removed(updated_node.body))

    def _compound(self, original_node: Any, updated_node: Any) -> Any:
        return _with_todos(original_node, updated_node, self.scan.todos)

    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> Any:
        if id(original_node) in self.scan.remove_stmts:
            return self._remove(updated_node)
        return self._compound(original_node, updated_node)

    def leave_For(self, original_node: cst.For, updated_node: cst.For) -> Any:
        return self._compound(original_node, updated_node)

    def leave_While(self, original_node: cst.While, updated_node: cst.While) -> Any:
        return self._compound(original_node, updated_node)

    def leave_With(self, original_node: cst.With, updated_node: cst.With) -> Any:
        plan = self.scan.checkpoint_withs.get(id(original_node))
        if plan is not None:
            kind, arg, model = plan
            code = (f'fsdp_bridge.save_checkpoint({_code(arg)}, {_code(model)}, kind="full")' if kind == "save"
                    else f"fsdp_bridge.load_checkpoint({_code(arg)}, {_code(model)})")
            return cst.parse_statement(code).with_changes(leading_lines=updated_node.leading_lines)
        return self._compound(original_node, updated_node)


def _render_shard(conv: _Conversion) -> cst.BaseExpression:
    """``fsdp_bridge.shard(module, fsdp_bridge.BridgeConfig(...)[, mesh=...])``, one argument per line
    when a single line would be long."""
    assert conv.module is not None
    config = [f"{_code(a.keyword)}={_code(a.value)}" for a in conv.config_args if a.keyword is not None]
    tail = [f"mesh={_code(conv.mesh)}"] if conv.mesh is not None else []
    one_line = (f"fsdp_bridge.shard({_code(conv.module)}, fsdp_bridge.BridgeConfig({', '.join(config)})"
                + "".join(f", {t}" for t in tail) + ")")
    if len(conv.indent) + len(one_line) <= 100:
        return cst.parse_expression(one_line)
    # libcst adds the enclosing block's indentation to each continuation line.
    i1, i2 = "    ", "        "
    lines = ["fsdp_bridge.shard(", f"{i1}{_code(conv.module)},", f"{i1}fsdp_bridge.BridgeConfig("]
    lines += [f"{i2}{c}," for c in config]
    lines += [f"{i1}),"] + [f"{i1}{t}," for t in tail] + [")"]
    return cst.parse_expression("\n".join(lines))


def _torch_save_path(stmt: cst.BaseStatement, var: str) -> cst.BaseExpression | None:
    """PATH when ``stmt`` is ``torch.save(var, PATH)`` or ``if <rank test>: torch.save(var, PATH)``."""
    save = m.SimpleStatementLine(body=[m.Expr(m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("save")),
                                                     args=[m.Arg(m.Name(var)), m.Arg()]))])
    if isinstance(stmt, cst.If) and stmt.orelse is None and isinstance(stmt.body, cst.IndentedBlock) \
            and len(stmt.body.body) == 1 and "rank" in _code(stmt.test):
        stmt = stmt.body.body[0]
    if m.matches(stmt, save):
        line = cast(cst.SimpleStatementLine, stmt)
        return cast(cst.Call, cast(cst.Expr, line.body[0]).value).args[1].value
    return None


def _commas(args: Sequence[cst.Arg]) -> list[cst.Arg]:
    out = []
    for i, a in enumerate(args):
        last = i == len(args) - 1
        out.append(a.with_changes(comma=cst.MaybeSentinel.DEFAULT if last
                                  else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))))
    return out


def _with_todos(original: Any, updated: Any, todos: dict[int, list[str]]) -> Any:
    texts = todos.get(id(original))
    if not texts:
        return updated
    existing = {line.comment.value for line in updated.leading_lines if line.comment is not None}
    lines = list(updated.leading_lines)
    for text in dict.fromkeys(texts):
        comment = f"# {TODO}: {text}"
        if comment not in existing:
            lines.append(cst.EmptyLine(comment=cst.Comment(comment)))
    return updated.with_changes(leading_lines=lines)


@dataclass
class MigratedSource:
    path: str
    original: str
    fixed: str
    findings: list[CodeFinding]

    @property
    def changed(self) -> bool:
        return self.original != self.fixed

    def diff(self) -> str:
        return "".join(difflib.unified_diff(self.original.splitlines(keepends=True),
                                            self.fixed.splitlines(keepends=True), f"a/{self.path}", f"b/{self.path}"))


def migrate_source(code: str, path: str = "<string>") -> MigratedSource:
    """Scan ``code`` and compute its rewritten form (nothing is written)."""
    module = cst.parse_module(code)
    wrapper = MetadataWrapper(module)
    collector = _Collector()
    wrapper.module.visit(collector)
    single = {k: v[0] for k, v in collector.assigned.items() if len(v) == 1}
    scan = _Scanner(path, code, single, collector.uses)
    wrapper.visit(scan)  # plan: FSDP(...) conversions and checkpoint blocks
    scan.planning = False
    wrapper.visit(scan)  # report: every other construct
    if not scan.uses_fsdp1:
        return MigratedSource(path, code, code, [])
    fixer = _Fixer(scan, {id(v): k for k, v in single.items()})
    fixed = wrapper.module.visit(fixer)
    if fixed.code != code:
        context = CodemodContext()
        AddImportsVisitor.add_needed_import(context, "fsdp_bridge")
        fixed = AddImportsVisitor(context).transform_module(fixed)
        for imp in _fsdp_imports(fixed):
            RemoveImportsVisitor.remove_unused_import(context, *imp)
        if scan.consumed_partial:
            RemoveImportsVisitor.remove_unused_import(context, "functools")
        fixed = RemoveImportsVisitor(context).transform_module(fixed)
    findings = sorted(scan.findings, key=lambda f: (f.line, f.column))
    return MigratedSource(path, code, fixed.code, findings)


def _fsdp_imports(module: cst.Module) -> list[tuple[str, str | None, str | None]]:
    """Every ``from torch.distributed.fsdp... import X`` (removed by the codemod only when unused)."""
    found: list[tuple[str, str | None, str | None]] = []

    class V(cst.CSTVisitor):
        def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
            mod = _code(node.module) if node.module else ""
            if not (mod.startswith("torch.distributed.fsdp") or mod == "functools") or isinstance(node.names,
                                                                                                  cst.ImportStar):
                return
            for alias in node.names:
                asname = alias.asname.name.value if alias.asname and isinstance(alias.asname.name, cst.Name) else None
                found.append((mod, _code(alias.name), asname))

    module.visit(V())
    return found


def migrate_paths(paths: Sequence[str | Path], *, fix: bool = False) -> tuple[CodeReport, list[MigratedSource]]:
    """Scan files (directories: every ``*.py`` below); with ``fix``, write the rewrites."""
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    report = CodeReport()
    results = []
    for f in files:
        result = migrate_source(f.read_text(), str(f))
        results.append(result)
        report.findings.extend(result.findings)
        if result.changed:
            report.changed.append(str(f))
            if fix:
                f.write_text(result.fixed)
    return report, results
