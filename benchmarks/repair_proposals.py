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

`--model LABEL=FOLDER` more than once compares models on the same tasks in one run
(`training/repairrl.py`'s checkpoints against the shipped policy, say), each task's rank
side by side, then each model's counts.

`--ran` also runs each task's failing tests once, traced, in its workspace (read-only
in the sandbox, as a session's repair does: `localize.failing_run`) and proposes
again with the edits of lines that run reached first (`propose(live=…)`); each task
shows both ranks, then both counts. With `--others`, the functions beside the broken
one are in focus too, as a session's reads put them there.

`--vs NAME=VALUE` proposes again with one of the repair's numbers changed
(`--vs TOP_K=16`, `--vs EXPAND=64`) on the same tasks and model, each task's two ranks
and times side by side, then both counts and how many ranks rose and fell: a change to
the proposing is measured against the code as it is, in one run.

`--again` times what a session's next repair of the same code costs, the candidates
tried before left out (`propose(known=…)`): proposed by the model anew, and through
the session's memory of the model's reads (`repair.Remembered`, which made the first
proposal), each task's two times and the ratio, then the medians; the two must
propose the same candidates, and the script says where they do not.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from heldout import cpu_model  # noqa: E402

# repair's numbers that are `propose`'s defaults, and its arguments that take them
PROPOSE_ARGS = {"TOP_K": "k", "EXPAND": "expand", "RESCORE": "rescore", "TAIL": "tail"}


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default="heldout")
    ap.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[LABEL=]FOLDER",
        help="a llama.cpp model folder (default: smollm2); again to compare",
    )
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
    ap.add_argument(
        "--again",
        action="store_true",
        help="time a second repair of the same code, anew and from the reads' memory",
    )
    ap.add_argument(
        "--vs",
        metavar="NAME=VALUE",
        help="also propose with the number repair.NAME set to VALUE (TOP_K=16, say),"
        " each task's two ranks side by side, then both counts",
    )
    ap.add_argument(
        "--ran",
        action="store_true",
        help="also propose with the edits of lines the failing run reached first",
    )
    a = ap.parse_args()

    from opencomposer.agent import repair
    from opencomposer.agent.backends.llamacpp import LlamaCppModel
    from opencomposer.training.catalog import load_suite
    from opencomposer.training.demos import spread
    from opencomposer.training.repairrl import broken_state
    from opencomposer.training.sft_offline import model_dir

    if a.rescore_tokens is not None:
        repair.RESCORE_TOKENS = a.rescore_tokens
    if a.chain_tokens is not None:
        repair.CHAIN_TOKENS = a.chain_tokens
    tasks = spread(load_suite(f"corpus:{a.split}"), a.tasks, a.seed)
    if not tasks:
        print(f"error: the corpus has no {a.split} tasks (build it first)", file=sys.stderr)
        return 1
    models = [m.partition("=")[::2] if "=" in m else (m, m) for m in a.model]
    models = [(label, str(model_dir(spec))) for label, spec in models or [("shipped", "smollm2")]]
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"repair proposals, {len(tasks)} tasks; CPU {cpu_model()}, load {load}")
    states = []
    for task in tasks:
        state = broken_state(task, a.others)
        if state is None:
            print(f"{task.id}: two sites, or the broken lines are not found once: left out")
            continue
        states.append((task, state, [repair.Span(*span) for span in state["spans"]]))
    if not states:
        print("no single-site task")
        return 1
    ran = await executed(states) if a.ran else {}
    sizes = {k: v for k, v in (("rescore", a.rescore), ("tail", a.tail)) if v is not None}
    vs = None
    if a.vs:
        name, _, value = a.vs.partition("=")
        if not isinstance(getattr(repair, name, None), int) or not value.lstrip("-").isdigit():
            print(
                f"error: --vs {a.vs}: give NAME=INTEGER, NAME a number of repair", file=sys.stderr
            )
            return 1
        vs = (name, int(value))
    ranks: dict[str, list[int | None]] = {}
    seconds: dict[str, list[float]] = {}
    again: dict[str, list[tuple[float, float]]] = {}
    for label, folder in models:
        model = LlamaCppModel(folder)
        await model.start()
        ranks[label], seconds[label], again[label] = [], [], []
        try:
            for task, state, spans in states:
                t0 = time.perf_counter()
                texts = {state["path"]: state["text"]}
                got = await repair.propose(model, model.tokenizer, texts, spans, **sizes)
                seconds[label].append(time.perf_counter() - t0)
                rank = rank_of(got, state["fixed"])
                ranks[label].append(rank)
                lines = sum(s.end - s.start for s in spans)
                where = "not proposed" if rank is None else f"rank {rank + 1}"
                print(
                    f"{label}: {task.id} ({state['kind']}): {where} of {len(got)},"
                    f" {lines} lines, {seconds[label][-1]:.1f} s"
                )
                if vs is not None:
                    name, value = vs
                    kept, t0 = getattr(repair, name), time.perf_counter()
                    setattr(repair, name, value)
                    # propose's defaults are read once: those numbers go as its arguments
                    given = {
                        **sizes,
                        **({PROPOSE_ARGS[name]: value} if name in PROPOSE_ARGS else {}),
                    }
                    try:
                        other = await repair.propose(model, model.tokenizer, texts, spans, **given)
                    finally:
                        setattr(repair, name, kept)
                    arm = f"{label} {name}={value}"
                    seconds.setdefault(arm, []).append(time.perf_counter() - t0)
                    at = rank_of(other, state["fixed"])
                    ranks.setdefault(arm, []).append(at)
                    print(
                        f"  {name}={value}: {'not proposed' if at is None else f'rank {at + 1}'}"
                        f" of {len(other)}, {seconds[arm][-1]:.1f} s"
                    )
                if a.again:
                    again[label].append(await propose_again(model, texts, spans, got, sizes))
                if a.ran:
                    live = repair.live_check(texts, ran.get(task.id))
                    t0 = time.perf_counter()
                    first = await repair.propose(
                        model, model.tokenizer, texts, spans, live=live, **sizes
                    )
                    at = rank_of(first, state["fixed"])
                    ranks.setdefault(f"{label} ran first", []).append(at)
                    seconds.setdefault(f"{label} ran first", []).append(time.perf_counter() - t0)
                    print(
                        f"  ran first: {'not proposed' if at is None else f'rank {at + 1}'}"
                        f" of {len(first)}; {sum(not p.ran for p in first)} not run"
                        + ("" if live else " (no record of the run)")
                    )
        finally:
            await model.close()
    n = len(states)
    print()
    for label in ranks:
        got = ranks[label]
        within = [sum(r is not None and r < k for r in got) for k in (1, 5, 10, 20, 50)]
        found = sum(r is not None for r in got)
        print(
            f"{label}: {n} single-site tasks: the fix ranks first in {within[0]}, within 5 in"
            f" {within[1]}, within 10 in {within[2]}, within 20 in {within[3]}, within 50 in"
            f" {within[4]}; proposed at all in {found}/{n}. Proposing: median"
            f" {statistics.median(seconds[label]):.1f} s, max {max(seconds[label]):.1f} s"
        )
        if again.get(label):
            anew, memo = (statistics.median(t) for t in zip(*again[label], strict=True))
            print(
                f"{label}: the next repair of the same code: median {anew:.1f} s proposed anew,"
                f" {memo:.2f} s from memory ({anew / memo:.0f}x)"
            )
    if len(ranks) > 1:
        base = models[0][0]
        for label in [k for k in ranks if k != base]:
            pairs = [
                (b, o)
                for b, o in zip(ranks[base], ranks[label], strict=True)
                if b is not None or o is not None
            ]
            up = sum(o is not None and (b is None or o < b) for b, o in pairs)
            down = sum(b is not None and (o is None or b < o) for b, o in pairs)
            print(f"{label} against {base}: the fix ranks higher in {up} tasks, lower in {down}")
    return 0


def rank_of(proposals: list[Any], fixed: str) -> int | None:
    """Where among `proposals` the reference fix (its file's text, `fixed`) is."""
    return next((i for i, p in enumerate(proposals) if p.after == fixed), None)


async def executed(states: list[Any]) -> dict[str, dict[str, frozenset[int]] | None]:
    """Each task's `localize.executed_lines`: its failing command (`state["command"]`)
    run once, traced, in its workspace, read-only in the sandbox."""
    from opencomposer.agent import localize
    from opencomposer.tools.protocols import SandboxConfig
    from opencomposer.tools.sandbox import run_sandboxed
    from opencomposer.training.env import EnvConfig, Workspaces, remove_workspace

    root = Path(tempfile.mkdtemp(prefix="repair-proposals-"))
    ws = Workspaces(root / "ws", EnvConfig(pool_size=0, max_templates=2))
    config = SandboxConfig(mode="read-only", timeout_s=300)
    out: dict[str, dict[str, frozenset[int]] | None] = {}
    try:
        for task, state, _ in states:
            workspace = await ws.template(task)
            first = await run_sandboxed(state["command"], root=workspace, config=config, files={})

            async def go(traced: str, folder: Path, at: Path = workspace) -> None:
                await run_sandboxed(traced, root=at, config=config, files={}, scratch=folder)

            found = await localize.failing_run(
                state["command"],
                str(workspace),
                first.output,
                go,
                localize.installed_folders(workspace),
            )
            out[task.id] = found.executed
    finally:
        await ws.aclose()
        remove_workspace(root / "ws")
        shutil.rmtree(root, ignore_errors=True)
    return out


async def propose_again(
    model: Any, texts: dict[str, str], spans: list[Any], got: list[Any], sizes: dict[str, int]
) -> tuple[float, float]:
    """(seconds, seconds) of the next repair of the same code, the candidates `got`
    left out: proposed by `model` anew, then through `repair.Remembered` after it made
    the first proposal, as a session's later turn makes it."""
    from opencomposer.agent import repair

    tried = {p.after for p in got}

    def known(path: str, after: str) -> bool:
        return after in tried

    t0 = time.perf_counter()
    anew = await repair.propose(model, model.tokenizer, texts, spans, known=known, **sizes)
    t1 = time.perf_counter()
    memo = repair.Remembered(model)
    await repair.propose(memo, model.tokenizer, texts, spans, **sizes)
    t2 = time.perf_counter()
    remembered = await repair.propose(memo, model.tokenizer, texts, spans, known=known, **sizes)
    t3 = time.perf_counter()
    same = [p.after for p in anew] == [p.after for p in remembered]
    print(
        f"  again: {t1 - t0:.1f} s anew, {t3 - t2:.2f} s from memory ({(t1 - t0) / (t3 - t2):.0f}x);"
        f" first through memory {t2 - t1:.1f} s; "
        + ("the same candidates" if same else "NOT the same candidates")
    )
    return t1 - t0, t3 - t2


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
