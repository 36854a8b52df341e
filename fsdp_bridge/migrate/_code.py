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
import os
import re
import shutil
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor
from libcst.metadata import MetadataWrapper, PositionProvider, QualifiedNameProvider, QualifiedNameSource

from fsdp_bridge.mapping import TABLE
from fsdp_bridge.migrate._report import CodeFinding, CodeReport
from fsdp_bridge.migrate._vendored import vendored_torch_module

__all__ = ["MigratedSource", "MigrationWriteError", "migrate_paths", "migrate_source"]

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
    "FlatParamHandle": "no FSDP2 form (FSDP2 keeps each parameter as its own DTensor): use the module's "
    "parameters and FSDPModule.unshard()/reshard()",
    "load_sharded_optimizer_state_dict": "fsdp_bridge.load_sharded_optimizer_state_dict, the same arguments: on "
    "FSDP2 each optimizer-state tensor is read into a DTensor laid out like its parameter (torch's builds FSDP1 "
    "ShardedTensors); pass the result's [optimizer_key] to fsdp_bridge.optim_state_dict_to_load or "
    "set_optimizer_state_dict",
    "_or_policy": "BridgeConfig.from_fsdp1(auto_wrap_policy=...) (FSDP1's recursion, exactly)",
    "_module_wrap_policy": "BridgeConfig(wrap=[LayerClass, ...])",
    "enable_wrap": "not rewritten: FSDP1's manual wrapping (enable_wrap + wrap(module)); on FSDP2 build the model "
    "unwrapped and shard it once: fsdp_bridge.shard(model, BridgeConfig(wrap=[<classes of the "
    "modules passed to wrap()>], ...)), with enable_wrap's keyword arguments moved into the config "
    "(BridgeConfig.from_fsdp1(**kwargs) takes them as they are)",
    "wrap": "not rewritten: wrap(module) inside enable_wrap is FSDP1's manual wrapping; drop it and list the "
    "module's class in BridgeConfig(wrap=[...]) for fsdp_bridge.shard",
    "fsdp_modules": "[m for m in model.modules() if isinstance(m, FSDPModule)]",
    FSDP: "fsdp_bridge.shard(model, fsdp_bridge.BridgeConfig(...)) (FSDP2: fully_shard on each unit, then the root)",
    "transformer_auto_wrap_policy": "BridgeConfig(wrap=[LayerClass, ...])",
    "size_based_auto_wrap_policy": "BridgeConfig(wrap={'min_num_params': N})",
    "ModuleWrapPolicy": "BridgeConfig(wrap=[LayerClass, ...])",
    "CustomPolicy": "BridgeConfig(wrap=callable) (a function module -> bool)",
    "lambda_auto_wrap_policy": "BridgeConfig(wrap=callable) (a function module -> bool)",
    "state_dict_type": (
        "not rewritten: FULL_STATE_DICT / SHARDED_STATE_DICT blocks whose body calls model.state_dict(), "
        "model.load_state_dict() or FSDP.optim_state_dict are rewritten; here the type is known only at run "
        "time, or is LOCAL_STATE_DICT, which has no FSDP2 form (FSDP1's flat-parameter shards): save "
        "SHARDED_STATE_DICT instead (get_model_state_dict + dcp.save, or fsdp_bridge.save_checkpoint); to carry "
        "a local checkpoint, load it in FSDP1, save it sharded, then `fsdp-bridge convert`"
    ),
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
_INTERNAL_ATTRS: dict[str, str] = {
    "flat_param": "FSDP1's flat parameter has no FSDP2 form: each parameter is its own DTensor; "
    "iterate model.parameters() (p.to_local() for this rank's shard)",
    "_flat_param": "FSDP1's flat parameter has no FSDP2 form: each parameter is its own DTensor; "
    "iterate model.parameters() (p.to_local() for this rank's shard)",
    "_handle": "FSDP1's FlatParamHandle has no FSDP2 form: use the module's parameters (DTensors) and "
    "FSDPModule methods (unshard/reshard)",
    "_has_params": "FSDP1's private flag (does this unit manage parameters) has no FSDP2 form: FSDPModule's "
    "reshard()/unshard() do nothing on a unit without parameters; drop the test",
    "_lazy_init": "FSDP2 initialises on the first forward; nothing to call (FSDPModule has no _lazy_init)",
    "_fsdp_wrapped_module": "FSDP2 does not wrap: the module is itself (an FSDPModule); drop the attribute",
    "_handles": "FSDP1's list of FlatParamHandles has no FSDP2 form: use the module's parameters (DTensors) and "
    "FSDPModule methods (unshard/reshard)",
}
"""FSDP1 internals real trainers reach into, and what to do on FSDP2."""

_FSDP1_PRIVATE_MODULES = (
    "_runtime_utils",
    "_flat_param",
    "_common_utils",
    "_init_utils",
    "_state_dict_utils",
    "_optim_utils",
    "_wrap_utils",
    "_traversal_utils",
    "_exec_order_utils",
    "_limiter_utils",
    "_unshard_param_utils",
    "_debug_utils",
)
"""Private modules of ``torch.distributed.fsdp`` that implement FSDP1 only (FSDP2 lives in ``_fully_shard``)."""


def _fsdp1_private(qnames: Iterable[Any]) -> str | None:
    """``torch.distributed.fsdp._runtime_utils._reshard`` -> that name, for FSDP1's private modules."""
    for q in qnames:
        parts = q.name.split(".")
        if parts[:3] == ["torch", "distributed", "fsdp"] and len(parts) > 4 and parts[3] in _FSDP1_PRIVATE_MODULES:
            return str(q.name)
    return None


_WRAPPER_ATTRS: dict[str, str] = {
    "sharding_strategy": "the strategy it was sharded with is fsdp_bridge.get_bridge(model).config.strategy "
    "(fsdp_bridge.ShardingStrategy, same member names) on the model given to fsdp_bridge.shard, or your own setting",
    "mixed_precision": "the setting is fsdp_bridge.get_bridge(model).config.mixed_precision on the model given to "
    "fsdp_bridge.shard, or your own MixedPrecision object",
    "cpu_offload": "the setting is fsdp_bridge.get_bridge(model).config.cpu_offload on the model given to "
    "fsdp_bridge.shard, or your own setting",
    "backward_prefetch": "the setting is fsdp_bridge.get_bridge(model).config.backward_prefetch, or your own setting",
    "forward_prefetch": "the setting is fsdp_bridge.get_bridge(model).config.forward_prefetch, or your own setting",
    "limit_all_gathers": "FSDP2 needs no all-gather rate limiter; use your own setting if the value is logged",
    "process_group": "the data-parallel group is fsdp_bridge.get_bridge(model).mesh.get_group() (a 1D mesh; on a "
    "2D mesh pass the dimension's name)",
    "compute_device": "the device is fsdp_bridge.get_bridge(model).device",
    "rank": "use torch.distributed.get_rank() (or the mesh's get_local_rank())",
    "world_size": "use torch.distributed.get_world_size() (or fsdp_bridge.get_bridge(model).mesh.size())",
    "training_state": "FSDP1's private state machine has no FSDP2 form; track the phase in your own code",
}
"""FSDP1 wrapper attributes read on a wrapped model; FSDPModule has none of them."""

_NAME_HELPERS = ("clean_tensor_name", "FSDP_WRAPPED_MODULE", "FSDP_PREFIX")
"""Private FSDP1 names that only spell or strip FSDP1's parameter-name prefixes: they still work, and
change nothing on FSDP2 names (which have no wrapper prefix)."""


def _private_text(name: str) -> str:
    last = name.rsplit(".", 1)[-1]
    if last in ("_reshard", "_unshard"):
        public = "reshard()" if last == "_reshard" else "unshard()"
        return (
            f"FSDP1's private {last} (flat-parameter handles) has no FSDP2 form: on an FSDP2 module call "
            f"module.{public} (FSDPModule), which frees or gathers that unit's parameters"
            + (
                " (fsdp_bridge.shard's FSDP2 units already free what they kept after a forward run without gradients)"
                if last == "_reshard"
                else ""
            )
        )
    if last == "_init_intra_and_inter_node_groups":
        return (
            "FSDP1's private helper for HYBRID_SHARD's (intra-node, inter-node) group pair, the groups FSDP1 "
            "builds by itself when process_group is None: drop it and the process_group= argument; "
            "fsdp_bridge.shard with HYBRID_SHARD builds the same 2D (replicate across nodes, shard within a "
            "node) mesh (hybrid_shape for another split), and the intra-node group is "
            "fsdp_bridge.get_bridge(model).mesh.get_group(1)"
        )
    if last == "_unshard_params_for_summon":
        return (
            "FSDP1's private summon context has no FSDP2 form: use fsdp_bridge.summon_full_params(module, "
            "writeback=..., rank0_only=..., offload_to_cpu=...), a context manager on both backends"
        )
    return (
        f"a private FSDP1 helper ({name.rsplit('.', 1)[0]}) with no FSDP2 form: FSDP2 keeps each parameter as "
        "its own DTensor; use the module's parameters and FSDPModule's public methods (unshard, reshard, "
        "set_requires_gradient_sync) or the bridge's functions"
    )


_CONFIG_DRIVEN = {
    "TrainingArguments": "fsdp",
    "Seq2SeqTrainingArguments": "fsdp",
    "FullyShardedDataParallelPlugin": "fsdp_version",
}
"""Constructors that drive FSDP from arguments: their settings are migrated by `migrate config`."""

_KEPT: dict[str, str] = {
    "StateDictType": "torch's FSDP1 enum, here a setting of your own (the state_dict_type blocks are rewritten)",
    "MixedPrecision": "torch's FSDP1 mixed-precision dataclass",
    "CPUOffload": "torch's FSDP1 offload dataclass",
    "BackwardPrefetch": "torch's FSDP1 prefetch enum",
    "ShardingStrategy": "torch's FSDP1 strategy enum",
    "transformer_auto_wrap_policy": "torch's FSDP1 wrap policy",
    "size_based_auto_wrap_policy": "torch's FSDP1 wrap policy",
    "lambda_auto_wrap_policy": "torch's FSDP1 wrap policy",
    "ModuleWrapPolicy": "torch's FSDP1 wrap policy",
    "CustomPolicy": "torch's FSDP1 wrap policy",
    "_or_policy": "torch's FSDP1 wrap-policy combinator",
    "_module_wrap_policy": "torch's FSDP1 wrap policy (the function behind ModuleWrapPolicy)",
    "FullStateDictConfig": "torch's FSDP1 state-dict config",
    "ShardedStateDictConfig": "torch's FSDP1 state-dict config",
    "FullOptimStateDictConfig": "torch's FSDP1 state-dict config",
    "ShardedOptimStateDictConfig": "torch's FSDP1 state-dict config",
}
"""FSDP1 objects that stay valid after migration: plain values BridgeConfig.from_fsdp1 translates."""

_FSDP_METHODS = (
    "fsdp_modules",
    "state_dict_type",
    "set_state_dict_type",
    "summon_full_params",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "full_optim_state_dict",
    "sharded_optim_state_dict",
    "shard_full_optim_state_dict",
    "scatter_full_optim_state_dict",
    "clip_grad_norm_",
    "no_sync",
)
_STRATEGIES = {
    "FULL_SHARD": "full_shard",
    "SHARD_GRAD_OP": "shard_grad_op",
    "NO_SHARD": "no_shard",
    "HYBRID_SHARD": "hybrid_shard",
    "_HYBRID_SHARD_ZERO2": "hybrid_shard_zero2",
}
_KWARG_OPTION = {
    "sharding_strategy": "strategy",
    "auto_wrap_policy": "wrap",
    "mixed_precision": "mixed_precision",
    "backward_prefetch": "backward_prefetch",
    "forward_prefetch": "forward_prefetch",
    "limit_all_gathers": "limit_all_gathers",
    "cpu_offload": "cpu_offload",
    "sync_module_states": "sync_module_states",
    "use_orig_params": "use_orig_params",
    "device_id": "device_id",
    "device_mesh": "process_group",
    "process_group": "process_group",
    "ignored_modules": "ignored_modules",
    "param_init_fn": "param_init_fn",
}


_IGNORED_KWARGS = ("ignored_modules", "ignored_states", "ignored_parameters")
"""FSDP1 arguments naming what is not sharded (modules or parameters), read as BridgeConfig.ignored_modules."""

_FSDP1_POSITIONAL = (
    "module",
    "process_group",
    "sharding_strategy",
    "cpu_offload",
    "auto_wrap_policy",
    "backward_prefetch",
    "mixed_precision",
    "ignored_modules",
    "param_init_fn",
    "device_id",
    "sync_module_states",
    "forward_prefetch",
    "limit_all_gathers",
    "use_orig_params",
    "ignored_states",
    "device_mesh",
)
"""FullyShardedDataParallel.__init__'s parameters in order (torch 2.8-2.14)."""


def _resolve(qnames: Iterable[Any]) -> tuple[str, str] | None:
    """(kind, member) for an FSDP1 qualified name, e.g. ("FullyShardedDataParallel", "state_dict_type")."""
    for q in qnames:
        name: str = q.name
        if not name.startswith("torch.distributed."):
            continue
        if name == "torch.distributed.fsdp.wrap.wrap":
            return "wrap", ""  # the module path holds "wrap" too: only the function itself is this name
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in _NAMES and part not in _FSDP_METHODS and (part != "wrap" or i == len(parts) - 1):
                rest = parts[i + 1 :]
                return part, rest[0] if rest else ""
    return None


@dataclass
class _Dispatch:
    """Functions of the migrated tree that tell the two backends apart, found by reading their bodies.

    ``versions``: ``def f(m)`` with ``if isinstance(m, FSDP): return 1`` and ``if isinstance(m, FSDPModule):
    return 2`` (the two literals); ``fsdp2_tests``: predicates true only for FSDP2 modules (every ``return``
    gives a bool literal or an ``isinstance(..., FSDPModule)`` test, and FSDP1's class is not mentioned).
    """

    versions: dict[str, tuple[int, int]] = field(default_factory=dict)
    fsdp2_tests: set[str] = field(default_factory=set)
    own_methods: dict[str, str] = field(default_factory=dict)  # "clip_grad_norm_" -> the file defining the tree's own
    sets_state_dict_type: str | None = None  # a file of the tree that calls FSDP.set_state_dict_type
    makes_state_dict_context: str | None = None  # a file of the tree that calls FSDP.state_dict_type
    group_fsdp: str | None = None  # a file of the tree passing process_group= (FSDP over some ranks)
    fsdp1_factories: set[str] = field(default_factory=set)
    """Functions of the tree that return FSDP1's wrapper (``-> FullyShardedDataParallel``, ``return FSDP(...)``),
    by every dotted suffix of their module path (``wrapped_model.load_model``, ``finetune.wrapped_model.load_model``):
    a file that imports one is handed an FSDP1 model (in their own file the usual evidence applies)."""

    def merge(self, other: _Dispatch) -> None:
        self.versions.update(other.versions)
        self.fsdp1_factories |= other.fsdp1_factories
        self.fsdp2_tests |= other.fsdp2_tests
        self.sets_state_dict_type = self.sets_state_dict_type or other.sets_state_dict_type
        self.makes_state_dict_context = self.makes_state_dict_context or other.makes_state_dict_context
        self.group_fsdp = self.group_fsdp or other.group_fsdp
        for name, where in other.own_methods.items():
            self.own_methods.setdefault(name, where)


_OWN_METHOD_NAMES = ("clip_grad_norm_", "no_sync")
_STATE_DICT_TYPE_CALL = re.compile(r"(?<!set_)state_dict_type\(")


def _makes_state_dict_context(code: str) -> bool:
    """The file calls ``FSDP.state_dict_type`` (rewritten to fsdp_bridge's; a LOCAL_STATE_DICT one stays
    a TODO of its own, so the tree is not reported migrated)."""
    return _STATE_DICT_TYPE_CALL.search(code) is not None


_GROUP_ARG = re.compile(r"\bprocess_group\s*=\s*(?!None\b)")


def _passes_group(code: str) -> bool:
    """Whether FSDP1 code passes a process group (the data-parallel group of a model-parallel layout)."""
    return "FullyShardedDataParallel" in code and _GROUP_ARG.search(code) is not None


def _find_fsdp1_factories(wrapper: MetadataWrapper, path: str) -> set[str]:
    """Top-level functions of a file that return FSDP1's wrapper: annotated so, or returning ``FSDP(...)``
    (directly or through a name assigned from it in the function); see ``_Dispatch.fsdp1_factories``."""
    names: list[str] = []

    class V(cst.CSTVisitor):
        METADATA_DEPENDENCIES = (QualifiedNameProvider,)

        def is_fsdp1(self, node: cst.CSTNode) -> bool:
            return _resolve(self.get_metadata(QualifiedNameProvider, node, set())) == (FSDP, "")

        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            wrapped = {
                _code(t.target)
                for n in _walk(node.body)
                if isinstance(n, cst.Assign) and isinstance(n.value, cst.Call) and self.is_fsdp1(n.value.func)
                for t in n.targets
            }
            returns = [n.value for n in _walk(node.body) if isinstance(n, cst.Return) and n.value is not None]
            if (node.returns is not None and self.is_fsdp1(node.returns.annotation)) or any(
                (isinstance(v, cst.Call) and self.is_fsdp1(v.func)) or _code(v) in wrapped for v in returns
            ):
                names.append(node.name.value)
            return False  # nested functions and methods are not reached by an import

    wrapper.visit(V())
    parts = [p for p in Path(path).with_suffix("").parts if p not in ("/", "")]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return {".".join([*parts[-k:], name]) for name in names for k in range(1, min(len(parts), 6) + 1)}


def _find_own_methods(code: str, path: str) -> dict[str, str]:
    """``clip_grad_norm_`` / ``no_sync`` the tree defines itself: a method of a class that does not
    subclass FSDP1's wrapper, or a function set as an attribute (``self.clip_grad_norm_ = fn``).
    A call ``x.clip_grad_norm_(...)`` elsewhere may then be that one, not FSDP1's."""
    if not any(f"def {n}" in code or f".{n} =" in code for n in _OWN_METHOD_NAMES):
        return {}
    found: dict[str, str] = {}
    wrapper = MetadataWrapper(cst.parse_module(code))

    class V(cst.CSTVisitor):
        METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider)

        def __init__(self) -> None:
            super().__init__()
            self.scopes: list[str] = []  # "class", "fsdp1 class" (subclasses FSDP1's wrapper) or "def"

        def visit_ClassDef(self, node: cst.ClassDef) -> None:
            bases = [_resolve(self.get_metadata(QualifiedNameProvider, b.value, set())) for b in node.bases]
            self.scopes.append("fsdp1 class" if (FSDP, "") in bases else "class")

        def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
            self.scopes.pop()

        def _add(self, name: str, node: cst.CSTNode) -> None:
            found.setdefault(name, path)  # no line: a rewrite above it would move it (--fix must be idempotent)

        def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
            if node.name.value in _OWN_METHOD_NAMES and self.scopes and self.scopes[-1] == "class" and not _stub(node):
                self._add(node.name.value, node)  # a method (a nested function counts once set as an attribute)
            self.scopes.append("def")

        def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
            self.scopes.pop()

        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            if isinstance(node.target, cst.Attribute) and node.target.attr.value in _OWN_METHOD_NAMES:
                self._add(node.target.attr.value, node)

    wrapper.visit(V())
    return found


def _is_fsdp2_class(qnames: Iterable[Any]) -> bool:
    return any(q.name.startswith("torch.distributed.") and q.name.endswith(".FSDPModule") for q in qnames)


def _find_dispatch(wrapper: MetadataWrapper) -> _Dispatch:
    """The backend-dispatch functions defined in one module (see :class:`_Dispatch`)."""
    found = _Dispatch()

    class V(cst.CSTVisitor):
        METADATA_DEPENDENCIES = (QualifiedNameProvider,)

        def kind(self, cls: cst.CSTNode) -> str | None:
            q = self.get_metadata(QualifiedNameProvider, cls, set())
            if _resolve(q) == (FSDP, ""):
                return "fsdp1"
            return "fsdp2" if _is_fsdp2_class(q) else None

        def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
            params = [p.name.value for p in node.params.params if p.name.value not in ("self", "cls")]
            if not params:
                return
            literal: dict[str, int] = {}
            classes: set[str] = set()
            for n in _walk(node.body):
                if isinstance(n, (cst.Name, cst.Attribute)) and (k := self.kind(n)) is not None:
                    classes.add(k)
                test = m.Call(func=m.Name("isinstance"), args=[m.Arg(m.Name(params[0])), m.Arg()])
                if not (isinstance(n, cst.If) and m.matches(n.test, test)):
                    continue
                body: Sequence[cst.CSTNode] = n.body.body
                if len(body) == 1 and isinstance(body[0], cst.SimpleStatementLine):
                    body = body[0].body
                if (
                    len(body) == 1
                    and isinstance(ret := body[0], cst.Return)
                    and isinstance(ret.value, cst.Integer)
                    and (k := self.kind(cast(cst.Call, n.test).args[1].value)) is not None
                ):
                    literal.setdefault(k, int(ret.value.value.replace("_", ""), 0))
            if len(literal) == 2 and literal["fsdp1"] != literal["fsdp2"]:
                found.versions[node.name.value] = (literal["fsdp1"], literal["fsdp2"])
            elif classes == {"fsdp2"}:
                returns = [n for n in _walk(node.body) if isinstance(n, cst.Return)]
                if returns and all(
                    r.value is not None
                    and (
                        m.matches(r.value, m.Name("True") | m.Name("False"))
                        or m.matches(r.value, m.Call(func=m.Name("isinstance")))
                    )
                    for r in returns
                ):
                    found.fsdp2_tests.add(node.name.value)

    wrapper.visit(V())
    return found


@dataclass(frozen=True)
class _Region:
    """Source span FSDP2 modules never enter, and the test that routes them away."""

    start: tuple[int, int]
    end: tuple[int, int]
    guard: str
    line: int

    def text(self) -> str:
        return (
            f"kept as is: FSDP2 modules never run this code (it is behind `{_short(self.guard)}`, line "
            f"{self.line}; the code has its own FSDP2 path), and FSDP1 modules run it as before"
        )


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
    kwarg_cases: list[tuple[cst.Arg, str | None]] = field(default_factory=list)
    report_notes: list[str] = field(default_factory=list)
    runtime: list[tuple[str, str]] | None = None
    """``(FSDP1 keyword or "**", source)`` for ``BridgeConfig.from_fsdp1(...)``: the values stay the
    user's own expressions and are translated when the code runs."""
    arg_comments: list[tuple[list[str], str | None]] = field(default_factory=list)
    """For each entry of ``runtime``: the comments on the lines before its argument and after it."""
    slot_comments: dict[str, tuple[list[str], str | None]] = field(default_factory=dict)
    """Comments written around the FSDP(...) arguments, by what they became in ``shard(...)``:
    ``"module"``, ``"mesh"`` or a BridgeConfig keyword (comments of an argument that became nothing
    go before the next one that did, or after the last)."""


def _arg(name: str, value: cst.BaseExpression) -> cst.Arg:
    return cst.Arg(
        value=value,
        keyword=cst.Name(name),
        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
    )


def _str(value: str) -> cst.SimpleString:
    return cst.SimpleString(f'"{value}"')


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


class _Scanner(cst.CSTVisitor):
    """Pass 1: find constructs, plan rewrites (nothing changes)."""

    METADATA_DEPENDENCIES = (QualifiedNameProvider, PositionProvider)

    def __init__(
        self,
        path: str,
        code: str,
        assignments: dict[str, cst.BaseExpression],
        name_uses: dict[str, int],
        dispatch: _Dispatch | None = None,
    ) -> None:
        super().__init__()
        self.path = path
        self.dispatch = dispatch or _Dispatch()
        self.group_offload_noted: set[int] = set()  # statements told that rank0_only lost its CPU copy
        self.options_at: cst.CSTNode | None = None  # the state_dict_type block whose options are being written
        self.regions: list[_Region] = []  # code FSDP2 modules never reach: FSDP1 constructs there stay as they are
        self.kept_checks: set[int] = set()  # id(isinstance(x, FSDP)) where it tells the backends apart
        self.lines = code.splitlines()
        self.assignments = assignments
        self.name_uses = name_uses
        self.findings: list[CodeFinding] = []
        self.todos: dict[int, list[str]] = {}  # id(statement) -> TODO texts
        self.conversions: dict[int, _Conversion] = {}  # id(FSDP call) -> conversion
        self.fixable_calls: dict[int, str] = {}  # id(call) -> "method" (no_sync, clip) or "summon"
        self.call_rewrites: dict[int, str] = {}  # id(call) -> replacement source (state dict API)
        self.unwrap_withs: set[int] = set()  # state_dict_type blocks replaced by their (rewritten) body
        self.context_makers: tuple[set[str], set[str]] | None = None  # see _made_context
        self.needs_state_dict_api: set[str] = set()  # names to import from torch.distributed.checkpoint.state_dict
        self.needs_imports: set[tuple[str, str | None]] = set()  # (module, name) other rewrites use
        self.optimizer_moves: dict[int, int] = {}  # id(optimizer statement) -> id(the wrap statement it follows)
        self.name_rewrites: dict[int, str] = {}  # id(Name/Attribute) -> replacement (annotations)
        self.expr_rewrites: dict[int, str] = {}  # id(Attribute) -> replacement expression source
        self.called: set[int] = set()  # id(func) of every call
        self.functions: list[cst.FunctionDef] = []  # enclosing function definitions
        self.module: cst.Module | None = None
        self.ddp_tests: dict[int, set[str]] = {}  # id(function or module) -> objects tested as DDP there
        self.wrapper_kinds: dict[tuple[int, str], set[str]] = {}  # (id(scope), object) -> {"fsdp1", "ddp"}
        self.classes: list[cst.ClassDef] = []  # enclosing class definitions
        self.predicates: set[str] | None = None  # see _fsdp1_predicates
        self.class_bases: set[int] = set()  # id(base expression) of every class definition
        self.partials: set[int] = set()  # id(functools.partial(FSDP, ...)) planned (rewritten or TODO)
        self.annotation_depth = 0
        self.assign_target_depth = 0
        self.attr_drops: set[int] = set()  # id(Attribute) -> replaced by its value (FSDP1 wrapper internals)
        self.removed_stmts: set[int] = set()  # id(statement) -> deleted (a no-op on FSDP2)
        self.planning = True
        self.consumed_partial = False
        self.consumed_nodes: set[int] = set()
        self.stmt_stack: list[cst.CSTNode] = []
        self.uses_fsdp1 = False

    # -- helpers -------------------------------------------------------------------
    def _fsdp1_factory(self, qnames: Iterable[Any]) -> bool:
        """A function of the migrated tree that returns FSDP1's wrapper (``_Dispatch.fsdp1_factories``)."""
        factories = self.dispatch.fsdp1_factories
        return any(q.source is QualifiedNameSource.IMPORT and q.name.lstrip(".") in factories for q in qnames)

    def _qn(self, node: cst.CSTNode) -> tuple[str, str] | None:
        return _resolve(self.get_metadata(QualifiedNameProvider, node, set()))

    def _private(self, node: cst.CSTNode) -> str | None:
        if isinstance(node, cst.Attribute) and self._private(node.value) is not None:
            return None  # reported at its module's name
        return _fsdp1_private(self.get_metadata(QualifiedNameProvider, node, set()))

    def _record(self, node: cst.CSTNode, construct: str, replacement: str, fixable: bool) -> None:
        pos = self.get_metadata(PositionProvider, node)
        # One line each: code quoted in the texts may span lines (a multi-line argument), and a
        # TODO comment must not (libcst refuses a comment with a line break in it).
        construct, replacement = " ".join(construct.split()), " ".join(replacement.split())
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
        self.module = node
        if self.planning:
            self._plan_regions(node)
            self._plan_block(node.body)

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        if self.planning and self._in_region(node) is None:
            self._plan_block(node.body)

    # -- code that already tells the backends apart ----------------------------------
    def _guard(self, test: cst.BaseExpression) -> tuple[str, bool, cst.Call | None] | None:
        """``(backend, pure, check)`` when ``test`` can hold only for modules of one backend: "fsdp1" or
        "fsdp2"; ``pure`` when it is that test alone (not one side of ``and``); ``check`` the
        ``isinstance(x, FSDP)`` call it rests on, if it does."""
        if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
            for side in (test.left, test.right):
                if (g := self._guard(side)) is not None:
                    return g[0], False, g[2]
            return None
        if isinstance(test, cst.Call) and m.matches(test.func, m.Name("isinstance")) and len(test.args) == 2:
            cls = test.args[1].value
            if self._qn(cls) == (FSDP, ""):
                return "fsdp1", True, test
            if _is_fsdp2_class(self.get_metadata(QualifiedNameProvider, cls, set())):
                return "fsdp2", True, None
            return None
        if isinstance(test, cst.Call) and _code(test.func).rsplit(".", 1)[-1] in self.dispatch.fsdp2_tests:
            return "fsdp2", True, None
        if (
            isinstance(test, cst.Comparison)
            and len(test.comparisons) == 1
            and isinstance(test.left, cst.Call)
            and isinstance(test.comparisons[0].operator, cst.Equal)
            and isinstance(comparator := test.comparisons[0].comparator, cst.Integer)
        ):
            versions = self.dispatch.versions.get(_code(test.left.func).rsplit(".", 1)[-1])
            value = int(comparator.value.replace("_", ""), 0)
            if versions is not None and value in versions:
                return ("fsdp1" if value == versions[0] else "fsdp2"), True, None
        return None

    def _add_region(self, first: cst.CSTNode, last: cst.CSTNode, guard: cst.BaseExpression) -> _Region:
        start = self.get_metadata(PositionProvider, first).start
        end = self.get_metadata(PositionProvider, last).end
        region = _Region(
            (start.line, start.column),
            (end.line, end.column),
            _code(guard),
            self.get_metadata(PositionProvider, guard).start.line,
        )
        self.regions.append(region)
        return region

    def _in_region(self, node: cst.CSTNode) -> _Region | None:
        if not self.regions:
            return None
        pos = self.get_metadata(PositionProvider, node).start
        return next((r for r in self.regions if r.start <= (pos.line, pos.column) <= r.end), None)

    def _plan_regions(self, module: cst.Module) -> None:
        """Find the code FSDP2 modules never reach in dual-backend code: branches of an if/elif chain that
        tests ``isinstance(x, FSDPModule)`` (or a helper of the tree that does, see :class:`_Dispatch`)
        that come after that test or test FSDP1 themselves, and the rest of a block after
        ``if <FSDP2 test>: ... return``.  FSDP1 constructs there stay as written: after migration FSDP2
        modules take the code's own FSDP2 path, and an FSDP1 module (fsdp_bridge's fsdp1 backend) runs
        them as before, so rewriting them could only change the FSDP1 path."""
        for node in _walk(module):
            if not isinstance(node, (cst.Module, cst.IndentedBlock)):
                continue
            stmts = node.body
            chains = [self._chain(stmt) for stmt in stmts if isinstance(stmt, cst.If)]
            # Separate ifs of one block (`if isinstance(m, FSDP): return 1` / `if isinstance(m, FSDPModule): ...`)
            # tell the backends apart as an if/elif chain does.
            block_dual = any(g is not None and g[0] == "fsdp2" for chain, _ in chains for _, _, g in chain)
            for chain, tail in chains:
                dual = block_dual
                routed: cst.BaseExpression | None = None
                for test, body, g in chain:
                    fsdp1 = g is not None and g[0] == "fsdp1" and (g[2] is None or dual)
                    if routed is not None or fsdp1:
                        self._add_region(body, body, routed if routed is not None else test)
                        if g is not None and g[2] is not None and dual:
                            self.kept_checks.add(id(g[2]))
                    if routed is None and g is not None and g[0] == "fsdp2" and g[1]:
                        routed = test
                if tail is not None and routed is not None:
                    self._add_region(tail, tail, routed)
            for i, stmt in enumerate(stmts[:-1]):
                if (
                    isinstance(stmt, cst.If)
                    and stmt.orelse is None
                    and (g := self._guard(stmt.test)) is not None
                    and g[0] == "fsdp2"
                    and g[1]
                    and _exits(stmt.body)
                ):
                    self._add_region(stmts[i + 1], stmts[-1], stmt.test)
                    break

    def _chain(self, node: cst.If) -> tuple[list[tuple[cst.BaseExpression, cst.BaseSuite, Any]], cst.BaseSuite | None]:
        """An if/elif chain as (test, body, guard) triples, and its else body."""
        chain = []
        cur = node
        while isinstance(cur.orelse, cst.If):
            chain.append((cur.test, cur.body, self._guard(cur.test)))
            cur = cur.orelse
        chain.append((cur.test, cur.body, self._guard(cur.test)))
        return chain, cur.orelse.body if isinstance(cur.orelse, cst.Else) else None

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
        if self.planning:
            self.called.add(id(func))
            if self._fsdp1_factory(self.get_metadata(QualifiedNameProvider, func, set())):
                self.uses_fsdp1 = True  # the file is handed an FSDP1 model by another file of the tree
        if id(node) in self.kept_checks:
            if not self.planning:
                self.uses_fsdp1 = True
                self._record(
                    node,
                    f"isinstance(..., {_code(node.args[1].value)})",
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
                    or any(self._qn(n) == (FSDP, "") for n in _walk(node.args[1].value))
                )
            ):
                construct = f"isinstance(..., {_short(_code(node.args[1].value), 40)})"
            elif (hit := self._qn(func)) is not None:
                construct = f"FSDP.{hit[1]}(...)" if hit[0] == FSDP and hit[1] else f"{_code(func)}(...)"
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
        if not self.planning:
            self._config_driven(node)
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
        self._plan_wrapper_method_call(node, func, hit)
        return None

    def _plan_state_dict_type_call(self, node: cst.Call, func: cst.BaseExpression, hit: tuple[str, str] | None) -> bool:
        """FSDP1's state_dict_type / set_state_dict_type call; True when it is planned."""
        if hit in ((FSDP, "state_dict_type"), (FSDP, "set_state_dict_type")) and id(func) not in self.consumed_nodes:
            for a in node.args:  # its arguments belong to this construct (a TODO when the block is not rewritten)
                self._consume(a.value)
            if hit[1] == "state_dict_type" and self._plan_state_dict_context(node):
                return True
        return False

    def _plan_wrap_call(
        self, node: cst.Call, func: cst.BaseExpression, hit: tuple[str, str] | None
    ) -> tuple[bool, bool | None]:
        """torch's enable_wrap / wrap; (handled, what visit_Call returns)."""
        if hit == ("enable_wrap", ""):
            if not self._plan_enable_wrap(node):
                self._record(node, "enable_wrap(...)", _NAMES["enable_wrap"], False)
                self._consume(node)  # its wrapper_cls=FSDP is part of this construct
            return True, False
        if hit == ("wrap", "") and id(func) not in self.consumed_nodes:
            if self._under_torch_enable_wrap():
                self._consume(func)
                self._record(
                    node,
                    f"{_code(func)}(...)",
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
                    f"{_code(func)}(...)",
                    "fsdp_bridge.wrap_module(module): inside fsdp_bridge.enable_wrap it shards the module as a unit "
                    "of its own (FSDP2: fully_shard on it), outside it returns the module unchanged, as FSDP1's "
                    "wrap; a module sharded already is returned as it is, so wrap(wrap(m)) is wrap(m)",
                    True,
                )
                return True, None  # its argument may be another wrap(...)
            self._consume(func)
            self._record(
                node,
                f"{_code(func)}(...)",
                "not rewritten: wrap(module, **overrides) changes enable_wrap's arguments for one module; write "
                "fsdp_bridge.ManualWrap(fsdp_bridge.BridgeConfig.from_fsdp1(**{**<enable_wrap's arguments>, "
                "**overrides})).wrap(module) (inside fsdp_bridge.enable_wrap torch's wrap refuses overrides)",
                False,
            )
            return True, None
        return False, None

    def _plan_optim_state_call(self, node: cst.Call, func: cst.BaseExpression, hit: tuple[str, str] | None) -> bool:
        """FSDP1's optimizer-state functions; True when the call is planned."""
        if hit == (FSDP, "optim_state_dict_to_load") and (code := self._optim_to_load(node, None)) is not None:
            self.call_rewrites[id(node)] = code
            self._record(
                node,
                "FSDP.optim_state_dict_to_load(...)",
                f"{code}: loads the state into the optimizer "
                "(torch's set_optimizer_state_dict) and returns optimizer.state_dict(), so loading the "
                "result again changes nothing",
                True,
            )
            return True
        if (
            hit in ((FSDP, "shard_full_optim_state_dict"), (FSDP, "scatter_full_optim_state_dict"))
            and (code := self._shard_full_to_load(node)) is not None
        ):
            self.call_rewrites[id(node)] = code
            self._record(
                node,
                f"FSDP.{hit[1]}(...)",
                f"{code}: loads the full state into the optimizer (torch's set_optimizer_state_dict, "
                "full_state_dict=True"
                + (", rank 0's sent to the others" if hit[1].startswith("scatter") else "")
                + ") and returns optimizer.state_dict(), so loading the result changes nothing",
                True,
            )
            return True
        if hit == (FSDP, "optim_state_dict") and (ctx := self._runtime_state_context()) is not None:
            if (where := self.dispatch.makes_state_dict_context) is not None and (
                mo := _model_and_optim(node)
            ) is not None:
                code = f"fsdp_bridge.optim_state_dict({mo[0]}, {mo[1]})"
                self.call_rewrites[id(node)] = code
                self.needs_imports.add(("fsdp_bridge", None))
                self._consume(node.func)
                self._record(
                    node,
                    "FSDP.optim_state_dict(...)",
                    f"{code}: inside `with {_short(ctx)}:` ({where} makes FSDP1's state-dict contexts, rewritten to "
                    "fsdp_bridge.state_dict_type): FSDP1's own call on FSDP1 models, on FSDP2 torch's "
                    "get_optimizer_state_dict with that block's type",
                    True,
                )
                return True
            self._record(
                node,
                "FSDP.optim_state_dict(...)",
                f"not rewritten: it runs inside `with {_short(ctx)}:`, a context made elsewhere that may set "
                "FSDP1's state-dict type, and FSDP1's optim_state_dict is sharded under SHARDED_STATE_DICT "
                "and full otherwise: use get_optimizer_state_dict(model, optim) for sharded, with "
                "options=StateDictOptions(full_state_dict=True, cpu_offload=True) for full",
                False,
            )
            self._consume(node.func)
            return True
        if (
            hit is not None
            and hit[0] == FSDP
            and hit[1] in ("optim_state_dict", "full_optim_state_dict", "sharded_optim_state_dict")
        ):
            if self._plan_optim_call(node, hit[1]):
                return True
        return False

    def _plan_summon(
        self, node: cst.Call, func: cst.BaseExpression, hit: tuple[str, str] | None
    ) -> tuple[bool, bool | None]:
        """FSDP1's summon_full_params; (handled, what visit_Call returns)."""
        # FSDP1's summon_full_params is a static method, also called through an instance:
        # ``model.summon_full_params(model, writeback=...)`` (FSDPModule has no such method).
        bound_summon = (
            hit is None
            and isinstance(func, cst.Attribute)
            and func.attr.value == "summon_full_params"
            and _code(func.value) != "fsdp_bridge"
            and len(node.args) >= 1
            and node.args[0].keyword is None
            and node.args[0].star == ""
            and not any(q.name.startswith("fsdp_bridge") for q in self.get_metadata(QualifiedNameProvider, func, set()))
        )
        if bound_summon or (hit is not None and hit[0] == FSDP and hit[1] == "summon_full_params"):
            construct = f"{_short(_code(func), 40)}(...)" if bound_summon else "FSDP.summon_full_params(...)"
            ok = (
                len(node.args) >= 1
                and node.args[0].keyword is None
                and all(
                    a.keyword is not None
                    and a.keyword.value in ("writeback", "recurse", "rank0_only", "offload_to_cpu", "with_grads")
                    for a in node.args[1:]
                )
            )
            kws = {a.keyword.value: _code(a.value) for a in node.args[1:] if a.keyword is not None}
            own = kws.get("recurse") == "False"  # the unit's own parameters (around generate, typically)
            if own:
                # The bridge's recurse=False gathers what the unit's forward gathers; FSDP2 has no
                # writeback, rank-0-only or offloaded form of that, so those must be literal False.
                ok = ok and all(
                    kws.get(k, "False") == "False" for k in ("writeback", "rank0_only", "offload_to_cpu", "with_grads")
                )
            else:
                ok = ok and kws.get("recurse", "True") == "True"
            if ok:
                self.fixable_calls[id(node)] = "summon"
            self._record(
                node,
                construct,
                "fsdp_bridge.summon_full_params(model, recurse=False): only the unit's own parameters, as in "
                "FSDP1 (FSDP2: the unit's unshard() / reshard(), what its forward gathers), so forward and "
                "generate may run inside while the nested units gather their own"
                if ok and own
                else _NAMES["summon_full_params"]
                if ok
                else _NAMES["summon_full_params"]
                + "; recurse=False with writeback, rank0_only, offload_to_cpu, with_grads "
                "(or arguments known only at run time) have no FSDP2 form: FSDP2's forward gathers each unit's "
                "parameters itself, so a context held only around forward/generate can be dropped",
                ok,
            )
            self._consume(node.func)
            return True, (False if ok else None)
        return False, None

    def _plan_wrapper_method_call(self, node: cst.Call, func: cst.BaseExpression, hit: tuple[str, str] | None) -> None:
        """The FSDP1 wrapper's no_sync() and clip_grad_norm_(...)."""
        if isinstance(func, cst.Attribute) and func.attr.value in ("no_sync", "clip_grad_norm_") and hit is None:
            qn = {q.name for q in self.get_metadata(QualifiedNameProvider, func, set())}
            if any(q.startswith(("torch.nn", "fsdp_bridge")) for q in qn) or _code(func.value) == "fsdp_bridge":
                return  # torch.nn.utils.clip_grad_norm_ works on FSDP2; fsdp_bridge's are the rewrites
            if self._ddp_tested(func.value):
                return  # DDP's no_sync (the code tells DDP apart), not FSDP1's
            name = func.attr.value
            if (where := self.dispatch.own_methods.get(name)) is not None and self._fsdp1_wrapper(
                node, func.value, by_calls=False
            ) != "fsdp1":
                if _code(func.value) == "self" and self.classes:
                    return  # the class's own method
                recv = _code(func.value)
                # relative to this file: the same text wherever the tree is (--fix stays idempotent on a copy)
                where = where if where == self.path else os.path.relpath(where, os.path.dirname(self.path) or ".")
                self._record(
                    node,
                    f"{_short(recv, 40)}.{name}(...)",
                    f"not rewritten: this tree defines its own {name} (in {where}), so this call may be that one; "
                    f"if {_short(recv, 40)} is the FSDP1-wrapped model, write fsdp_bridge.{name}({_short(recv, 40)}"
                    f"{', ...' if node.args else ''}) (FSDP2 modules have no {name}); if it is your own, keep it",
                    False,
                )
                return
            if func.attr.value == "no_sync" and not node.args:
                self.fixable_calls[id(node)] = "method"
                self._record(node, f"{_code(func.value)}.no_sync()", _NAMES["no_sync"], True)
                return
            if func.attr.value == "clip_grad_norm_" and node.args:
                self.fixable_calls[id(node)] = "method"
                self._record(node, f"{_code(func.value)}.clip_grad_norm_(...)", _NAMES["clip_grad_norm_"], True)
                return

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.functions.append(node)
        self._push(node)  # a TODO in its header (decorators, annotations, defaults) goes above the def

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.functions.pop()
        self.stmt_stack.pop()

    def _ddp_tested(self, obj: cst.BaseExpression) -> bool:
        """``obj`` is tested with ``isinstance(obj, DistributedDataParallel)`` in the enclosing function (or the
        module), and never with ``isinstance(obj, FSDP)``: its ``no_sync`` is DDP's, not FSDP1's."""
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        if scope is None:
            return False
        if id(scope) not in self.ddp_tests:
            ddp: set[str] = set()
            fsdp: set[str] = set()
            for n in _walk(scope):
                if not (isinstance(n, cst.Call) and m.matches(n.func, m.Name("isinstance")) and len(n.args) == 2):
                    continue
                quals = [q for x in _walk(n.args[1].value) for q in self.get_metadata(QualifiedNameProvider, x, set())]
                if any(
                    q.name.startswith("torch.nn.parallel.") and q.name.endswith(".DistributedDataParallel")
                    for q in quals
                ):
                    ddp.add(_code(n.args[0].value))
                if any(_resolve([q]) == (FSDP, "") for q in quals):
                    fsdp.add(_code(n.args[0].value))
            self.ddp_tests[id(scope)] = ddp - fsdp
        return _code(obj) in self.ddp_tests[id(scope)]

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.classes.append(node)
        self._push(node)  # a TODO in its header (bases, decorators) goes above the class
        if self.planning:
            self.class_bases.update(id(b.value) for b in node.bases)

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self.classes.pop()
        self.stmt_stack.pop()

    def _fsdp1_predicates(self) -> set[str]:
        """Functions of this file whose every ``return`` is ``isinstance(<first parameter>, FSDP)``."""
        if self.predicates is None:
            self.predicates = set()
            for n in _walk(self.module) if self.module is not None else ():
                if not (isinstance(n, cst.FunctionDef) and n.params.params):
                    continue
                first = n.params.params[0].name.value
                returns = [r for r in _walk(n.body) if isinstance(r, cst.Return)]
                if returns and all(
                    isinstance(r.value, cst.Call)
                    and m.matches(r.value.func, m.Name("isinstance"))
                    and len(r.value.args) == 2
                    and m.matches(r.value.args[0].value, m.Name(first))
                    and _resolve(self.get_metadata(QualifiedNameProvider, r.value.args[1].value, set())) == (FSDP, "")
                    for r in returns
                ):
                    self.predicates.add(n.name.value)
        return self.predicates

    def _test_kinds(self, test: cst.BaseExpression, target: str) -> set[str]:
        """Wrapper kinds that ``test`` checks ``target`` for: ``isinstance(target, FSDP | DDP)`` (in ``or``/``and``
        combinations too) or a helper of this file that returns ``isinstance(x, FSDP)``."""
        kinds: set[str] = set()
        for n in _walk(test):
            if not isinstance(n, cst.Call) or not n.args or _code(n.args[0].value) != target:
                continue
            if m.matches(n.func, m.Name("isinstance")) and len(n.args) == 2:
                for x in _walk(n.args[1].value):
                    quals = self.get_metadata(QualifiedNameProvider, x, set())
                    if _resolve(quals) == (FSDP, ""):
                        kinds.add("fsdp1")
                    if any(q.name.endswith(".DistributedDataParallel") for q in quals):
                        kinds.add("ddp")
            elif isinstance(n.func, cst.Name) and n.func.value in self._fsdp1_predicates():
                kinds.add("fsdp1")
        return kinds

    def _isinstance_branch(self, node: cst.CSTNode, obj: cst.BaseExpression) -> set[str]:
        """The wrapper kinds tested for ``obj`` by the innermost guard holding ``node``: the body of an
        ``if``/``elif`` or of a conditional expression, or what follows an ``and``."""
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        if scope is None:
            return set()
        target, here = _code(obj), self.get_metadata(PositionProvider, node).start
        best: tuple[Any, set[str]] | None = None
        for n in _walk(scope):
            guarded: list[tuple[cst.BaseExpression, cst.CSTNode]] = []
            if isinstance(n, cst.If):
                guarded.append((n.test, n.body))
            elif isinstance(n, cst.IfExp):
                guarded.append((n.test, n.body))
            elif isinstance(n, cst.BooleanOperation) and isinstance(n.operator, cst.And):
                guarded.append((n.left, n.right))
            for test, body in guarded:
                span = self.get_metadata(PositionProvider, body)
                start, end = (span.start.line, span.start.column), (span.end.line, span.end.column)
                if not start <= (here.line, here.column) <= end:
                    continue
                kinds = self._test_kinds(test, target)
                if kinds and (best is None or start > best[0]):
                    best = (start, kinds)
        return best[1] if best is not None else set()

    def _fsdp1_wrapper(self, node: cst.CSTNode, obj: cst.BaseExpression, *, by_calls: bool = True) -> str:
        """Whether ``obj`` at ``node`` is FSDP1's wrapper: "fsdp1", "ambiguous" (DDP's too), or "" (not shown).

        A guard around ``node`` decides (``if isinstance(obj, FSDP):``, ``is_fsdp(obj) and ...``); else the
        function (for ``self.x``: the class) shows it: assigned ``FSDP(...)``/``wrap(...)`` above ``node``,
        ``assert isinstance(obj, FSDP)``, an ``obj: FSDP`` annotation, or FSDP1's ``clip_grad_norm_``
        called on it (DDP has none). DistributedDataParallel assigned or tested there makes it ambiguous."""
        branch = self._isinstance_branch(node, obj)
        if branch:
            return "" if branch == {"ddp"} else ("fsdp1" if branch == {"fsdp1"} else "ambiguous")
        kinds = self._wrapper_kinds(obj, by_calls=by_calls, before=node)
        if "fsdp1" not in kinds:
            return ""
        return "ambiguous" if "ddp" in kinds else "fsdp1"

    def _wrapper_kinds(
        self, obj: cst.BaseExpression, *, by_calls: bool = True, before: cst.CSTNode | None = None
    ) -> set[str]:
        """See :meth:`_fsdp1_wrapper` (the evidence outside guards)."""
        target = _code(obj)
        scope: cst.CSTNode | None = self.functions[-1] if self.functions else self.module
        if target.startswith("self.") and self.classes:
            scope = self.classes[-1]
        if scope is None:
            return set()
        limit = None
        if before is not None and isinstance(scope, cst.FunctionDef):
            # An assignment counts only above ``before``: ``model.load_state_dict(sd)`` then
            # ``model = FSDP(model)`` loads into the plain module.
            limit = self.get_metadata(PositionProvider, before).start
        key = (id(scope), f"{target} {by_calls} {(limit.line, limit.column) if limit else ''}")
        if key in self.wrapper_kinds:
            return self.wrapper_kinds[key]

        def kind(expr: cst.BaseExpression) -> set[str]:
            found = set()
            for x in _walk(expr):
                quals = self.get_metadata(QualifiedNameProvider, x, set())
                if _resolve(quals) in ((FSDP, ""), ("wrap", "")) or self._fsdp1_factory(quals):
                    found.add("fsdp1")
                if any(
                    q.name.startswith("torch.nn.parallel.") and q.name.endswith(".DistributedDataParallel")
                    for q in quals
                ):
                    found.add("ddp")
            return found

        kinds: set[str] = set()
        for n in _walk(scope):
            if limit is not None and isinstance(n, (cst.IndentedBlock, cst.Module)):
                # Assigned in a statement that ends above ``before``, in a block that holds it: not in a sibling
                # branch (``if fsdp1: m = FSDP(m)`` then ``elif fsdp2: m.state_dict()`` is the plain module).
                span = self.get_metadata(PositionProvider, n)
                if (
                    not (span.start.line, span.start.column)
                    <= (limit.line, limit.column)
                    <= (
                        span.end.line,
                        span.end.column,
                    )
                ):
                    continue
                for stmt in n.body:  # statements that end before it (an if/else above: either branch's value)
                    end = self.get_metadata(PositionProvider, stmt).end
                    if (end.line, end.column) > (limit.line, limit.column):
                        continue
                    if (
                        isinstance(stmt, cst.If)
                        and isinstance(stmt.test, cst.UnaryOperation)
                        and isinstance(stmt.test.operator, cst.Not)
                        and _exits(stmt.body)
                    ):
                        kinds |= self._test_kinds(stmt.test.expression, target)  # ``if not isinstance(x, FSDP): raise``
                    for small in _walk(stmt):
                        if (
                            isinstance(small, cst.Assign)
                            and isinstance(small.value, cst.Call)
                            and any(_code(t.target) == target for t in small.targets)
                        ):
                            kinds |= kind(small.value.func)
            elif limit is None and isinstance(n, cst.Assign) and isinstance(n.value, cst.Call):
                if any(_code(t.target) == target for t in n.targets):
                    kinds |= kind(n.value.func)
            elif isinstance(n, cst.Assert):
                kinds |= self._test_kinds(n.test, target)
            elif (
                isinstance(n, (cst.For, cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp))
                and before is not None
            ):
                # ``for m in FSDP.fsdp_modules(model):`` (or a comprehension): m is an FSDP1 unit in there
                loops: list[cst.For | cst.CompFor] = []
                part: cst.For | cst.CompFor | None = n if isinstance(n, cst.For) else n.for_in
                while part is not None:
                    loops.append(part)
                    part = part.inner_for_in if isinstance(part, cst.CompFor) else None
                span, at = self.get_metadata(PositionProvider, n), self.get_metadata(PositionProvider, before).start
                if (span.start.line, span.start.column) <= (at.line, at.column) <= (
                    span.end.line,
                    span.end.column,
                ) and any(
                    _code(loop.target) == target
                    and isinstance(loop.iter, cst.Call)
                    and self._qn(loop.iter.func) == (FSDP, "fsdp_modules")
                    for loop in loops
                ):
                    kinds.add("fsdp1")
            elif isinstance(n, cst.Call):
                f = n.func
                if m.matches(f, m.Name("isinstance")) and len(n.args) == 2 and _code(n.args[0].value) == target:
                    kinds |= kind(n.args[1].value) & {"ddp"}  # an FSDP test decides only inside its guard
                elif (
                    by_calls
                    and isinstance(f, cst.Attribute)
                    and f.attr.value == "clip_grad_norm_"
                    and _code(f.value) == target
                    and "clip_grad_norm_" not in self.dispatch.own_methods
                ):
                    kinds.add("fsdp1")  # DDP has no clip_grad_norm_
            elif isinstance(n, cst.Param) and n.name.value == target and n.annotation is not None:
                kinds |= kind(n.annotation.annotation)
        self.wrapper_kinds[key] = kinds
        return kinds

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self.assign_target_depth += 1

    def leave_AssignTarget(self, original_node: cst.AssignTarget) -> None:
        self.assign_target_depth -= 1

    def _plan_set_state_dict_type(self, node: cst.Call) -> bool:
        """``FSDP.set_state_dict_type(M, SHARDED_STATE_DICT[, ShardedStateDictConfig()])`` as a statement of
        its own is deleted: an FSDP2 module's ``state_dict()`` already holds sharded (DTensor) values."""
        named = _named_args(node, ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config"))
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
            if cfg is not None and (not self._literal_config(cfg) or self._config_flag(cfg, "offload_to_cpu", False)):
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

    def visit_Annotation(self, node: cst.Annotation) -> None:
        self.annotation_depth += 1

    def leave_Annotation(self, original_node: cst.Annotation) -> None:
        self.annotation_depth -= 1

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        return self._reference(node)

    def visit_Name(self, node: cst.Name) -> bool:
        return self._reference(node)

    def _reference(self, node: cst.BaseExpression) -> bool:
        if self.planning:
            return True
        if (region := self._in_region(node)) is not None:
            if isinstance(node, cst.Attribute) and node.attr.value in _INTERNAL_ATTRS and self.uses_fsdp1:
                self._record(node, f"{_code(node)} (an FSDP1 internal)", region.text(), True)
                return True
            if (hit := self._qn(node)) is None:
                if self.uses_fsdp1 and (private := self._private(node)) is not None:
                    self._record(node, f"{_code(node)} ({private})", region.text(), True)
                    return False
                return True
            self.uses_fsdp1 = True
            self._record(node, f"FSDP.{hit[1]}" if hit[0] == FSDP and hit[1] else _code(node), region.text(), True)
            return False
        if isinstance(node, cst.Attribute) and node.attr.value in _INTERNAL_ATTRS and self.uses_fsdp1:
            if node.attr.value == "_fsdp_wrapped_module" and not self.assign_target_depth:
                self.attr_drops.add(id(node))
                self._record(
                    node,
                    f"{_code(node)} (an FSDP1 internal)",
                    f"{_code(node.value)}: FSDP2 does not wrap, the module is itself (an FSDPModule)",
                    True,
                )
                return True
            self._record(node, f"{_code(node)} (an FSDP1 internal)", _INTERNAL_ATTRS[node.attr.value], False)
            return True
        if (
            isinstance(node, cst.Attribute)
            and node.attr.value in _WRAPPER_ATTRS
            and self.uses_fsdp1
            and not self.assign_target_depth
            and id(node) not in self.called
            and id(node) not in self.consumed_nodes
            and self._qn(node) is None
            and self._fsdp1_wrapper(node, node.value) != ""
        ):
            self._record(
                node,
                f"{_code(node)} (an FSDP1 wrapper attribute)",
                f"not rewritten: FSDPModule has no {node.attr.value}; {_WRAPPER_ATTRS[node.attr.value]}",
                False,
            )
            return True
        if (
            isinstance(node, cst.Attribute)
            and node.attr.value == "module"
            and self.uses_fsdp1
            and not self.assign_target_depth
            and id(node) not in self.called
            and (wrapper := self._fsdp1_wrapper(node, node.value)) != ""
        ):
            # FSDP1's wrapper holds the model as .module; FSDP2 does not wrap (the sharded model is the module).
            obj = _code(node.value)
            if wrapper == "ambiguous":
                # DDP's wrapper keeps .module; FSDP2's sharded model is the module itself.
                code = f"({obj}.module if isinstance({obj}, torch.nn.parallel.DistributedDataParallel) else {obj})"
                stmt = self.stmt_stack[-1] if self.stmt_stack else None
                if stmt is not None and code[1:-1] in _code(stmt):
                    return True  # written by a first --fix
                self.expr_rewrites[id(node)] = code
                self.needs_imports.add(("torch", None))
                self._record(
                    node,
                    f"{_code(node)} (the wrapped module)",
                    f"{code}: {obj} may be DistributedDataParallel's wrapper (its .module) or, on the FSDP path, "
                    "an FSDP2 module, which does not wrap (the module itself)",
                    True,
                )
                return True
            self.attr_drops.add(id(node))
            self._record(
                node,
                f"{_code(node)} (the wrapped module)",
                f"{obj}: FSDP2 does not wrap, the sharded model is the module itself (FSDPModule has no .module)",
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
            and _code(node.value) != "fsdp_bridge"
            and not self._ddp_tested(node.value)
            and not any(
                q.name.startswith(("torch.nn", "fsdp_bridge"))
                for q in self.get_metadata(QualifiedNameProvider, node, set())
            )
        ):
            # ``ctx = model.no_sync`` (called later as ``ctx()``): FSDPModule has no no_sync.
            code = f"functools.partial(fsdp_bridge.no_sync, {_code(node.value)})"
            self.expr_rewrites[id(node)] = code
            self.needs_imports.update({("functools", None), ("fsdp_bridge", None)})
            self._record(
                node,
                f"{_code(node)} (not called here)",
                f"{code}: calling it gives fsdp_bridge.no_sync({_code(node.value)}); " + _fsdp2("no_sync"),
                True,
            )
            return True
        hit = self._qn(node)
        if hit is None:
            if self.uses_fsdp1 and (private := self._private(node)) is not None:
                if private.rsplit(".", 1)[-1] in _NAME_HELPERS:
                    text = (
                        "kept: FSDP1's parameter-name prefix helper still works; FSDP2 names have no wrapper "
                        "prefix, so it changes nothing there"
                    )
                    self._record(node, f"{_code(node)} ({private})", text, True)
                else:
                    self._record(node, f"{_code(node)} ({private})", _private_text(private), False)
                return False
            return True
        self.uses_fsdp1 = True
        if id(node) in self.consumed_nodes:
            return False
        kind, member = hit
        if kind == FSDP and member == "" and self.annotation_depth:
            self.needs_imports.add(("torch.distributed.fsdp", "FSDPModule"))
            self.name_rewrites[id(node)] = "FSDPModule"
            self._record(node, f"{_code(node)} (annotation)", "FSDPModule (FSDP2 units are FSDPModule)", True)
            return False
        if kind == FSDP and member == "" and id(node) in self.class_bases:
            self._record(
                node,
                f"class ...({_code(node)})",
                "not rewritten: a subclass of FSDP1's wrapper has no FSDP2 form (FSDP2 does not wrap: fully_shard "
                "makes the module itself an FSDPModule); build the model unwrapped, shard it with "
                "fsdp_bridge.shard(model, fsdp_bridge.BridgeConfig.from_fsdp1(**<the subclass's constructor "
                "arguments>)), and move the subclass's overrides into the code that calls them",
                False,
            )
            return False
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
            self._record(node, _code(node), text, not reentrant)
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
            self._record(node, _code(node), _NAMES[kind], True)
            return False
        if kind in _KEPT:
            reader = (
                "fsdp_bridge.state_dict_options"
                if kind.endswith("StateDictConfig") or kind == "StateDictType"
                else "fsdp_bridge.BridgeConfig.from_fsdp1"
            )
            self._record(
                node,
                _code(node),
                f"kept: {_KEPT[kind]}; {reader} reads it when the code runs, with FSDP1's meaning",
                True,
            )
            return False
        self._record(node, _code(node), _NAMES[kind], False)
        return False

    def _plan_scaler_class(self, node: cst.BaseExpression) -> bool:
        """FSDP1's ShardedGradScaler named but not called here (passed on, aliased, an annotation)."""
        self.needs_imports.add(("torch", None))
        self.expr_rewrites[id(node)] = "torch.amp.GradScaler"
        if self.annotation_depth:  # a type annotation: the scaler FSDP2 code makes
            self._record(node, f"{_code(node)} (a type annotation)", "torch.amp.GradScaler", True)
            return False
        # The class itself, passed on or re-exported (``GradScaler = ShardedGradScaler``): same constructor
        # arguments but process_group.
        self._record(
            node,
            f"{_code(node)} (the class, not called here)",
            "torch.amp.GradScaler: the same constructor arguments except process_group= (a call that passes it "
            f"fails with TypeError; FSDP2 needs no group) ({_fsdp2_any('ShardedGradScaler')})",
            True,
        )
        return False

    # -- FSDP(...) -----------------------------------------------------------------
    def _plan_fsdp(self, call: cst.Call) -> None:
        consumed_before = set(self.consumed_nodes)
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
        self.conversions[id(call)] = conv
        fixable = not conv.blockers
        if fixable and conv.runtime is None:
            for name in conv.consumed:
                if self.name_uses.get(name, 0) > 2:  # used elsewhere too: keep the assignment
                    continue
                self.consumed_nodes.add(id(self.assignments[name]))
        if conv.runtime is not None:
            self._record(call, f"{_code(call.func)}(...)", self._runtime_text(conv), True)
            rewritten = dict(conv.runtime or [])
            for a in call.args:
                kw = a.keyword.value if a.keyword is not None else None
                if kw is None or kw in ("module", "device_mesh"):
                    continue
                if kw == "backward_prefetch" and rewritten.get(kw) == '"pre"':
                    continue  # reported with its TODO above
                self._runtime_kwarg_finding(a, call.args)
            return
        text = _NAMES[FSDP] if fixable else "not rewritten: " + "; ".join(conv.blockers)
        self._record(call, f"{_code(call.func)}(...)", text, fixable)
        for a, case in conv.kwarg_cases:
            self._kwarg_finding(a, case, fixable)
        for note in conv.report_notes:
            self._record(call, "backward_prefetch", note, False)

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
        construct = f"{_code(node.func)}({_code(node.args[0].value)}, ...)"
        rest = node.args[1:]
        blockers = [
            f"{_code(a.value)}: positional arguments after FSDP (the module is given when the wrapper is called)"
            for a in rest
            if a.keyword is None and a.star != "**"
        ] + [
            f"{a.keyword.value}=: module objects fixed in the wrapper; name them for the bridge: "
            "BridgeConfig(ignored_modules=['path.to.module' or 'ClassName'])"
            for a in rest
            if a.keyword is not None and a.keyword.value in ("module", *_IGNORED_KWARGS)
        ]
        conv = _Conversion()
        runtime = None
        if not blockers:
            probe = node.with_changes(args=[cst.Arg(cst.Name("module")), *rest])
            runtime = self._plan_runtime(probe, conv)
            blockers = conv.blockers
        if runtime is None:
            self._record(node, construct, "not rewritten: " + "; ".join(blockers), False)
            return True
        i1, i2 = "    ", "        "
        lines = [f"{_code(node.func)}(", f"{i1}fsdp_bridge.shard,", f"{i1}config=fsdp_bridge.BridgeConfig.from_fsdp1("]
        conv.runtime = runtime
        lines += _runtime_lines(conv, i2)
        lines.append(f"{i1}),")
        if conv.mesh is not None:
            lines.append(f"{i1}mesh={_code(conv.mesh)},")
        lines.append(")")
        self.call_rewrites[id(node)] = "\n".join(lines)
        self.needs_imports.add(("fsdp_bridge", None))
        names = _runtime_names(runtime)
        self._record(
            node,
            construct,
            f"{_code(node.func)}(fsdp_bridge.shard, config=fsdp_bridge.BridgeConfig.from_fsdp1(...)"
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
        conv = _Conversion()
        probe = node.with_changes(args=[cst.Arg(cst.Name("module")), *rest])
        runtime = self._plan_runtime(probe, conv)
        if runtime is None:
            self._record(node, "enable_wrap(...)", "not rewritten: " + "; ".join(conv.blockers), False)
            self._consume(node)
            return True
        self._consume(node.func)
        for a in node.args:
            self._consume(a.value)
        items = [f"**{code}" if kw == "**" else f"{kw}={code}" for kw, code in runtime]
        config = f"fsdp_bridge.BridgeConfig.from_fsdp1({', '.join(items)})"
        mesh = f", mesh={_code(conv.mesh)}" if conv.mesh is not None else ""
        code = f"fsdp_bridge.enable_wrap({config}{mesh})"
        if "\n" in code or len(code) > 100 or any(lead or trail for lead, trail in conv.arg_comments):
            i1, i2 = "    ", "        "
            conv.runtime = runtime
            lines = ["fsdp_bridge.enable_wrap(", f"{i1}fsdp_bridge.BridgeConfig.from_fsdp1("]
            lines += _runtime_lines(conv, i2)
            lines.append(f"{i1}),")
            if conv.mesh is not None:
                lines.append(f"{i1}mesh={_code(conv.mesh)},")
            lines.append(")")
            code = "\n".join(lines)
        self.call_rewrites[id(node)] = code
        self.needs_imports.add(("fsdp_bridge", None))
        names = _runtime_names(runtime)
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

    def _plan_runtime(self, call: cst.Call, static: _Conversion) -> list[tuple[str, str]] | None:
        """FSDP1's arguments by name for ``BridgeConfig.from_fsdp1``; None when they cannot be named."""
        out: list[tuple[str, str]] = []
        static.arg_comments = []
        static.slot_comments = {}

        def add(kw: str, code: str) -> None:  # an argument kept, with the comments written around it
            out.append((kw, code))
            static.arg_comments.append(_comments_around(call, i))

        for i, a in enumerate(call.args):
            if a.star == "*":
                static.blockers.append(f"*{_code(a.value)}: positional arguments unpacked at run time")
                return None
            if a.star == "**":
                add("**", _code(a.value))
                continue
            name = a.keyword.value if a.keyword else (_FSDP1_POSITIONAL[i] if i < len(_FSDP1_POSITIONAL) else None)
            if name is None:
                static.blockers.append(f"positional argument {i + 1}: FullyShardedDataParallel takes no more")
                return None
            if name not in _FSDP1_POSITIONAL and name != "ignored_parameters":  # the only reason shown
                static.blockers = [f"{name}={_short(_code(a.value), 40)}: not an argument of FullyShardedDataParallel"]
                return None
            if name in ("module", "device_mesh"):  # out of the config: their comments go with them
                static.module, static.mesh = (a.value, static.mesh) if name == "module" else (static.module, a.value)
                lead, trail = _comments_around(call, i)
                if lead or trail:
                    static.slot_comments["module" if name == "module" else "mesh"] = (lead, trail)
            elif name == "process_group" and not m.matches(a.value, m.Name("None")):
                # FSDP2 shards over a DeviceMesh: the group (a data-parallel group of a model-parallel
                # setup, or HYBRID_SHARD's pair) becomes one when the code runs, passed as shard(mesh=).
                if any(b.keyword is not None and b.keyword.value == "device_mesh" for b in call.args):
                    static.blockers.append("process_group= with device_mesh=: FSDP1 takes one of them; drop one")
                    return None
                self.needs_imports.add(("fsdp_bridge", None))
                static.mesh = cst.parse_expression(f"fsdp_bridge.mesh_from_process_group({_code(a.value)})")
            elif name in _IGNORED_KWARGS and not m.matches(a.value, m.Name("None")):
                # modules or parameters (torch 2.0's ignored_parameters: ignored_states of parameters)
                names = self._module_paths(a.value, static.module)
                if names is not None:
                    add("ignored_modules", repr(names))
                elif static.module is not None:  # module objects known at run time: their paths, then
                    self.needs_imports.add(("fsdp_bridge", None))
                    add("ignored_modules", f"fsdp_bridge.module_names({_code(static.module)}, {_code(a.value)})")
                else:
                    static.blockers.append(
                        f"{name}={_code(a.value)}: name the modules for the bridge: "
                        "BridgeConfig(ignored_modules=['path.to.module' or 'ClassName'])"
                    )
                    return None
            elif name == "backward_prefetch" and self._member(a.value, "BackwardPrefetch") != "BACKWARD_PRE":
                member = "NONE" if m.matches(a.value, m.Name("None")) else self._member(a.value, "BackwardPrefetch")
                if member in ("BACKWARD_POST", "NONE"):
                    # FSDP2 has one backward order (BACKWARD_PRE's): say so where it changes.
                    note = f"backward_prefetch={_code(a.value)} has no FSDP2 equivalent; using 'pre': " + _fsdp2_case(
                        "backward_prefetch", "post" if member == "BACKWARD_POST" else "none"
                    )
                    self._record(a, "backward_prefetch", note, False)
                    add(name, '"pre"')
                else:
                    add(name, _code(a.value))
            else:
                add(name, _code(a.value))
        if static.module is None:
            return None
        return out

    def _module_paths(self, value: cst.BaseExpression, module: cst.BaseExpression | None) -> list[str] | None:
        """``[model.lm_head, model.model.embed]`` -> ``["lm_head", "model.embed"]`` when every entry is an
        attribute path under the module being wrapped."""
        if module is None or not isinstance(value, (cst.List, cst.Tuple, cst.Set)):
            return None
        root = _code(module)
        names = []
        for element in value.elements:
            text = _code(element.value)
            if not text.startswith(root + ".") or not all(p.isidentifier() for p in text[len(root) + 1 :].split(".")):
                return None
            names.append(text[len(root) + 1 :])
        return names

    def _runtime_text(self, conv: _Conversion) -> str:
        names = _runtime_names(conv.runtime or [])
        return (
            "fsdp_bridge.shard(model, fsdp_bridge.BridgeConfig.from_fsdp1(...)"
            + (", mesh=...)" if conv.mesh is not None else ")")
            + f": {', '.join(names) or 'no options'} kept as written and translated when the code runs "
            "(FSDP1's meaning, exactly; print fsdp_bridge.get_bridge(model).report for what each became)"
        )

    def _runtime_kwarg_finding(self, a: cst.Arg, siblings: Sequence[cst.Arg] = ()) -> None:
        kw = a.keyword.value if a.keyword else ""
        pos = self.get_metadata(PositionProvider, a)
        value = _code(a.value)
        sync = [_code(b.value) for b in siblings if b.keyword is not None and b.keyword.value == "sync_module_states"]
        if self._plan_param_init_fn(a, kw, value, sync):
            return
        described = self._describe_value(kw, a.value)
        group = [b for b in siblings if b.keyword is not None and b.keyword.value == "process_group"]
        if kw == "sharding_strategy" and group and _code(group[0].value) != "None":
            # The mesh is the process group's (mesh_from_process_group), not one over every rank.
            described = described.replace("mesh over all ranks", "mesh over the ranks of process_group=")
        self.findings.append(
            CodeFinding(self.path, pos.start.line, pos.start.column, f"{kw}={_short(value)}", described, True)
        )

    def _plan_param_init_fn(self, a: cst.Arg, kw: str, value: str, sync: list[str]) -> bool:
        """param_init_fn= for meta-device modules without sync_module_states; True when recorded."""
        if kw == "param_init_fn" and value != "None" and (not sync or sync[0] == "False"):
            # FSDP1 ran the function on every rank's meta-device modules (their own init, no broadcast):
            # BridgeConfig.from_fsdp1 keeps it and runs it so, in FSDP1's order, before sharding.
            self._record(
                a,
                f"{kw}={_short(value)}",
                "kept: fsdp_bridge.BridgeConfig.from_fsdp1 runs it as FSDP1 did, on each rank's meta-device "
                "modules (unit by unit, children first, each unit's modules breadth-first) before sharding, so "
                "the same seed gives FSDP1's weights on either backend; a real-device model is left as it is",
                True,
            )
            return True
        return False

    def _describe_value(self, kw: str, value: cst.BaseExpression) -> str:
        """What an FSDP1 argument's value becomes, as far as the source shows it."""
        option = _KWARG_OPTION.get(kw, kw)
        if kw == "ignored_parameters":
            return (
                "torch 2.0's name of ignored_states (torch >= 2.1 refuses it): parameter objects -> their paths in "
                "ignored_modules (fsdp_bridge.module_names, when the code runs): not sharded, gradients not reduced "
                "across ranks, as in FSDP1"
            )
        if kw not in _FSDP1_POSITIONAL:
            return "not an argument of FullyShardedDataParallel in torch >= 2.1 (see the FSDP(...) line)"
        if kw == "sharding_strategy":
            member = self._member(value, "ShardingStrategy")
            if member in _STRATEGIES:
                return f"{member}: {_fsdp2_case('strategy', _STRATEGIES[member])}"
            target = _code(value)
            assigned = sorted(
                {
                    member
                    for n in (_walk(self.module) if self.module is not None else ())
                    if isinstance(n, cst.Assign)
                    and any(_code(t.target) == target for t in n.targets)
                    and (member := self._member(n.value, "ShardingStrategy")) in _STRATEGIES
                }
            )
            if assigned:  # the values this file gives it: say what each becomes
                cases = "; ".join(f"{mm}: {_fsdp2_case('strategy', _STRATEGIES[mm])}" for mm in assigned)
                return f"chosen at run time among {', '.join(assigned)} (assigned in this file); {cases}"
            return (
                "known at run time; each strategy keeps its meaning (FULL_SHARD / SHARD_GRAD_OP a 1D mesh, "
                "resharded after forward or not; HYBRID_* a (replicate, shard) mesh; NO_SHARD a (world, 1) mesh); "
                "fsdp_bridge.get_bridge(model).report shows what it became"
            )
        if kw == "auto_wrap_policy":
            return (
                "the same units FSDP1 wraps: fully_shard on each, bottom-up, then the root "
                "(policy functions run FSDP1's own auto-wrap recursion)"
            )
        if kw == "mixed_precision":
            return "MixedPrecision's param/reduce/buffer dtypes -> MixedPrecisionPolicy (buffers cast once)"
        if kw == "cpu_offload":
            return (
                "CPUOffload(offload_params=True) -> CPUOffloadPolicy on a GPU run; refused with the reason on "
                "a CPU-only run; offload_params=False -> nothing offloaded"
            )
        if kw == "backward_prefetch":
            return "BACKWARD_PRE is FSDP2's implicit order; BACKWARD_POST / None are refused on FSDP2 with the reason"
        if kw == "use_orig_params":
            return "FSDP2 parameters always are the original ones"
        if kw in ("ignored_modules", "ignored_states"):
            return (
                "module (or parameter) objects -> their paths in the model (fsdp_bridge.module_names, when the "
                "code runs): not sharded, gradients not reduced across ranks, as in FSDP1"
            )
        if kw == "process_group" and _code(value) != "None":
            return (
                "shard(..., mesh=fsdp_bridge.mesh_from_process_group(<the group>)) when the code runs: a group of "
                "some ranks (the data-parallel group of a model-parallel setup) -> a 1D DeviceMesh over them, each "
                "group sharding its own copy as in FSDP1; HYBRID_SHARD's (intra-node, inter-node) pair -> a 2D "
                "(replicate, shard) mesh of those groups; the world group -> the bridge's mesh over every rank"
            )
        if kw == "process_group":
            return "None: the bridge's mesh over every rank"
        if kw in ("forward_prefetch", "limit_all_gathers", "sync_module_states"):
            return (
                f"{kw}={_code(value)}: " + _fsdp2_case(option, _code(value).lower())
                if _code(value) in ("True", "False") and kw != "limit_all_gathers"
                else _fsdp2_any(option)
            )
        if kw == "device_id":
            return "the device of the run (CUDA index -> cuda, torch.device('cpu') -> cpu)"
        if kw == "param_init_fn":
            return (
                "not called by the bridge: with sync_module_states=True, meta-device tensors of ranks other than "
                "0 are materialised and take rank 0's values and dtypes (what a to_empty + cast param_init_fn "
                "was for); rank 0 must hold real weights (shard() refuses a meta-device rank 0 with the fix)"
            )
        return _fsdp2_any(option)

    def _plan_static(self, call: cst.Call) -> _Conversion:
        conv = _Conversion()
        self._consume(call.func)
        line = self.lines[self.get_metadata(PositionProvider, call).start.line - 1]
        conv.indent = line[: len(line) - len(line.lstrip())]
        config: list[cst.Arg] = [_arg("backend", _str("fsdp2"))]
        strategy_name: str | None = "full_shard"
        has_wrap = False
        notes_for_report: list[str] = []
        kwarg_nodes: list[tuple[cst.Arg, str | None]] = []
        pending: list[str] = []  # comments of arguments that became nothing, for the next slot
        for i, a in enumerate(call.args):
            kw = a.keyword.value if a.keyword else None
            if a.star:
                conv.blockers.append(f"{a.star}{_code(a.value)}: arguments unpacked at run time")
                continue
            before = (len(config), conv.mesh)
            lead, trail = _comments_around(call, i)
            pending += lead
            if (kw is None and i == 0) or kw == "module":
                conv.module = a.value
                if pending or trail:
                    conv.slot_comments["module"] = (pending, trail)
                pending = []
                continue
            if kw is None:
                conv.blockers.append(f"positional argument {i + 1} ({_code(a.value)}): pass it by keyword")
                continue
            kwarg_nodes.append((a, None))
            value = (
                self._follow(a.value, conv)
                if kw
                in ("auto_wrap_policy", "mixed_precision", "cpu_offload", "sharding_strategy", "backward_prefetch")
                else a.value
            )
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
                    kwarg_nodes[-1] = (
                        a,
                        "none" if _code(wrap) == '"none"' else "auto / classes / min_num_params / callable",
                    )
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
                    note = f"backward_prefetch={_code(a.value)} has no FSDP2 equivalent; using 'pre': " + _fsdp2_case(
                        "backward_prefetch", "post" if member == "BACKWARD_POST" else "none"
                    )
                    conv.notes.append(note)
                    notes_for_report.append(note)
                else:
                    conv.blockers.append(f"backward_prefetch={_code(a.value)}: not a BackwardPrefetch member")
                config.append(_arg("backward_prefetch", _str("pre"))) if member in (
                    "BACKWARD_PRE",
                    "BACKWARD_POST",
                    "NONE",
                ) else None
            elif kw in ("forward_prefetch", "limit_all_gathers", "sync_module_states"):
                config.append(_arg(kw, a.value))
                literal = _code(a.value)
                kwarg_nodes[-1] = (
                    a,
                    "any" if kw == "limit_all_gathers" else literal.lower() if literal in ("True", "False") else None,
                )
            elif kw == "use_orig_params":
                pass  # FSDP2 parameters are always the original ones
            elif kw == "device_id":
                config.append(_arg("device", _str("cpu" if "cpu" in _code(a.value) else "auto")))
            elif kw == "device_mesh":
                conv.mesh = a.value
            else:
                conv.blockers.append(
                    f"{kw}={_code(a.value)}: no mechanical BridgeConfig equivalent "
                    f"({_fsdp2_any(_KWARG_OPTION.get(kw, kw))})"
                )
            slot = (  # what this argument became (the module's comments are taken above)
                "mesh"
                if conv.mesh is not before[1]
                else _code(config[-1].keyword)
                if len(config) > before[0] and config[-1].keyword is not None
                else None
            )
            if slot is not None:
                if pending or trail:
                    conv.slot_comments[slot] = (pending, trail)
                pending = []
            elif trail:
                pending.append(trail)
        if pending:
            conv.slot_comments[""] = (pending, None)
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
        conv.kwarg_cases = kwarg_nodes
        conv.report_notes = notes_for_report
        return conv

    def _kwarg_finding(self, a: cst.Arg, case: str | None, fixable: bool) -> None:
        kw = a.keyword.value if a.keyword else ""
        option = _KWARG_OPTION.get(kw, kw)
        pos = self.get_metadata(PositionProvider, a)
        # Arguments are reported, not given TODOs of their own: the call's TODO lists the blockers.
        text = _fsdp2_case(option, case) if case else self._describe_value(kw, a.value)
        self.findings.append(CodeFinding(self.path, pos.start.line, pos.start.column, f"{kw}=", text, fixable))

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
        conv.blockers.append(
            f"auto_wrap_policy={_code(value)}: only transformer_auto_wrap_policy, "
            "size_based_auto_wrap_policy (min_num_params) and ModuleWrapPolicy are converted; "
            "give BridgeConfig(wrap=callable) for the rest"
        )
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
                    if kw in (
                        "param_dtype",
                        "reduce_dtype",
                        "buffer_dtype",
                        "cast_forward_inputs",
                        "cast_root_forward_inputs",
                    ):
                        items.append(f'"{kw}": {_code(a.value)}')
                    elif kw == "keep_low_precision_grads" and _code(a.value) == "False":
                        continue
                    else:
                        conv.blockers.append(f"MixedPrecision({kw}=...): {_fsdp2_any(kw)}")
                        return None
                given = {a.keyword.value for a in value.args if a.keyword is not None}
                if "param_dtype" in given and "cast_forward_inputs" not in given:
                    items.append('"cast_forward_inputs": False')  # FSDP1's default: only the root casts
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
                if len(value.args) == 1 and (
                    value.args[0].keyword is None or value.args[0].keyword.value == "offload_params"
                ):
                    return value.args[0].value
        conv.blockers.append(f"cpu_offload={_code(value)}: not a CPUOffload(offload_params=...) call")
        return None

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

    def _plan_optimizer_order(self, body: Sequence[cst.BaseStatement]) -> None:
        """``opt = torch.optim.X(M.parameters(), ...)`` before ``M = FSDP(M, ...)`` in the same block moves
        to just after it: FSDP2 replaces the parameters, so an optimizer built before would update
        tensors the model no longer uses (training silently nothing)."""
        wraps: dict[str, int] = {}
        for i, stmt in enumerate(body):
            target = _assign_target(stmt)
            if (
                target is not None
                and isinstance(value := _assign_value(stmt), cst.Call)
                and self._qn(value.func) == (FSDP, "")
                and value.args
                and _code(value.args[0].value) == target
            ):
                wraps.setdefault(target, i)
        for i, stmt in enumerate(body):
            value = _assign_value(stmt)
            if not isinstance(value, cst.Call):
                continue
            names = {q.name for q in self.get_metadata(QualifiedNameProvider, value.func, set())}
            if not any(n.startswith("torch.optim.") for n in names):
                continue
            text = _code(value)
            uses = {t for t in wraps if f"{t}.parameters()" in text or f"{t}.named_parameters()" in text}
            for target in uses:
                j = wraps[target]
                if i < j and not any(_assign_target(body[k]) == _assign_target(stmt) for k in range(i + 1, j)):
                    self.optimizer_moves[id(stmt)] = id(body[j])
                    self._record(
                        stmt,
                        f"{_code(value.func)}(...) before FSDP(...)",
                        f"moved after the shard call: FSDP2 replaces {target}'s parameters, and an optimizer "
                        "built before would update tensors the model no longer uses",
                        True,
                    )

    def _plan_plain_state_dict(self, node: cst.Call, func: cst.Attribute) -> bool:
        """``model.state_dict()`` / ``model.load_state_dict(sd[, strict])`` outside a state_dict_type block, on
        an object the function shows to be FSDP1's wrapper: FSDP1's default type is FULL_STATE_DICT, so these
        are full state dicts on every rank; on FSDP2 they would be sharded DTensors (a torch.save on rank 0
        would keep rank 0's shards only, and loading plain tensors into DTensors fails)."""
        obj = func.value
        wrapper = self._fsdp1_wrapper(node, obj)
        if wrapper not in ("fsdp1", "ambiguous"):
            return False
        target, method = _code(obj), func.attr.value
        stmt = self.stmt_stack[-1] if self.stmt_stack else None
        if stmt is not None and f"if isinstance({target}, FSDPModule) else {target}.{method}(" in _code(stmt):
            return True  # the DDP branch a first --fix wrote
        args = list(node.args)
        if method == "state_dict":
            if args:
                return False  # destination/prefix/keep_vars: nn.Module's own signature, left alone
            construct = f"{_short(target, 40)}.state_dict()"
        else:
            positional = [a for a in args if a.keyword is None]
            keywords = {a.keyword.value: a for a in args if a.keyword is not None}
            if not 1 <= len(positional) <= 2 or set(keywords) - {"strict"} or (len(positional) == 2 and keywords):
                return False
            construct = f"{_short(target, 40)}.load_state_dict(...)"
        if (ctx := self._runtime_state_context()) is not None and (where := self.dispatch.makes_state_dict_context):
            self._record(
                node,
                construct,
                f"kept as is: it runs inside `with {_short(ctx)}:` and {where} makes FSDP1's state-dict contexts, "
                "rewritten to fsdp_bridge.state_dict_type, which gives FSDP2 modules that type's "
                f"{method} for the block",
                True,
            )
            return True
        if ctx is not None:
            self._record(
                node,
                construct,
                f"not rewritten: it runs inside `with {_short(ctx)}:`, a context made elsewhere that may set "
                "FSDP1's state-dict type; FSDP2 has no such setting: use get_model_state_dict / "
                "set_model_state_dict(model, sd) with options=StateDictOptions(full_state_dict=True) for a full "
                "state dict, no options for a sharded one",
                False,
            )
            return True
        if (where := self.dispatch.sets_state_dict_type) is not None:
            self._record(
                node,
                construct,
                f"not rewritten: {where} calls FSDP.set_state_dict_type, so this state dict's type is set at run "
                "time; FSDP2 has no such setting: use get_model_state_dict / set_model_state_dict(model, sd) with "
                "options=StateDictOptions(full_state_dict=True) for a full state dict, no options for a sharded one",
                False,
            )
            return True
        if method == "state_dict":
            code = f"get_model_state_dict({target}, options={self._options(True)})"
            self.needs_state_dict_api.add("get_model_state_dict")
        else:
            strict = (
                keywords["strict"].value
                if "strict" in keywords
                else (positional[1].value if len(positional) == 2 else None)
            )
            options = self._options(True)
            if strict is not None:
                options = options[:-1] + f", strict={_code(strict)})"
            code = f"set_model_state_dict({target}, {_code(positional[0].value)}, options={options})"
            self.needs_state_dict_api.add("set_model_state_dict")
        if wrapper == "ambiguous":  # DistributedDataParallel's too: its own state_dict stays on the DDP path
            self.needs_imports.add(("torch.distributed.fsdp", "FSDPModule"))
            code = f"({code} if isinstance({target}, FSDPModule) else {_code(node)})"
        self.call_rewrites[id(node)] = code
        self._record(
            node,
            construct,
            f"{_short(code, 90)}: outside a state_dict_type block FSDP1 gives and takes full state dicts (its "
            "default FULL_STATE_DICT), every rank; FSDP2's own would be sharded DTensors",
            True,
        )
        return True

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

    def _literal_config(self, cfg: cst.BaseExpression | None) -> bool:
        """A state-dict config written out (``FullStateDictConfig(rank0_only=True)``, inline or in a
        variable assigned once) whose flags are literal True/False."""
        if cfg is None or m.matches(cfg, m.Name("None")):
            return True
        value = self._follow(cfg, _Conversion())
        if not isinstance(value, cst.Call) or self._qn(value.func) is None:
            return False
        return all(a.keyword is not None and _code(a.value) in ("True", "False") for a in value.args)

    def _config_flag(self, cfg: cst.BaseExpression | None, name: str, default: bool) -> bool:
        """A keyword of ``FullStateDictConfig(...)`` given inline or in a variable assigned once."""
        if cfg is None:
            return default
        value = self._follow(cfg, _Conversion())
        if isinstance(value, cst.Call):
            for a in value.args:
                if a.keyword is not None and a.keyword.value == name:
                    return _code(a.value) == "True"
        return default

    def _plan_state_dict_context(self, node: cst.Call) -> bool:
        """``FSDP.state_dict_type(M, type, cfg, optim_cfg)`` that is not a block rewritten in place (a context
        made here and entered elsewhere, a type known only at run time, a block with no call to rewrite) ->
        ``fsdp_bridge.state_dict_type(...)``, the same arguments: FSDP1's own context on FSDP1 models, on
        FSDP2 the type's state_dict/load_state_dict for the block. A literal LOCAL_STATE_DICT stays a TODO."""
        named = _named_args(node, ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config"))
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
            and self._takes_no_state_of(block, _code(named["module"]))
        ):
            # ``with FSDP.state_dict_type(M, LOCAL_STATE_DICT): torch.save(optimizer.state_dict(), f)``:
            # nothing in the block reads M's state dicts, so the type changes nothing there.
            self.unwrap_withs.add(id(block))
            self._consume(node)
            self._record(
                node,
                "FSDP.state_dict_type(LOCAL_STATE_DICT)",
                f"the block's body without the context: nothing in it takes {_short(_code(named['module']), 30)}'s "
                "state dicts, so the type changes nothing there (an optimizer's own state_dict() is this rank's "
                "state either way: FSDP2's holds DTensor shards)",
                True,
            )
            return True
        if kind not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", None) or (kind is None and self._qn(type_arg)):
            return False
        self.expr_rewrites[id(node.func)] = "fsdp_bridge.state_dict_type"
        self.needs_imports.add(("fsdp_bridge", None))
        self._consume(node.func)
        self._record(
            node,
            f"FSDP.state_dict_type({kind or _short(_code(type_arg), 40)})",
            "fsdp_bridge.state_dict_type(...), the same arguments: FSDP1's own context on FSDP1 models; on FSDP2 "
            "the model's state_dict() / load_state_dict() and fsdp_bridge.optim_state_dict() give that type's "
            "state inside the block (torch.distributed.checkpoint.state_dict; LOCAL_STATE_DICT refused)",
            True,
        )
        return True

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
            f"offload_to_cpu={self._config_flag(optim_cfg, 'offload_to_cpu', False)}"
        )
        rewrites: dict[int, str] = {}
        for inner in _walk(node.body):
            if not isinstance(inner, cst.Call):
                continue
            func, hit = inner.func, self._qn(inner.func)
            if isinstance(func, cst.Attribute) and hit is None and _code(func.value) == model:
                if func.attr.value == "state_dict" and not inner.args:
                    rewrites[id(inner)] = f"fsdp_bridge.full_state_dict({model}, {model_args})"
                elif func.attr.value == "load_state_dict":
                    return  # a load in the same block: left to the reference pass (a TODO)
            elif hit == (FSDP, "optim_state_dict") and (mo := _model_and_optim(inner)) is not None:
                rewrites[id(inner)] = f"fsdp_bridge.full_optim_state_dict({mo[0]}, {mo[1]}, {optim_args})"
            elif hit is not None and hit[0] == FSDP:
                return
        if rewrites:
            self.needs_imports.add(("fsdp_bridge", None))
            self._unwrap_block(node, rewrites, (cfg, optim_cfg), "FULL_STATE_DICT", f": {_GROUP_RANK0}")

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
            value = self._follow(extra, _Conversion()) if extra is not None else None
            if value is not None and value is not extra and self.name_uses.get(cast(cst.Name, extra).value, 0) <= 2:
                self._consume(value)
        what = ", ".join(sorted({code.split("(")[0] for code in rewrites.values()}))
        self._record(node, f"FSDP.state_dict_type({kind})", f"the block's body with {what}{why}", True)

    def _takes_no_state_of(self, block: cst.With, model: str) -> bool:
        """Every call in the block's body is one that cannot reach ``model``'s state dicts: ``x.state_dict()``
        of another object, ``torch.save``, ``os``/``os.path``, ``dist.get_rank``-style queries, logging, print."""
        root = model.split(".")[0]
        for n in _walk(block.body):
            if isinstance(n, cst.Name) and n.value == root and root != "self":
                return False
            if not isinstance(n, cst.Call):
                continue
            func = n.func
            if isinstance(func, cst.Attribute) and func.attr.value == "state_dict" and not n.args:
                # An optimizer's, scheduler's or scaler's own: not the model's, its owner's (self.model ->
                # self), a part of it, or an object that may hold it (an engine, a trainer).
                if re.search(r"opt|sched|scaler", _code(func.value).split(".")[-1], re.IGNORECASE):
                    continue
                return False
            names = {q.name for q in self.get_metadata(QualifiedNameProvider, func, set())}
            code = _code(func)
            if names & _HARMLESS_CALLS or any(q.startswith(("os.", "logging.")) for q in names):
                continue
            if code.split(".")[0] in ("logger", "log", "logging") or code.startswith(("self.logger.", "os.path.")):
                continue
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
        named = _named_args(call, ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config"))
        if named is None or "module" not in named or "state_dict_type" not in named:
            return
        type_arg = named["state_dict_type"]
        kind = self._member(type_arg, "StateDictType")
        if kind is None and self._qn(type_arg) is not None:
            return  # an FSDP1 name that is not a member: reported by the reference pass
        if kind not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", None):
            return  # LOCAL_STATE_DICT: reported as a TODO by the reference pass
        model = _code(named["module"])
        cfg = named.get("state_dict_config")
        optim_cfg = named.get("optim_state_dict_config")
        if kind is None or not self._literal_config(cfg) or not self._literal_config(optim_cfg):
            # Type or configs known only at run time: fsdp_bridge translates them when the code runs.
            runtime = ", ".join(_code(a) for a in (type_arg, cfg, optim_cfg) if a is not None)
            if optim_cfg is not None and cfg is None:
                runtime = f"{_code(type_arg)}, None, {_code(optim_cfg)}"
            save_opts = f"fsdp_bridge.state_dict_options({runtime})"
            optim_opts = f"fsdp_bridge.state_dict_options({runtime}, optimizer=True)"
            load_opts = f"fsdp_bridge.state_dict_options({runtime}, load=True)"
            optim_load_opts = f"fsdp_bridge.state_dict_options({runtime}, optimizer=True, load=True)"
            self.needs_imports.add(("fsdp_bridge", None))
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
                offload=not full and self._config_flag(optim_cfg, "offload_to_cpu", False),
            )
            load_opts = self._options(full)
            # FSDP1 loads a full optimizer state with rank0_only from rank 0 alone (the other ranks'
            # dicts are ignored, often None) and broadcasts it; the model's load has no such mode.
            optim_load_opts = self._options(full, broadcast=full and self._config_flag(optim_cfg, "rank0_only", False))
        rewrites: dict[int, str] = {}
        for inner in _walk(node.body):
            if not isinstance(inner, cst.Call):
                continue
            func = inner.func
            hit = self._qn(func)
            if isinstance(func, cst.Attribute) and hit is None and _code(func.value) == model:
                if func.attr.value == "state_dict" and not inner.args:
                    self.needs_state_dict_api.add("get_model_state_dict")
                    rewrites[id(inner)] = f"get_model_state_dict({model}, options={save_opts})"
                elif (
                    func.attr.value == "load_state_dict"
                    and (load := _named_args(inner, ("state_dict", "strict", "assign"))) is not None
                    and set(load) <= {"state_dict", "strict"}
                    and "state_dict" in load
                ):
                    # set_model_state_dict returns the same (missing_keys, unexpected_keys) named tuple
                    self.needs_state_dict_api.add("set_model_state_dict")
                    opts = (
                        load_opts
                        if "strict" not in load
                        else _with_option(load_opts, f"strict={_code(load['strict'])}")
                    )
                    rewrites[id(inner)] = f"set_model_state_dict({model}, {_code(load['state_dict'])}, options={opts})"
            elif hit == (FSDP, "optim_state_dict") and (mo := _model_and_optim(inner)) is not None:
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
                    m_, o_, sd = (_code(a.value) for a in to_load.args[:3])
                    rewrites[id(inner)] = f"set_optimizer_state_dict({m_}, {o_}, {sd}, options={optim_load_opts})"
                    self._consume(to_load)
        if rewrites:
            # Runtime configs stay: the new calls read them.
            configs = () if save_opts.startswith("fsdp_bridge.") else (cfg, optim_cfg)
            why = f" (torch.distributed.checkpoint.state_dict, options={save_opts}); your torch.save / DCP code is kept"
            self._unwrap_block(node, rewrites, configs, kind or _short(_code(type_arg), 40), why)

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
        negated = [n for n in _walk(stmt.test) if isinstance(n, cst.UnaryOperation) and isinstance(n.operator, cst.Not)]
        return any(n is check for n in _walk(stmt.test)) and not any(any(x is check for x in _walk(n)) for n in negated)

    def _mock_spec(self, node: cst.Call) -> cst.BaseExpression | None:
        """FSDP1's wrapper class as the spec of a ``unittest.mock`` stand-in (``Mock(spec=FSDP)``)."""
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, node.func, set())}
        if not any(n.startswith(("unittest.mock.", "mock.")) and n.rsplit(".", 1)[-1] in _MOCKS for n in names):
            return None
        for i, a in enumerate(node.args):
            keyword = a.keyword.value if a.keyword is not None else ("spec" if i == 0 else None)
            if keyword in ("spec", "spec_set") and self._qn(a.value) == (FSDP, ""):
                return a.value
        return None

    def _config_driven(self, node: cst.Call) -> None:
        """FSDP set up by the HF Trainer's arguments or accelerate's plugin: point to `migrate config`."""
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, node.func, set())}
        for cls, key in _CONFIG_DRIVEN.items():
            if not any(n.split(".")[-1] == cls and n.startswith(("transformers", "accelerate")) for n in names):
                continue
            kwargs = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
            if key not in kwargs or (key == "fsdp_version" and _code(kwargs[key]) == "2"):
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
        """``isinstance(m, FSDP)`` -> ``isinstance(m, FSDPModule)``; ``FSDP.fsdp_modules(M)`` -> the
        modules of ``M`` that are ``FSDPModule``; ``ShardedGradScaler(...)`` -> ``torch.amp.GradScaler(...)``."""
        args = node.args
        if m.matches(node.func, m.Name("isinstance")) and len(args) == 2 and self._qn(args[1].value) == (FSDP, ""):
            if self._refuses_fsdp1(node):
                # ``if isinstance(m, FSDP): raise ...``: code that refuses FSDP1's wrapper (often FSDP2 code
                # guarding itself) stays true after the migration; FSDPModule there would refuse FSDP2 units.
                self._consume(args[1].value)
                return True
            self.needs_imports.add(("torch.distributed.fsdp", "FSDPModule"))
            code = f"isinstance({_code(args[0].value)}, FSDPModule)"
            self._record(node, f"isinstance(..., {_code(args[1].value)})", f"{code} (FSDP2 units are FSDPModule)", True)
        elif (
            m.matches(node.func, m.Name("isinstance"))
            and len(args) == 2
            and isinstance(args[1].value, (cst.Tuple, cst.BinaryOperation))
        ):
            hits = [
                n
                for n in _walk(args[1].value)
                if isinstance(n, (cst.Name, cst.Attribute)) and self._qn(n) == (FSDP, "")
            ]
            if not hits:
                return False
            self.needs_imports.add(("torch.distributed.fsdp", "FSDPModule"))
            for n in hits:  # FSDP inside a tuple or union of classes: that element becomes FSDPModule
                self.name_rewrites[id(n)] = "FSDPModule"
                self.consumed_nodes.add(id(n))
            self._record(
                node,
                f"isinstance(..., {_short(_code(args[1].value), 40)})",
                f"FSDPModule in place of {_code(hits[0])} (FSDP2 units are FSDPModule)",
                True,
            )
            return False
        elif (spec := self._mock_spec(node)) is not None:
            self._consume(spec)
            if "FSDP2" in _code(self.functions[-1] if self.functions else node):
                self._record(
                    node,
                    f"{_code(node.func)}(spec={_code(spec)})",
                    "kept as is: this test stands in an FSDP1 wrapper for code that tells it from FSDP2's",
                    True,
                )
                return False
            self.needs_imports.add(("torch.distributed.fsdp", "FSDPModule"))
            self.name_rewrites[id(spec)] = "FSDPModule"
            self._record(
                node,
                f"{_code(node.func)}(spec={_code(spec)})",
                "spec=FSDPModule: the stand-in passes the isinstance(..., FSDPModule) checks the migrated code makes",
                True,
            )
            return False
        elif hit == (FSDP, "fsdp_modules") and args:
            self.needs_imports.add(("torch.distributed.fsdp", "FSDPModule"))
            root = _code(args[0].value)
            code = f"[m for m in {root}.modules() if isinstance(m, FSDPModule)]"
            self._record(node, f"{_code(node.func)}(...)", code, True)
        elif hit == (FSDP, "clip_grad_norm_") and args:
            self.needs_imports.add(("fsdp_bridge", None))
            code = f"fsdp_bridge.clip_grad_norm_({', '.join(_code(a).rstrip(', ') for a in args)})"
            self._record(node, f"{_code(node.func)}(...)", f"{code}; {_fsdp2('clip_grad_norm_')}", True)
        elif (
            hit is not None
            and hit[0] == "ShardedGradScaler"
            and not any(a.keyword is not None and a.keyword.value == "process_group" for a in args)
        ):
            self.needs_imports.add(("torch", None))
            code = f"torch.amp.GradScaler({', '.join(_code(a).rstrip(', ') for a in args)})"
            self._record(node, "ShardedGradScaler(...)", f"{code} ({_fsdp2_any('ShardedGradScaler')})", True)
        else:
            return False
        self.call_rewrites[id(node)] = code
        self._consume(node.func)
        for a in args:
            self._consume(a.value) if self._qn(a.value) is not None else None
        return True

    def _plan_optim_call(self, node: cst.Call, member: str) -> bool:
        """FSDP's optimizer-state functions outside a state_dict_type block -> torch's state_dict API."""
        params = (
            ("model", "optim", "optim_input", "rank0_only", "group")
            if member == "full_optim_state_dict"
            else ("model", "optim", "optim_state_dict", "group")
        )
        named = _named_args(node, params)
        code = None
        unused = ("optim_input", "optim_state_dict", "group")
        if (
            named is not None
            and "model" in named
            and "optim" in named
            and all(m.matches(named[k], m.Name("None")) for k in unused if k in named)
        ):
            full = member != "sharded_optim_state_dict"
            rank0 = named.get("rank0_only")
            if member == "full_optim_state_dict" and self.dispatch.group_fsdp is not None:
                # rank0_only means each process group's first rank: torch's options have no such form.
                self.needs_imports.add(("fsdp_bridge", None))
                extra = "" if rank0 is None else f", rank0_only={_code(rank0)}"
                code = f"fsdp_bridge.full_optim_state_dict({_code(named['model'])}, {_code(named['optim'])}{extra})"
                self.call_rewrites[id(node)] = code
                self._record(node, f"FSDP.{member}(...)", f"{code}: {_GROUP_RANK0}", True)
                return True
            self.needs_state_dict_api.add("get_optimizer_state_dict")
            if member != "full_optim_state_dict" or rank0 is None or _code(rank0) in ("True", "False"):
                opts = self._options(
                    full, cpu_offload=member == "full_optim_state_dict" and (rank0 is None or _code(rank0) == "True")
                )
            else:  # rank 0 only, in CPU memory, when the expression is true (FSDP1's rank0_only)
                opts = f"StateDictOptions(full_state_dict=True, cpu_offload={_code(rank0)})"
            code = f"get_optimizer_state_dict({_code(named['model'])}, {_code(named['optim'])}, options={opts})"
        if code is None:
            return False
        self.call_rewrites[id(node)] = code
        self._record(node, f"FSDP.{member}(...)", code, True)
        return True

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
                text = _code(expr)
                if "state_dict" in text.lower() or "state_ctx" in text.lower() or self._made_context(expr):
                    return text
        return None

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
                    and (self._qn(n.func) == (FSDP, "state_dict_type") or _code(n.func).split(".")[-1] in funcs)
                    for n in _walk(value)
                ) or any(isinstance(n, cst.Name) and n.value in names for n in _walk(value))

            for _ in range(3):  # factories calling factories
                for n in _walk(module) if module is not None else ():
                    if isinstance(n, cst.Assign) and makes(n.value):
                        names.update(_code(t.target) for t in n.targets)
                    elif isinstance(n, cst.FunctionDef) and any(
                        (isinstance(r, cst.Return) and r.value is not None and makes(r.value))
                        or (isinstance(r, cst.With) and any(makes(i.item) for i in r.items))
                        for r in _walk(n.body)
                    ):
                        funcs.add(n.name.value)
            self.context_makers = (names, funcs)
        names, funcs = self.context_makers
        if isinstance(expr, (cst.Name, cst.Attribute)):
            return _code(expr) in names
        return isinstance(expr, cst.Call) and _code(expr.func).split(".")[-1] in funcs

    def _in_old_torch_branch(self, node: cst.CSTNode) -> bool:
        """Inside the branch of ``if <torch.__version__> < ...:`` (or the else of ``>=``) taken on old torch."""
        line = self.get_metadata(PositionProvider, node).start.line
        for stmt in self.stmt_stack:
            if not isinstance(stmt, cst.If) or "torch.__version__" not in (test := _code(stmt.test)):
                continue
            in_body = line <= self.get_metadata(PositionProvider, stmt.body).end.line
            if in_body == ("<" in test):
                return True
        return False

    def _optim_to_load(self, node: cst.Call, options: str | None) -> str | None:
        """``FSDP.optim_state_dict_to_load(M, O, sd)`` kept in a variable -> fsdp_bridge's helper that loads
        it and returns ``O.state_dict()`` (a later ``O.load_state_dict(x)`` then changes nothing)."""
        order: tuple[str, ...] = ("model", "optim", "optim_state_dict", "is_named_optimizer", "load_directly", "group")
        if any(a.keyword is None for a in node.args) and self._in_old_torch_branch(node):
            # torch < 2.1 took (optim_state_dict, model, optim): the branch the code takes there (dead on
            # the torch versions FSDP2 needs) is written with that order read right.
            order = ("optim_state_dict", "model", "optim")
        named = _named_args(node, order)
        if named is None or not {"model", "optim", "optim_state_dict"} <= set(named):
            return None
        if set(named) - {"model", "optim", "optim_state_dict", "load_directly"}:
            return None
        self.needs_imports.add(("fsdp_bridge", None))
        self._consume(node.func)
        extra = f", options={options}" if options else ""
        return (
            f"fsdp_bridge.optim_state_dict_to_load({_code(named['model'])}, {_code(named['optim'])}, "
            f"{_code(named['optim_state_dict'])}{extra})"
        )

    def _shard_full_to_load(self, node: cst.Call) -> str | None:
        """``x = FSDP.shard_full_optim_state_dict(sd, M, optim=O)`` (loaded later) -> the helper that
        loads it into ``O`` and returns ``O.state_dict()``; without ``optim`` the optimizer is unknown."""
        scatter = self._qn(node.func) == (FSDP, "scatter_full_optim_state_dict")
        named = _named_args(node, ("full_optim_state_dict", "model", "optim_input", "optim", "group"))
        if named is None or not {"full_optim_state_dict", "model"} <= set(named) or "group" in named:
            return None
        if "optim_input" in named and not m.matches(named["optim_input"], m.Name("None")):
            return None
        optim = _code(named["optim"]) if "optim" in named else self._loaded_into(node)
        if optim is None:
            return None
        self.needs_imports.add(("fsdp_bridge", None))
        self._consume(node.func)
        # scatter: rank 0's full state is sent to the others (theirs may be None), as FSDP1 does.
        options = f", options={self._options(True, broadcast=True)}" if scatter else ""
        return (
            f"fsdp_bridge.optim_state_dict_to_load({_code(named['model'])}, {optim}, "
            f"{_code(named['full_optim_state_dict'])}{options})"
        )

    def _loaded_into(self, node: cst.Call) -> str | None:
        """``x = <node>`` with ``O.load_state_dict(x)`` later in the same function: ``O``, the one optimizer."""
        if not self.stmt_stack or not self.functions:
            return None
        stmt = self.stmt_stack[-1]
        target = _assign_target(stmt)
        if target is None or _assign_value(stmt) is not node:
            return None
        function = self.functions[-1]
        nested = [n for n in _walk(function.body) if isinstance(n, (cst.FunctionDef, cst.Lambda))]
        inner = {id(x) for n in nested for x in _walk(n)}
        line = self.get_metadata(PositionProvider, stmt).start.line
        optims = {
            _code(n.func.value)
            for n in _walk(function.body)
            if id(n) not in inner
            and isinstance(n, cst.Call)
            and isinstance(n.func, cst.Attribute)
            and n.func.attr.value == "load_state_dict"
            and len(n.args) == 1
            and _code(n.args[0].value) == target
        }
        if len(optims) != 1:
            return None
        optim = optims.pop()
        # It must exist when the call runs: a parameter of the function, or assigned above the call.
        params = {p.name.value for p in (*function.params.params, *function.params.kwonly_params)}
        root = optim.split(".")[0]
        assigned_before = any(
            isinstance(n, cst.Assign)
            and id(n) not in inner
            and any(_code(t.target) in (optim, root) for t in n.targets)
            and self.get_metadata(PositionProvider, n).start.line < line
            for n in _walk(function.body)
        )
        return optim if root in params or assigned_before else None

    def _plan_optim_load(self, node: cst.Call) -> bool:
        """``O.load_state_dict(FSDP.optim_state_dict_to_load|shard_full_optim_state_dict|
        scatter_full_optim_state_dict(...))`` -> ``set_optimizer_state_dict(M, O, sd, options=...)``."""
        func = node.func
        if not (
            isinstance(func, cst.Attribute)
            and func.attr.value == "load_state_dict"
            and len(node.args) == 1
            and isinstance(node.args[0].value, cst.Call)
        ):
            return False
        inner = node.args[0].value
        hit = self._qn(inner.func)
        if hit is None or hit[0] != FSDP:
            return False
        optim = _code(func.value)
        args = [_code(a.value) for a in inner.args if a.keyword is None]
        keywords = {a.keyword.value: _code(a.value) for a in inner.args if a.keyword is not None}
        if hit[1] == "optim_state_dict_to_load" and len(args) >= 3:
            model: str | None = args[0]
            sd, opts = args[2], self._options(True)
        elif hit[1] in ("shard_full_optim_state_dict", "scatter_full_optim_state_dict") and args:
            model = args[1] if len(args) > 1 else keywords.get("model")
            sd = args[0]
            opts = self._options(True, broadcast=hit[1] == "scatter_full_optim_state_dict")
            if model is None:
                return False
        else:
            return False
        self.needs_state_dict_api.add("set_optimizer_state_dict")
        code = f"set_optimizer_state_dict({model}, {optim}, {sd}, options={opts})"
        self.call_rewrites[id(node)] = code
        self._consume(inner)
        self._record(node, f"FSDP.{hit[1]}(...)", code, True)
        return True


def _model_and_optim(call: cst.Call) -> tuple[str, str] | None:
    """``FSDP.optim_state_dict(model, optim)`` (positional or keyword; nothing else given): their code."""
    named = _named_args(call, ("model", "optim", "optim_state_dict", "group"))
    if named is None or set(named) != {"model", "optim"}:
        return None
    return _code(named["model"]), _code(named["optim"])


def _assign_target(stmt: cst.CSTNode) -> str | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign):
        targets = stmt.body[0].targets
        if len(targets) == 1 and isinstance(targets[0].target, (cst.Name, cst.Attribute)):
            return _code(targets[0].target)
    return None


def _assign_value(stmt: cst.CSTNode) -> cst.BaseExpression | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign):
        return stmt.body[0].value
    return None


def _stub(fn: cst.FunctionDef) -> bool:
    """A declaration only (a Protocol or abstract method): its body is a docstring, ``...``, ``pass``
    or ``raise NotImplementedError``."""
    body = fn.body.body if isinstance(fn.body, cst.IndentedBlock) else [fn.body]
    smalls = [x for stmt in body for x in getattr(stmt, "body", [])]
    return all(
        (isinstance(x, cst.Expr) and isinstance(x.value, (cst.Ellipsis, cst.SimpleString, cst.ConcatenatedString)))
        or isinstance(x, cst.Pass)
        or (isinstance(x, cst.Raise) and "NotImplementedError" in _code(x))
        for x in smalls
    )


def _exits(body: cst.BaseSuite) -> bool:
    """The block ends in return / raise / continue / break."""
    last = body.body[-1] if isinstance(body, cst.IndentedBlock) and body.body else None
    if isinstance(body, cst.SimpleStatementSuite):
        return bool(body.body) and isinstance(body.body[-1], (cst.Return, cst.Raise, cst.Continue, cst.Break))
    return (
        isinstance(last, cst.SimpleStatementLine)
        and bool(last.body)
        and isinstance(last.body[-1], (cst.Return, cst.Raise, cst.Continue, cst.Break))
    )


_GROUP_RANK0 = (
    "FSDP1's rank0_only in a tree sharding over process groups of some ranks: the full state on each "
    "group's first rank (which saves its model-parallel slice), the others empty, on both backends "
    "(torch's StateDictOptions(cpu_offload=True) would give it to world rank 0 only)"
)
_HARMLESS_CALLS = {
    "torch.save",
    "print",
    "str",
    "int",
    "len",
    "torch.distributed.get_rank",
    "torch.distributed.get_world_size",
    "torch.distributed.barrier",
}
_MOCKS = {"Mock", "MagicMock", "NonCallableMock", "NonCallableMagicMock", "AsyncMock", "create_autospec"}


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
        rewrite = self.scan.call_rewrites.get(id(original_node))
        if rewrite is not None:
            return cst.parse_expression(rewrite)
        conv = self.scan.conversions.get(id(original_node))
        if conv is not None and not conv.blockers:
            return _render_shard(conv)
        kind = self.scan.fixable_calls.get(id(original_node))
        if kind is not None:
            func = updated_node.func
            if kind == "method" and isinstance(func, cst.Attribute):
                target = cst.parse_expression(f"fsdp_bridge.{func.attr.value}")
                return updated_node.with_changes(func=target, args=_commas([cst.Arg(func.value), *updated_node.args]))
            kept = [
                a
                for a in updated_node.args
                if a.keyword is None or a.keyword.value != "recurse" or _code(a.value) == "False"
            ]
            return updated_node.with_changes(
                func=cst.parse_expression("fsdp_bridge.summon_full_params"), args=_commas(kept)
            )
        return updated_node

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> Any:
        if (code := self.scan.expr_rewrites.get(id(original_node))) is not None:
            return cst.parse_expression(code)
        rewrite = self.scan.name_rewrites.get(id(original_node))
        return cst.Name(rewrite) if rewrite else updated_node

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> Any:
        if id(original_node) in self.scan.attr_drops:
            return updated_node.value
        if (code := self.scan.expr_rewrites.get(id(original_node))) is not None:
            return cst.parse_expression(code)
        rewrite = self.scan.name_rewrites.get(id(original_node))
        return cst.Name(rewrite) if rewrite else updated_node

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> Any:
        if id(original_node) in self.scan.removed_stmts:
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

    def _reorder(self, original_body: Sequence[Any], body: Sequence[Any]) -> list[Any]:
        """Apply planned optimizer moves (original and updated bodies align one to one)."""
        if not self.scan.optimizer_moves or len(original_body) != len(body):
            return list(body)
        ids = [id(s) for s in original_body]
        moving = {i for i, sid in enumerate(ids) if sid in self.scan.optimizer_moves}
        if not moving:
            return list(body)
        out: list[Any] = []
        for i, stmt in enumerate(body):
            if i in moving:
                continue
            out.append(stmt)
            out.extend(body[k] for k in sorted(moving) if self.scan.optimizer_moves[ids[k]] == ids[i])
        return out

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
        body = self._drop_removed(self._reorder(original_node.body, updated_node.body))
        return updated_node.with_changes(body=body or [cst.SimpleStatementLine([cst.Pass()])])

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        return updated_node.with_changes(body=self._drop_removed(self._reorder(original_node.body, updated_node.body)))

    def _compound(self, original_node: Any, updated_node: Any) -> Any:
        return _with_todos(original_node, updated_node, self.scan.todos)

    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> Any:
        return self._compound(original_node, updated_node)

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> Any:
        return self._compound(original_node, updated_node)

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> Any:
        return self._compound(original_node, updated_node)

    def leave_For(self, original_node: cst.For, updated_node: cst.For) -> Any:
        return self._compound(original_node, updated_node)

    def leave_While(self, original_node: cst.While, updated_node: cst.While) -> Any:
        return self._compound(original_node, updated_node)

    def leave_With(self, original_node: cst.With, updated_node: cst.With) -> Any:
        if id(original_node) in self.scan.unwrap_withs and isinstance(updated_node.body, cst.IndentedBlock):
            # The block's body, one level out (its statements were rewritten inside it).
            body: list[Any] = list(updated_node.body.body)
            body[0] = body[0].with_changes(leading_lines=[*updated_node.leading_lines, *body[0].leading_lines])
            return cst.FlattenSentinel(body)
        return self._compound(original_node, updated_node)


def _with_option(options: str, extra: str) -> str:
    """``StateDictOptions(a=1)`` + ``strict=x`` -> ``StateDictOptions(a=1, strict=x)`` (also for
    ``fsdp_bridge.state_dict_options(...)``)."""
    head, _, _ = options.rpartition(")")
    return f"{head}{'' if head.endswith('(') else ', '}{extra})"


def _named_args(call: cst.Call, names: Sequence[str]) -> dict[str, cst.BaseExpression] | None:
    """A call's arguments by parameter name (positional ones in ``names`` order); None with ``*``/``**``."""
    out: dict[str, cst.BaseExpression] = {}
    for i, a in enumerate(call.args):
        if a.star:
            return None
        if a.keyword is not None:
            out[a.keyword.value] = a.value
        elif i < len(names):
            out[names[i]] = a.value
        else:
            return None
    return out


def _runtime_names(runtime: Sequence[tuple[str, str]]) -> list[str]:
    """The arguments kept for ``from_fsdp1`` as the report names them (``**kwargs`` by its name)."""
    return [f"**{code}" if kw == "**" else kw for kw, code in runtime]


def _short(code: str, limit: int = 60) -> str:
    one = " ".join(code.split())
    return one if len(one) <= limit else one[: limit - 3] + "..."


def _render_shard(conv: _Conversion) -> cst.BaseExpression:
    """``fsdp_bridge.shard(module, fsdp_bridge.BridgeConfig(...)[, mesh=...])``, one argument per line
    when a single line would be long."""
    assert conv.module is not None
    if conv.runtime is not None:
        return _render_runtime(conv)
    config = [(_code(a.keyword), f"{_code(a.keyword)}={_code(a.value)}") for a in conv.config_args if a.keyword]
    tail = [f"mesh={_code(conv.mesh)}"] if conv.mesh is not None else []
    one_line = (
        f"fsdp_bridge.shard({_code(conv.module)}, fsdp_bridge.BridgeConfig({', '.join(c for _, c in config)})"
        + "".join(f", {t}" for t in tail)
        + ")"
    )
    if len(conv.indent) + len(one_line) <= 100 and not conv.slot_comments:
        return cst.parse_expression(one_line)

    # libcst adds the enclosing block's indentation to each continuation line.
    i1, i2 = "    ", "        "
    lines = [
        "fsdp_bridge.shard(",
        *_commented(conv, i1, "module", _code(conv.module)),
        f"{i1}fsdp_bridge.BridgeConfig(",
    ]
    for slot, text in config:
        lines += _commented(conv, i2, slot, text)
    lines += [f"{i1}),"] + [x for t in tail for x in _commented(conv, i1, "mesh", t)]
    lines += [i1 + c for c in conv.slot_comments.get("", ([], None))[0]] + [")"]
    return cst.parse_expression("\n".join(lines))


def _comments_around(call: cst.Call, i: int) -> tuple[list[str], str | None]:
    """The comments on their own lines just before argument ``i`` of ``call``, and the one after it on
    its line (a rewrite that renders the arguments again keeps them in place)."""

    def own_lines(ws: object) -> list[str]:
        lines = getattr(ws, "empty_lines", ())
        return [line.comment.value for line in lines if line.comment is not None]

    def first(ws: object) -> str | None:
        line = getattr(ws, "first_line", None)
        return line.comment.value if line is not None and line.comment is not None else None

    lead: list[str] = []
    if i == 0:
        lead = own_lines(call.whitespace_before_args)
    else:
        prev = call.args[i - 1].comma
        if isinstance(prev, cst.Comma):
            lead = own_lines(prev.whitespace_after)
    a = call.args[i]
    trail = first(a.comma.whitespace_after) if isinstance(a.comma, cst.Comma) else first(a.whitespace_after_arg)
    return lead, trail


def _runtime_lines(conv: _Conversion, indent: str) -> list[str]:
    """``kw=<as written>,`` lines for ``BridgeConfig.from_fsdp1(...)``, with the comments written
    around each argument; a value spanning lines keeps its shape, re-indented under its keyword."""
    lines: list[str] = []
    comments = conv.arg_comments if len(conv.arg_comments) == len(conv.runtime or []) else []
    for k, (kw, code) in enumerate(conv.runtime or []):
        lead, trail = comments[k] if comments else ([], None)
        lines.extend(indent + c for c in lead)
        first, *rest = (f"**{code}" if kw == "**" else f"{kw}={code}").split("\n")
        rest = textwrap.dedent("\n".join(rest)).split("\n") if rest else []
        lines.append(indent + first)
        lines.extend(indent + line for line in rest)
        lines[-1] += "," + (f"  {trail}" if trail else "")
    return lines


def _render_runtime(conv: _Conversion) -> cst.BaseExpression:
    """``fsdp_bridge.shard(module, fsdp_bridge.BridgeConfig.from_fsdp1(kw=<as written>, ...)[, mesh=])``."""
    assert conv.module is not None and conv.runtime is not None
    i1, i2 = "    ", "        "
    lines = ["fsdp_bridge.shard(", *_commented(conv, i1, "module", _code(conv.module))]
    lines += [f"{i1}fsdp_bridge.BridgeConfig.from_fsdp1(", *_runtime_lines(conv, i2), f"{i1}),"]
    if conv.mesh is not None:
        lines += _commented(conv, i1, "mesh", f"mesh={_code(conv.mesh)}")
    lines.append(")")
    return cst.parse_expression("\n".join(lines))


def _commented(conv: _Conversion, indent: str, slot: str, text: str) -> list[str]:
    """``text,`` on a line of its own, with the comments written around the argument it came from."""
    lead, trail = conv.slot_comments.get(slot, ([], None))
    return [indent + c for c in lead] + [f"{indent}{text}," + (f"  {trail}" if trail else "")]


def _commas(args: Sequence[cst.Arg]) -> list[cst.Arg]:
    out = []
    for i, a in enumerate(args):
        last = i == len(args) - 1
        out.append(
            a.with_changes(
                comma=cst.MaybeSentinel.DEFAULT if last else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            )
        )
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
        return "".join(
            difflib.unified_diff(
                self.original.splitlines(keepends=True),
                self.fixed.splitlines(keepends=True),
                f"a/{self.path}",
                f"b/{self.path}",
            )
        )


def migrate_source(code: str, path: str = "<string>", *, dispatch: _Dispatch | None = None) -> MigratedSource:
    """Scan ``code`` and compute its rewritten form (nothing is written).

    ``dispatch``: backend-dispatch helpers defined in other files being migrated with this one.
    """
    module = cst.parse_module(code)
    wrapper = MetadataWrapper(module)
    collector = _Collector()
    wrapper.module.visit(collector)
    single = {k: v[0] for k, v in collector.assigned.items() if len(v) == 1}
    known = _Dispatch()
    if dispatch is not None:
        known.merge(dispatch)
    if "FSDPModule" in code:
        known.merge(_find_dispatch(wrapper))
    known.merge(
        _Dispatch(
            own_methods=_find_own_methods(code, path),
            sets_state_dict_type=path if "set_state_dict_type" in code else None,
            makes_state_dict_context=path if _makes_state_dict_context(code) else None,
            group_fsdp=path if _passes_group(code) else None,
        )
    )
    if _passes_group(code):
        known.group_fsdp = path  # this file's own, named first
    scan = _Scanner(path, code, single, collector.uses, known)
    wrapper.visit(scan)  # plan: FSDP(...) conversions and checkpoint blocks
    scan.planning = False
    wrapper.visit(scan)  # report: every other construct
    vendored = vendored_torch_module(code, path) if scan.findings else None
    if vendored is not None:  # a copy of torch's own code that touches FSDP1: one construct, left as it is
        finding = CodeFinding(path, 1, 0, vendored.construct, vendored.replacement, False)
        comment = f"# {TODO}: {vendored.construct}: {vendored.replacement}\n"
        head, _, rest = code.partition("\n") if code.startswith("#!") else ("", "", code)
        noted = code if comment in code else (f"{head}\n" if head else "") + comment + rest
        return MigratedSource(path, code, noted, [finding])
    if not scan.uses_fsdp1:  # at most config-driven FSDP (Trainer / accelerate arguments): report, change nothing
        return MigratedSource(path, code, code, sorted(scan.findings, key=lambda f: (f.line, f.column)))
    fixer = _Fixer(scan, {id(v): k for k, v in single.items()})
    fixed = wrapper.module.visit(fixer)
    if fixed.code != code:
        context = CodemodContext()
        if scan.conversions or scan.fixable_calls:
            AddImportsVisitor.add_needed_import(context, "fsdp_bridge")
        for name in sorted(scan.needs_state_dict_api):
            AddImportsVisitor.add_needed_import(context, "torch.distributed.checkpoint.state_dict", name)
        for module_name, obj in sorted(scan.needs_imports, key=str):
            AddImportsVisitor.add_needed_import(context, module_name, obj)
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
            if not (
                mod.startswith("torch.distributed.fsdp")
                or mod in ("functools", "torch.distributed.checkpoint.optimizer")
            ) or isinstance(node.names, cst.ImportStar):
                return
            for alias in node.names:
                asname = alias.asname.name.value if alias.asname and isinstance(alias.asname.name, cst.Name) else None
                found.append((mod, _code(alias.name), asname))

    module.visit(V())
    return found


def migrate_paths(paths: Sequence[str | Path], *, fix: bool = False) -> tuple[CodeReport, list[MigratedSource]]:
    """Scan files (directories: every ``*.py`` below); with ``fix``, write the rewrites.

    Never raises for a file's content: a file that cannot be read, parsed or rewritten
    (not UTF-8, not valid Python, a construct the codemod cannot handle) is left untouched
    and listed in ``report.skipped`` with the reason.  With ``fix`` the rewrite is all or
    nothing: every new file is written beside its original first, then all are moved into
    place; if any write fails, nothing is changed.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(f for f in p.rglob("*.py") if f.is_file()) if p.is_dir() else [p])
    report = CodeReport()
    results = []
    dispatch = _Dispatch()  # helpers such as fsdp_version(model) may live in another file of the tree
    for f in files:
        try:
            code = f.read_text(encoding="utf-8")
            if "FSDPModule" in code:
                dispatch.merge(_find_dispatch(MetadataWrapper(cst.parse_module(code))))
            if "FullyShardedDataParallel" in code:
                factories = _find_fsdp1_factories(MetadataWrapper(cst.parse_module(code)), str(f))
                dispatch.merge(_Dispatch(fsdp1_factories=factories))
            dispatch.merge(
                _Dispatch(
                    own_methods=_find_own_methods(code, str(f)),
                    sets_state_dict_type=str(f) if "set_state_dict_type" in code else None,
                    makes_state_dict_context=str(f) if _makes_state_dict_context(code) else None,
                    group_fsdp=str(f) if _passes_group(code) else None,
                )
            )
        except Exception:  # unreadable or unparsable: reported by the loop below
            continue
    for f in files:
        try:
            code = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            report.skipped.append((str(f), f"cannot be read as UTF-8 text ({err})"))
            continue
        try:
            result = migrate_source(code, str(f), dispatch=dispatch)
            if result.changed:
                cst.parse_module(result.fixed)  # the rewrite must parse, or the file is left alone
        except cst.ParserSyntaxError as err:
            report.skipped.append((str(f), f"not valid Python 3 ({str(err).splitlines()[0]})"))
            continue
        except Exception as err:  # a construct the codemod cannot handle: never a half-rewritten file
            report.skipped.append(
                (
                    str(f),
                    f"left untouched: the codemod failed on it ({type(err).__name__}: "
                    f"{str(err).splitlines()[0] if str(err) else ''})",
                )
            )
            continue
        results.append(result)
        report.findings.extend(result.findings)
        if result.changed:
            report.changed.append(str(f))
        comments = (result.fixed if result.changed else code).count(f"# {TODO}")
        if comments:
            report.todo_comments[str(f)] = comments
    if fix:
        _write_all([r for r in results if r.changed])
    return report, results


def _write_all(results: Sequence[MigratedSource]) -> None:
    """Stage every rewritten file beside its original, then replace them all (all or nothing)."""
    staged: list[tuple[Path, Path]] = []
    try:
        for r in results:
            target = Path(r.path)
            tmp = target.with_name(f".{target.name}.fsdp-bridge-tmp")
            tmp.write_text(r.fixed, encoding="utf-8")
            shutil.copymode(target, tmp)
            staged.append((tmp, target))
    except OSError as err:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise MigrationWriteError(f"could not write beside {Path(r.path)} ({err}); no file was changed") from err
    for tmp, target in staged:
        os.replace(tmp, target)


class MigrationWriteError(OSError):
    """``--fix`` could not stage a rewritten file; nothing was changed."""
