"""The session's one output: typed events, their documented wire form, traces made from them.

Guards: a wire form that drifts from docs/lsp.md (the table there is read and held
against the dataclasses), in-process fields (whole tool results, token ids, file
contents) leaking onto the wire, and traces written on two clocks (turn and call
times must lie on the session's one time line).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from opencomposer.agent import events as ev
from opencomposer.agent.session import Session, SessionConfig
from opencomposer.tools.workspace import LocalWorkspace

from tests.agent.conftest import scripted

DOC = Path(__file__).resolve().parents[2] / "docs" / "lsp.md"
FIX = '<read_file path="calc.py"/>\n<edit_file path="calc.py">\n<old>a - b</old>\n<new>a + b</new>\n</edit_file>'  # fmt: skip


def documented() -> dict[str, tuple[str, ...]]:
    section = DOC.read_text().split("### Events", 1)[1].split("###", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (.+) \|$", section, re.M)
    return {kind: tuple(re.findall(r"`(\w+)`", fields)) for kind, fields in rows}


def test_docs_table_is_the_dataclasses() -> None:
    assert documented() == {cls.type: cls.wire_fields() for cls in ev.EVENTS}


def test_events_are_frozen() -> None:
    e = ev.ModelStart(t=0.0, turn=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.turn = 2  # type: ignore[misc]


async def test_a_session_speaks_exactly_the_documented_wire_form(repo: Path, store) -> None:
    events: list[ev.Event] = []
    session = Session(
        model=scripted(FIX, "Fixed."),
        workspace=LocalWorkspace(repo),
        config=SessionConfig(approve="all"),
        on_event=events.append,
        traces=store,
    )
    result = await session.run("fix add")
    assert result.status == "completed"
    docs = documented()
    seen = set()
    for e in events:
        wire = e.to_wire()
        assert set(wire) == {"type", "t", *docs[wire["type"]]}, wire
        seen.add(wire["type"])
    assert seen == set(docs)  # every kind occurred (deltas: emit_deltas is on)
    end = next(e for e in events if isinstance(e, ev.ToolEnd) and e.name == "read_file")
    assert "a - b" in end.result and "result" not in end.to_wire()
    edit = next(e for e in events if isinstance(e, ev.Edit))
    assert edit.before is not None and "before" not in edit.to_wire()

    # the trace is made of the same events, on the session's one clock
    trace = store.export(result.session_id)
    start = next(e for e in events if isinstance(e, ev.SessionStart)).started
    model_ends = [e for e in events if isinstance(e, ev.ModelEnd)]
    for row, e in zip(trace["turns"], model_ends, strict=True):
        assert row["t_end"] == pytest.approx(start + e.t, abs=1e-6)
        assert row["t_start"] <= row["t_end"]
    tool_ends = {e.call_id: e for e in events if isinstance(e, ev.ToolEnd)}
    for call in trace["tool_calls"]:
        assert call["t_end"] == pytest.approx(start + tool_ends[call["call_id"]].t, abs=1e-6)
        assert call["t_start"] <= call["t_end"]
    first_turn_end = trace["turns"][0]["t_end"]
    assert all(c["t_start"] >= trace["turns"][0]["t_start"] for c in trace["tool_calls"])
    assert trace["turns"][1]["t_start"] >= first_turn_end
    assert trace["edits"][0]["path"] == "calc.py"
