"""The JSON-RPC message loop under `opencomposer serve`: stdio and TCP.

pygls' own loop logs and drops a message it cannot parse, and its TCP server
shares one protocol object between all connections (the second client steals
the first one's writer). This loop answers bad input with the JSON-RPC error the
specification names (-32700 parse error, -32600 invalid request, -32602 invalid
params for a request whose params do not fit) and stays up; `serve_tcp` gives
every connection its own server object, so two editors can share one workspace.

    asyncio.run(serve_stdio(make_server))   # what `opencomposer serve --stdio` runs

Framing (`FrameReader`) survives any byte stream: a header line over 8 KiB, a line
that is not a header, a header block without `Content-Length`, a body over 64 MiB
each get one -32700 answer, and reading resumes at the next `Content-Length:` header
line. That header line, with its CR LF, cannot occur inside valid JSON (a raw line
break is not allowed in a JSON string, and the header is no JSON token), so finding
one inside a body proves its `Content-Length` too large: the body is refused (with
its id when the part before the header is a request) and the header is read again.
A `Content-Length` too small leaves a body that fails to parse (-32700) and a tail
that is skipped up to the next header. Either way the next request is answered.

A TCP server takes a token (`lsp_auth`): a connection's first message must be
`initialize` carrying it in `initializationOptions.token`; anything else gets one
error (-32003) and the connection is closed before a server object exists for it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Final, Protocol

from cattrs.errors import ClassValidationError
from opencomposer.agent.text import valid_text
from pygls.exceptions import JsonRpcException

log = logging.getLogger("opencomposer.server")

PARSE_ERROR, INVALID_REQUEST, INVALID_PARAMS = -32700, -32600, -32602
UNAUTHORIZED = -32003  # TCP: the first message was not `initialize` with the token

MAX_HEADER_LINE = 8 * 1024
MAX_HEADERS = 32  # header lines in one message
MAX_BODY = 64 * 1024 * 1024  # a 50 MB file opened in the editor still fits
AUTH_MAX_BODY = 1024 * 1024  # the `initialize` a TCP connection must open with
AUTH_TIMEOUT_S = 30.0
READ_SIZE = 256 * 1024

_CONTENT_LENGTH = re.compile(rb"content-length:[ \t]*(\d{1,19})[ \t]*", re.IGNORECASE)
_HEADER = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\r\n]*")
# A whole Content-Length header line: what reading resumes at after bad framing.
_HEADER_LINE = re.compile(rb"content-length:[ \t]{0,16}\d{1,19}[ \t]{0,16}\r?\n", re.IGNORECASE)
_HEADER_LINE_MAX = 70  # bytes such a line can span
_HEADER_REST = re.compile(rb"[ \t]{0,16}\d{0,19}[ \t]{0,16}\r?")  # after the name, unfinished
_NAME = b"content-length:"
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class Connection(Protocol):
    """What the loop needs from a per-connection language server."""

    protocol: Any

    def stop_requested(self) -> bool: ...

    def warm_up(self) -> None:
        """Prepare for the handshake (called before the first message is read)."""
        ...

    async def disconnected(self) -> None:
        """The transport closed: stop this connection's sessions, mark their traces."""
        ...


class FrameWriter:
    """Writes framed messages; after the peer went away, writes are dropped."""

    def __init__(self, write: Callable[[bytes], Any], close: Callable[[], Any]) -> None:
        self._write, self._close = write, close
        self.closed = False

    def write(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            self._write(data)
        except (BrokenPipeError, ConnectionError, OSError, RuntimeError):
            self.closed = True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self._close()
            except Exception:
                pass


def send_error(protocol: Any, msg_id: Any, code: int, message: str) -> None:
    """Write a JSON-RPC error response directly (pygls cannot answer an id of null)."""
    write_error(protocol.writer, msg_id, code, message)


def write_error(writer: Any, msg_id: Any, code: int, message: str) -> None:
    body = json.dumps({"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}})
    data = body.encode()
    writer.write(b"Content-Length: %d\r\n\r\n" % len(data) + data)


def handle_body(protocol: Any, body: bytes) -> bool:
    """Decode one message and hand it to pygls, or answer why it cannot be; False
    when the body is not JSON at all."""
    if _SURROGATE_ESCAPE.search(body):
        body = _mend_surrogates(body)
    try:
        message = json.loads(body, object_hook=protocol.structure_message)
    except JsonRpcException as exc:
        _answer_bad_message(protocol, body, exc)
        return True
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        send_error(protocol, None, PARSE_ERROR, f"Parse error: {exc}")
        return False
    if not hasattr(message, "jsonrpc"):
        msg_id = message.get("id") if isinstance(message, dict) else None
        what = "a batch" if isinstance(message, list) else "not a JSON-RPC 2.0 message object"
        send_error(protocol, msg_id, INVALID_REQUEST, f"Invalid request: {what}")
        return True
    if message.jsonrpc != "2.0":
        send_error(
            protocol,
            getattr(message, "id", None),
            INVALID_REQUEST,
            'Invalid request: "jsonrpc" must be "2.0"',
        )
        return True
    protocol.handle_message(message)
    return True


def _mend_surrogates(body: bytes) -> bytes:
    """The body with every lone UTF-16 surrogate escape (`\\ud800`) turned into U+FFFD:
    JSON allows them, but no text that reaches a session, a file or the trace store
    may hold one."""
    try:
        return json.dumps(_mended(json.loads(body))).encode()
    except (ValueError, RecursionError):
        return body  # answered as a parse error by the caller


def _mended(value: Any) -> Any:
    if isinstance(value, str):
        return valid_text(value)
    if isinstance(value, list):
        return [_mended(v) for v in value]
    if isinstance(value, dict):
        return {_mended(k): _mended(v) for k, v in value.items()}
    return value


def _answer_bad_message(protocol: Any, body: bytes, exc: JsonRpcException) -> None:
    raw = json.loads(body)
    if not isinstance(raw, dict):
        send_error(protocol, None, INVALID_REQUEST, "Invalid request")
        return
    method, msg_id = raw.get("method"), raw.get("id")
    if method is None and "result" not in raw and "error" not in raw:
        send_error(protocol, msg_id, INVALID_REQUEST, "Invalid request: no method")
    elif method is not None and msg_id is not None:
        detail = _validation_detail(exc)
        send_error(protocol, msg_id, INVALID_PARAMS, f"Invalid params for {method}: {detail}")
    else:
        log.warning("dropped a malformed %s notification: %s", method, _validation_detail(exc))


def _validation_detail(exc: BaseException) -> str:
    cause = exc.__cause__
    if isinstance(cause, ClassValidationError):
        from cattrs import transform_error

        return "; ".join(transform_error(cause)[:5])
    return str(cause or exc)


class _Junk(Enum):
    """FrameReader: bytes skipped without a report."""

    JUNK = auto()


_JUNK: Final = _Junk.JUNK


@dataclass
class BadFrame:
    """Input that is not a framed message; answered with -32700 and `msg_id`."""

    message: str
    msg_id: Any = None


class FrameReader:
    """LSP frames (`Content-Length: N` CR LF CR LF, then N bytes) from a byte stream
    that may be out of step: `next()` gives a body, a `BadFrame`, or None at the end."""

    def __init__(self, stream: asyncio.StreamReader, *, max_body: int = MAX_BODY) -> None:
        self.max_body = max_body
        self._stream = stream
        self._buf = bytearray()
        self._eof = False
        self._lost: int | None = None  # buffer offset to look for the next header from
        self._quiet = False  # the bytes up to the next header are known junk

    def skip_to_next_header(self) -> None:
        """The last body was not JSON: what follows up to the next header line is the
        rest of a message whose Content-Length was too small; skip it silently."""
        self._quiet = True

    async def next(self) -> bytes | BadFrame | None:
        while True:
            if self._lost is not None:
                start, self._lost = self._lost, None
                if not await self._resync(start):
                    return None
            item = await self._frame()
            if item is not _JUNK:
                return item

    async def _frame(self) -> bytes | BadFrame | _Junk | None:
        length: int | None = None
        lines = 0
        while True:
            buf = self._buf
            nl = buf.find(b"\n", 0, MAX_HEADER_LINE + 1)
            if nl < 0:
                if len(buf) > MAX_HEADER_LINE:
                    return self._lose(1, f"a header line longer than {MAX_HEADER_LINE} bytes")
                if not await self._fill():
                    return None
                continue
            line = bytes(buf[:nl]).rstrip(b"\r")
            if not line.strip(b" \t"):
                del buf[: nl + 1]
                if length is not None:
                    break
                if lines:
                    return self._lose(0, "a message without a Content-Length header")
                continue  # blank lines between messages
            lines += 1
            match = _CONTENT_LENGTH.fullmatch(line)
            if match:
                length = int(match.group(1))
            elif not _HEADER.fullmatch(line) or _NAME in line.lower():
                # not a header, or one that a message cut short ran into
                shown = line[:40].decode("utf-8", "replace")
                return self._lose(1, None if self._quiet else f"expected a header, got {shown!r}")
            if lines > MAX_HEADERS:
                return self._lose(1, f"more than {MAX_HEADERS} header lines")
            del buf[: nl + 1]
        self._quiet = False
        if length > self.max_body:
            return self._lose(0, f"a {length}-byte message is over the {self.max_body}-byte limit")
        return await self._body(length)

    def _lose(self, resume_from: int, message: str | None) -> BadFrame | _Junk:
        """Out of step: resume at the next header line at or after buffer offset
        `resume_from`, and report `message` (None: known junk, already answered)."""
        self._lost = resume_from
        self._quiet = False
        return _JUNK if message is None else BadFrame(message)

    async def _body(self, length: int) -> bytes | BadFrame | None:
        scanned = 0
        while True:
            have = min(len(self._buf), length)
            found = _find_header_line(self._buf, max(0, scanned - _HEADER_LINE_MAX), have)
            if found >= 0:
                return self._too_long(found, length)
            scanned = have
            if have == length:
                break
            if not await self._fill():
                return None
        body = bytes(self._buf[:length])
        del self._buf[:length]
        cut = _header_line_start_at_end(body)
        if cut >= 0:  # the body ends inside the next message's header line
            self._buf[0:0] = body[cut:]
            return self._too_long(cut, length, body)
        return body

    def _too_long(self, at: int, length: int, body: bytes | None = None) -> BadFrame:
        """A header line at `at` inside a body of `length`: the Content-Length was too
        large. Reading resumes at that header; the request before it gets an answer."""
        head = bytes(self._buf[:at]) if body is None else body[:at]
        if body is None:
            del self._buf[:at]
        msg_id = None
        try:
            message = json.loads(head)
            if isinstance(message, dict) and isinstance(message.get("id"), int | str):
                msg_id = message["id"]
        except (ValueError, RecursionError):
            pass
        return BadFrame(
            f"Content-Length {length} is larger than the message ({len(head)} bytes)", msg_id
        )

    async def _resync(self, start: int) -> bool:
        """Drop bytes up to the next Content-Length header line; False at the end."""
        while True:
            found = _find_header_line(self._buf, start, len(self._buf))
            if found >= 0:
                del self._buf[:found]
                return True
            # keep what could be the start of a header line that is still arriving
            del self._buf[: max(start, len(self._buf) - _HEADER_LINE_MAX)]
            start = 0
            if not await self._fill():
                return False

    async def _fill(self) -> bool:
        if self._eof:
            return False
        try:
            data = await self._stream.read(READ_SIZE)
        except (ConnectionError, OSError):
            data = b""
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True


def _find_header_line(buf: bytearray, start: int, end: int) -> int:
    """Offset of the first whole Content-Length header line that starts in
    buf[start:end] (it may run past `end`), or -1."""
    if end <= start:
        return -1
    low = bytes(buf[start : end + _HEADER_LINE_MAX]).lower()
    i = low.find(_NAME)
    while 0 <= i < end - start:
        if _HEADER_LINE.match(buf, start + i):
            return start + i
        i = low.find(_NAME, i + 1)
    return -1


def _header_line_start_at_end(body: bytes) -> int:
    """Offset where `body` ends inside an unfinished Content-Length header line, or -1.
    Valid JSON cannot end so (no JSON value ends in `c`, `co`, …, `Content-Length: 5`)."""
    base = max(0, len(body) - _HEADER_LINE_MAX)
    low = body[base:].lower()
    i = low.find(b"c")
    while i >= 0:
        rest = low[i:]
        if _NAME.startswith(rest) or (
            rest.startswith(_NAME) and _HEADER_REST.fullmatch(rest, len(_NAME))
        ):
            return base + i
        i = low.find(b"c", i + 1)
    return -1


async def read_messages(conn: Connection, frames: FrameReader) -> None:
    """Read framed messages until EOF or `exit`; bad input never ends the loop."""
    while not conn.stop_requested():
        item = await frames.next()
        if item is None:
            return
        if isinstance(item, BadFrame):
            log.warning("bad framing: %s", item.message)
            send_error(conn.protocol, item.msg_id, PARSE_ERROR, f"Parse error: {item.message}")
            continue
        try:
            if not handle_body(conn.protocol, item):
                frames.skip_to_next_header()
        except Exception:
            log.exception("unexpected error while handling a message")


async def run_connection(
    conn: Connection, frames: FrameReader, writer: FrameWriter, first: bytes | None = None
) -> None:
    conn.protocol.set_writer(writer)
    try:
        if first is not None:
            handle_body(conn.protocol, first)
        await read_messages(conn, frames)
    finally:
        await conn.disconnected()
        writer.close()


def claim_stdio() -> tuple[Any, Any]:
    """Private handles on the real stdin and stdout for LSP frames. Afterwards fd 0 is
    /dev/null and fd 1 points at stderr, so neither a child process that inherits
    stdin nor a stray print (model engines, libraries) can touch the protocol."""
    sys.stdout.flush()
    inp = os.fdopen(os.dup(0), "rb", buffering=0)
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    return inp, out


async def serve_stdio(make_conn: Callable[[], Connection]) -> None:
    inp, out = claim_stdio()
    conn = make_conn()
    conn.warm_up()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), inp)
    await run_connection(conn, FrameReader(reader), FrameWriter(out.write, out.close))


async def serve_tcp(
    make_conn: Callable[[], Connection],
    host: str,
    port: int,
    on_listening: Callable[[str, int], Awaitable[None] | None] | None = None,
    *,
    token: str,
) -> None:
    """Serve until cancelled; each connection that opens with `initialize` carrying
    `token` gets its own server from `make_conn`."""

    async def on_client(reader: asyncio.StreamReader, stream: asyncio.StreamWriter) -> None:
        writer = FrameWriter(stream.write, stream.close)
        frames = FrameReader(reader, max_body=AUTH_MAX_BODY)
        first = await authenticate(frames, writer, token)
        if first is None:
            writer.close()
            return
        frames.max_body = MAX_BODY
        await run_connection(make_conn(), frames, writer, first)

    make_conn().warm_up()  # the serialisers are shared by all connections
    server = await asyncio.start_server(on_client, host, port, limit=2**20)
    bound_host, bound_port = server.sockets[0].getsockname()[:2]
    if on_listening is not None:
        res = on_listening(bound_host, bound_port)
        if asyncio.iscoroutine(res):
            await res
    async with server:
        await server.serve_forever()


async def authenticate(frames: FrameReader, writer: FrameWriter, token: str) -> bytes | None:
    """The connection's first message, if it is `initialize` with
    `initializationOptions.token` equal to `token` (the token taken out); else None,
    after one error response."""
    try:
        item = await asyncio.wait_for(frames.next(), AUTH_TIMEOUT_S)
    except TimeoutError:
        return None
    if item is None:
        return None
    if isinstance(item, BadFrame):
        write_error(writer, item.msg_id, PARSE_ERROR, f"Parse error: {item.message}")
        return None
    try:
        message = json.loads(item)
    except (ValueError, RecursionError) as exc:
        write_error(writer, None, PARSE_ERROR, f"Parse error: {exc}")
        return None
    msg_id = message.get("id") if isinstance(message, dict) else None
    params = message.get("params") if isinstance(message, dict) else None
    options = params.get("initializationOptions") if isinstance(params, dict) else None
    given = options.get("token") if isinstance(options, dict) else None
    if (
        not isinstance(message, dict)
        or message.get("method") != "initialize"
        or not isinstance(msg_id, int | str)
    ):
        write_error(
            writer,
            msg_id if isinstance(msg_id, int | str) else None,
            UNAUTHORIZED,
            "Unauthorized: the first message must be initialize with initializationOptions.token",
        )
        return None
    if not isinstance(given, str) or not hmac.compare_digest(
        given.encode("utf-8", "surrogatepass"), token.encode()
    ):
        what = "no token" if given is None else "a wrong token"
        write_error(
            writer,
            msg_id,
            UNAUTHORIZED,
            f"Unauthorized: initialize carried {what} (initializationOptions.token)",
        )
        log.warning("refused a TCP connection: %s", what)
        return None
    assert isinstance(options, dict)
    del options["token"]
    return json.dumps(message).encode()
