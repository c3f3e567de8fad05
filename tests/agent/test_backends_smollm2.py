"""The embedded model's one-time GGUF conversion: locking and atomicity (fast, with a
stand-in converter) and the real converted folder (slow the first time)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from opencomposer.agent.backends import smollm2


@pytest.fixture
def fake_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # the conversion alone: no shipped adapter folded into the stand-in folder
    monkeypatch.setattr(smollm2, "ADAPTER_DIR", tmp_path / "no-adapter")
    return tmp_path / "opencomposer" / "models" / smollm2.FOLDER_NAME


def test_gguf_is_found_in_the_installed_wheel() -> None:
    path = smollm2.gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50e6


def test_two_concurrent_callers_convert_once(fake_cache: Path, monkeypatch) -> None:
    calls = []

    def slow_convert(source: Path, out: Path) -> None:
        calls.append(out)
        time.sleep(0.3)
        (out / "config.json").write_text("{}")
        (out / smollm2._MARKER).write_text(json.dumps({"format_version": smollm2.FORMAT_VERSION}))

    monkeypatch.setattr(smollm2, "_convert", slow_convert)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(smollm2.smollm2_path())) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [fake_cache] * 3
    assert (fake_cache / "config.json").exists()
    leftovers = [p.name for p in fake_cache.parent.iterdir() if p.name.startswith(".smollm2")]
    assert leftovers == [f".{smollm2.FOLDER_NAME}.lock"]  # no temporary folder left


def test_failed_conversion_leaves_nothing_behind(fake_cache: Path, monkeypatch) -> None:
    def broken(source: Path, out: Path) -> None:
        (out / "model.safetensors").write_text("half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(smollm2, "_convert", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        smollm2.smollm2_path()
    assert not fake_cache.exists()
    assert [p.name for p in fake_cache.parent.iterdir()] == [f".{smollm2.FOLDER_NAME}.lock"]


def test_stale_folder_from_an_older_format_is_rebuilt(fake_cache: Path, monkeypatch) -> None:
    fake_cache.mkdir(parents=True)
    (fake_cache / "model.safetensors").write_text("old")  # no marker: incomplete or stale

    def convert(source: Path, out: Path) -> None:
        (out / smollm2._MARKER).write_text(json.dumps({"format_version": smollm2.FORMAT_VERSION}))

    monkeypatch.setattr(smollm2, "_convert", convert)
    assert smollm2.smollm2_path() == fake_cache
    assert not (fake_cache / "model.safetensors").exists()


@pytest.mark.slow
def test_real_conversion_gives_a_complete_hf_folder() -> None:
    folder = smollm2.smollm2_path(base=True)  # converts on first use, then cached
    stamp = (folder / "model.safetensors").stat().st_mtime
    assert smollm2.smollm2_path(base=True) == folder
    assert (folder / "model.safetensors").stat().st_mtime == stamp  # not converted again
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["vocab_size"] == 49152 and config["max_position_embeddings"] == 8192
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2


def test_tokenizer_loads_as_auto_tokenizer_does(tmp_path: Path) -> None:
    # `_local.load_tokenizer` skips AutoTokenizer's imports for the plain fast
    # tokenizer; it must give the very tokenizer AutoTokenizer does, and fall back to
    # AutoTokenizer for a folder that names another class
    from opencomposer.agent.backends._local import load_tokenizer
    from transformers import AutoTokenizer

    folder = smollm2.smollm2_path(base=True)
    fast, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(fast) is type(auto)
    text = Path(__file__).read_text() + " héllo \t\n  𝔘 <|im_end|>"
    assert fast.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False)  # fmt: skip
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    assert fast.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)  # fmt: skip
    assert fast.all_special_ids == auto.all_special_ids and fast.get_vocab() == auto.get_vocab()

    other = tmp_path / "other"
    other.mkdir()
    for name in ("tokenizer.json", "special_tokens_map.json", "chat_template.jinja"):
        if (folder / name).is_file():
            (other / name).write_bytes((folder / name).read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "GPT2Tokenizer"}))  # fmt: skip
    assert load_tokenizer(other).encode("x = 1") == AutoTokenizer.from_pretrained(other).encode("x = 1")  # fmt: skip
