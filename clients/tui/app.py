"""`opencomposer tui`: the agent in a terminal, as a client of the language server.

The app starts `opencomposer serve` as a child over stdio (or connects over TCP) and
speaks only LSP to it (`link.ServerLink`), so every behaviour is the server's and the
TUI stays thin: it draws the event stream, applies edits the server sends, asks the
user for approvals, and calls the `opencomposer.*` commands of `docs/lsp.md`.

A request continues the current session (a follow-up: the agent keeps the history,
docs/lsp.md "Follow-ups"); ctrl+s, the "New session" command or typing `/new` starts
a fresh one.

Run it:  opencomposer tui --workspace DIR --model scripted:turns.json
or:      python -m opencomposer.clients.tui.app --workspace DIR --model smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opencomposer.clients.tui.link import LinkConfig, LinkError, ServerLink, server_command
from opencomposer.clients.tui.prompt import PromptBar, PromptInput, workspace_files
from opencomposer.clients.tui.screens import ApprovalScreen, LogScreen, SearchScreen, SessionsScreen
from opencomposer.clients.tui.transcript import (
    AssistantEntry,
    DiffEntry,
    NoteEntry,
    OneLayout,
    ToolCard,
    ToolGroup,
    UserEntry,
    fmt_duration,
)
from rich.text import Text
from textual import events, on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
from textual.theme import Theme
from textual.widget import AwaitMount
from textual.widgets import Footer, Static

NEW_COMMAND = "/new"  # typed in the prompt: a new session (with a request after it, for that)
NEW_NOTE = "■ new session: the next request starts without the history above"

# One timer paces everything the transcript animates: server events are drawn, streamed
# text is flushed and spinners advance together, once per tick. Between ticks the
# transcript has nothing to repaint, so a key press costs one small frame; a tick costs
# one bigger frame (and at most one layout pass), not one per event.
TICK_INTERVAL_S = 0.1
# Input first: a tick that comes due while a key press is not yet on screen waits (at
# most this long) for that paint, so the key's frame is not the one carrying the tick.
INPUT_FIRST_S = 0.05


@dataclass(kw_only=True)
class SessionView:
    """What the app tracks about the running (or last) session."""

    query: str
    session_id: str | None = None  # set from the start for a follow-up
    request: int = 1  # 2, 3, … for follow-ups in the same session
    turn: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    status: str = "starting"
    progress: str = ""
    assistant: dict[int, AssistantEntry] = field(default_factory=dict)
    groups: dict[int, ToolGroup] = field(default_factory=dict)
    cards: dict[str, ToolCard] = field(default_factory=dict)
    diffs: list[DiffEntry] = field(default_factory=list)
    answered: bool = False


class Tick(Message, bubble=False):
    """Time to draw: the events waiting in `App.inbox`, streamed text, spinners.

    Events arrive at hundreds a second while the model streams; they are drawn in one
    batch per tick, on the `Transcript`'s own queue, so key presses (which go through
    the app's queue to the prompt) never wait behind them.
    """


class ServerStopped(Message):
    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason


class ServerNote(Message):
    def __init__(self, kind: str, text: str, path: Path | None = None) -> None:
        super().__init__()
        self.kind = kind
        self.text = text
        self.path = path


class AskDone(Message, bubble=False):
    """`opencomposer.ask` returned (`result`) or failed (`error`)."""

    def __init__(self, session: SessionView, result: dict[str, Any] | None, error: str | None):
        super().__init__()
        self.session = session
        self.result = result
        self.error = error


class Transcript(OneLayout, VerticalScroll):
    """The session's scrolling history, and the queue that draws it.

    Ticks (server events, stream flushes, spinners) and the end of `ask` are handled
    here, in this widget's message queue and in order, not in the app's: a key press
    never waits behind a batch of events or a Markdown conversion.
    """

    _ticking = False

    async def on_tick(self, message: Tick) -> None:
        try:
            await self.app.input_painted(INPUT_FIRST_S)  # type: ignore[attr-defined]
            await self.app.tick()  # type: ignore[attr-defined]
        finally:
            self._ticking = False

    def post_tick(self) -> None:
        """Post a `Tick` unless one is still waiting or running (ticks never pile up)."""
        if not self._ticking:
            self._ticking = True
            self.post_message(Tick())

    async def on_ask_done(self, message: AskDone) -> None:
        await self.app.ask_done(message)  # type: ignore[attr-defined]


class StatusLine(Static):
    """model · turn · tokens · elapsed · state, on one line."""


class OpenComposerApp(App[int]):
    """The terminal client. `command` overrides the server child (tests use it)."""

    CSS_PATH = "app.tcss"
    TITLE = "opencomposer"
    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+f", "search", "Search"),
        Binding("ctrl+o", "sessions", "Sessions"),
        Binding("ctrl+s", "new_session", "New session"),
        Binding("ctrl+n", "next_edit", "Next edit"),
        Binding("ctrl+g", "undo", "Undo edits"),
        Binding("ctrl+r", "restart", "Restart server"),
        Binding("ctrl+l", "log", "Log", show=False),
        Binding("ctrl+t", "toggle_theme", "Light/dark", show=False),
    ]

    def __init__(
        self,
        *,
        workspace: Path,
        model: str,
        tcp: str | None = None,
        command: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
        show_timings: bool = True,
        approve: str | None = None,
        auto_apply_edits: bool = True,
    ) -> None:
        super().__init__()
        self.workspace = workspace.resolve()
        self.model = model
        self.tcp = tcp
        self.command = list(command) if command else server_command(model)
        self.env = env
        self.show_timings = show_timings
        self.approve = approve
        # edits land in the transcript's review (accept / reject / undo), so under the
        # `safe` policy they need no question first (docs/lsp.md, auto_apply_edits)
        self.auto_apply_edits = auto_apply_edits
        self.link: ServerLink | None = None
        self.connected = False
        self.session: SessionView | None = None
        # the session a request continues (None: the next request starts a new one)
        self.conversation: str | None = None
        self.sessions_seen: list[str] = []
        self.log_lines: list[Text] = []
        self.server_error: str | None = None
        self.queued: list[tuple[DiffEntry, str]] = []
        self._status_text = ""
        self.inbox: list[dict[str, Any]] = []
        self._theme_cache: tuple[str, Theme] | None = None
        self._key_painted = asyncio.Event()
        self._key_painted.set()

    @property
    def current_theme(self) -> Theme:
        """Textual's, cached: it is read for every line painted and copies the theme table."""
        name = self.theme
        cached = getattr(self, "_theme_cache", None)
        if cached is None or cached[0] != name:
            cached = self._theme_cache = (name, super().current_theme)
        return cached[1]

    async def on_event(self, event: events.Event) -> None:
        if isinstance(event, events.Key):
            # Note the key until the screen has been painted after it (see input_painted).
            self._key_painted.clear()
            self.call_after_refresh(self._key_painted.set)
        await super().on_event(event)

    async def input_painted(self, timeout: float) -> None:
        """Wait until the last key press is on screen (or `timeout` s have passed)."""
        if not self._key_painted.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._key_painted.wait(), timeout)

    # -- layout -------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Transcript(id="transcript")
        yield Static("", id="banner")
        yield PromptBar(id="prompt-bar")
        yield StatusLine("", id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#banner").display = False
        transcript = self.query_one(Transcript)
        transcript.anchor()
        self._transcript = transcript
        self.query_one(PromptInput).focus()
        # Timer callbacks run in their own task; posting keeps every transcript change
        # on the transcript's queue, ordered with the end of `ask`.
        self.set_interval(TICK_INTERVAL_S, transcript.post_tick)
        self.set_interval(1.0, self._refresh_status)
        self._load_files()
        self._refresh_status()
        self.connect()

    @work(thread=True, exclusive=True, group="files")
    def _load_files(self) -> None:
        files = workspace_files(self.workspace)
        self.call_from_thread(setattr, self.query_one(PromptInput), "files", files)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Codebase search", "Search the index (ctrl+f)", self.action_search)
        yield SystemCommand(
            "Sessions",
            "Browse traces, continue one, submit as training query (ctrl+o)",
            self.action_sessions,
        )
        yield SystemCommand(
            "New session",
            "The next request starts a new session, without this one's history (ctrl+s, /new)",
            self.action_new_session,
        )
        yield SystemCommand("Cancel session", "Stop the running session (esc)", self.action_cancel)
        yield SystemCommand(
            "Next edit",
            "Focus the next edit to accept (a) or reject (r) (ctrl+n)",
            self.action_next_edit,
        )
        yield SystemCommand(
            "Undo session edits", "Revert every edit of the last session (ctrl+g)", self.action_undo
        )
        yield SystemCommand(
            "Restart server", "Start the language server again (ctrl+r)", self.action_restart
        )
        yield SystemCommand("Server log", "Messages the server logged (ctrl+l)", self.action_log)
        yield SystemCommand(
            "Light / dark",
            "Switch between the light and dark theme (ctrl+t)",
            self.action_toggle_theme,
        )

    # -- connection ---------------------------------------------------------------------

    @work(exclusive=True, group="link")
    async def connect(self) -> None:
        self.connected = False
        self.server_error = None
        self._banner(None)
        self._set_state("connecting")
        config = LinkConfig(
            workspace=self.workspace, command=self.command, tcp=self.tcp, env=self.env
        )
        link = ServerLink(config, self)
        self.link = link
        try:
            await link.start()
        except LinkError as exc:
            self._server_down(str(exc))
            return
        self.connected = True
        self._set_state("ready")
        settle_heap()

    async def disconnect(self) -> None:
        link, self.link = self.link, None
        self.connected = False
        if link is not None:
            await link.stop()

    async def action_restart(self) -> None:
        self.server_error = None
        await self.disconnect()
        self.connect()

    def _server_down(self, reason: str) -> None:
        self.connected = False
        self.server_error = reason
        self._banner(f"⚠ {reason}\nPress ctrl+r to restart the language server.")
        self._set_state("server stopped")
        if self.session is not None and self.session.ended is None:
            self.session.ended = time.monotonic()
            self.session.status = "interrupted"

    def _banner(self, text: str | None) -> None:
        banner = self.query_one("#banner", Static)
        banner.display = text is not None
        banner.update(Text(text or ""))

    async def on_unmount(self) -> None:
        await self.disconnect()

    # -- LinkUI: called by the link on this loop -----------------------------------------

    def server_event(self, event: dict[str, Any]) -> None:
        self.inbox.append(event)  # drawn on the next tick

    async def tick(self) -> None:
        """Draw what arrived since the last tick (runs on the transcript's queue)."""
        try:
            # One frame for the whole tick, however many mounts it awaits.
            with self.batch_update():
                await self.drain_inbox()
                await self._flush_streams()
                self._spin()
        except NoMatches:  # the app is closing: its widgets are gone
            return

    async def drain_inbox(self) -> None:
        batch, self.inbox = self.inbox, []
        for event in batch:
            await self.handle_event(event)
        if any(event.get("type") != "model_delta" for event in batch):
            self._refresh_status()

    async def server_approval(self, message: str, actions: list[str]) -> str | None:
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

        def done(choice: str | None) -> None:
            if not future.done():
                future.set_result(choice)

        self.push_screen(ApprovalScreen(message, actions), callback=done)
        return await future

    def server_progress(self, token: str, value: dict[str, Any]) -> None:
        text = value.get("message") or value.get("title") or ""
        if value.get("kind") == "end":
            text = ""
        self.post_message(ServerNote("progress", str(text)))

    def server_show_document(self, path: Path) -> None:
        self.post_message(ServerNote("show", "", path))

    def server_log(self, level: int, message: str) -> None:
        self.post_message(ServerNote(f"log{level}", message))

    def server_edit_failed(self, message: str) -> None:
        self.post_message(ServerNote("log1", f"could not apply an edit: {message}"))

    def server_stopped(self, reason: str) -> None:
        self.post_message(ServerStopped(reason))

    def on_server_stopped(self, message: ServerStopped) -> None:
        self._server_down(message.reason)

    def on_server_note(self, message: ServerNote) -> None:
        if message.kind == "progress":
            if self.session is not None:
                self.session.progress = message.text
                self._refresh_status()
        elif message.kind == "show" and message.path is not None:
            self._reveal(message.path)
        elif message.kind.startswith("log"):
            level = int(message.kind[3:] or 4)
            style = {1: "red", 2: "yellow"}.get(level, "")
            self.log_lines.append(Text(message.text, style=style))
            del self.log_lines[:-2000]
            if level == 1:
                self.notify(message.text, severity="error", markup=False)

    def _reveal(self, path: Path) -> None:
        if self.session is None:
            return
        for entry in reversed(self.session.diffs):
            if (self.workspace / entry.path).resolve() == path.resolve():
                self.query_one("#transcript", VerticalScroll).scroll_to_widget(entry, animate=False)
                return

    # -- sessions ------------------------------------------------------------------------

    @on(PromptInput.Submitted)
    def submitted(self, message: PromptInput.Submitted) -> None:
        text = message.text.strip()
        if text == NEW_COMMAND or text.startswith(NEW_COMMAND + " "):
            if not self.action_new_session():
                return
            text = text[len(NEW_COMMAND) :].strip()
            if not text:
                return
        if not text:
            self.notify("Type a request first.", severity="warning")
            return
        if not self.connected or self.link is None:
            self.notify(
                "The language server is not running (ctrl+r restarts it).", severity="error"
            )
            return
        if self.session is not None and self.session.ended is None:
            self.notify("A session is running; esc cancels it.", severity="warning")
            return
        self.session = SessionView(query=text, session_id=self.conversation)
        self._mount(UserEntry(text))
        self._set_state("thinking")
        self.ask(self.session, text)

    @work(group="ask")
    async def ask(self, session: SessionView, text: str) -> None:
        """Run `opencomposer.ask`; the outcome goes back onto the message queue."""
        argument: dict[str, Any] = {
            "query": text,
            "reveal": True,
            "auto_apply_edits": self.auto_apply_edits,
        }
        if self.approve:
            argument["approve"] = self.approve
        if session.session_id:
            argument["session_id"] = session.session_id  # a follow-up
        try:
            if self.link is None:
                raise LinkError("the language server is not running")
            result = await self.link.command("opencomposer.ask", argument)
        except LinkError as exc:
            self._transcript.post_message(AskDone(session, None, str(exc)))
        else:
            outcome = result if isinstance(result, dict) else {}
            self._transcript.post_message(AskDone(session, outcome, None))

    async def ask_done(self, message: AskDone) -> None:
        """`ask` returned; runs on the transcript's queue, after the session's events."""
        try:
            await self._ask_done(message)
        except NoMatches:  # the app is closing
            return

    async def _ask_done(self, message: AskDone) -> None:
        session, result = message.session, message.result
        await self.drain_inbox()  # the session's last events came before the answer
        await self._flush_streams()
        session.ended = session.ended or time.monotonic()
        if result is None:
            session.status = "error" if self.connected else "interrupted"
            await self._mount(NoteEntry(f"✗ {message.error}", "error"))
            if "cannot continue:" in str(message.error):  # the server cannot resume it
                self.conversation = None
                await self._mount(NoteEntry(NEW_NOTE, "ok"))
            self.queued.clear()
            self._refresh_status()
            return
        session.session_id = session.session_id or result.get("session_id")
        self.conversation = session.session_id  # the next request follows up on it
        session.status = str(result.get("status", session.status))
        answer = str(result.get("answer") or "")
        if answer and not session.answered:
            entry = AssistantEntry(session.turn + 1)
            await self._mount(entry)
            await entry.finish(answer)  # a final answer holds no tool call
        if result.get("error"):
            await self._mount(NoteEntry(f"✗ {result['error']}", "error"))
        self._refresh_status()
        self._decide_queued()
        settle_heap()

    async def handle_event(self, event: dict[str, Any]) -> None:
        """Draw one session event (DESIGN.md's stream plus `session_id`)."""
        session = self.session
        kind = event.get("type")
        sid = event.get("session_id")
        if session is None or (session.session_id and sid and sid != session.session_id):
            return
        if kind == "session_start":
            session.session_id = sid
            session.request = int(event.get("request") or 1)
            if str(sid) not in self.sessions_seen:
                self.sessions_seen.append(str(sid))
        elif kind == "model_start":
            session.turn = int(event.get("turn", session.turn + 1))
            session.status = "thinking"
        elif kind == "model_delta":
            entry = await self._assistant(session, int(event.get("turn", session.turn)))
            entry.add(str(event.get("prose", "")))
        elif kind == "message":
            entry = await self._assistant(session, int(event.get("turn", session.turn)))
            await entry.finish(str(event.get("prose", "")))
            session.answered = True
        elif kind == "model_end":
            session.prompt_tokens += int(event.get("prompt_tokens") or 0)
            session.completion_tokens += int(event.get("completion_tokens") or 0)
        elif kind == "tool_start":
            await self._tool_start(session, event)
        elif kind == "tool_end":
            card = session.cards.get(str(event.get("call_id")))
            if card is not None:
                result = event.get("result", event.get("output"))
                card.finish(
                    str(event.get("status", "ok")),
                    event.get("duration_s"),
                    None if result is None else str(result),
                )
                group = card.parent
                if isinstance(group, ToolGroup):
                    group.fold_finished()
            if not any(c.status is None for c in session.cards.values()):
                session.status = "thinking"
        elif kind == "edit":
            await self._edit(session, event)
        elif kind == "session_end":
            await self._flush_streams()
            session.status = str(event.get("status", "done"))
            session.ended = time.monotonic()
            await self._mount(
                NoteEntry(
                    self._summary(event),
                    "ok" if session.status in ("ok", "completed") else "warn",
                )
            )

    def _summary(self, event: dict[str, Any]) -> str:
        parts = [f"session {event.get('status', 'ended')}"]
        if event.get("turns") is not None:
            parts.append(f"{event['turns']} turns")
        if event.get("tool_calls") is not None:
            parts.append(f"{event['tool_calls']} tool calls")
        if self.show_timings and event.get("duration_s") is not None:
            parts.append(fmt_duration(float(event["duration_s"]), True))
        return "■ " + " · ".join(parts)

    async def _assistant(self, session: SessionView, turn: int) -> AssistantEntry:
        entry = session.assistant.get(turn)
        if entry is None:
            entry = AssistantEntry(turn)
            session.assistant[turn] = entry
            await self._mount(entry)
        return entry

    async def _tool_start(self, session: SessionView, event: dict[str, Any]) -> None:
        turn = int(event.get("turn", session.turn))
        name = str(event.get("name", "?"))
        group = session.groups.get(turn)
        if group is None:
            group = ToolGroup(turn, self.show_timings)
            session.groups[turn] = group
            await self._mount(group)
        card, replaced = group.start_call(str(event.get("call_id")), name, event.get("args"))
        if replaced is not None:  # a folded card, reused: its old call has ended
            session.cards.pop(replaced, None)
        session.cards[card.call_id] = card
        session.status = "running tools"

    async def _edit(self, session: SessionView, event: dict[str, Any]) -> None:
        path = str(event.get("path", "?"))
        entry = DiffEntry(str(session.session_id or ""), path, str(event.get("diff", "")))
        session.diffs.append(entry)
        await self._mount(entry)

    def _mount(self, widget) -> AwaitMount:
        return self._transcript.mount(widget)

    async def _flush_streams(self) -> None:
        if self.session is not None:
            for entry in list(self.session.assistant.values()):
                await entry.flush()

    def _spin(self) -> None:
        if self.session is None or not self.show_timings:
            return
        for card in self.session.cards.values():
            if card.status is None:
                card.tick()

    # -- edits ---------------------------------------------------------------------------

    @on(DiffEntry.Decided)
    def decided(self, message: DiffEntry.Decided) -> None:
        session, entry = self.session, message.entry
        if session is not None and session.ended is None:
            # The server decides on finished sessions only: hold the choice until then.
            self.queued.append((entry, message.decision))
            entry.set_state(f"queued-{message.decision}")
            return
        self.decide(entry, message.decision)

    @work(group="decide")
    async def decide(self, entry: DiffEntry, decision: str) -> None:
        if self.link is None or not self.connected:
            self.notify("The language server is not running.", severity="error")
            return
        argument = {"session_id": entry.session_id, "path": entry.path, "decision": decision}
        try:
            await self.link.command("opencomposer.decide", argument)
        except LinkError as exc:
            self.notify(str(exc), severity="error", markup=False)
            return
        for other in self._diffs(entry.session_id):
            if other.path == entry.path and other.state in ("pending", f"queued-{decision}"):
                other.set_state(decision)

    def _decide_queued(self) -> None:
        queued, self.queued = self.queued, []
        for entry, decision in queued:
            self.decide(entry, decision)

    def _diffs(self, session_id: str) -> list[DiffEntry]:
        return [d for d in self.query(DiffEntry) if d.session_id == session_id]

    @work(group="undo")
    async def action_undo(self) -> None:
        session = self.session
        if session is None or not session.session_id or self.link is None:
            self.notify("No session to undo.", severity="warning")
            return
        try:
            result = await self.link.command(
                "opencomposer.undo", {"session_id": session.session_id}
            )
        except LinkError as exc:
            self.notify(str(exc), severity="error", markup=False)
            return
        reverted = (result or {}).get("reverted", []) if isinstance(result, dict) else []
        for entry in self._diffs(session.session_id):
            entry.set_state("reverted")
        self.notify(f"Reverted {len(reverted)} file(s).", title="Undo")

    # -- keys ------------------------------------------------------------------------------

    def action_new_session(self) -> bool:
        """The next request starts a new session (False while a request runs)."""
        if self.session is not None and self.session.ended is None:
            self.notify("A session is running; esc cancels it first.", severity="warning")
            return False
        if self.conversation is not None:
            self.conversation = None
            self._mount(NoteEntry(NEW_NOTE, "ok"))
        self.notify("The next request starts a new session.", title="New session")
        self._refresh_status()
        return True

    @work(group="cancel")
    async def action_cancel(self) -> None:
        session = self.session
        if session is None or session.ended is not None or self.link is None:
            return
        session.status = "cancelling"
        self._refresh_status()
        argument = {"session_id": session.session_id} if session.session_id else {}
        try:
            await self.link.command("opencomposer.cancel", argument)
        except LinkError as exc:
            self.notify(str(exc), severity="error", markup=False)

    def action_next_edit(self) -> None:
        """Focus the next edit still waiting for accept (a) or reject (r)."""
        pending = [d for d in self.query(DiffEntry) if d.state == "pending"]
        if not pending:
            self.notify("No edit is waiting for a decision.")
            return
        after = [
            d for d in pending if self.focused is not None and d.region.y > self.focused.region.y
        ]
        target = (after or pending)[0]
        target.focus()
        self.query_one("#transcript", VerticalScroll).scroll_to_widget(target, animate=False)

    def action_search(self) -> None:
        if not self.connected:
            self.notify("The language server is not running.", severity="error")
            return
        self.push_screen(SearchScreen(self._run))

    def action_sessions(self) -> None:
        if not self.connected:
            self.notify("The language server is not running.", severity="error")
            return
        self.push_screen(SessionsScreen(self._run), callback=self.continue_session)

    def continue_session(self, session_id: str | None) -> None:
        """The next request follows up on `session_id` (chosen in the sessions list)."""
        if not session_id:
            return
        if self.session is not None and self.session.ended is None:
            self.notify("A session is running; esc cancels it first.", severity="warning")
            return
        self.conversation = session_id
        self._mount(
            NoteEntry(f"■ continuing session {session_id}: the next request follows up", "ok")
        )
        self._refresh_status()

    def action_log(self) -> None:
        self.push_screen(LogScreen(self.log_lines))

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.current_theme.dark else "textual-dark"

    async def _run(self, name: str, argument: dict[str, Any]) -> Any:
        if self.link is None:
            raise LinkError("the language server is not running")
        return await self.link.command(name, argument)

    # -- status ----------------------------------------------------------------------------

    def _set_state(self, state: str) -> None:
        if self.session is not None and self.session.ended is None and state in ("thinking",):
            self.session.status = state
        self._state = state
        self._refresh_status()

    def _refresh_status(self) -> None:
        try:
            status = self.query_one("#status", StatusLine)
        except Exception:
            return
        session = self.session
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(short_model(self.model), style="bold")
        if session is not None:
            if session.request > 1 and self.conversation == session.session_id:
                text.append(f" · request {session.request}")
            text.append(f" · turn {session.turn}")
            text.append(
                f" · {_tokens(session.prompt_tokens)}↑ {_tokens(session.completion_tokens)}↓"
            )
            if self.show_timings:
                end = session.ended or time.monotonic()
                text.append(f" · {end - session.started:.0f}s")
            state = session.status if session.ended or self.connected else self._state
            if session.progress and session.ended is None:
                state = session.progress
            text.append(f" · {state}", style="italic")
        else:
            text.append(f" · {getattr(self, '_state', '')}", style="italic")
        if text.plain != self._status_text:
            self._status_text = text.plain
            status.update(text, layout=False)  # one fixed-height line


def settle_heap() -> None:
    """Move every object alive now out of the garbage collector's sight (`gc.freeze`).

    While events stream, the UI allocates fast (strips, segments, messages) and the
    collector's full passes over the whole heap (imports, Textual, the LSP types) took
    ~70 ms of CPU each, about once a second: a keystroke that landed behind one waited
    for it. Called when the server is up and again when a session ends (not while one
    streams); later passes only walk what was allocated since. Each call first unfreezes
    and collects everything, so cyclic garbage is never kept for good.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def short_model(spec: str) -> str:
    """`scripted:/long/path/turns.json` → `scripted:turns.json`; other specs unchanged."""
    kind, sep, rest = spec.partition(":")
    if sep and ("/" in rest or "\\" in rest) and "#" not in rest:
        return f"{kind}:{Path(rest).name}"
    return spec


def _tokens(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def run(*, workspace: Path, model: str, tcp: str | None = None) -> int:
    """Entry point for `opencomposer tui`; returns the process exit status."""
    if not workspace.is_dir():
        import sys

        print(f"opencomposer tui: workspace {workspace} is not a folder", file=sys.stderr)
        return 2
    # Log records written to the terminal would tear the screen apart.
    for name in ("pygls", "opencomposer", "asyncio"):
        logging.getLogger(name).addHandler(logging.NullHandler())
        logging.getLogger(name).propagate = False
    app = OpenComposerApp(workspace=workspace, model=model, tcp=tcp)
    result = app.run()
    return int(result or 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="opencomposer-tui", description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", type=Path, default=Path.cwd())
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tcp", default=None, help="connect to a running server at HOST:PORT")
    args = parser.parse_args(argv)
    return run(workspace=args.workspace, model=args.model, tcp=args.tcp)


if __name__ == "__main__":
    raise SystemExit(main())
