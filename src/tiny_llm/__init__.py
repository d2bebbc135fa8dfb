"""tiny_llm: a mini vLLM on MLX, built one chapter a day."""

import logging

from tiny_llm.blas import load_openblas

load_openblas()  # must precede the first `import mlx.core`

# The engine reports its KV pool at start, as vLLM does: INFO to stderr unless the
# application configured the "tiny_llm" logger itself.
_log = logging.getLogger("tiny_llm")
if not _log.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("tiny_llm: %(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(logging.INFO)

from tiny_llm.engine import LLM, LLMEngine  # noqa: E402
from tiny_llm.request import RequestOutput  # noqa: E402
from tiny_llm.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
