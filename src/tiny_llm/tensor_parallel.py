"""Beyond one machine: tensor parallelism over ``mx.distributed``.

A model too large for one machine is split across ``N`` processes (ranks), one per
machine, each holding ``1/N`` of every layer. The split is Megatron's, two all-reduces
per layer:

- **Attention by KV-head groups.** Rank ``r`` holds KV heads ``r*Hkv/N .. (r+1)*Hkv/N - 1``
  and the query heads that read them: the output rows of q, k and v ("column" shards) and
  the matching input columns of o_proj ("row" shards). Its attention is complete for its
  heads; its o_proj product is a partial sum of the layer's output.
- **The feed-forward by its intermediate dimension**: gate and up by rows, down by
  columns. A Mixture-of-Experts layer splits every expert the same way and keeps the
  router whole on every rank: each rank routes every token as the others do, no token
  moves between ranks, and the work is equal by construction (experts placed on ranks
  would need an all-to-all of token rows and would idle the ranks whose experts are cold).
- **The embedding and the LM head stay whole**: a lookup is cheap, and only rank 0 needs
  logits (it samples), so the other ranks skip the head's work (an untied head's weights
  stay in every rank's memory).

The partial sums meet in ``all_reduce``: every rank gathers every rank's partial and adds
them in rank order. MLX's ring ``all_sum`` adds chunk by chunk in an order that depends
on the array's length, so with three ranks or more a row's bits would depend on how many
rows share the step; gathered and added in rank order, a row's sum depends only on that
row, the engine's batch invariance survives, and every rank holds the same bits.

**One scheduler, many workers.** Rank 0 runs the whole engine (scheduler, block manager,
tokenizer, sampler, server). Each step it sends the step's layout (``StepBatch``: token
ids, positions, block tables, slot mapping) to every other rank, and every rank runs the
forward on its shard; the collectives inside keep them in step. Every rank's page pool
has the same pages, holding its own KV heads only, so the block tables rank 0 writes mean
the same on every rank, and a rank's pool holds ``N`` times the tokens of one machine's
pool of the same bytes. Prefix caching, chunked prefill, preemption, speculation and
aborts are rank 0's bookkeeping and work unchanged. The steps travel over a TCP
connection of their own, not over ``mx.distributed``: the ring backend polls its sockets
while it waits, which would keep a core busy on every worker for as long as the engine
is idle.

The ranks meet and talk in ``tiny_llm.distributed`` (``ring``: the meeting and the step's
connections; ``workers``: rank 0's workers and a worker's loop, the launch).
"""

from __future__ import annotations

from dataclasses import replace
from math import gcd
from typing import Any

from tiny_llm.models.model import MLP, Model, ModelConfig
from tiny_llm.moe import SparseMoeBlock
from tiny_llm.step.batch import PagedLayout, ScheduledChunk, StepBatch
from tiny_llm.step.request import SequenceState

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class TensorParallelError(RuntimeError):
    """The ranks can no longer serve together (a worker died, or rank 0 went away)."""


# ANCHOR: tp_geometry
def valid_sizes(config: ModelConfig) -> list[int]:
    """The tensor-parallel sizes that split this model evenly: divisors of every head
    count and every feed-forward width."""
    common = 0
    for n in (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size,
              config.moe_intermediate_size, config.shared_expert_intermediate_size):
        common = gcd(common, n)
    return [d for d in range(1, common + 1) if common % d == 0]


def check_tensor_parallel(config: ModelConfig, size: int, model: Model | None = None) -> None:
    """Raise ValueError unless ``size`` ranks can each hold whole KV heads and an equal
    share of every layer (with ``model``, also whole groups of its quantized weights)."""
    sizes = valid_sizes(config)
    if model is not None:
        sizes = [n for n in sizes if all(w % n == 0 for w in _row_widths(model))]
    if size in sizes:
        return
    if size in valid_sizes(config):
        raise ValueError(f"tensor_parallel_size={size} would split groups of this model's "
                         f"quantized weights; valid sizes: {', '.join(map(str, sizes))}")
    widths = f"an MLP of {config.intermediate_size}"
    if config.num_experts:
        widths += f", experts of {config.moe_intermediate_size}"
    if config.shared_expert_intermediate_size:
        widths += f", a shared expert of {config.shared_expert_intermediate_size}"
    raise ValueError(
        f"tensor_parallel_size={size} does not divide this model: every rank holds whole KV "
        f"heads and an equal share of each layer, and it has {config.num_attention_heads} "
        f"attention heads, {config.num_key_value_heads} KV heads and {widths}; valid "
        f"sizes: {', '.join(map(str, valid_sizes(config)))}")


def _row_widths(model: Model) -> list[int]:
    """The input widths, in stored units (packed words, groups), of every layer a rank
    keeps a slice of the inputs of."""
    widths = []
    for block in model.model.layers:
        rows = [block.self_attn.o_proj]
        mlp = block.mlp
        rows += [mlp.down_proj] if isinstance(mlp, MLP) else [mlp.switch_mlp.down_proj]
        if isinstance(mlp, SparseMoeBlock) and "shared_expert" in mlp:
            rows.append(mlp.shared_expert.down_proj)
        widths += [v.shape[-1] for layer in rows for k, v in layer.parameters().items()
                   if k != "bias"]
    return widths


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The model one rank holds: its heads and its share of each feed-forward."""
    return replace(
        config, head_dim=config.head_dim,
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=config.num_key_value_heads // size,
        intermediate_size=config.intermediate_size // size,
        moe_intermediate_size=config.moe_intermediate_size // size,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // size)
# ANCHOR_END: tp_geometry


# ANCHOR: shard_linear
def shard_linear(layer: nn.Module, split: str, rank: int, size: int) -> None:
    """Keep rank ``rank``'s share of ``layer`` (a linear layer, quantized or not, or a
    stack of experts' ``[E, out, in]``): ``split="column"`` keeps a slice of its output
    features, ``"row"`` a slice of its input features (a row shard's output is a partial
    sum). Quantized weights are sliced as stored: packed words and their groups' scales
    and biases, which needs the slice to hold whole groups."""
    # TASK 8.1: shard_linear — Sharding a linear layer
    if split == "row" and "bias" in layer:
        raise ValueError("a row-sharded layer's bias would be added once per rank")
    params = layer.parameters()
    axes = {name: -1 if (split == "row" or name == "bias") else -2 for name in params}
    for name, value in params.items():  # every check before any slice: all or nothing
        if value.shape[axes[name]] % size:
            what = "its groups of quantized weights" if name in ("scales", "biases") else name
            raise ValueError(f"cannot split {what} ({value.shape[axes[name]]} along axis "
                             f"{axes[name]}) {size} ways")
    for name, value in params.items():
        step = value.shape[axes[name]] // size
        index = [slice(None)] * value.ndim
        index[axes[name]] = slice(rank * step, (rank + 1) * step)
        layer[name] = mx.contiguous(value[tuple(index)])
    # END TASK
# ANCHOR_END: shard_linear


# ANCHOR: all_reduce
def all_reduce(x: mx.array, group: mx.distributed.Group) -> mx.array:
    """The sum of every rank's ``x``, added in rank order: the same bits on every rank,
    and a row's sum depends only on that row."""
    # TASK 8.2: all_reduce — Where the partial sums meet
    parts = mx.distributed.all_gather(x, group=group)  # rank r's rows at r * len(x)
    parts = parts.reshape(group.size(), *x.shape)
    total = parts[0]
    for r in range(1, group.size()):
        total = total + parts[r]
    return total
    # END TASK


class AllReduce(nn.Module):
    """A sharded module whose output is this rank's partial sum, summed over the ranks."""

    def __init__(self, module: nn.Module, group: mx.distributed.Group):
        super().__init__()
        self.module = module
        self.group = group

    def __call__(self, *args: Any) -> mx.array:
        return all_reduce(self.module(*args), self.group)
# ANCHOR_END: all_reduce


# ANCHOR: shard_model
def shard_model(model: Model, group: mx.distributed.Group) -> None:
    """Keep this rank's share of every layer of ``model`` (in place; given a model whose
    weights are not evaluated yet, each tensor is read once and only its share is kept)
    and sum the partials after each attention and each feed-forward."""
    rank, size = group.rank(), group.size()
    check_tensor_parallel(model.config, size, model)  # before any layer is touched
    for block in model.model.layers:
        attn = block.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            shard_linear(proj, "column", rank, size)
        shard_linear(attn.o_proj, "row", rank, size)
        attn.n_heads //= size
        attn.n_kv_heads //= size
        block.self_attn = AllReduce(attn, group)
        mlp = block.mlp
        mlps = [mlp] if isinstance(mlp, MLP) else [mlp.switch_mlp]
        if isinstance(mlp, SparseMoeBlock) and "shared_expert" in mlp:
            mlps.append(mlp.shared_expert)
        for m in mlps:
            shard_linear(m.gate_proj, "column", rank, size)
            shard_linear(m.up_proj, "column", rank, size)
            shard_linear(m.down_proj, "row", rank, size)
        block.mlp = AllReduce(mlp, group)
    model.config = local_config(model.config, size)
    model.tensor_parallel = group
    # Now, not lazily: the whole weights are dropped, and a lazy array belongs to this
    # thread's stream (the server runs the engine on another thread).
    mx.eval(model.parameters())
# ANCHOR_END: shard_model


# ANCHOR: step_message
def step_message(batch: StepBatch) -> tuple[dict[str, Any], list[np.ndarray]]:
    """What a worker needs of a step: its rows and where their K/V live (no requests,
    no sampling: rank 0 samples)."""
    # TASK 8.3: step_message — Sending the step to the workers
    kv = batch.kv
    header = {"chunks": [[c.start, c.end] for c in batch.chunks],
              "query_start_loc": batch.query_start_loc, "context_lens": batch.context_lens,
              "decode_rows": batch.decode_rows}
    arrays = [batch.token_ids, batch.positions, kv.slot_mapping, *kv.page_metadata]
    return header, [np.array(a) for a in arrays]
    # END TASK


class Rank0Sequence(SequenceState):
    """A sequence as a worker sees it: its step's tokens arrive in the step's arrays, and
    everything else about it (its tokens so far, its sampling, its pages) stays on rank 0."""

    def __init__(self) -> None:
        super().__init__([])


def step_of_message(header: dict[str, Any], arrays: list[np.ndarray]) -> StepBatch:
    """The worker's copy of rank 0's step: the same rows, pages and layout (the tables
    are the block table's rows up to their first -1)."""
    tables = [row[row >= 0].tolist() for row in arrays[3]]
    token_ids, positions, slot_mapping, block_table, context_lens, query_start_loc = (
        mx.array(a) for a in arrays)
    return StepBatch(
        chunks=[ScheduledChunk(Rank0Sequence(), start, end) for start, end in header["chunks"]],
        token_ids=token_ids, positions=positions,
        query_start_loc=header["query_start_loc"], context_lens=header["context_lens"],
        logit_rows=mx.array([], dtype=mx.int32), sampling=[], drafts=[],
        decode_rows=header["decode_rows"],
        kv=PagedLayout(tables, slot_mapping, block_table, context_lens, query_start_loc))
# ANCHOR_END: step_message
