"""Tests for tiny_llm.sampling.sampler: parameter validation, exact filter sets, seeded batch
invariance, sampled frequencies (chi-square) and greedy argmax."""

import dataclasses
import math

from tiny_llm.sampling.params import SamplingParams
from tiny_llm.sampling.sampler import (
    RequestSampler,
    TokenHistory,
    filter_logits,
    penalize,
    sample_next_tokens,
    token_logprob,
)

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.device_independent  # the sampler decides nothing by device

# ---------------------------------------------------------------------------------------------
# helpers


def kept(logits, **params) -> set[int]:
    ids, probs = filter_logits(np.asarray(logits, dtype=np.float64), SamplingParams(**params))
    assert np.all(np.diff(ids) > 0), "kept ids must be ascending"
    assert probs.sum() == pytest.approx(1.0)
    return set(ids.tolist())


def reference_kept(logits: np.ndarray, p: SamplingParams) -> set[int]:
    """The documented filter semantics, straight from the definition (full sort, no shortcuts)."""
    x = (np.asarray(logits, dtype=np.float32) / np.float32(p.temperature)).astype(np.float64)
    order = np.lexsort((np.arange(len(x)), -x))  # logit descending, then token id ascending
    xs = x[order]
    n = p.top_k if 0 < p.top_k < len(x) else len(x)
    if p.top_p < 1.0:
        probs = np.exp(xs[:n] - xs[0])
        cum = np.cumsum(probs / probs.sum())
        n = int(np.argmax(cum >= p.top_p - 1e-6)) + 1
    if p.min_p > 0.0:
        n = int(np.count_nonzero(xs[:n] >= xs[0] + math.log(p.min_p) - 1e-6))
    return set(order[:n].tolist())


def chi2_sf(x: float, dof: int) -> float:
    """Chi-square survival function: 1 - P(dof/2, x/2), P the regularised lower incomplete gamma
    function, from its power series (absolute error ~1e-10, ample for a 1e-6 threshold)."""
    a, z = dof / 2, x / 2
    term = total = 1.0 / a
    n = 0
    while term > 1e-17 * total:
        n += 1
        term *= z / (a + n)
        total += term
    return 1.0 - math.exp(-z + a * math.log(z) - math.lgamma(a)) * total


def chi2_critical(dof: int, false_alarm: float = 1e-6) -> float:
    """The chi-square quantile at 1 - false_alarm (bisection on the survival function)."""
    lo, hi = 0.0, 1000.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, dof) > false_alarm else (lo, mid)
    return hi


def run_steps(rows: list[np.ndarray], samplers: list[RequestSampler], steps: int) -> list[list]:
    """Sample ``steps`` times from fixed logits rows; returns one token list per step."""
    logits = mx.array(np.stack(rows).astype(np.float32))
    return [sample_next_tokens(logits, samplers) for _ in range(steps)]


# ---------------------------------------------------------------------------------------------
# SamplingParams validation


BAD_PARAMS = [
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "1.0"),
    ("temperature", None),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.2),
    ("top_p", float("nan")),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", True),
    ("top_k", "5"),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", float("nan")),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.5),
    ("max_tokens", "16"),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop", 5),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", ["3"]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 7),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("seed", -1),
    ("seed", 1.5),
    ("seed", "42"),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3),
    ("repetition_penalty", 0),
    ("repetition_penalty", float("inf")),
    ("logit_bias", {"x": 1.0}),
    ("logit_bias", {5: 101}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", [1, 2]),
    ("min_tokens", -1),
    ("min_tokens", 1.5),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", True),
]


@pytest.mark.parametrize(("field", "value"), BAD_PARAMS)
def test_invalid_params_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b") as err:
        SamplingParams(**{field: value})
    assert repr(value) in str(err.value)


def test_params_normalisation_and_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1.0, 1.0, -1, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and not p.greedy
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    ids = SamplingParams(stop_token_ids=(np.int64(7), 2)).stop_token_ids
    assert ids == [7, 2] and all(type(t) is int for t in ids)
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=0).top_k == 0 and SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(temperature=np.float32(0.5)).temperature == 0.5


# ---------------------------------------------------------------------------------------------
# exact filter sets

QUARTERS = np.log([0.5, 0.25, 0.125, 0.125])


def test_top_k_keeps_the_k_highest_and_ties_go_to_the_lower_id():
    logits = [1.0, 3.0, 2.0, 3.0, 0.0]
    assert kept(logits, top_k=1) == {1}
    assert kept(logits, top_k=2) == {1, 3}
    assert kept(logits, top_k=3) == {1, 2, 3}
    assert kept([5.0, 4.0, 4.0, 4.0, 1.0], top_k=2) == {0, 1}
    assert kept([5.0, 4.0, 4.0, 4.0, 1.0], top_k=3) == {0, 1, 2}
    for disabled in (-1, 0, 5, 99):
        assert kept(logits, top_k=disabled) == set(range(5))


def test_top_p_keeps_the_smallest_prefix_reaching_top_p():
    assert kept(QUARTERS, top_p=0.3) == {0}
    assert kept(QUARTERS, top_p=0.5) == {0}  # exactly on the first boundary
    assert kept(QUARTERS, top_p=0.75) == {0, 1}  # exactly on the second boundary
    assert kept(QUARTERS, top_p=0.7501) == {0, 1, 2}
    assert kept(QUARTERS, top_p=0.875) == {0, 1, 2}
    assert kept(QUARTERS, top_p=0.9) == {0, 1, 2, 3}
    assert kept(QUARTERS, top_p=1.0) == {0, 1, 2, 3}
    # equal probabilities at the boundary: the lower token ids go first
    assert kept(np.log([0.2, 0.4, 0.2, 0.2]), top_p=0.6) == {0, 1}
    assert kept(np.log([0.2, 0.4, 0.2, 0.2]), top_p=0.7) == {0, 1, 2}
    # the top token is always kept, even if alone it is far below top_p
    assert kept(np.zeros(100), top_p=0.001) == {0}


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability():
    assert kept(QUARTERS, min_p=0.5) == {0, 1}  # 0.25 is exactly half of 0.5: inclusive
    assert kept(QUARTERS, min_p=0.25) == {0, 1, 2, 3}  # exactly a quarter: inclusive
    assert kept(QUARTERS, min_p=0.26) == {0, 1}
    assert kept(QUARTERS, min_p=0.0) == {0, 1, 2, 3}
    assert kept([2.0, 5.0, 5.0, 1.0], min_p=1.0) == {1, 2}  # all tokens tied at the top
    assert kept([2.0, 5.0, 4.0, 1.0], min_p=1.0) == {1}


def test_filters_apply_after_temperature_in_the_documented_order():
    probs = np.log([0.4, 0.3, 0.2, 0.1])
    # top-p sees the top-k survivors renormalised: 0.4 / 0.7 >= 0.5, so only token 0 stays
    # (top-p on the raw probabilities would keep {0, 1}).
    assert kept(probs, top_k=2, top_p=0.5) == {0}
    assert kept(probs, top_p=0.5) == {0, 1}
    # renormalised cum (0.44, 0.78, 1.0) keeps all three; min-p 0.6 then needs p >= 0.24
    assert kept(probs, top_k=3, top_p=0.9, min_p=0.6) == {0, 1}
    # temperature 0.5 squares the ratios: (0.53, 0.3, 0.13, 0.03) -> top_p 0.8 keeps two
    assert kept(probs, top_p=0.8) == {0, 1, 2}
    assert kept(probs, temperature=0.5, top_p=0.8) == {0, 1}
    ids, p = filter_logits(probs, SamplingParams(top_k=2))
    np.testing.assert_allclose(p, [0.4 / 0.7, 0.3 / 0.7], rtol=1e-6)
    ids, p = filter_logits(probs, SamplingParams(temperature=0.5))
    np.testing.assert_allclose(p, np.array([0.16, 0.09, 0.04, 0.01]) / 0.3, rtol=1e-6)


@pytest.mark.parametrize(("spike", "top_p"), [(11.0, 0.99), (20.0, 0.999999)])
def test_top_p_reaching_into_a_flat_tail_is_exact(spike, top_p):
    # One token at ``spike`` holds nearly all of the mass, 5000 tied tokens at 0 the rest, and
    # top_p needs some of the tail: the tail lies outside the narrow candidate windows (at 20
    # nats, outside all of them, so the whole row is used).
    logits = np.zeros(5001)
    logits[2500] = spike
    z = math.exp(spike) + 5000
    need = math.ceil((top_p - 1e-6) * z - math.exp(spike))  # tail tokens of probability 1/z
    tail = [i for i in range(5001) if i != 2500]
    expected = {2500, *tail[:need]}  # ties in the tail go to the lowest ids
    assert 0 < need < 5000
    assert kept(logits, top_p=top_p) == expected
    assert expected == reference_kept(logits, SamplingParams(top_p=top_p))


def test_filters_match_the_reference_on_random_rows():
    rng = np.random.default_rng(1234)
    for case in range(300):
        vocab = int(rng.choice([7, 300, 6000]))
        p = SamplingParams(
            temperature=float(rng.uniform(0.3, 2.0)),
            top_k=int(rng.choice([-1, 1, 5, 40, vocab, vocab + 3])),
            top_p=float(rng.choice([1.0, 0.3, 0.9, 0.999])),
            min_p=float(rng.choice([0.0, 1e-7, 0.01, 0.3])),
        )
        logits = rng.standard_normal(vocab) * float(rng.choice([0.3, 2.0, 8.0]))
        if case % 3 == 0:
            logits = np.round(logits, 1)  # many ties
        ids, probs = filter_logits(logits, p)
        assert set(ids.tolist()) == reference_kept(logits, p), (case, p)
        x = logits[ids] / p.temperature
        softmax = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
        np.testing.assert_allclose(probs, softmax, rtol=1e-5, atol=1e-12)


def test_filters_match_the_reference_when_the_nucleus_reaches_a_flat_tail():
    # A few spikes hold most of the mass, far above a flat, tied tail: top-p near 1 must reach
    # into the tail, which the fast path's candidate window leaves out (full-row fallback).
    rng = np.random.default_rng(77)
    for _ in range(40):
        p = SamplingParams(
            temperature=float(rng.uniform(0.5, 1.5)),
            top_k=int(rng.choice([-1, 3000, 5999])),
            top_p=float(rng.choice([0.98, 0.999])),
            min_p=float(rng.choice([0.0, 1e-7])),
        )
        logits = np.round(rng.standard_normal(6000), 0) / 4
        logits[rng.integers(6000, size=3)] = rng.uniform(9.5, 11, size=3) * p.temperature
        ids, _ = filter_logits(logits, p)
        assert len(ids) > 3 and set(ids.tolist()) == reference_kept(logits, p), p


def test_filter_logits_accepts_mlx_rows_of_any_float_dtype():
    logits = np.random.default_rng(3).standard_normal(500).astype(np.float32)
    p = SamplingParams(top_k=30, top_p=0.8)
    ids, probs = filter_logits(logits, p)
    mx_ids, mx_probs = filter_logits(mx.array(logits), p)
    np.testing.assert_array_equal(ids, mx_ids)
    np.testing.assert_array_equal(probs, mx_probs)
    half = mx.array(logits).astype(mx.bfloat16)
    ids16, _ = filter_logits(half, p)
    assert set(ids16.tolist()) == reference_kept(np.array(half.astype(mx.float32)), p)


# ---------------------------------------------------------------------------------------------
# sampling


def test_sampled_tokens_always_come_from_the_kept_set():
    rng = np.random.default_rng(5)
    rows = [rng.standard_normal(2000) * 3 for _ in range(4)]
    params = [
        SamplingParams(top_k=3, seed=1),
        SamplingParams(top_p=0.5, seed=2),
        SamplingParams(min_p=0.3, seed=3),
        SamplingParams(temperature=2.0, top_k=50, top_p=0.7, min_p=0.05, seed=4),
    ]
    allowed = [set(filter_logits(r, p)[0].tolist()) for r, p in zip(rows, params, strict=True)]
    masked = rng.standard_normal(2000)  # a constrained-decoding mask: -inf logits, no filters
    masked[rng.permutation(2000)[:1990]] = -np.inf
    rows.append(masked)
    params.append(SamplingParams(seed=5))
    allowed.append(set(np.flatnonzero(np.isfinite(masked)).tolist()))
    for step in run_steps(rows, [RequestSampler(p) for p in params], steps=200):
        for token, ok in zip(step, allowed, strict=True):
            assert token in ok


def test_seeded_runs_repeat_and_different_seeds_differ():
    row = np.log(np.full(16, 1 / 16))

    def draws(seed):
        return [t for (t,) in run_steps([row], [RequestSampler(SamplingParams(seed=seed))], 60)]

    assert draws(11) == draws(11)
    assert draws(11) != draws(12)
    unseeded = [RequestSampler(SamplingParams()) for _ in range(2)]
    a, b = zip(*run_steps([row, row], unseeded, 60), strict=True)
    assert a != b


def test_seeded_request_is_batch_invariant():
    rng = np.random.default_rng(99)
    steps, vocab = 40, 3000
    mine = SamplingParams(temperature=0.9, top_k=200, top_p=0.95, seed=123)
    own_rows = [rng.standard_normal(vocab) * 2 for _ in range(steps)]

    def my_tokens(batch_params: list[SamplingParams | None]) -> list[int]:
        """Run my request at the position of None, with other requests around it."""
        samplers = [RequestSampler(p or mine) for p in batch_params]
        where = batch_params.index(None)
        out = []
        for row in own_rows:
            batch = [rng.standard_normal(vocab) * 2 for _ in batch_params]
            batch[where] = row
            out.append(sample_next_tokens(mx.array(np.stack(batch), mx.float32), samplers)[where])
        return out

    alone = my_tokens([None])
    assert len(set(alone)) > 5  # genuinely random
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(seed=5, min_p=0.1),
        SamplingParams(temperature=1.5),
    ]
    assert my_tokens([*others, None]) == alone
    assert my_tokens([None, others[1], others[0]]) == alone
    assert my_tokens([others[2], None, SamplingParams(seed=123)]) == alone


# Fixed configurations: (logits, params, ids kept, unscaled logits of those ids or None to read
# the expected probabilities from the softmax of all logits).
def _peaked_vocab() -> np.ndarray:
    logits = np.full(4096, -30.0)
    logits[[7, 100, 2048, 3000, 4000, 4095]] = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5]
    return logits


EIGHT = np.log([0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02])
CHI2_CASES = [
    # no filter: the softmax of logits / 0.7 over all 8 tokens
    (EIGHT, SamplingParams(temperature=0.7), list(range(8))),
    # top-k 6 renormalised cum (.32 .55 .72 .84 .94 1) -> top-p .9 keeps 5 -> min-p .35 keeps 4
    (EIGHT, SamplingParams(top_k=6, top_p=0.9, min_p=0.35), [0, 1, 2, 3]),
    # large vocabulary (fast candidate path): the 6 high tokens; the tail is cut by min-p
    (_peaked_vocab(), SamplingParams(temperature=1.2, top_p=0.97, min_p=0.02),
     [7, 100, 2048, 3000, 4000, 4095]),
]  # fmt: skip


@pytest.mark.parametrize(("logits", "params", "expected_ids"), CHI2_CASES)
def test_sampled_frequencies_match_filtered_softmax(logits, params, expected_ids):
    rows, steps = 200, 60  # 12000 draws from 200 requests seeded 0..199
    samplers = [RequestSampler(dataclasses.replace(params, seed=s)) for s in range(rows)]
    draws = np.array(run_steps([logits] * rows, samplers, steps)).ravel()
    ids, probs = filter_logits(logits, params)
    assert ids.tolist() == expected_ids
    x = logits[ids] / params.temperature
    np.testing.assert_allclose(probs, np.exp(x) / np.exp(x).sum(), rtol=1e-5)
    assert set(np.unique(draws).tolist()) <= set(expected_ids)
    observed = np.array([np.count_nonzero(draws == t) for t in ids])
    expected = probs * len(draws)
    assert expected.min() > 50  # the chi-square approximation holds
    statistic = float(((observed - expected) ** 2 / expected).sum())
    # Threshold: the chi-square quantile for len(ids) - 1 degrees of freedom at 1 - 1e-6, so a
    # correct sampler fails with probability 1e-6 (the seeds are fixed, so it is deterministic).
    assert statistic < chi2_critical(len(ids) - 1), (statistic, observed, expected)


def test_chi2_critical_values():
    # dof 2 has the closed form sf(x) = exp(-x / 2); dof 1 is erfc(sqrt(x / 2)).
    assert chi2_critical(2) == pytest.approx(2 * math.log(1e6), rel=1e-9)
    assert math.erfc(math.sqrt(chi2_critical(1) / 2)) == pytest.approx(1e-6, rel=1e-6)
    assert chi2_critical(7) > chi2_critical(3) > chi2_critical(1)


# ---------------------------------------------------------------------------------------------
# greedy


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_greedy_is_argmax_for_every_float_dtype(dtype):
    values = np.random.default_rng(0).standard_normal((32, 5000)) * 4
    logits = mx.array(values).astype(dtype)
    as_float = np.array(logits.astype(mx.float32))
    samplers = [RequestSampler(SamplingParams(temperature=0.0, top_k=3)) for _ in range(32)]
    assert sample_next_tokens(logits, samplers) == np.argmax(as_float, axis=1).tolist()
    if dtype == mx.bfloat16:  # coarse values: ties at the maximum actually occur
        assert any(np.count_nonzero(r == r.max()) > 1 for r in as_float)


def test_greedy_ties_pick_the_lowest_id_and_mix_with_sampled_rows():
    logits = mx.array([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 9.0], [2.0, 2.0, 1.0, 2.0]])
    samplers = [
        RequestSampler(SamplingParams(temperature=0.0)),
        RequestSampler(SamplingParams(top_k=1, seed=0)),
        RequestSampler(SamplingParams(temperature=0.0)),
    ]
    assert sample_next_tokens(logits, samplers) == [1, 3, 0]
    ids, probs = filter_logits(logits[0], SamplingParams(temperature=0.0))
    assert ids.tolist() == [1] and probs.tolist() == [1.0]


def test_batch_shape_must_match_the_samplers():
    sampler = RequestSampler(SamplingParams())
    with pytest.raises(ValueError, match="samplers"):
        sample_next_tokens(mx.zeros((2, 8)), [sampler])
    with pytest.raises(ValueError, match="samplers"):
        sample_next_tokens(mx.zeros((8,)), [sampler])
    assert sample_next_tokens(mx.zeros((0, 8)), []) == []


# ---------------------------------------------------------------------------------------------
# Penalties, biases, min_tokens


def test_penalties_and_biases_as_vllm_defines_them():
    row = np.array([2.0, -1.0, 0.5, 1.0, 3.0], np.float32)
    history = TokenHistory(prompt_token_ids=[1], output_token_ids=[3, 3, 2], end_token_ids={4})
    p = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5,
                       presence_penalty=0.25, logit_bias={"0": -10}, min_tokens=5)
    assert p.logit_bias == {0: -10.0} and p.penalized
    # By hand: token 4 (an end token) masked while the output is shorter than min_tokens;
    # token 0 biased; tokens 1 (prompt), 2 and 3 (output) divided by 2 if positive, else
    # multiplied; then 0.5 per occurrence in the output and 0.25 once for being there.
    want = [2.0 - 10, -1.0 * 2, 0.5 / 2 - 0.5 - 0.25, 1.0 / 2 - 1.0 - 0.25, -np.inf]
    np.testing.assert_allclose(penalize(row, p, history), want, rtol=1e-6)
    sampler = RequestSampler(p, history)
    assert sample_next_tokens(mx.array(row[None]), [sampler]) == [2]
    history.output_token_ids += [0, 0]  # five tokens: the end token is allowed again
    assert sample_next_tokens(mx.array(row[None]), [sampler]) == [4]
    with pytest.raises(ValueError, match="need the request's tokens"):
        RequestSampler(p)
    with pytest.raises(ValueError, match="min_tokens must be at most max_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("penalty", [1e-38, 1e-50, 5e-324])
def test_a_penalty_near_zero_keeps_the_row_finite(temperature, penalty):
    """Dividing a positive logit by a repetition penalty near 0 overflows float32 (and such a
    penalty rounds to 0 in float32): the row keeps the highest finite value instead, so the
    tokens it favours stay the likeliest and every probability and logprob is a number (a
    NaN would fail the server's JSON). A masked end token stays masked."""
    row = np.array([2.0, 1.0, -1.0, 3.0, 0.5], np.float32)
    history = TokenHistory(prompt_token_ids=[0, 1, 2, 4], output_token_ids=[],
                           end_token_ids={4})
    p = SamplingParams(temperature=temperature, seed=0, repetition_penalty=penalty,
                       logprobs=3, min_tokens=1)
    penalized = penalize(row, p, history)
    assert np.isfinite(penalized[:4]).all() and min(penalized[:2]) > penalized[3]
    assert penalized[2] <= 0 and penalized[4] == -np.inf
    sampler = RequestSampler(p, history)
    (token,) = sample_next_tokens(mx.array(row[None]), [sampler], "processed_logprobs")
    assert token in (0, 1)  # the two seen tokens, both at float32's highest value
    (record,) = sampler.logprobs
    assert all(math.isfinite(lp) for lp in [record.logprob, *(lp for _, lp in record.top)])
    assert {t for t, _ in record.top[:2]} == {0, 1}
    _, probs = filter_logits(penalized, p)
    assert np.all(np.isfinite(probs))


@pytest.mark.parametrize("penalty", [1e39, 1.7e308])
def test_a_huge_penalty_on_a_row_of_seen_negative_logits_keeps_it_finite(penalty):
    """Multiplying negative logits by a huge repetition penalty overflows float32 to -inf;
    were every token seen, the row would be all -inf and its softmax NaN. They stay at
    float32's lowest value instead, and the masked end token at -inf."""
    row = np.array([-2.0, -1.0, -3.0, -0.5, 1.0], np.float32)
    history = TokenHistory(prompt_token_ids=[0, 1, 2, 3, 4], output_token_ids=[],
                           end_token_ids={4})
    p = SamplingParams(temperature=0, repetition_penalty=penalty, logprobs=1, min_tokens=1)
    penalized = penalize(row, p, history)
    assert np.isfinite(penalized[:4]).all() and penalized[4] == -np.inf
    sampler = RequestSampler(p, history)
    (token,) = sample_next_tokens(mx.array(row[None]), [sampler], "processed_logprobs")
    assert token in range(4) and math.isfinite(sampler.logprobs[0].logprob)


def test_a_penalized_request_gets_its_tokens_alone_and_batched(tiny_model, smollm_tokenizer):
    """Penalties read only the request's own tokens: greedy and seeded sampled requests with
    penalties get the same tokens in a batch as served alone."""
    from tiny_llm.engine import LLMEngine
    from tiny_llm.testing.runs import random_prompts, served_alone, tokens_of

    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             frequency_penalty=1.5, presence_penalty=0.5),
              SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True,
                             repetition_penalty=1.3, logit_bias={7: 5.0}),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={7: 100}),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={7: 100},
                             repetition_penalty=1e6)]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, seed=11, lo=4, hi=20)]
    first = served_alone(tiny_model, smollm_tokenizer, prompts[4]["prompt_token_ids"],
                         SamplingParams(temperature=0, max_tokens=1))[0][0]
    # Its first token would stop it at once; min_tokens holds it back for 12 tokens.
    params.append(SamplingParams(temperature=0, max_tokens=12, min_tokens=12,
                                 stop_token_ids=[first]))
    engine = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=4, num_pages=64)
    batched = tokens_of(engine, prompts, params)
    for prompt, p, got in zip(prompts, params, batched, strict=True):
        assert got == served_alone(tiny_model, smollm_tokenizer, prompt["prompt_token_ids"], p)[0]
    assert batched[2] == [7] * 6  # the bias wins every step
    assert batched[3][0] == 7 and 7 not in batched[3][1:]  # then the repetition penalty
    assert len(batched[4]) == 12 and first not in batched[4]


def test_special_tokens_are_left_out_of_the_text_unless_asked_for(tiny_model, smollm_tokenizer):
    """As vLLM's default: an end token the request goes past (ignore_eos) is in the token
    ids, not in the text; skip_special_tokens=False keeps its spelling."""
    from tiny_llm.engine import LLMEngine

    eos = min(smollm_tokenizer.eos_token_ids)
    engine = LLMEngine(tiny_model, smollm_tokenizer, num_pages=32)
    forced = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={eos: 100})
    prompt = {"prompt_token_ids": [5, 6, 7]}
    skipped = engine.generate(prompt, SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    kept = engine.generate(prompt, SamplingParams(**forced, skip_special_tokens=False),
                           use_tqdm=False)[0].outputs[0]
    assert skipped.token_ids == kept.token_ids == [eos] * 3
    assert skipped.text == "" and kept.text == smollm_tokenizer.decode([eos]) * 3 != ""
    with pytest.raises(ValueError, match="skip_special_tokens must be a bool"):
        SamplingParams(skip_special_tokens=1)


# ---------------------------------------------------------------------------------------------
# Logprobs


def test_a_tokens_logprob_and_the_most_likely_ones():
    x = np.array([1.0, 3.0, 3.0, -2.0], np.float32)
    log_norm = math.log(sum(math.exp(v) for v in x))
    record = token_logprob(x, 0, 3)
    assert record.token == 0 and math.isclose(record.logprob, 1.0 - log_norm, rel_tol=1e-12)
    assert [t for t, _ in record.top] == [1, 2, 0]  # the tie at 3.0 by ascending id
    assert math.isclose(record.top[0][1], 3.0 - log_norm, rel_tol=1e-12)
    assert token_logprob(x, 3, 0).top == ()
    for mode, drawn_from in (("raw_logprobs", x), ("processed_logprobs", x / np.float32(2.0))):
        sampler = RequestSampler(SamplingParams(temperature=2.0, seed=0, logprobs=2))
        token = sample_next_tokens(mx.array(x[None]), [sampler], mode)[0]
        assert sampler.logprobs == [token_logprob(drawn_from, token, 2)]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_modes_read_the_raw_row_or_the_distribution_drawn_from(temperature):
    """raw_logprobs: the row as it came, log-softmaxed. processed_logprobs: the distribution
    the token was drawn from (``filter_logits`` of the penalized row: bias, penalties,
    temperature, top-k and min-p), the tokens the filters drop never listed; a greedy
    row's after the bias and penalties only. The mode changes no token."""
    rng = np.random.default_rng(4)
    row = rng.normal(0.0, 2.0, 64).astype(np.float32)
    p = SamplingParams(temperature=temperature, seed=3, top_k=6, min_p=0.05, logprobs=8,
                       presence_penalty=1.5, logit_bias={5: 4.0, 9: -3.0})
    history = TokenHistory([1, 2], [int(np.argmax(row)), 7], set())
    penalized = penalize(row, p, history)
    tokens, records = {}, {}
    for mode in ("raw_logprobs", "processed_logprobs"):
        sampler = RequestSampler(p, TokenHistory([1, 2], list(history.output_token_ids), set()))
        tokens[mode] = [sample_next_tokens(mx.array(row[None]), [sampler], mode)[0]
                        for _ in range(20)]
        records[mode] = sampler.logprobs
    assert tokens["raw_logprobs"] == tokens["processed_logprobs"]
    ids, probs = filter_logits(penalized, p)
    want = dict(zip(ids.tolist(), np.log(probs).tolist(), strict=True))
    for token, raw, processed in zip(tokens["raw_logprobs"], records["raw_logprobs"],
                                     records["processed_logprobs"], strict=True):
        assert raw == token_logprob(row, token, 8)
        assert not math.isclose(processed.logprob, raw.logprob, abs_tol=1e-3)
        if p.greedy:
            assert processed == token_logprob(penalized, token, 8)
            continue
        assert math.isclose(processed.logprob, want[token], abs_tol=1e-6)
        best = sorted(want, key=lambda t: (-want[t], t))
        assert [t for t, _ in processed.top] == best and len(best) < 8
        assert all(math.isclose(lp, want[t], abs_tol=1e-6) for t, lp in processed.top)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_are_the_models_own_or_the_processed_ones(tiny_model, smollm_tokenizer, mode):
    """Each token's record against a recomputation from the model's logits at every position
    of prompt + output (one forward): log-softmaxed as they are (``raw_logprobs``, the
    default), or as the sampler processed them (``processed_logprobs``: the bias and
    penalties of the tokens before the position, then for a sampled row the temperature
    and top-k, ``filter_logits``); greedy and sampled, batched, each with the tokens it
    gets served alone. The two modes differ here, by the bias and the penalties."""
    from tiny_llm.engine import LLMEngine
    from tiny_llm.step.dense_kv import DenseKVCache
    from tiny_llm.testing.runs import random_prompts, served_alone

    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, seed=5, lo=4, hi=12)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3,
                             frequency_penalty=1.0, logit_bias={7: 2.0}),
              SamplingParams(temperature=0.7, seed=1, top_k=40, max_tokens=6, ignore_eos=True,
                             logprobs=3, repetition_penalty=1.5, logit_bias={7: 3.0}),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    options = {} if mode == "raw_logprobs" else {"logprobs_mode": mode}
    engine = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=3, num_pages=64, **options)
    assert engine.config.logprobs_mode == mode
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert outs[2].outputs[0].logprobs is None
    gap = 0.0  # how far the two modes' records are apart
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        ids, tokens = prompt["prompt_token_ids"], out.outputs[0].token_ids
        assert tokens == served_alone(tiny_model, smollm_tokenizer, ids, p)[0]
        if p.logprobs is None:
            continue
        seq = ids + tokens
        n = len(seq)
        logits = tiny_model(mx.array(seq, mx.int32), mx.arange(n),
                            DenseKVCache(tiny_model.config.num_hidden_layers), mx.arange(n))
        rows = np.array(logits.astype(mx.float32))[len(ids) - 1 : n - 1]
        records = out.outputs[0].logprobs
        assert [r.token for r in records] == tokens
        for i, (row, record) in enumerate(zip(rows, records, strict=True)):
            penalized = penalize(row, p, TokenHistory(ids, tokens[:i], set()))
            processed = log_softmax(penalized)
            if not p.greedy:
                kept, probs = filter_logits(penalized, p)
                processed = np.full(len(row), -np.inf)
                processed[kept] = np.log(probs)
            want, other = (log_softmax(row), processed) if mode == "raw_logprobs" else (
                processed, log_softmax(row))
            assert abs(record.logprob - want[record.token]) < 1e-4
            assert [t for t, _ in record.top] == list(np.argsort(-want, kind="stable")[:3])
            assert all(abs(lp - want[t]) < 1e-4 for t, lp in record.top)
            gap = max(gap, abs(other[record.token] - want[record.token]))
    assert gap > 0.1


def test_logprobs_mode_is_an_engine_option_checked_when_made():
    from tiny_llm.cli import build_parser, engine_options
    from tiny_llm.engine import EngineConfig

    assert EngineConfig().logprobs_mode == "raw_logprobs"  # vLLM's default
    with pytest.raises(ValueError, match=r"logprobs_mode must be one of \('raw_logprobs', "
                                         r"'processed_logprobs'\), got 'processed'"):
        EngineConfig(logprobs_mode="processed")
    for command in (["serve"], ["generate", "--prompt", "hi"]):
        args = build_parser().parse_args([*command, "--logprobs-mode", "processed_logprobs"])
        assert engine_options(args) == {"logprobs_mode": "processed_logprobs"}


def test_prompt_logprobs_are_the_models_own(tiny_model, smollm_tokenizer):
    """prompt_logprobs against a recomputation (the model's logits over the whole prompt,
    log-softmaxed, no temperature): scored across chunked-prefill steps, beside requests
    that do not ask, never from a cached prefix (which has no logits), once under n
    samples, and unchanged when the pool is so small that requests are preempted and
    recomputed."""
    from tiny_llm.engine import LLMEngine
    from tiny_llm.step.dense_kv import DenseKVCache
    from tiny_llm.testing.runs import random_prompts

    def expected(ids: list[int], k: int) -> list[tuple[int, float, list[int]]]:
        n = len(ids)
        logits = tiny_model(mx.array(ids, mx.int32), mx.arange(n),
                            DenseKVCache(tiny_model.config.num_hidden_layers), mx.arange(n))
        rows = np.array(logits.astype(mx.float32)).astype(np.float64)[: n - 1]
        want = rows - (rows.max(1, keepdims=True)
                       + np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1, keepdims=True)))
        return [(t, want[i, t], list(np.argsort(-want[i], kind="stable")[:k]))
                for i, t in enumerate(ids[1:])]

    def check(out, ids: list[int], k: int) -> None:
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for record, (token, logprob, best) in zip(out.prompt_logprobs[1:], expected(ids, k),
                                                   strict=True):
            assert record.token == token and abs(record.logprob - logprob) < 1e-4
            assert [t for t, _ in record.top] == best

    shared, tail = random_prompts(2, seed=9, lo=40, hi=41)
    engine = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=4, num_pages=64,
                       max_num_batched_tokens=24)  # 40-token prompts: prefilled in chunks
    plain = SamplingParams(temperature=0, max_tokens=3)
    engine.generate([{"prompt_token_ids": shared}], [plain], use_tqdm=False)  # cached now
    prompts = [{"prompt_token_ids": p} for p in (shared, shared + tail[:5], tail)]
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3), plain,
              SamplingParams(temperature=1.0, seed=2, max_tokens=3, prompt_logprobs=0, n=2)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    check(outs[0], shared, 3)
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens > 0
    assert outs[1].prompt_logprobs is None
    check(outs[2], tail, 0)
    assert len(outs[2].outputs) == 2
    alone = engine.generate([prompts[2]], [SamplingParams(max_tokens=1, prompt_logprobs=0)],
                            use_tqdm=False)  # a step whose scored rows all want k = 0
    check(alone[0], tail, 0)

    small = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=4, num_pages=6, page_size=16,
                      max_num_batched_tokens=24)  # 96 tokens: not enough for both at once
    scored = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=2)
    outs = small.generate([{"prompt_token_ids": shared}, {"prompt_token_ids": tail}],
                          [scored, scored], use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    check(outs[0], shared, 2)
    check(outs[1], tail, 2)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
