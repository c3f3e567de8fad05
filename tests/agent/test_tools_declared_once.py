"""Tools are declared once: a tool registered in `tools/specs.py` alone is parsed,
prompted, run under the approval its kind implies, traced, counted by the
environment's metrics and shown by clients, with no other change.

Guards the old way of adding a tool: edit specs.py, then the session, the
language server, the environment and the TUI, with nothing failing when one of
them was missed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from opencomposer.agent import events as ev
from opencomposer.agent.factory import open_session
from opencomposer.agent.prompts import system_prompt
from opencomposer.agent.session import SessionConfig
from opencomposer.agent.xmlcalls import parse_all
from opencomposer.tools import specs
from opencomposer.tools.protocols import ToolContext, ToolResult
from opencomposer.tools.workspace import LocalWorkspace
from opencomposer.training.env import EpisodeMetrics

from tests.agent.conftest import scripted


async def count_lines(ctx: ToolContext, path: str) -> ToolResult:
    text = ctx.workspace.read_text(path)
    return ToolResult.ok(f"{path} has {text.count(chr(10))} lines")


SPEC = specs.ToolSpec(
    name="count_lines",
    summary="Count the lines of a text file.",
    params=(specs.Param(name="path", doc="workspace-relative path"),),
    impl=f"{__name__}:count_lines",
    kind="read",
    footprint=lambda args: specs.Footprint(reads=(args.get("path") or specs.ALL,)),
    example='<count_lines path="src/app.py"/>',
)
CALL = 'Counting first.\n<count_lines path="calc.py"/>'


@pytest.fixture
def registered() -> Any:
    specs.register(SPEC)
    yield SPEC
    specs.unregister(SPEC.name)


async def test_a_registered_tool_is_everywhere(repo: Path, store, registered) -> None:
    # parsed and prompted
    [call] = parse_all(CALL, *specs.parser_rules())
    assert (call.name, call.raw) == ("count_lines", {"path": "calc.py"})
    assert '<count_lines path="src/app.py"/>' in system_prompt(style="compact")
    assert "## count_lines" in system_prompt(style="full")

    # run, without asking (a read under `safe`), and traced
    events: list[ev.Event] = []
    session = open_session(
        model=scripted(CALL, "It has 2 lines."),
        workspace=LocalWorkspace(repo),
        config=SessionConfig(approve="safe"),
        on_event=events.append,
        traces=store,
    )
    result = await session.run("how long is calc.py?")
    assert result.status == "completed"
    end = next(e for e in events if isinstance(e, ev.ToolEnd))
    assert (end.name, end.status, end.output) == ("count_lines", "ok", "calc.py has 2 lines")
    trace = store.export(result.session_id)
    assert [(c["name"], c["result"]) for c in trace["tool_calls"]] == [
        ("count_lines", "calc.py has 2 lines")
    ]
    assert "count_lines" in trace["meta"]["tools"]

    # counted by the environment's metrics by its kind
    metrics = EpisodeMetrics()
    for e in events:
        metrics.observe(e)
    assert metrics.summary()["reads_before_first_edit"] == 1

    # shown: session_start names it, and the prose clients show has its XML cut out
    start = next(e.to_wire() for e in events if isinstance(e, ev.SessionStart))
    assert "count_lines" in start["tools"]
    first = [e for e in events if isinstance(e, ev.ModelDelta | ev.Message) and e.turn == 1]
    assert "".join(e.prose for e in first if isinstance(e, ev.ModelDelta)) == "Counting first.\n"
    assert [e.prose for e in first if isinstance(e, ev.Message)] == ["Counting first.\n"]


def test_unregistered_it_is_gone(registered) -> None:
    specs.unregister(SPEC.name)
    assert "count_lines" not in specs.TOOL_NAMES and "count_lines" not in system_prompt()
    specs.register(SPEC)  # for the fixture's own unregister
