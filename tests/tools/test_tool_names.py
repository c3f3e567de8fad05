"""A tool's name is spelled once, in tools/specs.py: other code refers to it through the
spec's name constants, its registry and its `kind`, and writes calls with `render_call`.

Guards names spelled in five places (a hint in an error message, a trace filter, a
scripted demonstration), which go stale without a sound when a tool is renamed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from opencomposer.agent.xmlcalls import parse_all
from opencomposer.tools import specs

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("agent", "tools", "server", "training", "clients/tui", "index", "kernels")
# (file, string) -> why that string literal may spell a tool's name.
ALLOWED: dict[tuple[str, str], str] = {
    ("tools/terminal.py", "grep"): "the shell command grep in the read-only allowlist",
}


def _spelled(text: str) -> bool:
    """Whether a string literal spells a tool's name: a name with an underscore
    anywhere as a word, a one-word name (`grep`, `glob`) as the whole string or as a
    tag (`<grep`, `</grep>`)."""
    names = sorted(specs.TOOL_NAMES)
    long = [n for n in names if "_" in n]
    short = [n for n in names if "_" not in n]
    as_word = re.compile(r"(?<!\w)(?:" + "|".join(map(re.escape, long)) + r")(?!\w)")
    as_tag = re.compile(r"</?(?:" + "|".join(map(re.escape, short)) + r")(?![\w-])")
    return bool(as_word.search(text) or as_tag.search(text)) or text in short


def _literals(path: Path) -> list[tuple[int, str]]:
    """The string literals of a module (f-string pieces included), docstrings left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def test_the_check_sees_names_in_strings_and_tags_but_not_prose() -> None:
    assert _spelled("use write_file to create it") and _spelled('<grep pattern="x"/>')
    assert _spelled("grep") and _spelled("</glob>")
    assert not _spelled("grep -n foo") and not _spelled("a glob pattern")
    assert not _spelled("read_files") and not _spelled("my_read_file")


def test_no_code_outside_specs_spells_a_tool_name() -> None:
    found = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "tools/specs.py":
                continue
            for line, text in _literals(path):
                if _spelled(text) and (rel, text) not in ALLOWED:
                    found.append(f"{rel}:{line}: {text[:80]!r}")
    assert not found, "tool names outside tools/specs.py (use its constants):\n" + "\n".join(found)
    for rel, text in ALLOWED:  # an entry that no longer matches anything is stale
        assert any(t == text for _, t in _literals(ROOT / rel)), (rel, text)


ARGS = {
    specs.READ_FILE: {"path": 'odd "name" & <co>.py', "start_line": 3, "end_line": 9},
    specs.EDIT_FILE: {
        "path": "a.py",
        "replace_all": True,
        "old": "\nif a < b && c:\n",
        "new": "\r\n  x = '</edit_file>'\n\n",
    },
    specs.WRITE_FILE: {"path": "n.txt", "content": "&amp; stays raw\n"},
    specs.GREP: {"pattern": r'"\w+"', "glob": "*.py", "case_sensitive": False},
    specs.READ_LINTS: {"paths": ["a.py", "b c"]},
    specs.RUN_TERMINAL: {"command": "echo 1 && echo 2", "timeout_s": 5.0},
}


@pytest.mark.parametrize("name", sorted(ARGS))
def test_render_call_is_read_back_as_its_arguments(name: str) -> None:
    text = specs.render_call(name, **ARGS[name])
    [call] = parse_all(text, *specs.parser_rules())
    assert call.error is None and call.name == name
    expected = dict(ARGS[name])
    if name == specs.READ_LINTS:
        expected["paths"] = ["a.py", "b", "c"]  # a list parameter splits on spaces
    assert specs.get(name).validate(call.raw) == expected


def test_render_call_writes_the_prompts_layout_and_refuses_what_cannot_round_trip() -> None:
    assert specs.render_call(specs.READ_FILE, path="a.py") == '<read_file path="a.py"/>'
    assert specs.render_call(specs.EDIT_FILE, path="a.py", old="x", new="y") == (
        '<edit_file path="a.py">\n<old>x</old>\n<new>y</new>\n</edit_file>'
    )
    with pytest.raises(ValueError, match="no parameter"):
        specs.render_call(specs.READ_FILE, file="a.py")
    with pytest.raises(ValueError, match="cannot hold"):
        specs.render_call(specs.EDIT_FILE, path="a", old="x</old>", new="y")
