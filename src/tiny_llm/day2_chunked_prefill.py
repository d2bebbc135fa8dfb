"""Day 2: chunked prefill — one token budget per step, decodes first.

A step of the engine is one forward over a flat batch of at most
``max_num_batched_tokens`` tokens. Day 1 prefilled a prompt whole: a long prompt made
one huge step, and every running request waited for it. Here a prompt is cut into
chunks that fit what the step has left, and the budget is filled with one rule that
protects latency: **every running request's decode token is placed first**, prefill
chunks only fill what is left, oldest request first. A long prompt therefore arrives over
several steps, while requests that are already generating keep producing one token per
step (no prefill can starve them).

Chunked prefill is exact: a chunk's queries attend to every earlier token of the sequence
(already in the cache) plus the causal part of the chunk itself, so the K/V and logits
equal those of a one-shot prefill.

Invariants of ``TokenBudget``:

- what it hands out never exceeds ``max_num_batched_tokens`` in a step;
- a prefill chunk is ``1 <= n <= tokens the request still needs``;
- the scheduler asks for all decode tokens before any prefill chunk.
"""

from __future__ import annotations

from tiny_llm.day1_batching import Scheduler, StepBudget


# ANCHOR: token_budget
class TokenBudget(StepBudget):
    """Day 1's budget, but a prefill takes whatever the step has left."""

    def take_prefill(self, needed: int) -> int:
        granted = min(needed, self.left)
        self.left -= granted
        return granted
# ANCHOR_END: token_budget


# ANCHOR: chunked_scheduler
class ChunkedPrefillScheduler(Scheduler):
    """Day 1's scheduler with chunked prefill (``chunked=False`` keeps Day 1's whole
    prefills) and decodes scheduled before any prefill chunk."""

    def __init__(self, *args, chunked: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunked = chunked

    def new_budget(self) -> StepBudget:
        if self.chunked:
            return TokenBudget(self.max_num_batched_tokens)
        return StepBudget(self.max_num_batched_tokens)

    def running_order(self) -> list:
        decodes = [r for r in self.running if r.num_uncomputed_tokens == 1]
        prefills = [r for r in self.running if r.num_uncomputed_tokens > 1]
        return decodes + prefills  # prefills keep admission order: the oldest goes first
# ANCHOR_END: chunked_scheduler
