"""`opencomposer ask`: one session in the terminal, as JSON lines or for a person."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opencomposer.agent import events as ev

if TYPE_CHECKING:
    from opencomposer.agent.executor import Approval
    from opencomposer.agent.session import Policy
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
    max_turns: int = 25,
    sandbox: SandboxMode = "workspace-write",
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
