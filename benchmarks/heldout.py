"""Held-out figures of the embedded policy: the untrained base, SFT only, and SFT + RL.

Each model runs the same sample of held-out corpus tasks (projects never trained on,
`configs/corpus.toml` split = "heldout"), spread round-robin over those projects,
through `opencomposer bench` (the production agent, sandboxed workspaces, each task's
own tests as the verdict) with a budget of `--max-turns` turns per episode. It prints
one table, from this one run, and writes it with a plot:

    python benchmarks/heldout.py                      # base, the run's SFT and final checkpoints
    python benchmarks/heldout.py --tasks 60 --max-turns 8 --run runs/embedded \\
        --model base=smollm2-base --model shipped=smollm2

The table also counts the episodes whose reads showed every broken line (the code to
fix was found) and those that changed every broken line, fixed or not (the corpus's
part-credit reward check, `corpus.touched_check`); both read the reference solution
for the report only.

Outputs under `--out` (default `docs/embedded/`): `heldout.json` (every model's
`bench` report summary), `heldout.md` (the table), `heldout.png` (resolve rate with
two standard errors, per model). Per-model bench folders (traces, per-task rows) go
under `--work` (default `bench-heldout/`, not committed).

`--query issue` (or `test`, `oneline`) gives every sampled task that kind of request
in place of its own (`mixed`: a third of the tasks each, by task id), so one kind's
figures can be read alone.

`--split train` samples training-project tasks instead, the same way: a control that
tells a policy that cannot fix bugs from one that has not learned to generalise (its
training projects' figures beside the held-out ones; `per_project` in the JSON).

Models default to `base=smollm2-base`, then `sft=vllm:RUN/checkpoints/step_0` (the warm
start) and `sft+rl=vllm:RUN/checkpoints/step_N` (the newest) when `--run` has them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def parse_models(ap: argparse.ArgumentParser, values: list[str]) -> list[tuple[str, str]]:
    """(label, spec) of each ``--model LABEL=SPEC``; a malformed one is a usage error."""
    models = []
    for m in values:
        label, sep, spec = m.partition("=")
        if not sep or not label or not spec:
            ap.error(f"--model {m!r}: expected LABEL=SPEC")
        models.append((label, spec))
    return models


def run_models(run: Path) -> list[tuple[str, str]]:
    """(label, spec) of the run's warm-start and newest checkpoints, where present; of a
    supervised run alone (`training/sft_offline.py`), its newest as "sft"."""
    root = run / "checkpoints"
    if not root.is_dir():
        return []
    steps = sorted(
        (p for p in root.glob("step_*") if (p / "config.json").is_file()),
        key=lambda p: int(p.name.split("_")[1]),
    )
    try:
        sft_only = "sft_offline" in json.loads((run / "config.json").read_text())
    except (OSError, ValueError):
        sft_only = False
    if sft_only:
        return [("sft", f"vllm:{steps[-1]}")] if steps else []
    out = []
    if steps and steps[0].name == "step_0":
        out.append(("sft", f"vllm:{steps[0]}"))
    if steps and steps[-1].name != "step_0":
        out.append(("sft+rl", f"vllm:{steps[-1]}"))
    return out


def suite_name(split: str, query: str = "mixed") -> str:
    """The catalog's name of the corpus tasks of `split` with requests of kind `query`."""
    return f"corpus:{split}" + ("" if query == "mixed" else f":{query}")


def sample_suite(
    n: int, seed: int, dest: Path, split: str = "heldout", query: str = "mixed"
) -> list[str]:
    """Link a round-robin sample of `n` corpus tasks of `split` into `dest`; their ids."""
    from opencomposer.training.catalog import load_suite
    from opencomposer.training.demos import spread

    tasks = spread(load_suite(suite_name(split, query)), n, seed)
    if not tasks:
        raise SystemExit(f"error: the corpus has no {split} tasks (build it first)")
    dest.mkdir(parents=True, exist_ok=True)
    for t in tasks:
        (dest / t.id).symlink_to(t.dir)
    return sorted(t.id for t in tasks)


def summary(report: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "model",
        "n_tasks",
        "resolved",
        "resolve_rate",
        "resolve_rate_se",
        "turns",
        "tokens",
        "tool_calls",
        "parallel_calls_per_turn",
        "edit_failures",
        "statuses",
        "duration_s",
    )
    out = {k: report.get(k) for k in keys}
    # the corpus's part-credit check (`corpus.touched_check`): every broken line changed
    rows = report.get("tasks", [])
    out["lines_changed"] = sum(bool((r.get("parts") or {}).get("check0")) for r in rows)
    projects: dict[str, list[int]] = {}
    for row in report.get("tasks", []):
        p = projects.setdefault(row.get("source", ""), [0, 0])
        p[0] += int(bool(row["resolved"]))
        p[1] += 1
    out["per_project"] = {k: f"{a}/{b}" for k, (a, b) in sorted(projects.items())}
    return out


def lines_read(traces: Path, tasks: dict[str, Any]) -> int:
    """Episodes (the newest of each task in `traces`) whose `read_file` results showed
    every broken line, by the reference solution's lines, read for the report only: how
    often the policy found the code it had to fix."""
    import sqlite3

    from opencomposer.tools.specs import READ_FILE
    from opencomposer.training.demos import load_solution, shown_lines

    if not traces.is_file():
        return 0
    db = sqlite3.connect(f"file:{traces}?mode=ro", uri=True)
    try:
        newest: dict[str, tuple[float, str]] = {}
        for sid, started, meta in db.execute("SELECT id, started, meta FROM sessions"):
            task_id = json.loads(meta or "{}").get("task_id")
            if task_id in tasks and started >= newest.get(task_id, (-1.0, ""))[0]:
                newest[task_id] = (started, sid)
        found = 0
        for task_id, (_, sid) in newest.items():
            solution = load_solution(tasks[task_id], reference=True) or {}
            sites = {(str(e["path"]), int(e.get("line", 1))) for e in solution.get("edits", [])}
            rows = db.execute(
                "SELECT args, status, result FROM tool_calls WHERE session_id = ? AND name = ?",
                (sid, READ_FILE),
            )
            reads = [
                {
                    "turn": 0,
                    "name": READ_FILE,
                    "args": json.loads(a or "{}"),
                    "status": st,
                    "result": r,
                }
                for a, st, r in rows
            ]
            found += bool(sites) and sites <= shown_lines({"tool_calls": reads}, 1)
        return found
    finally:
        db.close()


def table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    lines = [
        "| model | resolved | resolve rate ± SE | broken lines read | broken lines changed | turns | tokens | tool calls | parallel calls / turn | edit failures |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, s in rows:
        n = s["n_tasks"] or 1
        lines.append(
            f"| {label} (`{s['model']}`) | {s['resolved']}/{s['n_tasks']} | "
            f"{s['resolve_rate']:.1%} ± {s['resolve_rate_se']:.1%} | "
            f"{s.get('lines_read', 0)}/{s['n_tasks']} | "
            f"{s.get('lines_changed', 0)}/{s['n_tasks']} | {s['turns']['mean']:.2f} | "
            f"{s['tokens']['mean']:.0f} | {s['tool_calls']['mean']:.2f} | "
            f"{s['parallel_calls_per_turn']:.2f} | {s['edit_failures'] / n:.2f} per task |"
        )
    return "\n".join(lines)


def plot(rows: list[tuple[str, dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [label for label, _ in rows]
    rates = [100 * s["resolve_rate"] for _, s in rows]
    errs = [200 * s["resolve_rate_se"] for _, s in rows]
    ax.bar(
        labels, rates, yerr=errs, capsize=6, color=["#999999", "#4c78a8", "#f58518"][: len(rows)]
    )
    for i, r in enumerate(rates):
        ax.text(i, r + 0.5, f"{r:.1f}%", ha="center", va="bottom")
    ax.set_ylabel("held-out resolve rate (%), ± 2 SE")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, max(10.0, max(r + e for r, e in zip(rates, errs, strict=True)) * 1.25))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=60, help="tasks, spread over the split's projects")
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--run", type=Path, default=ROOT / "runs" / "embedded")
    ap.add_argument("--model", action="append", default=[], metavar="LABEL=SPEC")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "embedded")
    ap.add_argument("--work", type=Path, default=ROOT / "bench-heldout")
    ap.add_argument(
        "--split",
        choices=("heldout", "train"),
        default="heldout",
        help="train: training-project tasks, a control (default: held out)",
    )
    ap.add_argument(
        "--query",
        choices=("mixed", "test", "issue", "oneline"),
        default="mixed",
        help="the requests: each task's own kind (mixed, the default) or one kind for all",
    )
    a = ap.parse_args()
    what = "held-out" if a.split == "heldout" else "training-project"
    if a.query != "mixed":
        what += f" ({a.query} requests)"

    from opencomposer.training.bench import run_bench

    models = parse_models(ap, a.model)
    if not models:
        models = [("base", "smollm2-base"), *run_models(a.run)]
    suite = Path(tempfile.mkdtemp(prefix="heldout-"))
    ids = sample_suite(a.tasks, a.seed, suite, a.split, a.query)
    from opencomposer.training.catalog import load_suite

    tasks = {t.id: t for t in load_suite(suite_name(a.split, a.query)) if t.id in set(ids)}
    print(
        f"{what}: {len(ids)} tasks, {a.max_turns} turns each; CPU {cpu_model()}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    rows: list[tuple[str, dict[str, Any]]] = []
    for label, spec in models:
        t0 = time.perf_counter()
        report = run_bench(
            suite,
            model=spec,
            concurrency=a.concurrency,
            max_turns=a.max_turns,
            out=a.work / label.replace("+", "_"),
        )
        s = summary(report)
        s["lines_read"] = lines_read(a.work / label.replace("+", "_") / "traces.db", tasks)
        rows.append((label, s))
        print(
            f"{label:8} {spec}: {s['resolved']}/{s['n_tasks']} resolved "
            f"({s['resolve_rate']:.1%} ± {s['resolve_rate_se']:.1%}) in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    base = rows[0][1]["resolve_rate"]
    print()
    print(table(rows))
    for label, s in rows[1:]:
        diff = s["resolve_rate"] - base
        se = (s["resolve_rate_se"] ** 2 + rows[0][1]["resolve_rate_se"] ** 2) ** 0.5
        print(
            f"{label} vs {rows[0][0]}: {diff:+.1%} ({diff / se if se else 0:+.1f} standard errors)"
        )
    a.out.mkdir(parents=True, exist_ok=True)
    title = (
        f"{len(ids)} {what} tasks, {a.max_turns} turns; {cpu_model()}, load "
        f"{os.getloadavg()[0]:.1f}"
    )
    meta = {
        "tasks": ids,
        "max_turns": a.max_turns,
        "seed": a.seed,
        "split": a.split,
        "query": a.query,
        "cpu": cpu_model(),
        "load": os.getloadavg()[0],
        "models": {label: s for label, s in rows},
    }
    (a.out / "heldout.json").write_text(json.dumps(meta, indent=1) + "\n")
    (a.out / "heldout.md").write_text(f"{title}\n\n{table(rows)}\n")
    plot(rows, a.out / "heldout.png", title)
    print(f"wrote {a.out / 'heldout.md'}, heldout.json, heldout.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
