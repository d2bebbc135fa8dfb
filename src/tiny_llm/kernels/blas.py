"""Make MLX's float32 GEMM fast on Linux CPUs.

The ``mlx[cpu]`` wheel links a reference BLAS. ``make setup`` builds a tiny shim
(``src/extensions/blas_shim``) that defines ``cblas_sgemm`` on top of the OpenBLAS in
``scipy-openblas32``. Loading it with ``RTLD_GLOBAL`` *before* ``mlx.core`` is imported
puts its symbol ahead of the wheel's BLAS, so every float32 matmul MLX runs on the CPU
goes through OpenBLAS (``benches/bench_model.py`` measures the difference).

OpenBLAS runs on one thread unless ``OPENBLAS_NUM_THREADS`` says otherwise. Its worker
threads spin while they wait for each other: on a quiet machine more threads make one
request faster, but with another process busy on a core they fall well behind one thread
(``benches/bench_blas_threads.py``, the book's performance appendix). One thread is the
default that never collapses; the engine runs it on every core through the extension's
thread pool instead (``cpu_kernels.py``).

Invariant: ``load_openblas()`` runs before the first ``import mlx.core`` in the process;
``tiny_llm/__init__.py`` calls it first thing.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from pathlib import Path

SHIM_PATH = Path(__file__).parents[1] / "_native" / "libcblas_shim.so"

_state: dict[str, bool] = {}


# ANCHOR: load_openblas
def load_openblas() -> bool:
    """Load the OpenBLAS shim globally; returns whether MLX will use OpenBLAS."""
    if "loaded" in _state:
        return _state["loaded"]
    loaded = False
    if sys.platform.startswith("linux") and os.environ.get("TINY_LLM_NO_OPENBLAS") != "1":
        if "mlx.core" in sys.modules:
            warnings.warn(
                "tiny_llm: mlx.core was imported before tiny_llm; OpenBLAS cannot be "
                "interposed and float32 matmuls will use the slow reference BLAS.",
                stacklevel=2,
            )
        elif SHIM_PATH.exists():
            os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # read when OpenBLAS loads
            ctypes.CDLL(str(SHIM_PATH), mode=os.RTLD_GLOBAL)
            loaded = True
        else:
            warnings.warn(
                f"tiny_llm: {SHIM_PATH.name} is not built (run `make setup`); "
                "float32 matmuls will use MLX's slow reference BLAS.",
                stacklevel=2,
            )
    _state["loaded"] = loaded
    return loaded
# ANCHOR_END: load_openblas


def openblas_loaded() -> bool:
    return _state.get("loaded", False)


def openblas_threads() -> int | None:
    """OpenBLAS's thread count, if the shim (and so scipy-openblas32) is loaded."""
    if not openblas_loaded():
        return None
    try:
        return ctypes.CDLL(None).scipy_openblas_get_num_threads()
    except AttributeError:
        return None
