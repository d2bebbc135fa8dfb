"""Tree speculation in the engine: the tree's shape and its refusals, the rows' positions and
mask in a step, both proposers' trees, the move of accepted rows, and the engine. The tree
mask's reference and the rule over a tree are the chapter's tasks (6.4 and 6.5), tested
with the chapter's tests in test_speculative.py.

Oracles: the causal attention over each draft's own path, the draft model's own chain after
a node's path, and the engine without speculation (greedy tokens identical, alone, batched
and with preemption, with drafts accepted off the first branch so that accepted rows move).
"""

from __future__ import annotations

from dataclasses import replace

from tiny_llm import speculative
from tiny_llm.cli import build_parser, engine_options
from tiny_llm.day1_batching import DenseAttention
from tiny_llm.day4_paged_attention import check_geometry
from tiny_llm.engine import EngineConfig, LLMEngine
from tiny_llm.sampling.params import SamplingParams
from tiny_llm.speculative import NgramProposer, move_rows
from tiny_llm.step.batch import AttentionGeometry, Drafts, ScheduledChunk, StepBatch, TokenTree
from tiny_llm.step.dense_kv import causal_attention
from tiny_llm.step.request import SequenceState
from tiny_llm.testing.runs import greedy, tokens_of

import mlx.core as mx
import numpy as np
import pytest
from test_speculative import TREE, tree_drafts  # the chapter's tree (Tasks 6.4 and 6.5)

# ---------------------------------------------------------------------------------------
# The shape


@pytest.mark.device_independent
def test_a_tree_is_kept_breadth_first_with_its_parents():
    tree = TokenTree.parse([(1, 0), (0,), [1], (0, 0)])
    assert tree.paths == ((0,), (1,), (0, 0), (1, 0))
    assert (len(tree), tree.depth, tree.width, tree.is_chain) == (4, 2, 2, False)
    assert TokenTree.chain(3).paths == ((0,), (0, 0), (0, 0, 0)) and TokenTree.chain(3).is_chain
    assert TokenTree.parse(TREE).pruned(1).paths == ((0,), (1,), (2,))
    assert TokenTree.chain(2).pruned(0) is None


@pytest.mark.device_independent
@pytest.mark.parametrize(("paths", "message"), [
    ([], "non-empty list"),
    ("0,1", "non-empty list"),
    ([(0,), ()], r"\(\) is not a path"),
    ([(0,), (-1,)], r"\(-1,\) is not a path"),
    ([(0,), (True,)], "is not a path"),
    ([(0,), (0,)], r"names \(0,\) twice"),
    ([(0,), (1, 0)], r"\(1, 0\) has no parent \(1,\)"),
    ([(0,), (2,)], r"\(2,\) is child rank 2, but rank 1"),
    ([(i,) for i in range(65)], "65 nodes; at most 64"),
])
def test_a_malformed_tree_is_refused_by_name(paths, message):
    with pytest.raises(ValueError, match=message):
        TokenTree.parse(paths)


def test_the_engine_refuses_what_cannot_serve_a_tree(tiny_model, smollm_tokenizer):
    tree = dict(speculative="ngram", speculative_token_tree=[(0,), (1,)])
    EngineConfig(**{**tree, "speculative": "draft"}, draft_model="x")  # both proposers grow trees
    with pytest.raises(ValueError, match="needs speculative='ngram' or 'draft'"):
        EngineConfig(speculative_token_tree=[(0,)])
    with pytest.raises(ValueError, match="num_speculative_tokens=3, but .* has 2 nodes"):
        EngineConfig(**tree, num_speculative_tokens=3)
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(**tree, tensor_parallel_size=2)
    config = EngineConfig(**tree)
    assert config.speculative_token_tree == TokenTree(((0,), (1,)))
    assert config.num_speculative_tokens == 2
    for attention in ("page_walk", "tiled_walk"):  # walks in MLX ops: causal rows only
        with pytest.raises(ValueError, match=f"attention='{attention}' cannot attend over a tree"):
            LLMEngine(tiny_model, smollm_tokenizer, num_pages=16, attention=attention, **tree)
    geometry = AttentionGeometry(4, 2, 64, 16, mx.float32, mx.cpu, token_trees=True)
    with pytest.raises(ValueError, match="attention='dense' cannot attend over a tree"):
        DenseAttention.check(replace(geometry, page_size=None))
    check_geometry(geometry)  # the kernels serve trees, on a CPU and in Metal
    check_geometry(replace(geometry, device=mx.gpu))
    # A chain is a tree every attention serves; without a tree, a chain of the given length.
    LLMEngine(tiny_model, smollm_tokenizer, num_pages=16, attention="page_walk",
              speculative="ngram", speculative_token_tree=[(0,), (0, 0)])
    assert EngineConfig(num_speculative_tokens=3).speculative_token_tree == TokenTree.chain(3)


@pytest.mark.device_independent
def test_the_cli_reads_a_tree_as_a_python_literal(capsys):
    parse = build_parser().parse_args
    args = parse(["generate", "--prompt", "hi", "--speculative", "ngram",
                  "--speculative-token-tree", "[(0,), (1,), (0, 0)]"])
    assert engine_options(args)["speculative_token_tree"] == [(0,), (1,), (0, 0)]
    with pytest.raises(SystemExit):
        parse(["generate", "--prompt", "hi", "--speculative-token-tree", "[(0,"])
    assert "is not a list of paths of child ranks" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# The rows of a tree: positions and what each row sees


@pytest.mark.device_independent
def test_drafts_know_their_depths_and_ancestors():
    drafts = tree_drafts()
    assert drafts.depths == [1, 1, 1, 2, 2, 2, 2, 3, 3]
    assert drafts.ancestor_bits()[7] == 1 << 7 | 1 << 4 | 1 << 1  # (1, 0, 0): (1, 0), (1,)
    assert Drafts((5, 6, 7)).ancestor_bits() == [1, 3, 7] and Drafts((5, 6)).is_chain
    with pytest.raises(ValueError, match="do not name earlier drafts"):
        Drafts((5, 6), parents=(-1, 1))


def test_a_tree_chunk_takes_positions_by_depth_and_sees_only_its_path():
    """A request of 6 tokens verifying the tree beside a plain prefill chunk: each draft's
    position is its depth after the last token, and its row's attention over the sequence
    equals the dense attention over the committed keys and its own path alone."""
    seq = SequenceState(list(range(1, 7)))
    seq.num_computed_tokens = 5
    other = SequenceState(list(range(50, 54)))
    drafts = tree_drafts()
    chunks = [ScheduledChunk(other, 0, 4), ScheduledChunk(seq, 5, 6 + len(drafts), drafts)]
    batch = StepBatch.build(chunks, kv=None)
    assert np.array(batch.positions).tolist() == [0, 1, 2, 3, 5, *(5 + d for d in drafts.depths)]
    tree = batch.tree
    assert tree is not None and StepBatch.build(chunks[:1], kv=None).tree is None
    num_keys = 6 + len(drafts)
    visible = tree.visible(range(4, 4 + 1 + len(drafts)), num_keys)
    assert tree.visible(range(0, 4), 4).tolist() == np.tril(np.ones((4, 4), bool)).tolist()
    rng = np.random.default_rng(0)
    q = mx.array(rng.normal(size=(1 + len(drafts), 4, 8)).astype(np.float32))
    k, v = (mx.array(rng.normal(size=(num_keys, 2, 8)).astype(np.float32)) for _ in "kv")
    out = causal_attention(q, k, v, 0.3, num_keys - q.shape[0], mx.array(visible))
    for i in range(len(drafts)):  # draft i: row 1 + i, key 6 + i
        path, node = [], i
        while node >= 0:
            path.insert(0, 6 + node)
            node = drafts.parent(node)
        keys = mx.array(list(range(6)) + path)
        alone = causal_attention(q[1 + i : 2 + i], k[keys], v[keys], 0.3, len(path) + 5)
        assert mx.allclose(out[1 + i], alone[0], atol=1e-5), i


@pytest.mark.device_independent
def test_moving_rows_copies_them_in_every_layer_and_nothing_else():
    """Accepted rows move from the rows a tree left them in to their depth's rows: every
    layer's K and V, read before any is written (a row may be both a source and a target)."""
    from types import SimpleNamespace

    from tiny_llm.day3_paged_kv import PagedKVStorage, slots_for

    config = SimpleNamespace(num_hidden_layers=3, num_key_value_heads=2, head_dim=8)
    kv = PagedKVStorage(config, num_pages=8, page_size=4, enable_prefix_caching=False,
                        dtype=mx.float32)
    seq = SequenceState(list(range(14)))
    assert kv.allocate(seq, 14)
    slots = mx.array(slots_for(kv.table(seq), 0, 14, 4), dtype=mx.int32)
    rng = np.random.default_rng(0)
    for layer in range(3):
        kv.pool.write(layer, slots, *(mx.array(rng.normal(size=(14, 2, 8)).astype(np.float32))
                                      for _ in "kv"))
    before = [[np.array(a) for a in kv.pool.gather(layer, slots)] for layer in range(3)]
    move_rows(kv, seq, [9, 12, 13], [8, 9, 10])  # 9 is read, then written
    for layer in range(3):
        after = [np.array(a) for a in kv.pool.gather(layer, slots)]
        for old, new in zip(before[layer], after, strict=True):
            expected = old.copy()
            expected[[8, 9, 10]] = old[[9, 12, 13]]
            assert np.array_equal(new, expected), layer


# ---------------------------------------------------------------------------------------
# Prompt lookup's trees


@pytest.mark.device_independent
def test_prompt_lookup_puts_other_continuations_on_the_first_level():
    ngram = NgramProposer()
    tokens = [5, 9, 9, 9, 9, 7, 9, 3, 9]
    assert ngram.continuations(tokens, 3, 1) == [[3, 9]]  # lookup's: the latest occurrence
    assert ngram.continuations(tokens, 3, 3) == [[3, 9], [7, 9, 3], [9, 7, 9]]
    request = SequenceState(tokens)
    drafts, = ngram.propose([request], [TokenTree.parse(TREE)])
    # (0,)=3 (0,0)=9; (1,)=7 (1,0)=9 (1,0,0)=3; (2,)=9 (2,0)=7 (2,0,0)=9; no (1, 1)
    assert drafts.tokens == (3, 7, 9, 9, 9, 7, 3, 9)
    assert drafts.parents == (-1, -1, -1, 0, 1, 2, 4, 5)
    chain, = ngram.propose([request], [TokenTree.chain(3)])
    assert chain.tokens == (3, 9) and chain.is_chain


# ---------------------------------------------------------------------------------------
# In the engine


class KnowingProposer:
    """Proposes trees whose right token (the target's greedy continuation, known from a run
    without speculation) sits at child rank ``right_rank`` of each node on the right path,
    with wrong tokens at the other ranks: every verification accepts off the first branch,
    so accepted rows must move."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], right_rank: int):
        self.expected, self.right_rank = expected, right_rank

    def propose(self, requests, trees):
        out = []
        for request, tree in zip(requests, trees, strict=True):
            prompt = tuple(request.prompt_token_ids)
            future = self.expected[prompt][len(request.output_token_ids):]
            tokens, index = [], {}
            for path in tree.paths:
                on_path = all(r == self.right_rank for r in path[:-1])
                depth = len(path)
                if depth > len(future):
                    continue
                right = future[depth - 1]
                token = right if on_path and path[-1] == self.right_rank else (right + 1 + path[-1])
                index[path] = len(tokens)
                tokens.append(token)
            parents = tuple(index[p[:-1]] if len(p) > 1 else -1 for p in index)
            out.append(Drafts(tuple(tokens), parents=parents))
        return out

    def rewind(self, request):
        pass

    def release(self, request):
        pass


SCENARIOS = {
    "alone": dict(n=1, engine=dict(num_pages=128)),
    "batch": dict(n=5, engine=dict(num_pages=128, max_num_batched_tokens=48)),
    "preemption": dict(n=5, engine=dict(num_pages=10, page_size=8, max_model_len=64,
                                        enable_prefix_caching=False)),
}


@pytest.mark.parametrize("attention", ["gather", "vector", "flash"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_are_identical_with_a_tree(tiny_model, smollm_tokenizer, scenario,
                                                 attention, monkeypatch):
    from tiny_llm.testing.runs import random_prompts

    spec = SCENARIOS[scenario]
    tree = [(0,), (1,), (0, 0), (1, 0), (1, 1), (1, 1, 0), (1, 1, 1)]
    options = dict(attention=attention, speculative="ngram", speculative_token_tree=tree,
                   speculative_max_batch=8, **spec["engine"])
    prompts = [{"prompt_token_ids": p} for p in random_prompts(spec["n"], seed=7, hi=20)]
    params = [greedy(14)] * len(prompts)
    expected = tokens_of(LLMEngine(tiny_model, smollm_tokenizer, **spec["engine"]), prompts,
                         params)
    known = {tuple(p["prompt_token_ids"]): e for p, e in zip(prompts, expected, strict=True)}
    engine = LLMEngine(tiny_model, smollm_tokenizer, **options)
    engine.core.spec.proposer = KnowingProposer(known, right_rank=1)
    moved = []
    monkeypatch.setattr(speculative, "move_rows", lambda kv, request, src, dst: (
        moved.append(len(src)), move_rows(kv, request, src, dst)))
    assert tokens_of(engine, prompts, params) == expected
    stats = engine.stats()
    assert stats["num_accepted_tokens"] > 0 and moved, "no accepted row moved"
    # Every rank-0 child was tried and rejected; every kept draft was a rank-1 child.
    assert stats["rank_accepts"][:2] == [0, stats["num_accepted_tokens"]]
    assert stats["rank_tries"][0] >= stats["rank_tries"][1] >= stats["num_accepted_tokens"]
    assert sum(n for _, n in stats["verified_shapes"]) == stats["num_verify_steps"]
    assert stats["num_free_pages"] == stats["num_pages"]
    if scenario == "preemption":
        assert stats["num_preemptions"] > 0
    engine.kv.blocks.check_invariants()


DRAFT_TREE = [(0,), (1,), (0, 0), (1, 0), (1, 1), (0, 0, 0), (1, 0, 0)]


def draft_engine(target, draft, tokenizer, **options):
    return LLMEngine(target, tokenizer, speculative="draft", draft_model=(draft, tokenizer),
                     speculative_token_tree=DRAFT_TREE, **options)


def test_the_draft_model_grows_each_node_from_its_own_path(tiny_model, other_tiny_model,
                                                           smollm_tokenizer):
    """A greedy request's tree from the draft model, one forward per depth: a node's
    children are the draft's top-ranked tokens after the node's own path, whichever nodes
    shared its forward. Oracle: the draft's chain after the request's tokens followed by
    the path, proposed for a request alone."""
    engine = draft_engine(tiny_model, other_tiny_model, smollm_tokenizer, num_pages=64)
    proposer = engine.core.spec.proposer
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]

    def request(tokens: list[int]):
        return engine.inputs.make_request({"prompt_token_ids": tokens}, greedy(8), "r")

    drafts, = proposer.propose([request(prompt)], [TokenTree.parse(DRAFT_TREE)])
    assert drafts.parents == (-1, -1, 0, 1, 1, 2, 3)
    paths = TokenTree.parse(DRAFT_TREE).paths
    for i, path in enumerate(paths):
        before, node = [], drafts.parent(i)
        while node >= 0:
            before.insert(0, drafts.tokens[node])
            node = drafts.parent(node)
        ranks = path[-1] + 1  # the draft's top tokens after the path: a fresh proposer's
        alone = draft_engine(tiny_model, other_tiny_model, smollm_tokenizer, num_pages=64)
        wide = TokenTree([(r,) for r in range(ranks)])
        top, = alone.core.spec.proposer.propose([request(prompt + before)], [wide])
        assert drafts.tokens[i] == top.tokens[path[-1]], path
    assert len(set(drafts.tokens[:2])) == 2  # siblings: the two best, not one token twice


@pytest.mark.device_independent
def test_a_greedy_nodes_children_are_the_best_scores_in_order():
    from tiny_llm.speculative import _top

    rng = np.random.default_rng(1)
    for _ in range(50):
        scores = rng.normal(size=300).astype(np.float32)
        scores[rng.integers(300, size=20)] = scores.max()  # ties at the top
        for n in (1, 2, 5):
            assert _top(scores, n) == np.argsort(-scores, kind="stable")[:n].tolist()


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_are_identical_with_a_draft_models_tree(tiny_model, other_tiny_model,
                                                              smollm_tokenizer, scenario):
    from tiny_llm.testing.runs import random_prompts

    spec = SCENARIOS[scenario]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(spec["n"], seed=9, hi=20)]
    params = [greedy(12)] * len(prompts)
    expected = tokens_of(LLMEngine(tiny_model, smollm_tokenizer, **spec["engine"]), prompts,
                         params)
    engine = draft_engine(tiny_model, other_tiny_model, smollm_tokenizer, **spec["engine"],
                          speculative_max_batch=8)
    assert tokens_of(engine, prompts, params) == expected
    stats = engine.stats()
    # A noisy draft: its first choice is kept sometimes, and its second now and then.
    assert stats["rank_accepts"][0] > 0 and stats["rank_tries"][1] > 0
    assert stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert stats["num_free_pages"] == stats["num_pages"]
    if scenario == "preemption":
        assert stats["num_preemptions"] > 0
    engine.kv.blocks.check_invariants()
    engine.core.spec.proposer.kv.blocks.check_invariants()


def test_a_sampled_draft_tree_draws_each_sibling_and_is_reproducible(tiny_model,
                                                                     smollm_tokenizer):
    """Sampled requests: a node's siblings are draws of their own from the draft's
    distribution after it (with replacement), recorded as that distribution; a seeded run
    gives the same tokens twice."""
    engine = draft_engine(tiny_model, tiny_model, smollm_tokenizer, num_pages=64)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)
    request = engine.inputs.make_request({"prompt_token_ids": [5, 6, 7, 8]}, params, "s")
    drafts, = engine.core.spec.proposer.propose([request], [TokenTree.parse(DRAFT_TREE)])
    assert drafts.probs.shape == (len(DRAFT_TREE), tiny_model.config.vocab_size)
    for i in range(len(drafts)):
        siblings = [j for j in range(len(drafts)) if drafts.parent(j) == drafts.parent(i)]
        assert all(np.array_equal(drafts.probs[j], drafts.probs[i]) for j in siblings)
        assert drafts.probs[i][drafts.tokens[i]] > 0
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 9, 4]}]
    seeded = [SamplingParams(temperature=0.8, seed=10 + i, max_tokens=10, ignore_eos=True)
              for i in range(2)]
    runs = [tokens_of(draft_engine(tiny_model, tiny_model, smollm_tokenizer, num_pages=64),
                      prompts, seeded) for _ in range(2)]
    assert runs[0] == runs[1] and all(len(t) == 10 for t in runs[0])


def test_prompt_lookup_trees_keep_greedy_tokens(smollm_tokenizer):
    """The n-gram proposer's trees through the engine: the repeater repeats the last token,
    which an older occurrence than the latest predicts (rank 2 of the first level)."""
    from tiny_llm.testing.models import make_repeater_model

    repeater_model = make_repeater_model()
    prompt = {"prompt_token_ids": [5, 9, 9, 9, 9, 7, 9, 3, 9]}
    expected = tokens_of(LLMEngine(repeater_model, smollm_tokenizer, num_pages=64),
                         [prompt], [greedy(10)])
    engine = LLMEngine(repeater_model, smollm_tokenizer, num_pages=64, attention="gather",
                       speculative="ngram", speculative_token_tree=TREE)
    assert tokens_of(engine, [prompt], [greedy(10)]) == expected
    assert engine.stats()["num_accepted_tokens"] > 0
