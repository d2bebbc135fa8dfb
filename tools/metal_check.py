"""Compile the kernels MLX's JIT would build, with Apple's Metal compiler (`make metal-check`).

For a set of model geometries (the default model's among them) and the largest geometries
the launcher accepts (``largest_geometries``), in every dtype, ask the extension for the
launch plan of both schedules, write the kernel source MLX would compile for it
(``tools/metal_emulator/mlx_jit.py``) and compile it with ``xcrun metal``. MLX prepends its
own ``utils.h`` to every JIT kernel; of it the kernels use only two type names, defined here.

    python tools/metal_check.py            # compile (macOS with Xcode's Metal toolchain)
    python tools/metal_check.py --emit DIR # only write the sources (any machine)
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_llm  # noqa: E402, F401  (before mlx)
from tiny_llm import extension  # noqa: E402

import mlx.core as mx  # noqa: E402
from metal_emulator.mlx_jit import kernel_source  # noqa: E402

MLX_UTILS_TYPES = "typedef half float16_t;\ntypedef bfloat bfloat16_t;\n"

# (name, query heads, KV heads, head_dim, dtype)
MODELS = [
    ("smollm2-135m", 9, 3, 64, mx.float32),
    ("smollm2-135m-f16", 9, 3, 64, mx.float16),
    ("qwen3-0.6b", 16, 8, 128, mx.float16),
    ("qwen3-4b-bf16", 32, 8, 128, mx.bfloat16),
    ("mha", 4, 4, 64, mx.float32),
]
DTYPES = (mx.float32, mx.float16, mx.bfloat16)

# Past anything the launcher may accept: the search for its largest geometries stops here.
SEARCH_HEAD_DIM = 4096
SEARCH_GROUP = 1024


def accepts(group: int, head_dim: int, dtype: mx.Dtype) -> bool:
    """Whether check_metal_geometry accepts a KV head of ``group`` query heads."""
    try:
        extension().check_metal_geometry(group, 1, head_dim, 16, dtype)
    except ValueError:
        return False
    return True


def largest_geometries(dtype: mx.Dtype) -> list[tuple[str, int, int]]:
    """The corners of what the launcher accepts, as (name, head_dim, group): the largest
    head_dim with the largest group it takes (the tiled schedule's most simdgroup matrices
    per thread), and the largest group with the largest head_dim it takes (the vector
    schedule's most softmax states per thread). Raises RuntimeError if the launcher
    accepts the search's bounds."""
    head_dims = range(8, SEARCH_HEAD_DIM + 8, 8)
    groups = range(1, SEARCH_GROUP + 1)
    if accepts(1, head_dims[-1], dtype) or accepts(groups[-1], 8, dtype):
        raise RuntimeError("the launcher accepts geometries at the search's bounds: raise them")
    head_dim = max(d for d in head_dims if accepts(1, d, dtype))
    group = max(g for g in groups if accepts(g, 8, dtype))
    group_at_head_dim = max(g for g in groups if accepts(g, head_dim, dtype))
    head_dim_at_group = max(d for d in head_dims if accepts(group, d, dtype))
    return [(f"largest-head-dim-{head_dim}-gqa{group_at_head_dim}", head_dim, group_at_head_dim),
            (f"largest-group-gqa{group}-{head_dim_at_group}", head_dim_at_group, group)]


def geometries() -> list[tuple[str, int, int, int, mx.Dtype]]:
    """MODELS, then the largest geometries in every dtype (two KV heads each)."""
    largest = [(f"{name}-{dtype_name(dtype)}", 2 * group, 2, head_dim, dtype)
               for dtype in DTYPES for name, head_dim, group in largest_geometries(dtype)]
    return MODELS + largest


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def sources() -> dict[str, str]:
    out = {}
    for name, n_heads, n_kv_heads, head_dim, dtype in geometries():
        q = mx.zeros((3, n_heads, head_dim), dtype)
        pages = mx.zeros((4, 16, n_kv_heads, head_dim), dtype)
        table = mx.array([[0, 1], [2, -1]], dtype=mx.int32)
        ctx, qsl = mx.array([20, 1], dtype=mx.int32), mx.array([0, 2, 3], dtype=mx.int32)
        # Row 1 is a draft of a token tree (it sees key 18 and itself): the kernels with
        # their two tree inputs are other kernels for MLX's JIT.
        tree = {"tree_start": mx.array([19, 18, 2], dtype=mx.int32),
                "tree_mask": mx.array([0, 3, 0], dtype=mx.uint64)}
        for tiled, trees in itertools.product((False, True), ({}, tree)):
            plan = extension().metal_launch_plan(q, pages, pages, table, ctx, qsl, 0.125,
                                                 tiled=tiled, **trees)
            _, text = kernel_source(plan)
            kind = ("flash" if tiled else "vector") + ("-tree" if trees else "")
            out[f"{name}-{kind}.metal"] = MLX_UTILS_TYPES + text
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--emit", type=Path, help="write the sources here; do not compile")
    args = parser.parse_args()
    if not args.emit and shutil.which("xcrun") is None:
        print("metal-check: no xcrun here: it compiles with Xcode's Metal toolchain, on macOS "
              "(--emit DIR writes the sources on any machine)", file=sys.stderr)
        return 1
    folder = args.emit or Path(tempfile.mkdtemp(prefix="tiny_llm_metal_"))
    folder.mkdir(parents=True, exist_ok=True)
    for file_name, text in sources().items():
        path = folder / file_name
        path.write_text(text)
        if args.emit:
            continue
        cmd = ["xcrun", "-sdk", "macosx", "metal", "-std=metal3.1", "-c", str(path),
               "-o", str(path.with_suffix(".air"))]  # fmt: skip
        if subprocess.run(cmd).returncode != 0:
            print(f"metal-check: {file_name} does not compile", file=sys.stderr)
            return 1
        print(f"compiled {file_name}")
    print(f"all kernel sources {'written to ' + str(folder) if args.emit else 'compile'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
