"""The answers' shapes: completions and chat completions (whole, and as streamed chunks), their
choices, tool calls, logprobs and usage, and OpenAI's error body.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

from tiny_llm.models.tokenizer import IncrementalDetokenizer
from tiny_llm.sampling import tool_calls
from tiny_llm.sampling.sampler import (
    TokenLogprob,
)
from tiny_llm.sampling.tool_calls import JsonToolCallParser, ToolCall, ToolCallParser
from tiny_llm.serving.protocol import APIError, ToolUse


class TokenSpelling(NamedTuple):
    """How a logprob record spells a token: its text, and the bytes it stands for (a token
    that is part of a character has the text U+FFFD but bytes of its own)."""

    text: Callable[[int], str]
    bytes: Callable[[int], bytes]


class TokenTexts:
    """A choice's tokens as the text each adds to its output, and where that text begins
    in it: the detokenizer the engine spells the output with, fed the same tokens. A token
    that ends mid-character adds "" and the one that completes the character carries all
    of it, so the texts joined are the output and no offset drifts."""

    def __init__(self, detokenizer: IncrementalDetokenizer):
        self.detokenizer, self.offset = detokenizer, 0

    def read(self, tokens: list[int], last: bool) -> tuple[list[str], list[int]]:
        """The next ``tokens``' texts and offsets; ``last``: the output ends with them (a
        tail held back mid-character goes to the last one, as U+FFFD, as in the text)."""
        texts = [self.detokenizer.add(token) for token in tokens]
        if last and texts:
            texts[-1] += self.detokenizer.flush()
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return texts, offsets


class CompletionBodies:
    """``/v1/completions`` bodies and chunks; ``pieces`` makes a detokenizer of the
    request's output (None for chat, whose records spell tokens their own way)."""

    object = "text_completion"

    def __init__(self, request_id: str, model: str, spelling: TokenSpelling,
                 pieces: Callable[[], IncrementalDetokenizer] | None):
        self.id, self.model, self.created = f"cmpl-{request_id}", model, int(time.time())
        self.spelling, self.pieces = spelling, pieces
        self.texts: dict[int, TokenTexts] = {}  # per choice: its tokens' texts so far

    def envelope(self, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def first(self, index: int) -> dict[str, Any]:
        return self.chunk(index, "", None, None)

    def chunk(self, index: int, text: str, finish_reason: str | None,
              records: list[TokenLogprob] | None) -> dict[str, Any]:
        return self.envelope([self.choice(index, text, finish_reason, records)])

    def usage_chunk(self, usage: dict) -> dict[str, Any]:
        return self.envelope([], usage=usage)

    def choice(self, index: int, text: str, finish_reason: str | None,
               records: list[TokenLogprob] | None) -> dict[str, Any]:
        logprobs = self.logprobs(records, index, last=finish_reason is not None)
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def whole(self, choices: list[dict[str, Any]], usage: dict) -> dict[str, Any]:
        return self.envelope(choices, usage=usage)

    def has_all_calls(self, index: int, text: str | None = None) -> bool:
        """Whether choice ``index`` holds the most tool calls allowed: a completion holds
        none."""
        return False

    def logprobs(self, records: list[TokenLogprob] | None, index: int = 0,
                 last: bool = False) -> dict[str, Any] | None:
        """The legacy completions' shape: parallel lists, the alternatives as dicts. A
        token reads the text it adds to the output (``TokenTexts``), so ``text_offset``
        indexes the returned text; ``last``: these records end the output."""
        if records is None:
            return None
        if index not in self.texts:
            self.texts[index] = TokenTexts(self.pieces())
        tokens, offsets = self.texts[index].read([r.token for r in records], last)
        return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
                "top_logprobs": [{self.alternative(t): lp for t, lp in r.top}
                                 for r in records],
                "text_offset": offsets}

    def alternative(self, token: int) -> str:
        """An alternative's key: its text alone, or, for a token that is part of a
        character, its bytes as OpenAI's legacy API spells them (``bytes:\\xf0\\x9f``);
        such tokens all read U+FFFD, and would share one key."""
        data = self.spelling.bytes(token)
        try:
            return data.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class ChatBodies(CompletionBodies):
    """``/v1/chat/completions`` bodies and chunks; with ``tools``, each choice's text is
    read for tool calls (``ToolCallParser``)."""

    object = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, spelling: TokenSpelling,
                 tool_use: ToolUse | None = None, tool_format: str | None = None):
        super().__init__(request_id, model, spelling, pieces=None)
        self.id = f"chatcmpl-{request_id}"
        use = tool_use or ToolUse(None, False, None, None)
        self.tools = use.tools if use.parse else None  # read for calls: None, not read
        self.max_calls, self.tool_format = use.max_calls, tool_format
        # a call cut off by max_tokens is not content where the output is calls only
        self.calls_only = use.parse and use.calls_only
        self.parsers: dict[int, ToolCallParser | JsonToolCallParser] = {}  # per choice

    def parser(self, index: int) -> ToolCallParser | JsonToolCallParser:
        if index not in self.parsers:
            self.parsers[index] = tool_calls.parser(self.tools, self.tool_format,
                                                    self.max_calls)
        return self.parsers[index]

    def finish_reason(self, num_calls: int, reason: str | None) -> str | None:
        """A choice's finish reason, with its calls: "tool_calls" where the model stopped
        after them, or the server stopped it at the most calls allowed."""
        if not num_calls or reason is None:
            return reason
        all_calls = self.max_calls is not None and num_calls >= self.max_calls
        return "tool_calls" if reason == "stop" or all_calls else reason

    def has_all_calls(self, index: int, text: str | None = None) -> bool:
        """Whether choice ``index`` holds the most calls allowed (its request may stop);
        ``text``: its next text, for a choice that is not streamed."""
        if self.tools is None or self.max_calls is None:
            return False
        if text is not None:
            self.parser(index).feed(text)
        return self.parser(index).done

    def first(self, index: int) -> dict[str, Any]:
        # with tools, the content may never come (only calls): null until it does
        content = "" if self.tools is None else None
        return self.envelope([{"index": index, "delta": {"role": "assistant", "content": content},
                               "logprobs": None, "finish_reason": None}])

    def chunk(self, index: int, text: str, finish_reason: str | None,
              records: list[TokenLogprob] | None) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        calls: list[ToolCall] = []
        if self.tools is not None:
            parser = self.parser(index)
            first = parser.num_calls
            text, calls = parser.feed(text)
            if finish_reason is not None:
                rest, more = parser.finish()
                text, calls = text + rest, calls + more
            if self.calls_only:
                text = ""
            if calls:
                delta["tool_calls"] = [{"index": first + k, **c.as_openai()}
                                       for k, c in enumerate(calls)]
            finish_reason = self.finish_reason(parser.num_calls, finish_reason)
        if text:
            delta = {"content": text, **delta}
        return self.envelope([{"index": index, "delta": delta,
                               "logprobs": self.logprobs(records),
                               "finish_reason": finish_reason}])

    def choice(self, index: int, text: str, finish_reason: str | None,
               records: list[TokenLogprob] | None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools is not None:
            content, calls = tool_calls.parse(text, self.tools, self.tool_format, self.max_calls)
            if self.calls_only:
                message["content"], content = None, ""
            if calls:
                message = {"role": "assistant", "content": content if content.strip() else None,
                           "tool_calls": [c.as_openai() for c in calls]}
                finish_reason = self.finish_reason(len(calls), finish_reason)
        return {"index": index, "message": message,
                "logprobs": self.logprobs(records), "finish_reason": finish_reason}

    def whole(self, choices: list[dict[str, Any]], usage: dict) -> dict[str, Any]:
        return {**self.envelope(choices, usage=usage), "object": "chat.completion"}

    def logprobs(self, records: list[TokenLogprob] | None,
                 index: int = 0) -> dict[str, Any] | None:
        """The chat shape: one entry per token, its alternatives inside it."""
        if records is None:
            return None

        def entry(token: int, logprob: float) -> dict[str, Any]:
            return {"token": self.spelling.text(token), "logprob": logprob,
                    "bytes": list(self.spelling.bytes(token))}

        return {"content": [entry(r.token, r.logprob) | {"top_logprobs": [
            entry(t, lp) for t, lp in r.top]} for r in records], "refusal": None}


def error_response(error: APIError, headers: dict[str, str] | None = None):
    """The error as OpenAI shapes it; ``headers`` besides (a 405's ``Allow``). A body left
    unread (408, 413) closes the connection: what the client still sends is not read."""
    from starlette.responses import JSONResponse

    if error.status == 401:
        headers = {"WWW-Authenticate": "Bearer", **(headers or {})}
    if error.status in (408, 413):
        headers = {"Connection": "close", **(headers or {})}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (--max-body-bytes)",
                    code="request_too_large")
