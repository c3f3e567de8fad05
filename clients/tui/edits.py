"""Apply an LSP `WorkspaceEdit` to the files on disk (the TUI is the server's editor).

The server asks its client to change files through `workspace/applyEdit`; a terminal
has no buffers, so the TUI writes straight to disk. Positions are UTF-16 code units,
as LSP defines them, counted on lines split at `\\n`, `\\r\\n` or `\\r`; line endings
in the file are kept byte for byte.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from lsprotocol import types as lsp

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


class EditError(Exception):
    """The edit cannot be applied; the message says why in one line."""


@dataclass(frozen=True, kw_only=True)
class Applied:
    """Paths (absolute) that an edit touched, in order."""

    paths: tuple[Path, ...]


def uri_to_path(uri: str) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme not in ("file", ""):
        raise EditError(f"not a file URI: {uri}")
    return Path(unquote(parsed.path))


def _offset(text: str, line_starts: list[int], pos: lsp.Position) -> int:
    """The string index of an LSP position (UTF-16 units), clamped to the text."""
    if pos.line >= len(line_starts):
        return len(text)
    start = line_starts[pos.line]
    end = line_starts[pos.line + 1] if pos.line + 1 < len(line_starts) else len(text)
    line = _LINE_BREAK.sub("", text[start:end])
    units = 0
    for i, ch in enumerate(line):
        if units >= pos.character:
            return start + i
        units += 2 if ord(ch) > 0xFFFF else 1
    return start + len(line)


def apply_text_edits(text: str, edits: list[lsp.TextEdit]) -> str:
    """Apply edits (all relative to the original text) and return the new text."""
    line_starts = [0] + [m.end() for m in _LINE_BREAK.finditer(text)]
    spans = []
    for edit in edits:
        start = _offset(text, line_starts, edit.range.start)
        end = _offset(text, line_starts, edit.range.end)
        if end < start:
            raise EditError(f"edit range ends before it starts: {edit.range}")
        spans.append((start, end, edit.new_text))
    spans.sort(key=lambda s: (s[0], s[1]))
    for (_, a_end, _), (b_start, _, _) in zip(spans, spans[1:], strict=False):
        if b_start < a_end:
            raise EditError("overlapping text edits")
    out, cursor = [], 0
    for start, end, new in spans:
        out.append(text[cursor:start])
        out.append(new)
        cursor = end
    out.append(text[cursor:])
    return "".join(out)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read(path: Path) -> str:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except FileNotFoundError:
        return ""
    except UnicodeDecodeError as exc:
        raise EditError(f"{path} is not UTF-8 text") from exc


def _edit_file(path: Path, edits: list) -> None:
    plain = [e for e in edits if isinstance(e, lsp.TextEdit)]
    _write(path, apply_text_edits(_read(path), plain))


def apply_workspace_edit(edit: lsp.WorkspaceEdit) -> Applied:
    """Apply every change of `edit` to disk, in order; raise `EditError` on the first failure."""
    touched: list[Path] = []
    try:
        for change in edit.document_changes or ():
            if isinstance(change, lsp.TextDocumentEdit):
                path = uri_to_path(change.text_document.uri)
                _edit_file(path, list(change.edits))
            elif isinstance(change, lsp.CreateFile):
                path = uri_to_path(change.uri)
                opts = change.options
                if path.exists() and not (opts and opts.overwrite):
                    if opts and opts.ignore_if_exists:
                        continue
                    raise EditError(f"{path} already exists")
                _write(path, "")
            elif isinstance(change, lsp.DeleteFile):
                path = uri_to_path(change.uri)
                if path.is_dir():
                    if not (change.options and change.options.recursive):
                        raise EditError(f"{path} is a folder")
                    import shutil

                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
                elif not (change.options and change.options.ignore_if_not_exists):
                    raise EditError(f"{path} does not exist")
            elif isinstance(change, lsp.RenameFile):
                path = uri_to_path(change.new_uri)
                old = uri_to_path(change.old_uri)
                if path.exists() and not (change.options and change.options.overwrite):
                    raise EditError(f"{path} already exists")
                path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(old, path)
            else:
                raise EditError(f"unsupported change: {type(change).__name__}")
            touched.append(path)
        for uri, edits in (edit.changes or {}).items():
            path = uri_to_path(uri)
            _edit_file(path, list(edits))
            touched.append(path)
    except OSError as exc:
        raise EditError(str(exc)) from exc
    return Applied(paths=tuple(touched))
