"""The compiled kernel extension (``src/extensions``, built by ``make setup``).

It holds the paged-attention ops (CPU schedules in C++, the Metal launch for Apple GPUs),
the paged K/V write, and the model's CPU kernels (matmuls, norms, RoPE, SwiGLU, the fused
decoder layers). Loaded on first use, so that the chapters that do not need it (Days 1-3,
the MLX-ops reference walks) run without a compiler. Two views of it:

- ``extension()``: the attention kernels the course swaps. With the learner switch on and
  a copy of the extension in the workspace (a kernel task started), the learner's copy is
  built and loaded instead of the reference. Not built: an ImportError with the command.
- ``reference_extension()``: the reference build, always; the model's CPU kernels, which
  are not course tasks. Not built: None, with a warning (the model then runs on MLX's ops).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from types import ModuleType

from tiny_llm.course import learner

REFERENCE = "tiny_llm._native._ext"


@functools.cache
def extension() -> ModuleType:
    """The attention kernels' module, or an ImportError saying how to build it."""
    ws = learner.workspace()
    if ws is not None and (ws / "extensions").is_dir():
        return learner.learner_extension(ws)
    try:
        return importlib.import_module(REFERENCE)
    except ImportError as e:
        raise ImportError(
            "the tiny_llm kernel extension is not built; run `make setup` "
            f"(it builds src/extensions with CMake) — {e}"
        ) from None


@functools.cache
def reference_extension() -> ModuleType | None:
    """The reference extension, or None (warned once) where it is not built."""
    try:
        return importlib.import_module(REFERENCE)
    except ImportError as e:
        warnings.warn(f"tiny_llm: the kernel extension is not built (run `make setup`); the "
                      f"model's CPU ops use MLX's instead (matmuls, RMSNorm, RoPE, SwiGLU) — {e}",
                      stacklevel=3)
        return None
