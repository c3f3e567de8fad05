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
import logging
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
from opencomposer.index import CodebaseIndex, IndexProblem, core
from opencomposer.index.cli import cmd_index
from opencomposer.index.files import MAX_DEPTH, walk
from opencomposer.index.snapshots import seed

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


def test_backtracking_ignore_rules_cannot_hang_the_walk(tmp_path: Path) -> None:
    """Guards: an ignore rule with many wildcards made Python's regex backtrack for
    minutes per long file name, holding the GIL (a hostile .gitignore hung the
    build). With RE2 the rule is matched in linear time and kept. Run in a
    subprocess: the old hang cannot be interrupted in-process."""
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
    assert skipped == {}  # matched by RE2, not dropped


def test_without_re2_backtracking_rules_are_dropped(tmp_path: Path, monkeypatch) -> None:
    """Where RE2 is missing, a rule with more than MAX_WILDCARDS wildcards is dropped
    (and counted) rather than matched by Python's backtracking regex."""
    from opencomposer.index import files

    monkeypatch.setattr(files, "_BACKEND", "simple")
    root = tmp_path / "ws"
    root.mkdir()
    (root / ".gitignore").write_text("*a*a*a*a*b\n*.log\n")
    (root / "ab.py").write_text("x = 1\n")
    (root / "noise.log").write_text("x\n")
    found = walk(root)
    assert sorted(found.files) == [".gitignore", "ab.py"]
    assert found.skipped == {"ignore rule too complex": 1}


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _folder(p: Path) -> None:
    p.mkdir()
    (p / "x").write_text("x")


@pytest.mark.parametrize(
    "name, make",
    [
        ("index.db", _fifo),
        ("index.db", _folder),
        ("index.db-wal", _fifo),
        ("lock", _fifo),
        ("lock", _folder),
        (".gitignore", _fifo),
    ],
)
def test_odd_entries_in_the_index_folder_are_replaced(
    workspace: Path, embedder_env: Path, name: str, make: Callable[[Path], None]
) -> None:
    """Guards: a FIFO or folder where the lock or database goes made refresh raise a
    traceback ("not seekable", IsADirectoryError) or could block the open."""
    folder = workspace / ".opencomposer/index"
    folder.mkdir(parents=True)
    make(folder / name)

    def build() -> list[Any]:
        with CodebaseIndex.open(workspace) as index:
            index.refresh()
            return index.search("retry with backoff", k=1)

    hits = finishes(build, 60, fifos=(folder / name,))
    assert hits[0].path == "src/retry.py"
    entry = folder / name
    assert (folder / "lock").is_file() and (entry.is_file() or not entry.exists())


def test_symlinks_in_the_index_folder_never_write_outside(
    workspace: Path, embedder_env: Path, tmp_path: Path
) -> None:
    """Guards: index files that are symlinks were followed: a dangling `.gitignore`
    link created a file outside the workspace, and a linked database was opened
    (and switched to WAL) wherever it pointed."""
    out = tmp_path / "outside"
    out.mkdir()
    other = out / "other.db"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    other_bytes = other.read_bytes()
    folder = workspace / ".opencomposer/index"
    folder.mkdir(parents=True)
    os.symlink(out / "created_by_index", folder / ".gitignore")
    os.symlink(other, folder / "index.db")
    os.symlink(out / "lockfile", folder / "lock")
    with CodebaseIndex.open(workspace) as index:
        index.refresh()
        assert index.search("retry with backoff", k=1)[0].path == "src/retry.py"
    assert sorted(os.listdir(out)) == ["other.db"]
    assert other.read_bytes() == other_bytes
    assert not (folder / "index.db").is_symlink() and (folder / ".gitignore").read_text() == "*\n"


@pytest.mark.parametrize("kind", ["outside symlink", "file"])
def test_index_folder_that_is_not_a_folder_is_one_line(
    workspace: Path,
    embedder_env: Path,
    tmp_path: Path,
    kind: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Guards: `.opencomposer` as a symlink put the whole index (and its writes)
    outside the workspace; as a file it raised NotADirectoryError with a traceback."""
    out = tmp_path / "outside"
    out.mkdir()
    if kind == "file":
        (workspace / ".opencomposer").write_text("not a folder\n")
    else:
        os.symlink(out, workspace / ".opencomposer")
    with pytest.raises(IndexProblem, match=r"\.opencomposer is .*real folder inside the workspace"):
        CodebaseIndex.open(workspace)
    assert os.listdir(out) == []
    assert cmd_index(workspace) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_seeding_a_workspace_never_writes_outside(workspace: Path, tmp_path: Path) -> None:
    """Guards: seeding a workspace's index from a stored database followed a symlinked
    `.opencomposer` or a planted `index.seeding` link and wrote the copy outside."""
    out = tmp_path / "outside"
    out.mkdir()
    stored = tmp_path / "stored.db"
    stored.write_bytes(b"SQLite format 3\0" + bytes(100))
    folder = workspace / ".opencomposer/index"
    folder.mkdir(parents=True)
    os.symlink(out / "planted", folder / "index.seeding")
    seed(workspace, stored, trust_stats=True)
    assert os.listdir(out) == []
    assert (folder / "index.db").read_bytes() == stored.read_bytes()
    other = tmp_path / "other_ws"
    other.mkdir()
    os.symlink(out, other / ".opencomposer")
    with pytest.raises(IndexProblem, match="real folder inside the workspace"):
        seed(other, stored, trust_stats=True)
    assert os.listdir(out) == []


def _sql(statement: str) -> Callable[[Path], None]:
    def damage(db: Path) -> None:
        con = sqlite3.connect(db)
        con.execute(statement)
        con.commit()
        con.close()

    return damage


def _overwrite(data: bytes, suffix: str = "") -> Callable[[Path], None]:
    def damage(db: Path) -> None:
        Path(str(db) + suffix).write_bytes(data)

    return damage


DAMAGES = {
    "truncated": lambda db: db.write_bytes(db.read_bytes()[:8192]),
    "garbage": _overwrite(b"\x8f\x00garbage" * 5000),
    "zero-filled": _overwrite(bytes(65536)),
    "garbage wal": _overwrite(os.urandom(1 << 16), "-wal"),
    "garbage shm": _overwrite(os.urandom(1 << 15), "-shm"),
    "vectors of another size": _sql("UPDATE vectors SET vec = substr(vec, 1, 8)"),
    "vectors of mixed sizes": _sql("UPDATE vectors SET vec = substr(vec, 1, 16) WHERE rowid % 2"),
    "generation not a number": _sql("UPDATE meta SET value = 'x' WHERE key = 'generation'"),
    "chunks table dropped": _sql("DROP TABLE chunks"),
    "lexical table dropped": _sql("DROP TABLE lex"),
    "meta emptied": _sql("DELETE FROM meta"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_index_is_rebuilt_with_one_warning(
    workspace: Path, embedder_env: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Guards: damage SQLite's integrity check cannot see (vectors of the wrong size,
    a dropped table) raised a FAISS AssertionError or IntegrityError traceback at
    the first refresh or search instead of a rebuild."""
    with CodebaseIndex.open(workspace) as index:
        index.refresh()
    db = workspace / ".opencomposer/index/index.db"
    DAMAGES[damage](db)
    with caplog.at_level(logging.WARNING, logger="opencomposer.index"):
        index = CodebaseIndex.open(workspace)
        index.refresh()
        hits = index.search("retry with backoff", k=1)
        index.update_buffer("src/extra.py", "def circuit_reset():\n    return 0\n")
        assert index.search("circuit_reset", k=1)[0].path == "src/extra.py"
        index.close()
    assert hits[0].path == "src/retry.py"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) <= 1 and all("\n" not in w for w in warnings)
    paths, _ = indexed(workspace)
    assert {"src/retry.py", "src/parse.py", "web/app.ts", "src/extra.py"} <= paths


@pytest.mark.parametrize("during", ["search", "refresh", "update_buffer"])
def test_index_damaged_while_open_is_rebuilt(
    workspace: Path, embedder_env: Path, during: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Guards: an open index whose database another process damaged raised
    OperationalError ("no such table") out of search, a traceback in
    codebase_search, instead of rebuilding."""
    index = CodebaseIndex.open(workspace)
    index.refresh()
    other = sqlite3.connect(workspace / ".opencomposer/index/index.db")
    other.execute("DROP TABLE lex")
    other.execute("UPDATE meta SET value = value + 1 WHERE key = 'generation'")
    other.commit()
    other.close()
    with caplog.at_level(logging.WARNING, logger="opencomposer.index"):
        if during == "refresh":
            index.refresh()
        elif during == "update_buffer":
            index.update_buffer("src/extra.py", "def circuit_reset():\n    return 0\n")
        hits = index.search("retry with backoff", k=1)
    assert hits[0].path == "src/retry.py"
    assert len([r for r in caplog.records if "rebuilding" in r.getMessage()]) == 1
    index.close()


def test_cli_on_a_damaged_index_warns_in_one_line(
    workspace: Path,
    embedder_env: Path,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Guards: a garbage database must give `opencomposer index` one warning line and
    a rebuilt index (exit 0), never a traceback."""
    assert cmd_index(workspace, quiet=True) == 0
    db = workspace / ".opencomposer/index/index.db"
    for suffix in ("-wal", "-shm"):
        Path(str(db) + suffix).unlink(missing_ok=True)
    db.write_bytes(b"not a database" * 1000)
    capfd.readouterr()
    with caplog.at_level(logging.WARNING, logger="opencomposer.index"):
        assert cmd_index(workspace) == 0
    out, err = capfd.readouterr()
    assert "Traceback" not in err
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "rebuilding" in warnings[0] and "\n" not in warnings[0]
    assert "indexed 4 files" in out and "4 files changed" in out


def test_a_busy_database_is_not_mistaken_for_damage(
    workspace: Path, embedder_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guards: every sqlite3.DatabaseError counted as damage, so a database that was
    only locked by another process (SQLITE_BUSY) would have been deleted and rebuilt."""
    index = CodebaseIndex.open(workspace)
    index.refresh()
    db = workspace / ".opencomposer/index/index.db"
    inode = db.stat().st_ino
    busy = sqlite3.OperationalError("database is locked")
    busy.sqlite_errorcode = 5  # SQLITE_BUSY

    def locked(*args: Any, **kwargs: Any) -> list[int]:
        raise busy

    monkeypatch.setattr(index, "lexical_search", locked)
    with pytest.raises(IndexProblem, match="unavailable: database is locked"):
        index.search("retry with backoff", k=1)
    assert db.stat().st_ino == inode and len(index) > 0
    monkeypatch.undo()
    assert index.search("retry with backoff", k=1)[0].path == "src/retry.py"
    index.close()
