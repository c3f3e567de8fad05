"""`opencomposer bench --max-turns N` and the report's headline metrics.

Guards: the turn budget reaches every episode's session (a model that never
answers stops at exactly N turns, status max_turns); the resolve rate comes with
its binomial standard error, and turns with their mean, in report.json and the
Markdown; a bad budget is one line, not a traceback.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from opencomposer.server.cli import main
from opencomposer.training import starter
from opencomposer.training.bench import make_report, markdown, run_bench
from opencomposer.training.env import EpisodeResult


def _result(task: str, resolved: bool, turns: int) -> EpisodeResult:
    return EpisodeResult(
        task_id=task,
        status="completed",
        reward=float(resolved),
        resolved=resolved,
        metrics={"wall_s": 1.0, "turns": turns, "tokens": 100, "tool_calls": 3},
    )


def test_standard_error_and_turns() -> None:
    results = [_result("a", True, 2), _result("b", False, 4), _result("c", False, 6)]
    results.append(_result("d", False, 8))
    report = make_report(results, [], suite="s", model="m", concurrency=1)
    assert report["resolve_rate"] == 0.25
    assert report["resolve_rate_se"] == pytest.approx(math.sqrt(0.25 * 0.75 / 4), abs=1e-4)
    assert report["turns"] == {"total": 20, "mean": 5.0}
    md = markdown(report)
    assert f"| resolve rate standard error | {report['resolve_rate_se']:.1%} |" in md
    assert "| turns (mean) | 5.00 |" in md
    empty = make_report([], [], suite="s", model="m", concurrency=1)
    assert empty["resolve_rate_se"] == 0.0


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_max_turns_bounds_every_episode(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    starter.generate(suite, seed=3, per_kind=1)
    first = sorted(p for p in suite.iterdir() if p.is_dir())[0]
    model = tmp_path / "m.json"
    model.write_text(json.dumps({"turns": ['<list_dir path="."/>'] * 10}))  # never answers
    report = run_bench(
        first, model=f"scripted:{model}", concurrency=1, out=tmp_path / "out", max_turns=2
    )
    (row,) = report["tasks"]
    assert row["status"] == "max_turns" and row["turns"] == 2 and row["tool_calls"] == 2
    assert json.loads((tmp_path / "out" / "report.json").read_text())["max_turns"] == 2


def test_bad_max_turns_is_one_line(tmp_path: Path, capsys) -> None:
    code = main(["bench", "--tasks", str(tmp_path), "--model", "scripted:x", "--max-turns", "0"])
    err = capsys.readouterr().err
    assert code != 0 and "max_turns must be at least 1" in err and err.count("\n") == 1
