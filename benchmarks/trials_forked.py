"""Trial runs of a repair's candidates: one forked pytest run (`agent/trials.py`) against
a fresh sandboxed run of each, on real corpus tasks.

For each task of a round-robin sample (`--tasks`, `--seed`, split `heldout`) it unpacks
the task's workspace, narrows the task's own verify command to the first failing test
(its leading assignments and options kept), and makes `--candidates` candidates of the
broken file: the reference fix at the middle, the others the broken file with a
comment added at a different line (the code does the same, so each fails as the bug
does, as most of a repair's candidates do). It then tries them all:

- real: `run_sandboxed(files=…)` for each, two side by side (a session's
  `trials_at_once`), as a repair did before the forked run;
- forked: `trials.forked` over the same list, two side by side.

It checks that both find the fix and nothing else, and prints the seconds per
candidate of each and their ratio (real / forked), per task and overall, from one run:

    OPENCOMPOSER_CORPUS=~/.cache/opencomposer/corpus-heldout \\
        python benchmarks/trials_forked.py --tasks 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from heldout import cpu_model  # noqa: E402


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default="heldout")
    ap.add_argument("--candidates", type=int, default=24)
    a = ap.parse_args()

    from opencomposer.agent import localize, trials
    from opencomposer.tools.protocols import SandboxConfig
    from opencomposer.tools.sandbox import run_sandboxed
    from opencomposer.training.catalog import load_suite
    from opencomposer.training.demos import spread

    tasks = spread(load_suite(f"corpus:{a.split}"), a.tasks, a.seed)
    if not tasks:
        print(f"error: the corpus has no {a.split} tasks (build it first)", file=sys.stderr)
        return 1
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(
        f"trial runs, {len(tasks)} tasks, {a.candidates} candidates each; CPU {cpu_model()}, load {load}"
    )
    config = SandboxConfig(mode="read-only")
    real_each: list[float] = []
    forked_each: list[float] = []
    for task in tasks:
        solution = json.loads((task.dir / "solution.json").read_text())
        fix = solution["edits"][0]
        # the verify command as a session's forked run narrows it, to the first failing test
        command = localize.narrowed_command(task.verify, f"FAILED {solution['failing'][0]}")
        if command is None or len({e["path"] for e in solution["edits"]}) != 1:
            print(f"{task.id}: not one file, or not a pytest command; left out")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "repo"
            root.mkdir()
            with tarfile.open(task.repo_tar) as tar:
                tar.extractall(root, filter="data")
            text = (root / fix["path"]).read_text()
            fixed = text
            for e in solution["edits"]:
                fixed = fixed.replace(e["old"], e["new"], 1)
            lines = text.splitlines(keepends=True)
            cands: list[dict[str, str]] = []
            for i in range(a.candidates - 1):
                at = (i * 7) % max(1, len(lines))
                noted = [*lines[:at], f"# candidate {i}\n", *lines[at:]]
                cands.append({fix["path"]: "".join(noted)})
            middle = len(cands) // 2
            cands.insert(middle, {fix["path"]: fixed})

            async def one(files: dict[str, str], root: Path = root, command: str = command) -> bool:
                r = await run_sandboxed(
                    command, root=root, config=config, timeout_s=120, files=files
                )
                return r.ok

            t0 = time.perf_counter()
            real: list[bool] = []
            for i in range(0, len(cands), 2):
                real += await asyncio.gather(*(one(c) for c in cands[i : i + 2]))
            real_s = time.perf_counter() - t0

            async def go(line: str, folder: Path, root: Path = root) -> None:
                await run_sandboxed(line, root=root, config=config, timeout_s=600, files={}, scratch=folder)  # fmt: skip

            t0 = time.perf_counter()
            got = await trials.forked(
                command, str(root), cands, go, each_s=60.0, stop_after=len(cands)
            )
            forked_s = time.perf_counter() - t0
        want = [i == middle for i in range(len(cands))]
        agree = (
            "agree" if got == real == want else f"DIFFER real={real == want} forked={got == want}"
        )
        n = len(cands)
        real_each.append(real_s / n)
        forked_each.append(forked_s / n)
        print(
            f"{task.id}: real {real_s / n:.2f} s/candidate, forked {forked_s / n:.2f} s/candidate"
            f" ({real_s / forked_s:.1f}x), {agree}"
        )
    if not real_each:
        print("no task to try")
        return 1
    total = sum(real_each) / sum(forked_each)
    print(
        f"\n{len(real_each)} tasks: real {statistics.median(real_each):.2f} s/candidate (median),"
        f" forked {statistics.median(forked_each):.2f} s/candidate (median); real / forked"
        f" over all candidates {total:.1f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
