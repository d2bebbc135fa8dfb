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

``BlockSpace`` plugs the manager into Day 1's scheduler, and ``PagedKVSpace`` adds the
page pool itself. On Day 3 attention still *gathers* each sequence's K/V from its pages
into a dense array (``PagedBatchKV``): the correctness checkpoint that Day 4 removes.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tiny_llm.kv_cache import causal_attention

import mlx.core as mx

log = logging.getLogger("tiny_llm")


# ANCHOR: block_math
def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Pages for ``num_tokens`` tokens: ceiling division."""
    return -(-num_tokens // block_size)


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
    max_len = max(seq_lens, default=0) if max_len is None else max_len
    paged = sum(blocks_needed(n, block_size) * block_size for n in seq_lens)
    dense = max_len * len(seq_lens)
    used = sum(seq_lens)
    return Fragmentation(paged - used, paged, dense - used, dense)
# ANCHOR_END: block_math


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the page is full and its tokens are known
    token_ids: tuple[int, ...] | None = None


def page_hash(parent: bytes | None, page_tokens: tuple[int, ...]) -> bytes:
    """Chained digest of a full page: it names the page's tokens *and* everything before
    them. SHA-256, so prefixes cannot be made to collide on purpose (Python's ``hash`` of
    a tuple of ints is the same in every process and easy to collide)."""
    digest = hashlib.sha256(parent or b"")
    digest.update(b"".join(t.to_bytes(8, "little", signed=True) for t in page_tokens))
    return digest.digest()


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
        table = self.tables[seq_id]
        new_len = self.lengths[seq_id] + num_tokens
        missing = blocks_needed(new_len, self.block_size) - len(table)
        if missing > self.num_free_blocks:
            return None
        table.extend(self._take_free_block() for _ in range(missing))
        self.lengths[seq_id] = new_len
        return table

    def free(self, seq_id: object) -> None:
        for block_id in reversed(self.tables.pop(seq_id, [])):  # tail pages evicted first
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        self.lengths.pop(seq_id, None)

    def _take_free_block(self) -> int:
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
class BlockSpace:
    """The scheduler's view of a ``BlockManager``: room for requests, by page.

    ``begin`` turns prefix-cache hits into computed tokens before the scheduler sizes a
    new request's first chunk; ``commit`` registers the pages a step filled.
    """

    def __init__(self, block_manager: BlockManager):
        self.blocks = block_manager
        # Per request: pages registered so far and the hash chain's last digest.
        self.cached_pages: dict[object, tuple[int, bytes | None]] = {}
        self._new_hits: dict[object, int] = {}  # hits found by begin(), counted on success
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0

    def begin(self, request) -> None:
        tokens = request.token_ids_between(0, request.num_tokens)
        hits = self.blocks.match_prefix(tokens)
        self.blocks.attach_prefix(request, hits)
        request.num_computed_tokens = len(hits) * self.blocks.block_size
        chain = self.blocks.blocks[hits[-1]].hash if hits else None
        self.cached_pages[request] = (len(hits), chain)
        self._new_hits[request] = request.num_computed_tokens

    def allocate(self, request, num_new_tokens: int) -> bool:
        needed = request.num_computed_tokens + num_new_tokens
        if request not in self.blocks.tables:
            ok = self.blocks.allocate(request, needed) is not None
        else:
            extra = needed - self.blocks.lengths[request]
            ok = extra <= 0 or self.blocks.grow(request, extra) is not None
        if ok and request in self._new_hits:
            self.prefix_cache_query_tokens += request.num_tokens
            self.prefix_cache_hit_tokens += self._new_hits.pop(request)
        return ok

    def free(self, request) -> None:
        self.blocks.free(request)
        self.cached_pages.pop(request, None)
        self._new_hits.pop(request, None)

    def commit(self, request) -> None:
        done, parent = self.cached_pages.get(request, (0, None))
        full = request.num_computed_tokens // self.blocks.block_size
        if not self.blocks.enable_prefix_caching or full <= done:
            return
        tokens = request.token_ids_between(0, full * self.blocks.block_size)
        self.cached_pages[request] = self.blocks.cache_full_blocks(request, tokens, done, parent)

    def table(self, request) -> list[int]:
        return self.blocks.tables[request]
# ANCHOR_END: block_space


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
    return [table[p // page_size] * page_size + p % page_size for p in range(start, end)]
# ANCHOR_END: slot_mapping


# ANCHOR: paged_batch
class PagedBatchKV:
    """One step over paged K/V: write the new rows at ``slot_mapping``, then (Day 3) gather
    each sequence's rows back into a dense array for ``causal_attention``."""

    def __init__(self, pool: PagePool, slot_mapping: list[int], query_start_loc: list[int],
                 context_slots: list[list[int]]):
        self.pool = pool
        self.slot_mapping = mx.array(slot_mapping, dtype=mx.int32)
        self.query_start_loc = query_start_loc
        self.context_slots = [mx.array(s, dtype=mx.int32) for s in context_slots]

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        self.pool.write(layer, self.slot_mapping, k, v)
        outs = []
        for b, slots in enumerate(self.context_slots):
            lo, hi = self.query_start_loc[b], self.query_start_loc[b + 1]
            keys, values = self.pool.gather(layer, slots)
            outs.append(causal_attention(q[lo:hi], keys, values, scale, len(slots) - (hi - lo)))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)

    def state(self) -> list[mx.array]:
        return self.pool.k + self.pool.v
# ANCHOR_END: paged_batch


# ANCHOR: paged_space
class PagedKVSpace(BlockSpace):
    """Paged KV for the engine: the block manager, the page pool, and step batches."""

    def __init__(self, config, num_pages: int, page_size: int, enable_prefix_caching: bool,
                 dtype: mx.Dtype, attention: str = "gather"):
        super().__init__(BlockManager(num_pages, page_size, enable_prefix_caching))
        self.page_size = page_size
        self.attention = attention
        self.pool = PagePool(config.num_hidden_layers, num_pages, page_size,
                             config.num_key_value_heads, config.head_dim, dtype)

    def batch(self, chunks, query_start_loc: list[int]):
        """The step's attention over the pages: Day 3 gathers, Day 4 walks the tables."""
        slot_mapping: list[int] = []
        tables, context_lens = [], []
        for chunk in chunks:
            req = chunk.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + chunk.num_tokens
            table = self.table(req)[: blocks_needed(end, self.page_size)]
            slot_mapping += slots_for(table, start, end, self.page_size)
            tables.append(table)
            context_lens.append(end)
        if self.attention == "gather":
            context_slots = [slots_for(t, 0, n, self.page_size)
                             for t, n in zip(tables, context_lens, strict=True)]
            return PagedBatchKV(self.pool, slot_mapping, query_start_loc, context_slots)
        from tiny_llm.day4_paged_attention import DirectPagedBatchKV

        return DirectPagedBatchKV(self.pool, self.attention, slot_mapping, tables,
                                  context_lens, query_start_loc)
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


def kv_bytes_per_token(config, dtype: mx.Dtype) -> int:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.size


def pool_pages(config, dtype: mx.Dtype, page_size: int, kv_memory_bytes: float | None,
               num_pages: int | None, max_model_len: int, max_num_seqs: int) -> int:
    """Pages in the pool: ``num_pages`` if given; else the budget (bytes, or a fraction of
    physical memory if <= 1) divided by the bytes of a page; by default enough for every
    slot at ``max_model_len``, capped at a tenth of physical memory."""
    if num_pages is not None:
        return num_pages
    page_bytes = kv_bytes_per_token(config, dtype) * page_size
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if kv_memory_bytes is None:
        wanted = blocks_needed(max_model_len, page_size) * max_num_seqs
        return max(1, min(wanted, int(physical * 0.1) // page_bytes))
    budget = kv_memory_bytes * physical if kv_memory_bytes <= 1 else kv_memory_bytes
    pages = int(budget // page_bytes)
    if pages < 1:
        raise ValueError(f"kv_memory_bytes={kv_memory_bytes} holds no page of {page_bytes} bytes")
    return pages


def log_pool(num_pages: int, page_size: int, page_bytes: int, max_model_len: int) -> None:
    tokens = num_pages * page_size
    log.info(
        "KV pool: %d pages x %d tokens = %d tokens (%.1f MiB); maximum concurrency at "
        "max_model_len=%d: %.2fx",
        num_pages, page_size, tokens, num_pages * page_bytes / 2**20, max_model_len,
        tokens / max_model_len,
    )
