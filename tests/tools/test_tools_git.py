"""Git on an untrusted worktree (`tools.git`): none of the repository's programs run.

Guards issue 19 items 2 and 3: a `.git/config` (or a file it includes, or
`.gitattributes`) naming a program made the host-side `git diff` at session start
run it outside the sandbox. Every vector gets a program that leaves a marker file
outside the workspace; the control test shows plain git does run them, so the
other tests can fail.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
from opencomposer.tools import git as safe_git
from opencomposer.tools.git import Git, GitError, run_git, untrusted_overrides

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

HOOKS = ("post-index-change", "pre-commit", "reference-transaction", "post-checkout")


def _git(ws: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(ws), *args], check=True, capture_output=True)


def hostile_repo(base: Path) -> tuple[Path, Path]:
    """A repository whose config names a marker-writing program in every place git
    looks for one; returns (workspace, marker folder)."""
    marks = base / "marks"
    marks.mkdir()
    ws = base / "ws"
    ws.mkdir()
    _git(ws, "init", "-q")
    (ws / "a.txt").write_text("one\n")
    (ws / "b.bin").write_bytes(b"\0\1\2")
    (ws / "m.md").write_text("doc\n")
    _git(ws, "add", ".")
    _git(ws, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")

    def evil(name: str) -> str:
        script = base / f"evil-{name}.sh"
        script.write_text(f"#!/bin/sh\necho ran > {marks}/{name}\ncat\n")
        script.chmod(0o755)
        return str(script)

    hooks = base / "hooks"
    hooks.mkdir()
    for hook in HOOKS:
        for folder in (hooks, ws / ".git" / "hooks"):
            (folder / hook).write_text(f"#!/bin/sh\necho ran > {marks}/hook-{hook}\n")
            (folder / hook).chmod(0o755)
    (base / "host").mkdir()
    (base / "host" / "host-only.txt").write_text("outside the workspace\n")
    (base / "included.cfg").write_text(
        f'[filter "inc"]\n\tclean = {evil("inc-clean")}\n\tsmudge = {evil("inc-smudge")}\n'
        f'[diff "incdiff"]\n\ttextconv = {evil("inc-textconv")}\n'
    )
    config = f"""
[core]
\tfsmonitor = {evil("fsmonitor")}
\thooksPath = {hooks}
\tpager = {evil("pager")}
\tsshCommand = {evil("ssh")}
\teditor = {evil("editor")}
\taskPass = {evil("askpass")}
\talternateRefsCommand = {evil("altrefs")}
\tgitProxy = {evil("proxy")}
\tworktree = {base / "host"}
[diff]
\texternal = {evil("external")}
[diff "evilc"]
\ttextconv = {evil("textconv")}
\tcommand = {evil("diff-command")}
[filter "evil"]
\tclean = {evil("clean")}
\tsmudge = {evil("smudge")}
\trequired = true
[filter "evilp"]
\tprocess = {evil("process")}
[pager]
\tdiff = {evil("pager-diff")}
\tstatus = {evil("pager-status")}
[credential]
\thelper = !{evil("credential")}
[uploadpack]
\tpackObjectsHook = {evil("pack-objects")}
[gpg]
\tprogram = {evil("gpg")}
[log]
\tshowSignature = true
[tar "tar"]
\tcommand = {evil("tar")}
[alias]
\tdiff = !{evil("alias")}
[include]
\tpath = {base / "included.cfg"}
"""
    with (ws / ".git" / "config").open("a") as f:
        f.write(config)
    (ws / ".gitattributes").write_text(
        "*.txt filter=evil diff=evilc\n*.py filter=evilp\n*.md filter=inc diff=incdiff\n"
    )
    (ws / ".git" / "info").mkdir(exist_ok=True)
    (ws / ".git" / "info" / "attributes").write_text("*.bin filter=inc diff=evilc\n")
    (ws / "a.txt").write_text("two\n")  # a tracked change: diff must read it (clean filter)
    (ws / "m.md").write_text("changed doc\n")
    (ws / "new.py").write_text("print(1)\n")  # untracked
    return ws, marks


def _exercise(ws: Path) -> dict[str, bytes]:
    git = Git.find(ws)
    assert git is not None
    out = {
        "head": git.run("rev-parse", "HEAD").stdout,
        "diff": git.run("diff", "--binary", "HEAD").stdout,
        "status": git.run("status", "--porcelain").stdout,
        "untracked": git.run("ls-files", "--others", "--exclude-standard").stdout,
        "log": git.run("log", "-1", "-p", "--format=%H").stdout,
    }
    out["each"] = git.run_each(["diff", "--no-index", "--", "/dev/null"], ["new.py", "m.md"])
    archive = git.run("archive", "--format=tar", "HEAD")
    assert archive.returncode == 0, archive.stderr
    out["archive"] = archive.stdout
    return out


def test_control_plain_git_runs_the_repository_programs(tmp_path: Path) -> None:
    """Without tools.git the same commands run the planted programs (the probe is live)."""
    ws, marks = hostile_repo(tmp_path)
    for args in (["diff", "HEAD"], ["status"], ["archive", "HEAD"]):
        subprocess.run(["git", "-C", str(ws), *args], capture_output=True, timeout=30)
    assert {"fsmonitor", "external"} <= {p.name for p in marks.iterdir()}


@pytest.mark.parametrize("sandbox", [False, True], ids=["config-only", "sandboxed"])
def test_no_repository_program_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sandbox: bool
) -> None:
    """Config layer alone (no bubblewrap) and with the sandbox: no marker, real output."""
    if not sandbox:
        monkeypatch.setattr(safe_git, "_bwrap", lambda: None)
    elif safe_git._bwrap() is None:
        pytest.skip("bubblewrap cannot make namespaces here")
    ws, marks = hostile_repo(tmp_path)
    out = _exercise(ws)
    assert sorted(p.name for p in marks.iterdir()) == []
    assert len(out["head"].strip()) == 40
    assert b"+two" in out["diff"] and b"+changed doc" in out["diff"]
    assert b"a.txt" in out["status"] and b"new.py" in out["untracked"]
    assert b"+print(1)" in out["each"]
    with tarfile.open(fileobj=io.BytesIO(out["archive"])) as archive:
        assert "a.txt" in archive.getnames()
    # core.worktree cannot point git at the rest of the disk
    assert b"host-only" not in out["diff"] + out["status"] + out["untracked"]


def test_lazy_fetch_and_remote_helpers_never_start(tmp_path: Path) -> None:
    """A partial clone with a missing blob and an `ext::` promisor remote: git would
    fetch lazily through the remote's command; no transport may start."""
    ws = tmp_path / "ws"
    marker = tmp_path / "fetched"
    ws.mkdir()
    _git(ws, "init", "-q")
    (ws / "a.txt").write_text("one\n")
    _git(ws, "add", "a.txt")
    _git(ws, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "i")
    blob = subprocess.run(
        ["git", "-C", str(ws), "rev-parse", "HEAD:a.txt"], capture_output=True, text=True
    ).stdout.strip()
    (ws / ".git" / "objects" / blob[:2] / blob[2:]).unlink()
    for key, value in (
        ("core.repositoryformatversion", "1"),
        ("extensions.partialClone", "origin"),
        ("remote.origin.promisor", "true"),
        ("remote.origin.url", f"ext::sh -c touch% {marker}"),
        ("protocol.ext.allow", "always"),
    ):
        _git(ws, "config", key, value)
    (ws / "a.txt").write_text("two\n")
    subprocess.run(["git", "-C", str(ws), "diff", "HEAD"], capture_output=True, timeout=30)
    assert marker.exists()  # control: plain git runs the remote's command
    marker.unlink()
    Git.find(ws).run("diff", "HEAD")  # type: ignore[union-attr]
    assert not marker.exists()


def test_apply_outside_a_repository_writes_only_its_folder(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "f.txt").write_text("hi\n")
    patch = b"--- a/f.txt\n+++ b/f.txt\n@@ -1 +1 @@\n-hi\n+ho\n"
    done = run_git(["apply", "-"], cwd=dest, input=patch, writable=dest)
    assert done.returncode == 0, done.stderr
    assert (dest / "f.txt").read_text() == "ho\n"


def test_trust_follows_scope_and_place() -> None:
    """System and global config files are the user's; anything from the repository, or
    from a "global" file that lies inside the workspace, has its programs blanked."""
    ws = Path("/work/ws")
    listing = b"".join(
        f"{scope}\0file:{origin}\0{key}\n{value}\0".encode()
        for scope, origin, key, value in (
            ("global", "/home/u/.gitconfig", "filter.lfs.clean", "git-lfs clean -- %f"),
            ("global", "/work/ws/.gitconfig", "core.pager", "evil"),
            ("local", ".git/config", "filter.Evil.Name.process", "evil"),
            ("local", "/tmp/included.cfg", "diff.x.textconv", "evil"),
            ("local", ".git/config", "remote.origin.uploadpack", "evil"),
            ("local", ".git/config", "user.name", "someone"),
            ("local", ".git/config", "diff.external", "evil"),
        )
    )
    blanks = dict(untrusted_overrides(listing, [ws]))
    assert "filter.lfs.clean" not in blanks
    assert blanks["core.pager"] == ""
    assert blanks["filter.Evil.Name.process"] == "" and blanks["filter.Evil.Name.clean"] == ""
    assert blanks["filter.Evil.Name.required"] == "false"
    assert blanks["diff.x.textconv"] == "" and blanks["diff.x.command"] == ""
    assert blanks["remote.origin.uploadpack"] == ""
    assert "user.name" not in blanks
    assert "diff.external" not in blanks  # switched off by --no-ext-diff instead


def test_a_fifo_in_the_config_ends_in_an_error_not_a_hang(tmp_path: Path) -> None:
    """`include.path` naming a FIFO blocks git's config read; the command is killed."""
    ws = tmp_path / "ws"
    ws.mkdir()
    _git(ws, "init", "-q")
    fifo = tmp_path / "cfg.fifo"
    os.mkfifo(fifo)
    with (ws / ".git" / "config").open("a") as f:
        f.write(f"[include]\n\tpath = {fifo}\n")
    git = Git.find(ws, timeout=1)
    assert git is not None
    t0 = time.monotonic()
    with pytest.raises(GitError, match="took over"):
        git.run("rev-parse", "HEAD")
    assert time.monotonic() - t0 < 10
