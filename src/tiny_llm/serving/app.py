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
import logging
import time
from typing import Any

from tiny_llm.engine import LLMEngine
from tiny_llm.serving.handlers import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_SHUTDOWN_TIMEOUT,
    Server,
    check_options,
)
from tiny_llm.serving.protocol import APIError
from tiny_llm.serving.responses import error_response

log = logging.getLogger("tiny_llm")




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
