"""`make demo`, N times: does the sample's test pass after each session, and how long
does the session take?

Each run is `examples/demo_lsp.py`'s own session — a fresh copy of
`examples/sample_repo` in a new git repository, `opencomposer serve --stdio` started as
a subprocess, the request sent by a real LSP client, the agent's edits applied and saved
by that client — then the sample's tests run (`pytest -q`). The session time runs from
starting the server to the answer (engine start and model load included, as a user
waits for them); the set-up (`make setup`, the one-time GGUF conversion) is not in it.

    python benchmarks/demo.py                    # 5 runs of the default model (smollm2)
    python benchmarks/demo.py --runs 5 --model llamacpp:runs/embedded/checkpoints/step_0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import io
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _demo_module():
    spec = importlib.util.spec_from_file_location("demo_lsp", ROOT / "examples" / "demo_lsp.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def one_run(demo, model: str, *, verbose: bool) -> tuple[bool, float, str]:
    """(tests pass, session seconds, the agent's answer line) of one demo session."""
    tmp = Path(tempfile.mkdtemp(prefix="opencomposer-demo-bench-"))
    try:
        repo = demo.prepare(tmp)
        out = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sys.stdout if verbose else out):
            rc = asyncio.run(demo.session(repo, model))
        seconds = time.perf_counter() - t0
        answer = next((ln for ln in out.getvalue().splitlines() if ln.startswith("answer:")), "")
        tests = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=False,
        )
        return rc == 0 and tests.returncode == 0, seconds, answer
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--verbose", action="store_true", help="show each session's events")
    a = ap.parse_args()
    demo = _demo_module()
    print(
        f"make demo x{a.runs}, model {a.model}; CPU {cpu_model()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    passed, times = 0, []
    for i in range(1, a.runs + 1):
        ok, seconds, answer = one_run(demo, a.model, verbose=a.verbose)
        passed += ok
        times.append(seconds)
        print(
            f"run {i}: tests {'pass' if ok else 'FAIL'}, session {seconds:.1f} s  {answer[:100]}",
            flush=True,
        )
    print(
        f"\n{passed}/{a.runs} runs left the sample's tests passing; session time median "
        f"{statistics.median(times):.1f} s, max {max(times):.1f} s (target: 5/5, at most 60 s); "
        f"load {os.getloadavg()[0]:.1f}"
    )
    return 0 if passed == a.runs else 1


if __name__ == "__main__":
    sys.exit(main())
