"""The starter suite: short, graded tasks a 135M-parameter model can earn reward on.

Three kinds, each a tiny repository written from a seed (the same seed always
gives byte-identical task folders):

- `find` — a value sits in one of a few config/source files; report it. Verify
  greps the final answer (written to `.opencomposer/answer.txt`) for the value.
- `fix` — a one-line bug (flipped operator, off-by-one, wrong variable, a total
  that drops a factor, in a function or a method) in a module at the top or inside
  a package (`billing/util.py`), that a given test exposes; the query names the
  file and quotes the failing test, its assertion or the intended behaviour.
  Verify runs the test (protected: restored before grading).
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
from dataclasses import dataclass
from pathlib import Path

from opencomposer.training.tasks import ANSWER_FILE, write_task

VERSION = 3
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


@dataclass(frozen=True, kw_only=True)
class _Bug:
    """One bug shape: the module text with `{op}` where the good and the bad code differ."""

    module: str  # the whole module, `{op}` marks the buggy spot (on one line)
    good: str
    bad: str
    call: str  # the test's expression
    expected: object
    target: str  # what the query names: `fn` or `Cls.method`
    imports: tuple[str, ...]  # the names the test imports from the module
    hint: str  # what the fixed code does, for "so it ..." queries


_FIELDS = [
    ("price", "quantity"),
    ("cost", "count"),
    ("amount", "units"),
    ("rate", "hours"),
    ("weight", "qty"),
    ("fee", "seats"),
]
_CLASSES = ["Item", "Line", "Entry", "Row", "Order", "Slot"]


def _simple(body: str, good: str, bad: str, args: tuple, expected: object, hint: str) -> Callable:
    def make(rng: random.Random) -> _Bug:
        fn = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"
        call = f"{fn}({', '.join(repr(a) for a in args)})"
        return _Bug(
            module=body.replace("{fn}", fn),
            good=good,
            bad=bad,
            call=call,
            expected=expected,
            target=fn,
            imports=(fn,),
            hint=hint,
        )

    return make


def _sum_of_products(rng: random.Random) -> _Bug:
    """A total that drops a factor (`sum(x.price ...)` for `sum(x.price * x.quantity ...)`),
    as a function over a list or as a method over a container's own list."""
    a, b = rng.choice(_FIELDS)
    cls = rng.choice(_CLASSES)
    fn = f"{rng.choice(['total', 'sum', 'compute', 'get'])}_{a}"
    head = (
        "from dataclasses import dataclass, field\n\n\n@dataclass\nclass {cls}:\n"
        f"    name: str\n    {a}: float\n    {b}: int = 1\n\n\n"
    ).replace("{cls}", cls)
    rows = f'[{cls}("x", 0.5, 4), {cls}("y", 1.25)]'
    if rng.random() < 0.5:
        module = head + f"def {fn}(rows):\n    return sum({{op}} for row in rows)\n"
        call, target, imports = f"{fn}({rows})", fn, (fn, cls)
    else:
        holder = rng.choice(["Cart", "Basket", "Invoice", "Batch", "Ledger"])
        meth = rng.choice(["subtotal", "total", "sum", f"total_{a}"])
        module = head + (
            f"@dataclass\nclass {holder}:\n    rows: list[{cls}] = field(default_factory=list)\n\n"
            f"    def {meth}(self) -> float:\n        return sum({{op}} for row in self.rows)\n"
        )
        call, target, imports = f"{holder}({rows}).{meth}()", f"{holder}.{meth}", (holder, cls)
    return _Bug(
        module=module,
        good=f"row.{a} * row.{b}",
        bad=f"row.{a}",
        call=call,
        expected=3.25,
        target=target,
        imports=imports,
        hint=f"it counts {b}",
    )


_BUGS: list[Callable[[random.Random], _Bug]] = [
    _simple("def {fn}(a, b):\n    return a {op} b\n", "+", "-", (2, 3), 5, "it adds"),
    _simple("def {fn}(a, b):\n    return a {op} b\n", "*", "+", (4, 5), 20, "it multiplies"),
    _simple(
        "def {fn}(xs):\n    return max(xs) if xs else {op}\n",
        "0",
        "None",
        ([],),
        0,
        "an empty list gives 0",
    ),
    _simple(
        "def {fn}(n):\n    return [i for i in range({op})]\n",
        "n",
        "n - 1",
        (3,),
        [0, 1, 2],
        "it returns n numbers",
    ),
    _simple(
        "def {fn}(a, b):\n    return a if a {op} b else b\n",
        ">",
        "<",
        (7, 2),
        7,
        "it returns the larger one",
    ),
    _simple(
        "def {fn}(s):\n    return s.{op}()\n",
        "upper",
        "lower",
        ("ab",),
        "AB",
        "it returns upper case",
    ),
    _simple(
        "def {fn}(xs):\n    return sum(xs) / {op}\n",
        "len(xs)",
        "(len(xs) + 1)",
        ([2, 4],),
        3.0,
        "it returns the mean",
    ),
    _simple("def {fn}(a, b):\n    return {op}\n", "a - b", "b - a", (9, 4), 5, "it returns a - b"),
    _simple(
        "def {fn}(xs, limit):\n    return [x for x in xs if x {op} limit]\n",
        ">=",
        ">",
        ([1, 2, 3], 2),
        [2, 3],
        "it keeps values equal to the limit",
    ),
    _simple(
        "def {fn}(total, percent):\n    return round(total * (1 {op} percent / 100), 2)\n",
        "-",
        "+",
        (20.0, 10),
        18.0,
        "it subtracts the discount",
    ),
    _sum_of_products,
    _sum_of_products,
]
_PACKAGES = ["app", "shop", "lib", "store", "billing", "core", "service", "src/app"]


def _fix_task(rng: random.Random, out: Path, task_id: str) -> Path:
    bug = rng.choice(_BUGS)(rng)
    mod = rng.choice(_MODULES)
    pkg = rng.choice(_PACKAGES) if rng.random() < 0.6 else ""
    path = f"{pkg}/{mod}.py" if pkg else f"{mod}.py"
    dotted = f"{pkg.replace('/', '.')}.{mod}" if pkg else mod
    broken = bug.module.replace("{op}", bug.bad)
    test_name = f"test_{bug.target.split('.')[-1].lower()}"
    test_path = f"tests/test_{mod}.py"
    test = (
        "import os\nimport sys\n\nsys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))\n\n"
        f"from {dotted} import {', '.join(bug.imports)}\n\n\n"
        f"def {test_name}():\n    assert {bug.call} == {bug.expected!r}\n\n\n"
        f'if __name__ == "__main__":\n    {test_name}()\n    print("ok")\n'
    )
    files = {path: broken, test_path: test}
    if pkg:  # every folder on the way is a package
        parts = pkg.split("/")
        for k in range(1, len(parts) + 1):
            files["/".join(parts[:k]) + "/__init__.py"] = ""
    ns: dict[str, object] = {}
    exec(broken, ns)  # the generator checks its own bug
    assert eval(bug.call, ns) != bug.expected, (bug.target, bug.bad)
    style = rng.randrange(3)
    if style == 0:
        query = (
            f"{test_path} fails: `assert {bug.call} == {bug.expected!r}` raises AssertionError. "
            f"Fix the bug in {path} (one line) so the test passes."
        )
    elif style == 1:
        query = f"The test {test_name} fails. Fix {bug.target} in {path} so {bug.hint}."
    else:
        query = f"`{bug.call}` should return {bug.expected!r}. Fix {bug.target} in {path}."
    (old_line,) = [
        ln for ln in broken.splitlines() if bug.bad in ln and ln.strip().startswith("return")
    ]
    new_line = old_line.replace(bug.bad, bug.good, 1)
    assert bug.module.replace("{op}", bug.good).count(new_line) == 1
    solution = {"answer": "Fixed.", "edits": [{"path": path, "old": old_line, "new": new_line}]}
    return _task(
        out,
        task_id,
        files,
        solution,
        query=query,
        verify=f"python {test_path}",
        timeout_s=180,
        command_timeout_s=20,
        protect=[test_path],
        reward={
            "verify": 0.7,
            "tool_call": 0.2,
            # partial credit for an edit that leaves the module valid Python
            "checks": [
                {
                    "command": f"python -m py_compile {path} && "
                    f"! (echo '{hashlib.sha256(broken.encode()).hexdigest()}  {path}' | sha256sum -c --status)",
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
