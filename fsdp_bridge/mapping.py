"""The FSDP1 <-> FSDP2 translation table: the one place that says what every option becomes.

Each :class:`Rule` covers one option in one case (e.g. ``backward_prefetch: post``)
and gives, for each backend, an :class:`Outcome` and the reason.  The same table
drives config validation (``UNSUPPORTED`` raises :class:`ConfigError`), the report
that :func:`fsdp_bridge.shard` logs, ``fsdp-bridge explain``, and the migration
guide in ``docs/migration.md`` (a test keeps that file in sync).

Rules whose ``when`` is ``None`` describe FSDP1 API with no config field (``no_sync``,
``state_dict_type`` ...): they appear in the migration table, not in a config report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdp_bridge.errors import Problem
from fsdp_bridge.strategy import Backend, BackwardPrefetch, ShardingStrategy
from fsdp_bridge.translation import Entry, Outcome, Translation, TranslationReport, show_value

if TYPE_CHECKING:
    from fsdp_bridge.config import BridgeConfig

__all__ = [
    "TABLE",
    "Outcome",
    "Rule",
    "Translation",
    "TranslationReport",
    "api_translation",
    "no_shard_mesh_shape",
    "translate",
    "unsupported_problems",
]


def full_precision_classes(config: BridgeConfig) -> tuple[str, ...]:
    """The module class names ``config`` keeps in full precision (``mixed_precision.full_precision_modules``,
    FSDP1's default where it is None: BatchNorm when there are wrap units); none without mixed precision."""
    mp = config.mixed_precision
    if not mp.enabled:
        return ()
    if mp.full_precision_modules is None:
        return ("_BatchNorm",) if config.wrap.mode != "none" else ()
    return mp.full_precision_modules


@dataclass(frozen=True)
class Context:
    """What a rule may look at: the config and, once known, the device type."""

    config: BridgeConfig
    device_type: str | None  # "cpu", "cuda", or None before the device is resolved


@dataclass(frozen=True)
class Rule:
    option: str
    """A BridgeConfig field, or an FSDP1 API name for rules with ``when=None``."""
    case: str
    """Which values of the option this rule covers."""
    fsdp1_api: str
    """How FSDP1 code spells this option."""
    fsdp1: Translation
    fsdp2: Translation
    when: Callable[[Context], bool] | None = None

    def for_backend(self, backend: Backend) -> Translation:
        return self.fsdp1 if backend is Backend.FSDP1 else self.fsdp2


N, E, X, U = Outcome.NATIVE, Outcome.EMULATED, Outcome.NOT_NEEDED, Outcome.UNSUPPORTED
T = Translation
SS = ShardingStrategy
BP = BackwardPrefetch


def _strategy(s: ShardingStrategy) -> Callable[[Context], bool]:
    return lambda c: c.config.strategy is s


def _raf_matches_strategy(c: Context) -> bool:
    raf = c.config.reshard_after_forward
    return isinstance(raf, bool) and raf == c.config.strategy.reshards_after_forward


def _device_type(c: Context) -> str | None:
    """The device the rule is for: the resolved one, else the config's when it names one."""
    if c.device_type is not None:
        return c.device_type
    return None if c.config.device == "auto" else c.config.device


def _on_cpu(c: Context) -> bool:
    return _device_type(c) == "cpu"


def _depth(value: object) -> bool:
    """A prefetch given as a number of units ahead (an int, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


_FSDP1_ONE_UNIT = (
    "FSDP1 prefetches exactly one unit ahead and has no depth setting; use {option}: {one} "
    "(one unit ahead) on fsdp1, or backend: fsdp2 for more"
)


_FLOAT8_CPU = (
    "float8 training runs float8 matmuls (torch._scaled_mm), which need a CUDA GPU of compute capability 8.9+ "
    "(Ada, Hopper or newer); there are none on CPU: remove float8"
)


def _cuda_graphs(c: Context) -> bool:
    return c.config.compile.mode in ("reduce-overhead", "max-autotune")


_NO_CUDA_GRAPHS = (
    "CUDA graphs replay fixed buffers, while FSDP all-gathers and frees each unit's parameters between the "
    "compiled regions; use mode: default or max-autotune-no-cudagraphs"
)
_NO_UNITS_TO_COMPILE = (
    "compile is regional: it compiles the wrap units, and wrap: none has none; choose units "
    "(wrap: auto, or a list of classes) or compile the model yourself"
)

_STRATEGY_FOR_RAF = (
    "FSDP1 ties resharding to the strategy; choose the strategy instead "
    "(reshard: full_shard / hybrid_shard; keep gathered: shard_grad_op / hybrid_shard_zero2) "
    "and remove reshard_after_forward"
)

_ONE_RANK_GROUP = (
    " A shard group of one rank (world size 1, hybrid_shape [N, 1]): every unit, root included, reshards "
    "unless reshard_after_forward is set (nothing is communicated; it frees FSDP2's one-rank copy)"
)

_HYBRID_ONE_RANK = (
    " With one rank per shard group (one GPU per node), torch's FSDP1 turned HYBRID into NO_SHARD over each "
    "one-rank group and never all-reduced across the groups (each trained its own copy); FSDP2 all-reduces "
    "over the replicate dimension, so such a run trains one model now"
)

TABLE: tuple[Rule, ...] = (
    # -- strategy ----------------------------------------------------------------
    Rule(
        "strategy",
        "full_shard",
        "sharding_strategy=ShardingStrategy.FULL_SHARD",
        T(N, "ShardingStrategy.FULL_SHARD"),
        T(
            N,
            "1D mesh over all ranks; reshard_after_forward=True on every unit, False on the root "
            "(FSDP1 also keeps the root gathered for the backward that follows)." + _ONE_RANK_GROUP,
        ),
        _strategy(SS.FULL_SHARD),
    ),
    Rule(
        "strategy",
        "shard_grad_op",
        "sharding_strategy=ShardingStrategy.SHARD_GRAD_OP",
        T(N, "ShardingStrategy.SHARD_GRAD_OP"),
        T(
            N,
            "1D mesh over all ranks; reshard_after_forward=False (ZeRO-2)." + _ONE_RANK_GROUP,
        ),
        _strategy(SS.SHARD_GRAD_OP),
    ),
    Rule(
        "strategy",
        "no_shard",
        "sharding_strategy=ShardingStrategy.NO_SHARD",
        T(N, "ShardingStrategy.NO_SHARD (its FutureWarning recommending DDP is silenced: the choice is deliberate)"),
        T(
            E,
            "2D mesh (world, 1): replicate over every rank, shard over groups of one, so every rank holds "
            "the full model and gradients are all-reduced: NO_SHARD's meaning, not ZeRO-2 (a 1D mesh= given, "
            "FSDP1's device_mesh or process_group, becomes (n, 1) over its ranks). FSDP2 still copies "
            "a unit's parameters into separate buffers when it runs it, so every unit reshards after forward "
            "(nothing is communicated; only the root's and the running unit's copies are alive): 1.065x "
            "FSDP1's peak on a small Llama in fp32, 1.001x in bf16 (was 1.199x keeping them). torch's "
            "FSDP2-based replicate() cannot reshard (1.199x) (benchmarks/no_shard.py)",
        ),
        _strategy(SS.NO_SHARD),
    ),
    Rule(
        "strategy",
        "hybrid_shard",
        "sharding_strategy=ShardingStrategy.HYBRID_SHARD",
        T(N, "ShardingStrategy.HYBRID_SHARD on a 2D device mesh (replicate, shard)"),
        T(
            N,
            "2D mesh (replicate, shard); reshard_after_forward=True on every unit, False on the root."
            + _ONE_RANK_GROUP
            + "."
            + _HYBRID_ONE_RANK,
        ),
        _strategy(SS.HYBRID_SHARD),
    ),
    Rule(
        "strategy",
        "hybrid_shard_zero2",
        "sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2",
        T(N, "ShardingStrategy._HYBRID_SHARD_ZERO2 on a 2D device mesh (replicate, shard)"),
        T(
            N,
            "2D mesh (replicate, shard); reshard_after_forward=False." + _ONE_RANK_GROUP + "." + _HYBRID_ONE_RANK,
        ),
        _strategy(SS.HYBRID_SHARD_ZERO2),
    ),
    # -- hybrid mesh shape -------------------------------------------------------
    Rule(
        "hybrid_shape",
        "default",
        "device_mesh=init_device_mesh(..., (nodes, gpus_per_node))",
        T(N, "device_mesh of shape (nodes, ranks per node): shard within a node, replicate across nodes"),
        T(N, "mesh of shape (nodes, ranks per node): shard within a node, replicate across nodes"),
        lambda c: c.config.strategy.is_hybrid and c.config.hybrid_shape is None,
    ),
    Rule(
        "hybrid_shape",
        "[replicate, shard]",
        "device_mesh=init_device_mesh(..., (replicate, shard))",
        T(N, "device_mesh of the given shape; mesh dim 0 replicates, dim 1 shards"),
        T(N, "mesh of the given shape; mesh dim 0 replicates, dim 1 shards"),
        lambda c: c.config.strategy.is_hybrid and c.config.hybrid_shape is not None,
    ),
    Rule(
        "hybrid_shape",
        "null (not hybrid)",
        "(no 2D device_mesh)",
        T(X, "not a hybrid strategy: a 1D mesh over all ranks"),
        T(X, "not a hybrid strategy: a 1D mesh over all ranks (no_shard: the (world, 1) mesh, see strategy)"),
        lambda c: not c.config.strategy.is_hybrid,
    ),
    # -- wrapping ----------------------------------------------------------------
    Rule(
        "wrap",
        "none",
        "auto_wrap_policy=None",
        T(N, "one FSDP unit: the root"),
        T(N, "fully_shard on the root only"),
        lambda c: c.config.wrap.mode == "none",
    ),
    Rule(
        "wrap",
        "auto / classes / min_num_params / callable",
        "auto_wrap_policy=transformer_auto_wrap_policy / size_based_auto_wrap_policy / ModuleWrapPolicy / CustomPolicy",
        T(
            N,
            "auto_wrap_policy=CustomPolicy over the units fsdp_bridge resolved (the same modules as on FSDP2, "
            "plus each module holding parameters of another dtype than its unit: FSDP1 flattens one dtype per unit)",
        ),
        T(
            E,
            "fully_shard on each resolved unit, bottom-up, then on the root; units that would split tied "
            "parameters are merged into their parent (a module reached by two paths stays one unit, as FSDP1 "
            "wraps it once). Where FSDP1's policy put the two modules of a tie in different units (GPT-2's wte "
            "and lm_head under size_based_auto_wrap_policy), each flattened its own copy and the copies "
            "trained apart from the first step; here the tie holds, so such a model's losses differ from "
            "FSDP1's from the second step on (as the model defines it, not as FSDP1 split it)",
        ),
        lambda c: c.config.wrap.mode != "none",
    ),
    # -- mixed precision ---------------------------------------------------------
    Rule(
        "mixed_precision",
        "fp32 (off)",
        "mixed_precision=None (or False)",
        T(N, "no MixedPrecision"),
        T(N, "default MixedPrecisionPolicy (no casts)"),
        lambda c: not c.config.mixed_precision.enabled,
    ),
    Rule(
        "mixed_precision",
        "param/reduce dtypes",
        "MixedPrecision(param_dtype, reduce_dtype, cast_forward_inputs, cast_root_forward_inputs)",
        T(N, "MixedPrecision(param_dtype, reduce_dtype, cast_forward_inputs, cast_root_forward_inputs)"),
        T(
            N,
            "MixedPrecisionPolicy(param_dtype, reduce_dtype, cast_forward_inputs) on each unit; the root's "
            "casts its inputs when cast_forward_inputs or cast_root_forward_inputs is set (FSDP1's default, "
            "the root only: false / true)",
        ),
        lambda c: c.config.mixed_precision.enabled,
    ),
    Rule(
        "mixed_precision.output_dtype",
        "set",
        "(none in FSDP1)",
        T(E, "a forward hook on the root casts its floating-point outputs"),
        T(
            N,
            "MixedPrecisionPolicy(output_dtype=...) on the root's fully_shard call only "
            "(inner units would hand the root's own layers inputs in another dtype)",
        ),
        lambda c: c.config.mixed_precision.output_dtype is not None,
    ),
    Rule(
        "mixed_precision.output_dtype",
        "null",
        "(none in FSDP1)",
        T(N, "outputs keep the dtype the model computes them in"),
        T(N, "MixedPrecisionPolicy(output_dtype=None): outputs keep the dtype the model computes them in"),
        lambda c: c.config.mixed_precision.output_dtype is None,
    ),
    Rule(
        "mixed_precision.buffer_dtype",
        "set",
        "MixedPrecision(buffer_dtype=...)",
        T(N, "MixedPrecision(buffer_dtype=...)"),
        T(
            E,
            "FSDP2 does not manage buffers: floating-point buffers are cast once when sharding; state dicts "
            "give them back in the dtype they had, as FSDP1's do",
        ),
        lambda c: c.config.mixed_precision.buffer_dtype is not None,
    ),
    Rule(
        "mixed_precision.buffer_dtype",
        "null",
        "MixedPrecision(buffer_dtype=None)",
        T(N, "buffers keep their dtype"),
        T(N, "buffers keep their dtype (FSDP2 does not manage buffers)"),
        lambda c: c.config.mixed_precision.buffer_dtype is None,
    ),
    Rule(
        "mixed_precision.full_precision_modules",
        "class names (null: BatchNorm when there are wrap units)",
        "MixedPrecision(_module_classes_to_ignore=...) with an auto_wrap_policy (default: BatchNorm)",
        T(
            N,
            "MixedPrecision(_module_classes_to_ignore=those classes): FSDP1 wraps each such module on its own "
            "without mixed precision and casts its inputs to float32 and its outputs back",
        ),
        T(
            E,
            "fully_shard on each such module with a default MixedPrecisionPolicy() before its parent's, and "
            "forward hooks casting its floating-point inputs to float32 and its outputs back (FSDP1's hooks)",
        ),
        lambda c: bool(full_precision_classes(c.config)),
    ),
    Rule(
        "mixed_precision.full_precision_modules",
        "[] (none; null without wrap units)",
        "MixedPrecision(_module_classes_to_ignore=()), or no auto_wrap_policy",
        T(
            N,
            "MixedPrecision(_module_classes_to_ignore=()): every module in param_dtype (FSDP1's own default "
            "keeps BatchNorm in full precision: BridgeConfig.from_fsdp1 carries it)",
        ),
        T(N, "every module computes in param_dtype"),
        lambda c: not full_precision_classes(c.config),
    ),
    # -- prefetch and rate limiting -----------------------------------------------
    Rule(
        "backward_prefetch",
        "pre",
        "backward_prefetch=BackwardPrefetch.BACKWARD_PRE",
        T(N, "BackwardPrefetch.BACKWARD_PRE"),
        T(N, "implicit: FSDP2 always gathers the previous unit before the current unit's gradient computation"),
        lambda c: c.config.backward_prefetch is BP.PRE,
    ),
    Rule(
        "backward_prefetch",
        "post",
        "backward_prefetch=BackwardPrefetch.BACKWARD_POST",
        T(N, "BackwardPrefetch.BACKWARD_POST"),
        T(
            U,
            "FSDP2 prefetches only before a unit's gradient computation (BACKWARD_PRE timing). "
            "Use backward_prefetch: pre: the same overlap, holding at most one more unit gathered",
        ),
        lambda c: c.config.backward_prefetch is BP.POST,
    ),
    Rule(
        "backward_prefetch",
        "none",
        "backward_prefetch=None",
        T(N, "backward_prefetch=None"),
        T(
            E,
            "each unit's set_modules_to_backward_prefetch([itself]): the unit is gathered already when its "
            "backward starts, so FSDP2's implicit prefetch of the next unit is off",
        ),
        lambda c: c.config.backward_prefetch is BP.NONE,
    ),
    Rule(
        "backward_prefetch",
        "integer N (units ahead)",
        "(none in FSDP1: BACKWARD_PRE prefetches one unit)",
        T(U, _FSDP1_ONE_UNIT.format(option="backward_prefetch", one="pre")),
        T(
            N,
            "explicit: each unit not nested in another calls set_modules_to_backward_prefetch with the N such "
            "units registered before it, nearest first (backward runs them in reverse registration order); "
            "the root keeps FSDP2's implicit prefetch of the last unit. Holds up to N more units gathered",
        ),
        lambda c: _depth(c.config.backward_prefetch),
    ),
    Rule(
        "forward_prefetch",
        "true",
        "forward_prefetch=True",
        T(N, "forward_prefetch=True"),
        T(
            E,
            "explicit: each unit not nested in another calls set_modules_to_forward_prefetch([the next such unit]), "
            "in the order the model registers them (a layer stack's forward order); nested units gather when reached",
        ),
        lambda c: c.config.forward_prefetch is True,
    ),
    Rule(
        "forward_prefetch",
        "integer N (units ahead)",
        "(none in FSDP1: forward_prefetch=True prefetches one unit)",
        T(U, _FSDP1_ONE_UNIT.format(option="forward_prefetch", one="true")),
        T(
            N,
            "explicit: each unit not nested in another calls set_modules_to_forward_prefetch with the next N "
            "such units, in the order the model registers them (a layer stack's forward order); the root "
            "gathers the first unit as it reaches it. Holds up to N more units gathered",
        ),
        lambda c: _depth(c.config.forward_prefetch),
    ),
    Rule(
        "forward_prefetch",
        "false",
        "forward_prefetch=False",
        T(N, "forward_prefetch=False"),
        T(N, "no explicit prefetch: each unit's all-gather is issued as the CPU reaches it"),
        lambda c: not c.config.forward_prefetch,
    ),
    Rule(
        "limit_all_gathers",
        "any",
        "limit_all_gathers=True|False",
        T(N, "limit_all_gathers passed through"),
        T(
            X,
            "FSDP2 frees memory without CPU synchronisation or recordStream, so in-flight all-gathers "
            "need no rate limiter",
        ),
        lambda c: True,
    ),
    # -- offload, checkpointing, init ----------------------------------------------
    Rule(
        "cpu_offload",
        "true, on CPU",
        "cpu_offload=CPUOffload(offload_params=True)",
        T(
            X,
            "parameters already live in host memory on a CPU run (torch's CPU offload needs an "
            "accelerator and would fail); nothing is offloaded",
        ),
        T(
            X,
            "parameters already live in host memory on a CPU run (torch's CPU offload needs an "
            "accelerator and would fail); nothing is offloaded",
        ),
        lambda c: c.config.cpu_offload and _on_cpu(c),
    ),
    Rule(
        "cpu_offload",
        "true, on an accelerator",
        "cpu_offload=CPUOffload(offload_params=True)",
        T(N, "CPUOffload(offload_params=True)"),
        T(
            N,
            "offload_policy=CPUOffloadPolicy(pin_memory=True). The gradients are then CPU DTensors: a collective "
            "over them (a loss scaler's overflow check, the clip's global norm) needs a process group with a CPU "
            "backend, init_process_group('cuda:nccl,cpu:gloo') (an NCCL-only group raises there)",
        ),
        lambda c: c.config.cpu_offload and not _on_cpu(c),
    ),
    Rule(
        "cpu_offload",
        "false",
        "cpu_offload=None",
        T(N, "cpu_offload=None: parameters stay on the device"),
        T(N, "offload_policy=OffloadPolicy(): parameters stay on the device"),
        lambda c: not c.config.cpu_offload,
    ),
    Rule(
        "activation_checkpointing",
        "true",
        "apply_activation_checkpointing(model, checkpoint_wrapper, check_fn)",
        T(
            N,
            "non-reentrant checkpoint_wrapper on every unit, applied before wrapping; "
            "Hugging Face models get use_cache=False",
        ),
        T(
            N,
            "non-reentrant checkpoint_wrapper on every unit, applied before fully_shard; "
            "Hugging Face models get use_cache=False",
        ),
        lambda c: c.config.activation_checkpointing,
    ),
    Rule(
        "activation_checkpointing",
        "false",
        "(no apply_activation_checkpointing)",
        T(N, "activations are stored for backward"),
        T(N, "activations are stored for backward"),
        lambda c: not c.config.activation_checkpointing,
    ),
    Rule(
        "sync_module_states",
        "true, on CPU",
        "sync_module_states=True, param_init_fn=...",
        T(
            E,
            "FSDP1's sync_module_states refuses CPU tensors: after wrapping (meta modules get "
            "param_init_fn=to_empty), rank 0's full state dict is broadcast with "
            "set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True), and buffers from rank 0",
        ),
        T(
            E,
            "after fully_shard, meta tensors are materialised with to_empty and rank 0's full state dict is "
            "broadcast with set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True); "
            "buffers are broadcast from rank 0",
        ),
        lambda c: c.config.sync_module_states and _on_cpu(c),
    ),
    Rule(
        "sync_module_states",
        "true, on an accelerator",
        "sync_module_states=True, param_init_fn=...",
        T(N, "sync_module_states=True; modules on the meta device get param_init_fn=to_empty"),
        T(
            E,
            "after fully_shard, meta tensors are materialised with to_empty and rank 0's full state dict is "
            "broadcast with set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True); "
            "buffers are broadcast from rank 0",
        ),
        lambda c: c.config.sync_module_states and not _on_cpu(c),
    ),
    Rule(
        "sync_module_states",
        "false",
        "sync_module_states=False",
        T(N, "sync_module_states=False: every rank keeps the weights it built"),
        T(N, "every rank keeps the weights it built"),
        lambda c: not c.config.sync_module_states,
    ),
    Rule(
        "reshard_after_forward",
        "null (from the strategy)",
        "(implied by sharding_strategy)",
        T(N, "implied by the strategy"),
        T(N, "set per unit from the strategy (see strategy)"),
        lambda c: c.config.reshard_after_forward is None,
    ),
    Rule(
        "reshard_after_forward",
        "no_shard + override",
        "(implied by sharding_strategy)",
        T(X, "nothing is sharded under NO_SHARD, so there is nothing to reshard"),
        T(
            X,
            "nothing is sharded under NO_SHARD, so there is nothing to reshard; every unit frees "
            "FSDP2's working copy of its parameters after forward whatever is set (see strategy)",
        ),
        lambda c: c.config.reshard_after_forward is not None and c.config.strategy is SS.NO_SHARD,
    ),
    Rule(
        "reshard_after_forward",
        "agrees with strategy",
        "(implied by sharding_strategy)",
        T(X, "already implied by the strategy"),
        T(N, "reshard_after_forward passed to every fully_shard call, the root included"),
        lambda c: c.config.strategy is not SS.NO_SHARD and _raf_matches_strategy(c),
    ),
    Rule(
        "reshard_after_forward",
        "true/false against the strategy",
        "(implied by sharding_strategy)",
        T(U, _STRATEGY_FOR_RAF),
        T(N, "reshard_after_forward passed to every fully_shard call, the root included"),
        lambda c: (
            c.config.strategy is not SS.NO_SHARD
            and isinstance(c.config.reshard_after_forward, bool)
            and not _raf_matches_strategy(c)
        ),
    ),
    Rule(
        "reshard_after_forward",
        "integer",
        "(none in FSDP1)",
        T(
            U,
            "FSDP1 cannot reshard to a smaller group after forward; remove reshard_after_forward or use backend: fsdp2",
        ),
        T(
            N,
            "reshard_after_forward=N: after forward, keep parameters gathered within groups of N ranks "
            "(N must divide the shard group size)",
        ),
        lambda c: (
            c.config.strategy is not SS.NO_SHARD
            and isinstance(c.config.reshard_after_forward, int)
            and not isinstance(c.config.reshard_after_forward, bool)
        ),
    ),
    Rule(
        "ignored_modules",
        "set",
        "ignored_modules=[...]",
        T(
            N,
            "ignored_modules (ignored_states when single parameters are named by path): not sharded, "
            "gradients not reduced across ranks. With sync_module_states, "
            "FSDP1's own (on an accelerator) leaves their parameters as each rank built them; the bridge's "
            "broadcast (on CPU) gives them rank 0's, as it does buffers. Moved to the run's device by the bridge "
            "(FSDP1's device_id moves only what it manages)",
        ),
        T(
            N,
            "ignored_params = their parameters (and parameters named by path): not sharded, gradients not "
            "reduced across ranks; moved to the run's device by the bridge (fully_shard moves only what it "
            "manages); sync_module_states' broadcast gives them rank 0's values. They stay plain tensors beside "
            "DTensors: give them an optimizer parameter group of their own on CUDA (foreach kernels refuse the mix; "
            "the first step says so)",
        ),
        lambda c: bool(c.config.ignored_modules),
    ),
    Rule(
        "ignored_modules",
        "none",
        "ignored_modules=None",
        T(N, "every parameter is managed by FSDP"),
        T(N, "every parameter is managed by fully_shard"),
        lambda c: not c.config.ignored_modules,
    ),
    Rule(
        "device",
        "cpu",
        "device_id=torch.device('cpu')",
        T(N, "device_id=cpu, process group on gloo"),
        T(N, "mesh on device type cpu, process group on gloo"),
        lambda c: _device_type(c) == "cpu",
    ),
    Rule(
        "device",
        "cuda",
        "device_id=torch.cuda.current_device()",
        T(
            N,
            "device_id=cuda:LOCAL_RANK (the model's GPU where the process made another one current and put it "
            "there; without LOCAL_RANK the model's GPU, else the current device), process group on NCCL",
        ),
        T(
            N,
            "mesh on device type cuda (cuda:LOCAL_RANK; the model's GPU where the process made another one current "
            "and put it there; without LOCAL_RANK the model's GPU, else the current device), process group on NCCL",
        ),
        lambda c: _device_type(c) == "cuda",
    ),
    Rule(
        "device",
        "auto",
        "device_id=...",
        T(N, "resolved by shard(): cuda (NCCL) when a GPU is available, else cpu (gloo)"),
        T(N, "resolved by shard(): cuda (NCCL) when a GPU is available, else cpu (gloo)"),
        lambda c: _device_type(c) is None,
    ),
    # -- torch.compile ---------------------------------------------------------------
    Rule(
        "compile",
        "false",
        "(torch.compile is applied by the user)",
        T(N, "no torch.compile"),
        T(N, "no torch.compile"),
        lambda c: not c.config.compile.enabled,
    ),
    Rule(
        "compile",
        "CUDA graph modes",
        "torch.compile(mode='reduce-overhead' | 'max-autotune')",
        T(U, _NO_CUDA_GRAPHS),
        T(U, _NO_CUDA_GRAPHS),
        lambda c: c.config.compile.enabled and _cuda_graphs(c),
    ),
    Rule(
        "compile",
        "true, wrap: none",
        "torch.compile(model)",
        T(U, _NO_UNITS_TO_COMPILE),
        T(U, _NO_UNITS_TO_COMPILE),
        lambda c: c.config.compile.enabled and not _cuda_graphs(c) and c.config.wrap.mode == "none",
    ),
    Rule(
        "compile",
        "true / options",
        "torch.compile on each wrapped module before FSDP(use_orig_params=True)",
        T(
            N,
            "unit.compile(mode, fullgraph, dynamic) on each wrap unit before FullyShardedDataParallel wraps it "
            "(regional compilation); FSDP1 needs use_orig_params=True for it, which the bridge always passes. "
            "The root is not compiled",
        ),
        T(
            N,
            "unit.compile(mode, fullgraph, dynamic) on each wrap unit before fully_shard (regional compilation, "
            "as torchtitan does); FSDP2's hooks and collectives run between the compiled regions. The root is "
            "not compiled",
        ),
        lambda c: c.config.compile.enabled and not _cuda_graphs(c) and c.config.wrap.mode != "none",
    ),
    # -- float8 ------------------------------------------------------------------------
    Rule(
        "float8",
        "false",
        "(torchao float8 applied by the user)",
        T(N, "no float8"),
        T(N, "no float8"),
        lambda c: c.config.float8 is None,
    ),
    Rule(
        "float8",
        "tensorwise / rowwise, on CPU",
        "convert_to_float8_training(model)",
        T(U, _FLOAT8_CPU),
        T(U, _FLOAT8_CPU),
        lambda c: c.config.float8 is not None and _on_cpu(c),
    ),
    Rule(
        "float8",
        "tensorwise / rowwise, on a GPU",
        "convert_to_float8_training(model) before FSDP",
        T(
            U,
            "FSDP1 flattens each unit's parameters into one flat tensor and has no float8 all-gather (torchao's "
            "float8 with FSDP works on FSDP2's per-parameter shards); use backend: fsdp2",
        ),
        T(
            N,
            "torchao convert_to_float8_training on the nn.Linear layers inside the units (not the units nor the "
            "root's own, e.g. lm_head; both dimensions multiples of 16) before fully_shard; tensorwise all-gathers "
            "in float8 (enable_fsdp_float8_all_gather), rowwise in the parameter dtype. Needs torchao (optional "
            "extra float8) and compute capability 8.9+: refused by shard() otherwise",
        ),
        lambda c: c.config.float8 is not None and not _on_cpu(c),
    ),
    # -- FSDP1 API with no config field (migration table only) ------------------------
    Rule(
        "use_orig_params",
        "-",
        "use_orig_params=True|False",
        T(N, "always True under fsdp_bridge, so optimizers see the original parameters"),
        T(X, "FSDP2 parameters are always the original ones (as DTensors)"),
    ),
    Rule(
        "device_id",
        "-",
        "device_id=...",
        T(N, "set from the resolved device"),
        T(X, "taken from the mesh's device type"),
    ),
    Rule(
        "param_init_fn",
        "-",
        "param_init_fn=...",
        T(
            N,
            "BridgeConfig.from_fsdp1 keeps it: FSDP1's own rule runs before sharding (param_init_fn, else "
            "reset_parameters(), on each rank's meta-device modules, rank 0's too, in FSDP1's order), then "
            "sync_module_states broadcasts rank 0's weights; other configs: to_empty for meta modules and rank "
            "0's weights broadcast",
        ),
        T(
            E,
            "the same before fully_shard (from_fsdp1: param_init_fn or reset_parameters() on each rank's "
            "meta-device modules, in FSDP1's order); other configs: to_empty(device) and rank 0's weights "
            "(sync_module_states), or load weights after shard()",
        ),
    ),
    Rule(
        "no_sync",
        "-",
        "with model.no_sync():",
        T(N, "fsdp_bridge.no_sync(model) calls FSDP.no_sync()"),
        T(
            N,
            "fsdp_bridge.no_sync(model) calls set_requires_gradient_sync(False) (covers HSDP's all-reduce), "
            "restored on exit",
        ),
    ),
    Rule(
        "defer_all_reduce",
        "-",
        "(none in FSDP1: with model.no_sync(): defers all communication)",
        T(
            U,
            "FSDP1 cannot keep the reduce-scatter per micro-batch and defer only the all-reduce across replicas; "
            "use fsdp_bridge.no_sync(model) (no communication until the last micro-batch) or backend: fsdp2",
        ),
        T(
            N,
            "fsdp_bridge.defer_all_reduce(model) calls set_requires_all_reduce(False) on every unit, restored on "
            "exit: each micro-batch still reduce-scatters in its shard group, the all-reduce across replicas runs "
            "once, in the first backward after the context. A 1D mesh has no all-reduce: the context changes "
            "nothing (logged once). NO_SHARD's (world, 1) mesh: all its communication is that all-reduce",
        ),
    ),
    Rule(
        "clip_grad_norm_",
        "-",
        "model.clip_grad_norm_(max_norm)",
        T(N, "fsdp_bridge.clip_grad_norm_(model, ...) calls FSDP.clip_grad_norm_"),
        T(
            N,
            "fsdp_bridge.clip_grad_norm_(model, ...) uses torch.nn.utils norms over DTensor gradients "
            "(correct across shards and replicas); returns the total norm",
        ),
    ),
    Rule(
        "summon_full_params",
        "-",
        "with FSDP.summon_full_params(model):",
        T(N, "fsdp_bridge.summon_full_params(model) calls FSDP.summon_full_params"),
        T(
            E,
            "fsdp_bridge.summon_full_params(model) swaps in DTensor.full_tensor() copies, writes shards "
            "back on exit when writeback=True",
        ),
    ),
    Rule(
        "state_dict_type",
        "-",
        "with FSDP.state_dict_type(model, ...): model.state_dict()",
        T(N, "torch.distributed.checkpoint.state_dict get/set_model_state_dict"),
        T(N, "torch.distributed.checkpoint.state_dict get/set_model_state_dict (the same call)"),
    ),
    Rule(
        "optim_state_dict",
        "-",
        "FSDP.optim_state_dict / optim_state_dict_to_load",
        T(N, "get/set_optimizer_state_dict"),
        T(N, "get/set_optimizer_state_dict (the same call)"),
    ),
    Rule(
        "cpu_ram_efficient_loading",
        "-",
        "cpu_ram_efficient_loading=True (accelerate, Trainer)",
        T(N, "rank 0 loads the weights, other ranks build on the meta device; implies sync_module_states=True"),
        T(
            E,
            "sync_module_states: true: ranks > 0 may build on the meta device; after fully_shard rank 0's full "
            "state dict is broadcast (set_model_state_dict with broadcast_from_rank0=True)",
        ),
    ),
    Rule(
        "ShardedGradScaler",
        "-",
        "ShardedGradScaler()",
        T(N, "ShardedGradScaler"),
        T(N, "torch.amp.GradScaler (works on DTensor gradients); fsdp_bridge.GradScaler on either backend"),
    ),
    Rule(
        "keep_low_precision_grads",
        "-",
        "MixedPrecision(keep_low_precision_grads=True)",
        T(N, "MixedPrecision(keep_low_precision_grads=True)"),
        T(
            U,
            "no equivalent: FSDP2 gradients take the sharded parameter's dtype; set param dtype via "
            "model.to(dtype) before sharding if low-precision gradients are the goal",
        ),
    ),
    Rule(
        "process_group",
        "-",
        "process_group=... | (intra, inter)",
        T(N, "a 1D device mesh, or 2D for HYBRID_*"),
        T(N, "mesh= (1D, or 2D for HYBRID_*; NO_SHARD replicates over a 1D mesh's ranks)"),
    ),
)


def api_translation(name: str, backend: Backend) -> Translation:
    """What the FSDP1 API row ``name`` (a rule without a config field, e.g. ``defer_all_reduce``) says for ``backend``.

    Raises:
        KeyError: no such row.
    """
    for rule in TABLE:
        if rule.option == name and rule.when is None:
            return rule.for_backend(backend)
    raise KeyError(f"no API row {name!r} in the table")


CONFIG_OPTIONS: tuple[str, ...] = tuple(dict.fromkeys(r.option for r in TABLE if r.when is not None))


def no_shard_mesh_shape(backend: Backend, world_size: int) -> tuple[int, ...]:
    """The mesh NO_SHARD runs on (the ``no_shard`` rows above): FSDP1 has the strategy natively (1D over every
    rank); FSDP2 replicates over every rank and shards over groups of one, ``(world, 1)``: NO_SHARD's meaning,
    not ZeRO-2.

    Args:
        backend: the backend that runs it.
        world_size: ranks in the job.

    Returns:
        The mesh shape.
    """
    return (world_size,) if backend is Backend.FSDP1 else (world_size, 1)


def _option_value(config: BridgeConfig, option: str) -> object:
    obj: object = config
    for part in option.split("."):
        obj = getattr(obj, part)
    return obj


def translate(
    config: BridgeConfig, backend: Backend | None = None, *, device_type: str | None = None
) -> TranslationReport:
    """What each option of ``config`` becomes on ``backend`` (default: the config's own).

    Args:
        config: the bridge config.
        backend: ``Backend.FSDP1`` or ``Backend.FSDP2``; default the config's own.
        device_type: ``"cuda"`` or ``"cpu"``; some options differ by device (offload on CPU).

    Returns:
        A :class:`TranslationReport`: one entry per option with its value, the torch call it
        becomes and its outcome (native, emulated, not needed, unsupported).
    """
    backend = backend or config.backend
    ctx = Context(config=config, device_type=device_type)
    entries: list[Entry] = []
    for option in CONFIG_OPTIONS:
        for rule in TABLE:
            if rule.option == option and rule.when is not None and rule.when(ctx):
                tr = rule.for_backend(backend)
                entries.append(Entry(option, rule.case, _option_value(config, option), tr.outcome, tr.text))
                break
    return TranslationReport(backend=backend, entries=tuple(entries))


def unsupported_problems(config: BridgeConfig, backend: Backend, *, device_type: str | None = None) -> list[Problem]:
    """One :class:`Problem` per option that ``backend`` cannot honour."""
    problems = []
    for entry in translate(config, backend, device_type=device_type).unsupported:
        supported = [
            r.case
            for r in TABLE
            if r.option == entry.option and r.when is not None and r.for_backend(backend).outcome is not U
        ]
        problems.append(
            Problem(
                entry.option,
                entry.value if isinstance(entry.value, int | float) else show_value(entry.value),  # 2, not '2'
                f"on {backend.value}: {', '.join(supported) or 'nothing'}",
                f"{backend.value} cannot do this: {entry.text}",
            )
        )
    return problems
