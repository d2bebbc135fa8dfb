"""Day 2: chunked prefill.

Two properties: chunking is exact (logits after a chunked prefill equal the one-shot
prefill), and the token budget protects decodes (no step exceeds it, and running requests
advance every step while a long prompt is prefilled).
"""

import random

from tiny_llm.day1_batching import StepBudget
from tiny_llm.day2_chunked_prefill import TokenBudget
from tiny_llm.engine import LLMEngine
from tiny_llm.kv_cache import DenseKVCache
from tiny_llm.sampling import SamplingParams
from tiny_llm.testing.runs import RecordingModel

import mlx.core as mx
import pytest


def one_shot_last_logits(model, prompt):
    logits = model(mx.array(prompt), mx.arange(len(prompt)), DenseKVCache(2))
    return logits[-1]


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunked_prefill_logits_equal_one_shot(tiny_model, smollm_tokenizer, chunk):
    rng = random.Random(chunk)
    for length in sorted({1, max(1, chunk - 1), chunk, chunk + 1, 3 * chunk + 2}):
        prompt = [rng.randrange(100, 40000) for _ in range(length)]
        recorder = RecordingModel(tiny_model)
        engine = LLMEngine(recorder, smollm_tokenizer, max_num_seqs=1, max_num_batched_tokens=chunk)
        engine.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))
        steps = engine.stats()["num_steps"]
        assert steps == -(-length // chunk), "the prompt was not split into budget-sized chunks"
        got = recorder.logits[-1][0]
        expected = one_shot_last_logits(tiny_model, prompt)
        # Only float32 rounding may differ: a chunk's GEMMs have other row counts (OpenBLAS
        # changes kernels at 16 rows) and attention folds keys in another order.
        assert mx.abs(got - expected).max().item() <= 4e-5


def test_token_budget_grants_decodes_first_and_never_exceeds():
    budget = TokenBudget(10)
    assert [budget.take_decode() for _ in range(3)] == [True] * 3
    assert budget.take_prefill(4) == 4
    assert budget.take_prefill(100) == 3 and budget.left == 0
    assert budget.take_decode() is False and budget.take_prefill(5) == 0
    whole = StepBudget(10)  # Day 1: a prompt whole or not at all
    assert whole.take_prefill(11) == 0 and whole.take_prefill(10) == 10


def test_long_prompt_does_not_starve_decodes(tiny_model, smollm_tokenizer):
    budget = 32
    engine = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=4, max_num_batched_tokens=budget)
    sizes = []
    schedule = engine.scheduler.schedule

    def checked_schedule():
        chunks = schedule()
        sizes.append(sum(c.num_tokens for c in chunks))
        return chunks

    engine.scheduler.schedule = checked_schedule
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short = [engine.add_request({"prompt_token_ids": [200 + i, 300 + i]}, params) for i in range(3)]
    engine.step()  # the three short prompts are prefilled together
    long_prompt = [random.Random(0).randrange(100, 40000) for _ in range(300)]
    long_id = engine.add_request({"prompt_token_ids": long_prompt}, params)
    long_req = engine.requests[long_id]
    prefill_steps = 0
    while long_req.num_computed_tokens < len(long_prompt):
        advanced = {o.request_id for o in engine.step()}
        prefill_steps += 1
        assert set(short) <= advanced, "a running request missed a step during the prefill"
    # Each step the three decodes came first; the long prompt got the other 29 tokens.
    assert prefill_steps == -(-300 // (budget - 3))
    while engine.has_unfinished_requests():
        engine.step()
    assert max(sizes) <= budget
    assert sizes[1] == budget  # a full step: 3 decode tokens + a 29-token prefill chunk


def test_chunked_and_unchunked_engines_generate_the_same_tokens(tiny_model, smollm_tokenizer):
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(1, 90))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = []
    for options in ({"max_num_batched_tokens": 16}, {"enable_chunked_prefill": False,
                                                      "max_num_batched_tokens": 128}):
        engine = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=4, max_model_len=128,
                           **options)
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params)
        results.append([o.outputs[0].token_ids for o in outs])
    assert results[0] == results[1]


def test_unchunked_engine_rejects_prompts_over_the_budget(tiny_model, smollm_tokenizer):
    engine = LLMEngine(tiny_model, smollm_tokenizer, kv_cache="dense",
                       enable_chunked_prefill=False, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="chunked prefill is off"):
        engine.add_request({"prompt_token_ids": list(range(100, 140))})
    # Paged, a preempted request recomputes prompt + output in one piece: it must fit.
    with pytest.raises(ValueError, match="at least max_model_len"):
        LLMEngine(tiny_model, smollm_tokenizer, enable_chunked_prefill=False,
                  max_num_batched_tokens=32, max_model_len=64)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=8, max_num_batched_tokens=4)
