"""Rollouts: agent sessions recorded token-exactly, turned into training samples,
and scheduled asynchronously with bounded staleness.

A rollout *is* an agent session run by the environment server; what training
keeps of it is, per model turn, the exact prompt token ids, completion token ids,
completion logprobs and the weight version that sampled them (``Turn``). Text is
never re-tokenized.

Samples (``samples_from_rollout``): turn k+1's prompt normally extends turn k's
prompt + completion by the tool results (and chat-template glue), so consecutive
turns are merged into one sequence whose loss mask is 1 on completion tokens only
— tool-result tokens, prompts and template tokens are masked out. Where a prompt
does *not* extend the previous sequence (context was trimmed), a new sample
starts: still token-exact, just not shared.

Scheduling (``RolloutScheduler``), for environments with heavy-tailed latencies:

- ``mode="sync"``: the naive baseline: launch B groups of G, wait for all of
  them, hand them out; nothing runs while the trainer trains.
- ``mode="async"``: keep up to ``max_inflight`` groups running at all times
  (over-sampling: more groups in flight than one step consumes); a step takes the
  first B groups to complete (the cut-off) and the others keep running into
  the next step. Within a group, ``extra_per_group`` more rollouts than G may be
  launched and the group closes when G have finished (the slowest are cancelled).
  Staleness is bounded: a group whose oldest turn was sampled more than
  ``max_staleness`` versions before the trainer's current one is dropped (and
  counted), and no new group starts while too many stale ones are in flight.
- every episode has a time limit; a rollout that crashes or times out is kept
  with status ``error``/``timeout``, masked out of the loss and counted.

Abort/resume of partial rollouts on a weight change lives in the sampler
wrapper (``weight_sync.VersionedModel``): a turn interrupted by new weights is
regenerated under them and the rollout continues; finished turns keep the
version they were sampled with, so staleness is measured per turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from opencomposer.training.advantages import Estimator, group_advantages

if TYPE_CHECKING:
    from opencomposer.agent.protocols import TurnOutput

Status = Literal["ok", "error", "timeout", "aborted"]


@dataclass(kw_only=True)
class Turn:
    """What training needs from one model turn."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    weight_version: int | None = None
    trained: bool = True  # False: its tokens stay in the context, out of the loss
    weight: int = 1  # the loss weight of its tokens (supervised samples: `sft.samples_from_traces`)


@dataclass(kw_only=True)
class Rollout:
    task_id: str
    group: int = 0
    index: int = 0
    status: Status = "ok"
    reward: float = 0.0
    resolved: bool = False
    turns: list[Turn] = field(default_factory=list)
    # tool_calls, parallel_calls_per_turn, reads_before_edit, searches_before_edit …
    stats: dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0
    error: str = ""
    session_id: str = ""  # the episode's trace (`<run>/traces.db`)

    @property
    def versions(self) -> list[int]:
        return [t.weight_version for t in self.turns if t.weight_version is not None]


@dataclass(kw_only=True)
class Sample:
    """One training sequence. ``mask``/``old_logprobs`` are aligned with ``input_ids``."""

    input_ids: list[int]
    mask: list[int]
    old_logprobs: list[float]
    advantage: float
    weight_version: int | None = None
    task_id: str = ""


@dataclass(kw_only=True)
class Group:
    task: Any
    task_id: str
    group: int
    rollouts: list[Rollout] = field(default_factory=list)

    @property
    def usable(self) -> list[Rollout]:
        return [r for r in self.rollouts if r.status == "ok" and r.turns]


# -- turns and samples ---------------------------------------------------------------


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def turn_from(output: TurnOutput) -> Turn | None:
    """A ``Turn`` from a session turn's model output (``TurnRecord.output``, the
    ``ModelEnd`` event's ``output``); None when the backend gave no token ids."""
    return _turn(
        output.prompt_token_ids,
        output.completion_token_ids,
        output.completion_logprobs,
        output.weight_version,
    )


def turn_from_trace(row: dict[str, Any]) -> Turn | None:
    """A ``Turn`` from a turn of a stored trace (``TraceStore.export``)."""
    return _turn(
        row.get("prompt_token_ids"),
        row.get("completion_token_ids"),
        row.get("completion_logprobs"),
        row.get("weight_version"),
    )


def _turn(
    prompt: list[int] | None,
    completion: list[int] | None,
    logprobs: list[float] | None,
    version: int | None,
) -> Turn | None:
    if prompt is None or completion is None or logprobs is None:
        return None
    if len(logprobs) != len(completion):
        raise ValueError(f"{len(completion)} completion tokens but {len(logprobs)} logprobs")
    return Turn(
        prompt_ids=list(prompt),
        completion_ids=list(completion),
        logprobs=[float(x) for x in logprobs],
        weight_version=version,
    )


def samples_from_rollout(rollout: Rollout, advantage: float) -> list[Sample]:
    """Token-exact samples of one rollout; consecutive turns merged where prompts extend."""
    samples: list[Sample] = []
    ids: list[int] = []
    mask: list[int] = []
    old: list[float] = []
    version: int | None = None

    def flush() -> None:
        if ids and any(mask):
            samples.append(
                Sample(
                    input_ids=list(ids),
                    mask=list(mask),
                    old_logprobs=list(old),
                    advantage=advantage,
                    weight_version=version,
                    task_id=rollout.task_id,
                )
            )

    for turn in rollout.turns:
        if ids and turn.prompt_ids[: len(ids)] == ids:
            delta = turn.prompt_ids[len(ids) :]  # tool results + template glue: masked
        else:
            flush()
            ids, mask, old = [], [], []
            delta = turn.prompt_ids
        ids += delta + turn.completion_ids
        mask += [0] * len(delta) + [int(turn.trained) * turn.weight] * len(turn.completion_ids)
        old += [0.0] * len(delta) + turn.logprobs
        if turn.weight_version is not None:
            version = turn.weight_version if version is None else min(version, turn.weight_version)
    flush()
    return samples


@dataclass(kw_only=True)
class BatchStats:
    groups: int = 0
    groups_skipped_equal: int = 0
    rollouts: int = 0
    rollouts_failed: int = 0
    rollouts_timeout: int = 0


def build_samples(
    groups: Sequence[Group], *, estimator: Estimator = "grpo"
) -> tuple[list[Sample], BatchStats]:
    """Advantages per group (failed rollouts masked out, all-equal groups skipped) → samples."""
    stats = BatchStats(groups=len(groups))
    samples: list[Sample] = []
    for g in groups:
        stats.rollouts += len(g.rollouts)
        stats.rollouts_failed += sum(r.status == "error" for r in g.rollouts)
        stats.rollouts_timeout += sum(r.status == "timeout" for r in g.rollouts)
        usable = g.usable
        adv = group_advantages([r.reward for r in usable], estimator=estimator)
        if adv is None:
            stats.groups_skipped_equal += 1
            continue
        for r, a in zip(usable, adv, strict=True):
            samples += samples_from_rollout(r, a)
    return samples, stats


# -- scheduling ----------------------------------------------------------------------

EpisodeFn = Callable[[Any, int, int], Awaitable[Rollout]]  # (task, group, index) -> Rollout


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    group_size: int = 4
    groups_per_step: int = 2
    mode: Literal["sync", "async"] = "async"
    max_inflight: int = 4  # groups running at once (async); >= groups_per_step
    extra_per_group: int = 0  # over-sampling inside a group; the slowest are cut off
    max_staleness: int = 1  # versions a turn may lag the trainer when it is consumed
    episode_timeout_s: float = 600.0


class RolloutScheduler:
    """Runs episodes and hands out complete groups, synchronously or asynchronously.

    ``episode(task, group, index)`` runs one rollout (locally or on a Ray actor);
    ``version()`` is the trainer's current weight version; ``tasks`` cycles forever.
    """

    def __init__(
        self,
        *,
        tasks: Iterator[Any],
        episode: EpisodeFn,
        version: Callable[[], int],
        config: SchedulerConfig,
        task_id: Callable[[Any], str] = lambda t: str(_get(t, "id", t)),
    ) -> None:
        if config.mode == "async" and config.max_inflight < config.groups_per_step:
            raise ValueError("max_inflight must be at least groups_per_step")
        self.tasks = tasks
        self.episode = episode
        self.version = version
        self.config = config
        self.task_id = task_id
        self._next_group = 0
        self._running: dict[int, asyncio.Task[Group]] = {}
        self._started_version: dict[int, int] = {}
        self._carry: list[Group] = []  # finished after a cut-off: consumed next step
        self.dropped_stale = 0

    async def _timed(self, task: Any, group: int, index: int) -> Rollout:
        t0 = time.perf_counter()
        try:
            r = await asyncio.wait_for(
                self.episode(task, group, index), self.config.episode_timeout_s
            )
        except TimeoutError:
            r = Rollout(task_id=self.task_id(task), group=group, index=index, status="timeout")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a crashed episode or a killed environment actor
            r = Rollout(
                task_id=self.task_id(task),
                group=group,
                index=index,
                status="error",
                error=f"{type(e).__name__}: {e}"[:500],
            )
        r.duration_s = r.duration_s or time.perf_counter() - t0
        return r

    async def _run_group(self, task: Any, group: int) -> Group:
        g = Group(task=task, task_id=self.task_id(task), group=group)
        n = self.config.group_size + max(0, self.config.extra_per_group)
        pending = {asyncio.ensure_future(self._timed(task, group, i)) for i in range(n)}
        try:
            while pending and len(g.rollouts) < self.config.group_size:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                g.rollouts += [d.result() for d in done]
        finally:
            for p in pending:  # the cut-off: stragglers beyond G are cancelled
                p.cancel()
            for p in pending:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await p
        g.rollouts = sorted(g.rollouts, key=lambda r: r.index)[: self.config.group_size]
        return g

    def _launch(self) -> None:
        task = next(self.tasks)
        gid = self._next_group
        self._next_group += 1
        self._started_version[gid] = self.version()
        self._running[gid] = asyncio.ensure_future(self._run_group(task, gid))

    def _stale(self, g: Group) -> bool:
        versions = [v for r in g.rollouts for v in r.versions]
        oldest = min(versions, default=self._started_version.get(g.group, self.version()))
        self._started_version.pop(g.group, None)
        return self.version() - oldest > self.config.max_staleness

    async def next_groups(self) -> list[Group]:
        """The next ``groups_per_step`` complete, fresh-enough groups."""
        want = self.config.groups_per_step
        if self.config.mode == "sync":
            for _ in range(want):
                self._launch()
            groups = list(await asyncio.gather(*self._running.values()))
            self._running.clear()
            self._started_version.clear()
            return groups
        out: list[Group] = []
        while True:
            while self._carry and len(out) < want:
                g = self._carry.pop(0)
                if self._stale(g):
                    self.dropped_stale += 1
                else:
                    out.append(g)
            if len(out) >= want:
                return out
            self._refill()
            done, _ = await asyncio.wait(
                list(self._running.values()), return_when=asyncio.FIRST_COMPLETED
            )
            for gid, t in list(self._running.items()):
                if t in done:
                    del self._running[gid]
                    self._carry.append(t.result())

    def _refill(self) -> None:
        """Start groups until ``max_inflight`` are running or waiting to be consumed."""
        while len(self._running) + len(self._carry) < self.config.max_inflight:
            self._launch()

    async def close(self) -> None:
        for t in self._running.values():
            t.cancel()
        for t in self._running.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._running.clear()
