"""Manual wrapping: FSDP1's ``enable_wrap`` / ``wrap`` on either backend.

FSDP1 code that chooses its units by hand shards each module where the model is built::

    with enable_wrap(wrapper_cls=FSDP, **fsdp_kwargs):
        self.encoder = wrap(self.encoder)

The bridge keeps that shape (``migrate code --fix`` writes it)::

    with fsdp_bridge.enable_wrap(fsdp_bridge.BridgeConfig.from_fsdp1(**fsdp_kwargs)):
        self.encoder = fsdp_bridge.wrap_module(self.encoder)

Each module passed to :func:`wrap_module` inside the context is sharded there and then, as a
unit of its own, with the context's config (FSDP2: ``fully_shard`` on it; FSDP1: its own
``FullyShardedDataParallel``).  A later :func:`fsdp_bridge.shard` of the whole model keeps those
units and shards the rest around them, as FSDP1 does with a root wrapper over wrapped children.

torch's own ``wrap(module)`` inside the context shards the same way (code that was not migrated, a
library's model code), so no module is left unsharded by mistake.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from contextvars import ContextVar, Token
from types import TracebackType

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_bridge.api import Bridge, get_bridge, shard_module
from fsdp_bridge.config import BridgeConfig
from fsdp_bridge.distributed import carried_mesh
from fsdp_bridge.errors import ConfigError, Problem

__all__ = ["ManualWrap", "enable_wrap", "wrap_module"]

_ACTIVE: ContextVar[ManualWrap | None] = ContextVar("fsdp_bridge_manual_wrap", default=None)


class ManualWrap:
    """The context made by :func:`enable_wrap`; its :meth:`wrap` shards one module as a unit."""

    def __init__(self, config: BridgeConfig, *, mesh: DeviceMesh | None = None) -> None:
        if not isinstance(config, BridgeConfig):
            raise TypeError(
                f"config must be a BridgeConfig (got {type(config).__name__}); for FSDP1 keyword arguments use "
                "fsdp_bridge.enable_wrap(fsdp_bridge.BridgeConfig.from_fsdp1(**fsdp_kwargs))"
            )
        self.config = config
        self.mesh = mesh
        """The mesh every unit is sharded over: the one given, else the one the first unit built."""
        self._token: Token[ManualWrap | None] | None = None
        self._torch_context: AbstractContextManager[None] | None = None

    def wrap(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` now as a unit of its own with this context's config; return the module
        to use in its place (FSDP2: ``module`` itself; FSDP1: its wrapper).

        A module this context (or another) sharded already is returned as it is, so FSDP1's
        ``wrap(wrap(m))`` means ``wrap(m)``; from then on the unit frees its gathered parameters after
        forward even when it runs as a root, as FSDP1's inner wrapper did (FSDP2; on FSDP1 a unit
        with no root over it stays a root, which keeps them for backward).  A unit wrapped once
        reshards as FSDP1 decides it: after forward under a root, not as one.

        Args:
            module: the module to shard (every rank, in the same order: sharding is collective).

        Returns:
            The module to use in its place.

        Raises:
            TypeError: ``module`` is not an ``nn.Module``.
            ConfigError: on every rank, as :func:`fsdp_bridge.shard` raises it.
        """
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"wrap_module takes an nn.Module (got {type(module).__name__}); pass the module to shard "
                "(FSDP1 code that wraps an optional module: `wrap(m) if m is not None else None`)"
            )
        bridge = getattr(module, "_fsdp_bridge", None)
        if isinstance(bridge, Bridge):
            config = bridge.config
            if config.strategy.reshards_after_forward and config.reshard_after_forward is None:
                bridge.impl.reshard_as_inner_unit(module)
            return module
        sharded = shard_module(module, self.config, self.mesh, as_unit=True)
        if self.mesh is None:
            self.mesh = get_bridge(sharded).mesh
        return sharded

    def _torch_wrap(self, module: nn.Module, **overrides: object) -> nn.Module:
        """torch's ``wrap(module)`` inside this context (e.g. in a library's model code) shards with it too."""
        if overrides:
            raise ConfigError(
                [
                    Problem(
                        "wrap",
                        f"torch's wrap(module, {', '.join(f'{k}=...' for k in sorted(overrides))})",
                        "wrap(module) without per-module overrides inside fsdp_bridge.enable_wrap",
                        "shard that module with its own config: fsdp_bridge.ManualWrap(fsdp_bridge.BridgeConfig."
                        "from_fsdp1(**{**<enable_wrap's arguments>, **overrides})).wrap(module)",
                    )
                ]
            )
        return self.wrap(module)

    def __enter__(self) -> ManualWrap:
        if _ACTIVE.get() is not None or _in_torch_enable_wrap():
            raise ConfigError(
                [
                    Problem(
                        "enable_wrap",
                        "a second enable_wrap inside another",
                        "one enable_wrap context at a time",
                        "FSDP1 refuses nested contexts too (NotImplementedError), torch's enable_wrap included: "
                        "close the first one, or call ManualWrap(config).wrap(module) with the other config",
                    )
                ]
            )
        from torch.distributed.fsdp.wrap import enable_wrap as torch_enable_wrap

        # torch's own wrap() calls (code not migrated, a library's models) shard through this context
        # too, instead of silently returning their module unsharded.
        self._torch_context = torch_enable_wrap(wrapper_cls=self._torch_wrap)
        self._torch_context.__enter__()
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None
        if self._torch_context is not None:
            self._torch_context.__exit__(exc_type, exc, tb)
            self._torch_context = None


def enable_wrap(config: BridgeConfig, *, mesh: DeviceMesh | None = None) -> ManualWrap:
    """A context inside which :func:`wrap_module` shards modules with ``config`` (FSDP1's ``enable_wrap``).

    Args:
        config: how each unit is sharded; FSDP1's ``enable_wrap`` keyword arguments (without
            ``wrapper_cls``) through ``BridgeConfig.from_fsdp1(**kwargs)``, which refuses what has no
            meaning on the backend with the same errors as ``shard``.
        mesh: the DeviceMesh to shard over (FSDP1's ``device_mesh``); default: the one given to
            ``BridgeConfig.from_fsdp1`` (``device_mesh`` or ``process_group``), else built once, by the
            first unit, from the strategy and the world size.

    Returns:
        A :class:`ManualWrap`; ``with fsdp_bridge.enable_wrap(config) as w:`` also gives ``w.wrap(module)``.

    Raises:
        TypeError: ``config`` is not a :class:`BridgeConfig`.
        ConfigError: when entered inside another ``enable_wrap`` context.
    """
    return ManualWrap(config, mesh=carried_mesh(config, mesh))


def wrap_module(module: nn.Module) -> nn.Module:
    """Inside :func:`enable_wrap`, shard ``module`` as a unit of its own and return it; outside,
    return ``module`` unchanged (FSDP1's ``wrap``, so a model builds with or without sharding).

    Call it on every rank, in the same order (sharding is collective).  Build the optimizer after
    the last unit (and the root, if any) is sharded.

    Args:
        module: the module to shard.

    Returns:
        The module to use in its place (FSDP2: ``module`` itself; FSDP1: its wrapper), or ``module``
        outside the context.  A module sharded already is returned as it is (``wrap(wrap(m))``).

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` (inside the context).
        ConfigError: on every rank, as :func:`fsdp_bridge.shard` raises it.
    """
    active = _ACTIVE.get()
    if active is None and _in_torch_enable_wrap():
        raise ConfigError(
            [
                Problem(
                    "wrap_module",
                    "called inside torch's enable_wrap",
                    "fsdp_bridge.wrap_module inside fsdp_bridge.enable_wrap (or torch's wrap inside torch's)",
                    "replace torch.distributed.fsdp.wrap.enable_wrap(wrapper_cls=FSDP, **kwargs) with "
                    "fsdp_bridge.enable_wrap(fsdp_bridge.BridgeConfig.from_fsdp1(**kwargs)) (`fsdp-bridge migrate "
                    "code --fix` does); outside any context wrap_module would leave the module unsharded",
                )
            ]
        )
    return module if active is None else active.wrap(module)


def _in_torch_enable_wrap() -> bool:
    # torch keeps enable_wrap's state on a private class (torch.distributed.fsdp.wrap._ConfigAutoWrap,
    # torch 1.12-2.14); if it moves, this check only stops catching the mixed-up case.
    from torch.distributed.fsdp import wrap as torch_wrap

    state = getattr(torch_wrap, "_ConfigAutoWrap", None)
    return bool(getattr(state, "in_autowrap_context", False))
