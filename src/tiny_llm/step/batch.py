"""One engine step as data: the scheduled chunks, the flat batch, and the attention seam.

A step runs one forward over the new tokens of several sequences, back to back with no
padding. The scheduler decides *which* tokens (``ScheduledChunk``: a request and the
positions ``start .. end - 1`` it computes this step); ``StepBatch.build`` lays them out
once, and everything downstream reads that one object:

- ``token_ids [T]`` and ``positions [T]``, the model's inputs;
- ``query_start_loc [B + 1]``: sequence b owns rows ``query_start_loc[b] .. [b + 1] - 1``;
- ``context_lens [B]``: tokens of sequence b once the step is done (its chunk's ``end``);
- ``decode_rows``: how many leading sequences are one row that samples (decodes, which
  every scheduler places first), so the first ``decode_rows`` rows of the batch and of
  the logits are theirs: the linear layers send them through the extension's decode
  matmul (``tiny_llm/kernels/cpu_kernels.py``);
- ``logit_rows``: the last row of every sequence whose chunk reaches its end (those sample);
  with speculative decoding, a request verifying ``k`` drafted tokens has ``k + 1`` rows
  there (``num_logits``); after them, the rows whose logits score a prompt's next token
  (``scored``: requests asking for ``prompt_logprobs``);
- ``kv``, what the KV storage lays out for the step (built once, read as fields): a
  ``PagedLayout`` for paged storage (Day 3: block tables, slot mapping and the
  block-table interface's arrays), a ``DenseLayout`` for dense slots (Day 1: the
  sequences' caches);
- ``tree``: where a request's drafts branch (speculative decoding's ``TokenTree`` shapes,
  carried in ``Drafts``), which drafts each row sees (``TreeRows``).

Attention is the seam the chapters swap. An ``AttentionBackend`` checks at engine build
that it can serve the model (``check(geometry)``); at every step it is given the step
(``begin_step``), prepares what all layers share (metadata as arrays), and is then the
``KVCache`` the model calls in every layer (``attend(layer, q, k, v, scale)``): it stores
the layer's new K/V and returns each row's causal attention over its sequence's keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, Protocol

from tiny_llm.kernels.cpu_kernels import FusedDecode
from tiny_llm.kernels.device import planned_device
from tiny_llm.models.model import ModelConfig
from tiny_llm.step.dense_kv import DenseKVCache
from tiny_llm.step.request import Request, SequenceState

import mlx.core as mx
import numpy as np


# ANCHOR: token_tree
@dataclass(frozen=True)
class TokenTree:
    """The shape of the drafts proposed per request and step, given as vLLM gives its
    ``speculative_token_tree``: each node is the path of child ranks that leads to it from
    the request's last token — ``(0,)`` its best-ranked child, ``(1,)`` the second,
    ``(0, 0)`` the best child of ``(0,)``. Kept breadth first (by depth, then by ranks), so
    that every parent comes before its children; a chain of k drafts is
    ``[(0,), (0, 0), ...]``, so chains and trees take one path through the engine."""

    paths: tuple[tuple[int, ...], ...]

    MAX_NODES: ClassVar[int] = 64  # a row's visible drafts are one 64-bit mask (TreeRows)

    @classmethod
    def chain(cls, k: int) -> TokenTree:
        return cls(tuple((0,) * depth for depth in range(1, k + 1)))

    @classmethod
    def parse(cls, paths: Any) -> TokenTree:
        """The tree ``paths`` lists, or a ValueError that names what is wrong with it."""
        if isinstance(paths, TokenTree):
            return paths
        example = "e.g. [(0,), (1,), (0, 0)]: two children of the root, one under the first"
        if not isinstance(paths, list | tuple) or not paths:
            raise ValueError(f"speculative_token_tree must be a non-empty list of paths of "
                             f"child ranks, {example}; got {paths!r}")
        nodes: list[tuple[int, ...]] = []
        for path in paths:
            if not isinstance(path, list | tuple) or not path or not all(
                    isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path):
                raise ValueError(f"speculative_token_tree: {path!r} is not a path of child "
                                 f"ranks (a non-empty tuple of integers >= 0), {example}")
            if tuple(path) in nodes:
                raise ValueError(f"speculative_token_tree names {tuple(path)} twice")
            nodes.append(tuple(path))
        for node in nodes:
            if len(node) > 1 and node[:-1] not in nodes:
                raise ValueError(f"speculative_token_tree: {node} has no parent {node[:-1]}")
            if node[-1] > 0 and (*node[:-1], node[-1] - 1) not in nodes:
                raise ValueError(f"speculative_token_tree: {node} is child rank {node[-1]}, "
                                 f"but rank {node[-1] - 1} of its parent is missing")
        if len(nodes) > cls.MAX_NODES:
            raise ValueError(f"speculative_token_tree has {len(nodes)} nodes; at most "
                             f"{cls.MAX_NODES} are verified in one step")
        return cls(tuple(sorted(nodes, key=lambda node: (len(node), node))))

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def is_chain(self) -> bool:
        return all(rank == 0 for path in self.paths for rank in path)

    @property
    def depth(self) -> int:
        return len(self.paths[-1])

    @property
    def width(self) -> int:
        """Children of the root."""
        return sum(len(path) == 1 for path in self.paths)

    def pruned(self, depth: int) -> TokenTree | None:
        """The nodes at most ``depth`` deep (None: none)."""
        kept = tuple(path for path in self.paths if len(path) <= depth)
        return TokenTree(kept) if kept else None
# ANCHOR_END: token_tree


@dataclass(frozen=True)
class Drafts:
    """Tokens a proposer guessed to follow a request's last token, as a tree: draft ``i``
    follows draft ``parents[i]`` (``-1``: the request's last token), every parent before its
    children (a chain, the default: each draft follows the one before). ``probs [k, V]``: the
    distribution each draft was drawn from (None: deterministic, one-hot on each token)."""

    tokens: tuple[int, ...]
    probs: np.ndarray | None = field(default=None, compare=False)
    parents: tuple[int, ...] | None = None  # None: a chain

    def __post_init__(self) -> None:
        if self.parents is not None and (
                len(self.parents) != len(self.tokens)
                or any(not -1 <= p < i for i, p in enumerate(self.parents))):
            raise ValueError(f"draft parents {self.parents} do not name earlier drafts")

    def __len__(self) -> int:
        return len(self.tokens)

    def parent(self, i: int) -> int:
        return i - 1 if self.parents is None else self.parents[i]

    @property
    def depths(self) -> list[int]:
        """Each draft's depth: 1 for the drafts that follow the request's last token."""
        depths: list[int] = []
        for i in range(len(self.tokens)):
            depths.append(1 + (depths[self.parent(i)] if self.parent(i) >= 0 else 0))
        return depths

    @property
    def is_chain(self) -> bool:
        return all(self.parent(i) == i - 1 for i in range(len(self.tokens)))

    def ancestor_bits(self) -> list[int]:
        """Per draft, the drafts its row sees besides the committed tokens: bit ``j`` set for
        each ancestor ``j`` and for itself (a chain: every draft up to itself)."""
        bits: list[int] = []
        for i in range(len(self.tokens)):
            p = self.parent(i)
            bits.append((bits[p] if p >= 0 else 0) | 1 << i)
        return bits


@dataclass(frozen=True)
class Emitted:
    """What a sampling request emits in a step: its new tokens (one; or the drafts it
    accepted, then the token after them) and which drafts those are, in order (their
    indices in its ``Drafts``: a path from the root of its tree)."""

    tokens: list[int]
    accepted: tuple[int, ...] = ()


@dataclass(frozen=True)
class ScheduledChunk:
    """``request`` computes positions ``start .. end - 1`` this step (a decode: one). With
    ``drafts`` (speculative decoding), the chunk's last ``len(drafts)`` rows are the drafted
    tokens, verified by the step's logits at its last ``len(drafts) + 1`` rows."""

    request: SequenceState
    start: int
    end: int
    drafts: Drafts | None = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def num_drafts(self) -> int:
        return len(self.drafts) if self.drafts is not None else 0


# ANCHOR: step_batch
@dataclass
class StepBatch:
    chunks: list[ScheduledChunk]
    token_ids: mx.array  # int32 [T]
    positions: mx.array  # int32 [T]
    query_start_loc: list[int]  # [B + 1]
    context_lens: list[int]  # [B]
    logit_rows: mx.array  # int32 [R]: the rows whose logits the step needs
    sampling: list[Request]  # the requests that sample after this step ...
    drafts: list[Drafts | None]  # ... and the drafts their logit rows verify (None: one row)
    decode_rows: int  # the leading sequences of one row that samples (decodes)
    kv: PagedLayout | DenseLayout | None  # what the KV storage lays out (None: nothing)
    # After the sampling rows: each scored request's prompt positions, a logit row each
    scored: list[tuple[Request, range]] = field(default_factory=list)
    tree: TreeRows | None = None  # where some drafts form a tree: which drafts each row sees

    @property
    def num_logits(self) -> list[int]:
        """How many of the logit rows are each sampling request's, in order: one, and one
        more per draft it verifies."""
        return [1 + (len(d) if d is not None else 0) for d in self.drafts]

    @property
    def decode_only(self) -> bool:
        """Whether every row of the step is a decode row."""
        return self.decode_rows == len(self.chunks)

    @classmethod
    def build(cls, chunks: list[ScheduledChunk], kv: PagedLayout | DenseLayout | None,
              score_prompts: bool = False) -> StepBatch:
        """The flat batch of ``chunks``; ``kv`` is the storage's layout of the same chunks
        (``layout(chunks)``). With ``score_prompts``, the prompt rows of requests that ask
        for their prompt's logprobs get logits too, after the sampling rows."""
        token_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        logit_rows: list[int] = []
        sampling, verified = [], []
        for chunk in chunks:
            req, drafts = chunk.request, chunk.num_drafts
            token_ids += req.token_ids_between(chunk.start, chunk.end - drafts)
            token_ids += chunk.drafts.tokens if drafts else ()
            # A draft sits where its depth puts it: right after its parent, whichever row
            # holds it (siblings share a position).
            positions += range(chunk.start, chunk.end - drafts)
            positions += [chunk.end - drafts - 1 + d for d in chunk.drafts.depths] if drafts else ()
            query_start_loc.append(query_start_loc[-1] + chunk.num_tokens)
            if chunk.end - drafts >= req.num_tokens:  # it reaches the end: sample what follows
                logit_rows += range(query_start_loc[-1] - 1 - drafts, query_start_loc[-1])
                sampling.append(req)
                verified.append(chunk.drafts)
        scored = []
        for chunk, first_row in zip(chunks, query_start_loc[:-1], strict=True):
            prompt_rows = chunk.request.scored_prompt_positions(chunk.start, chunk.end) \
                if score_prompts else range(0)
            if prompt_rows:
                logit_rows += [first_row + q - chunk.start for q in prompt_rows]
                scored.append((chunk.request, prompt_rows))
        # The leading sequences of one row that samples: the first rows of the batch and
        # of the logits alike.
        decodes = next((i for i, c in enumerate(chunks)
                        if c.num_tokens != 1 or c.end < c.request.num_tokens), len(chunks))
        return cls(
            chunks,
            mx.array(token_ids, dtype=mx.int32),
            mx.array(positions, dtype=mx.int32),
            query_start_loc,
            [c.end for c in chunks],
            mx.array(logit_rows, dtype=mx.int32),
            sampling,
            verified,
            decodes,
            kv,
            scored,
            TreeRows.of(chunks),
        )
# ANCHOR_END: step_batch


# ANCHOR: tree_rows
@dataclass(frozen=True)
class TreeRows:
    """Which keys each row of a step sees where some request's drafts form a tree. A row
    sees the keys of its sequence up to its own row (the causal rule), but from key
    ``start[t]`` on (the first draft row of its chunk) only the drafts whose bit is set in
    ``ancestors[t]``: its ancestors and itself, never a sibling or a cousin. Rows outside a
    tree have ``start`` past their own row: the causal rule alone. A step whose drafts are
    all chains has none (a chain's ancestors are every draft before it: the causal rule)."""

    start: np.ndarray  # int32 [T]: a key index in the row's sequence
    ancestors: np.ndarray  # uint64 [T]: bit j, draft j of the row's chunk

    @classmethod
    def of(cls, chunks: list[ScheduledChunk]) -> TreeRows | None:
        if all(c.drafts is None or c.drafts.is_chain for c in chunks):
            return None
        start: list[int] = []
        ancestors: list[int] = []
        for chunk in chunks:
            plain = chunk.num_tokens - chunk.num_drafts
            start += range(chunk.start + 1, chunk.start + plain + 1)  # past each row's own
            ancestors += [0] * plain
            if chunk.drafts is not None:
                start += [chunk.end - chunk.num_drafts] * chunk.num_drafts
                ancestors += chunk.drafts.ancestor_bits()
        return cls(np.array(start, dtype=np.int32), np.array(ancestors, dtype=np.uint64))

    @cached_property
    def arrays(self) -> tuple[mx.array, mx.array]:
        """``(start, ancestors)`` as the kernels take them: made once per step, read by
        every layer."""
        return mx.array(self.start), mx.array(self.ancestors)

    def visible(self, rows: range, num_keys: int) -> np.ndarray:
        """``[len(rows), num_keys]``: which of its sequence's keys each of ``rows`` sees (the
        rows are one sequence's, the last ``len(rows)`` of its ``num_keys``)."""
        own = np.arange(num_keys - len(rows), num_keys)[:, None]
        key = np.arange(num_keys)[None, :]
        start = self.start[rows.start : rows.stop, None].astype(np.int64)
        shift = np.clip(key - start, 0, 63).astype(np.uint64)
        bits = self.ancestors[rows.start : rows.stop, None]
        in_tree = ((bits >> shift) & np.uint64(1)).astype(bool)
        return (key <= own) & ((key < start) | in_tree)
# ANCHOR_END: tree_rows


# ANCHOR: layouts
@dataclass(frozen=True)
class PagedLayout:
    """A step's sequences in the page pool (Day 3's ``PagedKVStorage.layout``). The last
    three arrays are the block-table interface every paged attention reads (Days 4-5)."""

    tables: list[list[int]]  # each sequence's pages, as far as its chunk reaches
    slot_mapping: mx.array  # int32 [T]: the pool row of every new token
    block_table: mx.array  # int32 [B, max_pages]: the tables, -1 past their end
    context_lens: mx.array  # int32 [B]: tokens of each sequence once the step is done
    query_start_loc: mx.array  # int32 [B + 1]: sequence b owns rows [b] .. [b + 1] - 1

    @property
    def page_metadata(self) -> tuple[mx.array, mx.array, mx.array]:
        """``(block_table, context_lens, query_start_loc)``, in the kernels' argument order."""
        return self.block_table, self.context_lens, self.query_start_loc


@dataclass(frozen=True)
class DenseLayout:
    """A step's sequences in dense slots (Day 1's ``DenseKVStorage.layout``)."""

    caches: list[DenseKVCache]  # each sequence's cache, in the step's order
# ANCHOR_END: layouts


@dataclass(frozen=True)
class AttentionGeometry:
    """What an attention backend must support: the model's heads, the storage, the device,
    and whether drafts may form trees (rows that see their ancestors only: ``TreeRows``)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    page_size: int | None  # None: dense storage
    dtype: mx.Dtype
    device: mx.Device
    token_trees: bool = False

    @classmethod
    def of(cls, config: ModelConfig, page_size: int | None, dtype: mx.Dtype,
           token_trees: bool = False) -> AttentionGeometry:
        return cls(config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                   page_size, dtype, planned_device(), token_trees)

    def refuse_trees(self, attention: str) -> None:
        """Raise ValueError, naming the ``attention`` that cannot serve them, if drafts may
        form trees."""
        if self.token_trees:
            raise ValueError(f"{attention} cannot attend over a tree of drafts (causal rows "
                             f"only): a speculative_token_tree that branches needs "
                             f"attention='gather', 'vector' or 'flash'")


# ANCHOR: attention_backend
class AttentionBackend(Protocol):
    """One way to attend over the KV storage (a chapter's choice), behind one interface."""

    name: ClassVar[str]  # the engine option that selects it
    storage: ClassVar[str]  # the KV storage it reads: "dense" or "paged"

    @staticmethod
    def check(geometry: AttentionGeometry) -> None:
        """Raise ValueError, before any memory is allocated, if the model cannot be served."""
        ...

    def begin_step(self, step: StepBatch) -> None:
        """Take the step about to run; prepare what its layers share."""
        ...

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Store the step's ``k, v [T, Hkv, D]`` for ``layer`` and return every row's causal
        attention over its sequence, ``[T, Hq, D]`` (the model's ``KVCache``)."""
        ...

    def state(self) -> list[mx.array]:
        """The arrays a step writes, evaluated together with the logits."""
        ...

    def fused_decode(self) -> FusedDecode | None:
        """The step's pool and rows, if the fused decoder layers may attend in this
        backend's place (they run the extension's kernels over its pool); else None."""
        ...
# ANCHOR_END: attention_backend
