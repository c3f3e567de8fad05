"""Secret redaction applied to everything before it reaches the trace store.

Two sources of secrets: well-known token shapes (API keys, bearer tokens, private
keys, `password=…` assignments), and the values found in the workspace's `.env`
files, which are replaced wherever they appear (a tool result that printed one,
an edit that copied one).
"""

from __future__ import annotations

import re
from pathlib import Path

MARK = "[REDACTED]"

_PATTERNS = [
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", re.S),
    re.compile(r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_\-]{16,}"),
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"),
    re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"),
    re.compile(r"\bxox[abposr]-[A-Za-z0-9\-]{10,}"),
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    re.compile(r"\bAIza[0-9A-Za-z_\-]{30,}"),
    re.compile(r"\bhf_[A-Za-z0-9]{30,}"),
    re.compile(r"\beyJ[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,}"),  # JWT
]
# A quoted literal assigned to a key that names a secret (`api_key = "…"`, JSON
# `"token": "…"`), and env-style `SECRET_TOKEN=…` lines; the key is kept. Code such
# as `token = get_token()` is left alone: traces are training data.
_SECRET_KEY = r"[\w.\-]*(?:api[_-]?key|secret|token|passw(?:or)?d|credential)[\w.\-]*"
_ASSIGN = re.compile(rf"(?i)(\b{_SECRET_KEY}[\"']?\s*[:=]\s*[\"'])([^\"'\s]{{6,}})(?=[\"'])")
_ENV_LINE = re.compile(rf"(?im)^(\s*(?:export\s+)?{_SECRET_KEY}=)([^\s\"']{{6,}})$")
_BEARER = re.compile(r"(?i)(\bbearer\s+)([A-Za-z0-9._\-+/=]{12,})")


class Redactor:
    def __init__(self, extra_values: set[str] | None = None):
        self.values = sorted(
            (v for v in (extra_values or set()) if len(v) >= 6), key=len, reverse=True
        )

    @classmethod
    def for_workspace(cls, root: Path) -> Redactor:
        values: set[str] = set()
        try:
            candidates = list(root.glob(".env*")) + list(root.glob("*/.env*"))
        except OSError:
            candidates = []
        for f in candidates[:50]:
            try:
                if not f.is_file() or f.stat().st_size > 1_000_000:
                    continue
                for line in f.read_text(errors="replace").splitlines():
                    key, sep, value = line.partition("=")
                    if sep and not key.strip().startswith("#"):
                        values.add(value.strip().strip("'\""))
            except OSError:
                continue
        return cls(values)

    def __call__(self, text: str | None) -> str | None:
        if not text:
            return text
        for v in self.values:
            if v in text:
                text = text.replace(v, MARK)
        for p in _PATTERNS:
            text = p.sub(MARK, text)
        text = _ASSIGN.sub(lambda m: m.group(1) + MARK, text)
        text = _ENV_LINE.sub(lambda m: m.group(1) + MARK, text)
        return _BEARER.sub(lambda m: m.group(1) + MARK, text)
