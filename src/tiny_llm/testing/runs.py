"""Runs of the engine and of the single-request loop that tests and benchmarks compare."""

from __future__ import annotations

import random
from typing import Any

from tiny_llm.engine.generate import stream_generate
from tiny_llm.sampling.params import SamplingParams

import mlx.core as mx


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    """Greedy, exactly ``max_tokens`` new tokens (EOS ignored)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def served_alone(model, tokenizer, prompt_ids: list[int],
                 params: SamplingParams) -> tuple[list[int], str]:
    """The batching oracle: the request served alone, over a dense cache, no engine."""
    outs = list(stream_generate(model, tokenizer, prompt_ids, params))
    return outs[-1].outputs[0].token_ids, outs[-1].outputs[0].text


def random_prompts(n: int, seed: int, lo: int = 2, hi: int = 60, shared_prefix: int = 0,
                   rng: random.Random | None = None) -> list[list[int]]:
    """``n`` random token prompts of ``lo`` .. ``hi`` tokens after a shared prefix."""
    rng = random.Random(seed) if rng is None else rng
    prefix = [rng.randrange(100, 40000) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


def workload(n: int, seed: int, shared_prefix: int = 0, max_tokens: tuple[int, int] = (2, 16),
             lo: int = 1, hi: int = 40) -> tuple[list[dict], list[SamplingParams]]:
    """Random greedy requests as (prompts, params) for ``engine.generate``."""
    rng = random.Random(seed)
    prompts = random_prompts(n, seed, lo, hi, shared_prefix, rng)
    params = [greedy(rng.randint(*max_tokens)) for _ in range(n)]
    return [{"prompt_token_ids": p} for p in prompts], params


def tokens_of(engine, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]


def run_staggered(engine, jobs: list[tuple[int, Any, SamplingParams]],
                  max_steps: int = 5000) -> list[list[int]]:
    """Add job i = (arrival step, prompt, params) at its step, drive ``engine.step()`` to the
    end; the generated tokens of each job."""
    order = sorted(range(len(jobs)), key=lambda i: jobs[i][0])
    ids, tokens, step = {}, {}, 0
    while order or engine.has_unfinished_requests():
        while order and jobs[order[0]][0] <= step:
            i = order.pop(0)
            ids[engine.add_request(jobs[i][1], jobs[i][2])] = i
        for out in engine.step():
            if out.finished:
                tokens[ids[out.request_id]] = out.outputs[0].token_ids
        step += 1
        if step > max_steps:
            raise AssertionError("no progress")
    return [tokens[i] for i in range(len(jobs))]


class RecordingModel:
    """Wraps a model to keep the logits of every forward an engine runs."""

    def __init__(self, model):
        self.model, self.config, self.dtype = model, model.config, model.dtype
        self.tensor_parallel = model.tensor_parallel
        self.recorded: list[mx.array] = []

    def hidden_states(self, *args):
        return self.model.hidden_states(*args)

    def logits(self, *args):  # the runner calls both: the last layer's rows, then the head
        out = self.model.logits(*args)
        self.recorded.append(out)
        return out
