"""The PyTorch trainer: one optimizer step on a batch of token-exact samples.

A ``Sample`` (``rollouts.Sample``) is a token sequence, a mask that is 1 on the
tokens the model generated, the sampler's logprob of each of those tokens and the
rollout's advantage. ``Trainer.step`` packs the samples into micro-batches,
accumulates the gradient of ``loss.policy_loss`` (normalised by the step's total
token count, so accumulation equals the full-batch loss), clips the global norm,
and takes an AdamW step.

Precision: master weights and AdamW state stay fp32; the forward and backward run
under bf16 autocast (on CPU as on GPU — the same code path; only the device
differs), except on a CPU without native bf16 (no AVX512-BF16 or AMX, e.g. an
AVX2-only one): there bf16 matmuls take a slow fallback (an SFT step on one
1,500-token sample with LoRA took 221.8 s against 8.6 s in fp32 on 2 AVX2 cores,
``benchmarks/precision.py``), so ``bf16`` computes in fp32 (``Trainer.compute_dtype``
says which). ``precision = "mxfp8"`` swaps linear layers for the MXFP8 training
kernels of ``opencomposer.kernels.mx`` before the optimizer is built.

Faults: a step whose loss or gradient norm is not finite is skipped — gradients
are dropped, the optimizer is not stepped, the weights and the version stay.

Checkpoints are a Hugging Face folder (so vLLM can load it) plus
``trainer_state.pt`` (optimizer, step, version, RNG); ``Trainer.load`` resumes.

Run the tests: ``.venv/bin/python -m pytest tests/training/test_trainer.py -q``.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import math
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from opencomposer.training.loss import LossConfig, policy_loss, token_logprobs_and_entropy

if TYPE_CHECKING:
    from opencomposer.training.rollouts import Sample

Precision = Literal["bf16", "fp32", "mxfp8"]
STATE_FILE = "trainer_state.pt"
TOKENIZER_FILES = (
    "tokenizer",
    "special_tokens_map",
    "vocab",
    "merges",
    "chat_template",
    "generation_config",
)


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    micro_batch_size: int = 4  # sequences per forward/backward
    precision: Precision = "bf16"
    device: str = "cpu"
    loss: LossConfig = field(default_factory=LossConfig)
    gradient_checkpointing: bool = False
    lora_rank: int = 0  # >0: train low-rank adapters on a frozen model (training/lora.py)
    lora_alpha: float = 32.0


def compute_dtype(precision: Precision, device: torch.device) -> Literal["bf16", "fp32"]:
    """The dtype a ``precision`` computes in on ``device``: bf16 autocast for "bf16"
    and "mxfp8", except "bf16" on a CPU without native bf16 (AVX512-BF16 or AMX),
    where bf16 is several times slower than fp32 and the run computes in fp32."""
    if precision == "fp32":
        return "fp32"
    if precision == "bf16" and device.type == "cpu":
        from opencomposer.index.embed import cpu_has_bf16

        return "bf16" if cpu_has_bf16() else "fp32"
    return "bf16"


class PolicyHead(torch.nn.Module):
    """A causal LM's forward that projects only the selected positions to the vocabulary.

    ``forward(ids [B, T], attn [B, T], sel [B, T-1] bool) -> logits [N, V]`` where N is
    the number of selected positions (position i predicts token i+1). It is one module
    so that DDP/FSDP2 can wrap the whole trained forward (``training/cluster.py``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, attn: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        body, head = getattr(self.model, "model", None), getattr(self.model, "lm_head", None)
        if body is None or head is None:
            logits = self.model(input_ids=ids, attention_mask=attn).logits  # [B, T, V]
            return logits[:, :-1][sel]
        hidden = body(input_ids=ids, attention_mask=attn).last_hidden_state  # [B, T, H]
        return head(hidden[:, :-1][sel])


class Trainer:
    """Owns the policy, its optimizer, the step counter and the weight version."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: TrainerConfig,
        *,
        ref_model: torch.nn.Module | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if config.precision == "mxfp8":
            from opencomposer.kernels.convert import to_mxfp8_training

            model = to_mxfp8_training(model) or model
        else:  # an upcycled MoE trains on the grouped expert path; dense models are unchanged
            from opencomposer.kernels.moe import use_grouped_experts

            model = use_grouped_experts(model)
        if config.lora_rank > 0:
            from opencomposer.training.lora import LoraConfig, apply_lora

            apply_lora(model, LoraConfig(rank=config.lora_rank, alpha=config.lora_alpha))
        self.model = model.to(self.device, dtype=torch.float32)
        # what the forward and backward compute in ("bf16" autocast, or "fp32")
        self.compute_dtype = compute_dtype(config.precision, self.device)
        self.model.train()
        # the trained forward; training/cluster.py wraps it in DDP or FSDP2 (``distribute``)
        self.policy: torch.nn.Module = PolicyHead(self.model)
        self.world_size = 1  # > 1: gradients are averaged over ranks by the wrapper
        if config.gradient_checkpointing and hasattr(self.model, "gradient_checkpointing_enable"):
            self.model.gradient_checkpointing_enable()
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.to(self.device).eval().requires_grad_(False)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.step_count = 0
        self.version = 0  # bumps once per applied (non-skipped) step
        # All training work runs on this one thread (see `run`).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
        self.source_dir: Path | None = None  # tokenizer files are copied from here on save
        # the system-prompt style the policy is trained with; saved checkpoints say it
        # (opencomposer.json) so the agent prompts a trained folder the same way
        self.prompt_style: str | None = None
        # the checkpoint this run started from (`[sft] init`); saved checkpoints record
        # it, so a shipped policy's card can list every stage that trained it
        self.init_from: str | None = None
        self.max_turns: int | None = None  # the episodes' turn budget: the agent's default

    @classmethod
    def from_pretrained(
        cls, path: Path | str, config: TrainerConfig, *, with_reference: bool = False
    ) -> Trainer:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        ref = None
        if with_reference:
            bf16 = compute_dtype(config.precision, torch.device(config.device)) == "bf16"
            ref_dtype = torch.bfloat16 if bf16 else torch.float32
            ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=ref_dtype)
        trainer = cls(model, config, ref_model=ref)
        trainer.source_dir = Path(path)
        return trainer

    # -- the step ------------------------------------------------------------------

    def _autocast(self):
        enabled = self.compute_dtype == "bf16"
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def _micro_batches(self, samples: Sequence[Sample]) -> Iterator[dict[str, torch.Tensor]]:
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].input_ids))
        mb = max(1, self.config.micro_batch_size)
        for start in range(0, len(order), mb):
            batch = [samples[i] for i in order[start : start + mb]]
            width = max(len(s.input_ids) for s in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            attn = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width)
            old = torch.zeros(len(batch), width)
            for row, s in enumerate(batch):
                n = len(s.input_ids)
                ids[row, :n] = torch.tensor(s.input_ids)
                attn[row, :n] = 1
                mask[row, :n] = torch.tensor(s.mask, dtype=torch.float32)
                old[row, :n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
            adv = torch.tensor([s.advantage for s in batch], dtype=torch.float32)
            yield {
                "ids": ids.to(self.device),
                "attn": attn.to(self.device),
                # position i predicts token i+1: shift the per-token arrays left by one
                "mask": mask[:, 1:].to(self.device),
                "old": old[:, 1:].to(self.device),
                "adv": adv.to(self.device),
            }

    def _logprobs(self, model: torch.nn.Module, mb: dict[str, torch.Tensor]):
        """Per-position logprob of the next token and entropy, [B, T-1] each.

        Only trained positions matter, and prompts (a long system prompt, tool
        results) dominate the sequence, so the vocabulary projection runs on masked
        positions only (``PolicyHead``): ~10x less memory for the [tokens, vocab]
        logits on agent traces. ``model`` is the policy (through ``self.policy``, which
        DDP or FSDP2 may wrap on a cluster) or the reference model."""
        ids, sel = mb["ids"], mb["mask"] > 0  # sel: [B, T-1]
        fwd = self.policy if model is self.model else PolicyHead(model)
        with self._autocast():
            logits = fwd(ids, mb["attn"], sel)  # [N, V]
        lp, ent = token_logprobs_and_entropy(logits[None], ids[:, 1:][sel][None])  # [1, N]
        full_lp = lp.new_zeros(sel.shape)
        full_lp[sel] = lp[0]
        full_ent = ent.new_zeros(sel.shape)
        full_ent[sel] = ent[0]
        if not sel.any():  # an empty (padding) micro-batch: keep every parameter in the graph
            full_lp = full_lp + 0.0 * logits.sum()
        return full_lp, full_ent

    async def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args, **kwargs)` off the event loop on the trainer's own thread.

        Always the same thread: glibc gives each thread that allocates its own malloc
        arena and keeps what is freed there, so steps spread over a thread pool grew
        the process by gigabytes (6 GB to 17 GB in 3 steps of the 135M model) where one
        thread levels off. Memory the step freed is handed back to the system after."""
        loop = asyncio.get_running_loop()
        call = functools.partial(_then_trim, functools.partial(fn, *args, **kwargs))
        return await loop.run_in_executor(self._thread, call)

    def distribute(
        self, wrap: Callable[[torch.nn.Module], torch.nn.Module], world_size: int
    ) -> None:
        """Train as one of ``world_size`` ranks: ``wrap`` (DDP, FSDP2) wraps the policy
        forward and averages gradients over ranks; see ``step``'s ``totals``."""
        self.policy = wrap(self.policy)
        self.world_size = world_size
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=self.config.lr,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
        )

    def step(
        self,
        samples: Sequence[Sample],
        *,
        totals: tuple[float, float] | None = None,
        micro_batches: int = 0,
    ) -> dict[str, float]:
        """One optimizer step over ``samples``; returns the step's statistics.

        On a cluster each rank gets its shard of the batch: ``totals`` is the whole
        batch's (trained tokens, sequences), so every rank's loss is normalised like
        the full-batch loss, and ``micro_batches`` pads the shard with empty
        micro-batches so that every rank runs the same number of backward passes (the
        gradient all-reduce is collective)."""
        t0 = time.perf_counter()
        self.step_count += 1
        stats: dict[str, float] = {"samples": float(len(samples)), "skipped": 0.0}
        num_tokens = float(sum(sum(s.mask[1:]) for s in samples))
        num_sequences = float(len(samples))
        if totals is not None:
            num_tokens, num_sequences = totals
        if self.world_size > 1:
            return self._step(samples, num_tokens, num_sequences, micro_batches, stats, t0)
        if not samples or num_tokens == 0:
            stats.update(skipped=1.0, loss=0.0, grad_norm=0.0, train_s=time.perf_counter() - t0)
            return stats
        return self._step(samples, num_tokens, num_sequences, micro_batches, stats, t0)

    def _step(
        self,
        samples: Sequence[Sample],
        num_tokens: float,
        num_sequences: float,
        micro_batches: int,
        stats: dict[str, float],
        t0: float,
    ) -> dict[str, float]:
        distributed = self.world_size > 1
        batches = list(self._micro_batches(samples))
        while len(batches) < micro_batches:
            batches.append(self._empty_batch())
        self.optimizer.zero_grad(set_to_none=True)
        total_loss = 0.0
        agg: dict[str, float] = {}
        entropy_sum = 0.0
        finite = True
        for i, mb in enumerate(batches):
            last = i == len(batches) - 1
            logprobs, entropy = self._logprobs(self.model, mb)
            ref = None
            if self.ref_model is not None and self.config.loss.kl_coef:
                with torch.no_grad():
                    ref, _ = self._logprobs(self.ref_model, mb)
            loss, mstats = policy_loss(
                logprobs,
                mb["old"],
                mb["adv"],
                mb["mask"],
                config=self.config.loss,
                ref_logprobs=ref,
                num_tokens=max(num_tokens, 1.0),
                num_sequences=max(num_sequences, 1.0),
            )
            if not torch.isfinite(loss):
                finite = False
                if not distributed:  # ranks keep going: the all-reduce is collective
                    break
            with _no_sync(self.policy, enabled=distributed and not last):
                (loss * self.world_size).backward()  # the wrapper averages over ranks
            total_loss += float(loss.detach())
            w = mstats["tokens"] / max(num_tokens, 1.0)
            for k in ("ratio_mean", "clip_frac", "kl_old", "kl_ref"):
                agg[k] = agg.get(k, 0.0) + mstats[k] * w
            entropy_sum += float((entropy * mb["mask"]).sum())
        grad_norm = float("nan")
        if finite or distributed:  # a rank's NaN reaches every rank's gradient norm
            grad_norm = float(
                torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.config.grad_clip)
            )
            finite = math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.version += 1
        else:
            stats["skipped"] = 1.0
        self.optimizer.zero_grad(set_to_none=True)
        stats.update(agg)
        stats.update(
            loss=total_loss if finite else float("nan"),
            grad_norm=grad_norm,
            entropy=entropy_sum / max(num_tokens, 1.0),
            train_tokens=num_tokens,
            train_s=time.perf_counter() - t0,
        )
        return stats

    def _empty_batch(self) -> dict[str, torch.Tensor]:
        """A micro-batch with nothing to train on (padding on a rank with fewer samples)."""
        z = torch.zeros(1, 2, device=self.device)
        return {
            "ids": torch.zeros(1, 2, dtype=torch.long, device=self.device),
            "attn": torch.ones(1, 2, dtype=torch.long, device=self.device),
            "mask": z[:, 1:],
            "old": z[:, 1:],
            "adv": torch.zeros(1, device=self.device),
        }

    def sft_step(self, samples: Sequence[Sample], *, lr: float | None = None) -> dict[str, float]:
        """One supervised step: mean negative log-likelihood of the masked tokens."""
        t0 = time.perf_counter()
        if lr is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        num_tokens = float(sum(sum(s.mask[1:]) for s in samples))
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for mb in self._micro_batches(samples):
            logprobs, _ = self._logprobs(self.model, mb)
            loss = -(logprobs * mb["mask"]).sum() / max(num_tokens, 1.0)
            if not torch.isfinite(loss):
                self.optimizer.zero_grad(set_to_none=True)
                return {"loss": float("nan"), "skipped": 1.0, "train_s": time.perf_counter() - t0}
            loss.backward()
            total += float(loss.detach())
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        )
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
            self.version += 1
        self.optimizer.zero_grad(set_to_none=True)
        if lr is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = self.config.lr
        return {
            "loss": total,
            "grad_norm": grad_norm,
            "skipped": float(skipped),
            "train_tokens": num_tokens,
            "seq_tokens": float(sum(len(s.input_ids) for s in samples)),
            "train_s": time.perf_counter() - t0,
        }

    def nll(self, samples: Sequence[Sample]) -> float:
        """Mean negative log-likelihood per masked token of ``samples``, no update
        (a validation loss, in `sft_step`'s terms)."""
        total, tokens = 0.0, 0.0
        self.model.eval()
        try:
            with torch.no_grad():
                for mb in self._micro_batches(samples):
                    logprobs, _ = self._logprobs(self.model, mb)
                    total -= float((logprobs * mb["mask"]).sum())
                    tokens += float(mb["mask"].sum())
        finally:
            self.model.train()
        return total / max(tokens, 1.0)

    # -- weights and checkpoints -----------------------------------------------------

    def named_weights(
        self, dtype: torch.dtype = torch.bfloat16
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The current weights, by the Hugging Face names vLLM loads, cast for the sampler
        (adapters folded in, for a LoRA run)."""
        from opencomposer.training.lora import is_lora, merged_state_dict

        state = merged_state_dict(self.model) if is_lora(self.model) else self.model.state_dict()
        for name, t in state.items():
            yield name, t.detach().to(dtype)

    def save(
        self,
        folder: Path,
        *,
        extra: dict[str, Any] | None = None,
        model_state: dict[str, torch.Tensor] | None = None,
        optimizer_state: dict[str, Any] | None = None,
    ) -> Path:
        """Write a loadable HF folder plus the trainer state; returns ``folder``.
        ``model_state``/``optimizer_state``: full state dicts gathered by the caller (a
        sharded FSDP2 rank 0, ``training/cluster.py``) instead of this process's own."""
        folder.mkdir(parents=True, exist_ok=True)
        if hasattr(self.model, "save_pretrained"):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            from opencomposer.training.lora import (
                CHECKPOINT_ADAPTER,
                is_lora,
                merged_state_dict,
                save_adapter,
            )

            if is_lora(self.model):  # the merged model (loadable anywhere) and the adapter
                self.model.save_pretrained(
                    str(folder), state_dict=merged_state_dict(self.model), safe_serialization=True
                )
                save_adapter(self.model, folder / CHECKPOINT_ADAPTER)
            else:
                self.model.save_pretrained(
                    str(folder), state_dict=model_state, safe_serialization=True
                )
        else:
            torch.save(self.model.state_dict(), folder / "model.pt")
        if self.source_dir is not None:  # so that vLLM and the agent can load the folder
            for f in self.source_dir.iterdir():
                if f.is_file() and (f.name.startswith(TOKENIZER_FILES) or f.suffix == ".jinja"):
                    shutil.copyfile(f, folder / f.name)
        settings = {
            "prompt_style": self.prompt_style,
            "max_turns": self.max_turns,
            "init": self.init_from,
        }
        if any(v is not None for v in settings.values()):
            from opencomposer.agent.backends._local import write_model_settings

            write_model_settings(folder, {k: v for k, v in settings.items() if v is not None})
        state = {
            "optimizer": optimizer_state
            if optimizer_state is not None
            else self.optimizer.state_dict(),
            "step": self.step_count,
            "version": self.version,
            "rng": torch.get_rng_state(),
            "extra": extra or {},
        }
        tmp = folder / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(
            folder / STATE_FILE
        )  # the state file last: its presence marks a whole checkpoint
        return folder

    def load(self, folder: Path) -> dict[str, Any]:
        """Restore weights, optimizer, step and version from ``folder``; returns ``extra``.
        A LoRA run restores its adapters (the frozen base is the model it started from)."""
        from opencomposer.agent.backends._local import read_model_settings
        from opencomposer.training.lora import (
            checkpoint_adapter,
            is_lora,
            load_adapter_state,
            read_adapter,
        )

        self.init_from = read_model_settings(folder).get("init") or self.init_from
        if is_lora(self.model):
            load_adapter_state(self.model, read_adapter(checkpoint_adapter(folder))[1])
        elif (folder / "model.pt").exists():
            self.model.load_state_dict(torch.load(folder / "model.pt", map_location=self.device))
        else:
            from safetensors.torch import load_file

            weights: dict[str, torch.Tensor] = {}
            for f in sorted(folder.glob("*.safetensors")):
                weights.update(load_file(str(f), device=str(self.device)))
            missing, unexpected = self.model.load_state_dict(weights, strict=False)
            real_missing = [m for m in missing if not m.endswith("lm_head.weight")]
            if real_missing or unexpected:
                raise ValueError(
                    f"checkpoint {folder} does not match the model: {real_missing[:3]} {unexpected[:3]}"
                )
            if hasattr(self.model, "tie_weights"):
                self.model.tie_weights()
        state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step"])
        self.version = int(state["version"])
        torch.set_rng_state(state["rng"])
        return dict(state.get("extra") or {})


def _no_sync(module: torch.nn.Module, *, enabled: bool) -> Any:
    """DDP's ``no_sync`` (accumulate without the all-reduce) where asked and offered;
    FSDP2 modules toggle ``set_requires_gradient_sync`` instead."""
    import contextlib

    if not enabled:
        return contextlib.nullcontext()
    if hasattr(module, "no_sync"):
        return module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):

        @contextlib.contextmanager
        def fsdp() -> Iterator[None]:
            module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)

        return fsdp()
    return contextlib.nullcontext()


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint under ``run_dir/checkpoints`` (one with its state file)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return None
    done = [p for p in root.glob("step_*") if (p / STATE_FILE).exists()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (0 keeps all); returns the
    deleted folders. Incomplete ones (no state file yet) are left alone, and so is
    ``step_0``, the warm start's result (what RL is measured against)."""
    root = run_dir / "checkpoints"
    if keep <= 0 or not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if (p / STATE_FILE).exists() and p.name != "step_0"]
    done.sort(key=lambda p: int(p.name.split("_")[1]))
    old = done[:-keep]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


def tiny_llama(seed: int = 0, vocab_size: int = 64) -> torch.nn.Module:
    """A tiny random Llama (two layers, width 32): the test double for trainer code paths."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


try:
    _MALLOC_TRIM = getattr(
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "malloc_trim", None
    )
except OSError:  # no C library to open by name: nothing to trim
    _MALLOC_TRIM = None


def _then_trim(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    finally:
        if _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)
