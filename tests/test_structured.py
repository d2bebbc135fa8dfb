"""Structured outputs (``tiny_llm/structured.py``) inside continuous batching.

Oracles: ``jsonschema`` for JSON schemas, ``re.fullmatch`` for regular expressions, the
choices themselves, a parser of the test grammar's language; a constrained request served
alone for batch invariance; the model's own logits with the grammar's mask applied for
log-probabilities; an unconstrained run with the same seed for a step that failed.
"""

from __future__ import annotations

import json
import re

from tiny_llm.engine import LLMEngine
from tiny_llm.sampling.params import SamplingParams
from tiny_llm.sampling.sampler import token_logprob
from tiny_llm.structured import GrammarError, StructuredOutput
from tiny_llm.testing.runs import served_alone

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "pet": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
            "kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0,
                                                      "maximum": 8}},
            "required": ["kind"], "additionalProperties": False}]},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
# A tiny language: sums of numbers in parentheses, e.g. "(12+(3+4))".
LARK = 'start: expr\nexpr: "(" term ("+" term)* ")"\nterm: NUMBER | expr\nNUMBER: /[0-9]{1,2}/'
GBNF = 'root ::= "[" item ("," item)* "]"\nitem ::= [a-c]{1,3}'


@pytest.fixture(scope="module")
def engine(tiny_model, smollm_tokenizer):
    return LLMEngine(tiny_model, smollm_tokenizer, num_pages=512, max_num_seqs=16)


def texts(engine, specs, temperatures, max_tokens=160, prompt="Tell me"):
    params = [SamplingParams(temperature=t, seed=i, max_tokens=max_tokens, structured=spec)
              for i, (spec, t) in enumerate(zip(specs, temperatures, strict=True))]
    outs = engine.generate([prompt] * len(params), params, use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def balanced_sum(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if depth < 0:
            return False
    return depth == 0 and bool(re.fullmatch(r"[()+0-9]+", text))


@pytest.mark.task("9.1")
def test_the_mask_allows_exactly_the_tokens_that_begin_a_choice(engine, smollm_tokenizer):
    """At the start of a choice among words, a token is allowed exactly when its text begins
    one of them (the oracle decodes every token of the vocabulary); after "ma", exactly
    the tokens that continue "maybe" or "mango"."""
    choices = ["maybe", "mango", "no"]
    constraint = engine.inputs.grammars.constraint(StructuredOutput(choice=choices))
    texts = [smollm_tokenizer.decode([t]) for t in range(engine.model.config.vocab_size)]

    def starting(prefix: str) -> set[int]:
        return {t for t, text in enumerate(texts) if text and t not in smollm_tokenizer.
                eos_token_ids and any(c.startswith(prefix + text) for c in choices)}

    assert set(np.flatnonzero(constraint.allowed())) == starting("")
    for token in smollm_tokenizer.encode("ma", add_special_tokens=False):
        constraint.consume(token)
    assert set(np.flatnonzero(constraint.allowed())) == starting("ma")


@pytest.mark.task("9.2")
def test_every_output_under_a_json_schema_validates(engine):
    """24 requests in one batch at temperatures 0 to 1.5: each ends (stop, not length) with
    JSON that the schema accepts."""
    temps = [0.0, 0.5, 1.0, 1.5] * 6
    for text, finish in texts(engine, [StructuredOutput(json=SCHEMA)] * 24, temps):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.task("9.2")
@pytest.mark.parametrize("spec,check", [
    (StructuredOutput(regex=r"[0-9]{3}-[a-z]{2,4}"),
     lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    (StructuredOutput(choice=["yes", "no", "maybe later"]),
     lambda t: t in ("yes", "no", "maybe later")),
    (StructuredOutput(grammar=LARK), balanced_sum),
    (StructuredOutput(grammar=GBNF), lambda t: re.fullmatch(r"\[[a-c]{1,3}(,[a-c]{1,3})*\]", t)),
    (StructuredOutput(json_object=True), lambda t: isinstance(json.loads(t), dict)),
], ids=["regex", "choice", "lark", "gbnf", "json_object"])
def test_every_output_matches_its_grammar(engine, spec, check):
    temps = [0.0, 0.7, 1.0, 1.3] * 3
    for text, finish in texts(engine, [spec] * 12, temps, max_tokens=400):
        if spec.json_object and finish == "length":  # an object's strings may run on
            continue
        assert finish == "stop" and check(text), text


@pytest.mark.task("9.2")
def test_a_constrained_request_gets_its_tokens_alone_and_batched(engine, tiny_model,
                                                                 smollm_tokenizer):
    """Greedy, next to unconstrained requests and a request under another grammar: the
    tokens the request gets served alone, without the engine (``stream_generate``, which
    masks with the same grammar)."""
    spec = StructuredOutput(json=SCHEMA)
    prompts = ["Tell me", "A story", "Tell me", "Numbers"]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured=spec),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=60, structured=StructuredOutput(
                  grammar=LARK)),
              SamplingParams(temperature=0.9, seed=3, max_tokens=40)]
    batched = engine.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, batched, strict=True):
        alone = served_alone(tiny_model, smollm_tokenizer, engine.tokenize(prompt), p)[0]
        assert out.outputs[0].token_ids == alone


@pytest.mark.task("9.2")
@pytest.mark.parametrize("only_the_top", [dict(top_k=1), dict(top_p=1e-9), dict(min_p=1.0)],
                         ids=["top_k", "top_p", "min_p"])
def test_the_filters_read_the_masked_row(engine, only_the_top):
    """Top-k, top-p and min-p filter the row the grammar has masked: a sampled request whose
    filter keeps only the most likely token draws, at any temperature, the greedy
    constrained request's tokens (the grammar's best, never the model's forbidden one)."""
    spec = StructuredOutput(json=SCHEMA)
    want = texts(engine, [spec], [0.0], max_tokens=60)[0]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=60, structured=spec,
                             **only_the_top) for i, t in enumerate((0.5, 1.0, 1.5))]
    outs = engine.generate(["Tell me"] * 3, params, use_tqdm=False)
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs] == [want] * 3


@pytest.mark.task("9.2")
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_come_from_the_model_or_the_masked_distribution(tiny_model, smollm_tokenizer,
                                                                 mode):
    """A greedy request's log-probabilities and alternatives, recomputed position by
    position: the model's own logits with every token the grammar forbids removed, in both
    modes (raw_logprobs reads the row after the grammar's mask, as vLLM does, and before
    anything else; a greedy row has nothing else done to it), never a forbidden token."""
    spec = StructuredOutput(choice=["alpha", "beta", "gamma delta"])
    engine = LLMEngine(tiny_model, smollm_tokenizer, num_pages=64, logprobs_mode=mode)
    out = engine.generate(["Pick"], SamplingParams(temperature=0.0, max_tokens=10, logprobs=3,
                                                   structured=spec), use_tqdm=False)[0]
    o = out.outputs[0]
    grammars = engine.inputs.grammars
    matcher = grammars.constraint(spec)
    ids = engine.tokenize("Pick")
    for token, record in zip(o.token_ids, o.logprobs, strict=True):
        logits = np.array(_last_logits(tiny_model, ids)).astype(np.float32)
        allowed = matcher.allowed()
        masked = np.where(allowed, logits, -np.inf)
        assert token == int(np.argmax(masked))
        want = token_logprob(masked, token, 3)
        assert abs(record.logprob - want.logprob) < 1e-4
        assert [t for t, _ in record.top] == [t for t, _ in want.top]
        assert all(allowed[t] for t, _ in record.top)
        matcher.consume(token)
        ids = [*ids, token]
    assert o.text in ("alpha", "beta", "gamma delta")


def _last_logits(model, ids):
    from tiny_llm.step.dense_kv import DenseKVCache

    return model(mx.array(ids), mx.arange(len(ids)), DenseKVCache(model.config.num_hidden_layers),
                 mx.array([len(ids) - 1]))[0]


@pytest.mark.task("9.2")
def test_a_failed_step_rolls_the_matcher_back(engine, monkeypatch):
    """A step that fails after every sampler drew its token and advanced its matcher: the
    next step draws again from the restored generator and matcher, and the request's
    tokens are those of a run without the failure."""
    import tiny_llm.engine.runner as runner_module

    params = SamplingParams(temperature=1.0, seed=11, max_tokens=160,
                            structured=StructuredOutput(json=SCHEMA))
    want = engine.generate(["Tell me"], [params], use_tqdm=False)[0].outputs[0].token_ids
    real, calls = runner_module.sample_next_tokens, []

    def then_fail(*args):
        tokens = real(*args)
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("injected after sampling")
        return tokens

    monkeypatch.setattr(runner_module, "sample_next_tokens", then_fail)
    request_id = engine.add_request("Tell me", params)
    finished, failures = [], 0
    while engine.has_unfinished_requests():
        try:
            finished += [o for o in engine.step() if o.request_id == request_id and o.finished]
        except RuntimeError as e:
            assert "injected" in str(e)
            failures += 1
    assert failures == 1 and len(calls) > 5
    assert finished[0].outputs[0].token_ids == want


def test_a_grammar_that_does_not_compile_is_refused_at_admission(engine):
    before = len(engine.scheduler.waiting) + len(engine.scheduler.running)
    for spec in (StructuredOutput(json={"type": "strin"}), StructuredOutput(regex="(unclosed"),
                 StructuredOutput(grammar="start: undefined_rule"),
                 StructuredOutput(json="{not json")):
        with pytest.raises(GrammarError, match="does not compile"):
            engine.add_request("x", SamplingParams(structured=spec))
    assert len(engine.scheduler.waiting) + len(engine.scheduler.running) == before
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=StructuredOutput(regex="a"))


@pytest.mark.task("9.2")
def test_a_schemas_properties_come_in_its_order(engine):
    schema = {"type": "object", "properties": {"zeta": {"enum": [1, 2]}, "alpha": {
        "enum": ["x", "y"]}}, "required": ["zeta", "alpha"], "additionalProperties": False}
    for text, finish in texts(engine, [StructuredOutput(json=schema)] * 4, [0.0, 1.0] * 2):
        assert finish == "stop" and list(json.loads(text)) == ["zeta", "alpha"], text


@pytest.mark.task("9.2")
def test_schemas_that_differ_only_in_property_order_are_different_grammars(engine):
    """The cache of compiled grammars tells the two orders apart (the same properties, the
    same required list): in one batch, each schema's outputs come in its own order."""
    keys = ["left", "right"]
    orders = [keys, keys[::-1]]
    specs = [StructuredOutput(json={"type": "object", "properties": {
        k: {"enum": [1, 2]} for k in order}, "required": keys, "additionalProperties": False})
        for order in orders]
    outs = texts(engine, specs * 2, [0.0, 0.0, 1.0, 1.0])
    for (text, finish), order in zip(outs, orders * 2, strict=True):
        assert finish == "stop" and list(json.loads(text)) == order, text


@pytest.mark.task("9.2")
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
@pytest.mark.parametrize("only_the_top", [{}, dict(top_k=1)], ids=["unfiltered", "top_k"])
def test_logprob_alternatives_are_tokens_the_grammar_allows(tiny_model, smollm_tokenizer,
                                                            only_the_top, mode):
    """Asked for more alternatives than the grammar (and, processed, top-k) allow, a sampled
    request's record lists only tokens the grammar allows, of finite log-probability
    (JSON-serialisable); processed, only those that could have been drawn."""
    engine = LLMEngine(tiny_model, smollm_tokenizer, num_pages=64, logprobs_mode=mode)
    spec = StructuredOutput(choice=["yes", "no", "maybe"])
    out = engine.generate(["Pick"], SamplingParams(temperature=0.7, seed=2, max_tokens=5,
                                                   logprobs=8, structured=spec,
                                                   **only_the_top),
                          use_tqdm=False)[0].outputs[0]
    matcher = engine.inputs.grammars.constraint(spec)
    for token, record in zip(out.token_ids, out.logprobs, strict=True):
        allowed = matcher.allowed()
        assert record.top and all(allowed[t] and np.isfinite(lp) for t, lp in record.top)
        filtered = only_the_top and mode == "processed_logprobs"
        assert len(record.top) == (1 if filtered else min(8, np.count_nonzero(allowed)))
        matcher.consume(token)
    json.dumps([[r.logprob, r.top] for r in out.logprobs], allow_nan=False)


def test_the_end_token_after_a_complete_grammar_is_not_counted(engine, smollm_tokenizer):
    """A complete grammar takes its end token without keeping it: a rollback of the step
    that drew it must not undo a real token."""
    constraint = engine.inputs.grammars.constraint(StructuredOutput(choice=["yes"]))
    start = set(np.flatnonzero(constraint.allowed()))
    tokens = smollm_tokenizer.encode("yes", add_special_tokens=False)
    for token in tokens:
        constraint.consume(token)
    constraint.consume(smollm_tokenizer.eos_token_id)
    assert constraint.consumed == len(tokens)
    constraint.rollback(0)
    assert set(np.flatnonzero(constraint.allowed())) == start
