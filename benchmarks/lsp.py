"""Language-server latencies against the targets of issue 4, measured on the real
`opencomposer serve --stdio` process with a real LSP client (pygls).

| figure | target |
|---|---|
| `initialize` answered (request to response, server idle) | < 300 ms |
| first `opencomposer/event` after `opencomposer.ask` | < 100 ms |
| `opencomposer.search` p50 on a warm 10,000-chunk index | < 50 ms |
| cancellation (`opencomposer.cancel` / `$/cancelRequest` to the ask's answer) | < 500 ms |

Each line prints the figure, the target and target/figure (above 1: met). The
10,000-chunk workspace is generated once under
`$XDG_CACHE_HOME/opencomposer/bench-lsp-10k` (its index persists there, so only
the first run pays for embedding it). Also printed, for reference: the time from
spawning the process to the `initialize` answer (Python start and imports).

    python benchmarks/lsp.py [--skip-search] [--runs N]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lsprotocol import types as lsp
from pygls.io_ import run_async
from pygls.lsp.client import LanguageClient
from pygls.protocol import default_converter

SERVER = [sys.executable, "-m", "opencomposer.server.lsp", "--stdio"]
CHUNKS = 10_000
FUNCS_PER_FILE = 8
WORDS = [
    "retry",
    "backoff",
    "cache",
    "token",
    "parse",
    "render",
    "socket",
    "buffer",
    "stream",
    "queue",
    "worker",
    "lease",
    "shard",
    "index",
    "vector",
    "merge",
    "split",
    "flush",
    "commit",
    "rollback",
    "schema",
    "column",
    "record",
    "cursor",
    "batch",
    "window",
    "budget",
    "quota",
    "limit",
    "timeout",
    "deadline",
    "signal",
    "handler",
    "route",
    "session",
    "cookie",
    "header",
    "payload",
    "digest",
    "encode",
    "decode",
    "compress",
    "archive",
    "upload",
    "download",
    "mirror",
    "replica",
    "leader",
    "follower",
    "heartbeat",
]


@functools.cache
def _converter() -> Any:
    """One converter for all benchmark clients, so the client's own first-use
    (de)serialiser generation is not billed to the server."""
    return default_converter()


class Client(LanguageClient):
    def __init__(self) -> None:
        super().__init__("bench", "1", converter_factory=_converter)
        self.first_event: asyncio.Future[float] | None = None
        self.events: list[dict[str, Any]] = []

        @self.feature("opencomposer/event")
        def on_event(params: Any) -> None:
            ev = params._asdict() if hasattr(params, "_asdict") else params
            self.events.append(ev)
            if self.first_event is not None and not self.first_event.done():
                self.first_event.set_result(time.perf_counter())

        @self.feature(lsp.WINDOW_WORK_DONE_PROGRESS_CREATE)
        def on_create(params: Any) -> None:
            return None

        @self.feature(lsp.PROGRESS)
        def on_progress(params: Any) -> None:
            return None


async def spawn(
    root: Path, model: str, home: Path, *, initialize: bool = True
) -> tuple[Client, Any, float]:
    client = Client()
    env = dict(os.environ, OPENCOMPOSER_HOME=str(home))
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *SERVER,
        "--model",
        model,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    client.protocol.set_writer(proc.stdin)
    client._async_tasks.append(
        asyncio.create_task(
            run_async(stop_event=client._stop_event, reader=proc.stdout, protocol=client.protocol)
        )
    )
    spawn_to_init = 0.0
    if initialize:
        await init(client, root)
        spawn_to_init = time.perf_counter() - t0
    return client, proc, spawn_to_init


async def init(client: Client, root: Path) -> float:
    caps = lsp.ClientCapabilities(window=lsp.WindowClientCapabilities(work_done_progress=True))
    t0 = time.perf_counter()
    await client.initialize_async(
        lsp.InitializeParams(process_id=os.getpid(), root_uri=root.as_uri(), capabilities=caps)
    )
    took = time.perf_counter() - t0
    client.initialized(lsp.InitializedParams())
    return took


async def stop(client: Client, proc: Any) -> None:
    try:
        await asyncio.wait_for(client.shutdown_async(None), 10)
        client.exit(None)
    except Exception:
        pass
    proc.stdin.close()
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except TimeoutError:
        proc.kill()
    client._stop_event.set()
    for task in client._async_tasks:
        task.cancel()


async def command(client: Client, name: str, arg: dict[str, Any]) -> Any:
    return await client.workspace_execute_command_async(
        lsp.ExecuteCommandParams(command=name, arguments=[arg])
    )


def report(name: str, value_s: float, target_s: float, note: str = "") -> None:
    ratio = target_s / value_s if value_s > 0 else float("inf")
    verdict = "met" if value_s < target_s else "MISSED"
    print(
        f"{name:<52} {value_s * 1000:9.1f} ms   target < {target_s * 1000:.0f} ms   target/figure {ratio:6.2f}  {verdict} {note}"
    )


async def bench_initialize(root: Path, model: str, home: Path, runs: int) -> None:
    idle, cold = [], []
    for _ in range(runs):
        client, proc, _ = await spawn(root, model, home, initialize=False)
        t0 = time.perf_counter()
        await init(client, root)
        cold.append(time.perf_counter() - t0)
        await stop(client, proc)
    for _ in range(runs):
        client, proc, _ = await spawn(root, model, home, initialize=False)
        # an unknown request answered (method not found) proves the process is up and idle
        try:
            await asyncio.wait_for(client.protocol.send_request_async("opencomposer/ping"), 30)
        except Exception:
            pass
        idle.append(await init(client, root))
        await stop(client, proc)
    report("initialize, request to response (server idle), p50", statistics.median(idle), 0.300)
    print(
        f"{'  for reference: process spawn to initialize answer, p50':<52} {statistics.median(cold) * 1000:9.1f} ms"
    )


async def bench_first_event_and_cancel(root: Path, home: Path, runs: int) -> None:
    fast = home / "fast.json"
    fast.write_text(json.dumps({"turns": ["hello"], "chars_per_second": 0}))
    client, proc, _ = await spawn(root, f"scripted:{fast}", home)
    firsts = []
    for _ in range(runs + 1):
        client.first_event = asyncio.get_running_loop().create_future()
        t0 = time.perf_counter()
        ask = asyncio.ensure_future(command(client, "opencomposer.ask", {"query": "hi"}))
        firsts.append(await asyncio.wait_for(client.first_event, 30) - t0)
        await ask
    await stop(client, proc)
    report(
        "first opencomposer/event after opencomposer.ask, p50", statistics.median(firsts[1:]), 0.100
    )
    print(
        f"{'  for reference: the very first ask of a fresh server':<52} {firsts[0] * 1000:9.1f} ms"
    )

    slow = home / "slow.json"
    slow.write_text(json.dumps({"turns": ["word " * 5000], "chars_per_second": 200}))
    client, proc, _ = await spawn(root, f"scripted:{slow}", home)
    by_command, by_request = [], []
    for i in range(runs):
        client.first_event = asyncio.get_running_loop().create_future()
        ask = asyncio.ensure_future(command(client, "opencomposer.ask", {"query": f"slow {i}"}))
        await asyncio.wait_for(client.first_event, 30)
        await asyncio.sleep(0.3)
        t0 = time.perf_counter()
        await command(client, "opencomposer.cancel", {})
        result = await asyncio.wait_for(ask, 30)
        by_command.append(time.perf_counter() - t0)
        assert getattr(result, "status", None) == "cancelled" or result["status"] == "cancelled", (
            result
        )
    for i in range(runs):
        client.first_event = asyncio.get_running_loop().create_future()
        msg_id = f"bench-{i}"
        params = lsp.ExecuteCommandParams(
            command="opencomposer.ask", arguments=[{"query": f"slow r{i}"}]
        )
        fut = client.protocol.send_request(lsp.WORKSPACE_EXECUTE_COMMAND, params, msg_id=msg_id)
        await asyncio.wait_for(client.first_event, 30)
        await asyncio.sleep(0.3)
        t0 = time.perf_counter()
        client.protocol.notify(lsp.CANCEL_REQUEST, lsp.CancelParams(id=msg_id))
        try:
            await asyncio.wait_for(asyncio.wrap_future(fut), 30)
        except Exception:
            pass
        by_request.append(time.perf_counter() - t0)
    await stop(client, proc)
    report(
        "cancel: opencomposer.cancel to the ask's answer, max",
        max(by_command),
        0.500,
        f"(p50 {statistics.median(by_command) * 1000:.1f} ms)",
    )
    report(
        "cancel: $/cancelRequest to the ask's answer, max",
        max(by_request),
        0.500,
        f"(p50 {statistics.median(by_request) * 1000:.1f} ms)",
    )


def make_corpus(root: Path) -> None:
    """~10,000 chunks: files of eight ~300-character functions (above the chunker's merge size)."""
    rng = random.Random(0)
    files = CHUNKS // FUNCS_PER_FILE
    for f in range(files):
        pkg = root / f"pkg{f // 100:02d}"
        pkg.mkdir(parents=True, exist_ok=True)
        out = []
        for g in range(FUNCS_PER_FILE):
            a, b, c = rng.sample(WORDS, 3)
            body = " ".join(rng.choice(WORDS) for _ in range(12))
            out.append(
                f"def {a}_{b}_{c}_{f}_{g}(items, limit=10):\n"
                f'    """{a.title()} the {b} of each {c}: {body}."""\n'
                f"    result = []\n"
                f"    for item in items[:limit]:\n"
                f"        if item.{b} is not None and item.{c} > {g}:\n"
                f"            result.append(item.{a}({b}=item.{b}, {c}=item.{c} + {f}))\n"
                f"    return result\n"
            )
        (pkg / f"mod{f:04d}.py").write_text("\n\n".join(out))


async def bench_search(home: Path, runs: int) -> None:
    cache = (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "opencomposer"
        / "bench-lsp-10k"
    )
    if not (cache / "done").exists():
        print(f"generating the 10,000-chunk workspace in {cache} …", flush=True)
        make_corpus(cache)
        (cache / "done").write_text("")
    client, proc, _ = await spawn(cache, "scripted:" + str(home / "fast.json"), home)
    t0 = time.perf_counter()
    print("opening (and, the first time, building) its index through the server …", flush=True)
    await asyncio.wait_for(command(client, "opencomposer.search", {"query": "warm up"}), 3600)
    print(f"  index ready in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = random.Random(1)
    queries = [" ".join(rng.sample(WORDS, 3)) for _ in range(max(runs * 6, 30))]
    times = []
    for query in queries:
        t1 = time.perf_counter()
        hits = await command(client, "opencomposer.search", {"query": query, "k": 10})
        times.append(time.perf_counter() - t1)
        assert hits, query
    await stop(client, proc)
    # the baseline, measured now: the same queries on the same index, in this process
    from opencomposer.index import CodebaseIndex

    with CodebaseIndex.open(cache) as index:
        chunks = len(index)
        index.search("warm up", k=10)
        direct = []
        for query in queries:
            t1 = time.perf_counter()
            index.search(query, k=10)
            direct.append(time.perf_counter() - t1)
    server_p50, direct_p50 = statistics.median(times), statistics.median(direct)
    report(f"opencomposer.search p50, warm index of {chunks} chunks", server_p50, 0.050)
    print(
        f"{'  baseline: CodebaseIndex.search in-process, p50':<52} {direct_p50 * 1000:9.1f} ms"
        f"   server overhead {(server_p50 - direct_p50) * 1000:.1f} ms ({server_p50 / direct_p50:.2f}x)"
    )
    print(
        f"{'  load average while measuring':<52} {os.getloadavg()[0]:9.1f}   on {os.cpu_count()} CPUs"
    )


async def main() -> int:
    p = argparse.ArgumentParser(description="language-server latencies against the issue-4 targets")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument(
        "--skip-search", action="store_true", help="skip the 10,000-chunk search benchmark"
    )
    a = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory(prefix="oc-bench-lsp-") as tmp:
        home = Path(tmp) / "home"
        root = Path(tmp) / "ws"
        home.mkdir()
        root.mkdir()
        (root / "a.py").write_text("x = 1\n")
        fast = home / "fast.json"
        fast.write_text(json.dumps({"turns": ["hello"], "chars_per_second": 0}))
        await bench_initialize(root, f"scripted:{fast}", home, a.runs)
        await bench_first_event_and_cancel(root, home, a.runs)
        if not a.skip_search:
            await bench_search(home, a.runs)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
