"""What ``migrate code --fix`` writes for state dicts, summon, constructor arguments and wrap policies:
FSDP1's meaning kept, or a TODO saying why (one-process tests of ``migrate_source``)."""

from __future__ import annotations

from pathlib import Path

from fsdp_bridge.migrate._code import TODO, migrate_source

FIXTURES = Path(__file__).parent / "fixtures" / "migrate" / "precision"


def _fix(name: str) -> str:
    path = FIXTURES / name
    fixed = migrate_source(path.read_text(), str(path)).fixed
    compile(fixed, str(path), "exec")
    assert migrate_source(fixed, str(path)).fixed == fixed  # idempotent
    return fixed


def _between(code: str, start: str, end: str | None = None) -> str:
    tail = code[code.index(start) :]
    return tail if end is None else tail[: tail.index(end)]


def test_backward_prefetch_none_keeps_fsdp1_meaning_without_todo() -> None:
    fixed = _fix("prefetch_none.py")
    static = _between(fixed, "def build_plain", "def build_post")
    assert 'backward_prefetch="none"' in static and TODO not in static
    runtime = _between(fixed, "def build_runtime")
    assert 'backward_prefetch="none"' in runtime and TODO not in runtime
    post = _between(fixed, "def build_post", "def build_runtime")
    assert 'backward_prefetch="pre"' in post and TODO in post  # BACKWARD_POST has no FSDP2 order
    assert "refused on FSDP2" not in "\n".join(
        f.replacement for f in migrate_source((FIXTURES / "prefetch_none.py").read_text()).findings
    )
