"""The Qwen-style decoder we serve: Qwen3, Qwen2/Qwen2.5 and Llama (SmolLM2) in one file,
and their Mixture-of-Experts variants Qwen3-MoE and Qwen2-MoE.

The dense families differ in three switches only:

- ``qk_norm``: Qwen3 RMS-normalises every query and key head before RoPE;
- ``attention_bias``: Qwen2 adds biases to the q/k/v projections;
- ``rope_traditional``: whether RoPE rotates interleaved pairs (llama.cpp's layout) or
  the two halves of each head (Hugging Face's layout).

The model works on a *flat* batch: ``tokens [T]`` and ``positions [T]`` hold the new
tokens of every sequence in the step, back to back, with no padding. Attention is the one
place where sequences must not mix, so it is delegated to a ``KVCache`` object that knows
which rows belong to which sequence, stores their keys and values, and attends. The
chapters swap that object (dense per request, paged + gather, paged kernels); the model
never changes. An MoE config makes some layers' feed-forward a ``SparseMoeBlock``
(``moe.py``; ``ModelConfig.is_sparse_layer`` says which). Parameter names follow Hugging
Face (``model.layers.0.self_attn.q_proj``), so checkpoints and mlx-lm's model classes load
into it unchanged.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Protocol

from tiny_llm.kernels.cpu_fused import (
    FusedLayer,
    LayerArrays,
    decoder_projections,
    fused_decoder_layers,
    has_bias,
)
from tiny_llm.kernels.cpu_kernels import (
    Embedding,
    KernelPlan,
    Linear,
    RMSNorm,
    apply_linears,
    kernels_on,
    linear,
    rope,
    rope_inv_freq,
    swiglu,
)
from tiny_llm.moe import SparseMoeBlock

import mlx.core as mx
import mlx.nn as nn

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "qwen3_moe", "qwen2_moe")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")


@dataclass
class ModelConfig:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_traditional: bool = False
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 32768
    # Mixture of Experts (num_experts == 0: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {self.model_type!r}; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.model_type in MOE_MODEL_TYPES:
            self._check_moe()

    def _check_moe(self) -> None:
        if self.num_experts < 1 or self.moe_intermediate_size < 1:
            raise ValueError(f"{self.model_type} config needs num_experts >= 1 and "
                             f"moe_intermediate_size >= 1 (got {self.num_experts}, "
                             f"{self.moe_intermediate_size})")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be between "
                             f"1 and num_experts ({self.num_experts})")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers names layers that do not exist: {bad}")

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether ``layer``'s feed-forward is a sparse MoE block (else a dense MLP)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dictionary."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:  # before fields other models lack
            raise ValueError(
                f"unsupported architecture {model_type!r}; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        args = {k: v for k, v in config.items() if k in known}
        if args.get("num_key_value_heads") is None and "num_attention_heads" in args:
            args["num_key_value_heads"] = args["num_attention_heads"]  # HF default: MHA
        rope_params = config.get("rope_parameters") or {}
        if "rope_theta" not in args and "rope_theta" in rope_params:
            args["rope_theta"] = rope_params["rope_theta"]
        rope_type = rope_params.get("rope_type", "default")
        if args.get("rope_scaling") is None and rope_type != "default":
            args["rope_scaling"] = rope_params
        args["model_type"] = model_type
        args["qk_norm"] = model_type in ("qwen3", "qwen3_moe")
        if model_type in ("qwen2", "qwen2_moe"):
            args["attention_bias"] = True
        args["tie_word_embeddings"] = config.get(
            "tie_word_embeddings", model_type != "llama"
        )
        try:
            return cls(**args, extra={k: v for k, v in config.items() if k not in known})
        except TypeError as e:
            raise ValueError(f"config.json is missing a required field: {e}") from None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


# ANCHOR: kv_cache_protocol
class KVCache(Protocol):
    """Where attention reads and writes keys and values. Chapters provide implementations."""

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Store the step's new ``k, v [T, Hkv, D]`` for ``layer`` and return attention of
        ``q [T, Hq, D]`` over each sequence's keys (causal), shaped ``[T, Hq, D]``."""
        ...
# ANCHOR_END: kv_cache_protocol


# ANCHOR: rope
def rope_frequencies(config: ModelConfig) -> mx.array | None:
    """Per-pair inverse frequencies when the checkpoint rescales RoPE, else None."""
    scaling = config.rope_scaling
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type in ("default", "linear"):
        return None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
    dims = config.head_dim
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    freqs = config.rope_theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    wavelens = 2 * math.pi * freqs
    smooth = (old_len / wavelens - low) / (high - low)
    smoothed = freqs / ((1 - smooth) / factor + smooth)
    freqs = mx.where(wavelens > old_len / low, freqs * factor, freqs)
    is_medium = (wavelens <= old_len / low) & (wavelens >= old_len / high)
    return mx.where(is_medium, smoothed, freqs)


class RoPE(nn.Module):
    """Rotary embedding at arbitrary per-token positions (a flat batch has no shared offset)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dims = config.head_dim
        self.traditional = config.rope_traditional
        self.base = config.rope_theta
        scaling = config.rope_scaling or {}
        linear = (scaling.get("rope_type") or scaling.get("type")) == "linear"
        self.scale = 1.0 / scaling["factor"] if linear else 1.0
        self._freqs = rope_frequencies(config)
        self._inv_freq = rope_inv_freq(self.dims, self.base, self._freqs)
        # Computed now: a lazy array belongs to this thread's stream, and the engine may run
        # the model on another thread (the server's), where that stream does not exist.
        mx.eval(self._inv_freq, *([] if self._freqs is None else [self._freqs]))

    @property
    def inv_freq(self) -> mx.array:
        """Per-pair inverse frequencies (private to nn.Module: not a parameter)."""
        return self._inv_freq

    def __call__(self, x: mx.array, positions: mx.array, kernels: KernelPlan | None = None
                 ) -> mx.array:
        if kernels_on(kernels, x):  # the extension's one op (cpu_kernels.py says why)
            return rope(x, positions, self._inv_freq, self.dims, self.traditional, self.scale)
        # x: [T, H, D]. mx.fast.rope rotates along axis -2 starting at a per-batch offset,
        # so each token becomes its own batch entry of length 1 at offset = its position.
        T, H, D = x.shape
        y = mx.fast.rope(
            x.reshape(T, H, 1, D),
            self.dims,
            traditional=self.traditional,
            base=None if self._freqs is not None else self.base,
            scale=self.scale,
            offset=positions,
            freqs=self._freqs,
        )
        return y.reshape(T, H, D)
# ANCHOR_END: rope


# ANCHOR: attention
class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = hd = config.head_dim
        self.scale = hd**-0.5
        dim, bias = config.hidden_size, config.attention_bias
        self.q_proj = Linear(dim, self.n_heads * hd, bias=bias)
        self.k_proj = Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = Linear(self.n_heads * hd, dim, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, eps=config.rms_norm_eps)
        self.rope = RoPE(config)

    def __call__(self, x: mx.array, positions: mx.array, cache: KVCache,
                 kernels: KernelPlan | None = None) -> mx.array:
        T = x.shape[0]
        q, k, v = apply_linears(x, self.q_proj, self.k_proj, self.v_proj,  # one pass on a CPU
                                kernels=kernels)
        q = q.reshape(T, self.n_heads, self.head_dim)
        k = k.reshape(T, self.n_kv_heads, self.head_dim)
        v = v.reshape(T, self.n_kv_heads, self.head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q, kernels), self.k_norm(k, kernels)
        q, k = self.rope(q, positions, kernels), self.rope(k, positions, kernels)
        out = cache.attend(self.layer, q, k, v, self.scale)
        return self.o_proj(out.reshape(T, -1), kernels)
# ANCHOR_END: attention


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dim, hidden, bias=False)
        self.up_proj = Linear(dim, hidden, bias=False)
        self.down_proj = Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array, kernels: KernelPlan | None = None) -> mx.array:
        gate, up = apply_linears(x, self.gate_proj, self.up_proj, kernels=kernels)
        act = swiglu(gate, up) if kernels_on(kernels, gate) else nn.silu(gate) * up
        return self.down_proj(act, kernels)


# ANCHOR: feed_forward
def feed_forward(config: ModelConfig, layer: int) -> nn.Module:
    """A dense SwiGLU MLP, or a sparse MoE block where the config makes ``layer`` sparse."""
    if not config.is_sparse_layer(layer):
        return MLP(config.hidden_size, config.intermediate_size)
    shared = config.shared_expert_intermediate_size
    return SparseMoeBlock(
        config.hidden_size, config.num_experts, config.num_experts_per_tok,
        config.moe_intermediate_size, config.norm_topk_prob,
        shared_expert=MLP(config.hidden_size, shared) if shared else None,
    )
# ANCHOR_END: feed_forward


# ANCHOR: block
class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = feed_forward(config, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, positions: mx.array, cache: KVCache,
                 kernels: KernelPlan | None = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x, kernels), positions, cache, kernels)
        return h + self.mlp(self.post_attention_layernorm(h, kernels), kernels)
# ANCHOR_END: block

    # What the fused decode path (``kernels/cpu_fused.py``) takes of the block. Children as
    # dict items: self.self_attn would go through nn.Module.__getattr__.

    def fused_sources(self) -> list[dict]:
        """The modules whose items ``fused_layer`` reads: the block, its children and
        theirs (an MoE block's experts may be a list: its identity is an item too)."""
        children = [m for m in self.values() if isinstance(m, dict)]
        return [self, *children, *(m for c in children for m in c.values()
                                   if isinstance(m, dict))]

    def fused_layer(self) -> FusedLayer | None:
        """The block as the fused decoder op takes it (``Model.fused_layers`` keeps it while
        the block's sources keep their items). None for a Mixture-of-Experts block and for
        weights or norms the op's kernels do not serve."""
        attn, mlp = self["self_attn"], self["mlp"]
        if not isinstance(mlp, MLP):
            return None
        q_proj, k_proj, v_proj = attn["q_proj"], attn["k_proj"], attn["v_proj"]
        qkv = decoder_projections([q_proj, k_proj, v_proj], biases_allowed=True)
        o_proj = decoder_projections([attn["o_proj"]])
        gate_up = decoder_projections([mlp["gate_proj"], mlp["up_proj"]])
        down = decoder_projections([mlp["down_proj"]])
        if qkv is None or o_proj is None or gate_up is None or down is None:
            return None
        in_norm, post_norm = self["input_layernorm"], self["post_attention_layernorm"]
        if in_norm.weight.dtype != mx.float32 or post_norm.weight.dtype != mx.float32:
            return None
        qk_norms, qk_eps = [], 0.0
        if "q_norm" in attn:
            q_norm, k_norm = attn["q_norm"], attn["k_norm"]
            if q_norm.eps != k_norm.eps:
                return None
            qk_norms, qk_eps = [q_norm.weight, k_norm.weight], q_norm.eps
        rope = attn["rope"]
        biases = [q_proj.bias, k_proj.bias, v_proj.bias] if has_bias(q_proj) else []
        shared = (attn.n_heads, attn.n_kv_heads, attn.head_dim, in_norm.eps, post_norm.eps,
                  rope.dims, rope.traditional, rope.scale, qk_eps, attn.scale)
        arrays = LayerArrays(in_norm.weight, qkv, biases, qk_norms, rope.inv_freq,
                             post_norm.weight, o_proj, gate_up, down)
        return FusedLayer(arrays, attn.layer, shared)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = [TransformerBlock(config, i) for i in range(config.num_hidden_layers)]
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


# ANCHOR: model
class Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        # The group this model's layers are sharded over (``tensor_parallel.shard_model``);
        # None: every layer whole, on this process.
        self.tensor_parallel: mx.distributed.Group | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def __call__(
        self,
        tokens: mx.array,
        positions: mx.array,
        cache: KVCache,
        logit_rows: mx.array | None = None,
        kernels: KernelPlan | None = None,
    ) -> mx.array:
        """Run the step's flat batch ``tokens [T]`` at ``positions [T]``.

        Returns logits ``[R, vocab]`` for the rows in ``logit_rows`` (all ``T`` rows if
        None). The engine asks only for each sequence's last scheduled token: the vocab
        projection is the largest matmul of a step, so skipping the other rows matters.
        ``kernels``: the model runner's plan for the extension's CPU kernels (``cpu_kernels.py``),
        handed to every layer; None: MLX's ops alone.
        """
        return self.logits(self.hidden_states(tokens, positions, cache, kernels), logit_rows,
                           kernels)

    def logits(self, h: mx.array, logit_rows: mx.array | None = None,
               kernels: KernelPlan | None = None) -> mx.array:
        """The vocabulary's logits for the rows ``logit_rows`` of the last layer's ``h``."""
        if logit_rows is not None:
            h = h[logit_rows]
        h = self.model.norm(h, kernels)
        if not self.config.tie_word_embeddings:
            return self.lm_head(h, kernels)
        embed = self.model.embed_tokens
        if isinstance(embed, nn.QuantizedEmbedding):
            return embed.as_linear(h, kernels)
        return linear(h, embed.weight, kernels)

    def hidden_states(self, tokens: mx.array, positions: mx.array, cache: KVCache,
                      kernels: KernelPlan | None = None) -> mx.array:
        """Every row's output of the last layer (before the final norm)."""
        h = self.model.embed_tokens(tokens)
        layers = self.model.layers
        if kernels is not None and kernels.fused is not None and (out := fused_decoder_layers(
                layers, self.fused_layers(), h, positions, cache, kernels)) is not None:
            return out  # a decode step on a CPU: runs of layers as single ops, the same bits
        for layer in self.model.layers:
            h = layer(h, positions, cache, kernels)
        return h
# ANCHOR_END: model

    def fused_layers(self) -> list[FusedLayer | None]:
        """Each decoder block as the fused decoder op takes it, read again only when a block,
        or a module or array of one, was replaced (``load_weights``, ``update``, a new
        module). The check runs every decode step: one pass over the sources' items by
        identity, in C (``map``), not a walk of the blocks in Python."""
        blocks = self.model.layers
        cached = self.__dict__.get("_fused_layers")
        if cached is not None:
            held, sources, lengths, items, layers = cached
            if (len(blocks) == len(held) and all(map(operator.is_, blocks, held))
                    and list(map(len, sources)) == lengths
                    and all(map(operator.is_, chain.from_iterable(map(dict.values, sources)),
                                items))):
                return layers
        sources = [s for b in blocks for s in b.fused_sources()]
        layers = [b.fused_layer() for b in blocks]
        # object's setattr: nn.Module's would store the tuple among the model's parameters.
        object.__setattr__(self, "_fused_layers", (
            list(blocks), sources, list(map(len, sources)),
            list(chain.from_iterable(map(dict.values, sources))), layers))
        return layers

    @property
    def dtype(self) -> mx.Dtype:
        return self.model.norm.weight.dtype
