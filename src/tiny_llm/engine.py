"""The serving engine: requests in, one mixed forward per step, tokens out.

The engine composes the chapters from its configuration: a KV storage (Day 1's dense slots
or Day 3's page pool), the scheduler that goes with it (Day 1, Day 2 with chunked prefill,
Day 3 with pages), and an attention backend from ``ATTENTION_BACKENDS`` (Days 1, 3, 4, 5).
``LLMEngine.step`` is the whole serving loop, in four moves:

1. the scheduler picks this step's work: a decode token for each running request and
   prefill chunks for the rest of the token budget;
2. ``StepBatch.build`` lays the chunks out once as one flat batch — token ids, positions,
   where each sequence's rows start, block tables and slot mapping — with no padding;
3. one model forward runs it; logits are computed only at each sequence's last scheduled
   token, and only for sequences whose prompt is fully processed;
4. the sampler picks a token per such sequence; requests that hit a stop are retired and
   their slot is reused by the next step.

Reliability, as a user of a server expects it:

- A step is all-or-nothing. Everything that can fail (scheduling, the forward, sampling)
  happens before anything is recorded; if it raises — an error, or Ctrl-C — no request
  gains a token or loses text, seeded generators are rewound, and the next step
  continues from there (admissions and preemptions the scheduler made stand: they are
  valid states, and recomputed K/V is exact). The bookkeeping that follows cannot fail
  and holds back Ctrl-C until it is done.
- Outputs belong to requests. ``generate`` and ``stream`` read their own requests'
  queues; ``step`` returns the outputs of requests added with ``add_request``. Any number
  of streams, ``generate`` calls and step loops can interleave, from several threads: the
  engine serialises its calls with one lock (one step at a time). A request id is taken
  until its last output has been delivered. A stream dropped or closed before its end
  aborts its request and frees its pages.

``LLM`` is the offline front door in vLLM's shape: ``LLM().generate(prompts, params)``.
Engine options are keyword arguments; an unknown or mistyped option is an error.
"""

from __future__ import annotations

import itertools
import signal
import sys
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

from tiny_llm.cpu_kernels import check_int8_activations, kernel_forward
from tiny_llm.day1_batching import POLICIES, DenseAttention, DenseSlots, Scheduler
from tiny_llm.day2_chunked_prefill import ChunkedPrefillScheduler
from tiny_llm.day3_paged_kv import (
    MAX_POOL_FRACTION,
    GatherAttention,
    PagedKVSpace,
    PagedScheduler,
    kv_bytes_per_token,
    log_pool,
    pool_pages,
)
from tiny_llm.day4_paged_attention import PageWalkAttention, VectorKernelAttention
from tiny_llm.day5_paged_flash import FlashAttention, TiledWalkAttention
from tiny_llm.model import Model
from tiny_llm.request import Request, RequestOutput
from tiny_llm.sampling import SamplingParams, sample_next_tokens
from tiny_llm.speculative import (
    SPECULATIVE,
    NgramProposer,
    SpeculationPolicy,
    SpeculativeDecoding,
    SpeculativeScheduler,
    make_draft_proposer,
    rewind,
)
from tiny_llm.step import AttentionGeometry, ScheduledChunk, StepBatch
from tiny_llm.tokenizer import Tokenizer, check_text

import mlx.core as mx
import numpy as np
from jinja2.exceptions import TemplateError

KV_CACHES = ("dense", "paged")

# ANCHOR: attention_registry
ATTENTION_BACKENDS = {
    backend.name: backend
    for backend in (
        DenseAttention,  # Day 1: dense per-request caches
        GatherAttention,  # Day 3: pages, gathered back into dense K/V
        PageWalkAttention,  # Day 4: the page walk in MLX ops
        VectorKernelAttention,  # Day 4: the vector schedule (C++ / Metal)
        TiledWalkAttention,  # Day 5: the tiled walk in MLX ops
        FlashAttention,  # Day 5: vector decode rows + tiled multi-token queries (C++ / Metal)
    )
}
DEFAULT_ATTENTION = {"dense": "dense", "paged": "flash"}
# ANCHOR_END: attention_registry

Prompt = str | list[int] | dict[str, Any] | list[dict[str, str]]


CHAT_ROLES = ("system", "user", "assistant")


class ContextLengthError(ValueError):
    """A prompt that leaves no room to generate within ``max_model_len``."""


DEFAULT_MAX_NUM_SEQS = 32


# ANCHOR: engine_config
@dataclass
class EngineConfig:
    max_num_seqs: int | None = None  # requests at once (the "slots"); 32, or the budget if less
    max_num_batched_tokens: int = 512  # the token budget of one step
    max_model_len: int | None = None  # prompt + output; default: the model's context length
    scheduler: str = "continuous"  # or "static", the Day 1 baseline
    enable_chunked_prefill: bool = True  # Day 2; off: a prompt is prefilled in one step
    long_prefill_token_threshold: int | None = None  # Day 2: most tokens one prompt gets a step
    kv_cache: str = "paged"  # "dense": per-request caches (Days 1-2); "paged" (Day 3)
    page_size: int = 16  # tokens per KV page (paged)
    num_pages: int | None = None  # pool size in pages (paged) ...
    kv_memory_bytes: int | None = None  # ... or in bytes ...
    kv_memory_fraction: float | None = None  # ... or as a fraction of available memory
    enable_prefix_caching: bool = True  # reuse cached full pages of shared prompt prefixes
    attention: str | None = None  # a name in ATTENTION_BACKENDS; default: the storage's best
    speculative: str = "off"  # "draft" (a smaller model) or "ngram" (prompt lookup)
    num_speculative_tokens: int = 4  # tokens drafted per request and step
    speculative_max_batch: int = 16  # no drafts above this many running (tuned: see the book)
    draft_model: Any = None  # "draft": a path or hub id, or a (Model, Tokenizer) pair
    cpu_kernels: bool = True  # the extension's CPU matmuls, norms, RoPE, SwiGLU; False: MLX ops
    int8_activations: bool = False  # quantized layers' decode rows in int8 (the CPU kernels)
    fused_layers: bool = True  # decode steps' dense layers as one op (the CPU kernels)
# ANCHOR_END: engine_config

    def __post_init__(self) -> None:
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_seqs is None:  # as many as mlx-lm's batch_generate runs at once
            self.max_num_seqs = min(DEFAULT_MAX_NUM_SEQS, self.max_num_batched_tokens)
        for name in ("max_num_seqs", "page_size",
                     "num_speculative_tokens", "speculative_max_batch"):
            _check_int(name, getattr(self, name), 1)
        for name, least in (("max_model_len", 2), ("num_pages", 1), ("kv_memory_bytes", 1),
                            ("long_prefill_token_threshold", 1)):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), least)
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "cpu_kernels",
                     "int8_activations", "fused_layers"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.int8_activations and not self.cpu_kernels:
            raise ValueError("int8_activations is a mode of the CPU kernels: it needs "
                             "cpu_kernels=True")
        if self.int8_activations and self.speculative != "off":
            # Verification rows are not decode rows: they would keep float32 activations,
            # and a request's tokens would mix the two roundings.
            raise ValueError("int8_activations rounds decode rows only; speculative "
                             "decoding verifies drafts in rows of several tokens: choose one")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}), or running requests could not all decode"
            )
        _check_choice("scheduler", self.scheduler, POLICIES)
        _check_choice("kv_cache", self.kv_cache, KV_CACHES)
        fraction = self.kv_memory_fraction
        if fraction is not None and not (
            isinstance(fraction, int | float) and not isinstance(fraction, bool)
            and 0 < fraction <= MAX_POOL_FRACTION
        ):
            raise ValueError(
                f"kv_memory_fraction must be a number in (0, {MAX_POOL_FRACTION}], got {fraction!r}"
            )
        sizes = [n for n in ("num_pages", "kv_memory_bytes", "kv_memory_fraction")
                 if getattr(self, n) is not None]
        if len(sizes) > 1:
            raise ValueError(f"give at most one of num_pages, kv_memory_bytes and "
                             f"kv_memory_fraction, not {' and '.join(sizes)}")
        if sizes and self.kv_cache != "paged":
            raise ValueError(f"{sizes[0]} sizes the page pool: it needs kv_cache='paged'")
        if self.attention is None:
            self.attention = DEFAULT_ATTENTION[self.kv_cache]
        _check_choice("attention", self.attention, tuple(ATTENTION_BACKENDS))
        storage = ATTENTION_BACKENDS[self.attention].storage
        if storage != self.kv_cache:
            raise ValueError(f"attention={self.attention!r} reads {storage} K/V; it needs "
                             f"kv_cache={storage!r}, not {self.kv_cache!r}")
        _check_choice("speculative", self.speculative, SPECULATIVE)
        if self.speculative != "off" and self.kv_cache != "paged":
            raise ValueError("speculative decoding rewinds the paged cache: it needs "
                             "kv_cache='paged'")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("speculative='draft' and draft_model go together: give both or "
                             "neither")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {', '.join(unknown)}; "
                f"valid options: {', '.join(sorted(known))}"
            )
        return cls(**options)


def _check_int(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


# ANCHOR: engine
class LLMEngine:
    def __init__(self, model: Model, tokenizer: Tokenizer, **options: Any):
        self.config = cfg = EngineConfig.from_options(options)
        self.model, self.tokenizer = model, tokenizer
        context = model.config.max_position_embeddings
        if cfg.max_model_len is not None and cfg.max_model_len > context:
            raise ValueError(f"max_model_len ({cfg.max_model_len}) exceeds the model's context "
                             f"length ({context})")
        self.max_model_len = cfg.max_model_len or context
        paged = cfg.kv_cache == "paged"
        if paged and not cfg.enable_chunked_prefill and (
            cfg.max_num_batched_tokens < self.max_model_len
        ):
            # A preempted request recomputes prompt + output in one piece: it must fit.
            raise ValueError(
                f"with chunked prefill off and a paged cache, max_num_batched_tokens "
                f"({cfg.max_num_batched_tokens}) must be at least max_model_len "
                f"({self.max_model_len})"
            )
        if cfg.int8_activations:
            check_int8_activations(model)
        backend = ATTENTION_BACKENDS[cfg.attention]
        backend.check(AttentionGeometry.of(model.config, cfg.page_size if paged else None,
                                           model.dtype))  # before any memory is allocated
        self.kv = self._make_kv_space()
        self.attention = backend(self.kv)
        self.scheduler = self._make_scheduler()
        self.spec = self._make_speculation()
        self.requests: dict[str, Request] = {}  # ids taken: live or with undelivered outputs
        self._queues: dict[Request, deque[RequestOutput]] = {}  # outputs of generate/stream
        self._pending: list[RequestOutput] = []  # outputs of add_request'ed requests, for step()
        self._abandoned: deque[Request] = deque()  # requests of streams dropped unfinished
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self.counters = {"num_steps": 0, "num_prompt_tokens_computed": 0,
                         "num_generated_tokens": 0}

    def _make_kv_space(self) -> DenseSlots | PagedKVSpace:
        cfg, mcfg, dtype = self.config, self.model.config, self.model.dtype
        if cfg.kv_cache == "dense":
            return DenseSlots(cfg.max_num_seqs, mcfg.num_hidden_layers)
        pages = pool_pages(mcfg, dtype, cfg.page_size, self.max_model_len, cfg.max_num_seqs,
                           cfg.kv_memory_bytes, cfg.kv_memory_fraction, cfg.num_pages)
        log_pool(pages, cfg.page_size, kv_bytes_per_token(mcfg, dtype) * cfg.page_size,
                 self.max_model_len)
        return PagedKVSpace(mcfg, pages, cfg.page_size, cfg.enable_prefix_caching, dtype)

    def _make_scheduler(self) -> Scheduler:
        cfg = self.config
        args = (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.scheduler)
        chunking = dict(chunked=cfg.enable_chunked_prefill,
                        long_prefill_token_threshold=cfg.long_prefill_token_threshold)
        if cfg.speculative != "off":  # drafts become extra rows of a decode's chunk
            return SpeculativeScheduler(*args, kv=self.kv, **chunking)
        if cfg.kv_cache == "paged":  # Day 3
            return PagedScheduler(*args, kv=self.kv, **chunking)
        if cfg.enable_chunked_prefill:  # Day 2
            return ChunkedPrefillScheduler(*args, kv=self.kv, **chunking)
        return Scheduler(*args, kv=self.kv)  # Day 1

    def _make_speculation(self) -> SpeculativeDecoding | None:
        cfg = self.config
        if cfg.speculative == "off":
            return None
        if cfg.speculative == "ngram":
            proposer = NgramProposer()
        else:
            proposer = make_draft_proposer(self.model, self.tokenizer, cfg.draft_model,
                                           cfg.page_size, self.max_model_len, cfg.max_num_seqs,
                                           cfg.cpu_kernels, cfg.fused_layers)
        policy = SpeculationPolicy(cfg.num_speculative_tokens, cfg.speculative_max_batch)
        return SpeculativeDecoding(proposer, policy, self.model.config.vocab_size)

    @classmethod
    def from_pretrained(cls, model: str | None = None, *, dtype: str | mx.Dtype = "auto",
                        dequantize: bool | None = None, **options: Any) -> LLMEngine:
        """Load ``model`` (``loader.load``: ``dtype`` "auto" is float32 on the CPU and the
        checkpoint's own dtype on a GPU; ``dequantize=False`` keeps quantized weights as
        stored) and build an engine over it."""
        from tiny_llm.loader import load, parse_dtype

        parse_dtype(dtype)  # reject bad options before loading weights
        EngineConfig.from_options(options)
        return cls(*load(model, dtype=dtype, dequantize=dequantize), **options)

    # ------------------------------------------------------------ requests in

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request whose outputs ``step()`` returns. Raises ValueError/TypeError
        and changes nothing on bad input."""
        with self._lock:
            return self._add(prompt, params, request_id, collect=False).request_id

    def _add(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None,
             collect: bool) -> Request:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}"
                            + (" (use SamplingParams(**d))" if isinstance(params, dict) else ""))
        text, token_ids = self._tokenize(prompt)
        token_ids = self._check_prompt(token_ids)
        self._check_params(params, len(token_ids))
        self._reap_abandoned()
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self.requests:  # a caller may have used it explicitly
                request_id = str(next(self._ids))
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(token_ids, params, self.tokenizer.detokenizer(),
                          self.tokenizer.eos_token_ids, self.max_model_len, request_id, text)
        self.requests[request_id] = request
        if collect:
            self._queues[request] = deque()
        self.scheduler.add(request)
        return request

    def tokenize(self, prompt: Prompt) -> list[int]:
        """The token ids ``prompt`` would be served with (chat messages templated)."""
        return self._check_prompt(self._tokenize(prompt)[1])

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            check_text("the prompt", prompt)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if set(prompt) != {"prompt_token_ids"}:
                raise TypeError("a dict prompt is {'prompt_token_ids': [...]}, got keys "
                                f"{sorted(map(str, prompt))}")
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple):
                raise TypeError(
                    f"prompt_token_ids must be a list of ints, got {type(ids).__name__}"
                )
            return None, list(ids)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            for i, message in enumerate(prompt):
                for key in ("role", "content"):
                    if not isinstance(message.get(key), str):
                        raise TypeError(f"message {i} {key!r} must be a string, got "
                                        f"{type(message.get(key)).__name__}")
                if message["role"] not in CHAT_ROLES:  # a role is markup: never free text
                    raise ValueError(f"message {i} has role {message['role'][:40]!r}; a role "
                                     f"is one of {', '.join(CHAT_ROLES)}")
                for key, value in message.items():
                    if isinstance(value, str):
                        check_text(f"message {i} {key!r}", value)
            try:
                return None, self.tokenizer.encode_chat(prompt)
            except TemplateError as e:  # malformed messages, or the template refused them
                raise ValueError(f"the chat template cannot render these messages: {e}") from e
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        hint = " (decode bytes to str first)" if isinstance(prompt, bytes | bytearray) else ""
        raise TypeError(
            "a prompt is a string, a list of token ids, {'prompt_token_ids': [...]}, "
            f"or a list of chat messages; got {type(prompt).__name__}{hint}"
        )

    def _check_prompt(self, token_ids: list) -> list[int]:
        if not token_ids:
            raise ValueError("the prompt is empty")
        not_ints = [t for t in token_ids
                    if isinstance(t, bool) or not isinstance(t, int | np.integer)]
        if not_ints:
            raise TypeError(f"prompt token ids must be integers, got {not_ints[:5]}")
        token_ids = [int(t) for t in token_ids]
        vocab = self.model.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        if len(token_ids) >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "which leaves no room to generate"
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and len(token_ids) > budget:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
                f"({budget}), and chunked prefill is off"
            )
        return token_ids

    def _check_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        vocab = self.model.config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        # A request whose longest possible sequence exceeds the whole KV pool could never
        # finish, even alone: reject it now instead of letting it wait forever.
        capacity = self.kv.capacity_tokens
        longest = min(num_prompt_tokens + (params.max_tokens or self.max_model_len),
                      self.max_model_len)
        if capacity is not None and longest > capacity:
            raise ValueError(
                f"the request may need {longest} tokens of KV cache (prompt "
                f"{num_prompt_tokens} + max_tokens) but the whole pool holds {capacity}; "
                "lower max_tokens or enlarge the pool (num_pages, kv_memory_bytes)"
            )

    def abort(self, request_id: str) -> None:
        """Finish a running request with reason "abort" and free its slot and pages now."""
        with self._lock:
            request = self.requests.get(str(request_id))
            if request is None or request.is_finished:
                raise ValueError(f"unknown request id {request_id!r} (not running)")
            self._abort(request)

    def _abort(self, request: Request) -> None:
        delta = request.finish("abort")
        self._retire(request)
        self._route(request, request.output([], delta))

    def _retire(self, request: Request) -> None:
        self.scheduler.retire(request)
        if self.spec is not None:
            self.spec.proposer.release(request)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            self._reap_abandoned()
            return self.scheduler.has_unfinished() or bool(self._pending)
# ANCHOR_END: engine

    # --------------------------------------------------------------- one step

    # ANCHOR: step
    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of requests added with ``add_request`` (this
        step's, and any produced while ``generate``/``stream`` drove the engine)."""
        with self._lock:
            self._step()
            outputs, self._pending = self._pending, []
            for out in outputs:
                if out.finished:
                    self.requests.pop(out.request_id, None)
            return outputs

    def _step(self) -> None:
        self._reap_abandoned()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        chunks = self.scheduler.schedule()
        if not chunks:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler made no progress with requests waiting (a bug)")
            return
        batch = StepBatch.build(chunks, self.kv)
        self.attention.begin_step(batch)
        with kernel_forward(batch.decode_rows, enabled=self.config.cpu_kernels,
                            int8=self.config.int8_activations, fused=self.config.fused_layers):
            logits = self.model(batch.token_ids, batch.positions, self.attention,
                                batch.logit_rows)
        mx.eval(logits, self.attention.state())
        tokens = self._sample(logits, batch)
        with _interrupts_held():
            self._commit(batch, tokens)
    # ANCHOR_END: step

    def _sample(self, logits: mx.array, batch: StepBatch) -> list[list[int]]:
        """The tokens each sampling request emits (one, or with speculation the accepted
        drafts and one more); on failure, every generator is as it was."""
        requests = batch.sampling
        if not requests:
            return []
        states = [(r.sampler.rng, r.sampler.rng.bit_generator.state) for r in requests]
        try:
            rows = np.cumsum([0, *batch.num_logits])
            plain = [i for i, n in enumerate(batch.num_logits) if n == 1]
            tokens: list[list[int]] = [[] for _ in requests]
            if plain:  # one row each: the sampler takes them together
                picked = logits if len(plain) == len(requests) else logits[
                    mx.array([int(rows[i]) for i in plain])]
                drawn = sample_next_tokens(picked, [requests[i].sampler for i in plain])
                for i, token in zip(plain, drawn, strict=True):
                    tokens[i] = [token]
            for i, n in enumerate(batch.num_logits):
                if n > 1:  # drafts to verify: k + 1 rows
                    tokens[i] = self.spec.verify(requests[i], logits[rows[i] : rows[i] + n]).tokens
            return tokens
        except BaseException:
            for rng, state in states:
                rng.bit_generator.state = state
            raise

    def _commit(self, batch: StepBatch, tokens: list[list[int]]) -> None:
        """Record a successful step. Pure bookkeeping: nothing here may raise."""
        emitted = dict(zip(batch.sampling, tokens, strict=True))
        # A verified chunk computed K/V for its last token and the accepted drafts only.
        done = [ScheduledChunk(c.request, c.start, c.start + len(emitted[c.request]))
                if c.end > c.request.num_tokens else c for c in batch.chunks]
        self.scheduler.finish_step(done)
        for chunk in batch.chunks:
            prompt_len = len(chunk.request.prompt_token_ids)
            self.counters["num_prompt_tokens_computed"] += max(0, min(chunk.end, prompt_len)
                                                               - chunk.start)
            if chunk.end > chunk.request.num_tokens:  # drafts rejected: rewind the pages
                rewind(self.kv, chunk.request, chunk.request.num_computed_tokens)
        for request, new_tokens in emitted.items():
            request.spec_token_ids = []
            appended, delta = [], ""
            for token in new_tokens:
                appended.append(token)
                delta += request.append_token(token)
                if request.is_finished:
                    break
            if self.spec is not None and not request.is_finished:
                self.spec.proposer.rewind(request)
            if request.is_finished:
                self._retire(request)
            self._route(request, request.output(appended, delta))
            self.counters["num_generated_tokens"] += len(appended)
        self.counters["num_steps"] += 1

    def _route(self, request: Request, output: RequestOutput) -> None:
        queue = self._queues.get(request)
        if queue is not None:
            queue.append(output)
        else:
            self._pending.append(output)

    def _take(self, request: Request) -> RequestOutput | None:
        """The next output of a generate/stream request, if any (releasing its id after
        the last one)."""
        queue = self._queues[request]
        if not queue:
            return None
        out = queue.popleft()
        if out.finished:
            self._release(request)
        return out

    def _release(self, request: Request) -> None:
        self._queues.pop(request, None)
        if self.requests.get(request.request_id) is request:
            del self.requests[request.request_id]

    def _reap_abandoned(self) -> None:
        """Abort the requests of streams that were dropped before their end."""
        while self._abandoned:
            request = self._abandoned.popleft()
            if not request.is_finished:
                self._abort(request)
            self._release(request)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                **self.counters,
                "num_preemptions": getattr(self.scheduler, "num_preemptions", 0),
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "kv_cache_bytes": self.kv.nbytes(),
                **self.kv.stats(),
                **(self.spec.stats() if self.spec is not None else {}),
            }

    # ----------------------------------------------------------- outputs out

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order. All or nothing: a bad
        prompt adds none of them; an interrupt aborts the ones still running."""
        prompts = [prompts] if _is_single_prompt(prompts) else list(prompts)
        if isinstance(sampling_params, dict):
            raise TypeError("sampling_params must be a SamplingParams or a list of them, got "
                            "dict (use SamplingParams(**d))")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        requests: list[Request] = []
        with self._lock:
            try:
                for p, sp in zip(prompts, params, strict=True):
                    requests.append(self._add(p, sp, None, collect=True))
            except (ValueError, TypeError):
                self._drop(requests)
                raise
        final: dict[Request, RequestOutput] = {}
        bar = _progress(len(requests), use_tqdm)
        try:
            while len(final) < len(requests):
                with self._lock:
                    for request in requests:
                        while request not in final and (out := self._take(request)):
                            if out.finished:
                                final[request] = out
                                bar.update(1) if bar else None
                    if len(final) < len(requests):
                        self._step()
        finally:
            if bar:
                bar.close()
            with self._lock:
                self._drop([r for r in requests if r not in final])
        return [final[r] for r in requests]

    def _drop(self, requests: list[Request]) -> None:
        """Abort and forget requests whose owner is gone (their outputs go nowhere)."""
        for request in requests:
            if not request.is_finished:
                self._retire(request)
                request.finish("abort")
            self._release(request)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestStream:
        """An iterator over one request's outputs as they are produced. Bad input raises
        here, before any iteration; closing or dropping the iterator aborts the request."""
        with self._lock:
            return RequestStream(self, self._add(prompt, params, None, collect=True))


class RequestStream:
    """One request's outputs, in order. Iterating drives the engine when none is ready."""

    def __init__(self, engine: LLMEngine, request: Request):
        self.engine, self.request = engine, request
        self.request_id = request.request_id
        self._done = False
        # Dropped unfinished: hand the request to the engine to abort at its next call
        # (a finalizer may run in any thread, so it only appends).
        self._finalizer = weakref.finalize(self, engine._abandoned.append, request)

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestOutput:
        if self._done:
            raise StopIteration
        engine = self.engine
        while True:
            with engine._lock:
                out = engine._take(self.request)
                if out is None:
                    engine._step()
                    continue
            if out.finished:
                self._done = True
                self._finalizer.detach()
            return out

    def close(self) -> None:
        """Stop reading: abort the request if it is still running."""
        if not self._done:
            self._done = True
            self._finalizer.detach()
            with self.engine._lock:
                self.engine._drop([self.request])

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def _interrupts_held():
    """Hold Ctrl-C (SIGINT) until the block is done, then deliver it (main thread only:
    signal handlers can only be set there, and only it receives KeyboardInterrupt)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received and previous != signal.SIG_IGN:
            if callable(previous):
                previous(signal.SIGINT, None)
            else:  # SIG_DFL, or a handler installed from C
                raise KeyboardInterrupt


def _is_single_prompt(prompts: Any) -> bool:
    if isinstance(prompts, str | dict | bytes | bytearray):  # bytes: refused as one prompt
        return True
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return True
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], dict) and (
        "role" in prompts[0]
    )


def _progress(total: int, enabled: bool):
    if not enabled or total < 2:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", file=sys.stderr, leave=False)


class LLM:
    """vLLM-style offline API: ``LLM(model=None, **engine_options).generate(prompts, params)``."""

    def __init__(self, model: str | None = None, **engine_options: Any):
        self.engine = LLMEngine.from_pretrained(model, **engine_options)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        return self.engine.generate(prompts, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; rendered with the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.engine.generate(list(conversations), sampling_params, use_tqdm)

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    @property
    def config(self) -> dict[str, Any]:
        return {f.name: getattr(self.engine.config, f.name) for f in fields(EngineConfig)}
