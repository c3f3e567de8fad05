"""Fixtures for the index tests: a tiny real sentence-transformers model and workspaces.

The tiny model is a 2-layer BERT with random weights and MiniLM's tokenizer,
saved as a normal sentence-transformers folder: it loads in a fraction of the
time MiniLM takes, so the fast tests drive the real embedding path (folder
setting, batching, FAISS) without judging semantic quality. Relevance with the
real MiniLM is tested under `-m slow`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from opencomposer.index.embed import default_model_folder


@pytest.fixture(scope="session")
def tiny_embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    src = default_model_folder()
    dest = tmp_path_factory.mktemp("tiny-embedder")
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):  # fmt: skip
        if (src / name).exists():
            shutil.copy(src / name, dest / name)
    shutil.copytree(src / "1_Pooling", dest / "1_Pooling")
    pooling = json.loads((dest / "1_Pooling" / "config.json").read_text())
    pooling["word_embedding_dimension"] = 32
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=512)  # fmt: skip
    BertModel(config).save_pretrained(dest)
    return dest


@pytest.fixture
def embedder_env(tiny_embedder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("OPENCOMPOSER_EMBEDDER", str(tiny_embedder))
    monkeypatch.setenv("OPENCOMPOSER_EMBED_DTYPE", "fp32")
    return tiny_embedder


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
