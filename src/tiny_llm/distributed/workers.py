"""Rank 0's workers and a worker's loop: each step sent to every other rank, run there on its
shard, and the faults and the launch around them.

**Faults.** A worker that dies closes its connection: rank 0's step fails with
``TensorParallelError`` naming it (a server answers 503), and rank 0 exits a moment later,
idle or not, since it cannot serve without that shard. A step that does not finish within
``tensor_parallel_timeout`` seconds (a rank hung or stopped; the time counts from the send)
ends rank 0 with that error on stderr, since its main thread is blocked inside a
collective. A step that fails on rank 0 after it was sent leaves every later step failing:
the ranks may be in different collectives. A worker whose rank 0 has gone exits; workers
ignore Ctrl-C. Options and the model's geometry are checked on every rank, with the same
error on each, before the weights of a safetensors checkpoint are read (a GGUF file is read
whole first: MLX loads its tensors eagerly, so a model too large for one machine must come
as safetensors). Each worker checks that its own memory holds rank 0's page count before
allocating its pool.

**The launch.** ``tiny-llm launch`` runs ``mlx.launch`` and exits non-zero when a rank
failed (mlx.launch itself exits 0 whatever its ranks did). mlx.launch ends the other ranks
with SIGTERM once one exits: rank 0 then reports a lost worker and exits 1. Before MLX's
ring is built, the ranks check its connections themselves (``_meet``), so that a busy port,
an address that is not the machine's or a host that does not answer fails within seconds
with a message naming it.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any

from tiny_llm.distributed.ring import Ranks, ring_failed, say
from tiny_llm.step.batch import StepBatch
from tiny_llm.tensor_parallel import TensorParallelError, step_message, step_of_message

EXIT_GRACE = 2.0  # seconds between finding a rank gone and ending this one
LOST_WAIT = 1.0  # seconds rank 0 waits, on a sign of a lost worker, for its connection to close
STOP_TIMEOUT = 10.0  # seconds rank 0 waits, at its end, for the workers to exit


class Workers:
    """Rank 0's side: the workers' connections, each step sent to them, and a watchdog
    that ends rank 0 when a step is stuck in a collective."""

    def __init__(self, ranks: Ranks, timeout: float):
        self.channels, self.timeout = ranks.channels, timeout
        self.lost: set[int] = set()
        self.kv_cache_bytes: dict[int, int] = {}  # each worker's page pool
        self.failure: TensorParallelError | None = None
        self._failure_raised = False  # a step raised it: its caller reports it
        self._step_started: float | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self._sigterm: Any = signal.SIG_DFL  # what SIGTERM did before start()

    def start(self, setup: dict[str, Any]) -> None:
        """Send every worker the engine it builds (pool size, backend, kernels); wait until
        each has built it; then watch them."""
        for channel in self.channels.values():
            channel.send(setup)
        for rank, channel in self.channels.items():
            channel.sock.settimeout(self.timeout)
            reply, _ = channel.receive()
            channel.sock.settimeout(None)
            if reply is None or "error" in reply:
                why = "exited or did not answer" if reply is None else reply["error"]
                raise TensorParallelError(f"worker rank {rank} could not start: {why}")
            self.kv_cache_bytes[rank] = reply["kv_cache_bytes"]
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()
        if threading.current_thread() is threading.main_thread():  # where handlers are set
            self._sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _send(self, batch: StepBatch) -> None:
        header, arrays = step_message(batch)
        for rank, channel in self.channels.items():
            try:
                channel.send(header, arrays)
            except OSError:
                self._lose(rank)
                raise self._raised() from None

    @contextmanager
    def step(self, batch: StepBatch):
        """Send ``batch`` to the workers and run it on rank 0 inside the block, watched from
        before the send. A step that fails once sent may leave the ranks in different
        collectives: no later step runs."""
        if self.failure is not None:
            raise self._raised()
        with self._lock:
            self._step_started = time.monotonic()
        try:
            self._send(batch)
            yield
        except BaseException as e:
            if ring_failed(e):
                self._find_lost(wait=LOST_WAIT)  # a closed connection says which worker exited
            if self.failure is None:
                self.failure = TensorParallelError(
                    f"a tensor-parallel step failed on rank 0 after it was sent to the "
                    f"workers ({type(e).__name__}: {e}); the ranks may no longer be in step, "
                    f"so no later step runs")
            raise self._raised() from e
        finally:
            with self._lock:
                self._step_started = None

    def _raised(self) -> TensorParallelError:
        """The failure, to raise: its caller now knows (and reports it)."""
        self._failure_raised = True
        return self.failure

    def stop(self) -> None:
        """Tell every worker to exit (at rank 0's end), and wait until each has: one still
        finishing the last step would find the ring closed under it. A worker found gone
        that no step has reported (rank 0 idle, or ended by a signal) ends rank 0 with
        status 1 and the error on stderr, not a silent success."""
        if self._stopped:
            return
        self._find_lost(wait=0.0)
        if self.lost and not self._failure_raised:
            _exit(f"{self.failure}; rank 0 exits")
        self._stopped = True
        for channel in self.channels.values():
            try:
                channel.send({"stop": True})
            except OSError:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT
        for channel in self.channels.values():
            channel.sock.settimeout(max(0.0, deadline - time.monotonic()))
            channel.receive()  # nothing more is sent: this returns at the worker's exit

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM on rank 0. ``mlx.launch`` sends it to the other ranks when one exits: with a
        worker gone, rank 0 says so and exits 1 rather than die without a word. Otherwise
        SIGTERM does what it did before."""
        if not self._stopped:
            self._find_lost(wait=LOST_WAIT)  # a remote worker's end may come a moment later
            if self.failure is not None:
                _exit(f"{self.failure}; rank 0 exits")
        if callable(self._sigterm):
            self._sigterm(signum, frame)
        elif self._sigterm != signal.SIG_IGN:  # the default: end by the signal, as before
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)

    def _lose(self, rank: int) -> None:
        """Mark ``rank`` gone; the error names the first found (mlx.launch ends the other
        ranks once one has exited, and ``_find_lost`` reads them in rank order)."""
        if not self.lost:
            self.failure = TensorParallelError(f"tensor-parallel worker rank {rank} has "
                                               f"exited; rank 0 cannot serve without its shard")
        self.lost.add(rank)

    def _find_lost(self, wait: float) -> None:
        """Mark the workers whose connection has closed (they exited), waiting up to
        ``wait`` seconds for one to."""
        socks = {c.sock: r for r, c in self.channels.items() if r not in self.lost}
        readable, _, _ = select.select(list(socks), [], [], wait) if socks else ([], [], [])
        for sock in sorted(readable, key=socks.get):
            if _closed(sock):
                self._lose(socks[sock])

    def _watch(self) -> None:
        """A worker's connection closing means it exited: rank 0, which cannot serve
        without its shard, ends too (a moment later, so that a step failing on its own
        reports first). A step older than the timeout means a rank is stuck: rank 0,
        blocked in a collective, ends with that error."""
        lost_at: float | None = None
        while not self._stopped:
            known = len(self.lost)
            self._find_lost(wait=0.25)
            if len(self.lost) > known:
                lost_at = time.monotonic()
            with self._lock:
                started = self._step_started
            now = time.monotonic()
            if started is not None and now - started > self.timeout:
                _exit(f"a tensor-parallel step did not finish within {self.timeout:g} s "
                      f"(tensor_parallel_timeout): a rank is stuck, stopped or too slow"
                      f"{f' ({self.failure})' if self.failure else ''}; rank 0 exits")
            if lost_at is not None and now - lost_at > EXIT_GRACE:
                _exit(f"{self.failure}; rank 0 exits")


def _closed(sock: socket.socket) -> bool:
    """Whether the other side of a readable connection has closed it."""
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _exit(message: str) -> None:
    say(f"error: {message}")
    os._exit(1)


# ---------------------------------------------------------------- the workers

def serve_as_worker(ranks: Ranks, build_runner) -> None:
    """A worker's whole life: build the engine's shard as rank 0 says, then run every
    step rank 0 sends, until it says stop (exit 0) or goes away (exit 1). Never returns."""
    # Ctrl-C in the terminal reaches every rank of mlx.launch: rank 0 decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = ranks.channels[0]
    setup, _ = channel.receive()
    if setup is None:
        _exit(f"rank 0 went away before the engine started (worker rank {ranks.rank})")
    try:
        runner = build_runner(setup)
    except Exception as e:  # rank 0 reports it; the worker ends
        channel.send({"error": f"{type(e).__name__}: {e}"})
        _exit(f"worker rank {ranks.rank} could not start: {e}")
    channel.send({"kv_cache_bytes": runner.kv.nbytes()})
    gone = f"rank 0 went away or left a step worker rank {ranks.rank} is in: it stops"
    in_step = threading.Event()
    threading.Thread(target=_watch_rank0, args=(channel.sock, in_step, gone),
                     name="tp-rank0-watch", daemon=True).start()
    while True:
        header, arrays = channel.receive()
        if header is None:
            _exit(gone)
        if header.get("stop"):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        in_step.set()
        try:
            runner.forward(step_of_message(header, arrays), head=False)
        except Exception as e:  # rank 0's step fails with it: the ring breaks as we exit
            _exit(f"worker rank {ranks.rank}: a step failed ({type(e).__name__}: {e})")
        in_step.clear()


def _watch_rank0(sock: socket.socket, in_step: threading.Event, gone: str) -> None:
    """End a worker left inside a step: rank 0 has gone (its connection closed) or moved on
    (its next message waits) while this rank has been blocked in the step's collectives
    for ``EXIT_GRACE`` seconds. A broken ring does not always fail the collectives that
    wait on it, and a worker never leaves a step rank 0 abandoned."""
    waiting_since: float | None = None
    while True:
        readable, _, _ = select.select([sock], [], [], 0.25)
        if readable and in_step.is_set():
            waiting_since = waiting_since or time.monotonic()
            if time.monotonic() - waiting_since > EXIT_GRACE:
                _exit(gone)
        else:
            waiting_since = None
        if readable:
            time.sleep(0.05)  # the main thread reads what waits (or the end) itself


# ---------------------------------------------------------------- the launch

def launch(argv: list[str]) -> int:
    """``mlx.launch --backend ring`` with ``argv`` (its options, ``--``, the command), exiting
    as its ranks did: 0 when every rank exited 0; else the first failing status a rank exited
    with itself, in rank order; else 128 + N for the first rank ended by signal N (the
    launcher ends the others with SIGTERM when one exits). mlx.launch itself exits 0 whatever
    its ranks did (its ``main`` returns nothing), so it runs here in this process, with a
    record of the processes it starts. Ctrl-C ends the ranks: rank 0 first, so that the
    workers see it go rather than rank 0 a worker."""
    from mlx._distributed_utils import launch as mlx_launch

    started: dict[int, Any] = {}  # rank: mlx.launch's RemoteProcess

    class Recorded(mlx_launch.RemoteProcess):
        def __init__(self, rank: int, *args: Any):
            super().__init__(rank, *args)
            started[rank] = self

    original, argv0 = mlx_launch.RemoteProcess, sys.argv
    mlx_launch.RemoteProcess = Recorded
    sys.argv = ["tiny-llm launch", "--backend", "ring", *argv]
    try:
        mlx_launch.main()
    except KeyboardInterrupt:
        for rank in sorted(started):
            started[rank].process.terminate()
            started[rank].process.wait()
        return 130
    finally:
        mlx_launch.RemoteProcess, sys.argv = original, argv0
    if not started:
        raise ValueError("mlx.launch started no rank: tiny-llm launch runs the ring backend "
                         "only (no --backend)")
    codes = [started[rank].process.wait() for rank in sorted(started)]
    own, signalled = [c for c in codes if c > 0], [128 - c for c in codes if c < 0]
    return (own or signalled or [0])[0]
