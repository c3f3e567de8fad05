"""Text as UTF-8 can carry it.

A Python `str` may hold lone UTF-16 surrogates: JSON's `"\\ud800"` decodes to one, and
so does a non-UTF-8 byte in a command-line argument (`surrogateescape`). SQLite, the
JSON event stream and files written as UTF-8 refuse them, so text is mended where it
enters the system: the model's stream (`backends._stream`), the user's query
(`Session.run`) and the language server's transport.
"""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """`text` with surrogate pairs joined and lone surrogates replaced by U+FFFD."""
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
