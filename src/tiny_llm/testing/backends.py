"""Attention backends for tests, plugged in through the engine's seam (``engine.attention``)."""

from __future__ import annotations

from tiny_llm.day4_paged_attention import check_metadata
from tiny_llm.step.batch import AttentionGeometry, StepBatch

import mlx.core as mx
import numpy as np


class CheckedAttention:
    """Wraps an engine's backend: records every step's query lengths and, for paged
    storage, validates each layer's metadata as a kernel would trust it (the engine itself
    skips that check), then delegates. ``calls`` counts the layers attended."""

    def __init__(self, inner):
        self.inner = inner
        self.name, self.storage = inner.name, inner.storage
        self.calls = 0
        self.query_lengths: list[list[int]] = []  # per step

    def check(self, geometry: AttentionGeometry) -> None:
        self.inner.check(geometry)

    def begin_step(self, step: StepBatch) -> None:
        self.inner.begin_step(step)
        self.step = step
        self.query_lengths.append(np.diff(step.query_start_loc).tolist())

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        if self.storage == "paged":
            pool = self.inner.pool
            check_metadata(q, pool.k[layer], pool.v[layer], *self.step.kv.page_metadata)
        self.calls += 1
        return self.inner.attend(layer, q, k, v, scale)

    def state(self) -> list[mx.array]:
        return self.inner.state()

    def fused_decode(self) -> None:
        return None  # the fused layers would attend unchecked
