"""Supervised warm start: fine-tune on accepted traces or on rejection samples.

``opencomposer train --config FILE --sft`` is the usual first step before RL on a
user's own sessions: every trace in ``$OPENCOMPOSER_HOME/traces.db`` that ended
``completed`` and whose edits the user accepted (at least one ``accept``, no
``reject``/``undo``) becomes token-exact samples — the turns' recorded prompt and
completion ids, the loss on completion tokens only (tool results masked), exactly
like RL samples with a constant advantage of 1. Traces whose token ids were
withheld (redacted secrets) or never recorded are skipped and counted.

Rejection sampling (``[sft] source = "rejection"``) builds the same samples from
the policy's own rollouts that reached ``min_reward`` on training tasks; this is
the honest "SFT on successful rollouts" warm start used before RL on a tiny
model whose first rewards are too rare for GRPO groups to carry signal.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from opencomposer.training.rollouts import Rollout, Sample, samples_from_rollout, turn_from


@dataclass(kw_only=True)
class SftData:
    samples: list[Sample]
    sessions_used: int = 0
    sessions_skipped: int = 0


def accepted(trace: dict[str, Any]) -> bool:
    decisions = {e.get("decision") for e in trace.get("edits", [])}
    return (
        trace.get("status") == "completed"
        and "accept" in decisions
        and not decisions & {"reject", "undo"}
    )


def samples_from_traces(traces: Iterable[dict[str, Any]]) -> SftData:
    """Samples of every accepted trace (``TraceStore.export`` dicts)."""
    data = SftData(samples=[])
    for tr in traces:
        if not accepted(tr):
            continue
        turns = [turn_from(t) for t in tr.get("turns", [])]
        if not turns or any(t is None for t in turns):
            data.sessions_skipped += 1
            continue
        r = Rollout(task_id=str(tr.get("session_id", "")), turns=[t for t in turns if t])
        data.samples += samples_from_rollout(r, 1.0)
        data.sessions_used += 1
    return data


def load_accepted_traces(limit: int = 10_000) -> list[dict[str, Any]]:
    from opencomposer.agent.traces import TraceStore

    store = TraceStore()
    try:
        return [store.export(s["session_id"]) for s in store.list_sessions(limit)]
    finally:
        store.close()


def samples_from_rollouts(rollouts: Sequence[Rollout], *, min_reward: float) -> SftData:
    """Rejection sampling: the rollouts that reached ``min_reward``."""
    data = SftData(samples=[])
    for r in rollouts:
        if r.status == "ok" and r.turns and r.reward >= min_reward:
            data.samples += samples_from_rollout(r, 1.0)
            data.sessions_used += 1
        else:
            data.sessions_skipped += 1
    return data


async def collect_rejection_samples(run: Any) -> tuple[SftData, list[Rollout]]:
    """Roll out every training task ``samples_per_task`` times; keep the good ones."""
    import asyncio

    from opencomposer.training.rl import session_config

    cfg = run.config
    scfg = session_config(cfg)
    rollouts = await asyncio.gather(
        *(run.episode(t, scfg) for t in run.tasks for _ in range(cfg.sft.samples_per_task))
    )
    data = samples_from_rollouts(rollouts, min_reward=cfg.sft.min_reward)
    return data, list(rollouts)


def fit(
    trainer: Any,
    samples: Sequence[Sample],
    *,
    epochs: int,
    lr: float,
    batch: int,
    seed: int,
    max_steps: int | None = None,
) -> list[dict[str, float]]:
    """``epochs`` passes of supervised steps over ``samples`` (shuffled, ``batch`` per step)."""
    import random

    rng = random.Random(seed)
    stats: list[dict[str, float]] = []
    for _ in range(epochs):
        order = list(samples)
        rng.shuffle(order)
        for i in range(0, len(order), batch):
            if max_steps is not None and len(stats) >= max_steps:
                return stats
            stats.append(trainer.sft_step(order[i : i + batch], lr=lr))
    return stats


async def run_sft(run: Any, *, max_steps: int | None = None) -> Any:
    """``opencomposer train --sft``: fine-tune, write metrics and a loadable checkpoint.

    Returns the run folder; its ``checkpoints/step_N`` is a Hugging Face folder
    (tokenizer included) to use as ``model.path`` of an RL run."""
    import time

    from opencomposer.training.config import ConfigError
    from opencomposer.training.metrics import MetricsLog, plot_metrics

    cfg = run.config.sft
    out = run.out
    out.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(out / "metrics.jsonl")
    t0 = time.perf_counter()
    reward_mean = None
    if cfg.source == "traces":
        data = samples_from_traces(load_accepted_traces())
        if not data.samples:
            raise ConfigError(
                "no accepted traces with token ids to fine-tune on "
                '(accept an agent\'s edits first, or use [sft] source = "rejection")'
            )
    else:
        data, rollouts = await collect_rejection_samples(run)
        reward_mean = sum(r.reward for r in rollouts) / max(1, len(rollouts))
        if not data.samples:
            raise ConfigError(
                f"no rollout reached [sft] min_reward = {cfg.min_reward}; nothing to fine-tune on"
            )
    samples = data.samples[: cfg.max_examples]
    rollout_s = time.perf_counter() - t0
    stats = fit(
        run.trainer,
        samples,
        epochs=cfg.epochs,
        lr=cfg.lr,
        batch=cfg.micro_batch_size,
        seed=run.config.run.seed,
        max_steps=max_steps,
    )
    for i, st in enumerate(stats, 1):
        log.write(
            {
                "step": i,
                "phase": "sft",
                "weight_version": run.trainer.version - len(stats) + i,
                "reward_mean": reward_mean,
                "loss": st.get("loss"),
                "grad_norm": st.get("grad_norm"),
                "train_s": st.get("train_s"),
                "rollout_s": rollout_s if i == 1 else 0.0,
                "sft_examples": len(samples),
                "sft_sessions": data.sessions_used,
                "sft_skipped": data.sessions_skipped,
            }
        )
    run.trainer.save(
        out / "checkpoints" / f"step_{len(stats)}", extra={"step": len(stats), "phase": "sft"}
    )
    plot_metrics(out / "metrics.jsonl", out)
    print(
        f"sft: {len(samples)} samples from {data.sessions_used} sessions, {len(stats)} steps -> "
        f"{out / 'checkpoints' / f'step_{len(stats)}'}",
        flush=True,
    )
    return out
