"""The RL loop across a real two-node Ray cluster on this machine.

`ray start --head` plus `ray start --address` (its own CPUs and a custom resource
label), then `opencomposer train` with a `[cluster]` section: two vLLM sampler
replicas (one per node), two trainer ranks over gloo (on the labelled head), an
episode worker on each node, three RL steps of a tiny model on a one-task suite. A
third node joins while the run goes on. Asserts where each role ran, that both
replicas serve the trainer's weight version after each sync, and that the ranks'
weights are identical. Slow: the two engines start in about a minute or more on 2
shared cores."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opencomposer.training.cluster import tiny_model_folder
from opencomposer.training.cluster_local import LocalRayCluster
from opencomposer.training.tasks import write_task

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# a coin flip: groups get mixed rewards, so steps train and weights move (the test is
# about where things run and which weights they serve, not about learning)
VERIFY = 'python -c "import random, sys; sys.exit(random.random() < 0.5)"'


def write_suite(root: Path, n: int = 1) -> Path:
    repo = root / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    (repo / "README.md").write_text("A tiny workspace.\n")
    for i in range(n):
        write_task(root / "suite" / f"say{i}", query="Say anything.", verify=VERIFY, repo_dir=repo)
    return root / "suite"


def write_config(path: Path, *, model: Path, suite: Path, address: str, out: Path) -> None:
    path.write_text(
        f"""
[model]
path = "{model}"
sampler = "vllm"
kv_cache_gib = 0.25
precision = "fp32"

[tasks]
suite = "{suite}"
heldout = ""
eval_every = 0

[rollout]
group_size = 4
groups_per_step = 2
mode = "async"            # rollouts keep running through the step and the weight sync
max_inflight = 3
num_workers = 1
max_turns = 1
max_tokens = 24
max_completion_tokens = 48
episode_timeout_s = 300
prompt_style = "compact"

[optim]
lr = 1e-3
micro_batch_size = 4

[run]
steps = 3
checkpoint_every = 0
progress = false
out = "{out}"

[cluster]
address = "{address}"
samplers = 2
sampler_cpus = 1
sampler_placement = "strict_spread"
trainer_ranks = 2
trainer_cpus = 1
trainer_resource = "head"
trainer_placement = "strict_pack"
env_workers_per_node = 1
"""
    )


def run_bench_on(address: str, root: Path, env: dict) -> dict:
    """`opencomposer bench --cluster ADDRESS` with a scripted model on six tasks."""
    suite = write_suite(root / "bench", n=6)
    script = root / "turns.json"
    script.write_text(json.dumps({"turns": ["Done."], "chars_per_second": 0}))
    out = root / "bench-out"
    cmd = [sys.executable, "-m", "opencomposer.server.cli", "bench", "--tasks", str(suite)]
    cmd += ["--model", f"scripted:{script}", "--cluster", address, "--out", str(out)]
    cmd += ["--concurrency", "6"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def test_two_node_cluster_runs_three_rl_steps(tmp_path):
    model = tiny_model_folder(tmp_path / "model")
    suite = write_suite(tmp_path)
    out = tmp_path / "run"
    with LocalRayCluster() as ray_nodes:
        ray_nodes.add_node(num_cpus=3, resources={"head": 1}, head=True)
        ray_nodes.add_node(num_cpus=2, resources={"node_b": 1})
        cfg = tmp_path / "cluster.toml"
        write_config(cfg, model=model, suite=suite, address=ray_nodes.address, out=out)
        cmd = [sys.executable, "-m", "opencomposer.server.cli", "train", "--config", str(cfg)]
        log = (tmp_path / "train.log").open("w")
        proc = subprocess.Popen(cmd, env=ray_nodes.env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 900
            while not (out / "config.json").exists():  # the roles are placed and started
                assert proc.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the roles did not start"
                time.sleep(1)
            ray_nodes.add_node(num_cpus=1, resources={"node_c": 1})  # joins mid-run
            rc = proc.wait(timeout=max(1, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        assert rc == 0, (tmp_path / "train.log").read_text()[-3000:]
        bench = run_bench_on(ray_nodes.address, tmp_path, ray_nodes.env)
    # bench --cluster spread its episodes over the nodes' workers
    assert len(bench["tasks"]) == 6 and bench["nodes"] >= 2, bench

    report = json.loads((out / "cluster.json").read_text())
    label = {
        n["node"]: next(k for k in ("head", "node_b", "node_c") if k in n["resources"])
        for n in report["nodes"]
        if n["alive"]
    }
    place = report["placement"]
    # each role ran where its placement group put it
    for role in ("sampler", "trainer", "env"):
        for actor in place[role]:
            assert actor["node"] == actor["placed"], (role, actor)
    assert sorted(label[a["node"]] for a in place["sampler"]) == ["head", "node_b"]
    assert [label[a["node"]] for a in place["trainer"]] == ["head", "head"]
    assert [a["backend"] for a in place["trainer"]] == ["gloo", "gloo"]
    assert {label[a["node"]] for a in place["env"]} == {"head", "node_b", "node_c"}
    # rollouts were balanced over both replicas, and ran on both first nodes' workers
    assert all(a["turns"] > 0 for a in place["sampler"])
    ran = {label[a["node"]] for a in place["env"] if a["episodes"] > 0}
    assert {"head", "node_b"} <= ran
    # one weight version everywhere; the ranks' weights are identical
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert report["trainer_version"] >= 1
    assert report["replica_versions"] == [report["trainer_version"]] * 2
    sums = report["trainer_checksums"]
    assert len(sums) == 2 and sums[0] == sums[1]
    assert list(out.glob("traces-*.db"))  # each worker's episodes, traced on its node
    synced = [m for m in lines if "sync_bytes" in m]
    # a delta may be empty: a step whose update rounds to no bf16 change sends nothing
    assert synced and all(0 <= m["sync_bytes"] <= m["sync_full_bytes"] for m in synced)
    assert [m["weight_version"] for m in lines] == sorted(m["weight_version"] for m in lines)
