"""Speculative decoding over the rewindable paged cache, inside continuous batching.

A decode step computes one token per request, and most of its cost is reading the weights
and the pages; computing ``k + 1`` rows of one request costs little more than one. So a
cheap *proposer* guesses the next ``k`` tokens, and one forward of the model *verifies*
them all: the last sampled token plus the ``k`` drafts are ``k + 1`` query rows of the
request — a small prefill chunk, which Day 5's tiled schedule serves in the same mixed
forward as other requests' decodes and prefill chunks.

The acceptance rule keeps the output distribution exactly the model's (``speculative_accept``):
draft token ``x_i`` (proposed with probability ``q_i(x_i)``) is accepted with probability
``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection a token is drawn from the normalised
residual ``max(0, p_i - q_i)``; if all ``k`` are accepted, a bonus token is drawn from
``p_k``. Each step emits between 1 and ``k + 1`` tokens. Why it is lossless, in one line:
the chance of emitting ``x`` at position i is ``min(p, q)(x) + (1 - Σ min(p, q)) ·
(p - q)⁺(x) / Σ (p - q)⁺ = min(p, q)(x) + (p - q)⁺(x) = p(x)``, since ``1 - Σ min(p, q) =
Σ (p - q)⁺``. Greedy decoding reduces to "accept while the draft equals the argmax".

Two proposers: ``NgramProposer`` (prompt lookup: the tokens that followed the last
occurrence of the sequence's final n-gram; no model, useful for text that repeats its
input) and ``DraftModelProposer`` (a smaller model with the same tokenizer and its own
paged KV pool).

Rejected tokens must leave the cache exactly (``rewind``): their K/V was written into
pages during verification, so pages past the accepted length go back to the pool, the tail
page shrinks, and the pages they filled are never published to the prefix cache (the
scheduler commits pages only up to the accepted length).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tiny_llm.day3_paged_kv import PagedKVStorage, PageTables
from tiny_llm.sampling.params import SamplingParams
from tiny_llm.sampling.sampler import filter_logits
from tiny_llm.step.batch import Drafts, ScheduledChunk
from tiny_llm.step.request import Request

import mlx.core as mx
import numpy as np

SPECULATIVE = ("off", "draft", "ngram")


# ANCHOR: accept
def speculative_accept(draft_tokens: list[int], target_probs: np.ndarray,
                       draft_probs: np.ndarray, rng: np.random.Generator) -> tuple[int, int]:
    """How many of ``draft_tokens`` to keep, and the token that follows them.

    ``target_probs [k + 1, V]``: the model's distribution at each draft position and after
    the last one; ``draft_probs [k, V]``: the proposer's (one-hot for a deterministic
    proposer). Returns ``(num_accepted, bonus_token)``."""
    # TASK 6.1: speculative_accept — The acceptance rule
    for i, token in enumerate(draft_tokens):
        p, q = target_probs[i, token], draft_probs[i, token]
        if q > 0 and rng.random() < min(1.0, p / q):
            continue
        residual = np.maximum(target_probs[i] - draft_probs[i], 0.0)
        return i, _draw(residual, rng)
    return len(draft_tokens), _draw(target_probs[len(draft_tokens)], rng)
    # END TASK
# ANCHOR_END: accept


def _draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """A token drawn with probability proportional to ``weights`` (inverse CDF)."""
    cum = np.cumsum(weights, dtype=np.float64)
    return int(min(np.searchsorted(cum, rng.random() * cum[-1], side="right"), len(cum) - 1))


def distribution(logits_row: mx.array | np.ndarray, params: SamplingParams,
                 vocab: int) -> np.ndarray:
    """The dense distribution the sampler draws from for ``params`` (filters included)."""
    ids, probs = filter_logits(logits_row, params)
    dense = np.zeros(vocab, dtype=np.float64)
    dense[ids] = probs
    return dense


# ANCHOR: rewind
def rewind(tables: PageTables, request: Any, num_tokens: int) -> None:
    """Shrink ``request``'s storage to its first ``num_tokens`` tokens: pages past them go
    back to the pool (``BlockManager.truncate``). Pages committed to the prefix cache hold
    accepted tokens only and are never rewound: asking for that is an error, and changes
    nothing."""
    # TASK 6.2: rewind — Rewinding the paged cache
    committed, _ = tables.cached_pages.get(request, (0, None))
    if committed * tables.blocks.block_size > num_tokens:
        raise ValueError(f"cannot rewind to {num_tokens} tokens: {committed} pages of "
                         "accepted tokens are committed to the prefix cache")
    tables.blocks.truncate(request, num_tokens)
    # END TASK
# ANCHOR_END: rewind


# ---------------------------------------------------------------------------- proposers


# ANCHOR: ngram
class NgramProposer:
    """Prompt lookup: find the sequence's last ``n`` tokens earlier in the sequence (the
    longest n first) and propose the ``k`` tokens that followed that occurrence."""

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, requests: list[Request], k: list[int]) -> list[Drafts]:
        return [Drafts(tuple(self.lookup(r.token_ids_between(0, r.num_tokens), n)))
                for r, n in zip(requests, k, strict=True)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        # TASK 6.3: NgramProposer.lookup — Proposing without a model
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # the latest occurrence first
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []
        # END TASK

    def rewind(self, request: Request) -> None:
        pass

    def release(self, request: Request) -> None:
        pass
# ANCHOR_END: ngram


class _DraftSequence:
    """A request's tokens followed by the drafts proposed so far (what the draft reads)."""

    def __init__(self, request: Request):
        self.tokens = request.token_ids_between(0, request.num_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


class DraftModelProposer:
    """A smaller model with the same tokenizer drafts ``k`` tokens per request, sampled with
    the request's own parameters and generator. It runs through a model runner of its own
    (the engine's ``ModelRunner`` over the draft's paged KV pool: its own block tables, keyed
    by the request objects as the target's are)."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.kv: PagedKVStorage = runner.kv
        self.computed: dict[Request, int] = {}  # tokens of the request whose K/V it holds

    def propose(self, requests: list[Request], k: list[int]) -> list[Drafts]:
        vocab = self.runner.model.config.vocab_size
        seqs = [_DraftSequence(r) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[np.ndarray]] = [[] for _ in requests]
        active = [i for i, n in enumerate(k) if n > 0]
        while active:
            # What the draft has not computed yet: a catch-up chunk the first time (the
            # request's new tokens), then the draft token it just proposed.
            active = [i for i in active if self.kv.allocate(requests[i], seqs[i].num_tokens)]
            if not active:
                break  # the draft's pool is full: those requests decode without drafts
            chunks = [ScheduledChunk(requests[i], self.computed.get(requests[i], 0),
                                     seqs[i].num_tokens) for i in active]
            # The draft reads its own token sequences, in the pages of the requests' tables.
            _, logits = self.runner.run([ScheduledChunk(seqs[i], c.start, c.end)
                                         for i, c in zip(active, chunks, strict=True)],
                                        self.kv.layout(chunks))
            for row, (i, chunk) in enumerate(zip(active, chunks, strict=True)):
                self.computed[requests[i]] = chunk.end
                q = distribution(logits[row], requests[i].params, vocab)
                token = _draw(q, requests[i].sampler.rng)
                drafts[i].append(token)
                probs[i].append(q)
                seqs[i].tokens.append(token)
            active = [i for i in active if len(drafts[i]) < k[i]]
        return [Drafts(tuple(d), np.stack(p) if p else None) for d, p in
                zip(drafts, probs, strict=True)]

    def rewind(self, request: Request) -> None:
        """The request's tokens changed (drafts rejected): keep only K/V of tokens it has."""
        valid = min(self.computed.get(request, 0), request.num_tokens - 1)
        if request in self.kv.blocks.tables:
            rewind(self.kv, request, valid)
        self.computed[request] = valid

    def release(self, request: Request) -> None:
        self.kv.free(request)
        self.computed.pop(request, None)


# ---------------------------------------------------------------- the engine's side


# ANCHOR: policy
@dataclass
class SpeculationPolicy:
    """How many tokens to draft for each request. Verification rows cost little while a
    step is small, but a full batch is already compute-bound: past ``max_batch`` running
    requests, drafting is off (``benches/bench_week3_speculative.py`` measures where)."""

    num_speculative_tokens: int
    max_batch: int

    def k(self, num_running: int) -> int:
        return self.num_speculative_tokens if num_running <= self.max_batch else 0
# ANCHOR_END: policy


@dataclass
class Verified:
    """The outcome of verifying one request's drafts."""

    tokens: list[int]  # accepted drafts, then the bonus token
    num_drafts: int


@dataclass
class SpeculativeDecoding:
    """The engine's speculation: drafts proposed before the schedule and given rows after
    it, verified after the forward; after the commit, the pages of rejected drafts rewound
    and the proposer brought up to the requests' tokens."""

    proposer: Any
    policy: SpeculationPolicy
    vocab: int
    tables: PageTables  # the target's page tables, where draft rows are written
    max_num_batched_tokens: int  # the step's budget, which draft rows share
    counters: dict[str, int] = field(default_factory=lambda: {
        "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_verify_steps": 0})
    # acceptance_histogram[n]: verification steps that kept n drafts
    acceptance_histogram: list[int] = field(default_factory=list)

    def propose(self, running: list[Request]) -> dict[Request, Drafts]:
        """Drafts for the running requests that are decoding (before the step's schedule)."""
        k = self.policy.k(len(running))
        decoding = [r for r in running if r.num_uncomputed_tokens == 1 and r.params.drafts_allowed]
        if not k or not decoding:
            return {}
        room = [max(0, min(k, r.max_model_len - r.num_tokens - 1,
                           (r.params.max_tokens or 1 << 30) - len(r.output_token_ids) - 1))
                for r in decoding]
        proposals = zip(decoding, self.proposer.propose(decoding, room), strict=True)
        return {request: drafts for request, drafts in proposals if drafts.tokens}

    def schedule_drafts(self, chunks: list[ScheduledChunk], proposals: dict[Request, Drafts]
                        ) -> list[ScheduledChunk]:
        """The step's chunks, a decode with drafts turned into a chunk of ``1 + k`` rows
        where the step's budget and the pool have room (else it decodes one token as usual).
        """
        left = self.max_num_batched_tokens - sum(c.num_tokens for c in chunks)
        out = []
        for chunk in chunks:
            req, drafts = chunk.request, proposals.get(chunk.request)
            if drafts and chunk.num_tokens == 1 and chunk.end == req.num_tokens:
                n = min(len(drafts), left)
                if n and self.tables.allocate(req, chunk.end + n):
                    left -= n
                    kept = Drafts(drafts.tokens[:n], None if drafts.probs is None
                                  else drafts.probs[:n])
                    chunk = replace(chunk, end=chunk.end + n, drafts=kept)
            out.append(chunk)
        return out

    def rewind_rejected(self, chunks: list[ScheduledChunk]) -> None:
        """The step is committed: the pages of drafts that were not accepted go back to the
        pool (the scheduler has recorded what was computed: the accepted ones)."""
        for chunk in chunks:
            if chunk.drafts is not None:
                rewind(self.tables, chunk.request, chunk.request.num_computed_tokens)

    def caught_up(self, request: Request) -> None:
        """``request``'s tokens grew by this step's: the proposer keeps only what it computed
        of tokens the request has."""
        self.proposer.rewind(request)

    def release(self, request: Request) -> None:
        self.proposer.release(request)

    def verify(self, request: Request, drafts: Drafts, logits: mx.array) -> Verified:
        """Accept or reject ``drafts`` given the model's ``k + 1`` logit rows for them."""
        params = request.params
        target = np.stack([distribution(logits[i], params, self.vocab)
                           for i in range(len(drafts) + 1)])
        tokens, q = list(drafts.tokens), drafts.probs
        if q is None or params.greedy:  # deterministic proposal: one-hot on each draft
            q = np.zeros((len(tokens), self.vocab))
            q[np.arange(len(tokens)), tokens] = 1.0
        n, bonus = speculative_accept(tokens, target, q, request.sampler.rng)
        self.counters["num_draft_tokens"] += len(tokens)
        self.counters["num_accepted_tokens"] += n
        self.counters["num_verify_steps"] += 1
        self.acceptance_histogram += [0] * (n + 1 - len(self.acceptance_histogram))
        self.acceptance_histogram[n] += 1
        return Verified([*tokens[:n], bonus], len(tokens))

    def stats(self) -> dict[str, Any]:
        """Counters; ``mean_acceptance_length``: drafts kept per verification step."""
        steps = self.counters["num_verify_steps"]
        return {**self.counters, "acceptance_histogram": list(self.acceptance_histogram),
                "mean_acceptance_length":
                    (self.counters["num_accepted_tokens"] / steps) if steps else 0.0}


def load_draft_model(target_model, target_tokenizer, draft) -> Any:
    """The draft model ``draft`` names (a path or hub id, loaded in the target's dtype, or a
    ``(Model, Tokenizer)`` pair), refused with a clear error unless it shares the target's
    tokenizer."""
    from tiny_llm.models.loader import load

    draft_model, draft_tokenizer = (load(draft, dtype=target_model.dtype)
                                    if isinstance(draft, str) else draft)
    if draft_model.config.vocab_size != target_model.config.vocab_size or (
        draft_tokenizer is not None and draft_tokenizer.vocab_size != target_tokenizer.vocab_size
    ):
        raise ValueError(
            f"the draft model must share the target's tokenizer: vocabularies of "
            f"{draft_model.config.vocab_size} and {target_model.config.vocab_size} tokens")
    if draft_tokenizer is not None and draft_tokenizer.encode("Hello, world! 123") != (
            target_tokenizer.encode("Hello, world! 123")):
        raise ValueError("the draft model's tokenizer encodes text differently from the target's")
    return draft_model
