"""Day 1: continuous batching — requests join and leave at every step.

The scheduler owns two queues. ``waiting`` holds requests that have no K/V storage yet;
``running`` holds requests that do, in admission order, at most ``max_num_seqs`` of them
(the *slots*). Every step it:

1. gives each running request its next token, within the step's token budget and if its
   KV storage has room;
2. admits waiting requests, each with its whole prompt, while a slot and the budget
   allow. The ``continuous`` policy admits at every step; the ``static`` baseline admits
   only when the previous batch has completely finished, so one long request holds every
   slot hostage (head-of-line blocking).

After the forward, ``finish_step`` records the computed tokens, the engine samples, and
``retire`` frees a finished request's slot at once for the next step.

The scheduler never touches the model. ``BatchingSimulator`` drives it with simulated
requests: that is how the chapter's arithmetic (``static_batching_steps``,
``continuous_batching_steps``) is checked against the scheduler itself. Later days
extend it through its hooks: Day 2 the budget and the order of work, Day 3 admission
with cached prefixes, room-making by preemption, and page bookkeeping after a step.

Day 1's KV storage is ``DenseKVStorage``: one growing dense cache per slot, reused by the next
request. ``DenseAttention`` splits the step's flat batch into its sequences and attends
each over its own cache.

Invariants: ``len(running) <= max_num_seqs``; a request is in exactly one queue or
finished; the tokens scheduled in a step never exceed ``max_num_batched_tokens``; only the
scheduler changes a request's ``num_computed_tokens``.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from tiny_llm.step.batch import (
    AttentionGeometry,
    DenseLayout,
    PagedLayout,
    ScheduledChunk,
    StepBatch,
)
from tiny_llm.step.dense_kv import DenseKVCache
from tiny_llm.step.request import RequestStatus, SequenceState

import mlx.core as mx

POLICIES = ("continuous", "static")


class KVStorage(Protocol):
    """Where requests' K/V lives, as the scheduler and the engine see it."""

    def allocate(self, request: Any, num_tokens: int) -> bool:
        """Room for the first ``num_tokens`` tokens of ``request``; False if there is none.
        Asking again for the same or fewer tokens changes nothing."""
        ...

    def free(self, request: Any) -> None: ...

    def layout(self, chunks: list[ScheduledChunk]) -> DenseLayout | PagedLayout | None:
        """What attention needs to find the step's sequences in this storage."""
        ...


# ANCHOR: step_budget
class StepBudget:
    """The tokens one step may still schedule. Day 1 prefills a prompt whole or not at all."""

    def __init__(self, max_num_batched_tokens: int):
        self.left = max_num_batched_tokens

    def take_decode(self) -> bool:
        # TASK 1.1: StepBudget — The step budget
        if self.left == 0:
            return False
        self.left -= 1
        return True
        # END TASK

    def take_prefill(self, needed: int) -> int:
        """Tokens granted to a request that needs ``needed`` more (0: none this step)."""
        # TASK 1.1: StepBudget — The step budget
        if needed > self.left:
            return 0
        self.left -= needed
        return needed
        # END TASK

    def give_back(self, tokens: int) -> None:
        """Return tokens that were granted but not scheduled (no KV room, preemption)."""
        self.left += tokens
# ANCHOR_END: step_budget


# ANCHOR: scheduler
class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "continuous", kv: KVStorage | None = None):
        if policy not in POLICIES:
            raise ValueError(f"scheduler must be one of {POLICIES}, got {policy!r}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.kv = kv if kv is not None else UnlimitedKVStorage()
        self.waiting: deque = deque()
        self.running: list = []
        self.num_preemptions = 0  # requests sent back to waiting (Day 3 preempts)

    def add(self, request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        """This step's work: a chunk per request that computes tokens, running ones first."""
        # TASK 1.5: Scheduler.schedule — One step of the scheduler
        budget = self.new_budget()
        plan: dict = {}  # request -> tokens this step, in scheduling order
        for req in self.running_order():
            if req not in self.running:  # preempted (Day 3) to make room for an older one
                continue
            needed = req.num_uncomputed_tokens
            n = (1 if budget.take_decode() else 0) if needed == 1 else budget.take_prefill(needed)
            if n == 0:
                continue
            if self.make_room(req, req.num_computed_tokens + n, plan, budget):
                plan[req] = n
            else:
                budget.give_back(n)
        if self.may_admit():
            self.admit(plan, budget)
        return [ScheduledChunk(r, r.num_computed_tokens, r.num_computed_tokens + n)
                for r, n in plan.items()]
        # END TASK

    def admit(self, plan: dict, budget: StepBudget) -> None:
        # TASK 1.4: Scheduler.admit — Admission: continuous and static
        while self.waiting and len(self.running) < self.max_num_seqs and budget.left:
            req = self.waiting[0]
            n = self.try_admit(req, budget)
            if n == 0:
                return  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan[req] = n
        # END TASK

    def finish_step(self, chunks: list[ScheduledChunk]) -> None:
        """The step's forward succeeded: its chunks' K/V is stored."""
        # TASK 1.3: Scheduler.finish_step and retire — After the forward
        for chunk in chunks:
            chunk.request.num_computed_tokens = chunk.end
        # END TASK

    def retire(self, req) -> None:
        """Remove a finished (or aborted) request and free its slot and K/V at once."""
        # TASK 1.3: Scheduler.finish_step and retire — After the forward
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        # END TASK
# ANCHOR_END: scheduler

    # Hooks that later days override.

    def new_budget(self) -> StepBudget:
        return StepBudget(self.max_num_batched_tokens)

    def running_order(self) -> list:
        """The order in which running requests get tokens (Day 2: decodes first)."""
        return list(self.running)

    def may_admit(self) -> bool:
        # TASK 1.4: Scheduler.admit — Admission: continuous and static
        return self.policy == "continuous" or not self.running
        # END TASK

    def try_admit(self, req, budget: StepBudget) -> int:
        """Tokens of its prompt that ``req`` computes if admitted now; 0 leaves it waiting."""
        n = budget.take_prefill(req.num_uncomputed_tokens)
        if n and self.kv.allocate(req, req.num_computed_tokens + n):
            return n
        budget.give_back(n)
        return 0

    def make_room(self, req, num_tokens: int, plan: dict, budget: StepBudget) -> bool:
        """KV room for the first ``num_tokens`` tokens of running ``req`` (Day 3: preempt)."""
        return self.kv.allocate(req, num_tokens)


class UnlimitedKVStorage:
    """No KV limit beyond the slot count, and nothing to lay out (the simulator's storage)."""

    capacity_tokens: int | None = None  # no pool: any request fits

    def allocate(self, request, num_tokens: int) -> bool:
        return True

    def free(self, request) -> None:
        pass

    def layout(self, chunks: list[ScheduledChunk]) -> None:
        return None


# ANCHOR: dense_slots
class DenseKVStorage(UnlimitedKVStorage):
    """Day 1's KV storage: ``num_slots`` dense caches, one per running request, each reused
    by the next request that takes its slot. No page limit: a slot grows as needed."""

    def __init__(self, num_slots: int, num_layers: int):
        self.caches = [DenseKVCache(num_layers) for _ in range(num_slots)]
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.slot_of: dict[Any, int] = {}

    def allocate(self, request, num_tokens: int) -> bool:
        # TASK 1.2: DenseKVStorage — Slots and their caches
        if request not in self.slot_of:
            self.slot_of[request] = self.free_slots.pop()
        return True
        # END TASK

    def free(self, request) -> None:
        # TASK 1.2: DenseKVStorage — Slots and their caches
        slot = self.slot_of.pop(request, None)
        if slot is not None:
            self.caches[slot].reset()
            self.free_slots.append(slot)
        # END TASK

    def layout(self, chunks: list[ScheduledChunk]) -> DenseLayout:
        return DenseLayout([self.caches[self.slot_of[c.request]] for c in chunks])

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.caches)

    def stats(self) -> dict[str, int]:
        return {}
# ANCHOR_END: dense_slots


# ANCHOR: dense_attention
class DenseAttention:
    """Attention over each sequence's own dense cache: rows ``query_start_loc[b] ..
    query_start_loc[b + 1] - 1`` of the step are sequence b's new tokens, at positions
    ``chunk.start ..`` of its cache."""

    name: ClassVar[str] = "dense"
    storage: ClassVar[str] = "dense"

    def __init__(self, kv: DenseKVStorage):
        self.kv = kv
        self.step: StepBatch | None = None

    @staticmethod
    def check(geometry: AttentionGeometry) -> None:
        geometry.refuse_trees("attention='dense'")  # plain MLX ops serve any other geometry

    def begin_step(self, step: StepBatch) -> None:
        self.step = step

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        # TASK 1.6: DenseAttention.attend — Attention over a flat batch
        step = self.step
        qsl, outs = step.query_start_loc, []
        for b, (chunk, cache) in enumerate(zip(step.chunks, step.kv.caches, strict=True)):
            lo, hi = qsl[b], qsl[b + 1]
            outs.append(cache.attend_at(layer, q[lo:hi], k[lo:hi], v[lo:hi], scale, chunk.start))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)
        # END TASK

    def state(self) -> list[mx.array]:
        caches = self.step.kv.caches  # the step's sequences: only their buffers changed
        return [a for c in caches for a in c.keys + c.values if a is not None]

    def fused_decode(self) -> None:
        return None  # the fused layers attend over pages
# ANCHOR_END: dense_attention


# ANCHOR: simulator
class SimRequest(SequenceState):
    """A request for the model-free simulator: a prompt length and a planned output length."""

    def __init__(self, request_id: int, prompt_len: int, output_len: int,
                 prompt_token_ids: list[int] | None = None):
        super().__init__(prompt_token_ids or [request_id] * prompt_len)
        self.request_id = request_id
        self.output_len = output_len
        self.finish_step: int | None = None


@dataclass
class StepReport:
    step: int
    scheduled: list[tuple[int, int]]  # (request id, tokens)
    finished: list[int]
    num_running: int


class BatchingSimulator:
    """The engine's scheduler driven by fake tokens: a request whose chunk reaches the end
    of its tokens "generates" one, and stops after ``output_len``."""

    def __init__(self, max_batch: int, max_num_batched_tokens: int = 1 << 30,
                 policy: str = "continuous"):
        self.scheduler = self.make_scheduler(max_batch, max_num_batched_tokens, policy)
        self.requests: list[SimRequest] = []
        self.num_steps = 0

    def make_scheduler(self, max_batch: int, max_num_batched_tokens: int,
                       policy: str) -> Scheduler:
        return Scheduler(max_batch, max_num_batched_tokens, policy)

    def add_request(self, prompt_len: int, output_len: int,
                    prompt_token_ids: list[int] | None = None) -> SimRequest:
        req = SimRequest(len(self.requests), prompt_len, output_len, prompt_token_ids)
        self.requests.append(req)
        self.scheduler.add(req)
        return req

    def step(self) -> StepReport:
        chunks = self.scheduler.schedule()
        if not chunks and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler made no progress with requests waiting")
        self.scheduler.finish_step(chunks)
        self.num_steps += 1
        finished = []
        for chunk in chunks:
            req = chunk.request
            if chunk.end < req.num_tokens:
                continue  # a prefill chunk that did not reach the end samples nothing
            req.output_token_ids.append(-1 - req.request_id)  # a fake token per request
            if len(req.output_token_ids) == req.output_len:
                self.scheduler.retire(req)
                req.finish_step = self.num_steps
                finished.append(req.request_id)
        return StepReport(self.num_steps, [(c.request.request_id, c.num_tokens) for c in chunks],
                          finished, len(self.scheduler.running))

    def run(self) -> list[StepReport]:
        reports = []
        while self.scheduler.has_unfinished():
            reports.append(self.step())
        return reports
# ANCHOR_END: simulator


@dataclass
class BatchingStats:
    steps: int
    wasted_slot_steps: int  # slot-steps in which a slot held no request that was generating


def simulate_batching(output_lens: list[int], max_batch: int, policy: str) -> BatchingStats:
    """The scheduler itself on requests with one-token prompts, all arriving at step 0."""
    sim = BatchingSimulator(max_batch, policy=policy)
    for n in output_lens:
        sim.add_request(prompt_len=1, output_len=n)
    steps = len(sim.run())
    return BatchingStats(steps, steps * max_batch - sum(output_lens))


# ANCHOR: arithmetic
def static_batching_steps(output_lens: list[int], max_batch: int) -> BatchingStats:
    """Steps to serve requests that generate ``output_lens`` tokens (one per step, all
    arriving at once) in static batches of ``max_batch``: a batch takes as long as its
    longest request, and the next batch starts only when it is done."""
    # TASK 1.7: static_batching_steps and continuous_batching_steps — The arithmetic of batching
    steps = sum(max(output_lens[i : i + max_batch]) for i in range(0, len(output_lens), max_batch))
    return BatchingStats(steps, steps * max_batch - sum(output_lens))
    # END TASK


def continuous_batching_steps(output_lens: list[int], max_batch: int) -> BatchingStats:
    """The same with continuous batching: a slot takes the next request in line as soon as
    its request finishes. Each slot is a queue; the last one to empty ends the run."""
    # TASK 1.7: static_batching_steps and continuous_batching_steps — The arithmetic of batching
    slots_free_at = [0] * min(max_batch, len(output_lens))  # step at which each slot frees
    for n in output_lens:
        start = heapq.heappop(slots_free_at)
        heapq.heappush(slots_free_at, start + n)
    steps = max(slots_free_at, default=0)
    return BatchingStats(steps, steps * max_batch - sum(output_lens))
    # END TASK
# ANCHOR_END: arithmetic
