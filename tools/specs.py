"""Every tool, declared once.

A `ToolSpec` is the single source for a tool's prompt text (`render_prompt`),
for how the streaming parser reads its parameters (attribute or raw child
element: `parser_rules`), for argument validation (`ToolSpec.validate`), for the
scheduling footprint that lets independent calls run in parallel
(`ToolSpec.footprint`), and for what a call is (`ToolSpec.kind`), from which the
approval policy (`Session.needs_approval`), the environment's metrics and the
clients' views follow. Nothing outside this module names a tool.

`register` adds a tool at run time: every consumer reads the registry (`SPECS`,
`BY_NAME`) when it needs it, so a registered tool is parsed, prompted, run,
traced and shown with no other change.
"""

from __future__ import annotations

import importlib
import posixpath
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from opencomposer.tools.protocols import ToolContext, ToolError, ToolResult

ParamKind = Literal["str", "int", "float", "bool", "list"]
# What a call does: read (a file, a folder), search (the codebase), check (lints),
# edit (change files), command (run a program). read, search and check are read-only.
Kind = Literal["read", "search", "check", "edit", "command"]
ALL = ""  # the footprint prefix that covers the whole workspace

# The built-in tools' names, for code that must name one tool (another tool's error
# message pointing to it, a scripted demonstration): SPECS declares each under its name
# here, so renaming a tool is one edit. Code that asks what a call does reads its spec's
# `kind` instead.
READ_FILE = "read_file"
EDIT_FILE = "edit_file"
WRITE_FILE = "write_file"
DELETE_FILE = "delete_file"
LIST_DIR = "list_dir"
GLOB = "glob"
GREP = "grep"
CODEBASE_SEARCH = "codebase_search"
READ_LINTS = "read_lints"
RUN_TERMINAL = "run_terminal"


@dataclass(frozen=True, kw_only=True)
class Param:
    name: str
    kind: ParamKind = "str"
    required: bool = True
    child: bool = False  # long, raw text: written as <name>…</name> inside the call
    doc: str = ""

    def convert(self, raw: str) -> Any:
        match self.kind:
            case "str":
                return raw
            case "int":
                try:
                    return int(raw.strip())
                except ValueError:
                    raise ToolError(
                        f"parameter {self.name} must be an integer, got {raw!r}"
                    ) from None
            case "float":
                try:
                    return float(raw.strip())
                except ValueError:
                    raise ToolError(
                        f"parameter {self.name} must be a number, got {raw!r}"
                    ) from None
            case "bool":
                value = raw.strip().lower()
                if value in ("true", "1", "yes"):
                    return True
                if value in ("false", "0", "no"):
                    return False
                raise ToolError(f"parameter {self.name} must be true or false, got {raw!r}")
            case "list":
                return [p for p in raw.replace(",", " ").split() if p]


@dataclass(frozen=True)
class Footprint:
    """Workspace path prefixes a call reads and writes (ALL = everything).

    `terminal` marks run_terminal calls, which may overlap each other but are
    ordered against every call that touches files.
    """

    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    terminal: bool = False

    def conflicts(self, other: Footprint) -> bool:
        if self.terminal and other.terminal:
            return False
        return _overlap(self.writes, other.reads + other.writes) or _overlap(
            other.writes, self.reads + self.writes
        )

    def keyed(self, key: Callable[[str], str]) -> Footprint:
        """The same footprint with each path given as `key(path)`, so aliases of one
        file (`./a.txt`, `a.txt`, a symlink to it) are one path when calls are ordered."""
        return replace(
            self,
            reads=tuple(ALL if _norm(p) == ALL else _norm(key(p)) for p in self.reads),
            writes=tuple(ALL if _norm(p) == ALL else _norm(key(p)) for p in self.writes),
        )


def _norm(prefix: str) -> str:
    """One spelling of a path prefix: `./a`, `a//b/`, `d/../a` become `a`, `a/b`, `a`."""
    prefix = posixpath.normpath(prefix.strip()).strip("/")
    return "" if prefix in ("", ".") else prefix


def _overlap(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    for x in map(_norm, a):
        for y in map(_norm, b):
            if x in (ALL, y) or y == ALL or x.startswith(y + "/") or y.startswith(x + "/"):
                return True
    return False


ToolFn = Callable[..., Awaitable[ToolResult]]


@dataclass(frozen=True, kw_only=True)
class ToolSpec:
    name: str
    summary: str
    params: tuple[Param, ...]
    impl: str  # "module:function", imported on first use so the CLI stays light
    kind: Kind
    footprint: Callable[[Mapping[str, Any]], Footprint]
    example: str
    notes: str = ""
    rule: str = ""  # a line for the full system prompt's rules
    # under the `safe` policy, whether a call that is not read-only may run unasked
    safe: Callable[[Mapping[str, Any], Path], bool] | None = None

    @property
    def read_only(self) -> bool:
        return self.kind in ("read", "search", "check")

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    @property
    def child_names(self) -> frozenset[str]:
        return frozenset(p.name for p in self.params)

    def validate(self, raw: Mapping[str, str]) -> dict[str, Any]:
        """Typed arguments from the raw strings the parser found; ToolError on any problem."""
        unknown = sorted(set(raw) - {p.name for p in self.params})
        if unknown:
            allowed = ", ".join(p.name for p in self.params)
            raise ToolError(
                f"{self.name}: unknown parameter {', '.join(unknown)} (takes {allowed})"
            )
        args: dict[str, Any] = {}
        for p in self.params:
            if p.name in raw:
                try:
                    args[p.name] = p.convert(raw[p.name])
                except ToolError as e:
                    raise ToolError(f"{self.name}: {e}") from None
            elif p.required:
                raise ToolError(f"{self.name}: missing required parameter {p.name}")
        return args

    def load(self) -> ToolFn:
        module, _, fn = self.impl.partition(":")
        return getattr(importlib.import_module(module), fn)

    async def run(self, ctx: ToolContext, args: Mapping[str, Any]) -> ToolResult:
        return await self.load()(ctx, **args)

    def render(self) -> str:
        lines = [f"## {self.name}", self.summary]
        for p in self.params:
            how = f"child element <{p.name}>…</{p.name}>" if p.child else "attribute"
            opt = "" if p.required else ", optional"
            lines.append(f"- {p.name} ({p.kind}, {how}{opt}): {p.doc}")
        if self.notes:
            lines.append(self.notes)
        lines.append("Example:\n" + self.example)
        return "\n".join(lines)

    def render_call(self, **args: Any) -> str:
        """A call of this tool as the model writes it, which the parser reads back as
        `args`: short parameters as attributes (`&` and `"` escaped), long ones as raw
        child elements, in the layout of the prompt's examples."""
        attrs, children = [], []
        for name, value in args.items():
            p = self.param(name)
            if p is None:
                raise ValueError(f"{self.name} has no parameter {name}")
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, list | tuple):
                text = " ".join(map(str, value))
            else:
                text = str(value)
            if not p.child:
                quoted = text.replace("&", "&amp;").replace('"', "&quot;")
                attrs.append(f' {name}="{quoted}"')
                continue
            if f"</{name}>" in text:
                raise ValueError(f"{self.name}: <{name}> text cannot hold </{name}>")
            # the parser drops one newline at each end of a child's text: give it one
            head = "\n" if text.startswith(("\n", "\r\n")) else ""
            tail = "\n" if text.endswith("\n") else ""
            children.append(f"<{name}>{head}{text}{tail}</{name}>")
        if not children:
            return f"<{self.name}{''.join(attrs)}/>"
        return f"<{self.name}{''.join(attrs)}>\n" + "\n".join(children) + f"\n</{self.name}>"

    def render_compact(self) -> str:
        """One line for small models: the example call with child elements joined
        onto it, then the first sentence of the summary."""
        call = "".join(
            line.strip() if line.startswith("<") else line for line in self.example.splitlines()
        )
        first = self.summary.split(". ")[0].rstrip(".")
        return f"{call} — {first}."


def _path_reads(args: Mapping[str, Any]) -> Footprint:
    return Footprint(reads=(args.get("path") or ALL,))


def _path_writes(args: Mapping[str, Any]) -> Footprint:
    return Footprint(writes=(args.get("path") or ALL,))


def _read_only_command(args: Mapping[str, Any], root: Path) -> bool:
    from opencomposer.tools.terminal import is_safe_command

    return is_safe_command(str(args.get("command", "")), root)


def _lint_reads(args: Mapping[str, Any]) -> Footprint:
    return Footprint(reads=tuple(args.get("paths") or [ALL]))


SPECS: tuple[ToolSpec, ...] = (
    ToolSpec(
        name=READ_FILE,
        summary="Read a text file; lines come back numbered. Open editor buffers win over disk.",
        params=(
            Param(name="path", doc="workspace-relative path"),
            Param(name="start_line", kind="int", required=False, doc="first line, 1-based"),
            Param(name="end_line", kind="int", required=False, doc="last line, inclusive"),
        ),
        impl="opencomposer.tools.files:read_file",
        kind="read",
        footprint=_path_reads,
        example='<read_file path="src/app.py" start_line="1" end_line="60"/>',
    ),
    ToolSpec(
        name=EDIT_FILE,
        summary=(
            "Replace text in a file. <old> must match the file exactly once "
            "(whitespace differences are tolerated); include enough lines to be unique."
        ),
        params=(
            Param(name="path", doc="workspace-relative path"),
            Param(name="old", child=True, doc="the exact text to replace"),
            Param(name="new", child=True, doc="the replacement text"),
            Param(name="replace_all", kind="bool", required=False, doc="replace every match"),
        ),
        impl="opencomposer.tools.files:edit_file",
        kind="edit",
        footprint=_path_writes,
        example=(
            '<edit_file path="src/app.py">\n<old>def load(path):</old>\n'
            "<new>def load(path: str) -> dict:</new>\n</edit_file>"
        ),
        rule="Edit with edit_file: <old> must match the file once; include enough context.",
    ),
    ToolSpec(
        name=WRITE_FILE,
        summary="Create a file, or overwrite it whole.",
        params=(
            Param(name="path", doc="workspace-relative path"),
            Param(name="content", child=True, doc="the full new text of the file"),
        ),
        impl="opencomposer.tools.files:write_file",
        kind="edit",
        footprint=_path_writes,
        example='<write_file path="notes.txt">\n<content>hello\n</content>\n</write_file>',
    ),
    ToolSpec(
        name=DELETE_FILE,
        summary="Delete a file.",
        params=(Param(name="path", doc="workspace-relative path"),),
        impl="opencomposer.tools.files:delete_file",
        kind="edit",
        footprint=_path_writes,
        example='<delete_file path="old_module.py"/>',
    ),
    ToolSpec(
        name=LIST_DIR,
        summary="List a directory as a tree (.gitignore respected).",
        params=(
            Param(name="path", required=False, doc="directory, default the workspace root"),
            Param(name="depth", kind="int", required=False, doc="levels to show, default 2"),
        ),
        impl="opencomposer.tools.files:list_dir",
        kind="read",
        footprint=_path_reads,
        example='<list_dir path="src" depth="2"/>',
    ),
    ToolSpec(
        name=GLOB,
        summary="Find files whose paths match a glob pattern (** spans folders).",
        params=(Param(name="pattern", doc='for example "**/*.py" or "src/**/test_*.py"'),),
        impl="opencomposer.tools.search:glob",
        kind="search",
        footprint=lambda args: Footprint(reads=(ALL,)),
        example='<glob pattern="**/*.py"/>',
    ),
    ToolSpec(
        name=GREP,
        summary="Search file contents with a regular expression; matches come back as path:line:text.",
        params=(
            Param(name="pattern", doc="regular expression"),
            Param(name="path", required=False, doc="file or folder to search, default everything"),
            Param(name="glob", required=False, doc='only files matching this glob, e.g. "*.py"'),
            Param(name="case_sensitive", kind="bool", required=False, doc="default true"),
        ),
        impl="opencomposer.tools.search:grep",
        kind="search",
        footprint=_path_reads,
        example='<grep pattern="def retry" path="src"/>',
    ),
    ToolSpec(
        name=CODEBASE_SEARCH,
        summary=(
            "Semantic and keyword search over the whole codebase: describe what you look "
            "for in words; returns ranked path:start-end chunks."
        ),
        params=(
            Param(name="query", doc="what the code does, in words, or identifiers"),
            Param(name="path", required=False, doc="only under this folder"),
            Param(name="k", kind="int", required=False, doc="results, default 8"),
        ),
        impl="opencomposer.tools.search:codebase_search",
        kind="search",
        footprint=lambda args: Footprint(reads=(ALL,)),
        example='<codebase_search query="where retries back off after a failed request"/>',
    ),
    ToolSpec(
        name=READ_LINTS,
        summary="Diagnostics: syntax errors in any language, ruff findings for Python.",
        params=(
            Param(
                name="paths",
                kind="list",
                required=False,
                doc="files or folders, space separated; default all",
            ),
        ),
        impl="opencomposer.tools.lints:read_lints",
        kind="check",
        footprint=_lint_reads,
        example='<read_lints paths="src/app.py"/>',
    ),
    ToolSpec(
        name=RUN_TERMINAL,
        summary=(
            "Run a shell command in a sandbox at the workspace root (no network); "
            "returns the exit code and output."
        ),
        params=(
            Param(name="command", child=True, doc="a bash command line"),
            Param(name="timeout_s", kind="float", required=False, doc="seconds, default 120"),
        ),
        impl="opencomposer.tools.terminal:run_terminal",
        kind="command",
        footprint=lambda args: Footprint(reads=(ALL,), writes=(ALL,), terminal=True),
        example="<run_terminal>\n<command>python -m pytest -q tests/test_app.py</command>\n</run_terminal>",
        notes=(
            "Several run_terminal calls in one message may run at the same time; "
            "put dependent commands in one call joined with &&."
        ),
        rule="Run tests with run_terminal to check your change when the project has tests.",
        safe=_read_only_command,
    ),
)

BY_NAME: dict[str, ToolSpec] = {s.name: s for s in SPECS}
TOOL_NAMES: frozenset[str] = frozenset(BY_NAME)


def register(spec: ToolSpec) -> ToolSpec:
    """Add a tool, or replace the one of the same name."""
    global SPECS, TOOL_NAMES
    SPECS = (*(s for s in SPECS if s.name != spec.name), spec)
    BY_NAME[spec.name] = spec
    TOOL_NAMES = frozenset(BY_NAME)
    return spec


def unregister(name: str) -> None:
    global SPECS, TOOL_NAMES
    SPECS = tuple(s for s in SPECS if s.name != name)
    BY_NAME.pop(name, None)
    TOOL_NAMES = frozenset(BY_NAME)


def parser_rules() -> tuple[dict[str, frozenset[str]], dict[str, str]]:
    """For the streaming parser: each tool's parameter names, and for a tool with one
    child parameter its name (the bare `<tool>text</tool>` form)."""
    children = {s.name: s.child_names for s in SPECS}
    bare = {
        s.name: kids[0].name for s in SPECS if len(kids := [p for p in s.params if p.child]) == 1
    }
    return children, bare


def get(name: str) -> ToolSpec:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ToolError(
            f"unknown tool <{name}>; the tools are: {', '.join(sorted(TOOL_NAMES))}"
        ) from None


def render_call(name: str, **args: Any) -> str:
    """A call of the tool `name` (see `ToolSpec.render_call`); ToolError if unknown."""
    return get(name).render_call(**args)


def render_prompt(specs: tuple[ToolSpec, ...] | None = None, *, compact: bool = False) -> str:
    specs = SPECS if specs is None else specs
    if compact:
        return "\n".join(s.render_compact() for s in specs)
    return "\n\n".join(s.render() for s in specs)
