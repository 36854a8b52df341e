"""Pass 1 of ``migrate code``: the scanner, one visitor made of the fixers of each FSDP1 construct
family (``fixers/``) over the shared analysis; ``visit_Call`` hands each call to the family it belongs to."""

from __future__ import annotations

import re
from typing import cast

import libcst as cst
import libcst.matchers as m
from libcst.metadata import QualifiedNameProvider, QualifiedNameSource

from fsdp_bridge.migrate._analysis import called_as, code_of, handed_parameters, short, walk
from fsdp_bridge.migrate._names import FSDP, INTERNAL_ATTRS, wrapper_defines
from fsdp_bridge.migrate._objects import ObjectAnalysis
from fsdp_bridge.migrate._scan_base import ScannerBase
from fsdp_bridge.migrate.fixers._attributes import ElsewhereAttributesFixer
from fsdp_bridge.migrate.fixers._checkpoints import CheckpointNoteFixer
from fsdp_bridge.migrate.fixers._constructor import ConstructorFixer
from fsdp_bridge.migrate.fixers._data_assign import DataAssignFixer
from fsdp_bridge.migrate.fixers._ema import EmaFixer
from fsdp_bridge.migrate.fixers._imports import IS_SHARDED, ImportsFixer
from fsdp_bridge.migrate.fixers._internals import InternalsFixer, StorageFixer
from fsdp_bridge.migrate.fixers._lightning import LightningFixer
from fsdp_bridge.migrate.fixers._local_state import LocalStateFixer
from fsdp_bridge.migrate.fixers._meta_init import MetaInitFixer
from fsdp_bridge.migrate.fixers._no_sync_clip import NoSyncClipFixer
from fsdp_bridge.migrate.fixers._optim import OptimStateFixer
from fsdp_bridge.migrate.fixers._policies import PolicyFixer
from fsdp_bridge.migrate.fixers._scaler import ScalerFixer
from fsdp_bridge.migrate.fixers._state_dict import StateDictFixer
from fsdp_bridge.migrate.fixers._summon import SummonFixer

HANDED_MODEL_USES = frozenset(
    {
        "no_sync",
        "clip_grad_norm_",
        "summon_full_params",
        "state_dict",
        "load_state_dict",
        "register_comm_hook",
        "module",
        "forward",
    }
)
"""What a function handed an FSDP1 model by another file (``Dispatch.fsdp1_args``) may call on it that
FSDP2 does otherwise: a file that does is FSDP1 code, though it never names FSDP."""


_WRAPPED_NAME = re.compile(r"_fsdp_wrapped_module\.(?=[A-Za-z_0-9])")


class Scanner(
    ImportsFixer,
    ConstructorFixer,
    PolicyFixer,
    MetaInitFixer,
    StateDictFixer,
    LocalStateFixer,
    OptimStateFixer,
    SummonFixer,
    NoSyncClipFixer,
    ScalerFixer,
    LightningFixer,
    CheckpointNoteFixer,
    ElsewhereAttributesFixer,
    InternalsFixer,
    StorageFixer,
    EmaFixer,
    DataAssignFixer,
    ObjectAnalysis,
    ScannerBase,
):
    """Pass 1: find constructs, plan rewrites (nothing changes)."""

    # -- statements ----------------------------------------------------------------
    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> bool | None:
        self.stmt_stack.append(node)
        if not self.planning and id(node) in self.removed_stmts and id(node) in self.consumed_nodes:
            return False  # a statement of an idiom rewritten whole (StorageFixer): nothing to report in it
        return None

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine) -> None:
        self.stmt_stack.pop()

    def visit_With(self, node: cst.With) -> None:
        self._push(node)

    def visit_Module(self, node: cst.Module) -> None:
        self.module = node
        if self.planning:
            self._plan_regions(node)
            self._plan_block(node.body)

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        if self.planning and self._in_region(node) is None:
            self._plan_block(node.body)
        if not self.planning and self._in_region(node) is None:
            self._plan_storage(node.body)
            self._plan_ema(node.body)

    def leave_With(self, original_node: cst.With) -> None:
        self.stmt_stack.pop()

    def visit_If(self, node: cst.If) -> bool | None:
        self._push(node)
        if self._plan_free(node):
            return False  # the whole statement becomes one call: nothing inside is reported on its own
        return None

    def leave_If(self, original_node: cst.If) -> None:
        self.stmt_stack.pop()

    def visit_For(self, node: cst.For) -> bool | None:
        self._push(node)
        if id(node) in self.whole_loops:
            return False  # the whole loop becomes one call: nothing inside is reported on its own
        return None

    def leave_For(self, original_node: cst.For) -> None:
        self.stmt_stack.pop()

    def visit_While(self, node: cst.While) -> None:
        self._push(node)

    def leave_While(self, original_node: cst.While) -> None:
        self.stmt_stack.pop()

    # -- expressions ---------------------------------------------------------------
    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        """``"_fsdp_wrapped_module.token_emb"``: a parameter or module name as FSDP1's ``named_parameters()`` /
        ``named_modules()`` give it outside ``summon_full_params`` (its wrapper's prefix before each wrapped
        module's names) -> ``"token_emb"``, FSDP2's name for it (it does not wrap). Code keyed on the prefixed
        names (optimizer groups by name) would find nothing on FSDP2 (a KeyError). A bare prefix
        (``name.replace("_fsdp_wrapped_module.", "")``, ``hasattr(m, "_fsdp_wrapped_module")``) is left alone."""
        if self.planning or "b" in node.prefix.lower() or not _WRAPPED_NAME.search(node.value):
            return
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if isinstance(stmt, cst.SimpleStatementLine) and any(
            isinstance(e, cst.Expr) and e.value is node for e in stmt.body
        ):
            return  # a docstring or a bare string: words, not a name the code looks up
        code = _WRAPPED_NAME.sub("", node.value)
        if (
            self.module is not None
            and self.dispatch.constructs_fsdp1 is None
            and re.search(r"\b(FSDPModule|fully_shard)\b", self.code) is not None
            and _WRAPPED_NAME.sub("", str(node.evaluated_value))
            in {n.evaluated_value for n in walk(self.module) if isinstance(n, cst.SimpleString) and n is not node}
        ):
            # code written for both backends (it names FSDP2's module too and spells the name both ways: a list of
            # both layouts' prefixes) in a tree handed its models by a library, which may keep making FSDP1's
            self._record(
                node,
                f"{short(node.value, 50)} (a name under FSDP1's wrapper)",
                "kept as is: this file serves FSDP1's wrappers and FSDP2's modules alike (it spells the name "
                "without the prefix too), and no file of the tree makes an FSDP1 model: the models come from a "
                "library and may stay FSDP1's, whose names these are",
                True,
            )
            return
        self.expr_rewrites[id(node)] = code
        self.rewrites_names = True
        self._record(
            node,
            f"{short(node.value, 50)} (a name under FSDP1's wrapper)",
            f"{short(code, 50)}: FSDP1's named_parameters() / named_modules() put its wrapper's prefix "
            "(_fsdp_wrapped_module.) before the names of each wrapped module; FSDP2 does not wrap, and the model's "
            "names are the module's own (the bridge's fsdp1 backend, for an A/B run, brings the prefix back)",
            True,
        )

    def _plan_wrapped_module_test(self, node: cst.Call) -> bool:
        """``hasattr(m, "_fsdp_wrapped_module")`` telling FSDP1's wrapper by its attribute (true for FSDP1's
        wrappers only) -> ``fsdp_bridge.is_sharded(m)``: a branch doing FSDP work would be skipped on FSDP2, whose
        modules have no such attribute. Left as it is where what it guards unwraps (reads
        ``m._fsdp_wrapped_module``): FSDP2 does not wrap, so skipping that is what the code means."""
        if (
            self.planning
            or not self.uses_fsdp1
            or not m.matches(node.func, m.Name("hasattr"))
            or len(node.args) != 2
            or node.args[0].star
            or node.args[0].keyword is not None
            or not m.matches(
                node.args[1].value,
                m.SimpleString('"_fsdp_wrapped_module"') | m.SimpleString("'_fsdp_wrapped_module'"),
            )
        ):
            return False
        obj = code_of(node.args[0].value)
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        guarded = stmt.body if isinstance(stmt, (cst.If, cst.While)) else stmt
        if guarded is None or "._fsdp_wrapped_module" in code_of(guarded):
            return False
        if self.target == "torch" and isinstance(stmt, cst.If) and _returns_only(stmt.body, obj):
            return False  # ``return m``: an unwrap a first --fix lowered (FSDP2 does not wrap), skipped as before
        if (
            isinstance(stmt, cst.If)
            and isinstance(stmt.orelse, cst.Else)
            and code_of(stmt.body).strip() == code_of(stmt.orelse.body).strip()
        ):
            return False  # both branches alike: a forwarded read under it a first --fix dropped (X.config)
        scope = code_of(self.functions[-1] if self.functions else guarded)
        if (
            any(isinstance(s, (cst.While, cst.For)) for s in self.stmt_stack)
            or re.search(rf"(?m)^\s*{re.escape(obj)}\s*=[^=]", scope)
            or '_fsdp_wrapped_module"' in scope.replace("'", '"').replace(f'hasattr({obj}, "_fsdp_wrapped_module"', "")
            or "unwrapped(" in scope
        ):
            # an unwrapping loop or one reassigning the object (m = m.module, m = getattr(m, ...)): on FSDP2
            # is_sharded(m) stays true where unwrapping gives m itself, so the test stays as written
            return False
        code = f"fsdp_bridge.is_sharded({obj})"
        self.call_rewrites[id(node)] = code
        self.needs_imports.add(("fsdp_bridge", None))
        self._record(
            node,
            f'hasattr({short(obj, 40)}, "_fsdp_wrapped_module") (FSDP1\'s wrapper told by its attribute)',
            f"{short(code, 60)} ({IS_SHARDED}; FSDP2 modules have no _fsdp_wrapped_module, so the test would skip "
            "them)",
            True,
        )
        return True

    def _sharded_tensor_read(self, node: cst.Call) -> None:
        """``v.local_tensor()`` / ``v.local_shards()`` in a file using FSDP1: ShardedTensor's API, the values of
        FSDP1's SHARDED_STATE_DICT without a device mesh; FSDP2's sharded state dicts hold DTensors, which have
        neither (an AttributeError): a TODO naming DTensor's own."""
        func = node.func
        if (
            self.planning
            or not self.uses_fsdp1
            or node.args
            or not isinstance(func, cst.Attribute)
            or func.attr.value not in ("local_tensor", "local_shards")
        ):
            return
        self._record(
            node,
            f"{short(code_of(func), 50)}() (ShardedTensor's API)",
            "not rewritten: FSDP1's SHARDED_STATE_DICT (without a device mesh) gives ShardedTensor values, which "
            "this reads; FSDP2's sharded state dicts hold DTensors, which have no local_tensor() or local_shards(): "
            "use .to_local() for this rank's shard (or .full_tensor() for the whole tensor, a collective)",
            False,
        )

    def visit_Call(self, node: cst.Call) -> bool | None:
        func = node.func
        self._sharded_tensor_read(node)
        self._note_fsdp1_checkpoint(node)
        self._note_local_clip(node)
        self._note_shard_shapes(node)
        self._note_param_collective(node)
        self._note_param_sum(node)
        self._note_compiled_wrap(node)
        self._note_duck_typed_wrapper(node)
        self._note_optimizer_state(node)
        self._note_kernel_optimizer(node)
        self._note_data_swap(node)
        self._note_paired_meshes(node)
        self._note_plain_scaler(node)
        self._plan_offload_backend(node)
        self._note_rank_forward(node)
        if (
            not self.planning
            and m.matches(node.func, m.Name("getattr") | m.Name("hasattr"))
            and len(node.args) >= 2
            and m.matches(node.args[1].value, m.SimpleString('"_fsdp_flattened"') | m.SimpleString("'_fsdp_flattened'"))
        ):
            # FSDP1's mark on the parameters it flattened, read by its string: FSDP2's parameters never have it
            # (a TODO written into a file that may import nothing of FSDP1's)
            self.fsdp1_elsewhere = True
            self._record(
                node,
                f'{code_of(node.func)}(..., "_fsdp_flattened") (an FSDP1 internal)',
                INTERNAL_ATTRS["_fsdp_flattened"],
                False,
            )
        if self._plan_wrapped_module_test(node):
            return False
        copy = self._vendored_function(self.get_metadata(QualifiedNameProvider, func, set()))
        if self.planning:
            self.called.add(id(func))
            quals = self.get_metadata(QualifiedNameProvider, func, set())
            if (
                self._fsdp1_factory(quals)
                or self._star_factory(func, quals)
                or any(
                    q.source is QualifiedNameSource.IMPORT and q.name.lstrip(".") in self.dispatch.unit_holders
                    for q in quals
                )
            ):
                self.uses_fsdp1 = True  # the file is handed an FSDP1 model (or one holding FSDP1 units) by another
            if self._tree_predicate(self.get_metadata(QualifiedNameProvider, func, set())):
                self.uses_fsdp1 = True  # it tests for FSDP1's wrapper with a function of another file
            if copy is not None:
                self.uses_fsdp1 = True  # it calls into a copy of FSDP1's internals (reported below)
        elif copy is not None and copy != self.path:
            self._record_vendored_call(node, copy)
        if id(node) in self.kept_checks:
            if not self.planning:
                self.uses_fsdp1 = True
                self._record(
                    node,
                    f"isinstance(..., {code_of(node.args[1].value)})",
                    "kept as is: this code tells the backends apart (it tests FSDPModule too); "
                    "FSDPModule in its place would send FSDP2 modules down the FSDP1 path",
                    True,
                )
            return False
        if (region := self._in_region(node)) is not None:
            if self.planning:
                return None
            # One finding per call, as outside such code; FSDP1 names elsewhere are reported by _reference.
            if (
                m.matches(func, m.Name("isinstance"))
                and len(node.args) == 2
                and (
                    self._qn(node.args[1].value) is not None
                    or any(self._qn(n) == (FSDP, "") for n in walk(node.args[1].value))
                )
            ):
                construct = f"isinstance(..., {short(code_of(node.args[1].value), 40)})"
            elif (hit := self._qn(func)) is not None:
                construct = f"FSDP.{hit[1]}(...)" if hit[0] == FSDP and hit[1] else f"{code_of(func)}(...)"
            else:
                return None
            self.uses_fsdp1 = True
            self._record(node, construct, region.text(), True)
            return False
        if id(node) in self.partials:
            return False
        if self.planning and self._plan_partial(node):
            return False
        hit = self._qn(func)
        if hit is not None and hit[0] == FSDP and hit[1] == "":
            self.uses_fsdp1 = True
            if self.planning:
                self._plan_fsdp(node)
            return None
        if self._chosen_fsdp1_branch(func) is not None:  # (FSDP if ok else Plain)(m, ...)
            self.uses_fsdp1 = True
            if self.planning:
                self._plan_fsdp(node)
            return None
        if not self.planning:
            self._config_driven(node)
            if self._plan_lightning(node):
                return None
        if self.planning or not self.uses_fsdp1:
            return None
        if id(node) in self.call_rewrites:
            return False  # planned inside a state_dict_type block
        if self._plan_module_checks(node, hit):
            return False
        if self._plan_optim_load(node):
            return False
        if self._plan_state_dict_type_call(node, func, hit):
            return False
        handled, result = self._plan_wrap_call(node, func, hit)
        if handled:
            return result
        if hit == (FSDP, "set_state_dict_type") and self._plan_set_state_dict_type(node):
            return False
        through_model = (
            hit is None
            and isinstance(func, cst.Attribute)
            and func.attr.value == "set_state_dict_type"
            and bool(node.args)
            and node.args[0].keyword is None
        )
        # model.set_state_dict_type(model, ...)
        passes_itself = through_model and code_of(node.args[0].value) == code_of(cast(cst.Attribute, func).value)
        if passes_itself and self._plan_self_spelled_set_state_dict_type(node, cast(cst.Attribute, func)):
            return False
        if (
            through_model
            and isinstance(func, cst.Attribute)
            and not passes_itself
            and self.dispatch.own_methods.get("set_state_dict_type") is None
            and self._fsdp1_wrapper(node, func.value, by_calls=False) == "fsdp1"
        ):
            # model.set_state_dict_type(StateDictType.X, cfg): FSDP1's static method reached through the model
            # without the model, which FSDP1 reads as its module argument
            recv = short(code_of(func.value), 40)
            self._consume(node)
            self._record(
                node,
                f"{recv}.set_state_dict_type({short(code_of(node.args[0].value), 40)}, ...)",
                f"not rewritten: FSDP1's set_state_dict_type is a static method whose first argument is the module, "
                f"so called through {recv} without it FSDP1 takes {short(code_of(node.args[0].value), 40)} for the "
                "module (and raises); FSDP2's module has no set_state_dict_type (an AttributeError). Write "
                f"fsdp_bridge.set_state_dict_type({recv}, <type>, <config>) (it takes any module), or take the "
                f"state dict with get_model_state_dict({recv}, options=StateDictOptions(full_state_dict=True))",
                False,
            )
            return False
        if self._plan_optim_state_call(node, func, hit):
            return False
        handled, result = self._plan_summon(node, func, hit)
        if handled:
            return result
        if (
            isinstance(func, cst.Attribute)
            and func.attr.value in ("state_dict", "load_state_dict")
            and hit is None
            and self._plan_plain_state_dict(node, func)
        ):
            return False
        if (
            isinstance(func, cst.Attribute)
            and func.attr.value == "save_pretrained"
            and hit is None
            and self._plan_save_pretrained(node, func)
        ):
            return False
        self._plan_wrapper_method_call(node, func, hit)
        return None

    def visit_Comparison(self, node: cst.Comparison) -> None:
        """``m.__class__.__name__ == "FullyShardedDataParallel"`` (or ``type(m).__name__``; ``!=``) in a tree that
        makes FSDP1 models: FSDP1's wrapper told by its class name, which the bridge's models do not carry (they
        keep the user's class) -> ``fsdp_bridge.is_sharded(m)``."""
        if self.planning or self.dispatch.wraps_fsdp1 is None or len(node.comparisons) != 1:
            return
        comp = node.comparisons[0]
        if not isinstance(comp.operator, (cst.Equal, cst.NotEqual)):
            return
        for named, text in ((node.left, comp.comparator), (comp.comparator, node.left)):
            if not (isinstance(text, cst.SimpleString) and text.evaluated_value == "FullyShardedDataParallel"):
                continue
            obj: cst.BaseExpression | None = None
            if m.matches(named, m.Attribute(value=m.Attribute(attr=m.Name("__class__")), attr=m.Name("__name__"))):
                obj = cast(cst.Attribute, cast(cst.Attribute, named).value).value
            elif m.matches(named, m.Attribute(value=m.Call(func=m.Name("type")), attr=m.Name("__name__"))):
                call = cast(cst.Call, cast(cst.Attribute, named).value)
                obj = call.args[0].value if len(call.args) == 1 else None
            if obj is None:
                return
            negated = isinstance(comp.operator, cst.NotEqual)
            code = f"{'not ' if negated else ''}fsdp_bridge.is_sharded({code_of(obj)})"
            self.expr_rewrites[id(node)] = code
            self.needs_imports.add(("fsdp_bridge", None))
            self.fsdp1_elsewhere = True  # the file may import nothing of FSDP1's
            self._record(
                node,
                f"{short(code_of(node), 60)} (FSDP1's wrapper told by its class name)",
                f"{code} ({IS_SHARDED}): the bridge's models keep your model's class name",
                True,
            )
            return

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.functions.append(node)
        self._push(node)  # a TODO in its header (decorators, annotations, defaults) goes above the def
        if self.planning and not self.uses_fsdp1 and self.dispatch.fsdp1_args:
            params = [p.name.value for p in node.params.params]
            cls = self.classes[-1].name.value if self.classes else None
            handed = handed_parameters(called_as(node.name.value, cls), params, self.dispatch.fsdp1_args)
            uses = HANDED_MODEL_USES
            if cls is None and node.name.value in self.dispatch.defined_twice:
                # the call may reach another file's function of that name (a DDP script's train_one_epoch): a
                # .module read alone does not make this one FSDP1 code
                uses = uses - {"module"}
            if any(
                isinstance(n, cst.Attribute)
                and isinstance(n.value, cst.Name)
                and n.value.value in handed
                and n.attr.value in uses
                for n in walk(node.body)
            ):
                self.uses_fsdp1 = True  # another file hands this function an FSDP1 model, and it uses one here

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.functions.pop()
        self.stmt_stack.pop()

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.classes.append(node)
        self._push(node)  # a TODO in its header (bases, decorators) goes above the class
        if self.planning:
            self.class_bases.update(id(b.value) for b in node.bases)
            if any(code_of(b.value).rsplit(".", 1)[-1] in self.dispatch.fsdp1_attributes for b in node.bases):
                self.uses_fsdp1 = True  # a base class of the tree keeps an FSDP1 model in an attribute
            if node.name.value in self.dispatch.instance_attributes:
                self.uses_fsdp1 = True  # another file keeps an FSDP1 model on an instance of this class
            if self.dispatch.fsdp1_args and any(
                isinstance(n, cst.Attribute)
                and isinstance(n.value, cst.Attribute)
                and m.matches(n.value.value, m.Name("self"))
                and n.attr.value in HANDED_MODEL_USES
                and self._kept_from_a_handed_parameter(node, n.value.attr.value)
                for n in walk(node)
            ):
                self.uses_fsdp1 = True  # a method keeps the FSDP1 model another file hands it, another uses it
        else:
            self._plan_lightning_subclass(node)

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self.classes.pop()
        self.stmt_stack.pop()

    def visit_Assign(self, node: cst.Assign) -> None:
        self._plan_data_assign(node)

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self.assign_target_depth += 1

    def leave_AssignTarget(self, original_node: cst.AssignTarget) -> None:
        self.assign_target_depth -= 1

    def visit_Annotation(self, node: cst.Annotation) -> None:
        self.annotation_depth += 1

    def leave_Annotation(self, original_node: cst.Annotation) -> None:
        self.annotation_depth -= 1

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        inner = node.value
        if (
            isinstance(inner, cst.Attribute)
            and inner.attr.value in ("_fsdp_wrapped_module", "module")
            and not self.assign_target_depth
            and not self._written_in_place(node)
            and not wrapper_defines(node.attr.value)
        ):
            # FSDP1's wrapper hands a name it does not define to the module it wraps: X.name is the same
            # (for reads: a write, `X.module.n += 1` included, lands on the wrapper itself)
            self.forwarded_reads[id(inner)] = node.attr.value
        self._note_fsdp1_checkpoint(node)
        self._note_fsdp1_attribute(node)
        return self._reference(node)

    def _written_in_place(self, node: cst.Attribute) -> bool:
        """``node`` is the target of an augmented or annotated assignment or of a ``del`` in the current
        statement (``x.module.steps += 1``)."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        return isinstance(stmt, cst.SimpleStatementLine) and any(
            isinstance(b, (cst.AugAssign, cst.AnnAssign, cst.Del)) and b.target is node for b in stmt.body
        )

    def visit_Name(self, node: cst.Name) -> bool:
        self._note_fsdp1_checkpoint(node)
        return self._reference(node)


def _returns_only(body: cst.BaseSuite, obj: str) -> bool:
    """``body`` is ``return <obj>`` alone."""
    stmts = body.body if isinstance(body, cst.IndentedBlock) else [body]
    if len(stmts) != 1 or not isinstance(stmts[0], (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
        return False
    small = stmts[0].body
    return (
        len(small) == 1
        and isinstance(small[0], cst.Return)
        and small[0].value is not None
        and code_of(small[0].value) == obj
    )
