"""`cmd_index` / `cmd_search`: exit codes, summary, JSON shapes, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opencomposer.index.cli import cmd_index, cmd_search


def test_index_then_search_json(workspace: Path, embedder_env: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    assert cmd_index(workspace) == 0
    out = capsys.readouterr().out
    assert out.startswith("indexed 4 files,") and "chunks/s" in out
    assert cmd_search("retry with backoff", workspace, k=3, as_json=True) == 0
    results = json.loads(capsys.readouterr().out)
    assert len(results) == 3 and set(results[0]) == {"path", "start_line", "end_line", "score"}
    assert results[0]["path"] == "src/retry.py"


def test_queries_file(workspace: Path, embedder_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    qf = tmp_path / "q.txt"
    qf.write_text("retry with backoff\n\ncircuit breaker\n")
    assert (
        cmd_search(None, workspace, k=2, as_json=True, queries_file=qf) == 0
    )  # builds the index itself
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [x["query"] for x in lines] == ["retry with backoff", "circuit breaker"]
    assert all(len(x["results"]) == 2 for x in lines)


def test_errors_are_one_line(tmp_path: Path, embedder_env: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    assert cmd_index(tmp_path / "missing") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a folder" in err
    assert cmd_search("x", tmp_path, k=0) == 1
    assert cmd_search(None, tmp_path) == 1
    assert cmd_search(None, tmp_path, queries_file=tmp_path / "nope.txt") == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 3 and "Traceback" not in err


def test_bad_embedder_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setenv("OPENCOMPOSER_EMBEDDER", str(tmp_path))
    assert cmd_index(tmp_path) == 1
    assert "not a sentence-transformers model" in capsys.readouterr().err


def test_bad_files_are_skipped_with_reasons(workspace: Path, embedder_env: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    import os

    (workspace / "blob.dat2").write_bytes(b"\x00\x01\x02" * 1000)
    (workspace / "huge.py").write_text("x = 1\n" * 400_000)
    (workspace / "bundle.js").write_text("var a=1;" * 5000)
    (workspace / "latin1.py").write_bytes((bytes(range(160, 256)) + b"\n") * 50)
    (workspace / "mostly_ok.py").write_bytes(
        b"def caf\xe9_helper():\n    return 1\n" + b"# ok\n" * 50
    )
    os.symlink(workspace, workspace / "src" / "loop")
    assert cmd_index(workspace) == 0
    out = capsys.readouterr().out
    for reason in ("binary", "too large", "generated or minified", "not UTF-8", "symlink"):
        assert reason in out, out
    assert cmd_search("helper", workspace, k=10, as_json=True) == 0
    paths = {r["path"] for r in json.loads(capsys.readouterr().out)}
    assert "mostly_ok.py" in paths and "latin1.py" not in paths
