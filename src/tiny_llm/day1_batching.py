"""Day 1: continuous batching — requests join and leave at every step.

The scheduler owns two queues. ``waiting`` holds requests that have no K/V storage yet
(new ones, and preempted ones at the front); ``running`` holds requests that do, in
admission order. Every step it:

1. gives each running request its next tokens (decode tokens before prefill chunks, by
   Day 2's ``TokenBudget``), making room in the KV store for them — if the store is full,
   the newest running request is preempted (Day 3);
2. admits waiting requests while a slot, budget and KV room are free. The ``continuous``
   policy admits at every step; the ``static`` baseline admits only when the previous
   batch has completely finished, so one long request holds every slot hostage.

After the forward, ``finish_step`` advances each request's ``num_computed_tokens``; the
engine samples, and ``retire`` frees a finished request's slot at once for the next step.

The scheduler never touches the model: ``ContinuousBatchingScheduler`` drives this same
class with simulated requests, which is how the chapter's arithmetic
(``static_batching_steps``, ``continuous_batching_steps``) is computed.

Invariants: ``len(running) <= max_num_seqs``; a request is in exactly one queue or
finished; the tokens scheduled in a step never exceed ``max_num_batched_tokens``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from tiny_llm.day2_chunked_prefill import TokenBudget
from tiny_llm.request import RequestStatus

POLICIES = ("continuous", "static")


class KVSpace(Protocol):
    """Where a request's K/V lives; the scheduler asks it for room before scheduling."""

    def begin(self, request) -> None:
        """A waiting request is considered for admission (Day 3: reuse cached prefix pages
        by advancing ``num_computed_tokens``)."""
        ...

    def allocate(self, request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``request``; False if full."""
        ...

    def free(self, request) -> None: ...

    def commit(self, request) -> None:
        """The step computed more of ``request``'s K/V (Day 3: cache the full pages)."""
        ...


class UnboundedKV:
    """No KV limit beyond the slot count (the dense per-request caches of Days 1-2)."""

    def begin(self, request) -> None:
        pass

    def allocate(self, request, num_new_tokens: int) -> bool:
        return True

    def free(self, request) -> None:
        pass

    def commit(self, request) -> None:
        pass


@dataclass
class ScheduledChunk:
    request: object
    num_tokens: int


# ANCHOR: scheduler
class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "continuous",
        chunked_prefill: bool = True,
        kv: KVSpace | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"scheduler must be one of {POLICIES}, got {policy!r}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.chunked_prefill = chunked_prefill
        self.kv = kv or UnboundedKV()
        self.waiting: deque = deque()
        self.running: list = []
        self.num_preemptions = 0

    def add(self, request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = TokenBudget(self.max_num_batched_tokens, self.chunked_prefill)
        may_admit = self.policy == "continuous" or not self.running
        plan: dict = {}  # request -> tokens this step, in scheduling order
        preemptions_before = self.num_preemptions
        decodes = [r for r in self.running if r.num_uncomputed_tokens == 1]
        prefills = [r for r in self.running if r.num_uncomputed_tokens > 1]
        for req in decodes + prefills:
            if req not in self.running:  # preempted while making room for an older one
                continue
            if req.num_uncomputed_tokens == 1:
                n = 1 if budget.take_decode() else 0
            else:
                n = budget.take_prefill(req.num_uncomputed_tokens)
            if n == 0:
                continue
            if self._make_room(req, n, plan, budget):
                plan[req] = n
            else:
                budget.give_back(n)
        if may_admit and self.num_preemptions == preemptions_before:
            self._admit(plan, budget)
        return [ScheduledChunk(r, n) for r, n in plan.items()]

    def _admit(self, plan: dict, budget: TokenBudget) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs and budget.left:
            req = self.waiting[0]
            self.kv.begin(req)
            n = budget.take_prefill(req.num_uncomputed_tokens)
            if n == 0 or not self.kv.allocate(req, n):
                budget.give_back(n)
                self.kv.free(req)
                req.num_computed_tokens = 0
                return
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan[req] = n

    def _make_room(self, req, n: int, plan: dict, budget: TokenBudget) -> bool:
        """Allocate KV room for ``req``, preempting the newest running requests if needed.
        Returns False when ``req`` itself had to be preempted."""
        while not self.kv.allocate(req, n):
            victim = self.running[-1]
            self.preempt(victim)
            if victim in plan:
                budget.give_back(plan.pop(victim))
            if victim is req:
                return False
        return True

    def preempt(self, req) -> None:
        """Recompute preemption: drop the K/V, requeue at the front, redo the work later."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish_step(self, chunks: list[ScheduledChunk]) -> None:
        for chunk in chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
            self.kv.commit(chunk.request)

    def retire(self, req) -> None:
        """Remove a finished (or aborted) request and free its slot and K/V at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
# ANCHOR_END: scheduler


# ANCHOR: simulator
class SimRequest:
    """A request for the model-free simulator: a prompt length and a planned output length."""

    def __init__(
        self, request_id: int, prompt_len: int, output_len: int, prompt_token_ids=None
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids or [request_id] * prompt_len)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = prompt_len
        self.output_len = output_len
        self.num_tokens = prompt_len
        self.num_computed_tokens = 0
        self.num_generated = 0
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_step: int | None = None

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids_between(self, start: int, end: int) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[start:end]


@dataclass
class StepReport:
    step: int
    scheduled: list[tuple[int, int]]  # (request id, tokens)
    finished: list[int]
    num_running: int


class ContinuousBatchingScheduler:
    """The engine's scheduler driven by fake tokens: each request that completes its
    scheduled work in a step "generates" one token and stops after ``output_len``."""

    def __init__(
        self,
        max_batch: int,
        block_manager=None,
        max_num_batched_tokens: int = 1 << 30,
        policy: str = "continuous",
    ):
        kv = None
        if block_manager is not None:
            from tiny_llm.day3_paged_kv import BlockSpace

            kv = BlockSpace(block_manager)
        self.scheduler = Scheduler(max_batch, max_num_batched_tokens, policy, kv=kv)
        self.requests: list[SimRequest] = []
        self.num_steps = 0

    def add_request(
        self, prompt_len: int, output_len: int, prompt_token_ids: list[int] | None = None
    ) -> SimRequest:
        req = SimRequest(len(self.requests), prompt_len, output_len, prompt_token_ids)
        self.requests.append(req)
        self.scheduler.add(req)
        return req

    def step(self) -> StepReport:
        chunks = self.scheduler.schedule()
        self.scheduler.finish_step(chunks)
        self.num_steps += 1
        finished = []
        for chunk in chunks:
            req = chunk.request
            if req.num_uncomputed_tokens:
                continue  # a prefill chunk that did not reach the end samples nothing
            req.num_generated += 1
            req.num_tokens += 1
            req.output_token_ids.append(-1 - req.request_id)  # a fake token per request
            if req.num_generated == req.output_len:
                self.scheduler.retire(req)
                req.finish_step = self.num_steps
                finished.append(req.request_id)
        return StepReport(
            self.num_steps,
            [(c.request.request_id, c.num_tokens) for c in chunks],
            finished,
            len(self.scheduler.running),
        )

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


# ANCHOR: arithmetic
def simulate_batching(output_lens: list[int], max_batch: int, policy: str) -> BatchingStats:
    """All requests arrive at step 0 with one-token prompts; count steps and idle slots."""
    sim = ContinuousBatchingScheduler(max_batch, policy=policy)
    for n in output_lens:
        sim.add_request(prompt_len=1, output_len=n)
    steps = len(sim.run())
    return BatchingStats(steps, steps * max_batch - sum(output_lens))


def static_batching_steps(output_lens: list[int], max_batch: int) -> BatchingStats:
    return simulate_batching(output_lens, max_batch, "static")


def continuous_batching_steps(output_lens: list[int], max_batch: int) -> BatchingStats:
    return simulate_batching(output_lens, max_batch, "continuous")
# ANCHOR_END: arithmetic
