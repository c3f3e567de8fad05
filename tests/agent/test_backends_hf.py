"""The `hf:` backend on the converted SmolLM2: a real generation whose token ids and
logprobs agree with the tokenizer and with a teacher-forced forward pass (slow)."""

from __future__ import annotations

import time

import pytest
from opencomposer.agent.backends import make_model
from opencomposer.agent.backends.hf import HFModel
from opencomposer.agent.protocols import Message, Sampling

pytestmark = pytest.mark.slow

QUESTION = [Message(role="user", content="What is the capital of France?")]


def teacher_forced_logprobs(
    model: HFModel, prompt: list[int], completion: list[int]
) -> list[float]:
    import torch

    with torch.inference_mode():
        logits = model._model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)  # [positions, vocab]
    start = len(prompt) - 1
    return [logprobs[start + i, t].item() for i, t in enumerate(completion)]


async def test_hf_generates_with_consistent_ids_and_logprobs() -> None:
    model = make_model("hf:smollm2")
    assert isinstance(model, HFModel) and model.context_window == 8192
    try:
        stream = model.stream(QUESTION, Sampling(temperature=0, max_tokens=12))
        deltas = [d async for d in stream]
        out = stream.output
        assert out is not None and "Paris" in out.text
        assert "".join(deltas) == out.text
        tok = model.tokenizer.hf
        assert out.prompt_token_ids == model.tokenizer.prompt_ids(QUESTION)
        assert out.prompt_tokens == len(out.prompt_token_ids)
        ids = out.completion_token_ids
        assert ids and len(ids) == len(out.completion_logprobs) == out.completion_tokens
        assert tok.decode(ids, skip_special_tokens=True) == out.text
        reference = teacher_forced_logprobs(model, out.prompt_token_ids, ids)
        assert out.completion_logprobs == pytest.approx(reference, abs=0.15)
        assert model.count_tokens("The capital of France") == len(
            tok.encode("The capital of France", add_special_tokens=False)
        )

        long = model.stream(QUESTION, Sampling(temperature=1.0, max_tokens=500, seed=1))
        got = []
        async for delta in long:
            got.append(delta)
            if len(got) == 3:
                start = time.monotonic()
                await long.aclose()
        assert time.monotonic() - start < 5.0
        assert long.output.finish_reason == "cancelled"
        assert long.output.completion_tokens < 50
    finally:
        await model.close()
