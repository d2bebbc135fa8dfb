"""The model runner: a step's chunks in, logits and sampled tokens out.

The runner alone runs a model. For one step it lays the chunks out once (``StepBatch``:
the flat batch and the storage's typed layout), begins the attention backend's step, runs
the forward — on a CPU with a ``KernelPlan`` handed to the model, which sends the decode
rows to the extension's kernels and runs a decode-only step's dense layers as fused ops —
and evaluates the logits together with the step's K/V writes. ``sample`` then picks each
sampling request's tokens, and ``score_prompts`` reads the prompt rows some requests asked
logprobs of. The engine serves its model through one runner and speculative
decoding's draft model through another: the forward is written once.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tiny_llm.distributed.workers import Workers
from tiny_llm.kernels.cpu_kernels import KernelPlan, kernels_available, rows_argmax
from tiny_llm.models.model import Model
from tiny_llm.sampling.sampler import TokenLogprob, sample_next_tokens
from tiny_llm.step.batch import (
    AttentionBackend,
    DenseLayout,
    Drafts,
    Emitted,
    PagedLayout,
    ScheduledChunk,
    StepBatch,
)
from tiny_llm.step.request import Request

import mlx.core as mx
import numpy as np


# ANCHOR: kernel_settings
@dataclass(frozen=True)
class KernelSettings:
    """Which of the extension's CPU kernels a runner's forward takes
    (``kernels/cpu_kernels.py``)."""

    cpu_kernels: bool = True  # matmuls, norms, RoPE, SwiGLU; False: MLX's ops
    int8_activations: bool = False  # quantized layers' decode rows in int8
    fused_layers: bool = True  # a decode-only step's dense layers as fused ops
# ANCHOR_END: kernel_settings


@dataclass(frozen=True)
class RunnerOutput:
    """What a step's forward and sampling produced, for the commit to record: what each
    sampling request emits (in ``StepBatch.sampling``'s order: one token, or the drafts it
    accepted and the token after them), and the records of requests scoring their prompt."""

    emitted: list[Emitted]
    prompt_scores: list[tuple[Request, list[TokenLogprob]]]


# ANCHOR: model_runner
class ModelRunner:
    """One model over one KV storage and attention backend."""

    def __init__(self, model: Model, kv: Any, attention: AttentionBackend,
                 kernels: KernelSettings = KernelSettings(), scores_prompts: bool = True,
                 logprobs_mode: str = "raw_logprobs"):
        self.model, self.kv, self.attention, self.kernels = model, kv, attention, kernels
        self.scores_prompts = scores_prompts  # False: a draft model's (it samples only)
        self.logprobs_mode = logprobs_mode  # what a token's logprob record reads

    def execute(self, chunks: list[ScheduledChunk],
                verify: Callable[[Request, Drafts, mx.array], Emitted] | None = None
                ) -> tuple[StepBatch, RunnerOutput]:
        """One step's forward and sampling. Changes nothing a failed step must undo but the
        samplers', which ``sample`` restores itself."""
        batch, logits = self.run(chunks)
        scores = self.score_prompts(logits, batch)  # changes nothing: before sampling
        return batch, RunnerOutput(self.sample(logits, batch, verify), scores)

    def run(self, chunks: list[ScheduledChunk],
            layout: PagedLayout | DenseLayout | None = None) -> tuple[StepBatch, mx.array]:
        """One forward over ``chunks``: the step's batch and the logits of its logit rows.
        ``layout``: the storage's layout, if not of these chunks' requests (the draft's)."""
        batch = StepBatch.build(chunks, self.kv.layout(chunks) if layout is None else layout,
                                self.scores_prompts)
        return batch, self.forward(batch)

    def forward(self, batch: StepBatch, head: bool = True) -> mx.array:
        """The model over ``batch``, evaluated with the step's K/V writes: the logits of
        its logit rows, or with ``head=False`` the last layer's rows (a tensor-parallel
        worker's share of the step: rank 0 alone computes logits)."""
        self.attention.begin_step(batch)
        plan = self.kernel_plan(batch)
        h = self.model.hidden_states(batch.token_ids, batch.positions, self.attention, plan)
        out = self.model.logits(h, batch.logit_rows, plan) if head else h
        # h as well: every layer runs even where no logit reads it (a step of prefill chunks
        # only), so that tensor-parallel ranks all take part in every layer's all-reduces.
        mx.eval(out, h, self.attention.state())
        return out

    def sample(self, logits: mx.array, batch: StepBatch,
               verify: Callable[[Request, Drafts, mx.array], Emitted] | None = None
               ) -> list[Emitted]:
        """What each sampling request emits: one token, or, for a request with drafts,
        what ``verify`` makes of its ``k + 1`` rows. On failure, every generator, logprob
        record and grammar matcher is as it was."""
        requests = batch.sampling
        if not requests:
            return []
        if batch.scored:  # the prompt rows after the sampling rows are not sampled
            logits = logits[: sum(batch.num_logits)]
        checkpoints = [(r.sampler, r.sampler.checkpoint()) for r in requests]
        try:
            if max(batch.num_logits) == 1:  # one row each: the sampler takes them together
                drawn = sample_next_tokens(logits, [r.sampler for r in requests],
                                           self.logprobs_mode, self.argmax())
                return [Emitted([token]) for token in drawn]
            return self.sample_with_drafts(logits, batch, verify)
        except BaseException:
            for sampler, checkpoint in checkpoints:
                sampler.restore(checkpoint)
            raise

    def score_prompts(self, logits: mx.array, batch: StepBatch
                      ) -> list[tuple[Request, list[TokenLogprob]]]:
        """Each scored request's records for the prompt tokens after this step's rows: the
        next token's log-probability under the model's logits, with the ``k`` best (ties by
        id among them; a tie at the k-th place keeps any of its tokens). Reduced on the
        device: ``k + 1`` numbers a row come back."""
        if not batch.scored:
            return []
        rows = logits[sum(batch.num_logits):].astype(mx.float32)
        targets = mx.array([r.prompt_token_ids[q + 1] for r, positions in batch.scored
                            for q in positions], dtype=mx.int32)
        log_norm = mx.logsumexp(rows, axis=-1, keepdims=True)
        picked = mx.take_along_axis(rows, targets[:, None], axis=-1) - log_norm
        k = max(r.params.prompt_logprobs for r, _ in batch.scored)
        best = mx.argpartition(-rows, k - 1, axis=-1)[:, :k] if k else \
            mx.zeros((rows.shape[0], 0), dtype=mx.int32)
        best_lp = mx.take_along_axis(rows, best, axis=-1) - log_norm
        mx.eval(picked, best, best_lp)
        picked, best, best_lp = np.array(picked[:, 0]), np.array(best), np.array(best_lp)
        tokens = np.array(targets).tolist()
        scores, at = [], 0
        for request, positions in batch.scored:
            want = request.params.prompt_logprobs
            records = []
            for row in range(at, at + len(positions)):
                ranked = sorted(zip(best_lp[row].tolist(), best[row].tolist(), strict=True),
                                key=lambda pair: (-pair[0], pair[1]))[:want]  # ties: by id
                records.append(TokenLogprob(tokens[row], float(picked[row]),
                                            tuple((int(t), lp) for lp, t in ranked)))
            scores.append((request, records))
            at += len(positions)
        return scores
# ANCHOR_END: model_runner

    # ANCHOR: runner_kernel_plan
    def kernel_plan(self, batch: StepBatch) -> KernelPlan | None:
        """How this step's forward takes the extension's CPU kernels (None: MLX's ops
        alone). A decode-only step whose attention backend offers its pool to the fused
        decoder layers (the extension's kernels: they attend as the backend would) also runs
        its dense layers fused."""
        k = self.kernels
        if not (k.cpu_kernels and kernels_available()):  # the device may change: asked per step
            return None
        fused = self.attention.fused_decode() if k.fused_layers and batch.decode_only else None
        return KernelPlan(batch.decode_rows, k.int8_activations, fused)
    # ANCHOR_END: runner_kernel_plan

    def argmax(self) -> Callable[[mx.array], mx.array] | None:
        """The greedy rows' argmax where the CPU kernels serve (None: MLX's)."""
        return rows_argmax if self.kernels.cpu_kernels and kernels_available() else None

    # ANCHOR: sample_with_drafts
    def sample_with_drafts(self, logits: mx.array, batch: StepBatch,
                           verify: Callable[[Request, Drafts, mx.array], Emitted] | None
                           ) -> list[Emitted]:
        """A step where some requests verify drafts: the one-row requests sample together,
        then each drafting request's ``k + 1`` rows go to ``verify``, in batch order."""
        requests = batch.sampling
        rows = np.cumsum([0, *batch.num_logits])
        plain = [i for i, n in enumerate(batch.num_logits) if n == 1]
        emitted: list[Emitted] = [Emitted([]) for _ in requests]
        if plain:
            picked = logits[mx.array([int(rows[i]) for i in plain])]
            drawn = sample_next_tokens(picked, [requests[i].sampler for i in plain],
                                       self.logprobs_mode, self.argmax())
            for i, token in zip(plain, drawn, strict=True):
                emitted[i] = Emitted([token])
        for i, n in enumerate(batch.num_logits):
            if n > 1:
                emitted[i] = verify(requests[i], batch.drafts[i], logits[rows[i] : rows[i] + n])
        return emitted
    # ANCHOR_END: sample_with_drafts


# ANCHOR: sharded_runner
class ShardedModelRunner(ModelRunner):
    """Rank 0's runner of a tensor-parallel model (``tensor_parallel.py``): each step goes
    to the workers, then every rank runs it on its shard."""

    def __init__(self, model: Model, kv: Any, attention: AttentionBackend,
                 kernels: KernelSettings, workers: Workers, logprobs_mode: str):
        super().__init__(model, kv, attention, kernels, logprobs_mode=logprobs_mode)
        self.workers = workers

    def forward(self, batch: StepBatch, head: bool = True) -> mx.array:
        # Once the step is sent the workers run it: so must rank 0, whole, or the ranks'
        # collectives would pair up with the wrong step's. Ctrl-C waits for its end.
        with interrupts_held(), self.workers.step(batch):
            return super().forward(batch, head)
# ANCHOR_END: sharded_runner


@contextmanager
def interrupts_held():
    """Hold Ctrl-C (SIGINT) until the block is done, then deliver it (main thread only:
    signal handlers can only be set there, and only it receives KeyboardInterrupt)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received and previous != signal.SIG_IGN:
            if callable(previous):
                previous(signal.SIGINT, None)
            else:  # SIG_DFL, or a handler installed from C
                raise KeyboardInterrupt
