"""The serving engine: requests in, one mixed forward per step, tokens out.

``LLMEngine.step`` is the whole serving loop, in four moves:

1. the scheduler picks this step's work: a decode token for each running request and
   prefill chunks for the rest of the token budget (``day1_batching``, ``day2_chunked_prefill``);
2. the chunks are laid out as one flat batch — token ids, positions, and where each
   sequence's rows start — with no padding;
3. one model forward runs it; logits are computed only at each sequence's last scheduled
   token, and only for sequences whose prompt is fully processed;
4. the sampler picks a token per such sequence; requests that hit a stop are retired and
   their slot is reused by the next step.

``LLM`` is the offline front door in vLLM's shape: ``LLM().generate(prompts, params)``.
Engine options are keyword arguments; an unknown option is an error, never ignored.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from tiny_llm.day1_batching import POLICIES, ScheduledChunk, Scheduler, UnboundedKV
from tiny_llm.day3_paged_kv import PagedKVSpace, kv_bytes_per_token, log_pool, pool_pages
from tiny_llm.day4_paged_attention import check_geometry
from tiny_llm.extension import extension
from tiny_llm.kv_cache import DenseBatchKV, DenseKVCache
from tiny_llm.model import Model
from tiny_llm.request import Request, RequestOutput
from tiny_llm.sampling import SamplingParams, sample_next_tokens
from tiny_llm.tokenizer import Tokenizer

import mlx.core as mx
import numpy as np
from jinja2.exceptions import TemplateError

KV_CACHES = ("dense", "paged")
ATTENTIONS = ("gather", "reference", "kernel")

Prompt = str | list[int] | dict[str, Any] | list[dict[str, str]]


# ANCHOR: engine_config
@dataclass
class EngineConfig:
    max_num_seqs: int = 16  # requests that may run at once (the "slots")
    max_num_batched_tokens: int = 512  # the token budget of one step
    max_model_len: int | None = None  # prompt + output; default: the model's context length
    scheduler: str = "continuous"  # or "static", the Day 1 baseline
    enable_chunked_prefill: bool = True  # Day 2; off: a prompt is prefilled in one step
    kv_cache: str = "paged"  # "dense": per-request caches (Days 1-2); "paged" (Day 3)
    page_size: int = 16  # tokens per KV page (paged)
    kv_memory_bytes: float | None = None  # pool budget: bytes, or a fraction of RAM if <= 1
    num_pages: int | None = None  # explicit pool size; overrides kv_memory_bytes
    enable_prefix_caching: bool = True  # reuse cached full pages of shared prompt prefixes
    attention: str = "kernel"  # paged: "gather" (Day 3), "reference" or "kernel" (Days 4-5)
# ANCHOR_END: engine_config

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}), or running requests could not all decode"
            )
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.scheduler not in POLICIES:
            raise ValueError(f"scheduler must be one of {POLICIES}, got {self.scheduler!r}")
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {self.kv_cache!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        for name in ("page_size", "num_pages"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.kv_memory_bytes is not None and not self.kv_memory_bytes > 0:
            raise ValueError(f"kv_memory_bytes must be positive, got {self.kv_memory_bytes!r}")

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


# ANCHOR: dense_slots
class DenseSlots(UnboundedKV):
    """Days 1-2 KV storage: ``max_num_seqs`` dense caches, one per slot, reused in turn
    (no page limit: ``begin`` and ``commit`` have nothing to do)."""

    def __init__(self, num_slots: int, num_layers: int):
        self.caches = [DenseKVCache(num_layers) for _ in range(num_slots)]
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.slot_of: dict[Request, int] = {}

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        if request not in self.slot_of:
            self.slot_of[request] = self.free_slots.pop()
        return True

    def free(self, request: Request) -> None:
        slot = self.slot_of.pop(request, None)
        if slot is not None:
            self.caches[slot].reset()
            self.free_slots.append(slot)

    def batch(self, chunks: list[ScheduledChunk], query_start_loc: list[int]) -> DenseBatchKV:
        return DenseBatchKV([self.caches[self.slot_of[c.request]] for c in chunks], query_start_loc)

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.caches)
# ANCHOR_END: dense_slots


# ANCHOR: engine
class LLMEngine:
    def __init__(self, model: Model, tokenizer: Tokenizer, **options: Any):
        self.config = EngineConfig.from_options(options)
        self.model = model
        self.tokenizer = tokenizer
        cfg = self.config
        self.max_model_len = cfg.max_model_len or model.config.max_position_embeddings
        if cfg.kv_cache == "paged" and not cfg.enable_chunked_prefill and (
            cfg.max_num_batched_tokens < self.max_model_len
        ):
            # A preempted request recomputes prompt + output in one piece: it must fit.
            raise ValueError(
                f"with chunked prefill off and a paged cache, max_num_batched_tokens "
                f"({cfg.max_num_batched_tokens}) must be at least max_model_len "
                f"({self.max_model_len})"
            )
        self.kv = self._make_kv_space()
        self.scheduler = Scheduler(
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            cfg.scheduler,
            cfg.enable_chunked_prefill,
            self.kv,
        )
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []  # outputs of aborts, delivered by step()
        self._ids = itertools.count()
        self.counters = {"num_steps": 0, "num_prompt_tokens_computed": 0, "num_generated_tokens": 0}

    def _make_kv_space(self) -> DenseSlots | PagedKVSpace:
        cfg, mcfg = self.config, self.model.config
        if cfg.kv_cache == "dense":
            return DenseSlots(cfg.max_num_seqs, mcfg.num_hidden_layers)
        dtype = self.model.dtype
        pages = pool_pages(mcfg, dtype, cfg.page_size, cfg.kv_memory_bytes, cfg.num_pages,
                           self.max_model_len, cfg.max_num_seqs)
        page_bytes = kv_bytes_per_token(mcfg, dtype) * cfg.page_size
        log_pool(pages, cfg.page_size, page_bytes, self.max_model_len)
        if cfg.attention != "gather":
            check_geometry(mcfg.num_attention_heads, mcfg.num_key_value_heads, mcfg.head_dim,
                           cfg.page_size, dtype, mx.default_device())
        if cfg.attention == "kernel":
            extension()  # fail now, with the build command, rather than mid-step
        return PagedKVSpace(mcfg, pages, cfg.page_size, cfg.enable_prefix_caching, dtype,
                            cfg.attention)

    @classmethod
    def from_pretrained(cls, model: str | None = None, **options: Any) -> LLMEngine:
        from tiny_llm.loader import load

        return cls(*load(model), **options)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError/TypeError and changes nothing on
        bad input."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids)
        token_ids = [int(t) for t in token_ids]
        self._check_fits(len(token_ids), params)
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self.requests:  # a caller may have used it explicitly
                request_id = str(next(self._ids))
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(
            token_ids,
            params,
            self.tokenizer.detokenizer(),
            self.tokenizer.eos_token_ids,
            self.max_model_len,
            request_id,
            text,
        )
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt) and prompt:
            try:
                return None, self.tokenizer.encode_chat(prompt)
            except TemplateError as e:  # malformed messages, or the template refused them
                raise ValueError(f"the chat template cannot render these messages: {e}") from e
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise TypeError(
            "a prompt is a string, a list of token ids, {'prompt_token_ids': [...]}, "
            f"or a list of chat messages; got {type(prompt).__name__}"
        )

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        not_ints = [
            t for t in token_ids if isinstance(t, bool) or not isinstance(t, int | np.integer)
        ]
        if not_ints:
            raise TypeError(f"prompt token ids must be integers, got {not_ints[:5]}")
        vocab = self.model.config.vocab_size
        bad = [int(t) for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "which leaves no room to generate"
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and len(token_ids) > budget:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
                f"({budget}), and chunked prefill is off"
            )

    def _check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """A request whose longest possible sequence exceeds the whole KV pool could never
        finish, even alone: reject it now instead of letting it wait forever."""
        if not isinstance(self.kv, PagedKVSpace):
            return
        longest = min(num_prompt_tokens + (params.max_tokens or self.max_model_len),
                      self.max_model_len)
        pool_tokens = self.kv.blocks.num_blocks * self.kv.page_size
        if longest > pool_tokens:
            raise ValueError(
                f"the request may need {longest} tokens of KV cache (prompt "
                f"{num_prompt_tokens} + max_tokens) but the whole pool holds {pool_tokens}; "
                "lower max_tokens or raise kv_memory_bytes/num_pages"
            )

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(str(request_id), None)
        if request is None:
            raise ValueError(f"unknown request id {request_id!r}")
        delta = request.finish("abort")
        self.scheduler.retire(request)
        self._pending.append(request.output([], delta))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        chunks = self.scheduler.schedule()
        if chunks:
            sampling, logits = self._forward(chunks)
        elif self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler made no progress with requests waiting (a bug)")
        # Outputs of aborts leave only once the forward succeeded: an error keeps them.
        outputs, self._pending = self._pending, []
        if not chunks:
            return outputs
        self.scheduler.finish_step(chunks)
        tokens = sample_next_tokens(logits, [r.sampler for r in sampling]) if sampling else []
        for request, token in zip(sampling, tokens, strict=True):
            delta = request.append_token(token)
            outputs.append(request.output([token], delta))
            if request.is_finished:
                self.scheduler.retire(request)
                del self.requests[request.request_id]
        self.counters["num_steps"] += 1
        self.counters["num_generated_tokens"] += len(tokens)
        return outputs
# ANCHOR_END: engine

    # ANCHOR: forward
    def _forward(self, chunks: list[ScheduledChunk]) -> tuple[list[Request], mx.array]:
        """Lay the chunks out as one flat batch and run the model once."""
        token_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        logit_rows: list[int] = []
        sampling: list[Request] = []
        for chunk in chunks:
            req = chunk.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + chunk.num_tokens
            token_ids += req.token_ids_between(start, end)
            positions += range(start, end)
            query_start_loc.append(query_start_loc[-1] + chunk.num_tokens)
            if end == req.num_tokens:  # the chunk reaches the end: sample the next token
                logit_rows.append(query_start_loc[-1] - 1)
                sampling.append(req)
            if start < len(req.prompt_token_ids):
                prompt_end = min(end, len(req.prompt_token_ids))
                self.counters["num_prompt_tokens_computed"] += prompt_end - start
        kv = self.kv.batch(chunks, query_start_loc)
        logits = self.model(
            mx.array(token_ids, dtype=mx.int32),
            mx.array(positions, dtype=mx.int32),
            kv,
            mx.array(logit_rows, dtype=mx.int32),
        )
        mx.eval(logits, kv.state())
        return sampling, logits
    # ANCHOR_END: forward

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_bytes": self.kv.nbytes(),
            **(self.kv.stats() if isinstance(self.kv, PagedKVSpace) else {}),
        }

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order."""
        prompts = [prompts] if _is_single_prompt(prompts) else list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} sampling params for {len(prompts)} prompts"
                )
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params, strict=True):
                ids.append(self.add_request(p, sp))
        except (ValueError, TypeError):
            for request_id in ids:  # all or nothing: a bad prompt leaves no request behind
                self.abort(request_id)
            self._pending = [o for o in self._pending if o.request_id not in ids]
            raise
        final: dict[str, RequestOutput] = {}
        others: list[RequestOutput] = []  # outputs of requests added elsewhere: kept for step()
        bar = _progress(len(ids), use_tqdm)
        wanted = set(ids)
        while len(final) < len(ids):
            for out in self.step():
                if out.request_id not in wanted:
                    others.append(out)
                elif out.finished:
                    final[out.request_id] = out
                    bar.update(1) if bar else None
        if bar:
            bar.close()
        self._pending = others + self._pending
        return [final[i] for i in ids]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield one request's outputs as they are produced. Bad input raises here, before
        any iteration; closing the iterator (for example on Ctrl-C in a chat) aborts the
        request."""
        return self._stream(self.add_request(prompt, params))

    def _stream(self, request_id: str) -> Iterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                for out in self.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished and request_id in self.requests:
                self.abort(request_id)
                self._pending = [o for o in self._pending if o.request_id != request_id]


def _is_single_prompt(prompts: Any) -> bool:
    if isinstance(prompts, str | dict):
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
        EngineConfig.from_options(engine_options)  # reject bad options before loading weights
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
        return asdict(self.engine.config)
