"""Per-rank memory of a sharded training step, from the model's shapes alone.

The arithmetic follows what each backend allocates (checked against real runs in
``tests/test_estimate_validation.py``):

* **sharded state**: every wrap unit's parameters are split over the shard group of
  ``S`` ranks.  FSDP2 shards each parameter on dim 0 and pads it to ``ceil(d0/S)``
  rows; FSDP1 flattens a unit (each parameter aligned to 16 bytes) and pads the flat
  parameter to a multiple of ``S``.  Gradients are sharded like the parameters;
  the optimizer keeps its states (AdamW: two) per local parameter, in its dtype.
* **unsharded (transient)**: during forward/backward a unit is all-gathered in the
  compute dtype.  With resharding (FULL_SHARD, HYBRID_SHARD) the root unit stays
  gathered between forward and backward, plus the current and the prefetched unit;
  without it (SHARD_GRAD_OP, *_ZERO2, NO_SHARD on FSDP2) every unit stays gathered
  until backward ends.  The largest unit's unsharded gradient and its
  reduce-scatter input come on top.
* **activations**: measured by running one forward and backward of the model on
  the meta device (no memory is used) with the batch and sequence length given,
  in the compute dtype, with activation checkpointing when asked.
* **peak**: parameters and optimizer state plus the larger of forward/backward
  (activations + unsharded) and the optimizer step (all sharded gradients).  Gradients
  are set to None by ``zero_grad()`` before each step, and they grow in backward as
  activations are freed, so the two phases do not add up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from fsdp_bridge.backends import BackendImpl, get_backend
from fsdp_bridge.config import BridgeConfig
from fsdp_bridge.distributed import plan_mesh
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.estimate.tracker import LiveBytes
from fsdp_bridge.plan import reshard_after_forward
from fsdp_bridge.strategy import ShardingStrategy
from fsdp_bridge.wrap import resolve_wrap

__all__ = ["OPTIMIZERS", "RankMemory", "Unit", "estimate_memory", "measure_activations", "model_units"]

OPTIMIZERS: dict[str, tuple[int, bool]] = {
    # name: (states per parameter element, a scalar ``step`` tensor per parameter)
    "adamw": (2, True),
    "adam": (2, True),
    "sgd": (1, False),  # with momentum (a momentum buffer)
    "sgd-nomomentum": (0, False),
    "adagrad": (1, True),
    "rmsprop": (1, True),
    "none": (0, False),
}
"""The optimizers the estimator knows: name -> (states kept per parameter element, whether each
parameter also has a scalar ``step`` tensor)."""
_STEP_BYTES = 4  # torch keeps ``step`` as a float32 scalar tensor


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: the parameters it owns (not those of units nested in it)."""

    name: str
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def model_units(model: nn.Module, config: BridgeConfig) -> list[Unit]:
    """The units ``shard(model, config)`` would create (root last), with their parameter shapes.

    Args:
        model: the model (any device; meta is best).
        config: its wrap policy decides the units.

    Returns:
        One :class:`Unit` per unit, each parameter counted in its innermost unit.
    """
    plan = resolve_wrap(model, config.wrap)
    owner: dict[int, str] = {}
    order: list[nn.Parameter] = []
    for name, module in plan.units:  # children before parents: a parameter goes to its innermost unit
        for p in module.parameters():
            if id(p) not in owner:
                owner[id(p)] = name
                order.append(p)
    for p in model.parameters():
        if id(p) not in owner:
            owner[id(p)] = ""
            order.append(p)
    shapes: dict[str, list[tuple[int, ...]]] = {name: [] for name, _ in plan.units}
    shapes[""] = []
    for p in order:
        shapes[owner[id(p)]].append(tuple(p.shape))
    return [Unit(name or "(root)", tuple(s)) for name, s in shapes.items()]


def _shard_numel(unit: Unit, impl: BackendImpl, shard: int, cbytes: int) -> int:
    """Elements of ``unit`` one rank holds (the largest rank, padding included)."""
    return impl.shard_numel(unit.shapes, shard, cbytes)


def _padded_full_numel(unit: Unit, impl: BackendImpl, shard: int, cbytes: int) -> int:
    return _shard_numel(unit, impl, shard, cbytes) * shard


@dataclass(frozen=True)
class RankMemory:
    """Estimated bytes on one rank (the fullest one) for one backend and strategy."""

    backend: str
    strategy: str
    mesh: tuple[int, ...]
    shard_size: int
    params: int
    grads: int
    optimizer: int
    unsharded: int
    """Transient all-gathered parameters plus the largest unit's unsharded gradients."""
    activations: int | None
    """None when no batch/sequence length was given."""
    host: int
    """Bytes kept in host memory (CPU offload), not on the device."""
    largest_unit: str
    largest_unit_bytes: int
    device_memory: int | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def sharded_state(self) -> int:
        """Parameters + gradients + optimizer state held by this rank."""
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        """Device bytes at the fullest moment: parameters and optimizer state, plus either
        forward/backward (activations and gathered units; this step's gradients are
        created as activations are freed) or the optimizer step (all gradients)."""
        return self.params + self.optimizer + max(self.unsharded + (self.activations or 0), self.grads)

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.peak <= self.device_memory

    def to_dict(self) -> dict[str, Any]:
        """The estimate as JSON-safe data (``fsdp-bridge estimate --json``).

        Returns:
            Every field, with the derived ``sharded_state``, ``peak`` and ``fits``.
        """
        d = asdict(self)
        d.update(sharded_state=self.sharded_state, peak=self.peak, fits=self.fits, mesh=list(self.mesh))
        d["notes"] = list(self.notes)
        return d


def measure_activations(
    model: nn.Module,
    *,
    batch: int,
    seq_len: int,
    units: Sequence[nn.Module] = (),
    activation_checkpointing: bool = False,
) -> int:
    """Peak bytes a forward + backward of ``model`` (on the meta device) allocates beyond
    its parameters, gradients freed as soon as they are accumulated (FSDP reduces and
    frees them per unit; that part is counted in ``unsharded``).  Mutates ``model``
    (checkpoint wrappers): pass a fresh meta model.

    Args:
        model: a model on the meta device.
        batch: sequences per micro-batch.
        seq_len: tokens per sequence.
        units: the units activation checkpointing wraps.
        activation_checkpointing: wrap ``units`` in checkpoint wrappers first.

    Returns:
        The peak bytes above the parameters.

    Raises:
        ConfigError: the forward cannot run on meta tensors with this attention
            implementation (use eager), or at all.
    """
    from fsdp_bridge.api import checkpoint_units
    from fsdp_bridge.hf import disable_kv_cache, is_hf_model

    disable_kv_cache(model)
    if activation_checkpointing:
        checkpoint_units(model, list(units))
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    ids = torch.zeros((batch, seq_len), dtype=torch.long, device="meta")
    inputs: dict[str, torch.Tensor] = {"input_ids": ids}
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids  # explicit: shifting labels needs decoder_start_token_id
    get_head = getattr(model, "get_output_embeddings", None)
    if is_hf_model(model) and get_head is not None and get_head() is not None:
        inputs["labels"] = ids
    # transformers answers some mask questions from the data, which meta tensors cannot:
    # with no mask, causal models inspect position ids for packed sequences; with an
    # all-ones mask, bidirectional models (BERT, T5) check whether the mask can be
    # skipped. Try the explicit mask first, then none.
    attempts = [{"attention_mask": torch.ones_like(ids)}, {}]
    existing = [*model.parameters(), *model.buffers()]
    for i, extra in enumerate(attempts):
        try:
            with LiveBytes("meta", ignore=existing) as live:
                out = model(**inputs, **extra)
                loss = getattr(out, "loss", None)
                if loss is None:
                    first = out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))
                    loss = first.float().sum()
                loss.backward()
            break
        except RuntimeError as err:
            if "meta" not in str(err):
                raise
            if i + 1 < len(attempts):
                continue
            attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
            if attn not in (None, "eager"):
                raise ConfigError(
                    [
                        Problem(
                            "attn_implementation",
                            attn,
                            "eager (the model's forward must run on meta tensors)",
                            f"use --attn eager; the forward needs real data: {err}",
                        )
                    ]
                ) from None
            raise ConfigError(
                [
                    Problem(
                        "model",
                        type(model).__name__,
                        "a model whose forward runs on meta tensors",
                        f"its forward needs real data ({err}); estimate without --batch to leave activations out",
                    )
                ]
            ) from None
    return live.peak


def estimate_memory(
    model: nn.Module,
    config: BridgeConfig,
    *,
    world_size: int,
    nodes: int = 1,
    optimizer: str = "adamw",
    activations: int | None = None,
    device_memory: int | None = None,
) -> RankMemory:
    """Per-rank memory of training ``model`` (any device, meta is best) with ``config``.

    ``activations`` comes from :func:`measure_activations` (None: not estimated).

    Args:
        model: the model.
        config: strategy, backend and the other options.
        world_size: ranks in total.
        nodes: nodes the ranks are spread over.
        optimizer: whose state to count (``OPTIMIZERS``).
        activations: peak activation bytes per rank, or None.
        device_memory: bytes per device, to fill :attr:`RankMemory.fits`.

    Returns:
        The estimate for the fullest rank.

    Raises:
        ConfigError: an unknown optimizer, a world size below 1 or a node count that does not
            divide it (together), or a mesh the strategy cannot make of that world.
    """
    problems: list[Problem] = []
    if optimizer not in OPTIMIZERS:
        problems.append(Problem("optimizer", optimizer, ", ".join(OPTIMIZERS)))
    if world_size < 1:
        problems.append(Problem("world_size", world_size, "an integer >= 1"))
    if nodes < 1 or (world_size >= 1 and world_size % nodes):
        problems.append(Problem("nodes", nodes, f"a divisor of the world size ({world_size})"))
    if problems:
        raise ConfigError(problems)
    mesh = plan_mesh(config, world_size, local_world_size=world_size // nodes)
    backend, strategy = config.backend, config.strategy
    shard = 1 if strategy is ShardingStrategy.NO_SHARD else mesh.shard
    impl = get_backend(backend)
    notes: list[str] = []
    if shard == 1 and strategy is not ShardingStrategy.NO_SHARD:
        notes.append("a shard group of one rank holds whole parameters (FSDP1 then runs NO_SHARD)")

    storage = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    sbytes = torch.empty((), dtype=storage).element_size()
    mp = config.mixed_precision
    cbytes = torch.empty((), dtype=mp.param_dtype or storage).element_size()
    rbytes = torch.empty((), dtype=mp.reduce_dtype or mp.param_dtype or storage).element_size()

    units = model_units(model, config)
    local = [_shard_numel(u, impl, shard, cbytes) for u in units]
    params = sum(local) * sbytes
    grads = params
    states, has_step = OPTIMIZERS[optimizer]
    n_tensors = sum(len(u.shapes) for u in units)
    opt = states * sum(local) * sbytes + (_STEP_BYTES * n_tensors if has_step else 0)

    full = [_padded_full_numel(u, impl, shard, cbytes) for u in units]
    root, others = full[-1], full[:-1]
    largest = max(range(len(full)), key=lambda i: full[i])
    reshard = reshard_after_forward(strategy, config.reshard_after_forward, is_root=False, shard_size=shard)
    if not impl.gathers_full_copy(shard, mixed_precision=mp.enabled):
        gathered = 0  # the local parameters are the full ones: nothing is gathered
    elif reshard and shard > 1:
        gathered = root + 2 * max(others, default=0)  # root kept; current + prefetched unit
    elif reshard:
        # A one-rank copy (FSDP2's unsharded parameters, either backend's cast) is made when its
        # unit runs, nothing is prefetched, and it is freed after the unit.
        gathered = root + max(others, default=0)
    else:
        gathered = sum(full)
    unit_grad = full[largest] * (cbytes + (rbytes if shard > 1 else 0))
    unsharded = gathered * cbytes + unit_grad

    host = 0
    if config.cpu_offload:
        host = params + grads + opt
        params = grads = opt = 0
        notes.append("cpu_offload: parameters, gradients and optimizer state live in host memory")
    return RankMemory(
        backend=backend.value,
        strategy=strategy.value,
        mesh=mesh.shape,
        shard_size=shard,
        params=params,
        grads=grads,
        optimizer=opt,
        unsharded=unsharded,
        activations=activations,
        host=host,
        largest_unit=units[largest].name,
        largest_unit_bytes=full[largest] * cbytes,
        device_memory=device_memory,
        notes=tuple(notes),
    )
