"""read_file, edit_file (the match ladder and its errors), write_file, delete_file, list_dir,
driven through the declared specs exactly as the session executor runs them."""

from __future__ import annotations

from pathlib import Path

import pytest
from opencomposer.tools import specs
from opencomposer.tools.protocols import ToolContext, ToolResult
from opencomposer.tools.workspace import LocalWorkspace

APP = """import os


def add(a, b):
    return a - b


class Calc:
    def mul(self, a, b):
        result = a * b
        return result
"""


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.py").write_text(APP)
    changed: list[str] = []
    c = ToolContext(workspace=LocalWorkspace(root), on_file_changed=changed.append)
    c.changed = changed  # type: ignore[attr-defined]
    return c


async def call(ctx: ToolContext, name: str, **raw: str) -> ToolResult:
    spec = specs.get(name)
    return await spec.run(ctx, spec.validate(raw))


def disk(ctx: ToolContext, path: str) -> str:
    return (ctx.workspace.root / path).read_text()


# -- read_file -----------------------------------------------------------------


async def test_read_file_numbers_lines(ctx: ToolContext) -> None:
    r = await call(ctx, "read_file", path="src/app.py")
    assert r.status == "ok"
    assert r.output.splitlines()[3] == "    4\tdef add(a, b):"
    assert r.meta["lines"] == 11


async def test_read_file_range_and_footer(ctx: ToolContext) -> None:
    r = await call(ctx, "read_file", path="src/app.py", start_line="4", end_line="5")
    assert r.output == "    4\tdef add(a, b):\n    5\t    return a - b\n[lines 4-5 of 11]"
    r = await call(ctx, "read_file", path="src/app.py", start_line="10", end_line="99")
    assert r.status == "ok" and "   11\t        return result" in r.output


@pytest.mark.parametrize(
    ("start", "end", "message"),
    [
        ("0", "3", "start_line must be 1 or more"),
        ("50", "60", "start_line 50 is past the end of src/app.py, which has 11 lines"),
        ("5", "2", "end_line 2 is before start_line 5"),
    ],
)
async def test_read_file_bad_ranges(ctx: ToolContext, start: str, end: str, message: str) -> None:
    r = await call(ctx, "read_file", path="src/app.py", start_line=start, end_line=end)
    assert r.status == "error" and message in r.output


async def test_read_file_bad_paths(ctx: ToolContext, tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("s3cret")
    (ctx.workspace.root / "link").symlink_to(tmp_path / "secret.txt")
    (ctx.workspace.root / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    for path, message in [
        ("../secret.txt", "outside the workspace"),
        ("/etc/passwd", "is absolute"),
        ("link", "outside the workspace"),
        ("missing.py", "file not found: missing.py"),
        ("src", "is a directory; use list_dir"),
        ("img.png", "binary file"),
    ]:
        r = await call(ctx, "read_file", path=path)
        assert r.status == "error", path
        assert message in r.output and "s3cret" not in r.output
        assert "\n" not in r.output


async def test_read_file_sees_the_open_buffer(ctx: ToolContext) -> None:
    ctx.workspace.buffers["src/app.py"] = "unsaved = True\n"  # type: ignore[attr-defined]
    r = await call(ctx, "read_file", path="src/app.py")
    assert r.output == "    1\tunsaved = True"


async def test_read_file_caps_huge_files_and_says_how_to_continue(ctx: ToolContext) -> None:
    (ctx.workspace.root / "big.txt").write_text("".join(f"row {i}\n" for i in range(10_000)))
    (ctx.workspace.root / "wide.txt").write_text("x" * 50_000 + "\n")
    r = await call(ctx, "read_file", path="big.txt")
    assert "showing lines 1-2000 of 10000" in r.output and "start_line=2001" in r.output
    r = await call(ctx, "read_file", path="wide.txt")
    assert "line cut, 50000 characters" in r.output and len(r.output) < 3000


async def test_read_empty_file(ctx: ToolContext) -> None:
    (ctx.workspace.root / "empty.txt").write_text("")
    r = await call(ctx, "read_file", path="empty.txt")
    assert r.status == "ok" and "empty" in r.output


# -- edit_file -----------------------------------------------------------------


async def test_edit_exact(ctx: ToolContext) -> None:
    r = await call(ctx, "edit_file", path="src/app.py", old="return a - b", new="return a + b")
    assert r.status == "ok", r.output
    assert "return a + b" in disk(ctx, "src/app.py")
    assert "exact match" in r.output
    (edit,) = r.edits
    assert (
        edit.path == "src/app.py" and edit.before == APP and edit.after == disk(ctx, "src/app.py")
    )
    assert "-    return a - b\n+    return a + b\n" in edit.diff
    assert ctx.changed == ["src/app.py"]  # type: ignore[attr-defined]


async def test_edit_ignoring_trailing_whitespace(ctx: ToolContext) -> None:
    r = await call(
        ctx,
        "edit_file",
        path="src/app.py",
        old="def add(a, b):   \n    return a - b  ",
        new="def add(a, b):\n    return a + b",
    )
    assert r.status == "ok", r.output
    assert "trailing whitespace" in r.output
    assert "def add(a, b):\n    return a + b\n" in disk(ctx, "src/app.py")


async def test_edit_ignoring_indentation_reindents_new(ctx: ToolContext) -> None:
    old = "def mul(self, a, b):\n    result = a * b\n    return result"
    new = "def mul(self, a, b):\n    if a == 0:\n        return 0\n    return a * b"
    r = await call(ctx, "edit_file", path="src/app.py", old=old, new=new)
    assert r.status == "ok", r.output
    assert "ignoring indentation" in r.output and "+4 columns" in r.output
    assert disk(ctx, "src/app.py").endswith(
        "    def mul(self, a, b):\n        if a == 0:\n            return 0\n        return a * b\n"
    )


async def test_edit_with_whitespace_collapsed(ctx: ToolContext) -> None:
    r = await call(
        ctx, "edit_file", path="src/app.py", old="result  =  a *   b", new="result = b * a"
    )
    assert r.status == "ok", r.output
    assert "whitespace differences" in r.output
    assert "        result = b * a\n" in disk(ctx, "src/app.py")


async def test_edit_tolerates_newlines_around_children(ctx: ToolContext) -> None:
    r = await call(ctx, "edit_file", path="src/app.py", old="\nimport os\n\n", new="\nimport sys\n")
    assert r.status == "ok", r.output
    assert disk(ctx, "src/app.py").startswith("import sys\n")


async def test_edit_not_found_shows_closest_lines(ctx: ToolContext) -> None:
    before = disk(ctx, "src/app.py")
    r = await call(
        ctx, "edit_file", path="src/app.py", old="def add(x, y):\n    return x - y", new="z"
    )
    assert r.status == "error"
    assert "old text not found" in r.output
    assert "lines 4-5" in r.output and "    4\tdef add(a, b):" in r.output
    assert "-def add(x, y):" in r.output and "+def add(a, b):" in r.output
    assert disk(ctx, "src/app.py") == before and not r.edits


async def test_edit_found_twice_lists_lines_then_replace_all(ctx: ToolContext) -> None:
    (ctx.workspace.root / "t.py").write_text("x = 1\ny = 2\nx = 1\n")
    r = await call(ctx, "edit_file", path="t.py", old="x = 1", new="x = 3")
    assert r.status == "error" and "matches 2 times (at lines 1, 3)" in r.output
    r = await call(ctx, "edit_file", path="t.py", old="x = 1", new="x = 3", replace_all="true")
    assert r.status == "ok" and disk(ctx, "t.py") == "x = 3\ny = 2\nx = 3\n"
    assert "2 occurrences" in r.output


async def test_edit_fuzzy_found_twice(ctx: ToolContext) -> None:
    (ctx.workspace.root / "t.py").write_text("if a:\n    go()\nif b:\n  go()\n")
    r = await call(ctx, "edit_file", path="t.py", old="go()  ", new="stop()")
    assert r.status == "error" and "at lines 2, 4" in r.output


async def test_edit_keeps_crlf(ctx: ToolContext) -> None:
    (ctx.workspace.root / "w.txt").write_bytes(b"one\r\ntwo\r\nthree\r\n")
    r = await call(ctx, "edit_file", path="w.txt", old="one\ntwo", new="uno\ndos")
    assert r.status == "ok", r.output
    assert (ctx.workspace.root / "w.txt").read_bytes() == b"uno\r\ndos\r\nthree\r\n"


async def test_edit_errors(ctx: ToolContext) -> None:
    cases = [
        (dict(path="missing.py", old="a", new="b"), "file not found: missing.py (use write_file"),
        (dict(path="src/app.py", old="", new="b"), "old is empty"),
        (dict(path="src/app.py", old="import os", new="import os"), "the same"),
        (dict(path="../x.py", old="a", new="b"), "outside the workspace"),
    ]
    for raw, message in cases:
        r = await call(ctx, "edit_file", **raw)
        assert r.status == "error" and message in r.output, r.output


async def test_edit_writes_through_the_open_buffer(ctx: ToolContext) -> None:
    ctx.workspace.buffers["src/app.py"] = "value = 1\n"  # type: ignore[attr-defined]
    r = await call(ctx, "edit_file", path="src/app.py", old="value = 1", new="value = 2")
    assert r.status == "ok"
    assert r.edits[0].before == "value = 1\n"
    assert disk(ctx, "src/app.py") == "value = 2\n"


# -- write_file / delete_file ------------------------------------------------------


async def test_write_creates_and_overwrites(ctx: ToolContext) -> None:
    r = await call(ctx, "write_file", path="pkg/new.py", content="a = 1\n")
    assert r.status == "ok" and r.output == "created pkg/new.py (1 lines)"
    assert r.edits[0].before is None and r.edits[0].diff.startswith(
        "--- /dev/null\n+++ b/pkg/new.py"
    )
    r = await call(ctx, "write_file", path="pkg/new.py", content="a = 2\n")
    assert r.output.startswith("overwrote") and r.edits[0].before == "a = 1\n"
    r = await call(ctx, "write_file", path="pkg/new.py", content="a = 2\n")
    assert "unchanged" in r.output and not r.edits
    assert ctx.changed == ["pkg/new.py", "pkg/new.py"]  # type: ignore[attr-defined]


async def test_write_refusals(ctx: ToolContext, tmp_path: Path) -> None:
    (ctx.workspace.root / "blob.bin").write_bytes(b"\x00\x01")
    for path, message in [
        ("../out.txt", "outside the workspace"),
        ("src", "is a directory"),
        ("blob.bin", "not a text file"),
        ("src/app.py/x", "a parent of it is a file"),
    ]:
        r = await call(ctx, "write_file", path=path, content="x")
        assert r.status == "error" and message in r.output, r.output
    assert not (tmp_path / "out.txt").exists()
    assert (ctx.workspace.root / "blob.bin").read_bytes() == b"\x00\x01"


async def test_delete(ctx: ToolContext) -> None:
    r = await call(ctx, "delete_file", path="src/app.py")
    assert r.status == "ok" and not (ctx.workspace.root / "src" / "app.py").exists()
    assert r.edits[0].before == APP and r.edits[0].after is None
    r = await call(ctx, "delete_file", path="src/app.py")
    assert r.status == "error" and "file not found" in r.output
    r = await call(ctx, "delete_file", path="src")
    assert r.status == "error" and "directory" in r.output
    r = await call(ctx, "delete_file", path="../ws/../outside")
    assert r.status == "error"


# -- list_dir ------------------------------------------------------------------


async def test_list_dir_tree_depth_and_gitignore(ctx: ToolContext) -> None:
    root = ctx.workspace.root
    (root / ".gitignore").write_text("node_modules/\n*.pyc\n")
    (root / "node_modules" / "x").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "src" / "a.pyc").write_bytes(b"")
    (root / "src" / "deep" / "er").mkdir(parents=True)
    (root / "src" / "deep" / "er" / "f.txt").write_text("")
    (root / "src" / "deep" / "er" / "g.txt").write_text("")
    (root / "README.md").write_text("")
    r = await call(ctx, "list_dir")
    assert r.status == "ok"
    assert r.output.splitlines() == [
        "./",
        "  src/",
        "    deep/  (2 files below)",
        "    app.py",
        "  .gitignore",
        "  README.md",
    ]
    r = await call(ctx, "list_dir", path="src", depth="3")
    assert r.output.splitlines() == [
        "src/",
        "  deep/",
        "    er/",
        "      f.txt",
        "      g.txt",
        "  app.py",
    ]


async def test_list_dir_errors(ctx: ToolContext) -> None:
    for raw, message in [
        (dict(path="src/app.py"), "is a file"),
        (dict(path="nope"), "directory not found: nope"),
        (dict(path=".."), "outside the workspace"),
        (dict(path=".", depth="0"), "depth must be 1 or more"),
        (dict(path=".", depth="two"), "must be an integer"),
    ]:
        spec = specs.get("list_dir")
        try:
            r = await spec.run(ctx, spec.validate(raw))
        except Exception as e:  # validation errors are the executor's to report
            r = ToolResult.error(str(e))
        assert r.status == "error" and message in r.output, r.output


async def test_read_file_refuses_huge_files_with_advice(
    ctx: ToolContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opencomposer.tools import files

    monkeypatch.setattr(files, "READ_MAX_FILE_BYTES", 1000)
    (ctx.workspace.root / "log.txt").write_text("x" * 5000)
    r = await call(ctx, "read_file", path="log.txt")
    assert r.status == "error" and "too big for read_file" in r.output and "sed -n" in r.output
