"""The project's Metal kernels, launched exactly as the extension launches them on a Mac.

On an Apple GPU, the op (``src/extensions/metal_launch.cpp``) computes a launch plan — the
arguments of ``mx.fast.metal_kernel`` (kernel body, header, input and output names) and of
its call (padded metadata, packed params, template arguments, grid, threadgroup) — and
hands it to MLX's JIT. ``metal_launch_plan`` returns that same plan on any machine. Here
``tools/metal_emulator/mlx_jit.py`` rebuilds the ``[[kernel]]`` source MLX would generate
from it and runs it under the CPU Metal emulator, under several thread schedules whose
outputs must be bit-identical and close to a float64 numpy reference. On a Mac with a GPU
the same cases also run through the real op, and the default model end to end.

Groups:

* ragged cases (context lengths 1, page-1, page, page+1 and many pages; shuffled pages;
  GQA 1/3/4/5/8 and the default model's 9/3 heads; multi-query rows with a causal
  offset mixed with single-query rows; NaN garbage in every slot and page nobody may
  read; float and half), through both plans: ``tiled=False`` (Day 4, the vector schedule
  for every row) and ``tiled=True`` (Day 5, vector rows + tiled multi-token queries);
* the geometry rule, one for host and kernel (``check_metal_geometry``);
* the MSL-subset lint on every .metal file and on the generated kernel sources;
* planted bugs in the kernel source (one-line mutations of the plan's header), and in
  the host side (the plan's grid, params, padding, template arguments, threadgroup), each
  caught in the way expected;
* the same cases on the GPU, and a GPU end-to-end run (skipped where Metal is missing).
"""

from __future__ import annotations

import os
import shutil
import sys
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
    MetalCompileError,
    OutOfBoundsError,
    ScheduleMismatch,
    kernel_source,
    lint_metal,
    lint_source,
    run_plan,
)

METAL_DIR = REPO / "src" / "extensions" / "metal"
PAGED = METAL_DIR / "paged_attention.metal"
GEOMETRY = METAL_DIR / "paged_attention_geometry.h"

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
    # The default model (SmolLM2-135M): 9 query heads over 3 KV heads, head_dim 64, the
    # engine's page size; decodes and prefill chunks in one batch.
    PagedCase("smollm2_f32_9q3kv", "float", 64, 3, 3, 16,
              ((17, 1), (40, 23), (5, 1), (16, 16), (33, 1)), seed=7),
    PagedCase("smollm2_f16_9q3kv", "half", 64, 3, 3, 16, ((70, 1), (24, 24), (9, 2)), seed=8),
    # A group that does not divide the 64 pairs of a tile: 12 rows of 5 heads, 4 pairs idle.
    PagedCase("gqa5_f32", "float", 64, 5, 2, 8, ((30, 13), (8, 1), (12, 12)), seed=9),
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



# ------------------------------------------------------------- launch plans

PLANS = {"vector": False, "flash": True}  # plan name -> the op's `tiled` argument


def extension():
    import tiny_llm  # noqa: F401  (before mlx: it sets up MLX's CPU BLAS)
    from tiny_llm.extension import extension as load

    return load()


def mx_inputs(case: PagedCase) -> list:
    import mlx.core as mx

    x = inputs(case)
    return [mx.array(a) for a in (x.q, x.k_pages, x.v_pages, x.block_table, x.context_lens,
                                  x.query_start_loc)]  # fmt: skip


def plan_for(case: PagedCase, plan: str) -> dict[str, Any]:
    """The launch the extension would hand to MLX's JIT for this case."""
    return extension().metal_launch_plan(*mx_inputs(case), inputs(case).scale, tiled=PLANS[plan])


_inputs_cache: dict[str, PagedInputs] = {}


def inputs(case: PagedCase) -> PagedInputs:
    if case.name not in _inputs_cache:
        _inputs_cache[case.name] = make_inputs(case)
    return _inputs_cache[case.name]


def run_case(
    case: PagedCase, plan: str | dict[str, Any], schedule: str | None = None, **launch: Any
) -> np.ndarray:
    """Output of ``case`` (float64) under one schedule, or all DEFAULT_SCHEDULES
    bit-identical; ``plan`` is a plan name or a (mutated) plan."""
    launch_plan = plan_for(case, plan) if isinstance(plan, str) else plan
    schedules = DEFAULT_SCHEDULES if schedule is None else (schedule,)
    out = run_plan(launch_plan, PAGED, schedules=schedules, **launch)
    return out["out"].astype(np.float64)


def close_to_ref(got: np.ndarray, case: PagedCase) -> bool:
    tol = TOLERANCE[case.dtype]
    return bool(np.allclose(got, inputs(case).ref, atol=tol, rtol=tol))


PLAN_CASES = [pytest.param(p, c, id=f"{p}-{c.name}") for p in PLANS for c in CASES]


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
@pytest.mark.parametrize("plan,case", PLAN_CASES)
def test_production_launch_matches_numpy_under_all_schedules(plan: str, case: PagedCase) -> None:
    assert len(DEFAULT_SCHEDULES) >= 4
    got = run_case(case, plan)
    tol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(got, inputs(case).ref, atol=tol, rtol=tol)


def test_plan_is_the_source_tree_and_the_geometry() -> None:
    # The extension embeds the geometry header and the kernel file as they are on disk
    # (a stale build would test other code), and sizes the launch from the geometry.
    case = CASE_BY_NAME["smollm2_f32_9q3kv"]
    plan = plan_for(case, "flash")
    assert plan["header"] == (
        '#line 1 "paged_attention_geometry.h"\n' + GEOMETRY.read_text()
        + '#line 1 "paged_attention.metal"\n' + PAGED.read_text()
    )  # fmt: skip
    tile_rows = 64 // case.group  # kTilePairs // group
    tiles = -(-case.num_rows // tile_rows)
    assert plan["grid"] == (256 * (case.num_rows + len(case.seqs) * tiles), case.n_kv_heads, 1)
    assert plan["threadgroup"] == (256, 1, 1)
    assert [n for n, _ in plan["template_args"]] == ["T", "HEAD_DIM", "GROUP"]
    assert [v for _, v in plan["template_args"]][1:] == [case.head_dim, case.group]
    assert all(a.size >= 8 for a in plan["inputs"])  # nothing lands in `constant` memory
    vector = plan_for(case, "vector")
    assert vector["grid"] == (256 * case.num_rows, case.n_kv_heads, 1)


# --------------------------------------------------------- geometry rule


def test_default_model_geometry_is_accepted() -> None:
    # SmolLM2-135M: 9 query heads over 3 KV heads at head_dim 64. An earlier host check
    # demanded that the group divide 64 and rejected it before the first token.
    import mlx.core as mx

    ext = extension()
    for group in (1, 2, 3, 5, 7, 8, 16, 64):
        ext.check_metal_geometry(3 * group, 3, 64, 16, mx.float32)
    ext.check_metal_geometry(32, 8, 128, 16, mx.float16)  # Qwen3-0.6B / 4B-style


@pytest.mark.parametrize(
    "args,why",
    [
        ((65, 1, 64, 16), "at most 64 query heads"),
        ((8, 1, 60, 16), "head_dim must be a multiple of 8"),
        ((8, 1, 512, 16), "head_dim must be a multiple of 8 in"),
        ((8, 2, 64, 12), "page_size must be a multiple of 8"),
        ((64, 1, 256, 16), "bytes of threadgroup memory"),
        ((9, 2, 64, 16), "positive multiple of the KV heads"),
    ],
)
def test_unsupported_geometry_is_refused_naming_the_model(args, why) -> None:
    import mlx.core as mx

    n_heads, n_kv_heads, head_dim, page_size = args
    with pytest.raises(ValueError, match=why) as err:
        extension().check_metal_geometry(n_heads, n_kv_heads, head_dim, page_size, mx.float32)
    msg = str(err.value)
    assert f"{n_heads} query heads over {n_kv_heads} KV heads" in msg
    assert f"head_dim {head_dim}" in msg and f"page_size {page_size}" in msg and "float32" in msg


# -------------------------------------------------------------------- lint


@pytest.mark.parametrize(  # pure Python: runs on a Mac too
    "path", sorted(METAL_DIR.glob("*.metal")), ids=lambda p: str(p.relative_to(REPO))
)
def test_lint_passes(path: Path) -> None:
    assert lint_metal(path) == []


@pytest.mark.parametrize("plan", PLANS)
def test_lint_passes_on_the_generated_kernels(plan: str) -> None:
    _, text = kernel_source(plan_for(CASE_BY_NAME["smollm2_f16_9q3kv"], plan))
    assert lint_source(text, "generated.metal") == []


# ------------------------------------------------------- planted kernel bugs
#
# Each mutant is the plan's header (the kernel file as MLX compiles it) with one
# replacement; `#line` in the header keeps reported lines those of paged_attention.metal.

def mutated(old: str, new: str, plan: str):
    """``plan`` for a case, with exactly one occurrence of ``old`` in the kernel source
    replaced by ``new``."""

    def mutant(case: PagedCase) -> dict[str, Any]:
        launch = plan_for(case, plan)
        header = launch["header"]
        assert header.count(old) == 1, f"mutation anchor not unique: {old!r}"
        return {**launch, "header": header.replace(old, new)}

    return mutant


def line_of(needle: str, nth: int = 0, path: Path = PAGED) -> int:
    """1-based line of the ``nth`` line of ``path`` containing ``needle``."""
    return [i + 1 for i, s in enumerate(path.read_text().splitlines()) if needle in s][nth]


def cases(*names: str) -> list[PagedCase]:
    return [CASE_BY_NAME[n] for n in names]


# The vector schedule (paged_attention_impl), through Day 4's plan.

MERGE_BARRIER = "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  float factor[GROUP];"
ROUND_BARRIER = "    threadgroup_barrier(mem_flags::mem_threadgroup);\n  }\n  if (sg == 0) {"
IDLE_RETURN = "  for (int j = int(sg); j < num_pages; j += kSimdgroups) {"


@needs_emulator
def test_mutation_missing_barrier_before_merge() -> None:
    # Without it, a thread reads tg_m/tg_l slots that other simdgroups' lane 0 has not
    # written yet: NaN poison under round-robin, and different bits per schedule.
    (case,) = cases("ragged_decode_f32_gqa3")
    mutant = mutated(MERGE_BARRIER, "  float factor[GROUP];", "vector")
    forward = run_case(case, mutant(case), "forward")
    assert np.isnan(forward).any() and not close_to_ref(forward, case)
    with pytest.raises(ScheduleMismatch, match="buffer 'out' differs"):
        run_case(case, mutant(case))


@needs_emulator
def test_mutation_page_boundary_off_by_one_reads_nan_slot() -> None:
    # One key past the context when it is not a multiple of the page size: that slot
    # is NaN garbage (or a future key of a multi-query row), so the output is NaN.
    chosen = cases("ragged_decode_f32_gqa3", "mixed_prefill_f32_gqa8", "ragged_f16_mha")
    mutant = mutated(
        "min(page_size, num_keys - j * page_size)",
        "min(page_size, num_keys - j * page_size + 1)",
        "vector",
    )
    for case in chosen:
        got = run_case(case, mutant(case))  # deterministic: same bits under all schedules
        assert np.isnan(got).any() and not close_to_ref(got, case), case


@needs_emulator
def test_mutation_block_table_next_entry_reads_before_k_pages() -> None:
    # The last page of each row becomes the table's -1: page -1 reads k_pages before
    # its start, and the emulator names the buffer and the faulting line.
    (case,) = cases("ragged_decode_f32_gqa3")
    mutant = mutated(
        "block_table[b * max_pages + j]", "block_table[b * max_pages + j + 1]", "vector")
    with pytest.raises(OutOfBoundsError) as err:
        # guard="start": any read before the start faults, whatever the pool's size
        # (by default a small underflow may land in NaN-poisoned slack instead).
        run_case(case, mutant(case), "forward", guard="start")
    msg = str(err.value)
    assert "read of buffer(1) 'k_pages'" in msg and "before its start" in msg
    assert f"paged_attention.metal:{line_of('kr[i] = d < HEAD_DIM')}" in msg


@needs_emulator
def test_mutation_block_table_next_row_reads_past_the_table() -> None:
    # The next sequence's row: wrong (valid) pages for all but the last sequence, whose
    # lookup runs past the end of block_table.
    (case,) = cases("ragged_decode_f32_gqa3")
    mutant = mutated(
        "block_table[b * max_pages + j]", "block_table[(b + 1) * max_pages + j]", "vector")
    with pytest.raises(OutOfBoundsError) as err:
        run_case(case, mutant(case), "forward")
    msg = str(err.value)
    assert "read of buffer(3) 'block_table'" in msg and "past its end" in msg
    assert (
        f"paged_attention.metal:{line_of('const int page = block_table[b * max_pages + j]')}" in msg
    )


@needs_emulator
def test_mutation_early_return_of_idle_simdgroup_is_a_barrier_error() -> None:
    # A simdgroup that owns no page returns before the merge barrier.
    (case,) = cases("ragged_f32_mha")  # 1-7 pages per row: idle simdgroups everywhere
    mutant = mutated(
        IDLE_RETURN, "  if (int(sg) >= num_pages) return;\n" + IDLE_RETURN, "vector")
    barrier_line = line_of("threadgroup_barrier") + 1  # one line was inserted above it
    for schedule in DEFAULT_SCHEDULES[:4]:
        with pytest.raises(BarrierError) as err:
            run_case(case, mutant(case), schedule)
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
    mutant = mutated(ROUND_BARRIER, "  }\n  if (sg == 0) {", "vector")
    got = run_case(case, mutant(case))  # bit-identical under all schedules
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
    mutant = mutated("j += kSimdgroups) {", "j += kSimdgroups + 1) {", "vector")
    for case in chosen[:2]:  # at most 8 pages
        assert close_to_ref(run_case(case, mutant(case)), case), case
    case = chosen[2]  # 13 pages
    got = run_case(case, mutant(case))
    assert np.isfinite(got).all() and not close_to_ref(got, case)


@needs_emulator
def test_mutation_no_causal_offset_is_caught_only_by_multi_query_rows() -> None:
    # Every row sees the whole context: the keys past a row's position are valid data,
    # so only the values of multi-query rows (L > 1) are wrong.
    decode, case = cases("ragged_decode_f32_gqa3", "mixed_prefill_f32_gqa8")
    mutant = mutated("(int(row) - query_start_loc[b])", "(query_len - 1)", "vector")
    assert close_to_ref(run_case(decode, mutant(decode)), decode)  # L == 1 everywhere
    got = run_case(case, mutant(case))
    assert np.isfinite(got).all() and not close_to_ref(got, case)
    single = inputs(case).query_start_loc[1]  # the row of the 1-token sequence
    np.testing.assert_allclose(got[single], inputs(case).ref[single], atol=2e-5)


@needs_emulator
def test_mutation_sequence_lookup_boundary() -> None:
    # `<` instead of `<=`: the first row of each later sequence is attributed to the
    # previous sequence.
    (case,) = cases("mixed_f16_gqa4")
    old = "query_start_loc[b + 1] <= int(row)"
    mutant = mutated(old, old.replace("<=", "<"), "vector")
    assert not close_to_ref(run_case(case, mutant(case)), case)


@needs_emulator
def test_mutation_gqa_head_mapping() -> None:
    # Interleaved instead of grouped heads: query head h must read KV head h // GROUP.
    (case,) = cases("mixed_f16_gqa4")  # GROUP 4 with 2 KV heads
    old = "const int head = int(kv_head) * GROUP + g;\n    for (int i = 0; i < PER_LANE; ++i) {"
    new = old.replace("int(kv_head) * GROUP + g", "int(kv_head) + g * n_kv_heads")
    mutant = mutated(old, new, "vector")  # the q load (the output loop is indented deeper)
    assert not close_to_ref(run_case(case, mutant(case)), case)


@needs_emulator
def test_mutation_merge_without_rescale() -> None:
    # Simdgroups' partial outputs added without exp(m_s - global_m).
    (case,) = cases("many_pages_f32_gqa4")
    mutant = mutated("factor[g] = exp(m[g] - global_m);", "factor[g] = 1.0f;", "vector")
    got = run_case(case, mutant(case))
    assert np.isfinite(got).all() and not close_to_ref(got, case)


@needs_emulator
def test_mutation_merge_reads_uninitialised_accumulator() -> None:
    # Round 0 adds to tg_acc instead of overwriting it: threadgroup memory starts as
    # NaN poison in the emulator (garbage on a GPU).
    (case,) = cases("ragged_f16_mha")
    mutant = mutated(
        "s == 0 ? 0.0f : tg_acc[g * HEAD_DIM + d]", "tg_acc[g * HEAD_DIM + d]", "vector")
    assert np.isnan(run_case(case, mutant(case))).all()


# The tiled (FlashAttention) schedule (paged_flash_impl), through Day 5's plan.

MULTI_QUERY = ("mixed_prefill_f32_gqa8", "prefill_f32_gqa3", "mixed_f16_gqa4")


@needs_emulator
def test_mutation_tiled_missing_loop_end_barrier_is_seen_only_under_run_ahead() -> None:
    # A fast simdgroup stages the next key tile while others still read this one.
    chosen = cases(*MULTI_QUERY)
    mutant = mutated(
        "    // Everyone is done with this key tile before the next one overwrites it.\n"
        "    threadgroup_barrier(mem_flags::mem_threadgroup);\n",
        "", "flash")
    for case in chosen:
        lockstep = run_plan(mutant(case), PAGED, schedules=("forward", "reverse"))
        lockstep = lockstep["out"].astype(np.float64)
        assert close_to_ref(lockstep, case), case
        for schedule in ("run_ahead", "run_ahead_shuffled:1"):
            assert not close_to_ref(run_case(case, mutant(case), schedule), case), case


@needs_emulator
def test_mutation_tiled_missing_staging_barrier() -> None:
    # Simdgroups multiply a key tile before the whole threadgroup has staged it: they
    # read the NaN poison of fresh threadgroup memory.
    chosen = cases(*MULTI_QUERY)
    mutant = mutated(
        "    threadgroup_barrier(mem_flags::mem_threadgroup);\n\n"
        "    simdgroup_matrix<float, 8, 8> s =",
        "\n    simdgroup_matrix<float, 8, 8> s =", "flash")
    for case in chosen:
        for schedule in DEFAULT_SCHEDULES[:4]:
            assert np.isnan(run_case(case, mutant(case), schedule)).any(), (case, schedule)


@needs_emulator
def test_mutation_tiled_staging_past_the_context_reads_nan_garbage() -> None:
    # Keys past the last row's position must be staged as zeros, not loaded: masking
    # their scores is not enough, because P (0) times V (NaN garbage) is NaN.
    chosen = cases(*MULTI_QUERY)
    mutant = mutated(
        "const bool in_range = key0 + t < num_keys;", "const bool in_range = true;", "flash"
    )
    for case in chosen:
        assert np.isnan(run_case(case, mutant(case))).any(), case


@needs_emulator
def test_mutation_tiled_causal_mask_off_by_one() -> None:
    # `<` instead of `<=` when computing P: every row loses its own key.
    chosen = cases(*MULTI_QUERY)
    old = "const bool visible = my_valid && key0 + j <= my_pos;\n        const float p"
    mutant = mutated(old, old.replace("<=", "<"), "flash")
    for case in chosen:
        assert not close_to_ref(run_case(case, mutant(case)), case), case


@needs_emulator
def test_mutation_tiled_query_rows_past_the_tile_read_past_q() -> None:
    # Rows past the sequence's last query must not be loaded: for the batch's last
    # sequence they lie past the end of q.
    (case,) = cases("mixed_f16_gqa4")
    mutant = mutated("my_scratch[e] = row < rows_in_tile\n", "my_scratch[e] = true\n", "flash")
    with pytest.raises(OutOfBoundsError) as err:
        run_case(case, mutant(case), "forward")
    msg = str(err.value)
    assert "read of buffer(0) 'q'" in msg and "past its end" in msg
    assert f"paged_attention.metal:{line_of('? float(q[(flat * n_heads + head)')}" in msg



# --------------------------------------------------------- planted host bugs
#
# What a bug in the launcher (metal_launch.cpp) would hand to MLX: the plan, edited.


def edited(case: PagedCase, plan: str, **changes: Any) -> dict[str, Any]:
    return {**plan_for(case, plan), **changes}


@needs_emulator
def test_host_grid_one_row_short_leaves_a_row_unwritten() -> None:
    # The last query row's threadgroups never run: that row keeps the output's
    # uninitialised (NaN) contents.
    case = CASE_BY_NAME["smollm2_f32_9q3kv"]
    launch = plan_for(case, "vector")
    x, y, z = launch["grid"]
    got = run_case(case, {**launch, "grid": (x - 256, y, z)}, "forward")
    assert np.isnan(got[-1]).all() and not np.isnan(got[:-1]).any()


@needs_emulator
def test_host_grid_without_tile_threadgroups_leaves_prefill_rows_unwritten() -> None:
    case = CASE_BY_NAME["smollm2_f32_9q3kv"]
    launch = plan_for(case, "flash")
    got = run_case(case, {**launch, "grid": (256 * case.num_rows, case.n_kv_heads, 1)}, "forward")
    multi = np.repeat([q > 1 for _, q in case.seqs], [q for _, q in case.seqs])
    assert np.isnan(got[multi]).all() and not np.isnan(got[~multi]).any()


@needs_emulator
def test_host_grid_sized_with_another_tile_height_is_caught() -> None:
    # The host sizing tiles of 64 // 4 rows while the kernel (group 5) uses 64 // 5:
    # too few tile threadgroups, so the last sequence's tiles never run.
    case = CASE_BY_NAME["gqa5_f32"]
    launch = plan_for(case, "flash")
    tiles = -(-case.num_rows // (64 // 4))
    grid = (256 * (case.num_rows + len(case.seqs) * tiles), case.n_kv_heads, 1)
    assert grid[0] < launch["grid"][0]
    got = run_case(case, {**launch, "grid": grid}, "forward")
    last = case.seqs[-1][1]
    tol = TOLERANCE[case.dtype]
    assert np.isnan(got[-last:]).all()
    np.testing.assert_allclose(got[:-last], inputs(case).ref[:-last], atol=tol, rtol=tol)


@needs_emulator
@pytest.mark.parametrize(
    "swap", [(2, 3), (1, 4)], ids=["n_heads-n_kv_heads", "max_pages-page_size"]
)
def test_host_params_packed_in_the_wrong_order(swap: tuple[int, int]) -> None:
    import mlx.core as mx

    case = CASE_BY_NAME["smollm2_f32_9q3kv"]
    launch = plan_for(case, "flash")
    params = np.array(launch["inputs"][6])
    i, j = swap
    params[[i, j]] = params[[j, i]]
    inputs_ = [*launch["inputs"][:6], mx.array(params)]
    try:
        got = run_case(case, {**launch, "inputs": inputs_}, "forward")
    except OutOfBoundsError:
        return  # reading the wrong rows ran off a buffer: caught
    assert not close_to_ref(got, case)


@needs_emulator
def test_host_without_padding_does_not_compile() -> None:
    # MLX passes arrays of fewer than 8 elements in the `constant` address space; the
    # kernels take `device` pointers, which Metal (and the emulator) refuse to convert.

    case = CASE_BY_NAME["smollm2_f16_9q3kv"]  # 3 sequences: context_lens has 3 elements
    launch = plan_for(case, "flash")
    raw = mx_inputs(case)
    unpadded = [*launch["inputs"][:4], raw[4], raw[5], launch["inputs"][6]]
    assert unpadded[4].size < 8
    with pytest.raises(MetalCompileError, match="constant_ptr"):
        run_case(case, {**launch, "inputs": unpadded}, "forward")


@needs_emulator
def test_host_template_group_wrong() -> None:
    case = CASE_BY_NAME["smollm2_f32_9q3kv"]
    launch = plan_for(case, "flash")
    args = [(n, case.n_heads if n == "GROUP" else v) for n, v in launch["template_args"]]
    with pytest.raises((OutOfBoundsError, AssertionError)):
        got = run_case(case, {**launch, "template_args": args}, "forward")
        assert close_to_ref(got, case)


@needs_emulator
def test_host_threadgroup_of_four_simdgroups() -> None:
    # The kernels assume 8 simdgroups (pages s, s + 8, ...; 8 rows of pairs per tile):
    # with 4, half of each context and half of each tile are never computed.
    case = CASE_BY_NAME["smollm2_f32_9q3kv"]
    for plan in PLANS:
        try:
            got = run_case(case, edited(case, plan, threadgroup=(128, 1, 1)), "forward")
        except OutOfBoundsError:
            continue  # twice the threadgroups: the extra ones read rows past q
        assert np.isnan(got).any() or not close_to_ref(got, case), plan



# ---------------------------------------------------------------- GPU (Mac)


def _metal_available() -> bool:
    try:
        import tiny_llm  # noqa: F401  (before mlx: it sets up MLX's CPU BLAS)

        import mlx.core as mx

        return bool(mx.metal.is_available())
    except Exception:
        return False


needs_gpu = pytest.mark.skipif(not _metal_available(), reason="needs an Apple GPU (mx.metal)")


@needs_gpu
@pytest.mark.parametrize("plan,case", PLAN_CASES)
def test_extension_on_gpu_matches_numpy(plan: str, case: PagedCase) -> None:
    from tiny_llm.day4_paged_attention import paged_attention

    import mlx.core as mx

    x = inputs(case)
    dtype = {"float": mx.float32, "half": mx.float16}[case.dtype]
    q, k, v, table, ctx, qsl = mx_inputs(case)
    with mx.stream(mx.gpu):
        out = paged_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), table, ctx, qsl,
                              x.scale, tiled=PLANS[plan])  # fmt: skip
        got = np.array(out.astype(mx.float32)).astype(np.float64)
    tol = {"float": 1e-4, "half": 4e-3}[case.dtype]  # Metal's exp and sums round differently
    np.testing.assert_allclose(got, x.ref, atol=tol, rtol=tol)


@needs_gpu
def test_default_model_on_gpu_generates_the_cpu_tokens() -> None:
    # The default model, float32 weights, a batch of greedy requests: the GPU engine's
    # tokens equal the CPU engine's. (float32 everywhere keeps rounding far below the
    # gaps between the top logits of these prompts; a flip would show as a mismatch.)
    from tiny_llm import LLMEngine, SamplingParams
    from tiny_llm.loader import load

    import mlx.core as mx

    prompts = ["The capital of France is", "def fibonacci(n):", "Three colors are"]
    params = SamplingParams(temperature=0, max_tokens=12)
    tokens = {}
    for device in (mx.cpu, mx.gpu):
        with mx.stream(device):
            model, tokenizer = load(dtype=mx.float32, dequantize=True)
            engine = LLMEngine(model, tokenizer, max_model_len=256, num_pages=64)
            outs = engine.generate(prompts, params, use_tqdm=False)
            tokens[device] = [o.outputs[0].token_ids for o in outs]
    assert tokens[mx.gpu] == tokens[mx.cpu]
