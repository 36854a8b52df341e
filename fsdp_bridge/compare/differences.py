"""The settings that differ between FSDP1 and FSDP2 for one config and can change the numbers.

Read from the mapping table (:func:`fsdp_bridge.mapping.translate`): every option whose
FSDP1 and FSDP2 translations differ is listed with what it can change.  One fact that is
no config option (how each backend averages gradients) is added from :data:`_ALWAYS`.
"""

from __future__ import annotations

import enum

from fsdp_bridge.compare.report import Difference
from fsdp_bridge.config import BridgeConfig
from fsdp_bridge.mapping import translate
from fsdp_bridge.strategy import Backend

__all__ = ["backend_differences"]

_EFFECTS: dict[str, str] = {
    "strategy": "When each unit's parameters are freed after forward (the root included) changes memory and "
    "communication, not the values, in fp32.",
    "mixed_precision": "The compute and reduction dtypes decide the rounding of the loss and gradients; "
    "a different reduce dtype changes the gradients in their last bits.",
    "backward_prefetch": "Prefetch order changes overlap and peak memory, not the values.",
    "forward_prefetch": "Prefetch order changes overlap and peak memory, not the values.",
    "limit_all_gathers": "Rate limiting changes peak memory and speed, not the values.",
    "reshard_after_forward": "Resharding changes memory and communication, not the values.",
    "cpu_offload": "The optimizer step runs on the CPU: same values, different speed.",
    "sync_module_states": "Both start from rank 0's weights; the broadcast differs, not the values.",
}

_ONLY_WHEN_SET = frozenset({"cpu_offload", "sync_module_states", "reshard_after_forward"})
"""Options whose unset value (false, null) does the same on both backends: nothing is offloaded or
broadcast, and resharding follows the strategy (listed under ``strategy``)."""

_ALWAYS: tuple[Difference, ...] = (
    Difference(
        setting="gradient averaging",
        fsdp1="divides gradients by a power-of-two factor (about sqrt(N)) before the reduce-scatter and by the rest "
        "after it, in every reduce dtype",
        fsdp2="reduces with ReduceOp.AVG when the reduce dtype is fp32 or bf16 (divides before/after only for fp16)",
        effect="The gradients can differ in their last bits; in fp32 at small world sizes they usually agree exactly, "
        "in bf16/fp16 the rounding differs, which is why those tolerances are looser.",
    ),
)


def backend_differences(
    config: BridgeConfig, *, device_type: str | None = None, world_size: int = 2
) -> list[Difference]:
    """What FSDP1 and FSDP2 do differently for ``config`` (the backend field is ignored).

    Args:
        config: the bridge config both backends run.
        device_type: ``"cpu"`` or ``"cuda"``; some rows differ by device.
        world_size: ranks; above one, the gradient-reduction difference is listed too.

    Returns:
        The settings whose rows differ and can change the numbers, with their effect.
    """
    one = translate(config, Backend.FSDP1, device_type=device_type)
    two = translate(config, Backend.FSDP2, device_type=device_type)
    by_option = {e.option: e for e in two.entries}
    out: list[Difference] = []
    for e1 in one.entries:
        e2 = by_option.get(e1.option)
        if e2 is None or e1.option not in _EFFECTS or (e1.outcome, e1.text) == (e2.outcome, e2.text):
            continue
        if e1.option in _ONLY_WHEN_SET and e1.value in (False, None):
            continue
        if e1.option == "mixed_precision" and not config.mixed_precision.enabled:
            continue  # both compute and reduce in the parameters' dtype: nothing differs
        out.append(
            Difference(
                setting=f"{e1.option} = {_value(e1.value)}",
                fsdp1=f"{e1.outcome.value}: {e1.text}",
                fsdp2=f"{e2.outcome.value}: {e2.text}",
                effect=_EFFECTS[e1.option],
            )
        )
    if world_size > 1:
        out.extend(_ALWAYS)
    return out


def _value(value: object) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    spelling = getattr(value, "to_spelling", None)
    return str(spelling()) if callable(spelling) else str(value)
