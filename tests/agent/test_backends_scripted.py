"""The `scripted:` test double: turn selection, pacing, failure, cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest
from opencomposer.agent.backends.scripted import ScriptedModel
from opencomposer.agent.protocols import Message, ModelError, ModelStream, Sampling

USER = Message(role="user", content="fix the bug")


def convo(assistant_turns: int) -> list[Message]:
    messages = [Message(role="system", content="sys"), USER]
    for i in range(assistant_turns):
        messages += [
            Message(role="assistant", content=f"turn {i}"),
            Message(role="user", content="<tool_result/>", kind="tool_results"),
        ]
    return messages


async def play(stream: ModelStream) -> list[str]:
    return [delta async for delta in stream]


async def test_turn_is_the_number_of_assistant_messages() -> None:
    model = ScriptedModel(["first", "second"])
    for n, expected in [(0, "first"), (1, "second"), (2, ""), (5, "")]:
        stream = model.stream(convo(n), Sampling())
        assert "".join(await play(stream)) == expected
        assert stream.output is not None
        assert stream.output.text == expected and stream.output.finish_reason == "stop"


async def test_each_session_starts_from_the_first_turn() -> None:
    model = ScriptedModel(["first", "second"])
    for _ in range(2):  # stateless: a new session replays from the start
        stream = model.stream([USER], Sampling())
        assert "".join(await play(stream)) == "first"


async def test_paced_stream_takes_len_over_rate_and_starts_at_once() -> None:
    model = ScriptedModel(["x" * 300], chars_per_second=300)
    stream = model.stream([USER], Sampling())
    start = time.monotonic()
    arrivals = []
    async for delta in stream:
        arrivals.append((time.monotonic() - start, delta))
    total = time.monotonic() - start
    assert "".join(d for _, d in arrivals) == "x" * 300
    assert len(arrivals) >= 20  # small chunks, not one blob
    assert arrivals[0][0] < 0.3
    assert total >= 0.95  # sleeps never end early; the upper bound is generous for busy CI
    assert total < 3.0


async def test_slow_consumer_does_not_slow_the_stream() -> None:
    model = ScriptedModel(["y" * 100], chars_per_second=200)  # 0.5 s of text
    stream = model.stream([USER], Sampling())
    got = []
    woke = 0.0
    async for delta in stream:
        got.append(delta)
        if len(got) == 1:
            await asyncio.sleep(1.0)  # the producer keeps going meanwhile
            woke = time.monotonic()
    assert "".join(got) == "y" * 100
    assert time.monotonic() - woke < 0.3  # the rest was already queued, not paced anew


async def test_token_counts_are_reported() -> None:
    model = ScriptedModel(["a" * 40])
    stream = model.stream([Message(role="user", content="b" * 20)], Sampling())
    await play(stream)
    out = stream.output
    assert out is not None
    assert out.completion_tokens == 10 and out.prompt_tokens == 5
    assert out.completion_token_ids is None and out.prompt_token_ids is None
    assert model.count_tokens("abcdefgh") == 2


async def test_fail_after_chars_raises_model_error_mid_stream() -> None:
    model = ScriptedModel(["z" * 100], chars_per_second=1000, fail_after_chars=30)
    stream = model.stream([USER], Sampling())
    got: list[str] = []
    with pytest.raises(ModelError, match="after 30 characters"):
        async for delta in stream:
            got.append(delta)
    assert "".join(got) == "z" * 30
    assert stream.output is not None and stream.output.finish_reason == "error"
    assert stream.output.text == "z" * 30


async def test_aclose_from_another_task_ends_the_stream_at_once() -> None:
    model = ScriptedModel(["w" * 1000], chars_per_second=20)  # 50 s if not cancelled
    stream = model.stream([USER], Sampling())
    got: list[str] = []

    async def consume() -> None:
        async for delta in stream:
            got.append(delta)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.3)
    start = time.monotonic()
    await stream.aclose()
    await asyncio.wait_for(task, 1.0)
    assert time.monotonic() - start < 0.5
    assert stream.output is not None and stream.output.finish_reason == "cancelled"
    assert 0 < len(stream.output.text) < 1000 and stream.output.text == "".join(got)
    await stream.aclose()  # twice is fine


async def test_aclose_before_iterating() -> None:
    stream = ScriptedModel(["never"]).stream([USER], Sampling())
    await stream.aclose()
    assert await play(stream) == []
    assert stream.output is not None and stream.output.finish_reason == "cancelled"


async def test_breaking_out_stops_the_producer() -> None:
    model = ScriptedModel(["v" * 1000], chars_per_second=100)
    stream = model.stream([USER], Sampling())
    async for _ in stream:
        break
    await asyncio.sleep(0.1)
    assert stream.output is not None and stream.output.finish_reason == "cancelled"


async def test_many_sessions_share_one_model() -> None:
    model = ScriptedModel(["abc" * 20], chars_per_second=600)
    streams = [model.stream([USER], Sampling()) for _ in range(8)]
    start = time.monotonic()
    texts = await asyncio.gather(*(play(s) for s in streams))
    assert all("".join(t) == "abc" * 20 for t in texts)
    assert time.monotonic() - start < 0.6  # concurrent: 0.1 s each, not 0.8 s in a row


async def test_a_turn_can_answer_what_the_conversation_shows() -> None:
    """In code a turn may be a function of the conversation so far (a scripted player
    that says what a tool result showed); it is called when the turn is played."""
    seen: list[int] = []

    def reply(messages: list[Message]) -> str:
        seen.append(len(messages))
        return f"saw {messages[-1].content}"

    model = ScriptedModel(["first", reply])
    assert await play(model.stream(convo(0), Sampling())) == ["first"]
    assert await play(model.stream(convo(1), Sampling())) == ["saw <tool_result/>"]
    assert seen == [4]
