"""Token sampling: logit filters, penalties and batch-invariant seeded draws (a request's
parameters and their checks: ``params``).

What happens to one row of logits:

1. The row is read as float32 (exact for float16/bfloat16 logits).
2. ``temperature < 1e-5`` (0 included) is greedy: argmax, lowest token id on ties. All
   greedy rows of a batch share one vectorised MLX argmax and consume no randomness.
3. Otherwise the row is divided by the temperature (still float32: the "scaled logits") and
   filtered in vLLM V0's order: top-k (keep the k highest), then top-p on the renormalised
   probabilities of the top-k survivors (keep the shortest rank prefix whose mass reaches
   top_p), then min-p (keep tokens whose probability is at least ``min_p`` times the top
   token's; a ratio, so renormalisation does not matter to it). vLLM V1 applies min-p first,
   and its top-p then renormalises over min-p's survivors: a different set can survive.
   Before either, a request with penalties, a logit bias or ``min_tokens`` has its row
   adjusted on the host (``penalize``, from the request's own tokens); a greedy one then
   takes numpy's argmax, with the same tie rule.
4. One uniform draw from the request's own ``np.random.Generator`` picks a token by inverse CDF
   over the kept tokens, walked in ascending token-id order.
5. A request with ``logprobs`` records the token (``TokenLogprob``): in the model's own
   distribution (the engine's default ``logprobs_mode``, read from the row as it came), or
   in the one it was drawn from; a request without them costs no pass for them.

Invariants:

* Rank order is (scaled logit descending, token id ascending). Every filter keeps a prefix of
  it, so a tie at any boundary goes to the lower token id, and the top token is always kept.
* Top-p and min-p boundaries allow a slack of ``_SLACK`` (1e-6) so that a boundary that is exact
  in real arithmetic stays inclusive despite float32 rounding: top_p=0.75 over probabilities
  (0.5, 0.25, 0.25) keeps two tokens, min_p=0.5 keeps a token at exactly half the top
  probability. Exponentials are float32 (relative error ~1e-7, below the slack); every sum,
  cumulative sum and comparison with a threshold is float64.
* A row's token depends only on its logits, its params and its generator, which advances
  exactly once per sampled step. So a seeded request draws the same tokens whatever else is in
  the batch; unseeded requests get independent generators spawned from one process-level
  ``SeedSequence`` (OS entropy).

Why numpy rather than MLX for sampled rows: per-request generators make seeded draws exact and
independent of batch composition, float64 sums keep tail probabilities that float32 would round
away, and the filters need data-dependent, per-row work. To keep a row's cost O(V) plus a small
sort, the filters read only candidates: the narrowest window of ``_WINDOWS`` (all tokens within
2, 4, ... 16 nats of the top logit, each found with one comparison) that holds the top-k set or
else top_p of the probability mass, or the whole row if none does; with top-k, narrowed to the
top-k set by ``np.partition``. Every candidate set is all tokens at or above some value, hence a
prefix of the rank order that contains every token the filters can keep, so sorting just its
values gives the same result as sorting the vocabulary. Min-p alone needs no sort at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tiny_llm.sampling.params import FLOAT32_MAX, SamplingParams
from tiny_llm.structured import Constraint, constrained

import mlx.core as mx
import numpy as np

_SLACK = 1e-6
_WINDOWS = (2.0, 4.0, 6.0, 8.0, 11.0, 16.0)  # candidate windows, in nats below the top logit
_MASS_GUARD = 1e-9  # a window's mass must beat top_p by this, far above float64 rounding
_ENTROPY = np.random.SeedSequence()


@dataclass
class TokenHistory:
    """What penalties read of a request: its prompt, its output so far (the request's own
    list, which grows as it decodes), and the tokens that would end it (min_tokens holds
    them back)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    end_token_ids: set[int]


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability, and the ``logprobs`` most likely tokens' (ties by
    ascending id; only tokens of finite log-probability are listed), in the distribution
    the engine's ``logprobs_mode`` names (``LOGPROBS_MODES``, vLLM's names):

    * ``raw_logprobs`` (the default): the model's own, the log-softmax of its logits
      before anything the request's sampling parameters do, but after a structured output's
      mask (vLLM applies the grammar before its sampler too): a record never lists a token
      the grammar forbids;
    * ``processed_logprobs``: the distribution the token was drawn from: the logits after
      the grammar's mask, min_tokens, logit_bias and the repetition, frequency and presence
      penalties, divided by the temperature, renormalised over the tokens top-k, top-p
      and min-p keep (the others at -inf). A greedy request's row is neither divided nor
      filtered: its argmax reads the whole row.

    A prompt token's record (``prompt_logprobs``) is always the model's own."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class RequestSampler:
    """One request's params and its own random generator (seeded, or spawned from OS
    entropy); with penalties, the request's ``history``; with ``logprobs``, a record per
    sampled token; with a structured output, its ``constraint``."""

    def __init__(self, params: SamplingParams, history: TokenHistory | None = None,
                 constraint: Constraint | None = None) -> None:
        if params.penalized and history is None:
            raise ValueError("penalties, logit_bias and min_tokens need the request's tokens")
        if (params.structured is None) != (constraint is None):
            raise ValueError("a structured output needs its constraint (Grammars.constraint)")
        self.params, self.history, self.constraint = params, history, constraint
        seed = params.seed if params.seed is not None else _ENTROPY.spawn(1)[0]
        self.rng = np.random.default_rng(seed)
        self.logprobs: list[TokenLogprob] = []

    def checkpoint(self) -> SamplerCheckpoint:
        """What a step may change: the generator's state, the records, the matcher."""
        consumed = self.constraint.consumed if self.constraint is not None else 0
        return SamplerCheckpoint(self.rng.bit_generator.state, len(self.logprobs), consumed)

    def restore(self, checkpoint: SamplerCheckpoint) -> None:
        """Undo what a failed step did since ``checkpoint``: the same draws come again."""
        self.rng.bit_generator.state = checkpoint.rng_state
        del self.logprobs[checkpoint.num_logprobs:]
        if self.constraint is not None:
            self.constraint.rollback(checkpoint.consumed)


class SamplerCheckpoint(NamedTuple):
    rng_state: dict
    num_logprobs: int
    consumed: int  # tokens the grammar's matcher had taken


def token_logprob(x: np.ndarray, token: int, k: int) -> TokenLogprob:
    """``token``'s record in the distribution softmax(``x``), with the ``k`` most likely."""
    x = x.astype(np.float64)
    top = float(x.max())
    log_norm = top + math.log(np.exp(x - top).sum())
    best = np.array([], dtype=np.int64)
    if k:  # the k highest without sorting the vocabulary: those at or above the k-th, ranked
        kth = np.partition(x, len(x) - k)[len(x) - k]
        # Only tokens that could be drawn: a grammar's mask leaves the others at -inf.
        ids = np.flatnonzero(x >= kth) if np.isfinite(kth) else np.flatnonzero(np.isfinite(x))
        best = ids[np.lexsort((ids, -x[ids]))][:k]  # ties by ascending id
    return TokenLogprob(token, float(x[token] - log_norm),
                        tuple((int(t), float(x[t] - log_norm)) for t in best))


# ANCHOR: penalize
def penalize(row: np.ndarray, p: SamplingParams, history: TokenHistory) -> np.ndarray:
    """A row of float32 logits with ``p``'s biases and penalties applied, in vLLM's order:
    min_tokens (the end tokens masked), logit_bias, then the repetition, frequency and
    presence penalties."""
    row = np.array(row, dtype=np.float32)
    if len(history.output_token_ids) < p.min_tokens:
        ends = [t for t in history.end_token_ids if t < len(row)]
        row[ends] = -np.inf
    for token, bias in p.logit_bias.items():  # ids checked against the vocabulary at admission
        row[token] += np.float32(bias)
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.array([*history.prompt_token_ids, *history.output_token_ids],
                                  dtype=np.int64))
        seen = seen[seen < len(row)]
        # In float64, then back within float32's range: a penalty near 0 would round to 0 in
        # float32 or overflow a positive logit to inf, a huge one a negative logit to -inf
        # (a row of infinities has a NaN softmax). A masked token stays at -inf.
        x, rp = row[seen].astype(np.float64), p.repetition_penalty
        with np.errstate(over="ignore"):
            penalized = np.clip(np.where(x > 0, x / rp, x * rp), -FLOAT32_MAX, FLOAT32_MAX)
        row[seen] = np.where(np.isneginf(x), x, penalized)
    if p.frequency_penalty or p.presence_penalty:
        counts = np.bincount(np.array(history.output_token_ids, dtype=np.int64),
                             minlength=len(row))[: len(row)]
        row -= np.float32(p.frequency_penalty) * counts.astype(np.float32)
        row -= np.float32(p.presence_penalty) * (counts > 0).astype(np.float32)
    return row
# ANCHOR_END: penalize


class _Filters(NamedTuple):
    """A row's filters; ``top_k`` is 0 when disabled or when it would keep the whole row."""

    top_k: int
    top_p: float
    min_p: float

    @classmethod
    def of(cls, p: SamplingParams, vocab: int) -> _Filters:
        return cls(p.top_k if 0 < p.top_k < vocab else 0, p.top_p, p.min_p)


def _scaled(row: np.ndarray, temperature: float) -> np.ndarray:
    """float32 logits divided by the temperature, kept in float32 and finite above."""
    with np.errstate(over="ignore"):
        x = row / np.float32(temperature)
    return np.minimum(x, FLOAT32_MAX, out=x)


def _logsumexp(x: np.ndarray, top: float) -> float:
    """log(sum(exp(x))) given ``top = x.max()``, accumulated in float64."""
    return top + math.log(np.exp(x - top).sum(dtype=np.float64))


def _min_p_bound(top: float, min_p: float) -> np.float64:
    """Lowest scaled logit min-p keeps (probability >= min_p * top probability, less slack)."""
    return np.float64(top + math.log(min_p) - _SLACK)


def _window_suffices(ids: np.ndarray, x: np.ndarray, f: _Filters, log_norm: float | None) -> bool:
    """Whether a window holds what the filters read: the top-k set, or else top_p of the mass."""
    if f.top_k:
        return len(ids) >= f.top_k
    mass = float(np.exp(x[ids].astype(np.float64) - log_norm).sum())
    return mass >= f.top_p - _SLACK + _MASS_GUARD


# ANCHOR: filters
def _candidates(x: np.ndarray, top: float, f: _Filters, log_norm: float | None) -> np.ndarray:
    """A rank prefix of the row (ids ascending) holding every token the filters can keep.

    The first window (all tokens within ``_WINDOWS`` nats of the top logit) that suffices, else
    the whole row; with top-k, narrowed to the top-k set (and its ties) by ``np.partition``.
    """
    windows = (np.flatnonzero(x >= top - margin) for margin in _WINDOWS)
    ids = next((w for w in windows if _window_suffices(w, x, f, log_norm)), np.arange(len(x)))
    if f.top_k:
        xs = x[ids]
        kth = np.partition(xs, len(xs) - f.top_k)[len(xs) - f.top_k]
        ids = ids[xs >= kth]
    return ids


def _kept_prefix(ranked: np.ndarray, log_norm: float | None, f: _Filters) -> int:
    """How many leading candidates survive, given their scaled logits in rank order.

    ``log_norm`` is the row's logsumexp, read by top-p without top-k; with top-k, top-p reads
    the probabilities renormalised over the top-k set.
    """
    n = len(ranked)
    if f.top_k:
        n = f.top_k
        log_norm = _logsumexp(ranked[:n], ranked[0])
    if f.top_p < 1.0:
        cum = np.cumsum(np.exp(ranked[:n] - log_norm))
        n = min(n, int(np.searchsorted(cum, f.top_p - _SLACK)) + 1)  # first reaching top_p
    if f.min_p > 0.0:
        n = int(np.count_nonzero(ranked[:n] >= _min_p_bound(ranked[0], f.min_p)))
    return n


def _rank_prefix(ids: np.ndarray, xs: np.ndarray, n: int, last: float) -> np.ndarray:
    """The first ``n`` of ``ids`` in rank order (ids ascending), the n-th having logit ``last``:
    every token above ``last``, then tokens equal to it by ascending id."""
    keep = xs > last
    keep[np.flatnonzero(xs == last)[: n - np.count_nonzero(keep)]] = True
    return ids[keep]


def _filtered(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Ids (ascending) of the tokens that survive top-k, top-p and min-p on scaled logits."""
    f = _Filters.of(p, len(x))
    top = float(x.max())
    if not f.top_k and f.top_p >= 1.0:  # at most min-p: a threshold, no ranking needed
        if f.min_p <= 0.0:
            return np.arange(len(x))
        return np.flatnonzero(x >= _min_p_bound(top, f.min_p))
    log_norm = None if f.top_k else _logsumexp(x, top)
    ids = _candidates(x, top, f, log_norm)
    xs = x[ids].astype(np.float64)
    ranked = np.sort(xs)[::-1]  # values only: cheaper than an argsort
    n = _kept_prefix(ranked, log_norm, f)
    return _rank_prefix(ids, xs, n, ranked[n - 1])


def _weights(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Unnormalised probabilities of the kept tokens ``ids`` (float32, top token 1)."""
    xs = x if len(ids) == len(x) else x[ids]
    return np.exp(xs - xs.max())


def _draw(x: np.ndarray, ids: np.ndarray, rng: np.random.Generator) -> int:
    """One uniform draw picks a kept token by inverse CDF, ``ids`` ascending."""
    cum = np.cumsum(_weights(x, ids), dtype=np.float64)
    i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    return int(ids[min(i, len(ids) - 1)])
# ANCHOR_END: filters


def _kept_only(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``x`` with every token but ``ids`` at -inf: the filtered distribution's logits."""
    if len(ids) == len(x):
        return x
    out = np.full_like(x, -np.inf)
    out[ids] = x[ids]
    return out


def _rows(logits: mx.array, rows: list[int]) -> mx.array:
    picked = logits if len(rows) == logits.shape[0] else logits[mx.array(rows)]
    return picked.astype(mx.float32)


# ANCHOR: sample_next_tokens
def sample_next_tokens(logits: mx.array, samplers: Sequence[RequestSampler],
                       logprobs_mode: str = "raw_logprobs",
                       argmax: Callable[[mx.array], mx.array] | None = None) -> list[int]:
    """Next token for each row of ``logits`` [B, V]; row b uses ``samplers[b]``. A request
    with ``logprobs`` records each token in the distribution ``logprobs_mode`` names
    (``TokenLogprob``). ``argmax``: the greedy rows' ``mx.argmax(rows, axis=-1)``, computed
    another way (the CPU kernels' op)."""
    if logits.ndim != 2 or logits.shape[0] != len(samplers):
        raise ValueError(
            f"logits must be [B, V] with B == len(samplers) == {len(samplers)}, "
            f"got shape {tuple(logits.shape)}"
        )
    tokens = [0] * len(samplers)
    # On the device: greedy rows with nothing to do on the host (no penalty, no logprobs:
    # the requests that may also draft).
    plain = [s.params.greedy and s.params.drafts_allowed for s in samplers]
    greedy = [b for b, s in enumerate(samplers) if plain[b]]
    on_host = [b for b, s in enumerate(samplers) if not plain[b]]
    if greedy:
        rows = _rows(logits, greedy)
        picked = (mx.argmax(rows, axis=-1) if argmax is None else argmax(rows)).tolist()
        for b, token in zip(greedy, picked, strict=True):
            tokens[b] = token
    if on_host:
        for b, row in zip(on_host, np.array(_rows(logits, on_host)), strict=True):
            tokens[b] = _sample_on_host(row, samplers[b], logprobs_mode)
    return tokens


def _sample_on_host(raw: np.ndarray, s: RequestSampler, logprobs_mode: str) -> int:
    """A row's token: the grammar's mask, then the bias and penalties, then the argmax or
    the filtered draw; the token's record (with logprobs) and the matcher advanced."""
    masked = row = raw if s.constraint is None else constrained(raw, s.constraint)
    if s.params.penalized:
        row = penalize(row, s.params, s.history)
    wants_record = s.params.logprobs is not None
    if s.params.greedy:  # np.argmax: the lowest token id on ties, as the device's argmax
        token = int(np.argmax(row))
    else:
        row = _scaled(row, s.params.temperature)
        kept = _filtered(row, s.params)
        token = _draw(row, kept, s.rng)
        if wants_record and logprobs_mode == "processed_logprobs":
            row = _kept_only(row, kept)
    if wants_record:
        drawn_from = masked if logprobs_mode == "raw_logprobs" else row
        s.logprobs.append(token_logprob(drawn_from, token, s.params.logprobs))
    if s.constraint is not None:
        s.constraint.consume(token)
    return token
# ANCHOR_END: sample_next_tokens


def filter_logits(
    logits_row: np.ndarray | mx.array, params: SamplingParams
) -> tuple[np.ndarray, np.ndarray]:
    """The distribution ``sample_next_tokens`` draws a row from.

    Returns (kept token ids ascending, their probabilities). Greedy params give the argmax with
    probability 1.
    """
    if isinstance(logits_row, mx.array):
        logits_row = np.array(logits_row.astype(mx.float32))
    row = np.asarray(logits_row, dtype=np.float32)
    if row.ndim != 1:
        raise ValueError(f"logits_row must be 1-D, got shape {row.shape}")
    if params.greedy:
        return np.array([int(np.argmax(row))]), np.ones(1)
    x = _scaled(row, params.temperature)
    ids = _filtered(x, params)
    weights = _weights(x, ids).astype(np.float64)
    return ids, weights / weights.sum()
