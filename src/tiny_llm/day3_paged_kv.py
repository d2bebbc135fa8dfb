"""Day 3: paged KV cache — fixed-size pages from one shared pool.

Dense caches reserve memory per request; pages share one pool. A sequence's keys and
values live in pages of ``block_size`` token slots; its **block table** lists the pages
in order, so token position ``p`` lives in page ``table[p // block_size]`` at slot
``p % block_size``. One table per sequence serves every layer (each layer has its own
pool arrays indexed by the same page ids).

``BlockManager`` is the bookkeeping, model-free and exact:

- a sequence of ``n`` tokens holds exactly ``blocks_needed(n)`` pages: a new page is taken
  only when the tail page is full;
- every page is either free (reference count 0) or referenced by exactly as many block
  tables as point at it; free + used = total, always;
- with prefix caching, a full page is identified by a chained SHA-256 digest of (parent
  digest, its token ids), and a hit also compares the page's own token ids. Freed pages
  keep their identity and stay reusable until the allocator needs them, oldest first
  (LRU). A new request reuses every cached full page of its prompt, except that the last
  prompt token is always recomputed: its logits are needed.

``PageTables`` is the scheduler's view of the manager (room for requests, by page), and
``PagedScheduler`` extends Day 2's scheduler with what pages make possible and necessary:
admission reuses cached prefix pages, and when the pool is full the newest running
request is *preempted* (its pages freed, its K/V recomputed later) instead of failing.
``PagedKVStorage`` adds the page pool and lays out a step's block tables and slot mapping.
On Day 3 attention still *gathers* each sequence's K/V from its pages into a dense array
(``GatherAttention``): the correctness checkpoint that Day 4 removes.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from tiny_llm.day1_batching import BatchingSimulator, Scheduler
from tiny_llm.day2_chunked_prefill import ChunkedPrefillScheduler
from tiny_llm.step.batch import AttentionGeometry, PagedLayout, ScheduledChunk, StepBatch
from tiny_llm.step.dense_kv import causal_attention
from tiny_llm.step.request import RequestStatus

import mlx.core as mx
import numpy as np

log = logging.getLogger("tiny_llm")


# ANCHOR: block_math
def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Pages for ``num_tokens`` tokens: ceiling division."""
    # TASK 3.1: blocks_needed — Pages
    return -(-num_tokens // block_size)
    # END TASK


@dataclass
class Fragmentation:
    paged_wasted_slots: int  # empty slots in tail pages
    paged_total_slots: int  # slots in pages held
    dense_wasted_slots: int  # reserved for max_len but unused
    dense_total_slots: int

    @property
    def paged_fraction(self) -> float:
        return self.paged_wasted_slots / max(1, self.paged_total_slots)

    @property
    def dense_fraction(self) -> float:
        return self.dense_wasted_slots / max(1, self.dense_total_slots)


def kv_cache_blocks_fragmentation(
    seq_lens: Sequence[int], block_size: int, max_len: int | None = None
) -> Fragmentation:
    """Slots wasted by paging (tail pages) vs by reserving ``max_len`` per sequence."""
    # TASK 3.2: kv_cache_blocks_fragmentation — Fragmentation
    max_len = max(seq_lens, default=0) if max_len is None else max_len
    paged = sum(blocks_needed(n, block_size) * block_size for n in seq_lens)
    dense = max_len * len(seq_lens)
    used = sum(seq_lens)
    return Fragmentation(paged - used, paged, dense - used, dense)
    # END TASK
# ANCHOR_END: block_math


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the page is full and its tokens are known
    token_ids: tuple[int, ...] | None = None


# ANCHOR: page_hash
def page_hash(parent: bytes | None, page_tokens: tuple[int, ...]) -> bytes:
    """Chained digest of a full page: it names the page's tokens *and* everything before
    them. SHA-256, so prefixes cannot be made to collide on purpose (Python's ``hash`` of
    a tuple of ints is the same in every process and easy to collide)."""
    digest = hashlib.sha256(parent or b"")
    digest.update(b"".join(t.to_bytes(8, "little", signed=True) for t in page_tokens))
    return digest.digest()
# ANCHOR_END: page_hash


# ANCHOR: block_manager
class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Pages with ref_count 0, least recently freed first: the next to be (re)used.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # page hash -> page id
        self.tables: dict[object, list[int]] = {}
        self.lengths: dict[object, int] = {}  # tokens each sequence has room for

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def can_allocate(self, num_tokens: int) -> bool:
        return blocks_needed(num_tokens, self.block_size) <= self.num_free_blocks

    def allocate(self, seq_id: object, num_tokens: int) -> list[int] | None:
        """A new block table with room for ``num_tokens``; None (and no change) if full."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        self.tables[seq_id], self.lengths[seq_id] = [], 0
        if self.grow(seq_id, num_tokens) is None:
            del self.tables[seq_id], self.lengths[seq_id]
            return None
        return self.tables[seq_id]

    def append(self, seq_id: object) -> list[int] | None:
        """Room for one more token; a new page only when the tail page is full."""
        return self.grow(seq_id, 1)

    def grow(self, seq_id: object, num_tokens: int) -> list[int] | None:
        """Room for ``num_tokens`` more tokens, all or nothing; None if the pool is full."""
        # TASK 3.3: BlockManager.grow — Growing a sequence
        table = self.tables[seq_id]
        new_len = self.lengths[seq_id] + num_tokens
        missing = blocks_needed(new_len, self.block_size) - len(table)
        if missing > self.num_free_blocks:
            return None
        table.extend(self._take_free_block() for _ in range(missing))
        self.lengths[seq_id] = new_len
        return table
        # END TASK

    def truncate(self, seq_id: object, num_tokens: int) -> None:
        """Keep room for the first ``num_tokens`` tokens only. Each page past them loses the
        table's reference, tail first; a page no table holds goes back on the free list
        (keeping its cache identity). The only code that returns pages: ``free`` and
        speculative decoding's rewind call it."""
        # TASK 3.4: BlockManager.free — Freeing and reusing pages
        table = self.tables[seq_id]
        keep = blocks_needed(num_tokens, self.block_size)
        for block_id in reversed(table[keep:]):  # tail pages evicted first
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        del table[keep:]
        self.lengths[seq_id] = min(self.lengths[seq_id], num_tokens)
        # END TASK

    def free(self, seq_id: object) -> None:
        """Return every page of ``seq_id`` and forget its table; a sequence without one
        (never allocated, or freed already) is left alone."""
        # TASK 3.4: BlockManager.free — Freeing and reusing pages
        if seq_id in self.tables:
            self.truncate(seq_id, 0)
            del self.tables[seq_id], self.lengths[seq_id]
        # END TASK

    def _take_free_block(self) -> int:
        """The least recently freed page, with one reference; a page that was cached
        forgets its hash (its old contents are about to be overwritten)."""
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict the cached page this one held
            del self.cached[block.hash]
            block.hash = block.token_ids = None
        block.ref_count = 1
        return block_id
# ANCHOR_END: block_manager

    # ANCHOR: prefix_caching
    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached pages holding a prefix of ``token_ids``, excluding the last token."""
        # TASK 3.5: BlockManager.match_prefix — Prefix caching
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = None
        bs = self.block_size
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            page_tokens = tuple(token_ids[start : start + bs])
            parent = page_hash(parent, page_tokens)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != page_tokens:
                break
            hits.append(block_id)
        return hits
        # END TASK

    def attach_prefix(self, seq_id: object, block_ids: list[int]) -> None:
        """Start ``seq_id``'s table with shared cached pages (reference counts go up)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
        self.tables[seq_id] = list(block_ids)
        self.lengths[seq_id] = len(block_ids) * self.block_size

    def cache_full_blocks(
        self, seq_id: object, token_ids: Sequence[int], num_cached: int = 0,
        parent: bytes | None = None,
    ) -> tuple[int, bytes | None]:
        """Register the pages of ``seq_id`` that are full of computed tokens. ``num_cached``
        pages were handled before, ending the hash chain at ``parent``; returns both, updated,
        for next time. The chain is the sequence's own: a page that stays private (an
        identical one was cached first) has no hash, yet the pages after it still chain
        through its digest."""
        if not self.enable_prefix_caching:
            return num_cached, parent
        table, bs = self.tables[seq_id], self.block_size
        full = min(len(token_ids) // bs, len(table))
        for i in range(num_cached, full):
            page_tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = page_hash(parent, page_tokens)
            block = self.blocks[table[i]]
            # If an identical page is cached already, this copy stays private.
            if block.hash is None and parent not in self.cached:
                block.hash, block.token_ids = parent, page_tokens
                self.cached[parent] = block.block_id
        return max(full, num_cached), parent
    # ANCHOR_END: prefix_caching

    def check_invariants(self) -> None:
        """Every page is free xor referenced exactly as often as tables point at it."""
        refs: dict[int, int] = {}
        for table in self.tables.values():
            for block_id in table:
                refs[block_id] = refs.get(block_id, 0) + 1
        for block in self.blocks:
            want = refs.get(block.block_id, 0)
            assert block.ref_count == want, f"page {block.block_id}: {block.ref_count} != {want}"
            assert (want == 0) == (block.block_id in self.free_blocks), f"page {block.block_id}"
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].hash == h
        assert len(self.free_blocks) + len(refs) == self.num_blocks


# ANCHOR: block_space
class PageTables:
    """The scheduler's view of a ``BlockManager``: room for requests, by page.

    It answers questions and keeps page bookkeeping; it never changes a request's state
    (the scheduler does). ``match_prefix`` attaches a waiting request's cached prefix
    pages and says how many tokens they hold; ``commit`` registers pages a step filled.
    """

    def __init__(self, block_manager: BlockManager):
        self.blocks = block_manager
        # Per request: pages registered so far and the hash chain's last digest.
        self.cached_pages: dict[object, tuple[int, bytes | None]] = {}
        self._new_hits: dict[object, int] = {}  # hits of match_prefix, counted on success
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    def match_prefix(self, request) -> int:
        """Attach the cached pages holding a prefix of ``request``'s tokens; return how
        many tokens they hold (their K/V needs no computing)."""
        # A request may reuse less than it has: one that scores its prompt needs logits a
        # cached page does not have.
        tokens = request.token_ids_between(0, request.num_reusable_tokens)
        hits = self.blocks.match_prefix(tokens)
        self.blocks.attach_prefix(request, hits)
        chain = self.blocks.blocks[hits[-1]].hash if hits else None
        self.cached_pages[request] = (len(hits), chain)
        self._new_hits[request] = len(hits) * self.blocks.block_size
        return self._new_hits[request]

    def allocate(self, request, num_tokens: int) -> bool:
        if request not in self.blocks.tables:
            ok = self.blocks.allocate(request, num_tokens) is not None
        else:
            extra = num_tokens - self.blocks.lengths[request]
            ok = extra <= 0 or self.blocks.grow(request, extra) is not None
        if ok and request in self._new_hits:
            self.prefix_cache_query_tokens += request.num_tokens
            self.prefix_cache_hit_tokens += self._new_hits.pop(request)
        return ok

    def free(self, request) -> None:
        self.blocks.free(request)
        self.cached_pages.pop(request, None)
        self._new_hits.pop(request, None)

    def commit(self, request, num_computed: int) -> None:
        """``request``'s first ``num_computed`` tokens are in the pool: cache its full pages."""
        done, parent = self.cached_pages.get(request, (0, None))
        full = num_computed // self.blocks.block_size
        if not self.blocks.enable_prefix_caching or full <= done:
            return
        tokens = request.token_ids_between(0, full * self.blocks.block_size)
        self.cached_pages[request] = self.blocks.cache_full_blocks(request, tokens, done, parent)

    def table(self, request) -> list[int]:
        return self.blocks.tables[request]

    def layout(self, chunks: list[ScheduledChunk]) -> None:
        return None  # no pool: the model-free simulator's storage
# ANCHOR_END: block_space


# ANCHOR: paged_scheduler
class PagedScheduler(ChunkedPrefillScheduler):
    """Day 2's scheduler over pages: prefix hits at admission, preemption when full."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._preemptions_before_step = 0

    def schedule(self) -> list[ScheduledChunk]:
        self._preemptions_before_step = self.num_preemptions
        return super().schedule()

    def may_admit(self) -> bool:
        # A step that had to preempt is short of pages: admitting now would only thrash.
        return super().may_admit() and self.num_preemptions == self._preemptions_before_step

    def try_admit(self, req, budget) -> int:
        req.num_computed_tokens = self.kv.match_prefix(req)  # cached pages need no compute
        n = super().try_admit(req, budget)
        if n == 0:
            self.kv.free(req)
            req.num_computed_tokens = 0
        elif req.num_cached_tokens is None:  # what usage reports, as vLLM does
            req.num_cached_tokens = min(req.num_computed_tokens, len(req.prompt_token_ids))
        return n

    def make_room(self, req, num_tokens: int, plan: dict, budget) -> bool:
        """Allocate ``req``'s pages, preempting the newest running requests while the pool
        is full. Returns False when ``req`` itself had to go."""
        # TASK 3.7: PagedScheduler.make_room and preempt — Preemption
        while not self.kv.allocate(req, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim in plan:
                budget.give_back(plan.pop(victim))
            if victim is req:
                return False
        return True
        # END TASK

    def preempt(self, req) -> None:
        """Recompute preemption: drop the K/V, requeue at the front, redo the work later."""
        # TASK 3.7: PagedScheduler.make_room and preempt — Preemption
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        # END TASK

    def finish_step(self, chunks: list[ScheduledChunk]) -> None:
        super().finish_step(chunks)
        for chunk in chunks:
            self.kv.commit(chunk.request, chunk.end)
# ANCHOR_END: paged_scheduler


class PagedBatchingSimulator(BatchingSimulator):
    """The scheduler over a ``BlockManager``, driven by simulated requests (model-free):
    ``PagedBatchingSimulator(max_batch, block_manager).step()``."""

    def __init__(self, max_batch: int, block_manager: BlockManager,
                 max_num_batched_tokens: int = 1 << 30, policy: str = "continuous"):
        self.block_manager = block_manager
        super().__init__(max_batch, max_num_batched_tokens, policy)

    def make_scheduler(self, max_batch: int, max_num_batched_tokens: int,
                       policy: str) -> Scheduler:
        return PagedScheduler(max_batch, max_num_batched_tokens, policy,
                              kv=PageTables(self.block_manager))


# ANCHOR: page_pool
class PagePool:
    """Per-layer K and V pages, ``[num_pages, page_size, n_kv_heads, head_dim]``; a flat
    slot ``page * page_size + offset`` names one token row. The engine must hold the only
    reference to these arrays: MLX then performs the indexed write in place, costing
    O(new tokens); any other reference turns every write into a copy of the whole pool."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, n_kv_heads: int,
                 head_dim: int, dtype: mx.Dtype):
        shape = (num_pages, page_size, n_kv_heads, head_dim)
        self.k = [mx.zeros(shape, dtype) for _ in range(num_layers)]
        self.v = [mx.zeros(shape, dtype) for _ in range(num_layers)]
        self.page_size = page_size
        mx.eval(self.k, self.v)

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        pages, offsets = slots // self.page_size, slots % self.page_size
        self.k[layer][pages, offsets] = k
        self.v[layer][pages, offsets] = v

    def gather(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """Rows at ``slots`` as dense ``[len(slots), n_kv_heads, head_dim]`` arrays."""
        pages, offsets = slots // self.page_size, slots % self.page_size
        return self.k[layer][pages, offsets], self.v[layer][pages, offsets]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)
# ANCHOR_END: page_pool


# ANCHOR: slot_mapping
def slots_for(table: Sequence[int], start: int, end: int, page_size: int) -> list[int]:
    """Pool rows of positions ``start .. end - 1`` (address translation)."""
    # TASK 3.6: slots_for — Address translation
    return [table[p // page_size] * page_size + p % page_size for p in range(start, end)]
    # END TASK
# ANCHOR_END: slot_mapping


# ANCHOR: paged_space
class PagedKVStorage(PageTables):
    """Paged KV for the engine: the block manager, the page pool, and each step's layout:
    the block tables of the step's sequences (``-1`` past their pages), the pool slot of
    every new token, and the step's context lengths and query start locations as arrays."""

    def __init__(self, config, num_pages: int, page_size: int, enable_prefix_caching: bool,
                 dtype: mx.Dtype):
        super().__init__(BlockManager(num_pages, page_size, enable_prefix_caching))
        self.page_size = page_size
        self.pool = PagePool(config.num_hidden_layers, num_pages, page_size,
                             config.num_key_value_heads, config.head_dim, dtype)

    def layout(self, chunks: list[ScheduledChunk]) -> PagedLayout:
        ps = self.page_size
        tables = [self.table(c.request)[: blocks_needed(c.end, ps)] for c in chunks]
        block_table = np.full((len(tables), max(map(len, tables))), -1, dtype=np.int32)
        slot_mapping: list[int] = []
        query_start_loc = [0]
        for b, (chunk, table) in enumerate(zip(chunks, tables, strict=True)):
            block_table[b, : len(table)] = table
            slot_mapping += slots_for(table, chunk.start, chunk.end, ps)
            query_start_loc.append(query_start_loc[-1] + chunk.num_tokens)
        return PagedLayout(
            tables,
            mx.array(slot_mapping, dtype=mx.int32),
            mx.array(block_table),
            mx.array([c.end for c in chunks], dtype=mx.int32),
            mx.array(query_start_loc, dtype=mx.int32),
        )
    # ANCHOR_END: paged_space

    def nbytes(self) -> int:
        return self.pool.nbytes()

    def stats(self) -> dict[str, int]:
        return {
            "num_pages": self.blocks.num_blocks,
            "num_free_pages": self.blocks.num_free_blocks,
            "page_size": self.page_size,
            "prefix_cache_query_tokens": self.prefix_cache_query_tokens,
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
        }


# ANCHOR: gather_attention
class GatherAttention:
    """Day 3's attention: write the new rows at their slots, then gather each sequence's
    rows back into a dense array and run the dense oracle on it. Correct, and O(context)
    bytes copied per layer per step: what Day 4 removes."""

    name: ClassVar[str] = "gather"
    storage: ClassVar[str] = "paged"

    def __init__(self, kv: PagedKVStorage):
        self.pool = kv.pool
        self.page_size = kv.page_size

    @staticmethod
    def check(geometry: AttentionGeometry) -> None:
        pass  # plain MLX ops serve any geometry; the dense oracle takes any mask (trees)

    def begin_step(self, step: StepBatch) -> None:
        self.step = step
        self.context_slots = [
            mx.array(slots_for(table, 0, end, self.page_size), dtype=mx.int32)
            for table, end in zip(step.kv.tables, step.context_lens, strict=True)
        ]
        qsl, tree = step.query_start_loc, step.tree  # a tree's masks: once, for every layer
        self.visible = [None if tree is None else mx.array(tree.visible(range(lo, hi), end))
                        for lo, hi, end in zip(qsl[:-1], qsl[1:], step.context_lens, strict=True)]

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        self.pool.write(layer, self.step.kv.slot_mapping, k, v)
        qsl, outs = self.step.query_start_loc, []
        for b, slots in enumerate(self.context_slots):
            lo, hi = qsl[b], qsl[b + 1]
            keys, values = self.pool.gather(layer, slots)
            outs.append(causal_attention(q[lo:hi], keys, values, scale, len(slots) - (hi - lo),
                                         self.visible[b]))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)

    def state(self) -> list[mx.array]:
        return self.pool.k + self.pool.v

    def fused_decode(self) -> None:
        return None  # the fused layers run the kernels, not this gather
# ANCHOR_END: gather_attention

