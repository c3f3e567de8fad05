"""`codebase_search` in a real agent session over the real index.

A session opened by the factory every front door uses (`agent.factory`:
scripted model, local workspace) opens the workspace's index lazily, builds
it, and the tool result lists ranked
`path:start-end (score) symbol` chunks. The tiny random-weight embedder keeps
this fast, so relevance here comes from the lexical half;
`test_index_minilm.py` checks the dense half with MiniLM.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from opencomposer.agent.backends.scripted import ScriptedModel
from opencomposer.agent.factory import open_session
from opencomposer.agent.session import SessionConfig
from opencomposer.tools.workspace import LocalWorkspace


async def test_codebase_search_in_an_agent_session(workspace: Path, embedder_env: Path) -> None:
    call = '<codebase_search query="retry with backoff after failed attempts" k="3"/>'
    model = ScriptedModel([call, "It is retry_with_backoff in src/retry.py."])
    events: list[dict[str, Any]] = []
    session = open_session(
        model=model,
        workspace=LocalWorkspace(workspace),
        config=SessionConfig(emit_deltas=False),
        on_event=lambda e: events.append(e.to_wire()),
    )
    result = await session.run("where do we retry?")
    assert result.status == "completed"
    end = next(e for e in events if e["type"] == "tool_end" and e["name"] == "codebase_search")
    assert end["status"] == "ok", end
    heads = re.findall(r"^(\S+):(\d+)-(\d+) \(([0-9.]+)\)", end["output"], re.M)
    assert 1 <= len(heads) <= 3
    assert heads[0][0] == "src/retry.py"
    scores = [float(h[3]) for h in heads]
    assert scores == sorted(scores, reverse=True)
    assert "def retry_with_backoff" in end["output"]
    assert (workspace / ".opencomposer/index/index.db").exists()  # built by the session
    # what the model saw next is the same ranked result
    assert any("src/retry.py:" in m.content for m in session.messages if m.role != "assistant")
