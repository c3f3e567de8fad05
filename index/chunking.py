"""Syntax-aware chunking with tree-sitter, for every grammar in tree-sitter-language-pack.

A chunk is a span of whole lines that a reader would cut out by hand: one
function, one method, one small class, or a run of small neighbours (imports,
constants, one-line helpers) merged until the size bound. The walk is generic
over grammars, driven by node type names (`function_definition`, `class_item`,
`method_declaration`, ...), so one algorithm serves all 170-odd languages:

1. Walk the children of a node in order. A child that fits the bound and is a
   definition big enough to matter becomes its own chunk (comments right above
   it travel with it); small children accumulate and are merged.
2. A child over the bound is split recursively. If it is a definition (a big
   class), its header (the lines before its body) is kept as `context` for
   every piece, so a method chunk still says which class it belongs to.
3. A node with nothing left to split becomes line windows.

Files with no grammar, and any file whose parse fails, fall back to line
windows: a parse problem never drops a file. Every chunk carries its path,
1-based inclusive line span, symbol name and enclosing scope (`Outer.Inner`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import Any

EXTENSIONS: dict[str, str] = {
    "py": "python", "pyi": "python", "pyw": "python", "js": "javascript", "mjs": "javascript",
    "cjs": "javascript", "jsx": "javascript", "ts": "typescript", "mts": "typescript",
    "cts": "typescript", "tsx": "tsx", "go": "go", "rs": "rust", "java": "java", "kt": "kotlin",
    "kts": "kotlin", "scala": "scala", "sc": "scala", "c": "c", "h": "c", "cc": "cpp",
    "cpp": "cpp", "cxx": "cpp", "hpp": "cpp", "hh": "cpp", "hxx": "cpp", "cu": "cuda",
    "cuh": "cuda", "cs": "csharp", "rb": "ruby", "php": "php", "swift": "swift", "m": "objc",
    "mm": "objc", "lua": "lua", "sh": "bash", "bash": "bash", "zsh": "bash", "fish": "fish",
    "ps1": "powershell", "r": "r", "jl": "julia", "hs": "haskell", "ml": "ocaml",
    "mli": "ocaml_interface", "fs": "fsharp", "fsi": "fsharp_signature", "ex": "elixir",
    "exs": "elixir", "erl": "erlang", "hrl": "erlang", "clj": "clojure", "cljs": "clojure",
    "el": "elisp", "lisp": "commonlisp", "scm": "scheme", "rkt": "racket", "dart": "dart",
    "zig": "zig", "nim": "nim", "v": "v", "sol": "solidity", "sql": "sql", "html": "html",
    "htm": "html", "vue": "vue", "svelte": "svelte", "astro": "astro", "css": "css",
    "scss": "scss", "json": "json", "yaml": "yaml", "yml": "yaml", "toml": "toml",
    "xml": "xml", "md": "markdown", "markdown": "markdown", "rst": "rst", "tex": "latex",
    "proto": "proto", "graphql": "graphql", "gql": "graphql", "tf": "terraform", "hcl": "hcl",
    "nix": "nix", "cmake": "cmake", "mk": "make", "vim": "vim", "groovy": "groovy",
    "gradle": "groovy", "pl": "perl", "pm": "perl", "elm": "elm", "gleam": "gleam",
    "odin": "odin", "hx": "haxe", "ada": "ada", "adb": "ada", "f90": "fortran",
    "f95": "fortran", "f": "fortran", "pas": "pascal", "vhd": "vhdl", "sv": "verilog",
    "glsl": "glsl", "hlsl": "hlsl", "wgsl": "wgsl", "ini": "ini", "cfg": "ini",
    "thrift": "thrift", "capnp": "capnp", "prisma": "prisma", "purs": "purescript",
    "star": "starlark", "bzl": "starlark", "tcl": "tcl", "typ": "typst", "ipynb": "json",
    "gd": "gdscript", "luau": "luau", "cairo": "cairo", "kdl": "kdl", "ron": "ron",
    "wat": "wat", "wast": "wast", "matlab": "matlab", "rego": "rego", "janet": "janet",
}  # fmt: skip
FILENAMES = {"Makefile": "make", "makefile": "make", "GNUmakefile": "make", "Dockerfile": "dockerfile", "CMakeLists.txt": "cmake", "BUILD": "starlark", "WORKSPACE": "starlark", "meson.build": "meson", "go.mod": "gomod"}  # fmt: skip

# Node types that name a unit a reader looks for.
_DEF_RE = re.compile(
    r"(function|method|class|struct|interface|enum|trait|impl|module|namespace|constructor"
    r"|object|protocol|extension|record|union|macro|subroutine|procedure|type_(alias|spec|decl)"
    r"|decorated_definition|section|rule_set|element|table|pair|block_mapping_pair|test)"
)
_SCOPE_RE = re.compile(r"(class|struct|interface|enum|trait|impl|module|namespace|object|protocol|extension|record|decorated_definition)")  # fmt: skip
_BODY_RE = re.compile(r"(body|block|declaration_list|member|field_declaration_list|suite|statement_block)")  # fmt: skip
_NAME_TYPES = ("identifier", "name", "type_identifier", "field_identifier", "property_identifier", "constant", "word")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ChunkConfig:
    max_chars: int = 1500
    # Runs of statements (imports, constants) smaller than this are merged with a neighbour.
    min_chars: int = 250
    # Definitions at least this big are chunks of their own. 0: every function and class,
    # however small: merging small functions blurs their embeddings (fused MRR@10 +0.04
    # on benchmarks/retrieval.py's tuning libraries against 250).
    min_def_chars: int = 0
    window_lines: int = 40


@dataclass(frozen=True, kw_only=True)
class Chunk:
    path: str
    start_line: int  # 1-based, inclusive
    end_line: int
    text: str
    symbol: str = ""
    scope: str = ""
    # Lines kept from an enclosing definition that was split (its header).
    context: str = ""
    language: str = ""


def language_for(path: str) -> str | None:
    """The tree-sitter language name for a path, or None (line windows)."""
    name = path.rsplit("/", 1)[-1]
    if name in FILENAMES:
        return FILENAMES[name]
    if name.startswith("Dockerfile"):
        return "dockerfile"
    ext = name.rsplit(".", 1)[-1].lower() if "." in name else ""
    return EXTENSIONS.get(ext)


@cache
def _parser(language: str) -> Any:
    from tree_sitter_language_pack import get_parser

    return get_parser(language)  # type: ignore[arg-type]


def chunk_text(path: str, text: str, config: ChunkConfig | None = None) -> list[Chunk]:
    """Chunks of one file's text; never raises for any input text."""
    config = config or ChunkConfig()
    lines = text.splitlines()
    if not lines or not text.strip():
        return []
    language = language_for(path)
    if language is not None:
        try:
            chunks = _SyntaxChunker(path, text, lines, language, config).run()
            if chunks:
                return chunks
        except Exception:  # a grammar bug must not drop the file
            pass
    return line_windows(path, lines, 1, len(lines), config, language=language or "")


def line_windows(
    path: str,
    lines: list[str],
    start: int,
    end: int,
    config: ChunkConfig,
    *,
    symbol: str = "",
    scope: str = "",
    context: str = "",
    language: str = "",
) -> list[Chunk]:
    """Windows of whole lines in [start, end] (1-based), each under max_chars where lines allow."""
    out: list[Chunk] = []
    i = start
    while i <= end:
        j, size = i, 0
        while j <= end and (
            j == i
            or (size + len(lines[j - 1]) + 1 <= config.max_chars and j - i < config.window_lines)
        ):
            size += len(lines[j - 1]) + 1
            j += 1
        body = "\n".join(lines[i - 1 : j - 1])
        if body.strip():
            if len(body) > 4 * config.max_chars:  # one giant line: keep the search text bounded
                body = body[: 4 * config.max_chars]
            out.append(Chunk(path=path, start_line=i, end_line=j - 1, text=body, symbol=symbol, scope=scope, context=context, language=language))  # fmt: skip
        i = j
    return out


class _SyntaxChunker:
    def __init__(self, path: str, text: str, lines: list[str], language: str, config: ChunkConfig):
        self.path, self.lines, self.language, self.config = path, lines, language, config
        self.source = text.encode("utf-8", errors="replace")
        self.chunks: list[Chunk] = []

    def run(self) -> list[Chunk]:
        tree = _parser(self.language).parse(self.source)
        self._children(tree.root_node, scope="", context="")
        return self.chunks

    # -- helpers -------------------------------------------------------------

    def _size(self, node: Any) -> int:
        return node.end_byte - node.start_byte

    @staticmethod
    def _span(node: Any) -> tuple[int, int]:
        end = node.end_point[0] + 1
        if node.end_point[1] == 0 and end > node.start_point[0] + 1:
            end -= 1  # a node ending at column 0 ends on the line before
        return node.start_point[0] + 1, end

    def _is_def(self, node: Any) -> bool:
        return node.is_named and bool(_DEF_RE.search(node.type)) and node.type not in ("comment",)

    def _name(self, node: Any) -> str:
        if node.type == "decorated_definition":
            inner = node.child_by_field_name("definition")
            if inner is not None:
                return self._name(inner)
        named = node.child_by_field_name("name")
        if named is None:
            for child in node.named_children[:6]:
                if child.type in _NAME_TYPES or child.type.endswith("identifier"):
                    named = child
                    break
        if named is None:
            return ""
        name = self.source[named.start_byte : named.end_byte].decode("utf-8", errors="replace")
        return name if len(name) <= 80 and "\n" not in name else ""

    def _emit(self, start: int, end: int, *, symbol: str, scope: str, context: str) -> None:
        body = "\n".join(self.lines[start - 1 : end])
        if not body.strip():
            return
        if len(body) > 2 * self.config.max_chars:
            self.chunks += line_windows(self.path, self.lines, start, end, self.config, symbol=symbol, scope=scope, context=context, language=self.language)  # fmt: skip
            return
        self.chunks.append(Chunk(path=self.path, start_line=start, end_line=end, text=body, symbol=symbol, scope=scope, context=context, language=self.language))  # fmt: skip

    # -- the walk --------------------------------------------------------------

    def _children(self, node: Any, *, scope: str, context: str, symbol: str = "", lead_start: int = 0) -> None:  # fmt: skip
        """Chunk the children of node; pending small siblings are merged.

        lead_start: a line before the first child (a split definition's header)
        that the first chunk must cover. symbol: the name pieces of a split
        function carry.
        """
        first_chunk = len(self.chunks)
        pending: list[Any] = []
        pending_size = 0

        def start_of(n: Any) -> int:
            nonlocal lead_start
            line = self._span(n)[0]
            if lead_start:
                line, lead_start = min(line, lead_start), 0
            return line

        def flush() -> None:
            nonlocal pending, pending_size
            if pending:
                start, end = start_of(pending[0]), self._span(pending[-1])[1]
                defs = [n for n in pending if self._is_def(n)]
                names = [n for n in map(self._name, defs[:3]) if n]
                name = ", ".join(names) if names else symbol
                self._emit(start, end, symbol=name, scope=scope, context=context)
            pending, pending_size = [], 0

        for child in node.children:
            size = self._size(child)
            if size == 0:
                continue
            if size > self.config.max_chars:
                if pending and pending_size < self.config.min_chars:
                    lead_start = start_of(pending[0])
                    pending, pending_size = [], 0
                else:
                    lead = self._take_comments(pending)
                    flush()
                    if lead:
                        lead_start = start_of(lead[0])
                self._split(child, start_of(child), scope=scope, context=context, symbol=symbol)
            elif self._is_def(child) and size >= self.config.min_def_chars:
                lead = self._take_comments(pending)
                flush()
                start = start_of(lead[0] if lead else child)
                self._emit(start, self._span(child)[1], symbol=self._name(child), scope=scope, context=context)  # fmt: skip
            else:
                if pending and pending_size + size > self.config.max_chars:
                    flush()
                pending.append(child)
                pending_size += size
        if pending and pending_size < self.config.min_chars and len(self.chunks) > first_chunk:
            last = self.chunks[-1]
            end = self._span(pending[-1])[1]
            if (
                last.end_line <= end
                and len(last.text) + pending_size <= self.config.max_chars * 1.3
            ):
                text = "\n".join(self.lines[last.start_line - 1 : end])
                self.chunks[-1] = Chunk(path=last.path, start_line=last.start_line, end_line=end, text=text, symbol=last.symbol, scope=last.scope, context=last.context, language=last.language)  # fmt: skip
                pending = []
        flush()

    def _take_comments(self, pending: list[Any]) -> list[Any]:
        """Comments at the end of pending belong to the definition that follows them."""
        lead: list[Any] = []
        while pending and "comment" in pending[-1].type:
            lead.insert(0, pending.pop())
        return lead

    def _split(self, node: Any, start: int, *, scope: str, context: str, symbol: str) -> None:
        """A node over the size bound: recurse into its parts, keeping its header as context."""
        end = self._span(node)[1]
        if not node.children:
            self.chunks += line_windows(self.path, self.lines, start, end, self.config, symbol=symbol, scope=scope, context=context, language=self.language)  # fmt: skip
            return
        if not (self._is_def(node) or node.type == "decorated_definition"):
            self._children(node, scope=scope, context=context, symbol=symbol, lead_start=start)
            return
        name = self._name(node)
        if _SCOPE_RE.search(self._inner(node).type):
            inner_scope, piece_symbol = (
                (f"{scope}.{name}" if scope and name else (name or scope)),
                "",
            )
        else:
            inner_scope, piece_symbol = scope, name or symbol
        body = self._body(node)
        if body is None:
            self._children(node, scope=inner_scope, context=context, symbol=piece_symbol, lead_start=start)  # fmt: skip
            return
        own_start = self._span(node)[0]
        header_end = max(body.start_point[0], own_start)  # 1-based last header line, or the first
        header = "\n".join(self.lines[own_start - 1 : header_end])[:400]
        sub_context = (context + "\n" + header).strip()[-600:]
        self._children(body, scope=inner_scope, context=sub_context, symbol=piece_symbol, lead_start=start)  # fmt: skip

    def _inner(self, node: Any) -> Any:
        if node.type == "decorated_definition":
            inner = node.child_by_field_name("definition")
            if inner is not None:
                return inner
        return node

    def _body(self, node: Any) -> Any:
        if node.type == "decorated_definition":
            inner = node.child_by_field_name("definition")
            return self._body(inner) if inner is not None else None
        body = node.child_by_field_name("body")
        if body is not None:
            return body
        candidates = [c for c in node.named_children if _BODY_RE.search(c.type)]
        if candidates:
            return max(candidates, key=self._size)
        return None
