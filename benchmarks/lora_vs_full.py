"""LoRA against full fine-tuning for RL, from the two runs of `configs/lora-vs-full/`.

Both arms run GRPO on the starter suite from the same weights (the full arm's partial
warm start, its `step_0`); the full arm updates every weight at lr 3e-5, the LoRA arm
trains rank-16 adapters on the frozen model at 3e-4. This prints, from the runs'
`metrics.jsonl`, the held-out mean reward at each evaluation, each arm's gain over the
common start with its standard error, and the cost per RL step, and writes a table and
a plot to `docs/rl/lora-vs-full/`:

    opencomposer train --config configs/lora-vs-full/full.toml
    opencomposer train --config configs/lora-vs-full/lora.toml
    .venv/bin/python benchmarks/lora_vs_full.py [--full RUN] [--lora RUN] [--out DIR]

RUN is a run folder or its metrics.jsonl (the measured runs' copies are in
docs/rl/lora-vs-full/: `--full docs/rl/lora-vs-full/full.metrics.jsonl --lora
docs/rl/lora-vs-full/lora.metrics.jsonl --out /tmp/x` prints the same curves).

One evaluation is 17 held-out tasks x 2 samples at temperature 0.7; the standard error
of one figure is taken as sqrt(p (1 - p) / 34): exact for rewards of 0 or 1, an upper
bound for rewards in [0, 1].
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EPISODES = 34  # 17 held-out starter tasks x eval_samples 2


def rows(run: Path) -> list[dict[str, Any]]:
    """A run's metrics: RUN/metrics.jsonl, or RUN itself when it is the file (the copies
    kept beside the report)."""
    path = run if run.is_file() else run / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found: train the arm first (see --help)")
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def curve(run: Path) -> list[tuple[int, float, float]]:
    """(RL step, held-out reward, its resolve rate) at each evaluation after the warm
    start (the full arm's warm-start figure is its step 0; the LoRA arm's step 0 is
    its evaluation before any RL step, of the same weights)."""
    points: dict[int, tuple[float, float]] = {}
    before: tuple[float, float] | None = None
    for r in rows(run):
        if r.get("heldout_reward") is None:
            continue
        point = (float(r["heldout_reward"]), float(r["heldout_resolve_rate"]))
        if r.get("phase") == "baseline":
            before = point
        else:
            points[int(r["step"])] = point
    if 0 not in points and before is not None:  # no warm start: RL starts from the model
        points[0] = before
    return [(s, *points[s]) for s in sorted(points)]


def se(p: float) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / EPISODES)


def step_costs(run: Path) -> dict[str, float]:
    rl = [r for r in rows(run) if r.get("phase") in (None, "rl") and r.get("step", 0) > 0]
    trained = [r for r in rl if not r.get("step_skipped")]
    return {
        "steps": len(rl),
        "trained": len(trained),
        "train_s": statistics.mean(r["train_s"] for r in trained) if trained else 0.0,
        "rollout_s": statistics.mean(r["rollout_s"] for r in rl) if rl else 0.0,
        "sync_s": statistics.mean(r.get("sync_s", 0.0) for r in trained) if trained else 0.0,
    }


def checkpoint_bytes(run: Path) -> tuple[int, int]:
    """(weights and adapter, trainer state) of the run's newest checkpoint."""
    if run.is_file():
        return 0, 0
    ckpts = sorted((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    if not ckpts:
        return 0, 0
    files = [f for f in ckpts[-1].rglob("*") if f.is_file()]
    state = sum(f.stat().st_size for f in files if f.name == "trainer_state.pt")
    adapter = sum(f.stat().st_size for f in files if f.parent.name == "adapter")
    return adapter or sum(f.stat().st_size for f in files if f.suffix == ".safetensors"), state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", type=Path, default=ROOT / "runs" / "lora-vs-full" / "full")
    ap.add_argument("--lora", type=Path, default=ROOT / "runs" / "lora-vs-full" / "lora")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "rl" / "lora-vs-full")
    a = ap.parse_args()
    arms = {"full fine-tuning": a.full, "LoRA rank 16": a.lora}
    curves = {name: curve(run) for name, run in arms.items()}
    for name, c in curves.items():
        if not c or c[0][0] != 0:
            print(f"error: {name}: no held-out evaluation at RL step 0", file=sys.stderr)
            return 2
    steps = sorted(set.intersection(*(set(s for s, _, _ in c) for c in curves.values())))
    lines = [
        "| RL step | " + " | ".join(f"{n}: reward (resolve)" for n in arms) + " |",
        "|---|" + "---|" * len(arms),
    ]
    for s in steps:
        cells = []
        for c in curves.values():
            reward, resolve = next((r, v) for st, r, v in c if st == s)
            cells.append(f"{reward:.3f} ± {se(reward):.3f} ({resolve:.2f})")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    gains = []
    for name, c in curves.items():
        start, last = c[0][1], c[-1][1]
        after = [r for st, r, _ in c if st > 0]
        mean_after = statistics.mean(after) if after else start
        gains.append(
            f"- {name}: start {start:.3f}, last {last:.3f} ({last - start:+.3f} ± "
            f"{math.hypot(se(start), se(last)):.3f}); mean after RL {mean_after:.3f} "
            f"({mean_after - start:+.3f})"
        )
    costs = {name: step_costs(run) for name, run in arms.items()}
    cost_lines = []
    for name, c in costs.items():
        weights, state = checkpoint_bytes(arms[name])
        held = (
            f"; newest checkpoint {weights / 2**20:.0f} MiB of weights"
            f"{' (the adapter)' if 'LoRA' in name else ''}, {state / 2**20:.0f} MiB of "
            "trainer state"
            if weights
            else ""
        )
        cost_lines.append(
            f"- {name}: {c['trained']} of {c['steps']} RL steps trained; per trained step "
            f"train {c['train_s']:.1f} s, weight sync {c['sync_s']:.2f} s; rollout "
            f"{c['rollout_s']:.1f} s a step{held}"
        )
    full, lora = costs.values()
    if full["train_s"]:
        cost_lines.append(
            f"- train time per trained step, LoRA / full: {lora['train_s'] / full['train_s']:.2f}x"
        )
    text = "\n".join(
        [
            "# LoRA against full fine-tuning for RL (starter suite)",
            "",
            *lines,
            "",
            *gains,
            "",
            *cost_lines,
        ]
    )
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "report.md").write_text(text + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, c in curves.items():
        xs = [s for s, _, _ in c]
        ys = [r for _, r, _ in c]
        ax.errorbar(xs, ys, yerr=[se(y) for y in ys], marker="o", capsize=3, label=name)
    ax.set_xlabel("RL step (GRPO), from the same warm start")
    ax.set_ylabel("held-out mean reward")
    ax.set_title("LoRA vs full fine-tuning, starter suite (34 episodes / point)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out / "learning.png", dpi=110)
    print(f"wrote {a.out / 'report.md'} and {a.out / 'learning.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
