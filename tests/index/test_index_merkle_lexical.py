"""Merkle-tree change detection and identifier-aware lexical terms."""

from __future__ import annotations

from opencomposer.index.lexical import MAX_QUERY_TERMS, fts_query, split_identifier, terms
from opencomposer.index.merkle import Tree, diff


def test_merkle_diff_finds_exactly_the_changes() -> None:
    old = Tree.build({"a/b.py": "1", "a/c.py": "2", "d.py": "3", "e/f/g.py": "4"})
    new = Tree.build({"a/b.py": "1", "a/c.py": "X", "d.py": "3", "h/i.py": "6"})
    d = diff(old, new)
    assert (d.added, d.changed, d.removed) == (["h/i.py"], ["a/c.py"], ["e/f/g.py"])
    assert not diff(new, Tree.build(dict(new.files)))


def test_merkle_hashes_change_only_on_the_edited_path() -> None:
    files = {f"pkg{i}/mod{j}.py": f"{i}-{j}" for i in range(5) for j in range(5)}
    old = Tree.build(files)
    new = Tree.build({**files, "pkg3/mod1.py": "edited"})
    changed = {d for d in old.dirs if old.dirs[d] != new.dirs[d]}
    assert changed == {"", "pkg3"}


def test_identifier_splitting() -> None:
    assert split_identifier("parseHTTPHeader") == ["parse", "http", "header"]
    assert split_identifier("retry_with_backoff") == ["retry", "with", "backoff"]
    assert split_identifier("XMLHttpRequest2") == ["xml", "http", "request2"]
    t = terms("def get_user(self): return userID")
    assert {"get_user", "get", "user", "userid", "id"} <= set(t)


def test_query_terms_are_capped_and_quoted() -> None:
    q = fts_query(" ".join(f"word{i}" for i in range(5000)))
    assert q is not None and q.count(" OR ") == MAX_QUERY_TERMS - 1
    assert fts_query("the of and") is None
    assert fts_query('say "hi" AND NOT x') == '"say" OR "hi" OR "not"'
