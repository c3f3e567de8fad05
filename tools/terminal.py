"""run_terminal, and the read-only command allowlist behind `--approve safe`.

`run_terminal` hands the command to `run_sandboxed` and formats the outcome as
`exit code N` (or why it was killed) followed by the capped output.

`is_safe_command(command, root)` answers one question: can this command line run
without asking the user, because it can neither change a file, nor run a program
other than itself, nor read outside the workspace? It is judged on what the
command can *do*, not on its name:

- The line is split with `shlex`; it is accepted only if it is one pipeline whose
  every stage is a program in `SAFE_PROGRAMS`. Redirections, `;`, `&&`, `||`,
  background `&`, substitutions, subshells, variables, globs, `~`, comments and
  control characters are refused: anything we cannot read with certainty is unsafe.
- The program bash will find on the sandbox's PATH must lie outside the workspace
  (a `cat` written into a virtual environment inside it, or reached through a
  relative PATH entry, is not the `cat` on this list).
- Each program's options are parsed as GNU getopt would (combined short flags,
  `-n20`, `--lines=20`, `--lines 20`, options after operands) against the list of
  options known to be harmless for *that* program. An unknown option is unsafe,
  and long options must be spelled in full: getopt would expand an abbreviation
  (`sort --outp=F` is `--output`), we do not. So every writer and executor
  (`sort -o/--compress-program`, `find -exec/-delete/-fprint`, `rg --pre`,
  `file -C`, `date -s`, `tree -o`, `diff --paginate` …) needs approval, and so
  does anything added to a program after this list was written.
- File operands and file-valued options must stay in the workspace: absolute
  paths, `~`, and relative paths that resolve (`..`, symlinks) outside `root` are
  unsafe. Options that make a program follow symlinks while it recurses (`grep -R`,
  `rg -L`, `find -L`, `tree -l`, `du -L`, `ls -L`, `diff` on folders without
  `--no-dereference`) are not on the lists. Operands that write are refused by
  count (`uniq IN OUT`) or shape (`date MMDDhhmm` sets the clock).
- `git` is not on the list. Git runs programs named by the repository's own
  configuration (`core.fsmonitor`, `diff.external`, textconv and filter drivers,
  `gpg.program`, `core.pager`), which a workspace can define, and a command line
  cannot reliably switch them all off. Git commands are asked about (an "always"
  answer covers that exact command for the session).
- Test runners and interpreters (pytest, python, make) are never safe: they run
  project code.

Auto-approved commands still run in the sandbox like any other; the allowlist only
decides whether the user is asked first.
"""

from __future__ import annotations

import enum
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opencomposer.tools.output import returns_errors
from opencomposer.tools.protocols import ToolContext, ToolError, ToolResult
from opencomposer.tools.sandbox import CommandResult, run_sandboxed, sandbox_path

MAX_TIMEOUT_S = 3600.0


class Arg(enum.Enum):
    FLAG = "flag"  # takes no value
    TEXT = "text"  # takes a value that is not a file (`-n 20`, `--format=%s`)
    PATH = "path"  # takes a value that names a file it reads
    OPTIONAL = "optional"  # `--color` or `--color=auto`, never a separate word


def _options(spec: str) -> dict[str, Arg]:
    """`-a -n= -f=PATH --color[=]` -> {"-a": FLAG, "-n": TEXT, "-f": PATH, "--color": OPTIONAL}."""
    out: dict[str, Arg] = {}
    for word in spec.split():
        if word.endswith("=PATH"):
            out[word[:-5]] = Arg.PATH
        elif word.endswith("[=]"):
            out[word[:-3]] = Arg.OPTIONAL
        elif word.endswith("="):
            out[word[:-1]] = Arg.TEXT
        else:
            out[word] = Arg.FLAG
    return out


class Operands(enum.Enum):
    PATHS = "paths"  # every operand is a file the program reads
    TEXT = "text"  # operands are strings (echo, tr's sets, basename)
    PATTERN_PATHS = "pattern, paths"  # grep/rg: a pattern first unless -e/-f gave one


@dataclass(frozen=True)
class Program:
    """How one allowlisted program's arguments are read (see the module docstring)."""

    options: dict[str, Arg] = field(default_factory=dict)
    operands: Operands = Operands.PATHS
    parse_options: bool = True  # False: bash builtins that take every word as text
    numeric_short: bool = False  # `head -20`, `grep -3`
    # False where a short option takes its value from the *next* word even inside a
    # cluster (tree: `-La 2` is `-L 2 -a`): such an option must end its cluster.
    attached_values: bool = True
    max_operands: int | None = None
    pattern_from: frozenset[str] = frozenset()  # options that supply the pattern instead
    check: Callable[[list[str], set[str], Path], bool] | None = None  # a last, own rule


_GNU = "--help --version"


def _gnu(spec: str, **kw: Any) -> Program:
    return Program(options=_options(f"{spec} {_GNU}"), **kw)


def _date_operands(operands: list[str], seen: set[str], root: Path) -> bool:
    # `date +FORMAT` prints; `date MMDDhhmm[[CC]YY]` sets the clock.
    return all(op.startswith("+") for op in operands)


def _diff_no_follow(operands: list[str], seen: set[str], root: Path) -> bool:
    # Comparing folders reads the files their symlinks point to, wherever they are.
    if "--no-dereference" in seen:
        return True
    return not any((root / op).is_dir() for op in operands if op != "-")


_GREP = _gnu(
    "-E -F -G -P -i -y -v -w -x -c -L -l -o -q -s -b -H -h -n -T -Z -z -a -I -r -U "
    "-e= -f=PATH -m= -A= -B= -C= -d= -D= "
    "--extended-regexp --fixed-strings --basic-regexp --perl-regexp --regexp= --file=PATH "
    "--ignore-case --no-ignore-case --word-regexp --line-regexp --null-data --no-messages "
    "--invert-match --max-count= --byte-offset --line-number --no-line-number "
    "--line-buffered --with-filename --no-filename --label= --only-matching --quiet "
    "--silent --binary-files= --text --directories= --devices= --recursive --include= "
    "--exclude= --exclude-from=PATH --exclude-dir= --files-without-match "
    "--files-with-matches --count --initial-tab --null --before-context= --after-context= "
    "--context= --color[=] --colour[=] --binary",
    operands=Operands.PATTERN_PATHS,
    numeric_short=True,
    pattern_from=frozenset({"-e", "-f", "--regexp", "--file"}),
)

# bash runs its own of these, whatever PATH holds
_BUILTINS = frozenset({"echo", "printf", "true", "false", "pwd"})

SAFE_PROGRAMS: dict[str, Program] = {
    # bash builtins
    "echo": Program(operands=Operands.TEXT, parse_options=False),
    "true": Program(operands=Operands.TEXT, parse_options=False),
    "false": Program(operands=Operands.TEXT, parse_options=False),
    "printf": Program(operands=Operands.TEXT, parse_options=False),  # `-v VAR`: see _stage_safe
    "pwd": Program(options=_options("-L -P"), operands=Operands.TEXT, max_operands=0),
    # coreutils and friends
    "ls": _gnu(
        "-a -A -b -B -c -C -d -D -f -F -g -G -h -H -i -k -l -m -n -N -o -p -q -Q -r -R -s "
        "-S -t -u -U -v -x -X -Z -1 -I= -T= -w= "
        "--all --almost-all --author --escape --block-size= --ignore-backups --color[=] "
        "--directory --dired --classify[=] --file-type --format= --full-time "
        "--group-directories-first --no-group --human-readable --si "
        "--dereference-command-line --dereference-command-line-symlink-to-dir --hide= "
        "--hyperlink[=] --indicator-style= --inode --ignore= --kibibytes --literal "
        "--numeric-uid-gid --hide-control-chars --show-control-chars --quote-name "
        "--quoting-style= --reverse --recursive --size --sort= --time= --time-style= "
        "--tabsize= --width= --context --zero"
    ),
    "cat": _gnu(
        "-A -b -e -E -n -s -t -T -u -v --show-all --number-nonblank --show-ends --number "
        "--squeeze-blank --show-tabs --show-nonprinting"
    ),
    "head": _gnu(
        "-c= -n= -q -v -z --bytes= --lines= --quiet --silent --verbose --zero-terminated",
        numeric_short=True,
    ),
    "tail": _gnu(
        "-c= -n= -q -v -z --bytes= --lines= --quiet --silent --verbose --zero-terminated",
        numeric_short=True,
    ),
    "wc": _gnu("-c -m -l -L -w --bytes --chars --lines --max-line-length --words --total="),
    "which": _gnu("-a -s", operands=Operands.TEXT),
    "whoami": _gnu("", max_operands=0),
    "uname": _gnu(
        "-a -s -n -r -v -m -p -i -o --all --kernel-name --nodename --kernel-release "
        "--kernel-version --machine --processor --hardware-platform --operating-system",
        max_operands=0,
    ),
    "date": _gnu(
        "-d= -f=PATH -I[=] -R -r=PATH -u --date= --file=PATH --iso-8601[=] --rfc-email "
        "--rfc-3339= --reference=PATH --utc --universal --debug --resolution",
        operands=Operands.TEXT,
        check=_date_operands,
    ),
    "file": _gnu(
        "-b -c -d -E -e= -F= -h -i -k -l -L -n -N -r -s -0 -P= --brief --checking-printout "
        "--exclude= --exclude-quiet= --extension --apple --mime --mime-type --mime-encoding "
        "--keep-going --list --no-dereference --dereference --no-buffer --no-pad --print0 "
        "--raw --special-files --separator= --parameter="
    ),
    "stat": _gnu("-L -f -c= -t --dereference --file-system --format= --printf= --terse --cached="),
    "du": _gnu(
        "-0 -a -b -B= -c -d= -D -h -H -k -l -m -P -S -s -t= -x -X=PATH --null --all "
        "--apparent-size --block-size= --bytes --total --dereference-args --max-depth= "
        "--human-readable --inodes --count-links --no-dereference --separate-dirs --si "
        "--summarize --threshold= --time[=] --time-style= --exclude= --exclude-from=PATH "
        "--one-file-system"
    ),
    "df": _gnu(
        "-a -B= -h -H -i -k -l -P -T -t= -x= --all --block-size= --human-readable --si "
        "--inodes --local --output[=] --portability --print-type --type= --exclude-type= "
        "--total --no-sync"
    ),
    "tree": _gnu(
        "-a -d -f -x -L= -P= -I= -i -q -N -Q -p -u -g -s -h -D -F -v -t -c -U -r -n -C -X -J "
        "-S -A --gitignore --ignore-case --matchdirs --metafirst --prune --noreport "
        "--charset= --si --du --timefmt= --inodes --device --dirsfirst --filesfirst --sort= "
        "--filelimit= --nolinks",
        attached_values=False,
    ),
    "basename": _gnu("-a -s= -z --multiple --suffix= --zero", operands=Operands.TEXT),
    "dirname": _gnu("-z --zero", operands=Operands.TEXT),
    "realpath": _gnu(
        "-e -m -L -P -q -s -z --canonicalize-existing --canonicalize-missing --logical "
        "--physical --quiet --strip --no-symlinks --zero --relative-to=PATH "
        "--relative-base=PATH"
    ),
    "diff": _gnu(
        "-a -b -B -c -C= -d -D= -e -E -f -F= -i -I= -L= -n -N -p -q -s -t -T -u -U= -w -W= "
        "-x= -X=PATH -y -Z --brief --report-identical-files --context[=] --unified[=] --ed "
        "--normal --rcs --side-by-side --left-column --suppress-common-lines "
        "--show-c-function --show-function-line= --label= --expand-tabs --initial-tab "
        "--tabsize= --suppress-blank-empty --new-file --unidirectional-new-file "
        "--ignore-case --ignore-tab-expansion --ignore-trailing-space --ignore-space-change "
        "--ignore-all-space --ignore-blank-lines --ignore-matching-lines= --text "
        "--strip-trailing-cr --minimal --horizon-lines= --speed-large-files --color[=] "
        "--palette= --width= --exclude= --exclude-from=PATH --ifdef= --line-format= "
        "--old-line-format= --new-line-format= --unchanged-line-format= "
        "--old-group-format= --new-group-format= --unchanged-group-format= "
        "--changed-group-format= --no-dereference --ignore-file-name-case "
        "--no-ignore-file-name-case",
        check=_diff_no_follow,
    ),
    "cmp": _gnu(
        "-b -i= -l -n= -s --print-bytes --ignore-initial= --verbose --bytes= --quiet --silent"
    ),
    "sort": _gnu(
        "-b -d -f -g -h -i -M -n -R -r -V -c -C -m -s -u -z -k= -t= -S= "
        "--ignore-leading-blanks --dictionary-order --ignore-case --general-numeric-sort "
        "--ignore-nonprinting --month-sort --human-numeric-sort --numeric-sort --random-sort "
        "--random-source=PATH --reverse --sort= --version-sort --batch-size= --check[=] "
        "--debug --merge --parallel= --stable --unique --zero-terminated --key= "
        "--field-separator= --buffer-size="
    ),
    "uniq": _gnu(
        "-c -d -D -f= -i -s= -u -w= -z --count --repeated --all-repeated[=] --skip-fields= "
        "--group[=] --ignore-case --skip-chars= --unique --zero-terminated --check-chars=",
        max_operands=1,  # the second operand is the file it writes
    ),
    "cut": _gnu(
        "-b= -c= -d= -f= -n -s -z --bytes= --characters= --delimiter= --fields= --complement "
        "--only-delimited --output-delimiter= --zero-terminated"
    ),
    "tr": _gnu(
        "-c -C -d -s -t --complement --delete --squeeze-repeats --truncate-set1",
        operands=Operands.TEXT,
    ),
    "nl": _gnu(
        "-b= -d= -f= -h= -i= -l= -n= -p -s= -v= -w= --body-numbering= --section-delimiter= "
        "--footer-numbering= --header-numbering= --line-increment= --join-blank-lines= "
        "--number-format= --no-renumber --number-separator= --starting-line-number= "
        "--number-width="
    ),
    "sha256sum": _gnu("-b -t -z --binary --text --tag --zero"),
    "md5sum": _gnu("-b -t -z --binary --text --tag --zero"),
    "grep": _GREP,
    "egrep": _GREP,
    "fgrep": _GREP,
    "rg": Program(
        options=_options(
            "-a -b -c -F -H -i -I -l -n -N -o -p -P -q -s -S -u -U -v -w -x -0 -. "
            "-A= -B= -C= -d= -e= -E= -f=PATH -g= -j= -m= -M= -r= -t= -T= "
            "--after-context= --before-context= --context= --binary --block-buffered "
            "--byte-offset --case-sensitive --color= --colors= --column --context-separator= "
            "--count --count-matches --crlf --debug --dfa-size-limit= --encoding= --engine= "
            "--field-context-separator= --field-match-separator= --files "
            "--files-with-matches --files-without-match --fixed-strings --glob= "
            "--glob-case-insensitive --heading --hidden --iglob= --ignore-case "
            "--ignore-file=PATH --ignore-file-case-insensitive --include-zero "
            "--invert-match --json --line-buffered --line-number --line-regexp "
            "--max-columns= --max-columns-preview --max-count= --max-depth= "
            "--max-filesize= --mmap --multiline --multiline-dotall --no-config --no-column "
            "--no-heading --no-filename --no-ignore --no-ignore-dot --no-ignore-exclude "
            "--no-ignore-files --no-ignore-global --no-ignore-messages --no-ignore-parent "
            "--no-ignore-vcs --no-line-number --no-messages --no-mmap --no-pcre2-unicode "
            "--no-require-git --no-unicode --null --null-data --one-file-system "
            "--only-matching --passthru --path-separator= --pcre2 --pretty --quiet "
            "--regex-size-limit= --regexp= --replace= --smart-case --sort= --sortr= "
            "--sort-files --stats --text --threads= --trim --type= --type-not= --type-add= "
            "--type-clear= --type-list --unrestricted --vimgrep --with-filename "
            "--word-regexp --file=PATH --help --version"
        ),
        operands=Operands.PATTERN_PATHS,
        pattern_from=frozenset({"-e", "-f", "--regexp", "--file", "--files", "--type-list"}),
    ),
}


# find: its expression's primaries, by what follows them. -exec, -execdir, -ok,
# -okdir, -delete, -fprint, -fprint0, -fprintf, -fls and -files0-from are absent;
# so are -follow and the leading -L/-H (symlinks followed while descending).
def _words(spec: str) -> frozenset[str]:
    return frozenset(spec.split())


_FIND_FLAGS = _words(
    "-depth -d -mount -xdev -noleaf -ignore_readdir_race -noignore_readdir_race -daystart "
    "-true -false -empty -executable -readable -writable -nouser -nogroup -print -print0 "
    "-ls -prune -quit -not ! -a -and -o -or ( ) , -nowarn -warn --help --version"
)
_FIND_TEXT = _words(
    "-name -iname -path -ipath -wholename -iwholename -regex -iregex -lname -ilname -type "
    "-xtype -size -perm -user -group -uid -gid -links -inum -mtime -mmin -atime -amin "
    "-ctime -cmin -maxdepth -mindepth -used -fstype -regextype -printf -context"
)
_FIND_PATH = _words("-newer -anewer -cnewer -samefile")
_FIND_NEWER = re.compile(r"-newer([aBcm])([aBcmt])")

_SHELL_SPECIAL = set("$`<>;&|(){}\\\n*?[]~")


def _stages(command: str) -> list[list[str]] | None:
    """The words of each stage of a pipeline, split at unquoted `|`; None if unreadable.

    Called after `_unquoted_specials`, so the only operator left outside quotes is
    `|`, and no backslash is left outside single quotes.
    """
    segments, quote, start = [], None, 0
    for i, ch in enumerate(command):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "|":
            segments.append(command[start:i])
            start = i + 1
    segments.append(command[start:])
    try:
        return [shlex.split(seg, posix=True) for seg in segments]
    except ValueError:
        return None


def _unquoted_specials(command: str) -> bool:
    """True if a shell metacharacter other than a plain pipe appears outside quotes
    (in double quotes: `$`, backquote and backslash), a control character anywhere,
    or a `#` that starts a word (a comment)."""
    if any(ord(ch) < 0x20 and ch != "\t" or ord(ch) == 0x7F for ch in command):
        return True
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
        elif ch != "|" and ch in _SHELL_SPECIAL or ch == "#" and prev in " \t":
            return True
        prev = ch
    return quote is not None


def _inside(path: str, root: Path) -> bool:
    """True if `path`, relative to `root`, names something inside it (symlinks followed)."""
    if path == "-":  # standard input
        return True
    if path.startswith(("/", "~")):
        return False
    try:
        resolved = (root / path).resolve()
    except (OSError, RuntimeError):  # a symlink loop
        return False
    return resolved == root or root in resolved.parents


def _parse(prog: Program, args: list[str], root: Path) -> tuple[list[str], set[str]] | None:
    """(operands, options seen), or None if an argument is unknown or reads outside."""
    operands: list[str] = []
    seen: set[str] = set()
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            operands += args[i:]
            break
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            kind = prog.options.get(name)
            if kind is None or kind is Arg.FLAG and eq:
                return None
            if kind in (Arg.TEXT, Arg.PATH) and not eq:
                if i == len(args):
                    return None
                value, i = args[i], i + 1
            if kind is Arg.PATH and not _inside(value, root):
                return None
            seen.add(name)
        elif arg.startswith("-") and arg != "-":
            if prog.numeric_short and arg[1:].isdigit():
                continue
            j = 1
            while j < len(arg):
                name = "-" + arg[j]
                kind = prog.options.get(name)
                if kind is None:
                    return None
                seen.add(name)
                j += 1
                if kind is Arg.FLAG:
                    continue
                value = arg[j:]
                if value and kind is not Arg.OPTIONAL and not prog.attached_values:
                    return None
                if kind in (Arg.TEXT, Arg.PATH) and not value:
                    if i == len(args):
                        return None
                    value, i = args[i], i + 1
                if kind is Arg.PATH and not _inside(value, root):
                    return None
                break
        else:
            operands.append(arg)
    return operands, seen


def _program_safe(prog: Program, args: list[str], root: Path) -> bool:
    if not prog.parse_options:
        return True
    parsed = _parse(prog, args, root)
    if parsed is None:
        return False
    operands, seen = parsed
    if prog.max_operands is not None and len(operands) > prog.max_operands:
        return False
    files = operands
    if prog.operands is Operands.TEXT:
        files = []
    elif prog.operands is Operands.PATTERN_PATHS and not seen & prog.pattern_from:
        files = operands[1:]
    if not all(_inside(f, root) for f in files):
        return False
    return prog.check is None or prog.check(operands, seen, root)


def _find_safe(args: list[str], root: Path) -> bool:
    while args and args[0] == "-P":  # never follow symlinks (the default)
        args = args[1:]
    i = 0
    while i < len(args) and not (args[i].startswith("-") or args[i] in ("(", ")", "!", ",")):
        if not _inside(args[i], root):
            return False
        i += 1
    while i < len(args):
        primary = args[i]
        i += 1
        newer = _FIND_NEWER.fullmatch(primary)
        if primary in _FIND_FLAGS:
            continue
        if primary in _FIND_TEXT or newer and newer.group(2) == "t":
            value = None
        elif primary in _FIND_PATH or newer:
            value = "path"
        else:
            return False
        if i == len(args):
            return False
        if value == "path" and not _inside(args[i], root):
            return False
        i += 1
    return True


def _found_outside(name: str, root: Path) -> bool:
    """True unless the program bash would run for `name` (the first on the sandbox's
    PATH) is a file in the workspace: one the model could have written, perhaps in a
    virtual environment inside it, or through a relative PATH entry."""
    for entry in sandbox_path().split(os.pathsep):
        candidate = os.path.join(root, entry, name)  # an absolute entry replaces root
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            real = os.path.realpath(candidate)
            return not real.startswith(f"{root}{os.sep}")
    return True


def _stage_safe(words: list[str], root: Path) -> bool:
    if not words:
        return False
    name, args = words[0], words[1:]
    if name != "find" and name not in SAFE_PROGRAMS:
        return False
    if name not in _BUILTINS and not _found_outside(name, root):
        return False
    if name == "find":
        return _find_safe(args, root)
    if name == "printf" and args and args[0].startswith("-") and args[0] != "--":
        return False  # `printf -v VAR` assigns; no other option exists
    return _program_safe(SAFE_PROGRAMS[name], args, root)


def is_safe_command(command: str, root: Path | str) -> bool:
    """True only for command lines that cannot write, run other programs, or read
    outside `root` (see the module docstring)."""
    if not command.strip() or _unquoted_specials(command):
        return False
    stages = _stages(command)
    if stages is None:
        return False
    real_root = Path(root).resolve()
    return all(_stage_safe(stage, real_root) for stage in stages)


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
        raise ToolError("command is empty")
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
        "silent": not result.output.strip(),
    }
    if result.ok:
        return ToolResult.ok(text, meta=meta)
    return ToolResult.error(text, meta=meta)
