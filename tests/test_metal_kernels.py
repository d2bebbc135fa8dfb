"""The project's Metal kernels (src/extensions/metal) against numpy references.

On Linux the kernels run under the CPU Metal emulator (tools/metal_emulator): the
``.metal`` file compiles unchanged as C++ and every case runs under several thread
schedules, whose outputs must be bit-identical and close to a float64 numpy
reference. On a Mac with a GPU the same cases run through the real extension op
(``tiny_llm.day4_paged_attention.paged_attention``).

Four groups:

* ragged paged-attention cases (context lengths 1, page-1, page, page+1 and many
  pages; shuffled pages; GQA 1/3/4/8; multi-query rows with a causal offset mixed
  with single-query rows; NaN garbage in every slot and page nobody may read;
  float and half) for every kernel family in ``FAMILIES``;
* the MSL-subset lint on every .metal file in src/extensions/metal;
* planted bugs: one-line mutations of the REAL kernel source, each caught in the
  way expected (mismatch with the reference, a difference between schedules, an
  out-of-bounds report naming the buffer, a barrier report naming the line);
* the same numeric cases on the GPU (skipped where Metal is unavailable).

Kernel families (``FAMILIES``): "vector" is ``paged_attention_decode`` (the vector
schedule for every row) and "dispatch" is ``paged_attention``, the op's kernel (vector
schedule for single-query rows, tiled FlashAttention schedule for multi-query
sequences, one grid). Adding a family: add its host_name instantiations to its .metal
file and one ``KernelFamily`` entry (file, host name for a case, launch geometry,
optional buffers and a filter for the cases it supports); every case then runs on it,
and the lint globs the folder.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

from metal_emulator import (  # noqa: E402
    DEFAULT_SCHEDULES,
    BarrierError,
    MetalLibrary,
    Out,
    OutOfBoundsError,
    ScheduleMismatch,
    compile_metal,
    lint_metal,
    run_schedules,
)

METAL_DIR = REPO / "src" / "extensions" / "metal"
PAGED = METAL_DIR / "paged_attention.metal"

HAVE_COMPILER = shutil.which(os.environ.get("CXX", "g++")) is not None
# The emulator is Linux-only (README: x86-64 context switch or ucontext, GCC flags);
# on a Mac the GPU tests at the end of this file run the same cases instead.
needs_emulator = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not HAVE_COMPILER,
    reason="the Metal emulator needs Linux and a C++ compiler (g++ or $CXX)",
)


# ------------------------------------------------------------------- cases


@dataclass(frozen=True)
class PagedCase:
    """One ragged batch: ``seqs`` is a list of (context_len, query_len)."""

    name: str
    dtype: str  # "float" | "half"
    head_dim: int
    group: int  # query heads per KV head (GQA ratio)
    n_kv_heads: int
    page_size: int
    seqs: tuple[tuple[int, int], ...]
    spare_pages: int = 3  # pool pages nobody owns (filled with NaN)
    seed: int = 0

    @property
    def n_heads(self) -> int:
        return self.n_kv_heads * self.group

    @property
    def num_rows(self) -> int:
        return sum(q for _, q in self.seqs)

    @property
    def np_dtype(self) -> type:
        return {"float": np.float32, "half": np.float16}[self.dtype]

    def __str__(self) -> str:
        return self.name


CASES = [
    # context 1, page-1, page, page+1 and 8 pages (every simdgroup owns one).
    PagedCase("ragged_decode_f32_gqa3", "float", 64, 3, 2, 8,
              ((1, 1), (7, 1), (8, 1), (9, 1), (61, 1))),
    # 13 and 10 pages: simdgroups 0..4 walk two pages each (j += 8 wraps).
    PagedCase("many_pages_f32_gqa4", "float", 128, 4, 1, 8, ((100, 1), (73, 1), (3, 1)), seed=1),
    # Multi-query rows (causal offset) mixed with single-query rows; a full prefill.
    PagedCase("mixed_prefill_f32_gqa8", "float", 96, 8, 1, 8,
              ((23, 5), (1, 1), (17, 17), (40, 3)), seed=2),
    # Query tiles of 21 rows (64 // 3 pairs): the 30-row chunk spans two tiles.
    PagedCase("prefill_f32_gqa3", "float", 64, 3, 2, 16, ((50, 30), (5, 1), (16, 16)), seed=6),
    PagedCase("ragged_f32_mha", "float", 64, 1, 4, 16, ((15, 1), (17, 1), (100, 2)), seed=3),
    PagedCase("ragged_f16_mha", "half", 64, 1, 2, 16, ((1, 1), (15, 1), (33, 4), (70, 1)), seed=4),
    PagedCase("mixed_f16_gqa4", "half", 128, 4, 2, 8, ((9, 2), (31, 1), (64, 6)), seed=5),
]  # fmt: skip
CASE_BY_NAME = {c.name: c for c in CASES}

TOLERANCE = {"float": 2e-5, "half": 2e-3}  # atol = rtol, outputs are O(1)


@dataclass
class PagedInputs:
    q: np.ndarray  # [T, Hq, D]
    k_pages: np.ndarray  # [P, page_size, Hkv, D]
    v_pages: np.ndarray
    block_table: np.ndarray  # int32 [B, max_pages], -1 where unused
    context_lens: np.ndarray  # int32 [B]
    query_start_loc: np.ndarray  # int32 [B + 1]
    scale: float
    ref: np.ndarray = field(repr=False)  # float64 [T, Hq, D]


def make_inputs(case: PagedCase) -> PagedInputs:
    """Inputs with shuffled pages and NaN in every slot/page no row may read."""
    rng = np.random.default_rng(case.seed)
    ps, hkv, d = case.page_size, case.n_kv_heads, case.head_dim
    ctx = np.array([c for c, _ in case.seqs], np.int32)
    qlen = np.array([q for _, q in case.seqs], np.int32)
    assert (qlen >= 1).all() and (ctx >= qlen).all()
    pages_used = -(-ctx // ps)
    max_pages = int(pages_used.max()) + 1  # every row ends with at least one -1
    num_pages = int(pages_used.sum()) + case.spare_pages
    free = list(rng.permutation(num_pages))
    table = np.full((len(ctx), max_pages), -1, np.int32)
    for b, n in enumerate(pages_used):
        for j in range(n):
            table[b, j] = free.pop()

    k = rng.standard_normal((num_pages, ps, hkv, d))
    v = rng.standard_normal((num_pages, ps, hkv, d))
    readable = np.zeros((num_pages, ps), bool)
    for b, n in enumerate(ctx):
        pos = np.arange(n)
        readable[table[b, pos // ps], pos % ps] = True
    k[~readable] = np.nan
    v[~readable] = np.nan
    q = 1.5 * rng.standard_normal((int(qlen.sum()), case.n_heads, d))  # peaky softmax
    q, k, v = (a.astype(case.np_dtype) for a in (q, k, v))
    qsl = np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32)
    scale = float(1 / np.sqrt(d))
    ref = paged_attention_ref(q, k, v, table, ctx, qsl, scale)
    return PagedInputs(q, k, v, table, ctx, qsl, scale, ref)


def paged_attention_ref(q, k_pages, v_pages, block_table, context_lens, query_start_loc, scale):
    """float64 reference: row i of sequence b (L_b rows) sits at position
    context_lens[b] - L_b + i and sees keys 0..that position."""
    t, hq, d = q.shape
    ps, hkv = k_pages.shape[1], k_pages.shape[2]
    group = hq // hkv
    out = np.full((t, hq, d), np.nan)
    for b, n in enumerate(context_lens):
        rows = np.arange(query_start_loc[b], query_start_loc[b + 1])
        pos = np.arange(n)
        pages, slots = block_table[b, pos // ps], pos % ps
        kk = k_pages[pages, slots].astype(np.float64)  # [n, Hkv, D]
        vv = v_pages[pages, slots].astype(np.float64)
        last = n - len(rows) + np.arange(len(rows))  # causal limit per row
        visible = pos[None, :] <= last[:, None]  # [L, n]
        for h in range(hq):
            kv = h // group
            s = q[rows, h].astype(np.float64) @ kk[:, kv].T * scale  # [L, n]
            s = np.where(visible, s, -np.inf)
            w = np.exp(s - s.max(axis=1, keepdims=True))
            out[rows, h] = (w / w.sum(axis=1, keepdims=True)) @ vv[:, kv]
    return out


# --------------------------------------------------------- kernel families


def paged_buffers(case: PagedCase, x: PagedInputs) -> dict[int | str, Any]:
    """Buffers of the block-table interface (DESIGN.md section 4), by parameter name."""
    return {
        "q": x.q,
        "k_pages": x.k_pages,
        "v_pages": x.v_pages,
        "block_table": x.block_table,
        "context_lens": x.context_lens,
        "query_start_loc": x.query_start_loc,
        "out": Out(x.q.shape, case.np_dtype),
        "p": {
            "num_seqs": len(x.context_lens),
            "max_pages": x.block_table.shape[1],
            "n_heads": case.n_heads,
            "n_kv_heads": case.n_kv_heads,
            "page_size": case.page_size,
            "scale": x.scale,
        },
    }


@dataclass(frozen=True)
class KernelFamily:
    path: Path
    host_name: Callable[[PagedCase], str]
    launch: Callable[[PagedCase], dict[str, Any]]  # groups= / grid=, threadgroup=
    buffers: Callable[[PagedCase, PagedInputs], dict[int | str, Any]] = paged_buffers
    supports: Callable[[PagedCase], bool] = lambda case: True
    output: str = "out"


def dispatch_groups(case: PagedCase) -> tuple[int, int]:
    """The op's grid (paged_attention_metal in src/extensions/paged_attention.cpp): one
    threadgroup per query row, then tiles_per_seq per sequence, per KV head."""
    tile_rows = 64 // case.group
    tiles_per_seq = -(-case.num_rows // tile_rows)
    return (case.num_rows + len(case.seqs) * tiles_per_seq, case.n_kv_heads)


FAMILIES = {
    # The vector schedule alone, for every row: one threadgroup per (query row, KV head),
    # 8 simdgroups of 32 lanes.
    "vector": KernelFamily(
        PAGED,
        lambda c: f"paged_attention_decode_{c.dtype}_{c.head_dim}_{c.group}",
        lambda c: {"groups": (c.num_rows, c.n_kv_heads), "threadgroup": 256},
    ),
    # The op's kernel: vector schedule for single-query rows, tiled (FlashAttention)
    # schedule with simdgroup_matrix tiles for multi-query sequences, one dispatch.
    "dispatch": KernelFamily(
        PAGED,
        lambda c: f"paged_attention_{c.dtype}_{c.head_dim}_{c.group}",
        lambda c: {"groups": dispatch_groups(c), "threadgroup": 256},
        supports=lambda c: c.page_size % 8 == 0 and c.head_dim % 8 == 0,
    ),
}

FAMILY_CASES = [
    pytest.param(fam, case, id=f"{fam}-{case.name}")
    for fam, family in FAMILIES.items()
    for case in CASES
    if family.supports(case)
]

_inputs_cache: dict[str, PagedInputs] = {}


def inputs(case: PagedCase) -> PagedInputs:
    if case.name not in _inputs_cache:
        _inputs_cache[case.name] = make_inputs(case)
    return _inputs_cache[case.name]


def run_case(
    lib: MetalLibrary,
    family: KernelFamily,
    case: PagedCase,
    schedule: str | None = None,
    **launch: Any,
) -> np.ndarray:
    """Output of ``case`` (float64): one schedule, or all DEFAULT_SCHEDULES bit-identical."""
    x = inputs(case)
    args = (family.host_name(case), family.buffers(case, x))
    launch = {**family.launch(case), **launch}
    if schedule is None:
        out = run_schedules(lib, *args, **launch)
    else:
        out = lib.run(*args, schedule=schedule, **launch)
    return out[family.output].astype(np.float64)


def close_to_ref(got: np.ndarray, case: PagedCase) -> bool:
    tol = TOLERANCE[case.dtype]
    return bool(np.allclose(got, inputs(case).ref, atol=tol, rtol=tol))


# ------------------------------------------------------- kernels vs numpy


def test_reference_masks_causally_and_ignores_nan_garbage() -> None:
    case = CASE_BY_NAME["mixed_prefill_f32_gqa8"]
    x = inputs(case)
    assert np.isfinite(x.ref).all()
    assert np.isnan(x.k_pages).any() and np.isnan(x.v_pages).any()
    # Row 0 of the 17-token prefill (rows 6..22) sees only key 0: its output is value 0.
    page = x.block_table[2, 0]
    np.testing.assert_allclose(x.ref[6, :, :], np.repeat(x.v_pages[page, 0], case.group, axis=0))


@needs_emulator
@pytest.mark.parametrize("family_name,case", FAMILY_CASES)
def test_paged_attention_matches_numpy_under_all_schedules(
    family_name: str, case: PagedCase
) -> None:
    assert len(DEFAULT_SCHEDULES) >= 4
    family = FAMILIES[family_name]
    got = run_case(compile_metal(family.path), family, case)
    tol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(got, inputs(case).ref, atol=tol, rtol=tol)


# -------------------------------------------------------------------- lint


@pytest.mark.parametrize(  # pure Python: runs on a Mac too
    "path", sorted(METAL_DIR.glob("*.metal")), ids=lambda p: str(p.relative_to(REPO))
)
def test_lint_passes(path: Path) -> None:
    assert lint_metal(path) == []


# ------------------------------------------------------------ planted bugs
#
# Each mutant is the real file with one replacement. To keep the compiles short, the
# mutant keeps only the host_name instantiations the test launches (they sit at the end
# of the file, so the kernel's line numbers are unchanged).

VECTOR = FAMILIES["vector"]
DISPATCH = FAMILIES["dispatch"]
INSTANTIATION = re.compile(r'template \[\[host_name\("([^"]+)"\)\]\] \[\[kernel\]\]\n[^\n]*;\n')


def mutated(old: str, new: str, family: KernelFamily, cases: list[PagedCase]) -> MetalLibrary:
    """``family``'s file with exactly one occurrence of ``old`` replaced by ``new``,
    compiled with the instantiations that ``cases`` need."""
    text = family.path.read_text()
    assert text.count(old) == 1, f"mutation anchor not unique in {family.path.name}: {old!r}"
    keep = {family.host_name(c) for c in cases}
    text = INSTANTIATION.sub(lambda m: m[0] if m[1] in keep else "", text.replace(old, new))
    assert set(INSTANTIATION.findall(text)) == keep, "missing instantiations"
    return compile_metal(family.path, source=text)


def line_of(needle: str, nth: int = 0, path: Path = PAGED) -> int:
    """1-based line of the ``nth`` line of ``path`` containing ``needle``."""
    return [i + 1 for i, s in enumerate(path.read_text().splitlines()) if needle in s][nth]


def cases(*names: str) -> list[PagedCase]:
    return [CASE_BY_NAME[n] for n in names]


# The vector schedule (paged_attention_impl), through the decode-only kernel.

MERGE_BARRIER = "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  float factor[GROUP];"
ROUND_BARRIER = "    threadgroup_barrier(mem_flags::mem_threadgroup);\n  }\n  if (sg == 0) {"
IDLE_RETURN = "  for (int j = int(sg); j < num_pages; j += kSimdgroups) {"


@needs_emulator
def test_mutation_missing_barrier_before_merge() -> None:
    # Without it, a thread reads tg_m/tg_l slots that other simdgroups' lane 0 has not
    # written yet: NaN poison under round-robin, and different bits per schedule.
    (case,) = cases("ragged_decode_f32_gqa3")
    lib = mutated(MERGE_BARRIER, "  float factor[GROUP];", VECTOR, [case])
    forward = run_case(lib, VECTOR, case, "forward")
    assert np.isnan(forward).any() and not close_to_ref(forward, case)
    with pytest.raises(ScheduleMismatch, match="buffer 'out' differs"):
        run_case(lib, VECTOR, case)


@needs_emulator
def test_mutation_page_boundary_off_by_one_reads_nan_slot() -> None:
    # One key past the context when it is not a multiple of the page size: that slot
    # is NaN garbage (or a future key of a multi-query row), so the output is NaN.
    chosen = cases("ragged_decode_f32_gqa3", "mixed_prefill_f32_gqa8", "ragged_f16_mha")
    lib = mutated(
        "min(page_size, num_keys - j * page_size)",
        "min(page_size, num_keys - j * page_size + 1)",
        VECTOR,
        chosen,
    )
    for case in chosen:
        got = run_case(lib, VECTOR, case)  # deterministic: same bits under all schedules
        assert np.isnan(got).any() and not close_to_ref(got, case), case


@needs_emulator
def test_mutation_block_table_next_entry_reads_before_k_pages() -> None:
    # The last page of each row becomes the table's -1: page -1 reads k_pages before
    # its start, and the emulator names the buffer and the faulting line.
    (case,) = cases("ragged_decode_f32_gqa3")
    lib = mutated(
        "block_table[b * max_pages + j]", "block_table[b * max_pages + j + 1]", VECTOR, [case]
    )
    with pytest.raises(OutOfBoundsError) as err:
        # guard="start": any read before the start faults, whatever the pool's size
        # (by default a small underflow may land in NaN-poisoned slack instead).
        run_case(lib, VECTOR, case, "forward", guard="start")
    msg = str(err.value)
    assert "read of buffer(1) 'k_pages'" in msg and "before its start" in msg
    assert f"paged_attention.metal:{line_of('kr[i] = d < HEAD_DIM')}" in msg


@needs_emulator
def test_mutation_block_table_next_row_reads_past_the_table() -> None:
    # The next sequence's row: wrong (valid) pages for all but the last sequence, whose
    # lookup runs past the end of block_table.
    (case,) = cases("ragged_decode_f32_gqa3")
    lib = mutated(
        "block_table[b * max_pages + j]", "block_table[(b + 1) * max_pages + j]", VECTOR, [case]
    )
    with pytest.raises(OutOfBoundsError) as err:
        run_case(lib, VECTOR, case, "forward")
    msg = str(err.value)
    assert "read of buffer(3) 'block_table'" in msg and "past its end" in msg
    assert (
        f"paged_attention.metal:{line_of('const int page = block_table[b * max_pages + j]')}" in msg
    )


@needs_emulator
def test_mutation_early_return_of_idle_simdgroup_is_a_barrier_error() -> None:
    # A simdgroup that owns no page returns before the merge barrier.
    (case,) = cases("ragged_f32_mha")  # 1-7 pages per row: idle simdgroups everywhere
    lib = mutated(
        IDLE_RETURN, "  if (int(sg) >= num_pages) return;\n" + IDLE_RETURN, VECTOR, [case]
    )
    barrier_line = line_of("threadgroup_barrier") + 1  # one line was inserted above it
    for schedule in DEFAULT_SCHEDULES[:4]:
        with pytest.raises(BarrierError) as err:
            run_case(lib, VECTOR, case, schedule)
        assert f"paged_attention.metal:{barrier_line}" in str(err.value), schedule
        assert "returned" in str(err.value), schedule


@needs_emulator
def test_mutation_missing_barrier_in_merge_rounds() -> None:
    # No synchronisation point is left after the merge barrier, so each thread runs to
    # the end in one go: simdgroup 0 writes round 0 (which ignores tg_acc) and reads
    # back only its own lanes' values. Every schedule gives the same bits, so only the
    # reference catches it: rows whose context spans several simdgroups' pages come out
    # as simdgroup 0's share; single-page rows (simdgroup 0 only) stay right.
    (case,) = cases("ragged_decode_f32_gqa3")  # page 8; contexts 1, 7, 8 | 9, 61
    lib = mutated(ROUND_BARRIER, "  }\n  if (sg == 0) {", VECTOR, [case])
    got = run_case(lib, VECTOR, case)  # bit-identical under all schedules
    tol = TOLERANCE[case.dtype]
    ref = inputs(case).ref
    np.testing.assert_allclose(got[:3], ref[:3], atol=tol, rtol=tol)
    assert np.isfinite(got).all()
    for row in (3, 4):
        assert not np.allclose(got[row], ref[row], atol=1e-3), row


@needs_emulator
def test_mutation_page_stride_is_caught_only_past_eight_pages() -> None:
    # Simdgroup s must walk pages s, s + 8, ...: a wrong stride only skips pages when a
    # context has more pages than there are simdgroups.
    chosen = cases("ragged_decode_f32_gqa3", "mixed_prefill_f32_gqa8", "many_pages_f32_gqa4")
    lib = mutated("j += kSimdgroups) {", "j += kSimdgroups + 1) {", VECTOR, chosen)
    for case in chosen[:2]:  # at most 8 pages
        assert close_to_ref(run_case(lib, VECTOR, case), case), case
    case = chosen[2]  # 13 pages
    got = run_case(lib, VECTOR, case)
    assert np.isfinite(got).all() and not close_to_ref(got, case)


@needs_emulator
def test_mutation_no_causal_offset_is_caught_only_by_multi_query_rows() -> None:
    # Every row sees the whole context: the keys past a row's position are valid data,
    # so only the values of multi-query rows (L > 1) are wrong.
    decode, case = cases("ragged_decode_f32_gqa3", "mixed_prefill_f32_gqa8")
    lib = mutated("(int(row) - query_start_loc[b])", "(query_len - 1)", VECTOR, [decode, case])
    assert close_to_ref(run_case(lib, VECTOR, decode), decode)  # L == 1 everywhere
    got = run_case(lib, VECTOR, case)
    assert np.isfinite(got).all() and not close_to_ref(got, case)
    single = inputs(case).query_start_loc[1]  # the row of the 1-token sequence
    np.testing.assert_allclose(got[single], inputs(case).ref[single], atol=2e-5)


@needs_emulator
def test_mutation_sequence_lookup_boundary() -> None:
    # `<` instead of `<=`: the first row of each later sequence is attributed to the
    # previous sequence.
    (case,) = cases("mixed_f16_gqa4")
    old = "query_start_loc[b + 1] <= int(row)"
    lib = mutated(old, old.replace("<=", "<"), VECTOR, [case])
    assert not close_to_ref(run_case(lib, VECTOR, case), case)


@needs_emulator
def test_mutation_gqa_head_mapping() -> None:
    # Interleaved instead of grouped heads: query head h must read KV head h // GROUP.
    (case,) = cases("mixed_f16_gqa4")  # GROUP 4 with 2 KV heads
    old = "const int head = int(kv_head) * GROUP + g;\n    for (int i = 0; i < PER_LANE; ++i) {"
    new = old.replace("int(kv_head) * GROUP + g", "int(kv_head) + g * n_kv_heads")
    lib = mutated(old, new, VECTOR, [case])  # the q load (the output loop is indented deeper)
    assert not close_to_ref(run_case(lib, VECTOR, case), case)


@needs_emulator
def test_mutation_merge_without_rescale() -> None:
    # Simdgroups' partial outputs added without exp(m_s - global_m).
    (case,) = cases("many_pages_f32_gqa4")
    lib = mutated("factor[g] = exp(m[g] - global_m);", "factor[g] = 1.0f;", VECTOR, [case])
    got = run_case(lib, VECTOR, case)
    assert np.isfinite(got).all() and not close_to_ref(got, case)


@needs_emulator
def test_mutation_merge_reads_uninitialised_accumulator() -> None:
    # Round 0 adds to tg_acc instead of overwriting it: threadgroup memory starts as
    # NaN poison in the emulator (garbage on a GPU).
    (case,) = cases("ragged_f16_mha")
    lib = mutated(
        "s == 0 ? 0.0f : tg_acc[g * HEAD_DIM + d]", "tg_acc[g * HEAD_DIM + d]", VECTOR, [case]
    )
    assert np.isnan(run_case(lib, VECTOR, case)).all()


# The tiled (FlashAttention) schedule (paged_flash_impl), through the op's kernel.

MULTI_QUERY = ("mixed_prefill_f32_gqa8", "prefill_f32_gqa3", "mixed_f16_gqa4")


@needs_emulator
def test_mutation_tiled_missing_loop_end_barrier_is_seen_only_under_run_ahead() -> None:
    # A fast simdgroup stages the next key tile while others still read this one.
    chosen = cases(*MULTI_QUERY)
    lib = mutated(
        "    // Everyone is done with this key tile before the next one overwrites it.\n"
        "    threadgroup_barrier(mem_flags::mem_threadgroup);\n",
        "",
        DISPATCH,
        chosen,
    )
    for case in chosen:
        lockstep = run_schedules(
            lib, DISPATCH.host_name(case), DISPATCH.buffers(case, inputs(case)),
            schedules=("forward", "reverse"), **DISPATCH.launch(case),
        )["out"].astype(np.float64)  # fmt: skip
        assert close_to_ref(lockstep, case), case
        for schedule in ("run_ahead", "run_ahead_shuffled:1"):
            assert not close_to_ref(run_case(lib, DISPATCH, case, schedule), case), case


@needs_emulator
def test_mutation_tiled_missing_staging_barrier() -> None:
    # Simdgroups multiply a key tile before the whole threadgroup has staged it: they
    # read the NaN poison of fresh threadgroup memory.
    chosen = cases(*MULTI_QUERY)
    lib = mutated(
        "    threadgroup_barrier(mem_flags::mem_threadgroup);\n\n"
        "    simdgroup_matrix<float, 8, 8> s =",
        "\n    simdgroup_matrix<float, 8, 8> s =",
        DISPATCH,
        chosen,
    )
    for case in chosen:
        for schedule in DEFAULT_SCHEDULES[:4]:
            assert np.isnan(run_case(lib, DISPATCH, case, schedule)).any(), (case, schedule)


@needs_emulator
def test_mutation_tiled_staging_past_the_context_reads_nan_garbage() -> None:
    # Keys past the last row's position must be staged as zeros, not loaded: masking
    # their scores is not enough, because P (0) times V (NaN garbage) is NaN.
    chosen = cases(*MULTI_QUERY)
    lib = mutated(
        "const bool in_range = key0 + t < num_keys;", "const bool in_range = true;",
        DISPATCH, chosen,
    )  # fmt: skip
    for case in chosen:
        assert np.isnan(run_case(lib, DISPATCH, case)).any(), case


@needs_emulator
def test_mutation_tiled_causal_mask_off_by_one() -> None:
    # `<` instead of `<=` when computing P: every row loses its own key.
    chosen = cases(*MULTI_QUERY)
    old = "const bool visible = my_valid && key0 + j <= my_pos;\n        const float p"
    lib = mutated(old, old.replace("<=", "<"), DISPATCH, chosen)
    for case in chosen:
        assert not close_to_ref(run_case(lib, DISPATCH, case), case), case


@needs_emulator
def test_mutation_tiled_query_rows_past_the_tile_read_past_q() -> None:
    # Rows past the sequence's last query must not be loaded: for the batch's last
    # sequence they lie past the end of q.
    (case,) = cases("mixed_f16_gqa4")
    lib = mutated("my_scratch[e] = row < tile_rows\n", "my_scratch[e] = true\n", DISPATCH, [case])
    with pytest.raises(OutOfBoundsError) as err:
        run_case(lib, DISPATCH, case, "forward")
    msg = str(err.value)
    assert "read of buffer(0) 'q'" in msg and "past its end" in msg
    assert f"paged_attention.metal:{line_of('? float(q[(flat * n_heads + head)')}" in msg


# ---------------------------------------------------------------- GPU (Mac)


def _metal_available() -> bool:
    try:
        import tiny_llm  # noqa: F401  (before mlx: it sets up MLX's CPU BLAS)

        import mlx.core as mx

        return bool(mx.metal.is_available())
    except Exception:
        return False


@pytest.mark.skipif(not _metal_available(), reason="needs an Apple GPU (mx.metal)")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_extension_on_gpu_matches_numpy(case: PagedCase) -> None:
    from tiny_llm.day4_paged_attention import paged_attention

    import mlx.core as mx

    x = inputs(case)
    dtype = {"float": mx.float32, "half": mx.float16}[case.dtype]
    with mx.stream(mx.gpu):
        out = paged_attention(
            mx.array(x.q, dtype=dtype),
            mx.array(x.k_pages, dtype=dtype),
            mx.array(x.v_pages, dtype=dtype),
            mx.array(x.block_table),
            mx.array(x.context_lens),
            mx.array(x.query_start_loc),
            x.scale,
        )
        got = np.array(out.astype(mx.float32)).astype(np.float64)
    tol = {"float": 1e-4, "half": 4e-3}[case.dtype]  # Metal is fast-math
    np.testing.assert_allclose(got, x.ref, atol=tol, rtol=tol)
