"""Tree-sitter chunking: syntax-shaped, bounded, named, and never losing a file."""

from __future__ import annotations

import typing

import pytest
from opencomposer.index.chunking import ChunkConfig, chunk_text, language_for

PY = '''import os
import sys

CONSTANT = 1


def small_a():
    return 1


def small_b():
    return 2


def handler(request):
    """Handle one request."""
''' + "".join(f"    step_{i} = request.get('key_{i}')\n" for i in range(20)) + '''    return request


class Service:
    """A service with many methods."""

''' + "".join(
    f"    def method_{i}(self, value):\n" + "".join(f"        value = value + {j}  # step {j} of the work\n" for j in range(8)) + "        return value\n\n"
    for i in range(12)
)  # fmt: skip


def test_python_functions_classes_and_merging() -> None:
    config = ChunkConfig()
    chunks = chunk_text("svc.py", PY, config)
    by_symbol = {c.symbol: c for c in chunks}
    assert "handler" in by_symbol
    assert PY.splitlines()[by_symbol["handler"].start_line - 1].startswith("def handler")
    # tiny statements (imports, constants) share a chunk; every function is its own chunk
    first = chunks[0]
    assert first.start_line == 1 and "CONSTANT" in first.text and "small_a" not in first.text
    assert by_symbol["small_a"].text == "def small_a():\n    return 1"
    assert "small_b" not in by_symbol["small_a"].text
    # with a minimum size for definitions, small functions merge with their neighbours
    merged = chunk_text("svc.py", PY, ChunkConfig(min_def_chars=250))
    assert "small_a" in merged[0].text and "small_b" in merged[0].text
    assert merged[0].symbol == "small_a, small_b"
    # the big class is split into method chunks that keep the class as scope and header context
    methods = [c for c in chunks if c.scope == "Service"]
    assert len(methods) >= 3
    assert all("class Service" in c.context for c in methods)
    assert any(c.symbol == "method_5" for c in methods)
    assert all(len(c.text) <= 2 * config.max_chars for c in chunks)
    # spans are ordered, 1-based and inside the file
    n = len(PY.splitlines())
    assert all(1 <= c.start_line <= c.end_line <= n for c in chunks)
    assert all(c.text == "\n".join(PY.splitlines()[c.start_line - 1 : c.end_line]) for c in chunks)


@pytest.mark.parametrize(
    ("path", "source", "symbol"),
    [
        ("a.js", "function alpha(x) {\n" + "  x += 1;\n" * 60 + "  return x;\n}\n", "alpha"),
        (
            "a.ts",
            "export class Beta {\n"
            + "".join(f"  m{i}(): number {{\n" + "    return 1;\n" * 30 + "  }\n" for i in range(4))
            + "}\n",
            "m2",
        ),  # fmt: skip
        (
            "a.go",
            "package x\n\nfunc Gamma() int {\n" + "\tx := 1\n" * 80 + "\treturn x\n}\n",
            "Gamma",
        ),
        ("a.rs", "fn delta() -> i32 {\n" + "    let x = 1;\n" * 60 + "    x\n}\n", "delta"),
        (
            "A.java",
            "class A {\n  void epsilon() {\n"
            + "    int x = 1;\n" * 60
            + "  }\n  void zeta() {\n"
            + "    int y = 2;\n" * 60
            + "  }\n}\n",
            "epsilon",
        ),
    ],
    ids=["js", "ts", "go", "rust", "java"],
)
def test_other_languages_have_symbols(path: str, source: str, symbol: str) -> None:
    chunks = chunk_text(path, source)
    assert chunks and any(symbol in c.symbol for c in chunks), [(c.symbol, c.scope) for c in chunks]


def test_fallback_and_broken_input() -> None:
    text = "".join(f"line {i} of plain text\n" for i in range(200))
    chunks = chunk_text("notes.unknownext", text, ChunkConfig(window_lines=40))
    assert [c.start_line for c in chunks] == [1, 41, 81, 121, 161]
    broken = "def ok():\n    return 1\n\ndef broken(:\n    ))) [[[\n\nclass X\n    pass\n" * 30
    chunks = chunk_text("broken.py", broken)
    covered = {i for c in chunks for i in range(c.start_line, c.end_line + 1)}
    assert len(covered) >= len(broken.splitlines()) * 0.9
    assert chunk_text("empty.py", "") == [] and chunk_text("blank.py", "\n\n  \n") == []
    giant = "x = [" + ", ".join(str(i) for i in range(50_000)) + "]\n"
    chunks = chunk_text("giant.py", giant)
    assert chunks and all(len(c.text) <= 4 * ChunkConfig().max_chars for c in chunks)


def test_every_grammar_in_the_pack_loads_and_chunks() -> None:
    from tree_sitter_language_pack import SupportedLanguage, get_parser

    names = typing.get_args(SupportedLanguage)
    assert len(names) > 150
    for name in names:
        get_parser(name)  # raises if a grammar is missing
    # a chunker run over the mapped languages never raises and never loses the text
    for ext in ["py", "js", "ts", "tsx", "go", "rs", "java", "c", "cpp", "cs", "rb", "php", "swift", "kt", "scala", "lua", "sh", "hs", "ml", "ex", "zig", "sql", "html", "css", "json", "yaml", "toml", "md"]:  # fmt: skip
        assert language_for(f"f.{ext}") is not None
        chunks = chunk_text(f"f.{ext}", "some text\n" * 5 + "{ fn(x) }\n")
        assert chunks, ext
