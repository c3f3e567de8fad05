"""Trainer ranks as Ray actors (local Ray, a tiny model, gloo): two ranks take the step
one process takes; a rank that dies stops the step with one line, and the same run
resumes from its newest checkpoint."""

import json
import random

import pytest
from opencomposer.training.cluster import Cluster, ClusterError, tiny_model_folder
from opencomposer.training.config import parse_config
from opencomposer.training.rl import Run, run_loop, trainer_config
from opencomposer.training.rollouts import Rollout, Sample, Turn
from opencomposer.training.trainer import Trainer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny") / "model")


def config(strategy="ddp", **run):
    return parse_config(
        {
            "model": {"precision": "fp32"},
            "optim": {"lr": 1e-2, "micro_batch_size": 2},
            "rollout": {"group_size": 4, "groups_per_step": 2, "max_inflight": 2},
            "tasks": {"heldout": ""},
            "run": {"progress": False, "checkpoint_every": 1, **run},
            "cluster": {"trainer_ranks": 2, "trainer_cpus": 0.5, "strategy": strategy},
        }
    )


def samples(n=5, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randrange(6, 20)
        ids = [rng.randrange(1, 49152) for _ in range(k)]
        mask = [0] * 3 + [1] * (k - 3)
        out.append(
            Sample(
                input_ids=ids,
                mask=mask,
                old_logprobs=[0.0] * 3 + [-10.0] * (k - 3),
                advantage=1.0 if i % 2 else -1.0,
            )
        )
    return out


def cluster_for(cfg, folder):
    return Cluster(
        cfg, folder, make_model=None, to_rollout=None, trainer_config=trainer_config(cfg)
    )


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
async def test_two_ranks_take_the_one_process_step_and_stay_identical(tiny, tmp_path, strategy):
    """Guards the loss normalisation over shards (and the padding of the rank with
    fewer micro-batches): the averaged gradient is the full-batch gradient. The
    checkpoint of the ranks (gathered first under FSDP2) loads back to the same
    weights."""
    cfg = config(strategy)
    batch = samples()
    one = Trainer.from_pretrained(tiny, trainer_config(cfg))
    ref = one.step(batch)
    cluster = cluster_for(cfg, tiny)
    try:
        await cluster.start(roles=("trainer",))
        assert [r["backend"] for r in cluster.rank_nodes] == ["gloo", "gloo"]
        got = await cluster.trainer.step(batch)
        assert cluster.trainer.version == 1 == one.version
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-6)
        sums = await cluster.trainer.checksums()
        assert len(sums) == 2 and sums[0] == sums[1]
        cluster.trainer.save(tmp_path / "ck", extra={"step": 1})
        await cluster.trainer.step(samples(seed=1))
        assert (await cluster.trainer.checksums())[0] != sums[0]
        assert cluster.trainer.load(tmp_path / "ck") == {"step": 1}
        assert cluster.trainer.version == 1
        assert await cluster.trainer.checksums() == sums
    finally:
        await cluster.close()


class Receiver:
    weight_version = 0

    def reload_weights(self, weights, version):
        self.weight_version = version


def synthetic_run(cfg, cluster, out, kill_at=None):
    rng = random.Random(1)
    calls = {"n": 0}

    async def episode(task, scfg):
        calls["n"] += 1
        if kill_at is not None and calls["n"] == kill_at:
            import ray

            ray.kill(cluster.ranks[1], no_restart=True)
        k = rng.randrange(3, 8)
        return Rollout(
            task_id=task,
            reward=float(rng.random() < 0.5),
            turns=[
                Turn(
                    prompt_ids=[1, 2, 3],
                    completion_ids=[rng.randrange(1, 49152) for _ in range(k)],
                    logprobs=[-10.0] * k,
                    weight_version=cluster.trainer.version,
                )
            ],
        )

    return Run(
        config=cfg,
        out=out,
        trainer=cluster.trainer,
        sampler=Receiver(),
        episode=episode,
        tasks=["t1", "t2", "t3"],
    )


async def test_a_dead_rank_stops_the_step_in_one_line_and_the_run_resumes(tiny, tmp_path):
    cfg = config(steps=3)
    cluster = cluster_for(cfg, tiny)
    try:
        await cluster.start(roles=("trainer",))
        # steps 1 and 2 run and checkpoint; rank 1 dies while step 3's rollouts run
        run = synthetic_run(cfg, cluster, tmp_path, kill_at=2 * 8 + 1)
        with pytest.raises(ClusterError) as err:
            await run_loop(run)
        msg = str(err.value)
        assert "\n" not in msg and "trainer rank 1 died during step 3" in msg
        assert "resume" in msg
    finally:
        await cluster.close()
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    cluster = cluster_for(cfg, tiny)
    try:
        await cluster.start(roles=("trainer",))
        await run_loop(synthetic_run(cfg, cluster, tmp_path))
        assert cluster.trainer.version >= 2  # restored from checkpoints/step_2, then on
        sums = await cluster.trainer.checksums()
        assert sums[0] == sums[1]
    finally:
        await cluster.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
