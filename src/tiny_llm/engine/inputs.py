"""Input processing: a prompt and its sampling parameters in, a checked ``Request`` out.

Everything a request can be refused for is checked here, before the engine changes
anything: the prompt's form (text, token ids, ``{"prompt_token_ids": ...}`` or chat
messages), its token ids against the vocabulary, its length against ``max_model_len`` and
the step budget, the parameters against the vocabulary, the longest the request may grow
against the whole KV pool (a request that could never finish, even alone, is refused now
rather than left waiting forever), and a structured output's grammar, compiled here.
"""

from __future__ import annotations

from typing import Any

from tiny_llm.engine.config import EngineConfig
from tiny_llm.models.tokenizer import Tokenizer, check_text, strings_in
from tiny_llm.sampling.params import InvalidParam, SamplingParams
from tiny_llm.sampling.tool_calls import check_tool_message, check_tools, template_messages
from tiny_llm.step.request import Request
from tiny_llm.structured import Grammars

import numpy as np
from jinja2.exceptions import TemplateError

Prompt = str | list[int] | dict[str, Any] | list[dict[str, Any]]

CHAT_ROLES = ("system", "user", "assistant", "tool")


class ContextLengthError(ValueError):
    """A prompt that leaves no room to generate within ``max_model_len``."""


class InputProcessor:
    """Turns prompts into requests for one engine: its tokenizer, vocabulary and limits."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, config: EngineConfig,
                 max_model_len: int, capacity_tokens: int | None):
        self.tokenizer, self.vocab_size, self.config = tokenizer, vocab_size, config
        self.max_model_len = max_model_len
        self.capacity_tokens = capacity_tokens  # the whole KV pool, None: unbounded
        self.grammars = Grammars(tokenizer, vocab_size)  # structured outputs' compiler

    def make_request(self, prompt: Prompt, params: SamplingParams | None,
                     request_id: str) -> Request:
        """A checked request; ValueError or TypeError, and nothing made, on bad input."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}"
                            + (" (use SamplingParams(**d))" if isinstance(params, dict) else ""))
        text, token_ids = self._tokenize(prompt)
        token_ids = self._check_prompt(token_ids)
        self._check_params(params, len(token_ids))
        constraint = None
        if params.structured is not None:  # compiled here, off the engine's steps
            constraint = self.grammars.constraint(params.structured)
        return Request(token_ids, params, self.tokenizer.detokenizer(params.skip_special_tokens),
                       self.tokenizer.eos_token_ids, self.max_model_len, request_id, text,
                       constraint)

    def tokenize(self, prompt: Prompt, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The token ids ``prompt`` would be served with (chat messages templated, with
        the ``tools`` offered)."""
        if tools is not None and not _is_chat(prompt):
            raise TypeError("tools are offered in a chat: the prompt must be chat messages")
        return self._check_prompt(self._tokenize(prompt, tools)[1])

    def _tokenize(self, prompt: Prompt, tools: list[dict[str, Any]] | None = None
                  ) -> tuple[str | None, list]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            check_text("the prompt", prompt)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if set(prompt) != {"prompt_token_ids"}:
                raise TypeError("a dict prompt is {'prompt_token_ids': [...]}, got keys "
                                f"{sorted(map(str, prompt))}")
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple):
                raise TypeError(
                    f"prompt_token_ids must be a list of ints, got {type(ids).__name__}"
                )
            return None, list(ids)
        if _is_chat(prompt):
            return None, self._encode_chat(prompt, tools)
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        hint = " (decode bytes to str first)" if isinstance(prompt, bytes | bytearray) else ""
        raise TypeError(
            "a prompt is a string, a list of token ids, {'prompt_token_ids': [...]}, "
            f"or a list of chat messages; got {type(prompt).__name__}{hint}"
        )

    def _encode_chat(self, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None) -> list[int]:
        for i, message in enumerate(messages):
            if not isinstance(message.get("role"), str):
                raise TypeError(f"message {i} 'role' must be a string, got "
                                f"{type(message.get('role')).__name__}")
            if message["role"] not in CHAT_ROLES:  # a role is markup: never free text
                raise ValueError(f"message {i} has role {message['role'][:40]!r}; a role "
                                 f"is one of {', '.join(CHAT_ROLES)}")
            calls_only = message["role"] == "assistant" and message.get("tool_calls")
            content = message.get("content")
            if not (isinstance(content, str) or (calls_only and content is None)):
                raise TypeError(f"message {i} 'content' must be a string, got "
                                f"{type(content).__name__}")
            check_tool_message(i, message)
            for key, value in message.items():
                for text in strings_in([key, value]):
                    check_text(f"message {i} {key!r}", text)
        if tools is not None:
            tools = check_tools(tools)
            for text in strings_in(tools):
                check_text("tools", text)
        messages, tools = template_messages(messages, tools,
                                            self.tokenizer.template_reads_tools)
        try:
            return self.tokenizer.encode_chat(messages, tools=tools)
        except TemplateError as e:  # malformed messages, or the template refused them
            raise ValueError(f"the chat template cannot render these messages: {e}") from e

    def _check_prompt(self, token_ids: list) -> list[int]:
        if not token_ids:
            raise ValueError("the prompt is empty")
        not_ints = [t for t in token_ids
                    if isinstance(t, bool) or not isinstance(t, int | np.integer)]
        if not_ints:
            raise TypeError(f"prompt token ids must be integers, got {not_ints[:5]}")
        token_ids = [int(t) for t in token_ids]
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        if len(token_ids) >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "which leaves no room to generate"
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and len(token_ids) > budget:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
                f"({budget}), and chunked prefill is off"
            )
        return token_ids

    def _check_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        vocab = self.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidParam("stop_token_ids", f"stop_token_ids out of the vocabulary "
                               f"[0, {vocab}): {bad[:5]}")
        bad = [t for t in params.logit_bias if t >= vocab]
        if bad:
            raise InvalidParam("logit_bias", f"logit_bias keys out of the vocabulary "
                               f"[0, {vocab}): {bad[:5]}")
        capacity = self.capacity_tokens
        longest = min(num_prompt_tokens + (params.max_tokens or self.max_model_len),
                      self.max_model_len)
        if capacity is not None and longest > capacity:
            raise InvalidParam(
                "max_tokens",
                f"the request may need {longest} tokens of KV cache (prompt "
                f"{num_prompt_tokens} + max_tokens) but the whole pool holds {capacity}; "
                "lower max_tokens or enlarge the pool (num_pages, kv_memory_bytes)"
            )


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)
