"""`opencomposer ask`: one session in the terminal, as JSON lines or for a person.

Where a language server is already running for this user (`opencomposer serve
--tcp`, recorded under `$OPENCOMPOSER_HOME/servers/`, the same authenticated server
the editors and the TUI use) with the model asked for, `ask` hands the request to it
as `opencomposer.ask` over that connection instead of loading a model: its engine is
warm, so decoding starts within a second rather than after an engine start. The
client plays the editor's part (`clients.tui.link.ServerLink`): it writes the edits
the server sends to disk, answers approvals in the terminal and renders the
`opencomposer/event` stream with the same views. The server runs sessions with its
own defaults, so `--max-turns` or `--sandbox` other than the defaults, `--no-server`,
or a server that cannot be reached, run the session in this process as before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opencomposer.agent import events as ev

if TYPE_CHECKING:
    from opencomposer.agent.executor import Approval
    from opencomposer.agent.session import Policy
    from opencomposer.server.lsp_auth import ServerInfo
    from opencomposer.tools.protocols import SandboxMode


class JsonView:
    """The documented JSON-lines stream (`to_wire`), one event a line."""

    def __call__(self, event: ev.Event) -> None:
        sys.stdout.write(json.dumps(event.to_wire(), ensure_ascii=False) + "\n")
        sys.stdout.flush()

    def close(self) -> None:
        pass


class HumanView:
    """Streams the session for a person: the reply as it is written, one line per
    tool call with its duration, edits as coloured diffs, and a spinner while the
    model thinks."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(highlight=False, soft_wrap=True)
        self.status: Any = None
        self.streaming = False

    def _spin(self, text: str) -> None:
        self._stop_spin()
        self.status = self.console.status(text, spinner="dots")
        self.status.start()

    def _stop_spin(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None

    def _end_stream(self) -> None:
        if self.streaming:
            self.console.print()
            self.streaming = False

    def __call__(self, e: ev.Event) -> None:
        from rich.markup import escape
        from rich.syntax import Syntax

        if isinstance(e, ev.ToolStart | ev.ToolEnd | ev.Edit):
            self._end_stream()
        match e:
            case ev.SessionStart():
                self.console.print(
                    f"[bold]opencomposer[/] {e.model} in {e.workspace}  [dim]{e.session_id}[/]"
                )
            case ev.ModelStart():
                self._spin(f"thinking (turn {e.turn})")
            case ev.ModelDelta():
                self._stop_spin()
                self.console.print(escape(e.text), end="", style="cyan")
                self.streaming = True
            case ev.ModelEnd():
                self._end_stream()
                self.console.print(
                    f"[dim]  turn {e.turn}: {e.prompt_tokens} prompt + {e.completion_tokens} completion tokens[/]"
                )
            case ev.ToolStart():
                args = " ".join(f"{k}={_short(v)}" for k, v in e.args.items())
                self.console.print(f"[yellow]→ {e.name}[/] {escape(args)}")
            case ev.ToolEnd():
                mark = "[green]✓[/]" if e.status == "ok" else "[red]✗[/]"
                self.console.print(f"{mark} {e.name} [dim]{e.duration_s * 1000:.0f} ms[/]")
            case ev.Edit():
                self.console.print(f"[magenta]edited {e.path}[/]")
                self.console.print(Syntax(e.diff or "(no change)", "diff", theme="ansi_dark"))
            case ev.SessionEnd():
                self._stop_spin()
                self._end_stream()
                colour = "green" if e.status == "completed" else "red"
                self.console.print(
                    f"[{colour}]{e.status}[/] after {e.turns} turns, {e.tool_calls} tool calls, "
                    f"{e.duration_s:.1f} s"
                )
                if e.trace:
                    self.console.print(f"[dim]trace: {e.trace}[/]")

    def close(self) -> None:
        self._stop_spin()

    def approve(self, name: str, args: dict[str, Any]) -> Approval:
        self._stop_spin()
        what = "\n  ".join(f"{k}: {v}" for k, v in args.items())  # whole: the user decides on it
        self.console.print(f"[bold yellow]approve[/] {name}: ", end="")
        self.console.print(_visible(str(what)), highlight=False)
        answer = input("  run? [y]es / [a]lways / [n]o: ").strip().lower()
        answers: dict[str, Approval] = {"y": "run", "yes": "run", "a": "always", "always": "always"}
        return answers.get(answer, "reject")


def _visible(text: str) -> Any:
    """`text` as a rich Text never read as markup (a `[conceal]` tag once hid
    `; touch …` from the person approving), its hidden characters highlighted
    escapes (`agent.text.reveal`)."""
    from opencomposer.agent.text import reveal
    from rich.text import Text

    out = Text()
    for piece, escaped in reveal(text):
        out.append(piece, style="reverse" if escaped else "")
    return out


def _short(v: Any, limit: int = 60) -> str:
    s = v if isinstance(v, str) else json.dumps(v)
    s = s.replace("\n", "⏎")
    return s if len(s) <= limit else s[: limit - 1] + "…"


def ask(
    query: str,
    *,
    workspace: Path,
    model: str,
    as_json: bool,
    approve: Policy,
    max_turns: int | None = None,
    sandbox: SandboxMode = "workspace-write",
    use_server: bool = True,
) -> int:
    from opencomposer.agent.backends import make_model
    from opencomposer.agent.factory import open_session
    from opencomposer.agent.session import SessionConfig
    from opencomposer.agent.traces import TraceStore
    from opencomposer.tools.protocols import SandboxConfig
    from opencomposer.tools.workspace import LocalWorkspace

    root = Path(workspace).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"workspace {str(root)!r} is not a directory")
    if not query.strip():
        raise ValueError("the request is empty")
    view: JsonView | HumanView = JsonView() if as_json else HumanView()
    interactive = not as_json and sys.stdin.isatty()
    if use_server and max_turns is None and sandbox == "workspace-write":
        server = warm_server(model)
        if server is not None:
            remote = RemoteAsk(server, root, model, view, approve=approve, interactive=interactive)
            status = asyncio.run(remote.run(query))
            if status is not None:
                return status
            print(
                f"opencomposer: the server on port {server.port} is unreachable "
                f"({remote.failure}); running here",
                file=sys.stderr,
            )

    async def approver(name: str, args: dict[str, Any]) -> Approval:
        assert isinstance(view, HumanView)
        return await asyncio.to_thread(view.approve, name, args)

    async def main() -> int:
        m = make_model(model)
        traces = TraceStore()
        session = open_session(
            model=m,
            workspace=LocalWorkspace(root),
            config=SessionConfig(
                approve=approve,
                max_turns=max_turns,
                sandbox=SandboxConfig(mode=sandbox),
                emit_deltas=not as_json,
            ),
            on_event=view,
            approver=approver if interactive else None,
            traces=traces,
        )
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, session.cancel)
        loop.add_signal_handler(signal.SIGTERM, session.cancel)
        try:
            result = await session.run(query)
        finally:
            view.close()
            await m.close()
            traces.close()
        if not as_json and result.answer:
            from rich.markdown import Markdown

            assert isinstance(view, HumanView)
            view.console.print(Markdown(result.answer))
        return 0 if result.status == "completed" else 1

    return asyncio.run(main())


def warm_server(model: str) -> ServerInfo | None:
    """The newest live server of this user that runs `model`, if any."""
    from opencomposer.server.lsp_auth import running_servers

    return next((s for s in running_servers() if s.model == model), None)


class RemoteAsk:
    """One `opencomposer.ask` on a running server; the `LinkUI` of its connection."""

    def __init__(
        self,
        server: ServerInfo,
        root: Path,
        model: str,
        view: JsonView | HumanView,
        *,
        approve: Policy,
        interactive: bool,
    ) -> None:
        self.server = server
        self.root = root
        self.model = model
        self.view = view
        self.approve = approve
        self.interactive = interactive
        self.session_id: str | None = None
        self.started = False  # an event arrived: too late to fall back
        self.failure = ""
        self.link: Any = None

    async def run(self, query: str) -> int | None:
        """The exit status, or None when the server could not take the request."""
        from opencomposer.clients.tui.link import LinkConfig, LinkError, ServerLink

        # pygls logs a failed connection's every unsent message to stderr; the
        # one line below says what happened
        logging.getLogger("pygls").setLevel(logging.CRITICAL)
        address = f"{self.server.host}:{self.server.port}"
        config = LinkConfig(workspace=self.root, tcp=address, token=self.server.token)
        self.link = ServerLink(config, self)
        try:
            await self.link.start()
        except LinkError as e:
            self.failure = str(e)
            return None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.cancel()))
        argument = {"query": query, "approve": self.approve, "model": self.model}
        try:
            result = await self.link.command("opencomposer.ask", argument)
        except LinkError as e:
            if not self.started:
                self.failure = str(e)
                return None
            print(f"opencomposer: {e}", file=sys.stderr)
            return 1
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            self.view.close()
            await self.link.stop()
        answer = result.get("answer") if isinstance(result, dict) else None
        if isinstance(self.view, HumanView) and answer:
            from rich.markdown import Markdown

            self.view.console.print(Markdown(answer))
        completed = isinstance(result, dict) and result.get("status") == "completed"
        return 0 if completed else 1

    async def cancel(self) -> None:
        if self.session_id is not None and self.link is not None:
            from opencomposer.clients.tui.link import LinkError

            try:
                await self.link.command("opencomposer.cancel", {"session_id": self.session_id})
            except LinkError:
                pass

    # -- LinkUI ---------------------------------------------------------------------

    def server_event(self, event: dict[str, Any]) -> None:
        self.started = True
        if event.get("type") == ev.SessionStart.type:
            self.session_id = event.get("session_id")
        typed = event_from_wire(event)
        if typed is None or (isinstance(self.view, JsonView) and isinstance(typed, ev.ModelDelta)):
            return  # the JSON stream carries no deltas, as in this process
        self.view(typed)

    async def server_approval(self, message: str, actions: list[str]) -> str | None:
        if not self.interactive or not isinstance(self.view, HumanView):
            return None  # nobody to ask: the call is refused, as in this process
        from opencomposer.server.lsp import ACTION_ALWAYS, ACTION_REJECT, ACTION_RUN

        view = self.view

        def ask_person() -> str:
            view._stop_spin()
            view.console.print("[bold yellow]approve[/] ", end="")
            view.console.print(_visible(message), highlight=False)
            answer = input("  run? [y]es / [a]lways / [n]o: ").strip().lower()
            choices = {"y": ACTION_RUN, "yes": ACTION_RUN, "a": ACTION_ALWAYS}
            return choices.get(answer, ACTION_ALWAYS if answer == "always" else ACTION_REJECT)

        return await asyncio.to_thread(ask_person)

    def server_progress(self, token: str, value: dict[str, Any]) -> None:
        pass

    def server_show_document(self, path: Path) -> None:
        pass

    def server_log(self, level: int, message: str) -> None:
        if level <= 2:  # Error, Warning
            print(f"opencomposer serve: {message}", file=sys.stderr)

    def server_edit_failed(self, message: str) -> None:
        print(f"opencomposer: an edit could not be written: {message}", file=sys.stderr)

    def server_stopped(self, reason: str) -> None:
        self.failure = reason


_EVENT_TYPES = {cls.type: cls for cls in ev.EVENTS}


def event_from_wire(wire: dict[str, Any]) -> ev.Event | None:
    """The typed event of an `opencomposer/event` notification (its wire fields; the
    local-only ones keep their defaults); None for a type this client does not know."""
    cls = _EVENT_TYPES.get(str(wire.get("type")))
    if cls is None:
        return None
    try:
        return cls(**{k: wire[k] for k in ("t", *cls.wire_fields()) if k in wire})
    except TypeError:
        return None
