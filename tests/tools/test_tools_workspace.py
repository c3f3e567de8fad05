"""LocalWorkspace: path safety, the buffer overlay, text decoding, atomic writes, the walk."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
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
