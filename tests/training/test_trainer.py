"""The trainer on a tiny random Llama: steps move weights, NaN steps do not, resume is exact."""

import math

import pytest
import torch
from opencomposer.training.loss import LossConfig
from opencomposer.training.rollouts import Rollout, Sample, Turn, samples_from_rollout
from opencomposer.training.trainer import Trainer, TrainerConfig, latest_checkpoint, tiny_llama


def samples(n: int = 4) -> list[Sample]:
    out = []
    for i in range(n):
        ids = [1 + (i + j) % 60 for j in range(6 + i)]
        mask = [0, 0, 0] + [1] * (len(ids) - 3)
        out.append(
            Sample(
                input_ids=ids,
                mask=mask,
                old_logprobs=[-4.0] * len(ids),
                advantage=1.0 if i % 2 else -1.0,
            )
        )
    return out


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_step_changes_weights_and_bumps_version():
    tr = Trainer(tiny_llama(), TrainerConfig(lr=1e-2, micro_batch_size=2))
    before = params(tr.model)
    stats = tr.step(samples())
    assert stats["skipped"] == 0 and tr.version == 1
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0 and stats["entropy"] > 0
    assert stats["train_tokens"] == sum(len(s.input_ids) - 3 for s in samples())
    after = params(tr.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_gradient_accumulation_matches_one_big_batch():
    a = Trainer(tiny_llama(), TrainerConfig(lr=1e-2, micro_batch_size=1, precision="fp32"))
    b = Trainer(tiny_llama(), TrainerConfig(lr=1e-2, micro_batch_size=4, precision="fp32"))
    sa, sb = a.step(samples()), b.step(samples())
    assert sa["loss"] == pytest.approx(sb["loss"], rel=1e-4)
    assert sa["grad_norm"] == pytest.approx(sb["grad_norm"], rel=1e-4)


def test_nan_loss_skips_the_step_and_keeps_weights():
    tr = Trainer(tiny_llama(), TrainerConfig(lr=1e-2))
    before = params(tr.model)
    bad = samples()
    bad[0].advantage = float("nan")
    stats = tr.step(bad)
    assert stats["skipped"] == 1 and tr.version == 0
    after = params(tr.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert tr.step(samples())["skipped"] == 0 and tr.version == 1  # training goes on


def test_checkpoint_resume_is_exact(tmp_path):
    cfg = TrainerConfig(lr=1e-2, precision="fp32", loss=LossConfig())
    a = Trainer(tiny_llama(), cfg)
    a.step(samples())
    a.save(tmp_path / "checkpoints" / "step_1", extra={"scheduler": 7})
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_1"
    b = Trainer(tiny_llama(seed=1), cfg)
    assert b.load(tmp_path / "checkpoints" / "step_1") == {"scheduler": 7}
    assert b.version == 1 and b.step_count == 1
    a.step(samples())
    b.step(samples())
    pa, pb = params(a.model), params(b.model)
    assert all(torch.allclose(pa[k], pb[k]) for k in pa)


def test_incomplete_checkpoint_is_not_resumed(tmp_path):
    (tmp_path / "checkpoints" / "step_3").mkdir(parents=True)
    assert latest_checkpoint(tmp_path) is None


def test_samples_mask_tool_results_and_merge_turns():
    r = Rollout(
        task_id="t",
        turns=[
            Turn(prompt_ids=[1, 2], completion_ids=[3, 4], logprobs=[-0.1, -0.2], weight_version=2),
            # the next prompt extends the sequence by a tool result [7, 8]
            Turn(
                prompt_ids=[1, 2, 3, 4, 7, 8], completion_ids=[5], logprobs=[-0.3], weight_version=3
            ),
            # context trimmed: a new sample starts
            Turn(prompt_ids=[1, 9], completion_ids=[6], logprobs=[-0.4], weight_version=3),
        ],
    )
    s = samples_from_rollout(r, 0.5)
    assert [x.input_ids for x in s] == [[1, 2, 3, 4, 7, 8, 5], [1, 9, 6]]
    assert [x.mask for x in s] == [[0, 0, 1, 1, 0, 0, 1], [0, 0, 1]]
    assert s[0].old_logprobs == [0, 0, -0.1, -0.2, 0, 0, -0.3]
    assert s[0].weight_version == 2 and s[0].advantage == 0.5


def test_masked_position_logprobs_equal_the_full_forward():
    tr = Trainer(tiny_llama(), TrainerConfig(precision="fp32"))
    mb = next(tr._micro_batches(samples(3)))
    lp, ent = tr._logprobs(tr.model, mb)
    logits = tr.model(input_ids=mb["ids"], attention_mask=mb["attn"]).logits[:, :-1]
    full = torch.log_softmax(logits.float(), -1).gather(-1, mb["ids"][:, 1:, None])[..., 0]
    sel = mb["mask"] > 0
    assert torch.allclose(lp[sel], full[sel], atol=1e-5)
    assert torch.all(lp[~sel] == 0) and torch.all(ent[sel] > 0)


def test_mxfp8_precision_trains_through_the_kernels():
    tr = Trainer(tiny_llama(), TrainerConfig(lr=1e-2, precision="mxfp8"))
    stats = tr.step(samples())
    assert stats["skipped"] == 0 and math.isfinite(stats["loss"]) and tr.version == 1


def test_upcycled_moe_model_trains(tmp_path):
    from opencomposer.training.upcycle import upcycle

    tiny_llama().save_pretrained(tmp_path / "dense")
    folder = upcycle(tmp_path / "dense", tmp_path / "moe", num_experts=4, top_k=2)
    tr = Trainer.from_pretrained(folder, TrainerConfig(lr=1e-2, precision="fp32"))
    assert "Mixtral" in type(tr.model).__name__
    before = params(tr.model)
    assert tr.step(samples())["skipped"] == 0
    after = params(tr.model)
    assert any(not torch.equal(before[k], after[k]) for k in before if "experts" in k)


async def test_trainer_work_runs_on_its_one_thread():
    import threading

    tr = Trainer(tiny_llama(), TrainerConfig(lr=1e-2, precision="fp32"))
    names = {await tr.run(lambda: threading.current_thread().name) for _ in range(5)}
    assert len(names) == 1 and names.pop().startswith("trainer")
    assert await tr.run(lambda a, *, b: a + b, 2, b=3) == 5
    with pytest.raises(ZeroDivisionError):
        await tr.run(lambda: 1 / 0)


def test_pruning_keeps_the_newest_and_the_warm_start(tmp_path):
    from opencomposer.training.trainer import STATE_FILE, prune_checkpoints

    for step in (0, 2, 4, 6):
        d = tmp_path / "checkpoints" / f"step_{step}"
        d.mkdir(parents=True)
        (d / STATE_FILE).write_bytes(b"x")
    (tmp_path / "checkpoints" / "step_8").mkdir()  # incomplete: left alone
    gone = prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in gone) == ["step_2"]
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step_0", "step_4", "step_6", "step_8"]


@pytest.mark.parametrize(("native", "computes"), [(True, torch.bfloat16), (False, torch.float32)])
def test_bf16_computes_in_fp32_on_a_cpu_without_native_bf16(monkeypatch, native, computes):
    from opencomposer.index import embed

    monkeypatch.setattr(embed, "cpu_has_bf16", lambda: native)
    tr = Trainer(tiny_llama(), TrainerConfig(lr=1e-2, precision="bf16"))
    assert tr.compute_dtype == ("bf16" if native else "fp32")
    with tr._autocast():
        assert tr.model.lm_head(torch.ones(1, tr.model.config.hidden_size)).dtype == computes
    assert tr.step(samples())["skipped"] == 0  # and it trains
    fp32 = Trainer(tiny_llama(), TrainerConfig(lr=1e-2, precision="fp32"))
    assert fp32.compute_dtype == "fp32"
