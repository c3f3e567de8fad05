"""RL on the fix step (`training/fixstep.py`): the states, the grading in the sandbox and
the update that reuses one prompt cache for a whole group.

    .venv/bin/python -m pytest tests/training/test_fixstep.py -q
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil

import pytest
import torch
from opencomposer.agent.protocols import TurnOutput
from opencomposer.agent.traces import TraceStore
from opencomposer.tools.specs import EDIT_FILE, render_call
from opencomposer.training import fixstep
from opencomposer.training.corpus import touched_check
from opencomposer.training.fixstep import (
    FixScorer,
    Reply,
    advantages,
    edit_signature,
    fix_states,
    pick_states,
    read_groups,
    sample_groups,
    train_groups,
)
from opencomposer.training.nextstep import Step
from opencomposer.training.rollouts import Sample
from opencomposer.training.trainer import Trainer, TrainerConfig, tiny_llama

from tests.training.test_rl_demos import LINE_FIX, cart_task, record_in_sandbox

EDIT = '<edit_file path="a.py">\n<old>x = 1</old>\n<new>x = 2</new>\n</edit_file>'
RUN = "<run_terminal>\n<command>python -m pytest -q</command>\n</run_terminal>"


def _trace(sid, calls, turns=3, task="t1"):
    return {
        "session_id": sid,
        "meta": {"task_id": task},
        "tool_calls": [{"turn": t, "name": n} for t, n in calls],
        "turns": [
            {"turn": i, "messages": [{"role": "user", "content": f"{sid}/{i}"}], "text": f"r{i}"}
            for i in range(1, turns + 1)
        ],
    }


def test_the_fix_state_is_the_first_edit_before_which_no_file_changed():
    traces = [
        _trace("a", [(1, "run_terminal"), (2, "read_file"), (3, "edit_file")]),
        # a recovery: the first (wrong) edit's turn is the state, not the fix after it
        _trace("b", [(1, "read_file"), (2, "edit_file"), (3, "edit_file")]),
        _trace("c", [(1, "write_file"), (2, "edit_file")]),  # the workspace changed first
        _trace("d", [(1, "read_file")]),  # no edit
        _trace("e", [(2, "edit_file")], task=""),  # no task to grade it on
    ]
    got = fix_states(traces)
    assert [(s.session_id, s.turn, s.text) for s in got] == [("a", 3, "r3"), ("b", 2, "r2")]
    assert got[0].messages == [{"role": "user", "content": "a/3"}]
    assert fixstep.state_key(got[0]) == "a:3"


def test_group_advantages_are_relative_and_vanish_when_all_alike():
    assert advantages([1.0, 0.0, 0.0, 0.0]) == pytest.approx(
        [3**0.5, -(3**-0.5)] + [-(3**-0.5)] * 2
    )
    assert sum(advantages([1.0, 0.0, 1.0, 0.0, 0.0])) == pytest.approx(0.0)
    assert advantages([0.0] * 4) == [0.0] * 4 and advantages([1.0] * 3) == [0.0] * 3
    assert advantages([1.0]) == [0.0]


def test_replies_with_the_same_edits_share_a_signature():
    same = edit_signature("Fixing it.\n" + EDIT + "\n" + RUN)
    assert same == edit_signature("Other words.\n" + EDIT)
    assert same != edit_signature(EDIT.replace("x = 2", "x = 3"))
    assert edit_signature(RUN) == () == edit_signature("<edit_file path='a.py'><old>x")


def test_states_are_spread_over_tasks_first():
    states = [Step(f"s{i}", f"t{i % 3}", 2, [], "") for i in range(9)]
    first = pick_states(states, 3, seed=1)
    assert sorted(s.task_id for s in first) == ["t0", "t1", "t2"]
    assert pick_states(states, 3, seed=1) == first
    assert len(pick_states(states, 100, seed=1)) == 9


def test_groups_round_trip_and_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "groups.jsonl"
    state = Step("s1", "t1", 2, [], "")
    fixstep.append_group(path, state, [Reply("a", [1, 2], [3, 4], [-0.5, -0.1], reward=1.0)])
    with open(path, "a") as f:
        f.write('{"state": "s2:2", "replies": [')
    (g,) = read_groups(path)
    assert g["state"] == "s1:2" and g["replies"][0].reward == 1.0
    assert g["replies"][0].ids == [3, 4]


class Sampler:
    """A model with a fixed reply per prompt and recorded token ids (its own ids)."""

    name = "sampler"
    context_window = 4096

    def __init__(self, replies):
        self.replies = replies
        self.temperatures = []

    def stream(self, messages, sampling):
        self.temperatures.append(sampling.temperature)
        text = self.replies[messages[-1].content]

        class Stream:
            output = None

            def __aiter__(self):
                return self.gen()

            async def gen(self):
                if isinstance(text, Exception):  # as a backend fails: while streaming
                    raise text
                yield text
                self.output = TurnOutput(
                    text=text,
                    prompt_token_ids=[1, 2, 3],
                    completion_token_ids=[4, 5],
                    completion_logprobs=[-1.0, -2.0],
                )

        return Stream()

    async def close(self):
        pass


def test_each_state_gets_k_sampled_replies_with_their_tokens():
    states = [Step("a", "t1", 2, [{"role": "user", "content": "p1"}], "")]
    model = Sampler({"p1": EDIT})
    seen = []

    async def on_group(state, replies):
        seen.append((fixstep.state_key(state), len(replies)))

    (group,) = asyncio.run(sample_groups(model, states, k=3, temperature=0.8, on_group=on_group))
    assert [r.text for r in group] == [EDIT] * 3 and group[0].ids == [4, 5]
    assert group[0].logprobs == [-1.0, -2.0] and group[0].prompt_ids == [1, 2, 3]
    assert model.temperatures == [0.8] * 3 and seen == [("a:2", 3)]


def test_a_prompt_over_the_window_leaves_its_group_empty_and_a_failing_model_is_an_error():
    from opencomposer.agent.protocols import ModelError, PromptTooLong

    long = Step("b", "t2", 2, [{"role": "user", "content": "p2"}], "")
    states = [long, Step("a", "t1", 2, [{"role": "user", "content": "p1"}], "")]
    model = Sampler({"p1": EDIT, "p2": PromptTooLong("the prompt is 9000 tokens, over ...")})
    empty, group = asyncio.run(sample_groups(model, states, k=2, temperature=0.8))
    assert empty == [] and len(group) == 2
    # only states over the window: nothing to sample, and no error
    assert asyncio.run(sample_groups(model, [long], k=2, temperature=0.8)) == [[]]
    broken = Sampler({"p2": ModelError("engine died")})
    with pytest.raises(fixstep.FixStepError, match="answered no state: engine died"):
        asyncio.run(sample_groups(broken, [long], k=2, temperature=0.8))


def _lora_trainer(seed=0):
    torch.manual_seed(seed)
    config = TrainerConfig(lr=1e-2, lora_rank=4, lora_alpha=8, micro_batch_size=8, precision="fp32")
    return Trainer(tiny_llama(seed=0), config)


def _grads(trainer):
    return {
        n: p.grad.detach().clone()
        for n, p in trainer.model.named_parameters()
        if p.grad is not None
    }


def test_the_cached_prompt_gives_the_gradient_of_the_whole_sequence():
    """At the start of a step the adapter has not moved the prompt's keys and values, so
    the update through the prompt's cache equals the trainer's own step on the whole
    sequences (same loss, same advantages, same sampler logprobs)."""
    prompt = [5, 9, 11, 3, 7, 2]
    replies = [
        Reply("", prompt, [8, 4, 6], [-3.9, -4.2, -4.0], reward=1.0),
        Reply("", prompt, [1, 12], [-4.1, -4.3], reward=0.0),
        Reply("", prompt, [13, 14, 15, 16], [-4.0] * 4, reward=0.0),
    ]
    # a trained adapter (B != 0), so the gradient reaches A as well as B
    ours = _lora_trainer()
    with torch.no_grad():
        for n, p in ours.model.named_parameters():
            if "lora_b" in n:
                p.normal_(0, 0.05)
    theirs = _lora_trainer()
    theirs.model.load_state_dict(ours.model.state_dict())
    adv = advantages([r.reward for r in replies])
    tokens = float(sum(len(r.ids) for r in replies))

    ours.optimizer.zero_grad()

    fixstep._group_backward(ours, replies, adv, tokens)
    samples = [
        Sample(
            input_ids=prompt + r.ids,
            mask=[0] * len(prompt) + [1] * len(r.ids),
            old_logprobs=[0.0] * len(prompt) + r.logprobs,
            advantage=a,
        )
        for r, a in zip(replies, adv, strict=True)
    ]
    # Trainer.step applies its update; compare the gradients just before it
    captured = {}
    real_step = theirs.optimizer.step

    def capture(*args, **kwargs):
        captured.update(_grads(theirs))
        return real_step(*args, **kwargs)

    theirs.optimizer.step = capture
    theirs.step(samples)
    got = _grads(ours)
    assert got and set(got) == set(captured)
    # the trainer clips the global norm at 1.0; ours is the gradient before clipping
    norm = torch.sqrt(sum((g.float() ** 2).sum() for g in got.values()))
    scale = min(1.0, theirs.config.grad_clip / float(norm))
    for n, g in got.items():
        assert torch.allclose(g * scale, captured[n], atol=1e-5, rtol=1e-3), n


def test_only_groups_with_mixed_rewards_train():
    trainer = _lora_trainer()
    prompt = [5, 9, 11, 3]
    mixed = {
        "replies": [
            Reply("", prompt, ids, [-4.0, -4.0], reward=r)
            for ids, r in (([8, 4], 1.0), ([6, 2], 0.0))
        ]
    }
    flat = {"replies": [Reply("", prompt, [8, 4], [-4.0, -4.0], reward=0.0)] * 2}
    assert train_groups(trainer, [flat, flat]) == 0
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_b" in n}
    rows = []
    assert train_groups(trainer, [flat, mixed], epochs=2, on_step=lambda n, s: rows.append(s)) == 2
    assert [r["groups"] for r in rows] == [1.0, 1.0]
    assert any(
        not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if "lora_b" in n
    )


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_replies_are_graded_by_the_tasks_tests_in_the_sandbox(tmp_path):
    from opencomposer.training.env import EnvConfig, EnvironmentServer

    task = cart_task(tmp_path, split="train")
    # a corpus task's reward: the tests, and part credit for changing the broken line
    checked = dataclasses.replace(
        task,
        reward={"verify": 0.8, "checks": [{"command": touched_check([LINE_FIX]), "weight": 0.2}]},
    )
    store = TraceStore(tmp_path / "demos.db")
    stats = record_in_sandbox([task], store, tmp_path)
    assert stats.accepted == 1, stats.failed
    (tr,) = [store.export(s) for s in stats.session_ids]
    store.close()
    (state,) = fix_states([tr])
    assert state.task_id == task.id and "<edit_file" in state.text

    def fix(new, old=LINE_FIX["old"]):
        return render_call(EDIT_FILE, path=LINE_FIX["path"], old=old, new=new) + "\n" + RUN

    right = fix(LINE_FIX["new"])
    wrong = fix(LINE_FIX["new"].replace("sum(", "1 + sum("))
    missing = fix(LINE_FIX["new"], old=LINE_FIX["old"].replace("sum(p for", "sum(x for"))
    elsewhere = fix("        self.items = list()", old="        self.items = []")
    writes_by_shell = (
        "<run_terminal>\n<command>sed -i 's/p for p/p * q for p/' shop/cart.py</command>\n"
        "</run_terminal>"
    )

    async def grade():
        env = EnvironmentServer(EnvConfig(num_actors=1, root=tmp_path / "g", disk_mb=64))
        await env.start()
        try:
            plain = FixScorer(env, {task.id: task})
            texts = [right, "Fixed it.\n" + right, wrong, missing, writes_by_shell]
            got = await asyncio.gather(*(plain.score(task.id, t) for t in texts))
            part = FixScorer(env, {task.id: checked})
            more = [right, wrong, elsewhere]
            return got, await asyncio.gather(*(part.score(task.id, t) for t in more))
        finally:
            await env.close()

    (right, same, bad, absent, shell), (c_right, c_wrong, c_elsewhere) = asyncio.run(grade())
    assert right == same == (1.0, "resolved")
    assert bad == (0.0, "tests fail")
    assert absent == (0.0, "no edit applied")
    # the grading runs no command: the tests decide, on the files as the edits left them
    assert shell == (0.0, "no edit")
    # with the part-credit check: the right line changed wrongly earns the part; an edit
    # that leaves the broken line is not test-run
    assert c_right == (1.0, "resolved")
    assert c_wrong == (0.2, "tests fail")
    assert c_elsewhere == (0.0, "broken line kept")


def test_a_run_with_no_states_is_a_one_line_error(tmp_path, capsys):
    db = tmp_path / "empty.db"
    TraceStore(db).close()
    assert fixstep.main(["train", "--db", str(db), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().out.strip().startswith("error: no fix state in")
    assert fixstep.main(["train", "--db", str(tmp_path / "nope.db"), "--out", "o"]) == 2
    assert "no such trace store" in capsys.readouterr().out


# -- best-of-k --------------------------------------------------------------------------


def _edit(old: str, new: str) -> str:
    return f'Fixing it.\n<edit_file path="a.py">\n<old>{old}</old>\n<new>{new}</new>\n</edit_file>'


def _tar_task(tmp_path, files):
    import io
    import tarfile
    import types

    repo = tmp_path / "repo.tar"
    with tarfile.open(repo, "w") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return types.SimpleNamespace(repo_tar=repo)


def _prefers(word):
    """A scorer that likes code holding ``word`` and is indifferent to the rest."""
    asked = []

    async def score(context, text):
        asked.append(text)
        return 5.0 * text.count(word) - 0.01 * len(text)

    score.asked = asked
    return score


def test_best_of_k_picks_a_passing_reply_else_the_one_the_ranking_prefers(tmp_path):
    task = _tar_task(tmp_path, {"a.py": "def f():\n    x = 1\n    return x\n"})
    replies = [
        Reply("I am not sure.", [1], [2], [-1.0], why="no edit"),
        Reply(_edit("x = 1", "x = 2"), [1], [2], [-1.0], why="tests fail"),
        Reply(_edit("x = 1", "x = 3"), [1], [2], [-1.0], why="tests fail"),
        Reply(_edit("y = 1", "x = 3"), [1], [2], [-1.0], why="no edit applied"),
    ]

    def run(score, rs=replies):
        return asyncio.run(fixstep.pick_best(task, rs, score))

    assert run(_prefers("3")) == (2, "ranked")
    # a passing reply wins over the ranking's choice
    passing = [*replies[:1], dataclasses.replace(replies[1], why="resolved"), *replies[2:]]
    assert run(_prefers("3"), passing) == (1, "resolved")
    # no change the scorer finds better than the code as it stands: nothing to learn
    assert run(_prefers("1")) is None
    assert run(_prefers("3"), [replies[0], replies[3]]) is None


def test_task_files_hold_only_the_asked_paths_inside_the_folder(tmp_path):
    task = _tar_task(tmp_path, {"a.py": "A\n", "pkg/b.py": "B\n", "c.py": "C\n"})
    with fixstep.task_files(task, ["a.py", "./pkg/b.py", "missing.py", "../a.py"]) as ws:
        assert ws.read_text("a.py") == "A\n" and ws.read_text("pkg/b.py") == "B\n"
        assert not ws.exists("c.py") and not ws.exists("missing.py")
        assert not (ws.root.parent / "a.py").exists()


def test_picks_are_saved_as_made_and_read_back(tmp_path):
    task = _tar_task(tmp_path, {"a.py": "x = 1\n"})
    tasks = {"t1": task, "t2": task}
    groups = [
        {
            "state": f"s{i}:3",
            "task_id": t,
            "replies": [Reply(_edit("x = 1", new), [1], [2], [-1.0])],
        }
        for i, (t, new) in enumerate((("t1", "x = 3"), ("t2", "x = 2"), ("gone", "x = 3")))
    ]
    out = tmp_path / "picks.jsonl"
    score = _prefers("3")
    picked = fixstep.pick_groups(groups, tasks, score, out, log=lambda line: None)
    assert [(g["state"], g["pick"], g["why"]) for g in picked] == [("s0:3", 0, "ranked")]
    assert len(out.read_text().splitlines()) == 2  # s2's task is not in the map
    asked = len(score.asked)
    again = fixstep.pick_groups(groups, tasks, score, out, log=lambda line: None)
    assert [g["state"] for g in again] == ["s0:3"] and len(score.asked) == asked


def test_a_picked_group_trains_its_pick_alone():
    trainer = _lora_trainer()
    prompt = [5, 9, 11, 3]
    replies = [Reply("", prompt, ids, [-4.0, -4.0], reward=0.0) for ids in ([8, 4], [6, 2])]
    assert train_groups(trainer, [{"replies": replies}]) == 0  # no mixed reward, no pick
    rows = []
    steps = train_groups(
        trainer, [{"replies": replies, "pick": 1}], on_step=lambda n, s: rows.append(s)
    )
    assert steps == 1 and rows[0]["groups"] == 1.0
    # the one-hot advantage is the gradient of the picked reply alone
    ours, theirs = _lora_trainer(), _lora_trainer()
    theirs.model.load_state_dict(ours.model.state_dict())
    tokens = float(sum(len(r.ids) for r in replies))
    fixstep._group_backward(ours, replies, [0.0, 1.0], tokens)
    fixstep._group_backward(theirs, replies[1:], [1.0], tokens)
    for (n, g), (_, h) in zip(_grads(ours).items(), _grads(theirs).items(), strict=True):
        assert torch.allclose(g, h, atol=1e-6), n
