"""Tests of the Metal CPU emulator (tools/metal_emulator).

Three groups:

* example kernels vs numpy references, each under several thread schedules
  with bit-identical outputs required across schedules;
* the MSL-subset lint: clean on every .metal file under src/extensions/ and
  the emulator's examples (globbed, so new kernels are covered), and flags
  deliberately bad snippets;
* MLX's JIT wrapper (``mlx_jit``): the ``[[kernel]]`` source ``mx.fast.metal_kernel``
  writes around a body, character for character, and a run of it; what ``run_on_metal``
  brings back from MLX in a fresh interpreter, and the thread limit
  ``pipeline_thread_limit`` reads from MLX's refusal;
* planted bugs: one-line mutations of the example kernels, applied as string
  replacements, each caught in the specific way expected (an out-of-bounds or
  barrier report, a mismatch with the reference, or a difference between
  schedules), plus misuse kernels in tests/metal_cases/misuse.metal.

Adding a kernel file: put it in src/extensions/metal/ (the lint test picks it
up), compile it with ``compile_metal(path)``, and compare ``run_schedules(lib,
"host_name", {...buffers...}, groups=..., threadgroup=...)`` with a numpy
reference.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

from metal_emulator import (  # noqa: E402
    DEFAULT_SCHEDULES,
    BarrierError,
    EmulatorError,
    MetalCompileError,
    MetalLibrary,
    MetalRunError,
    MetalSourceError,
    Out,
    OutOfBoundsError,
    ScheduleMismatch,
    SimdError,
    bfloat16_to_float32,
    compile_metal,
    float32_to_bfloat16,
    kernel_source,
    lint_metal,
    lint_source,
    mlx_printed_source,
    pipeline_thread_limit,
    run_on_metal,
    run_plan,
    run_schedules,
)

pytestmark = [pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("g++") is None,
    reason="the Metal emulator needs Linux and g++ (on a Mac, test on the GPU instead)",
), pytest.mark.device_independent]

EXAMPLES = REPO / "tools" / "metal_emulator" / "examples"
CASES = Path(__file__).resolve().parent / "metal_cases"
LINTED_FILES = sorted([*(REPO / "src" / "extensions").rglob("*.metal"), *EXAMPLES.glob("*.metal")])


def example(name: str) -> MetalLibrary:
    """Compiled example kernel file (cached on disk and in the process)."""
    return compile_metal(EXAMPLES / name)


def mutated(name: str, old: str, new: str) -> MetalLibrary:
    """The example ``name`` with exactly one occurrence of ``old`` replaced by ``new``."""
    path = EXAMPLES / name
    text = path.read_text()
    assert text.count(old) == 1, f"mutation anchor not unique in {name}: {old!r}"
    return compile_metal(path, source=text.replace(old, new))


def line_containing(path: Path, needle: str, nth: int = 0) -> int:
    """1-based line number of the ``nth`` line of ``path`` containing ``needle``."""
    hits = [i + 1 for i, s in enumerate(path.read_text().splitlines()) if needle in s]
    return hits[nth]


# ------------------------------------------------------------------- cases


def reduce_case(n: int, per_group: int, dtype: type = np.float32, seed: int = 0):
    """Buffers and numpy references (sums, maxes) for block_reduce."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(dtype)
    groups = -(-n // per_group)
    xf = x.astype(np.float32)
    chunks = [xf[g * per_group : (g + 1) * per_group] for g in range(groups)]
    sums = np.array([c.sum() * 0.5 for c in chunks], np.float32)
    maxes = np.array([c.max() for c in chunks], np.float32)
    params = {"n": n, "per_group": per_group, "scale": 0.5}
    return {0: x, 1: Out(groups), 2: Out(groups), 3: params}, groups, sums, maxes


def decode_case(lens=(37, 5, 70, 16), hq=4, hkv=2, d=32, page_size=16, pages=20, max_pages=6):
    """Buffers and numpy reference for paged_decode: GQA, shuffled pages, -1 padding."""
    rng = np.random.default_rng(1)
    b = len(lens)
    q = rng.standard_normal((b, hq, d)).astype(np.float32)
    k = rng.standard_normal((pages, page_size, hkv, d)).astype(np.float32)
    v = rng.standard_normal((pages, page_size, hkv, d)).astype(np.float32)
    table = np.full((b, max_pages), -1, np.int32)
    free = list(rng.permutation(pages))
    for i, n in enumerate(lens):
        for j in range(-(-n // page_size)):
            table[i, j] = free.pop()
    scale = float(1 / np.sqrt(d))
    ref = np.zeros((b, hq, d), np.float32)
    for i, n in enumerate(lens):
        pos = np.arange(n)
        pg, slot = table[i, pos // page_size], pos % page_size
        for h in range(hq):
            kv = h // (hq // hkv)
            s = k[pg, slot, kv] @ q[i, h] * scale
            w = np.exp(s - s.max())
            ref[i, h] = (w / w.sum()) @ v[pg, slot, kv]
    bufs = {
        "q": q,
        "k_pages": k,
        "v_pages": v,
        "block_table": table,
        "context_lens": np.array(lens, np.int32),
        "out": Out(ref.shape),
        "p": {
            "num_heads": hq,
            "num_kv_heads": hkv,
            "max_pages": max_pages,
            "page_size": page_size,
            "scale": scale,
        },
    }
    return bufs, (hq, b), ref


def matmul_case(m=32, n=48, k=64, dtype: type = np.float32):
    """Buffers and numpy reference for tiled_matmul."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    ref = a.astype(np.float32) @ b.astype(np.float32)
    return {0: a, 1: b, 2: Out((m, n)), 3: {"M": m, "N": n, "K": k}}, (n // 16, m // 16), ref


# ------------------------------------------------------- kernels vs numpy


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_block_reduce_matches_numpy_under_all_schedules(dtype: type) -> None:
    bufs, groups, sums, maxes = reduce_case(1000, 300, dtype)
    name = "block_reduce_float" if dtype == np.float32 else "block_reduce_half"
    out = run_schedules(example("reduce.metal"), name, bufs, groups=groups, threadgroup=64)
    np.testing.assert_allclose(out["sums"], sums, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out["maxes"], maxes)


def test_partial_threadgroups_and_simdgroups() -> None:
    # dispatchThreads semantics: 200 threads in groups of 64 -> the last group
    # has 8 threads (one partial simdgroup); threads_per_threadgroup says so.
    bufs, groups, sums, maxes = reduce_case(1000, 250)
    out = run_schedules(
        example("reduce.metal"), "block_reduce_float", bufs, grid=200, threadgroup=64
    )
    np.testing.assert_allclose(out[1], sums, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[2], maxes)


def test_threadgroup_parameter_tree_sum() -> None:
    bufs, groups, sums, _ = reduce_case(1000, 300)
    bufs = {0: bufs[0], 1: Out(groups), 2: bufs[3]}
    out = run_schedules(
        example("reduce.metal"),
        "tree_sum",
        bufs,
        groups=groups,
        threadgroup=128,
        threadgroup_memory={0: 128 * 4},
    )
    np.testing.assert_allclose(out["sums"], sums, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float", "half", "bfloat"])
def test_paged_decode_matches_numpy_under_all_schedules(dtype: str) -> None:
    bufs, groups, ref = decode_case()
    tol = {"float": 1e-5, "half": 5e-3, "bfloat": 3e-2}[dtype]
    if dtype == "half":
        for key in ("q", "k_pages", "v_pages"):
            bufs[key] = bufs[key].astype(np.float16)
        bufs["out"] = Out(ref.shape, np.float16)
    elif dtype == "bfloat":
        for key in ("q", "k_pages", "v_pages"):
            bufs[key] = float32_to_bfloat16(bufs[key])
        bufs["out"] = Out(ref.shape, np.uint16)
    lib = example("paged_decode.metal")
    out = run_schedules(lib, f"paged_decode_{dtype}_32", bufs, groups=groups, threadgroup=32)["out"]
    got = bfloat16_to_float32(out) if dtype == "bfloat" else out.astype(np.float32)
    np.testing.assert_allclose(got, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_simdgroup_matrix_matmul_matches_numpy(dtype: type) -> None:
    bufs, groups, ref = matmul_case(dtype=dtype)
    name = "tiled_matmul_float" if dtype == np.float32 else "tiled_matmul_half"
    out = run_schedules(example("simd_matmul.metal"), name, bufs, groups=groups, threadgroup=64)
    np.testing.assert_allclose(out["C"], ref, rtol=1e-4, atol=1e-4)


def test_workers_and_ucontext_fallback_give_identical_bits() -> None:
    bufs, groups, ref = decode_case()
    lib = example("paged_decode.metal")
    base = lib.run("paged_decode_float_32", bufs, groups=groups, threadgroup=32)["out"]
    two = lib.run("paged_decode_float_32", bufs, groups=groups, threadgroup=32, workers=2)["out"]
    portable = compile_metal(EXAMPLES / "paged_decode.metal", context="ucontext")
    assert portable.context_switch == "ucontext"
    slow = portable.run("paged_decode_float_32", bufs, groups=groups, threadgroup=32)["out"]
    assert base.tobytes() == two.tobytes() == slow.tobytes()


def test_shim_conversions_vectors_shuffles_and_matrix_layout() -> None:
    lib = compile_metal(CASES / "shim_features.metal")
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(64) * 100).astype(np.float32)
    out = lib.run(
        "convert", {0: x, 1: Out(64, np.float16), 2: Out(64, np.uint16), 3: Out(64)}, grid=64
    )
    np.testing.assert_array_equal(out[1], x.astype(np.float16))
    np.testing.assert_array_equal(out[2], float32_to_bfloat16(x))
    np.testing.assert_array_equal(out[3], bfloat16_to_float32(out[2]) + out[1].astype(np.float32))

    a = rng.standard_normal((32, 4)).astype(np.float32)
    b = rng.standard_normal((32, 4)).astype(np.float32)
    out = lib.run("vectors", {0: a, 1: b, 2: Out(32), 3: Out((32, 4))}, grid=32)
    np.testing.assert_allclose(out[2], (a * b).sum(1), rtol=1e-6)
    w = a * 2 - b + np.array([1, 2, 3, 4], np.float32)
    w[:, 1] = np.maximum(w[:, 1], 0)
    np.testing.assert_array_equal(out[3], w)

    x = rng.standard_normal(64).astype(np.float32)
    outs = {i: Out(64) for i in range(1, 6)}
    out = run_schedules(lib, "shuffles", {0: x, **outs}, grid=64, threadgroup=64)
    lane = np.arange(64) % 32
    base = np.arange(64) - lane
    np.testing.assert_array_equal(
        out[1], x[np.where(lane + 3 < 32, np.arange(64) + 3, np.arange(64))]
    )
    np.testing.assert_array_equal(out[2], x[np.where(lane >= 5, np.arange(64) - 5, np.arange(64))])
    np.testing.assert_array_equal(out[3], x[base + (lane ^ 6)])
    for g in range(2):
        seg = x[32 * g : 32 * g + 32]
        np.testing.assert_allclose(
            out[5][32 * g : 32 * g + 32], np.cumsum(seg), rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            out[4][32 * g : 32 * g + 32], np.cumsum(seg) - seg, rtol=1e-5, atol=1e-6
        )

    m = np.arange(64, dtype=np.float32)  # element (r, c) = 8r + c
    out = lib.run("matrix_layout", {0: m, 1: Out(32), 2: Out(64)}, groups=1, threadgroup=32)
    lanes = np.arange(32)
    rows = ((lanes >> 4) & 1) * 4 + ((lanes >> 1) & 3)
    cols = ((lanes >> 3) & 1) * 4 + (lanes & 1) * 2
    np.testing.assert_array_equal(out[1], 8 * rows + cols)
    np.testing.assert_array_equal(out[2].reshape(8, 8), m.reshape(8, 8).T)


def test_position_attributes_with_partial_threadgroups() -> None:
    lib = compile_metal(CASES / "shim_features.metal")
    grid, tg = (10, 6, 2), (4, 4, 2)  # dispatchThreads: partial groups along x and y
    out = lib.run("positions", {0: Out((2, 6, 10, 16), np.uint32)}, grid=grid, threadgroup=tg)[0]
    z, y, x = np.meshgrid(np.arange(2), np.arange(6), np.arange(10), indexing="ij")
    size_x = np.minimum(4, 10 - (x // 4) * 4)  # size of each thread's (possibly partial) group
    size_y = np.minimum(4, 6 - (y // 4) * 4)
    lx, ly, lz = x % 4, y % 4, z
    idx = lx + ly * size_x + lz * size_x * size_y
    n_sg = (size_x * size_y * 2 + 31) // 32
    expect = np.stack(
        [x, y, z, x // 4, y // 4, z // 2, lx, ly, lz, size_x * size_y * 2,
         np.full_like(x, 3 * 2 * 1), idx, idx % 32, idx // 32, np.full_like(x, 32), n_sg],
        axis=-1,
    )  # fmt: skip
    np.testing.assert_array_equal(out, expect)


# ----------------------------------------------------- MLX's JIT wrapper


class FakeArray:
    """What kernel_source reads of an input: dtype, ndim and size (mx or numpy arrays)."""

    def __init__(self, shape: tuple[int, ...], dtype: str):
        self.shape, self.dtype = shape, dtype
        self.ndim, self.size = len(shape), int(np.prod(shape))


def demo_plan(**changes: Any) -> dict[str, Any]:
    plan = {
        "name": "demo",
        "input_names": ["x", "lens", "alpha"],
        "output_names": ["y"],
        "source": "  y[thread_position_in_grid.x] = x[0] * alpha + x_shape[0] + lens[0]"
                  " + simdgroup_index_in_threadgroup;",
        "header": "#include <metal_stdlib>\nusing namespace metal;\n",
        "ensure_row_contiguous": True,
        "atomic_outputs": False,
        "inputs": [FakeArray((4, 8), "mlx.core.float16"), FakeArray((3,), "mlx.core.int32"),
                   FakeArray((), "mlx.core.float32")],
        "output_shapes": [(32,)],
        "output_dtypes": ["mlx.core.float32"],
        "grid": (32, 1, 1),
        "threadgroup": (32, 1, 1),
        "template_args": [("T", "mlx.core.bfloat16"), ("N", 4), ("B", True)],
    }  # fmt: skip
    return {**plan, **changes}


def test_kernel_source_is_what_mlx_writes() -> None:
    # Read from write_signature / write_template / make_template_hash in
    # mlx/backend/common/metal_kernel.cpp (MLX 0.32): small inputs go to `constant`, a 0-d
    # input is a reference, `_shape` buffers follow their input when the body names them,
    # attributes the body names come last (in MLX's order), bools print as 0/1.
    plan = demo_plan()
    name = "custom_kernel_demo__bfloat16_t_4_1_float16_t_int32_tc_floats_float"
    assert kernel_source(plan) == (name, plan["header"] + f"""template <typename T, int N, bool B>
[[kernel]] void {name}(
  const device float16_t* x [[buffer(0)]],
  const constant int* x_shape [[buffer(1)]],
  const constant int32_t* lens [[buffer(2)]],
  const constant float& alpha [[buffer(3)]],
  device float* y [[buffer(4)]],
  uint simdgroup_index_in_threadgroup [[simdgroup_index_in_threadgroup]],
  uint3 thread_position_in_grid [[thread_position_in_grid]]) {{
{plan["source"]}
}}

template [[host_name("{name}")]] [[kernel]] decltype({name}<bfloat16_t, 4, 1>) \
{name}<bfloat16_t, 4, 1>;
""")


LIVE_VARIANTS = {
    "as above": {},
    "no template, atomic output": dict(template_args=[], atomic_outputs=True),
    "8 elements are device memory": dict(inputs=[
        FakeArray((2, 4), "mlx.core.bfloat16"), FakeArray((8,), "mlx.core.int32"),
        FakeArray((1,), "mlx.core.uint32")]),
    "strides, ndim and grid attributes": dict(
        source="  y[threads_per_grid.x] = x_strides[0] + x_ndim + thread_index_in_simdgroup;",
        output_dtypes=["mlx.core.float16"]),
}


@pytest.mark.parametrize("variant", list(LIVE_VARIANTS))
def test_kernel_source_is_what_the_installed_mlx_prints(variant: str) -> None:
    """MLX itself, asked for the text it would compile (``mlx_printed_source``): a new MLX
    that writes its kernels differently fails here before any Mac sees it."""
    plan = demo_plan(**LIVE_VARIANTS[variant])
    assert kernel_source(plan)[1] == mlx_printed_source(plan)


AXPY_HEADER = """#include <metal_stdlib>
using namespace metal;
template <typename T>
void axpy(const device T* x, const device T* y, device T* out, float a, uint i) {
  out[i] = T(a * float(x[i]) + float(y[i]));
}
"""


def axpy_plan(n: int, small: np.ndarray) -> dict:
    rng = np.random.default_rng(0)
    return {
        "name": "axpy", "input_names": ["x", "y", "a"], "output_names": ["out"],
        "source": "  if (thread_position_in_grid.x < uint(x_shape[0])) {\n"
                  "    axpy<T>(x, y, out, a[0], thread_position_in_grid.x);\n  }",
        "header": AXPY_HEADER, "ensure_row_contiguous": True, "atomic_outputs": False,
        "inputs": [rng.standard_normal(n).astype(np.float32),
                   rng.standard_normal(n).astype(np.float32), small],
        "output_shapes": [(n,)], "output_dtypes": [np.float32],
        "grid": (n, 1, 1), "threadgroup": (64, 1, 1), "template_args": [("T", np.float32)],
    }  # fmt: skip


def test_run_plan_runs_the_generated_kernel_with_partial_threadgroups(tmp_path: Path) -> None:
    # `a` has 8 elements: `device` memory, which the helper takes. 100 threads in groups
    # of 64: MLX dispatches threads, so the last group is partial.
    plan = axpy_plan(100, np.full(8, 2.5, np.float32))
    out = run_plan(plan, tmp_path / "axpy.metal")["out"]
    x, y, _ = plan["inputs"]
    np.testing.assert_allclose(out, 2.5 * x + y, rtol=1e-6)
    # A grid smaller than the threadgroup shrinks the threadgroup, as MLX does.
    small = run_plan({**plan, "grid": (40, 1, 1)}, tmp_path / "axpy.metal")["out"]
    np.testing.assert_allclose(small[:40], (2.5 * x + y)[:40], rtol=1e-6)
    assert np.isnan(small[40:]).all()


def test_constant_pointer_does_not_convert_to_device_pointer(tmp_path: Path) -> None:
    # With one element `a` is passed as `const constant float*`: Metal refuses to pass it
    # where a `device` pointer is expected, and so does the emulator.
    plan = axpy_plan(16, np.full(1, 2.5, np.float32))
    plan["header"] = AXPY_HEADER.replace("float a, uint i", "const device float* a, uint i")
    plan["header"] = plan["header"].replace("T(a * float", "T(a[0] * float")
    plan["source"] = plan["source"].replace("a[0], thread", "a, thread")
    with pytest.raises(MetalCompileError, match="constant_ptr"):
        run_plan(plan, tmp_path / "axpy.metal")
    # Reading through it is fine.
    ok = axpy_plan(16, np.full(1, 2.5, np.float32))
    x, y, _ = ok["inputs"]
    np.testing.assert_allclose(run_plan(ok, tmp_path / "axpy.metal")["out"], 2.5 * x + y)


def test_run_on_metal_returns_what_mlx_raised() -> None:
    # The plan crosses to a fresh interpreter, MLX builds its kernel there, and what MLX
    # raises comes back in its words: here, that it has no Metal back-end.
    plan = axpy_plan(16, np.full(8, 2.5, np.float32))
    with pytest.raises(MetalRunError, match=r"^RuntimeError: .*No Metal back-end"):
        run_on_metal(plan)
    # A refusal that names no thread limit is not read as one.
    with pytest.raises(MetalRunError, match="No Metal back-end"):
        pipeline_thread_limit(plan)


def test_pipeline_thread_limit_reads_the_limit_mlx_names(monkeypatch) -> None:
    # MLX 0.32's refusal (CustomKernel::eval_gpu), for a threadgroup over Metal's 1024.
    from metal_emulator import mlx_jit

    asked = []

    def refuse(plan: dict, *, threadgroup: tuple[int, int, int]) -> list:
        asked.append(threadgroup)
        raise MetalRunError(f"ValueError: Thread group size ({threadgroup[0]}) is greater than "
                            " the maximum allowed threads per threadgroup (896).")

    plan = axpy_plan(16, np.full(8, 2.5, np.float32))
    monkeypatch.setattr(mlx_jit, "run_on_metal", refuse)
    assert pipeline_thread_limit(plan) == 896
    assert asked == [(1024 + 32, 1, 1)]
    # An MLX that launched it would not refuse a pipeline's smaller limit either.
    monkeypatch.setattr(mlx_jit, "run_on_metal", lambda plan, *, threadgroup: [])
    with pytest.raises(RuntimeError, match="without refusing"):
        pipeline_thread_limit(plan)


# -------------------------------------------------------------------- lint


@pytest.mark.parametrize("path", LINTED_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_lint_passes_on_project_and_example_kernels(path: Path) -> None:
    assert lint_metal(path) == []


GOOD_SNIPPET = """\
#include <metal_stdlib>
using namespace metal;
struct P { uint n; float s; };
[[kernel]] void k(device float* out [[buffer(0)]], constant P& p [[buffer(1)]],
                  uint tid [[thread_position_in_grid]]) {
  threadgroup float t[32];
  t[tid % 32] = p.s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = t[0];
}
"""

BAD_SNIPPETS = [
    ("#include <metal_stdlib>", "#include <metal_stdlib>\n#include <cmath>", "rule 1"),
    ("using namespace metal;", 'using namespace metal;\n#include "mlx/backend/utils.h"', "rule 1"),
    ("out[tid] = t[0];", "out[tid] = std::max(t[0], 0.0f);", "rule 1"),
    ("[[kernel]] void k(", "[[kernel]] float k(", "rule 2"),
    ("uint tid [[thread_position_in_grid]]", "uint tid", "rule 3"),
    ("[[buffer(1)]]", "[[buffer(0)]]", "rule 3"),
    ("constant P& p [[buffer(1)]]", "constant uint& p [[buffer(1)]]", "rule 4"),
    ("device float* out [[buffer(0)]]", "float out [[buffer(0)]]", "rule 4"),
    ("struct P { uint n; float s; };", "struct P { uint n; half s; };", "rule 4"),
    ("threadgroup float t[32];", "threadgroup float t[32], u[4];", "rule 5"),
    ("threadgroup float t[32];", "threadgroup float t[32];\n  threadgroup float z = 0;", "rule 5"),
    (
        "t[tid % 32] = p.s;",
        "if (tid > 1) { threadgroup float u[4]; }\n  t[tid % 32] = p.s;",
        "rule 5",
    ),
    ("out[tid] = t[0];", "out[tid] = float2(t[0], 1.0f).yx.x;", "rule 6"),
    ("out[tid] = t[0];", "out[tid] = t[0]; texture2d<float> tex;", "rule 7"),
    ("t[tid % 32] = p.s;", "if (tid >= p.n) return;\n  t[tid % 32] = p.s;", "rule 8"),
    ("out[tid] = t[0];", "out[tid] = max(t[0], -INFINITY);", "rule 9"),
    ("out[tid] = t[0];", "out[tid] = double(t[0]);", "rule 10"),
    ("out[tid] = t[0];", "out[tid] = t[0] + 1.0h;", "rule 10"),
    ("out[tid] = t[0];", "out[tid] = [&](float a) { return a; }(t[0]);", "rule 10"),
    ("out[tid] = t[0];", "simdgroup_matrix<float, 4, 4> m;\n  out[tid] = t[0];", "rule 10"),
    ("out[tid] = t[0];", "atomic_fetch_add_explicit(out, 1.0f, memory_order_relaxed);", "rule 10"),
    ("out[tid] = t[0];", "simdgroup_matrix<float, 8, 8> m;\n  "
     "simdgroup_load(m, out, 16, ulong2(8, 0), true);\n  out[tid] = t[0];", "rule 10"),
]


def test_lint_accepts_the_good_snippet() -> None:
    assert lint_source(GOOD_SNIPPET, "good.metal") == []


@pytest.mark.parametrize("old,new,rule", BAD_SNIPPETS)
def test_lint_flags_bad_snippets(old: str, new: str, rule: str) -> None:
    assert GOOD_SNIPPET.count(old) == 1
    problems = lint_source(GOOD_SNIPPET.replace(old, new), "bad.metal")
    assert any(f"{rule}:" in p for p in problems), problems
    assert all(p.startswith("bad.metal:") for p in problems)


def test_lint_flags_uninstantiated_template_and_loose_host_name() -> None:
    src = GOOD_SNIPPET.replace("[[kernel]] void k(", "template <typename T>\n[[kernel]] void k(")
    assert any("never instantiated" in p for p in lint_source(src, "t.metal"))
    src2 = src + '[[host_name("x")]] void helper();\n'
    assert any("rule 2" in p and "host_name" in p for p in lint_source(src2, "t.metal"))


# ------------------------------------------------------------ planted bugs


def test_mutation_missing_barrier_is_a_mismatch_and_a_schedule_difference() -> None:
    anchor = "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  if (sg == 0) {"
    lib = mutated("reduce.metal", anchor, "  if (sg == 0) {")
    bufs, groups, sums, _ = reduce_case(1000, 300)
    out = lib.run("block_reduce_float", bufs, groups=groups, threadgroup=64, schedule="forward")
    assert not np.allclose(out["sums"], sums, atol=1e-3)  # read poisoned threadgroup memory
    with pytest.raises(ScheduleMismatch):
        run_schedules(lib, "block_reduce_float", bufs, groups=groups, threadgroup=64)


def test_mutation_off_by_one_context_length_is_a_mismatch() -> None:
    # Reads one key past the context; with lengths that are not multiples of
    # the page size it stays inside the last page, so only the values differ.
    lib = mutated("paged_decode.metal", "ctx = context_lens[b];", "ctx = context_lens[b] + 1;")
    bufs, groups, ref = decode_case(lens=(37, 5, 70, 17))
    for schedule in DEFAULT_SCHEDULES:
        out = lib.run(
            "paged_decode_float_32", bufs, groups=groups, threadgroup=32, schedule=schedule
        )
        assert not np.allclose(out["out"], ref, atol=1e-3), schedule


def test_mutation_early_return_before_barrier_is_reported_with_file_and_line() -> None:
    anchor = "  float s = 0.0f;\n  float m = -FLT_MAX;"
    lib = mutated("reduce.metal", anchor, "  if (begin + tid >= end) return;\n" + anchor)
    # 1000 elements, 320 per group: the last group's 40 elements leave 24 of
    # its 64 threads without work, and they return before the barrier.
    bufs, groups, _, _ = reduce_case(1000, 320)
    barrier_line = line_containing(EXAMPLES / "reduce.metal", "threadgroup_barrier") + 1
    for schedule in DEFAULT_SCHEDULES:
        with pytest.raises(BarrierError) as err:
            lib.run("block_reduce_float", bufs, groups=groups, threadgroup=64, schedule=schedule)
        assert f"reduce.metal:{barrier_line}" in str(err.value)
        assert "returned" in str(err.value)


def test_mutation_block_table_off_by_one_is_an_out_of_bounds_read_of_k() -> None:
    lib = mutated("paged_decode.metal", "t / p.page_size];", "t / p.page_size + 1];")
    bufs, groups, _ = decode_case()
    with pytest.raises(OutOfBoundsError) as err:
        lib.run("paged_decode_float_32", bufs, groups=groups, threadgroup=32)
    msg = str(err.value)
    assert "out-of-bounds read of buffer(1) 'k_pages'" in msg
    assert "before its start" in msg
    assert "in thread (" in msg and "of threadgroup (" in msg
    assert "paged_decode.metal:" in msg  # the faulting line, via addr2line


def test_mutation_missing_loop_end_barrier_is_seen_only_under_run_ahead() -> None:
    anchor = "    }\n    threadgroup_barrier(mem_flags::mem_threadgroup);\n  }"
    lib = mutated("simd_matmul.metal", anchor, "    }\n  }")
    bufs, groups, ref = matmul_case()
    kernel = "tiled_matmul_float"
    lockstep = run_schedules(
        lib, kernel, bufs, schedules=("forward", "reverse"), groups=groups, threadgroup=64
    )
    np.testing.assert_allclose(lockstep["C"], ref, rtol=1e-4, atol=1e-4)
    ahead = lib.run(kernel, bufs, groups=groups, threadgroup=64, schedule="run_ahead")
    assert not np.allclose(ahead["C"], ref, atol=1e-3)


def test_mutation_missing_simdgroup_barrier_is_caught() -> None:
    lib = mutated("simd_matmul.metal", "  simdgroup_barrier(mem_flags::mem_threadgroup);\n", "")
    bufs, groups, ref = matmul_case()
    out = lib.run("tiled_matmul_float", bufs, groups=groups, threadgroup=64)
    assert not np.allclose(out["C"], ref, atol=1e-3)


# ---------------------------------------------------------- misuse reports


MISUSE = CASES / "misuse.metal"


MISUSE_CASES = [  # kernel, threads per group, groups, expected error, text in the report
    ("different_barriers", 64, 1, BarrierError, "different barriers"),
    ("barrier_vs_simd_deadlock", 64, 1, BarrierError, "deadlock"),
    ("simd_divergence", 32, 1, SimdError, "simdgroup divergence"),
    ("broadcast_not_uniform", 32, 1, SimdError, "simdgroup-uniform"),
    ("threadgroup_overflow", 32, 1, OutOfBoundsError, "threadgroup array declared at"),
    ("threadgroup_too_big", 32, 1, EmulatorError, "more than 32 KiB"),
    ("reads_big_params", 32, 1, EmulatorError, "BigParams of 16 bytes"),
    ("matrix_on_partial_simdgroup", 16, 1, SimdError, "full simdgroup"),
    ("write_past_end", 32, 2, OutOfBoundsError, "buffer(0) 'out'"),
]


@pytest.mark.parametrize("kernel,threads,groups,error,needle", MISUSE_CASES)
def test_misuse_is_reported(
    kernel: str, threads: int, groups: int, error: type[EmulatorError], needle: str
) -> None:
    lib = compile_metal(MISUSE)
    buffers: dict[int | str, object] = {0: Out(threads * groups)}
    if kernel == "reads_big_params":
        buffers[1] = b"\0" * 8  # BigParams needs 16 bytes
    with pytest.raises(error) as err:
        lib.run(kernel, buffers, groups=groups, threadgroup=threads)
    assert needle in str(err.value)
    if kernel != "reads_big_params":
        assert "misuse.metal:" in str(err.value)


def test_guard_start_catches_a_read_just_before_the_start() -> None:
    lib = compile_metal(MISUSE)
    x = np.arange(32, dtype=np.float32)
    out = lib.run("read_before_start", {0: x, 1: Out(32)}, grid=32)[1]
    assert np.isnan(out[0])  # default layout: the slack before the start reads as NaN
    with pytest.raises(OutOfBoundsError, match=r"buffer\(0\) 'x' at byte offset -4 \(before"):
        lib.run("read_before_start", {0: x, 1: Out(32)}, grid=32, guard="start")


def test_barrier_reports_name_both_lines() -> None:
    lib = compile_metal(MISUSE)
    with pytest.raises(BarrierError) as err:
        lib.run("different_barriers", {0: Out(64)}, groups=1, threadgroup=64)
    a = line_containing(MISUSE, "BARRIER_A")
    b = line_containing(MISUSE, "BARRIER_B")
    assert f"misuse.metal:{a}" in str(err.value) and f"misuse.metal:{b}" in str(err.value)


def test_prepass_refuses_other_threadgroup_statements() -> None:
    text = GOOD_SNIPPET.replace("threadgroup float t[32];", "threadgroup float t[32] = {0};")
    with pytest.raises(MetalSourceError, match=r"bad\.metal:6: unsupported threadgroup"):
        compile_metal(CASES / "bad.metal", source=text)


def test_harness_checks_bindings() -> None:
    lib = example("reduce.metal")
    bufs, groups, _, _ = reduce_case(100, 100)
    with pytest.raises(KeyError, match="unbound buffers 3 \\(p\\)"):
        lib.run("block_reduce_float", {k: v for k, v in bufs.items() if k != 3}, groups=groups)
    with pytest.raises(ValueError, match="missing fields \\['scale'\\]"):
        lib.run("block_reduce_float", {**bufs, 3: {"n": 100, "per_group": 100}}, groups=groups)
    with pytest.raises(KeyError, match="no \\[\\[buffer\\]\\] parameter 9"):
        lib.run("block_reduce_float", {**bufs, 9: np.zeros(1)}, groups=groups)


def test_a_threadgroup_larger_than_metal_dispatches_is_refused() -> None:
    # Metal refuses more than 1024 threads per threadgroup; so does the emulator, before
    # running a thread (the launcher's own limit is a static_assert in metal_launch.cpp).
    lib = compile_metal(MISUSE)
    with pytest.raises(ValueError, match="more than the 1024 a Metal pipeline allows"):
        lib.run("write_past_end", {0: Out(2048)}, groups=1, threadgroup=2048)
    with pytest.raises(ValueError, match="a threadgroup of"):
        lib.run("write_past_end", {0: Out(2048)}, groups=1, threadgroup=(64, 32, 1))
