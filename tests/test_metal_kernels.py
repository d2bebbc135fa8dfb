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
  read; float, half and bfloat; the largest geometries the launcher accepts; the rows of
  token trees, which see their ancestors only), through
  both plans: ``tiled=False`` (Day 4, the vector schedule for every row) and
  ``tiled=True`` (Day 5, vector rows + tiled multi-token queries);
* the geometry rule, one for host and kernel (``check_metal_geometry``), whose largest
  geometries are cases here and kernels that ``make metal-check`` compiles;
* the MSL-subset lint on every .metal file and on the generated kernel sources;
* planted bugs in the kernel source (one-line mutations of the plan's header), and in
  the host side (the plan's grid, params, padding, template arguments, threadgroup), each
  caught in the way expected;
* the same cases on the GPU, the thread limit of the largest geometries' pipelines, and a
  GPU end-to-end run (skipped where Metal is missing; where the GPU lacks a feature a
  plan's kernel needs, its tests say which, found by a probe kernel).
"""

from __future__ import annotations

import functools
import math
import os
import re
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
from tiny_llm.course import learner  # noqa: E402
from tiny_llm.step.batch import TreeRows  # noqa: E402
from tiny_llm.testing.paged import float64_reference, make_paged_case, tree_rows  # noqa: E402

from metal_check import largest_geometries  # noqa: E402
from metal_check import sources as metal_check_sources  # noqa: E402
from metal_emulator import (  # noqa: E402
    DEFAULT_SCHEDULES,
    MetalRunError,
    Sparse,
    bfloat16_to_float32,
    kernel_source,
    lint_metal,
    lint_source,
    mlx_printed_source,
    pipeline_thread_limit,
    run_on_metal,
    run_plan,
)
from metal_emulator.mlx_jit import type_string  # noqa: E402

# The kernels under test: the learner's copy in course mode (tiny_llm.course.learner), else src/.
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


DTYPES = {"float": "float32", "half": "float16", "bfloat": "bfloat16"}  # a case's -> MLX's


def mx_dtype(name: str) -> Any:
    import mlx.core as mx

    return getattr(mx, DTYPES[name])


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
    tree: tuple[int, ...] = ()  # the last sequence's last rows verify drafts with these parents

    @property
    def n_heads(self) -> int:
        return self.n_kv_heads * self.group

    @property
    def num_rows(self) -> int:
        return sum(q for _, q in self.seqs)

    @property
    def mx_dtype(self) -> Any:
        return mx_dtype(self.dtype)

    def __str__(self) -> str:
        return self.name


# The tree of tests/test_token_trees.py: [(0,), (1,), (2,), (0, 0), (1, 0), (1, 1), (2, 0),
# (1, 0, 0), (2, 0, 0)], as each draft's parent.
TREE_PARENTS = (-1, -1, -1, 0, 1, 1, 2, 4, 6)

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
    # The largest geometries the launcher accepts (test_the_largest_accepted_geometries_are
    # _cases), in every dtype. head_dim 256 with a group of 13 (32,576 of 32,768 bytes of
    # threadgroup memory): 32 simdgroup matrices of Q and 32 of O per tiled thread, 8 lanes'
    # worth of each head per vector thread; a decode of 9 pages (simdgroup 0 walks two),
    # 5 query rows in tiles of 4. A group of 64 at head_dim 80 (31,744 bytes): 64 softmax
    # states per vector thread, tiles of one row.
    MetalCase("largest_head_dim_f32_256_gqa13", "float", 256, 13, 2, 8,
              ((1, 1), (70, 1), (12, 5)), seed=20),
    MetalCase("largest_head_dim_f16_256_gqa13", "half", 256, 13, 2, 8,
              ((1, 1), (70, 1), (12, 5)), seed=21),
    MetalCase("largest_head_dim_bf16_256_gqa13", "bfloat", 256, 13, 2, 8,
              ((1, 1), (70, 1), (12, 5)), seed=22),
    MetalCase("largest_group_f32_gqa64_80", "float", 80, 64, 2, 8, ((9, 1), (10, 3)), seed=23),
    MetalCase("largest_group_f16_gqa64_80", "half", 80, 64, 2, 8, ((9, 1), (10, 3)), seed=24),
    MetalCase("largest_group_bf16_gqa64_80", "bfloat", 80, 64, 2, 8, ((9, 1), (10, 3)), seed=25),
    # Token trees (speculative decoding): the last sequence's last rows are drafts that see
    # their ancestors only. Nine drafts (simdgroup 0 folds drafts 0 and 8) over a page
    # boundary, beside a decode and a prefill chunk that the tiled schedule takes; a tree
    # row inside a query tile, whose output is its vector threadgroup's alone.
    MetalCase("tree_f32_gqa3", "float", 64, 3, 2, 8, ((17, 1), (40, 12), (30, 10)), seed=30,
              tree=TREE_PARENTS),
    MetalCase("tree_f16_9q3kv", "half", 64, 3, 3, 16, ((70, 1), (24, 24), (90, 8)), seed=31,
              tree=(-1, -1, 0, 1, 1, 4, 2)),
    MetalCase("tree_bf16_16q8kv", "bfloat", 128, 2, 8, 16, ((19, 5), (40, 4)), seed=32,
              tree=(-1, 0, 0)),
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
    tree: TreeRows | None = None  # the rows of the case's tree of drafts


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
    tree = tree_rows(paged, case.tree)
    return PagedInputs(*arrays, paged.scale, float64_reference(paged, tree), tree)


# ------------------------------------------------------------- launch plans

PLANS = {"vector": False, "flash": True}  # plan name -> the op's `tiled` argument


def extension():
    from tiny_llm.kernels.extension import extension as load

    return load()


def mx_inputs(case: MetalCase) -> list:
    import mlx.core as mx

    x = inputs(case)
    q, k, v = (mx.array(a).astype(case.mx_dtype) for a in (x.q, x.k_pages, x.v_pages))
    return [q, k, v] + [mx.array(a) for a in (x.block_table, x.context_lens, x.query_start_loc)]


def tree_inputs(case: MetalCase) -> dict[str, Any]:
    """The op's tree arguments for ``case`` (none for a causal case)."""
    tree = inputs(case).tree
    if tree is None:
        return {}
    tree_start, tree_mask = tree.arrays
    return {"tree_start": tree_start, "tree_mask": tree_mask}


def plan_for(case: MetalCase, plan: str) -> dict[str, Any]:
    """The launch the extension would hand to MLX's JIT for this case."""
    return extension().metal_launch_plan(*mx_inputs(case), inputs(case).scale, tiled=PLANS[plan],
                                         **tree_inputs(case))


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


def test_the_largest_accepted_geometries_are_cases() -> None:
    # The launcher accepts only what the emulator has run: the corners of what
    # check_metal_geometry accepts (the largest head_dim with its largest group, the largest
    # group with its largest head_dim), in every dtype, are cases, so both plans run them
    # (and on a Mac the GPU tests below). Raising a limit fails here until a case runs it.
    cases = {(c.dtype, c.head_dim, c.group) for c in CASES}
    largest = {(dtype, head_dim, group) for dtype in DTYPES
               for _, head_dim, group in largest_geometries(mx_dtype(dtype))}
    assert len(largest) == 2 * len(DTYPES)
    assert largest - cases == set()


def test_metal_check_compiles_the_largest_accepted_geometries() -> None:
    # make metal-check compiles, with Apple's compiler, the kernels of those corners too.
    emitted = metal_check_sources()
    for dtype in DTYPES:
        for name, head_dim, group in largest_geometries(mx_dtype(dtype)):
            for plan in PLANS:
                text = emitted[f"{name}-{DTYPES[dtype]}-{plan}.metal"]
                assert f"<{type_string(mx_dtype(dtype))}, {head_dim}, {group}>" in text


# -------------------------------------------------------------------- lint


@pytest.mark.task("4.4", "5.4")  # the Metal tasks' code, whichever the learner is on
@pytest.mark.parametrize(  # pure Python: runs on a Mac too
    "path", sorted(METAL_DIR.glob("*.metal")), ids=lambda p: p.name
)
def test_lint_passes(path: Path) -> None:
    assert lint_metal(path) == []


@pytest.mark.parametrize("plan", [pytest.param(p, marks=pytest.mark.task(*PLAN_TASKS[p]))
                                  for p in PLANS])
@pytest.mark.parametrize("name", ["smollm2_f16_9q3kv", "tree_f16_9q3kv"])
def test_lint_passes_on_the_generated_kernels(plan: str, name: str) -> None:
    _, text = kernel_source(plan_for(CASE_BY_NAME[name], plan))
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


@dataclass(frozen=True)
class Probe:
    """A kernel of a few lines that needs one Metal feature, and the output it must give:
    whether a GPU runs the feature is found by running it, since a virtual GPU (GitHub's
    macOS runners' "Apple Paravirtual device") may lack a feature or misreport its family."""

    feature: str  # what a skip names
    source: str  # the kernel body (mx.fast.metal_kernel's `source`)
    inputs: tuple[tuple[str, np.ndarray], ...]
    expected: np.ndarray

    def plan(self, name: str) -> dict[str, Any]:
        """A launch plan of one simdgroup, as metal_launch_plan returns them."""
        import mlx.core as mx

        return {
            "name": f"tiny_llm_probe_{name}", "input_names": [n for n, _ in self.inputs],
            "output_names": ["out"], "source": self.source,
            "header": "#include <metal_stdlib>\nusing namespace metal;\n",
            "ensure_row_contiguous": True, "atomic_outputs": False,
            "inputs": [mx.array(a) for _, a in self.inputs],
            "output_shapes": [self.expected.shape], "output_dtypes": [mx.float32],
            "grid": (32, 1, 1), "threadgroup": (32, 1, 1), "template_args": [],
        }  # fmt: skip


_LANES = np.arange(1, 33, dtype=np.float32) / 8  # sums exactly, in any order
_A = (np.arange(64) % 5 - 2).reshape(8, 8).astype(np.float32)  # small integers: exact
_B = (np.arange(64)[::-1] % 7 - 3).reshape(8, 8).astype(np.float32)

# The two features of the kernels beyond Metal's core, both of the Apple7 GPU family (A14,
# M1) and later: the vector schedule's dot products are simd_sum reductions, the tiled
# schedule's tiles are simdgroup_matrix products.
PROBES = {
    "simd_sum": Probe(
        "simd_sum (SIMD-scoped reductions, Apple7 GPU family and later)",
        "  const float total = simd_sum(x[thread_index_in_simdgroup]);\n"
        "  if (thread_index_in_simdgroup == 0) {\n"
        "    out[0] = total;\n"
        "  }\n",
        (("x", _LANES),), np.array([_LANES.sum()], np.float32)),
    "simdgroup_matrix": Probe(
        "simdgroup_matrix (SIMD-scoped matrix multiplies, Apple7 GPU family and later)",
        "  simdgroup_matrix<float, 8, 8> a_tile;\n"
        "  simdgroup_matrix<float, 8, 8> b_tile;\n"
        "  simdgroup_matrix<float, 8, 8> product;\n"
        "  simdgroup_load(a_tile, a, 8);\n"
        "  simdgroup_load(b_tile, b, 8);\n"
        "  simdgroup_multiply(product, a_tile, b_tile);\n"
        "  simdgroup_store(product, out, 8);\n",
        (("a", _A), ("b", _B)), _A @ _B),
}  # fmt: skip
PLAN_FEATURES = {"vector": ("simd_sum",), "flash": ("simd_sum", "simdgroup_matrix")}


def gpu_name() -> str:
    import mlx.core as mx

    info = mx.device_info()
    return f"{info['device_name']} (architecture {info['architecture']})"


@functools.cache
def missing_feature(feature: str) -> str | None:
    """Why this GPU does not run ``feature`` (its probe's error or wrong output), or None."""
    probe = PROBES[feature]
    try:
        (got,) = run_on_metal(probe.plan(feature))
    except MetalRunError as error:
        return f"{probe.feature} does not run on {gpu_name()}: {error}"
    if not np.array_equal(got, probe.expected):
        return (f"{probe.feature} computes wrong values on {gpu_name()}: "
                f"{got.ravel()[:4].tolist()}... for {probe.expected.ravel()[:4].tolist()}...")
    return None


def require_features(plan: str) -> None:
    """Skip, naming the feature and the GPU, where this GPU lacks one that the plan's
    kernel needs."""
    for feature in PLAN_FEATURES[plan]:
        why = missing_feature(feature)
        if why is not None:
            pytest.skip(why)


@needs_emulator
@pytest.mark.parametrize("feature", PROBES)
def test_each_probe_computes_its_expected_output(feature: str) -> None:
    # A probe that fails on a GPU must mean the GPU, not the probe: each runs here, as MLX
    # would build it, and gives the output a GPU must give.
    plan = PROBES[feature].plan(feature)
    assert lint_source(kernel_source(plan)[1], "probe.metal") == []
    got = run_plan(plan, METAL_DIR / f"probe_{feature}.metal")["out"]
    np.testing.assert_array_equal(got, PROBES[feature].expected)


@pytest.mark.parametrize("failure", ["refused", "zeros"])
def test_a_gpu_without_a_feature_skips_the_plans_that_need_it(monkeypatch, failure) -> None:
    # The capability check as a virtual GPU may meet it, faked: simdgroup matrices refused
    # (the pipeline does not build) or computing zeros. The vector plan's tests still run;
    # the tiled plan's are skipped, naming the feature and the GPU.
    import mlx.core as mx

    def run(plan: dict) -> list[np.ndarray]:
        if "simdgroup_multiply" not in plan["source"]:
            return [PROBES["simd_sum"].expected]
        if failure == "refused":
            raise MetalRunError("RuntimeError: [metal::Device] Unable to build compute pipeline")
        return [np.zeros(plan["output_shapes"][0], np.float32)]

    monkeypatch.setitem(globals(), "run_on_metal", run)
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "Apple Paravirtual device",
                                                    "architecture": "paravirtual"})
    missing_feature.cache_clear()
    try:
        require_features("vector")
        with pytest.raises(pytest.skip.Exception) as skipped:
            require_features("flash")
    finally:
        missing_feature.cache_clear()
    why = str(skipped.value)
    assert why.startswith("simdgroup_matrix (SIMD-scoped matrix multiplies, Apple7")
    assert "Apple Paravirtual device (architecture paravirtual)" in why
    assert ("Unable to build" if failure == "refused" else "wrong values") in why


@needs_gpu
def test_an_apple7_gpu_runs_every_probe() -> None:
    # The probes may skip kernel tests on a virtual GPU, never on a real Apple GPU of the
    # kernels' family (MLX names it applegpu_g13 for M1 and A14, higher after).
    import mlx.core as mx

    architecture = str(mx.device_info()["architecture"])
    generation = re.fullmatch(r"applegpu_g(\d+)[a-z]*", architecture)
    if generation is None or int(generation.group(1)) < 13:
        pytest.skip(f"{gpu_name()} is not named as an Apple7 GPU or later: the probes decide")
    assert {f: missing_feature(f) for f in PROBES} == dict.fromkeys(PROBES)


@needs_gpu
@pytest.mark.parametrize("plan,case", PLAN_CASES)
def test_extension_on_gpu_matches_numpy(plan: str, case: MetalCase) -> None:
    from tiny_llm.day4_paged_attention import paged_attention

    import mlx.core as mx

    require_features(plan)
    x = inputs(case)
    with mx.stream(mx.gpu):
        out = paged_attention(*mx_inputs(case), x.scale, tiled=PLANS[plan], tree=x.tree)
        got = np.array(out.astype(mx.float32)).astype(np.float64)
    # Metal's exp and sums round differently from numpy's.
    tol = {"float": 1e-4, "half": 4e-3, "bfloat": 2e-2}[case.dtype]
    np.testing.assert_allclose(got, x.ref, atol=tol, rtol=tol)


LARGEST_PLAN_CASES = [p for p in PLAN_CASES if p.values[1].name.startswith("largest_")]


@needs_gpu
@pytest.mark.parametrize("plan,case", LARGEST_PLAN_CASES)
def test_the_largest_geometries_pipelines_take_their_threadgroup(
    plan: str, case: MetalCase
) -> None:
    # A pipeline's thread limit depends on the registers its kernel uses, and only the GPU
    # knows it. The launcher's threadgroups (256 threads) must fit the pipelines of its
    # largest geometries, which hold the most state per thread. (MLX refuses a larger
    # threadgroup than a pipeline takes, before dispatching it; pipeline_thread_limit reads
    # the limit it names.)
    require_features(plan)
    launch = plan_for(case, plan)
    assert pipeline_thread_limit(launch) >= math.prod(launch["threadgroup"])


@needs_gpu
def test_default_model_on_gpu_generates_the_cpu_tokens() -> None:
    # The default model, float32 weights, a batch of greedy requests: the GPU engine's
    # tokens equal the CPU engine's. (float32 everywhere keeps rounding far below the
    # gaps between the top logits of these prompts; a flip would show as a mismatch.)
    from tiny_llm import LLMEngine, SamplingParams
    from tiny_llm.models.loader import load

    import mlx.core as mx

    for plan in PLANS:
        require_features(plan)
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
