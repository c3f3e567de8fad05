"""The training run's configuration: one TOML file, read into keyword-only dataclasses.

Sections and their keys are the dataclasses below (``configs/starter.toml`` is
the annotated example). Unknown sections or keys, wrong types and impossible
values are user mistakes: ``ConfigError`` with one line naming the key.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A config file that cannot be used; the message is one line."""


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    path: str = "smollm2"  # "smollm2" (embedded) or a Hugging Face model folder
    sampler: Literal["vllm", "hf"] = "vllm"  # the engine that samples rollouts
    precision: Literal["bf16", "fp32", "mxfp8"] = "bf16"
    moe_experts: int = 0  # > 0: upcycle the dense model into an MoE before training
    moe_top_k: int = 2
    kv_cache_gib: float = 1.0


@dataclass(frozen=True, kw_only=True)
class TasksSection:
    suite: str = "starter:train"
    heldout: str = "starter:heldout"  # "" for none
    eval_every: int = 5  # steps between held-out evaluations (0: only at start and end)
    eval_samples: int = 2  # rollouts per held-out task per evaluation
    eval_temperature: float = 0.7


@dataclass(frozen=True, kw_only=True)
class RolloutSection:
    group_size: int = 4
    groups_per_step: int = 4
    mode: Literal["sync", "async"] = "async"
    max_inflight: int = 6
    extra_per_group: int = 0
    max_staleness: int = 1
    episode_timeout_s: float = 180.0
    num_workers: int = 2  # environment-server Ray actors (workspaces, setup, verify)
    max_turns: int = 4
    max_tokens: int = 256  # per turn
    max_completion_tokens: int = 1024  # per episode
    temperature: float = 1.0
    top_p: float = 1.0
    approve: Literal["none", "safe", "all"] = "all"
    # the system prompt's style, as the production agent picks it: "auto" = what the
    # model backend asks for (the embedded SmolLM2 asks for "compact"), else "full"
    prompt_style: Literal["auto", "full", "compact"] = "auto"


@dataclass(frozen=True, kw_only=True)
class AlgoSection:
    estimator: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    aggregation: Literal["token", "sequence"] = "token"


@dataclass(frozen=True, kw_only=True)
class OptimSection:
    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 4
    gradient_checkpointing: bool = False  # recompute activations: less memory, ~30% more time
    lora_rank: int = 0  # >0: train rank-r adapters on the frozen model (training/lora.py)
    lora_alpha: float = 32.0


@dataclass(frozen=True, kw_only=True)
class RunSection:
    steps: int = 40
    seed: int = 0
    out: str = "runs/starter"
    checkpoint_every: int = 5
    keep_checkpoints: int = 3  # newest complete checkpoints kept (0: all); ~1.6 GB each for 135M
    progress: bool = True


@dataclass(frozen=True, kw_only=True)
class SftSection:
    """Supervised warm start: on accepted traces (``--sft``) or on rejection samples.

    ``source``: "traces" — the accepted traces of a trace store (``traces_db``,
    default ``$OPENCOMPOSER_HOME/traces.db``); "demos" — first record accepted
    demonstrations of the training tasks that ship a ``solution.json``
    (``training/demos.py``) into ``traces_db`` (default ``<run>/demos.db``), then
    the same; "rejection" — the policy's own rollouts with reward >= ``min_reward``."""

    source: Literal["traces", "demos", "rejection"] = "traces"
    traces_db: str = ""
    warmup_rounds: int = 0  # RL runs: SFT rounds before the first RL step (0: none)
    min_reward: float = 1.0  # rejection sampling: keep rollouts at least this good
    samples_per_task: int = 4  # rejection sampling: attempts per training task
    epochs: int = 2
    lr: float = 1e-5
    micro_batch_size: int = 4
    max_examples: int = 512
    # "demos": the suite demonstrated ("": the run's training tasks), e.g.
    # "corpus:train:all", every training task once per request kind.
    demo_suite: str = ""
    # SFT steps between mid-round checkpoints (``<run>/checkpoints/sft_resume``), from
    # which an interrupted warm start or ``--sft`` resumes; 0: none.
    checkpoint_every: int = 10
    # ``--sft``: continue from this checkpoint (a ``step_N`` folder of an earlier run):
    # its weights (a LoRA run: its adapters) and optimizer state, e.g. one more epoch.
    init: str = ""


@dataclass(frozen=True, kw_only=True)
class ClusterSection:
    """The roles as Ray actors across a cluster (``training/cluster.py``). Without a
    ``[cluster]`` section everything runs in this process, as on one machine.

    ``*_resource``: a custom Ray resource label (``ray start --resources='{"gpu_node": 1}'``)
    that a role's placement-group bundles ask a sliver of, which pins the role to the
    nodes carrying that label; "" places it wherever its CPUs/GPUs fit."""

    address: str = ""  # "": start a local Ray (as now); "auto" or "HOST:PORT": join a cluster
    samplers: int = 1  # vLLM engine replicas, one Ray actor each
    sampler_cpus: float = 1.0
    sampler_gpus: float = 0.0  # > 0: each replica on its own GPU(s)
    sampler_resource: str = ""
    sampler_placement: Literal["pack", "spread", "strict_spread"] = "spread"
    trainer_ranks: int = 1  # torch.distributed ranks, one Ray actor each
    trainer_cpus: float = 1.0
    trainer_gpus: float = 0.0  # > 0: one CUDA device per rank, NCCL
    trainer_resource: str = ""
    trainer_placement: Literal["pack", "strict_pack", "spread"] = "pack"
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl with GPUs, else gloo
    env_workers_per_node: int = (
        1  # episode workers per node (each with rollout.num_workers env actors)
    )
    env_resource: str = ""  # only nodes with this label get environment workers
    weight_delta: bool = True  # send only the changed bf16 elements when that is smaller
    episode_retries: int = 2  # re-runs of an episode whose sampler replica or env worker died
    master_port: int = 0  # torch.distributed rendezvous port (0: a free one)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    tasks: TasksSection = field(default_factory=TasksSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    optim: OptimSection = field(default_factory=OptimSection)
    run: RunSection = field(default_factory=RunSection)
    sft: SftSection = field(default_factory=SftSection)
    cluster: ClusterSection | None = None  # None: one process, as on one machine


def _check(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{where} = {value!r}: expected one of {list(typing.get_args(hint))}")
        return value
    if origin in (types.UnionType, typing.Union):
        for arg in typing.get_args(hint):
            try:
                return _check(value, arg, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where} = {value!r} has the wrong type")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (
        not isinstance(value, hint) or (hint is int and isinstance(value, bool))
    ):
        raise ConfigError(f"{where} = {value!r}: expected {hint.__name__}")
    return value


def _section(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"[{where}] must be a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"unknown key {where}.{key} (known: {', '.join(sorted(names))})")
        kw[key] = _check(value, hints[key], f"{where}.{key}")
    return cls(**kw)


def parse_config(data: dict[str, Any]) -> TrainConfig:
    hints = typing.get_type_hints(TrainConfig)
    kw = {}
    for key, value in data.items():
        if key not in hints:
            raise ConfigError(f"unknown section [{key}] (known: {', '.join(hints)})")
        cls = next(a for a in typing.get_args(hints[key]) or (hints[key],) if a is not type(None))
        kw[key] = _section(cls, value, key)
    cfg = TrainConfig(**kw)
    r = cfg.rollout
    if r.group_size < 2:
        raise ConfigError("rollout.group_size must be at least 2 (advantages are group-relative)")
    if r.groups_per_step < 1 or r.max_inflight < r.groups_per_step:
        raise ConfigError("rollout.max_inflight must be at least rollout.groups_per_step (>= 1)")
    if cfg.run.steps < 0 or cfg.optim.micro_batch_size < 1:
        raise ConfigError("run.steps must be >= 0 and optim.micro_batch_size >= 1")
    if cfg.run.keep_checkpoints < 0:
        raise ConfigError("run.keep_checkpoints must be >= 0 (0 keeps every checkpoint)")
    if cfg.sft.checkpoint_every < 0:
        raise ConfigError("sft.checkpoint_every must be >= 0 (0: no mid-round checkpoints)")
    if cfg.cluster is not None:
        _check_cluster(cfg)
    return cfg


def _check_cluster(cfg: TrainConfig) -> None:
    c = cfg.cluster
    assert c is not None
    if c.samplers < 1 or c.trainer_ranks < 1 or c.env_workers_per_node < 1:
        raise ConfigError(
            "cluster.samplers, cluster.trainer_ranks and cluster.env_workers_per_node must be >= 1"
        )
    if min(c.sampler_cpus, c.sampler_gpus, c.trainer_cpus, c.trainer_gpus) < 0:
        raise ConfigError("cluster CPU and GPU counts must be >= 0")
    if c.backend == "nccl" and c.trainer_gpus <= 0:
        raise ConfigError("cluster.backend = 'nccl' needs cluster.trainer_gpus > 0")
    if c.episode_retries < 0 or not 0 <= c.master_port < 65536:
        raise ConfigError("cluster.episode_retries must be >= 0 and cluster.master_port a port")
    if cfg.sft.warmup_rounds > 0:
        raise ConfigError(
            "[sft] warmup_rounds is not supported with [cluster] yet: warm-start on one "
            "machine, then point model.path at that checkpoint"
        )


def load_config(path: Path) -> TrainConfig:
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return parse_config(data)
