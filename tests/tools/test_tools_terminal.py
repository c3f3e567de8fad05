"""run_terminal through its spec, and the read-only allowlist behind `--approve safe`."""

from __future__ import annotations

from pathlib import Path

import pytest
from opencomposer.tools import specs
from opencomposer.tools.protocols import SandboxConfig, ToolContext, ToolResult
from opencomposer.tools.terminal import is_safe_command
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


SAFE = [
    "ls -la",
    "cat a.txt",
    "head -n 20 src/app.py",
    "git status",
    "git --no-pager diff HEAD~1 -- src",
    "git log --oneline -n 5",
    "git branch --show-current",
    "rg -n 'def retry' src",
    "grep -rn TODO . | head -n 20",
    "pwd",
    "echo 'a;b > c'",
    "find . -name '*.py' -type f",
    "wc -l a.txt b.txt",
    "sort names.txt | uniq -c",
]
UNSAFE = [
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
    'echo "$HOME"',
    "sleep 1 &",
    "(ls)",
    "find . -delete",
    "find . -exec rm {} ;",
    "sort -o out.txt in.txt",
    "sort -oout.txt in.txt",
    "git diff --output=patch.txt",
    "git -c core.pager=sh log",
    "git commit -m x",
    "git branch -D main",
    "git checkout .",
    "rg --pre ./evil.sh x",
    "python -m pytest",
    "pytest -q",
    "./script.sh",
    "/bin/ls",
    "FOO=1 ls",
    "ls *.py",
    "echo 'unterminated",
    "ls\nrm a.txt",
    "tree -o out.txt",
]


@pytest.mark.parametrize("command", SAFE)
def test_safe_commands(command: str) -> None:
    assert is_safe_command(command)


@pytest.mark.parametrize("command", UNSAFE)
def test_unsafe_commands(command: str) -> None:
    assert not is_safe_command(command)


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
