"""`make demo` without the language server: one real session with `opencomposer ask`.

Copies `examples/sample_repo` (a cart whose subtotal ignores quantities, with a
failing test) into a fresh git repository, asks the agent to fix it with the model
given (default: the embedded SmolLM2-135M on vLLM), then prints the trace.

    python examples/demo.py [--model SPEC] [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUERY = "The test test_subtotal_counts_quantities fails. Fix Cart.subtotal in shop/cart.py so it counts quantities."


def prepare(dest: Path) -> Path:
    repo = dest / "shop"
    shutil.copytree(HERE / "sample_repo", repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    git = ["git", "-C", str(repo), "-c", "user.name=demo", "-c", "user.email=demo@localhost"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "sample repository"], check=True)
    return repo


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--keep", action="store_true", help="keep the temporary repository")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="opencomposer-demo-"))
    try:
        repo = prepare(tmp)
        print(f"sample repository: {repo}", flush=True)
        cli = [sys.executable, "-m", "opencomposer.server.cli"]
        rc = subprocess.run([*cli, "ask", QUERY, "--workspace", str(repo), "--model", a.model, "--approve", "all"]).returncode
        print("\n── the trace ──", flush=True)
        subprocess.run([*cli, "traces", "show", _last_session()], check=False)
        print("\n── tests after the session ──", flush=True)
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=repo, check=False)
        return 0 if rc in (0, 1) else rc
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def _last_session() -> str:
    from opencomposer.agent.traces import TraceStore

    store = TraceStore()
    try:
        return store.list_sessions(1)[0]["session_id"]
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(main())
