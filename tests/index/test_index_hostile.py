"""The index on a hostile workspace and on a damaged index of its own.

A workspace may come from anyone (a cloned repository, a task's tarball, a
model's writes): its FIFOs must not block the build, its symlinks must not bring
content from outside it (or from its secrets) into chunks and search results,
its loops and depths must not break the walk, and a damaged `.opencomposer/index/`
must be rebuilt with one warning, never a traceback or a hang. Every test judges
by effects: the rows in the index database, the files outside the workspace.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from opencomposer.index import CodebaseIndex, core
from opencomposer.index.files import MAX_DEPTH, walk

SECRET = "OUTSIDE_SECRET_TOKEN_7f3a"
DOTENV = "INSIDE_DOTENV_TOKEN_91c2"


def finishes(fn: Callable[[], Any], seconds: float, fifos: tuple[Path, ...] = ()) -> Any:
    """fn() on a daemon thread: its result, or a test failure if it has not returned
    within `seconds` (then the FIFOs it may be stuck on are opened for writing and
    closed, which frees the thread)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(5)
        pytest.fail(f"did not finish within {seconds} s (blocked on a FIFO or backtracking)")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def indexed(root: Path) -> tuple[set[str], str]:
    """(paths in the files table, all chunk text) of root's index database."""
    con = sqlite3.connect(root / ".opencomposer/index/index.db")
    try:
        paths = {r[0] for r in con.execute("SELECT path FROM files")}
        text = "\n".join(r[0] for r in con.execute("SELECT text FROM chunks"))
    finally:
        con.close()
    return paths, text


def outside_folder(tmp_path: Path) -> Path:
    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret.py").write_text(f"{SECRET} = 'hunter2'\n\ndef steal():\n    return {SECRET}\n")
    (out / "guide.md").write_text(f"# Guide\n\n{SECRET} lives here.\n")
    return out


def test_hostile_workspace_builds_and_embeds_nothing_from_outside(
    workspace: Path, embedder_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guards: a FIFO `.gitignore` / `.opencomposerignore` hung the build forever (plain
    open()); symlinks to files outside the workspace, to a secret inside it or into
    .git could put their content in chunks; link loops could break the walk.
    The build runs in a subprocess, so the old hang fails the test instead of hanging it."""
    out = outside_folder(tmp_path)
    before = sorted(os.listdir(out))
    ws = workspace
    os.mkfifo(ws / ".gitignore")
    os.mkfifo(ws / "src" / ".opencomposerignore")
    os.mkfifo(ws / "pipe.py")
    os.symlink("../pipe.py", ws / "src" / "pipe_link.py")
    monkeypatch.chdir(ws)  # a relative bind keeps the socket's path short
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind("sock.py")
    os.symlink(out / "secret.py", ws / "leak.py")  # absolute, outside
    os.symlink("../../outside/secret.py", ws / "src" / "rel_leak.py")  # relative, outside
    os.symlink(out, ws / "docs")  # a folder outside
    (ws / ".env").write_text(f"API_TOKEN={DOTENV}\n")
    os.symlink(".env", ws / "settings.py")  # a secret under an innocent name
    (ws / ".git").mkdir()
    (ws / ".git" / "config").write_text(f"[remote]\n  token = {DOTENV}\n")
    os.symlink(".git/config", ws / "gitconfig.py")
    os.symlink("self.py", ws / "self.py")  # loops
    os.symlink("y.py", ws / "x.py")
    os.symlink("x.py", ws / "y.py")
    os.symlink("..", ws / "src" / "up")
    os.symlink("d2", ws / "d1")
    os.symlink("d1", ws / "d2")
    os.symlink("src/retry.py", ws / "retry_alias.py")  # an indexed file: kept

    code = (
        "import sys; from pathlib import Path; from opencomposer.index.cli import cmd_index; "
        "sys.exit(cmd_index(Path(sys.argv[1])))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(ws)], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the index build hung on the hostile workspace")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "special file" in done.stdout and "symlink" in done.stdout, done.stdout

    paths, text = indexed(ws)
    assert {"src/retry.py", "src/parse.py", "web/app.ts", "retry_alias.py"} <= paths
    for bad in ("leak.py", "src/rel_leak.py", "settings.py", "gitconfig.py", "pipe.py", "sock.py"):
        assert bad not in paths
    assert not any(p.startswith(("docs/", ".git/", "src/up/", "d1/")) for p in paths), paths
    assert SECRET not in text and DOTENV not in text
    with CodebaseIndex.open(ws) as index:
        hits = index.search(f"{SECRET} hunter2 steal", k=20)
        assert hits and not any(SECRET in h.text for h in hits)
    assert sorted(os.listdir(out)) == before


def test_files_swapped_after_the_walk_are_caught_at_read_time(
    workspace: Path, embedder_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guards: the index read each file by path after the walk had checked it, so a
    file swapped for a FIFO blocked the build forever, a file or folder swapped for
    a symlink leaked content from outside, and a file grown past the cap was read
    whole."""
    out = outside_folder(tmp_path)
    (workspace / "lib").mkdir()
    (workspace / "lib" / "guide.md").write_text("# Guide\n\nInside.\n")
    real_walk = core.walk

    def walk_then_swap(root: Path, config: Any) -> Any:
        found = real_walk(root, config)
        (workspace / "src/parse.py").unlink()
        os.mkfifo(workspace / "src/parse.py")
        (workspace / "web/app.ts").unlink()
        os.symlink(out / "secret.py", workspace / "web/app.ts")
        (workspace / "lib").rename(workspace / "lib.old")
        os.symlink(out, workspace / "lib")
        (workspace / "README.md").write_text("grown = 1\n" * 200_000)  # 2 MB, over the cap
        return found

    monkeypatch.setattr(core, "walk", walk_then_swap)
    index = CodebaseIndex.open(workspace)
    stats = finishes(index.refresh, 60, fifos=(workspace / "src/parse.py",))
    paths, text = indexed(workspace)
    assert "src/retry.py" in paths
    assert not {"src/parse.py", "web/app.ts", "lib/guide.md", "README.md"} & paths
    assert SECRET not in text and "grown = 1" not in text
    assert stats.skipped.get("special file") == 1
    assert stats.skipped.get("symlink") == 2
    assert stats.skipped.get("too large") == 1
    index.close()


def test_link_loops_and_links_out_of_the_walk(tmp_path: Path) -> None:
    """Guards: a symlinked file was indexed under its own name whatever it named, so
    `notes.py -> .env` or `x.py -> .git/config` put secrets in the index; loops of
    links must leave the rest of the walk intact."""
    root = tmp_path / "ws"
    (root / "a").mkdir(parents=True)
    (root / "a" / "real.py").write_text("x = 1\n")
    (root / ".env").write_text("TOKEN=1\n")
    (root / "vendor").mkdir()
    (root / "vendor" / "lib.py").write_text("y = 1\n")
    (root / ".gitignore").write_text("vendor/\n")
    os.symlink(".env", root / "notes.py")
    os.symlink("vendor/lib.py", root / "lib_alias.py")  # an ignored file
    os.symlink("a/real.py", root / "alias.py")
    os.symlink("loop.py", root / "loop.py")
    os.symlink("b/..", root / "b")
    os.symlink("a", root / "a_link")
    found = walk(root)
    assert sorted(found.files) == [".gitignore", "a/real.py", "alias.py"]
    assert found.links == {"alias.py": "a/real.py"}
    assert found.stats["alias.py"] == found.stats["a/real.py"]
    assert found.skipped["symlink"] == 5


def test_deep_tree_is_cut(tmp_path: Path) -> None:
    """Guards: a walk that recursed without a bound (deep enough, RecursionError;
    each level holds a folder descriptor)."""
    root = tmp_path / "ws"
    deep = root.joinpath(*["d"] * (MAX_DEPTH + 20))
    deep.mkdir(parents=True)
    (deep / "bottom.py").write_text("x = 1\n")
    (root.joinpath(*["d"] * 3) / "shallow.py").write_text("x = 1\n")
    found = walk(root)
    assert list(found.files) == ["d/d/d/shallow.py"]
    assert found.skipped["too deep"] == 1


def test_backtracking_ignore_rules_are_dropped(tmp_path: Path) -> None:
    """Guards: an ignore rule with many wildcards made Python's regex backtrack for
    minutes per long file name, holding the GIL (a hostile .gitignore hung the
    build). Run in a subprocess: the old hang cannot be interrupted in-process."""
    root = tmp_path / "ws"
    root.mkdir()
    (root / ".gitignore").write_text("*a*a*a*a*a*a*a*a*a*a*a*a*a*b\n*.log\n")
    long_name = "a" * 200 + "c.py"
    (root / long_name).write_text("x = 1\n")
    (root / "noise.log").write_text("x\n")
    code = (
        "import json, sys; from opencomposer.index.files import walk; "
        "found = walk(sys.argv[1]); print(json.dumps([sorted(found.files), found.skipped]))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the walk hung matching an ignore rule")
    assert done.returncode == 0, done.stderr
    files, skipped = json.loads(done.stdout)
    assert files == [".gitignore", long_name]  # the simple rule still hides noise.log
    assert skipped == {"ignore rule too complex": 1}
