"""The engine's thread: ``EngineLoop`` calls ``engine.step()`` while requests are unfinished
and sleeps otherwise; HTTP handlers add and abort requests through it and read each
request's outputs from an ``asyncio.Queue`` of their own. A handler never holds the engine's
lock while it waits: an add waits at most one step, an abort is posted without waiting.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import threading
import uuid
from typing import Any

from tiny_llm.engine import LLMEngine
from tiny_llm.sampling.params import SamplingParams
from tiny_llm.serving.protocol import APIError
from tiny_llm.step.request import RequestOutput
from tiny_llm.tensor_parallel import TensorParallelError

log = logging.getLogger("tiny_llm")


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
                    self.engine.current_load().num_waiting >= self.max_waiting:
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
