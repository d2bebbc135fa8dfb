"""The chapters' exercises: every folded answer's numbers, recomputed by the code it names.

Each chapter with a "## Exercises" section works its answers out on paper and names the
function, the configuration or the benchmark that gives the same numbers. A test here takes
one exercise, recomputes its key numbers with those functions (or by arithmetic on a config
the package defines), checks them against the values the answer states, and checks that
the chapter's text states them: a change in the code or in the prose that breaks an answer
fails here.

Left alone: the values an answer cites from a benchmark's measurements (``{{#result}}``),
and the outcomes of random draws, which are checked by their closed forms (sampled
frequencies the prose quotes must lie within sampling error of them). Nothing is downloaded,
and no weights are loaded or computed: SmolLM2-135M's config is read from the installed
default model's GGUF metadata, and a ``Model`` built from a config knows its parameters'
shapes without evaluating them.
"""

import importlib
import logging
import math
import sys
from fractions import Fraction
from pathlib import Path

from tiny_llm import LLMEngine, Model, ModelConfig, SamplingParams
from tiny_llm.day1_batching import (
    BatchingSimulator,
    DenseKVStorage,
    continuous_batching_steps,
    simulate_batching,
    static_batching_steps,
)
from tiny_llm.day2_chunked_prefill import ChunkedPrefillScheduler
from tiny_llm.day3_paged_kv import blocks_needed
from tiny_llm.day5_paged_flash import flash_schedule, tile_rows
from tiny_llm.engine.pool_size import kv_bytes_per_token, log_pool, pool_pages
from tiny_llm.kernels.extension import extension
from tiny_llm.models.loader import default_model_path, gguf_config
from tiny_llm.models.model import RoPE
from tiny_llm.moe import LOOP_MIN_ROWS_PER_EXPERT, use_loop
from tiny_llm.serving.handlers import Server
from tiny_llm.speculative import speculative_accept
from tiny_llm.step.batch import TokenTree
from tiny_llm.step.dense_kv import DenseKVCache
from tiny_llm.structured import Constraint, Grammars, StructuredOutput, constrained
from tiny_llm.tensor_parallel import check_tensor_parallel, local_config, shard_linear, valid_sizes
from tiny_llm.testing.models import tiny_config

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

# The numbers are arithmetic, scheduling and shapes: no device decision changes them.
pytestmark = pytest.mark.device_independent

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book" / "src"
MiB = 2**20

# Qwen3-0.6B's config.json (the Hub's Qwen/Qwen3-0.6B), for the exercises that size it.
QWEN3_0_6B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024,
                  num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                  tie_word_embeddings=True, max_position_embeddings=40960)
# Qwen3-32B's, for the tensor-parallel split.
QWEN3_32B = dict(model_type="qwen3", vocab_size=151936, hidden_size=5120, num_hidden_layers=64,
                 intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8,
                 head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                 max_position_embeddings=40960)


def bench(name: str):
    """A script of ``benches/`` as a module (importing it runs nothing)."""
    if str(ROOT / "benches") not in sys.path:
        sys.path.insert(0, str(ROOT / "benches"))
    return importlib.import_module(name)


def exercises(chapter: str) -> str:
    """The chapter's "## Exercises" section, its whitespace collapsed (a phrase may wrap)."""
    text = (BOOK / f"{chapter}.md").read_text()
    assert "\n## Exercises\n" in text, f"{chapter}.md has no exercises"
    section = text.split("\n## Exercises\n", 1)[1].split("\n## ", 1)[0]
    return " ".join(section.split())


def assert_states(chapter: str, *phrases: str) -> None:
    section = exercises(chapter)
    missing = [p for p in phrases if p not in section]
    assert not missing, f"{chapter}.md's exercises do not state {missing}"


def count(model: nn.Module, prefix: str = "") -> int:
    """Parameters under ``prefix`` (shapes only: nothing is evaluated)."""
    return sum(v.size for k, v in tree_flatten(model.parameters()) if k.startswith(prefix))


@pytest.fixture(scope="module")
def smollm_config() -> ModelConfig:
    """SmolLM2-135M's config, as the loader reads it from the installed default model."""
    raw, meta = mx.load(str(default_model_path()), return_metadata=True)
    return gguf_config(meta, has_output="output.weight" in raw)


def test_every_chapter_with_exercises_is_tested_here():
    """A new chapter's exercises need their tests: the list below is every chapter that
    has a "## Exercises" section, and each has two exercises or more."""
    chapters = sorted(p.stem for p in BOOK.glob("*.md") if "\n## Exercises\n" in p.read_text())
    assert chapters == sorted(["week3-day1", "week3-day2", "week3-day3", "week3-day4",
                               "week3-day5", "speculative", "moe", "tensor-parallel",
                               "serving", "model"])
    for chapter in chapters:
        assert exercises(chapter).count("<details><summary>") >= 2, chapter


# ------------------------------------------------------------------------ Day 1


def test_week3_day1_static_and_continuous_steps():
    """Two slots, outputs of 2, 8, 3 and 5 tokens: static batching takes 13 steps with 8
    idle slot-steps, continuous 10 with 2, by the arithmetic (Task 1.7), by the scheduler
    itself, and with the continuous timeline the answer draws (A, C, D share slot 1)."""
    lens = [2, 8, 3, 5]
    static, continuous = static_batching_steps(lens, 2), continuous_batching_steps(lens, 2)
    assert (static.steps, static.wasted_slot_steps) == (13, 8)
    assert (continuous.steps, continuous.wasted_slot_steps) == (10, 2)
    assert simulate_batching(lens, 2, "static") == static
    assert simulate_batching(lens, 2, "continuous") == continuous
    sim = BatchingSimulator(max_batch=2)
    for n in lens:
        sim.add_request(prompt_len=1, output_len=n)
    sim.run()
    assert [r.finish_step for r in sim.requests] == [2, 8, 5, 10]  # A, B, C, D
    assert_states("week3-day1", "steps = 8 + 5 = 13",
                  "idle slot-steps = 13 × 2 − (2 + 8 + 3 + 5) = 26 − 18 = 8",
                  "slot 1: A (steps 1-2), C (3-5), D (6-10)", "slot 2: B (steps 1-8)",
                  "steps = 10", "idle slot-steps = 10 × 2 − 18 = 2",
                  "`static_batching_steps([2, 8, 3, 5], 2)`",
                  "`continuous_batching_steps([2, 8, 3, 5], 2)`")


def test_week3_day1_dense_slot_memory(smollm_config):
    """8 dense slots of SmolLM2 at 300 tokens: the real caches grow to 512 rows (STEP 256),
    22.5 MiB a slot and 180 MiB in all, 59% of it tokens; reserving 2,048 rows would take
    720 MiB; pages of 16 would hold 304 rows a sequence."""
    c = smollm_config
    per_token = kv_bytes_per_token(c, mx.float32)
    assert per_token == 46_080 == 45 * 1024
    assert DenseKVCache.STEP == 256
    storage = DenseKVStorage(8, c.num_hidden_layers)
    q = mx.zeros((300, c.num_attention_heads, c.head_dim))
    kv = mx.zeros((300, c.num_key_value_heads, c.head_dim))
    for cache in storage.caches:  # 300 tokens in every layer of every slot (never evaluated)
        for layer in range(c.num_hidden_layers):
            cache.attend_at(layer, q, kv, kv, 1.0, 0)
    assert {cache.keys[0].shape[0] for cache in storage.caches} == {512}
    held, per_slot = storage.nbytes(), storage.caches[0].nbytes()
    assert per_slot == 512 * per_token and held == 8 * per_slot == 180 * MiB
    tokens = 8 * 300 * per_token
    reserved = 2048 * per_token
    assert reserved == 90 * MiB
    pages = blocks_needed(300, 16)
    assert pages == 19
    assert_states(
        "week3-day1", f"grows its buffers {DenseKVCache.STEP} rows at a time (DenseKVCache.STEP)",
        f"{per_token:,} bytes = {per_token // 1024} KiB",
        f"300 tokens → 2 × 256 = {per_slot // per_token} rows",
        f"{per_slot / MiB:g} MiB per slot", f"8 slots: {held / MiB:g} MiB held",
        f"≈ {tokens / MiB:.0f} MiB of it tokens ({tokens / held:.0%})",
        f"{reserved / MiB:g} MiB per slot, {8 * reserved / MiB:g} MiB for 8 "
        f"({300 / 2048:.0%} of it tokens)",
        f"{pages} pages = {pages * 16} rows here, for 300 tokens")


# ------------------------------------------------------------------------ Day 2


class ChunkedSimulator(BatchingSimulator):
    """The fake-token simulator on Day 2's scheduler (decodes first, chunked prefill)."""

    def make_scheduler(self, max_batch, max_num_batched_tokens, policy):
        return ChunkedPrefillScheduler(max_batch, max_num_batched_tokens, policy)


def test_week3_day2_long_prompt_among_decodes():
    """A 1,024-token prompt arrives while 8 requests decode, budget 256: each step carries
    the 8 decode rows first and 248 prompt tokens; the first token comes out of the 5th
    step, whose chunk is the last 32 tokens."""
    sim = ChunkedSimulator(max_batch=9, max_num_batched_tokens=256)
    for _ in range(8):
        sim.add_request(prompt_len=1, output_len=100)
    sim.step()  # the 1-token prompts: from now on the 8 decode
    long = sim.add_request(prompt_len=1024, output_len=2)
    chunks = []
    while not long.output_token_ids:
        report = sim.step()
        assert report.scheduled[:8] == [(i, 1) for i in range(8)]  # decodes first
        chunks.append(dict(report.scheduled)[long.request_id])
    assert chunks == [248, 248, 248, 248, 32]
    assert_states("week3-day2", "each step: 8 decode rows first, then 256 − 8 = 248 prompt tokens",
                  f"steps: ceil(1,024 / 248) = {len(chunks)}",
                  f"(4 × 248 = {sum(chunks[:4])}, the 5th step takes the last {chunks[-1]})",
                  "The first token comes out of the 5th step")


def test_week3_day2_score_matrix_sizes():
    """The score matrix of a 2,048-token prompt in one step (151 MB a layer, float32, 9
    heads) and of one 512-row chunk (38 MB); the scheduler's four chunks compute 0.625 of
    one step's scores (``rows × end`` per chunk, as the benchmark counts them)."""
    heads = 9
    one_step = 2048 * 2048 * heads * 4
    one_chunk = 512 * 2048 * heads * 4
    assert (one_step, one_chunk) == (150_994_944, 37_748_736)
    sim = ChunkedSimulator(max_batch=1, max_num_batched_tokens=512)
    sim.add_request(prompt_len=2048, output_len=1)
    ends, scores = 0, 0
    for report in sim.run():
        ((_, rows),) = report.scheduled
        ends += rows
        scores += rows * ends
    assert scores == 512 * (512 + 1024 + 1536 + 2048) == 2_621_440
    assert scores / 2048**2 == 0.625 and 2048 * 2049 // 2 == 2_098_176
    assert_states("week3-day2", f"× 4 bytes = {one_step / 1e6:.0f} MB per layer",
                  f"× 4 bytes = {one_chunk / 1e6:.0f} MB per layer",
                  f"512 × 5,120 = {scores:,} scores per head",
                  f"2,048 × 2,048 = {2048**2:,} in one step ({scores / 2048**2:g} of it",
                  "the causal triangle the rows need is 2,098,176")


# ------------------------------------------------------------------------ Day 3


def test_week3_day3_pool_for_qwen3_on_a_16_gb_mac(caplog):
    """Qwen3-0.6B in bfloat16 on 16 GB less 6: 112 KiB of K/V a token, an 8.8 GB pool of
    about 76,700 tokens, 4,795 pages of 16 (the answer rounds to 4,790) and 18 requests of
    4,096 tokens, as ``pool_pages`` sizes it from ``kv_memory_bytes`` and the engine's log
    reports it."""
    config = ModelConfig.from_hf(QWEN3_0_6B)
    params = count(Model(config))
    assert round(params / 1e9, 1) == 0.6  # "about 0.6 B"
    per_token = kv_bytes_per_token(config, mx.bfloat16)
    assert per_token == 114_688 == 112 * 1024
    weights = 0.6e9 * 2
    pool = 16e9 - 6e9 - weights
    tokens = pool / per_token
    pages = pool_pages(config, mx.bfloat16, 16, 4096, 1, kv_memory_bytes=int(pool),
                       available=10**11)
    assert pages == int(pool) // (16 * per_token) == 4795
    assert abs(pages - 4790) / pages < 0.002  # the answer's "≈ 4,790": 76,700 / 16
    assert int(tokens // 4096) == 18
    with caplog.at_level(logging.INFO, logger="tiny_llm"):
        log_pool(pages, 16, 16 * per_token, 4096)
    assert f"= {pages * 16} tokens" in caplog.text and "max_model_len=4096: 18.73x" in caplog.text
    assert_states("week3-day3", f"× 2 bytes ≈ {weights / 1e9:g} GB",
                  f"= {per_token:,} bytes = {per_token // 1024} KiB",
                  f"16 − 6 − 1.2 ≈ {pool / 1e9:g} GB",
                  f"8.8 × 10⁹ / 114,688 ≈ {round(tokens, -2):,.0f} tokens",
                  "76,700 / 16 ≈ 4,790 pages of 16 tokens",
                  f"76,700 / 4,096 ≈ {int(tokens // 4096)} at full length", "`kv_memory_bytes`")


def test_week3_day3_predicted_tail_waste():
    """About P / 2 slots wasted in each sequence's last page: 8 / 228 ≈ 0.035 for pages of
    16 and 128 / 348 ≈ 0.37 for pages of 256, at a mean length of 220. (The measured
    fractions come from table 3, not tested here.)"""
    predicted = {p: (p / 2) / (220 + p / 2) for p in (16, 256)}
    assert f"{predicted[16]:.3f}" == "0.035" and f"{predicted[256]:.2f}" == "0.37"
    assert_states("week3-day3", f"pages of 16: 8 / (220 + 8) ≈ {predicted[16]:.3f}",
                  f"pages of 256: 128 / (220 + 128) ≈ {predicted[256]:.2f}")


# ------------------------------------------------------------------------ Day 4


def test_week3_day4_decode_memory_bound(smollm_config):
    """A float32 decode step of SmolLM2 reads its 134.5 M parameters once: 538 MB
    (``decode_bytes_per_token``, the benchmarks' memory bound), 27 ms and 37 tokens/s at
    20 GB/s."""
    model = Model(smollm_config)
    params = count(model)
    assert params == 134_515_008
    c = smollm_config
    step_bytes = bench("bench_model").decode_bytes_per_token(
        dict(tree_flatten(model.parameters())), c.vocab_size, c.tie_word_embeddings)
    assert step_bytes == 4 * params + 4 * c.hidden_size  # every weight, and one embedding row
    seconds = step_bytes / 20e9
    assert (round(seconds * 1e3), round(1 / seconds)) == (27, 37)
    assert_states("week3-day4", f"{params / 1e6:.1f} M parameters × 4 bytes",
                  f"134.5 × 10⁶ × 4 = {step_bytes / 1e6:.0f} MB",
                  f"at B = 20 GB/s, {seconds * 1e3:.0f} ms ({1 / seconds:.0f} tokens/s)",
                  "benches/common.py:copy_bandwidth")
    assert hasattr(bench("common"), "copy_bandwidth")
    assert "### Decode against batch size" in (BOOK / "performance.md").read_text()
    assert '"step / memory bound"' in (ROOT / "benches" / "bench_cpu_decode.py").read_text()


def test_week3_day4_kv_reads_against_weights(smollm_config):
    """Batch 8 at 2,048 tokens reads 755 MB of K/V a decode step, more than the weights'
    538 MB, which K/V equals at about 11,700 tokens in the batch."""
    per_token = kv_bytes_per_token(smollm_config, mx.float32)
    assert per_token == 46_080
    kv = 8 * 2048 * per_token
    weights = 4 * count(Model(smollm_config))
    assert kv == 754_974_720 and kv > weights
    balance = weights / per_token
    assert round(balance, -2) == 11_700
    assert_states("week3-day4", f"× 4 bytes = {per_token:,} bytes",
                  f"16,384 tokens × 46,080 bytes = {kv / 1e6:.0f} MB per step",
                  f"538 × 10⁶ / 46,080 ≈ {round(balance, -2):,.0f} tokens in the whole batch")


# ------------------------------------------------------------------------ Day 5


def test_week3_day5_tiled_and_vector_page_reads():
    """A 512-token prompt, pages and tiles of 16: ``flash_schedule`` cuts 32 tiles, which
    read 528 (tile, page) pairs; a walk per row reads 8,448 pages, 16 times as many."""
    schedule = flash_schedule([0, 512], 16)
    assert schedule.vector_rows == [] and len(schedule.tiles) == 32
    tiled = sum(blocks_needed(t.first_row + t.num_rows, 16) for t in schedule.tiles)
    vector = sum(blocks_needed(p + 1, 16) for p in range(512))
    assert (tiled, vector) == (528, 8448) and vector == 16 * tiled
    assert_states("week3-day5", f"1 + 2 + ... + 32 = {tiled}",
                  f"16 × (1 + 2 + ... + 32) = {vector:,}", "Sixteen times fewer page reads")


def test_week3_day5_metal_tiles_of_a_100_row_chunk():
    """Apple GPU tiles of ``64 // group`` rows (``metal_tile_rows``): SmolLM2 (group 3)
    takes 5 tiles of 21 for 100 rows, the last of 16; Qwen3-0.6B (group 2) 4 of 32, the
    last of 4. The CPU's tiles are 16 rows for every group."""
    qwen = ModelConfig.from_hf(QWEN3_0_6B)
    groups = {"SmolLM2": 9 // 3, "Qwen3-0.6B": qwen.num_attention_heads // qwen.num_key_value_heads}
    expected = {"SmolLM2": (21, 5, 16), "Qwen3-0.6B": (32, 4, 4)}
    for name, group in groups.items():
        rows = extension().metal_tile_rows(group)
        assert rows == tile_rows(mx.gpu, group) == 64 // group
        tiles = flash_schedule([0, 100], rows).tiles
        assert (rows, len(tiles), tiles[-1].num_rows) == expected[name], name
        assert tile_rows(mx.cpu, group) == 16
        assert_states("week3-day5", f"group {group}, tile_rows = {rows} → ceil(100 / {rows}) = "
                      f"{len(tiles)} tiles (the last of {tiles[-1].num_rows} rows)")
    assert_states("week3-day5", "`extension().metal_tile_rows(group)`")


# ------------------------------------------------------------------------ speculative


class ScriptedRng:
    """Stands in for ``np.random.Generator``: ``random()`` returns the given uniforms."""

    def __init__(self, *values: float):
        self.values = iter(values)

    def random(self) -> float:
        return next(self.values)


def outcome_probabilities(draft: int, p: np.ndarray, q: np.ndarray) -> dict:
    """``speculative_accept``'s exact distribution of (kept, token) for one draft: it draws
    two uniforms, and every threshold it compares them with here is a multiple of 1/30, so
    the midpoints of a 30 × 30 grid weigh each outcome exactly."""
    cells = (np.arange(30) + 0.5) / 30
    probs: dict = {}
    for u in cells:
        for v in cells:
            outcome = speculative_accept([draft], np.stack([p, p]), q[None], ScriptedRng(u, v))
            probs[outcome] = probs.get(outcome, 0.0) + 1 / 900
    return probs


def test_speculative_acceptance_rule_on_four_tokens():
    """p = (0.5, 0.2, 0.2, 0.1), q = (0.1, 0.6, 0.1, 0.2): ``speculative_accept`` keeps the
    draft 1 with probability 1/3 and otherwise emits 0 or 2 in 0.8 : 0.2; over drafts drawn
    from q it keeps half, and its first token is distributed as p: what the answer says.
    Computed exactly, with draws that walk a grid (``outcome_probabilities``)."""
    p, q = np.array([0.5, 0.2, 0.2, 0.1]), np.array([0.1, 0.6, 0.1, 0.2])
    fixed = outcome_probabilities(1, p, q)
    kept = sum(w for (n, _), w in fixed.items() if n == 1)
    rejected = {b: w / (1 - kept) for (n, b), w in fixed.items() if n == 0}
    assert kept == pytest.approx(1 / 3) and rejected == pytest.approx({0: 0.8, 2: 0.2})
    kept_any, first = 0.0, np.zeros(4)
    for x in range(4):  # the draft drawn from q: each weighed by its chance
        for (n, b), w in outcome_probabilities(x, p, q).items():
            kept_any += q[x] * w * n
            first[x if n == 1 else b] += q[x] * w
    assert kept_any == pytest.approx(np.minimum(p, q).sum()) == pytest.approx(0.5)
    assert first == pytest.approx(p)
    assert_states("speculative", "min(1, p(1) / q(1)) = min(1, 0.2 / 0.6) = 1/3",
                  "(p − q)⁺ = (0.4, 0, 0.1, 0) → normalised (0.8, 0, 0.2, 0)",
                  "Σ min(p, q) = 0.1 + 0.2 + 0.1 + 0.1 = 0.5 of drafts drawn from q are kept",
                  "min(0.5, 0.1) + 0.5 × 0.8 = 0.1 + 0.4 = 0.5 = p(0)",
                  "q(1) × 1/3 = 0.2 = p(1)")
    assert_states("speculative", "outcomes weigh 1/3 for keeping the draft and 0.8 : 0.2 for "
                  "tokens 0 and 2", "it keeps 0.5 of them and emits its first token with "
                  "probabilities `p`")


def test_speculative_chain_against_tree():
    """Kept with 0.6 (first-ranked guess) and 0.5 (second): a chain of 8 drafts emits 2.47
    tokens a forward, two chains of 4 2.74, a chain of 4 2.31 (``predicted_length`` of the
    benchmark's ``SHAPES``), each verifying 9 rows (5 for the chain of 4)."""
    speculative = bench("bench_week3_speculative")
    shapes = {k: speculative.SHAPES[k] for k in ("chain 8", "tree 8: 2 chains of 4", "chain 4")}
    assert shapes["tree 8: 2 chains of 4"][:4] == [(0,), (1,), (0, 0), (1, 0)]
    length = {k: speculative.predicted_length(paths, [0.6, 0.5]) for k, paths in shapes.items()}
    assert [1 + len(TokenTree.parse(paths)) for paths in shapes.values()] == [9, 9, 5]
    assert length["chain 8"] == pytest.approx((1 - 0.6**9) / 0.4)
    assert length["chain 4"] == pytest.approx((1 - 0.6**5) / 0.4)
    first = sum(0.6**d for d in range(1, 5))
    second = 0.4 * 0.5 * sum(0.6**d for d in range(4))
    assert length["tree 8: 2 chains of 4"] == pytest.approx(1 + first + second)
    chain8, tree, chain4 = length.values()
    assert_states("speculative", "rows: 1 (the last token) + 8 drafts = 9, for both",
                  f"(1 − 0.6⁹) / (1 − 0.6) = {chain8:.2f}",
                  f"0.6 + 0.6² + 0.6³ + 0.6⁴ = {first:.3f}",
                  f"0.2 × (1 + 0.6 + 0.6² + 0.6³) = {second:.3f}",
                  f"1 + 1.306 + 0.435 = {tree:.2f}", f"(1 − 0.6⁵) / (1 − 0.6) = {chain4:.2f}",
                  f"Drafts 5 to 8 of the chain add {chain8 - chain4:.2f} of a token",
                  f"a second guess at depth 1 add {tree - chain4:.2f}",
                  f"gives {chain8:.4f}, {tree:.4f} and {chain4:.4f} for these shapes")
    for simulated, exact in zip((2.48, 2.75, 2.31), (chain8, tree, chain4), strict=True):
        assert abs(simulated - exact) < 0.02  # 100,000 steps of tree_accept: sampling error
    assert_states("speculative", "emits 2.48, 2.75 and 2.31 tokens a step over 100,000 steps")


# ------------------------------------------------------------------------ MoE


def lazy_tiny_model(model_type: str = "qwen3", vocab_size: int = 49152, seed: int = 0,
                    **overrides) -> Model:
    """``make_tiny_model``'s model, its weights left unevaluated (only shapes are needed)."""
    return Model(ModelConfig.from_hf(tiny_config(model_type, vocab_size, **overrides)))


def test_moe_parameters_of_the_mid_model(monkeypatch):
    """The benchmark's mid MoE (``models(SHAPES["mid"])``) has 132,261,376 parameters,
    12,582,912 in one layer's experts, of which a token uses 1,572,864 (its dense twin's MLP):
    44,180,992 a token, the twin's 44,049,920 and the routers'."""
    moe_bench = bench("bench_week3_moe")
    monkeypatch.setattr(moe_bench, "make_tiny_model", lazy_tiny_model)
    moe, dense = moe_bench.models(moe_bench.SHAPES["mid"])
    c = moe.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_experts, c.num_experts_per_tok,
            c.moe_intermediate_size) == (512, 8, 32, 4, 256)
    assert all(c.is_sparse_layer(i) for i in range(c.num_hidden_layers))
    expert = 3 * 512 * 256
    experts = count(moe, "model.layers.0.mlp.switch_mlp.")
    router = count(moe, "model.layers.0.mlp.gate.")
    assert (expert, experts, router) == (393_216, 12_582_912, 16_384)
    active = 4 * expert
    assert active == count(dense, "model.layers.0.mlp.") == 1_572_864
    total, twin = count(moe), count(dense)
    assert (total, twin) == (132_261_376, 44_049_920)
    assert total == twin + 8 * (experts + router - active)
    per_token = total - 8 * (experts - active)
    assert per_token == twin + 8 * router == 44_180_992
    assert_states("moe", f"3 × 512 × 256 (gate, up, down) = {expert:,}",
                  f"32 × 393,216 = {experts:,}", f"4 × 393,216 = {active:,}",
                  f"512 × 32 = {router:,}", f"44,049,920 + 8 × (12,582,912 + 16,384 − 1,572,864) "
                  f"= 44,049,920 + 88,211,456 = {total:,} ({total / twin:.1f} × the twin)",
                  f"44,049,920 + 8 × 16,384 = {per_token:,}",
                  f"gives {total:,} and {twin:,}, and {experts:,} under one layer's "
                  "`mlp.switch_mlp`")


def test_moe_distinct_experts_of_a_16_row_step(cpu_device):
    """16 rows each routed to 4 of 32 experts at random read 32 (1 − (7/8)¹⁶) ≈ 28.2
    experts a layer (the 28.23 the answer measured over 2,000 draws of ``route`` is within
    sampling error), 44.4 MB of float32 against the twin's 6.3 MB; at 2 rows an expert
    ``use_loop`` keeps the gathered matmul on the CPU, and loops from 24 rows (96
    assignments)."""
    missed = (1 - Fraction(4, 32)) ** 16  # one expert, by all 16 rows
    both = (Fraction(28 * 27, 32 * 31)) ** 16  # two given experts, by all 16 rows
    distinct = 32 * (1 - float(missed))
    variance = float(32 * missed * (1 - missed) + 32 * 31 * (both - missed**2))
    assert round(distinct, 1) == 28.2
    assert abs(28.23 - distinct) < 4 * math.sqrt(variance / 2000)
    read, twin = distinct * 393_216 * 4, 1_572_864 * 4
    assert round(read / 1e6, 1) == 44.4
    assert LOOP_MIN_ROWS_PER_EXPERT == 3 and 16 * 4 // 32 == 2
    assert not use_loop("auto", 16 * 4, 32) and not use_loop("auto", 23 * 4, 32)
    assert use_loop("auto", 24 * 4, 32) and use_loop("auto", 96, 32)
    assert_states("moe", "1 − 4/32 = 7/8", f"(7/8)¹⁶ = {float(missed):.3f}",
                  f"32 × (1 − 0.118) ≈ {distinct:.1f} of 32",
                  f"28.2 × 393,216 × 4 B ≈ {read / 1e6:.1f} MB",
                  f"1,572,864 × 4 B ≈ {twin / 1e6:.1f} MB: {distinct / 4:.1f} × fewer",
                  "16 × 4 / 32 = 2 < LOOP_MIN_ROWS_PER_EXPERT = 3",
                  "the loop from 24 rows: 96 assignments",
                  "over 2,000 draws picks 28.23 distinct experts on average",
                  '`use_loop("auto", 64, 32)` is False where `use_loop("auto", 96, 32)` is True')


# ------------------------------------------------------------------------ tensor parallel


def test_tensor_parallel_sizes_and_shards(smollm_config):
    """SmolLM2 splits over 1 or 3 ranks, Qwen3-32B over 1, 2, 4 or 8, the benchmark's model
    over 1, 2, 3 or 6; ``shard_linear`` as rank 1 of 3 leaves each projection the answer's
    shape, a third of the layer's 3,538,944 weights; ``local_config`` holds 3 heads, 1 KV
    head and an MLP of 512."""
    smol = smollm_config
    assert valid_sizes(smol) == [1, 3]
    assert valid_sizes(ModelConfig.from_hf(QWEN3_32B)) == [1, 2, 4, 8]
    measured = ModelConfig.from_hf(bench("bench_tensor_parallel").MODEL)
    assert (measured.num_attention_heads, measured.num_key_value_heads) == (12, 6)
    assert valid_sizes(measured) == [1, 2, 3, 6]
    with pytest.raises(ValueError, match="9 attention heads, 3 KV heads and an MLP of 1536"):
        check_tensor_parallel(smol, 2)
    local = local_config(smol, 3)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) \
        == (3, 1, 512)
    h, kv, mlp = smol.hidden_size, smol.num_key_value_heads * smol.head_dim, smol.intermediate_size
    projections = {  # name: (input, output features, split, shard's shape)
        "q_proj": (h, h, "column", (192, 576)), "k_proj": (h, kv, "column", (64, 576)),
        "v_proj": (h, kv, "column", (64, 576)), "o_proj": (h, h, "row", (576, 192)),
        "gate_proj": (h, mlp, "column", (512, 576)), "up_proj": (h, mlp, "column", (512, 576)),
        "down_proj": (mlp, h, "row", (576, 512))}
    whole = per_rank = 0
    for name, (fan_in, fan_out, split, shard) in projections.items():
        layer = nn.Linear(fan_in, fan_out, bias=False)
        whole += layer.weight.size
        shard_linear(layer, split, 1, 3)
        assert layer.weight.shape == shard, name
        per_rank += layer.weight.size
    assert (whole, per_rank) == (3_538_944, 1_179_648) and 3 * per_rank == whole
    assert_states("tensor-parallel", "gcd(9, 3, 1536) = 3 → 1 or 3 ranks",
                  "q_proj [576, 576] → [192, 576]", "k_proj [192, 576] → [64, 576]",
                  "o_proj [576, 576] → [576, 192]", "gate_proj, up_proj [1536, 576] → [512, 576]",
                  "down_proj [576, 1536] → [576, 512]",
                  f"a layer: {whole:,} weights, {per_rank:,} per rank: a third",
                  "gcd(64, 8, 25600) = 8 → 1, 2, 4 or 8 ranks",
                  "`valid_sizes(config)` returns `[1, 3]` for SmolLM2-135M's config and "
                  "`[1, 2, 4, 8]` for Qwen3-32B's", "`valid_sizes` gives `[1, 2, 3, 6]`")


def test_tensor_parallel_bytes_received_per_decode_step():
    """A decode step's 60 all-reduces of 576 floats: each rank receives 138,240 bytes over 2
    ranks and 276,480 over 3 (8 times that for 8 requests), as the benchmark's table 1 counts
    them; a ring all_sum would receive 138,240 and 184,320."""
    tp = bench("bench_tensor_parallel")
    hidden, layers = tp.MODEL["hidden_size"], tp.MODEL["num_hidden_layers"]
    assert (hidden, layers) == (576, 30)
    row = hidden * 4
    ours = {(n, b): 2 * layers * (n - 1) * b * row for n in (2, 3) for b in (1, 8)}
    ring = {n: 2 * layers * 2 * (n - 1) / n * row for n in (2, 3)}
    assert ours == {(2, 1): 138_240, (2, 8): 1_105_920, (3, 1): 276_480, (3, 8): 2_211_840}
    assert ring == {2: 138_240, 3: 184_320} and ours[3, 1] / ring[3] == 1.5
    # The table's column, on made-up timings (every step 1 s): its bytes are arithmetic.
    sizes = {size for _, size in tp.CONFIGS}
    rounds = [{**{key: {"steps": {"1": 1.0, "8": 1.0}, "tokens": []} for key in tp.CONFIGS},
               **{("mlx_lm", size): {"step": 1.0, "tokens": []} for size in sizes}}]
    table = tp.measured_table(rounds, hidden, layers)
    col = {name: table.headers.index(name) for name in ("ranks", "batch", "KB received per rank")}
    received = {(r[col["ranks"]], r[col["batch"]]): r[col["KB received per rank"]] * 1e3
                for r in table.rows if r[col["ranks"]] > 1}
    assert received == pytest.approx(ours)
    assert_states("tensor-parallel", f"576 floats × 4 B = {row:,} B",
                  "2 all-reduces × 30 layers = 60",
                  f"2 ranks: {ours[2, 1]:,} B ≈ {ours[2, 1] / 1e3:.0f} KB (8 requests: "
                  f"{ours[2, 8]:,} B ≈ {ours[2, 8] / 1e3:,.0f} KB)",
                  f"3 ranks: {ours[3, 1]:,} B ≈ {ours[3, 1] / 1e3:.0f} KB (8 requests: "
                  f"{ours[3, 8]:,} B ≈ {ours[3, 8] / 1e3:,.0f} KB)",
                  f"2 ranks: {ring[2]:,.0f} B: the same",
                  f"3 ranks: {ring[3]:,.0f} B: ours receive {ours[3, 1] / ring[3]:g} × as many",
                  f"2,304 and {2 * row:,} bytes from the other ranks, 138,240 and 276,480 for "
                  "the step's 60")


# ------------------------------------------------------------------------ serving


def test_serving_mask_words_and_bits(smollm_tokenizer):
    """A 49,152-token row's mask is 1,536 words (6,144 bytes); token 12,345 is bit 25 of word
    385, and ``Constraint.allowed`` over a mask with that bit alone allows it alone. 32 rows
    take 192 KiB of words and 1.5 MiB of bools. llguidance's bitmask has one word more
    (6,148 bytes), and the choice ``["yes", "no"]`` allows 5 first tokens."""
    vocab, token = 49_152, 12_345
    words = vocab // 32
    word, bit = divmod(token, 32)
    assert (words, words * 4, word, bit) == (1_536, 6_144, 385, 25)

    class OneBit:  # a matcher whose mask sets bit 25 of word 385, little-endian words
        def compute_bitmask(self) -> bytes:
            mask = np.zeros(words, dtype="<u4")
            mask[word] = np.uint32(1) << np.uint32(bit)
            return mask.tobytes()

    allowed = Constraint(OneBit(), vocab).allowed()
    assert np.flatnonzero(allowed).tolist() == [token]
    byte, bit_in_byte = word * 4 + bit // 8, bit % 8
    assert (byte, bit_in_byte) == (1_543, 1)
    assert np.frombuffer(OneBit().compute_bitmask(), np.uint8)[byte] == 1 << bit_in_byte
    row = constrained(np.zeros(vocab, np.float32), Constraint(OneBit(), vocab))
    assert np.flatnonzero(np.isfinite(row)).tolist() == [token]
    assert (32 * words * 4, 32 * allowed.nbytes) == (192 * 1024, int(1.5 * MiB))
    choice = Grammars(smollm_tokenizer, vocab).constraint(StructuredOutput(choice=["yes", "no"]))
    assert len(choice.matcher.compute_bitmask()) == 6_148
    first = [smollm_tokenizer.decode([int(t)]) for t in np.flatnonzero(choice.allowed())]
    assert sorted(first) == sorted(["n", "y", "no", "ye", "yes"])
    assert_states("serving", f"49,152 / 32 = {words:,} words = {words * 4:,} bytes",
                  f"word 12,345 // 32 = {word}, bit 12,345 % 32 = {bit}",
                  f"byte 385 × 4 + 25 // 8 = {byte:,}, its bit 25 % 8 = {bit_in_byte}",
                  "32 × 6,144 B = 196,608 B = 192 KiB of words",
                  "32 × 49,152 B = 1.5 MiB of bools", f"32 × 49,152 = {32 * vocab:,} iterations",
                  "returns 6,148 bytes", "it allows 5 first tokens: `n`, `y`, `no`, `ye`, `yes`")


def test_serving_n_samples_share_the_prompts_pages(tiny_model, smollm_tokenizer):
    """``n=4`` samples of a 300-token prompt, pages of 16, prefix caching on: the engine
    computes 336 prompt tokens (300, then 12 for each other sample), 864 of the 1,200 come
    from the prefix cache, and ``usage`` reports the prompt once with the first sample's 0
    cached tokens."""
    engine = LLMEngine(tiny_model, smollm_tokenizer, max_model_len=1024, max_num_seqs=8)
    prompt = list(range(1000, 1300))
    params = SamplingParams(n=4, max_tokens=2, temperature=0.8, seed=1, ignore_eos=True)
    ids = engine.add_samples({"prompt_token_ids": prompt}, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    outs = [finals[i] for i in ids]
    stats = engine.stats()
    assert (stats["num_prompt_tokens_computed"], stats["prefix_cache_query_tokens"],
            stats["prefix_cache_hit_tokens"]) == (336, 1_200, 864)
    assert [o.num_cached_tokens for o in outs] == [0, 288, 288, 288]
    usage = Server.usage(None, outs, len(prompt))  # it reads nothing of the server
    assert (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]) == (300, 0)
    assert_states("serving", "300 // 16 = 18 pages = 288 tokens",
                  "300 − 288 = 12 tokens each",
                  "300 + 3 × 12 = 336 prompt tokens, not 4 × 300 = 1,200",
                  "3 × 288 = 864 tokens", "prompt_tokens 300 (once), cached_tokens 0",
                  "`num_prompt_tokens_computed` 336, `prefix_cache_query_tokens` 1,200 and "
                  "`prefix_cache_hit_tokens` 864", "`num_cached_tokens` 0, 288, 288 and 288")


# ------------------------------------------------------------------------ the model


def test_model_parameter_count_of_smollm2(smollm_config):
    """SmolLM2-135M built from its config has 134,515,008 parameters: 28,311,552 in the
    (tied) embedding, 3,540,096 a layer; 538,060,032 bytes in float32, 21% of it the
    embedding."""
    c = smollm_config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.intermediate_size, c.vocab_size, c.tie_word_embeddings) \
        == (576, 30, 9, 3, 64, 1536, 49152, True)
    model = Model(c)
    embedding, layer = count(model, "model.embed_tokens."), count(model, "model.layers.0.")
    total = count(model)
    assert (embedding, layer, total) == (28_311_552, 3_540_096, 134_515_008)
    attention, mlp = count(model, "model.layers.0.self_attn."), count(model, "model.layers.0.mlp.")
    assert (attention, mlp) == (884_736, 2_654_208)
    assert not any(k.startswith("lm_head") for k, _ in tree_flatten(model.parameters()))  # tied
    assert_states("model", f"49,152 × 576 = {embedding:,}", f"= {attention:,}", f"= {mlp:,}",
                  f"2 × 576 = {layer - attention - mlp:,}", f"a layer: {layer:,}",
                  f"30 layers: {30 * layer:,}", f"final norm: {c.hidden_size}",
                  f"total: {total:,} ≈ {total / 1e6:.1f} M",
                  f"× 4 B = {4 * total:,} B ≈ {4 * total / 1e6:.0f} MB a token, "
                  f"{embedding / total:.0%} of it the embedding",
                  f"give {total:,} ({embedding:,} under `embed_tokens`, {layer:,} under "
                  "`model.layers.0`)")


def test_model_rope_angles_at_position_812(smollm_config):
    """``RoPE(config)`` at position 812 turns pairs 0, 16 and 31 by 812 rad (1.4691 past 129
    turns), 2.5678 and 0.011636 rad; its ``inv_freq`` is 1, 3.162e-3 and 1.433e-5 there,
    and pair 31 takes about 438,000 positions to turn once."""
    c = smollm_config
    assert (c.head_dim, c.rope_theta, c.rope_traditional) == (64, 100_000.0, False)
    rope = RoPE(c)
    pairs = (0, 16, 31)
    x = np.zeros((3, 1, 64), np.float32)
    for row, i in enumerate(pairs):
        x[row, 0, i] = 1.0
    y = np.array(rope(mx.array(x), mx.array([812] * 3)))
    inv = np.array(rope.inv_freq)
    exact = [812 * c.rope_theta ** (-2 * i / 64) for i in pairs]
    for row, i in enumerate(pairs):
        angle = math.atan2(y[row, 0, i + 32], y[row, 0, i]) % math.tau
        assert angle == pytest.approx(exact[row] % math.tau, abs=1e-4), i
        assert inv[i] == pytest.approx(c.rope_theta ** (-2 * i / 64), rel=1e-5), i
    turn = math.tau / inv[31]
    assert exact[0] // math.tau == 129 and round(turn, -3) == 438_000
    assert c.max_position_embeddings == 8192 < turn

    def sci(v: float) -> str:
        return f"{v:.3e}".replace("e-0", "e-")

    assert_states("model", f"812 rad = 129 turns + {exact[0] % math.tau:.3f} rad",
                  f"812 × 100,000^(−16/32) = 812 × {inv[16]:.6f} = {exact[1]:.3f} rad",
                  f"812 × 100,000^(−31/32) = 812 × {sci(inv[31])} = {exact[2]:.5f} rad",
                  f"2π / 1.433e-5 ≈ {round(turn, -3):,.0f} positions (the context is 8,192)",
                  f"1.4691, {exact[1]:.4f} and {exact[2]:.6f} rad",
                  f"holds 1, {sci(inv[16])} and {sci(inv[31])} for the three pairs")
