"""Lightning on FSDP2 through the bridge: :class:`FabricStrategy` (Fabric) and :class:`TrainerStrategy`
(PyTorch Lightning's Trainer) take what Lightning's FSDP1 strategies (``lightning.fabric.strategies.FSDPStrategy``,
``lightning.pytorch.strategies.FSDPStrategy``) take and mean the same, so code moves by changing the class alone.

For example::

    strategy = fsdp_bridge.lightning.FabricStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block},
                                                    state_dict_type="full", limit_all_gathers=True)
    fabric = L.Fabric(devices=8, strategy=strategy, precision="bf16-mixed")

    trainer = L.Trainer(devices=8, strategy=fsdp_bridge.lightning.TrainerStrategy(auto_wrap_policy={Block}),
                        precision="bf16-mixed")

Each is Lightning's own ``ModelParallelStrategy`` (FSDP2: Lightning's samplers, backward, gradient sync and
checkpoint saving) over one data-parallel dimension of every rank, whose model is sharded by
:func:`fsdp_bridge.shard`. FSDP1's arguments are read as :meth:`BridgeConfig.from_fsdp1` reads them, when the
strategy is made, so a wrong one raises :class:`ConfigError` before any process group exists.

Importing this module imports Lightning (``pip install lightning``); nothing else in the bridge does.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import FSDPPrecision, HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import FSDPPrecision as _TrainerFSDPPrecision
from lightning.pytorch.plugins.precision import HalfPrecision as _TrainerHalfPrecision
from lightning.pytorch.plugins.precision import MixedPrecision as _TrainerMixedPrecision
from lightning.pytorch.plugins.precision import Precision as _TrainerPrecision
from lightning.pytorch.strategies import ModelParallelStrategy as _TrainerModelParallel
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from fsdp_bridge.api import clip_grad_norm_, is_sharded, shard
from fsdp_bridge.config import BridgeConfig
from fsdp_bridge.errors import ConfigError, Problem

__all__ = ["FabricStrategy", "TrainerStrategy"]

_PRECISION_DTYPES = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16", "32-true": None}
"""Lightning's ``precision=`` and the dtype its FSDP1 strategy gave FSDP1's ``MixedPrecision`` for parameters,
gradient reduction and buffers alike (``FSDPPrecision.mixed_precision_config``)."""

_PRECISION_SPELLINGS = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true"}
"""Lightning's older ``precision=`` spellings (also as integers) and the names Fabric reads them as."""


class _FSDP1Arguments:
    """What both strategies make of Lightning's FSDP1 arguments: the bridge's config, whether a
    ``MixedPrecision`` was given (else the precision plugin's dtype is used), and what to recompute."""

    config: BridgeConfig
    _explicit_precision: bool
    _checkpointing: Any

    def _read_fsdp1(
        self,
        kwargs: dict[str, Any],
        cpu_offload: Any,
        mixed_precision: Any,
        auto_wrap_policy: Any,
        activation_checkpointing: Any,
        activation_checkpointing_policy: Any,
        sharding_strategy: Any,
        device_mesh: Any,
    ) -> None:
        fsdp1 = dict(kwargs)
        fsdp1["sharding_strategy"] = _sharding_strategy(sharding_strategy)
        if cpu_offload is not None:
            fsdp1["cpu_offload"] = _cpu_offload(cpu_offload)
        if isinstance(auto_wrap_policy, set):
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            auto_wrap_policy = ModuleWrapPolicy(auto_wrap_policy)
        if auto_wrap_policy is not None:
            fsdp1["auto_wrap_policy"] = auto_wrap_policy
        self._explicit_precision = mixed_precision is not None
        if mixed_precision is not None:
            fsdp1["mixed_precision"] = mixed_precision
        hybrid_shape = None
        if isinstance(device_mesh, tuple):
            hybrid_shape = device_mesh
        elif device_mesh is not None:
            fsdp1["device_mesh"] = device_mesh
        config = BridgeConfig.from_fsdp1(**fsdp1)
        if hybrid_shape is not None:
            if not config.strategy.is_hybrid:
                raise ConfigError(
                    [
                        Problem(
                            "device_mesh",
                            device_mesh,
                            "a (replicate, shard) pair only with a HYBRID_* sharding_strategy, not "
                            f"{sharding_strategy}",
                            'pass sharding_strategy="HYBRID_SHARD" with it, or drop device_mesh=',
                        )
                    ]
                )
            config = config.replace(hybrid_shape=hybrid_shape)
        self.config = config
        """The bridge's config the strategy shards with (the precision plugin's dtype is added when it shards)."""
        self._checkpointing = _checkpointed(activation_checkpointing, activation_checkpointing_policy, auto_wrap_policy)
        if self._checkpointing is True:
            self.config = self.config.replace(activation_checkpointing=True)

    def _shard(self, module: nn.Module, precision: str, device_mesh: DeviceMesh) -> nn.Module:
        """Shard ``module`` with the config, the plugin's ``precision`` name giving the dtypes of FSDP1's
        ``MixedPrecision`` where none was given, over ``device_mesh``'s data-parallel dimension."""
        config = self.config
        if not self._explicit_precision:
            dtype = _PRECISION_DTYPES[precision]
            if dtype is not None:
                config = config.replace(
                    mixed_precision={"param_dtype": dtype, "reduce_dtype": dtype, "buffer_dtype": dtype}
                )
        if callable(self._checkpointing):
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                apply_activation_checkpointing,
                checkpoint_wrapper,
            )

            apply_activation_checkpointing(module, checkpoint_wrapper_fn=checkpoint_wrapper, **self._checkpointing())
        # HYBRID_*: the bridge builds its (replicate, shard) mesh over the same ranks; otherwise the data-parallel
        # dimension Lightning made, which its samplers use
        return shard(module, config, mesh=None if config.strategy.is_hybrid else device_mesh["data_parallel"])


def _refuse_unsupported(state_dict_type: Any, checkpoint_io: Any) -> None:
    """Refuse a ``state_dict_type`` other than Lightning's two and a ``CheckpointIO`` plugin (FSDP2's
    strategies save through DCP), before any process group exists."""
    if state_dict_type not in ("full", "sharded"):
        raise ConfigError([Problem("state_dict_type", state_dict_type, "'full' or 'sharded'", "pass one of the two")])
    if checkpoint_io is not None:
        raise ConfigError(
            [
                Problem(
                    "checkpoint_io",
                    checkpoint_io,
                    "none: Lightning's FSDP2 strategies save through DCP, not a CheckpointIO plugin",
                    "drop checkpoint_io= (the checkpoint is written as state_dict_type says)",
                )
            ]
        )


class FabricStrategy(_FSDP1Arguments, ModelParallelStrategy):
    """Lightning Fabric's FSDP strategy on FSDP2, with the arguments of its FSDP1 one (``FSDPStrategy``).

    Args:
        accelerator, parallel_devices, cluster_environment, process_group_backend, timeout: as Lightning's
            strategies take them (Fabric sets the first three from its own arguments).
        precision: Lightning's ``FSDPPrecision`` or a precision name; default: the plugin Lightning's FSDP1
            strategy makes of ``Fabric(precision=...)`` (``"32-true"``, ``"16-true"``, ``"bf16-true"``,
            ``"bf16-mixed"``). ``"16-mixed"`` (fp16 autocast and FSDP1's ``ShardedGradScaler``) has to be given
            here too, ``FabricStrategy(precision="16-mixed")``: Fabric refuses it for an FSDP2 strategy that
            brings no plugin of its own.
        cpu_offload: ``True`` / ``False`` or FSDP1's ``CPUOffload``.
        mixed_precision: FSDP1's ``MixedPrecision``; default: what Lightning's FSDP1 strategy derives from
            ``Fabric(precision=...)`` (``"bf16-mixed"``: bf16 parameters, gradient reduction and buffers).
        auto_wrap_policy: a set of module classes (each instance a unit, as Lightning's ``ModuleWrapPolicy``)
            or any FSDP1 auto-wrap policy.
        activation_checkpointing: module classes to recompute in backward (Lightning's deprecated spelling).
        activation_checkpointing_policy: a set of module classes or an FSDP1 policy choosing what to recompute.
        sharding_strategy: FSDP1's ``ShardingStrategy`` member or its name (``"FULL_SHARD"``, ...).
        state_dict_type: ``"sharded"`` (default: ``fabric.save`` writes a DCP directory) or ``"full"`` (one file
            written by rank 0).
        device_mesh: a ``(replicate, shard)`` pair of sizes or a 2D ``DeviceMesh`` for HYBRID_* strategies.
        **kwargs: other FSDP1 constructor arguments (``backward_prefetch``, ``forward_prefetch``,
            ``limit_all_gathers``, ``sync_module_states``, ``use_orig_params``, ``ignored_modules``, ...), read
            as :meth:`BridgeConfig.from_fsdp1` reads them.

    Raises:
        ConfigError: an argument FSDP2 cannot honour (named with its value and the fix), before any collective.
    """

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[Any] | None = None,
        cluster_environment: Any = None,
        precision: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cpu_offload: Any = None,
        mixed_precision: Any = None,
        auto_wrap_policy: Any = None,
        activation_checkpointing: Any = None,
        activation_checkpointing_policy: Any = None,
        sharding_strategy: Any = "FULL_SHARD",
        state_dict_type: str = "sharded",
        device_mesh: Any = None,
        **kwargs: Any,
    ) -> None:
        _refuse_unsupported(state_dict_type, kwargs.pop("checkpoint_io", None))
        self._read_fsdp1(
            kwargs,
            cpu_offload,
            mixed_precision,
            auto_wrap_policy,
            activation_checkpointing,
            activation_checkpointing_policy,
            sharding_strategy,
            device_mesh,
        )
        super().__init__(
            parallelize_fn=self._parallelize,
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=state_dict_type == "sharded",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.accelerator = accelerator
        self.parallel_devices = parallel_devices
        self.cluster_environment = cluster_environment
        if precision is not None:
            self.precision = precision

    @property
    def precision(self) -> FSDPPrecision:
        """Lightning's FSDP1 precision plugin (``FSDPPrecision``): its forward autocast, input casts, gradient
        scaler and parameter dtypes, as Lightning's FSDP1 strategy has them."""
        return self._precision if isinstance(self._precision, FSDPPrecision) else FSDPPrecision("32-true")

    @precision.setter
    def precision(self, precision: Any) -> None:
        self._precision = None if precision is None else _fsdp_precision(precision)

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Unscale the gradients (``"16-mixed"``) and clip them as FSDP1's ``clip_grad_norm_`` does, as
        Lightning's FSDP1 strategy does.

        Args:
            module: the model Fabric set up (its sharded module).
            optimizer: its optimizer, whose gradients the fp16 scaler unscales first.
            max_norm: the largest total norm allowed.
            norm_type: the p of the p-norm.
            error_if_nonfinite: not read, as Lightning's FSDP1 strategy does not read it.

        Returns:
            The total norm before clipping, the same on every rank.
        """
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(module, float(max_norm), float(norm_type))

    def setup_environment(self) -> None:
        """Set up the process group and the device mesh: one data-parallel dimension over every rank (Lightning's
        own default would make a node's GPUs a tensor-parallel group, which FSDP1's strategy never did).

        Returns:
            None; Fabric calls it once per process when it launches.
        """
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def _parallelize(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return self._shard(module, self.precision.precision, device_mesh)


class TrainerStrategy(_FSDP1Arguments, _TrainerModelParallel):
    """PyTorch Lightning's Trainer strategy on FSDP2, with the arguments of its FSDP1 one
    (``lightning.pytorch.strategies.FSDPStrategy``): ``Trainer(strategy=TrainerStrategy(...))``.

    The LightningModule is sharded as Lightning's FSDP1 strategy wrapped it: the whole module, whose
    ``auto_wrap_policy`` units and root :func:`fsdp_bridge.shard` makes FSDP2 units, when the Trainer sets up
    (no ``configure_model`` sharding of its own is needed, and one that builds layers still runs first). Its
    ``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step`` run inside the module's own
    forward call, as Lightning runs them inside FSDP1's wrapper, so the root's parameters are gathered for them.

    Args:
        accelerator, parallel_devices, cluster_environment, process_group_backend, timeout: as Lightning's
            strategies take them (the Trainer sets the first three from its own arguments).
        checkpoint_io: refused: checkpoints are written through DCP, as ``state_dict_type`` says.
        precision_plugin: Lightning's ``FSDPPrecision`` or a precision name; default: the plugin Lightning's FSDP1
            strategy makes of ``Trainer(precision=...)``. ``"16-mixed"`` (fp16 autocast and FSDP1's
            ``ShardedGradScaler``) is given here alone, ``TrainerStrategy(precision_plugin="16-mixed")`` with no
            ``Trainer(precision=...)``: the Trainer refuses it for an FSDP2 strategy.
        cpu_offload, mixed_precision, auto_wrap_policy, activation_checkpointing, activation_checkpointing_policy,
            sharding_strategy, device_mesh, **kwargs: as :class:`FabricStrategy` reads them.
        state_dict_type: ``"full"`` (default, as Lightning's FSDP1 strategy: one checkpoint file written by rank
            0, the same keys as FSDP1's) or ``"sharded"`` (a DCP directory).

    Raises:
        ConfigError: an argument FSDP2 cannot honour (named with its value and the fix), before any collective.
    """

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[Any] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cpu_offload: Any = None,
        mixed_precision: Any = None,
        auto_wrap_policy: Any = None,
        activation_checkpointing: Any = None,
        activation_checkpointing_policy: Any = None,
        sharding_strategy: Any = "FULL_SHARD",
        state_dict_type: str = "full",
        device_mesh: Any = None,
        **kwargs: Any,
    ) -> None:
        _refuse_unsupported(state_dict_type, checkpoint_io)
        self._read_fsdp1(
            kwargs,
            cpu_offload,
            mixed_precision,
            auto_wrap_policy,
            activation_checkpointing,
            activation_checkpointing_policy,
            sharding_strategy,
            device_mesh,
        )
        self._own_precision = None if precision_plugin is None else _trainer_precision(precision_plugin)
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=state_dict_type == "sharded",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.accelerator = accelerator
        self.parallel_devices = parallel_devices
        self.cluster_environment = cluster_environment

    @property  # type: ignore[override]
    def precision_plugin(self) -> _TrainerFSDPPrecision:
        """Lightning's FSDP1 precision plugin for the Trainer (``FSDPPrecision``): its autocast, input casts,
        gradient scaler and parameter dtypes, as Lightning's FSDP1 strategy has them (and its refusal of
        ``gradient_clip_algorithm="norm"``, which Lightning's FSDP1 strategy cannot clip either)."""
        if self._own_precision is not None:
            return self._own_precision
        plugin = getattr(self, "_trainer_precision", None)
        return plugin if plugin is not None else _TrainerFSDPPrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, precision: Any) -> None:
        plugin = None if precision is None else _trainer_precision(precision)
        own = getattr(self, "_own_precision", None)
        if own is not None and plugin is not None and plugin.precision not in ("32-true", own.precision):
            raise ConfigError(
                [
                    Problem(
                        "precision",
                        plugin.precision,
                        f"the strategy's own precision_plugin ({own.precision!r}) or none on the Trainer",
                        "drop Trainer(precision=...) and keep the strategy's precision_plugin=",
                    )
                ]
            )
        self._trainer_precision = plugin

    def setup_environment(self) -> None:
        """Set up the process group and the device mesh: one data-parallel dimension over every rank.

        Returns:
            None; the Trainer calls it once per process.
        """
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        """Shard the LightningModule (after its ``configure_model``), then set up its optimizers and precision as
        Lightning's FSDP2 strategy does.

        Args:
            trainer: the Trainer setting up.

        Returns:
            None; ``self.model`` is the sharded LightningModule.

        Raises:
            TypeError: a module of the LightningModule is FSDP1's wrapper already.
        """
        from torch.distributed.fsdp import FullyShardedDataParallel

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise TypeError(
                "TrainerStrategy shards the LightningModule with FSDP2, but a module of it is FSDP1's "
                "FullyShardedDataParallel already: build the model unwrapped (the strategy's auto_wrap_policy "
                "chooses the units)"
            )
        if not is_sharded(self.model):  # set up again (validate, test or predict after fit): sharded already
            self.model = self._shard(self.model, self.precision_plugin.precision, self.device_mesh)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``training_step`` inside its own forward call, where FSDP2's root gathers its
        parameters (as Lightning runs it inside FSDP1's wrapper).

        Args:
            *args: what the Trainer passes to the LightningModule's ``training_step`` (the batch, its index).
            **kwargs: likewise.

        Returns:
            What the LightningModule's ``training_step`` returns.
        """
        with self.precision_plugin.train_step_context():
            return self._through_forward("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``validation_step`` inside its own forward call, where FSDP2's root gathers its
        parameters (as Lightning runs it inside FSDP1's wrapper).

        Args:
            *args: what the Trainer passes to the LightningModule's ``validation_step`` (the batch, its index).
            **kwargs: likewise.

        Returns:
            What the LightningModule's ``validation_step`` returns.
        """
        with self.precision_plugin.val_step_context():
            return self._through_forward("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``test_step`` inside its own forward call, where FSDP2's root gathers its
        parameters (as Lightning runs it inside FSDP1's wrapper).

        Args:
            *args: what the Trainer passes to the LightningModule's ``test_step`` (the batch, its index).
            **kwargs: likewise.

        Returns:
            What the LightningModule's ``test_step`` returns.
        """
        with self.precision_plugin.test_step_context():
            return self._through_forward("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``predict_step`` inside its own forward call, where FSDP2's root gathers its
        parameters (as Lightning runs it inside FSDP1's wrapper).

        Args:
            *args: what the Trainer passes to the LightningModule's ``predict_step`` (the batch, its index).
            **kwargs: likewise.

        Returns:
            What the LightningModule's ``predict_step`` returns.
        """
        with self.precision_plugin.predict_step_context():
            return self._through_forward("predict_step", *args, **kwargs)

    def _through_forward(self, method: str, *args: Any, **kwargs: Any) -> Any:
        assert self.model is not None and self.lightning_module is not None
        return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)


def _trainer_precision(value: Any) -> _TrainerFSDPPrecision:
    """Lightning's FSDP1 precision plugin for the Trainer, for a name or the plugin the Trainer made of one."""
    if isinstance(value, _TrainerFSDPPrecision):
        return value
    if type(value) in (_TrainerPrecision, _TrainerHalfPrecision, _TrainerMixedPrecision):
        value = value.precision
    return _TrainerFSDPPrecision(
        _precision_name(value, "Trainer(precision=...)", "TrainerStrategy(precision_plugin=...)")
    )


def _fsdp_precision(value: Any) -> FSDPPrecision:
    """Lightning's FSDP1 precision plugin for a precision name or for the plugin Fabric made of one."""
    if isinstance(value, FSDPPrecision):
        return value
    if type(value) in (Precision, HalfPrecision, MixedPrecision):
        value = value.precision  # the plugin Fabric makes of a name for other strategies: the name
    return FSDPPrecision(_precision_name(value, "Fabric(precision=...)", "FabricStrategy(precision=...)"))


def _precision_name(value: Any, outer: str, own: str) -> Any:
    """Lightning's name for a precision given as a name (any of its spellings), refused when not one of those
    its FSDP1 strategies take."""
    name = _PRECISION_SPELLINGS.get(str(value), str(value)) if isinstance(value, (str, int)) else None
    if name not in _PRECISION_DTYPES:
        raise ConfigError(
            [
                Problem(
                    "precision",
                    value,
                    "32-true, 16-true, bf16-true, 16-mixed, bf16-mixed (or Lightning's FSDPPrecision)",
                    f"pass one of those names as {outer} (and as {own} for '16-mixed')",
                )
            ]
        )
    return name


def _sharding_strategy(value: Any) -> Any:
    """FSDP1's ShardingStrategy member for a Lightning spelling (a member or its name, any case)."""
    if not isinstance(value, str):
        return value
    from torch.distributed.fsdp import ShardingStrategy

    try:
        return ShardingStrategy[value.upper()]
    except KeyError:
        raise ConfigError(
            [
                Problem(
                    "sharding_strategy",
                    value,
                    ", ".join(s.name for s in ShardingStrategy),
                    "pass one of those names (any case) or a ShardingStrategy member",
                )
            ]
        ) from None


def _cpu_offload(value: Any) -> Any:
    """FSDP1's CPUOffload for Lightning's ``cpu_offload=`` (a bool or a CPUOffload)."""
    from torch.distributed.fsdp import CPUOffload

    return value if isinstance(value, CPUOffload) else CPUOffload(offload_params=bool(value))


def _checkpointed(classes: Any, policy: Any, wrap_policy: Any) -> Any:
    """What to recompute in backward: False (nothing), True (the bridge's wrap units: the classes asked for are
    the wrap policy's), or a function giving ``apply_activation_checkpointing``'s keyword arguments."""
    if classes is None and policy is None:
        return False
    if classes is not None and policy is not None:
        raise ConfigError(
            [
                Problem(
                    "activation_checkpointing",
                    classes,
                    "activation_checkpointing or activation_checkpointing_policy, not both",
                    "drop activation_checkpointing= and keep activation_checkpointing_policy=",
                )
            ]
        )
    if classes is not None:
        wanted = set(classes) if isinstance(classes, (list, tuple, set)) else {classes}
        if wanted == set(getattr(wrap_policy, "_module_classes", ()) or ()):
            return True
        found = tuple(wanted)
        return lambda: {"check_fn": lambda m: isinstance(m, found)}
    if isinstance(policy, set):
        if policy == set(getattr(wrap_policy, "_module_classes", ()) or ()):
            return True
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        chosen = ModuleWrapPolicy(policy)
        return lambda: {"auto_wrap_policy": chosen}
    return lambda: {"auto_wrap_policy": policy}
