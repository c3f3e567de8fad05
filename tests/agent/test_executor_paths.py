"""The executor's ordering: aliases of one path are one path, and the schedule it finds
in linear time is the one the pairwise conflict rule gives."""

from __future__ import annotations

import asyncio
import gc
import random
import time
from pathlib import Path
from typing import Any

import pytest
from opencomposer.agent.executor import Executor, _Schedule
from opencomposer.agent.xmlcalls import ParsedCall
from opencomposer.tools import specs
from opencomposer.tools.protocols import ToolContext
from opencomposer.tools.workspace import LocalWorkspace


async def run_message(root: Path, calls: list[tuple[str, dict[str, str]]]) -> list[Any]:
    """Run one message's calls; the first write is held back a little by the gate, so a
    later call that is not ordered after it runs first."""
    held: set[int] = set()

    async def gate(spec: specs.ToolSpec, args: dict[str, Any]) -> str | None:
        if spec.name in ("write_file", "edit_file") and not held:
            held.add(1)
            await asyncio.sleep(0.05)
        return None

    ex = Executor(ToolContext(workspace=LocalWorkspace(root)), turn=1, gate=gate)
    for i, (name, raw) in enumerate(calls):
        ex.submit(ParsedCall(index=i, name=name, raw=raw))
    return [rec.result for rec in await ex.wait()]


@pytest.mark.parametrize(
    ("first", "second", "real"),
    [
        ("./a.txt", "a.txt", "a.txt"),
        ("a.txt", "./a.txt", "a.txt"),
        ("d//a.txt", "d/a.txt", "d/a.txt"),
        ("d/../a.txt", "a.txt", "a.txt"),
        ("d/a.txt", "d/./a.txt/", "d/a.txt"),
        ("a.txt", "alias.txt", "a.txt"),
        ("d/a.txt", "dlink/a.txt", "d/a.txt"),
    ],
)
async def test_aliases_of_one_path_keep_message_order(
    tmp_path: Path, first: str, second: str, real: str
) -> None:
    """Issue 19 item 10: `./a.txt` and `a.txt` in one message were ordered as two paths,
    so an edit ran before the write it depended on (or was lost) and both said ok."""
    (tmp_path / "d").mkdir()
    (tmp_path / "alias.txt").symlink_to("a.txt")
    (tmp_path / "dlink").symlink_to("d")
    results = await run_message(
        tmp_path,
        [
            ("write_file", {"path": first, "content": "one\n"}),
            ("edit_file", {"path": second, "old": "one", "new": "two"}),
            ("read_file", {"path": second}),
        ],
    )
    assert [r.status for r in results] == ["ok", "ok", "ok"], [r.output for r in results]
    assert (tmp_path / real).read_text() == "two\n"
    assert results[2].output.endswith("\ttwo")


async def test_a_write_then_a_read_of_its_folder_keep_order(tmp_path: Path) -> None:
    """A write under a folder and a later listing of that folder, spelled differently."""
    (tmp_path / "pkg").mkdir()
    results = await run_message(
        tmp_path,
        [
            ("write_file", {"path": "./pkg//new.py", "content": "x = 1\n"}),
            ("list_dir", {"path": "pkg/"}),
            ("grep", {"pattern": "x = 1", "path": "./pkg"}),
        ],
    )
    assert "new.py" in results[1].output
    assert results[2].output == "pkg/new.py:1:x = 1"


# -- the schedule ----------------------------------------------------------------


PATHS = ["", "a", "a/b", "a/c", "a/b/x", "b"]


def _footprint(rng: random.Random) -> specs.Footprint:
    kind = rng.random()
    if kind < 0.15:
        return specs.Footprint(reads=("",), writes=("",), terminal=True)
    if kind < 0.2:
        return specs.Footprint()
    reads = tuple(rng.sample(PATHS, rng.randint(0, 2)))
    writes = tuple(rng.sample(PATHS, rng.randint(0, 1))) if rng.random() < 0.5 else ()
    return specs.Footprint(reads=reads or ("a",), writes=writes)


async def test_the_schedule_equals_the_pairwise_rule() -> None:
    """Each call starts exactly when every earlier call it conflicts with (pairwise, as
    `Footprint.conflicts` says) has finished: never sooner, never later."""
    rng = random.Random(19)
    for _ in range(60):
        fps = [_footprint(rng) for _ in range(rng.randint(1, 25))]
        schedule = _Schedule()
        release = [asyncio.Event() for _ in fps]
        started: set[int] = set()
        tasks = []

        for i, fp in enumerate(fps):
            task = asyncio.ensure_future(_job(i, schedule.deps(fp), started, release[i]))
            schedule.add(fp, task)
            tasks.append(task)
        finished: set[int] = set()
        while len(finished) < len(fps):
            for _ in range(30):
                await asyncio.sleep(0)
            want = {
                j
                for j, fp in enumerate(fps)
                if all(i in finished for i in range(j) if fps[i].conflicts(fp))
            }
            assert started == want, (fps, finished)
            i = rng.choice(sorted(started - finished))
            release[i].set()
            await tasks[i]
            finished.add(i)


async def _job(i: int, deps: list[Any], started: set[int], release: asyncio.Event) -> None:
    if deps:
        await asyncio.wait(deps)
    started.add(i)
    await release.wait()


def _submit_time(n: int) -> float:
    async def run() -> float:
        loop = asyncio.get_running_loop()
        fps = [
            specs.Footprint(reads=(f"src/m{i % 50}/f{i}.py",))
            if i % 3
            else specs.Footprint(writes=(f"src/m{i % 50}/f{i % 7}.py",))
            for i in range(n)
        ]
        fps[n // 2] = specs.Footprint(reads=("",), writes=("",), terminal=True)
        schedule = _Schedule()
        gc.disable()  # collection pauses over the many live futures are noise here
        try:
            start = time.perf_counter()
            for fp in fps:
                schedule.deps(fp)
                schedule.add(fp, loop.create_future())
            return time.perf_counter() - start
        finally:
            gc.enable()

    return min(asyncio.run(run()) for _ in range(3))


def test_ten_thousand_calls_are_scheduled_in_linear_time() -> None:
    """Issue 19 item 13: every call was compared with every earlier one; 10,000 calls in
    one reply took about 100 s before the first started."""
    small, large = _submit_time(2_500), _submit_time(10_000)
    assert large < 2.0, large
    assert large / small < 8, (small, large)
