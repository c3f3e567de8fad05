"""`make_model` / `parse_spec`: every spec form, one-line errors, lazy heavy imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from opencomposer.agent.backends import make_model, parse_spec
from opencomposer.agent.backends.hf import HFModel
from opencomposer.agent.backends.openai import OpenAIModel
from opencomposer.agent.backends.scripted import ScriptedModel
from opencomposer.agent.protocols import Model


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "turns.json"
    path.write_text(json.dumps({"turns": ["hello"], "chars_per_second": 0}))
    return path


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("", "unknown model spec"),
        ("gpt4", "unknown model spec"),
        ("llama:foo", "unknown model spec"),
        ("vllm:", "lacks its argument"),
        ("hf:/no/such/folder", "model folder not found"),
        ("openai:ftp://host/v1#m", "openai:http(s)://"),
        ("openai:http://host/v1", "openai:http(s)://"),
        ("openai:http://host/v1#", "openai:http(s)://"),
        ("scripted:/no/such/file.json", "scripted model file not found"),
    ],
)
def test_bad_spec_is_one_clear_line(spec: str, words: str) -> None:
    with pytest.raises(ValueError) as info:
        make_model(spec)
    message = str(info.value)
    assert words in message
    assert "\n" not in message


def test_parse_spec_splits_at_the_first_colon() -> None:
    assert parse_spec("smollm2") == ("smollm2", "")
    assert parse_spec("openai:http://127.0.0.1:8000/v1#qwen") == (
        "openai",
        "http://127.0.0.1:8000/v1#qwen",
    )
    assert parse_spec("vllm:Qwen/Qwen2.5-0.5B") == ("vllm", "Qwen/Qwen2.5-0.5B")


def test_scripted_spec_builds_a_model(script: Path) -> None:
    model = make_model(f"scripted:{script}")
    assert isinstance(model, ScriptedModel)
    assert isinstance(model, Model)
    assert model.turns == ["hello"]


@pytest.mark.parametrize(
    "content",
    ["not json", json.dumps({"turns": "abc"}), json.dumps({"turns": [1]}), json.dumps([])],
)
def test_malformed_script_is_one_line(tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        make_model(f"scripted:{path}")
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_openai_spec_builds_the_endpoint_url() -> None:
    model = make_model("openai:http://127.0.0.1:9/v1#tiny")
    assert isinstance(model, OpenAIModel) and isinstance(model, Model)
    assert model.url == "http://127.0.0.1:9/v1/chat/completions"
    assert model.model == "tiny"


def test_hf_spec_is_lazy_and_reads_the_context_window(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    model = make_model(f"hf:{tmp_path}")
    assert isinstance(model, HFModel) and isinstance(model, Model)
    assert model.context_window == 2048
    assert model._model is None  # nothing loaded until the first turn


def test_importing_backends_pulls_in_no_heavy_library() -> None:
    # Guards `opencomposer --help` and the LSP handshake against a stray top-level import.
    code = (
        "import sys, opencomposer.agent.backends as b; "
        "b.parse_spec('smollm2'); "
        "print(sorted(m for m in ('torch', 'vllm', 'transformers', 'httpx') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
