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

Parsing is linear in the message, however it is chunked: the parser never looks at
consumed text again (the code-fence parity is counted forward, once), and a
construct that cannot be decided yet (a long attribute, a long child) names what it
waits for, which is looked for in the new chunks alone. Ten thousand calls in one
message, or a 200,000-character attribute streamed in small chunks, parse in tens of
milliseconds.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

_NAME = re.compile(r"[A-Za-z_][\w\-]*")
_SPACE = re.compile(r"\s*")
_CALLISH = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")
_MAX_NAME = 128  # a longer element or attribute name is prose, never a call


def _skip_space(buf: str, i: int) -> int:
    """The first index at or after i that holds no white space (len(buf) if none)."""
    m = _SPACE.match(buf, i)
    assert m is not None  # `\s*` matches the empty string anywhere
    return m.end()


@dataclass
class ParsedCall:
    index: int
    name: str
    raw: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    start: int = 0
    end: int = 0


_SKIP = ParsedCall(index=-1, name="")
_NONSPACE = ""  # _NeedMore(_NONSPACE): white space alone cannot decide it


class _NeedMore(Exception):
    """The buffer ends before the construct at hand can be decided. `until` is what
    must arrive before another look can decide it: a string that must appear in the
    new text, `_NONSPACE`, or None for any text at all."""

    def __init__(self, until: str | None = None) -> None:
        self.until = until


class _Wait:
    """Holds the parser back until what it waits for has arrived, looking only at new
    text (plus the few characters a token may straddle)."""

    def __init__(self, until: str, tail: str) -> None:
        self.until = until
        self.carry = tail[-(len(until) - 1) :] if len(until) > 1 else ""

    def arrived(self, chunk: str) -> bool:
        if self.until == _NONSPACE:
            return not chunk.isspace()
        text = self.carry + chunk
        if self.until in text:
            return True
        keep = len(self.until) - 1
        self.carry = text[-keep:] if keep else ""
        return False


class _Fences:
    """Whether a position lies inside a ``` code fence: the parity of the fence lines
    (`^[ \\t]*```) before it, advanced as the parser moves on, so that each question
    costs only the text since the last one."""

    def __init__(self) -> None:
        self.inside = False
        self._state = 0  # 0: in the line's indent; 1, 2: backticks seen; -1: line decided

    def advance(self, buf: str, i: int, end: int) -> None:
        state = self._state
        while i < end:
            if state < 0:
                nl = buf.find("\n", i, end)
                if nl < 0:
                    break
                i, state = nl + 1, 0
                continue
            c = buf[i]
            i += 1
            if c == "`":
                state += 1
                if state == 3:
                    self.inside = not self.inside
                    state = -1
            elif c == "\n":
                state = 0
            elif state != 0 or c not in " \t":
                state = -1
        self._state = state


@dataclass
class _Tag:
    """An opening tag being read: what is known of it so far."""

    name: str
    start: int  # offset of its `<` in the message
    known: bool
    fenced: bool
    raw: dict[str, str] = field(default_factory=dict)


class StreamParser:
    """Feed text chunks; get complete calls back as soon as they close.

    `children` maps each known tool to the names of its parameters that may be
    written as child elements; `bare` maps a tool to the parameter that bare content
    fills (tools with a single child parameter).

    `buf` holds only the text not yet consumed, from message offset `base` on (call
    offsets are message offsets); what an unfinished construct waits for (a closing
    quote, `</old>`, ...) is looked for in each new chunk alone, and the chunks are
    joined only once it has arrived.
    """

    def __init__(self, children: Mapping[str, frozenset[str]], bare: Mapping[str, str]):
        self.children = children
        self.bare = bare
        self.buf = ""
        self.base = 0
        self.pos = 0
        self.calls: list[ParsedCall] = []
        self._consumed: list[str] = []  # the message before `base`
        self._pending: list[str] = []  # chunks that arrived while waiting
        self._wait: _Wait | None = None
        self._fences = _Fences()
        self._fenced_to = 0  # message offset up to which `_fences` has looked
        self._tag: _Tag | None = None  # an opening tag being read
        self._open: ParsedCall | None = None  # a call whose body is being read
        self._open_fenced = False
        self._held: list[str] = []  # the message from `_held_at` on, for `prose`
        self._held_at = 0
        self._prose_calls = 0  # calls `prose` has cut out so far

    @property
    def text(self) -> str:
        """The whole message so far."""
        head = "".join(self._consumed)
        self._consumed = [head]
        return head + self.buf + "".join(self._pending)

    def feed(self, chunk: str) -> list[ParsedCall]:
        if not chunk:
            return []
        self._pending.append(chunk)
        self._held.append(chunk)
        if self._wait is not None and not self._wait.arrived(chunk):
            return []
        return self._scan(final=False)

    def close(self) -> list[ParsedCall]:
        """End of message: whatever is still open is reported as unclosed."""
        done = self._scan(final=True)
        if self._open is not None:
            call = self._open
            call.error = f"unclosed element <{call.name}>: the message ended before </{call.name}>"
            call.end = self.base + len(self.buf)
            self._open = None
            self.pos = len(self.buf)
            done.append(call)
        return done

    @property
    def decided(self) -> int:
        """The message offset before which every character is known to be prose or part
        of a finished call; what follows may still turn out to be a call."""
        if self._open is not None:
            return self._open.start
        if self._tag is not None:
            return self._tag.start
        return self.base + self.pos

    def prose(self) -> str:
        """The prose decided since the last `prose()`: the message's text outside
        tool-call elements, for live views. Text that may still open a call is held
        back until the parser has decided it; after `close()` the rest comes out, so
        the pieces join to `without_calls` of the whole message."""
        end = self.decided
        if end <= self._held_at:
            return ""
        held, base = "".join(self._held), self._held_at
        out, at = [], base
        while self._prose_calls < len(self.calls) and self.calls[self._prose_calls].start < end:
            call = self.calls[self._prose_calls]
            out.append(held[at - base : call.start - base])
            at = call.end
            self._prose_calls += 1
        out.append(held[at - base : end - base])
        at = max(at, end)
        self._held, self._held_at = [held[at - base :]], at
        return "".join(out)

    # -- scanning ----------------------------------------------------------------

    def _scan(self, *, final: bool) -> list[ParsedCall]:
        if self._pending:
            self.buf += "".join(self._pending)
            self._pending.clear()
        self._wait = None
        done: list[ParsedCall] = []
        while True:
            try:
                call = self._step(final)
            except _NeedMore as more:
                if not final:
                    if more.until is not None:
                        self._wait = _Wait(more.until, self.buf)
                    break
                # The message ended inside an opening tag or a stray fragment.
                if self._open is None:
                    self._report_truncated_tag(done)
                break
            if call is None:
                break
            done.append(call)
        self._drop_consumed()
        return done

    def _drop_consumed(self) -> None:
        """Move the text before `pos` out of the working buffer (kept for `text`)."""
        if self.pos == 0:
            return
        self._in_fence(self.pos)  # the fence count must pass it first
        self._consumed.append(self.buf[: self.pos])
        self.buf = self.buf[self.pos :]
        self.base += self.pos
        self.pos = 0

    def _in_fence(self, i: int) -> bool:
        """Whether buffer position i (never behind an earlier question) is in a fence."""
        at = self.base + i
        if at > self._fenced_to:
            self._fences.advance(self.buf, self._fenced_to - self.base, i)
            self._fenced_to = at
        return self._fences.inside

    def _step(self, final: bool) -> ParsedCall | None:
        if self._open is not None:
            return self._read_body(self._open)
        if self._tag is not None:
            call = self._read_tag(self._tag)
            if call is not _SKIP:
                return call
        return self._read_text(final)

    def _read_text(self, final: bool) -> ParsedCall | None:
        buf = self.buf
        while True:
            lt = buf.find("<", self.pos)
            if lt < 0:
                self.pos = len(buf)
                return None
            self.pos = lt  # the prose before it is consumed
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
            if m.end() - m.start() > _MAX_NAME:
                self.pos = m.end()
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
                        self.base + lt,
                        self.base + self.pos,
                        error=f"stray closing tag </{name}> with no open <{name}>",
                    )
                self.pos = m.end()
                continue
            if not (after.isspace() or after in "/>"):
                self.pos = m.end()
                continue
            known = name in self.children
            if not known and not _CALLISH.match(name):
                self.pos = m.end()
                continue
            fenced = self._in_fence(lt)
            if not known and fenced:
                self.pos = m.end()
                continue
            self._tag = _Tag(name=name, start=self.base + lt, known=known, fenced=fenced)
            self.pos = m.end()
            call = self._read_tag(self._tag)
            if call is not _SKIP:
                return call

    def _read_tag(self, tag: _Tag) -> ParsedCall:
        """Read the opening tag on from `pos` to its `/>` or `>`; unknown names that
        carry no attributes are prose (`<file_path>`), and come back as _SKIP."""
        buf = self.buf
        while True:
            i = self.pos = _skip_space(buf, self.pos)
            if i >= len(buf):
                raise _NeedMore
            if buf.startswith("/>", i):
                self.pos, self._tag = i + 2, None
                call = self._new_call(tag.name, tag.start, self.base + i + 2, raw=tag.raw)
                return self._finish(call, tag.fenced)
            if buf[i] == "/" and i + 1 == len(buf):
                raise _NeedMore
            if buf[i] == ">":
                self.pos, self._tag = i + 1, None
                if not tag.known and not tag.raw:
                    return _SKIP
                call = self._new_call(tag.name, tag.start, self.base + i + 1, raw=tag.raw)
                self._open, self._open_fenced = call, tag.fenced
                return self._read_body(call)
            attr = self._attribute(i)
            if attr is None:
                if not tag.known and not tag.raw:
                    self._tag = None  # `<some_word text` in prose: not a call
                    return _SKIP
                end = buf.find(">", i)
                if end < 0:
                    raise _NeedMore(">")
                self.pos, self._tag = end + 1, None
                bad = buf[i : min(end, i + 40)]
                return self._new_call(
                    tag.name,
                    tag.start,
                    self.base + end + 1,
                    raw=tag.raw,
                    error=f"malformed attribute in <{tag.name}> near {bad!r}",
                )
            name, value, self.pos = attr
            tag.raw[name] = value

    def _attribute(self, i: int) -> tuple[str, str, int] | None:
        """`name="value"` (or single quotes) at i as (name, unescaped value, end);
        None if what stands there cannot become one."""
        buf = self.buf
        m = _NAME.match(buf, i)
        if m is None or m.end() - i > _MAX_NAME:
            return None
        j = m.end()
        if j == len(buf):
            raise _NeedMore  # the name may go on
        j = _skip_space(buf, j)
        if j == len(buf):
            raise _NeedMore(_NONSPACE)
        if buf[j] != "=":
            return None
        j = _skip_space(buf, j + 1)
        if j == len(buf):
            raise _NeedMore(_NONSPACE)
        quote = buf[j]
        if quote not in "\"'":
            return None
        end = buf.find(quote, j + 1)
        if end < 0:
            raise _NeedMore(quote)
        return m.group(0), html.unescape(buf[j + 1 : end]), end + 1

    def _read_body(self, call: ParsedCall) -> ParsedCall:
        buf = self.buf
        close_tag = f"</{call.name}>"
        allowed = self.children.get(call.name)
        while True:
            i = _skip_space(buf, self.pos)
            if i >= len(buf):
                raise _NeedMore(_NONSPACE)
            if buf.startswith(close_tag, i):
                self.pos = i + len(close_tag)
                self._open = None
                call.end = self.base + self.pos
                return self._finish(call, self._open_fenced)
            if len(buf) - i < len(close_tag) and close_tag.startswith(buf[i:]):
                raise _NeedMore
            child = self._child_at(i, allowed)
            if child is None:
                # Bare content up to the call's closing tag.
                end = buf.find(close_tag, i)
                if end < 0:
                    raise _NeedMore(close_tag)
                body = _trim(buf[self.pos : end])
                self.pos = end + len(close_tag)
                self._open = None
                call.end = self.base + self.pos
                slot = self.bare.get(call.name)
                if slot is not None and slot not in call.raw:
                    call.raw[slot] = body
                elif call.error is None:
                    call.error = f"unexpected text inside <{call.name}>: {body[:60]!r}"
                return self._finish(call, self._open_fenced)
            cname, content_start, self_closing = child
            if self_closing:
                call.raw.setdefault(cname, "")
                self.pos = content_start
                continue
            cclose = f"</{cname}>"
            end = buf.find(cclose, content_start)
            if end < 0:
                raise _NeedMore(cclose)
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
        if m.end() - m.start() > _MAX_NAME:
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
        """A call spanning message offsets start..end."""
        call = ParsedCall(
            index=len(self.calls),
            name=name,
            raw=raw or {},
            error=error,
            start=start,
            end=end,
        )
        self.calls.append(call)
        return call

    def _finish(self, call: ParsedCall, fenced: bool) -> ParsedCall:
        if call.error is None and fenced:
            call.error = (
                f"<{call.name}> inside a ``` code fence was not run; "
                "write tool calls as plain XML outside code fences"
            )
        return call

    def _report_truncated_tag(self, done: list[ParsedCall]) -> None:
        tag, self._tag = self._tag, None
        if tag is not None:
            name, start = tag.name, tag.start
        else:
            lt = self.buf.find("<", self.pos)
            m = _NAME.match(self.buf, lt + 1) if lt >= 0 else None
            if not (m and (m.group(0) in self.children or _CALLISH.match(m.group(0)))):
                self.pos = len(self.buf)
                return
            name, start = m.group(0), self.base + lt
        self.pos = len(self.buf)
        done.append(
            self._new_call(
                name,
                start,
                self.base + self.pos,
                error=f"unclosed element <{name}>: the message ended inside its tag",
            )
        )


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


def without_calls(text: str, calls: Sequence[ParsedCall]) -> str:
    """`text` with the elements of `calls` (the parser's calls on it) cut out: the
    message as a person reads it, the calls being shown apart."""
    out, at = [], 0
    for call in calls:
        out.append(text[at : call.start])
        at = max(at, call.end)
    out.append(text[at:])
    return "".join(out)


def parse_all(
    text: str, children: Mapping[str, frozenset[str]], bare: Mapping[str, str]
) -> list[ParsedCall]:
    """Parse a whole message at once (tests, trace replay)."""
    parser = StreamParser(children, bare)
    return parser.feed(text) + parser.close()
