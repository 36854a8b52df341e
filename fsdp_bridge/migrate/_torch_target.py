"""``migrate code --target torch``: the bridge rewrite lowered to plain FSDP2 code.

The codemod first plans and writes the bridge target (every decision about which objects are FSDP1's is
made there, once); this pass then replaces each bridge call it can write in plain torch:

* ``fsdp_bridge.shard(m, fsdp_bridge.BridgeConfig(<literal settings>)[, mesh=])`` ->
  ``_fsdp2_helpers.shard_model(m, mesh=..., wrap_classes=..., reshard_after_forward=...,
  mp_policy=MixedPrecisionPolicy(...), offload_policy=CPUOffloadPolicy(...), ...)``: ``fully_shard``
  bottom-up then on the root, in the generated module (:mod:`fsdp_bridge.migrate._torch_helpers`);
* ``fsdp_bridge.no_sync(m)`` -> ``_fsdp2_helpers.no_sync(m)`` (``set_requires_gradient_sync``), also where
  ``fsdp_bridge.no_sync`` is passed on as a value;
* ``fsdp_bridge.clip_grad_norm_(m, n[, p])`` -> ``_fsdp2_helpers.clip_grad_norm_(m, n[, p])`` (torch's clip over
  ``m.parameters()``, the norm a plain tensor);
* ``fsdp_bridge.ema_update_(ema, m, decay)`` -> ``_fsdp2_helpers.ema_update_(ema, m, decay)`` (the pairs of local
  shards stepped with torch's foreach operations);
* ``fsdp_bridge.save_pretrained(m, d, ...)`` -> ``_fsdp2_helpers.save_pretrained(m, d, ...)`` (the full state
  gathered, rank 0 writes it);
* ``fsdp_bridge.is_sharded(m)`` -> ``isinstance(m, FSDPModule)``; ``fsdp_bridge.unwrapped(m)`` -> ``m`` (both kept
  in a file importing a library that wraps models in FSDP1 itself, ``WRAPPING_LIBRARIES``);
  ``fsdp_bridge.ShardedModule`` (a type: annotation, validator, ``Optional[...]``) -> ``FSDPModule``;
* ``fsdp_bridge.GradScaler(...)`` -> ``_fsdp2_helpers.GradScaler(...)`` (torch.amp.GradScaler that unscales
  float16 gradients too; arguments past the device named; kept when it passes ``process_group=``), and
  ``fsdp_bridge.GradScaler`` named as a value -> ``_fsdp2_helpers.GradScaler``;
* ``fsdp_bridge.full_state_dict(m)`` / ``full_optim_state_dict(m, o)`` -> ``get_model_state_dict`` /
  ``get_optimizer_state_dict`` with ``StateDictOptions(full_state_dict=True[, cpu_offload=True])`` (every rank,
  or rank 0 in CPU memory when no file of the tree shards over process groups).

Every other bridge call stays as the bridge target wrote it, under a TODO saying why it was not written
in plain torch; the file then still imports ``fsdp_bridge`` (and says so).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor
from libcst.metadata import MetadataWrapper, PositionProvider, QualifiedNameProvider

from fsdp_bridge.migrate._analysis import code_of, resolve_fsdp, walk
from fsdp_bridge.migrate._names import FSDP, TODO
from fsdp_bridge.migrate._render import closing_comments, commas, comments_around
from fsdp_bridge.migrate._torch_helpers import HELPERS_NAME
from fsdp_bridge.strategy import ShardingStrategy

# FSDP1's ShardedGradScaler's parameters in order (the bridge's GradScaler keeps them).
_SCALER_ARGS = (
    "device",
    "init_scale",
    "backoff_factor",
    "growth_factor",
    "growth_interval",
    "enabled",
    "process_group",
)

__all__ = ["TARGETS", "Lowered", "LoweredCall", "imports_of", "lower_to_torch"]

TARGETS = ("bridge", "torch")
"""What ``migrate code --fix`` writes: the bridge's calls (default), or plain FSDP2 code."""

_BY_NAME = frozenset(
    ("no_sync", "clip_grad_norm_", "summon_full_params", "optim_state_dict_to_load", "ema_update_", "save_pretrained")
)
"""Bridge calls lowered by their name alone, their arguments kept as written."""

_FSDP = "torch.distributed.fsdp"

WRAPPING_LIBRARIES = ("composer", "lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "fairseq2")
"""Training libraries that wrap the models they are handed in FSDP1's wrapper themselves (their FSDP1 path):
in a file importing one, a model may be such a wrapper after --fix, so the bridge's type test and unwrap stay."""
_ACCELERATE_LOADERS = frozenset(
    {
        "load_checkpoint_and_dispatch",
        "load_checkpoint_in_model",
        "init_empty_weights",
        "init_on_device",
        "infer_auto_device_map",
        "dispatch_model",
        "cpu_offload",
        "disk_offload",
        "is_peft_model",
        "PartialState",
        "set_seed",
        "get_logger",
        "DistributedType",
        "gather_object",
        "broadcast_object_list",
        "find_executable_batch_size",
    }
)
"""accelerate's big-model loading utilities and helpers that wrap nothing in FSDP1 (its ``Accelerator`` and
FSDP plugin do)."""


def _accelerate_loaders_only(module: cst.Module) -> bool:
    """Every name the file takes from accelerate is one of its loading utilities (no ``import accelerate``)."""
    names: set[str] = set()
    for n in walk(module):
        if isinstance(n, cst.Import) and any(code_of(a.name).split(".")[0] == "accelerate" for a in n.names):
            return False
        if (
            isinstance(n, cst.ImportFrom)
            and n.module is not None
            and code_of(n.module).split(".")[0] == "accelerate"
            and not n.relative
        ):
            if isinstance(n.names, cst.ImportStar):
                return False
            names |= {code_of(a.name) for a in n.names}
    return bool(names) and names <= _ACCELERATE_LOADERS


_STATE = "torch.distributed.checkpoint.state_dict"


@dataclass
class Lowered:
    """The file lowered to plain torch, and what happened to each bridge call."""

    module: cst.Module
    uses_helpers: bool = False
    """The file calls the generated ``_fsdp2_helpers`` module (written beside it)."""
    calls: list[LoweredCall] = field(default_factory=list)
    """Every bridge call of the bridge rewrite, in the order of the file: what it became, or why it stays."""


@dataclass(frozen=True)
class LoweredCall:
    """One bridge call of the bridge rewrite and what this pass made of it (positions are the bridge
    rewrite's: the report maps them back to the user's file)."""

    line: int
    column: int
    end_line: int
    name: str
    """After ``fsdp_bridge.``: ``shard``, ``no_sync``, ``BridgeConfig.from_fsdp1``."""
    code: str
    """The bridge call as the bridge rewrite wrote it, on one line (``fsdp_bridge.no_sync(model)``)."""
    became: str = ""
    """The plain-torch code written for it, on one line; empty when it stays on the bridge."""
    why: str = ""
    """Why it stays on the bridge (a TODO comment in the file says the same); empty when lowered."""
    notes: tuple[str, ...] = ()
    """What the call lost on the way (said in the report)."""
    settings: tuple[tuple[str, str, str], ...] = ()
    """``shard``: (BridgeConfig keyword, its value, the ``shard_model`` arguments it became; empty for
    none) for each setting of the config."""

    inner: bool = False
    """A bridge call inside another that stays on the bridge as a whole (kept with it)."""

    @property
    def kept(self) -> bool:
        return not self.became


class _CannotLower(Exception):
    """A bridge call this pass does not write in plain torch (the message says why)."""


@dataclass
class _Shard:
    """The plain arguments of one ``shard_model`` call, each with the comments of what it came from."""

    lines: list[tuple[str, list[str], str | None]] = field(default_factory=list)
    """(``kw=value``, comments on lines before it, comment after it)."""
    loose: list[str] = field(default_factory=list)
    """Comments of settings that became nothing (written before the closing parenthesis)."""
    imports: set[tuple[str, str | None]] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    values: dict[str, str] = field(default_factory=dict)
    """BridgeConfig keyword -> its value, as the bridge rewrite wrote it."""
    became: dict[str, list[str]] = field(default_factory=dict)
    """BridgeConfig keyword -> the ``shard_model`` arguments it became (none: an empty list)."""

    def add(self, kw: str, text: str, comments: tuple[list[str], str | None] = ([], None)) -> None:
        """An argument of ``shard_model`` made from the setting ``kw``."""
        self.lines.append((text, *comments))
        self.became.setdefault(kw, []).append(_one_line(text))


def _literal_str(node: cst.BaseExpression) -> str | None:
    return node.evaluated_value if isinstance(node, cst.SimpleString) else None  # type: ignore[return-value]


def _mixed_precision(value: cst.BaseExpression, out: _Shard, kw: tuple[list[str], str | None]) -> None:
    """The bridge's ``mixed_precision={"param_dtype": ..., ...}`` -> ``mp_policy=MixedPrecisionPolicy(...)``
    (and ``buffer_dtype=`` / ``cast_root_forward_inputs=`` of ``shard_model``: FSDP2 has neither)."""
    if not isinstance(value, cst.Dict):
        raise _CannotLower(f"mixed_precision={code_of(value)}: not a mapping of FSDP1's MixedPrecision fields")
    policy: list[str] = []
    extra: list[str] = []
    for element in value.elements:
        if not isinstance(element, cst.DictElement) or (key := _literal_str(element.key)) is None:
            raise _CannotLower(f"mixed_precision={code_of(value)}: not a literal mapping")
        text = code_of(element.value)
        if key in ("param_dtype", "reduce_dtype", "cast_forward_inputs"):
            policy.append(f"{key}={text}")
        elif key == "buffer_dtype":
            extra.append(f"buffer_dtype={text}")
        elif key == "cast_root_forward_inputs":
            if text != "True":  # shard_model's default: FSDP1's root casts its inputs
                extra.append(f"cast_root_forward_inputs={text}")
        else:
            raise _CannotLower(f"mixed_precision[{key!r}]: not a field FSDP1's MixedPrecision has")
    out.imports.add((_FSDP, "MixedPrecisionPolicy"))
    one_line = f"mp_policy=MixedPrecisionPolicy({', '.join(policy)})"
    if len(one_line) > 80:  # one argument per line (continuation lines take the statement's indentation)
        one_line = "mp_policy=MixedPrecisionPolicy(\n" + "".join(f"        {p},\n" for p in policy) + "    )"
    out.add("mixed_precision", one_line, kw)
    for e in extra:
        out.add("mixed_precision", e)


def _shard_args(call: cst.Call) -> tuple[str, _Shard]:
    """``fsdp_bridge.shard(m, fsdp_bridge.BridgeConfig(...)[, mesh=X])``: (module source, arguments)."""
    positional = [a for a in call.args if a.keyword is None]
    named = {a.keyword.value: a for a in call.args if a.keyword is not None}
    if len(positional) != 2 or set(named) - {"mesh"} or any(a.star for a in call.args):
        raise _CannotLower("not the shard(module, BridgeConfig(...)[, mesh=]) form the codemod writes")
    config = positional[1].value
    if not (isinstance(config, cst.Call) and code_of(config.func) == "fsdp_bridge.BridgeConfig"):
        raise _CannotLower(
            f"{code_of(config.func) if isinstance(config, cst.Call) else 'the config'}: settings known only when "
            "the code runs (the bridge translates them then); write the fully_shard call by hand"
        )
    out = _Shard()
    settings: dict[str, cst.BaseExpression] = {}
    comments: dict[str, tuple[list[str], str | None]] = {}
    for i, a in enumerate(config.args):
        if a.keyword is None or a.star:
            raise _CannotLower(f"BridgeConfig({code_of(a.value)}): not a keyword setting")
        settings[a.keyword.value] = a.value
        out.values[a.keyword.value] = " ".join(code_of(a.value).split())
        comments[a.keyword.value] = comments_around(config, i)
    if _literal_str(settings.get("backend", cst.SimpleString('"fsdp2"'))) != "fsdp2":
        raise _CannotLower(f"backend={code_of(settings['backend'])}: only a config for FSDP2 is written as FSDP2")
    if "wrap" not in settings:
        raise _CannotLower("no wrap=: the bridge's default ('auto') chooses the units when the code runs")
    strategy = _literal_str(settings.get("strategy", cst.SimpleString('"full_shard"')))
    if strategy not in {s.value for s in ShardingStrategy}:
        raise _CannotLower(f"strategy={code_of(settings['strategy'])}: known only when the code runs")
    device = _literal_str(settings.get("device", cst.SimpleString('"auto"')))
    if device not in ("cpu", "auto"):
        raise _CannotLower(f"device={code_of(settings['device'])}: not a literal the codemod writes")

    def note(kw: str) -> None:  # a setting that became nothing keeps its comments
        out.became.setdefault(kw, [])
        lead, trail = comments.get(kw, ([], None))
        out.loose += lead + ([trail] if trail else [])

    mesh = named.get("mesh")
    if mesh is not None and "fsdp_bridge" in code_of(mesh.value):
        raise _CannotLower(f"mesh={code_of(mesh.value)}: FSDP1's process group becomes a mesh when the code runs")
    device_arg = ', "cpu"' if device == "cpu" else ""
    built = f'{HELPERS_NAME}.data_parallel_mesh("{strategy}"{device_arg})'
    mesh_code = code_of(mesh.value) if mesh is not None else built
    if mesh is not None and strategy == "no_shard":  # a 1D mesh given: replicated over its ranks, (n, 1)
        mesh_code = f'{HELPERS_NAME}.data_parallel_mesh("no_shard", mesh={mesh_code})'
    out.add("strategy", f"mesh={mesh_code}", comments.get("strategy", ([], None)))
    note("device")
    note("hybrid_shape")  # the mesh given has the shape
    note("backend")
    if mesh is None:  # the mesh built says the device and the shape
        out.became["device"] = out.became["hybrid_shape"] = [f"mesh={mesh_code}"]
    wrap = settings.get("wrap", cst.SimpleString('"none"'))
    if isinstance(wrap, (cst.List, cst.Tuple, cst.Set)):
        if any(
            isinstance(e.value, (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)) for e in wrap.elements
        ):
            raise _CannotLower(f"wrap={code_of(wrap)}: class names, not classes (name them as classes to eject)")
        classes = ", ".join(code_of(e.value) for e in wrap.elements)
        one = "," if len(wrap.elements) == 1 else ""
        out.add("wrap", f"wrap_classes=({classes}{one})", comments.get("wrap", ([], None)))
    elif isinstance(wrap, cst.Dict) and [
        _literal_str(e.key) for e in wrap.elements if isinstance(e, cst.DictElement)
    ] == ["min_num_params"]:
        element = wrap.elements[0]
        assert isinstance(element, cst.DictElement)
        out.add("wrap", f"wrap_min_num_params={code_of(element.value)}", comments.get("wrap", ([], None)))
    elif _literal_str(wrap) == "none":
        note("wrap")
    else:
        raise _CannotLower(f"wrap={code_of(wrap)}: not a list of classes or min_num_params")
    # The mapping's rule (fsdp_bridge.plan.reshard_after_forward): the units reshard as the strategy says.
    reshard = ShardingStrategy(strategy).reshards_after_forward or strategy == "no_shard"
    out.add("strategy", f"reshard_after_forward={reshard}")
    for kw, value in settings.items():
        text = code_of(value)
        if kw in ("strategy", "device", "hybrid_shape", "backend", "wrap"):
            continue
        if kw == "mixed_precision":
            _mixed_precision(value, out, comments[kw])
        elif kw == "cpu_offload":
            if device == "cpu":  # the mapping: nothing to offload to on a CPU run (and torch refuses it there)
                out.notes.append("cpu_offload: not needed on a CPU run (the parameters are on the CPU already)")
                note(kw)
            elif text != "False":
                out.imports.add((_FSDP, "CPUOffloadPolicy"))
                policy = "CPUOffloadPolicy(pin_memory=True)"
                if text != "True":
                    out.imports.add((_FSDP, "OffloadPolicy"))
                    policy = f"{policy} if {text} else OffloadPolicy()"
                out.add(kw, f"offload_policy={policy}", comments[kw])
            else:
                note(kw)
        elif kw == "backward_prefetch":
            case = _literal_str(value)
            if case == "none":
                out.add(kw, "backward_prefetch=False", comments[kw])
            elif case == "pre":  # FSDP2's own order
                note(kw)
            else:
                raise _CannotLower(f"backward_prefetch={text}: only 'pre' and 'none' are written in plain torch")
        elif kw in ("forward_prefetch", "sync_module_states"):
            if isinstance(value, (cst.Integer, cst.SimpleString)):
                raise _CannotLower(f"{kw}={text}: FSDP1 takes a bool here (a prefetch depth is the bridge's own)")
            if text != "False":
                out.add(kw, f"{kw}={text}", comments[kw])
            else:
                note(kw)
        elif kw == "limit_all_gathers":  # the mapping: not needed on FSDP2
            note(kw)
        else:
            raise _CannotLower(f"{kw}={text}: no plain-torch form written for this setting yet")
    out.loose += closing_comments(config) + closing_comments(call)
    return code_of(positional[0].value), out


def _render_shard(call: cst.Call) -> tuple[cst.BaseExpression, _Shard]:
    module, out = _shard_args(call)
    i1 = "    "
    lines = [f"{HELPERS_NAME}.shard_model(", f"{i1}{module},"]
    for text, lead, trail in out.lines:
        lines += [i1 + c for c in lead]
        lines.append(f"{i1}{text}," + (f"  {trail}" if trail else ""))
    lines += [i1 + c for c in out.loose]
    lines.append(")")
    return cst.parse_expression("\n".join(lines)), out


class _Lowerer(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, groups: bool, typed: bool = False) -> None:
        super().__init__()
        self.groups = groups  # a file of the tree shards over process groups (FSDP1's rank0_only is per group)
        self.typed = typed  # the tree sets a state-dict type at run time (the bridge's calls follow it)
        self.result_imports: set[tuple[str, str | None]] = set()
        self.uses_helpers = False
        self.found: list[LoweredCall] = []
        self.settings: tuple[tuple[str, str, str], ...] = ()  # of the shard call being lowered
        self.pending: list[list[str]] = []  # TODO texts of the statements being visited, innermost last
        self.notes: list[str] = []  # what the call being lowered lost on the way (said in the report)
        self.calls: list[bool] = []  # for each call being visited: whether it is a bridge call
        self.inside: set[int] = set()  # id(Attribute) of fsdp_bridge.X inside a bridge call (handled with it)
        self.fsdp_module = "FSDPModule"  # how torch's class is written (qualified where the file binds the name)
        self.fsdp_module_import: tuple[str, str | None] = (_FSDP, "FSDPModule")
        self.wrapping_library: str | None = None  # a library the file imports that wraps models in FSDP1 itself
        self.annotation_depth = 0
        self.scopes: list[cst.CSTNode] = []  # the module, then each function being visited (original nodes)
        self.statements: list[cst.CSTNode] = []  # the statements being visited, innermost last (original nodes)
        self.call: cst.Call | None = None  # the bridge call being lowered (original node)

    # -- statements: collect the TODOs of what is inside ---------------------------
    def visit_Module(self, node: cst.Module) -> None:
        self.scopes.append(node)

    def _enter(self, node: cst.CSTNode) -> None:
        self.pending.append([])
        self.statements.append(node)

    def _leave(self, updated: Any) -> Any:
        self.statements.pop()
        texts = self.pending.pop()
        if not texts:
            return updated
        existing = {line.comment.value for line in updated.leading_lines if line.comment is not None}
        lines = list(updated.leading_lines)
        for text in dict.fromkeys(texts):
            comment = f"# {TODO}: {' '.join(text.split())}"
            if comment not in existing:
                lines.append(cst.EmptyLine(comment=cst.Comment(comment)))
        return updated.with_changes(leading_lines=lines)

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self._enter(node)

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine, updated_node: Any) -> Any:
        return self._leave(updated_node)

    def visit_With(self, node: cst.With) -> None:
        self._enter(node)

    def leave_With(self, original_node: cst.With, updated_node: Any) -> Any:
        return self._leave(updated_node)

    def visit_If(self, node: cst.If) -> None:
        self._enter(node)

    def leave_If(self, original_node: cst.If, updated_node: Any) -> Any:
        return self._leave(updated_node)

    def visit_For(self, node: cst.For) -> None:
        self._enter(node)

    def leave_For(self, original_node: cst.For, updated_node: Any) -> Any:
        return self._leave(updated_node)

    def visit_While(self, node: cst.While) -> None:
        self._enter(node)

    def leave_While(self, original_node: cst.While, updated_node: Any) -> Any:
        return self._leave(updated_node)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._enter(node)
        self.scopes.append(node)

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: Any) -> Any:
        self.scopes.pop()
        return self._leave(updated_node)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._enter(node)

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: Any) -> Any:
        return self._leave(updated_node)

    def _record(self, node: cst.CSTNode, name: str, became: str = "", why: str = "", inner: bool = False) -> None:
        where = self.get_metadata(PositionProvider, node)
        self.found.append(
            LoweredCall(
                where.start.line,
                where.start.column,
                where.end.line,
                name,
                _one_line(code_of(node)),
                _one_line(became),
                why,
                tuple(self.notes),
                self.settings,
                inner,
            )
        )
        self.notes, self.settings = [], ()

    def _keep(self, node: cst.CSTNode, construct: str, why: str) -> None:
        name = construct.removeprefix("fsdp_bridge.").removesuffix("(...)")
        self._record(node, name, why=why)
        if self.pending:
            self.pending[-1].append(f"{construct}: kept on fsdp_bridge under --target torch: {why}")

    # -- expressions ---------------------------------------------------------------
    def visit_Annotation(self, node: cst.Annotation) -> None:
        self.annotation_depth += 1

    def leave_Annotation(self, original_node: cst.Annotation, updated_node: cst.Annotation) -> cst.Annotation:
        self.annotation_depth -= 1
        return updated_node

    def leave_IfExp(self, original_node: cst.IfExp, updated_node: cst.IfExp) -> cst.BaseExpression:
        """``m if flag else m``: what ``fsdp_bridge.unwrapped(m) if flag else m`` lowers to (FSDP2 does not wrap)
        is ``m``, where the test is a name or an attribute (nothing run by dropping it)."""
        test = updated_node.test
        pure = isinstance(test, cst.Name) or (isinstance(test, cst.Attribute) and "(" not in code_of(test))
        if (
            pure
            and code_of(updated_node.body) == code_of(updated_node.orelse)
            and code_of(original_node.body) != code_of(original_node.orelse)
        ):
            return updated_node.body.with_changes(lpar=updated_node.lpar, rpar=updated_node.rpar)
        return updated_node

    def leave_BooleanOperation(
        self, original_node: cst.BooleanOperation, updated_node: cst.BooleanOperation
    ) -> cst.BaseExpression:
        """An unwrapping loop's test (``fsdp_bridge.is_sharded(m) and fsdp_bridge.unwrapped(m) is not m``, lowered
        to ``isinstance(m, FSDPModule) and m is not m``) is False: FSDP2 does not wrap, and no FSDP1 wrapper is
        left. ``A or False`` is ``A``, and so is ``A or A`` (``isinstance(m, FSDPModule) or
        fsdp_bridge.is_sharded(m)``, what --fix writes for ``isinstance(m, (FSDP, FSDPModule))``, lowered)."""
        right = updated_node.right
        if isinstance(updated_node.operator, cst.And) and isinstance(right, cst.Comparison):
            if (
                len(right.comparisons) == 1
                and isinstance(right.comparisons[0].operator, cst.IsNot)
                and code_of(right.left) == code_of(right.comparisons[0].comparator)
            ):
                return cst.Name("False")
        if isinstance(updated_node.operator, cst.Or) and (
            m.matches(right, m.Name("False"))
            or (m.matches(right, m.Call(func=m.Name("isinstance"))) and code_of(right) == code_of(updated_node.left))
        ):
            return updated_node.left.with_changes(lpar=updated_node.lpar, rpar=updated_node.rpar)
        return updated_node

    def visit_Call(self, node: cst.Call) -> None:
        # a bridge call lowered as a whole (its arguments rendered anew); one lowered by its name alone
        # (clip_grad_norm_, no_sync, ...) keeps its arguments, whose own bridge calls are lowered too (else a
        # second --fix would lower them: not idempotent)
        named = _is_bridge_function(node.func)
        bridge = named and code_of(node.func).removeprefix("fsdp_bridge.") not in _BY_NAME
        self.calls.append(bridge)
        if named:  # the call's own name is no reference to the function as a value
            self.inside.update(id(n) for n in walk(node if bridge else node.func) if isinstance(n, cst.Attribute))

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        self.calls.pop()
        func = code_of(updated_node.func)
        if not _is_bridge_function(updated_node.func) or any(self.calls):
            return updated_node  # not the bridge's, or inside a bridge call that is handled as a whole
        name = func.removeprefix("fsdp_bridge.")
        self.call = original_node
        try:
            new = self._lower(name, updated_node)
        except _CannotLower as why:
            self._keep(original_node, f"{func}(...)", str(why))
            for n in walk(original_node):  # the bridge calls inside stay with it
                if n is not original_node and isinstance(n, cst.Call) and code_of(n.func).startswith("fsdp_bridge."):
                    inside = code_of(n.func).removeprefix("fsdp_bridge.")
                    self._record(n, inside, why=f"inside {func}(...), which stays on fsdp_bridge", inner=True)
            return updated_node
        self._record(original_node, name, code_of(new))
        return new

    def _lower(self, name: str, call: cst.Call) -> cst.BaseExpression:
        args = list(call.args)
        if name == "shard":
            new, out = _render_shard(call)
            self.notes = out.notes
            self.settings = tuple((kw, out.values[kw], ", ".join(out.became.get(kw, []))) for kw in out.values)
            self.uses_helpers = True
            self.result_imports |= out.imports
            return new
        if name == "no_sync" and len(args) == 1 and args[0].keyword is None and not args[0].star:
            self.uses_helpers = True
            return call.with_changes(func=cst.parse_expression(f"{HELPERS_NAME}.no_sync"))
        if name == "clip_grad_norm_" and args and args[0].keyword is None and not args[0].star:
            # torch's clip over the parameters, its DTensor norm made a plain tensor (FSDP1's is one: callers
            # format it, stack it with the loss, all-gather it)
            self.uses_helpers = True
            return call.with_changes(func=cst.parse_expression(f"{HELPERS_NAME}.clip_grad_norm_"))
        if name == "save_pretrained":
            # the same signature in the helper module (the full state gathered for fully_shard's models)
            self.uses_helpers = True
            return call.with_changes(func=cst.parse_expression(f"{HELPERS_NAME}.save_pretrained"))
        if name == "ema_update_":
            # the same signature in the helper module: pairs of local shards (a DTensor's, or a plain tensor's
            # data: also what a model a wrapping library hands over holds)
            self.uses_helpers = True
            return call.with_changes(func=cst.parse_expression(f"{HELPERS_NAME}.ema_update_"))
        if name in ("summon_full_params", "optim_state_dict_to_load") and self.wrapping_library is not None:
            raise _CannotLower(
                f"this file uses {self.wrapping_library}, which wraps models in FSDP1's wrapper itself: a model "
                f"it hands over stays FSDP1's, which the plain-torch {name} (for fully_shard's models) does not "
                f"handle; fsdp_bridge.{name} serves both"
            )
        if (
            name == "optim_state_dict_to_load"
            and self.typed
            and not any(a.keyword is not None and a.keyword.value == "options" for a in args)
        ):
            raise _CannotLower(
                "this tree sets a state-dict type (set_state_dict_type / state_dict_type), which "
                "fsdp_bridge.optim_state_dict_to_load follows at run time when no options= is given (full or "
                "sharded, rank 0's broadcast); plain torch has no such setting: pass the options of the type "
                "(StateDictOptions(...)) and write _fsdp2_helpers.optim_state_dict_to_load(model, optim, sd, options)"
            )
        if name in ("summon_full_params", "optim_state_dict_to_load"):
            # the same signature in the helper module, written for fully_shard's models (and unsharded ones)
            self.uses_helpers = True
            return call.with_changes(func=cst.parse_expression(f"{HELPERS_NAME}.{name}"))
        if name in ("is_sharded", "unwrapped") and self.wrapping_library is not None:
            raise _CannotLower(
                f"this file uses {self.wrapping_library}, which wraps models in FSDP1's wrapper itself: a model "
                "it hands over stays FSDP1's (--fix cannot change that library), and "
                + (
                    "isinstance(m, FSDPModule) is False for it"
                    if name == "is_sharded"
                    else "dropping the unwrap hands on the wrapper, not the module inside it"
                )
                + f"; fsdp_bridge.{name} serves both (plain torch only where every model is fully_shard's)"
            )
        if name == "is_sharded" and len(args) == 1 and args[0].keyword is None and not args[0].star:
            self.result_imports.add(self.fsdp_module_import)
            return cst.parse_expression(f"isinstance({code_of(args[0].value)}, {self.fsdp_module})")
        if name == "unwrapped" and len(args) == 1 and args[0].keyword is None and not args[0].star:
            return args[0].value  # FSDP2 does not wrap: the module is itself
        if name in ("full_state_dict", "full_optim_state_dict"):
            return self._full_state(name, args)
        if name == "GradScaler":
            return self._scaler(call, args)
        if name == "optim_state_dict" and any(a.star for a in args):
            raise _CannotLower(
                "its arguments past the optimizer come through ** and are known only when the code runs (FSDP1's "
                "optim_state_dict= and group=, which torch's get_optimizer_state_dict does not take; "
                "fsdp_bridge.optim_state_dict checks them); where they are empty, FSDP1's default is the full state "
                "as a CPU copy on every rank: get_optimizer_state_dict(model, optim, "
                "options=StateDictOptions(full_state_dict=True)) gives it on each rank's device, with "
                "cpu_offload=True on rank 0 alone"
            )
        why = {
            "BridgeConfig.from_fsdp1": "settings known only when the code runs",
            "set_state_dict_type": "plain torch has no persistent state-dict type: pass the type's "
            "StateDictOptions (fsdp_bridge.state_dict_options(type, config, optim_config)) to each "
            "get_/set_model_state_dict and get_/set_optimizer_state_dict call instead",
            "state_dict_options": "plain torch reads no FSDP1 state-dict type or configs: write "
            "StateDictOptions(...) from the values passed here (FULL_STATE_DICT -> full_state_dict=True, and "
            "configs with offload_to_cpu=True, rank0_only=True -> cpu_offload=True too: a CPU copy on rank 0 "
            "alone; torch has no CPU copy on every rank; SHARDED_STATE_DICT -> StateDictOptions(), with "
            "cpu_offload=True where its config has offload_to_cpu=True)",
            "fsdp1_settings": "an FSDPModule keeps no strategy or mixed-precision setting that public torch API "
            "reads back: use the values your code passes to fully_shard (mesh, reshard_after_forward, mp_policy)",
        }.get(name, "no plain-torch form written for it yet")
        raise _CannotLower(why)

    def _scaler(self, call: cst.Call, args: list[cst.Arg]) -> cst.BaseExpression:
        """The bridge's scaler (FSDP1's ShardedGradScaler) as the helpers' ``torch.amp.GradScaler`` (float16
        gradients unscaled too, as ShardedGradScaler does): right on FSDP2, whose
        DTensor gradients reduce the overflow check over their mesh. Arguments given by position past the
        device are named: the two classes order ``backoff_factor`` and ``growth_factor`` differently."""
        if any(a.star for a in args):
            raise _CannotLower("arguments unpacked with * or **: process_group= may be among them")
        if self.wrapping_library is not None:
            raise _CannotLower(_SCALER_OF_FSDP1.format(library=self.wrapping_library))
        if self.groups:
            raise _CannotLower(
                "the tree shards over process groups of some ranks: ShardedGradScaler agrees on an overflow over "
                "its group (every rank by default), FSDP2's DTensor gradients over their own mesh only, so "
                "model-parallel slices could skip different steps; fsdp_bridge.GradScaler keeps FSDP1's meaning"
            )
        # process_group=None is ShardedGradScaler's default (the default group): nothing to keep
        args = [
            a
            for a in args
            if not (a.keyword is not None and a.keyword.value == "process_group" and m.matches(a.value, m.Name("None")))
        ]
        if sum(a.keyword is None for a in args) == len(_SCALER_ARGS) or any(
            a.keyword is not None and a.keyword.value == "process_group" for a in args
        ):
            raise _CannotLower(
                "process_group= given: torch.amp.GradScaler takes no group (FSDP2's DTensor gradients agree on "
                "an overflow over their own mesh); drop it and write _fsdp2_helpers.GradScaler(...)"
            )
        named = [
            a.with_changes(
                keyword=cst.Name(_SCALER_ARGS[i]),
                equal=cst.AssignEqual(
                    whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
                ),
            )
            if a.keyword is None and i > 0
            else a
            for i, a in enumerate(args)
        ]
        self.uses_helpers = True
        return call.with_changes(func=cst.parse_expression(f"{HELPERS_NAME}.GradScaler"), args=commas(named))

    def _full_state(self, name: str, args: list[cst.Arg]) -> cst.BaseExpression:
        """FSDP1's full state on every rank, or on rank 0 in CPU memory: DCP's ``StateDictOptions`` says
        both (``cpu_offload=True`` with ``full_state_dict=True`` keeps it on world rank 0 only, which is
        FSDP1's ``rank0_only`` for a model sharded over every rank; over a process group FSDP1 gives it to
        each group's first rank, which DCP cannot say); the two mixed it cannot say either."""
        optim = name == "full_optim_state_dict"
        given = 2 if optim else 1
        positional = [code_of(a.value) for a in args if a.keyword is None and not a.star]
        named = {a.keyword.value: code_of(a.value) for a in args if a.keyword is not None}
        if len(positional) != given or len(named) + given != len(args) or set(named) - {"rank0_only", "offload_to_cpu"}:
            raise _CannotLower("not the (model[, optimizer], rank0_only=, offload_to_cpu=) form the codemod writes")
        default = "True" if optim else "False"  # FSDP1's defaults: full_optim_state_dict gives rank 0 a CPU copy
        rank0, offload = named.get("rank0_only", default), named.get("offload_to_cpu", default)
        used_on = self._used_on_rank0_only()
        if used_on is not None and offload == "True":
            # read only under a test of world rank 0: rank 0's CPU copy is all the code uses (FSDP1's copies on
            # the other ranks, or on each group's first rank, were never read)
            self.notes.append(
                f"rank0_only={rank0}, offload_to_cpu={offload} -> cpu_offload=True (rank 0 alone gets the state): "
                f"the result is read only under `if {used_on}:`"
            )
            rank0 = "True"
        elif {rank0, offload} - {"True", "False"} or rank0 != offload:
            raise _CannotLower(
                f"rank0_only={rank0}, offload_to_cpu={offload}: torch's StateDictOptions(full_state_dict=True) "
                "gives every rank the state on its device, and with cpu_offload=True rank 0 alone a CPU copy; "
                "no option gives one without the other"
            )
        elif rank0 == "True" and self.groups:
            raise _CannotLower(
                "rank0_only=True in a tree that shards over process groups: FSDP1 gives the state to the first "
                "rank of each group; torch's StateDictOptions(full_state_dict=True, cpu_offload=True) to world "
                "rank 0 only"
            )
        function = "get_optimizer_state_dict" if optim else "get_model_state_dict"
        self.result_imports |= {(_STATE, function), (_STATE, "StateDictOptions")}
        options = "full_state_dict=True" + (", cpu_offload=True" if rank0 == "True" else "")
        return cst.parse_expression(f"{function}({', '.join(positional)}, options=StateDictOptions({options}))")

    def _used_on_rank0_only(self) -> str | None:
        """The test of world rank 0 under which every read of the name the call being lowered is assigned to
        lies (``state = fsdp_bridge.full_state_dict(...)`` then ``if rank == 0: torch.save(state, ...)``), or
        None: another statement form, a read elsewhere, the name assigned again, no read at all."""
        stmt = self.statements[-1] if self.statements else None
        if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and self.scopes):
            return None
        assign = stmt.body[0]
        if not (
            isinstance(assign, cst.Assign)
            and assign.value is self.call
            and len(assign.targets) == 1
            and isinstance(assign.targets[0].target, cst.Name)
        ):
            return None
        name = assign.targets[0].target.value
        scope = self.scopes[-1]
        tests: list[str] = []
        for path in _paths_to_names(scope, name):
            if path[-2] is assign.targets[0]:
                continue  # the assignment being lowered
            if _stored(path):
                return None  # assigned again: another value
            if any(isinstance(n, (cst.FunctionDef, cst.ClassDef, cst.Lambda)) for n in path[1:-1]):
                return None  # read in a nested function or class: run from anywhere
            test = _rank0_branch(path)
            if test is None:
                return None
            tests.append(test)
        return tests[0] if tests else None

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> Any:
        if code_of(updated_node) == "fsdp_bridge.no_sync" and id(original_node) not in self.inside:
            # passed on as a value (functools.partial(fsdp_bridge.no_sync, model)): the same signature
            self.uses_helpers = True
            self._record(original_node, "no_sync", f"{HELPERS_NAME}.no_sync")
            return cst.parse_expression(f"{HELPERS_NAME}.no_sync")
        if (
            code_of(updated_node) == "fsdp_bridge.GradScaler"
            and id(original_node) not in self.inside
            and self.wrapping_library is not None
        ):
            self._keep(original_node, "fsdp_bridge.GradScaler", _SCALER_OF_FSDP1.format(library=self.wrapping_library))
            return updated_node
        if code_of(updated_node) == "fsdp_bridge.GradScaler" and id(original_node) not in self.inside:
            # passed on, aliased or in an annotation: torch's class (no process_group=; its positional order
            # swaps backoff_factor and growth_factor)
            self.uses_helpers = True
            self._record(original_node, "GradScaler", f"{HELPERS_NAME}.GradScaler")
            return cst.parse_expression(f"{HELPERS_NAME}.GradScaler")
        if (
            code_of(updated_node) == "fsdp_bridge.ShardedModule"
            and id(original_node) not in self.inside
            and self.wrapping_library is not None
            and not self.annotation_depth
        ):
            # a class tested at run time (isinstance in a function of the file): as fsdp_bridge.is_sharded above
            self._keep(
                original_node,
                "fsdp_bridge.ShardedModule",
                f"this file imports {self.wrapping_library}, which wraps models in FSDP1's wrapper itself: a model it "
                "hands over stays FSDP1's, which isinstance(m, FSDPModule) refuses; fsdp_bridge.ShardedModule "
                "accepts both",
            )
            return updated_node
        if code_of(updated_node) == "fsdp_bridge.ShardedModule" and id(original_node) not in self.inside:
            # FSDP1's class as a type (annotation, validator, Optional[...]): every model is fully_shard's here
            self.result_imports.add(self.fsdp_module_import)
            self._record(original_node, "ShardedModule", self.fsdp_module)
            return cst.parse_expression(self.fsdp_module)
        if code_of(updated_node).startswith("fsdp_bridge.") and id(original_node) not in self.inside:
            inner = original_node.value
            if not (isinstance(inner, cst.Attribute) and code_of(inner).startswith("fsdp_bridge.")) and not (
                isinstance(inner, cst.Call) and code_of(inner.func).startswith("fsdp_bridge.")
            ):  # an attribute of a bridge call's result: the call is reported itself
                self._keep(original_node, code_of(updated_node), "no plain-torch form written for it yet")
        return updated_node


_WORLD_RANK0 = re.compile(
    r"^(?:[\w.]+\.)?(?:(?:get_rank\(\)|get_global_rank\(\)|rank|global_rank|world_rank|ddp_rank)\s*==\s*0|"
    r"master_process|is_main_process(?:\(\))?|is_master(?:_process)?(?:\(\))?|is_rank_zero\(\)|is_global_zero|"
    r"is_world_process_zero\(\))$"
)
"""A test true on world rank 0 alone (``rank == 0``, ``dist.get_rank() == 0``, ``master_process``,
``accelerator.is_main_process``); a node-local rank is not one."""


def _is_rank0_test(test: cst.BaseExpression) -> bool:
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return _is_rank0_test(test.left) or _is_rank0_test(test.right)
    return bool(_WORLD_RANK0.match(code_of(test))) and "local" not in code_of(test)


def _rank0_branch(path: list[cst.CSTNode]) -> str | None:
    """The world-rank-0 test of an ``if`` whose body holds the end of ``path``, or None."""
    for parent, child in itertools.pairwise(path):
        if isinstance(parent, cst.If) and child is parent.body and _is_rank0_test(parent.test):
            return code_of(parent.test)
    return None


def _stored(path: list[cst.CSTNode]) -> bool:
    """The ``Name`` at the end of ``path`` is assigned there (a target, a loop variable, ``as`` name, ``del``)."""
    name = path[-1]
    for node in path[:-1]:
        target = getattr(node, "target", None) if isinstance(node, _STORES) else None
        if isinstance(node, cst.AsName):
            target = node.name
        if isinstance(node, cst.Del):
            target = node.target
        if target is not None and any(n is name for n in walk(target)):
            return True
    return False


_STORES = (cst.AssignTarget, cst.AugAssign, cst.AnnAssign, cst.For, cst.CompFor)


def _paths_to_names(root: cst.CSTNode, name: str) -> list[list[cst.CSTNode]]:
    """The path from ``root`` to each ``Name`` node spelled ``name`` (attribute names aside)."""
    found: list[list[cst.CSTNode]] = []

    def visit(node: cst.CSTNode, path: list[cst.CSTNode]) -> None:
        path = [*path, node]
        if isinstance(node, cst.Name) and node.value == name:
            parent = path[-2] if len(path) > 1 else None
            if not (isinstance(parent, cst.Attribute) and parent.attr is node):
                found.append(path)
            return
        for child in node.children:
            visit(child, path)

    visit(root, [])
    return found


def _one_line(code: str) -> str:
    """Code on one line, as the report quotes it (``f(\n    a,\n)`` -> ``f(a)``)."""
    return " ".join(code.split()).replace("( ", "(").replace(", )", ")")


def _helpers_import(path: str, module: cst.Module) -> tuple[str, str | None, int] | None:
    """How a file imports the generated module beside it: a package's file relatively; None for a folder with
    no ``__init__.py`` or a package's file that is also a script (a ``__main__`` guard: ``python pkg/train.py``
    finds only an absolute import), see :func:`_with_either_import`."""
    here = Path(path)
    if (
        (here.parent / "__init__.py").is_file()
        and not _MAIN_GUARD.search(module.code)
        and here.stem.isidentifier()  # train-fsdp.py is never imported: a script
        and not _imports_a_sibling(module, here.parent)
    ):
        return "", HELPERS_NAME, 1
    return None


def _imports_a_sibling(module: cst.Module, folder: Path) -> bool:
    """``module`` imports a file beside it by an absolute name (``from model import Transformer`` with
    ``model.py`` there): it runs as a script from its folder (``torchrun train.py``), where only an absolute
    import finds the generated module too."""
    for stmt in module.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            names: list[str] = []
            if isinstance(small, cst.ImportFrom) and not small.relative and small.module is not None:
                names = [code_of(small.module)]
            elif isinstance(small, cst.Import):
                names = [code_of(alias.name) for alias in small.names]
            for name in names:
                top = name.split(".", 1)[0]
                if (folder / f"{top}.py").is_file() or (folder / top).is_dir():
                    return True
    return False


_MAIN_GUARD = re.compile(r"""^if\s+__name__\s*==\s*['"]__main__['"]\s*:""", re.MULTILINE)


EITHER_IMPORT = (
    "try:  # a module of a namespace package, or a script run from its own folder\n"
    f"    from . import {HELPERS_NAME}\n"
    "except ImportError:\n"
    f"    import {HELPERS_NAME}\n"
)


def _with_either_import(module: cst.Module) -> cst.Module:
    """A file in a folder with no ``__init__.py`` may be a script (``python train.py``: only an absolute import
    finds the module beside it) or a module of a namespace package (imported as ``pkg.train``: only a relative
    one does): both are tried, after the file's leading imports."""
    if EITHER_IMPORT in module.code:
        return module
    body = list(module.body)
    at = 0
    for i, stmt in enumerate(body):
        if isinstance(stmt, cst.SimpleStatementLine) and all(
            isinstance(s, (cst.Import, cst.ImportFrom)) or (i == 0 and isinstance(s, cst.Expr)) for s in stmt.body
        ):
            at = i + 1
        else:
            break
    return module.with_changes(body=[*body[:at], *cst.parse_module(EITHER_IMPORT).body, *body[at:]])


def _binds_otherwise(module: cst.Module, name: str) -> bool:
    """``module`` binds ``name`` to something other than torch's FSDP class of that name: a class or function
    of its own, an assignment, an import from another module."""
    found = False

    class V(cst.CSTVisitor):
        def visit_ClassDef(self, node: cst.ClassDef) -> None:
            nonlocal found
            found = found or node.name.value == name

        def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
            nonlocal found
            found = found or node.name.value == name

        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            nonlocal found
            found = found or (isinstance(node.target, cst.Name) and node.target.value == name)

        def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
            nonlocal found
            source = code_of(node.module) if node.module else ""
            if isinstance(node.names, cst.ImportStar) or source.startswith("torch.distributed"):
                return
            for alias in node.names:
                bound = alias.asname.name if alias.asname is not None else alias.name
                found = found or (isinstance(bound, cst.Name) and bound.value == name)

    module.visit(V())
    return found


KEPT_CONSTRUCTOR = "(FSDP1's constructor chosen by a conditional expression)"
"""The TODO of an FSDP1 constructor the bridge rewrite leaves as written: the file's model stays FSDP1's."""


def _constructs_fsdp1(module: cst.Module) -> bool:
    """The bridge rewrite still calls FSDP1's constructor (one it left as written, under a TODO): the models of
    the file may stay FSDP1's wrappers."""
    if "FullyShardedDataParallel" not in module.code:
        return False
    found: list[cst.Call] = []

    class V(cst.CSTVisitor):
        METADATA_DEPENDENCIES = (QualifiedNameProvider,)

        def visit_Call(self, node: cst.Call) -> None:
            if resolve_fsdp(self.get_metadata(QualifiedNameProvider, node.func, set())) == (FSDP, ""):
                found.append(node)

    MetadataWrapper(module).visit(V())
    return bool(found)


_SCALER_OF_FSDP1 = (
    "this file uses {library}, which wraps models in FSDP1's wrapper: a model it hands over stays FSDP1's, whose "
    "gradients are each rank's flat shard, and torch.amp.GradScaler would check each rank's shard alone for an "
    "overflow (ranks then skip different steps and their scales drift apart); fsdp_bridge.GradScaler (FSDP1's "
    "ShardedGradScaler) agrees on it over the ranks, for FSDP1's models and fully_shard's alike"
)
"""Why ``fsdp_bridge.GradScaler`` stays on the bridge under ``--target torch`` where models may stay FSDP1's."""


def lower_to_torch(
    module: cst.Module, path: str, *, groups: bool = False, typed: bool = False, kept: bool = False
) -> Lowered:
    """Replace the bridge calls of the bridge rewrite ``module`` with plain torch code (see the module
    docstring); the imports follow. ``groups``: a file of the tree passes ``process_group=`` to FSDP1.
    ``typed``: a file of the tree sets a state-dict type (``set_state_dict_type``), which the bridge's
    optimizer-state calls follow at run time and plain torch has no form of. ``kept``: a file of the tree calls
    FSDP1's class picked by a conditional expression, left as written: its models stay FSDP1's."""
    lowerer = _Lowerer(groups, typed or "state_dict_type(" in module.code)
    if _binds_otherwise(module, "FSDPModule"):
        # the file's own FSDPModule (a class of its own, another library's): torch's is written in full
        lowerer.fsdp_module, lowerer.fsdp_module_import = f"{_FSDP}.FSDPModule", (_FSDP, None)
    lowerer.wrapping_library = next(
        (m.split(".")[0] for m in imports_of(module.code) if m.split(".")[0] in WRAPPING_LIBRARIES), None
    )
    if lowerer.wrapping_library == "accelerate" and _accelerate_loaders_only(module):
        lowerer.wrapping_library = None  # its loading utilities and helpers alone (load_checkpoint_and_dispatch)
    if lowerer.wrapping_library is None and (kept or KEPT_CONSTRUCTOR in module.code or _constructs_fsdp1(module)):
        lowerer.wrapping_library = (
            "torch's FSDP1 (kept as written in the tree: a constructor or a subclass of its wrapper, see its TODO)"
        )
    lowerer.pending.append([])  # module level (a TODO there has no statement: none is written)
    new = MetadataWrapper(module).visit(lowerer)
    context = CodemodContext()
    for mod, obj in sorted(lowerer.result_imports, key=str):
        AddImportsVisitor.add_needed_import(context, mod, obj)
    how = _helpers_import(path, module) if lowerer.uses_helpers else None
    if how is not None:
        AddImportsVisitor.add_needed_import(context, how[0], how[1], relative=how[2])
    new = AddImportsVisitor(context).transform_module(new)
    RemoveImportsVisitor.remove_unused_import(context, "fsdp_bridge")
    new = RemoveImportsVisitor(context).transform_module(new)
    if lowerer.uses_helpers and how is None:
        new = _with_either_import(new)
    return Lowered(new, lowerer.uses_helpers, lowerer.found)


def imports_of(code: str) -> list[str]:
    """Every module a source imports (``import a.b`` -> ``a.b``; ``from a import b`` -> ``a.b``), for checks."""
    found: list[str] = []

    class V(cst.CSTVisitor):
        def visit_Import(self, node: cst.Import) -> None:
            found.extend(code_of(a.name) for a in node.names)

        def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
            base = code_of(node.module) if node.module else ""
            if isinstance(node.names, cst.ImportStar):
                found.append(f"{base}.*")
                return
            found.extend(f"{base}.{code_of(a.name)}" if base else code_of(a.name) for a in node.names)

    cst.parse_module(code).visit(V())
    return found


def _is_bridge_function(func: cst.BaseExpression) -> bool:
    """``fsdp_bridge.name`` (or ``fsdp_bridge.A.name``): a bridge function itself, not a method of what a
    bridge call returned (``fsdp_bridge.unwrapped(m).state_dict``)."""
    parts: list[str] = []
    while isinstance(func, cst.Attribute):
        parts.append(func.attr.value)
        func = func.value
    return isinstance(func, cst.Name) and func.value == "fsdp_bridge" and bool(parts)
