"""vLLM in-process on the embedded SmolLM2 (slow: the engine start takes ~25 s idle,
minutes on a loaded 2-core machine, so one engine serves every check here).

Guards: token ids and logprobs that match the tokenizer and a transformers forward
pass; concurrent sessions on one engine; `aclose()` aborting in the engine; an
in-place weight reload that changes the outputs and the recorded `weight_version`;
nothing written to stdout by the engine's processes; a close without a traceback.
"""

from __future__ import annotations

import asyncio
import math

import pytest
from opencomposer.agent.backends import make_model
from opencomposer.agent.backends._local import kept_tokens
from opencomposer.agent.backends.vllm import VLLMModel
from opencomposer.agent.protocols import Message, Sampling

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

QUESTION = [Message(role="user", content="What is the capital of France?")]
GREEDY = Sampling(temperature=0, max_tokens=16)


async def generate(model: VLLMModel, messages=QUESTION, sampling=GREEDY):
    stream = model.stream(messages, sampling)
    deltas = [d async for d in stream]
    assert stream.output is not None and "".join(deltas) == stream.output.text
    return stream.output


def reference_logprobs(folder: str, prompt: list[int], completion: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


async def test_vllm_engine_end_to_end(capfd: pytest.CaptureFixture[str]) -> None:
    model = make_model("vllm:smollm2")
    assert isinstance(model, VLLMModel) and model.context_window == 8192
    try:
        # A greedy turn: text, ids and logprobs agree with the tokenizer and transformers.
        out = await generate(model)
        assert "Paris" in out.text, out.text
        assert out.finish_reason == "stop" and out.weight_version == 0
        tok = model.tokenizer.hf
        assert out.prompt_token_ids == model.tokenizer.prompt_ids(QUESTION)
        ids = out.completion_token_ids
        assert ids and len(ids) == len(out.completion_logprobs) == out.completion_tokens
        assert tok.decode(ids, skip_special_tokens=True) == out.text
        reference = reference_logprobs(model.path, out.prompt_token_ids, ids)
        assert out.completion_logprobs == pytest.approx(reference, abs=0.2)

        # Alternatives keep the turn's head and go on; `logprob` is the model's.
        more = await model.alternatives(out, 4, 3, Sampling(temperature=1.0, max_tokens=16))
        kept = kept_tokens(tok.decode, ids, out.text[:4])
        assert len(more) == 3 and all(m.completion_token_ids[:kept] == ids[:kept] for m in more)
        assert all(len(m.completion_token_ids) == len(m.completion_logprobs) for m in more)
        context, text = "The capital of France is", " Paris."
        body = tok.encode(text, add_special_tokens=False)
        got = await model.logprob(context, text)
        prompt = tok.encode(context, add_special_tokens=False)
        assert got == pytest.approx(sum(reference_logprobs(model.path, prompt, body)), abs=0.3)
        assert got > await model.logprob(context, " Berlin.")

        # What a repair reads (`agent/repair.py`): each token's logprob and the likeliest
        # tokens there, and greedy continuations that stop at the token asked for.
        rows = await model.top_tokens(prompt + body, len(prompt), 5)
        assert len(rows) == len(body) and sum(h for h, _ in rows) == pytest.approx(got, abs=0.05)
        for here, top in rows:  # the likeliest first, none less likely than a token not in it
            values = [lp for _, lp in top]
            assert len(top) == 5 and values == sorted(values, reverse=True)
            assert here <= values[0] + 1e-3
        first = rows[0][1][0][0]  # the likeliest token after the context
        free, until = (
            await model.greedy([prompt], 4, [-1]),
            await model.greedy([prompt], 4, [first]),
        )
        assert free[0][0] == first and len(free[0]) == 4 and until == [[first]]

        # A variant of a long text reads what it shares with it from the prefix cache
        # and is still scored from where it differs; a text scored again, all of it
        # cached, is scored in full once more.
        code = "".join(f"item_{i} = compute({i}, {i * 7 % 13})\n" for i in range(80))
        long = tok.encode(code, add_special_tokens=False)[:420]
        whole = await model.top_tokens(long, 1, 1)
        variant = [*long[:300], long[310], *long[301:380]]
        scored = [h for h, _ in await model.top_tokens(variant, 300, 1)]
        reference = reference_logprobs(model.path, variant[:300], variant[300:])
        assert len(scored) == len(reference) and all(h > -math.inf for h in scored)
        assert sum(scored) == pytest.approx(sum(reference), rel=0.05, abs=1.0)
        again = await model.top_tokens(long, 1, 1)
        assert len(again) == len(whole) == len(long) - 1
        assert sum(h for h, _ in again) == pytest.approx(sum(h for h, _ in whole), rel=0.05)

        # Eight sessions at once on the one engine.
        prompts = [[Message(role="user", content=f"Count from 1 to {n}.")] for n in range(5, 13)]
        outs = await asyncio.gather(
            *(
                generate(model, p, Sampling(temperature=0.8, max_tokens=24, seed=i))
                for i, p in enumerate(prompts)
            )
        )
        assert all(o.completion_token_ids and o.text for o in outs)

        # Cancellation aborts the request inside the engine.
        stream = model.stream(QUESTION, Sampling(temperature=1.0, max_tokens=1000, seed=7))
        got = []
        async for delta in stream:
            got.append(delta)
            if len(got) == 3:
                await stream.aclose()
        assert stream.output.finish_reason == "cancelled"
        assert stream.output.completion_tokens < 100
        await asyncio.sleep(0.5)
        assert model._engine.get_num_unfinished_requests() == 0

        # Weight sync: damaged weights change the greedy answer and the version ...
        from safetensors.torch import load_file

        original = load_file(f"{model.path}/model.safetensors")
        damaged = {k: (v * 0.3 if ".mlp." in k else v) for k, v in original.items()}
        await model.reload_weights(damaged.items(), version=1)
        after = await generate(model)
        assert after.weight_version == 1
        assert after.completion_token_ids != ids
        # ... and reloading the original folder restores it exactly.
        await model.reload_weights(model.path, version=2)
        restored = await generate(model)
        assert restored.weight_version == 2
        assert restored.completion_token_ids == ids
    finally:
        await model.close()
    # stdout carries the LSP protocol and `ask --json`: the engine processes (which
    # inherit file descriptor 1) must write nothing there.
    out, err = capfd.readouterr()
    assert out == ""
    # a normal close is quiet: no engine-death error from vLLM's output handler
    assert "EngineDeadError" not in err and "Traceback" not in err, err[-2000:]
