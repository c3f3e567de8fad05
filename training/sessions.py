"""The agent session settings of a training run: rollouts, evaluations, rejection samples
and demonstrations all open the production `Session` with settings made here.

`resolve_prompt_style` decides once per run which system prompt every session gets;
`session_config` turns a run's `[rollout]` section into a `SessionConfig`;
`demo_session_config` is the demonstrations' variant (every call approved, a few turns).
The RL loop (`rl.py`), the supervised warm start (`sft.py`) and the demonstrations
(`demos.py`) all read these, so none of them needs another.
"""

from __future__ import annotations

from typing import Any

from opencomposer.agent.protocols import Sampling
from opencomposer.agent.session import SessionConfig
from opencomposer.training.config import TrainConfig


def resolve_prompt_style(cfg: TrainConfig, sampler: Any) -> str:
    """The system-prompt style of every session of the run (rollouts, evals, demos):
    ``rollout.prompt_style``, or for "auto" what the sampler's backend asks for, as
    the production agent decides it (the model's ``prompt_style``, else "full")."""
    style = cfg.rollout.prompt_style
    if style != "auto":
        return style
    for m in (sampler, getattr(sampler, "inner", None)):
        value = getattr(m, "prompt_style", None)
        if isinstance(value, str) and value in ("full", "compact"):
            return value
    return "full"


def session_config(
    cfg: TrainConfig, *, temperature: float | None = None, prompt_style: str | None = None
) -> SessionConfig:
    """The settings of a rollout (or, with `temperature`, an evaluation) of `cfg`'s run."""
    r = cfg.rollout
    return SessionConfig(
        approve=r.approve,
        max_turns=r.max_turns,
        max_completion_tokens=r.max_completion_tokens,
        sampling=Sampling(
            temperature=r.temperature if temperature is None else temperature,
            top_p=r.top_p,
            max_tokens=r.max_tokens,
        ),
        emit_deltas=False,
        prompt_style=prompt_style or r.prompt_style,
        # a rollout trains on the replies as sampled: no reply picked among others, no
        # edit put in place of the model's
        fix_samples=1,
        repair=False,
    )


DEMO_MAX_TURNS = 8  # a demonstration's turn budget, the one rollouts and the held-out bench use


def demo_session_config(*, prompt_style: str, max_turns: int = DEMO_MAX_TURNS) -> SessionConfig:
    """The session settings of a demonstration: the sampler's prompt style, every
    call approved (as in rollouts), enough turns for look + edit + answer."""
    return SessionConfig(
        approve="all", max_turns=max_turns, emit_deltas=False, prompt_style=prompt_style
    )
