"""Approvals through the language server mean what they mean in `opencomposer ask`.

Guards the old split: under `safe` the server applied file edits without asking,
while `ask` asked. Now a file change under `safe` becomes a
`window/showMessageRequest` unless the client sends its own `auto_apply_edits`
setting (docs/lsp.md, Approvals). Real server over stdio, scripted editor.
"""

from __future__ import annotations

from lsp_harness import scripted

ASK = "opencomposer.ask"
FIX = '<edit_file path="calc.py">\n<old>    return a - b</old>\n<new>    return a + b</new>\n</edit_file>'


async def test_safe_asks_before_a_file_change(spawn, repo, tmp_path):
    before = (repo / "calc.py").read_text()
    editor = await spawn(scripted(tmp_path / "m.json", [FIX, "fixed"]))
    editor.approve_with = "Reject"
    result = await editor.command(ASK, {"query": "fix add"})
    assert result["status"] == "completed"
    assert len(editor.approval_requests) == 1 and "edit_file calc.py" in editor.approval_requests[0]
    assert (repo / "calc.py").read_text() == before and not editor.edits_received
    end = next(e for e in editor.events if e["type"] == "tool_end")
    assert end["status"] == "error"


async def test_auto_apply_edits_is_the_clients_own_setting(spawn, repo, tmp_path):
    editor = await spawn(scripted(tmp_path / "m.json", [FIX, "fixed"]))
    editor.approve_with = "Reject"  # would refuse, were it asked
    result = await editor.command(ASK, {"query": "fix add", "auto_apply_edits": True})
    assert result["status"] == "completed" and result["edits"] == ["calc.py"]
    assert editor.approval_requests == []
    assert "return a + b" in (repo / "calc.py").read_text()


async def test_auto_apply_edits_does_not_loosen_none(spawn, repo, tmp_path):
    before = (repo / "calc.py").read_text()
    editor = await spawn(scripted(tmp_path / "m.json", [FIX, "fixed"]))
    editor.approve_with = "Reject"
    await editor.command(ASK, {"query": "fix", "approve": "none", "auto_apply_edits": True})
    assert len(editor.approval_requests) == 1
    assert (repo / "calc.py").read_text() == before


async def test_the_approval_shows_the_whole_command_and_its_hidden_characters(
    spawn, repo, tmp_path
):
    """Guards: the editor's approval showed only the first 500 characters of a
    command, so a long one hid its tail (`; touch …`) from the person approving,
    and raw ANSI escapes or U+202E could disguise what showed."""
    command = "echo " + "x" * 600 + " \x1b[8m; touch pwned\u202e"
    call = f"<run_terminal><command>{command}</command></run_terminal>"
    editor = await spawn(scripted(tmp_path / "m.json", [call, "done"]))
    editor.approve_with = "Reject"
    await editor.command(ASK, {"query": "run it"})
    assert len(editor.approval_requests) == 1
    message = editor.approval_requests[0]
    assert "x" * 600 in message and "\\x1b[8m; touch pwned\\u202e" in message
    assert "\x1b" not in message and "\u202e" not in message
    assert not (repo / "pwned").exists()
