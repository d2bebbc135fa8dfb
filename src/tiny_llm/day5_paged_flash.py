"""Day 5: paged FlashAttention — a tiled schedule for multi-token queries.

Day 4's vector schedule gives every query row its own walk over its sequence's pages, so a
prefill chunk of L rows reads each page L times. The tiled schedule cuts the rows of a
multi-token query into *query tiles* of consecutive rows and walks the pages once per
tile: it loads a page (a key tile) once, scores all the tile's (row, head) pairs against
it — a small matrix product, ``[pairs, D] x [D, page_size]`` — folds the scores into each
pair's online softmax and accumulates ``P V``. Pages past the tile's last row are never
visited (tiles above the causal diagonal are skipped); on the diagonal page each row
stops at itself.

Which rows take which schedule (``flash_schedule``): a single-token query (a decode)
keeps the vector schedule; a sequence with ``L > 1`` rows becomes ``ceil(L / tile_rows)``
tiles. The tile height is the kernels' (``tile_rows``): 16 rows on the CPU; on Apple GPUs
``64 // group`` rows, because a threadgroup holds 64 (row, head) pairs in 8x8
simdgroup matrices. Both schedules read the same pages through the same block tables, in
one dispatch.

Implementations: ``paged_flash_reference`` (tiles in MLX ops: correctness first, the
oracle the C++ and Metal tiles are tested against) and Day 4's ``paged_attention`` with
``tiled=True`` (the extension op). Engine backends: ``TiledWalkAttention``
(``attention="tiled_walk"``) and ``FlashAttention`` (``attention="flash"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tiny_llm.day4_paged_attention import (
    PageWalkAttention,
    VectorKernelAttention,
)
from tiny_llm.kernels.extension import extension
from tiny_llm.step.batch import AttentionGeometry, StepBatch

import mlx.core as mx
import numpy as np


# ANCHOR: flash_schedule
@dataclass(frozen=True)
class QueryTile:
    seq: int  # the sequence (block-table row)
    first_row: int  # its first row in the flat batch
    num_rows: int  # 1 .. tile_rows consecutive rows


@dataclass(frozen=True)
class FlashSchedule:
    vector_rows: list[int]  # rows of single-token queries: the vector schedule
    tiles: list[QueryTile]  # rows of multi-token queries, tile by tile


def flash_schedule(query_start_loc: list[int], tile_rows: int) -> FlashSchedule:
    """Which rows of a step take which schedule, as the kernels decide it."""
    # TASK 5.1: flash_schedule — Which rows take tiles
    vector_rows, tiles = [], []
    for b in range(len(query_start_loc) - 1):
        lo, hi = query_start_loc[b], query_start_loc[b + 1]
        if hi - lo == 1:
            vector_rows.append(lo)
            continue
        for first in range(lo, hi, tile_rows):
            tiles.append(QueryTile(b, first, min(tile_rows, hi - first)))
    return FlashSchedule(vector_rows, tiles)
    # END TASK


def tile_rows(device: mx.Device, group: int) -> int:
    """Rows per query tile of the kernels on ``device`` for a GQA group of ``group``."""
    ext = extension()
    return ext.metal_tile_rows(group) if device == mx.gpu else ext.cpu_query_tile
# ANCHOR_END: flash_schedule


# ANCHOR: tiled_reference
@dataclass
class TileWalk:
    """Per-tile metadata of a tiled walk, computed once per step."""

    rows: mx.array  # [N, R]: flat row of each tile row (clamped where the tile is short)
    valid: mx.array  # [N, R]: whether the tile row exists
    last_pos: mx.array  # [N, R]: the last key position each tile row sees (causal)
    tables: mx.array  # [N, max_pages]: the block table of each tile's sequence
    num_columns: int  # page columns the longest tile walks
    num_rows: int  # T

    @classmethod
    def of(cls, block_table: mx.array, context_lens: mx.array, query_start_loc: mx.array,
           page_size: int, tile_rows: int) -> TileWalk:
        qsl, ctx = np.array(query_start_loc).tolist(), np.array(context_lens)
        schedule = flash_schedule(qsl, tile_rows)
        tiles = [*schedule.tiles, *(QueryTile(_seq(qsl, r), r, 1) for r in schedule.vector_rows)]
        offsets = np.arange(tile_rows)
        first = np.array([t.first_row for t in tiles])
        count = np.array([t.num_rows for t in tiles])
        seq = np.array([t.seq for t in tiles])
        rows = first[:, None] + offsets[None, :]
        valid = offsets[None, :] < count[:, None]
        rows = np.where(valid, rows, first[:, None])
        query_lens = np.diff(qsl)
        row_in_seq = rows - np.array(qsl)[seq][:, None]
        last_pos = (ctx - query_lens)[seq][:, None] + row_in_seq
        return cls(mx.array(rows), mx.array(valid), mx.array(last_pos),
                   mx.array(np.array(block_table)[seq]),
                   -(-(int(last_pos.max(initial=0)) + 1) // page_size), qsl[-1])


def _seq(query_start_loc: list[int], row: int) -> int:
    return int(np.searchsorted(query_start_loc, row, side="right")) - 1


def tile_walk(q: mx.array, k_pages: mx.array, v_pages: mx.array, walk: TileWalk,
              scale: float) -> mx.array:
    """Every tile reads page column j of its sequence once per iteration: the scores of
    its (row, head) pairs against the page are one matrix product per KV head."""
    _, n_heads, D = q.shape
    _, page_size, n_kv_heads, _ = k_pages.shape
    group = n_heads // n_kv_heads
    N, R = walk.rows.shape
    # The tile's pairs per KV head: R rows x G heads, as the rows of one matrix.
    qt = (q.astype(mx.float32) * scale)[walk.rows].reshape(N, R, n_kv_heads, group, D)
    qt = qt.transpose(0, 2, 1, 3, 4).reshape(N, n_kv_heads, R * group, D)
    limit = mx.repeat(walk.last_pos, group, axis=1)[:, None, :, None]  # [N, 1, R*G, 1]
    tile_limit = walk.last_pos.max(axis=1)[:, None]  # [N, 1]: the tile's last key
    # Each pair's online-softmax state: running max, sum, and output.
    m = mx.full((N, n_kv_heads, R * group, 1), -mx.inf)
    denom = mx.zeros((N, n_kv_heads, R * group, 1))
    acc = mx.zeros((N, n_kv_heads, R * group, D))
    slot_pos = mx.arange(page_size)
    for j in range(walk.num_columns):
        # TASK 5.2: tile_walk — The tiled walk in MLX ops
        pages = mx.maximum(walk.tables[:, j], 0)  # -1 (past the sequence) is masked below
        k = k_pages[pages].astype(mx.float32).transpose(0, 2, 3, 1)  # [N, Hkv, D, S]
        v = v_pages[pages].astype(mx.float32).transpose(0, 2, 1, 3)  # [N, Hkv, S, D]
        key_pos = j * page_size + slot_pos
        visible = key_pos[None, None, None, :] <= limit  # [N, 1, R*G, S]
        # Mask V past the tile's last key: p is 0 there, but 0 * NaN (garbage) is NaN.
        seen = (key_pos[None, :] <= tile_limit).reshape(N, 1, page_size, 1)
        v = mx.where(seen, v, 0.0)
        scores = mx.where(visible, qt @ k, -mx.inf)  # the tile against the page
        new_m = mx.maximum(m, scores.max(axis=-1, keepdims=True))
        correction = mx.exp(m - new_m)
        p = mx.exp(scores - new_m)
        denom = denom * correction + p.sum(axis=-1, keepdims=True)
        acc = acc * correction + p @ v
        m = new_m
        # END TASK
    # Each tile row back to its flat row; the padding rows of short tiles are dropped.
    out = (acc / denom).reshape(N, n_kv_heads, R, group, D).transpose(0, 2, 1, 3, 4)
    out = out.reshape(N * R, n_heads, D)
    valid = np.array(walk.valid).reshape(-1)
    rows = np.array(walk.rows).reshape(-1)[valid]
    result = mx.zeros((walk.num_rows, n_heads, D), dtype=mx.float32)
    result[mx.array(rows)] = out[mx.array(np.flatnonzero(valid))]
    return result.astype(q.dtype)


def paged_flash_reference(q: mx.array, k_pages: mx.array, v_pages: mx.array,
                          block_table: mx.array, context_lens: mx.array,
                          query_start_loc: mx.array, scale: float,
                          tile_rows: int = 16) -> mx.array:
    """The block-table interface with the tiled schedule, in MLX ops."""
    walk = TileWalk.of(block_table, context_lens, query_start_loc, k_pages.shape[1], tile_rows)
    return tile_walk(q, k_pages, v_pages, walk, scale)
# ANCHOR_END: tiled_reference


# ANCHOR: flash_backends
class TiledWalkAttention(PageWalkAttention):
    """``attention="tiled_walk"``: the tiled walk in MLX ops."""

    name: ClassVar[str] = "tiled_walk"
    TILE_ROWS = 16

    @staticmethod
    def check(geometry: AttentionGeometry) -> None:
        geometry.refuse_trees("attention='tiled_walk'")  # plain MLX ops serve any other geometry

    def begin_step(self, step: StepBatch) -> None:
        self.step = step
        self.walk = TileWalk.of(*step.kv.page_metadata, self.pool.page_size, self.TILE_ROWS)

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        self.pool.write(layer, self.step.kv.slot_mapping, k, v)
        return tile_walk(q, self.pool.k[layer], self.pool.v[layer], self.walk, scale)


class FlashAttention(VectorKernelAttention):
    """``attention="flash"``: Day 4's kernel backend with tiles for multi-token queries."""

    name: ClassVar[str] = "flash"
    tiled: ClassVar[bool] = True
# ANCHOR_END: flash_backends
