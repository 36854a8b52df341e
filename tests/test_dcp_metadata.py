"""DCP ``.metadata`` is read by a bounded interpreter, never unpickled: real metadata of every
shape DCP writes loads; hostile files (class mutation through BUILD, exponential hashing,
collisions, sharing, depth, size) are a CheckpointError naming the file, quickly, and leave the
process as it was. Hostile files are read in a child process with a timeout, so that a reader
that hangs or mutates a class fails the test without poisoning the test process."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path, PurePosixPath

import pytest
import torch

from fsdp_bridge._dcp_metadata import MetadataLimits, parse_dcp_metadata
from fsdp_bridge.checkpoint import CheckpointError
from fsdp_bridge.checkpoint._formats import load_dcp_metadata

# ---- a tiny pickle assembler (protocol 4 opcodes) -------------------------------------------


def s(text: str) -> bytes:  # SHORT_BINUNICODE
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def glob(module: str, name: str) -> bytes:  # STACK_GLOBAL
    return s(module) + s(name) + b"\x93"


def get(i: int) -> bytes:  # BINGET / LONG_BINGET
    return b"h" + bytes([i]) if i < 256 else b"j" + i.to_bytes(4, "little")


PROTO, STOP, MEMO = b"\x80\x04", b".", b"\x94"
EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE, NONE = b"}", b"]", b")", b"N"
TUPLE1, TUPLE2, MARK, TUPLE = b"\x85", b"\x86", b"(", b"t"
SETITEM, SETITEMS, APPEND, BUILD, REDUCE, NEWOBJ, POP = b"s", b"u", b"a", b"b", b"R", b"\x81", b"0"


def k(i: int) -> bytes:  # BININT1
    return b"K" + bytes([i])


def nested_tuple_key(depth: int) -> bytes:
    """A dict whose key is t_depth, t_{i+1} = (t_i, t_i) through the memo: 2**depth leaves."""
    body = k(0) + k(0) + TUPLE2 + MEMO
    for i in range(depth):
        body += POP + get(i) + get(i) + TUPLE2 + MEMO
    return PROTO + EMPTY_DICT + body + k(1) + SETITEM + STOP


CLASS_MUTATIONS = {
    # setattr on the class through BUILD's slot state: the attack on the path-escape check
    "slotstate_on_class": PROTO
    + glob("pathlib", "PosixPath")
    + NONE
    + EMPTY_DICT
    + s("is_relative_to")
    + glob("builtins", "slice")
    + SETITEM
    + TUPLE2
    + BUILD
    + STOP,
    "dict_state_on_class": PROTO
    + glob("pathlib", "PurePosixPath")
    + EMPTY_DICT
    + s("__str__")
    + glob("builtins", "slice")
    + SETITEM
    + BUILD
    + STOP,
    "build_on_dcp_class": PROTO
    + glob("torch.distributed.checkpoint.metadata", "Metadata")
    + NONE
    + EMPTY_DICT
    + s("__eq__")
    + glob("builtins", "slice")
    + SETITEM
    + TUPLE2
    + BUILD
    + STOP,
    # an enum member is a module-level singleton: REDUCE may return it, BUILD may not touch it
    "build_on_enum_member": PROTO
    + glob("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
    + k(0)
    + TUPLE1
    + REDUCE
    + NONE
    + EMPTY_DICT
    + s("value")
    + k(7)
    + SETITEM
    + TUPLE2
    + BUILD
    + STOP,
    "setitem_on_a_class": PROTO + glob("collections", "OrderedDict") + s("x") + k(1) + SETITEM + STOP,
}

CHILD = textwrap.dedent(
    """
    import pathlib, sys, time, torch
    from torch.distributed.checkpoint import metadata as m
    from fsdp_bridge.checkpoint import CheckpointError
    from fsdp_bridge.checkpoint._formats import load_dcp_metadata

    def snapshot():
        return (dict(vars(pathlib.PurePath)), dict(vars(pathlib.PosixPath)), dict(vars(pathlib.PurePosixPath)),
                dict(vars(m.Metadata)), m._MEM_FORMAT_ENCODING(0).value)

    for name in sys.argv[1:]:
        before = snapshot()
        start = time.monotonic()
        try:
            load_dcp_metadata(pathlib.Path(name))
            outcome = "loaded"
        except CheckpointError as err:
            outcome = "refused: " + " ".join(str(err).split())
        state = "unchanged" if before == snapshot() else "CHANGED"
        print(f"{outcome}\t{state}\t{time.monotonic() - start:.3f}", flush=True)
    """
)


def read_in_child(paths: list[Path], timeout: float = 60.0) -> list[tuple[str, str, float]]:
    """Read each of ``paths`` with load_dcp_metadata in one fresh process: (outcome,
    unchanged|CHANGED, seconds) for each. A hang is a test failure (TimeoutExpired), not a hung suite;
    a class changed by one file is seen before the next."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, paths)], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("\t") for line in proc.stdout.strip().splitlines()[-len(paths) :]]
    return [(outcome, state, float(seconds)) for outcome, state, seconds in rows]


def write(tmp_path: Path, data: bytes, name: str = "d") -> Path:
    (tmp_path / name).mkdir(exist_ok=True)
    (tmp_path / name / ".metadata").write_bytes(data)
    return tmp_path / name / ".metadata"


# ---- what DCP writes loads ---------------------------------------------------------------


def test_everything_dcp_writes_loads_equal_to_pickle(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {
        "w": torch.randn(3, 4),
        "h": torch.zeros(2, dtype=torch.bfloat16),
        "cl": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "scalar": torch.tensor(1.5),
        "step": 3,
        "nested": {"a": [1, 2, {"b": "text"}], "c": (4, 5)},
        "none": None,
    }
    for checkpoint_id in (str(tmp_path / "a"), tmp_path / "b"):  # a path is stored as a path
        dcp.save(state, checkpoint_id=checkpoint_id, no_dist=True)
        data = (Path(checkpoint_id) / ".metadata").read_bytes()
        parsed = load_dcp_metadata(Path(checkpoint_id) / ".metadata")
        trusted = pickle.loads(data)  # the bytes this test just wrote
        assert parsed.state_dict_metadata == trusted.state_dict_metadata
        assert parsed.storage_data == trusted.storage_data
        assert parsed.planner_data == trusted.planner_data
        assert parsed.version == trusted.version
        assert str(parsed.storage_meta.checkpoint_id) == str(trusted.storage_meta.checkpoint_id)
    assert isinstance(load_dcp_metadata(tmp_path / "b" / ".metadata").storage_meta.checkpoint_id, PurePosixPath)
    # The same metadata pickled again at every protocol DCP could use.
    for protocol in (2, 3, 4, 5):
        again = write(tmp_path, pickle.dumps(trusted, protocol=protocol))
        assert load_dcp_metadata(again).state_dict_metadata == trusted.state_dict_metadata


# ---- hostile files -------------------------------------------------------------------------


def test_metadata_can_never_change_a_class_or_shared_object(tmp_path: Path) -> None:
    names = sorted(CLASS_MUTATIONS)
    results = read_in_child([write(tmp_path, CLASS_MUTATIONS[n], n) for n in names])
    for name, (outcome, state, _) in zip(names, results, strict=True):
        assert state == "unchanged", (name, outcome)
        assert outcome.startswith("refused: checkpoint ") and ".metadata" in outcome, (name, outcome)


def test_the_path_escape_check_holds_after_a_hostile_metadata(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"this file did not create|refusing"):
        load_dcp_metadata(write(tmp_path, CLASS_MUTATIONS["slotstate_on_class"]))
    assert Path("/a/b").is_relative_to(Path("/a")) and not Path("/x").is_relative_to(Path("/a"))


def test_exponential_hashing_is_refused_within_seconds(tmp_path: Path) -> None:
    data = nested_tuple_key(100)  # pickle.loads hashes 2**100 tuples here: it never returns
    assert len(data) < 1024
    [(outcome, state, seconds)] = read_in_child([write(tmp_path, data)], timeout=60)
    assert "refused:" in outcome and "larger than 1024 values" in outcome, outcome
    assert state == "unchanged" and seconds < 5


def test_colliding_keys_are_refused(tmp_path: Path) -> None:
    prime = 2**61 - 1  # hash(n) == hash(n + prime): equal hashes make dict insertion quadratic
    data = pickle.dumps({5 + m * prime: 0 for m in range(20)}, protocol=4)
    with pytest.raises(CheckpointError, match=r"with one hash"):
        load_dcp_metadata(write(tmp_path, data))


def test_shared_and_cyclic_containers_are_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2), "v": torch.ones(2)}, checkpoint_id=str(tmp_path / "x"), no_dist=True)
    metadata = pickle.loads((tmp_path / "x" / ".metadata").read_bytes())
    metadata.state_dict_metadata["v"] = metadata.state_dict_metadata["w"]  # one object, two entries
    with pytest.raises(CheckpointError, match=r"occurs more than once"):
        load_dcp_metadata(write(tmp_path, pickle.dumps(metadata)))
    loop: list[object] = []
    loop.append(loop)
    metadata.state_dict_metadata["v"] = copy.deepcopy(metadata.state_dict_metadata["w"])
    metadata.planner_data = {"w": loop}
    with pytest.raises(CheckpointError, match=r"more than once"):
        load_dcp_metadata(write(tmp_path, pickle.dumps(metadata)))
    shared: tuple[object, ...] = (1,)
    for _ in range(12):
        shared = (shared,) * 50  # a few KB pickled; 50**12 paths when walked
    metadata.planner_data = {"w": ("model", "w"), "v": shared}
    with pytest.raises(CheckpointError, match=r"planner_data occurs more than once"):
        load_dcp_metadata(write(tmp_path, pickle.dumps(metadata)))
    deep: list[object] = []
    for _ in range(400):
        deep = [deep]
    metadata.planner_data = {"w": deep}
    with pytest.raises(CheckpointError, match=r"deeper than 16"):
        load_dcp_metadata(write(tmp_path, pickle.dumps(metadata)))


@pytest.mark.parametrize(
    "data,match",
    [
        (PROTO + glob("os", "system") + s("true") + TUPLE1 + REDUCE + STOP, r"refusing to load os\.system"),
        (PROTO + glob("torch", "Size") + s("x") + TUPLE1 + REDUCE + STOP, r"torch\.Size takes"),
        (PROTO + glob("torch.distributed.checkpoint.metadata", "Metadata") + TUPLE1 + STOP, r"not DCP|expected"),
        (PROTO + b"cos\nsystem\n" + STOP, r"refusing to load os\.system"),
        (PROTO + b"P1\n" + STOP, r"opcode PERSID"),
        (PROTO + b"\x8a\x20" + b"\x01" * 32 + STOP, r"wider than 16 bytes"),
        (PROTO + EMPTY_DICT + get(5) + STOP, r"memo entry 5 is used before"),
        (PROTO + EMPTY_TUPLE + EMPTY_LIST + APPEND + STOP, r"APPEND on a tuple"),
        (PROTO + k(1) + STOP, r"is a int, expected Metadata"),
        (
            PROTO + glob("torch.distributed.checkpoint.metadata", "Metadata") + EMPTY_TUPLE + NEWOBJ + MARK + STOP,
            r"exactly one",
        ),
    ],
)
def test_anything_but_dcp_metadata_is_refused(tmp_path: Path, data: bytes, match: str) -> None:
    with pytest.raises(CheckpointError, match=match) as err:
        load_dcp_metadata(write(tmp_path, data))
    assert ".metadata" in str(err.value) and "use another checkpoint" in str(err.value)


def test_build_sets_only_the_dataclass_fields(tmp_path: Path) -> None:
    data = (
        PROTO
        + glob("torch.distributed.checkpoint.metadata", "Metadata")
        + EMPTY_TUPLE
        + NEWOBJ
        + EMPTY_DICT
        + s("__class__")
        + k(1)
        + SETITEM
        + BUILD
        + STOP
    )
    with pytest.raises(CheckpointError, match=r"may only set its fields \(planner_data, state_dict_metadata"):
        load_dcp_metadata(write(tmp_path, data))


def test_an_oversized_metadata_file_is_refused_before_reading(tmp_path: Path) -> None:
    path = write(tmp_path, b"")
    with open(path, "wb") as f:  # sparse: 6 GiB on paper, nothing on disk
        f.truncate(6 << 30)
    with pytest.raises(CheckpointError, match=r"is 6442450944 bytes, over the 1073741824-byte limit"):
        load_dcp_metadata(path)
    with pytest.raises(CheckpointError, match=r"over the 10-byte limit"):
        parse_dcp_metadata(b"x" * 11, path, MetadataLimits(max_bytes=10))


# ---- a user's DCP directory read by the backends' FSDP1 loaders -----------------------------

LOADER_CHILD = textwrap.dedent(
    """
    import os, pathlib, sys, torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.tensor import distribute_tensor, init_device_mesh
    from fsdp_bridge.backends.fsdp1_objects import load_sharded_optimizer_state_dict
    from fsdp_bridge.errors import CheckpointError

    store = sys.argv[1]
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    plain = {"w": torch.zeros(2, 2)}
    sharded = {"w": distribute_tensor(torch.zeros(2, 2), mesh)}
    for name in sys.argv[2:]:
        for kind, model_state in (("plain", plain), ("dtensor", sharded)):
            before = dict(vars(pathlib.PosixPath))
            try:
                load_sharded_optimizer_state_dict(model_state, "optim", FileSystemReader(name))
                outcome = "loaded"
            except CheckpointError as err:
                outcome = "refused: " + " ".join(str(err).split())
            except Exception as err:
                outcome = "other: " + type(err).__name__
            state = "unchanged" if before == dict(vars(pathlib.PosixPath)) else "CHANGED"
            print(f"{kind}\\t{outcome}\\t{state}", flush=True)
    dist.destroy_process_group()
    os._exit(0)  # no interpreter finalisation: the gloo group's destructor can abort at exit (a torch teardown race)
    """
)


def test_the_fsdp1_optimizer_loader_never_unpickles_a_users_metadata(tmp_path: Path) -> None:
    """``load_sharded_optimizer_state_dict`` (what ``migrate code --fix`` writes) is handed torch's own
    ``FileSystemReader``, which unpickles ``.metadata``: a file naming ``os.system`` or setting an attribute
    on a class through BUILD is refused by the project's parser on both paths (FSDP1 tensors, FSDP2
    DTensors), and nothing runs or changes."""
    marker = tmp_path / "ran"
    command = f"touch {marker}"
    system = PROTO + glob("os", "system") + s(command) + TUPLE1 + REDUCE + STOP
    paths = [
        write(tmp_path, system, "system").parent,
        write(tmp_path, CLASS_MUTATIONS["slotstate_on_class"], "build").parent,
    ]
    proc = subprocess.run(
        [sys.executable, "-c", LOADER_CHILD, str(tmp_path / "store"), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("\t") for line in proc.stdout.strip().splitlines()[-4:]]
    assert [kind for kind, _, _ in rows] == ["plain", "dtensor"] * 2
    for (_, outcome, state), path in zip(rows, [paths[0], paths[0], paths[1], paths[1]], strict=True):
        assert outcome.startswith("refused: ") and str(path / ".metadata") in outcome, outcome
        assert state == "unchanged"
    assert not marker.exists(), "a command named in .metadata ran"
