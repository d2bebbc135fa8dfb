"""The book's diagrams, drawn by code: each is computed from the engine's own functions on
a small example, then written as SVG to ``book/src/figures/``.

- ``flat-batch.svg`` (Day 1): one step's flat batch, laid out by ``StepBatch.build``;
- ``page-walk.svg`` (Day 4): a block table walked page by page, with the online softmax's
  running max and sum after each page, computed by the same recurrence as the kernels;
- ``tiles-diagonal.svg`` (Day 5): the query tiles of ``flash_schedule`` over a chunk's
  pages, each (tile, page) pair full, on the causal diagonal, or never read;
- ``metal-threadgroup.svg`` (Day 4): one Metal threadgroup of the vector schedule, with the
  sizes of ``paged_attention_geometry.h``: which pages each simdgroup walks, and which
  elements of a key each lane holds;
- ``layers.svg`` (the architecture chapter): the package's layers as ``tiny_llm.LAYERS``
  states them, with each package's modules as they are on disk;
- ``token-tree.svg`` (speculative decoding): a tree of drafts with the positions and the
  mask ``StepBatch.build`` gives its rows, the path ``tree_accept`` keeps, and the row moves
  ``move_accepted`` makes;
- ``budget-split.svg`` (Day 2): five steps of ``ChunkedPrefillScheduler`` under a budget of 16
  tokens, each step's rows split into decode tokens first and prefill chunks after;
- ``page-states.svg`` (Day 3): the page pool after each step of ``PagedScheduler`` over a
  ``BlockManager``: pages held, shared by a prefix hit, free or cached, and a preemption;
- ``speculation-steps.svg`` (speculative decoding): ``speculative_accept`` on given
  distributions and draws, and the pages ``rewind`` returns;
- ``moe-dispatch.svg`` (Mixture of Experts): ``route``, ``dispatch`` and ``combine`` on five
  rows and four experts;
- ``tp-split.svg`` (tensor parallelism): the slices of one layer's weights that
  ``shard_model`` keeps on each of two ranks, and the layer's two all-reduces;
- ``server-threads.svg`` (serving): the server's threads and queues, named from
  ``EngineLoop`` and ``Server``, whose sources must still make the calls it shows.

The files are committed; ``tests/test_book.py`` draws them again and fails if a committed
one differs, so a diagram cannot drift from the code it shows.

    python tools/book_figures.py          # rewrite book/src/figures/*.svg
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiny_llm.day1_batching import SimRequest
    from tiny_llm.day3_paged_kv import BlockManager
    from tiny_llm.models.model import TransformerBlock

    import mlx.core as mx
    import numpy as np

FIGURES = Path(__file__).resolve().parents[1] / "book" / "src" / "figures"
GEOMETRY = Path(__file__).resolve().parents[1] / "src" / "extensions" / "metal" / \
    "paged_attention_geometry.h"
COLORS = ["#cfe3f7", "#fde2c4", "#d5efd5", "#eadcf5", "#f7d4d4"]  # one per sequence
FONT = 'font-family="ui-monospace, SFMono-Regular, Menlo, Consolas, monospace" font-size="13"'


class Svg:
    """A few SVG primitives, in the order they are drawn."""

    def __init__(self, width: int, height: int, title: str):
        self.width, self.height, self.title = width, height, title
        self.items: list[str] = []

    def rect(self, x: float, y: float, w: float, h: float, fill: str, stroke: str = "#555",
             dashed: bool = False) -> None:
        dash = ' stroke-dasharray="3 2"' if dashed else ""
        self.items.append(f'<rect x="{x:g}" y="{y:g}" width="{w:g}" height="{h:g}" '
                          f'fill="{fill}" stroke="{stroke}"{dash}/>')

    def text(self, x: float, y: float, s: str, anchor: str = "middle", size: int = 13,
             color: str = "#222", bold: bool = False) -> None:
        weight = ' font-weight="bold"' if bold else ""
        self.items.append(f'<text x="{x:g}" y="{y:g}" text-anchor="{anchor}" '
                          f'font-size="{size}" fill="{color}"{weight}>{escape(s)}</text>')

    def line(self, x1: float, y1: float, x2: float, y2: float, color: str = "#444",
             width: float = 1, arrow: bool = False) -> None:
        head = ' marker-end="url(#arrow)"' if arrow else ""
        self.items.append(f'<line x1="{x1:g}" y1="{y1:g}" x2="{x2:g}" y2="{y2:g}" '
                          f'stroke="{color}" stroke-width="{width:g}"{head}/>')

    def render(self) -> str:
        marker = ('<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" '
                  'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
                  '<path d="M 0 0 L 10 5 L 0 10 z" fill="#444"/></marker></defs>')
        body = "\n  ".join(self.items)
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" '
                f'height="{self.height}" viewBox="0 0 {self.width} {self.height}" {FONT}>\n'
                f'  <title>{escape(self.title)}</title>\n  {marker}\n'
                f'  <rect width="100%" height="100%" fill="white"/>\n  {body}\n</svg>\n')


# ---------------------------------------------------------------------------------------
# Day 1: the flat batch


class _Request:
    """What ``StepBatch.build`` reads of a request."""

    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens

    def token_ids_between(self, start: int, end: int) -> list[int]:
        return list(range(start, end))


def flat_batch() -> str:
    from tiny_llm import ScheduledChunk, StepBatch

    # Two decodes (contexts of 41 and 18 tokens), a 6-token prompt computed whole, and
    # tokens 32..39 of a 64-token prompt (a chunk that does not reach its end).
    requests = {"A": _Request(41), "B": _Request(18), "C": _Request(6), "D": _Request(64)}
    chunks = [ScheduledChunk(requests["A"], 40, 41), ScheduledChunk(requests["B"], 17, 18),
              ScheduledChunk(requests["C"], 0, 6), ScheduledChunk(requests["D"], 32, 40)]
    batch = StepBatch.build(chunks, None)
    positions = batch.positions.tolist()
    logit_rows = set(batch.logit_rows.tolist())
    names = list(requests)
    cell, x0, y0 = 44, 150, 70
    svg = Svg(x0 + cell * len(positions) + 40, 350, "One step's flat batch")
    svg.text(20, 30, "StepBatch.build: four chunks, one flat batch of rows, no padding",
             anchor="start", bold=True)
    svg.text(x0 - 12, y0 + 27, "positions", anchor="end")
    for b in range(len(chunks)):
        lo, hi = batch.query_start_loc[b], batch.query_start_loc[b + 1]
        for row in range(lo, hi):
            svg.rect(x0 + row * cell, y0, cell, 40, COLORS[b])
            svg.text(x0 + row * cell + cell / 2, y0 + 25, str(positions[row]))
        svg.text(x0 + (lo + hi) / 2 * cell, y0 - 10, names[b], bold=True)
    svg.text(x0 - 12, y0 + 75, "logit rows", anchor="end")
    for row in sorted(logit_rows):
        svg.line(x0 + row * cell + cell / 2, y0 + 85, x0 + row * cell + cell / 2, y0 + 44,
                 arrow=True)
    svg.text(x0 - 12, y0 + 120, "query_start_loc", anchor="end")
    for b, start in enumerate(batch.query_start_loc):
        x = x0 + start * cell
        svg.line(x, y0 - 4, x, y0 + 130, color="#999")
        svg.text(x + 4, y0 + 120 + (12 if b % 2 else 0), str(start), anchor="start")
    svg.text(x0 - 12, y0 + 165, "context_lens", anchor="end")
    for b, ctx in enumerate(batch.context_lens):
        lo, hi = batch.query_start_loc[b], batch.query_start_loc[b + 1]
        svg.text(x0 + (lo + hi) / 2 * cell, y0 + 165, str(ctx))
    svg.text(20, y0 + 210, "A and B decode; C is a 6-token prompt computed whole; D computes "
             "tokens 32..39 of a 64-token prompt, so it samples nothing.", anchor="start",
             size=12, color="#444")
    svg.text(20, y0 + 250, f"decode_rows = {batch.decode_rows}: the leading one-row sequences "
             "that sample, first in the batch and in the logits.", anchor="start", size=12,
             color="#444")
    svg.text(20, y0 + 230, "Each row attends to its own sequence's keys up to its position; "
             "query_start_loc keeps the sequences apart.", anchor="start", size=12,
             color="#444")
    return svg.render()


# ---------------------------------------------------------------------------------------
# Day 4: the page walk with the online softmax


def page_walk() -> str:
    table, page_size = [7, 2, 5], 4
    scores = [[0.5, 1.0, -0.2, 0.3], [2.1, 0.4, 1.7, -1.0], [0.9, 3.0]]  # the last page: 2 keys
    cell, x0, y0 = 36, 40, 80
    width = x0 + len(table) * (page_size * cell + 60) + 120
    svg = Svg(width, 400, "A page walk with the online softmax")
    svg.text(20, 30, "One (row, head) pair walks its block table; after each page only m, l "
             "and acc remain", anchor="start", bold=True)
    m, total = -math.inf, 0.0
    for j, (page, page_scores) in enumerate(zip(table, scores, strict=True)):
        x = x0 + j * (page_size * cell + 60)
        svg.text(x + page_size * cell / 2, y0 - 25, f"logical page {j} → table[{j}] = {page}")
        for t in range(page_size):
            visible = t < len(page_scores)
            svg.rect(x + t * cell, y0, cell, 34, COLORS[j] if visible else "#ffffff",
                     dashed=not visible)
            label = f"{page_scores[t]:g}" if visible else "–"
            svg.text(x + t * cell + cell / 2, y0 + 22, label, size=12)
        svg.text(x + page_size * cell / 2, y0 + 52, f"keys {j * page_size}.."
                 f"{j * page_size + len(page_scores) - 1} (scores)", size=11, color="#666")
        new_m = max(m, *page_scores)
        correction = math.exp(m - new_m) if m > -math.inf else 0.0
        total = total * correction + sum(math.exp(s - new_m) for s in page_scores)
        lines = [f"m = {new_m:.2f}", f"correction = {correction:.3f}", f"l = {total:.3f}",
                 "acc = acc·correction", "      + Σ p·v"]
        for i, s in enumerate(lines):
            svg.text(x, y0 + 95 + 20 * i, s, anchor="start", size=12)
        if j + 1 < len(table):
            svg.line(x + page_size * cell + 8, y0 + 17, x + page_size * cell + 52, y0 + 17,
                     arrow=True)
        m = new_m
    notes = ["m: the running maximum; l: the running sum of exp(score − m).",
             "A new maximum rescales l and acc by correction = exp(m_old − m_new);",
             "on the first page it is 0 (m starts at −FLT_MAX).",
             "The output is acc / l: exactly softmax · V, read one page at a time.",
             "The last page holds 2 of its 4 slots: the walk stops at the context length."]
    for i, note in enumerate(notes):
        svg.text(20, y0 + 220 + 20 * i, note, anchor="start", size=12, color="#444")
    return svg.render()


# ---------------------------------------------------------------------------------------
# Day 5: tiles over pages, and the causal diagonal


def tiles_diagonal() -> str:
    from tiny_llm.day5_paged_flash import flash_schedule

    cached, rows, page_size, tile_rows = 48, 22, 16, 16  # a 22-row chunk after 48 tokens
    context = cached + rows
    pages = -(-context // page_size)
    schedule = flash_schedule([0, rows], tile_rows)
    cw, rh, x0, y0 = 90, 12, 170, 80
    svg = Svg(x0 + pages * cw + 40, y0 + rows * rh + 110, "Query tiles over pages")
    svg.text(20, 30, f"A {rows}-row chunk after {cached} cached tokens, tiles of {tile_rows} "
             f"rows, pages of {page_size} keys", anchor="start", bold=True)
    for j in range(pages):
        k0, k1 = j * page_size, min(context, (j + 1) * page_size) - 1
        svg.text(x0 + j * cw + cw / 2, y0 - 10, f"page {j}: {k0}..{k1}", size=11)
    kinds = {"full": "#d5efd5", "diagonal": "#fde2c4", "skipped": "#ffffff"}
    for n, tile in enumerate(schedule.tiles):
        first = cached + tile.first_row
        last = first + tile.num_rows - 1
        y = y0 + tile.first_row * rh
        h = tile.num_rows * rh
        svg.text(x0 - 10, y + h / 2 + 4, f"tile {n}: rows at {first}..{last}", anchor="end",
                 size=11)
        for j in range(pages):
            k0, k1 = j * page_size, min(context, (j + 1) * page_size) - 1
            kind = "skipped" if k0 > last else "full" if k1 <= first else "diagonal"
            svg.rect(x0 + j * cw, y, cw, h, kinds[kind], dashed=kind == "skipped")
    # The causal boundary: the row at position p sees keys 0..p.
    def edge(position: int) -> float:
        return x0 + (position + 1) / page_size * cw

    svg.line(edge(cached), y0, edge(cached + rows - 1), y0 + rows * rh, color="#b33", width=1.5)
    legend = [("full", "every row of the tile sees the whole page: one fold for all"),
              ("diagonal", "the page crosses the tile's diagonal: each row up to itself"),
              ("skipped", "no row of the tile reaches the page: never read")]
    for i, (kind, words) in enumerate(legend):
        y = y0 + rows * rh + 25 + 20 * i
        svg.rect(20, y - 12, 24, 14, kinds[kind], dashed=kind == "skipped")
        svg.text(52, y, f"{kind}: {words}", anchor="start", size=12)
    svg.text(20, y0 + rows * rh + 85, "red: the causal boundary (a row at position p sees "
             "keys 0..p)", anchor="start", size=12, color="#b33")
    return svg.render()


# ---------------------------------------------------------------------------------------
# Day 4: a Metal threadgroup of the vector schedule


def geometry_constant(name: str) -> int:
    m = re.search(rf"\b{name}\s*=\s*(\d+)", GEOMETRY.read_text())
    if m is None:
        raise ValueError(f"{name} not found in {GEOMETRY.name}")
    return int(m[1])


def metal_threadgroup() -> str:
    simd_width, simdgroups = geometry_constant("kSimdWidth"), geometry_constant("kSimdgroups")
    head_dim, num_pages = 64, 13
    per_lane = -(-head_dim // simd_width)
    x0, y0, rh = 40, 80, 30
    svg = Svg(900, y0 + simdgroups * rh + 190, "One Metal threadgroup of the vector schedule")
    svg.text(20, 30, f"One query row and KV head: {simdgroups} simdgroups × {simd_width} lanes "
             f"= {simdgroups * simd_width} threads; a context of {num_pages} pages",
             anchor="start", bold=True)
    for s in range(simdgroups):
        y = y0 + s * rh
        svg.text(x0, y + 19, f"simdgroup {s}", anchor="start")
        for n, page in enumerate(range(s, num_pages, simdgroups)):
            svg.rect(x0 + 120 + n * 70, y + 3, 60, rh - 6, COLORS[n % len(COLORS)])
            svg.text(x0 + 150 + n * 70, y + 20, f"page {page}", size=11)
        svg.text(x0 + 280, y + 19, "→ its own m, l, acc per head of the group", anchor="start",
                 size=11, color="#666")
    y = y0 + simdgroups * rh + 30
    svg.text(x0, y, "then the simdgroups merge their states through threadgroup memory "
             "(after a barrier), and write the row", anchor="start", size=12, color="#444")
    y += 40
    svg.text(x0, y, f"one key of head_dim {head_dim}: element d is lane d mod {simd_width}'s "
             f"(PER_LANE = {per_lane} elements a lane: d = lane + {simd_width}·i)",
             anchor="start", size=12)
    cell = (900 - 2 * x0) / head_dim
    for d in range(head_dim):
        svg.rect(x0 + d * cell, y + 12, cell, 26, COLORS[d // simd_width % len(COLORS)])
        if d % 8 == 0:
            svg.text(x0 + d * cell + cell / 2, y + 30, str(d % simd_width), size=10)
    svg.text(x0, y + 58, "the lane of each element (every 8th numbered): neighbouring lanes "
             "read neighbouring elements,", anchor="start", size=11, color="#666")
    svg.text(x0, y + 76, "and a score is simd_sum of the lanes' partial dot products",
             anchor="start", size=11, color="#666")
    return svg.render()


# ---------------------------------------------------------------------------------------
# The architecture: the package's layers


PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tiny_llm"


def layers() -> str:
    import tiny_llm

    rows = list(reversed(tiny_llm.LAYERS))  # the highest layer on top
    details = [_layer_detail(name, role) for name, role in rows]
    row_h, x0, y0, name_w = 30, 20, 60, 215
    width = x0 + name_w + 7 * max(map(len, details)) + 20  # 11-px monospace: 6.6 px a char
    svg = Svg(width + x0, y0 + row_h * len(rows) + 60, "The package's layers")
    svg.text(x0, 30, "src/tiny_llm, lowest layer at the bottom: a module imports only its "
             "own layer and those below", anchor="start", bold=True)
    for i, ((name, _), detail) in enumerate(zip(rows, details, strict=True)):
        y = y0 + i * row_h
        package = (PACKAGE / name).is_dir()
        fill = COLORS[0] if name in tiny_llm.CHAPTERS else COLORS[2] if package else COLORS[3]
        svg.rect(x0, y, width - x0, row_h - 4, fill)
        svg.text(x0 + 8, y + 18, name + ("/" if package else ".py"), anchor="start", bold=True)
        svg.text(x0 + name_w, y + 18, detail, anchor="start", size=11, color="#333")
    y = y0 + row_h * len(rows) + 20
    for i, (label, fill) in enumerate((("a chapter (a learner replaces it)", COLORS[0]),
                                        ("a package", COLORS[2]), ("the CLI", COLORS[3]))):
        svg.rect(x0 + i * 280, y, 18, 14, fill)
        svg.text(x0 + i * 280 + 26, y + 12, label, anchor="start", size=12)
    return svg.render()


def _layer_detail(name: str, role: str) -> str:
    """A layer's role, and a package's modules as they are on disk."""
    detail = role.removeprefix("chapter: ").removeprefix("chapter, ")
    if (PACKAGE / name).is_dir():
        modules = sorted(p.stem for p in (PACKAGE / name).glob("*.py") if p.stem != "__init__")
        detail += " (" + ", ".join(modules) + ")"
    return detail


# ---------------------------------------------------------------------------------------
# Speculative decoding: a tree of drafts, its mask, and the cache after acceptance


def token_tree() -> str:
    from tiny_llm import speculative
    from tiny_llm.step.batch import Drafts, ScheduledChunk, StepBatch, TokenTree

    import numpy as np

    tree = TokenTree.parse([(0,), (1,), (0, 0), (1, 0), (1, 1)])
    words = ["cat", "dog", "sat", "ran", "was"]  # the drafts' tokens, one per node
    index = {path: i for i, path in enumerate(tree.paths)}
    parents = tuple(index[p[:-1]] if len(p) > 1 else -1 for p in tree.paths)
    drafts = Drafts(tuple(range(len(words))), parents=parents)
    committed = 7  # the request's tokens; the last one, "the", at position 6
    chunk = ScheduledChunk(_Request(committed), committed - 1, committed + len(drafts), drafts)
    batch = StepBatch.build([chunk], None)
    positions = batch.positions.tolist()
    visible = batch.tree.visible(range(1 + len(drafts)), committed + len(drafts))
    # The model's greedy choices: "dog" after "the", "was" after "dog", then "here" (token 9).
    target = np.eye(10)[[1, 9, 4, 9, 9, 9]]
    path, _ = speculative.tree_accept(drafts, target, np.eye(10)[list(drafts.tokens)],
                                      np.random.default_rng(0))
    moves: list[tuple[list[int], list[int]]] = []
    real_move = speculative.move_rows
    speculative.move_rows = lambda kv, request, src, dst: moves.append((src, dst))
    try:
        decoding = speculative.SpeculativeDecoding(None, None, 10, None, 0)
        decoding.move_accepted([chunk], {chunk.request: speculative.Emitted([], tuple(path))})
    finally:
        speculative.move_rows = real_move
    (src, dst), = moves
    svg = Svg(820, 470, "A tree of drafts: its rows, its mask, and the cache after acceptance")
    svg.text(20, 28, "speculative_token_tree [(0,), (1,), (0, 0), (1, 0), (1, 1)] after "
             "\"the\": one forward verifies five drafts", anchor="start", bold=True)
    # The tree: the last token at the root, each node under its parent.
    node_xy = {-1: (200.0, 80.0)}
    for i, node in enumerate(tree.paths):  # under its parent, siblings spread by rank
        siblings = sum(1 for other in tree.paths if other[:-1] == node[:-1])
        px, py = node_xy[parents[i]]
        spread = 210 if len(node) == 1 else 120
        node_xy[i] = (px + (node[-1] - (siblings - 1) / 2) * spread, py + 70)
    for i, parent in enumerate(parents):
        (x1, y1), (x2, y2) = node_xy[parent], node_xy[i]
        svg.line(x1, y1 + 14, x2, y2 - 14, color="#2a7" if i in path else "#999",
                 width=2.5 if i in path else 1)
    for i, (x, y) in node_xy.items():
        fill = "#eee" if i < 0 else "#bfe6c4" if i in path else "#f3f3f3"
        svg.rect(x - 34, y - 14, 68, 28, fill)
        label = "the" if i < 0 else f"d{i} {words[i]}"
        svg.text(x, y + 5, label, bold=i in path)
        row = 1 + i
        svg.text(x + 38, y + 5, f"pos {positions[row]}", anchor="start", size=11, color="#555")
    svg.text(20, 330, "green: the path the model accepts (tree_accept, greedy): d1 dog, d4 was,",
             anchor="start", size=12, color="#444")
    svg.text(20, 346, "then its own next token; each node sits at its depth's position.",
             anchor="start", size=12, color="#444")
    # The mask: which keys each row of the chunk sees.
    cell, mx0, my0 = 36, 460, 80
    keys = ["...", "the", *(f"d{i}" for i in range(len(drafts)))]
    first_key = committed - 2  # one column for the keys before "the"
    svg.text(mx0 + cell * len(keys) / 2, my0 - 22, "StepBatch.tree: keys each row sees",
             bold=True)
    for c, name in enumerate(keys):
        svg.text(mx0 + c * cell + cell / 2, my0 - 4, name, size=11)
    for r in range(1 + len(drafts)):
        svg.text(mx0 - 8, my0 + r * cell + cell / 2 + 4, "the" if r == 0 else f"d{r - 1}",
                 anchor="end", size=11)
        for c in range(len(keys)):
            seen = bool(visible[r, first_key + c])
            svg.rect(mx0 + c * cell, my0 + r * cell, cell, cell, "#7fb3e0" if seen else "white",
                     stroke="#bbb")
    # The cache rows after the last token, before and after acceptance.
    cy, cx0, slot = 385, 20, 62
    first = committed  # the draft rows: first + i
    before = ["the", *(f"d{i} {words[i]}" for i in range(len(drafts)))]
    after = ["the", *(f"d{i} {words[i]}" for i in path)]
    svg.text(cx0, cy - 12, "The KV rows from the last token on: accepted rows move to their "
             "depth's row (move_rows), the rest are rewound", anchor="start", size=12, bold=True)
    for k, label in enumerate(before):
        svg.rect(cx0 + 70 + k * slot, cy, slot - 4, 24, "#f3f3f3")
        svg.text(cx0 + 70 + k * slot + (slot - 4) / 2, cy + 16, label, size=11)
    svg.text(cx0 + 60, cy + 16, "before", anchor="end", size=11)
    for k in range(len(before)):
        filled = k < len(after)
        svg.rect(cx0 + 70 + k * slot, cy + 50, slot - 4, 24, "#bfe6c4" if filled else "white",
                 dashed=not filled)
        if filled:
            svg.text(cx0 + 70 + k * slot + (slot - 4) / 2, cy + 66, after[k], size=11)
    svg.text(cx0 + 60, cy + 66, "after", anchor="end", size=11)
    for s_row, d_row in zip(src, dst, strict=True):
        xs = cx0 + 70 + (1 + s_row - first) * slot + (slot - 4) / 2
        xd = cx0 + 70 + (1 + d_row - first) * slot + (slot - 4) / 2
        svg.line(xs, cy + 26, xd, cy + 48, arrow=True)
    svg.text(cx0 + 70 + len(before) * slot + 10, cy + 66, "dashed: back to the pool",
             anchor="start", size=11, color="#444")
    return svg.render()


# ---------------------------------------------------------------------------------------
# Day 2: how a step's budget is split


def budget_split() -> str:
    from tiny_llm.day1_batching import BatchingSimulator
    from tiny_llm.day2_chunked_prefill import ChunkedPrefillScheduler

    budget, names = 16, "ABCD"
    # (the step before which it arrives, prompt tokens, output tokens) of A, B, C, D
    arrivals = [(0, 4, 6), (0, 3, 6), (1, 30, 3), (2, 6, 3)]
    sim = BatchingSimulator(4, budget)
    sim.scheduler = ChunkedPrefillScheduler(4, budget)  # Day 2's scheduler, no model
    cell, x0, y0, row_h = 34, 80, 80, 46
    svg = Svg(860, y0 + 5 * row_h + 75, "How a step's token budget is split")
    svg.text(20, 30, f"ChunkedPrefillScheduler, a budget of {budget} tokens a step: decodes "
             "first, then prompt chunks", anchor="start", bold=True)
    for row in range(budget):
        svg.text(x0 + row * cell + cell / 2, y0 - 10, str(row), size=11, color="#666")
    for step in range(5):
        for arrival, prompt, output in arrivals:
            if arrival == step:
                sim.add_request(prompt, output)
        computed = [r.num_computed_tokens for r in sim.requests]
        report = sim.step()
        chunks = [(i, computed[i], computed[i] + n) for i, n in report.scheduled]
        decodes = [start >= len(sim.requests[i].prompt_token_ids) for i, start, _ in chunks]
        assert sum(end - start for _, start, end in chunks) <= budget, "over the budget"
        assert decodes == sorted(decodes, reverse=True), "a prefill chunk before a decode"
        y = y0 + step * row_h
        svg.text(x0 - 10, y + 22, f"step {report.step}", anchor="end")
        _budget_row(svg, chunks, decodes, names, x0, y, cell, budget)
        notes = [f"{names[i]}: prompt {start}..{end - 1}"
                 + (", samples" if end == len(sim.requests[i].prompt_token_ids) else "")
                 for (i, start, end), decode in zip(chunks, decodes, strict=True) if not decode]
        notes += [f"{names[r.request_id]} waits" for r in sim.scheduler.waiting]
        _notes(svg, x0 + budget * cell + 14, y + 17, notes)
    y = y0 + 5 * row_h + 10
    for i, line in enumerate([
            "Upper case: a decode token; lower case: a prompt token; dashed: an unused row.",
            "C (30 tokens) arrives before step 2, D (6 tokens) before step 3: D waits while C "
            "takes what the decodes leave.",
            "A and B get a token in every step; no step exceeds the budget."]):
        svg.text(20, y + 20 * i, line, anchor="start", size=12, color="#444")
    return svg.render()


def _budget_row(svg: Svg, chunks: list[tuple[int, int, int]], decodes: list[bool],
                names: str, x0: float, y: float, cell: float, budget: int) -> None:
    """One step's rows of the flat batch: each chunk's tokens in order, then the unused."""
    row = 0
    for (i, start, end), decode in zip(chunks, decodes, strict=True):
        for _ in range(start, end):
            svg.rect(x0 + row * cell, y, cell, 34, COLORS[i])
            svg.text(x0 + row * cell + cell / 2, y + 22,
                     names[i] if decode else names[i].lower(), bold=decode)
            row += 1
    for free in range(row, budget):
        svg.rect(x0 + free * cell, y, cell, 34, "#ffffff", dashed=True)


# ---------------------------------------------------------------------------------------
# Day 3: the page pool, prefix sharing and preemption


def page_states() -> str:
    from tiny_llm.day3_paged_kv import BlockManager, PagedBatchingSimulator

    blocks = BlockManager(8, 4, enable_prefix_caching=True)
    sim = PagedBatchingSimulator(4, blocks)
    shared = list(range(100, 108))  # two pages of prompt that A and B share
    prompts = {0: shared + [1, 2], 1: shared + [3, 4, 5], 2: [7] * 12}  # A, B, C by arrival
    names = "ABC"
    cell, x0, y0, row_h = 60, 80, 80, 66
    svg = Svg(900, y0 + 4 * row_h + 70, "The page pool, step by step")
    svg.text(20, 30, f"BlockManager: {blocks.num_blocks} pages of {blocks.block_size} tokens, "
             "prefix caching on; PagedScheduler, after each step", anchor="start", bold=True)
    for page in range(blocks.num_blocks):
        svg.text(x0 + page * cell + cell / 2, y0 - 10, f"page {page}", size=11, color="#666")
    for step in range(4):
        if step in prompts:
            sim.add_request(len(prompts[step]), 8, prompts[step])
        tables = {r: list(t) for r, t in blocks.tables.items()}
        running = list(sim.scheduler.running)
        report = sim.step()
        blocks.check_invariants()
        y = y0 + step * row_h
        svg.text(x0 - 10, y + 23, f"step {report.step}", anchor="end")
        _pool_row(svg, blocks, names, x0, y, cell)
        notes = _pool_notes(tables, running, blocks, names)
        _notes(svg, x0 + blocks.num_blocks * cell + 14, y + 19, notes)
    y = y0 + 4 * row_h + 10
    for i, line in enumerate([
            "A colour: the request whose block table holds the page; ×2: two tables share it "
            "(reference count 2).",
            "Dashed: free. \"cached\": free, yet its hash still names its tokens, so a request "
            "with that prefix reuses it.",
            "B reuses A's two full prompt pages; when a page is missing, the newest request "
            "is preempted."]):
        svg.text(20, y + 20 * i, line, anchor="start", size=12, color="#444")
    return svg.render()


def _pool_row(svg: Svg, blocks: BlockManager, names: str, x0: float, y: float, cell: float) -> None:
    """Each page of the pool: who holds it, how many tables share it, or free."""
    owners: dict[int, list[int]] = {}
    for request, table in blocks.tables.items():
        for page in table:
            owners.setdefault(page, []).append(request.request_id)
    for block in blocks.blocks:
        x, held = x0 + block.block_id * cell, sorted(owners.get(block.block_id, []))
        assert len(held) == block.ref_count
        if held:
            fill = COLORS[held[0]] if len(held) == 1 else COLORS[3]
            svg.rect(x, y, cell, 38, fill)
            svg.text(x + cell / 2, y + 17, "+".join(names[i] for i in held), bold=True)
            if len(held) > 1:
                svg.text(x + cell / 2, y + 32, f"×{len(held)}", size=11)
        else:
            svg.rect(x, y, cell, 38, "#ffffff", dashed=True)
            svg.text(x + cell / 2, y + 24, "cached" if block.hash else "free", size=11,
                     color="#666")


def _pool_notes(before: dict[SimRequest, list[int]], running: list[SimRequest],
                blocks: BlockManager, names: str) -> list[str]:
    """What a step did to the pool, in order: admissions (with their prefix hits), pages
    taken from the free list, a preemption (of the newest running request), and pages
    taken from what it freed."""
    victims = [r for r in before if r not in blocks.tables]
    freed = {page for victim in victims for page in before[victim]}
    early, late = [], []
    for request, table in blocks.tables.items():
        name, pages = names[request.request_id], ", ".join(map(str, table))
        if request not in before:
            hits = ", ".join(map(str, table[:request.num_cached_tokens // blocks.block_size]))
            early.append(f"{name} admitted: pages {pages}" + (f" ({hits} cached)" if hits else ""))
        elif table != before[request]:
            new = table[len(before[request]):]
            (late if freed & set(new) else early).append(
                f"{name} grows into page {', '.join(map(str, new))}")
    for victim in victims:
        assert victim is running[-1] and victim.num_preemptions, "not a preemption of the newest"
        early += [f"{names[victim.request_id]} preempted (newest): pages",
                  f"  {', '.join(map(str, reversed(before[victim])))} freed, tail first"]
    return early + late


def _notes(svg: Svg, x: float, middle: float, lines: list[str]) -> None:
    """Lines of 12-px text, left-aligned at ``x``, centred on ``middle`` as a block."""
    for i, line in enumerate(lines):
        svg.text(x, middle + 4 + 14 * i - 7 * (len(lines) - 1), line, anchor="start", size=12)


# ---------------------------------------------------------------------------------------
# Speculative decoding: one verification step, and the rewind of the rejected rows


class _Draws:
    """A stand-in for the request's generator whose uniform draws are given, so that the
    figure can show each one the acceptance rule takes."""

    def __init__(self, draws: list[float]):
        self.draws, self.used = draws, 0

    def random(self) -> float:
        self.used += 1
        return self.draws[self.used - 1]


def speculation_steps() -> str:
    from tiny_llm.day3_paged_kv import BlockManager, PageTables
    from tiny_llm.speculative import rewind, speculative_accept

    import numpy as np

    vocab = ["the", "cat", "sat", "on", "ran", "dog"]
    text = ["we", "fed", "the", "dog", "and", "the"]  # committed; "the" not yet computed
    drafts = [vocab.index(w) for w in ("cat", "sat", "on", "the")]
    q = np.array([[0, .5, 0, 0, 0, .5], [0, 0, .7, 0, .3, 0], [0, 0, 0, 1, 0, 0],
                  [1, 0, 0, 0, 0, 0]])  # the proposer's distribution at each draft
    p = np.array([[.1, .6, 0, 0, 0, .3], [.1, 0, .2, .1, .6, 0], [.4, 0, 0, .2, .2, .2],
                  [.2, .2, .2, .2, .1, .1], [.2, .2, .2, .2, .1, .1]])  # the model's, k + 1 rows
    draws = _Draws([.42, .55, .5])
    accepted, token = speculative_accept(drafts, p, q, draws)
    assert draws.used == min(accepted + 1, len(drafts)) + 1, "a draw per tried draft, one more"
    tables = PageTables(BlockManager(4, 4))
    n, k = len(text), len(drafts)
    assert tables.allocate("A", n + k)  # the verification writes rows n - 1 .. n + k - 1
    before = list(tables.table("A"))
    rewind(tables, "A", n + accepted)  # computed: the last token and the accepted drafts
    svg = Svg(860, 470, "One step of speculative decoding")
    svg.text(20, 30, f"Draft k = {k}, verify them in one forward, keep a prefix and one "
             "token more, rewind the rest", anchor="start", bold=True)
    _spec_table(svg, vocab, drafts, p, q, draws, accepted, token)
    tokens = text + [vocab[d] for d in drafts]
    emitted = " ".join([*tokens[n:n + accepted], vocab[token]])
    svg.text(20, 236, f"speculative_accept returns ({accepted}, {token}): the step emits "
             f"\"{emitted}\"", anchor="start", size=12, bold=True)
    _spec_pages(svg, 262, "written", before, tokens, n - 1, n + k, tables.blocks.block_size)
    kept = tokens[:n + accepted] + [f"{vocab[token]}*"]
    freed = tuple(b for b in before if b not in tables.table("A"))
    _spec_pages(svg, 336, "rewound", tables.table("A"), kept, n - 1, n + accepted,
                tables.blocks.block_size, freed)
    for i, line in enumerate([
            "Each slot: the token whose K/V row it holds; orange: rows this step wrote.",
            f"rewind(tables, request, {n + accepted}) keeps the first {n + accepted} rows; "
            "BlockManager.truncate returns the pages past them.",
            f"*: the emitted \"{vocab[token]}\" has no K/V yet; its row is written by the next "
            "step, over the stale slot."]):
        svg.text(20, 410 + 20 * i, line, anchor="start", size=12, color="#444")
    return svg.render()


def _spec_table(svg: Svg, vocab: list[str], drafts: list[int], p: np.ndarray, q: np.ndarray,
                draws: _Draws, accepted: int, token: int) -> None:
    """Each draft: q(x), p(x), the chance of keeping it, the draw, and the verdict."""
    import numpy as np

    heads = ["draft", "q(x)", "p(x)", "min(1, p/q)", "draw u", "verdict"]
    xs = [20, 150, 230, 310, 430, 520]
    for x, head in zip(xs, heads, strict=True):
        svg.text(x, 70, head, anchor="start", bold=True)
    for i, d in enumerate(drafts):
        y = 96 + 24 * i
        row = [f"x{i} = {vocab[d]}"]
        if i <= accepted:  # tried: one draw each
            row += [f"{q[i, d]:.2f}", f"{p[i, d]:.2f}", f"{min(1.0, p[i, d] / q[i, d]):.2f}",
                    f"{draws.draws[i]:.2f}"]
        for x, cell in zip(xs, row, strict=False):
            svg.text(x, y, cell, anchor="start", color="#222" if i <= accepted else "#999")
        verdict = "kept" if i < accepted else "rejected" if i == accepted else "not tried"
        svg.text(xs[-1], y, verdict, anchor="start", bold=i == accepted,
                 color="#2a7" if i < accepted else "#b33" if i == accepted else "#999")
    residual = np.maximum(p[accepted] - q[accepted], 0.0)
    assert residual[token] > 0, "the emitted token is not in the residual"
    shares = ", ".join(f"{vocab[t]} {w:.2f}" for t, w in enumerate(residual / residual.sum())
                       if w > 0)
    svg.text(20, 96 + 24 * len(drafts) + 20, f"at x{accepted}: the residual max(0, p − q), "
             f"normalised: {shares}; draw u = {draws.draws[draws.used - 1]:.2f} → "
             f"\"{vocab[token]}\"", anchor="start", size=12)


def _spec_pages(svg: Svg, y: float, label: str, table: list[int], tokens: list[str],
                first_written: int, end: int, page_size: int, freed: tuple[int, ...] = ()) -> None:
    """A block table's pages, each slot with the token of its row; written rows orange."""
    cell, x0 = 48, 110
    svg.text(x0 - 12, y + 36, label, anchor="end")
    for j, page in enumerate([*table, *freed]):
        x = x0 + j * (page_size * cell + 16)
        svg.text(x + page_size * cell / 2, y + 10, f"page {page}" + (" → free" if page in freed
                                                                      else ""), size=11)
        for slot in range(page_size):
            pos = j * page_size + slot
            held = page not in freed and pos < end
            fill = "#ffffff" if not held else COLORS[1] if pos >= first_written else COLORS[0]
            svg.rect(x + slot * cell, y + 18, cell, 28, fill, dashed=not held)
            if pos < len(tokens):
                svg.text(x + slot * cell + cell / 2, y + 37, tokens[pos], size=11,
                         color="#222" if held else "#999")


# ---------------------------------------------------------------------------------------
# Mixture of Experts: route, dispatch, combine


def moe_dispatch() -> str:
    from tiny_llm.moe import combine, dispatch, expert_bounds, route

    import mlx.core as mx

    logits = mx.array([[2.0, 0.1, 1.0, -1.0], [0.3, 1.9, -0.5, 1.4], [1.1, -0.2, 0.2, 2.2],
                       [-1.0, 0.4, 1.6, 1.3], [0.9, 2.6, 0.0, -0.3]])  # router logits [T, E]
    (T, E), k = logits.shape, 2
    routing = route(logits, k, normalize=True)
    grouped = dispatch(mx.arange(T, dtype=mx.float32)[:, None], routing.experts)  # x[t] = t
    order, rows = grouped.order.tolist(), grouped.rows[:, 0].tolist()
    # Each assignment's output: a one-hot of its expert, so combine returns the weights.
    combined = combine(mx.eye(E)[grouped.expert_ids], grouped.order, routing.weights).tolist()
    experts, weights = routing.experts.tolist(), routing.weights.tolist()
    assert rows == [j // k for j in order], "dispatch gathered the wrong rows"
    row_h, y0 = 28, 90
    svg = Svg(900, y0 + T * k * row_h + 90, "Routing, dispatch and combine")
    svg.text(20, 30, f"SparseMoeBlock: {T} rows, {E} experts, top-{k} (norm_topk_prob): "
             "route, dispatch, combine", anchor="start", bold=True)
    for x, head in ((20, "route: each row's experts"), (330, "dispatch: sorted by expert"),
                    (640, "combine: weighted sum")):
        svg.text(x, y0 - 20, head, anchor="start", bold=True)
    chip: dict[int, tuple[float, float]] = {}  # assignment t * k + slot -> its chip's right end
    for t in range(T):
        y = y0 + t * k * row_h
        svg.text(20, y + row_h, f"t{t}", anchor="start", bold=True)
        for slot in range(k):
            ys = y + slot * row_h + 4
            svg.rect(60, ys, 120, row_h - 8, COLORS[t])
            svg.text(120, ys + 15, f"E{experts[t][slot]}  w {weights[t][slot]:.2f}", size=12)
            chip[t * k + slot] = (180, ys + (row_h - 8) / 2)
    for expert, start, end in expert_bounds(grouped.expert_ids):  # one matmul group each
        middle = y0 + (start + end) * row_h / 2
        svg.rect(320, y0 + start * row_h, 160, (end - start) * row_h, "#f6f6f6", stroke="#999")
        svg.text(345, middle, f"E{expert}", bold=True)
        svg.text(345, middle + 13, f"{start}..{end - 1}", size=10, color="#555")
    for j, assignment in enumerate(order):
        t, y = assignment // k, y0 + j * row_h + 4
        assert experts[t][assignment % k] == grouped.expert_ids[j].item()
        svg.rect(370, y, 100, row_h - 8, COLORS[t])
        svg.text(420, y + 15, f"x[t{t}]", size=12)
        svg.line(*chip[assignment], 318, y + (row_h - 8) / 2, color="#999")
        svg.line(470, y + (row_h - 8) / 2, 636, y0 + (t * k + 1) * row_h - 4, color="#999")
    for t in range(T):
        y = y0 + t * k * row_h + row_h - 4
        got = [combined[t][e] for e in experts[t]]
        assert all(abs(g - w) < 1e-6 for g, w in zip(got, weights[t], strict=True))
        terms = " + ".join(f"{g:.2f}·E{e}(x)" for g, e in zip(got, experts[t], strict=True))
        svg.text(640, y + 4, f"t{t}: {terms}", anchor="start", size=12)
    for i, line in enumerate([
            "route: softmax over the experts, the top-k kept and renormalised; dispatch: "
            "argsort of the flat [T·k] experts;",
            "one gather_mm multiplies each sorted row by its expert's weights (or the loop: "
            "one matmul per grey group);",
            "combine: outputs scattered back to [T, k] and summed with the routing weights, "
            "each row its own k outputs."]):
        svg.text(20, y0 + T * k * row_h + 30 + 20 * i, line, anchor="start", size=12,
                 color="#444")
    return svg.render()


# ---------------------------------------------------------------------------------------
# Tensor parallelism: one decoder layer on two ranks


def tp_split() -> str:
    from tiny_llm.tensor_parallel import AllReduce, shard_model
    from tiny_llm.testing.models import make_tiny_model
    from tiny_llm.testing.ranks import RankPlace

    size = 2
    whole = make_tiny_model(vocab_size=32, num_hidden_layers=1).model.layers[0]
    ranks = []
    for r in range(size):
        model = make_tiny_model(vocab_size=32, num_hidden_layers=1)  # the same weights
        shard_model(model, RankPlace(r, size))
        ranks.append(model.model.layers[0])
    assert all(isinstance(b.self_attn, AllReduce) and isinstance(b.mlp, AllReduce)
               for b in ranks), "a layer without its two all-reduces"
    head_dim = whole.self_attn.head_dim
    projections = [("self_attn", "q_proj", "q head", head_dim),
                   ("self_attn", "k_proj", "KV head", head_dim),
                   ("self_attn", "v_proj", "KV head", head_dim),
                   ("self_attn", "o_proj", "q head", head_dim), ("mlp", "gate_proj", "", 1),
                   ("mlp", "up_proj", "", 1), ("mlp", "down_proj", "", 1)]
    row_h, x0, col_w, y0 = 34, 200, 340, 80
    svg = Svg(x0 + size * col_w + 20, y0 + 10 * row_h + 80, "One layer on two ranks")
    svg.text(20, 30, "shard_model over 2 ranks: the weights each rank keeps of one decoder "
             "layer (a tiny qwen3)", anchor="start", bold=True)
    for r in range(size):
        svg.text(x0 + r * col_w + col_w / 2, y0 - 14, f"rank {r}", bold=True)
    y = y0
    for block, name, unit, width in projections:
        full = getattr(getattr(whole, block), name).weight
        svg.text(20, y + 21, f"{name} {_shape(full)}", anchor="start")
        for r, layer in enumerate(ranks):
            kept = getattr(getattr(layer, block).module, name).weight
            svg.rect(x0 + r * col_w, y + 2, col_w - 12, row_h - 6,
                     COLORS[0] if kept.shape[0] < full.shape[0] else COLORS[1])
            svg.text(x0 + r * col_w + 8, y + 21, f"{_shape(kept)} {_kept(full, kept, unit, width)}",
                     anchor="start", size=12)
        y += row_h
        if name in ("v_proj", "o_proj", "down_proj"):
            y = _tp_between(svg, name, ranks, x0, y, col_w, row_h, size)
    for i, line in enumerate([
            "blue: a column shard (rows of W [out, in]: whole outputs); orange: a row shard "
            "(columns of W: a partial sum).",
            "Each rank attends over its own heads with no communication; two all_reduce per "
            "layer add the partial sums."]):
        svg.text(20, y + 20 + 20 * i, line, anchor="start", size=12, color="#444")
    return svg.render()


def _tp_between(svg: Svg, name: str, ranks: list[TransformerBlock], x0: float, y: float,
                col_w: float, row_h: float, size: int) -> float:
    """The row after v_proj (each rank's attention) or a row shard (the all-reduce)."""
    if name == "v_proj":
        for r, layer in enumerate(ranks):
            attn = layer.self_attn.module
            svg.text(x0 + r * col_w + 8, y + 21, f"attention over its {attn.n_heads} q heads, "
                     f"{attn.n_kv_heads} KV", anchor="start", size=12, color="#555")
        return y + row_h
    svg.rect(x0, y + 2, size * col_w - 12, row_h - 6, COLORS[4])
    svg.text(x0 + (size * col_w - 12) / 2, y + 21, f"all_reduce: the ranks' {name} partial "
             "sums, added in rank order", size=12, bold=True)
    return y + row_h


def _shape(weight: mx.array) -> str:
    return "[" + "×".join(map(str, weight.shape)) + "]"


def _kept(full: mx.array, kept: mx.array, unit: str, width: int) -> str:
    """Which slice of ``full`` a rank's ``kept`` is: rows (a column shard) or columns (a
    row shard), found by comparing the values."""
    import mlx.core as mx

    axis = 0 if kept.shape[0] < full.shape[0] else 1
    n = kept.shape[axis]
    starts = [s for s in range(0, full.shape[axis], n)
              if mx.array_equal(mx.take(full, mx.arange(s, s + n), axis=axis), kept).item()]
    assert len(starts) == 1, "a shard that is not one slice of the whole weight"
    lo, hi = starts[0], starts[0] + n
    first, last = lo // width, hi // width - 1
    what = "" if not unit else f" = {unit} {first}" if last == first else \
        f" = {unit}s {first}..{last}"
    return f"{'rows' if axis == 0 else 'cols'} {lo}..{hi - 1}{what}"


# ---------------------------------------------------------------------------------------
# Serving: the server's threads and queues


def _calls(function: Callable[..., object], *snippets: str) -> None:
    """Fail if ``function``'s source no longer contains each of ``snippets``: the figure
    names these calls, and a rename must break the drawing."""
    source = inspect.getsource(function)
    missing = [s for s in snippets if s not in source]
    assert not missing, f"{function.__qualname__} no longer calls {missing}"


def server_threads() -> str:
    from tiny_llm.serving import handlers
    from tiny_llm.serving.engine_loop import EngineLoop

    Server = handlers.Server
    loop = EngineLoop(engine=None)  # never started: its thread and queues are only named
    grammar = re.search(r'thread_name_prefix="([^"]+)"', inspect.getsource(Server.__init__))
    assert grammar is not None, "Server no longer names its grammar threads"
    _calls(Server.submit, "asyncio.to_thread(check_context_length", "self.loop.add")
    _calls(Server.compile_grammar, "self.compiler", "self.engine.compile_grammar")
    _calls(Server.outputs, "await queue.get()", "self.loop.abort(request_id)")
    _calls(EngineLoop.add, "asyncio.Queue()", "with self._admit", "self.engine.add_request")
    _calls(EngineLoop.abort, "self._aborts.put", "self._wake.set()")
    _calls(EngineLoop._run, "self._take_aborts()", "self.engine.step()", "self._deliver(")
    _calls(EngineLoop._deliver, "loop.call_soon_threadsafe(queue.put_nowait")
    svg = Svg(900, 480, "The server's threads and queues")
    svg.text(20, 30, "tiny-llm serve: handlers on an event loop, worker threads, one engine "
             "thread, a queue per request", anchor="start", bold=True)
    boxes = [("event loop (uvicorn)", COLORS[0], [
                 "Server.submit: parse the body,", "  to_thread(check_context_length)",
                 "  to_thread(EngineLoop.add)", "Server.outputs: await queue.get()",
                 "Server.events: SSE to the client", "closed early: loop.abort(id)"]),
             ("worker threads", COLORS[2], [
                 "check_context_length:", "  template and tokenize", "EngineLoop.add: with _admit,",
                 "  engine.add_request", f"{grammar[1]} × {handlers.GRAMMAR_THREADS}:",
                 "  engine.compile_grammar"]),
             (f"thread {loop._thread.name}", COLORS[1], [
                 "EngineLoop._run, while unfinished:", "  _take_aborts: engine.abort",
                 "  engine.step()", "  _deliver: each output to", "    its request's queue",
                 f"idle: waits on _wake ({type(loop._wake).__name__})"])]
    for n, (title, fill, lines) in enumerate(boxes):
        x = 20 + 300 * n
        svg.rect(x, 60, 260, 190, fill)
        svg.text(x + 130, 80, title, bold=True)
        for i, line in enumerate(lines):
            svg.text(x + 10, 106 + 22 * i, line, anchor="start", size=12)
    svg.line(282, 140, 318, 140, arrow=True)
    _server_queue(svg, 300, "queues[id]: an asyncio.Queue per request",
                  "engine thread → handler (call_soon_threadsafe)", (720, 250), (180, 250))
    _server_queue(svg, 370, f"_aborts: {type(loop._aborts).__name__} of request ids",
                  "handler → engine thread, posted without waiting", (100, 250), (800, 250))
    for i, line in enumerate([
            "A handler never waits for a step: an add waits only for the _admit lock, an abort "
            "is posted, outputs arrive",
            "on the request's own queue. Requests added between steps join the batch at the "
            "next engine.step()."]):
        svg.text(20, 440 + 18 * i, line, anchor="start", size=12, color="#444")
    return svg.render()


def _server_queue(svg: Svg, y: float, name: str, what: str, source: tuple[float, float],
                  target: tuple[float, float]) -> None:
    """A queue between two threads, with an arrow in from ``source`` and out to ``target``."""
    svg.rect(300, y, 300, 44, COLORS[3])
    svg.text(450, y + 18, name, size=11, bold=True)
    svg.text(450, y + 35, what, size=10, color="#444")
    side_in, side_out = (300, 600) if source[0] < target[0] else (600, 300)
    svg.line(*source, side_in, y + 22, arrow=True)
    svg.line(side_out, y + 22, *target, arrow=True)


FIGURES_BY_NAME: dict[str, Callable[[], str]] = {
    "flat-batch.svg": flat_batch,
    "page-walk.svg": page_walk,
    "tiles-diagonal.svg": tiles_diagonal,
    "metal-threadgroup.svg": metal_threadgroup,
    "layers.svg": layers,
    "token-tree.svg": token_tree,
    "budget-split.svg": budget_split,
    "page-states.svg": page_states,
    "speculation-steps.svg": speculation_steps,
    "moe-dispatch.svg": moe_dispatch,
    "tp-split.svg": tp_split,
    "server-threads.svg": server_threads,
}


def main() -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    for name, draw in FIGURES_BY_NAME.items():
        (FIGURES / name).write_text(draw())
        print(f"wrote {(FIGURES / name).relative_to(FIGURES.parents[2])}")


if __name__ == "__main__":
    main()
