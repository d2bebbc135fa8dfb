"""Paged-attention cases and the dense references every paged walk is checked against.

A case is a step's worth of sequences over a shuffled page pool: ``seqs`` lists
``(context_len, query_len)`` per sequence (its last ``query_len`` tokens are the queries).
Everything no sequence owns — the tails of last pages, spare pages, page 0 (which a
clamped ``-1`` table entry would name) — holds garbage (NaN, or huge values), so a walk
that reads it, or multiplies it by a zero probability, shows it in its output.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tiny_llm.step.batch import Drafts, ScheduledChunk, TreeRows
from tiny_llm.step.dense_kv import causal_attention
from tiny_llm.step.request import SequenceState

import mlx.core as mx
import numpy as np

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
HUGE = {mx.float32: 1e30, mx.float16: 6e4, mx.bfloat16: 1e30}


@dataclass
class PagedCase:
    q: mx.array  # [T, Hq, D]
    k_pages: mx.array  # [P, page_size, Hkv, D]
    v_pages: mx.array
    tables: list[list[int]]  # each sequence's pages, in logical order
    context_lens: list[int]
    query_lens: list[int]
    scale: float

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def query_start_loc(self) -> list[int]:
        return [0, *np.cumsum(self.query_lens).tolist()]

    @property
    def block_table(self) -> mx.array:
        """[B, max_pages + 1]: one spare -1 column, as the engine's tables may have."""
        return block_table(self.tables, max(map(len, self.tables)) + 1)

    def args(self) -> tuple:
        """The block-table interface's arguments."""
        return (self.q, self.k_pages, self.v_pages, self.block_table,
                mx.array(self.context_lens, dtype=mx.int32),
                mx.array(self.query_start_loc, dtype=mx.int32), self.scale)


def block_table(tables: list[list[int]], width: int) -> mx.array:
    table = np.full((len(tables), width), -1, dtype=np.int32)
    for b, t in enumerate(tables):
        table[b, : len(t)] = t
    return mx.array(table)


def make_paged_case(seqs: list[tuple[int, int]], *, dtype: str | mx.Dtype = "float32",
                    head_dim: int = 64, page_size: int = 16, group: int = 1,
                    n_kv_heads: int = 2, garbage: str | float = "nan", spare_pages: int = 3,
                    seed: int = 0, q_scale: float = 1.5) -> PagedCase:
    """Sequences over shuffled pages; garbage (``"nan"``, ``"huge"`` or a number) wherever
    no sequence owns the slot. ``q_scale`` sharpens attention, so that one wrongly
    (in)visible key shows."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    rng = np.random.default_rng(seed)
    needed = [-(-ctx // page_size) for ctx, _ in seqs]
    num_pages = sum(needed) + spare_pages
    ids = (1 + rng.permutation(num_pages - 1)).tolist()  # page 0 stays garbage
    tables, at = [], 0
    for n in needed:
        tables.append(ids[at : at + n])
        at += n
    shape = (num_pages, page_size, n_kv_heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    owned = np.zeros((num_pages, page_size), dtype=bool)
    for (ctx, _), table in zip(seqs, tables, strict=True):
        pos = np.arange(ctx)
        owned[np.array(table)[pos // page_size], pos % page_size] = True
    fill = np.nan if garbage == "nan" else HUGE[dtype] if garbage == "huge" else garbage
    k[~owned] = fill
    v[~owned] = -fill if garbage == "huge" else fill
    total = sum(ql for _, ql in seqs)
    q = q_scale * rng.standard_normal((total, n_kv_heads * group, head_dim)).astype(np.float32)
    return PagedCase(mx.array(q).astype(dtype), mx.array(k).astype(dtype),
                     mx.array(v).astype(dtype), tables, [c for c, _ in seqs],
                     [ql for _, ql in seqs], float(head_dim**-0.5))


def gathered(case: PagedCase, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequence b's keys and values by address translation, as float32 numpy arrays."""
    pos = np.arange(case.context_lens[b])
    pages = np.array(case.tables[b])[pos // case.page_size]
    slots = pos % case.page_size
    k = np.array(case.k_pages.astype(mx.float32))[pages, slots]
    v = np.array(case.v_pages.astype(mx.float32))[pages, slots]
    return k, v


def dense_reference(case: PagedCase) -> np.ndarray:
    """The oracle: gather by address translation in numpy, then the dense attention in
    plain MLX ops, at float32 on the values the pool holds."""
    q = case.q.astype(mx.float32)
    qsl, outs = case.query_start_loc, []
    for b, ctx in enumerate(case.context_lens):
        k, v = gathered(case, b)
        lo, hi = qsl[b], qsl[b + 1]
        out = causal_attention(q[lo:hi], mx.array(k), mx.array(v), case.scale, ctx - (hi - lo))
        outs.append(np.array(out))
    return np.concatenate(outs)


def tree_rows(case: PagedCase, parents: tuple[int, ...]) -> TreeRows | None:
    """The case's last sequence verifying a tree of drafts: its last ``len(parents)`` rows
    are the drafts (``parents`` as ``Drafts`` takes them), every other row causal; the rows'
    metadata as a step of these chunks carries it. None without drafts."""
    if not parents:
        return None
    chunks = [ScheduledChunk(SequenceState([0] * ctx), ctx - q, ctx)
              for ctx, q in zip(case.context_lens, case.query_lens, strict=True)]
    drafts = Drafts(tuple(range(len(parents))), parents=parents)
    chunks[-1] = replace(chunks[-1], drafts=drafts)
    return TreeRows.of(chunks)


def float64_reference(case: PagedCase, tree: TreeRows | None = None) -> np.ndarray:
    """The same in numpy at float64 (no MLX op involved: the Metal emulator's oracle); rows
    of a ``tree`` see what ``TreeRows.visible`` says."""
    q = np.array(case.q.astype(mx.float32)).astype(np.float64)
    group = q.shape[1] // case.k_pages.shape[2]
    qsl, out = case.query_start_loc, np.full(q.shape, np.nan)
    for b, ctx in enumerate(case.context_lens):
        k, v = (a.astype(np.float64) for a in gathered(case, b))
        rows = np.arange(qsl[b], qsl[b + 1])
        if tree is None:
            last = ctx - len(rows) + np.arange(len(rows))  # causal limit per row
            visible = np.arange(ctx)[None, :] <= last[:, None]
        else:
            visible = tree.visible(range(qsl[b], qsl[b + 1]), ctx)
        for h in range(q.shape[1]):
            s = np.where(visible, q[rows, h] @ k[:, h // group].T * case.scale, -np.inf)
            w = np.exp(s - s.max(axis=1, keepdims=True))
            out[rows, h] = (w / w.sum(axis=1, keepdims=True)) @ v[:, h // group]
    return out
