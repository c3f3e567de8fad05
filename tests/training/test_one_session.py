"""Training runs the agent that serves users: an RL episode and a served session on the
same workspace get the same tools, the same system prompt and the same
`codebase_search` results.

Guards the split this fixes: the environment built its `Session` without an
index, so `codebase_search` failed in every RL and bench episode while the
prompt still offered it. Both sides here are real: the episode runs through
`EnvironmentServer.run_episode` (Ray actors, bubblewrap, the per-snapshot index
cache) and the served session through `opencomposer serve` over stdio with a
scripted editor; each records its trace, and the test compares the traces.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from opencomposer.agent.traces import TraceStore
from opencomposer.training.env import EnvConfig, EnvironmentServer
from opencomposer.training.tasks import load_task, safe_extract, write_task

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))

from lsp_harness import Editor, scripted  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")

FILES = {
    "src/retry.py": (
        "import time\n\n\ndef retry_with_backoff(fn, attempts=5, base=0.1, cap=2.0):\n"
        '    """Call fn until it succeeds, sleeping longer after each failure."""\n'
        "    for attempt in range(attempts):\n        try:\n            return fn()\n"
        "        except Exception:\n            time.sleep(min(cap, base * 2**attempt))\n"
        '    raise RuntimeError("gave up")\n'
    ),
    "src/parse.py": (
        "def parse_header(line):\n"
        '    name, _, value = line.partition(":")\n'
        "    return name.strip().lower(), value.strip()\n"
    ),
    "README.md": "# demo\n\nRetry helpers and a header parser.\n",
}
SEARCH = '<codebase_search query="retry a failing call with exponential backoff" k="3"/>'


def _search_results(trace: dict) -> list[str]:
    return [c["result"] for c in trace["tool_calls"] if c["name"] == "codebase_search"]


async def test_episode_and_served_session_are_the_same_agent(
    tmp_path: Path, embedder_env: Path
) -> None:
    repo = tmp_path / "repo"
    for rel, text in FILES.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    task = load_task(write_task(tmp_path / "task", query="where do we retry?", verify="true", repo_dir=repo))  # fmt: skip
    model = scripted(tmp_path / "model.json", [SEARCH, "It is retry_with_backoff."])

    env_store = TraceStore(tmp_path / "env-traces.db")
    server = EnvironmentServer(
        EnvConfig(num_actors=1, pool_size=0, root=tmp_path / "env", index_cache=tmp_path / "cache")
    )
    try:
        episode = await server.run_episode(task, model_spec_or_factory=model, traces=env_store)
    finally:
        await server.close()
    assert episode.status == "completed", episode
    trained = env_store.export(episode.session_id)
    env_store.close()

    # the served side: a workspace unpacked from the same repo.tar, through the language server
    workspace = tmp_path / "served"
    safe_extract(task.repo_tar, workspace)
    home = tmp_path / "home"
    home.mkdir()
    editor = await Editor.spawn(workspace, model=model, home=home)
    try:
        answer = await editor.command("opencomposer.ask", {"query": task.query})
    finally:
        await editor.close()
    assert answer["status"] == "completed", answer
    served_store = TraceStore(home / "traces.db")
    served = served_store.export(answer["session_id"])
    served_store.close()

    assert trained["meta"]["tools"] == served["meta"]["tools"]
    assert "codebase_search" in trained["meta"]["tools"]
    assert trained["meta"]["prompt_style"] == served["meta"]["prompt_style"]
    system = [t["messages"][0] for t in (trained["turns"][0], served["turns"][0])]
    assert system[0]["role"] == "system" and system[0] == system[1]

    [trained_hits], [served_hits] = _search_results(trained), _search_results(served)
    assert trained_hits.startswith("src/retry.py:"), trained_hits
    assert trained_hits == served_hits
    call = next(c for c in trained["tool_calls"] if c["name"] == "codebase_search")
    assert call["status"] == "ok"
