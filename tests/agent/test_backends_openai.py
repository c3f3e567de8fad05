"""The `openai:` backend against a fake OpenAI-compatible server on 127.0.0.1.

The fake (http.server in a thread) speaks `/v1/chat/completions` with SSE; each
route prefix selects a behaviour: a normal stream with logprobs and usage, a server
that rejects `logprobs`, an HTTP 500, a stream cut mid-chunk, one that ends without
finishing, and a slow one for cancellation. No real endpoint is contacted.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opencomposer.agent.backends.openai import OpenAIModel
from opencomposer.agent.protocols import Message, ModelError, Sampling

WORDS = ["Hello", ",", " world", "!"]


def chunk(content: str | None = None, finish: str | None = None, logprob: float | None = None):
    choice: dict = {"index": 0, "delta": {} if content is None else {"content": content}}
    if logprob is not None:
        choice["logprobs"] = {"content": [{"token": content, "logprob": logprob}]}
    choice["finish_reason"] = finish
    return {"id": "c1", "object": "chat.completion.chunk", "choices": [choice]}


class FakeOpenAI(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    requests: list[dict] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeOpenAI.requests.append(
            {"path": self.path, "body": body, "auth": self.headers.get("Authorization")}
        )
        route = self.path.split("/")[1]
        if route == "error":
            return self.reply(500, {"error": {"message": "model exploded\nwith details"}})
        if route == "nologprobs" and "logprobs" in body:
            return self.reply(400, {"error": {"message": "logprobs are not supported"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with_lp = bool(body.get("logprobs"))
        if route == "broken":
            self.send_event(chunk("Hel", logprob=-0.5 if with_lp else None))
            self.wfile.write(b'40\r\ndata: {"trunc')  # a chunk cut short, then the socket closes
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if route == "slow":
            for _ in range(200):
                self.send_event(chunk("tick "))
                time.sleep(0.05)
        for i, word in enumerate(WORDS):
            self.send_event(chunk(word, logprob=-0.1 * (i + 1) if with_lp else None))
        if route == "unfinished":
            return self.end_stream()
        self.send_event(chunk(finish="stop"))
        self.send_event(
            {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": len(WORDS)}}
        )
        self.send_line(b"data: [DONE]\n\n")
        self.end_stream()

    def reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_event(self, payload: dict) -> None:
        self.send_line(b": keep-alive\n\ndata: " + json.dumps(payload).encode() + b"\n\n")

    def send_line(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


MESSAGES = [Message(role="system", content="be brief"), Message(role="user", content="hi")]


async def run(model: OpenAIModel, sampling: Sampling | None = None):
    stream = model.stream(MESSAGES, sampling or Sampling())
    deltas = [d async for d in stream]
    return deltas, stream.output


async def test_streams_text_logprobs_and_usage(server: str, monkeypatch) -> None:
    monkeypatch.setenv("OPENCOMPOSER_API_KEY", "sk-test")
    model = OpenAIModel(f"{server}/ok/v1", "tiny")
    FakeOpenAI.requests.clear()
    deltas, out = await run(model, Sampling(temperature=0.5, max_tokens=7, seed=3, stop=("END",)))
    await model.close()
    assert deltas == WORDS
    assert out.text == "Hello, world!" and out.finish_reason == "stop"
    assert out.completion_logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert (out.prompt_tokens, out.completion_tokens) == (11, 4)
    assert out.completion_token_ids is None
    sent = FakeOpenAI.requests[-1]
    assert sent["path"] == "/ok/v1/chat/completions"
    assert sent["auth"] == "Bearer sk-test"
    body = sent["body"]
    assert body["stream"] is True and body["logprobs"] is True and body["model"] == "tiny"
    assert body["messages"] == [m.as_dict() for m in MESSAGES]
    assert (body["temperature"], body["max_tokens"], body["seed"], body["stop"]) == (
        0.5,
        7,
        3,
        ["END"],
    )


async def test_no_key_sends_no_authorization(server: str, monkeypatch) -> None:
    monkeypatch.delenv("OPENCOMPOSER_API_KEY", raising=False)
    model = OpenAIModel(f"{server}/ok/v1/", "tiny")
    await run(model)
    await model.close()
    assert FakeOpenAI.requests[-1]["auth"] is None


async def test_server_without_logprobs_is_asked_again_without(server: str) -> None:
    model = OpenAIModel(f"{server}/nologprobs/v1", "tiny")
    deltas, out = await run(model)
    assert "".join(deltas) == "Hello, world!" and out.completion_logprobs is None
    assert model.logprobs is False  # remembered: the next turn asks once
    FakeOpenAI.requests.clear()
    await run(model)
    await model.close()
    assert len(FakeOpenAI.requests) == 1


async def test_http_error_is_one_line_model_error(server: str) -> None:
    model = OpenAIModel(f"{server}/error/v1", "tiny")
    with pytest.raises(ModelError) as info:
        await run(model)
    await model.close()
    assert "HTTP 500" in str(info.value) and "model exploded with details" in str(info.value)
    assert "\n" not in str(info.value)


async def test_broken_stream_is_model_error(server: str) -> None:
    model = OpenAIModel(f"{server}/broken/v1", "tiny")
    stream = model.stream(MESSAGES, Sampling())
    got = []
    with pytest.raises(ModelError, match="broke|ended before") as info:
        async for delta in stream:
            got.append(delta)
    await model.close()
    assert got == ["Hel"] and "\n" not in str(info.value)
    assert stream.output.finish_reason == "error" and stream.output.text == "Hel"


async def test_stream_without_finish_is_model_error(server: str) -> None:
    model = OpenAIModel(f"{server}/unfinished/v1", "tiny")
    with pytest.raises(ModelError, match="ended before the turn finished"):
        await run(model)
    await model.close()


async def test_unreachable_host_is_model_error() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = OpenAIModel(f"http://127.0.0.1:{port}/v1", "tiny")
    with pytest.raises(ModelError, match="cannot reach"):
        await run(model)
    await model.close()


async def test_aclose_stops_a_slow_stream(server: str) -> None:
    model = OpenAIModel(f"{server}/slow/v1", "tiny")
    stream = model.stream(MESSAGES, Sampling())
    got = []
    start = time.monotonic()
    async for delta in stream:
        got.append(delta)
        if len(got) == 3:
            await stream.aclose()
    await model.close()
    assert time.monotonic() - start < 2.0  # the whole stream would take 10 s
    assert stream.output.finish_reason == "cancelled"
    assert stream.output.text == "".join(got) and 3 <= len(got) < 20


async def test_sessions_run_concurrently(server: str) -> None:
    model = OpenAIModel(f"{server}/ok/v1", "tiny")
    results = await asyncio.gather(*(run(model) for _ in range(8)))
    await model.close()
    assert all(out.text == "Hello, world!" for _, out in results)
