"""Tool-call and reasoning parsing: each recorded reply's expected content and calls are written out by hand; a
streamed reply gives exactly them whatever its token boundaries (every split into three pieces, and one character
at a time), and the answer for any prefix is a prefix of the final one."""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.errors import BadRequestError
from ember.server import reasoning
from ember.server.reply import ReplyParser
from ember.server.tool_parsers import Parsed, parse
from ember.server.tools import call_grammar, plan, resolve_parser, template_messages, template_parser

WEATHER = '{"city": "Paris", "days": [1, 2]}'
# (parser, reasoning, thinking, reply text, expected reasoning, content, calls)
CASES = [
    ("hermes", False, False,
     'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + '}\n</tool_call>\n'
     '<tool_call>\n{"name": "note", "arguments": {"text": "a </tool_call> inside, and \\"quotes\\" {"}}\n</tool_call>',
     "", "Let me look.",
     [("get_weather", WEATHER), ("note", '{"text": "a </tool_call> inside, and \\"quotes\\" {"}')]),
    ("hermes", False, False, "No tools: <tool is not a tag.\n", "", "No tools: <tool is not a tag.\n", []),
    ("hermes", False, False, "<tool_call>not json</tool_call> after", "", "<tool_call>not json</tool_call> after", []),
    ("hermes", False, False, '<tool_call>{"arguments": {}, "name": "late_name"}</tool_call>', "", "",
     [("late_name", "{}")]),
    ("hermes", False, False, '<tool_call>\n{"name": "cut", "arguments": {"x": [1, 2', "", "", [("cut", '{"x": [1, 2')]),
    ("llama3_json", False, False, '<|python_tag|>{"name": "a", "parameters": {"q": "x;y"}}; {"name": "b", '
     '"parameters": {}}', "", "", [("a", '{"q": "x;y"}'), ("b", "{}")]),
    ("llama3_json", False, False, '{"answer": 42}', "", '{"answer": 42}', []),
    ("llama3_json", False, False, '{"name": "a", "parameters": {}}; {"x": 1', "", '{"x": 1', [("a", "{}")]),
    ("llama3_json", False, False, "  Plain {text}", "", "  Plain {text}", []),
    ("mistral", False, False, 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"k": "]"}}, {"name": "g", '
     '"arguments": {"n": 1.5e3}}]', "", "Sure.", [("f", '{"k": "]"}'), ("g", '{"n": 1.5e3}')]),
    ("hermes", True, False, '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "w", "arguments": '
     '{}}\n</tool_call>', "\nThe user wants weather.\n", "", [("w", "{}")]),
    (None, True, True, "I think </thin and more</think>\n\nThe answer.", "I think </thin and more", "The answer.", []),
    (None, True, False, "No thinking here.", "", "No thinking here.", []),
    (None, True, True, "Cut short while thinking", "Cut short while thinking", "", []),
]


# hermes replies without the tags, read as calls only when every object names one of the request's tools
BARE = [
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}\n{"name": "get_weather", "arguments": {}}', "",
     [("get_weather", '{"city": "Oslo"}'), ("get_weather", "{}")]),
    ('{"name": "John", "arguments": {"age": 3}}', '{"name": "John", "arguments": {"age": 3}}', []),
    ('{"name": "get_weather", "arguments": {}} then text', "then text", [("get_weather", "{}")]),
    ('```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```', "", [("get_weather", '{"city": "Oslo"}')]),
    ('```json\n{"name": "other", "arguments": {}}\n```', '```json\n{"name": "other", "arguments": {}}\n```', []),
    ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
]


@pytest.mark.parametrize("text,content,calls", BARE)
def test_bare_hermes_calls_of_the_requests_tools(text, content, calls):
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            parser = ReplyParser("hermes", False, names=("get_weather",))
            assert _streamed(parser, [text[:i], text[i:j], text[j:]]) == ("", content, calls)
    assert parse("hermes", text, True).calls == ()  # without the request's names: content, as before


def _streamed(parser: ReplyParser, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    thought, content, calls = "", "", {}
    for k, piece in enumerate(pieces):
        delta = parser.feed(piece, final=k == len(pieces) - 1)
        thought += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for c in delta.get("tool_calls", []):
            if "id" in c:  # the first delta of a call: OpenAI's shape, the name once
                assert c["index"] not in calls and c["type"] == "function" and c["function"]["arguments"] == ""
                assert c["id"].startswith("call_") or (parser.tools == "mistral" and len(c["id"]) == 9)
                calls[c["index"]] = [c["function"]["name"], ""]
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                calls[c["index"]][1] += c["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return thought, content, [tuple(calls[i]) for i in range(len(calls))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[3][:24]}")
def test_every_split_gives_the_expected_reply(case):
    kind, splits_thinking, thinking, text, thought, content, calls = case
    expected = (thought, content, calls)
    whole = ReplyParser(kind, splits_thinking, thinking)
    assert _streamed(whole, [text]) == expected
    message = whole.message()
    assert message["content"] == (content or None if calls else content)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == calls
    assert _streamed(ReplyParser(kind, splits_thinking, thinking), list(text)) == expected
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            pieces = [text[:i], text[i:j], text[j:]]
            assert _streamed(ReplyParser(kind, splits_thinking, thinking), pieces) == expected, pieces


@pytest.mark.parametrize("case", [c for c in CASES if c[0] is not None], ids=lambda c: f"{c[0]}-{c[3][:24]}")
def test_a_prefix_says_a_prefix_of_the_final_answer(case):
    kind, text = case[0], case[3]
    final = parse(kind, text, True)
    for i in range(len(text)):
        early = parse(kind, text[:i], False)
        assert final.content.startswith(early.content)
        assert len(early.calls) <= len(final.calls)
        for (name, args), (final_name, final_args) in zip(early.calls, final.calls):
            assert name == final_name and final_args.startswith(args)


def test_markers_choose_the_parser():
    assert template_parser("{{- '<tool_call>\\n' }}") == "hermes"
    assert template_parser("[TOOL_CALLS] ...") == "mistral"
    assert template_parser("<|python_tag|>") == "llama3_json"
    assert template_parser("{{ message.content }}") is None
    assert resolve_parser("none", "<tool_call>") is None
    assert resolve_parser("mistral", "") == "mistral"
    with pytest.raises(ValueError, match="tool_call_parser='xml' is not supported"):
        resolve_parser("xml", "")
    assert reasoning.resolve("auto", "{% if '</think>' in content %}") is True
    assert reasoning.resolve("auto", "plain") is False
    assert reasoning.opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not reasoning.opens_thinking("<think>\n\n</think>\n\n")


def _tool(name: str, parameters: dict | None = None):
    function = NS(name=name, description=None, parameters=parameters, strict=None)
    return NS(type="function", function=function,
              model_dump=lambda **_: {"type": "function", "function": {"name": name, "parameters": parameters}})


WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                  "required": ["city"]}


def test_plan_refuses_what_it_cannot_serve():
    with pytest.raises(BadRequestError, match="tool_choice='required' needs tools"):
        plan(None, "required", None, "hermes")
    with pytest.raises(BadRequestError, match=r"tools\[1\].function.name='a' is given twice"):
        plan([_tool("a"), _tool("a")], None, None, "hermes")
    with pytest.raises(BadRequestError, match=r"tools\[0\].function.name='a b' is not allowed"):
        plan([_tool("a b")], None, None, "hermes")
    with pytest.raises(BadRequestError, match="tools cannot be used with this model"):
        plan([_tool("a")], "auto", None, None)
    named = NS(type="function", function=NS(name="zzz"))
    with pytest.raises(BadRequestError, match="tool_choice.function.name='zzz' is not one of"):
        plan([_tool("a")], named, None, "hermes")
    assert plan([_tool("a")], "none", None, None).parser is None  # shown to the template, never parsed
    auto = plan([_tool("a")], None, None, "hermes")
    assert auto.parser == "hermes" and auto.constraint is None and auto.template_tools[0]["function"]["name"] == "a"
    assert plan([_tool("a")], "required", None, "hermes").constraint.grammar.startswith("start: call (")
    assert plan([_tool("a")], "required", False, "hermes").constraint.grammar.startswith("start: call\n")


@pytest.fixture(scope="module")
def vocabulary():
    """llguidance's view of the default model's vocabulary (no model weights needed)."""
    import llguidance.hf

    from ember.config import default_model_path
    from ember.tokenizer import Tokenizer

    path = default_model_path()
    tok = Tokenizer.load(path, gguf_file=path)
    return tok, llguidance.hf.from_tokenizer(tok.hf, n_vocab=tok.vocab_size, eos_token=[tok.eos_token_id])


def _accepts(vocabulary, grammar: str, text: str) -> bool:
    import llguidance

    tok, table = vocabulary
    matcher = llguidance.LLMatcher(table, llguidance.grammar_from("grammar", grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.parametrize("kind,good,bad", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
     '{"name": "get_weather", "parameters": {"city": 5}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]',
     '[TOOL_CALLS][{"name": "get_date", "arguments": {}}]'),
])
def test_required_grammar_admits_only_schema_conformant_calls(vocabulary, kind, good, bad):
    functions = [NS(name="get_weather", parameters=WEATHER_SCHEMA), NS(name="get_time", parameters=None)]
    grammar = call_grammar(kind, functions, many=True)
    assert _accepts(vocabulary, grammar, good)
    assert not _accepts(vocabulary, grammar, bad)
    assert [name for name, _ in parse(kind, good, True).calls] == [n for n in ("get_weather", "get_time")
                                                                    if n in good]
    one = call_grammar(kind, functions[:1], many=False)
    if kind == "llama3_json":
        assert not _accepts(vocabulary, one, good)  # one call only, of the named function


def test_conversation_with_calls_renders_arguments_as_objects():
    from ember.server.protocol import ChatMessage

    messages = [ChatMessage(role="user", content="weather?"),
                ChatMessage(role="assistant", tool_calls=[{"id": "call_1", "function": {"name": "w", "arguments":
                                                                                         '{"city": "Oslo"}'}}]),
                ChatMessage(role="tool", tool_call_id="call_1", content="sunny")]
    out = template_messages(messages)
    assert out[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": {"city": "Oslo"}}}]}
    assert out[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    for bad, why in [(dict(role="tool", content="x"), "tool_call_id is required"),
                     (dict(role="user"), "content is required"),
                     (dict(role="user", content="x", tool_calls=[]), "only allowed in assistant messages")]:
        with pytest.raises(ValueError, match=why):
            ChatMessage(**bad)
    assert json.loads(json.dumps(out))  # plain data only


_PIECES = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<think>", "</think>", "{", "}", "[", "]",
           "```", "json", "`", "nope", "\\q",
           '"name"', '"arguments"', '"parameters"', ":", ",", ";", '"f"', '"g"', '"', "\\", "x", "1", " ", "\n"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=40), st.sampled_from(["hermes", "llama3_json", "mistral"]),
       st.booleans(), st.data())
def test_any_text_parses_prefix_stable_and_split_invariant(pieces, kind, think, data):
    """Fuzzed replies of markers and JSON fragments: no parser raises, a prefix's answer is a prefix of the final
    one, and streaming in random pieces gives the whole reply's answer."""
    text = "".join(pieces)
    final = parse(kind, text, True, ("f",))
    for i in range(len(text)):
        early = parse(kind, text[:i], False, ("f",))
        assert final.content.startswith(early.content) and len(early.calls) <= len(final.calls)
        assert all(n == fn and fa.startswith(a) for (n, a), (fn, fa) in zip(early.calls, final.calls))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=4)))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    whole = ReplyParser(kind, think, names=("f",))
    expected = _streamed(whole, [text])
    assert _streamed(ReplyParser(kind, think, names=("f",)), parts) == expected


@pytest.mark.parametrize("text,content,calls", [
    ('<tool_call>{"name": nope}</tool_call>', '<tool_call>{"name": nope}</tool_call>', []),
    ('<tool_call>{"name": "a\\qb"}</tool_call> x', '<tool_call>{"name": "a\\qb"}</tool_call> x', []),
    ('<tool_call>\n{"name": "f", "arguments": {}}\n<tool_call>\n{"name": "g", "arguments": {"x": 1}}\n</tool_call>',
     "", [("f", "{}"), ("g", '{"x": 1}')]),
    ('<tool_call>{"name": "f", "arguments": {}}\nI called f.', "I called f.", [("f", "{}")]),
    ('Let me check.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone.', "Let me check.\nDone.",
     [("f", "{}")]),
])
def test_odd_hermes_replies(text, content, calls):
    """Broken JSON is content, never an exception; a block left open ends at the next block or with its object;
    the text on either side of a call is joined by a newline. Every split says the same."""
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            assert _streamed(ReplyParser("hermes", False), [text[:i], text[i:j], text[j:]]) == ("", content, calls)


def test_auto_with_a_response_format_is_calls_or_the_json_answer(vocabulary):
    functions = [NS(name="get_weather", parameters=WEATHER_SCHEMA)]
    answer = {"type": "object", "properties": {"response": {"enum": ["sunny", "snowy"]}}, "required": ["response"]}
    grammar = call_grammar("hermes", functions, True, answer=answer)
    assert _accepts(vocabulary, grammar, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                         '\n</tool_call>')
    assert _accepts(vocabulary, grammar, '{"response": "snowy"}')
    assert not _accepts(vocabulary, grammar, '{"response": "rainy"}')
    assert not _accepts(vocabulary, grammar, "Plain text.")
    assert parse("hermes", '{"response": "snowy"}', True, ("get_weather",)) == Parsed('{"response": "snowy"}')
    auto = plan([_tool("get_weather", WEATHER_SCHEMA)], "auto", None, "hermes", answer=answer)
    assert auto.constraint.grammar.startswith("start: calls | answer")


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    """parallel_tool_calls=false under tool_choice "auto" (no grammar to hold the model to one call): the reply
    says the first call and drops the rest (as vLLM), streamed or whole."""
    text = ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "f", "arguments": {"b": 2}}\n</tool_call>')
    for single, want in ((False, 2), (True, 1)):
        whole = ReplyParser("hermes", False, single=single)
        whole.feed(text, final=True)
        streamed = ReplyParser("hermes", False, single=single)
        for i in range(0, len(text), 7):
            streamed.feed(text[i:i + 7], final=i + 7 >= len(text))
        for p in (whole, streamed):
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in p.calls] == \
                [("f", '{"a": 1}'), ("f", '{"b": 2}')][:want]


def test_mistral_call_ids_are_nine_letters_or_digits():
    """Mistral's chat templates refuse tool call ids that are not 9 alphanumerics (the next turn sends them back);
    the other families keep OpenAI's call_ ids."""
    mistral = ReplyParser("mistral", False)
    mistral.feed('[TOOL_CALLS][{"name": "f", "arguments": {}}]', final=True)
    hermes = ReplyParser("hermes", False)
    hermes.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>', final=True)
    (m,), (h,) = mistral.calls, hermes.calls
    assert len(m["id"]) == 9 and m["id"].isalnum() and h["id"].startswith("call_")


def test_a_name_with_a_lone_surrogate_escape_stays_content():
    """A name whose JSON escape decodes to a lone surrogate cannot be written out as UTF-8 (the reply's JSON would
    fail with a 500): the block is no call, its text stays content and encodes."""
    text = '<tool_call>{"name": "f\\ud800", "arguments": {}}</tool_call>'
    p = ReplyParser("hermes", False)
    delta = p.feed(text, final=True)
    assert not p.calls and delta["content"] == text
    json.dumps(delta, ensure_ascii=False).encode("utf-8")
