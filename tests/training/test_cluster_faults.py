"""Faults on a cluster (local Ray, the tiny model on the `hf` engine, real episodes in
the sandbox): a dead sampler replica or environment worker is replaced, the replica
loaded with the last synced weights, and the episodes that hit them run again, so the
step's groups come out whole and on one weight version."""

import functools

import pytest
from opencomposer.training.cluster import Cluster, tiny_model_folder
from opencomposer.training.config import parse_config
from opencomposer.training.rl import make_sampler, rollout_from_episode, trainer_config
from opencomposer.training.rollouts import RolloutScheduler, SchedulerConfig, build_samples
from opencomposer.training.sessions import session_config
from opencomposer.training.tasks import load_task, write_task

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

VERIFY = "python -c \"import sys; sys.exit(len(open('.opencomposer/answer.txt').read()) % 2)\""


@pytest.fixture
def task(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text("A tiny workspace.\n")
    return load_task(
        write_task(tmp_path / "say", query="Say anything.", verify=VERIFY, repo_dir=repo)
    )


async def test_dead_replica_and_worker_are_replaced_and_episodes_rerun(tmp_path, task):
    import ray

    model = tiny_model_folder(tmp_path / "model")
    cfg = parse_config(
        {
            "model": {"path": str(model), "sampler": "hf", "precision": "fp32"},
            "optim": {"lr": 1e-3, "micro_batch_size": 4},
            "rollout": {
                "group_size": 3,
                "groups_per_step": 2,
                "mode": "sync",
                "max_turns": 1,
                "max_tokens": 8,
                "num_workers": 1,
                "prompt_style": "compact",
            },
            "tasks": {"heldout": ""},
            "cluster": {
                "samplers": 2,
                "sampler_cpus": 0.25,
                "trainer_ranks": 1,
                "trainer_cpus": 0.25,
                "env_workers_per_node": 2,
            },
        }
    )
    cluster = Cluster(
        cfg,
        model,
        make_model=functools.partial(make_sampler, cfg, model),
        to_rollout=rollout_from_episode,
        trainer_config=trainer_config(cfg),
    )
    scfg = session_config(cfg, prompt_style="compact")

    async def episode(t, group, index):
        r = await cluster.episode(t, scfg)
        r.group, r.index = group, index
        return r

    def scheduler():
        return RolloutScheduler(
            tasks=iter([task] * 100),
            episode=episode,
            version=lambda: cluster.trainer.version,
            config=SchedulerConfig(group_size=3, groups_per_step=2, mode="sync"),
        )

    try:
        await cluster.start()
        groups = await scheduler().next_groups()
        samples, _ = build_samples(groups)
        # mixed rewards are likely but not certain with 3 rollouts a group: train on what came
        if samples:
            await cluster.trainer.step(samples)
        version = cluster.trainer.version
        await cluster.broadcast(version)
        assert cluster.replica_versions == [version, version]

        ray.kill(cluster.replicas[0].handle, no_restart=True)
        ray.kill(cluster.workers[0].handle, no_restart=True)
        groups = await scheduler().next_groups()
        rollouts = [r for g in groups for r in g.rollouts]
        assert len(rollouts) == 6
        assert all(r.status == "ok" and r.turns for r in rollouts), [r.error for r in rollouts]
        assert {t.weight_version for r in rollouts for t in r.turns} == {version}
        counts = cluster.fault_counts()
        assert counts["replicas_replaced"] == 1 and counts["workers_replaced"] == 1
        assert counts["episodes_retried"] >= 2
        assert max(r.stats["attempts"] for r in rollouts) >= 2
        assert cluster.replica_versions == [version, version]  # the new replica too
        infos = await cluster.placement()
        assert all(i["version"] == version for i in infos["sampler"])
    finally:
        await cluster.close()
