"""The TUI demo driver: `opencomposer tui` in a real terminal, from prompt to accepted
edit, reproducibly.

Runs the TUI inside tmux (a real pseudo-terminal and terminal emulator, so Textual
draws exactly as it would for a person), on a fresh git copy of
`examples/sample_repo`, with the model of `--model` (default: the embedded
`smollm2`). It types the demo's request, waits for the session to end, focuses the
first edit (ctrl+n), accepts it (a), then checks that the edit is marked accepted on
screen and that a file on disk differs from the sample. The final screen is printed
and saved as text, and the sample's tests are run on the edited copy (reported: a
small model's accepted edit is not always a correct one).

    .venv/bin/python -m opencomposer.clients.tui.demo_driver \\
        [--model smollm2] [--prompt TEXT] [--timeout 900] [--out DIR] [--keep]

Needs `tmux` (Debian package `tmux`). Exit status 0 when an edit was accepted and a
file changed, 1 when the session ended without one (the reason is printed), 2 for a
setup problem. With the embedded model a run loads the vLLM engine (~30-60 s) and
generates on the CPU: minutes, not seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "examples" / "sample_repo"
PROMPT = (
    "The test test_subtotal_counts_quantities fails. "
    "Fix Cart.subtotal in shop/cart.py so it counts quantities."
)
SIZE = (120, 45)
# the end line, or an error note at a line start (not the mark of a failed tool card)
ENDED = re.compile(r"■ session \w+|^\s*✗ ", re.M)
PENDING = "a accept · r reject"


class Failed(Exception):
    """The run could not go on; the message is the one-line reason."""


@dataclass(kw_only=True)
class Outcome:
    accepted: bool
    changed: list[str]
    screen: str
    reason: str


class Tmux:
    """One private tmux server (its own socket) holding one window: the TUI."""

    def __init__(self, name: str) -> None:
        self.base = ["tmux", "-L", name]
        self.socket: Path | None = None

    def run(self, *args: str, tries: int = 3) -> str:
        # On a machine this busy, tmux itself can take many seconds to answer.
        for attempt in range(tries):
            try:
                done = subprocess.run(
                    [*self.base, *args], capture_output=True, text=True, timeout=60, check=False
                )
            except subprocess.TimeoutExpired:
                if attempt == tries - 1:
                    raise Failed(f"tmux {args[0]} did not answer in 60 s ({tries} tries)") from None
                continue
            if done.returncode != 0:
                raise Failed(f"tmux {args[0]}: {done.stderr.strip() or done.returncode}")
            return done.stdout
        raise AssertionError("unreachable")

    def start(self, command: list[str], env: dict[str, str], cwd: Path) -> None:
        width, height = SIZE
        exports = [f"{k}={v}" for k, v in env.items()]
        self.run(
            "new-session",
            "-d",
            "-s",
            "tui",
            "-x",
            str(width),
            "-y",
            str(height),
            "-c",
            str(cwd),
            "env",
            "-u",  # a size from the environment would beat the terminal's own
            "COLUMNS",
            "-u",
            "LINES",
            *exports,
            *command,
        )
        self.run("set-option", "-t", "tui", "remain-on-exit", "on")
        self.socket = Path(self.run("display-message", "-p", "#{socket_path}").strip())

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "tui")

    def keys(self, *keys: str, literal: bool = False) -> None:
        self.run("send-keys", "-t", "tui", *(["-l"] if literal else []), *keys)

    def dead(self) -> bool:
        return self.run("display-message", "-p", "-t", "tui", "#{pane_dead}").strip() == "1"

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=30, check=False)
        if self.socket is not None:  # tmux leaves the socket file behind
            self.socket.unlink(missing_ok=True)


def prepare(dest: Path) -> Path:
    """A git repository holding a copy of the sample (the agent's git tools want one)."""
    repo = dest / "shop"
    shutil.copytree(SAMPLE, repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    git = ["git", "-C", str(repo), "-c", "user.name=tui", "-c", "user.email=tui@localhost"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "sample repository"], check=True)
    return repo


def changed_files(repo: Path) -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line[3:] for line in out.splitlines() if line.strip()]


def run_tests(repo: Path) -> str:
    """The sample's own test suite on the edited copy: whether the edit fixed the bug
    (reported beside the result; the exit status is about the accepted edit)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    tail = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    return ("pass" if proc.returncode == 0 else "fail") + f" ({tail})"


def tui_command(workspace: Path, model: str) -> list[str]:
    script = Path(sys.executable).parent / "opencomposer"
    base = [str(script)] if script.exists() else [sys.executable, "-m", "opencomposer.server.cli"]
    return [*base, "tui", "--workspace", str(workspace), "--model", model]


def wait_for(tmux: Tmux, test, timeout: float, what: str, log) -> str:
    """Poll the screen until `test(screen)` holds; raise `Failed` on timeout or exit."""
    deadline = time.monotonic() + timeout
    last_status = ""
    while True:
        screen = tmux.screen()
        if test(screen):
            return screen
        status = _status_line(screen)
        quiet = re.sub(r" · \d+s · ", " · ", status)  # the elapsed time alone is no news
        if quiet and quiet != last_status:
            log(f"  status: {status}")
            last_status = quiet
        if tmux.dead():
            raise Failed(f"the TUI exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise Failed(f"no {what} within {timeout:.0f} s")
        time.sleep(1.0)


def _status_line(screen: str) -> str:
    lines = [line.strip() for line in screen.splitlines() if line.strip()]
    for line in reversed(lines):
        if " · turn " in line or line.endswith(("ready", "connecting")):
            return line
    return ""


def session(tmux: Tmux, repo: Path, prompt: str, timeout: float, log) -> Outcome:
    wait_for(
        tmux,
        lambda s: " · ready" in s or "restart" in s,
        300,
        "language server start",
        log,
    )
    screen = tmux.screen()
    if "ctrl+r to restart" in screen:
        raise Failed("the language server did not start: " + _banner(screen))
    log("typing the request")
    tmux.keys(prompt, literal=True)
    time.sleep(0.5)
    tmux.keys("Enter")
    t0 = time.monotonic()
    screen = wait_for(tmux, lambda s: bool(ENDED.search(s)), timeout, "end of the session", log)
    log(f"session ended after {time.monotonic() - t0:.0f} s")
    time.sleep(1.0)
    screen = tmux.screen()
    if PENDING not in screen:
        tmux.keys("C-n")  # ctrl+n scrolls to an edit waiting off screen, if any
        time.sleep(1.0)
        screen = tmux.screen()
    if PENDING not in screen:
        return Outcome(
            accepted=False,
            changed=changed_files(repo),
            screen=screen,
            reason="the session ended without an edit to accept",
        )
    log("accepting the edit (ctrl+n, a)")
    tmux.keys("C-n")
    time.sleep(0.5)
    tmux.keys("a")
    try:
        screen = wait_for(tmux, lambda s: "accepted" in s, 60, "accepted edit", log)
    except Failed as exc:
        return Outcome(
            accepted=False, changed=changed_files(repo), screen=tmux.screen(), reason=str(exc)
        )
    changed = changed_files(repo)
    reason = "" if changed else "accepted, but no file on disk differs from the sample"
    return Outcome(accepted=True, changed=changed, screen=screen, reason=reason)


def _banner(screen: str) -> str:
    for line in screen.splitlines():
        if "⚠" in line:
            return line.strip(" ⚠│")
    return "(no message on screen)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the session")
    ap.add_argument("--out", type=Path, default=None, help="folder for final_screen.txt")
    ap.add_argument("--keep", action="store_true", help="keep the workspace copy")
    args = ap.parse_args(argv)

    def log(message: str) -> None:
        print(message, flush=True)

    if shutil.which("tmux") is None:
        print("demo_driver: tmux is not installed (apt-get install tmux)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="opencomposer-tui-real-"))
    repo = prepare(tmp)
    env = {
        "OPENCOMPOSER_HOME": str(tmp / "home"),
        "TERM": "xterm-256color",
        "COLORTERM": "truecolor",
        "PATH": os.environ.get("PATH", ""),
    }
    tmux = Tmux(f"opencomposer-tui-{os.getpid()}")
    log(f"workspace {repo}, model {args.model}, terminal {SIZE[0]}x{SIZE[1]} (tmux)")
    code = 2
    try:
        tmux.start(tui_command(repo, args.model), env, repo)
        outcome = session(tmux, repo, args.prompt, args.timeout, log)
        code = 0 if outcome.accepted and outcome.changed else 1
        print("---- final screen ----")
        print(outcome.screen.rstrip())
        print("----------------------")
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "final_screen.txt").write_text(outcome.screen)
        if outcome.changed:
            diff = subprocess.run(
                ["git", "-C", str(repo), "diff"], capture_output=True, text=True, check=False
            ).stdout
            print(f"changed on disk: {', '.join(outcome.changed)}\n{diff.rstrip()}")
            print(f"sample's tests after the edit: {run_tests(repo)}")
        verdict = "accepted edit" if code == 0 else f"no accepted edit: {outcome.reason}"
        print(f"result: {verdict}")
    except Failed as exc:
        with_screen = ""
        try:
            with_screen = tmux.screen()
        except Failed:
            pass
        if with_screen:
            print("---- screen ----\n" + with_screen.rstrip())
        print(f"demo_driver: {exc}", file=sys.stderr)
        code = 2
    finally:
        try:
            tmux.keys("C-q")
            time.sleep(1.0)
        except Failed:
            pass
        tmux.close()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
