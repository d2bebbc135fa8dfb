"""tiny_llm: a mini vLLM on MLX, built one chapter a day.

``import tiny_llm`` interposes OpenBLAS for MLX's CPU matmuls (before ``mlx.core`` loads),
sets up the engine's log, and installs the learner switch (``tiny_llm.course.learner``). The
engine is imported on first use of ``tiny_llm.LLM`` and friends, so that no day's module is
imported before the switch can choose where it comes from.
"""

import importlib
import logging

from tiny_llm.kernels.blas import load_openblas

load_openblas()  # must precede the first `import mlx.core`

from tiny_llm.course import learner  # noqa: E402

learner.install()

# The engine reports its KV pool at start, as vLLM does: INFO to stderr unless the
# application configured the "tiny_llm" logger itself.
_log = logging.getLogger("tiny_llm")
if not _log.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("tiny_llm: %(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(logging.INFO)

# The package's face: the names programs outside the package (the benchmarks, the tools, a
# user's script) import, each from the module that defines it today. A module may move inside
# the package; these names stay, so that a benchmark of one commit runs on another's package.
FACE = {
    "ATTENTION_BACKENDS": "engine",
    "causal_attention": "step.dense_kv",
    "default_model_path": "models.loader",
    "DenseKVCache": "step.dense_kv",
    "EngineConfig": "engine",
    "extension": "kernels.extension",
    "IncrementalDetokenizer": "models.tokenizer",
    "KernelPlan": "kernels.cpu_kernels",
    "kv_bytes_per_token": "engine.pool_size",
    "linear": "kernels.cpu_kernels",
    "linears": "kernels.cpu_kernels",
    "LLM": "engine",
    "LLMEngine": "engine",
    "load": "models.loader",
    "Model": "models.model",
    "ModelConfig": "models.model",
    "openblas_loaded": "kernels.blas",
    "openblas_threads": "kernels.blas",
    "PagedLayout": "step.batch",
    "plans_for_gpu": "kernels.device",
    "reference_extension": "kernels.extension",
    "rehearsing_gpu": "kernels.device",
    "RequestOutput": "step.request",
    "SamplingParams": "sampling.params",
    "ScheduledChunk": "step.batch",
    "set_gpu_rehearsal": "kernels.device",
    "split_blas": "kernels.cpu_kernels",
    "StepBatch": "step.batch",
    "stream_generate": "engine.generate",
    "Tokenizer": "models.tokenizer",
}
__all__ = sorted(FACE)

# The package's layers, lowest first, each with what it holds: a module imports only its own
# layer and those below (tests/test_architecture.py checks every import; the architecture
# chapter draws them). The top level holds the chapters, the CLI and this face; a chapter sits
# where its idea is used (MoE below the models that hold its block, structured outputs below
# the sampler that masks with them).
LAYERS = (
    ("course", "the tasks and their stubs, a learner's workspace, the learner switch"),
    ("kernels", "the extension's binding, the CPU kernel plans, the fused decode layers"),
    ("moe", "chapter: Mixture of Experts (routing, dispatch, combine)"),
    ("models", "the model families, their loader, the tokenizer"),
    ("structured", "chapter, serving: a grammar's mask on a logit row"),
    ("sampling", "the sampling parameters, the sampler, tool calls"),
    ("step", "requests, the step batch and its layouts, the attention seam"),
    ("day1_batching", "chapter, Day 1: continuous batching"),
    ("day2_chunked_prefill", "chapter, Day 2: chunked prefill"),
    ("day3_paged_kv", "chapter, Day 3: paged KV cache"),
    ("day4_paged_attention", "chapter, Day 4: paged attention, read in place"),
    ("day5_paged_flash", "chapter, Day 5: paged FlashAttention"),
    ("speculative", "chapter: speculative decoding"),
    ("tensor_parallel", "chapter: beyond one machine (shards, the all-reduce)"),
    ("distributed", "the ranks' meeting, rank 0's workers, a worker's loop"),
    ("engine", "the engine: configuration, scheduler core, model runner, outputs"),
    ("serving", "the OpenAI-compatible server, by job"),
    ("cli", "tiny-llm chat | generate | serve | launch | course"),
    ("testing", "tiny models, runs and paged cases for the tests and benchmarks"),
)
CHAPTERS = tuple(name for name, role in LAYERS if role.startswith("chapter"))


def __getattr__(name: str):
    module = FACE.get(name)
    if module is None:
        raise AttributeError(f"module 'tiny_llm' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tiny_llm.{module}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *FACE])
