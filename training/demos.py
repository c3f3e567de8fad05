"""Demonstrations: accepted traces of the *training* tasks, played through the real agent.

The supervised warm start (``opencomposer train --sft`` and the warm-start phase
of RL, ``[sft] source = "demos"``) learns from accepted traces. On a fresh machine
there are none yet, so this module makes them the way a user's session would
produce them: for every training task that ships a ``solution.json`` (the starter
suite does), a ``scripted:`` model plays a short, plausible solution — look
first (``grep`` for the identifier the query names, or ``read_file`` of the files
the query names), then edit (``edit_file`` with the changed lines of each
solution edit, or one ``replace_all`` a file where the edits rename one
identifier across files) or answer — through the production ``Session``, the real tools in
the task's sandboxed workspace (``EnvironmentServer.run_episode``) and a real
``TraceStore``. The stored trace is therefore byte-for-byte what a live session
stores: the system prompt (in the style the sampler will be prompted with), the
tool results as the tools rendered them, the edits. A demonstration whose
episode is graded ``resolved`` is marked accepted (its edits ``accept``-ed, and
``meta.accepted``); the rest are kept but not accepted, and counted.

Corpus tasks get an engineer's session instead (`expert_plan`): reproduce, locate,
read, edit, rerun, answer; a share of them first make a wrong edit, see the rerun fail
and correct it, with the wrong edit's turn kept out of the loss.

Held-out tasks are refused (``DemoError``): their solutions are never read.

    python -m opencomposer.training.demos --suite starter:train --db demos.db \\
        [--prompt-style compact] [--max N]   # tops up to N, round-robin over projects

A training run (``[sft] source = "demos"``) records into ``<run>/demos.db`` the same
way, so demonstrations recorded ahead of it with the run's prompt style count there.
"""

from __future__ import annotations

import ast
import asyncio
import difflib
import functools
import hashlib
import json
import random
import re
import shlex
import tarfile
import tempfile
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opencomposer.tools.specs import (
    CODEBASE_SEARCH,
    EDIT_FILE,
    GREP,
    READ_FILE,
    RUN_TERMINAL,
    render_call,
)
from opencomposer.training.sessions import DEMO_MAX_TURNS, demo_session_config

SOLUTION = "solution.json"


class DemoError(ValueError):
    """A task that cannot be demonstrated (held-out, or no usable solution); one line."""


@dataclass(kw_only=True)
class DemoStats:
    recorded: int = 0
    accepted: int = 0
    skipped: int = 0  # training tasks without a solution.json, or whose request leads nowhere
    failed: list[str] = field(default_factory=list)  # task ids whose demo did not resolve
    session_ids: list[str] = field(default_factory=list)  # the accepted ones


def load_solution(task: Any, *, reference: bool = False) -> dict[str, Any] | None:
    """The task's ``solution.json``; None if it has none. Refuses held-out tasks, unless
    for a ``reference`` session (`record_demos`), which nothing ever trains on."""
    if getattr(task, "split", "") == "heldout" and not reference:
        raise DemoError(f"task {task.id} is held out: its solution is never used")
    path = Path(task.dir) / SOLUTION
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise DemoError(f"{path}: not JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("edits", []), list):
        raise DemoError(f"{path}: expected {{answer, edits: [{{path, old, new}}]}}")
    return data


# ---------------------------------------------------------------- the scripted turns


def _edit_call(path: str, old: str, new: str, *, replace_all: bool = False) -> str:
    flag = {"replace_all": True} if replace_all else {}
    return render_call(EDIT_FILE, path=path, **flag, old=old, new=new)


def renamed_word(old: str, new: str) -> tuple[str, str] | None:
    """``(a, b)`` when ``new`` is ``old`` with every ``a`` replaced by ``b`` (one
    identifier renamed, several times); None otherwise."""
    words = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
    a, b = words.findall(old), words.findall(new)
    pairs = {(x, y) for x, y in zip(a, b, strict=False) if x != y}
    if len(a) != len(b) or len(pairs) != 1:
        return None
    ((x, y),) = pairs
    if old.replace(x, y) != new:
        return None
    return x, y


def line_edits(path: str, old: str, new: str) -> list[tuple[str, str]]:
    """The solution edit ``old -> new`` (often a whole file) as small search/replace
    pairs: each block of changed lines, widened with neighbours until it is unique
    in the file, so that ``edit_file`` accepts it and the model sees local edits."""
    if old not in new and "\n" not in old.strip("\n"):
        return [(old, new)]  # already a one-line edit
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    pairs = []
    sm = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            continue
        lo, hi, blo, bhi = i1, i2, j1, j2
        while True:
            o = "".join(a[lo:hi]).rstrip("\n")
            if o and old.count(o) == 1:
                break
            if lo == 0 and hi == len(a):
                break
            if lo > 0:
                lo, blo = lo - 1, blo - 1
            if hi < len(a):
                hi, bhi = hi + 1, bhi + 1
        pairs.append(("".join(a[lo:hi]).rstrip("\n"), "".join(b[blo:bhi]).rstrip("\n")))
    return pairs


@dataclass(frozen=True)
class Plan:
    """A demonstration: the assistant turns the scripted model plays, the turns the
    policy must not learn from (``untrained``: a wrong first edit, played so that the
    session shows its test still failing) and the turns whose test run must fail for
    the story the next turns tell to be true (``must_fail``); indices into ``turns``.
    ``grounded`` maps a turn's index to the broken lines it fixes (`TracebackTurn`):
    played, that turn first says where the traceback points when it points at one, or
    else the error a failed run printed."""

    turns: list[str]
    untrained: tuple[int, ...] = ()
    must_fail: tuple[int, ...] = ()
    grounded: dict[int, tuple[tuple[str, int, str], ...]] = field(default_factory=dict)

    def played(self) -> list[str | TracebackTurn]:
        """The turns as the scripted model plays them."""
        return [
            TracebackTurn(t, self.grounded[i]) if i in self.grounded else t
            for i, t in enumerate(self.turns)
        ]


# A frame of a pytest traceback (``--tb=short``: "src/pkg/mod.py:42: in func"; long
# and native tracebacks differ, and are not read).
_FRAME = re.compile(r"^(?P<path>\S+?\.py):(?P<line>\d+): in \S+", re.M)
_RUN_RESULT = re.compile(
    rf'<tool_result name="{RUN_TERMINAL}"[^>]*>\n(?P<out>.*?)\n</tool_result>', re.S
)


def last_run_output(user_messages: Sequence[str]) -> str:
    """The output of the latest ``run_terminal`` call among a conversation's user
    messages (their contents; tool results come back as user messages), '' if none."""
    for content in reversed(user_messages):
        outs = [r.group("out") for r in _RUN_RESULT.finditer(content)]
        if outs:
            return "\n".join(outs)
    return ""


def traceback_frame(output: str, files: Collection[str]) -> tuple[str, int, str] | None:
    """The deepest frame of the pytest traceback in ``output`` that is in one of
    ``files`` (workspace paths): the file, the line and the source line pytest printed
    under it (stripped). None when the traceback does not reach those files (a failed
    assertion in the test)."""

    def file_of(frame: str) -> str | None:
        return next((p for p in files if frame == p or frame.endswith("/" + p)), None)

    deepest = None
    for m in _FRAME.finditer(output):
        path = file_of(m.group("path"))
        if path is not None:
            rest = output[m.end() :].split("\n", 2)
            source = rest[1].strip() if len(rest) > 1 else ""
            deepest = (path, int(m.group("line")), source)
    return deepest


def traceback_site(
    output: str, sites: Sequence[tuple[str, int, str]]
) -> tuple[str, int, str] | None:
    """The site among ``sites`` (path, line, code) at which the traceback in ``output``
    stops: its deepest frame in any of the sites' files is at that line. None when it
    does not reach those files or stops at another line of them (the bug only shows
    later)."""
    frame = traceback_frame(output, {path for path, _, _ in sites})
    return next((s for s in sites if frame and frame[:2] == s[:2]), None)


# The first error line pytest prints for a failure ("E   AssertionError: assert 4 == 3").
_ERROR = re.compile(r"^E {2,}(?P<error>\S.*)$", re.M)
ERROR_CHARS = 120  # longer error lines are cut, with "…"


def failure_line(output: str) -> str | None:
    """The first ``E`` line of a pytest failure in ``output``, stripped, with backticks
    made quotes and cut to `ERROR_CHARS`; None when it has none."""
    m = _ERROR.search(output)
    if m is None:
        return None
    error = m.group("error").strip().replace("`", "'")
    return error if len(error) <= ERROR_CHARS else error[: ERROR_CHARS - 1].rstrip() + "…"


@dataclass(frozen=True)
class TracebackTurn:
    """A fixing turn that reads the failing run first. When the traceback stops at one
    of the lines it fixes, it starts by saying so ("The traceback points to line 42 of
    pkg/mod.py: `return x[i + 1]`."), so the policy learns that the last frame in the
    code is where to look; otherwise, when the run failed, it starts with the error
    pytest reported ("The test fails with `assert 4 == 3`."), so the edit follows from
    what the run showed (and every fixing turn after a run opens alike). Without a run,
    it is ``text`` as planned. A ``scripted:`` turn: called with the conversation so far."""

    text: str
    sites: tuple[tuple[str, int, str], ...]

    def __call__(self, messages: list[Any]) -> str:
        said = [m.content for m in messages if m.role == "user"]
        output = last_run_output(said)
        site = traceback_site(output, self.sites)
        if site is not None:
            path, line, code = site
            return f"The traceback points to line {line} of {path}: `{code}`. {self.text}"
        error = failure_line(output)
        return f"The test fails with `{error}`. {self.text}" if error else self.text


def demo_turns(task: Any, solution: dict[str, Any]) -> list[str]:
    """The assistant turns of `demo_plan`."""
    return demo_plan(task, solution).turns


def demo_plan(task: Any, solution: dict[str, Any], *, recovery: bool | None = None) -> Plan:
    """A short demonstration: look, then edit, then answer. A corpus task (its solution
    names the buggy ``functions``) gets an engineer's session instead: `expert_plan`
    (``recovery``: see there)."""
    if solution.get("functions"):
        return expert_plan(task, solution, recovery=recovery)
    return Plan(turns=_short_turns(task, solution))


def _short_turns(task: Any, solution: dict[str, Any]) -> list[str]:
    query: str = task.query
    edits = [e for e in solution.get("edits", []) if isinstance(e, dict)]
    answer = str(solution.get("answer", "")).strip() or "Done."
    named = re.findall(r"`([A-Za-z_][A-Za-z0-9_.]*)`", query)
    turns: list[str] = []
    paths = list(dict.fromkeys(str(e["path"]) for e in edits))
    if edits and all(p in query for p in paths):
        calls = "\n".join(render_call(READ_FILE, path=p) for p in paths)
        turns.append(f"Let me read {', '.join(paths)}.\n{calls}")
    elif edits and named:
        turns.append(f"Let me find every use of {named[0]}.\n{render_call(GREP, pattern=named[0])}")
    elif edits:
        calls = "\n".join(render_call(READ_FILE, path=p) for p in paths)
        turns.append(f"Let me read the files.\n{calls}")
    else:  # an answer-only task: search for the word of the answer the query names
        words = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", answer)
        key = next((w for w in words if w in query and len(w) > 2), None)
        if key:
            turns.append(f"Let me search for {key}.\n{render_call(GREP, pattern=key)}")
    if edits:
        renames = {renamed_word(str(e["old"]), str(e["new"])) for e in edits}
        rename = renames.pop() if len(edits) > 1 and len(renames) == 1 else None
        calls = []
        for e in edits:
            path, old, new = str(e["path"]), str(e["old"]), str(e["new"])
            if rename:  # one identifier renamed across files: one replace_all a file
                calls.append(_edit_call(path, *rename, replace_all=True))
            else:
                calls += [_edit_call(path, o, n) for o, n in line_edits(path, old, new)]
        turns.append("\n".join(calls))
    turns.append(answer)
    return turns


# ---------------------------------------------------------------- an engineer's session

# The pytest options the verify command adds for the harness; a person leaves them out.
_HARNESS_OPTS = ("-q", "-x", "-p", "no:cacheprovider", "no:xdist", "no:randomly")

# A file this short is read whole; a longer one is searched first, then read in part.
SMALL_FILE_LINES = 100


def pytest_command(task: Any, targets: Sequence[str] = (), *, k: str | None = None) -> str:
    """The command an engineer types to run tests: plain ``python -m pytest`` (the
    workspace's conftest puts its paths on sys.path) with the project's own options,
    short tracebacks and ``-x``, on ``targets`` (test ids or files), or on the tests
    whose names match ``k``."""
    words = shlex.split(task.verify)
    try:
        at = words.index("pytest")
    except ValueError:
        return task.verify
    protect = set(getattr(task, "protect", ()) or ())
    keep, skip = [], False
    for w in words[at + 1 :]:
        if skip:
            skip = False
        elif w == "-p":
            skip = True  # with its plugin name
        elif w not in _HARNESS_OPTS and w not in protect:
            keep.append(w)
    select = ["-k", k] if k else []
    return " ".join(
        shlex.quote(w)
        for w in ["python", "-m", "pytest", "-x", "-q", "--tb=short", *keep, *select, *targets]
    )


@dataclass(frozen=True)
class Request:
    """What a request tells an engineer, read from its text alone (never the solution):
    the failing test's id, or only its name; the functions it names, with their files
    where it gives them."""

    test_id: str = ""
    test_name: str = ""
    functions: dict[str, str] = field(default_factory=dict)  # name -> path ("" unknown)


_TEST_ID = re.compile(r"`([\w./-]+\.py(?:::[\w\[\]./-]+)+)`")
_TEST_NAME = re.compile(r"\b(test_\w+)\b")
_IN_FILE = re.compile(r"\b([A-Za-z_][\w.]*) in ([\w./-]+\.py)\b")
_SUBJECT = re.compile(r"`([A-Za-z_][\w.]*)`")


def read_request(query: str) -> Request:
    """The test and the functions ``query`` names (see `Request`)."""
    first = query.split("```", 1)[0]  # the request, not the output it quotes
    test_id = next(iter(_TEST_ID.findall(first)), "")
    name = test_id.split("::")[-1].split("[")[0] if test_id else ""
    if not name:
        name = next(iter(_TEST_NAME.findall(first)), "")
    functions = {f: p for f, p in _IN_FILE.findall(first) if not f.startswith("test_")}
    if not functions:
        functions = {f: "" for f in _SUBJECT.findall(first) if "::" not in f and f != name}
    return Request(test_id=test_id, test_name=name, functions=functions)


def _source(task: Any, path: str) -> str:
    """The text of ``path`` in the task's (broken) workspace; "" when absent."""
    try:
        with tarfile.open(task.repo_tar) as tar:
            member = tar.extractfile(path)
            return member.read().decode("utf-8") if member else ""
    except (OSError, KeyError, tarfile.TarError, UnicodeDecodeError):
        return ""


def _functions(text: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


# A read after a grep starts at the hit and takes this many lines: the policy cannot know
# how long a function is before it reads it, so the window does not depend on that.
READ_WINDOW = 40


def function_lines(
    task: Any, path: str, line: int, *, window: int = READ_WINDOW
) -> tuple[int, int]:
    """The lines an engineer reads to see ``line`` of the task's workspace file: from
    the ``def`` line of the innermost function around it (where a grep for it lands),
    ``window`` lines; longer only when ``line`` lies further down, to show it. A
    window around ``line`` when the file does not parse."""
    best: tuple[int, int] | None = None
    for node in _functions(_source(task, path)):
        lo, hi = node.lineno, node.end_lineno or node.lineno
        if lo <= line <= hi and (best is None or hi - lo < best[1] - best[0]):
            best = (lo, hi)
    if best is None:
        return max(1, line - window // 2), line + window // 2
    lo = best[0]
    return lo, max(lo + window - 1, line + 5)


def test_lines(task: Any, test_id: str) -> tuple[str, int, int, str] | None:
    """``(file, first, last, source)`` of the test function ``test_id`` names."""
    file, *rest = test_id.split("::")
    name = rest[-1].split("[")[0] if rest else ""
    text = _source(task, file)
    for node in _functions(text):
        if node.name == name:
            hi = node.lineno + READ_WINDOW - 1
            end = min(node.end_lineno or hi, hi)  # what the read shows of the test
            body = "\n".join(text.splitlines()[node.lineno - 1 : end])
            return file, node.lineno, hi, body
    return None


# The bug kinds of `training/mining.py`, as a reviewer would name them.
_KIND_PHRASES = {
    "flipped comparison": "a flipped comparison",
    "off-by-one bound": "an off-by-one bound",
    "off-by-one index": "an off-by-one index",
    "wrong operator": "a wrong operator",
    "dropped factor": "a dropped factor",
    "changed constant": "a changed constant",
    "dropped call": "a dropped call",
    "dropped branch": "a dropped branch",
    "dropped return": "a dropped return",
    "wrong return value": "a wrong return value",
    "and/or swapped": "an `and`/`or` mix-up",
    "dropped negation": "a dropped `not`",
    "negated condition": "a negated condition",
    "swapped arguments": "swapped arguments",
    "wrong variable": "a wrong variable",
}


def _kind_words(kind: str) -> str:
    parts = kind.removeprefix("two-site: ").split(" + ")
    return " and ".join(_KIND_PHRASES.get(p, f"a bug ({p})") for p in parts)


# Code tokens for `change_words`: numbers (``2.0`` whole), names, Python's two-character
# operators, then any other single character.
_CODE_TOKEN = re.compile(
    r"\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\w+|\*\*=?|//=?|->|:=|[=!<>+\-*/%&|^@]=|<<|>>|\s+|.", re.S
)
CHANGE_WORDS_MAX = 60  # longer sides (a dropped branch's lines) are not spelled out


def _changed_span(old: str, new: str) -> tuple[str, str] | None:
    """The smallest span of whole code tokens in which ``old`` and ``new`` differ, as
    ``(was, now)``, widened by one neighbour token where one side would be empty. None
    when nothing changes, or a side spans lines or is longer than `CHANGE_WORDS_MAX`."""
    a, b = _CODE_TOKEN.findall(old), _CODE_TOKEN.findall(new)
    codes = [
        c
        for c in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes()
        if c[0] != "equal"
    ]
    if not codes:
        return None
    i1, i2, j1, j2 = codes[0][1], codes[-1][2], codes[0][3], codes[-1][4]

    def solid(i: int, toks: list[str]) -> bool:
        return 0 <= i < len(toks) and not toks[i].isspace()

    def span(lo: int, hi: int, toks: list[str]) -> str:
        return "".join(toks[lo:hi]).strip()

    if not span(i1, i2, a) or not span(j1, j2, b):  # widen both sides by a neighbour
        left = i1 - 1
        while left >= 0 and a[left].isspace():
            left -= 1
        if solid(left, a):
            j1 -= i1 - left
            i1 = left
        else:
            right = i2
            while right < len(a) and a[right].isspace():
                right += 1
            if not solid(right, a):
                return None
            j2 += right + 1 - i2
            i2 = right + 1
    was, now = span(i1, i2, a), span(j1, j2, b)
    if not was or not now or was == now:
        return None
    if "\n" in was + now or max(len(was), len(now)) > CHANGE_WORDS_MAX or "`" in was + now:
        return None
    return was, now


def change_words(old: str, new: str) -> str | None:
    """The edit ``old -> new`` said as the engineer would before making it: "`<` should
    be `<=`", the span `_changed_span` finds (a dropped ``not``: "`if` should be `if
    not`"); None where it finds none.

    Said before the ``edit_file`` call, the change is decided where the policy writes
    it in words, and the call copies it; otherwise the one changed token hides among
    the copied ones, and a small model learns to copy ``<old>`` unchanged."""
    found = _changed_span(old, new)
    return None if found is None else f"`{found[0]}` should be `{found[1]}`"


def quoted_line(old: str, new: str) -> str | None:
    """The first line that ``old -> new`` changes, stripped, as the fixing turn quotes
    it; None where there is none, or it is too long or holds a backquote to quote."""
    a, b = old.splitlines(), new.splitlines()
    sm = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    changed = [
        a[i].strip()
        for tag, i1, i2, _, _ in sm.get_opcodes()
        if tag != "equal"
        for i in range(i1, i2)
    ]
    line = changed[0] if changed else ""
    if not line or len(line) > CHANGE_WORDS_MAX or "`" in line:
        return None
    return line


def said_change(old: str, new: str) -> str | None:
    """`change_words` with the line it changes quoted first ("in `return None`, `None`
    should be `value`"), so that the ``edit_file`` call after it copies both its
    ``<old>`` line and the change from the sentence just written. Without the quote
    (the change is the whole line, or the line is long) it is `change_words` alone;
    None where that is."""
    found = _changed_span(old, new)
    if found is None:
        return None
    words = f"`{found[0]}` should be `{found[1]}`"
    line = quoted_line(old, new)
    if not line or line == found[0]:
        return words
    return f"in `{line}`, {words}"


def _locate_pattern(function: str) -> str:
    """A grep pattern for a function's definition (a method's, dunders included, by its
    own name: the read then starts at the hit)."""
    return rf"def {function.rsplit('.', 1)[-1]}\b"


# The grep tool shows this many matches (tools/search.py's GREP_MAX_SHOWN); a hit past
# it is not on the screen to be chosen.
GREP_SHOWN = 200


def _py_files(task: Any, scope: str = "") -> dict[str, str]:
    """The task's workspace ``.py`` files under ``scope`` (a file or a folder; "" for
    all), path -> text, in path order: what a ``grep`` over them reads."""
    try:
        st = Path(task.repo_tar).stat()
        every = _tar_py_files(str(task.repo_tar), st.st_mtime_ns, st.st_size)
    except (OSError, tarfile.TarError):
        return {}
    top = scope.rstrip("/") + "/"
    return {k: v for k, v in every.items() if not scope or k == scope or k.startswith(top)}


@functools.lru_cache(maxsize=8)
def _tar_py_files(tar_path: str, mtime_ns: int, size: int) -> dict[str, str]:
    """Every ``.py`` file of a workspace tar, path -> text, in path order; read once per
    version of the tar (one plan greps its files several times)."""
    out: dict[str, str] = {}
    with tarfile.open(tar_path) as tar:
        for m in tar.getmembers():
            name = m.name.removeprefix("./")
            member = tar.extractfile(m) if m.isfile() and name.endswith(".py") else None
            if member is not None:
                out[name] = member.read().decode("utf-8", "replace")
    return dict(sorted(out.items()))


def grep_hits(task: Any, pattern: str, scope: str = "") -> list[tuple[str, int, str]]:
    """``(path, line, text)`` of each line of the task's ``.py`` files matching
    ``pattern``, in the order the grep tool lists them (path, then line)."""
    regex = re.compile(pattern)
    return [
        (path, n, text)
        for path, source in _py_files(task, scope).items()
        for n, text in enumerate(source.split("\n"), 1)
        if regex.search(text)
    ]


def _is_test_file(path: str) -> bool:
    parts = Path(path).parts
    name = parts[-1] if parts else ""
    return (
        any(p in ("test", "tests", "testing") for p in parts[:-1])
        or name.startswith("test_")
        or name.endswith("_test.py")
        or name == "conftest.py"
    )


def locate_call(
    task: Any, function: str, path: str, line: int, *, scope: str = "", seen: str = ""
) -> str:
    """The ``grep`` call that finds the definition of ``function`` (at ``line`` of
    ``path``) so that which hit to read next follows from its listing alone, never from
    the solution:

    - ``def NAME`` when it has one hit in ``scope`` (a file, or every ``.py`` file);
    - else, where ``seen`` (what the session showed: the request, the test read) names
      the owner (``Owner.NAME``: its class, or the function it is nested in),
      ``class Owner|def NAME``: the hit to read is the first ``def NAME`` after the
      owner's line, in the owner's file;
    - else ``def NAME`` when exactly one of its hits is outside the tests.

    Raises `DemoError` when none of these picks the definition: reading the right one
    of several hits would teach guessing."""
    parts = function.split(".")
    name = parts[-1]
    plain = _locate_pattern(function)
    site = (path, function_lines(task, path, line)[0])
    hits = grep_hits(task, plain, scope)
    if [h[:2] for h in hits] == [site]:
        return _grep_call(plain, scope)
    owner = parts[-2] if len(parts) > 1 else ""
    if owner and re.search(rf"\b{re.escape(owner)}\b", seen):
        text = _source(task, path)
        word = "class" if re.search(rf"^\s*class {re.escape(owner)}\b", text, re.M) else "def"
        pattern = rf"{word} {owner}\b|{plain}"
        anchor = re.compile(rf"^\s*(?:async\s+)?{word} {re.escape(owner)}\b")
        shown = grep_hits(task, pattern, scope)[:GREP_SHOWN]
        pick, in_file = None, ""
        for p, n, text_line in shown:
            if anchor.search(text_line):
                in_file = p
            elif p == in_file and re.search(plain, text_line):
                pick = (p, n)
                break
        if pick == site:
            return _grep_call(pattern, scope)
    outside = [h[:2] for h in hits[:GREP_SHOWN] if not _is_test_file(h[0])]
    if outside == [site]:
        return _grep_call(plain, scope)
    if site not in [h[:2] for h in hits]:
        raise DemoError(
            f"task {task.id}: a grep for `def {name}` does not find its definition at "
            f"{site[0]}:{site[1]}"
        )
    raise DemoError(
        f"task {task.id}: a grep finds {len(hits)} definitions of {name} and nothing the "
        "session shows tells which one is meant"
    )


def _grep_call(pattern: str, scope: str) -> str:
    if scope.endswith(".py"):
        return render_call(GREP, pattern=pattern, path=scope)
    return render_call(GREP, pattern=pattern, glob="*.py")


def _called_name(function: str) -> str:
    """The word a caller of ``function`` writes: its name, or its class for a dunder."""
    parts = function.split(".")
    if parts[-1].startswith("__") and parts[-1].endswith("__") and len(parts) > 1:
        return parts[-2]
    return parts[-1]


def _upper_first(text: str) -> str:
    """``text`` as a sentence's start (``str.capitalize`` would lower the rest: code)."""
    return text[:1].upper() + text[1:]


def _say(rng: random.Random, options: Sequence[str], calls: Sequence[str]) -> str:
    return "\n".join([rng.choice(options), *calls])


# A share of the one-edit demonstrations make a plausible wrong fix first, rerun the
# test, see it still fail and correct the edit: the policy sees a failing rerun lead to
# another look at the code, never to an answer that claims success. The wrong edit's
# turn is played (the session must show its failure) but not trained on.
RECOVERY_SHARE = 0.5
# Half of those make the trained policy's commonest failure instead: the edit that says
# the change and then sends <old> back as <new>. The tool refuses it ("old and new are
# the same"), and the next turn makes the edit with the change in <new>. As above, the
# failing turn is played, not trained on: the policy learns the way out of it.
UNCHANGED_SHARE = 0.5
# Of the wrong-edit recoveries whose session has room for it, this share tries two wrong
# changes before the right one: the policy sees that a second failure, too, leads to
# another attempt while turns remain.
TWICE_SHARE = 0.4
# Of the recoveries whose fix quotes lines around the broken one because that line alone
# occurs more than once in the file, this share first sends the broken line alone, as
# the trained policy does: the tool refuses it and lists the matches with a line either
# side, and the next turn quotes the lines around the right one. The refused turn is
# played, not trained on.
AMBIGUOUS_SHARE = 0.6


def wrong_fix(task: Any, edit: dict[str, Any]) -> str | None:
    """What a plausible wrong first attempt leaves in place of the solution edit's
    broken lines: another bug-like change inside them (a mutation `mining` would make),
    neither the broken text nor the fix, and unique in the file once made (so the
    correcting ``edit_file`` applies). None when the lines allow no such change."""
    found = wrong_fixes(task, edit, 1)
    return found[0] if found else None


def wrong_fixes(task: Any, edit: dict[str, Any], n: int) -> list[str]:
    """Up to ``n`` distinct wrong attempts (`wrong_fix`), in a seeded order."""
    from opencomposer.training import mining

    path, old, fixed = str(edit["path"]), str(edit["old"]), str(edit["new"])
    source = _source(task, path)
    if not old or source.count(old) != 1:
        return []
    data = source.encode()
    a = data.index(old.encode())
    b = a + len(old.encode())
    every = {n.lineno: ["demo"] for n in _functions(source)}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "module.py").write_bytes(data)
        found = mining.find_mutations(Path(tmp), "module.py", every, check=False)
        inside = [m for m in found if a <= m.start and m.end <= b and m.checked()]
    options: list[str] = []
    for m in inside:
        wrong = (data[a : m.start] + m.new.encode() + data[m.end : b]).decode()
        if wrong in (old, fixed) or wrong in options:
            continue
        if source.replace(old, wrong).count(wrong) == 1:
            options.append(wrong)
    rng = random.Random(hashlib.sha1(f"{task.id}|wrong".encode()).hexdigest())
    return rng.sample(sorted(options), min(n, len(options)))


def ambiguous_line(task: Any, edit: dict[str, Any]) -> tuple[str, str, int] | None:
    """(the broken line, its fix, how often the file holds it) when the solution edit
    quotes lines around one changed line because that line alone is not unique in the
    file; None otherwise."""
    old, new = str(edit["old"]).split("\n"), str(edit["new"]).split("\n")
    changed = [i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b]
    if len(old) < 2 or len(old) != len(new) or len(changed) != 1:
        return None
    line = old[changed[0]]
    count = _source(task, str(edit["path"])).count(line) if line.strip() else 0
    return (line, new[changed[0]], count) if count > 1 else None


def expert_plan(task: Any, solution: dict[str, Any], *, recovery: bool | None = None) -> Plan:
    """What a good engineer does with a bug report, as assistant turns, each step
    derived from what the session shows at that point (the request, then the tool
    results), never from the solution's hidden facts:

    - the request names the failing test's id: run it, and read the test (grep for
      its ``def``) to see what it calls; grep for the called function, read it;
    - it names the test and the function's file: run the test (``-k NAME``) and read
      the file (whole when short, else grep for the ``def`` and read from its line);
    - it names only the function: grep for its ``def`` (or ``codebase_search``), read
      it, and after the fix run the module's test file.

    A grep for a definition is `locate_call`'s: where the name has several, it also
    matches the owner the session has shown (``class Owner|def NAME``), so the hit the
    read starts from follows from the listing; a task where nothing shown tells the
    hits apart is not demonstrated.

    Then fix it with ``edit_file`` and run the test again in the same message (one
    turn an attempt), and answer in a sentence or two. Independent calls share a
    message, so the policy learns to batch them; the order and wording vary with the
    task's id (seeded). Raises `DemoError` when the
    request does not lead to the code (an issue that names no function, a test that
    does not call it): such a session would teach guessing.

    With ``recovery`` (None: for a seeded `RECOVERY_SHARE` of the tasks), a one-edit
    task whose session fits `DEMO_MAX_TURNS` first gets a wrong edit (`wrong_fix`,
    untrained; two for a seeded `TWICE_SHARE` where the budget allows), each with the
    rerun that fails, then the edit that corrects it; or, for a seeded
    `UNCHANGED_SHARE` of them and where no wrong edit fits, an edit whose <new> repeats
    <old> (untrained, refused by the tool), then the edit with the change. Where the
    broken line alone is not unique in the file (`ambiguous_line`), a seeded
    `AMBIGUOUS_SHARE` of the recoveries send it alone first instead (untrained, refused
    with the matches listed), then the edit that quotes the lines around it."""
    rng = random.Random(hashlib.sha1(str(task.id).encode()).hexdigest())
    edits = [e for e in solution.get("edits", []) if isinstance(e, dict)]
    functions = [str(f) for f in solution.get("functions", [])]
    kind = str(solution.get("kind", "bug"))
    req = read_request(task.query)
    # The functions are in (path, offset) order, the edits in the order they apply.
    ordered = sorted(edits, key=lambda e: (str(e["path"]), int(e.get("line", 1))))
    names = functions if len(functions) == len(ordered) else functions[:1] * len(ordered)
    sites = list(
        dict.fromkeys(
            (str(e["path"]), f, int(e.get("line", 1))) for e, f in zip(ordered, names, strict=True)
        )
    )
    files = {path: _source(task, path) for path, _, _ in sites}

    def read_site(path: str, line: int) -> str:
        lo, hi = function_lines(task, path, line)
        return render_call(READ_FILE, path=path, start_line=lo, end_line=hi)

    def grep_site(function: str, path: str, line: int, *, scope: str = "", seen: str) -> str:
        return locate_call(task, function, path, line, scope=scope, seen=seen)

    edit = [_edit_call(str(e["path"]), str(e["old"]), str(e["new"])) for e in edits]
    turns: list[str] = []
    if req.test_id:  # the test's id: run it, read it, follow its call to the code
        found = test_lines(task, req.test_id)
        if found is None or not all(
            re.search(rf"\b{re.escape(_called_name(f))}\b", found[3]) for _, f, _ in sites
        ):
            raise DemoError(f"task {task.id}: the failing test does not name the buggy code")
        file, lo, hi, _ = found
        run = render_call(RUN_TERMINAL, command=pytest_command(task, [req.test_id]))
        name = req.test_id.split("::")[-1].split("[")[0]
        turns.append(
            _say(
                rng,
                ["Let me run the failing test and find it.", "Reproducing it first."],
                [run, render_call(GREP, pattern=_locate_pattern(name), path=file)],
            )
        )
        turns.append(
            _say(
                rng,
                ["Reading the test to see what it calls.", "Let me read the test."],
                [render_call(READ_FILE, path=file, start_line=lo, end_line=hi)],
            )
        )
        shown = f"{task.query}\n{found[3]}"
        greps = list(dict.fromkeys(grep_site(f, p, ln, seen=shown) for p, f, ln in sites))
        turns.append(_say(rng, ["Now find where that is defined."], greps))
        turns.append(
            _say(
                rng,
                ["Reading it.", "Let me read the function."],
                [read_site(p, ln) for p, _, ln in sites],
            )
        )
        rerun = run
    elif req.functions and req.test_name:  # the test's name and the function's file
        if not all(req.functions.get(f) == p for p, f, _ in sites):
            raise DemoError(f"task {task.id}: the request does not name the buggy function's file")
        run = render_call(RUN_TERMINAL, command=pytest_command(task, k=req.test_name))
        whole = {p for p in files if len(files[p].splitlines()) <= SMALL_FILE_LINES}
        first = [
            render_call(READ_FILE, path=p)
            for p in dict.fromkeys(p for p, _, _ in sites)
            if p in whole
        ]
        first += list(
            dict.fromkeys(
                grep_site(f, p, ln, scope=p, seen=task.query)
                for p, f, ln in sites
                if p not in whole
            )
        )
        then = [read_site(p, ln) for p, _, ln in sites if p not in whole]
        if rng.random() < 0.7:
            turns.append(
                _say(
                    rng,
                    [
                        "Let me run the test and look at the code.",
                        "Reproducing it, and reading meanwhile.",
                    ],
                    [run, *first],
                )
            )
            if then:
                turns.append(_say(rng, ["Reading the function.", "Let me read it."], then))
        else:
            turns.append(_say(rng, ["Let me look at the code first."], first))
            turns.append(_say(rng, ["Now the test, and the function."], [run, *then]))
        rerun = run
    else:  # an issue: only the function's name
        named = {f.rsplit(".", 1)[-1] for f in req.functions}
        if not named or not all(f.rsplit(".", 1)[-1] in named for _, f, _ in sites):
            raise DemoError(f"task {task.id}: the request names no function to look for")
        locate = list(dict.fromkeys(grep_site(f, p, ln, seen=task.query) for p, f, ln in sites))
        # semantic search too, where one definition has the name (where hits need the
        # owner to tell them apart, the grep shows how)
        unique = all(len(grep_hits(task, _locate_pattern(f))) == 1 for _, f, _ in sites)
        if rng.random() >= 0.7 and unique:
            locate = [render_call(CODEBASE_SEARCH, query=" ".join(sorted(req.functions)))]
        turns.append(
            _say(rng, ["Let me find where it is defined.", "Searching for the code."], locate)
        )
        turns.append(
            _say(
                rng,
                ["Reading it.", "Let me read the function."],
                [read_site(p, ln) for p, _, ln in sites],
            )
        )
        protect = sorted(getattr(task, "protect", ()) or ())
        module = [
            t for t in protect if Path(t).name in {f"test_{Path(p).stem}.py" for p, _, _ in sites}
        ]
        rerun = render_call(RUN_TERMINAL, command=pytest_command(task, module or protect))
    lines = ", ".join(f"line {line}" for _, _, line in sites)

    def fixing(changes: Sequence[tuple[str, str]]) -> list[str]:
        # Where comes first, what kind of bug last: the quoted line is the choice the
        # rest of the turn (the change, the edit's <old>) copies from, and a small
        # model that starts with the kind commits to one before it has looked.
        said = [w for w in (said_change(o, n) for o, n in changes) if w]
        kinds = _kind_words(kind)
        if len(said) != len(changes):
            quoted = [q for q in (quoted_line(o, n) for o, n in changes) if q]
            where = " and ".join(f"`{q}`" for q in quoted) or lines
            return [
                f"The bug is in {where} ({lines}): {kinds}. Fixing it.",
                f"Found it: {where}, {kinds} at {lines}.",
            ]
        what = "; ".join(said)
        return [
            f"{_upper_first(what)} ({kinds}, {lines}). Fixing it.",
            f"Found it: {what}; {kinds} at {lines}.",
        ]

    # The edit and the rerun share a message (the executor runs the command after the
    # edit it conflicts with), so every attempt at the fix costs one turn, and a failed
    # one leaves the turn budget room for another.
    if recovery is None:
        draw = random.Random(hashlib.sha1(f"{task.id}|recovery".encode()).hexdigest())
        recovery = draw.random() < RECOVERY_SHARE
    wrongs: list[str] = []
    unchanged = False
    fits = recovery and len(edits) == 1 and len(turns) + 3 <= DEMO_MAX_TURNS
    alone = ambiguous_line(task, edits[0]) if fits else None
    if alone:  # this recovery sends the broken line alone first, or not at all
        draw = random.Random(hashlib.sha1(f"{task.id}|ambiguous".encode()).hexdigest())
        if draw.random() < AMBIGUOUS_SHARE:
            recovery = False
        else:
            alone = None
    if recovery:
        draw = random.Random(hashlib.sha1(f"{task.id}|unchanged".encode()).hexdigest())
        if (
            draw.random() >= UNCHANGED_SHARE
            and len(edits) == 1
            and len(turns) + 3 <= DEMO_MAX_TURNS
        ):
            # two wrong attempts where the budget allows it, for a share of them
            most = 2 if len(turns) + 4 <= DEMO_MAX_TURNS and draw.random() < TWICE_SHARE else 1
            wrongs = wrong_fixes(task, edits[0], most)
        unchanged = not wrongs and len(turns) + 3 <= DEMO_MAX_TURNS
    untrained: list[int] = []
    must_fail: list[int] = []
    code = {(p, ln): (files[p].splitlines()[ln - 1 : ln] or [""])[0].strip() for p, _, ln in sites}
    broken = tuple((p, ln, code[p, ln]) for p, _, ln in sites if code[p, ln])
    grounded = {len(turns): broken}
    if wrongs:
        e = edits[0]
        path, before = str(e["path"]), str(e["old"])
        for i, wrong in enumerate(wrongs):
            untrained.append(len(turns))
            must_fail.append(len(turns))
            if i == 0:
                options = fixing([(before, wrong)])
            else:
                options = [
                    f"Still failing. {_upper_first(said_change(before, wrong) or lines)}; trying that."
                ]
            turns.append(_say(rng, options, [_edit_call(path, before, wrong), rerun]))
            before = wrong
        again = said_change(before, str(e["new"]))
        what = (
            f"{_upper_first(again)} ({_kind_words(kind)}, {lines})"
            if again
            else f"{_upper_first(_kind_words(kind))} at {lines}"
        )
        turns.append(
            _say(
                rng,
                [
                    f"Still failing, so that was not it. {what}; correcting my edit.",
                    f"The test still fails: my change was wrong. Looking again: {what}.",
                ],
                [_edit_call(path, before, str(e["new"])), rerun],
            )
        )
    elif alone:
        e = edits[0]
        path, (line, fixed, count) = str(e["path"]), alone
        untrained.append(len(turns))
        changes = [(str(e["old"]), str(e["new"]))]
        turns.append(_say(rng, fixing(changes), [_edit_call(path, line, fixed), rerun]))
        where = f"line {e.get('line')}" if e.get("line") else "the function I read"
        turns.append(
            _say(
                rng,
                [
                    f"`{line.strip()}` is in {count} places in {path}; quoting the lines "
                    f"around the one at {where} makes the edit unique.",
                    f"That line occurs {count} times. The one to fix is at {where}, so "
                    "the edit takes the lines around it too.",
                ],
                [*edit, rerun],
            )
        )
    elif unchanged:
        untrained.append(len(turns))
        changes = [(str(e["old"]), str(e["new"])) for e in edits]
        same = [_edit_call(str(e["path"]), str(e["old"]), str(e["old"])) for e in edits]
        turns.append(_say(rng, fixing(changes), [*same, rerun]))
        said = [w for w in (said_change(o, n) for o, n in changes) if w]
        what = "; ".join(said) if len(said) == len(changes) else f"{_kind_words(kind)} at {lines}"
        turns.append(
            _say(
                rng,
                [
                    f"My edit changed nothing: it sent the line back as it was. "
                    f"{_upper_first(what)}, so the new text gets that change.",
                    f"Nothing changed: the new text repeated the old. Again, with the "
                    f"change made: {what}.",
                ],
                [*edit, rerun],
            )
        )
    else:
        turns.append(
            _say(rng, fixing([(str(e["old"]), str(e["new"])) for e in edits]), [*edit, rerun])
        )
    where = " and ".join(f"`{f}` ({p})" for p, f, _ in sites)
    turns.append(
        rng.choice(
            [
                f"Fixed {_kind_words(kind)} in {where}; the failing test passes now.",
                f"The bug was {_kind_words(kind)} in {where}. I fixed it and the test passes.",
                f"{where}: fixed {_kind_words(kind)}. The tests that failed pass again.",
            ]
        )
    )
    return Plan(
        turns=turns, untrained=tuple(untrained), must_fail=tuple(must_fail), grounded=grounded
    )


# ---------------------------------------------------------------- recording


def _plan(
    task: Any, solution: dict[str, Any] | None, *, recovery: bool | None = None
) -> Plan | None:
    """The demonstration; None when the task has no solution or its request does not
    lead to the code (`expert_plan`)."""
    if solution is None:
        return None
    try:
        return demo_plan(task, solution, recovery=recovery)
    except DemoError:
        return None


def _failed_as_planned(trace: dict[str, Any], plan: Plan) -> bool:
    """Whether every test run the plan needs to fail did (trace turns count from 1)."""
    for i in plan.must_fail:
        runs = [
            c
            for c in trace.get("tool_calls", [])
            if c.get("turn") == i + 1 and c.get("name") == RUN_TERMINAL
        ]
        if not runs or any(c.get("status") == "ok" for c in runs):
            return False
    return True


def shown_lines(trace: dict[str, Any], before_turn: int) -> set[tuple[str, int]]:
    """``(path, line)`` of every file line a successful ``read_file`` (its numbered
    lines) or ``grep`` (its ``path:line:`` hits) showed in the trace's turns before
    ``before_turn`` (trace turns count from 1)."""
    shown: set[tuple[str, int]] = set()
    for c in trace.get("tool_calls", []):
        if c.get("turn", before_turn) >= before_turn or c.get("status") != "ok":
            continue
        result = str(c.get("result") or "")
        if c.get("name") == READ_FILE:
            args = c.get("args") or {}
            path = str(args.get("path", "") if isinstance(args, dict) else "")
            path = path.removeprefix("./")
            shown |= {(path, int(n)) for n in _NUMBERED.findall(result)}
        elif c.get("name") == GREP:
            shown |= {(p, int(n)) for p, n in _HIT.findall(result)}
    return shown


_NUMBERED = re.compile(r"^ *(\d+)\t", re.M)  # a read_file line: "    42\tcode"
_HIT = re.compile(r"^([^\s:][^:\n]*):(\d+):", re.M)  # a grep hit: "pkg/mod.py:42:code"


def _grounded(trace: dict[str, Any], plan: Plan) -> bool:
    """Whether every line each fixing turn fixes was on screen before that turn: a
    demonstration whose reads missed the line would teach the edit without its cause."""
    for i, sites in plan.grounded.items():
        seen = shown_lines(trace, i + 1)
        if any((path, line) not in seen for path, line, _ in sites):
            return False
    return True


def playable(task: Any) -> bool:
    """Whether a reference session of ``task`` (held-out ones included) can be played:
    it has a solution and its request leads to the code."""
    return _plan(task, load_solution(task, reference=True), recovery=False) is not None


def demonstrable(task: Any) -> bool:
    """Whether `record_demos` can play ``task`` (a training task with a usable solution)."""
    return _plan(task, load_solution(task)) is not None


async def record_demos(
    tasks: Sequence[Any],
    *,
    env: Any,
    store: Any,
    session_config: Any,
    concurrency: int = 4,
    meta: dict[str, Any] | None = None,
    reference: bool = False,
) -> DemoStats:
    """Play a demonstration of every task with a solution through ``env.run_episode``
    (the production Session) into ``store`` (a ``TraceStore``); mark resolved ones
    accepted. ``meta`` is added to every demonstration's ``meta``. Refuses held-out
    tasks before running anything.

    With ``reference``, held-out tasks are played too, without a wrong first edit, as
    the states at which `training.nextstep` asks a policy for its next step. Such a
    session is never accepted (``meta.source = "reference"``, ``accepted`` false), so
    no SFT reads it; ``meta.resolved`` says whether the expert's session resolved."""
    from opencomposer.agent.backends.scripted import ScriptedModel

    plans = []
    stats = DemoStats()
    for t in tasks:
        # raises for held-out tasks, before anything runs, unless for reference
        solution = load_solution(t, reference=reference)
        plan = _plan(t, solution, recovery=False if reference else None)
        if plan is None:
            stats.skipped += 1
            continue
        plans.append((t, plan))
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(task: Any, plan: Plan) -> None:
        model = ScriptedModel(plan.played(), name=f"scripted:demo/{task.id}")
        async with gate:
            res = await env.run_episode(
                task, model_spec_or_factory=model, session_config=session_config, traces=store
            )
        stats.recorded += 1
        sid = res.session_id
        ok = res.resolved and res.status == "completed" and bool(sid)
        if ok and (plan.must_fail or plan.grounded):
            trace = store.export(sid) or {}
            # a wrong first edit that happened to pass tells a lie; a fix whose line the
            # session never showed teaches guessing
            ok = _grounded(trace, plan) and (not plan.must_fail or _failed_as_planned(trace, plan))
        if sid:
            extra: dict[str, Any] = {}
            if plan.untrained:
                extra["untrained_turns"] = [i + 1 for i in plan.untrained]
            if reference:
                extra = {"resolved": ok}
            store.set_meta(
                sid,
                source="reference" if reference else "demo",
                task_id=task.id,
                request=request_key(task),
                accepted=ok and not reference,
                reward=res.reward,
                **extra,
                **(meta or {}),
            )
        if ok:
            if not reference:
                store.record_decision(sid, "*", "accept")
            stats.accepted += 1
            stats.session_ids.append(sid)
        else:
            stats.failed.append(task.id)

    await asyncio.gather(*(one(t, plan) for t, plan in plans))
    return stats


def spread(tasks: Sequence[Any], n: int, seed: int) -> list[Any]:
    """Up to ``n`` of ``tasks``, taken round-robin over their projects (``source``) in
    a seeded order, so a capped warm start sees every project, not the first few."""
    rng = random.Random(seed)
    by_source: dict[str, list[Any]] = {}
    for t in sorted(tasks, key=lambda t: t.id):
        by_source.setdefault(str(getattr(t, "source", "")), []).append(t)
    queues = [by_source[k] for k in sorted(by_source)]
    for q in queues:
        rng.shuffle(q)
    out: list[Any] = []
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop())
    return out


def demo_metas(store: Any) -> list[dict[str, Any]]:
    """The ``meta`` of every demonstration recorded in ``store`` (a ``TraceStore``)."""
    metas = [
        (store.get(s["session_id"]) or {}).get("meta") or {} for s in store.list_sessions(100_000)
    ]
    return [m for m in metas if m.get("source") == "demo"]


def request_key(task: Any) -> str:
    """What tells a task's demonstrations apart besides its id: its request. A corpus
    exported once per request kind (`opencomposer tasks export --query test|issue|oneline`)
    gives the same bug three tasks with one id; each is a demonstration of its own."""
    return hashlib.sha1(str(task.query).encode()).hexdigest()[:16]


def pending(store: Any, tasks: Sequence[Any], *, style: str, limit: int, seed: int) -> list[Any]:
    """The tasks to demonstrate next so that ``store`` holds up to ``limit``
    demonstrations in prompt ``style``: those not recorded there yet (a task is its id
    and its request), taken round-robin over their projects (a store filled in several
    sittings tops up, never repeats). A demonstration recorded before requests were
    kept in ``meta`` stands for every request of its task."""
    metas = [m for m in demo_metas(store) if m.get("prompt_style") == style]
    done = {(m.get("task_id"), m.get("request")) for m in metas}
    want = max(0, limit - len(done))
    todo = [t for t in tasks if not {(t.id, request_key(t)), (t.id, None)} & done]
    out: list[Any] = []
    for t in spread(todo, len(todo), seed):
        if len(out) >= want:
            break
        if demonstrable(t):
            out.append(t)
    return out


async def _main(suite: str, db: Path, prompt_style: str, limit: int, seed: int) -> DemoStats:
    from opencomposer.agent.traces import TraceStore
    from opencomposer.training.catalog import load_suite

    store = TraceStore(db)
    try:
        todo = pending(store, load_suite(suite), style=prompt_style, limit=limit, seed=seed)
        return await play(todo, store, prompt_style=prompt_style)
    finally:
        store.close()


async def play(
    tasks: Sequence[Any],
    store: Any,
    *,
    prompt_style: str,
    env_config: Any = None,
    reference: bool = False,
) -> DemoStats:
    """`record_demos` of ``tasks`` into ``store`` on an environment server of its own
    (``env_config``: default two sandboxed workers), in ``prompt_style``."""
    from opencomposer.training.env import EnvConfig, EnvironmentServer

    if not tasks:
        return DemoStats()
    env = EnvironmentServer(env_config or EnvConfig(num_actors=2))
    try:
        await env.start()
        return await record_demos(
            tasks,
            env=env,
            store=store,
            session_config=demo_session_config(prompt_style=prompt_style),
            meta={"prompt_style": prompt_style},
            reference=reference,
        )
    finally:
        await env.close()


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default="starter:train")
    ap.add_argument("--db", type=Path, required=True, help="trace store to write (SQLite)")
    ap.add_argument("--prompt-style", default="compact", choices=["full", "compact"])
    ap.add_argument(
        "--max", type=int, default=100_000, help="demonstrations the store should hold in all"
    )
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args()
    try:
        s = asyncio.run(_main(ns.suite, ns.db, ns.prompt_style, ns.max, ns.seed))
    except (DemoError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{s.accepted}/{s.recorded} demonstrations accepted ({s.skipped} without solution)")
    if s.failed:
        print("not resolved: " + ", ".join(sorted(s.failed)))
