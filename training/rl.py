"""`opencomposer train`: GRPO-style RL through the production agent, on this CPU or a GPU.

One step:

1. **rollouts** — the ``RolloutScheduler`` hands out ``groups_per_step`` groups of
   ``group_size`` episodes; an episode is ``EnvironmentServer.run_episode`` (the
   agent ``Session`` on a fresh sandboxed copy of the task, graded by its verify
   command) with the sampler model wrapped in ``VersionedModel``;
2. **advantages + samples** — per group (``advantages``), crashed/timed-out
   rollouts masked, all-equal groups skipped; token-exact samples (``rollouts``);
3. **train** — ``Trainer.step`` (clipped ratio against the sampler's logprobs);
   in async mode rollouts keep running while it trains (a thread);
4. **sync** — the new weights go into the running sampler (``weight_sync``) with
   the new version, and the sampler's version is checked (lag is an error);
5. **metrics** — a line in ``metrics.jsonl``, a progress line, plots at the end;
   a held-out evaluation every ``tasks.eval_every`` steps; a checkpoint every
   ``run.checkpoint_every`` steps. Restarting the same command resumes from the
   newest complete checkpoint.

Where things run: the trainer and the sampler (vLLM in-process on CPU, so the
weight sync is a memory copy) live in this process; workspaces, setup and verify
run on the environment server's Ray actors; the agent session loop runs here on
the event loop, many episodes at once. With a ``[cluster]`` section the same loop
drives Ray actors instead: sampler replicas, trainer ranks and per-node episode
workers (``training/cluster.py``); the run folder then also gets ``cluster.json``
(where each role ran, the replicas' versions, the ranks' weight checksums), and the
episodes' traces are in ``traces-<node ip>-<pid>.db``, one per episode worker, each
written on its worker's node.

Run: ``opencomposer train --config configs/starter.toml [--max-steps N] [--out DIR] [--sft]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import itertools
import json
import random
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from opencomposer.training.config import ConfigError, TrainConfig, load_config
from opencomposer.training.loss import LossConfig
from opencomposer.training.metrics import (
    MetricsLog,
    Progress,
    plot_metrics,
    rollout_summary,
    step_metrics,
)
from opencomposer.training.rollouts import (
    Group,
    Rollout,
    RolloutScheduler,
    SchedulerConfig,
    build_samples,
    turn_from,
)
from opencomposer.training.sessions import resolve_prompt_style, session_config
from opencomposer.training.sft import (
    SftCheckpoints,
    collect_rejection_samples,
    fit,
    fit_steps,
    load_init,
    run_sft,
    trace_samples,
)
from opencomposer.training.trainer import (
    Trainer,
    TrainerConfig,
    latest_checkpoint,
    prune_checkpoints,
)
from opencomposer.training.weight_sync import ModuleReceiver, VersionedModel, WeightSync

# Statuses whose turns are trained on (a degenerate `repetition` reply included: its
# low reward is what teaches the policy out of it).
OK_STATUSES = frozenset({"completed", "max_turns", "max_tokens", "repetition"})
METRIC_KEYS = {  # env metrics -> rollout stats
    "tool_calls": "tool_calls",
    "parallel_calls_per_turn": "parallel_calls_per_turn",
    "reads_before_first_edit": "reads_before_edit",
    "searches_before_first_edit": "searches_before_edit",
    "turns": "turns",
}


def rollout_from_episode(result: Any, *, group: int = 0, index: int = 0) -> Rollout:
    """A ``Rollout`` from the environment server's ``EpisodeResult``, whose turns are
    the session's ``model_end`` events (the same stream traces are written from).

    Sessions that timed out or failed in the environment are kept, but marked so
    that the loss masks them out; a turn without token ids (a backend that gives
    none) makes the rollout unusable for training (``error``)."""
    status = str(getattr(result, "status", "error"))
    turns = [
        turn_from(t.output) if t.output is not None else None
        for t in getattr(result, "turns", []) or []
    ]
    r = Rollout(
        task_id=str(getattr(result, "task_id", "")),
        group=group,
        index=index,
        reward=float(getattr(result, "reward", 0.0)),
        resolved=bool(getattr(result, "resolved", False)),
        turns=[t for t in turns if t is not None],
        duration_s=float((getattr(result, "metrics", {}) or {}).get("wall_s", 0.0)),
        error=str(getattr(result, "error", "") or ""),
        session_id=str(getattr(result, "session_id", "") or ""),
    )
    metrics = getattr(result, "metrics", {}) or {}
    r.stats = {ours: float(metrics.get(theirs, 0.0)) for theirs, ours in METRIC_KEYS.items()}
    if status == "timeout":
        r.status = "timeout"
    elif status not in OK_STATUSES:
        r.status = "error"
        r.error = r.error or status
    elif any(t is None for t in turns):
        r.status = "error"
        r.error = "the sampler gave no token ids for a turn"
    return r


def task_cycle(tasks: Sequence[Any], *, seed: int, skip: int = 0) -> Iterator[Any]:
    """Tasks forever, reshuffled each epoch (deterministic, so resume can skip ahead)."""
    if not tasks:
        raise ConfigError("the task set is empty")

    def gen() -> Iterator[Any]:
        for epoch in itertools.count():
            order = list(tasks)
            random.Random(seed + epoch).shuffle(order)
            yield from order

    return itertools.islice(gen(), skip, None)


class _Counter:
    """Wraps an iterator and counts what was taken (the resume cursor)."""

    def __init__(self, it: Iterator[Any], start: int = 0) -> None:
        self.it, self.n = it, start

    def __iter__(self) -> _Counter:
        return self

    def __next__(self) -> Any:
        self.n += 1
        return next(self.it)


# -- building the pieces -----------------------------------------------------------------


def model_folder(cfg: TrainConfig, out: Path) -> Path:
    path = cfg.model.path
    if path in ("smollm2", "smollm2-base"):  # the embedded policy; "-base": untrained
        from opencomposer.agent.backends.smollm2 import smollm2_path

        folder = Path(smollm2_path(base=path == "smollm2-base"))
    else:
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"model.path {path!r} is not a folder")
    if cfg.model.moe_experts > 0:
        from opencomposer.training.upcycle import upcycle

        target = out / "upcycled"
        if not (target / "config.json").exists():
            upcycle(folder, target, num_experts=cfg.model.moe_experts, top_k=cfg.model.moe_top_k)
        folder = target
    return folder


def trainer_config(cfg: TrainConfig) -> TrainerConfig:
    a, o = cfg.algo, cfg.optim
    return TrainerConfig(
        lr=o.lr,
        weight_decay=o.weight_decay,
        grad_clip=o.grad_clip,
        micro_batch_size=o.micro_batch_size,
        gradient_checkpointing=o.gradient_checkpointing,
        lora_rank=o.lora_rank,
        lora_alpha=o.lora_alpha,
        precision=cfg.model.precision,
        loss=LossConfig(
            clip_low=a.clip_low, clip_high=a.clip_high, kl_coef=a.kl_coef, aggregation=a.aggregation
        ),
    )


def make_sampler(cfg: TrainConfig, folder: Path) -> VersionedModel:
    """The sampler, built as the production agent builds it (``smollm2`` is the
    embedded model, which asks for the compact prompt); an explicit
    ``rollout.prompt_style`` is handed to the backend."""
    from opencomposer.agent.backends import make_model

    kw: dict[str, Any] = {}
    if cfg.model.sampler == "vllm":
        kw["kv_cache_gib"] = cfg.model.kv_cache_gib
    if cfg.rollout.prompt_style != "auto":
        kw["prompt_style"] = cfg.rollout.prompt_style
    embedded = cfg.model.path == "smollm2" and cfg.model.moe_experts == 0
    inner = make_model(f"{cfg.model.sampler}:{'smollm2' if embedded else folder}", **kw)
    if hasattr(inner, "reload_weights"):
        return VersionedModel(inner)
    # the hf: backend has no reload_weights: copy into its (lazily loaded) module
    return VersionedModel(inner, ModuleReceiver(lambda: inner._model))


# -- the loop -------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class Run:
    """The pieces of one run; ``train`` builds them, tests pass their own."""

    config: TrainConfig
    out: Path
    trainer: Trainer
    sampler: Any  # VersionedModel (has reload_weights and weight_version)
    episode: Callable[[Any, Any], Any]  # async (task, session_config) -> Rollout
    tasks: Sequence[Any]
    heldout: Sequence[Any] = ()
    prompt_style: str | None = None  # resolved once (resolve_prompt_style); None: the config's
    env: Any = None  # the EnvironmentServer (demonstrations run on it)


async def evaluate(run: Run, *, samples: int) -> dict[str, float]:
    """Mean reward and resolve rate on the held-out tasks under the current weights."""
    if not run.heldout:
        return {}
    cfg = session_config(
        run.config, temperature=run.config.tasks.eval_temperature, prompt_style=run.prompt_style
    )
    rollouts = await asyncio.gather(
        *(run.episode(t, cfg) for t in run.heldout for _ in range(samples))
    )
    s = rollout_summary(list(rollouts))
    return {"heldout_reward": s["reward_mean"], "heldout_resolve_rate": s["resolve_rate"]}


async def warm_start(run: Run, log: MetricsLog, sync: WeightSync, progress: Progress) -> None:
    """Supervised rounds before RL (``[sft] warmup_rounds``): on accepted traces
    (``source`` = "traces"/"demos": the same samples each round) or on the policy's
    own good rollouts (``"rejection"``: sampled afresh each round)."""
    cfg = run.config
    traces = None
    for round_ in range(1, cfg.sft.warmup_rounds + 1):
        t0 = time.perf_counter()
        rollouts: list[Rollout] = []
        if cfg.sft.source == "rejection":
            data, rollouts = await collect_rejection_samples(run)
        else:
            traces = traces or await trace_samples(run)
            data = traces
        t1 = time.perf_counter()
        chosen = list(data.samples)  # a seeded random subset when capped, not the newest
        random.Random(cfg.run.seed + round_).shuffle(chosen)
        chosen = chosen[: cfg.sft.max_examples]
        stats = []
        if chosen:
            settings = {
                "epochs": cfg.sft.epochs,
                "lr": cfg.sft.lr,
                "batch": cfg.sft.micro_batch_size,
            }
            ckpts = SftCheckpoints(
                run.trainer,
                run.out,
                every=cfg.sft.checkpoint_every,
                round_=round_,
                samples=chosen,
                **settings,
            )
            start = await run.trainer.run(ckpts.resume)
            if start:
                progress.note(f"warm start {round_}: resumed after step {start}")
            stats = await run.trainer.run(
                fit,
                run.trainer,
                chosen,
                epochs=cfg.sft.epochs,
                lr=cfg.sft.lr,
                batch=cfg.sft.micro_batch_size,
                seed=cfg.run.seed + round_,
                start=start,
                on_step=ckpts,
            )
            total = fit_steps(len(chosen), epochs=cfg.sft.epochs, batch=cfg.sft.micro_batch_size)
            await run.trainer.run(ckpts.save, total)  # a crash before the next round resumes here
        t2 = time.perf_counter()
        res = await sync.push(run.trainer.named_weights(sync.dtype), run.trainer.version)
        m: dict[str, Any] = {
            "step": 0,
            "phase": f"warmup{round_}",
            "time": time.time(),
            "sft_source": cfg.sft.source,
            "weight_version": run.trainer.version,
            "sft_examples": len(chosen),
            "sft_sessions": data.sessions_used,
            "sft_steps": len(stats),
            "sft_tokens": sum(sum(s.mask) for s in chosen),
            "sft_seq_tokens": sum(len(s.input_ids) for s in chosen),
            "loss": _mean([s.get("loss") or 0.0 for s in stats]),
            "loss_last": stats[-1].get("loss") if stats else None,
            "rollout_s": t1 - t0,
            "train_s": t2 - t1,
            "sync_s": res.seconds,
        }
        if rollouts:
            m.update(rollout_summary(rollouts))
        if run.heldout:
            t3 = time.perf_counter()
            m.update(await evaluate(run, samples=cfg.tasks.eval_samples))
            m["eval_s"] = time.perf_counter() - t3
        log.write(m)
        progress.note(
            f"warm start {round_} ({cfg.sft.source}): {len(data.samples)} samples, "
            f"{len(stats)} steps, loss {m['loss']:.3f}, "
            f"held-out {m.get('heldout_reward', float('nan')):.3f}"
        )


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


async def run_loop(run: Run, *, max_steps: int | None = None) -> Path:
    cfg = run.config
    out = run.out
    out.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(out / "metrics.jsonl")
    steps = cfg.run.steps if max_steps is None else max_steps
    sync = WeightSync(run.sampler, max_lag=0)
    start_step, cursor, warmed = 0, 0, False
    ckpt = latest_checkpoint(out)
    if ckpt is not None:
        extra = run.trainer.load(ckpt)
        start_step, cursor = int(extra.get("step", 0)), int(extra.get("task_cursor", 0))
        warmed = bool(extra.get("warmed", start_step > 0))
        log.truncate_after(start_step)
        await sync.push(run.trainer.named_weights(sync.dtype), run.trainer.version)
        print(
            f"resumed from {ckpt} (step {start_step}, weight version {run.trainer.version})",
            flush=True,
        )
    elif cfg.sft.init:  # a fresh run continues an earlier stage's checkpoint
        load_init(run)
        await sync.push(run.trainer.named_weights(sync.dtype), run.trainer.version)
        print(f"started from {cfg.sft.init} ([sft] init)", flush=True)
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    tasks = _Counter(task_cycle(run.tasks, seed=cfg.run.seed, skip=cursor), cursor)
    scfg = session_config(cfg, prompt_style=run.prompt_style)
    r = cfg.rollout

    async def episode(task: Any, group: int, index: int) -> Rollout:
        ro = await run.episode(task, scfg)
        ro.group, ro.index = group, index
        return ro

    scheduler = RolloutScheduler(
        tasks=tasks,
        episode=episode,
        version=lambda: run.trainer.version,
        config=SchedulerConfig(
            group_size=r.group_size,
            groups_per_step=r.groups_per_step,
            mode=r.mode,
            max_inflight=r.max_inflight,
            extra_per_group=r.extra_per_group,
            max_staleness=r.max_staleness,
            episode_timeout_s=r.episode_timeout_s,
        ),
    )
    progress = Progress(steps, enabled=cfg.run.progress)
    try:
        if start_step == 0 and not warmed:
            if run.heldout:
                t3 = time.perf_counter()
                ev = await evaluate(run, samples=cfg.tasks.eval_samples)
                log.write(
                    {
                        "step": 0,
                        "phase": "baseline",
                        "time": time.time(),
                        "weight_version": run.trainer.version,
                        "prompt_style": run.prompt_style,
                        "reward_mean": None,
                        "eval_s": time.perf_counter() - t3,
                        **ev,
                    }
                )
                progress.note(f"baseline held-out reward {ev['heldout_reward']:.3f}")
            if cfg.sft.warmup_rounds > 0:
                await warm_start(run, log, sync, progress)
                run.trainer.save(out / "checkpoints" / "step_0", extra={"step": 0, "warmed": True})
                shutil.rmtree(out / "checkpoints" / SftCheckpoints.FOLDER, ignore_errors=True)
        for step in range(start_step + 1, steps + 1):
            t0 = time.perf_counter()
            groups: list[Group] = await scheduler.next_groups()
            t1 = time.perf_counter()
            samples, bstats = build_samples(groups, estimator=cfg.algo.estimator)
            train = await run.trainer.run(run.trainer.step, samples)
            t2 = time.perf_counter()
            sync_s = 0.0
            if not train.get("skipped"):
                sync_s = (
                    await sync.push(run.trainer.named_weights(sync.dtype), run.trainer.version)
                ).seconds
            extra: dict[str, Any] = {
                "groups_dropped_stale": scheduler.dropped_stale,
                "aborted_turns": getattr(run.sampler, "aborted_turns", 0),
            }
            sampler_metrics = getattr(run.sampler, "metrics", None)
            if callable(sampler_metrics):  # a cluster: weight bytes sent, replacements
                extra.update(sampler_metrics())
            if (
                run.heldout
                and cfg.tasks.eval_every
                and (step % cfg.tasks.eval_every == 0 or step == steps)
            ):
                t3 = time.perf_counter()
                extra.update(await evaluate(run, samples=cfg.tasks.eval_samples))
                extra["eval_s"] = time.perf_counter() - t3
            m = step_metrics(
                step=step,
                weight_version=run.trainer.version,
                groups=groups,
                batch=bstats,
                train=train,
                times={"rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": sync_s},
                extra=extra,
            )
            log.write(m)
            progress.update(m)
            if cfg.run.checkpoint_every and (step % cfg.run.checkpoint_every == 0 or step == steps):
                run.trainer.save(
                    out / "checkpoints" / f"step_{step}",
                    extra={"step": step, "task_cursor": tasks.n},
                )
                prune_checkpoints(out, cfg.run.keep_checkpoints)
    finally:
        await scheduler.close()
    plot_metrics(out / "metrics.jsonl", out)
    return out


async def _train_async(cfg: TrainConfig, out: Path, max_steps: int | None, sft: bool) -> Path:
    from opencomposer.agent.traces import TraceStore
    from opencomposer.training.catalog import load_suite
    from opencomposer.training.env import EnvConfig, EnvironmentServer
    from opencomposer.training.tasks import TaskError

    try:
        tasks = load_suite(cfg.tasks.suite)
        heldout = load_suite(cfg.tasks.heldout) if cfg.tasks.heldout else []
    except TaskError as e:
        raise ConfigError(str(e)) from None
    if not tasks:
        raise ConfigError(f"task suite {cfg.tasks.suite!r} is empty")
    folder = model_folder(cfg, out)
    if cfg.cluster is not None:
        if sft:
            raise ConfigError("--sft is not supported with [cluster] yet; run it on one machine")
        return await train_on_cluster(cfg, out, tasks, heldout, folder, max_steps=max_steps)
    trainer = Trainer.from_pretrained(
        folder, trainer_config(cfg), with_reference=cfg.algo.kl_coef > 0
    )
    sampler = make_sampler(cfg, folder)
    # `--sft` on traces or demonstrations never samples: the engine stays unstarted;
    # on traces it runs no episode either: no Ray, no environment actors
    samples = not sft or cfg.sft.source == "rejection"
    env = None
    if not sft or cfg.sft.source != "traces":
        env = EnvironmentServer(EnvConfig(num_actors=max(1, min(cfg.rollout.num_workers, 4))))
    out.mkdir(parents=True, exist_ok=True)
    traces = TraceStore(out / "traces.db")  # every episode, like a user's session
    await asyncio.gather(*([env.start()] if env else []), *([sampler.start()] if samples else []))

    async def episode(task: Any, scfg: Any) -> Rollout:
        if env is None:
            raise RuntimeError("--sft on traces runs no episodes")
        res = env.run_episode(
            task, model_spec_or_factory=sampler, session_config=scfg, traces=traces
        )
        if inspect.isawaitable(res):
            res = await res
        return rollout_from_episode(res)

    run = Run(
        config=cfg,
        out=out,
        trainer=trainer,
        sampler=sampler,
        episode=episode,
        tasks=tasks,
        heldout=heldout,
        prompt_style=resolve_prompt_style(cfg, sampler),
        env=env,
    )
    trainer.prompt_style = run.prompt_style
    trainer.max_turns = cfg.rollout.max_turns  # the budget its episodes are trained to fit
    try:
        if sft:
            return await run_sft(run, max_steps=max_steps)
        return await run_loop(run, max_steps=max_steps)
    finally:
        if env is not None:
            await env.close()
        traces.close()
        await sampler.close()


async def train_on_cluster(
    cfg: TrainConfig,
    out: Path,
    tasks: Sequence[Any],
    heldout: Sequence[Any],
    folder: Path,
    *,
    max_steps: int | None = None,
) -> Path:
    """``run_loop`` with its roles on Ray actors (``[cluster]``); writes ``cluster.json``."""
    from opencomposer.training.cluster import Cluster

    cluster = Cluster(
        cfg,
        folder,
        make_model=functools.partial(make_sampler, cfg, folder),
        to_rollout=rollout_from_episode,
        trainer_config=trainer_config(cfg),
    )
    cluster.traces_dir = str(out.resolve())  # traces-<node>-<pid>.db, on each worker's node
    try:
        await cluster.start()
        run = Run(
            config=cfg,
            out=out,
            trainer=cluster.trainer,
            sampler=cluster.sampler,
            episode=cluster.episode,
            tasks=tasks,
            heldout=heldout,
            prompt_style=resolve_prompt_style(cfg, cluster.sampler),
        )
        cluster.trainer.prompt_style = run.prompt_style
        await run_loop(run, max_steps=max_steps)
        report = await cluster.report()
        (out / "cluster.json").write_text(json.dumps(report, indent=2))
        return out
    finally:
        await cluster.close()


def train(
    config_path: Path, *, max_steps: int | None = None, out: Path | None = None, sft: bool = False
) -> Path:
    """The CLI entry point: returns the run folder (metrics.jsonl, plots, checkpoints)."""
    cfg = load_config(Path(config_path))
    if max_steps is not None and max_steps < 0:
        raise ConfigError("--max-steps must be >= 0")
    run_dir = Path(out) if out is not None else Path(cfg.run.out)
    if sft:
        run_dir = run_dir / "sft" if out is None else run_dir
    return asyncio.run(_train_async(cfg, run_dir, max_steps, sft))
