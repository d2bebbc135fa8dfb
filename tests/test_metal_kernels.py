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

import tiny_llm  # noqa: E402, F401  (before mlx: it sets up MLX's CPU BLAS)
from tiny_llm import learner  # noqa: E402
from tiny_llm.testing.paged import float64_reference, make_paged_case  # noqa: E402

from metal_emulator import (  # noqa: E402
    DEFAULT_SCHEDULES,
    Sparse,
    bfloat16_to_float32,
    kernel_source,
    lint_metal,
    lint_source,
    mlx_printed_source,
    run_plan,
)

# The kernels under test: the learner's copy in course mode (tiny_llm.learner), else src/.
_WORKSPACE = learner.workspace()
METAL_DIR = (_WORKSPACE / "extensions" / "metal"
             if _WORKSPACE is not None and (_WORKSPACE / "extensions").is_dir()
             else REPO / "src" / "extensions" / "metal")
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
class MetalCase:
    """One ragged batch: ``seqs`` is a list of (context_len, query_len)."""

    name: str
    dtype: str  # "float" | "half" | "bfloat"
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
    def mx_dtype(self) -> Any:
        import mlx.core as mx

        return {"float": mx.float32, "half": mx.float16, "bfloat": mx.bfloat16}[self.dtype]

    def __str__(self) -> str:
        return self.name


CASES = [
    # context 1, page-1, page, page+1 and 8 pages (every simdgroup owns one).
    MetalCase("ragged_decode_f32_gqa3", "float", 64, 3, 2, 8,
              ((1, 1), (7, 1), (8, 1), (9, 1), (61, 1))),
    # 13 and 10 pages: simdgroups 0..4 walk two pages each (j += 8 wraps).
    MetalCase("many_pages_f32_gqa4", "float", 128, 4, 1, 8, ((100, 1), (73, 1), (3, 1)), seed=1),
    # Multi-query rows (causal offset) mixed with single-query rows; a full prefill.
    MetalCase("mixed_prefill_f32_gqa8", "float", 96, 8, 1, 8,
              ((23, 5), (1, 1), (17, 17), (40, 3)), seed=2),
    # Query tiles of 21 rows (64 // 3 pairs): the 30-row chunk spans two tiles.
    MetalCase("prefill_f32_gqa3", "float", 64, 3, 2, 16, ((50, 30), (5, 1), (16, 16)), seed=6),
    MetalCase("ragged_f32_mha", "float", 64, 1, 4, 16, ((15, 1), (17, 1), (100, 2)), seed=3),
    MetalCase("ragged_f16_mha", "half", 64, 1, 2, 16, ((1, 1), (15, 1), (33, 4), (70, 1)), seed=4),
    MetalCase("mixed_f16_gqa4", "half", 128, 4, 2, 8, ((9, 2), (31, 1), (64, 6)), seed=5),
    # The default model (SmolLM2-135M): 9 query heads over 3 KV heads, head_dim 64, the
    # engine's page size; decodes and prefill chunks in one batch.
    MetalCase("smollm2_f32_9q3kv", "float", 64, 3, 3, 16,
              ((17, 1), (40, 23), (5, 1), (16, 16), (33, 1)), seed=7),
    MetalCase("smollm2_f16_9q3kv", "half", 64, 3, 3, 16, ((70, 1), (24, 24), (9, 2)), seed=8),
    # bfloat16, as a GPU loads bf16 checkpoints: the default model's geometry, and
    # Qwen3-0.6B's (16 query heads over 8 KV heads, head_dim 128).
    MetalCase("smollm2_bf16_9q3kv", "bfloat", 64, 3, 3, 16, ((33, 1), (24, 11), (9, 1)),
              seed=10),
    MetalCase("qwen3_0.6b_bf16_16q8kv", "bfloat", 128, 2, 8, 16, ((40, 1), (19, 5)), seed=11),
    # A group that does not divide the 64 pairs of a tile: 12 rows of 5 heads, 4 pairs idle.
    MetalCase("gqa5_f32", "float", 64, 5, 2, 8, ((30, 13), (8, 1), (12, 12)), seed=9),
]  # fmt: skip
CASE_BY_NAME = {c.name: c for c in CASES}

# atol = rtol, outputs are O(1): float32 summation order, or half an ulp of the output's
# rounding to the dtype (float16 2^-11, bfloat16 2^-8) with a margin.
TOLERANCE = {"float": 2e-5, "half": 2e-3, "bfloat": 1.6e-2}


@dataclass
class PagedInputs:
    """A case's arrays as numpy (what the emulator binds) and its float64 reference."""

    q: np.ndarray  # [T, Hq, D]
    k_pages: np.ndarray  # [P, page_size, Hkv, D]
    v_pages: np.ndarray
    block_table: np.ndarray  # int32 [B, max_pages], -1 where unused
    context_lens: np.ndarray  # int32 [B]
    query_start_loc: np.ndarray  # int32 [B + 1]
    scale: float
    ref: np.ndarray = field(repr=False)  # float64 [T, Hq, D]


def make_inputs(case: MetalCase) -> PagedInputs:
    """Shuffled pages, NaN in every slot and page no row may read (tiny_llm.testing.paged).
    bfloat16 arrays are kept as float32 (exactly: every value is a bfloat16)."""
    import mlx.core as mx

    paged = make_paged_case(list(case.seqs), dtype=case.mx_dtype, head_dim=case.head_dim,
                            page_size=case.page_size, group=case.group,
                            n_kv_heads=case.n_kv_heads, spare_pages=case.spare_pages,
                            seed=case.seed)
    arrays = [np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)
              for a in paged.args()[:6]]
    return PagedInputs(*arrays, paged.scale, float64_reference(paged))


# ------------------------------------------------------------- launch plans

PLANS = {"vector": False, "flash": True}  # plan name -> the op's `tiled` argument


def extension():
    from tiny_llm.extension import extension as load

    return load()


def mx_inputs(case: MetalCase) -> list:
    import mlx.core as mx

    x = inputs(case)
    q, k, v = (mx.array(a).astype(case.mx_dtype) for a in (x.q, x.k_pages, x.v_pages))
    return [q, k, v] + [mx.array(a) for a in (x.block_table, x.context_lens, x.query_start_loc)]


def plan_for(case: MetalCase, plan: str) -> dict[str, Any]:
    """The launch the extension would hand to MLX's JIT for this case."""
    return extension().metal_launch_plan(*mx_inputs(case), inputs(case).scale, tiled=PLANS[plan])


_inputs_cache: dict[str, PagedInputs] = {}


def inputs(case: MetalCase) -> PagedInputs:
    if case.name not in _inputs_cache:
        _inputs_cache[case.name] = make_inputs(case)
    return _inputs_cache[case.name]


def run_case(
    case: MetalCase, plan: str | dict[str, Any], schedule: str | None = None, **launch: Any
) -> np.ndarray:
    """Output of ``case`` (float64) under one schedule, or all DEFAULT_SCHEDULES
    bit-identical; ``plan`` is a plan name or a (mutated) plan."""
    launch_plan = plan_for(case, plan) if isinstance(plan, str) else plan
    schedules = DEFAULT_SCHEDULES if schedule is None else (schedule,)
    out = run_plan(launch_plan, PAGED, schedules=schedules, **launch)["out"]
    if case.dtype == "bfloat":
        out = bfloat16_to_float32(out)  # the emulator hands bfloat16 back as its bits
    return out.astype(np.float64)


def close_to_ref(got: np.ndarray, case: MetalCase) -> bool:
    tol = TOLERANCE[case.dtype]
    return bool(np.allclose(got, inputs(case).ref, atol=tol, rtol=tol))


# The vector plan runs Task 4.4's code; the flash plan runs Task 5.4's tiles (and 4.4's code for
# its vector rows: an earlier task, done by then). A task's tests pass once it and those
# before it are done.
PLAN_TASKS = {"vector": ("4.4",), "flash": ("5.4",)}
PLAN_CASES = [pytest.param(p, c, id=f"{p}-{c.name}", marks=pytest.mark.task(*PLAN_TASKS[p]))
              for p in PLANS for c in CASES]


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
def test_production_launch_matches_numpy_under_all_schedules(plan: str, case: MetalCase) -> None:
    assert len(DEFAULT_SCHEDULES) >= 4
    got = run_case(case, plan)
    tol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(got, inputs(case).ref, atol=tol, rtol=tol)


@needs_emulator
@pytest.mark.parametrize("plan", [pytest.param(p, marks=pytest.mark.task(*PLAN_TASKS[p]))
                                  for p in PLANS])
def test_a_pool_past_2_31_elements_is_addressed_in_64_bits(plan: str) -> None:
    # One layer's pool can hold more than 2**31 elements (a 4 GiB half pool: a large model
    # at a long context), so a kernel must compute pool offsets in 64 bits: an `int` offset
    # wraps (as it does on a GPU, and under the emulator's -fwrapv) and reads elsewhere. The
    # case's pages move past element 2**31 of pools the emulator maps without memory.
    import mlx.core as mx

    case = CASE_BY_NAME["smollm2_f16_9q3kv"]  # decodes and prefill chunks, 3 KV heads
    launch = plan_for(case, plan)
    arrays = dict(zip(launch["input_names"], launch["inputs"], strict=True))
    page_elems = case.page_size * case.n_kv_heads * case.head_dim
    first = 2**31 // page_elems + 1  # the case's page 0 moves here: past element 2**31
    for name in ("k_pages", "v_pages"):
        data = np.array(arrays[name])
        page_bytes = page_elems * data.itemsize
        arrays[name] = Sparse((first + data.shape[0]) * page_bytes, first * page_bytes, data)
    table = np.array(arrays["block_table"])
    arrays["block_table"] = mx.array(np.where(table >= 0, table + first, table))
    moved = {**launch, "inputs": list(arrays.values())}
    got = run_case(case, moved, "forward")
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


LIVE_CASES = ["smollm2_f32_9q3kv", "smollm2_f16_9q3kv", "qwen3_0.6b_bf16_16q8kv"]


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("name", LIVE_CASES)
def test_emulated_kernel_is_the_source_the_installed_mlx_writes(plan: str, name: str) -> None:
    # What a Mac's MLX compiles for this launch, printed by the installed MLX itself: the
    # emulator runs that very text (a new MLX that writes kernels differently fails here).
    launch = plan_for(CASE_BY_NAME[name], plan)
    assert kernel_source(launch)[1] == mlx_printed_source(launch)


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


@pytest.mark.task("4.4", "5.4")  # the Metal tasks' code, whichever the learner is on
@pytest.mark.parametrize(  # pure Python: runs on a Mac too
    "path", sorted(METAL_DIR.glob("*.metal")), ids=lambda p: p.name
)
def test_lint_passes(path: Path) -> None:
    assert lint_metal(path) == []


@pytest.mark.parametrize("plan", [pytest.param(p, marks=pytest.mark.task(*PLAN_TASKS[p]))
                                  for p in PLANS])
def test_lint_passes_on_the_generated_kernels(plan: str) -> None:
    _, text = kernel_source(plan_for(CASE_BY_NAME["smollm2_f16_9q3kv"], plan))
    assert lint_source(text, "generated.metal") == []


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
def test_extension_on_gpu_matches_numpy(plan: str, case: MetalCase) -> None:
    from tiny_llm.day4_paged_attention import paged_attention

    import mlx.core as mx

    x = inputs(case)
    with mx.stream(mx.gpu):
        out = paged_attention(*mx_inputs(case), x.scale, tiled=PLANS[plan])
        got = np.array(out.astype(mx.float32)).astype(np.float64)
    # Metal's exp and sums round differently from numpy's.
    tol = {"float": 1e-4, "half": 4e-3, "bfloat": 2e-2}[case.dtype]
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
