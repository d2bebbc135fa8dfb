"""Speculative decoding: the acceptance rule, trees of drafts (the tree mask and the rule
over a tree), rewind, the proposers, and the engine.

Oracles: the target distribution itself (chi-square over many seeded trials: what the rule
emits must be distributed as the target, at any temperature and with filters; a tree's rule
is also the chain's rule, draw for draw, on a chain), the causal attention over each draft's
own path, and the
engine without speculation (greedy tokens must be identical, token for token, for both
proposers, alone and in a batch, with preemption and prefix hits).
"""

from __future__ import annotations

import random
from dataclasses import replace

from tiny_llm.day3_paged_kv import BlockManager, PageTables
from tiny_llm.engine import LLMEngine
from tiny_llm.sampling.params import SamplingParams
from tiny_llm.speculative import (
    NgramProposer,
    distribution,
    rewind,
    speculative_accept,
    tree_accept,
    tree_attention,
)
from tiny_llm.step.batch import Drafts, ScheduledChunk, StepBatch, TokenTree
from tiny_llm.step.dense_kv import causal_attention
from tiny_llm.step.request import SequenceState
from tiny_llm.structured import StructuredOutput
from tiny_llm.testing.models import make_repeater_model
from tiny_llm.testing.runs import greedy, served_alone, tokens_of

import mlx.core as mx
import numpy as np
import pytest


class Draws:
    """A generator whose draws are given: decides each accept/reject in a test."""

    def __init__(self, *values: float):
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def chi2_critical(dof: int) -> float:
    """The chi-square value exceeded with probability ~1e-6 (Wilson-Hilferty)."""
    z = 4.75
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


# ---------------------------------------------------------------------------------------
# The acceptance rule


@pytest.mark.task("6.1")
def test_the_rule_case_by_case():
    p = np.array([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.8, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = np.array([[0.25, 0.25, 0.5, 0.0], [0.1, 0.1, 0.8, 0.0]])
    # Draft 0 (p 0.5 >= q 0.25): accepted whatever the draw; draft 2 at position 1
    # (p = q): accepted; all accepted, the bonus comes from p[2] (draw 0.6 -> token 2).
    # Whether a draft kept for certain takes a draw is the learner's choice: the draws are
    # alike, so both give the same bonus.
    assert speculative_accept([0, 2], p, q, Draws(0.6, 0.6, 0.6)) == (2, 2)
    # Draft 2 at position 0: p 0.2 < q 0.5, accepted with probability 0.4.
    assert speculative_accept([2, 2], p, q, Draws(0.39, 0.0, 0.6))[0] == 2
    n, bonus = speculative_accept([2, 2], p, q, Draws(0.41, 0.5))
    # Rejected: the residual max(0, p - q) = [0.25, 0.05, 0, 0] -> draw 0.5 -> token 0.
    assert (n, bonus) == (0, 0)
    assert speculative_accept([2, 2], p, q, Draws(0.41, 0.9)) == (0, 1)
    # A token the proposer could not propose (q = 0) is never accepted.
    assert speculative_accept([3], p, q[:1], Draws(0.0, 0.5))[0] == 0


@pytest.mark.task("6.1")
def test_greedy_accepts_exactly_the_argmax():
    vocab = 7
    p = np.eye(vocab)[[3, 5, 1]]  # greedy targets: one-hot on the argmax
    q = np.eye(vocab)[[3, 5]]
    assert speculative_accept([3, 5], p, q, np.random.default_rng(0)) == (2, 1)
    assert speculative_accept([3, 4], p, np.eye(vocab)[[3, 4]], np.random.default_rng(0)) == (
        1, 5)  # the first mismatch is replaced by the target's argmax
    assert speculative_accept([2, 5], p, np.eye(vocab)[[2, 5]], np.random.default_rng(0)) == (
        0, 3)


@pytest.mark.task("6.1")
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.1),
], ids=["T1", "T0.7-topk-topp", "minp"])
def test_emitted_tokens_follow_the_target_distribution(params):
    """Over many trials, the token emitted at each position is distributed as the target's
    distribution there, whatever the draft proposes (filters applied to both)."""
    rng = np.random.default_rng(0)
    vocab, k, trials = 8, 3, 30000
    target = rng.normal(size=(k + 1, vocab)) * 2
    draft = target[:k] + rng.normal(size=(k, vocab))  # a draft that is often, not always, right
    p = np.stack([distribution(row, params, vocab) for row in target])
    q = np.stack([distribution(row, params, vocab) for row in draft])
    counts = np.zeros((k + 1, vocab))
    draws = np.random.default_rng(1)
    for _ in range(trials):
        drafts = [int(draws.choice(vocab, p=q[i])) for i in range(k)]
        n, bonus = speculative_accept(drafts, p, q, draws)
        for j, token in enumerate([*drafts[:n], bonus]):
            counts[j, token] += 1
    for j in range(k + 1):
        seen = counts[j].sum()
        assert seen > 2000
        support = p[j] > 0
        expected = p[j][support] * seen
        chi2 = ((counts[j][support] - expected) ** 2 / expected).sum()
        assert chi2 < chi2_critical(max(1, support.sum() - 1)), (j, counts[j], p[j] * seen)
        assert counts[j][~support].sum() == 0  # nothing the filters removed is ever emitted


# ---------------------------------------------------------------------------------------
# Trees of drafts

# [(0,), (1,), (2,), (0, 0), (1, 0), (1, 1), (2, 0), (1, 0, 0), (2, 0, 0)]: three children
# of the root, a path of three under the first two, breadth first.
TREE = [(0,), (1,), (2,), (0, 0), (1, 0), (1, 1), (2, 0), (1, 0, 0), (2, 0, 0)]


def tree_drafts(tokens: list[int] | None = None) -> Drafts:
    tree = TokenTree.parse(TREE)
    index = {p: i for i, p in enumerate(tree.paths)}
    parents = tuple(index[p[:-1]] if len(p) > 1 else -1 for p in tree.paths)
    return Drafts(tuple(tokens or range(100, 100 + len(tree))), parents=parents)


@pytest.mark.task("6.4")
@pytest.mark.device_independent
def test_tree_attention_gives_each_draft_its_own_path():
    """Oracle: the causal attention of the draft's row over the committed keys and its own
    path alone (the last token's row: over the committed keys)."""
    drafts, committed = tree_drafts(), 6
    rng = np.random.default_rng(0)
    num_keys = committed + len(drafts)
    q = mx.array(rng.normal(size=(1 + len(drafts), 4, 8)).astype(np.float32))
    k, v = (mx.array(rng.normal(size=(num_keys, 2, 8)).astype(np.float32)) for _ in "kv")
    got = tree_attention(q, k, v, 0.3, drafts)
    alone = causal_attention(q[:1], k[:committed], v[:committed], 0.3, committed - 1)
    assert mx.allclose(got[0], alone[0], atol=1e-5)
    for i in range(len(drafts)):  # draft i: row 1 + i, key committed + i
        path, node = [], i
        while node >= 0:
            path.insert(0, committed + node)
            node = drafts.parent(node)
        keys = mx.array(list(range(committed)) + path)
        alone = causal_attention(q[1 + i : 2 + i], k[keys], v[keys], 0.3, len(keys) - 1)
        assert mx.allclose(got[1 + i], alone[0], atol=1e-5), i
    chain = Drafts((5, 6, 7))  # a chain's rows see every draft up to their own: causal
    causal = causal_attention(q[:4], k[:9], v[:9], 0.3, 5)
    assert mx.allclose(tree_attention(q[:4], k[:9], v[:9], 0.3, chain), causal, atol=1e-5)


@pytest.mark.task("6.4")
@pytest.mark.parametrize("tiled", [False, True], ids=["vector", "tiled"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_the_kernels_attend_over_a_tree_as_the_reference(tiled, dtype):
    """The extension's schedules with tree rows (a request verifying the tree after 70
    committed tokens, more than one chunk of keys, beside another's prefill chunk) against
    ``tree_attention`` for the tree and the causal attention for the prefill chunk."""
    from tiny_llm.day4_paged_attention import paged_attention

    page_size, n_pages, h_kv, h_q, dim = 8, 32, 2, 4, 64
    prefill = SequenceState(list(range(8)))
    prefill.num_computed_tokens = 3
    verifying = SequenceState(list(range(71)))
    verifying.num_computed_tokens = 70
    drafts = tree_drafts()
    chunks = [ScheduledChunk(prefill, 3, 8),
              ScheduledChunk(verifying, 70, 71 + len(drafts), drafts)]
    tree = StepBatch.build(chunks, kv=None).tree
    rng = np.random.default_rng(5)
    pages = rng.permutation(n_pages)
    tables = [pages[:1].tolist(), pages[1:1 + -(-(71 + len(drafts)) // page_size)].tolist()]
    block_table = np.full((2, max(map(len, tables))), -1, np.int32)
    for b, table in enumerate(tables):
        block_table[b, : len(table)] = table
    context_lens, qsl = [8, 71 + len(drafts)], [0, 5, 5 + 1 + len(drafts)]
    k_pages, v_pages = (rng.normal(size=(n_pages, page_size, h_kv, dim)) for _ in "kv")
    q = rng.normal(size=(qsl[-1], h_q, dim))
    as_mx = lambda a: mx.array(a.astype(np.float32)).astype(dtype)  # noqa: E731
    args = (as_mx(q), as_mx(k_pages), as_mx(v_pages), mx.array(block_table),
            mx.array(context_lens, dtype=mx.int32), mx.array(qsl, dtype=mx.int32), 0.25)
    wrong = replace(tree, ancestors=tree.ancestors | np.uint64(1 << 12))  # past 9 drafts
    with pytest.raises(ValueError, match="names keys after the row's own"):
        paged_attention(*args, tiled=tiled, tree=wrong)
    got = paged_attention(*args, tiled=tiled, tree=tree)
    for b, table in enumerate(tables):
        n = context_lens[b]
        slots = [table[p // page_size] * page_size + p % page_size for p in range(n)]
        k = as_mx(k_pages.reshape(-1, h_kv, dim)[slots])
        v = as_mx(v_pages.reshape(-1, h_kv, dim)[slots])
        rows = as_mx(q[qsl[b] : qsl[b + 1]])
        want = (tree_attention(rows, k, v, 0.25, drafts) if b == 1 else
                causal_attention(rows, k, v, 0.25, n - rows.shape[0]))
        tol = 1e-5 if dtype == mx.float32 else 2e-2
        assert mx.allclose(got[qsl[b] : qsl[b + 1]].astype(mx.float32),
                           want.astype(mx.float32), atol=tol), b




@pytest.mark.task("6.5")
@pytest.mark.device_independent
def test_a_chain_decides_as_the_chain_rule_draw_for_draw():
    rng = np.random.default_rng(0)
    vocab, k = 6, 4
    for trial in range(200):
        p = rng.dirichlet(np.ones(vocab), size=k + 1)
        q = rng.dirichlet(np.ones(vocab), size=k)
        tokens = [int(rng.choice(vocab, p=q[i])) for i in range(k)]
        n, bonus = speculative_accept(tokens, p, q, np.random.default_rng(trial))
        path, tree_bonus = tree_accept(Drafts(tuple(tokens)), p, q, np.random.default_rng(trial))
        assert (path, tree_bonus) == (list(range(n)), bonus)


@pytest.mark.task("6.5")
@pytest.mark.device_independent
def test_greedy_takes_the_longest_path_of_argmaxes_in_a_tree():
    # (0,)=3 (1,)=4 (2,)=5 (0,0)=1 (1,0)=2 (1,1)=6 (2,0)=2 (1,0,0)=0 (2,0,0)=3
    drafts = tree_drafts([3, 4, 5, 1, 2, 6, 2, 0, 3])
    vocab = 8
    target = np.eye(vocab)[[0] * (len(drafts) + 1)]  # row 1 + i: after draft i
    target[0] = np.eye(vocab)[4]  # after the last token: 4, which is (1,)
    target[2] = np.eye(vocab)[6]  # after (1,): 6, which is (1, 1), not its sibling (1, 0)
    target[6] = np.eye(vocab)[7]  # after (1, 1): 7, a leaf's bonus
    q = np.eye(vocab)[list(drafts.tokens)]
    assert tree_accept(drafts, target, q, np.random.default_rng(0)) == ([1, 5], 7)
    target[0] = np.eye(vocab)[7]  # no child of the root is right: the argmax alone
    assert tree_accept(drafts, target, q, np.random.default_rng(0)) == ([], 7)


@pytest.mark.task("6.5")
@pytest.mark.device_independent
@pytest.mark.parametrize("siblings", ["drawn", "deterministic"])
def test_what_a_tree_emits_follows_the_target_distribution(siblings):
    """Three children of the root and two under the first, drawn from the draft's
    distribution (with replacement) or fixed: the first two emitted tokens are distributed
    as the target's distributions there, under the filters."""
    params = SamplingParams(temperature=0.8, top_k=5)
    rng = np.random.default_rng(2)
    vocab, trials = 7, 30000
    logits = rng.normal(size=(6, vocab)) * 2
    p = np.stack([distribution(row, params, vocab) for row in logits])
    q_root = distribution(logits[0] + rng.normal(size=vocab), params, vocab)
    q_first = distribution(logits[1] + rng.normal(size=vocab), params, vocab)
    parents = (-1, -1, -1, 0, 0)
    counts = np.zeros((2, vocab))
    draws = np.random.default_rng(3)
    for _ in range(trials):
        if siblings == "drawn":
            tokens = [int(draws.choice(vocab, p=q)) for q in (q_root,) * 3 + (q_first,) * 2]
            q = np.stack([q_root] * 3 + [q_first] * 2)
        else:
            tokens = [0, 2, 4, 1, 3]
            q = np.eye(vocab)[tokens]
        # Targets past the first level are one distribution whatever the node: row 1 + i
        # for draft i, as if every node were followed by the same text.
        target = np.stack([p[0], p[1], p[1], p[1], p[2], p[2]])
        path, bonus = tree_accept(Drafts(tuple(tokens), parents=parents), target, q, draws)
        emitted = [tokens[i] for i in path] + [bonus]
        for j, token in enumerate(emitted[:2]):
            counts[j, token] += 1
    for j, want in enumerate((p[0], p[1])):
        seen = counts[j].sum()
        support = want > 0
        expected = want[support] * seen
        chi2 = ((counts[j][support] - expected) ** 2 / expected).sum()
        assert chi2 < chi2_critical(max(1, support.sum() - 1)), (j, counts[j], expected)
        assert counts[j][~support].sum() == 0
        assert seen > 2000


# ---------------------------------------------------------------------------------------
# Rewind


def space_with(tokens: int, page_size: int = 4, caching: bool = True) -> tuple[PageTables, str]:
    space = PageTables(BlockManager(16, page_size, enable_prefix_caching=caching))

    class Seq:
        def __init__(self):
            self.ids = list(range(100, 100 + tokens))
            self.num_tokens = tokens

        def token_ids_between(self, start, end):
            return self.ids[start:end]

    seq = Seq()
    assert space.allocate(seq, tokens)
    return space, seq


@pytest.mark.task("6.2")
@pytest.mark.parametrize("before,after,pages", [
    (10, 10, 3),  # nothing rejected
    (10, 9, 3),  # within the tail page
    (13, 11, 3),  # across a page boundary: the last page returns
    (14, 6, 2),  # back to the end of a prompt, two pages away
])
def test_rewind_returns_pages_past_the_new_length(before, after, pages):
    space, seq = space_with(before)
    space.commit(seq, min(after, 8))  # pages full of accepted tokens may be cached
    rewind(space, seq, after)
    bm = space.blocks
    assert len(bm.tables[seq]) == pages and bm.lengths[seq] == after
    assert bm.num_free_blocks == 16 - pages
    bm.check_invariants()
    assert space.allocate(seq, after + 5)  # and the sequence grows again from there
    bm.check_invariants()


@pytest.mark.task("6.2")
def test_rewind_refuses_to_cut_into_committed_pages_and_changes_nothing():
    space, seq = space_with(13)  # pages of 4: 4 pages
    space.commit(seq, 8)  # two full pages of accepted tokens in the prefix cache
    bm = space.blocks
    table, free = list(bm.tables[seq]), bm.num_free_blocks
    with pytest.raises(ValueError, match="committed"):
        rewind(space, seq, 7)  # would cut into the second committed page
    assert bm.tables[seq] == table and bm.lengths[seq] == 13 and bm.num_free_blocks == free
    rewind(space, seq, 8)  # down to the committed pages themselves is fine
    assert len(bm.tables[seq]) == 2
    bm.check_invariants()


@pytest.mark.task("6.2")
def test_random_accepts_and_rejects_conserve_pages():
    """Thousands of speculative steps (grow by the drafts, commit what is accepted, rewind
    the rest) over several sequences sharing a pool with prefix caching: the accounting
    stays exact, nothing cached holds a rejected token, and everything comes back."""
    rng = random.Random(0)
    bm = BlockManager(64, 4, enable_prefix_caching=True)
    space = PageTables(bm)

    class Seq:
        def __init__(self, ident: int):
            self.ids = [ident] * rng.randint(1, 9)

        @property
        def num_tokens(self):
            return len(self.ids)

        def token_ids_between(self, start, end):
            return self.ids[start:end]

    live = []
    for step in range(3000):
        if len(live) < 4 and rng.random() < 0.1:
            seq = Seq(len(live) + step)
            if space.allocate(seq, seq.num_tokens):
                space.commit(seq, seq.num_tokens - 1)
                live.append(seq)
        if not live:
            continue
        seq = rng.choice(live)
        k = rng.randint(0, 4)
        if not space.allocate(seq, seq.num_tokens + k):
            space.free(seq)
            live.remove(seq)
            continue
        accepted = rng.randint(0, k)
        seq.ids += [rng.randrange(50) for _ in range(accepted + 1)]
        space.commit(seq, seq.num_tokens - 1)
        rewind(space, seq, seq.num_tokens - 1)
        bm.check_invariants()
        # Rewound to exactly its accepted tokens: a partial last page stays.
        assert bm.lengths[seq] == seq.num_tokens - 1
        assert len(bm.tables[seq]) == -(-(seq.num_tokens - 1) // 4)
        for block in bm.blocks:  # a cached page holds tokens of a sequence, never drafts
            if block.token_ids is not None:
                assert len(block.token_ids) == 4
        if rng.random() < 0.02:
            space.free(seq)
            live.remove(seq)
    for seq in live:
        space.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == 64


# ---------------------------------------------------------------------------------------
# The n-gram proposer


@pytest.mark.task("6.3")
def test_ngram_lookup_proposes_what_followed_the_last_occurrence():
    ngram = NgramProposer(max_n=3)
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert ngram.lookup(tokens, 3) == [8, 9, 1]  # "5 6 7" occurred before: what followed
    assert ngram.lookup([1, 2, 3, 1, 2, 3, 4, 1, 2], 2) == [3, 4]  # the latest occurrence
    assert ngram.lookup([1, 2, 3, 4], 3) == []  # no repetition, no proposal
    assert ngram.lookup([7, 7, 7, 7], 5) == [7]  # never past the end of the sequence


# ---------------------------------------------------------------------------------------
# In the engine


def repetitive_prompts(n: int, seed: int) -> list[dict]:
    """Prompts that repeat themselves, so prompt lookup has something to find."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(100, 40000) for _ in range(rng.randint(3, 8))]
        out.append({"prompt_token_ids": phrase * rng.randint(2, 4) + phrase[:2]})
    return out


@pytest.fixture(scope="module")
def repeater():
    return make_repeater_model()  # repeats itself: prompt lookup has something to find


SCENARIOS = {
    "alone": dict(n=1, engine=dict(num_pages=128)),
    "batch": dict(n=6, engine=dict(num_pages=128, max_num_batched_tokens=32)),
    "preemption": dict(n=6, engine=dict(num_pages=12, page_size=8, max_model_len=64,
                                        enable_prefix_caching=False)),
}


@pytest.mark.task("6.3")
@pytest.mark.parametrize("proposer", ["ngram", "self-draft", "other-draft"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_are_identical_with_speculation(tiny_model, smollm_tokenizer,
                                                      other_tiny_model, repeater, proposer,
                                                      scenario):
    spec = SCENARIOS[scenario]
    prompts = repetitive_prompts(spec["n"], seed=len(scenario))
    shared = [{"prompt_token_ids": prompts[0]["prompt_token_ids"] + [7, 8, 9]}]  # prefix hit
    prompts = prompts + (shared if spec["n"] > 1 else [])
    params = [greedy(12)] * len(prompts)
    target = repeater if proposer == "ngram" else tiny_model
    expected = tokens_of(LLMEngine(target, smollm_tokenizer, **spec["engine"]), prompts,
                         params)
    options = {"ngram": dict(speculative="ngram"),
               "self-draft": dict(speculative="draft", draft_model=(tiny_model, smollm_tokenizer)),
               "other-draft": dict(speculative="draft",
                                   draft_model=(other_tiny_model, smollm_tokenizer))}[proposer]
    engine = LLMEngine(target, smollm_tokenizer, **spec["engine"], **options,
                       speculative_max_batch=8)
    schedule, sizes = engine.scheduler.schedule, []

    def recorded():  # every step's tokens, drafts to verify included
        chunks = schedule()
        sizes.append(sum(c.num_tokens for c in chunks))
        return chunks

    engine.scheduler.schedule = recorded
    assert tokens_of(engine, prompts, params) == expected
    assert max(sizes) <= engine.config.max_num_batched_tokens, "drafts overran the budget"
    stats = engine.stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_free_pages"] == stats["num_pages"]
    if proposer == "self-draft":  # the target drafting for itself is always right
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    elif proposer == "other-draft":  # sometimes right: both branches of the rule are taken
        assert 0 < stats["num_accepted_tokens"]
        assert stats["num_accepted_tokens"] < stats["num_draft_tokens"] or scenario == "alone"
    else:  # the repeater repeats what prompt lookup finds
        assert stats["num_accepted_tokens"] > 0
    if scenario == "preemption":
        assert stats["num_preemptions"] > 0
    engine.kv.blocks.check_invariants()


def test_seeded_sampling_with_speculation_is_reproducible(tiny_model, smollm_tokenizer):
    prompts = repetitive_prompts(3, seed=4)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=10 + i, max_tokens=10,
                             ignore_eos=True) for i in range(3)]
    runs = [tokens_of(LLMEngine(tiny_model, smollm_tokenizer, num_pages=128,
                                speculative="draft", draft_model=(tiny_model, smollm_tokenizer)),
                      prompts, params) for _ in range(2)]
    assert runs[0] == runs[1] and all(len(t) == 10 for t in runs[0])


def test_speculation_switches_off_when_the_batch_is_full(tiny_model, smollm_tokenizer):
    from tiny_llm.speculative import SpeculationPolicy
    from tiny_llm.step.batch import TokenTree

    policy = SpeculationPolicy(TokenTree.chain(4), max_batch=2)
    assert [policy.tree_for(n) for n in (1, 2, 3, 16)] == [TokenTree.chain(4)] * 2 + [None] * 2
    prompts = repetitive_prompts(6, seed=5)
    engine = LLMEngine(tiny_model, smollm_tokenizer, num_pages=128, speculative="draft",
                       draft_model=(tiny_model, smollm_tokenizer), speculative_max_batch=2)
    tokens_of(engine, prompts, [greedy(5)] * 4 + [greedy(25)] * 2)
    stats = engine.stats()
    # Four plain decode steps while six run (the prompts take one step), then the last two
    # requests speculate: 4 drafts and 1 bonus per step, all accepted (a self-draft).
    assert stats["num_verify_steps"] > 0
    assert stats["num_steps"] == 1 + 4 + -(-(25 - 5) // 5)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_no_request_gets_drafts_past_its_own_max_tokens(tiny_model, smollm_tokenizer,
                                                         repeater, proposer):
    """A verification emits the accepted drafts and one more token: a request is drafted
    at most ``max_tokens - its output - 1`` tokens (none when one token is left), however
    many the engine may draft, and still ends with exactly its max_tokens tokens."""
    options = dict(speculative="ngram") if proposer == "ngram" else dict(
        speculative="draft", draft_model=(tiny_model, smollm_tokenizer))
    target = repeater if proposer == "ngram" else tiny_model
    engine = LLMEngine(target, smollm_tokenizer, num_pages=128, num_speculative_tokens=6,
                       **options)
    drafted = []
    verify = engine.core.spec.verify
    engine.core.spec.verify = lambda request, drafts, logits: (drafted.append(
        (request.params.max_tokens - len(request.output_token_ids), len(drafts)))
        or verify(request, drafts, logits))
    prompts = repetitive_prompts(5, seed=6)
    params = [greedy(n) for n in (2, 3, 5, 8, 13)]
    outs = tokens_of(engine, prompts, params)
    assert [len(t) for t in outs] == [2, 3, 5, 8, 13]
    assert drafted and all(0 < n < left for left, n in drafted), drafted
    assert engine.stats()["num_draft_tokens"] == sum(n for _, n in drafted)


def test_bad_speculative_configurations_are_refused(tiny_model, smollm_tokenizer):
    from tiny_llm.testing.models import make_tiny_model as tiny

    small_vocab = tiny(vocab_size=512)
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        LLMEngine(tiny_model, smollm_tokenizer, speculative="draft",
                  draft_model=(small_vocab, smollm_tokenizer))
    with pytest.raises(ValueError, match="go together"):
        LLMEngine(tiny_model, smollm_tokenizer, speculative="draft")
    with pytest.raises(ValueError, match="needs kv_cache='paged'"):
        LLMEngine(tiny_model, smollm_tokenizer, kv_cache="dense", speculative="ngram")
    with pytest.raises(ValueError, match="speculative must be one of"):
        LLMEngine(tiny_model, smollm_tokenizer, speculative="yes")


def test_penalties_and_logprobs_decode_without_drafts_and_keep_their_tokens(repeater,
                                                                            smollm_tokenizer):
    """Penalties read the tokens before each position, logprobs are recorded token by
    token, a grammar's mask depends on the tokens before it: a verification's rows give
    none of these, so such requests decode without drafts, beside requests that draft, and
    get the tokens they get served alone."""
    prompts = repetitive_prompts(4, seed=3)
    params = [greedy(12), greedy(12, frequency_penalty=0.5), greedy(12, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=12, structured=StructuredOutput(
                  regex="[^0-9]{1,40}"))]
    engine = LLMEngine(repeater, smollm_tokenizer, num_pages=128, speculative="ngram")
    proposed = []
    propose = engine.core.spec.proposer.propose
    engine.core.spec.proposer.propose = lambda requests, k: (
        proposed.extend(r.params for r in requests) or propose(requests, k))
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.stats()["num_draft_tokens"] > 0  # the plain request drafted
    assert not any(p is params[1] or p is params[2] or p is params[3] for p in proposed)
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        alone = served_alone(repeater, smollm_tokenizer, prompt["prompt_token_ids"], p)[0]
        assert out.outputs[0].token_ids == alone
    assert len(outs[2].outputs[0].logprobs) == 12
