"""Tiny random models, and mlx-lm's twin of a model (the oracle for logits)."""

from __future__ import annotations

import importlib
from typing import Any

from tiny_llm.models.model import Model, ModelConfig

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

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


def tiny_config(model_type: str = "qwen3", vocab_size: int = 49152, **overrides: Any) -> dict:
    """A Hugging Face ``config.json`` dictionary of a tiny model of ``model_type``."""
    return {**TINY, "model_type": model_type, "vocab_size": vocab_size, **overrides}


def random_weights(model: nn.Module, seed: int = 0) -> list[tuple[str, mx.array]]:
    """Random float32 parameters that keep activations O(1) and logits spread out over
    several units, so that a wrong detail cannot hide in near-constant outputs."""
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    out = []
    for (name, p), key in zip(params, keys, strict=True):
        noise = mx.random.normal(p.shape, key=key)
        if "norm" in name:  # RMSNorm gains around 1, different per channel
            value = 1.0 + 0.3 * noise
        elif name.endswith(".bias"):
            value = 0.5 * noise
        elif "embed_tokens" in name:
            value = 0.3 * noise
        else:  # linear layers: std 1.5 / sqrt(fan_in) keeps activations O(1)
            value = noise * (1.5 / p.shape[-1] ** 0.5)
        out.append((name, value))
    return out


def make_tiny_model(model_type: str = "qwen3", vocab_size: int = 49152, seed: int = 0,
                    **overrides: Any) -> Model:
    """A random float32 model in which context and positions clearly matter (engine tests).

    With plain N(0, 0.2) weights attention is nearly uniform, and a bug that shifts
    positions or mixes sequences can leave greedy tokens unchanged; sharpening attention
    (larger q/k) makes such bugs visible in the tokens the tests compare."""
    model = Model(ModelConfig.from_hf(tiny_config(model_type, vocab_size, **overrides)))
    mx.random.seed(seed)
    model.load_weights([(k, _sharp(k, v.shape)) for k, v in tree_flatten(model.parameters())])
    mx.eval(model.parameters())
    return model


def _sharp(name: str, shape: tuple[int, ...]) -> mx.array:
    noise = mx.random.normal(shape) * 0.2
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return 2.0 + noise
    if name.endswith("norm.weight"):
        return 1.0 + noise
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return noise * 3.0
    return noise


def mlx_lm_model(hf_config: dict) -> nn.Module:
    """mlx-lm's model class for ``hf_config["model_type"]`` (random weights)."""
    module = importlib.import_module(f"mlx_lm.models.{hf_config['model_type']}")
    return module.Model(module.ModelArgs.from_dict(hf_config))


def hf_config_of(model: Model) -> dict:
    """The Hugging Face config dictionary of one of our models."""
    c = model.config
    config = {**c.extra, "model_type": c.model_type, "hidden_size": c.hidden_size,
              "num_hidden_layers": c.num_hidden_layers, "intermediate_size": c.intermediate_size,
              "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
              "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
              "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_theta,
              "rope_scaling": c.rope_scaling, "rope_traditional": c.rope_traditional,
              "tie_word_embeddings": c.tie_word_embeddings}  # fmt: skip
    if c.model_type == "llama":
        config["attention_bias"] = c.attention_bias
    if c.num_experts:
        config.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                      moe_intermediate_size=c.moe_intermediate_size,
                      shared_expert_intermediate_size=c.shared_expert_intermediate_size,
                      norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=c.decoder_sparse_step,
                      mlp_only_layers=c.mlp_only_layers)
    return config


def mlx_lm_twin(model: Model) -> nn.Module:
    """mlx-lm's model of the same family and config, holding the very arrays ``model``
    holds (parameter names are shared; ``strict`` checks that none is missing)."""
    twin = mlx_lm_model(hf_config_of(model))
    twin.load_weights(list(tree_flatten(model.parameters())), strict=True)
    mx.eval(twin.parameters())
    return twin


def make_repeater_model(vocab_size: int = 49152, seed: int = 0) -> Model:
    """A model that predicts its last token again: attention and MLPs output zero, so the
    residual stream is the token's embedding, and the tied vocabulary projection scores
    that token highest. Greedy decoding repeats the prompt's last token — text that
    prompt lookup (speculative decoding's n-gram proposer) can predict."""
    model = Model(ModelConfig.from_hf(tiny_config("llama", vocab_size,
                                                  tie_word_embeddings=True)))
    mx.random.seed(seed)
    weights = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("embed_tokens.weight"):
            weights.append((name, mx.random.normal(p.shape)))
        elif "norm" in name:
            weights.append((name, mx.ones(p.shape)))
        else:
            weights.append((name, mx.zeros(p.shape)))
    model.load_weights(weights)
    mx.eval(model.parameters())
    return model
