"""The model's CPU kernels: the extension's ``linear`` and ``rope``, and the routing of
``tiny_llm/kernels/cpu_kernels.py``.

- ``linear(x, w)`` is ``x @ w.T`` against a float64 oracle for every tile remainder (M and
  N not multiples of the tile, K not a multiple of 8, K = 1);
- a row's result is the same bits whatever other rows share the call, in any order, and
  wherever in memory the weights and rows start (the kernel aligns its loads to the
  weights' address, which must not change a result);
- strided inputs are read correctly, bad input is refused with a clear error;
- ``linear(..., blas=True)`` (MLX's BLAS split over the worker pool) against the oracle;
- with ``KernelPlan(n)`` exactly the first ``n`` rows of every linear layer (and of the
  tied vocabulary projection) go to the decode kernel, the rest to the split BLAS;
  outside it, none;
- ``StepBatch.decode_rows`` counts the leading single-row sequences of a step that sample;
- ``rope`` matches ``mx.fast.rope`` in both layouts, with partial rotation, a linear
  position scale and a checkpoint's own frequencies, at positions up to 100k;
- ``swiglu`` matches ``nn.silu(gate) * up`` over the range where exp over- and underflows;
- ``rms_norm`` matches ``mx.fast.rms_norm`` (2-D and per-head 3-D rows, large and tiny
  values), a row alone and in a batch give the same bits;
- ``argmax_rows`` is ``mx.argmax`` (ties, NaN, -inf, tails past whole vectors), and the
  engine's greedy rows take it with the CPU kernels;
- the decode matmul built for AVX2 and built with plain-array lanes (what other CPUs
  compile) gives the same bits; the CPU attention built for AVX2 and AVX-512 (two and
  three pairs per fold) gives the same bits, and each build the same in both schedules.
"""

from __future__ import annotations

import functools
import itertools
import os
import platform
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

# The kernels serve CPU streams: on a Mac they run on its CPU, and the GPU rehearsal, which
# would run them the same way, leaves them to the main pass.
pytestmark = [pytest.mark.usefixtures("cpu_device"), pytest.mark.device_independent]


@pytest.fixture(scope="module")
def ext():
    from tiny_llm.kernels.extension import reference_extension

    module = reference_extension()
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
    # K % 8 == 0 and != 0 in the next test; several tiles of each shape. Calls of up to 4
    # rows read the weight rows one at a time, larger ones in 4 x 3 tiles: same bits.
    k, n = 200, 70
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


@pytest.mark.skipif(sys.platform != "linux", reason="the split BLAS is Linux only")
@pytest.mark.parametrize("m, n, k", [(1, 3, 8), (7, 13, 576), (65, 700, 33), (300, 1000, 64)])
def test_split_blas_matches_float64_oracle(ext, m, n, k):
    x = mx.random.normal((m, k), key=mx.random.key(m))
    w = mx.random.normal((n, k), key=mx.random.key(n + 1000))
    got = np.asarray(ext.linear(x, w, blas=True))
    bound = 4e-7 * k * (np.abs(np.asarray(x)) @ np.abs(np.asarray(w)).T) + 1e-30
    assert np.all(np.abs(got - oracle(x, w)) <= bound)


@pytest.mark.parametrize("k", [96, 99])
def test_a_group_gives_each_weight_the_bits_of_its_own_call(ext, k):
    """One call for several weights (q, k and v): each product as ``linear`` alone computes
    it, also where the weights start at different offsets past a 32-byte boundary (each
    needs x aligned its own way), for a part smaller than one work item, an empty part,
    the same weight twice and a strided weight."""
    shifted = shifted_copies(mx.random.normal((13, k), key=mx.random.key(8)))
    strided = mx.random.normal((k, 5), key=mx.random.key(15)).T
    base = mx.random.normal((70, k), key=mx.random.key(9))
    weights = [base, *shifted[1:4], mx.random.normal((1, k), key=mx.random.key(10)),
               mx.zeros((0, k)), base, strided]
    for m in (1, 4, 5, 37, 68):
        x = mx.random.normal((m, k), key=mx.random.key(m))
        got = ext.linear_group(x, weights)
        assert [y.shape for y in got] == [(m, w.shape[0]) for w in weights]
        for y, w in zip(got, weights, strict=True):
            assert np.array_equal(np.asarray(y), np.asarray(ext.linear(x, w)))


@pytest.mark.skipif(sys.platform != "linux", reason="the split BLAS is Linux only")
def test_a_split_blas_group_matches_float64_oracle(ext):
    x = mx.random.normal((70, 64), key=mx.random.key(11))
    weights = [mx.random.normal((n, 64), key=mx.random.key(n)) for n in (700, 3, 129)]
    for y, w in zip(ext.linear_group(x, weights, blas=True), weights, strict=True):
        bound = 4e-7 * 64 * (np.abs(np.asarray(x)) @ np.abs(np.asarray(w)).T) + 1e-30
        assert np.all(np.abs(np.asarray(y) - oracle(x, w)) <= bound)
        assert np.array_equal(np.asarray(y), np.asarray(ext.linear(x, w, blas=True)))
    assert ext.linear_group(x, [mx.zeros((0, 64))], blas=True)[0].shape == (70, 0)


def test_a_bad_group_is_refused(ext):
    x = mx.zeros((2, 8))
    with pytest.raises(ValueError, match="weights"):
        ext.linear_group(x, [])
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        ext.linear_group(x, [mx.zeros((3, 8)), mx.zeros((3, 7))])
    with pytest.raises(ValueError, match="float32"):
        ext.linear_group(x, [mx.zeros((3, 8)), mx.zeros((3, 8), dtype=mx.float16)])


def test_layers_applied_together_equal_each_applied_alone(ext):
    """``apply_linears``: in a step the same bits as each layer alone, biases where a layer
    has one; outside a step exactly MLX's ``x @ w.T + b``; a quantized layer takes its own
    path."""
    from tiny_llm.kernels.cpu_kernels import KernelPlan, Linear, apply_linears

    import mlx.nn as nn

    mx.random.seed(3)
    layers = [Linear(64, 24, bias=True), Linear(64, 8, bias=False)]
    x = mx.random.normal((6, 64), key=mx.random.key(12))
    for decode_rows in (2, 6, 0):
        kernels = KernelPlan(decode_rows)
        together = apply_linears(x, *layers, kernels=kernels)
        alone = [layer(x, kernels) for layer in layers]
        for a, b in zip(together, alone, strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(np.asarray(together[0]),
                                   np.asarray(x @ layers[0].weight.T + layers[0].bias),
                                   rtol=1e-5, atol=1e-5)
    outside = apply_linears(x, *layers)
    assert np.array_equal(np.asarray(outside[0]),
                          np.asarray(x @ layers[0].weight.T + layers[0].bias))
    assert np.array_equal(np.asarray(outside[1]), np.asarray(x @ layers[1].weight.T))
    quantized = nn.QuantizedLinear(64, 32, bias=False)
    got = apply_linears(x, layers[1], quantized, kernels=KernelPlan(2))
    want = layers[1](x, KernelPlan(2))
    assert np.array_equal(np.asarray(got[0]), np.asarray(want))
    assert np.array_equal(np.asarray(got[1]), np.asarray(quantized(x)))


@pytest.fixture
def kernel_calls(monkeypatch, ext):
    """(rows, blas) of every call into the extension's linear, (name, rows) of the others;
    ``calls.weights``: how many weight matrices each linear call multiplied."""
    from tiny_llm.kernels import cpu_kernels

    class Calls(list):
        weights: list[int]

    calls = Calls()
    calls.weights = []

    class Spy:
        @staticmethod
        def linear_group(x, weights, blas=False):
            calls.append((x.shape[0], blas))
            calls.weights.append(len(weights))
            return ext.linear_group(x, weights, blas=blas)

        @staticmethod
        def quantized_linear_group(x, weights, scales, biases, group_size, bits, blas=False,
                                   int8=False):
            calls.append(("quantized-int8" if int8 else "quantized", x.shape[0]))
            calls.weights.append(len(weights))
            return ext.quantized_linear_group(x, weights, scales, biases, group_size, bits,
                                              blas=blas, int8=int8)

        @staticmethod
        def rope(x, *args):
            calls.append(("rope", x.shape[0]))
            return ext.rope(x, *args)

        @staticmethod
        def swiglu(gate, up):
            calls.append(("swiglu", gate.shape[0]))
            return ext.swiglu(gate, up)

        @staticmethod
        def rms_norm(x, weight, eps):
            calls.append(("rms_norm", x.shape[0]))
            return ext.rms_norm(x, weight, eps)

        def __getattr__(self, name):
            return getattr(ext, name)

    spy = Spy()
    monkeypatch.setattr(cpu_kernels, "reference_extension", lambda: spy)
    return calls


def test_decode_rows_take_the_decode_kernel_and_the_rest_split_blas(kernel_calls, ext):
    from tiny_llm.kernels import cpu_kernels
    from tiny_llm.kernels.cpu_kernels import KernelPlan, Linear

    layer = Linear(24, 10, bias=True)
    x = mx.random.normal((5, 24), key=mx.random.key(7))
    plain = layer(x)
    assert kernel_calls == []
    routed = layer(x, KernelPlan(2))
    split = cpu_kernels.split_blas()  # False only with OpenBLAS threads of its own
    assert kernel_calls == [(2, False)] + [(3, True)] * split
    rest = ext.linear(x[2:], layer.weight, blas=True) if split else x[2:] @ layer.weight.T
    want = np.concatenate([np.asarray(ext.linear(x[:2], layer.weight) + layer.bias),
                           np.asarray(rest + layer.bias)])
    assert np.array_equal(np.asarray(routed), want)
    np.testing.assert_allclose(np.asarray(routed), np.asarray(plain), rtol=1e-5, atol=1e-6)
    kernel_calls.clear()
    layer(x, KernelPlan(9))  # more than the rows: all of them
    layer(x, KernelPlan(0))  # a prefill-only step
    assert kernel_calls == [(5, False)] + [(5, True)] * split


def test_a_decode_step_sends_its_decode_rows_through_the_kernel(kernel_calls, tiny_model):
    from tiny_llm.kernels.cpu_kernels import KernelPlan
    from tiny_llm.step.dense_kv import DenseKVCache

    cache = DenseKVCache(tiny_model.config.num_hidden_layers)
    tiny_model(mx.array([5, 9], dtype=mx.int32), mx.array([0, 1]), cache)
    tiny_model(mx.array([6], dtype=mx.int32), mx.array([2]), cache)  # no plan: MLX's ops
    assert kernel_calls == []
    tiny_model(mx.array([7], dtype=mx.int32), mx.array([3]), cache, kernels=KernelPlan(1))
    # norm, q k v (one call), Qwen3's q and k norms, rope q k, o, norm, gate up (one call),
    # swiglu, down
    norm, row = ("rms_norm", 1), (1, False)
    assert tiny_model.config.qk_norm
    layer = [norm, row, norm, norm, ("rope", 1), ("rope", 1), row, norm, row, ("swiglu", 1), row]
    layers = tiny_model.config.num_hidden_layers
    assert kernel_calls == layer * layers + [norm, row]  # the final norm, the vocabulary
    assert kernel_calls.weights == [3, 1, 2, 1] * layers + [1]


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_the_engine_option_turns_the_kernels_on_and_off(kernel_calls, tiny_model,
                                                        smollm_tokenizer, cpu_kernels):
    from tiny_llm.engine import LLMEngine
    from tiny_llm.sampling.params import SamplingParams

    engine = LLMEngine(tiny_model, smollm_tokenizer, cpu_kernels=cpu_kernels, num_pages=16)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request({"prompt_token_ids": [5, 6, 7]}, params)
    engine.add_request({"prompt_token_ids": [8, 9, 10, 11]}, params)
    while engine.has_unfinished_requests():
        engine.step()
    if not cpu_kernels:
        assert kernel_calls == []
    else:  # prefill rows by the split BLAS, decodes (2 rows per step) by the decode kernel
        from tiny_llm.kernels.cpu_kernels import split_blas

        assert (2, False) in kernel_calls and ((7, True) in kernel_calls) == split_blas()
        assert all(rows in (2, 7, "rope", "swiglu", "rms_norm") for rows, _ in kernel_calls)


def test_step_batch_counts_the_leading_single_row_sequences():
    from tiny_llm.step.batch import ScheduledChunk, StepBatch

    class Seq:  # what StepBatch.build reads of a request
        num_tokens = 8

        def token_ids_between(self, start, end):
            return list(range(start, end))

    sizes = [(7, 8), (7, 8), (0, 5), (7, 8)]  # two decodes, a prefill chunk, a decode
    chunks = [ScheduledChunk(Seq(), s, e) for s, e in sizes]
    assert StepBatch.build(chunks, None).decode_rows == 2
    assert StepBatch.build(chunks[2:], None).decode_rows == 0
    assert StepBatch.build(chunks[:2], None).decode_rows == 2
    # a one-token prefill chunk short of the prompt's end has no logit row: it ends the
    # prefix, so the decode rows of the batch and of the logits stay the same rows
    mid_prompt = ScheduledChunk(Seq(), 3, 4)
    step = StepBatch.build([chunks[0], mid_prompt, chunks[1]], None)
    assert step.decode_rows == 1 and step.logit_rows.tolist() == [0, 2]


@pytest.mark.parametrize("traditional", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("dims, head_dim", [(64, 64), (16, 32)])
@pytest.mark.parametrize("scale, freqs", [(1.0, None), (0.25, None), (1.0, "custom")])
def test_rope_matches_mlx(ext, traditional, dims, head_dim, scale, freqs):
    from tiny_llm.kernels.cpu_kernels import rope, rope_inv_freq

    positions = mx.array([0, 1, 7, 300, 4095, 100_000, 5], dtype=mx.int32)
    x = mx.random.normal((7, 3, head_dim), key=mx.random.key(8))
    base = 10000.0
    if freqs == "custom":  # what llama3 rope scaling hands mx.fast.rope
        freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims) * 1.7
    got = rope(x, positions, rope_inv_freq(dims, base, freqs), dims, traditional, scale)
    want = mx.fast.rope(x.reshape(7, 3, 1, head_dim), dims, traditional=traditional,
                        base=None if freqs is not None else base, scale=scale,
                        offset=positions, freqs=freqs).reshape(x.shape)
    assert abs(got - want).max().item() <= 2e-5
    assert abs(got - x).max().item() > 0.1  # it rotated something
    if dims < head_dim:
        assert np.array_equal(np.asarray(got[..., dims:]), np.asarray(x[..., dims:]))


def test_rope_refuses_bad_input(ext):
    x, pos, inv = mx.zeros((2, 1, 8)), mx.zeros((2,), dtype=mx.int32), mx.ones((4,))
    with pytest.raises(ValueError, match="positions"):
        ext.rope(x, pos[:1], inv, 8, False, 1.0)
    with pytest.raises(ValueError, match="dims"):
        ext.rope(x, pos, inv, 10, False, 1.0)
    with pytest.raises(ValueError, match="inv_freq"):
        ext.rope(x, pos, mx.ones((3,)), 8, False, 1.0)


def test_swiglu_matches_mlx(ext):
    import mlx.nn as nn

    gate = mx.concatenate([mx.random.normal((5, 33), key=mx.random.key(9)) * 4,
                           mx.array([[-200.0, -90.0, -1e-6, 0.0, 1e-6, 90.0, 200.0] * 4
                                     + [3.0] * 5])])
    up = mx.random.normal(gate.shape, key=mx.random.key(10))
    got, want = ext.swiglu(gate, up), nn.silu(gate) * up
    assert mx.all(mx.isfinite(got)).item()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-6)
    with pytest.raises(ValueError, match="one shape"):
        ext.swiglu(gate, up[:2])


@pytest.mark.parametrize("shape, scale", [((1, 576), 1.0), ((37, 576), 30.0), ((5, 3, 64), 1e-3),
                                          ((4, 7), 1.0)])
def test_rms_norm_matches_mlx(ext, shape, scale):
    x = mx.random.normal(shape, key=mx.random.key(13)) * scale
    weight = mx.random.normal(shape[-1:], key=mx.random.key(14))
    got, want = ext.rms_norm(x, weight, 1e-5), mx.fast.rms_norm(x, weight, 1e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-6)
    flat = x.reshape(-1, shape[-1])
    full = np.asarray(ext.rms_norm(flat, weight, 1e-5))
    for i in (0, flat.shape[0] - 1):  # a row alone: its own bits
        assert np.array_equal(np.asarray(ext.rms_norm(flat[i:i + 1], weight, 1e-5))[0], full[i])


def test_rms_norm_refuses_bad_input(ext):
    with pytest.raises(ValueError, match="weight"):
        ext.rms_norm(mx.zeros((2, 8)), mx.ones((7,)), 1e-5)
    with pytest.raises(ValueError, match="float32"):
        ext.rms_norm(mx.zeros((2, 8), dtype=mx.float16), mx.ones((8,), dtype=mx.float16), 1e-5)


@pytest.mark.parametrize("cols", [1, 7, 8, 49152 + 3])
def test_argmax_rows_is_mlxs_argmax(ext, cols):
    """Each row's index as mx.argmax gives it: the lowest among equal maxima (in a vector's
    lanes, across vectors, in the tail), a NaN before any number, 0 for a row of -inf."""
    rows = np.asarray(mx.random.normal((9, cols), key=mx.random.key(cols))).copy()
    rows[1, :] = 2.0  # every column ties
    rows[2, cols // 2:] = 50.0  # ties from the middle on (a lane, then later vectors)
    rows[3, -1] = 60.0  # the maximum in the tail
    rows[4, :] = -np.inf
    rows[5, cols // 3] = np.nan  # a NaN outranks the numbers
    rows[6, 0], rows[6, -1] = 70.0, np.nan
    rows[7, -1], rows[7, 0] = np.nan, np.nan
    x = mx.array(rows)
    got, want = ext.argmax_rows(x), mx.argmax(x, axis=-1)
    assert got.dtype == want.dtype and got.tolist() == want.tolist()
    assert ext.argmax_rows(x[3:4]).tolist() == [cols - 1]  # a row alone


def test_argmax_rows_refuses_bad_input(ext):
    with pytest.raises(ValueError, match="float32"):
        ext.argmax_rows(mx.zeros((2, 8), dtype=mx.float16))
    with pytest.raises(ValueError, match="V >= 1"):
        ext.argmax_rows(mx.zeros((2, 0)))
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        ext.argmax_rows(mx.zeros((8,)))


def test_the_greedy_rows_take_the_kernels_argmax_where_they_serve(smollm_tokenizer,
                                                                   monkeypatch):
    """The engine's greedy pick goes through the extension's argmax with the CPU kernels,
    through MLX's without: the same tokens either way."""
    from tiny_llm.engine import LLMEngine, runner
    from tiny_llm.testing.models import make_tiny_model
    from tiny_llm.testing.runs import tokens_of, workload

    calls, kernel = [], runner.rows_argmax
    monkeypatch.setattr(runner, "rows_argmax", lambda x: calls.append(x.shape) or kernel(x))
    model = make_tiny_model("llama")
    prompts, params = workload(4, seed=3, max_tokens=(2, 6), hi=50)
    on = tokens_of(LLMEngine(model, smollm_tokenizer, num_pages=64), prompts, params)
    assert calls
    calls.clear()
    off = tokens_of(LLMEngine(model, smollm_tokenizer, num_pages=64, cpu_kernels=False),
                    prompts, params)
    assert not calls and on == off


def test_the_command_line_turns_the_kernels_off():
    from tiny_llm.cli import build_parser, engine_options
    from tiny_llm.engine import EngineConfig

    parse = build_parser().parse_args
    assert "cpu_kernels" not in engine_options(parse(["generate", "--prompt", "hi"]))
    off = engine_options(parse(["generate", "--prompt", "hi", "--no-cpu-kernels"]))
    assert off == {"cpu_kernels": False} and EngineConfig().cpu_kernels
    with pytest.raises(TypeError, match="cpu_kernels"):
        EngineConfig(cpu_kernels="yes")


# The harness below builds the decode matmul twice, with the AVX2 registers and with the
# plain-array lanes that other CPUs (a Mac's NEON) compile to, and compares their bits: the
# one definition of a dot product must not depend on which of the two computes it.
def vector_units() -> list[tuple[str, list[str]]]:
    """g++ flags for the vector units this CPU runs: AVX2, none (plain lanes, what other
    CPUs compile) and, where the CPU has it, AVX-512 with 256-bit registers (VL)."""
    units = [("avx2", ["-mavx2", "-mfma", "-mno-avx512f"]),
             ("generic", ["-mno-avx2", "-mno-fma", "-mno-avx512f"])]
    if "avx512vl" in Path("/proc/cpuinfo").read_text():
        units.append(("avx512", ["-mavx2", "-mfma", "-mavx512f", "-mavx512vl"]))
    return units


LANES_HARNESS = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "cpu_linear.h"
extern "C" void cblas_sgemm(int, int, int, int, int, int, float, const float*, int,
                            const float*, int, float, float*, int) { std::abort(); }
int main(int argc, char** argv) {
  const long M = atol(argv[1]), N = atol(argv[2]), K = atol(argv[3]), off = atol(argv[4]);
  std::vector<float> x(M * K + 8), w(N * K + 8), y(M * N);
  uint32_t s = 12345;
  auto next = [&] { s = s * 1664525u + 1013904223u; return (s >> 8) / 16777216.0f - 0.5f; };
  for (auto& v : x) v = next();
  for (auto& v : w) v = next();
  tiny_llm::linear_cpu(x.data() + off, {{w.data() + 3 * off % 8, y.data(), N}}, M, K);
  fwrite(y.data(), sizeof(float), y.size(), stdout);
}
"""


@pytest.mark.skipif(shutil.which("g++") is None or platform.machine() != "x86_64",
                    reason="needs g++ on x86_64")
def test_linear_gives_the_same_bits_on_every_vector_unit(tmp_path):
    """The float32 kernel built for AVX2 (4 x 3 tiles), plain vector extensions (what a Mac
    compiles) and, where the CPU has it, AVX-512 (8 x 3 tiles): one definition, the same
    bits, whatever the tile."""
    src = Path(__file__).resolve().parent.parent / "src" / "extensions"
    (tmp_path / "harness.cpp").write_text(LANES_HARNESS)
    builds = {}
    for name, flags in vector_units():
        exe = tmp_path / name
        subprocess.run(["g++", "-O2", "-std=c++17", *flags, f"-I{src}", "-o", str(exe),
                        str(tmp_path / "harness.cpp"), str(src / "cpu_linear.cpp"),
                        str(src / "worker_pool.cpp"), str(src / "profile.cpp"), "-lpthread"],
                       check=True)
        builds[name] = exe
    for m, n, k, off in [(1, 7, 64, 0), (5, 13, 576, 1), (9, 4, 99, 3), (12, 10, 576, 2),
                         (70, 33, 40, 5)]:
        outs = [subprocess.run([str(exe), str(m), str(n), str(k), str(off)], check=True,
                               capture_output=True).stdout for exe in builds.values()]
        assert len(outs[0]) == 4 * m * n and all(o == outs[0] for o in outs), (m, n, k, off)


ATTENTION_HARNESS = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "cpu_attention.h"
int main(int argc, char** argv) {
  const int D = atoi(argv[1]), tile = atoi(argv[2]);
  const int H = 10, Hkv = 2, ps = 16, pages = 12, B = 3, max_pages = 4;
  // A 37-row chunk after 16 cached tokens, a decode row, a 40-row prompt.
  const std::vector<int32_t> ctx{53, 20, 40}, qsl{0, 37, 38, 78};
  const std::vector<int32_t> table{7, 2, 11, 4, 0, 9, -1, -1, 5, 1, 8, -1};
  uint32_t s = 12345;
  auto next = [&] { s = s * 1664525u + 1013904223u; return (s >> 8) / 16777216.0f - 0.5f; };
  std::vector<float> q(qsl[B] * H * D), k(pages * ps * Hkv * D), v(k.size()), out(q.size());
  for (auto& x : q) x = 3 * next();
  for (auto& x : k) x = next();
  for (auto& x : v) x = next();
  tiny_llm::CpuAttentionShape g{B, max_pages, H, Hkv, D, ps, 0.125f, tile};
  tiny_llm::paged_attention_cpu<float>(q.data(), k.data(), v.data(), table.data(), ctx.data(),
                                       qsl.data(), out.data(), g);
  fwrite(out.data(), sizeof(float), out.size(), stdout);
}
"""


@pytest.mark.skipif(shutil.which("g++") is None or platform.machine() != "x86_64",
                    reason="needs g++ on x86_64")
def test_attention_gives_the_same_bits_on_every_vector_unit(tmp_path):
    """``fold_page`` folds kPairsPerFold pairs at a time: 2 with AVX2 (and on a Mac), 3 with
    AVX-512. A pair's arithmetic must not depend on how many share its call, so both builds
    give the same bits, in the vector schedule and in tiles (five heads per KV head: blocks
    of either size straddle rows). So does this CPU's own build (-march=native -O3, as the
    extension is built): its multiply-adds are spelled out, where GCC tuning for a Zen 3
    once fused fewer of them than the -mavx2 -mfma build.
    The plain build (no FMA) rounds differently, but agrees with itself across schedules."""
    src = Path(__file__).resolve().parent.parent / "src" / "extensions"
    mlx_include = Path(mx.__file__).resolve().parent / "include"
    (tmp_path / "harness.cpp").write_text(ATTENTION_HARNESS)
    targets = [*vector_units(), ("native", ["-march=native", "-O3"])]
    outs = {}
    for name, flags in targets:
        exe = tmp_path / name
        subprocess.run(["g++", "-O2", "-std=c++17", "-Wno-psabi", *flags, f"-I{src}",
                        f"-I{mlx_include}", "-o", str(exe), str(tmp_path / "harness.cpp"),
                        str(src / "cpu_attention.cpp"), str(src / "worker_pool.cpp"),
                        str(src / "profile.cpp"), "-lpthread"], check=True)
        for head_dim in (64, 68, 76):  # the tails past 32 columns, and past vectors of 8
            for tile in (1, 16):
                outs[name, head_dim, tile] = subprocess.run(
                    [str(exe), str(head_dim), str(tile)], check=True,
                    capture_output=True).stdout
    for head_dim in (64, 68, 76):
        assert len(outs["avx2", head_dim, 1]) == 4 * 78 * 10 * head_dim
        for name, _ in targets:
            assert outs[name, head_dim, 1] == outs[name, head_dim, 16], (name, head_dim)
        fma = [outs[name, head_dim, 1] for name, _ in targets if name != "generic"]
        assert all(o == fma[0] for o in fma), head_dim


def test_a_model_built_on_one_thread_serves_on_another(smollm_tokenizer):
    """The server builds the model on the main thread and steps the engine on its own:
    nothing the model holds may be a lazy array of the main thread's stream."""
    import threading

    from tiny_llm.engine import LLMEngine
    from tiny_llm.sampling.params import SamplingParams
    from tiny_llm.testing.models import make_tiny_model

    engine = LLMEngine(make_tiny_model(), smollm_tokenizer, num_pages=16)
    engine.add_request({"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    failures: list[BaseException] = []

    def serve() -> None:
        try:
            while engine.has_unfinished_requests():
                engine.step()
        except BaseException as e:  # noqa: BLE001  (reported below)
            failures.append(e)

    thread = threading.Thread(target=serve)
    thread.start()
    thread.join(timeout=120)
    assert not failures, failures


# ---------------------------------------------------------------------------------------------
# quantized linear layers: the decode kernel reads MLX's affine layout (packed uint32, scales,
# biases) directly; the oracle is the same product in float64 over the dequantized weights.


def quantized(n: int, k: int, group_size: int, bits: int, seed: int):
    w = mx.random.normal((n, k), key=mx.random.key(seed))
    return mx.quantize(w, group_size=group_size, bits=bits)


def dequantized_oracle(x: mx.array, packed, group_size: int, bits: int) -> np.ndarray:
    return oracle(x, mx.dequantize(*packed, group_size=group_size, bits=bits))


QFORMATS = [(32, 4), (64, 4), (128, 4), (32, 8), (64, 8), (128, 8)]


@pytest.mark.parametrize("group_size, bits", QFORMATS)
@pytest.mark.parametrize("m, n, k", [(1, 1, 128), (3, 7, 256), (5, 37, 384), (70, 19, 640)])
def test_quantized_matches_float64_oracle_and_mlx(ext, group_size, bits, m, n, k):
    x = mx.random.normal((m, k), key=mx.random.key(m + k))
    packed = quantized(n, k, group_size, bits, seed=n)
    want = dequantized_oracle(x, packed, group_size, bits)
    scale = np.abs(want).max()
    got = ext.quantized_linear_group(x, [packed[0]], [packed[1]], [packed[2]], group_size, bits)
    np.testing.assert_allclose(np.asarray(got[0]), want, rtol=0, atol=2e-6 * k * scale / 8)
    mlx = mx.quantized_matmul(x, *packed, transpose=True, group_size=group_size, bits=bits)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(mlx), rtol=0,
                               atol=2e-6 * k * scale / 8)
    if ext.has_blas_split:
        split = ext.quantized_linear_group(x, [packed[0]], [packed[1]], [packed[2]], group_size,
                                           bits, blas=True)
        np.testing.assert_allclose(np.asarray(split[0]), want, rtol=0, atol=2e-6 * k * scale / 8)


@pytest.mark.parametrize("group_size, bits", [(32, 4), (64, 8)])
def test_a_quantized_row_does_not_depend_on_the_other_rows(ext, group_size, bits):
    """Each row alone, in batches of every size up to 9 (every tile remainder), and in a call
    that multiplies several weights at once: the same bits."""
    k = 576
    x = mx.random.normal((9, k), key=mx.random.key(4))
    parts = [quantized(n, k, group_size, bits, seed=n) for n in (50, 7)]
    weights, scales, biases = ([p[i] for p in parts] for i in range(3))
    alone = [np.concatenate([np.asarray(ext.quantized_linear_group(
        x[i:i + 1], [w], [s], [b], group_size, bits)[0]) for i in range(9)])
        for w, s, b in zip(weights, scales, biases, strict=True)]
    for m in range(1, 10):
        together = ext.quantized_linear_group(x[:m], weights, scales, biases, group_size, bits)
        for got, want in zip(together, alone, strict=True):
            assert np.array_equal(np.asarray(got), want[:m]), m
    reversed_rows = ext.quantized_linear_group(x[::-1], weights, scales, biases, group_size,
                                               bits)
    assert np.array_equal(np.asarray(reversed_rows[0])[::-1], alone[0])


def bfloat16_bits_as_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16's definition: the top half of a float32's bits."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_scales_stored_narrower_widen_exactly(ext):
    """Every finite float16 and bfloat16 value as a scale (bias zero) and as a bias (scale
    zero) of a one-group row that x = e_0 reads once: each output is the value itself,
    as numpy widens it."""
    x = mx.zeros((1, 32)).at[0, 0].add(1.0)
    halves = np.arange(1 << 16, dtype=np.uint16)
    for dtype, values in ((mx.float16, halves.view(np.float16).astype(np.float32)),
                          (mx.bfloat16, bfloat16_bits_as_float32(halves))):
        finite = halves[np.isfinite(values)]
        want = values[np.isfinite(values)]
        n = len(finite)
        w = mx.zeros((n, 4), dtype=mx.uint32).at[:, 0].add(1)  # weight 0 of each row: q = 1
        stored = mx.array(finite).view(dtype)[:, None]
        zero = mx.zeros((n, 1), dtype=dtype)
        for scales, biases in ((stored, zero), (zero, stored)):
            got = np.asarray(ext.quantized_linear_group(x, [w], [scales], [biases], 32, 4)[0])
            assert np.array_equal(got[0], want), dtype


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("group_size, bits", [(32, 4), (64, 8), (128, 4)])
def test_scales_as_stored_give_the_bits_of_float32_copies(ext, dtype, group_size, bits):
    """Scales and biases in float16 or bfloat16, as checkpoints store them, against their
    float32 copies: the same bits from the decode kernel (rows of every tile remainder, and
    past 64 rows), int8 activations and the split BLAS, in a call of several weights."""
    k = 640
    x = mx.random.normal((70, k), key=mx.random.key(9))
    parts = [quantized(n, k, group_size, bits, seed=n) for n in (37, 5)]
    weights = [p[0] for p in parts]
    stored = [[p[i].astype(dtype) for p in parts] for i in (1, 2)]
    copies = [[a.astype(mx.float32) for a in arrays] for arrays in stored]
    calls = [dict()]
    if ext.int8_kernel_serves(group_size, bits):
        calls.append(dict(int8=True))
    if ext.has_blas_split:
        calls.append(dict(blas=True))
    for m, options in itertools.product((1, 3, 70), calls):
        got = ext.quantized_linear_group(x[:m], weights, *stored, group_size, bits, **options)
        want = ext.quantized_linear_group(x[:m], weights, *copies, group_size, bits, **options)
        for g, w in zip(got, want, strict=True):
            assert np.array_equal(np.asarray(g), np.asarray(w)), (m, options)


def test_an_empty_quantized_part_leaves_the_others_alone(ext):
    """A weight of no rows beside others in one call: an empty output, the others' bits as
    in calls of their own, in the decode kernel, int8 activations and the split BLAS."""
    k = 256
    x = mx.random.normal((5, k), key=mx.random.key(3))
    w, s, b = quantized(40, k, 32, 4, seed=2)
    empty = (mx.zeros((0, k * 4 // 32), dtype=mx.uint32), mx.zeros((0, k // 32)),
             mx.zeros((0, k // 32)))
    calls = [dict(), dict(int8=True)] + ([dict(blas=True)] if ext.has_blas_split else [])
    for options in calls:
        alone = ext.quantized_linear_group(x, [w], [s], [b], 32, 4, **options)[0]
        got = ext.quantized_linear_group(x, [empty[0], w], [empty[1], s], [empty[2], b], 32, 4,
                                         **options)
        assert got[0].shape == (5, 0), options
        assert np.array_equal(np.asarray(got[1]), np.asarray(alone)), options


def int8_oracle(x: mx.array, packed, group_size: int, bits: int) -> np.ndarray:
    """x rounded as int8 activations define it (per 32 values: scale max|x| / 127, x times
    127 / max|x| in float32 rounded to the nearest integer, ties to even), then the product
    with the dequantized weights in float64."""
    x = np.asarray(x, dtype=np.float32)
    rounded = np.zeros(x.shape, dtype=np.float64)
    for g in range(0, x.shape[1], 32):
        part = x[:, g:g + 32]
        amax = np.abs(part).max(axis=1, keepdims=True)
        inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
        rounded[:, g:g + 32] = np.rint(part * inv) * (amax.astype(np.float64) / 127)
    w = np.asarray(mx.dequantize(*packed, group_size=group_size, bits=bits), dtype=np.float64)
    return rounded @ w.T


INT8_FORMATS = [(32, 4), (64, 4), (128, 4), (32, 8), (64, 8), (128, 8)]


@pytest.mark.parametrize("group_size, bits", INT8_FORMATS)
@pytest.mark.parametrize("m, n, k", [(1, 1, 256), (3, 7, 608), (5, 37, 576), (9, 19, 1536)])
def test_int8_rows_match_the_rounded_oracle(ext, group_size, bits, m, n, k):
    """int8=True computes x rounded to int8 per 32 values times the weights: to float32
    rounding of that product (K = 576 at 4 bits and 608 at 8 leave half a 64-byte block);
    against the float kernel, within the rounding's own error."""
    if k % group_size:
        pytest.skip("K must be a multiple of the group size")
    x = mx.random.normal((m, k), key=mx.random.key(m + k))
    if m >= 3:
        x[2, :32] = 0.0  # a group of zeros: scale 0, no division by it
    packed = quantized(n, k, group_size, bits, seed=n)
    want = int8_oracle(x, packed, group_size, bits)
    scale = np.abs(want).max()
    got = np.asarray(ext.quantized_linear_group(x, *([p] for p in packed), group_size, bits,
                                                int8=True)[0])
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * k * scale / 8)
    floats = np.asarray(ext.quantized_linear_group(x, *([p] for p in packed), group_size, bits)[0])
    assert 0 < np.abs(got - floats).max() <= 0.02 * np.abs(floats).max()


@pytest.mark.parametrize("group_size, bits", [(32, 4), (32, 8), (128, 4)])
def test_an_int8_row_does_not_depend_on_the_other_rows(ext, group_size, bits):
    """int8 rows alone, in batches of every size up to 9 (every tile of rows and of weight
    rows), reversed and in a call of several weights: the same bits."""
    k = 576 if group_size < 128 else 640
    x = mx.random.normal((9, k), key=mx.random.key(7))
    parts = [quantized(n, k, group_size, bits, seed=n) for n in (50, 7, 3)]
    weights, scales, biases = ([p[i] for p in parts] for i in range(3))
    call = functools.partial(ext.quantized_linear_group, group_size=group_size, bits=bits,
                             int8=True)
    alone = [np.concatenate([np.asarray(call(x[i:i + 1], [w], [s], [b])[0]) for i in range(9)])
             for w, s, b in zip(weights, scales, biases, strict=True)]
    for m in range(1, 10):
        for got, want in zip(call(x[:m], weights, scales, biases), alone, strict=True):
            assert np.array_equal(np.asarray(got), want[:m]), m
    reversed_rows = call(x[::-1], weights, scales, biases)
    assert np.array_equal(np.asarray(reversed_rows[0])[::-1], alone[0])


def test_a_bad_quantized_call_is_refused(ext):
    x = mx.zeros((2, 64))
    w, s, b = quantized(8, 64, 32, 4, seed=1)
    call = ext.quantized_linear_group
    with pytest.raises(ValueError, match="4 and 8 bits"):
        call(x, [w], [s], [b], 32, 3)
    with pytest.raises(ValueError, match="4 and 8 bits"):
        call(x, [w], [s], [b], 16, 4)
    with pytest.raises(ValueError, match=r"packed uint32 weights \[N, K \* bits / 32\]"):
        call(mx.zeros((2, 128)), [w], [s], [b], 32, 4)
    with pytest.raises(ValueError, match=r"scales and biases \[N, K / group\] of one dtype"):
        call(x, [w], [s.astype(mx.float16)], [b], 32, 4)
    with pytest.raises(ValueError, match=r"float32, float16 or bfloat16"):
        call(x, [w], [s.astype(mx.int32)], [b.astype(mx.int32)], 32, 4)
    with pytest.raises(ValueError, match="each with its scales and biases"):
        call(x, [w], [s], [], 32, 4)
    assert ext.quantized_kernel_serves(64, 8) and not ext.quantized_kernel_serves(64, 2)
    with pytest.raises(ValueError, match="int8 rows are decode rows"):
        call(x, [w], [s], [b], 32, 4, blas=True, int8=True)
    w96, s96, b96 = (mx.zeros((8, 384 * 4 // 32), dtype=mx.uint32), mx.zeros((8, 4)),
                     mx.zeros((8, 4)))
    call(mx.zeros((2, 384)), [w96], [s96], [b96], 96, 4)  # the float kernel serves it
    with pytest.raises(ValueError, match=r"int8=True\) serves groups that divide 64 bytes"):
        call(mx.zeros((2, 384)), [w96], [s96], [b96], 96, 4, int8=True)
    assert ext.int8_kernel_serves(32, 4) and not ext.int8_kernel_serves(96, 4)


def test_quantized_layers_take_the_kernel_in_a_step(kernel_calls, ext):
    """A model quantized with ``nn.quantize`` holds ``QuantizedLinear`` layers; in a step
    they go through the kernel in one call for q/k/v, and match MLX's own quantized matmul;
    formats the kernel does not serve take MLX's op."""
    from tiny_llm.kernels.cpu_kernels import KernelPlan, Linear, QuantizedLinear, apply_linears

    import mlx.nn as nn

    layers = [Linear(64, 24, bias=True), Linear(64, 8, bias=False)]
    holder = nn.Sequential(*layers)
    nn.quantize(holder, group_size=32, bits=4)
    q = holder.layers
    assert all(isinstance(layer, QuantizedLinear) for layer in q)
    x = mx.random.normal((5, 64), key=mx.random.key(2))
    together = apply_linears(x, *q, kernels=KernelPlan(3))
    assert list(kernel_calls) == [("quantized", 3), ("quantized", 2)]
    assert kernel_calls.weights == [2, 2]
    for got, layer in zip(together, q, strict=True):
        want = nn.QuantizedLinear.__call__(layer, x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    three_bits = nn.Sequential(Linear(64, 8, bias=False))
    nn.quantize(three_bits, group_size=32, bits=3)
    kernel_calls.clear()
    got = three_bits.layers[0](x, KernelPlan(5))
    assert not kernel_calls
    assert np.array_equal(np.asarray(got), np.asarray(nn.QuantizedLinear.__call__(
        three_bits.layers[0], x)))


QLANES_HARNESS = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "cpu_qlinear.h"
extern "C" void cblas_sgemm(int, int, int, int, int, int, float, const float*, int,
                            const float*, int, float, float*, int) { std::abort(); }
int main(int argc, char** argv) {
  const long M = atol(argv[1]), N = atol(argv[2]), K = atol(argv[3]);
  const int group = atoi(argv[4]), bits = atoi(argv[5]);
  const auto type = static_cast<tiny_llm::ScaleType>(atoi(argv[7]));  // 0 f32, 1 f16, 2 bf16
  std::vector<float> x(M * K), s(N * K / group), b(N * K / group), y(M * N);
  std::vector<uint16_t> s16(s.size()), b16(b.size());
  std::vector<uint32_t> w(N * K * bits / 32);
  uint32_t r = 12345;
  auto next = [&] { r = r * 1664525u + 1013904223u; return r; };
  for (auto& v : x) v = (next() >> 8) / 16777216.0f - 0.5f;
  for (auto& v : s) v = (next() >> 8) / 1677721600.0f;
  for (auto& v : b) v = -(next() >> 8) / 167772160.0f;
  for (auto& v : w) v = next();
  // float16: every finite exponent (subnormals too) and sign; bfloat16: exponents of
  // magnitudes 2^-27 .. 2^1.
  auto half = [&](uint16_t sign) {
    return static_cast<uint16_t>(sign | (next() % 31) << 10 | (next() & 0x3ff));
  };
  auto bhalf = [&](uint16_t sign) {
    return static_cast<uint16_t>(sign | (100 + next() % 28) << 7 | (next() & 0x7f));
  };
  for (size_t i = 0; i < s16.size(); ++i) {
    const uint16_t sign = next() % 4 == 0 ? 0x8000 : 0;
    s16[i] = type == tiny_llm::ScaleType::f16 ? half(0) : bhalf(0);
    b16[i] = type == tiny_llm::ScaleType::f16 ? half(sign) : bhalf(sign);
  }
  const bool wide = type == tiny_llm::ScaleType::f32;
  tiny_llm::quantized_linear_cpu(
      x.data(), {{w.data(), wide ? static_cast<const void*>(s.data()) : s16.data(),
                  wide ? static_cast<const void*>(b.data()) : b16.data(), y.data(), N, type}},
      M, K, {group, bits}, atoi(argv[6]) != 0);
  fwrite(y.data(), sizeof(float), y.size(), stdout);
}
"""


@pytest.mark.skipif(shutil.which("g++") is None or platform.machine() != "x86_64",
                    reason="needs g++ on x86_64")
def test_quantized_lanes_give_the_same_bits_on_every_vector_unit(tmp_path):
    """The quantized kernel built for AVX-512 (where the CPU has it, with and without VNNI's
    integer dot products), AVX2, plain vector extensions (what a Mac compiles, there with
    NEON) and this CPU (-march=native, as the extension is built): one definition, the same
    bits, in float and in int8 activations, with float32, float16 and bfloat16 scales (the
    native build widens float16 by F16C's instructions, the others by the kernel's own
    bit arithmetic). Where the CPU lacks AVX-512, those builds are compiled, not run, so
    that a change cannot break them unseen (one did: AVX2's integer products inside an
    AVX-512 build without VNNI, whose lanes are one register)."""
    src = Path(__file__).resolve().parent.parent / "src" / "extensions"
    (tmp_path / "harness.cpp").write_text(QLANES_HARNESS)
    targets = [("avx2", ["-mavx2", "-mfma", "-mno-avx512f"]),
               ("generic", ["-mno-avx2", "-mno-fma", "-mno-avx512f"])]
    cpuinfo = Path("/proc/cpuinfo").read_text()
    avx512 = [("avx512", ["-mavx512f", "-mavx512dq", "-mfma"], "avx512dq" in cpuinfo),
              ("avx512vnni", ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl",
                              "-mavx512vnni", "-mfma"],
               "avx512dq" in cpuinfo and "avx512_vnni" in cpuinfo and "avx512bw" in cpuinfo)]
    compiles = []
    for name, flags, runs in avx512:
        if runs:
            targets.append((name, flags))
        else:  # built all the same: each vector unit's own code must at least compile
            compiles.append(["g++", "-O2", "-std=c++17", "-Wno-psabi", *flags, f"-I{src}", "-c",
                             "-o", os.devnull, str(src / "cpu_qlinear.cpp")])
    if "f16c" in cpuinfo:
        targets.append(("native", ["-march=native"]))
    builds = [tmp_path / name for name, _ in targets]
    compiles += [["g++", "-O2", "-std=c++17", *flags, f"-I{src}", "-o", str(exe),
                  str(tmp_path / "harness.cpp"), str(src / "cpu_qlinear.cpp"),
                  str(src / "worker_pool.cpp"), str(src / "profile.cpp"), "-lpthread"]
                 for (_, flags), exe in zip(targets, builds, strict=True)]
    with ThreadPoolExecutor(os.cpu_count()) as pool:  # the compiler is one core each
        for done in pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True),
                             compiles):
            assert done.returncode == 0, done.stderr[-3000:]
    # 160 and 96: rows ending in part of a 64-byte block (int8's last block, at 4 and 8 bits)
    for m, n, k, group, bits in [(1, 7, 64, 32, 4), (5, 13, 576, 32, 4), (3, 9, 384, 128, 8),
                                 (70, 33, 256, 64, 4), (2, 11, 576, 32, 8), (1, 5, 160, 32, 4),
                                 (2, 5, 96, 32, 8)]:
        for int8, scales in itertools.product("01", "012"):
            outs = [subprocess.run([str(exe), str(m), str(n), str(k), str(group), str(bits),
                                    int8, scales], check=True, capture_output=True).stdout
                    for exe in builds]
            assert len(outs[0]) == 4 * m * n and all(o == outs[0] for o in outs), (
                m, n, k, int8, scales)


def test_a_quantized_engine_serves_each_request_as_alone(kernel_calls, smollm_tokenizer):
    """A 4-bit model (an 8-bit embedding, as the default GGUF): the engine's greedy tokens
    in a batch equal each request served alone by the same engine and by the reference
    ``stream_generate`` on MLX's own quantized matmul; its decode rows took the kernel."""
    from tiny_llm.engine import LLMEngine
    from tiny_llm.kernels import cpu_kernels
    from tiny_llm.testing.models import make_tiny_model
    from tiny_llm.testing.runs import served_alone, tokens_of, workload

    import mlx.nn as nn

    model = make_tiny_model("llama", tie_word_embeddings=True)
    nn.quantize(model, class_predicate=lambda path, module: hasattr(module, "to_quantized") and {
        "group_size": 32, "bits": 8 if "embed" in path else 4})
    assert isinstance(model.model.embed_tokens, cpu_kernels.QuantizedEmbedding)
    prompts, params = workload(6, seed=3, max_tokens=(4, 12))
    batched = tokens_of(LLMEngine(model, smollm_tokenizer, num_pages=64), prompts, params)
    assert ("quantized", 6) in kernel_calls  # a step of six decode rows
    assert not any(name == "quantized-int8" for name, _ in kernel_calls)
    for prompt, p, got in zip(prompts, params, batched, strict=True):
        alone = tokens_of(LLMEngine(model, smollm_tokenizer, num_pages=64), [prompt], [p])[0]
        assert got == alone
        assert got == served_alone(model, smollm_tokenizer, prompt["prompt_token_ids"], p)[0]
    # Int8 activations: each request's tokens in the batch equal it served alone, in int8 too.
    kernel_calls.clear()
    int8 = functools.partial(LLMEngine, model, smollm_tokenizer, num_pages=64,
                             int8_activations=True)
    batched = tokens_of(int8(), prompts, params)
    assert ("quantized-int8", 6) in kernel_calls  # the six decode rows, in int8
    for prompt, p, got in zip(prompts, params, batched, strict=True):
        assert got == tokens_of(int8(), [prompt], [p])[0]


def test_a_quantized_head_survives_a_step_without_logit_rows(smollm_tokenizer):
    """A prompt longer than the step budget: its first chunks sample nothing, so the tied
    4-bit head multiplies no rows (MLX's quantized matmul divides by the row count and
    stopped the process there); the request gets the tokens it gets alone."""
    from tiny_llm.engine import LLMEngine
    from tiny_llm.testing.models import make_tiny_model
    from tiny_llm.testing.runs import greedy, served_alone

    import mlx.nn as nn

    model = make_tiny_model("llama", tie_word_embeddings=True)
    nn.quantize(model, group_size=32, bits=4)
    prompt = list(range(100, 190))
    engine = LLMEngine(model, smollm_tokenizer, num_pages=64, max_num_batched_tokens=32,
                       max_num_seqs=4)
    got = engine.generate([prompt], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
    assert got == served_alone(model, smollm_tokenizer, prompt, greedy(4))[0]


def test_int8_activations_are_refused_where_they_cannot_serve(smollm_tokenizer):
    """No silent fallback: float weights, the MLX ops, or a format the int8 kernel does not
    serve give a clear error before anything is allocated."""
    from tiny_llm.engine import LLMEngine
    from tiny_llm.testing.models import make_tiny_model

    import mlx.nn as nn

    with pytest.raises(ValueError, match="this model has none"):
        LLMEngine(make_tiny_model("llama"), smollm_tokenizer, num_pages=8, int8_activations=True)
    with pytest.raises(ValueError, match="needs cpu_kernels=True"):
        LLMEngine(make_tiny_model("llama"), smollm_tokenizer, num_pages=8,
                  int8_activations=True, cpu_kernels=False)
    with pytest.raises(ValueError, match="speculative decoding verifies drafts"):
        LLMEngine(make_tiny_model("llama"), smollm_tokenizer, num_pages=8,
                  int8_activations=True, speculative="ngram")
    with pytest.raises(TypeError, match="int8_activations must be True or False"):
        LLMEngine(make_tiny_model("llama"), smollm_tokenizer, num_pages=8, int8_activations=1)
    model = make_tiny_model("llama")
    nn.quantize(model.model.layers[0].mlp, group_size=32, bits=3)  # not served: 3 bits
    nn.quantize(model, group_size=32, bits=4)
    with pytest.raises(ValueError, match=r"does not serve model\.layers\.0\.mlp"):
        LLMEngine(model, smollm_tokenizer, num_pages=8, int8_activations=True)
