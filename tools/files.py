"""File tools: read_file, edit_file, write_file, delete_file, list_dir.

Convention for errors (every tool in this package): helpers raise `ToolError`
with one clear line for the model; each public tool is wrapped in
`returns_errors`, so it returns `ToolResult.error(message)` instead of raising,
whoever calls it (the session executor, a test, a benchmark).

edit_file matches `old` on a ladder, stopping at the first rung that matches:
1. exact text;
2. line by line, ignoring trailing whitespace;
3. line by line, ignoring indentation (then `new` is re-indented by the same delta);
4. line by line, with runs of whitespace collapsed.
Models often get whitespace wrong and almost never get the words wrong, so the
fuzzy rungs fix the common mistake without ever matching different code. A miss
shows the closest lines, or, when the file already holds `new`, says the edit was made
already (a model sending an applied edit again).
"""

from __future__ import annotations

import asyncio
import difflib
import heapq
import re
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from opencomposer.tools.output import returns_errors
from opencomposer.tools.protocols import Edit, ToolContext, ToolError, ToolResult
from opencomposer.tools.specs import GREP, LIST_DIR, READ_FILE, RUN_TERMINAL, WRITE_FILE
from opencomposer.tools.workspace import MAX_FILE_BYTES, not_found, walk

READ_MAX_LINES = 2000
READ_MAX_FILE_BYTES = MAX_FILE_BYTES
READ_MAX_CHARS = 60_000
LINE_MAX_CHARS = 2000
DIFF_MAX_CHARS = 4000
EDIT_INLINE_CHARS = 200_000  # bigger files are matched off the event loop
LIST_MAX_ENTRIES = 400
LIST_MAX_SCAN = 50_000  # entries walked (for the hidden-file counts) before giving up


# -- shared helpers ------------------------------------------------------------


def split_lines(text: str) -> list[str]:
    """Lines without their endings (only "\\n" splits: form feeds etc. stay in lines)."""
    if not text:
        return []
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def number(lines: list[str], first: int) -> str:
    width = max(5, len(str(first + len(lines) - 1)))
    return "\n".join(f"{n:>{width}}\t{line}" for n, line in enumerate(lines, first))


def _keep_ends(text: str) -> list[str]:
    """Lines with their "\n" (unlike str.splitlines, no split at form feeds or U+2028)."""
    return [line for line in re.split(r"(?<=\n)", text) if line]


_HUNK = re.compile(r"@@ -(\d+)((?:,\d+)?) \+(\d+)((?:,\d+)?) @@")
_CONTEXT = 3  # difflib's default context lines


def unified_diff(path: str, before: str | None, after: str | None) -> str:
    """A unified diff of two texts, made on the changed middle only.

    The common head and tail (whole lines, less the context) are cut off in
    linear time before difflib sees the lines, and the hunk headers are shifted
    back: an edit of one line in a 16 MB file costs a few copies of the file,
    not difflib's line tables over all of it.
    """
    a, b = before or "", after or ""
    head, tail = _common_lines(a, b)
    shift = a.count("\n", 0, head)
    diff = difflib.unified_diff(
        _keep_ends(a[head : len(a) - tail]),
        _keep_ends(b[head : len(b) - tail]),
        "/dev/null" if before is None else f"a/{path}",
        "/dev/null" if after is None else f"b/{path}",
    )
    out = []
    for line in diff:
        if shift and line.startswith("@@ -"):
            line = _HUNK.sub(
                lambda m: f"@@ -{int(m[1]) + shift}{m[2]} +{int(m[3]) + shift}{m[4]} @@", line, 1
            )
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def _common_lines(a: str, b: str) -> tuple[int, int]:
    """(head, tail): character counts of whole lines that `a` and `b` share at
    their start and end, less `_CONTEXT` lines each, never overlapping."""
    p = _prefix_len(a, b)
    head = a.rfind("\n", 0, p) + 1  # start of the line holding the first difference
    for _ in range(_CONTEXT):
        if head == 0:
            break
        head = a.rfind("\n", 0, head - 1) + 1
    s = _suffix_len(a, b, min(len(a), len(b)) - p)
    nl = a.find("\n", len(a) - s) if s else -1
    if nl < 0:  # no line boundary inside the common tail
        return head, 0
    start = nl + 1
    for _ in range(_CONTEXT):
        nl = a.find("\n", start)
        if nl < 0:
            return head, 0
        start = nl + 1
    return head, len(a) - start


_STEP = 1 << 16


def _prefix_len(a: str, b: str) -> int:
    """Length of the common prefix: 64 KiB blocks compared in C, then a bisection."""
    n, lo = min(len(a), len(b)), 0
    while lo < n and a[lo : lo + _STEP] == b[lo : lo + _STEP]:
        lo += _STEP
    hi = min(lo + _STEP, n)
    while lo < hi:  # a[:lo] == b[:lo]; the first difference is before hi
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return min(lo, n)


def _suffix_len(a: str, b: str, most: int) -> int:
    """Length of the common suffix, at most `most` (see `_prefix_len`)."""
    la, lb, lo = len(a), len(b), 0
    while (
        lo < most
        and a[la - min(lo + _STEP, most) : la - lo] == b[lb - min(lo + _STEP, most) : lb - lo]
    ):
        lo = min(lo + _STEP, most)
        if lo == most:
            return most
    hi = min(lo + _STEP, most)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[la - mid : la - lo] == b[lb - mid : lb - lo]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _short(diff: str) -> str:
    if len(diff) <= DIFF_MAX_CHARS:
        return diff
    return (
        diff[:DIFF_MAX_CHARS].rsplit("\n", 1)[0]
        + f"\n[... diff cut, {len(diff)} characters in all]"
    )


def _changed(ctx: ToolContext, path: str) -> None:
    if ctx.on_file_changed is not None:
        ctx.on_file_changed(path)


def _read_existing(ctx: ToolContext, path: str) -> str | None:
    """The text of `path`, None if it does not exist; ToolError if binary or a folder."""
    ws = ctx.workspace
    if ws.is_dir(path):
        raise ToolError(f"{path} is a directory, not a file")
    if not ws.exists(path):
        return None
    return ws.read_text(path)


# -- read_file ----------------------------------------------------------------


@returns_errors
async def read_file(
    ctx: ToolContext, path: str, start_line: int | None = None, end_line: int | None = None
) -> ToolResult:
    ws = ctx.workspace
    key = ws.relative(ws.resolve(path))
    if ws.is_dir(path):
        raise ToolError(f"{key} is a directory; use {LIST_DIR} to see what it holds")
    if not ws.exists(path):
        raise not_found(ws, key)
    target = ws.resolve(path)
    if target.is_file() and target.stat().st_size > READ_MAX_FILE_BYTES and key not in ws.overlay():
        size_mb = target.stat().st_size / 1e6
        raise ToolError(
            f"{key} is {size_mb:.0f} MB, too big to read (limit "
            f"{READ_MAX_FILE_BYTES // 1_000_000} MB); use {GREP}, or {RUN_TERMINAL} with sed -n 'A,Bp'"
        )
    lines = split_lines(ws.read_text(path))
    total = len(lines)
    if total == 0:
        return ToolResult.ok(f"({key} is empty)", meta={"lines": 0})
    start = 1 if start_line is None else start_line
    end = total if end_line is None else end_line
    if start < 1:
        raise ToolError(f"start_line must be 1 or more, got {start}")
    if start > total:
        raise ToolError(f"start_line {start} is past the end of {key}, which has {total} lines")
    if end < start:
        raise ToolError(f"end_line {end} is before start_line {start}")
    end = min(end, total)

    shown: list[str] = []
    size = 0
    for line in lines[start - 1 : end]:
        if len(line) > LINE_MAX_CHARS:
            line = line[:LINE_MAX_CHARS] + f" [... line cut, {len(line)} characters]"
        if shown and (len(shown) >= READ_MAX_LINES or size + len(line) > READ_MAX_CHARS):
            break
        shown.append(line)
        size += len(line) + 8
    last = start + len(shown) - 1
    out = number(shown, start)
    if last < end:
        out += (
            f"\n[showing lines {start}-{last} of {total}; output limit reached. "
            f"Continue with start_line={last + 1}]"
        )
    elif start > 1 or end < total:
        out += f"\n[lines {start}-{last} of {total}]"
    return ToolResult.ok(out, meta={"lines": total})


# -- edit_file ----------------------------------------------------------------


@dataclass(frozen=True)
class _Rung:
    name: str  # how the match was made, said back to the model
    norm: Callable[[str], str]
    reindent: bool


_RUNGS = (
    _Rung("ignoring trailing whitespace", lambda s: s.rstrip(), False),
    _Rung("ignoring indentation", lambda s: s.strip(), True),
    _Rung("ignoring whitespace differences", lambda s: " ".join(s.split()), True),
)


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _trim_blank_edges(lines: list[str]) -> list[str]:
    lo, hi = 0, len(lines)
    while lo < hi and not lines[lo].strip():
        lo += 1
    while hi > lo and not lines[hi - 1].strip():
        hi -= 1
    return lines[lo:hi]


def _reindent(
    new_lines: list[str], old_lines: list[str], file_lines: list[str]
) -> tuple[list[str], str]:
    """Shift `new_lines` by the indentation difference between `old` and the file."""
    pair = next(((o, f) for o, f in zip(old_lines, file_lines, strict=False) if o.strip()), None)
    if pair is None:
        return new_lines, ""
    old_ind, file_ind = _indent(pair[0]), _indent(pair[1])
    if old_ind == file_ind:
        return new_lines, ""
    out = []
    for line in new_lines:
        if not line.strip():
            out.append(line)
        elif line.startswith(old_ind):
            out.append(file_ind + line[len(old_ind) :])
        elif file_ind.startswith(old_ind):
            out.append(file_ind[len(old_ind) :] + line)
        else:
            out.append(file_ind + line.lstrip())
    delta = len(file_ind.expandtabs(4)) - len(old_ind.expandtabs(4))
    return out, f"; new text re-indented by {delta:+d} columns"


def _some(lines: list[int], most: int = 20) -> str:
    shown = ", ".join(map(str, lines[:most]))
    return shown if len(lines) <= most else f"{shown} and {len(lines) - most} more"


def _match_lines(text: str, old: str) -> list[int]:
    """1-based line of each match of `old`, counting newlines once across the text."""
    lines, line, last, pos = [], 1, 0, text.find(old)
    while pos >= 0:
        line += text.count("\n", last, pos)
        lines.append(line)
        last, pos = pos, text.find(old, pos + 1)
    return lines


def _fuzzy_matches(
    file_lines: list[str], old_lines: list[str], norm: Callable[[str], str]
) -> list[int]:
    """Starts of the windows equal to `old_lines` under `norm`. The file's lines are
    normalised as they are compared, never all at once (a copy of a big file each)."""
    want = [norm(x) for x in old_lines]
    n = len(want)
    return [
        i
        for i in range(len(file_lines) - n + 1)
        if norm(file_lines[i]) == want[0]
        and all(norm(file_lines[i + j]) == want[j] for j in range(1, n))
    ]


_TOKEN = re.compile(r"\w+|[^\w\s]")


def _best_window(file_lines: list[str], old_lines: list[str]) -> tuple[int, float]:
    """(start, similarity) of the file window most like `old_lines`; start -1 if none.

    A coarse pass scores every window by token overlap with up to 8 of old's lines
    (linear in the file; each file line's tokens are made once and added to the
    windows that sample it, so only one float per window is kept), then difflib
    ranks the best five line by line; a miss on a 20,000-line file costs about a
    tenth of a second.
    """
    n = max(1, len(old_lines))
    count = max(1, len(file_lines) - n + 1)
    filled = [j for j, line in enumerate(old_lines) if line.strip()] or [0]
    sample = sorted({filled[round(k * (len(filled) - 1) / 7)] for k in range(8)})
    old_tok = [set(_TOKEN.findall(old_lines[j])) if j < len(old_lines) else set() for j in sample]
    scores = array("d", bytes(8 * count))
    for k, line in enumerate(file_lines):
        have: set[str] | None = None
        for j, want in zip(sample, old_tok, strict=True):
            if want and 0 <= k - j < count:
                if have is None:
                    have = set(_TOKEN.findall(line))
                scores[k - j] += len(want & have) / len(want | have)

    def fine(i: int) -> float:
        pairs = list(zip(old_lines[:50], file_lines[i : i + min(n, 50)], strict=False))
        if not pairs:
            return 0.0
        ratios = [difflib.SequenceMatcher(None, a.strip(), b.strip()).ratio() for a, b in pairs]
        return sum(ratios) / max(len(pairs), min(n, 50))

    ranked = heapq.nlargest(5, range(count), key=scores.__getitem__)
    scored = [(fine(i), -i) for i in ranked]
    best, neg_i = max(scored) if scored else (0.0, 1)
    return -neg_i, best


def _closest(file_lines: list[str], old_lines: list[str]) -> str:
    """The file's lines most like `old`, numbered, with a diff of the difference."""
    best_i, best = _best_window(file_lines, old_lines)
    if best_i < 0 or best < 0.3:
        return "No similar lines were found: read the file again before editing."
    window = file_lines[best_i : best_i + max(1, len(old_lines))]
    diff = list(difflib.unified_diff(old_lines, window, "your old", "the file", n=0, lineterm=""))
    shown = number(window, best_i + 1)
    parts = [
        f"The closest text is at lines {best_i + 1}-{best_i + len(window)} "
        f"({best:.0%} similar):\n{shown}"
    ]
    if diff:
        parts.append("Difference (- your old, + the file):\n" + "\n".join(diff[2:40]))
    return "\n".join(parts)


def apply_edit(text: str, old: str, new: str, replace_all: bool) -> tuple[str, int, str]:
    """(new text, replacements, how it matched); ToolError when `old` is absent or ambiguous."""
    crlf = "\r\n" in text and "\r\n" not in old
    if crlf:
        text = text.replace("\r\n", "\n")
        new = new.replace("\r\n", "\n")
    result = _apply(text, old, new, replace_all)
    if crlf:
        return result[0].replace("\n", "\r\n"), result[1], result[2]
    return result


def _apply(text: str, old: str, new: str, replace_all: bool) -> tuple[str, int, str]:
    count = text.count(old)
    if count == 1 or (count > 1 and replace_all):
        return text.replace(old, new), count, "exact match"
    if count > 1:
        lines = _match_lines(text, old)
        raise ToolError(
            f"old text matches {count} times (at lines {_some(lines)}); "
            'add surrounding lines to make it unique, or set replace_all="true"'
            + _around(text.split("\n"), [i - 1 for i in lines], old.count("\n") + 1)
        )

    file_lines = text.split("\n")
    old_lines = _trim_blank_edges(old.split("\n"))
    if old_lines:
        new_lines = _trim_blank_edges(new.split("\n")) if new.strip() else []
        for rung in _RUNGS:
            hits = _fuzzy_matches(file_lines, old_lines, rung.norm)
            if not hits:
                continue
            if len(hits) > 1 and not replace_all:
                raise ToolError(
                    f"old text matches {len(hits)} times {rung.name} "
                    f"(at lines {_some([i + 1 for i in hits])}); add surrounding lines "
                    'to make it unique, or set replace_all="true"'
                    + _around(file_lines, hits, len(old_lines))
                )
            note = ""
            out = list(file_lines)
            hits = _non_overlapping(hits, len(old_lines))
            for i in reversed(hits):
                window = file_lines[i : i + len(old_lines)]
                repl, note = (
                    _reindent(new_lines, old_lines, window) if rung.reindent else (new_lines, "")
                )
                out[i : i + len(old_lines)] = repl
            return "\n".join(out), len(hits), f"matched {rung.name}{note}"

    made = _already_made(file_lines, new)
    if made:
        where, shown = made
        raise ToolError(
            f"old text not found, but the file already holds the new text at {where}: this "
            "edit was made already and the file has changed since you quoted it; read it "
            f"again before editing it.\n{shown}"
        )
    raise ToolError(
        "old text not found (tried exact, then ignoring trailing whitespace, indentation and "
        "whitespace runs). " + _closest(file_lines, old_lines or old.split("\n"))
    )


def _already_made(file_lines: list[str], new: str) -> tuple[str, str] | None:
    """(where, the numbered lines) of the first place the file holds `new` as whole
    lines, on the first rung that finds it; None if it does not. This is an edit sent
    again after it was applied."""
    new_lines = _trim_blank_edges(new.split("\n"))
    if not any(line.strip() for line in new_lines):
        return None
    n = len(new_lines)
    for rung in _RUNGS:
        hits = _fuzzy_matches(file_lines, new_lines, rung.norm)
        if hits:
            i = hits[0]
            where = f"line {i + 1}" if n == 1 else f"lines {i + 1}-{i + n}"
            if len(hits) > 1:
                where += f" (and {len(hits) - 1} more)"
            return where, number(file_lines[i : i + n], i + 1)
    return None


def _around(file_lines: list[str], starts: list[int], n: int, most: int = 4) -> str:
    """The first matches of an ambiguous `old`, numbered, each with the line before and
    after it: the context that tells them apart, to quote in the next try."""
    if n > 8:  # a long old text: its lines say enough, the listing would swamp the answer
        return ""
    blocks = []
    for i in starts[:most]:
        lo, hi = max(0, i - 1), min(len(file_lines), i + n + 1)
        block = [line if len(line) <= 200 else line[:200] + " …" for line in file_lines[lo:hi]]
        blocks.append(number(block, lo + 1))
    more = f"\n({len(starts) - most} more not shown)" if len(starts) > most else ""
    return ". The matches, with a line either side:\n" + "\n--\n".join(blocks) + more


def _non_overlapping(hits: list[int], n: int) -> list[int]:
    kept: list[int] = []
    for i in hits:
        if not kept or i >= kept[-1] + n:
            kept.append(i)
    return kept


@returns_errors
async def edit_file(
    ctx: ToolContext, path: str, old: str, new: str, replace_all: bool = False
) -> ToolResult:
    ws = ctx.workspace
    key = ws.relative(ws.resolve(path))
    if not old:
        raise ToolError(f"old is empty; use {WRITE_FILE} to create or overwrite a whole file")
    before = _read_existing(ctx, path)
    if before is None:
        raise not_found(ws, key, otherwise=f"use {WRITE_FILE} to create it")
    if old == new:
        raise ToolError("old and new are the same; nothing to change")
    try:
        if len(before) > EDIT_INLINE_CHARS:  # a miss on a big file searches for a while
            after, count, how = await asyncio.to_thread(apply_edit, before, old, new, replace_all)
        else:
            after, count, how = apply_edit(before, old, new, replace_all)
    except ToolError as e:
        raise ToolError(f"{key}: {e}") from None
    if after == before:
        return ToolResult.ok(f"{key} unchanged: the replacement gives the same text")
    await ws.write_text(key, after)
    _changed(ctx, key)
    diff = unified_diff(key, before, after)
    times = "1 occurrence" if count == 1 else f"{count} occurrences"
    return ToolResult.ok(
        f"edited {key}: replaced {times} ({how})\n{_short(diff)}",
        edits=[Edit(path=key, before=before, after=after, diff=diff)],
    )


# -- write_file / delete_file -------------------------------------------------


@returns_errors
async def write_file(ctx: ToolContext, path: str, content: str) -> ToolResult:
    ws = ctx.workspace
    key = ws.relative(ws.resolve(path))
    if key == ".":
        raise ToolError("path must name a file, not the workspace root")
    try:
        before = _read_existing(ctx, path)
    except ToolError as e:
        if "binary" in str(e) or "not UTF-8" in str(e):
            raise ToolError(f"{key} is not a text file; refusing to overwrite it") from None
        raise
    if before == content:
        return ToolResult.ok(f"{key} unchanged: it already has this content")
    await ws.write_text(key, content)
    _changed(ctx, key)
    diff = unified_diff(key, before, content)
    n = len(split_lines(content))
    verb = "created" if before is None else "overwrote"
    return ToolResult.ok(
        f"{verb} {key} ({n} lines)",
        edits=[Edit(path=key, before=before, after=content, diff=diff)],
    )


@returns_errors
async def delete_file(ctx: ToolContext, path: str) -> ToolResult:
    ws = ctx.workspace
    key = ws.key(path, follow=False)  # a symlink names itself: the link goes, not its target
    if key == "." or ws.is_dir(path):
        raise ToolError(f"{key} is a directory; only files are deleted")
    if not ws.exists(path):
        raise not_found(ws, key)
    try:
        before = ws.read_text(path)
    except ToolError as e:
        if "binary" in str(e) or "not UTF-8" in str(e):
            raise ToolError(
                f"{key} is not a text file; only text files, which can be restored, are deleted"
            ) from None
        raise
    await ws.delete(key)
    _changed(ctx, key)
    return ToolResult.ok(
        f"deleted {key}",
        edits=[Edit(path=key, before=before, after=None, diff=unified_diff(key, before, None))],
    )


# -- list_dir -----------------------------------------------------------------


@returns_errors
async def list_dir(ctx: ToolContext, path: str = "", depth: int = 2) -> ToolResult:
    ws = ctx.workspace
    key = ws.relative(ws.resolve(path or "."))
    if depth < 1:
        raise ToolError(f"depth must be 1 or more, got {depth}")
    depth = min(depth, 12)
    if not ws.is_dir(key):
        if ws.exists(key):
            raise ToolError(f"{key} is a file, not a directory; use {READ_FILE}")
        raise not_found(ws, key, "directory")
    start = "" if key == "." else key
    base_depth = start.count("/") + 1 if start else 0

    children: dict[str, list[tuple[str, bool]]] = {}
    hidden: dict[str, int] = {}

    def scan() -> int:
        scanned = 0
        for rel, is_dir in walk(ws.root, start, include_dirs=True):
            scanned += 1
            if scanned > LIST_MAX_SCAN:
                break
            parent, _, name = rel.rpartition("/")
            level = rel.count("/") + 1 - base_depth
            if level > depth:
                top = "/".join(rel.split("/")[: base_depth + depth])
                hidden[top] = hidden.get(top, 0) + (0 if is_dir else 1)
                continue
            children.setdefault(parent, []).append((name, is_dir))
        return scanned

    scanned = await asyncio.to_thread(scan)  # a big tree is walked off the event loop

    lines = [f"{key}/" if key != "." else "./"]
    count = 0

    def emit(folder: str, indent: int) -> None:
        nonlocal count
        items = sorted(children.get(folder, []), key=lambda x: (not x[1], x[0]))
        for name, is_dir in items:
            if count >= LIST_MAX_ENTRIES:
                return
            count += 1
            rel = f"{folder}/{name}" if folder else name
            if is_dir:
                more = f"  ({hidden[rel]} files below)" if rel in hidden else ""
                lines.append(f"{'  ' * indent}{name}/{more}")
                emit(rel, indent + 1)
            else:
                lines.append(f"{'  ' * indent}{name}")

    emit(start, 1)
    total = sum(len(v) for v in children.values())
    if scanned > LIST_MAX_SCAN:
        lines.append(f"[stopped after {LIST_MAX_SCAN} entries; counts are partial]")
    if count == 0:
        lines.append("  (empty)")
    elif total > count:
        lines.append(f"[... {total - count} more entries; list a subfolder to see them]")
    return ToolResult.ok("\n".join(lines), meta={"entries": total})
