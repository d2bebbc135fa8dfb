"""Single-request generation over a dense KV cache: the model the course starts from.

One request, one ``DenseKVCache``: the first forward runs the whole prompt, every later
forward runs the one token just sampled. It shares ``Request`` (stop rules, streaming
text) and the sampler with the engine, so "a request served alone" means the same thing
here and in the engine's tests.
"""

from __future__ import annotations

from collections.abc import Iterator

from tiny_llm.models.model import Model
from tiny_llm.models.tokenizer import Tokenizer
from tiny_llm.sampling.params import SamplingParams
from tiny_llm.sampling.sampler import sample_next_tokens
from tiny_llm.step.dense_kv import DenseKVCache
from tiny_llm.step.request import Request, RequestOutput
from tiny_llm.structured import Grammars

import mlx.core as mx


# ANCHOR: stream_generate
def stream_generate(
    model: Model,
    tokenizer: Tokenizer,
    prompt_token_ids: list[int],
    params: SamplingParams,
    max_model_len: int | None = None,
) -> Iterator[RequestOutput]:
    max_model_len = max_model_len or model.config.max_position_embeddings
    constraint = None  # a structured output's matcher, as the engine gives one
    if params.structured is not None:
        constraint = Grammars(tokenizer, model.config.vocab_size).constraint(params.structured)
    req = Request(prompt_token_ids, params, tokenizer.detokenizer(params.skip_special_tokens),
                  tokenizer.eos_token_ids, max_model_len, constraint=constraint)
    cache = DenseKVCache(model.config.num_hidden_layers)
    start = 0  # tokens whose K/V is in the cache
    while not req.is_finished:
        end = req.num_tokens
        tokens = mx.array(req.token_ids_between(start, end), dtype=mx.int32)
        logits = model(tokens, mx.arange(start, end), cache, mx.array([end - start - 1]))
        start = end
        token = sample_next_tokens(logits, [req.sampler])[0]
        yield req.output([token], req.append_token(token))
# ANCHOR_END: stream_generate
