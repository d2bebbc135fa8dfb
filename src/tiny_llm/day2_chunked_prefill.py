"""Day 2: chunked prefill — one token budget per step, decodes first.

A step of the engine is one forward over a flat batch of at most
``max_num_batched_tokens`` tokens. Filling it is a packing problem with one rule that
protects latency: **every running request's decode token is placed first**, and prefill
work only fills what is left. A long prompt therefore arrives in chunks over several
steps, and requests that are already generating keep producing one token per step while
it does (no prefill can starve them).

Chunked prefill is exact: a chunk's queries attend to every earlier token of the
sequence (already in the cache) plus the causal part of the chunk itself, so the K/V and
logits equal those of a one-shot prefill.

Invariants of ``TokenBudget`` (the scheduler in ``day1_batching`` asks it for every row):

- what it hands out never exceeds ``max_num_batched_tokens`` in a step;
- a prefill chunk is ``1 <= n <= tokens the request still needs``;
- with ``chunked=False`` a prefill is granted whole or not at all (Day 1's behaviour);
- the scheduler asks for all decode tokens before any prefill chunk.
"""

from __future__ import annotations


# ANCHOR: token_budget
class TokenBudget:
    """The tokens one step may still schedule."""

    def __init__(self, max_num_batched_tokens: int, chunked: bool = True):
        self.left = max_num_batched_tokens
        self.chunked = chunked

    def take_decode(self) -> bool:
        if self.left == 0:
            return False
        self.left -= 1
        return True

    def take_prefill(self, needed: int) -> int:
        """Size of the chunk granted to a prefill that needs ``needed`` tokens (0: none)."""
        if self.left == 0 or (not self.chunked and needed > self.left):
            return 0
        granted = min(needed, self.left)
        self.left -= granted
        return granted

    def give_back(self, tokens: int) -> None:
        """Return tokens that were granted but not scheduled (preemption, or no KV room)."""
        self.left += tokens
# ANCHOR_END: token_budget
