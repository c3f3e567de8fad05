"""The pure parts of the server: line edits for applyEdit and command arguments."""

from __future__ import annotations

import random

import pytest
from lsp_harness import apply_text_edits
from lsprotocol import types as lsp
from opencomposer.server import lsp_commands as cmds
from opencomposer.server.workspace_overlay import code_units, line_edits, split_lines


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("a\nb\nc\n", "a\nB\nc\n"),
        ("a\nb\nc", "a\nb\nc\nd"),  # no final newline: the edit ends at the last character
        ("a\nb\nc", "a\nb"),
        ("", "x\ny\n"),
        ("x\ny\n", ""),
        ("α😀\r\nβ\r\n", "α😀\r\nγ\r\nδ"),  # CRLF and characters outside the BMP
        ("same\n", "same\n"),
    ],
)
def test_line_edits_turn_old_into_new(old: str, new: str) -> None:
    edits = line_edits(old, new)
    assert apply_text_edits(old, edits) == new
    assert all(
        e.range.start.character == 0 or e.range.start.line == len(split_lines(old)) - 1
        for e in edits
    )


def test_line_edits_random_round_trip() -> None:
    rng = random.Random(7)
    words = ["a\n", "b\n", "cc\n", "😀\n", "\n", "tail"]
    for _ in range(300):
        old = "".join(rng.choice(words) for _ in range(rng.randint(0, 12)))
        new = "".join(rng.choice(words) for _ in range(rng.randint(0, 12)))
        assert apply_text_edits(old, line_edits(old, new)) == new, (old, new)


def test_line_edits_touch_only_changed_lines() -> None:
    old = "".join(f"line {i}\n" for i in range(1000))
    new = old.replace("line 500\n", "LINE 500\n")
    (edit,) = line_edits(old, new)
    assert (edit.range.start.line, edit.range.end.line, edit.new_text) == (500, 501, "LINE 500\n")


def test_code_units_follow_the_negotiated_encoding() -> None:
    assert code_units("a😀", lsp.PositionEncodingKind.Utf16) == 3
    assert code_units("a😀", lsp.PositionEncodingKind.Utf8) == 5
    assert code_units("a😀", lsp.PositionEncodingKind.Utf32) == 2


def test_split_lines_only_on_lsp_line_breaks() -> None:
    assert split_lines("a\x0bb\u2028c\r\nd\re") == ["a\x0bb\u2028c\r\n", "d\r", "e"]


def test_ask_arguments_are_typed() -> None:
    args = cmds.parse(
        cmds.ASK,
        [
            {
                "query": "why?",
                "uri": "file:///x.py",
                "selection": {
                    "start": {"line": 1, "character": 0},
                    "end": {"line": 3, "character": 2},
                },
                "approve": "all",
            }
        ],
    )
    assert args.query == "why?" and args.approve == "all" and args.selection.end_line == 3


@pytest.mark.parametrize(
    ("command", "arguments", "message"),
    [
        (cmds.ASK, [{"query": " "}], "'query' is empty"),
        (cmds.ASK, [{"query": "x", "selection": {"start": 1}}], "LSP Range"),
        (cmds.ASK, [{"query": "x", "open_files": "a"}], "list of URIs"),
        (cmds.ASK, [{"query": "x"}, {}], "got 2 arguments"),
        (cmds.ASK, ["x"], "got str"),
        (cmds.SESSIONS, [{"limit": True}], "'limit' must be an integer"),
        (cmds.DECIDE, [{"session_id": "s", "path": "p"}], "needs 'decision'"),
        ("opencomposer.other", [], "unknown command"),
    ],
)
def test_bad_arguments_say_what_is_wrong(command: str, arguments: list, message: str) -> None:
    with pytest.raises(cmds.ArgError, match=message.replace("(", r"\(")):
        cmds.parse(command, arguments)


def test_cancel_and_sessions_need_no_argument() -> None:
    assert cmds.parse(cmds.CANCEL, []).session_id is None
    assert cmds.parse(cmds.SESSIONS, None).limit == 50
