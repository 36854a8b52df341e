"""What the codemod says about each FSDP1 name: the texts of its findings and TODOs, mostly from
the mapping table, and the tables of FSDP1's arguments, methods and internals."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from fsdp_bridge.mapping import TABLE
from fsdp_bridge.strategy import FSDP1_PARAMETERS

TODO = "TODO(fsdp-bridge)"

FSDP = "FullyShardedDataParallel"

# Names (last components of a torch.distributed qualified name) and their replacements.
# The texts come from the mapping table where it has a row for the construct.


# What the bridge target writes for FSDP1's ShardedGradScaler, and why not torch.amp.GradScaler.
SCALER_TEXT = (
    "sums the overflow check over the ranks, as FSDP1's flat-shard gradients need on the fsdp1 backend and "
    "DTensor gradients allow on fsdp2; --target torch writes _fsdp2_helpers.GradScaler(...) (torch.amp.GradScaler "
    "that unscales float16 gradients as ShardedGradScaler does), right on FSDP2 only"
)


def fsdp2_text(option: str) -> str:
    for rule in TABLE:
        if rule.option == option:
            return rule.fsdp2.text
    raise KeyError(option)


NAMES: dict[str, str] = {
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
    "default_auto_wrap_policy": "torch 1.11's name of size_based_auto_wrap_policy (no longer in torch): "
    "BridgeConfig(wrap={'min_num_params': N}), N its min_num_params (100000000 by default)",
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
    "set_state_dict_type": "fsdp_bridge.save_checkpoint / load_checkpoint; or " + fsdp2_text("state_dict_type"),
    "StateDictType": "fsdp_bridge.save_checkpoint(..., kind='full'|'sharded')",
    "FullStateDictConfig": "fsdp_bridge.save_checkpoint(..., kind='full') (rank 0 writes, CPU copy)",
    "ShardedStateDictConfig": "fsdp_bridge.save_checkpoint(..., kind='sharded')",
    "LocalStateDictConfig": "fsdp_bridge.save_checkpoint / load_checkpoint(..., kind='sharded') (FSDP2 has no local "
    "state dict)",
    "FullOptimStateDictConfig": "fsdp_bridge.save_checkpoint(path, model, optimizer, kind='full')",
    "ShardedOptimStateDictConfig": "fsdp_bridge.save_checkpoint(path, model, optimizer, kind='sharded')",
    "summon_full_params": "fsdp_bridge.summon_full_params(model, writeback=...); " + fsdp2_text("summon_full_params"),
    "no_sync": "fsdp_bridge.no_sync(model); " + fsdp2_text("no_sync"),
    "clip_grad_norm_": "fsdp_bridge.clip_grad_norm_(model, max_norm); " + fsdp2_text("clip_grad_norm_"),
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
    "rekey_optim_state_dict": "not rewritten: FSDP1's re-keying of an optimizer state dict (parameter ids <-> "
    "names) reads FSDP1's wrapper (keeps working only where the model stays FSDP1's); on FSDP2 torch's "
    "get_optimizer_state_dict / set_optimizer_state_dict key the state by parameter name already: load a "
    "name-keyed full state with set_optimizer_state_dict(model, optimizer, sd, "
    "options=StateDictOptions(full_state_dict=True))",
    "flatten_sharded_optim_state_dict": "not rewritten: FSDP1's flattening of a sharded optimizer state dict "
    "(ShardedTensors, from sharded_optim_state_dict) into its flat parameters' layout has no FSDP2 form (FSDP2 "
    "keeps one DTensor per parameter): load the sharded state with set_optimizer_state_dict(model, optimizer, sd) "
    "(fsdp_bridge.optim_state_dict_to_load(model, optimizer, sd) on either backend); a checkpoint FSDP1 wrote "
    "loads with fsdp_bridge.load_sharded_optimizer_state_dict",
    "ShardedGradScaler": "fsdp_bridge.GradScaler(...) (either backend); " + fsdp2_text("ShardedGradScaler"),
    "CPUOffload": "BridgeConfig(cpu_offload=True) (" + fsdp2_text("cpu_offload") + ")",
    "MixedPrecision": "BridgeConfig(mixed_precision={'param_dtype': ..., 'reduce_dtype': ..., 'buffer_dtype': ...})",
    "BackwardPrefetch": "BridgeConfig(backward_prefetch='pre') (FSDP2 has only BACKWARD_PRE timing)",
    "ShardingStrategy": "BridgeConfig(strategy='full_shard'|'shard_grad_op'|'no_shard'|'hybrid_shard'|"
    "'hybrid_shard_zero2')",
    "apply_activation_checkpointing": "BridgeConfig(activation_checkpointing=True) checkpoints every wrap unit; "
    "remove this call once the config has it",
}

INTERNAL_ATTRS: dict[str, str] = {
    "flat_param": "FSDP1's flat parameter has no FSDP2 form: each parameter is its own DTensor; "
    "iterate model.parameters() (p.to_local() for this rank's shard); to move a model's shards (and their "
    "gradients) to another device between steps: fsdp_bridge.move_shards(model, device)",
    "_flat_param": "FSDP1's flat parameter has no FSDP2 form: each parameter is its own DTensor; "
    "iterate model.parameters() (p.to_local() for this rank's shard); to move a model's shards (and their "
    "gradients) to another device between steps: fsdp_bridge.move_shards(model, device)",
    "_handle": "FSDP1's FlatParamHandle has no FSDP2 form: use the module's parameters (DTensors) and "
    "FSDPModule methods (unshard/reshard); to move a model's shards (and their gradients) to another device "
    "between steps: fsdp_bridge.move_shards(model, device)",
    "_has_params": "FSDP1's private flag (does this unit manage parameters) has no FSDP2 form: FSDPModule's "
    "reshard()/unshard() do nothing on a unit without parameters; drop the test",
    "_lazy_init": "FSDP2 initialises on the first forward; nothing to call (FSDPModule has no _lazy_init)",
    "_is_root": "FSDP1's private root flag has no FSDP2 form (FSDPModule has no _is_root): the root is the model "
    "fsdp_bridge.shard returned (fsdp_bridge.get_bridge(m) finds its bridge on it, TypeError on a unit inside it); "
    "fsdp_bridge.clip_grad_norm_ takes either, so a root search made for FSDP1's clipping can go",
    "_fsdp_wrapped_module": "not rewritten: on the bridge's fsdp1 backend the model stays FSDP1's wrapper and this "
    "is the module inside it (its own forward, state_dict, __dict__, identity), while FSDP2 does not wrap (the "
    "module is itself, an FSDPModule); only a read of a name the wrapper does not define (X._fsdp_wrapped_module."
    "name, which the wrapper forwards) is rewritten to X.name. Use the model itself where it is FSDP2's",
    "_handles": "FSDP1's list of FlatParamHandles has no FSDP2 form: use the module's parameters (DTensors) and "
    "FSDPModule methods (unshard/reshard)",
    "_local_shard": "FSDP1's flat parameter's local shard has no FSDP2 form (setting p.data on a DTensor "
    "parameter does not move its shard): each parameter is a DTensor, p.to_local() this rank's shard; to move a "
    "model's shards (and their gradients) to another device between steps: fsdp_bridge.move_shards(model, device)",
    "_is_flat_param": "FSDP1's flat-parameter flag has no FSDP2 form: each parameter is its own DTensor "
    "(isinstance(p, torch.distributed.tensor.DTensor))",
    "_all_handles": "FSDP1's list of every FlatParamHandle under the root has no FSDP2 form: iterate the model's "
    "parameters (DTensors) and its FSDPModule units (m for m in model.modules() if isinstance(m, FSDPModule))",
    "_assert_state": "FSDP1's private training-state check has no FSDP2 form (FSDPModule has no _assert_state): "
    "drop it",
    "_exec_order_data": "FSDP1's record of the order its units ran in (for forward prefetch and its order checks) "
    "has no FSDP2 form: FSDP2 prefetches in the order set with FSDPModule.set_modules_to_forward_prefetch / "
    "set_modules_to_backward_prefetch (the bridge: BridgeConfig(forward_prefetch=True))",
    "_fsdp_flattened": "FSDP1 marks the parameters it flattened (flat parameters, use_orig_params views) with "
    "_fsdp_flattened; FSDP2's carry no such mark (False on every one, so a check that an optimizer holds sharded "
    "parameters fails): test isinstance(p, torch.distributed.tensor.DTensor)",
}
"""FSDP1 internals real trainers reach into, and what to do on FSDP2."""

FSDP1_PRIVATE_MODULES = (
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


def fsdp1_private(qnames: Iterable[Any]) -> str | None:
    """``torch.distributed.fsdp._runtime_utils._reshard`` -> that name, for FSDP1's private modules (of a name
    imported from two of them in two branches, the first in sorted order: the report and a TODO read the same on
    every run)."""
    for q in sorted(qnames, key=lambda q: str(q.name)):
        parts = q.name.split(".")
        if parts[:3] == ["torch", "distributed", "fsdp"] and len(parts) > 4 and parts[3] in FSDP1_PRIVATE_MODULES:
            return str(q.name)
        if parts[:4] == ["torch", "distributed", "fsdp", "fully_sharded_data_parallel"] and len(parts) > 4:
            if parts[4].startswith("_") or parts[4] == "TrainingState":  # the wrapper's module's own internals
                return str(q.name)
    return None


WRAPPER_ATTRS: dict[str, str] = {
    "sharding_strategy": "the strategy it was sharded with is fsdp_bridge.get_bridge(model).config.strategy "
    "(fsdp_bridge.ShardingStrategy, same member names) on the model given to fsdp_bridge.shard, or your own setting",
    "mixed_precision": "the setting is fsdp_bridge.get_bridge(model).config.mixed_precision on the model given to "
    "fsdp_bridge.shard, or your own MixedPrecision object",
    "cpu_offload": "the setting is fsdp_bridge.get_bridge(model).config.cpu_offload on the model given to "
    "fsdp_bridge.shard, or your own setting",
    "backward_prefetch": "the setting is fsdp_bridge.get_bridge(model).config.backward_prefetch, or your own setting",
    "forward_prefetch": "the setting is fsdp_bridge.get_bridge(model).config.forward_prefetch, or your own setting",
    "limit_all_gathers": "FSDP2 needs no all-gather rate limiter; use your own setting if the value is logged",
    "process_group": "FSDP1's process_group is the group the model is sharded over: "
    "fsdp_bridge.get_bridge(model).mesh.get_group() on a 1D mesh (FULL_SHARD, SHARD_GRAD_OP); under HYBRID_SHARD "
    "the node's shard group, mesh.get_group('shard'); under NO_SHARD (a (world, 1) mesh) every rank, "
    "mesh.get_group('replicate')",
    "compute_device": "the device is fsdp_bridge.get_bridge(model).device",
    "rank": "use torch.distributed.get_rank() (or the mesh's get_local_rank())",
    "world_size": "use torch.distributed.get_world_size() (or fsdp_bridge.get_bridge(model).mesh.size())",
    "training_state": "FSDP1's private state machine has no FSDP2 form; track the phase in your own code",
    "params": "FSDP1's list of flat parameters has no FSDP2 form: iterate model.parameters() (DTensors; "
    "p.to_local() for this rank's shard)",
    "check_is_root": "the root is the model fsdp_bridge.shard returned (fsdp_bridge.get_bridge(m) finds its "
    "bridge on it, TypeError on a unit inside it); fsdp_bridge.clip_grad_norm_ takes either, so a check made "
    "for FSDP1's clipping can go",
}
"""FSDP1 wrapper attributes read on a wrapped model; FSDPModule has none of them. Reported only where the code shows
the object is FSDP1's (``params`` is too common a name otherwise)."""

OLD_WRAP_KWARG = "fsdp_auto_wrap_policy"
"""torch 1.11's name of FullyShardedDataParallel's ``auto_wrap_policy`` (torch >= 1.12 refuses it)."""

NAME_HELPERS = ("clean_tensor_name", "FSDP_WRAPPED_MODULE", "FSDP_PREFIX")
"""Private FSDP1 names that only spell or strip FSDP1's parameter-name prefixes: they still work, and
change nothing on FSDP2 names (which have no wrapper prefix)."""


def private_text(name: str) -> str:
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
    if last in ("_get_fsdp_handles", "_get_fsdp_states"):
        return (
            f"FSDP1's private {last} has no FSDP2 form and finds nothing on an FSDP2 model (an empty list: a loop "
            "over it does nothing, an operation on what it collects may raise): work on the parameters instead; "
            "two models sharded alike (a model and its EMA copy) hold matching shards, so pairing their "
            "parameters in order with p.to_local() (this rank's shard) gives what the flat parameters gave"
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


CONFIG_DRIVEN = {
    "TrainingArguments": "fsdp",
    "Seq2SeqTrainingArguments": "fsdp",
    "FullyShardedDataParallelPlugin": "fsdp_version",
}
"""Constructors that drive FSDP from arguments: their settings are migrated by `migrate config`."""

KEPT: dict[str, str] = {
    "StateDictType": "torch's FSDP1 enum, here a value of your own code",
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


def keep_low_precision_text(value: str) -> str:
    """The TODO for ``MixedPrecision(keep_low_precision_grads=<value>)`` that is not a literal False."""
    return (
        f"not rewritten: MixedPrecision(keep_low_precision_grads={value}): FSDP2 keeps gradients "
        "in the parameters' dtype and BridgeConfig.from_fsdp1 refuses a true value when the code runs: "
        "drop it (gradients reduced in reduce_dtype, kept in the parameters' dtype)"
    )


PATCH_WORDS = ("fixed", "patched", "modified")
"""Words a tree's patched copy of one of torch's functions may carry before or after torch's name
(``fixed_flatten_optim_state_dict`` for ``_flatten_optim_state_dict``, ``_broadcast_state_patched``)."""


def unpatched(name: str) -> str | None:
    """``name`` without a word of :data:`PATCH_WORDS` before or after it, and without leading underscores
    (``fixed_full_optim_state_dict`` -> ``full_optim_state_dict``); None where it has no such word."""
    bare = name.lstrip("_")
    for word in PATCH_WORDS:
        if bare.startswith(f"{word}_") and len(bare) > len(word) + 1:
            return bare[len(word) + 1 :].lstrip("_")
        if bare.endswith(f"_{word}") and len(bare) > len(word) + 1:
            return bare[: -len(word) - 1]
    return None


FSDP_METHODS = (
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

STRATEGIES = {
    "FULL_SHARD": "full_shard",
    "SHARD_GRAD_OP": "shard_grad_op",
    "NO_SHARD": "no_shard",
    "HYBRID_SHARD": "hybrid_shard",
    "_HYBRID_SHARD_ZERO2": "hybrid_shard_zero2",
}

KWARG_OPTION = {
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


IGNORED_KWARGS = ("ignored_modules", "ignored_states", "ignored_parameters")
"""FSDP1 arguments naming what is not sharded (modules or parameters), read as BridgeConfig.ignored_modules."""

FSDP1_POSITIONAL = FSDP1_PARAMETERS
"""FullyShardedDataParallel.__init__'s parameters in order, ``module`` first."""


GROUP_RANK0 = (
    "FSDP1's rank0_only in a tree sharding over process groups or a mesh of its own: the full state on each "
    "group's first rank (under a model-parallel layout, the rank that saves its slice), the others empty, "
    "on both backends (torch's StateDictOptions(cpu_offload=True) would give it to world rank 0 only)"
)

HARMLESS_CALLS = {
    "torch.save",
    "print",
    "str",
    "int",
    "len",
    "torch.distributed.get_rank",
    "torch.distributed.get_world_size",
    "torch.distributed.barrier",
}

MOCKS = {"Mock", "MagicMock", "NonCallableMock", "NonCallableMagicMock", "AsyncMock", "create_autospec"}


def fsdp2_any(option: str) -> str:
    texts = [r.fsdp2.text for r in TABLE if r.option == option]
    return texts[0] if texts else "see docs/migration.md"


def fsdp2_case(option: str, case: str) -> str:
    for r in TABLE:
        if r.option == option and r.case == case:
            return r.fsdp2.text
    return fsdp2_any(option)


def wrapper_defines(name: str) -> bool:
    """Whether FSDP1's wrapper class answers ``name`` itself (a method or attribute of
    ``FullyShardedDataParallel`` or ``nn.Module``) rather than handing it to the module it wraps."""
    return name.startswith("_") or name in _WRAPPER_INSTANCE_NAMES or name in _wrapper_names()


# Set on each instance (not in dir() of the class): nn.Module's and FSDP1's own attributes.
_WRAPPER_INSTANCE_NAMES = frozenset(
    (
        "training",
        "sharding_strategy",
        "mixed_precision",
        "cpu_offload",
        "backward_prefetch",
        "forward_prefetch",
        "limit_all_gathers",
        "use_orig_params",
        "process_group",
        "compute_device",
        "rank",
        "world_size",
        "training_state",
    )
)


@functools.cache
def _wrapper_names() -> frozenset[str]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return frozenset(dir(FullyShardedDataParallel))
