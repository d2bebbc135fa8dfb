"""The CPU matmul of the linear layers: the extension's ``linear`` and the routing of
``tiny_llm/linear.py``.

- ``linear(x, w)`` is ``x @ w.T`` against a float64 oracle for every tile remainder (M and
  N not multiples of the tile, K not a multiple of 8, K = 1);
- a row's result is the same bits whatever other rows share the call, in any order, and
  wherever in memory the weights and rows start (the kernel aligns its loads to the
  weights' address, which must not change a result);
- strided inputs are read correctly, bad input is refused with a clear error;
- under ``decode_rows(n)`` exactly the first ``n`` rows of every linear layer (and of the
  tied vocabulary projection) go to the kernel, the rest to MLX's matmul; outside it, none;
- ``StepBatch.decode_rows`` counts the leading single-row sequences of a step.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(mx.default_device().type != mx.DeviceType.cpu,
                                reason="the kernel serves CPU streams")


@pytest.fixture(scope="module")
def ext():
    from tiny_llm import linear

    module = linear._kernel()
    assert module is not None, "the extension must be built for the tests (make setup)"
    return module


def oracle(x: mx.array, w: mx.array) -> np.ndarray:
    return np.asarray(x, dtype=np.float64) @ np.asarray(w, dtype=np.float64).T


SHAPES = [(1, 1, 1), (1, 3, 8), (2, 5, 9), (3, 7, 16), (4, 4, 64), (5, 10, 100), (7, 13, 576),
          (65, 37, 33), (130, 300, 64)]


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_matches_float64_oracle(ext, m, n, k):
    x = mx.random.normal((m, k), key=mx.random.key(m))
    w = mx.random.normal((n, k), key=mx.random.key(n + 1000))
    got = np.asarray(ext.linear(x, w))
    want = oracle(x, w)
    bound = 4e-7 * k * (np.abs(np.asarray(x)) @ np.abs(np.asarray(w)).T) + 1e-30
    assert got.shape == (m, n)
    assert np.all(np.abs(got - want) <= bound)


def test_a_row_does_not_depend_on_the_other_rows(ext):
    k, n = 200, 70  # K % 8 == 0 and != 0 in the next test; several tiles of each shape
    x = mx.random.normal((37, k), key=mx.random.key(1))
    w = mx.random.normal((n, k), key=mx.random.key(2))
    full = np.asarray(ext.linear(x, w))
    for i in range(37):
        assert np.array_equal(np.asarray(ext.linear(x[i:i + 1], w))[0], full[i])
    rng = np.random.default_rng(0)
    for size in (2, 3, 5, 9, 36):
        rows = rng.choice(37, size=size, replace=False)
        got = np.asarray(ext.linear(x[mx.array(rows)], w))
        assert np.array_equal(got, full[rows])


def shifted_copies(values: mx.array, count: int = 8) -> list[mx.array]:
    """``count`` views of the same values in one buffer, each starting one float further
    past a 32-byte boundary than the one before (modulo 8 floats)."""
    n = values.size
    pad = (1 - n) % 8 or 8  # every copy takes 1 (mod 8) floats
    flat = mx.concatenate([values.reshape(-1), mx.zeros((pad,))] * count)
    mx.eval(flat)
    return [flat[i * (n + pad):i * (n + pad) + n].reshape(values.shape) for i in range(count)]


def address(a: mx.array) -> int:
    return np.asarray(a).__array_interface__["data"][0]


@pytest.mark.parametrize("k", [96, 99])
def test_a_result_does_not_depend_on_where_the_buffers_start(ext, k):
    x = mx.random.normal((6, k), key=mx.random.key(3))
    w = mx.random.normal((11, k), key=mx.random.key(4))
    expected = np.asarray(ext.linear(x, w))
    weights, rows = shifted_copies(w), shifted_copies(x, 3)
    assert len({address(v) % 32 for v in weights}) == 8, "every 4-byte offset of the weights"
    for ws in weights:
        for xs in rows:
            assert np.array_equal(np.asarray(ext.linear(xs, ws)), expected)


def test_strided_inputs(ext):
    x = mx.random.normal((40, 5), key=mx.random.key(5)).T  # [5, 40], column-major
    w = mx.random.normal((40, 9), key=mx.random.key(6)).T  # [9, 40]
    got = np.asarray(ext.linear(x, w))
    np.testing.assert_allclose(got, oracle(x, w), rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused(ext):
    x, w = mx.zeros((2, 8)), mx.zeros((3, 8))
    with pytest.raises(ValueError, match="float32"):
        ext.linear(x.astype(mx.float16), w.astype(mx.float16))
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        ext.linear(x, mx.zeros((3, 7)))
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        ext.linear(mx.zeros((2, 2, 8)), w)


@pytest.fixture
def kernel_calls(monkeypatch, ext):
    """The row counts of every call into the kernel."""
    from tiny_llm import linear

    calls: list[int] = []

    class Spy:
        @staticmethod
        def linear(x, w):
            calls.append(x.shape[0])
            return ext.linear(x, w)

    monkeypatch.setattr(linear, "_kernel", lambda: Spy)
    return calls


def test_decode_rows_take_the_kernel_and_the_rest_mlx(kernel_calls, ext):
    from tiny_llm.linear import Linear, decode_rows

    layer = Linear(24, 10, bias=True)
    x = mx.random.normal((5, 24), key=mx.random.key(7))
    plain = layer(x)
    assert kernel_calls == []
    with decode_rows(2):
        routed = layer(x)
    assert kernel_calls == [2]
    want = np.concatenate([np.asarray(ext.linear(x[:2], layer.weight) + layer.bias),
                           np.asarray(x[2:] @ layer.weight.T + layer.bias)])
    assert np.array_equal(np.asarray(routed), want)
    np.testing.assert_allclose(np.asarray(routed), np.asarray(plain), rtol=1e-5, atol=1e-6)
    with decode_rows(9):  # more than the rows: all of them
        layer(x)
    assert kernel_calls == [2, 5]


def test_a_decode_step_sends_its_decode_rows_through_the_kernel(kernel_calls, tiny_model):
    from tiny_llm.kv_cache import DenseKVCache
    from tiny_llm.linear import decode_rows

    cache = DenseKVCache(tiny_model.config.num_hidden_layers)
    tiny_model(mx.array([5], dtype=mx.int32), mx.array([0]), cache)
    assert kernel_calls == []
    with decode_rows(1):
        tiny_model(mx.array([6], dtype=mx.int32), mx.array([1]), cache)
    layers = tiny_model.config.num_hidden_layers
    assert kernel_calls == [1] * (7 * layers + 1), "q, k, v, o, gate, up, down + the head"


def test_step_batch_counts_the_leading_single_row_sequences():
    from tiny_llm.step import ScheduledChunk, StepBatch

    class Seq:  # what StepBatch.build reads of a request
        num_tokens, spec_token_ids = 8, []

        def token_ids_between(self, start, end):
            return list(range(start, end))

    class NoKV:
        def layout(self, chunks):
            return {}

    sizes = [(7, 8), (7, 8), (0, 5), (7, 8)]  # two decodes, a prefill chunk, a decode
    chunks = [ScheduledChunk(Seq(), s, e) for s, e in sizes]
    assert StepBatch.build(chunks, NoKV()).decode_rows == 2
    assert StepBatch.build(chunks[2:], NoKV()).decode_rows == 0
    assert StepBatch.build(chunks[:2], NoKV()).decode_rows == 2
