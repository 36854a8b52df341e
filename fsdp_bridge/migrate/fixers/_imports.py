"""FSDP1 names used as values: imports, ``isinstance`` checks, attributes of the wrapper, private
FSDP1 modules, the config classes kept for the bridge to read, mocks of the wrapper."""

from __future__ import annotations

import itertools
import os
import re
from typing import cast

import libcst as cst
import libcst.matchers as m
from libcst.metadata import PositionProvider, QualifiedNameProvider

from fsdp_bridge.migrate._analysis import code_of, short, walk
from fsdp_bridge.migrate._names import (
    CONFIG_DRIVEN,
    FSDP,
    FSDP_METHODS,
    INTERNAL_ATTRS,
    KEPT,
    MOCKS,
    NAME_HELPERS,
    NAMES,
    SCALER_TEXT,
    WRAPPER_ATTRS,
    fsdp2_text,
    keep_low_precision_text,
    private_text,
)
from fsdp_bridge.migrate._report import CodeFinding
from fsdp_bridge.migrate._scan_base import ScannerBase
from fsdp_bridge.migrate.fixers._no_sync_clip import unproven_text

WRAPPER_METHODS = ("check_is_root",)
"""FSDP1 wrapper methods FSDPModule lacks, reported where called on an object shown to be the wrapper."""

SETTINGS = {
    "sharding_strategy": "torch's ShardingStrategy member, NO_SHARD when the shard group has one rank as with FSDP1",
    "mixed_precision": "torch's MixedPrecision, with None fields when none was set as with FSDP1",
}
"""Wrapper attributes ``fsdp_bridge.fsdp1_settings`` answers (for the model shard() returned or any unit in it,
on either backend) and what it gives."""

PRIVATE_IDIOMS = ("_has_params", "_handle", "_reshard", "_unshard")
"""FSDP1 internals whose idioms (``if m._has_params and m.sharding_strategy ...: _reshard(m, m._handle, ...)``)
another fixer treats as a whole: a setting read in the same statement or condition is left to it."""

IS_SHARDED = (
    "True for models sharded by fsdp_bridge.shard on either backend, every unit in them, and FSDP1 wrappers; "
    "DDP and modules sharded with torch's own fully_shard keep their own paths"
)

SHARDED_MODULE = (
    "isinstance(m, fsdp_bridge.ShardedModule) is fsdp_bridge.is_sharded(m): models sharded by fsdp_bridge.shard on "
    "either backend, their units and FSDP1 wrappers; --target torch writes FSDPModule"
)

TYPING_FORMS = {"Union", "Optional", "Annotated"}
"""``typing``'s (and ``typing_extensions``') subscripted forms whose elements are types a value is checked
against: FSDP1's class inside one is the type of a sharded model."""

UNITTEST_ASSERTS = {"assertIsInstance": "assertTrue", "assertNotIsInstance": "assertFalse"}
"""unittest's type assertions and the assertion each becomes around ``fsdp_bridge.is_sharded``."""


def _parameters(func: cst.FunctionDef) -> list[str]:
    """The names of ``func``'s positional parameters, in order."""
    return [p.name.value for p in (*func.params.posonly_params, *func.params.params)]


def class_elements(expr: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The classes of ``isinstance``'s second argument: a tuple (nested too) or a ``|`` union."""
    if isinstance(expr, cst.Tuple):
        return [x for e in expr.elements for x in class_elements(e.value)]
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.BitOr):
        return [*class_elements(expr.left), *class_elements(expr.right)]
    return [expr]


FSDP1_MODEL_FUNCTIONS = (
    "state_dict_type",
    "set_state_dict_type",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "full_optim_state_dict",
    "sharded_optim_state_dict",
    "summon_full_params",
)
"""FSDP1's static functions whose first argument is the model."""


class ImportsFixer(ScannerBase):
    """FSDP1 names used as values, imports and isinstance checks."""

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        module = code_of(node.module) if node.module else ""
        if module.startswith("torch.distributed.fsdp"):
            self.uses_fsdp1 = True
        if module == "torch.distributed.fsdp" and not self.planning and not isinstance(node.names, cst.ImportStar):
            for alias in node.names:
                name = code_of(alias.name)
                if name in FSDP_METHODS:  # FSDP1's static methods, never functions of the package
                    self._record(
                        alias,
                        f"from torch.distributed.fsdp import {name}",
                        f"not rewritten: torch.distributed.fsdp has no {name} (the import raises ImportError, so the "
                        f"file does not run as written); FSDP1's is the static method FullyShardedDataParallel."
                        f"{name}: call it so (FSDP.{name}(...)) and run the migration again, which rewrites it",
                        False,
                    )
        return False

    def _fsdp1_internal(self, node: cst.Attribute) -> bool:
        """``node`` reads one of FSDP1's internals (``INTERNAL_ATTRS``) in a file using FSDP1; ``_local_shard`` only
        where no class of the file keeps an attribute of that name itself (a hand-written sharded optimizer's)."""
        name = node.attr.value
        if name not in INTERNAL_ATTRS or not self.uses_fsdp1 or name in self.dispatch.own_attributes:
            return False  # not FSDP1's, or a name a class of the tree keeps itself
        return name != "_local_shard" or re.search(r"\bself\._local_shard\s*=", self.code) is None

    def _reference(self, node: cst.BaseExpression) -> bool:
        if self.planning:
            if self._qn(node) is not None:
                # FSDP1's names spelled out (torch.distributed.fsdp.FullyShardedDataParallel) without a
                # ``from torch.distributed.fsdp import``: FSDP1 code from the file's first line, as an import makes it
                self.uses_fsdp1 = True
            return True
        if (region := self._in_region(node)) is not None:
            if isinstance(node, cst.Attribute) and self._fsdp1_internal(node):
                self._record(node, f"{code_of(node)} (an FSDP1 internal)", region.text(), True)
                return True
            if (hit := self._qn(node)) is None:
                if self.uses_fsdp1 and (private := self._private(node)) is not None:
                    self._record(node, f"{code_of(node)} ({private})", region.text(), True)
                    return False
                return True
            self.uses_fsdp1 = True
            self._record(node, f"FSDP.{hit[1]}" if hit[0] == FSDP and hit[1] else code_of(node), region.text(), True)
            return False
        if isinstance(node, cst.Attribute) and self._fsdp1_internal(node):
            if node.attr.value == "_fsdp_wrapped_module" and not self.assign_target_depth:
                # the inner module: FSDP1's on the fsdp1 backend, the module itself on FSDP2
                self._rewrite_wrapped_module(node, "an FSDP1 internal", "the fsdp1 backend's units")
                return True  # what it holds is rewritten too (a forwarded read inside it)
            self._record(node, f"{code_of(node)} (an FSDP1 internal)", INTERNAL_ATTRS[node.attr.value], False)
            return True
        if (
            isinstance(node, cst.Attribute)
            and node.attr.value in WRAPPER_ATTRS
            and self.uses_fsdp1
            and not self.assign_target_depth
            and (id(node) not in self.called or node.attr.value in WRAPPER_METHODS)
            and id(node) not in self.consumed_nodes
            and self._qn(node) is None
            and (
                (wrapper := self._fsdp1_wrapper(node, node.value)) != ""
                or (wrapper := self._given_to_fsdp1_api(node.value)) != ""
            )
        ):
            stmt = self.stmt_stack[-1] if self.stmt_stack else None
            test = stmt.test if isinstance(stmt, (cst.If, cst.While)) else stmt
            if (
                node.attr.value in SETTINGS
                and wrapper == "fsdp1"
                and not (test is not None and any(name in code_of(test) for name in PRIVATE_IDIOMS))
            ):
                code = f"fsdp_bridge.fsdp1_settings({code_of(node.value)}).{node.attr.value}"
                self.expr_rewrites[id(node)] = code
                self.needs_imports.add(("fsdp_bridge", None))
                what = SETTINGS[node.attr.value]
                self._record(node, f"{code_of(node)} (an FSDP1 wrapper attribute)", f"{code} ({what})", True)
                return True
            self._record(
                node,
                f"{code_of(node)} (an FSDP1 wrapper attribute)",
                f"not rewritten: FSDPModule has no {node.attr.value}; {WRAPPER_ATTRS[node.attr.value]}"
                + (f" ({short(code_of(node.value), 30)} is {wrapper})" if wrapper.startswith("given ") else ""),
                False,
            )
            return True
        if (
            isinstance(node, cst.Attribute)
            and node.attr.value == "module"
            and self.uses_fsdp1
            and not (self.assign_target_depth and self._assigned_here(node))  # x.module.name = v reads x.module
            and id(node) not in self.called
            and (
                (wrapper := self._fsdp1_wrapper(node, node.value)) != ""
                or (source := self._module_source(node, node.value)) != ""
            )
        ):
            # FSDP1's wrapper holds the model as .module; FSDP2 does not wrap (the sharded model is the module).
            obj = code_of(node.value)
            if self._guarded_already(node, obj):
                return True  # written by a first --fix
            if self._plan_recursive_unwrap(node, obj):
                return True
            if (
                wrapper == "fsdp1"
                and (method := self._module_state_dict_read(node)) is not None
                and not self._other_path_above(node, node.value)
            ):
                # (where it may be another wrapper too the forms below keep that wrapper's .module.state_dict())
                self._record(
                    node,
                    f"{code_of(node)}.{method}() (the wrapped module's own state dict)",
                    f"not rewritten: outside summon_full_params FSDP1's wrapped module holds this rank's flat shard "
                    f"(use_orig_params=False: a `_flat_param` key; True: this rank's views), so {short(obj, 30)}.module"
                    f".{method}() never took the model's weights but this rank's shard in FSDP1's layout, which "
                    "FSDP2 has no form of (its module's own state_dict() gives DTensor shards by parameter name). "
                    "For the full weights call "
                    + (
                        f"get_model_state_dict({short(obj, 30)}, options=StateDictOptions(full_state_dict=True, "
                        "cpu_offload=True)) on every rank (rank 0 gets them; fsdp_bridge.full_state_dict takes FSDP1 "
                        "models too), then save on rank 0"
                        if method == "state_dict"
                        else f"set_model_state_dict({short(obj, 30)}, sd, options=StateDictOptions("
                        "full_state_dict=True)) on every rank; a checkpoint of FSDP1's flat shards loads only into "
                        "FSDP1 at the same world size (save it again from FSDP1 as a full state dict)"
                    ),
                    False,
                )
                return True
            if (self._under_hasattr_module(node, obj) or not self._bare_in_other_branch(node, obj)) and (
                read := self._unwrapped_state_dict(node, obj)
            ) is not None:
                # a TODO at the state dict (the unwrap's own rewrite below runs after --fix; the state dict is wrong)
                name, call, line, choice = read
                construct = f"{name}.state_dict() after {name} = {short(choice, 80)}"
                text = " ".join(
                    (
                        f"not rewritten: on FSDP1 {name} is the wrapped module, whose state_dict() outside "
                        "summon_full_params holds this rank's flat shard (use_orig_params=False: a `_flat_param` key; "
                        "True: this rank's views), never the model's weights (and where nested units hold the "
                        "parameters, their state-dict hooks gather: a collective, which on one rank alone hangs); on "
                        "FSDP2 it is the sharded model "
                        "itself, whose state_dict() gives DTensor shards. For the full weights call "
                        f"get_model_state_dict({short(obj, 30)}, options=StateDictOptions(full_state_dict=True, "
                        "cpu_offload=True)) on every rank (rank 0 gets them; fsdp_bridge.full_state_dict takes FSDP1 "
                        "models too), then save on rank 0"
                    ).split()
                )
                pos = self.get_metadata(PositionProvider, call).start
                self.findings.append(CodeFinding(self.path, pos.line, pos.column, construct, text, False))
                self.todos.setdefault(id(line), []).append(f"{construct}: {text}")
            if self._under_hasattr_module(node, obj):
                self._record(
                    node,
                    f"{code_of(node)} (the wrapped module)",
                    f"kept as is: it runs under hasattr({short(obj, 30)}, \"module\"), which FSDP1's (and DDP's) "
                    "wrapper passes; an FSDP2 module does not wrap, has no .module and takes the other branch",
                    True,
                )
                return True
            if self._bare_in_other_branch(node, obj):
                self._record(
                    node,
                    f"{code_of(node)} (the wrapped module)",
                    f"kept as is: the other branch of its conditional expression takes {short(obj, 30)} itself, "
                    "FSDP1's wrapper on the FSDP path, so this branch is another path's wrapper (DDP's), whose "
                    ".module stays",
                    True,
                )
                return True
            guarded: tuple[str, str] | None = None
            if wrapper == "ambiguous" and re.search(
                r"(?<!Distributed)\bDataParallel\b", "\n".join(line.split("#", 1)[0] for line in self.lines)
            ):
                # the file uses DataParallel too, whose .module the DDP test below would not keep (under --target
                # torch the unwrap becomes the model itself): the form that keeps any other wrapper's .module
                wrapper = ""
                source = "may be DistributedDataParallel's or DataParallel's wrapper, or FSDP1's"
            if wrapper == "":
                # Shown FSDP1's on some path only (made by a function of the tree, handed by a call of it): other
                # paths may bring another wrapper (DDP's, DeepSpeed's engine), whose .module stays.
                guarded = (
                    f"(fsdp_bridge.unwrapped({obj}) if fsdp_bridge.is_sharded({obj}) else {obj}.module)",
                    f"{obj} {source}: its module on a model that stays FSDP1's, the module itself on FSDP2 (it does "
                    "not wrap), and the .module of anything else (DDP's wrapper, DeepSpeed's engine)",
                )
            elif wrapper == "ambiguous":
                # DDP's wrapper keeps .module; FSDP2's sharded model is the module itself.
                guarded = (
                    f"({obj}.module if isinstance({obj}, torch.nn.parallel.DistributedDataParallel) "
                    f"else fsdp_bridge.unwrapped({obj}))",
                    f"{obj} may be DistributedDataParallel's wrapper (its .module) or, on the FSDP path, the module "
                    "inside FSDP1's wrapper (the bridge's fsdp1 backend, or a model FSDP1 wrapped elsewhere), the "
                    "module itself on FSDP2 (it does not wrap)",
                )
            if guarded is not None:
                code, why = guarded
                stmt = self.stmt_stack[-1] if self.stmt_stack else None
                if stmt is not None and code[1:-1] in code_of(stmt):
                    return True  # written by a first --fix
                self.expr_rewrites[id(node)] = code
                self.needs_imports.add(("fsdp_bridge", None))
                if "torch.nn.parallel" in code:
                    self.needs_imports.add(("torch", None))
                self._record(node, f"{code_of(node)} (the wrapped module)", f"{code}: {why}", True)
                self._note_module_set_after_wrap(node)
                return True
            if (kept := self.dispatch.subclasses_fsdp1) is not None:
                kept = "this file" if kept == self.path else kept
                # the tree keeps a subclass of FSDP1's wrapper (a TODO): its models stay FSDP1's and reach here
                code = f"fsdp_bridge.unwrapped({obj})"
                self.expr_rewrites[id(node)] = code
                self.needs_imports.add(("fsdp_bridge", None))
                self._record(
                    node,
                    f"{code_of(node)} (the wrapped module)",
                    f"{code}: {kept} keeps a subclass of FSDP1's wrapper, whose models stay FSDP1's: the module "
                    "inside the wrapper there, the module itself on FSDP2 (it does not wrap)",
                    True,
                )
                return True
            if id(node) in self.forwarded_reads:
                # X.module.name: FSDP1's wrapper hands a name it does not define to the module it wraps
                self.attr_drops.add(id(node))
                self._record(
                    node,
                    f"{code_of(node)} (the wrapped module)",
                    f"{obj}: FSDP2 does not wrap, the sharded model is the module itself (FSDPModule has no .module; "
                    f"FSDP1's wrapper hands .{self.forwarded_reads[id(node)]} to the module it wraps)",
                    True,
                )
                return True
            # The model may stay FSDP1's (the bridge's fsdp1 backend, or wrapped by a library outside the tree)
            code = f"fsdp_bridge.unwrapped({obj})"
            self.expr_rewrites[id(node)] = code
            self.needs_imports.add(("fsdp_bridge", None))
            self._record(
                node,
                f"{code_of(node)} (the wrapped module)",
                f"{code}: the module inside FSDP1's wrapper (the bridge's fsdp1 backend, or a model FSDP1 wrapped "
                "elsewhere), the module itself on FSDP2 (it does not wrap)",
                True,
            )
            return True
        if (
            isinstance(node, cst.Attribute)
            and node.attr.value == "no_sync"
            and id(node) not in self.called
            and self.uses_fsdp1
            and not self.assign_target_depth
            and id(node) not in self.consumed_nodes
            and code_of(node.value) != "fsdp_bridge"
            and not self._ddp_tested(node.value)
            and not any(
                q.name.startswith(("torch.nn", "fsdp_bridge"))
                for q in self.get_metadata(QualifiedNameProvider, node, set())
            )
        ):
            # ``ctx = model.no_sync`` (called later as ``ctx()``): FSDPModule has no no_sync.
            if self._bound_called_with_args():
                return True  # ctx(model) later: another object's no_sync (accelerate's takes the model), not FSDP1's
            recv = code_of(node.value)
            wrapper = self._fsdp1_wrapper(node, node.value, by_calls=False) or self._handed_fsdp1(node.value)
            if "no_sync" in self.dispatch.own_methods and wrapper != "fsdp1":
                if recv == "self" and self.classes:
                    return True  # the class's own method
                where = self.dispatch.own_methods["no_sync"]
                where = "this file" if where == self.path else os.path.relpath(where, os.path.dirname(self.path) or ".")
                self._record(
                    node,
                    f"{short(recv, 40)}.no_sync (not called here)",
                    f"not rewritten: this tree defines its own no_sync (in {where}), so this may be that one; if "
                    f"{short(recv, 40)} is the FSDP1-wrapped model, write functools.partial(fsdp_bridge.no_sync, "
                    f"{short(recv, 40)}) (it takes any module); if it is your own, keep it",
                    False,
                )
                return True
            if wrapper == "":  # nothing shows whose no_sync this is: another object's must stay as it is
                text = unproven_text(recv, "no_sync", bound=True)
                self._record(node, f"{short(recv, 40)}.no_sync (not called here)", text, False)
                return True
            code = f"functools.partial(fsdp_bridge.no_sync, {recv})"
            self.expr_rewrites[id(node)] = code
            self.needs_imports.update({("functools", None), ("fsdp_bridge", None)})
            self._record(
                node,
                f"{code_of(node)} (not called here)",
                f"{code}: calling it gives fsdp_bridge.no_sync({code_of(node.value)}); " + fsdp2_text("no_sync"),
                True,
            )
            return True
        hit = self._qn(node)
        if hit is None:
            if self.uses_fsdp1 and (private := self._private(node)) is not None:
                if private.rsplit(".", 1)[-1] in NAME_HELPERS:
                    text = (
                        "kept: FSDP1's parameter-name prefix helper still works; FSDP2 names have no wrapper "
                        "prefix, so it changes nothing there"
                    )
                    self._record(node, f"{code_of(node)} ({private})", text, True)
                else:
                    self._record(node, f"{code_of(node)} ({private})", private_text(private), False)
                return False
            return True
        self.uses_fsdp1 = True
        if id(node) in self.consumed_nodes:
            return False
        kind, member = hit
        tested = kind == FSDP and member == "" and self._isinstance_only_argument(node)
        if kind == FSDP and member == "" and (self.annotation_depth or self._type_value(node) or tested):
            # FSDPModule here would refuse the fsdp1 backend's models where the type is checked at run time
            # (a pydantic field, a validator's isinstance, isinstance(m, Optional[...]))
            self.needs_imports.add(("fsdp_bridge", None))
            self.expr_rewrites[id(node)] = "fsdp_bridge.ShardedModule"
            what = (
                "annotation"
                if self.annotation_depth
                else "a class that function of this file only tests with isinstance"
                if tested
                else "a type given as a value"
            )
            self._record(node, f"{code_of(node)} ({what})", f"fsdp_bridge.ShardedModule ({SHARDED_MODULE})", True)
            return False
        if kind == FSDP and member == "" and id(node) in self.class_bases:
            self._record(
                node,
                f"class ...({code_of(node)})",
                "not rewritten: a subclass of FSDP1's wrapper has no FSDP2 form (FSDP2 does not wrap: fully_shard "
                "makes the module itself an FSDPModule); build the model unwrapped, shard it with "
                "fsdp_bridge.shard(model, fsdp_bridge.BridgeConfig.from_fsdp1(**<the subclass's constructor "
                "arguments>)), and move the subclass's overrides into the code that calls them",
                False,
            )
            return False
        if kind == FSDP and member == "" and (alias := self._class_alias(node)) is not None:
            name, followed = alias
            if followed:
                return False  # calls through it resolve to torch's class; the assignment is reported after the rewrite
            # Bound again in its scope (re-assigned, another branch, ``global``): the name is not always the class.
            self._record(
                node,
                f"{name} = {code_of(node)} (an alias of FSDP1's wrapper class)",
                f"not followed: {name} is bound more than once in its scope, so calls through it ({name}(...), "
                f"{name}.optim_state_dict, {name}.state_dict_type, ...) may not be FSDP1's and are not listed here; "
                f"where the code picks FSDP1's class, call it there instead ({code_of(node)}(module, **kwargs) in "
                f"that branch, {name}(...) in the others) and run migrate code again",
                False,
            )
            return False
        if kind == FSDP and member == "" and self._chosen_callee(node):
            self.blocked_choice = True
            self._record(
                node,
                f"({code_of(node)} if ... else ...)(...) (FSDP1's constructor chosen by a conditional expression)",
                "not rewritten: its arguments cannot all become the bridge's call, so the model this call makes "
                "stays FSDP1's (the calls on it that the report lists as rewritten go to fsdp_bridge functions, "
                "which serve FSDP1 models too); to see which and why, call the class in a branch of its own: "
                f"`{code_of(node)}(module, ...) if <test> else <the other class>(module, ...)`, and run migrate "
                "code again",
                False,
            )
            return False
        if kind == FSDP and member == "" and self._in_class_tuple(node):
            self._record(
                node,
                f"({code_of(node)}, ...) (FSDP1's class in a tuple of classes)",
                "not rewritten: a tuple kept for a later isinstance; where it is tested write isinstance(m, "
                f"(<the other classes>)) or fsdp_bridge.is_sharded(m) ({IS_SHARDED}). fsdp_bridge.ShardedModule in "
                "the tuple tests the same, but code the test guards that reads the wrapper's .module or its "
                "settings then fails on FSDP2 modules; use it once that code is checked",
                False,
            )
            return False
        if kind == FSDP and member == "":
            # FSDP(...) calls are handled in visit_Call; isinstance(x, FSDP) and the like land here.
            stmt = self.stmt_stack[-1] if self.stmt_stack else None
            holder = (
                next(
                    (c for c in walk(stmt) if isinstance(c, cst.Call) and any(a.value is node for a in c.args)),
                    None,
                )
                if stmt is not None
                else None
            )
            callee = code_of(holder.func).rsplit(".", 1)[-1].lower() if isinstance(holder, cst.Call) else ""
            if stmt is not None and any(
                isinstance(c, cst.Comparison)
                and c.left is node
                and len(c.comparisons) == 1
                and isinstance(c.comparisons[0].operator, (cst.Is, cst.IsNot))
                and m.matches(c.comparisons[0].comparator, m.Name("None"))
                for c in walk(stmt)
            ):
                # ``FSDP is not None``: whether the guarded import of FSDP1's class worked (``except ImportError:
                # FSDP = None``); the import stays for it, and the test means what it meant
                self._record(
                    node,
                    f"{code_of(node)} is (not) None",
                    "kept: a test that the import of FSDP1's class worked (the import stays for it); what the code "
                    "does with FSDP1's models is rewritten where they are used",
                    True,
                )
                return False
            if isinstance(holder, cst.Call) and "instance" not in callee and "subclass" not in callee:
                self._record(
                    node,
                    f"{code_of(node)} (FSDP1's class handed to {short(code_of(holder.func), 40)}(...))",
                    f"not rewritten: {short(code_of(holder.func), 40)} wraps modules with FSDP1's class; FSDP2 has no "
                    "wrapper class (fully_shard changes the module itself): shard the units with fsdp_bridge."
                    "enable_wrap(fsdp_bridge.BridgeConfig.from_fsdp1(**kwargs)) and fsdp_bridge.wrap_module(unit), "
                    "or the whole model with fsdp_bridge.shard(model, BridgeConfig.from_fsdp1(auto_wrap_policy=...))",
                    False,
                )
                return False
            self._record(node, code_of(node), "torch.distributed.fsdp.FSDPModule (FSDP2 modules are FSDPModule)", False)
            return False
        if kind == FSDP:
            if member in ("state_dict_type", "set_state_dict_type", "summon_full_params"):
                self._record(node, f"FSDP.{member}", NAMES[member], False)
            elif member in NAMES:
                self._record(node, f"FSDP.{member}", NAMES[member], False)
            elif isinstance(node, cst.Attribute) and isinstance(node.value, cst.Call):
                pass  # FSDP(...).to(rank): a module's own method on the constructed model (FSDP2's module has it)
            elif member and not member.startswith("__"):
                self._record(
                    node,
                    f"FSDP.{member}",
                    f"not rewritten: FullyShardedDataParallel.{member} is FSDP1's, and FSDP2 has no counterpart the "
                    "migration writes (fully_shard changes the module itself, and torch.distributed.fsdp.FSDPModule "
                    "has its own methods): rework this use for FSDP2",
                    False,
                )
            return False
        if kind == "apply_activation_checkpointing":
            reentrant = any("CheckpointImpl.REENTRANT" in line for line in self.lines)
            text = (
                "not rewritten: CheckpointImpl.REENTRANT appears in this file; reentrant checkpointing re-enters "
                "autograd, which FSDP2's hooks do not support: use CheckpointImpl.NO_REENTRANT, or "
                "BridgeConfig(activation_checkpointing=True)"
                if reentrant
                else "kept: torch's checkpoint_wrapper works around FSDP2 units (non-reentrant), with FSDP1's losses; "
                "or drop it for BridgeConfig(activation_checkpointing=True), which wraps every unit before "
                "sharding"
            )
            self._record(node, code_of(node), text, not reentrant)
            return False
        if kind == "ShardedGradScaler" and not member and id(node) not in self.called and not self.assign_target_depth:
            return self._plan_scaler_class(node)
        if (
            kind == "load_sharded_optimizer_state_dict"
            and not member
            and not self.assign_target_depth
            and not self.annotation_depth
        ):
            # torch's function builds FSDP1 ShardedTensor templates; the bridge's takes the same arguments.
            self.needs_imports.add(("fsdp_bridge", None))
            self.expr_rewrites[id(node)] = "fsdp_bridge.load_sharded_optimizer_state_dict"
            self._record(node, code_of(node), NAMES[kind], True)
            return False
        if kind == "default_auto_wrap_policy" and not member and not self.annotation_depth:
            # torch 1.11's name, gone since 1.12: its new name, kept as a value as that one is (below)
            self.expr_rewrites[id(node)] = "size_based_auto_wrap_policy"
            self.needs_imports.add(("torch.distributed.fsdp.wrap", "size_based_auto_wrap_policy"))
            self._consume(node)
            self._record(
                node,
                code_of(node),
                f"size_based_auto_wrap_policy: {NAMES[kind].split(':', 1)[0]}, renamed in torch 1.12; kept: "
                f"{KEPT['size_based_auto_wrap_policy']}; where it reaches fsdp_bridge.BridgeConfig.from_fsdp1 it is "
                "read when the code runs, with FSDP1's meaning",
                True,
            )
            return False
        if kind in KEPT:
            library = None
            state_value = kind.endswith("StateDictConfig") or kind == "StateDictType"
            if not self.conversions and (not state_value or self._in_plugin_call(node)):
                if self._lightning_strategy_here():
                    library = (
                        "fsdp_bridge.lightning's strategy (was Lightning's FSDPStrategy)"
                        if self._lightning_moves()
                        else "Lightning's FSDPStrategy"
                    )
                elif self._accelerate_plugin_here():
                    library = "accelerate's FullyShardedDataParallelPlugin"
            if library is not None:
                # No FSDP1 wrapper of its own here: the value goes to the library's FSDP1 setup (its TODO).
                pos = self.get_metadata(PositionProvider, node)
                self.findings.append(
                    CodeFinding(
                        self.path,
                        pos.start.line,
                        pos.start.column,
                        code_of(node),
                        f"kept: {KEPT[kind]}; {library} of this file reads it"
                        + (
                            ", with FSDP1's meaning, on FSDP2 (BridgeConfig.from_fsdp1 reads it when the code runs)"
                            if library.startswith("fsdp_bridge")
                            else f" (FSDP1's until that {'strategy' if library.startswith('Lightning') else 'plugin'} "
                            "moves to FSDP2: see its TODO)"
                        ),
                        True,
                        note=True,
                    )
                )
                return False
            if kind == "MixedPrecision" and (unkept := self._mixed_precision_unkept(node)):
                # read when the code runs, but not with FSDP1's meaning: said, not claimed
                self._record(node, code_of(node), unkept, False)
                return False
            local = "LOCAL_STATE_DICT" in code_of(node) or kind.startswith("Local")
            stmt = self.stmt_stack[-1] if self.stmt_stack else None
            compared = stmt is not None and any(  # a test of a value (x is LOCAL_STATE_DICT) reaches no function
                isinstance(c, cst.Comparison) and any(n is node for n in walk(c)) for c in walk(stmt)
            )
            if local and not compared and (kind.endswith("StateDictConfig") or kind == "StateDictType"):
                # kept as a value, but no state function of the bridge takes it: said, not claimed
                self._record(
                    node,
                    code_of(node),
                    f"kept: {KEPT[kind]}; LOCAL_STATE_DICT has no FSDP2 form: fsdp_bridge.state_dict_options refuses "
                    "it on either backend, and fsdp_bridge's state-dict functions on FSDP2 models (FSDP1 models keep "
                    "FSDP1's own calls); a code path that takes it on FSDP2 needs SHARDED_STATE_DICT instead (an "
                    "existing local checkpoint: save it again from FSDP1 as sharded, then `fsdp-bridge convert`)",
                    False,
                )
                return False
            reader = (
                "fsdp_bridge's state-dict functions (FSDP1's own, for a model that stays FSDP1's)"
                if kind.endswith("StateDictConfig") or kind == "StateDictType"
                else "fsdp_bridge.BridgeConfig.from_fsdp1"
            )
            self._record(
                node,
                code_of(node),
                f"kept: {KEPT[kind]}; where it reaches {reader} it is read when the code runs, with FSDP1's "
                "meaning (elsewhere it stays your code's value, or goes to FSDP1's own calls left as they are)",
                True,
            )
            return False
        self._record(node, code_of(node), NAMES[kind], False)
        return False

    def _given_to_fsdp1_api(self, obj: cst.BaseExpression) -> str:
        """``"given to FSDP.<name>(...) here"`` where the current function hands ``obj`` as the model to one of
        FSDP1's static state functions (``FSDP.sharded_optim_state_dict(model, o)``, ``FSDP.state_dict_type(model,
        ...)``): reason enough to report an FSDP1 wrapper attribute read on it (not to rewrite one: those functions
        also take a module holding FSDP1 units); "" where it is not."""
        scope = self.functions[-1] if self.functions else None
        target = code_of(obj)
        for n in walk(scope) if scope is not None else ():
            if isinstance(n, cst.Call) and n.args and n.args[0].keyword is None:
                hit = self._qn(n.func)
                if hit is not None and hit[0] == FSDP and hit[1] in FSDP1_MODEL_FUNCTIONS:
                    if code_of(n.args[0].value) == target:
                        return f"given to FSDP.{hit[1]}(...) here"
        return ""

    def _mixed_precision_unkept(self, node: cst.CSTNode) -> str:
        """The TODO text for ``MixedPrecision(...)`` (``node`` its name) given a field the bridge cannot keep
        when it reads the value at run time, or ""."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        path = _path_to(stmt, node) if stmt is not None else None
        call = path[-2] if path is not None and len(path) > 1 else None
        if not isinstance(call, cst.Call) or call.func is not node:
            return ""
        given = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
        low = given.get("keep_low_precision_grads")
        if low is not None and code_of(low) != "False":
            return keep_low_precision_text(code_of(low))
        return ""

    def _bound_called_with_args(self) -> bool:
        """The statement binds a value to a name (``ctx = a if c else b.no_sync``) that the enclosing function (or
        the module) calls with arguments (``with ctx(model):``). FSDP1's ``no_sync()`` takes none, so the value is
        another object's method (accelerate's ``Accelerator.no_sync(model)``)."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if not isinstance(stmt, cst.SimpleStatementLine):
            return False
        names = {
            t.target.value
            for small in stmt.body
            if isinstance(small, cst.Assign)
            for t in small.targets
            if isinstance(t.target, cst.Name)
        }
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        if not names or scope is None:
            return False
        return any(
            isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value in names and bool(n.args)
            for n in walk(scope)
        )

    def _isinstance_only_argument(self, node: cst.BaseExpression) -> bool:
        """``node`` (FSDP1's class) is a positional argument of ``f(...)``, a function this file defines once,
        whose parameter there is used only as ``isinstance``'s class (and handed on to ``f`` itself in the same
        place): ``wraps(model, FSDP)`` with ``def wraps(module, classes): isinstance(module, classes) or
        any(wraps(m, classes) ...)``. ``fsdp_bridge.ShardedModule`` is tested the same way there."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        path = _path_to(stmt, node) if stmt is not None and self.module is not None else None
        if not path or len(path) < 3 or not isinstance(path[-2], cst.Arg) or not isinstance(path[-3], cst.Call):
            return False
        call, arg = path[-3], path[-2]
        if not isinstance(call.func, cst.Name) or arg.keyword is not None or arg.star:
            return False
        index = next(i for i, a in enumerate(call.args) if a is arg)
        if any(a.keyword is not None or a.star for a in call.args[:index]):
            return False
        name = call.func.value
        defs = [
            n for n in walk(cast(cst.Module, self.module)) if isinstance(n, cst.FunctionDef) and n.name.value == name
        ]
        if len(defs) != 1 or index >= len(defs[0].params.params):
            return False
        fn = defs[0]
        param = fn.params.params[index].name.value
        allowed: set[int] = set()
        for c in walk(fn.body):
            if not (isinstance(c, cst.Call) and isinstance(c.func, cst.Name)):
                continue
            if c.func.value == "isinstance" and len(c.args) == 2 and m.matches(c.args[1].value, m.Name(param)):
                allowed.add(id(c.args[1].value))
            elif c.func.value == name and len(c.args) > index and c.args[index].keyword is None:
                if m.matches(c.args[index].value, m.Name(param)):
                    allowed.add(id(c.args[index].value))
        uses = [n for n in walk(fn.body) if isinstance(n, cst.Name) and n.value == param]
        return bool(uses) and all(id(u) in allowed for u in uses)

    def _type_value(self, node: cst.BaseExpression) -> bool:
        """``node`` (FSDP1's class) is a type inside a type expression written as a value: an element of
        ``Union[...]``/``Optional[...]``/``Annotated[...]`` or of an ``X | Y`` union, or an argument of a call
        in ``Annotated``'s metadata (``Annotated[FSDP, InstanceOf(FSDP)]``, whose validator tests isinstance)."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        path = _path_to(stmt, node) if stmt is not None else None
        if not path:
            return False
        typed = False
        i = len(path) - 2  # path[-1] is node
        while i >= 0:
            parent = path[i]
            if isinstance(parent, (cst.Index, cst.SubscriptElement)):
                i -= 1
                continue
            if isinstance(parent, cst.Subscript) and path[i + 1] is not parent.value:
                form = self._typing_form(parent.value)
                if form is None or (form == "Annotated" and path[i + 1] is not parent.slice[0]):
                    return False  # Annotated's metadata: only a call's argument there is a type (below)
                typed = True
            elif isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.BitOr):
                typed = True
            elif isinstance(parent, cst.Arg) and parent.keyword is None and not parent.star and i >= 1:
                # an argument of a call that is a metadata element (not the first) of Annotated[...]
                call, index, element, subscript = (path[i - k] if i >= k else None for k in (1, 2, 3, 4))
                if not (
                    isinstance(call, cst.Call)
                    and isinstance(index, cst.Index)
                    and isinstance(element, cst.SubscriptElement)
                    and isinstance(subscript, cst.Subscript)
                    and self._typing_form(subscript.value) == "Annotated"
                    and any(e is element for e in subscript.slice[1:])
                ):
                    return False
                i -= 5  # past the Annotated subscript itself
                typed = True
                continue
            else:
                return typed
            i -= 1
        return typed

    def _guarded_already(self, node: cst.Attribute, obj: str) -> bool:
        """``node`` (``obj.module``) is the other branch of the unwrap a first ``--fix`` wrote:
        ``(fsdp_bridge.unwrapped(obj) if fsdp_bridge.is_sharded(obj) else obj.module)``, or its ``--target torch``
        form ``(obj if isinstance(obj, FSDPModule) else obj.module)``."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        path = _path_to(stmt, node) if stmt is not None else None
        if not path or len(path) < 2 or not isinstance(path[-2], cst.IfExp) or path[-2].orelse is not node:
            return False
        choice = path[-2]
        return (code_of(choice.test), code_of(choice.body)) in (
            (f"fsdp_bridge.is_sharded({obj})", f"fsdp_bridge.unwrapped({obj})"),
            (f"isinstance({obj}, FSDPModule)", obj),
        )

    def _bare_in_other_branch(self, node: cst.Attribute, obj: str) -> bool:
        """``node`` (``obj.module``) is a branch of a conditional expression whose other branch is ``obj`` itself, in
        a file that wraps with DDP too: ``model if use_fsdp else model.module`` hands FSDP1's wrapper itself on its
        FSDP path, so the ``.module`` branch unwraps another wrapper (DDP's)."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        path = _path_to(stmt, node) if stmt is not None else None
        if not path or len(path) < 2 or not isinstance(path[-2], cst.IfExp) or path[-2].test is node:
            return False
        choice = path[-2]
        other = choice.orelse if choice.body is node else choice.body
        # only where the file wraps with another wrapper too (else the choice keeps or drops FSDP1's own wrapper):
        # called, not only imported (`from ... import DistributedDataParallel as DDP` beside `#model = DDP(model)`)
        text = "\n".join(line.split("#", 1)[0] for line in self.lines)
        return (
            code_of(other) == obj
            and re.search(r"\b(DistributedDataParallel|DataParallel|DDP)\s*[(,)]", text) is not None
        )

    def _chosen_callee(self, node: cst.BaseExpression) -> bool:
        """``node`` is a branch of a conditional expression that is called: ``(FSDP if ok else Plain)(m, ...)``."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        path = _path_to(stmt, node) if stmt is not None else None
        if not path or len(path) < 3 or not isinstance(path[-2], cst.IfExp) or path[-2].test is node:
            return False
        return isinstance(path[-3], cst.Call) and path[-3].func is path[-2]

    def _in_class_tuple(self, node: cst.BaseExpression) -> bool:
        """``node`` is an element of a tuple or list (``WRAPPERS = (DDP, FSDP)``, ``kinds=(FSDP,)``)."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        path = _path_to(stmt, node) if stmt is not None else None
        return bool(path and len(path) >= 3 and isinstance(path[-3], (cst.Tuple, cst.List)))

    def _typing_form(self, expr: cst.BaseExpression) -> str | None:
        """``Union``/``Optional``/``Annotated`` when ``expr`` names that form of ``typing`` or
        ``typing_extensions``."""
        for q in self.get_metadata(QualifiedNameProvider, expr, set()):
            module, _, name = q.name.rpartition(".")
            if module in ("typing", "typing_extensions") and name in TYPING_FORMS:
                return name
        return None

    def _guards_a_hand_reduced_norm(self, check: cst.Call) -> bool:
        """``check`` (``isinstance(x, FSDP)``) is the test, not negated, of an ``if`` with an ``else`` (or code
        after it, the branch returning), whose body reads ``.grad``, takes a norm and calls a torch.distributed
        collective (``all_reduce``), not written for DTensors (no ``to_local`` / ``full_tensor``)."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if not isinstance(stmt, cst.If) or not any(n is check for n in walk(stmt.test)):
            return False
        if any(isinstance(n, cst.UnaryOperation) and isinstance(n.operator, cst.Not) for n in walk(stmt.test)):
            return False
        body = stmt.body.body if isinstance(stmt.body, cst.IndentedBlock) else ()
        returns = bool(body) and m.matches(body[-1], m.SimpleStatementLine(body=[m.Return()]))
        if stmt.orelse is None and not returns:
            return False  # no other branch for FSDP2 models to take: the branch's work would be skipped
        attrs = {a.attr.value for a in walk(stmt.body) if isinstance(a, cst.Attribute)}
        calls = [code_of(c.func).rsplit(".", 1)[-1] for c in walk(stmt.body) if isinstance(c, cst.Call)]
        return (
            "grad" in attrs
            and not attrs & {"to_local", "full_tensor"}
            and any(c in ("norm", "vector_norm") for c in calls)
            and any(c in ("all_reduce", "reduce", "all_reduce_coalesced") for c in calls)
            and not any("clip" in c or c in ("step", "backward", "zero_grad") for c in calls)  # only the norm
        )

    def _refuses_fsdp1(self, check: cst.Call) -> bool:
        """``check`` (``isinstance(x, FSDP)``) is the test, not negated, of an ``if`` whose body only raises."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if not isinstance(stmt, cst.If) or not isinstance(stmt.body, cst.IndentedBlock):
            return False
        body = stmt.body.body
        if not (
            len(body) == 1
            and isinstance(body[0], cst.SimpleStatementLine)
            and all(isinstance(s, cst.Raise) for s in body[0].body)
        ):
            return False
        negated = [n for n in walk(stmt.test) if isinstance(n, cst.UnaryOperation) and isinstance(n.operator, cst.Not)]
        return any(n is check for n in walk(stmt.test)) and not any(any(x is check for x in walk(n)) for n in negated)

    def _mock_spec(self, node: cst.Call) -> cst.BaseExpression | None:
        """FSDP1's wrapper class as the spec of a ``unittest.mock`` stand-in (``Mock(spec=FSDP)``)."""
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, node.func, set())}
        if not any(n.startswith(("unittest.mock.", "mock.")) and n.rsplit(".", 1)[-1] in MOCKS for n in names):
            return None
        for i, a in enumerate(node.args):
            keyword = a.keyword.value if a.keyword is not None else ("spec" if i == 0 else None)
            if keyword in ("spec", "spec_set") and self._qn(a.value) == (FSDP, ""):
                return a.value
        return None

    def _note_module_set_after_wrap(self, node: cst.Attribute) -> None:
        """``model.module.head = nn.Linear(...)`` on a sharded model: a TODO, since the new module is sharded by
        neither backend, and on FSDP2 its plain tensors sit among DTensor parameters."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if not (self.assign_target_depth and isinstance(stmt, cst.SimpleStatementLine)):
            return
        for small in stmt.body:
            if (
                isinstance(small, cst.Assign)
                and isinstance(small.value, cst.Call)
                and any(isinstance(t.target, cst.Attribute) and t.target.value is node for t in small.targets)
            ):
                self._record(
                    small,
                    f"{short(code_of(small.targets[0].target), 50)} = {short(code_of(small.value.func), 30)}(...) "
                    "(a module set into a sharded model)",
                    "not rewritten: set after the model was sharded, it is sharded by neither FSDP1 nor FSDP2 (its "
                    "gradients are not averaged over ranks); on FSDP2 its plain tensors sit among DTensor parameters, "
                    "which torch's foreach clip_grad_norm_ and foreach/fused optimizers refuse: set it before the "
                    "shard call",
                    False,
                )
                return

    def _module_source(self, node: cst.CSTNode, obj: cst.BaseExpression) -> str:
        """Why ``obj`` at ``node`` may be FSDP1's wrapper though the function does not show it is: made by a
        function of the tree that returns one on some path, handed one by a call of the tree, or summoned
        (``with FSDP.summon_full_params(obj)`` around ``node``); "" for none."""
        if (factory := self._factory_result(node, obj)) != "":
            return f"comes from {short(factory, 40)}(...), which returns FSDP1's wrapper on one path"
        if self._handed_parameter(node, obj):
            return "is handed FSDP1's wrapper by a call of the tree"
        for stmt in self.stmt_stack:
            if isinstance(stmt, cst.With) and any(
                isinstance(item.item, cst.Call)
                and code_of(item.item.func).rsplit(".", 1)[-1] == "summon_full_params"
                and item.item.args
                and code_of(item.item.args[0].value) == code_of(obj)
                for item in stmt.items
            ):
                return "is summoned by summon_full_params around it"
        if (tested := self._fsdp1_tested_around(node)) is not None:
            return f"is read where {short(tested, 40)} is tested for FSDP1's wrapper (the same model, by another name)"
        return ""

    def _plan_recursive_unwrap(self, node: cst.Attribute, obj: str) -> bool:
        """``return unwrap(model.module)`` inside ``def unwrap(model)`` (peeling wrappers until none is left): on
        FSDP2 the sharded model is the module itself and still tests as sharded, so the recursion would never
        end; the call returns ``model`` there, and recurses on the module inside any other wrapper."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if stmt is None or not self.functions:
            return False
        name = self.functions[-1].name.value
        call = next(
            (
                c
                for c in walk(stmt)
                if isinstance(c, cst.Call)
                and m.matches(c.func, m.Name(name))
                and len(c.args) == 1
                and c.args[0].keyword is None
                and c.args[0].value is node
            ),
            None,
        )
        if call is None:
            return False
        if f"fsdp_bridge.unwrapped({obj}) is {obj}" in code_of(stmt):
            return True  # written by a first --fix
        inner = f"(fsdp_bridge.unwrapped({obj}) if fsdp_bridge.is_sharded({obj}) else {obj}.module)"
        itself = f"fsdp_bridge.is_sharded({obj}) and fsdp_bridge.unwrapped({obj}) is {obj}"
        code = f"({obj} if {itself} else {name}({inner}))"
        self.call_rewrites[id(call)] = code
        self.needs_imports.add(("fsdp_bridge", None))
        self._record(
            call,
            f"{name}({code_of(node)}) (a recursive unwrap)",
            f"{short(code, 90)}: FSDP2 does not wrap (the sharded model is the module itself, and stays sharded), so "
            f"{obj} is returned there; the module inside FSDP1's wrapper, and the .module of any other wrapper "
            "(DDP's), are unwrapped further as before",
            True,
        )
        return True

    def _module_state_dict_read(self, node: cst.Attribute) -> str | None:
        """``"state_dict"`` / ``"load_state_dict"`` where ``x.module`` is the receiver of that call in the current
        statement, outside a ``summon_full_params`` block (where FSDP1's wrapped module holds the full
        parameters); None otherwise."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if stmt is None or self._in_summon():
            return None
        return next(
            (
                c.func.attr.value
                for c in walk(stmt)
                if isinstance(c, cst.Call)
                and isinstance(c.func, cst.Attribute)
                and c.func.value is node
                and c.func.attr.value in ("state_dict", "load_state_dict")
            ),
            None,
        )

    def _factory_result(self, node: cst.CSTNode, obj: cst.BaseExpression) -> str:
        """The function of the tree that made ``obj`` (a name assigned its result above ``node`` in this
        function, that element of it being an FSDP1 model on some path: ``Dispatch.fsdp1_results``), or ""."""
        if not (isinstance(obj, cst.Name) and self.functions):
            return ""
        return self._made_by_factory(self.functions[-1], obj.value, before=node)

    def _unwrapped_state_dict(
        self, node: cst.CSTNode, obj: str
    ) -> tuple[str, cst.Call, cst.SimpleStatementLine, str] | None:
        """``name = obj.module if <test> else obj`` or ``name = obj if <test> else obj.module`` (``node`` the
        ``obj.module``; the test ``hasattr(obj, "module")`` or the flag of the FSDP path) with ``obj`` FSDP1's
        wrapper here, and ``name.state_dict()`` called later in the function (or module): (name, that call, its
        statement, the conditional expression)."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        scope = self.functions[-1] if self.functions else self.module
        if (
            scope is None
            or not isinstance(stmt, cst.SimpleStatementLine)
            or not self._shown_fsdp1(node, cst.parse_expression(obj))
        ):
            return None
        assign = stmt.body[0]
        if not (
            isinstance(assign, cst.Assign)
            and len(assign.targets) == 1
            and isinstance(assign.targets[0].target, cst.Name)
            and isinstance(assign.value, cst.IfExp)
            and (
                (assign.value.body is node and code_of(assign.value.orelse) == obj)
                or (assign.value.orelse is node and code_of(assign.value.body) == obj)
            )
        ):
            return None
        name = assign.targets[0].target.value
        wrapped_when = assign.value.body is node  # the test's value that gives the wrapped module
        for line in walk(scope):  # the innermost statement holding the call: the TODO goes above it
            if not isinstance(line, cst.SimpleStatementLine):
                continue
            if self._on_plain_path(scope, stmt, line, assign.value.test, plain=not wrapped_when):
                continue  # ``else:`` of ``if <the same test>:``: the object itself there, no wrapper
            for call in walk(line):
                if (
                    isinstance(call, cst.Call)
                    and not call.args
                    and m.matches(call.func, m.Attribute(value=m.Name(name), attr=m.Name("state_dict")))
                ):
                    return name, call, line, code_of(assign.value)
        return None

    @staticmethod
    def _on_plain_path(
        scope: cst.CSTNode, assigned: cst.CSTNode, line: cst.CSTNode, test: cst.BaseExpression, *, plain: bool
    ) -> bool:
        """``line`` runs only where ``test`` (a flag: a name or an attribute chain, set nowhere after
        ``assigned``) is ``plain``: the body of ``if test:`` (``if not test:``) or its ``else:``."""
        if not (isinstance(test, cst.Name) or (isinstance(test, cst.Attribute) and "(" not in code_of(test))):
            return False
        flag = code_of(test)
        seen = False
        for n in walk(scope):  # source order: an assignment of the flag after ``assigned`` may change it
            if n is assigned:
                seen = True
            elif seen and isinstance(n, (cst.AssignTarget, cst.AugAssign, cst.AnnAssign)):
                if code_of(n.target) == flag:
                    return False
        path = _path_to(scope, line) or []
        for parent, child in itertools.pairwise(path):
            if not isinstance(parent, cst.If):
                continue
            negated = isinstance(parent.test, cst.UnaryOperation) and isinstance(parent.test.operator, cst.Not)
            tested = code_of(parent.test.expression) if negated else code_of(parent.test)  # type: ignore[attr-defined]
            if tested != flag:
                continue
            if child is parent.body:
                value = not negated  # the flag's value where this branch runs
            elif child is parent.orelse:
                value = negated
            else:
                continue
            if value == plain:
                return True
        return False

    def _under_hasattr_module(self, node: cst.CSTNode, obj: str) -> bool:
        """``node`` (``obj.module``) is in the branch a ``hasattr(obj, "module")`` test takes when true: ``obj.module
        if hasattr(obj, "module") else obj``, or the body of ``if hasattr(obj, "module"):``."""

        def is_test(test: cst.BaseExpression) -> bool:
            return (
                isinstance(test, cst.Call)
                and m.matches(test.func, m.Name("hasattr"))
                and len(test.args) == 2
                and code_of(test.args[0].value) == obj
                and m.matches(test.args[1].value, m.SimpleString('"module"') | m.SimpleString("'module'"))
            )

        for stmt in self.stmt_stack:
            if isinstance(stmt, cst.If) and is_test(stmt.test) and any(n is node for n in walk(stmt.body)):
                return True
        last = self.stmt_stack[-1] if self.stmt_stack else None
        return last is not None and any(
            isinstance(e, cst.IfExp) and is_test(e.test) and any(n is node for n in walk(e.body)) for e in walk(last)
        )

    def _in_plugin_call(self, node: cst.CSTNode) -> bool:
        """``node`` is in the arguments of accelerate's ``FullyShardedDataParallelPlugin(...)`` (a state-dict
        config it reads, ``state_dict_config=FullStateDictConfig(...)``), not in a state-dict call of the code."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        path = _path_to(stmt, node) if stmt is not None else None
        return any(
            isinstance(n, cst.Call)
            and n.func is not node
            and any(
                q.name.startswith("accelerate") and q.name.endswith(".FullyShardedDataParallelPlugin")
                for q in self.get_metadata(QualifiedNameProvider, n.func, set())
            )
            for n in path or ()
        )

    def _accelerate_plugin_here(self) -> bool:
        """This file builds accelerate's FullyShardedDataParallelPlugin for FSDP1 (no ``fsdp_version=2``)."""
        if self.accelerate_here is None:
            self.accelerate_here = False
            for n in walk(self.module) if self.module is not None else ():
                if isinstance(n, cst.Call) and any(
                    q.name.startswith("accelerate") and q.name.endswith(".FullyShardedDataParallelPlugin")
                    for q in self.get_metadata(QualifiedNameProvider, n.func, set())
                ):
                    version = next(
                        (a.value for a in n.args if a.keyword is not None and a.keyword.value == "fsdp_version"), None
                    )
                    if version is None or code_of(version) == "1":
                        self.accelerate_here = True
        return self.accelerate_here

    def _no_version_through(self, starred: list[cst.BaseExpression]) -> bool:
        """Nothing ``**fsdp_kwargs`` / ``*args`` passes can set ``fsdp_version``: each is a name and the code
        that can fill it (the enclosing function, else the file) never writes the text ``fsdp_version``
        (``fsdp_kwargs["auto_wrap_policy"] = ...`` only), so accelerate's FSDP1 default applies."""
        scope = self.functions[-1] if self.functions else self.module
        return (
            scope is not None and all(isinstance(v, cst.Name) for v in starred) and "fsdp_version" not in code_of(scope)
        )

    def _config_driven(self, node: cst.Call) -> None:
        """FSDP set up by the HF Trainer's arguments or accelerate's plugin: point to `migrate config`."""
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, node.func, set())}
        for cls, key in CONFIG_DRIVEN.items():
            if not any(n.split(".")[-1] == cls and n.startswith(("transformers", "accelerate")) for n in names):
                continue
            kwargs = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
            starred = [a.value for a in node.args if a.star]
            if cls == "FullyShardedDataParallelPlugin" and (not starred or self._no_version_through(starred)):
                given = code_of(kwargs[key]) if key in kwargs else None
                if given is None or given == "1":
                    self.fsdp1_elsewhere = True  # accelerate wraps the model with FSDP1: TODOs are written
                    self._record(node, f"{cls}(...) (accelerate's FSDP1 plugin)", accelerate_plugin_text(given), False)
                    return
            if key not in kwargs or (key == "fsdp_version" and code_of(kwargs[key]) == "2"):
                return
            self._record(
                node,
                f"{cls}({key}=...)",
                f"FSDP here is driven by {cls}'s arguments: migrate them with `fsdp-bridge migrate config` "
                "(the launch command, the arguments file, or the accelerate/axolotl YAML), not with "
                "fsdp_bridge.shard/save_checkpoint",
                False,
            )

    def _plan_module_checks(self, node: cst.Call, hit: tuple[str, str] | None) -> bool:
        """``isinstance(m, FSDP)`` -> ``fsdp_bridge.is_sharded(m)`` (unittest's ``self.assertIsInstance(m, FSDP)``
        -> ``self.assertTrue(fsdp_bridge.is_sharded(m))``, ``assertNotIsInstance`` -> ``assertFalse``);
        ``FSDP.fsdp_modules(M)`` -> the modules of ``M`` that are sharded; ``ShardedGradScaler(...)`` ->
        ``fsdp_bridge.GradScaler(...)``."""
        args = node.args
        assertion = self._unittest_assertion(node)
        check = assertion is not None or (m.matches(node.func, m.Name("isinstance")) and len(args) == 2)
        if (subject := _type_of(node)) is not None and self._qn(args[1].value) == (FSDP, ""):
            # issubclass(type(m), FSDP) asks what isinstance(m, FSDP) asks (not issubclass(C, ShardedModule):
            # a class cannot tell shard()'s FSDP2 units from torch's own fully_shard modules)
            if self._refuses_fsdp1(node):
                self._consume(args[1].value)
                return True
            self.needs_imports.add(("fsdp_bridge", None))
            code = f"fsdp_bridge.is_sharded({code_of(subject)})"
            self._record(node, f"issubclass(type(...), {code_of(args[1].value)})", f"{code} ({IS_SHARDED})", True)
        elif check and self._qn(args[1].value) == (FSDP, ""):
            if assertion is None and self._refuses_fsdp1(node):
                # ``if isinstance(m, FSDP): raise ...``: code that refuses FSDP1's wrapper (often FSDP2 code
                # guarding itself) stays true after the migration; FSDPModule there would refuse FSDP2 units.
                self._consume(args[1].value)
                return True
            if (
                assertion is None
                and self.dispatch.constructs_fsdp1 is None
                and re.search(r"\bisinstance\([^()]*,\s*FSDPModule\s*\)", self.code) is not None
            ):
                # code written for both backends (it tests FSDPModule on its own path) in a tree handed its models
                # by a library, which may keep making FSDP1's: the FSDP1 test stays FSDP1's
                self._consume(args[1].value)
                self._record(
                    node,
                    f"isinstance(..., {code_of(args[1].value)})",
                    "kept as is: this file tests FSDPModule on a path of its own, and no file of the tree makes an "
                    "FSDP1 model (a library hands them over and may keep making FSDP1's), so the test serves "
                    "those; FSDP2 modules take the FSDPModule path",
                    True,
                )
                return True
            if assertion is None and self._guards_a_hand_reduced_norm(node):
                # ``if isinstance(m, FSDP):`` around a gradient norm summed over the ranks by hand (FSDP1's flat
                # shards): on FSDP2 the gradients are DTensors, which the collective refuses, and the other branch's
                # plain norm of them is already the whole model's. The test stays FSDP1's: FSDP2 models take the
                # other branch.
                self._consume(args[1].value)
                self._record(
                    node,
                    f"{code_of(node.func)}(..., {code_of(args[1].value)})",
                    "kept as is: its branch sums a gradient norm over the ranks by hand (torch.distributed "
                    "collective over FSDP1's flat-shard gradients), which FSDP2's DTensor gradients refuse; with "
                    "the test kept, FSDP2 models take the other branch, whose norm of DTensor gradients is the "
                    "whole model's",
                    True,
                )
                return True
            self.needs_imports.add(("fsdp_bridge", None))
            test = f"fsdp_bridge.is_sharded({code_of(args[0].value)})"
            if assertion is None and self._unwrap_loop_test(node, code_of(args[0].value)):
                test = _unwraps(code_of(args[0].value))
            code = self._asserted(node, assertion, test)
            construct = f"{code_of(node.func)}(..., {code_of(args[1].value)})"
            self._record(node, construct, f"{code} ({IS_SHARDED})", True)
        elif check and isinstance(args[1].value, (cst.Tuple, cst.BinaryOperation)):
            classes = class_elements(args[1].value)
            hits = [n for n in classes if self._qn(n) == (FSDP, "")]
            if not hits:
                return False
            for n in hits:
                self._consume(n)
            obj = code_of(args[0].value)
            construct = f"{code_of(node.func)}(..., {short(code_of(args[1].value), 40)})"
            others = list(dict.fromkeys(code_of(n) for n in classes if self._qn(n) != (FSDP, "")))
            if others and not isinstance(args[0].value, (cst.Name, cst.Attribute)):
                test = f"isinstance(x, ({', '.join(others)})) or fsdp_bridge.is_sharded(x)"
                self._record(
                    node,
                    construct,
                    f"not rewritten: write {self._asserted(node, assertion, test, f'({test})')} with x the value of "
                    f"{short(obj, 40)} ({IS_SHARDED}); FSDPModule in FSDP's place would miss models sharded on the "
                    "fsdp1 backend",
                    False,
                )
                return True
            self.needs_imports.add(("fsdp_bridge", None))
            code = f"fsdp_bridge.is_sharded({obj})"
            if assertion is None and self._unwrap_loop_test(node, obj):
                code = _unwraps(obj)
            if others:
                kinds = others[0] if len(others) == 1 else f"({', '.join(others)})"
                code = f"isinstance({obj}, {kinds}) or {code}"
                code = self._asserted(node, assertion, code, f"({code})")
            else:
                code = self._asserted(node, assertion, code)
            self._record(node, construct, f"{code} ({IS_SHARDED})", True)
        elif (spec := self._mock_spec(node)) is not None:
            # kept: the stand-in is an FSDP1 wrapper, which the migrated code's fsdp_bridge.is_sharded accepts
            self._consume(spec)
            self._record(
                node,
                f"{code_of(node.func)}(spec={code_of(spec)})",
                "kept as is: the stand-in is an FSDP1 wrapper; fsdp_bridge.is_sharded (what the migrated code's "
                "isinstance(..., FSDP) became) and fsdp_bridge's calls accept it as FSDP1 did",
                True,
            )
            return False
        elif hit == (FSDP, "fsdp_modules") and args:
            self.needs_imports.add(("fsdp_bridge", None))
            root = code_of(args[0].value)
            code = f"[m for m in {root}.modules() if fsdp_bridge.is_sharded(m)]"
            self._record(node, f"{code_of(node.func)}(...)", f"{code} (the units of either backend)", True)
        elif hit == (FSDP, "clip_grad_norm_") and args:
            self.needs_imports.add(("fsdp_bridge", None))
            code = code_of(node.with_changes(func=cst.parse_expression("fsdp_bridge.clip_grad_norm_")))
            shown = _one_line(code, "fsdp_bridge.clip_grad_norm_")
            self._record(node, f"{code_of(node.func)}(...)", f"{shown}; {fsdp2_text('clip_grad_norm_')}", True)
        elif hit is not None and hit[0] == "ShardedGradScaler":
            # The bridge's scaler, not torch.amp.GradScaler: on the fsdp1 backend the gradients are flat shards
            # and only a ShardedGradScaler sums the overflow check over the ranks (process_group= kept: the
            # bridge's class takes it with FSDP1's meaning).
            self.needs_imports.add(("fsdp_bridge", None))
            code = code_of(node.with_changes(func=cst.parse_expression("fsdp_bridge.GradScaler")))
            shown = _one_line(code, "fsdp_bridge.GradScaler")
            self._record(node, "ShardedGradScaler(...)", f"{shown} ({SCALER_TEXT})", True)
        else:
            return False
        self.call_rewrites[id(node)] = code
        self._consume(node.func)
        for a in args:
            self._consume(a.value) if self._qn(a.value) is not None else None
        return True

    def _unittest_assertion(self, node: cst.Call) -> str | None:
        """``assertTrue`` / ``assertFalse`` when ``node`` is ``self.assertIsInstance(obj, cls[, msg])`` /
        ``self.assertNotIsInstance(...)`` in a method of a unittest ``TestCase`` (see ``_test_case``)."""
        func = node.func
        if not (
            isinstance(func, cst.Attribute)
            and func.attr.value in UNITTEST_ASSERTS
            and m.matches(func.value, m.Name("self"))
            and 2 <= len(node.args) <= 3
            and all(a.keyword is None and not a.star for a in node.args[:2])
            and all(not a.star and (a.keyword is None or a.keyword.value == "msg") for a in node.args[2:])
            and self.classes
        ):
            return None
        # ``self`` is the first parameter of the innermost function binding it, a method of the innermost class.
        cls = self.classes[-1]
        method = next((f for f in reversed(self.functions) if "self" in _parameters(f)), None)
        if method is None or _parameters(method)[0] != "self" or not any(s is method for s in cls.body.body):
            return None
        return UNITTEST_ASSERTS[func.attr.value] if self._test_case(cls, set()) else None

    def _test_case(self, cls: cst.ClassDef, seen: set[int]) -> bool:
        """``cls`` derives from unittest's ``TestCase`` or an imported class whose name ends in ``TestCase``
        (absltest's, torch's ``MultiProcessTestCase``, ...), directly or through classes defined at the top of
        this file (followed, whatever their names)."""
        seen.add(id(cls))
        top = self.module.body if self.module is not None else ()
        for base in cls.bases:
            if base.keyword is not None:
                continue
            names = {q.name for q in self.get_metadata(QualifiedNameProvider, base.value, set())}
            if names & {"unittest.TestCase", "unittest.case.TestCase"}:
                return True
            if isinstance(base.value, cst.Name):
                parents = [c for c in top if isinstance(c, cst.ClassDef) and c.name.value == base.value.value]
                if parents:
                    if any(id(c) not in seen and self._test_case(c, seen) for c in parents):
                        return True
                    continue
            if code_of(base.value).rsplit(".", 1)[-1].endswith("TestCase"):
                return True
        return False

    def _unwrap_loop_test(self, node: cst.Call, obj: str) -> bool:
        """``node`` tests ``obj`` in a ``while`` condition whose body assigns ``obj`` its inner module (``while
        isinstance(m, (DDP, FSDP)): m = m.module``), or in an ``if`` whose body hands ``obj`` to an unwrapping
        call: an unwrapping test, which must hold only where there is something to unwrap (FSDP2 does not wrap:
        fsdp_bridge.unwrapped gives the module itself). Not under ``not``."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if not isinstance(stmt, (cst.While, cst.If)) or _path_to(stmt.test, node) is None:
            return False
        if any(
            isinstance(n, cst.UnaryOperation) and isinstance(n.operator, cst.Not) and _path_to(n, node) is not None
            for n in walk(stmt.test)
        ):
            return False  # ``while not isinstance(parent, FSDP): parent = <its parent>``: a search for a unit
        if isinstance(stmt, cst.If):
            # ``if isinstance(m, FSDP): set_layer(name, accelerator.unwrap_model(m), root)``: strips FSDP1's
            # wrappers, of which FSDP2 has none (the test must not hold for FSDP2's root and units)
            return any(
                isinstance(n, cst.Call)
                and "unwrap" in code_of(n.func).rsplit(".", 1)[-1].lower()
                and any(code_of(a.value) == obj for a in n.args)
                for n in walk(stmt.body)
            )
        return any(
            isinstance(n, cst.Assign)
            and any(code_of(t.target) == obj for t in n.targets)
            and any(w in code_of(n.value) for w in (".module", "_fsdp_wrapped_module", "unwrap"))
            for n in walk(stmt.body)
        )

    @staticmethod
    def _asserted(node: cst.Call, assertion: str | None, test: str, alone: str | None = None) -> str:
        """``test`` as written in place of ``node``: the receiver's ``assertion(test[, msg])``, or for
        ``isinstance`` ``alone`` (``test`` in parentheses where it is an ``or``) or ``test``."""
        if assertion is None or not isinstance(node.func, cst.Attribute):
            return alone or test
        msg = [code_of(a).rstrip(", ") for a in node.args[2:]]
        return f"{code_of(node.func.value)}.{assertion}({', '.join([test, *msg])})"

    def _class_alias(self, node: cst.CSTNode) -> tuple[str, bool] | None:
        """The name in ``NAME = FullyShardedDataParallel`` when ``node`` is that statement's whole value, and
        whether it is followed (bound once in its scope, see ``class_aliases``)."""
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
            return None
        assign = stmt.body[0]
        if (
            isinstance(assign, cst.Assign)
            and assign.value is node
            and len(assign.targets) == 1
            and isinstance(assign.targets[0].target, cst.Name)
        ):
            return assign.targets[0].target.value, id(assign) in self.aliases.assignments
        return None


def _type_of(node: cst.Call) -> cst.BaseExpression | None:
    """``x`` when ``node`` is ``issubclass(type(x), <class>)``."""
    if not (m.matches(node.func, m.Name("issubclass")) and len(node.args) == 2):
        return None
    first = node.args[0].value
    if not (isinstance(first, cst.Call) and m.matches(first.func, m.Name("type")) and len(first.args) == 1):
        return None
    if any(a.keyword is not None or a.star for a in (*node.args, *first.args)):
        return None
    return first.args[0].value


def _one_line(code: str, name: str) -> str:
    """``code`` for a report line: as written on one line, else ``name(<the same arguments>)`` (a call over
    several lines keeps its layout and comments in the file)."""
    return code if "\n" not in code else f"{name}(<the same arguments>)"


def _unwraps(obj: str) -> str:
    """The test of an unwrapping loop over ``obj``: a wrapper with a module inside (FSDP1's, on either
    backend), never an FSDP2 module, which is its own module."""
    return f"(fsdp_bridge.is_sharded({obj}) and fsdp_bridge.unwrapped({obj}) is not {obj})"


def _path_to(root: cst.CSTNode, target: cst.CSTNode) -> list[cst.CSTNode] | None:
    """The nodes from ``root`` down to ``target`` (both included), or None when ``target`` is not under it."""
    if root is target:
        return [root]
    for child in root.children:
        if (path := _path_to(child, target)) is not None:
            return [root, *path]
    return None


def accelerate_plugin_text(version: str | None) -> str:
    """The TODO on accelerate's ``FullyShardedDataParallelPlugin(...)`` built for FSDP1."""
    why = (
        "fsdp_version=1"
        if version is not None
        else "no fsdp_version: accelerate reads FSDP_VERSION from the environment (accelerate launch "
        "--fsdp_version), 1 by default"
    )
    return (
        f"accelerate wraps the model with FSDP1 through this plugin ({why}); for FSDP2 pass fsdp_version=2 with "
        "accelerate's FSDP2 forms, not these values: reshard_after_forward in place of sharding_strategy, "
        "cpu_offload a bool or torch's OffloadPolicy (an FSDP1 CPUOffload raises), transformer_cls_names_to_wrap "
        "(the names of layer classes inside the model given to prepare) with auto_wrap_policy="
        "transformer_auto_wrap_policy: its FSDP2 path reads a policy function and those names, not the classes a "
        "partial binds, and a ModuleWrapPolicy object or another policy function (lambda_auto_wrap_policy, your "
        "own) shards the root alone; backward_prefetch, limit_all_gathers and use_orig_params have no FSDP2 form "
        "there, forward_prefetch given (False too) is refused (accelerate 1.15: ValueError beside "
        "reshard_after_forward) and sync_module_states dropped with a warning. fsdp_version needs accelerate 1.6 "
        "or newer (and the recent torch its FSDP2 path checks for). The same settings in "
        "an accelerate YAML, given to `fsdp-bridge migrate config`, show each FSDP2 key and what has none. Tests "
        "of fsdp_bridge.ShardedModule / is_sharded then see torch's FSDPModule, which they do not accept: test "
        "isinstance(m, FSDPModule) there"
    )
