"""A Merkle tree over file hashes: which files changed since the last build.

Leaves are content hashes of files (workspace-relative POSIX paths); a folder's
hash is the hash of its sorted (name, child hash) pairs, so one edited file
changes exactly the hashes on its path to the root. Comparing two trees starts
at the root and descends only into folders whose hashes differ: an unchanged
workspace costs one comparison, a one-file edit a path's worth.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


def content_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass(kw_only=True)
class Tree:
    files: dict[str, str]  # path -> content hash
    dirs: dict[str, str] = field(default_factory=dict)  # folder ("" = root) -> hash
    children: dict[str, list[str]] = field(default_factory=dict)  # folder -> child paths

    @classmethod
    def build(cls, files: dict[str, str]) -> Tree:
        tree = cls(files=dict(files))
        kids: dict[str, set[str]] = {"": set()}
        for path in files:
            parts = path.split("/")
            for i in range(len(parts)):
                parent, child = "/".join(parts[:i]), "/".join(parts[: i + 1])
                kids.setdefault(parent, set()).add(child)
        tree.children = {d: sorted(c) for d, c in kids.items()}
        for folder in sorted(kids, key=lambda d: d.count("/") + bool(d), reverse=True):
            h = hashlib.blake2b(digest_size=16)
            for child in tree.children[folder]:
                h.update(child.rsplit("/", 1)[-1].encode() + b"\0")
                h.update((tree.files.get(child) or tree.dirs[child]).encode() + b"\n")
            tree.dirs[folder] = h.hexdigest()
        return tree

    @property
    def root(self) -> str:
        return self.dirs.get("", "")


@dataclass(frozen=True, kw_only=True)
class Diff:
    added: list[str]
    changed: list[str]
    removed: list[str]

    def __bool__(self) -> bool:
        return bool(self.added or self.changed or self.removed)


def diff(old: Tree, new: Tree) -> Diff:
    """Files added, changed and removed from old to new, visiting only differing folders."""
    added: list[str] = []
    changed: list[str] = []
    removed: list[str] = []

    def visit(folder: str) -> None:
        if old.dirs.get(folder) == new.dirs.get(folder):
            return
        for child in sorted(set(old.children.get(folder, ())) | set(new.children.get(folder, ()))):
            if child in new.dirs or child in old.dirs:
                if child in new.dirs and child in old.dirs:
                    visit(child)
                else:
                    # A whole folder appeared or vanished (or a file became a folder).
                    for f in _files_under(new, child):
                        (changed if f in old.files else added).append(f)
                    for f in _files_under(old, child):
                        if f not in new.files:
                            removed.append(f)
                    if child in new.files and child not in old.files:
                        added.append(child)
                    if child in old.files and child not in new.files:
                        removed.append(child)
                continue
            before, after = old.files.get(child), new.files.get(child)
            if before is None:
                added.append(child)
            elif after is None:
                removed.append(child)
            elif before != after:
                changed.append(child)

    visit("")
    return Diff(added=added, changed=changed, removed=removed)


def _files_under(tree: Tree, folder: str) -> list[str]:
    if folder not in tree.dirs:
        return []
    prefix = folder + "/"
    return [f for f in tree.files if f.startswith(prefix)]
