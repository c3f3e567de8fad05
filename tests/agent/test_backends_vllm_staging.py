"""How `VLLMModel.reload_weights` hands weights to the engine, without an engine:
tensors become one safetensors file in a staging folder (tied tensors included),
folders pass through, and the staging folder never outlives the reload."""

from __future__ import annotations

from pathlib import Path

import pytest
from opencomposer.agent.backends.vllm import VLLMModel
from opencomposer.agent.protocols import ModelError


def test_tensors_are_staged_and_the_staging_is_dropped(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    model = VLLMModel(tmp_path)
    embed = torch.ones(4, 2)
    weights = [("model.embed_tokens.weight", embed), ("lm_head.weight", embed)]  # tied
    folder = model._weights_folder(weights)
    loaded = load_file(str(folder / "model.safetensors"))
    assert set(loaded) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert torch.equal(loaded["lm_head.weight"], embed)
    model._drop_staging()
    assert not folder.exists()


def test_folders_pass_through_and_single_files_are_linked(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x")
    model = VLLMModel(tmp_path)
    assert model._weights_folder(tmp_path) == tmp_path.resolve()
    folder = model._weights_folder(tmp_path / "model.safetensors")
    assert (folder / "model.safetensors").resolve() == (tmp_path / "model.safetensors").resolve()
    model._drop_staging()
    assert not folder.exists() and (tmp_path / "model.safetensors").exists()


def test_missing_weights_are_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no .safetensors weights"):
        VLLMModel(tmp_path)._weights_folder(tmp_path / "nothing")
