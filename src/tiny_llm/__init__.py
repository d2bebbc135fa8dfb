"""tiny_llm: a mini vLLM on MLX, built one chapter a day.

``import tiny_llm`` interposes OpenBLAS for MLX's CPU matmuls (before ``mlx.core`` loads),
sets up the engine's log, and installs the learner switch (``tiny_llm.learner``). The
engine is imported on first use of ``tiny_llm.LLM`` and friends, so that no day's module is
imported before the switch can choose where it comes from.
"""

import logging

from tiny_llm.blas import load_openblas

load_openblas()  # must precede the first `import mlx.core`

from tiny_llm import learner  # noqa: E402

learner.install()

# The engine reports its KV pool at start, as vLLM does: INFO to stderr unless the
# application configured the "tiny_llm" logger itself.
_log = logging.getLogger("tiny_llm")
if not _log.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("tiny_llm: %(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(logging.INFO)

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name in ("LLM", "LLMEngine"):
        from tiny_llm import engine

        return getattr(engine, name)
    if name == "RequestOutput":
        from tiny_llm.request import RequestOutput

        return RequestOutput
    if name == "SamplingParams":
        from tiny_llm.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'tiny_llm' has no attribute {name!r}")
