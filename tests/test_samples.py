"""Several samples of one prompt (``SamplingParams(n=...)``) over shared pages.

The first sample computes the prompt; the others wait for it, then take its full pages from
the prefix cache and compute only the last, partial page. Oracles: each sample is the
request served alone with the seed ``seed + index``; the engine's counters say how many
prompt tokens were computed and served from the cache; the block manager's invariants after
every step (each page referenced exactly as often as tables hold it), the pages in use while
the samples run, and every page free at the end.
"""

from __future__ import annotations

from tiny_llm.engine import LLMEngine
from tiny_llm.sampling.params import SamplingParams
from tiny_llm.testing.runs import served_alone

import pytest

PROMPT = list(range(100, 150))  # 50 tokens: three full pages of 16 and two tokens


def engine_of(tiny_model, smollm_tokenizer, **options):
    return LLMEngine(tiny_model, smollm_tokenizer, num_pages=128, page_size=16, **options)


def pages_in_use(engine: LLMEngine) -> list[int]:
    """From now on, after every step: check the block manager's invariants and append the
    pages in use to the list returned."""
    used, step = [], engine.core.step

    def checked() -> None:
        step()
        engine.kv.blocks.check_invariants()
        used.append(engine.stats()["num_pages"] - engine.stats()["num_free_pages"])

    engine.core.step = checked
    return used


@pytest.mark.parametrize("budget", [512, 32])  # 32: the prompt is computed over two steps
def test_samples_share_the_prompts_pages_and_draw_from_their_own_seeds(tiny_model,
                                                                       smollm_tokenizer,
                                                                       budget):
    engine = engine_of(tiny_model, smollm_tokenizer, max_num_batched_tokens=budget)
    pages_in_use(engine)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6)
    out, plain = engine.generate([{"prompt_token_ids": PROMPT}, "Hello"], [params, None],
                                 use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and len(plain.outputs) == 1
    for i, completion in enumerate(out.outputs):
        alone = served_alone(tiny_model, smollm_tokenizer, PROMPT, params.for_sample(i))[0]
        assert completion.token_ids == alone
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4  # four seeds, four samples
    stats = engine.stats()
    hello = len(engine.tokenize("Hello"))
    assert stats["num_prompt_tokens_computed"] == len(PROMPT) + 3 * 2 + hello
    assert stats["prefix_cache_hit_tokens"] == 3 * 48
    assert stats["num_free_pages"] == stats["num_pages"]


def test_each_sample_holds_its_own_reference_to_the_shared_pages(tiny_model, smollm_tokenizer):
    """The first sample's four pages, then the three full ones shared by all four samples
    plus a page of each one's own; when the first finishes (a step ahead of the others) its
    own page goes and the shared ones stay for the other three; then nothing."""
    engine = engine_of(tiny_model, smollm_tokenizer)
    used = pages_in_use(engine)
    params = SamplingParams(n=4, temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_samples({"prompt_token_ids": PROMPT}, params)
    shared = []
    while engine.has_unfinished_requests():
        engine.step()
        shared.append([engine.kv.blocks.blocks[p].ref_count for p in range(3)])
    assert used == [4, 7, 7, 7, 7, 6, 0]
    assert shared == [[1, 1, 1]] + [[4, 4, 4]] * 4 + [[3, 3, 3], [0, 0, 0]]


def test_the_prompt_is_scored_once_and_its_pages_still_shared(tiny_model, smollm_tokenizer):
    """With prompt_logprobs, the first sample scores the prompt; the others take its pages
    from the prefix cache as before (a request that scores its prompt could not)."""
    engine = engine_of(tiny_model, smollm_tokenizer)
    pages_in_use(engine)
    out = engine.generate([{"prompt_token_ids": PROMPT}],
                          SamplingParams(n=3, seed=1, max_tokens=4, prompt_logprobs=1),
                          use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == len(PROMPT)
    stats = engine.stats()
    assert stats["num_prompt_tokens_computed"] == len(PROMPT) + 2 * 2
    assert stats["prefix_cache_hit_tokens"] == 2 * 48


def test_without_prefix_caching_every_sample_computes_the_prompt(tiny_model, smollm_tokenizer):
    engine = engine_of(tiny_model, smollm_tokenizer, enable_prefix_caching=False)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=5)  # their prompts in one step
    out = engine.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    for i, completion in enumerate(out.outputs):
        assert completion.token_ids == served_alone(tiny_model, smollm_tokenizer, PROMPT,
                                                    params.for_sample(i))[0]
    assert engine.stats()["num_prompt_tokens_computed"] == 3 * len(PROMPT)


def test_aborting_some_samples_leaves_no_page_behind(tiny_model, smollm_tokenizer):
    """Abort a waiting sample before the first has computed the prompt and a running one
    mid-decode; the rest finish with their tokens, and every page is free afterwards."""
    engine = engine_of(tiny_model, smollm_tokenizer, max_num_batched_tokens=32)
    pages_in_use(engine)
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    ids = engine.add_samples({"prompt_token_ids": PROMPT}, params, "job")
    assert ids == [f"job-{i}" for i in range(4)]
    engine.abort("job-3")  # still waiting for the first sample's prompt
    finished: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 5:
            engine.abort("job-2")
    assert set(finished) == set(ids)
    for i in (0, 1):
        assert finished[f"job-{i}"] == served_alone(tiny_model, smollm_tokenizer, PROMPT,
                                                    params.for_sample(i))[0]
    assert finished["job-3"] == [] and len(finished["job-2"]) < 12
    stats = engine.stats()
    assert stats["num_free_pages"] == stats["num_pages"] and not engine.core.held_samples


def test_several_samples_are_refused_where_one_stream_is_expected(tiny_model,
                                                                  smollm_tokenizer):
    engine = engine_of(tiny_model, smollm_tokenizer)
    with pytest.raises(ValueError, match="one sample"):
        engine.add_request("hi", SamplingParams(n=2))
    with pytest.raises(ValueError, match="one sample"):
        engine.stream("hi", SamplingParams(n=2))
    for n in (0, 129, 1.5):
        with pytest.raises(ValueError, match="n must be"):
            SamplingParams(n=n)
