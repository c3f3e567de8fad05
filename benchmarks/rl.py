"""RL loop benchmark: asynchronous rollouts vs naive synchronous batching, and weight sync.

Part 1 — stragglers. A task suite whose episodes sleep for log-normally
distributed times (each task's ``delay.txt``; the agent's one command is
``sleep $(cat delay.txt)``, run through the real environment server, Session,
tool code and bubblewrap sandbox; the model is the ``scripted:`` double). The
same ``RolloutScheduler`` and the same task order run twice:

- ``sync``: launch B groups of G, wait for all of them, "train", repeat;
- ``async``: keep ``max_inflight`` groups running, take the first B that finish
  (bounded staleness, default 2), and keep rolling out while the trainer trains.

The trainer is simulated by a fixed ``--train-s`` pause in a thread (both modes
pay it); throughput is rollouts consumed per second of wall time. Target: >= 2x.

Part 2 — weight sync. The embedded SmolLM2-135M in a running vLLM engine; the
trainer's weights pushed ``--sync-reps`` times (``WeightSync.push``: bf16 cast,
staging, ``collective_rpc`` reload). Target: < 2 s. Skip with ``--skip-sync``.

Part 3 — time split per step of a real run, from its ``metrics.jsonl``
(``--metrics FILE``).

    .venv/bin/python benchmarks/rl.py [--steps 6] [--tasks 16] [--sigma 1.2] [--skip-sync] [--metrics FILE]
    .venv/bin/python benchmarks/rl.py --metrics-only --metrics RUN/metrics.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = {
    "turns": [
        "Waiting for the environment.\n<run_terminal>\n<command>sleep $(cat delay.txt)</command>\n</run_terminal>",
        "Done.",
    ],
    "chars_per_second": 0,
}


def make_suite(
    root: Path, n: int, *, mu: float, sigma: float, cap: float, seed: int
) -> list[float]:
    from opencomposer.training.tasks import write_task

    rng = random.Random(seed)
    delays = [min(cap, rng.lognormvariate(mu, sigma)) for _ in range(n)]
    for i, d in enumerate(delays):
        repo = root / "repos" / f"t{i:02d}"
        repo.mkdir(parents=True)
        (repo / "delay.txt").write_text(f"{d:.3f}\n")
        write_task(
            root / "tasks" / f"sleep-{i:02d}",
            query="Wait for the environment.",
            verify="test -f delay.txt",
            repo_dir=repo,
            timeout_s=cap + 60,
        )
    return delays


async def run_mode(mode: str, tasks, env, model_spec: str, args) -> dict:
    from opencomposer.agent.session import SessionConfig
    from opencomposer.training.rl import rollout_from_episode
    from opencomposer.training.rollouts import RolloutScheduler, SchedulerConfig

    version = {"v": 0}
    scfg = SessionConfig(approve="all", max_turns=3, emit_deltas=False)

    async def episode(task, group, index):
        res = await env.run_episode(task, model_spec_or_factory=model_spec, session_config=scfg)
        r = rollout_from_episode(res, group=group, index=index)
        r.stats["version"] = version["v"]
        return r

    sched = RolloutScheduler(
        tasks=itertools.cycle(tasks),
        episode=episode,
        version=lambda: version["v"],
        config=SchedulerConfig(
            group_size=args.group_size,
            groups_per_step=args.groups_per_step,
            mode=mode,
            max_inflight=args.max_inflight,
            max_staleness=args.max_staleness,
            episode_timeout_s=args.cap + 60,
        ),
    )
    steps = []
    t_start = time.perf_counter()
    consumed = 0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        groups = await sched.next_groups()
        t1 = time.perf_counter()
        await asyncio.to_thread(time.sleep, args.train_s)  # the simulated trainer
        version["v"] += 1
        t2 = time.perf_counter()
        n = sum(len(g.rollouts) for g in groups)
        consumed += n
        bad = sum(r.stats.get("version", 0) < version["v"] - 2 for g in groups for r in g.rollouts)
        steps.append(
            {
                "rollout_s": t1 - t0,
                "train_s": t2 - t1,
                "rollouts": n,
                "too_stale": bad,
                "env_errors": sum(
                    "env" in r.error or r.status == "timeout" for g in groups for r in g.rollouts
                ),
            }
        )
    wall = time.perf_counter() - t_start
    await sched.close()
    return {
        "mode": mode,
        "wall_s": wall,
        "rollouts": consumed,
        "throughput": consumed / wall,
        "dropped_stale": sched.dropped_stale,
        "steps": steps,
    }


async def part_stragglers(args) -> dict:
    from opencomposer.training.catalog import load_suite
    from opencomposer.training.env import EnvConfig, EnvironmentServer

    root = Path(tempfile.mkdtemp(prefix="oc-rl-bench-"))
    delays = make_suite(
        root, args.tasks, mu=math.log(args.median), sigma=args.sigma, cap=args.cap, seed=args.seed
    )
    tasks = load_suite(root / "tasks")
    spec_file = root / "sleep.json"
    spec_file.write_text(json.dumps(SCRIPT))
    spec = f"scripted:{spec_file}"
    print(
        f"delays (s): median {statistics.median(delays):.2f}, mean {statistics.mean(delays):.2f}, "
        f"max {max(delays):.2f} over {len(delays)} tasks (log-normal, sigma {args.sigma})",
        flush=True,
    )
    async with EnvironmentServer(EnvConfig(num_actors=2, pool_size=0)) as env:
        await env.prewarm(tasks)
        results = {}
        for mode in ("sync", "async"):
            results[mode] = await run_mode(mode, tasks, env, spec, args)
            r = results[mode]
            print(
                f"{mode:>5}: {r['rollouts']} rollouts in {r['wall_s']:.1f} s = {r['throughput']:.2f} rollouts/s"
                f" (dropped stale groups: {r['dropped_stale']})",
                flush=True,
            )
            for i, s in enumerate(r["steps"], 1):
                print(
                    f"       step {i}: rollout wait {s['rollout_s']:.2f} s, train {s['train_s']:.2f} s",
                    flush=True,
                )
    ratio = results["async"]["throughput"] / results["sync"]["throughput"]
    print(f"async/sync throughput: {ratio:.2f}x (target >= 2x)", flush=True)
    return {"ratio": ratio, **results}


async def part_sync(args) -> dict:
    import torch
    from opencomposer.agent.backends import make_model
    from opencomposer.agent.backends.smollm2 import smollm2_path
    from opencomposer.agent.protocols import Message, Sampling
    from opencomposer.training.trainer import Trainer, TrainerConfig
    from opencomposer.training.weight_sync import VersionedModel, WeightSync

    folder = smollm2_path()
    trainer = Trainer.from_pretrained(folder, TrainerConfig())
    sampler = VersionedModel(make_model(f"vllm:{folder}"))
    t0 = time.perf_counter()
    await sampler.start()
    print(f"vLLM engine start: {time.perf_counter() - t0:.1f} s", flush=True)
    sync = WeightSync(sampler)
    times = []
    for rep in range(1, args.sync_reps + 1):
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.mul_(1.0 + 1e-3)
        trainer.version = rep
        res = await sync.push(trainer.named_weights(), rep)
        times.append(res.seconds)
        print(
            f"sync {rep}: {res.seconds:.2f} s, sampler at version {sampler.weight_version}",
            flush=True,
        )
    s = sampler.stream([Message(role="user", content="Say hi.")], Sampling(max_tokens=8))
    _ = [d async for d in s]
    print(f"a turn after the sync carries weight_version {s.output.weight_version}", flush=True)
    await sampler.close()
    warm = times[1:] or times
    print(
        f"weight sync of the 135M model: first (cold) {times[0]:.2f} s, then mean "
        f"{statistics.mean(warm):.2f} s, max {max(warm):.2f} s (target < 2 s)",
        flush=True,
    )
    return {"sync_s": times}


def part_metrics(path: Path) -> None:
    """The time split per step, and the held-out learning curve by phase."""
    all_rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    rows = [r for r in all_rows if r.get("step", 0) > 0 and r.get("rollout_s") is not None]
    timed = [r["time"] for r in all_rows if r.get("time") is not None]
    t0 = min(timed, default=0.0)
    held = [r for r in all_rows if r.get("heldout_reward") is not None]
    if held:
        print(f"held-out mean reward of {path}:")
        for r in held:
            phase = r.get("phase") or f"after RL step {r['step']}"
            at = f" at {(r['time'] - t0) / 60:5.1f} min" if r.get("time") is not None else ""
            print(
                f"  {phase:>18}{at}: {r['heldout_reward']:.3f}"
                f" (resolve rate {r.get('heldout_resolve_rate', 0.0):.2f})"
            )
    for r in all_rows:
        if str(r.get("phase", "")).startswith("warmup"):
            print(
                f"  warm start: {r.get('sft_examples')} examples, {r.get('sft_steps')} steps,"
                f" {r.get('train_s', 0.0):.0f} s training, {r.get('rollout_s', 0.0):.0f} s collecting"
            )
    if not rows:
        print(f"{path}: no steps")
        return
    print(f"time split per step of {path} ({len(rows)} steps):")
    for key in ("rollout_s", "train_s", "sync_s", "eval_s"):
        xs = [r[key] for r in rows if r.get(key) is not None]
        if xs:
            print(
                f"  {key:>10}: mean {statistics.mean(xs):7.2f} s  max {max(xs):7.2f} s  (n={len(xs)})"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--groups-per-step", type=int, default=4)
    ap.add_argument("--max-inflight", type=int, default=12)
    ap.add_argument("--median", type=float, default=5.0, help="median sleep, seconds")
    ap.add_argument("--sigma", type=float, default=1.2, help="log-normal sigma")
    ap.add_argument("--cap", type=float, default=40.0)
    ap.add_argument("--train-s", type=float, default=2.0, help="simulated train step")
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-sync", action="store_true")
    ap.add_argument("--only-sync", action="store_true", help="skip the straggler part")
    ap.add_argument("--sync-reps", type=int, default=3)
    ap.add_argument("--metrics", type=Path, help="a run's metrics.jsonl: print its time split")
    ap.add_argument(
        "--metrics-only", action="store_true", help="only read --metrics (no benchmark runs)"
    )
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    out: dict = {}
    if args.metrics_only and not args.metrics:
        ap.error("--metrics-only needs --metrics FILE")
    if not args.only_sync and not args.metrics_only:
        out["stragglers"] = asyncio.run(part_stragglers(args))
    if not args.skip_sync and not args.metrics_only:
        out["sync"] = asyncio.run(part_sync(args))
    if args.metrics:
        part_metrics(args.metrics)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
