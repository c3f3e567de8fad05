"""The embedded model folds the shipped LoRA adapter in: `smollm2` is the trained
policy when an adapter ships, `smollm2-base` (base=True) the untrained model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from opencomposer.agent.backends import smollm2
from opencomposer.agent.backends.adapter import AdapterError, fingerprint
from safetensors.torch import load_file, save_file

LAYER = "model.layers.0.self_attn.q_proj"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache whose base folder is the real converted model (linked, not copied)."""
    real = smollm2.smollm2_path(base=True)
    root = tmp_path / "xdg"
    (root / "opencomposer" / "models").mkdir(parents=True)
    (root / "opencomposer" / "models" / smollm2.FOLDER_NAME).symlink_to(real)
    monkeypatch.setenv("XDG_CACHE_HOME", str(root))
    return real


def _adapter(folder, base_state, *, fp: str | None = None):
    g = torch.Generator().manual_seed(0)
    w = base_state[f"{LAYER}.weight"]
    a = torch.randn(4, w.shape[1], generator=g) * 0.1
    b = torch.randn(w.shape[0], 4, generator=g) * 0.1
    folder.mkdir(parents=True)
    save_file({f"{LAYER}.lora_a": a, f"{LAYER}.lora_b": b}, str(folder / "adapter.safetensors"))
    meta = {
        "rank": 4,
        "alpha": 8.0,
        "base_fingerprint": fp or fingerprint(base_state, [f"{LAYER}.weight"]),
    }
    (folder / "adapter.json").write_text(json.dumps(meta))
    return a, b


def _state(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_without_an_adapter_smollm2_is_the_base(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "ADAPTER_DIR", tmp_path / "none")
    assert smollm2.smollm2_path().resolve() == cache.resolve()
    assert smollm2.shipped_adapter() is None


def test_the_shipped_adapter_is_folded_in_and_base_stays_untrained(cache, tmp_path, monkeypatch):
    base_state = _state(cache)
    a, b = _adapter(tmp_path / "adapter", base_state)
    monkeypatch.setattr(smollm2, "ADAPTER_DIR", tmp_path / "adapter")
    trained = smollm2.smollm2_path()
    assert trained != smollm2.smollm2_path(base=True)
    assert (trained / "tokenizer.json").is_file() and (trained / "config.json").is_file()
    merged = _state(trained)
    assert set(merged) == set(base_state)
    want = (base_state[f"{LAYER}.weight"].float() + (b @ a) * 2.0).to(torch.bfloat16)
    assert torch.equal(merged[f"{LAYER}.weight"], want)
    untouched = [k for k in base_state if k != f"{LAYER}.weight"]
    assert all(torch.equal(merged[k], base_state[k]) for k in untouched)
    assert smollm2.smollm2_path() == trained  # cached


def test_an_adapter_for_other_weights_is_refused(cache, tmp_path, monkeypatch):
    _adapter(tmp_path / "adapter", _state(cache), fp="0" * 16)
    monkeypatch.setattr(smollm2, "ADAPTER_DIR", tmp_path / "adapter")
    with pytest.raises(AdapterError, match="other base weights"):
        smollm2.smollm2_path()


def test_the_base_spec_names_the_untrained_folder(cache, tmp_path, monkeypatch):
    from opencomposer.agent.backends import make_model, parse_spec

    assert parse_spec("smollm2-base") == ("smollm2", "smollm2-base")
    assert parse_spec("hf:smollm2-base") == ("hf", "smollm2-base")
    _adapter(tmp_path / "adapter", _state(cache))
    monkeypatch.setattr(smollm2, "ADAPTER_DIR", tmp_path / "adapter")
    base = make_model("hf:smollm2-base")
    trained = make_model("hf:smollm2")
    assert Path(base.path).resolve() == cache.resolve()
    assert Path(trained.path) == smollm2.smollm2_path() != Path(base.path)
    assert base.prompt_style == trained.prompt_style == "compact"
