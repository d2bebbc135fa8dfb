"""A request's sampling parameters (``SamplingParams``, vLLM's names and defaults) and their
checks: every field is validated where the parameters are made, and a bad one raises
``InvalidParam`` naming the field (the server's 400 names it too).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, replace

from tiny_llm.models.tokenizer import check_text
from tiny_llm.structured import StructuredOutput

import numpy as np


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class InvalidParam(ValueError):
    """A sampling parameter out of its range, naming it (``field``)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _invalid(field: str, requirement: str, value: object) -> InvalidParam:
    return InvalidParam(field, f"SamplingParams.{field} must be {requirement}, got {value!r}")


def _real(field: str, value: object, ok: Callable[[float], bool], requirement: str) -> float:
    is_real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not is_real or not math.isfinite(value) or not ok(float(value)):
        raise _invalid(field, requirement, value)
    return float(value)


def _optional_int(field: str, value: object, minimum: int) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or value < minimum:
        raise _invalid(field, f"None or an int >= {minimum}", value)
    return int(value)


def _stop_strings(value: object) -> list[str]:
    items = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise _invalid("stop", "None, a non-empty string or a list of non-empty strings", value)
    for s in items:
        try:
            check_text("SamplingParams.stop", s)
        except ValueError as e:
            raise InvalidParam("stop", str(e)) from None
    return list(items)


def _stop_ids(value: object) -> list[int]:
    items = [] if value is None else value
    if not isinstance(items, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in items):
        raise _invalid("stop_token_ids", "None or a list of ints >= 0", value)
    return [int(t) for t in items]


def _logit_bias(value: object) -> dict[int, float]:
    items = {} if value is None else value
    if not isinstance(items, dict):
        raise _invalid("logit_bias", "None or a dict of token id -> bias in [-100, 100]", value)
    out = {}
    for token, bias in items.items():
        # JSON object keys are strings: "42" is token 42, as in OpenAI's API.
        tid = int(token) if isinstance(token, str) and token.isascii() and token.isdigit() \
            else token
        if not _is_int(tid) or tid < 0:
            raise _invalid("logit_bias", "keyed by token ids >= 0", value)
        ok = isinstance(bias, numbers.Real) and not isinstance(bias, bool)
        if not ok or not -100.0 <= float(bias) <= 100.0:
            raise _invalid("logit_bias", "a dict of token id -> bias in [-100, 100]", value)
        out[int(tid)] = float(bias)
    return out


GREEDY_BELOW = 1e-5  # temperatures below this sample greedily
MAX_LOGPROBS = 20  # alternatives a token's record may list (OpenAI's top_logprobs limit)
FLOAT32_MAX = np.finfo(np.float32).max  # the highest logit a row keeps (inf: NaN softmax)
MAX_SAMPLES = 128  # samples of one prompt (OpenAI's limit on n)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # what a record reads: TokenLogprob


@dataclass
class SamplingParams:
    """Per-request sampling settings; ``__post_init__`` validates and normalises them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # The special tokens' text (<|im_end|>) left out of the output text, as vLLM's default;
    # their ids stay in the output's token ids (a stop string spelling one never matches:
    # stop_token_ids stops at it).
    skip_special_tokens: bool = True
    seed: int | None = None
    # Penalties and biases (``penalize``): on the output so far, as vLLM and OpenAI define
    # them; repetition_penalty also counts the prompt.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    # The sampled token's log-probability and this many alternatives' (``TokenLogprob``).
    logprobs: int | None = None
    # Each prompt token's log-probability (and this many alternatives'), in the model's
    # own distribution at the position before it: ``RequestOutput.prompt_logprobs``.
    prompt_logprobs: int | None = None
    # A grammar the output must match (``structured.py``): JSON schema, regex, choice...
    structured: StructuredOutput | None = None
    # Samples of the prompt (``generate`` and the server): they share the prompt's pages.
    n: int = 1

    def __post_init__(self) -> None:
        self.temperature = _real(
            "temperature", self.temperature, lambda v: v >= 0.0, "a finite number >= 0"
        )
        self.top_p = _real("top_p", self.top_p, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")
        self.min_p = _real("min_p", self.min_p, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _invalid("top_k", "-1 or 0 (disabled) or an int >= 1", self.top_k)
        self.top_k = int(self.top_k)
        self.max_tokens = _optional_int("max_tokens", self.max_tokens, 1)
        self.seed = _optional_int("seed", self.seed, 0)
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_ids(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(name, "a bool", getattr(self, name))
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _real(name, getattr(self, name), lambda v: -2.0 <= v <= 2.0,
                                      "a number in [-2, 2]"))
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty,
                                        lambda v: v > 0.0, "a finite number > 0")
        self.logit_bias = _logit_bias(self.logit_bias)
        self.min_tokens = _optional_int("min_tokens", self.min_tokens, 0) or 0
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _invalid("min_tokens", f"at most max_tokens ({self.max_tokens})",
                           self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            k = _optional_int(name, getattr(self, name), 0)
            if k is not None and k > MAX_LOGPROBS:
                raise _invalid(name, f"None or an int in [0, {MAX_LOGPROBS}]", k)
            setattr(self, name, k)
        self.n = _optional_int("n", self.n, 1)
        if self.n is None or self.n > MAX_SAMPLES:
            raise _invalid("n", f"an int in [1, {MAX_SAMPLES}]", self.n)
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise _invalid("structured", "a StructuredOutput", self.structured)
            # A grammar ends with an end token where its output is whole: both would hold
            # that token back.
            for name in ("ignore_eos", "min_tokens"):
                if getattr(self, name):
                    raise InvalidParam(name, f"{name} cannot be combined with a structured "
                                       "output, which ends exactly where its grammar is "
                                       "complete")

    def for_sample(self, index: int) -> SamplingParams:
        """Sample ``index``'s own params: one sample, seeded ``seed + index`` if seeded.
        The first scores the prompt (``prompt_logprobs``) for all of them."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index,
                       prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    @property
    def drafts_allowed(self) -> bool:
        """Whether speculative decoding may draft for the request: not with penalties (they
        read the tokens before each position), logprobs (recorded token by token) nor a
        structured output (its mask at a position depends on the tokens before it)."""
        return not self.penalized and self.logprobs is None and self.structured is None

    @property
    def penalized(self) -> bool:
        """Whether a penalty, a bias or min_tokens changes this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens)

    @property
    def greedy(self) -> bool:
        # Dividing float32 logits by a temperature this small overflows to inf/NaN.
        return self.temperature < GREEDY_BELOW
