"""The TUI's only door to the agent: an LSP client of `opencomposer serve`.

`ServerLink` starts the language server as a child over stdio (or connects over TCP),
runs on the caller's asyncio loop (Textual's), and plays the editor's part of the
contract in `docs/lsp.md`: it applies `workspace/applyEdit` to disk, answers
`window/showMessageRequest` through the UI, and forwards `opencomposer/event`,
`$/progress`, `window/showDocument` and `window/logMessage` to it. Everything the UI
sees arrives through the small `LinkUI` protocol, so the link is testable without
Textual and the UI never touches pygls.

The server's messages are read and parsed (JSON, pygls structuring) in a reader thread,
not on the UI loop: while the model streams that is hundreds of messages a second. The
thread hands them to the loop in batches, one callback per batch; `opencomposer/event`
notifications skip pygls there and go to `LinkUI.server_event` as plain dicts.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import socket
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from lsprotocol import types as lsp
from opencomposer.clients.tui.edits import EditError, apply_workspace_edit, uri_to_path
from pygls.exceptions import JsonRpcException
from pygls.lsp.client import LanguageClient
from pygls.protocol import JsonRPCNotification, JsonRPCResponseMessage, default_converter

logger = logging.getLogger(__name__)

EVENT_NOTIFICATION = "opencomposer/event"
INITIALIZE_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = 10.0


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
    """How to reach the server: a child command over stdio, or `tcp` as HOST:PORT.

    A TCP server takes only clients that send its token (`initializationOptions.token`):
    `token`, else `OPENCOMPOSER_TOKEN`, else the one the server recorded for its port
    under `OPENCOMPOSER_HOME` (`opencomposer.server.lsp_auth`)."""

    workspace: Path
    command: Sequence[str] = ()
    tcp: str | None = None
    env: dict[str, str] | None = None
    token: str | None = None


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
        self._arrived: list[Any] = []  # parsed by the reader thread, not yet handled
        self._arrived_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self._token: str | None = None
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
        # The child's stdout is a plain pipe that the reader thread reads with blocking
        # calls; stdin stays an asyncio stream (pygls writes small requests to it).
        out_r, out_w = os.pipe()
        try:
            with os.fdopen(fd, "wb") as stderr:
                self.process = await asyncio.create_subprocess_exec(
                    *self.config.command,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=out_w,
                    stderr=stderr,
                    cwd=self.config.workspace,
                    env=env,
                    start_new_session=True,
                )
        except BaseException:
            os.close(out_r)
            raise
        finally:
            os.close(out_w)
        assert self.process.stdin is not None
        self.client.protocol.set_writer(self.process.stdin)
        self._start_reader(os.fdopen(out_r, "rb", buffering=1 << 16), closed=None)
        self._spawn(self._watch_child(self.process))

    async def _start_tcp(self, address: str) -> None:
        from opencomposer.server.lsp_auth import token_for

        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise LinkError(f"--tcp wants HOST:PORT, got {address!r}")
        self._token = self.config.token or token_for(int(port))
        if not self._token:
            raise LinkError(
                f"no token for the language server at {address}: set OPENCOMPOSER_TOKEN to the "
                "token it printed, or use the OPENCOMPOSER_HOME it runs with"
            )
        try:
            sock = await asyncio.to_thread(
                socket.create_connection, (host, int(port)), CONNECT_TIMEOUT_S
            )
        except OSError as exc:
            raise LinkError(f"cannot connect to the language server at {address}: {exc}") from exc
        sock.settimeout(None)
        self._socket = sock
        self.client.protocol.set_writer(_SocketWriter(sock))
        self._start_reader(sock.makefile("rb"), closed=f"the connection to {address} closed")

    def _spawn(self, coro: Any) -> None:
        self._tasks.append(asyncio.ensure_future(coro))

    def _start_reader(self, stream: BinaryIO, closed: str | None) -> None:
        loop = asyncio.get_running_loop()
        # Callbacks from the thread run in the starter's context (Textual's active app).
        context = contextvars.copy_context()
        self._reader = threading.Thread(
            target=self._read_frames,
            args=(stream, loop, context, closed),
            name="opencomposer-tui-reader",
            daemon=True,
        )
        self._reader.start()

    def _read_frames(
        self,
        stream: BinaryIO,
        loop: asyncio.AbstractEventLoop,
        context: contextvars.Context,
        closed: str | None,
    ) -> None:
        """Reader thread: LSP frames → parsed messages, handed to the loop in batches."""
        protocol = self.client.protocol
        try:
            while (body := _read_frame(stream)) is not None:
                try:
                    item = _parse(body, protocol.structure_message)
                except Exception:  # one bad message must not end the connection
                    logger.exception("unreadable message from the language server")
                    continue
                with self._arrived_lock:
                    self._arrived.append(item)
                    first = len(self._arrived) == 1
                if first:
                    loop.call_soon_threadsafe(self._deliver, context=context)
        except (OSError, ValueError, RuntimeError):  # closed under us, or the loop is gone
            pass
        finally:
            with contextlib.suppress(OSError):
                stream.close()
            if closed is not None:
                with contextlib.suppress(RuntimeError):  # the loop already closed
                    loop.call_soon_threadsafe(self._connection_lost, closed, context=context)

    def _deliver(self) -> None:
        """On the loop: handle every message the reader thread has parsed so far."""
        with self._arrived_lock:
            batch, self._arrived = self._arrived, []
        for is_event, message in batch:
            try:
                if is_event:
                    self.ui.server_event(message)
                else:
                    self.client.protocol.handle_message(message)
            except Exception:
                logger.exception("could not handle a message from the language server")

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
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)
            self._socket.close()
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
            initialization_options={"token": self._token} if self._token else None,
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


def _parse(body: bytes, structure: Any) -> tuple[bool, Any]:
    """(True, params) for an `opencomposer/event`, else (False, the pygls message)."""
    message = json.loads(body)
    if isinstance(message, dict) and message.get("method") == EVENT_NOTIFICATION:
        params = message.get("params")
        if isinstance(params, dict):
            return True, params
    return False, json.loads(body, object_hook=structure)


def _read_frame(stream: BinaryIO) -> bytes | None:
    """One LSP message body from `stream` (blocking), or None at the end of the stream."""
    length: int | None = None
    while True:
        header = stream.readline()
        if not header:
            return None
        if not header.strip():
            if length is not None:
                break
            continue
        name, _, value = header.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    body = stream.read(length)
    if len(body) < length:
        return None
    return body


class _SocketWriter:
    """pygls' writer interface over a connected socket (requests are small)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def write(self, data: bytes) -> None:
        self._sock.sendall(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
