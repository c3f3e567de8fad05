"""Next-step accuracy of a policy on held-out projects, step by step of an engineer's session.

Each held-out task of a round-robin sample (projects never trained on) gets a reference
session: an engineer's session played through the production agent and tools, kept in
`--db` (never trained on; recorded once, reused by later runs). At every assistant turn
of those that resolved their task, each model gets that turn's exact prompt and answers
greedily; its calls are compared with the engineer's (`training/nextstep.py`): `tool`
is a call of the same tool (no call where the engineer answers), `exact` the same call,
`part` the step's point (`edit_file`: the right line in the right file, whatever the
change; `read_file`: a range holding the function; `grep`: the same pattern;
`run_terminal`: a pytest run). The `edit_file` steps are also split by whether
the failing run's traceback in the prompt stops at the line the engineer changes. One
table, from this one run:

    python benchmarks/next_step.py --model sft=vllm:runs/embedded/checkpoints/step_0
    python benchmarks/next_step.py --tasks 40 --model base=vllm:smollm2-base \\
        --model sft=vllm:runs/embedded/checkpoints/step_0
    python benchmarks/next_step.py --tasks 108 --only edit_file --model ...  # the fix step alone

Outputs under `--out` (default `docs/embedded/`): `next_step.md` and `next_step.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from heldout import cpu_model, parse_models  # noqa: E402
from opencomposer.tools.specs import (  # noqa: E402
    CODEBASE_SEARCH,
    EDIT_FILE,
    GREP,
    READ_FILE,
    RUN_TERMINAL,
)
from opencomposer.training.nextstep import ANSWER  # noqa: E402

KINDS = (RUN_TERMINAL, GREP, CODEBASE_SEARCH, READ_FILE, EDIT_FILE, ANSWER)


def table(rows: dict[str, dict[str, dict[str, int]]]) -> str:
    labels = list(rows)
    lines = [
        "| step (the engineer's call) | calls | "
        + " | ".join(f"{label}: tool / exact / its point" for label in labels)
        + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    first = rows[labels[0]]
    for kind in [k for k in KINDS if k in first] + sorted(set(first) - set(KINDS)):
        n = first[kind]["n"]
        cells = [
            " / ".join(f"{rows[label][kind].get(k, 0) / n:.0%}" for k in ("tool", "exact", "part"))
            for label in labels
        ]
        lines.append(f"| `{kind}` | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=40, help="held-out tasks, spread over projects")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", action="append", default=[], metavar="LABEL=SPEC")
    ap.add_argument("--db", type=Path, default=ROOT / "bench-heldout" / "reference.db")
    ap.add_argument("--prompt-style", default="compact", choices=["full", "compact"])
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "embedded")
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        choices=KINDS,
        help="only the steps where the engineer makes this call (repeatable)",
    )
    a = ap.parse_args()

    from opencomposer.agent.backends import make_model
    from opencomposer.agent.protocols import ModelError
    from opencomposer.training.catalog import load_suite
    from opencomposer.training.demos import spread
    from opencomposer.training.nextstep import (
        edit_split,
        load_references,
        record_references,
        reference_steps,
        replies,
        step_kinds,
        tally,
    )

    models = parse_models(ap, a.model)
    if not models:
        models = [("base", "vllm:smollm2-base"), ("shipped", "vllm:smollm2")]
    tasks = spread(load_suite("corpus:heldout"), a.tasks, a.seed)
    if not tasks:
        raise SystemExit("error: the corpus has no held-out tasks (build it first)")
    a.db.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    stats = asyncio.run(record_references(tasks, a.db, prompt_style=a.prompt_style))
    if stats.recorded:
        print(
            f"recorded {stats.recorded} reference sessions ({stats.accepted} resolved; "
            f"{stats.skipped} tasks skipped, their request leads to no code) "
            f"in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    refs = [
        t
        for t in load_references(a.db)
        if (t.get("meta") or {}).get("prompt_style") == a.prompt_style
    ]
    steps = reference_steps(refs, [t.id for t in tasks])
    if a.only:
        steps = [s for s in steps if step_kinds(s) & set(a.only)]
    n_sessions = len({s.session_id for s in steps})
    print(
        f"next step: {len(steps)} steps of {n_sessions} resolved reference sessions "
        f"({len(tasks)} held-out tasks); CPU {cpu_model()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    if not steps:
        raise SystemExit("error: no resolved reference session to measure on")
    rows: dict[str, dict[str, dict[str, int]]] = {}
    answers: dict[str, list[dict[str, object]]] = {}
    for label, spec in models:
        t1 = time.perf_counter()

        async def run(spec: str = spec) -> list[str]:
            model = make_model(spec)
            try:
                return await replies(model, steps, concurrency=a.concurrency)
            finally:
                await model.close()

        got = asyncio.run(run())
        failed = [g for g in got if isinstance(g, ModelError)]
        if failed:
            print(f"{label}: {len(failed)} steps left out: {failed[0]}", flush=True)
        counts = {**tally(steps, got), **edit_split(steps, got)}
        answers[label] = [
            {"task": s.task_id, "turn": s.turn, "reply": str(g)}
            for s, g in zip(steps, got, strict=True)
        ]
        rows[label] = {k: vars(v) for k, v in counts.items()}
        edit = counts.get(EDIT_FILE)
        said = (
            f", edit_file steps: {edit.tool}/{edit.n} call it, {edit.exact} exact, "
            f"{edit.part} on the right line"
            if edit
            else ""
        )
        print(f"{label:8} {spec}: {time.perf_counter() - t1:.0f} s{said}", flush=True)
    print()
    md = table(rows)
    print(md)
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "tasks": sorted(t.id for t in tasks),
        "steps": len(steps),
        "sessions": n_sessions,
        "cpu": cpu_model(),
        "load": os.getloadavg()[0],
        "models": dict(models),
        "only": a.only,
        "counts": rows,
        "replies": answers,
    }
    title = (
        f"Next-step accuracy: {len(steps)} steps of {n_sessions} reference sessions on "
        f"held-out projects{' (' + ', '.join(a.only) + ' steps only)' if a.only else ''}; "
        f"{cpu_model()}"
    )
    (a.out / "next_step.json").write_text(json.dumps(meta, indent=1) + "\n")
    (a.out / "next_step.md").write_text(f"{title}\n\n{md}\n")
    print(f"wrote {a.out / 'next_step.md'}, next_step.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
