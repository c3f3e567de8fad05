"""The starter suite: deterministic, split, and every task solvable and not pre-solved.

Each task is checked without Ray: unpack, run verify (must fail), apply the
reference solution, run verify and every graded check (must pass). One task of
each kind then goes through the real environment server with an oracle
`scripted:` model that plays the reference solution.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from opencomposer.training import starter
from opencomposer.training.catalog import load_suite
from opencomposer.training.tasks import ANSWER_FILE, load_task, safe_extract


def _digest(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_generation_is_deterministic(tmp_path: Path) -> None:
    starter.generate(tmp_path / "a", seed=3, per_kind=4)
    starter.generate(tmp_path / "b", seed=3, per_kind=4)
    starter.generate(tmp_path / "c", seed=4, per_kind=4)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert _digest(tmp_path / "a") != _digest(tmp_path / "c")


def _run(cmd: str, cwd: Path) -> int:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(
        ["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, timeout=60
    ).returncode


def _apply(repo: Path, solution: dict) -> None:
    (repo / ANSWER_FILE).parent.mkdir(parents=True, exist_ok=True)
    (repo / ANSWER_FILE).write_text(solution["answer"])
    for edit in solution["edits"]:
        text = (repo / edit["path"]).read_text()
        assert edit["old"] in text
        (repo / edit["path"]).write_text(text.replace(edit["old"], edit["new"]))


def test_every_task_fails_before_and_passes_with_the_solution(tmp_path: Path) -> None:
    paths = starter.generate(tmp_path / "suite", seed=0, per_kind=6)
    assert len(paths) == 18
    for path in paths:
        task = load_task(path)
        repo = tmp_path / "ws" / task.id
        safe_extract(task.repo_tar, repo)
        (repo / ANSWER_FILE).parent.mkdir(parents=True, exist_ok=True)
        (repo / ANSWER_FILE).write_text("I don't know.")
        assert _run(task.verify, repo) != 0, task.id
        for check in task.reward.get("checks", []):  # no partial reward for doing nothing
            assert _run(check["command"], repo) != 0, (task.id, check)
        _apply(repo, json.loads((path / starter.SOLUTION).read_text()))
        assert _run(task.verify, repo) == 0, task.id
        for check in task.reward.get("checks", []):
            assert _run(check["command"], repo) == 0, (task.id, check)


def test_suite_by_name_with_splits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENCOMPOSER_HOME", str(tmp_path))
    tasks = load_suite("starter")
    train, heldout = load_suite("starter:train"), load_suite("starter:heldout")
    assert len(tasks) == 3 * starter.DEFAULT_PER_KIND
    assert train and heldout and len(train) + len(heldout) == len(tasks)
    assert {t.id for t in heldout}.isdisjoint({t.id for t in train})
    assert {t.id.split("-")[0] for t in tasks} == {"find", "fix", "rename"}
    assert starter.suite_dir().is_relative_to(tmp_path)
    assert [t.id for t in load_suite("starter")] == [t.id for t in tasks]  # cached, same


@pytest.mark.skipif(not Path("/usr/bin/bwrap").exists(), reason="needs bubblewrap")
def test_oracle_episodes_earn_full_reward(tmp_path: Path) -> None:
    from opencomposer.training.env import EnvConfig, EnvironmentServer

    paths = starter.generate(tmp_path / "suite", seed=1, per_kind=1)

    def oracle(path: Path) -> str:
        sol = json.loads((path / starter.SOLUTION).read_text())
        turns = [
            "\n".join(
                f'<edit_file path="{e["path"]}">\n<old>{e["old"]}</old>\n<new>{e["new"]}</new>\n</edit_file>'
                for e in sol["edits"]
            )
            or '<list_dir path="."/>',
            sol["answer"],
        ]
        f = tmp_path / f"{path.name}.json"
        f.write_text(json.dumps({"turns": turns}))
        return f"scripted:{f}"

    async def main() -> list:
        srv = EnvironmentServer(EnvConfig(num_actors=1, root=tmp_path / "env", pool_size=0))
        try:
            return [
                await srv.run_episode(load_task(p), model_spec_or_factory=oracle(p)) for p in paths
            ]
        finally:
            await srv.close()

    results = asyncio.run(main())
    assert [(r.task_id, r.reward, r.resolved) for r in results] == [
        (p.name, 1.0, True) for p in paths
    ], [(r.task_id, r.parts, r.error, r.verify_output) for r in results]
