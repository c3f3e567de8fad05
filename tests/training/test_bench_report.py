"""run_bench end to end with the scripted model on starter tasks: report.json, Markdown, plots."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from opencomposer.training import starter
from opencomposer.training.bench import make_report, markdown, run_bench
from opencomposer.training.env import EpisodeResult
from opencomposer.training.tasks import TaskError


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_run_bench_writes_report(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    paths = starter.generate(suite, seed=2, per_kind=1)
    find = next(p for p in paths if p.name.startswith("find"))
    answer = json.loads((find / starter.SOLUTION).read_text())["answer"]
    # one script for every task: look around in parallel, then answer the find task's value
    model = tmp_path / "m.json"
    model.write_text(
        json.dumps({"turns": ['<list_dir path="."/>\n<glob pattern="**/*.py"/>', answer]})
    )
    report = run_bench(suite, model=f"scripted:{model}", concurrency=3, out=tmp_path / "out")

    on_disk = json.loads((tmp_path / "out" / "report.json").read_text())
    assert on_disk["resolve_rate"] == report["resolve_rate"] == pytest.approx(1 / 3, abs=1e-3)
    rows = {r["id"]: r for r in on_disk["tasks"]}
    assert set(rows) == {p.name for p in paths}
    assert rows[find.name]["resolved"] and rows[find.name]["reward"] == 1.0
    assert all(r["tool_calls"] == 2 and r["parallel_calls_per_turn"] == 2.0 for r in rows.values())
    assert all(r["reward"] >= 0.2 for r in rows.values())  # every task pays for a valid tool call
    assert report["wall_s"]["p50"] > 0 and report["wall_s"]["p90"] >= report["wall_s"]["p50"]
    assert report["statuses"] == {"completed": 3}
    md = (tmp_path / "out" / "report.md").read_text()
    assert "resolve rate | 33.3% (1/3)" in md and find.name in md
    for png in ("wall_time.png", "per_task.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_math_and_errors(tmp_path: Path) -> None:
    results = [
        EpisodeResult(
            task_id="a",
            status="completed",
            reward=1.0,
            resolved=True,
            metrics={"wall_s": 1.0, "tokens": 10, "tool_calls": 2, "edit_failures": 1},
        ),
        EpisodeResult(
            task_id="b", status="setup_failed", reward=0.0, resolved=False, error="setup failed"
        ),
    ]
    report = make_report(results, [], suite="s", model="m", concurrency=1)
    assert report["resolve_rate"] == 0.5 and report["edit_failures"] == 1
    assert report["statuses"] == {"completed": 1, "setup_failed": 1}
    assert report["wall_s"]["p50"] == 0.5
    assert "| b | no | 0.00 | setup_failed |" in markdown(report)
    with pytest.raises(TaskError, match="concurrency"):
        run_bench(tmp_path, model="scripted:x", concurrency=0, out=tmp_path / "o")
    with pytest.raises(TaskError, match="no task suite"):
        run_bench(tmp_path / "nope", model="scripted:x", concurrency=1, out=tmp_path / "o")


@pytest.mark.skipif(
    shutil.which("bwrap") is None or shutil.which("tar") is None, reason="needs bwrap and tar"
)
def test_usual_tars_run_and_escapes_are_one_line_in_the_report(tmp_path: Path) -> None:
    """Issue 19 item 14: a repo.tar made with `tar -cf repo.tar -C repo .` was refused,
    and a refused tar reached the report as Ray's remote traceback."""
    import io
    import subprocess
    import tarfile

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "value.txt").write_text("42\n")
    suite = tmp_path / "suite"
    usual = suite / "usual"
    usual.mkdir(parents=True)
    subprocess.run(["tar", "-cf", str(usual / "repo.tar"), "-C", str(repo), "."], check=True)
    (usual / "task.toml").write_text('query = "q"\nverify = "grep -q 42 value.txt"\n')
    for name, member in (
        ("dotdot", tarfile.TarInfo("./../escaped.txt")),
        ("symlink", tarfile.TarInfo("./out")),
    ):
        task = suite / name
        task.mkdir()
        if name == "symlink":
            member.type, member.linkname = tarfile.SYMTYPE, str(tmp_path / "escaped.txt")
        with tarfile.open(task / "repo.tar", "w") as tar:
            member.size = 1 if member.isreg() else 0
            tar.addfile(member, io.BytesIO(b"x") if member.isreg() else None)
        (task / "task.toml").write_text('query = "q"\nverify = "true"\n')
    model = tmp_path / "m.json"
    model.write_text(json.dumps({"turns": ["done"]}))
    report = run_bench(suite, model=f"scripted:{model}", concurrency=2, out=tmp_path / "out")

    rows = {r["id"]: r for r in report["tasks"]}
    assert rows["usual"]["resolved"] and rows["usual"]["status"] == "completed"
    for name in ("dotdot", "symlink"):
        assert rows[name]["status"] == "task_error"
        error = report["errors"][name]
        assert "\n" not in error and "Traceback" not in error and "ray::" not in error
        assert error.startswith("repo.tar entry") and ("outside" in error or "escapes" in error)
    assert "usual" not in report["errors"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Errors" in md and md.count("- dotdot: repo.tar entry") == 1
    assert not (tmp_path / "escaped.txt").exists()
