"""Next-step accuracy (`training/nextstep.py`): reference sessions of held-out tasks,
played through the real sandbox and never trained on, and the scoring of a policy's
reply at each of their steps.

    .venv/bin/python -m pytest tests/training/test_nextstep.py -q
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
from opencomposer.agent.protocols import ModelError, TurnOutput
from opencomposer.agent.traces import TraceStore
from opencomposer.training import nextstep
from opencomposer.training.demos import DemoError, load_solution, playable, record_demos
from opencomposer.training.nextstep import Tally, reference_steps, score, tally
from opencomposer.training.sft import accepted, samples_from_traces

from tests.training.test_rl_demos import cart_task

EDIT = '<edit_file path="a.py">\n<old>    x = 1</old>\n<new>    x = 2</new>\n</edit_file>'


@pytest.mark.parametrize(
    ("want", "got", "expected"),
    [
        (EDIT, "Fixing it.\n" + EDIT, [("edit_file", True, True)]),
        # the right line, the wrong change: the point of the step, not the step
        (EDIT, EDIT.replace("x = 2", "x = 3"), [("edit_file", False, True)]),
        (EDIT, EDIT.replace("x = 1", "y = 1"), [("edit_file", False, False)]),
        (EDIT, EDIT.replace("a.py", "b.py"), [("edit_file", False, False)]),
        (EDIT, "Done.", [("edit_file", False, False)]),
        (
            '<read_file path="a.py" start_line="10" end_line="49"/>',
            '<read_file path="a.py" start_line="1" end_line="30"/>',
            [("read_file", False, True)],
        ),
        (
            '<read_file path="a.py" start_line="10" end_line="49"/>',
            '<read_file path="a.py" start_line="11" end_line="49"/>',
            [("read_file", False, False)],
        ),
        (
            '<read_file path="a.py" start_line="10"/>',
            '<read_file path="a.py"/>',
            [("read_file", False, True)],
        ),
        (
            '<grep pattern="def f\\b" glob="*.py"/>',
            '<grep pattern="def f\\b" path="src"/>',
            [("grep", False, True)],
        ),
        (
            "<run_terminal>\n<command>python -m pytest -q t.py</command>\n</run_terminal>",
            "<run_terminal>\n<command>python -m pytest -x</command>\n</run_terminal>",
            [("run_terminal", False, True)],
        ),
        ("Fixed it; the test passes.", "The bug was here.", [("answer", True, True)]),
        ("Fixed it; the test passes.", '<read_file path="a.py"/>', [("answer", False, False)]),
        # each of the engineer's calls is judged on its own
        (
            '<read_file path="a.py"/>\n<read_file path="b.py"/>',
            '<read_file path="b.py"/>',
            [("read_file", False, False), ("read_file", True, True)],
        ),
        # a malformed call (here cut off by the token budget) is no call
        (
            EDIT,
            '<edit_file path="a.py">\n<old>    x = 1</old>\n<new>    x',
            [("edit_file", False, False)],
        ),
    ],
)
def test_a_reply_is_scored_against_the_engineers_calls(want, got, expected):
    assert score(want, got) == expected


def _trace(sid, meta, texts):
    return {
        "session_id": sid,
        "meta": meta,
        "turns": [
            {"turn": i + 1, "messages": [{"role": "user", "content": f"{sid}/{i}"}], "text": t}
            for i, t in enumerate(texts)
        ],
    }


def test_only_resolved_reference_sessions_give_steps():
    traces = [
        _trace("a", {"source": "reference", "resolved": True, "task_id": "t1"}, ["x", "y"]),
        _trace("b", {"source": "reference", "resolved": False, "task_id": "t2"}, ["x"]),
        _trace("c", {"source": "demo", "accepted": True, "task_id": "t3"}, ["x"]),
        _trace("d", {"source": "reference", "resolved": True, "task_id": "t4"}, ["z"]),
    ]
    assert [(s.session_id, s.turn) for s in reference_steps(traces)] == [
        ("a", 1),
        ("a", 2),
        ("d", 1),
    ]
    assert [s.task_id for s in reference_steps(traces, ["t4", "t2"])] == ["t4"]


def test_a_step_is_of_the_kinds_of_call_the_engineer_makes():
    run = "<run_terminal>\n<command>pytest</command>\n</run_terminal>"
    read = '<read_file path="a.py"/>'
    steps = reference_steps(
        [
            _trace(
                "a",
                {"source": "reference", "resolved": True},
                [f"Looking.\n{run}\n{read}", EDIT, "Fixed it."],
            )
        ]
    )
    assert [nextstep.step_kinds(s) for s in steps] == [
        {"run_terminal", "read_file"},
        {"edit_file"},
        {"answer"},
    ]


def test_a_reference_session_is_never_trained_on():
    tr = {"status": "completed", "edits": [], "meta": {"source": "reference", "accepted": True}}
    assert not accepted(tr)


def test_a_step_the_model_cannot_answer_is_left_out():
    tr = _trace("a", {"source": "reference", "resolved": True}, [EDIT, "Done."])
    steps = reference_steps([tr])
    too_long = ModelError("the prompt is 8468 tokens, over the model's context window of 8192")
    got = asyncio.run(nextstep.replies(Oracle({"a/0": too_long, "a/1": "Done."}), steps))
    assert got[0] is too_long and got[1] == "Done."
    assert tally(steps, got) == {"answer": Tally(n=1, exact=1, part=1, tool=1)}


class Oracle:
    """A model whose reply to a step's prompt is given by a table (others: one line)."""

    name = "oracle"
    context_window = 8192

    def __init__(self, table):
        self.table = table

    def stream(self, messages, sampling):
        assert sampling.temperature == 0.0
        text = self.table.get(messages[-1].content, "I do not know.")

        class Stream:
            output = None

            def __aiter__(self):
                return self.gen()

            async def gen(self):
                if isinstance(text, Exception):
                    raise text
                yield text
                self.output = TurnOutput(text=text)

            async def aclose(self):
                pass

        return Stream()

    def count_tokens(self, text):
        return len(text)

    async def close(self):
        pass


def test_a_request_that_leads_nowhere_starts_no_environment(tmp_path):
    import dataclasses

    task = cart_task(tmp_path, split="heldout")
    vague = dataclasses.replace(task, query="Something is off in the shop; please have a look.")
    assert playable(task) and not playable(vague)
    # nothing to play: the environment server (here a config it could not start with)
    # is never started
    stats = asyncio.run(
        nextstep.record_references(
            [vague], tmp_path / "reference.db", prompt_style="compact", env_config=object()
        )
    )
    assert stats.recorded == 0


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_held_out_references_play_in_the_sandbox_and_score_a_policy(tmp_path):
    from opencomposer.training.env import EnvConfig

    task = cart_task(tmp_path, split="heldout")
    # the training paths still refuse it
    with pytest.raises(DemoError, match="held out"):
        load_solution(task)
    with pytest.raises(DemoError, match="held out"):
        asyncio.run(record_demos([task], env=None, store=None, session_config=None))

    db = tmp_path / "reference.db"
    env = EnvConfig(num_actors=1, root=tmp_path / "ws", disk_mb=64)
    stats = asyncio.run(
        nextstep.record_references([task], db, prompt_style="compact", env_config=env)
    )
    assert stats.recorded == stats.accepted == 1, stats.failed
    again = asyncio.run(
        nextstep.record_references([task], db, prompt_style="compact", env_config=env)
    )
    assert again.recorded == 0  # already there
    traces = nextstep.load_references(db)
    assert len(traces) == 1
    tr = traces[0]
    assert tr["meta"]["source"] == "reference" and tr["meta"]["resolved"] is True
    assert not accepted(tr) and samples_from_traces(traces).sessions_used == 0
    store = TraceStore(db)
    assert all(e["decision"] != "accept" for e in store.export(tr["session_id"])["edits"])
    store.close()

    steps = reference_steps(traces, [task.id])
    assert len(steps) == len(tr["turns"]) >= 3  # look, edit, rerun, answer
    kinds = [k for s in steps for k, _, _ in score(s.text, s.text)]
    assert "edit_file" in kinds and kinds[-1] == "answer"

    # a policy that replies as the engineer did matches every step; one that answers
    # at once matches only the answer
    perfect = Oracle({s.messages[-1]["content"]: s.text for s in steps})
    got = asyncio.run(nextstep.replies(perfect, steps, concurrency=2))
    assert got == [s.text for s in steps]
    full = tally(steps, got)
    assert all(t.tool == t.exact == t.part == t.n for t in full.values())
    lazy = tally(steps, asyncio.run(nextstep.replies(Oracle({}), steps)))
    assert lazy["answer"] == Tally(n=1, exact=1, part=1, tool=1)
    assert all(t.tool == t.exact == t.part == 0 for k, t in lazy.items() if k != "answer")


def test_edit_steps_are_split_by_whether_the_traceback_shows_their_line():
    """The fix step is read off the traceback when the failing run stops at the line
    the engineer changes; elsewhere it must be reasoned out. The benchmark reports the
    two apart."""
    run = '<tool_result name="run_terminal" index="0" status="error">\nexit code 1\n{tb}\n</tool_result>'
    raises = "tests/test_a.py:4: in test_x\n    f()\na.py:7: in f\n    x = 1\nE   ValueError\n"
    asserts = "tests/test_a.py:5: in test_x\n    assert f() == 2\nE   assert 1 == 2\n"

    def step(tb: str, sid: str) -> nextstep.Step:
        messages = [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "fix it"},
            {"role": "assistant", "content": "running"},
            {"role": "user", "content": run.format(tb=tb)},
        ]
        return nextstep.Step(session_id=sid, task_id=sid, turn=2, messages=messages, text=EDIT)

    steps = [step(raises, "a"), step(asserts, "b"), step(raises.replace(":7:", ":9:"), "c")]
    assert [nextstep.traceback_shows(s, "a.py", "    x = 1") for s in steps] == [True, False, True]
    assert not nextstep.traceback_shows(steps[0], "b.py", "    x = 1")
    got = [EDIT, EDIT.replace("x = 2", "x = 3"), "Done."]
    assert nextstep.edit_split(steps, got) == {
        nextstep.EDIT_IN_TRACEBACK: Tally(n=2, exact=1, part=1, tool=1),
        nextstep.EDIT_NOT_IN_TRACEBACK: Tally(n=1, exact=0, part=1, tool=1),
    }
