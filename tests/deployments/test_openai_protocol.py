"""OpenAI bodies translate to the splitspec.v1 request the gRPC API would send, unsupported fields are refused by name,
and responses, chunks and errors have OpenAI's shapes and HTTP statuses."""

import json

import grpc
import pytest

from deployments import api
from deployments import openai_protocol as protocol
from deployments.status import ModelNotFoundError, RequestDeadlineError, StageUnavailableError, to_status
from services.errors import CapacityError, InvalidRequestError
from services.loop import FINISH_STOP
from services.sampling import SamplingParams
from splitspec.api.v1 import splitspec_pb2 as pb

CHAT = protocol.ChatCompletionRequest
TEXT = protocol.CompletionRequest


def chat_body(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields).encode()


def request_of(model, raw: bytes) -> pb.GenerateRequest:
    return protocol.generate_request(protocol.parse_body(model, raw), "r1")


def test_chat_body_becomes_the_grpc_request():
    request = request_of(CHAT, chat_body(
        messages=[{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        max_tokens=9, max_completion_tokens=7, temperature=0, top_p=0.9, top_k=-1, seed=3, stop="\n", user="ignored",
        speculation={"mode": "on", "num_draft_tokens": 2, "drafter": "model", "overlap": True}))
    assert [(m.role, m.content) for m in request.messages] == [("system", "Be brief."), ("user", "a\nb")]
    assert request.max_new_tokens == 7  # max_completion_tokens wins over the deprecated max_tokens
    assert (request.temperature, request.top_k, request.seed, list(request.stop)) == (0.0, 0, 3, ["\n"])
    assert request.top_p == pytest.approx(0.9)
    assert request.speculation == pb.SpeculationPolicy(mode=pb.SpeculationPolicy.MODE_ON, num_draft_tokens=2,
                                                       drafter="model", overlap=True)


@pytest.mark.parametrize("model,raw,logprobs,top", [
    (CHAT, chat_body(), False, 0),
    (CHAT, chat_body(logprobs=True), True, 0),
    (CHAT, chat_body(logprobs=True, top_logprobs=20), True, 20),
    (CHAT, chat_body(logprobs=False, top_logprobs=3), False, 3),  # (api.parse refuses it: top_logprobs needs logprobs)
    (TEXT, b'{"prompt": "a"}', False, 0),
    (TEXT, b'{"prompt": "a", "logprobs": 0}', True, 0),
    (TEXT, b'{"prompt": "a", "logprobs": 5}', True, 5),
])
def test_logprobs_become_the_grpc_fields(model, raw, logprobs, top):
    request = request_of(model, raw)
    assert (request.logprobs, request.top_logprobs) == (logprobs, top)


@pytest.mark.parametrize("response_format,schema", [
    (None, ""), ({"type": "text"}, ""), ({"type": "json_object"}, '{"type": "object"}'),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}, "strict": True}},
     '{"type": "integer"}'),
])
def test_response_format_becomes_the_json_schema(response_format, schema):
    """Structured outputs: json_object asks for any object, json_schema for its schema (as text); text for nothing."""
    assert request_of(CHAT, chat_body(response_format=response_format)).json_schema == schema
    completion = json.dumps({"prompt": "a", "response_format": response_format}).encode()
    assert request_of(TEXT, completion).json_schema == schema  # (completions too: vLLM's extension)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_become_the_prompt_and_a_forced_choice_the_json_schema():
    """Tools go into the system message (deployments.tools' format), the history's calls and results into turns; a
    named tool_choice constrains the answer to that function's call."""
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    auto = request_of(CHAT, chat_body(messages=history, tools=[WEATHER]))
    assert [m.role for m in auto.messages] == ["system", "user", "assistant", "user"]
    assert "<tools>" in auto.messages[0].content and "<tool_call>" in auto.messages[2].content
    assert auto.messages[3].content == "<tool_response>\nrain\n</tool_response>" and auto.json_schema == ""
    named = request_of(CHAT, chat_body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert json.loads(named.json_schema)["properties"]["name"] == {"const": "get_weather"}
    none = request_of(CHAT, chat_body(tools=[WEATHER], tool_choice="none"))
    assert [m.role for m in none.messages] == ["user"]


def test_an_answer_with_calls_is_tool_calls_whole_and_streamed():
    body = protocol.parse_body(protocol.ChatCompletionRequest, chat_body(tools=[WEATHER]))
    answer = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    whole = protocol.Completion(True, plan(), "m", tool_plan=protocol.tool_plan(body))
    response = whole.response(answer, FINISH_STOP, 9, pb.Timings())
    message = response["choices"][0]["message"]
    assert response["choices"][0]["finish_reason"] == "tool_calls" and message["content"] == "Checking."
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    streamed = protocol.Completion(True, plan(), "m", tool_plan=protocol.tool_plan(body))
    sent = [streamed.chunk(answer[:12]), streamed.chunk(answer[12:])]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in sent) == "Checking."
    held = streamed.held_back()
    assert [c["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] for c in held] == ["get_weather"]
    assert held[0]["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    assert streamed.chunk(None, FINISH_STOP)["choices"][0]["finish_reason"] == "tool_calls"
    plain = protocol.Completion(True, plan(), "m", tool_plan=protocol.tool_plan(body))
    assert plain.response("No call.", FINISH_STOP, 3, pb.Timings())["choices"][0]["finish_reason"] == "stop"


def test_openai_defaults():
    """Unset temperature samples at 1 (OpenAI's default); chat leaves max tokens to the server, completions take 16."""
    chat = request_of(CHAT, chat_body())
    assert chat.temperature == 1.0 and not chat.HasField("max_new_tokens") and not chat.HasField("seed")
    assert not chat.HasField("top_p") and chat.speculation == pb.SpeculationPolicy()
    text = request_of(TEXT, b'{"model": "m", "prompt": ["Once upon a time"]}')
    assert text.prompt == "Once upon a time" and text.max_new_tokens == protocol.COMPLETIONS_DEFAULT_MAX_TOKENS


@pytest.mark.parametrize("model,raw,message", [
    (CHAT, chat_body(n=2), "n: not supported by splitspec (splitspec returns one choice per request)"),
    (CHAT, chat_body(logprobs=True, top_logprobs=21), "top_logprobs: Input should be less than or equal to 20"),
    (CHAT, chat_body(logprobs=True, top_logprobs=-1), "top_logprobs: Input should be greater than or equal to 0"),
    (CHAT, chat_body(tool_choice="auto"), "tool_choice 'auto' needs tools"),
    (CHAT, chat_body(functions=[{"name": "f"}]), "functions: not supported"),
    (CHAT, chat_body(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
     "response_format and a forced tool_choice both decide the answer's format"),
    (CHAT, chat_body(response_format={"type": "xml"}), "response_format.type must be text, json_object or json_schema"),
    (CHAT, chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format of type json_schema needs its schema"),
    (CHAT, chat_body(frequency_penalty=1, logit_bias={"5": 1}), "frequency_penalty, logit_bias: not supported"),
    (CHAT, chat_body(stream_options={"include_usage": True}), "stream_options is only allowed when stream is true"),
    (CHAT, chat_body(messages=[{"role": "function", "content": "x"}]), "role must be one of"),
    (CHAT, chat_body(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]), "['input_audio'] are not supported"),
    (CHAT, chat_body(speculation={"mode": "on", "k": 3}), "speculation.k: Extra inputs are not permitted"),
    (CHAT, chat_body(seed=-1), "seed: Input should be greater than or equal to 0"),
    (CHAT, b"{oops", "invalid request body"),
    (TEXT, b'{"prompt": "a", "echo": true, "best_of": 2}', "echo, best_of: not supported"),
    (TEXT, b'{"prompt": "a", "suffix": "z"}', "suffix: not supported"),
    (TEXT, b'{"prompt": "a", "logprobs": 21}', "logprobs: Input should be less than or equal to 20"),
    (TEXT, b'{"prompt": ["a", "b"]}', "prompt has 2 strings: send one prompt per request"),
    (TEXT, b'{"prompt": [[1, 2]]}', "token-id prompts are not supported"),
    (TEXT, b'{"model": "m"}', "prompt: Field required"),
])
def test_refused_with_the_field_named(model, raw, message):
    with pytest.raises(InvalidRequestError) as err:
        request_of(model, raw)
    assert message in str(err.value)


def plan(**kwargs) -> api.Plan:
    return api.Plan(**{"request_id": "r1", "session_id": "r1/s", "prompt_ids": [1, 2, 3], "params": SamplingParams(),
                       "max_new_tokens": 4, "stop": [], "speculate": True, "num_draft_tokens": 3, "drafter": "eagle"}
                    | kwargs)


def test_responses_and_chunks_have_openai_shapes():
    p = plan()
    p.stats.steps, p.stats.drafted, p.stats.accepted = 2, 6, 4
    chat = protocol.Completion(True, p, "m", include_usage=True)
    whole = chat.response("Paris.", api.FINISH_STOP_SEQUENCE, 2, pb.Timings(ttft_ms=5))
    assert whole["id"] == "chatcmpl-r1" and whole["object"] == "chat.completion"
    assert whole["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Paris."}, "logprobs": None,
                                 "finish_reason": "stop"}]
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert whole["speculation_stats"]["accepted"] == 4 and whole["speculation_stats"]["drafter"] == "eagle"
    assert whole["timings"]["ttft_ms"] == 5
    assert chat.chunk("", role=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat.chunk("Par")["choices"][0]["delta"] == {"content": "Par"} and chat.chunk("Par")["usage"] is None
    assert chat.chunk(None, "length")["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                              "finish_reason": "length"}
    assert chat.usage_chunk(2)["choices"] == [] and chat.usage_chunk(2)["usage"]["total_tokens"] == 5
    running = protocol.Completion(True, p, "m", include_usage=True, continuous_usage=True)
    assert running.chunk("Par", completion_tokens=2)["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                                                   "total_tokens": 5}
    text = protocol.Completion(False, p, "m")
    assert text.id == "cmpl-r1" and text.chunk("is")["object"] == "text_completion"
    assert text.chunk("is")["choices"][0]["text"] == "is" and "usage" not in text.chunk("is")


@pytest.mark.parametrize("exc,status,kind", [
    (InvalidRequestError("bad"), 400, "invalid_request_error"),
    (ModelNotFoundError("no such model"), 404, "not_found_error"),
    (CapacityError("full"), 429, "rate_limit_error"),
    (StageUnavailableError("verify down"), 503, "service_unavailable_error"),
    (RequestDeadlineError("too long"), 504, "timeout_error"),
    (RuntimeError("boom"), 500, "server_error"),
])
def test_errors_map_to_http_status_and_openai_json(exc, status, kind):
    code, message = to_status(exc)
    got_status, body = protocol.error(code, message)
    assert (got_status, body["error"]["type"]) == (status, kind)
    assert body["error"]["message"] == message and "boom" not in message  # an internal error says only its reference
    assert protocol.error(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated")[0] == 401


@pytest.fixture(scope="module")
def tokenizer():
    from services.loading import describe
    from services.models import default_pair

    default_pair.prepare()
    return describe(default_pair.target_dir()).tokenizer


def test_logprobs_have_the_shapes_the_openai_client_parses(tokenizer):
    """Chat: ``logprobs.content`` entries with their bytes (a token that ends inside a character: its own bytes);
    completions: the legacy lists, ``text_offset`` running on across chunks; both parse as the `openai` client's
    types."""
    from openai.types import Completion as TextCompletion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.completion_choice import Logprobs

    from services.logprobs import TokenLogprob

    ids = tokenizer("日本 ok")["input_ids"]  # "日" is two tokens: the first ends inside the character
    entries = [TokenLogprob(t, -0.5 * (i + 1), ((t, -0.5 * (i + 1)), (ids[0], -3.0))) for i, t in enumerate(ids)]
    asking = plan(params=SamplingParams(logprobs=2))
    chat = protocol.Completion(True, asking, "m", tokenizer=tokenizer)
    whole = ChatCompletion.model_validate(chat.response("日本 ok", "length", len(ids), pb.Timings(), entries))
    content = whole.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in content).decode() == "日本 ok"
    assert [e.logprob for e in content] == [e.logprob for e in entries]
    assert [[t.logprob for t in e.top_logprobs] for e in content] == [[v for _, v in e.top] for e in entries]
    assert content[-1].token == " ok" and content[-1].top_logprobs[1].bytes == list(content[0].bytes)
    chunk = ChatCompletionChunk.model_validate(chat.chunk(" ok", logprobs=entries[-1:]))
    assert chunk.choices[0].logprobs.content[0].token == " ok"
    text = protocol.Completion(False, asking, "m", tokenizer=tokenizer)
    # (streamed, the client builds its chunks without validating them: finish_reason is null until the last)
    legacy = [Logprobs.model_validate(text.chunk("", logprobs=part)["choices"][0]["logprobs"])
              for part in (entries[:2], entries[2:])]
    pieces = [tokenizer.decode([t]) for t in ids]
    assert TextCompletion.model_validate(text.response("", "length", 0, pb.Timings(), []))
    assert sum((lp.tokens for lp in legacy), []) == pieces
    assert sum((lp.token_logprobs for lp in legacy), []) == [e.logprob for e in entries]
    assert sum((lp.text_offset for lp in legacy), []) == [sum(map(len, pieces[:i])) for i in range(len(ids))]
    assert legacy[1].top_logprobs[-1] == {" ok": entries[-1].logprob, pieces[0]: -3.0}  # the top ones and the token
    # a request that did not ask: "logprobs": null, as before
    assert protocol.Completion(True, plan(), "m").response("x", "length", 1, pb.Timings())["choices"][0]["logprobs"] is None
