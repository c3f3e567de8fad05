"""LocalWorkspace: path safety, the buffer overlay, text decoding, atomic writes, the walk."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import stat
import threading
from pathlib import Path

import pytest
from opencomposer.tools import workspace
from opencomposer.tools.protocols import PathError, ToolError, Workspace
from opencomposer.tools.workspace import LocalWorkspace, walk, walk_files


@pytest.fixture
def ws(tmp_path: Path) -> LocalWorkspace:
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.py").write_text("print('disk')\n")
    return LocalWorkspace(root)


def test_implements_the_protocol(ws: LocalWorkspace) -> None:
    assert isinstance(ws, Workspace)


@pytest.mark.parametrize(
    "bad",
    ["../outside.txt", "src/../../outside.txt", "/etc/passwd", "~/x", "a\0b", "C:\\x", "C:/x"],
)
def test_resolve_refuses_escapes(ws: LocalWorkspace, bad: str) -> None:
    with pytest.raises(PathError) as e:
        ws.resolve(bad)
    assert "\n" not in str(e.value)


def test_resolve_refuses_symlink_pointing_out(ws: LocalWorkspace, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    (ws.root / "link.txt").symlink_to(secret)
    (ws.root / "linkdir").symlink_to(tmp_path)
    with pytest.raises(PathError, match="outside the workspace"):
        ws.read_text("link.txt")
    with pytest.raises(PathError):
        ws.resolve("linkdir/secret.txt")


def test_resolve_accepts_inner_dotdot_and_inner_symlinks(ws: LocalWorkspace) -> None:
    assert ws.resolve("src/../src/app.py") == ws.root / "src" / "app.py"
    (ws.root / "alias.py").symlink_to(ws.root / "src" / "app.py")
    assert ws.read_text("alias.py") == "print('disk')\n"
    assert ws.relative(ws.resolve(".")) == "."


def test_buffers_win_over_disk(ws: LocalWorkspace) -> None:
    ws.buffers["src/app.py"] = "print('buffer')\n"
    ws.buffers["new.py"] = "unsaved\n"
    assert ws.read_text("./src/app.py") == "print('buffer')\n"
    assert ws.read_bytes("src/app.py") == b"print('buffer')\n"
    assert ws.exists("new.py")
    assert ws.overlay() == {"src/app.py": "print('buffer')\n", "new.py": "unsaved\n"}
    ws.buffers["src/app.py"] = "print('disk')\n"  # same as disk: not in the overlay
    assert ws.overlay() == {"new.py": "unsaved\n"}


def test_binary_and_non_utf8_are_refused_clearly(ws: LocalWorkspace) -> None:
    (ws.root / "blob.bin").write_bytes(b"\x7fELF\x00\x01\x02")
    (ws.root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ToolError, match="binary file"):
        ws.read_text("blob.bin")
    with pytest.raises(ToolError, match=r"not UTF-8 text \(invalid byte 0xe9 at offset 3\)"):
        ws.read_text("latin1.txt")
    with pytest.raises(ToolError, match="file not found: nope.txt"):
        ws.read_text("nope.txt")
    with pytest.raises(ToolError, match="is a directory"):
        ws.read_text("src")


async def test_write_is_atomic_keeps_mode_and_creates_parents(ws: LocalWorkspace) -> None:
    script = ws.root / "run.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    await ws.write_text("run.sh", "#!/bin/sh\necho hi\n")
    assert stat.S_IMODE(script.stat().st_mode) == 0o755
    assert script.read_text() == "#!/bin/sh\necho hi\n"
    await ws.write_text("deep/er/new.txt", "x")
    assert (ws.root / "deep" / "er" / "new.txt").read_text() == "x"
    mode = stat.S_IMODE((ws.root / "deep" / "er" / "new.txt").stat().st_mode)
    assert mode & 0o600 == 0o600 and mode != 0o600 or os.umask(0o022) == 0o077
    assert not [p for p in ws.root.rglob("*.tmp")]


async def test_write_updates_an_open_buffer_and_delete_drops_it(ws: LocalWorkspace) -> None:
    ws.buffers["src/app.py"] = "old buffer"
    await ws.write_text("src/app.py", "new text\n")
    assert ws.buffers["src/app.py"] == "new text\n"
    assert (ws.root / "src" / "app.py").read_text() == "new text\n"
    await ws.delete("src/app.py")
    assert "src/app.py" not in ws.buffers and not (ws.root / "src" / "app.py").exists()
    with pytest.raises(ToolError, match="file not found"):
        await ws.delete("src/app.py")
    with pytest.raises(ToolError, match="directory"):
        await ws.delete("src")


async def test_writes_outside_have_no_effect(ws: LocalWorkspace, tmp_path: Path) -> None:
    with pytest.raises(PathError):
        await ws.write_text("../escaped.txt", "x")
    assert not (tmp_path / "escaped.txt").exists()


def test_hostile_gitignore_rule_cannot_hang_the_walk(tmp_path: Path) -> None:
    """Guards: `*a*a*…*b` against a 200-character name made Python's regex backtrack
    for minutes with the GIL held, so list_dir, glob and grep hung the server. Run
    in a subprocess: that hang cannot be interrupted in-process."""
    import json
    import subprocess
    import sys

    root = tmp_path / "ws"
    root.mkdir()
    (root / ".gitignore").write_text(
        "*a*a*a*a*a*a*a*a*a*a*a*a*a*b\na/**/a/**/a/**/a/**/a/**/b\n*.log\n"
    )
    long_name = "a" * 200 + "c.py"
    (root / long_name).write_text("x = 1\n")
    (root / "noise.log").write_text("x\n")
    deep = root.joinpath(*["a"] * 40)
    deep.mkdir(parents=True)
    (deep / "c").write_text("x\n")
    code = (
        "import json, sys; from opencomposer.tools.workspace import walk_files; "
        "print(json.dumps(sorted(walk_files(__import__('pathlib').Path(sys.argv[1])))))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the walk hung matching an ignore rule")
    assert done.returncode == 0, done.stderr
    files = json.loads(done.stdout)
    assert long_name in files and "noise.log" not in files
    assert "/".join(["a"] * 40) + "/c" in files


def test_walk_respects_nested_gitignore_and_skips_git(ws: LocalWorkspace, tmp_path: Path) -> None:
    root = ws.root
    (root / ".gitignore").write_text("build/\n*.log\n")
    (root / "build").mkdir()
    (root / "build" / "out.txt").write_text("x")
    (root / "debug.log").write_text("x")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref")
    (root / "pkg" / "gen").mkdir(parents=True)
    (root / "pkg" / ".gitignore").write_text("gen/\n!keep.log\n")
    (root / "pkg" / "gen" / "x.py").write_text("")
    (root / "pkg" / "mod.py").write_text("")
    (root / "pkg" / "keep.log").write_text("")
    (root / "outlink").symlink_to(tmp_path)
    files = list(walk_files(root))
    assert files == [".gitignore", "pkg/.gitignore", "pkg/keep.log", "pkg/mod.py", "src/app.py"]
    assert list(walk_files(root, "pkg")) == ["pkg/.gitignore", "pkg/keep.log", "pkg/mod.py"]
    assert ("pkg", True) in list(walk(root, include_dirs=True))


def test_odd_but_inside_names_are_fine(ws: LocalWorkspace) -> None:
    assert ws.resolve("a:b.txt") == ws.root / "a:b.txt"
    assert ws.resolve(" src/app.py ") == ws.root / "src" / "app.py"


# -- issue 19: writes that cannot be redirected, special files, loops ---------------


def _exchange(a: Path, b: Path) -> None:
    """Swap two directory entries atomically (renameat2 RENAME_EXCHANGE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, bytes(a), at_fdcwd, bytes(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@pytest.fixture
def swap(ws: LocalWorkspace, tmp_path: Path) -> Path:
    """`d` (a real folder in the workspace) and `lnk` (a symlink to a folder outside)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("s3cret\n")
    (outside / "victim.txt").write_text("keep me\n")
    (ws.root / "d").mkdir()
    (ws.root / "d" / "secret.txt").write_text("inside\n")
    (ws.root / "d" / "victim.txt").write_text("inside\n")
    (ws.root / "lnk").symlink_to(outside)
    return outside


def _swap_after_check(monkeypatch: pytest.MonkeyPatch, ws: LocalWorkspace) -> None:
    """Let every path check pass on the real folder `d`, then put the symlink in its
    place just before the descriptor walk opens it."""
    real_parent_dir = workspace.parent_dir

    def swap_then_open(root: Path, key: str, **kw: bool):  # type: ignore[no-untyped-def]
        if not (ws.root / "d").is_symlink():
            _exchange(ws.root / "d", ws.root / "lnk")
        return real_parent_dir(root, key, **kw)

    monkeypatch.setattr(workspace, "parent_dir", swap_then_open)


async def test_a_folder_swapped_for_a_symlink_after_the_check_redirects_nothing(
    ws: LocalWorkspace, swap: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19 item 8: `d` passes the path check, then becomes a symlink to a folder
    outside before the open; writes, reads and deletes must not reach through it."""
    before = {p.name: p.read_text() for p in swap.iterdir()}
    for act in (
        lambda: ws.write_text("d/new.txt", "pwned"),
        lambda: ws.write_text("d/victim.txt", "pwned"),
        lambda: ws.delete("d/victim.txt"),
        lambda: asyncio.to_thread(ws.read_text, "d/secret.txt"),
    ):
        _swap_after_check(monkeypatch, ws)
        with pytest.raises(PathError, match="symlink") as e:
            await act()
        assert "\n" not in str(e.value)
        monkeypatch.undo()
        _exchange(ws.root / "d", ws.root / "lnk")  # back to the real folder
    assert {p.name: p.read_text() for p in swap.iterdir()} == before
    assert (ws.root / "d" / "victim.txt").read_text() == "inside\n"


def test_a_racing_swap_never_reaches_outside(ws: LocalWorkspace, swap: Path) -> None:
    """Issue 19 item 8 with a real race: a thread exchanges the folder `d` and a symlink
    to outside as fast as it can while writes, reads and deletes go through `d`."""
    try:
        _exchange(ws.root / "d", ws.root / "lnk")
        _exchange(ws.root / "d", ws.root / "lnk")
    except (OSError, AttributeError):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")
    before = {p.name: p.read_text() for p in swap.iterdir()}
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            _exchange(ws.root / "d", ws.root / "lnk")

    flipper = threading.Thread(target=flip)
    flipper.start()
    seen: set[str] = set()
    try:
        for i in range(1000):
            with contextlib.suppress(ToolError):
                ws.write_disk(f"d/f{i % 7}.txt", "pwned")
            with contextlib.suppress(ToolError):
                seen.add(ws.read_text("d/secret.txt"))
            with contextlib.suppress(ToolError):
                ws.delete_disk("d/victim.txt")
    finally:
        stop.set()
        flipper.join()
    assert {p.name: p.read_text() for p in swap.iterdir()} == before
    assert "s3cret\n" not in seen


def _fifo_guard(fifo: Path, fn, timeout: float = 5.0):  # type: ignore[no-untyped-def]
    """Run `fn` in a thread; if it blocks on the FIFO, unblock it and fail."""
    result: list = []
    worker = threading.Thread(target=lambda: result.append(_catch(fn)), daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(timeout)
        pytest.fail(f"{fn} blocked on the FIFO {fifo.name}")
    return result[0]


def _catch(fn):  # type: ignore[no-untyped-def]
    try:
        return fn()
    except ToolError as e:
        return e


async def test_special_files_are_refused_without_blocking(ws: LocalWorkspace) -> None:
    """Issue 19 item 10: read_text on a FIFO blocked the event loop for good; writes
    replaced it. Every access refuses a FIFO at once and leaves it in place."""
    fifo = ws.root / "pipe.txt"
    os.mkfifo(fifo)
    err = _fifo_guard(fifo, lambda: ws.read_text("pipe.txt"))
    assert isinstance(err, ToolError) and "FIFO" in str(err) and "\n" not in str(err)
    err = _fifo_guard(fifo, lambda: ws.write_disk("pipe.txt", "x"))
    assert isinstance(err, ToolError) and "FIFO" in str(err)
    ws.buffers["pipe.txt"] = "buffer"
    assert _fifo_guard(fifo, ws.overlay) == {"pipe.txt": "buffer"}
    del ws.buffers["pipe.txt"]
    os.mkfifo(ws.root / ".gitignore")  # git's rules: a .gitignore that is not a file is not read
    files = _fifo_guard(fifo, lambda: list(walk_files(ws.root)))
    assert files == ["src/app.py"]  # neither FIFO is a file a tool can read
    assert ("pipe.txt", False) in _fifo_guard(fifo, lambda: list(walk(ws.root)))
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


async def test_delete_removes_the_symlink_not_its_target(ws: LocalWorkspace) -> None:
    """Issue 19 item 10: deleting a symlink deleted the file it points to."""
    target = ws.root / "src" / "app.py"
    (ws.root / "alias.py").symlink_to(target)
    (ws.root / "src" / "rel.py").symlink_to("app.py")
    await ws.delete("alias.py")
    await ws.delete("./src//rel.py")
    assert not (ws.root / "alias.py").is_symlink() and not (ws.root / "src" / "rel.py").is_symlink()
    assert target.read_text() == "print('disk')\n"
    assert ws.key("alias.py", follow=False) == "alias.py"


def test_symlink_loops_break_nothing_else(ws: LocalWorkspace) -> None:
    """Issue 19 item 10: one symlink loop made the walk (list_dir, glob) raise for the
    whole workspace. Loops are listed as plain entries and never followed."""
    (ws.root / "self").symlink_to("self")
    (ws.root / "a").symlink_to("b")
    (ws.root / "b").symlink_to("a")
    (ws.root / "src" / "up").symlink_to("..")
    assert list(walk_files(ws.root)) == ["src/app.py"]
    entries = dict(walk(ws.root, include_dirs=True))
    assert entries["self"] is False and entries["a"] is False and entries["src/up"] is True
    with pytest.raises(ToolError) as e:
        ws.read_text("self")
    assert "\n" not in str(e.value)


def test_aliases_have_one_key(ws: LocalWorkspace) -> None:
    """The key is the one spelling of a file that buffers and call ordering use."""
    (ws.root / "alias.py").symlink_to(ws.root / "src" / "app.py")
    for alias in ["src/app.py", "./src/app.py", "src//app.py", "src/../src/app.py", "alias.py"]:
        assert ws.key(alias) == "src/app.py", alias
    assert ws.key("src/") == "src" and ws.key("./") == "."


def test_files_over_the_cap_are_refused_in_one_line(
    ws: LocalWorkspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19 item 13: the file tools load a file whole; above MAX_FILE_BYTES they say so."""
    monkeypatch.setattr(workspace, "MAX_FILE_BYTES", 1000)
    (ws.root / "big.txt").write_text("x" * 1001)
    with pytest.raises(ToolError, match=r"over the 0 MB the file tools load") as e:
        ws.read_text("big.txt")
    assert "\n" not in str(e.value)


async def test_lone_surrogates_are_refused_in_one_line(ws: LocalWorkspace) -> None:
    with pytest.raises(ToolError, match="lone surrogate"):
        await ws.write_text("s.txt", "a\ud800b")
    assert not (ws.root / "s.txt").exists() and not list(ws.root.glob(".*.tmp"))
