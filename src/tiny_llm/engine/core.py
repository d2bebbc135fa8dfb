"""The engine core: one step is schedule → run → commit.

1. The scheduler picks this step's work: a decode token for each running request and
   prefill chunks for the rest of the token budget (with speculation, a decoding request's
   drafts become extra rows of its chunk);
2. the model runner lays the chunks out once as one flat batch — token ids, positions,
   where each sequence's rows start, and the storage's typed layout — runs one forward
   (logits only at each sequence's last scheduled token, and only for sequences whose
   prompt is fully processed, plus the prompt rows of requests that score their prompt)
   and samples;
3. the commit records the step: computed tokens and page commits, rejected drafts'
   pages rewound, tokens appended, stops checked, finished requests retired (their slot
   and pages free at once), outputs routed to their owners.

A step is all-or-nothing. Everything that can fail (scheduling, the forward, sampling)
happens before anything is recorded; if it raises — an error, or Ctrl-C — no request
gains a token or loses text, seeded generators are rewound, and the next step continues
from there (admissions and preemptions the scheduler made stand: they are valid states,
and recomputed K/V is exact). The commit cannot fail and holds back Ctrl-C until it is
done. (With tensor parallelism, a step that fails after rank 0 sent it to the workers
ends the engine instead: ``tensor_parallel.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypedDict

from tiny_llm.day1_batching import Scheduler
from tiny_llm.engine.outputs import OutputRouter
from tiny_llm.engine.runner import ModelRunner, RunnerOutput, interrupts_held
from tiny_llm.speculative import SpeculativeDecoding
from tiny_llm.step.batch import StepBatch
from tiny_llm.step.request import Request


class EngineStats(TypedDict, total=False):
    """What ``stats()`` reports: the core's counters and queues, the pages' counts (paged
    K/V), and speculation's counters (with a proposer)."""

    num_steps: int
    num_prompt_tokens_computed: int
    num_generated_tokens: int
    num_preemptions: int
    num_running: int
    num_waiting: int  # waiting to be scheduled, and samples held for their first sample
    kv_cache_bytes: int
    num_pages: int
    num_free_pages: int
    page_size: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_verify_steps: int
    acceptance_histogram: list[int]
    rank_tries: list[int]  # per child rank of a tree (a chain: rank 0 only)
    rank_accepts: list[int]
    verified_shapes: list[list]  # [paths of child ranks, verification steps of that shape]
    mean_acceptance_length: float


@dataclass(frozen=True)
class EngineLoad:
    """The engine's load now, as a server admits and reports by it."""

    num_running: int
    num_waiting: int  # waiting to be scheduled, and samples held for their first sample
    num_pages: int | None  # the page pool's size (None: dense K/V)
    num_free_pages: int | None


class EngineCore:
    """The serving loop over one scheduler, one model runner and, optionally, speculation."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner,
                 spec: SpeculativeDecoding | None, outputs: OutputRouter,
                 shares_prompts: bool = False):
        self.scheduler, self.runner, self.spec, self.outputs = scheduler, runner, spec, outputs
        # Samples of one prompt after the first wait here until the first has computed the
        # prompt: then the prefix cache gives them its pages (shares_prompts: paged K/V
        # with prefix caching), and each computes only the prompt's last, partial page.
        self.shares_prompts = shares_prompts
        self.held_samples: list[tuple[Request, Request]] = []  # (sample, the first sample)
        self.counters = {"num_steps": 0, "num_prompt_tokens_computed": 0,
                         "num_generated_tokens": 0}

    # ANCHOR: step
    def step(self) -> None:
        self.reap_abandoned()
        self.release_held()
        proposals = self.spec.propose(self.scheduler.running) if self.spec is not None else {}
        chunks = self.scheduler.schedule()
        if proposals:
            chunks = self.spec.schedule_drafts(chunks, proposals)
        if not chunks:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler made no progress with requests waiting (a bug)")
            return
        batch, output = self.runner.execute(chunks, self.spec.verify if self.spec else None)
        with interrupts_held():
            self._commit(batch, output)
    # ANCHOR_END: step

    def _commit(self, batch: StepBatch, output: RunnerOutput) -> None:
        """Record a successful step. Pure bookkeeping: nothing here may raise."""
        for request, records in output.prompt_scores:
            request.prompt_logprobs += records
        emitted = dict(zip(batch.sampling, output.emitted, strict=True))
        # A verified chunk computed K/V for its last token and the accepted drafts only,
        # which must sit in the rows after it before pages are committed.
        if self.spec is not None:
            self.spec.move_accepted(batch.chunks, emitted)
        done = [replace(c, end=c.start + len(emitted[c.request].tokens), drafts=None)
                if c.drafts is not None else c for c in batch.chunks]
        self.scheduler.finish_step(done)
        if self.spec is not None:
            self.spec.rewind_rejected(batch.chunks)
        for chunk in batch.chunks:
            prompt_len = len(chunk.request.prompt_token_ids)
            self.counters["num_prompt_tokens_computed"] += max(0, min(chunk.end, prompt_len)
                                                               - chunk.start)
        for request, new in emitted.items():
            step_output = request.append_tokens(new.tokens)
            if step_output.finished:
                self.retire(request)
            elif self.spec is not None:
                self.spec.caught_up(request)
            self.outputs.route(request, step_output)
            self.counters["num_generated_tokens"] += len(step_output.new_token_ids)
        self.counters["num_steps"] += 1

    def add(self, request: Request, after: Request | None = None) -> None:
        """Queue ``request``; a sample ``after`` the first of its prompt waits for it."""
        if after is not None and self.shares_prompts:
            self.held_samples.append((request, after))
        else:
            self.scheduler.add(request)

    def release_held(self) -> None:
        """Queue the samples whose first sample has computed the prompt (or finished)."""
        ready = [(r, first) for r, first in self.held_samples if first.is_finished
                 or first.num_computed_tokens >= len(first.prompt_token_ids)]
        for pair in ready:
            self.held_samples.remove(pair)
            self.scheduler.add(pair[0])

    def abort(self, request: Request) -> None:
        """Finish ``request`` with reason "abort", free its slot and pages, route the output."""
        delta = request.finish("abort")
        self.retire(request)
        self.outputs.route(request, request.output([], delta))

    def retire(self, request: Request) -> None:
        self.held_samples = [(r, first) for r, first in self.held_samples if r is not request]
        self.scheduler.retire(request)
        if self.spec is not None:
            self.spec.release(request)

    def drop(self, requests: list[Request]) -> None:
        """Abort and forget requests whose owner is gone (their outputs go nowhere)."""
        for request in requests:
            if not request.is_finished:
                self.retire(request)
                request.finish("abort")
            self.outputs.release(request)

    def reap_abandoned(self) -> None:
        """Abort the requests of streams that were dropped before their end."""
        abandoned = self.outputs.abandoned
        while abandoned:
            request = abandoned.popleft()
            if not request.is_finished:
                self.abort(request)
            self.outputs.release(request)

    def has_unfinished(self) -> bool:
        self.reap_abandoned()
        return (self.scheduler.has_unfinished() or bool(self.held_samples)
                or bool(self.outputs.pending))

    def stats(self) -> EngineStats:
        kv = self.runner.kv
        return EngineStats(
            **self.counters,
            num_preemptions=self.scheduler.num_preemptions,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.held_samples),
            kv_cache_bytes=kv.nbytes(),
            **kv.stats(),
            **(self.spec.stats() if self.spec is not None else {}),
        )

    def current_load(self) -> EngineLoad:
        pages = self.runner.kv.stats()
        waiting = len(self.scheduler.waiting) + len(self.held_samples)
        return EngineLoad(len(self.scheduler.running), waiting, pages.get("num_pages"),
                          pages.get("num_free_pages"))
