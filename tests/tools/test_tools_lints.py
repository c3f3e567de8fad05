"""read_lints: tree-sitter syntax errors (Python, JavaScript) and ruff findings, overlay-aware."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from pathlib import Path

import pytest
from opencomposer.tools import lints, specs
from opencomposer.tools.protocols import ToolContext, ToolResult
from opencomposer.tools.workspace import LocalWorkspace


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src" / "ok.py").write_text("def f(x):\n    return x\n")
    (root / "src" / "unused.py").write_text("import os\n\nvalue = 1\n")
    (root / "web").mkdir()
    (root / "web" / "app.js").write_text("function f( {\n  return 1;\n}\n")
    (root / "README.md").write_text("# hi\n")
    # The workspace's own ruff configuration applies (this ruff's defaults also sort imports).
    (root / "ruff.toml").write_text('[lint]\nselect = ["E9", "F"]\n')
    return ToolContext(workspace=LocalWorkspace(root))


async def call(ctx: ToolContext, **raw: str) -> ToolResult:
    spec = specs.get("read_lints")
    return await spec.run(ctx, spec.validate(raw))


def test_every_mapped_language_has_a_parser_offline() -> None:
    assert lints.detect_language("a/b.py") == "python"
    assert lints.detect_language("x/Makefile") == "make"
    assert lints.detect_language("notes.unknownext") is None
    missing = [lang for lang in lints._EXTENSIONS if lints.get_parser(lang) is None]
    assert missing == []
    assert lints.get_parser("no-such-language") is None
    assert lints.find_ruff() is not None


def test_syntax_errors_report_line_and_column() -> None:
    parser = lints.get_parser("python")
    found = lints.syntax_errors("x.py", "def f(:\n    pass\n\nx = (1,\n", parser)
    assert found, "a broken file must give diagnostics"
    assert all(d.message.startswith("syntax error") for d in found)
    assert found[0].line == 1
    assert lints.syntax_errors("x.py", "def f():\n    pass\n", parser) == []


async def test_read_lints_whole_workspace(ctx: ToolContext) -> None:
    r = await call(ctx)
    assert r.status == "ok"
    lines = r.output.splitlines()
    assert lines[0] == "2 problems in 2 files (4 files checked)"
    assert "src/unused.py:1:8: F401 `os` imported but unused (ruff)" in lines
    assert any(line.startswith("web/app.js:1:") and "syntax error" in line for line in lines)


async def test_read_lints_python_syntax_error_reported_once(ctx: ToolContext) -> None:
    (ctx.workspace.root / "src" / "broken.py").write_text("def g(:\n    pass\n")
    r = await call(ctx, paths="src/broken.py")
    lines = r.output.splitlines()
    assert " in 1 file (1 file checked)" in lines[0], r.output
    assert all(ln.startswith("src/broken.py:1:") and ln.endswith("(ruff)") for ln in lines[1:])


async def test_read_lints_uses_the_open_buffer(ctx: ToolContext) -> None:
    ctx.workspace.buffers["src/ok.py"] = "import sys\ndef f(x):\n    return x\n"  # type: ignore[attr-defined]
    ctx.workspace.buffers["web/app.js"] = "function f() { return 1; }\n"  # type: ignore[attr-defined]
    r = await call(ctx, paths="src/ok.py web/app.js")
    assert r.output.splitlines()[1:] == ["src/ok.py:1:8: F401 `sys` imported but unused (ruff)"]


async def test_read_lints_clean_and_errors(ctx: ToolContext) -> None:
    r = await call(ctx, paths="src/ok.py")
    assert r.status == "ok" and r.output == "no problems found (1 file checked)"
    r = await call(ctx, paths="missing.py")
    assert r.status == "error" and "path not found: missing.py" in r.output
    r = await call(ctx, paths="../x")
    assert r.status == "error" and "outside the workspace" in r.output


async def test_read_lints_without_ruff_still_checks_syntax(
    ctx: ToolContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lints, "find_ruff", lambda: None)
    (ctx.workspace.root / "src" / "broken.py").write_text("def g(:\n    pass\n")
    r = await call(ctx, paths="src")
    assert "src/broken.py:1:" in r.output and "ruff is not installed" in r.output
    assert "F401" not in r.output


# -- issue 19: ruff runs on the host, so nothing may turn the check into a change ------


async def test_read_lints_never_changes_a_file(ctx: ToolContext) -> None:
    """Issue 19 item 1: ruff runs unsandboxed and read_lints is auto-approved; a
    workspace `ruff.toml` with `fix = true` made it rewrite files. Paths named like
    ruff options (`--fix.py`) stay paths."""
    root = ctx.workspace.root
    (root / "ruff.toml").write_text(
        'fix = true\nunsafe-fixes = true\n[lint]\nselect = ["E9", "F"]\n'
    )
    for name in ["--fix.py", "-x.py", "src/unused.py"]:
        (root / name).write_text("import os\n\nvalue = 1\n")
    r = await call(ctx, paths="--fix.py -x.py src")
    assert r.status == "ok", r.output
    for name in ["--fix.py", "-x.py", "src/unused.py"]:
        assert f"{name}:1:8: F401 `os` imported but unused (ruff)" in r.output
        assert (root / name).read_text() == "import os\n\nvalue = 1\n"
    assert not (root / ".ruff_cache").exists()


async def test_read_lints_refuses_a_fifo_and_skips_it_in_folders(ctx: ToolContext) -> None:
    """Issue 19 item 10: a FIFO named `x.py` blocked the parser and ruff."""
    fifo = ctx.workspace.root / "src" / "pipe.py"
    os.mkfifo(fifo)
    out: list[ToolResult] = []

    def run(raw: dict[str, str]) -> ToolResult:
        worker = threading.Thread(target=lambda: out.append(asyncio.run(call(ctx, **raw))))
        worker.daemon = True
        worker.start()
        worker.join(30)
        if worker.is_alive():
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            pytest.fail("read_lints blocked on a FIFO")
        return out.pop()

    r = run(dict(paths="src/pipe.py"))
    assert r.status == "error" and "not a regular file" in r.output
    r = run(dict(paths="src"))
    assert r.status == "ok" and "src/unused.py:1:8: F401" in r.output and "pipe" not in r.output
