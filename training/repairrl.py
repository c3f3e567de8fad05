"""RL on the repair's ranking: the policy learns, from trial runs, which of the edits it
proposes pass the failing tests.

The shipped session's repair (`agent/repair.py`, `SessionConfig.repair`) turns the
policy's own next-token odds into candidate edits of the functions a failing test ran
and tries them, best first by first-order gain (log P(the token an edit puts) - log
P(the token there), `repair.first_order_gain`), until one passes or the turn's trial
time runs out. A fix the policy proposes at rank 60 is never tried. How the policy
ranks its candidates is therefore a policy in its own right, and this trains it with
rewards from the environment:

1. **States** (`collect`): a training-project task (single-site bugs), its broken file,
   and the code in focus: the function around the broken line, where the failing
   run's traceback puts a session's repair, and the `--others` functions of the file
   nearest it, which a session's reads put there too and whose edits compete for the
   same ranks. Held-out projects are refused.
2. **Actions**: `repair.propose` with the policy on llama.cpp, as a session runs it;
   the candidates are its actions. The first `--graded` of them are graded, and so is
   the one that makes the reference fix wherever it ranks (found by comparing texts;
   it is graded by its trial run like the others), so a state whose fix ranks low
   still tells the policy where it is. A fix the proposer misses (its first token is
   not among the model's top tokens where it begins) is graded too, as the edit it
   begins with (`repair.first_edit`): raising that token's odds is what brings it
   among the candidates. A state whose fix is neither is not graded (`--all-states`
   grades it too): another edit that passes is rare there, and grading is most of a
   state's time.
3. **Reward**: each graded candidate is tried against the task's failing tests in a
   forked trial run in the task's sandboxed workspace (`agent/trials.forked`, the
   session's own trial runs): 1 when the tests pass, 0 when they fail; a candidate
   whose files no child imported is left out. Groups are appended to
   `OUT/groups.jsonl` as they are graded, so a stopped run resumes.
4. **Update** (`train`): the ranking as a stochastic policy, π(i) = softmax(g_i / τ)
   over a state's graded candidates, where g_i is candidate i's first-order gain
   recomputed in `transformers` from the LoRA-adapted policy (differentiable). The
   objective is log J, J = Σ π(i) r_i, the chance that the first candidate tried
   passes; its gradient is the policy gradient with advantage π(i)(r_i / J - 1) per
   candidate, exact over the graded set (no sampling noise), plus a KL penalty to the
   starting policy's next-token distributions over the code read (`--kl`), so the
   rest of what the model does moves little. Groups whose candidates all pass or all
   fail carry no gradient and are skipped, as in GRPO.

    python -m opencomposer.training.repairrl collect --model smollm2 --out runs/repairrl
    python -m opencomposer.training.repairrl train --model smollm2 --out runs/repairrl
    python -m opencomposer.training.sft_offline merge runs/repairrl --model smollm2
    OPENCOMPOSER_CORPUS=~/.cache/opencomposer/corpus-heldout python \\
        benchmarks/repair_proposals.py --model runs/repairrl/checkpoints/step_N

`train` saves adapter checkpoints (`checkpoints/step_N/adapter`, with the optimizer
state) every `--checkpoint-every` steps and resumes from the newest.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import shlex
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

OPTIMIZER_STATE = "optimizer.pt"


class RepairRLError(ValueError):
    pass


# -- states and their graded candidates --------------------------------------------------


def failing_command(verify: str, failing: Sequence[str]) -> str:
    """The task's verify command narrowed to the tests that fail on the bug: the test
    files it names give way to the failing tests' ids (what a session's repair tries
    first, `localize.narrowed_command`). `verify` itself when it names none."""
    if not failing:
        return verify
    files = {f.split("::", 1)[0] for f in failing}
    words = [w for w in shlex.split(verify) if w not in files]
    return shlex.join([*words, *failing])


def broken_state(task: Any, others: int) -> dict[str, Any] | None:
    """(the state of a single-site task): its broken file's path and text, the lines in
    focus, and the file as the reference fix leaves it; None for a two-site task or
    one whose broken lines are not found once."""
    from opencomposer.agent import repair

    solution = json.loads((task.dir / "solution.json").read_text())
    if len(solution["edits"]) != 1:
        return None
    fix = solution["edits"][0]
    text = broken_text(task, fix["path"])
    if text.count(fix["old"]) != 1:
        return None
    line = fix["line"] - 1
    frames = [(fix["path"], line), *((fix["path"], n) for n in nearest(text, line, others))]
    spans = repair.focus({fix["path"]: text}, frames)
    return {
        "path": fix["path"],
        "text": text,
        "fixed": text.replace(fix["old"], fix["new"]),
        "spans": [[s.path, s.start, s.end] for s in spans],
        "kind": solution.get("kind", ""),
        "command": failing_command(task.verify, solution.get("failing", [])),
    }


def nearest(text: str, line: int, n: int) -> list[int]:
    """The first lines (0-based) of the `n` functions of `text` nearest 0-based `line`,
    outside the one around it, nearest first."""
    import ast

    if n <= 0:
        return []
    funcs = [
        (node.lineno - 1, node.end_lineno or node.lineno)
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    outside = [(a, b) for a, b in funcs if not a <= line < b]
    outside.sort(key=lambda f: min(abs(f[0] - line), abs(f[1] - line)))
    return [a for a, _ in outside[:n]]


def graded_indices(afters: Sequence[str], fixed: str, graded: int) -> list[int]:
    """Which of the ranked candidates (`afters`, the files they leave) are graded: the
    first `graded`, and the reference fix's wherever it ranks."""
    out = list(range(min(graded, len(afters))))
    ref = next((i for i, a in enumerate(afters) if a == fixed), None)
    if ref is not None and ref >= graded:
        out.append(ref)
    return out


async def grade(
    task: Any, workspace: Path, command: str, candidates: Sequence[dict[str, str]]
) -> list[bool | None] | None:
    """Each candidate ({path: text}) tried against `command` in one forked trial run in
    the task's sandboxed `workspace` (read-only; the run writes its scratch folder
    only); None when the run cannot be made or the code as it is did not fail."""
    from opencomposer.agent import trials
    from opencomposer.tools.sandbox import run_sandboxed
    from opencomposer.training.env import EnvConfig, sandbox_config

    config = sandbox_config(task, EnvConfig())
    bindir = str(Path(sys.executable).parent)

    async def run(line: str, folder: Path) -> None:
        await run_sandboxed(
            f'export PATH="{bindir}:$PATH"\n{line}',
            root=workspace,
            config=config,
            timeout_s=max(60.0, 3.0 * len(candidates)),
            files={},
            scratch=folder,
        )

    return await trials.forked(
        command,
        str(workspace),
        candidates,
        run,
        each_s=20.0,
        stop_after=len(candidates) + 1,
    )


def read_groups(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # the last line of a run cut short
    return out


async def collect(
    tasks: Sequence[Any],
    *,
    model: Any,
    out: Path,
    graded: int,
    others: int,
    proposed_only: bool = True,
    log: Any = print,
) -> list[dict[str, Any]]:
    """Propose with `model` (a `repair.TokenLM` with its `tokenizer`), grade and append
    one group per task to `out` (those there already are kept and not redone); returns
    every group in `out`. With `proposed_only`, a state whose candidates do not hold the
    reference fix is not graded: its candidates almost never pass (another edit that
    passes is rare), and grading them is most of a state's time."""
    from opencomposer.agent import repair
    from opencomposer.training.env import EnvConfig, Workspaces, remove_workspace

    done = {g["task_id"] for g in read_groups(out)}
    todo = [t for t in tasks if t.id not in done]
    if not todo:
        return read_groups(out)
    root = out.parent / "workspaces"
    ws = Workspaces(root, EnvConfig(pool_size=0, max_templates=2))
    try:
        for n, task in enumerate(todo, 1):
            t0 = time.perf_counter()
            state = broken_state(task, others)
            row: dict[str, Any] = {"task_id": task.id, "source": task.source}
            if state is None:
                row["skipped"] = "two sites, or the broken lines are not found once"
            else:
                texts = {state["path"]: state["text"]}
                spans = [repair.Span(*s) for s in state["spans"]]
                got = await repair.propose(model, model.tokenizer, texts, spans)
                afters = [p.after for p in got]
                picked = graded_indices(afters, state["fixed"], graded)
                ref = next((i for i, a in enumerate(afters) if a == state["fixed"]), None)
                # a fix the proposer misses, scored as the edit it would begin with
                missed = None
                if ref is None:
                    missed = repair.first_edit(
                        model.tokenizer, texts, spans, state["path"], state["fixed"]
                    )
                verdicts = None
                if ref is not None or missed is not None or not proposed_only:
                    workspace = await ws.template(task)
                    candidates = [{got[i].path: got[i].after} for i in picked]
                    if missed is not None:
                        candidates.append({state["path"]: state["fixed"]})
                    verdicts = await grade(task, workspace, state["command"], candidates)
                row |= {
                    "kind": state["kind"],
                    "path": state["path"],
                    "spans": state["spans"],
                    "command": state["command"],
                    "proposed": len(got),
                    "reference_rank": ref,
                }
                if ref is None and missed is None and proposed_only:
                    row["skipped"] = "the fix is neither proposed nor one edit of the code in focus"
                elif verdicts is None:
                    row["skipped"] = "the trial run could not be made, or the code did not fail"
                else:
                    extra = []
                    if missed is not None:
                        reward = verdicts.pop()
                        extra.append(
                            {
                                "rank": None,
                                "first": _first(missed),
                                "gain": None,
                                "reward": None if reward is None else float(reward),
                                "reference": True,
                                "new": repair.changed_lines(state["text"], state["fixed"])[1],
                            }
                        )
                    row["candidates"] = [
                        {
                            "rank": i,
                            "first": _first(got[i].first),
                            "gain": got[i].gain,
                            "reward": None if v is None else float(v),
                            "reference": i == ref,
                            "new": got[i].new,
                        }
                        for i, v in zip(picked, verdicts, strict=True)
                    ] + extra
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
            cands = row.get("candidates", [])
            passed = sum(c["reward"] == 1.0 for c in cands)
            log(
                f"[{n}/{len(todo)}] {task.id}: "
                + (
                    row["skipped"]
                    if "skipped" in row
                    else f"{passed} of {len(cands)} graded pass, the fix ranks "
                    f"{'nowhere' if row['reference_rank'] is None else row['reference_rank'] + 1}"
                    f" of {row['proposed']}"
                    + (", graded as the edit it begins with" if missed is not None else "")
                )
                + f" ({time.perf_counter() - t0:.1f} s)"
            )
    finally:
        await ws.aclose()
        remove_workspace(root)
    return read_groups(out)


def _first(first: Any) -> list[Any] | None:
    return None if first is None else [first.site, first.at, first.how, first.token]


# -- the update ---------------------------------------------------------------------------


def learnable(group: dict[str, Any]) -> list[dict[str, Any]]:
    """The group's graded candidates with a known reward and a first-order gain, when
    their rewards differ (else none: an all-pass or all-fail group has no gradient)."""
    cands = [c for c in group.get("candidates", []) if c["reward"] is not None and c["first"]]
    rewards = {c["reward"] for c in cands}
    return cands if len(rewards) > 1 else []


@contextlib.contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """The LoRA-adapted `model` as it was before training (every adapter's scale 0)."""
    from opencomposer.training.lora import lora_modules

    mods = [m for _, m in lora_modules(model)]
    scales = [m.scale for m in mods]
    try:
        for m in mods:
            m.scale = 0.0
        yield
    finally:
        for m, s in zip(mods, scales, strict=True):
            m.scale = s


def group_loss(
    model: Any,
    tok: Any,
    group: dict[str, Any],
    texts: dict[str, str],
    *,
    temperature: float,
    kl: float,
    ref_cache: dict[Any, Any] | None = None,
) -> tuple[Any, dict[str, float]]:
    """(-log J + kl · KL(start ‖ now), stats) of one learnable group. The model reads
    each site's prompt only up to the last position a gain reads, and projects to the
    vocabulary only there; the KL is taken at those positions too, against the
    adapters-off model's odds (kept in `ref_cache` for the next epoch)."""
    import torch
    from opencomposer.agent import repair

    cands = learnable(group)
    spans = [repair.Span(*s) for s in group["spans"]]
    prompts = repair.site_prompts(tok, texts, spans)
    decoder, head = model.get_decoder(), model.get_output_embeddings()

    def odds(ids: Any, need: list[int]) -> Any:
        hidden = decoder(input_ids=ids).last_hidden_state[0, need]
        return torch.log_softmax(head(hidden).float(), dim=-1)

    rows: dict[int, tuple[dict[int, int], Any]] = {}
    kls = []
    for site in sorted({c["first"][0] for c in cands}):
        prompt, offset = prompts[site]
        # the logits at position i predict token i + 1: a gain at body token j reads
        # position offset + j - 1, a drop's also the next
        need = sorted(
            {offset + c["first"][1] - 1 + d for c in cands if c["first"][0] == site for d in (0, 1)}
        )
        ids = torch.tensor([prompt[: need[-1] + 1]])
        logp = odds(ids, need)
        rows[site] = ({pos: k for k, pos in enumerate(need)}, logp)
        if kl:
            key = (group["task_id"], site)
            ref = ref_cache.get(key) if ref_cache is not None else None
            if ref is None:
                with torch.no_grad(), adapters_off(model):
                    ref = odds(ids, need)
                if ref_cache is not None:
                    ref_cache[key] = ref
            kls.append((ref.exp() * (ref - logp)).sum(-1).mean())
    gains = []
    for c in cands:
        site, at, how, token = c["first"]
        prompt, offset = prompts[site]
        where, logp = rows[site]

        def lp(j: int, t: int, where: Any = where, logp: Any = logp, offset: int = offset) -> Any:
            return logp[where[offset + j - 1], t]

        first = repair.FirstOrder(site, at, how, token)
        gains.append(repair.first_order_gain(first, prompt[offset:], lp))
    g = torch.stack(gains) / temperature
    r = torch.tensor([c["reward"] for c in cands])
    pi = torch.softmax(g, dim=0)
    j = (pi * r).sum()
    loss = -torch.log(j.clamp_min(1e-8))
    kl_term = torch.stack(kls).mean() if kls else torch.zeros(())
    loss = loss + kl * kl_term
    with torch.no_grad():
        order = torch.argsort(g, descending=True).tolist()
        first_pass = next(k for k, i in enumerate(order) if r[i] > 0)
    return loss, {
        "logJ": float(torch.log(j.detach().clamp_min(1e-8))),
        "kl": float(kl_term.detach()),
        "rank": first_pass,
    }


def train(
    groups: Sequence[dict[str, Any]],
    tasks: dict[str, Any],
    *,
    folder: Path,
    out: Path,
    epochs: int,
    groups_per_step: int,
    lr: float,
    temperature: float,
    kl: float,
    lora_rank: int,
    lora_alpha: float,
    seed: int,
    checkpoint_every: int,
    log: Any = print,
) -> Path:
    """Train a LoRA adapter on `folder`'s policy over the learnable `groups`; returns the
    last checkpoint (resumes from the newest under `out/checkpoints`)."""
    import torch
    from opencomposer.agent.backends._local import (
        ChatTokenizer,
        read_model_settings,
        write_model_settings,
    )
    from opencomposer.training.lora import (
        checkpoint_adapter,
        load_adapter_state,
        newest_adapter_checkpoint,
    )
    from opencomposer.training.sft_offline import save_adapter_checkpoint
    from opencomposer.training.trainer import Trainer, TrainerConfig
    from safetensors.torch import load_file

    todo = [g for g in groups if learnable(g) and g["task_id"] in tasks]
    if not todo:
        raise RepairRLError("no group has candidates that pass and fail: nothing to learn from")
    torch.manual_seed(seed)
    config = TrainerConfig(lr=lr, lora_rank=lora_rank, lora_alpha=lora_alpha)
    trainer = Trainer.from_pretrained(folder, config)
    settings = read_model_settings(folder)
    trainer.prompt_style = settings.get("prompt_style")
    trainer.max_turns = settings.get("max_turns")
    model = trainer.model
    tok = ChatTokenizer(folder)
    texts: dict[str, dict[str, str]] = {}
    per_epoch = math.ceil(len(todo) / groups_per_step)
    total = epochs * per_epoch
    done = 0
    newest = newest_adapter_checkpoint(out)
    if newest is not None:
        adapter = checkpoint_adapter(newest)
        load_adapter_state(model, load_file(str(adapter / "adapter.safetensors")))
        if (newest / OPTIMIZER_STATE).is_file():
            trainer.optimizer.load_state_dict(torch.load(newest / OPTIMIZER_STATE))
        done = int(newest.name.split("_")[1])
        log(f"resumed from {newest} ({done} of {total} steps)")
    # bf16 where the CPU computes it natively (or a GPU), else fp32 (`compute_dtype`)
    bf16 = trainer.compute_dtype == "bf16"
    ref_cache: dict[Any, Any] = {}
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    params = [p for p in model.parameters() if p.requires_grad]
    last = newest
    for step in range(done, total):
        epoch, k = divmod(step, per_epoch)
        order = list(range(len(todo)))
        random.Random(seed + epoch).shuffle(order)
        batch = [todo[i] for i in order[k * groups_per_step : (k + 1) * groups_per_step]]
        t0 = time.perf_counter()
        trainer.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, list[float]] = {"logJ": [], "kl": [], "rank": []}
        for group in batch:
            if group["task_id"] not in texts:
                task = tasks[group["task_id"]]
                texts[group["task_id"]] = {group["path"]: broken_text(task, group["path"])}
            with torch.autocast(trainer.device.type, dtype=torch.bfloat16, enabled=bf16):
                loss, st = group_loss(
                    model,
                    tok,
                    group,
                    texts[group["task_id"]],
                    temperature=temperature,
                    kl=kl,
                    ref_cache=ref_cache,
                )
            (loss / len(batch)).backward()
            for key in stats:
                stats[key].append(st[key])
        grad = float(torch.nn.utils.clip_grad_norm_(params, config.grad_clip))
        if math.isfinite(grad):
            trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        row = {
            "step": step + 1,
            "phase": "repairrl",
            "time": time.time(),
            "logJ": sum(stats["logJ"]) / len(batch),
            "kl": sum(stats["kl"]) / len(batch),
            "first_pass_rank": sum(stats["rank"]) / len(batch),
            "grad_norm": grad,
            "train_s": time.perf_counter() - t0,
        }
        with open(metrics, "a") as f:
            f.write(json.dumps(row) + "\n")
        log(
            f"step {step + 1}/{total}: log J {row['logJ']:+.3f}, KL {row['kl']:.4f}, first passing"
            f" candidate at {row['first_pass_rank']:.1f}, grad {grad:.3f} ({row['train_s']:.1f} s)"
        )
        if (step + 1) % checkpoint_every == 0 or step + 1 == total:
            last = save_adapter_checkpoint(trainer, out / "checkpoints" / f"step_{step + 1}")
            # the policy's own settings (its `repair` among them): this trains the ranking
            # the session's repair uses, and a merged checkpoint runs as the policy did
            write_model_settings(last, settings)
            torch.save(trainer.optimizer.state_dict(), last / OPTIMIZER_STATE)
    if last is None:
        raise RepairRLError(f"{out}: no step to take and no checkpoint")
    return last


def broken_text(task: Any, path: str) -> str:
    """The file at `path` in a task's (broken) workspace."""
    with tarfile.open(task.repo_tar) as tar:
        member = tar.extractfile(path)
        return member.read().decode() if member else ""


# -- command line ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    from opencomposer.training.sft_offline import OfflineError, model_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, text in (
        ("collect", "propose and grade candidates at training states (resumes)"),
        ("train", "train the ranking on the graded groups (resumes)"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--model", default="smollm2", help="the policy (a local model name)")
        p.add_argument("--suite", default="corpus:train", help="the training tasks")
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--seed", type=int, default=0)
    c = sub.choices["collect"]
    c.add_argument("--states", type=int, default=200, help="tasks, round-robin over projects")
    c.add_argument("--graded", type=int, default=16, help="candidates graded per state")
    c.add_argument("--others", type=int, default=1, help="nearest functions also in focus")
    c.add_argument(
        "--all-states",
        action="store_true",
        help="grade states whose candidates do not hold the reference fix too",
    )
    t = sub.choices["train"]
    t.add_argument("--epochs", type=int, default=3)
    t.add_argument("--groups-per-step", type=int, default=8)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--temperature", type=float, default=1.0, help="τ of the ranking's softmax")
    t.add_argument("--kl", type=float, default=0.1, help="weight of KL(start ‖ now)")
    t.add_argument("--lora-rank", type=int, default=16)
    t.add_argument("--lora-alpha", type=float, default=32.0)
    t.add_argument("--checkpoint-every", type=int, default=10)
    a = ap.parse_args(argv)

    from opencomposer.training.catalog import load_suite
    from opencomposer.training.demos import spread

    try:
        tasks = load_suite(a.suite)
        held = sorted({t.id for t in tasks if t.split == "heldout"})
        if held:
            raise RepairRLError(f"{a.suite} holds held-out tasks ({held[0]}, …): use corpus:train")
        if not tasks:
            raise RepairRLError(f"{a.suite}: no task (build the corpus first)")
        folder = model_dir(a.model)
        a.out.mkdir(parents=True, exist_ok=True)
        groups_file = a.out / "groups.jsonl"
        t0 = time.time()
        if a.cmd == "collect":
            picked = spread(tasks, a.states, a.seed)
            groups = asyncio.run(
                _collect(picked, folder, groups_file, a.graded, a.others, not a.all_states)
            )
            print(summary(groups) + f" ({time.time() - t0:.0f} s)")
            return 0
        groups = read_groups(groups_file)
        print(summary(groups))
        last = train(
            groups,
            {t.id: t for t in tasks},
            folder=folder,
            out=a.out,
            epochs=a.epochs,
            groups_per_step=a.groups_per_step,
            lr=a.lr,
            temperature=a.temperature,
            kl=a.kl,
            lora_rank=a.lora_rank,
            lora_alpha=a.lora_alpha,
            seed=a.seed,
            checkpoint_every=a.checkpoint_every,
        )
        (a.out / "config.json").write_text(json.dumps({"repairrl": vars(a)}, default=str, indent=1))
        print(f"saved {last} ({time.time() - t0:.0f} s)")
        return 0
    except (RepairRLError, OfflineError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


async def _collect(
    tasks: Sequence[Any], folder: Path, out: Path, graded: int, others: int, proposed_only: bool
) -> list[dict[str, Any]]:
    from opencomposer.agent.backends.llamacpp import LlamaCppModel

    model = LlamaCppModel(str(folder))
    await model.start()
    try:
        return await collect(
            tasks,
            model=model,
            out=out,
            graded=graded,
            others=others,
            proposed_only=proposed_only,
        )
    finally:
        await model.close()


def summary(groups: Sequence[dict[str, Any]]) -> str:
    graded = [g for g in groups if "candidates" in g]
    ranks = [g["reference_rank"] for g in graded if g.get("reference_rank") is not None]
    some = sum(any(c["reward"] == 1.0 for c in g["candidates"]) for g in graded)
    within = sum(r < 24 for r in ranks)
    return (
        f"{len(groups)} states, {len(graded)} graded: {some} with a passing candidate, "
        f"{sum(bool(learnable(g)) for g in graded)} learnable; the reference fix proposed in "
        f"{len(ranks)}, within the first 24 in {within}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
