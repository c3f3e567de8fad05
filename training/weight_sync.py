"""Weight sync: new trainer weights into the running sampler, with a version.

The sampler is never restarted. Every turn it samples records the weight version
it was sampled with (``TurnOutput.weight_version``), so training can measure
staleness per turn and detect a sampler that lags.

Transports:

- **CPU, in-process** (this machine): the trainer and the vLLM engine live in one
  process; ``WeightSync.push`` hands the trainer's named tensors, cast to the
  dtype the sampler holds (``WeightSync.dtype``: fp32 for an fp32 engine, so a small
  update is not rounded away on the way, else bf16), to the
  backend's ``reload_weights(weights, version)`` — vLLM 0.32's
  ``model_runner.reload_weights`` through ``LLM.collective_rpc``; for the
  ``transformers`` fallback or tests, ``ModuleReceiver`` copies into a module.
- **GPU** (designed, gated on CUDA, not exercised here): vLLM's weight-transfer
  engine. The engine is created with ``weight_transfer_config={"backend":
  "nccl"}``; the trainer process opens an NCCL group with the inference workers
  through ``NCCLTrainerWeightTransferEngine.trainer_init(NCCLTrainerInitInfo(
  master_address, master_port, world_size=1 + tp_size), client=…,
  source=ModuleSource(model))`` (client: ``RayVLLMWeightSyncClient`` for an
  engine actor, or the in-process ``LLMClient`` below), and each sync is one
  ``send_weights()`` — a packed NCCL broadcast from GPU memory, with
  ``finish_weight_update(weight_version=…)`` stamping the version engine-side.
  ``NcclTransport`` wraps that; ``WeightSync`` uses it when given one.

- **Many replicas** (``[cluster]``, ``training/cluster.py``): ``ReplicaSet`` is the
  receiver; trainer rank 0 sends a delta of the bf16 weights (or them whole) through
  Ray's object store to every sampler replica under one version, and the versions
  are read back (a disagreement is ``SamplerLagError``). ``benchmarks/cluster.py
  --gpu`` drives the NCCL path above into replica actors (vLLM's weight-transfer
  RPCs, forwarded by ``SamplerReplica``).

Abort/resume of partial rollouts: ``VersionedModel`` wraps the sampler model.
While weights are being replaced no new turn starts; a turn that was generating
when new weights arrived is (with ``abort_in_flight``) cancelled and generated
again under the new weights — the rollout resumes from its last finished turn
instead of being thrown away. To make that invisible to the session, such turns
are buffered and released whole.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from opencomposer.agent.protocols import Message, Model, Sampling, TurnOutput

Weights = Iterable[tuple[str, torch.Tensor]]


class WeightReceiver(Protocol):
    """``VLLMModel`` is one (its ``reload_weights`` is a coroutine); so is ``ModuleReceiver``.
    A receiver may also say which dtype it holds its weights in (``weight_dtype``, a
    torch dtype or its name); ``WeightSync.dtype`` reads it."""

    weight_version: int

    def reload_weights(self, weights: Weights, version: int) -> Any: ...


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class SamplerLagError(RuntimeError):
    """The sampler's weight version is behind the trainer's after a sync."""


class ModuleReceiver:
    """An in-process torch module as the sampler (the ``hf:`` backend, tests).

    ``module`` is the module or a function returning it (the ``hf:`` backend loads
    its model lazily)."""

    def __init__(self, module: torch.nn.Module | Any) -> None:
        self._module = module
        self.weight_version = 0

    @property
    def module(self) -> torch.nn.Module:
        m = self._module
        return m if isinstance(m, torch.nn.Module) else m()

    @property
    def weight_dtype(self) -> torch.dtype | None:
        """The dtype of the module's first parameter; None while it is not loaded."""
        module = self.module
        first = next(module.parameters(), None) if module is not None else None
        return None if first is None else first.dtype

    def reload_weights(self, weights: Weights, version: int) -> None:
        state = self.module.state_dict()
        with torch.no_grad():
            for name, t in weights:
                if name in state:
                    state[name].copy_(t.to(state[name].dtype))
        self.weight_version = version


@dataclass(kw_only=True)
class SyncResult:
    version: int
    seconds: float
    lag: int  # trainer version - sampler version after the sync (0 when healthy)


class WeightSync:
    """Pushes the trainer's weights to a receiver and checks the version landed."""

    def __init__(
        self, receiver: WeightReceiver, *, max_lag: int = 0, transport: Any = None
    ) -> None:
        self.receiver = receiver
        self.max_lag = max_lag
        self.transport = transport  # e.g. NcclTransport on a GPU

    @property
    def dtype(self) -> torch.dtype:
        """The dtype to send weights in: the receiver's own, else bf16. Sent as bf16,
        an fp32 sampler would run a rounding of the trained weights (an update smaller
        than half of bf16's step, ~0.2 % of a weight, would not reach it until later
        steps added to it), and the logprobs it samples with, the importance ratio's
        denominator, would not be the trained policy's."""
        return torch_dtype(getattr(self.receiver, "weight_dtype", None)) or torch.bfloat16

    async def push(self, weights: Weights, version: int) -> SyncResult:
        t0 = time.perf_counter()
        if self.transport is not None:
            await asyncio.to_thread(self.transport.send, version)
        else:
            await _maybe_await(self.receiver.reload_weights(weights, version))
        seconds = time.perf_counter() - t0
        landed = int(getattr(self.receiver, "weight_version", version) or 0)
        lag = check_lag(landed, version, max_lag=self.max_lag)
        return SyncResult(version=version, seconds=seconds, lag=lag)


def torch_dtype(value: Any) -> torch.dtype | None:
    """A torch dtype from a dtype or its name (vLLM's ``dtype`` argument: "bfloat16",
    "float32", "half", …); None for anything else (``"auto"``, None)."""
    found = getattr(torch, value, None) if isinstance(value, str) else value
    return found if isinstance(found, torch.dtype) else None


def check_lag(sampler_version: int | None, trainer_version: int, *, max_lag: int) -> int:
    """The lag of a sampler version behind the trainer; raises SamplerLagError above ``max_lag``."""
    if sampler_version is None:
        return 0
    lag = trainer_version - sampler_version
    if lag > max_lag:
        raise SamplerLagError(
            f"sampler is at weight version {sampler_version}, trainer at {trainer_version} "
            f"(allowed lag {max_lag})"
        )
    return lag


# -- abort/resume of in-flight turns ---------------------------------------------------


class VersionedModel:
    """A ``Model`` wrapper that stamps versions and pauses/aborts turns around updates.

    ``update(fn)`` runs ``fn()`` (the actual reload) while no turn starts; turns that
    were generating are restarted under the new weights when ``abort_in_flight``.
    """

    def __init__(
        self, inner: Model, receiver: WeightReceiver | None = None, *, abort_in_flight: bool = True
    ):
        self.inner = inner
        self.receiver = receiver if receiver is not None else inner  # type: ignore[assignment]
        self.name = inner.name
        if hasattr(inner, "prompt_style"):  # the agent picks the system prompt by it
            self.prompt_style = inner.prompt_style
        self.context_window = inner.context_window
        self.abort_in_flight = abort_in_flight
        self.version = int(getattr(self.receiver, "weight_version", 0) or 0)
        self._open = asyncio.Event()
        self._open.set()
        self._streams: set[_VersionedStream] = set()
        self.aborted_turns = 0

    @property
    def weight_version(self) -> int:
        return self.version

    @property
    def weight_dtype(self) -> Any:
        return getattr(self.receiver, "weight_dtype", None)

    async def reload_weights(self, weights: Weights, version: int) -> None:
        """The receiver side of ``WeightSync``: pause, reload, abort stale turns, resume."""
        self._open.clear()
        try:
            await _maybe_await(self.receiver.reload_weights(weights, version))
            self.version = int(getattr(self.receiver, "weight_version", version) or version)
            if self.abort_in_flight:
                for s in list(self._streams):
                    s.abort()
        finally:
            self._open.set()

    def stream(self, messages: list[Message], sampling: Sampling) -> _VersionedStream:
        return _VersionedStream(self, messages, sampling)

    def count_tokens(self, text: str) -> int:
        return self.inner.count_tokens(text)

    async def start(self) -> None:
        """Start the engine now (outside any episode's time limit)."""
        start = getattr(self.inner, "start", None)
        if start is not None:
            await start()

    async def close(self) -> None:
        await self.inner.close()


class _VersionedStream:
    def __init__(self, owner: VersionedModel, messages: list[Message], sampling: Sampling) -> None:
        self.owner = owner
        self.messages = messages
        self.sampling = sampling
        self.output: TurnOutput | None = None
        self._aborted = False
        self._inner: Any = None

    def abort(self) -> None:
        self._aborted = True
        self.owner.aborted_turns += 1

    async def _generate(self) -> tuple[str, TurnOutput | None]:
        while True:
            await self.owner._open.wait()
            self._aborted = False
            version = self.owner.version
            self._inner = self.owner.inner.stream(self.messages, self.sampling)
            self.owner._streams.add(self)
            parts: list[str] = []
            try:
                async for delta in self._inner:
                    parts.append(delta)
                    if self._aborted:
                        break
            finally:
                self.owner._streams.discard(self)
            if self._aborted:
                await self._inner.aclose()
                continue  # resume: this turn again, under the new weights
            out = self._inner.output
            if out is not None and out.weight_version is None:
                out.weight_version = version
            return "".join(parts), out

    async def _iter(self) -> AsyncIterator[str]:
        text, self.output = await self._generate()
        if text:
            yield text

    def __aiter__(self) -> AsyncIterator[str]:
        return self._iter()

    async def aclose(self) -> None:
        if self._inner is not None:
            await self._inner.aclose()


# -- GPU transport (designed; needs CUDA and a vLLM engine built with weight_transfer_config) --


class LLMClient:
    """vLLM's weight-sync client protocol over an in-process ``LLM`` (``collective_rpc``)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def _engine(self) -> Any:
        return self.llm.llm_engine

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.collective_rpc("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.collective_rpc("finish_weight_update", kwargs={"weight_version": weight_version})


class NcclTransport:
    """Trainer-side NCCL broadcast into vLLM workers (GPU only; see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        client: Any,
        *,
        master_address: str = "127.0.0.1",
        master_port: int = 29555,
        world_size: int = 2,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the NCCL weight transport needs a CUDA device; on CPU use in-process sync"
            )
        from vllm.distributed.weight_transfer import ModuleSource
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        info = NCCLTrainerInitInfo(
            master_address=master_address, master_port=master_port, world_size=world_size
        )
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(
            info, client=client, source=ModuleSource(model)
        )
        self.client = client

    def send(self, version: int) -> None:
        # start_weight_update, the broadcast and finish_weight_update in one call;
        # the version is stamped trainer-side by VersionedModel.
        self.engine.send_weights()
