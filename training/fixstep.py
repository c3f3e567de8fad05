"""RL on the fix step: sampled edits at an engineer's states, rewarded by the tests.

A whole episode costs tens of seconds here and a 135M policy resolves almost none, so
full-episode GRPO sees a reward in few groups. The step that decides an episode is the
fix: every session that reaches it has run the test, found the function and read it.
This trains that step alone, as a bandit whose start states come from demonstrations
(the same states a session of the policy reaches when it locates the bug):

1. **States** (`fix_states`): in each recorded session (an accepted demonstration on
   a training project, or a reference session on a held-out one for measurement), the
   first turn that calls ``edit_file``, with its exact prompt (the request and the
   real tool results so far). Only turns before which no file changed: the workspace
   at that turn is the task's own, so a fresh copy of the task reproduces it.
2. **Groups** (`sample_groups`): the policy answers each state ``k`` times through the
   production model backend (vLLM), which records the token ids and their logprobs.
3. **Reward** (`FixScorer`): each reply's calls run through the production
   `Executor` and tools on a fresh sandboxed copy of the task (everything but
   ``run_terminal``, which the grading replaces), then the task's own reward decides:
   1 when its tests pass, its part credit when they fail but its checks pass (a corpus
   task's: the broken line changed, 0.2), else 0. A reply that fails the checks is not
   test-run (it left every broken line as it was). Replies that make the same edits
   share one verdict.
4. **Update** (`train_groups`): GRPO's group-relative advantages, the clipped
   policy-gradient loss of `training/loss.py` against the sampler's logprobs, on the
   reply's tokens only. The prompt is the same for a whole group, so it runs once and
   its key/value cache, graph included, serves every reply of the group: a group of 8
   replies of ~100 tokens after a prompt of ~2,500 costs about one sequence's forward
   and backward, not eight, and the gradient is exact.

    python -m opencomposer.training.fixstep train --db demos.db --model smollm2 \\
        --out runs/fixstep --states 200 --k 8
    python -m opencomposer.training.sft_offline merge runs/fixstep --model smollm2
    python benchmarks/fix_step.py --model rl=vllm:runs/fixstep/checkpoints/step_N

With ``--objective best`` the update learns one reply per state instead of the
group's advantages (best-of-k distillation, `pick_best`): a reply the tests pass when
the group has one, else the reply the policy itself ranks first as code (the session's
own sample-and-rank, `agent/alternatives.py`, with the policy as a `transformers`
scorer), when it finds the code after that change likelier than before. A 135M policy
tells a fix from a bug far more often than it writes one, and this turns that
judgment into a target on every state, not only the few where a reply passes.

Sampled groups are appended to ``OUT/groups.jsonl`` as they are scored, so a stopped
run resumes where it was; training reads them back (and ``OUT/picks.jsonl``, the best
replies chosen so far).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import random
import statistics
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opencomposer.tools.specs import DELETE_FILE, EDIT_FILE, RUN_TERMINAL, WRITE_FILE
from opencomposer.training.nextstep import Step

CHANGES = frozenset({EDIT_FILE, WRITE_FILE, DELETE_FILE})


class FixStepError(ValueError):
    """A run that cannot go on (no states, no scored group): one line for the user."""


def state_key(step: Step) -> str:
    """A state's name in ``groups.jsonl``: its session and turn."""
    return f"{step.session_id}:{step.turn}"


def fix_states(traces: Sequence[dict[str, Any]]) -> list[Step]:
    """The fix state of each `TraceStore.export` dict that has one (see the module doc)."""
    out = []
    for tr in traces:
        calls = tr.get("tool_calls") or ()
        edits = sorted(int(c.get("turn", 0)) for c in calls if c.get("name") == EDIT_FILE)
        if not edits:
            continue
        first = edits[0]
        if any(c.get("name") in CHANGES and int(c.get("turn", 0)) < first for c in calls):
            continue
        turn = next((t for t in tr.get("turns") or () if int(t.get("turn", -1)) == first), None)
        task_id = str((tr.get("meta") or {}).get("task_id") or "")
        if turn is None or not turn.get("messages") or not task_id:
            continue
        out.append(
            Step(
                session_id=str(tr.get("session_id", "")),
                task_id=task_id,
                turn=first,
                messages=list(turn["messages"]),
                text=str(turn.get("text") or ""),
            )
        )
    return out


def load_traces(dbs: Sequence[Path], *, source: str) -> list[dict[str, Any]]:
    """Sessions of the trace stores ``dbs``: ``accepted`` demonstrations (training) or
    ``reference`` sessions that resolved their task (held-out measurement)."""
    from opencomposer.training.nextstep import load_references
    from opencomposer.training.sft import load_accepted_traces

    traces: list[dict[str, Any]] = []
    for db in dbs:
        if not Path(db).is_file():
            raise FixStepError(f"{db}: no such trace store")
        if source == "reference":
            traces += [
                t for t in load_references(Path(db)) if (t.get("meta") or {}).get("resolved")
            ]
        else:
            traces += load_accepted_traces(100_000, db=db)
    return traces


# -- sampling ----------------------------------------------------------------------------


@dataclass
class Reply:
    """One sampled answer at a state, and what the tests said of it."""

    text: str
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    finish: str = "stop"
    reward: float = 0.0
    why: str = ""


async def sample_groups(
    model: Any,
    states: Sequence[Step],
    *,
    k: int,
    temperature: float,
    max_tokens: int = 320,
    concurrency: int = 16,
    on_group: Callable[[Step, list[Reply]], Any] | None = None,
) -> list[list[Reply]]:
    """``k`` replies of ``model`` at each state (the backend batches concurrent ones;
    its prefix cache serves a state's prompt to all ``k``). A state whose prompt the
    model cannot take (over its context window) gets an empty group. ``on_group`` is
    awaited with each finished group, in no particular order."""
    from opencomposer.agent.protocols import ModelError, PromptTooLong, Sampling
    from opencomposer.training.nextstep import answer

    gate = asyncio.Semaphore(max(1, concurrency))
    errors: list[str] = []
    # no per-request seed: vLLM on CPU cannot seed one request's generator
    sampling = Sampling(temperature=temperature, top_p=1.0, max_tokens=max_tokens)

    async def one(state: Step) -> Reply | None:
        async with gate:
            out = await answer(model, state, sampling)
        if isinstance(out, PromptTooLong):  # this state only: its group stays empty
            return None
        if isinstance(out, ModelError):
            errors.append(str(out))
            return None
        if not out.completion_token_ids or out.prompt_token_ids is None:
            return None
        return Reply(
            text=out.text,
            prompt_ids=list(out.prompt_token_ids),
            ids=list(out.completion_token_ids),
            logprobs=list(out.completion_logprobs or [0.0] * len(out.completion_token_ids)),
            finish=out.finish_reason,
        )

    async def group(state: Step) -> list[Reply]:
        got = await asyncio.gather(*(one(state) for _ in range(k)))
        replies = [r for r in got if r is not None]
        if on_group is not None and replies:
            await on_group(state, replies)
        return replies

    groups = list(await asyncio.gather(*(group(s) for s in states)))
    if errors and not any(groups):
        raise FixStepError(f"the model answered no state: {errors[0]}")
    return groups


# -- reward ------------------------------------------------------------------------------


def edit_signature(text: str) -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    """The file-changing calls of a reply, as the parser reads them: replies with the
    same signature change the workspace alike."""
    from opencomposer.agent.xmlcalls import parse_all
    from opencomposer.tools.specs import parser_rules

    return tuple(
        (c.name, tuple(sorted(c.raw.items())))
        for c in parse_all(text, *parser_rules())
        if not c.error and c.name in CHANGES
    )


class FixScorer:
    """Grades replies on fresh copies of their tasks (see the module doc)."""

    def __init__(self, env: Any, tasks: dict[str, Any]):
        self.env = env
        self.tasks = tasks
        self._seen: dict[tuple[str, Any], asyncio.Future[tuple[float, str]]] = {}

    async def score(self, task_id: str, text: str) -> tuple[float, str]:
        """``(reward, why)`` of one reply at a state of task ``task_id``."""
        sig = edit_signature(text)
        if not sig:
            return 0.0, "no edit"
        key = (task_id, sig)
        if key not in self._seen:
            self._seen[key] = asyncio.ensure_future(self._grade(task_id, text))
        return await self._seen[key]

    async def _grade(self, task_id: str, text: str) -> tuple[float, str]:
        from opencomposer.agent.executor import Executor
        from opencomposer.agent.xmlcalls import parse_all
        from opencomposer.tools.protocols import ToolContext
        from opencomposer.tools.specs import parser_rules

        task = self.tasks.get(task_id)
        if task is None:
            return 0.0, f"unknown task {task_id}"

        async def gate(spec: Any, args: Any) -> str | None:
            if spec.name == RUN_TERMINAL:
                return "not run while grading a fix: the task's verify runs the tests"
            return None

        async with self.env.lease(task) as lease:
            ex = Executor(ToolContext(workspace=lease.workspace), turn=1, gate=gate)
            for call in parse_all(text, *parser_rules()):
                ex.submit(call)
            records = await ex.wait()
            applied = [
                r
                for r in records
                if r.name in CHANGES and r.result is not None and r.result.status == "ok"
            ]
            if not applied:
                return 0.0, "no edit applied"
            # the task's part-credit checks (the corpus's: every broken line changed, the
            # file still parses) run first; a reply that fails them cannot have fixed the
            # bug where it was made, and skipping its test run halves the grading time
            for check in task.reward.get("checks", []):
                if not (await lease.exec(check["command"])).ok:
                    return 0.0, "broken line kept"
            verdict = await lease.verify(answer=text, tool_ok=True)
        return verdict.reward, "resolved" if verdict.resolved else "tests fail"


def advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """GRPO's group-relative advantages, ``(r - mean) / std``; all zero when every
    reply of the group scored alike (it teaches nothing)."""
    if len(rewards) < 2:
        return [0.0] * len(rewards)
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    if std < eps:
        return [0.0] * len(rewards)
    return [(r - mean) / std for r in rewards]


# -- groups on disk ----------------------------------------------------------------------


def append_group(path: Path, state: Step, replies: Sequence[Reply]) -> None:
    row = {
        "state": state_key(state),
        "task_id": state.task_id,
        "replies": [vars(r) for r in replies],
    }
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def read_groups(path: Path) -> list[dict[str, Any]]:
    """The groups of ``path``; a torn last line (a run stopped mid-write) is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        row["replies"] = [Reply(**r) for r in row.get("replies", [])]
        out.append(row)
    return out


# -- the update ----------------------------------------------------------------------------


def train_groups(
    trainer: Any,
    groups: Sequence[dict[str, Any]],
    *,
    epochs: int = 1,
    groups_per_step: int = 4,
    seed: int = 0,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> int:
    """Policy-gradient steps over the groups with a mixed reward (the others have no
    advantage), or, for a group with a ``pick`` (`pick_best`), on that reply alone with
    an advantage of 1; returns the number of optimizer steps taken."""
    import torch

    useful = []
    for g in groups:
        if "pick" in g:  # best-of-k: the picked reply alone, as its own target
            adv = [float(i == g["pick"]) for i in range(len(g["replies"]))]
        else:
            adv = advantages([r.reward for r in g["replies"]])
        if any(adv):
            useful.append((g["replies"], adv))
    if not useful:
        return 0
    model, config = trainer.model, trainer.config
    rng = random.Random(seed)
    n_steps = 0
    for _ in range(epochs):
        order = list(range(len(useful)))
        rng.shuffle(order)
        for start in range(0, len(order), groups_per_step):
            chunk = [useful[i] for i in order[start : start + groups_per_step]]
            t0 = time.perf_counter()
            tokens = float(sum(len(r.ids) for replies, _ in chunk for r in replies))
            trainer.optimizer.zero_grad(set_to_none=True)
            total, clipped = 0.0, 0.0
            for replies, adv in chunk:
                stats = _group_backward(trainer, replies, adv, tokens)
                total += stats["loss"]
                clipped += stats["clip_frac"] * stats["tokens"]
            grad_norm = float(
                torch.nn.utils.clip_grad_norm_(
                    [p for p in model.parameters() if p.requires_grad], config.grad_clip
                )
            )
            if math.isfinite(grad_norm):
                trainer.optimizer.step()
                trainer.version += 1
            trainer.optimizer.zero_grad(set_to_none=True)
            trainer.step_count += 1
            n_steps += 1
            if on_step is not None:
                on_step(
                    n_steps,
                    {
                        "loss": total,
                        "grad_norm": grad_norm,
                        "groups": float(len(chunk)),
                        "train_tokens": tokens,
                        "clip_frac": clipped / max(tokens, 1.0),
                        "train_s": time.perf_counter() - t0,
                    },
                )
    return n_steps


def _group_backward(
    trainer: Any, replies: Sequence[Reply], adv: Sequence[float], tokens: float
) -> dict[str, float]:
    """Backward of one group's share of the step's loss: the prompt runs once, and its
    key/value cache (with its graph) serves every reply of the group, so the gradient is
    the whole sequences' while the prompt's forward and backward are paid once."""
    import torch
    from opencomposer.training.loss import policy_loss, token_logprobs_and_entropy
    from transformers import DynamicCache

    model = trainer.model
    prompt = replies[0].prompt_ids
    todo = [(r, a) for r, a in zip(replies, adv, strict=True) if a and r.prompt_ids == prompt]
    if not todo:
        return {"loss": 0.0, "clip_frac": 0.0, "tokens": 0.0}
    with trainer._autocast():
        cache = model(
            input_ids=torch.tensor([prompt[:-1]], device=trainer.device), use_cache=True
        ).past_key_values
    # each reply gets a cache of its own over the same prompt tensors (a forward appends
    # to the cache it is given)
    prefix = [(layer.keys, layer.values) for layer in cache.layers]
    total: Any = 0.0
    clip, n = 0.0, 0.0
    for reply, a in todo:
        ids = torch.tensor([[prompt[-1], *reply.ids[:-1]]], device=trainer.device)
        target = torch.tensor([reply.ids], device=trainer.device)
        with trainer._autocast():
            logits = model(
                input_ids=ids, past_key_values=DynamicCache(ddp_cache_data=prefix), use_cache=True
            ).logits
        logp, _ = token_logprobs_and_entropy(logits, target)
        old = torch.tensor([reply.logprobs], device=trainer.device, dtype=logp.dtype)
        loss, st = policy_loss(
            logp,
            old,
            torch.tensor([a], device=trainer.device),
            torch.ones_like(logp),
            config=trainer.config.loss,
            num_tokens=max(tokens, 1.0),
        )
        total = total + loss
        clip += st["clip_frac"] * st["tokens"]
        n += st["tokens"]
    total.backward()
    return {"loss": float(total.detach()), "clip_frac": clip / max(n, 1.0), "tokens": n}


# -- best-of-k: the policy's own judgment picks the target ---------------------------------


def lm_scorer(folder: Path) -> Callable[[str, str], Any]:
    """`alternatives.Score` over a local model folder as a `transformers` forward pass
    (fp32, the CPU's threads): log P(text | the last `CONTEXT_TOKENS` of context), on the
    token ids the backends' `logprob` scores (`ChatTokenizer.scored_ids`)."""
    import torch
    from opencomposer.agent import alternatives
    from opencomposer.agent.backends._local import ChatTokenizer
    from transformers import AutoModelForCausalLM

    tok = ChatTokenizer(folder)
    lm = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    async def score(context: str, text: str) -> float:
        ids, first = tok.scored_ids(context, text, alternatives.CONTEXT_TOKENS)
        with torch.inference_mode():
            logits = lm(torch.tensor([ids])).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        pos = torch.arange(first - 1, len(ids) - 1)
        return float(logp[pos, torch.tensor(ids[first:])].sum())

    return score


async def pick_best(task: Any, replies: Sequence[Reply], score: Any) -> tuple[int, str] | None:
    """``(index, why)`` of the reply to learn at a state, or None: among replies the
    tests pass (``why`` "resolved"), the one the ranking prefers; else the ranking's
    choice (`alternatives.rank`: the candidate whose changed code ``score`` finds
    likeliest against the code as it stands, in the task's files) when that gain is
    positive ("ranked")."""
    from opencomposer.agent import alternatives
    from opencomposer.agent.xmlcalls import parse_all
    from opencomposer.tools.specs import parser_rules

    cands = [parse_all(r.text, *parser_rules()) for r in replies]
    with task_files(task, named_paths(cands)) as ws:
        ranked = await alternatives.rank(ws, cands, score)
    gains = ranked.gains
    passed = [i for i, r in enumerate(replies) if r.why == "resolved"]
    if passed:
        return max(passed, key=lambda i: (gains[i], -i)), "resolved"
    if math.isfinite(gains[ranked.index]) and gains[ranked.index] > 0:
        return ranked.index, "ranked"
    return None


def named_paths(candidates: Sequence[Sequence[Any]]) -> list[str]:
    """The paths the candidates' calls name, each once."""
    return sorted({str(c.raw["path"]) for calls in candidates for c in calls if c.raw.get("path")})


@contextlib.contextmanager
def task_files(task: Any, paths: Sequence[str]) -> Any:
    """A `LocalWorkspace` over a temporary folder holding ``paths`` as the task's
    (broken) workspace has them; paths it lacks, or that leave the folder, stay absent."""
    import tempfile

    from opencomposer.tools.workspace import LocalWorkspace

    with tempfile.TemporaryDirectory(prefix="fixstep-") as tmp, tarfile.open(task.repo_tar) as tar:
        root = Path(tmp).resolve()
        names = {m.name.removeprefix("./"): m for m in tar.getmembers() if m.isfile()}
        for path in paths:
            member = names.get(path.removeprefix("./"))
            dest = (root / path).resolve()
            if member is None or not dest.is_relative_to(root):
                continue
            data = tar.extractfile(member)
            if data is not None:
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data.read())
        yield LocalWorkspace(root)


def pick_groups(
    groups: Sequence[dict[str, Any]],
    tasks: dict[str, Any],
    score: Any,
    out: Path,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """The groups with a best reply (`pick_best`), each with its ``pick`` and ``why``;
    the picks are appended to ``out`` as they are made and read back on a rerun."""
    done: dict[str, dict[str, Any]] = {}
    if out.is_file():
        for line in out.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[row["state"]] = row
    t0 = time.perf_counter()
    for n, g in enumerate(groups, 1):
        if g["state"] in done or g["task_id"] not in tasks or not g["replies"]:
            continue
        got = asyncio.run(pick_best(tasks[g["task_id"]], g["replies"], score))
        row = {"state": g["state"], "pick": got[0] if got else None, "why": got[1] if got else ""}
        done[g["state"]] = row
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        if n % 10 == 0:
            log(f"{n}/{len(groups)} groups ranked ({time.perf_counter() - t0:.0f} s)")
    picked = []
    for g in groups:
        row = done.get(g["state"])
        if row and row["pick"] is not None:
            picked.append({**g, "pick": int(row["pick"]), "why": row["why"]})
    return picked


# -- the run -------------------------------------------------------------------------------


def pick_states(states: Sequence[Step], n: int, seed: int) -> list[Step]:
    """Up to ``n`` states, one per task first (spread over tasks), in a seeded order."""
    rng = random.Random(seed)
    by_task: dict[str, list[Step]] = {}
    for s in states:
        by_task.setdefault(s.task_id, []).append(s)
    rounds: list[list[Step]] = []
    for group in by_task.values():
        rng.shuffle(group)
        for i, s in enumerate(group):
            while len(rounds) <= i:
                rounds.append([])
            rounds[i].append(s)
    out: list[Step] = []
    for r in rounds:
        rng.shuffle(r)
        out += r
    return out[:n]


def task_map(suite: str) -> dict[str, Any]:
    from opencomposer.training.catalog import load_suite

    return {t.id: t for t in load_suite(suite)}


async def collect(
    states: Sequence[Step],
    *,
    model_spec: str,
    tasks: dict[str, Any],
    out: Path,
    k: int,
    temperature: float,
    max_tokens: int,
    env_config: Any = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Sample and grade a group at each state not yet in ``out`` (see the module doc);
    returns every group ``out`` holds."""
    from opencomposer.agent.backends import make_model
    from opencomposer.training.env import EnvConfig, EnvironmentServer

    out.parent.mkdir(parents=True, exist_ok=True)
    done = {g["state"] for g in read_groups(out)}
    todo = [s for s in states if state_key(s) not in done and s.task_id in tasks]
    if todo:
        env = EnvironmentServer(env_config or EnvConfig(num_actors=2))
        model = make_model(model_spec)
        scorer = FixScorer(env, tasks)
        t0, n_done, resolved = time.perf_counter(), 0, 0

        async def graded(state: Step, replies: list[Reply]) -> None:
            nonlocal n_done, resolved
            verdicts = await asyncio.gather(*(scorer.score(state.task_id, r.text) for r in replies))
            for r, (reward, why) in zip(replies, verdicts, strict=True):
                r.reward, r.why = reward, why
            append_group(out, state, replies)
            n_done += 1
            resolved += sum(r.why == "resolved" for r in replies)
            if n_done % 10 == 0 or n_done == len(todo):
                log(
                    f"{n_done}/{len(todo)} states sampled and graded, {resolved} replies "
                    f"resolved ({time.perf_counter() - t0:.0f} s)"
                )

        try:
            await env.start()
            await sample_groups(
                model,
                todo,
                k=k,
                temperature=temperature,
                max_tokens=max_tokens,
                on_group=graded,
            )
        finally:
            await model.close()
            await env.close()
    return read_groups(out)


def summary(groups: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The share of replies that resolve their task (the mean over states of each
    state's share) with its standard error over states; the share of states with a
    resolving reply, and with a mixed group (some reward, not all the same)."""
    shares, mixed = [], []
    for g in groups:
        if g["replies"]:
            shares.append(statistics.fmean(r.why == "resolved" for r in g["replies"]))
            mixed.append(any(advantages([r.reward for r in g["replies"]])))
    if not shares:
        return {"states": 0.0, "pass": 0.0, "se": 0.0, "mixed": 0.0, "any": 0.0}
    se = statistics.stdev(shares) / math.sqrt(len(shares)) if len(shares) > 1 else 0.0
    return {
        "states": float(len(shares)),
        "pass": statistics.fmean(shares),
        "se": se,
        "any": statistics.fmean(r > 0 for r in shares),
        "mixed": statistics.fmean(mixed),
    }


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from opencomposer.training.sft_offline import OfflineError

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="sample, grade and train (resumes from OUT/groups.jsonl)")
    tr.add_argument("--db", type=Path, action="append", required=True, help="demonstrations")
    tr.add_argument("--model", default="smollm2", help="the policy (a local model name)")
    tr.add_argument("--suite", default="corpus:train", help="where the states' tasks come from")
    tr.add_argument("--out", type=Path, required=True)
    tr.add_argument("--states", type=int, default=200)
    tr.add_argument("--k", type=int, default=8, help="replies per state")
    tr.add_argument("--temperature", type=float, default=0.8)
    tr.add_argument("--max-tokens", type=int, default=320)
    tr.add_argument("--epochs", type=int, default=2)
    tr.add_argument("--groups-per-step", type=int, default=4)
    tr.add_argument("--lr", type=float, default=1e-4)
    tr.add_argument("--lora-rank", type=int, default=16)
    tr.add_argument("--lora-alpha", type=float, default=32.0)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument(
        "--objective",
        choices=["grpo", "best"],
        default="grpo",
        help="grpo: the group's advantages; best: the best reply of each group (pick_best)",
    )
    tr.add_argument("--sample-only", action="store_true", help="stop once the groups are graded")
    a = ap.parse_args(argv)

    try:
        states = fix_states(load_traces(a.db, source="accepted"))
        if not states:
            raise FixStepError("no fix state in " + ", ".join(map(str, a.db)))
        picked = pick_states(states, a.states, a.seed)
        a.out.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        groups = asyncio.run(
            collect(
                picked,
                model_spec=f"vllm:{a.model}",
                tasks=task_map(a.suite),
                out=a.out / "groups.jsonl",
                k=a.k,
                temperature=a.temperature,
                max_tokens=a.max_tokens,
            )
        )
        s = summary(groups)
        print(
            f"{int(s['states'])} states: replies pass {s['pass']:.1%} ± {s['se']:.1%}, "
            f"{s['any']:.0%} of states have a passing reply, {s['mixed']:.0%} a mixed group "
            f"({time.time() - t0:.0f} s)",
            flush=True,
        )
        if a.sample_only:
            return 0
        if a.objective == "best":
            from opencomposer.training.sft_offline import model_dir

            groups = pick_groups(
                groups, task_map(a.suite), lm_scorer(model_dir(a.model)), a.out / "picks.jsonl"
            )
            whys = collections.Counter(g["why"] for g in groups)
            print(
                f"best replies: {len(groups)} states ({whys['resolved']} passing, "
                f"{whys['ranked']} ranked) ({time.time() - t0:.0f} s)",
                flush=True,
            )
        return _train(a, groups, t0)
    except (FixStepError, OfflineError) as e:
        print(f"error: {e}")
        return 2


def _train(a: Any, groups: list[dict[str, Any]], t0: float) -> int:
    import torch
    from opencomposer.agent.backends._local import read_model_settings
    from opencomposer.training.sft_offline import model_dir, save_adapter_checkpoint
    from opencomposer.training.trainer import Trainer, TrainerConfig

    torch.manual_seed(a.seed)
    config = TrainerConfig(lr=a.lr, lora_rank=a.lora_rank, lora_alpha=a.lora_alpha)
    trainer = Trainer.from_pretrained(model_dir(a.model), config)
    settings = read_model_settings(model_dir(a.model))
    trainer.prompt_style = settings.get("prompt_style")
    trainer.max_turns = settings.get("max_turns")
    metrics = a.out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)

    def on_step(n: int, st: dict[str, float]) -> None:
        with open(metrics, "a") as f:
            f.write(json.dumps({"step": n, "phase": "fixstep", "time": time.time(), **st}) + "\n")
        print(
            f"step {n}: loss {st['loss']:+.4f} grad {st['grad_norm']:.3f} "
            f"clip {st['clip_frac']:.3f} ({st['train_s']:.1f} s)",
            flush=True,
        )

    steps = train_groups(
        trainer,
        groups,
        epochs=a.epochs,
        groups_per_step=a.groups_per_step,
        seed=a.seed,
        on_step=on_step,
    )
    if not steps:
        raise FixStepError(
            "no group has a best reply: nothing to learn from"
            if a.objective == "best"
            else "no group has a mixed reward: nothing to learn from"
        )
    (a.out / "config.json").write_text(
        json.dumps({"fixstep": vars(a) | {"steps": steps}}, default=str, indent=1) + "\n"
    )
    folder = save_adapter_checkpoint(trainer, a.out / "checkpoints" / f"step_{steps}")
    print(f"saved {folder} ({steps} steps, {time.time() - t0:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
