"""Cluster benchmark, one run: rollouts with two sampler replicas against one, weight
broadcast to two replicas against one, and the delta's size against the full weights.

Everything runs on the product path of ``training/cluster.py``: vLLM sampler replicas
as Ray actors, a trainer rank under ``torch.distributed`` (gloo), episode workers
running the real agent session and sandbox on starter-suite tasks.

Part 1 — rollout throughput. ``--episodes`` episodes (``--concurrency`` at once), first
with every episode sent to replica 0, then balanced over both replicas; episodes/s and
generated tokens/s. On a 2-core machine both replicas share the same two cores, so no
gain is expected: the ratio says how much the second engine costs, not what it buys.

Part 2 — weights. Trainer steps on the policy's own samples (``--lr``), each followed
by a broadcast: whole weights to both replicas, a delta to both, a delta to one,
whole weights to one. Seconds per broadcast (encode on rank 0, the object store,
apply and engine reload on the replicas, versions read back) and bytes sent.

    .venv/bin/python benchmarks/cluster.py [--model smollm2|tiny] [--episodes 16] [--address ADDR]

``--gpu`` is the GPU check for a lent device (not run here: none was lent): a trainer
rank on CUDA and a vLLM replica built with vLLM's NCCL weight-transfer engine, the
weights broadcast from rank 0's GPU memory into the engine's workers through
``RayVLLMWeightSyncClient`` (vLLM's collective RPC), timed, and the engine's version read back. It needs two GPUs (NCCL refuses two
ranks on one device); on one it reports that and runs the object-store path on CUDA.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def cpu_line() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"CPU: {model} x{os.cpu_count()}; load average {load}"


def config(args: argparse.Namespace, model: str) -> Any:
    from opencomposer.training.config import parse_config

    return parse_config(
        {
            "model": {"path": model, "sampler": "vllm", "kv_cache_gib": 0.5, "precision": "bf16"},
            "tasks": {"suite": "starter:train", "heldout": ""},
            "optim": {"lr": args.lr, "micro_batch_size": 2},
            "rollout": {
                "group_size": 2,
                "max_turns": 1,
                "max_tokens": args.max_tokens,
                "num_workers": 2,
                "prompt_style": "compact",
                "temperature": 1.0,
            },
            "cluster": {
                "address": args.address,
                "samplers": 2,
                "sampler_cpus": 0.5,
                "trainer_ranks": 1,
                "trainer_cpus": 0.5,
                "env_workers_per_node": 2,
            },
        }
    )


async def throughput(cluster: Any, tasks: list[Any], scfg: Any, n: int, conc: int) -> dict:
    gate = asyncio.Semaphore(conc)

    async def one(i: int) -> Any:
        async with gate:
            return await cluster.episode(tasks[i % len(tasks)], scfg)

    t0 = time.perf_counter()
    rollouts = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    tokens = sum(len(t.completion_ids) for r in rollouts for t in r.turns)
    return {
        "episodes": n,
        "wall_s": round(wall, 2),
        "episodes_per_s": round(n / wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "ok": sum(r.status == "ok" for r in rollouts),
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from opencomposer.training.catalog import load_suite
    from opencomposer.training.cluster import Cluster, tiny_model_folder
    from opencomposer.training.rl import (
        make_sampler,
        model_folder,
        rollout_from_episode,
        trainer_config,
    )
    from opencomposer.training.rollouts import Group, build_samples
    from opencomposer.training.sessions import session_config

    work = Path(tempfile.mkdtemp(prefix="oc-cluster-bench-"))
    model = "smollm2" if args.model == "smollm2" else str(tiny_model_folder(work / "tiny"))
    cfg = config(args, model)
    folder = model_folder(cfg, work)
    tasks = load_suite("starter:train")[:8]
    cluster = Cluster(
        cfg,
        folder,
        make_model=functools.partial(make_sampler, cfg, folder),
        to_rollout=rollout_from_episode,
        trainer_config=trainer_config(cfg),
    )
    scfg = session_config(cfg, prompt_style="compact")
    out: dict[str, Any] = {"model": args.model, "cpu": cpu_line()}
    try:
        t0 = time.perf_counter()
        await cluster.start()
        out["start_s"] = round(time.perf_counter() - t0, 1)
        both = list(cluster.replicas)
        await throughput(cluster, tasks, scfg, 2, 2)  # warm: templates, indexes, engines
        cluster.replicas = both[:1]
        one = await throughput(cluster, tasks, scfg, args.episodes, args.concurrency)
        cluster.replicas = both
        two = await throughput(cluster, tasks, scfg, args.episodes, args.concurrency)
        out["rollouts"] = {
            "one_replica": one,
            "two_replicas": two,
            "ratio": round(two["episodes_per_s"] / one["episodes_per_s"], 2),
        }
        # weights: steps on the policy's own rollouts, each followed by one broadcast
        rollouts = [await cluster.episode(tasks[i % len(tasks)], scfg) for i in range(4)]
        for i, r in enumerate(rollouts):
            r.reward = float(i % 2)  # mixed rewards: every step trains
        group = Group(task=None, task_id="t", group=0, rollouts=rollouts)
        samples, _ = build_samples([group])
        rows = []
        plan = [("full", both), ("delta", both), ("delta", both[:1]), ("full", both[:1])]
        plan += [("full", both)]
        for kind, replicas in plan:
            await cluster.trainer.step(samples)
            cluster.replicas = replicas
            cluster.delta = kind == "delta"
            cluster.replica_versions = cluster.replica_versions[: len(replicas)]
            t0 = time.perf_counter()
            await cluster.broadcast(cluster.trainer.version)
            s = dict(cluster.sampler.last_sync)
            rows.append(
                {
                    "kind": kind,
                    "replicas": len(replicas),
                    "seconds": round(time.perf_counter() - t0, 2),
                    "bytes": int(s["sync_bytes"]),
                    "full_bytes": int(s["sync_full_bytes"]),
                    "ratio": round(s["sync_delta_ratio"], 4),
                }
            )
        cluster.replicas = both
        out["broadcast"] = rows
        full1 = [r["seconds"] for r in rows if r["kind"] == "full" and r["replicas"] == 1]
        full2 = [r["seconds"] for r in rows if r["kind"] == "full" and r["replicas"] == 2]
        out["broadcast_two_vs_one"] = round(min(full2) / min(full1), 2)
        deltas = [r["ratio"] for r in rows if r["kind"] == "delta"]
        out["delta_fraction"] = round(sum(deltas) / len(deltas), 4)
    finally:
        await cluster.close()
    return out


async def cuda_cluster(args: argparse.Namespace) -> dict[str, Any]:  # pragma: no cover
    """The product path on CUDA: a trainer rank (NCCL, world of one) and a vLLM replica
    sharing the GPU, four real episodes, one step, one broadcast, versions read back."""
    from opencomposer.training.catalog import load_suite
    from opencomposer.training.cluster import Cluster
    from opencomposer.training.config import parse_config
    from opencomposer.training.rl import (
        make_sampler,
        model_folder,
        rollout_from_episode,
        trainer_config,
    )
    from opencomposer.training.rollouts import Group, build_samples
    from opencomposer.training.sessions import session_config

    cfg = parse_config(
        {
            "model": {"path": "smollm2", "sampler": "vllm", "kv_cache_gib": 4.0},
            "optim": {"lr": 1e-6, "micro_batch_size": 4},
            "rollout": {"max_turns": 1, "max_tokens": 64, "prompt_style": "compact"},
            "tasks": {"heldout": ""},
            "cluster": {
                "samplers": 1,
                "sampler_gpus": 0.4,
                "trainer_ranks": 1,
                "trainer_gpus": 0.4,
                "env_workers_per_node": 1,
            },
        }
    )
    work = Path(tempfile.mkdtemp(prefix="oc-cluster-gpu-"))
    folder = model_folder(cfg, work)
    cluster = Cluster(
        cfg,
        folder,
        make_model=functools.partial(make_sampler, cfg, folder),
        to_rollout=rollout_from_episode,
        trainer_config=trainer_config(cfg),
    )
    tasks = load_suite("starter:train")[:4]
    scfg = session_config(cfg, prompt_style="compact")
    try:
        await cluster.start()
        rollouts = list(await asyncio.gather(*(cluster.episode(t, scfg) for t in tasks)))
        for i, r in enumerate(rollouts):
            r.reward = float(i % 2)
        samples, _ = build_samples([Group(task=None, task_id="t", group=0, rollouts=rollouts)])
        t0 = time.perf_counter()
        stats = await cluster.trainer.step(samples)
        t1 = time.perf_counter()
        await cluster.broadcast(cluster.trainer.version)
        return {
            "backend": cluster.backend,
            "ok_rollouts": sum(r.status == "ok" for r in rollouts),
            "step_s": round(t1 - t0, 2),
            "grad_norm": stats.get("grad_norm"),
            "broadcast": cluster.sampler.last_sync,
            "versions": {"trainer": cluster.trainer.version, "replicas": cluster.replica_versions},
        }
    finally:
        await cluster.close()


def gpu_check(args: argparse.Namespace) -> int:  # pragma: no cover - needs CUDA
    """Part 1: ``cuda_cluster``. Part 2 (two GPUs or more): a vLLM replica with vLLM's
    NCCL weight-transfer engine, weights broadcast into it from this process's GPU."""
    import ray
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: the GPU check needs one (and two for the NCCL broadcast)")
        return 2
    print("CUDA cluster path:", json.dumps(asyncio.run(cuda_cluster(args)), indent=2))
    from opencomposer.agent.backends.smollm2 import smollm2_path
    from opencomposer.agent.backends.vllm import VLLMModel
    from opencomposer.training.cluster import SamplerReplica, connect
    from opencomposer.training.weight_sync import VersionedModel

    folder = str(smollm2_path())
    gpus = torch.cuda.device_count()
    print(cpu_line(), f"GPUs: {gpus} x {torch.cuda.get_device_name(0)}")
    connect("")

    class NcclVLLM(VLLMModel):
        def _build_engine(self) -> Any:  # the engine, with vLLM's NCCL weight transfer
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            self._stop_ids = sorted(self.tokenizer.stop_ids())
            a = AsyncEngineArgs(
                model=self.path,
                dtype="bfloat16",
                gpu_memory_utilization=0.3,
                weight_transfer_config={"backend": "nccl"},
            )
            return AsyncLLM.from_engine_args(a)

    replica = (
        ray.remote(SamplerReplica)
        .options(num_gpus=1 if gpus > 1 else 0.5, max_concurrency=100)
        .remote(lambda: VersionedModel(NcclVLLM(folder)))
    )
    print("replica:", ray.get(replica.start.remote()))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.001)  # different weights, so the broadcast is visible
    if gpus < 2:
        print("one GPU: NCCL cannot put the trainer and the engine on one device; skipping it")
        return 0
    from vllm.distributed.weight_transfer import ModuleSource
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    info = NCCLTrainerInitInfo(
        master_address=ray.util.get_node_ip_address(), master_port=29555, world_size=2
    )
    engine = NCCLTrainerWeightTransferEngine.trainer_init(
        info, client=RayVLLMWeightSyncClient(replica), source=ModuleSource(model)
    )
    times = []
    for version in (1, 2, 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.send_weights()
        ray.get(replica.update_weight_version.remote(str(version)))
        times.append(time.perf_counter() - t0)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"NCCL broadcast of {nbytes / 2**20:.0f} MiB: {[round(t, 3) for t in times]} s")
    print("replica after sync:", ray.get(replica.info.remote()))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--address", default="", help="a running Ray cluster (default: local)")
    p.add_argument("--gpu", action="store_true", help="the GPU check for a lent device")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    if args.gpu:
        return gpu_check(args)
    out = asyncio.run(bench(args))
    print(cpu_line())
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
