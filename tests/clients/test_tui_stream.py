"""How the TUI draws a fast stream: one widget per streamed message, a bounded timeline.

The app here gets its events straight from `server_event` (what the LSP link calls),
with a server command that exits at once; the ticks, widgets and Markdown are real.

    .venv/bin/python -m pytest tests/clients/test_tui_stream.py -q
"""

from __future__ import annotations

import time

from opencomposer.clients.tui.app import OpenComposerApp, SessionView
from opencomposer.clients.tui.transcript import (
    AssistantEntry,
    StreamView,
    ToolCard,
    ToolFold,
    ToolGroup,
)
from textual.widgets._markdown import MarkdownBlock, MarkdownFence

NEVER = ["/bin/sh", "-c", "exit 1"]
SID = {"session_id": "s1"}


def _app(tmp_path) -> OpenComposerApp:
    return OpenComposerApp(workspace=tmp_path, model="x", command=NEVER, show_timings=False)


async def _until(pilot, cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await pilot.pause(0.05)


def test_stream_view_splits_finished_blocks_outside_code_fences():
    view = StreamView()
    view.append("Para one\nline two\n\n```py\nx = 1\n\ny = 2\n```\n\n- a\n- b\n\ntail")
    assert [block for block, _ in view._blocks] == [
        "Para one\nline two\n",
        "```py\nx = 1\n\ny = 2\n```\n",  # the blank line inside the fence does not split
        "- a\n- b\n",
    ]
    assert view._open == "tail"


def test_stream_view_cuts_a_huge_open_block():
    view = StreamView()
    view.append("```\n" + "code line\n" * 500)
    head, _ = view._blocks[0]
    assert head.startswith("```\n") and head.endswith("\n```")  # closed where it was cut
    assert view._open.startswith("```\n")  # and opened again for the rest
    assert len(view._open) <= StreamView.MAX_OPEN
    long = StreamView()
    for _ in range(200):
        long.append("word " * 10)
    assert len(long._open) <= StreamView.MAX_OPEN


async def test_streamed_text_is_one_widget_then_full_markdown(tmp_path):
    app = _app(tmp_path)
    text = "".join(
        f"Paragraph {i} says **something**.\n\n"
        + ("```python\nx = 1\n\ny = 2\n```\n\n" * (i % 5 == 0))
        for i in range(60)
    )
    async with app.run_test(size=(80, 30)) as pilot:
        app.session = SessionView(query="q")
        app.server_event({"type": "session_start", **SID})
        app.server_event({"type": "model_start", "turn": 1, **SID})
        for i in range(0, len(text), 7):
            delta = text[i : i + 7]  # prose alone: no tool call in it
            app.server_event(
                {"type": "model_delta", "turn": 1, "text": delta, "prose": delta, **SID}
            )
        entry = None

        def streamed() -> bool:
            nonlocal entry
            entries = list(app.query(AssistantEntry))
            entry = entries[0] if entries else None
            return entry is not None and entry.shown == text

        await _until(pilot, streamed)
        await pilot.pause(0.2)
        assert [type(c) for c in entry.children] == [StreamView]  # not a widget per block
        view = entry.query_one(StreamView)
        assert 60 <= view.line_count <= view.height_lines < view.line_count + StreamView.HEIGHT_STEP
        rendered = [strip.text.strip() for strip in view._lines + view._open_lines]
        assert rendered[0] == "Paragraph 0 says something." and rendered[1] == ""
        assert rendered[-1] == "Paragraph 59 says something."

        app.server_event({"type": "message", "turn": 1, "text": text, "prose": text, **SID})
        await _until(
            pilot, lambda: not entry.query(StreamView) and bool(entry.query(MarkdownBlock))
        )
        assert len(entry.query(MarkdownFence)) == 12
        assert entry.shown == text.strip()


async def test_busy_turn_folds_old_calls_and_reuses_their_cards(tmp_path):
    app = _app(tmp_path)
    async with app.run_test(size=(100, 40)) as pilot:
        app.session = SessionView(query="q")
        app.server_event({"type": "session_start", **SID})
        for i in range(40):
            call = {"turn": 1, "call_id": f"c{i}", "name": "grep", **SID}
            app.server_event({"type": "tool_start", "args": {"pattern": f"p{i}"}, **call})
            app.server_event(
                {"type": "tool_end", "status": "ok", "duration_s": 0.01, "result": f"r{i}", **call}
            )
            await pilot.pause(0.01)
        app.server_event(
            {"type": "tool_start", "turn": 1, "call_id": "last", "name": "glob", **SID}
        )
        await _until(pilot, lambda: "last" in app.session.cards)
        await pilot.pause(0.3)
        group = app.query_one(ToolGroup)
        shown = [c for c in group.children if isinstance(c, ToolCard) and c.display]
        assert len(shown) <= ToolGroup.MAX_CARDS
        assert len(app.query(ToolCard)) <= ToolGroup.MAX_CARDS + group.columns  # reused
        assert shown[-1].name_ == "glob" and shown[-1].status is None
        fold = group.query_one(ToolFold)
        assert len(fold.rows) + len(shown) == 41
        assert fold.ok == len(fold.rows) and fold.failed == 0
        assert app.session.cards["last"] is shown[-1]
        assert all(c.call_id in app.session.cards for c in shown)
        fold.focus()
        await pilot.press("enter")
        assert fold.expanded and "p0" in str(fold.render())
        app.query_one("#prompt").focus()
        await pilot.press(*"still typing")
        assert app.query_one("#prompt").text == "still typing"
