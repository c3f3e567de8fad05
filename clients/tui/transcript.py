"""What a session looks like: prompts, streamed answers, the tool timeline, diffs.

Widgets are grouped by the area they draw; they never talk to the server. Buttons and
keys post `DiffEntry.Decided` messages that the app turns into LSP commands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rich.console import RenderableType
from rich.markdown import Markdown as RichMarkdown
from rich.syntax import Syntax
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.geometry import Region, Size
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Button, Markdown, Static

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
CARD_WIDTH = 28
RESULT_LINES = 40
RESULT_CHARS = 8_000
DIFF_LINES = 400


def prose_text(prose: str) -> str:
    """A reply's prose (the server cut its tool-call XML out) as shown: blank-line runs
    squeezed, where the calls stood."""
    return re.sub(r"\n{3,}", "\n\n", prose).strip()


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


class OneLayout:
    """Mixin for transcript widgets that never scroll: a size change costs one layout pass.

    Textual stores a widget's new size in a reactive that asks for another layout pass,
    so every widget that grows costs a second pass in the next frame. These widgets do
    not scroll, so the first pass already placed everything; the second is skipped.
    """

    def _size_updated(
        self, size: Size, virtual_size: Size, container_size: Size, layout: bool = True
    ) -> bool:
        return super()._size_updated(  # type: ignore[misc]
            size, virtual_size, container_size, layout=False
        )


class Expandable(Static, can_focus=True):
    """A one-widget row that Enter, space or a click expands; `_content()` draws it."""

    BINDINGS = [Binding("enter,space", "toggle", "Expand", show=True)]
    expanded = False

    def _content(self) -> RenderableType:
        raise NotImplementedError

    def action_toggle(self) -> None:
        self.expanded = not self.expanded
        self.set_class(self.expanded, "expanded")
        self.update(self._content())

    def on_click(self) -> None:
        self.action_toggle()


class StreamView(OneLayout, Widget):
    """The streaming part of an assistant turn: one widget, only its last block re-rendered.

    Deltas arrive at hundreds a second. Textual's `Markdown.append` re-splits the whole
    source and mounts a widget per block, so every flush grows the widget tree and the
    screen's layout pass with it. Here the stream is split at blank lines outside code
    fences; finished blocks are rendered once (Rich's Markdown) into cached strips and
    only the open block is rendered again on a flush, and only its lines are repainted.
    The height grows in steps of `HEIGHT_STEP` lines (blank until filled), so the screen
    runs a layout pass every few lines of text, not on every flush. `AssistantEntry`
    swaps it for full Markdown widgets when the message ends.
    """

    DEFAULT_CSS = """
    StreamView {
        height: auto;
    }
    """

    MAX_OPEN = 3_000  # characters; a longer block is cut at a line (or word) end
    HEIGHT_STEP = 6  # lines

    def __init__(self) -> None:
        super().__init__()
        self.source = ""
        self._blocks: list[tuple[str, bool]] = []  # (source, blank line before)
        self._open = ""
        self._open_gap = False
        self._lines: list[Strip] = []  # the finished blocks at `_width`
        self._open_lines: list[Strip] = []
        self._width = 0

    def on_mount(self) -> None:
        self.watch(self.app, "theme", lambda _: self._invalidate(), init=False)

    def _invalidate(self) -> None:
        self._width = 0
        self.refresh(layout=True)

    def append(self, text: str) -> None:
        """Add streamed text; renders what changed if the width is known."""
        if not text:
            return
        self.source += text
        self._open += text
        finished = self._split()
        if not self._width:
            self.refresh(layout=True)
            return
        height, first = self.height_lines, len(self._lines)
        for block, gap in finished:
            self._lines.extend(self._block_lines(block, gap, bool(self._lines)))
        self._open_lines = self._block_lines(self._open, self._open_gap, bool(self._lines))
        if self.height_lines != height:
            self.refresh(layout=True)
        else:  # repaint the lines that changed, from the first new or open one
            self.refresh(Region(0, first, self._width, height - first))

    @property
    def line_count(self) -> int:
        return len(self._lines) + len(self._open_lines)

    @property
    def height_lines(self) -> int:
        """The lines, rounded up to a whole `HEIGHT_STEP`."""
        step = self.HEIGHT_STEP
        return -(-self.line_count // step) * step

    def _split(self) -> list[tuple[str, bool]]:
        """Move the finished blocks at the start of `_open` to `_blocks`; return them."""
        text, done = self._open, []
        start = block_start = 0
        fence: str | None = None
        fence_line = ""
        seen = False  # a non-blank line in the current block
        gap = self._open_gap
        while (nl := text.find("\n", start)) >= 0:
            line = text[start:nl]
            stripped = line.strip()
            if fence is not None:
                if stripped.startswith(fence):
                    fence = None
            elif stripped.startswith(("```", "~~~")):
                fence, fence_line, seen = stripped[:3], line, True
            elif not stripped:
                if seen:
                    done.append((text[block_start:start], gap))
                    gap, seen = True, False
                block_start = nl + 1
            else:
                seen = True
            start = nl + 1
        rest = text[block_start:]
        if len(rest) > self.MAX_OPEN:
            # One huge block (a long paragraph or code block): cut it so a flush never
            # re-renders more than MAX_OPEN characters. The full Markdown at the end of
            # the message joins it up again.
            cut = rest.rfind("\n", 0, len(rest) - 1)
            if cut <= 0:
                cut = rest.rfind(" ")
            if cut > 0:
                head, rest = rest[:cut], rest[cut + 1 :]
                if fence is not None:
                    head += "\n" + fence
                    rest = fence_line + "\n" + rest
                done.append((head, gap))
                gap = False
        self._open, self._open_gap = rest, gap
        self._blocks.extend(done)
        return done

    def _block_lines(self, source: str, gap: bool, after: bool) -> list[Strip]:
        if not source.strip():
            return []
        lines = self._render(source, self._width)
        return ([Strip.blank(0)] if gap and after else []) + lines

    def _render(self, source: str, width: int) -> list[Strip]:
        dark = self.app.current_theme.dark
        markdown = RichMarkdown(
            source,
            code_theme="ansi_dark" if dark else "ansi_light",
            hyperlinks=False,
            inline_code_theme="ansi_dark" if dark else "ansi_light",
        )
        console = self.app.console
        options = console.options.update(width=width, height=None, highlight=False)
        lines = console.render_lines(markdown, options, pad=False)
        strips = [Strip(line) for line in lines]
        while strips and not strips[0].text.strip():
            strips.pop(0)
        while strips and not strips[-1].text.strip():
            strips.pop()
        return strips

    def _ensure(self, width: int) -> None:
        if width == self._width or width <= 0:
            return
        self._width = width
        self._lines = []
        for block, gap in self._blocks:
            self._lines.extend(self._block_lines(block, gap, bool(self._lines)))
        self._open_lines = self._block_lines(self._open, self._open_gap, bool(self._lines))

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        self._ensure(width)
        return self.height_lines

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        self._ensure(width)
        style = self.rich_style
        n = len(self._lines)
        if y < n:
            strip = self._lines[y]
        elif y - n < len(self._open_lines):
            strip = self._open_lines[y - n]
        else:
            return Strip.blank(width, style)
        return strip.apply_style(style).crop_extend(0, width, style)


class AssistantEntry(OneLayout, Markdown):
    """One assistant turn: streamed into a `StreamView`, full Markdown once it ends.

    It shows the reply's prose, which the server's events carry with the tool-call XML
    already cut out by the agent's parser (the timeline shows the calls).
    """

    def __init__(self, turn: int) -> None:
        super().__init__("", classes="assistant")
        self.turn = turn
        self.shown = ""
        self._pending = ""
        self._view: StreamView | None = None
        self.final = False

    def add(self, prose: str) -> None:
        """Queue streamed prose; `App` flushes pending text to the screen on a timer."""
        self._pending += prose

    async def flush(self) -> None:
        if not self._pending or self.final:
            return
        chunk, self._pending = self._pending, ""
        self.shown += chunk
        if self._view is None:
            if not self.shown.strip():
                return  # nothing visible yet (leading whitespace before a tool call)
            self._view = StreamView()
            await self.mount(self._view)
            self._view.append(self.shown)
        else:
            self._view.append(chunk)

    async def finish(self, prose: str) -> None:
        """The whole message arrived: show exactly its prose, as full Markdown."""
        self.final = True
        self._pending = ""
        final = prose_text(prose)
        if final != self.shown.strip() or self._view is not None:
            self.shown = final
            await self.update(final)
            if self._view is not None:  # no blocks were mounted (empty prose)
                view, self._view = self._view, None
                view.display = False
                await view.remove()
        self.display = bool(final)

    def mount_all(self, widgets, **kwargs):  # type: ignore[override]
        # `Markdown.update` mounts its first blocks inside a batch update: hide the stream
        # view in the same batch so no frame shows the text twice.
        if self._view is not None:
            view, self._view = self._view, None
            view.display = False
            view.remove()
        return super().mount_all(widgets, **kwargs)


class ToolCard(OneLayout, Expandable):
    """One tool call: spinner while it runs, then status and duration; Enter expands."""

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
        self.update(self._content(), layout=False)  # before mount: no second layout

    def reset(self, call_id: str, name: str, args: Any) -> None:
        """Show another call (a folded card reused by `ToolGroup.start_call`)."""
        self.call_id, self.name_, self.args = call_id, name, args
        self.status = self.duration = self.result = None
        self.expanded = False
        self.frame = 0
        self.set_classes("tool running")
        self.update(self._content())

    def tick(self) -> None:
        self.frame += 1
        self.update(self._content(), layout=False)  # same size: skip the layout pass

    def finish(self, status: str, duration: float | None, result: str | None) -> None:
        """The call ended. `result` should already be clipped (`clip`), off the UI loop."""
        lines = self._content().plain.count("\n")
        self.status = status
        self.duration = duration
        if result is not None:
            self.result = clip(result)  # a no-op when the caller clipped it already
        # One class change, one restyle (remove + add would restyle twice).
        state = "ok" if status == "ok" else "error"
        self.set_classes(["tool", state, *(["expanded"] if self.expanded else [])])
        content = self._content()
        self.update(content, layout=content.plain.count("\n") != lines)

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


class ToolFold(OneLayout, Expandable):
    """Finished calls folded out of a busy turn: a one-line count; Enter lists them.

    A turn that makes hundreds of calls would otherwise keep hundreds of card widgets,
    and every layout pass of the screen walks all of them.
    """

    def __init__(self, show_timings: bool) -> None:
        super().__init__(classes="tool fold")
        self.show_timings = show_timings
        self.rows: list[Text] = []
        self.ok = 0
        self.failed = 0
        self.expanded = False
        self.update(self._content(), layout=False)

    def add(self, card: ToolCard) -> None:
        ok = card.status == "ok"
        self.ok += ok
        self.failed += not ok
        row = Text()
        row.append("✓ " if ok else "✗ ", style="bold")
        row.append(card.name_, style="bold")
        args = short_args(card.args)
        if args:
            row.append(f"  {args}", style="dim")
        dur = fmt_duration(card.duration, self.show_timings)
        if dur:
            row.append(f"  {dur}", style="dim")
        first = (card.result or "").strip().split("\n", 1)[0][:120]
        if first:
            row.append(f"  → {first}", style="dim italic")
        self.rows.append(row)

    def refresh_content(self) -> None:
        self.update(self._content(), layout=self.expanded)

    def _content(self) -> Text:
        head = Text(no_wrap=not self.expanded, overflow="ellipsis")
        head.append("▸ " if not self.expanded else "▾ ", style="bold")
        head.append(f"{len(self.rows)} earlier calls", style="bold")
        head.append(f" · {self.ok} ok", style="dim")
        if self.failed:
            head.append(f" · {self.failed} failed", style="dim")
        for row in self.rows if self.expanded else ():
            head.append("\n")
            head.append_text(row)
        return head


class ToolGroup(OneLayout, Grid):
    """The calls of one assistant turn; calls that overlap in time sit side by side.

    At most `MAX_CARDS` cards show; older finished calls fold into one `ToolFold` row
    at the top, so a turn with hundreds of calls keeps the layout small. A folded card
    widget is hidden and reused for the next call (mounting a widget costs several
    layout passes as it arrives; reusing one costs the single pass of the tick).
    """

    MAX_CARDS = 12

    def __init__(self, turn: int, show_timings: bool = True) -> None:
        super().__init__(classes="tools")
        self.turn = turn
        self.show_timings = show_timings
        self.fold: ToolFold | None = None
        self.columns = 1

    def on_resize(self) -> None:
        self.relayout()

    def start_call(self, call_id: str, name: str, args: Any) -> tuple[ToolCard, str | None]:
        """A card for a new call: a folded one reused, or a new one mounted.

        Returns the card and the call id it showed before (None for a new card).
        """
        spare = next((c for c in self.children if isinstance(c, ToolCard) and not c.display), None)
        if spare is None:
            card = ToolCard(call_id, name, args, self.show_timings)
            self.mount(card)
            replaced = None
        else:
            card, replaced = spare, spare.call_id
            card.reset(call_id, name, args)
            if self.children[-1] is not card:
                self.move_child(card, after=self.children[-1])
            card.display = True
        self.fold_finished()
        self.relayout()
        return card, replaced

    def fold_finished(self) -> None:
        """Fold the oldest finished cards, a whole grid row at a time.

        Whole rows keep every other card in its column (same width, so its rendered
        lines stay cached) and the group's height changes less often.
        """
        cards = [c for c in self.children if isinstance(c, ToolCard) and c.display]
        excess = len(cards) - self.MAX_CARDS
        if excess <= 0:
            return
        columns = max(1, self.columns)
        count = -(-excess // columns) * columns
        old = []
        for card in cards[:count]:
            if card.status is None or card.expanded or card.has_focus:
                break
            old.append(card)
        if len(old) < count:
            return  # the oldest row still has a running (or opened) call
        if self.fold is None:
            self.fold = ToolFold(self.show_timings)
            self.mount(self.fold, before=0)
        for card in old:
            self.fold.add(card)
            card.display = False  # hidden, kept for the next call
        self.fold.refresh_content()

    def relayout(self) -> None:
        n = sum(1 for c in self.children if isinstance(c, ToolCard) and c.display) or 1
        width = self.size.width or CARD_WIDTH
        columns = max(1, min(n, width // CARD_WIDTH))
        if columns != self.columns or self.styles.grid_size_columns != columns:
            self.columns = columns
            self.styles.grid_size_columns = columns


class DiffView(Widget):
    """A unified diff with syntax colours that follow the light or dark theme.

    The diff is clipped once, here; paints reuse it.
    """

    def __init__(self, diff: str) -> None:
        super().__init__(classes="diff-body")
        self.diff = diff
        self.shown = clip(diff, DIFF_LINES, 200_000)
        self.lines = len(self.shown.splitlines()) or 1

    def on_mount(self) -> None:
        self.watch(self.app, "theme", lambda _: self.refresh(layout=True), init=False)

    def render(self) -> RenderableType:
        theme = "ansi_dark" if self.app.current_theme.dark else "ansi_light"
        return Syntax(self.shown, "diff", theme=theme, word_wrap=True)

    def get_content_height(self, container, viewport, width: int) -> int:
        return self.lines


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
