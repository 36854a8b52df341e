"""The schema engine (fsdp_bridge/_schema.py): one declaration per field drives parsing, errors and docs."""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from fsdp_bridge import BridgeConfig
from fsdp_bridge._schema import (
    Check,
    at_least,
    check_problems,
    checks,
    describe,
    field_rows,
    field_spec,
    hints,
    normalise,
    parse_layout,
    parse_section,
    spec,
)
from fsdp_bridge.errors import ConfigError, Problem
from fsdp_bridge.train import field_reference

ROOT = Path(__file__).resolve().parents[1]


def _parse_colour(value: Any, key: str, problems: list[Problem]) -> str:
    if value not in ("red", "blue"):
        raise ValueError(value)
    return str(value)


@dataclass(frozen=True, kw_only=True)
class Inner:
    size: int = field(default=2, metadata=checks(at_least(1)))
    """How many."""
    kind: Literal["a", "b"] = "a"
    """Which one."""


@dataclass(frozen=True, kw_only=True)
class Outer:
    name: str = "x"
    """The name."""
    inner: Inner = field(default_factory=Inner)
    """A section."""
    maybe: Inner | None = None
    """A section that may be null."""
    colour: str = field(default="red", metadata=spec("red or blue", _parse_colour, summary="a colour", fix="paint"))
    """The colour."""
    files: tuple[str, ...] = field(default=("a",), metadata=checks(Check(bool, "at least one file")))
    """Files."""
    limit: int | None = field(default=None, metadata=checks(at_least(1, optional=True)))
    """An optional limit."""


@dataclass(frozen=True, kw_only=True)
class Normalised:
    colour: str = field(default="red", metadata=spec("red or blue", _parse_colour))
    """The colour."""
    count: int = 1
    """A count."""

    def __post_init__(self) -> None:
        problems: list[Problem] = []
        normalise(self, problems)
        if problems:
            raise ConfigError(problems)


def test_a_mapping_is_read_with_every_problem_collected_under_dotted_keys() -> None:
    problems: list[Problem] = []
    data = {"nmae": 1, "inner": {"size": "x", "knd": "a"}, "colour": "green", "maybe": None, "files": "one"}
    kwargs = parse_section(Outer, data, problems, elsewhere={"inner.knd": "inner.kind"})
    assert [str(p) for p in problems] == [
        "nmae: got 1; allowed: known keys are name, inner, maybe, colour, files, limit. Fix: unknown key; "
        "did you mean 'name'?",
        "inner.size: got 'x'; allowed: an integer",
        "inner.knd: got 'a'; allowed: known keys are size, kind. Fix: unknown key; did you mean 'inner.kind'?",
        "colour: got 'green'; allowed: red or blue. Fix: paint",
    ]
    assert kwargs == {"inner": Inner(), "maybe": None, "files": ("one",)}  # a single file needs no list
    problems.clear()
    assert parse_section(Outer, {"inner": [1], "maybe": {"kind": "b"}}, problems) == {"maybe": Inner(kind="b")}
    assert [str(p) for p in problems] == ["inner: got [1]; allowed: a mapping of size, kind"]


def test_a_section_that_reads_itself_reports_under_its_key() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Job:
        bridge: BridgeConfig = field(default_factory=BridgeConfig)
        """The bridge."""

    problems: list[Problem] = []
    parse_section(Job, {"bridge": {"strategy": "zero3", "devise": "cpu"}}, problems)
    assert {p.key for p in problems} == {"bridge.strategy", "bridge.devise"}


def test_value_rules_skip_null_show_lists_and_walk_sections() -> None:
    assert check_problems(Outer()) == []
    found = check_problems(Outer(inner=Inner(size=0), files=(), limit=0), "job.")
    assert [str(p) for p in found] == [
        "job.inner.size: got 0; allowed: an integer >= 1",
        "job.files: got []; allowed: at least one file",
        "job.limit: got 0; allowed: null or an integer >= 1",
    ]


def test_python_spellings_are_normalised_once_and_a_bad_one_is_reported() -> None:
    assert Normalised(colour="blue").colour == "blue"
    with pytest.raises(ConfigError) as info:
        Normalised(colour="green", count="3")  # type: ignore[arg-type]
    assert [str(p) for p in info.value.problems] == [
        "colour: got 'green'; allowed: red or blue",
        "count: got '3'; allowed: an integer",
    ]


def test_a_flat_config_reads_its_fields_from_their_yaml_places() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Flat:
        seq_len: int = field(default=4, metadata=spec("an integer", at="data.seq_len"))
        """Tokens."""
        lr: float = field(default=1.0, metadata=spec("a number", at="optim.lr"))
        """Rate."""
        seed: int = 0
        """Seed."""

    problems: list[Problem] = []
    data = {"data": {"seq_len": 8, "seqlen": 1}, "optim": None, "seed": 1, "compare": {}}
    assert parse_layout(Flat, data, problems) == {"seq_len": 8, "seed": 1}
    assert [p.key for p in problems] == ["data.seqlen", "compare"]
    assert "did you mean 'seq_len'?" in problems[0].fix and "known keys are data, optim, seed" in problems[1].allowed
    problems.clear()
    assert parse_layout(Flat, {"optim": 3}, problems) == {}
    assert [str(p) for p in problems] == ["optim: got 3; allowed: a mapping of lr"]


def test_docs_rows_come_from_the_declarations() -> None:
    rows = {r.key: (r.type, r.default, r.doc) for r in field_rows(Outer)}
    assert rows["name"] == ("a string", "x", "The name.")
    assert rows["inner"] == ("section", "", "A section.")
    assert rows["inner.kind"] == ("one of a, b", "a", "Which one.")
    assert rows["maybe"] == ("section or null", "null", "A section that may be null.")
    assert rows["maybe.size"] == ("an integer", "2", "How many.")
    assert rows["colour"] == ("a colour", "red", "The colour.")  # the declared summary, not the parser's text
    assert rows["files"] == ("a list of strings", "[a]", "Files.")


def test_the_training_reference_describes_bridge_fields_from_the_bridge_declarations() -> None:
    rows = {r.key: r for r in field_reference()}
    types = hints(BridgeConfig)
    for f in dataclasses.fields(BridgeConfig):
        declared = field_spec(f)
        expected = describe(types[f.name]) if declared is None else (declared.summary or declared.allowed)
        row = rows[f"bridge.{f.name}"]
        assert row.type == expected, f.name
        assert row.doc, f"BridgeConfig.{f.name} needs a docstring"
    assert rows["bridge.device"].type == "one of auto, cuda, cpu"
    assert rows["bridge.cpu_offload"].type == "true or false"


def test_bridge_constructor_signature_names_every_field_in_order() -> None:
    tree = ast.parse((ROOT / "fsdp_bridge" / "config.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BridgeConfig")
    guard = next(n for n in cls.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    init = next(n for n in guard.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert [a.arg for a in init.args.kwonlyargs] == BridgeConfig.field_names()
    assert not init.args.args[1:], "fields are keyword-only"


def _lines(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def test_the_readme_python_blocks_are_the_ones_mypy_checks() -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    checked = _lines((ROOT / "tests" / "typing" / "readme_snippets.py").read_text())
    assert blocks
    for block in blocks:
        want = _lines(block)
        starts = [i for i, line in enumerate(checked) if line == want[0]]
        assert any(checked[i : i + len(want)] == want for i in starts), (
            f"README block not in tests/typing/readme_snippets.py (copy it into a readme_block_N):\n{block}"
        )
