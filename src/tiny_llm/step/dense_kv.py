"""Dense K/V storage and the plain-MLX attention that every later kernel is checked against.

``causal_attention`` is written with ordinary MLX ops (matmul, mask, softmax) on purpose:
it is the course's oracle. It takes one sequence's queries at absolute positions
``q_start .. q_start + T - 1`` and all of that sequence's keys ``0 .. S - 1``; query ``i``
sees keys ``0 .. q_start + i`` (or the keys a mask names: a tree of drafts).

``DenseKVCache`` is the starting point of the course: one growing buffer per layer for a
single sequence. Day 1's engine gives each running request one of them.
"""

from __future__ import annotations

import mlx.core as mx


# ANCHOR: causal_attention
def causal_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, q_start: int,
    visible: mx.array | None = None,
) -> mx.array:
    """``q [T, Hq, D]`` over ``k, v [S, Hkv, D]``; returns ``[T, Hq, D]`` in q's dtype.
    ``visible [T, S]`` (bool), if given, says which keys each row sees instead of the
    causal rule (a tree of drafts: ``TreeRows``)."""
    T, n_heads, D = q.shape
    S, n_kv_heads, _ = k.shape
    group = n_heads // n_kv_heads
    # GQA: the `group` query heads of one KV head are stacked as rows of one matmul
    # against that head's keys, so each K/V row is read once per group (and the matmul
    # is G times taller, which BLAS runs far better than G broadcast ones).
    qg = q.reshape(T, n_kv_heads, group, D).transpose(1, 2, 0, 3)  # [Hkv, G, T, D]
    qg = qg.reshape(n_kv_heads, group * T, D)
    scores = (qg * scale) @ k.transpose(1, 2, 0)  # [Hkv, G*T, S]
    if visible is None:
        visible = mx.arange(S)[None, :] <= mx.arange(q_start, q_start + T)[:, None]  # [T, S]
    scores = scores.reshape(n_kv_heads, group, T, S).astype(mx.float32)
    probs = mx.softmax(mx.where(visible, scores, -mx.inf), axis=-1).astype(v.dtype)
    out = probs.reshape(n_kv_heads, group * T, S) @ v.transpose(1, 0, 2)  # [Hkv, G*T, D]
    return out.reshape(n_kv_heads, group, T, D).transpose(2, 0, 1, 3).reshape(T, n_heads, D)
# ANCHOR_END: causal_attention


# ANCHOR: dense_cache
class DenseKVCache:
    """One sequence's keys and values, one buffer per layer, grown in steps of ``STEP``."""

    STEP = 256

    def __init__(self, num_layers: int):
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.lengths = [0] * num_layers

    def reset(self) -> None:
        """Forget the sequence but keep the buffers: the next request in this slot reuses them."""
        self.lengths = [0] * len(self.lengths)

    @property
    def length(self) -> int:
        """Tokens stored (layer 0 is written first in a step, so read the last layer)."""
        return self.lengths[-1]

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """The sequence's next tokens (the model's ``KVCache`` for a single request)."""
        return self.attend_at(layer, q, k, v, scale, self.lengths[layer])

    def attend_at(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float,
                  start: int) -> mx.array:
        """Store ``k, v`` at positions ``start ..`` and attend over positions ``0 .. end - 1``.
        The explicit position makes a repeated step (a retry) write the same rows again."""
        end = start + k.shape[0]
        self._reserve(layer, end, k)
        self.keys[layer][start:end] = k
        self.values[layer][start:end] = v
        self.lengths[layer] = end
        return causal_attention(q, self.keys[layer][:end], self.values[layer][:end], scale, start)

    def _reserve(self, layer: int, needed: int, like: mx.array) -> None:
        buf = self.keys[layer]
        capacity = 0 if buf is None else buf.shape[0]
        if needed <= capacity:
            return
        new_capacity = -(-needed // self.STEP) * self.STEP
        shape = (new_capacity - capacity, *like.shape[1:])
        grow = [mx.zeros(shape, like.dtype), mx.zeros(shape, like.dtype)]
        if buf is None:
            self.keys[layer], self.values[layer] = grow
        else:
            self.keys[layer] = mx.concatenate([buf, grow[0]])
            self.values[layer] = mx.concatenate([self.values[layer], grow[1]])

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values if a is not None)
# ANCHOR_END: dense_cache
