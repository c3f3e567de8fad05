"""The repair's candidates, offline: for held-out corpus tasks, does `repair.propose`
propose the exact fix when it looks at the function with the bug, and at what rank?

This measures the proposing alone, apart from the session around it (whether the
policy found the function, which command it ran, how many trial runs fit the budget).
For each single-site task of a round-robin sample (`--tasks`, `--seed`, split
`heldout`) it reads the broken file from the task's workspace, focuses on the function
around the broken line (`repair.focus`, as a session does with a traceback frame
there), and runs `propose` with the model `--model` (llama.cpp, the shipped policy by
default). It prints each task's rank of the fix (the reference solution's file, byte
for byte; another edit might pass the tests too, so this is a lower bound), the
candidates and the seconds, then how many fixes rank within the first 1, 5, 10 and 20
and at all, and the median time:

    OPENCOMPOSER_CORPUS=~/.cache/opencomposer/corpus-heldout \\
        python benchmarks/repair_proposals.py --tasks 24
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import statistics
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from heldout import cpu_model  # noqa: E402


def nearest(text: str, line: int, n: int) -> list[int]:
    """The first lines (0-based) of the `n` functions of `text` nearest 0-based `line`,
    outside the one around it, nearest first."""
    if n <= 0:
        return []
    funcs = [
        (node.lineno - 1, node.end_lineno or node.lineno)
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    outside = [(a, b) for a, b in funcs if not a <= line < b]
    outside.sort(key=lambda f: min(abs(f[0] - line), abs(f[1] - line)))
    return [a for a, _ in outside[:n]]


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default="heldout")
    ap.add_argument("--model", default="", help="a llama.cpp model folder (default: smollm2)")
    ap.add_argument("--rescore", type=int, help="candidates scored exactly (repair.RESCORE)")
    ap.add_argument("--tail", type=int, help="unscored candidates after them (repair.TAIL)")
    ap.add_argument(
        "--rescore-tokens",
        type=int,
        help="code tokens an exact score reads (repair.RESCORE_TOKENS)",
    )
    ap.add_argument(
        "--others",
        type=int,
        default=0,
        help="functions of the file nearest the broken one also in focus, as a session's"
        " traceback and reads put them (default 0: the broken one alone)",
    )
    ap.add_argument(
        "--chain-tokens",
        type=int,
        help="tokens of one file's spans read one after another (repair.CHAIN_TOKENS; 0: each"
        " span after its own code above)",
    )
    a = ap.parse_args()

    from opencomposer.agent import repair
    from opencomposer.agent.backends.llamacpp import LlamaCppModel
    from opencomposer.agent.backends.smollm2 import smollm2_path
    from opencomposer.training.catalog import load_suite
    from opencomposer.training.demos import spread

    if a.rescore_tokens is not None:
        repair.RESCORE_TOKENS = a.rescore_tokens
    if a.chain_tokens is not None:
        repair.CHAIN_TOKENS = a.chain_tokens
    tasks = spread(load_suite(f"corpus:{a.split}"), a.tasks, a.seed)
    if not tasks:
        print(f"error: the corpus has no {a.split} tasks (build it first)", file=sys.stderr)
        return 1
    model = LlamaCppModel(a.model or smollm2_path())
    await model.start()
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"repair proposals, {len(tasks)} tasks; CPU {cpu_model()}, load {load}")
    ranks: list[int | None] = []
    seconds: list[float] = []
    try:
        for task in tasks:
            solution = json.loads((task.dir / "solution.json").read_text())
            if len(solution["edits"]) != 1:
                print(f"{task.id}: two sites, left out")
                continue
            fix = solution["edits"][0]
            with tarfile.open(task.repo_tar) as tar:
                member = tar.extractfile(fix["path"])
                text = member.read().decode() if member else ""
            if text.count(fix["old"]) != 1:
                print(f"{task.id}: the broken lines are not found once, left out")
                continue
            fixed = text.replace(fix["old"], fix["new"])
            texts = {fix["path"]: text}
            line = fix["line"] - 1
            others = [(fix["path"], n) for n in nearest(text, line, a.others)]
            spans = repair.focus(texts, [(fix["path"], line), *others])
            t0 = time.perf_counter()
            sizes = {k: v for k, v in (("rescore", a.rescore), ("tail", a.tail)) if v is not None}
            got = await repair.propose(model, model.tokenizer, texts, spans, **sizes)
            seconds.append(time.perf_counter() - t0)
            rank = next((i for i, p in enumerate(got) if p.after == fixed), None)
            ranks.append(rank)
            lines = sum(s.end - s.start for s in spans)
            where = "not proposed" if rank is None else f"rank {rank + 1}"
            print(
                f"{task.id} ({solution['kind']}): {where} of {len(got)},"
                f" {lines} lines, {seconds[-1]:.1f} s"
            )
    finally:
        await model.close()
    if not ranks:
        print("no single-site task")
        return 1
    n = len(ranks)
    within = [sum(r is not None and r < k for r in ranks) for k in (1, 5, 10, 20)]
    found = sum(r is not None for r in ranks)
    print(
        f"\n{n} single-site tasks: the fix ranks first in {within[0]}, within 5 in"
        f" {within[1]}, within 10 in {within[2]}, within 20 in {within[3]};"
        f" proposed at all in {found}/{n}. Proposing: median {statistics.median(seconds):.1f} s,"
        f" max {max(seconds):.1f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
