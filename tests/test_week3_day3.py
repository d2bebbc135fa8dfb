"""Day 3: paged KV cache — block math, bookkeeping invariants, and the paged engine
against the dense engine of Days 1-2 (the oracle)."""

import logging

from tiny_llm.day3_paged_kv import (
    BlockManager,
    PagedBatchingSimulator,
    blocks_needed,
    kv_cache_blocks_fragmentation,
)
from tiny_llm.engine import LLMEngine
from tiny_llm.sampling.params import SamplingParams
from tiny_llm.testing.runs import greedy, tokens_of, workload

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

PAGED = dict(kv_cache="paged", attention="gather")  # Day 3: attention gathers from the pages
DENSE = dict(kv_cache="dense")  # the oracle: Days 1-2


@pytest.mark.task("3.1")
def test_block_math():
    assert blocks_needed(8, 4) == 2
    assert [blocks_needed(n, 4) for n in (0, 1, 3, 4, 5, 9)] == [0, 1, 1, 1, 2, 3]


@pytest.mark.task("3.2")
def test_fragmentation():
    frag = kv_cache_blocks_fragmentation([5, 16, 17], block_size=16, max_len=64)
    assert (frag.paged_total_slots, frag.paged_wasted_slots) == (16 + 16 + 32, 64 - 38)
    assert (frag.dense_total_slots, frag.dense_wasted_slots) == (3 * 64, 3 * 64 - 38)
    # No max_len: a static batch reserves the longest sequence for every one.
    frag = kv_cache_blocks_fragmentation([5, 16, 17], block_size=16)
    assert (frag.dense_total_slots, frag.dense_wasted_slots) == (3 * 17, 3 * 17 - 38)


@pytest.mark.task("3.3")
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_append_allocates_a_page_only_when_the_tail_is_full(block_size):
    bm = BlockManager(num_blocks=64, block_size=block_size)
    bm.allocate("s", 1)
    for n in range(2, 3 * block_size + 2):
        free_before = bm.num_free_blocks
        table = bm.append("s")
        grew = free_before - bm.num_free_blocks
        assert grew == (1 if (n - 1) % block_size == 0 else 0), f"token {n}"
        assert len(table) == blocks_needed(n, block_size)


@pytest.mark.task("3.3")
def test_out_of_memory_returns_none_and_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.allocate("a", 8) is not None and bm.num_free_blocks == 1
    assert bm.allocate("b", 5) is None and "b" not in bm.tables and bm.num_free_blocks == 1
    assert bm.append("a") is not None  # 9th token takes the last page
    assert bm.append("a") is not None  # 10th fits in the tail page
    assert bm.grow("a", 3) is None and bm.lengths["a"] == 10  # 13 tokens would need a 4th
    assert not bm.can_allocate(1)
    bm.check_invariants()


@pytest.mark.task("3.5")
def test_prefix_pages_are_shared_and_survive_other_holders():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(10))  # two full pages + 2 tokens
    bm.allocate("a", 10)
    assert bm.cache_full_blocks("a", prompt)[0] == 2
    hits = bm.match_prefix(prompt + [99])
    assert hits == bm.tables["a"][:2]
    bm.attach_prefix("b", hits)
    assert [bm.blocks[i].ref_count for i in hits] == [2, 2]
    bm.free("a")  # "a" aborts; "b" still holds the shared pages
    assert [bm.blocks[i].ref_count for i in hits] == [1, 1]
    bm.check_invariants()
    bm.free("b")
    # Freed pages keep their identity: the prompt still hits, until the pool needs them.
    assert bm.match_prefix(prompt) == hits
    # A full-prompt hit leaves the last token to recompute: 8 tokens = 2 pages -> 1 hit.
    assert len(bm.match_prefix(prompt[:8])) == 1
    bm.allocate("c", 8 * 4)  # needs every page: the cached ones are evicted (LRU)
    assert bm.match_prefix(prompt) == [] and not bm.cached
    bm.check_invariants()


@pytest.mark.task("3.5")
def test_hash_collision_cannot_alias_a_prefix():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    bm.allocate("a", 2)
    bm.cache_full_blocks("a", [1, 2])
    page = bm.tables["a"][0]
    assert len(bm.cached) == 1
    bm.blocks[page].token_ids = (7, 7)  # as if another prefix had produced the same hash
    assert bm.match_prefix([1, 2, 3]) == []


@pytest.mark.task("3.7")
@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 6),  # arrival step
            st.integers(1, 40),  # prompt length
            st.integers(1, 12),  # output length
            st.integers(0, 2),  # which shared prefix
            st.booleans(),  # abort it later?
        ),
        min_size=1,
        max_size=12,
    ),
    st.integers(6, 24),  # pages in the pool
    st.sampled_from([2, 4, 8]),  # page size
    st.booleans(),  # prefix caching
)
def test_random_workloads_keep_page_accounting_exact(jobs, num_pages, page_size, caching):
    bm = BlockManager(num_pages, page_size, enable_prefix_caching=caching)
    sim = PagedBatchingSimulator(max_batch=4, block_manager=bm, max_num_batched_tokens=32)
    prefixes = [[1000 + p * 100 + i for i in range(24)] for p in range(3)]
    pending = sorted(jobs)
    added = []
    step = 0
    while pending or sim.scheduler.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt_len, out_len, prefix, abort = pending.pop(0)
            tokens = (prefixes[prefix] + list(range(len(added) * 100, len(added) * 100 + 40)))
            tokens = tokens[:prompt_len]
            if blocks_needed(prompt_len + out_len, page_size) > num_pages:
                continue  # the engine rejects what could never fit; so does this driver
            added.append((sim.add_request(prompt_len, out_len, tokens), abort))
        sim.step()
        step += 1
        for req, abort in added:
            if abort and len(req.output_token_ids) == 1 and req in sim.scheduler.running:
                sim.scheduler.retire(req)
        bm.check_invariants()
        held = {p for t in bm.tables.values() for p in t}
        assert len(held) + bm.num_free_blocks == num_pages
        assert len(sim.scheduler.running) <= 4
        assert step < 2000, "no progress: livelock"
    assert bm.num_free_blocks == num_pages and not bm.tables  # nothing leaked
    for req, abort in added:
        assert abort or len(req.output_token_ids) == req.output_len


@pytest.mark.task("3.7")
def test_paged_engine_equals_dense_engine(tiny_model, smollm_tokenizer):
    prompts, params = workload(10, seed=1)
    dense = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=4, **DENSE)
    paged = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=4, **PAGED,
                      page_size=4, num_pages=256, max_num_batched_tokens=32)
    assert tokens_of(paged, prompts, params) == tokens_of(dense, prompts, params)
    assert paged.stats()["num_preemptions"] == 0
    paged.kv.blocks.check_invariants()
    assert paged.stats()["num_free_pages"] == 256


@pytest.mark.task("3.7")
def test_small_pool_preempts_and_still_matches_dense(tiny_model, smollm_tokenizer):
    prompts, params = workload(10, seed=2)
    expected = tokens_of(LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=4, **DENSE),
                         prompts, params)
    paged = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=4, **PAGED,
                      page_size=4, num_pages=18, max_model_len=72, enable_prefix_caching=False)
    assert tokens_of(paged, prompts, params) == expected
    stats = paged.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_pages"] == 18


@pytest.mark.task("3.7")
@pytest.mark.parametrize("page_size", [4, 16])
def test_prefix_cache_hits_change_nothing_but_the_work(tiny_model, smollm_tokenizer, page_size):
    prompts, params = workload(8, seed=3, shared_prefix=37)
    results, stats = [], []
    for caching in (False, True):
        engine = LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=2, **PAGED,
                           page_size=page_size, num_pages=128, enable_prefix_caching=caching)
        results.append(tokens_of(engine, prompts, params))
        stats.append(engine.stats())
    dense = tokens_of(LLMEngine(tiny_model, smollm_tokenizer, max_num_seqs=2, **DENSE), prompts,
                      params)
    assert results[0] == results[1] == dense
    assert stats[0]["prefix_cache_hit_tokens"] == 0
    assert stats[1]["prefix_cache_hit_tokens"] >= 6 * (37 // page_size) * page_size
    assert stats[1]["num_prompt_tokens_computed"] < stats[0]["num_prompt_tokens_computed"]


def test_request_that_can_never_fit_is_rejected(tiny_model, smollm_tokenizer):
    engine = LLMEngine(tiny_model, smollm_tokenizer, **PAGED, page_size=4, num_pages=8,
                       max_model_len=64)
    running = engine.add_request({"prompt_token_ids": [5, 6, 7]}, greedy(4))
    with pytest.raises(ValueError, match="whole pool holds 32"):
        engine.add_request({"prompt_token_ids": list(range(100, 120))}, greedy(20))
    with pytest.raises(ValueError, match="whole pool"):
        engine.add_request({"prompt_token_ids": [5]}, SamplingParams(max_tokens=None))
    outs = engine.generate({"prompt_token_ids": list(range(100, 120))}, greedy(12))
    assert len(outs[0].outputs[0].token_ids) == 12
    # The request added with add_request finished alongside; its output waits for the next
    # step() (the caller of add_request owns it), and then its id is free again.
    assert engine.requests[running].is_finished
    outs = engine.step()
    assert [o.request_id for o in outs] == [running] * 4 and outs[-1].finished
    assert running not in engine.requests


@pytest.mark.task("3.7")
def test_abort_of_a_prefix_sharer_leaves_the_other_intact(tiny_model, smollm_tokenizer):
    prefix = list(range(300, 340))
    a, b = {"prompt_token_ids": prefix + [1, 2]}, {"prompt_token_ids": prefix + [3]}
    expected = tokens_of(LLMEngine(tiny_model, smollm_tokenizer, **DENSE), [b], [greedy(10)])[0]
    engine = LLMEngine(tiny_model, smollm_tokenizer, **PAGED, page_size=8, num_pages=64)
    ida = engine.add_request(a, greedy(30))
    engine.step()  # a's prompt pages are computed and cached
    idb = engine.add_request(b, greedy(10))
    engine.step()
    shared = engine.kv.blocks.tables[engine.requests[idb]][:5]
    assert shared == engine.kv.blocks.tables[engine.requests[ida]][:5]
    engine.abort(ida)
    assert all(engine.kv.blocks.blocks[p].ref_count == 1 for p in shared)
    result = {}
    while engine.has_unfinished_requests():
        result.update({o.request_id: o for o in engine.step()})
    assert result[idb].outputs[0].token_ids == expected
    assert engine.stats()["prefix_cache_hit_tokens"] == 40


def test_pool_is_sized_from_the_memory_budget_and_logged(tiny_model, smollm_tokenizer, caplog):
    cfg = tiny_model.config
    page_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 16
    with caplog.at_level(logging.INFO, logger="tiny_llm"):
        engine = LLMEngine(tiny_model, smollm_tokenizer, **PAGED,
                           kv_memory_bytes=100 * page_bytes + 5, max_model_len=400)
    assert engine.stats()["num_pages"] == 100
    assert "100 pages x 16 tokens" in caplog.text and "4.00x" in caplog.text
    with pytest.raises(ValueError, match="holds no page"):
        LLMEngine(tiny_model, smollm_tokenizer, **PAGED, kv_memory_bytes=10)


@pytest.mark.task("3.5")
def test_a_private_duplicate_page_keeps_its_sequence_hash_chain():
    """Two sequences fill identical first pages; only one copy is cached. The second
    sequence's later pages must still chain through the first page's digest, or its page
    1 would be filed as a *first* page and hit a request that merely starts with it."""
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    shared, tail = [1, 2], [3, 4]
    bm.allocate("a", 2)
    bm.allocate("b", 4)
    bm.cache_full_blocks("a", shared)
    done, chain = bm.cache_full_blocks("b", shared, 0, None)  # page 0 stays private
    assert bm.blocks[bm.tables["b"][0]].hash is None
    bm.cache_full_blocks("b", shared + tail, done, chain)
    assert bm.match_prefix(tail + [9]) == []  # [3, 4] was never a first page
    assert bm.match_prefix(shared + tail + [9]) == [bm.tables["a"][0], bm.tables["b"][1]]


@pytest.mark.task("3.4")
def test_free_returns_pages_when_no_table_holds_them_and_reuses_the_oldest_first():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = bm.allocate("a", 8)  # pages for 2 x 4 tokens
    bm.allocate("b", 4)
    assert bm.num_free_blocks == 3
    bm.blocks[a[0]].ref_count += 1  # as if another table shared a's first page
    bm.tables["c"], bm.lengths["c"] = [a[0]], 4
    bm.free("a")
    assert bm.num_free_blocks == 4  # a's second page came back; the shared one did not
    bm.free("c")
    bm.free("b")
    assert bm.num_free_blocks == 6 and not bm.tables
    bm.check_invariants()
    # Freed pages are reused least recently freed first (a cached page lives longest).
    order = list(bm.free_blocks)
    assert bm.allocate("d", 4) == [order[0]]


@pytest.mark.task("3.4")
def test_truncate_is_the_one_way_pages_return():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    bm.allocate("a", 14)  # 4 pages
    bm.attach_prefix("b", bm.tables["a"][:2])  # b shares a's first two pages
    a_pages = list(bm.tables["a"])
    bm.truncate("a", 5)  # keeps 2 pages; the last two return, tail first
    assert bm.tables["a"] == a_pages[:2] and bm.lengths["a"] == 5
    assert list(bm.free_blocks)[-2:] == [a_pages[3], a_pages[2]]
    bm.truncate("a", 0)  # a's shared pages keep b's reference
    assert bm.tables["a"] == [] and all(bm.blocks[p].ref_count == 1 for p in a_pages[:2])
    bm.free("a")
    bm.free("a")  # and freeing again, or a sequence never allocated, changes nothing
    bm.free("never")
    assert "a" not in bm.tables
    bm.check_invariants()


@pytest.mark.task("3.6")
def test_slots_translate_positions_through_the_block_table():
    from tiny_llm.day3_paged_kv import slots_for

    table = [7, 2, 5]  # logical page j lives in physical page table[j]
    assert slots_for(table, 0, 3, 4) == [28, 29, 30]
    assert slots_for(table, 3, 9, 4) == [31, 8, 9, 10, 11, 20]
    assert slots_for(table, 5, 5, 4) == []


@pytest.mark.task("3.7")
def test_preemption_takes_the_newest_request_and_requeues_it_first():
    # 5 pages of 4 tokens; three 4-token prompts take a page each; each needs a second page
    # for its 5th token, and only two are left: the newest (admitted last) must go.
    bm = BlockManager(num_blocks=5, block_size=4)
    sim = PagedBatchingSimulator(max_batch=3, block_manager=bm)
    old, middle, new = (sim.add_request(4, 3, [i] * 4) for i in range(3))
    late = sim.add_request(4, 1, [9] * 4)  # waiting: behind the preempted one, not ahead
    sim.step()  # prefill all three (12 tokens, 3 pages)
    assert sim.scheduler.running == [old, middle, new]
    sim.step()  # token 5 of each: 3 more pages wanted, 2 free
    assert sim.scheduler.running == [old, middle]
    assert list(sim.scheduler.waiting) == [new, late]
    assert new.num_preemptions == 1 and new.num_computed_tokens == 0
    assert old.num_preemptions == middle.num_preemptions == 0
    sim.run()
    assert all(len(r.output_token_ids) == r.output_len for r in (old, middle, new, late))
    bm.check_invariants()
    assert bm.num_free_blocks == 5


@pytest.mark.task("3.7")
def test_a_victim_planned_this_step_leaves_the_plan_and_gives_its_tokens_back():
    """make_room preempts the newest running request; one already given tokens this step
    loses them, and the step's budget gets them back for the requests after it."""
    bm = BlockManager(num_blocks=2, block_size=4)
    sim = PagedBatchingSimulator(max_batch=2, block_manager=bm, max_num_batched_tokens=16)
    old, new = (sim.add_request(4, 3, [i] * 4) for i in range(2))
    sim.step()  # both prompts: a page each, the pool is full; each 5th token needs a page
    scheduler = sim.scheduler
    budget = scheduler.new_budget()
    assert budget.take_decode() and budget.take_decode()  # old's and new's tokens
    plan = {new: 1}  # new was planned first (say, by a running order that put it first)
    assert scheduler.make_room(old, 5, plan, budget)
    assert plan == {} and budget.left == 16 - 1
    assert scheduler.running == [old] and list(scheduler.waiting) == [new]
    assert new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert len(bm.tables[old]) == 2
