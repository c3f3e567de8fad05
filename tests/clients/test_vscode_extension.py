"""The VS Code extension: its pure logic under node's test runner (session store,
panel rendering, inline review's line diff), and (slow) the whole `make vsix` build
from a clean npm install to a packaged .vsix. The extension in a real VS Code is
tests/e2e/test_vscode_e2e.py (`make e2e-vscode`)."""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXT = REPO / "clients" / "vscode"
needs_node = pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None, reason="needs node and npm"
)


@needs_node
def test_extension_logic_passes_node_test() -> None:
    if not (EXT / "node_modules" / "typescript").exists():
        pytest.skip("clients/vscode/node_modules missing: run `make vsix` (npm ci) first")
    out = subprocess.run(
        ["npm", "test", "--silent"], cwd=EXT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "# fail 0" in out.stdout and "# pass" in out.stdout


@needs_node
@pytest.mark.slow
def test_make_vsix_packages_the_extension() -> None:
    out = subprocess.run(["make", "vsix"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with zipfile.ZipFile(EXT / "opencomposer.vsix") as z:
        names = set(z.namelist())
    assert {
        "extension/package.json",
        "extension/out/extension.js",
        "extension/out/model.js",
        "extension/out/panel.js",
        "extension/out/inline.js",
        "extension/out/review.js",
    } <= names
    assert any(n.startswith("extension/node_modules/vscode-languageclient/") for n in names)
    # the panel renders Markdown with markdown-it, so it must travel in the package
    assert any(n.startswith("extension/node_modules/markdown-it/") for n in names)
    assert not any(n.startswith("extension/out/test/") for n in names)
