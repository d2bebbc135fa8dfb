"""Day 1: continuous batching.

The oracle is "a request served alone": ``stream_generate`` runs one request over a dense
cache with no engine at all. Every request served inside a changing batch must produce
exactly the same greedy tokens (float32).

Engines here run Day 1's configuration (``DAY1``: dense per-request caches, prompts
prefilled whole), so the file tests Day 1's code alone, whatever later days hold. Tests
name the course tasks they check (``@pytest.mark.task``); a task's tests pass once it and
the tasks before it are done.
"""

import copy
import random

from tiny_llm.day1_batching import (
    BatchingSimulator,
    DenseKVStorage,
    Scheduler,
    SimRequest,
    StepBudget,
    continuous_batching_steps,
    simulate_batching,
    static_batching_steps,
)
from tiny_llm.engine import LLMEngine
from tiny_llm.sampling.params import SamplingParams
from tiny_llm.step.batch import DenseLayout
from tiny_llm.step.request import RequestStatus
from tiny_llm.testing.runs import greedy, random_prompts, served_alone

import mlx.core as mx
import pytest

DAY1 = dict(kv_cache="dense", enable_chunked_prefill=False)


def alone(model, tokenizer, prompt_ids, params) -> tuple[list[int], str]:
    return served_alone(model, tokenizer, prompt_ids, params)


def run_staggered(engine: LLMEngine, prompts, params, arrivals) -> dict[str, list[int]]:
    """Add request i at step arrivals[i]; run to completion; return tokens per request."""
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    ids: dict[int, str] = {}
    tokens: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            ids[i] = engine.add_request({"prompt_token_ids": prompts[i]}, params[i])
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        step += 1
    return {i: tokens[rid] for i, rid in ids.items()}


@pytest.mark.task("1.6")
@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_batch_invariance_against_request_served_alone(tiny_model, smollm_tokenizer, policy):
    prompts = random_prompts(13, seed=1)
    rng = random.Random(2)
    params = [greedy(rng.randint(3, 14)) for _ in prompts]
    arrivals = [rng.randint(0, 12) for _ in prompts]
    engine = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=4, scheduler=policy, **DAY1)
    got = run_staggered(engine, prompts, params, arrivals)
    for i, prompt in enumerate(prompts):
        expected, _ = alone(tiny_model, smollm_tokenizer, prompt, params[i])
        assert got[i] == expected, f"request {i} (prompt {len(prompt)} tokens) diverged"
    assert engine.stats()["num_steps"] > 0


@pytest.mark.task("1.6")
def test_more_requests_than_slots_all_complete_and_slots_are_reused(
    tiny_model, smollm_tokenizer
):
    engine = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=3, **DAY1)
    ids = [engine.add_request({"prompt_token_ids": p}, greedy(4)) for p in random_prompts(10, 3)]
    finished, slots_used, max_live = set(), set(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
        max_live = max(max_live, len(engine.scheduler.running))
        slots_used |= set(engine.kv.slot_of.values())
    assert finished == set(ids)
    assert max_live == 3
    assert slots_used == {0, 1, 2}  # ten requests went through the same three slots
    assert sorted(engine.kv.free_slots) == [0, 1, 2]


class FailsAfterStoring:
    """The engine's attention, failing once, in its ``at``-th layer call, after that layer's
    K/V is stored: the engine retries the step, which must store the same positions again."""

    def __init__(self, inner, at: int):
        self.inner, self.at, self.calls = inner, at, 0
        self.name, self.storage = inner.name, inner.storage

    def begin_step(self, step):
        self.inner.begin_step(step)

    def attend(self, *args):
        out = self.inner.attend(*args)
        self.calls += 1
        if self.calls == self.at:
            mx.eval(out, self.inner.state())  # this layer's rows are in the cache now
            raise RuntimeError("injected after the layer's K/V was stored")
        return out

    def state(self):
        return self.inner.state()

    def fused_decode(self):
        return None  # every layer through attend: the failure must come from there


@pytest.mark.task("1.6")
@pytest.mark.parametrize("at", [1, 6])  # a prefill's first layer; a decode's first layer
def test_a_retried_step_stores_its_chunks_at_their_own_positions(tiny_model, smollm_tokenizer,
                                                                  at):
    """A chunk's K/V goes at ``chunk.start ..`` of its cache, not after whatever the cache
    holds: a step that failed after its first layer stored its rows is run again, and must
    overwrite those rows, not append after them."""
    prompts = random_prompts(3, seed=11)
    engine = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=3, **DAY1)
    ids = [engine.add_request({"prompt_token_ids": p}, greedy(5)) for p in prompts]
    engine.runner.attention = FailsAfterStoring(engine.runner.attention, at)
    tokens, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except RuntimeError:
            failures += 1
            continue
        tokens.update({o.request_id: o.outputs[0].token_ids for o in outputs if o.finished})
    assert failures == 1
    for rid, prompt in zip(ids, prompts, strict=True):
        assert tokens[rid] == alone(tiny_model, smollm_tokenizer, prompt, greedy(5))[0]


def test_stop_string_across_token_boundary_is_excluded(tiny_model, smollm_tokenizer):
    prompt = random_prompts(1, 4)[0]
    tokens, text = alone(tiny_model, smollm_tokenizer, prompt, greedy(24))
    pieces = [smollm_tokenizer.decode(tokens[:i]) for i in range(len(tokens) + 1)]
    # A stop string made of the last char of token k and the first char of token k+1.
    k = next(
        i for i in range(3, len(tokens) - 1)
        if len(pieces[i]) > len(pieces[i - 1]) and len(pieces[i + 1]) > len(pieces[i])
    )
    stop = pieces[k][-1] + pieces[k + 1][len(pieces[k])]
    engine = LLMEngine(tiny_model, smollm_tokenizer, **DAY1)
    other = engine.add_request({"prompt_token_ids": random_prompts(1, 5)[0]}, greedy(30))
    out = engine.generate({"prompt_token_ids": prompt}, greedy(24, stop=[stop]))[0]
    cut = text.find(stop)
    assert out.finish_reason == "stop"
    assert out.outputs[0].text == text[:cut]
    assert stop not in out.outputs[0].text
    assert engine.requests[other].output_token_ids  # the other request kept going


def test_streamed_text_concatenates_to_final_text(tiny_model, smollm_tokenizer):
    prompt = random_prompts(1, 6)[0]
    _, text = alone(tiny_model, smollm_tokenizer, prompt, greedy(20))
    stop = text[7:10]
    engine = LLMEngine(tiny_model, smollm_tokenizer, **DAY1)
    outs = list(engine.stream({"prompt_token_ids": prompt}, greedy(20, stop=[stop])))
    final = outs[-1].outputs[0].text
    assert "".join(o.text_delta for o in outs) == final == text[: text.find(stop)]


def test_stop_token_ids_eos_and_ignore_eos(tiny_model, smollm_tokenizer):
    prompt = random_prompts(1, 7)[0]
    tokens, _ = alone(tiny_model, smollm_tokenizer, prompt, greedy(12))
    target = tokens[5]
    first = tokens.index(target)
    engine = LLMEngine(tiny_model, smollm_tokenizer, **DAY1)
    out = engine.generate({"prompt_token_ids": prompt}, greedy(12, stop_token_ids=[target]))[0]
    assert out.finish_reason == "stop" and out.outputs[0].token_ids == tokens[: first + 1]

    tokenizer = copy.copy(smollm_tokenizer)
    tokenizer.eos_token_ids = {target}
    engine = LLMEngine(tiny_model, tokenizer, **DAY1)
    eos = SamplingParams(temperature=0.0, max_tokens=12)
    out = engine.generate({"prompt_token_ids": prompt}, eos)[0]
    assert out.finish_reason == "stop" and out.outputs[0].token_ids == tokens[: first + 1]
    out = engine.generate({"prompt_token_ids": prompt}, greedy(12))[0]  # ignore_eos=True
    assert out.finish_reason == "length" and out.outputs[0].token_ids == tokens


def test_max_tokens_and_max_model_len(tiny_model, smollm_tokenizer):
    prompt = random_prompts(1, 8, lo=10, hi=10)[0]
    engine = LLMEngine(tiny_model, smollm_tokenizer, max_model_len=16, **DAY1)
    by_tokens, by_len = engine.generate(
        [{"prompt_token_ids": prompt[:5]}, {"prompt_token_ids": prompt}], greedy(9)
    )
    assert by_tokens.finish_reason == "length" and len(by_tokens.outputs[0].token_ids) == 9
    assert by_len.finish_reason == "length"
    assert len(prompt) + len(by_len.outputs[0].token_ids) == 16


@pytest.mark.task("1.6")
def test_abort_mid_flight_frees_resources_and_spares_others(tiny_model, smollm_tokenizer):
    prompts = random_prompts(3, 9)
    engine = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=3, **DAY1)
    ids = [engine.add_request({"prompt_token_ids": p}, greedy(10)) for p in prompts]
    for _ in range(3):
        engine.step()
    engine.abort(ids[1])
    assert len(engine.kv.free_slots) == 1
    results = {}
    while engine.has_unfinished_requests() or not results:
        for out in engine.step():
            results[out.request_id] = out
    assert results[ids[1]].finish_reason == "abort"
    for i in (0, 2):
        assert results[ids[i]].outputs[0].token_ids == alone(
            tiny_model, smollm_tokenizer, prompts[i], greedy(10)
        )[0]
    with pytest.raises(ValueError, match="unknown request id"):
        engine.abort("no-such-request")
    with pytest.raises(ValueError, match="unknown request id"):
        engine.abort(ids[0])  # already finished


def test_bad_input_is_rejected_and_running_requests_are_untouched(tiny_model, smollm_tokenizer):
    prompt = random_prompts(1, 10)[0]
    engine = LLMEngine(tiny_model, smollm_tokenizer, max_model_len=64, **DAY1)
    good = engine.add_request({"prompt_token_ids": prompt}, greedy(8), request_id="good")
    engine.step()
    vocab = tiny_model.config.vocab_size
    cases = [
        (ValueError, "empty", lambda: engine.add_request("")),
        (ValueError, "empty", lambda: engine.add_request({"prompt_token_ids": []})),
        (ValueError, "max_model_len", lambda: engine.add_request({"prompt_token_ids": [5] * 64})),
        (ValueError, "vocabulary", lambda: engine.add_request({"prompt_token_ids": [1, vocab]})),
        (ValueError, "vocabulary", lambda: engine.add_request({"prompt_token_ids": [-1, 2]})),
        (ValueError, "already in use", lambda: engine.add_request("hi", request_id="good")),
        (TypeError, "SamplingParams", lambda: engine.add_request("hi", {"temperature": 0})),
        (TypeError, "prompt", lambda: engine.add_request(3.5)),
        (ValueError, "top_p", lambda: engine.add_request("hi", SamplingParams(top_p=1.5))),
        (ValueError, "max_tokens", lambda: SamplingParams(max_tokens=-1)),
        (ValueError, "temperature", lambda: SamplingParams(temperature=float("nan"))),
        (TypeError, "unknown engine option", lambda: LLMEngine(tiny_model, smollm_tokenizer, x=1)),
        (ValueError, "scheduler", lambda: LLMEngine(tiny_model, smollm_tokenizer, scheduler="x")),
        (ValueError, "at least max_num_seqs", lambda: LLMEngine(
            tiny_model, smollm_tokenizer, max_num_seqs=8, max_num_batched_tokens=4)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
    assert list(engine.requests) == ["good"]
    # A list with one bad prompt adds none of them.
    with pytest.raises(ValueError, match="empty"):
        engine.generate([{"prompt_token_ids": [5, 6]}, ""], greedy(2))
    assert list(engine.requests) == ["good"]
    with pytest.raises(TypeError, match="message 0 'content' must be a string, got NoneType"):
        engine.add_request([{"role": "user"}])  # a message without content
    with pytest.raises(ValueError, match="empty"):
        engine.stream("")  # raises at the call, before any iteration (the chat relies on it)
    results = {}
    while engine.has_unfinished_requests():
        results.update({o.request_id: o for o in engine.step()})
    expected, _ = alone(tiny_model, smollm_tokenizer, prompt, greedy(8))
    assert results[good].outputs[0].token_ids == expected


def test_the_default_slots_fit_the_token_budget():
    """32 slots by default, as many as the budget lets decode at once when it is smaller (so
    a small budget alone is a valid configuration); given both, a budget below the slots is
    refused above."""
    from tiny_llm.engine import EngineConfig

    assert EngineConfig().max_num_seqs == 32
    assert EngineConfig(max_num_batched_tokens=16).max_num_seqs == 16
    assert EngineConfig(max_num_seqs=4, max_num_batched_tokens=16).max_num_seqs == 4


def test_seeded_sampling_is_batch_invariant(tiny_model, smollm_tokenizer):
    prompt = random_prompts(1, 11)[0]
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    expected, _ = alone(tiny_model, smollm_tokenizer, prompt, seeded)
    engine = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=4, **DAY1)
    others = [
        SamplingParams(temperature=1.0, seed=7, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.5, top_k=20, max_tokens=15, ignore_eos=True),
        greedy(5),
    ]
    prompts = [prompt] + random_prompts(3, 12)
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], [seeded] + others)
    assert outs[0].outputs[0].token_ids == expected
    unseeded = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    out = engine.generate({"prompt_token_ids": prompt}, unseeded)[0]
    assert len(out.outputs[0].token_ids) == 12


@pytest.mark.task("1.7")
def test_continuous_beats_static_on_head_of_line_blocking(tiny_model, smollm_tokenizer):
    # One long request among short ones, four slots, all arriving at once.
    lens = [30, 3, 3, 3, 3, 3, 3, 3]
    static, continuous = static_batching_steps(lens, 4), continuous_batching_steps(lens, 4)
    # static: batch [30,3,3,3] takes 30 steps, batch [3,3,3,3] 3 more.
    assert static.steps == 33 and static.wasted_slot_steps == 33 * 4 - sum(lens)
    assert simulate_batching(lens, 4, "static") == static  # the scheduler agrees
    # continuous: the long request holds one slot for 30 steps; three slots serve the
    # seven short requests (3 rounds of 3 steps) meanwhile.
    assert continuous.steps == 30 and continuous.wasted_slot_steps == 30 * 4 - sum(lens)
    assert continuous.wasted_slot_steps < static.wasted_slot_steps
    assert simulate_batching(lens, 4, "continuous") == continuous

    for policy, stats in (("static", static), ("continuous", continuous)):
        engine = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=4, scheduler=policy,
                           **DAY1)
        engine.generate([{"prompt_token_ids": [100 + i]} for i in range(8)],
                        [greedy(n) for n in lens], use_tqdm=False)
        assert engine.stats()["num_steps"] == stats.steps


@pytest.mark.task("1.5")
def test_model_free_scheduler_admits_and_retires_in_flight():
    sim = BatchingSimulator(max_batch=2)
    a, b, c = sim.add_request(4, 2), sim.add_request(1, 5), sim.add_request(2, 1)
    first = sim.step()
    assert first.scheduled == [(a.request_id, 4), (b.request_id, 1)]  # c waits for a slot
    second = sim.step()
    assert a.request_id in second.finished  # a finished after 2 tokens ...
    third = sim.step()
    assert (c.request_id, 2) in third.scheduled  # ... and c took its slot at once
    assert all(r.num_running <= 2 for r in [first, second, third, *sim.run()])


@pytest.mark.task("1.5")
def test_a_chunk_starts_where_its_request_left_off():
    scheduler = Scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    a, b = SimRequest(0, 4, 3), SimRequest(1, 2, 3)
    scheduler.add(a)
    scheduler.add(b)
    first = scheduler.schedule()
    assert [(c.request, c.start, c.end) for c in first] == [(a, 0, 4), (b, 0, 2)]
    scheduler.finish_step(first)
    for req in (a, b):
        req.output_token_ids.append(7)  # the sampled token, still to be computed
    second = scheduler.schedule()
    assert [(c.request, c.start, c.end) for c in second] == [(a, 4, 5), (b, 2, 3)]


def test_text_flushed_at_finish_is_still_cut_at_a_stop_string():
    """Bytes held back mid-character come out only at the end; a stop string they
    complete must still be cut (and the reason becomes "stop")."""
    from tiny_llm.step.request import Request

    class HeldBack:  # a detokenizer that releases everything only when flushed
        def add(self, token: int) -> str:
            return ""

        def flush(self) -> str:
            return "ok STOP tail"

    req = Request([1, 2], SamplingParams(max_tokens=1, stop=["STOP"]), HeldBack(), set(), 64)
    released = req.append_token(7)
    assert released == "ok " and req.output_text == "ok " and req.finish_reason == "stop"
    aborted = Request([1, 2], SamplingParams(stop=["STOP"]), HeldBack(), set(), 64)
    aborted.append_token(7)
    assert aborted.finish("abort") == "ok " and aborted.finish_reason == "abort"


@pytest.mark.parametrize("pieces,stop,min_tokens,want", [
    (["a,", "b", ",c", "d"], [","], 2, "a,b"),  # the first comma is in the first two tokens
    (["a,", "b", ",c", "d"], [","], 0, "a"),
    (["ab", "c", "d", "be"], ["b", "xyz"], 2, "abcd"),  # a "b" held back, not yet searched
    (["ab", "c", "d", "e"], ["cd", "xyz"], 2, "ab"),  # begins in the first two, ends after
])
def test_min_tokens_holds_stop_strings_back_as_it_holds_end_tokens(pieces, stop, min_tokens,
                                                                    want):
    """vLLM's rule: a stop string ends the output only in a token after the first
    min_tokens (one that starts earlier and ends there counts)."""
    from tiny_llm.step.request import Request

    class Pieces:  # a detokenizer whose token i is pieces[i]
        def add(self, token: int) -> str:
            return pieces[token]

        def flush(self) -> str:
            return ""

    req = Request([1, 2], SamplingParams(stop=stop, min_tokens=min_tokens), Pieces(), set(), 64)
    for token in range(len(pieces)):
        req.append_token(token)
        if req.is_finished:
            break
    assert (req.output_text, req.finish_reason) == (want, "stop")


@pytest.mark.task("1.7")
@pytest.mark.parametrize("seed", range(20))
def test_step_arithmetic_equals_the_scheduler(seed):
    """The closed forms of the chapter (a static batch lasts as long as its longest request;
    a continuous slot takes the next request as soon as its own ends) against the
    scheduler itself driving fake requests."""
    rng = random.Random(seed)
    lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
    max_batch = rng.randint(1, 8)
    for policy, closed_form in (("static", static_batching_steps),
                                ("continuous", continuous_batching_steps)):
        assert closed_form(lens, max_batch) == simulate_batching(lens, max_batch, policy), policy


# ---------------------------------------------------------------------------------------
# The pieces, one at a time (each task's own tests).


@pytest.mark.task("1.1")
def test_step_budget_grants_decodes_and_whole_prompts_only():
    budget = StepBudget(10)
    assert [budget.take_decode() for _ in range(3)] == [True] * 3 and budget.left == 7
    assert budget.take_prefill(8) == 0 and budget.left == 7  # whole or not at all
    assert budget.take_prefill(7) == 7 and budget.left == 0
    assert budget.take_decode() is False and budget.take_prefill(1) == 0
    budget.give_back(4)
    assert budget.take_prefill(4) == 4


@pytest.mark.task("1.2")
def test_dense_slots_are_taken_once_and_reused():
    slots = DenseKVStorage(num_slots=2, num_layers=1)
    a, b, c = SimRequest(0, 3, 1), SimRequest(1, 3, 1), SimRequest(2, 3, 1)
    assert slots.allocate(a, 3) and slots.allocate(a, 4)  # the same request: one slot
    assert slots.allocate(b, 3)
    assert sorted(slots.slot_of.values()) == [0, 1] and slots.free_slots == []
    slot_a = slots.slot_of[a]
    kv = mx.ones((3, 1, 4))
    slots.caches[slot_a].attend(0, kv, kv, kv, 1.0)  # a's K/V in its slot
    assert slots.caches[slot_a].length == 3
    slots.free(a)
    slots.free(a)  # freeing twice changes nothing
    assert slots.free_slots == [slot_a]
    assert slots.caches[slot_a].length == 0  # the next request does not attend to a's K/V
    assert slots.allocate(c, 3) and slots.slot_of[c] == slot_a  # reused at once
    assert slots.layout([]) == DenseLayout([])


@pytest.mark.task("1.3")
def test_finish_step_records_computed_tokens_and_retire_frees():
    from tiny_llm.step.batch import ScheduledChunk

    kv = DenseKVStorage(num_slots=2, num_layers=1)
    scheduler = Scheduler(2, 64, kv=kv)
    a, b = SimRequest(0, 5, 2), SimRequest(1, 3, 2)
    scheduler.running = [a, b]
    kv.allocate(a, 5)
    kv.allocate(b, 3)
    scheduler.finish_step([ScheduledChunk(a, 0, 5), ScheduledChunk(b, 0, 2)])
    assert (a.num_computed_tokens, b.num_computed_tokens) == (5, 2)
    scheduler.retire(a)
    assert scheduler.running == [b] and a.status == RequestStatus.FINISHED
    assert a not in kv.slot_of and len(kv.free_slots) == 1
    scheduler.waiting.append(a)  # retire also takes a request out of the waiting queue
    scheduler.retire(a)
    assert not scheduler.waiting


@pytest.mark.task("1.4")
@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_admission_fills_free_slots_in_order_within_the_budget(policy):
    scheduler = Scheduler(max_num_seqs=3, max_num_batched_tokens=10, policy=policy)
    reqs = [SimRequest(i, n, 1) for i, n in enumerate([4, 5, 2, 1])]
    for r in reqs:
        scheduler.add(r)
    plan: dict = {}
    scheduler.admit(plan, StepBudget(10))
    # 4 + 5 fit; 2 more would exceed 10 tokens: nobody overtakes the head of the queue.
    assert plan == {reqs[0]: 4, reqs[1]: 5} and scheduler.running == reqs[:2]
    assert list(scheduler.waiting) == reqs[2:]
    assert all(r.status == RequestStatus.RUNNING for r in reqs[:2])
    # Static admits only into an empty batch; continuous whenever a slot is free.
    assert scheduler.may_admit() == (policy == "continuous")
    scheduler.running = []
    assert scheduler.may_admit()
    # The slots bound admission as the budget does: three slots, three requests, however
    # many tokens the step has left.
    plan = {}
    scheduler.admit(plan, StepBudget(100))
    assert list(plan) == reqs[2:] and len(scheduler.running) == 2
    more = [SimRequest(i, 1, 1) for i in range(4, 8)]
    for r in more:
        scheduler.add(r)
    scheduler.admit(plan, StepBudget(100))
    assert len(scheduler.running) == 3 and list(scheduler.waiting) == more[1:]
