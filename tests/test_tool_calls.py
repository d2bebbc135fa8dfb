"""Tool calls without a server: the parser that splits an output into content and calls
(whole, or fed in any pieces), the checks on tools and tool_choice, how a conversation with
tools is written for a template that does not read them, and the grammar that holds a
required call to the tool's schema (every output it allows parses into a valid call)."""

from __future__ import annotations

import json
import random

from tiny_llm.engine.inputs import InputProcessor
from tiny_llm.sampling.tool_calls import (
    ToolCallParser,
    ToolChoice,
    check_tools,
    chosen,
    constraint,
    format_of,
    parse,
    parser,
)
from tiny_llm.structured import Grammars

import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
    "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]

OUTPUT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
          '{"zone": "CET"}}\n</tool_call>')


def test_an_output_splits_into_content_and_calls():
    content, calls = parse(OUTPUT, TOOLS)
    assert content == "Let me look.\n"  # the whitespace between calls is not content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    only_calls = OUTPUT[OUTPUT.index("<tool_call>"):]
    assert parse(f"\n\n{only_calls}\n", TOOLS)[0] == ""  # whitespace around calls is not content
    assert parse("  ", TOOLS)[0] == "  "  # but is, when there is no call
    for pieces in ([OUTPUT + " and more"], [OUTPUT[:90], OUTPUT[90:] + " and more"]):
        reader, content, calls = parser(TOOLS, "hermes", max_calls=1), "", []
        for piece in pieces:  # the answer ends with its one call allowed
            got, more = reader.feed(piece)
            content, calls = content + got, calls + more
        rest, more = reader.finish()
        assert (content + rest, [c.name for c in calls + more]) == ("Let me look.\n",
                                                                     ["get_weather"])
        assert reader.done
    not_a_call = "<tool_call>oops</tool_call>"
    assert parse(f"{only_calls}\n{not_a_call}", TOOLS)[0] == f"\n{not_a_call}"
    assert calls[0].as_openai()["function"] == {"name": "get_weather",
                                                "arguments": calls[0].arguments}


@pytest.mark.parametrize("zone", ['a " </tool_call> b', "C:\\", 'C:\\" </tool_call>'])
def test_a_calls_arguments_may_spell_the_closing_tag_after_escapes(zone):
    """Inside a JSON string an escaped quote does not end the string and an escaped
    backslash does not escape the quote after it: each block ends at the first closing
    tag outside its arguments' strings, whole or fed in pieces."""
    zones = [zone, "CET"]
    text = "\n".join(f"<tool_call>\n{json.dumps({'name': 'get_time', 'arguments': {'zone': z}})}"
                     "\n</tool_call>" for z in zones) + " after"
    for cut in (None, *range(1, len(text))):
        reader = parser(TOOLS, "hermes")
        pieces = [text] if cut is None else [text[:cut], text[cut:]]
        fed = [reader.feed(piece) for piece in pieces] + [reader.finish()]
        content, calls = "".join(c for c, _ in fed), [c for _, more in fed for c in more]
        assert content == " after", (cut, content)
        assert [json.loads(c.arguments) for c in calls] == [{"zone": z} for z in zones]


LLAMA_CALL = '{"name": "get_time", "parameters": {"zone": "CET"}}'


@pytest.mark.parametrize(("fmt", "text"), [("hermes", t) for t in [
    OUTPUT,
    "<tool_call>\n{not json}\n</tool_call> and <tool_call>[1, 2]</tool_call>",
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not an offered tool
    '<tool_call>{"name": "get_time", "arguments": "CET"}</tool_call>',
    "a < b and <tool_ca ll> is not a tag; <tool_call",  # a tag begun at the very end
    'x <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n',  # stopped at its end
    "<tool_call>\n{\"name\": \"get_ti",  # cut off (max_tokens)
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "</tool_call>"}}\n</tool_call>',
    '<tool_call>{"name": ["get_time"]}</tool_call> <tool_call>{"name": {}}</tool_call>',
    f"\n{OUTPUT[OUTPUT.index('<tool_call>'):]}\n<tool_call>oops</tool_call>  ",
    '<tool_call>{"q": "5" tall"}</tool_call> then ' + OUTPUT[OUTPUT.index("<tool_call>"):],
    "<tool_call>" + "[" * 5000 + "</tool_call>",  # JSON too deep for Python to read
    '<tool_call>{"name": "get_time", "arguments": {"zone": ' + "9" * 5000 + "}}</tool_call>",
]] + [("json", t) for t in [
    LLAMA_CALL, f"  {LLAMA_CALL}\n", '{"answer": 42}', "Plain text {not a call}",
    LLAMA_CALL[:20], f"<|python_tag|>{LLAMA_CALL}", "<|python_tag|> ok", '{"name": [1]}']])
def test_fed_in_any_pieces_an_output_parses_as_it_does_whole(fmt, text):
    whole_content, whole_calls = parse(text, TOOLS, fmt)
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
        reader, content, calls = parser(TOOLS, fmt), "", []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            got, more = reader.feed(text[a:b])
            content, calls = content + got, calls + more
        rest, more = reader.finish()
        content, calls = content + rest, calls + more
        assert content == whole_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments)
                                                          for c in whole_calls]
    if not whole_calls:  # a block that is not a call stays, as written
        assert whole_content == text


def test_llamas_format_is_one_json_object_as_the_whole_answer():
    for text in (LLAMA_CALL, f" <|python_tag|>{LLAMA_CALL}"):  # Llama 3.1 may write the tag
        content, calls = parse(text, TOOLS, "json")
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_time", {"zone": "CET"})]
    odd = '<tool_call>{"q": "5" tall"}</tool_call> then '  # a quote that never closes
    content, calls = parse(odd + OUTPUT[OUTPUT.index("<tool_call>"):], TOOLS)
    assert content == odd and [c.name for c in calls] == ["get_weather", "get_time"]
    tagged = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "</tool_call>"}}'
    assert [json.loads(c.arguments) for c in parse(f"{tagged}\n</tool_call>", TOOLS)[1]] == [
        {"zone": "</tool_call>"}]  # the tag inside a string does not end the block
    reader = parser(TOOLS, "json")
    assert reader.feed("It is") == ("It is", [])  # not an object: content at once
    reader = parser(TOOLS, "json")
    assert reader.feed(" {") == ("", [])  # maybe a call: held to the end


LLAMA_LIKE_TEMPLATE = """{% for message in messages %}<|start_header_id|>{{ message.role }}\
<|end_header_id|>

{{ message.content }}<|eot_id|>{% endfor %}{% if tools %}To call a function, answer with \
{"name": function name, "parameters": its arguments}: {{ tools | tojson }}{% endif %}"""


def test_the_format_is_read_from_the_template():
    from test_tokenizer import TOOLS_TEMPLATE

    assert format_of("{{ messages }}", False) == "hermes"  # the turns teach Hermes blocks
    assert format_of(TOOLS_TEMPLATE, True) == "hermes"
    assert format_of(LLAMA_LIKE_TEMPLATE, True) == "json"
    assert format_of("{{ tools | tojson }} [TOOL_CALLS]", True) is None  # Mistral's
    from tiny_llm.models.tokenizer import Tokenizer

    broken = Tokenizer.__new__(Tokenizer)  # only its template matters here
    broken.chat_template = "{% if tools %}"  # a syntax error: said when it is rendered
    assert not broken.template_reads_tools


def test_a_model_whose_format_is_unknown_is_refused_tools():
    from tiny_llm.serving.protocol import APIError, parse_request

    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    with pytest.raises(APIError, match="tool-call format") as refused:
        parse_request(body, True, "m", None)
    assert refused.value.param == "tools" and refused.value.status == 400
    assert parse_request(body | {"tools": []}, True, "m", None).tool_use.tools is None
    parsed = parse_request(body | {"tool_choice": "required"}, True, "m", "json")
    assert json.loads(json.dumps(parsed.params.structured.json))["anyOf"][0]["required"] == [
        "name", "parameters"]


def test_a_request_read_for_calls_keeps_special_tokens_in_its_text():
    """A format's tags may be special tokens (Llama's <|python_tag|>): the parser must see
    them, so a request whose output is read for calls keeps them unless it says otherwise."""
    from tiny_llm.serving.protocol import parse_request

    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_request(body, True, "m").params.skip_special_tokens
    assert parse_request(body | {"tools": TOOLS, "tool_choice": "none"}, True,
                         "m").params.skip_special_tokens
    for fmt in ("hermes", "json"):
        read = parse_request(body | {"tools": TOOLS}, True, "m", fmt)
        assert read.tool_use.parse and not read.params.skip_special_tokens
    asked = body | {"tools": TOOLS, "skip_special_tokens": True}
    assert parse_request(asked, True, "m").params.skip_special_tokens


def test_content_streams_while_only_a_possible_tag_waits():
    parser = ToolCallParser(TOOLS)
    assert parser.feed("Hello <tool") == ("Hello ", [])
    assert parser.feed("box>") == ("<toolbox>", [])
    assert parser.feed("<tool_call>\n{") == ("", [])  # inside a block: held to its end
    content, calls = parser.feed('"name": "get_time", "arguments": {"zone": "X"}}\n</tool_call>!')
    assert content == "!" and [c.name for c in calls] == ["get_time"]
    assert parser.finish() == ("", [])


@pytest.mark.parametrize(("tools", "match"), [
    ({"type": "function"}, "must be a list"),
    ([{"type": "retrieval", "function": {"name": "f"}}], r"tools\[0\] must be"),
    ([{"type": "function", "function": {"name": "no spaces"}}], "letters, digits"),
    ([WEATHER, WEATHER], "two tools are named 'get_weather'"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "JSON schema"),
])
def test_bad_tools_are_refused_naming_the_problem(tools, match):
    with pytest.raises(ValueError, match=match):
        check_tools(tools)


def test_tool_choice():
    assert check_tools([{"type": "function", "function": {"name": "f"}}])[0]["function"][
        "parameters"] == {"type": "object", "properties": {}}
    assert chosen(None, TOOLS).mode == "auto" and chosen(None, []).mode == "none"
    assert chosen("auto", []).mode == "none"  # nothing to call
    assert chosen("required", TOOLS) == ("required", None)
    assert chosen({"type": "function", "function": {"name": "get_time"}}, TOOLS) == (
        "named", "get_time")
    required = [t | {"function": t["function"] | {"name": "required"}} for t in TOOLS[:1]]
    named_required = chosen({"type": "function", "function": {"name": "required"}},
                            required + TOOLS[1:])
    assert named_required == ("named", "required")  # a function may be named so
    for choice, match in [("always", "must be one of"), ("required", "needs tools"),
                          ({"type": "function", "function": {"name": "nope"}}, "not among"),
                          ({"type": "function", "function": {"name": ["x"]}}, "not among"),
                          ({"function": {"name": "get_time"}}, "a named tool_choice")]:
        with pytest.raises(ValueError, match=match):
            chosen(choice, TOOLS if choice != "required" else [])


def test_a_template_without_tools_gets_them_written_into_the_turns(smollm_tokenizer):
    """SmolLM2's template reads only role and content: the tools go into the system turn,
    an earlier call is written as the model writes one, its result is a user turn."""
    from tiny_llm.engine.config import EngineConfig

    tok = smollm_tokenizer
    assert not tok.template_reads_tools
    inputs = InputProcessor(tok, tok.vocab_size, EngineConfig(), 4096, None)
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    listing = "\n".join(json.dumps(t) for t in check_tools(TOOLS))
    written = [
        {"role": "system", "content": "Be brief.\n\nYou can call functions. They are listed, "
         "one JSON object per line, between <tools> and </tools>:\n<tools>\n" + listing +
         "\n</tools>\nTo call one, answer with its name and arguments as JSON inside "
         "<tool_call></tool_call> tags, one call per block:\n<tool_call>\n"
         '{"name": "<name>", "arguments": {<arguments>}}\n</tool_call>\n'
         "The results come back inside <tool_response></tool_response> tags."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
         '{"city": "Paris"}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}]
    assert inputs.tokenize(conversation, TOOLS) == tok.encode_chat(written)
    assert inputs.tokenize(conversation) == tok.encode_chat([written[0] | {
        "content": "Be brief."}, *written[1:]])
    for bad, error in [
        ({"role": "assistant", "content": None}, "'content' must be a string"),
        ({"role": "user", "content": "x", "tool_calls": [{"function": {
            "name": "f", "arguments": "{}"}}]}, "only an assistant message has tool_calls"),
        ({"role": "assistant", "content": None, "tool_calls": [{"function": {
            "name": "f", "arguments": "{city"}}]}, "arguments are not JSON"),
        ({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]},
         "a tool call is")]:
        with pytest.raises((ValueError, TypeError), match=error):
            inputs.tokenize([bad])
    with pytest.raises(ValueError, match="two tools"):
        inputs.tokenize(conversation, [WEATHER, WEATHER])
    with pytest.raises(TypeError, match="tools are offered in a chat"):
        inputs.tokenize("plain text", TOOLS)


@pytest.mark.parametrize("name", [None, "get_time"])
@pytest.mark.parametrize(("fmt", "parallel"), [("hermes", True), ("hermes", False),
                                               ("json", True)])
def test_a_required_call_is_always_a_valid_one(smollm_tokenizer, name, fmt, parallel):
    """Random walks through the grammar's allowed tokens (no model: any allowed token)
    end in outputs that parse into calls of the right tools with valid arguments."""
    import jsonschema

    tok = smollm_tokenizer
    grammars = Grammars(tok, tok.vocab_size)
    choice = ToolChoice("required") if name is None else ToolChoice("named", name)
    spec = constraint(check_tools(TOOLS), choice, parallel, fmt)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rng = random.Random(len(name or "") + parallel)
    for _ in range(4):
        matcher, ids = grammars.constraint(spec), []
        while len(ids) < 200:
            allowed = matcher.allowed().nonzero()[0].tolist()
            token = rng.choice(allowed)
            if token in tok.eos_token_ids:
                break
            matcher.consume(token)
            ids.append(token)
        assert token in tok.eos_token_ids, "the grammar never let the output end"
        content, calls = parse(tok.decode(ids), TOOLS, fmt)
        assert content.strip() == "" and calls
        assert len(calls) == 1 or (parallel and fmt == "hermes" and name is None)
        for call in calls:
            assert name in (None, call.name)
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert constraint(TOOLS, ToolChoice("auto"), True) is None
    assert constraint(TOOLS, ToolChoice("none"), True) is None


def test_a_strict_tools_calls_are_calls_only_when_their_arguments_validate():
    """Under auto nothing holds the model to a schema while it writes; a strict tool's
    call that its parameters refuse comes back as the text it is, never as a call."""
    strict = [t | {"function": t["function"] | {"strict": True}} for t in TOOLS]
    valid = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    invalid = '<tool_call>{"name": "get_time", "arguments": {"zone": 7}}</tool_call>'
    for fmt, good, bad in [("hermes", valid, invalid),
                           ("json", LLAMA_CALL, LLAMA_CALL.replace('"CET"', "7"))]:
        assert [c.name for c in parse(good, check_tools(strict), fmt)[1]] == ["get_time"]
        assert parse(bad, check_tools(strict), fmt) == (bad, [])
        assert [c.name for c in parse(bad, check_tools(TOOLS), fmt)[1]] == ["get_time"]
    for bad, match in [({"strict": "yes"}, "strict must be a boolean"),
                       ({"strict": True, "parameters": {"type": "strin"}}, "not a JSON schema"),
                       ({"strict": True, "parameters": {"$ref": "#/$defs/gone"}}, "refers to"),
                       ({"strict": True, "parameters": json.loads("[" * 200 + "]" * 200)},
                        "JSON schema")]:
        with pytest.raises(ValueError, match=match):
            check_tools([{"type": "function", "function": {"name": "f", **bad}}])


def plain():
    """Token ids spelled as their numbers: the shapes' tests read no logprobs."""
    from tiny_llm.serving.responses import TokenSpelling

    return TokenSpelling(str, lambda token: str(token).encode())


@pytest.mark.parametrize(("fmt", "text"), [("hermes", OUTPUT), ("json", LLAMA_CALL)])
@pytest.mark.parametrize("max_calls", [None, 1])
@pytest.mark.parametrize("reason", ["stop", "length", "abort"])
def test_a_streamed_choice_ends_as_the_whole_one_does(fmt, text, max_calls, reason):
    """The server's two shapes of one output: the same calls and the same finish reason
    ("tool_calls" where the model stopped after its calls, or the server at the last call
    allowed)."""
    from tiny_llm.serving.protocol import ToolUse
    from tiny_llm.serving.responses import ChatBodies

    use = ToolUse(check_tools(TOOLS), True, None, max_calls)
    whole = ChatBodies("r", "m", plain(), use, fmt).choice(0, text, reason, None)
    shape = ChatBodies("r", "m", plain(), use, fmt)
    chunks = [shape.chunk(0, text[:30], None, None)["choices"][0],
              shape.chunk(0, text[30:], reason, None)["choices"][0]]
    streamed = [c["function"]["name"] for chunk in chunks
                for c in chunk["delta"].get("tool_calls", [])]
    assert streamed == [c["function"]["name"] for c in whole["message"]["tool_calls"]]
    assert chunks[-1]["finish_reason"] == whole["finish_reason"] == (
        "tool_calls" if reason == "stop" or max_calls else reason)


@pytest.mark.parametrize("fmt", ["hermes", "json"])
def test_a_call_cut_off_under_a_required_choice_is_not_content(fmt):
    """Under tool_choice required (or named) the grammar writes calls only: a call that
    max_tokens cut off is dropped, not returned as markup in the content, streamed or
    whole; the finish reason says the output was cut."""
    from tiny_llm.serving.protocol import ToolUse
    from tiny_llm.serving.responses import ChatBodies

    if fmt == "hermes":
        done = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
        text = done + '\n<tool_call>{"name": "get_time", "argu'
    else:
        text = LLAMA_CALL[:-6]  # the output is one object: cut, no call at all
    use = ToolUse(check_tools(TOOLS), True, None, None, calls_only=True)
    whole = ChatBodies("r", "m", plain(), use, fmt).choice(0, text, "length", None)
    assert whole["message"]["content"] is None and whole["finish_reason"] == "length"
    shape = ChatBodies("r", "m", plain(), use, fmt)
    deltas = [shape.chunk(0, text[:40], None, None)["choices"][0]["delta"],
              shape.chunk(0, text[40:], "length", None)["choices"][0]["delta"]]
    assert not any("content" in d for d in deltas)
    calls = len(whole["message"].get("tool_calls", []))
    assert calls == (1 if fmt == "hermes" else 0)
    assert sum(len(d.get("tool_calls", [])) for d in deltas) == calls
    unconstrained = ChatBodies("r", "m", plain(), use._replace(calls_only=False), fmt)
    assert unconstrained.choice(0, text, "length", None)["message"]["content"]  # auto: text


def test_under_auto_a_strict_tools_calls_are_held_to_its_schema_as_they_are_written(
        smollm_tokenizer):
    """auto with a strict tool (Hermes blocks): free text passes untouched, but once the
    model opens a block, the call must name an offered tool and a strict tool's arguments
    must fit its schema (another tool's: any object). Random walks from an opened block
    end in valid calls."""
    from tiny_llm.serving.protocol import parse_request

    import jsonschema

    tok = smollm_tokenizer
    grammars = Grammars(tok, tok.vocab_size)
    tools = check_tools([TOOLS[0], TIME | {"function": TIME["function"] | {"strict": True}}])
    spec = constraint(tools, ToolChoice("auto"), True)
    assert constraint(check_tools(TOOLS), ToolChoice("auto"), True) is None  # none strict

    def accepted(text: str) -> bool:
        matcher = grammars.constraint(spec)
        for token in tok.encode(text, add_special_tokens=False):
            if not matcher.allowed()[token]:
                return False
            matcher.consume(token)
        return True

    assert accepted("Just prose, a < b, and a <tool_ca ll> that is not a tag.")
    assert accepted('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": '
                    '"CET"}}\n</tool_call>')
    assert accepted('<tool_call>\n{"name": "get_weather", "arguments": {"any": [1]}}')
    assert not accepted('<tool_call>\n{"name": "get_time", "arguments": {"zone": 7}}')
    assert not accepted('<tool_call>\n{"name": "rm_rf"')
    assert not accepted("<tool_call>x")  # a tag opens a call or is not written
    rng = random.Random(5)
    bounded = constraint(check_tools([t | {"function": t["function"] | {"strict": True}}
                                      for t in TOOLS]), ToolChoice("auto"), True)
    for _ in range(4):  # every schema bounded: the walks end
        matcher = grammars.constraint(bounded)
        ids = tok.encode("Sure.\n<tool_call>\n", add_special_tokens=False)
        for token in ids:
            matcher.consume(token)
        while len(ids) < 250:
            token = rng.choice(matcher.allowed().nonzero()[0].tolist())
            if token in tok.eos_token_ids:
                break
            matcher.consume(token)
            ids.append(token)
        assert token in tok.eos_token_ids
        content, calls = parse(tok.decode(ids), tools)
        assert content == "Sure.\n" and calls
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    assert parse_request(body, True, "m").params.structured == spec
    json_format = {"response_format": {"type": "json_object"}}  # then the format's grammar
    assert parse_request(body | json_format, True, "m").params.structured.json_object
