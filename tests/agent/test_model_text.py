"""Text that UTF-8 cannot carry (lone UTF-16 surrogates) is mended where it enters the
system (the backend stream, the session's query), so a session with such a reply or
request still runs its calls, writes its trace and completes."""

from __future__ import annotations

import json

from opencomposer.agent.backends._stream import TaskStream
from opencomposer.agent.session import Session, SessionConfig
from opencomposer.agent.text import valid_text
from opencomposer.tools.workspace import LocalWorkspace

from tests.agent.conftest import scripted


async def test_a_reply_with_lone_surrogates_completes_and_is_traced(repo, store):
    """Guards the lone surrogate in a model reply that ended the session with `error`
    (the trace store could not encode it)."""
    turns = (
        'Writing \ud800 now.\n<write_file path="out.txt"><content>a\udfffb</content></write_file>'
        '\n<grep pattern="x\udc00"/>',
        "done \ud83d",
    )
    session = Session(
        model=scripted(*turns),
        workspace=LocalWorkspace(repo),
        config=SessionConfig(approve="all"),
        traces=store,
    )
    result = await session.run("write it")
    assert result.status == "completed", result.error
    assert result.answer == "done \ufffd"
    assert (repo / "out.txt").read_text(encoding="utf-8") == "a\ufffdb"
    trace = store.export(result.session_id)
    assert trace["status"] == "completed"
    assert [c["name"] for c in trace["tool_calls"]] == ["write_file", "grep"]
    assert "Writing \ufffd now." in trace["turns"][0]["text"]
    json.dumps(trace).encode("utf-8")  # every string in it is valid UTF-8


async def test_a_surrogate_pair_split_across_deltas_is_joined():
    async def produce(out, emit):
        for piece in ("a\ud83d", "\ude00b", "c\ud83d"):
            emit(piece)

    stream = TaskStream(produce)
    deltas = [d async for d in stream]
    assert "".join(deltas) == stream.output.text == "a\U0001f600bc\ufffd"


def test_valid_text_keeps_valid_text_and_mends_the_rest():
    assert valid_text("plain é 😀") == "plain é 😀"
    assert valid_text("\ud83d\ude00") == "😀"
    assert valid_text("x\udc00y\ud800") == "x\ufffdy\ufffd"


async def test_a_query_with_a_lone_surrogate_is_traced(repo, store):
    """A non-UTF-8 byte in `opencomposer ask`'s argument arrives as a lone surrogate
    (surrogateescape); the session's trace must still be written."""
    session = Session(
        model=scripted("ok"),
        workspace=LocalWorkspace(repo),
        config=SessionConfig(approve="all"),
        traces=store,
    )
    result = await session.run("fix \udcff please", context="file \ud800")
    assert result.status == "completed"
    trace = store.export(result.session_id)
    assert trace["query"] == "fix \ufffd please"
    assert "\ud800" not in json.dumps(trace["turns"][0]["messages"], ensure_ascii=False)
