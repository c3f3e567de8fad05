"""The fix step of held-out sessions: how often a policy's edit makes the tests pass.

Each held-out task of a round-robin sample (`--tasks`, projects never trained on) gets a
reference session: an engineer's session played through the production agent and
tools, kept in `--db` (never trained on; recorded once, shared with
`benchmarks/next_step.py`). Each one that resolved its task gives one state: the turn
of its first edit, with the exact prompt the session had there (the request, the
failing run, the function it read). Each model answers every state `--k` times at `--temperature`; each reply's
calls run through the production executor and tools on a fresh sandboxed copy of the
task, and the task's own tests decide (`training/fixstep.py`, `FixScorer`). The same
states and grading train the policy in `python -m opencomposer.training.fixstep train`.

It prints one table from this one run: per model, the share of replies that fix the
bug (the mean over states of each state's share, with its standard error over
states), the share of states with at least one fixing reply, and the replies' edit
outcomes (resolved; the broken line changed but the tests fail; an edit that leaves
every broken line as it was; an edit that does not apply; no edit); and a second table
of the replies that fix the bug by the kind of bug the task's mutation made:

    OPENCOMPOSER_CORPUS=~/.cache/opencomposer/corpus-heldout python benchmarks/fix_step.py \\
        --tasks 40 --model shipped=vllm:smollm2 \\
        --model rl=vllm:runs/fixstep/checkpoints/step_N

Outputs under `--out` (default `docs/embedded/`): `fix_step.md` and `fix_step.json`;
each model's graded replies go to `--work/LABEL/groups.jsonl` (a rerun reuses them).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from heldout import cpu_model, parse_models  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=40, help="held-out tasks, spread over projects")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--db", type=Path, default=ROOT / "bench-heldout" / "reference.db")
    ap.add_argument("--model", action="append", default=[], metavar="LABEL=SPEC")
    ap.add_argument("--k", type=int, default=8, help="replies per state")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--prompt-style", default="compact", choices=["full", "compact"])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "embedded")
    ap.add_argument("--work", type=Path, default=ROOT / "bench-heldout" / "fix_step")
    a = ap.parse_args()

    from opencomposer.training.catalog import load_suite
    from opencomposer.training.demos import spread
    from opencomposer.training.fixstep import (
        collect,
        fix_states,
        load_traces,
        state_key,
        summary,
    )
    from opencomposer.training.nextstep import record_references

    models = parse_models(ap, a.model) or [("shipped", "vllm:smollm2")]
    tasks = {t.id: t for t in spread(load_suite("corpus:heldout"), a.tasks, a.seed)}
    if not tasks:
        print("error: the corpus has no held-out tasks (build it first)", file=sys.stderr)
        return 2
    a.db.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    stats = asyncio.run(record_references(list(tasks.values()), a.db, prompt_style=a.prompt_style))
    if stats.recorded:
        print(f"recorded {stats.recorded} reference sessions in {time.perf_counter() - t0:.0f} s")
    traces = [
        t
        for t in load_traces([a.db], source="reference")
        if (t.get("meta") or {}).get("prompt_style") == a.prompt_style
    ]
    states = [s for s in fix_states(traces) if s.task_id in tasks]
    if not states:
        print(f"error: {a.db}: no resolved reference session of the sampled tasks", file=sys.stderr)
        return 2
    projects = len({tasks[s.task_id].source for s in states})
    print(
        f"fix step: {len(states)} states of held-out reference sessions ({projects} projects), "
        f"{a.k} replies each at temperature {a.temperature}; CPU {cpu_model()}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    rows = {}
    for label, spec in models:
        t0 = time.perf_counter()
        groups = asyncio.run(
            collect(
                states,
                model_spec=spec,
                tasks=tasks,
                out=a.work / label / "groups.jsonl",
                k=a.k,
                temperature=a.temperature,
                max_tokens=a.max_tokens,
                log=lambda line: None,
            )
        )
        keys = {state_key(s) for s in states}
        groups = [g for g in groups if g["state"] in keys]
        why = collections.Counter(r.why for g in groups for r in g["replies"])
        rows[label] = {
            "spec": spec,
            **summary(groups),
            "outcomes": dict(why),
            "by_kind": by_kind(groups, tasks),
        }
        print(
            f"{label:10} {spec}: {rows[label]['pass']:.1%} ± {rows[label]['se']:.1%} "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    kinds = ["resolved", "tests fail", "broken line kept", "no edit applied", "no edit"]
    lines = [
        "| model | states | replies that fix it | states with a fix | " + " | ".join(kinds) + " |",
        "|---|---|---|---|" + "---|" * len(kinds),
    ]
    for label, r in rows.items():
        total = sum(r["outcomes"].values()) or 1
        lines.append(
            f"| {label} | {int(r['states'])} | {r['pass']:.1%} ± {r['se']:.1%} | {r['any']:.0%} | "
            + " | ".join(f"{r['outcomes'].get(k, 0) / total:.0%}" for k in kinds)
            + " |"
        )
    lines += ["", kind_table(rows)]
    md = "\n".join(lines)
    print()
    print(md)
    title = (
        f"Fix step on held-out projects: {len(states)} states, {a.k} replies each at "
        f"temperature {a.temperature}; {cpu_model()}, {os.cpu_count()} cores"
    )
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "states": sorted(state_key(s) for s in states),
        "k": a.k,
        "temperature": a.temperature,
        "cpu": cpu_model(),
        "load": os.getloadavg()[0],
        "models": rows,
    }
    (a.out / "fix_step.json").write_text(json.dumps(meta, indent=1) + "\n")
    (a.out / "fix_step.md").write_text(f"{title}\n\n{md}\n")
    print(f"wrote {a.out / 'fix_step.md'}, fix_step.json")
    return 0


def bug_kind(task: Any) -> str:
    """The kind of bug the task's mutation made ("two-site" for every pair), from its
    reference solution: read for the report, never for a reply."""
    from opencomposer.training.demos import load_solution

    found = load_solution(task, reference=True) or {}
    return str(found.get("kind", "unknown")).split(":")[0]


def by_kind(groups: list[dict[str, Any]], tasks: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per bug kind: the states, the replies and the replies that fix the bug."""
    out: dict[str, dict[str, int]] = {}
    for g in groups:
        row = out.setdefault(bug_kind(tasks[g["task_id"]]), {"states": 0, "replies": 0, "fix": 0})
        row["states"] += 1
        row["replies"] += len(g["replies"])
        row["fix"] += sum(r.why == "resolved" for r in g["replies"])
    return dict(sorted(out.items()))


def kind_table(rows: dict[str, dict[str, Any]]) -> str:
    """Replies that fix the bug, by the kind of bug, one column per model."""
    kinds = sorted({k for r in rows.values() for k in r["by_kind"]})
    lines = [
        "| bug kind | states | " + " | ".join(rows) + " |",
        "|---|---|" + "---|" * len(rows),
    ]
    for kind in kinds:
        cells = [
            r["by_kind"].get(kind, {"states": 0, "replies": 0, "fix": 0}) for r in rows.values()
        ]
        states = max(c["states"] for c in cells)
        lines.append(
            f"| {kind} | {states} | "
            + " | ".join(f"{c['fix']}/{c['replies']}" for c in cells)
            + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
