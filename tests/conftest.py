"""Shared test setup.

tiny_llm must be imported before mlx.core: it interposes OpenBLAS for MLX's CPU GEMM.
Engine tests use tiny random models (``tiny_llm.testing.models``, built in-process, never
downloaded) together with the real SmolLM2 tokenizer read from the installed GGUF file, so
stop strings and streaming text behave as they do with a real model.
"""

import tiny_llm  # noqa: F401  (side effect: loads the OpenBLAS shim first)
from tiny_llm.testing.models import make_tiny_model
from tiny_llm.tokenizer import Tokenizer

import mlx.core as mx
import pytest


@pytest.fixture(scope="session")
def smollm_tokenizer() -> Tokenizer:
    from tiny_llm.loader import default_model_path

    _, meta = mx.load(str(default_model_path()), return_metadata=True)
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="session")
def tiny_model():
    return make_tiny_model()
