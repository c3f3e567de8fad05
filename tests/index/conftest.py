"""Fixtures for the index tests: workspaces, and a CLS-pooled variant of the tiny
embedder (`tiny_embedder` and `embedder_env` live in tests/conftest.py, shared with
the other folders' tests that run `codebase_search`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest


@pytest.fixture
def cls_pooled_embedder(tiny_embedder: Path, tmp_path: Path) -> Path:
    """The tiny model with CLS pooling instead of mean pooling (not our BERT fast path)."""
    folder = tmp_path / "cls"
    shutil.copytree(tiny_embedder, folder)
    pooling = folder / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    config.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    pooling.write_text(json.dumps(config))
    return folder


SAMPLE = {
    "src/retry.py": '''"""Retry helpers."""
import time


def retry_with_backoff(fn, attempts=5, base=0.1, cap=2.0):
    """Call fn until it succeeds, sleeping exponentially longer between tries."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception:
            delay = min(cap, base * 2 ** attempt)
            time.sleep(delay)
    raise RuntimeError("gave up")


class CircuitBreaker:
    """Stops calling a failing service for a while."""

    def __init__(self, threshold: int = 3):
        self.threshold = threshold
        self.failures = 0

    def record_failure(self) -> None:
        self.failures += 1

    def is_open(self) -> bool:
        return self.failures >= self.threshold
''',
    "src/parse.py": """def parseHttpHeader(line):
    name, _, value = line.partition(":")
    return name.strip().lower(), value.strip()


def read_config_file(path):
    with open(path) as f:
        return dict(parseHttpHeader(l) for l in f if ":" in l)
""",
    "web/app.ts": """export class UserStore {
  private users: Map<string, string> = new Map();

  addUser(id: string, name: string): void {
    this.users.set(id, name);
  }

  findUserByEmail(email: string): string | undefined {
    for (const [id, name] of this.users) {
      if (name === email) { return id; }
    }
    return undefined;
  }
}
""",
    "README.md": "# Sample\n\nA sample project with retry helpers and a user store.\n",
}


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    for rel, text in SAMPLE.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root
