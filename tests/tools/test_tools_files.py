"""read_file, edit_file (the match ladder and its errors), write_file, delete_file, list_dir,
driven through the declared specs exactly as the session executor runs them."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from fifo_guard import unblocked
from opencomposer.tools import specs, workspace
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


async def test_a_missing_path_names_the_files_it_may_mean(ctx: ToolContext) -> None:
    """A base name alone, a path short of its leading folder, or the wrong case: the
    error names the existing files (not ignored ones), nearest first, on one line."""
    root = ctx.workspace.root
    made = ["tests/test_app.py", "src/pkg/mod.py", "lib/pkg/mod.py", "build/test_app.py"]
    for rel in [*made, "src/shop/__init__.py"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    (root / ".gitignore").write_text("build/\n")
    ws = ctx.workspace
    assert isinstance(ws, LocalWorkspace)
    ws.buffers["docs/test_app.py"] = "unsaved = True\n"
    both = "one of: lib/pkg/mod.py, src/pkg/mod.py?"
    cases = [
        ("read_file", {"path": "test_app.py"}, "one of: docs/test_app.py, tests/test_app.py?"),
        ("read_file", {"path": "pkg/mod.py"}, "file not found: pkg/mod.py; did you mean " + both),
        ("read_file", {"path": "APP.py"}, "file not found: APP.py; did you mean src/app.py?"),
        ("edit_file", {"path": "app.py", "old": "a", "new": "b"}, "did you mean src/app.py?"),
        ("delete_file", {"path": "mod.py"}, "file not found: mod.py; did you mean " + both),
        ("list_dir", {"path": "pkg"}, "directory not found: pkg; did you mean one of: lib/pkg, "),
        ("list_dir", {"path": "app.py"}, "directory not found: app.py"),
        ("grep", {"pattern": "x", "path": "pkg"}, "path not found: pkg; did you mean one of: lib"),
        ("read_lints", {"paths": "mod.py"}, "path not found: mod.py; did you mean " + both),
        # a package named as a module
        ("read_file", {"path": "shop.py"}, "did you mean src/shop/__init__.py?"),
        ("edit_file", {"path": "src/shop.py", "old": "a", "new": "b"}, "src/shop/__init__.py?"),
    ]
    for tool, args, message in cases:
        r = await call(ctx, tool, **args)
        assert r.status == "error", (tool, args)
        assert message in r.output, (tool, r.output)
        assert "\n" not in r.output and "build/" not in r.output
    r = await call(ctx, "list_dir", path="app.py")
    assert "did you mean" not in r.output  # a file is not offered for a folder
    r = await call(ctx, "read_file", path="nowhere.py")
    assert r.output == "file not found: nowhere.py"
    r = await call(ctx, "edit_file", path="nowhere.py", old="a", new="b")
    assert r.output == "file not found: nowhere.py (use write_file to create it)"


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


async def test_edit_sent_again_says_it_was_made(ctx: ToolContext) -> None:
    edit = dict(path="src/app.py", old="    return a - b", new="    return a + b")
    assert (await call(ctx, "edit_file", **edit)).status == "ok"
    after = disk(ctx, "src/app.py")
    r = await call(ctx, "edit_file", **edit)
    assert r.status == "error" and not r.edits and disk(ctx, "src/app.py") == after
    first, shown = r.output.split("\n", 1)
    assert first.startswith("src/app.py: old text not found, but the file already holds the ")
    assert "new text at line 5: this edit was made already" in first
    assert shown == "    5\t    return a + b"
    # a miss whose new text the file does not hold keeps the closest-lines answer
    r = await call(ctx, "edit_file", path="src/app.py", old="return a - b", new="return b + a")
    assert "old text not found (tried exact" in r.output and "already holds" not in r.output
    # a deletion has no new text to look for
    r = await call(ctx, "edit_file", path="src/app.py", old="return a - b", new="")
    assert "already holds" not in r.output


async def test_edit_found_twice_lists_lines_then_replace_all(ctx: ToolContext) -> None:
    (ctx.workspace.root / "t.py").write_text("x = 1\ny = 2\nx = 1\n")
    r = await call(ctx, "edit_file", path="t.py", old="x = 1", new="x = 3")
    assert r.status == "error" and "matches 2 times (at lines 1, 3)" in r.output
    # each match is shown with a line either side, to quote in the next try
    assert r.output.endswith(
        "The matches, with a line either side:\n    1\tx = 1\n    2\ty = 2\n--\n"
        "    2\ty = 2\n    3\tx = 1\n    4\t"
    )
    r = await call(ctx, "edit_file", path="t.py", old="x = 1", new="x = 3", replace_all="true")
    assert r.status == "ok" and disk(ctx, "t.py") == "x = 3\ny = 2\nx = 3\n"
    assert "2 occurrences" in r.output


async def test_edit_fuzzy_found_twice(ctx: ToolContext) -> None:
    (ctx.workspace.root / "t.py").write_text("if a:\n    go()\nif b:\n  go()\n")
    r = await call(ctx, "edit_file", path="t.py", old="go()  ", new="stop()")
    assert r.status == "error" and "at lines 2, 4" in r.output
    assert (
        "    1\tif a:\n    2\t    go()\n    3\tif b:\n--\n    3\tif b:\n    4\t  go()" in r.output
    )
    many = "".join(f"if c{i}:\n    go()\n" for i in range(6))
    (ctx.workspace.root / "m.py").write_text(many)
    r = await call(ctx, "edit_file", path="m.py", old="go()", new="stop()")
    assert r.output.count("\n--\n") == 3 and r.output.endswith("(2 more not shown)")


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
    assert r.status == "error" and "too big to read" in r.output and "sed -n" in r.output


# -- issue 19: special files, symlinks, aliases, size ------------------------------


async def test_file_tools_refuse_a_fifo_at_once(ctx: ToolContext) -> None:
    """Issue 19 item 10: read_file on a FIFO blocked the event loop (and the language
    server) for good. Every file tool refuses it in one line and leaves it in place."""
    fifo = ctx.workspace.root / "src" / "pipe.py"
    os.mkfifo(fifo)
    for name, raw in [
        ("read_file", dict(path="src/pipe.py")),
        ("edit_file", dict(path="src/pipe.py", old="a", new="b")),
        ("write_file", dict(path="src/pipe.py", content="x")),
        ("delete_file", dict(path="src/pipe.py")),
    ]:
        r = unblocked(fifo, lambda name=name, raw=raw: call(ctx, name, **raw))
        assert r.status == "error" and "\n" not in r.output, (name, r.output)
    r = unblocked(fifo, lambda: call(ctx, "list_dir", path="src"))
    assert r.status == "ok" and "pipe.py" in r.output and "app.py" in r.output
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


async def test_delete_file_on_a_symlink_deletes_the_link(ctx: ToolContext) -> None:
    """Issue 19 item 10: delete_file on a symlink deleted its target."""
    root = ctx.workspace.root
    (root / "link.py").symlink_to("src/app.py")
    r = await call(ctx, "delete_file", path="./link.py")
    assert r.status == "ok", r.output
    assert not (root / "link.py").is_symlink() and disk(ctx, "src/app.py") == APP
    assert r.edits[0].path == "link.py" and r.edits[0].before == APP


async def test_list_dir_and_read_survive_symlink_loops(ctx: ToolContext) -> None:
    """Issue 19 item 10: one symlink loop made list_dir fail for the whole workspace."""
    root = ctx.workspace.root
    (root / "loop").symlink_to("loop")
    (root / "src" / "parent").symlink_to("..")
    r = await call(ctx, "list_dir", depth="3")
    assert r.status == "ok" and "app.py" in r.output and "loop" in r.output
    r = await call(ctx, "read_file", path="loop")
    assert r.status == "error" and "\n" not in r.output


async def test_files_over_the_cap_are_refused(
    ctx: ToolContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19 item 13: the file tools load a file whole, so they refuse one over the cap."""
    monkeypatch.setattr(workspace, "MAX_FILE_BYTES", 1000)
    (ctx.workspace.root / "big.txt").write_text("x\n" * 1000)
    for name, raw in [
        ("edit_file", dict(path="big.txt", old="x", new="y", replace_all="true")),
        ("write_file", dict(path="big.txt", content="small\n")),
        ("delete_file", dict(path="big.txt")),
    ]:
        r = await call(ctx, name, **raw)
        assert r.status == "error" and "the file tools load" in r.output, (name, r.output)
        assert "\n" not in r.output
    assert disk(ctx, "big.txt") == "x\n" * 1000


_MEMORY_PROBE = """
import asyncio, resource, sys, tempfile, tracemalloc
from pathlib import Path
from opencomposer.tools import specs, workspace
from opencomposer.tools.protocols import ToolContext
from opencomposer.tools.workspace import LocalWorkspace

root = Path(tempfile.mkdtemp())
line = "    value = compute(alpha, beta)  # a typical line of code\\n"
lines = (workspace.MAX_FILE_BYTES - 100) // len(line)
with open(root / "big.py", "w") as f:
    for i in range(lines):
        f.write("    target = 1\\n" if i == lines // 2 else line)
size = (root / "big.py").stat().st_size
spec = specs.get("edit_file")
ctx = ToolContext(workspace=LocalWorkspace(root))

async def edit(old, new):
    return await spec.run(ctx, spec.validate(dict(path="big.py", old=old, new=new)))

def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

async def main():
    base = rss()
    miss = await edit("nothing = like_this(3)", "x")  # every rung of the ladder, then the closest lines
    miss_peak = rss() - base
    tracemalloc.start()
    hit = await edit("    target = 1\\n", "    target = 2\\n")
    hit_peak = tracemalloc.get_traced_memory()[1]
    print(miss.status, hit.status, size, miss_peak, hit_peak)

asyncio.run(main())
"""


def test_edit_file_memory_is_a_small_multiple_of_the_file() -> None:
    """Issue 19 item 13: edit_file on a 55 MB file peaked at 1.65 GB (30x): the miss
    path kept token sets for every line and the diff ran difflib over the whole file.
    On a file just under the cap, a hit now peaks near 2x and a miss near 3.5x."""
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    miss, hit, size, miss_peak, hit_peak = out.stdout.split()
    assert (miss, hit) == ("error", "ok")
    assert int(hit_peak) < 3 * int(size), (hit_peak, size)
    assert int(miss_peak) < 5 * int(size), (miss_peak, size)


def test_unified_diff_of_the_middle_matches_difflib_over_everything() -> None:
    """The diff is made on the changed middle only; its hunks must be difflib's own."""
    import difflib
    import random

    from opencomposer.tools.files import _keep_ends, unified_diff

    rng = random.Random(19)
    for _ in range(300):
        a_lines = [
            rng.choice("abcde") * rng.randint(0, 3) + "\n" for _ in range(rng.randint(0, 40))
        ]
        b_lines = list(a_lines)
        for _ in range(rng.randint(0, 3)):
            i = rng.randint(0, len(b_lines))
            if rng.random() < 0.5 and i < len(b_lines):
                del b_lines[i]
            else:
                b_lines.insert(i, rng.choice("xyz") + "\n")
        a, b = "".join(a_lines), "".join(b_lines)
        if rng.random() < 0.3:
            b = b.rstrip("\n")
        want = "".join(
            line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
            for line in difflib.unified_diff(_keep_ends(a), _keep_ends(b), "a/f", "b/f")
        )
        got = unified_diff("f", a, b)
        assert _hunks_apply(a, got) == b, (a, b, got)
        assert (got == "") == (want == "")


def _hunks_apply(text: str, diff: str) -> str:
    """Apply a unified diff (as `patch` would) to check that its line numbers are right."""
    import re

    from opencomposer.tools.files import _keep_ends

    old = _keep_ends(text)
    out: list[str] = []
    pos = 0
    lines = diff.splitlines(keepends=True)
    i = 2
    while i < len(lines):
        m = re.match(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", lines[i])
        assert m, lines[i]
        start, count = int(m[1]), int(m[2] or 1)
        first = start - 1 if count else start
        out += old[pos:first]
        pos = first
        i += 1
        while i < len(lines) and not lines[i].startswith("@@"):
            line = lines[i]
            nl = i + 1 < len(lines) and lines[i + 1].startswith("\\ No newline")
            body = line[1:] if not nl else line[1:].rstrip("\n")
            if line[0] in " -":
                assert old[pos] == body, (old[pos], body)
                pos += 1
            if line[0] in " +":
                out.append(body)
            i += 2 if nl else 1
    out += old[pos:]
    return "".join(out)
