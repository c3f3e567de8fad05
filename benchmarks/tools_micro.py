"""Tool-layer micro benchmarks: the fixed cost of one tool call.

Measures, as medians over repeated runs in one process:
- `read_file` of a 200-line file through `ToolSpec.validate` + `ToolSpec.run`
  (target < 2 ms), against a bare `Path.read_text` as the baseline;
- `run_terminal` with `true` in the bubblewrap sandbox (target < 50 ms), against
  the same bwrap command line started bare (no limits, no cgroup, no capture) and
  `true` as a plain asyncio subprocess;
- how long after cancelling a sandboxed `sleep` its process is gone;
- `read_file` of a path that is missing in a tree of 10,000 files, whose error
  names the files it may mean (a walk of the tree), against a hit in that tree.

Run: .venv/bin/python benchmarks/tools_micro.py
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from opencomposer.tools import specs
from opencomposer.tools.protocols import SandboxConfig, ToolContext
from opencomposer.tools.sandbox import run_sandboxed, sandbox_argv
from opencomposer.tools.workspace import LocalWorkspace


async def median_ms(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def _alive(marker: str) -> bool:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    return True
            except OSError:
                pass
    return False


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "mod.py").write_text("".join(f"line_{i} = {i}\n" for i in range(200)))
        ctx = ToolContext(workspace=LocalWorkspace(root), sandbox=SandboxConfig(timeout_s=30))
        read = specs.get("read_file")
        term = specs.get("run_terminal")

        async def read_tool() -> None:
            r = await read.run(
                ctx, read.validate({"path": "mod.py", "start_line": "1", "end_line": "60"})
            )
            assert r.status == "ok"

        async def read_plain() -> None:
            (root / "mod.py").read_text()

        async def terminal_tool() -> None:
            r = await term.run(ctx, term.validate({"command": "true"}))
            assert r.status == "ok", r.output

        async def plain_true() -> None:
            proc = await asyncio.create_subprocess_exec("true")
            await proc.wait()

        bare_bwrap = sandbox_argv("true", root, ctx.sandbox)

        async def bwrap_true() -> None:
            proc = await asyncio.create_subprocess_exec(*bare_bwrap)
            await proc.wait()

        await read_tool()
        await terminal_tool()
        read_ms = await median_ms(read_tool, 500)
        read_base = await median_ms(read_plain, 500)
        term_ms, bwrap_ms = [], []
        for _ in range(15):  # interleaved, so load from other processes hits both alike
            term_ms.append(await median_ms(terminal_tool, 2))
            bwrap_ms.append(await median_ms(bwrap_true, 2))
        term_med, bwrap_med = statistics.median(term_ms), statistics.median(bwrap_ms)
        term_base = await median_ms(plain_true, 30)

        cancel_ms = []
        for i in range(5):
            marker = f"4321.{i}{os.getpid()}"
            task = asyncio.create_task(
                run_sandboxed(f"sleep {marker}", root=root, config=SandboxConfig())
            )
            while not _alive(marker):
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)
            t = time.perf_counter()
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            while _alive(marker):
                await asyncio.sleep(0.001)
            cancel_ms.append((time.perf_counter() - t) * 1000)
        await asyncio.sleep(0.3)

        tree = root / "tree"
        for i in range(10_000):
            folder = tree / f"pkg{i // 100}" / f"sub{i // 10 % 10}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"mod{i % 10}_{i}.py").write_text("x = 1\n")

        async def read_named(path: str, status: str) -> None:
            r = await read.run(ctx, read.validate({"path": path}))
            assert r.status == status, r.output

        hit_ms = await median_ms(lambda: read_named("tree/pkg7/sub3/mod4_734.py", "ok"), 50)
        miss_ms = await median_ms(lambda: read_named("sub3/mod4_734.py", "error"), 10)

    print(f"read_file via spec.run      median {read_ms:7.3f} ms  (target < 2 ms)")
    print(
        f"  baseline Path.read_text   median {read_base:7.3f} ms  ratio {read_ms / read_base:6.1f}x"
    )
    print(f"run_terminal 'true' (bwrap) median {term_med:7.2f} ms  (target < 50 ms)")
    print(
        f"  baseline bare bwrap true  median {bwrap_med:7.2f} ms  ratio {term_med / bwrap_med:6.2f}x"
    )
    print(
        f"  baseline plain subprocess median {term_base:7.2f} ms  ratio {term_med / term_base:6.1f}x"
    )
    print(f"  (load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(
        f"cancel -> process gone      median {statistics.median(cancel_ms):7.2f} ms  "
        f"(max {max(cancel_ms):.2f} ms; target ~100 ms)"
    )
    print(f"read_file miss, 10k files   median {miss_ms:7.2f} ms  (names the near misses)")
    print(f"  baseline read_file hit    median {hit_ms:7.3f} ms  ratio {miss_ms / hit_ms:6.0f}x")


if __name__ == "__main__":
    asyncio.run(main())
