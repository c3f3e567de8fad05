"""`EditorWorkspace`: the agent's files while an editor holds some of them open.

Reads: open buffers (the `buffers` dict the language server keeps current from
`didOpen`/`didChange`/`didClose`) win over the disk, so `read_file`, `grep` and
`codebase_search` see unsaved text (`LocalWorkspace` does that part).

Writes: every change to a file goes to the editor as `workspace/applyEdit`, open
or not, so it lands in a buffer and the editor's undo can take it back. The edit
is the smallest set of whole-line replacements (`line_edits`), so cursors and
folds elsewhere in the buffer stay put. A refused edit raises `ToolError`, which
the session turns into an error result for that tool call.

The server never writes a file behind the editor's back while it is open. After
the editor applied an edit to a file it did *not* have open, the disk is brought
in line only when the editor left it stale (editors that save what they applied,
like the VS Code and Neovim clients, already did), so commands run by
`run_terminal` see the change.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from pathlib import Path

from lsprotocol import types as lsp
from opencomposer.agent.text import common_ends
from opencomposer.tools.protocols import ToolError
from opencomposer.tools.workspace import LocalWorkspace

_LINES = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")
# Above this many changed lines on either side, one replacement beats a line diff.
_DIFF_LIMIT = 4000


def split_lines(text: str) -> list[str]:
    """Lines with their terminators, split the LSP way (\\n, \\r\\n, \\r only)."""
    return _LINES.findall(text)


def code_units(text: str, encoding: str) -> int:
    """Length of `text` in the negotiated position encoding's code units."""
    if encoding == lsp.PositionEncodingKind.Utf8:
        return len(text.encode("utf-8"))
    if encoding == lsp.PositionEncodingKind.Utf32:
        return len(text)
    return len(text.encode("utf-16-le")) // 2


def _position(lines: list[str], i: int, encoding: str) -> lsp.Position:
    """Start of line `i`, or the end of the document when `i` is past the last line."""
    if i < len(lines):
        return lsp.Position(line=i, character=0)
    if not lines:
        return lsp.Position(line=0, character=0)
    last = lines[-1]
    if last.endswith(("\n", "\r")):
        return lsp.Position(line=len(lines), character=0)
    return lsp.Position(line=len(lines) - 1, character=code_units(last, encoding))


def line_edits(
    old: str, new: str, encoding: str = lsp.PositionEncodingKind.Utf16
) -> list[lsp.TextEdit]:
    """Whole-line `TextEdit`s that turn `old` into `new` (ranges refer to `old`)."""
    a, b = split_lines(old), split_lines(new)
    head, tail = common_ends(a, b)
    a_mid, b_mid = a[head : len(a) - tail], b[head : len(b) - tail]
    ops: Sequence[tuple[str, int, int, int, int]]
    if max(len(a_mid), len(b_mid)) > _DIFF_LIMIT:
        ops = [("replace", 0, len(a_mid), 0, len(b_mid))]
    else:
        ops = SequenceMatcher(None, a_mid, b_mid, autojunk=False).get_opcodes()
    edits = []
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal":
            continue
        start, end = _position(a, head + i1, encoding), _position(a, head + i2, encoding)
        edits.append(
            lsp.TextEdit(range=lsp.Range(start=start, end=end), new_text="".join(b_mid[j1:j2]))
        )
    return edits


@dataclass(kw_only=True)
class EditorLink:
    """What the overlay needs from the language server's connection to one editor."""

    # Sends `workspace/applyEdit`; returns (applied, failure reason).
    apply_edit: Callable[[lsp.WorkspaceEdit, str], Awaitable[tuple[bool, str | None]]]
    position_encoding: str = lsp.PositionEncodingKind.Utf16
    document_changes: bool = True
    resource_operations: frozenset[str] = field(default_factory=frozenset)
    # Called with the workspace-relative path after a change landed (index refresh).
    on_changed: Callable[[str], None] | None = None


class EditorWorkspace(LocalWorkspace):
    """`LocalWorkspace` whose writes go through the editor (see the module docstring)."""

    def __init__(self, root: Path, buffers: dict[str, str], editor: EditorLink) -> None:
        super().__init__(root, buffers)
        self.editor = editor

    def uri(self, key: str) -> str:
        return (self.root / key).as_uri()

    async def write_text(self, path: str, text: str) -> None:
        key = self.key(path)
        target = self.root / key
        if target.is_dir():
            raise ToolError(f"{key} is a directory; cannot write it as a file")
        was_open = key in self.buffers
        old = self.read_text(key) if self.exists(key) else None
        if old == text:
            return
        uri = self.uri(key)
        if old is None:
            if "create" not in self.editor.resource_operations or not self.editor.document_changes:
                self.write_disk(key, text)  # not open, the editor cannot create files: disk it is
                self._changed(key)
                return
            changes: list = [
                lsp.CreateFile(uri=uri, options=lsp.CreateFileOptions(ignore_if_exists=True)),
                self._document_edit(uri, [_insert_all(text)]),
            ]
            edit = lsp.WorkspaceEdit(document_changes=changes)
        else:
            edits = line_edits(old, text, self.editor.position_encoding)
            edit = self._workspace_edit(uri, edits)
        await self._apply(edit, f"opencomposer: edit {key}", key)
        if was_open or key in self.buffers:
            self.buffers[key] = text  # until the editor's own didChange arrives
        elif not _disk_equals(target, text):
            self.write_disk(key, text)
        self._changed(key)

    async def delete(self, path: str) -> None:
        key = self.key(path, follow=False)  # a symlink goes, never its target
        target = self.root / key
        if target.is_dir():
            raise ToolError(f"{key} is a directory; only files are deleted")
        if not self.exists(key):
            raise ToolError(f"file not found: {key}")
        can_delete = "delete" in self.editor.resource_operations and self.editor.document_changes
        if can_delete:
            options = lsp.DeleteFileOptions(ignore_if_not_exists=True)
            edit = lsp.WorkspaceEdit(
                document_changes=[lsp.DeleteFile(uri=self.uri(key), options=options)]
            )
            await self._apply(edit, f"opencomposer: delete {key}", key)
        elif key in self.buffers:
            raise ToolError(
                f"{key} is open in the editor, which cannot delete files; close it first"
            )
        self.buffers.pop(key, None)
        if target.exists():
            self.delete_disk(key)
        self._changed(key)

    def _document_edit(self, uri: str, edits: list[lsp.TextEdit]) -> lsp.TextDocumentEdit:
        # Version null: clients that debounce didChange (Neovim) would otherwise
        # skip an edit whose version looks older than their buffer.
        ident = lsp.OptionalVersionedTextDocumentIdentifier(uri=uri, version=None)
        return lsp.TextDocumentEdit(text_document=ident, edits=edits)

    def _workspace_edit(self, uri: str, edits: list[lsp.TextEdit]) -> lsp.WorkspaceEdit:
        if self.editor.document_changes:
            return lsp.WorkspaceEdit(document_changes=[self._document_edit(uri, edits)])
        return lsp.WorkspaceEdit(changes={uri: edits})

    async def _apply(self, edit: lsp.WorkspaceEdit, label: str, key: str) -> None:
        try:
            applied, reason = await self.editor.apply_edit(edit, label)
        except ConnectionError as e:
            raise ToolError(f"could not change {key}: {e}") from None
        if not applied:
            why = f": {reason}" if reason else ""
            raise ToolError(f"the editor refused the change to {key}{why}")

    def _changed(self, key: str) -> None:
        if self.editor.on_changed is not None:
            self.editor.on_changed(key)


def _insert_all(text: str) -> lsp.TextEdit:
    origin = lsp.Position(line=0, character=0)
    return lsp.TextEdit(range=lsp.Range(start=origin, end=origin), new_text=text)


def _disk_equals(target: Path, text: str) -> bool:
    try:
        return target.read_bytes() == text.encode("utf-8")
    except OSError:
        return False
