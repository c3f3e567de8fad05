"""Sample-and-rank for turns that change files: what a candidate's changes would do
(`preview`), the scored window, the ranking, and the session keeping only the chosen
candidate's calls, with a test-double model whose scores are known."""

import asyncio
import math

from opencomposer.agent import alternatives as alt
from opencomposer.agent.backends.scripted import ScriptedModel
from opencomposer.agent.protocols import TurnOutput
from opencomposer.agent.session import Session, SessionConfig
from opencomposer.agent.xmlcalls import parse_all
from opencomposer.tools.specs import parser_rules
from opencomposer.tools.workspace import LocalWorkspace

CODE = "def add(a, b):\n    return a - b\n\n\ndef neg(a):\n    return -a\n"


def calls(text):
    return parse_all(text, *parser_rules())


def edit(old, new, path="calc.py"):
    return f'<edit_file path="{path}">\n<old>{old}</old>\n<new>{new}</new>\n</edit_file>'


def test_preview_applies_a_candidates_changes_in_memory_only(repo):
    ws = LocalWorkspace(repo)
    (repo / "calc.py").write_text(CODE)
    two = edit("    return a - b", "    return a + b") + edit("    return -a", "    return 0 - a")
    got = alt.preview(ws, calls(two))
    assert got == {"calc.py": (CODE, CODE.replace("a - b", "a + b").replace("-a\n", "0 - a\n"))}
    assert (repo / "calc.py").read_text() == CODE  # nothing written
    # what cannot apply: a missing <old>, an unchanged one, a path outside, a deletion
    for bad in (
        edit("    return a * b", "    return a + b"),
        edit("    return a - b", "    return a - b"),
        edit("x", "y", path="../outside.py"),
        '<delete_file path="calc.py"/>',
        '<read_file path="calc.py"/>',
    ):
        assert alt.preview(ws, calls(bad)) is None, bad
    made = alt.preview(
        ws, calls('<write_file path="new.py"><content>x = 1\n</content></write_file>')
    )
    assert made == {"new.py": ("", "x = 1")}  # as the call gives it, as write_file writes it


def test_a_preview_skipping_what_cannot_apply_gives_the_files_as_the_calls_leave_them(repo):
    ws = LocalWorkspace(repo)
    (repo / "calc.py").write_text(CODE)
    fix = edit("    return a - b", "    return a + b")
    # the same edit twice, as a model sends it: the second finds no <old> and fails
    for text in (fix + fix, edit("x", "y", path="../outside.py") + fix + edit("    nope", "")):
        assert alt.preview(ws, calls(text)) is None
        assert alt.preview(ws, calls(text), skipping=True) == {
            "calc.py": (CODE, CODE.replace("a - b", "a + b"))
        }
    for nothing in (fix.replace("a + b", "a - b"), fix + '<delete_file path="calc.py"/>'):
        assert alt.preview(ws, calls(nothing), skipping=True) is None
    # a file a call writes can be edited by the calls after it
    made = '<write_file path="new.py"><content>x = 1\n</content></write_file>'
    made += edit("x = 1", "x = 2", path="new.py")
    assert alt.preview(ws, calls(made)) == {"new.py": ("", "x = 2")}


def test_the_window_holds_the_change_and_the_lines_around_it():
    before = "".join(f"line {i}\n" for i in range(200))
    after = before.replace("line 100\n", "line 100!\n")
    start, tail = alt.window(before, after)
    at = before.index("line 100") + len("line 100")  # the first character that differs
    assert before[start - 1] == "\n" and at - start >= alt.AROUND_CHARS
    assert len(before) - tail - at >= alt.AROUND_CHARS
    assert before[start : len(before) - tail].count("line 100") == 1
    assert after[start : len(after) - tail].count("line 100!") == 1
    assert alt.window("abc", "abd") == (0, 0)


async def test_rank_keeps_the_change_the_scorer_finds_likeliest(repo):
    ws = LocalWorkspace(repo)
    (repo / "calc.py").write_text(CODE)

    asked = []

    async def score(context, text):  # a model that likes "a + b" and dislikes "a * b"
        asked.append((context, text))
        return text.count("a + b") * 5.0 - text.count("a * b") * 5.0 - len(text) * 0.01

    cands = [
        calls(edit("    return a - b", "    return a * b")),
        calls(edit("    return a - q", "    return a + b")),  # cannot apply
        calls(edit("    return a - b", "    return a + b")),
        calls(edit("    return a - b", "    return a + b")),  # a tie: the earlier wins
    ]
    ranked = await alt.rank(ws, cands, score)
    assert ranked.index == 2 and ranked.gains[1] == -math.inf
    assert ranked.gains[2] == ranked.gains[3] > 0 > ranked.gains[0]
    # one window for all: the file as it stands, "a * b" and "a + b", each scored once
    assert len(asked) == len(set(asked)) == 3
    nothing = await alt.rank(ws, [cands[1], cands[1]], score)
    assert nothing.index == 0


class Ranking(ScriptedModel):
    """Scripted turns, plus `alternatives` (fixed continuations of the reply's text
    before its first change) and a `logprob` that likes "a + b"."""

    fix_samples = 3

    def __init__(self, turns, more):
        super().__init__(turns)
        self.more, self.asked = more, []

    async def alternatives(self, turn, keep, n, sampling):
        self.asked.append((turn.text[:keep], n, sampling.temperature))
        return [TurnOutput(text=turn.text[:keep] + m) for m in self.more[:n]]

    async def logprob(self, context, text):
        return text.count("a + b") * 5.0 - len(text) * 0.01


async def test_a_turn_that_changes_files_keeps_the_likeliest_candidate(repo, store):
    (repo / "calc.py").write_text(CODE)
    first = 'Reading, then fixing.\n<read_file path="calc.py"/>\n' + edit(
        "    return a - b", "    return a * b"
    )
    rerun = "\n<run_terminal><command>python -c 'import calc'</command></run_terminal>"
    model = Ranking(
        [first + rerun, "Fixed."],
        more=[
            "\nThe fix: a + b.\n" + edit("    return a - b", "    return a + b") + rerun,
            "\n" + edit("nope", "x"),
        ],
    )
    events = []
    session = Session(
        model=model,
        workspace=LocalWorkspace(repo),
        config=SessionConfig(approve="all"),
        on_event=lambda e: events.append(e.to_wire()),
        traces=store,
    )
    result = await session.run("fix add")
    assert result.status == "completed"
    assert (repo / "calc.py").read_text() == CODE.replace("a - b", "a + b")
    kept, n, temperature = model.asked[0]  # up to the end of the read that ran
    assert kept.endswith('<read_file path="calc.py"/>') and n == 2 and temperature == 0.8
    turn = result.turns[0]
    assert "a + b" in turn.output.text and "a * b" not in turn.output.text
    assert turn.output.meta["fix_samples"]["chosen"] == 1
    # the read ran once, before the ranking; then the chosen edit and its rerun
    names = [c.name for c in turn.calls]
    assert names == ["read_file", "edit_file", "run_terminal"]
    assert [e["type"] for e in events].count("edit") == 1
    message = next(e for e in events if e["type"] == "message" and e["turn"] == 1)
    assert "a + b" in message["text"]
    assert "a + b" in store.export(result.session_id)["turns"][0]["text"]


async def test_without_fix_samples_or_a_backend_that_ranks_the_reply_runs_as_sampled(repo):
    (repo / "calc.py").write_text(CODE)
    wrong = edit("    return a - b", "    return a * b")
    for model, cfg in (
        (
            Ranking([wrong, "ok"], more=[edit("    return a - b", "    return a + b")]),
            SessionConfig(approve="all", fix_samples=1),
        ),
        (ScriptedModel([wrong, "ok"]), SessionConfig(approve="all", fix_samples=4)),
    ):
        (repo / "calc.py").write_text(CODE)
        session = Session(model=model, workspace=LocalWorkspace(repo), config=cfg)
        await session.run("fix add")
        assert "a * b" in (repo / "calc.py").read_text()


async def test_first_passing_tries_the_best_ranked_first_and_each_change_once(repo):
    ws = LocalWorkspace(repo)
    (repo / "calc.py").write_text(CODE)
    cands = [
        calls(edit("    return a - b", "    return a * b")),
        calls(edit("    return a - q", "    return a + b")),  # cannot apply: not tried
        calls(edit("    return a - b", "    return a + b")),
        calls(edit("    return a - b", "    return a * b")),  # alike the first: tried once
        calls(edit("    return a - b", "    return b + a")),
        calls('<write_file path="new.py"><content>x = 1\n</content></write_file>'),  # a new file
    ]
    gains = [3.0, -math.inf, 1.0, 3.0, 2.0, 9.0]
    ranked = alt.Ranked(
        index=5, gains=tuple(gains), changed=tuple(alt.preview(ws, c) for c in cands)
    )
    tried = []

    async def check(files):
        tried.append(files["calc.py"].splitlines()[1].strip())
        return "+" in files["calc.py"]

    got = await alt.first_passing(ws, ranked, check)
    assert got == alt.Tried(index=4, runs=2) and tried == ["return a * b", "return b + a"]
    assert (repo / "calc.py").read_text() == CODE  # nothing written

    async def never(files):
        tried.append("never")
        return False

    tried.clear()
    assert await alt.first_passing(ws, ranked, never) == alt.Tried(index=None, runs=3)

    async def no_time(files):  # the first run could not be made: none is
        tried.append("none")
        return None

    tried.clear()
    assert await alt.first_passing(ws, ranked, no_time) == alt.Tried(index=None, runs=0)
    assert tried == ["none"]


class LikesProducts(Ranking):
    """A ranking that prefers the wrong change ("a * b")."""

    async def logprob(self, context, text):
        return text.count("a * b") * 5.0 - len(text) * 0.01


CHECK = "python3 -c 'import calc; assert calc.add(2, 3) == 5, calc.add(2, 3)'"


def run(command):
    return f"<run_terminal><command>{command}</command></run_terminal>"


async def test_a_failing_check_picks_the_candidate_that_makes_it_pass(repo, store):
    """The model reproduced the failure; of its candidate changes, the one its ranking
    likes best fails that command in a trial run and the next passes: that one is made."""
    (repo / "calc.py").write_text(CODE)
    fix = "The fix.\n" + edit("    return a - b", "    return a * b")
    model = LikesProducts(
        ["Reproducing.\n" + run(CHECK), fix, "Fixed."],
        more=["\n" + edit("    return a - b", "    return b + a"), "\n" + edit("nope", "x")],
    )
    session = Session(
        model=model,
        workspace=LocalWorkspace(repo),
        config=SessionConfig(approve="all"),
        traces=store,
    )
    result = await session.run("fix add")
    assert result.status == "completed"
    assert (repo / "calc.py").read_text() == CODE.replace("a - b", "b + a")
    meta = result.turns[1].output.meta["fix_samples"]
    assert meta["chosen"] == 1 and meta["gains"][0] > meta["gains"][1]
    assert meta["checked"] == {"command": CHECK, "runs": 2, "passed": 1}
    assert (
        store.export(result.session_id)["turns"][1]["meta"]["fix_samples"]["checked"]["passed"] == 1
    )
    assert not list(repo.rglob("__pycache__"))  # the trial runs wrote nothing


async def test_a_command_the_user_allowed_always_is_tried(repo):
    (repo / "calc.py").write_text(CODE)
    model = LikesProducts(
        [run(CHECK), edit("    return a - b", "    return a * b"), "Done."],
        more=[edit("    return a - b", "    return b + a")],
    )

    async def always(name, args):
        return "always"

    cfg = SessionConfig(approve="safe", auto_apply_edits=True)
    session = Session(model=model, workspace=LocalWorkspace(repo), config=cfg, approver=always)
    result = await session.run("fix add")
    assert (repo / "calc.py").read_text() == CODE.replace("a - b", "b + a")
    assert result.turns[1].output.meta["fix_samples"]["checked"]["passed"] == 1


async def test_no_trial_without_a_failing_check_a_free_command_or_time(repo):
    """The ranking alone decides when the last check passed, when the policy would ask
    before running the command, or when trials are off."""
    passing = "python3 -c 'import calc'"
    cases = (
        ([run(passing)], SessionConfig(approve="all")),
        ([run(CHECK)], SessionConfig(approve="all", verify_s=0)),
        ([run(CHECK), run(passing)], SessionConfig(approve="all")),
        ([run(CHECK)], SessionConfig(approve="safe", auto_apply_edits=True)),
    )
    for before, cfg in cases:
        (repo / "calc.py").write_text(CODE)
        model = LikesProducts(
            [*before, edit("    return a - b", "    return a * b"), "Done."],
            more=[edit("    return a - b", "    return b + a")],
        )

        async def yes(name, args):
            return "run"  # this once: a trial would run it again unasked

        session = Session(model=model, workspace=LocalWorkspace(repo), config=cfg, approver=yes)
        result = await session.run("fix add")
        assert (repo / "calc.py").read_text() == CODE.replace("a - b", "a * b"), (before, cfg)
        assert "checked" not in result.turns[len(before)].output.meta["fix_samples"]


async def test_trials_side_by_side_keep_the_order():
    # two at once; 1 and 2 pass, and 2 finishes before 1 when they run side by side
    flight, most, done = 0, 0, []

    async def check(files):
        nonlocal flight, most
        flight += 1
        most = max(most, flight)
        n = int(files["n"])
        await asyncio.sleep(0.05 if n == 1 else 0.01)
        flight -= 1
        done.append(n)
        return n in (1, 2)

    cands = [{"n": str(i)} for i in range(5)]
    assert await alt.first_that_passes(cands, check, at_once=2) == alt.Tried(index=1, runs=2)
    assert most == 2 and done == [0, 1]

    done.clear()  # 1 and 2 side by side: 2 is done first, 1 comes first in order
    got = await alt.first_that_passes(cands[1:], check, at_once=2)
    assert got == alt.Tried(index=0, runs=2) and done == [2, 1]

    async def late(files):  # no time for the second batch: it is not waited for
        return None if int(files["n"]) >= 2 else False

    assert await alt.first_that_passes(cands, late, at_once=2) == alt.Tried(index=None, runs=2)
