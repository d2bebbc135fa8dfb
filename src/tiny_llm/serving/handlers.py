"""The endpoints' handlers: ``Server`` reads a body (bounded in size and time), parses it in
a worker thread, compiles a structured output's grammar in threads of its own, adds the
request through the engine loop, and answers (streamed or whole) in the shapes of
``responses``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tiny_llm.engine import LLMEngine
from tiny_llm.models.tokenizer import IncrementalDetokenizer
from tiny_llm.sampling import tool_calls
from tiny_llm.sampling.params import InvalidParam, SamplingParams
from tiny_llm.serving.engine_loop import EngineLoop
from tiny_llm.serving.metrics import Metrics, Timeline
from tiny_llm.serving.protocol import (
    APIError,
    ParsedRequest,
    check_context_length,
    param_of,
    parse_request,
    prompt_param,
)
from tiny_llm.serving.responses import (
    ChatBodies,
    CompletionBodies,
    TokenSpelling,
    body_too_large,
    error_response,
)
from tiny_llm.step.request import RequestOutput
from tiny_llm.structured import GrammarError

DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # a 128k-token prompt as token ids is about 1 MB
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds a request's headers may take to arrive
DEFAULT_BODY_TIMEOUT = 60.0  # seconds its body may take (4 MiB at about 0.5 Mbit/s)
API_KEY_ENV = "TINY_LLM_API_KEY"
DEFAULT_SHUTDOWN_TIMEOUT = 10.0  # seconds in-flight requests get after the first signal
GRAMMAR_THREADS = 2  # grammars compiled at once; more wait for a thread, other requests do not


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
        if parsed.params.structured is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(
                self.compiler, self.engine.compile_grammar, parsed.params)
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

    def spelling(self) -> TokenSpelling:
        tokenizer = self.engine.tokenizer
        return TokenSpelling(lambda token: tokenizer.decode([token]), tokenizer.token_bytes)

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
        shape = (ChatBodies(request_id, self.model_name, self.spelling(), parsed.tool_use,
                           self.tool_format) if chat
                 else CompletionBodies(request_id, self.model_name, self.spelling(),
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
