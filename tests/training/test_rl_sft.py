"""`train --sft`: accepted traces become token-exact samples; SFT steps lower the loss."""

import pytest
from opencomposer.agent.protocols import TurnOutput
from opencomposer.agent.traces import TraceStore
from opencomposer.training.rollouts import Rollout, Turn
from opencomposer.training.sft import samples_from_rollouts, samples_from_traces
from opencomposer.training.trainer import Trainer, TrainerConfig, tiny_llama


def write_session(store, sid, ws, *, decision, ids=True, status="completed"):
    store.start_session(sid, workspace=ws, model="m", sampling={}, query="fix it")
    out = TurnOutput(
        text="ok",
        prompt_token_ids=[1, 2, 3] if ids else None,
        completion_token_ids=[4, 5] if ids else None,
        completion_logprobs=[-0.1, -0.2] if ids else None,
    )
    store.write_turn(
        sid, 0, messages=[{"role": "user", "content": "fix it"}], output=out, t_start=0, t_end=1
    )
    store.write_edit(sid, 0, turn=0, call_id="c", path="a.py", before="x", after="y", diff="-x\n+y")
    store.end_session(sid, status=status, answer="done", turns=1, tool_calls=1)
    if decision:
        store.record_decision(sid, "a.py", decision)


def test_only_accepted_traces_with_token_ids_are_used(tmp_path):
    store = TraceStore(tmp_path / "traces.db")
    write_session(store, "good", tmp_path, decision="accept")
    write_session(store, "rejected", tmp_path, decision="reject")
    write_session(store, "undecided", tmp_path, decision=None)
    write_session(store, "noids", tmp_path, decision="accept", ids=False)
    write_session(store, "errored", tmp_path, decision="accept", status="error")
    data = samples_from_traces([store.export(s["session_id"]) for s in store.list_sessions()])
    store.close()
    assert data.sessions_used == 1 and data.sessions_skipped == 1
    (s,) = data.samples
    assert s.input_ids == [1, 2, 3, 4, 5] and s.mask == [0, 0, 0, 1, 1] and s.advantage == 1.0


def test_rejection_sampling_keeps_good_rollouts():
    t = [Turn(prompt_ids=[1], completion_ids=[2], logprobs=[-1.0])]
    rs = [
        Rollout(task_id="a", reward=1.0, turns=t),
        Rollout(task_id="b", reward=0.1, turns=t),
        Rollout(task_id="c", reward=1.0, turns=t, status="timeout"),
    ]
    data = samples_from_rollouts(rs, min_reward=0.5)
    assert data.sessions_used == 1 and data.sessions_skipped == 2 and len(data.samples) == 1


def test_sft_steps_lower_the_loss():
    tr = Trainer(tiny_llama(), TrainerConfig(lr=1e-2, precision="fp32"))
    t = [Turn(prompt_ids=[1, 2, 3], completion_ids=[7, 8, 9, 10], logprobs=[0.0] * 4)]
    data = samples_from_rollouts([Rollout(task_id="a", reward=1.0, turns=t)], min_reward=1.0)
    before = tr.nll(data.samples)  # the same loss, measured without a step
    losses = [tr.sft_step(data.samples)["loss"] for _ in range(10)]
    assert losses[-1] < losses[0] * 0.7 and tr.version == 10
    assert before == pytest.approx(losses[0], rel=1e-5)


def test_sft_on_traces_starts_no_environment(tmp_path, monkeypatch):
    """`train --sft` on accepted traces runs no episode, so it starts neither Ray nor
    the environment actors (~0.8 GB and part of a core on a 2-core machine)."""
    import json

    from opencomposer.training import env
    from opencomposer.training.cluster import tiny_model_folder
    from opencomposer.training.rl import train
    from opencomposer.training.tasks import write_task

    def no_env(*a, **kw):
        raise AssertionError("the environment server was started")

    monkeypatch.setattr(env, "EnvironmentServer", no_env)
    model = tiny_model_folder(tmp_path / "model")
    store = TraceStore(tmp_path / "traces.db")
    for i in range(2):
        write_session(store, f"s{i}", tmp_path, decision="accept")
    store.close()
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text("hello\n")
    write_task(tmp_path / "suite" / "t", query="Say hello.", verify="true", repo_dir=repo)
    cfg = tmp_path / "sft.toml"
    cfg.write_text(
        f'[model]\npath = "{model}"\nprecision = "fp32"\n'
        f'[tasks]\nsuite = "{tmp_path / "suite"}"\nheldout = ""\n'
        f'[sft]\nsource = "traces"\ntraces_db = "{tmp_path / "traces.db"}"\n'
        "micro_batch_size = 1\nepochs = 1\n[run]\nprogress = false\n"
    )
    out = train(cfg, out=tmp_path / "run", sft=True)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (out / "checkpoints" / "step_2" / "config.json").is_file()
