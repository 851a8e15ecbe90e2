"""Tool calls in the Hermes format: template detection, prompts and history, the constraint, and
the parsers (the streamed parse must equal the whole one however the text is split)."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tinyloop.errors import RequestError
from tinyloop.http.tools import (
    MAX_TOOL_CALLS,
    ContentDelta,
    Delta,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    default_tool_prompt,
    flatten_history,
    render_history,
    template_supports_tools,
    tool_call_constraint,
    with_tool_prompt,
)
from tinyloop.tokenizer import CHATML_TEMPLATE, render_chat

CHECKPOINTS = Path(__file__).parents[1] / "data" / "checkpoints"

# Ouro's ChatML (its `enable_thinking` switch opening `<think>`) with a Qwen-style tools section:
# no template in the repo or the shared fixtures takes tools (Ouro's own is plain ChatML).
OURO_TOOLS_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + message.content }}
{%- for call in message.tool_calls or [] %}
{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
{{- call.function.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK: dict[str, Any] = {"type": "function",
                         "function": {"name": "now", "description": None, "parameters": None, "strict": None}}

HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "name": "get_weather", "content": "21C"},
]


def _ids() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


# --- templates, prompts, history ---------------------------------------------------------------

def test_a_template_that_reads_tools_supports_them() -> None:
    assert template_supports_tools(OURO_TOOLS_TEMPLATE)
    assert template_supports_tools("{% if tools is defined %}{{ tools | length }}{% endif %}")


def test_plain_chatml_and_the_checkpoints_templates_do_not_support_tools() -> None:
    assert not template_supports_tools(CHATML_TEMPLATE)
    for name in ("ouro-tiny", "huginn-tiny"):  # Huginn's uses {% generation %}: it must still parse
        config = json.loads((CHECKPOINTS / name / "tokenizer_config.json").read_text())
        assert not template_supports_tools(config["chat_template"]), name


def test_tools_only_as_text_set_locally_or_in_a_broken_template_do_not_count() -> None:
    assert not template_supports_tools("{{ 'tools' }} {# tools #}")
    assert not template_supports_tools("{% set tools = [] %}{{ tools }}")
    assert not template_supports_tools("{% if tools %}")


def test_the_default_prompt_lists_each_tool_as_a_json_line_and_asks_for_tool_call_blocks() -> None:
    prompt = default_tool_prompt([WEATHER, CLOCK])
    listed = re.search(r"<tools>\n(.*)\n</tools>", prompt, re.S)
    assert listed is not None
    lines = [json.loads(line) for line in listed.group(1).split("\n")]
    assert lines == [WEATHER, {"type": "function", "function": {"name": "now"}}]  # nulls left out
    assert '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>' in prompt


def test_the_tool_prompt_goes_before_a_system_message_or_in_a_new_one() -> None:
    prompt = default_tool_prompt([WEATHER])
    user = {"role": "user", "content": "hi"}
    assert with_tool_prompt([user], [WEATHER]) == [{"role": "system", "content": prompt}, user]
    system = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    out = with_tool_prompt([system, user], [WEATHER])
    assert out == [{"role": "system", "content": f"{prompt}\n\nBe brief."}, user]
    assert system["content"] == [{"type": "text", "text": "Be brief."}]  # the input is untouched


def test_render_history_parses_arguments_into_objects_and_keeps_the_rest() -> None:
    out = render_history(HISTORY)
    calls = out[2]["tool_calls"]
    assert calls[0] == {"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert calls[1]["function"]["arguments"] == "not json"
    assert out[3] == HISTORY[3] and out[:2] == HISTORY[:2]
    assert HISTORY[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


def test_a_tool_template_renders_the_parsed_history_as_hermes_blocks() -> None:
    prompt = render_chat(render_history(HISTORY), template=OURO_TOOLS_TEMPLATE, tools=[WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>\n<tool_response>\n21C\n" in prompt
    assert prompt.startswith("<|im_start|>system\nYou help.\n\n# Tools\n\n<tools>\n{")


def test_flatten_history_writes_calls_and_results_as_text_for_plain_chatml() -> None:
    history = [*HISTORY[1:], {"role": "assistant", "content": "Sunny in Paris.",
                              "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "now", "arguments": "{}"}}]}]
    prompt = render_chat(flatten_history(history), template=CHATML_TEMPLATE, add_generation_prompt=False)
    assert prompt == (
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": "not json"}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>\n"
        "<tool_response>\n21C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nSunny in Paris.\n"
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n')


def test_tool_results_apart_become_separate_user_messages() -> None:
    tool = {"role": "tool", "tool_call_id": "c", "content": "ok"}
    out = flatten_history([tool, {"role": "user", "content": "and?"}, tool])
    assert [m["role"] for m in out] == ["user", "user", "user"]
    assert out[0]["content"] == out[2]["content"] == "<tool_response>\nok\n</tool_response>"


# --- the constraint ----------------------------------------------------------------------------

def test_required_constrains_to_every_tool_and_a_named_choice_to_that_one() -> None:
    required = tool_call_constraint([WEATHER, CLOCK], "required", parallel=True)
    assert required is not None and required.kind == "tool_calls"
    assert json.loads(required.source) == {
        "tools": [{"name": "get_weather", "parameters": {**WEATHER["function"]["parameters"],
                                                          "additionalProperties": False}},
                  {"name": "now", "parameters": {"type": "object", "additionalProperties": False}}],
        "parallel": True, "begin": "<tool_call>\n", "end": "\n</tool_call>", "separator": "\n"}
    named = tool_call_constraint([WEATHER, CLOCK], {"type": "function", "function": {"name": "now"}}, False)
    assert named is not None
    spec = json.loads(named.source)
    assert spec["tools"] == [{"name": "now", "parameters": {"type": "object", "additionalProperties": False}}]
    assert spec["parallel"] is False


def test_auto_none_and_no_choice_leave_the_output_free() -> None:
    for choice in ("auto", "none", None):
        assert tool_call_constraint([WEATHER], choice, parallel=True) is None


def test_a_choice_of_an_unknown_tool_is_refused_on_tool_choice() -> None:
    with pytest.raises(RequestError, match="'nope'") as err:
        tool_call_constraint([WEATHER], {"type": "function", "function": {"name": "nope"}}, parallel=True)
    assert err.value.param == "tool_choice"
    with pytest.raises(RequestError) as empty:
        tool_call_constraint([], "required", parallel=True)
    assert empty.value.param == "tool_choice"


# --- parsing -----------------------------------------------------------------------------------

def test_a_call_and_the_text_around_it_are_parsed() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": 1}}\n</tool_call>\n'
    content, calls = ToolCallParser(new_id=_ids()).parse(text)
    assert content == "Let me look."
    assert calls == [ToolCall("call_0", "get_weather", '{"city":"Paris","n":1}')]
    assert calls[0].to_openai() == {"id": "call_0", "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city":"Paris","n":1}'}}


def test_parallel_calls_come_in_order_and_ids_look_like_openais() -> None:
    block = '<tool_call>\n{{"name": "{}", "arguments": {{}}}}\n</tool_call>'
    content, calls = ToolCallParser().parse("\n".join(block.format(n) for n in ("a", "b", "c")))
    assert content is None and [c.name for c in calls] == ["a", "b", "c"]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls) and len({c.id for c in calls}) == 3


def test_blocks_that_are_not_calls_stay_in_the_content() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {}</tool_call> x <tool_call>{"arguments": {}}</tool_call>'
            ' <tool_call>{"name": "b", "arguments": [1]}</tool_call> <tool_call>{"name": "c", "arguments": NaN}'
            '</tool_call>')
    content, calls = ToolCallParser().parse(text)
    assert calls == [] and content == text


def test_an_unclosed_last_block_is_a_call_when_its_json_is_whole() -> None:
    content, calls = ToolCallParser(new_id=_ids()).parse('Sure.<tool_call>\n{"name": "now", "arguments": {}}\n')
    assert content == "Sure." and calls == [ToolCall("call_0", "now", "{}")]
    content, calls = ToolCallParser().parse('Sure.<tool_call>\n{"name": "now", "argu')
    assert content == 'Sure.<tool_call>\n{"name": "now", "argu' and calls == []


def test_arguments_may_be_a_json_string_or_absent_or_called_parameters() -> None:
    text = ('<tool_call>{"name": "a", "arguments": "{\\"x\\": \\"\u00e9\\"}"}</tool_call>'
            '<tool_call>{"name": "b"}</tool_call><tool_call>{"name": "c", "parameters": {"y": null}}</tool_call>')
    _, calls = ToolCallParser().parse(text)
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"x":"\u00e9"}'), ("b", "{}"), ("c", '{"y":null}')]


def test_calls_beyond_the_cap_stay_in_the_content() -> None:
    block = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    content, calls = ToolCallParser().parse(block * (MAX_TOOL_CALLS + 2))
    assert len(calls) == MAX_TOOL_CALLS and content == block * 2
    content, calls = ToolCallParser(max_calls=1).parse(block * 2)
    assert len(calls) == 1 and content == block


def test_text_without_calls_is_all_content() -> None:
    assert ToolCallParser().parse("  just words  ") == ("just words", [])
    assert ToolCallParser().parse(" \n") == (None, [])


# --- streaming ---------------------------------------------------------------------------------

def test_content_streams_holding_back_only_a_possible_tag_start() -> None:
    parser = StreamingToolParser()
    assert parser.feed("Hello <tool") == [ContentDelta("Hello")]  # the space waits for what follows
    assert parser.feed("box> ok") == [ContentDelta(" <toolbox> ok")]
    assert parser.feed("\n<tool_call>\n{") == []
    assert parser.finish() == [ContentDelta("\n<tool_call>\n{")]


def test_a_call_streams_as_its_first_delta_then_its_arguments() -> None:
    parser = StreamingToolParser(new_id=_ids())
    assert parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}') == []
    deltas = parser.feed("\n</tool_call>")
    assert [d.to_openai() for d in deltas if isinstance(d, ToolCallDelta)] == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city":"Paris"}'}}]
    assert parser.calls == 1 and parser.finish() == []
    assert "calls=1" in repr(parser)


def test_an_unclosed_call_comes_out_in_finish() -> None:
    parser = StreamingToolParser(new_id=_ids())
    assert parser.feed('<tool_call>{"name": "now"}') == []
    assert parser.finish() == [ToolCallDelta(0, "", id="call_0", name="now"), ToolCallDelta(0, "{}")]


def _streamed(text: str, cuts: list[int], max_calls: int) -> tuple[str | None, list[tuple[str, str]]]:
    parser = StreamingToolParser(max_calls=max_calls)
    bounds = [0, *sorted(cuts), len(text)]
    deltas: list[Delta] = []
    for a, b in itertools.pairwise(bounds):
        deltas += parser.feed(text[a:b])
    deltas += parser.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            if d.id is not None:
                assert d.index == len(calls) and d.name is not None and d.arguments == ""
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    return content or None, [(name, args) for name, args in calls.values()]


# Replies built of whole blocks (calls, broken ones, one left open) and text around them.
BLOCKS = st.sampled_from([
    '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', '<tool_call>{"name": "g"}</tool_call>',
    '<tool_call>\n{"name": "h", "arguments": "{}"}', '<tool_call>{"name": </tool_call>', "<tool_call>{}</tool_call>",
])
FILLER = st.sampled_from(["hi", " ", "\n", "<tool_", "</tool", "<", "é", "</tool_call>", "<tool_call>",
                          '{"name": "f"}'])
REPLIES = st.lists(st.one_of(BLOCKS, FILLER), max_size=10).map("".join)


def test_a_reply_fed_one_character_at_a_time_parses_as_a_whole() -> None:
    text = ('Hi <tool <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call> <tool_call>{"name": </tool_call>'
            ' </tool_call>\n<tool_call>{"name": "g"}</tool_call> <tool_call>{"name": "h"}')
    content, calls = ToolCallParser().parse(text)
    assert [c.name for c in calls] == ["f", "g", "h"]
    assert _streamed(text, list(range(len(text))), MAX_TOOL_CALLS) == (content, [(c.name, c.arguments) for c in calls])


@st.composite
def split_texts(draw: st.DrawFn, text: st.SearchStrategy[str]) -> tuple[str, list[int]]:
    """A text and the points to cut it at."""
    whole = draw(text)
    return whole, draw(st.lists(st.integers(0, len(whole)), max_size=8))


@given(split_texts(REPLIES), st.sampled_from([1, 2, MAX_TOOL_CALLS]))
def test_the_streamed_parse_equals_the_whole_parse_however_the_text_is_split(
        split: tuple[str, list[int]], max_calls: int) -> None:
    text, cuts = split
    content, calls = ToolCallParser(max_calls=max_calls).parse(text)
    assert _streamed(text, cuts, max_calls) == (content, [(c.name, c.arguments) for c in calls])


@given(split_texts(st.text(alphabet="<>/tool_cae{}\"n: \n", max_size=60)))
def test_the_streamed_parse_equals_the_whole_parse_on_tag_soup(split: tuple[str, list[int]]) -> None:
    text, cuts = split
    content, calls = ToolCallParser().parse(text)
    assert _streamed(text, cuts, MAX_TOOL_CALLS) == (content, [(c.name, c.arguments) for c in calls])


def test_forced_calls_close_the_parameters_objects_that_leave_extra_properties_unsaid() -> None:
    params = {"type": "object", "properties": {"where": {"type": "object", "properties": {"city": {"type": "string"}}},
                                               "open": {"type": "object", "additionalProperties": True}},
              "$defs": {"P": {"properties": {"x": {"type": "integer"}}}}}
    constraint = tool_call_constraint([{"type": "function", "function": {"name": "f", "parameters": params}}],
                                      "required", False)
    assert constraint is not None
    got = json.loads(constraint.source)["tools"][0]["parameters"]
    assert got["additionalProperties"] is False
    assert got["properties"]["where"]["additionalProperties"] is False
    assert got["properties"]["open"]["additionalProperties"] is True  # said: kept
    assert got["$defs"]["P"]["additionalProperties"] is False
