"""The README's Python blocks, type-checked by mypy (``make lint``; pyproject's ``[tool.mypy] files``).

Users run mypy on code like this: the package ships ``py.typed``, so these calls must type-check
as written.  Each ``readme_block_N`` holds the README's N-th Python block verbatim, indented
(``tests/test_schema.py`` checks they still match); the names a block takes from its surroundings
are parameters.  The rest checks what the constructor accepts and what the fields hold after it.
Not collected by pytest (no ``test_`` prefix); ``warn_unused_ignores`` is on for this file, so
each ``type: ignore`` below must still be needed: a signature that stopped refusing a wrong type fails.
"""

# mypy: warn-unused-ignores
# ruff: noqa: F841, B007, I001

from __future__ import annotations

from typing import assert_type

import torch
from torch import nn

import fsdp_bridge
from fsdp_bridge import Backend, BackwardPrefetch, BridgeConfig, ShardingStrategy
from fsdp_bridge.config import MixedPrecisionConfig, WrapPolicy


def readme_block_1(
    model: nn.Module, loader: list[list[dict[str, torch.Tensor]]], optimizer: torch.optim.Optimizer
) -> None:
    import torch
    import fsdp_bridge

    config = fsdp_bridge.BridgeConfig(strategy="full_shard", backend="fsdp2")  # or backend="fsdp1"
    model = fsdp_bridge.shard(model, config)  # any nn.Module; HF models shard well by default
    optimizer = torch.optim.AdamW(model.parameters())  # build it after shard()

    for step, batches in enumerate(loader):
        for i, batch in enumerate(batches):  # gradient accumulation
            if i < len(batches) - 1:
                with fsdp_bridge.no_sync(model):
                    model(**batch).loss.backward()
            else:
                model(**batch).loss.backward()
        fsdp_bridge.clip_grad_norm_(model, 1.0)  # global norm over shards and replicas
        optimizer.step()
        optimizer.zero_grad()

    print(fsdp_bridge.get_bridge(model).report.format())  # what every option became


def readme_block_2(
    model: nn.Module, loader: list[list[dict[str, torch.Tensor]]], optimizer: torch.optim.Optimizer
) -> None:
    fsdp_bridge.save_checkpoint("runs/step_100", model, optimizer, state={"step": 100}, keep_last=3)  # sharded DCP
    latest = fsdp_bridge.latest_checkpoint("runs")  # None when there is none yet
    state = fsdp_bridge.load_checkpoint(latest, model, optimizer) if latest is not None else {}
    fsdp_bridge.save_checkpoint("export", model, kind="full")  # AutoModelForCausalLM.from_pretrained("export")


def spellings_users_write() -> None:
    config = BridgeConfig(
        strategy="hybrid_shard",
        backend=Backend.FSDP1,
        mixed_precision="bf16",
        wrap=["LlamaDecoderLayer", nn.Linear],
        backward_prefetch=None,
        reshard_after_forward=2,
        hybrid_shape=[2, 4],
        ignored_modules="lm_head",
        device="cpu",
    )
    BridgeConfig(mixed_precision={"param_dtype": "bf16"}, wrap={"min_num_params": 1_000_000})
    BridgeConfig(wrap=lambda module: isinstance(module, nn.Linear), strategy=ShardingStrategy.NO_SHARD)
    # After construction every field holds its annotated, normalised type.
    assert_type(config.strategy, ShardingStrategy)
    assert_type(config.backend, Backend)
    assert_type(config.mixed_precision, MixedPrecisionConfig)
    assert_type(config.wrap, WrapPolicy)
    assert_type(config.backward_prefetch, BackwardPrefetch | int)
    assert_type(config.hybrid_shape, tuple[int, int] | None)
    assert_type(config.ignored_modules, tuple[str, ...])
    assert_type(fsdp_bridge.load_config("config.yaml"), BridgeConfig)


def mistakes_mypy_catches() -> None:
    BridgeConfig("full_shard")  # type: ignore[call-arg]
    BridgeConfig(strategy=3)  # type: ignore[arg-type]
    BridgeConfig(cpu_offload="yes")  # type: ignore[arg-type]
    BridgeConfig(hybrid_shape=2)  # type: ignore[arg-type]
    BridgeConfig(stratgy="full_shard")  # type: ignore[call-arg]
