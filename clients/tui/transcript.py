"""What a session looks like: prompts, streamed answers, the tool timeline, diffs.

Widgets are grouped by the area they draw; they never talk to the server. Buttons and
keys post `DiffEntry.Decided` messages that the app turns into LSP commands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rich.console import RenderableType
from rich.syntax import Syntax
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Button, Markdown, Static

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
CARD_WIDTH = 28
RESULT_LINES = 40
RESULT_CHARS = 8_000
DIFF_LINES = 400

# Display only: the tool elements of DESIGN.md's protocol, hidden from the streamed
# prose (the timeline shows them). Names seen in `tool_start` events are added.
TOOL_NAMES = {
    "read_file",
    "edit_file",
    "write_file",
    "delete_file",
    "list_dir",
    "glob",
    "grep",
    "codebase_search",
    "read_lints",
    "run_terminal",
}
_OPEN_TAG = re.compile(r"<([A-Za-z_][\w\-]*)(?=[\s/>])")
_PARTIAL_TAG = re.compile(r"<[A-Za-z_\-\w]*$")


class ToolCallFilter:
    """Streams assistant text with the tool-call XML elements cut out.

    `feed` may be called with any chunking; it holds back a possible tag start at the
    end of a chunk until the next chunk decides it.
    """

    def __init__(self, names: set[str] | None = None) -> None:
        self.names = names if names is not None else TOOL_NAMES
        self._buf = ""
        self._inside: str | None = None
        self._in_body = False

    def feed(self, chunk: str) -> str:
        self._buf += chunk
        out: list[str] = []
        while self._buf:
            if self._inside is None:
                i = self._buf.find("<")
                if i < 0:
                    out.append(self._buf)
                    self._buf = ""
                    break
                out.append(self._buf[:i])
                rest = self._buf[i:]
                match = _OPEN_TAG.match(rest)
                if match is None:
                    if _PARTIAL_TAG.fullmatch(rest) and len(rest) < 40:
                        self._buf = rest
                        break
                    out.append("<")
                    self._buf = rest[1:]
                    continue
                if match.group(1) not in self.names:
                    out.append(rest[: match.end()])
                    self._buf = rest[match.end() :]
                    continue
                self._inside, self._in_body = match.group(1), False
                self._buf = rest[match.end() :]
            elif not self._in_body:
                j = self._buf.find(">")
                if j < 0:
                    self._buf = self._buf[-1:] if self._buf.endswith("/") else ""
                    break
                self_closing = j > 0 and self._buf[j - 1] == "/"
                self._buf = self._buf[j + 1 :]
                if self_closing:
                    self._inside = None
                else:
                    self._in_body = True
            else:
                close = f"</{self._inside}>"
                k = self._buf.find(close)
                if k < 0:
                    self._buf = self._buf[-(len(close) - 1) :]
                    break
                self._buf = self._buf[k + len(close) :]
                self._inside = None
        return "".join(out)

    def flush(self) -> str:
        rest, self._buf = ("" if self._inside else self._buf), ""
        return rest


def visible_text(text: str, names: set[str] | None = None) -> str:
    """`text` without its tool-call elements, blank-line runs squeezed."""
    f = ToolCallFilter(names)
    shown = f.feed(text) + f.flush()
    return re.sub(r"\n{3,}", "\n\n", shown).strip()


def clip(text: str, max_lines: int = RESULT_LINES, max_chars: int = RESULT_CHARS) -> str:
    """Head and tail of a long text with a marker saying how much is hidden."""
    lines = text.splitlines()
    if len(lines) <= max_lines and len(text) <= max_chars:
        return text
    head_n, tail_n = max_lines * 2 // 3, max_lines // 3
    head, tail = lines[:head_n], lines[-tail_n:] if len(lines) > head_n else []
    head_s = "\n".join(head)[: max_chars * 2 // 3]
    tail_s = "\n".join(tail)[-(max_chars // 3) :]
    hidden = max(0, len(text) - len(head_s) - len(tail_s))
    return f"{head_s}\n… {hidden:,} characters not shown …\n{tail_s}"


def fmt_duration(seconds: float | None, show: bool) -> str:
    if seconds is None:
        return ""
    if not show:
        return "·"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def short_args(args: Any, width: int = 40) -> str:
    if not isinstance(args, dict):
        return "" if args is None else str(args)[:width]
    parts = []
    for key in ("path", "pattern", "query", "command"):
        if key in args:
            parts.append(str(args[key]).replace("\n", " "))
    if not parts:
        parts = [f"{k}={v}" for k, v in args.items() if len(str(v)) < 40]
    text = " ".join(parts)
    return text if len(text) <= width else text[: width - 1] + "…"


class UserEntry(Static):
    """A prompt the user sent."""

    def __init__(self, text: str) -> None:
        super().__init__(Text(text), classes="user")


class NoteEntry(Static):
    """A one-line note in the transcript (session end, errors)."""

    def __init__(self, text: str, kind: str = "info") -> None:
        super().__init__(Text(text), classes=f"note {kind}")


class AssistantEntry(Markdown):
    """One assistant turn, streamed in as Markdown with tool-call XML cut out."""

    def __init__(self, turn: int) -> None:
        super().__init__("", classes="assistant")
        self.turn = turn
        self.filter = ToolCallFilter()
        self.shown = ""
        self._pending = ""
        self.final = False

    def add(self, delta: str) -> None:
        """Queue streamed text; `App` flushes pending text to the screen on a timer."""
        self._pending += self.filter.feed(delta)

    async def flush(self) -> None:
        if self._pending and not self.final:
            chunk, self._pending = self._pending, ""
            self.shown += chunk
            await self.append(chunk)

    async def finish(self, text: str) -> None:
        """The whole message arrived: show exactly its prose."""
        self.final = True
        self._pending = ""
        final = visible_text(text, self.filter.names)
        if final != self.shown.strip():
            self.shown = final
            await self.update(final)
        self.display = bool(final)


class ToolCard(Static, can_focus=True):
    """One tool call: spinner while it runs, then status and duration; Enter expands."""

    BINDINGS = [Binding("enter,space", "toggle", "Expand", show=True)]

    def __init__(self, call_id: str, name: str, args: Any, show_timings: bool) -> None:
        super().__init__(classes="tool running")
        self.call_id = call_id
        self.name_ = name
        self.args = args
        self.status: str | None = None
        self.duration: float | None = None
        self.result: str | None = None
        self.expanded = False
        self.frame = 0
        self.show_timings = show_timings

    def on_mount(self) -> None:
        self.update(self._content())

    def tick(self) -> None:
        self.frame += 1
        self.update(self._content(), layout=False)  # same size: skip the layout pass

    def finish(self, status: str, duration: float | None, result: str | None) -> None:
        self.status = status
        self.duration = duration
        if result is not None:
            self.result = clip(result)
        self.remove_class("running")
        self.add_class("ok" if status == "ok" else "error")
        self.update(self._content())

    def action_toggle(self) -> None:
        self.expanded = not self.expanded
        self.set_class(self.expanded, "expanded")
        self.update(self._content())

    def on_click(self) -> None:
        self.action_toggle()

    def _content(self) -> RenderableType:
        if self.status is None:
            mark = SPINNER[self.frame % len(SPINNER)] if self.show_timings else "…"
        else:
            mark = "✓" if self.status == "ok" else "✗"
        head = Text()
        head.append(f"{mark} ", style="bold")
        head.append(self.name_, style="bold")
        dur = fmt_duration(self.duration, self.show_timings)
        if dur:
            head.append(f"  {dur}", style="dim")
        args = short_args(self.args)
        if args:
            head.append("\n" + args, style="dim")
        if self.expanded:
            body = self.result if self.result is not None else _args_text(self.args)
            head.append("\n" + (body or "(no output)"))
        elif self.result is not None and self.result.strip():
            head.append("\n▸ result", style="dim italic")
        return head


def _args_text(args: Any) -> str:
    if isinstance(args, dict):
        return "\n".join(f"{k}: {v}" for k, v in args.items())
    return "" if args is None else str(args)


class ToolGroup(Grid):
    """The calls of one assistant turn; calls that overlap in time sit side by side."""

    def __init__(self, turn: int) -> None:
        super().__init__(classes="tools")
        self.turn = turn

    def on_resize(self) -> None:
        self.relayout()

    def relayout(self) -> None:
        n = len(self.children) or 1
        width = self.size.width or CARD_WIDTH
        self.styles.grid_size_columns = max(1, min(n, width // CARD_WIDTH))


class DiffView(Widget):
    """A unified diff with syntax colours that follow the light or dark theme."""

    def __init__(self, diff: str) -> None:
        super().__init__(classes="diff-body")
        self.diff = diff

    def on_mount(self) -> None:
        self.watch(self.app, "theme", lambda _: self.refresh(layout=True), init=False)

    def render(self) -> RenderableType:
        theme = "ansi_dark" if self.app.current_theme.dark else "ansi_light"
        return Syntax(clip(self.diff, DIFF_LINES, 200_000), "diff", theme=theme, word_wrap=True)

    def get_content_height(self, container, viewport, width: int) -> int:
        return len(clip(self.diff, DIFF_LINES, 200_000).splitlines()) or 1


class DiffEntry(Vertical, can_focus=True):
    """An edit to one file: the diff, then Accept / Reject (a / r) for the file."""

    BINDINGS = [
        Binding("a", "decide('accept')", "Accept file"),
        Binding("r", "decide('reject')", "Reject file"),
    ]

    @dataclass
    class Decided(Message):
        entry: DiffEntry
        decision: str

    def __init__(self, session_id: str, path: str, diff: str) -> None:
        super().__init__(classes="diff pending")
        self.session_id = session_id
        self.path = path
        self.diff = diff
        self.state = "pending"

    def compose(self) -> ComposeResult:
        yield Static(self._title(), classes="diff-title")
        yield DiffView(self.diff)
        with Horizontal(classes="diff-actions"):
            yield Button("Accept", id="accept", variant="success", compact=True)
            yield Button("Reject", id="reject", variant="error", compact=True)

    STATES = {
        "pending": "edited · a accept · r reject",
        "accept": "accepted",
        "reject": "rejected, file restored",
        "reverted": "reverted",
        "queued-accept": "will be accepted when the session ends",
        "queued-reject": "will be rejected when the session ends",
    }

    def _title(self) -> Text:
        label = self.STATES.get(self.state, self.state)
        return Text.assemble(("✎ ", "bold"), (self.path, "bold"), ("  " + label, "italic"))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.action_decide(str(event.button.id))

    def action_decide(self, decision: str) -> None:
        if self.state == "pending":
            self.post_message(self.Decided(self, decision))

    def set_state(self, state: str) -> None:
        """One of `STATES`; the buttons show only while the edit is pending."""
        self.remove_class(*self.STATES)
        self.state = state
        self.add_class(state)
        self.query_one(".diff-title", Static).update(self._title())
        self.query_one(".diff-actions").display = state == "pending"
