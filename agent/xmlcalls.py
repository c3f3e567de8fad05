"""The XML tool-call protocol: an incremental parser over the model's stream.

An assistant message is free text in which tool calls stand as XML elements named
after the tool. Short parameters are attributes; long ones are child elements whose
content is raw text (no escaping; a child ends at its own closing tag). The parser
consumes the stream chunk by chunk and returns each call the moment its closing tag
(or `/>`) has arrived, so the executor can start it before the message ends.

How it departs from XML, on purpose:

- Child content is raw: `<old>if a < b && c:</old>` is taken as written.
- A tool with exactly one child parameter may take it as bare content
  (`<run_terminal>ls -la</run_terminal>`), which small models write often.
- One leading and one trailing newline of child content are dropped, so both
  `<old>x</old>` and `<old>\\nx\\n</old>` mean `x`.
- Elements that are not calls (`<b>`, `a < b`) stay text. Unknown snake_case
  element names (`<run_command …/>`) are read as calls so the model learns they do
  not exist; so are known tool names inside a code fence, which are reported, not run.

Malformed calls never raise: each becomes a `ParsedCall` with `error` set, which the
executor turns into an error result for that call while the others still run.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

_NAME = re.compile(r"[A-Za-z_][\w\-]*")
_ATTR = re.compile(r"([A-Za-z_][\w\-]*)\s*=\s*(?:\"([^\"]*)\"|'([^']*)')", re.S)
_CALLISH = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")
_FENCE = re.compile(r"^[ \t]*```", re.M)


@dataclass
class ParsedCall:
    index: int
    name: str
    raw: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    start: int = 0
    end: int = 0


_SKIP = ParsedCall(index=-1, name="")


class _NeedMore(Exception):
    """The buffer ends before the construct at hand can be decided."""


class StreamParser:
    """Feed text chunks; get complete calls back as soon as they close.

    `children` maps each known tool to the names of its parameters that may be
    written as child elements; `bare` maps a tool to the parameter that bare content
    fills (tools with a single child parameter).
    """

    def __init__(self, children: Mapping[str, frozenset[str]], bare: Mapping[str, str]):
        self.children = children
        self.bare = bare
        self.buf = ""
        self.pos = 0
        self.calls: list[ParsedCall] = []
        self._open: ParsedCall | None = None  # a call whose body is being read

    @property
    def text(self) -> str:
        return self.buf

    def feed(self, chunk: str) -> list[ParsedCall]:
        self.buf += chunk
        return self._scan(final=False)

    def close(self) -> list[ParsedCall]:
        """End of message: whatever is still open is reported as unclosed."""
        done = self._scan(final=True)
        if self._open is not None:
            call = self._open
            call.error = f"unclosed element <{call.name}>: the message ended before </{call.name}>"
            call.end = len(self.buf)
            self._open = None
            self.pos = len(self.buf)
            done.append(call)
        return done

    # -- scanning ----------------------------------------------------------------

    def _scan(self, *, final: bool) -> list[ParsedCall]:
        done: list[ParsedCall] = []
        while True:
            try:
                call = self._step(final)
            except _NeedMore:
                if not final:
                    break
                # The message ended inside an opening tag or a stray fragment.
                if self._open is None:
                    self._report_truncated_tag(done)
                break
            if call is None:
                break
            done.append(call)
        return done

    def _step(self, final: bool) -> ParsedCall | None:
        if self._open is not None:
            return self._read_body(self._open)
        return self._read_text(final)

    def _read_text(self, final: bool) -> ParsedCall | None:
        buf = self.buf
        while True:
            lt = buf.find("<", self.pos)
            if lt < 0:
                self.pos = len(buf)
                return None
            m = _NAME.match(buf, lt + 1)
            closing = False
            if m is None and buf.startswith("</", lt):
                m = _NAME.match(buf, lt + 2)
                closing = True
            if m is None:
                if len(buf) - lt < 3 and not final:
                    raise _NeedMore
                self.pos = lt + 1
                continue
            if m.end() == len(buf):
                raise _NeedMore  # the name may go on
            name = m.group(0)
            after = buf[m.end()]
            if closing:
                if after == ">" and name in self.children:
                    self.pos = m.end() + 1
                    return self._new_call(
                        name,
                        lt,
                        self.pos,
                        error=f"stray closing tag </{name}> with no open <{name}>",
                    )
                self.pos = m.end()
                continue
            if not (after.isspace() or after in "/>"):
                self.pos = m.end()
                continue
            known = name in self.children
            if not known and (not _CALLISH.match(name) or _in_fence(buf, lt)):
                self.pos = m.end()
                continue
            call = self._read_open_tag(name, lt, m.end(), known)
            if call is not _SKIP:
                return call

    def _read_open_tag(self, name: str, lt: int, i: int, known: bool) -> ParsedCall:
        """Read `<name attr="v" …` to its `/>` or `>`; unknown names that carry no
        attributes are prose (`<file_path>`), and come back as _SKIP."""
        buf = self.buf
        raw: dict[str, str] = {}
        while True:
            while i < len(buf) and buf[i].isspace():
                i += 1
            if i >= len(buf):
                raise _NeedMore
            if buf.startswith("/>", i):
                self.pos = i + 2
                return self._finish(self._new_call(name, lt, i + 2, raw=raw))
            if buf[i] == "/" and i + 1 == len(buf):
                raise _NeedMore
            if buf[i] == ">":
                if not known and not raw:
                    self.pos = i + 1
                    return _SKIP
                call = self._new_call(name, lt, i + 1, raw=raw)
                self.pos = i + 1
                self._open = call
                return self._read_body(call)
            m = _ATTR.match(buf, i)
            if m is None:
                if _partial_attr(buf, i):
                    raise _NeedMore
                if not known and not raw:
                    self.pos = i  # `<some_word text` in prose: not a call
                    return _SKIP
                end = buf.find(">", i)
                if end < 0:
                    raise _NeedMore
                self.pos = end + 1
                bad = buf[i : min(end, i + 40)]
                return self._new_call(
                    name,
                    lt,
                    end + 1,
                    raw=raw,
                    error=f"malformed attribute in <{name}> near {bad!r}",
                )
            value = m.group(2) if m.group(2) is not None else m.group(3)
            raw[m.group(1)] = html.unescape(value)
            i = m.end()

    def _read_body(self, call: ParsedCall) -> ParsedCall:
        buf = self.buf
        close_tag = f"</{call.name}>"
        allowed = self.children.get(call.name)
        while True:
            i = self.pos
            while i < len(buf) and buf[i].isspace():
                i += 1
            if i >= len(buf):
                raise _NeedMore
            if buf.startswith(close_tag, i):
                self.pos = i + len(close_tag)
                self._open = None
                call.end = self.pos
                return self._finish(call)
            if close_tag.startswith(buf[i:]):
                raise _NeedMore
            child = self._child_at(i, allowed)
            if child is None:
                # Bare content up to the call's closing tag.
                end = buf.find(close_tag, i)
                if end < 0:
                    raise _NeedMore
                body = _trim(buf[self.pos : end])
                self.pos = end + len(close_tag)
                self._open = None
                call.end = self.pos
                slot = self.bare.get(call.name)
                if slot is not None and slot not in call.raw:
                    call.raw[slot] = body
                elif call.error is None:
                    call.error = f"unexpected text inside <{call.name}>: {body[:60]!r}"
                return self._finish(call)
            cname, content_start, self_closing = child
            if self_closing:
                call.raw.setdefault(cname, "")
                self.pos = content_start
                continue
            cclose = f"</{cname}>"
            end = buf.find(cclose, content_start)
            if end < 0:
                raise _NeedMore
            if cname in call.raw and call.error is None:
                call.error = f"parameter {cname} given twice in <{call.name}>"
            call.raw[cname] = _trim(buf[content_start:end])
            self.pos = end + len(cclose)

    def _child_at(self, i: int, allowed: frozenset[str] | None) -> tuple[str, int, bool] | None:
        """(name, content start, self-closing) if a child element opens at i."""
        buf = self.buf
        if buf[i] != "<":
            return None
        m = _NAME.match(buf, i + 1)
        if m is None:
            if i + 1 >= len(buf):
                raise _NeedMore
            return None
        if m.end() >= len(buf):
            raise _NeedMore
        name = m.group(0)
        if allowed is not None and name not in allowed:
            return None
        j = m.end()
        if buf.startswith(">", j):
            return name, j + 1, False
        if buf.startswith("/>", j):
            return name, j + 2, True
        if buf[j] == "/" and j + 1 >= len(buf):
            raise _NeedMore
        return None

    # -- bookkeeping ------------------------------------------------------------

    def _new_call(
        self,
        name: str,
        start: int,
        end: int,
        *,
        raw: dict[str, str] | None = None,
        error: str | None = None,
    ) -> ParsedCall:
        call = ParsedCall(
            index=len(self.calls), name=name, raw=raw or {}, error=error, start=start, end=end
        )
        self.calls.append(call)
        return call

    def _finish(self, call: ParsedCall) -> ParsedCall:
        if call.error is None and _in_fence(self.buf, call.start):
            call.error = (
                f"<{call.name}> inside a ``` code fence was not run; "
                "write tool calls as plain XML outside code fences"
            )
        return call

    def _report_truncated_tag(self, done: list[ParsedCall]) -> None:
        lt = self.buf.find("<", self.pos)
        m = _NAME.match(self.buf, lt + 1) if lt >= 0 else None
        if m and (m.group(0) in self.children or _CALLISH.match(m.group(0))):
            name = m.group(0)
            done.append(
                self._new_call(
                    name,
                    lt,
                    len(self.buf),
                    error=f"unclosed element <{name}>: the message ended inside its tag",
                )
            )
        self.pos = len(self.buf)


def _trim(text: str) -> str:
    if text.startswith("\r\n"):
        text = text[2:]
    elif text.startswith("\n"):
        text = text[1:]
    if text.endswith("\r\n"):
        text = text[:-2]
    elif text.endswith("\n"):
        text = text[:-1]
    return text


def _partial_attr(buf: str, i: int) -> bool:
    """True when buf[i:] could still grow into `name="value"`."""
    rest = buf[i:]
    return (
        re.fullmatch(r"[A-Za-z_][\w\-]*(\s*(=\s*((\"[^\"]*)|('[^']*))?)?)?", rest, re.S) is not None
    )


def _in_fence(buf: str, pos: int) -> bool:
    return len(_FENCE.findall(buf, 0, pos)) % 2 == 1


def parse_all(
    text: str, children: Mapping[str, frozenset[str]], bare: Mapping[str, str]
) -> list[ParsedCall]:
    """Parse a whole message at once (tests, trace replay)."""
    parser = StreamParser(children, bare)
    return parser.feed(text) + parser.close()
