"""The starter suite: short, graded tasks a 135M-parameter model can earn reward on.

Three kinds, each a tiny repository written from a seed (the same seed always
gives byte-identical task folders):

- `find` — a value sits in one of a few config/source files; report it. Verify
  greps the final answer (written to `.opencomposer/answer.txt`) for the value.
- `fix` — a one-line bug (flipped operator, off-by-one, wrong variable) that a
  given test exposes; the query quotes the test and its failure. Verify runs the
  test (protected: restored before grading).
- `rename` — rename a function across the files that define and use it.

Rewards are graded so that a small model learns step by step: a share for making
a valid tool call at all (`tool_call`), shares for partial progress (`checks`:
one of the configured values reported, an edit that keeps the module valid,
each file renamed), and the rest for `verify`. No check pays for doing nothing.

Each task has a `split`: about one in five is `heldout` (chosen by a hash of the
task id, so it is stable as the suite grows; 17 of the default 72: 8 find, 4 fix,
5 rename), for the RL loop's learning curve: `load_suite("starter:train")`,
`load_suite("starter:heldout")`. Each task also has `solution.json` beside it; the
warm start's demonstrations (`training/demos.py`) read it for training tasks only.

    python -m opencomposer.training.starter OUT_DIR [--seed 0] [--per-kind 24]
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from opencomposer.training.tasks import ANSWER_FILE, write_task

VERSION = 2
SOLUTION = "solution.json"  # {"answer": str, "edits": [{"path", "old", "new"}]}
DEFAULT_SEED = 0
DEFAULT_PER_KIND = 24

_NOUNS = [
    "price",
    "order",
    "user",
    "cart",
    "item",
    "score",
    "width",
    "height",
    "count",
    "total",
    "limit",
    "delay",
    "speed",
    "budget",
    "weight",
    "level",
]
_VERBS = ["compute", "get", "build", "load", "update", "format", "check", "merge", "parse", "scale"]
_MODULES = ["util", "core", "helpers", "mathx", "models", "logic", "tools", "calc"]
_SETTINGS = [
    "TIMEOUT_MS",
    "MAX_RETRIES",
    "PORT",
    "BATCH_SIZE",
    "CACHE_TTL",
    "WORKERS",
    "BUFFER_KB",
    "POOL_SIZE",
    "RATE_LIMIT",
    "MAX_DEPTH",
]


def suite_dir(seed: int = DEFAULT_SEED) -> Path:
    """Where the built-in starter suite is cached."""
    from opencomposer.agent.traces import home

    return home() / "suites" / f"starter-v{VERSION}-seed{seed}"


def ensure_suite(seed: int = DEFAULT_SEED, per_kind: int = DEFAULT_PER_KIND) -> list[Path]:
    """The cached suite's task folders, generated on first use."""
    d = suite_dir(seed)
    marker = d / ".complete"
    if not marker.exists() or marker.read_text() != str(per_kind):
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=d.name + ".", dir=d.parent))
        generate(tmp, seed=seed, per_kind=per_kind)
        (tmp / ".complete").write_text(str(per_kind))
        shutil.rmtree(d, ignore_errors=True)
        try:
            os.replace(tmp, d)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return sorted(p for p in d.iterdir() if (p / "task.toml").is_file())


def generate(
    out: Path, *, seed: int = DEFAULT_SEED, per_kind: int = DEFAULT_PER_KIND
) -> list[Path]:
    """Write `per_kind` tasks of each kind under `out`; return the task folders."""
    rng = random.Random(seed)
    makers: list[tuple[str, Callable[[random.Random, Path, str], Path]]] = [
        ("find", _find_task),
        ("fix", _fix_task),
        ("rename", _rename_task),
    ]
    paths = []
    for kind, make in makers:
        for i in range(per_kind):
            task_id = f"{kind}-{i:03d}"
            paths.append(make(rng, out / task_id, task_id))
    return paths


def split_of(task_id: str) -> str:
    return "heldout" if int(hashlib.sha1(task_id.encode()).hexdigest(), 16) % 5 == 0 else "train"


def _write_files(files: dict[str, str]) -> Path:
    root = Path(tempfile.mkdtemp(prefix="oc-starter-"))
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _task(
    out: Path, task_id: str, files: dict[str, str], solution: dict[str, object], **kw: object
) -> Path:
    """Write the task, plus `solution.json` beside it (never inside repo.tar): the
    reference answer and edits, for tests, oracle rollouts and warm-start data."""
    root = _write_files(files)
    try:
        path = write_task(out, repo_dir=root, split=split_of(task_id), source="starter", **kw)  # type: ignore[arg-type]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    (path / SOLUTION).write_text(json.dumps(solution, indent=1, sort_keys=True) + "\n")
    return path


# ---------------------------------------------------------------- find a value


def _find_task(rng: random.Random, out: Path, task_id: str) -> Path:
    names = rng.sample(_SETTINGS, 4)
    values = [rng.randint(100, 99999) for _ in names]
    target = rng.randrange(len(names))
    files = {
        "README.md": "# service\n\nSettings live in config/.\n",
        "config/settings.py": "".join(
            f"{n} = {v}\n" for n, v in zip(names[:2], values[:2], strict=True)
        ),
        "config/limits.toml": "".join(
            f"{n.lower()} = {v}\n" for n, v in zip(names[2:], values[2:], strict=True)
        ),
        "app/main.py": "from config.settings import *  # noqa\n\n\ndef main():\n    return 0\n",
    }
    name, value = names[target], values[target]
    key = name if target < 2 else name.lower()
    solution = {"answer": f"{key} is {value}.", "edits": []}
    return _task(
        out,
        task_id,
        files,
        solution,
        query=f"What is the value of {key} in this project's configuration? Reply with the number.",
        verify=f"grep -qw {value} {ANSWER_FILE}",
        timeout_s=120,
        command_timeout_s=20,
        reward={
            "verify": 0.7,
            "tool_call": 0.2,
            # partial credit for reporting one of the configured values (it looked)
            "checks": [
                {
                    "command": f"grep -qwE '{'|'.join(map(str, values))}' {ANSWER_FILE}",
                    "weight": 0.1,
                }
            ],
        },
    )


# ---------------------------------------------------------------- fix a one-line bug

_BUGS = [
    # (function body with {op} placeholder, good, bad, args, expected)
    ("def {fn}(a, b):\n    return a {op} b\n", "+", "-", (2, 3), 5),
    ("def {fn}(a, b):\n    return a {op} b\n", "*", "+", (4, 5), 20),
    ("def {fn}(xs):\n    return max(xs) if xs else {op}\n", "0", "None", ([],), 0),
    ("def {fn}(n):\n    return [i for i in range({op})]\n", "n", "n - 1", (3,), [0, 1, 2]),
    ("def {fn}(a, b):\n    return a if a {op} b else b\n", ">", "<", (7, 2), 7),
    ("def {fn}(s):\n    return s.{op}()\n", "upper", "lower", ("ab",), "AB"),
    ("def {fn}(xs):\n    return sum(xs) / {op}\n", "len(xs)", "(len(xs) + 1)", ([2, 4],), 3.0),
    ("def {fn}(a, b):\n    return {op}\n", "a - b", "b - a", (9, 4), 5),
]


def _fix_task(rng: random.Random, out: Path, task_id: str) -> Path:
    body, good, bad, args, expected = rng.choice(_BUGS)
    fn = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"
    mod = rng.choice(_MODULES)
    helper = f"def describe():\n    return {mod!r}\n\n\n"
    broken = helper + body.format(fn=fn, op=bad)
    call = f"{fn}({', '.join(repr(a) for a in args)})"
    test = (
        "import os\nimport sys\n\nsys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))\n\n"
        f"from {mod} import {fn}\n\n\n"
        f"def test_{fn}():\n    assert {call} == {expected!r}\n\n\n"
        f'if __name__ == "__main__":\n    test_{fn}()\n    print("ok")\n'
    )
    files = {f"{mod}.py": broken, f"tests/test_{mod}.py": test}
    ns: dict[str, object] = {}
    exec(helper + body.format(fn=fn, op=bad), ns)  # the generator checks its own bug
    assert ns[fn](*args) != expected, (fn, bad)
    query = (
        f"tests/test_{mod}.py fails: `assert {call} == {expected!r}` raises AssertionError. "
        f"Fix the bug in {mod}.py (one line) so the test passes."
    )
    old_line = body.format(fn=fn, op=bad).splitlines()[1]
    new_line = body.format(fn=fn, op=good).splitlines()[1]
    solution = {
        "answer": "Fixed.",
        "edits": [{"path": f"{mod}.py", "old": old_line, "new": new_line}],
    }
    return _task(
        out,
        task_id,
        files,
        solution,
        query=query,
        verify=f"python tests/test_{mod}.py",
        timeout_s=180,
        command_timeout_s=20,
        protect=[f"tests/test_{mod}.py"],
        reward={
            "verify": 0.7,
            "tool_call": 0.2,
            # partial credit for an edit that leaves the module valid Python
            "checks": [
                {
                    "command": f"python -m py_compile {mod}.py && "
                    f"! (echo '{hashlib.sha256(broken.encode()).hexdigest()}  {mod}.py' | sha256sum -c --status)",
                    "weight": 0.1,
                }
            ],
        },
    )


# ---------------------------------------------------------------- rename a symbol


def _rename_task(rng: random.Random, out: Path, task_id: str) -> Path:
    old = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"
    new = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}s"
    while new == old:
        new += "_v2"
    pkg = rng.choice(_MODULES)
    files = {
        f"{pkg}/__init__.py": "",
        f"{pkg}/base.py": f"def {old}(x):\n    return x * 2\n",
        f"{pkg}/api.py": f"from {pkg}.base import {old}\n\n\ndef run(x):\n    return {old}(x) + 1\n",
        f"{pkg}/cli.py": f"from {pkg} import base\n\n\ndef main():\n    print(base.{old}(21))\n",
    }
    users = [f"{pkg}/base.py", f"{pkg}/api.py", f"{pkg}/cli.py"]
    verify = (
        f"! grep -rqw {old} --include=*.py . && "
        f"python -c 'from {pkg}.base import {new}; from {pkg}.api import run; assert run(1) == 3; import {pkg}.cli'"
    )
    solution = {
        "answer": "Renamed.",
        "edits": [
            {"path": p, "old": files[p], "new": re.sub(rf"\b{old}\b", new, files[p])} for p in users
        ],
    }
    return _task(
        out,
        task_id,
        files,
        solution,
        query=f"Rename the function `{old}` to `{new}` everywhere in the project (definition and every use).",
        verify=verify,
        timeout_s=240,
        command_timeout_s=20,
        reward={
            "verify": 0.5,
            "tool_call": 0.2,
            "checks": [{"command": f"! grep -qw {old} {p}", "weight": 0.1} for p in users],
        },
    )


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--per-kind", type=int, default=DEFAULT_PER_KIND)
    ns = ap.parse_args()
    for p in generate(ns.out, seed=ns.seed, per_kind=ns.per_kind):
        print(p)
    sys.exit(0)
