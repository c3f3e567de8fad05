"""`bench --out DIR` keeps every episode's trace in `DIR/traces.db`, named by the report.

Guards the gap this closes: benchmark episodes ran the production session but left
no trace, so a failed task could not be inspected the way a user's session can.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from opencomposer.agent.traces import TraceStore
from opencomposer.training.bench import run_bench
from opencomposer.training.tasks import write_task

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


def test_every_episode_is_a_trace_the_cli_can_show(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "notes.txt").write_text("hello\n")
    suite = tmp_path / "suite"
    write_task(suite / "passes", query="look around", verify="true", repo_dir=repo)
    write_task(suite / "fails", query="make verify pass", verify="false", repo_dir=repo)
    model = tmp_path / "m.json"
    model.write_text(json.dumps({"turns": ['<read_file path="notes.txt"/>', "Looked."]}))
    out = tmp_path / "out"
    report = run_bench(suite, model=f"scripted:{model}", concurrency=2, out=out)

    rows = {r["id"]: r for r in json.loads((out / "report.json").read_text())["tasks"]}
    assert rows["passes"]["resolved"] and not rows["fails"]["resolved"]
    store = TraceStore(out / "traces.db")
    try:
        for task_id, row in rows.items():
            trace = store.export(row["session_id"])
            assert trace["query"] == ("look around" if task_id == "passes" else "make verify pass")
            assert trace["meta"]["task_id"] == task_id
            assert trace["meta"]["resolved"] is row["resolved"]
            assert [c["name"] for c in trace["tool_calls"]] == ["read_file"]
            assert trace["tool_calls"][0]["result"].strip().endswith("hello")
    finally:
        store.close()
    assert report["tasks"] and len(rows) == 2

    failed = rows["fails"]["session_id"]
    cli = Path(sys.executable).parent / "opencomposer"
    shown = subprocess.run(
        [str(cli), "traces", "show", failed],
        env={**os.environ, "OPENCOMPOSER_HOME": str(out)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert f"session {failed}" in shown.stdout
    assert "query: make verify pass" in shown.stdout and "read_file" in shown.stdout
