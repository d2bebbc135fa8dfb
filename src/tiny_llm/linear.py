"""The model's linear layers on the CPU: decode rows through the extension's matmul.

A decode step multiplies a few rows (one per running request) by every weight matrix of
the model. OpenBLAS packs each weight panel before it multiplies, so at small M it reads
and writes the weights more than once per call and runs at a fraction of the memory
bandwidth. The extension's ``linear`` (``src/extensions/cpu_linear.cpp``) reads each
weight row once for all the rows of the call, on the worker pool's threads, and defines
every output element as one dot product whose order depends on nothing but K: a row's
result is the same bits alone or next to any other rows.

Which rows take it is decided per step, not per call: the engine marks the step's leading
single-row sequences (decodes: every scheduler places them first) with ``decode_rows(n)``,
and every linear layer sends those ``n`` rows to the extension and the rest (prefill
chunks, speculative verification) to MLX's matmul, OpenBLAS on Linux, which is faster at
large M. A request's decode rows therefore take the same kernel whether it runs alone or
in any batch. Outside ``decode_rows`` (tests, oracles, the reference ``generate``) every
row takes MLX's matmul, as do GPU streams (the Mac path is MLX's Metal matmul) and dtypes
other than float32.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import warnings
from collections.abc import Iterator
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn

_decode_rows: contextvars.ContextVar[int] = contextvars.ContextVar("decode_rows", default=0)


# ANCHOR: decode_rows
@contextlib.contextmanager
def decode_rows(n: int) -> Iterator[None]:
    """Within the block, the first ``n`` rows of every linear layer's input (and of the
    logits) belong to single-row sequences and take the extension's matmul."""
    token = _decode_rows.set(n)
    try:
        yield
    finally:
        _decode_rows.reset(token)


def linear(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ weight.T``, the first ``decode_rows`` rows through the extension's matmul."""
    n = min(_decode_rows.get(), x.shape[0]) if x.ndim == 2 else 0
    if n == 0 or not _takes_kernel(x, weight):
        return x @ weight.T
    ext = _kernel()
    if n == x.shape[0]:
        return ext.linear(x, weight)
    return mx.concatenate([ext.linear(x[:n], weight), x[n:] @ weight.T])
# ANCHOR_END: decode_rows


def _takes_kernel(x: mx.array, weight: mx.array) -> bool:
    return (x.dtype == weight.dtype == mx.float32
            and mx.default_device().type == mx.DeviceType.cpu and _kernel() is not None)


@functools.cache
def _kernel() -> ModuleType | None:
    # The reference extension, also when a learner's copy serves the attention kernels:
    # this matmul is not a course task.
    try:
        return importlib.import_module("tiny_llm._native._ext")
    except ImportError as e:
        warnings.warn(f"tiny_llm: the kernel extension is not built (run `make setup`); decode "
                      f"matmuls use MLX's matmul instead — {e}", stacklevel=3)
        return None


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same quantization) whose matmul is ``linear``."""

    def __call__(self, x: mx.array) -> mx.array:
        y = linear(x, self.weight)
        return y + self.bias if "bias" in self else y
