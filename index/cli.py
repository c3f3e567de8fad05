"""`opencomposer index` and `opencomposer search`, as functions the main CLI wires in.

    opencomposer index [DIR]                       # build or refresh, progress bar on stderr
    opencomposer search QUERY [--workspace DIR] [-k N] [--json]
    opencomposer search --queries FILE --json      # one JSON line per query, models loaded once

Both return an exit code and print user errors as one line on stderr.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .core import CodebaseIndex, Hit, IndexProblem, IndexStats
from .embed import EmbedderError


def _fail(message: str) -> int:
    print(f"opencomposer: {message}", file=sys.stderr)
    return 1


class _Bar:
    """A one-line progress bar on stderr (redrawn with \\r; silent when not a terminal)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet or not sys.stderr.isatty()
        self.last = 0.0
        self.t0 = time.perf_counter()

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if self.quiet or (now - self.last < 0.1 and done < total):
            return
        self.last = now
        width = 30
        filled = int(width * done / total) if total else width
        rate = f" {done / (now - self.t0):.0f}/s" if phase == "embed" and now > self.t0 else ""
        sys.stderr.write(
            f"\r{phase:<5} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}{rate}  "
        )
        sys.stderr.flush()

    def end(self) -> None:
        if not self.quiet:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def summary(stats: IndexStats) -> str:
    line = (
        f"indexed {stats.files} files, {stats.chunks} chunks in {stats.seconds:.1f} s "
        f"({stats.files_changed} files changed, {stats.files_removed} removed, "
        f"{stats.chunks_embedded} chunks embedded, {stats.chunks_per_s:.0f} chunks/s)"
    )
    if stats.skipped:
        line += "; skipped " + ", ".join(f"{n} {why}" for why, n in sorted(stats.skipped.items()))
    return line


def cmd_index(root: Path, *, quiet: bool = False) -> int:
    """Build or refresh the index of root; a summary line on stdout."""
    bar = _Bar(quiet)
    try:
        with CodebaseIndex.open(root, progress=bar) as index:
            stats = index.refresh()
    except (IndexProblem, EmbedderError, OSError) as e:
        bar.end()
        return _fail(str(e))
    bar.end()
    if not quiet:
        print(summary(stats))
    return 0


def _as_json(hits: list[Hit]) -> list[dict[str, object]]:
    return [
        {"path": h.path, "start_line": h.start_line, "end_line": h.end_line, "score": h.score}
        for h in hits
    ]


def cmd_search(
    query: str | None,
    root: Path,
    *,
    k: int = 10,
    as_json: bool = False,
    queries_file: Path | None = None,
) -> int:
    """Search the index of root (refreshing it first); JSON or a readable list on stdout."""
    if query is None and queries_file is None:
        return _fail("search needs a QUERY or --queries FILE")
    if k <= 0:
        return _fail(f"-k must be positive, not {k}")
    try:
        queries = (
            [q for q in queries_file.read_text(encoding="utf-8").splitlines() if q.strip()]
            if queries_file is not None
            else [query or ""]
        )
    except (OSError, UnicodeDecodeError) as e:
        return _fail(f"cannot read queries from {queries_file}: {e}")
    try:
        with CodebaseIndex.open(root, progress=_Bar(True)) as index:
            index.refresh()
            for q in queries:
                hits = index.search(q, k=k)
                if queries_file is not None:
                    print(json.dumps({"query": q, "results": _as_json(hits)}), flush=True)
                elif as_json:
                    print(json.dumps(_as_json(hits)))
                else:
                    for h in hits:
                        name = f"  {h.scope + '.' if h.scope else ''}{h.symbol}" if h.symbol else ""
                        print(f"{h.path}:{h.start_line}-{h.end_line}  {h.score:.4f}{name}")
    except (IndexProblem, EmbedderError, OSError) as e:
        return _fail(str(e))
    return 0
