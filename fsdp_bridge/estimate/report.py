"""Estimate every requested configuration at once and print it as a table."""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence

from torch import nn

from fsdp_bridge.config import BridgeConfig
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.estimate.memory import RankMemory, estimate_memory, measure_activations
from fsdp_bridge.estimate.model import build_meta_model, load_model_config
from fsdp_bridge.strategy import Backend, ShardingStrategy
from fsdp_bridge.wrap import resolve_wrap

__all__ = ["estimate", "format_bytes", "format_table", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"1.5TiB"`` or a plain number of bytes.

    Args:
        text: a size with an optional unit (B, KB/KiB ... TB/TiB, any case).

    Returns:
        The size in bytes.

    Raises:
        ConfigError: ``text`` is not a size, named as ``device_memory``.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError([Problem("device_memory", text, "a size such as 80GiB, 40GB or 24576MiB")])
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int | None) -> str:
    """A byte count for tables.

    Args:
        n: bytes, or None.

    Returns:
        ``"1.50 GiB"`` style (binary units, two decimals), ``"512 B"`` below 1 KiB, ``"-"`` for None.
    """
    if n is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def estimate(
    model: str | nn.Module,
    *,
    world_size: int,
    nodes: int = 1,
    strategies: Sequence[ShardingStrategy | str] = tuple(ShardingStrategy),
    backends: Sequence[Backend | str] = tuple(Backend),
    base: BridgeConfig | None = None,
    optimizer: str = "adamw",
    batch: int | None = None,
    seq_len: int | None = None,
    device_memory: int | None = None,
    attn_implementation: str | None = "eager",
) -> list[RankMemory]:
    """Per-rank memory for every backend x strategy (``base`` gives the other options).

    ``model`` is a spec (see :mod:`fsdp_bridge.estimate.model`) or a module, best on the
    meta device.  Needs no process group and allocates no weights.  Activations are
    measured with ``attn_implementation`` (eager: the attention probabilities are
    stored, an upper bound for fused kernels).

    Args:
        model: a spec or a module.
        world_size: ranks in total.
        nodes: nodes the ranks are spread over (hybrid strategies shard within a node).
        strategies: the strategies to estimate (default: all five).
        backends: the backends to estimate (default: both).
        base: the config giving every other option (precision, wrap, offload ...).
        optimizer: whose state to count (``OPTIMIZERS``).
        batch: micro-batch per rank, for activations (with ``seq_len``).
        seq_len: sequence length, for activations (with ``batch``).
        device_memory: bytes per device, to say whether each configuration fits.
        attn_implementation: the attention used to measure activations.

    Returns:
        One :class:`RankMemory` per backend and strategy (the fullest rank).

    Raises:
        ConfigError: every size out of range, ``batch`` without ``seq_len`` (or the reverse), a
            model that cannot be built or run on the meta device, together where they can be.
    """
    base = base or BridgeConfig()
    problems = [
        Problem(key, value, f"an integer from 1 to {limit:,}", fix)
        for key, value, limit, fix in (
            ("world_size", world_size, 2**24, "the total number of ranks, e.g. --world-size 8"),
            ("nodes", nodes, 2**20, "the number of nodes, e.g. --nodes 2"),
            ("batch", batch, 2**20, "the micro-batch per rank, e.g. --batch 1"),
            ("seq_len", seq_len, 2**20, "the sequence length, e.g. --seq-len 2048"),
        )
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit)
    ]
    if (batch is None) != (seq_len is None):
        problems.append(
            Problem(
                "batch/seq_len",
                (batch, seq_len),
                "both or neither",
                "give --batch and --seq-len together to estimate activations",
            )
        )
    if device_memory is not None and device_memory <= 0:
        problems.append(Problem("device_memory", device_memory, "a positive size such as 80GiB"))
    if problems:
        raise ConfigError(problems)
    module: nn.Module = (
        build_meta_model(load_model_config(model), attn_implementation=attn_implementation)
        if isinstance(model, str)
        else model
    )

    activations: int | None = None
    if batch is not None and seq_len is not None:
        compute = base.mixed_precision.param_dtype
        fresh = copy.deepcopy(module)
        if compute is not None:
            fresh = fresh.to(compute)
        units = resolve_wrap(fresh, base.wrap).modules
        try:
            activations = measure_activations(
                fresh, batch=batch, seq_len=seq_len, units=units, activation_checkpointing=base.activation_checkpointing
            )
        except (RuntimeError, ValueError, IndexError) as err:  # e.g. numel overflow, seq_len past the positions
            raise ConfigError(
                [
                    Problem(
                        "batch/seq_len",
                        (batch, seq_len),
                        "sizes this model can run a forward with",
                        f"the meta-device forward failed ({' '.join(str(err).split())[:200]}); "
                        "use a smaller --batch or --seq-len",
                    )
                ]
            ) from None

    rows: list[RankMemory] = []
    for b in backends:
        for s in strategies:
            config = base.replace(backend=b, strategy=s, hybrid_shape=None)
            rows.append(
                estimate_memory(
                    module,
                    config,
                    world_size=world_size,
                    nodes=nodes,
                    optimizer=optimizer,
                    activations=activations,
                    device_memory=device_memory,
                )
            )
    return rows


def format_table(rows: Sequence[RankMemory], *, title: str = "") -> str:
    """A plain-text table of ``rows``, one per configuration.

    Args:
        rows: the estimates.
        title: a line printed above the table.

    Returns:
        The table: backend, strategy, mesh, then each memory figure and whether it fits.
    """
    head = [
        "backend",
        "strategy",
        "mesh",
        "params",
        "grads",
        "optimizer",
        "sharded",
        "unsharded",
        "activations",
        "peak",
        "host",
        "fits",
    ]
    body: list[list[str]] = []
    for r in rows:
        fits = "-" if r.fits is None else ("yes" if r.fits else "NO")
        body.append(
            [
                r.backend,
                r.strategy,
                "x".join(map(str, r.mesh)),
                format_bytes(r.params),
                format_bytes(r.grads),
                format_bytes(r.optimizer),
                format_bytes(r.sharded_state),
                format_bytes(r.unsharded),
                format_bytes(r.activations),
                format_bytes(r.peak),
                format_bytes(r.host) if r.host else "-",
                fits,
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
    lines = [title] if title else []
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in body)
    notes = sorted({n for r in rows for n in r.notes})
    lines.extend(f"note: {n}" for n in notes)
    return "\n".join(lines)
