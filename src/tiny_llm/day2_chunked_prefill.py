"""Day 2: chunked prefill — one token budget per step, decodes first.

A step of the engine is one forward over a flat batch of at most
``max_num_batched_tokens`` tokens. Day 1 prefilled a prompt whole: a long prompt made
one huge step, and every running request waited for it. Here a prompt is cut into
chunks that fit what the step has left, and the budget is filled with one rule that
protects latency: **every running request's decode token is placed first**, prefill
chunks only fill what is left, oldest request first. A long prompt therefore arrives over
several steps, while requests that are already generating keep producing one token per
step (no prefill can starve them).

Fairness between prefills: the oldest prompt takes what the step has left, so one long
prompt can still hold back a short one that arrived with it (head-of-line blocking among
prefills). ``long_prefill_token_threshold`` caps the chunk any one request takes per
step; what is left goes to the next prompt in line (vLLM has the same knob).

Chunked prefill is exact: a chunk's queries attend to every earlier token of the sequence
(already in the cache) plus the causal part of the chunk itself, so the K/V and logits
equal those of a one-shot prefill.

Invariants of ``TokenBudget``:

- what it hands out never exceeds ``max_num_batched_tokens`` in a step;
- a prefill chunk is ``1 <= n <= tokens the request still needs`` (and at most the
  threshold, when one is set);
- the scheduler asks for all decode tokens before any prefill chunk.
"""

from __future__ import annotations

from tiny_llm.day1_batching import Scheduler, StepBudget


# ANCHOR: token_budget
class TokenBudget(StepBudget):
    """Day 1's budget, but a prefill takes whatever the step has left (up to a threshold)."""

    def __init__(self, max_num_batched_tokens: int, max_chunk: int | None = None):
        super().__init__(max_num_batched_tokens)
        self.max_chunk = max_chunk

    def take_prefill(self, needed: int) -> int:
        # TASK 2.1: TokenBudget.take_prefill — Chunks
        granted = min(needed, self.left)
        # END TASK
        if self.max_chunk is not None:
            # TASK 2.3: the long-prefill threshold — Fairness between prompts
            granted = min(granted, self.max_chunk)
            # END TASK
        self.left -= granted
        return granted
# ANCHOR_END: token_budget


# ANCHOR: chunked_scheduler
class ChunkedPrefillScheduler(Scheduler):
    """Day 1's scheduler with chunked prefill (``chunked=False`` keeps Day 1's whole
    prefills) and decodes scheduled before any prefill chunk."""

    def __init__(self, *args, chunked: bool = True,
                 long_prefill_token_threshold: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunked = chunked
        self.long_prefill_token_threshold = long_prefill_token_threshold

    def new_budget(self) -> StepBudget:
        if self.chunked:
            return TokenBudget(self.max_num_batched_tokens, self.long_prefill_token_threshold)
        return StepBudget(self.max_num_batched_tokens)

    def running_order(self) -> list:
        # TASK 2.2: ChunkedPrefillScheduler.running_order — Decodes first
        decodes = [r for r in self.running if r.num_uncomputed_tokens == 1]
        prefills = [r for r in self.running if r.num_uncomputed_tokens > 1]
        return decodes + prefills  # prefills keep admission order: the oldest goes first
        # END TASK
# ANCHOR_END: chunked_scheduler
