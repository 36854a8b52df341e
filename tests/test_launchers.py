"""train() inside a launcher that set up the ranks: which process group a process joins (one process,
milliseconds), the Kubernetes manifest, and the Ray Train example with a worker that fails once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch.distributed as dist

from fsdp_bridge._faults import InjectedFault, maybe_fail
from fsdp_bridge._launch import existing_launch, first_slurm_host, slurm_rank_env
from fsdp_bridge.distributed import group_device, init_distributed
from fsdp_bridge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

SRUN_TASK = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
}


@pytest.mark.parametrize(
    ("env", "joins"),
    [
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, True),  # torchrun, Kubeflow, Ray
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "16"}, True),  # srun, one task per rank
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, False),  # one task: fsdp-bridge train starts the ranks
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "x"}, False),
        ({"RANK": "0"}, False),
        ({}, False),
    ],
)
def test_which_environment_is_a_launch_that_set_up_the_ranks(env: dict[str, str], joins: bool) -> None:
    assert existing_launch(env) is joins


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("gpu[07-08]", "gpu07"),
        ("gpu[003,010-012],cpu1", "gpu003"),
        ("node5,node6", "node5"),
        ("rack[2-3]-n[01-04]", "rack2-n01"),
        ("", None),
    ],
)
def test_first_host_of_a_slurm_node_list(nodelist: str, first: str | None) -> None:
    assert first_slurm_host(nodelist) == first


def test_srun_variables_map_to_torchs() -> None:
    assert slurm_rank_env(SRUN_TASK) == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "29500",
    }
    # srun's launch node wins over the node list; what the script exported wins over both.
    launch_ip = {**SRUN_TASK, "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7"}
    assert slurm_rank_env(launch_ip)["MASTER_ADDR"] == "10.0.0.7"
    exported = slurm_rank_env({**launch_ip, "MASTER_ADDR": "head", "MASTER_PORT": "6000"})
    assert "MASTER_ADDR" not in exported and "MASTER_PORT" not in exported
    # Uneven nodes: this node's own count.
    assert slurm_rank_env({**SRUN_TASK, "SLURM_TASKS_PER_NODE": "5,3"})["LOCAL_WORLD_SIZE"] == "3"
    # torchrun under srun (RANK set), or a single task: nothing to map.
    assert slurm_rank_env({**SRUN_TASK, "RANK": "0", "WORLD_SIZE": "16"}) == {}
    assert slurm_rank_env({**SRUN_TASK, "SLURM_NTASKS": "1"}) == {}


def test_srun_task_without_an_address_is_refused_before_any_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_LAUNCH_NODE_IPADDR"):
        monkeypatch.delenv(name, raising=False)
    task = {k: v for k, v in SRUN_TASK.items() if k != "SLURM_JOB_NODELIST"}
    for name, value in task.items():
        monkeypatch.setenv(name, value)
    assert not dist.is_initialized()
    # init_distributed (what train() and shard() call) maps srun's variables: it does not start
    # a one-rank group of its own in a task of an 8-task srun.
    with pytest.raises(ConfigError, match=r"MASTER_ADDR: got None; allowed: the address of the node that runs rank 0"):
        init_distributed("cpu")
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("device", "backend", "expected"),
    [
        ("cpu", "gloo", "cpu"),
        ("auto", "gloo", "cpu"),
        ("cpu", "cpu:gloo,cuda:nccl", "cpu"),
        ("auto", "fake", "cpu"),  # another library's backend: trusted
    ],
)
def test_a_launchers_group_is_joined_on_the_device_it_serves(device: str, backend: str, expected: str) -> None:
    assert group_device(device, backend).type == expected


@pytest.mark.parametrize(
    ("device", "backend", "fix"),
    [
        ("cuda", "gloo", r"start the launcher's group with NCCL \(Ray Train: ScalingConfig\(use_gpu=True\)"),
        ("cpu", "nccl", r"start the launcher's group with gloo \(Ray Train: ScalingConfig\(use_gpu=False\)"),
    ],
)
def test_a_launchers_group_with_another_backend_is_refused(device: str, backend: str, fix: str) -> None:
    with pytest.raises(
        ConfigError,
        match=rf"device: got '{device}'; allowed: a device the launcher's process group serves: it uses the {backend} backend.*Fix: {fix}",
    ):
        group_device(device, backend)


def test_an_initialised_group_is_joined_not_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert init_distributed("auto").type == "cpu"
        assert dist.group.WORLD is group
        with pytest.raises(ConfigError, match="it uses the gloo backend"):
            init_distributed("cuda")
        assert dist.group.WORLD is group
    finally:
        dist.destroy_process_group()


def test_a_once_fault_fires_on_the_first_attempt_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Ray Train and Kubernetes restart workers without TORCHELASTIC_RESTART_COUNT: the marker the
    # firing rank leaves in the run directory tells the next attempt.
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("FSDP_BRIDGE_FAULT", "1:step:3:once")
    with pytest.raises(InjectedFault, match="rank 1 at step:3"):
        maybe_fail("step:3", run_dir=tmp_path)
    maybe_fail("step:3", run_dir=tmp_path)  # the second attempt gets past it
    assert (tmp_path / ".fault-fired-rank1-step-3").exists()


def test_kubeflow_pytorchjob_manifest_runs_a_valid_config_through_torchrun(tmp_path: Path) -> None:
    """No cluster here: the manifest is parsed, its config loaded and its command checked."""
    import yaml
    from torch.distributed.run import get_args_parser

    from fsdp_bridge.cli import build_parser
    from fsdp_bridge.train import load_train_config, preflight

    docs = list(yaml.safe_load_all((EXAMPLES / "k8s" / "pytorchjob.yaml").read_text()))
    by_kind = {d["kind"]: d for d in docs}
    assert sorted(by_kind) == ["ConfigMap", "PyTorchJob"]
    job = by_kind["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    elastic = job["spec"]["elasticPolicy"]
    assert elastic["rdzvBackend"] == "c10d" and 1 <= elastic["minReplicas"] <= elastic["maxReplicas"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert elastic["minReplicas"] <= worker["replicas"] <= elastic["maxReplicas"]
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    # The worker command: torchrun (the operator passes the rendezvous as PET_* variables) running
    # `fsdp-bridge train CONFIG --resume` as each rank.
    command = container["command"]
    assert command[0] == "torchrun"
    launch = get_args_parser().parse_args(command[1:])
    assert launch.no_python and launch.training_script == "fsdp-bridge"
    assert launch.nproc_per_node == job["spec"]["nprocPerNode"] == "1"
    cli = build_parser().parse_args(launch.training_script_args)
    assert cli.command == "train" and cli.resume
    (config_path,) = [i for i in cli.items if "=" not in i]
    # The config file is the ConfigMap's key, mounted where the command reads it.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    config_dir, _, key = config_path.rpartition("/")
    config_map = volumes[mounts[config_dir]]["configMap"]["name"]
    assert config_map == by_kind["ConfigMap"]["metadata"]["name"]
    local = tmp_path / key
    local.write_text(by_kind["ConfigMap"]["data"][key])
    config = load_train_config(local)
    assert config.resume == "auto"
    # output_dir is on the volume every pod mounts (a claim, not the pod's own disk).
    runs = next(p for p in mounts if config.output_dir.startswith(p + "/"))
    assert "persistentVolumeClaim" in volumes[mounts[runs]]
    # Every world size the elastic policy allows is one the job accepts.
    for world in range(elastic["minReplicas"], elastic["maxReplicas"] + 1):
        preflight(config, world_size=world, local_world_size=1, device_type=config.bridge.device)


# The Ray example and an uninterrupted run through the CLI: a tiny model, a few seconds of training each.
TINY = [
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.num_hidden_layers=2",
    "model.tokenizer_vocab_size=400",
    "data.seq_len=32",
    "data.eval_sequences=8",
    "micro_batch_size=2",
    "max_steps=6",
    "eval_interval=3",
    "checkpoint.interval=2",
    "checkpoint.keep_last=null",
    "checkpoint.export_hf=false",
    "schedule.warmup_steps=2",
]


def _losses(run: Path | str) -> dict[int, float]:
    """Each step's loss in metrics.jsonl (a step run again after a resume: its last record)."""
    import fsspec

    with fsspec.open(f"{run}/metrics.jsonl", "r") as f:  # a path or a URL
        records = [json.loads(line) for line in f.read().splitlines()]
    return {int(r["step"]): float(r["loss"]) for r in records if "loss" in r}


@pytest.mark.slow  # 1.5 to 3.5 min on 2 shared cores, most of it Ray starting itself and the workers twice
def test_ray_train_example_resumes_after_a_worker_failure_with_an_uninterrupted_runs_loss(
    tmp_path: Path, s3_env: dict[str, str]
) -> None:
    """The run goes to an S3 bucket (moto's server on 127.0.0.1): the workers write their checkpoints
    there, the restarted ones resume from the one they left there, and the run ends as an
    uninterrupted local run does."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        # Everything on loopback: Ray's single-machine mode, gloo on lo.
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        GLOO_SOCKET_IFNAME="lo",
        RAY_DEDUP_LOGS="0",
        RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.25",  # sees the failure and the end sooner (default 2 s)
    )
    env.pop("RAY_ADDRESS", None)
    # The s3_env fixture's bucket, under a name of this test run's own: a run at a URL keeps its local copy
    # (and a `once` fault's marker) under the temporary directory, named after the URL.
    ray_run, reference = f"s3://fsdp-bridge-test/ray-run-{uuid.uuid4().hex[:12]}", tmp_path / "reference"
    # Worker 1 fails in step 4, after the checkpoint of step 2: Ray starts both workers again,
    # and the second attempt resumes from step 2 (resume: auto).
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "ray_train.py"),
            *TINY,
            f"output_dir={ray_run}",
            "--storage-path",
            str(tmp_path / "ray"),
            "--quiet",
        ],
        env={**env, "FSDP_BRIDGE_FAULT": "1:step:4:once"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "injected fault on rank 1 at step:4" in proc.stderr, proc.stderr[-6000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])["summary"]
    assert summary["steps"] == 6 and summary["resumed_from"] == f"{ray_run}/checkpoints/step_00000002", summary
    # The same job, uninterrupted, through fsdp-bridge train's own launcher (2 ranks).
    ref = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsdp_bridge",
            "train",
            *TINY,
            f"output_dir={reference}",
            "--nproc-per-node",
            "2",
            "--quiet",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ref.returncode == 0, ref.stderr[-4000:]
    expected, got = _losses(reference), _losses(ray_run)
    assert sorted(got) == sorted(expected) == list(range(1, 7))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), (step, got, expected)
    assert summary["final_loss"] == pytest.approx(
        json.loads((reference / "summary.json").read_text())["final_loss"], rel=1e-5
    )
