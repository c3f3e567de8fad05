"""Task suites by name: the built-in ones and any folder of task folders.

`load_suite` is what `bench --tasks`, `train` (`[tasks] suite`) and the demonstrations
read. It knows the generated suites (`starter`: `training/starter.py`; `own`:
`training/mining.py`), so it sits above those generators, which in turn write the
task format of `training/tasks.py`.
"""

from __future__ import annotations

import re
from pathlib import Path

from opencomposer.training import corpus, mining, starter
from opencomposer.training.tasks import TASK_FILE, Task, TaskError, load_task

SUITES = Path(__file__).parent / "suites"  # suites committed with the code


def load_suite(name_or_dir: str | Path) -> list[Task]:
    """Tasks of a suite, sorted by id.

    Built-in names: `starter` (also `starter:train`, `starter:heldout`), generated
    deterministically by `training/starter.py` into the cache; `own`, mined from this
    repository by `training/mining.py` into the cache on first use; `corpus` (also
    `corpus:train`, `corpus:heldout`), the built task corpus (`training/corpus.py`,
    ``$OPENCOMPOSER_CORPUS``), exported into the cache once per build, each task with
    one request of a kind picked per task; `corpus:SPLIT:KIND` gives every task the
    request of one kind (test, issue, oneline), `corpus:SPLIT:all` every task once per
    kind (the same id up to three times: demonstrations keep them apart); the folders under
    `training/suites/` (e.g. `pypi`, tasks mined from PyPI libraries). Anything else is
    a folder of task folders (or one task folder).
    """
    name = str(name_or_dir)
    base, _, split = name.partition(":")
    if base == "starter" and not Path(name).exists():
        tasks = [load_task(p) for p in starter.ensure_suite()]
    elif base == "own" and not Path(name).exists():
        tasks = [load_task(p) for p in mining.ensure_own_suite()]
    elif base == "corpus" and not Path(name).exists():
        split, _, query = split.partition(":")
        kinds = corpus.QUERY_KINDS if query == "all" else (query or "mixed",)
        tasks = [load_task(p) for kind in kinds for p in corpus.ensure_export(query=kind)]
    else:
        d = Path(name_or_dir)
        builtin = SUITES / name
        if not d.exists() and re.fullmatch(r"[A-Za-z0-9_-]+", name) and builtin.is_dir():
            d = builtin  # a suite committed under training/suites/
        split = ""
        if not d.is_dir():
            raise TaskError(
                f"no task suite {name!r}: not a folder, nor one of: corpus, own, starter"
            )
        if (d / TASK_FILE).is_file():
            return [load_task(d)]
        dirs = sorted(p for p in d.iterdir() if (p / TASK_FILE).is_file())
        if not dirs:
            raise TaskError(f"{d}: no task folders (folders with {TASK_FILE})")
        tasks = [load_task(p) for p in dirs]
    if split:
        if split not in ("train", "heldout"):
            raise TaskError(f"unknown split {split!r}: use train or heldout")
        tasks = [t for t in tasks if t.split == split]
    return sorted(tasks, key=lambda t: t.id)
