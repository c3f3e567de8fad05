"""Fixtures for the language-server tests: a small repository with a bug, a private
OPENCOMPOSER_HOME (trace store), and `editor`, which starts the real server."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from lsp_harness import Editor  # noqa: E402

CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TEST_CALC = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
FIX = (
    "The bug is in add.\n"
    '<edit_file path="calc.py">\n<old>    return a - b</old>\n<new>    return a + b</new>\n</edit_file>'
)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "calc.py").write_text(CALC)
    (root / "test_calc.py").write_text(TEST_CALC)
    return root


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    monkeypatch.setenv("OPENCOMPOSER_HOME", str(path))
    return path


@pytest.fixture
async def spawn(repo: Path, home: Path):
    """spawn(model_spec, **kw) -> a started, initialized Editor; closed afterwards."""
    editors: list[Editor] = []

    async def start(model: str, **kw) -> Editor:
        editor = await Editor.spawn(kw.pop("root", repo), model=model, home=home, **kw)
        editors.append(editor)
        return editor

    yield start
    for editor in editors:
        await editor.close()
        if os.environ.get("OC_TEST_SHOW_STDERR"):
            print(editor.stderr())
