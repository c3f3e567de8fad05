"""Screens over the transcript: approval dialog, codebase search, sessions, server log.

Each screen receives what it needs from the app (a `run` coroutine to call a server
command) instead of reaching for the connection, so the screens stay LSP-agnostic.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any

from rich.syntax import Syntax
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Footer, Input, Label, OptionList, RichLog, Static
from textual.widgets.option_list import Option

Command = Callable[[str, dict[str, Any]], Awaitable[Any]]

APPROVE_KEYS = {"Run": "y", "Always for this command": "a", "Reject": "n"}


class ApprovalScreen(ModalScreen[str | None]):
    """The server asks before a terminal command runs: Run (y), Always (a), Reject (n)."""

    BINDINGS = [Binding("escape", "choose(None)", "Reject", show=False)]

    def __init__(self, message: str, actions: list[str]) -> None:
        super().__init__(classes="dialog")
        self.message = message
        self.actions = actions or ["Run", "Reject"]

    def compose(self) -> ComposeResult:
        with Vertical(id="approval", classes="box"):
            yield Label("Run this command?", classes="box-title")
            yield Static(Text(self.message), id="approval-message")
            with Horizontal(classes="buttons"):
                for i, title in enumerate(self.actions):
                    key = APPROVE_KEYS.get(title)
                    label = f"{title} ({key})" if key else title
                    variant = "error" if title == "Reject" else "primary"
                    yield Button(label, id=f"action-{i}", variant=variant, compact=True)

    def on_mount(self) -> None:
        self.query_one(Button).focus()

    def on_key(self, event) -> None:
        for title in self.actions:
            if APPROVE_KEYS.get(title) == event.key:
                event.stop()
                self.dismiss(title)
                return

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        index = int(str(event.button.id).removeprefix("action-"))
        self.dismiss(self.actions[index])

    def action_choose(self, title: str | None) -> None:
        self.dismiss("Reject" if "Reject" in self.actions else title)


def _lexer(path: str) -> str:
    return Syntax.guess_lexer(path, code="") if "." in PurePosixPath(path).name else "text"


class SearchScreen(ModalScreen[None]):
    """`opencomposer.search` over the codebase index: results on the left, preview below."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close")]

    def __init__(self, run: Command) -> None:
        super().__init__(classes="panel-screen")
        self.run = run
        self.results: list[dict[str, Any]] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="search", classes="box"):
            yield Label("Codebase search", classes="box-title")
            yield Input(placeholder="what are you looking for? (Enter)", id="search-input")
            yield OptionList(id="search-results")
            with VerticalScroll(id="search-preview-scroll"):
                yield Static("", id="search-preview")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#search-input", Input).focus()

    @on(Input.Submitted, "#search-input")
    def submitted(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self.search(event.value.strip())

    @work(exclusive=True, group="search")
    async def search(self, query: str) -> None:
        results_list = self.query_one("#search-results", OptionList)
        results_list.clear_options()
        self.query_one("#search-preview", Static).update(Text("searching…", style="dim"))
        try:
            found = await self.run("opencomposer.search", {"query": query, "k": 20})
        except Exception as exc:  # the server's one-line reason, never a traceback
            self.query_one("#search-preview", Static).update(Text(str(exc), style="red"))
            return
        self.results = [r for r in found or [] if isinstance(r, dict)]
        if not self.results:
            self.query_one("#search-preview", Static).update(Text("no results", style="dim"))
            return
        results_list.add_options(
            Option(
                Text.assemble(
                    (f"{r.get('path')}", "bold"),
                    f":{r.get('start_line')}-{r.get('end_line')}  ",
                    (f"{float(r.get('score') or 0):.2f}", "dim"),
                )
            )
            for r in self.results
        )
        results_list.highlighted = 0
        results_list.focus()

    @on(OptionList.OptionHighlighted, "#search-results")
    def preview(self, event: OptionList.OptionHighlighted) -> None:
        result = self.results[event.option_index]
        path = str(result.get("path", ""))
        syntax = Syntax(
            str(result.get("text", "")),
            _lexer(path),
            line_numbers=True,
            start_line=int(result.get("start_line") or 1),
            theme="ansi_dark" if self.app.current_theme.dark else "ansi_light",
            word_wrap=True,
        )
        self.query_one("#search-preview", Static).update(syntax)


class SessionsScreen(ModalScreen[str | None]):
    """Past sessions from the trace store; `s` submits the highlighted one for training,
    `c` continues it (the screen returns its id: the next request follows up on it)."""

    BINDINGS = [
        Binding("escape", "dismiss(None)", "Close"),
        Binding("c", "continue_session", "Continue session"),
        Binding("s", "submit", "Submit as training query"),
        Binding("f5", "refresh", "Refresh"),
    ]

    def __init__(self, run: Command) -> None:
        super().__init__(classes="panel-screen")
        self.run = run
        self.sessions: list[dict[str, Any]] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="sessions", classes="box"):
            yield Label("Sessions", classes="box-title")
            yield DataTable(id="sessions-table", cursor_type="row", zebra_stripes=True)
            yield Input(
                placeholder="verify command for submit, e.g. python -m pytest -q (optional)",
                id="sessions-verify",
            )
            yield Static("", id="sessions-status")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("status", "query", "edits", "model", "started")
        table.focus()
        self.action_refresh()

    @work(exclusive=True, group="sessions")
    async def action_refresh(self) -> None:
        status = self.query_one("#sessions-status", Static)
        try:
            found = await self.run("opencomposer.sessions", {"limit": 200})
        except Exception as exc:
            status.update(Text(str(exc), style="red"))
            return
        self.sessions = [s for s in found or [] if isinstance(s, dict)]
        table = self.query_one(DataTable)
        table.clear()
        for s in self.sessions:
            query = str(s.get("query", "")).replace("\n", " ")
            table.add_row(
                str(s.get("status", "")),
                query[:60],
                str(s.get("edits", "")),
                str(s.get("model", "")),
                _when(s.get("started")),
                key=str(s.get("session_id")),
            )
        status.update(
            Text(
                f"{len(self.sessions)} sessions · c: continue · s: submit as training query",
                style="dim",
            )
        )

    def action_continue_session(self) -> None:
        if self.sessions:
            self.dismiss(str(self.sessions[self.query_one(DataTable).cursor_row]["session_id"]))

    @work(exclusive=True, group="submit")
    async def action_submit(self) -> None:
        table = self.query_one(DataTable)
        status = self.query_one("#sessions-status", Static)
        if not self.sessions:
            return
        session = self.sessions[table.cursor_row]
        status.update(Text("submitting…", style="dim"))
        argument = {"session_id": session["session_id"]}
        verify = self.query_one("#sessions-verify", Input).value.strip()
        if verify:
            argument["verify"] = verify
        try:
            result = await self.run("opencomposer.submit", argument)
        except Exception as exc:
            status.update(Text(str(exc), style="red"))
            return
        task_dir = (result or {}).get("task_dir", "?") if isinstance(result, dict) else result
        status.update(Text(f"submitted → {task_dir}", style="green"))
        self.app.notify(f"Training task written to {task_dir}", title="Submitted")

    @on(Input.Submitted, "#sessions-verify")
    def verify_submitted(self) -> None:
        self.query_one(DataTable).focus()
        self.action_submit()


def _when(started: Any) -> str:
    if isinstance(started, int | float):
        return datetime.fromtimestamp(started).strftime("%Y-%m-%d %H:%M")
    return str(started or "")[:16]


class LogScreen(ModalScreen[None]):
    """Everything the server logged (`window/logMessage`), newest last."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Close")]

    def __init__(self, lines: list[Text]) -> None:
        super().__init__(classes="panel-screen")
        self.lines = lines

    def compose(self) -> ComposeResult:
        with Vertical(id="log", classes="box"):
            yield Label("Server log", classes="box-title")
            yield RichLog(id="log-view", wrap=True, markup=False)
        yield Footer()

    def on_mount(self) -> None:
        view = self.query_one(RichLog)
        for line in self.lines:
            view.write(line)
        if not self.lines:
            view.write(Text("(nothing logged yet)", style="dim"))
