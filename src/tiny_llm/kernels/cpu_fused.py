"""A decode step's decoder layers as one op of the extension (``src/extensions/cpu_decoder.h``).

Op by op, a layer is about sixteen MLX ops: two norms, the projections, RoPE, the K/V
write, attention, SwiGLU, two residual additions and the reshapes between them. For a
decode step of a small model each op computes little, so building the ops in Python and
scheduling them in MLX is a large share of a one-request step, and even two ops a layer
leave over a hundred ops a step for the default model, each built and scheduled on the
main thread beside the cores' kernels (``benches/bench_cpu_decode.py`` and the book's
performance appendix measure it). For a step whose rows are all decode rows the model
runner therefore puts a ``FusedDecode`` (the pool, the step's layout, its schedule) in the
step's ``KernelPlan``, and the model runs each run of consecutive dense layers as one op,
``decoder_layers``; per layer:

- the input norm, the q/k/v projections (and their biases), the per-head q/k norms and
  RoPE;
- the K/V write: the step's rows into the layer's pages, in place;
- paged attention over those pages, o_proj, the residual, the post-attention norm, the
  SwiGLU MLP and its residual.

The op calls the functions that the op path's kernels call, on the same inputs in the same
order, and adds as its additions do, so each layer's output is the op path's bit for bit
(the tests compare them): batch invariance and every oracle of the op path hold as they
were.

The pages are written in place only when nothing but the KV pool holds them (no other
Python reference, view or pending graph: MLX's donation rule, ``donatable``), as op by op
``paged_kv_write`` writes in place only a pool it may donate; otherwise the step runs op by
op, whose write copies the pool and leaves the holder's array as it was. What the op takes
of each layer (its arrays and how they are laid out) is the model's block's to say
(``fused_layer``: the model reads its own modules, by role); it is worked out once and
reused while the layer's modules and arrays stay the same objects. A weight replaced
(``load_weights``, ``update``, a new module) is read again; one changed in place in MLX
(``w += d``, ``w[i] = x``, which keep the Python object) is not, and decode steps would go
on multiplying by the old values: change weights by replacing them while an engine serves.

The fused layers serve what those kernels serve: float32 on a CPU stream with the reference
extension (a learner's kernels run op by op: they are what the course tests), projections
that are all ``Linear`` or all ``QuantizedLinear`` of one served format within each call
(q/k/v, o, gate/up, down), no biases but q/k/v's, a dense MLP, and an attention backend that
attends over the extension's pages with its kernels (Day 4's and Day 5's kernel backends:
the runner offers a ``FusedDecode`` only with those). MoE layers run op by op between runs
of fused ones; anything else, and every step with prefill rows, runs op by op.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from tiny_llm.kernels.cpu_kernels import (
    KernelPlan,
    Linear,
    QuantizedLinear,
    kernel_reads_scales,
    kernels_on,
)
from tiny_llm.kernels.extension import extension, reference_extension

import mlx.core as mx
import mlx.nn as nn

# Layers run as fused ops since the process started (tests check the path is taken).
fused_layers_run = 0


class LayerArrays(NamedTuple):
    """One layer's arrays, in the order ``decoder_run`` takes them (``DecoderLayerArrays``
    in ``cpu_decoder.h``). A projection is ``(arrays, group_size, bits)``: bits 0 for
    float32 weights ``[w, ...]``, else ``[w, scales, biases, ...]``."""

    input_norm: mx.array
    qkv: tuple[list[mx.array], int, int]
    qkv_biases: list[mx.array]  # [] or q, k and v's
    qk_norms: list[mx.array]  # [] or Qwen3's q_norm and k_norm weights
    inv_freq: mx.array  # RoPE's per-pair inverse frequencies
    post_norm: mx.array
    o_proj: tuple[list[mx.array], int, int]
    gate_up: tuple[list[mx.array], int, int]
    down: tuple[list[mx.array], int, int]


class FusedLayer(NamedTuple):
    """A decoder layer as decoder_run takes it (``arrays``), its pools' index (``layer``)
    and what the layers of one run must share (``shared``): the model's blocks make theirs
    (``TransformerBlock.fused_layer``)."""

    arrays: LayerArrays
    layer: int
    shared: tuple[Any, ...]


def fused_decoder_layers(blocks: list[Callable[..., mx.array]],
                         ops: list[FusedLayer | None], x: mx.array, positions: mx.array, cache: Any,
                         kernels: KernelPlan) -> mx.array | None:
    """``x`` through ``blocks`` (the model's decoder layers, in order) with each run of
    consecutive layers the fused op serves as one op (``ops``: each block as the op takes
    it, None where it does not serve it) and the others op by op (attending through
    ``cache``), or None when the step is not one it serves (then the caller runs every
    layer op by op). ``kernels.fused``: the step's pool and layout."""
    fused = kernels.fused
    if (fused is None or x.ndim != 2 or not kernels_on(kernels, x)
            or extension() is not reference_extension()):
        return None
    pool = fused.pool
    if not any(ops):
        return None
    _rehandle(pool)
    if not _pools_held_by_pool_only(pool):
        return None
    if positions.dtype != mx.int32:
        positions = positions.astype(mx.int32)
    ext = reference_extension()
    step_rows = (fused.slot_mapping, *fused.page_metadata)  # every run's
    global fused_layers_run
    first = 0
    while first < len(blocks):
        if ops[first] is None:
            x = blocks[first](x, positions, cache, kernels)
            first += 1
            continue
        last = first + 1
        while last < len(blocks) and ops[last] is not None and (
                ops[last].shared == ops[first].shared):
            last += 1
        run = _decoder_run(blocks[first], ops[first:last])
        layers = [op.layer for op in ops[first:last]]
        x = ext.decoder_layers(run, x, [pool.k[i] for i in layers], [pool.v[i] for i in layers],
                               positions, *step_rows, tiled=fused.tiled, int8=kernels.int8)
        fused_layers_run += last - first
        first = last
    return x


def _decoder_run(first: Callable[..., mx.array], ops: list[FusedLayer]) -> Any:
    """The extension's checked run of these layer ops, kept for the run's first block."""
    cached = _runs.get(id(first))
    if cached is not None and len(cached[0]) == len(ops) and all(
            map(operator.is_, cached[0], ops)):
        return cached[1]
    n_heads, n_kv_heads, head_dim, eps, post_eps, rope_dims, traditional, rope_scale, qk_eps, \
        scale = ops[0].shared
    run = reference_extension().decoder_run(
        [op.arrays for op in ops], n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        eps=eps, post_eps=post_eps, rope_dims=rope_dims, rope_traditional=traditional,
        rope_scale=rope_scale, qk_eps=qk_eps, scale=scale)
    _remember(_runs, first, (ops, run))
    return run


def _rehandle(pool: Any) -> None:
    """Each entry of the pool's lists becomes a new handle on the same array (no copy):
    whoever still holds the old Python object then holds an MLX handle of their own, which
    MLX's is_donatable counts."""
    ext = reference_extension()
    for arrays in (pool.k, pool.v):
        arrays[:] = [ext.new_handle(a) for a in arrays]


def _pools_held_by_pool_only(pool: Any) -> bool:
    """Whether the decoder op may write every layer's pages in place: nothing but the pool
    holds each array (no other Python name, view or graph node; after ``_rehandle``)."""
    return all(map(reference_extension().donatable, pool.k + pool.v))


# Each run's checked run, kept here rather than on the modules, with the layers it was made
# of: while those are the same, so is the run.
_runs: dict[int, tuple[list[FusedLayer], Any]] = {}


def _remember(cache: dict[int, Any], owner: Any, entry: Any) -> None:
    if id(owner) not in cache:  # forgotten with its owner, before its id can be reused
        weakref.finalize(owner, cache.pop, id(owner), None)
    cache[id(owner)] = entry


def decoder_projections(layers: list[nn.Module], biases_allowed: bool = False
                 ) -> tuple[list[mx.array], int, int] | None:
    """The layers' weights as the fused ops take them: ``(arrays, group_size, bits)``, bits
    0 for float32 weights; None unless the op path would send them to the extension's
    decode kernels in one call (and without biases, but for q/k/v's)."""
    first = layers[0]
    with_bias = has_bias(first)
    if (with_bias and not biases_allowed) or any(has_bias(m) != with_bias for m in layers):
        return None
    if isinstance(first, Linear):
        weights = [m.weight for m in layers]
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
        arrays += (m.weight, m.scales, m.biases)
    if mode != "affine" or not reference_extension().quantized_kernel_serves(group, bits):
        return None
    return arrays, group, bits


def has_bias(layer: nn.Module) -> bool:
    """Whether a linear layer adds a bias (MLX's ``Linear`` holds one only if it does)."""
    return "bias" in layer.keys()
