"""A multi-node Ray cluster on this machine, started with ``ray start`` like a real one.

For the two-node test and ``benchmarks/cluster.py``: a head (``ray start --head``)
and more nodes (``ray start --address``), each with its own CPUs, a custom resource
label, its own ports, all under one ``--temp-dir``. ``stop()`` ends exactly the
processes this cluster started — the ones whose command line names its temp dir,
and their children (vLLM's engine processes) — never other Ray instances on the
machine (``ray stop`` would end them all).

    with LocalRayCluster() as c:
        c.add_node(num_cpus=3, resources={"head": 1}, head=True)
        c.add_node(num_cpus=3, resources={"node_b": 1})
        ... train with [cluster] address = c.address ...
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _free_range(n: int) -> int:
    """The first of ``n`` consecutive ports that are free now (worker ports)."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - n)
        ok = True
        for p in (base, base + n // 2, base + n - 1):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")


class LocalRayCluster:
    """Ray nodes as ``ray start`` subprocesses; a context manager that always stops them."""

    def __init__(self, temp_dir: Path | None = None) -> None:
        # Ray's socket paths must stay short: a temp dir directly under /tmp
        self.temp_dir = Path(temp_dir or tempfile.mkdtemp(prefix="ocray-", dir="/tmp"))
        self.port = 0
        self.nodes: list[dict[str, Any]] = []
        bindir = Path(sys.executable).parent
        self.ray = str(bindir / "ray") if (bindir / "ray").exists() else "ray"
        self.env = {
            **os.environ,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "disabled",  # a throwaway cluster on loopback
        }

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def add_node(
        self,
        *,
        num_cpus: float,
        resources: dict[str, float] | None = None,
        head: bool = False,
        object_store_mb: int = 400,
        timeout_s: float = 180,
    ) -> None:
        workers = _free_range(60)
        args = [
            self.ray,
            "start",
            f"--num-cpus={num_cpus:g}",
            f"--resources={json.dumps(resources or {})}",
            f"--object-store-memory={object_store_mb * 2**20}",
            f"--temp-dir={self.temp_dir}",
            "--node-ip-address=127.0.0.1",
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--min-worker-port={workers}",
            f"--max-worker-port={workers + 59}",
            "--disable-usage-stats",
        ]
        if head:
            self.port = free_port()
            args += [
                "--head",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--ray-client-server-port={free_port()}",
            ]
        else:
            args += [f"--address={self.address}"]
        r = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"ray start failed: {' | '.join(tail)}")
        self.nodes.append({"num_cpus": num_cpus, "resources": resources or {}, "head": head})

    def pids(self) -> list[int]:
        """This cluster's processes: command lines naming its temp dir, plus descendants."""
        mark = str(self.temp_dir)
        parent: dict[int, int] = {}
        roots: set[int] = set()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                stat = (d / "stat").read_text()
            except OSError:
                continue
            pid = int(d.name)
            parent[pid] = int(stat.rsplit(")", 1)[1].split()[1])
            if mark in cmd and pid != os.getpid():
                roots.add(pid)
        found = set(roots)
        grew = True
        while grew:
            grew = False
            for pid, ppid in parent.items():
                if ppid in found and pid not in found and pid != os.getpid():
                    found.add(pid)
                    grew = True
        return sorted(found)

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
            pids = self.pids()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if Path(f"/proc/{p}").exists()]
                time.sleep(0.1)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
