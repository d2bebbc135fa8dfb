"""Day 4: attention that reads the pages in place.

Oracle: gather each sequence's rows out of the pool by address translation in numpy, then
run the dense ``causal_attention`` written in plain MLX ops (``tiny_llm.testing.paged``).
Both page walks — the extension's vector schedule and the MLX-op reference — must match
it, and the engine running either of them must produce the same greedy tokens as the
dense engine.

Every case fills what a walk must never read (unused slots of used pages, unused pages,
the page that a clamped -1 would name) with garbage: NaN or huge values. A walk that reads
one of them, or multiplies one by a zero probability, shows it in the output.
"""

import subprocess
import sys
import textwrap

from tiny_llm.day4_paged_attention import (
    check_metadata,
    paged_attention,
    paged_attention_reference,
    paged_kv_write,
)
from tiny_llm.engine import LLMEngine
from tiny_llm.kernels.device import plans_for_gpu
from tiny_llm.kernels.extension import extension
from tiny_llm.step.dense_kv import causal_attention
from tiny_llm.testing.backends import CheckedAttention
from tiny_llm.testing.paged import DTYPES, PagedCase, dense_reference, make_paged_case
from tiny_llm.testing.runs import greedy, run_staggered

import mlx.core as mx
import numpy as np
import pytest

# The oracle runs at float32 on the very values the pool stores (already rounded to the
# dtype), and both walks accumulate in float32: what remains is float32 summation order
# (float32 case) or the final rounding of the output to the dtype, half an ulp at most
# (float16: 2^-11 relative, bfloat16: 2^-8), with a margin.
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
WALKS = {"vector": paged_attention, "reference": paged_attention_reference}
# Each walk's course task: the MLX-op walk (4.1), the C++ vector schedule (4.2). The C++
# schedule is tested on the CPU on every machine (``cpu_device``, ``on_its_device``): on a
# Mac's GPU the op runs the Metal kernel instead, which tests/test_metal_kernels.py checks
# (Task 4.4).
ON_CPU = pytest.mark.usefixtures("cpu_device")
WALK_PARAMS = [pytest.param("reference", marks=pytest.mark.task("4.1")),
               pytest.param("vector", marks=pytest.mark.task("4.2"))]


def on_its_device(walk: str, request: pytest.FixtureRequest) -> None:
    if walk == "vector":
        request.getfixturevalue("cpu_device")


def make_case(seqs, *, dtype="float32", head_dim=64, page_size=16, group=1, n_kv_heads=2,
              garbage="nan", seed=0) -> PagedCase:
    return make_paged_case(seqs, dtype=dtype, head_dim=head_dim, page_size=page_size,
                           group=group, n_kv_heads=n_kv_heads, garbage=garbage, seed=seed)


def f32(a: mx.array) -> np.ndarray:
    # mx.eval first: an error raised inside a CPU kernel reaches Python through mx.eval, but
    # np.array() of the unevaluated array returns its uninitialised buffer (MLX 0.32).
    mx.eval(a)
    return np.array(a.astype(mx.float32))


dense_oracle = dense_reference


def standard_seqs(ps: int, long: bool = False):
    """Ragged contexts around page boundaries, decode rows (one query) and chunks (several
    queries, causal inside the chunk) in one call."""
    seqs = [
        (1, 1),  # the first token of a prompt: one key
        (ps + 1, 1),  # decode: one key into a new page
        (max(ps - 1, 1), 1),  # decode: page not yet full
        (ps, min(ps, 3)),  # a chunk that ends exactly at a page boundary
        (3 * ps + 5, 5),  # a chunk after several pages, crossing a boundary if ps <= 5
        (min(2 * ps, 24), min(2 * ps, 24)),  # a whole prompt at once: offset 0
    ]
    if long:
        seqs += [(2049, 1), (2100, 7)]  # a long decode and a long chunk
    return seqs


# A pruned matrix rather than the full product: every dtype, head dim (64, 96, 128 and
# 8, 40, 256), page size (1, 4, 8, 16, 256) and GQA ratio (1, 4, 8) appears, each dtype
# meets at least two head dims, page sizes and ratios, and both kinds of garbage.
# (dtype, head_dim, page_size, group, n_kv_heads, garbage, long contexts)
MATRIX = [
    ("float32", 64, 8, 1, 2, "nan", False),
    ("float32", 128, 16, 4, 2, "huge", True),
    ("float32", 96, 256, 8, 1, "nan", True),
    ("float32", 40, 4, 4, 2, "nan", False),
    ("float32", 256, 16, 1, 4, "huge", False),
    ("float32", 8, 1, 4, 1, "nan", False),
    ("float16", 64, 16, 4, 2, "nan", False),
    ("float16", 128, 8, 8, 1, "huge", True),
    ("float16", 96, 256, 1, 2, "nan", False),
    ("bfloat16", 96, 16, 1, 2, "nan", True),
    ("bfloat16", 128, 256, 4, 2, "huge", False),
    ("bfloat16", 64, 8, 8, 1, "nan", False),
]


@pytest.mark.parametrize("walk", WALK_PARAMS)
@pytest.mark.parametrize(
    "dtype,head_dim,page_size,group,n_kv_heads,garbage,long", MATRIX,
    ids=[f"{d}-D{h}-ps{p}-G{g}-kv{k}-{gb}{'-long' if lg else ''}"
         for d, h, p, g, k, gb, lg in MATRIX],
)
def test_page_walk_matches_dense_oracle(walk, dtype, head_dim, page_size, group, n_kv_heads,
                                        garbage, long, request):
    on_its_device(walk, request)
    case = make_case(standard_seqs(page_size, long), dtype=dtype, head_dim=head_dim,
                     page_size=page_size, group=group, n_kv_heads=n_kv_heads, garbage=garbage)
    assert_matches_oracle(walk, case, dtype, garbage)


def assert_matches_oracle(walk: str, case: PagedCase, dtype: str, garbage: str) -> None:
    out = WALKS[walk](*case.args())
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    got, want = f32(out), dense_oracle(case)
    assert np.isfinite(want).all()
    leaked = (~np.isfinite(got) | (np.abs(got) > 100)).any(axis=(1, 2))
    assert not leaked.any(), (
        f"{walk}: garbage ({garbage}) from unused slots/pages leaked into {int(leaked.sum())} "
        f"of {len(leaked)} output rows (rows {np.flatnonzero(leaked)[:10].tolist()})"
        + (" — see test_reference_walk_never_lets_nan_in_v_leak"
           if walk == "reference" and garbage == "nan" else "")
    )
    np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype],
                               err_msg=f"{walk} vs dense oracle")


def test_oracle_tolerance_is_sharp_enough_to_see_an_off_by_one():
    """The float32 tolerance is meaningful: shifting the causal limit by one key, or
    dropping the last page, moves the output by far more than it."""
    case = make_case([(37, 5)], page_size=8, group=4, garbage="huge")
    want = dense_oracle(case)
    shifted = make_case([(37, 5)], page_size=8, group=4, garbage="huge")
    shifted.context_lens = [36]
    got = f32(paged_attention(*shifted.args()))
    assert np.abs(got - want).max() > 100 * TOL["float32"]


@pytest.mark.parametrize("walk", WALK_PARAMS)
def test_batch_of_very_different_lengths_and_many_decodes(walk, request):
    """Many decode rows of a few keys next to a long prefill chunk, in one call."""
    on_its_device(walk, request)
    seqs = [(2 + 3 * i, 1) for i in range(40)] + [(2300, 64), (9, 9)]
    case = make_case(seqs, page_size=16, group=4, head_dim=64, garbage="nan", seed=3)
    assert_matches_oracle(walk, case, "float32", "nan")


@pytest.mark.task("4.2")
@ON_CPU
def test_kernel_never_reads_unused_slots_pages_or_minus_one_entries():
    """NaN everywhere a sequence does not own — in K and in V — and outputs stay finite."""
    case = make_case(standard_seqs(8), page_size=8, group=4, garbage="nan")
    assert np.isnan(f32(case.k_pages)[0]).all()  # page 0 (what a clamped -1 names) is NaN
    out = f32(paged_attention(*case.args()))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, dense_oracle(case), rtol=1e-5, atol=1e-5)


@pytest.mark.task("4.1")
def test_reference_walk_never_lets_nan_in_v_leak():
    """The reference page walk reads whole page columns (and page 0 for -1 entries) and
    masks the scores; a NaN in V at a masked slot must still not reach the output
    (0 * NaN = NaN: probabilities of masked slots are 0, but the product with V is not)."""
    case = make_case([(5, 1), (20, 2)], page_size=8, head_dim=64, group=1, garbage="nan")
    out = f32(paged_attention_reference(*case.args()))
    bad = np.flatnonzero(~np.isfinite(out).all(axis=(1, 2))).tolist()
    assert not bad, (
        "BUG day4_paged_attention.paged_attention_reference: NaN in V at masked slots "
        f"(unused tail slots, pages named by clamped -1 entries) leaks into rows {bad}: "
        "`acc * correction + einsum(p, v)` multiplies p == 0 by NaN; V (or the product) "
        "must be masked with mx.where, not only the scores"
    )
    np.testing.assert_allclose(out, dense_oracle(case), rtol=1e-5, atol=1e-5)


@pytest.mark.task("4.2")
@ON_CPU  # the extension's CPU worker pool
def test_thread_count_does_not_change_results():
    seqs = [(300 + 37 * i, 1) for i in range(32)] + [(1500, 24), (700, 16)]
    case = make_case(seqs, page_size=16, group=4, head_dim=128, garbage="nan", seed=5)
    ext = extension()
    try:
        ext.set_num_threads(0)
        default = f32(paged_attention(*case.args()))
        results = {}
        for n in (1, 3):
            ext.set_num_threads(n)
            results[n] = f32(paged_attention(*case.args()))
    finally:
        ext.set_num_threads(0)
    assert np.isfinite(default).all()
    for n, out in results.items():
        assert np.array_equal(out, default), f"{n} threads differ from the default"
    np.testing.assert_allclose(default, dense_oracle(case), rtol=1e-5, atol=1e-5)


@ON_CPU  # how the CPU kernel splits work over its threads
def test_a_decode_row_gives_the_same_bits_alone_and_in_a_batch():
    """One or two decode rows are few work items for the cores: the kernel may split a KV
    head's query heads over several items. A row's result must not depend on that."""
    seqs = [(40 + 97 * i, 1) for i in range(9)]
    case = make_case(seqs, page_size=16, group=3, n_kv_heads=3, head_dim=64, seed=8)
    q, k_pages, v_pages, table, lens, _, scale = case.args()
    batched = f32(paged_attention(*case.args()))
    for b in range(len(seqs)):
        alone = paged_attention(q[b:b + 1], k_pages, v_pages, table[b:b + 1], lens[b:b + 1],
                                mx.array([0, 1], dtype=mx.int32), scale)
        assert np.array_equal(f32(alone), batched[b:b + 1]), b
    np.testing.assert_allclose(batched, dense_oracle(case), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# paged_kv_write
# ---------------------------------------------------------------------------------------


def random_pool(rng, dtype, shape=(7, 8, 2, 16)):
    dt = DTYPES[dtype]
    k = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dt)
    v = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dt)
    mx.eval(k, v)
    return k, v


@pytest.mark.task("4.3")
@ON_CPU  # Task 4.3 is the C++ write (on a GPU, MLX's scatter writes)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_kv_write_writes_exactly_the_named_slots(dtype):
    rng = np.random.default_rng(1)
    k, v = random_pool(rng, dtype)
    P, ps, H, D = k.shape
    k_before, v_before = f32(k), f32(v)
    slots = rng.permutation(P * ps)[:11]
    slots[:2] = [0, P * ps - 1]  # the first and the last slot of the pool
    dt = DTYPES[dtype]
    k_new = mx.array(rng.standard_normal((len(slots), H, D)).astype(np.float32)).astype(dt)
    v_new = mx.array(rng.standard_normal((len(slots), H, D)).astype(np.float32)).astype(dt)
    # Non-contiguous new rows (a transposed view) must be written as their logical values.
    k_view = mx.array(np.ascontiguousarray(f32(k_new).transpose(1, 0, 2))).astype(dt)
    k_view = k_view.transpose(1, 0, 2)
    k, v = paged_kv_write(k, v, k_view, v_new, mx.array(slots.astype(np.int32)))
    mx.eval(k, v)
    k_want, v_want = k_before.reshape(-1, H, D), v_before.reshape(-1, H, D)
    k_want[slots], v_want[slots] = f32(k_new), f32(v_new)
    assert np.array_equal(f32(k), k_want.reshape(P, ps, H, D))
    assert np.array_equal(f32(v), v_want.reshape(P, ps, H, D))


def test_kv_write_of_no_rows_changes_nothing():
    rng = np.random.default_rng(2)
    k, v = random_pool(rng, "float32")
    before = f32(k), f32(v)
    empty = mx.zeros((0, 2, 16))
    k, v = paged_kv_write(k, v, empty, empty, mx.zeros((0,), dtype=mx.int32))
    assert np.array_equal(f32(k), before[0]) and np.array_equal(f32(v), before[1])


@pytest.mark.task("4.3")
@ON_CPU  # the C++ write (on a GPU, MLX's scatter writes)
def test_kv_write_is_in_place_when_the_caller_drops_the_old_pool():
    """The engine's pattern: write, attend on the new pool, evaluate; repeat. No copies,
    and the attention sees every row written so far."""
    rng = np.random.default_rng(3)
    ext = extension()
    P, ps, H, D = 6, 4, 2, 16
    k = mx.array(np.full((P, ps, H, D), np.nan, np.float32))
    v = mx.array(np.full((P, ps, H, D), np.nan, np.float32))
    mx.eval(k, v)
    table = [4, 1, 3]  # one sequence, shuffled pages
    keys, values = [], []
    copies = ext.pool_copies()
    for length, new in ((5, 5), (6, 1), (9, 3)):  # a prefill chunk, a decode, a chunk
        kn = rng.standard_normal((new, H, D)).astype(np.float32)
        vn = rng.standard_normal((new, H, D)).astype(np.float32)
        keys.append(kn)
        values.append(vn)
        slots = [table[p // ps] * ps + p % ps for p in range(length - new, length)]
        k, v = paged_kv_write(k, v, mx.array(kn), mx.array(vn), mx.array(slots, dtype=mx.int32))
        q = mx.array(rng.standard_normal((new, 2 * H, D)).astype(np.float32))
        used = -(-length // ps)
        bt = mx.array([table[:used] + [-1] * (len(table) - used)], dtype=mx.int32)
        out = paged_attention(q, k, v, bt, mx.array([length], dtype=mx.int32),
                              mx.array([0, new], dtype=mx.int32), 0.25)
        mx.eval(out, k, v)
        want = causal_attention(q, mx.array(np.concatenate(keys)), mx.array(np.concatenate(values)),
                                0.25, length - new)
        np.testing.assert_allclose(np.array(out), np.array(want), rtol=1e-5, atol=1e-5)
    assert ext.pool_copies() == copies, (
        f"BUG paged_ops.cpp paged_kv_write: {ext.pool_copies() - copies} pool copies in "
        "3 writes whose old pools nobody referenced. PagedKVWrite has two outputs made by "
        "array::make_arrays, which gives each output its own copy of the inputs vector, so "
        "at eval each input pool's array_desc_ use_count is 2 and is_donatable() is never "
        "true: every write copies the whole pool (O(pool), not O(new tokens)). One "
        "single-output primitive per pool (k and v written by two PagedKVWrite nodes) would "
        "let the pool be donated"
    )


@pytest.mark.task("4.3")
@ON_CPU
def test_kv_write_copies_when_the_old_pool_is_still_referenced():
    rng = np.random.default_rng(4)
    ext = extension()
    k_old, v_old = random_pool(rng, "float32")
    k_before, v_before = f32(k_old), f32(v_old)
    rows = mx.array(rng.standard_normal((2, 2, 16)).astype(np.float32))
    copies = ext.pool_copies()
    k_new, v_new = paged_kv_write(k_old, v_old, rows, rows, mx.array([3, 40], dtype=mx.int32))
    mx.eval(k_new, v_new)
    assert ext.pool_copies() > copies, "a pool still referenced was written without a copy"
    assert np.array_equal(f32(k_old), k_before) and np.array_equal(f32(v_old), v_before), (
        "writing changed an array the caller still holds"
    )
    k_want = k_before.reshape(-1, 2, 16)
    k_want[[3, 40]] = np.array(rows)
    assert np.array_equal(f32(k_new), k_want.reshape(k_before.shape))


@pytest.mark.task("4.3")
@ON_CPU
@pytest.mark.parametrize("keep_old", [False, True], ids=["dropped", "kept"])
def test_kv_write_into_a_non_contiguous_pool(keep_old):
    """A pool that is a strided view (here a transpose) must be written by logical
    position, like any MLX array."""
    rng = np.random.default_rng(5)
    P, ps, H, D = 4, 8, 2, 16
    base = rng.standard_normal((P, ps, H, D)).astype(np.float32)
    k = mx.array(np.ascontiguousarray(base.transpose(1, 0, 2, 3))).transpose(1, 0, 2, 3)
    v = mx.array(np.ascontiguousarray(base.transpose(1, 0, 2, 3))).transpose(1, 0, 2, 3)
    mx.eval(k, v)
    assert np.array_equal(np.array(k), base)
    old = (k, v) if keep_old else None
    rows = rng.standard_normal((2, H, D)).astype(np.float32)
    k, v = paged_kv_write(k, v, mx.array(rows), mx.array(rows), mx.array([3, 17], dtype=mx.int32))
    mx.eval(k, v)
    want = base.copy().reshape(-1, H, D)
    want[[3, 17]] = rows
    assert np.array_equal(np.array(k), want.reshape(base.shape)), (
        "BUG paged_ops.cpp PagedKVWrite::eval_cpu: the pool is assumed row-contiguous "
        "(copy_shared_buffer / memcpy of nbytes, rows at slot * row_bytes); a strided pool "
        "is written at the wrong places. paged_kv_write should pass the pools through "
        "mx::contiguous (or copy when !flags().row_contiguous)"
    )
    if old is not None:
        assert np.array_equal(np.array(old[0]), base)


# ---------------------------------------------------------------------------------------
# Bad metadata: ValueError before anything is dispatched
# ---------------------------------------------------------------------------------------


def i32(x):
    return mx.array(np.array(x, dtype=np.int32))


def valid_metadata():
    """Two sequences over 6 pages of 8 slots: (ctx 10, 2 queries), (ctx 5, 1 query)."""
    return dict(
        q=mx.zeros((3, 4, 16)), k_pages=mx.zeros((6, 8, 2, 16)), v_pages=mx.zeros((6, 8, 2, 16)),
        block_table=i32([[3, 5, -1], [1, -1, -1]]), context_lens=i32([10, 5]),
        query_start_loc=i32([0, 2, 3]),
    )


def with_pages(shape, dtype=mx.float32):
    return dict(k_pages=mx.zeros(shape, dtype), v_pages=mx.zeros(shape, dtype))


BAD_METADATA = {
    "q rank 2": dict(q=mx.zeros((3, 64))),
    "pages rank 3": with_pages((6, 8, 32)),
    "v pages shape differs": dict(v_pages=mx.zeros((6, 8, 2, 24))),
    "q head_dim differs from pages": dict(q=mx.zeros((3, 4, 24))),
    "query heads not a multiple of KV heads": dict(q=mx.zeros((3, 3, 16))),
    "zero KV heads": dict(q=mx.zeros((3, 4, 16)), **with_pages((6, 8, 0, 16))),
    # (with every entry -1, so that only the page size is wrong)
    "page_size 0": dict(**with_pages((6, 0, 2, 16)), block_table=i32([[-1] * 3] * 2)),
    "q not a float": dict(q=mx.zeros((3, 4, 16), dtype=mx.int32),
                          **with_pages((6, 8, 2, 16), mx.int32)),
    "k dtype differs from q": dict(k_pages=mx.zeros((6, 8, 2, 16), mx.float16)),
    "v dtype differs from q": dict(v_pages=mx.zeros((6, 8, 2, 16), mx.bfloat16)),
    "q float16, pages float32": dict(q=mx.zeros((3, 4, 16), mx.float16)),
    "block_table int64": dict(block_table=mx.array([[3, 5, -1], [1, -1, -1]], dtype=mx.int64)),
    "context_lens int64": dict(context_lens=mx.array([10, 5], dtype=mx.int64)),
    "query_start_loc uint32": dict(query_start_loc=mx.array([0, 2, 3], dtype=mx.uint32)),
    "context_lens float": dict(context_lens=mx.array([10.0, 5.0])),
    "block_table rank 1": dict(block_table=i32([3, 5, -1])),
    "context_lens too short": dict(context_lens=i32([10])),
    "query_start_loc too long": dict(query_start_loc=i32([0, 2, 3, 3])),
    "query_start_loc not from 0": dict(query_start_loc=i32([1, 2, 3])),
    "query_start_loc not ending at T": dict(query_start_loc=i32([0, 2, 2])),
    "zero-length sequence": dict(q=mx.zeros((2, 4, 16)), query_start_loc=i32([0, 2, 2])),
    "query_start_loc decreasing": dict(query_start_loc=i32([0, 4, 3])),
    "context shorter than its queries": dict(context_lens=i32([1, 5])),
    "zero context": dict(context_lens=i32([10, 0])),
    "page id past the pool": dict(block_table=i32([[3, 6, -1], [1, -1, -1]])),
    "negative page id in use": dict(block_table=i32([[3, -2, -1], [1, -1, -1]])),
    "-1 in a used entry": dict(block_table=i32([[3, -1, -1], [1, -1, -1]])),
    "unused entry not -1": dict(block_table=i32([[3, 5, 0], [1, -1, -1]])),
    "unused entry is a valid page": dict(block_table=i32([[3, 5, -1], [1, 2, -1]])),
    "too few table columns": dict(block_table=i32([[3], [1]])),
    "context needs more pages than the table": dict(context_lens=i32([25, 5])),
}


KNOWN_METADATA_BUGS = {
    "page_size 0": "BUG day4_paged_attention.check_metadata: `page_size & (page_size - 1)` "
    "is 0 for page_size 0, so it passes (numpy then divides by zero computing pages_used); "
    "with every entry -1 nothing else objects, and the CPU kernel's page loop "
    "(`start += ps` in attend_row) would never end. Require page_size >= 1",
    "zero KV heads": "BUG day4_paged_attention.check_metadata: `q.shape[1] % n_kv_heads` "
    "raises ZeroDivisionError for pages with 0 KV heads instead of a ValueError",
}


@pytest.mark.parametrize("name", list(BAD_METADATA))
def test_bad_metadata_is_rejected_before_dispatch(name):
    meta = {**valid_metadata(), **BAD_METADATA[name]}
    check_metadata(**valid_metadata())  # the base case is valid
    # The wrapper raises at call time, so nothing lazy is left to evaluate: nothing ran.
    # (Never evaluated here: an unchecked page_size 0 would make the kernel loop forever.)
    for call in (check_metadata, lambda **m: paged_attention(**m, scale=0.25)):
        try:
            call(**meta)
        except ValueError:
            continue
        except Exception as e:  # any other error is the failure to report
            pytest.fail(f"{name!r} raised {type(e).__name__}: {e}, not ValueError. "
                        + KNOWN_METADATA_BUGS.get(name, ""))
        pytest.fail(f"{name!r} was accepted. " + KNOWN_METADATA_BUGS.get(name, ""))


def test_valid_metadata_runs():
    out = paged_attention(**valid_metadata(), scale=0.25)
    assert out.shape == (3, 4, 16) and np.array_equal(f32(out), np.zeros((3, 4, 16)))


def kv_write_args():
    return dict(k_pages=mx.zeros((4, 8, 2, 16)), v_pages=mx.zeros((4, 8, 2, 16)),
                k_new=mx.ones((3, 2, 16)), v_new=mx.ones((3, 2, 16)),
                slot_mapping=i32([0, 9, 31]))


BAD_WRITES = {
    "slot_mapping int64": dict(slot_mapping=mx.array([0, 9, 31], dtype=mx.int64)),
    "slot_mapping rank 2": dict(slot_mapping=i32([[0, 9, 31]])),
    "slot_mapping shorter than rows": dict(slot_mapping=i32([0, 9])),
    "slot past the pool": dict(slot_mapping=i32([0, 9, 32])),
    "negative slot": dict(slot_mapping=i32([0, -1, 31])),
    "duplicate slots": dict(slot_mapping=i32([0, 9, 0])),
    "new rows dtype differs": dict(k_new=mx.ones((3, 2, 16), mx.float16)),
    "new v rows dtype differs": dict(v_new=mx.ones((3, 2, 16), mx.bfloat16)),
    "new rows head_dim differs": dict(k_new=mx.ones((3, 2, 8)), v_new=mx.ones((3, 2, 8))),
    "new rows KV heads differ": dict(k_new=mx.ones((3, 1, 16)), v_new=mx.ones((3, 1, 16))),
    "v rows shape differs": dict(v_new=mx.ones((3, 2, 8))),
    "pages rank 3": dict(k_pages=mx.zeros((4, 8, 32)), v_pages=mx.zeros((4, 8, 32))),
    # k float16 + v float32 (not the reverse: that would overflow the v pool if accepted).
    "k and v pools of different dtypes": dict(
        k_pages=mx.zeros((4, 8, 2, 16), mx.float16), k_new=mx.ones((3, 2, 16), mx.float16)),
}


@pytest.mark.parametrize("name", list(BAD_WRITES))
def test_bad_kv_write_is_rejected_before_dispatch(name):
    args = {**kv_write_args(), **BAD_WRITES[name]}
    try:
        k, v = paged_kv_write(**args)
    except ValueError:
        return
    mx.eval(k, v)
    raise AssertionError(
        f"paged_kv_write accepted {name!r}"
        + (" — BUG paged_ops.cpp paged_kv_write checks k_new/k_pages and v_new/v_pages "
           "dtypes separately but never k_pages vs v_pages; eval_cpu then copies rows of "
           "k's row_bytes into v (wrong slots; a heap overflow when v's rows are smaller). "
           "Nor does the Python wrapper check it"
           if "pools of different dtypes" in name else "")
    )


def test_cpp_op_rejects_mismatched_dtypes():
    """The op itself, without the Python checks: an error, not a crash or garbage."""
    ext = extension()
    meta = valid_metadata()
    rest = (meta["block_table"], meta["context_lens"], meta["query_start_loc"], 0.25)
    k = meta["k_pages"]
    for q, kp, vp in [
        (mx.zeros((3, 4, 16), mx.float16), k, k),
        (meta["q"], k, k.astype(mx.float16)),
        (meta["q"], k.astype(mx.bfloat16), k),
        (meta["q"].astype(mx.int32), k.astype(mx.int32), k.astype(mx.int32)),
    ]:
        with pytest.raises(ValueError, match="dtype"):
            ext.paged_attention(q, kp, vp, *rest)
    with pytest.raises(ValueError, match="int32"):
        ext.paged_attention(meta["q"], k, k, meta["block_table"].astype(mx.int64),
                            *rest[1:])
    w = kv_write_args()
    with pytest.raises(ValueError, match="dtype"):
        ext.paged_kv_write(w["k_pages"], w["v_pages"], w["k_new"].astype(mx.float16),
                           w["v_new"], w["slot_mapping"])


def test_cpp_op_rejects_q_that_does_not_fit_the_pages():
    """Called directly, the op reads out of bounds if q's head_dim differs from the pages'
    or Hq is not a multiple of Hkv; run in a subprocess so a crash cannot take pytest down."""
    script = textwrap.dedent("""
        import tiny_llm
        from tiny_llm.kernels.extension import extension
        import mlx.core as mx
        ext = extension()
        meta = (mx.array([[0]], dtype=mx.int32), mx.array([1], dtype=mx.int32),
                mx.array([0, 1], dtype=mx.int32), 1.0)
        pages = mx.ones((2, 8, 2, 16))
        for q in (mx.ones((1, 2, 32)), mx.ones((1, 3, 16))):
            try:
                mx.eval(ext.paged_attention(q, pages, pages, *meta))
                print("accepted", q.shape)
            except ValueError:
                print("rejected", q.shape)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, f"the op crashed: {run.returncode} {run.stderr[-2000:]}"
    assert "accepted" not in run.stdout, (
        "BUG paged_ops.cpp paged_attention(): checks only ranks and dtypes, not that "
        "q.shape(2) == k_pages.shape(3) and q.shape(1) % k_pages.shape(2) == 0, so the CPU "
        f"kernel reads out of bounds: {run.stdout.strip()}"
    )


# ---------------------------------------------------------------------------------------
# The engine: kernel == reference == gather == dense, greedy, float32
# ---------------------------------------------------------------------------------------


def staggered_jobs(seed: int, n: int, shared_prefix: int = 0):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(100, 40000, shared_prefix).tolist()
    return [
        (int(rng.integers(0, 6)),  # arrival step
         {"prompt_token_ids": prefix + rng.integers(100, 40000, int(rng.integers(1, 40))).tolist()},
         greedy(int(rng.integers(2, 14))))
        for _ in range(n)
    ]


SCENARIOS = {
    # many requests, chunked prefill, a shared prefix: prefix-cache hits
    "prefix-cache": dict(jobs=dict(seed=11, n=10, shared_prefix=21),
                         paged=dict(num_pages=256, enable_prefix_caching=True)),
    # a pool too small for everyone: preemption and recomputation
    "preemption": dict(jobs=dict(seed=12, n=10),
                       paged=dict(num_pages=9, max_model_len=72, enable_prefix_caching=False)),
}


# The engine attends with the day's last kernel on its device: the C++ one (4.3's write
# done) on a CPU, the Metal one (4.4) on a GPU.
@pytest.mark.task("4.4" if plans_for_gpu() else "4.3")
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_engine_kernel_equals_reference_gather_and_dense(tiny_model, smollm_tokenizer,
                                                         scenario):
    spec = SCENARIOS[scenario]
    jobs = staggered_jobs(**spec["jobs"])
    common = dict(max_num_seqs=4, max_num_batched_tokens=16)
    dense = LLMEngine(tiny_model, smollm_tokenizer, kv_cache="dense", **common)
    expected = run_staggered(dense, jobs)
    copies = extension().pool_copies()
    results, stats = {}, {}
    for attention in ("vector", "page_walk", "gather"):
        engine = LLMEngine(tiny_model, smollm_tokenizer, kv_cache="paged", attention=attention,
                           page_size=8, **common, **spec["paged"])  # a page size Metal takes
        # metadata checked
        checked = engine.runner.attention = CheckedAttention(engine.attention)
        results[attention] = run_staggered(engine, jobs)
        stats[attention] = engine.stats()
        engine.kv.blocks.check_invariants()
        layers = tiny_model.config.num_hidden_layers
        assert checked.calls == layers * stats[attention]["num_steps"] > 0
        if attention == "vector":
            kernel_copies = extension().pool_copies() - copies
    for attention, tokens in results.items():
        assert tokens == expected, f"attention={attention} differs from the dense engine"
    for s in stats.values():
        assert s["num_free_pages"] == s["num_pages"]  # everything freed
        if scenario == "preemption":
            assert s["num_preemptions"] > 0
        else:
            assert s["prefix_cache_hit_tokens"] > 0
    # Every attention schedules the same work: only where attention reads K/V differs.
    assert len({(s["num_steps"], s["num_preemptions"]) for s in stats.values()}) == 1
    assert kernel_copies == 0, (
        f"the kernel engine copied a whole K/V pool {kernel_copies} times in "
        f"{stats['vector']['num_steps']} steps ({layers} layers x 2 pools per step): the "
        "in-place write is not in place (see test_kv_write_is_in_place_when_the_caller_"
        "drops_the_old_pool)"
    )


def test_engine_rejects_kernel_geometry_it_cannot_run(smollm_tokenizer):
    from tiny_llm.testing.models import make_tiny_model

    model = make_tiny_model()
    model.apply(lambda p: p.astype(mx.int32))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        LLMEngine(model, smollm_tokenizer)


def test_where_the_gpu_decides_the_op_checks_its_metal_plan_and_writes_by_scatter(
        gpu_decisions):
    """On a Mac's GPU (and in the rehearsal) the op makes the Metal launch plan and checks it
    even when check_metadata is skipped, and K/V is written by MLX's scatter, not the C++
    write (whose copy of a still-referenced pool the counter would see)."""
    case = make_case([(9, 1), (4, 2)], page_size=4, group=1)
    with pytest.raises(ValueError, match="page_size must be a multiple of 8"):
        mx.eval(paged_attention(*case.args(), validate=False))
    ext = extension()
    k_old, v_old = random_pool(np.random.default_rng(6), "float32")
    k_before = f32(k_old)
    rows = mx.array(np.random.default_rng(7).standard_normal((2, 2, 16)).astype(np.float32))
    copies = ext.pool_copies()
    k_new, v_new = paged_kv_write(k_old, v_old, rows, rows, mx.array([3, 40], dtype=mx.int32))
    mx.eval(k_new, v_new)
    assert ext.pool_copies() == copies, "the C++ write ran where the GPU decides"
    assert np.array_equal(f32(k_old), k_before), "the write changed a pool still held"
    k_want = k_before.reshape(-1, 2, 16)
    k_want[[3, 40]] = np.array(rows)
    assert np.array_equal(f32(k_new), k_want.reshape(k_before.shape))
