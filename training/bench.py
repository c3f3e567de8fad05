"""The internal benchmark: every task of a suite through the environment server.

`opencomposer bench --tasks DIR|own|starter --model SPEC [--max-turns N] [--concurrency N] [--out DIR]`
calls `run_bench`, which runs each task once as an episode (the production
`Session`, tools in fresh sandboxed workspaces, verify at the end) and writes:

- `report.json` — `{resolve_rate, resolve_rate_se (binomial standard error), mean_reward,
  wall_s: {p50, p90}, turns, tokens, tool_calls,
  parallel_calls_per_turn, reads_before_first_edit, searches_before_first_edit,
  edit_failures, statuses, errors: {task id: one line}, tasks: [{id, resolved,
  reward, status, error, …}], …}` — a task that cannot run (a repo.tar entry that
  escapes, a failing setup) is one row with its status and a one-line error
- `report.md` — the same as a Markdown summary and per-task table
- `wall_time.png`, `per_task.png` — plots (matplotlib, Agg backend)
- `traces.db` — every episode recorded like a user's session (`meta` adds the task,
  reward and status); a row's `session_id` names its trace:
  `OPENCOMPOSER_HOME=OUT opencomposer traces show SESSION_ID`

    from opencomposer.training.bench import run_bench
    report = run_bench("starter", model="scripted:turns.json", concurrency=4, out=Path("bench-out"))
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opencomposer.agent.traces import TraceStore
from opencomposer.training.catalog import load_suite
from opencomposer.training.env import EnvConfig, EnvironmentServer, EpisodeResult
from opencomposer.training.tasks import Task, TaskError

TRACES = "traces.db"  # every episode's trace: OPENCOMPOSER_HOME=OUT opencomposer traces show ID
MEAN_KEYS = (
    "turns",
    "tokens",
    "tool_calls",
    "parallel_calls_per_turn",
    "reads_before_first_edit",
    "searches_before_first_edit",
    "edit_failures",
)


def run_bench(
    tasks_dir_or_suite: str | Path,
    *,
    model: str,
    concurrency: int = 4,
    out: Path | str = Path("bench-out"),
    env_config: EnvConfig | None = None,
    session_config: Any = None,
    limit: int | None = None,
    max_turns: int | None = None,
    on_result: Callable[[EpisodeResult], None] | None = None,
    cluster: str | None = None,
) -> dict[str, Any]:
    """Run the suite, write the report files into `out`, return the report dict.
    `max_turns` is each episode's turn budget (the session's default otherwise).
    `cluster` (a Ray address) joins that cluster and runs the episodes on episode
    workers spread over its nodes (`training/cluster.py`), each building the model
    from `model` on its own node; their traces go to `out/traces-<node>-<pid>.db` on
    the node that ran them.

    Raises TaskError (one line) for a bad suite or concurrency; the model spec is
    checked by the backend (ValueError, one line).
    """
    if concurrency < 1:
        raise TaskError(f"concurrency must be at least 1, got {concurrency}")
    if max_turns is not None:
        if max_turns < 1:
            raise TaskError(f"max_turns must be at least 1, got {max_turns}")
        from dataclasses import replace

        from opencomposer.agent.session import SessionConfig

        base = session_config or SessionConfig(approve="all", emit_deltas=False)
        session_config = replace(base, max_turns=max_turns)
    tasks = load_suite(tasks_dir_or_suite)
    if limit is not None:
        tasks = tasks[:limit]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = env_config or EnvConfig(num_actors=min(concurrency, 4), pool_size=0)
    t0 = time.time()
    traces = TraceStore(out / TRACES)
    try:
        if cluster:
            results = asyncio.run(
                _run_cluster(tasks, model, concurrency, cluster, session_config, on_result, out)
            )
        else:
            results = asyncio.run(
                _run(tasks, model, concurrency, cfg, session_config, on_result, traces)
            )
    finally:
        traces.close()
    report = make_report(
        results, tasks, suite=str(tasks_dir_or_suite), model=model, concurrency=concurrency
    )
    report["max_turns"] = session_config.max_turns if session_config is not None else None
    if cluster:
        report["cluster"] = cluster
        report["nodes"] = len({r.metrics.get("node") for r in results if r.metrics.get("node")})
    report["started"] = t0
    report["duration_s"] = round(time.time() - t0, 2)
    write_report(report, out)
    return report


async def _run(
    tasks: list[Task],
    model: str,
    concurrency: int,
    cfg: EnvConfig,
    session_config: Any,
    on_result: Callable[[EpisodeResult], None] | None,
    traces: TraceStore,
) -> list[EpisodeResult]:
    server = EnvironmentServer(cfg)
    gate = asyncio.Semaphore(concurrency)
    try:
        model_obj = server.model(model)  # built once, shared by every episode
        start = getattr(model_obj, "start", None)
        if start is not None:  # engines start before the clock of any episode runs
            await start()

        async def one(task: Task) -> EpisodeResult:
            async with gate:
                r = await server.run_episode(
                    task,
                    model_spec_or_factory=model_obj,
                    session_config=session_config,
                    traces=traces,
                )
            if on_result is not None:
                on_result(r)
            return r

        return list(await asyncio.gather(*(one(t) for t in tasks)))
    finally:
        await server.close()


async def _run_cluster(
    tasks: list[Task],
    model: str,
    concurrency: int,
    address: str,
    session_config: Any,
    on_result: Callable[[EpisodeResult], None] | None,
    out: Path,
) -> list[EpisodeResult]:
    """The suite on episode workers across the cluster at `address` (one per node)."""
    from opencomposer.training.cluster import Cluster
    from opencomposer.training.config import parse_config

    cfg = parse_config(
        {
            "rollout": {"num_workers": min(concurrency, 4)},
            "cluster": {"address": address, "env_workers_per_node": 1},
        }
    )
    cluster = Cluster(cfg, Path("."), make_model=None, to_rollout=None)
    gate = asyncio.Semaphore(concurrency)
    try:
        await cluster.start(roles=("env",))

        async def one(task: Task) -> EpisodeResult:
            async with gate:
                r = await cluster.bench_episode(task, model, session_config, str(out.resolve()))
            if on_result is not None:
                on_result(r)
            return r

        return list(await asyncio.gather(*(one(t) for t in tasks)))
    finally:
        await cluster.close()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return round(s[lo] + (s[hi] - s[lo]) * (k - lo), 3)


def make_report(
    results: list[EpisodeResult], tasks: list[Task], *, suite: str, model: str, concurrency: int
) -> dict[str, Any]:
    by_id = {t.id: t for t in tasks}
    rows = []
    for r in results:
        m = r.metrics
        rows.append(
            {
                "id": r.task_id,
                "resolved": r.resolved,
                "reward": r.reward,
                "status": r.status,
                "wall_s": m.get("wall_s", 0.0),
                **{k: m.get(k, 0) for k in MEAN_KEYS},
                "prompt_tokens": m.get("prompt_tokens", 0),
                "completion_tokens": m.get("completion_tokens", 0),
                "parts": r.parts,
                "source": by_id[r.task_id].source if r.task_id in by_id else "",
                "session_id": r.session_id,
                "error": _one_line(r.error) if r.error else r.error,
            }
        )
    n = len(rows)
    walls = [row["wall_s"] for row in rows]
    report: dict[str, Any] = {
        "suite": suite,
        "model": model,
        "concurrency": concurrency,
        "n_tasks": n,
        "resolved": sum(row["resolved"] for row in rows),
        "resolve_rate": round(sum(row["resolved"] for row in rows) / n, 4) if n else 0.0,
        "resolve_rate_se": _binomial_se(sum(row["resolved"] for row in rows), n),
        "turns": {"total": sum(row["turns"] for row in rows), "mean": _mean(rows, "turns")},
        "mean_reward": round(statistics.fmean(row["reward"] for row in rows), 4) if n else 0.0,
        "wall_s": {
            "p50": _pct(walls, 0.5),
            "p90": _pct(walls, 0.9),
            "mean": round(statistics.fmean(walls), 3) if n else 0.0,
        },
        "tokens": {"total": sum(row["tokens"] for row in rows), "mean": _mean(rows, "tokens")},
        "tool_calls": {
            "total": sum(row["tool_calls"] for row in rows),
            "mean": _mean(rows, "tool_calls"),
        },
        "parallel_calls_per_turn": _mean(rows, "parallel_calls_per_turn"),
        "reads_before_first_edit": _mean(rows, "reads_before_first_edit"),
        "searches_before_first_edit": _mean(rows, "searches_before_first_edit"),
        "edit_failures": sum(row["edit_failures"] for row in rows),
        "statuses": dict(Counter(row["status"] for row in rows)),
        # one line per task that could not run or failed in the environment
        "errors": {row["id"]: row["error"] for row in rows if row["error"]},
        "tasks": rows,
    }
    return report


def _binomial_se(k: int, n: int) -> float:
    """The standard error of a resolve rate k/n: sqrt(p (1 - p) / n)."""
    if n == 0:
        return 0.0
    p = k / n
    return round(math.sqrt(p * (1 - p) / n), 4)


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return round(statistics.fmean(float(r[key]) for r in rows), 3) if rows else 0.0


def write_report(report: dict[str, Any], out: Path) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(markdown(report))
    plot(report, out)


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Benchmark: {report['suite']} with {report['model']}",
        "",
        "| metric | value |",
        "|---|---|",
        f"| tasks | {report['n_tasks']} |",
        f"| resolve rate | {report['resolve_rate']:.1%} ({report['resolved']}/{report['n_tasks']}) |",
        f"| resolve rate standard error | {report.get('resolve_rate_se', 0.0):.1%} |",
        f"| turns (mean) | {report.get('turns', {}).get('mean', 0.0):.2f} |",
        f"| mean reward | {report['mean_reward']:.3f} |",
        f"| wall time per task p50 / p90 | {report['wall_s']['p50']:.2f} s / {report['wall_s']['p90']:.2f} s |",
        f"| tokens (total / mean) | {report['tokens']['total']} / {report['tokens']['mean']:.0f} |",
        f"| tool calls (total / mean) | {report['tool_calls']['total']} / {report['tool_calls']['mean']:.1f} |",
        f"| parallel calls per turn | {report['parallel_calls_per_turn']:.2f} |",
        f"| reads / searches before first edit | {report['reads_before_first_edit']:.2f} / {report['searches_before_first_edit']:.2f} |",
        f"| edit failures | {report['edit_failures']} |",
        f"| statuses | {', '.join(f'{k}: {v}' for k, v in sorted(report['statuses'].items()))} |",
        "",
        "| task | resolved | reward | status | wall s | turns | tokens | tool calls | parallel/turn | reads→edit | searches→edit | edit failures |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["tasks"]:
        lines.append(
            f"| {r['id']} | {'yes' if r['resolved'] else 'no'} | {r['reward']:.2f} | {r['status']} | "
            f"{r['wall_s']:.2f} | {r['turns']} | {r['tokens']} | {r['tool_calls']} | "
            f"{r['parallel_calls_per_turn']:.2f} | {r['reads_before_first_edit']} | "
            f"{r['searches_before_first_edit']} | {r['edit_failures']} |"
        )
    if report.get("errors"):
        lines += ["", "## Errors", ""]
        lines += [f"- {task}: {error}" for task, error in report["errors"].items()]
    return "\n".join(lines) + "\n"


def _one_line(text: str) -> str:
    """An error as one line: whitespace and line breaks folded, at most 300 characters."""
    return " ".join(str(text).split())[:300]


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["tasks"]
    ids = [r["id"] for r in rows]
    colors = ["tab:green" if r["resolved"] else "tab:red" for r in rows]

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist([r["wall_s"] for r in rows] or [0], bins=min(20, max(1, len(rows))), color="tab:blue")
    for q, style in (("p50", "--"), ("p90", ":")):
        ax.axvline(
            report["wall_s"][q],
            color="black",
            linestyle=style,
            label=f"{q} {report['wall_s'][q]:.2f} s",
        )
    ax.set_xlabel("wall time per task (s)")
    ax.set_ylabel("tasks")
    ax.set_title(f"{report['suite']}: resolve rate {report['resolve_rate']:.0%}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "wall_time.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(4, 1, figsize=(max(6, 0.35 * len(rows) + 2), 10), sharex=True)
    for ax, key, label in zip(
        axes,
        ("reward", "tokens", "tool_calls", "parallel_calls_per_turn"),
        ("reward", "tokens", "tool calls", "parallel calls / turn"),
        strict=True,
    ):
        ax.bar(range(len(rows)), [r[key] for r in rows], color=colors)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0, top=max([1.0, *(r[key] * 1.1 for r in rows)]))
    axes[-1].set_xticks(range(len(rows)))
    axes[-1].set_xticklabels(ids, rotation=90, fontsize=7)
    axes[0].set_title("per task (green: resolved)")
    fig.tight_layout()
    fig.savefig(out / "per_task.png", dpi=100)
    plt.close(fig)
