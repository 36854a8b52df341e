"""``fsdp-bridge migrate code`` bounds every file before libcst parses it: a file nesting 1,500
calls (libcst's native parser overflows its stack on it: a segmentation fault) and a 50 MB file
(it exhausts memory) are reported as skipped, with the bound and the fix, and the other files of
the tree are still migrated."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_bridge.migrate.limits import MAX_INDENT, MAX_NESTING, SourceLimitError, read_source

FIXTURES = Path(__file__).parent / "fixtures" / "migrate"


def test_a_deep_and_a_huge_file_are_skipped_and_the_rest_migrated(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(FIXTURES / "grad_accum.py", tree / "a.py")
    (tree / "deep.py").write_text("x = " + "f(" * 1500 + "1" + ")" * 1500 + "\n")
    with open(tree / "huge.py", "wb") as f:
        f.truncate(50_000_000)  # sparse: 50 MB by its size, never read
    cli = [sys.executable, "-m", "fsdp_bridge", "migrate", "code", str(tree)]
    out = subprocess.run(cli, capture_output=True, text=True, check=False, timeout=300)
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)  # findings and skipped files: not a crash
    assert f"{tree / 'deep.py'}: [skipped] brackets nested more than {MAX_NESTING} deep" in out.stdout
    assert f"{tree / 'huge.py'}: [skipped] 50,000,000 bytes, over the codemod's limit" in out.stdout
    assert f"{tree / 'a.py'}" in out.stdout and "Traceback" not in out.stderr


def test_the_bounds_count_tokens_not_text(tmp_path: Path) -> None:
    ok = tmp_path / "ok.py"
    ok.write_text(
        's = "' + "(" * 5000 + '"  # ' + "[" * 5000 + "\nx = " + "f(" * MAX_NESTING + ")" * MAX_NESTING + "\n"
    )
    assert read_source(ok).startswith("s = ")
    deep_blocks = tmp_path / "blocks.py"
    deep_blocks.write_text(
        "".join(" " * i + "if a:\n" for i in range(MAX_INDENT + 1)) + " " * (MAX_INDENT + 1) + "pass\n"
    )
    with pytest.raises(SourceLimitError, match=f"blocks indented more than {MAX_INDENT} levels deep"):
        read_source(deep_blocks)


def test_a_file_with_crlf_line_endings_keeps_them_when_rewritten(tmp_path: Path) -> None:
    """Only the lines the codemod changes differ: a CRLF file is not turned into an LF one."""
    from fsdp_bridge.migrate._code import migrate_paths

    lines = [
        "import torch",
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP",
        "",
        "",
        "def wrap(net: torch.nn.Module) -> torch.nn.Module:",
        "    return FSDP(net)",
        "",
    ]
    path = tmp_path / "crlf.py"
    path.write_bytes("\r\n".join(lines).encode())
    assert read_source(path) == "\r\n".join(lines)
    migrate_paths([tmp_path], fix=True)
    written = path.read_bytes().decode()
    assert "fsdp_bridge.shard(net" in written and "FSDP(" not in written, written
    assert written.count("\n") == written.count("\r\n") > 0, written
    migrate_paths([tmp_path], fix=True)
    assert path.read_bytes().decode() == written
