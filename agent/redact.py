"""Secret redaction applied to everything before it reaches the trace store.

Every rule matches within one line, so a secret is caught however a text was
cut: a partial read of a key file, output split across tool results, a numbered
`read_file` line, a `grep` hit, a diff line. What is replaced by `[REDACTED]`:

- **Token shapes**: AWS key ids (`AKIA…`, `ASIA…`), GitHub (`ghp_…`,
  `github_pat_…`), GitLab (`glpat-…`), OpenAI/Anthropic (`sk-…`), Stripe secret,
  restricted and webhook keys (`sk_live_`, `sk_test_`, `rk_live_`, `rk_test_`,
  `whsec_`; publishable `pk_` keys are public and stay), Slack tokens (`xoxb-`,
  `xoxp-`, `xapp-`) and webhook URLs, Google API keys (`AIza…`) and OAuth tokens
  (`ya29.`), Hugging Face (`hf_`), npm (`npm_`), PyPI (`pypi-`), SendGrid, JWTs.
- **Private keys**: a `-----BEGIN … PRIVATE KEY-----` header line starts a block
  whose lines are all redacted up to the END line; a BEGIN followed by key text on
  the same line (JSON's `"private_key": "-----BEGIN …\\nMIIE…"`) is redacted to the
  END marker or the end of the line. Without any marker, a line that is nothing
  but a base64 run of 40 or more characters mixing upper case, lower case and
  digits (after a `read_file` number, a `grep` location, a diff sign or a quote),
  or ending a line after any text with 60 or more such characters, is redacted:
  that is what the body of a key file read in part looks like, and also a bare
  40-character AWS secret key. Hex digests (one case) stay.
- **Credentials in context**: `Authorization: Bearer|Basic|token …`,
  `scheme://user:password@host`, and the value given to a key that names a
  secret. A key names a secret when its last words (split at `_ - .` and
  camelCase) are one of api key, secret, token, password, passwd, pass, passphrase,
  credential(s), private/access/account/auth/secret/session/signing/encryption/master
  key, client secret, auth — optionally followed by key, base, value, b64:
  `aws_secret_access_key`, `GITHUB_TOKEN`, `clientSecret`, `X-Api-Key`,
  `SECRET_KEY_BASE`, `--password`, but not `max_tokens`, `token_type`,
  `tokenizer` or `password_min_length`. For such a key:
  - a quoted literal (`password = "…"`, JSON `"token": "…"`) is redacted;
  - an unquoted value (`aws_secret_access_key = …` in an INI file,
    `DB_PASSWORD=…` in a `.env`, `token: …` in YAML, `--token abc…`) is
    redacted unless it reads as code or a reference: a call or index
    (`password = input()`, `os.environ["X"]`), a dotted name or a bare word
    without digits (`token = self.token`, `secret = None`), a number, `$VAR`,
    `{{ template }}` or `<placeholder>`. A shell-style `NAME=value` line with an
    upper-case secret name is redacted whatever its value, except `$VAR` and calls.
- **`.env` files**: the values found in the workspace's `.env`, `.env.*` and
  `*.env` files at any depth (bounded walk) are replaced wherever they appear, and
  `Redactor.env_file` redacts every `KEY=value` value of a text known to come
  from such a file (the trace store applies it to a tool result when the call
  names a `.env` file).

False positives cost training data (a turn whose text changed keeps no token
ids), hence the care for code: `password = input()` stays as written.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from pathlib import Path

MARK = "[REDACTED]"

# Token shapes, each with the literal text it holds (checked first: cheap). Each
# pattern starts with its literal, then looks back for a word boundary before it
# (`(?<!\w.{N})`, N the literal's length): a literal first lets `re` skip ahead
# fast, where a leading `\b` makes it try every position.
_TOKENS = [
    (hints, re.compile(pattern))
    for hints, pattern in (
        (
            ("AKIA", "ASIA", "AGPA", "AIDA", "AROA", "ANPA", "ANVA", "AIPA"),
            r"A(?:KIA|SIA|GPA|IDA|ROA|NPA|NVA|IPA)(?<!\w.{4})[0-9A-Z]{16}\b",
        ),
        (("sk-",), r"sk-(?<!\w.{3})(?:proj-|ant-|svcacct-)?[A-Za-z0-9_\-]{16,}"),
        (("_live_", "_test_"), r"[sr]k_(?:live|test)_(?<!\w.{8})[0-9A-Za-z]{10,}"),
        (("whsec_",), r"whsec_(?<!\w.{6})[0-9A-Za-z+/=]{16,}"),
        (("ghp_", "gho_", "ghu_", "ghs_", "ghr_"), r"gh[pousr]_(?<!\w.{4})[A-Za-z0-9]{20,}"),
        (("github_pat_",), r"github_pat_(?<!\w.{11})[A-Za-z0-9_]{20,}"),
        (("glpat-",), r"glpat-(?<!\w.{6})[A-Za-z0-9_\-]{20,}"),
        (("xox",), r"xox[abposre]-(?<!\w.{5})[A-Za-z0-9\-]{10,}"),
        (("xapp-",), r"xapp-(?<!\w.{5})\d-[A-Za-z0-9\-]{10,}"),
        (("hooks.slack.com",), r"https://hooks\.slack\.com/services/[A-Za-z0-9/_\-]+"),
        (("AIza",), r"AIza(?<!\w.{4})[0-9A-Za-z_\-]{30,}"),
        (("ya29.",), r"ya29\.(?<!\w.{5})[0-9A-Za-z_\-]{20,}"),
        (("GOCSPX-",), r"GOCSPX-(?<!\w.{7})[0-9A-Za-z_\-]{20,}"),
        (("hf_",), r"hf_(?<!\w.{3})[A-Za-z0-9]{30,}"),
        (("npm_",), r"npm_(?<!\w.{4})[A-Za-z0-9]{30,}"),
        (("pypi-",), r"pypi-(?<!\w.{5})[A-Za-z0-9_\-]{50,}"),
        (("SG.",), r"SG\.(?<!\w.{3})[A-Za-z0-9_\-]{16,}\.[A-Za-z0-9_\-]{16,}"),
        (("dop_v1_",), r"dop_v1_(?<!\w.{7})[a-f0-9]{40,}"),
        (("eyJ",), r"eyJ(?<!\w.{3})[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,}"),
    )
]

_PEM_BEGIN = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----")
_PEM_END = re.compile(r"-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----")
# What may stand before a line's content: a read_file or `cat -n` number, a grep
# location (`path:` or `path:12:`), a diff sign, a quote. Kept when the content
# is redacted.
_PREFIX = r"(?:[ \t]*\d+\t|[^\s:]+:(?:\d+[:\-])?)?[ \t]*[+\-<>]?[ \t]*[\"']?"
_PEM_HEADER_LINE = re.compile(rf"^({_PREFIX})-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----")
# The inside of a key block: base64, blank, or an RFC 1421 / OpenPGP header line.
_PEM_BODY_LINE = re.compile(rf"^({_PREFIX})(?:[A-Za-z0-9+/=]*|[A-Za-z][\w-]*: .*)[\"',]*\s*$")
_B64_LINE = re.compile(rf"(?m)^({_PREFIX})([A-Za-z0-9+/]{{40,}}={{0,2}})([\"']?[,;]?[ \t\r]*)$")
# The same run ending a line after any text (`look at /root/.ssh/id_rsa:MIIE…`):
# 60 or more characters, the length of a key's lines (64, OpenSSH 70), longer than
# checksums that end lines (go.sum's 44).
_B64_TAIL = re.compile(r"(?m)(?<=[\s:=])()([A-Za-z0-9+/]{60,}={0,2})([\"']?[,;]?[ \t\r]*)$")
_B64_RUN = re.compile(r"[A-Za-z0-9+/]{40}")
_INLINE_PEM = re.compile(
    r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----(?=(?:\\[nr]|[ \t])*[A-Za-z0-9+/]{16})"
    r".*?(?=-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|[\"']|$)",
    re.M,
)

_AUTH_HEADER = re.compile(
    r"(?i)(\b(?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?(?:(?:bearer|basic|token|bot|digest)\s+)?)"
    r"([A-Za-z0-9._~+/\-]{8,}=*)"
)
_BEARER = re.compile(r"(?i)(\bbearer\s+)([A-Za-z0-9._~+/\-]{12,}=*)")
_URL_CREDS = re.compile(r"(://[^\s:/@'\"<>]*:)([^\s@/'\"<>]+)(@)")

# Candidates for `key <sep> value`: a key holding a secret-ish fragment. Which keys
# really name a secret is decided by _names_secret on the words of the key.
_KEY = (
    r"(?:[A-Za-z_\-][\w.\-]{0,40}?)?(?i:key|secret|token|passw|passphrase|credential|auth)"
    r"[\w.\-]{0,40}"
)
_SEP = r"[\"']?\s*(?::\s*[A-Za-z_][\w\[\]., |]*?\s*)?(?:=>|:=|[:=])\s*"
_QUOTED = re.compile(rf"(?<![\w.\-])({_KEY})({_SEP}[rbuRBUf]{{0,2}})([\"'])((?:(?!\3)[^\n])+)(\3)")
_UNQUOTED = re.compile(rf"(?<![\w.\-])({_KEY})({_SEP})(?![\"'\s])([^\s\"'`,;)}}\]]+)")
_FLAG = re.compile(rf"(?<![\w\-])(--?{_KEY})([ \t]+)(?![\"'\-])([^\s\"'`,;)}}\]]+)")
_ENV_ASSIGN = re.compile(
    rf"(?m)^({_PREFIX}[ \t]*(?:export[ \t]+)?)([A-Za-z_][A-Za-z0-9_.\-]*)([ \t]*=[ \t]*)(.+?)[ \t\r]*$"
)
# Lowercase fragments of a secret-naming key: the assignment rules only look at the
# lines that hold one.
_FRAGMENTS = ("key", "secret", "token", "passw", "passphrase", "credential", "auth")

_SECRET_WORDS = re.compile(
    r"(?:^|_)(?:api_?key|apikey|secret|token|password|passwd|pass|passphrase|credentials?|"
    r"(?:private|access|account|auth|secret|session|signing|encryption|master)_?key|"
    r"client_?secret|auth)(?:_(?:key|base|value|b64))*$"
)
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_CODE_WORD = re.compile(r"^[A-Za-z_]+(?:\.[A-Za-z_]\w*)*$")
_NUMBER = re.compile(r"^[+\-]?\d+(?:\.\d+)?$")

# `.env`, `.env.local`, `prod.env`: a dotenv file's name anywhere in an argument
ENV_FILE = re.compile(r"(?:^|[/\\\s\"'=:])[\w\-]*\.env(?:\.[\w.\-]+)?(?=$|[\s\"',;:)|>])")
ENV_WALK_MAX_DIRS = 5_000
ENV_WALK_MAX_FILES = 50
_SKIP_DIRS = frozenset(
    {".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv", ".tox", ".nox",
     ".mypy_cache", ".pytest_cache", ".ruff_cache", "site-packages", "dist", "build"}
)  # fmt: skip


def _names_secret(key: str) -> bool:
    words = _CAMEL.sub("_", key.strip("\"'-")).lower()
    words = re.sub(r"[^a-z0-9]+", "_", words).strip("_")
    return bool(_SECRET_WORDS.search(words))


def _reads_as_code(value: str) -> bool:
    """A value that is a reference or an expression, not a literal secret."""
    v = re.sub(r"(?:\\[nrt])+$", "", value.strip())  # `secret = 1\n` inside a string
    return (
        not v
        or v[0] in "$%{<&*@"
        or "(" in v
        or "[" in v
        or v == MARK
        or bool(_CODE_WORD.match(v))
        or bool(_NUMBER.match(v))
    )


def _quoted(m: re.Match[str]) -> str:
    if not _names_secret(m.group(1)):
        return m.group(0)
    return m.group(1) + m.group(2) + m.group(3) + MARK + m.group(5)


def _unquoted(m: re.Match[str]) -> str:
    key, sep, value = m.group(1), m.group(2), m.group(3)
    if not _names_secret(key) or _reads_as_code(value):
        return m.group(0)
    return key + sep + MARK


def _shell_assign(m: re.Match[str]) -> str:
    """`NAME=value` lines (.env, `export`, `env` output) with a secret NAME."""
    pre, key, eq, value = m.groups()
    if eq != "=" or not (key.isupper() and _names_secret(key)):
        return m.group(0)  # `NAME = value` with spaces reads as code: _unquoted decides
    v = value.strip("\"'")
    if not v or v[0] == "$" or "(" in v or "[" in v or v == MARK:
        return m.group(0)
    return pre + key + eq + MARK


def _b64_line(m: re.Match[str]) -> str:
    body = m.group(2)
    if not (re.search(r"[a-z]", body) and re.search(r"[A-Z]", body) and re.search(r"\d", body)):
        return m.group(0)
    return m.group(1) + MARK + m.group(3)


def _pem_blocks(text: str) -> str:
    """Key blocks: from a BEGIN header line, every key line up to the END line."""
    out = []
    inside = False
    for line in text.splitlines(keepends=True):
        if not inside:
            header = _PEM_HEADER_LINE.match(line)
            if header and not _PEM_END.search(line):
                marker = _PEM_BEGIN.search(line)
                assert marker is not None
                rest = line[marker.end() :]
                inside = not rest.strip(" \t\r\n\"',")
                if inside:
                    out.append(line)
                    continue
            out.append(line)
            continue
        end = _PEM_END.search(line)
        if end:
            prefix = _PEM_BODY_LINE.match(line[: end.start()] + "\n")
            out.append((prefix.group(1) if prefix else "") + MARK + "\n" + line[end.start() :])
            inside = False
            continue
        body = _PEM_BODY_LINE.match(line)
        if body is None:
            inside = False  # not key material: the block was cut short
            out.append(line)
            continue
        newline = "\n" if line.endswith("\n") else ""
        out.append(body.group(1) + MARK + newline if line.strip() else line)
    return "".join(out)


def _assignments(line: str) -> str:
    line = _QUOTED.sub(_quoted, line)
    line = _ENV_ASSIGN.sub(_shell_assign, line)
    line = _UNQUOTED.sub(_unquoted, line)
    return _FLAG.sub(_unquoted, line)


def _on_lines_with(text: str, fragments: tuple[str, ...], fn: Callable[[str], str]) -> str:
    """`fn` applied to each line of `text` holding one of `fragments` (any case)."""
    low = text.lower()
    starts: set[int] = set()
    for f in fragments:
        i = low.find(f)
        while i != -1:
            starts.add(low.rfind("\n", 0, i) + 1)
            end = low.find("\n", i)
            i = -1 if end == -1 else low.find(f, end)
    if not starts:
        return text
    out, pos = [], 0
    for start in sorted(starts):
        end = text.find("\n", start)
        end = len(text) if end == -1 else end
        out += [text[pos:start], fn(text[start:end])]
        pos = end
    out.append(text[pos:])
    return "".join(out)


class Redactor:
    def __init__(self, extra_values: Iterable[str] | None = None):
        self.values = sorted(
            {v for v in (extra_values or ()) if len(v) >= 6}, key=len, reverse=True
        )
        self._cache: OrderedDict[str, str] = OrderedDict()

    @classmethod
    def for_workspace(cls, root: Path) -> Redactor:
        """A redactor that also knows the secret values of the workspace's `.env` files."""
        values: set[str] = set()
        for f in _env_files(Path(root)):
            try:
                if not f.is_file() or f.stat().st_size > 1_000_000:
                    continue
                text = f.read_text(errors="replace")
            except OSError:
                continue
            for line in text.splitlines():
                key, sep, value = line.partition("=")
                key = key.strip().removeprefix("export ").strip()
                if sep and key and not key.startswith("#"):
                    value = value.strip().strip("'\"")
                    if _env_value_is_secret(key, value):
                        values.add(value)
        return cls(values)

    def __call__(self, text: str | None) -> str | None:
        if not text:
            return text
        if len(text) >= 256:  # conversation prefixes come back every turn
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
        clean = self._redact(text)
        if len(text) >= 256:
            self._cache[text] = clean
            if len(self._cache) > 256:
                self._cache.popitem(last=False)
        return clean

    def _redact(self, text: str) -> str:
        for v in self.values:
            if v in text:
                text = text.replace(v, MARK)
        if "PRIVATE KEY" in text:
            text = _INLINE_PEM.sub(MARK, text)
            text = _pem_blocks(text)
        for hints, pattern in _TOKENS:
            if any(h in text for h in hints):
                text = pattern.sub(MARK, text)
        if _B64_RUN.search(text):
            text = _B64_LINE.sub(_b64_line, text)
            text = _B64_TAIL.sub(_b64_line, text)
        low = text.lower()
        if "authorization" in low:
            text = _AUTH_HEADER.sub(lambda m: m.group(1) + MARK, text)
        if "bearer" in low:
            text = _BEARER.sub(lambda m: m.group(1) + MARK, text)
        if "://" in text:
            text = _URL_CREDS.sub(lambda m: m.group(1) + MARK + m.group(3), text)
        return _on_lines_with(text, _FRAGMENTS, _assignments)

    def env_file(self, text: str | None) -> str | None:
        """`text` (first redacted as usual) with the value of every `KEY=value` line
        replaced: for text read from a `.env` file, where every value may be secret."""
        text = self(text)
        if not text:
            return text

        learned: set[str] = set()

        def value(m: re.Match[str]) -> str:
            pre, key, eq, v = m.groups()
            if v in (MARK, '""', "''"):
                return m.group(0)
            bare = v.strip().strip("'\"")
            if len(bare) >= 6 and _env_value_is_secret(key, bare):
                learned.add(bare)
            return pre + key + eq + MARK

        text = _ENV_ASSIGN.sub(value, text)
        self.learn(learned)
        return text

    def learn(self, values: Iterable[str]) -> None:
        """Also replace `values` from now on, wherever they appear."""
        new = {v for v in values if len(v) >= 6} - set(self.values)
        if new:
            self.values = sorted({*self.values, *new}, key=len, reverse=True)
            self._cache.clear()


def names_env_file(text: str) -> bool:
    """Whether `text` (a tool call's argument) names a `.env` or `.env.*` file."""
    return bool(ENV_FILE.search(text))


def _env_value_is_secret(key: str, value: str) -> bool:
    """Which `.env` values to replace wherever they appear: those of secret-named
    keys, and any other of 6+ characters that is not a plain word, a number, a
    path or a URL (a URL's password is caught by the URL rule): `production`,
    `8080`, `/var/data` and `http://localhost:3000` stay."""
    v = value.strip()
    if len(v) < 4 or v[0] == "$":
        return False
    if _names_secret(key):
        return True
    return not (
        len(v) < 6
        or "://" in v
        or v.startswith(("/", "./", "../", "~"))
        or re.fullmatch(r"[A-Za-z]+|[+\-]?\d+(?:\.\d+)*", v)
    )


def _env_files(root: Path) -> list[Path]:
    """`.env` and `.env.*` files under `root` at any depth, shallow folders first
    (breadth-first), without following links; bounded so a huge workspace costs
    a fraction of a second."""
    found: list[Path] = []
    queue = deque([root])
    seen = 0
    while queue and seen < ENV_WALK_MAX_DIRS:
        folder = queue.popleft()
        seen += 1
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    if entry.name not in _SKIP_DIRS:
                        queue.append(Path(entry.path))
                elif ENV_FILE.fullmatch(entry.name):
                    found.append(Path(entry.path))
                    if len(found) >= ENV_WALK_MAX_FILES:
                        return found
            except OSError:
                continue
    return found
