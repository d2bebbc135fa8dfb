"""The requests the server takes: each body read and checked once, into the engine's inputs.

``parse_request`` turns a chat or completions body into a ``ParsedRequest`` (the prompt, the
sampling parameters, the structured output, the tools in use); every field the server does
not honour is refused by name, and every 400 names its field (``APIError.param``). The
engine's own checks are the rules (``SamplingParams``, a message's role and content, the
prompt's tokens): their errors become 400s here, with the field they name. The server adds
OpenAI's own: the translation of its spellings, and a prompt plus ``max_tokens`` within
``max_model_len`` (``check_context_length``; the engine alone would stop at the limit).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from tiny_llm.engine import ContextLengthError, LLMEngine
from tiny_llm.models.tokenizer import check_text, strings_in
from tiny_llm.sampling import tool_calls
from tiny_llm.sampling.params import MAX_LOGPROBS, MAX_SAMPLES, InvalidParam, SamplingParams
from tiny_llm.sampling.tool_calls import ToolChoice
from tiny_llm.structured import KINDS, StructuredOutput


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


# ANCHOR: parse
class ToolUse(NamedTuple):
    """What a chat request's tools ask of it."""

    tools: list[dict[str, Any]] | None  # offered in the prompt (none under tool_choice none)
    parse: bool  # whether the output is read for calls
    grammar: StructuredOutput | None  # a required or named call's, else the response format
    max_calls: int | None  # 1 without parallel calls under auto: the output ends there
    calls_only: bool = False  # required or named: the grammar writes nothing but calls


@dataclass
class ParsedRequest:
    prompt: Any  # text, token ids or chat messages: what engine.add_request takes
    params: SamplingParams
    stream: bool
    include_usage: bool
    tool_use: ToolUse = ToolUse(None, False, None, None)  # what its tools ask of it
    grammar_param: str | None = None  # the field the output's grammar came from


# ANCHOR: request_fields
# The request fields, as this server treats them: every one is honoured, accepted only in
# a value that asks for nothing (the OpenAI client and others send such defaults), or
# refused with a 400 naming it. No field is ignored while it asks for something.
# OpenAI's, then vLLM's beyond them.
SAMPLING_FIELDS = ("temperature", "top_p", "seed", "stop", "presence_penalty",
                   "frequency_penalty", "logit_bias", "top_k", "min_p", "stop_token_ids",
                   "ignore_eos", "repetition_penalty", "min_tokens", "skip_special_tokens")
HONOURED = {
    "chat": {"model", "n", "max_tokens", "max_completion_tokens", "stream", "stream_options",
             "messages", "logprobs", "top_logprobs", "response_format", "structured_outputs",
             "tools", "tool_choice", "parallel_tool_calls", *SAMPLING_FIELDS},
    "completions": {"model", "n", "max_tokens", "max_completion_tokens", "stream",
                    "stream_options", "prompt", "logprobs", "response_format",
                    "structured_outputs", *SAMPLING_FIELDS},
}
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions' logprobs
NO_EFFECT = {"user"}  # an end user's id, for the caller's own bookkeeping
# Not supported (yet), so accepted only in a value that asks for nothing.
NEUTRAL_CHAT: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"), "store": (None, False), "metadata": (None, {}),
    "modalities": (None, ["text"]), "service_tier": (None, "auto", "default"),
    "prediction": (None,), "audio": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,),
}
NEUTRAL_COMPLETIONS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
}


def asks_nothing(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of the ``neutral`` ones (0 and 0.0 alike, not False)."""
    def same(a: Any, b: Any) -> bool:
        if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
            return a is b
        return a == b and (isinstance(a, (int, float)) == isinstance(b, (int, float)))

    return any(same(value, v) for v in neutral)


def check_fields(body: dict, chat: bool) -> None:
    """Refuse a field this endpoint does not know, or one that asks for what this server
    does not do, naming it."""
    endpoint = "chat" if chat else "completions"
    neutral = NEUTRAL_CHAT if chat else NEUTRAL_COMPLETIONS
    for name, value in body.items():
        if name in HONOURED[endpoint] or name in NO_EFFECT:
            continue
        if name not in neutral:
            raise APIError(400, f"unknown field {name!r} for /v1/{endpoint}"
                           f"{'/completions' if chat else ''}", param=name)
        if not asks_nothing(value, neutral[name]):
            raise APIError(400, f"{name} is not supported by this server, and is refused "
                           "rather than ignored: leave it out", param=name,
                           code="unsupported_field")
# ANCHOR_END: request_fields


def parse_request(body: Any, chat: bool, model_name: str,
                  tool_format: str | None = "hermes") -> ParsedRequest:
    """The request, checked; ``tool_format``: how the model writes tool calls
    (``tool_calls.format_of``; None: in no format this server reads)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_fields(body, chat)
    if body.get("model") not in (None, model_name):
        raise APIError(404, f"the model {body['model']!r} does not exist; this server serves "
                       f"{model_name!r}", param="model", code="model_not_found")
    n = 1 if body.get("n") is None else body["n"]  # null means the default, as in OpenAI's
    if type(n) is not int or not 1 <= n <= MAX_SAMPLES:
        raise APIError(400, f"n must be an integer in [1, {MAX_SAMPLES}]", param="n")
    prompt = chat_messages(body) if chat else completion_prompt(body)
    options = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:  # absent or null: the older name, then the default
        max_tokens = body.get("max_tokens")
    if max_tokens is None and not chat:
        max_tokens = 16  # OpenAI's default for completions
    fmt = structured_output(body)
    use = tool_use(body, tool_format, fmt) if chat else ToolUse(None, False, fmt, None)
    if use.parse:  # a format's tags may be special tokens (Llama's <|python_tag|>): kept
        options.setdefault("skip_special_tokens", False)
    structured = use.grammar
    grammar_param = "tools" if structured is not fmt else next(
        (name for name in ("structured_outputs", "response_format") if body.get(name)), None)
    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=requested_logprobs(body, chat),
                                structured=structured, n=n, **options)
    except InvalidParam as e:
        raise APIError(400, str(e), param=param_of(e, body)) from None
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e)) from None
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise APIError(400, "user must be a string", param="user")
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise APIError(400, "stream must be a boolean", param="stream")
    return ParsedRequest(prompt, params, stream, include_usage(body, stream), use, grammar_param)


def param_of(error: InvalidParam, body: dict) -> str:
    """The request field an engine's ``InvalidParam`` names: ``max_tokens`` is
    ``max_completion_tokens`` where the request gave that one."""
    if error.field == "max_tokens" and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return error.field


def include_usage(body: dict, stream: bool) -> bool:
    """``stream_options.include_usage``: a boolean (null: false), asked for only where the
    request is streamed."""
    options = body.get("stream_options")
    if options is None:
        return False
    wanted = options.get("include_usage") if isinstance(options, dict) else None
    if not isinstance(options, dict) or not set(options) <= {"include_usage"} or (
            wanted is not None and not isinstance(wanted, bool)):
        raise APIError(400, "stream_options must be an object whose only field is "
                       "include_usage, a boolean", param="stream_options")
    if wanted and not stream:
        raise APIError(400, "stream_options.include_usage needs stream: true",
                       param="stream_options")
    return bool(wanted)


# ANCHOR: offered_tools
def offered_tools(body: dict) -> tuple[list[dict[str, Any]] | None, ToolChoice, bool]:
    """The tools a chat request offers (checked), its tool choice and whether several calls
    may come at once."""
    tools = body.get("tools")
    try:
        tools = tool_calls.check_tools(tools) if tools else None
        for text in strings_in(tools):
            check_text("tools", text)
    except ValueError as e:
        raise APIError(400, str(e), param="tools") from None
    try:
        choice = tool_calls.chosen(body.get("tool_choice"), tools or [])
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    parallel = body.get("parallel_tool_calls")
    if parallel not in (None, True, False):
        raise APIError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    return tools, choice, parallel is not False


def tool_use(body: dict, tool_format: str | None, fmt: StructuredOutput | None) -> ToolUse:
    """What a chat request's tools ask of it, ``fmt`` its response format."""
    tools, choice, parallel = offered_tools(body)
    if choice.mode == "none":
        return ToolUse(None, False, fmt, None)
    if tool_format is None:
        raise APIError(400, "this model's chat template teaches a tool-call format this server "
                       "does not read (Hermes <tool_call> blocks or Llama's JSON object)",
                       param="tools")
    grammar = tool_calls.constraint(tools, choice, parallel, tool_format)
    if choice.mode != "auto" and fmt is not None:
        raise APIError(400, "a required or named tool_choice constrains the output to "
                       "tool calls; it cannot also follow a response format",
                       param="tool_choice")
    if choice.mode != "auto":
        return ToolUse(tools, True, grammar, None, calls_only=True)
    # auto: a strict tool's grammar, unless a response format is asked for (then a strict
    # tool's calls are checked as they are read)
    return ToolUse(tools, True, fmt or grammar, None if parallel else 1)
# ANCHOR_END: offered_tools


# ANCHOR: response_format
def structured_output(body: dict) -> StructuredOutput | None:
    """The grammar a request's output must match: OpenAI's ``response_format``
    (``json_schema``, ``json_object``; ``text`` asks for none) or vLLM's
    ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``)."""
    fmt, vllm = body.get("response_format"), body.get("structured_outputs")
    if isinstance(fmt, dict) and fmt.get("type") == "text":
        fmt = None  # asks for nothing
    if fmt is not None and vllm is not None:
        raise APIError(400, "give response_format or structured_outputs, not both",
                       param="structured_outputs")
    if vllm is not None:
        if not isinstance(vllm, dict):
            raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
        given = {k: v for k, v in vllm.items() if v is not None}  # clients send nulls
        unknown = sorted(set(given) - set(KINDS))
        if unknown:
            raise APIError(400, f"structured_outputs takes one of {', '.join(KINDS)}; this "
                           f"server does not do {', '.join(unknown)}", param="structured_outputs")
        try:
            return StructuredOutput(**given)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"structured_outputs: {e}", param="structured_outputs") from None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError(400, "response_format json_schema needs a json_schema object with a "
                           "'schema'", param="response_format")
        return StructuredOutput(json=spec["schema"])  # strict or not, the schema is enforced
    raise APIError(400, "response_format's type must be text, json_object or json_schema",
                   param="response_format")
# ANCHOR_END: response_format


def requested_logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's logprob record lists (None: no records): chat's
    ``logprobs`` (a bool) and ``top_logprobs``, or completions' ``logprobs`` (a count)."""
    if not chat:
        k = body.get("logprobs")
        if k is not None and (type(k) is not int or not 0 <= k <= MAX_COMPLETION_LOGPROBS):
            raise APIError(400, f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]",
                           param="logprobs")
        return k
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise APIError(400, "logprobs must be a boolean", param="logprobs")
    if top is not None and (type(top) is not int or not 0 <= top <= MAX_LOGPROBS):
        raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]",
                       param="top_logprobs")
    if top and not wanted:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


def chat_messages(body: dict) -> list[dict[str, Any]]:
    """The conversation in the engine's shape (``chat_message``)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    return [chat_message(i, m) for i, m in enumerate(messages)]


def chat_message(i: int, m: Any) -> dict[str, Any]:
    """Message ``i`` in the engine's shape: OpenAI's spellings translated (``developer`` is
    ``system``; text content parts are one string), a participant's ``name`` (the template
    reads it, as ``transformers`` passes it), an assistant turn's ``tool_calls`` and a tool
    result's ``tool_call_id``. Its role and content are the engine's to check (one rule, the
    engine's: its errors are 400s naming ``messages``)."""
    if not isinstance(m, dict):
        raise APIError(400, f"messages[{i}] must be an object with a role and a content",
                       param="messages")
    role = "system" if m.get("role") == "developer" else m.get("role")  # OpenAI's newer name
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise APIError(400, "only text content parts, each with a string 'text', are "
                           "supported", param="messages")
        content = "".join(p["text"] for p in content)
    message = {"role": role, "content": content}
    if role == "assistant" and m.get("tool_calls"):
        message["tool_calls"] = m["tool_calls"]  # checked with the conversation
    return message | message_ids(i, m, role)


def message_ids(i: int, m: dict, role: str) -> dict[str, str]:
    """Message ``i``'s ``name`` and, for a tool result, its ``tool_call_id``: strings
    (null: none), a name as OpenAI's rule has it (letters, digits, _ and -)."""
    ids = {}
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            raise APIError(400, f"messages[{i}].name must be a string of letters, digits, _ "
                           "or -", param="messages")
        ids["name"] = name
    call_id = m.get("tool_call_id")
    if role == "tool" and call_id is not None:
        if not isinstance(call_id, str):
            raise APIError(400, f"messages[{i}].tool_call_id must be a string",
                           param="messages")
        ids["tool_call_id"] = call_id
    return ids


def completion_prompt(body: dict) -> Any:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return {"prompt_token_ids": prompt}
    raise APIError(400, "prompt must be a string or a list of token ids (one prompt)",
                   param="prompt")


def prompt_param(prompt: Any) -> str:
    """The field a parsed prompt came from."""
    return "messages" if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) \
        else "prompt"


def check_context_length(engine: LLMEngine, prompt: Any, params: SamplingParams,
                         tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt's token ids (templated with the tools offered, and tokenized: call it off
    the event loop); raise when prompt + max_tokens exceed ``max_model_len``."""
    param = prompt_param(prompt)
    limit = engine.max_model_len
    try:
        ids = engine.tokenize(prompt, tools)
    except ContextLengthError as e:
        raise APIError(400, f"This model's maximum context length is {limit} tokens: {e}.",
                       param=param, code="context_length_exceeded") from None
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param=param) from None
    except RecursionError:  # the body parsed, but its messages or tools nest too deeply
        raise APIError(400, "the messages or tools nest too deeply", param=param) from None
    asked = len(ids) + (params.max_tokens or 0)
    if asked > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, "
                       f"you requested {asked} tokens ({len(ids)} in the prompt, "
                       f"{params.max_tokens or 0} for the completion).",
                       param=param, code="context_length_exceeded")
    return ids
# ANCHOR_END: parse
