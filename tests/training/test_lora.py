"""LoRA: training moves only the adapters, merging equals the wrapped model, the
adapter file round-trips, and a checkpoint resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from opencomposer.training.lora import (
    LoraConfig,
    LoraError,
    apply_lora,
    merge_adapter,
    merged_state_dict,
    save_adapter,
)
from opencomposer.training.rollouts import Sample
from opencomposer.training.trainer import Trainer, TrainerConfig, tiny_llama


def _samples(n: int = 4) -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, 64, (12,), generator=g).tolist()
        out.append(
            Sample(input_ids=tokens, mask=[0] * 4 + [1] * 8, old_logprobs=[0.0] * 12, advantage=1.0)
        )
    return out


def test_only_adapters_train_and_merged_weights_match_the_wrapped_model():
    base = tiny_llama(seed=0)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    tr = Trainer(base, TrainerConfig(lr=5e-2, precision="fp32", lora_rank=4, lora_alpha=8))
    trainable = [n for n, p in tr.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    for _ in range(3):
        tr.sft_step(_samples())
    merged = dict(tr.named_weights(torch.float32))
    assert set(merged) == set(before)  # plain HF names, no wrapper names
    changed = [k for k in before if not torch.equal(merged[k], before[k])]
    assert changed and all(k.endswith("_proj.weight") for k in changed)
    # A plain model with the merged weights computes what the wrapped one does.
    plain = tiny_llama(seed=0)
    plain.load_state_dict(merged)
    x = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        want = tr.model(x).logits
        got = plain(x).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_adapter_file_merges_into_the_base_and_refuses_other_weights(tmp_path):
    model = tiny_llama(seed=0)
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, LoraConfig(rank=2, alpha=4))
    for name, p in model.named_parameters():
        if name.endswith("lora_b"):
            torch.nn.init.normal_(p, std=0.1)
    save_adapter(model, tmp_path / "a")
    merged = merge_adapter(base_state, tmp_path / "a")
    want = merged_state_dict(model)
    for k, v in want.items():
        torch.testing.assert_close(merged[k], v, rtol=1e-5, atol=1e-6)
    other = {k: v + 1.0 for k, v in base_state.items()}
    with pytest.raises(LoraError, match="other base weights"):
        merge_adapter(other, tmp_path / "a")
    with pytest.raises(LoraError, match="no adapter"):
        merge_adapter(base_state, tmp_path / "missing")


def _adapter(model, folder: Path, *, rank: int, seed: int) -> None:
    """A LoRA adapter of ``rank`` on ``model`` with random (non-zero) weights, saved."""
    apply_lora(model, LoraConfig(rank=rank, alpha=2.0 * rank))
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(("lora_a", "lora_b")):
            p.data = torch.randn(p.shape, generator=g) * 0.1
    save_adapter(model, folder)


def test_two_adapters_stack_into_one_for_the_base(tmp_path):
    """An adapter trained on a policy that already folds one in ships as one adapter of
    the summed rank for the untrained weights: folding it in gives what folding in the
    two in turn gives."""
    from opencomposer.agent.backends.adapter import (
        ADAPTER_CONFIG,
        ADAPTER_WEIGHTS,
        fingerprint,
        stack_adapters,
    )
    from safetensors.torch import save_file

    base = {k: v.clone() for k, v in tiny_llama(seed=0).state_dict().items()}
    first = tiny_llama(seed=0)
    _adapter(first, tmp_path / "a", rank=2, seed=1)
    shipped = merge_adapter(base, tmp_path / "a")
    second = tiny_llama(seed=0)
    second.load_state_dict(shipped)
    _adapter(second, tmp_path / "b", rank=3, seed=2)
    want = merge_adapter(shipped, tmp_path / "b")

    meta, tensors = stack_adapters(base, tmp_path / "a", tmp_path / "b")
    assert meta["rank"] == 5 and meta["alpha"] == 5.0
    layers = sorted({k.rpartition(".")[0] for k in tensors})
    assert meta["base_fingerprint"] == fingerprint(base, [f"{x}.weight" for x in layers])
    (tmp_path / "ab").mkdir()
    save_file(tensors, str(tmp_path / "ab" / ADAPTER_WEIGHTS))
    (tmp_path / "ab" / ADAPTER_CONFIG).write_text(json.dumps(meta))
    got = merge_adapter(base, tmp_path / "ab")
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5)
    # the second adapter was not trained on the base: not stacked the other way round
    with pytest.raises(LoraError, match="other base weights"):
        stack_adapters(base, tmp_path / "b", tmp_path / "a")


def test_ship_onto_the_shipped_policy_stacks_the_adapters(tmp_path):
    from opencomposer.agent.backends.adapter import merge_adapter as fold
    from opencomposer.training.ship import ShipError, ship
    from safetensors.torch import save_file

    base = {k: v.clone() for k, v in tiny_llama(seed=0).state_dict().items()}
    weights = tmp_path / "base"
    weights.mkdir()
    save_file(base, str(weights / "model.safetensors"))
    dest = tmp_path / "shipped"
    _adapter(tiny_llama(seed=0), dest, rank=2, seed=1)
    (dest / "model_card.json").write_text(json.dumps({"stages": [{"run": "runs/old"}]}))
    policy = tiny_llama(seed=0)
    policy.load_state_dict(fold(base, dest))
    run = tmp_path / "run"
    _adapter(policy, run / "checkpoints" / "step_4", rank=3, seed=2)
    want = fold(fold(base, dest), run / "checkpoints" / "step_4")
    # shipped as it stands, it would not fold into the base
    with pytest.raises(ShipError, match="no shipped adapter"):
        ship(run, dest=tmp_path / "nothing", onto_shipped=True, base_weights=weights)
    card = ship(run, dest=dest, onto_shipped=True, base_weights=weights)
    assert card["adapter"]["rank"] == 5
    assert [st["run"] for st in card["stages"]][0] == "runs/old" and len(card["stages"]) == 2
    got = fold(base, dest)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5)


def test_no_matching_layer_is_an_error():
    with pytest.raises(LoraError, match="no linear layer"):
        apply_lora(tiny_llama(), LoraConfig(rank=2, targets=("nothing",)))


def test_checkpoint_resumes_the_adapters_exactly(tmp_path):
    cfg = TrainerConfig(lr=5e-2, precision="fp32", lora_rank=4)
    a = Trainer(tiny_llama(seed=0), cfg)
    a.sft_step(_samples())
    a.save(tmp_path / "ck")
    # the adapter beside, not among, the model's weights: vLLM loads every *.safetensors
    assert (tmp_path / "ck" / "adapter" / "adapter.safetensors").is_file()
    assert [p.name for p in (tmp_path / "ck").glob("*.safetensors")] == ["model.safetensors"]
    b = Trainer(tiny_llama(seed=0), cfg)
    b.load(tmp_path / "ck")
    for s in (a, b):
        s.sft_step(_samples(2))
    wa, wb = dict(a.named_weights(torch.float32)), dict(b.named_weights(torch.float32))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)


def test_the_embedded_config_trains_adapters_on_the_corpus():
    from pathlib import Path

    from opencomposer.training.config import load_config
    from opencomposer.training.rl import trainer_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "embedded.toml")
    assert cfg.tasks.suite == "corpus:train" and cfg.model.path == "smollm2-base"
    assert cfg.rollout.max_turns == 8 and cfg.sft.source == "demos"
    assert trainer_config(cfg).lora_rank == cfg.optim.lora_rank > 0


def test_ship_copies_the_adapter_and_writes_the_card(tmp_path):
    import json

    from opencomposer.training.ship import ShipError, ship

    run = tmp_path / "run"
    tr = Trainer(tiny_llama(seed=0), TrainerConfig(lr=5e-2, precision="fp32", lora_rank=2))
    tr.sft_step(_samples())
    tr.save(run / "checkpoints" / "step_0")
    tr.sft_step(_samples())
    tr.save(run / "checkpoints" / "step_2")
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "phase": "warmup1", "time": 100.0, "train_s": 3.0}\n'
        '{"step": 2, "time": 160.0, "rollout_s": 40.0, "train_s": 5.0}\n'
    )
    held = tmp_path / "heldout.json"
    held.write_text('{"models": {"base": {"resolve_rate": 0.0}}}')
    from opencomposer.agent.traces import TraceStore

    store = TraceStore(run / "demos.db")
    for i, ok in enumerate((True, True, False)):
        store.start_session(f"s{i}", workspace=tmp_path, model="scripted", sampling={}, query="q")
        store.set_meta(f"s{i}", source="demo", accepted=ok, task_id=f"t{i}")
    store.close()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "report.json").write_text(
        json.dumps(
            {
                "manifest_sha256": "abc",
                "totals": {"tasks": 50},
                "projects": [
                    {"name": "b", "split": "train", "status": "built"},
                    {"name": "a", "split": "train", "status": "built"},
                    {"name": "h", "split": "heldout", "status": "built"},
                    {"name": "s", "split": "train", "status": "skipped"},
                ],
            }
        )
    )
    card = ship(run, heldout=held, dest=tmp_path / "shipped", corpus=corpus)
    assert card["demonstrations"] == {"recorded": 3, "accepted": 2}
    assert card["corpus"]["train_projects"] == ["a", "b"]
    assert card["corpus"]["heldout_projects"] == ["h"] and card["corpus"]["totals"]["tasks"] == 50
    assert card["checkpoint"] == "step_2" and card["wall_s"] == 60.0
    assert card["phases"] == {
        "warmup1": {"steps": 1, "seconds": 3.0},
        "rl": {"steps": 1, "seconds": 45.0},
    }
    assert card["heldout"]["models"]["base"]["resolve_rate"] == 0.0
    assert len(card["corpus_manifest"]["sha256"]) == 16 and "[sft]" in card["config"]["text"]
    on_disk = json.loads((tmp_path / "shipped" / "model_card.json").read_text())
    assert on_disk["adapter"]["sha256"] == card["adapter"]["sha256"]
    assert (tmp_path / "shipped" / "adapter.safetensors").is_file()
    with pytest.raises(ShipError, match="no checkpoint with a LoRA adapter"):
        ship(tmp_path / "empty", dest=tmp_path / "x")


def test_the_card_lists_every_stage_that_trained_the_shipped_checkpoint(tmp_path):
    """Checkpoints record the one their run started from (`[sft] init`); the card
    follows that chain, and `earlier` where a checkpoint predates the record."""
    import json
    from types import SimpleNamespace

    from opencomposer.training.sft import load_init
    from opencomposer.training.ship import ship

    def stage(
        name: str,
        step: int,
        init: Path | None = None,
        record: bool = True,
        config: dict | None = None,
    ) -> Path:
        tr = Trainer(tiny_llama(seed=0), TrainerConfig(lr=5e-2, precision="fp32", lora_rank=2))
        if init is not None:
            cfg = SimpleNamespace(sft=SimpleNamespace(init=str(init)))
            load_init(SimpleNamespace(config=cfg, trainer=tr))
        tr.sft_step(_samples())
        if not record:
            tr.init_from = None
        run = tmp_path / name
        (run / "metrics.jsonl").parent.mkdir(parents=True)
        rows = [
            {"step": i + 1, "phase": "sft", "time": 10.0 * i, "train_s": 2.0} for i in range(step)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "config.json").write_text(json.dumps(config or {"name": name}))
        return tr.save(run / "checkpoints" / f"step_{step}")

    old = stage("old", 3)
    first = stage("first", 2, init=old, record=False)  # saved before checkpoints said
    last = stage("last", 4, init=first)
    resumed = Trainer(tiny_llama(seed=0), TrainerConfig(lr=5e-2, precision="fp32", lora_rank=2))
    resumed.load(last)
    assert resumed.init_from == str(first)  # a resumed run keeps saying where it started

    conf = tmp_path / "old.toml"
    conf.write_text("[sft]\nlr = 1\n")
    card = ship(tmp_path / "last", dest=tmp_path / "shipped", earlier=[(old, conf)])
    assert [(s["run"], s["checkpoint"]) for s in card["stages"]] == [
        (str(tmp_path / "old"), "step_3"),
        (str(tmp_path / "first"), "step_2"),
        (str(tmp_path / "last"), "step_4"),
    ]
    assert card["stages"][0]["config"]["text"] == "[sft]\nlr = 1\n"
    assert json.loads(card["stages"][1]["config"]["text"]) == {"name": "first"}
    assert card["stages"][2]["config"] == card["config"]
    assert card["stages"][1]["phases"] == {"sft": {"steps": 2, "seconds": 4.0}}
    assert card["total"] == {"steps": 9, "seconds": 18.0}
    # without `earlier`, the chain ends where the record does
    assert len(ship(tmp_path / "last", dest=tmp_path / "s2")["stages"]) == 2
    # a checkpoint without the record: its run's config names where it started
    stage("cfg", 1, init=first, record=False, config={"sft": {"init": str(first)}})
    card = ship(tmp_path / "cfg", dest=tmp_path / "s3", earlier=[(old, conf), (first, None)])
    assert [s["run"] for s in card["stages"]] == [
        str(tmp_path / n) for n in ("old", "first", "cfg")
    ]


def test_sft_init_continues_from_a_checkpoint(tmp_path, monkeypatch):
    """`[sft] init`: one more epoch starts from an earlier run's adapters and optimizer."""
    import asyncio
    from types import SimpleNamespace

    from opencomposer.training import sft as sftmod
    from opencomposer.training.config import ConfigError, SftSection
    from opencomposer.training.lora import adapter_state

    data = SimpleNamespace(samples=_samples(), sessions_used=4, sessions_skipped=0)
    first = Trainer(tiny_llama(seed=0), TrainerConfig(lr=5e-2, precision="fp32", lora_rank=2))
    first.sft_step(data.samples)
    first.save(tmp_path / "first" / "step_1")

    async def samples(run):
        return data

    monkeypatch.setattr(sftmod, "trace_samples", samples)

    def run_with(init: str) -> Trainer:
        tr = Trainer(tiny_llama(seed=0), TrainerConfig(lr=5e-2, precision="fp32", lora_rank=2))
        sft = SftSection(source="traces", init=init, epochs=1, lr=0.0, micro_batch_size=4)
        cfg = SimpleNamespace(sft=sft, run=SimpleNamespace(seed=0))
        asyncio.run(
            sftmod.run_sft(SimpleNamespace(config=cfg, out=tmp_path / init[-6:], trainer=tr))
        )
        return tr

    tr = run_with(str(tmp_path / "first" / "step_1"))  # lr 0: the step keeps the loaded adapters
    assert tr.version == 2
    for name, t in adapter_state(first.model).items():
        assert torch.equal(adapter_state(tr.model)[name], t)
    with pytest.raises(ConfigError, match="not a checkpoint folder"):
        run_with(str(tmp_path / "absent"))


def test_an_interrupted_sft_resumes_from_its_mid_round_checkpoint(tmp_path, monkeypatch, capsys):
    """`--sft` killed mid-epoch: the rerun restores the last `sft_resume` checkpoint and
    takes only the steps after it, ending exactly where an uninterrupted run ends; a
    different set of samples starts over."""
    import asyncio
    from types import SimpleNamespace

    from opencomposer.training import sft as sftmod
    from opencomposer.training.config import SftSection
    from opencomposer.training.lora import adapter_state

    data = SimpleNamespace(samples=_samples(8), sessions_used=8, sessions_skipped=0)

    async def samples(run):
        return data

    monkeypatch.setattr(sftmod, "trace_samples", samples)
    sft = SftSection(source="traces", epochs=1, lr=5e-2, micro_batch_size=1, checkpoint_every=3)
    cfg = SimpleNamespace(sft=sft, run=SimpleNamespace(seed=0))

    def trainer() -> Trainer:
        return Trainer(tiny_llama(seed=0), TrainerConfig(lr=5e-2, precision="fp32", lora_rank=2))

    def run(out: Path, tr: Trainer) -> Trainer:
        asyncio.run(sftmod.run_sft(SimpleNamespace(config=cfg, out=out, trainer=tr)))
        return tr

    whole = run(tmp_path / "whole", trainer())

    class Killed(Exception):
        pass

    doomed = trainer()
    step = doomed.sft_step
    calls = {"n": 0}

    def dies_at_five(batch, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            raise Killed
        return step(batch, **kw)

    doomed.sft_step = dies_at_five  # type: ignore[method-assign]
    out = tmp_path / "cut"
    with pytest.raises(Killed):
        run(out, doomed)
    assert (out / "checkpoints" / "sft_resume").is_dir()
    capsys.readouterr()

    again = trainer()
    taken = {"n": 0}
    step2 = again.sft_step

    def counted(batch, **kw):
        taken["n"] += 1
        return step2(batch, **kw)

    again.sft_step = counted  # type: ignore[method-assign]
    run(out, again)
    assert "resumed after step 3 of 8" in capsys.readouterr().out
    assert taken["n"] == 5  # steps 4..8, not all eight
    for name, t in adapter_state(whole.model).items():
        assert torch.allclose(adapter_state(again.model)[name], t, atol=1e-6), name
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["seq_tokens"] >= r["train_tokens"] > 0 for r in rows)  # what each step ran
    assert (out / "checkpoints" / "step_8").is_dir()
    assert not (out / "checkpoints" / "sft_resume").exists()

    # Other samples are another round: nothing is resumed from a stale checkpoint.
    doomed2 = trainer()
    calls["n"] = 0
    step = doomed2.sft_step
    doomed2.sft_step = dies_at_five  # type: ignore[method-assign]
    with pytest.raises(Killed):
        run(out, doomed2)
    data.samples = _samples(8)[::-1]
    run(out, trainer())
    assert "resumed" not in capsys.readouterr().out


def test_the_shipped_policy_carries_its_turn_budget_into_the_embedded_folder(tmp_path, monkeypatch):
    """`ship` writes the policy's settings beside its adapter (the turn budget its
    episodes were trained to fit); `smollm2` merges them into the folder it loads."""
    import json

    from opencomposer.agent.backends import smollm2
    from opencomposer.agent.backends._local import (
        read_prompt_style,
        read_repair,
        read_turn_budget,
    )
    from opencomposer.training.ship import ship
    from safetensors.torch import save_file

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    base = tiny_llama(seed=0).state_dict()

    def convert(source: Path, out: Path) -> None:
        save_file(
            {k: v.clone().contiguous() for k, v in base.items()}, str(out / "model.safetensors")
        )
        (out / "config.json").write_text("{}")
        (out / smollm2._MARKER).write_text(json.dumps({"format_version": smollm2.FORMAT_VERSION}))

    monkeypatch.setattr(smollm2, "_convert", convert)
    monkeypatch.setattr(smollm2, "gguf_path", lambda: tmp_path / "model.gguf")
    dest = tmp_path / "shipped"
    monkeypatch.setattr(smollm2, "ADAPTER_DIR", dest)

    tr = Trainer(tiny_llama(seed=0), TrainerConfig(lr=5e-2, precision="fp32", lora_rank=2))
    tr.prompt_style, tr.max_turns = "compact", 8
    tr.sft_step(_samples())
    tr.save(tmp_path / "run" / "checkpoints" / "step_1")
    assert ship(tmp_path / "run", dest=dest)["settings"] == {
        "prompt_style": "compact",
        "max_turns": 8,
    }
    folder = smollm2.smollm2_path()
    assert folder.name.startswith(f"{smollm2.FOLDER_NAME}-trained-")
    assert read_turn_budget(folder) == 8 and read_prompt_style(folder) == "compact"
    assert read_turn_budget(smollm2.smollm2_path(base=True)) is None

    # a checkpoint saved before checkpoints recorded it: the run's config gives it
    tr.max_turns = None
    tr.save(tmp_path / "old" / "checkpoints" / "step_1")
    (tmp_path / "old" / "config.json").write_text(json.dumps({"rollout": {"max_turns": 6}}))
    assert ship(tmp_path / "old", dest=dest)["settings"]["max_turns"] == 6
    assert smollm2.smollm2_path() != folder  # new settings: merged anew
    assert read_turn_budget(smollm2.smollm2_path()) == 6

    # how sessions use the shipped policy carries over to the next one shipped there
    settings = json.loads((dest / "opencomposer.json").read_text())
    (dest / "opencomposer.json").write_text(json.dumps({**settings, "repair": True}))
    assert ship(tmp_path / "run", dest=dest)["settings"] == {
        "prompt_style": "compact",
        "max_turns": 8,
        "repair": True,
    }
    assert read_repair(smollm2.smollm2_path())
