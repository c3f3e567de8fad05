"""cap() and OutputCapture: head and tail kept, marker says how much was cut, memory bounded."""

from __future__ import annotations

from opencomposer.tools.output import OutputCapture, cap


def test_cap_keeps_short_text_whole() -> None:
    assert cap("abc\n", 10) == "abc\n"


def test_cap_keeps_head_and_tail_on_line_boundaries() -> None:
    text = "".join(f"line {i}\n" for i in range(1000))
    out = cap(text, 200)
    assert out.startswith("line 0\n") and out.endswith("line 999\n")
    assert "characters (" in out and "lines) cut from the middle" in out
    assert len(out) < 300
    for line in out.splitlines():
        assert line.startswith(("line ", "[..."))


def test_capture_bounds_memory_and_counts_the_cut() -> None:
    cap_ = OutputCapture(1000)
    chunk = b"0123456789" * 6553 + b"\n"  # ~64 KiB
    for _ in range(2000):  # ~128 MiB fed
        cap_.feed(chunk)
        assert len(cap_._head) + len(cap_._tail) <= 3 * 1000
    text = cap_.text()
    assert cap_.total == 2000 * len(chunk)
    assert cap_.truncated
    assert text.startswith("0123456789")
    assert f"{cap_.total - 1000} bytes" in text
    assert len(text) < 1200


def test_capture_without_overflow_is_exact() -> None:
    cap_ = OutputCapture(100)
    for part in (b"hello ", b"w\xc3", b"\xa9rld\n"):
        cap_.feed(part)
    assert cap_.text() == "hello wérld\n"
    assert not cap_.truncated
