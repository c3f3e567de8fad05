"""The rollout scheduler: sync baseline, async cut-offs, over-sampling, time limits,
crashes and staleness; and how failed rollouts and all-equal groups reach the loss."""

import asyncio
import itertools

import pytest
from opencomposer.training.rollouts import (
    Group,
    Rollout,
    RolloutScheduler,
    SchedulerConfig,
    Turn,
    build_samples,
)


def turn(version=0):
    return Turn(prompt_ids=[1, 2], completion_ids=[3], logprobs=[-1.0], weight_version=version)


def make_episode(delays, rewards=None, fail=(), version=lambda: 0):
    """An episode that sleeps delays[(group, index)] (default 0.01 s)."""
    started = []

    async def episode(task, group, index):
        started.append((group, index))
        if (group, index) in fail:
            raise RuntimeError("environment actor died")
        await asyncio.sleep(delays.get((group, index), 0.01))
        reward = (rewards or {}).get((group, index), float(index % 2))
        return Rollout(
            task_id=task, group=group, index=index, reward=reward, turns=[turn(version())]
        )

    episode.started = started
    return episode


def scheduler(episode, **kw):
    version = kw.pop("version", lambda: 0)
    return RolloutScheduler(
        tasks=itertools.cycle(["a", "b"]),
        episode=episode,
        version=version,
        config=SchedulerConfig(**kw),
    )


async def test_sync_mode_waits_for_every_group():
    s = scheduler(make_episode({(0, 1): 0.2}), mode="sync", group_size=2, groups_per_step=2)
    groups = await s.next_groups()
    assert [g.group for g in groups] == [0, 1]
    assert all(len(g.rollouts) == 2 for g in groups)


async def test_async_cut_off_takes_the_first_groups_and_keeps_the_rest_running():
    ep = make_episode({(0, 0): 0.5, (0, 1): 0.5})  # group 0 is a straggler
    s = scheduler(ep, mode="async", group_size=2, groups_per_step=2, max_inflight=4)
    first = await s.next_groups()
    assert 0 not in [g.group for g in first]
    second = await s.next_groups()
    await s.close()
    assert len(second) == 2 and len({g.group for g in first + second}) == 4


async def test_over_sampling_cancels_the_slowest_rollouts_of_a_group():
    ep = make_episode({(0, 2): 5.0})
    s = scheduler(ep, mode="sync", group_size=2, groups_per_step=1, extra_per_group=1)
    (g,) = await asyncio.wait_for(s.next_groups(), 2.0)
    assert sorted(r.index for r in g.rollouts) == [0, 1]


async def test_time_limit_and_crash_are_kept_as_failed_rollouts():
    ep = make_episode({(0, 0): 5.0}, fail={(0, 1)})
    s = scheduler(ep, mode="sync", group_size=3, groups_per_step=1, episode_timeout_s=0.2)
    (g,) = await s.next_groups()
    status = {r.index: r.status for r in g.rollouts}
    assert status == {0: "timeout", 1: "error", 2: "ok"}
    assert "environment actor died" in g.rollouts[1].error


async def test_stale_groups_are_dropped():
    current = {"v": 0}
    ep = make_episode({}, version=lambda: 0)
    s = scheduler(
        ep,
        mode="async",
        group_size=2,
        groups_per_step=1,
        max_inflight=2,
        max_staleness=1,
        version=lambda: current["v"],
    )
    await s.next_groups()
    current["v"] = 5  # the trainer moved far ahead of the in-flight rollouts
    ep_new = make_episode({}, version=lambda: 5)
    s.episode = ep_new
    g = await s.next_groups()
    await s.close()
    assert s.dropped_stale >= 1
    assert all(min(r.versions) == 5 for gg in g for r in gg.rollouts)


def test_async_config_needs_enough_groups_in_flight():
    with pytest.raises(ValueError, match="max_inflight"):
        scheduler(make_episode({}), mode="async", groups_per_step=4, max_inflight=2)


def test_failed_rollouts_are_masked_and_equal_groups_skipped():
    ok = lambda i, r: Rollout(task_id="t", index=i, reward=r, turns=[turn()])  # noqa: E731
    g1 = Group(
        task="t",
        task_id="t",
        group=0,
        rollouts=[ok(0, 1.0), ok(1, 0.0), Rollout(task_id="t", index=2, status="timeout")],
    )
    g2 = Group(task="t", task_id="t", group=1, rollouts=[ok(0, 1.0), ok(1, 1.0)])
    samples, stats = build_samples([g1, g2], estimator="dr_grpo")
    assert [s.advantage for s in samples] == [0.5, -0.5]  # the timeout is not in the baseline
    assert stats.rollouts_timeout == 1 and stats.groups_skipped_equal == 1 and stats.rollouts == 5
