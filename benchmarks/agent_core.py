"""Agent-core speed figures, each against its target, from one run.

    .venv/bin/python benchmarks/agent_core.py

1. Four independent `run_terminal sleep 1` calls in one message: the tool phase
   against the 4 s a serial run takes (target <= 1.3 s).
2. `scripted:` at 200 chars/s, a message with three calls: the first call starts
   before the message ends; closing tag -> tool_start latency (target < 20 ms).
3. Dispatch overhead of a small read_file through the executor (target < 2 ms
   median), against calling the tool function directly.
4. Sandbox overhead of `run_terminal true` (target < 50 ms median), against a
   plain subprocess.
5. `opencomposer --help` wall time (target < 0.4 s).

The embedded model's figures are in benchmarks/model.py.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from opencomposer.agent.backends.scripted import ScriptedModel
from opencomposer.agent.executor import Executor
from opencomposer.agent.session import Session, SessionConfig
from opencomposer.agent.xmlcalls import ParsedCall
from opencomposer.tools import specs
from opencomposer.tools.protocols import SandboxConfig, ToolContext
from opencomposer.tools.workspace import LocalWorkspace


def line(name: str, value: str, target: str, ok: bool) -> None:
    print(f"{name:<48} {value:>24}   target {target:<12} {'OK' if ok else 'MISSED'}")


async def parallel_sleeps(root: Path) -> None:
    msg = "\n".join("<run_terminal><command>sleep 1</command></run_terminal>" for _ in range(4))
    events: list[dict] = []
    session = Session(
        model=ScriptedModel([msg, "done"]),
        workspace=LocalWorkspace(root),
        config=SessionConfig(approve="all"),
        on_event=lambda e: events.append(e.to_wire()),
    )
    await session.run("sleep")
    starts = [e["t"] for e in events if e["type"] == "tool_start"]
    ends = [e["t"] for e in events if e["type"] == "tool_end"]
    phase = max(ends) - min(starts)
    line(
        "4 x sleep 1 in one message: tool phase",
        f"{phase:.2f} s ({4 / phase:.2f}x serial)",
        "<= 1.3 s",
        phase <= 1.3,
    )


async def streaming_start(root: Path) -> None:
    msg = (
        'First the file.\n<read_file path="a.txt"/>\nThen a search over everything here.\n'
        '<grep pattern="hello"/>\nAnd the listing of the root.\n<list_dir path="."/>\nThat is all for now.'
    )
    arrivals: list[tuple[float, int]] = []
    model = ScriptedModel([msg, "done"], chars_per_second=200)
    plain_stream = model.stream

    class Timed:
        """The scripted stream, noting when each delta arrives."""

        def __init__(self, inner):  # type: ignore[no-untyped-def]
            self.inner = inner

        @property
        def output(self):  # type: ignore[no-untyped-def]
            return self.inner.output

        async def __aiter__(self):  # type: ignore[no-untyped-def]
            total = 0
            async for d in self.inner:
                total += len(d)
                arrivals.append((time.monotonic(), total))
                yield d

        async def aclose(self) -> None:
            await self.inner.aclose()

    def stream(messages, sampling):  # type: ignore[no-untyped-def]
        return Timed(plain_stream(messages, sampling))

    model.stream = stream  # type: ignore[method-assign]
    events: list[dict] = []
    session = Session(
        model=model,
        workspace=LocalWorkspace(root),
        config=SessionConfig(approve="all"),
        on_event=lambda e: events.append(e.to_wire()),
    )
    await session.run("look")
    t0 = session.clock.start
    from opencomposer.agent.xmlcalls import parse_all
    from opencomposer.tools.specs import parser_rules

    calls = parse_all(msg, *parser_rules())
    starts = [e["t"] for e in events if e["type"] == "tool_start"][: len(calls)]
    msg_end = next(e["t"] for e in events if e["type"] == "model_end")
    lat = []
    for call, started in zip(calls, starts, strict=True):
        closed_at = next(t for t, n in arrivals if n >= call.end) - t0
        lat.append((started - closed_at) * 1000)
    early = msg_end - starts[0]
    line("first call starts before the message ends", f"{early:.2f} s earlier", "> 0", early > 0)
    line("closing tag -> tool_start (max of 3)", f"{max(lat):.2f} ms", "< 20 ms", max(lat) < 20)


async def dispatch(root: Path) -> None:
    ctx = ToolContext(workspace=LocalWorkspace(root))
    spec = specs.get("read_file")
    fn = spec.load()
    direct, through = [], []
    for i in range(300):
        t = time.perf_counter()
        await fn(ctx, path="a.txt")
        direct.append(time.perf_counter() - t)
        ex = Executor(ctx, turn=1)
        t = time.perf_counter()
        ex.submit(ParsedCall(index=i, name="read_file", raw={"path": "a.txt"}))
        await ex.wait()
        through.append(time.perf_counter() - t)
    d, x = statistics.median(direct) * 1000, statistics.median(through) * 1000
    line("read_file through the executor (median)", f"{x:.3f} ms (direct {d:.3f})", "< 2 ms", x < 2)


async def sandbox(root: Path) -> None:
    ctx = ToolContext(workspace=LocalWorkspace(root), sandbox=SandboxConfig())
    fn = specs.get("run_terminal").load()
    boxed, plain = [], []
    for _ in range(30):
        t = time.perf_counter()
        await fn(ctx, command="true")
        boxed.append(time.perf_counter() - t)
        t = time.perf_counter()
        p = await asyncio.create_subprocess_exec("bash", "-c", "true")
        await p.wait()
        plain.append(time.perf_counter() - t)
    b, p_ = statistics.median(boxed) * 1000, statistics.median(plain) * 1000
    line(
        "run_terminal `true` in bwrap (median)",
        f"{b:.1f} ms ({b - p_:+.1f} vs plain)",
        "< 50 ms",
        b < 50,
    )


def cli_help() -> None:
    exe = Path(sys.executable).with_name("opencomposer")
    times = []
    for _ in range(5):
        t = time.perf_counter()
        subprocess.run([str(exe), "--help"], capture_output=True, check=True)
        times.append(time.perf_counter() - t)
    m = statistics.median(times)
    line("opencomposer --help (median of 5)", f"{m:.3f} s", "< 0.4 s", m < 0.4)


async def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "a.txt").write_text("hello\nworld\n")
        await parallel_sleeps(root)
        await streaming_start(root)
        await dispatch(root)
        await sandbox(root)
    cli_help()


if __name__ == "__main__":
    asyncio.run(main())
