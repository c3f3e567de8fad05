"""Pieces of the TUI that need no server: applying WorkspaceEdits to disk, showing the
prose the server's events carry, clipping huge tool output, and a 1 MB result reaching a
tool card.

    .venv/bin/python -m pytest tests/clients/test_tui_units.py -q
"""

from __future__ import annotations

import time

import pytest
from lsprotocol import types as lsp
from opencomposer.clients.tui.app import OpenComposerApp, SessionView, short_model
from opencomposer.clients.tui.edits import EditError, apply_text_edits, apply_workspace_edit
from opencomposer.clients.tui.transcript import AssistantEntry, ToolCard, clip, prose_text
from tui_harness import wait_for


def _edit(l1, c1, l2, c2, text):
    rng = lsp.Range(
        start=lsp.Position(line=l1, character=c1), end=lsp.Position(line=l2, character=c2)
    )
    return lsp.TextEdit(range=rng, new_text=text)


def test_text_edits_count_utf16_and_keep_crlf():
    text = "a😀b\r\nsecond\r\n"
    # 😀 is two UTF-16 units: character 3 is "b"
    assert apply_text_edits(text, [_edit(0, 3, 0, 4, "B")]) == "a😀B\r\nsecond\r\n"
    assert (
        apply_text_edits(text, [_edit(1, 0, 1, 6, "2nd"), _edit(0, 0, 0, 1, "A")])
        == "A😀b\r\n2nd\r\n"
    )
    # past the end clamps to the end
    assert apply_text_edits("x\n", [_edit(0, 0, 99, 0, "y\n")]) == "y\n"
    with pytest.raises(EditError):
        apply_text_edits("abc", [_edit(0, 0, 0, 2, "x"), _edit(0, 1, 0, 3, "y")])


def test_workspace_edit_create_edit_rename_delete(tmp_path):
    a, b = tmp_path / "sub" / "a.py", tmp_path / "b.py"
    doc = lsp.OptionalVersionedTextDocumentIdentifier(uri=a.as_uri(), version=None)
    edit = lsp.WorkspaceEdit(
        document_changes=[
            lsp.CreateFile(uri=a.as_uri()),
            lsp.TextDocumentEdit(text_document=doc, edits=[_edit(0, 0, 0, 0, "x = 1\n")]),
            lsp.RenameFile(old_uri=a.as_uri(), new_uri=b.as_uri()),
        ]
    )
    applied = apply_workspace_edit(edit)
    assert b.read_text() == "x = 1\n" and not a.exists()
    assert applied.paths[-1] == b
    apply_workspace_edit(lsp.WorkspaceEdit(changes={b.as_uri(): [_edit(0, 4, 0, 5, "2")]}))
    assert b.read_text() == "x = 2\n"
    apply_workspace_edit(lsp.WorkspaceEdit(document_changes=[lsp.DeleteFile(uri=b.as_uri())]))
    assert not b.exists()
    with pytest.raises(EditError, match="does not exist"):
        apply_workspace_edit(lsp.WorkspaceEdit(document_changes=[lsp.DeleteFile(uri=b.as_uri())]))


async def test_prose_is_shown_from_the_events_not_parsed_again(tmp_path):
    """Guards the TUI's own XML scanner, which could disagree with the agent's parser:
    the TUI shows the `prose` of `model_delta` and `message` events, never their `text`."""
    never = ["/bin/sh", "-c", "exit 1"]
    app = OpenComposerApp(workspace=tmp_path, model="x", command=never, show_timings=False)
    async with app.run_test(size=(80, 24)) as pilot:
        app.session = SessionView(query="q")
        sid = {"session_id": "s1"}
        app.server_event({"type": "session_start", **sid})
        for text, prose in [("Reading.\n<read_", "Reading.\n"), ('file path="a"/>', "")]:
            delta = {"type": "model_delta", "turn": 1, "text": text, "prose": prose}
            app.server_event({**delta, **sid})
        await wait_for(pilot, lambda: bool(app.query(AssistantEntry)), 10, "the entry")
        entry = app.query_one(AssistantEntry)
        await wait_for(pilot, lambda: entry.shown == "Reading.\n", 10, "the streamed prose")
        message = {"type": "message", "turn": 1, "text": "<b>x", "prose": "Read.\n\n\n\nOk\n"}
        app.server_event({**message, **sid})
        await wait_for(pilot, lambda: entry.shown == "Read.\n\nOk", 10, "the final prose")
    assert prose_text("\n\nI'll read both.\n\n\n\nThen `List<int>` stays.\n") == (
        "I'll read both.\n\nThen `List<int>` stays."
    )


def test_clip_keeps_head_and_tail_of_a_megabyte():
    big = "".join(f"line {i}\n" for i in range(150_000))
    assert len(big) > 1_000_000
    cut = clip(big)
    assert cut.startswith("line 0\n") and cut.rstrip().endswith("line 149999")
    assert "characters not shown" in cut and len(cut) < 10_000


def test_short_model_names():
    assert short_model("scripted:/tmp/x/turns.json") == "scripted:turns.json"
    assert short_model("smollm2") == "smollm2"
    assert short_model("openai:http://h:8000/v1#m") == "openai:http://h:8000/v1#m"


async def test_megabyte_tool_result_reaches_a_card_quickly(tmp_path):
    """A server that sends a 1 MB `result` in tool_end: the card clips it, typing still works."""
    never = ["/bin/sh", "-c", "exit 1"]
    app = OpenComposerApp(workspace=tmp_path, model="x", command=never, show_timings=False)
    async with app.run_test(size=(80, 30)) as pilot:
        app.session = SessionView(query="q")
        sid = {"session_id": "s1"}
        app.server_event({"type": "session_start", **sid})
        app.server_event(
            {
                "type": "tool_start",
                "turn": 1,
                "call_id": "c1",
                "name": "grep",
                "args": {"pattern": "x"},
                **sid,
            }
        )
        # Events are drawn on the app's next tick (TICK_INTERVAL_S).
        await wait_for(pilot, lambda: bool(app.query(ToolCard)), 10, "the card")
        t0 = time.monotonic()
        big = "match\n" * 180_000
        app.server_event(
            {
                "type": "tool_end",
                "turn": 1,
                "call_id": "c1",
                "name": "grep",
                "status": "ok",
                "duration_s": 0.1,
                "result": big,
                **sid,
            }
        )
        card = app.query_one(ToolCard)
        await wait_for(pilot, lambda: card.status is not None, 10, "the result")
        assert card.status == "ok" and len(card.result) < 10_000
        card.focus()
        await pilot.press("enter")
        assert card.expanded
        app.query_one("#prompt").focus()
        await pilot.press(*"ok")
        assert app.query_one("#prompt").text == "ok"
        assert time.monotonic() - t0 < 10  # generous: a hang, not a speed check
