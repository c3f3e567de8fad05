"""The real loop, slow: SmolLM2-135M on vLLM in-process, the environment server on Ray,
the trainer on this CPU. Tasks whose verify passes at random give every group reward
variance, so steps really train; the test checks that weights, versions and metrics
move, that the sampler's logprobs agree with the trainer's, and that a stopped run
resumes from its checkpoint.

    .venv/bin/python -m pytest tests/training/test_rl_slow.py -m slow -q
"""

import json

import pytest
import torch
from opencomposer.training.tasks import write_task
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

CONFIG = """
[tasks]
suite = "{suite}"
heldout = ""
[rollout]
group_size = 4
groups_per_step = 2
max_inflight = 2
max_turns = 1
max_tokens = 48
max_completion_tokens = 48
num_workers = 1
[optim]
lr = 1e-4
micro_batch_size = 2
gradient_checkpointing = true
[run]
steps = 2
checkpoint_every = 1
progress = false
"""


def test_train_moves_weights_versions_metrics_and_resumes(tmp_path):
    from opencomposer.agent.backends.smollm2 import smollm2_path
    from opencomposer.training.rl import train

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text("hello\n")
    for i in range(2):
        write_task(
            tmp_path / "suite" / f"coin-{i}",
            query="Say hello.",
            verify="test $((RANDOM % 2)) -eq 0",
            repo_dir=repo,
            timeout_s=300,
        )
    cfg = tmp_path / "rl.toml"
    cfg.write_text(CONFIG.format(suite=tmp_path / "suite"))
    out = train(cfg, out=tmp_path / "run")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    trained = [r for r in rows if not r["step_skipped"]]
    assert trained, rows
    assert rows[-1]["weight_version"] == len(trained)
    for r in trained:
        assert r["completion_tokens"] > 0 and r["grad_norm"] > 0 and r["sync_s"] > 0
        assert r["kl_old"] < 0.5  # a misaligned token or logprob would be far above
    # the first trained step's rollouts were all sampled by the weights it trains, so
    # there the trainer must reproduce the sampler's logprobs (later steps may train on
    # turns one version old, after a 1e-4 step: a real policy change, not a mismatch)
    assert trained[0]["kl_old"] < 0.05
    base = load_file(str(smollm2_path() / "model.safetensors"))
    new = load_file(str(out / "checkpoints" / "step_2" / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(base[key].float(), new[key].float())
    assert (out / "reward.png").exists() and (out / "time.png").exists()
    from opencomposer.agent.traces import TraceStore

    store = TraceStore(out / "traces.db")  # every episode is a trace, like a user's session
    sessions = [store.get(s["session_id"]) or {} for s in store.list_sessions(limit=1000)]
    store.close()
    assert len(sessions) >= 2 * 2 * 4  # steps x groups x group size
    assert all(s["meta"].get("task_id", "").startswith("coin-") for s in sessions)

    out = train(cfg, out=tmp_path / "run", max_steps=3)  # resume
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
