"""The `opencomposer` command: the process front door.

Every subcommand imports what it needs when it runs, so `opencomposer --help`
stays fast. A user mistake ends in one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL = "smollm2"


class UsageError(Exception):
    """A mistake in what the user asked for: printed as one line, exit 2."""


def _ask(a: argparse.Namespace) -> int:
    from opencomposer.server.ask import ask

    return ask(
        a.query,
        workspace=a.workspace,
        model=a.model,
        as_json=a.json,
        approve=a.approve,
        max_turns=a.max_turns,
        sandbox=a.sandbox,
        use_server=not a.no_server,
    )


def _serve(a: argparse.Namespace) -> int:
    from opencomposer.server.lsp import serve

    tcp = None
    if a.tcp:
        host, _, port = a.tcp.rpartition(":")
        if not host or not port.isdigit():
            raise UsageError(f"--tcp wants HOST:PORT, got {a.tcp!r}")
        tcp = (host, int(port))
    elif a.allow_remote:
        raise UsageError("--allow-remote goes with --tcp")
    return serve(tcp=tcp, model=a.model, allow_remote=a.allow_remote)


def _index(a: argparse.Namespace) -> int:
    from opencomposer.index.cli import cmd_index

    return cmd_index(_workspace(a.dir), quiet=a.quiet)


def _search(a: argparse.Namespace) -> int:
    from opencomposer.index.cli import cmd_search

    if a.query is None and a.queries is None:
        raise UsageError("give a QUERY or --queries FILE")
    return cmd_search(
        a.query, _workspace(a.workspace), k=a.k, as_json=a.json, queries_file=a.queries
    )


def _tui(a: argparse.Namespace) -> int:
    from opencomposer.clients.tui.app import run

    return run(workspace=_workspace(a.workspace), model=a.model, tcp=a.tcp)


def _traces(a: argparse.Namespace) -> int:
    from opencomposer.server import traces_cli

    return traces_cli.main(a)


def _tasks_mine(a: argparse.Namespace) -> int:
    import json

    from opencomposer.training.corpus import mine_repo

    paths = mine_repo(_workspace(a.repo), out=a.out, limit=a.limit)
    print(json.dumps({"tasks": [str(p) for p in paths]}))
    return 0 if paths else 1


def _tasks_build_corpus(a: argparse.Namespace) -> int:
    from opencomposer.training.corpus import build_corpus, load_manifest

    only = [p.strip() for p in (a.projects or "").split(",") if p.strip()]
    report = build_corpus(
        load_manifest(a.manifest),
        a.out,
        jobs=a.jobs,
        only=only,
        force=a.force,
        limit=a.limit,
        earlier=a.earlier,
    )
    return 0 if report["totals"]["tasks"] else 1


def _tasks_export(a: argparse.Namespace) -> int:
    from opencomposer.training.corpus import export

    only = [p.strip() for p in (a.projects or "").split(",") if p.strip()]
    made = export(a.corpus, a.out, split=a.split, query=a.query, projects=only, limit=a.limit)
    print(f"{len(made)} task folders in {a.out}")
    return 0 if made else 1


def _bench(a: argparse.Namespace) -> int:
    import json

    from opencomposer.training.bench import run_bench

    report = run_bench(
        a.tasks,
        model=a.model,
        concurrency=a.concurrency,
        out=a.out,
        max_turns=a.max_turns,
        cluster=a.cluster,
    )
    summary = {k: v for k, v in report.items() if k != "tasks"}
    print(json.dumps(summary, indent=2))
    return 0


def _train(a: argparse.Namespace) -> int:
    # torch's OpenMP threads spin at their barriers by default; beside any other busy
    # process (a corpus build, the sandboxed tests of episodes) a step then stalls: a
    # 1,000-token LoRA forward and backward measured 3.7 s alone, 4.8-43.6 s next to a
    # corpus build, 5.8-6.9 s there with passive waits. Read when libgomp loads (torch's
    # first import, below); set it to override.
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    from opencomposer.training.rl import train

    out = train(a.config, max_steps=a.max_steps, out=a.out, sft=a.sft)
    print(f"metrics: {out / 'metrics.jsonl'}")
    return 0


def _workspace(path: str | Path | None) -> Path:
    root = Path(path or ".").expanduser()
    if not root.is_dir():
        raise UsageError(f"workspace {str(root)!r} is not a directory")
    return root.resolve()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="opencomposer",
        description="An open coding agent: ask it to change your code, from the terminal or your editor.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def cmd(
        name: str, fn: Callable[[argparse.Namespace], int], help_: str
    ) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(fn=fn)
        return sp

    sp = cmd("ask", _ask, "run one agent session on a request")
    sp.add_argument("query", help="what you want done")
    sp.add_argument("--workspace", "-w", default=".", help="repository to work in (default: .)")
    sp.add_argument("--model", "-m", default=DEFAULT_MODEL, help="model spec (default: smollm2)")
    sp.add_argument("--json", action="store_true", help="print the event stream as JSON lines")
    sp.add_argument(
        "--approve",
        choices=("none", "safe", "all"),
        default="safe",
        help="calls that run without asking: none, safe (read-only tools and allowlisted commands), all",
    )
    sp.add_argument(
        "--max-turns",
        type=int,
        default=None,
        help="turn budget (default: the model's own, a trained policy's; else 25)",
    )
    sp.add_argument(
        "--sandbox", choices=("read-only", "workspace-write", "off"), default="workspace-write"
    )
    sp.add_argument(
        "--no-server",
        action="store_true",
        help="run here even when `opencomposer serve --tcp` runs this model (default: use it)",
    )

    sp = cmd("serve", _serve, "run the language server")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--stdio", action="store_true", help="speak LSP over stdin/stdout (default)")
    g.add_argument(
        "--tcp",
        metavar="HOST:PORT",
        help="listen on a TCP port; clients must send the token it prints (docs/lsp.md)",
    )
    sp.add_argument("--model", "-m", default=DEFAULT_MODEL)
    sp.add_argument(
        "--allow-remote",
        action="store_true",
        help="with --tcp: listen on an address other machines can reach (unencrypted)",
    )

    sp = cmd("index", _index, "build or refresh the codebase index")
    sp.add_argument("dir", nargs="?", default=".")
    sp.add_argument("--quiet", "-q", action="store_true")

    sp = cmd("search", _search, "search the codebase index")
    sp.add_argument("query", nargs="?")
    sp.add_argument("--workspace", "-w", default=".")
    sp.add_argument("-k", type=int, default=10)
    sp.add_argument("--json", action="store_true")
    sp.add_argument(
        "--queries", type=Path, help="file of queries, one a line; prints one JSON line each"
    )

    sp = cmd("tui", _tui, "the terminal UI")
    sp.add_argument("--workspace", "-w", default=".")
    sp.add_argument("--model", "-m", default=DEFAULT_MODEL)
    sp.add_argument(
        "--tcp", metavar="HOST:PORT", help="connect to a running server instead of starting one"
    )

    sp = cmd("traces", _traces, "list, show, export or submit logged sessions")
    tsub = sp.add_subparsers(dest="traces_command", metavar="ACTION", required=True)
    t = tsub.add_parser("list", help="recent sessions")
    t.add_argument("--limit", type=int, default=20)
    t.add_argument("--json", action="store_true")
    t = tsub.add_parser("show", help="one session, turn by turn")
    t.add_argument("session")
    t = tsub.add_parser("export", help="one session as JSON (token ids included)")
    t.add_argument("session")
    t.add_argument("--out", type=Path)
    t = tsub.add_parser("submit", help="turn sessions into training tasks")
    t.add_argument("sessions", nargs="+")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--verify", help="command whose exit status 0 means the task is solved")

    sp = cmd("tasks", _tasks_mine, "mine training tasks from a repository by bug injection")
    tsub = sp.add_subparsers(dest="tasks_command", metavar="ACTION", required=True)
    t = tsub.add_parser("mine", help="inject bugs that tests catch, write one task per bug")
    t.add_argument("repo")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--limit", type=int, default=20)
    t = tsub.add_parser(
        "build-corpus", help="mine every project of a corpus manifest (resumes a stopped build)"
    )
    t.set_defaults(fn=_tasks_build_corpus)
    t.add_argument("--manifest", type=Path, default=Path("configs/corpus.toml"))
    t.add_argument("--out", type=Path, required=True, help="the corpus folder")
    t.add_argument("--jobs", type=int, default=1, help="projects built at once")
    t.add_argument("--projects", help="only these projects (comma-separated names)")
    t.add_argument("--force", action="store_true", help="rebuild projects already built")
    t.add_argument("--limit", type=int, help="single-site tasks per project (default: manifest)")
    t.add_argument(
        "--earlier",
        type=Path,
        help="an earlier build's report.json (docs/corpus/report.json): the report keeps "
        "its rows for projects this folder lacks, where the manifest entry is unchanged",
    )
    t = tsub.add_parser("export", help="write a built corpus's tasks as plain task folders")
    t.set_defaults(fn=_tasks_export)
    t.add_argument("corpus", type=Path)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--split", choices=("train", "heldout"), default="")
    t.add_argument("--query", choices=("mixed", "test", "issue", "oneline"), default="mixed")
    t.add_argument("--projects", help="only these projects (comma-separated names)")
    t.add_argument("--limit", type=int)

    sp = cmd("bench", _bench, "run a task suite through the environment server")
    sp.add_argument(
        "--tasks", required=True, help="a folder of tasks, or a built-in suite: own, starter"
    )
    sp.add_argument("--model", "-m", default=DEFAULT_MODEL)
    sp.add_argument("--concurrency", type=int, default=4)
    sp.add_argument(
        "--max-turns", type=int, help="turn budget of each episode (default: the session's)"
    )
    sp.add_argument("--out", type=Path, default=Path("bench-out"))
    sp.add_argument(
        "--cluster",
        metavar="ADDRESS",
        help="join this Ray cluster and spread the environment workers over its nodes",
    )

    sp = cmd("train", _train, "reinforcement learning (or --sft) on a task suite")
    sp.add_argument("--config", type=Path, required=True)
    sp.add_argument("--max-steps", type=int)
    sp.add_argument("--out", type=Path)
    sp.add_argument("--sft", action="store_true", help="supervised fine-tuning on accepted traces")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if os.environ.get("OPENCOMPOSER_DEBUG"):
        import logging

        logging.basicConfig(level=logging.DEBUG)
    try:
        return args.fn(args)
    except UsageError as e:
        print(f"opencomposer: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("opencomposer: interrupted", file=sys.stderr)
        return 130
    except (FileNotFoundError, NotADirectoryError, PermissionError, KeyError, ValueError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"opencomposer: {msg}", file=sys.stderr)
        return 1
    except ImportError as e:
        print(f"opencomposer: {args.command} is not available: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
