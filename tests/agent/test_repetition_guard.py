"""The repetition guard in the stream layer that every backend's turns pass through
(`agent/backends/_stream.py`), and the session status it leads to.

Guards: a reply that repeats one phrase ("a mix of a mix of …", the embedded model's
degenerate answer to the demo) is stopped long before it would have ended, the
producer is cancelled, `finish_reason` is "repetition" and the session ends with
status `repetition`; legitimate repetitive code (many similar lines, a separator,
this repository's own sources) never trips it; the guard's work stays bounded by
the output's length (one check per `every` characters).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from opencomposer.agent.backends._stream import RepetitionGuard, TaskStream
from opencomposer.agent.protocols import TurnOutput
from opencomposer.agent.session import Session, SessionConfig, SessionResult
from opencomposer.tools.workspace import LocalWorkspace

from tests.agent.conftest import scripted

ROOT = Path(__file__).resolve().parents[2]


def _fires(text: str, chunk: int = 7) -> int | None:
    """Feed `text` as a stream in `chunk`-character deltas; the offset where it fired."""
    guard = RepetitionGuard()
    sent = ""
    for i in range(0, len(text), chunk):
        sent += text[i : i + chunk]
        if guard.feed(sent, len(text[i : i + chunk])) is not None:
            return len(sent)
    return None


def test_degenerate_phrases_fire_early() -> None:
    for phrase in ("a mix of ", "ab", "\n", '<read_file path="a.py"/>\n', "x" * 150 + "y"):
        text = "Sure. " + phrase * (4000 // len(phrase) + 1)
        at = _fires(text)
        assert at is not None and at <= 1200, (phrase, at)


def test_legitimate_repetitive_code_does_not_fire() -> None:
    table = "".join(f"    'item_{i:03d}': {i * 7 % 13},\n" for i in range(400))
    tests = "".join(
        f"def test_case_{i}():\n    assert add({i}, 1) == {i + 1}\n\n\n" for i in range(120)
    )
    sep = "".join("#" * 79 + f"\ndef f{i}():\n    return {i}\n" for i in range(30))
    csv = "".join(f"{i},{i * i},{(i * 37) % 101}\n" for i in range(600))
    for text in (table, tests, sep, csv):
        assert _fires(text) is None, text[:80]
    sources = sorted((ROOT / "agent").rglob("*.py")) + sorted((ROOT / "tools").rglob("*.py"))
    assert len(sources) > 10
    for path in sources:
        assert _fires(path.read_text(encoding="utf-8"), chunk=13) is None, path


def test_a_line_that_counts_fires() -> None:
    """The trained policy's degenerate reply: a sentence that turns into a count
    ("line 12, line 13, …") repeats only with its numbers blanked out."""
    counting = "Found it: in `if x:`, `if` should be `if y` (a dropped call at " + ", ".join(
        f"line {i}" for i in range(12, 2000, 2)
    )
    at = _fires(counting)
    assert at is not None and at <= 1000, at
    steps = "Steps: " + " ".join(f"step {i} of {i * 3}." for i in range(400))
    assert _fires(steps) is not None


def test_one_line_without_a_counted_phrase_does_not_fire() -> None:
    numbers = "DATA = [" + ", ".join(str(i * 7919 % 10007) for i in range(600)) + "]"
    # a long line of real text: this repository's session loop, newlines joined
    words = (ROOT / "agent" / "session.py").read_text(encoding="utf-8").replace("\n", " ")
    record = "rows = " + ", ".join(
        f'{{"id": {i}, "name": "{chr(97 + i % 26) * (1 + i % 5)}"}}' for i in range(120)
    )
    floats = "W = [" + ", ".join(f"{(i * 37 % 91 + 1) * 1e-5:.3e}" for i in range(200)) + "]"
    for text in (numbers, words, record, floats):
        assert "\n" not in text and len(text) > 1000
        assert _fires(text) is None, text[:80]


def test_checks_are_amortised(monkeypatch) -> None:
    guard = RepetitionGuard()
    calls = 0
    real = guard.period

    def counting(text: str) -> int | None:
        nonlocal calls
        calls += 1
        return real(text)

    monkeypatch.setattr(guard, "period", counting)
    text = (ROOT / "agent" / "session.py").read_text() * 3
    sent = ""
    for ch in text:
        sent += ch
        guard.feed(sent, 1)
    assert calls <= len(text) // guard.every + 1


async def test_stream_stops_a_producer_that_never_ends() -> None:
    """Any backend's producer: the guard cancels it and the stream ends."""
    produced = 0

    async def produce(out: TurnOutput, emit) -> None:
        nonlocal produced
        while True:  # a model that would repeat until its token budget
            emit("a mix of ")
            produced += 1
            await asyncio.sleep(0)

    stream = TaskStream(produce)
    got = "".join([d async for d in stream])
    assert stream.output is not None and stream.output.finish_reason == "repetition"
    assert stream.output.meta["repetition_period"] == len("a mix of ")
    assert got == stream.output.text and len(got) < 1200 and produced < 140


async def test_session_ends_with_repetition_status(tmp_path: Path) -> None:
    reply = "Here is the fix: " + "a mix of " * 1000
    model = scripted(reply, "never reached", cps=20_000.0)
    events: list[dict] = []
    session = Session(
        model=model,
        workspace=LocalWorkspace(tmp_path),
        config=SessionConfig(approve="all"),
        on_event=lambda e: events.append(e.to_wire()),
    )
    result = await session.run("fix the bug")
    assert result.status == "repetition"
    assert "repeating itself" in (result.error or "")
    assert len(result.turns) == 1
    assert len(result.turns[0].output.text) < len(reply) // 3  # stopped early
    assert events[-1]["type"] == "session_end" and events[-1]["status"] == "repetition"


async def test_session_with_long_similar_lines_completes(tmp_path: Path) -> None:
    content = "".join(
        f"COLOR_{i} = ({i % 256}, {i * 3 % 256}, {i * 7 % 256})\n" for i in range(300)
    )
    turn = f'<write_file path="colors.py">\n<content>\n{content}</content>\n</write_file>'
    session = Session(
        model=scripted(turn, "Wrote colors.py.", cps=200_000.0),
        workspace=LocalWorkspace(tmp_path),
        config=SessionConfig(approve="all"),
    )
    result = await session.run("write the colour table")
    assert result.status == "completed" and result.answer == "Wrote colors.py."
    assert (tmp_path / "colors.py").read_text().count("COLOR_") == 300


def test_rl_trains_on_repetition_episodes() -> None:
    """A degenerate episode is a rollout with its (zero) reward, not a masked-out error."""
    from opencomposer.training.env import EpisodeResult
    from opencomposer.training.rl import rollout_from_episode

    r = rollout_from_episode(
        EpisodeResult(task_id="t", status="repetition", reward=0.0, resolved=False)
    )
    assert r.status == "ok" and r.reward == 0.0
    assert (
        rollout_from_episode(
            EpisodeResult(task_id="t", status="error", reward=0.0, resolved=False)
        ).status
        == "error"
    )


async def test_the_same_failing_turn_three_times_ends_the_session(tmp_path: Path) -> None:
    """A model that sends the same failing calls again and again (the embedded policy
    reading the prompt's example path 7 turns in a row) is stopped at the third such
    turn with status `repetition`, naming the call and its error."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_x():\n    pass\n")
    loop = '<read_file path="src/app.py" start_line="1" end_line="9"/>\n<grep pattern="x"/>'
    events: list[dict] = []
    session = Session(
        model=scripted(*[loop] * 8, "never reached", cps=200_000.0),
        workspace=LocalWorkspace(tmp_path),
        config=SessionConfig(approve="all", max_turns=8),
        on_event=lambda e: events.append(e.to_wire()),
    )
    result = await session.run("fix the bug")
    assert len(result.turns) == 8  # grep succeeds: a turn with one good call is no loop
    session = Session(
        model=scripted(*[loop.split("\n")[0]] * 8, "never reached", cps=200_000.0),
        workspace=LocalWorkspace(tmp_path),
        config=SessionConfig(approve="all", max_turns=8),
        on_event=lambda e: events.append(e.to_wire()),
    )
    result = await session.run("fix the bug")
    assert result.status == "repetition" and len(result.turns) == 3
    assert result.error == (
        "the model made the same failing call 3 turns in a row "
        "(read_file: file not found: src/app.py)"
    )
    assert events[-1]["type"] == "session_end" and events[-1]["status"] == "repetition"


async def test_a_retry_that_sees_a_new_result_is_not_a_loop(tmp_path: Path) -> None:
    """The same call made again is fine while its result changes (the tests rerun
    after each edit), and so is a failing call made again after a different one."""
    (tmp_path / "n.txt").write_text("0\n")
    bump = "<run_terminal><command>echo $(( $(cat n.txt) + 1 )) > n.txt; cat n.txt; exit 1</command></run_terminal>"
    missing = '<read_file path="missing.py"/>'
    turns = [bump] * 4 + [missing, missing, bump, missing, missing, "Done."]
    session = Session(
        model=scripted(*turns, cps=200_000.0),
        workspace=LocalWorkspace(tmp_path),
        config=SessionConfig(approve="all", max_turns=12),
    )
    result = await session.run("count")
    assert result.status == "completed" and result.answer == "Done."
    assert (tmp_path / "n.txt").read_text() == "5\n"


async def test_two_failing_turns_in_alternation_end_the_session(tmp_path: Path) -> None:
    """The trained policy's loop: an edit refused (its <new> repeats <old>), the failing
    test rerun, the same edit again. Two full cycles end the session, though the test's
    output differs in its timing; a cycle whose test run changes is no loop."""
    (tmp_path / "a.py").write_text("x = 1\n")
    edit = '<edit_file path="a.py"><old>x = 1</old><new>x = 1</new></edit_file>'
    # a failing "test" that prints its own duration, different on every run
    run = "<run_terminal><command>echo 1 failed in 0.$(date +%N)s; exit 1</command></run_terminal>"

    async def play(*turns: str) -> SessionResult:
        session = Session(
            model=scripted(*turns, cps=200_000.0),
            workspace=LocalWorkspace(tmp_path),
            config=SessionConfig(approve="all", max_turns=8),
        )
        return await session.run("fix the bug")

    result = await play(*[edit, run] * 4, "never reached")
    assert result.status == "repetition" and len(result.turns) == 4
    assert result.error.startswith(
        "the model alternated between the same two failing turns 4 turns in a row (edit_file: "
    )
    assert "; run_terminal: exit code 1)" in result.error

    (tmp_path / "n.txt").write_text("0\n")
    counting = (
        "<run_terminal><command>echo $(( $(cat n.txt) + 1 )) > n.txt; cat n.txt; exit 1"
        "</command></run_terminal>"
    )
    result = await play(*[edit, counting] * 3, "Done.")
    assert result.status == "completed" and len(result.turns) == 7
