"""read_lints: syntax errors for every language tree-sitter knows, ruff for Python.

Syntax: the language comes from the file name or extension (the table below,
for the languages `tree_sitter_language_pack` 0.13 bundles); every ERROR and
MISSING node of the parse becomes one diagnostic at its line:col. A language
whose parser cannot be loaded is skipped, never an error.

Python: `ruff check --output-format json` (the project's own ruff configuration
applies), on disk files in one batch and on open editor buffers through stdin.
Ruff is looked for next to `sys.executable` first, then on PATH. It runs on the
host, so the workspace's configuration may not turn the check into a change:
`--no-fix` overrides a `fix = true` there and `--no-cache` keeps the cache
folder it may name unwritten; paths come after `--`, each as `./…`.

Only regular files are checked: a FIFO would block the parser and ruff.

Errors follow the package convention (see `opencomposer.tools.files`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opencomposer.tools.output import returns_errors
from opencomposer.tools.protocols import ToolContext, ToolError, ToolResult, Workspace
from opencomposer.tools.workspace import not_found, walk_files

if TYPE_CHECKING:
    from tree_sitter_language_pack import SupportedLanguage

LINT_MAX_FILES = 2000
LINT_MAX_BYTES = 1024 * 1024
LINT_MAX_SHOWN = 300
SYNTAX_PER_FILE = 10
RUFF_TIMEOUT_S = 60.0
RUFF_BATCH = 400


@dataclass(frozen=True, order=True)
class Diagnostic:
    path: str
    line: int
    col: int
    message: str
    source: str  # "syntax" (tree-sitter), "ruff" or "ruff-syntax"

    def render(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.message}"


# -- languages and parsers ------------------------------------------------------


_EXTENSIONS: dict[SupportedLanguage, str] = {
    "python": "py pyi",
    "javascript": "js mjs cjs jsx",
    "typescript": "ts mts cts",
    "tsx": "tsx",
    "rust": "rs",
    "go": "go",
    "c": "c h",
    "cpp": "cc cpp cxx c++ hpp hh hxx h++ ipp",
    "cuda": "cu cuh",
    "csharp": "cs",
    "java": "java",
    "kotlin": "kt kts",
    "scala": "scala sc",
    "swift": "swift",
    "objc": "mm",
    "ruby": "rb rake gemspec",
    "php": "php",
    "perl": "pl pm",
    "lua": "lua",
    "luau": "luau",
    "bash": "sh bash",
    "fish": "fish",
    "powershell": "ps1 psm1",
    "html": "html htm",
    "css": "css",
    "scss": "scss",
    "vue": "vue",
    "svelte": "svelte",
    "astro": "astro",
    "json": "json",
    "yaml": "yaml yml",
    "toml": "toml",
    "xml": "xml xsd xsl svg",
    "sql": "sql",
    "graphql": "graphql gql",
    "proto": "proto",
    "haskell": "hs",
    "ocaml": "ml",
    "ocaml_interface": "mli",
    "elixir": "ex exs",
    "erlang": "erl hrl",
    "clojure": "clj cljs cljc edn",
    "elisp": "el",
    "commonlisp": "lisp lsp",
    "scheme": "scm ss",
    "racket": "rkt",
    "fennel": "fnl",
    "julia": "jl",
    "r": "r",
    "dart": "dart",
    "zig": "zig",
    "nim": "nim",
    "nix": "nix",
    "d": "d",
    "odin": "odin",
    "hare": "ha",
    "gleam": "gleam",
    "elm": "elm",
    "purescript": "purs",
    "fsharp": "fs fsx",
    "fsharp_signature": "fsi",
    "groovy": "groovy gradle",
    "hcl": "hcl",
    "terraform": "tf tfvars",
    "starlark": "bzl star",
    "cmake": "cmake",
    "make": "mk",
    "ninja": "ninja",
    "dockerfile": "dockerfile",
    "solidity": "sol",
    "verilog": "sv svh",
    "vhdl": "vhd vhdl",
    "glsl": "glsl vert frag",
    "hlsl": "hlsl",
    "wgsl": "wgsl",
    "latex": "tex",
    "bibtex": "bib",
    "vim": "vim",
    "tcl": "tcl",
    "pascal": "pas",
    "fortran": "f90 f95 f03 f08",
    "ada": "adb ads",
    "haxe": "hx",
    "typst": "typ",
    "kdl": "kdl",
    "ron": "ron",
    "jsonnet": "jsonnet libsonnet",
    "prisma": "prisma",
    "thrift": "thrift",
    "capnp": "capnp",
    "smithy": "smithy",
    "twig": "twig",
    "heex": "heex",
    "qmljs": "qml",
    "rego": "rego",
    "llvm": "ll",
    "wat": "wat",
    "wast": "wast",
}
_BY_EXTENSION = {ext: lang for lang, exts in _EXTENSIONS.items() for ext in exts.split()}
_BY_NAME: dict[str, SupportedLanguage] = {
    "Makefile": "make",
    "GNUmakefile": "make",
    "Dockerfile": "dockerfile",
    "CMakeLists.txt": "cmake",
    "BUILD": "starlark",
    "BUILD.bazel": "starlark",
    "WORKSPACE": "starlark",
    "meson.build": "meson",
}


def detect_language(path: str) -> SupportedLanguage | None:
    """The tree-sitter language name for `path`, from its file name or extension."""
    name = path.rsplit("/", 1)[-1]
    if name in _BY_NAME:
        return _BY_NAME[name]
    _, dot, ext = name.rpartition(".")
    return _BY_EXTENSION.get(ext.lower()) if dot else None


@functools.cache
def get_parser(language: SupportedLanguage) -> Any | None:
    """A tree-sitter parser for `language` from the language pack, or None."""
    try:
        import tree_sitter_language_pack as pack

        return pack.get_parser(language)
    except Exception:
        return None


def syntax_errors(path: str, text: str, parser: Any) -> list[Diagnostic]:
    """ERROR and MISSING nodes of `text` as diagnostics (outermost ones only)."""
    data = text.encode("utf-8")
    tree = parser.parse(data)
    found: list[Diagnostic] = []
    stack = [tree.root_node]
    while stack and len(found) < SYNTAX_PER_FILE:
        node = stack.pop()
        row, col = node.start_point
        if node.is_missing:
            found.append(
                Diagnostic(path, row + 1, col + 1, f'syntax error: missing "{node.type}"', "syntax")
            )
        elif node.is_error:
            snippet = data[node.start_byte : node.end_byte].decode("utf-8", "replace")
            snippet = " ".join(snippet.split())[:40]
            found.append(
                Diagnostic(
                    path, row + 1, col + 1, f"syntax error: unexpected {snippet!r}", "syntax"
                )
            )
        elif node.has_error:
            stack.extend(reversed(node.children))
    return sorted(found)


# -- ruff ---------------------------------------------------------------------


def find_ruff() -> str | None:
    beside = Path(sys.executable).parent / "ruff"
    if beside.is_file():
        return str(beside)
    return shutil.which("ruff")


async def _ruff(
    ruff: str, root: Path, args: list[str], stdin: str | None = None
) -> list[dict[str, Any]]:
    proc = await asyncio.create_subprocess_exec(
        ruff,
        "check",
        "--output-format",
        "json",
        "--no-cache",
        "--no-fix",
        "--exit-zero",
        "--quiet",
        *args,
        cwd=str(root),
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(
            proc.communicate(stdin.encode("utf-8") if stdin is not None else None), RUFF_TIMEOUT_S
        )
    except BaseException:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)  # not proc.kill(): see sandbox._Run.kill
        raise
    try:
        return json.loads(out or b"[]")
    except json.JSONDecodeError:
        first = (err or out).decode("utf-8", "replace").strip().splitlines()
        raise ToolError(f"ruff failed: {first[0] if first else 'no output'}") from None


def _ruff_diagnostics(
    ws: Workspace, items: list[dict[str, Any]], stdin_key: str | None = None
) -> list[Diagnostic]:
    out = []
    for item in items:
        key = stdin_key or ws.relative(Path(item["filename"]))
        loc = item.get("location") or {}
        code = item.get("code")
        message = f"{code} {item['message']}" if code else item["message"]
        syntax = code in (None, "", "invalid-syntax", "E999")
        out.append(
            Diagnostic(
                key,
                loc.get("row", 1),
                loc.get("column", 1),
                f"{message} (ruff)",
                "ruff-syntax" if syntax else "ruff",
            )
        )
    return out


async def ruff_check(
    ws: Workspace, ruff: str, disk: list[str], buffers: dict[str, str]
) -> list[Diagnostic]:
    found: list[Diagnostic] = []
    for i in range(0, len(disk), RUFF_BATCH):
        found += _ruff_diagnostics(
            ws, await _ruff(ruff, ws.root, ["--", *(f"./{p}" for p in disk[i : i + RUFF_BATCH])])
        )
    for key, text in buffers.items():
        items = await _ruff(ruff, ws.root, [f"--stdin-filename={ws.root / key}", "-"], stdin=text)
        found += _ruff_diagnostics(ws, items, stdin_key=key)
    return found


# -- the tool -----------------------------------------------------------------


def _targets(ws: Workspace, paths: list[str] | None) -> tuple[list[str], int]:
    """Files to check (workspace-relative, capped) and how many were left out by the cap."""
    found: dict[str, None] = {}
    for raw in paths or ["."]:
        key = ws.relative(ws.resolve(raw))
        if ws.is_dir(key):
            start = "" if key == "." else key
            for rel in walk_files(ws.root, start):
                found[rel] = None
            for rel in ws.overlay():
                if start == "" or rel.startswith(start + "/"):
                    found[rel] = None
        elif ws.exists(key):
            if key not in ws.overlay() and not _regular(ws.root / key):
                raise ToolError(f"{key} is not a regular file; only text files are checked")
            found[key] = None
        else:
            raise not_found(ws, key, "path")
    files = sorted(found)
    return files[:LINT_MAX_FILES], max(0, len(files) - LINT_MAX_FILES)


def _regular(target: Path) -> bool:
    try:
        return stat.S_ISREG(target.stat().st_mode)
    except OSError:
        return False


def _syntax_pass(ws: Workspace, files: list[str]) -> tuple[list[Diagnostic], set[str], list[str]]:
    """Syntax diagnostics, the files checked, and the Python files (for ruff)."""
    found: list[Diagnostic] = []
    checked: set[str] = set()
    python: list[str] = []
    overlay = ws.overlay()
    for key in files:
        language = detect_language(key)
        if language is None:
            continue
        if language == "python":
            python.append(key)
        parser = get_parser(language)
        if parser is None:
            continue
        try:
            if key not in overlay and (ws.root / key).stat().st_size > LINT_MAX_BYTES:
                continue
            text = ws.read_text(key)
        except (ToolError, OSError):
            continue
        checked.add(key)
        found += syntax_errors(key, text, parser)
    return found, checked, python


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


@returns_errors
async def read_lints(ctx: ToolContext, paths: list[str] | None = None) -> ToolResult:
    ws = ctx.workspace
    files, left_out = await asyncio.to_thread(_targets, ws, paths)  # a big tree: off the loop
    syntax, checked, python = await asyncio.to_thread(_syntax_pass, ws, files)
    notes: list[str] = []
    ruff_found: list[Diagnostic] = []
    if python:
        ruff = find_ruff()
        if ruff is None:
            notes.append("ruff is not installed: Python was checked for syntax only")
        else:
            overlay = ws.overlay()
            disk = [p for p in python if p not in overlay]
            buffers = {p: overlay[p] for p in python if p in overlay}
            ruff_found = await ruff_check(ws, ruff, disk, buffers)
            checked.update(python)
    # Where ruff found Python syntax errors, its messages are the better ones: keep only them.
    ruff_syntax = {d.path for d in ruff_found if d.source == "ruff-syntax"}
    diagnostics = sorted([d for d in syntax if d.path not in ruff_syntax] + ruff_found)
    if left_out:
        notes.append(f"only the first {LINT_MAX_FILES} files were checked; {left_out} left out")
    n_files = len({d.path for d in diagnostics})
    n_checked = len(checked)
    if not diagnostics:
        head = f"no problems found ({_count(n_checked, 'file')} checked)"
        return ToolResult.ok(
            "\n".join([head, *notes]), meta={"problems": 0, "files_checked": n_checked}
        )
    lines = [d.render() for d in diagnostics[:LINT_MAX_SHOWN]]
    if len(diagnostics) > LINT_MAX_SHOWN:
        lines.append(f"[... {len(diagnostics) - LINT_MAX_SHOWN} more problems not shown]")
    head = (
        f"{_count(len(diagnostics), 'problem')} in {_count(n_files, 'file')} "
        f"({_count(n_checked, 'file')} checked)"
    )
    return ToolResult.ok(
        "\n".join([head, *lines, *notes]),
        meta={"problems": len(diagnostics), "files_checked": n_checked},
    )
