"""Fixtures shared across the test folders: a tiny real sentence-transformers model.

The tiny model is a 2-layer BERT with random weights and MiniLM's tokenizer,
saved as a normal sentence-transformers folder: it loads in a fraction of the
time MiniLM takes, so the fast tests drive the real embedding path (folder
setting, batching, FAISS) without judging semantic quality. Relevance with the
real MiniLM is tested under `-m slow` (tests/index).
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
