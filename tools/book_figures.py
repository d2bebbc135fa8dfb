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
  ``move_accepted`` makes.

The files are committed; ``tests/test_book.py`` draws them again and fails if a committed
one differs, so a diagram cannot drift from the code it shows.

    python tools/book_figures.py          # rewrite book/src/figures/*.svg
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from html import escape
from pathlib import Path

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


FIGURES_BY_NAME: dict[str, Callable[[], str]] = {
    "flat-batch.svg": flat_batch,
    "page-walk.svg": page_walk,
    "tiles-diagonal.svg": tiles_diagonal,
    "metal-threadgroup.svg": metal_threadgroup,
    "layers.svg": layers,
    "token-tree.svg": token_tree,
}


def main() -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    for name, draw in FIGURES_BY_NAME.items():
        (FIGURES / name).write_text(draw())
        print(f"wrote {(FIGURES / name).relative_to(FIGURES.parents[2])}")


if __name__ == "__main__":
    main()
