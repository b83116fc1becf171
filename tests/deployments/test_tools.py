"""Tool calls translated: tools and the history into the documented prompt format, forced choices into a schema,
answers back into calls (deployments.tools)."""

import json
import re
from pathlib import Path

import pytest

from deployments import tool_parsers, tools
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


# -- the model's own tool template (deployments.tools.ToolFormat, deployments.tool_parsers) -------------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CHATML_TOOLS = (FIXTURES / "chatml_tools.jinja").read_text()  # the default pair's template with a Hermes tool section
LLAMA3_JSON = (FIXTURES / "llama3_json_tools.jinja").read_text()  # Llama 3.1-style JSON tool calling
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


@pytest.fixture()
def tokenizer():
    """The default pair's tokenizer, a fresh one (a test may replace its chat template)."""
    from transformers import AutoTokenizer

    from services.models import default_pair

    return AutoTokenizer.from_pretrained(default_pair.prepare()[0])


def test_the_format_is_the_template_s_where_it_renders_tools_in_a_known_format(tokenizer):
    assert tools.server_format(tokenizer.chat_template) == tools.ToolFormat()  # the default pair's: no tools
    hermes = tools.server_format(CHATML_TOOLS)
    assert hermes.in_template and hermes.parser.name == "hermes"
    llama = tools.server_format(LLAMA3_JSON)
    assert llama.in_template and llama.parser.name == "llama3_json"
    assert tools.server_format({"default": tokenizer.chat_template, "tool_use": LLAMA3_JSON}).parser.name == "llama3_json"
    unknown = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}"  # renders tools, format unknown
    assert tools.server_format(unknown) == tools.ToolFormat()
    assert tools.server_format(unknown, "llama3_json") == tools.ToolFormat(tool_parsers.PARSERS["llama3_json"], True)
    with pytest.raises(ValueError, match="none of"):
        tools.server_format(CHATML_TOOLS, "pythonic")


def test_the_template_renders_the_tools_and_the_history(tokenizer):
    own, tokenizer.chat_template = tokenizer.chat_template, CHATML_TOOLS
    plan = tools.plan([WEATHER], "auto", None, tools.server_format(CHATML_TOOLS).parser)
    assert tools.uses_template(tools.server_format(CHATML_TOOLS), HISTORY, plan)
    prompt = tools.render_prompt(tokenizer, HISTORY, plan)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in prompt  # the template's own rendering of the signature
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert prompt.endswith("<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    plain = [{"role": "user", "content": "hi"}]
    assert not tools.uses_template(tools.server_format(CHATML_TOOLS), plain, tools.plan(None, None, None))
    for chat in (plain, [{"role": "system", "content": "Be brief."}] + plain):  # without tools: as the default pair's
        assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
            tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, chat_template=own)


def test_a_bos_the_template_writes_is_not_added_twice(tokenizer):
    from tokenizers.processors import TemplateProcessing

    tokenizer.chat_template = LLAMA3_JSON
    tokenizer.bos_token = "<|endoftext|>"  # a tokenizer that adds a BOS of its own, as Llama 3's does
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single=f"{tokenizer.bos_token} $A",
                                                                   special_tokens=[(tokenizer.bos_token, bos)])
    assert tokenizer("")["input_ids"] == [bos]
    plan = tools.plan([WEATHER], "auto", None, tool_parsers.PARSERS["llama3_json"])
    prompt = tools.render_prompt(tokenizer, HISTORY, plan)
    assert not prompt.startswith(tokenizer.bos_token) and '"parameters": {"city": "Paris"}' in prompt
    ids = tokenizer(prompt)["input_ids"]
    assert ids[0] == bos and ids[1] != bos


def test_a_template_s_own_refusal_is_a_bad_request(tokenizer):
    tokenizer.chat_template = LLAMA3_JSON
    two_calls = [HISTORY[0], {"role": "assistant", "content": "", "tool_calls": HISTORY[1]["tool_calls"] * 2}]
    with pytest.raises(InvalidRequestError, match="one tool per turn"):
        tools.render_prompt(tokenizer, two_calls, tools.plan([WEATHER], "auto", None))


def test_llama3_json_answers_are_parsed_into_calls():
    plan = tools.plan([WEATHER, TIME], "auto", None, tool_parsers.PARSERS["llama3_json"])
    content, calls = tools.parse_answer('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                        '{"name": "get_time", "arguments": {}}', plan)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert tools.parse_answer(' {"name": "get_time", "parameters": {}}\n', plan)[1][0].name == "get_time"
    for text in ('It is sunny. {"name": "get_time", "parameters": {}}', '{"name": "nope", "parameters": {}}',
                 '{"name": "get_time", "parameters": {}} and more', '{"name": "get_ti', '{"answer": 42}'):
        assert tools.parse_answer(text, plan) == (text, []), text  # prose, unknown functions, cut short: text


def test_streamed_llama3_json_answers_hold_back_only_an_answer_that_may_be_a_call():
    plan = tools.plan([WEATHER], "auto", None, tool_parsers.PARSERS["llama3_json"])
    call = tools.StreamedAnswer(plan)
    assert "".join(call.feed(d) for d in [" ", "<|python", "_tag|>{\"name\": \"get_weather\", ",
                                          "\"parameters\": {\"city\": \"Lima\"}}"]) == ""
    rest, calls = call.finish()
    assert rest == "" and [c.name for c in calls] == ["get_weather"]
    prose = tools.StreamedAnswer(plan)
    assert prose.feed("It is") == "It is" and prose.feed(' {"a": 1}') == ' {"a": 1}' and prose.finish() == ("", [])
    json_text = tools.StreamedAnswer(plan)  # a JSON answer that is no call: held to the end, then sent as text
    assert json_text.feed('{"answer": 42}') == "" and json_text.finish() == ('{"answer": 42}', [])


def test_a_last_block_the_answer_ended_before_closing_is_a_call():
    plan = tools.plan([WEATHER], "auto", None)
    content, calls = tools.parse_answer('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}',
                                        plan)
    assert content == "Checking." and [c.name for c in calls] == ["get_weather"]
    cut = '<tool_call>\n{"name": "get_weather", "argu'  # cut short: text
    assert tools.parse_answer(cut, plan) == (cut, [])


def test_a_named_parser_needs_a_template_that_renders_tools(tokenizer):
    with pytest.raises(ValueError, match="renders no tools"):
        tools.server_format(tokenizer.chat_template, "llama3_json")


def test_a_malformed_history_call_is_a_bad_request():
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [{"function": "x"}]}]
    for render in (tools.render_messages, tools.template_messages):
        with pytest.raises(InvalidRequestError, match=re.escape("messages[1].tool_calls")):
            render(history, tools.plan([WEATHER], "auto", None))


def test_a_chat_template_is_read_from_its_file_and_checked(tmp_path):
    from deployments.config import AppConfig

    path = tmp_path / "template.jinja"
    path.write_text(CHATML_TOOLS)
    assert AppConfig.model_validate({"models": {"chat_template": str(path)}}).models.chat_template == CHATML_TOOLS
    marked = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"  # transformers' tag
    assert AppConfig.model_validate({"models": {"chat_template": marked}}).models.chat_template == marked
    for bad, reason in (("{% for m in messages %}", "no valid Jinja"), (str(tmp_path / "none.jinja"), "neither")):
        with pytest.raises(ValueError, match=reason):
            AppConfig.model_validate({"models": {"chat_template": bad}})
    with pytest.raises(ValueError, match="tool_call_parser must be auto or one of"):
        AppConfig.model_validate({"models": {"tool_call_parser": "pythonic"}})
