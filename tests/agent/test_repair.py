"""Small edits the model proposes, tried against the failing command: where to look
(`enclosing`, `traceback_lines`, `focus`), the edits a language model proposes
(`propose`), and a session that makes the edit that passes in place of its own, with a
test-double model whose predictions come from a character n-gram model of code."""

import asyncio
import functools
import math
from collections import Counter, defaultdict

from opencomposer.agent import repair
from opencomposer.agent.backends.scripted import ScriptedModel
from opencomposer.agent.session import Session, SessionConfig
from opencomposer.tools.workspace import LocalWorkspace

CALC = (
    '"""Arithmetic."""\n'
    "\n"
    "LIMIT = 10\n"
    "\n"
    "\n"
    "class Box:\n"
    "    size: int = 3\n"
    "\n"
    "    def grow(self, n):\n"
    "        # bigger\n"
    "        return self.size + n\n"
    "\n"
    "\n"
    "def add(a, b):\n"
    "    return a - b\n"
)


def test_enclosing_is_the_innermost_function_or_the_statement():
    assert repair.enclosing(CALC, 14, "calc.py") == (13, 15)  # add, from its def
    assert repair.enclosing(CALC, 10, "calc.py") == (8, 11)  # the method, not the class
    assert repair.enclosing(CALC, 6, "calc.py") == (6, 7)  # a class's field
    assert repair.enclosing(CALC, 2, "calc.py") == (2, 3)  # a module's constant
    for nothing in (1, 9, 40, -1):  # a blank line, a comment, past the end
        assert repair.enclosing(CALC, nothing, "calc.py") is None
    text = "".join(f"line {i}\n" for i in range(30))
    assert repair.enclosing(text, 20, "notes.txt") == (12, 29)


def test_traceback_lines_are_the_workspaces_own_innermost_first(tmp_path):
    out = (
        f'  File "{tmp_path}/tests/test_calc.py", line 5, in test_add\n'
        "    assert add(2, 3) == 5\n"
        f'  File "{tmp_path}/calc.py", line 15, in add\n'
        '  File "/usr/lib/python3.11/functools.py", line 3, in wrapper\n'
        "pkg/mod.py:12: in helper\n"
    )
    assert repair.traceback_lines(out, str(tmp_path)) == [
        ("pkg/mod.py", 11),
        ("calc.py", 14),
        ("tests/test_calc.py", 4),
    ]


def test_focus_takes_each_function_once_and_leaves_tests_out():
    texts = {"calc.py": CALC, "tests/test_calc.py": "def test_add():\n    assert 1\n"}
    lines = [("tests/test_calc.py", 1), ("calc.py", 14), ("calc.py", 13), ("calc.py", 10)]
    lines += [("calc.py", 9), ("missing.py", 3), ("calc.py", 6)]
    assert repair.focus(texts, lines) == [
        repair.Span("calc.py", 13, 15),
        repair.Span("calc.py", 8, 11),
        repair.Span("calc.py", 6, 7),
    ]
    assert repair.focus(texts, lines, limit=4) == [
        repair.Span("calc.py", 13, 15),
        repair.Span("calc.py", 6, 7),
    ]


class Chars:
    """A tokenizer whose tokens are characters (id = code point + 1; 0 begins a text)."""

    bos_id = 0
    special_ids = frozenset({0})

    def encode(self, text):
        return [ord(c) + 1 for c in text]

    def decode(self, ids):
        return "".join(chr(i - 1) for i in ids if i > 0)


class NGram:
    """A real language model, if a tiny one: characters after the 5 before them, counted
    in the code it was given, with add-0.01 smoothing over the characters it has seen."""

    ORDER = 5

    def __init__(self, code):
        self.tok = Chars()
        self.counts = defaultdict(Counter)
        text = "\0" * self.ORDER + code
        for i in range(self.ORDER, len(text)):
            for n in range(self.ORDER + 1):
                self.counts[text[i - n : i]][text[i]] += 1
        self.vocab = sorted(set(code))

    def dist(self, before):
        for n in range(self.ORDER, -1, -1):
            seen = self.counts.get(before[len(before) - n :] if n else "")
            if seen:
                total = sum(seen.values()) + 0.01 * len(self.vocab)
                return {c: math.log((seen[c] + 0.01) / total) for c in self.vocab}
        raise AssertionError("the empty context is always seen")

    def _text(self, ids):
        return "\0" * self.ORDER + self.tok.decode(ids)

    async def top_tokens(self, ids, first, k):
        rows = []
        for i in range(first, len(ids)):
            d = self.dist(self._text(ids[:i]))
            top = sorted(d.items(), key=lambda x: -x[1])[:k]
            here = d.get(chr(ids[i] - 1), math.log(1e-6))
            rows.append((here, [(ord(c) + 1, lp) for c, lp in top]))
        return rows

    async def greedy(self, prefixes, max_tokens, until):
        outs = []
        for ids, end in zip(prefixes, until, strict=True):
            got = []
            while len(got) < max_tokens:
                d = self.dist(self._text(ids + got))
                got.append(ord(max(d, key=d.get)) + 1)
                if got[-1] == end:
                    break
            outs.append(got)
        return outs

    async def logprob(self, context, text):
        before = self._text(self.tok.encode(context))
        total = 0.0
        for c in text:
            total += self.dist(before).get(c, math.log(1e-6))
            before += c
        return total


# What the model has read: code where `<=` follows `if lo` and pairs are multiplied.
KNOWN = (
    "def first(lo, hi):\n    if lo <= hi:\n        return lo\n    return hi\n\n"
    "def last(lo, hi):\n    if lo <= hi:\n        return hi\n    return lo\n\n"
    "def cost(pairs):\n    return sum(p * q for p, q in pairs)\n\n"
    "def costs(pairs):\n    return sum(p * q for p, q in pairs)\n\n"
)


async def test_propose_finds_the_edits_the_model_expects():
    lm = NGram(KNOWN)
    text = "def pick(lo, hi):\n    if lo < hi:\n        return lo\n    return hi\n"
    got = await repair.propose(lm, lm.tok, {"m.py": text}, [repair.Span("m.py", 0, 4)])
    assert got, "no proposal"
    best = got[0]
    assert best.after == text.replace("lo < hi", "lo <= hi")
    assert (best.old, best.new) == ("    if lo < hi:\n", "    if lo <= hi:\n")
    exact = [p for p in got if p.exact]
    assert got[: len(exact)] == exact  # those scored exactly first, best first
    assert best.gain > 0 and all(a.gain >= b.gain for a, b in zip(exact, exact[1:], strict=False))
    for p in got:  # every proposal compiles and keeps the names it defines
        assert p.after != text and "def pick(lo," in p.after and " hi):" in p.after
        compile(p.after, "m.py", "exec")
    # an insertion of several tokens, continued until the model meets the code again
    text = "def total(pairs):\n    return sum(p for p, q in pairs)\n"
    got = await repair.propose(lm, lm.tok, {"t.py": text}, [repair.Span("t.py", 0, 2)])
    fixed = text.replace("sum(p for", "sum(p * q for")
    assert fixed in [p.after for p in got]


async def test_past_the_exact_scores_come_more_edits_by_first_order_gain():
    lm = NGram(KNOWN)
    text = "def pick(lo, hi):\n    if lo < hi:\n        return lo\n    return hi\n"
    span = [repair.Span("m.py", 0, 4)]
    got = await repair.propose(lm, lm.tok, {"m.py": text}, span, rescore=0, tail=64)
    assert got and not any(p.exact for p in got) and len(got) <= 64
    assert all(a.gain >= b.gain for a, b in zip(got, got[1:], strict=False))
    assert text.replace("lo < hi", "lo <= hi") in [p.after for p in got]
    some = await repair.propose(lm, lm.tok, {"m.py": text}, span, rescore=4, tail=8)
    assert [p.exact for p in some] == [True] * 4 + [False] * (len(some) - 4)
    # the tail goes on where the exact scores stop, in first-order order
    assert [p.after for p in some[4:]] == [p.after for p in got[4 : len(some)]]


async def test_edits_known_to_have_been_tried_give_way_to_the_next():
    lm = NGram(KNOWN)
    text = "def pick(lo, hi):\n    if lo < hi:\n        return lo\n    return hi\n"
    span = [repair.Span("m.py", 0, 4)]
    got = await repair.propose(lm, lm.tok, {"m.py": text}, span, tail=12)
    assert len(got) == 12
    tried = {(p.path, p.after) for p in got[:4]}
    asked: list[tuple[str, str]] = []

    def known(path, after):
        asked.append((path, after))
        return (path, after) in tried

    again = await repair.propose(lm, lm.tok, {"m.py": text}, span, tail=8, known=known)
    # the four tried are left out, not counted: the eight after them come in their place
    assert [p.after for p in again] == [p.after for p in got[4:]]
    assert tried <= set(asked)


class Counted(NGram):
    """The n-gram model, counting the reads asked of it (positions and continuations)."""

    def __init__(self, code):
        super().__init__(code)
        self.reads = 0

    async def top_tokens(self, ids, first, k):
        self.reads += len(ids) - first
        return await super().top_tokens(ids, first, k)

    async def greedy(self, prefixes, max_tokens, until):
        self.reads += len(prefixes)
        return await super().greedy(prefixes, max_tokens, until)


async def test_a_remembered_model_answers_a_repeated_repair_from_memory():
    """A later repair of the same code makes the same reads: answered from memory, it
    asks the model nothing, and proposes what the model itself would have."""
    text = "def pick(lo, hi):\n    if lo < hi:\n        return lo\n    return hi\n"
    span = [repair.Span("m.py", 0, 4)]
    lm = Counted(KNOWN)
    memo = repair.Remembered(lm)
    first = await repair.propose(memo, lm.tok, {"m.py": text}, span, tail=4)
    read, asked = lm.reads, memo.asked
    assert read > 0 and memo.reused == 0
    tried = {p.after for p in first}
    again = await repair.propose(
        memo, lm.tok, {"m.py": text}, span, tail=4, known=lambda path, after: after in tried
    )
    assert lm.reads == read  # every read, from memory
    assert memo.asked - asked == memo.reused == asked
    plain = await repair.propose(
        NGram(KNOWN), lm.tok, {"m.py": text}, span, tail=4, known=lambda p, a: a in tried
    )
    assert [p.after for p in again] == [p.after for p in plain] and not tried & {
        p.after for p in again
    }
    # other code is read anew; a small memory forgets the least recently used
    other = text.replace("return hi", "return 0")
    await repair.propose(memo, lm.tok, {"m.py": other}, span, tail=4)
    assert lm.reads > read
    small = repair.Remembered(Counted(KNOWN), limit=1)
    await small.top_tokens([1, 2, 3], 1, 2)
    await small.top_tokens([1, 2, 4], 1, 2)
    await small.top_tokens([1, 2, 3], 1, 2)
    assert small.reused == 0 and small.lm.reads == 6


async def test_the_model_may_write_the_rest_of_a_line_anew():
    # `ratio(b, a)` for `ratio(a, b)`: no one-token edit undoes a swap, but after `a` in
    # place of `b` the model writes `, b)` to the end of the line
    lm = NGram("def f(a, b):\n    return ratio(a, b)\n\n" * 3)
    text = "def g(a, b):\n    return ratio(b, a)\n"
    got = await repair.propose(lm, lm.tok, {"m.py": text}, [repair.Span("m.py", 0, 2)])
    assert text.replace("ratio(b, a)", "ratio(a, b)") in [p.after for p in got]


async def test_each_proposal_says_where_its_first_order_gain_is_read():
    # what RL on the ranking (`training/repairrl.py`) recomputes from the model's odds:
    # every tail proposal's gain is `first_order_gain` over the rows of its site
    lm = NGram(KNOWN)
    text = (
        "def pick(lo, hi):\n    if lo < hi:\n        return lo\n    return hi\n\n"
        "def total(pairs):\n    return sum(p for p, q in pairs)\n"
    )
    spans = [repair.Span("m.py", 0, 4), repair.Span("m.py", 5, 7)]
    got = await repair.propose(lm, lm.tok, {"m.py": text}, spans, rescore=0, tail=400)
    prompts = repair.site_prompts(lm.tok, {"m.py": text}, spans)
    assert len(prompts) == 1  # the two functions are read as one text, one site
    prompt, offset = prompts[0]
    body = prompt[offset:]
    assert lm.tok.decode(body) == text
    full = {}  # log P(every character | the text before it), by body position

    def lp(j, t):
        if j not in full:
            full[j] = lm.dist(lm._text(prompt[: offset + j]))
        return full[j].get(chr(t - 1), math.log(1e-6))

    hows = set()
    for p in got:
        assert p.first is not None and p.first.site == 0
        hows.add(p.first.how)
        gain = repair.first_order_gain(p.first, body, lp)
        if p.first.how == repair.DROP:  # where the token after is not among the top
            # tokens, `_edits` takes the last of those less a nat for its odds
            assert p.gain - 1e-9 <= gain <= p.gain + 1.0 + 1e-9
        else:
            assert math.isclose(gain, p.gain, abs_tol=1e-9), p
    assert hows == {repair.SUB, repair.INS, repair.DROP}
    # the fix's gain is read where it changes the code: after `lo <`, `=` put before ` hi`
    fix = next(p for p in got if p.after == text.replace("lo < hi", "lo <= hi"))
    assert fix.first.how == repair.INS and fix.first.at == text.index(" hi:")


def test_an_edit_is_placed_where_propose_would_begin_it():
    lm = NGram(KNOWN)
    text = "def pick(lo, hi):\n    if lo < hi:\n        return lo\n    return hi\n\nX = 1\n"
    texts, spans = {"m.py": text}, [repair.Span("m.py", 0, 4)]

    def first(after):
        return repair.first_edit(lm.tok, texts, spans, "m.py", after)

    at = text.index(" hi:")
    assert first(text.replace("lo < hi", "lo <= hi")) == repair.FirstOrder(
        0, at, repair.INS, ord("=") + 1
    )
    lt = text.index("< hi")
    assert first(text.replace("lo < hi", "lo > hi")) == repair.FirstOrder(
        0, lt, repair.SUB, ord(">") + 1
    )
    assert first(text.replace("return lo", "return")) == repair.FirstOrder(
        0, text.index(" lo\n"), repair.DROP, -1
    )
    assert first(text.replace("X = 1", "X = 2")) is None  # outside the code in focus
    assert first(text) is None
    # the one `propose` makes of the fix starts where `first_edit` says
    got = asyncio.run(repair.propose(lm, lm.tok, texts, spans))
    fix = next(p for p in got if p.after == text.replace("lo < hi", "lo <= hi"))
    assert fix.first == first(fix.after)


def test_the_spans_of_a_file_are_read_one_after_another(monkeypatch):
    tok = Chars()
    other = "X = 1\n\ndef g():\n    return X\n"
    texts = {"calc.py": CALC, "other.py": other}
    spans = [repair.Span("calc.py", 8, 11), repair.Span("calc.py", 13, 15)]
    spans.append(repair.Span("other.py", 2, 4))
    first, second, third = repair._sites(tok, texts, spans)
    # the first reads the code above it; the second, the first's text and then its own,
    # not the code between them
    above = tok.encode("".join(CALC.splitlines(keepends=True)[:8]))
    assert first.prompt == above + first.ids and first.offset == len(above)
    assert second.prompt == first.prompt + second.ids
    assert second.offset == len(first.prompt)
    assert tok.decode(second.ids) == "def add(a, b):\n    return a - b\n"
    # another file starts again from its own code above
    assert third.prompt == tok.encode("X = 1\n\n") + third.ids
    # past CHAIN_TOKENS, a span is read after its own code above again
    monkeypatch.setattr(repair, "CHAIN_TOKENS", len(first.prompt))
    _, alone, _ = repair._sites(tok, texts, spans)
    head = "".join(CALC.splitlines(keepends=True)[:13])
    assert alone.prompt == tok.encode(head) + alone.ids


async def test_edits_are_proposed_in_every_span_of_a_file():
    lm = NGram(KNOWN)
    text = (
        "def pick(lo, hi):\n    if lo < hi:\n        return lo\n    return hi\n\n\n"
        "def total(pairs):\n    return sum(p for p, q in pairs)\n"
    )
    spans = [repair.Span("m.py", 6, 8), repair.Span("m.py", 0, 4)]
    got = [p.after for p in await repair.propose(lm, lm.tok, {"m.py": text}, spans)]
    assert text.replace("lo < hi", "lo <= hi") in got
    assert text.replace("sum(p for", "sum(p * q for") in got


async def test_comments_and_docstrings_are_not_edited():
    # the model knows the comment and docstring as written elsewhere, so editing them
    # would look likely; they change nothing the code does, so they are not proposed
    known = 'def f(a, b):\n    """Add them."""\n    return a + b  # the sum\n\n' * 3
    lm = NGram(known)
    text = 'def f(a, b):\n    """Add the."""\n    return a - b  # the sun\n'
    got = await repair.propose(lm, lm.tok, {"m.py": text}, [repair.Span("m.py", 0, 3)])
    assert got, "no proposal"
    for p in got:
        assert '"""Add the."""' in p.after and "# the sun" in p.after
    assert text.replace("a - b", "a + b") in [p.after for p in got]


async def test_an_old_that_occurs_twice_takes_the_lines_around_it():
    lm = NGram(KNOWN)
    text = "def a(lo, hi):\n    if lo < hi:\n        return lo\n    if lo < hi:\n        return 0\n"
    got = await repair.propose(lm, lm.tok, {"m.py": text}, [repair.Span("m.py", 0, 5)])
    for p in got:
        assert text.count(p.old) == 1 and p.after == text.replace(p.old, p.new)


class Repairing(ScriptedModel):
    """Scripted turns, with an n-gram model's predictions for the repair."""

    def __init__(self, turns, code):
        super().__init__(turns)
        self.lm = NGram(code)
        self.tokenizer = self.lm.tok

    async def top_tokens(self, ids, first, k):
        return await self.lm.top_tokens(ids, first, k)

    async def greedy(self, prefixes, max_tokens, until):
        return await self.lm.greedy(prefixes, max_tokens, until)

    async def logprob(self, context, text):
        return await self.lm.logprob(context, text)


PICK = "def pick(lo, hi):\n    if lo < hi:\n        return lo\n    return 0\n"
CHECK = "python3 -c 'import m; assert m.pick(2, 2) == 2 and m.pick(3, 1) == 0'"


def repairing(**config):
    """A session that repairs, given the time its trial runs need on a loaded machine:
    these tests are of what the repair finds, not of how fast it finds it (about 20
    sandboxed runs take 40 s of the default 60 a turn on an idle 2-core machine)."""
    return SessionConfig(approve="all", repair=True, verify_s=300.0, **config)


def run(command):
    return f"<run_terminal><command>{command}</command></run_terminal>"


def edit(old, new, path="m.py"):
    return f'<edit_file path="{path}">\n<old>{old}</old>\n<new>{new}</new>\n</edit_file>'


async def test_a_change_that_fails_the_check_is_replaced_by_an_edit_that_passes(repo, store):
    """The model reproduced the failure and sends a wrong change with a rerun: the
    change fails the check in a trial run, the model's own proposed edit passes it, so
    that edit is made, the rerun kept, and the trace says what was replaced."""
    (repo / "m.py").write_text(PICK)
    wrong = edit("        return lo", "        return hi")
    model = Repairing(
        ["Reproducing.\n" + run(CHECK), "The fix.\n" + wrong + "\n" + run(CHECK), "Fixed."],
        KNOWN,
    )
    cfg = repairing()
    session = Session(model=model, workspace=LocalWorkspace(repo), config=cfg, traces=store)
    result = await session.run("fix pick")
    assert result.status == "completed"
    assert (repo / "m.py").read_text() == PICK.replace("lo < hi", "lo <= hi")
    turn = result.turns[1]
    assert [c.name for c in turn.calls] == ["edit_file", "run_terminal"]
    assert turn.calls[0].args["new"] == "    if lo <= hi:\n"
    assert turn.calls[1].result.meta["exit_code"] == 0  # the rerun, kept, passes
    meta = turn.output.meta["repair"]
    assert meta["command"] == CHECK and meta["runs"] >= 2 and wrong in meta["replaced"]
    assert turn.output.completion_token_ids is None  # not the model's tokens: no sample
    assert store.export(result.session_id)["turns"][1]["meta"]["repair"]["runs"] == meta["runs"]
    assert not list(repo.rglob("__pycache__"))  # the trial runs wrote nothing


async def test_no_repair_when_the_change_passes_or_repair_is_off(repo):
    right = edit("    if lo < hi:", "    if not lo > hi:")
    for cfg, change, after in (
        (repairing(), right, "    if not lo > hi:"),
        (SessionConfig(approve="all"), edit("        return lo", "        return hi"), None),
        (
            SessionConfig(approve="all", repair=True, verify_s=0),
            edit("    return 0", "    return 1"),
            None,
        ),
    ):
        (repo / "m.py").write_text(PICK)
        model = Repairing([run(CHECK), change, "Done."], KNOWN)
        result = await Session(model=model, workspace=LocalWorkspace(repo), config=cfg).run("fix")
        text = (repo / "m.py").read_text()
        assert "lo <= hi" not in text, cfg
        if after:
            assert after in text
        assert "repair" not in result.turns[1].output.meta, cfg


async def read_twice(repo, store):
    """A session on PICK that reproduces the failure, then reads m.py in two turns."""
    (repo / "m.py").write_text(PICK)
    read = '<read_file path="m.py"/>'
    model = Repairing([run(CHECK), "Reading.\n" + read, "Again.\n" + read, "Fixed."], KNOWN)
    cfg = repairing()
    session = Session(model=model, workspace=LocalWorkspace(repo), config=cfg, traces=store)
    result = await session.run("fix pick")
    assert (repo / "m.py").read_text() == PICK.replace("lo < hi", "lo <= hi")
    return result


async def test_a_reply_that_changes_nothing_gets_the_edit_that_passes(repo, store):
    """While the check fails, a turn that only reads gets the model's own edit that
    passes the check added after its calls; once the code passes, nothing is added."""
    result = await read_twice(repo, store)
    turn = result.turns[1]
    assert [c.name for c in turn.calls] == ["read_file", "edit_file"]
    assert turn.calls[1].result.status == "ok" and "repair" in turn.output.meta
    assert "repair" not in result.turns[2].output.meta  # the code passes: nothing to add
    assert [c.name for c in result.turns[2].calls] == ["read_file"]


async def test_a_change_that_cannot_apply_is_not_repaired_once_the_code_passes(repo, store):
    """The failing check was fixed by a repair, and the model, not having rerun it,
    sends an edit of a file that is not there: the code as it is passes, so nothing is
    proposed in its place (an edit that merely keeps the check passing would be made)."""
    (repo / "m.py").write_text(PICK)
    read = '<read_file path="m.py"/>'
    ghost = edit("    return 0", "    return 1", path="gone.py")
    model = Repairing([run(CHECK), "Reading.\n" + read, "Also.\n" + ghost, "Fixed."], KNOWN)
    session = Session(model=model, workspace=LocalWorkspace(repo), config=repairing(), traces=store)
    result = await session.run("fix pick")
    assert (repo / "m.py").read_text() == PICK.replace("lo < hi", "lo <= hi")
    assert "repair" in result.turns[1].output.meta
    third = result.turns[2]
    assert "repair" not in third.output.meta
    assert [(c.name, c.result.status) for c in third.calls] == [("edit_file", "error")]


async def test_a_later_repair_tries_the_edits_after_those_that_failed(repo, store, monkeypatch):
    """Each repair tries a few candidates (`tail`). Once the first repair's have failed
    the check, the next repair, of the same code in the same focus, leaves them out and
    tries those after them, the fix among them."""
    monkeypatch.setattr(repair, "propose", functools.partial(repair.propose, tail=6))
    result = await read_twice(repo, store)
    first, second = (t.output.meta["repair"] for t in result.turns[1:3])
    assert first["spans"] == second["spans"]
    # the code as it is, then the six proposed: all failed
    assert "gain" not in first and (first["proposals"], first["runs"]) == (6, 7)
    assert second["known_failed"] == 6 and "gain" in second
    # the same code, read again: the model's answers come from the session's memory
    assert first["reads"][0] > 0 and first["reads"][1] == 0
    assert second["reads"][0] == second["reads"][1] == first["reads"][0]


async def test_a_span_that_does_not_compile_alone_is_checked_in_its_file():
    # the inner function's `nonlocal` is bound outside its span: alone it does not
    # compile, so candidates are checked in the whole file, and still proposed
    lm = NGram(KNOWN)
    text = (
        "def outer(lo, hi):\n"
        "    n = 0\n"
        "    def pick():\n"
        "        nonlocal n\n"
        "        if lo < hi:\n"
        "            return lo\n"
        "        return hi\n"
        "    return pick()\n"
    )
    got = await repair.propose(lm, lm.tok, {"m.py": text}, [repair.Span("m.py", 2, 7)])
    assert text.replace("lo < hi", "lo <= hi") in [p.after for p in got]
    for p in got:
        compile(p.after, "m.py", "exec")


def test_a_span_that_steps_out_of_a_nested_class_is_checked_alone():
    # the last method of a nested class, then the next method of the class around it,
    # read as one span: it compiles alone under one `if 1:` for each level, so a
    # candidate costs the span's parse, not the whole file's
    lines = [
        "class Outer:\n",
        "    class Item:\n",
        "        def __lt__(self, other):\n",
        "            return self.at < other.at\n",
        "\n",
        "    def __contains__(self, key):\n",
        "        return key in self.items\n",
        "\n",
        "x = 1\n",
    ]
    text = "".join(lines)
    site = repair._site(NGram(KNOWN).tok, text, repair.Span("m.py", 2, 7))
    assert site is not None and not site.whole and site.shape is not None
    # what a candidate changes is still told from what it keeps
    changed = site.body.replace("key in", "key not in")
    assert repair._shape("m.py", site.checked(changed))[1] != site.shape[1]
    assert repair._shape("m.py", site.checked(site.body + "    # a note\n")) == site.shape
    # a region whose first lines are its outermost is left as it is
    assert repair._region("def f():\n    return 1\n") == "def f():\n    return 1\n"


BRANCHES = (
    "def sign(n):\n"  # 0
    "    if n > 0:\n"  # 1
    "        return 1\n"  # 2
    "    elif n < 0:\n"  # 3
    "        return -1\n"  # 4
    "    else:\n"  # 5
    "        total = max(\n"  # 6
    "            n,\n"  # 7
    "            0,\n"  # 8
    "        )\n"  # 9
    "        return total\n"  # 10
    "\n"  # 11
    "\n"  # 12
    "def never(n):\n"  # 13
    "    return n\n"  # 14
)


def test_live_lines_are_the_statements_a_run_reached():
    # sign(0) ran: lines 1, 3, 6 (the call reports one of its lines) and 10; both
    # functions' `def` lines ran when the module was imported
    live = repair.live_lines(BRANCHES, {0, 1, 3, 6, 10, 13})
    assert live is not None
    assert {1, 3, 5, 6, 7, 8, 9, 10} <= live  # `else:`, and the whole call
    assert not {2, 4, 14} & live  # the branches not taken, the body never run
    assert {0, 13} <= live  # a signature (its defaults) runs at import
    assert repair.live_lines("def broken(:\n", {0}) is None
    # nothing can be put between the statements of a function that never ran
    idle = "@wrap\ndef f(a=1):\n    x = a\n\n    return x\n"
    assert repair.live_lines(idle, {0, 1}) == {0, 1}
    assert repair.live_lines(idle, {0, 1, 2, 4}) == {0, 1, 2, 3, 4}


async def test_edits_of_lines_the_failing_run_reached_come_first():
    lm = NGram(KNOWN)
    text = (
        "def pick(lo, hi):\n    if lo < hi:\n        return lo\n    return hi\n\n"
        "def spare(lo, hi):\n    if lo < hi:\n        return hi\n    return lo\n"
    )
    spans = [repair.Span("m.py", 0, 4), repair.Span("m.py", 5, 9)]
    everywhere = await repair.propose(lm, lm.tok, {"m.py": text}, spans, tail=64)
    assert all(p.ran for p in everywhere)  # no record: every line counts as run
    spare = set(range(5, 9))

    def live(path, line):
        return path == "m.py" and line not in spare  # `spare` never ran

    got = await repair.propose(lm, lm.tok, {"m.py": text}, spans, tail=1000, live=live)
    flags = [p.ran for p in got]
    assert flags == sorted(flags, reverse=True) and True in flags and False in flags
    cut = len("".join(text.splitlines(keepends=True)[:5]))
    for p in got:  # an edit that ran changes what comes before `spare`
        assert (p.after[:cut] != text[:cut]) == p.ran, (p.old, p.new)
    # without the record, edits of `spare` rank among the first 64, with those of `pick`
    assert any(p.after[:cut] == text[:cut] for p in everywhere)
