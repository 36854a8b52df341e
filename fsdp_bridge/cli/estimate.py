"""``fsdp-bridge estimate MODEL --world-size N [options]``: memory per rank, every strategy.

MODEL is a Hugging Face model directory, a config file (.json/.yaml with model_type)
or a model type with sizes, e.g.::

    fsdp-bridge estimate llama:hidden_size=4096,intermediate_size=11008,num_hidden_layers=32,\\
num_attention_heads=32,vocab_size=32000 --world-size 8 --batch 1 --seq-len 2048 --device-memory 80GiB

The model is built on the meta device: no weights, no process group.  Activations
are measured with a meta-device forward/backward (eager attention by default: an
upper bound; fused attention kernels store less).  ``--fake-world`` checks the FSDP2
rows against the real shard() run as rank 0 and the last rank of a fake world of
``--world-size`` ranks (torch's fake process group, in this process); exit status 1 if
any parameter's shard differs from the estimate.
"""

from __future__ import annotations

import argparse
import enum
import json

from fsdp_bridge.strategy import Backend, ShardingStrategy

# The keys of fsdp_bridge.estimate.memory.OPTIMIZERS, copied so that `--help` does not
# import torch (tests/test_imports.py checks the two agree).
OPTIMIZER_NAMES: tuple[str, ...] = ("adamw", "adam", "sgd", "sgd-nomomentum", "adagrad", "rmsprop", "none")


def _choices(value: str, enum_cls: type[enum.Enum]) -> list[str]:
    return [m.value for m in enum_cls] if value == "all" else [v.strip() for v in value.split(",")]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "estimate",
        help="estimate memory per rank for every strategy and backend",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="HF model directory, config file, or TYPE:key=value,...")
    p.add_argument("--world-size", type=int, required=True, help="total number of ranks")
    p.add_argument("--nodes", type=int, default=1, help="nodes (HYBRID_* shards within a node; default 1)")
    p.add_argument("--strategy", default="all", help="a strategy, a comma list, or all (default)")
    p.add_argument("--backend", default="all", help="fsdp1, fsdp2 or all (default)")
    p.add_argument("--mixed-precision", default="fp32", help="fp32 (default), bf16 or fp16")
    p.add_argument("--cpu-offload", action="store_true", help="parameters, gradients, optimizer state on host")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZER_NAMES, help="optimizer state to count")
    p.add_argument("--wrap", default="auto", help="wrap policy: auto, none, or class names (A,B)")
    p.add_argument("--batch", type=int, default=None, help="micro-batch per rank (with --seq-len: activations)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each unit in backward")
    p.add_argument("--attn", default="eager", help="attention implementation for the activation run (eager)")
    p.add_argument("--device-memory", default=None, help="memory per device, e.g. 80GiB: marks what fits")
    p.add_argument(
        "--fake-world",
        action="store_true",
        help="also run the real shard() as the first and last of --world-size ranks (fake process "
        "group, meta device, this one process) and check each FSDP2 row against its shards",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fsdp_bridge.config import BridgeConfig
    from fsdp_bridge.estimate import estimate, format_table
    from fsdp_bridge.estimate.report import parse_bytes

    base = BridgeConfig(
        mixed_precision=args.mixed_precision,
        cpu_offload=args.cpu_offload,
        wrap=args.wrap,
        activation_checkpointing=args.activation_checkpointing,
    )
    device_memory = parse_bytes(args.device_memory) if args.device_memory else None
    model = args.model
    if args.fake_world:  # build once: every checked row shards a copy
        from fsdp_bridge.estimate import build_meta_model, load_model_config

        model = build_meta_model(load_model_config(args.model), attn_implementation=args.attn)
    rows = estimate(
        model,
        world_size=args.world_size,
        nodes=args.nodes,
        strategies=_choices(args.strategy, ShardingStrategy),
        backends=_choices(args.backend, Backend),
        base=base,
        optimizer=args.optimizer,
        batch=args.batch,
        seq_len=args.seq_len,
        device_memory=device_memory,
        attn_implementation=args.attn,
    )
    checks: list[dict[str, object]] = []
    if args.fake_world:
        from fsdp_bridge.estimate import plan_at_scale

        for row in rows:
            if row.backend != Backend.FSDP2.value:
                continue
            config = base.replace(backend=row.backend, strategy=row.strategy, hybrid_shape=None)
            plan = plan_at_scale(model, config, world_size=args.world_size, nodes=args.nodes, optimizer=args.optimizer)
            checks.append(
                {
                    "backend": row.backend,
                    "strategy": row.strategy,
                    "ranks": [r.rank for r in plan.ranks],
                    "mesh": list(plan.ranks[0].mesh),
                    "matches": plan.matches,
                    "mismatches": list(plan.mismatches),
                }
            )
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "world_size": args.world_size,
                    "nodes": args.nodes,
                    "config": base.to_dict(),
                    "optimizer": args.optimizer,
                    "batch": args.batch,
                    "seq_len": args.seq_len,
                    "rows": [r.to_dict() for r in rows],
                    **({"fake_world": checks} if args.fake_world else {}),
                },
                indent=2,
            )
        )
    else:
        title = (
            f"{args.model}: {args.world_size} ranks on {args.nodes} node(s), {args.optimizer}, "
            f"{args.mixed_precision}"
            + (", cpu offload" if args.cpu_offload else "")
            + (", activation checkpointing" if args.activation_checkpointing else "")
        )
        print(format_table(rows, title=title))
        for c in checks:
            ranks = " and ".join(map(str, c["ranks"]))  # type: ignore[call-overload]
            verdict = "= estimate (every local shape, params bytes)" if c["matches"] else "DIFFERS from the estimate:"
            print(
                f"fake world: {c['backend']} {c['strategy']}: shard() on ranks {ranks} of {args.world_size} {verdict}"
            )
            for m in c["mismatches"]:  # type: ignore[attr-defined]
                print(f"  {m}")
    return 0 if all(c["matches"] for c in checks) else 1
