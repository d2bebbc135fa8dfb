"""Tool calls: functions a chat request offers the model, and the calls it writes back.

A request lists ``tools`` (OpenAI's shape: ``{"type": "function", "function": {"name",
"description", "parameters"}}``, the parameters a JSON schema). The prompt shows them to the
model in one of two ways:

- the model's own chat template, when it reads ``tools`` (Qwen's, Llama's, Hermes-style
  ones): the tools, and earlier turns' calls and results, go to the template as
  ``transformers`` passes them (a call's arguments as an object, results as ``tool``
  messages);
- otherwise (SmolLM2's template knows only role and content) a system message lists the
  tools and the format, earlier calls are written in that format and results become user
  turns, so that any chat model can be offered tools.

The model answers in the format its template teaches (``format_of``). Hermes blocks (Qwen's
templates, and the turns written for a template without tools), one call per block::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``ToolCallParser`` splits such an output into content and calls as it streams: text is
content unless it may begin a block (held back until it is clear), a block becomes a call
when it closes on a JSON object naming an offered tool, and anything else in a block stays
content, as written. Llama's templates teach one JSON object as the whole answer,
``{"name": ..., "parameters": {...}}`` (``JsonToolCallParser``: an answer that begins with
``{`` waits for its end). A call of a ``strict`` tool is a call only if its arguments
validate against the tool's parameters (``jsonschema``); otherwise it stays content (and
under ``auto`` in Hermes blocks, a grammar holds it to the schema as it is written).

``tool_choice`` decides what is enforced: ``none`` parses nothing, ``auto`` parses what the
model chose to write, ``required`` and a named function constrain the output to calls
(``constraint``: a grammar over the tools' own schemas, the structured outputs' machinery),
so a required call is always a valid one.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, NamedTuple

from tiny_llm.structured import JSON_LAYOUT, StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1 may begin a call with it
CHOICES = ("none", "auto", "required")


def format_of(chat_template: str | None, template_reads_tools: bool) -> str | None:
    """The format a model writes its calls in, read from its chat template: Hermes blocks
    where the template names them or does not read tools (the turns then teach them),
    Llama's JSON object where it teaches that; None for a template that reads tools and
    teaches a format this module does not read."""
    if not template_reads_tools or OPEN in chat_template:
        return "hermes"
    if PYTHON_TAG in chat_template or '"parameters"' in chat_template:
        return "json"
    return None


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI's API carries it
    id: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The tools as OpenAI's API gives them, checked: a list of functions with distinct
    names, each one's parameters a JSON schema object (absent: no parameters)."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {...}}")
    names: set[str] = set()
    checked = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(function, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or \
                not all(c.isalnum() or c in "_-" for c in name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -")
        if name in names:
            raise ValueError(f"tools[{i}]: two tools are named {name!r}")
        names.add(name)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"tools[{i}].function.description must be a string")
        strict = function.get("strict")
        if strict not in (None, True, False):
            raise ValueError(f"tools[{i}].function.strict must be a boolean")
        _check_schema(i, parameters)  # strict or not, whatever the tool_choice
        checked.append({"type": "function", "function": {
            "name": name, **({"description": description} if description else {}),
            "parameters": parameters, **({"strict": True} if strict else {})}})
    return checked


def _check_schema(i: int, schema: dict[str, Any]) -> None:
    """A tool's parameters: a JSON schema its calls can be checked against (a strict
    tool's calls are; a grammar holds a required call to it)."""
    from jsonschema import Draft202012Validator, SchemaError
    from referencing.exceptions import Unresolvable

    try:
        Draft202012Validator.check_schema(schema)
        Draft202012Validator(schema).is_valid({})  # its references resolve
    except SchemaError as e:
        raise ValueError(f"tools[{i}].function.parameters is not a JSON schema: "
                         f"{e.message}") from None
    except Unresolvable as e:
        raise ValueError(f"tools[{i}].function.parameters refers to what it does not "
                         f"hold: {e}") from None
    except RecursionError:
        raise ValueError(f"tools[{i}].function.parameters nests too deeply") from None


def _valid(validator: Any, arguments: dict[str, Any]) -> bool:
    from referencing.exceptions import Unresolvable

    try:
        return validator.is_valid(arguments)
    except (Unresolvable, RecursionError):  # arguments the schema cannot judge: no call
        return False


class ToolChoice(NamedTuple):
    mode: str  # none, auto, required, or named
    name: str | None = None  # named: the function that must be called


def chosen(tool_choice: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    """``tool_choice`` as OpenAI's API gives it, checked against the tools."""
    if not tools and tool_choice in (None, "none", "auto"):
        return ToolChoice("none")  # nothing to call (clients send these as defaults)
    if tool_choice is None:
        return ToolChoice("auto")
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(CHOICES)} or "
                             "{'type': 'function', 'function': {'name': ...}}")
        if tool_choice == "required" and not tools:
            raise ValueError("tool_choice 'required' needs tools")
        return ToolChoice(tool_choice)
    named = isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and \
        isinstance(tool_choice.get("function"), dict)
    if not named:
        raise ValueError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}")
    name = tool_choice["function"].get("name")
    if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    return ToolChoice("named", name)


# ANCHOR: constraint
def constraint(tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool,
               fmt: str = "hermes") -> StructuredOutput | None:
    """The grammar a choice holds the output to. ``required`` or named: one call (for
    ``required`` in Hermes blocks with ``parallel``, one or more, a line apart) whose name
    is an offered tool's (the named one) and whose arguments match that tool's parameters.
    ``auto`` with a ``strict`` tool, in Hermes blocks: any text without the opening tag, or
    text up to the tag and then calls as above (a strict tool's arguments held to its
    schema, another's to any object). None otherwise: the model chooses."""
    strict = any(t["function"].get("strict") for t in tools)
    if choice.mode == "none" or choice.mode == "auto" and not (strict and fmt == "hermes"):
        return None
    offered = [t["function"] for t in tools if choice.mode in ("required", "auto")
               or t["function"]["name"] == choice.name]
    key = "arguments" if fmt == "hermes" else "parameters"
    call = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": f["name"]},
        key: f["parameters"] if choice.mode != "auto" or f.get("strict") else {"type": "object"}},
        "required": ["name", key], "additionalProperties": False} for f in offered],
        "x-guidance": JSON_LAYOUT}
    if fmt == "json":  # the whole answer is the call
        return StructuredOutput(json=call)
    more = ' ("\\n" call)*' if parallel and choice.mode != "named" else ""
    rules = [f"start: call{more}"]
    if choice.mode == "auto":  # text without the tag, or text up to it (lazy) and calls
        rules = [f'start: TEXT | lead "\\n" body {json.dumps(chr(10) + CLOSE)}{more}',
                 f"TEXT: /(?s:.*)/ & ~/(?s:.*{OPEN}.*)/",
                 f"lead[stop={json.dumps(OPEN)}]: /(?s:.*)/"]
    rules += [f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}",
              f"body: %json {json.dumps(call)}"]
    return StructuredOutput(grammar="\n".join(rules) + "\n")
# ANCHOR_END: constraint


def template_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      template_reads_tools: bool
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation and tools to render: as they are for a template that reads tools
    (a call's arguments parsed to an object, as ``transformers`` expects), or written into
    plain turns for one that does not."""
    if template_reads_tools:
        return [_with_parsed_arguments(m) for m in messages], tools or None
    plain = [_as_plain_turn(m) for m in messages]
    if not tools:
        return plain, None
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    offer = (f"You can call functions. They are listed, one JSON object per line, between "
             f"<tools> and </tools>:\n<tools>\n{listing}\n</tools>\nTo call one, answer with "
             f'its name and arguments as JSON inside {OPEN}{CLOSE} tags, one call per '
             f'block:\n{OPEN}\n{{"name": "<name>", "arguments": {{<arguments>}}}}\n{CLOSE}\n'
             "The results come back inside <tool_response></tool_response> tags.")
    if plain and plain[0]["role"] == "system":
        return [{**plain[0], "content": f"{plain[0]['content']}\n\n{offer}"}, *plain[1:]], None
    return [{"role": "system", "content": offer}, *plain], None


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": _arguments_object(
        c["function"]["arguments"])}} for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _as_plain_turn(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user",
                "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    if message["role"] == "assistant" and message.get("tool_calls"):
        blocks = [_block(c["function"]["name"], _arguments_object(c["function"]["arguments"]))
                  for c in message["tool_calls"]]
        text = "\n".join([message["content"], *blocks] if message.get("content") else blocks)
        return {"role": "assistant", "content": text}
    return message


def _block(name: str, arguments: dict[str, Any]) -> str:
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{call}\n{CLOSE}"


def _arguments_object(arguments: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as e:
        raise ValueError(f"a tool call's arguments are not JSON: {e}") from None
    except (ValueError, RecursionError):
        raise ValueError("a tool call's arguments are JSON this server will not read "
                         "(nested too deeply, or a number too long)") from None
    if not isinstance(value, dict):
        raise ValueError("a tool call's arguments must be a JSON object")
    return value


def check_tool_message(i: int, message: dict[str, Any]) -> None:
    """A ``tool`` result or an assistant turn's ``tool_calls``, in the engine's shape."""
    calls = message.get("tool_calls")
    if calls is None:
        return
    if message["role"] != "assistant":
        raise ValueError(f"message {i}: only an assistant message has tool_calls")
    if not isinstance(calls, list) or not calls:
        raise TypeError(f"message {i} tool_calls must be a non-empty list")
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or \
                not isinstance(function.get("arguments"), str | dict):
            raise TypeError(f"message {i}: a tool call is {{'id': ..., 'type': 'function', "
                            "'function': {'name': str, 'arguments': str}}")
        _arguments_object(function["arguments"])


# ANCHOR: parser
class ToolCallParser:
    """Splits a model's output into content and tool calls, piece by piece as it streams.

    ``feed`` takes the next text and returns the content that is now certain and the calls
    that closed; ``finish`` returns what was held back. Fed whole or in any pieces, an
    output gives the same content and calls. Whitespace at the start and between calls
    waits: it is content only if text, not a call, follows it. With ``max_calls``, the
    output ends at that call's end (what follows is dropped: ``done``)."""

    def __init__(self, tools: list[dict[str, Any]], max_calls: int | None = None):
        self.reader = CallReader(tools)
        self.max_calls = max_calls
        self.pending = ""  # text not yet looked at: a possible opening tag, or a block
        self.in_block = False
        self.gap = ""  # whitespace held since the start or the last call
        self.at_boundary = True  # nothing but that whitespace since the start or a call
        self.num_calls = 0

    @property
    def done(self) -> bool:
        """Whether it holds the most calls allowed."""
        return self.max_calls is not None and self.num_calls >= self.max_calls

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while not self.done:
            if self.in_block:
                end = _block_end(self.pending)
                if end < 0:
                    break  # the block goes on
                self._close(self.pending[:end], True, content, calls)
                self.pending = self.pending[end + len(CLOSE):]
                continue
            start = self.pending.find(OPEN)
            before = self.pending[:start] if start >= 0 else \
                self.pending[:len(self.pending) - _partial_tag(self.pending)]
            self._text(before, content)
            if start < 0:  # the rest may begin a tag
                self.pending = self.pending[len(before):]
                break
            self.pending, self.in_block = self.pending[start + len(OPEN):], True
        if self.done:
            self.pending = ""
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest: an unclosed block is a call if it holds a whole call (the output
        stopped at its closing tag), content otherwise; one whose closing tag a quote that
        never closed had hidden ends at that tag, and what follows is read again."""
        content: list[str] = []
        calls: list[ToolCall] = []
        while self.in_block and CLOSE in self.pending and self.reader.call(self.pending) is None \
                and not self.done:
            # a quote that never closed hid the block's closing tag: the block ends there
            at = self.pending.index(CLOSE)
            body, rest, self.pending = self.pending[:at], self.pending[at + len(CLOSE):], ""
            self._close(body, True, content, calls)
            more, found = self.feed(rest)
            content.append(more)
            calls += found
        if self.done:
            pass  # what came after the last call allowed is not the answer's
        elif self.in_block:
            self._close(self.pending, False, content, calls)
        else:
            self._text(self.pending, content)
        if not self.num_calls:  # no call: the held whitespace was the answer's
            content.append(self.gap)
        self.pending, self.in_block, self.gap = "", False, ""
        return "".join(content), calls

    def _text(self, text: str, content: list[str]) -> None:
        if self.at_boundary and not text.strip():
            self.gap += text  # content only if text follows
            return
        content.append(self.gap + text)
        self.gap, self.at_boundary = "", False

    def _close(self, body: str, closed: bool, content: list[str],
               calls: list[ToolCall]) -> None:
        self.in_block = False
        call = self.reader.call(body)
        if call is None:  # not a call: the block stays text, as the model wrote it
            self._text(OPEN + body + (CLOSE if closed else ""), content)
            return
        calls.append(call)
        self.num_calls += 1
        self.gap, self.at_boundary = "", True
# ANCHOR_END: parser


class JsonToolCallParser:
    """Llama's format: a call is the whole answer, one JSON object naming a tool (after
    ``<|python_tag|>``, which Llama 3.1 may write first). An answer that begins with ``{``
    is held to its end; any other streams as content."""

    def __init__(self, tools: list[dict[str, Any]], max_calls: int | None = None):
        self.reader = CallReader(tools)
        self.max_calls = max_calls
        self.pending = ""
        self.holding: bool | None = None  # undecided until the first character past the tag
        self.num_calls = 0

    @property
    def done(self) -> bool:
        """Whether it holds the most calls allowed (known only at the answer's end)."""
        return self.max_calls is not None and self.num_calls >= self.max_calls

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.holding is False:
            return text, []
        self.pending += text
        start = self.pending.lstrip()
        if PYTHON_TAG.startswith(start):
            return "", []  # the tag, or a part of it: undecided
        start = start.removeprefix(PYTHON_TAG).lstrip()
        if start:
            self.holding = start[0] == "{"
        if self.holding is False:
            text, self.pending = self.pending, ""
            return text, []
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self.pending = self.pending, ""
        call = None
        if self.holding:
            call = self.reader.call(text.lstrip().removeprefix(PYTHON_TAG))
        if call is None:
            return text, []
        self.num_calls += 1
        return "", [call]


def parser(tools: list[dict[str, Any]], fmt: str = "hermes", max_calls: int | None = None
           ) -> ToolCallParser | JsonToolCallParser:
    """A streaming parser of calls in the format ``fmt`` (``format_of``); Llama's format
    holds one call in any case."""
    kind = ToolCallParser if fmt == "hermes" else JsonToolCallParser
    return kind(tools, max_calls)


def parse(text: str, tools: list[dict[str, Any]], fmt: str = "hermes",
          max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
    """A whole output's content and calls."""
    reader = parser(tools, fmt, max_calls)
    content, calls = reader.feed(text)
    rest, more = reader.finish()
    return content + rest, calls + more


class CallReader:
    """What makes a text a call: a JSON object naming an offered tool, with an object of
    arguments (Hermes' key, or Llama's ``parameters``) that a ``strict`` tool's parameters
    accept."""

    def __init__(self, tools: list[dict[str, Any]]):
        self.names = {t["function"]["name"] for t in tools}
        strict = [t["function"] for t in tools if t["function"].get("strict")]
        self.validators = {}
        if strict:
            from jsonschema import Draft202012Validator

            self.validators = {f["name"]: Draft202012Validator(f["parameters"]) for f in strict}

    def call(self, text: str) -> ToolCall | None:
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):  # not JSON, or JSON Python will not read
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or \
                value["name"] not in self.names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        validator = self.validators.get(value["name"])
        if validator is not None and not _valid(validator, arguments):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False),
                        f"call_{secrets.token_hex(12)}")


def _block_end(text: str) -> int:
    """Where the closing tag of a block that begins ``text`` is (-1: not yet): the first
    one outside a JSON string, so that a call's own arguments may spell the tag."""
    at = text.find(CLOSE)
    while at >= 0 and _inside_json_string(text[:at]):
        at = text.find(CLOSE, at + 1)
    return at


def _inside_json_string(text: str) -> bool:
    """Whether ``text``, read as the beginning of a JSON object, ends inside a string."""
    if not text.lstrip().startswith("{"):
        return False
    inside = escaped = False
    for c in text:
        if escaped:
            escaped = False
        elif c == "\\" and inside:
            escaped = True
        elif c == '"':
            inside = not inside
    return inside


def _partial_tag(text: str) -> int:
    """The length of the longest end of ``text`` that begins the opening tag."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
