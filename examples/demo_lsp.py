"""`make demo`: one real agent session through the language server, with a real LSP client.

Copies `examples/sample_repo` (a cart whose subtotal ignores quantities, with a
failing test) into a fresh git repository, starts `opencomposer serve --stdio`
(the module `opencomposer.server.lsp`), and plays the editor with pygls'
`LanguageClient`: it opens the buggy file, asks the agent to fix it, prints the
work-done progress and every `opencomposer/event` as it streams (text, tool calls
with their durations, edits as diffs), applies the agent's `workspace/applyEdit`s
to its buffer and saves them, answers approvals, then prints the trace and runs
the tests.

    python examples/demo_lsp.py [--model SPEC] [--keep]     # default model: smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lsprotocol import types as lsp
from pygls.io_ import run_async
from pygls.lsp.client import LanguageClient
from pygls.uris import to_fs_path

HERE = Path(__file__).resolve().parent
QUERY = "The test test_subtotal_counts_quantities fails. Fix Cart.subtotal in shop/cart.py so it counts quantities."
BUGGY = "shop/cart.py"


def prepare(dest: Path) -> Path:
    repo = dest / "shop"
    shutil.copytree(HERE / "sample_repo", repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    git = ["git", "-C", str(repo), "-c", "user.name=demo", "-c", "user.email=demo@localhost"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "sample repository"], check=True)
    return repo


def plain(value: Any) -> Any:
    if hasattr(value, "_asdict"):
        return {k: plain(v) for k, v in value._asdict().items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


class DemoEditor(LanguageClient):
    """Just enough editor: buffers, applyEdit (then save), approvals, a console view."""

    def __init__(self) -> None:
        super().__init__("opencomposer-demo", "0.1")
        self.buffers: dict[str, str] = {}
        self.versions: dict[str, int] = {}
        self.streaming = False

        @self.feature("opencomposer/event")
        def on_event(params: Any) -> None:
            self.show(plain(params))

        @self.feature(lsp.WINDOW_WORK_DONE_PROGRESS_CREATE)
        def on_create(params: lsp.WorkDoneProgressCreateParams) -> None:
            return None

        @self.feature(lsp.PROGRESS)
        def on_progress(params: lsp.ProgressParams) -> None:
            value = plain(params.value)
            if value.get("kind") != "report":
                self.line(f"[progress] {value.get('kind')}: {value.get('title') or value.get('message') or ''}")

        @self.feature(lsp.WINDOW_SHOW_MESSAGE_REQUEST)
        def on_approval(params: lsp.ShowMessageRequestParams) -> lsp.MessageActionItem:
            self.line(f"[approval] {params.message} -> Run")
            return lsp.MessageActionItem(title="Run")

        @self.feature(lsp.WORKSPACE_APPLY_EDIT)
        def on_apply(params: lsp.ApplyWorkspaceEditParams) -> lsp.ApplyWorkspaceEditResult:
            try:
                self.apply(params.edit)
            except Exception as e:  # the demo editor refuses what it cannot apply
                return lsp.ApplyWorkspaceEditResult(applied=False, failure_reason=str(e))
            return lsp.ApplyWorkspaceEditResult(applied=True)

    def line(self, text: str) -> None:
        if self.streaming:
            print(flush=True)
            self.streaming = False
        print(text, flush=True)

    def show(self, ev: dict[str, Any]) -> None:
        kind = ev["type"]
        if kind == "session_start":
            self.line(f"── session {ev['session_id']} · model {ev['model']}")
        elif kind == "model_start":
            self.line(f"── turn {ev['turn']}")
        elif kind == "model_delta":
            print(ev["text"], end="", flush=True)
            self.streaming = True
        elif kind == "tool_start":
            args = " ".join(f"{k}={str(v).splitlines()[0][:50] if str(v) else ''!r}" for k, v in ev["args"].items())
            self.line(f"▶ {ev['name']} {args}")
        elif kind == "tool_end":
            self.line(f"  {'✓' if ev['status'] == 'ok' else '✗'} {ev['name']} {ev['duration_s']:.2f}s")
        elif kind == "edit":
            self.line(f"✎ {ev['path']}\n{ev['diff'].rstrip()}")
        elif kind == "session_end":
            self.line(f"── {ev['status']}: {ev['turns']} turns, {ev['tool_calls']} tool calls, {ev['duration_s']:.1f}s")

    def apply(self, edit: lsp.WorkspaceEdit) -> None:
        for change in edit.document_changes or []:
            if isinstance(change, lsp.CreateFile):
                Path(to_fs_path(change.uri)).parent.mkdir(parents=True, exist_ok=True)
                Path(to_fs_path(change.uri)).touch()
            elif isinstance(change, lsp.DeleteFile):
                Path(to_fs_path(change.uri)).unlink(missing_ok=True)
                self.buffers.pop(change.uri, None)
            elif isinstance(change, lsp.TextDocumentEdit):
                self.edit(change.text_document.uri, change.edits)

    def edit(self, uri: str, edits: list[Any]) -> None:
        path = Path(to_fs_path(uri))
        text = self.buffers.get(uri, path.read_text() if path.exists() else "")
        lines = text.splitlines(keepends=True)

        def offset(pos: lsp.Position) -> int:  # whole-line edits: character is 0 or the line's end
            return sum(len(x) for x in lines[: pos.line]) + pos.character

        for e in sorted(edits, key=lambda e: (e.range.start.line, e.range.start.character), reverse=True):
            text = text[: offset(e.range.start)] + e.new_text + text[offset(e.range.end) :]
        path.write_text(text)  # "save" what was applied, like the VS Code and Neovim clients
        if uri in self.buffers:
            self.buffers[uri] = text
            self.versions[uri] += 1
            self.text_document_did_change(
                lsp.DidChangeTextDocumentParams(
                    text_document=lsp.VersionedTextDocumentIdentifier(uri=uri, version=self.versions[uri]),
                    content_changes=[lsp.TextDocumentContentChangeWholeDocument(text=text)],
                )
            )

    def open(self, path: Path) -> None:
        uri = path.as_uri()
        self.buffers[uri] = path.read_text()
        self.versions[uri] = 1
        self.text_document_did_open(
            lsp.DidOpenTextDocumentParams(
                text_document=lsp.TextDocumentItem(uri=uri, language_id="python", version=1, text=self.buffers[uri])
            )
        )


async def session(repo: Path, model: str) -> int:
    editor = DemoEditor()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "opencomposer.server.lsp", "--stdio", "--model", model,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    editor.protocol.set_writer(proc.stdin)
    reader = asyncio.create_task(run_async(stop_event=editor._stop_event, reader=proc.stdout, protocol=editor.protocol))
    caps = lsp.ClientCapabilities(
        workspace=lsp.WorkspaceClientCapabilities(
            apply_edit=True,
            workspace_edit=lsp.WorkspaceEditClientCapabilities(
                document_changes=True,
                resource_operations=[lsp.ResourceOperationKind.Create, lsp.ResourceOperationKind.Delete],
            ),
        ),
        window=lsp.WindowClientCapabilities(work_done_progress=True),
    )
    await editor.initialize_async(lsp.InitializeParams(process_id=os.getpid(), root_uri=repo.as_uri(), capabilities=caps))
    editor.initialized(lsp.InitializedParams())
    editor.open(repo / BUGGY)
    print(f"asking: {QUERY}\n(the first turn waits for the model to load)", flush=True)
    params = lsp.ExecuteCommandParams(
        command="opencomposer.ask",
        arguments=[{"query": QUERY, "uri": (repo / BUGGY).as_uri(), "approve": "all"}],
    )
    try:
        result = plain(await editor.workspace_execute_command_async(params))
    except Exception as e:
        editor.line(f"the session failed: {e}")
        result = None
    if result:
        editor.line(f"\nanswer: {result['answer'] or '(none)'}")
        editor.line(f"status: {result['status']}  session: {result['session_id']}")
        editor.line(f"trace: {result.get('trace', '')}")
        editor.line(f"edited: {', '.join(result.get('edits') or []) or 'nothing'}")
    await editor.shutdown_async(None)
    editor.exit(None)
    proc.stdin.close()
    await proc.wait()
    editor._stop_event.set()
    reader.cancel()
    return 0 if result else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="model spec (default: the embedded SmolLM2-135M)")
    p.add_argument("--keep", action="store_true", help="keep the temporary repository")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="opencomposer-demo-"))
    try:
        repo = prepare(tmp)
        print(f"sample repository: {repo}", flush=True)
        rc = asyncio.run(session(repo, a.model))
        print("\n── tests after the session ──", flush=True)
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=repo, check=False)
        return rc
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
