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

The drafts may form a tree (``TokenTree``: several guesses per position, a chain being the
tree of one child per node). Its nodes are the extra rows of the request's chunk, breadth
first; a node sits at the position its depth gives and sees the committed tokens and its
own ancestors only (``StepBatch.tree``; ``tree_attention`` is that mask in plain MLX ops,
the reference the engine's masks and kernels are checked against). ``tree_accept`` walks
down from the root, trying each node's children in turn on the residual the last rejection
left, and the accepted path's K/V moves into the rows right after the last token
(``move_accepted``) before the rest is rewound. Both proposers grow trees: prompt lookup
from several earlier occurrences, the draft model one forward per depth.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tiny_llm.day3_paged_kv import PagedKVStorage, PageTables, slots_for
from tiny_llm.sampling.params import SamplingParams
from tiny_llm.sampling.sampler import filter_logits
from tiny_llm.step.batch import Drafts, Emitted, ScheduledChunk, TokenTree
from tiny_llm.step.dense_kv import causal_attention
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


# ANCHOR: tree_attention
def tree_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                   drafts: Drafts) -> mx.array:
    """A verifying chunk's attention in plain MLX ops: the reference that the engine's tree
    masks and kernels are checked against. ``q [1 + n, Hq, D]``: the rows of the request's
    last token and of its ``n`` drafts; ``k, v [S, Hkv, D]``: the sequence's keys, draft
    ``i``'s at ``S - n + i``. The last token's row sees the keys up to its own; draft
    ``i``'s row sees those, its ancestors and itself, never a sibling or a cousin."""
    # TASK 6.4: tree_attention — The tree mask
    n, num_keys = len(drafts), k.shape[0]
    visible = np.zeros((1 + n, num_keys), dtype=bool)
    visible[:, : num_keys - n] = True
    for i in range(n):
        node = i
        while node >= 0:
            visible[1 + i, num_keys - n + node] = True
            node = drafts.parent(node)
    return causal_attention(q, k, v, scale, num_keys - n - 1, mx.array(visible))
    # END TASK
# ANCHOR_END: tree_attention


# ANCHOR: tree_accept
def tree_accept(drafts: Drafts, target_probs: np.ndarray, draft_probs: np.ndarray,
                rng: np.random.Generator) -> tuple[list[int], int]:
    """The path of drafts to keep (their indices, from the root down), and the token after it.

    ``target_probs [k + 1, V]``: the model's distribution after the request's last token
    (row 0) and after each draft (row ``1 + i``); ``draft_probs [k, V]``: the distribution
    each draft was drawn from (one-hot for a deterministic proposer). From the root, a
    node's children are tried in order: child ``c`` is kept with probability
    ``min(1, p(x_c) / q_c(x_c))`` and becomes the node; a rejected child turns ``p`` into
    the normalised residual ``max(0, p - q_c)`` for the next sibling; when no child is kept,
    the token is drawn from ``p``. Each sibling is one draw of its own (siblings drawn with
    replacement, or deterministic ones), so each try is the chain's rule on the residual
    the last one left, and the emitted token follows the model's distribution. A chain
    (one child per node) is exactly ``speculative_accept``."""
    # TASK 6.5: tree_accept — The rule over a tree
    children: list[list[int]] = [[] for _ in range(len(drafts) + 1)]  # by row: 0 the root
    for i in range(len(drafts)):
        children[drafts.parent(i) + 1].append(i)
    path: list[int] = []
    row = 0
    while True:
        p = target_probs[row]
        for child in children[row]:
            token, q = drafts.tokens[child], draft_probs[child]
            if q[token] > 0 and rng.random() < min(1.0, p[token] / q[token]):
                path.append(child)
                row = child + 1
                break
            residual = np.maximum(p - q, 0.0)
            p = residual / residual.sum()
        else:
            return path, _draw(p, rng)
    # END TASK
# ANCHOR_END: tree_accept


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


def move_rows(kv: PagedKVStorage, request: Request, src: list[int], dst: list[int]) -> None:
    """``request``'s K/V rows at positions ``src`` copied to positions ``dst``, in every
    layer: all read, then all written. The rows read are evaluated before the pool's write
    refers to them, so that nothing else holds the pool and the write happens in place."""
    table = kv.table(request)
    src_slots, dst_slots = (mx.array([slots_for(table, p, p + 1, kv.page_size)[0]
                                      for p in positions], dtype=mx.int32)
                            for positions in (src, dst))
    for layer in range(len(kv.pool.k)):
        k, v = kv.pool.gather(layer, src_slots)
        mx.eval(k, v)
        kv.pool.write(layer, dst_slots, k, v)


# ---------------------------------------------------------------------------- proposers


# ANCHOR: ngram
class NgramProposer:
    """Prompt lookup: find the sequence's last ``n`` tokens earlier in the sequence (the
    longest n first) and propose the ``k`` tokens that followed that occurrence."""

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, requests: list[Request], trees: list[TokenTree]) -> list[Drafts]:
        """Per request, the nodes of its tree that earlier text continues: the root's child
        of rank r is the first token of the r-th continuation found, each continuing as a
        chain (nodes ``(r, 0, 0, ...)``); nodes it has no token for are left out."""
        drafts = []
        for request, tree in zip(requests, trees, strict=True):
            found = self.continuations(request.token_ids_between(0, request.num_tokens),
                                       tree.depth, tree.width)
            index: dict[tuple[int, ...], int] = {}
            tokens, parents = [], []
            for path in tree.paths:  # parents first
                rank, depth = path[0], len(path)
                if any(path[1:]) or rank >= len(found) or depth > len(found[rank]):
                    continue
                index[path] = len(tokens)
                tokens.append(found[rank][depth - 1])
                parents.append(index[path[:-1]] if depth > 1 else -1)
            drafts.append(Drafts(tuple(tokens), parents=tuple(parents)))
        return drafts

    def continuations(self, tokens: list[int], k: int, width: int) -> list[list[int]]:
        """Up to ``width`` continuations of at most ``k`` tokens, each starting with a token
        of its own: ``lookup``'s first, then those after other earlier occurrences of the
        sequence's last token, ranked as ``lookup`` ranks them (the longer the suffix they
        match, at least ``min_n`` and at most ``max_n`` tokens, then the later)."""
        first = self.lookup(tokens, k)
        if not first or width == 1:  # no occurrence at all, or a chain: lookup's alone
            return [first] if first else []
        found, last = [first], len(tokens) - 1

        def matched(end: int) -> int:  # suffix tokens that tokens[.. end] ends with
            n = 0
            while n < self.max_n and n <= end and tokens[end - n] == tokens[last - n]:
                n += 1
            return n

        for n, end in sorted(((matched(e), e) for e in range(last)), reverse=True):
            if len(found) >= width or n < self.min_n:
                break
            after = tokens[end + 1 : end + 1 + k]
            if after and all(f[0] != after[0] for f in found):
                found.append(after)
        return found

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


def _top(scores: np.ndarray, n: int) -> list[int]:
    """The ``n`` highest-scoring tokens, best first (equal scores among them: the lower id
    first, as argmax)."""
    if n == 1:
        return [int(np.argmax(scores))]
    nth = np.partition(scores, len(scores) - n)[len(scores) - n]  # the n-th best score
    above = np.flatnonzero(scores > nth)
    tied = np.flatnonzero(scores == nth)[: n - len(above)]
    return sorted([*above.tolist(), *tied.tolist()], key=lambda t: (-scores[t], t))


class _GrowingTree:
    """A request's tree of drafts as the draft model grows it, one depth per forward. The
    draft reads it as a sequence: the request's tokens, then a chain's drafts as they come."""

    def __init__(self, request: Request, tree: TokenTree):
        self.request, self.tree = request, tree
        self.sequence = request.token_ids_between(0, request.num_tokens)
        self.tokens: list[int] = []  # the nodes so far, breadth first (as tree.paths)
        self.probs: list[np.ndarray] = []
        self.parents: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.sequence)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        return self.sequence[start:end]

    def chunk(self, depth: int, computed: int) -> ScheduledChunk:
        """The rows whose logits give the nodes at ``depth``. A chain's: the tokens the draft
        has not computed (the request's new ones, then the last draft). A branching tree's,
        past depth 1: the request's last token and every node so far, each node's row seeing
        its own path (``Drafts``), its K/V written again to the same rows."""
        n = self.request.num_tokens
        if depth == 1 or self.tree.is_chain:
            return ScheduledChunk(self, computed, self.num_tokens)
        return ScheduledChunk(self, n - 1, n + len(self.tokens),
                              Drafts(tuple(self.tokens), parents=tuple(self.parents)))

    def grow(self, depth: int, logits: mx.array, vocab: int) -> None:
        """The nodes at ``depth`` from ``logits`` (the chunk's logit rows): a node's
        children are the top-ranked tokens after it for a greedy request, else as many
        draws from the draft's distribution, with replacement and the request's generator
        (each sibling a draw of its own: ``tree_accept``'s proof needs it)."""
        params, rng = self.request.params, self.request.sampler.rng
        first = len(self.tokens)
        for path in self.tree.paths:
            if len(path) != depth or path[-1] > 0:
                continue
            parent = self.tree.paths.index(path[:-1]) if depth > 1 else -1
            row = logits[0 if parent < 0 or self.tree.is_chain else 1 + parent]
            scores = np.array(row.astype(mx.float32))
            q = distribution(scores, params, vocab)
            n = sum(1 for p in self.tree.paths if p[:-1] == path[:-1])
            tokens = _top(scores, n) if params.greedy else [_draw(q, rng) for _ in range(n)]
            self.tokens += tokens
            self.probs += [q] * n
            self.parents += [parent] * n
        if self.tree.is_chain:
            self.sequence += self.tokens[first:]

    def drafts(self) -> Drafts:
        return Drafts(tuple(self.tokens), np.stack(self.probs) if self.probs else None,
                      None if self.tree.is_chain else tuple(self.parents))


class DraftModelProposer:
    """A smaller model with the same tokenizer drafts each request's tree (a chain of ``k``
    by default), one draft forward per depth, sampled with the request's own parameters and
    generator. It runs through a model runner of its own (the engine's ``ModelRunner`` over
    the draft's paged KV pool: its own block tables, keyed by the request objects as the
    target's are)."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.kv: PagedKVStorage = runner.kv
        self.computed: dict[Request, int] = {}  # tokens of the request whose K/V it holds

    def propose(self, requests: list[Request], trees: list[TokenTree]) -> list[Drafts]:
        vocab = self.runner.model.config.vocab_size
        growing = [_GrowingTree(r, t) for r, t in zip(requests, trees, strict=True)]
        active = growing
        for depth in range(1, max((t.depth for t in trees), default=0) + 1):
            active = [g for g in active if depth <= g.tree.depth]
            chunks = [g.chunk(depth, self.computed.get(g.request, 0)) for g in active]
            # The draft's pool full: those requests verify the nodes they have so far.
            fits = [self.kv.allocate(g.request, c.end) for g, c in zip(active, chunks, strict=True)]
            active = [g for g, ok in zip(active, fits, strict=True) if ok]
            chunks = [c for c, ok in zip(chunks, fits, strict=True) if ok]
            if not active:
                break
            # The draft reads its own token sequences, in the pages of the requests' tables.
            batch, logits = self.runner.run(chunks, self.kv.layout(
                [replace(c, request=g.request) for g, c in zip(active, chunks, strict=True)]))
            rows = np.cumsum([0, *batch.num_logits])
            for i, (g, chunk) in enumerate(zip(active, chunks, strict=True)):
                # K/V past the request's tokens is a chain's drafts' alone (a tree's nodes
                # sit breadth first, not where an accepted path puts them).
                self.computed[g.request] = chunk.end if g.tree.is_chain else g.request.num_tokens
                g.grow(depth, logits[rows[i] : rows[i + 1]], vocab)
        return [g.drafts() for g in growing]

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
    """Which drafts to propose for each request: the tree (a chain of
    ``num_speculative_tokens`` by default). Verification rows cost little while a step is
    small, but a full batch is already compute-bound: past ``max_batch`` running requests,
    drafting is off (``benches/bench_week3_speculative.py`` measures where)."""

    tree: TokenTree
    max_batch: int

    def tree_for(self, num_running: int) -> TokenTree | None:
        return self.tree if num_running <= self.max_batch else None
# ANCHOR_END: policy


@dataclass
class SpeculativeDecoding:
    """The engine's speculation: drafts proposed before the schedule and given rows after
    it, verified after the forward; after the commit, the pages of rejected drafts rewound
    and the proposer brought up to the requests' tokens."""

    proposer: Any
    policy: SpeculationPolicy
    vocab: int
    tables: PagedKVStorage  # the target's pages, where draft rows are written
    max_num_batched_tokens: int  # the step's budget, which draft rows share
    counters: dict[str, int] = field(default_factory=lambda: {
        "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_verify_steps": 0})
    # acceptance_histogram[n]: verification steps that kept n drafts
    acceptance_histogram: list[int] = field(default_factory=list)
    # rank_tries[r], rank_accepts[r]: children of rank r tried, and kept (a chain: rank 0)
    rank_tries: list[int] = field(default_factory=list)
    rank_accepts: list[int] = field(default_factory=list)
    # verified_shapes[paths]: verification steps whose drafts had that shape (TokenTree paths)
    verified_shapes: dict[tuple[tuple[int, ...], ...], int] = field(default_factory=dict)

    def propose(self, running: list[Request]) -> dict[Request, Drafts]:
        """Drafts for the running requests that are decoding (before the step's schedule)."""
        tree = self.policy.tree_for(len(running))
        decoding = [r for r in running if r.num_uncomputed_tokens == 1 and r.params.drafts_allowed]
        if tree is None or not decoding:
            return {}
        # No draft deeper than the tokens a request may still emit after this step's.
        trees = {r: tree.pruned(min(r.max_model_len - r.num_tokens - 1,
                                    (r.params.max_tokens or 1 << 30) - len(r.output_token_ids) - 1))
                 for r in decoding}
        asked = [r for r in decoding if trees[r] is not None]
        proposals = zip(asked, self.proposer.propose(asked, [trees[r] for r in asked]),
                        strict=True)
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
                    kept = Drafts(drafts.tokens[:n],  # parents first: still a tree
                                  None if drafts.probs is None else drafts.probs[:n],
                                  None if drafts.parents is None else drafts.parents[:n])
                    chunk = replace(chunk, end=chunk.end + n, drafts=kept)
            out.append(chunk)
        return out

    def move_accepted(self, chunks: list[ScheduledChunk], accepted: dict[Request, Emitted]
                      ) -> None:
        """The step is verified: each accepted draft's K/V moves to the row its depth puts
        it at (the rows after the request's last token, in order), where a tree left it
        elsewhere. A chain's accepted drafts are there already."""
        for chunk in chunks:
            if chunk.drafts is None:
                continue
            first = chunk.end - chunk.num_drafts  # draft i's row: first + i
            moves = [(first + i, first + depth)
                     for depth, i in enumerate(accepted[chunk.request].accepted) if i != depth]
            if moves:
                move_rows(self.tables, chunk.request, *map(list, zip(*moves, strict=True)))

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

    def verify(self, request: Request, drafts: Drafts, logits: mx.array) -> Emitted:
        """Accept or reject ``drafts`` given the model's ``k + 1`` logit rows for them."""
        params = request.params
        target = np.stack([distribution(logits[i], params, self.vocab)
                           for i in range(len(drafts) + 1)])
        tokens, q = list(drafts.tokens), drafts.probs
        if q is None or params.greedy:  # deterministic proposal: one-hot on each draft
            q = np.zeros((len(tokens), self.vocab))
            q[np.arange(len(tokens)), tokens] = 1.0
        if drafts.is_chain:
            n, bonus = speculative_accept(tokens, target, q, request.sampler.rng)
            path = list(range(n))
        else:
            path, bonus = tree_accept(drafts, target, q, request.sampler.rng)
        n = len(path)
        self.counters["num_draft_tokens"] += len(tokens)
        self.counters["num_accepted_tokens"] += n
        self.counters["num_verify_steps"] += 1
        self.acceptance_histogram += [0] * (n + 1 - len(self.acceptance_histogram))
        self.acceptance_histogram[n] += 1
        self.count_tries(drafts, path)
        return Emitted([*(tokens[i] for i in path), bonus], tuple(path))

    def count_tries(self, drafts: Drafts, path: list[int]) -> None:
        """The shape verified, and per child rank the children tried and kept on the way
        down ``path``: a node's children are tried in rank order up to the one kept (all of
        them where none is)."""
        children: list[list[int]] = [[] for _ in range(len(drafts) + 1)]
        ranks: list[tuple[int, ...]] = []  # each draft's path of child ranks
        for i in range(len(drafts)):
            parent = drafts.parent(i)
            ranks.append((*(ranks[parent] if parent >= 0 else ()), len(children[parent + 1])))
            children[parent + 1].append(i)
        shape = tuple(ranks)
        self.verified_shapes[shape] = self.verified_shapes.get(shape, 0) + 1
        row = 0
        for depth in range(len(path) + 1):
            kept = path[depth] if depth < len(path) else None
            for rank, child in enumerate(children[row]):
                for counts in (self.rank_tries, self.rank_accepts):
                    counts += [0] * (rank + 1 - len(counts))
                self.rank_tries[rank] += 1
                if child == kept:
                    self.rank_accepts[rank] += 1
                    break
            if kept is None:
                return
            row = kept + 1

    def stats(self) -> dict[str, Any]:
        """Counters; ``mean_acceptance_length``: drafts kept per verification step."""
        steps = self.counters["num_verify_steps"]
        return {**self.counters, "acceptance_histogram": list(self.acceptance_histogram),
                "rank_tries": list(self.rank_tries), "rank_accepts": list(self.rank_accepts),
                "verified_shapes": [[list(map(list, shape)), n]
                                    for shape, n in self.verified_shapes.items()],
                "mean_acceptance_length":
                    (self.counters["num_accepted_tokens"] / steps) if steps else 0.0}
