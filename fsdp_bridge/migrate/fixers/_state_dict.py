"""FSDP1's state-dict contexts (``state_dict_type``, ``set_state_dict_type``) and the model state
saved or loaded in them or outside them."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import libcst as cst
import libcst.matchers as m
from libcst.metadata import CodePosition, PositionProvider, QualifiedNameProvider, QualifiedNameSource

from fsdp_bridge.migrate._analysis import (
    Conversion,
    code_of,
    module_suffixes,
    named_args,
    short,
    walk,
    wrapper_subclasses,
)
from fsdp_bridge.migrate._names import FSDP, FSDP_METHODS, GROUP_RANK0
from fsdp_bridge.migrate._render import commas, with_option
from fsdp_bridge.migrate._report import CodeFinding
from fsdp_bridge.migrate._scan_base import ScannerBase

_STATE_DICT_HOOK = re.compile(r"\.(?:_register_state_dict_hook|register_state_dict_post_hook)\(")
"""A hook that may change the keys of a module's state dict (``state_dict_hook`` adding merged LoRA weights)."""
_RANK_TEST = re.compile(r"rank\b|rank\(\)|\bis_main|\bis_master|main_process|master_process|\brank0\b", re.I)


def rank_guard_text(guard: str, what: str, *, block: bool = False) -> str:
    """The TODO for a state-dict call (``block``: a state_dict_type block) under a test that picks ranks."""
    return (
        f"not rewritten: under `if {short(guard, 40)}:` (some ranks only): {what}; a full or sharded state "
        "dict of a sharded model gathers across every rank (FSDP1's too, unless its units were left gathered by "
        "a forward just before), and FSDP2's get_model_state_dict / set_model_state_dict always do: call them on "
        "every rank before the test (rank0_only / cpu_offload=True keeps the result on rank 0), and save under it"
        + (
            ". Left as written, FSDP1's state_dict_type context on a model the rest of the file now shards with "
            "FSDP2 sets nothing, and raises KeyError on leaving the block"
            if block
            else ""
        )
    )


FULL_LOAD_KEYS = (
    "; torch's full-state load fills a key the state dict lacks with the model's current value instead of "
    "reporting it (missing_keys is empty, strict refuses unexpected keys only): where a checkpoint missing "
    "weights must fail, compare its keys with the model's first"
)
"""Said of each rewrite to ``set_model_state_dict(..., full_state_dict=True)`` (torch's ``_load_model_state_dict``
updates the given state dict with the local one)."""


_OPTIMIZER_NAME = re.compile(r"^(?:opt|optim|optimi[sz]ers?)$|_(?:optim|optimi[sz]er)$|^optimi[sz]er_")
"""A receiver named as an optimizer (``optimizer``, ``opt``, ``g_optim``, ``optimizer_d``): its state dict is the
optimizer's, whatever the function it sits in is handed."""


NOT_MODULES = frozenset(
    {"config", "generation_config", "tokenizer", "processor", "image_processor", "feature_extractor", "peft_config"}
)
"""Attributes of a Hugging Face model that have a ``save_pretrained`` and hold no parameters."""


class StateDictFixer(ScannerBase):
    """State-dict contexts and model state."""

    def _plan_state_dict_type_call(self, node: cst.Call, func: cst.BaseExpression, hit: tuple[str, str] | None) -> bool:
        """FSDP1's state_dict_type / set_state_dict_type call; True when it is planned."""
        if hit in ((FSDP, "state_dict_type"), (FSDP, "set_state_dict_type")) and id(func) not in self.consumed_nodes:
            for a in node.args:  # its arguments belong to this construct (a TODO when the block is not rewritten)
                self._consume(a.value)
            if hit[1] == "state_dict_type" and self._plan_state_dict_context(node):
                return True
        return False

    def _plan_set_state_dict_type(self, node: cst.Call, through_class: bool = True) -> bool:
        """``FSDP.set_state_dict_type(M, SHARDED_STATE_DICT[, ShardedStateDictConfig()])`` as a statement of
        its own is deleted: an FSDP2 module's ``state_dict()`` already holds sharded (DTensor) values. A type
        known only at run time, or FULL_STATE_DICT, becomes ``fsdp_bridge.set_state_dict_type(...)`` (also
        ``M.set_state_dict_type(M, ...)``, ``through_class=False``): FSDP1's own call on FSDP1 models, on FSDP2
        the type's state dicts until the next call. In a tree holding such a call, SHARDED ones become the
        bridge's too: a model may be set to FULL somewhere and back to SHARDED here."""
        named = named_args(node, ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config"))
        if (
            named is not None
            and "module" in named
            and "state_dict_type" in named
            and self.dispatch.unfollowed_set_state_dict_type is None  # never half of a LOCAL / SHARDED pair
        ):
            type_arg = named["state_dict_type"]
            kind = self._member(type_arg, "StateDictType")
            followed = self.dispatch.bridge_sets_state_dict_type is not None  # the tree also sets another type
            if (
                kind == "FULL_STATE_DICT"
                or (kind is None and self._qn(type_arg) is None)
                or (kind == "SHARDED_STATE_DICT" and followed)
            ):
                self.expr_rewrites[id(node.func)] = "fsdp_bridge.set_state_dict_type"
                self.needs_imports.add(("fsdp_bridge", None))
                self._consume(node.func)
                self._record(
                    node,
                    f"FSDP.set_state_dict_type({kind or short(code_of(type_arg), 40)})",
                    "fsdp_bridge.set_state_dict_type(...), the same arguments: FSDP1's own call on FSDP1 models; "
                    f"on FSDP2 {short(code_of(named['module']), 30)}'s state_dict() / load_state_dict() and "
                    "fsdp_bridge.optim_state_dict() / optim_state_dict_to_load() follow the type it sets at run "
                    "time until the next call (LOCAL_STATE_DICT refused with a ConfigError)",
                    True,
                )
                return True
        if not through_class:
            return False
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if (
            named is None
            or "state_dict_type" not in named
            or not isinstance(stmt, cst.SimpleStatementLine)
            or len(stmt.body) != 1
            or not isinstance(stmt.body[0], cst.Expr)
            or stmt.body[0].value is not node
        ):
            return False
        if self._member(named["state_dict_type"], "StateDictType") == "LOCAL_STATE_DICT":
            self._consume(node)
            self._record(
                node,
                "FSDP.set_state_dict_type(LOCAL_STATE_DICT)",
                "not rewritten: LOCAL_STATE_DICT (each rank's FSDP1 flat-parameter shards) has no FSDP2 form; "
                "delete the call and take the state sharded (get_model_state_dict(model): DTensor values, "
                "saved with torch.distributed.checkpoint) or full where it is saved; an existing local "
                "checkpoint: load it in FSDP1, save it as SHARDED_STATE_DICT, then `fsdp-bridge convert`",
                False,
            )
            return True
        if self._member(named["state_dict_type"], "StateDictType") != "SHARDED_STATE_DICT":
            return False
        for key in ("state_dict_config", "optim_state_dict_config"):
            cfg = named.get(key)
            # the optimizer config's offload_to_cpu is written where its state is taken (_persistent_optim_offload)
            offload = key == "state_dict_config" and self._config_flag(cfg, "offload_to_cpu", False)
            if cfg is not None and (not self._literal_config(cfg) or offload):
                return False
        self.removed_stmts.add(id(stmt))
        self._consume(node)
        self._record(
            node,
            "FSDP.set_state_dict_type(SHARDED_STATE_DICT)",
            "deleted: an FSDP2 module's state_dict() already holds sharded (DTensor) values "
            "(get_model_state_dict(model) gives the same)",
            True,
        )
        return True

    def _plan_self_spelled_set_state_dict_type(self, node: cst.Call, func: cst.Attribute) -> bool:
        """``x.set_state_dict_type(x, ...)``: FSDP1's static method reached through the model. Rewritten as
        ``FSDP.set_state_dict_type`` is only when ``x`` is shown to be FSDP1's wrapper (see
        ``_fsdp1_wrapper`` / ``_handed_fsdp1``) and the tree defines no ``set_state_dict_type`` of its own (a
        subclass's override may do something else); otherwise a TODO says why."""
        recv = short(code_of(func.value), 40)
        where = self.dispatch.own_methods.get("set_state_dict_type")
        if where is None and (
            self._fsdp1_wrapper(node, func.value, by_calls=False) == "fsdp1"
            or self._handed_fsdp1(func.value) == "fsdp1"
        ):
            return self._plan_set_state_dict_type(node, through_class=False)
        if where is not None:
            where = "this file" if where == self.path else os.path.relpath(where, os.path.dirname(self.path) or ".")
            why = f"this tree defines its own set_state_dict_type (in {where}), which this call may reach"
        else:
            why = (
                f"nothing here shows {recv} is FSDP1's wrapper (no FSDP(...) or a factory of the tree assigned "
                f"to it in this scope, no ': FSDP' annotation, no isinstance(..., FSDP) guard)"
            )
        self._consume(node)
        self._record(
            node,
            f"{recv}.set_state_dict_type({recv}, ...)",
            f"not rewritten: {why}; if it is FSDP1's own static method on an FSDP1-wrapped model, write "
            f"fsdp_bridge.set_state_dict_type({recv}, ...) (the same arguments; it takes any module)",
            False,
        )
        return True

    # -- state dicts -----------------------------------------------------------------
    def _plan_block(self, body: Sequence[cst.BaseStatement]) -> None:
        body = [stmt for stmt in body if self._in_region(stmt) is None]
        for stmt in body:
            if isinstance(stmt, cst.With):
                self.options_at = stmt
                try:
                    self._plan_state_dict_block(stmt)
                finally:
                    self.options_at = None
        self._plan_optimizer_order(body)

    def _an_optimizer_here(self, name: str) -> bool:
        """``name`` is what the current function hands FSDP1's optimizer-state functions as the optimizer
        (``FSDP.optim_state_dict_to_load(model, name, sd)``): its ``load_state_dict`` is the optimizer's."""
        scope = self.functions[-1] if self.functions else None
        for n in walk(scope) if scope is not None else ():
            if isinstance(n, cst.Call) and (hit := self._qn(n.func)) is not None and hit[0] == FSDP:
                if hit[1] in ("optim_state_dict", "optim_state_dict_to_load", "full_optim_state_dict"):
                    named = named_args(n, ("model", "optim", "third", "fourth", "fifth", "sixth"))
                    if named is not None and "optim" in named and code_of(named["optim"]) == name:
                        return True
        return False

    def _plan_plain_state_dict(self, node: cst.Call, func: cst.Attribute) -> bool:
        """``model.state_dict()`` / ``model.load_state_dict(sd[, strict])`` outside a state_dict_type block, on
        an object the function shows to be FSDP1's wrapper: FSDP1's default type is FULL_STATE_DICT, so these
        are full state dicts on every rank; on FSDP2 they would be sharded DTensors (a torch.save on rank 0
        would keep rank 0's shards only, and loading plain tensors into DTensors fails)."""
        obj = func.value
        # ``model._orig_mod.load_state_dict(...)``: the model inside torch.compile's wrapper, FSDP1's when the
        # compiled one is (the call stays on ``model._orig_mod``)
        shown = obj.value if isinstance(obj, cst.Attribute) and obj.attr.value == "_orig_mod" else obj
        wrapper = self._fsdp1_wrapper(node, shown)
        if wrapper == "fsdp1" and func.attr.value == "load_state_dict" and self._plain_elsewhere(node, shown):
            # plain where the class calls this before its wrap (a resume from __init__): each keeps its own load,
            # whose strict check torch's full-state load does not make (a key the state lacks is kept, not refused)
            wrapper = "ambiguous"
        if wrapper not in ("fsdp1", "ambiguous") and _OPTIMIZER_NAME.search(code_of(shown).rsplit(".", 1)[-1]):
            return False  # an optimizer's own state dict (a call may hand the function a model too, not here)
        handed = False
        if (
            wrapper not in ("fsdp1", "ambiguous")
            and self._handed_parameter(node, shown)
            and not self._in_own_state_dict_type_block(code_of(shown))
        ):
            # A call of the tree hands this function an FSDP1 model (other calls may hand it other modules)
            wrapper, handed = "ambiguous", True
        if (
            wrapper not in ("fsdp1", "ambiguous")
            and isinstance(shown, cst.Attribute)
            and m.matches(shown.value, m.Name("self"))
            and self.classes
            and not self._isinstance_branch(node, shown)
            and not self._in_own_state_dict_type_block(code_of(shown))
            and (
                self._kept_from_a_handed_parameter(self.classes[-1], shown.attr.value)
                or self._handed_in(self.classes[-1], shown.attr.value, among=True)
            )
        ):
            # ``self.model = model`` from a parameter a call of the tree hands an FSDP1 model (``Trainer(unet=unet)``
            # after ``unet = wrap_unet(...)``), or annotated ``Union[nn.Module, FSDP]``: FSDP1's on some path
            wrapper, handed = "ambiguous", True
        if wrapper not in ("fsdp1", "ambiguous", "handed") and (
            self._factory_result(node, shown) != "" or self._holder_result(node, shown)
        ):
            # ``model, tok = setup_model(...)``: a function of the tree returns FSDP1's model there (on some path),
            # or a plain module it gave FSDP1 units (whose state dicts FSDP1 gives full)
            wrapper = "ambiguous"
        if wrapper not in ("fsdp1", "ambiguous"):
            if id(node) not in self.other_roots or self._an_optimizer_here(code_of(obj)):
                return False
            wrapper = "handed"  # in another model's state_dict_type block; nothing here shows what it is
        target, method = code_of(obj), func.attr.value
        around = [
            code_of(c.args[0].value)
            for stmt in self.stmt_stack
            if isinstance(stmt, cst.With)
            for item in stmt.items
            if isinstance(c := item.item, cst.Call) and c.args and self._qn(c.func) == (FSDP, "state_dict_type")
        ]
        if (covering := next((x for x in around if x != target and self._made_from(target, x)), None)) is not None:
            self._record(
                node,
                f"{short(target, 40)}.{method}({'...' if node.args else ''})",
                f"kept as is: {short(target, 30)} is made from {short(covering, 30)} (unwrapped) inside "
                f"FSDP.state_dict_type({short(covering, 30)}, ...), made fsdp_bridge.state_dict_type, which gives the "
                f"model's {method} that type's state",
                True,
            )
            return True
        if method == "state_dict" and not node.args and self._inside_own_summon(target):
            self._record(
                node,
                f"{short(target, 40)}.state_dict()",
                f"kept as is: inside summon_full_params({short(target, 30)}) its parameters are the full tensors, "
                "and the model's own state_dict() gives them on either backend (a local call, no collective)",
                True,
            )
            return True
        if method == "state_dict" and (hook := _STATE_DICT_HOOK.search(self.code)) is not None:
            self._record(
                node,
                f"{short(target, 40)}.state_dict()",
                f"not rewritten: this file registers a state-dict hook ({hook.group(0).strip('.(')}), which may "
                "add keys that are no attributes of the model (merged weights); torch's get_model_state_dict looks "
                "every key up on the model and raises AttributeError for such a key, while FSDP1's full state dict "
                f"ran the hooks on the gathered parameters: take it as `with fsdp_bridge.summon_full_params("
                f"{short(target, 30)}): sd = {short(target, 30)}.state_dict()` (full tensors, the hooks' keys kept)",
                False,
            )
            return True
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        written = code_of(stmt) if stmt is not None else ""
        if (
            f"FSDPModule) for m in {target}.modules()) else {target}.{method}(" in written
            or f"FSDPModule) else {target}.{method}(" in written
        ):
            return True  # the DDP branch a first --fix wrote (this form, or the root-only test of earlier versions)
        if (guard := self._rank_guard()) is not None and wrapper in ("fsdp1", "ambiguous"):  # a collective on FSDP2
            self._record(
                node,
                f"{short(target, 40)}.{method}({'...' if node.args else ''})",
                rank_guard_text(guard, f"{short(target, 40)}.{method}"),
                False,
            )
            return True
        if (covering := self._unit_of_context_model(target)) is not None:
            self._record(
                node,
                f"{short(target, 40)}.{method}({'...' if node.args else ''})",
                f"not rewritten: {target} iterates the modules of a model inside `with {short(covering, 60)}:`, and "
                f"FSDP1's context sets the type of that model's FSDP units too, so {target}.{method} took the "
                "context's type and configs (rank0_only: rank 0 of the unit's group only; offload_to_cpu); on FSDP2 "
                "take the model's state once with get_model_state_dict(model, options=StateDictOptions("
                "full_state_dict=True, cpu_offload=True)) (world rank 0), or write the per-unit gather and the "
                "rank test for your groups by hand",
                False,
            )
            return True
        args = list(node.args)
        if method == "state_dict":
            if args:
                return False  # destination/prefix/keep_vars: nn.Module's own signature, left alone
            construct = f"{short(target, 40)}.state_dict()"
        else:
            positional = [a for a in args if a.keyword is None]
            keywords = {a.keyword.value: a for a in args if a.keyword is not None}
            if not 1 <= len(positional) <= 2 or set(keywords) - {"strict"} or (len(positional) == 2 and keywords):
                return False
            construct = f"{short(target, 40)}.load_state_dict(...)"
            if (owner := self._own_narrow_load_state_dict()) is not None:
                self._record(
                    node,
                    construct,
                    f"not rewritten: {owner} in this file defines its own load_state_dict, which torch cannot call: "
                    "FSDP1's wrapper loaded through nn.Module's (the override of the module inside was never "
                    "called), while on FSDP2 the model is that class, and torch's set_model_state_dict calls its "
                    "load_state_dict(state_dict=..., strict=..., assign=...) (a TypeError): name its first parameter "
                    "state_dict and give it strict and assign (or **kwargs)",
                    False,
                )
                return True
        ctx = self._runtime_state_context()
        if ctx is not None and self._context_of_another_model(ctx, target):
            ctx = None  # FSDP1's contexts set the type of the model they are given (and its units) only
        if ctx is not None and (owner := self._subclass_context(ctx)) is not None:
            self._record(
                node,
                construct,
                f"kept as is: it runs inside `with {short(ctx)}:`, FSDP1's own context ({owner} subclasses FSDP1's "
                f"wrapper and stays FSDP1's, with the models it makes), which gives that type's {method}",
                True,
            )
            return True
        if ctx is not None and (where := self.dispatch.makes_state_dict_context) and not self._unimportable_context():
            self._record(
                node,
                construct,
                f"kept as is: it runs inside `with {short(ctx)}:` and {where} makes FSDP1's state-dict contexts, "
                "rewritten to fsdp_bridge.state_dict_type, which gives FSDP2 modules that type's "
                f"{method} for the block",
                True,
            )
            return True
        if ctx is not None:
            self._record(
                node,
                construct,
                f"not rewritten: it runs inside `with {short(ctx)}:`, a context made elsewhere that may set "
                "FSDP1's state-dict type; FSDP2 has no such setting: use get_model_state_dict / "
                "set_model_state_dict(model, sd) with options=StateDictOptions(full_state_dict=True) for a full "
                "state dict, no options for a sharded one",
                False,
            )
            return True
        persistent = self._persistent_type(node, target) if self.dispatch.sets_state_dict_type else None
        if persistent == "FULL_STATE_DICT":
            pass  # made in this function and its type never set since: FSDP1's default, written below
        elif persistent == "SHARDED_STATE_DICT":
            # FSDP.set_state_dict_type(target, SHARDED_STATE_DICT) above, in this block: FSDP1's state_dict()
            # and load_state_dict() take sharded state from then on, as FSDP2's own (DTensor) do.
            code = self._model_state_call(method, target, args, full=False)
            if wrapper == "ambiguous":
                code = self._for_fsdp2_only(code, target, node)
            self.call_rewrites[id(node)] = code
            self._record(
                node,
                construct,
                f"{short(code, 90)}: FSDP.set_state_dict_type({short(target, 30)}, SHARDED_STATE_DICT) above makes "
                "FSDP1's state dicts of this model sharded from then on, as FSDP2's own (DTensor) are",
                True,
            )
            return True
        elif (where := self.dispatch.sets_state_dict_type) is not None and self._bridge_follows():
            # Every set_state_dict_type call of the tree becomes fsdp_bridge.set_state_dict_type, which an FSDP2
            # module's own state_dict() / load_state_dict() follow, as FSDP1's do.
            if persistent == "other" or self._typed_by_factory(node, target):
                how = (
                    f"FSDP.set_state_dict_type({short(target, 30)}, ...) above"
                    if persistent == "other"
                    else f"the function that made {short(target, 30)} calls FSDP.set_state_dict_type on it, which"
                )
                self._record(
                    node,
                    construct,
                    f"kept as is: {how} becomes fsdp_bridge.set_state_dict_type, and an FSDP2 module's own "
                    "state_dict() / load_state_dict() then give and take the type it sets at run time, as FSDP1's do",
                    True,
                )
                return True
            self._record(
                node,
                construct,
                f"not rewritten: {where} sets a state-dict type at run time (FSDP.set_state_dict_type, made "
                "fsdp_bridge.set_state_dict_type, which FSDP2 modules follow) and nothing here shows whether "
                f"{short(target, 40)} is a model it sets: if it is, keep this call; if not, FSDP1 gave a full "
                "state dict: write get_model_state_dict / set_model_state_dict(model, sd) with "
                "options=StateDictOptions(full_state_dict=True)",
                False,
            )
            return True
        elif (where := self.dispatch.sets_state_dict_type) is not None:
            self._record(
                node,
                construct,
                f"not rewritten: {where} calls FSDP.set_state_dict_type, so this state dict's type is set at run "
                "time; FSDP2 has no such setting: use get_model_state_dict / set_model_state_dict(model, sd) with "
                "options=StateDictOptions(full_state_dict=True) for a full state dict, no options for a sharded one",
                False,
            )
            return True
        code = self._model_state_call(method, target, args, full=True)
        if wrapper == "handed":
            if any(re.search(r"\bfully_shard\b|\bFSDPModule\b", line.split("#", 1)[0]) for line in self.lines):
                self._record(
                    node,
                    construct,
                    f"not rewritten: it runs inside another model's FSDP.state_dict_type block, which does not "
                    f"cover {short(target, 40)}, and this file also uses FSDP2, so {short(target, 40)} may be an "
                    "FSDP1 root (full state dict by default) or an FSDP2 module (sharded): for a full state dict "
                    "write get_model_state_dict / set_model_state_dict(model, sd) with "
                    "options=StateDictOptions(full_state_dict=True)",
                    False,
                )
                return True
            code = self._for_fsdp2_only(code, target, node)
            self.call_rewrites[id(node)] = code
            self._record(
                node,
                construct,
                f"{short(code, 90)}: FSDP1's state_dict_type context covers its own model only, so another FSDP1 "
                "root used in it (a copy wrapped elsewhere, nothing here shows which) gives and takes FSDP1's "
                "default full state dicts; written for FSDP2 modules only, anything else keeps its own call",
                True,
            )
            return True
        if wrapper == "ambiguous":  # DistributedDataParallel's too: its own state_dict stays on the DDP path
            code = self._for_fsdp2_only(code, target, node)
        self.call_rewrites[id(node)] = code
        self._record(
            node,
            construct,
            f"{short(code, 90)}: outside a state_dict_type block FSDP1 gives and takes full state dicts (its "
            "default FULL_STATE_DICT), every rank; FSDP2's own would be sharded DTensors"
            + (FULL_LOAD_KEYS if method == "load_state_dict" and "full_state_dict=True" in code else "")
            + (
                f" ({short(target, 40)} is FSDP1's model on some path: a call of the tree hands it one, or its "
                "annotation names FSDP1's class; any other module keeps its own call)"
                if handed
                else ""
            ),
            True,
        )
        return True

    def _own_narrow_load_state_dict(self) -> str | None:
        """A module class of this file whose own ``load_state_dict`` torch's state-dict functions cannot call
        (they call ``load_state_dict(state_dict=..., strict=..., assign=...)`` on FSDP2, where the model is the user's
        class): its name."""
        for c in walk(self.module) if self.module is not None else ():
            if not isinstance(c, cst.ClassDef):
                continue
            if not any(code_of(b.value).rsplit(".", 1)[-1].endswith("Module") for b in c.bases):
                continue  # an EMA's or a scaler's own load_state_dict: not the model's
            for stmt in c.body.body:
                if not (isinstance(stmt, cst.FunctionDef) and stmt.name.value == "load_state_dict"):
                    continue
                names = [p.name.value for p in (*stmt.params.params, *stmt.params.kwonly_params)]
                takes = isinstance(stmt.params.star_kwarg, cst.Param) or {"strict", "assign"} <= set(names)
                if not takes or names[1:2] != ["state_dict"]:
                    return c.name.value
        return None

    def _plan_save_pretrained(self, node: cst.Call, func: cst.Attribute) -> bool:
        """``model.save_pretrained(path)`` (Hugging Face's, PEFT's) without ``state_dict=`` on an object shown to be
        FSDP1's model, or handed one by a call of the tree, outside any state-dict context: it takes
        ``model.state_dict()``, full on FSDP1 (its default type, gathered on every rank), DTensor shards on FSDP2.
        Reached by every rank, ``fsdp_bridge.save_pretrained(model, ...)`` (``**kwargs`` too: it reads a
        ``state_dict`` there when the code runs); elsewhere a TODO: the gather is a collective, and where the call
        runs on one rank only it must move out."""
        if any(a.keyword is not None and a.keyword.value == "state_dict" for a in node.args):
            return False
        obj = func.value
        alias = self._inner_module_alias(node, obj)  # u = model.module; u.save_pretrained(path)
        label = f"{code_of(obj)}.save_pretrained(...) ({code_of(obj)} = {code_of(alias)})" if alias else None
        obj = alias or obj
        inner = isinstance(obj, cst.Attribute) and obj.attr.value == "module"
        part: str | None = None
        if (
            isinstance(obj, cst.Attribute)
            and isinstance(obj.value, cst.Attribute)
            and obj.value.attr.value == "module"
            and obj.attr.value not in NOT_MODULES
            and not obj.attr.value.endswith("config")
            and (self._fsdp1_wrapper(node, obj.value.value) == "fsdp1" or self._handed_parameter(node, obj.value.value))
        ):
            part, obj = obj.attr.value, obj.value.value  # model.module.lora.save_pretrained(path)
        elif isinstance(obj, cst.Attribute) and inner:
            # model.module.save_pretrained(path): FSDP1's wrapper's inner module (the model itself on FSDP2)
            obj = obj.value
            if self._fsdp1_wrapper(node, obj) != "fsdp1" and not self._handed_parameter(node, obj):
                return False
        elif self._fsdp1_wrapper(node, obj) not in ("fsdp1", "ambiguous") and not self._handed_parameter(node, obj):
            if (
                not isinstance(obj, cst.Attribute)
                or obj.attr.value in NOT_MODULES
                or obj.attr.value.endswith("config")  # text_config, lora_config, quantization_config
                or not (self._fsdp1_wrapper(node, obj.value) == "fsdp1" or self._handed_parameter(node, obj.value))
            ):
                return False
            part = obj.attr.value  # model.llm.save_pretrained(path): a submodule of FSDP1's model (a PEFT part)
            obj = obj.value
        if self._runtime_state_context() is not None or self._inside_own_summon(code_of(obj)):
            return False  # a state_dict_type block or a summon: the type it gives (reported with the block)
        if self.dispatch.sets_state_dict_type is not None:
            return False  # a type set at run time, reported where it is set
        target = short(code_of(obj), 40)
        took = (
            f"{target}.module.state_dict(), the state of the module inside FSDP1's wrapper (the units wrapped "
            "inside it gathered by their hooks, its own parameters not), and FSDP2 (which does not "
            f"wrap: no .module) gives {target}.state_dict() as DTensor shards"
            if inner
            else f"{target}.state_dict(): FSDP1's wrapper forwards save_pretrained to the module inside it, whose "
            "state_dict() held the units nested in it gathered by their hooks and the root unit's own parameters as "
            "this rank's flat shard (a _flat_param entry), not the model's weights, and FSDP2 gives DTensor shards"
        )
        if part is not None:
            self._record(
                node,
                f"{target}.{part}.save_pretrained(...)",
                f"not rewritten: save_pretrained takes {target}.{part}.state_dict(), a submodule of FSDP1's model "
                "(full where FSDP1 wrapped it as a unit of its own, gathered by its hooks; this rank's flat shard "
                "where it is part of a bigger unit), and FSDP2 gives DTensor shards (PEFT's save then fails on "
                f"every rank); take the full state on every rank, sd = get_model_state_dict({target}, "
                "options=StateDictOptions(full_state_dict=True, cpu_offload=True)) (a collective: outside any "
                f"rank test), then on rank 0 keep the keys under '{part}.' without that prefix and pass them as "
                f"{target}.{part}.save_pretrained(..., state_dict=...)",
                False,
            )
            return True
        guard = f"if {test}:" if (test := self._rank_guard()) else self._rank_condition(node)
        positional = [a for a in node.args if a.star == "*"] + [
            a for a in node.args[1:] if a.keyword is None and not a.star
        ]
        if not inner and label is None and guard is None and not positional:
            # fsdp_bridge.save_pretrained(model, <the same arguments>): it gathers the full state and rank 0 writes
            self.fixable_calls[id(node)] = "method"
            self._record(
                node,
                f"{target}.save_pretrained(...)",
                f"fsdp_bridge.save_pretrained({target}, ...): save_pretrained took {took}; the bridge's call "
                "gathers the full state (a collective: every rank must reach the call, as every rank had to for "
                "the gather of FSDP1's nested units) and has rank 0 write it (state_dict=, which PEFT's save "
                "narrows to the adapter's keys), on a fully_shard model; an FSDP1 wrapper or an unsharded model "
                "gets its own call",
                True,
            )
            return True
        where = f" under `{short(guard, 40)}`, where the other ranks never reach the gather" if guard else ""
        if positional and not where:
            where = (
                f" ({short(code_of(positional[0]), 30)}: arguments given by position past the directory, or "
                "through *, which save_pretrained's classes place differently; name them and run migrate code "
                "again)"
            )
        self._record(
            node,
            label or f"{target}{'.module' if inner else ''}.save_pretrained(...)",
            f"not rewritten{where}: save_pretrained takes {took}; take the full state on "
            f"every rank, sd = get_model_state_dict({target}, options=StateDictOptions(full_state_dict=True, "
            f"cpu_offload=True)) (a collective: outside any rank test), then {target}.save_pretrained(..., "
            "state_dict=sd) on rank 0",
            False,
        )
        return True

    def _inner_module_alias(self, node: cst.Call, obj: cst.BaseExpression) -> cst.Attribute | None:
        """``obj`` is a name the enclosing function assigned ``X.module`` before ``node``, with ``X`` shown to be
        FSDP1's model (``unwrapped = model.module``): that ``X.module``; else None."""
        if not isinstance(obj, cst.Name) or not self.functions:
            return None
        line = self.get_metadata(PositionProvider, node).start.line
        found: cst.Attribute | None = None
        for n in walk(self.functions[-1]):
            if not isinstance(n, cst.Assign) or self.get_metadata(PositionProvider, n).start.line >= line:
                continue
            if len(n.targets) != 1 or not m.matches(n.targets[0].target, m.Name(obj.value)):
                continue
            value = n.value
            found = (
                value
                if isinstance(value, cst.Attribute)
                and value.attr.value == "module"
                and (self._fsdp1_wrapper(node, value.value) == "fsdp1" or self._handed_parameter(node, value.value))
                else None
            )  # the last assignment before the call decides
        return found

    def _holder_function(self, func: cst.BaseExpression) -> bool:
        """``func`` is a function of the tree in ``Dispatch.unit_holders``: imported from its file, or defined in
        this one."""
        for q in self.get_metadata(QualifiedNameProvider, func, set()):
            if q.source is QualifiedNameSource.IMPORT and q.name.lstrip(".") in self.dispatch.unit_holders:
                return True
            if q.source is QualifiedNameSource.LOCAL and "." not in q.name:
                if module_suffixes(self.path, {q.name}) & self.dispatch.unit_holders:
                    return True
        return False

    def _inside_own_summon(self, target: str) -> bool:
        """The current statement is inside ``with FSDP.summon_full_params(target, ...):`` (or the bridge's) that
        gathers every parameter: no ``recurse=False`` (FSDP2's unshard, whose state dict reshards). Under
        ``rank0_only`` rank 0 holds them (the state dict a rank-0 block saves); torch's full-state call there
        would be a collective inside that block."""

        def gathers_all(call: cst.Call) -> bool:
            given = {a.keyword.value: code_of(a.value) for a in call.args if a.keyword is not None}
            return given.get("recurse", "True") == "True"

        return any(gathers_all(call) for call in self._blocks_around("summon_full_params", target))

    def _holder_result(self, node: cst.CSTNode, obj: cst.BaseExpression) -> bool:
        """``obj = f(...)`` above ``node`` in this function, ``f`` a function of the tree that gives parts of a
        module FSDP1's wrapper and returns the module (``Dispatch.unit_holders``)."""
        if not (isinstance(obj, cst.Name) and self.functions and self.dispatch.unit_holders):
            return False
        at = self.get_metadata(PositionProvider, node).start
        for n in walk(self.functions[-1]):
            if (
                isinstance(n, cst.Assign)
                and isinstance(n.value, cst.Call)
                and any(m.matches(t.target, m.Name(obj.value)) for t in n.targets)
                and self._holder_function(n.value.func)
            ):
                start = self.get_metadata(PositionProvider, n).start
                if (start.line, start.column) < (at.line, at.column):
                    return True
        return False

    def _made_from(self, target: str, model: str) -> bool:
        """``target`` is a name this function assigns from ``model`` (``m = unwrap_model(model)``,
        ``m = model.module``): the same model, unwrapped, as the context around it sees it."""
        scope = self.functions[-1] if self.functions else self.module
        return (
            target != model
            and scope is not None
            and any(
                isinstance(n, cst.Assign)
                and isinstance(n.value, (cst.Call, cst.Attribute))
                and any(m.matches(t.target, m.Name(target)) for t in n.targets)
                and any(isinstance(x, (cst.Name, cst.Attribute)) and code_of(x) == model for x in walk(n.value))
                for n in walk(scope)
            )
        )

    def _in_own_state_dict_type_block(self, target: str) -> bool:
        """Inside ``with FSDP.state_dict_type(target, ...):`` (or a kept block of it): the block decides the call's
        type (rewritten with it, or the block's TODO covers it)."""
        return bool(self._blocks_around("state_dict_type", target))

    def _blocks_around(self, method: str, target: str) -> list[cst.Call]:
        """The ``with X.<method>(target, ...):`` calls around the current statement (FSDP1's or the bridge's)."""
        return [
            item.item
            for stmt in self.stmt_stack
            if isinstance(stmt, cst.With)
            for item in stmt.items
            if isinstance(item.item, cst.Call)
            and code_of(item.item.func).rsplit(".", 1)[-1] == method
            and item.item.args
            and code_of(item.item.args[0].value) == target
            and (item.item.args[0].keyword is None or item.item.args[0].keyword.value == "module")
        ]

    def _for_fsdp2_only(self, code: str, target: str, node: cst.Call) -> str:
        """``code`` (torch's state-dict call) where ``target`` holds FSDP2 modules (is one, or a plain module whose
        parts were sharded, as FSDP1 code wrapping only some submodules leaves it; torch.compile's wrapper of
        one), ``node`` (its own call) for anything else: DDP, a module FSDP1 still wraps, an object that is no
        module at all (an optimizer handed the same way)."""
        self.needs_imports.add(("torch.distributed.fsdp", "FSDPModule"))
        self.needs_imports.add(("torch", None))
        holds = f"isinstance({target}, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in {target}.modules())"
        return f"({code} if {holds} else {code_of(node)})"

    def _model_state_call(self, method: str, target: str, args: list[cst.Arg], *, full: bool) -> str:
        """torch's call for ``target.state_dict()`` / ``target.load_state_dict(sd[, strict])``: full or sharded."""
        options = self._options(full)
        if method == "state_dict":
            self.needs_state_dict_api.add("get_model_state_dict")
            return f"get_model_state_dict({target}, options={options})"
        positional = [a for a in args if a.keyword is None]
        strict = next((a.value for a in args if a.keyword is not None and a.keyword.value == "strict"), None)
        if strict is None and len(positional) == 2:
            strict = positional[1].value
        if strict is not None:
            options = options[:-1] + ("" if options.endswith("()") else ", ") + f"strict={code_of(strict)})"
        self.needs_state_dict_api.add("set_model_state_dict")
        return f"set_model_state_dict({target}, {code_of(positional[0].value)}, options={options})"

    def _options(self, full: bool, *, cpu_offload: bool = False, broadcast: bool = False, offload: bool = False) -> str:
        self.needs_state_dict_api.add("StateDictOptions")
        at = self.options_at or (self.stmt_stack[-1] if self.stmt_stack else None)
        if full and cpu_offload and (where := self.dispatch.group_fsdp) is not None and at is not None:
            # torch's full state dict with cpu_offload goes to rank 0 of the world only; FSDP1's rank0_only
            # meant each process group's first rank, which saves its own model-parallel slice.
            cpu_offload = False
            if id(at) not in self.group_offload_noted:
                self.group_offload_noted.add(id(at))
                text = (
                    f"this tree shards over a process group of some ranks ({Path(where).name}): FSDP1 gave the "
                    "full state to each group's first rank, torch's StateDictOptions(cpu_offload=True) gives it "
                    "to rank 0 of the world only (the other groups' first ranks would get an empty dict and save "
                    "nothing), so it is written without cpu_offload: every rank gets the full state on its "
                    "device (more memory); keep it so, or restore cpu_offload=True if the group is the world"
                )
                pos = self.get_metadata(PositionProvider, at)
                construct = "rank0_only=True (full state dict)"
                self.findings.append(CodeFinding(self.path, pos.start.line, pos.start.column, construct, text, False))
                # A state_dict_type block is replaced by its body: the comment goes above its first statement.
                target = at.body.body[0] if isinstance(at, cst.With) and at.body.body else at
                self.todos.setdefault(id(target), []).append(f"{construct}: {text}")
        if not full:
            return "StateDictOptions(cpu_offload=True)" if offload else "StateDictOptions()"
        extra = (", cpu_offload=True" if cpu_offload else "") + (", broadcast_from_rank0=True" if broadcast else "")
        return f"StateDictOptions(full_state_dict=True{extra})"

    @staticmethod
    def _runtime_flags(cfg: cst.BaseExpression, offload_default: str = "False") -> str:
        """``rank0_only=..., offload_to_cpu=...`` of a full-state config known at run time: the keywords of a
        ``FullStateDictConfig(...)`` call written there (FSDP1's defaults for those not given: False, and
        ``offload_default`` for ``offload_to_cpu``, True for ``FullOptimStateDictConfig``), else the config
        object's attributes."""
        if isinstance(cfg, cst.Call) and all(a.keyword is not None for a in cfg.args):
            given = {a.keyword.value: code_of(a.value) for a in cfg.args if a.keyword is not None}
            defaults = {"rank0_only": "False", "offload_to_cpu": offload_default}
            if set(given) <= set(defaults):
                return ", ".join(f"{k}={given.get(k, defaults[k])}" for k in defaults)
        obj = code_of(cfg)
        return f"rank0_only={obj}.rank0_only, offload_to_cpu={obj}.offload_to_cpu"

    def _literal_config(self, cfg: cst.BaseExpression | None) -> bool:
        """A state-dict config written out (``FullStateDictConfig(rank0_only=True)``, inline or in a
        variable assigned once) whose flags are literal True/False."""
        if cfg is None or m.matches(cfg, m.Name("None")):
            return True
        value = self._follow(cfg, Conversion())
        if not isinstance(value, cst.Call) or self._qn(value.func) is None:
            return False
        return all(a.keyword is not None and code_of(a.value) in ("True", "False") for a in value.args)

    def _config_flag(self, cfg: cst.BaseExpression | None, name: str, default: bool) -> bool:
        """A keyword of ``FullStateDictConfig(...)`` given inline or in a variable assigned once."""
        if cfg is None:
            return default
        value = self._follow(cfg, Conversion())
        if isinstance(value, cst.Call):
            for a in value.args:
                if a.keyword is not None and a.keyword.value == name:
                    return code_of(a.value) == "True"
        return default

    def _plan_state_dict_context(self, node: cst.Call) -> bool:
        """``FSDP.state_dict_type(M, type, cfg, optim_cfg)`` that is not a block rewritten in place (a context
        made here and entered elsewhere, a type known only at run time, a block with no call to rewrite) ->
        ``fsdp_bridge.state_dict_type(...)``, the same arguments: FSDP1's own context on FSDP1 models, on
        FSDP2 the type's state_dict/load_state_dict for the block. A literal LOCAL_STATE_DICT stays a TODO."""
        named = named_args(node, ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config"))
        if named is None and self._module_and_mapping(node):
            # ``FSDP.state_dict_type(m, **cfg)``: fsdp_bridge's takes FSDP1's parameter names, so the same mapping
            return self._bridge_state_dict_type(node, short(code_of(node.args[-1]), 40), " (FSDP1's parameter names)")
        if named is None or "module" not in named or "state_dict_type" not in named:
            return False
        type_arg = named["state_dict_type"]
        kind = self._member(type_arg, "StateDictType")
        block = self.stmt_stack[-1] if self.stmt_stack else None
        if (
            kind == "LOCAL_STATE_DICT"
            and isinstance(block, cst.With)
            and len(block.items) == 1
            and block.items[0].item is node
            and block.items[0].asname is None
            and self._takes_no_state_of(block, code_of(named["module"]))
        ):
            # ``with FSDP.state_dict_type(M, LOCAL_STATE_DICT): torch.save(optimizer.state_dict(), f)``:
            # nothing in the block reads M's state dicts, so the type changes nothing there.
            self.unwrap_withs.add(id(block))
            self._consume(node)
            self._note_fsdp1_checkpoint(type_arg)  # what FSDP1 saved here (flat-parameter shards) does not resume
            self._record(
                node,
                "FSDP.state_dict_type(LOCAL_STATE_DICT)",
                f"the block's body without the context: nothing in it takes {short(code_of(named['module']), 30)}'s "
                "state dicts, so the type changes nothing there (an optimizer's own state_dict() is this rank's "
                "state either way: FSDP2's holds DTensor shards)",
                True,
            )
            return True
        if kind not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", None) or (kind is None and self._qn(type_arg)):
            return False
        model = code_of(named["module"])
        part = (
            self._submodule_state_call(block.body, model)
            if kind != "SHARDED_STATE_DICT"  # (a submodule's DTensor shards to DCP load as FSDP1's did)
            and isinstance(block, cst.With)
            and any(item.item is node for item in block.items)
            else None
        )
        if part is not None:
            # FSDP1's context sets the type on every unit under the model, so a submodule that is a unit of its
            # own gave (or took) that type's state; on FSDP2 the bridge's context serves the model's own calls
            self._submodule_state_todo(node, kind or short(code_of(type_arg), 40), model, part)
            return True
        if isinstance(block, cst.With) and any(item.item is node for item in block.items):
            # the context covers its model only: another root's state dicts in it keep FSDP1's default (full)
            self._plan_other_roots(block, model, {})
        return self._bridge_state_dict_type(node, kind or short(code_of(type_arg), 40), "")

    def _bridge_state_dict_type(self, node: cst.Call, shown: str, args_note: str) -> bool:
        """``node`` (FSDP1's ``state_dict_type`` context) -> ``fsdp_bridge.state_dict_type`` with the same
        arguments; ``shown`` is the type as the report names it."""
        self.expr_rewrites[id(node.func)] = "fsdp_bridge.state_dict_type"
        self.needs_imports.add(("fsdp_bridge", None))
        self._consume(node.func)
        self._record(
            node,
            f"FSDP.state_dict_type({shown})",
            f"fsdp_bridge.state_dict_type(...), the same arguments{args_note}: FSDP1's own context on FSDP1 models; "
            "on FSDP2 the model's state_dict() / load_state_dict() and fsdp_bridge.optim_state_dict() give that "
            "type's state inside the block (torch.distributed.checkpoint.state_dict; LOCAL_STATE_DICT refused)",
            True,
        )
        return True

    @staticmethod
    def _module_and_mapping(node: cst.Call) -> bool:
        """``node``'s arguments are the module (first, or ``module=``) and one ``**mapping``."""
        args = list(node.args)
        if len(args) != 2 or args[1].star != "**":
            return False
        first = args[0]
        return not first.star and (first.keyword is None or first.keyword.value == "module")

    def _plan_group_full_block(
        self, node: cst.With, model: str, cfg: cst.BaseExpression | None, optim_cfg: cst.BaseExpression | None
    ) -> None:
        """A FULL_STATE_DICT block with ``rank0_only`` in a tree sharding over process groups of some ranks:
        ``M.state_dict()`` / ``FSDP.optim_state_dict(M, O)`` -> fsdp_bridge's full_state_dict /
        full_optim_state_dict, which keep FSDP1's meaning (each group's first rank)."""
        model_args = (
            f"rank0_only={self._config_flag(cfg, 'rank0_only', False)}, "
            f"offload_to_cpu={self._config_flag(cfg, 'offload_to_cpu', False)}"
        )
        optim_args = (
            f"rank0_only={self._config_flag(optim_cfg, 'rank0_only', False)}, "
            # FullOptimStateDictConfig's offload_to_cpu defaults to True (FullStateDictConfig's to False)
            f"offload_to_cpu={self._config_flag(optim_cfg, 'offload_to_cpu', True)}"
        )
        rewrites: dict[int, str] = {}
        for inner in walk(node.body):
            if not isinstance(inner, cst.Call):
                continue
            func, hit = inner.func, self._qn(inner.func)
            if isinstance(func, cst.Attribute) and hit is None and code_of(func.value) == model:
                if func.attr.value == "state_dict" and not inner.args:
                    rewrites[id(inner)] = f"fsdp_bridge.full_state_dict({model}, {model_args})"
                elif func.attr.value == "load_state_dict":
                    return  # a load in the same block: left to the reference pass (a TODO)
            elif hit == (FSDP, "optim_state_dict") and (mo := self._model_and_own_optim_state(inner)) is not None:
                rewrites[id(inner)] = f"fsdp_bridge.full_optim_state_dict({mo[0]}, {mo[1]}, {optim_args})"
            elif hit is not None and hit[0] == FSDP:
                return
        if rewrites:
            self.needs_imports.add(("fsdp_bridge", None))
            self._plan_other_roots(node, model, rewrites)  # an EMA copy's state_dict() in it: its own default
            self._unwrap_block(node, rewrites, (cfg, optim_cfg), "FULL_STATE_DICT", f": {GROUP_RANK0}")

    def _unwrap_block(
        self,
        node: cst.With,
        rewrites: dict[int, str],
        configs: tuple[cst.BaseExpression | None, ...],
        kind: str,
        why: str,
    ) -> None:
        """A state_dict_type block replaced by its body with ``rewrites`` made in it; the config objects it
        was given, when built in a variable used only there, go with it."""
        self.call_rewrites.update(rewrites)
        self.unwrap_withs.add(id(node))
        self._consume(node.items[0].item)
        for extra in configs:
            value = self._follow(extra, Conversion()) if extra is not None else None
            if value is None or value is extra:
                continue
            # used by this block and others like it (the model's and an EMA copy's): gone with the last of them
            name = cast(cst.Name, extra).value
            self.unwrapped_config_uses[id(value)] = self.unwrapped_config_uses.get(id(value), 0) + 1
            if self.name_uses.get(name, 0) <= 1 + self.unwrapped_config_uses[id(value)]:
                self._consume(value)
        what = ", ".join(sorted({code.split("(")[0] for code in rewrites.values()}))
        full_load = any(
            c.startswith("set_model_state_dict(") and ("full_state_dict=True" in c or "FULL_STATE_DICT" in c)
            for c in rewrites.values()
        )
        self._record(
            node,
            f"FSDP.state_dict_type({kind})",
            f"the block's body with {what}{why}" + (FULL_LOAD_KEYS if full_load else ""),
            True,
        )

    def _takes_no_state_of(self, block: cst.With, model: str) -> bool:
        """Every call in the block's body is one that cannot reach ``model``'s state dicts: ``x.state_dict()``
        of another object, ``torch.save``, ``os``/``os.path``, ``dist.get_rank``-style queries, logging, print."""
        root = model.split(".")[0]
        for n in walk(block.body):
            if isinstance(n, cst.Name) and n.value == root and root != "self":
                return False
            if isinstance(n, cst.Call) and not self._harmless_in_state_block(n):
                return False
        return True

    def _plan_state_dict_block(self, node: cst.With) -> None:
        """``with FSDP.state_dict_type(M, FULL_STATE_DICT|SHARDED_STATE_DICT[, cfg[, optim_cfg]]):`` becomes
        its body, with ``M.state_dict()``, ``M.load_state_dict(x)``, ``FSDP.optim_state_dict(M, O)`` and
        ``O.load_state_dict(FSDP.optim_state_dict_to_load(M, O, x))`` turned into torch's
        ``torch.distributed.checkpoint.state_dict`` calls (which work on FSDP1 and FSDP2 models): the
        user's own ``torch.save`` / DCP code around them keeps working."""
        if len(node.items) != 1 or not isinstance(node.items[0].item, cst.Call):
            return
        call = node.items[0].item
        if self._qn(call.func) != (FSDP, "state_dict_type"):
            return
        named = named_args(call, ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config"))
        if named is None or "module" not in named or "state_dict_type" not in named:
            return
        type_arg = named["state_dict_type"]
        kind = self._member(type_arg, "StateDictType")
        if kind is None and self._qn(type_arg) is not None:
            return  # an FSDP1 name that is not a member: reported by the reference pass
        model = code_of(named["module"])
        cfg = named.get("state_dict_config")
        optim_cfg = named.get("optim_state_dict_config")
        if kind == "LOCAL_STATE_DICT":
            self._plan_local_block(node, model, cfg, optim_cfg)  # saved and loaded per rank: sharded
            return
        if kind not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", None):
            return
        if (guard := self._rank_guard()) is not None and "state_dict(" in code_of(node.body):
            self._consume(call.func)
            self._record(
                call,
                f"FSDP.state_dict_type({kind or code_of(type_arg)})",
                rank_guard_text(guard, f"the state-dict calls of this block on {short(model, 30)}", block=True),
                False,
            )
            return
        if kind != "SHARDED_STATE_DICT" and (part := self._submodule_state_call(node.body, model)) is not None:
            self._submodule_state_todo(call, kind or short(code_of(type_arg), 40), model, part)
            return
        if f"{model}.load_state_dict(" in code_of(node.body) and (owner := self._own_narrow_load_state_dict()):
            self._consume(call.func)
            self._record(
                call,
                f"FSDP.state_dict_type({kind or short(code_of(type_arg), 40)})",
                f"not rewritten: {owner} in this file defines its own load_state_dict, which torch cannot call, and "
                f"the block loads {short(model, 30)}: FSDP1's wrapper loaded through nn.Module's (the override was "
                "never called), while on FSDP2 the model is that class and torch's set_model_state_dict calls its "
                "load_state_dict(state_dict=..., strict=..., assign=...) (a TypeError): name its first parameter "
                "state_dict and give it strict and assign (or **kwargs)",
                False,
            )
            return
        full_save: str | None = None
        full_optim: str | None = None  # FSDP1's every-rank CPU copy of the full optimizer state
        if kind is None or not self._literal_config(cfg) or not self._literal_config(optim_cfg):
            # Type or configs known only at run time: fsdp_bridge translates them when the code runs.
            runtime = ", ".join(code_of(a) for a in (type_arg, cfg, optim_cfg) if a is not None)
            if optim_cfg is not None and cfg is None:
                runtime = f"{code_of(type_arg)}, None, {code_of(optim_cfg)}"
            save_opts = f"fsdp_bridge.state_dict_options({runtime})"
            optim_opts = f"fsdp_bridge.state_dict_options({runtime}, optimizer=True)"
            # over process groups of some ranks each rank loads its own dict (world rank 0's is not sent)
            of_model = f", model={model}" if self.dispatch.group_fsdp is not None else ""
            load_opts = f"fsdp_bridge.state_dict_options({runtime}, load=True{of_model})"
            optim_load_opts = f"fsdp_bridge.state_dict_options({runtime}, optimizer=True, load=True)"
            self.needs_imports.add(("fsdp_bridge", None))
            if kind == "FULL_STATE_DICT" and cfg is not None:
                # A full state whose config is known at run time: FSDP1's rank0_only and offload_to_cpu each
                # as given (torch's options have no every-rank CPU copy: offload_to_cpu=True, rank0_only=False)
                full_save = f"fsdp_bridge.full_state_dict({model}, {self._runtime_flags(cfg)})"
            if kind == "FULL_STATE_DICT" and self.dispatch.group_fsdp is None:
                # the optimizer state as FSDP1's optimizer config gives it (FullOptimStateDictConfig(), also when
                # none is given: every rank a CPU copy, which torch's options cannot say)
                full_optim = (
                    "rank0_only=False, offload_to_cpu=True"
                    if optim_cfg is None or m.matches(optim_cfg, m.Name("None"))
                    else self._runtime_flags(optim_cfg, offload_default="True")
                )
        elif (
            kind == "FULL_STATE_DICT"
            and self.dispatch.group_fsdp is not None
            and (self._config_flag(cfg, "rank0_only", False) or self._config_flag(optim_cfg, "rank0_only", False))
        ):
            self._plan_group_full_block(node, model, cfg, optim_cfg)
            return
        else:
            full = kind == "FULL_STATE_DICT"
            save_opts = self._options(
                full,
                cpu_offload=full and self._config_flag(cfg, "rank0_only", False),
                offload=not full and self._config_flag(cfg, "offload_to_cpu", False),
            )
            optim_opts = self._options(
                full,
                cpu_offload=full and self._config_flag(optim_cfg, "rank0_only", False),
                # ShardedOptimStateDictConfig's offload_to_cpu defaults to True (ShardedStateDictConfig's to False)
                offload=not full and self._config_flag(optim_cfg, "offload_to_cpu", True),
            )
            # A model state taken with rank0_only in the block is whole on rank 0 only (the others get {}): a load
            # of what the block built (sd = model.state_dict(); sd.update(...); model.load_state_dict(sd)) is
            # rank 0's, broadcast; torch's load of a different dict on each rank would pair tensors across ranks.
            load_opts = self._options(full, broadcast=full and self._config_flag(cfg, "rank0_only", False))
            # FSDP1 loads a full optimizer state with rank0_only from rank 0 alone (the other ranks'
            # dicts are ignored, often None) and broadcasts it.
            optim_load_opts = self._options(full, broadcast=full and self._config_flag(optim_cfg, "rank0_only", False))
            if (
                full
                and not self._config_flag(optim_cfg, "rank0_only", False)
                and self._config_flag(optim_cfg, "offload_to_cpu", True)  # FullOptimStateDictConfig's default
                and self.dispatch.group_fsdp is None
            ):
                # every rank a CPU copy of the whole state (FSDP1's default): torch's options have no such form
                # (cpu_offload gives rank 0 alone the state); the bridge gathers one tensor at a time to the CPU
                full_optim = "rank0_only=False, offload_to_cpu=True"
        rewrites: dict[int, str] = {}
        for inner in walk(node.body):
            if not isinstance(inner, cst.Call):
                continue
            func = inner.func
            hit = self._qn(func)
            key = id(inner)  # the call as written (a class-called method below is read as bound)
            if (
                hit in ((FSDP, "state_dict"), (FSDP, "load_state_dict"))
                and inner.args
                and inner.args[0].keyword is None
                and code_of(inner.args[0].value) == model
            ):
                # FSDP.load_state_dict(model, sd): nn.Module's method called through FSDP1's class, as
                # model.load_state_dict(sd) (the state-dict type of the block applies the same)
                bound = cst.Attribute(inner.args[0].value, cst.Name(hit[1]))
                inner = inner.with_changes(func=bound, args=commas(list(inner.args[1:])))
                func, hit = bound, None
            if isinstance(func, cst.Attribute) and hit is None and code_of(func.value) == model:
                if func.attr.value == "state_dict" and not inner.args and full_save is not None:
                    rewrites[key] = full_save
                elif func.attr.value == "state_dict" and not inner.args:
                    self.needs_state_dict_api.add("get_model_state_dict")
                    rewrites[key] = f"get_model_state_dict({model}, options={save_opts})"
                elif (
                    func.attr.value == "load_state_dict"
                    and (load := named_args(inner, ("state_dict", "strict", "assign"))) is not None
                    and set(load) <= {"state_dict", "strict"}
                    and "state_dict" in load
                ):
                    # set_model_state_dict returns the same (missing_keys, unexpected_keys) named tuple
                    self.needs_state_dict_api.add("set_model_state_dict")
                    opts = (
                        load_opts
                        if "strict" not in load
                        else with_option(load_opts, f"strict={code_of(load['strict'])}")
                    )
                    rewrites[key] = f"set_model_state_dict({model}, {code_of(load['state_dict'])}, options={opts})"
            elif hit == (FSDP, "optim_state_dict") and (mo := self._model_and_own_optim_state(inner)) is not None:
                if full_optim is not None:
                    self.needs_imports.add(("fsdp_bridge", None))
                    rewrites[id(inner)] = f"fsdp_bridge.full_optim_state_dict({mo[0]}, {mo[1]}, {full_optim})"
                    continue
                self.needs_state_dict_api.add("get_optimizer_state_dict")
                rewrites[id(inner)] = f"get_optimizer_state_dict({mo[0]}, {mo[1]}, options={optim_opts})"
            elif hit == (FSDP, "optim_state_dict_to_load") and id(inner) not in self.consumed_nodes:
                code = self._optim_to_load(inner, optim_load_opts)
                if code is not None:
                    rewrites[id(inner)] = code
            elif (
                isinstance(func, cst.Attribute)
                and func.attr.value == "load_state_dict"
                and len(inner.args) == 1
                and isinstance(inner.args[0].value, cst.Call)
                and self._qn(inner.args[0].value.func) == (FSDP, "optim_state_dict_to_load")
            ):
                to_load = inner.args[0].value
                if len(to_load.args) >= 3:
                    self.needs_state_dict_api.add("set_optimizer_state_dict")
                    m_, o_, sd = (code_of(a.value) for a in to_load.args[:3])
                    rewrites[id(inner)] = f"set_optimizer_state_dict({m_}, {o_}, {sd}, options={optim_load_opts})"
                    self._consume(to_load)
        if rewrites:
            self._plan_other_roots(node, model, rewrites)
            # Runtime configs stay: the new calls read them.
            configs = () if save_opts.startswith("fsdp_bridge.") else (cfg, optim_cfg)
            saves_model = any("get_model_state_dict(" in r for r in rewrites.values())
            saves_optim = any("get_optimizer_state_dict(" in r for r in rewrites.values())
            if saves_model and saves_optim and optim_opts != save_opts:
                shown = f"{save_opts}, the optimizer's options={optim_opts}"
            elif saves_model or (not saves_optim and not load_opts):
                shown = save_opts
            elif saves_optim:
                shown = optim_opts  # FullOptimStateDictConfig's own flags (offload_to_cpu defaults to True)
            else:
                shown = load_opts  # a block that only loads: its options
            why = f" (torch.distributed.checkpoint.state_dict, options={shown}); your torch.save / DCP code is kept"
            if full_save is not None and any("fsdp_bridge.full_state_dict(" in r for r in rewrites.values()):
                why = (
                    " (the model's full state with the config's rank0_only and offload_to_cpu as FSDP1 reads them "
                    f"when the code runs; other calls: options={save_opts}); your torch.save / DCP code is kept"
                )
            if full_optim is not None and any("fsdp_bridge.full_optim_state_dict(" in r for r in rewrites.values()):
                if full_optim == "rank0_only=False, offload_to_cpu=True":
                    why += (
                        "; the optimizer state as FSDP1's default optimizer config gives it: every rank a CPU copy "
                        "(fsdp_bridge.full_optim_state_dict, one tensor at a time; torch's cpu_offload gives rank 0 "
                        "alone)"
                    )
                else:
                    alone = all("fsdp_bridge.full_optim_state_dict(" in r for r in rewrites.values())
                    why = (
                        " (the optimizer's full state with its config's rank0_only and offload_to_cpu as FSDP1 reads "
                        "them when the code runs, fsdp_bridge.full_optim_state_dict"
                        + ("" if alone else f"; other calls: options={shown}")
                        + "); your torch.save / DCP code is kept"
                    )
            self._unwrap_block(node, rewrites, configs, kind or short(code_of(type_arg), 40), why)

    def _plan_other_roots(self, block: cst.With, model: str, rewrites: dict[int, str]) -> None:
        """Marks ``other.state_dict()`` / ``other.load_state_dict(...)`` in the body of ``model``'s
        state_dict_type block for :meth:`_plan_plain_state_dict`: the context covers ``model`` (and its units)
        only, so an FSDP1 root handed in from elsewhere (an EMA copy) keeps FSDP1's default full state dicts
        there, which --fix must keep once that root is made FSDP2 where it is wrapped. An optimizer's,
        scheduler's or scaler's own, and calls inside the ones rewritten, are left alone."""
        replaced = {id(c) for call in walk(block.body) if id(call) in rewrites for c in walk(call)}
        for inner in walk(block.body):
            if not isinstance(inner, cst.Call) or id(inner) in replaced or not isinstance(inner.func, cst.Attribute):
                continue
            if inner.func.attr.value not in ("state_dict", "load_state_dict") or self._qn(inner.func) is not None:
                continue
            target = code_of(inner.func.value)
            if not re.fullmatch(r"[A-Za-z_][\w.]*", target):
                continue  # a call's result, a subscript: evaluated twice by the written guard
            if target == model or target.startswith(model + ".") or model.startswith(target + "."):
                continue
            if self._made_from(target, model):
                continue  # the context's model, unwrapped: its state dicts take the context's type
            root = inner.func.value
            while isinstance(root, cst.Attribute):
                root = root.value
            quals = self.get_metadata(QualifiedNameProvider, root, set())
            if any(q.source is QualifiedNameSource.IMPORT for q in quals):
                continue  # a module's function (torch.distributed.checkpoint's load_state_dict), not a model's
            if not self._harmless_in_state_block(inner):
                self.other_roots.add(id(inner))

    def _persistent_type(self, node: cst.CSTNode, model: str) -> str | None:
        """The type the last ``FSDP.set_state_dict_type(model, T[, cfg[, optim_cfg]])`` statement above ``node``
        in a block holding it (the function's, or an enclosing one) sets: "SHARDED_STATE_DICT" where the
        configs add nothing (none, or literal without rank0_only nor the model's offload_to_cpu: the call a rewrite
        deletes; the optimizer's offload_to_cpu is followed), "other" for any other such call, None where there is
        none."""
        call = self._last_set_state_dict_type(node, model)
        if call is not None:
            named = named_args(call, ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config"))
            assert named is not None
            plain = all(
                self._literal_config(named.get(k))
                # the optimizer's offload_to_cpu is written out where its state is (_persistent_optim_offload)
                and (k == "optim_state_dict_config" or not self._config_flag(named.get(k), "offload_to_cpu", False))
                and not self._config_flag(named.get(k), "rank0_only", False)
                for k in ("state_dict_config", "optim_state_dict_config")
            )
            sharded = "state_dict_type" in named and (
                self._member(named["state_dict_type"], "StateDictType") == "SHARDED_STATE_DICT"
            )
            return "SHARDED_STATE_DICT" if sharded and plain else "other"
        scope = self.functions[-1] if self.functions else None
        at = self.get_metadata(PositionProvider, node).start
        if isinstance(scope, cst.FunctionDef) and self._wrapper_made_above(scope, at, model):
            return "FULL_STATE_DICT"  # made by FSDP(...) in this function and never set since: FSDP1's default
        return None

    def _persistent_optim_offload(self, node: cst.CSTNode, model: str) -> bool:
        """Whether the optimizer state the last ``FSDP.set_state_dict_type(model, SHARDED_STATE_DICT, ...)`` above
        ``node`` sets is offloaded: FSDP1's ``ShardedOptimStateDictConfig()`` (also when none is given) has
        ``offload_to_cpu=True``."""
        call = self._last_set_state_dict_type(node, model)
        keys = ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config")
        named = named_args(call, keys) if call is not None else None
        cfg = named.get("optim_state_dict_config") if named is not None else None
        if cfg is not None and m.matches(cfg, m.Name("None")):
            cfg = None
        return self._config_flag(cfg, "offload_to_cpu", True)

    def _last_set_state_dict_type(self, node: cst.CSTNode, model: str) -> cst.Call | None:
        """The last ``set_state_dict_type(model, ...)`` statement (FSDP1's, or the bridge's a first ``--fix``
        wrote) above ``node`` in a block holding it (the function's, or an enclosing one)."""
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        if scope is None:
            return None
        at = self.get_metadata(PositionProvider, node).start
        found: tuple[tuple[int, int], cst.Call] | None = None
        for block in walk(scope):
            if not isinstance(block, (cst.IndentedBlock, cst.Module)):
                continue
            span = self.get_metadata(PositionProvider, block)
            if not (span.start.line, span.start.column) <= (at.line, at.column) <= (span.end.line, span.end.column):
                continue
            for stmt in block.body:
                end = self.get_metadata(PositionProvider, stmt).end
                if (end.line, end.column) > (at.line, at.column) or not isinstance(stmt, cst.SimpleStatementLine):
                    continue
                for small in stmt.body:
                    call = small.value if isinstance(small, cst.Expr) else None
                    if not isinstance(call, cst.Call) or (
                        self._qn(call.func) != (FSDP, "set_state_dict_type")
                        and code_of(call.func) != "fsdp_bridge.set_state_dict_type"  # written by a first --fix
                    ):
                        continue
                    named = named_args(
                        call, ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config")
                    )
                    if named is None or "module" not in named or code_of(named["module"]) != model:
                        continue
                    where = (end.line, end.column)
                    if found is None or where > found[0]:
                        found = (where, call)
        return found[1] if found is not None else None

    def _bridge_follows(self) -> bool:
        """Every ``set_state_dict_type`` call of the tree becomes (or is) ``fsdp_bridge.set_state_dict_type``."""
        return (
            self.dispatch.bridge_sets_state_dict_type is not None
            and self.dispatch.unfollowed_set_state_dict_type is None
        )

    def _typed_by_factory(self, node: cst.CSTNode, model: str) -> bool:
        """``model = make(...)`` above ``node`` in its function, where ``make`` is a function of this file that
        calls ``set_state_dict_type(x, ...)`` (FSDP1's or the bridge's) on the ``x`` it returns."""
        scope = self.functions[-1] if self.functions else None
        if scope is None or self.module is None:
            return False
        typing: set[str] = set()
        for fn in self.module.body:
            if not isinstance(fn, cst.FunctionDef):
                continue
            returned = {code_of(n.value) for n in walk(fn) if isinstance(n, cst.Return) and n.value is not None}
            for n in walk(fn):
                if (
                    isinstance(n, cst.Call)
                    and isinstance(n.func, cst.Attribute)
                    and n.func.attr.value == "set_state_dict_type"
                    and (self._qn(n.func) == (FSDP, "set_state_dict_type") or code_of(n.func.value) == "fsdp_bridge")
                    and n.args
                    and code_of(n.args[0].value) in returned
                ):
                    typing.add(fn.name.value)
        if not typing:
            return False
        at = self.get_metadata(PositionProvider, node).start
        for n in walk(scope.body):
            if (
                isinstance(n, cst.Assign)
                and isinstance(n.value, cst.Call)
                and code_of(n.value.func) in typing
                and any(code_of(t.target) == model for t in n.targets)
                and self.get_metadata(PositionProvider, n).end.line <= at.line
            ):
                return True
        return False

    def _wrapper_made_above(self, scope: cst.FunctionDef, at: CodePosition, model: str) -> bool:
        """``model = FSDP(...)`` (or ``wrap(...)``) in a statement of a block holding ``at``, above it."""
        for block in walk(scope.body):
            if not isinstance(block, cst.IndentedBlock):
                continue
            span = self.get_metadata(PositionProvider, block)
            if not (span.start.line, span.start.column) <= (at.line, at.column) <= (span.end.line, span.end.column):
                continue
            for stmt in block.body:
                end = self.get_metadata(PositionProvider, stmt).end
                if (end.line, end.column) > (at.line, at.column) or not isinstance(stmt, cst.SimpleStatementLine):
                    continue
                for small in stmt.body:
                    if (
                        isinstance(small, cst.Assign)
                        and isinstance(small.value, cst.Call)
                        and any(code_of(t.target) == model for t in small.targets)
                        and self._qn(small.value.func) in ((FSDP, ""), ("wrap", ""))
                    ):
                        return True
        return False

    @staticmethod
    def _submodule_state_call(body: cst.CSTNode, model: str) -> cst.Call | None:
        """The first ``model.part.state_dict()`` / ``load_state_dict(...)`` of a submodule in ``body`` (not
        ``model.module``'s: the model itself on FSDP2), or None."""
        for n in walk(body):
            if (
                isinstance(n, cst.Call)
                and isinstance(n.func, cst.Attribute)
                and n.func.attr.value in ("state_dict", "load_state_dict")
                and (owner := code_of(n.func.value)).startswith(model + ".")
                and owner != model + ".module"
            ):
                return n
        return None

    def _submodule_state_todo(self, call: cst.Call, shown: str, model: str, part: cst.Call) -> None:
        """The TODO at FSDP1's ``state_dict_type`` block ``call`` whose body takes a submodule's state."""
        self._record(
            call,
            f"FSDP.state_dict_type({shown})",
            f"not rewritten: {short(code_of(part.func), 50)}(...) inside it is a submodule's: FSDP1's context "
            f"set the type on every unit under {short(model, 30)}, so a submodule wrapped as a unit gave that "
            "type's state (full tensors under FULL_STATE_DICT), while the migrated block serves "
            f"{short(model, 30)}'s own state and FSDP2's submodule state dicts hold DTensor shards. Take the "
            f"whole model's state, get_model_state_dict({short(model, 30)}, options=StateDictOptions("
            "full_state_dict=True, cpu_offload=True)) on every rank, and keep the submodule's keys (their prefix "
            "dropped) on rank 0",
            False,
        )
        self._consume(call.func)
        for a in call.args:  # its arguments belong to this construct (kept with the block)
            self._consume(a.value)

    def _note_rank_forward(self, node: cst.Call) -> None:
        """``model(x)`` / ``model.generate(...)`` of a model shown to be FSDP1's (or handed one) under a test that
        picks ranks (``if rank == 0:``): a TODO. Every unit's all-gather in that forward is a collective the other
        ranks do not join; FSDP1 skipped it only where the unit was still gathered from an earlier forward (its
        root after a forward without backward, which a wrap of the root alone leaves so), while on FSDP2 every
        such forward gathers (the bridge frees what a forward without gradients left gathered), and the other
        ranks hang at their next collective."""
        if self.planning:
            return
        func = node.func
        model = func.value if isinstance(func, cst.Attribute) and func.attr.value == "generate" else func
        if isinstance(model, cst.Attribute) and model.attr.value == "module":
            model = model.value  # model.module(x), model.module.generate(...): FSDP1's inner module, gathered too
        if not isinstance(model, (cst.Name, cst.Attribute)) or (guard := self._rank_body()) is None:
            return
        if isinstance(model, cst.Name) and (
            any(
                q.source in (QualifiedNameSource.IMPORT, QualifiedNameSource.BUILTIN)
                for q in self.get_metadata(QualifiedNameProvider, model, set())
            )
            or any(
                isinstance(n, (cst.FunctionDef, cst.ClassDef)) and n.name.value == model.value
                for n in (walk(self.module) if self.module is not None else ())
            )
        ):
            return  # a function or class (``save_model(model)``), not the model
        root: cst.BaseExpression = model
        while isinstance(root, cst.Attribute):
            root = root.value
        if isinstance(root, cst.Name) and any(
            q.source in (QualifiedNameSource.IMPORT, QualifiedNameSource.BUILTIN)
            for q in self.get_metadata(QualifiedNameProvider, root, set())
        ):
            return  # a library's function (torch.save, torch.ones), not the model
        wrapper = self._fsdp1_wrapper(node, model) in ("fsdp1", "ambiguous")
        source = "" if wrapper else self._module_source(node, model)  # FSDP1's on some path (made by a choice, ...)
        if source.startswith("is read where") and isinstance(model, cst.Attribute):
            # only a guard of another name around it: a method of some object (optimizer.state_dict), not a forward
            source = ""
        if not (wrapper or source != "" or self._handed_parameter(node, model)):
            return
        if self._in_summon():
            return  # inside a gather of the model (reported with it)
        target = short(code_of(model), 30)
        self._record(
            node,
            f"{short(code_of(func), 40)}(...) under {short(guard, 40)}",
            f"not rewritten: a forward of the sharded model on some ranks only: each unit's all-gather in it is a "
            "collective the other ranks do not join. FSDP1 skipped it only where the unit was still gathered from "
            "an earlier forward (the root after a forward without backward: a wrap of the root alone kept the "
            "ranks in step by chance); on FSDP2 every such forward gathers (fsdp_bridge frees the units a forward "
            "without gradients left gathered), so the other ranks hang at their next collective. Run the forward "
            f"on every rank ({target}(...) before the test) and use its result on rank 0",
            False,
        )

    def _rank_body(self) -> str | None:
        """The test of an ``if`` that picks ranks when the current statement is in its body (not in its ``else`` or
        ``elif`` branches, where the test was false), or None."""
        for i, stmt in enumerate(self.stmt_stack[:-1]):
            if isinstance(stmt, cst.If) and _RANK_TEST.search(code_of(stmt.test)):
                inner = self.stmt_stack[i + 1]
                if any(b is inner for b in stmt.body.body):
                    return code_of(stmt.test)
        return None

    def _rank_condition(self, node: cst.CSTNode) -> str | None:
        """A rank test around ``node`` that is not an ``if`` around its statement, or None: ``rank == 0 and
        node`` (or a conditional expression), an earlier ``if <rank test>: return`` in its function, or an ``if``
        testing a name its function assigned from a rank (``r = dist.get_rank()``; ``if r == 0:``)."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        for holder in walk(stmt) if stmt is not None else ():
            if isinstance(holder, (cst.BooleanOperation, cst.IfExp)) and any(n is node for n in walk(holder)):
                tested = holder.left if isinstance(holder, cst.BooleanOperation) else holder.test
                if _RANK_TEST.search(code_of(tested)):
                    return code_of(holder)
        if not self.functions:
            return None
        function = self.functions[-1]
        ranks = {
            t.target.value
            for n in walk(function)
            if isinstance(n, cst.Assign) and _RANK_TEST.search(code_of(n.value))
            for t in n.targets
            if isinstance(t.target, cst.Name)
        }
        for outer in self.stmt_stack:
            if isinstance(outer, cst.If) and any(
                isinstance(n, cst.Name) and n.value in ranks for n in walk(outer.test)
            ):
                return f"if {code_of(outer.test)}:"
        line = self.get_metadata(PositionProvider, node).start.line
        for early in walk(function):
            if (
                isinstance(early, cst.If)
                and self.get_metadata(PositionProvider, early).start.line < line
                and (
                    _RANK_TEST.search(code_of(early.test))
                    or any(isinstance(n, cst.Name) and n.value in ranks for n in walk(early.test))
                )
                and any(isinstance(n, cst.Return) for n in walk(early.body))
                and not any(n is node for n in walk(early))
            ):
                return f"if {code_of(early.test)}: return"
        return None

    def _rank_guard(self) -> str | None:
        """The test of an ``if`` around the current statement that picks ranks (``if rank == 0:``,
        ``if dist.get_rank() == 0:``, ``if is_main_process:``), or None."""
        for stmt in reversed(self.stmt_stack):
            if isinstance(stmt, cst.If) and _RANK_TEST.search(code_of(stmt.test)):
                return code_of(stmt.test)
        return None

    def _unit_of_context_model(self, target: str) -> str | None:
        """The ``FSDP.state_dict_type(model, ...)`` call around the current statement when ``target`` is a
        loop variable over a model's modules inside it (``for m in block.modules():``, ``named_modules()``,
        ``children()``, ``FSDP.fsdp_modules(...)``): it may be a unit of that model, whose type the context sets."""
        loop = next(
            (
                s
                for s in reversed(self.stmt_stack)
                if isinstance(s, cst.For)
                and target in _loop_names(s.target)
                and isinstance(s.iter, cst.Call)
                and (
                    (
                        isinstance(s.iter.func, cst.Attribute)
                        and s.iter.func.attr.value in ("modules", "named_modules", "children", "named_children")
                    )
                    or self._qn(s.iter.func) == (FSDP, "fsdp_modules")
                )
            ),
            None,
        )
        if loop is None:
            return None
        for s in self.stmt_stack:
            if s is loop:
                return None  # the context must hold the loop
            if isinstance(s, cst.With):
                for item in s.items:
                    if isinstance(item.item, cst.Call) and self._qn(item.item.func) == (FSDP, "state_dict_type"):
                        return code_of(item.item)
        return None

    @staticmethod
    def _context_of_another_model(ctx: str, target: str) -> bool:
        """``with make_ctx(model, ...):`` around ``target.state_dict()`` where ``target`` is neither ``model``
        nor reached through it: FSDP1's state_dict_type covers one model (its FSDP units), so another root
        (an EMA copy) keeps its own type there. False where the context's model cannot be read."""
        try:
            expr = cst.parse_expression(ctx)
        except cst.ParserSyntaxError:
            return False
        if not isinstance(expr, cst.Call) or not expr.args:
            return False
        first = expr.args[0]
        if first.keyword is not None and first.keyword.value not in ("module", "model"):
            return False
        if first.star:
            return False
        model = code_of(first.value)
        return target != model and not target.startswith(model + ".") and not model.startswith(target + ".")

    def _runtime_state_context(self) -> str | None:
        """The ``with`` item around the current statement that looks like a state-dict context made
        elsewhere (``with state_dict_ctx:``, ``with get_state_ctx(model):``), or None."""
        for stmt in reversed(self.stmt_stack):
            if not isinstance(stmt, cst.With):
                continue
            for item in stmt.items:
                expr = item.item
                if isinstance(expr, cst.Call) and self._qn(expr.func) is not None:
                    continue  # FSDP.state_dict_type(...) itself: planned with its block, or reported there
                text = code_of(expr)
                if "state_dict" in text.lower() or "state_ctx" in text.lower() or self._made_context(expr):
                    return text
        return None

    def _unimportable_context(self) -> bool:
        """A ``with`` around the current statement calls FSDP1's static method imported from the package, which
        has no such function (``from torch.distributed.fsdp import state_dict_type``: an ImportError, reported at
        the import): nothing rewrites that block."""
        return any(
            isinstance(item.item, cst.Call)
            and any(
                q.name.rsplit(".", 1)[0] == "torch.distributed.fsdp" and q.name.rsplit(".", 1)[-1] in FSDP_METHODS
                for q in self.get_metadata(QualifiedNameProvider, item.item.func, set())
            )
            for stmt in self.stmt_stack
            if isinstance(stmt, cst.With)
            for item in stmt.items
        )

    def _subclass_context(self, ctx: str) -> str | None:
        """The name of this file's subclass of FSDP1's wrapper when ``ctx`` (a ``with`` item's code) is its
        ``state_dict_type(...)``: FSDP1's own context, left as it is with the subclass (its models stay FSDP1's)."""
        owner = ctx.split(".state_dict_type(", 1)[0] if ".state_dict_type(" in ctx else None
        return owner if owner in wrapper_subclasses("\n".join(self.lines)) else None

    def _made_context(self, expr: cst.BaseExpression) -> bool:
        """``expr`` is a state-dict context made elsewhere in this file: a name assigned from
        ``FSDP.state_dict_type(...)`` (or from a call to a function returning one), or such a call."""
        if self.context_makers is None:
            funcs: set[str] = set()
            names: set[str] = set()
            module = self.module

            def makes(value: cst.CSTNode) -> bool:
                return any(
                    isinstance(n, cst.Call)
                    and (self._qn(n.func) == (FSDP, "state_dict_type") or code_of(n.func).split(".")[-1] in funcs)
                    for n in walk(value)
                ) or any(isinstance(n, cst.Name) and n.value in names for n in walk(value))

            for _ in range(3):  # factories calling factories
                for n in walk(module) if module is not None else ():
                    if isinstance(n, cst.Assign) and makes(n.value):
                        names.update(code_of(t.target) for t in n.targets)
                    elif isinstance(n, cst.FunctionDef) and any(
                        (isinstance(r, cst.Return) and r.value is not None and makes(r.value))
                        or (isinstance(r, cst.With) and any(makes(i.item) for i in r.items))
                        for r in walk(n.body)
                    ):
                        funcs.add(n.name.value)
            self.context_makers = (names, funcs)
        names, funcs = self.context_makers
        if isinstance(expr, (cst.Name, cst.Attribute)):
            return code_of(expr) in names
        return isinstance(expr, cst.Call) and code_of(expr.func).split(".")[-1] in funcs


def _loop_names(target: cst.BaseExpression) -> set[str]:
    """The names a ``for`` target binds (``m``; ``name, m``)."""
    return {n.value for n in walk(target) if isinstance(n, cst.Name)}
