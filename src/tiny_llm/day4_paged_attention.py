"""Day 4: attention that walks the block table instead of gathering dense K/V.

Day 3 copied every sequence's keys and values out of the pages into a dense array, every
layer of every step: O(context) bytes moved per token generated. Here attention reads the
pages where they are. For query row ``i`` of sequence ``b`` (absolute position
``context_lens[b] - L_b + i``), key position ``p`` is found by address translation:
page ``block_table[b, p // page_size]``, slot ``p % page_size``.

Two implementations share one interface (the block-table interface of the book's Day 4):

- ``paged_attention_reference``: plain MLX ops, one *page column* per iteration with an
  online softmax (running max, running sum, running output). Correctness first, and an
  oracle for the kernels.
- ``paged_attention``: the extension op (``src/extensions``). Decode rows run the vector
  schedule, one (query row, KV head) per work item on all cores; rows of multi-token
  queries run Day 5's tiled schedule. On Apple GPUs the same two schedules run as Metal
  kernels. ``paged_kv_write`` writes new rows into the pages in place, O(new tokens)
  whatever the pool size.

``check_metadata`` validates everything a kernel would trust, before any kernel runs.
"""

from __future__ import annotations

from tiny_llm.day3_paged_kv import PagePool
from tiny_llm.extension import extension

import mlx.core as mx
import numpy as np


def check_geometry(n_heads: int, n_kv_heads: int, head_dim: int, page_size: int,
                   dtype: mx.Dtype, device: mx.Device) -> None:
    """Raise ValueError unless the kernels can serve this attention geometry on ``device``
    (checked once per engine, before any step, and per call when validating)."""
    if dtype not in (mx.float32, mx.float16, mx.bfloat16):
        raise ValueError(f"attention runs in float32, float16 or bfloat16, not {dtype}")
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv_heads} KV heads")
    if page_size < 1 or head_dim < 1:
        raise ValueError(f"page_size and head_dim must be positive, got {page_size}, {head_dim}")
    if device == mx.gpu:  # the launcher's own rule (src/extensions/metal_launch.cpp)
        extension().check_metal_geometry(n_heads, n_kv_heads, head_dim, page_size, dtype)


# ANCHOR: check_metadata
def check_metadata(
    q: mx.array,
    k_pages: mx.array,
    v_pages: mx.array,
    block_table: mx.array,
    context_lens: mx.array,
    query_start_loc: mx.array,
) -> None:
    """Raise ValueError unless the metadata is safe for a kernel to trust."""
    if q.ndim != 3 or k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(
            f"q must be [T, Hq, D] and pages [P, page_size, Hkv, D]; got q {q.shape}, "
            f"k_pages {k_pages.shape}, v_pages {v_pages.shape}"
        )
    num_pages, page_size, n_kv_heads, head_dim = k_pages.shape
    if n_kv_heads < 1 or q.shape[2] != head_dim or q.shape[1] % n_kv_heads:
        raise ValueError(f"q {q.shape} does not fit pages with {n_kv_heads} KV heads of {head_dim}")
    check_geometry(q.shape[1], n_kv_heads, head_dim, page_size, q.dtype, mx.default_device())
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise ValueError(f"q and pages must share a float dtype; got {q.dtype}, {k_pages.dtype}")
    for name, a in (("block_table", block_table), ("context_lens", context_lens),
                    ("query_start_loc", query_start_loc)):
        if a.dtype != mx.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")
    table, ctx, qsl = (np.array(a) for a in (block_table, context_lens, query_start_loc))
    if table.ndim != 2 or ctx.shape != (table.shape[0],) or qsl.shape != (table.shape[0] + 1,):
        raise ValueError(
            f"need block_table [B, max_pages], context_lens [B], query_start_loc [B+1]; got "
            f"{table.shape}, {ctx.shape}, {qsl.shape}"
        )
    query_lens = np.diff(qsl)
    if qsl[0] != 0 or qsl[-1] != q.shape[0] or (query_lens < 1).any():
        raise ValueError(f"query_start_loc must rise from 0 to T={q.shape[0]}: {qsl.tolist()}")
    if (ctx < query_lens).any():
        raise ValueError(f"context_lens {ctx.tolist()} shorter than query lengths {query_lens}")
    pages_used = -(-ctx // page_size)
    if (pages_used > table.shape[1]).any():
        raise ValueError(f"context_lens {ctx.tolist()} need more pages than the table has")
    used = np.arange(table.shape[1])[None, :] < pages_used[:, None]
    if ((table < 0) | (table >= num_pages))[used].any():
        raise ValueError(f"block_table names pages outside the pool [0, {num_pages})")
    if (table[~used] != -1).any():
        raise ValueError("unused block_table entries must be -1")
# ANCHOR_END: check_metadata


def paged_attention(
    q: mx.array,
    k_pages: mx.array,
    v_pages: mx.array,
    block_table: mx.array,
    context_lens: mx.array,
    query_start_loc: mx.array,
    scale: float,
    validate: bool = True,
    tiled: bool = True,
) -> mx.array:
    """The extension kernel. ``validate=False`` skips the checks (the engine builds its
    metadata itself and checks it once in tests). ``tiled=False``: the vector schedule for
    every row (Day 4); ``True``: multi-token queries take the tiled schedule (Day 5)."""
    if validate:
        check_metadata(q, k_pages, v_pages, block_table, context_lens, query_start_loc)
    return extension().paged_attention(
        q, k_pages, v_pages, block_table, context_lens, query_start_loc, scale, tiled=tiled
    )


def paged_kv_write(
    k_pages: mx.array, v_pages: mx.array, k_new: mx.array, v_new: mx.array,
    slot_mapping: mx.array, validate: bool = True,
) -> tuple[mx.array, mx.array]:
    """Write rows at flat slots (``page * page_size + offset``). The caller must drop its
    references to the old pools: then the write happens in place."""
    if validate:
        slots = np.array(slot_mapping)
        capacity = k_pages.shape[0] * k_pages.shape[1]
        if slot_mapping.dtype != mx.int32 or slots.ndim != 1 or len(slots) != k_new.shape[0]:
            raise ValueError(f"slot_mapping must be int32 [{k_new.shape[0]}]")
        if ((slots < 0) | (slots >= capacity)).any():
            raise ValueError(f"slot_mapping has slots outside the pool [0, {capacity})")
        if len(np.unique(slots)) != len(slots):
            raise ValueError("slot_mapping writes the same slot twice")
    return extension().paged_kv_write(k_pages, v_pages, k_new, v_new, slot_mapping)


# ANCHOR: reference_page_walk
def paged_attention_reference(
    q: mx.array,
    k_pages: mx.array,
    v_pages: mx.array,
    block_table: mx.array,
    context_lens: mx.array,
    query_start_loc: mx.array,
    scale: float,
) -> mx.array:
    """The page walk in MLX ops: every query row reads page column j of its sequence per
    iteration and folds it into an online softmax. Never builds the whole context."""
    T, n_heads, D = q.shape
    _, page_size, n_kv_heads, _ = k_pages.shape
    group = n_heads // n_kv_heads
    qsl = np.array(query_start_loc)
    ctx = np.array(context_lens)
    seq_of_row = np.repeat(np.arange(len(ctx)), np.diff(qsl))
    row_in_seq = np.arange(T) - qsl[seq_of_row]
    last_pos = ctx[seq_of_row] - np.diff(qsl)[seq_of_row] + row_in_seq  # causal limit per row
    rows_table = mx.array(np.array(block_table)[seq_of_row])  # [T, max_pages]
    qg = (q.astype(mx.float32) * scale).reshape(T, n_kv_heads, group, D)
    m = mx.full((T, n_kv_heads, group, 1), -mx.inf)  # running max, sum, output
    denom = mx.zeros((T, n_kv_heads, group, 1))
    acc = mx.zeros((T, n_kv_heads, group, D))
    slot_pos = mx.arange(page_size)
    limit = mx.array(last_pos)[:, None, None, None]
    num_columns = -(-(int(last_pos.max()) + 1) // page_size)
    for j in range(num_columns):
        pages = mx.maximum(rows_table[:, j], 0)  # -1 (unused) is masked below
        k = k_pages[pages].astype(mx.float32)  # [T, page_size, Hkv, D]
        v = v_pages[pages].astype(mx.float32)
        visible = (j * page_size + slot_pos)[None, None, None, :] <= limit  # [T, 1, 1, S]
        # Mask V too: p is 0 at hidden slots, but 0 * NaN (garbage in a slot) is NaN.
        v = mx.where(visible.reshape(T, page_size, 1, 1), v, 0.0)
        scores = mx.where(visible, mx.einsum("thgd,tshd->thgs", qg, k), -mx.inf)
        new_m = mx.maximum(m, scores.max(axis=-1, keepdims=True))
        correction = mx.exp(m - new_m)
        p = mx.exp(scores - new_m)
        denom = denom * correction + p.sum(axis=-1, keepdims=True)
        acc = acc * correction + mx.einsum("thgs,tshd->thgd", p, v)
        m = new_m
    return (acc / denom).reshape(T, n_heads, D).astype(q.dtype)
# ANCHOR_END: reference_page_walk


# ANCHOR: direct_paged_batch
class DirectPagedBatchKV:
    """One engine step whose attention reads the pages in place (Day 4).

    ``attention="reference"`` walks them with MLX ops and writes with MLX indexing;
    ``attention="kernel"`` uses the extension for both. Neither gathers dense K/V."""

    def __init__(self, pool: PagePool, attention: str, slot_mapping: list[int],
                 block_tables: list[list[int]], context_lens: list[int],
                 query_start_loc: list[int]):
        self.pool = pool
        self.attention = attention
        width = max(len(t) for t in block_tables)
        table = np.full((len(block_tables), width), -1, dtype=np.int32)
        for b, t in enumerate(block_tables):
            table[b, : len(t)] = t
        self.block_table = mx.array(table)
        self.context_lens = mx.array(context_lens, dtype=mx.int32)
        self.query_start_loc = mx.array(query_start_loc, dtype=mx.int32)
        self.slot_mapping = mx.array(slot_mapping, dtype=mx.int32)

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        pool = self.pool
        if self.attention == "kernel":
            pool.k[layer], pool.v[layer] = paged_kv_write(
                pool.k[layer], pool.v[layer], k, v, self.slot_mapping, validate=False
            )
            return paged_attention(q, pool.k[layer], pool.v[layer], self.block_table,
                                   self.context_lens, self.query_start_loc, scale,
                                   validate=False)
        pool.write(layer, self.slot_mapping, k, v)
        return paged_attention_reference(q, pool.k[layer], pool.v[layer], self.block_table,
                                         self.context_lens, self.query_start_loc, scale)

    def state(self) -> list[mx.array]:
        return self.pool.k + self.pool.v
# ANCHOR_END: direct_paged_batch
