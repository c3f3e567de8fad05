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


# -- TCP authentication records (lsp_auth) ----------------------------------------


def test_server_record_is_private_and_found_by_port(tmp_path, monkeypatch):
    """The token file is 0600 in a 0700 folder, even under a permissive umask."""
    import os
    import stat

    from opencomposer.server import lsp_auth

    monkeypatch.setenv("OPENCOMPOSER_HOME", str(tmp_path))
    monkeypatch.delenv("OPENCOMPOSER_TOKEN", raising=False)
    old = os.umask(0)
    try:
        info = lsp_auth.ServerInfo(host="127.0.0.1", port=4711, token="t0k", pid=os.getpid())
        path = lsp_auth.write_server_file(info)
    finally:
        os.umask(old)
    assert path == tmp_path / "servers" / "4711.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert lsp_auth.token_for(4711) == "t0k" and lsp_auth.token_for(4712) is None
    assert lsp_auth.running_servers() == [info]
    monkeypatch.setenv("OPENCOMPOSER_TOKEN", "from-env")
    assert lsp_auth.token_for(4711) == "from-env"
    lsp_auth.remove_server_file(path, "another server's token")
    assert path.exists()  # not ours any more: left alone
    lsp_auth.remove_server_file(path, "t0k")
    assert not path.exists()


def test_a_dead_servers_record_is_ignored(tmp_path, monkeypatch):
    import subprocess
    import sys

    from opencomposer.server import lsp_auth

    monkeypatch.setenv("OPENCOMPOSER_HOME", str(tmp_path))
    monkeypatch.delenv("OPENCOMPOSER_TOKEN", raising=False)
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    info = lsp_auth.ServerInfo(host="127.0.0.1", port=4713, token="old", pid=int(child.stdout))
    lsp_auth.write_server_file(info)
    assert lsp_auth.token_for(4713) is None and lsp_auth.running_servers() == []


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("192.168.1.10", False),
        ("10.0.0.1", False),
    ],
)
def test_only_loopback_addresses_are_served_without_allow_remote(host, allowed):
    from opencomposer.server.lsp_auth import check_bind

    if allowed:
        assert check_bind(host, allow_remote=False) is None
    else:
        with pytest.raises(ValueError, match="--allow-remote"):
            check_bind(host, allow_remote=False)
        assert "unencrypted" in check_bind(host, allow_remote=True)
