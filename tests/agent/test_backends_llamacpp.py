"""The llama.cpp backend: GGUF conversion, exact token ids and logprobs, speculation
that changes nothing but speed, prefix reuse, stop strings, cancellation.

The fast tests run a tiny random Llama with SmolLM2's tokenizer (2 layers, hidden 64,
float32 weights converted to an F32 GGUF), so llama.cpp and a transformers forward
pass compute the same function and their logprobs must agree to 1e-3: a wrong q/k
permutation, a tensor under the wrong name or an off-by-one between a token and the
logits it was sampled from shows up as a mismatch. The slow test runs the embedded
SmolLM2 (Q8_0).
"""

from __future__ import annotations

import asyncio
import math

import pytest
from opencomposer.agent.backends import make_model, parse_spec
from opencomposer.agent.backends._gguf import _permute, gguf_name, llama_shape
from opencomposer.agent.backends._local import kept_tokens
from opencomposer.agent.backends.llamacpp import LlamaCppModel, _Drafts, _Sampler, _Text
from opencomposer.agent.protocols import Message, Sampling

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make")

CODE = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(12))
COPY = [
    Message(role="user", content=f"Here is a file:\n{CODE}\nRepeat it exactly."),
    Message(role="assistant", content=CODE[:200]),
    Message(role="user", content="Go on."),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """A random Llama with SmolLM2's vocabulary and tokenizer, saved in float32."""
    import torch
    from opencomposer.agent.backends.smollm2 import gguf_path
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    source = gguf_path()
    tok = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # peaked distributions: greedy choices are not near-ties
        model.model.embed_tokens.weight.normal_(0, 1.0)
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def reference_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    import torch

    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


async def turn(model: LlamaCppModel, messages: list[Message], sampling: Sampling):
    stream = model.stream(messages, sampling)
    deltas = [d async for d in stream]
    assert stream.output is not None and "".join(deltas) == stream.output.text
    return stream.output


def test_spec_builds_a_lazy_llamacpp_model(tiny) -> None:
    folder, _ = tiny
    model = make_model(f"llamacpp:{folder}")
    assert isinstance(model, LlamaCppModel) and model._engine is None
    assert model.context_window == 2048
    assert parse_spec("llamacpp:smollm2") == ("llamacpp", "smollm2")
    with pytest.raises(ValueError, match="llamacpp: model folder not found"):
        make_model("llamacpp:/no/such/folder")


def test_tokens_and_logprobs_are_the_models_exactly(tiny, cache) -> None:
    folder, reference = tiny

    async def main() -> None:
        model = LlamaCppModel(folder, qtype="f32", draft=0, threads=1)
        try:
            out = await turn(model, COPY[:1], Sampling(temperature=0.8, max_tokens=24, seed=1))
        finally:
            await model.close()
        assert out.prompt_token_ids == model.tokenizer.prompt_ids(COPY[:1])
        ids = out.completion_token_ids
        assert ids and len(ids) == len(out.completion_logprobs) == out.completion_tokens
        text = model.tokenizer.hf.decode(ids, skip_special_tokens=True)
        assert text == out.text
        expected = reference_logprobs(reference, out.prompt_token_ids, ids)
        assert out.completion_logprobs == pytest.approx(expected, abs=1e-3)

    asyncio.run(main())


def test_alternatives_share_the_head_and_logprob_is_the_models(tiny, cache) -> None:
    # alternatives to a turn keep its text up to a cut (at a token boundary) and go on;
    # their ids and logprobs are the model's; `logprob` sums the model's log-probability
    # of a text after a context, as a transformers forward pass gives it
    folder, reference = tiny

    async def main() -> None:
        model = LlamaCppModel(folder, qtype="f32", draft=0, threads=1)
        try:
            out = await turn(model, COPY[:1], Sampling(temperature=0.8, max_tokens=24, seed=1))
            more = await model.alternatives(out, 12, 2, Sampling(temperature=1.0, max_tokens=16))
            tok = model.tokenizer.hf
            context, text = CODE[:300], "def g(x):\n    return x + 1\n"
            got = await model.logprob(context, text, context_tokens=40)
            again = await model.logprob(context, text, context_tokens=40)  # from the cache
        finally:
            await model.close()
        assert len(more) == 2
        kept = kept_tokens(tok.decode, out.completion_token_ids, out.text[:12])
        head = tok.decode(out.completion_token_ids[:kept])
        assert kept > 0 and out.text[:12].startswith(head)
        for alt in more:
            assert alt.completion_token_ids[:kept] == out.completion_token_ids[:kept]
            assert alt.text.startswith(head) and alt.completion_tokens > kept
            assert len(alt.completion_token_ids) == len(alt.completion_logprobs)
            assert alt.prompt_token_ids == out.prompt_token_ids
            expected = reference_logprobs(reference, out.prompt_token_ids, alt.completion_token_ids)
            assert alt.completion_logprobs == pytest.approx(expected, abs=1e-3)
        before = tok.encode(context, add_special_tokens=False)[-40:]
        body = tok.encode(text, add_special_tokens=False)
        assert got == pytest.approx(sum(reference_logprobs(reference, before, body)), abs=1e-2)
        assert again == pytest.approx(got, abs=1e-6)

    asyncio.run(main())


def test_speculation_changes_speed_only(tiny, cache) -> None:
    folder, reference = tiny

    async def main() -> None:
        plain = LlamaCppModel(folder, qtype="f32", draft=0, threads=1)
        fast = LlamaCppModel(folder, qtype="f32", draft=12, threads=1)
        try:
            for seed in (0, 1):
                sampling = Sampling(temperature=0.5, max_tokens=80, seed=seed)
                a = await turn(plain, COPY, sampling)
                b = await turn(fast, COPY, sampling)
                assert b.completion_token_ids == a.completion_token_ids and b.text == a.text
                assert b.completion_logprobs == pytest.approx(a.completion_logprobs, abs=1e-3)
                assert b.meta["draft_accepted"] > 0
                assert b.meta["decode_passes"] < a.meta["decode_passes"]
                expected = reference_logprobs(reference, b.prompt_token_ids, b.completion_token_ids)
                assert b.completion_logprobs == pytest.approx(expected, abs=1e-3)
        finally:
            await plain.close()
            await fast.close()

    asyncio.run(main())


def test_the_repairs_reads_leave_the_conversation_cached(tiny, cache) -> None:
    # top tokens, scores and greedy continuations run in sequences of their own: the
    # turn after them still reuses its prompt, and says what a fresh engine says
    folder, _ = tiny
    sampling = Sampling(temperature=0, max_tokens=16)

    async def main() -> None:
        model = LlamaCppModel(folder, qtype="f32", threads=1)
        fresh = LlamaCppModel(folder, qtype="f32", threads=1)
        try:
            first = await turn(model, COPY[:1], sampling)
            ids = model.tokenizer.encode(CODE[:400])
            await model.top_tokens(ids, 10, 4)
            await model.greedy([ids[:20], ids[:50]], 6, [-1, -1])
            await model.logprob(CODE[:100], CODE[100:200])
            history = [*COPY[:1], Message(role="assistant", content=first.text), COPY[2]]
            second = await turn(model, history, sampling)
            assert second.meta["prompt_reused_tokens"] >= len(first.prompt_token_ids) - 1
            alone = await turn(fresh, history, sampling)
            assert second.completion_token_ids == alone.completion_token_ids
        finally:
            await model.close()
            await fresh.close()

    asyncio.run(main())


def test_a_later_turn_reuses_the_cached_prefix(tiny, cache) -> None:
    folder, _ = tiny
    sampling = Sampling(temperature=0, max_tokens=16)

    async def main() -> None:
        model = LlamaCppModel(folder, qtype="f32", threads=1)
        fresh = LlamaCppModel(folder, qtype="f32", threads=1)
        try:
            first = await turn(model, COPY[:1], sampling)
            history = [*COPY[:1], Message(role="assistant", content=first.text), COPY[2]]
            second = await turn(model, history, sampling)
            # all of turn 1's prompt but maybe its last token ("assistant\n" + the reply
            # may tokenize the newline together with what follows)
            assert second.meta["prompt_reused_tokens"] >= len(first.prompt_token_ids) - 1
            alone = await turn(fresh, history, sampling)
            assert alone.meta["prompt_reused_tokens"] == 0
            assert second.completion_token_ids == alone.completion_token_ids
            assert second.completion_logprobs == pytest.approx(alone.completion_logprobs, abs=1e-3)
        finally:
            await model.close()
            await fresh.close()

    asyncio.run(main())


def test_stop_string_and_cancel(tiny, cache) -> None:
    folder, _ = tiny

    async def main() -> None:
        model = LlamaCppModel(folder, qtype="f32", threads=1)
        try:
            whole = await turn(model, COPY[:1], Sampling(temperature=0, max_tokens=40))
            assert len(whole.text) > 12
            stop = whole.text[5:9]
            cut = await turn(model, COPY[:1], Sampling(temperature=0, max_tokens=40, stop=(stop,)))
            assert cut.text == whole.text[: whole.text.index(stop)]
            assert cut.finish_reason == "stop" and cut.meta["stop_reason"] == stop

            stream = model.stream(COPY[:1], Sampling(temperature=0, max_tokens=1000))
            async for _ in stream:
                break
            await stream.aclose()
            assert stream.output is not None and stream.output.finish_reason == "cancelled"
            again = await turn(model, COPY[:1], Sampling(temperature=0, max_tokens=40))
            assert again.completion_token_ids == whole.completion_token_ids
        finally:
            await model.close()

    asyncio.run(main())


# -- the parts, without an engine -------------------------------------------------------


def test_text_holds_back_a_possible_stop_and_joins_split_characters() -> None:
    sent: list[str] = []
    text = _Text(("STOP",), sent.append)
    for piece in (b"ab", b"cS", b"T", "é".encode()[:1], "é".encode()[1:], b"xx"):
        assert not text.add(piece)
    assert "".join(sent) == "abcST"[: len("".join(sent))]
    assert text.add(b"STOP")
    text.flush()
    assert "".join(sent) == "abcSTéxx" and text.stop_reason == "STOP"


def test_top_tokens_and_greedy_are_the_models(tiny, cache) -> None:
    # what `agent/repair.py` reads: at each token, its logprob and the model's k likeliest
    # tokens there; greedy continuations that stop at the token asked for
    folder, reference = tiny
    import torch

    async def main() -> None:
        model = LlamaCppModel(folder, qtype="f32", draft=0, threads=1)
        tok = model.tokenizer
        ids = tok.encode(CODE[:200])
        try:
            rows = await model.top_tokens(ids, 5, 4)
            again = await model.top_tokens(ids, 5, 4)  # from the cache
            prefixes = [ids[:20], ids[:30]]
            free = await model.greedy(prefixes, 6, [-1, -1])
            until = await model.greedy(prefixes, 6, [free[0][2], -1])
        finally:
            await model.close()
        with torch.inference_mode():
            logp = torch.log_softmax(reference(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        assert len(rows) == len(ids) - 5 and rows == again
        for i, (here, top) in zip(range(5, len(ids)), rows, strict=True):
            assert here == pytest.approx(logp[i - 1, ids[i]].item(), abs=1e-3)
            values, best = logp[i - 1].topk(4)
            assert [t for t, _ in top] == best.tolist()
            assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-3)
        for prefix, got in zip(prefixes, free, strict=True):
            assert len(got) == 6
            with torch.inference_mode():
                out = reference.generate(torch.tensor([prefix]), max_new_tokens=6, do_sample=False)
            assert got == out[0, len(prefix) :].tolist()
        end = free[0][2]
        assert until == [free[0][: free[0].index(end) + 1], free[1]]

    asyncio.run(main())


def test_greedy_runs_prefixes_side_by_side_in_groups(tiny, cache, monkeypatch) -> None:
    # more prefixes than sequences: they are decoded in groups, each a sequence of the
    # cache sharing the cells before it, and sequence 0 (every turn's) is left holding
    # what it says it holds
    import torch
    from opencomposer.agent.backends import llamacpp

    folder, reference = tiny
    monkeypatch.setattr(llamacpp, "GREEDY_SEQS", 3)

    async def main():
        model = LlamaCppModel(folder, qtype="f32", draft=0, threads=1)
        ids = model.tokenizer.encode(CODE[:300])
        prefixes = [ids[:n] for n in (12, 30, 18, 41, 41, 25, 7)]
        try:
            before = await model.top_tokens(ids, 5, 3)
            got = await model.greedy(prefixes, 5, [-1] * len(prefixes))
            after = await model.top_tokens(ids, 5, 3)
        finally:
            await model.close()
        return before, got, after, prefixes

    before, got, after, prefixes = asyncio.run(main())
    assert after == before
    for prefix, tokens in zip(prefixes, got, strict=True):
        with torch.inference_mode():
            out = reference.generate(torch.tensor([prefix]), max_new_tokens=5, do_sample=False)
        assert tokens == out[0, len(prefix) :].tolist()


def test_sampler_top_p_and_raw_logprobs() -> None:
    import numpy as np

    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    logits = np.concatenate([logits, np.full(100, -30, dtype=np.float32)])
    greedy = _Sampler(Sampling(temperature=0))
    assert greedy.sample(logits) == (0, pytest.approx(math.log(0.5), abs=1e-5))
    top = _Sampler(Sampling(temperature=1.0, top_p=0.7, seed=0))
    drawn = {top.sample(logits)[0] for _ in range(200)}
    assert drawn == {0, 1}  # 0.5 < 0.7 <= 0.8: the second token stays, the third does not
    wide = _Sampler(Sampling(temperature=1.0, top_p=1.0, seed=0))
    counts = np.bincount([wide.sample(logits)[0] for _ in range(2000)], minlength=4)[:4]
    assert counts / 2000 == pytest.approx([0.5, 0.3, 0.15, 0.05], abs=0.04)


def test_sampler_top_p_past_the_rounded_mass() -> None:
    # a vocabulary of 49,152: the float32 running sum ends short of the total, so no
    # prefix reaches a top_p of 1 (or just under); the sample comes from the whole
    import numpy as np

    logits = np.random.default_rng(0).normal(0, 2, 49_152).astype(np.float32)
    for top_p in (1.0, 1.0 - 1e-9):
        sampler = _Sampler(Sampling(temperature=0.8, top_p=top_p, seed=1))
        tokens = [sampler.sample(logits)[0] for _ in range(20)]
        assert all(0 <= t < 49_152 for t in tokens) and len(set(tokens)) > 15


def test_drafts_propose_what_followed_the_last_ngram() -> None:
    drafts = _Drafts([1, 2, 3, 4, 5, 6, 9])
    assert drafts.propose([], 3) == []  # (6, 9) and 9 never occurred before
    assert drafts.propose([2, 3], 3) == [4, 5, 6]
    assert drafts.propose([2, 3, 4, 5], 10) == [6, 9, 2, 3, 4, 5]
    assert drafts.propose([2, 3, 4, 5, 7], 3) == []


def test_gguf_names_and_rotary_permutation() -> None:
    import numpy as np

    assert gguf_name("model.layers.3.self_attn.q_proj.weight") == "blk.3.attn_q.weight"
    assert gguf_name("model.layers.0.mlp.down_proj.weight") == "blk.0.ffn_down.weight"
    assert gguf_name("lm_head.weight") is None
    assert gguf_name("lm_head.weight", tied=False) == "output.weight"
    with pytest.raises(ValueError, match="unexpected tensor"):
        gguf_name("model.layers.0.self_attn.rotary_emb.inv_freq")
    # One head of dim 4: rows (x0, x1 | y0, y1) become interleaved pairs (x0, y0, x1, y1).
    w = np.arange(4)[:, None] * np.ones((1, 2))
    assert _permute(w, 1)[:, 0].tolist() == [0, 2, 1, 3]
    with pytest.raises(ValueError, match="vocab_size is 32000"):
        llama_shape({"model_type": "llama", "vocab_size": 32000}, 49152)
    with pytest.raises(ValueError, match="model_type is 'qwen2'"):
        llama_shape({"model_type": "qwen2", "vocab_size": 49152}, 49152)


@pytest.mark.slow
def test_embedded_model_answers_and_matches_transformers() -> None:
    """SmolLM2 on its Q8_0 GGUF: the right answer, ids that decode to the text, and
    logprobs close to the bf16 model's (up to Q8_0's rounding)."""
    import torch
    from transformers import AutoModelForCausalLM

    question = [Message(role="user", content="What is the capital of France?")]

    async def main():
        model = make_model("llamacpp:smollm2")
        try:
            return model, await turn(model, question, Sampling(temperature=0, max_tokens=16))
        finally:
            await model.close()

    model, out = asyncio.run(main())
    assert "Paris" in out.text, out.text
    assert out.prompt_token_ids == model.tokenizer.prompt_ids(question)
    assert model.tokenizer.hf.decode(out.completion_token_ids, skip_special_tokens=True) == out.text
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.bfloat16)
    expected = reference_logprobs(hf, out.prompt_token_ids, out.completion_token_ids)
    # Q8_0 rounds every weight: measured 0.26 at most here (a -2.0 first token), 0.2 is
    # what vLLM's bf16 kernels get; on average they must stay far closer
    assert out.completion_logprobs == pytest.approx(expected, abs=0.4)
    gaps = [abs(a - b) for a, b in zip(out.completion_logprobs, expected, strict=True)]
    assert sum(gaps) / len(gaps) < 0.1


def test_a_lora_checkpoint_converts_its_model_weights_not_its_adapter(tmp_path):
    """A LoRA run's checkpoint holds the merged model and, beside it, the adapter
    (`adapter.safetensors`); the GGUF is made from the model's files only."""
    from opencomposer.agent.backends._gguf import model_weights

    for name in ("model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "adapter.safetensors").write_bytes(b"")
    assert [p.name for p in model_weights(tmp_path)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_the_embedded_model_runs_a_batch_on_this_cpu() -> None:
    """On a CPU with AMX, llama.cpp's AMX buffer type crashed the process (SIGSEGV in
    `ggml_backend_amx_mul_mat`) on the embedded Q8_0 model's first batch; the engine
    keeps the weights out of it there. A child process runs the batch, so a crash is
    this test's failure, not the end of the suite."""
    import subprocess
    import sys

    code = (
        "from opencomposer.agent.backends.llamacpp import _Engine\n"
        "from opencomposer.agent.backends.smollm2 import gguf_path\n"
        "e = _Engine(gguf_path(), 1024, 1, set())\n"
        "e.llama.eval(e.llama.tokenize(b'def f(x):\\n    return x + 1\\n' * 20))\n"
        "print('evaluated', e.llama.n_tokens)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "evaluated" in r.stdout, (r.returncode, r.stderr[-800:])


@pytest.mark.parametrize("vocab", [5, 64, 1000, 49152])
def test_top_finds_the_likeliest_tokens_by_block(vocab) -> None:
    # `_top` sorts only the vocabulary blocks that can hold the k likeliest tokens;
    # it must agree with a full sort, for a vocabulary of any size
    import numpy as np
    from opencomposer.agent.backends.llamacpp import _top

    rng = np.random.default_rng(vocab)
    rows = (rng.standard_normal((7, vocab)) * 4).astype(np.float32)
    targets = rng.integers(0, vocab, 7).tolist()
    exact = rows.astype(np.float64)
    exact -= np.log(np.exp(exact).sum(axis=1, keepdims=True))
    for k in (0, 1, 4, 8):
        got = _top(rows, targets, k)
        for r, (here, top) in enumerate(got):
            assert here == pytest.approx(exact[r, targets[r]], abs=1e-4)
            assert [t for t, _ in top] == np.argsort(-exact[r])[: min(k, vocab)].tolist()
            assert [lp for _, lp in top] == pytest.approx(
                np.sort(exact[r])[::-1][: len(top)], abs=1e-4
            )
