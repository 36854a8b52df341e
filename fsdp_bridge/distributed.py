"""Devices, process groups and device meshes.

NCCL on CUDA when GPUs are present, gloo on CPU otherwise; ``device: cpu`` or
``device: cuda`` overrides the automatic choice.  Mesh shapes are validated against the
world size *before* any collective, so a wrong shape fails on every rank at once.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import tempfile
import weakref
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_bridge._launch import env_from_slurm, restart_count
from fsdp_bridge.config import BridgeConfig, fsdp1_mesh
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.mapping import no_shard_mesh_shape
from fsdp_bridge.strategy import ShardingStrategy

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MeshPlan",
    "agree",
    "broadcast_in_place",
    "carried_mesh",
    "group_device",
    "init_distributed",
    "mesh_from_process_group",
    "plan_mesh",
    "resolve_device",
]

DEFAULT_TIMEOUT_S = 600.0
"""Default process-group timeout: a rank that stops answering fails the others after this."""


def resolve_device(device: str, placed: torch.device | None = None) -> torch.device:
    """The device this rank computes on, for ``device`` = auto, cuda or cpu: on CUDA the GPU the process made
    current and put the model on (``torch.cuda.set_device(gpu)`` and ``model.to(gpu)`` with a GPU other than 0:
    a mapping of its own), else ``cuda:LOCAL_RANK``, or, where no launcher set ``LOCAL_RANK`` (processes started
    with ``mp.spawn``), the GPU the model's parameters are on (``placed``: ``model.to(rank)``), as FSDP1 computes
    where the parameters are, else
    ``torch.cuda.current_device()`` (set with ``torch.cuda.set_device(rank)``); ``cuda:0`` where
    ``CUDA_VISIBLE_DEVICES`` shows the process one GPU only (set per rank)."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            [
                Problem(
                    "device",
                    device,
                    "auto or cpu on a machine without CUDA",
                    "set device: cpu (or auto), or run on a machine with GPUs",
                )
            ]
        )
    # A launcher's LOCAL_RANK; without one (mp.spawn and the like), the GPU the model was moved to, else the
    # one the process chose with torch.cuda.set_device, as FSDP1 takes the parameters' device, else
    # torch.cuda.current_device()
    given = os.environ.get("LOCAL_RANK")
    if (
        placed is not None
        and placed.type == "cuda"
        and placed.index not in (None, 0)
        and placed.index == torch.cuda.current_device()
    ):
        # the process chose this GPU itself (torch.cuda.set_device to a GPU of its own mapping, not LOCAL_RANK's)
        # and put the model there: FSDP1 computes where the parameters are
        local_rank = placed.index
    elif given is not None:
        local_rank = int(given)
    elif placed is not None and placed.type == "cuda":
        local_rank = placed.index if placed.index is not None else torch.cuda.current_device()
    else:
        local_rank = torch.cuda.current_device()
    if local_rank > 0 and torch.cuda.device_count() == 1 and os.environ.get("CUDA_VISIBLE_DEVICES"):
        # each process sees one GPU (CUDA_VISIBLE_DEVICES set per rank, a scheduler's one GPU per task): it
        # computes on that one, as FSDP1 on torch.cuda.current_device() does; without that variable two ranks
        # on a one-GPU machine are refused below
        return torch.device("cuda", 0)
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            [
                Problem(
                    "LOCAL_RANK",
                    local_rank,
                    f"< {torch.cuda.device_count()} (GPUs on this node)",
                    "launch at most one rank per GPU (--nproc-per-node)",
                )
            ]
        )
    return torch.device("cuda", local_rank)


def init_distributed(
    device: str = "auto", *, timeout_s: float = DEFAULT_TIMEOUT_S, placed: torch.device | None = None
) -> torch.device:
    """Join or initialise the default process group and return this rank's device.

    Never starts ranks; which group this process joins, in this order:

    1. a default process group already initialised (Ray Train's ``TorchTrainer``, your own
       ``init_process_group``) is joined as it is; its backend must serve ``device``
       (:func:`group_device`);
    2. ``RANK`` and ``WORLD_SIZE`` in the environment (torchrun, ``fsdp-bridge train``, Kubeflow's
       PyTorchJob, TorchX): ``env://`` with ``MASTER_ADDR``/``MASTER_PORT``;
    3. an ``srun`` task (``SLURM_PROCID`` with ``SLURM_NTASKS`` > 1, no ``RANK``): SLURM's
       variables are mapped to torch's first (:func:`fsdp_bridge._launch.slurm_rank_env`), then 2;
    4. otherwise a single-process group (world size 1) on a private file store (no network port).

    Args:
        device: ``auto`` (CUDA with NCCL when available, else CPU with gloo), ``cuda`` or ``cpu``.
        timeout_s: how long a collective may wait for a silent rank before the job fails.
            Call this before :func:`fsdp_bridge.shard` to choose it in your own loop
            (``shard()`` initialises with the 600 s default otherwise).
        placed: the CUDA device the model's parameters are on (``shard()`` passes it): without a
            launcher's ``LOCAL_RANK`` this rank computes there, as FSDP1 does.

    Returns:
        This rank's device.

    Raises:
        ConfigError: for a timeout that is not a finite number of seconds > 0; a group already
            initialised whose backend does not serve ``device``; an srun task without
            ``MASTER_ADDR`` and no node to take it from.
    """
    if not (isinstance(timeout_s, int | float) and 0 < timeout_s < float("inf")):
        raise ConfigError([Problem("timeout_s", timeout_s, "a finite number of seconds > 0", "e.g. timeout_s=600")])
    if dist.is_initialized():
        torch_device = group_device(device, str(dist.get_backend()), placed)
        if torch_device.type == "cuda":
            torch.cuda.set_device(torch_device)
        return torch_device
    env_from_slurm()
    torch_device = resolve_device(device, placed)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    backend = "nccl" if torch_device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    # NCCL bound to this rank's GPU: without device_id it guesses the GPU from the global rank,
    # which is wrong when ranks map to GPUs unevenly (and torch warns that it can hang).
    device_id = torch_device if torch_device.type == "cuda" else None
    attempt = restart_count()
    if attempt and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # After an elastic restart, torch's env:// rendezvous hands the new ranks the previous
        # attempt's addresses (gloo and NCCL then fail with "Connection refused"; torch 2.13,
        # pytorch/pytorch#167288): rendezvous on the agent's store under this attempt's own prefix.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout=timeout)
        prefixed = dist.PrefixStore(f"/fsdp_bridge/attempt_{attempt}", agent)
        dist.init_process_group(
            backend=backend, store=prefixed, rank=rank, world_size=world, timeout=timeout, device_id=device_id
        )
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id)
    else:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="fsdp-bridge-"), "store"), 1)
        dist.init_process_group(
            backend=backend, store=store, rank=0, world_size=1, timeout=timeout, device_id=device_id
        )
    return torch_device


_BACKEND_DEVICES = {"gloo": "cpu", "mpi": "cpu", "nccl": "cuda", "xccl": "xpu", "hccl": "npu"}
"""The device type each of torch's process-group backends serves here: the pairs this module starts
itself (gloo for CPU ranks, NCCL for CUDA ranks), and XPU's and Ascend's collective libraries."""


def group_device(device: str, backend: str, placed: torch.device | None = None) -> torch.device:
    """This rank's device in a process group a launcher already initialised with ``backend``.

    ``backend`` is what ``torch.distributed.get_backend()`` says: one name (``gloo``, ``nccl``)
    or per-device pairs (``cpu:gloo,cuda:nccl``). ``device: auto`` follows the group (CUDA for an
    NCCL group, CPU for a gloo group, CUDA first when it has both and a GPU is present);
    ``cpu``/``cuda`` must be served by it. A backend not known here is trusted with ``device``.

    Raises:
        ConfigError: ``device`` is one the group's backend does not serve (raised on every rank
            alike, before any collective).
    """
    served: list[str] = []
    for part in backend.lower().split(","):
        dev, _, name = part.strip().rpartition(":")
        kind = dev or _BACKEND_DEVICES.get(name)
        if kind is None:
            return resolve_device(device, placed)  # a backend of another library: it knows its devices
        served.append(kind)
    if device == "auto":
        device = "cuda" if "cuda" in served and torch.cuda.is_available() else "cpu" if "cpu" in served else "auto"
    if device in served:
        return resolve_device(device, placed)
    fix = {
        "cpu": "start the launcher's group with gloo (Ray Train: ScalingConfig(use_gpu=False); "
        "torch: init_process_group('gloo')), or set bridge.device to cuda",
        "cuda": "start the launcher's group with NCCL (Ray Train: ScalingConfig(use_gpu=True); "
        "torch: init_process_group('nccl')), or set bridge.device to cpu",
    }.get(device, "set bridge.device to one the group serves")
    raise ConfigError(
        [
            Problem(
                "device",
                device,
                f"a device the launcher's process group serves: it uses the {backend} backend "
                f"({', '.join(served) or 'no known device'})",
                fix,
            )
        ]
    )


def _digest(fingerprint: dict[str, str] | None) -> int:
    if not fingerprint:
        return 0
    text = json.dumps(fingerprint, sort_keys=True)
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)  # 60 bits: fits an int64


def _disagreements(fingerprints: list[dict[str, str] | None]) -> list[Problem]:
    prints = [f or {} for f in fingerprints]
    keys = sorted({k for f in prints for k in f})
    problems = []
    for key in keys:
        values = [f.get(key, "<missing>") for f in prints]
        if len(set(values)) > 1:
            by_value: dict[str, list[int]] = {}
            for rank, value in enumerate(values):
                by_value.setdefault(value, []).append(rank)
            seen = "; ".join(f"rank {','.join(map(str, ranks))}: {value}" for value, ranks in by_value.items())
            problems.append(
                Problem(
                    f"ranks disagree on {key}",
                    seen,
                    "the same value on every rank",
                    "every rank must call shard() with the same config and the same model",
                )
            )
    return problems


def agree(local_problems: list[Problem], *, raise_here: bool = True, fingerprint: dict[str, str] | None = None) -> None:
    """Raise the same ConfigError on every rank if any rank found a problem.

    For checks whose outcome can differ between ranks (e.g. what each rank's model
    holds): one small all-gather that every rank joins, so no rank is left waiting in a
    later collective while another has raised.  Problems found identically on every rank
    are reported once; others are prefixed with the ranks that found them.
    ``raise_here=False`` lets a rank that holds the original exception re-raise that instead.
    ``fingerprint`` (field -> value) is what this rank asked for: ranks that differ in any
    field all raise the same error naming the field and each rank's value.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if local_problems and raise_here:
            raise ConfigError(local_problems)
        return
    # Fast path: one small all-reduce (MAX of [problem?, digest, -digest]) says whether any rank
    # found anything or asked for something else; only then are the details gathered
    # (pickled objects cost two more collectives).
    digest = _digest(fingerprint)
    flag = torch.tensor([1 if local_problems else 0, digest, -digest], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    differ = int(flag[1].item()) != -int(flag[2].item())
    if not int(flag[0].item()) and not differ:
        return
    gathered: list[tuple[list[Problem], dict[str, str] | None] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (list(local_problems), fingerprint))
    per_rank = [entry[0] if entry else [] for entry in gathered]
    if differ:
        mismatch = _disagreements([entry[1] if entry else None for entry in gathered])
        per_rank = [[*mismatch, *items] for items in per_rank]
    if not any(per_rank) or not raise_here:
        return
    if all(items == per_rank[0] for items in per_rank):
        raise ConfigError(per_rank[0])
    merged: list[Problem] = []
    unique = {str(p): p for items in per_rank for p in items}  # values may be unhashable lists
    for text, problem in unique.items():
        ranks = [str(r) for r, items in enumerate(per_rank) if any(str(q) == text for q in items)]
        label = f"rank {','.join(ranks)}: {problem.key}"
        merged.append(Problem(label, problem.value, problem.allowed, problem.fix))
    raise ConfigError(merged)


@dataclass(frozen=True)
class MeshPlan:
    """The mesh a strategy needs, before it is created."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]

    @property
    def shard(self) -> int:
        return self.shape[-1]


def plan_mesh(config: BridgeConfig, world_size: int, *, local_world_size: int | None = None) -> MeshPlan:
    """The mesh shape for ``config`` at ``world_size`` (no collective; raises ConfigError).

    FULL_SHARD / SHARD_GRAD_OP: 1D.  HYBRID_*: 2D (replicate, shard), by default
    shard within a node.  NO_SHARD: 1D for FSDP1, (world, 1) for FSDP2, which is pure
    replication with gradient all-reduce.
    """
    strategy = config.strategy
    if strategy.is_hybrid:
        if config.hybrid_shape is not None:
            shape = config.hybrid_shape
        else:
            per_node = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            if per_node < 1 or world_size % per_node:
                raise ConfigError(
                    [
                        Problem(
                            "hybrid_shape",
                            None,
                            "an explicit [replicate, shard]",
                            f"ranks per node ({per_node}) does not divide the world size "
                            f"({world_size}); set hybrid_shape",
                        )
                    ]
                )
            shape = (world_size // per_node, per_node)
        if shape[0] * shape[1] != world_size:
            raise ConfigError(
                [
                    Problem(
                        "hybrid_shape",
                        list(shape),
                        f"two integers whose product is the world size ({world_size})",
                        f"set hybrid_shape to [replicate, shard] with replicate * shard = {world_size}, "
                        f"e.g. [1, {world_size}], or launch {shape[0] * shape[1]} ranks",
                    )
                ]
            )
        plan = MeshPlan(shape, ("replicate", "shard"))
    elif strategy is ShardingStrategy.NO_SHARD:
        no_shard = no_shard_mesh_shape(config.backend, world_size)
        plan = MeshPlan(no_shard, ("replicate", "shard") if len(no_shard) == 2 else ("shard",))
    else:
        plan = MeshPlan((world_size,), ("shard",))
    raf = config.reshard_after_forward
    if isinstance(raf, int) and not isinstance(raf, bool) and plan.shard % raf:
        raise ConfigError(
            [
                Problem(
                    "reshard_after_forward",
                    raf,
                    f"a divisor of the shard group size ({plan.shard})",
                    "use true, false, or a divisor of the number of ranks per shard group",
                )
            ]
        )
    return plan


def build_mesh(plan: MeshPlan, device_type: str) -> DeviceMesh:
    """Create the mesh (a collective: call only after validation)."""
    return init_device_mesh(device_type, plan.shape, mesh_dim_names=plan.dim_names)


def plan_user_mesh(config: BridgeConfig, mesh: DeviceMesh) -> MeshPlan:
    """The plan for a mesh the user passes to shard(): the data-parallel mesh FSDP runs on.

    It may be a sub-mesh of a larger one (``mesh["dp"]`` of a (dp, tp) mesh, or
    ``mesh["replicate", "shard"]`` of a 3D mesh): its own size, not the world's, is the
    data-parallel size, and HYBRID_* take any 2D shape unless ``hybrid_shape`` pins one.
    """
    size = mesh.size()
    if config.strategy.is_hybrid and mesh.ndim != 2:
        raise ConfigError(
            [
                Problem(
                    "mesh",
                    f"DeviceMesh{tuple(mesh.shape)}",
                    f"a 2D (replicate, shard) data-parallel mesh for {config.strategy.value}",
                    "pass mesh['replicate', 'shard'] of your mesh (e.g. of a "
                    "(replicate, shard, tp) mesh), or use full_shard on a 1D data-parallel mesh such as mesh['dp']",
                )
            ]
        )
    if config.strategy.is_hybrid and config.hybrid_shape is None:
        plan = MeshPlan(tuple(mesh.shape), ("replicate", "shard"))
    else:
        plan = plan_mesh(config, size, local_world_size=size if not config.strategy.is_hybrid else None)
    if mesh.ndim == 1 and plan.shape == (size, 1):
        return plan  # NO_SHARD over a 1D mesh on FSDP2: replicated over it (see replication_mesh)
    check_user_mesh(mesh, plan)
    return plan


def replication_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """NO_SHARD over a 1D data-parallel mesh on FSDP2 (FSDP1's ``device_mesh=`` or ``process_group=`` for
    NO_SHARD): the ``(n, 1)`` (replicate, shard) mesh over the same ranks, replicated along the first
    dimension and sharded over groups of one. Built from the mesh itself where torch can (its parameters
    may be DTensors of a sibling dimension, a (dp, tp) mesh's tp), else from its process group. A
    collective: call on every rank, after validation.

    Args:
        mesh: a 1D mesh (over every rank, or a data-parallel sub-mesh of a larger one).

    Returns:
        A 2D ``(replicate, shard)`` mesh of shape ``(mesh.size(), 1)`` over the same ranks, the same object
        for every call with that mesh (no new process groups after the first).
    """
    made = _REPLICATION_MESHES.get(mesh)
    if made is None:  # made once per mesh: each unit sharded over it shares the groups
        made = _REPLICATION_MESHES[mesh] = _make_replication_mesh(mesh)
    return made


_REPLICATION_MESHES: weakref.WeakKeyDictionary[DeviceMesh, DeviceMesh] = weakref.WeakKeyDictionary()
"""A user's mesh -> the mesh the bridge shards over in its place (replication_mesh, named_hybrid_mesh)."""


def named_hybrid_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """HYBRID_* over a 2D mesh without dimension names (FSDP1 takes ``init_device_mesh("cuda", (nodes, 8))``,
    FSDP2 refuses it): the same mesh with its dimensions named ``("replicate", "shard")``, over the same
    process groups (no new group), one per mesh.

    Args:
        mesh: a 2D mesh whose ``mesh_dim_names`` is None.

    Returns:
        The named mesh (``mesh`` itself when it has names).
    """
    if mesh.mesh_dim_names is not None or mesh.ndim != 2:
        return mesh
    named = _REPLICATION_MESHES.get(mesh)
    if named is None:
        groups = [mesh.get_group(0), mesh.get_group(1)]
        named = DeviceMesh.from_group(groups, mesh.device_type, mesh=mesh.mesh, mesh_dim_names=("replicate", "shard"))
        _REPLICATION_MESHES[mesh] = named
    return named


def _make_replication_mesh(mesh: DeviceMesh) -> DeviceMesh:
    size = mesh.size()
    unflatten = getattr(mesh, "_unflatten", None)  # torch's private API, 2.8+: keeps the parent mesh
    # Over some ranks only (a group per model-parallel slice), each slice's ranks would make process groups the
    # other slices do not, and the calls would not line up (a hang): the groups below are made on every rank.
    if unflatten is not None and size == dist.get_world_size():
        try:
            return cast(DeviceMesh, unflatten(0, (size, 1), ("replicate", "shard")))
        except (RuntimeError, ValueError, NotImplementedError):
            pass  # the names taken in the parent mesh, a mesh torch cannot unflatten: from its group below
    singles, _ = dist.new_subgroups_by_enumeration([[r] for r in range(dist.get_world_size())])
    ranks = torch.tensor(mesh.mesh.flatten().tolist(), dtype=torch.int).view(size, 1)
    groups = [mesh.get_group(0), cast(dist.ProcessGroup, singles)]  # this rank's group of one
    return DeviceMesh.from_group(groups, mesh.device_type, mesh=ranks, mesh_dim_names=("replicate", "shard"))


def check_user_mesh(mesh: DeviceMesh, plan: MeshPlan) -> None:
    """A mesh passed to shard() must have the shape the strategy needs."""
    shape = tuple(mesh.shape)
    if shape != plan.shape:
        raise ConfigError(
            [
                Problem(
                    "mesh",
                    f"DeviceMesh{shape}",
                    f"a data-parallel mesh of shape {plan.shape} ({', '.join(plan.dim_names)}) for "
                    f"{plan.shape[0] if len(plan.shape) == 1 else 'replicate x shard'} ranks",
                    "pass the data-parallel (sub-)mesh of that shape (e.g. mesh['dp'] of a (dp, tp) mesh; "
                    "a 2D (replicate, shard) mesh for HYBRID_*), or mesh=None to let fsdp_bridge build it",
                )
            ]
        )


def _group_problem(value: object, why: str) -> ConfigError:
    return ConfigError(
        [
            Problem(
                "process_group",
                value,
                "None, a torch.distributed ProcessGroup, or FSDP1's HYBRID pair (shard group, replicate group)",
                why,
            )
        ]
    )


def mesh_from_process_group(group: object, device_type: str | None = None) -> DeviceMesh | None:
    """The data-parallel DeviceMesh that FSDP1's ``process_group=`` argument stands for.

    FSDP2 shards over a DeviceMesh, FSDP1 over process groups. ``migrate code --fix`` writes
    ``fsdp_bridge.shard(model, BridgeConfig.from_fsdp1(...), mesh=mesh_from_process_group(<group>))``
    where an ``FSDP(...)`` call passes ``process_group=``: the data-parallel group of a model-parallel
    setup (each group shards its own copy, as in FSDP1), or HYBRID_SHARD's pair of groups.

    Call it on every rank (the HYBRID pair exchanges its groups' ranks: a collective over the
    replicate group).

    Args:
        group: None or a group over every rank (the bridge's own mesh: returns None); a ProcessGroup
            (a 1D mesh over its ranks); or FSDP1's ``(shard_group, replicate_group)`` pair for
            HYBRID_SHARD (intra-node, inter-node): a 2D ``(replicate, shard)`` mesh.
        device_type: the mesh's device type; default ``cuda`` for an NCCL group, ``cpu`` otherwise.

    Returns:
        The mesh to pass as ``shard(..., mesh=)``, or None for the bridge's mesh over every rank.

    Raises:
        ConfigError: no process group is initialised, a value that is not a group or a pair of
            groups, or a pair whose groups do not form a (replicate, shard) grid.
    """
    if group is None:
        return None
    if not dist.is_initialized():
        raise _group_problem(group, "initialise torch.distributed (init_process_group) before building the mesh")
    pair = isinstance(group, (tuple, list))
    given: list[object] = list(group) if isinstance(group, (tuple, list)) else [group]
    groups = [g for g in given if isinstance(g, dist.ProcessGroup)]
    if len(given) != (2 if pair else 1) or len(groups) != len(given):
        raise _group_problem(
            type(group).__name__ if not pair else f"a {len(given)}-tuple",
            "pass one ProcessGroup, or FSDP1's (intra-node, inter-node) pair of ProcessGroups",
        )
    if device_type is None:
        backend = str(dist.get_backend(groups[0]))
        device_type = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
    if not pair:
        ranks = dist.get_process_group_ranks(groups[0])
        if len(ranks) == dist.get_world_size():
            return None
        return DeviceMesh.from_group(groups[0], device_type, mesh_dim_names=("shard",))
    shard_group, replicate_group = groups
    shard_ranks = dist.get_process_group_ranks(shard_group)
    replicate_ranks = dist.get_process_group_ranks(replicate_group)
    rows: list[list[int] | None] = [None] * len(replicate_ranks)
    dist.all_gather_object(rows, shard_ranks, group=replicate_group)  # each replica's shard group, in order
    column = shard_ranks.index(dist.get_rank())
    if any(r is None or len(r) != len(shard_ranks) for r in rows) or [r[column] for r in rows] != replicate_ranks:  # type: ignore[index]
        raise _group_problem(
            f"shard group {shard_ranks}, replicate group {replicate_ranks}",
            "the replicate group must hold the rank at this rank's position in every shard group "
            "(FSDP1's intra-node / inter-node split); build init_device_mesh(device, (replicate, shard)) "
            "and pass it as shard(..., mesh=...)",
        )
    mesh = torch.tensor(rows, dtype=torch.int)
    return DeviceMesh.from_group(
        [replicate_group, shard_group], device_type, mesh=mesh, mesh_dim_names=("replicate", "shard")
    )


def broadcast_in_place(
    tensor: torch.Tensor, device: torch.device, src: int, group: dist.ProcessGroup | None = None
) -> None:
    """``src``'s values into ``tensor``; a tensor kept off the collective's device (still on CPU before
    FSDP1 moves it, offloaded) goes through a copy on ``device`` that is written back."""
    if tensor.device == device:
        dist.broadcast(tensor, src=src, group=group)
        return
    tmp = tensor.to(device)
    dist.broadcast(tmp, src=src, group=group)
    tensor.copy_(tmp)


def average_gradients_over(mesh: DeviceMesh, params: list[torch.nn.Parameter]) -> None:
    """Average the gradients of replicated ``params`` over every rank of ``mesh`` after each
    accumulation (what FSDP does for the parameters it manages)."""
    if not params or mesh.size() == 1:
        return
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim) if mesh.shape[dim] > 1]
    size = mesh.size()

    def hook(param: torch.Tensor) -> None:
        assert param.grad is not None
        for group in groups:
            dist.all_reduce(param.grad, group=group)
        param.grad.div_(size)

    for p in params:
        p.register_post_accumulate_grad_hook(hook)


def carried_mesh(config: BridgeConfig, mesh: Any) -> Any:
    """The mesh to shard over: ``mesh``, or the ``device_mesh`` / ``process_group`` that
    :meth:`BridgeConfig.from_fsdp1` was given (a group becomes its mesh here: call on every rank).

    Raises:
        ConfigError: both, and not the same mesh.
    """
    carried = fsdp1_mesh(config)
    if carried is None:
        return mesh
    name, value = carried
    if mesh is not None:
        if name == "device_mesh" and mesh is value:
            return mesh
        raise ConfigError(
            [
                Problem(
                    "mesh",
                    f"shard(..., mesh=...) and BridgeConfig.from_fsdp1({name}=...)",
                    "one of them",
                    f"drop {name} from the FSDP1 arguments or mesh= from the call",
                )
            ]
        )
    if name == "device_mesh":
        return value
    return mesh_from_process_group(value)
