"""LSP framing that is out of step: the reader resynchronises at the next
`Content-Length:` header, caps header lines and bodies, and never stops reading.

The unit tests drive `FrameReader` over an in-memory stream (every bad shape, fed
whole and byte by byte); the end-to-end tests write raw bytes to the real server
process over stdio and require the valid request after each bad frame to be answered.
"""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
from pathlib import Path

import pytest
from lsp_harness import REPO, SERVER, scripted, server_env
from opencomposer.server.lsp_transport import MAX_BODY, BadFrame, FrameReader


def frame(body: bytes, length: int | None = None) -> bytes:
    return b"Content-Length: %d\r\n\r\n" % (len(body) if length is None else length) + body


def request(msg_id: int, method: str = "opencomposer.sessions") -> bytes:
    return json.dumps(
        {
            "jsonrpc": "2.0",
            "id": msg_id,
            "method": "workspace/executeCommand",
            "params": {"command": method, "arguments": [{}]},
        }
    ).encode()


GOOD = request(99)
B1 = request(1)

# Each: bytes that are not a well-framed message, as a client bug or an attacker sends them.
BAD = {
    "too small": frame(B1, len(B1) - 20),
    "too small by one": frame(B1, len(B1) - 1),
    "too large by one": frame(B1, len(B1) + 1),
    "too large by 5": frame(B1, len(B1) + 5),
    "too large by 19": frame(B1, len(B1) + 19),
    "too large by 25": frame(B1, len(B1) + 25),
    "too large past the next frame": frame(B1, len(B1) + 10_000),
    "header only, no body": b"Content-Length: 40\r\n\r\n",
    "zero length": frame(b"", 0),
    "header line over 1 MiB": b"X-Junk: " + b"a" * (1 << 20) + b"\r\n\r\n",
    "digits over 1 MiB": b"Content-Length: " + b"9" * (1 << 20) + b"\r\n\r\n",
    "9 KiB without a line break": b"z" * 9000,
    "garbage lines": b"hello\r\nworld\r\n\r\n",
    "garbage without line breaks": b"\x00\xff" * 100,
    "no Content-Length": b"Content-Type: application/json\r\n\r\n" + B1,
    "Content-Length not a number": b"Content-Length: abc\r\n\r\n" + B1,
    "negative Content-Length": b"Content-Length: -5\r\n\r\n" + B1,
    "Content-Length with 25 digits": b"Content-Length: " + b"1" * 25 + b"\r\n\r\n" + B1,
    "over the body limit": b"Content-Length: %d\r\n\r\n" % (MAX_BODY + 1) + b"{" * 100,
    "header cut short": b"Content-Length: 12",
    "header name cut short": b"Content-Le",
    "a stray CR": b"\r",
    "too many headers": b"X-A: b\r\n" * 40 + b"\r\n",
    "not UTF-8": frame(b'{"jsonrpc": "2.0", "id": 5, "method": "\xff\xfe"}'),
}


async def read_all(data: bytes, *, step: int | None = None, max_body: int = MAX_BODY) -> list:
    stream = asyncio.StreamReader()
    if step is None:
        stream.feed_data(data)
    else:
        for i in range(0, len(data), step):
            stream.feed_data(data[i : i + step])
    stream.feed_eof()
    frames = FrameReader(stream, max_body=max_body)
    items = []
    while (item := await asyncio.wait_for(frames.next(), 5)) is not None:
        items.append(item)
        if isinstance(item, bytes) and item != GOOD:
            try:
                json.loads(item)
            except ValueError:
                frames.skip_to_next_header()  # what the message loop does
    return items


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("step", [None, 1, 7])
async def test_the_next_frame_is_read_after_any_bad_framing(case, step):
    """Guards a too-small Content-Length leaving the server deaf for good, a too-large
    one swallowing the next request, and over-long header lines ending the loop."""
    if step is not None and len(BAD[case]) > 100_000:
        step = 4096
    items = await read_all(BAD[case] + frame(GOOD) + frame(GOOD), step=step)
    assert items[-2:] == [GOOD, GOOD], [i if isinstance(i, BadFrame) else i[:60] for i in items]
    assert any(isinstance(i, BadFrame) for i in items) or case in {
        "too small",
        "too small by one",
        "zero length",
        "not UTF-8",
    }  # those reach the JSON parser, which answers -32700


async def test_a_too_large_length_is_answered_with_the_request_id():
    (bad, good) = await read_all(frame(B1, len(B1) + 30) + frame(GOOD))
    assert isinstance(bad, BadFrame) and bad.msg_id == 1 and "larger than" in bad.message
    assert good == GOOD


async def test_valid_json_holding_header_text_is_not_cut():
    """A body may mention `Content-Length: 5` (in a string, without a raw line break);
    only a raw header line, impossible in JSON, counts as a frame boundary."""
    body = json.dumps({"text": "Content-Length: 5\r\n\r\nContent-Length: 7\n"}).encode()
    assert await read_all(frame(body) + frame(GOOD), step=3) == [body, GOOD]


async def test_a_body_over_the_limit_is_skipped_without_being_buffered():
    body = json.dumps({"text": "x" * 300_000}).encode()
    items = await read_all(frame(body) + frame(GOOD), step=65536, max_body=100_000)
    assert isinstance(items[0], BadFrame) and "over the 100000-byte limit" in items[0].message
    assert items[1:] == [GOOD]


async def test_random_runs_of_bad_framing_never_lose_a_following_frame():
    rng = random.Random(19)
    pieces = [v for k, v in BAD.items() if len(v) < 10_000]
    for _ in range(1000):
        goods = [request(1000 + i) for i in range(rng.randint(1, 4))]
        data = b""
        for body in goods:
            data += b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 3)))
            data += frame(body)
        items = await read_all(data, step=rng.choice([None, 1, 5, 64]))
        got = [i for i in items if i in goods]
        assert got == goods


# -- the real server ------------------------------------------------------------


class RawClient:
    """Writes raw bytes to `opencomposer serve --stdio` and reads its framed answers."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.seen: list[dict] = []

    async def send(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        await self.proc.stdin.drain()

    async def _read(self) -> dict:
        length = None
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                raise EOFError("the server closed its stdout")
            if line.strip() == b"" and length is not None:
                break
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        message = json.loads(await self.proc.stdout.readexactly(length))
        self.seen.append(message)
        return message

    async def answer(self, msg_id: int, timeout: float = 20) -> dict:
        for message in self.seen:
            if message.get("id") == msg_id:
                return message

        async def wait() -> dict:
            while True:
                message = await self._read()
                if message.get("id") == msg_id and "method" not in message:
                    return message

        return await asyncio.wait_for(wait(), timeout)


@pytest.fixture
async def raw(repo: Path, home: Path, tmp_path: Path):
    spec = scripted(tmp_path / "m.json", ["hi"])
    proc = await asyncio.create_subprocess_exec(
        *SERVER,
        "--stdio",
        "--model",
        spec,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env=server_env(home),
        cwd=str(REPO),
    )
    client = RawClient(proc)
    init = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {"processId": None, "rootUri": repo.as_uri(), "capabilities": {}},
    }
    await client.send(frame(json.dumps(init).encode()))
    assert "result" in await client.answer(0, timeout=60)
    await client.send(frame(b'{"jsonrpc": "2.0", "method": "initialized", "params": {}}'))
    yield client
    if proc.returncode is None:
        proc.kill()
    await proc.wait()


async def test_the_server_answers_the_request_after_every_bad_frame(raw):
    """Guards item 11 of issue 19 end to end: after each bad frame, written as raw
    bytes to the real server, the next request gets its answer and the process lives."""
    for n, case in enumerate(sorted(BAD), start=100):
        await raw.send(BAD[case] + frame(request(n)))
        try:
            answer = await raw.answer(n)
        except (TimeoutError, EOFError) as e:
            pytest.fail(f"no answer after {case!r}: {type(e).__name__}")
        assert answer.get("result") == [], (case, answer)
        assert raw.proc.returncode is None, case
    errors = [m for m in raw.seen if "error" in m]
    assert errors and all(m["error"]["code"] == -32700 for m in errors)
    assert any(m["id"] == 1 for m in errors)  # the too-large frame's own request


async def test_a_body_over_64_mib_is_skipped_and_the_next_request_answered(raw):
    body = json.dumps({"jsonrpc": "2.0", "method": "x", "params": "y" * MAX_BODY}).encode()
    await raw.send(frame(body) + frame(request(7)))
    assert (await raw.answer(7, timeout=60)).get("result") == []
    (error,) = [m for m in raw.seen if "error" in m]
    assert "over the" in error["error"]["message"]


async def test_a_lone_surrogate_in_a_request_reaches_no_file_or_trace(raw, repo, home):
    """JSON allows `\\ud800`; the transport mends it to U+FFFD, so the session runs and
    its trace (UTF-8 in SQLite) is written."""
    ask = {
        "jsonrpc": "2.0",
        "id": 8,
        "method": "workspace/executeCommand",
        "params": {"command": "opencomposer.ask", "arguments": [{"query": "fix \ud800 it"}]},
    }
    await raw.send(frame(json.dumps(ask).encode()))
    result = (await raw.answer(8, timeout=60))["result"]
    assert result["status"] == "completed", result
    with sqlite3.connect(home / "traces.db") as db:
        (query,) = db.execute("SELECT query FROM sessions").fetchone()
    assert query == "fix \ufffd it"
