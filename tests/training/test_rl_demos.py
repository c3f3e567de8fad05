"""Demonstrations and the SFT warm start on accepted traces.

The scripted demonstrations of the starter suite's *training* tasks go through the
real environment server (Ray, bubblewrap), the production Session and a real
TraceStore; held-out tasks are refused; accepted traces without token ids are
tokenized exactly as the sampler is prompted (the chat template over the
recorded messages), with the loss on the assistant's tokens only.

    .venv/bin/python -m pytest tests/training/test_rl_demos.py -q
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil

import pytest
from opencomposer.agent.protocols import Message
from opencomposer.agent.traces import TraceStore
from opencomposer.training import demos, starter
from opencomposer.training.catalog import load_suite
from opencomposer.training.config import ConfigError, parse_config
from opencomposer.training.demos import (
    DEMO_MAX_TURNS,
    DemoError,
    demo_plan,
    demo_turns,
    line_edits,
    load_solution,
    pending,
    record_demos,
    renamed_word,
    wrong_fix,
)
from opencomposer.training.rollouts import Rollout, Turn, samples_from_rollout
from opencomposer.training.sessions import resolve_prompt_style, session_config
from opencomposer.training.sft import TraceTokenizer, accepted, samples_from_traces
from opencomposer.training.tasks import load_task, write_task


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("starter")
    starter.generate(root, seed=5, per_kind=6)
    return load_suite(root)


@pytest.fixture(scope="module")
def tokenizer():
    from opencomposer.agent.backends.smollm2 import smollm2_path

    return TraceTokenizer(smollm2_path())


def record_in_sandbox(tasks, store, tmp_path):
    """`record_demos` through a real environment server (Ray, bubblewrap)."""
    from opencomposer.training.env import EnvConfig

    env = EnvConfig(num_actors=1, root=tmp_path / "ws", disk_mb=64)
    return asyncio.run(demos.play(tasks, store, prompt_style="compact", env_config=env))


def by_kind(tasks, kind, split="train"):
    return next(t for t in tasks if t.id.startswith(kind) and t.split == split)


def test_demo_turns_look_then_act_then_answer(suite):
    find = by_kind(suite, "find")
    sol = load_solution(find)
    key, _, value = sol["answer"].partition(" is ")
    assert demo_turns(find, sol) == [
        f'Let me search for {key}.\n<grep pattern="{key}"/>',
        sol["answer"],
    ]
    fix = by_kind(suite, "fix")
    sol = load_solution(fix)
    (edit,) = sol["edits"]
    look, act, answer = demo_turns(fix, sol)
    assert look.endswith(f'<read_file path="{edit["path"]}"/>') and edit["path"] in fix.query
    assert f"<old>{edit['old']}</old>" in act and f"<new>{edit['new']}</new>" in act
    assert answer == "Fixed."
    rename = by_kind(suite, "rename")
    sol = load_solution(rename)
    look, act, answer = demo_turns(rename, sol)
    old = rename.query.split("`")[1]
    assert look.endswith(f'<grep pattern="{old}"/>')
    assert act.count('replace_all="true"') == 3 and act.count(f"<old>{old}</old>") == 3


def test_line_edits_are_small_and_unique():
    old = "a = 1\nb = 2\nc = 1\n"
    new = "a = 1\nb = 3\nc = 1\n"
    assert line_edits("x", old, new) == [("b = 2", "b = 3")]
    # a changed line that is not unique grows until it is
    old = "x = 0\ny = 1\nx = 0\nz = 2\n"
    new = "x = 0\ny = 1\nx = 9\nz = 2\n"
    ((o, n),) = line_edits("x", old, new)
    assert old.count(o) == 1 and old.replace(o, n) == new
    assert renamed_word("f(x)\ng = f\n", "h(x)\ng = h\n") == ("f", "h")
    assert renamed_word("a - b", "b - a") is None


def test_held_out_solutions_are_never_read(suite):
    held = by_kind(suite, "find", split="heldout")
    with pytest.raises(DemoError, match="held out"):
        load_solution(held)
    train = [t for t in suite if t.split == "train"][:2]
    # refused before anything runs: no environment, no store needed
    with pytest.raises(DemoError, match="held out"):
        asyncio.run(record_demos(train + [held], env=None, store=None, session_config=None))


def test_accepted_by_decision_or_mark():
    assert accepted({"status": "completed", "edits": [{"decision": "accept"}]})
    assert accepted({"status": "completed", "edits": [], "meta": {"accepted": True}})
    assert not accepted({"status": "completed", "edits": [], "meta": {"accepted": False}})
    assert not accepted({"status": "completed", "edits": [], "meta": {}})
    assert not accepted(
        {"status": "completed", "edits": [{"decision": "reject"}], "meta": {"accepted": True}}
    )
    assert not accepted({"status": "error", "edits": [], "meta": {"accepted": True}})


def test_trace_tokenizer_matches_the_sampler_prompt(tokenizer):
    msgs = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Rename `f`."},
    ]
    text = 'Let me look.\n<grep pattern="f"/>'
    t1 = tokenizer.turn(msgs, text)
    sampler_prompt = tokenizer.chat.prompt_ids([Message(**m) for m in msgs])
    assert t1.prompt_ids == sampler_prompt
    hf = tokenizer.chat.hf
    assert hf.decode(t1.completion_ids) == text + "<|im_end|>"
    msgs2 = msgs + [
        {"role": "assistant", "content": text},
        {"role": "user", "content": '<tool_result name="grep">a.py:1:f</tool_result>'},
    ]
    t2 = tokenizer.turn(msgs2, "Done.")
    # the next prompt extends prompt + completion: the turns merge into one sample
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.completion_ids)] == (
        t1.prompt_ids + t1.completion_ids
    )


def test_prompt_style_setting():
    cfg = parse_config({"rollout": {"prompt_style": "compact"}})
    assert resolve_prompt_style(cfg, object()) == "compact"
    auto = parse_config({})
    assert auto.rollout.prompt_style == "auto"

    class Compact:
        prompt_style = "compact"

    class Wrapped:
        inner = Compact()

    assert resolve_prompt_style(auto, Compact()) == "compact"
    assert resolve_prompt_style(auto, Wrapped()) == "compact"
    assert resolve_prompt_style(auto, object()) == "full"
    with pytest.raises(ConfigError, match="prompt_style"):
        parse_config({"rollout": {"prompt_style": "tiny"}})
    assert session_config(cfg, prompt_style="compact").prompt_style == "compact"
    assert session_config(cfg).prompt_style == "compact"  # the config's own
    assert parse_config({"sft": {"source": "demos"}}).sft.source == "demos"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_demos_through_the_real_session_become_assistant_only_samples(suite, tokenizer, tmp_path):
    tasks = [by_kind(suite, k) for k in ("find", "fix", "rename")]
    store = TraceStore(tmp_path / "demos.db")
    stats = record_in_sandbox(tasks, store, tmp_path)
    assert stats.accepted == stats.recorded == 3 and not stats.failed
    traces = [store.export(s) for s in stats.session_ids]
    # a store filled in several sittings tops up to its limit and never repeats a task
    more = [t for t in suite if t.split == "train"][:6]
    todo = pending(store, [*tasks, *more], style="compact", limit=5, seed=0)
    assert len(todo) == 2 and not {t.id for t in todo} & {t.id for t in tasks}
    assert pending(store, tasks, style="compact", limit=3, seed=0) == []
    assert len(pending(store, tasks, style="full", limit=3, seed=0)) == 3  # another style
    # the same task under another request (an export per request kind) is a new one
    asked = dataclasses.replace(tasks[0], query=tasks[0].query + "\nPlease fix it.")
    assert pending(store, [asked], style="compact", limit=4, seed=0) == [asked]
    assert pending(store, [asked], style="compact", limit=3, seed=0) == []  # at its limit
    store.close()
    for tr in traces:
        assert accepted(tr) and tr["meta"]["source"] == "demo"
        assert tr["meta"]["prompt_style"] == "compact"
        assert all(e["decision"] == "accept" for e in tr["edits"])
        assert tr["turns"][0]["prompt_token_ids"] is None  # scripted: no ids recorded
    data = samples_from_traces(traces, tokenizer=tokenizer)
    assert data.sessions_used == 3 and len(data.samples) == 3  # turns merged per session
    hf = tokenizer.chat.hf
    for tr, s in zip(traces, data.samples, strict=True):
        # the loss covers exactly the assistant's turns, each ended by <|im_end|>
        trained = hf.decode([i for i, m in zip(s.input_ids, s.mask, strict=True) if m])
        assert trained == "".join(t["text"] + "<|im_end|>" for t in tr["turns"])
        # and every turn's prompt is what the sampler is given for those messages
        for t in tr["turns"]:
            p = tokenizer.chat.prompt_ids([Message(**m) for m in t["messages"]])
            assert s.input_ids[: len(p)] == p
    # no held-out task was touched
    assert all(load_task(t.dir).split == "train" for t in tasks)


def test_checkpoints_say_the_prompt_style_they_were_trained_with(tmp_path):
    from opencomposer.agent.backends._local import read_prompt_style
    from opencomposer.training.trainer import Trainer, TrainerConfig, tiny_llama

    tr = Trainer(tiny_llama(), TrainerConfig(precision="fp32"))
    assert read_prompt_style(tr.save(tmp_path / "a")) == "full"  # says nothing: full
    tr.prompt_style = "compact"
    assert read_prompt_style(tr.save(tmp_path / "b")) == "compact"


CART = (
    "class Cart:\n"
    "    def __init__(self):\n"
    "        self.items = []\n"
    "\n"
    "    def subtotal(self):\n"
    "        return sum(p for p, q in self.items)\n"
)
CART_TEST = (
    "from shop.cart import Cart\n\n\ndef test_subtotal():\n    assert Cart().subtotal() == 0\n"
)
CART_FIX = {"path": "shop/cart.py", "old": "sum(p for p, q", "new": "sum(p * q for p, q", "line": 6}


def _corpus_task(tmp_path, query, *, test=CART_TEST, cart=CART):
    """A corpus-like task (a workspace tar, a verify command, protected tests)."""
    import io
    import tarfile
    from types import SimpleNamespace

    tar_path = tmp_path / f"repo{abs(hash(query))}.tar"
    with tarfile.open(tar_path, "w") as tar:
        for name, text in {"shop/cart.py": cart, "tests/test_cart.py": test}.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return SimpleNamespace(
        id="shop-cart-subtotal-1",
        query=query,
        split="train",
        repo_tar=tar_path,
        protect=["tests/test_cart.py"],
        verify="PYTHONPATH=.deps python -m pytest -q -p no:cacheprovider -x tests/test_cart.py",
    )


SOLUTION = {"functions": ["Cart.subtotal"], "kind": "dropped factor", "edits": [CART_FIX]}


def test_expert_turns_follow_only_what_the_request_shows(tmp_path):
    from opencomposer.training.demos import read_request

    # one line: the test's name and the function's file -> run -k NAME, read the file
    one = _corpus_task(tmp_path, "Fix Cart.subtotal in shop/cart.py: the test test_subtotal fails.")
    assert read_request(one.query).functions == {"Cart.subtotal": "shop/cart.py"}
    turns = demo_turns(one, SOLUTION)
    text = "\n".join(turns)
    assert "-k test_subtotal" in text and '<read_file path="shop/cart.py"/>' in text
    assert "tests/test_cart.py" not in text  # the request never named it
    assert "<old>sum(p for p, q</old>" in text and "<" not in turns[-1]

    # the test's id -> run it, read the test, grep the function it calls, read that
    q = "`tests/test_cart.py::test_subtotal` started failing. Output:\n\n```\nE  assert 1 == 2\n```\n"
    turns = demo_turns(_corpus_task(tmp_path, q), SOLUTION)
    text = "\n".join(turns)
    assert "tests/test_cart.py::test_subtotal</command>" in turns[0]
    assert '<grep pattern="def test_subtotal\\b" path="tests/test_cart.py"/>' in turns[0]
    assert '<read_file path="tests/test_cart.py" start_line="4" end_line="43"/>' in turns[1]
    assert 'pattern="def subtotal\\b"' in turns[2]
    assert '<read_file path="shop/cart.py" start_line="5" end_line="44"/>' in turns[3]
    # ... but a test that never names the function leads nowhere: not demonstrated
    blind = "def test_subtotal():\n    assert helper() == 0\n"
    with pytest.raises(DemoError, match="does not name"):
        demo_turns(_corpus_task(tmp_path, q, test=blind), SOLUTION)

    # an issue naming the function -> locate, read, fix, then run the module's tests
    q = "Bug report: `Cart.subtotal` in shop gives wrong results.\n\n```\nE  assert 1 == 2\n```\n"
    turns = demo_turns(_corpus_task(tmp_path, q), SOLUTION)
    assert "<run_terminal>" not in turns[0] and "subtotal" in turns[0]
    assert "--tb=short tests/test_cart.py</command>" in turns[-2]
    # an issue that names no function is not demonstrated
    anon = "Bug report: shop gives wrong results.\n\n```\nE  assert 1 == 2\n```\n"
    with pytest.raises(DemoError, match="names no function"):
        demo_turns(_corpus_task(tmp_path, anon), SOLUTION)


def test_make_demo_request_reads_as_a_one_line_request():
    from opencomposer.training.demos import read_request

    query = (
        "The test test_subtotal_counts_quantities fails. "
        "Fix Cart.subtotal in shop/cart.py so it counts quantities."
    )
    req = read_request(query)
    assert req.test_name == "test_subtotal_counts_quantities" and not req.test_id
    assert req.functions == {"Cart.subtotal": "shop/cart.py"}


def test_a_method_is_found_by_its_own_def_and_read_from_the_hit(tmp_path):
    from opencomposer.training.demos import READ_WINDOW, _locate_pattern, function_lines

    assert _locate_pattern("Bits.__getitem__") == r"def __getitem__\b"
    assert _locate_pattern("Cart.subtotal") == r"def subtotal\b"
    long = "def f():\n" + "    x = 1\n" * 80 + "    return x\n"
    task = _corpus_task(tmp_path, "q", cart=long)
    assert function_lines(task, "shop/cart.py", 3) == (1, READ_WINDOW)  # fixed window
    assert function_lines(task, "shop/cart.py", 70) == (1, 75)  # stretched to show the line


TWO_CARTS = "class Order:\n    def subtotal(self):\n        return 0\n\n\n" + CART
TWO_FIX = {**CART_FIX, "line": 11}
TWO_SOLUTION = {**SOLUTION, "edits": [TWO_FIX]}


def test_a_definition_with_several_hits_is_found_by_what_the_session_shows(tmp_path):
    from opencomposer.training.demos import grep_hits, locate_call

    issue = "Bug report: `Cart.subtotal` in shop gives wrong results.\n\n```\nE  1 != 2\n```\n"
    task = _corpus_task(tmp_path, issue, cart=TWO_CARTS)
    # `def subtotal` has two hits; the owner's line comes before the one to read
    call = locate_call(task, "Cart.subtotal", "shop/cart.py", 11, seen=issue)
    assert call == '<grep pattern="class Cart\\b|def subtotal\\b" glob="*.py"/>'
    pattern = re.search(r'pattern="([^"]+)"', call).group(1)
    assert [h[1] for h in grep_hits(task, pattern)] == [2, 6, 10]
    turns = demo_turns(task, TWO_SOLUTION)
    assert call in turns[0]
    assert '<read_file path="shop/cart.py" start_line="10" end_line="49"/>' in turns[1]
    assert "codebase_search" not in "".join(turns)  # its hits would need guessing

    # a session that never showed the owner cannot tell the hits apart: not demonstrated
    with pytest.raises(DemoError, match="2 definitions of subtotal"):
        locate_call(task, "Cart.subtotal", "shop/cart.py", 11, seen="the cart is wrong")
    with pytest.raises(DemoError, match="does not find its definition at shop/cart.py:10"):
        locate_call(task, "Cart.total", "shop/cart.py", 11, seen=issue)
    # one hit of the name: the plain grep, scoped to a named file where there is one
    one = _corpus_task(tmp_path, issue)
    assert locate_call(one, "Cart.subtotal", "shop/cart.py", 6, scope="shop/cart.py") == (
        '<grep pattern="def subtotal\\b" path="shop/cart.py"/>'
    )
    # a test helper of the same name: the one hit outside the tests is the definition
    helper = CART_TEST + "\n\ndef subtotal(items):\n    return 0\n"
    both = _corpus_task(tmp_path, issue + " ", test=helper)
    assert locate_call(both, "Cart.subtotal", "shop/cart.py", 6, seen="") == (
        '<grep pattern="def subtotal\\b" glob="*.py"/>'
    )


def test_a_demo_is_accepted_only_if_the_lines_it_fixes_were_shown_first():
    from opencomposer.training.demos import Plan, _grounded, shown_lines

    def call(turn, name, result, status="ok", **args):
        return {"turn": turn, "name": name, "args": args, "status": status, "result": result}

    read = "".join(f"{n:>6}\tline {n}\n" for n in range(5, 9))
    trace = {
        "tool_calls": [
            call(1, "grep", "shop/cart.py:2:    def subtotal(self):\nshop/util.py:9:x"),
            call(2, "read_file", read, path="./shop/cart.py"),
            call(2, "read_file", "file not found", status="error", path="shop/other.py"),
            call(3, "edit_file", "edited", path="shop/cart.py"),
        ]
    }
    assert shown_lines(trace, 2) == {("shop/cart.py", 2), ("shop/util.py", 9)}
    assert ("shop/cart.py", 6) in shown_lines(trace, 3)
    fix = (("shop/cart.py", 6, "return 1"),)
    assert _grounded(trace, Plan(turns=["a", "b", "fix"], grounded={2: fix}))
    # fixed in the turn that read it: the read came too late to be its cause
    assert not _grounded(trace, Plan(turns=["a", "fix"], grounded={1: fix}))
    # a line no read showed
    far = (("shop/cart.py", 40, "return 1"),)
    assert not _grounded(trace, Plan(turns=["a", "b", "fix"], grounded={2: far}))


# The corpus's reference fixes are whole lines, broken -> fixed.
CART_LINE = "        return sum(p for p, q in self.items)"
LINE_FIX = {
    "path": "shop/cart.py",
    "old": CART_LINE,
    "new": "        return sum(p * q for p, q in self.items)",
    "line": 6,
}
LINE_SOLUTION = {**SOLUTION, "edits": [LINE_FIX]}
ONE_LINE = "Fix Cart.subtotal in shop/cart.py: the test test_subtotal fails."


def _rerun(turn: str) -> str:
    found = re.search(r"<run_terminal>.*?</run_terminal>", turn, re.S)
    assert found, turn
    return found.group()


def test_a_recovery_demo_edits_wrongly_first_then_corrects_the_edit(tmp_path, monkeypatch):
    monkeypatch.setattr(demos, "UNCHANGED_SHARE", 0.0)
    monkeypatch.setattr(demos, "TWICE_SHARE", 0.0)
    task = _corpus_task(tmp_path, ONE_LINE)
    plain = demo_plan(task, LINE_SOLUTION, recovery=False)
    assert plain.untrained == plain.must_fail == ()
    # the fix and its rerun share a message: one turn per attempt
    assert f"<old>{CART_LINE}</old>" in plain.turns[-2] and "<run_terminal>" in plain.turns[-2]
    assert plain.turns[-2].index("</edit_file>") < plain.turns[-2].index("<run_terminal>")
    plan = demo_plan(task, LINE_SOLUTION, recovery=True)
    assert len(plan.turns) == len(plain.turns) + 1 <= DEMO_MAX_TURNS
    (k,) = plan.untrained
    assert plan.must_fail == (k,)
    wrong = wrong_fix(task, LINE_FIX)
    assert wrong is not None and wrong not in (CART_LINE, LINE_FIX["new"])
    assert wrong.startswith("        return ")  # a change inside the broken line
    # the wrong edit with its rerun, the edit that corrects it with the same rerun, the answer
    assert f"<old>{CART_LINE}</old>" in plan.turns[k] and f"<new>{wrong}</new>" in plan.turns[k]
    assert f"<old>{wrong}</old>" in plan.turns[k + 1]
    assert f"<new>{LINE_FIX['new']}</new>" in plan.turns[k + 1]
    assert _rerun(plan.turns[k]) == _rerun(plan.turns[k + 1]) == _rerun(plain.turns[-2])
    assert "<" not in plan.turns[-1] and k + 3 == len(plan.turns)
    # the same task, seeded: the share of recoveries is drawn per task id
    assert demo_plan(task, LINE_SOLUTION) in (plain, plan)
    # a session that is already long gets no wrong edit (with its rerun it would not
    # fit the turn budget), and nothing at all where the unchanged edit would not fit
    q = "`tests/test_cart.py::test_subtotal` started failing. Output:\n\n```\nE  assert 1 == 2\n```\n"
    long_plain = demo_plan(_corpus_task(tmp_path, q), LINE_SOLUTION, recovery=False)
    monkeypatch.setattr(demos, "DEMO_MAX_TURNS", len(long_plain.turns))
    long = demo_plan(_corpus_task(tmp_path, q), LINE_SOLUTION, recovery=True)
    assert long.untrained == long.must_fail == () and long.turns == long_plain.turns
    # nor a fix whose lines are not in the file
    assert wrong_fix(task, {**LINE_FIX, "old": "        return 0"}) is None


def test_a_recovery_demo_may_try_two_wrong_changes_before_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(demos, "UNCHANGED_SHARE", 0.0)
    monkeypatch.setattr(demos, "TWICE_SHARE", 1.0)
    task = _corpus_task(tmp_path, ONE_LINE)
    plain = demo_plan(task, LINE_SOLUTION, recovery=False)
    plan = demo_plan(task, LINE_SOLUTION, recovery=True)
    first, second = demos.wrong_fixes(task, LINE_FIX, 2)
    assert len({first, second, CART_LINE, LINE_FIX["new"]}) == 4
    assert len(plan.turns) == len(plain.turns) + 2 <= DEMO_MAX_TURNS
    k, j = plan.untrained
    assert plan.must_fail == (k, j) and j == k + 1
    # each attempt edits what the last one left, and reruns the test in the same message
    assert f"<old>{CART_LINE}</old>" in plan.turns[k] and f"<new>{first}</new>" in plan.turns[k]
    assert f"<old>{first}</old>" in plan.turns[j] and f"<new>{second}</new>" in plan.turns[j]
    assert f"<old>{second}</old>" in plan.turns[j + 1]
    assert f"<new>{LINE_FIX['new']}</new>" in plan.turns[j + 1]
    assert all(_rerun(plan.turns[i]) == _rerun(plain.turns[-2]) for i in (k, j, j + 1))
    # where two do not fit the budget, one does
    monkeypatch.setattr(demos, "DEMO_MAX_TURNS", len(plain.turns) + 1)
    assert len(demo_plan(task, LINE_SOLUTION, recovery=True).untrained) == 1


def test_an_unchanged_edit_demo_is_refused_then_made_with_the_change(tmp_path, monkeypatch):
    """The trained policy's commonest failure, played and left out of the loss: the
    turn says the change and sends <old> back as <new>; the next makes the edit."""
    monkeypatch.setattr(demos, "UNCHANGED_SHARE", 1.0)
    task = _corpus_task(tmp_path, ONE_LINE)
    plain = demo_plan(task, LINE_SOLUTION, recovery=False)
    plan = demo_plan(task, LINE_SOLUTION, recovery=True)
    assert len(plan.turns) == len(plain.turns) + 1 <= DEMO_MAX_TURNS
    (k,) = plan.untrained
    assert plan.must_fail == ()
    assert f"<old>{CART_LINE}</old>\n<new>{CART_LINE}</new>" in plan.turns[k]
    assert "`p` should be `p * q`" in plan.turns[k]  # it said the change, then dropped it
    assert _rerun(plan.turns[k]) == _rerun(plain.turns[-2])
    assert plan.turns[k + 1].split("\n", 1)[1] == plain.turns[-2].split("\n", 1)[1]
    said = plan.turns[k + 1].split("\n", 1)[0]
    assert "<" not in said and "`p` should be `p * q`" in said
    assert plan.turns[k + 2 :] == plain.turns[-1:]
    assert k in plan.grounded  # the failing turn quotes the run, as a plain one does


TWICE_CART = CART + "\n    def prices(self):\n" + CART_LINE + "\n"
WIDE_FIX = {
    "path": "shop/cart.py",
    "old": "    def subtotal(self):\n" + CART_LINE + "\n",
    "new": "    def subtotal(self):\n" + LINE_FIX["new"] + "\n",
    "line": 6,
}
WIDE_SOLUTION = {**SOLUTION, "edits": [WIDE_FIX]}


def test_an_ambiguous_line_demo_sends_it_alone_then_quotes_the_lines_around_it(
    tmp_path, monkeypatch
):
    """The policy's second failure, played and left out of the loss: the broken line
    alone, which the file holds twice; the next turn sends the solution's wider edit."""
    monkeypatch.setattr(demos, "AMBIGUOUS_SHARE", 1.0)
    task = _corpus_task(tmp_path, ONE_LINE, cart=TWICE_CART)
    assert demos.ambiguous_line(task, WIDE_FIX) == (CART_LINE, LINE_FIX["new"], 2)
    plain = demo_plan(task, WIDE_SOLUTION, recovery=False)
    plan = demo_plan(task, WIDE_SOLUTION, recovery=True)
    assert len(plan.turns) == len(plain.turns) + 1 <= DEMO_MAX_TURNS
    (k,) = plan.untrained
    assert plan.must_fail == () and k in plan.grounded
    alone = f"<old>{CART_LINE}</old>\n<new>{LINE_FIX['new']}</new>"
    assert alone in plan.turns[k] and _rerun(plan.turns[k]) == _rerun(plain.turns[-2])
    said, calls = plan.turns[k + 1].split("\n", 1)
    assert "<" not in said and "2" in said and "line 6" in said
    assert calls == plain.turns[-2].split("\n", 1)[1]  # the wide edit and the rerun
    assert plan.turns[k + 2 :] == plain.turns[-1:]
    # not drawn: another recovery; a line the file holds once: never
    monkeypatch.setattr(demos, "AMBIGUOUS_SHARE", 0.0)
    assert alone not in "".join(demo_plan(task, WIDE_SOLUTION, recovery=True).turns)
    once = _corpus_task(tmp_path, ONE_LINE)
    assert demos.ambiguous_line(once, WIDE_FIX) is None
    assert demos.ambiguous_line(task, LINE_FIX) is None  # nothing around the line to quote


def test_untrained_turns_stay_in_the_context_out_of_the_loss():
    turns = [
        Turn(prompt_ids=[1, 2], completion_ids=[3, 4], logprobs=[0.0, 0.0]),
        Turn(prompt_ids=[1, 2, 3, 4, 5], completion_ids=[6], logprobs=[0.0], trained=False),
        Turn(prompt_ids=[1, 2, 3, 4, 5, 6, 7], completion_ids=[8, 9], logprobs=[0.0, 0.0]),
    ]
    (s,) = samples_from_rollout(Rollout(task_id="t", turns=turns), 1.0)
    assert s.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert s.mask == [0, 0, 1, 1, 0, 0, 0, 1, 1]
    # from a stored trace: the turns its meta names (numbered from 1, as sessions do)
    trace = {
        "status": "completed",
        "meta": {"accepted": True, "untrained_turns": [2]},
        "turns": [
            {
                "turn": i + 1,
                "prompt_token_ids": t.prompt_ids,
                "completion_token_ids": t.completion_ids,
                "completion_logprobs": t.logprobs,
            }
            for i, t in enumerate(turns)
        ],
    }
    (s2,) = samples_from_traces([trace]).samples
    assert s2.input_ids == s.input_ids and s2.mask == s.mask


def test_edit_turns_weigh_more_in_the_loss_when_asked():
    def turn(n, ids, out):
        return {
            "turn": n,
            "prompt_token_ids": ids,
            "completion_token_ids": out,
            "completion_logprobs": [0.0] * len(out),
        }

    trace = {
        "status": "completed",
        "meta": {"accepted": True, "untrained_turns": [2]},
        "turns": [
            turn(1, [1], [2, 3]),
            turn(2, [1, 2, 3, 4], [5]),
            turn(3, [1, 2, 3, 4, 5, 6], [7]),
        ],
        "tool_calls": [
            {"turn": 1, "name": "read_file"},
            {"turn": 2, "name": "edit_file"},  # untrained: stays out of the loss
            {"turn": 3, "name": "edit_file"},
        ],
    }
    (plain,) = samples_from_traces([trace]).samples
    (weighted,) = samples_from_traces([trace], edit_weight=3).samples
    assert plain.mask == [0, 1, 1, 0, 0, 0, 1]
    assert weighted.mask == [0, 1, 1, 0, 0, 0, 3]
    with pytest.raises(ValueError, match="at least 1"):
        samples_from_traces([trace], edit_weight=0)


CART_WORKSPACE = {
    "shop/__init__.py": "",
    "shop/cart.py": CART,
    "tests/test_cart.py": (
        "from shop.cart import Cart\n\n\n"
        "def test_subtotal():\n"
        "    cart = Cart()\n"
        "    cart.items += [(2.0, 3), (1.0, 1)]\n"
        "    assert cart.subtotal() == 7.0\n"
    ),
}


def cart_task(tmp_path, *, split, cart=CART, solution=None):
    """The cart workspace as a task folder (one-line request, the line fix as solution,
    or ``cart`` as ``shop/cart.py`` with its ``solution``)."""
    repo = tmp_path / "repo"
    for name, text in {**CART_WORKSPACE, "shop/cart.py": cart}.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    folder = write_task(
        tmp_path / "task",
        query=ONE_LINE,
        verify="python -m pytest -q -p no:cacheprovider tests/test_cart.py",
        repo_dir=repo,
        protect=["tests/test_cart.py"],
        split=split,
        source="corpus:cart",
    )
    solution = solution or {**LINE_SOLUTION, "answer": "Fixed."}
    (folder / "solution.json").write_text(json.dumps(solution))
    return load_task(folder)


def recovery_in_sandbox(tmp_path, tokenizer, monkeypatch, *, unchanged: float):
    """The cart task's recovery demonstration (``UNCHANGED_SHARE`` = ``unchanged``)
    recorded in the sandbox: the task, the untrained turn's index in the plan, the
    stored trace and the text SFT trains on."""
    task = cart_task(tmp_path, split="train")
    monkeypatch.setattr(demos, "RECOVERY_SHARE", 1.0)
    monkeypatch.setattr(demos, "UNCHANGED_SHARE", unchanged)
    monkeypatch.setattr(demos, "TWICE_SHARE", 0.0)
    (k,) = demo_plan(task, load_solution(task)).untrained
    store = TraceStore(tmp_path / "demos.db")
    stats = record_in_sandbox([task], store, tmp_path)
    assert stats.accepted == stats.recorded == 1, stats.failed
    (sid,) = stats.session_ids
    tr = store.export(sid)
    store.close()
    assert tr["meta"]["untrained_turns"] == [k + 1]
    (s,) = samples_from_traces([tr], tokenizer=tokenizer).samples
    trained = tokenizer.chat.hf.decode([i for i, m in zip(s.input_ids, s.mask, strict=True) if m])
    return task, k, tr, trained


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_a_recovery_demo_through_the_real_session(tmp_path, tokenizer, monkeypatch):
    """Played in the sandbox: the wrong edit applies, its rerun fails (checked, or the
    demo is not accepted), the correction passes; SFT learns every turn but the wrong one."""
    task, k, tr, trained = recovery_in_sandbox(tmp_path, tokenizer, monkeypatch, unchanged=0.0)
    runs = {c["turn"]: c["status"] for c in tr["tool_calls"] if c["name"] == "run_terminal"}
    # the rerun in the wrong edit's message fails, the one beside the correction passes
    assert runs == {1: "error", k + 1: "error", k + 2: "ok"}
    wrong = wrong_fix(task, LINE_FIX)
    assert f"<new>{wrong}</new>" not in trained and f"<old>{wrong}</old>" in trained
    assert trained == "".join(t["text"] + "<|im_end|>" for t in tr["turns"] if t["turn"] != k + 1)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_an_unchanged_edit_demo_through_the_real_session(tmp_path, tokenizer, monkeypatch):
    """Played in the sandbox: the tool refuses the unchanged edit, the next edit
    applies and the test passes; SFT learns every turn but the refused one."""
    _, k, tr, trained = recovery_in_sandbox(tmp_path, tokenizer, monkeypatch, unchanged=1.0)
    edits = [(c["turn"], c["status"]) for c in tr["tool_calls"] if c["name"] == "edit_file"]
    assert edits == [(k + 1, "error"), (k + 2, "ok")]
    assert f"<new>{CART_LINE}</new>" not in trained and f"<new>{LINE_FIX['new']}</new>" in trained


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_an_ambiguous_line_demo_through_the_real_session(tmp_path, tokenizer, monkeypatch):
    """Played in the sandbox: the tool refuses the line alone and lists both places,
    the wider edit applies and the test passes; SFT learns every turn but the refused one."""
    monkeypatch.setattr(demos, "AMBIGUOUS_SHARE", 1.0)
    monkeypatch.setattr(demos, "RECOVERY_SHARE", 1.0)
    task = cart_task(tmp_path, split="train", cart=TWICE_CART, solution=WIDE_SOLUTION)
    (k,) = demo_plan(task, load_solution(task)).untrained
    store = TraceStore(tmp_path / "demos.db")
    stats = record_in_sandbox([task], store, tmp_path)
    assert stats.accepted == stats.recorded == 1, stats.failed
    tr = store.export(stats.session_ids[0])
    store.close()
    assert tr["meta"]["untrained_turns"] == [k + 1]
    edits = [c for c in tr["tool_calls"] if c["name"] == "edit_file"]
    assert [(c["turn"], c["status"]) for c in edits] == [(k + 1, "error"), (k + 2, "ok")]
    assert "matches 2 times (at lines 6, 9)" in edits[0]["result"]
    assert "    5\t    def subtotal(self):\n    6\t" + CART_LINE in edits[0]["result"]
    (s,) = samples_from_traces([tr], tokenizer=tokenizer).samples
    trained = tokenizer.chat.hf.decode([i for i, m in zip(s.input_ids, s.mask, strict=True) if m])
    assert (
        f"<old>{CART_LINE}</old>" not in trained and "def subtotal(self):\n" + CART_LINE in trained
    )


def test_demonstrations_come_from_the_demo_suite_when_one_is_named(tmp_path, monkeypatch):
    """`[sft] demo_suite` names what is demonstrated (e.g. every training task once per
    request kind); without it the run's own training tasks are; a suite that does not
    load is one clear configuration error."""
    from types import SimpleNamespace

    from opencomposer.training import catalog
    from opencomposer.training import sft as sftmod
    from opencomposer.training.config import ConfigError, SftSection

    seen = []

    def fake_pending(store, tasks, **kw):
        seen.append(list(tasks))
        return []

    monkeypatch.setattr(sftmod, "pending", fake_pending)
    monkeypatch.setattr(catalog, "load_suite", lambda name: [f"{name}/a", f"{name}/b"])

    def run(suite):
        cfg = SimpleNamespace(
            sft=SftSection(source="demos", demo_suite=suite), run=SimpleNamespace(seed=0)
        )
        return SimpleNamespace(config=cfg, tasks=["own"], prompt_style="compact", env=None)

    asyncio.run(sftmod.ensure_demos(run(""), tmp_path / "a.db"))
    asyncio.run(sftmod.ensure_demos(run("corpus:train:all"), tmp_path / "b.db"))
    assert seen == [["own"], ["corpus:train:all/a", "corpus:train:all/b"]]

    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"\[sft\] demo_suite: no task suite 'nowhere'"):
        asyncio.run(sftmod.ensure_demos(run("nowhere"), tmp_path / "c.db"))


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        ("if x < y:", "if x <= y:", "`<` should be `<=`"),
        ("    return a and b", "    return a or b", "`and` should be `or`"),
        ("k = n // 2", "k = n / 2", "`//` should be `/`"),
        ("stop * 2.0", "stop * 1.0", "`2.0` should be `1.0`"),  # a number is one token
        ("return sum(p for p, q in s)", "return sum(p * q for p, q in s)", "`p` should be `p * q`"),
        ("f(a, b)", "f(b, a)", "`a, b` should be `b, a`"),
        ("if not a:", "if a:", "`if not` should be `if`"),  # a deletion names a neighbour
        ("return x", "return x[0]", "`x` should be `x[0]`"),
        ("x = 1", "x = 1", None),  # no change
        ("    y = a\n    z = b", "    y = a", None),  # a dropped line is not one short span
    ],
)
def test_the_fix_is_said_in_words_before_the_edit(old, new, said):
    from opencomposer.training.demos import change_words

    assert change_words(old, new) == said


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        (
            "        return None",
            "        return value",
            "in `return None`, `None` should be `value`",
        ),
        (
            "    if m:\n        return None",
            "    if not m:\n        return None",
            "in `if m:`, `if` should be `if not`",
        ),
        ("a, b", "b, a", "`a, b` should be `b, a`"),  # the whole line changes: no quote
        ("x = 1", "x = 1", None),
    ],
)
def test_the_said_change_quotes_the_line_it_changes(old, new, said):
    from opencomposer.training.demos import said_change

    assert said_change(old, new) == said


def test_the_fixing_turn_names_the_change_it_makes(tmp_path, monkeypatch):
    from opencomposer.training.demos import change_words, said_change

    task = _corpus_task(tmp_path, ONE_LINE)
    plain = demo_plan(task, LINE_SOLUTION, recovery=False)
    fix = plain.turns[-2]
    said = f"in `{CART_LINE.strip()}`, `p` should be `p * q`"
    assert said_change(CART_LINE, LINE_FIX["new"]) == said
    words = fix.split("<edit_file")[0]
    assert said[1:] in words  # "in" or "In", as the sentence starts
    # the line first, the kind of bug after it: the quote is what the edit copies
    assert words.index(said[1:]) < words.index(demos._kind_words(SOLUTION["kind"]))
    monkeypatch.setattr(demos, "TWICE_SHARE", 0.0)
    monkeypatch.setattr(demos, "UNCHANGED_SHARE", 0.0)
    plan = demo_plan(task, LINE_SOLUTION, recovery=True)
    (k,) = plan.untrained
    wrong = wrong_fix(task, LINE_FIX)
    # the wrong attempt says its own change; the correction says the right one
    said = plan.turns[k].split("<edit_file")[0]
    assert " should be `" in said and "`p * q`" not in said
    correction = plan.turns[k + 1].split("<edit_file")[0]
    assert wrong is not None and said_change(wrong, LINE_FIX["new"])[1:] in correction
    assert change_words(wrong, LINE_FIX["new"]) in correction


SHORT_TB = (
    "F\n"
    "=================================== FAILURES ===================================\n"
    "________________________________ test_subtotal _________________________________\n"
    "tests/test_cart.py:7: in test_subtotal\n"
    "    assert cart.subtotal() == 7.0\n"
    "{frame}"
    "E   AttributeError: 'Cart' object has no attribute 'itemz'\n"
)


@pytest.mark.parametrize(
    ("frames", "expected"),
    [
        ("shop/cart.py:6: in subtotal\n    return sum(p * q for p, q in self.itemz)\n", 6),
        # the sandbox's absolute path, and a deeper frame in another file
        (
            "/workspace/shop/cart.py:6: in subtotal\n    x\n/usr/lib/python3/x.py:9: in f\n",
            6,
        ),
        ("shop/cart.py:9: in total\n    return self.subtotal()\n", None),  # another line
        ("", None),  # a failed assertion in the test: the code is not in the traceback
        ("shop/cart.py:6: in subtotal\nshop/cart.py:9: in total\n", None),  # deepest wins
    ],
)
def test_the_traceback_site_is_the_deepest_frame_in_the_fixed_file(frames, expected):
    from opencomposer.training.demos import traceback_site

    sites = [("shop/cart.py", 6, "return x"), ("shop/other.py", 3, "y")]
    found = traceback_site(SHORT_TB.format(frame=frames), sites)
    assert (found and found[1]) == expected


def test_the_fixing_turn_says_where_the_traceback_points_when_it_points_at_the_fix(tmp_path):
    from opencomposer.agent.executor import CallRecord, format_results
    from opencomposer.tools.protocols import ToolResult
    from opencomposer.training.demos import TracebackTurn

    task = _corpus_task(tmp_path, ONE_LINE)
    plan = demo_plan(task, LINE_SOLUTION, recovery=False)
    (k,) = plan.grounded
    assert k == len(plan.turns) - 2  # the fixing turn
    turn = plan.played()[k]
    assert isinstance(turn, TracebackTurn) and plan.played()[0] == plan.turns[0]

    def results(output: str) -> Message:
        rec = CallRecord("c0", 1, 0, "run_terminal", {}, result=ToolResult.error(output))
        return Message(role="user", content=format_results([rec]), kind="tool_results")

    here = SHORT_TB.format(frame=f"shop/cart.py:6: in subtotal\n{CART_LINE}\n")
    said = turn([Message(role="user", content=ONE_LINE), results(here)])
    assert (
        said
        == f"The traceback points to line 6 of shop/cart.py: `{CART_LINE.strip()}`. "
        + (plan.turns[k])
    )
    # the latest run counts; an assertion failure in the test says nothing of the code,
    # so the turn quotes the error instead; without a run it is as planned
    later = results(SHORT_TB.format(frame=""))
    assert turn([results(here), later]) == (
        "The test fails with `AttributeError: 'Cart' object has no attribute 'itemz'`. "
        + plan.turns[k]
    )
    assert turn([Message(role="user", content=ONE_LINE)]) == plan.turns[k]
    assert turn([results("1 passed in 0.01s")]) == plan.turns[k]


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (SHORT_TB.format(frame=""), "AttributeError: 'Cart' object has no attribute 'itemz'"),
        # the first E line; backticks become quotes
        ("E   assert `a` == 3\nE    +  where 4 = f()\n", "assert 'a' == 3"),
        ("E   ValueError: " + "x" * 200, "ValueError: " + "x" * 107 + "…"),
        ("E\nERROR tests/test_a.py\n1 passed", None),  # no error text
        ("", None),
    ],
)
def test_the_failure_line_is_the_first_error_pytest_printed(output, expected):
    from opencomposer.training.demos import ERROR_CHARS, failure_line

    found = failure_line(output)
    assert found == expected and (found is None or len(found) <= ERROR_CHARS)


BROKEN_CART = CART.replace("sum(p for p, q in self.items)", "sum(p * q for p, q in self.itemz)")
ITEMZ_FIX = {
    "path": "shop/cart.py",
    "old": "        return sum(p * q for p, q in self.itemz)",
    "new": "        return sum(p * q for p, q in self.items)",
    "line": 6,
}


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_a_demo_reads_the_traceback_of_its_own_failing_run(tmp_path, monkeypatch):
    """Played in the sandbox: the test run raises in the broken line, so the recorded
    fixing turn starts by pointing at it, from the run's own output."""
    monkeypatch.setattr(demos, "RECOVERY_SHARE", 0.0)
    solution = {**SOLUTION, "kind": "wrong variable", "edits": [ITEMZ_FIX], "answer": "Fixed."}
    task = cart_task(tmp_path, split="train", cart=BROKEN_CART, solution=solution)
    store = TraceStore(tmp_path / "demos.db")
    stats = record_in_sandbox([task], store, tmp_path)
    assert stats.accepted == stats.recorded == 1, stats.failed
    tr = store.export(stats.session_ids[0])
    store.close()
    fixing = next(t["text"] for t in tr["turns"] if "<edit_file" in t["text"])
    line = ITEMZ_FIX["old"].strip()
    assert fixing.startswith(f"The traceback points to line 6 of shop/cart.py: `{line}`. ")
