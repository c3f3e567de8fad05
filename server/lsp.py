"""`opencomposer serve`: the language server that hosts the agent (docs/lsp.md).

One `ComposerServer` per editor connection (pygls `LanguageServer`), all of them
sharing one `Shared` per process: models, the trace store, the codebase index of
each workspace and the edits of finished sessions (so a second client on the
same workspace over TCP can undo what the first one asked for).

What it implements, by LSP method:

- `initialize` (fast: nothing heavy is imported before the first command),
  `textDocument/didOpen|didChange|didClose|didSave` (full sync; open buffers are
  the overlay the agent reads, didChange/didSave feed the index),
  `textDocument/codeAction` ("Ask opencomposer about this selection").
- `workspace/executeCommand`: `opencomposer.ask|cancel|search|decide|undo|
  sessions|submit` (arguments checked in `lsp_commands`).
- Server to client: `opencomposer/event` for every session event,
  `window/workDoneProgress/create` + `$/progress`, `workspace/applyEdit` for
  every change (`workspace_overlay`), `window/showMessageRequest` to approve a
  command, `window/showDocument` to reveal edits.
- `$/cancelRequest` on an ask request, `opencomposer.cancel` and a cancelled
  progress stop the session; a client that goes away stops its sessions and their
  traces end as `disconnected`.
- Follow-ups: `opencomposer.ask` with the `session_id` of a finished session
  continues it (its `History` from memory, else from its trace); its edits join the
  session's `Record`, so undo and reject cover every request.

Run it:

    python -m opencomposer.server.lsp --stdio [--model scripted:turns.json]
    python -m opencomposer.server.lsp --tcp 127.0.0.1:2087   # prints the clients' token
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lsprotocol import types as lsp
from opencomposer.agent import events as ev
from opencomposer.agent.indexing import IndexHandle
from opencomposer.agent.text import revealed
from opencomposer.server import lsp_commands as cmds
from opencomposer.server.workspace_overlay import EditorLink, EditorWorkspace
from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams, JsonRpcRequestCancelled
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol, lsp_method
from pygls.uris import to_fs_path

if TYPE_CHECKING:
    from opencomposer.agent.executor import Approval
    from opencomposer.agent.protocols import Model
    from opencomposer.agent.session import History, Session
    from opencomposer.agent.traces import TraceStore
    from opencomposer.tools.protocols import Edit

log = logging.getLogger("opencomposer.server")

VERSION = "0.1.0"
EVENT = "opencomposer/event"
ASK_SELECTION = "Ask opencomposer about this selection"
ACTION_RUN, ACTION_ALWAYS, ACTION_REJECT = "Run", "Always for this command", "Reject"
SERVER_ERROR = -32000  # a command that could not be carried out (unknown session, model failure…)
INDEX_MAX_BUFFER = 8 * 1024 * 1024  # larger buffers are not fed to the index
CANCEL_WAIT_S = 5.0
HISTORIES_KEPT = 256  # finished sessions continued from memory; older ones from their trace


def server_error(message: str) -> JsonRpcException:
    return JsonRpcException(message=message, code=SERVER_ERROR)


# -- process-wide state ----------------------------------------------------------


@dataclass(kw_only=True)
class Record:
    """A session this process ran: enough to undo or reject its edits."""

    session_id: str
    root: Path
    edits: list[Edit] = field(default_factory=list)
    from_trace: bool = False  # read back from the trace store: another process ran it
    # path -> how many of its edits (the first ones) the user accepted: a later reject
    # of the file (after a follow-up edited it again) keeps those
    accepted: dict[str, int] = field(default_factory=dict)

    def of(self, path: str) -> list[Edit]:
        return [e for e in self.edits if e.path == path]


@dataclass(kw_only=True)
class Running:
    session: Session
    task: asyncio.Task[Any]
    owner: ComposerServer
    msg_id: Any = None
    progress: str | None = None
    by_request: bool = False  # cancelled through $/cancelRequest


class Shared:
    """Everything the connections of one process share."""

    def __init__(self, *, model: str) -> None:
        self.default_model = model
        self._models: dict[str, Model] = {}
        self._model_locks: dict[str, asyncio.Lock] = {}
        self._traces: TraceStore | None = None
        self.indexes: dict[Path, IndexHandle] = {}
        self.records: dict[str, Record] = {}
        self.running: dict[str, Running] = {}
        self.histories: OrderedDict[str, History] = OrderedDict()

    def keep_history(self, session_id: str, history: History) -> None:
        self.histories[session_id] = history
        self.histories.move_to_end(session_id)
        while len(self.histories) > HISTORIES_KEPT:
            self.histories.popitem(last=False)

    async def model(self, spec: str) -> Model:
        if spec in self._models:
            return self._models[spec]
        lock = self._model_locks.setdefault(spec, asyncio.Lock())
        async with lock:
            if spec not in self._models:
                from opencomposer.agent.backends import make_model

                try:
                    self._models[spec] = await asyncio.to_thread(make_model, spec)
                except ValueError as e:
                    raise server_error(str(e)) from None
                except Exception as e:
                    raise server_error(f"could not load model {spec}: {e}") from None
        return self._models[spec]

    async def close(self) -> None:
        """Stop model engines (vLLM worker processes) and close the trace store."""
        for spec, model in list(self._models.items()):
            try:
                await asyncio.wait_for(model.close(), 30)
            except Exception:
                log.exception("closing model %s failed", spec)
        self._models.clear()
        if self._traces is not None:
            self._traces.close()
            self._traces = None

    def traces(self) -> TraceStore:
        if self._traces is None:
            from opencomposer.agent.traces import TraceStore

            self._traces = TraceStore()
        return self._traces

    def index(self, root: Path) -> IndexHandle:
        if root not in self.indexes:
            self.indexes[root] = IndexHandle(root)
        return self.indexes[root]


@functools.cache
def _converter() -> Any:
    """One cattrs converter for every connection: its generated code is reused."""
    from pygls.protocol import default_converter

    return default_converter()


def _prewarm() -> None:
    """Import the agent while the editor is still busy starting up (never blocks)."""
    try:
        import opencomposer.agent.backends  # noqa: F401
        import opencomposer.agent.session  # noqa: F401
        import opencomposer.agent.traces  # noqa: F401
    except Exception:
        log.exception("prewarm failed")


# -- the per-connection server ---------------------------------------------------


class ComposerProtocol(LanguageServerProtocol):
    """pygls' protocol, with `$/cancelRequest` reaching a running session and `exit`
    ending only this connection (one TCP client must not stop the others)."""

    _server: ComposerServer

    def _handle_cancel_notification(self, msg_id: Any) -> None:
        if not self._server.cancel_ask(msg_id):
            super()._handle_cancel_notification(msg_id)

    @lsp_method(lsp.EXIT)
    def lsp_exit(self, *args: Any) -> None:  # type: ignore[override]
        self._server.exit_requested = True


class ComposerServer(LanguageServer):
    def __init__(self, shared: Shared) -> None:
        super().__init__(
            name="opencomposer",
            version=VERSION,
            text_document_sync_kind=lsp.TextDocumentSyncKind.Full,
            protocol_cls=ComposerProtocol,
            converter_factory=_converter,
        )
        self.shared = shared
        self.root: Path | None = None
        self.buffers: dict[str, str] = {}
        self.exit_requested = False
        self.closed = False
        self.always: set[str] = set()
        self.model_spec = shared.default_model
        self._outgoing: set[concurrent.futures.Future[Any]] = set()
        self._register()

    # -- registration ------------------------------------------------------------

    def _register(self) -> None:
        def f(name: str, options: Any = None) -> Any:
            return lambda method: self.feature(name, options)(_function(method))

        f(lsp.INITIALIZE)(self.on_initialize)
        f(lsp.INITIALIZED)(self.on_initialized)
        f(lsp.SHUTDOWN)(self.on_shutdown)
        f(lsp.TEXT_DOCUMENT_DID_OPEN)(self.on_open)
        f(lsp.TEXT_DOCUMENT_DID_CHANGE)(self.on_change)
        f(lsp.TEXT_DOCUMENT_DID_CLOSE)(self.on_close)
        f(lsp.TEXT_DOCUMENT_DID_SAVE, lsp.SaveOptions(include_text=True))(self.on_save)
        f(
            lsp.TEXT_DOCUMENT_CODE_ACTION,
            lsp.CodeActionOptions(code_action_kinds=[lsp.CodeActionKind.Refactor]),
        )(self.on_code_action)
        f(lsp.WINDOW_WORK_DONE_PROGRESS_CANCEL)(self.on_progress_cancel)
        handlers = {
            cmds.ASK: self.cmd_ask,
            cmds.CANCEL: self.cmd_cancel,
            cmds.SEARCH: self.cmd_search,
            cmds.DECIDE: self.cmd_decide,
            cmds.UNDO: self.cmd_undo,
            cmds.SESSIONS: self.cmd_sessions,
            cmds.SUBMIT: self.cmd_submit,
        }
        for name, handler in handlers.items():
            self.command(name)(_command(name, handler))

    # -- transport hooks (lsp_transport.Connection) ----------------------------

    def warm_up(self) -> None:
        """Generate cattrs' (de)serialisers for the handshake types before the client
        asks: done lazily, on the first `initialize`, they cost ~100 ms of its answer."""
        converter = self.protocol._converter
        converter.structure(
            {"processId": None, "rootUri": None, "capabilities": {}}, lsp.InitializeParams
        )
        caps = lsp.ServerCapabilities(
            text_document_sync=lsp.TextDocumentSyncOptions(open_close=True)
        )
        converter.unstructure(lsp.InitializeResult(capabilities=caps))

    def stop_requested(self) -> bool:
        return self.exit_requested

    async def disconnected(self) -> None:
        """The editor went away: stop its sessions, fail what waits on it, mark traces."""
        self.closed = True
        for fut in list(self._outgoing):
            if not fut.done():
                fut.set_exception(ConnectionError("the editor disconnected"))
        mine = [r for r in self.shared.running.values() if r.owner is self]
        for r in mine:
            r.session.cancel(reason="disconnected")
        if mine:
            await asyncio.wait([r.task for r in mine], timeout=CANCEL_WAIT_S)
        for r in mine:
            if r.session.traces is not None:
                try:
                    r.session.traces.set_status(r.session.id, "disconnected")
                except Exception:
                    log.exception("could not mark %s disconnected", r.session.id)

    def cancel_ask(self, msg_id: Any) -> bool:
        for r in self.shared.running.values():
            if r.owner is self and r.msg_id == msg_id:
                r.by_request = True
                r.session.cancel(reason="cancelled")
                return True
        return False

    async def client_request(self, method: str, params: Any) -> Any:
        """A request to the editor that fails (ConnectionError) if it goes away."""
        if self.closed:
            raise ConnectionError("the editor disconnected")
        fut = self.protocol.send_request(method, params)
        self._outgoing.add(fut)
        waiter = asyncio.wrap_future(fut)
        waiter.add_done_callback(lambda f: f.cancelled() or f.exception())  # always retrieved
        try:
            # shielded: a cancelled session must not cancel pygls' future, which the
            # editor's late answer would then fail to resolve
            return await asyncio.shield(waiter)
        finally:
            self._outgoing.discard(fut)

    # -- lifecycle ---------------------------------------------------------------

    def on_initialize(self, params: lsp.InitializeParams) -> None:
        uri = params.root_uri
        if uri is None and params.workspace_folders:
            uri = params.workspace_folders[0].uri
        if uri is None and params.root_path:
            self.root = Path(params.root_path).resolve()
        elif uri is not None:
            path = to_fs_path(uri)
            self.root = Path(path).resolve() if path else None
        options = params.initialization_options
        if isinstance(options, dict) and isinstance(options.get("model"), str) and options["model"]:
            self.model_spec = options["model"]

    def on_initialized(self, params: lsp.InitializedParams) -> None:
        threading.Thread(target=_prewarm, name="oc-prewarm", daemon=True).start()

    async def on_shutdown(self, *args: Any) -> None:
        mine = [r for r in self.shared.running.values() if r.owner is self]
        for r in mine:
            r.session.cancel(reason="cancelled")
        if mine:
            await asyncio.wait([r.task for r in mine], timeout=CANCEL_WAIT_S)

    # -- documents ---------------------------------------------------------------

    def _key(self, uri: str) -> str | None:
        """Workspace-relative path of a file URI inside the root, else None."""
        if self.root is None or not uri.startswith("file:"):
            return None
        path = to_fs_path(uri)
        if path is None:
            return None
        try:
            return Path(path).resolve().relative_to(self.root).as_posix()
        except ValueError:
            return None

    def _sync(self, uri: str, *, feed_index: bool) -> None:
        key = self._key(uri)
        if key is None:
            return
        text = self.workspace.get_text_document(uri).source
        self.buffers[key] = text
        if feed_index and self.root is not None and len(text) <= INDEX_MAX_BUFFER:
            self.shared.index(self.root).update_buffer(key, text)

    def on_open(self, params: lsp.DidOpenTextDocumentParams) -> None:
        self._sync(params.text_document.uri, feed_index=False)

    def on_change(self, params: lsp.DidChangeTextDocumentParams) -> None:
        self._sync(params.text_document.uri, feed_index=True)

    def on_save(self, params: lsp.DidSaveTextDocumentParams) -> None:
        self._sync(params.text_document.uri, feed_index=True)

    def on_close(self, params: lsp.DidCloseTextDocumentParams) -> None:
        key = self._key(params.text_document.uri)
        if key is not None and self.root is not None:
            self.buffers.pop(key, None)
            if self.root in self.shared.indexes:
                self.shared.indexes[self.root].drop_buffer(key)

    def on_code_action(self, params: lsp.CodeActionParams) -> list[lsp.CodeAction] | None:
        r = params.range
        if (r.start.line, r.start.character) == (r.end.line, r.end.character):
            return None
        arg = {
            "query": "Explain the selected code and suggest improvements.",
            "uri": params.text_document.uri,
            "selection": {
                "start": {"line": r.start.line, "character": r.start.character},
                "end": {"line": r.end.line, "character": r.end.character},
            },
            "prompt": True,  # clients that can should let the user edit the query
        }
        command = lsp.Command(title=ASK_SELECTION, command=cmds.ASK, arguments=[arg])
        return [
            lsp.CodeAction(title=ASK_SELECTION, kind=lsp.CodeActionKind.Refactor, command=command)
        ]

    def on_progress_cancel(self, params: lsp.WorkDoneProgressCancelParams) -> None:
        for r in self.shared.running.values():
            if r.owner is self and r.progress == params.token:
                r.session.cancel(reason="cancelled")

    # -- the editor link ---------------------------------------------------------

    def _require_root(self) -> Path:
        if self.root is None or not self.root.is_dir():
            raise server_error("no workspace: initialize with a rootUri or workspace folder")
        return self.root

    def editor_link(self) -> EditorLink:
        caps = self.client_capabilities
        ws_caps = caps.workspace.workspace_edit if caps.workspace else None
        resource_ops = (
            frozenset(str(op.value) for op in (ws_caps.resource_operations or []))
            if ws_caps
            else frozenset()
        )
        encoding = self.workspace.position_encoding or lsp.PositionEncodingKind.Utf16
        return EditorLink(
            apply_edit=self._apply_edit,
            position_encoding=str(getattr(encoding, "value", encoding)),
            document_changes=bool(ws_caps and ws_caps.document_changes),
            resource_operations=resource_ops,
            on_changed=self._changed,
        )

    async def _apply_edit(self, edit: lsp.WorkspaceEdit, label: str) -> tuple[bool, str | None]:
        params = lsp.ApplyWorkspaceEditParams(edit=edit, label=label)
        result = await self.client_request(lsp.WORKSPACE_APPLY_EDIT, params)
        if result is None:
            return False, "no answer"
        return bool(result.applied), result.failure_reason

    def _changed(self, key: str) -> None:
        if self.root is None:
            return
        text = self.buffers.get(key)
        if text is None:
            try:
                text = (self.root / key).read_text("utf-8")
            except (OSError, UnicodeDecodeError):
                return
        if len(text) <= INDEX_MAX_BUFFER:
            self.shared.index(self.root).update_buffer(key, text)

    def _context(self, args: cmds.AskArgs) -> str | None:
        """The editor state the user asked from: current file, selection, open files."""
        parts: list[str] = []
        if args.uri:
            key = self._key(args.uri)
            if key is not None:
                parts.append(f"Current file: {key}")
                if args.selection is not None:
                    s = args.selection
                    try:
                        lines = self._text(key).splitlines()
                        chosen = "\n".join(lines[s.start_line : s.end_line + 1])
                    except Exception:
                        chosen = ""
                    parts.append(f"Selection: lines {s.start_line + 1}-{s.end_line + 1} of {key}")
                    if chosen:
                        parts.append("```\n" + chosen[:8000] + "\n```")
        opened = [k for k in (self._key(u) for u in args.open_files) if k is not None]
        if opened:
            parts.append("Open files: " + ", ".join(opened[:50]))
        return "\n".join(parts) or None

    def _text(self, key: str) -> str:
        if key in self.buffers:
            return self.buffers[key]
        assert self.root is not None
        return (self.root / key).read_text("utf-8")

    # -- sessions --------------------------------------------------------------

    def _forward(self, session_id: str, event: ev.Event) -> None:
        if self.closed:
            return
        self.protocol.notify(EVENT, {**event.to_wire(), "session_id": session_id})
        running = self.shared.running.get(session_id)
        if running is not None and running.progress is not None:
            message = _progress_message(event)
            if message:
                self.work_done_progress.report(
                    running.progress, lsp.WorkDoneProgressReport(message=message)
                )

    async def _approve(self, session_id: str, name: str, args: dict[str, Any]) -> Approval:
        """The session's approver: asked only about the calls its policy holds back
        (`Session.needs_approval`), through `window/showMessageRequest`."""
        command = str(args.get("command", "")).strip()
        key = f"{name}:{command}"
        if key in self.always:
            return "run"
        if command:
            what = f"run `{revealed(command)}`"  # whole: the user decides on what they see
        else:
            detail = args.get("path") or args.get("pattern") or args.get("query") or ""
            what = f"call {name} {revealed(str(detail))}".rstrip()
        params = lsp.ShowMessageRequestParams(
            type=lsp.MessageType.Warning,
            message=f"opencomposer ({session_id}) wants to {what}",
            actions=[
                lsp.MessageActionItem(title=t) for t in (ACTION_RUN, ACTION_ALWAYS, ACTION_REJECT)
            ],
        )
        try:
            choice = await self.client_request(lsp.WINDOW_SHOW_MESSAGE_REQUEST, params)
        except (ConnectionError, JsonRpcException):
            return "reject"
        title = getattr(choice, "title", None) if choice is not None else None
        if title == ACTION_ALWAYS:
            self.always.add(key)
            return "always"
        return "run" if title == ACTION_RUN else "reject"

    async def _reveal(self, root: Path, path: str) -> None:
        params = lsp.ShowDocumentParams(uri=(root / path).as_uri(), take_focus=False)
        try:
            await self.client_request(lsp.WINDOW_SHOW_DOCUMENT, params)
        except (ConnectionError, JsonRpcException):
            pass

    async def _progress_begin(self, running: Running, title: str) -> None:
        caps = self.client_capabilities.window
        if not (caps and caps.work_done_progress):
            return
        token = f"opencomposer/{running.session.id}"
        try:
            await self.client_request(
                lsp.WINDOW_WORK_DONE_PROGRESS_CREATE, lsp.WorkDoneProgressCreateParams(token=token)
            )
        except (ConnectionError, JsonRpcException):
            return
        if running.task.done():
            return
        self.work_done_progress.begin(
            token,
            lsp.WorkDoneProgressBegin(title="opencomposer", message=title[:80], cancellable=True),
        )
        running.progress = token

    def _history(self, session_id: str, root: Path) -> tuple[str, History]:
        """The finished session a follow-up continues: from memory, else its trace."""
        from opencomposer.agent.session import History

        if session_id in self.shared.running:
            raise server_error(f"session {session_id} is still running")
        if session_id in self.shared.histories:
            return session_id, self.shared.histories[session_id]
        store = self.shared.traces()
        try:
            full = store.resolve(session_id)
            trace = store.export(full)
        except KeyError as e:
            raise server_error(f"cannot continue: {e.args[0] if e.args else e}") from None
        if full in self.shared.running or trace["status"] == "running":
            raise server_error(f"session {full} is still running")
        if full in self.shared.histories:  # named by a prefix
            return full, self.shared.histories[full]
        if Path(trace["workspace"]) != root:
            raise server_error(
                f"cannot continue: session {full} ran in {trace['workspace']}, not in this workspace"
            )
        return full, History.from_trace(trace)

    async def cmd_ask(self, args: cmds.AskArgs) -> dict[str, Any]:
        from opencomposer.agent.factory import open_session
        from opencomposer.agent.session import SessionConfig

        root = self._require_root()
        if args.session_id:
            self._history(args.session_id, root)  # fail fast, before loading a model
        model = await self.shared.model(args.model or self.model_spec)
        history = None
        if args.session_id:  # again: the model load awaited, another ask may have started it
            session_id, history = self._history(args.session_id, root)
        else:
            session_id = uuid.uuid4().hex[:12]
        workspace = EditorWorkspace(root, self.buffers, self.editor_link())
        session = open_session(
            model=model,
            workspace=workspace,
            config=SessionConfig(
                approve=args.approve,
                auto_apply_edits=args.auto_apply_edits,
            ),
            on_event=lambda event: self._on_event(session_id, event, root, args.reveal),
            approver=lambda name, a: self._approve(session_id, name, a),
            traces=self.shared.traces(),
            index=self.shared.index(root),
            session_id=session_id,
            history=history,
        )
        task = asyncio.ensure_future(session.run(args.query, context=self._context(args)))
        running = Running(session=session, task=task, owner=self, msg_id=self.protocol.msg_id)
        self.shared.running[session_id] = running
        progress = asyncio.ensure_future(self._progress_begin(running, args.query))
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            session.cancel(reason="disconnected" if self.closed else "cancelled")
            await asyncio.wait([task], timeout=CANCEL_WAIT_S)
            raise
        finally:
            self.shared.running.pop(session_id, None)
            if not progress.done():
                progress.cancel()  # a client that never answered workDoneProgress/create
            await asyncio.gather(progress, return_exceptions=True)
            if running.progress is not None and not self.closed:
                self.work_done_progress.end(
                    running.progress, lsp.WorkDoneProgressEnd(message=_ended(task))
                )
        self.shared.keep_history(session_id, session.history())
        self._add_edits(session_id, root, result.edits, follow_up=history is not None)
        if running.by_request:
            data = {"session_id": session_id, "status": result.status}
            raise JsonRpcRequestCancelled(message=f"session {session_id} cancelled", data=data)
        body: dict[str, Any] = {
            "session_id": session_id,
            "status": result.status,
            "answer": result.answer,
        }
        if result.error:
            body["error"] = result.error
        body["trace"] = result.trace
        body["edits"] = [e.path for e in result.edits]
        return body

    def _on_event(self, session_id: str, event: ev.Event, root: Path, reveal: bool) -> None:
        self._forward(session_id, event)
        window = self.client_capabilities.window
        can_show = bool(window and window.show_document and window.show_document.support)
        if reveal and can_show and isinstance(event, ev.Edit) and not self.closed:
            asyncio.ensure_future(self._reveal(root, event.path))

    def cmd_cancel(self, args: cmds.CancelArgs) -> dict[str, Any]:
        chosen = [
            r
            for sid, r in self.shared.running.items()
            if (sid == args.session_id if args.session_id else r.owner is self)
        ]
        if args.session_id and not chosen:
            raise server_error(f"no running session {args.session_id}")
        for r in chosen:
            r.session.cancel(reason="cancelled")
        return {"cancelled": [r.session.id for r in chosen]}

    async def cmd_search(self, args: cmds.SearchArgs) -> list[dict[str, Any]]:
        root = self._require_root()
        try:
            hits = await self.shared.index(root).query(args.query, args.k, args.path)
        except JsonRpcException:
            raise
        except Exception as e:
            raise server_error(f"search failed: {e}") from None
        return [
            {
                "path": h.path,
                "start_line": h.start_line,
                "end_line": h.end_line,
                "score": float(h.score),
                "text": h.text,
            }
            for h in hits
        ]

    def _add_edits(self, session_id: str, root: Path, edits: list[Edit], follow_up: bool) -> None:
        """A session's edits over all its requests: undo and reject cover the session."""
        record = self.shared.records.get(session_id)
        if record is None and follow_up:
            try:
                record = self._record_from_trace(session_id)
                # the trace holds this request's edits too: keep the earlier ones
                record.edits = record.edits[: len(record.edits) - len(edits)]
            except JsonRpcException:
                record = None
        if record is None:
            record = Record(session_id=session_id, root=root)
        record.edits.extend(edits)
        self.shared.records[session_id] = record

    def _record(self, session_id: str) -> Record:
        if session_id in self.shared.running:
            raise server_error(f"session {session_id} is still running; cancel it first")
        record = self.shared.records.get(session_id)
        if record is not None:
            return record
        return self._record_from_trace(session_id)

    def _record_from_trace(self, session_id: str) -> Record:
        """A session of an earlier server process: its edits as the trace kept them."""
        from opencomposer.tools.protocols import Edit

        store = self.shared.traces()
        try:
            trace = store.export(store.resolve(session_id))
        except KeyError as e:
            raise server_error(str(e.args[0] if e.args else e)) from None
        edits = [
            Edit(path=e["path"], before=e["before"], after=e["after"], diff=e["diff"] or "")
            for e in trace["edits"]
        ]
        accepted: dict[str, int] = {}  # the leading run of accepted edits of each path
        seen: dict[str, int] = {}
        for row in trace["edits"]:
            n = seen[row["path"]] = seen.get(row["path"], 0) + 1
            if row["decision"] == "accept" and accepted.get(row["path"], 0) == n - 1:
                accepted[row["path"]] = n
        return Record(
            session_id=trace["session_id"],
            root=Path(trace["workspace"]),
            edits=edits,
            from_trace=True,
            accepted=accepted,
        )

    async def _revert(
        self, record: Record, paths: list[str] | None = None, keep_accepted: bool = False
    ) -> tuple[list[str], list[dict[str, str]]]:
        """Put each file back as it was before the session's first edit to it, through
        the editor (with `keep_accepted`, as it was after its last accepted edit).
        Newest-touched file first. From a trace (another process), only files still
        exactly as the session left them are reverted."""
        from opencomposer.tools.protocols import ToolError

        if record.root != self._require_root():
            raise server_error(
                f"session {record.session_id} ran in {record.root}, not in this workspace"
            )
        first: dict[str, Edit] = {}
        last: dict[str, Edit] = {}
        for e in record.edits:
            first.setdefault(e.path, e)
            last[e.path] = e
        order = [p for p in reversed(list(last)) if paths is None or p in paths]
        workspace = EditorWorkspace(record.root, self.buffers, self.editor_link())
        reverted, failed = [], []
        for path in order:
            before = first[path].before
            kept = record.accepted.get(path, 0) if keep_accepted else 0
            if 0 < kept < len(record.of(path)):  # edits since the accept: reject only those
                before = record.of(path)[kept - 1].after
            try:
                if record.from_trace:
                    now = workspace.read_text(path) if workspace.exists(path) else None
                    if now != last[path].after:
                        failed.append(
                            {"path": path, "error": "changed since the session; not reverted"}
                        )
                        continue
                if before is None:
                    if workspace.exists(path):
                        await workspace.delete(path)
                else:
                    await workspace.write_text(path, before)
                reverted.append(path)
            except ToolError as e:
                failed.append({"path": path, "error": str(e)})
        return reverted, failed

    async def cmd_decide(self, args: cmds.DecideArgs) -> dict[str, Any]:
        record = self._record(args.session_id)
        if not any(e.path == args.path for e in record.edits):
            raise server_error(f"session {args.session_id} did not edit {args.path}")
        reverted = False
        if args.decision == "reject":
            done, failed = await self._revert(record, [args.path], keep_accepted=True)
            if failed:
                raise server_error(f"could not revert {args.path}: {failed[0]['error']}")
            reverted = bool(done)
        else:
            record.accepted[args.path] = len(record.of(args.path))
        self._decide(record.session_id, args.path, args.decision)
        return {"ok": True, "reverted": reverted}

    async def cmd_undo(self, args: cmds.UndoArgs) -> dict[str, Any]:
        record = self._record(args.session_id)
        reverted, failed = await self._revert(record)
        for path in reverted:
            self._decide(record.session_id, path, "undo")
        body: dict[str, Any] = {"reverted": reverted}
        if failed:
            body["failed"] = failed
        return body

    def _decide(self, session_id: str, path: str, decision: str) -> None:
        try:
            self.shared.traces().record_decision(session_id, path, decision)
        except Exception as e:
            raise server_error(f"could not record the decision: {e}") from None

    def cmd_sessions(self, args: cmds.SessionsArgs) -> list[dict[str, Any]]:
        return self.shared.traces().list_sessions(args.limit)

    async def cmd_submit(self, args: cmds.SubmitArgs) -> dict[str, Any]:
        try:
            from opencomposer.training.tasks import task_from_trace
        except ImportError:
            raise server_error(
                "opencomposer.submit needs opencomposer.training.tasks.task_from_trace, which this installation lacks"
            ) from None
        from opencomposer.agent.traces import home

        store = self.shared.traces()
        try:
            session_id = store.resolve(args.session_id)
        except KeyError as e:
            raise server_error(str(e.args[0] if e.args else e)) from None
        out = Path(args.out).expanduser() if args.out else home() / "tasks" / session_id
        try:
            task_dir = await asyncio.to_thread(
                task_from_trace, session_id, out=out, verify=args.verify, store=store
            )
        except Exception as e:
            raise server_error(f"could not submit {session_id}: {e}") from None
        return {"task_dir": str(task_dir)}


def _function(method: Any) -> Any:
    """A plain function calling `method` (pygls tags handlers with attributes, which
    bound methods cannot carry)."""
    if asyncio.iscoroutinefunction(method):

        async def call_async(*args: Any) -> Any:
            return await method(*args)

        return call_async

    def call(*args: Any) -> Any:
        return method(*args)

    return call


def _command(name: str, handler: Any) -> Any:
    """Wrap a typed command handler: check the arguments first (-32602 on misfit)."""

    if asyncio.iscoroutinefunction(handler):

        async def run_async(*arguments: Any) -> Any:
            return await handler(_parse(name, arguments))

        return run_async

    def run(*arguments: Any) -> Any:
        return handler(_parse(name, arguments))

    return run


def _parse(name: str, arguments: tuple[Any, ...]) -> Any:
    try:
        return cmds.parse(name, list(arguments))
    except cmds.ArgError as e:
        raise JsonRpcInvalidParams(message=str(e)) from None


def _progress_message(event: ev.Event) -> str | None:
    match event:
        case ev.ModelStart():
            return f"thinking (turn {event.turn})"
        case ev.ToolStart(args=args):
            keys = ("path", "pattern", "query", "command")
            detail = next((args[k] for k in keys if args.get(k)), "")
            return f"{event.name} {str(detail)[:60]}".strip()
        case ev.Edit():
            return f"edited {event.path}"
    return None


def _ended(task: asyncio.Task[Any]) -> str:
    if task.cancelled() or task.exception() is not None:
        return "stopped"
    return task.result().status


# -- entry points ----------------------------------------------------------------


def serve(
    *,
    tcp: tuple[str, int] | None = None,
    model: str = "smollm2",
    allow_remote: bool = False,
) -> int:
    """Run the language server until the editor exits (stdio) or forever (TCP, where
    clients must present the token this prints and records: `lsp_auth`)."""
    from opencomposer.server import lsp_auth, lsp_transport

    logging.basicConfig(
        level=logging.DEBUG if os.environ.get("OPENCOMPOSER_DEBUG") else logging.WARNING,
        stream=sys.stderr,
        format="opencomposer serve: %(levelname)s %(message)s",
    )
    if not os.environ.get("OPENCOMPOSER_DEBUG"):
        # pygls logs every error response with a traceback; the client gets them anyway
        logging.getLogger("pygls").setLevel(logging.CRITICAL)
    shared = Shared(model=model)
    connections: list[ComposerServer] = []

    def make() -> ComposerServer:
        server = ComposerServer(shared)
        connections.append(server)
        return server

    if tcp is not None:
        try:
            warning = lsp_auth.check_bind(tcp[0], allow_remote=allow_remote)
        except ValueError as e:
            print(f"opencomposer serve: {e}", file=sys.stderr)
            return 2
        if warning:
            print(f"opencomposer serve: warning: {warning}", file=sys.stderr)
        token = lsp_auth.new_token()
        records: list[Path] = []

        def listening(host: str, port: int) -> None:
            info = lsp_auth.ServerInfo(
                host=host, port=port, token=token, pid=os.getpid(), model=model
            )
            try:
                records.append(lsp_auth.write_server_file(info))
                where = f"; also in {records[0]} (mode 0600)"
            except OSError as e:
                where = f"; could not record it under {lsp_auth.servers_dir()}: {e}"
            print(f"opencomposer serve: listening on {host}:{port}", file=sys.stderr)
            print(
                f"opencomposer serve: token {token} (clients send it as "
                f"initializationOptions.token{where})",
                file=sys.stderr,
                flush=True,
            )

        async def run_tcp() -> None:
            task = asyncio.current_task()
            assert task is not None
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
            try:
                await lsp_transport.serve_tcp(make, tcp[0], tcp[1], listening, token=token)
            finally:
                for path in records:
                    lsp_auth.remove_server_file(path, token)
                await shared.close()

        try:
            asyncio.run(run_tcp())
        except (KeyboardInterrupt, asyncio.CancelledError):
            return 0
        except OSError as e:
            print(
                f"opencomposer serve: cannot listen on {tcp[0]}:{tcp[1]}: {e.strerror or e}",
                file=sys.stderr,
            )
            return 1
        return 0
    started = time.monotonic()

    async def run_stdio() -> None:
        try:
            await lsp_transport.serve_stdio(make)
        finally:
            await shared.close()

    try:
        asyncio.run(run_stdio())
    except KeyboardInterrupt:
        return 0
    log.debug("served for %.1f s", time.monotonic() - started)
    server = connections[0] if connections else None
    if server is not None and server.exit_requested and not server.protocol._shutdown:
        return 1  # `exit` without `shutdown`, as the LSP specification asks
    return 0


def _parse_tcp(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m opencomposer.server.lsp", description="opencomposer language server"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--stdio", action="store_true", help="talk LSP over stdin/stdout (default)")
    mode.add_argument(
        "--tcp", type=_parse_tcp, metavar="HOST:PORT", help="listen for editors on a TCP port"
    )
    parser.add_argument(
        "--model", default=os.environ.get("OPENCOMPOSER_MODEL", "smollm2"), help="model spec"
    )
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="with --tcp: listen on an address other machines can reach (unencrypted)",
    )
    ns = parser.parse_args(argv)
    return serve(tcp=ns.tcp, model=ns.model, allow_remote=ns.allow_remote)


if __name__ == "__main__":
    sys.exit(main())
