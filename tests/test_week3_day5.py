"""Day 5: the tiled (FlashAttention) schedule of the paged attention op, and the full engine.

Oracles: dense attention in plain MLX ops (``causal_attention`` over
rows gathered by address translation), the reference page walk, and the Day 1 dense
engine. Three kinds of property:

- the op is right: rows of multi-token queries (tiled schedule) and one-token rows (vector
  schedule), mixed in one call, match the dense oracle for any prefix, page size, dtype,
  head dim and GQA ratio, over shuffled pages, without reading a slot it does not own;
- the op is schedule-invariant: a query row gives the same bits whether it is a decode
  row, a row of a tile at any offset, or a row of a differently chunked query. That is
  what makes chunked prefill and recompute after preemption exact;
- the default engine (paged, kernel, chunked prefill, prefix caching) reproduces the dense
  one-shot logits and the dense engine's greedy tokens, and never materializes dense K/V.

Tolerances of the op against the float32 oracle. The kernel converts its inputs to float32,
computes in float32 and rounds the output once to the input dtype. So the oracle runs on
the same (already rounded) inputs upcast to float32, and the allowed error is half an ulp
of the output dtype (relative; float16 2**-11, bfloat16 2**-8) plus float32 noise (online
softmax vs one softmax, ~1e-6; 2e-5 allowed at 250+ keys).
"""

import math
import random

from tiny_llm.day3_paged_kv import PagePool
from tiny_llm.day4_paged_attention import paged_attention, paged_attention_reference
from tiny_llm.day5_paged_flash import (
    flash_schedule,
    paged_flash_reference,
    tile_rows,
)
from tiny_llm.engine import LLMEngine
from tiny_llm.kernels.device import plans_for_gpu
from tiny_llm.kernels.extension import extension
from tiny_llm.step.dense_kv import DenseKVCache
from tiny_llm.testing.backends import CheckedAttention
from tiny_llm.testing.paged import DTYPES, PagedCase, block_table, dense_reference, make_paged_case
from tiny_llm.testing.runs import RecordingModel, greedy, tokens_of

import mlx.core as mx
import numpy as np
import pytest

# (relative, absolute) error allowed against the float32 oracle; see the module docstring.
TOLERANCE = {"float32": (2e-5, 2e-5), "float16": (2**-11 + 2e-5, 2e-5),
             "bfloat16": (2**-8 + 2e-5, 2e-5)}
SHARPEN = 3.0  # q scale: peaked attention, so one wrongly (in)visible key shows


# ---------------------------------------------------------------------------------------
# Op-level cases: sequences over a shuffled pool whose unowned slots are poisoned.


def build_case(seqs, *, page_size, n_heads, n_kv_heads, head_dim, dtype, seed,
               spare_pages=3, poison=float("nan")) -> PagedCase:
    return make_paged_case(seqs, dtype=dtype, head_dim=head_dim, page_size=page_size,
                           group=n_heads // n_kv_heads, n_kv_heads=n_kv_heads,
                           garbage="nan" if poison != poison else poison,
                           spare_pages=spare_pages, seed=seed, q_scale=SHARPEN)


def table_array(tables: list[list[int]], width: int | None = None) -> mx.array:
    return block_table(tables, max(len(t) for t in tables) + 1 if width is None else width)


def tiled_op(*args, **kwargs) -> mx.array:
    """The extension op with Day 5's tiles (``paged_attention(..., tiled=True)``)."""
    return paged_attention(*args, **kwargs, tiled=True)


def run_op(case: PagedCase, op=tiled_op, k_pages=None, v_pages=None) -> mx.array:
    k_pages = case.k_pages if k_pages is None else k_pages
    v_pages = case.v_pages if v_pages is None else v_pages
    out = op(case.q, k_pages, v_pages, table_array(case.tables),
             mx.array(case.context_lens, dtype=mx.int32),
             mx.array(case.query_start_loc, dtype=mx.int32), case.scale)
    mx.eval(out)
    return out


def run_rows(case: PagedCase, seq: int, first: int, count: int, row_offset: int = 0) -> mx.array:
    """Rows ``first .. first + count - 1`` of sequence ``seq``'s query, computed as a query
    of their own over the context they see (the table cut to that context). With
    ``row_offset``, a sequence of that many rows (over ``seq``'s first pages) comes first in
    the flat batch."""
    lo = case.query_start_loc[seq] + first
    ctx = case.context_lens[seq] - case.query_lens[seq] + first + count
    table = case.tables[seq][: -(-ctx // case.page_size)]
    q, tables, ctxs, qsl = case.q[lo : lo + count], [table], [ctx], [0, count]
    if row_offset:
        q = mx.concatenate([case.q[:row_offset], q])
        tables = [case.tables[seq][: -(-row_offset // case.page_size)], table]
        ctxs, qsl = [row_offset, ctx], [0, row_offset, row_offset + count]
    out = tiled_op(q, case.k_pages, case.v_pages, table_array(tables),
                   mx.array(ctxs, dtype=mx.int32), mx.array(qsl, dtype=mx.int32), case.scale)
    mx.eval(out)
    return out[row_offset:]


def bits(a: mx.array) -> np.ndarray:
    mx.eval(a)  # a kernel's error surfaces through mx.eval, not through np.array (MLX 0.32)
    return np.array(a.astype(mx.float32))


def dense_oracle(case: PagedCase) -> mx.array:
    return mx.array(dense_reference(case))


def assert_close(got: mx.array, want: mx.array, dtype_name: str, case: PagedCase, what: str):
    rtol, atol = TOLERANCE[dtype_name]
    g, w = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert np.isfinite(g).all(), f"{what}: non-finite output (a poisoned slot was read?)"
    bad = np.abs(g - w) > atol + rtol * np.abs(w)
    if bad.any():
        row = int(np.argwhere(bad)[0][0])
        seq = int(np.searchsorted(case.query_start_loc, row, side="right")) - 1
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements off; first at flat row {row} = sequence "
            f"{seq} (context {case.context_lens[seq]}, query {case.query_lens[seq]}, row "
            f"{row - case.query_start_loc[seq]}); max error {np.abs(g - w).max():.3g}")


def prefixes(page_size: int) -> list[int]:
    """Context before the query: none, a whole number of pages, and a ragged one."""
    return [0, 2 * page_size, 3 * page_size + 5]


# (page_size, head_dim, n_heads, n_kv_heads): GQA 1, 4 and 8; head dims 64, 128 and 40 (an
# odd multiple of 8); page sizes below, at and above the query tile of 16.
GEOMETRIES = [
    (16, 64, 4, 4), (8, 64, 8, 2), (32, 64, 8, 1),
    (16, 128, 8, 2), (8, 128, 8, 1), (32, 128, 4, 4),
    (16, 40, 8, 1), (32, 40, 4, 4), (8, 40, 8, 2),
]


@pytest.mark.task("5.3")
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("page_size,head_dim,n_heads,n_kv_heads", GEOMETRIES)
def test_tiled_schedule_matches_dense_attention(dtype_name, page_size, head_dim, n_heads,
                                                n_kv_heads):
    """Every query length x prefix, as sequences of one call (flat batch, shuffled pages)."""
    seqs = [(prefix + L, L) for L in (2, 7, 64, 200) for prefix in prefixes(page_size)]
    random.Random(page_size + head_dim).shuffle(seqs)
    case = build_case(seqs, page_size=page_size, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      head_dim=head_dim, dtype=DTYPES[dtype_name], seed=head_dim + n_heads)
    got = run_op(case)
    assert got.dtype == DTYPES[dtype_name] and got.shape == case.q.shape
    assert_close(got, dense_oracle(case), dtype_name, case, "kernel vs dense oracle")


@pytest.mark.task("5.3")
@pytest.mark.parametrize("dtype_name,page_size,head_dim,n_heads,n_kv_heads", [
    ("float32", 16, 64, 8, 2), ("float16", 8, 128, 8, 1), ("bfloat16", 32, 40, 4, 4)])
def test_tiled_schedule_matches_the_reference_page_walk(dtype_name, page_size, head_dim,
                                                        n_heads, n_kv_heads):
    """Against the Day 4 page walk (float32 inside, one rounding to the dtype, like the
    kernel): equal within one ulp of the dtype, on the same poisoned pool (the walk reads
    whole pages and must mask what it does not own, NaN included). The kernel never reads
    unowned slots: with them zeroed it gives the same bits."""
    seqs = [(prefix + L, L) for L in (2, 7, 64, 200) for prefix in prefixes(page_size)]
    case = build_case(seqs, page_size=page_size, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      head_dim=head_dim, dtype=DTYPES[dtype_name], seed=7)
    k_clean = mx.where(mx.isnan(case.k_pages), mx.zeros_like(case.k_pages), case.k_pages)
    v_clean = mx.where(mx.isnan(case.v_pages), mx.zeros_like(case.v_pages), case.v_pages)
    got = bits(run_op(case))
    assert np.array_equal(got, bits(run_op(case, k_pages=k_clean, v_pages=v_clean))), (
        "the kernel's output depends on slots outside every context")
    want = bits(run_op(case, paged_attention_reference))
    assert np.isfinite(want).all(), "the reference page walk let a masked NaN slot through"
    ulp = {"float32": 2e-5, "float16": 2**-10, "bfloat16": 2**-7}[dtype_name]
    err = np.abs(got - want)
    assert (err <= 2e-5 + ulp * np.abs(want)).all(), f"kernel vs page walk: max {err.max():.3g}"


# ---------------------------------------------------------------------------------------
# The schedule's Python side: which rows take which schedule, and the tiled reference walk.


@pytest.mark.task("5.1")
def test_flash_schedule_covers_every_row_once_in_tiles_of_the_kernel_height():
    qsl = [0, 1, 38, 39, 55, 56, 57, 157]  # decode, 37 rows, decode, 16, decode, decode, 100
    for height in (1, 7, 16, 21):
        schedule = flash_schedule(qsl, height)
        rows = list(schedule.vector_rows)
        for tile in schedule.tiles:
            assert 1 <= tile.num_rows <= height
            assert qsl[tile.seq] <= tile.first_row < tile.first_row + tile.num_rows <= qsl[
                tile.seq + 1]
            rows += range(tile.first_row, tile.first_row + tile.num_rows)
        assert sorted(rows) == list(range(qsl[-1]))  # each row exactly once
        assert schedule.vector_rows == [0, 38, 55, 56]  # one-token queries only
        lens = np.diff(qsl)
        assert len(schedule.tiles) == sum(-(-n // height) for n in lens if n > 1)


def test_tile_heights_are_the_kernels():
    assert tile_rows(mx.cpu, 3) == 16  # kCpuQueryTile
    # Apple GPUs: 64 (row, head) pairs per threadgroup; the Metal launch sizes its grid for
    # every sequence's tiles with the same height (tests/test_metal_kernels.py runs it).
    assert [tile_rows(mx.gpu, g) for g in (1, 3, 4, 5, 8)] == [64, 21, 16, 12, 8]


@pytest.mark.task("5.2")
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("page_size,head_dim,n_heads,n_kv_heads", GEOMETRIES[::2])
@pytest.mark.parametrize("height", [1, 5, 16])
def test_tiled_reference_walk_matches_dense_attention(dtype_name, page_size, head_dim, n_heads,
                                                      n_kv_heads, height):
    seqs = [(prefix + L, L) for L in (1, 2, 7, 40) for prefix in prefixes(page_size)]
    case = build_case(seqs, page_size=page_size, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      head_dim=head_dim, dtype=DTYPES[dtype_name], seed=height)
    got = run_op(case, lambda *a: paged_flash_reference(*a, tile_rows=height))
    assert_close(got, dense_oracle(case), dtype_name, case, "tiled reference vs dense oracle")


@pytest.mark.task("5.3")
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_kernel_tiles_match_the_tiled_reference_walk(dtype_name):
    """The C++ tiles against the MLX-op tiles of the same height: equal within one ulp."""
    seqs = [(prefix + L, L) for L in (2, 7, 64, 200) for prefix in prefixes(16)]
    case = build_case(seqs, page_size=16, n_heads=8, n_kv_heads=2, head_dim=64,
                      dtype=DTYPES[dtype_name], seed=3)
    got = bits(run_op(case))
    height = tile_rows(mx.cpu, 4)
    want = bits(run_op(case, lambda *a: paged_flash_reference(*a, tile_rows=height)))
    ulp = {"float32": 2e-5, "float16": 2**-10, "bfloat16": 2**-7}[dtype_name]
    assert (np.abs(got - want) <= 2e-5 + ulp * np.abs(want)).all()


# Bit-identity across schedules is a property of the CPU kernels (both schedules fold pages
# through one routine); on a Mac's GPU the Metal schedules agree to rounding only, so these
# checks always run on the CPU (the ``cpu_device`` fixture).


@pytest.mark.task("5.3")
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_mixed_batch_of_decode_and_prefill_rows(dtype_name, cpu_device):
    """One call, one-token rows (vector schedule) between multi-token rows (tiled)."""
    page_size = 16
    seqs = [(1, 1), (40, 7), (17, 1), (200, 200), (33, 1), (80, 64), (16, 1), (2, 2),
            (300, 1), (53, 37)]
    case = build_case(seqs, page_size=page_size, n_heads=8, n_kv_heads=2, head_dim=64,
                      dtype=DTYPES[dtype_name], seed=11)
    got = run_op(case)
    assert_close(got, dense_oracle(case), dtype_name, case, "mixed batch vs dense oracle")
    qsl = case.query_start_loc
    for b, L in enumerate(case.query_lens):  # and the batch changes no bit of any row
        alone = run_rows(case, b, 0, L)
        assert np.array_equal(bits(alone), bits(got[qsl[b] : qsl[b + 1]])), (
            f"sequence {b} (query {L}) differs alone and in the mixed batch")


@pytest.mark.task("5.3")
def test_tiles_of_one_row_give_the_same_bits_as_tiles(cpu_device):
    """Day 4's kernel (the vector schedule for every row) and Day 5's (tiles for multi-token
    queries) fold each row's pages through one routine: tiling changes the memory traffic,
    not one bit of the result. Five heads per KV head: fold_page's blocks of two or three
    pairs then straddle rows, so a pair is folded beside other pairs in a tile than alone."""
    seqs = [(1, 1), (40, 7), (17, 1), (200, 200), (80, 64), (53, 37)]
    case = build_case(seqs, page_size=16, n_heads=10, n_kv_heads=2, head_dim=64,
                      dtype=mx.float32, seed=12)
    assert np.array_equal(bits(run_op(case, paged_attention)), bits(run_op(case)))


# ---------------------------------------------------------------------------------------
# Schedule invariance: bit-identical rows whatever schedule, tile or chunk computes them.


@pytest.mark.task("5.3")
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("prefix", [0, 21, 32])
def test_a_row_has_the_same_bits_in_any_schedule(dtype_name, prefix, cpu_device):
    L, page_size = 37, 16
    case = build_case([(prefix + L, L)], page_size=page_size, n_heads=10, n_kv_heads=2,
                      head_dim=64, dtype=DTYPES[dtype_name], seed=prefix)
    full = bits(run_op(case))  # tiles of rows 0-15, 16-31, 32-36
    assert np.isfinite(full).all()
    for i in range(L):  # each row as a decode row (vector schedule) over its context
        alone = bits(run_rows(case, 0, i, 1))
        assert np.array_equal(alone[0], full[i]), (
            f"row {i} of a {L}-token query (prefix {prefix}) differs from the same row "
            f"computed as a 1-token query: max diff {np.abs(alone[0] - full[i]).max():.3g}")
    # Chunked as a prefill would be: each row sits in tiles of other sizes and offsets.
    for split in ([5, 20, 12], [1, 16, 16, 4], [7, 30], [36, 1], [17, 3, 17]):
        assert sum(split) == L
        got, first = [], 0
        for n in split:
            got.append(bits(run_rows(case, 0, first, n)))
            first += n
        assert np.array_equal(np.concatenate(got), full), f"chunks {split} changed bits"
    # Behind another sequence's rows in the flat batch: other flat offsets, same bits.
    for offset in (3, 16, 21):
        assert np.array_equal(bits(run_rows(case, 0, 0, L, row_offset=offset)), full), offset


# ---------------------------------------------------------------------------------------
# The engine: default configuration (paged, kernel, chunked prefill, prefix caching).


def dense_logits(model, tokens: list[int], rows: list[int]) -> mx.array:
    """One-shot forward over a fresh dense cache; logits at ``rows`` only."""
    n = len(tokens)
    out = model(mx.array(tokens), mx.arange(n), DenseKVCache(model.config.num_hidden_layers),
                mx.array(rows, dtype=mx.int32))
    mx.eval(out)
    return out


@pytest.mark.task("5.3")
@pytest.mark.parametrize("chunk,page_size", [(5, 16), (16, 16), (37, 8)])
def test_chunked_prefill_through_the_flash_schedule_equals_one_shot_dense(
        tiny_model, smollm_tokenizer, chunk, page_size):
    rng = random.Random(chunk)
    for length in (chunk + 1, 3 * chunk + 2, 100):
        prompt = [rng.randrange(100, 40000) for _ in range(length)]
        recorder = RecordingModel(tiny_model)
        engine = LLMEngine(recorder, smollm_tokenizer, max_num_seqs=1, num_pages=64,
                           page_size=page_size, max_num_batched_tokens=chunk)
        checked = engine.runner.attention = CheckedAttention(engine.attention)
        out = engine.generate({"prompt_token_ids": prompt}, greedy(4), use_tqdm=False)
        generated = out[0].outputs[0].token_ids
        prefill_steps = -(-length // chunk)
        assert engine.stats()["num_steps"] == prefill_steps + 3, "not chunked by the budget"
        got = mx.concatenate([recorder.recorded[prefill_steps - 1]]
                             + recorder.recorded[prefill_steps:])
        tokens = prompt + generated[:-1]
        want = dense_logits(tiny_model, tokens, list(range(length - 1, len(tokens))))
        assert got.shape == want.shape == (4, tiny_model.config.vocab_size)
        diff = mx.abs(got - want).max().item()
        assert diff <= 1e-4, f"prompt {length}, chunks of {chunk}: max |logit diff| {diff:.3g}"
        assert generated == mx.argmax(want, axis=-1).tolist()
        assert any(max(lens) > 1 for lens in checked.query_lengths), "no multi-token query"


def test_long_prompt_prefills_in_chunks_and_matches_dense(tiny_model, smollm_tokenizer):
    length, chunk = 3000, 700  # chunk boundaries at 700, 1400, ... are mid-page
    prompt = [random.Random(3).randrange(100, 40000) for _ in range(length)]
    recorder = RecordingModel(tiny_model)
    engine = LLMEngine(recorder, smollm_tokenizer, max_num_seqs=1, max_num_batched_tokens=chunk)
    checked = engine.runner.attention = CheckedAttention(engine.attention)
    out = engine.generate({"prompt_token_ids": prompt}, greedy(2), use_tqdm=False)
    generated = out[0].outputs[0].token_ids
    assert len(generated) == 2
    assert checked.query_lengths[: math.ceil(length / chunk)] == [
        [min(chunk, length - s)] for s in range(0, length, chunk)]
    got = mx.concatenate([recorder.recorded[-2], recorder.recorded[-1]])
    want = dense_logits(tiny_model, prompt + generated[:1], [length - 1, length])
    diff = mx.abs(got - want).max().item()
    assert diff <= 1e-4, f"3000-token prompt: max |logit diff| {diff:.3g}"
    assert generated == mx.argmax(want, axis=-1).tolist()


def mixed_workload(seed: int = 0):
    """Requests sharing a 40-token prefix (prefix-cache hits) and unrelated ones."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, 40000) for _ in range(40)]
    prompts, params = [], []
    for i in range(10):
        suffix = [rng.randrange(100, 40000) for _ in range(rng.randint(1, 50))]
        prompts.append({"prompt_token_ids": (shared + suffix) if i % 3 else suffix})
        params.append(greedy(rng.randint(2, 24)))
    return prompts, params


# Small pool (preemption), small budget (chunks), page size 8: every Day 2-5 path at once.
FINAL = dict(max_num_seqs=4, max_num_batched_tokens=24, page_size=8, num_pages=24)


@pytest.mark.parametrize("attention", [pytest.param("flash", marks=pytest.mark.task(
                                           "5.4" if plans_for_gpu() else "5.3")),
                                       pytest.param("tiled_walk",
                                                    marks=pytest.mark.task("5.2"))])
def test_final_engine_equals_dense_day1_engine(tiny_model, smollm_tokenizer, attention):
    prompts, params = mixed_workload()
    dense = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=4, kv_cache="dense",
                      enable_chunked_prefill=False, max_num_batched_tokens=1024)
    expected = tokens_of(dense, prompts, params)
    engine = LLMEngine(tiny_model, smollm_tokenizer, **FINAL, attention=attention)
    if attention == "flash":  # the defaults are the final engine
        assert LLMEngine(tiny_model, smollm_tokenizer, num_pages=8).config.attention == "flash"
    checked = engine.runner.attention = CheckedAttention(engine.attention)
    assert engine.config.enable_prefix_caching and engine.config.enable_chunked_prefill
    got = tokens_of(engine, prompts, params)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0, "the workload did not preempt; shrink num_pages"
    assert stats["prefix_cache_hit_tokens"] > 0, "no prefix-cache hit"
    assert any(1 in lens and max(lens) > 1 for lens in checked.query_lengths), "no mixed step"
    assert got == expected
    assert stats["num_free_pages"] == FINAL["num_pages"]
    engine.kv.blocks.check_invariants()


def test_kernel_path_never_materializes_dense_kv(tiny_model, smollm_tokenizer, monkeypatch):
    def forbid(owner, name):
        def forbidden(*args, **kwargs):
            raise AssertionError(f"dense K/V: {owner.__name__}.{name} called")

        monkeypatch.setattr(owner, name, forbidden)

    prompts, params = mixed_workload(seed=1)
    forbid(PagePool, "gather")  # Day 3 gathers pages into dense K/V
    forbid(PagePool, "write")  # the MLX-op walks write with MLX indexing
    forbid(DenseKVCache, "attend_at")  # Days 1-2 keep dense K/V per request
    # The patches bite: each older path now fails at the method it would call.
    for options, fired in (({"attention": "gather"}, "PagePool"),
                           ({"attention": "page_walk"}, "PagePool.write"),
                           ({"kv_cache": "dense"}, "DenseKVCache.attend_at")):
        older = LLMEngine(tiny_model, smollm_tokenizer, **options,
                          **({"num_pages": 64} if "kv_cache" not in options else {}))
        with pytest.raises(AssertionError, match=f"dense K/V: {fired}"):
            older.generate(prompts[:1], params[:1], use_tqdm=False)
    engine = LLMEngine(tiny_model, smollm_tokenizer, **FINAL)
    copies = extension().pool_copies()
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert all(o.finished for o in outs)
    assert engine.stats()["num_preemptions"] > 0
    # Nor a copy of the pool: the engine holds the only reference, so writes are in place.
    copies = extension().pool_copies() - copies
    assert copies == 0, (
        f"paged_kv_write copied a whole pool {copies} times in {engine.stats()['num_steps']} "
        "steps: writes cost O(pool), not O(new tokens)")
