"""Generated checkpoint descriptions (``fsdp_bridge.json``): load or CheckpointError, nothing else.

A real description, saved once, is mutated by hypothesis: a field replaced by any JSON value
(wrong types, huge and negative numbers, nested junk), a field removed, junk fields added,
the text truncated, random or non-UTF-8 bytes.  Everything that reads a description runs on
each: ``detect``, ``verify_manifest``, ``inspect_checkpoint`` and its text, ``read_full`` (what
``convert`` reads) and ``latest_checkpoint`` of the parent (what ``--resume`` uses, which skips
damaged siblings).  The only outcomes allowed are success and :class:`CheckpointError`.
``HYPOTHESIS_PROFILE=thorough`` runs more examples.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fsdp_bridge
from fsdp_bridge.checkpoint import CheckpointError, detect, inspect_checkpoint, latest_checkpoint
from fsdp_bridge.checkpoint._convert import read_full
from fsdp_bridge.checkpoint._formats import META_FILE, verify_manifest
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
    @given(data=_mutations(meta))
    def check(data: bytes) -> None:
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
