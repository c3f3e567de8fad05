"""The streaming XML tool-call parser: every malformed shape becomes an error call,
never an exception, and chunking never changes what is parsed."""

import pytest
from opencomposer.agent.xmlcalls import StreamParser, parse_all, without_calls
from opencomposer.tools.specs import parser_rules

_CHILDREN, _BARE = parser_rules()


def parse(text):
    return parse_all(text, _CHILDREN, _BARE)


def parse_chunked(text, size):
    p = StreamParser(_CHILDREN, _BARE)
    calls = []
    for i in range(0, len(text), size):
        calls += p.feed(text[i : i + size])
    return calls + p.close()


MESSAGE = """I'll look at both.
<grep pattern="def retry" path="src/"/>
<read_file path="tests/test_retry.py" start_line="1" end_line="80"/>
<edit_file path="src/retry.py">
<old>    if a < b && c > d:</old>
<new>
    delay = min(cap, base * 2 ** attempt)  # <b>raw</b> &amp; stays
</new>
</edit_file>
done"""


def test_calls_and_raw_children():
    calls = parse(MESSAGE)
    assert [c.name for c in calls] == ["grep", "read_file", "edit_file"]
    assert all(c.error is None for c in calls)
    assert calls[0].raw == {"pattern": "def retry", "path": "src/"}
    assert calls[2].raw["old"] == "    if a < b && c > d:"
    assert (
        calls[2].raw["new"] == "    delay = min(cap, base * 2 ** attempt)  # <b>raw</b> &amp; stays"
    )
    assert [c.index for c in calls] == [0, 1, 2]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 50])
def test_chunking_does_not_change_the_parse(size):
    whole = [(c.name, c.raw, c.error) for c in parse(MESSAGE)]
    assert [(c.name, c.raw, c.error) for c in parse_chunked(MESSAGE, size)] == whole


def test_call_is_returned_when_its_closing_tag_arrives():
    p = StreamParser(_CHILDREN, _BARE)
    assert p.feed('<read_file path="a.py"') == []
    got = p.feed("/> and then <grep pattern")
    assert [c.name for c in got] == ["read_file"]
    assert p.feed('="x"/>')[0].name == "grep"


def test_bare_content_fills_the_single_child_parameter():
    (call,) = parse("<run_terminal>echo a < b && ls</run_terminal>")
    assert call.error is None and call.raw == {"command": "echo a < b && ls"}


def test_attribute_entities_are_unescaped():
    (call,) = parse('<grep pattern="a &lt; b &amp;&amp; &quot;c&quot;"/>')
    assert call.raw["pattern"] == 'a < b && "c"'


def test_unknown_tool_with_attributes_is_a_call():
    (call,) = parse('<run_command cmd="ls"/>')
    assert call.name == "run_command" and call.error is None  # rejected later by the spec lookup


def test_prose_is_not_a_call():
    assert parse("if a < b then <b>bold</b> and <file_path> or <div class='x'>") == []


def test_stray_closing_tag():
    (call,) = parse("text </edit_file> more")
    assert "stray closing tag" in call.error


def test_unclosed_element():
    (call,) = parse('<edit_file path="a.py">\n<old>x</old>\n<new>y')
    assert "unclosed element <edit_file>" in call.error


def test_message_ending_inside_a_tag():
    (call,) = parse('<read_file path="a.p')
    assert "unclosed" in call.error


def test_malformed_attribute_then_next_call_still_parses():
    calls = parse('<read_file path=a.py/>\n<glob pattern="*.py"/>')
    assert "malformed attribute" in calls[0].error
    assert calls[1].name == "glob" and calls[1].error is None


def test_calls_in_code_fences_are_reported_not_run():
    calls = parse('```xml\n<read_file path="a.py"/>\n```\n<glob pattern="*"/>')
    assert "code fence" in calls[0].error
    assert calls[1].error is None


def test_child_given_twice():
    (call,) = parse('<edit_file path="a"><old>x</old><old>y</old><new>z</new></edit_file>')
    assert "given twice" in call.error


def test_unexpected_text_in_a_call_without_bare_slot():
    (call,) = parse('<edit_file path="a">just text</edit_file>')
    assert "unexpected text" in call.error


def test_huge_message_is_linear_enough():
    body = "x" * 1_000_000
    (call,) = parse_chunked(
        f'<write_file path="big.txt"><content>{body}</content></write_file>', 4096
    )
    assert call.raw["content"] == body


def _best_time(fn, repeat=5):
    import time

    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _one_against_ten(make_text, n, chunk):
    """time(one message of size n) / time(ten messages of size n/10), same chunking:
    about 1 when parsing is linear, about 10 when it is quadratic in the message."""
    whole, part = make_text(n), make_text(n // 10)
    one = _best_time(lambda: parse_chunked(whole, chunk))
    ten = _best_time(lambda: [parse_chunked(part, chunk) for _ in range(10)])
    return one / ten


@pytest.mark.parametrize("chunk", [16, 10**9])
def test_ten_thousand_calls_parse_in_linear_time(chunk):
    """Guards the quadratic scan (fence parity recounted from the message start for
    every call, the whole buffer copied per chunk) that held 10,000 calls in one reply
    for ~100 s before the first one started."""

    def calls(n):
        return "".join(f'<read_file path="f{i}.py"/>\n' for i in range(n))

    parsed = parse_chunked(calls(10_000), chunk)
    assert [c.raw["path"] for c in parsed] == [f"f{i}.py" for i in range(10_000)]
    assert all(c.error is None for c in parsed)
    assert _one_against_ten(calls, 10_000, chunk) < 3


@pytest.mark.parametrize("where", ["attribute", "child"])
def test_a_200k_character_parameter_streams_in_linear_time(where):
    """Guards the rescan of an unfinished attribute (or child) from its start on every
    new chunk, which took ~98 s for a 200,000-character attribute."""

    def message(n):
        if where == "attribute":
            return f'<grep pattern="{"a" * n}"/>'
        return f'<write_file path="x"><content>{"a" * n}</content></write_file>'

    (call,) = parse_chunked(message(200_000), 16)
    assert len(call.raw["pattern" if where == "attribute" else "content"]) == 200_000
    assert _one_against_ten(message, 200_000, 16) < 3


def test_offsets_and_text_survive_the_dropped_prefix():
    """Call offsets are message offsets, and `text` is the whole message, although the
    parser keeps only the unconsumed tail."""
    text = "x" * 5000 + '<grep pattern="p"/>' + "y" * 5000 + '<glob pattern="*.py"/>tail'
    p = StreamParser(_CHILDREN, _BARE)
    calls = []
    for i in range(0, len(text), 7):
        calls += p.feed(text[i : i + 7])
    calls += p.close()
    assert [text[c.start : c.end] for c in calls] == [
        '<grep pattern="p"/>',
        '<glob pattern="*.py"/>',
    ]
    assert p.text == text


def test_a_fence_opened_long_before_still_counts():
    """The fence parity is counted forward once; a call far after an opening fence is
    still reported, not run, and one after the closing fence runs."""
    text = "```\n" + "code line\n" * 20_000 + '<read_file path="a"/>\n```\n<read_file path="b"/>'
    first, second = parse_chunked(text, 64)
    assert "code fence" in first.error and second.error is None


PROSE = (
    'I\'ll read both.\n<read_file path="a.py"/>\n<edit_file path="b.py">\n<old>x < 1 && y</old>\n'
    "<new>if a<b: pass</new>\n</edit_file>\nThen `List<int>` stays, <b>bold</b> stays.\n"
    "```\n<grep pattern='x'/>\n```\n<unclosed_thing a='1'"
)


def test_prose_is_the_message_without_its_calls_whatever_the_chunking():
    """Guards live views against showing tool-call XML, or text that later turns out to
    open a call: `prose()` hands out only what the parser has decided, and the pieces
    join to the message without its calls (fenced and unclosed calls included)."""
    import random

    whole = without_calls(PROSE, parse(PROSE))
    assert whole == (
        "I'll read both.\n\n\nThen `List<int>` stays, <b>bold</b> stays.\n```\n\n```\n"
    )
    rng = random.Random(7)
    for _ in range(300):
        p, pieces, i = StreamParser(_CHILDREN, _BARE), [], 0
        while i < len(PROSE):
            n = rng.randint(1, 9)
            p.feed(PROSE[i : i + n])
            piece = p.prose()
            assert "<read_file" not in piece and "<old>" not in piece
            pieces.append(piece)
            i += n
        p.close()
        pieces.append(p.prose())
        assert "".join(pieces) == whole


def test_prose_holds_back_only_what_may_still_open_a_call():
    p = StreamParser(_CHILDREN, _BARE)
    p.feed("Let me look. <read")
    assert p.prose() == "Let me look. "
    p.feed('_file path="a.py"/> and a < b ')
    assert p.prose() == " and a < b "
