"""Day 2: chunked prefill.

Two properties: chunking is exact (logits after a chunked prefill equal the one-shot
prefill), and the token budget protects decodes (no step exceeds it, and running requests
advance every step while a long prompt is prefilled).
"""

import random

from tiny_llm.day1_batching import StepBudget
from tiny_llm.day2_chunked_prefill import TokenBudget
from tiny_llm.engine import LLMEngine
from tiny_llm.sampling.params import SamplingParams
from tiny_llm.step.dense_kv import DenseKVCache
from tiny_llm.testing.runs import RecordingModel

import mlx.core as mx
import pytest

DAY2 = dict(kv_cache="dense")  # Day 2's configuration: dense caches, chunked prefill


def one_shot_last_logits(model, prompt):
    logits = model(mx.array(prompt), mx.arange(len(prompt)), DenseKVCache(2))
    return logits[-1]


@pytest.mark.task("2.3")
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunked_prefill_logits_equal_one_shot(tiny_model, smollm_tokenizer, chunk):
    rng = random.Random(chunk)
    for length in sorted({1, max(1, chunk - 1), chunk, chunk + 1, 3 * chunk + 2}):
        prompt = [rng.randrange(100, 40000) for _ in range(length)]
        recorder = RecordingModel(tiny_model)
        engine = LLMEngine(recorder, smollm_tokenizer, max_num_seqs=1,
                           max_num_batched_tokens=chunk, **DAY2)
        engine.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))
        steps = engine.stats()["num_steps"]
        assert steps == -(-length // chunk), "the prompt was not split into budget-sized chunks"
        got = recorder.recorded[-1][0]
        expected = one_shot_last_logits(tiny_model, prompt)
        # Only float32 rounding may differ: a chunk's GEMMs have other row counts (OpenBLAS
        # changes kernels at 16 rows) and attention folds keys in another order.
        assert mx.abs(got - expected).max().item() <= 4e-5


@pytest.mark.task("2.1")
def test_token_budget_grants_decodes_first_and_never_exceeds():
    budget = TokenBudget(10)
    assert [budget.take_decode() for _ in range(3)] == [True] * 3
    assert budget.take_prefill(4) == 4
    assert budget.take_prefill(100) == 3 and budget.left == 0
    assert budget.take_decode() is False and budget.take_prefill(5) == 0
    whole = StepBudget(10)  # Day 1: a prompt whole or not at all
    assert whole.take_prefill(11) == 0 and whole.take_prefill(10) == 10


@pytest.mark.task("2.3")
def test_long_prompt_does_not_starve_decodes(tiny_model, smollm_tokenizer):
    budget = 32
    engine = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=4, max_num_batched_tokens=budget,
                       **DAY2)
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


@pytest.mark.task("2.3")
def test_chunked_and_unchunked_engines_generate_the_same_tokens(tiny_model, smollm_tokenizer):
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(1, 90))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = []
    for options in ({"max_num_batched_tokens": 16}, {"enable_chunked_prefill": False,
                                                      "max_num_batched_tokens": 128}):
        engine = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=4, max_model_len=128,
                           **options, **DAY2)
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


@pytest.mark.task("2.2")
def test_decodes_go_first_then_prefills_oldest_first():
    from tiny_llm.day1_batching import SimRequest
    from tiny_llm.day2_chunked_prefill import ChunkedPrefillScheduler

    scheduler = ChunkedPrefillScheduler(4, 64)
    prefill_old, decode_a, prefill_new, decode_b = (SimRequest(i, 8, 1) for i in range(4))
    for r in (decode_a, decode_b):
        r.num_computed_tokens = 7  # one token left: a decode
    prefill_new.num_computed_tokens = 3  # a partial prefill
    scheduler.running = [prefill_old, decode_a, prefill_new, decode_b]
    assert scheduler.running_order() == [decode_a, decode_b, prefill_old, prefill_new]


@pytest.mark.task("2.3")
def test_the_threshold_caps_each_prompts_chunk():
    budget = TokenBudget(100, max_chunk=30)
    assert [budget.take_prefill(n) for n in (50, 10, 80)] == [30, 10, 30]
    assert budget.left == 30 and TokenBudget(10, max_chunk=30).take_prefill(50) == 10


@pytest.mark.task("2.3")
def test_a_short_prompt_behind_a_long_one_is_not_blocked(tiny_model, smollm_tokenizer):
    """FCFS gives the step's budget to the older, long prompt; with a threshold the short
    prompt that arrived with it gets its share at once, and both still equal the engine
    without a threshold token for token."""
    rng = random.Random(7)
    long_prompt = [rng.randrange(100, 40000) for _ in range(200)]
    short_prompt = [rng.randrange(100, 40000) for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first_token_step, tokens = {}, {}
    for threshold in (None, 16):
        engine = LLMEngine(tiny_model, smollm_tokenizer, max_num_batched_tokens=32,
                           long_prefill_token_threshold=threshold, **DAY2)
        ids = [engine.add_request({"prompt_token_ids": p}, params)
               for p in (long_prompt, short_prompt)]
        step = 0
        while engine.has_unfinished_requests():
            step += 1
            for out in engine.step():
                if out.new_token_ids and out.request_id == ids[1]:
                    first_token_step.setdefault(threshold, step)
                if out.finished:
                    tokens[threshold, out.request_id] = out.outputs[0].token_ids
    assert first_token_step[None] == -(-(200 + 8) // 32)  # behind the whole long prefill
    assert first_token_step[16] == 1  # 16 for the long prompt, 8 for the short one
    assert all(tokens[16, i] == tokens[None, i] for i in ids)
