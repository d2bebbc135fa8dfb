"""A request's life: its tokens, how far its K/V has been computed, and when it stops.

Invariants:

- ``num_computed_tokens`` counts the tokens whose K/V are stored in the cache; the tokens
  still to feed the model are ``all_token_ids[num_computed_tokens:]``. A fresh request needs
  its whole prompt; a decoding one needs exactly its last sampled token. Preemption simply
  resets it to 0 (the K/V is recomputed later).
- Output text is released only when it can no longer become part of a stop string, so a
  stop string that spans several tokens never leaks into the stream; the stop string
  itself is never part of the output.
- Every finished request has a ``finish_reason``: ``stop`` (EOS, a stop token id or a stop
  string), ``length`` (``max_tokens`` or ``max_model_len``) or ``abort``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

from tiny_llm.models.tokenizer import IncrementalDetokenizer
from tiny_llm.sampling.params import SamplingParams
from tiny_llm.sampling.sampler import RequestSampler, TokenHistory, TokenLogprob
from tiny_llm.structured import Constraint


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SequenceState:
    """A sequence as the schedulers, the KV storage and the step batch read and move it: the
    base of the engine's ``Request`` and of Day 1's model-free ``SimRequest``."""

    def __init__(self, prompt_token_ids: list[int]):
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V is stored (only the scheduler moves it)
        self.num_preemptions = 0
        self.num_cached_tokens: int | None = None  # a prefix-cache hit at its first admission

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_reusable_tokens(self) -> int:
        """Tokens whose cached K/V it may take from the prefix cache instead of computing."""
        return self.num_tokens

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """``(prompt + output)[start:end]`` without building the whole list."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - n)]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, if the params ask for them


@dataclass
class RequestOutput:
    """What a request produced so far (vLLM's shape), plus what is new since last step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_token_ids: list[int] = field(default_factory=list)
    text_delta: str = ""
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams(prompt_logprobs=k): None for the first prompt token, then each
    # one's record in the model's own distribution (its logits, no temperature), as vLLM's
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


_ids = itertools.count()


# ANCHOR: request
class Request(SequenceState):
    def __init__(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        eos_token_ids: set[int],
        max_model_len: int,
        request_id: str | None = None,
        prompt: str | None = None,
        constraint: Constraint | None = None,
    ):
        super().__init__(prompt_token_ids)
        self.request_id = request_id if request_id is not None else f"req-{next(_ids)}"
        self.prompt = prompt
        self.params = params
        self.detokenizer = detokenizer
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_token_ids = set(params.stop_token_ids or ())
        self.max_model_len = max_model_len
        self.sampler = RequestSampler(params, TokenHistory(
            self.prompt_token_ids, self.output_token_ids, self.eos_token_ids | self.stop_token_ids),
            constraint)
        self.finish_reason: str | None = None
        # With params.prompt_logprobs: a record for each prompt token after the first, in
        # the model's own distribution at the position before it (scored while prefilling)
        self.prompt_logprobs: list[TokenLogprob] = []
        self._text = ""  # detokenized output, stop strings not yet ruled out at its end
        self._released = 0  # chars of _text already handed to the caller
        self._max_stop_len = max((len(s) for s in params.stop or ()), default=0)
        self._stops_end_after = 0  # a stop string counts if it ends past this (min_tokens)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def scored_prompt_positions(self, start: int, end: int) -> range:
        """The positions in ``start .. end - 1`` whose logits score the next prompt token
        and have not yet (none without ``prompt_logprobs``)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        scored, last = len(self.prompt_logprobs), len(self.prompt_token_ids) - 1
        if scored < last and start > scored:  # a position would never be scored
            raise RuntimeError(f"request {self.request_id} scores its prompt but was given "
                               f"cached K/V past the tokens it has scored (a bug)")
        return range(max(start, scored), min(end, last))

    @property
    def num_reusable_tokens(self) -> int:
        """Tokens whose cached K/V this request may take instead of computing them: all
        of them, but only those already scored when it asks for its prompt's logprobs
        (a cached page's tokens would have no logits)."""
        scored = len(self.prompt_logprobs)
        if self.params.prompt_logprobs is None or scored >= len(self.prompt_token_ids) - 1:
            return self.num_tokens
        return scored

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def output_text(self) -> str:
        return self._text[: self._released]

    def append_token(self, token: int) -> str:
        """Record a sampled token, check every stop condition, return newly released text."""
        self.output_token_ids.append(token)
        if token in self.eos_token_ids or token in self.stop_token_ids:
            return self.finish("stop")
        self._text += self.detokenizer.add(token)
        if not self._past_min_tokens():
            self._stops_end_after = len(self._text)
        elif self._max_stop_len and self._truncate_at_stop_string():
            return self.finish("stop", flush=False)
        max_tokens = self.params.max_tokens
        if max_tokens is not None and len(self.output_token_ids) >= max_tokens:
            return self.finish("length")
        if self.num_tokens >= self.max_model_len:
            return self.finish("length")
        # Hold back the tail that could still be the start of a stop string.
        return self._release(len(self._text) - max(0, self._max_stop_len - 1))

    def append_tokens(self, tokens: list[int]) -> RequestOutput:
        """Record a step's tokens in order (a verification's accepted drafts and the one
        after them), up to the one that finishes the request; its output for the step."""
        appended, delta = [], ""
        for token in tokens:
            appended.append(token)
            delta += self.append_token(token)
            if self.status is RequestStatus.FINISHED:
                break
        return self.output(appended, delta)

    def finish(self, reason: str, flush: bool = True) -> str:
        """Mark finished; returns the text that was still held back."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        if flush:
            self._text += self.detokenizer.flush()
            # The flushed tail (bytes held back mid-character) may complete a stop string.
            # (cut on an abort too, whose reason stays: a stop string is never output text)
            if (self._max_stop_len and self._past_min_tokens()
                    and self._truncate_at_stop_string() and reason != "abort"):
                self.finish_reason = "stop"
        return self._release(len(self._text))

    def _past_min_tokens(self) -> bool:
        # As the end tokens are masked for the first min_tokens tokens, a stop string ends
        # the output only in a later token (one that starts earlier and ends there counts).
        return len(self.output_token_ids) > self.params.min_tokens

    def _truncate_at_stop_string(self) -> bool:
        # Released text is followed by at least max_stop_len - 1 held-back chars that were
        # already searched, so a new match can only start at or after the release point;
        # and it must end past the text of the first min_tokens tokens.
        def start(stop: str) -> int:
            return max(self._released, self._stops_end_after + 1 - len(stop))

        hits = [i for s in self.params.stop for i in [self._text.find(s, start(s))] if i >= 0]
        if not hits:
            return False
        self._text = self._text[: min(hits)]
        return True

    def _release(self, upto: int) -> str:
        upto = max(self._released, min(upto, len(self._text)))
        delta = self._text[self._released : upto]
        self._released = upto
        return delta

    def output(self, new_token_ids: list[int], text_delta: str) -> RequestOutput:
        completion = CompletionOutput(
            0, self.output_text, list(self.output_token_ids), self.finish_reason,
            None if self.params.logprobs is None else list(self.sampler.logprobs))
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [completion],
            self.is_finished,
            new_token_ids,
            text_delta,
            self.num_cached_tokens or 0,
            None if self.params.prompt_logprobs is None else [None, *self.prompt_logprobs],
        )
# ANCHOR_END: request
