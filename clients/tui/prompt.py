"""The prompt: a multi-line `TextArea` with history, paste, and `@file` completion.

Enter sends; Alt+Enter, Shift+Enter or Ctrl+J start a new line; a paste never sends.
Up on the first line and Down on the last walk the history of sent prompts. Typing
`@` followed by part of a path opens a list of workspace files; Tab or Enter takes the
highlighted one, Escape closes the list.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import OptionList, TextArea

MAX_FILES = 50_000
MAX_MATCHES = 8
_SKIP_DIRS = {".git", "node_modules", "__pycache__", ".venv", "venv", ".mypy_cache", ".tox"}
_MENTION = re.compile(r"(?:^|(?<=\s))@([\w./\-]*)$")
NEWLINE_KEYS = ("alt+enter", "shift+enter", "ctrl+j")


def workspace_files(root: Path) -> list[str]:
    """Workspace-relative file paths: `git ls-files` when it is a repository, else a walk."""
    try:
        out = subprocess.run(
            # the workspace's .git/config is untrusted: core.fsmonitor would run its program
            ["git", "-c", "core.fsmonitor=false", "ls-files", "-co", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        files = [line for line in out.splitlines() if line]
        if files:
            return sorted(files)[:MAX_FILES]
    except (OSError, subprocess.SubprocessError):
        pass
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        rel = Path(dirpath).relative_to(root)
        files.extend(str(rel / f) if str(rel) != "." else f for f in sorted(filenames))
        if len(files) >= MAX_FILES:
            break
    return sorted(files[:MAX_FILES])


def match_files(files: list[str], fragment: str, limit: int = MAX_MATCHES) -> list[str]:
    """Files whose path contains `fragment` (any case); file-name prefix matches first."""
    needle = fragment.lower()
    ranked = []
    for path in files:
        low = path.lower()
        if needle not in low:
            continue
        name = low.rsplit("/", 1)[-1]
        rank = 0 if name.startswith(needle) else 1 if low.startswith(needle) else 2
        ranked.append((rank, len(path), path))
        if len(ranked) > 2000:
            break
    return [p for _, _, p in sorted(ranked)[:limit]]


class PromptInput(TextArea):
    """The text box; the parent `PromptBar` owns history and completion."""

    @dataclass
    class Submitted(Message):
        text: str

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.sent: list[str] = []
        self._history_index: int | None = None
        self._draft = ""
        self.files: list[str] = []

    @property
    def mentions(self) -> OptionList:
        return self.parent.query_one("#mentions", OptionList)  # type: ignore[union-attr]

    async def _on_key(self, event: events.Key) -> None:
        key = event.key
        menu = self.mentions
        if menu.display:
            if key in ("up", "down"):
                self._stop(event)
                menu.action_cursor_up() if key == "up" else menu.action_cursor_down()
                return
            if key in ("tab", "enter"):
                self._stop(event)
                self._take_mention()
                return
            if key == "escape":
                self._stop(event)
                menu.display = False
                return
        if key == "enter":
            self._stop(event)
            self._submit()
            return
        if key in NEWLINE_KEYS:
            self._stop(event)
            self.insert("\n")
            return
        if key == "up" and self.cursor_location[0] == 0 and self.sent:
            self._stop(event)
            self._walk_history(-1)
            return
        last_row = self.cursor_location[0] == self.document.line_count - 1
        if key == "down" and last_row and self._history_index is not None:
            self._stop(event)
            self._walk_history(+1)
            return
        await super()._on_key(event)

    @staticmethod
    def _stop(event: events.Key) -> None:
        event.stop()
        event.prevent_default()

    def _submit(self) -> None:
        text = self.text
        if text.strip():
            if not self.sent or self.sent[-1] != text:
                self.sent.append(text)
            self.clear()
        self._history_index = None
        self.post_message(self.Submitted(text))

    def _walk_history(self, step: int) -> None:
        if self._history_index is None:
            if step > 0:
                return
            self._draft = self.text
            index = len(self.sent) - 1
        else:
            index = self._history_index + step
        if index >= len(self.sent):
            self._history_index = None
            self.load_text(self._draft)
        else:
            self._history_index = max(0, index)
            self.load_text(self.sent[self._history_index])
        self.move_cursor(self.document.end)

    def _mention_fragment(self) -> str | None:
        row, col = self.cursor_location
        line = self.document.get_line(row)[:col]
        match = _MENTION.search(line)
        return match.group(1) if match else None

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        fragment = self._mention_fragment()
        menu = self.mentions
        if fragment is None or not self.files:
            menu.display = False
            return
        found = match_files(self.files, fragment)
        menu.clear_options()
        if not found:
            menu.display = False
            return
        menu.add_options(found)
        menu.highlighted = 0
        menu.display = True

    def _take_mention(self) -> None:
        menu = self.mentions
        fragment = self._mention_fragment()
        menu.display = False
        if fragment is None or menu.highlighted is None:
            return
        choice = str(menu.get_option_at_index(menu.highlighted).prompt)
        row, col = self.cursor_location
        self.replace(choice + " ", (row, col - len(fragment)), (row, col))
        menu.display = False


class PromptBar(Vertical):
    """The completion list stacked above the prompt box."""

    def compose(self) -> ComposeResult:
        menu = OptionList(id="mentions")
        menu.display = False
        menu.can_focus = False
        yield menu
        yield PromptInput(id="prompt")
