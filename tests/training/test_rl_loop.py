"""The training loop end to end on a tiny random Llama with synthetic episodes:
metrics lines, versions that move, checkpoints, resume, bad task sets."""

import json
import random

import pytest
import torch
from opencomposer.training.config import ConfigError, parse_config
from opencomposer.training.rl import Run, rollout_from_episode, run_loop, task_cycle
from opencomposer.training.rollouts import Rollout, Turn
from opencomposer.training.trainer import Trainer, TrainerConfig, tiny_llama
from opencomposer.training.weight_sync import ModuleReceiver, VersionedModel


class NullModel:
    name, context_window = "null", 1024

    async def close(self):
        pass


def make_run(tmp_path, *, steps=3, crash_every=0, keep=3):
    cfg = parse_config(
        {
            "rollout": {"group_size": 4, "groups_per_step": 2, "mode": "async", "max_inflight": 3},
            "optim": {"lr": 1e-2, "micro_batch_size": 4},
            "run": {
                "steps": steps,
                "checkpoint_every": 2,
                "keep_checkpoints": keep,
                "progress": False,
            },
            "tasks": {"eval_every": 2, "eval_samples": 1},
        }
    )
    trainer = Trainer(tiny_llama(), TrainerConfig(lr=1e-2, precision="fp32"))
    sampler = VersionedModel(NullModel(), ModuleReceiver(tiny_llama(seed=3)))
    rng = random.Random(0)
    calls = {"n": 0}

    async def episode(task, scfg):
        calls["n"] += 1
        if crash_every and calls["n"] % crash_every == 0:
            raise RuntimeError("boom")
        ids = [rng.randrange(1, 60) for _ in range(4)]
        return Rollout(
            task_id=task,
            reward=float(ids[0] % 2),
            resolved=bool(ids[0] % 2),
            turns=[
                Turn(
                    prompt_ids=[1, 2, 3],
                    completion_ids=ids,
                    logprobs=[-4.0] * 4,
                    weight_version=sampler.weight_version,
                )
            ],
            stats={"tool_calls": 2.0, "parallel_calls_per_turn": 2.0},
        )

    return Run(
        config=cfg,
        out=tmp_path,
        trainer=trainer,
        sampler=sampler,
        episode=episode,
        tasks=["t1", "t2", "t3"],
        heldout=["h1"],
    )


def lines(tmp_path):
    return [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]


async def test_loop_writes_metrics_moves_versions_and_checkpoints(tmp_path):
    run = make_run(tmp_path)
    before = {k: v.clone() for k, v in run.trainer.model.state_dict().items()}
    await run_loop(run)
    rows = lines(tmp_path)
    assert rows[0]["step"] == 0 and "heldout_reward" in rows[0]  # the baseline evaluation
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["weight_version"] for r in steps] == [1, 2, 3]
    for key in (
        "reward_mean",
        "resolve_rate",
        "entropy",
        "grad_norm",
        "kl_old",
        "rollout_s",
        "train_s",
        "sync_s",
        "tool_calls",
        "parallel_calls_per_turn",
        "completion_tokens",
    ):
        assert key in steps[-1], key
    assert "heldout_reward" in steps[1] and "heldout_reward" in steps[2]
    assert run.sampler.weight_version == 3  # the sampler got every version
    after = run.trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    sampler_w = run.sampler.receiver.module.state_dict()
    # an fp32 sampler gets the fp32 weights, not a bf16 rounding of them
    assert all(torch.equal(sampler_w[k], after[k]) for k in sampler_w)
    assert (tmp_path / "checkpoints" / "step_2").is_dir() and (
        tmp_path / "checkpoints" / "step_3"
    ).is_dir()
    assert (tmp_path / "reward.png").stat().st_size > 0
    assert (tmp_path / "learning.png").read_bytes()[:4] == b"\x89PNG"


async def test_stopped_run_resumes_from_its_checkpoint(tmp_path):
    await run_loop(make_run(tmp_path, steps=2))
    run = make_run(tmp_path, steps=4)
    await run_loop(run)
    steps = [r["step"] for r in lines(tmp_path)]
    assert steps == [0, 1, 2, 3, 4]  # nothing redone, nothing skipped
    assert run.trainer.version == 4 and run.sampler.weight_version == 4


async def test_old_checkpoints_are_pruned_and_the_newest_resumes(tmp_path):
    await run_loop(make_run(tmp_path, steps=6, keep=2))
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step_4", "step_6"]  # step_2 deleted: ~1.6 GB each for the 135M model
    run = make_run(tmp_path, steps=7, keep=2)
    await run_loop(run)
    assert run.trainer.version == 7
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_6", "step_7"]
    with pytest.raises(ConfigError, match="keep_checkpoints must be >= 0"):
        parse_config({"run": {"keep_checkpoints": -1}})


async def test_crashing_rollouts_are_counted_and_training_goes_on(tmp_path):
    run = make_run(tmp_path, steps=2, crash_every=3)
    await run_loop(run)
    steps = [r for r in lines(tmp_path) if r["step"] > 0]
    assert sum(r["rollouts_failed"] for r in steps) >= 2
    assert steps[-1]["weight_version"] == 2


def test_empty_or_malformed_task_sets_are_one_clear_error():
    with pytest.raises(ConfigError, match="empty"):
        next(task_cycle([], seed=0))
    with pytest.raises(ConfigError, match="unknown key rollout.grup_size"):
        parse_config({"rollout": {"grup_size": 4}})


def test_episode_results_map_to_rollouts():
    class Out:
        prompt_token_ids, completion_token_ids, completion_logprobs, weight_version = (
            [1],
            [2, 3],
            [-0.1, -0.2],
            4,
        )

    class Rec:
        output = Out()

    class Res:
        task_id, status, reward, resolved, error = "t", "completed", 1.0, True, None
        turns = [Rec()]
        metrics = {"tool_calls": 3, "reads_before_first_edit": 2, "wall_s": 1.5}

    r = rollout_from_episode(Res(), group=2, index=1)
    assert r.status == "ok" and r.turns[0].completion_ids == [2, 3] and r.versions == [4]
    assert r.stats["tool_calls"] == 3 and r.stats["reads_before_edit"] == 2 and r.duration_s == 1.5
    Res.status = "timeout"
    assert rollout_from_episode(Res()).status == "timeout"
    Res.status = "env_error"
    assert rollout_from_episode(Res()).status == "error"
    from opencomposer.agent.protocols import TurnOutput

    Res.status, Rec.output = "completed", TurnOutput(text="no token ids")
    assert rollout_from_episode(Res()).status == "error"


async def test_rejection_sampling_warm_start_runs_before_rl_and_is_not_redone(tmp_path):
    run = make_run(tmp_path, steps=1)
    run.config = parse_config(
        {
            "rollout": {"group_size": 2, "groups_per_step": 1, "max_inflight": 1},
            "run": {"steps": 1, "checkpoint_every": 1, "progress": False},
            "tasks": {"eval_every": 1, "eval_samples": 1},
            "sft": {
                "source": "rejection",
                "warmup_rounds": 1,
                "min_reward": 1.0,
                "samples_per_task": 2,
                "epochs": 1,
            },
        }
    )
    await run_loop(run)
    rows = lines(tmp_path)
    assert [r.get("phase") for r in rows[:2]] == ["baseline", "warmup1"]
    assert rows[1]["sft_examples"] > 0 and rows[1]["weight_version"] > 0
    assert (tmp_path / "checkpoints" / "step_0").is_dir()
    run2 = make_run(tmp_path, steps=2)
    run2.config = run.config
    await run_loop(run2, max_steps=2)
    phases = [r.get("phase") for r in lines(tmp_path)]
    assert phases.count("warmup1") == 1 and phases.count("baseline") == 1


def accepted_trace_db(db):
    """A trace store with one accepted session and one rejected one."""
    from opencomposer.agent.protocols import TurnOutput
    from opencomposer.agent.traces import TraceStore

    store = TraceStore(db)
    for sid, decision in (("good", "accept"), ("bad", "reject")):
        store.start_session(sid, workspace=db.parent, model="m", sampling={}, query="q")
        out = TurnOutput(
            text="x",
            prompt_token_ids=[1, 2],
            completion_token_ids=[5, 6, 7],
            completion_logprobs=[0.0] * 3,
        )
        store.write_turn(sid, 1, messages=[], output=out, t_start=0, t_end=1)
        store.write_edit(sid, 1, turn=1, call_id="c", path="a", before="", after="", diff="")
        store.end_session(sid, status="completed", answer="", turns=1, tool_calls=1)
        store.record_decision(sid, "*", decision)
    store.close()
    return db


async def test_trace_warm_start_trains_on_accepted_traces_before_rl(tmp_path):
    db = accepted_trace_db(tmp_path / "traces.db")
    run = make_run(tmp_path / "run", steps=1)
    run.config = parse_config(
        {
            "rollout": {"group_size": 2, "groups_per_step": 1, "max_inflight": 1},
            "run": {"steps": 1, "checkpoint_every": 1, "progress": False},
            "tasks": {"eval_every": 1, "eval_samples": 1},
            "sft": {"source": "traces", "traces_db": str(db), "warmup_rounds": 1, "epochs": 3},
        }
    )
    await run_loop(run)
    rows = lines(tmp_path / "run")
    assert [r.get("phase") for r in rows[:2]] == ["baseline", "warmup1"]
    warm = rows[1]
    assert warm["sft_examples"] == 1 and warm["sft_sessions"] == 1 and warm["sft_steps"] == 3
    assert warm["weight_version"] == 3 and run.sampler.weight_version >= 3
    assert "heldout_reward" in warm and warm["time"] >= rows[0]["time"]
    assert rows[2]["step"] == 1


async def test_an_interrupted_warm_start_resumes_mid_round(tmp_path):
    """A warm start killed between SFT steps resumes from its `sft_resume` checkpoint:
    the rerun takes the remaining steps only and reaches the weights of a run that was
    never interrupted."""
    db = accepted_trace_db(tmp_path / "traces.db")
    cfg = parse_config(
        {
            "rollout": {"group_size": 2, "groups_per_step": 1, "max_inflight": 1},
            "run": {"steps": 0, "progress": False},
            "sft": {
                "source": "traces",
                "traces_db": str(db),
                "warmup_rounds": 1,
                "epochs": 4,
                "lr": 1e-2,
                "checkpoint_every": 1,
            },
        }
    )

    def warm(out, *, die_at=0):
        run = make_run(out, steps=0)
        run.config, run.heldout = cfg, []
        step, calls = run.trainer.sft_step, {"n": 0}

        def sft_step(batch, **kw):
            calls["n"] += 1
            if calls["n"] == die_at:
                raise KeyboardInterrupt
            return step(batch, **kw)

        run.trainer.sft_step = sft_step
        return run, calls

    whole, _ = warm(tmp_path / "whole")
    await run_loop(whole)
    cut, _ = warm(tmp_path / "cut", die_at=3)
    with pytest.raises(KeyboardInterrupt):
        await run_loop(cut)
    assert not (tmp_path / "cut" / "checkpoints" / "step_0").exists()
    again, calls = warm(tmp_path / "cut")
    await run_loop(again)
    assert calls["n"] == 2  # steps 3 and 4
    assert lines(tmp_path / "cut")[-1]["sft_steps"] == 2
    for name, t in whole.trainer.model.state_dict().items():
        assert torch.allclose(again.trainer.model.state_dict()[name], t, atol=1e-6), name
    assert (tmp_path / "cut" / "checkpoints" / "step_0").is_dir()
    assert not (tmp_path / "cut" / "checkpoints" / "sft_resume").exists()


async def test_trace_warm_start_without_accepted_traces_is_one_clear_error(tmp_path):
    run = make_run(tmp_path, steps=1)
    run.config = parse_config(
        {
            "run": {"steps": 1, "progress": False},
            "sft": {
                "source": "traces",
                "traces_db": str(tmp_path / "empty.db"),
                "warmup_rounds": 1,
            },
        }
    )
    with pytest.raises(ConfigError, match="no accepted traces"):
        await run_loop(run)


async def test_sft_init_starts_rl_from_an_earlier_stage(tmp_path):
    """`[sft] init` on a fresh RL run: the trainer and the sampler start from that
    checkpoint's weights (an SFT stage's), not the base model."""
    import dataclasses

    first = make_run(tmp_path / "sft", steps=2)
    await run_loop(first)
    init = tmp_path / "sft" / "checkpoints" / "step_2"
    run = make_run(tmp_path / "rl", steps=1)
    run.config = dataclasses.replace(
        run.config, sft=dataclasses.replace(run.config.sft, init=str(init))
    )
    await run_loop(run)
    assert run.trainer.version == 3 and run.sampler.weight_version == 3  # 2 loaded + 1 step
    assert [r["step"] for r in lines(tmp_path / "rl")] == [0, 1]
