"""run_terminal, and the read-only command allowlist behind `--approve safe`.

`run_terminal` hands the command to `run_sandboxed` and formats the outcome as
`exit code N` (or why it was killed) followed by the capped output.

`is_safe_command` answers one question: can this command line be run without
asking the user, because it cannot change any file? It parses the line with
`shlex` and accepts it only if every stage of every pipeline is a known read-only
program with no argument that lets it write (`sed -i`, `find -delete`,
`git diff --output`, `rg --pre` …). Redirections, `;`, `&&`, `||`, background
`&`, command substitution, subshells, variable expansion and globs into
unknown programs are all refused: anything we cannot read with certainty is
unsafe. Test runners (pytest) are deliberately not safe: tests execute
arbitrary project code.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from opencomposer.tools.output import returns_errors
from opencomposer.tools.protocols import ToolContext, ToolError, ToolResult
from opencomposer.tools.sandbox import CommandResult, run_sandboxed

MAX_TIMEOUT_S = 3600.0

# program -> arguments (exact, or prefixes ending in "=") that make it write or execute
SAFE_COMMANDS: dict[str, frozenset[str]] = {
    "ls": frozenset(),
    "cat": frozenset(),
    "head": frozenset(),
    "tail": frozenset(),
    "wc": frozenset(),
    "pwd": frozenset(),
    "echo": frozenset(),
    "printf": frozenset({"-v"}),
    "true": frozenset(),
    "false": frozenset(),
    "which": frozenset(),
    "whoami": frozenset(),
    "date": frozenset({"-s", "--set", "--set="}),
    "uname": frozenset(),
    "file": frozenset({"-C", "--compile"}),
    "stat": frozenset(),
    "du": frozenset(),
    "df": frozenset(),
    "tree": frozenset({"-o", "-R"}),
    "basename": frozenset(),
    "dirname": frozenset(),
    "realpath": frozenset(),
    "diff": frozenset(),
    "cmp": frozenset(),
    "sort": frozenset({"-o", "--output", "--output=", "-T", "--temporary-directory="}),
    "uniq": frozenset(),
    "cut": frozenset(),
    "tr": frozenset(),
    "nl": frozenset(),
    "rg": frozenset({"--pre", "--pre=", "--pre-glob", "--pre-glob="}),
    "grep": frozenset(),
    "egrep": frozenset(),
    "fgrep": frozenset(),
    "find": frozenset(
        {"-delete", "-exec", "-execdir", "-ok", "-okdir", "-fprint", "-fprint0", "-fprintf", "-fls"}
    ),
    "sha256sum": frozenset(),
    "md5sum": frozenset(),
}

# git subcommand -> arguments that make it write
SAFE_GIT: dict[str, frozenset[str]] = {
    "status": frozenset(),
    "diff": frozenset({"--output", "--output=", "--ext-diff"}),
    "log": frozenset({"--output", "--output=", "--ext-diff"}),
    "show": frozenset({"--output", "--output=", "--ext-diff"}),
    "blame": frozenset(),
    "ls-files": frozenset(),
    "rev-parse": frozenset(),
    "grep": frozenset({"-O", "--open-files-in-pager", "--open-files-in-pager="}),
    "branch": frozenset(),  # only the listing forms, checked below
}
_GIT_BRANCH_LISTING = frozenset(
    {"--list", "-l", "-a", "--all", "-r", "--remotes", "-v", "-vv", "--show-current"}
)
_GIT_GLOBAL_WRITERS = ("-c", "--exec-path", "--git-dir", "--work-tree", "-C", "--config-env")

_CONTROL = {
    "|",
    "||",
    "&",
    "&&",
    ";",
    ";;",
    "(",
    ")",
    "<",
    ">",
    ">>",
    "<<",
    "<<<",
    ">|",
    "&>",
    "<&",
    ">&",
    "|&",
    "\n",
}
_SHELL_SPECIAL = set("$`<>;&|(){}\\\n*?[]")


def _tokens(command: str) -> list[str] | None:
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        return list(lexer)
    except ValueError:
        return None


def _unquoted_specials(command: str) -> bool:
    """True if a shell metacharacter other than a plain pipe appears outside single quotes.

    `~` and `#` count only at the start of a word (`HEAD~1` is plain text).
    """
    quote: str | None = None
    prev = " "
    for ch in command:
        if quote == "'":
            if ch == "'":
                quote = None
        elif quote == '"':
            if ch == '"':
                quote = None
            elif ch in "$`\\":
                return True
        elif ch in "'\"":
            quote = ch
        elif ch != "|" and ch in _SHELL_SPECIAL or ch in "~#" and prev in " \t":
            return True
        prev = ch
    return quote is not None


def _writes(arg: str, writers: frozenset[str]) -> bool:
    return any(arg == w or (w.endswith("=") and arg.startswith(w)) for w in writers)


def _stage_safe(words: list[str]) -> bool:
    if not words:
        return False
    prog, args = words[0], words[1:]
    if "/" in prog or "=" in prog:
        return False
    if prog == "git":
        return _git_safe(args)
    if prog not in SAFE_COMMANDS:
        return False
    writers = SAFE_COMMANDS[prog]
    if any(_writes(a, writers) for a in args):
        return False
    return not (prog == "sort" and any(a.startswith("-o") for a in args))


def _git_safe(args: list[str]) -> bool:
    if (
        not args
        or args[0].startswith("-")
        and any(args[0].startswith(w) for w in _GIT_GLOBAL_WRITERS)
    ):
        return False
    while args and args[0] in ("--no-pager", "-P"):
        args = args[1:]
    if not args or args[0] not in SAFE_GIT:
        return False
    sub, rest = args[0], args[1:]
    if any(_writes(a, SAFE_GIT[sub]) for a in rest):
        return False
    if sub == "branch":
        return all(a in _GIT_BRANCH_LISTING for a in rest)
    return True


def is_safe_command(command: str) -> bool:
    """True only for read-only command lines (see the module docstring)."""
    if not command.strip() or _unquoted_specials(command):
        return False
    tokens = _tokens(command)
    if tokens is None:
        return False
    stages: list[list[str]] = [[]]
    for tok in tokens:
        if tok == "|":
            stages.append([])
        elif tok in _CONTROL:
            return False
        else:
            stages[-1].append(tok)
    return all(_stage_safe(stage) for stage in stages)


def format_result(result: CommandResult, timeout_s: float) -> str:
    if result.killed_reason == "timeout":
        head = f"killed: timed out after {timeout_s:g} s"
    elif result.killed_reason == "process limit":
        head = "killed: too many processes (the sandbox's process limit)"
    elif result.killed_reason == "memory limit":
        head = f"killed: out of memory (exit code {result.exit_code})"
    else:
        head = f"exit code {result.exit_code}"
    output = result.output if result.output.strip() else "(no output)"
    return f"{head}\n{output}"


@returns_errors
async def run_terminal(
    ctx: ToolContext, command: str, timeout_s: float | None = None
) -> ToolResult:
    if not command.strip():
        raise ToolError("run_terminal command is empty")
    limit = ctx.sandbox.timeout_s if timeout_s is None else timeout_s
    most = min(MAX_TIMEOUT_S, ctx.sandbox.max_timeout_s)
    if not 0 < limit <= most:
        raise ToolError(f"timeout_s must be between 0 and {most:g}, got {limit:g}")
    result = await run_sandboxed(
        command, root=Path(ctx.workspace.root), config=ctx.sandbox, timeout_s=limit
    )
    text = format_result(result, limit)
    meta = {
        "exit_code": result.exit_code,
        "duration_s": round(result.duration_s, 3),
        "timed_out": result.timed_out,
        "killed_reason": result.killed_reason,
    }
    if result.ok:
        return ToolResult.ok(text, meta=meta)
    return ToolResult.error(text, meta=meta)
