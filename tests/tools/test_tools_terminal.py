"""run_terminal through its spec, and the read-only allowlist behind `--approve safe`.

The allowlist is tested per program, table-driven: the forms that must stay
auto-approved, and every writer, executor, file-list and symlink-following option
of that program, which must not.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from opencomposer.tools import specs
from opencomposer.tools.protocols import SandboxConfig, ToolContext, ToolResult
from opencomposer.tools.sandbox import run_sandboxed
from opencomposer.tools.terminal import SAFE_PROGRAMS, is_safe_command
from opencomposer.tools.workspace import LocalWorkspace


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    root = tmp_path / "ws"
    root.mkdir()
    (root / "a.txt").write_text("alpha\n")
    return ToolContext(workspace=LocalWorkspace(root), sandbox=SandboxConfig(timeout_s=20))


async def call(ctx: ToolContext, **raw: str) -> ToolResult:
    spec = specs.get("run_terminal")
    return await spec.run(ctx, spec.validate(raw))


async def test_run_terminal_ok(ctx: ToolContext) -> None:
    r = await call(ctx, command="cat a.txt && echo b > b.txt")
    assert r.status == "ok" and r.output == "exit code 0\nalpha\n"
    assert (ctx.workspace.root / "b.txt").read_text() == "b\n"
    assert r.meta["exit_code"] == 0 and r.meta["timed_out"] is False


async def test_run_terminal_failure_and_no_output(ctx: ToolContext) -> None:
    r = await call(ctx, command="exit 4")
    assert r.status == "error" and r.output == "exit code 4\n(no output)"


async def test_run_terminal_timeout(ctx: ToolContext) -> None:
    r = await call(ctx, command="echo started; sleep 30", timeout_s="0.5")
    assert r.status == "error"
    assert r.output == "killed: timed out after 0.5 s\nstarted\n"
    assert r.meta["timed_out"] is True


async def test_run_terminal_bad_input(ctx: ToolContext) -> None:
    r = await call(ctx, command="   ")
    assert r.status == "error" and "empty" in r.output
    r = await call(ctx, command="true", timeout_s="-1")
    assert r.status == "error" and "timeout_s must be between" in r.output


async def test_run_terminal_caps_output(ctx: ToolContext) -> None:
    ctx.sandbox = SandboxConfig(timeout_s=20, output_limit=1000)
    r = await call(ctx, command="seq 1 100000")
    assert r.output.startswith("exit code 0\n1\n2\n") and r.output.endswith("99999\n100000\n")
    assert "cut from the middle" in r.output and len(r.output) < 1200


# program -> (forms that stay auto-approved, forms that must need approval). The
# second list holds every option of that program that writes a file, runs another
# program, reads a file list or follows symlinks out of the workspace, plus
# operands that write or read outside it.
TABLE: dict[str, tuple[list[str], list[str]]] = {
    "echo": (["echo 'a;b > c'", "echo -n hi", "echo -e 'a\\tb'"], ['echo "$HOME"']),
    "printf": (["printf '%s\\n' a b", "printf -- x"], ["printf -v x '%s' a", "printf -vx y"]),
    "true": (["true", "true --whatever"], []),
    "false": (["false"], []),
    "pwd": (["pwd", "pwd -P"], ["pwd -X"]),
    "ls": (
        ["ls", "ls -la", "ls -lhR src", "ls --color=never -1", "ls -w80 -T 4", "ls -- a.txt"],
        ["ls -L -R", "ls -RL .", "ls --dereference", "ls /", "ls ..", "ls ~", "ls --al"],
    ),
    "cat": (
        ["cat a.txt", "cat -n a.txt", "cat -- -", "cat src/app.py a.txt"],
        ["cat /etc/passwd", "cat ../x", "cat src/../../x", "cat '~/.ssh/id_rsa'"],
    ),
    "head": (
        ["head -n 20 src/app.py", "head -20 a.txt", "head -n5 a.txt", "head --lines=3 a.txt"],
        ["head /etc/shadow", "head --lin=3 a.txt", "head -x a.txt"],
    ),
    "tail": (["tail -n 5 a.txt", "tail -3 a.txt", "tail -n +2 a.txt"], ["tail -f a.txt"]),
    "wc": (
        ["wc -l a.txt b.txt", "wc -lw a.txt", "wc --total=never a.txt"],
        ["wc --files0-from=list", "wc --files0-from list", "wc -l ../b"],
    ),
    "which": (["which python3", "which -a ls"], ["which -x ls"]),
    "whoami": (["whoami"], ["whoami x"]),
    "uname": (["uname -a", "uname -sr"], ["uname x"]),
    "date": (
        ["date", "date +%s", "date -u +%Y-%m-%d", "date -d yesterday", "date -Iseconds"],
        ["date -s 2020-01-01", "date --set=now", "date 010100002000", "date --se=now"],
    ),
    "file": (
        ["file a.txt", "file -b --mime-type a.txt", "file -L link_in"],
        ["file -C", "file --compile", "file -m magic a.txt", "file -f list", "file -z a.txt"]
        + ["file -Z a.txt", "file -S a.txt", "file --no-sandbox a.txt", "file -p a.txt"],
    ),
    "stat": (["stat a.txt", "stat -c %s a.txt", "stat --printf=%n a.txt"], ["stat /etc"]),
    "du": (
        ["du -sh .", "du -a src", "du --max-depth=1", "du -d 1"],
        ["du -L", "du --dereference", "du --files0-from=list", "du ..", "du -X /etc/x"],
    ),
    "df": (["df -h .", "df --output=source ."], ["df --sync", "df /"]),
    "tree": (
        ["tree", "tree -L 2 -a", "tree -aL 2", "tree --dirsfirst src"],
        ["tree -o out.txt", "tree -R -H x", "tree -l", "tree --fromfile list"]
        + ["tree -La 2", "tree -Lo 1 out.html", "tree --infofile=x"],
    ),
    "basename": (["basename src/app.py .py", "basename -a /x/y"], ["basename -q x"]),
    "dirname": (["dirname /x/y"], ["dirname -q x"]),
    "realpath": (["realpath a.txt", "realpath --relative-to=src a.txt"], ["realpath /etc"]),
    "diff": (
        ["diff a.txt b.txt", "diff -u a.txt b.txt", "diff --no-dereference src a.txt"],
        ["diff -l a.txt b.txt", "diff --paginate a.txt b.txt", "diff -r src src2"]
        + ["diff src src2", "diff a.txt /etc/passwd", "diff --from-file=src a.txt"],
    ),
    "cmp": (["cmp a.txt b.txt", "cmp -l a.txt b.txt 1 2"], ["cmp a.txt /etc/passwd"]),
    "sort": (
        ["sort names.txt", "sort -nr -k2,2 -t, a.txt", "sort -u --parallel=2 a.txt"],
        ["sort -o out.txt in.txt", "sort -oout.txt in.txt", "sort -no out a.txt"]
        + ["sort --output=o a.txt", "sort --outp=victim.py /dev/null", "sort --o=x a.txt"]
        + ["sort --compress-program=sh a.txt", "sort --compress-prog=sh a.txt"]
        + ["sort -T dir a.txt", "sort --temporary-directory=d a", "sort --files0-from=f"]
        + ["sort /etc/shadow"],
    ),
    "uniq": (
        ["uniq a.txt", "uniq -c a.txt", "sort names.txt | uniq -c"],
        ["uniq /dev/null victim.py", "uniq a.txt victim.py", "uniq - out", "uniq -c a b"],
    ),
    "cut": (["cut -d, -f1 a.txt", "cut -c1-5 a.txt"], ["cut -f1 /etc/passwd"]),
    "tr": (["tr a-z A-Z", "tr -d '\\r'", "tr -s ' '"], ["tr -x a b"]),
    "nl": (["nl a.txt", "nl -ba a.txt"], ["nl /etc/passwd"]),
    "sha256sum": (["sha256sum a.txt", "sha256sum --tag a.txt"], ["sha256sum -c sums"]),
    "md5sum": (["md5sum a.txt"], ["md5sum --check sums", "md5sum /etc/passwd"]),
    "grep": (
        ["grep -rn TODO . | head -n 20", "grep -i x a.txt", "grep -e -x a.txt", "grep -3 x a"]
        + ["grep -r --include='*.py' x src", "grep -c x -- a.txt", "grep /etc/passwd a.txt"],
        ["grep -R x .", "grep --dereference-recursive x", "grep -r x /home", "grep -r x .."]
        + ["grep -f /etc/x a.txt", "grep -e x /etc/passwd", "grep x a.txt -e y /etc/passwd"]
        + ["grep --exclude-from=../x x", "grep --inc=x y"],
    ),
    "egrep": (["egrep 'a|b' a.txt"], ["egrep -R x"]),
    "fgrep": (["fgrep x a.txt"], ["fgrep x /etc/passwd"]),
    "rg": (
        ["rg -n 'def retry' src", "rg -nS x", "rg --files src", "rg -g '*.py' -t py x"]
        + ["rg -uu -A3 x", "rg --json -e x"],
        ["rg --pre ./evil.sh x", "rg --pre=sh x", "rg --pre-glob '*' x", "rg -z x"]
        + ["rg --search-zip x", "rg -L x", "rg --follow x", "rg --hostname-bin=sh x"]
        + ["rg x /etc", "rg --files /etc", "rg -e x ..", "rg -f /etc/x", "rg --ignore-file=/x x"],
    ),
    "find": (
        ["find . -name '*.py' -type f", "find src -maxdepth 2 -newer a.txt -print"]
        + ["find -P . -newermt 2020-01-01", "find . '(' -name a -o -name b ')' -print0"],
        ["find . -delete", "find . -exec rm '{}' ';'", "find . -execdir ls ';'", "find . -ok ls"]
        + ["find . -okdir ls", "find . -fprint x", "find . -fprint0 x", "find . -fprintf x y"]
        + ["find . -fls x", "find -L .", "find -H .", "find . -follow", "find / -name x"]
        + ["find .. -name x", "find . -newer /etc/passwd", "find . -files0-from x"],
    ),
}

# Shell syntax that can write, run or expand beyond what the words show.
SHELL_UNSAFE = [
    "",
    "rm -rf /",
    "ls; rm a.txt",
    "ls && rm a.txt",
    "ls || rm a.txt",
    "cat a.txt > b.txt",
    "echo hi >> a.txt",
    "cat < a.txt",
    "ls | xargs rm",
    "ls | sh",
    "echo $(rm a.txt)",
    "echo `rm a.txt`",
    "sleep 1 &",
    "(ls)",
    "git status",
    "git diff",
    "git log --oneline -n 5",
    "git grep -Orm -e x",
    "git -c core.pager=sh log",
    "python -m pytest",
    "pytest -q",
    "./script.sh",
    "/bin/ls",
    "FOO=1 ls",
    "ls *.py",
    "cat ~/.ssh/id_rsa",
    "cat a=~/x",
    "echo 'unterminated",
    "ls\nrm a.txt",
    "ls\rx",
    "cat a.txt\x1b",
    "ls # comment",
]


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src2").mkdir()
    (root / "a.txt").write_text("b\na\na\n")
    (root / "b.txt").write_text("a\n")
    (root / "names.txt").write_text("x\ny\n")
    (root / "src" / "app.py").write_text("def retry(): pass\n")
    (root / "link_in").symlink_to("a.txt")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("key\n")
    (root / "link_out").symlink_to(tmp_path / "outside")
    return root


def test_every_allowlisted_program_has_a_table_row() -> None:
    """Adding a program to the allowlist without listing its writer options fails here."""
    assert set(TABLE) == set(SAFE_PROGRAMS) | {"find"}


@pytest.mark.parametrize("command", [c for safe, _ in TABLE.values() for c in safe])
def test_known_safe_forms_pass(command: str, ws: Path) -> None:
    assert is_safe_command(command, ws)


@pytest.mark.parametrize(
    "command", [c for _, unsafe in TABLE.values() for c in unsafe] + SHELL_UNSAFE
)
def test_writers_executors_and_outside_reads_need_approval(command: str, ws: Path) -> None:
    """The allowlist once let `uniq IN OUT`, `sort --outp=F`, `sort --compress-program`,
    `git grep -O` and `cat ~/.ssh/id_rsa` run without asking."""
    assert not is_safe_command(command, ws)


@pytest.mark.parametrize(
    "command",
    ["cat link_out/secret", "grep key link_out/secret", "ls link_out", "wc link_out/../x"]
    + ["find link_out -type f", "rg key link_out", "head -n1 link_out/secret"],
)
def test_symlinks_out_of_the_workspace_need_approval(command: str, ws: Path) -> None:
    """A symlink inside the workspace that points outside is an outside read."""
    assert not is_safe_command(command, ws)


def test_workspace_root_through_a_symlink(ws: Path, tmp_path: Path) -> None:
    alias = tmp_path / "alias"
    alias.symlink_to(ws)
    assert is_safe_command("cat a.txt src/app.py", alias)
    assert not is_safe_command("cat ../outside/secret", alias)


@pytest.mark.parametrize("entry", ["{ws}/.venv/bin", ".venv/bin"])
def test_a_program_of_the_same_name_in_the_workspace_needs_approval(
    entry: str, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a PATH entry inside the workspace (a project venv, a relative entry), `cat`
    would run a file the model may have written, not /usr/bin/cat."""
    (ws / ".venv" / "bin").mkdir(parents=True)
    fake = ws / ".venv" / "bin" / "cat"
    fake.write_text("#!/bin/sh\ntouch pwned\n")
    monkeypatch.setenv("PATH", f"{entry.format(ws=ws)}:{os.environ['PATH']}")
    assert is_safe_command("echo hi", ws) and is_safe_command("ls", ws)
    assert is_safe_command("cat a.txt", ws)  # not executable: bash skips it
    fake.chmod(0o755)
    assert not is_safe_command("cat a.txt", ws)
    assert not is_safe_command("ls | cat", ws)


async def test_safe_forms_change_nothing_when_run(ws: Path) -> None:
    """Judged by effect: every auto-approved example, run in the sandbox, leaves the
    workspace byte for byte as it was."""
    before = _snapshot(ws)
    for command in [c for safe, _ in TABLE.values() for c in safe]:
        await run_sandboxed(command, root=ws, config=SandboxConfig(timeout_s=10))
    assert _snapshot(ws) == before


@pytest.mark.parametrize(
    "command, made",
    [
        ("uniq a.txt victim.py", "victim.py"),
        ("sort --outp=victim.py a.txt", "victim.py"),
        ("find . -name a.txt -fprint victim.py", "victim.py"),
        ("sort --compress-program=./prog -S 1 big.txt", "ran"),
    ],
)
async def test_the_refused_forms_really_write(command: str, made: str, ws: Path) -> None:
    """The refusals above guard real writes: run unapproved, these change the workspace."""
    (ws / "prog").write_text("#!/bin/sh\ntouch ran\ncat\n")
    (ws / "prog").chmod(0o755)
    (ws / "big.txt").write_text("".join(f"{i}\n" for i in range(300)))  # sort spills it
    assert not is_safe_command(command, ws)
    await run_sandboxed(command, root=ws, config=SandboxConfig(timeout_s=10))
    assert (ws / made).exists()


def _snapshot(root: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = (
            f"-> {p.readlink()}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
        )
    return out


async def test_run_terminal_without_bwrap_is_a_clear_error(
    ctx: ToolContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opencomposer.tools import sandbox

    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    r = await call(ctx, command="true")
    assert r.status == "error" and "bubblewrap (bwrap) is not installed" in r.output
    assert "\n" not in r.output


async def test_sandboxed_caches_go_to_private_tmp(ctx: ToolContext) -> None:
    r = await call(ctx, command="echo $XDG_CACHE_HOME; mkdir -p $XDG_CACHE_HOME/x && echo ok")
    assert r.output == "exit code 0\n/tmp/.cache\nok\n"
