"""FSDP1's ``LOCAL_STATE_DICT`` blocks whose model state is saved with ``torch.save`` and loaded back
from ``torch.load``, and the optimizer state taken with ``FSDP.optim_state_dict`` given the optimizer's
own ``state_dict()``.

FSDP1's local state dict is each rank's own shards (its flat parameters, ShardedTensor values), saved
and loaded per rank at the same world size and wrapping. FSDP2's sharded state dict
(``get_model_state_dict(model)``: DTensor values under the parameters' names) is each rank's own
shards too, loadable at the same mesh. Where the block's state dict only goes to ``torch.save`` and
what it loads only comes from ``torch.load``, the block becomes its body with the sharded calls: the
code saves and resumes its own checkpoints as before (FSDP1 local files written earlier stay
unreadable: the checkpoint note says so). FSDP1's ``optim_state_dict`` under ``LOCAL_STATE_DICT`` is
its sharded optimizer state (``full_state_dict`` is only true for ``FULL_STATE_DICT``), and
``LocalOptimStateDictConfig`` keeps it on the device: ``get_optimizer_state_dict`` without options.
The same holds where the state goes to torch.distributed.checkpoint instead (``save_state_dict`` / ``save``
of the state dict, or its in-place ``load_state_dict`` / ``load`` followed by the model's own
``load_state_dict`` in the block): a DCP directory of DTensor shards the migrated code saves and resumes.
Anything else (the state dict returned, kept on an object, handed to code that may read FSDP1's
flat-parameter keys, the model passed elsewhere in the block) stays a TODO saying why."""

from __future__ import annotations

import re
from typing import cast

import libcst as cst
import libcst.matchers as m
from libcst.metadata import PositionProvider, QualifiedNameProvider

from fsdp_bridge.migrate._analysis import code_of, named_args, short, walk
from fsdp_bridge.migrate._names import FSDP, HARMLESS_CALLS
from fsdp_bridge.migrate._render import with_option
from fsdp_bridge.migrate._report import CodeFinding
from fsdp_bridge.migrate._scan_base import ScannerBase

STATE_DICT_TYPE_ARGS = ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config")

LOCAL_CONSTRUCT = "FSDP.state_dict_type(LOCAL_STATE_DICT)"

# torch.distributed.checkpoint's save and in-place load (and their older spellings), which take a state dict as
# it is and write it to, or fill it from, a directory every rank shares
_DCP_MODULES = (
    "torch.distributed.checkpoint",
    "torch.distributed._shard.checkpoint",
    "torch.distributed.checkpoint.state_dict_saver",
    "torch.distributed.checkpoint.state_dict_loader",
)
DCP_SAVES = frozenset(f"{mod}.{f}" for mod in _DCP_MODULES for f in ("save", "save_state_dict"))
DCP_LOADS = frozenset(f"{mod}.{f}" for mod in _DCP_MODULES for f in ("load", "load_state_dict"))


class LocalStateFixer(ScannerBase):
    """LOCAL_STATE_DICT blocks saved and loaded per rank; optimizer state given as the optimizer's own."""

    parent_maps: dict[int, dict[int, cst.CSTNode]] | None = None

    # -- LOCAL_STATE_DICT blocks ---------------------------------------------------------
    def _plan_local_block(
        self, node: cst.With, model: str, cfg: cst.BaseExpression | None, optim_cfg: cst.BaseExpression | None
    ) -> None:
        """``with FSDP.state_dict_type(M, LOCAL_STATE_DICT[, cfg[, optim_cfg]]):`` whose body saves M's state
        with torch.save or loads it from torch.load -> its body with torch's sharded calls; otherwise a TODO
        naming what could not be proved. A body that takes no state of M is left to the context's own plan
        (unwrapped as it is)."""
        call = node.items[0].item
        if self._takes_no_state_of(node, model) or not isinstance(call, cst.Call):
            return
        why = self._local_block_rewrites(node, model, cfg, optim_cfg)
        if why is None:
            return
        self._consume(call)
        text = (
            f"not rewritten: {why}; the block runs only on a model that stays FSDP1's: on one --fix shards with "
            "FSDP2, torch's FSDP.state_dict_type raises when the block ends (KeyError: None), so rewrite it by hand; "
            "FSDP1's LOCAL_STATE_DICT is each rank's flat-parameter shards (keys of "
            "FSDP1's own); FSDP2's sharded state dict (get_model_state_dict(model): DTensor values under the "
            "parameters' names, saved and loaded per rank at the same mesh) replaces it where the state only "
            "goes to torch.save or DCP's save and comes back from torch.load or DCP's in-place load; an existing "
            "local checkpoint: load it in FSDP1, "
            "save it as SHARDED_STATE_DICT, then `fsdp-bridge convert`"
        )
        pos = self.get_metadata(PositionProvider, call)
        self.findings.append(CodeFinding(self.path, pos.start.line, pos.start.column, LOCAL_CONSTRUCT, text, False))
        self.todos.setdefault(id(node), []).append(f"{LOCAL_CONSTRUCT}: {text}")

    def _local_block_rewrites(
        self, node: cst.With, model: str, cfg: cst.BaseExpression | None, optim_cfg: cst.BaseExpression | None
    ) -> str | None:
        """Plan the block's rewrite; None when planned, else why it cannot be. Every LOCAL block on the same
        model in the file is checked first: the migrated code must save and load one format, so when one of
        them stays FSDP1's (a TODO), this one does too."""
        function = self.functions[-1] if self.functions else None
        checked = self._local_block_check(node, model, cfg, optim_cfg, function)
        if isinstance(checked, str):
            return checked
        for other, other_function in self._local_blocks_of(model):
            if other is node:
                continue
            named = named_args(cast(cst.Call, other.items[0].item), STATE_DICT_TYPE_ARGS) or {}
            if self._takes_no_state_of(other, model):
                continue
            why = self._local_block_check(
                other, model, named.get("state_dict_config"), named.get("optim_state_dict_config"), other_function
            )
            if isinstance(why, str):
                # named by its function, not its line: a TODO written above it moves the lines on a second --fix
                where = f"in {other_function.name.value}()" if other_function is not None else "at module level"
                return (
                    f"the LOCAL_STATE_DICT block on {short(model, 30)} {where} in this file stays FSDP1's "
                    f"({why}), and what one block saves the other loads: both are left in FSDP1's format"
                )
        self._apply_local_block(node, model, cfg, optim_cfg, checked)
        return None

    def _local_blocks_of(self, model: str) -> list[tuple[cst.With, cst.FunctionDef | None]]:
        """Every ``with FSDP.state_dict_type(<model>, LOCAL_STATE_DICT...)`` block of the file, with the
        function it is in."""
        found: list[tuple[cst.With, cst.FunctionDef | None]] = []

        def visit(n: cst.CSTNode, function: cst.FunctionDef | None) -> None:
            if isinstance(n, cst.FunctionDef):
                function = n
            if isinstance(n, cst.With) and n.items and isinstance(call := n.items[0].item, cst.Call):
                named = named_args(call, STATE_DICT_TYPE_ARGS)
                if (
                    self._qn(call.func) == (FSDP, "state_dict_type")
                    and named is not None
                    and "module" in named
                    and "state_dict_type" in named
                    and code_of(named["module"]) == model
                    and self._member(named["state_dict_type"], "StateDictType") == "LOCAL_STATE_DICT"
                ):
                    found.append((n, function))
            for child in n.children:
                visit(child, function)

        if self.module is not None:
            visit(self.module, None)
        return found

    def _local_block_check(
        self,
        node: cst.With,
        model: str,
        cfg: cst.BaseExpression | None,
        optim_cfg: cst.BaseExpression | None,
        function: cst.FunctionDef | None,
    ) -> str | list[tuple[cst.Call, str]]:
        """What the block's saves and loads are (nothing changed), or why it cannot be rewritten."""
        if function is None:
            return "the block is not in a function, so where its state goes cannot be followed"
        if not self._literal_config(cfg) or not self._literal_config(optim_cfg):
            return "its configs are known only at run time"
        root = model.split(".")[0]
        planned: list[tuple[cst.Call, str]] = []  # (call, what it is)
        covered: set[int] = set()
        for inner in walk(node.body):
            if id(inner) in covered:
                continue
            if isinstance(inner, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
                return "the block defines code that runs later, which may take the model's state"
            if (isinstance(inner, cst.Name) and inner.value == root and root != "self") or (
                isinstance(inner, cst.Attribute) and code_of(inner) == model
            ):
                return f"{short(model, 30)} is used in the block otherwise than by state_dict() / load_state_dict()"
            if not isinstance(inner, cst.Call):
                continue
            func, hit = inner.func, self._qn(inner.func)
            what: str | None = None
            if isinstance(func, cst.Attribute) and hit is None and code_of(func.value) == model:
                if func.attr.value == "state_dict" and not inner.args:
                    if not self._goes_to_torch_save(inner, function, 0, (model, node)):
                        return (
                            f"{short(model, 30)}.state_dict() goes elsewhere than into torch.save or DCP's save / "
                            "load (returned, kept, or handed to code that may read FSDP1's flat-parameter keys)"
                        )
                    what = "save"
                elif func.attr.value == "load_state_dict":
                    load_args = named_args(inner, ("state_dict", "strict", "assign"))
                    if load_args is None or "state_dict" not in load_args or set(load_args) - {"state_dict", "strict"}:
                        return f"{short(model, 30)}.load_state_dict is given arguments other than (state_dict, strict)"
                    if not self._comes_from_torch_load(load_args["state_dict"], function, 0, (model, node)):
                        return (
                            f"what {short(model, 30)}.load_state_dict loads does not come from torch.load or the "
                            "model's own state filled by DCP's load in this block (it may hold FSDP1's "
                            "flat-parameter keys)"
                        )
                    what = "load"
                else:
                    return f"{short(code_of(func), 40)} may read the model's state"
            elif (
                isinstance(func, cst.Attribute)
                and func.attr.value == "load_state_dict"
                and len(inner.args) == 1
                and isinstance(given := inner.args[0].value, cst.Call)
                and self._qn(given.func) == (FSDP, "optim_state_dict_to_load")
            ):
                to_load = named_args(given, ("model", "optim", "optim_state_dict"))
                if (
                    to_load is None
                    or set(to_load) != {"model", "optim", "optim_state_dict"}
                    or code_of(to_load["model"]) != model
                    or code_of(to_load["optim"]) != code_of(func.value)
                ):
                    return "FSDP.optim_state_dict_to_load is given arguments other than (this model, the optimizer, sd)"
                what = "optim_set"
            elif hit == (FSDP, "optim_state_dict"):
                mo = self._model_and_own_optim_state(inner)
                if mo is None or mo[0] != model:
                    return "FSDP.optim_state_dict is called with arguments other than (this model, an optimizer)"
                what = "optim"
            elif hit == (FSDP, "optim_state_dict_to_load"):
                to_load = named_args(inner, ("model", "optim", "optim_state_dict"))
                if to_load is None or set(to_load) != {"model", "optim", "optim_state_dict"}:
                    return "FSDP.optim_state_dict_to_load is called with arguments other than (model, optim, sd)"
                if code_of(to_load["model"]) != model:
                    return "FSDP.optim_state_dict_to_load is given another model"
                what = "optim_load"
            elif hit is not None:
                return f"the block calls {short(code_of(func), 40)}"
            elif self._dcp(inner, DCP_SAVES | DCP_LOADS) is not None:
                pass  # what it saves or fills is followed from the model's state_dict() above
            elif not self._harmless_in_state_block(inner):
                return f"{short(code_of(func), 40)}(...) may take the model's state"
            if what is not None:
                planned.append((inner, what))
                # The call's own parts (the model, the optimizer) are this construct's; what it loads is
                # checked like the rest of the block.
                covered.update(id(n) for n in walk(inner.func))
                if what == "optim_set":
                    given = cast(cst.Call, inner.args[0].value)
                    covered.update(id(n) for n in walk(given.func))
                    covered.update(id(n) for a in given.args[:2] for n in walk(a.value))
                    covered.add(id(given))
                for a in inner.args:
                    if what in ("save", "optim") or code_of(a.value) == model:
                        covered.update(id(n) for n in walk(a.value))
        if not planned:
            return "nothing in the block saves or loads the model's state with state_dict() / load_state_dict()"
        return planned

    def _apply_local_block(
        self,
        node: cst.With,
        model: str,
        cfg: cst.BaseExpression | None,
        optim_cfg: cst.BaseExpression | None,
        planned: list[tuple[cst.Call, str]],
    ) -> None:
        """Write the checked block's calls as torch's sharded ones."""
        # Sharded options (FSDP1's Local*Config offload_to_cpu -> cpu_offload), imported only when written.
        save = self._options(False, offload=self._config_flag(cfg, "offload_to_cpu", False))
        optim_save = self._options(False, offload=self._config_flag(optim_cfg, "offload_to_cpu", False))
        load = self._options(False)
        rewrites: dict[int, str] = {}
        for inner, what in planned:
            if what == "save":
                self.needs_state_dict_api.add("get_model_state_dict")
                rewrites[id(inner)] = f"get_model_state_dict({model}, options={save})"
            elif what == "load":
                load_args = named_args(inner, ("state_dict", "strict")) or {}
                strict = load_args.get("strict")
                opts = load if strict is None else with_option(load, f"strict={code_of(strict)}")
                self.needs_state_dict_api.add("set_model_state_dict")
                sd = code_of(load_args["state_dict"])
                rewrites[id(inner)] = f"set_model_state_dict({model}, {sd}, options={opts})"
            elif what == "optim":
                mo = self._model_and_own_optim_state(inner)
                assert mo is not None  # checked above
                self.needs_state_dict_api.add("get_optimizer_state_dict")
                rewrites[id(inner)] = f"get_optimizer_state_dict({mo[0]}, {mo[1]}, options={optim_save})"
            elif what == "optim_set":
                given = cast(cst.Call, inner.args[0].value)
                m_, o_, sd_ = (code_of(a.value) for a in given.args)
                self.needs_state_dict_api.add("set_optimizer_state_dict")
                rewrites[id(inner)] = f"set_optimizer_state_dict({m_}, {o_}, {sd_}, options={load})"
                self._consume(given)
            else:
                code = self._optim_to_load(inner, load)
                if code is not None:
                    rewrites[id(inner)] = code
        why = (
            f" (torch.distributed.checkpoint.state_dict, options={save}): FSDP1's LOCAL_STATE_DICT was each rank's "
            "own flat-parameter shards, FSDP2's sharded state dict is each rank's own shards (DTensor values under "
            "the parameters' names); the torch.save / torch.load (or DCP save / load) around it is kept, and the "
            "checkpoints the migrated "
            "code writes load back at the same world size (FSDP1 local files written before do not)"
        )
        self._unwrap_block(node, rewrites, (cfg, optim_cfg), "LOCAL_STATE_DICT", why)
        return None

    def _harmless_in_state_block(self, call: cst.Call) -> bool:
        """A call that cannot reach a model's state dicts: ``x.state_dict()`` of an optimizer, scheduler or
        scaler, ``torch.save`` / ``torch.load``, ``os``/``os.path``, ``dist.get_rank``-style queries, logging,
        print."""
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value in ("state_dict", "load_state_dict"):
            # An optimizer's, scheduler's or scaler's own: not the model's, its owner's (self.model ->
            # self), a part of it, or an object that may hold it (an engine, a trainer).
            if func.attr.value == "state_dict" and call.args:
                return False
            return bool(
                re.search(r"opt|sched|^sch$|_sch$|^lr_|scaler", code_of(func.value).split(".")[-1], re.IGNORECASE)
            )
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, func, set())}
        code = code_of(func)
        if names & HARMLESS_CALLS or "torch.load" in names or any(q.startswith(("os.", "logging.")) for q in names):
            return True
        return code.split(".")[0] in ("logger", "log", "logging") or code.startswith(("self.logger.", "os.path."))

    # -- following a value inside its function -------------------------------------------
    def _parent_of(self, node: cst.CSTNode, function: cst.FunctionDef) -> cst.CSTNode | None:
        if self.parent_maps is None:
            self.parent_maps = {}
        parents = self.parent_maps.get(id(function))
        if parents is None:
            parents = {id(child): n for n in walk(function) for child in n.children}
            self.parent_maps[id(function)] = parents
        return parents.get(id(node))

    def _is_torch(self, call: cst.CSTNode, name: str) -> bool:
        return isinstance(call, cst.Call) and any(
            q.name == name for q in self.get_metadata(QualifiedNameProvider, call.func, set())
        )

    def _dcp(self, call: cst.CSTNode | None, names: frozenset[str]) -> cst.BaseExpression | None:
        """The state dict given to ``call`` where it is one of torch.distributed.checkpoint's ``names``
        (first positional or ``state_dict=``); None for any other call."""
        if not isinstance(call, cst.Call) or not any(
            q.name in names for q in self.get_metadata(QualifiedNameProvider, call.func, set())
        ):
            return None
        if call.args and call.args[0].keyword is None and not call.args[0].star:
            return call.args[0].value
        return next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "state_dict"), None)

    def _into_own_load(self, call: cst.CSTNode | None, arg: cst.Arg, within: tuple[str, cst.With] | None) -> bool:
        """``call`` is ``<model>.load_state_dict(arg)`` inside the LOCAL block ``within`` (the model's own state,
        filled in place by DCP's load, given back to it)."""
        if within is None or not isinstance(call, cst.Call) or not isinstance(call.func, cst.Attribute):
            return False
        model, block = within
        return (
            call.func.attr.value == "load_state_dict"
            and code_of(call.func.value) == model
            and (call.args[0] is arg if arg.keyword is None else arg.keyword.value == "state_dict")
            and any(n is call for n in walk(block.body))
        )

    def _goes_to_torch_save(
        self, expr: cst.CSTNode, function: cst.FunctionDef, depth: int, within: tuple[str, cst.With] | None = None
    ) -> bool:
        """``expr``'s value only reaches ``torch.save`` (as the object saved) or DCP's save or in-place load
        (as the state dict): passed to it, put in a dict literal that goes there, or kept in a local variable
        (or its items) that only goes there and, filled by DCP's load, back to the model's ``load_state_dict``
        in the LOCAL block ``within``."""
        parent = self._parent_of(expr, function)
        if depth > 3 or parent is None:
            return False
        if isinstance(parent, cst.Arg):
            call = self._parent_of(parent, function)
            if self._into_own_load(call, parent, within):
                return True
            if any(self._dcp(call, names) is expr for names in (DCP_SAVES, DCP_LOADS)):
                return True
            return (
                isinstance(call, cst.Call)
                and self._is_torch(call, "torch.save")
                and (call.args[0] is parent if parent.keyword is None else parent.keyword.value == "obj")
            )
        if isinstance(parent, cst.DictElement) and parent.value is expr:
            outer = self._parent_of(parent, function)
            return isinstance(outer, cst.Dict) and self._goes_to_torch_save(outer, function, depth + 1, within)
        if isinstance(parent, cst.Assign) and parent.value is expr and len(parent.targets) == 1:
            target = parent.targets[0].target
            held = target.value if isinstance(target, cst.Subscript) else target
            return isinstance(held, cst.Name) and self._only_saved(held.value, function, depth, within)
        return False

    def _only_saved(
        self, name: str, function: cst.FunctionDef, depth: int, within: tuple[str, cst.With] | None = None
    ) -> bool:
        """The local variable ``name`` is only filled (``name = ...``, ``name[k] = ...``, ``name.update(...)``)
        and saved with ``torch.save`` or DCP (or filled by DCP's load and given back to the model in the
        block ``within``)."""
        params = function.params
        if any(p.name.value == name for p in (*params.params, *params.kwonly_params, *params.posonly_params)):
            return False
        saved = filled = given_back = False
        for n in walk(function.body):
            if not isinstance(n, cst.Name) or n.value != name:
                continue
            parent = self._parent_of(n, function)
            if isinstance(parent, cst.Attribute) and parent.attr is n:
                continue  # x.name: another object's attribute
            if isinstance(parent, cst.Arg) and parent.keyword is n:
                continue
            if isinstance(parent, cst.AssignTarget):
                continue
            if isinstance(parent, cst.Subscript) and isinstance(self._parent_of(parent, function), cst.AssignTarget):
                continue
            if isinstance(parent, cst.Attribute) and parent.attr.value == "update":
                if isinstance(call := self._parent_of(parent, function), cst.Call) and call.func is parent:
                    continue
            if self._goes_to_torch_save(n, function, depth + 1, within):
                saved = True
                if isinstance(parent, cst.Arg):
                    call = self._parent_of(parent, function)
                    filled = filled or self._dcp(call, DCP_LOADS) is n
                    given_back = given_back or self._into_own_load(call, parent, within)
                continue
            return False
        # what DCP's load fills in place counts only once it is given back to the model in the block
        return saved and (given_back or not filled)

    def _comes_from_torch_load(
        self,
        expr: cst.BaseExpression,
        function: cst.FunctionDef,
        depth: int,
        within: tuple[str, cst.With] | None = None,
    ) -> bool:
        """``expr`` is ``torch.load(...)``, an item of one, or a local variable assigned only from those, or
        (in the LOCAL block ``within``) only from the model's own ``state_dict()`` there, which DCP's load fills
        in place."""
        if depth > 3:
            return False
        if self._is_torch(expr, "torch.load"):
            return True
        if isinstance(expr, cst.Subscript):
            return self._comes_from_torch_load(expr.value, function, depth + 1)
        if not isinstance(expr, cst.Name):
            return False
        name = expr.value
        params = function.params
        if any(p.name.value == name for p in (*params.params, *params.kwonly_params, *params.posonly_params)):
            return False
        values = []
        for n in walk(function.body):
            if isinstance(n, cst.Assign) and any(m.matches(t.target, m.Name(name)) for t in n.targets):
                values.append(n.value)
            elif isinstance(n, (cst.AugAssign, cst.AnnAssign, cst.NamedExpr, cst.For, cst.CompFor)) and any(
                m.matches(t, m.Name(name)) for t in walk(n.target)
            ):
                return False
            elif isinstance(n, cst.AsName) and any(m.matches(t, m.Name(name)) for t in walk(n.name)):
                return False  # with ... as name / except ... as name
        if values and within is not None and all(self._own_state_in(v, within) for v in values):
            return True
        return bool(values) and all(self._comes_from_torch_load(v, function, depth + 1) for v in values)

    def _own_state_in(self, value: cst.BaseExpression, within: tuple[str, cst.With]) -> bool:
        """``value`` is ``<model>.state_dict()`` written inside the block."""
        model, block = within
        return self._is_own_state(value, model) and any(n is value for n in walk(block.body))

    # -- the optimizer's own state -------------------------------------------------------
    def _model_and_own_optim_state(self, call: cst.Call) -> tuple[str, str] | None:
        """``FSDP.optim_state_dict(model, optim[, optim_state_dict][, group=None])`` where
        ``optim_state_dict`` is ``optim.state_dict()`` (inline, or a variable assigned so by the statement just
        above the call's): FSDP1's default for that argument, so the call is ``(model, optim)``'s."""
        named = named_args(call, ("model", "optim", "optim_state_dict", "group"))
        if named is None or not {"model", "optim"} <= set(named):
            return None
        if "group" in named and not m.matches(named["group"], m.Name("None")):
            return None
        model, optim = code_of(named["model"]), code_of(named["optim"])
        given = named.get("optim_state_dict")
        if given is None or m.matches(given, m.Name("None")) or self._is_own_state(given, optim):
            return model, optim
        if isinstance(given, cst.Name) and self._assigned_just_above(call, given.value, optim):
            return model, optim
        return None

    @staticmethod
    def _is_own_state(expr: cst.BaseExpression, optim: str) -> bool:
        """``expr`` is ``<optim>.state_dict()`` (an optimizer's, or a model's: ``optim`` is its source)."""
        return (
            isinstance(expr, cst.Call)
            and not expr.args
            and isinstance(expr.func, cst.Attribute)
            and expr.func.attr.value == "state_dict"
            and code_of(expr.func.value) == optim
        )

    def _assigned_just_above(self, call: cst.Call, name: str, optim: str) -> bool:
        """The statement just above the one holding ``call``, in the same block, is ``name = optim.state_dict()``."""
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        if scope is None:
            return False
        for block in walk(scope):
            if not isinstance(block, (cst.IndentedBlock, cst.Module)):
                continue
            body = list(block.body)
            for i, stmt in enumerate(body):
                if i == 0 or not isinstance(stmt, cst.SimpleStatementLine):
                    continue
                if not any(n is call for n in walk(stmt)):
                    continue
                above = body[i - 1]
                return (
                    isinstance(above, cst.SimpleStatementLine)
                    and len(above.body) == 1
                    and isinstance(assign := above.body[0], cst.Assign)
                    and len(assign.targets) == 1
                    and m.matches(assign.targets[0].target, m.Name(name))
                    and self._is_own_state(assign.value, optim)
                )
        return False
