"""A scripted editor for end-to-end tests of `opencomposer serve`.

`Editor` is pygls' `LanguageClient` playing the part of VS Code: it starts the
real server process over stdio (or connects over TCP), keeps its own open
buffers, applies `workspace/applyEdit` to them (sending `didChange`, like an
editor) or to the disk for files it has not open, answers approvals with a
chosen action, and records every `opencomposer/event` and `$/progress`.

    editor = await Editor.spawn(root, model="scripted:/tmp/turns.json", home=tmp)
    await editor.open("calc.py")
    result = await editor.command("opencomposer.ask", {"query": "fix it"})
    await editor.close()
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from lsprotocol import types as lsp
from pygls.io_ import run_async
from pygls.lsp.client import LanguageClient

REPO = Path(__file__).resolve().parents[2]
SERVER = [sys.executable, "-m", "opencomposer.server.lsp"]


def scripted(path: Path, turns: list[str], chars_per_second: float = 0) -> str:
    """Write a scripted model file; returns its spec."""
    path.write_text(json.dumps({"turns": turns, "chars_per_second": chars_per_second}))
    return f"scripted:{path}"


def offset(text: str, pos: lsp.Position) -> int:
    """Character offset of an LSP (UTF-16) position."""
    lines = text.splitlines(keepends=True)
    base = sum(len(line) for line in lines[: pos.line])
    line = lines[pos.line] if pos.line < len(lines) else ""
    units, i = 0, 0
    while i < len(line) and units < pos.character:
        units += 2 if ord(line[i]) > 0xFFFF else 1
        i += 1
    return base + i


def apply_text_edits(text: str, edits: list[lsp.TextEdit]) -> str:
    spans = sorted(
        ((offset(text, e.range.start), offset(text, e.range.end), e.new_text) for e in edits),
        reverse=True,
    )
    for start, end, new in spans:
        text = text[:start] + new + text[end:]
    return text


def server_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["OPENCOMPOSER_HOME"] = str(home)
    env.pop("OPENCOMPOSER_MODEL", None)
    return env


class Editor(LanguageClient):
    def __init__(self, root: Path) -> None:
        super().__init__("test-editor", "1")
        self.root = root
        self.docs: dict[str, tuple[int, str]] = {}  # uri -> (version, text)
        self.events: list[dict[str, Any]] = []
        self.progress: list[Any] = []
        self.progress_created: list[Any] = []
        self.messages: list[str] = []
        self.shown: list[str] = []
        self.edits_received: list[lsp.WorkspaceEdit] = []
        self.approve_with: str | None = "Run"
        self.refuse_edits = False
        self.approval_requests: list[str] = []
        self._event_waiters: list[tuple[Any, asyncio.Future[dict[str, Any]]]] = []
        self.stderr_path: Path | None = None
        self.process: asyncio.subprocess.Process | None = None
        self._register()

    # -- server to client --------------------------------------------------------

    def _register(self) -> None:
        @self.feature("opencomposer/event")
        def on_event(params: Any) -> None:
            event = params if isinstance(params, dict) else _plain(params)
            self.events.append(event)
            for match, fut in list(self._event_waiters):
                if not fut.done() and match(event):
                    fut.set_result(event)

        @self.feature(lsp.PROGRESS)
        def on_progress(params: lsp.ProgressParams) -> None:
            self.progress.append(params.value)

        @self.feature(lsp.WINDOW_WORK_DONE_PROGRESS_CREATE)
        def on_create(params: lsp.WorkDoneProgressCreateParams) -> None:
            self.progress_created.append(params.token)

        @self.feature(lsp.WINDOW_SHOW_MESSAGE_REQUEST)
        def on_message_request(
            params: lsp.ShowMessageRequestParams,
        ) -> lsp.MessageActionItem | None:
            self.approval_requests.append(params.message)
            if self.approve_with is None:
                return None
            return lsp.MessageActionItem(title=self.approve_with)

        @self.feature(lsp.WINDOW_SHOW_DOCUMENT)
        def on_show(params: lsp.ShowDocumentParams) -> lsp.ShowDocumentResult:
            self.shown.append(params.uri)
            return lsp.ShowDocumentResult(success=True)

        @self.feature(lsp.WINDOW_SHOW_MESSAGE)
        def on_message(params: lsp.ShowMessageParams) -> None:
            self.messages.append(params.message)

        @self.feature(lsp.WORKSPACE_APPLY_EDIT)
        def on_apply(params: lsp.ApplyWorkspaceEditParams) -> lsp.ApplyWorkspaceEditResult:
            self.edits_received.append(params.edit)
            if self.refuse_edits:
                return lsp.ApplyWorkspaceEditResult(
                    applied=False, failure_reason="user rejected the edit"
                )
            self.apply(params.edit)
            return lsp.ApplyWorkspaceEditResult(applied=True)

    def apply(self, edit: lsp.WorkspaceEdit) -> None:
        for change in edit.document_changes or []:
            if isinstance(change, lsp.CreateFile):
                path = Path(_fs(change.uri))
                path.parent.mkdir(parents=True, exist_ok=True)
                if not path.exists():
                    path.write_text("")
            elif isinstance(change, lsp.DeleteFile):
                Path(_fs(change.uri)).unlink(missing_ok=True)
                if change.uri in self.docs:
                    self.close_doc(change.uri)
            else:
                self._edit(change.text_document.uri, change.edits)
        for uri, edits in (edit.changes or {}).items():
            self._edit(uri, edits)

    def _edit(self, uri: str, edits: list[Any]) -> None:
        if uri in self.docs:
            version, text = self.docs[uri]
            self.change(uri, apply_text_edits(text, edits))
        else:  # not open: the editor changes and saves the file
            path = Path(_fs(uri))
            path.write_text(apply_text_edits(path.read_text(), edits))

    # -- lifecycle ---------------------------------------------------------------

    @classmethod
    async def spawn(
        cls,
        root: Path,
        *,
        model: str,
        home: Path,
        capabilities: lsp.ClientCapabilities | None = None,
        initialize: bool = True,
    ) -> Editor:
        editor = cls(root)
        editor.stderr_path = home / f"server-stderr-{id(editor)}.log"
        stderr = editor.stderr_path.open("wb")
        proc = await asyncio.create_subprocess_exec(
            *SERVER,
            "--stdio",
            "--model",
            model,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            env=server_env(home),
            cwd=str(REPO),
        )
        stderr.close()
        editor.process = proc
        editor._server = proc
        editor.protocol.set_writer(proc.stdin)
        editor._async_tasks.append(
            asyncio.create_task(
                run_async(
                    stop_event=editor._stop_event, reader=proc.stdout, protocol=editor.protocol
                )
            )
        )
        editor._async_tasks.append(asyncio.create_task(editor._server_exit()))
        if initialize:
            await editor.handshake(capabilities)
        return editor

    @classmethod
    async def connect(
        cls,
        root: Path,
        host: str,
        port: int,
        capabilities: lsp.ClientCapabilities | None = None,
        token: str | None = None,
    ) -> Editor:
        """Connect over TCP; the token is the one the server recorded for `port`
        (under this process's OPENCOMPOSER_HOME) unless given."""
        from opencomposer.server.lsp_auth import token_for

        editor = cls(root)
        await editor.start_tcp(host, port)
        await editor.handshake(capabilities, token=token or token_for(port))
        return editor

    async def handshake(
        self, capabilities: lsp.ClientCapabilities | None = None, token: str | None = None
    ) -> lsp.InitializeResult:
        result = await self.initialize_async(
            lsp.InitializeParams(
                process_id=os.getpid(),
                root_uri=self.root.as_uri(),
                capabilities=capabilities or full_capabilities(),
                initialization_options={"token": token} if token else None,
            )
        )
        self.initialized(lsp.InitializedParams())
        return result

    async def close(self) -> None:
        if self.process is not None and self.process.returncode is None:
            try:
                await asyncio.wait_for(self.shutdown_async(None), 10)
                self.exit(None)
            except Exception:
                pass
            try:
                self.process.stdin.close()
            except Exception:
                pass
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        else:
            writer = self.protocol.writer
            if writer is not None and hasattr(writer, "close"):
                writer.close()
        self._stop_event.set()
        for task in self._async_tasks:
            task.cancel()
        await asyncio.gather(*self._async_tasks, return_exceptions=True)

    def stderr(self) -> str:
        return (
            self.stderr_path.read_text(errors="replace")
            if self.stderr_path and self.stderr_path.exists()
            else ""
        )

    # -- documents ---------------------------------------------------------------

    def uri(self, rel: str) -> str:
        return (self.root / rel).as_uri()

    def open(self, rel: str, text: str | None = None) -> str:
        uri = self.uri(rel)
        text = (self.root / rel).read_text() if text is None else text
        self.docs[uri] = (1, text)
        self.text_document_did_open(
            lsp.DidOpenTextDocumentParams(
                text_document=lsp.TextDocumentItem(
                    uri=uri, language_id="python", version=1, text=text
                )
            )
        )
        return uri

    def change(self, uri: str, text: str) -> None:
        version = self.docs[uri][0] + 1
        self.docs[uri] = (version, text)
        self.text_document_did_change(
            lsp.DidChangeTextDocumentParams(
                text_document=lsp.VersionedTextDocumentIdentifier(uri=uri, version=version),
                content_changes=[lsp.TextDocumentContentChangeWholeDocument(text=text)],
            )
        )

    def close_doc(self, uri: str) -> None:
        self.docs.pop(uri, None)
        self.text_document_did_close(
            lsp.DidCloseTextDocumentParams(text_document=lsp.TextDocumentIdentifier(uri=uri))
        )

    def buffer(self, rel: str) -> str:
        return self.docs[self.uri(rel)][1]

    # -- commands and events -------------------------------------------------------

    def command_future(self, name: str, *args: Any) -> Any:
        """The raw pygls future of an executeCommand request (to cancel it by id)."""
        return self.protocol.send_request(
            lsp.WORKSPACE_EXECUTE_COMMAND,
            lsp.ExecuteCommandParams(command=name, arguments=list(args)),
        )

    async def command(self, name: str, *args: Any, timeout: float = 60) -> Any:
        result = await asyncio.wait_for(
            self.workspace_execute_command_async(
                lsp.ExecuteCommandParams(command=name, arguments=list(args))
            ),
            timeout,
        )
        return _plain(result)

    def wait_event(self, match: Any) -> asyncio.Future[dict[str, Any]]:
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        for event in self.events:
            if match(event):
                fut.set_result(event)
                return fut
        self._event_waiters.append((match, fut))
        return fut

    def event_types(self, session_id: str | None = None) -> list[str]:
        return [
            e["type"]
            for e in self.events
            if session_id is None or e.get("session_id") == session_id
        ]


def full_capabilities() -> lsp.ClientCapabilities:
    """What VS Code announces, as far as the server cares."""
    return lsp.ClientCapabilities(
        workspace=lsp.WorkspaceClientCapabilities(
            apply_edit=True,
            workspace_edit=lsp.WorkspaceEditClientCapabilities(
                document_changes=True,
                resource_operations=[
                    lsp.ResourceOperationKind.Create,
                    lsp.ResourceOperationKind.Delete,
                ],
            ),
        ),
        window=lsp.WindowClientCapabilities(
            work_done_progress=True, show_document=lsp.ShowDocumentClientCapabilities(support=True)
        ),
    )


def _fs(uri: str) -> str:
    from pygls.uris import to_fs_path

    path = to_fs_path(uri)
    assert path is not None
    return path


def _plain(value: Any) -> Any:
    """pygls hands back named tuples for untyped JSON; make them plain data."""
    if hasattr(value, "_asdict"):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return {k: _plain(v) for k, v in vars(value).items()}
    return value
