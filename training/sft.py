"""Supervised warm start: fine-tune on accepted traces or on rejection samples.

``opencomposer train --config FILE --sft`` is the usual first step before RL on a
user's own sessions: every trace in ``$OPENCOMPOSER_HOME/traces.db`` that ended
``completed`` and whose edits the user accepted (at least one ``accept``, no
``reject``/``undo``), or that was marked ``meta.accepted`` (an answer-only session,
a demonstration: ``training/demos.py``), becomes samples — the turns' recorded
prompt and completion ids, the loss on completion tokens only (tool results
masked), exactly like RL samples with a constant advantage of 1.

Turns recorded without token ids (a ``scripted:`` or API backend) are tokenized
the way the sampler would see them (``TraceTokenizer``): the turn's recorded
messages through the training model's chat template with the generation prompt
(exactly ``ChatTokenizer.prompt_ids``, what the vLLM backend sends), and as the
completion the assistant text followed by the end-of-turn token the sampler
stops on, as the template renders it. Turns whose text was redacted are skipped
(their recorded text is not what was said), and so is their session.

Rejection sampling (``[sft] source = "rejection"``) builds the same samples from
the policy's own rollouts that reached ``min_reward`` on training tasks; this is
the honest "SFT on successful rollouts" warm start used before RL on a tiny
model whose first rewards are too rare for GRPO groups to carry signal.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opencomposer.tools.specs import EDIT_FILE
from opencomposer.training.demos import DemoError, DemoStats, pending, record_demos
from opencomposer.training.rollouts import (
    Rollout,
    Sample,
    Turn,
    samples_from_rollout,
    turn_from_trace,
)
from opencomposer.training.sessions import demo_session_config, session_config


@dataclass(kw_only=True)
class SftData:
    samples: list[Sample]
    sessions_used: int = 0
    sessions_skipped: int = 0


def accepted(trace: dict[str, Any]) -> bool:
    """Completed, and accepted: its edits accepted (none rejected or undone), or
    marked ``meta.accepted`` (sessions without edits, demonstrations). Never a
    reference session (`demos.record_demos`, held-out tasks included)."""
    if trace.get("status") != "completed":
        return False
    decisions = {e.get("decision") for e in trace.get("edits", [])}
    if decisions & {"reject", "undo"}:
        return False
    meta = trace.get("meta") or {}
    if meta.get("source") == "reference":  # a held-out task's expert session: evaluation only
        return False
    if "accepted" in meta:
        return bool(meta["accepted"])
    return "accept" in decisions


class TraceTokenizer:
    """Token ids for trace turns recorded without them, as the sampler would see them.

    ``prompt`` is the chat template over the turn's messages with the generation
    prompt (``ChatTokenizer.prompt_ids``, what the vLLM backend feeds the engine);
    ``completion`` is the assistant text plus the end-of-turn token, cut from the
    template's rendering of the same conversation with the reply appended, so the
    next turn's prompt extends prompt + completion and turns merge into one sample.
    """

    def __init__(self, path: Any) -> None:
        from opencomposer.agent.backends._local import ChatTokenizer

        self.chat = ChatTokenizer(path)

    def turn(self, messages: list[dict[str, str]], text: str) -> Turn:
        from opencomposer.agent.protocols import Message

        msgs = [Message(role=m["role"], content=m["content"]) for m in messages]  # type: ignore[arg-type]
        prompt = self.chat.prompt_ids(msgs)
        tok = self.chat.hf
        full_text = tok.apply_chat_template(
            [m.as_dict() for m in msgs] + [{"role": "assistant", "content": text}],
            tokenize=False,
            add_generation_prompt=False,
        )
        full = list(tok(full_text, add_special_tokens=False)["input_ids"])
        if full[: len(prompt)] != prompt:  # a template that rewrites earlier turns
            completion = list(tok(text, add_special_tokens=False)["input_ids"])
            end = sorted(self.chat.stop_ids())
            completion += end[-1:]
        else:
            rest = full[len(prompt) :]
            stops = self.chat.stop_ids()
            n_text = len(tok(text, add_special_tokens=False)["input_ids"])
            cut = next((i for i in range(n_text, len(rest)) if rest[i] in stops), len(rest) - 1)
            completion = rest[: cut + 1]
        return Turn(prompt_ids=prompt, completion_ids=completion, logprobs=[0.0] * len(completion))


def samples_from_traces(
    traces: Iterable[dict[str, Any]],
    *,
    tokenizer: TraceTokenizer | None = None,
    only_accepted: bool = True,
    edit_weight: int = 1,
) -> SftData:
    """Samples of every accepted trace (``TraceStore.export`` dicts; every one given,
    without ``only_accepted``: validation sessions). Turns without token ids are
    tokenized by ``tokenizer``; without one, such sessions are skipped.
    The turns a trace's ``meta.untrained_turns`` lists (a demonstration's wrong first
    edit) stay in the context but out of the loss. The tokens of a trained turn that
    calls ``edit_file`` weigh ``edit_weight`` times in the loss (the mask holds the
    weight): the fix is a few tokens of a session, and the step that decides it."""
    if edit_weight < 1:
        raise ValueError(f"edit_weight must be at least 1, not {edit_weight}")
    data = SftData(samples=[])
    for tr in traces:
        if only_accepted and not accepted(tr):
            continue
        untrained = set((tr.get("meta") or {}).get("untrained_turns") or ())
        edit_turns = {
            c.get("turn") for c in tr.get("tool_calls") or () if c.get("name") == EDIT_FILE
        }
        turns: list[Turn | None] = []
        for t in tr.get("turns", []):
            turn = turn_from_trace(t)
            if turn is None and tokenizer is not None and not t.get("redacted"):
                turn = tokenizer.turn(t.get("messages") or [], t.get("text") or "")
            if turn is not None and t.get("turn") in untrained:
                turn.trained = False
            if turn is not None and t.get("turn") in edit_turns:
                turn.weight = edit_weight
            turns.append(turn)
        if not turns or any(t is None for t in turns):
            data.sessions_skipped += 1
            continue
        r = Rollout(task_id=str(tr.get("session_id", "")), turns=[t for t in turns if t])
        data.samples += samples_from_rollout(r, 1.0)
        data.sessions_used += 1
    return data


def load_accepted_traces(limit: int = 10_000, *, db: Any = None) -> list[dict[str, Any]]:
    """Accepted traces of a trace store (default ``$OPENCOMPOSER_HOME/traces.db``)."""
    from opencomposer.agent.traces import TraceStore

    store = TraceStore(db)
    try:
        traces = [store.export(s["session_id"]) for s in store.list_sessions(limit)]
        return [t for t in traces if accepted(t)]
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


def trace_db(run: Any) -> Path | None:
    """The trace store the warm start reads: ``[sft] traces_db``; for demonstrations
    ``<run>/demos.db`` by default; None: the user's store."""
    cfg = run.config.sft
    if cfg.traces_db:
        return Path(cfg.traces_db).expanduser()
    return Path(run.out) / "demos.db" if cfg.source == "demos" else None


def demo_style(run: Any) -> str:
    """The prompt style demonstrations are (and were) recorded in: the run's."""
    return run.prompt_style or "full"


async def ensure_demos(run: Any, db: Path) -> Any:
    """Record demonstrations of the run's training tasks (or of ``[sft] demo_suite``)
    into ``db`` (the ones not recorded there yet in this prompt style), on the run's
    environment server."""
    from opencomposer.agent.traces import TraceStore
    from opencomposer.training.catalog import load_suite
    from opencomposer.training.config import ConfigError
    from opencomposer.training.tasks import TaskError

    style = demo_style(run)
    suite = run.config.sft.demo_suite
    try:
        tasks = load_suite(suite) if suite else run.tasks
    except TaskError as e:
        raise ConfigError(f"[sft] demo_suite: {e}") from None
    store = TraceStore(db)
    try:
        todo = pending(
            store,
            tasks,
            style=style,
            limit=run.config.sft.max_examples,
            seed=run.config.run.seed,
        )
        if not todo:
            return DemoStats()
        if run.env is None:
            raise ConfigError('[sft] source = "demos" needs the environment server')
        try:
            return await record_demos(
                todo,
                env=run.env,
                store=store,
                session_config=demo_session_config(prompt_style=style),
                meta={"prompt_style": style},
            )
        except DemoError as e:
            raise ConfigError(str(e)) from None
    finally:
        store.close()


async def trace_samples(run: Any) -> SftData:
    """SFT samples of the accepted traces the warm start reads (``[sft] source`` =
    "traces" or "demos"), tokenized with the training model's tokenizer where a
    turn has no token ids. Demonstrations count only in the run's prompt style."""
    import asyncio

    from opencomposer.training.config import ConfigError

    cfg = run.config.sft
    db = trace_db(run)
    if cfg.source == "demos":
        stats = await ensure_demos(run, db)
        if stats.recorded:
            print(
                f"demonstrations: {stats.accepted}/{stats.recorded} accepted"
                + (f" (not resolved: {', '.join(sorted(stats.failed))})" if stats.failed else ""),
                flush=True,
            )
    traces = await asyncio.to_thread(load_accepted_traces, db=db)
    if cfg.source == "demos":
        style = demo_style(run)
        traces = [t for t in traces if (t.get("meta") or {}).get("prompt_style") == style]
    source_dir = getattr(run.trainer, "source_dir", None)
    tokenizer = TraceTokenizer(source_dir) if source_dir is not None else None
    data = await asyncio.to_thread(samples_from_traces, traces, tokenizer=tokenizer)
    if not data.samples:
        raise ConfigError(
            f"no accepted traces to fine-tune on in {db or 'the trace store'} "
            '(accept an agent\'s edits first, or use [sft] source = "demos" or "rejection")'
        )
    return data


async def collect_rejection_samples(run: Any) -> tuple[SftData, list[Rollout]]:
    """Roll out every training task ``samples_per_task`` times; keep the good ones."""
    import asyncio

    cfg = run.config
    scfg = session_config(cfg, prompt_style=run.prompt_style)
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
    start: int = 0,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    lr_at: Callable[[int], float] | None = None,
) -> list[dict[str, float]]:
    """``epochs`` passes of supervised steps over ``samples`` (shuffled, ``batch`` per step),
    at rate ``lr``, or ``lr_at(n)`` at step ``n`` (from 1) when given.

    ``start``: the steps an interrupted run of the same fit already took; the order is
    the seed's, so they are skipped, not redone. ``on_step(n, stats)`` follows each
    step, ``n`` counting from the fit's first. Returns the stats of the steps taken."""
    import random

    rng = random.Random(seed)
    stats: list[dict[str, float]] = []
    n = 0
    for _ in range(epochs):
        order = list(samples)
        rng.shuffle(order)
        for i in range(0, len(order), batch):
            if max_steps is not None and n >= max_steps:
                return stats
            n += 1
            if n <= start:
                continue
            st = trainer.sft_step(order[i : i + batch], lr=lr_at(n) if lr_at else lr)
            stats.append(st)
            if on_step is not None:
                on_step(n, st)
    return stats


def fit_steps(samples: int, *, epochs: int, batch: int, max_steps: int | None = None) -> int:
    """How many steps `fit` takes over ``samples`` samples in all."""
    n = epochs * -(-samples // max(1, batch))
    return n if max_steps is None else min(n, max_steps)


class SftCheckpoints:
    """Mid-round checkpoints of one supervised round, so that an interrupted warm start
    or ``--sft`` resumes where it stopped instead of from its first step.

    Every ``every`` steps (and at the round's end) the trainer's state (adapters or
    weights, optimizer, step) goes to ``<run>/checkpoints/sft_resume``, replacing the
    previous one, with a fingerprint of the round: its number, settings and samples.
    `resume` restores it only for the same round on the same samples."""

    FOLDER = "sft_resume"

    def __init__(
        self,
        trainer: Any,
        out: Path,
        *,
        every: int,
        round_: int,
        samples: Sequence[Sample],
        **settings: Any,
    ) -> None:
        import hashlib

        h = hashlib.sha1()
        for s in samples:
            h.update(json.dumps([s.input_ids, s.mask]).encode())
        self.trainer = trainer
        self.folder = out / "checkpoints" / self.FOLDER
        self.every = every
        self.key = {"round": round_, "samples": h.hexdigest()[:16], **settings}

    def resume(self) -> int:
        """The steps already taken (0: none); restores the trainer to just after them."""
        from opencomposer.training.trainer import STATE_FILE

        if not (self.folder / STATE_FILE).is_file():
            return 0
        import torch

        state = torch.load(self.folder / STATE_FILE, map_location="cpu", weights_only=False)
        extra = state.get("extra") or {}
        if extra.get("sft_round") != self.key:
            return 0
        self.trainer.load(self.folder)
        return int(extra.get("sft_step", 0))

    def __call__(self, n: int, stats: dict[str, float]) -> None:
        if self.every > 0 and n % self.every == 0:
            self.save(n)

    def save(self, n: int) -> None:
        """Write the state after step ``n``; the previous one is replaced only once
        the new one is complete."""
        import shutil

        tmp = self.folder.with_name(self.folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.trainer.save(tmp, extra={"phase": "sft", "sft_round": self.key, "sft_step": n})
        old = self.folder.with_name(self.folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if self.folder.exists():
            self.folder.rename(old)
        tmp.rename(self.folder)
        shutil.rmtree(old, ignore_errors=True)

    def clear(self) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def load_init(run: Any) -> None:
    """Start from the checkpoint ``[sft] init`` names, when it names one: a later SFT
    stage (``--sft``, or the warm start before RL) continues an earlier one."""
    from opencomposer.training.config import ConfigError

    if not run.config.sft.init:
        return
    init = Path(run.config.sft.init).expanduser()
    if not (init / "config.json").is_file():
        raise ConfigError(f"[sft] init: {init} is not a checkpoint folder")
    run.trainer.load(init)
    run.trainer.init_from = str(init)


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
    if dataclasses.is_dataclass(run.config):  # what trained the checkpoints (a card reads it)
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(run.config), indent=2))
    log = MetricsLog(out / "metrics.jsonl")
    t0 = time.perf_counter()
    reward_mean = None
    if cfg.source in ("traces", "demos"):
        data = await trace_samples(run)
    else:
        data, rollouts = await collect_rejection_samples(run)
        reward_mean = sum(r.reward for r in rollouts) / max(1, len(rollouts))
        if not data.samples:
            raise ConfigError(
                f"no rollout reached [sft] min_reward = {cfg.min_reward}; nothing to fine-tune on"
            )
    samples = data.samples[: cfg.max_examples]
    rollout_s = time.perf_counter() - t0
    settings = {"epochs": cfg.epochs, "lr": cfg.lr, "batch": cfg.micro_batch_size}
    ckpts = SftCheckpoints(
        run.trainer, out, every=cfg.checkpoint_every, round_=1, samples=samples, **settings
    )
    start = ckpts.resume()
    total = fit_steps(
        len(samples), epochs=cfg.epochs, batch=cfg.micro_batch_size, max_steps=max_steps
    )
    if start:
        log.truncate_after(start)
        print(f"sft: resumed after step {start} of {total} ({ckpts.folder})", flush=True)
    else:
        log.truncate_after(0)
        load_init(run)

    def step_done(n: int, st: dict[str, float]) -> None:
        log.write(
            {
                "step": n,
                "phase": "sft",
                "weight_version": run.trainer.version,
                "reward_mean": reward_mean,
                "loss": st.get("loss"),
                "grad_norm": st.get("grad_norm"),
                "train_s": st.get("train_s"),
                "train_tokens": st.get("train_tokens"),  # the trained (masked) tokens
                "seq_tokens": st.get("seq_tokens"),  # what the step ran through the model
                "rollout_s": rollout_s if n == start + 1 else 0.0,
                "sft_examples": len(samples),
                "sft_sessions": data.sessions_used,
                "sft_skipped": data.sessions_skipped,
            }
        )
        print(f"sft: step {n}/{total} loss {st.get('loss', float('nan')):.4f}", flush=True)
        ckpts(n, st)

    fit(
        run.trainer,
        samples,
        epochs=cfg.epochs,
        lr=cfg.lr,
        batch=cfg.micro_batch_size,
        seed=run.config.run.seed,
        max_steps=max_steps,
        start=start,
        on_step=step_done,
    )
    final = out / "checkpoints" / f"step_{total}"
    run.trainer.save(final, extra={"step": total, "phase": "sft"})
    ckpts.clear()
    plot_metrics(out / "metrics.jsonl", out)
    print(
        f"sft: {len(samples)} samples from {data.sessions_used} sessions, {total} steps -> {final}",
        flush=True,
    )
    return out
