"""SFT away from the environment: pack accepted demonstrations (and held-out reference
sessions) into a file, fit it on a trainer, merge the adapter-only checkpoint."""

import json

import pytest
from opencomposer.agent.protocols import TurnOutput
from opencomposer.agent.traces import TraceStore
from opencomposer.training import sft_offline
from opencomposer.training.sft_offline import OfflineError, fit_samples, load_samples, merge, pack


def session(store, sid, ws, *, source, accepted, resolved=None, style="compact"):
    store.start_session(sid, workspace=ws, model="m", sampling={}, query="fix it")
    for turn in range(2):
        out = TurnOutput(
            text="ok",
            prompt_token_ids=[1, 2, 3, 7, 8][: 3 + 2 * turn],
            completion_token_ids=[7, 8] if turn == 0 else [9, 10, 11],
            completion_logprobs=[-0.1, -0.2] if turn == 0 else [-0.1] * 3,
        )
        store.write_turn(
            sid,
            turn,
            messages=[{"role": "user", "content": "fix it"}],
            output=out,
            t_start=0,
            t_end=1,
        )
    store.end_session(sid, status="completed", answer="done", turns=2, tool_calls=1)
    extra = {} if resolved is None else {"resolved": resolved}
    store.set_meta(sid, source=source, accepted=accepted, prompt_style=style, **extra)
    if accepted:
        store.record_decision(sid, "*", "accept")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from opencomposer.training.cluster import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def stores(tmp_path):
    demos, refs = TraceStore(tmp_path / "demos.db"), TraceStore(tmp_path / "ref.db")
    for i in range(6):
        session(demos, f"d{i}", tmp_path, source="demo", accepted=True)
    session(demos, "full-style", tmp_path, source="demo", accepted=True, style="full")
    session(demos, "refused", tmp_path, source="demo", accepted=False)
    session(refs, "r0", tmp_path, source="reference", accepted=False, resolved=True)
    session(refs, "r1", tmp_path, source="reference", accepted=False, resolved=False)
    demos.close()
    refs.close()
    return tmp_path / "demos.db", tmp_path / "ref.db"


def test_pack_keeps_accepted_demonstrations_of_the_style_and_resolved_references(
    tmp_path, stores, model
):
    demos, refs = stores
    summary = pack([demos], tmp_path / "s.npz", model=str(model), validation=refs)
    assert summary["train_sessions"] == 6 and summary["val_sessions"] == 1
    got, train, val = load_samples(tmp_path / "s.npz")
    assert got == summary and len(train) == 6 and len(val) == 1
    # two turns merge into one sample; the loss falls on the completions only
    assert train[0].input_ids == [1, 2, 3, 7, 8, 9, 10, 11]
    assert train[0].mask == [0, 0, 0, 1, 1, 1, 1, 1]


def test_fit_lowers_the_validation_loss_and_merge_makes_a_loadable_folder(tmp_path, stores, model):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    demos, refs = stores
    pack([demos], tmp_path / "s.npz", model=str(model), validation=refs)
    lines: list[str] = []
    ckpt = fit_samples(
        tmp_path / "s.npz",
        str(model),
        tmp_path / "run",
        epochs=3,
        lr=3e-2,
        batch=2,
        lora_rank=4,
        warmup=1,
        adapter_only=True,
        log=lines.append,
    )
    assert ckpt.name == "step_9"
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert rows[0]["lr"] == pytest.approx(3e-2) and rows[-1]["lr"] == pytest.approx(3e-3)
    val = [json.loads(x) for x in (tmp_path / "run" / "validation.jsonl").read_text().splitlines()]
    assert [v["epoch"] for v in val] == [0, 1, 2, 3]
    assert val[-1]["val_loss"] < val[0]["val_loss"]
    assert not (ckpt / "model.safetensors").exists()  # the adapter alone travels
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved == ["step_3", "step_6", "step_9"]  # one adapter an epoch
    settings = json.loads((ckpt / "opencomposer.json").read_text())
    assert settings == {"prompt_style": "compact", "max_turns": 8}
    assert merge(tmp_path / "run", str(model)) == ckpt  # a run folder: its newest
    merged = load_file(str(ckpt / "model.safetensors"))
    base = load_file(str(model / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[name], base[name])
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"])
    AutoModelForCausalLM.from_pretrained(str(ckpt))  # vLLM and the agent load it the same way
    assert (ckpt / "tokenizer.json").is_file()
    # the held-out benchmark measures such a run's checkpoint as SFT, not SFT + RL
    assert heldout_module().run_models(tmp_path / "run") == [("sft", f"vllm:{ckpt}")]


def heldout_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "heldout.py"
    spec = importlib.util.spec_from_file_location("heldout_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pack_weighs_edit_turns_and_leaves_validation_unweighted(tmp_path, model):
    demos, refs = TraceStore(tmp_path / "demos.db"), TraceStore(tmp_path / "ref.db")
    session(demos, "d0", tmp_path, source="demo", accepted=True)
    session(refs, "r0", tmp_path, source="reference", accepted=False, resolved=True)
    for store, sid in ((demos, "d0"), (refs, "r0")):  # the second turn edits
        store.write_call(
            sid, 1, call_id="c1", index=0, name="edit_file", args={"path": "a.py"},
            status="ok", result="edited", t_start=0, t_end=1,
        )  # fmt: skip
    demos.close()
    refs.close()
    out = tmp_path / "s.npz"
    summary = pack(
        [tmp_path / "demos.db"],
        out,
        model=str(model),
        validation=tmp_path / "ref.db",
        edit_weight=3,
    )
    _, (train,), (val,) = load_samples(out)
    assert train.mask == [0, 0, 0, 1, 1, 3, 3, 3]
    assert val.mask == [0, 0, 0, 1, 1, 1, 1, 1]
    assert summary["edit_weight"] == 3 and summary["train_tokens"] == 5  # tokens, not weights
    with pytest.raises(OfflineError, match="--edit-weight must be from 1 to 255"):
        pack([tmp_path / "demos.db"], out, model=str(model), edit_weight=0)


def test_bad_input_is_one_line(tmp_path, stores, model):
    with pytest.raises(OfflineError, match="no such trace store"):
        pack([tmp_path / "absent.db"], tmp_path / "s.npz", model=str(model))
    (tmp_path / "junk.npz").write_bytes(b"not a file")
    with pytest.raises(OfflineError, match="not a samples file"):
        load_samples(tmp_path / "junk.npz")
    with pytest.raises(OfflineError, match="not a model folder"):
        sft_offline.model_dir(str(tmp_path))
    assert sft_offline.main(["pack", "--db", str(tmp_path / "absent.db"), "--out", "x"]) == 2


def test_schedule_warms_up_then_decays_to_a_tenth():
    at = sft_offline.schedule(1.0, total=100, warmup=10)
    assert at(1) == pytest.approx(0.1) and at(10) == pytest.approx(1.0)
    assert at(55) == pytest.approx(0.55) and at(100) == pytest.approx(0.1)


def test_heldout_counts_the_episodes_that_read_every_broken_line(tmp_path):
    import json
    from types import SimpleNamespace

    task_dir = tmp_path / "t1"
    task_dir.mkdir()
    edits = [{"path": "a.py", "old": "x", "new": "y", "line": 12}]
    (task_dir / "solution.json").write_text(json.dumps({"edits": edits}))
    tasks = {"t1": SimpleNamespace(id="t1", dir=task_dir, split="heldout")}
    store = TraceStore(tmp_path / "traces.db")

    def episode(sid, reads):
        session(store, sid, tmp_path, source="bench", accepted=False)
        store.set_meta(sid, task_id="t1")
        for i, (path, lines) in enumerate(reads):
            result = "".join(f"{n:>6}\tline {n}\n" for n in lines)
            store.write_call(
                sid, 0, call_id=f"c{i}", index=i, name="read_file", args={"path": path},
                status="ok", result=result, t_start=0, t_end=1,
            )  # fmt: skip

    episode("early", [("a.py", range(10, 20))])  # an older session of the task
    episode("late", [("a.py", range(1, 12)), ("b.py", range(10, 20))])  # missed line 12
    store.close()
    assert heldout_module().lines_read(tmp_path / "traces.db", tasks) == 0
    store = TraceStore(tmp_path / "traces.db")
    episode("last", [("./a.py", range(1, 12)), ("a.py", range(12, 30))])
    store.close()
    assert heldout_module().lines_read(tmp_path / "traces.db", tasks) == 1
    assert heldout_module().lines_read(tmp_path / "absent.db", tasks) == 0
