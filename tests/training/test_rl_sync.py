"""Weight sync: weights and versions land in the sampler, lag is detected, and turns
interrupted by new weights are regenerated under them (abort/resume)."""

import asyncio

import pytest
import torch
from opencomposer.agent.backends._stream import TaskStream
from opencomposer.agent.protocols import Message, Sampling
from opencomposer.training.weight_sync import (
    ModuleReceiver,
    SamplerLagError,
    VersionedModel,
    WeightSync,
    check_lag,
    torch_dtype,
)


class SlowTokenModel:
    """Streams `n` tokens, one per `delay` s, with ids and logprobs; counts starts."""

    name = "slow"
    context_window = 1024

    def __init__(self, n: int = 5, delay: float = 0.02):
        self.n, self.delay, self.starts = n, delay, 0

    def stream(self, messages, sampling):
        self.starts += 1

        async def produce(out, emit):
            out.prompt_token_ids, out.completion_token_ids, out.completion_logprobs = [1, 2], [], []
            for i in range(self.n):
                await asyncio.sleep(self.delay)
                out.completion_token_ids.append(10 + i)
                out.completion_logprobs.append(-0.5)
                emit(f"t{i} ")

        return TaskStream(produce)

    def count_tokens(self, text):
        return len(text) // 4

    async def close(self):
        pass


class IgnoringReceiver:
    """A sampler whose reload silently does nothing: its version lags."""

    weight_version = 0

    def reload_weights(self, weights, version):
        pass


async def test_push_copies_weights_and_version():
    src, dst = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    rx = ModuleReceiver(dst)
    res = await WeightSync(rx).push(src.state_dict().items(), 7)
    assert rx.weight_version == 7 and res.lag == 0 and res.seconds >= 0
    assert torch.equal(dst.weight, src.weight)


async def test_weights_go_out_in_the_dtype_the_sampler_holds():
    fp32, bf16 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).to(torch.bfloat16)
    assert WeightSync(ModuleReceiver(fp32)).dtype == torch.float32
    assert WeightSync(VersionedModel(SlowTokenModel(n=1), ModuleReceiver(bf16))).dtype == (
        torch.bfloat16
    )
    assert WeightSync(IgnoringReceiver()).dtype == torch.bfloat16  # says nothing: bf16
    assert WeightSync(ModuleReceiver(lambda: None)).dtype == torch.bfloat16  # not loaded yet
    assert torch_dtype("float32") == torch.float32 and torch_dtype("auto") is None
    # an update below bf16's step reaches an fp32 sampler whole
    src = torch.nn.Linear(2, 2)
    with torch.no_grad():
        src.weight.fill_(1.0 + 2**-12)
    sync = WeightSync(ModuleReceiver(fp32))
    await sync.push(((k, v.to(sync.dtype)) for k, v in src.state_dict().items()), 1)
    assert torch.equal(fp32.weight, src.weight)


async def test_lagging_sampler_is_detected():
    with pytest.raises(SamplerLagError, match="sampler is at weight version 0, trainer at 3"):
        await WeightSync(IgnoringReceiver()).push([], 3)
    assert check_lag(2, 3, max_lag=1) == 1
    with pytest.raises(SamplerLagError):
        check_lag(1, 3, max_lag=1)


async def test_turn_interrupted_by_new_weights_is_regenerated_under_them():
    inner = SlowTokenModel(n=6, delay=0.03)
    model = VersionedModel(inner, ModuleReceiver(torch.nn.Linear(2, 2)))
    stream = model.stream([Message(role="user", content="hi")], Sampling())

    async def consume():
        return "".join([d async for d in stream])

    turn = asyncio.ensure_future(consume())
    await asyncio.sleep(0.08)  # mid-turn
    await model.reload_weights(torch.nn.Linear(2, 2).state_dict().items(), 1)
    text = await turn
    assert text == "t0 t1 t2 t3 t4 t5 "
    assert stream.output.weight_version == 1  # the whole turn comes from the new weights
    assert stream.output.completion_token_ids == [10, 11, 12, 13, 14, 15]
    assert model.aborted_turns == 1 and inner.starts == 2


async def test_turns_finished_before_a_sync_keep_their_version():
    model = VersionedModel(SlowTokenModel(n=2, delay=0.0), ModuleReceiver(torch.nn.Linear(2, 2)))
    s = model.stream([Message(role="user", content="hi")], Sampling())
    _ = [d async for d in s]
    await model.reload_weights([], 4)
    assert s.output.weight_version == 0 and model.weight_version == 4
