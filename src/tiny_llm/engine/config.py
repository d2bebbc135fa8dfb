"""The engine's options: ``EngineConfig``, checked as a whole when it is made, and the
registry of attention backends the option ``attention`` chooses from."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tiny_llm.day1_batching import POLICIES, DenseAttention
from tiny_llm.day3_paged_kv import GatherAttention
from tiny_llm.day4_paged_attention import PageWalkAttention, VectorKernelAttention
from tiny_llm.day5_paged_flash import FlashAttention, TiledWalkAttention
from tiny_llm.engine.pool_size import MAX_POOL_FRACTION
from tiny_llm.sampling.params import LOGPROBS_MODES
from tiny_llm.speculative import SPECULATIVE
from tiny_llm.step.batch import TokenTree

import numpy as np

KV_CACHES = ("dense", "paged")

# ANCHOR: attention_registry
ATTENTION_BACKENDS = {
    backend.name: backend
    for backend in (
        DenseAttention,  # Day 1: dense per-request caches
        GatherAttention,  # Day 3: pages, gathered back into dense K/V
        PageWalkAttention,  # Day 4: the page walk in MLX ops
        VectorKernelAttention,  # Day 4: the vector schedule (C++ / Metal)
        TiledWalkAttention,  # Day 5: the tiled walk in MLX ops
        FlashAttention,  # Day 5: vector decode rows + tiled multi-token queries (C++ / Metal)
    )
}
DEFAULT_ATTENTION = {"dense": "dense", "paged": "flash"}
# ANCHOR_END: attention_registry

DEFAULT_MAX_NUM_SEQS = 32


# ANCHOR: engine_config
@dataclass
class EngineConfig:
    max_num_seqs: int | None = None  # requests at once (the "slots"); 32, or the budget if less
    max_num_batched_tokens: int = 512  # the token budget of one step
    max_model_len: int | None = None  # prompt + output; default: the model's context length
    scheduler: str = "continuous"  # or "static", the Day 1 baseline
    enable_chunked_prefill: bool = True  # Day 2; off: a prompt is prefilled in one step
    long_prefill_token_threshold: int | None = None  # Day 2: most tokens one prompt gets a step
    kv_cache: str = "paged"  # "dense": per-request caches (Days 1-2); "paged" (Day 3)
    page_size: int = 16  # tokens per KV page (paged)
    num_pages: int | None = None  # pool size in pages (paged) ...
    kv_memory_bytes: int | None = None  # ... or in bytes ...
    kv_memory_fraction: float | None = None  # ... or as a fraction of available memory
    enable_prefix_caching: bool = True  # reuse cached full pages of shared prompt prefixes
    attention: str | None = None  # a name in ATTENTION_BACKENDS; default: the storage's best
    speculative: str = "off"  # "draft" (a smaller model) or "ngram" (prompt lookup)
    num_speculative_tokens: int | None = None  # a chain of this many drafts (default 4) ...
    speculative_token_tree: Any = None  # ... or a tree of them: paths of child ranks
    speculative_max_batch: int = 8  # no drafts above this many running (chosen: see the book)
    draft_model: Any = None  # "draft": a path or hub id, or a (Model, Tokenizer) pair
    cpu_kernels: bool = True  # the extension's CPU matmuls, norms, RoPE, SwiGLU; False: MLX ops
    int8_activations: bool = False  # quantized layers' decode rows in int8 (the CPU kernels)
    fused_layers: bool = True  # decode steps' dense layers as one op (the CPU kernels)
    tensor_parallel_size: int = 1  # ranks the model is split over (processes of mlx.launch)
    tensor_parallel_timeout: float = 120.0  # seconds a step may take before rank 0 gives up
    logprobs_mode: str = "raw_logprobs"  # or "processed_logprobs": TokenLogprob
# ANCHOR_END: engine_config

    def __post_init__(self) -> None:
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_seqs is None:  # as many as mlx-lm's batch_generate runs at once
            self.max_num_seqs = min(DEFAULT_MAX_NUM_SEQS, self.max_num_batched_tokens)
        for name in ("max_num_seqs", "page_size", "tensor_parallel_size",
                     "speculative_max_batch"):
            _check_int(name, getattr(self, name), 1)
        for name, least in (("max_model_len", 2), ("num_pages", 1), ("kv_memory_bytes", 1),
                            ("long_prefill_token_threshold", 1), ("num_speculative_tokens", 1)):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), least)
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "cpu_kernels",
                     "int8_activations", "fused_layers"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.int8_activations and not self.cpu_kernels:
            raise ValueError("int8_activations is a mode of the CPU kernels: it needs "
                             "cpu_kernels=True")
        if self.int8_activations and self.speculative != "off":
            # Verification rows are not decode rows: they would keep float32 activations,
            # and a request's tokens would mix the two roundings.
            raise ValueError("int8_activations rounds decode rows only; speculative "
                             "decoding verifies drafts in rows of several tokens: choose one")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}), or running requests could not all decode"
            )
        _check_choice("scheduler", self.scheduler, POLICIES)
        _check_choice("kv_cache", self.kv_cache, KV_CACHES)
        fraction = self.kv_memory_fraction
        if fraction is not None and not (
            isinstance(fraction, int | float) and not isinstance(fraction, bool)
            and 0 < fraction <= MAX_POOL_FRACTION
        ):
            raise ValueError(
                f"kv_memory_fraction must be a number in (0, {MAX_POOL_FRACTION}], got {fraction!r}"
            )
        sizes = [n for n in ("num_pages", "kv_memory_bytes", "kv_memory_fraction")
                 if getattr(self, n) is not None]
        if len(sizes) > 1:
            raise ValueError(f"give at most one of num_pages, kv_memory_bytes and "
                             f"kv_memory_fraction, not {' and '.join(sizes)}")
        if sizes and self.kv_cache != "paged":
            raise ValueError(f"{sizes[0]} sizes the page pool: it needs kv_cache='paged'")
        if self.attention is None:
            self.attention = DEFAULT_ATTENTION[self.kv_cache]
        _check_choice("attention", self.attention, tuple(ATTENTION_BACKENDS))
        storage = ATTENTION_BACKENDS[self.attention].storage
        if storage != self.kv_cache:
            raise ValueError(f"attention={self.attention!r} reads {storage} K/V; it needs "
                             f"kv_cache={storage!r}, not {self.kv_cache!r}")
        _check_choice("speculative", self.speculative, SPECULATIVE)
        _check_choice("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        if self.speculative != "off" and self.kv_cache != "paged":
            raise ValueError("speculative decoding rewinds the paged cache: it needs "
                             "kv_cache='paged'")
        timeout = self.tensor_parallel_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"tensor_parallel_timeout must be a number of seconds > 0, "
                             f"got {timeout!r}")
        if self.tensor_parallel_size > 1 and self.kv_cache != "paged":
            raise ValueError("tensor parallelism shares rank 0's block tables with every rank: "
                             "it needs kv_cache='paged'")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("speculative='draft' and draft_model go together: give both or "
                             "neither")
        self._check_token_tree()

    def _check_token_tree(self) -> None:
        """``speculative_token_tree`` parsed (a chain of ``num_speculative_tokens`` when not
        given), and refused where the drafts' proposer cannot serve it (the attention
        backend says so at engine build: ``AttentionGeometry.token_trees``)."""
        if self.speculative_token_tree is None:
            self.speculative_token_tree = TokenTree.chain(self.num_speculative_tokens or 4)
            self.num_speculative_tokens = len(self.speculative_token_tree)
            return
        tree = TokenTree.parse(self.speculative_token_tree)
        if self.speculative == "off":
            raise ValueError("speculative_token_tree shapes the drafts: it needs "
                             "speculative='ngram' or 'draft'")
        if self.num_speculative_tokens not in (None, len(tree)):
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens}, but "
                             f"speculative_token_tree has {len(tree)} nodes: give one of them")
        if not tree.is_chain and self.tensor_parallel_size > 1:
            raise ValueError("tensor parallelism sends its workers causal steps: a "
                             "speculative_token_tree that branches needs tensor_parallel_size=1")
        self.speculative_token_tree, self.num_speculative_tokens = tree, len(tree)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {', '.join(unknown)}; "
                f"valid options: {', '.join(sorted(known))}"
            )
        return cls(**options)


def _check_int(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
