"""The TUI's only door to the agent: an LSP client of `opencomposer serve`.

`ServerLink` starts the language server as a child over stdio (or connects over TCP),
runs on the caller's asyncio loop (Textual's), and plays the editor's part of the
contract in `docs/lsp.md`: it applies `workspace/applyEdit` to disk, answers
`window/showMessageRequest` through the UI, and forwards `opencomposer/event`,
`$/progress`, `window/showDocument` and `window/logMessage` to it. Everything the UI
sees arrives through the small `LinkUI` protocol, so the link is testable without
Textual and the UI never touches pygls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lsprotocol import types as lsp
from opencomposer.clients.tui.edits import EditError, apply_workspace_edit, uri_to_path
from pygls.exceptions import JsonRpcException
from pygls.io_ import run_async
from pygls.lsp.client import LanguageClient
from pygls.protocol import JsonRPCNotification, JsonRPCResponseMessage, default_converter

logger = logging.getLogger(__name__)

EVENT_NOTIFICATION = "opencomposer/event"
INITIALIZE_TIMEOUT_S = 120.0


class LinkError(Exception):
    """The server is unreachable, stopped, or answered a command with an error."""


class LinkUI(Protocol):
    """What the link tells the UI; every call happens on the UI's event loop."""

    def server_event(self, event: dict[str, Any]) -> None: ...

    async def server_approval(self, message: str, actions: list[str]) -> str | None: ...

    def server_progress(self, token: str, value: dict[str, Any]) -> None: ...

    def server_show_document(self, path: Path) -> None: ...

    def server_log(self, level: int, message: str) -> None: ...

    def server_edit_failed(self, message: str) -> None: ...

    def server_stopped(self, reason: str) -> None: ...


@dataclass(frozen=True, kw_only=True)
class LinkConfig:
    """How to reach the server: a child command over stdio, or `tcp` as HOST:PORT."""

    workspace: Path
    command: Sequence[str] = ()
    tcp: str | None = None
    env: dict[str, str] | None = None


def server_command(model: str) -> list[str]:
    """The child process the TUI runs: the language server on stdio."""
    return [sys.executable, "-m", "opencomposer.server.lsp", "--stdio", "--model", model]


def _plain_converter():
    """pygls turns unknown payloads into namedtuples; events are plain JSON, keep dicts."""
    converter = default_converter()
    converter.register_structure_hook(JsonRPCNotification, lambda obj, cls: cls(**obj))
    converter.register_structure_hook(JsonRPCResponseMessage, lambda obj, cls: cls(**obj))
    return converter


def _as_dict(value: Any) -> Any:
    if hasattr(value, "_asdict"):
        return {k: _as_dict(v) for k, v in value._asdict().items()}
    return value


class ServerLink:
    """One connection to one server. `start()`, then `command()`; `stop()` when done."""

    def __init__(self, config: LinkConfig, ui: LinkUI) -> None:
        self.config = config
        self.ui = ui
        self.client = LanguageClient("opencomposer-tui", "0.1", converter_factory=_plain_converter)
        self.process: asyncio.subprocess.Process | None = None
        self.stderr_path: Path | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopping = False
        self._stopped = asyncio.Event()
        self.lost_reason: str | None = None
        self._register()

    # -- server to client -------------------------------------------------------------

    def _register(self) -> None:
        # pygls tags handlers with attributes, which bound methods refuse: wrap them.
        def sync(method: Any) -> Any:
            return lambda params: method(params)

        async def approval(params: lsp.ShowMessageRequestParams) -> lsp.MessageActionItem | None:
            return await self._on_message_request(params)

        feature = self.client.feature
        feature(EVENT_NOTIFICATION)(sync(self._on_event))
        feature(lsp.WORKSPACE_APPLY_EDIT)(sync(self._on_apply_edit))
        feature(lsp.WINDOW_SHOW_MESSAGE_REQUEST)(approval)
        feature(lsp.WINDOW_WORK_DONE_PROGRESS_CREATE)(sync(self._on_progress_create))
        feature(lsp.PROGRESS)(sync(self._on_progress))
        feature(lsp.WINDOW_SHOW_DOCUMENT)(sync(self._on_show_document))
        feature(lsp.WINDOW_LOG_MESSAGE)(sync(self._on_log))
        feature(lsp.WINDOW_SHOW_MESSAGE)(sync(self._on_log))

    def _on_event(self, params: Any) -> None:
        event = _as_dict(params)
        if isinstance(event, dict):
            self.ui.server_event(event)

    def _on_apply_edit(self, params: lsp.ApplyWorkspaceEditParams) -> lsp.ApplyWorkspaceEditResult:
        try:
            apply_workspace_edit(params.edit)
        except EditError as exc:
            self.ui.server_edit_failed(str(exc))
            return lsp.ApplyWorkspaceEditResult(applied=False, failure_reason=str(exc))
        return lsp.ApplyWorkspaceEditResult(applied=True)

    async def _on_message_request(
        self, params: lsp.ShowMessageRequestParams
    ) -> lsp.MessageActionItem | None:
        titles = [a.title for a in params.actions or ()]
        choice = await self.ui.server_approval(params.message, titles)
        return lsp.MessageActionItem(title=choice) if choice else None

    def _on_progress_create(self, params: lsp.WorkDoneProgressCreateParams) -> None:
        return None

    def _on_progress(self, params: lsp.ProgressParams) -> None:
        value = _as_dict(params.value)
        if isinstance(value, dict):
            self.ui.server_progress(str(params.token), value)

    def _on_show_document(self, params: lsp.ShowDocumentParams) -> lsp.ShowDocumentResult:
        try:
            path = uri_to_path(params.uri)
        except EditError:
            return lsp.ShowDocumentResult(success=False)
        self.ui.server_show_document(path)
        return lsp.ShowDocumentResult(success=True)

    def _on_log(self, params: lsp.LogMessageParams | lsp.ShowMessageParams) -> None:
        self.ui.server_log(int(params.type), params.message)

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and run the LSP handshake; raise `LinkError` with a one-line reason."""
        try:
            if self.config.tcp:
                await self._start_tcp(self.config.tcp)
            else:
                await self._start_child()
            init = self.client.initialize_async(self._initialize_params())
            result = await asyncio.wait_for(
                self._unless_stopped(init), timeout=INITIALIZE_TIMEOUT_S
            )
            if result is None:
                raise LinkError(
                    self.lost_reason
                    or self.stop_reason("the language server stopped during start-up")
                )
            self.client.initialized(lsp.InitializedParams())
        except TimeoutError as exc:
            await self.stop()
            raise LinkError(
                f"the language server did not answer `initialize` in {INITIALIZE_TIMEOUT_S:.0f} s"
            ) from exc
        except (OSError, JsonRpcException, RuntimeError) as exc:
            reason = await self._exit_reason() or self.stop_reason(
                f"cannot start the language server: {exc}"
            )
            await self.stop()
            raise LinkError(reason) from exc
        except LinkError:
            await self.stop()
            raise

    async def _exit_reason(self) -> str | None:
        """Why the child went away, once it has (a broken pipe says less than its exit)."""
        if self.lost_reason or self.process is None:
            return self.lost_reason
        with contextlib.suppress(TimeoutError):
            code = await asyncio.wait_for(self.process.wait(), timeout=2)
            return self.stop_reason(f"the language server exited with code {code}")
        return None

    async def _unless_stopped(self, awaitable: Any) -> Any:
        """Await `awaitable`, or return None as soon as the connection is gone."""
        task = asyncio.ensure_future(awaitable)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        stopped = asyncio.ensure_future(self._stopped.wait())
        try:
            done, _ = await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # A request the caller stops waiting for stays pending: cancelling its future
            # makes pygls fail on the late answer.
            stopped.cancel()
        if task in done:
            return task.result()
        task.cancel()  # the connection is gone; no answer will come
        with contextlib.suppress(BaseException):
            await task
        return None

    async def _start_child(self) -> None:
        fd, log = tempfile.mkstemp(prefix="opencomposer-tui-server-", suffix=".log")
        self.stderr_path = Path(log)
        env = {**os.environ, **(self.config.env or {})}
        with os.fdopen(fd, "wb") as stderr:
            self.process = await asyncio.create_subprocess_exec(
                *self.config.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                cwd=self.config.workspace,
                env=env,
                start_new_session=True,
            )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.client.protocol.set_writer(self.process.stdin)
        self._spawn(self._read(self.process.stdout))
        self._spawn(self._watch_child(self.process))

    async def _start_tcp(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise LinkError(f"--tcp wants HOST:PORT, got {address!r}")
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError as exc:
            raise LinkError(f"cannot connect to the language server at {address}: {exc}") from exc
        self.client.protocol.set_writer(writer)
        self._spawn(self._read(reader, closed=f"the connection to {address} closed"))

    def _spawn(self, coro: Any) -> None:
        self._tasks.append(asyncio.ensure_future(coro))

    async def _read(self, reader: Any, closed: str | None = None) -> None:
        stop = self.client._stop_event
        await run_async(
            stop_event=stop, reader=reader, protocol=self.client.protocol, logger=logger
        )
        if closed is not None:
            self._connection_lost(closed)

    async def _watch_child(self, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        self._connection_lost(self.stop_reason(f"the language server exited with code {code}"))

    def _connection_lost(self, reason: str) -> None:
        if self._stopped.is_set():
            return
        self.lost_reason = reason
        self._stopped.set()
        self.client._stop_event.set()
        for future in list(self.client.protocol._request_futures.values()):
            if not future.done():
                future.set_exception(LinkError(reason))
        if not self._stopping:
            self.ui.server_stopped(reason)

    def stop_reason(self, reason: str) -> str:
        """`reason`, plus the last line the server wrote to stderr when there is one."""
        last = self.last_stderr_line()
        return f"{reason}: {last}" if last else reason

    def last_stderr_line(self) -> str:
        if self.stderr_path is None:
            return ""
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(max(0, self.stderr_path.stat().st_size - 4096))
                lines = f.read().decode("utf-8", "replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1].strip()[:300] if lines else ""

    @property
    def running(self) -> bool:
        return not self._stopped.is_set()

    async def stop(self) -> None:
        """Shut the server down politely, then firmly; safe to call more than once."""
        self._stopping = True
        if self.running:
            # Not wait_for: a cancelled request future breaks pygls when the answer lands late.
            shutdown = asyncio.ensure_future(self.client.shutdown_async(None))
            shutdown.add_done_callback(lambda t: t.cancelled() or t.exception())
            await asyncio.wait([shutdown], timeout=2)
            with contextlib.suppress(Exception):
                self.client.exit(None)
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                if process.stdin is not None:
                    process.stdin.close()
            try:
                await asyncio.wait_for(process.wait(), timeout=3)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, 9)
                await process.wait()
        self._stopped.set()
        self.client._stop_event.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        if self.stderr_path is not None:
            self.stderr_path.unlink(missing_ok=True)

    def _initialize_params(self) -> lsp.InitializeParams:
        root = self.config.workspace.resolve()
        return lsp.InitializeParams(
            process_id=os.getpid(),
            root_uri=root.as_uri(),
            workspace_folders=[lsp.WorkspaceFolder(uri=root.as_uri(), name=root.name)],
            client_info=lsp.ClientInfo(name="opencomposer-tui", version="0.1"),
            capabilities=lsp.ClientCapabilities(
                workspace=lsp.WorkspaceClientCapabilities(
                    apply_edit=True,
                    workspace_edit=lsp.WorkspaceEditClientCapabilities(
                        document_changes=True,
                        resource_operations=[
                            lsp.ResourceOperationKind.Create,
                            lsp.ResourceOperationKind.Rename,
                            lsp.ResourceOperationKind.Delete,
                        ],
                    ),
                    execute_command=lsp.ExecuteCommandClientCapabilities(),
                ),
                window=lsp.WindowClientCapabilities(
                    work_done_progress=True,
                    show_message=lsp.ShowMessageRequestClientCapabilities(),
                    show_document=lsp.ShowDocumentClientCapabilities(support=True),
                ),
            ),
        )

    # -- client to server ---------------------------------------------------------------

    async def command(self, name: str, argument: dict[str, Any]) -> Any:
        """Run `workspace/executeCommand` `name` with one argument object; LinkError on failure."""
        if not self.running:
            raise LinkError("the language server is not running")
        params = lsp.ExecuteCommandParams(command=name, arguments=[argument])
        try:
            result = await self._unless_stopped(self.client.workspace_execute_command_async(params))
        except JsonRpcException as exc:
            raise LinkError(f"{name}: {exc.message}") from exc
        except RuntimeError as exc:
            raise LinkError(f"{name}: {exc}") from exc
        if not self.running and result is None:
            raise LinkError("the language server stopped")
        return _as_dict(result)
