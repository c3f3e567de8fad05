"""The VS Code extension in a real VS Code (slow): `make e2e-vscode` installs
code-server 4.100.3, puppeteer-core and Debian's chromium on first use (cached under
~/.cache/opencomposer/e2e), packages and installs the .vsix, and drives code-server
with Chromium through Ask, streaming, inline review, follow-up, accept/reject all,
undo, cancel, search, submit and a server crash (tests/e2e/vscode_e2e.js)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None, reason="needs node and npm"
)
def test_vscode_extension_end_to_end_in_code_server() -> None:
    out = subprocess.run(
        ["make", "e2e-vscode"], cwd=REPO, capture_output=True, text=True, timeout=3500
    )
    tail = out.stdout[-6000:] + out.stderr[-4000:]
    assert out.returncode == 0, tail
    assert "PASS: all steps" in out.stdout, tail
    assert "E2E METRICS" in out.stdout, tail
