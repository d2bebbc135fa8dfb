"""An OpenAI-compatible HTTP server on the engine: ``tiny-llm serve``.

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed as
server-sent events or not), ``GET /v1/models`` and ``/v1/models/{id}``, ``GET /health`` and
``GET /metrics`` (Prometheus text). Starlette routes, uvicorn serves, sse-starlette streams.

One thread drives the engine (``EngineLoop``): it calls ``engine.step()`` while requests
are unfinished and sleeps otherwise. HTTP handlers run on the event loop and never hold
the engine's lock, nor do work that grows with a request's size there: reading the body
stops at ``max_body_bytes``, and parsing it, templating and tokenizing, and adding a request
happen in worker threads (an add waits at most one step for the lock); a structured
output's grammar is compiled before the add, in threads of its own. Each request's
outputs reach its handler through its own ``asyncio.Queue``. A request joins the running
batch at the next step. A client that disconnects has its request aborted: the handler
posts the id to the engine thread without waiting (a cancelled handler cannot lose it),
which aborts it before its next step and frees its pages.

Shutdown (SIGTERM or SIGINT) is bounded: new requests get 503 at once (the server listens
until the requests in flight have ended; ``/health`` answers 503 too), the ones in flight
run for up to ``shutdown_timeout`` seconds, then end with an error (an error event and
``[DONE]`` on a stream); a second signal ends them at once.

With ``api_key`` every ``/v1`` route needs ``Authorization: Bearer <key>`` (401 otherwise),
and with ``key_for_all`` ``/health`` and ``/metrics`` too.

Errors have OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``): 400 for
invalid parameters (the engine's own checks, with their messages; ``param`` names the
field), 400 with code ``context_length_exceeded`` when prompt + max_tokens exceed
``max_model_len``, 401 without the key, 404 for another model's name or an unknown route,
405 for a method a route does not take, 408 for a body that does not arrive within
``body_timeout`` seconds, 413 for a body over ``max_body_bytes``, 503 when ``max_waiting``
requests already wait or the server is shutting down. A connection whose request has not
shown its headers within ``header_timeout`` seconds is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import os
import queue
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tiny_llm.engine import CHAT_ROLES, ContextLengthError, LLMEngine
from tiny_llm.models.tokenizer import IncrementalDetokenizer, check_text, strings_in
from tiny_llm.sampling import tool_calls
from tiny_llm.sampling.sampler import (
    MAX_LOGPROBS,
    MAX_SAMPLES,
    InvalidParam,
    SamplingParams,
    TokenLogprob,
)
from tiny_llm.sampling.tool_calls import JsonToolCallParser, ToolCall, ToolCallParser, ToolChoice
from tiny_llm.step.request import RequestOutput
from tiny_llm.structured import KINDS, GrammarError, StructuredOutput
from tiny_llm.tensor_parallel import TensorParallelError

log = logging.getLogger("tiny_llm")

# Latency buckets (seconds) for TTFT, inter-token and per-token histograms.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # a 128k-token prompt as token ids is about 1 MB
DEFAULT_SHUTDOWN_TIMEOUT = 10.0  # seconds in-flight requests get after the first signal
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds a request's headers may take to arrive
DEFAULT_BODY_TIMEOUT = 60.0  # seconds its body may take (4 MiB at about 0.5 Mbit/s)
API_KEY_ENV = "TINY_LLM_API_KEY"
GRAMMAR_THREADS = 2  # grammars compiled at once; more wait for a thread, other requests do not


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


# ANCHOR: engine_loop
class EngineLoop:
    """Drives ``engine.step()`` in its own thread; hands outputs to per-request queues."""

    def __init__(self, engine: LLMEngine, max_waiting: int | None = None):
        self.engine, self.max_waiting = engine, max_waiting
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.num_aborted = 0  # requests whose client went away before their end
        self._admit = threading.Lock()  # the waiting-count check and the add, as one
        self._aborts: queue.SimpleQueue[tuple[str, bool]] = queue.SimpleQueue()
        self._failure: Exception | None = None  # set: end every request with it
        self._closed: Exception | None = None  # set: refuse every request with it
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiny-llm-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def add(self, prompt: Any, params: SamplingParams, loop: asyncio.AbstractEventLoop
            ) -> tuple[str, list[tuple[str, asyncio.Queue]]]:
        """Add a request (from a worker thread): its id, and the id and output queue of
        each of its ``params.n`` samples, registered before the engine can produce an
        output. Raises APIError 503 when ``max_waiting`` requests wait (checked and added
        as one, so a burst cannot all pass the check), and the engine's ValueError/TypeError."""
        request_id = f"req-{uuid.uuid4().hex}"
        ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        samples = [(i, asyncio.Queue()) for i in ids]
        with self._admit:
            if self._closed is not None:
                raise self._closed
            if self.max_waiting is not None and \
                    len(self.engine.scheduler.waiting) >= self.max_waiting:
                raise APIError(503, f"the server is overloaded ({self.max_waiting} requests "
                               "waiting); retry later", kind="server_overloaded")
            for i, outputs in samples:
                self.queues[i] = (loop, outputs)
            try:
                if params.n == 1:
                    self.engine.add_request(prompt, params, request_id=request_id)
                else:
                    self.engine.add_samples(prompt, params, request_id)
            except BaseException:
                for i in ids:
                    del self.queues[i]
                raise
        if self._closed is not None:  # closed while this add waited: not served either
            for i in ids:
                self.abort(i, client_left=False)
            raise self._closed
        self._wake.set()
        return request_id, samples

    def abort(self, request_id: str, client_left: bool = True) -> None:
        """Abort a request whose client went away (or whose answer is complete), from any
        thread or coroutine, without waiting: the engine thread aborts it before its next
        step (a no-op if it finished meanwhile)."""
        self._aborts.put((request_id, client_left))
        self._wake.set()

    def fail_all(self, error: Exception) -> None:
        """End every request in flight with ``error`` (from any thread, without waiting),
        before the next step, and refuse later ones with it."""
        self._closed = self._failure = error
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._take_aborts()
            if self._failure is not None:
                self._fail_all(self._failure)
                self._failure = None
            if not self.engine.has_unfinished_requests():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except TensorParallelError as e:  # a rank is gone: no later step can run
                log.error("%s: the server stops", e)
                self._closed = APIError(503, str(e), kind="engine_failed")
                self._fail_all(self._closed)
                os.kill(os.getpid(), signal.SIGTERM)  # the bounded shutdown ends the process
                return
            except Exception as e:  # the step changed nothing; end its requests, go on
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outputs:
                self._deliver(out.request_id, out, out.finished)

    def _take_aborts(self) -> None:
        while True:
            try:
                request_id, client_left = self._aborts.get_nowait()
            except queue.Empty:
                return
            try:
                self.engine.abort(request_id)
            except ValueError:  # it finished meanwhile
                continue
            self.num_aborted += client_left

    def _deliver(self, request_id: str, item: RequestOutput | Exception, last: bool) -> None:
        entry = self.queues.pop(request_id, None) if last else self.queues.get(request_id)
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _fail_all(self, error: Exception) -> None:
        """Abort every request (their abort outputs, returned by the next step, find no
        queue) and hand each handler the error instead."""
        for request_id in list(self.queues):
            try:
                self.engine.abort(request_id)
            except ValueError:
                pass
            self._deliver(request_id, error, last=True)
# ANCHOR_END: engine_loop


# ANCHOR: metrics
class Metrics:
    """Latency histograms observed by the handlers, plus the engine's gauges and counters
    read at scrape time (``collect``)."""

    def __init__(self, engine: LLMEngine, aborted):
        from prometheus_client import CollectorRegistry, Histogram

        self.engine, self.aborted = engine, aborted
        self.registry = CollectorRegistry()

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=BUCKETS, registry=self.registry)

        self.ttft = histogram("tiny_llm_time_to_first_token_seconds",
                              "From arrival to the first output token")
        self.itl = histogram("tiny_llm_inter_token_latency_seconds",
                             "Between consecutive output tokens of a request")
        self.tpot = histogram("tiny_llm_time_per_output_token_seconds",
                              "A finished request's decode time per token after the first")
        self.e2e = histogram("tiny_llm_e2e_request_latency_seconds",
                             "From arrival to the last output")
        self.registry.register(self)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.engine.stats()
        yield GaugeMetricFamily("tiny_llm_num_requests_running", "Requests running",
                                value=stats["num_running"])
        yield GaugeMetricFamily("tiny_llm_num_requests_waiting", "Requests waiting",
                                value=stats["num_waiting"])
        yield CounterMetricFamily("tiny_llm_num_preemptions", "Requests preempted",
                                  value=stats["num_preemptions"])
        yield CounterMetricFamily("tiny_llm_num_aborted_requests",
                                  "Requests aborted because their client went away",
                                  value=self.aborted())
        yield CounterMetricFamily("tiny_llm_generation_tokens", "Output tokens",
                                  value=stats["num_generated_tokens"])
        yield CounterMetricFamily("tiny_llm_prompt_tokens_computed", "Prompt tokens computed",
                                  value=stats["num_prompt_tokens_computed"])
        if "num_pages" in stats:
            yield GaugeMetricFamily("tiny_llm_kv_pages_in_use", "KV pages held",
                                    value=stats["num_pages"] - stats["num_free_pages"])
            yield GaugeMetricFamily("tiny_llm_kv_pages_total", "KV pages in the pool",
                                    value=stats["num_pages"])
            queried = stats["prefix_cache_query_tokens"]
            yield GaugeMetricFamily(
                "tiny_llm_prefix_cache_hit_rate", "Prompt tokens served from cached pages, "
                "as a share of the prompt tokens looked up",
                value=stats["prefix_cache_hit_tokens"] / queried if queried else 0.0)


@dataclass
class Timeline:
    """When a request arrived and produced tokens (for the latency histograms)."""

    arrival: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    tokens: int = 0

    def tokens_out(self, metrics: Metrics, n: int) -> None:
        if n == 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            metrics.ttft.observe(now - self.arrival)
        else:
            metrics.itl.observe((now - self.last) / n)
        self.last, self.tokens = now, self.tokens + n

    def done(self, metrics: Metrics) -> None:
        end = time.perf_counter()
        metrics.e2e.observe(end - self.arrival)
        if self.first is not None and self.tokens > 1:
            metrics.tpot.observe((self.last - self.first) / (self.tokens - 1))
# ANCHOR_END: metrics


# ANCHOR: parse
class ToolUse(NamedTuple):
    """What a chat request's tools ask of it."""

    tools: list[dict[str, Any]] | None  # offered in the prompt (none under tool_choice none)
    parse: bool  # whether the output is read for calls
    grammar: StructuredOutput | None  # a required or named call's, else the response format
    max_calls: int | None  # 1 without parallel calls under auto: the output ends there
    calls_only: bool = False  # required or named: the grammar writes nothing but calls


@dataclass
class ParsedRequest:
    prompt: Any  # text, token ids or chat messages: what engine.add_request takes
    params: SamplingParams
    stream: bool
    include_usage: bool
    tool_use: ToolUse = ToolUse(None, False, None, None)  # what its tools ask of it
    grammar_param: str | None = None  # the field the output's grammar came from


# ANCHOR: request_fields
# The request fields, as this server treats them: every one is honoured, accepted only in
# a value that asks for nothing (the OpenAI client and others send such defaults), or
# refused with a 400 naming it. No field is ignored while it asks for something.
# OpenAI's, then vLLM's beyond them.
SAMPLING_FIELDS = ("temperature", "top_p", "seed", "stop", "presence_penalty",
                   "frequency_penalty", "logit_bias", "top_k", "min_p", "stop_token_ids",
                   "ignore_eos", "repetition_penalty", "min_tokens", "skip_special_tokens")
HONOURED = {
    "chat": {"model", "n", "max_tokens", "max_completion_tokens", "stream", "stream_options",
             "messages", "logprobs", "top_logprobs", "response_format", "structured_outputs",
             "tools", "tool_choice", "parallel_tool_calls", *SAMPLING_FIELDS},
    "completions": {"model", "n", "max_tokens", "max_completion_tokens", "stream",
                    "stream_options", "prompt", "logprobs", "response_format",
                    "structured_outputs", *SAMPLING_FIELDS},
}
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions' logprobs
NO_EFFECT = {"user"}  # an end user's id, for the caller's own bookkeeping
# Not supported (yet), so accepted only in a value that asks for nothing.
NEUTRAL_CHAT: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"), "store": (None, False), "metadata": (None, {}),
    "modalities": (None, ["text"]), "service_tier": (None, "auto", "default"),
    "prediction": (None,), "audio": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,),
}
NEUTRAL_COMPLETIONS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
}


def asks_nothing(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of the ``neutral`` ones (0 and 0.0 alike, not False)."""
    def same(a: Any, b: Any) -> bool:
        if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
            return a is b
        return a == b and (isinstance(a, (int, float)) == isinstance(b, (int, float)))

    return any(same(value, v) for v in neutral)


def check_fields(body: dict, chat: bool) -> None:
    """Refuse a field this endpoint does not know, or one that asks for what this server
    does not do, naming it."""
    endpoint = "chat" if chat else "completions"
    neutral = NEUTRAL_CHAT if chat else NEUTRAL_COMPLETIONS
    for name, value in body.items():
        if name in HONOURED[endpoint] or name in NO_EFFECT:
            continue
        if name not in neutral:
            raise APIError(400, f"unknown field {name!r} for /v1/{endpoint}"
                           f"{'/completions' if chat else ''}", param=name)
        if not asks_nothing(value, neutral[name]):
            raise APIError(400, f"{name} is not supported by this server, and is refused "
                           "rather than ignored: leave it out", param=name,
                           code="unsupported_field")
# ANCHOR_END: request_fields


def parse_request(body: Any, chat: bool, model_name: str,
                  tool_format: str | None = "hermes") -> ParsedRequest:
    """The request, checked; ``tool_format``: how the model writes tool calls
    (``tool_calls.format_of``; None: in no format this server reads)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_fields(body, chat)
    if body.get("model") not in (None, model_name):
        raise APIError(404, f"the model {body['model']!r} does not exist; this server serves "
                       f"{model_name!r}", param="model", code="model_not_found")
    n = 1 if body.get("n") is None else body["n"]  # null means the default, as in OpenAI's
    if type(n) is not int or not 1 <= n <= MAX_SAMPLES:
        raise APIError(400, f"n must be an integer in [1, {MAX_SAMPLES}]", param="n")
    prompt = chat_messages(body) if chat else completion_prompt(body)
    options = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:  # absent or null: the older name, then the default
        max_tokens = body.get("max_tokens")
    if max_tokens is None and not chat:
        max_tokens = 16  # OpenAI's default for completions
    fmt = structured_output(body)
    use = tool_use(body, tool_format, fmt) if chat else ToolUse(None, False, fmt, None)
    if use.parse:  # a format's tags may be special tokens (Llama's <|python_tag|>): kept
        options.setdefault("skip_special_tokens", False)
    structured = use.grammar
    grammar_param = "tools" if structured is not fmt else next(
        (name for name in ("structured_outputs", "response_format") if body.get(name)), None)
    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=requested_logprobs(body, chat),
                                structured=structured, n=n, **options)
    except InvalidParam as e:
        raise APIError(400, str(e), param=param_of(e, body)) from None
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e)) from None
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise APIError(400, "user must be a string", param="user")
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise APIError(400, "stream must be a boolean", param="stream")
    return ParsedRequest(prompt, params, stream, include_usage(body, stream), use, grammar_param)


def param_of(error: InvalidParam, body: dict) -> str:
    """The request field an engine's ``InvalidParam`` names: ``max_tokens`` is
    ``max_completion_tokens`` where the request gave that one."""
    if error.field == "max_tokens" and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return error.field


def include_usage(body: dict, stream: bool) -> bool:
    """``stream_options.include_usage``: a boolean (null: false), asked for only where the
    request is streamed."""
    options = body.get("stream_options")
    if options is None:
        return False
    wanted = options.get("include_usage") if isinstance(options, dict) else None
    if not isinstance(options, dict) or not set(options) <= {"include_usage"} or (
            wanted is not None and not isinstance(wanted, bool)):
        raise APIError(400, "stream_options must be an object whose only field is "
                       "include_usage, a boolean", param="stream_options")
    if wanted and not stream:
        raise APIError(400, "stream_options.include_usage needs stream: true",
                       param="stream_options")
    return bool(wanted)


# ANCHOR: offered_tools
def offered_tools(body: dict) -> tuple[list[dict[str, Any]] | None, ToolChoice, bool]:
    """The tools a chat request offers (checked), its tool choice and whether several calls
    may come at once."""
    tools = body.get("tools")
    try:
        tools = tool_calls.check_tools(tools) if tools else None
        for text in strings_in(tools):
            check_text("tools", text)
    except ValueError as e:
        raise APIError(400, str(e), param="tools") from None
    try:
        choice = tool_calls.chosen(body.get("tool_choice"), tools or [])
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    parallel = body.get("parallel_tool_calls")
    if parallel not in (None, True, False):
        raise APIError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    return tools, choice, parallel is not False


def tool_use(body: dict, tool_format: str | None, fmt: StructuredOutput | None) -> ToolUse:
    """What a chat request's tools ask of it, ``fmt`` its response format."""
    tools, choice, parallel = offered_tools(body)
    if choice.mode == "none":
        return ToolUse(None, False, fmt, None)
    if tool_format is None:
        raise APIError(400, "this model's chat template teaches a tool-call format this server "
                       "does not read (Hermes <tool_call> blocks or Llama's JSON object)",
                       param="tools")
    grammar = tool_calls.constraint(tools, choice, parallel, tool_format)
    if choice.mode != "auto" and fmt is not None:
        raise APIError(400, "a required or named tool_choice constrains the output to "
                       "tool calls; it cannot also follow a response format",
                       param="tool_choice")
    if choice.mode != "auto":
        return ToolUse(tools, True, grammar, None, calls_only=True)
    # auto: a strict tool's grammar, unless a response format is asked for (then a strict
    # tool's calls are checked as they are read)
    return ToolUse(tools, True, fmt or grammar, None if parallel else 1)
# ANCHOR_END: offered_tools


# ANCHOR: response_format
def structured_output(body: dict) -> StructuredOutput | None:
    """The grammar a request's output must match: OpenAI's ``response_format``
    (``json_schema``, ``json_object``; ``text`` asks for none) or vLLM's
    ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``)."""
    fmt, vllm = body.get("response_format"), body.get("structured_outputs")
    if isinstance(fmt, dict) and fmt.get("type") == "text":
        fmt = None  # asks for nothing
    if fmt is not None and vllm is not None:
        raise APIError(400, "give response_format or structured_outputs, not both",
                       param="structured_outputs")
    if vllm is not None:
        if not isinstance(vllm, dict):
            raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
        given = {k: v for k, v in vllm.items() if v is not None}  # clients send nulls
        unknown = sorted(set(given) - set(KINDS))
        if unknown:
            raise APIError(400, f"structured_outputs takes one of {', '.join(KINDS)}; this "
                           f"server does not do {', '.join(unknown)}", param="structured_outputs")
        try:
            return StructuredOutput(**given)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"structured_outputs: {e}", param="structured_outputs") from None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError(400, "response_format json_schema needs a json_schema object with a "
                           "'schema'", param="response_format")
        return StructuredOutput(json=spec["schema"])  # strict or not, the schema is enforced
    raise APIError(400, "response_format's type must be text, json_object or json_schema",
                   param="response_format")
# ANCHOR_END: response_format


def requested_logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's logprob record lists (None: no records): chat's
    ``logprobs`` (a bool) and ``top_logprobs``, or completions' ``logprobs`` (a count)."""
    if not chat:
        k = body.get("logprobs")
        if k is not None and (type(k) is not int or not 0 <= k <= MAX_COMPLETION_LOGPROBS):
            raise APIError(400, f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]",
                           param="logprobs")
        return k
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise APIError(400, "logprobs must be a boolean", param="logprobs")
    if top is not None and (type(top) is not int or not 0 <= top <= MAX_LOGPROBS):
        raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]",
                       param="top_logprobs")
    if top and not wanted:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


def chat_messages(body: dict) -> list[dict[str, Any]]:
    """The conversation in the engine's shape (``chat_message``)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    return [chat_message(i, m) for i, m in enumerate(messages)]


def chat_message(i: int, m: Any) -> dict[str, Any]:
    """Message ``i``: role and content, a participant's ``name`` (the template reads it, as
    ``transformers`` passes it), an assistant turn's ``tool_calls`` and a tool result's
    ``tool_call_id``."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise APIError(400, "each message needs a role and a content", param="messages")
    role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name
    if role not in CHAT_ROLES:
        raise APIError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)} "
                       "(or developer)", param="messages")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise APIError(400, "only text content parts, each with a string 'text', are "
                           "supported", param="messages")
        content = "".join(p["text"] for p in content)
    message = {"role": role, "content": content}
    if role == "assistant" and m.get("tool_calls"):
        message["tool_calls"] = m["tool_calls"]  # checked with the conversation
    elif not isinstance(content, str):
        raise APIError(400, "message content must be a string", param="messages")
    return message | message_ids(i, m, role)


def message_ids(i: int, m: dict, role: str) -> dict[str, str]:
    """Message ``i``'s ``name`` and, for a tool result, its ``tool_call_id``: strings
    (null: none), a name as OpenAI's rule has it (letters, digits, _ and -)."""
    ids = {}
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            raise APIError(400, f"messages[{i}].name must be a string of letters, digits, _ "
                           "or -", param="messages")
        ids["name"] = name
    call_id = m.get("tool_call_id")
    if role == "tool" and call_id is not None:
        if not isinstance(call_id, str):
            raise APIError(400, f"messages[{i}].tool_call_id must be a string",
                           param="messages")
        ids["tool_call_id"] = call_id
    return ids


def completion_prompt(body: dict) -> Any:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return {"prompt_token_ids": prompt}
    raise APIError(400, "prompt must be a string or a list of token ids (one prompt)",
                   param="prompt")


def prompt_param(prompt: Any) -> str:
    """The field a parsed prompt came from."""
    return "messages" if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) \
        else "prompt"


def check_context_length(engine: LLMEngine, prompt: Any, params: SamplingParams,
                         tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt's token ids (templated with the tools offered, and tokenized: call it off
    the event loop); raise when prompt + max_tokens exceed ``max_model_len``."""
    param = prompt_param(prompt)
    limit = engine.max_model_len
    try:
        ids = engine.tokenize(prompt, tools)
    except ContextLengthError as e:
        raise APIError(400, f"This model's maximum context length is {limit} tokens: {e}.",
                       param=param, code="context_length_exceeded") from None
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param=param) from None
    except RecursionError:  # the body parsed, but its messages or tools nest too deeply
        raise APIError(400, "the messages or tools nest too deeply", param=param) from None
    asked = len(ids) + (params.max_tokens or 0)
    if asked > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, "
                       f"you requested {asked} tokens ({len(ids)} in the prompt, "
                       f"{params.max_tokens or 0} for the completion).",
                       param=param, code="context_length_exceeded")
    return ids
# ANCHOR_END: parse


# ANCHOR: handlers
class Server:
    """The HTTP side: parses requests, feeds the engine loop, shapes OpenAI responses."""

    def __init__(self, engine: LLMEngine, model_name: str, max_waiting: int | None = None,
                 *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, api_key: str | None = None,
                 key_for_all: bool = False, header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT):
        check_options(max_waiting, max_body_bytes, api_key, key_for_all,
                      header_timeout=header_timeout, body_timeout=body_timeout)
        self.engine, self.model_name = engine, model_name
        self.max_body_bytes, self.api_key, self.key_for_all = max_body_bytes, api_key, key_for_all
        self.header_timeout, self.body_timeout = header_timeout, body_timeout
        self.loop = EngineLoop(engine, max_waiting)
        self.compiler = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="tiny-llm-grammar")
        self.metrics = Metrics(engine, lambda: self.loop.num_aborted)
        self.created = int(time.time())
        self.shutting_down = False
        tokenizer = engine.tokenizer
        self.tool_format = tool_calls.format_of(tokenizer.chat_template,
                                                tokenizer.template_reads_tools)

    def begin_shutdown(self, timeout: float) -> None:
        """Refuse new requests; end the ones in flight with an error after ``timeout``
        seconds (at once for 0)."""
        self.shutting_down = True
        error = APIError(503, "the server is shutting down", kind="server_shutting_down")
        if timeout <= 0:
            self.loop.fail_all(error)
            return
        timer = threading.Timer(timeout, self.loop.fail_all, args=(error,))
        timer.daemon = True
        timer.start()

    def authorized(self, request) -> bool:
        if self.api_key is None:
            return True
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self.api_key.encode())

    async def read_body(self, request) -> Any:
        """The JSON body, read up to ``max_body_bytes`` (413 past it) within
        ``body_timeout`` seconds (408 past it) and parsed off the event loop (400 if it is
        not JSON, or nests too deeply to parse)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise body_too_large(self.max_body_bytes)
        try:
            data = await asyncio.wait_for(self.receive_body(request), self.body_timeout)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.body_timeout:g} "
                           "s (--body-timeout)", code="request_timeout") from None
        try:
            return await asyncio.to_thread(json.loads, data)
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None
        except RecursionError:
            raise APIError(400, "the request body nests too deeply") from None

    async def receive_body(self, request) -> bytes:
        """The body's bytes as they arrive, up to ``max_body_bytes`` (413 past it)."""
        from starlette.requests import ClientDisconnect

        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise body_too_large(self.max_body_bytes)
                chunks.append(chunk)
        except ClientDisconnect:
            raise APIError(499, "the client closed the request") from None
        return b"".join(chunks)

    async def submit(self, body: Any, chat: bool) -> tuple[ParsedRequest, str, list, int]:
        """The parsed request, its id, each sample's (id, queue, timeline), the prompt's
        length."""
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", kind="server_shutting_down")
        parsed = parse_request(body, chat, self.model_name, self.tool_format)
        # Templating and tokenizing take time that grows with the prompt: a worker thread.
        ids = await asyncio.to_thread(check_context_length, self.engine, parsed.prompt,
                                      parsed.params, parsed.tool_use.tools)
        num_prompt = len(ids)
        await self.compile_grammar(parsed)
        try:
            # the ids, not the prompt: the engine need not template and tokenize it again
            request_id, queues = await asyncio.to_thread(
                self.loop.add, {"prompt_token_ids": ids}, parsed.params,
                asyncio.get_running_loop())
        except InvalidParam as e:  # a parameter checked against the vocabulary or the pool
            raise APIError(400, str(e), param=param_of(e, body)) from None
        except (ValueError, TypeError) as e:  # the engine's other checks are the prompt's
            raise APIError(400, str(e), param=prompt_param(parsed.prompt)) from None
        return parsed, request_id, [(i, q, Timeline()) for i, q in queues], num_prompt

    async def compile_grammar(self, parsed: ParsedRequest) -> None:
        """Compile the output's grammar (a format's, or a required tool call's) before the
        request is added, in the compiler's own threads: a grammar that takes seconds holds
        back its own request alone, never the admission lock nor the worker threads other
        requests are parsed in. The engine keeps it compiled; the add copies its matcher."""
        structured = parsed.params.structured
        if structured is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(
                self.compiler, self.engine.inputs.grammars.constraint, structured)
        except GrammarError as e:
            raise APIError(400, str(e), param=parsed.grammar_param) from None

    async def outputs(self, request_id: str, queue: asyncio.Queue, timeline: Timeline):
        """The request's outputs until it finishes; aborts it if the consumer stops early
        (a client that went away)."""
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, APIError):  # the server ended it (shutting down)
                    raise out
                if isinstance(out, Exception):
                    raise APIError(500, f"the engine failed: {out}", kind="server_error")
                timeline.tokens_out(self.metrics, len(out.new_token_ids))
                finished = out.finished
                yield out
        finally:
            if finished:
                timeline.done(self.metrics)
            else:  # no await here: this may run in a cancelled scope (a closed stream)
                self.loop.abort(request_id)

    def spelling(self) -> Spelling:
        tokenizer = self.engine.tokenizer
        return Spelling(lambda token: tokenizer.decode([token]), tokenizer.token_bytes)

    def pieces(self, params: SamplingParams) -> Callable[[], IncrementalDetokenizer]:
        """A maker of detokenizers that spell an output as the engine does for ``params``."""
        return functools.partial(self.engine.tokenizer.detokenizer, params.skip_special_tokens)

    def usage(self, outs: list[RequestOutput], num_prompt: int) -> dict[str, Any]:
        """Every sample's tokens; the prompt (and its cached tokens, the first sample's)
        once."""
        completion = sum(len(out.outputs[0].token_ids) for out in outs)
        return {"prompt_tokens": num_prompt, "completion_tokens": completion,
                "total_tokens": num_prompt + completion,
                "prompt_tokens_details": {"cached_tokens": outs[0].num_cached_tokens}}

    async def merged(self, samples: list):
        """``(index, output)`` of every sample, as they come. Leaving early closes them
        all (their requests are aborted)."""
        streams = [self.outputs(i, q, t) for i, q, t in samples]
        if len(streams) == 1:
            async with contextlib.aclosing(streams[0]) as outs:
                async for out in outs:
                    yield 0, out
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream) -> None:
            try:
                async for out in stream:
                    await merged.put((index, out, None))
                await merged.put((index, None, None))
            except Exception as e:  # the engine's failure, or the server's end of it
                await merged.put((index, None, e))

        tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
        try:
            live = len(streams)
            while live:
                index, out, error = await merged.get()
                if error is not None:
                    raise error
                if out is None:
                    live -= 1
                    continue
                yield index, out
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in streams:
                await stream.aclose()

    async def complete(self, request, chat: bool):
        from sse_starlette.sse import EventSourceResponse
        from starlette.responses import JSONResponse

        try:
            body = await self.read_body(request)
            parsed, request_id, samples, num_prompt = await self.submit(body, chat)
        except APIError as e:
            return error_response(e)
        shape = (ChatShape(request_id, self.model_name, self.spelling(), parsed.tool_use,
                           self.tool_format) if chat
                 else CompletionShape(request_id, self.model_name, self.spelling(),
                                      self.pieces(parsed.params)))
        if parsed.stream:
            return EventSourceResponse(self.events(parsed, samples, num_prompt, shape),
                                       ping=15)
        last: list[RequestOutput | None] = [None] * len(samples)
        texts: list[list[str]] = [[] for _ in samples]
        outs = self.merged(samples)
        try:
            async for index, out in outs:
                last[index] = out
                texts[index].append(out.text_delta)
                if not out.finished and shape.has_all_calls(index, out.text_delta):
                    self.loop.abort(samples[index][0], client_left=False)
                if await request.is_disconnected():
                    break
        except APIError as e:
            return error_response(e)
        finally:
            await outs.aclose()
        if any(out is None or not out.finished for out in last):
            return error_response(APIError(499, "the client closed the request"))
        choices = [shape.choice(i, "".join(texts[i]), out.finish_reason, out.outputs[0].logprobs)
                   for i, out in enumerate(last)]
        return JSONResponse(shape.whole(choices, self.usage(last, num_prompt)))

    async def events(self, parsed: ParsedRequest, samples: list, num_prompt: int, shape):
        for index in range(len(samples)):
            yield json.dumps(shape.first(index))
        finals: list[RequestOutput] = []
        try:
            # aclosing: a cancelled stream closes its outputs (and aborts) at once, not when
            # the abandoned generator is collected.
            async with contextlib.aclosing(self.merged(samples)) as outs:
                sent = [0] * len(samples)  # logprob records sent: a token's may wait for its text
                async for index, out in outs:
                    if out.text_delta or out.finished:
                        records = out.outputs[0].logprobs
                        chunk = shape.chunk(index, out.text_delta, out.finish_reason,
                                            records and records[sent[index]:])
                        sent[index] = len(records or ())
                        if not out.finished and shape.has_all_calls(index):  # before sending
                            self.loop.abort(samples[index][0], client_left=False)
                        yield json.dumps(chunk)
                    if out.finished:
                        finals.append(out)
            if parsed.include_usage:
                yield json.dumps(shape.usage_chunk(self.usage(finals, num_prompt)))
        except APIError as e:
            yield json.dumps(e.body())
        yield "[DONE]"
# ANCHOR_END: handlers


class Spelling(NamedTuple):
    """How a logprob record spells a token: its text, and the bytes it stands for (a token
    that is part of a character has the text U+FFFD but bytes of its own)."""

    text: Callable[[int], str]
    bytes: Callable[[int], bytes]


class TokenTexts:
    """A choice's tokens as the text each adds to its output, and where that text begins
    in it: the detokenizer the engine spells the output with, fed the same tokens. A token
    that ends mid-character adds "" and the one that completes the character carries all
    of it, so the texts joined are the output and no offset drifts."""

    def __init__(self, detokenizer: IncrementalDetokenizer):
        self.detokenizer, self.offset = detokenizer, 0

    def read(self, tokens: list[int], last: bool) -> tuple[list[str], list[int]]:
        """The next ``tokens``' texts and offsets; ``last``: the output ends with them (a
        tail held back mid-character goes to the last one, as U+FFFD, as in the text)."""
        texts = [self.detokenizer.add(token) for token in tokens]
        if last and texts:
            texts[-1] += self.detokenizer.flush()
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return texts, offsets


class CompletionShape:
    """``/v1/completions`` bodies and chunks; ``pieces`` makes a detokenizer of the
    request's output (None for chat, whose records spell tokens their own way)."""

    object = "text_completion"

    def __init__(self, request_id: str, model: str, spelling: Spelling,
                 pieces: Callable[[], IncrementalDetokenizer] | None):
        self.id, self.model, self.created = f"cmpl-{request_id}", model, int(time.time())
        self.spelling, self.pieces = spelling, pieces
        self.texts: dict[int, TokenTexts] = {}  # per choice: its tokens' texts so far

    def envelope(self, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def first(self, index: int) -> dict[str, Any]:
        return self.chunk(index, "", None, None)

    def chunk(self, index: int, text: str, finish_reason: str | None,
              records: list[TokenLogprob] | None) -> dict[str, Any]:
        return self.envelope([self.choice(index, text, finish_reason, records)])

    def usage_chunk(self, usage: dict) -> dict[str, Any]:
        return self.envelope([], usage=usage)

    def choice(self, index: int, text: str, finish_reason: str | None,
               records: list[TokenLogprob] | None) -> dict[str, Any]:
        logprobs = self.logprobs(records, index, last=finish_reason is not None)
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def whole(self, choices: list[dict[str, Any]], usage: dict) -> dict[str, Any]:
        return self.envelope(choices, usage=usage)

    def has_all_calls(self, index: int, text: str | None = None) -> bool:
        """Whether choice ``index`` holds the most tool calls allowed: a completion holds
        none."""
        return False

    def logprobs(self, records: list[TokenLogprob] | None, index: int = 0,
                 last: bool = False) -> dict[str, Any] | None:
        """The legacy completions' shape: parallel lists, the alternatives as dicts. A
        token reads the text it adds to the output (``TokenTexts``), so ``text_offset``
        indexes the returned text; ``last``: these records end the output."""
        if records is None:
            return None
        if index not in self.texts:
            self.texts[index] = TokenTexts(self.pieces())
        tokens, offsets = self.texts[index].read([r.token for r in records], last)
        return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
                "top_logprobs": [{self.alternative(t): lp for t, lp in r.top}
                                 for r in records],
                "text_offset": offsets}

    def alternative(self, token: int) -> str:
        """An alternative's key: its text alone, or, for a token that is part of a
        character, its bytes as OpenAI's legacy API spells them (``bytes:\\xf0\\x9f``);
        such tokens all read U+FFFD, and would share one key."""
        data = self.spelling.bytes(token)
        try:
            return data.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class ChatShape(CompletionShape):
    """``/v1/chat/completions`` bodies and chunks; with ``tools``, each choice's text is
    read for tool calls (``ToolCallParser``)."""

    object = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, spelling: Spelling,
                 tool_use: ToolUse | None = None, tool_format: str | None = None):
        super().__init__(request_id, model, spelling, pieces=None)
        self.id = f"chatcmpl-{request_id}"
        use = tool_use or ToolUse(None, False, None, None)
        self.tools = use.tools if use.parse else None  # read for calls: None, not read
        self.max_calls, self.tool_format = use.max_calls, tool_format
        # a call cut off by max_tokens is not content where the output is calls only
        self.calls_only = use.parse and use.calls_only
        self.parsers: dict[int, ToolCallParser | JsonToolCallParser] = {}  # per choice

    def parser(self, index: int) -> ToolCallParser | JsonToolCallParser:
        if index not in self.parsers:
            self.parsers[index] = tool_calls.parser(self.tools, self.tool_format,
                                                    self.max_calls)
        return self.parsers[index]

    def finish_reason(self, num_calls: int, reason: str | None) -> str | None:
        """A choice's finish reason, with its calls: "tool_calls" where the model stopped
        after them, or the server stopped it at the most calls allowed."""
        if not num_calls or reason is None:
            return reason
        all_calls = self.max_calls is not None and num_calls >= self.max_calls
        return "tool_calls" if reason == "stop" or all_calls else reason

    def has_all_calls(self, index: int, text: str | None = None) -> bool:
        """Whether choice ``index`` holds the most calls allowed (its request may stop);
        ``text``: its next text, for a choice that is not streamed."""
        if self.tools is None or self.max_calls is None:
            return False
        if text is not None:
            self.parser(index).feed(text)
        return self.parser(index).done

    def first(self, index: int) -> dict[str, Any]:
        # with tools, the content may never come (only calls): null until it does
        content = "" if self.tools is None else None
        return self.envelope([{"index": index, "delta": {"role": "assistant", "content": content},
                               "logprobs": None, "finish_reason": None}])

    def chunk(self, index: int, text: str, finish_reason: str | None,
              records: list[TokenLogprob] | None) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        calls: list[ToolCall] = []
        if self.tools is not None:
            parser = self.parser(index)
            first = parser.num_calls
            text, calls = parser.feed(text)
            if finish_reason is not None:
                rest, more = parser.finish()
                text, calls = text + rest, calls + more
            if self.calls_only:
                text = ""
            if calls:
                delta["tool_calls"] = [{"index": first + k, **c.as_openai()}
                                       for k, c in enumerate(calls)]
            finish_reason = self.finish_reason(parser.num_calls, finish_reason)
        if text:
            delta = {"content": text, **delta}
        return self.envelope([{"index": index, "delta": delta,
                               "logprobs": self.logprobs(records),
                               "finish_reason": finish_reason}])

    def choice(self, index: int, text: str, finish_reason: str | None,
               records: list[TokenLogprob] | None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools is not None:
            content, calls = tool_calls.parse(text, self.tools, self.tool_format, self.max_calls)
            if self.calls_only:
                message["content"], content = None, ""
            if calls:
                message = {"role": "assistant", "content": content if content.strip() else None,
                           "tool_calls": [c.as_openai() for c in calls]}
                finish_reason = self.finish_reason(len(calls), finish_reason)
        return {"index": index, "message": message,
                "logprobs": self.logprobs(records), "finish_reason": finish_reason}

    def whole(self, choices: list[dict[str, Any]], usage: dict) -> dict[str, Any]:
        return {**self.envelope(choices, usage=usage), "object": "chat.completion"}

    def logprobs(self, records: list[TokenLogprob] | None,
                 index: int = 0) -> dict[str, Any] | None:
        """The chat shape: one entry per token, its alternatives inside it."""
        if records is None:
            return None

        def entry(token: int, logprob: float) -> dict[str, Any]:
            return {"token": self.spelling.text(token), "logprob": logprob,
                    "bytes": list(self.spelling.bytes(token))}

        return {"content": [entry(r.token, r.logprob) | {"top_logprobs": [
            entry(t, lp) for t, lp in r.top]} for r in records], "refusal": None}


def error_response(error: APIError, headers: dict[str, str] | None = None):
    """The error as OpenAI shapes it; ``headers`` besides (a 405's ``Allow``). A body left
    unread (408, 413) closes the connection: what the client still sends is not read."""
    from starlette.responses import JSONResponse

    if error.status == 401:
        headers = {"WWW-Authenticate": "Bearer", **(headers or {})}
    if error.status in (408, 413):
        headers = {"Connection": "close", **(headers or {})}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (--max-body-bytes)",
                    code="request_too_large")


def check_options(max_waiting: int | None, max_body_bytes: int, api_key: str | None,
                  key_for_all: bool = False,
                  shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
                  header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                  body_timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
    """Refuse bad server options at startup (before any model is loaded, from the CLI)."""
    check_seconds("shutdown_timeout", shutdown_timeout, 0)
    check_seconds("header_timeout", header_timeout)
    check_seconds("body_timeout", body_timeout)
    if max_waiting is not None and (isinstance(max_waiting, bool)
                                    or not isinstance(max_waiting, int) or max_waiting < 1):
        raise ValueError(f"max_waiting must be an integer >= 1 (every request waits before "
                         f"its first step), got {max_waiting!r}")
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or \
            max_body_bytes < 1024:
        raise ValueError(f"max_body_bytes must be an integer >= 1024, got {max_body_bytes!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key
                                or not api_key.isascii() or not api_key.isprintable()
                                or api_key != api_key.strip() or " " in api_key):
        raise ValueError("the API key must be non-empty printable ASCII without spaces "
                         "(a header carries it)")
    if key_for_all and api_key is None:
        raise ValueError("--api-key-for-all needs a key (--api-key or TINY_LLM_API_KEY)")


def check_seconds(name: str, value: Any, low: float | None = None) -> None:
    """A duration option: seconds from ``low`` (None: more than 0) up to an hour."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value < 3600 and (
        value > 0 if low is None else value >= low)
    if not ok:
        raise ValueError(f"{name} must be between {low or 0} and 3600 seconds"
                         f"{' (more than 0)' if low is None else ''}, got {value!r}")


# ANCHOR: app
def build_app(server: Server):
    """The Starlette application; the engine loop runs while the app does."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    def guarded(handler, always: bool):
        """``handler`` behind the API key: ``/v1`` routes always, the others with
        ``key_for_all``."""
        async def run(request):
            if (always or server.key_for_all) and not server.authorized(request):
                return error_response(APIError(401, "Incorrect or missing API key: send "
                                               "'Authorization: Bearer <key>'",
                                               code="invalid_api_key"))
            return await handler(request)
        return run

    async def chat(request):
        return await server.complete(request, chat=True)

    async def completions(request):
        return await server.complete(request, chat=False)

    card = {"id": server.model_name, "object": "model", "created": server.created,
            "owned_by": "tiny-llm", "max_model_len": server.engine.max_model_len}

    async def models(request):
        return JSONResponse({"object": "list", "data": [card]})

    async def model(request):
        name = request.path_params["model"]
        if name != server.model_name:
            return error_response(APIError(404, f"the model {name!r} does not exist; this "
                                           f"server serves {server.model_name!r}",
                                           param="model", code="model_not_found"))
        return JSONResponse(card)

    async def no_route(request, exc):  # unknown paths and methods: OpenAI's error shape too
        message = (f"no route {request.url.path}" if exc.status_code == 404
                   else f"{request.method} is not allowed on {request.url.path}")
        return error_response(APIError(exc.status_code, message), exc.headers)

    async def health(request):
        if not server.loop.alive:
            return PlainTextResponse("engine loop stopped", status_code=503)
        if server.shutting_down:  # a load balancer sends new work elsewhere
            return PlainTextResponse("shutting down", status_code=503)
        return PlainTextResponse("ok")

    async def metrics(request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        # engine.stats() waits for the engine's lock (up to one step): not on the event loop
        text = await asyncio.to_thread(generate_latest, server.metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @asynccontextmanager
    async def lifespan(app):
        server.loop.start()
        try:
            yield
        finally:
            server.loop.stop()
            server.compiler.shutdown(wait=False, cancel_futures=True)

    return Starlette(routes=[
        Route("/v1/chat/completions", guarded(chat, True), methods=["POST"]),
        Route("/v1/completions", guarded(completions, True), methods=["POST"]),
        Route("/v1/models", guarded(models, True)),
        Route("/v1/models/{model:path}", guarded(model, True)),
        Route("/health", guarded(health, False)),
        Route("/metrics", guarded(metrics, False)),
    ], exception_handlers={404: no_route, 405: no_route}, lifespan=lifespan)


def serve(engine: LLMEngine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          max_waiting: int | None = None, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          api_key: str | None = None, key_for_all: bool = False,
          shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
          header_timeout: float = DEFAULT_HEADER_TIMEOUT,
          body_timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
    check_options(max_waiting, max_body_bytes, api_key, key_for_all, shutdown_timeout)
    server = Server(engine, model_name, max_waiting, max_body_bytes=max_body_bytes,
                    api_key=api_key, key_for_all=key_for_all, header_timeout=header_timeout,
                    body_timeout=body_timeout)
    from sse_starlette.sse import AppStatus

    # sse-starlette would cut every stream the moment a signal arrives, with no error
    # event: the streams end here instead, through the bounded shutdown (uvicorn's own
    # timeout, a few seconds later, is the backstop).
    AppStatus.disable_automatic_graceful_drain()
    config = uvicorn_config(server, host, port, log_level="info",
                            timeout_graceful_shutdown=shutdown_timeout + 5)
    bounded_shutdown(config, server, shutdown_timeout).run()


def uvicorn_config(server: Server, host: str, port: int, **options: Any):
    """uvicorn's configuration for ``server``'s app, on an HTTP protocol with a deadline
    for each request's headers (``header_timeout``)."""
    import uvicorn

    return uvicorn.Config(build_app(server), host=host, port=port,
                          http=timed_protocol(server.header_timeout), **options)


def timed_protocol(header_timeout: float) -> type:
    """uvicorn's HTTP protocol with a deadline for each request's headers, from the
    connection's start or its previous response's end: a connection whose next request
    has not shown all its headers by then (one byte a second, or nothing) is closed. The
    body's deadline is the handler's (``read_body``: a 408)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderDeadline(AutoHTTPProtocol):
        header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.await_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self.header_timer.cancel()
            super().connection_lost(exc)

        def await_headers(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
            self.header_timer = self.loop.call_later(header_timeout, self.headers_late,
                                                     self.cycle)

        def headers_late(self, cycle) -> None:
            # the same cycle: no request's headers came since; a running one is left be
            if self.cycle is cycle and (cycle is None or cycle.response_complete):
                self.transport.close()

    return HeaderDeadline


def bounded_shutdown(config, server: Server, timeout: float):
    """uvicorn's server with a bounded shutdown: the first SIGTERM/SIGINT stops admission
    and gives the requests in flight ``timeout`` seconds, a second one ends them at once
    (their streams still end with an error event and ``[DONE]``), a third exits without
    waiting for anything. Until the requests in flight have ended the server still listens,
    and answers a new request 503 rather than refusing its connection."""
    import uvicorn

    class BoundedShutdown(uvicorn.Server):
        signals = 0
        signalled = 0.0  # when the first signal came (time.monotonic)

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.signals += 1
            if self.signals == 1:
                log.info("shutting down: %d request(s) in flight get up to %g s",
                         len(server.loop.queues), timeout)
                self.signalled = time.monotonic()
                server.begin_shutdown(timeout)
            elif self.signals == 2:  # end every request now; their streams still close
                server.begin_shutdown(0)
            else:  # a third: stop waiting for anything
                self.force_exit = True
            self.should_exit = True

        async def shutdown(self, sockets: list | None = None) -> None:
            # uvicorn's own shutdown closes the listener first: it waits for the requests
            # in flight (ended by the grace's timer, or a step past it), bounded by its
            # own backstop should the engine thread hang.
            backstop = self.signalled + self.config.timeout_graceful_shutdown
            while server.loop.queues and not self.force_exit and time.monotonic() < backstop:
                await asyncio.sleep(0.05)
            await super().shutdown(sockets)

    return BoundedShutdown(config)
# ANCHOR_END: app
