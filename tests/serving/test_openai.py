"""The OpenAI-compatible HTTP API, through the real `openai` client and Serve's HTTP proxy: greedy chat equals the gRPC
answer and the target alone, streamed deltas concatenate to the whole answer, usage counts match, logprobs under
speculation equal speculation off's (and gRPC's), structured outputs are schema-valid JSON and the same with
speculation on and off, bad input is a 400 in OpenAI's error JSON, and the service goes on serving. The service
takes a bearer token, as a deployment reachable by others does: calls without it (or with a wrong one) are
UNAUTHENTICATED / 401, with no detail beyond that; the token itself never reaches the config."""

import json

import grpc
import httpx2 as httpx
import jsonschema
import openai
import pytest

from deployments.auth import read_token, token_digest
from deployments.config import AppConfig
from splitspec.api.auth import bearer
from splitspec.api.client import SpecDecodeClient
from tests.serving.conftest import MAX_NEW_TOKENS, PROMPTS, make_config, serving

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"  # the default pair's target: its folder's name is the served model id
SPECULATION = [{"mode": "off"}, {"mode": "on", "num_draft_tokens": 3, "drafter": "model"}, {"mode": "default"}]
TOKEN = "test-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}  # (raw HTTP requests' header; the clients send the token themselves)


@pytest.fixture(scope="module")
def client():
    with serving(make_config(auth={"token_sha256": token_digest(TOKEN)}), token=TOKEN) as client:
        yield client


@pytest.fixture(scope="module")
def oai(client):
    with openai.OpenAI(base_url=client.http_base_url, api_key=TOKEN, max_retries=0, timeout=300) as oai:
        yield oai


def chat(oai, prompt: str, **kwargs):
    return oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **kwargs)


def test_models(oai):
    assert [m.id for m in oai.models.list()] == [MODEL]
    card = oai.models.retrieve(MODEL)
    assert card.owned_by == "splitspec" and card.model_extra["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")


@pytest.mark.parametrize("speculation", SPECULATION, ids=[s["mode"] + s.get("drafter", "") for s in SPECULATION])
def test_greedy_chat_equals_grpc_and_target_alone(client, oai, reference, speculation):
    for prompt in PROMPTS[:4]:
        answer = chat(oai, prompt, temperature=0, max_tokens=MAX_NEW_TOKENS, extra_body={"speculation": speculation})
        grpc_answer = client.generate(messages=[("user", prompt)], max_new_tokens=MAX_NEW_TOKENS)
        assert list(grpc_answer.token_ids) == reference(prompt)
        assert answer.choices[0].message.content == grpc_answer.text, prompt
        assert answer.choices[0].message.role == "assistant" and answer.choices[0].finish_reason in ("stop", "length")
        assert answer.usage.completion_tokens == len(grpc_answer.token_ids)
        assert answer.usage.prompt_tokens == grpc_answer.usage.prompt_tokens
        assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
        stats = answer.model_extra["speculation_stats"]
        assert stats["enabled"] == (speculation["mode"] != "off")
        assert stats["accepted"] <= stats["drafted"]
        if speculation["mode"] == "on":
            assert stats["drafter"] == "model" and stats["num_draft_tokens"] == 3 and not stats["adaptive"]


STREAM_OPTIONS = [None, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}]


@pytest.mark.parametrize("options", STREAM_OPTIONS, ids=["no-usage", "include_usage", "continuous_usage"])
def test_stream_deltas_concatenate_to_the_answer(oai, options):
    for prompt in PROMPTS[4:7]:
        whole = chat(oai, prompt, temperature=0, max_tokens=MAX_NEW_TOKENS)
        chunks = list(chat(oai, prompt, temperature=0, max_tokens=MAX_NEW_TOKENS, stream=True,
                           **({"stream_options": options} if options else {})))
        choices = [c.choices[0] for c in chunks if c.choices]
        assert choices[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in choices) == whole.choices[0].message.content
        assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + [whole.choices[0].finish_reason]
        finished = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
        assert finished.model_extra["speculation_stats"]["steps"] > 0
        assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
        if options is None:
            assert all(c.usage is None for c in chunks)
            continue
        assert not chunks[-1].choices and chunks[-1].usage == whole.usage  # the last chunk, without choices
        if options.get("continuous_usage_stats"):  # vLLM's extension: every chunk, the tokens sent so far
            sent = [c.usage.completion_tokens for c in chunks]
            assert sent == sorted(sent) and sent[0] == 0 and finished.usage == whole.usage
        else:
            assert all(c.usage is None for c in chunks[:-1])


def test_completions_with_stop_and_stream(client, oai):
    prompt = "The three primary colors are"
    grpc_answer = client.generate(prompt=prompt, max_new_tokens=MAX_NEW_TOKENS)
    answer = oai.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_NEW_TOKENS)
    assert answer.object == "text_completion" and answer.choices[0].text == grpc_answer.text
    assert answer.usage.completion_tokens == len(grpc_answer.token_ids)
    streamed = oai.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_NEW_TOKENS, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == grpc_answer.text
    assert len(oai.completions.create(model=MODEL, prompt=prompt, temperature=0).choices[0].text) > 0  # 16 tokens
    stop = grpc_answer.text.strip().split()[1]  # a word of the answer: generation ends before it
    stopped = oai.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_NEW_TOKENS, stop=stop)
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    assert grpc_answer.text.startswith(stopped.choices[0].text)


def test_seeded_sampling_is_reproducible_and_matches_grpc(client, oai):
    """Under the server's default policy a seeded sampled request gets a pinned k (an adaptive one would change which
    draws are made), so the seed gives the same answer twice, and the same as through gRPC."""
    kwargs = dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=MAX_NEW_TOKENS)
    first, second = (chat(oai, PROMPTS[1], **kwargs) for _ in range(2))
    grpc_answer = client.generate(messages=[("user", PROMPTS[1])], max_new_tokens=MAX_NEW_TOKENS, temperature=0.9,
                                  top_p=0.95, seed=1234)
    assert first.choices[0].message.content == second.choices[0].message.content == grpc_answer.text
    stats = first.model_extra["speculation_stats"]
    assert stats["enabled"] and not stats["adaptive"] and stats["num_draft_tokens"] == 2 and stats["drafted"] > 0


LOGPROBS_TOL = 1e-5
TOP = 3
SPECULATING = [{"mode": "on", "num_draft_tokens": 3, "drafter": "model"}, {"mode": "default"}]  # default: EAGLE


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= LOGPROBS_TOL for a, b in zip(got, want))


def _warm(create) -> None:
    """Prefill the prompt once for a feature drafter (EAGLE): from here on every request with it — with features or
    without — takes the prompt's KV from the prefix cache and computes only its last position. (The first token's
    values of a prompt computed whole and of one after a cache hit differ by float rounding, ~1e-5: a property of
    the prefix cache, not of speculation, which the comparisons below leave out.)"""
    create(max_tokens=1, temperature=0, extra_body={"speculation": {"mode": "on", "drafter": "eagle"}})


def test_chat_stream_logprobs_equal_speculation_off_and_grpc(client, oai):
    """Greedy chat, streamed: the client parses each chunk's logprobs.content; the entries (one per token, the first
    token's included) equal those of the same request with speculation off, and gRPC's."""
    prompt = PROMPTS[0]
    _warm(lambda **kwargs: chat(oai, prompt, **kwargs))

    def streamed(speculation):
        chunks = list(chat(oai, prompt, temperature=0, max_tokens=MAX_NEW_TOKENS, stream=True, logprobs=True,
                           top_logprobs=TOP, extra_body={"speculation": speculation}))
        choices = [c.choices[0] for c in chunks if c.choices]
        entries = [e for c in choices if c.logprobs is not None for e in c.logprobs.content]
        return "".join(c.delta.content or "" for c in choices), entries, chunks

    text, off, _ = streamed({"mode": "off"})
    assert len(off) == MAX_NEW_TOKENS or off[-1].token == "<|im_end|>"
    assert all(len(e.top_logprobs) == TOP and e.top_logprobs[0].token == e.token for e in off)  # greedy: the argmax
    assert text.startswith("".join(e.token for e in off[:3]))
    for speculation in SPECULATING:
        text_on, on, chunks = streamed(speculation)
        finished = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
        assert text_on == text and [e.token for e in on] == [e.token for e in off], speculation
        assert _close([e.logprob for e in on], [e.logprob for e in off]), speculation
        for a, b in zip(on, off):
            assert _close([t.logprob for t in a.top_logprobs], [t.logprob for t in b.top_logprobs]), (a, b)
        if speculation["mode"] == "on":  # (the default policy may decline to draft: adaptive)
            assert finished.model_extra["speculation_stats"]["drafted"] > 0
    grpc_answer = client.generate(messages=[("user", prompt)], max_new_tokens=MAX_NEW_TOKENS, logprobs=True,
                                  top_logprobs=TOP, speculate=True, num_draft_tokens=3, drafter="eagle")
    assert len(grpc_answer.logprobs) == len(grpc_answer.token_ids) == len(off)
    assert _close([e.logprob for e in grpc_answer.logprobs], [e.logprob for e in off])
    assert all(len(e.top_logprobs) == TOP and e.top_logprobs[0].token_id == t
               for e, t in zip(grpc_answer.logprobs, grpc_answer.token_ids))
    streamed_grpc = list(client.stream(messages=[("user", prompt)], max_new_tokens=MAX_NEW_TOKENS, logprobs=True,
                                       speculate=True, num_draft_tokens=3, drafter="eagle"))
    entries = [e for chunk in streamed_grpc for e in chunk.logprobs]
    assert all(len(chunk.logprobs) == len(chunk.token_ids) for chunk in streamed_grpc)
    assert [e.token_id for e in entries] == list(grpc_answer.token_ids) and all(not e.top_logprobs for e in entries)
    assert _close([e.logprob for e in entries], [e.logprob for e in off])


def test_completion_logprobs_equal_speculation_off(client, oai, default_pair, target_info):
    """A whole completion: the legacy logprobs parse, one entry per token. Greedy, speculation on gives speculation
    off's values. Seeded sampling (top-k, top-p, EAGLE drafts): the values are gRPC's for the same tokens, and the
    target's processed distribution along them (teacher-forced in this process: transformers' forward, not the
    served one, hence a looser bound)."""
    import torch

    from services.logprobs import LOGPROB_FLOOR, target_logprobs
    from services.sampling import SamplingParams

    prompt = "The three primary colors are"
    _warm(lambda **kwargs: oai.completions.create(model=MODEL, prompt=prompt, **kwargs))

    def complete(speculation, temperature=0.0, **body):
        answer = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW_TOKENS, logprobs=TOP,
                                        temperature=temperature, extra_body={"speculation": speculation, **body})
        lp = answer.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert len(lp.tokens) == answer.usage.completion_tokens
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
        assert all(top[token] == logprob for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
        return answer.choices[0].text, lp

    text, off = complete({"mode": "off"})
    assert all(max(top.values()) == logprob for top, logprob in zip(off.top_logprobs, off.token_logprobs))
    for speculation in SPECULATING:
        text_on, on = complete(speculation)
        assert text_on == text and on.tokens == off.tokens, speculation
        assert _close(on.token_logprobs, off.token_logprobs), speculation
    sampled = dict(temperature=0.9, top_k=5, top_p=0.9, seed=7)
    eagle = {"mode": "on", "num_draft_tokens": 2, "drafter": "eagle"}
    _, http = complete(eagle, **sampled)
    answer = client.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, logprobs=True, top_logprobs=TOP, speculate=True,
                             num_draft_tokens=2, drafter="eagle", **sampled)
    assert answer.speculation_stats.drafted > 0
    assert _close(http.token_logprobs, [e.logprob for e in answer.logprobs])
    assert all(sum(e.logprob > LOGPROB_FLOOR for e in entry.top_logprobs) <= sampled["top_k"]
               for entry in answer.logprobs)
    target, _ = default_pair
    prompt_ids = target_info.tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([prompt_ids + list(answer.token_ids)])).logits[0].float()
    params = SamplingParams(sampled["temperature"], sampled["top_k"], sampled["top_p"])
    reference = target_logprobs(logits[len(prompt_ids) - 1 : -1], params)  # [n, vocab_size]
    for i, (token, entry) in enumerate(zip(answer.token_ids, answer.logprobs)):
        assert abs(entry.logprob - float(reference[i, token])) <= 1e-3, (i, entry.logprob, float(reference[i, token]))


BAD = [  # (body fields over a good chat request, status, words of the message)
    (dict(n=2), 400, "n: not supported"),
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(max_tokens=100_000), 400, "limit"),
    (dict(temperature=-1), 400, "temperature must be >= 0"),
    (dict(top_p=0), 400, "top_p must be in (0, 1]"),
    (dict(messages=[]), 400, "messages"),
    (dict(messages=[{"role": "function", "content": "x"}]), 400, "role"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "send text"),
    (dict(logprobs=True, top_logprobs=21), 400, "top_logprobs: Input should be less than or equal to 20"),
    (dict(top_logprobs=2), 400, "top_logprobs needs logprobs"),
    (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), 400, "tools[0].function.name"),
    (dict(tool_choice="required"), 400, "tool_choice 'required' needs tools"),
    (dict(presence_penalty=0.5), 400, "presence_penalty: not supported"),
    (dict(stream=False, stream_options={"include_usage": True}), 400, "only allowed when stream is true"),
    (dict(stop=[""]), 400, "stop sequences"),
    (dict(speculation={"mode": "sometimes"}), 400, "speculation.mode"),
    (dict(speculation={"drafter": "oracle"}), 400, "unknown drafter"),
    (dict(speculation={"num_draft_tokens": 17}), 400, "num_draft_tokens (k) must be"),
    (dict(model="gpt-4o"), 404, "does not exist"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}),
     400, 'Unimplemented keys: ["not"]'),
    (dict(response_format={"type": "yaml"}), 400, "response_format.type must be"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("fields,status,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_gets_its_status_in_openai_error_json(client, fields, status, message, stream):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream} | fields
    response = httpx.post(f"{client.http_base_url}/chat/completions", json=body, timeout=120, headers=AUTH)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] in ("invalid_request_error", "not_found_error")


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}
FORMATS = [({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}, PERSON),
           ({"type": "json_object"}, {"type": "object"})]
SPECULATE = [{"mode": "on", "num_draft_tokens": 3, "drafter": "eagle"}, {"mode": "on", "num_draft_tokens": 3,
                                                                          "drafter": "model"}, {"mode": "default"}]


@pytest.mark.parametrize("response_format,schema", FORMATS, ids=["json_schema", "json_object"])
def test_structured_outputs_are_schema_valid_and_speculation_changes_nothing(client, oai, response_format, schema):
    """The openai client gets JSON valid under the schema, the same answer with speculation on as off (greedy), and
    gRPC's json_schema field gives it too; so do completions."""
    prompt = "Give a person's name and age as JSON."
    off = chat(oai, prompt, temperature=0, max_tokens=64, response_format=response_format,
               extra_body={"speculation": {"mode": "off"}})
    assert off.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(off.choices[0].message.content), schema)
    for speculation in SPECULATE:
        on = chat(oai, prompt, temperature=0, max_tokens=64, response_format=response_format,
                  extra_body={"speculation": speculation})
        assert on.choices[0].message.content == off.choices[0].message.content, speculation
    grpc_answer = client.generate(messages=[("user", prompt)], max_new_tokens=64,
                                  json_schema=json.dumps(response_format.get("json_schema", {}).get("schema", schema)))
    assert grpc_answer.text == off.choices[0].message.content
    completion = oai.completions.create(model=MODEL, prompt=f"{prompt}\n", max_tokens=64, temperature=0,
                                        extra_body={"response_format": response_format})  # (vLLM's extension)
    jsonschema.validate(json.loads(completion.choices[0].text), schema)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
FORCED = [{"type": "function", "function": {"name": "get_weather"}}, "required"]


@pytest.mark.parametrize("tool_choice", FORCED, ids=["named", "required"])
def test_forced_tool_calls_parse_and_their_arguments_are_valid(oai, tool_choice):
    """A named or required tool choice: the openai client gets tool_calls (whole, and assembled from a stream) whose
    arguments are JSON valid for the function's parameters, the same with speculation on as off (greedy); then a
    second turn with the call and its result in the history answers."""
    prompt = [{"role": "user", "content": "What is the weather in Paris, in Celsius?"}]
    kwargs = dict(model=MODEL, messages=prompt, tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0,
                  max_tokens=96)
    off = oai.chat.completions.create(**kwargs, extra_body={"speculation": {"mode": "off"}})
    assert off.choices[0].finish_reason == "tool_calls"
    calls = off.choices[0].message.tool_calls
    assert calls and calls[0].type == "function" and calls[0].id.startswith("call_")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if tool_choice != "required":
        assert [c.function.name for c in calls] == ["get_weather"]
    on = oai.chat.completions.create(**kwargs, extra_body={"speculation": {"mode": "on", "drafter": "eagle",
                                                                            "num_draft_tokens": 3}})
    assert [(c.function.name, c.function.arguments) for c in on.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in calls]
    with oai.chat.completions.stream(**kwargs) as stream:  # the client assembles the streamed deltas
        streamed = stream.get_final_completion()
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in calls]
    history = prompt + [off.choices[0].message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": '{"temperature": 21}'} for c in calls]
    answer = oai.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME], tool_choice="none",
                                         temperature=0, max_tokens=24)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content


def test_auto_tool_choice_answers_text_or_calls(oai):
    """With tool_choice auto the model answers in text or in calls; either way the client parses the answer."""
    answer = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                         tools=[WEATHER], temperature=0, max_tokens=24)
    message = answer.choices[0].message
    assert (answer.choices[0].finish_reason == "tool_calls") == bool(message.tool_calls)
    assert message.content or message.tool_calls


def test_bad_input_through_the_openai_client_and_service_goes_on(client, oai):
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, "hi", n=3)
    assert "one choice per request" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:  # a schema llguidance cannot compile: its reason
        chat(oai, "hi", response_format={"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": {"type": "string", "format": "weird"}}})
    assert "Unknown format: weird" in err.value.message
    with pytest.raises(grpc.RpcError) as err:  # gRPC's json_schema field: INVALID_ARGUMENT with the reason
        client.generate("hi", json_schema='{"type": "array", "uniqueItems": true}')
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "uniqueItems" in err.value.details()
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt=[1, 2, 3])
    for raw in (b"{not json", b"[]", b'{"model": "x"}'):
        response = httpx.post(f"{client.http_base_url}/chat/completions", content=raw, timeout=60,
                              headers={"content-type": "application/json"} | AUTH)
        assert response.status_code in (400, 404) and "error" in response.json()
    assert chat(oai, "hi", temperature=0, max_tokens=4).usage.completion_tokens == 4


def test_request_id_header_and_health(client):
    response = httpx.post(f"{client.http_base_url}/completions", headers={"x-request-id": "my-request-7"} | AUTH, timeout=120,
                          json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200 and response.headers["x-request-id"] == "my-request-7"
    assert response.json()["id"] == "cmpl-my-request-7"
    health = httpx.get(client.http_base_url.removesuffix("/v1") + "/health", timeout=60)
    assert health.status_code == 200 and health.json() == {"status": "SERVING"}


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_413_and_the_service_goes_on(client, oai, chunked):
    """A body over limits.max_request_bytes (4 MiB) is refused with 413 and OpenAI error JSON, whether its
    Content-Length says so or its chunks do (read as they arrive, never buffered whole); the next request is served."""
    from deployments.config import Limits

    limit = Limits().max_request_bytes
    padding = b" " * (limit + 1)  # (whitespace: valid JSON once the object follows, so only the size is wrong)
    raw = padding + b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    content = (raw[i : i + 2**16] for i in range(0, len(raw), 2**16)) if chunked else raw
    response = httpx.post(f"{client.http_base_url}/chat/completions", content=content, timeout=120,
                          headers={"content-type": "application/json"} | AUTH)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 413
    assert f"limit of {limit} bytes" in error["message"] and "max_request_bytes" in error["message"]
    assert chat(oai, "hi", temperature=0, max_tokens=2).usage.completion_tokens == 2


# -- the bearer token (deployments.auth) --------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789", TOKEN[:-1]])
def test_calls_without_the_token_are_unauthenticated(client, token):
    with SpecDecodeClient(client.address, token=token, timeout_s=120) as caller:
        with pytest.raises(grpc.RpcError) as unary:
            caller.generate(messages=[("user", PROMPTS[0])], max_new_tokens=4)
        with pytest.raises(grpc.RpcError) as stream:
            list(caller.stream(messages=[("user", PROMPTS[0])], max_new_tokens=4))
    for error in (unary.value, stream.value):
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error.details() == "unauthenticated"


def test_calls_with_the_token_are_served(client):
    with SpecDecodeClient(client.address, token=TOKEN, timeout_s=120) as caller:
        assert len(caller.generate(messages=[("user", PROMPTS[0])], max_new_tokens=4).token_ids) == 4
        assert sum(len(c.token_ids) for c in caller.stream(messages=[("user", PROMPTS[1])], max_new_tokens=4)) == 4
        assert caller.metadata[-1] == bearer(TOKEN)


def test_token_sources_and_config_checks(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSPEC_AUTH_TOKEN", f" {TOKEN}\n")
    assert read_token() == TOKEN
    path = tmp_path / "token"
    path.write_text("from-a-file-0123456789\n")
    assert read_token(str(path)) == "from-a-file-0123456789"
    monkeypatch.setenv("SPLITSPEC_AUTH_TOKEN", "short")
    with pytest.raises(ValueError, match="at least 16 characters"):
        read_token()
    monkeypatch.delenv("SPLITSPEC_AUTH_TOKEN")
    assert read_token() == ""
    with pytest.raises(ValueError, match="token_sha256"):
        AppConfig.model_validate({"auth": {"token_sha256": TOKEN}})  # the token itself, not its digest


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789"])
def test_http_calls_without_the_token_get_401(client, token):
    headers = {"authorization": f"Bearer {token}"} if token else {}
    for method, path, body in (("GET", "/models", None), ("POST", "/chat/completions", {
            "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 4}), ("POST", "/completions", {
            "prompt": "Hello", "max_tokens": 4, "stream": True})):
        response = httpx.request(method, client.http_base_url + path, json=body, headers=headers, timeout=60)
        assert response.status_code == 401
        assert response.json()["error"] == {"message": "unauthenticated", "type": "authentication_error",
                                                  "param": None, "code": 401}
    with openai.OpenAI(base_url=client.http_base_url, api_key=token or "none", max_retries=0) as oai:
        with pytest.raises(openai.AuthenticationError):
            oai.models.list()
    assert httpx.get(client.http_base_url.removesuffix("/v1") + "/health", timeout=60).status_code == 200  # a probe


def test_http_calls_with_the_token_are_served(client):
    with openai.OpenAI(base_url=client.http_base_url, api_key=TOKEN, max_retries=0, timeout=120) as oai:
        answer = oai.chat.completions.create(model=oai.models.list().data[0].id, max_tokens=4, temperature=0,
                                             messages=[{"role": "user", "content": PROMPTS[0]}])
    assert answer.usage.completion_tokens == 4


def test_no_api_docs_are_served_around_the_token(client):
    """FastAPI's /docs, /redoc and /openapi.json would answer without the token: they are off."""
    base = client.http_base_url.removesuffix("/v1")
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        for headers in ({}, AUTH):
            assert httpx.get(base + path, headers=headers, timeout=60).status_code == 404, path
