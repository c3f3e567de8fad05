"""grep (ripgrep and the Python fallback), glob and codebase_search."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from fifo_guard import unblocked
from opencomposer.index import Hit
from opencomposer.tools import search, specs
from opencomposer.tools.protocols import ToolContext, ToolResult
from opencomposer.tools.workspace import LocalWorkspace


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    root = tmp_path / "ws"
    (root / "src" / "net").mkdir(parents=True)
    (root / "build").mkdir()
    (root / ".gitignore").write_text("build/\n")
    (root / "src" / "app.py").write_text("def retry(n):\n    return n\n\nRETRY = 3\n")
    (root / "src" / "net" / "client.py").write_text("from app import retry\nretry(2)\n")
    (root / "src" / "notes.md").write_text("retry policy\n")
    (root / "build" / "gen.py").write_text("def retry(): pass\n")
    (root / "data.bin").write_bytes(b"retry\x00\x01")
    return ToolContext(workspace=LocalWorkspace(root))


async def call(ctx: ToolContext, name: str, **raw: str) -> ToolResult:
    spec = specs.get(name)
    return await spec.run(ctx, spec.validate(raw))


@pytest.fixture(params=["rg", "python"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "rg":
        assert shutil.which("rg"), "ripgrep is missing: run `make system-deps`"
    else:
        real = shutil.which
        monkeypatch.setattr(search.shutil, "which", lambda n: None if n == "rg" else real(n))
    return request.param


async def test_grep_matches_respect_gitignore_and_skip_binary(
    ctx: ToolContext, engine: str
) -> None:
    r = await call(ctx, "grep", pattern=r"retry\(")
    assert r.status == "ok"
    assert r.output.splitlines() == [
        "src/app.py:1:def retry(n):",
        "src/net/client.py:2:retry(2)",
    ]


async def test_grep_path_glob_and_case(ctx: ToolContext, engine: str) -> None:
    r = await call(ctx, "grep", pattern="retry", path="src/net")
    assert r.output.splitlines() == [
        "src/net/client.py:1:from app import retry",
        "src/net/client.py:2:retry(2)",
    ]
    r = await call(ctx, "grep", pattern="retry", glob="*.md")
    assert r.output == "src/notes.md:1:retry policy"
    r = await call(ctx, "grep", pattern="^retry", case_sensitive="false", path="src/app.py")
    assert r.output == "src/app.py:4:RETRY = 3"
    r = await call(ctx, "grep", pattern="nothing_like_this")
    assert r.status == "ok" and "no matches" in r.output


async def test_grep_searches_open_buffers_not_disk(ctx: ToolContext, engine: str) -> None:
    ctx.workspace.buffers["src/app.py"] = "def backoff():\n    retry_later()\n"  # type: ignore[attr-defined]
    ctx.workspace.buffers["src/unsaved.py"] = "retry_unsaved = 1\n"  # type: ignore[attr-defined]
    r = await call(ctx, "grep", pattern="retry", path="src", glob="*.py")
    assert r.output.splitlines() == [
        "src/app.py:2:    retry_later()",
        "src/net/client.py:1:from app import retry",
        "src/net/client.py:2:retry(2)",
        "src/unsaved.py:1:retry_unsaved = 1",
    ]
    r = await call(ctx, "grep", pattern="retry", path="src/unsaved.py")
    assert r.output == "src/unsaved.py:1:retry_unsaved = 1"


async def test_grep_caps_output_with_a_count(ctx: ToolContext, engine: str) -> None:
    (ctx.workspace.root / "many.txt").write_text("hit\n" * 1000)
    r = await call(ctx, "grep", pattern="hit")
    lines = r.output.splitlines()
    assert len(lines) == search.GREP_MAX_SHOWN + 1
    assert lines[-1].startswith("[... 800 more matches not shown")
    assert r.meta["matches"] == 1000


async def test_grep_look_around(ctx: ToolContext, engine: str) -> None:
    r = await call(ctx, "grep", pattern=r"retry(?=\()", path="src/app.py")
    assert r.output == "src/app.py:1:def retry(n):"


async def test_grep_errors(ctx: ToolContext, engine: str) -> None:
    r = await call(ctx, "grep", pattern="(unclosed")
    assert r.status == "error" and "invalid regular expression" in r.output
    r = await call(ctx, "grep", pattern="x", path="../")
    assert r.status == "error" and "outside the workspace" in r.output
    r = await call(ctx, "grep", pattern="x", path="nope")
    assert r.status == "error" and "path not found: nope" in r.output


async def test_glob(ctx: ToolContext) -> None:
    r = await call(ctx, "glob", pattern="**/*.py")
    assert r.output.splitlines() == ["src/app.py", "src/net/client.py"]
    r = await call(ctx, "glob", pattern="*.{md,py}")
    assert r.output.splitlines() == ["src/app.py", "src/net/client.py", "src/notes.md"]
    r = await call(ctx, "glob", pattern="src/*.py")
    assert r.output == "src/app.py"
    ctx.workspace.buffers["src/new.py"] = "x"  # type: ignore[attr-defined]
    r = await call(ctx, "glob", pattern="src/*.py")
    assert r.output.splitlines() == ["src/app.py", "src/new.py"]
    r = await call(ctx, "glob", pattern="*.rs")
    assert r.status == "ok" and "no files match" in r.output
    r = await call(ctx, "glob", pattern="../*.py")
    assert r.status == "error"


async def test_glob_caps(ctx: ToolContext) -> None:
    for i in range(search.GLOB_MAX_SHOWN + 20):
        (ctx.workspace.root / f"f{i:04d}.txt").write_text("")
    r = await call(ctx, "glob", pattern="*.txt")
    assert r.output.splitlines()[-1] == "[... 20 more files; use a narrower pattern]"


class FakeIndex:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str | None]] = []

    def search(self, query: str, *, k: int = 10, path: str | None = None) -> list[Hit]:
        self.calls.append((query, k, path))
        return [
            Hit(path="src/app.py", start_line=1, end_line=2, score=0.91, symbol="retry"),
            Hit(
                path="src/net/client.py",
                start_line=1,
                end_line=2,
                score=0.5,
                text="a\nb\nc\nd\ne\nf\ng\nh",
            ),
        ][:k]


async def test_codebase_search_formats_hits(ctx: ToolContext) -> None:
    index = FakeIndex()
    ctx.index = index
    r = await call(ctx, "codebase_search", query="where do we retry", path="src", k="2")
    assert r.status == "ok"
    assert index.calls == [("where do we retry", 2, "src")]
    blocks = r.output.split("\n\n")
    assert blocks[0] == "src/app.py:1-2 (0.910) retry\n  def retry(n):\n      return n"
    assert blocks[1].startswith("src/net/client.py:1-2 (0.500)\n  a\n")
    assert blocks[1].endswith("[... 2 more lines]")


async def test_codebase_search_opens_the_index_lazily_once(ctx: ToolContext) -> None:
    opened: list[FakeIndex] = []

    async def factory() -> FakeIndex:
        opened.append(FakeIndex())
        return opened[-1]

    ctx.index_factory = factory
    await call(ctx, "codebase_search", query="a")
    await call(ctx, "codebase_search", query="b")
    assert len(opened) == 1 and len(opened[0].calls) == 2


async def test_codebase_search_without_index(ctx: ToolContext) -> None:
    r = await call(ctx, "codebase_search", query="retry")
    assert r.status == "error" and "no codebase index" in r.output

    async def broken() -> FakeIndex:
        raise RuntimeError("disk full")

    ctx.index_factory = broken
    r = await call(ctx, "codebase_search", query="retry")
    assert r.status == "error" and "disk full" in r.output


# -- issue 19: model input never becomes a program's option; odd files --------------


def _plant(root: Path, marker: Path) -> None:
    """Files whose names are rg options, and a script that leaves `marker` if run."""
    (root / "evil.sh").write_text(f"#!/bin/sh\ntouch {marker}\n")
    (root / "evil.sh").chmod(0o755)
    for name in ["--pre=sh", "-x", "--files", "-e", "--no-config"]:
        (root / name).write_text(f"x in {name}\n")
    (root / "-d").mkdir()
    (root / "-d" / "f.txt").write_text("x in -d/f.txt\n")
    (root / "rgrc").write_text("--pre=sh\n")


async def test_grep_model_input_never_becomes_an_rg_option(
    ctx: ToolContext, engine: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19 item 1: `<grep pattern="x" path="--pre=sh"/>` with a file named
    `--pre=sh` made rg run every searched file through sh, on the host, unapproved.
    Paths, patterns and globs stay operands; a ripgrep config file adds nothing."""
    root = ctx.workspace.root
    marker = tmp_path / "ran"
    _plant(root, marker)
    monkeypatch.setenv("RIPGREP_CONFIG_PATH", str(root / "rgrc"))
    for name in ["--pre=sh", "-x", "--files", "-e", "--no-config"]:
        r = await call(ctx, "grep", pattern="x", path=name)
        assert r.output == f"{name}:1:x in {name}", r.output
    r = await call(ctx, "grep", pattern="x", path="-d")
    assert r.output == "-d/f.txt:1:x in -d/f.txt"
    r = await call(ctx, "grep", pattern="--pre=sh", path=".")
    assert r.output.splitlines() == ["--pre=sh:1:x in --pre=sh", "rgrc:1:--pre=sh"]
    r = await call(ctx, "grep", pattern="--fi", glob="--files")
    assert r.output == "--files:1:x in --files"
    r = await call(ctx, "grep", pattern="x in -x")
    assert r.output == "-x:1:x in -x"
    assert not marker.exists()


async def test_grep_and_glob_skip_special_files_and_symlink_loops(
    ctx: ToolContext, engine: str
) -> None:
    """Issue 19 item 10: a FIFO named as grep's path blocked the search; one symlink loop
    broke glob for the whole workspace. Both now answer, with the rest of the files."""
    root = ctx.workspace.root
    fifo = root / "src" / "pipe.py"
    os.mkfifo(fifo)
    (root / "loop").symlink_to("loop")
    (root / "src" / "up").symlink_to("..")
    r = unblocked(fifo, lambda: call(ctx, "grep", pattern="retry", path="src/pipe.py"))
    assert r.status == "error" and "regular file" in r.output
    r = unblocked(fifo, lambda: call(ctx, "grep", pattern=r"retry\("))
    assert r.output.splitlines() == ["src/app.py:1:def retry(n):", "src/net/client.py:2:retry(2)"]
    r = unblocked(fifo, lambda: call(ctx, "glob", pattern="**/*"))
    assert r.output.splitlines() == [
        ".gitignore",
        "data.bin",
        "src/app.py",
        "src/net/client.py",
        "src/notes.md",
    ]


@pytest.mark.parametrize("target", ["src/net", "src/app.py"])
async def test_grep_does_not_follow_a_path_swapped_for_a_symlink(
    ctx: ToolContext, engine: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    """Issue 19 item 8 for reads: the path passes the check, then becomes a symlink to a
    folder or file outside before the search opens it; nothing from outside comes back."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "client.py").write_text("retry s3cret\n")
    (tmp_path / "secret.py").write_text("retry s3cret\n")
    real = search._searchable
    path = ctx.workspace.root / target

    def check_then_swap(p: Path) -> bool:
        ok = real(p)
        path.rename(path.with_name(path.name + ".old"))
        path.symlink_to(outside if path.name == "net" else tmp_path / "secret.py")
        return ok

    monkeypatch.setattr(search, "_searchable", check_then_swap)
    r = await call(ctx, "grep", pattern="retry", path=target)
    assert "s3cret" not in r.output
    assert r.status == "error" or "no matches" in r.output, r.output
