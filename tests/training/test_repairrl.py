"""RL on the repair's ranking (`training/repairrl.py`): candidates proposed by a real (if
tiny) language model, graded by forked trial runs in the sandbox, and a LoRA update
that raises the chance that the first candidate tried passes."""

from __future__ import annotations

import json

import pytest
import torch
from opencomposer.training import repairrl
from opencomposer.training.lora import LoraConfig, apply_lora
from opencomposer.training.tasks import load_task, write_task
from opencomposer.training.trainer import tiny_llama

from tests.agent.test_repair import KNOWN, Chars, NGram

PICK = (
    "def pick(lo, hi):\n    if lo < hi:\n        return lo\n    return hi\n\n\n"
    "def total(pairs):\n    return sum(p * q for p, q in pairs)\n"
)
TESTS = (
    "from pick import pick, total\n\n\n"
    "def test_pick_equal():\n    assert pick(2, 2) == 2 and pick(1, 2) == 1 and pick(3, 2) == 2\n\n\n"
    "def test_total():\n    assert total([(2, 3)]) == 6\n"
)
VERIFY = "python -m pytest -x -q -p no:cacheprovider test_pick.py"


def pick_task(tmp_path, split="train", new="    if lo <= hi:\n"):
    """A one-file project whose `pick` has a flipped comparison (`<` for `<=`: the tie
    returns `hi`, which the test tells apart by identity of the branch taken)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "pick.py").write_text(PICK)
    (repo / "test_pick.py").write_text(
        TESTS.replace("pick(2, 2) == 2", "pick(2, 2.0) == 2 and type(pick(2, 2.0)) is int")
    )
    folder = write_task(
        tmp_path / "task",
        query="test_pick_equal fails",
        verify=VERIFY,
        repo_dir=repo,
        split=split,
        source="corpus:pick",
    )
    solution = {
        "kind": "flipped comparison",
        "failing": ["test_pick.py::test_pick_equal"],
        "edits": [{"path": "pick.py", "line": 2, "old": "    if lo < hi:\n", "new": new}],
    }
    (folder / "solution.json").write_text(json.dumps(solution))
    return load_task(folder)


def test_the_failing_command_names_the_failing_tests_in_place_of_their_files():
    got = repairrl.failing_command(VERIFY, ["test_pick.py::test_pick_equal"])
    assert got == "python -m pytest -x -q -p no:cacheprovider test_pick.py::test_pick_equal"
    assert repairrl.failing_command(VERIFY, []) == VERIFY


def test_the_first_candidates_and_the_reference_fix_are_graded():
    afters = ["a", "b", "c", "fix", "e"]
    assert repairrl.graded_indices(afters, "fix", 2) == [0, 1, 3]
    assert repairrl.graded_indices(afters, "b", 2) == [0, 1]
    assert repairrl.graded_indices(afters, "none", 9) == [0, 1, 2, 3, 4]


async def test_candidates_are_proposed_and_graded_by_trial_runs(tmp_path):
    task = pick_task(tmp_path)
    lm = NGram(KNOWN)
    lm.tokenizer = lm.tok
    out = tmp_path / "run" / "groups.jsonl"
    out.parent.mkdir()
    lines: list[str] = []
    groups = await repairrl.collect([task], model=lm, out=out, graded=6, others=1, log=lines.append)
    (group,) = groups
    assert "skipped" not in group, group
    cands = group["candidates"]
    ref = [c for c in cands if c["reference"]]
    assert len(ref) == 1 and ref[0]["reward"] == 1.0  # the real fix passes its trial run
    assert ref[0]["new"] == "    if lo <= hi:\n" and group["reference_rank"] is not None
    assert any(c["reward"] == 0.0 for c in cands)  # and most edits do not
    assert repairrl.learnable(group)
    assert group["command"].endswith("test_pick.py::test_pick_equal")
    assert "pass, the fix ranks" in lines[0]
    # a second run resumes: the graded task is not proposed again
    again = await repairrl.collect([task], model=lm, out=out, graded=6, others=1, log=lines.append)
    assert again == groups and len(lines) == 1


async def test_a_fix_the_proposer_misses_is_graded_as_the_edit_it_begins_with(tmp_path):
    # a fix no candidate makes whole (it adds a comment); its first token is scored
    task = pick_task(tmp_path, new="    if lo <= hi:  # ties go to lo\n")
    lm = NGram(KNOWN)
    lm.tokenizer = lm.tok
    out = tmp_path / "groups.jsonl"
    lines: list[str] = []
    (group,) = await repairrl.collect(
        [task], model=lm, out=out, graded=6, others=0, log=lines.append
    )
    assert group["reference_rank"] is None
    (ref,) = [c for c in group["candidates"] if c["reference"]]
    assert ref["rank"] is None and ref["reward"] == 1.0
    assert ref["first"] == [0, PICK.index(" hi:"), "ins", ord("=") + 1]
    assert ref["new"] == "    if lo <= hi:  # ties go to lo\n"
    assert repairrl.learnable(group) and "the edit it begins with" in lines[0]


async def test_a_state_whose_fix_is_out_of_reach_is_graded_only_when_asked(tmp_path, monkeypatch):
    from opencomposer.agent import repair

    task = pick_task(tmp_path, new="    if lo <= hi:  # ties go to lo\n")
    monkeypatch.setattr(repair, "first_edit", lambda *a: None)
    lm = NGram(KNOWN)
    lm.tokenizer = lm.tok
    out = tmp_path / "groups.jsonl"
    (group,) = await repairrl.collect([task], model=lm, out=out, graded=6, others=0, log=print)
    assert group["skipped"] == "the fix is neither proposed nor one edit of the code in focus"
    assert "candidates" not in group
    out.unlink()
    (group,) = await repairrl.collect(
        [task], model=lm, out=out, graded=6, others=0, proposed_only=False, log=print
    )
    passing = [c["new"] for c in group["candidates"] if c["reward"] == 1.0]
    assert passing == ["    if lo <= hi:\n"] and not any(
        c["reference"] for c in group["candidates"]
    )


def test_the_update_raises_the_chance_that_the_first_candidate_passes():
    # a group as `collect` writes it: where each candidate's gain is read, its reward
    at = PICK.index(" hi:")  # `=` put before ` hi` makes `<=`
    lt = PICK.index("< hi")
    group = {
        "task_id": "t",
        "path": "pick.py",
        "spans": [["pick.py", 0, 4]],
        "candidates": [
            {"first": [0, at, "ins", ord("=") + 1], "reward": 1.0},
            {"first": [0, lt, "sub", ord(">") + 1], "reward": 0.0},
            {"first": [0, lt, "sub", ord("!") + 1], "reward": 0.0},
            {"first": [0, PICK.index("lo\n"), "sub", ord("h") + 1], "reward": 0.0},
            {"first": [0, PICK.index("hi\n"), "drop", -1], "reward": None},  # not known
        ],
    }
    assert len(repairrl.learnable(group)) == 4
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=128)  # the characters' ids (code point + 1) fit
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    texts = {"pick.py": PICK}
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    first = None
    for _ in range(15):
        loss, st = repairrl.group_loss(model, Chars(), group, texts, temperature=1.0, kl=0.1)
        if first is None:
            first = st
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, last = repairrl.group_loss(model, Chars(), group, texts, temperature=1.0, kl=0.1)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # the adapters start as no change
    assert last["logJ"] > first["logJ"] + 0.5, (first, last)
    assert last["rank"] == 0 and last["kl"] > 0.0


def test_a_group_that_all_passes_or_all_fails_is_not_learned():
    same = {"candidates": [{"first": [0, 1, "sub", 5], "reward": 0.0}] * 3}
    assert repairrl.learnable(same) == []
    assert repairrl.learnable({"skipped": "two sites"}) == []


def test_held_out_tasks_are_refused(tmp_path, capsys):
    task = pick_task(tmp_path, split="heldout")
    code = repairrl.main(["collect", "--suite", str(task.dir.parent), "--out", str(tmp_path / "o")])
    assert code == 2
    assert "held-out" in capsys.readouterr().err


def test_training_saves_resumable_checkpoints_with_the_policys_settings(tmp_path):
    from opencomposer.agent import repair
    from opencomposer.agent.backends._local import ChatTokenizer, read_model_settings
    from opencomposer.agent.backends.smollm2 import gguf_path
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "policy"
    source = gguf_path()
    AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    (folder / "opencomposer.json").write_text('{"prompt_style": "compact", "repair": true}')
    task = pick_task(tmp_path)
    tok = ChatTokenizer(folder)
    texts, spans = {"pick.py": PICK}, [repair.Span("pick.py", 0, 8)]
    cands = []
    for new, reward in (("lo <= hi", 1.0), ("lo > hi", 0.0), ("lo < lo", 0.0), ("hi < hi", 0.0)):
        first = repair.first_edit(tok, texts, spans, "pick.py", PICK.replace("lo < hi", new))
        assert first is not None, new
        cands.append({"first": [first.site, first.at, first.how, first.token], "reward": reward})
    group = {
        "task_id": task.id,
        "path": "pick.py",
        "spans": [["pick.py", 0, 8]],
        "candidates": cands,
    }
    out = tmp_path / "run"
    lines: list[str] = []
    kw = dict(folder=folder, out=out, groups_per_step=1, lr=5e-3, temperature=1.0, kl=0.1)
    kw |= dict(lora_rank=4, lora_alpha=8.0, seed=0, checkpoint_every=4, log=lines.append)
    last = repairrl.train([group], {task.id: task}, epochs=8, **kw)
    assert last.name == "step_8" and (out / "checkpoints" / "step_4" / "adapter").is_dir()
    assert (last / repairrl.OPTIMIZER_STATE).is_file()
    assert read_model_settings(last)["repair"] is True  # it runs as the policy did
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["logJ"] > rows[0]["logJ"]
    # a second run with more epochs resumes from step 8 and takes the rest only
    again = repairrl.train([group], {task.id: task}, epochs=10, **kw)
    assert again.name == "step_10" and any("resumed from" in x and "step_8" in x for x in lines)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
