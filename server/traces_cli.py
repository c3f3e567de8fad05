"""`opencomposer traces list|show|export|submit`.

JSON output is strict (no NaN or Infinity: they are written as null), and reading
marks sessions whose process died `interrupted` (see `agent.traces`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from opencomposer.agent.traces import TraceStore, dumps


def main(a: argparse.Namespace) -> int:
    store = TraceStore()
    try:
        return {"list": _list, "show": _show, "export": _export, "submit": _submit}[
            a.traces_command
        ](store, a)
    finally:
        store.close()


def _list(store: TraceStore, a: argparse.Namespace) -> int:
    rows = store.list_sessions(a.limit)
    if a.json:
        print(dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no sessions yet in {store.path}")
        return 0
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["started"]))
        query = (r["query"] or "").replace("\n", " ")
        query = query if len(query) <= 60 else query[:59] + "…"
        print(
            f"{r['session_id']}  {when}  {r['status']:<10} {r['turns'] or 0:>2} turns "
            f"{r['tool_calls'] or 0:>3} calls {r['edits']:>2} edits  {r['model']}  {query}"
        )
    return 0


def _show(store: TraceStore, a: argparse.Namespace) -> int:
    t = store.export(store.resolve(a.session))
    print(f"session {t['session_id']}  {t['status']}  model {t['model']}")
    print(f"workspace {t['workspace']}  git {t['git_head'] or '-'}")
    print(f"query: {t['query']}")
    calls_by_turn: dict[int, list[dict]] = {}
    for c in t["tool_calls"]:
        calls_by_turn.setdefault(c["turn"], []).append(c)
    for turn in t["turns"]:
        n = turn["turn"]
        print(
            f"\n── turn {n}: {turn['prompt_tokens']} prompt + {turn['completion_tokens']} completion tokens "
            f"({turn['t_end'] - turn['t_start']:.1f} s)"
        )
        print(turn["text"].rstrip())
        for c in calls_by_turn.get(n, []):
            dur = (c["t_end"] - c["t_start"]) * 1000
            first = (c["result"] or "").strip().splitlines()[:1]
            print(
                f"  [{c['status']}] {c['name']} {json.dumps(c['args'])[:100]} {dur:.0f} ms  {first[0][:80] if first else ''}"
            )
    for e in t["edits"]:
        print(f"\nedit {e['path']} ({e['decision'] or 'undecided'})\n{e['diff']}")
    print(f"\nanswer: {t['answer']}")
    return 0


def _export(store: TraceStore, a: argparse.Namespace) -> int:
    data = dumps(store.export(store.resolve(a.session)), indent=2)
    if a.out:
        Path(a.out).write_text(data)
        print(a.out)
    else:
        sys.stdout.write(data + "\n")
    return 0


def _submit(store: TraceStore, a: argparse.Namespace) -> int:
    from opencomposer.training.tasks import task_from_trace

    for prefix in a.sessions:
        path = task_from_trace(store.resolve(prefix), out=a.out, verify=a.verify, store=store)
        print(path)
    return 0
