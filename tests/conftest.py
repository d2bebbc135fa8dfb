"""Shared test setup.

tiny_llm must be imported before mlx.core: it interposes OpenBLAS for MLX's CPU GEMM.
Engine tests use tiny random models (built here, in-process, never downloaded) together
with the real SmolLM2 tokenizer read from the installed GGUF file, so stop strings and
streaming text behave as they do with a real model.
"""

import tiny_llm  # noqa: F401  (side effect: loads the OpenBLAS shim first)
from tiny_llm.model import Model, ModelConfig
from tiny_llm.tokenizer import Tokenizer

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=4096,
)


def make_tiny_model(
    model_type: str = "qwen3", vocab_size: int = 49152, seed: int = 0, **overrides
) -> Model:
    """A random float32 model in which context and positions clearly matter.

    With plain N(0, 0.2) weights attention is nearly uniform, and a bug that shifts
    positions or mixes sequences can leave greedy tokens unchanged; sharpening attention
    (larger q/k) makes such bugs visible in the tokens the tests compare.
    """
    config = ModelConfig.from_hf(
        {**TINY, "model_type": model_type, "vocab_size": vocab_size, **overrides}
    )
    model = Model(config)
    mx.random.seed(seed)
    model.load_weights([(k, _init(k, v.shape)) for k, v in tree_flatten(model.parameters())])
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    return model


def _init(name: str, shape: tuple[int, ...]) -> mx.array:
    noise = mx.random.normal(shape) * 0.2
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return 2.0 + noise
    if name.endswith("norm.weight"):
        return 1.0 + noise
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return noise * 3.0
    return noise


@pytest.fixture(scope="session")
def smollm_tokenizer() -> Tokenizer:
    from tiny_llm.loader import default_model_path

    _, meta = mx.load(str(default_model_path()), return_metadata=True)
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="session")
def tiny_model() -> Model:
    return make_tiny_model()
