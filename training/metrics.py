"""Per-step metrics: one JSON line per step, PNG plots, and a live progress line.

``step_metrics`` turns a step's groups plus the trainer's and sync's statistics
into the flat dict written to ``metrics.jsonl`` (keys documented inline);
``plot_metrics`` draws reward / resolve rate / held-out reward, the loss-side
numbers and the time split; ``Progress`` prints one line per step to stderr.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opencomposer.training.rollouts import BatchStats, Group, Rollout


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def rollout_summary(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Means over rollouts: reward, resolve rate, tokens and tool use."""
    ok = [r for r in rollouts if r.status == "ok"]
    out = {
        "reward_mean": _mean([r.reward for r in rollouts]),
        "resolve_rate": _mean([float(r.resolved) for r in rollouts]),
        "completion_tokens": _mean([sum(len(t.completion_ids) for t in r.turns) for r in ok]),
        "episode_s": _mean([r.duration_s for r in rollouts]),
    }
    for key in (
        "tool_calls",
        "parallel_calls_per_turn",
        "reads_before_edit",
        "searches_before_edit",
        "turns",
    ):
        out[key] = _mean([r.stats.get(key, 0.0) for r in ok])
    return out


def step_metrics(
    *,
    step: int,
    weight_version: int,
    groups: Sequence[Group],
    batch: BatchStats,
    train: dict[str, float],
    times: dict[str, float],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    rollouts = [r for g in groups for r in g.rollouts]
    versions = [v for r in rollouts for v in r.versions]
    m: dict[str, Any] = {"step": step, "weight_version": weight_version, "time": time.time()}
    m.update(rollout_summary(rollouts))
    m.update(
        rollouts=batch.rollouts,
        rollouts_failed=batch.rollouts_failed,
        rollouts_timeout=batch.rollouts_timeout,
        groups=batch.groups,
        groups_skipped_equal=batch.groups_skipped_equal,
        staleness_max=max((weight_version - v for v in versions), default=0),
        entropy=train.get("entropy", 0.0),
        kl_old=train.get("kl_old", 0.0),
        kl_ref=train.get("kl_ref", 0.0),
        clip_frac=train.get("clip_frac", 0.0),
        loss=train.get("loss", 0.0),
        grad_norm=train.get("grad_norm", 0.0),
        train_tokens=train.get("train_tokens", 0.0),
        step_skipped=train.get("skipped", 0.0),
        rollout_s=times.get("rollout_s", 0.0),
        train_s=times.get("train_s", 0.0),
        sync_s=times.get("sync_s", 0.0),
    )
    m.update(extra or {})
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in m.items()}


class MetricsLog:
    """Appends one JSON line per step; survives restarts (resume appends)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, metrics: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Drop lines past ``step`` (a resumed run redoes them)."""
        keep = [m for m in self.read() if m.get("step", 0) <= step]
        self.path.write_text("".join(json.dumps(m) + "\n" for m in keep))


PLOTS = (
    ("reward.png", "reward", ("reward_mean", "resolve_rate", "heldout_reward")),
    ("optim.png", "optimisation", ("entropy", "kl_old", "grad_norm", "clip_frac")),
    ("time.png", "seconds per step", ("rollout_s", "train_s", "sync_s")),
    (
        "tools.png",
        "tool use per episode",
        ("tool_calls", "parallel_calls_per_turn", "reads_before_edit", "completion_tokens"),
    ),
)


def plot_metrics(metrics_path: Path, out_dir: Path) -> list[Path]:
    """PNG plots of ``metrics.jsonl``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = MetricsLog(metrics_path).read()
    written = []
    for fname, title, keys in PLOTS:
        fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3))
        for ax, key in zip(axes, keys, strict=True):
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o" if key.startswith("heldout") else None)
            ax.set_title(key)
            ax.set_xlabel("step")
        fig.suptitle(title)
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    learning = plot_learning(rows, out_dir / "learning.png", plt)
    if learning is not None:
        written.append(learning)
    return written


def plot_learning(rows: Sequence[dict[str, Any]], path: Path, plt: Any) -> Path | None:
    """Held-out reward against wall-clock minutes, each point labelled with what
    produced the weights (before training, the warm start, RL step N), so the
    share of the rise due to each phase is visible; training reward as a line."""
    timed = [r for r in rows if r.get("time") is not None]
    held = [r for r in timed if r.get("heldout_reward") is not None]
    if not held:
        return None
    t0 = min(r["time"] for r in timed)
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [(r["time"] - t0) / 60 for r in held]
    ys = [r["heldout_reward"] for r in held]
    ax.plot(xs, ys, marker="o", label="held-out mean reward")
    for x, y, r in zip(xs, ys, held, strict=True):
        phase = r.get("phase")
        label = "base" if phase == "baseline" else "warm" if phase else f"{r['step']}"
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(0, 6), fontsize=7)
    train = [r for r in timed if not r.get("phase") and r.get("reward_mean") is not None]
    if train:
        ax.plot(
            [(r["time"] - t0) / 60 for r in train],
            [r["reward_mean"] for r in train],
            alpha=0.5,
            label="training-rollout mean reward",
        )
    ax.set_xlabel("minutes since the first held-out evaluation")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(
        "held-out reward: before training (base), after the warm start, after RL step N", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


class Progress:
    """One line per step on stderr: the live view of a run."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total = total
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def note(self, text: str) -> None:
        if self.enabled:
            print(f"{text} | {time.perf_counter() - self.t0:.0f}s", file=sys.stderr, flush=True)

    def update(self, m: dict[str, Any]) -> None:
        if not self.enabled:
            return
        held = m.get("heldout_reward")
        line = (
            f"step {m['step']}/{self.total} v{m['weight_version']} reward {m['reward_mean']:.3f} "
            f"resolve {m['resolve_rate']:.2f} "
            + (f"heldout {held:.3f} " if held is not None else "")
            + f"loss {m['loss'] or 0:.4f} | rollout {m['rollout_s']:.1f}s train {m['train_s']:.1f}s "
            f"sync {m['sync_s']:.2f}s | {time.perf_counter() - self.t0:.0f}s"
        )
        print(line, file=sys.stderr, flush=True)
