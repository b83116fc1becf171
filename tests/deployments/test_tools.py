"""Tool calls translated: tools and the history into the documented prompt format, forced choices into a schema,
answers back into calls (deployments.tools)."""

import json
import re

import pytest

from deployments import tools
from services.errors import InvalidRequestError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_no_tools_means_plain_text():
    plan = tools.plan(None, None, None)
    assert not plan.active and plan.forced is None
    assert tools.render_messages([{"role": "user", "content": "hi"}], plan) == [("user", "hi")]
    assert tools.parse_answer('<tool_call>{"name": "x", "arguments": {}}</tool_call>', plan)[1] == []


def test_auto_puts_the_signatures_in_the_system_message():
    plan = tools.plan([WEATHER, TIME], None, None)
    assert plan.choice == "auto" and plan.forced is None
    rendered = tools.render_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], plan)
    assert rendered[0][0] == "system" and rendered[0][1].startswith("Be brief.\n\n# Tools")
    assert json.dumps(tools.parse_functions([WEATHER])[0].signature()) in rendered[0][1]
    assert rendered[1] == ("user", "hi")
    alone = tools.render_messages([{"role": "user", "content": "hi"}], plan)
    assert alone[0][0] == "system" and "<tools>" in alone[0][1] and alone[1] == ("user", "hi")


def test_the_history_s_calls_and_results_become_messages():
    plan = tools.plan([WEATHER], "auto", None)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    rendered = tools.render_messages(history, plan)[1:]
    assert rendered == [("user", "Weather in Paris?"),
                        ("assistant", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
                        ("user", "<tool_response>\nsunny, 21 C\n</tool_response>")]


def test_auto_answers_are_parsed_into_calls_and_text():
    plan = tools.plan([WEATHER, TIME], "auto", None)
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>')
    content, calls = tools.parse_answer(text, plan)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    bad = 'x <tool_call>{"name": "nope", "arguments": {}}</tool_call> <tool_call>not json</tool_call>'
    assert tools.parse_answer(bad, plan) == (bad, [])  # unknown functions and bad JSON stay text


def test_forced_choices_are_schemas():
    named = tools.plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.forced == tools.call_schema(named.functions[0])
    assert named.forced["properties"]["arguments"] == WEATHER["function"]["parameters"]
    required = tools.plan([WEATHER, TIME], "required", None)
    assert required.forced["type"] == "array" and len(required.forced["items"]["anyOf"]) == 2
    assert "maxItems" not in required.forced
    assert tools.plan([WEATHER], "required", False).forced["maxItems"] == 1
    content, calls = tools.parse_answer('{"name": "get_weather", "arguments": {"city": "Rome"}}', named)
    assert content == "" and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    content, calls = tools.parse_answer('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
                                        '"arguments": {"city": "Rome"}}]', required)
    assert content == "" and [c.name for c in calls] == ["get_time", "get_weather"]
    assert tools.parse_answer('{"name": "get_wea', named) == ('{"name": "get_wea', [])  # cut short: text


def test_none_leaves_the_tools_out():
    plan = tools.plan([WEATHER], "none", None)
    assert not plan.active and tools.render_messages([{"role": "user", "content": "hi"}], plan) == [("user", "hi")]


@pytest.mark.parametrize("tools_, choice, message", [
    ([{"type": "retrieval"}], None, "tools[0]: expected"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "unique"),
    ([WEATHER], {"type": "function", "function": {"name": "other"}}, "not in tools"),
    ([WEATHER], "sometimes", "tool_choice must be"),
    (None, "required", "needs tools"),
])
def test_bad_tools_are_refused_with_the_reason(tools_, choice, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        tools.plan(tools_, choice, None)


def test_streamed_auto_answers_hold_back_only_what_may_be_a_call():
    plan = tools.plan([WEATHER], "auto", None)
    stream = tools.StreamedAnswer(plan)
    sent = "".join(stream.feed(d) for d in ["Sure", ". <tool", "_call>{\"name\": \"get_weather\", ",
                                            "\"arguments\": {\"city\": \"Lima\"}}</tool_call>"])
    assert sent == "Sure. "
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["get_weather"]
    text_only = tools.StreamedAnswer(plan)
    sent = "".join(text_only.feed(d) for d in ["a <", "b> c <tool", "s are fun"])
    assert sent + text_only.finish()[0] == "a <b> c <tools are fun" and text_only.finish()[1] == []
    forced = tools.StreamedAnswer(tools.plan([WEATHER], "required", None))
    assert forced.feed('[{"name": "get_weather", "arguments": {"city": "X"}}]') == ""
    assert [c.name for c in forced.finish()[1]] == ["get_weather"]
