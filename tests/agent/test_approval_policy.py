"""One approval policy: what `none`, `safe` and `all` let run without asking.

Guards the split this fixes: under `safe` the language server applied file edits
without asking while `opencomposer ask` asked. The policy lives in
`Session.needs_approval` alone; `auto_apply_edits` is a client's own, named setting
that lets file changes through under `safe` only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from opencomposer.agent.factory import open_session
from opencomposer.agent.session import SessionConfig
from opencomposer.tools import specs
from opencomposer.tools.workspace import LocalWorkspace

from tests.agent.conftest import scripted

CALLS = {
    "read": ("read_file", {"path": "calc.py"}),
    "read-only command": ("run_terminal", {"command": "cat calc.py"}),
    "writing command": ("run_terminal", {"command": "touch x.txt"}),
    "file change": ("edit_file", {"path": "calc.py", "old": "a - b", "new": "a + b"}),
}
# policy, auto_apply_edits -> the calls that run without asking
RUNS = {
    ("all", False): set(CALLS),
    ("all", True): set(CALLS),
    ("safe", False): {"read", "read-only command"},
    ("safe", True): {"read", "read-only command", "file change"},
    ("none", False): set(),
    ("none", True): set(),
}


@pytest.mark.parametrize(("policy", "auto"), list(RUNS))
def test_policy_table(repo: Path, policy: str, auto: bool) -> None:
    session = open_session(
        model=scripted("done"),
        workspace=LocalWorkspace(repo),
        config=SessionConfig(approve=policy, auto_apply_edits=auto),  # type: ignore[arg-type]
    )
    runs = {k for k, (name, args) in CALLS.items() if not session.needs_approval(specs.get(name), args)}  # fmt: skip
    assert runs == RUNS[(policy, auto)]


async def test_safe_without_anyone_to_ask_leaves_files_alone(repo: Path) -> None:
    edit = '<edit_file path="calc.py">\n<old>a - b</old>\n<new>a + b</new>\n</edit_file>'
    before = (repo / "calc.py").read_text()
    session = open_session(
        model=scripted(edit, "done"),
        workspace=LocalWorkspace(repo),
        config=SessionConfig(approve="safe"),
    )
    result = await session.run("fix add")
    assert (repo / "calc.py").read_text() == before
    assert (
        "needs the user's approval under the 'safe' policy" in result.turns[1].messages[-1].content
    )
