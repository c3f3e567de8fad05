"""The JSON-RPC message loop under `opencomposer serve`: stdio and TCP.

pygls' own loop logs and drops a message it cannot parse, and its TCP server
shares one protocol object between all connections (the second client steals
the first one's writer). This loop answers bad input with the JSON-RPC error the
specification names (-32700 parse error, -32600 invalid request, -32602 invalid
params for a request whose params do not fit) and stays up; `serve_tcp` gives
every connection its own server object, so two editors can share one workspace.

    asyncio.run(serve_stdio(make_server))   # what `opencomposer serve --stdio` runs
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from cattrs.errors import ClassValidationError
from pygls.exceptions import JsonRpcException

log = logging.getLogger("opencomposer.server")

_CONTENT_LENGTH = re.compile(rb"^Content-Length:\s*(\d+)\s*$", re.IGNORECASE)
PARSE_ERROR, INVALID_REQUEST, INVALID_PARAMS = -32700, -32600, -32602


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
    body = json.dumps({"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}})
    data = body.encode()
    protocol.writer.write(b"Content-Length: %d\r\n\r\n" % len(data) + data)


def handle_body(protocol: Any, body: bytes) -> None:
    """Decode one message and hand it to pygls, or answer why it cannot be."""
    try:
        message = json.loads(body, object_hook=protocol.structure_message)
    except JsonRpcException as exc:
        _answer_bad_message(protocol, body, exc)
        return
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        send_error(protocol, None, PARSE_ERROR, f"Parse error: {exc}")
        return
    if not hasattr(message, "jsonrpc"):
        msg_id = message.get("id") if isinstance(message, dict) else None
        what = "a batch" if isinstance(message, list) else "not a JSON-RPC 2.0 message object"
        send_error(protocol, msg_id, INVALID_REQUEST, f"Invalid request: {what}")
        return
    if message.jsonrpc != "2.0":
        send_error(
            protocol,
            getattr(message, "id", None),
            INVALID_REQUEST,
            'Invalid request: "jsonrpc" must be "2.0"',
        )
        return
    protocol.handle_message(message)


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


async def read_messages(conn: Connection, reader: asyncio.StreamReader) -> None:
    """Read framed messages until EOF or `exit`."""
    length = 0
    while not conn.stop_requested():
        try:
            header = await reader.readline()
        except (ConnectionError, ValueError):
            return
        if not header:
            return
        match = _CONTENT_LENGTH.match(header)
        if match:
            length = int(match.group(1))
            continue
        if header.strip() or not length:
            continue  # other headers, or a blank line without a length
        try:
            body = await reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        length = 0
        try:
            handle_body(conn.protocol, body)
        except Exception:
            log.exception("unexpected error while handling a message")


async def run_connection(
    conn: Connection, reader: asyncio.StreamReader, writer: FrameWriter
) -> None:
    conn.protocol.set_writer(writer)
    try:
        await read_messages(conn, reader)
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
    await run_connection(conn, reader, FrameWriter(out.write, out.close))


async def serve_tcp(
    make_conn: Callable[[], Connection],
    host: str,
    port: int,
    on_listening: Callable[[str, int], Awaitable[None] | None] | None = None,
) -> None:
    """Serve until cancelled; each connection gets its own server from `make_conn`."""

    async def on_client(reader: asyncio.StreamReader, stream: asyncio.StreamWriter) -> None:
        writer = FrameWriter(stream.write, stream.close)
        await run_connection(make_conn(), reader, writer)

    make_conn().warm_up()  # the serialisers are shared by all connections
    server = await asyncio.start_server(on_client, host, port, limit=2**20)
    bound_host, bound_port = server.sockets[0].getsockname()[:2]
    if on_listening is not None:
        res = on_listening(bound_host, bound_port)
        if asyncio.iscoroutine(res):
            await res
    async with server:
        await server.serve_forever()
