"""The per-snapshot index cache of training environments (`training/snapshot_index.py`).

Guards three bugs: an episode paying for a full index build (each episode must
embed only what changed since its snapshot), a project's second task re-embedding
the whole project, and a stale chunk surviving across snapshots whose files
differ in content but not in size (deterministic tars give every file mtime 0,
so file stats cannot tell them apart).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from opencomposer.index.embed import Embedder
from opencomposer.training.snapshot_index import SnapshotIndexes
from opencomposer.training.tasks import load_task, safe_extract, write_task


@pytest.fixture
def embedded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Number of texts each `Embedder.encode` call embedded, in order."""
    calls: list[int] = []
    encode = Embedder.encode

    def counting(self: Embedder, texts: list[str], progress=None):  # type: ignore[no-untyped-def]
        calls.append(len(texts))
        return encode(self, texts, progress)

    monkeypatch.setattr(Embedder, "encode", counting)
    return calls


def _task(tmp: Path, name: str, repo: Path, source: str = "mined:demo"):
    return load_task(
        write_task(tmp / "tasks" / name, query="q", verify="true", repo_dir=repo, source=source)
    )


def test_one_build_per_snapshot_and_projects_share_work(
    tmp_path: Path, workspace: Path, embedder_env: Path, embedded: list[int]
) -> None:
    cache = SnapshotIndexes(tmp_path / "cache")
    a = _task(tmp_path, "a", workspace)
    # task b: the same project with one function changed, same size (lower -> upper)
    parse = workspace / "src" / "parse.py"
    original = parse.read_text()
    parse.write_text(original.replace("lower", "upper"))
    assert parse.stat().st_size == len(original)
    b = _task(tmp_path, "b", workspace)

    db_a = cache.ensure(a)
    full = sum(embedded)
    assert full > 0 and db_a.exists()
    assert cache.ensure(a) == db_a and sum(embedded) == full  # cached: nothing embedded

    db_b = cache.ensure(b)
    assert db_b != db_a
    seeded = sum(embedded) - full
    assert 0 < seeded < full  # only src/parse.py's changed chunk, not the project

    root = tmp_path / "episode-b"
    safe_extract(b.repo_tar, root)
    index = cache.open(b, root)
    try:
        hits = index.search("parseHttpHeader", k=3)
        parse = [h for h in hits if h.path == "src/parse.py"]
        assert parse and any("upper()" in h.text for h in parse)
        assert not any("lower()" in h.text for h in parse)
    finally:
        index.close()


def test_an_episode_embeds_only_what_it_changed(
    tmp_path: Path, workspace: Path, embedder_env: Path, embedded: list[int]
) -> None:
    cache = SnapshotIndexes(tmp_path / "cache")
    task = _task(tmp_path, "t", workspace)
    cache.ensure(task)
    before = sum(embedded)

    root = tmp_path / "episode"
    safe_extract(task.repo_tar, root)
    retry = root / "src" / "retry.py"
    retry.write_text(retry.read_text().replace("gave up", "exhausted every attempt"))
    index = cache.open(task, root)
    try:
        episode = sum(embedded) - before
        assert 0 < episode <= 3  # the edited file's chunks, nothing else
        hits = index.search("exhausted every attempt", k=2)
        assert hits and hits[0].path == "src/retry.py"
    finally:
        index.close()

    # the snapshot itself is untouched: the next episode starts from the original text
    other = tmp_path / "episode2"
    safe_extract(task.repo_tar, other)
    index = cache.open(task, other)
    try:
        texts = [h.text for h in index.search("gave up", k=3) if h.path == "src/retry.py"]
        assert texts and all("exhausted" not in t for t in texts)
    finally:
        index.close()
