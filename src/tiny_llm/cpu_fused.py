"""A decoder layer of a decode step as two ops of the extension (``src/extensions/cpu_decoder.h``).

Op by op, a layer is about sixteen MLX ops: two norms, the projections, RoPE, the K/V
write, attention, SwiGLU, two residual additions and the reshapes between them. For a
decode step of a small model each op computes little, and building the ops in Python and
scheduling them in MLX cost about a fifth of a one-request step on the development machine
(16.1 against 13.2 ms fused at 512 tokens of context, ``benches/bench_vs_llama_cpp.py``).
Inside ``kernel_forward`` a step whose rows are all decode rows therefore runs each dense
layer as

- ``decoder_qkv``: the input norm, the q/k/v projections (and their biases), the per-head
  q/k norms and RoPE, giving q, k and v;
- the attention backend's K/V write (``write_pages``: in place, as op by op);
- ``decoder_rest``: paged attention over those pages, o_proj, the residual, the post-attention
  norm, the SwiGLU MLP and its residual.

Both ops call the functions that the op path's kernels call, on the same inputs in the same
order, and add as its additions do, so the layer's output is the op path's bit for bit (the
tests compare them): batch invariance and every oracle of the op path hold as they were.

The fused layer serves what those kernels serve: float32 on a CPU stream with the reference
extension (a learner's kernels run op by op: they are what the course tests), projections
that are all ``Linear`` or all ``QuantizedLinear`` of one served format within each call
(q/k/v, o, gate/up, down), no biases but q/k/v's, a dense MLP, and an attention backend that
writes the extension's pages and attends with its kernels (Day 4's and Day 5's kernel
backends offer ``write_pages``). Anything else, and every step with prefill rows, runs op
by op.
"""

from __future__ import annotations

from typing import Any

from tiny_llm.cpu_kernels import Linear, QuantizedLinear, fused_step, kernel_reads_scales, native
from tiny_llm.extension import extension

import mlx.core as mx
import mlx.nn as nn

# Layers run as fused ops since the process started (tests check the path is taken).
fused_layers_run = 0


def fused_decoder_layer(block: nn.Module, x: mx.array, positions: mx.array,
                        cache: Any) -> mx.array | None:
    """``block(x, positions, cache)`` as two fused ops, or None where they do not serve it
    (then the caller runs the layer op by op)."""
    step = fused_step()
    write_pages = getattr(cache, "write_pages", None)
    if (step is None or write_pages is None or x.ndim != 2 or x.shape[0] > step[0]
            or x.dtype != mx.float32 or extension() is not native()):
        return None
    # Children as dict items: block.self_attn would go through nn.Module.__getattr__
    # (Python) for each of the dozens of reads a layer makes.
    attn, mlp = block["self_attn"], block["mlp"]
    if "gate_proj" not in mlp:
        return None  # a Mixture-of-Experts block
    q_proj, k_proj, v_proj = attn["q_proj"], attn["k_proj"], attn["v_proj"]
    qkv = _projections([q_proj, k_proj, v_proj], biases_allowed=True)
    o_proj = _projections([attn["o_proj"]])
    gate_up = _projections([mlp["gate_proj"], mlp["up_proj"]])
    down = _projections([mlp["down_proj"]])
    if qkv is None or o_proj is None or gate_up is None or down is None:
        return None
    in_norm, post_norm = block["input_layernorm"], block["post_attention_layernorm"]
    if in_norm["weight"].dtype != mx.float32 or post_norm["weight"].dtype != mx.float32:
        return None
    qk_norms, qk_eps = [], 0.0
    if "q_norm" in attn:
        q_norm, k_norm = attn["q_norm"], attn["k_norm"]
        if q_norm.eps != k_norm.eps:
            return None
        qk_norms, qk_eps = [q_norm["weight"], k_norm["weight"]], q_norm.eps
    ext, rope, int8 = native(), attn["rope"], step[1]
    if positions.dtype != mx.int32:
        positions = positions.astype(mx.int32)
    q, k, v = ext.decoder_qkv(
        x, in_norm["weight"], qkv, positions, rope._inv_freq, n_heads=attn.n_heads,
        n_kv_heads=attn.n_kv_heads, eps=in_norm.eps, rope_dims=rope.dims,
        rope_traditional=rope.traditional, rope_scale=rope.scale,
        qkv_biases=[q_proj["bias"], k_proj["bias"], v_proj["bias"]] if "bias" in q_proj else [],
        qk_norms=qk_norms, qk_eps=qk_eps, int8=int8)
    k_pages, v_pages = write_pages(attn.layer, k, v)
    global fused_layers_run
    fused_layers_run += 1
    return ext.decoder_rest(x, q, k_pages, v_pages, *cache.page_metadata(), attn.scale,
                            cache.tiled, o_proj, post_norm["weight"], post_norm.eps, gate_up,
                            down, int8=int8)


def _projections(layers: list[nn.Module], biases_allowed: bool = False
                 ) -> tuple[list[mx.array], int, int] | None:
    """The layers' weights as the fused ops take them: ``(arrays, group_size, bits)``, bits
    0 for float32 weights; None unless the op path would send them to the extension's
    decode kernels in one call (and without biases, but for q/k/v's)."""
    first = layers[0]
    with_bias = "bias" in first
    if (with_bias and not biases_allowed) or any(("bias" in m) != with_bias for m in layers):
        return None
    if isinstance(first, Linear):
        weights = [m["weight"] for m in layers]
        if not all(isinstance(m, Linear) for m in layers) or any(
                w.dtype != mx.float32 for w in weights):
            return None  # (other dtypes take MLX's matmul op by op)
        return weights, 0, 0
    if not isinstance(first, QuantizedLinear):
        return None
    group, bits, mode = first.group_size, first.bits, first.mode
    arrays = []
    for m in layers:
        if (not isinstance(m, QuantizedLinear) or m.group_size != group or m.bits != bits
                or m.mode != mode or not kernel_reads_scales(m)):
            return None
        arrays += (m["weight"], m["scales"], m["biases"])
    if mode != "affine" or not native().quantized_kernel_serves(group, bits):
        return None
    return arrays, group, bits
