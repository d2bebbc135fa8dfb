"""tiny_llm: a mini vLLM on MLX, built one chapter a day."""

from tiny_llm.blas import load_openblas

load_openblas()  # must precede the first `import mlx.core`
