"""The engine's front doors: ``LLMEngine`` (add, step, generate, stream, abort, stats) and
``LLM``, the offline API in vLLM's shape: ``LLM().generate(prompts, params)``.

``LLMEngine`` composes the chapters from its configuration: a KV storage (Day 1's dense
slots or Day 3's page pool), the scheduler that goes with it (Day 1, Day 2 with chunked
prefill, Day 3 with pages, speculation's on top), and an attention backend from
``ATTENTION_BACKENDS`` (Days 1, 3, 4, 5), run by a ``ModelRunner`` inside an
``EngineCore``. Engine options are keyword arguments; an unknown or mistyped option is an
error.

Outputs belong to requests. ``generate`` and ``stream`` read their own requests' outputs;
``step`` returns the outputs of requests added with ``add_request``. Any number of streams,
``generate`` calls and step loops can interleave, from several threads: the engine
serialises its calls with one lock (one step at a time). A stream dropped or closed before
its end aborts its request and frees its pages.
"""

from __future__ import annotations

import atexit
import functools
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import fields, replace
from typing import Any

from tiny_llm.day1_batching import DenseKVStorage, Scheduler
from tiny_llm.day2_chunked_prefill import ChunkedPrefillScheduler
from tiny_llm.day3_paged_kv import PagedKVStorage, PagedScheduler
from tiny_llm.day5_paged_flash import FlashAttention
from tiny_llm.distributed.ring import join
from tiny_llm.distributed.workers import Workers, serve_as_worker
from tiny_llm.engine.config import ATTENTION_BACKENDS, EngineConfig
from tiny_llm.engine.core import EngineCore, EngineLoad, EngineStats
from tiny_llm.engine.inputs import InputProcessor, Prompt
from tiny_llm.engine.outputs import OutputRouter, RequestStream
from tiny_llm.engine.pool_size import check_worker_pool, kv_bytes_per_token, log_pool, pool_pages
from tiny_llm.engine.runner import KernelSettings, ModelRunner, ShardedModelRunner
from tiny_llm.kernels.cpu_kernels import check_int8_activations
from tiny_llm.models.model import Model
from tiny_llm.models.tokenizer import Tokenizer
from tiny_llm.sampling.params import SamplingParams
from tiny_llm.speculative import (
    DraftModelProposer,
    NgramProposer,
    SpeculationPolicy,
    SpeculativeDecoding,
)
from tiny_llm.step.batch import AttentionBackend, AttentionGeometry
from tiny_llm.step.request import Request, RequestOutput
from tiny_llm.tensor_parallel import shard_model

import mlx.core as mx


# ANCHOR: engine
class LLMEngine:
    def __init__(self, model: Model, tokenizer: Tokenizer, **options: Any):
        self.config = cfg = EngineConfig.from_options(options)
        self.tokenizer = tokenizer
        self.max_model_len = _max_model_len(cfg, model)
        if cfg.int8_activations:
            check_int8_activations(model)
        workers = _tensor_parallel(cfg, model)  # a worker rank serves there and never returns
        backend = ATTENTION_BACKENDS[cfg.attention]
        page_size = cfg.page_size if cfg.kv_cache == "paged" else None
        trees = not cfg.speculative_token_tree.is_chain  # drafts that branch
        backend.check(AttentionGeometry.of(model.config, page_size, model.dtype, trees))  # before
        self.kv = _kv_storage(cfg, model, self.max_model_len)  # ... any memory is allocated
        self.scheduler = _scheduler(cfg, self.kv)
        # A fused decode op runs whole layers: it has no place for the all-reduces.
        kernels = KernelSettings(cfg.cpu_kernels, cfg.int8_activations,
                                 cfg.fused_layers and workers is None)
        if workers is None:
            self.runner = ModelRunner(model, self.kv, backend(self.kv), kernels,
                                      logprobs_mode=cfg.logprobs_mode)
        else:
            workers.start({"num_pages": self.kv.blocks.num_blocks, "page_size": cfg.page_size,
                           "attention": cfg.attention, "cpu_kernels": kernels.cpu_kernels,
                           "int8_activations": kernels.int8_activations})
            atexit.register(workers.stop)
            self.runner = ShardedModelRunner(model, self.kv, backend(self.kv), kernels, workers,
                                             cfg.logprobs_mode)
        self.outputs = OutputRouter()
        self.core = EngineCore(self.scheduler, self.runner,
                               _speculation(cfg, model, tokenizer, self.max_model_len, self.kv),
                               self.outputs, cfg.kv_cache == "paged" and cfg.enable_prefix_caching)
        self.inputs = InputProcessor(tokenizer, model.config.vocab_size, cfg,
                                     self.max_model_len, self.kv.capacity_tokens)
        self._lock = threading.RLock()

    @classmethod
    def from_pretrained(cls, model: str | None = None, *, dtype: str | mx.Dtype = "auto",
                        dequantize: bool | None = None, **options: Any) -> LLMEngine:
        """Load ``model`` (``loader.load``: ``dtype`` "auto" is float32 on the CPU and the
        checkpoint's own dtype on a GPU; ``dequantize=False`` keeps quantized weights as
        stored) and build an engine over it."""
        from tiny_llm.models.loader import load, parse_dtype

        parse_dtype(dtype)  # reject bad options before loading weights
        cfg = EngineConfig.from_options(options)
        shard = None
        if cfg.tensor_parallel_size > 1:  # each rank keeps its share only
            shard = functools.partial(shard_model, group=join(cfg.tensor_parallel_size).group)
        return cls(*load(model, dtype=dtype, dequantize=dequantize, shard=shard), **options)

    @property
    def model(self) -> Model:
        return self.runner.model

    @property
    def attention(self) -> AttentionBackend:
        return self.runner.attention

    @property
    def requests(self) -> dict[str, Request]:
        """Requests by id: live ones and finished ones with outputs not yet delivered."""
        return self.outputs.requests

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request whose outputs ``step()`` returns. Raises ValueError/TypeError
        and changes nothing on bad input."""
        params = _one_sample(params)
        self.compile_grammar(params)
        with self._lock:
            return self._add(params, prompt, request_id, collect=False).request_id

    def add_samples(self, prompt: Prompt, params: SamplingParams,
                    request_id: str | None = None) -> list[str]:
        """Queue ``params.n`` samples of one prompt, whose outputs ``step()`` returns: ids
        ``request_id-0`` .. ``-(n-1)``. The first computes the prompt; the others then
        share its pages. All or nothing on bad input."""
        self.compile_grammar(params)
        with self._lock:
            base = self.outputs.new_id(request_id)
            return [r.request_id for r in self._add_samples(prompt, params, base, False)]

    def compile_grammar(self, params: SamplingParams | None) -> None:
        """Compile a structured output's grammar (GrammarError if it is not one) without the
        engine's lock (the steps go on meanwhile): an add of a request with the same output
        then takes a copy of the compiled matcher. Safe from any thread."""
        if isinstance(params, SamplingParams) and params.structured is not None:
            self.inputs.grammars.constraint(params.structured)

    def _add_samples(self, prompt: Prompt, params: SamplingParams, base: str,
                     collect: bool) -> list[Request]:
        if not isinstance(params, SamplingParams) or params.n == 1:  # make_request checks it
            return [self._add(params, prompt, base, collect)]
        samples: list[Request] = []
        try:
            for i in range(params.n):
                first = samples[0] if samples else None
                what = prompt if first is None else {"prompt_token_ids": first.prompt_token_ids}
                samples.append(self._add(params.for_sample(i), what, f"{base}-{i}", collect,
                                         after=first))
        except (ValueError, TypeError):
            self.core.drop(samples)
            raise
        for r in samples[1:]:  # the prompt's text, not the ids the others were given
            r.prompt = samples[0].prompt
        return samples

    def _add(self, params: SamplingParams | None, prompt: Prompt, request_id: str | None,
             collect: bool, after: Request | None = None) -> Request:
        self.core.reap_abandoned()
        request = self.inputs.make_request(prompt, params, self.outputs.new_id(request_id))
        self.outputs.register(request, collect)
        self.core.add(request, after)
        return request

    def tokenize(self, prompt: Prompt, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The token ids ``prompt`` would be served with (chat messages templated, with the
        ``tools`` offered: ``tool_calls``)."""
        return self.inputs.tokenize(prompt, tools)

    def abort(self, request_id: str) -> None:
        """Finish a running request with reason "abort" and free its slot and pages now."""
        with self._lock:
            request = self.outputs.requests.get(str(request_id))
            if request is None or request.is_finished:
                raise ValueError(f"unknown request id {request_id!r} (not running)")
            self.core.abort(request)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of requests added with ``add_request`` (this
        step's, and any produced while ``generate``/``stream`` drove the engine)."""
        with self._lock:
            self.core.step()
            return self.outputs.take_pending()

    def stats(self) -> EngineStats:
        with self._lock:
            return self.core.stats()

    def current_load(self) -> EngineLoad:
        """Requests running and waiting, and the pages in use (for a server's admission)."""
        with self._lock:
            return self.core.current_load()
# ANCHOR_END: engine

    # ----------------------------------------------------------- outputs out

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order, ``n`` completions each
        where the params ask for several. All or nothing: a bad prompt adds none of them;
        an interrupt aborts the ones still running."""
        prompts = _prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        requests: list[Request] = []
        groups: list[int] = []  # samples per prompt
        with self._lock:
            try:
                for p, sp in zip(prompts, params, strict=True):
                    sp = SamplingParams() if sp is None else sp
                    samples = self._add_samples(p, sp, self.outputs.new_id(None), True)
                    requests += samples
                    groups.append(len(samples))
            except (ValueError, TypeError):
                self.core.drop(requests)
                raise
        final: dict[Request, RequestOutput] = {}
        bar = _progress(len(requests), use_tqdm)
        try:
            while len(final) < len(requests):
                with self._lock:
                    for request in requests:
                        while request not in final and (out := self.outputs.take(request)):
                            if out.finished:
                                final[request] = out
                                bar.update(1) if bar else None
                    if len(final) < len(requests):
                        self.core.step()
        finally:
            if bar:
                bar.close()
            self.drop([r for r in requests if r not in final])
        outs, start = [], 0
        for size in groups:
            outs.append(_merged([final[r] for r in requests[start:start + size]]))
            start += size
        return outs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestStream:
        """An iterator over one request's outputs as they are produced. Bad input raises
        here, before any iteration; closing or dropping the iterator aborts the request."""
        with self._lock:
            return RequestStream(self, self._add(_one_sample(params), prompt, None,
                                                 collect=True))

    def next_output(self, request: Request) -> RequestOutput:
        """The next output of a ``stream``'s request, stepping the engine until there is one."""
        while True:
            with self._lock:
                out = self.outputs.take(request)
                if out is not None:
                    return out
                self.core.step()

    def drop(self, requests: list[Request]) -> None:
        """Abort and forget ``generate``/``stream`` requests whose reader is gone."""
        with self._lock:
            self.core.drop(requests)


def _max_model_len(cfg: EngineConfig, model: Model) -> int:
    context = model.config.max_position_embeddings
    if cfg.max_model_len is not None and cfg.max_model_len > context:
        raise ValueError(f"max_model_len ({cfg.max_model_len}) exceeds the model's context "
                         f"length ({context})")
    max_model_len = cfg.max_model_len or context
    if cfg.kv_cache == "paged" and not cfg.enable_chunked_prefill and (
        cfg.max_num_batched_tokens < max_model_len
    ):
        # A preempted request recomputes prompt + output in one piece: it must fit.
        raise ValueError(
            f"with chunked prefill off and a paged cache, max_num_batched_tokens "
            f"({cfg.max_num_batched_tokens}) must be at least max_model_len ({max_model_len})"
        )
    return max_model_len


def _tensor_parallel(cfg: EngineConfig, model: Model) -> Workers | None:
    """Rank 0's workers when the model is split over ranks (sharding it here if it is still
    whole); on any other rank, serve rank 0's steps until it ends, then exit."""
    group = model.tensor_parallel
    if cfg.tensor_parallel_size == 1:
        if group is not None:
            raise ValueError(f"this model is sharded over {group.size()} ranks: pass "
                             f"tensor_parallel_size={group.size()}")
        return None
    ranks = join(cfg.tensor_parallel_size)
    if group is None:
        shard_model(model, ranks.group)
    if ranks.rank != 0:
        serve_as_worker(ranks, lambda setup: _worker_runner(model, setup))
    return Workers(ranks, cfg.tensor_parallel_timeout)


def _worker_runner(model: Model, setup: dict[str, Any]) -> ModelRunner:
    """A worker's runner, as rank 0 built its own: the same pages, backend and kernels."""
    backend = ATTENTION_BACKENDS[setup["attention"]]
    backend.check(AttentionGeometry.of(model.config, setup["page_size"], model.dtype))
    check_worker_pool(setup["num_pages"],
                      kv_bytes_per_token(model.config, model.dtype) * setup["page_size"])
    kv = PagedKVStorage(model.config, setup["num_pages"], setup["page_size"], False, model.dtype)
    kernels = KernelSettings(setup["cpu_kernels"], setup["int8_activations"], False)
    return ModelRunner(model, kv, backend(kv), kernels)


def _kv_storage(cfg: EngineConfig, model: Model, max_model_len: int
                ) -> DenseKVStorage | PagedKVStorage:
    mcfg, dtype = model.config, model.dtype
    if cfg.kv_cache == "dense":
        return DenseKVStorage(cfg.max_num_seqs, mcfg.num_hidden_layers)
    pages = pool_pages(mcfg, dtype, cfg.page_size, max_model_len, cfg.max_num_seqs,
                       cfg.kv_memory_bytes, cfg.kv_memory_fraction, cfg.num_pages)
    log_pool(pages, cfg.page_size, kv_bytes_per_token(mcfg, dtype) * cfg.page_size,
             max_model_len)
    return PagedKVStorage(mcfg, pages, cfg.page_size, cfg.enable_prefix_caching, dtype)


def _scheduler(cfg: EngineConfig, kv: DenseKVStorage | PagedKVStorage) -> Scheduler:
    args = (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.scheduler)
    chunking = dict(chunked=cfg.enable_chunked_prefill,
                    long_prefill_token_threshold=cfg.long_prefill_token_threshold)
    if cfg.kv_cache == "paged":  # Day 3 (and speculation, whose drafts need pages)
        return PagedScheduler(*args, kv=kv, **chunking)
    if cfg.enable_chunked_prefill:  # Day 2
        return ChunkedPrefillScheduler(*args, kv=kv, **chunking)
    return Scheduler(*args, kv=kv)  # Day 1


def _speculation(cfg: EngineConfig, model: Model, tokenizer: Tokenizer, max_model_len: int,
                 tables: PagedKVStorage) -> SpeculativeDecoding | None:
    if cfg.speculative == "off":
        return None
    if cfg.speculative == "ngram":
        proposer = NgramProposer()
    else:  # the draft model, run as the target is: its own runner over its own pool
        from tiny_llm.models.loader import load_draft_model

        draft = load_draft_model(model, tokenizer, cfg.draft_model)
        pages = pool_pages(draft.config, draft.dtype, cfg.page_size, max_model_len,
                           cfg.max_num_seqs)
        FlashAttention.check(AttentionGeometry.of(
            draft.config, cfg.page_size, draft.dtype,
            token_trees=not cfg.speculative_token_tree.is_chain))
        kv = PagedKVStorage(draft.config, pages, cfg.page_size, False, draft.dtype)
        kernels = KernelSettings(cfg.cpu_kernels, False, cfg.fused_layers)
        proposer = DraftModelProposer(ModelRunner(draft, kv, FlashAttention(kv), kernels,
                                                  scores_prompts=False))
    policy = SpeculationPolicy(cfg.speculative_token_tree, cfg.speculative_max_batch)
    return SpeculativeDecoding(proposer, policy, model.config.vocab_size, tables,
                               cfg.max_num_batched_tokens)


def _one_sample(params: SamplingParams | None) -> SamplingParams | None:
    if isinstance(params, SamplingParams) and params.n > 1:  # other types: make_request says
        raise ValueError(f"n={params.n}: one request streams one sample; generate() and "
                         "add_samples() serve several")
    return params


def _merged(outs: list[RequestOutput]) -> RequestOutput:
    """The samples of one prompt as one output: its completions indexed 0 .. n-1."""
    if len(outs) == 1:
        return outs[0]
    first = outs[0]
    completions = [replace(o.outputs[0], index=i) for i, o in enumerate(outs)]
    return RequestOutput(first.request_id.rsplit("-", 1)[0], first.prompt,
                         first.prompt_token_ids, completions, True,
                         num_cached_tokens=first.num_cached_tokens,
                         prompt_logprobs=first.prompt_logprobs)


def _params_per_prompt(sampling_params: Any, n: int) -> list[SamplingParams | None]:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if isinstance(sampling_params, dict) or not isinstance(sampling_params, Iterable):
        hint = " (use SamplingParams(**d))" if isinstance(sampling_params, dict) else ""
        raise TypeError("sampling_params must be a SamplingParams or a list of them, got "
                        f"{type(sampling_params).__name__}{hint}")
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params


def _prompt_list(prompts: Any) -> list[Any]:
    """What ``generate`` was given, as a list of prompts (each checked when it is added)."""
    if _is_single_prompt(prompts):
        return [prompts]
    if not isinstance(prompts, Iterable):
        raise TypeError("generate takes a prompt or a list of prompts (a prompt is a string, a "
                        "list of token ids, {'prompt_token_ids': [...]} or a list of chat "
                        f"messages), got {type(prompts).__name__}")
    return list(prompts)


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
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; rendered with the chat template
        and the ``tools`` offered (``tool_calls.parse`` reads the calls out of a text)."""
        if not isinstance(messages, list | tuple) or not all(
                isinstance(m, dict | list | tuple) for m in messages):
            raise TypeError("chat takes a conversation (a list of messages, each a dict with a "
                            "role and content) or a list of conversations, got "
                            f"{type(messages).__name__}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [c if tools is None else {"prompt_token_ids": self.engine.tokenize(c, tools)}
                   for c in conversations]
        return self.engine.generate(prompts, sampling_params, use_tqdm)

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def config(self) -> dict[str, Any]:
        return {f.name: getattr(self.engine.config, f.name) for f in fields(EngineConfig)}
