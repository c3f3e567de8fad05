"""Text as UTF-8 can carry it, and as a person approving it can see it.

A Python `str` may hold lone UTF-16 surrogates: JSON's `"\\ud800"` decodes to one, and
so does a non-UTF-8 byte in a command-line argument (`surrogateescape`). SQLite, the
JSON event stream and files written as UTF-8 refuse them, so text is mended where it
enters the system: the model's stream (`backends._stream`), the user's query
(`Session.run`) and the language server's transport.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator, Sequence

_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` with surrogate pairs joined and lone surrogates replaced by U+FFFD."""
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def reveal(text: str) -> Iterator[tuple[str, bool]]:
    """`text` in pieces `(piece, escaped)` that show every character the model wrote:
    control, format and bidi characters (ANSI escapes, `\\r`, U+202E, zero-width
    joiners) become `\\x1b`-style escapes instead of acting on the terminal or the
    editor that shows them; newlines and tabs stay. Approval prompts print commands
    through it, whole: a person decides on what they can see."""
    plain: list[str] = []
    for ch in text:
        if ch in "\n\t" or (unicodedata.category(ch)[0] != "C" and ch not in "\u2028\u2029"):
            plain.append(ch)
            continue
        if plain:
            yield "".join(plain), False
            plain = []
        yield ascii(ch)[1:-1], True
    if plain:
        yield "".join(plain), False


def revealed(text: str) -> str:
    """`reveal` as one string."""
    return "".join(piece for piece, _ in reveal(text))


def common_ends(a: Sequence[object], b: Sequence[object]) -> tuple[int, int]:
    """(head, tail): how many items `a` and `b` share at their start, and then at their
    end in what is left (two texts' characters or lines: where they differ)."""
    most = min(len(a), len(b))
    head = 0
    while head < most and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < most - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    return head, tail
