"""Generated checkpoint descriptions (``fsdp_bridge.json``): load or CheckpointError, nothing else.

A real description, saved once, is mutated by hypothesis: a field replaced by any JSON value
(wrong types, huge and negative numbers, nested junk), a field removed, junk fields added,
the text truncated, random or non-UTF-8 bytes.  Everything that reads a description runs on
each: ``detect``, ``verify_manifest``, ``inspect_checkpoint`` and its text, ``read_full`` (what
``convert`` reads) and ``latest_checkpoint`` of the parent (what ``--resume`` uses, which skips
damaged siblings).  The only outcomes allowed are success and :class:`CheckpointError`.
Half the mutated descriptions are sealed again (their ``description_sha256`` recomputed, as a
careless tool or an attacker would) so that the checks behind the seal are exercised too.

DCP's ``.metadata`` of a real save is mutated the same way (flipped bits, replaced, inserted
and removed bytes, truncation) and replaced by generated hostile pickles (globals, BUILD,
SETITEM, memo references, nested tuples as keys); each is read by ``load_dcp_metadata`` and
``inspect_checkpoint`` within a time bound per case (a case over it fails; a hang in C is ended
by pytest-timeout's thread method), and no class reachable from the parser may change.
``HYPOTHESIS_PROFILE=thorough`` runs more examples.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fsdp_bridge
from fsdp_bridge.checkpoint import CheckpointError, detect, inspect_checkpoint, latest_checkpoint
from fsdp_bridge.checkpoint._convert import read_full
from fsdp_bridge.checkpoint._formats import META_FILE, description_digest, load_dcp_metadata, verify_manifest
from fsdp_bridge.cli.inspect import format_info
from fsdp_bridge.testing.models import build_tiny

EXAMPLES = 3000 if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else 300

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("fuzz")
    model = build_tiny("llama", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fsdp_bridge.save_checkpoint(root / "step_1", model, optimizer, kind="full", state={"step": 1})
    return root / "step_1", json.loads((root / "step_1" / META_FILE).read_text())


def _mutations(meta: dict[str, Any]) -> st.SearchStrategy[bytes]:
    keys = sorted(meta)

    def replace(args: tuple[str, Any]) -> bytes:
        key, value = args
        return json.dumps({**meta, key: value}).encode()

    def drop(key: str) -> bytes:
        return json.dumps({k: v for k, v in meta.items() if k != key}).encode()

    def nested(args: tuple[str, str, Any]) -> bytes:  # junk one level down (files, digests, params, ...)
        key, sub, value = args
        inner = meta[key] if isinstance(meta[key], dict) else {}
        return json.dumps({**meta, key: {**inner, sub: value}}).encode()

    def truncate(at: int) -> bytes:
        text = json.dumps(meta).encode()
        return text[: at % len(text)]

    def non_utf8(args: tuple[int, bytes]) -> bytes:
        at, junk = args
        text = json.dumps(meta).encode()
        at %= len(text)
        return text[:at] + b"\xff\xfe" + junk + text[at:]

    sub_keys = st.sampled_from(
        ["model.safetensors", "optimizer.json", "../escape", "/etc/passwd", "numel", "kind", "path", "x" * 300]
    )
    return st.one_of(
        st.tuples(st.sampled_from(keys), json_values).map(replace),
        st.sampled_from(keys).map(drop),
        st.tuples(st.sampled_from([k for k in keys if isinstance(meta[k], dict)] or keys), sub_keys, json_values).map(
            nested
        ),
        st.dictionaries(st.text(max_size=8), json_values, max_size=3).map(
            lambda extra: json.dumps({**meta, **extra}).encode()
        ),
        st.integers(min_value=0, max_value=10**6).map(truncate),
        st.tuples(st.integers(min_value=0, max_value=10**6), st.binary(max_size=8)).map(non_utf8),
        st.binary(max_size=64),
        json_values.map(lambda v: json.dumps(v).encode()),
    )


def _read_everything(path: Path) -> None:
    detected = detect(path)
    if detected.kind.value in ("sharded", "full"):
        verify_manifest(detected)
    format_info(inspect_checkpoint(path))
    read_full(path)


def test_generated_descriptions_load_or_raise_checkpoint_error(
    saved: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    source, meta = saved
    root = tmp_path_factory.mktemp("mutated")
    target = root / "step_2"
    shutil.copytree(source, target)
    logger = logging.getLogger("fsdp_bridge")
    level = logger.level
    logger.setLevel(logging.ERROR)  # latest_checkpoint warns about each skip (restored below)
    outcomes = {"loaded": 0, "refused": 0}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=_mutations(meta), seal=st.booleans())
    def check(data: bytes, seal: bool) -> None:
        if seal:
            try:
                parsed = json.loads(data)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                data = json.dumps({**parsed, "description_sha256": description_digest(parsed)}).encode()
        (target / META_FILE).write_bytes(data)
        try:
            _read_everything(target)
            outcomes["loaded"] += 1
        except CheckpointError as err:
            assert str(target) in str(err) or err.path.startswith(str(target)), err
            outcomes["refused"] += 1
        found = latest_checkpoint(root)  # a damaged description is skipped, never raised
        assert found in (None, target)

    try:
        check()
    finally:
        logger.setLevel(level)
    # Both outcomes occur: the mutations are not all rejected by the first check.
    print(outcomes)
    assert outcomes["loaded"] > 0 and outcomes["refused"] > 0, outcomes


# ---- DCP .metadata ----------------------------------------------------------------------

CASE_SECONDS = 2.0
"""The time bound per case: the largest real metadata here parses in milliseconds."""


@pytest.fixture(scope="module")
def dcp_saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz_dcp")
    model = build_tiny("llama", seed=0)
    fsdp_bridge.save_checkpoint(root / "step_1", model, torch.optim.AdamW(model.parameters()), state={"step": 1})
    return root / "step_1" / "dcp"


def _metadata_mutations(original: bytes) -> st.SearchStrategy[bytes]:
    n = len(original)
    positions = st.integers(min_value=0, max_value=n - 1)

    def flip(args: tuple[list[int], int]) -> bytes:
        at, bit = args
        data = bytearray(original)
        for i in at:
            data[i] ^= 1 << bit
        return bytes(data)

    def replace(args: tuple[int, bytes]) -> bytes:
        at, junk = args
        return original[:at] + junk + original[at + len(junk) :]

    def insert(args: tuple[int, bytes]) -> bytes:
        at, junk = args
        return original[:at] + junk + original[at:]

    def remove(args: tuple[int, int]) -> bytes:
        at, length = args
        return original[:at] + original[at + length :]

    return st.one_of(
        st.tuples(st.lists(positions, min_size=1, max_size=4), st.integers(0, 7)).map(flip),
        st.tuples(positions, st.binary(min_size=1, max_size=16)).map(replace),
        st.tuples(positions, st.binary(min_size=1, max_size=16)).map(insert),
        st.tuples(positions, st.integers(1, 64)).map(remove),
        positions.map(lambda at: original[:at]),
    )


def _s(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


_GLOBALS = [
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch", "float32"),
    ("collections", "OrderedDict"),
    ("builtins", "slice"),
    ("builtins", "set"),
    ("builtins", "getattr"),
    ("os", "system"),
    ("torch.distributed.checkpoint.filesystem", "os.system"),
]
# One protocol-4 opcode (with its argument) per entry: a random program over them is a hostile pickle.
_PIECES = st.one_of(
    st.sampled_from(_GLOBALS).map(lambda g: _s(g[0]) + _s(g[1]) + b"\x93"),
    st.sampled_from([b"N", b"\x88", b"\x89", b")", b"]", b"}", b"(", b"t", b"\x85", b"\x86", b"\x87"]),
    st.sampled_from([b"b", b"s", b"u", b"a", b"e", b"R", b"\x81", b"\x94", b"0", b"2", b"1", b"l", b"d"]),
    st.integers(0, 255).map(lambda i: b"K" + bytes([i])),
    st.integers(0, 40).map(lambda i: b"h" + bytes([i])),
    st.sampled_from(["is_relative_to", "__class__", "__dict__", "state_dict_metadata", "fqn", "x"]).map(_s),
)


def _hostile_pickles() -> st.SearchStrategy[bytes]:
    def nested_key(depth: int) -> bytes:  # the exponential-hashing shape, at a random depth
        body = b"K\x00K\x00\x86\x94"
        for i in range(depth):
            body += b"0h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94"
        return b"\x80\x04}" + body + b"K\x01s."

    return st.one_of(
        st.lists(_PIECES, min_size=1, max_size=40).map(lambda ops: b"\x80\x04" + b"".join(ops) + b"."),
        st.integers(10, 200).map(nested_key),
    )


def _class_state() -> tuple[object, ...]:
    from torch.distributed.checkpoint import metadata as m

    return tuple(
        dict(vars(c))
        for c in (
            pathlib.PurePath,
            pathlib.PosixPath,
            pathlib.PurePosixPath,
            m.Metadata,
            m.MetadataIndex,
            m.TensorProperties,
        )
    )


@pytest.mark.timeout(600, method="thread")  # a hang inside C (hashing) cannot be interrupted otherwise
def test_generated_dcp_metadata_loads_or_raises_checkpoint_error_in_bounded_time(
    dcp_saved: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    original = (dcp_saved / ".metadata").read_bytes()
    target = tmp_path_factory.mktemp("mutated_dcp") / "dcp"
    shutil.copytree(dcp_saved, target)
    before = _class_state()
    outcomes = {"loaded": 0, "refused": 0}
    slowest = [0.0]

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.one_of(_metadata_mutations(original), _hostile_pickles()))
    def check(data: bytes) -> None:
        (target / ".metadata").write_bytes(data)
        start = time.monotonic()
        try:
            load_dcp_metadata(target / ".metadata")
            format_info(inspect_checkpoint(target))
            outcomes["loaded"] += 1
        except CheckpointError as err:
            assert ".metadata" in str(err) or str(target) in str(err), err
            outcomes["refused"] += 1
        seconds = time.monotonic() - start
        slowest[0] = max(slowest[0], seconds)
        assert seconds < CASE_SECONDS, (seconds, data[:200])
        assert _class_state() == before, data[:200]

    check()
    print(outcomes, f"slowest case {slowest[0]:.3f} s")
    assert outcomes["refused"] > 0, outcomes
