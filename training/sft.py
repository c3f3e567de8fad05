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
