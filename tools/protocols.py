"""The boundaries of the tools package: what a tool runs against, and what it returns.

Implementations are passed in, never imported from here: the local disk
(`LocalWorkspace`), the language server's open-buffer overlay, a training
environment's sandboxed copy; the codebase index behind `codebase_search`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable


class ToolError(Exception):
    """A recoverable problem with one tool call: its message goes back to the model."""


class PathError(ToolError):
    """A path that is malformed or resolves outside the workspace."""


@runtime_checkable
class Workspace(Protocol):
    """The files a session works on. Paths are workspace-relative POSIX strings.

    Reads see open editor buffers first (an overlay) and the disk second. Writes
    are async because an editor-backed workspace applies them through the editor
    (`workspace/applyEdit`) and may be refused.
    """

    root: Path

    def resolve(self, path: str) -> Path:
        """Absolute path inside the workspace; raises PathError for anything that
        escapes it (`..`, absolute paths, symlinks pointing out)."""
        ...

    def key(self, path: str, *, follow: bool = True) -> str:
        """Canonical workspace-relative form of `path` (`.` for the root): one spelling
        per file, whatever `./`, `..` or symlinks named it; PathError as in `resolve`.
        With `follow=False` a symlink names itself, not its target."""
        ...

    def relative(self, path: Path) -> str:
        """Workspace-relative POSIX form of an absolute path inside the workspace."""
        ...

    def read_bytes(self, path: str) -> bytes: ...

    def read_text(self, path: str) -> str:
        """Text of a file; raises ToolError for binary or non-UTF-8 content."""
        ...

    def exists(self, path: str) -> bool: ...

    def is_dir(self, path: str) -> bool: ...

    def overlay(self) -> dict[str, str]:
        """Open buffers whose text differs from (or is absent on) disk: path -> text."""
        ...

    async def write_text(self, path: str, text: str) -> None: ...

    async def delete(self, path: str) -> None: ...


class SearchHit(Protocol):
    """One ranked chunk, as `codebase_search` reads it; the index's `Hit` is one.
    `text` may be empty (the tool then reads the lines), `symbol` names the chunk's
    function or class where there is one."""

    @property
    def path(self) -> str: ...
    @property
    def start_line(self) -> int: ...
    @property
    def end_line(self) -> int: ...
    @property
    def score(self) -> float: ...
    @property
    def text(self) -> str: ...
    @property
    def symbol(self) -> str: ...


@runtime_checkable
class Index(Protocol):
    """What `codebase_search` needs from the codebase index (`opencomposer.index`)."""

    def search(
        self, query: str, *, k: int = 10, path: str | None = None
    ) -> Sequence[SearchHit]: ...


SandboxMode = Literal["read-only", "workspace-write", "off"]


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    mode: SandboxMode = "workspace-write"
    timeout_s: float = 120.0  # a command's limit when the call names none
    max_timeout_s: float = 3600.0  # the most a call's timeout_s may ask for
    memory_mb: int = 4096
    max_processes: int = 256
    output_limit: int = 30_000
    network: bool = False


@dataclass(frozen=True, kw_only=True)
class Edit:
    """One file change made by a tool: enough to show it (diff) and to undo it."""

    path: str
    before: str | None  # None: the file did not exist
    after: str | None  # None: the file was deleted
    diff: str


@dataclass(kw_only=True)
class ToolResult:
    status: Literal["ok", "error"]
    output: str
    edits: list[Edit] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def ok(cls, output: str, **kw: Any) -> ToolResult:
        return cls(status="ok", output=output, **kw)

    @classmethod
    def error(cls, output: str, **kw: Any) -> ToolResult:
        return cls(status="error", output=output, **kw)


@dataclass(kw_only=True)
class ToolContext:
    """Everything a tool may touch, passed in by the session."""

    workspace: Workspace
    index: Index | None = None
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    # Called with (path) after a tool changed a file, so an index can refresh.
    on_file_changed: Callable[[str], None] | None = None
    # Opens the index lazily on first use (building it if needed).
    index_factory: Callable[[], Awaitable[Index]] | None = None
