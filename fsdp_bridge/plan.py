"""The decision layer: a config, the table and the device resolved into what a backend executes.

:func:`resolve_plan` is the only place that decides what an option does on a backend and
device.  It reads each decision from the rule the table (:mod:`fsdp_bridge.mapping`) matched
for that option, so the report a user sees (``explain``, the log of :func:`~fsdp_bridge.shard`)
and the behaviour come from the same row: where the table says "not needed" for CPU offload on
a CPU run, the plan offloads nothing; where it says FSDP1's own ``sync_module_states`` is used,
the plan asks the backend for it, and where it says "emulated", the bridge broadcasts.

Backends receive a :class:`ShardPlan` and carry it out; they never read the config or the
device type to decide anything again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_bridge.config import BridgeConfig
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.mapping import Outcome, TranslationReport, api_translation
from fsdp_bridge.strategy import Backend, BackwardPrefetch, ShardingStrategy

__all__ = ["PrecisionPlan", "ShardPlan", "SyncMethod", "reshard_after_forward", "resolve_plan"]


def reshard_after_forward(
    strategy: ShardingStrategy,
    override: bool | int | None,
    *,
    is_root: bool,
    shard_size: int | None = None,
    root_is_unit: bool = False,
) -> bool | int | None:
    """Whether a unit frees its gathered parameters after forward, matching FSDP1: the root keeps
    them for the backward that immediately follows, unless ``override`` (the config's
    ``reshard_after_forward``) says otherwise.

    A shard group of one rank (NO_SHARD's (world, 1) mesh, any strategy at world size 1, HYBRID
    with one rank per shard group): True on every unit unless the user set ``override`` (NO_SHARD:
    whatever is asked). Nothing is sharded, so resharding communicates nothing; it frees the
    working copy FSDP2 makes of a unit's parameters even on a shard group of one
    (``FSDPParamGroup.wait_for_unshard`` copies them into separate all-gather outputs), so the copy
    of the unit in use is alive instead of the whole model's. FSDP1 keeps a one-rank flat
    parameter as it is (it runs NO_SHARD there) and does not read this.

    ``root_is_unit`` (a unit sharded on its own by manual wrapping, asked about as a root): ``None``
    for a strategy that reshards, i.e. decided when it first runs, True under a root and False as
    one, as FSDP1 decides it (FSDP2's own ``None``)."""
    if strategy is ShardingStrategy.NO_SHARD:
        return True
    if override is not None:
        return override
    if shard_size == 1:
        return True
    if is_root and root_is_unit:
        return None if strategy.reshards_after_forward else False
    return strategy.reshards_after_forward and not is_root


class SyncMethod(enum.Enum):
    """How every rank gets rank 0's initial weights (``sync_module_states``)."""

    NONE = "none"
    """Each rank keeps the weights it built."""
    BACKEND = "backend"
    """The backend's own mechanism (FSDP1's ``sync_module_states=True`` on an accelerator)."""
    BROADCAST = "broadcast"
    """After sharding, rank 0's full state dict is broadcast into the shards
    (``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``) and every buffer
    from rank 0: FSDP2, and FSDP1 on CPU, whose own sync refuses CPU tensors."""


@dataclass(frozen=True)
class PrecisionPlan:
    """Dtypes the backend applies (``None``: keep the original dtype)."""

    param_dtype: torch.dtype | None = None
    """Compute dtype of gathered parameters, on every unit and the root."""
    reduce_dtype: torch.dtype | None = None
    """Dtype of gradient reduction."""
    root_output_dtype: torch.dtype | None = None
    """The root's floating-point outputs are cast to it (only the root: inner units would hand the
    root's own layers inputs in another dtype)."""
    buffer_dtype: torch.dtype | None = None
    """Floating-point buffers in this dtype (FSDP1 casts them in forward; FSDP2 once, at sharding)."""
    cast_forward_inputs: bool = True
    """Each unit casts its floating-point inputs to ``param_dtype``."""
    cast_root_forward_inputs: bool = True
    """The root casts its floating-point inputs to ``param_dtype`` (it also does with
    ``cast_forward_inputs``, as in FSDP1)."""

    @property
    def enabled(self) -> bool:
        return any(
            d is not None for d in (self.param_dtype, self.reduce_dtype, self.root_output_dtype, self.buffer_dtype)
        )


@dataclass
class ShardPlan:
    """Everything resolved and validated before the backend touches the model."""

    backend: Backend
    strategy: ShardingStrategy
    device: torch.device
    mesh: DeviceMesh
    units: list[nn.Module]
    """Modules to shard as their own unit, children before parents; root excluded."""
    ignored_modules: list[nn.Module]
    has_meta: bool
    """Some parameters or buffers are on the meta device (built without memory)."""
    report: TranslationReport
    """What every option became: the rows each decision below was read from."""
    precision: PrecisionPlan = field(default_factory=PrecisionPlan)
    offload_params: bool = False
    """Keep sharded parameters (and their gradients and optimizer step) in host memory."""
    sync: SyncMethod = SyncMethod.NONE
    backward_prefetch: BackwardPrefetch = BackwardPrefetch.PRE
    """FSDP1's backward prefetch (FSDP2 prefetches one unit implicitly, the ``pre`` timing)."""
    backward_prefetch_units: int = 0
    """Explicit backward prefetch depth: each unit not nested in another prefetches the N units registered
    before it (FSDP2's ``set_modules_to_backward_prefetch``); 0: the backend's own rule."""
    forward_prefetch: int = 0
    """Units ahead whose all-gather each unit not nested in another issues in forward, in registration
    order (0: none; FSDP1's ``forward_prefetch=True`` is 1, its only depth)."""
    limit_all_gathers: bool = True
    """FSDP1's rate limiter (FSDP2 needs none)."""
    reshard_override: bool | int | None = None
    """``reshard_after_forward`` given by the user; ``None``: from the strategy, per unit."""
    shard_size: int | None = None
    """Ranks in a shard group (the mesh's last dimension); ``None``: not known (tests)."""
    scalar_params: list[nn.Parameter] = field(default_factory=list)
    """0-dim parameters (e.g. CLIP's ``logit_scale``): neither backend shards them, so they stay
    whole on every rank and their gradients are averaged by the bridge."""
    ignored_parameters: list[nn.Parameter] = field(default_factory=list)
    """Parameters named in ``ignored_modules`` by path (FSDP1's ``ignored_states`` of parameters):
    not sharded, gradients not reduced, as the parameters of ignored modules."""
    root_is_unit: bool = False
    """The module sharded may be a unit of a larger model (:func:`fsdp_bridge.wrap_module`, FSDP1's
    manual ``wrap``): whether it reshards after forward is decided when it runs, as FSDP1 decides it."""
    float8: str | None = None
    """torchao float8 recipe for the linear layers inside the units (None: off; only where the table's
    float8 row is native: FSDP2 on a GPU)."""
    compile_options: dict[str, Any] | None = None
    """``torch.compile`` keyword arguments for each unit, compiled before sharding (None: no compilation)."""
    full_precision_units: list[nn.Module] = field(default_factory=list)
    """Units (also in ``units``) of ``mixed_precision.full_precision_modules``' classes: sharded without mixed
    precision, their floating-point inputs cast to float32 and outputs back (FSDP1's
    ``_module_classes_to_ignore``)."""
    materialize: bool = True
    """Allocate a meta-device model on ``device`` after sharding.  False only for planning at a
    fake world size (:func:`fsdp_bridge.estimate.plan_at_scale`, FSDP2): the shards stay on meta."""

    def reshard_after_forward(self, *, is_root: bool) -> bool | int | None:
        """Per-unit reshard-after-forward (:func:`reshard_after_forward`).

        Args:
            is_root: the unit is the root module, which keeps its gathered parameters for the
                backward that follows unless the config says otherwise (FSDP1's rule).

        Returns:
            Whether the unit frees its gathered parameters after forward: a bool, the config's
            ``reshard_after_forward`` override as given (FSDP2 takes an int too), or None where it
            is decided when the unit first runs (a manually wrapped unit asked about as a root).
        """
        return reshard_after_forward(
            self.strategy,
            self.reshard_override,
            is_root=is_root,
            shard_size=self.shard_size,
            root_is_unit=self.root_is_unit,
        )

    def defers_all_reduce(self) -> bool:
        """What :func:`fsdp_bridge.defer_all_reduce` does on this plan, from the table's ``defer_all_reduce`` row.

        Returns:
            True where the backend defers the all-reduce across replicas (a 2D mesh with more than one
            replica); False where there is nothing to defer (a 1D mesh, or one replica).

        Raises:
            ConfigError: the backend cannot defer only the all-reduce (FSDP1), with the reason and the fix.
        """
        row = api_translation("defer_all_reduce", self.backend)
        if row.outcome is Outcome.UNSUPPORTED:
            raise ConfigError(
                [Problem("defer_all_reduce", self.backend.value, "a model sharded with backend: fsdp2", row.text)]
            )
        return self.mesh.ndim == 2 and self.mesh.size(0) > 1

    @property
    def ignored_params(self) -> set[nn.Parameter]:
        owned = {p for m in self.ignored_modules for p in m.parameters()}
        return owned | set(self.scalar_params) | set(self.ignored_parameters)

    @property
    def ignored_states(self) -> list[nn.Module | nn.Parameter] | None:
        """FSDP1's ``ignored_states`` when single parameters are ignored (it takes them only there,
        not beside ``ignored_modules``); None otherwise."""
        if not (self.scalar_params or self.ignored_parameters):
            return None
        return [*self.ignored_modules, *self.scalar_params, *self.ignored_parameters]


def resolve_plan(
    config: BridgeConfig,
    report: TranslationReport,
    *,
    device: torch.device,
    mesh: DeviceMesh,
    units: list[nn.Module],
    ignored_modules: list[nn.Module],
    has_meta: bool,
    scalar_params: list[nn.Parameter] | None = None,
    ignored_parameters: list[nn.Parameter] | None = None,
    materialize: bool = True,
    shard_size: int | None = None,
) -> ShardPlan:
    """The plan for ``config`` on ``report.backend`` and ``device``, read from the table's rows.

    Args:
        config: the validated config.
        report: ``translate(config, device_type=device.type)``: one matched row per option.
        device: the resolved device of this rank.
        mesh: the data-parallel mesh, already built.
        units: wrap units, children before parents (root excluded).
        ignored_modules: modules not sharded, whose gradients are not reduced.
        has_meta: some tensors are on the meta device.
        scalar_params: 0-dim parameters kept whole on every rank.
        ignored_parameters: parameters named in ``ignored_modules`` by path.
        materialize: allocate meta tensors after sharding (False only for fake-world planning).
        shard_size: ranks in a shard group (one: every unit reshards after forward by default).

    Returns:
        The :class:`ShardPlan` the backend executes.
    """
    mp = config.mixed_precision
    offload = report.outcome("cpu_offload")
    sync = report.outcome("sync_module_states")
    backward = config.backward_prefetch
    return ShardPlan(
        backend=report.backend,
        strategy=config.strategy,
        device=device,
        mesh=mesh,
        units=units,
        ignored_modules=ignored_modules,
        has_meta=has_meta,
        report=report,
        precision=PrecisionPlan(
            param_dtype=mp.param_dtype,
            reduce_dtype=mp.reduce_dtype,
            root_output_dtype=mp.output_dtype,
            buffer_dtype=mp.buffer_dtype,
            cast_forward_inputs=mp.cast_forward_inputs,
            cast_root_forward_inputs=mp.cast_root_forward_inputs,
        ),
        # The table says "not needed" for offload on a CPU run: nothing is offloaded then.
        offload_params=config.cpu_offload and offload is Outcome.NATIVE,
        # NATIVE: the backend's own sync (FSDP1 on an accelerator); EMULATED: the bridge broadcasts.
        sync=(
            SyncMethod.NONE
            if not config.sync_module_states
            else SyncMethod.BACKEND
            if sync is Outcome.NATIVE
            else SyncMethod.BROADCAST
        ),
        # An integer is a depth (the table allows it on FSDP2 only): explicit prefetch of that many units.
        backward_prefetch=backward if isinstance(backward, BackwardPrefetch) else BackwardPrefetch.PRE,
        backward_prefetch_units=0 if isinstance(backward, BackwardPrefetch) else backward,
        forward_prefetch=int(config.forward_prefetch),  # true: one unit ahead
        limit_all_gathers=config.limit_all_gathers,
        reshard_override=config.reshard_after_forward,
        compile_options=config.compile.options() if config.compile.enabled else None,
        float8=config.float8 if report.outcome("float8") is Outcome.NATIVE else None,
        scalar_params=list(scalar_params or []),
        ignored_parameters=list(ignored_parameters or []),
        materialize=materialize,
        shard_size=shard_size,
    )
