"""CodebaseIndex end to end on real SQLite, FAISS and a (tiny) sentence-transformers model."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from opencomposer.index import CodebaseIndex, Hit, core


def build(root: Path) -> CodebaseIndex:
    index = CodebaseIndex.open(root)
    index.refresh()
    return index


def test_build_and_search_by_identifier(workspace: Path, embedder_env: Path) -> None:
    index = build(workspace)
    hits = index.search("retry with backoff", k=3)
    assert hits and isinstance(hits[0], Hit)
    top = hits[0]
    assert top.path == "src/retry.py" and top.symbol == "retry_with_backoff"
    assert top.start_line <= 5 <= top.end_line and "def retry_with_backoff" in top.text
    # camelCase split: words find parseHttpHeader
    assert "parseHttpHeader" in index.search("parse http header", k=1)[0].symbol
    assert any(h.path == "web/app.ts" for h in index.search("find user by email", k=3))
    index.close()


def test_persisted_index_reopens_without_reembedding(workspace: Path, embedder_env: Path) -> None:
    first = build(workspace)
    n = len(first)
    first.close()
    again = CodebaseIndex.open(workspace)
    assert len(again) == n
    stats = again.refresh()
    assert stats.files_changed == 0 and stats.chunks_embedded == 0
    assert again.search("circuit breaker failures", k=1)[0].path == "src/retry.py"


def test_edit_reembeds_only_changed_chunks(workspace: Path, embedder_env: Path) -> None:
    index = build(workspace)
    retry = workspace / "src/retry.py"
    retry.write_text(retry.read_text().replace("self.failures += 1", "self.failures += 2"))
    os.utime(retry, ns=(1, 1))  # an old mtime: not racy, stat differs
    stats = index.refresh()
    assert stats.files_changed == 1
    assert 1 <= stats.chunks_embedded < 3
    assert "failures += 2" in "".join(h.text for h in index.search("record_failure", k=3))


def test_deleted_and_added_files(workspace: Path, embedder_env: Path) -> None:
    index = build(workspace)
    (workspace / "src/parse.py").unlink()
    (workspace / "src/extra.go").write_text(
        "package x\n\nfunc ComputeChecksum(b []byte) int {\n\treturn len(b)\n}\n"
    )
    stats = index.refresh()
    assert stats.files_removed == 1 and stats.files_changed == 1
    paths = {h.path for h in index.search("parse http header read config", k=10)}
    assert "src/parse.py" not in paths
    assert index.search("compute checksum", k=1)[0].path == "src/extra.go"
    # nothing stale is left in FAISS either
    assert all(p != "src/parse.py" for p, *_ in index._meta.values())
    assert index._vectors.ntotal == len(index)


def test_path_filter(workspace: Path, embedder_env: Path) -> None:
    index = build(workspace)
    assert {h.path for h in index.search("user", k=10, path="web/")} == {"web/app.ts"}
    assert all(h.path.startswith("src/") for h in index.search("retry", k=10, path="src"))
    assert all(h.path.endswith(".py") for h in index.search("user store", k=10, path="*.py"))
    assert index.search("retry", path="nowhere/") == []


def test_update_buffer_and_remove(workspace: Path, embedder_env: Path) -> None:
    index = build(workspace)
    text = (
        workspace / "src/parse.py"
    ).read_text() + "\n\ndef tokenizeShellWords(s):\n    return s.split()\n"
    stats = index.update_buffer("src/parse.py", text)
    assert stats.chunks_embedded >= 1
    assert index.search("tokenize shell words", k=1)[0].path == "src/parse.py"
    # the open buffer wins over the unchanged disk file at the next refresh
    index.refresh()
    assert index.search("tokenizeShellWords", k=1)[0].path == "src/parse.py"
    index.drop_buffer("src/parse.py")
    index.refresh()
    assert all("tokenizeShellWords" not in h.text for h in index.search("tokenizeShellWords", k=10))
    index.remove("src")
    assert all(not h.path.startswith("src/") for h in index.search("retry", k=10))


def test_empty_workspace_and_odd_queries(tmp_path: Path, embedder_env: Path) -> None:
    index = build(tmp_path)
    assert len(index) == 0
    assert index.search("anything") == []
    assert index.dense_search("anything", n=5) == [] and index.lexical_search("anything", n=5) == []
    (tmp_path / "a.py").write_text("def alpha():\n    return 1\n")
    index.refresh()
    assert index.search("") == []
    huge = "retry " * 1700 + "alpha"  # 10,000+ characters
    assert index.search(huge, k=5)[0].path == "a.py"
    assert index.search("!!! ??? ...", k=5)  # no lexical terms: dense still answers


@pytest.mark.parametrize("damage", ["truncate", "garbage", "stale-version"])
def test_corrupt_or_stale_index_is_rebuilt_with_warning(workspace: Path, embedder_env: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    build(workspace).close()
    db = workspace / ".opencomposer/index/index.db"
    for suffix in ("-wal", "-shm"):
        Path(str(db) + suffix).unlink(missing_ok=True)
    if damage == "truncate":
        data = db.read_bytes()
        db.write_bytes(data[: len(data) // 3])
    elif damage == "garbage":
        db.write_bytes(b"not a database at all" * 100)
    else:
        con = sqlite3.connect(db)
        con.execute("UPDATE meta SET value='0' WHERE key='format_version'")
        con.commit()
        con.close()
    with caplog.at_level(logging.WARNING, logger="opencomposer.index"):
        index = CodebaseIndex.open(workspace)
    warnings = [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    index.refresh()
    assert index.search("retry with backoff", k=1)[0].path == "src/retry.py"


def test_vanishing_file_during_indexing(workspace: Path, embedder_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    real_walk = core.walk

    def walk_then_delete(root: Path, config: object) -> object:
        found = real_walk(root, config)  # type: ignore[arg-type]
        (workspace / "src/parse.py").unlink()
        return found

    monkeypatch.setattr(core, "walk", walk_then_delete)
    index = CodebaseIndex.open(workspace)
    stats = index.refresh()
    assert stats.skipped.get("vanished") == 1
    assert index.search("retry with backoff", k=1)[0].path == "src/retry.py"


def test_racy_mtime_is_rechecked(workspace: Path, embedder_env: Path) -> None:
    index = build(workspace)
    f = workspace / "src/parse.py"
    st = f.stat()
    f.write_text(f.read_text().replace("strip().lower()", "strip().upper()"))  # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime: only the content differs
    assert index.refresh().files_changed == 1  # the first build saw a fresh mtime and kept no stat


async def test_concurrent_calls_from_asyncio(workspace: Path, embedder_env: Path) -> None:
    index = build(workspace)
    results = await asyncio.gather(
        *[asyncio.to_thread(index.search, "retry backoff", k=2) for _ in range(8)],
        asyncio.to_thread(index.update_buffer, "src/new.py", "def brandNewHelper():\n    pass\n"),
        asyncio.to_thread(index.refresh),
    )
    assert all(r for r in results[:8])
    assert index.search("brand new helper", k=1)[0].path == "src/new.py"


def test_ivf_index_beyond_flat_size_removes_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "FLAT_MAX", 100)
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((2000, 16)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    ids = np.arange(10, 2010, dtype=np.int64)
    index = core._vector_index(vecs, ids, 16)
    assert "IVF" in type(index).__name__
    _, got = index.search(vecs[:1], 1)
    assert got[0][0] == 10
    index.remove_ids(np.array([10], dtype=np.int64))
    _, got = index.search(vecs[:1], 5)
    assert 10 not in got[0] and index.ntotal == 1999


@pytest.mark.slow  # two fresh interpreters load torch and the model
def test_two_indexers_at_once(workspace: Path, embedder_env: Path) -> None:
    for i in range(30):
        (workspace / f"gen/mod{i}.py").parent.mkdir(exist_ok=True)
        (workspace / f"gen/mod{i}.py").write_text(
            "\n\n".join(
                f"def func_{i}_{j}(x):\n    return x * {j}\n" + "    # pad\n" * 20 for j in range(6)
            )
        )
    script = textwrap.dedent(f"""
        from pathlib import Path
        from opencomposer.index import CodebaseIndex
        s = CodebaseIndex.open(Path({str(workspace)!r})).refresh()
        print(s.files, s.chunks)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    counts = {o[0].strip() for o in outs}
    assert len(counts) == 1  # both see the same complete index
    index = CodebaseIndex.open(workspace)
    assert index.refresh().chunks_embedded == 0
    con = sqlite3.connect(workspace / ".opencomposer/index/index.db")
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    n_chunks = con.execute("SELECT count(*) FROM chunks").fetchone()[0]
    n_lex = con.execute("SELECT count(*) FROM lex").fetchone()[0]
    assert n_chunks == n_lex == len(index) and str(n_chunks) in counts.pop()


def test_unused_vectors_are_collected(workspace: Path, embedder_env: Path) -> None:
    index = build(workspace)
    (workspace / "src/parse.py").unlink()
    index.refresh()
    con = sqlite3.connect(workspace / ".opencomposer/index/index.db")
    used = con.execute("SELECT count(DISTINCT vkey) FROM chunks").fetchone()[0]
    assert con.execute("SELECT count(*) FROM vectors").fetchone()[0] == used
