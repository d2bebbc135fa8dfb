"""tiny_llm: a mini vLLM on MLX, built one chapter a day."""

from tiny_llm.blas import load_openblas

load_openblas()  # must precede the first `import mlx.core`

from tiny_llm.engine import LLM, LLMEngine  # noqa: E402
from tiny_llm.request import RequestOutput  # noqa: E402
from tiny_llm.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
