"""The compiled kernel extension (``src/extensions``, built by ``make setup``).

It holds the paged-attention ops (CPU schedules in C++, the Metal launch for Apple GPUs)
and the paged K/V write. Loaded on first use, so that the chapters that do not need it
(Days 1-3, the MLX-ops reference walks) run without a compiler. With the learner switch on
and a copy of the extension in the workspace (a kernel task started), the learner's copy
is built and loaded instead.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from tiny_llm import learner


@functools.cache
def extension() -> ModuleType:
    """The extension module, or an ImportError saying how to build it."""
    ws = learner.workspace()
    if ws is not None and (ws / "extensions").is_dir():
        return learner.learner_extension(ws)
    try:
        return importlib.import_module("tiny_llm._native._ext")
    except ImportError as e:
        raise ImportError(
            "the tiny_llm kernel extension is not built; run `make setup` "
            f"(it builds src/extensions with CMake) — {e}"
        ) from None
