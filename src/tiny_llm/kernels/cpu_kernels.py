"""The model's CPU kernels from the extension: the matmuls of an engine step, RoPE, SwiGLU.

**Decode rows.** A decode step multiplies a few rows (one per running request) by every
weight matrix of the model. OpenBLAS packs each weight panel before it multiplies, so at
small M it reads and writes the weights more than once per call and runs at a fraction of
the memory bandwidth. The extension's ``linear`` (``src/extensions/cpu_linear.cpp``)
reads each weight row once for all the rows of the call, on the worker pool's threads,
and defines every output element as one dot product whose order depends on nothing but
K: a row's result is the same bits alone or next to any other rows.

**Prefill rows** are compute-bound, and there OpenBLAS's packed GEMM is faster than that
kernel. It runs on one thread (``blas.py``: its own threads collapse beside a busy
neighbour), so ``linear(..., blas=True)`` calls it on blocks of weight rows spread over
the worker pool instead: both cores, and a block goes to whichever thread is free. Where
you have given OpenBLAS threads of its own (``OPENBLAS_NUM_THREADS`` above 1), prefill
rows take MLX's matmul and those threads, not both at once.

Which rows take which is decided per step, not per call: the model runner hands the model a
``KernelPlan`` with the step's leading single-row sequences (``decode_rows``: decodes, which
every scheduler places first), and the model passes it down to each layer as an argument.
Every linear layer sends those rows to the decode kernel and the rest (prefill chunks,
speculative verification) to the split BLAS (on Linux; elsewhere MLX's matmul). A
request's decode rows therefore take the same kernel whether it runs alone or in any
batch. Without a plan (tests, oracles, the reference ``generate``, an engine with
``cpu_kernels=False``) the model runs on MLX's ops alone, as it does on GPU streams (the
Mac path: MLX's Metal matmul and rope) and in dtypes other than float32. The plan is an
argument, not a setting of the model: one model may serve several engines at once.

**Elementwise layers.** MLX's CPU rope with a position per row (the flat batch's case)
runs as a chain of about a dozen ops, which made it the costliest op of a decode step
after the matmuls; its CPU ``exp`` is slow enough that SiLU over a step's MLP rows
costs more than the matmul next to it at large batches; and its CPU ``rms_norm`` is a
chain too (two per layer and one more per step). The extension has each as one op
(``src/extensions/cpu_layers.cpp``): ``rope`` computes the same angles as ``mx.fast.rope``
(``theta = (position * scale) * inv_freq``, ``inv_freq`` from ``rope_inv_freq``),
``swiglu`` is ``silu(gate) * up`` and ``rms_norm`` is ``mx.fast.rms_norm``'s formula.
With a plan they serve every CPU float32 row.

**Quantized weights as stored** (``load(dequantize=False)``, ``--quantized``): a
``QuantizedLinear`` (and a tied ``QuantizedEmbedding`` head) in MLX's affine layout takes
``quantized_linears``, the same split by rows: decode rows by the extension's
``quantized_linear`` (``src/extensions/cpu_qlinear.cpp``), which reads the packed bytes
once for all the rows of the call (4 bits a weight instead of float32's 32, plus the
groups' scales and biases) in an order that depends on nothing but K, the group size and
the bit width; prefill rows by blocks dequantized to float32 for the split BLAS. It serves
4 and 8 bits in groups of a multiple of 32; other formats take MLX's ``quantized_matmul``.
Scales and biases are read in the dtype the checkpoint stores them in (the loader keeps
float16 and bfloat16 ones on the CPU): the kernel widens them to float32 as it reads them,
which is exact, so they give the bits of float32 copies from half the bytes.

**Int8 activations, an option** (``EngineConfig(int8_activations=True)``,
``--int8-activations``): the decode rows of quantized layers are rounded to int8 per 32
values (scale ``max|x| / 127``) and multiplied by the packed weights as integers, exactly,
then scaled once per lane, as llama.cpp does for its quantized formats. Logits move by
the rounding (the tests state how far from MLX's float products); a row's result still
depends on nothing but the row, so batch invariance holds as before. It pays from a few
rows up, where the float kernel is bound by unpacking the weights (``int8_kernel_serves``
names the formats: 4 and 8 bits, groups of 32, 64 or 128 and other divisors or multiples
of 64 bytes of packed weights).

**One pass for a layer's projections.** ``apply_linears(x, q_proj, k_proj, v_proj)`` (and
gate with up) multiplies one input by several weights in one call of the kernels: one run
of the worker pool for all their blocks, so the small k and v matrices do not each end
with a thread waiting for the other.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tiny_llm.kernels.blas import openblas_threads
from tiny_llm.kernels.device import plans_for_gpu
from tiny_llm.kernels.extension import reference_extension

import mlx.core as mx
import mlx.nn as nn


# ANCHOR: kernel_plan
@dataclass(frozen=True)
class FusedDecode:
    """What the fused decoder layers need of a decode-only step (``cpu_fused.py``), offered
    by the attention backend whose kernels they run (its ``fused_decode``): the page pool
    they write, the step's rows in it, and the backend's schedule."""

    pool: Any  # Day 3's PagePool (per-layer ``k`` and ``v`` lists), written in place
    slot_mapping: mx.array  # int32 [T]: the pool row of every new token
    page_metadata: tuple[mx.array, mx.array, mx.array]  # the block-table interface's arrays
    tiled: bool  # the attention backend's schedule (Day 5's tiles or Day 4's vectors)


@dataclass(frozen=True)
class KernelPlan:
    """How one step's forward takes the extension's CPU kernels: made by the model runner,
    passed down the model to every layer. ``None`` in its place: MLX's ops alone."""

    decode_rows: int  # the first rows of every linear layer's input (and of the logits)
    int8: bool = False  # quantized layers multiply the decode rows with int8 activations
    fused: FusedDecode | None = None  # a decode-only step: runs of layers as fused ops


def kernels_available() -> bool:
    """Whether the extension's CPU kernels can serve the model: the CPU as the device the
    engine plans for, and the extension built."""
    return not plans_for_gpu() and reference_extension() is not None


def rows_argmax(x: mx.array) -> mx.array:
    """``mx.argmax(x, axis=-1)`` of rows ``[R, V]`` on the CPU: the extension's op for
    float32 rows (MLX's CPU argmax compares one element at a time), MLX's otherwise."""
    if x.dtype == mx.float32 and x.ndim == 2 and x.shape[1] > 0:
        return reference_extension().argmax_rows(x)
    return mx.argmax(x, axis=-1)


def kernels_on(kernels: KernelPlan | None, *arrays: mx.array) -> bool:
    """Whether ops on these inputs take the extension's kernels: with a plan (the runner
    makes one only where they can serve: a CPU, the extension built), in float32."""
    return kernels is not None and all(a.dtype == mx.float32 for a in arrays)


def kernel_reads_scales(layer: nn.Module) -> bool:
    """Whether the extension's quantized kernels read this layer's scales and biases: both
    of one dtype, float32 or, as checkpoints store them, float16 or bfloat16 (widened to
    float32 in the kernel, exactly)."""
    scales, biases = layer["scales"], layer.get("biases")
    return (biases is not None and biases.dtype == scales.dtype
            and scales.dtype in (mx.float32, mx.float16, mx.bfloat16))


def linears(x: mx.array, weights: list[mx.array], kernels: KernelPlan | None = None
            ) -> list[mx.array]:
    """``[x @ w.T for w in weights]``; with a plan, decode rows by the decode kernel and the
    rest by split BLAS, each in one call for all the weights (read in one pass)."""
    if x.ndim != 2 or x.shape[0] == 0 or not kernels_on(kernels, x, *weights):
        return [x @ w.T for w in weights]
    ext = reference_extension()
    return _by_row_kind(
        x, kernels.decode_rows, lambda rows: ext.linear_group(rows, weights),
        lambda rows: (ext.linear_group(rows, weights, blas=True) if split_blas()
                      else [rows @ w.T for w in weights]))


def quantized_linears(x: mx.array, layers: list[nn.Module], kernels: KernelPlan | None = None
                      ) -> list[mx.array]:
    """Each quantized layer's matmul (``nn.QuantizedLinear``'s, or a quantized embedding's
    ``as_linear``) of ``x``, the layers of one format; with a plan, decode rows by the
    extension's kernel from the packed bytes and the rest by dequantized blocks and split
    BLAS; formats it does not serve, and everything without a plan, by MLX's
    ``quantized_matmul``."""
    first = layers[0]
    if (x.ndim != 2 or x.shape[0] == 0 or first.mode != "affine" or not kernels_on(kernels, x)
            or not all(kernel_reads_scales(layer) for layer in layers)
            or not reference_extension().quantized_kernel_serves(first.group_size, first.bits)):
        return [mlx_quantized_matmul(x, layer) for layer in layers]
    ext, fmt, int8 = reference_extension(), (first.group_size, first.bits), kernels.int8
    # A module's parameters are its dict's items: layer["weight"] reads them directly, where
    # layer.weight goes through nn.Module.__getattr__ (Python), hundreds of times a step.
    packed = ([layer["weight"] for layer in layers], [layer["scales"] for layer in layers],
              [layer["biases"] for layer in layers])
    return _by_row_kind(
        x, kernels.decode_rows,
        lambda rows: ext.quantized_linear_group(rows, *packed, *fmt, int8=int8),
        lambda rows: (ext.quantized_linear_group(rows, *packed, *fmt, blas=True) if split_blas()
                      else [mlx_quantized_matmul(rows, layer) for layer in layers]))


def check_int8_activations(model: nn.Module) -> None:
    """Raise ValueError unless int8 activations can serve ``model``: on a CPU with the
    extension built, and quantized layers (weights kept as stored) all in formats the int8
    kernel serves."""
    if not kernels_available():
        raise ValueError("int8_activations runs on the extension's CPU kernels: it needs the "
                         "CPU as the default device and the extension built")
    layers = [(name, m) for name, m in model.named_modules()
              if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)]
    if not layers:
        raise ValueError("int8_activations multiplies quantized weights: this model has none "
                         "(load it with dequantize=False, --quantized on the command line)")
    for name, m in layers:
        if (m.mode != "affine" or m.get("biases") is None
                or not reference_extension().int8_kernel_serves(m.group_size, m.bits)):
            raise ValueError(f"int8_activations does not serve {name} ({m.bits} bits, groups "
                             f"of {m.group_size}, mode {m.mode!r})")


def mlx_quantized_matmul(x: mx.array, layer: nn.Module) -> mx.array:
    if x.size == 0:  # MLX's CPU kernel divides by the row count (a step without logit rows)
        return mx.zeros((*x.shape[:-1], layer["weight"].shape[0]), dtype=x.dtype)
    return mx.quantized_matmul(x, layer.weight, scales=layer.scales, biases=layer.get("biases"),
                               transpose=True, group_size=layer.group_size, bits=layer.bits,
                               mode=layer.mode)


def _by_row_kind(x: mx.array, decode_rows: int, decode: Callable[[mx.array], list[mx.array]],
                 prefill: Callable[[mx.array], list[mx.array]]) -> list[mx.array]:
    """The step's decode rows (its first ones) through ``decode``, the rest through
    ``prefill``, each product's two parts joined."""
    n = min(decode_rows, x.shape[0])
    parts = [decode(x[:n] if n < x.shape[0] else x)] if n else []
    if n < x.shape[0]:
        parts.append(prefill(x[n:] if n else x))
    return parts[0] if len(parts) == 1 else [mx.concatenate(ys) for ys in zip(*parts, strict=True)]


def linear(x: mx.array, weight: mx.array, kernels: KernelPlan | None = None) -> mx.array:
    """``x @ weight.T``, as ``linears`` computes it."""
    return linears(x, [weight], kernels)[0]
# ANCHOR_END: kernel_plan


@functools.cache
def split_blas() -> bool:
    """Whether prefill rows take the split BLAS: on Linux, with OpenBLAS on one thread (or
    the mlx wheel's reference BLAS, which has no threads)."""
    return reference_extension().has_blas_split and openblas_threads() in (None, 1)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters) whose matmul is ``linears``; quantized, it becomes a
    ``QuantizedLinear``."""

    def __call__(self, x: mx.array, kernels: KernelPlan | None = None) -> mx.array:
        return apply_linears(x, self, kernels=kernels)[0]

    def to_quantized(self, group_size: int | None = None, bits: int | None = None,
                     mode: str = "affine", quantize_input: bool = False) -> nn.Module:
        if quantize_input:
            return super().to_quantized(group_size, bits, mode, quantize_input)
        return QuantizedLinear.from_linear(self, group_size, bits, mode)


class QuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` (same parameters) whose matmul is ``quantized_linears``."""

    def __call__(self, x: mx.array, kernels: KernelPlan | None = None) -> mx.array:
        return apply_linears(x, self, kernels=kernels)[0]


class Embedding(nn.Embedding):
    """``nn.Embedding``; quantized, it becomes a ``QuantizedEmbedding``."""

    def to_quantized(self, group_size: int | None = None, bits: int | None = None,
                     mode: str = "affine", quantize_input: bool = False) -> nn.Module:
        if quantize_input:
            return super().to_quantized(group_size, bits, mode, quantize_input)
        return QuantizedEmbedding.from_embedding(self, group_size, bits, mode)


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` (a tied LM head) is
    ``quantized_linears``, and whose lookup gives ``output_dtype`` rows when it is set."""

    # The model's dtype where the scales are stored narrower (the loader keeps a
    # checkpoint's float16 scales on the CPU): mx.dequantize computes in the scales'
    # dtype, so the looked-up rows' scales are widened first, not the rows rounded.
    output_dtype: mx.Dtype | None = None

    def __call__(self, x: mx.array) -> mx.array:
        scales, biases = self["scales"][x], self.get("biases")
        biases = None if biases is None else biases[x]
        if self.output_dtype is not None and scales.dtype != self.output_dtype:
            scales = scales.astype(self.output_dtype)
            biases = None if biases is None else biases.astype(self.output_dtype)
        return mx.dequantize(self["weight"][x], scales=scales, biases=biases,
                             group_size=self.group_size, bits=self.bits, mode=self.mode)

    def as_linear(self, x: mx.array, kernels: KernelPlan | None = None) -> mx.array:
        return quantized_linears(x, [self], kernels)[0]


def apply_linears(x: mx.array, *layers: nn.Module, kernels: KernelPlan | None = None
                  ) -> list[mx.array]:
    """Each layer applied to one input ``x`` (a layer's q, k and v projections, or its gate
    and up), in one call of the kernels where the layers are all ``Linear`` or all
    ``QuantizedLinear`` of one format; otherwise each by its own (MLX's ops)."""
    if all(isinstance(layer, Linear) for layer in layers):
        ys = linears(x, [layer["weight"] for layer in layers], kernels)  # as in quantized_linears
    elif all(isinstance(layer, QuantizedLinear) for layer in layers) and len(
            {(layer.group_size, layer.bits, layer.mode) for layer in layers}) == 1:
        ys = quantized_linears(x, list(layers), kernels)
    else:  # each by its own: ours with the plan, any other module as it is
        return [layer(x, kernels) if isinstance(layer, Linear | QuantizedLinear) else layer(x)
                for layer in layers]
    return [y + layer["bias"] if "bias" in layer else y
            for y, layer in zip(ys, layers, strict=True)]


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameters); with a plan, CPU float32 rows take the extension's
    one op (MLX's CPU ``rms_norm`` is a chain of ops)."""

    def __call__(self, x: mx.array, kernels: KernelPlan | None = None) -> mx.array:
        weight = self["weight"]  # a dict read, as in quantized_linears
        if kernels_on(kernels, x, weight):
            return reference_extension().rms_norm(x, weight, self.eps)
        return super().__call__(x)


# ANCHOR: rope
def rope_inv_freq(dims: int, base: float, freqs: mx.array | None) -> mx.array:
    """Per-pair inverse frequencies, as ``mx.fast.rope`` computes them from ``base`` (or
    the reciprocal of ``freqs``, a checkpoint's rescaled frequencies)."""
    if freqs is not None:
        return mx.reciprocal(freqs.astype(mx.float32))
    half = dims // 2
    return mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (math.log(base) / half))


def rope(x: mx.array, positions: mx.array, inv_freq: mx.array, dims: int, traditional: bool,
         scale: float) -> mx.array:
    """RoPE of ``x [T, H, D]``, row t at ``positions[t]``, by the extension's one op."""
    if positions.dtype != mx.int32:
        positions = positions.astype(mx.int32)
    return reference_extension().rope(x, positions, inv_freq, dims, traditional, scale)
# ANCHOR_END: rope


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` by the extension's one op."""
    return reference_extension().swiglu(gate, up)
