"""`agent.factory.open_session`: the one way every front door opens a session.

Guards: a session whose `codebase_search` has no index (the environment once
built its sessions without one), and an index that keeps answering from the
files as they were before the session's own edits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opencomposer.agent.backends.scripted import ScriptedModel
from opencomposer.agent.factory import open_session
from opencomposer.agent.session import SessionConfig
from opencomposer.tools.workspace import LocalWorkspace

NEW = '<write_file path="zoo.py">\n<content>def feed_the_zebras(count):\n    return count * 2\n</content>\n</write_file>'  # fmt: skip


def _search_outputs(events: list[dict[str, Any]]) -> list[str]:
    return [e["output"] for e in events if e["type"] == "tool_end" and e["name"] == "codebase_search"]  # fmt: skip


async def test_search_sees_the_sessions_own_edits(repo: Path, embedder_env: Path) -> None:
    search = '<codebase_search query="feed the zebras" k="2"/>'
    model = ScriptedModel([search, NEW, search, "Done."])
    events: list[dict[str, Any]] = []
    session = open_session(
        model=model,
        workspace=LocalWorkspace(repo),
        config=SessionConfig(approve="all", emit_deltas=False),
        on_event=lambda e: events.append(e.to_wire()),
    )
    result = await session.run("add a zebra feeder")
    assert result.status == "completed"
    before, after = _search_outputs(events)
    assert "zoo.py" not in before
    assert after.startswith("zoo.py:1-2"), after  # the file the session wrote, found at once
