"""Day 4: attention that walks the block table instead of gathering dense K/V.

Day 3 copied every sequence's keys and values out of the pages into a dense array, every
layer of every step: O(context) bytes moved per token generated. Here attention reads the
pages where they are. For query row ``i`` of sequence ``b`` (absolute position
``context_lens[b] - L_b + i``), key position ``p`` is found by address translation:
page ``block_table[b, p // page_size]``, slot ``p % page_size``.

Two implementations of the block-table interface:

- ``paged_attention_reference``: plain MLX ops, one *page column* per iteration with an
  online softmax (running max, running sum, running output). Correctness first, and an
  oracle for the kernels.
- ``paged_attention``: the extension op (``src/extensions``) with the *vector schedule*:
  one work item per (query row, KV head) walks its sequence's pages and folds each page
  into its online softmax, for all query heads of the KV head's group at once (each K/V
  row is read once per group). CPU threads in C++; a threadgroup per item on Apple GPUs.
  A multi-token query is several rows, each walking its own causal range: Day 5 shares
  the pages between them.

``paged_kv_write`` writes new rows into the pages in place, O(new tokens) whatever the pool
size. ``check_metadata`` validates everything a kernel would trust, before any kernel runs;
``check_geometry`` says at engine build whether the kernels serve the model at all.

Engine backends: ``PageWalkAttention`` (``attention="page_walk"``) and
``VectorKernelAttention`` (``attention="vector"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tiny_llm.day3_paged_kv import PagedKVStorage
from tiny_llm.kernels.cpu_kernels import FusedDecode
from tiny_llm.kernels.device import planned_device, rehearsing_gpu
from tiny_llm.kernels.extension import extension
from tiny_llm.step.batch import AttentionGeometry, StepBatch, TreeRows

import mlx.core as mx
import numpy as np


# ANCHOR: check_geometry
def check_geometry(geometry: AttentionGeometry) -> None:
    """Raise ValueError unless the kernels serve this geometry on its device: the CPU
    kernels any float geometry, the Metal ones what their launcher accepts."""
    g = geometry
    if g.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        raise ValueError(f"attention runs in float32, float16 or bfloat16, not {g.dtype}")
    if g.n_kv_heads < 1 or g.n_heads < 1 or g.n_heads % g.n_kv_heads:
        raise ValueError(f"{g.n_heads} query heads are not a multiple of {g.n_kv_heads} KV heads")
    if g.head_dim < 1 or (g.page_size is not None and g.page_size < 1):
        raise ValueError(f"head_dim and page_size must be positive: {g.head_dim}, {g.page_size}")
    if g.device == mx.gpu:  # the launcher's own rule (src/extensions/metal_launch.cpp)
        extension().check_metal_geometry(g.n_heads, g.n_kv_heads, g.head_dim, g.page_size,
                                         g.dtype)
# ANCHOR_END: check_geometry


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
    check_geometry(AttentionGeometry(q.shape[1], n_kv_heads, head_dim, page_size, q.dtype,
                                     planned_device()))
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


def check_tree(tree: TreeRows, context_lens: mx.array, query_start_loc: mx.array) -> None:
    """Raise ValueError unless every tree row's keys lie in its own sequence, at or before the
    row itself: a kernel reads whatever keys the mask names."""
    qsl, ctx = np.array(query_start_loc).astype(np.int64), np.array(context_lens)
    rows = int(qsl[-1])
    if tree.start.shape != (rows,) or tree.ancestors.shape != (rows,):
        raise ValueError(f"the tree's start and mask need one entry per query row ({rows})")
    lens = np.diff(qsl)
    seq = np.repeat(np.arange(len(ctx)), lens)
    own = ctx[seq] - lens[seq] + np.arange(rows) - qsl[seq]  # each row's own key
    start = tree.start.astype(np.int64)
    in_tree = start <= own
    if (start[in_tree] < 0).any():
        raise ValueError("tree rows must start at a key of their sequence (>= 0)")
    span = np.clip(own - start + 1, 0, 63).astype(np.uint64)  # the row's keys from start on
    past_own = in_tree & (own - start + 1 < 64) & ((tree.ancestors >> span) != 0)
    if past_own.any():
        raise ValueError(f"the tree mask of rows {np.flatnonzero(past_own).tolist()} names "
                         "keys after the row's own")


def paged_attention(
    q: mx.array,
    k_pages: mx.array,
    v_pages: mx.array,
    block_table: mx.array,
    context_lens: mx.array,
    query_start_loc: mx.array,
    scale: float,
    validate: bool = True,
    tiled: bool = False,
    tree: TreeRows | None = None,
) -> mx.array:
    """The extension op: the vector schedule for every query row (Day 5's ``tiled=True``
    gives multi-token queries tiles); ``tree``: rows of token trees, which see their
    ancestors only (on a CPU). ``validate=False`` skips the checks (the engine builds its
    metadata itself; tests check it)."""
    if validate:
        check_metadata(q, k_pages, v_pages, block_table, context_lens, query_start_loc)
        if tree is not None:
            check_tree(tree, context_lens, query_start_loc)
    trees = {} if tree is None else dict(zip(("tree_start", "tree_mask"), tree.arrays,
                                             strict=True))
    return extension().paged_attention(
        q, k_pages, v_pages, block_table, context_lens, query_start_loc, scale, tiled=tiled,
        gpu_rehearsal=rehearsing_gpu(), **trees,
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
    return extension().paged_kv_write(k_pages, v_pages, k_new, v_new, slot_mapping,
                                      gpu_rehearsal=rehearsing_gpu())


# ANCHOR: reference_page_walk
@dataclass
class PageWalk:
    """Per-row metadata of a page walk, computed once per step (every layer shares it)."""

    rows_table: mx.array  # [T, max_pages]: the block table of each row's sequence
    last_pos: mx.array  # [T, 1, 1, 1]: the last key position each row sees (causal)
    num_columns: int  # page columns the longest row walks

    @classmethod
    def of(cls, block_table: mx.array, context_lens: mx.array, query_start_loc: mx.array,
           page_size: int) -> PageWalk:
        qsl, ctx = np.array(query_start_loc), np.array(context_lens)
        query_lens = np.diff(qsl)
        seq_of_row = np.repeat(np.arange(len(ctx)), query_lens)
        row_in_seq = np.arange(qsl[-1]) - qsl[seq_of_row]
        last_pos = ctx[seq_of_row] - query_lens[seq_of_row] + row_in_seq
        return cls(mx.array(np.array(block_table)[seq_of_row]),
                   mx.array(last_pos)[:, None, None, None],
                   -(-(int(last_pos.max(initial=0)) + 1) // page_size))


def page_walk(q: mx.array, k_pages: mx.array, v_pages: mx.array, walk: PageWalk,
              scale: float) -> mx.array:
    """Every query row reads page column j of its sequence per iteration and folds it into
    an online softmax. Never builds the whole context."""
    # TASK 4.1: page_walk — The page walk in MLX ops
    T, n_heads, D = q.shape
    _, page_size, n_kv_heads, _ = k_pages.shape
    group = n_heads // n_kv_heads
    qg = (q.astype(mx.float32) * scale).reshape(T, n_kv_heads, group, D)
    m = mx.full((T, n_kv_heads, group, 1), -mx.inf)  # running max, sum, output
    denom = mx.zeros((T, n_kv_heads, group, 1))
    acc = mx.zeros((T, n_kv_heads, group, D))
    slot_pos = mx.arange(page_size)
    for j in range(walk.num_columns):
        pages = mx.maximum(walk.rows_table[:, j], 0)  # -1 (unused) is masked below
        k = k_pages[pages].astype(mx.float32)  # [T, page_size, Hkv, D]
        v = v_pages[pages].astype(mx.float32)
        visible = (j * page_size + slot_pos)[None, None, None, :] <= walk.last_pos  # [T,1,1,S]
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
    # END TASK


def paged_attention_reference(q: mx.array, k_pages: mx.array, v_pages: mx.array,
                              block_table: mx.array, context_lens: mx.array,
                              query_start_loc: mx.array, scale: float) -> mx.array:
    """The block-table interface, walked with MLX ops (the kernels' oracle)."""
    walk = PageWalk.of(block_table, context_lens, query_start_loc, k_pages.shape[1])
    return page_walk(q, k_pages, v_pages, walk, scale)
# ANCHOR_END: reference_page_walk


# ANCHOR: walk_backends
class PageWalkAttention:
    """``attention="page_walk"``: the page walk in MLX ops; writes with MLX indexing."""

    name: ClassVar[str] = "page_walk"
    storage: ClassVar[str] = "paged"

    def __init__(self, kv: PagedKVStorage):
        self.pool = kv.pool

    @staticmethod
    def check(geometry: AttentionGeometry) -> None:
        geometry.refuse_trees("attention='page_walk'")  # plain MLX ops serve any other geometry

    def begin_step(self, step: StepBatch) -> None:
        self.step = step
        self.walk = PageWalk.of(*step.kv.page_metadata, self.pool.page_size)

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        self.pool.write(layer, self.step.kv.slot_mapping, k, v)
        return page_walk(q, self.pool.k[layer], self.pool.v[layer], self.walk, scale)

    def state(self) -> list[mx.array]:
        return self.pool.k + self.pool.v

    def fused_decode(self) -> None:
        return None  # the fused layers run the kernels, not this walk in MLX ops


class VectorKernelAttention:
    """``attention="vector"``: the extension writes the pages in place and runs the vector
    schedule for every row. Neither gathers dense K/V."""

    name: ClassVar[str] = "vector"
    storage: ClassVar[str] = "paged"
    tiled: ClassVar[bool] = False  # multi-token queries take Day 5's tiles (FlashAttention)

    def __init__(self, kv: PagedKVStorage):
        self.pool = kv.pool
        extension()  # fail at engine build, with the build command, rather than mid-step

    @staticmethod
    def check(geometry: AttentionGeometry) -> None:
        check_geometry(geometry)

    def begin_step(self, step: StepBatch) -> None:
        self.step = step

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        return self.attend_pages(q, *self.write_pages(layer, k, v), scale)

    def write_pages(self, layer: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store the step's ``k, v`` rows of ``layer``; return its pages after the write."""
        pool = self.pool
        # The old pools are dropped as the new ones are stored: the write happens in place.
        pool.k[layer], pool.v[layer] = paged_kv_write(
            pool.k[layer], pool.v[layer], k, v, self.step.kv.slot_mapping, validate=False
        )
        return pool.k[layer], pool.v[layer]

    def attend_pages(self, q: mx.array, k_pages: mx.array, v_pages: mx.array,
                     scale: float) -> mx.array:
        return paged_attention(q, k_pages, v_pages, *self.step.kv.page_metadata, scale,
                               validate=False, tiled=self.tiled, tree=self.step.tree)

    def state(self) -> list[mx.array]:
        return self.pool.k + self.pool.v

    def fused_decode(self) -> FusedDecode:
        step = self.step
        return FusedDecode(self.pool, step.kv.slot_mapping, step.kv.page_metadata, self.tiled)
# ANCHOR_END: walk_backends
