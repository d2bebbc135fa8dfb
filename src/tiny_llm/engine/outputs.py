"""Output routing: every output goes to the owner of its request.

Requests have two kinds of owners. One added with ``add_request`` is the step loop's: its
outputs wait in ``pending`` until ``step()`` returns them. One made by ``generate`` or
``stream`` is collected: its outputs wait in its own queue until that caller takes them.
A request id stays taken until the request's last output has been delivered. A stream
dropped unfinished is *abandoned*: its request is handed back here (from any thread, so
only appended) and aborted at the engine's next call.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from typing import Protocol

from tiny_llm.step.request import Request, RequestOutput


class OutputRouter:
    """The engine's request ids and where each request's outputs go."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}  # ids taken: live or with undelivered outputs
        self.pending: list[RequestOutput] = []  # outputs of add_request'ed requests
        self.abandoned: deque[Request] = deque()  # requests of streams dropped unfinished
        self._queues: dict[Request, deque[RequestOutput]] = {}  # of generate/stream
        self._ids = itertools.count()

    def new_id(self, request_id: str | None) -> str:
        """``request_id`` if it is free (ValueError if taken), else a fresh one."""
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self.requests:  # a caller may have used it explicitly
                request_id = str(next(self._ids))
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        return request_id

    def register(self, request: Request, collect: bool) -> None:
        """Take ``request``'s id; ``collect``: its outputs queue for ``take``."""
        self.requests[request.request_id] = request
        if collect:
            self._queues[request] = deque()

    def route(self, request: Request, output: RequestOutput) -> None:
        queue = self._queues.get(request)
        if queue is not None:
            queue.append(output)
        else:
            self.pending.append(output)

    def take(self, request: Request) -> RequestOutput | None:
        """The next output of a collected request, if any (its id is released after the
        last one)."""
        queue = self._queues[request]
        if not queue:
            return None
        out = queue.popleft()
        if out.finished:
            self.release(request)
        return out

    def take_pending(self) -> list[RequestOutput]:
        """The step loop's outputs so far; finished requests' ids are released."""
        outputs, self.pending = self.pending, []
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs

    def release(self, request: Request) -> None:
        self._queues.pop(request, None)
        if self.requests.get(request.request_id) is request:
            del self.requests[request.request_id]


class StreamingEngine(Protocol):
    """What a stream needs of its engine (``LLMEngine``'s public methods)."""

    outputs: OutputRouter

    def next_output(self, request: Request) -> RequestOutput: ...

    def drop(self, requests: list[Request]) -> None: ...


# ANCHOR: request_stream
class RequestStream:
    """One request's outputs, in order. Iterating drives the engine when none is ready."""

    def __init__(self, engine: StreamingEngine, request: Request):
        self.engine, self.request = engine, request
        self.request_id = request.request_id
        self._done = False
        # Dropped unfinished: hand the request back to abort at the engine's next call
        # (a finalizer may run in any thread, so it only appends).
        self._finalizer = weakref.finalize(self, engine.outputs.abandoned.append, request)

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestOutput:
        if self._done:
            raise StopIteration
        out = self.engine.next_output(self.request)
        if out.finished:
            self._done = True
            self._finalizer.detach()
        return out

    def close(self) -> None:
        """Stop reading: abort the request if it is still running."""
        if not self._done:
            self._done = True
            self._finalizer.detach()
            self.engine.drop([self.request])

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
# ANCHOR_END: request_stream
