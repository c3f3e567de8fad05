"""Sample-and-rank at the fix step, offline: how often the reply that
`agent/alternatives.py` keeps fixes the bug, against one reply as sampled.

It reads the graded replies of `benchmarks/fix_step.py` (`--work/LABEL/groups.jsonl`:
each held-out fix state answered `k` times, every reply graded by the task's own
tests) and, for each state and each N in `--n`, ranks the state's first N replies
with the session's own ranking (`alternatives.rank`: each reply's changes applied in
memory to the task's files, the one whose changed code the scorer finds likeliest
against the code as it stands) with the model `--scorer` as a `transformers` forward
pass. It prints, per N: the share of states whose kept reply fixes the bug (with its
standard error over states), the share of replies that fix it (one reply, as
sampled), and the share of states where at least one of the N does (the most any
ranking can keep):

    OPENCOMPOSER_CORPUS=~/.cache/opencomposer/corpus-heldout python benchmarks/fix_rank.py \\
        --groups bench-heldout/fix_step/shipped/groups.jsonl --scorer smollm2 --n 1 2 4 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from heldout import cpu_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=Path, required=True, help="fix_step.py's groups.jsonl")
    ap.add_argument("--scorer", default="smollm2", help="smollm2, smollm2-base or a folder")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    a = ap.parse_args()

    import torch
    from opencomposer.agent import alternatives
    from opencomposer.agent.xmlcalls import parse_all
    from opencomposer.tools.specs import parser_rules
    from opencomposer.training.fixstep import lm_scorer, named_paths, task_files, task_map
    from opencomposer.training.sft_offline import model_dir

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    forward = lm_scorer(model_dir(a.scorer))
    memo: dict[tuple[str, str], float] = {}  # a state's texts, scored once for every N

    async def score(context: str, text: str) -> float:
        if (context, text) not in memo:
            memo[context, text] = await forward(context, text)
        return memo[context, text]

    tasks = task_map("corpus:heldout")
    states = [json.loads(x) for x in a.groups.read_text().splitlines() if x.strip()]
    kept = {n: 0.0 for n in a.n}
    any_fix = {n: 0.0 for n in a.n}
    per_reply = {n: 0.0 for n in a.n}
    picks: dict[int, list[float]] = {n: [] for n in a.n}
    t0, used = time.perf_counter(), 0
    for st in states:
        if st["task_id"] not in tasks:
            continue
        used += 1
        memo.clear()
        replies = st["replies"]
        cands = [parse_all(r["text"], *parser_rules()) for r in replies]
        with task_files(tasks[st["task_id"]], named_paths(cands)) as ws:
            fixed = [r["why"] == "resolved" for r in replies]
            for n in a.n:
                ranked = asyncio.run(alternatives.rank(ws, cands[:n], score))
                hit = float(fixed[ranked.index])
                kept[n] += hit
                picks[n].append(hit)
                any_fix[n] += float(any(fixed[:n]))
                per_reply[n] += sum(fixed[:n]) / n
    if not used:
        print("no state of the groups is a task of the corpus", file=sys.stderr)
        return 1
    print(
        f"fix step, sample-and-rank: {used} held-out states, scorer {a.scorer}; "
        f"CPU {cpu_model()}; {time.perf_counter() - t0:.0f} s\n"
    )
    print("| replies | kept reply fixes it | one reply fixes it | any of them fixes it |")
    print("|---|---|---|---|")
    for n in a.n:
        p = kept[n] / used
        se = math.sqrt(p * (1 - p) / used)
        print(
            f"| {n} | {p:.1%} ± {se:.1%} ({int(kept[n])}/{used}) | {per_reply[n] / used:.1%} "
            f"| {any_fix[n] / used:.1%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
