"""Finding the tests that fail the way a request says the code fails.

A bug report quotes what went wrong (pytest's `E` lines, a traceback's last line) but
often names no test: "`Version.parse` gives wrong results. The output: E AssertionError:
assert '1.2.1' == '1.2.4'". An engineer's first step is to reproduce it: run the test
suite and find the tests that fail that way. The session's repair (`agent/repair.py`)
needs exactly that, a command that fails because of the bug, to try edits against.

`quoted(request)` reads the failure lines a request quotes; `matching(output, quotes)`
reads a pytest run's failure sections and returns the node ids of the tests whose
section holds the most of those lines (at least one); `command(ids)` is the pytest
command that runs them. Lines are compared with their white space collapsed,
pytest's `E` marker taken off and memory addresses read as one, since the reporter's
run may have shown them with another traceback style, and objects at other addresses. A line too short to tell one failure from another (`?  ^`, a
bare `E`) is not compared. Nothing here runs anything: the session runs the suite and
then the command (`Session._reproduce`).
"""

from __future__ import annotations

import re
import shlex

# quoted lines compared, at most; shorter lines (after normalising) are not compared
MOST_QUOTED = 12
MIN_CHARS = 6
# tests the reproducing command runs, at most (the best matches, in the run's order)
MOST_TESTS = 3
# the run of the whole suite that looks for them: every failure, each traceback short
SUITE = "python -m pytest -q --tb=short -p no:cacheprovider -rfE"

_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.DOTALL)
_E_LINE = re.compile(r"^E(?:\s+(.*))?$")
# the last line of a Python traceback: `ValueError: …`, `pkg.mod.Error: …`, `KeyError`
_RAISED = re.compile(
    r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Warning)\b(?::.*)?$"
)
_HEAD = re.compile(r"^_{3,} (.+?) _{3,}$|^_ (.+) _$")
_BLOCK = re.compile(r"^={3,} (FAILURES|ERRORS) ={3,}$")
_END = re.compile(r"^={3,} .* ={3,}$")
_SUMMARY = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")


def _norm(line: str) -> str:
    """`line` with its white space collapsed and any memory address (`at 0x7f04…`, which
    differs from run to run) read as one."""
    return _ADDRESS.sub("0x?", " ".join(line.split()))


def quoted(request: str) -> list[str]:
    """The failure lines `request` quotes, normalised, each once, in order: pytest's `E`
    lines (without the marker) and the lines that read as a raised exception, from its
    code blocks (the whole text when it has none). [] when it quotes no failure."""
    blocks = _FENCE.findall(request) or [request]
    found: dict[str, None] = {}
    for block in blocks:
        for raw in block.splitlines():
            m = _E_LINE.match(raw.strip())
            line = _norm(m.group(1) or "") if m else _norm(raw)
            if (m or _RAISED.match(line)) and len(line.replace(" ", "")) >= MIN_CHARS:
                found.setdefault(line, None)
    return list(found)[:MOST_QUOTED]


def _node_title(node: str) -> str:
    """The title pytest gives a test's failure section: its node id after the file,
    `::` read as `.` (`tests/t.py::TestA::test_b[x]` -> `TestA.test_b[x]`)."""
    _, _, rest = node.partition("::")
    return rest.replace("::", ".") if rest else node


def sections(output: str) -> list[tuple[str, list[str]]]:
    """(title, normalised lines) of each failure and error section of a pytest run's
    output, in order."""
    out: list[tuple[str, list[str]]] = []
    inside = False
    for raw in output.splitlines():
        line = raw.rstrip()
        if _BLOCK.match(line):
            inside = True
            continue
        if inside and _END.match(line):
            inside = False
            continue
        if not inside:
            continue
        head = _HEAD.match(line)
        if head:
            out.append(((head.group(1) or head.group(2)).strip(), []))
        elif out:
            m = _E_LINE.match(line.strip())
            out[-1][1].append(_norm(m.group(1) or "") if m else _norm(line))
    return out


def matching(output: str, quotes: list[str]) -> list[str]:
    """The node ids of the tests a pytest run failed whose failure sections hold the
    most of `quotes` (at least one), `MOST_TESTS` at most, in the run's order; [] when
    no section holds any. An error collecting a file or setting a test up counts as
    that file's or that test's failure."""
    if not quotes:
        return []
    ids = list(dict.fromkeys(_SUMMARY.findall(output)))
    by_title: dict[str, str] = {}
    for node in ids:
        by_title.setdefault(_node_title(node), node)
    wanted = set(quotes)
    scored: list[tuple[int, str]] = []
    for title, lines in sections(output):
        for prefix in ("ERROR collecting ", "ERROR at setup of ", "ERROR at teardown of "):
            if title.startswith(prefix):
                title = title[len(prefix) :]
        node = by_title.get(title) or (title if title in ids else None)
        if node is None:
            continue
        score = len(wanted.intersection(lines))
        if score:
            scored.append((score, node))
    if not scored:
        return []
    best = max(s for s, _ in scored)
    return list(dict.fromkeys(n for s, n in scored if s == best))[:MOST_TESTS]


def command(ids: list[str]) -> str:
    """The pytest command that runs the tests `ids`, as the model would write it."""
    return shlex.join(["python", "-m", "pytest", "-q", "--tb=short", *ids])
