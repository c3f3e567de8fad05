"""The terminal approval prompt shows the model's command exactly as it will run.

It once rendered the command through rich markup: a `[conceal]` tag hid
`; touch …` from the user, and the hidden part ran after `y`.
"""

from __future__ import annotations

import io
import unicodedata

import pytest
from opencomposer.server.ask import HumanView
from rich.console import Console


def _prompt(
    command: str, monkeypatch: pytest.MonkeyPatch, answer: str = "n", *, colour: bool = True
) -> tuple[str, str]:
    """What a person sees (with colour: as the terminal gets it) and their decision."""
    view = HumanView()
    buf = io.StringIO()
    view.console = Console(
        file=buf, force_terminal=colour, color_system="truecolor" if colour else None, width=400
    )
    monkeypatch.setattr("builtins.input", lambda prompt="": answer)
    decision = view.approve("run_terminal", {"command": command})
    return buf.getvalue(), decision


@pytest.mark.parametrize(
    "command",
    [
        "ls [conceal]; touch pwned[/conceal]",
        "ls [conceal]; touch pwned",
        "ls [/]; touch pwned",
        "echo [bold red]x[/] [link=http://x]; touch pwned[/link]",
    ],
)
def test_markup_in_the_command_is_shown_not_rendered(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, decision = _prompt(command, monkeypatch)
    assert command in out and decision == "reject"
    assert "\x1b[8m" not in out  # rich's conceal


@pytest.mark.parametrize(
    "command, shown",
    [
        ("ls\x1b[8m; touch pwned", "ls\\x1b[8m; touch pwned"),
        ("ls\r; touch pwned", "ls\\r; touch pwned"),
        ("ls \u202e; touch pwned", "ls \\u202e; touch pwned"),
        ("ls\u200b; touch pwned", "ls\\u200b; touch pwned"),
        ("ls\x08\x08; touch pwned", "ls\\x08\\x08; touch pwned"),
    ],
)
def test_control_and_format_characters_are_made_visible(
    command: str, shown: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, _ = _prompt(command, monkeypatch, colour=False)
    assert shown in plain
    assert not any(unicodedata.category(ch)[0] == "C" for ch in plain.replace("\n", ""))
    coloured, _ = _prompt(command, monkeypatch)
    assert "\x1b[8m" not in coloured and command not in coloured


def test_multi_line_commands_and_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    out, decision = _prompt("cat <<'EOF' > a.txt\n[red]x[/red]\nEOF", monkeypatch, answer="a")
    assert "cat <<'EOF' > a.txt\n[red]x[/red]\nEOF" in out and decision == "always"
