"""Mixture of Experts: the sparse feed-forward block of Qwen3-MoE and Qwen2-MoE.

A sparse layer holds ``E`` SwiGLU experts and a router. Each token row of the step goes
through only ``k`` of them, so a model with many parameters costs per token what a much
smaller dense model costs. Three steps, each independent of the cache and the scheduler:

1. **Route** (``route``): router logits ``x @ Wg`` [T, E] -> softmax (float32) -> the top-k
   experts of each row and their probabilities, renormalised to sum to one when the
   checkpoint says ``norm_topk_prob``.
2. **Dispatch** (``dispatch``): the ``T*k`` (row, expert) assignments are sorted by expert,
   so that each expert's rows are contiguous; the rows are gathered in that order. Then
   either one gathered matmul (``mx.gather_mm``) multiplies every row by its expert's
   weights, or a loop runs one plain matmul per active expert over its slice of rows
   (``Experts``). Which one is a measured choice (``SparseMoeBlock.dispatch_mode``).
3. **Combine** (``combine``): the expert outputs are put back in assignment order and each
   row's ``k`` outputs are summed with the routing weights, in the router's order. A row's
   sum reads only its own ``k`` outputs: rows of different requests never mix.

Qwen2-MoE adds a shared expert (a dense SwiGLU every token goes through) scaled by
``sigmoid(x @ w_shared_gate)``. Which layers are sparse is the config's business
(``ModelConfig.is_sparse_layer``); the model file only builds a ``SparseMoeBlock`` there.

Parameter names follow mlx-lm (``mlp.gate``, ``mlp.switch_mlp.{gate,up,down}_proj``, stacked
``[E, out, in]``), so MLX-converted checkpoints load unchanged and Hugging Face's per-expert
tensors are stacked at load time (``loader.stack_experts``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from tiny_llm.kernels.cpu_kernels import KernelPlan
from tiny_llm.kernels.device import plans_for_gpu

import mlx.core as mx
import mlx.nn as nn


# ANCHOR: route
class Routing(NamedTuple):
    experts: mx.array  # [T, k] int32: the chosen experts of each row, in the router's order
    weights: mx.array  # [T, k] float32: their routing weights


def route(logits: mx.array, top_k: int, normalize: bool) -> Routing:
    """The top-``top_k`` experts of each row of router ``logits [T, E]`` and their weights."""
    # TASK 7.1: route — Routing
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    experts = mx.argpartition(-probs, kth=top_k - 1, axis=-1)[:, :top_k]
    weights = mx.take_along_axis(probs, experts, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return Routing(experts.astype(mx.int32), weights)
    # END TASK
# ANCHOR_END: route


# ANCHOR: dispatch
class Dispatch(NamedTuple):
    order: mx.array  # [T*k]: assignment indices (row * k + slot) sorted by expert
    rows: mx.array  # [T*k, dim]: the input row of each sorted assignment
    expert_ids: mx.array  # [T*k]: the expert of each sorted assignment (ascending)


def dispatch(x: mx.array, experts: mx.array) -> Dispatch:
    """Group the assignments of ``experts [T, k]`` by expert and gather their rows of ``x``."""
    # TASK 7.2: dispatch — Dispatch
    flat = experts.reshape(-1)
    order = mx.argsort(flat)
    rows = x[order // experts.shape[1]]
    return Dispatch(order, rows, flat[order])
    # END TASK
# ANCHOR_END: dispatch


# ANCHOR: combine
def combine(outputs: mx.array, order: mx.array, weights: mx.array) -> mx.array:
    """Sum each row's expert ``outputs`` (sorted as ``order``) with its routing ``weights``."""
    # TASK 7.3: combine — Combine
    T, k = weights.shape
    in_order = mx.zeros_like(outputs).at[order].add(outputs)
    per_row = in_order.reshape(T, k, -1).astype(mx.float32)
    return (per_row * weights[..., None]).sum(axis=1).astype(outputs.dtype)
    # END TASK
# ANCHOR_END: combine


class ExpertLinear(nn.Module):
    """``E`` linear maps stacked as ``weight [E, out, in]``; row ``i`` uses expert ``ids[i]``."""

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        bound = 1 / math.sqrt(in_features)
        self.weight = mx.random.uniform(-bound, bound, (num_experts, out_features, in_features))

    def __call__(self, rows: mx.array, ids: mx.array) -> mx.array:
        out = mx.gather_mm(rows[:, None, :], self.weight.swapaxes(-1, -2), rhs_indices=ids,
                           sorted_indices=True)
        return out[:, 0, :]

    def grouped(self, rows: mx.array, bounds: list[tuple[int, int, int]]) -> mx.array:
        """The same product as one plain matmul per active expert: ``bounds`` lists
        ``(expert, start, end)`` of each expert's contiguous rows."""
        parts = [rows[s:e] @ self.weight[expert].T for expert, s, e in bounds]
        return mx.concatenate(parts, axis=0)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine"):
        return QuantizedExpertLinear(self.weight, group_size, bits)


class QuantizedExpertLinear(nn.Module):
    """``ExpertLinear`` with affine-quantized weights, multiplied without dequantizing."""

    def __init__(self, weight: mx.array, group_size: int, bits: int):
        super().__init__()
        self.group_size, self.bits = group_size, bits
        self.weight, self.scales, self.biases = mx.quantize(weight, group_size, bits)

    def __call__(self, rows: mx.array, ids: mx.array) -> mx.array:
        out = mx.gather_qmm(rows[:, None, :], self.weight, self.scales, self.biases,
                            rhs_indices=ids, transpose=True, group_size=self.group_size,
                            bits=self.bits, sorted_indices=True)
        return out[:, 0, :]

    def grouped(self, rows: mx.array, bounds: list[tuple[int, int, int]]) -> mx.array:
        parts = [mx.quantized_matmul(rows[s:e], self.weight[expert], self.scales[expert],
                                     self.biases[expert], transpose=True,
                                     group_size=self.group_size, bits=self.bits)
                 for expert, s, e in bounds]
        return mx.concatenate(parts, axis=0)


class Experts(nn.Module):
    """The ``E`` SwiGLU experts of a sparse layer, applied to rows grouped by expert."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = ExpertLinear(num_experts, dim, hidden)
        self.up_proj = ExpertLinear(num_experts, dim, hidden)
        self.down_proj = ExpertLinear(num_experts, hidden, dim)

    def __call__(self, rows: mx.array, ids: mx.array) -> mx.array:
        h = nn.silu(self.gate_proj(rows, ids)) * self.up_proj(rows, ids)
        return self.down_proj(h, ids)

    def per_expert(self, rows: mx.array, ids: mx.array) -> mx.array:
        """The same, as a loop of plain matmuls over the active experts (the alternative the
        MoE benchmark measures against the gathered matmul). Reads ``ids`` on the host."""
        bounds = expert_bounds(ids)
        h = nn.silu(self.gate_proj.grouped(rows, bounds)) * self.up_proj.grouped(rows, bounds)
        return self.down_proj.grouped(h, bounds)


def expert_bounds(sorted_ids: mx.array) -> list[tuple[int, int, int]]:
    """``(expert, start, end)`` of each run of equal ids in ``sorted_ids``."""
    ids = sorted_ids.tolist()
    bounds, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            bounds.append((ids[start], start, i))
            start = i
    return bounds


# ANCHOR: dispatch_choice
# On the CPU, a loop of per-expert GEMMs beats MLX's gathered matmul once experts get a few
# rows each (prefill chunks); at one or two rows per expert (decode) the gathered matmul
# wins. Tuned to the crossover of benches/bench_week3_moe.py's table 2. On a GPU the
# gathered matmul is the fast path.
LOOP_MIN_ROWS_PER_EXPERT = 3


def use_loop(mode: str, assignments: int, num_experts: int) -> bool:
    """Whether ``mode`` ("auto", "gather" or "loop") runs the per-expert loop for a step of
    ``assignments`` (row, expert) pairs."""
    if mode == "auto":
        return not plans_for_gpu() and assignments >= LOOP_MIN_ROWS_PER_EXPERT * num_experts
    if mode not in ("gather", "loop"):
        raise ValueError(f"dispatch_mode must be 'auto', 'gather' or 'loop', got {mode!r}")
    return mode == "loop"
# ANCHOR_END: dispatch_choice


# ANCHOR: sparse_block
class SparseMoeBlock(nn.Module):
    """Route, dispatch, run the experts, combine; plus the gated shared expert if any."""

    def __init__(self, dim: int, num_experts: int, top_k: int, hidden: int,
                 norm_topk_prob: bool, shared_expert: nn.Module | None = None):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.switch_mlp = Experts(num_experts, dim, hidden)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = nn.Linear(dim, 1, bias=False)
        self.num_experts = num_experts
        self.dispatch_mode = "auto"  # or "gather" / "loop" (the benchmark compares them)
        self.observer: Callable[[Routing], None] | None = None  # sees each step's routing

    def __call__(self, x: mx.array, kernels: KernelPlan | None = None) -> mx.array:
        routing = route(self.gate(x), self.top_k, self.norm_topk_prob)
        if self.observer is not None:
            self.observer(routing)
        grouped = dispatch(x, routing.experts)
        loop = use_loop(self.dispatch_mode, grouped.expert_ids.size, self.num_experts)
        run = self.switch_mlp.per_expert if loop else self.switch_mlp
        out = combine(run(grouped.rows, grouped.expert_ids), grouped.order, routing.weights)
        if "shared_expert" in self:
            out = out + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, kernels)
        return out
# ANCHOR_END: sparse_block
