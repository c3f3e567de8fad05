"""Training and serving across a Ray cluster: every role a Ray actor, placed on purpose.

The ``[cluster]`` section of the training config (``config.ClusterSection``) turns the
one-process loop of ``rl.py`` into this; without it nothing here runs.

Roles and where they run:

- **sampler replicas** (``SamplerReplica``): N vLLM engines (``model.sampler``; the
  ``hf`` engine works too), one Ray actor each, with ``sampler_cpus``/``sampler_gpus``
  per replica, in one placement group (``sampler_placement``: pack, spread,
  strict_spread). A replica wraps its engine in ``weight_sync.VersionedModel``, so
  the abort/resume of turns around a weight update is the single-machine code.
- **trainer ranks** (``TrainerRank``): M ranks under ``torch.distributed`` (gloo on
  CPU, NCCL with GPUs), the policy forward wrapped in DDP or FSDP2
  (``Trainer.distribute``); one placement group, packed by default. The driver
  shards each step's samples over the ranks and keeps every rank's loss normalised
  like the full-batch loss (``Trainer.step(totals=…)``), so M ranks take the step
  one rank would.
- **environment workers** (``EpisodeWorker``): ``env_workers_per_node`` per node,
  each pinned to its node (node affinity). A worker owns an ``EnvironmentServer``
  (whose actors sit on the same node, as ``env.py`` requires) and runs the whole
  agent session there; its model is a ``ReplicaClient``, which sends each turn to
  the sampler replica the driver chose for the episode. A node that joins mid-run
  gets workers (the driver polls the node list).
- **the driver** (this process): the ``RolloutScheduler``, advantages, metrics and
  checkpoints of ``rl.run_loop``, unchanged; ``Cluster`` stands in for the episode
  function, ``RemoteTrainer`` for the trainer and ``ReplicaSet`` for the sampler.

Balancing: each episode goes to the replica (and the worker) with the fewest
episodes in flight.

Weights (``ReplicaSet.reload_weights``): trainer rank 0 encodes its new bf16 weights
against the ones it sent last (``encode_weights``): a tensor goes whole, or, where
fewer than a third of its elements changed, as (indices, values) — after a small
AdamW step most bf16 weights round to the same value, which is what makes the
delta small. The payload is put into Ray's object store once (one copy per node)
and every replica applies it to its own copy and reloads the engine under the one
new version; then the versions are read back and must all agree. A replica whose
copy is not at the delta's base (a replacement) gets the full weights instead.
On GPUs the same step is an NCCL broadcast from rank 0 into each engine's workers
(``benchmarks/cluster.py --gpu``, written for a lent device).

Faults:

- a sampler replica that dies is replaced in its placement-group bundle, loaded with
  the last synced weights, and the episodes that were on it run again
  (``episode_retries``); an environment worker that dies is replaced on its node and
  its episodes run again. A retried episode is a fresh episode: nothing of the
  failed attempt reaches the step.
- a trainer rank that dies stops the step with ``ClusterError`` (one line); the run
  resumes from its newest checkpoint when the same command runs again
  (``run.out`` must then be on storage every trainer node sees).

Run: ``opencomposer train --config configs/cluster-local.toml`` (one machine) or
``configs/cluster-example.toml`` (``address`` of a running cluster). Tests:
``tests/training/test_cluster*.py``; the two-node one starts a real two-node Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from opencomposer.training.config import ClusterSection, ConfigError, TrainConfig
from opencomposer.training.weight_sync import SamplerLagError

log = logging.getLogger(__name__)

LABEL_SHARE = 0.001  # what a bundle asks of a custom resource label: pins it, barely uses it


class ClusterError(ValueError):
    """A failure of the cluster the user acts on (a dead trainer rank, roles that do
    not fit); the message is one line."""


class StaleBaseError(RuntimeError):
    """A replica got a delta whose base version it does not hold."""


def where() -> dict[str, Any]:
    """This process's node, IP and pid (what the placement checks compare)."""
    import ray

    ctx = ray.get_runtime_context()
    return {"node": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"[:300]


# -- weights as payloads: whole tensors, or (indices, values) where that is smaller -------


@dataclass(kw_only=True)
class WeightPayload:
    """New weights for the sampler replicas; ``base_version`` None means complete."""

    version: int
    base_version: int | None
    full: dict[str, torch.Tensor] = field(default_factory=dict)
    sparse: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    total_bytes: int = 0  # the whole weights in bf16, for the ratio

    @property
    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self.full.values())
        for idx, val in self.sparse.values():
            n += idx.numel() * idx.element_size() + val.numel() * val.element_size()
        return n


def encode_weights(
    new: dict[str, torch.Tensor],
    old: dict[str, torch.Tensor] | None,
    *,
    version: int,
    base_version: int | None,
    delta: bool = True,
) -> WeightPayload:
    """``new`` as a payload against ``old`` (bf16 tensors by name). A tensor whose
    elements are bitwise unchanged is left out; one with few changes goes as int32
    indices + bf16 values (6 bytes an element against 2 for the whole tensor, so
    sparse pays below a third changed); the rest go whole."""
    total = sum(t.numel() * t.element_size() for t in new.values())
    if old is None or not delta:
        return WeightPayload(version=version, base_version=None, full=dict(new), total_bytes=total)
    p = WeightPayload(version=version, base_version=base_version, total_bytes=total)
    for name, t in new.items():
        o = old.get(name)
        if o is None or o.shape != t.shape or o.dtype != t.dtype:
            p.full[name] = t
            continue
        flat, oflat = t.reshape(-1), o.reshape(-1)
        if t.element_size() == 2:
            changed = flat.view(torch.int16) != oflat.view(torch.int16)
        else:
            changed = flat != oflat
        idx = changed.nonzero().squeeze(1)
        n = idx.numel()
        if n == 0:
            continue
        if n * (4 + t.element_size()) < flat.numel() * t.element_size():
            p.sparse[name] = (idx.to(torch.int32), flat[idx].clone())
        else:
            p.full[name] = t
    return p


def apply_weights(payload: WeightPayload, shadow: dict[str, torch.Tensor]) -> None:
    """Apply ``payload`` to ``shadow`` (a replica's copy of the weights) in place."""
    if payload.base_version is None:
        shadow.clear()
    for name, t in payload.full.items():
        shadow[name] = t.clone()
    for name, (idx, val) in payload.sparse.items():
        shadow[name].view(-1)[idx.long()] = val


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as the sampler loads them: Hugging Face names, bf16, tied
    tensors once (vLLM ties them itself). FSDP2 shards are gathered first."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        ptr = t.data_ptr() if not hasattr(t, "full_tensor") else id(t)
        if ptr in seen:
            continue
        seen.add(ptr)
        out[name] = full.detach().to("cpu", torch.bfloat16).clone()
    return out


# -- sampler replicas ----------------------------------------------------------------


class SamplerReplica:
    """One sampler engine as a Ray actor (async: many turns and a reload at once)."""

    def __init__(self, make_model: Callable[[], Any]) -> None:
        logging.basicConfig(level=logging.WARNING)
        self._make = make_model
        self.model: Any = None
        self.shadow: dict[str, torch.Tensor] = {}
        self.version = 0
        self.turns = 0

    async def start(self) -> dict[str, Any]:
        self.model = self._make()
        start = getattr(self.model, "start", None)
        if start is not None:
            await start()
        return {
            **where(),
            "name": self.model.name,
            "context_window": self.model.context_window,
            "prompt_style": getattr(self.model, "prompt_style", None),
        }

    async def generate(self, messages: list[Any], sampling: Any) -> Any:
        """One turn: the whole text and its ``TurnOutput`` (token ids, logprobs, version)."""
        stream = self.model.stream(messages, sampling)
        text = "".join([d async for d in stream])
        self.turns += 1
        out = stream.output
        if out is not None:
            out.text = text
        return out

    async def load(self, payload: WeightPayload, version: int) -> int:
        """New weights (whole or a delta against this replica's copy) under ``version``."""
        if payload.base_version is not None and (
            payload.base_version != self.version or not self.shadow
        ):
            raise StaleBaseError(
                f"replica holds version {self.version}, delta needs {payload.base_version}"
            )
        apply_weights(payload, self.shadow)
        await self.model.reload_weights(list(self.shadow.items()), version)
        self.version = version
        return int(self.model.weight_version)

    # vLLM's weight-transfer RPCs, as ``RayVLLMWeightSyncClient`` calls them on GPUs:
    # trainer rank 0 broadcasts over NCCL straight into this engine's workers.

    def _engine(self) -> Any:
        return getattr(self.model, "inner", self.model)._engine

    async def init_weight_transfer_engine(self, request: Any) -> None:
        await self._engine().init_weight_transfer_engine(request)

    async def start_weight_update(self) -> None:
        await self._engine().start_weight_update()

    async def update_weights(self, request: Any) -> None:
        await self._engine().update_weights(request)

    async def finish_weight_update(self) -> None:
        await self._engine().finish_weight_update()

    async def update_weight_version(self, version: str) -> None:
        await self._engine().update_weight_version(version)
        self.version = int(version)
        inner = getattr(self.model, "inner", self.model)
        inner.weight_version = self.version  # the engine stamps turns with it
        if inner is not self.model:
            self.model.version = self.version  # VersionedModel's own

    async def info(self) -> dict[str, Any]:
        return {
            **where(),
            "version": int(self.model.weight_version) if self.model else None,
            "turns": self.turns,
            "aborted_turns": getattr(self.model, "aborted_turns", 0),
        }

    async def shutdown(self) -> None:
        if self.model is not None:
            await self.model.close()


class ReplicaClient:
    """A ``Model`` whose turns run on a sampler replica (used inside episode workers)."""

    def __init__(self, handle: Any, meta: dict[str, Any], tokenizer_path: str) -> None:
        from opencomposer.agent.backends._local import ChatTokenizer

        self.handle = handle
        self.name = str(meta["name"])
        self.context_window = int(meta["context_window"])
        if meta.get("prompt_style"):
            self.prompt_style = meta["prompt_style"]
        self._tokenizer = ChatTokenizer(tokenizer_path)
        self.died = False

    def count_tokens(self, text: str) -> int:
        return self._tokenizer.count(text)

    def stream(self, messages: list[Any], sampling: Any) -> Any:
        import ray
        from opencomposer.agent.backends._stream import TaskStream
        from opencomposer.agent.protocols import ModelError, TurnOutput

        async def produce(out: TurnOutput, emit: Callable[[str], None]) -> None:
            try:
                res = await self.handle.generate.remote(messages, sampling)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
                self.died = True
                raise ModelError(f"sampler replica died: {_one_line(e)}") from None
            for f in dataclasses.fields(res):
                if f.name != "text":
                    setattr(out, f.name, getattr(res, f.name))
            emit(res.text)

        return TaskStream(produce)

    async def close(self) -> None:
        pass


# -- environment workers ---------------------------------------------------------------


class EpisodeWorker:
    """Runs whole episodes on its node: an ``EnvironmentServer`` plus the agent session."""

    def __init__(self, num_actors: int, tokenizer_path: str = "") -> None:
        from opencomposer.training.env import EnvConfig, EnvironmentServer

        logging.basicConfig(level=logging.WARNING)
        self.env = EnvironmentServer(EnvConfig(num_actors=num_actors))
        self.tokenizer_path = tokenizer_path
        self.episodes = 0
        self.traces: Any = None  # the episodes' trace store (``_traces``)

    async def start(self) -> dict[str, Any]:
        await self.env.start()
        return where()

    async def run(
        self,
        task: Any,
        session_config: Any,
        replica: Any,
        meta: dict[str, Any],
        to_rollout: Callable[[Any], Any],
        traces_dir: str = "",
    ) -> tuple[Any, bool, dict[str, Any]]:
        """One training episode; (rollout, whether its sampler replica died, where)."""
        client = ReplicaClient(replica, meta, self.tokenizer_path)
        res = await self.env.run_episode(
            task,
            model_spec_or_factory=client,
            session_config=session_config,
            traces=self._traces(traces_dir),
        )
        self.episodes += 1
        return to_rollout(res), client.died, where()

    async def run_spec(
        self, task: Any, model_spec: str, session_config: Any, traces_dir: str = ""
    ) -> Any:
        """One benchmark episode with a model built from ``model_spec`` on this node;
        its trace goes to ``traces_dir/traces-<node ip>-<pid>.db`` (on this node)."""
        model = self.env.model(model_spec)
        start = getattr(model, "start", None)
        if start is not None:
            await start()
        res = await self.env.run_episode(
            task,
            model_spec_or_factory=model,
            session_config=session_config,
            traces=self._traces(traces_dir),
        )
        self.episodes += 1
        res.metrics = {**res.metrics, "node": where()["node"]}  # the Ray node id
        return res

    def _traces(self, traces_dir: str) -> Any:
        """This worker's trace store, ``traces_dir/traces-<node ip>-<pid>.db`` on its node."""
        if traces_dir and self.traces is None:
            from opencomposer.agent.traces import TraceStore

            here = where()
            path = Path(traces_dir) / f"traces-{here['ip']}-{here['pid']}.db"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.traces = TraceStore(path)
        return self.traces

    async def info(self) -> dict[str, Any]:
        return {**where(), "episodes": self.episodes}

    async def shutdown(self) -> None:
        await self.env.close()
        if self.traces is not None:
            self.traces.close()


# -- trainer ranks -----------------------------------------------------------------------


class TrainerRank:
    """One ``torch.distributed`` rank of the trainer (a Ray actor)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.trainer: Any = None
        self.sent: dict[str, torch.Tensor] | None = None  # rank 0: the weights last sent
        self.sent_version = 0
        self.sizes: dict[str, int] = {}
        self.strategy = "ddp"

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port on its node."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return where()["ip"], port

    def init(
        self,
        address: str,
        port: int,
        folder: str,
        config: Any,
        *,
        strategy: str,
        backend: str,
        with_reference: bool,
    ) -> dict[str, Any]:
        import torch.distributed as dist
        from opencomposer.training.trainer import Trainer

        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray shows each rank its own device(s)
            config = dataclasses.replace(config, device="cuda")
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=300),
        )
        self.trainer = Trainer.from_pretrained(folder, config, with_reference=with_reference)
        self.trainer.distribute(_wrapper(strategy, backend), self.world_size)
        self.strategy = strategy
        if self.rank == 0 or strategy == "fsdp2":  # under FSDP2 the gather is collective
            sent = bf16_state(self.trainer.model)
            if self.rank == 0:
                self.sent, self.sent_version = sent, 0
        return {**where(), "rank": self.rank, "backend": dist.get_backend()}

    def step(
        self, samples: list[Any], totals: tuple[float, float], micro_batches: int
    ) -> dict[str, float]:
        stats = self.trainer.step(samples, totals=totals, micro_batches=micro_batches)
        stats["version"] = float(self.trainer.version)
        return stats

    def gather(self) -> None:
        """Ranks > 0 under FSDP2: join the all-gather of rank 0's ``payload``."""
        bf16_state(self.trainer.model)

    def payload(self, delta: bool) -> WeightPayload:
        """Rank 0: the current weights as a payload against the ones sent last."""
        new = bf16_state(self.trainer.model)
        p = encode_weights(
            new,
            self.sent,
            version=self.trainer.version,
            base_version=self.sent_version,
            delta=delta,
        )
        self.sent, self.sent_version = new, self.trainer.version
        self.sizes = {"nbytes": p.nbytes, "total_bytes": p.total_bytes}
        return p

    def payload_sizes(self) -> dict[str, int]:
        return dict(self.sizes)

    def full_payload(self) -> WeightPayload:
        """Rank 0: the weights sent last, whole (for a replica that has no copy)."""
        assert self.sent is not None
        return encode_weights(self.sent, None, version=self.sent_version, base_version=None)

    def checksum(self) -> str:
        """A hash of this rank's fp32 weights: equal on every rank after each step."""
        h = hashlib.sha256()
        for name, t in sorted(self.trainer.model.state_dict().items()):
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            h.update(name.encode())
            h.update(full.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def save(self, folder: str, extra: dict[str, Any], prompt_style: str | None) -> str:
        """Rank 0 writes the checkpoint; under FSDP2 every rank first joins the gather
        of the full model and optimizer state."""
        model_state = optimizer_state = None
        if self.strategy == "fsdp2":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            policy, optimizer = self.trainer.policy, self.trainer.optimizer
            full = get_model_state_dict(policy, options=opts)  # names under PolicyHead.model
            model_state = {k.removeprefix("model."): v for k, v in full.items()}
            optimizer_state = get_optimizer_state_dict(policy, optimizer, options=opts)
        if self.rank == 0:
            self.trainer.prompt_style = prompt_style
            self.trainer.save(
                Path(folder),
                extra=extra,
                model_state=model_state,
                optimizer_state=optimizer_state,
            )
        return folder

    def load(self, folder: str) -> dict[str, Any]:
        if self.strategy == "fsdp2":
            extra = self._load_full(Path(folder))
        else:
            extra = self.trainer.load(Path(folder))
        if self.rank == 0:
            self.sent, self.sent_version = None, self.trainer.version  # replicas need it whole
        return extra

    def _load_full(self, folder: Path) -> dict[str, Any]:
        """FSDP2: every rank reads the full checkpoint and keeps its shards."""
        from opencomposer.training.trainer import STATE_FILE
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        weights: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        names = set(self.trainer.policy.state_dict())
        full = {f"model.{k}": v for k, v in weights.items() if f"model.{k}" in names}
        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.trainer.policy, full, options=opts)
        state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False)
        set_optimizer_state_dict(
            self.trainer.policy, self.trainer.optimizer, state["optimizer"], options=opts
        )
        self.trainer.step_count = int(state["step"])
        self.trainer.version = int(state["version"])
        return dict(state.get("extra") or {})

    def info(self) -> dict[str, Any]:
        return {**where(), "rank": self.rank, "version": self.trainer.version}


def _wrapper(strategy: str, backend: str) -> Callable[[torch.nn.Module], torch.nn.Module]:
    def wrap(module: torch.nn.Module) -> torch.nn.Module:
        if strategy == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            return fully_shard(module)
        from torch.nn.parallel import DistributedDataParallel

        if backend == "nccl":
            return DistributedDataParallel(module.cuda(), device_ids=[torch.cuda.current_device()])
        return DistributedDataParallel(module)

    return wrap


# -- placement ---------------------------------------------------------------------------


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """ClusterError (one line) for a HOST:PORT nothing answers on: ``ray.init`` would
    retry it for minutes. "" and "auto" are Ray's to resolve."""
    if not address or address == "auto" or address.startswith("ray://"):
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise ClusterError(f"cannot reach the Ray cluster at {address!r}: {e}") from None


def connect(address: str) -> None:
    """Join the cluster at ``address`` ("auto", "HOST:PORT") or start a local Ray ("")."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kw: dict[str, Any] = dict(
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        configure_logging=False,
    )
    check_reachable(address)
    try:
        if address:
            ray.init(address=address, **kw)
        else:
            ray.init(object_store_memory=1 << 30, **kw)
    except ConnectionError as e:
        raise ClusterError(f"cannot join the Ray cluster at {address!r}: {_one_line(e)}") from None


@dataclass(frozen=True, kw_only=True)
class RoleSpec:
    """How many actors of a role, what each asks for, and how they are placed."""

    name: str
    count: int
    cpus: float
    gpus: float = 0.0
    resource: str = ""
    strategy: str = "PACK"

    def bundle(self) -> dict[str, float]:
        b = {"CPU": max(self.cpus, LABEL_SHARE)}
        if self.gpus:
            b["GPU"] = self.gpus
        if self.resource:
            b[self.resource] = LABEL_SHARE
        return b


async def place(role: RoleSpec, timeout_s: float = 120.0) -> Any:
    """A ready placement group for ``role``; ClusterError when the cluster cannot hold it."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([role.bundle() for _ in range(role.count)], strategy=role.strategy)
    try:
        await asyncio.wait_for(pg.ready(), timeout_s)
    except TimeoutError:
        remove_placement_group(pg)
        raise ClusterError(
            f"cannot place {role.count} {role.name}(s) of {role.bundle()} ({role.strategy}) "
            f"within {timeout_s:.0f} s; the cluster has {ray.cluster_resources()}"
        ) from None
    return pg


def bundle_nodes(pg: Any) -> list[str]:
    """The node of each bundle of a ready placement group."""
    from ray.util import placement_group_table

    table = placement_group_table(pg)["bundles_to_node_id"]
    return [table[i] for i in range(len(table))]


def actor_options(role: RoleSpec, pg: Any, index: int, **kw: Any) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    opts: dict[str, Any] = dict(
        num_cpus=role.cpus,
        num_gpus=role.gpus,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=index
        ),
        **kw,
    )
    if role.resource:
        opts["resources"] = {role.resource: LABEL_SHARE}
    return opts


# -- the driver's side -----------------------------------------------------------------


@dataclass(kw_only=True)
class Slot:
    """One actor of a role and what the driver knows of it."""

    index: int
    handle: Any = None
    node: str = ""  # where it runs (reported by the actor)
    placed: str = ""  # where its placement put it
    inflight: int = 0
    generation: int = 0  # bumps on each replacement
    served: int = 0


def _least(slots: Sequence[Slot]) -> Slot:
    return min(slots, key=lambda s: (s.inflight, s.served, s.index))


class ReplicaSet:
    """The sampler replicas as one weight receiver: a push reaches all of them under
    one version, and ``weight_version`` is that version (it raises if they differ)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.name = "replicas"
        self.context_window = 0
        self.prompt_style: str | None = None
        self.last_sync: dict[str, float] = {}

    @property
    def weight_version(self) -> int:
        versions = self.cluster.replica_versions
        if len(set(versions)) > 1:
            raise SamplerLagError(f"sampler replicas serve different weight versions: {versions}")
        return versions[0] if versions else 0

    @property
    def aborted_turns(self) -> int:
        return self.cluster.aborted_turns

    async def reload_weights(self, weights: Any, version: int) -> None:
        await self.cluster.broadcast(version)

    def metrics(self) -> dict[str, Any]:
        return {**self.last_sync, **self.cluster.fault_counts()}

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


class RemoteWeights:
    """Stands in for ``Trainer.named_weights()``: the weights stay on rank 0."""

    def __iter__(self) -> Any:
        raise TypeError("cluster weights are sent by rank 0 (ReplicaSet), not iterated")


class RemoteTrainer:
    """The trainer ranks behind ``Trainer``'s interface, as ``rl.run_loop`` uses it."""

    def __init__(self, cluster: Cluster, micro_batch_size: int) -> None:
        self.cluster = cluster
        self.micro_batch_size = micro_batch_size
        self.version = 0
        self.step_count = 0
        self.prompt_style: str | None = None

    async def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        res = fn(*args, **kwargs)
        return await res if asyncio.iscoroutine(res) else res

    async def step(self, samples: Sequence[Any]) -> dict[str, float]:
        """One optimizer step on every rank, the batch sharded over them."""
        self.step_count += 1
        tokens = float(sum(sum(s.mask[1:]) for s in samples))
        if not samples or tokens == 0:
            return {"samples": float(len(samples)), "skipped": 1.0, "loss": 0.0, "grad_norm": 0.0}
        ranks = self.cluster.ranks
        order = sorted(samples, key=lambda s: len(s.input_ids))
        shards = [order[i :: len(ranks)] for i in range(len(ranks))]
        mbs = max(1, max(math.ceil(len(sh) / self.micro_batch_size) for sh in shards))
        totals = (tokens, float(len(samples)))
        stats = await self.cluster.on_ranks(
            "step", lambda i: (shards[i], totals, mbs), what=f"step {self.step_count}"
        )
        versions = {int(s["version"]) for s in stats}
        if len(versions) != 1:
            raise ClusterError(f"trainer ranks disagree on the weight version: {sorted(versions)}")
        merged = dict(stats[0])
        for k in ("loss", "ratio_mean", "clip_frac", "kl_old", "kl_ref", "entropy", "samples"):
            if all(k in s for s in stats):
                merged[k] = sum(float(s[k]) for s in stats)
        self.version = versions.pop()
        merged.pop("version", None)
        return merged

    def named_weights(self, dtype: Any = None) -> RemoteWeights:
        """Rank 0 sends the replicas a bf16 delta whatever ``dtype`` asks."""
        return RemoteWeights()

    def save(self, folder: Path, *, extra: dict[str, Any] | None = None) -> Path:
        self.cluster.on_ranks_blocking(
            "save", lambda i: (str(folder), extra or {}, self.prompt_style), what="checkpoint"
        )
        return folder

    def load(self, folder: Path) -> dict[str, Any]:
        extras = self.cluster.on_ranks_blocking("load", lambda i: (str(folder),), what="resume")
        infos = self.cluster.on_ranks_blocking("info", lambda i: (), what="resume")
        self.version = int(infos[0]["version"])
        return dict(extras[0])

    async def checksums(self) -> list[str]:
        return list(await self.cluster.on_ranks("checksum", lambda i: (), what="checksum"))


class Cluster:
    """Starts the roles, balances episodes over them, replaces what dies.

    ``make_model()`` builds one sampler engine (called inside each replica actor);
    ``to_rollout(EpisodeResult)`` makes a training ``Rollout`` (called in workers)."""

    def __init__(
        self,
        config: TrainConfig,
        folder: Path,
        *,
        make_model: Callable[[], Any],
        to_rollout: Callable[[Any], Any],
        trainer_config: Any = None,
    ) -> None:
        if config.cluster is None:
            raise ConfigError("the training config has no [cluster] section")
        self.config = config
        self.section: ClusterSection = config.cluster
        self.folder = Path(folder)
        self.make_model = make_model
        self.to_rollout = to_rollout
        self.trainer_config = trainer_config
        c = self.section
        self.sampler_role = RoleSpec(
            name="sampler replica",
            count=c.samplers,
            cpus=c.sampler_cpus,
            gpus=c.sampler_gpus,
            resource=c.sampler_resource,
            strategy=c.sampler_placement.upper(),
        )
        self.trainer_role = RoleSpec(
            name="trainer rank",
            count=c.trainer_ranks,
            cpus=c.trainer_cpus,
            gpus=c.trainer_gpus,
            resource=c.trainer_resource,
            strategy=c.trainer_placement.upper(),
        )
        self.delta = c.weight_delta  # the benchmark compares whole and delta broadcasts
        self.traces_dir = ""  # set: each worker writes its episodes' traces there
        self.backend = c.backend if c.backend != "auto" else ("nccl" if c.trainer_gpus else "gloo")
        self.replicas: list[Slot] = []
        self.workers: list[Slot] = []
        self.ranks: list[Any] = []
        self.rank_nodes: list[dict[str, Any]] = []
        self.meta: dict[str, Any] = {}
        self.replica_versions: list[int] = []
        self.synced_version = 0
        self.replaced = {"replicas_replaced": 0, "workers_replaced": 0, "episodes_retried": 0}
        self.aborted_turns = 0
        self._pgs: dict[str, Any] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._watch: asyncio.Task[None] | None = None
        self.sampler = ReplicaSet(self)
        self.trainer = RemoteTrainer(self, config.optim.micro_batch_size)

    # -- start and stop --------------------------------------------------------------

    async def start(self, roles: Sequence[str] = ("sampler", "env", "trainer")) -> None:
        """Place and start the roles (tests start some of them alone)."""
        connect(self.section.address)
        starts = {
            "sampler": self._start_replicas,
            "env": self._start_workers,
            "trainer": self._start_ranks,
        }
        await asyncio.gather(*(starts[r]() for r in roles))
        if "env" in roles:
            self._watch = asyncio.ensure_future(self._watch_nodes())

    async def _start_replicas(self) -> None:
        pg = self._pgs["sampler"] = await place(self.sampler_role)
        nodes = bundle_nodes(pg)
        self.replicas = [Slot(index=i, placed=nodes[i]) for i in range(self.sampler_role.count)]
        await asyncio.gather(*(self._spawn_replica(s) for s in self.replicas))
        self.replica_versions = [0] * len(self.replicas)

    async def _spawn_replica(self, slot: Slot) -> None:
        import ray

        opts = actor_options(
            self.sampler_role, self._pgs["sampler"], slot.index, max_concurrency=1000
        )
        slot.handle = ray.remote(SamplerReplica).options(**opts).remote(self.make_model)
        info = await slot.handle.start.remote()
        slot.node = info["node"]
        self.meta = {k: info[k] for k in ("name", "context_window", "prompt_style")}
        self.sampler.context_window = int(info["context_window"])
        self.sampler.prompt_style = info["prompt_style"]

    def _node_ids(self) -> list[str]:
        import ray

        label = self.section.env_resource
        return [
            n["NodeID"]
            for n in ray.nodes()
            if n.get("Alive") and (not label or n.get("Resources", {}).get(label, 0) > 0)
        ]

    async def _start_workers(self, nodes: Iterable[str] | None = None) -> None:
        new: list[Slot] = []
        for node in nodes if nodes is not None else self._node_ids():
            for _ in range(self.section.env_workers_per_node):
                new.append(Slot(index=len(self.workers) + len(new), placed=node))
        self.workers += new
        await asyncio.gather(*(self._spawn_worker(s) for s in new))

    async def _spawn_worker(self, slot: Slot) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        alive = slot.placed in self._node_ids()
        slot.handle = (
            ray.remote(EpisodeWorker)
            .options(
                num_cpus=0,
                max_concurrency=1000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node_id=slot.placed, soft=not alive
                ),
            )
            .remote(max(1, min(self.config.rollout.num_workers, 4)), str(self.folder))
        )
        info = await slot.handle.start.remote()
        slot.node = info["node"]

    async def _start_ranks(self) -> None:
        import ray

        role = self.trainer_role
        pg = self._pgs["trainer"] = await place(role)
        nodes = bundle_nodes(pg)
        self.ranks = [
            ray.remote(TrainerRank)
            .options(**actor_options(role, pg, i, max_restarts=0))
            .remote(i, role.count)
            for i in range(role.count)
        ]
        address, port = await self.ranks[0].rendezvous.remote()
        if self.section.master_port:
            port = self.section.master_port
        infos = await asyncio.gather(
            *(
                r.init.remote(
                    address,
                    port,
                    str(self.folder),
                    self.trainer_config,
                    strategy=self.section.strategy,
                    backend=self.backend,
                    with_reference=self.config.algo.kl_coef > 0,
                )
                for r in self.ranks
            )
        )
        self.rank_nodes = [{**info, "placed": nodes[i]} for i, info in enumerate(infos)]

    async def _watch_nodes(self, every_s: float = 2.0) -> None:
        """Give environment workers to nodes that join while the run goes on."""
        while True:
            await asyncio.sleep(every_s)
            try:
                have = {w.placed for w in self.workers}
                fresh = [n for n in self._node_ids() if n not in have]
                if fresh:
                    log.warning("nodes joined: %s; starting environment workers there", fresh)
                    await self._start_workers(fresh)
            except Exception as e:  # the watch never takes the run down
                log.warning("node watch: %s", _one_line(e))

    async def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(BaseException):
                await self._watch
        slots = [s for s in self.replicas + self.workers if s.handle is not None]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.gather(
                    *(s.handle.shutdown.remote() for s in slots), return_exceptions=True
                ),
                timeout=60,
            )
        for h in [s.handle for s in slots] + self.ranks:
            with contextlib.suppress(Exception):
                ray.kill(h, no_restart=True)
        for pg in self._pgs.values():
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        self.replicas, self.workers, self.ranks, self._pgs = [], [], [], {}

    # -- episodes ----------------------------------------------------------------------

    async def episode(self, task: Any, session_config: Any) -> Any:
        """One rollout on the least busy worker and replica; re-run (a fresh episode)
        when either dies, up to ``episode_retries`` times."""
        import ray

        last = ""
        for attempt in range(self.section.episode_retries + 1):
            replica, worker = _least(self.replicas), _least(self.workers)
            rgen, wgen = replica.generation, worker.generation
            replica.inflight += 1
            worker.inflight += 1
            try:
                rollout, died, _ = await worker.handle.run.remote(
                    task,
                    session_config,
                    replica.handle,
                    self.meta,
                    self.to_rollout,
                    self.traces_dir,
                )
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
                last = f"environment worker died: {_one_line(e)}"
                await self._replace("worker", worker, wgen)
                self.replaced["episodes_retried"] += 1
                continue
            finally:
                replica.inflight -= 1
                worker.inflight -= 1
            if died:
                last = "sampler replica died"
                await self._replace("replica", replica, rgen)
                self.replaced["episodes_retried"] += 1
                continue
            replica.served += 1
            worker.served += 1
            rollout.stats["attempts"] = float(attempt + 1)
            return rollout
        raise RuntimeError(
            f"episode failed after {self.section.episode_retries + 1} attempts: {last}"
        )

    async def bench_episode(
        self, task: Any, model_spec: str, session_config: Any, traces_dir: str = ""
    ) -> Any:
        """One benchmark episode (``bench --cluster``) on the least busy worker, with
        the model built there; re-run on a fresh worker if its worker dies."""
        import ray

        for _ in range(self.section.episode_retries + 1):
            worker = _least(self.workers)
            gen = worker.generation
            worker.inflight += 1
            try:
                res = await worker.handle.run_spec.remote(
                    task, model_spec, session_config, traces_dir
                )
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
                await self._replace("worker", worker, gen)
                self.replaced["episodes_retried"] += 1
                continue
            finally:
                worker.inflight -= 1
            worker.served += 1
            return res
        raise RuntimeError("benchmark episode failed: its environment workers kept dying")

    async def _replace(self, kind: str, slot: Slot, generation: int) -> None:
        """Replace a dead actor once, however many episodes saw it die."""
        import ray

        lock = self._locks.setdefault((kind, slot.index), asyncio.Lock())
        async with lock:
            if slot.generation != generation:
                return  # another episode replaced it already
            with contextlib.suppress(Exception):
                ray.kill(slot.handle, no_restart=True)
            log.warning("%s %d died; replacing it", kind, slot.index)
            if kind == "worker":
                await self._spawn_worker(slot)
                self.replaced["workers_replaced"] += 1
            else:
                await self._spawn_replica(slot)
                if self.ranks:
                    version = await slot.handle.load.remote(
                        self.ranks[0].full_payload.remote(), self.synced_version
                    )
                    self.replica_versions[slot.index] = version
                self.replaced["replicas_replaced"] += 1
            slot.generation += 1

    # -- weights -----------------------------------------------------------------------

    async def broadcast(self, version: int) -> None:
        """Rank 0's new weights to every replica under ``version``; the versions are
        read back. A replica without the delta's base gets the weights whole; a dead
        one is replaced (and loaded whole)."""
        import ray

        t0 = time.perf_counter()
        payload = self.ranks[0].payload.remote(self.delta)
        if self.section.strategy == "fsdp2":  # gathering the shards is collective
            await self.on_ranks("gather", lambda i: (), what="weight sync", ranks=self.ranks[1:])
        sizes = await self.ranks[0].payload_sizes.remote()  # actor calls run in order

        async def one(slot: Slot) -> int:
            gen = slot.generation
            try:
                return int(await slot.handle.load.remote(payload, version))
            except ray.exceptions.RayTaskError as e:
                if not isinstance(e.cause, StaleBaseError):
                    raise
                return int(
                    await slot.handle.load.remote(self.ranks[0].full_payload.remote(), version)
                )
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
                self.synced_version = version
                await self._replace("replica", slot, gen)
                return self.replica_versions[slot.index]

        self.replica_versions = list(await asyncio.gather(*(one(s) for s in self.replicas)))
        self.synced_version = version
        self.sampler.last_sync = {
            "sync_bytes": sizes["nbytes"],
            "sync_full_bytes": sizes["total_bytes"],
            "sync_delta_ratio": sizes["nbytes"] / max(1, sizes["total_bytes"]),
            "sync_broadcast_s": time.perf_counter() - t0,
        }
        infos = await asyncio.gather(*(s.handle.info.remote() for s in self.replicas))
        self.aborted_turns = sum(int(i["aborted_turns"]) for i in infos)

    # -- trainer ranks -----------------------------------------------------------------

    async def on_ranks(
        self,
        method: str,
        args: Callable[[int], tuple[Any, ...]],
        *,
        what: str,
        ranks: Sequence[Any] | None = None,
    ) -> list[Any]:
        """Call ``method`` on every rank; a dead rank is ``ClusterError`` (one line)."""
        chosen = self.ranks if ranks is None else ranks
        refs = [getattr(r, method).remote(*args(i)) for i, r in enumerate(chosen)]
        return await self._ranks_result(refs, what)

    def on_ranks_blocking(
        self, method: str, args: Callable[[int], tuple[Any, ...]], *, what: str
    ) -> list[Any]:
        import ray

        refs = [getattr(r, method).remote(*args(i)) for i, r in enumerate(self.ranks)]
        try:
            return list(ray.get(refs))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
            raise self._rank_error(refs, what, e) from None

    async def _ranks_result(self, refs: list[Any], what: str) -> list[Any]:
        import ray

        try:
            return list(await asyncio.gather(*refs))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
            raise self._rank_error(refs, what, e) from None

    def _rank_error(self, refs: list[Any], what: str, e: BaseException) -> ClusterError:
        import ray

        dead = []
        for i, ref in enumerate(refs):
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                try:
                    ray.get(ready[0])
                except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
                    dead.append(i)
                except Exception:
                    pass
        ranks = ", ".join(map(str, dead)) or "?"
        return ClusterError(
            f"trainer rank {ranks} died during {what} ({_one_line(e)[:120]}); "
            "run the same command again to resume from the newest checkpoint"
        )

    # -- what the run and the tests read -------------------------------------------------

    def fault_counts(self) -> dict[str, int]:
        return dict(self.replaced)

    async def report(self) -> dict[str, Any]:
        """Where every role ran, the replicas' versions, the ranks' weight checksums."""
        import ray

        infos = await asyncio.gather(*(s.handle.info.remote() for s in self.replicas))
        return {
            "nodes": [
                {"node": n["NodeID"], "alive": n["Alive"], "resources": n.get("Resources", {})}
                for n in ray.nodes()
            ],
            "placement": await self.placement(),
            "replica_versions": [int(i["version"]) for i in infos],
            "trainer_version": self.trainer.version,
            "trainer_checksums": await self.trainer.checksums() if self.ranks else [],
            "backend": self.backend,
            "strategy": self.section.strategy,
            "last_sync": self.sampler.last_sync,
            **self.fault_counts(),
        }

    async def placement(self) -> dict[str, list[dict[str, Any]]]:
        """Where each actor runs and where its placement put it, by role."""
        reps = await asyncio.gather(*(s.handle.info.remote() for s in self.replicas))
        wks = await asyncio.gather(*(s.handle.info.remote() for s in self.workers))
        return {
            "sampler": [
                {**i, "placed": s.placed} for s, i in zip(self.replicas, reps, strict=True)
            ],
            "env": [{**i, "placed": s.placed} for s, i in zip(self.workers, wks, strict=True)],
            "trainer": list(self.rank_nodes),
        }


def tiny_model_folder(dst: Path, *, seed: int = 0) -> Path:
    """A tiny random Llama (2 layers, width 128) with SmolLM2's tokenizer and chat
    template, as a Hugging Face folder that vLLM and the trainer both load: the test
    double for cluster runs (fast to sample and to train, real engines throughout)."""
    import json
    import shutil

    from opencomposer.agent.backends.smollm2 import smollm2_path
    from transformers import LlamaConfig, LlamaForCausalLM

    dst = Path(dst)
    if (dst / "model.safetensors").exists():
        return dst
    src = Path(smollm2_path())
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
    )
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        skip = f.name in ("config.json", "model.safetensors") or f.name.startswith("opencomposer")
        if f.is_file() and not skip:
            shutil.copyfile(f, dst / f.name)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(str(dst))).to(torch.bfloat16)
    model.save_pretrained(str(dst))
    return dst
