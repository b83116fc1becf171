"""The OpenAI API's JSON, translated: chat / completion bodies in, splitspec.v1 requests out, and responses back.

Pure translation, no Ray and no HTTP: a body becomes a ``pb.GenerateRequest`` that the gRPC methods' validation
(``deployments.api.parse``) and loop take as they are, so the HTTP API decodes exactly as gRPC does. Fields of the
OpenAI API that splitspec cannot honour (n > 1, tools, penalties, ...) are refused with a 400 that names them; fields
that change nothing about the output (``user``, ``metadata``, ``store``, ...) are ignored, as vLLM does. Logprobs are
the target's (services.logprobs), in the chat API's shape (``logprobs.content``) or the legacy completions one
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``). A body's ``response_format`` (chat; completions too, as
vLLM) (``json_schema`` or ``json_object``) is the request's ``json_schema`` (structured outputs: services.constraint).
Tool calls (``tools``, ``tool_choice``, ``parallel_tool_calls``, and the history's calls and results) go through
``deployments.tools``: the prompt format, a forced choice's schema, the answer parsed back into ``tool_calls``.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

import grpc
from google.protobuf import json_format
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments import api, tools
from services.errors import InvalidRequestError
from services.grammar import JSON_OBJECT_SCHEMA
from services.logprobs import TokenLogprob
from services.loop import FINISH_LENGTH, FINISH_STOP
from services.sampling import MAX_TOP_LOGPROBS
from services.text import token_pieces
from splitspec.api.v1 import splitspec_pb2 as pb

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions (chat: the server's default)
DEFAULT_TEMPERATURE = 1.0  # the OpenAI API's default: a body without temperature samples (0 = greedy)
OWNED_BY = "splitspec"
FINISH = {FINISH_STOP: "stop", api.FINISH_STOP_SEQUENCE: "stop", FINISH_LENGTH: "length"}
MODES = {"default": pb.SpeculationPolicy.MODE_UNSPECIFIED, "on": pb.SpeculationPolicy.MODE_ON,
         "off": pb.SpeculationPolicy.MODE_OFF}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}  # developer: o1's system
DONE = "data: [DONE]\n\n"

# HTTP status and OpenAI error type of each gRPC status the edge maps an error to (deployments.status.to_status)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
SERVER_ERROR = (500, "server_error")


# -- request bodies ------------------------------------------------------------------------------------------------


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI fields that change nothing here (user, metadata, store, ...)


class Speculation(BaseModel):
    """splitspec's extension: the request's speculation policy (splitspec.v1.SpeculationPolicy)."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["default", "on", "off"] = Field("default", description="default: the server's policy")
    num_draft_tokens: int = Field(0, ge=0, description="k, pinned; 0 = the server's default (adaptive)")
    drafter: str = Field("", description="model, eagle or prompt_lookup; empty = the server's default")
    overlap: bool | None = Field(None, description="pre-drafting; unset = the server's default")


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's extension: every chunk carries the usage so far")


class TextPart(_Lenient):
    type: str
    text: str | None = None


class Message(_Lenient):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls (deployments.tools renders them)
    tool_call_id: str | None = None  # a tool message's: the call it answers


class _Sampling(_Lenient):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, description="extension (as vLLM): 0 or -1 = off")
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    speculation: Speculation | None = None
    response_format: dict[str, Any] | None = None  # (completions: an extension, as vLLM's)


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="with logprobs: alternatives a token")
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="the legacy API's: alternatives a token")
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


def parse_body(model: type[_Sampling], raw: bytes) -> _Sampling:
    """A request body, validated; InvalidRequestError (400) naming the first bad field otherwise."""
    try:
        body = model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise InvalidRequestError(f"invalid request body: {where}: {first['msg']}") from None
    _refuse_unsupported(body)
    return body


def _refuse_unsupported(body: _Sampling) -> None:
    unsupported = {
        "n": body.n not in (None, 1),
        "presence_penalty": bool(body.presence_penalty),
        "frequency_penalty": bool(body.frequency_penalty),
        "logit_bias": bool(body.logit_bias),
    }
    if isinstance(body, ChatCompletionRequest):
        unsupported |= {
            "functions": bool(body.functions),
        }
    else:
        unsupported |= {"echo": bool(body.echo), "suffix": bool(body.suffix), "best_of": body.best_of not in (None, 1)}
    refused = [name for name, used in unsupported.items() if used]
    if refused:
        hint = " (splitspec returns one choice per request)" if "n" in refused else ""
        raise InvalidRequestError(f"{', '.join(refused)}: not supported by splitspec{hint}; leave "
                                  f"{'it' if len(refused) == 1 else 'them'} unset")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true")


def json_schema_of(response_format: dict[str, Any] | None) -> str:
    """The splitspec.v1 ``json_schema`` of a body's ``response_format`` (empty for text). ``strict`` changes
    nothing: the schema is always enforced (its grammar masks every token)."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return ""
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise InvalidRequestError('response_format of type json_schema needs its schema: {"type": "json_schema", '
                                      '"json_schema": {"name": "...", "schema": {...}}}')
        return json.dumps(spec["schema"])
    raise InvalidRequestError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")


def generate_request(body: _Sampling, request_id: str, calls: tools.ToolPlan | None = None,
                     prompt: str | None = None) -> pb.GenerateRequest:
    """The splitspec.v1 request of a chat or completion body (validated further by ``api.parse``); ``calls``: the chat
    body's ``tool_plan``, where the caller has it already; ``prompt``: the chat's prompt text where the model's own
    template rendered it (tools.render_prompt), else its messages go as chat turns."""
    request = pb.GenerateRequest(
        request_id=request_id,
        temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_k=max(0, body.top_k or 0),
        stop=[body.stop] if isinstance(body.stop, str) else body.stop or [],
    )
    if body.top_p is not None:
        request.top_p = body.top_p
    if body.seed is not None:
        request.seed = body.seed
    if isinstance(body, ChatCompletionRequest):
        calls = tool_plan(body) if calls is None else calls
        if prompt is not None:
            request.prompt = prompt
        else:
            request.messages.extend(pb.ChatMessage(role=_role(role), content=content)
                                    for role, content in tools.render_messages(chat_messages(body), calls))
        max_tokens = body.max_completion_tokens or body.max_tokens
        request.logprobs, request.top_logprobs = bool(body.logprobs), body.top_logprobs or 0
        request.json_schema = json_schema_of(body.response_format)
        if calls.forced is not None:
            if request.json_schema:
                raise InvalidRequestError("response_format and a forced tool_choice both decide the answer's "
                                          "format: send one of them")
            request.json_schema = json.dumps(calls.forced)
    else:
        request.prompt = _prompt(body.prompt)
        max_tokens = body.max_tokens
        request.logprobs, request.top_logprobs = body.logprobs is not None, body.logprobs or 0
        request.json_schema = json_schema_of(body.response_format)
    if max_tokens is not None:
        request.max_new_tokens = min(max_tokens, 2**32 - 1)  # (api.parse refuses what exceeds the server's limit)
    if body.speculation is not None:
        s = body.speculation
        request.speculation.CopyFrom(pb.SpeculationPolicy(mode=MODES[s.mode], num_draft_tokens=s.num_draft_tokens,
                                                          drafter=s.drafter))
        if s.overlap is not None:
            request.speculation.overlap = s.overlap
    return request


def tool_plan(body: ChatCompletionRequest, parser: tools.ToolParser = tools.HERMES) -> tools.ToolPlan:
    """What the body's tools ask of the answer (deployments.tools), its auto answers read by ``parser``."""
    return tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls, parser)


def chat_messages(body: ChatCompletionRequest) -> list[dict]:
    """The body's messages as dicts (text content; an assistant's tool calls, a tool message's call id); a role
    other than the API's is refused."""
    for m in body.messages:
        if m.role != "tool":
            _role(m.role)
    return [{"role": m.role, "content": _text(m), "tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id}
            for m in body.messages]


def _role(role: str) -> str:
    if role not in ROLES:
        raise InvalidRequestError(f"chat message role must be one of {list(ROLES) + ['tool']}, got {role!r}")
    return ROLES[role]


def _text(message: Message) -> str:
    if isinstance(message.content, list):  # content parts: only text (joined by newlines, as vLLM does)
        kinds = {part.type for part in message.content} - {"text"}
        if kinds:
            raise InvalidRequestError(f"chat content parts of type {sorted(kinds)} are not supported: send text")
        return "\n".join(part.text or "" for part in message.content)
    return message.content or ""


def _prompt(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if prompt and all(isinstance(p, str) for p in prompt):
        raise InvalidRequestError(f"prompt has {len(prompt)} strings: send one prompt per request")
    raise InvalidRequestError("prompt must be text: token-id prompts are not supported")


# -- responses -------------------------------------------------------------------------------------------------------


def usage(plan: api.Plan, completion_tokens: int) -> dict:
    prompt_tokens = len(plan.prompt_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def extensions(plan: api.Plan, timings: pb.Timings) -> dict:
    """splitspec's fields beside the OpenAI ones: what speculation did, and the server's timings (ms)."""
    return {"speculation_stats": _plain(api.speculation_stats(plan)), "timings": _plain(timings)}


def _plain(message) -> dict:
    return json_format.MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


class Completion:
    """Responses of one request, chat (``chat.completion``) or text (``text_completion``); ids as OpenAI's."""

    def __init__(self, chat: bool, plan: api.Plan, model: str, *, include_usage: bool = False,
                 continuous_usage: bool = False, tokenizer=None, tool_plan: tools.ToolPlan | None = None):
        self.chat, self.plan, self.model = chat, plan, model
        self.tools = tools.StreamedAnswer(tool_plan or tools.ToolPlan())  # a streamed answer's held-back text
        self.called = False  # the answer was tool calls (finish_reason "tool_calls")
        self.include_usage = include_usage  # stream_options.include_usage: chunks carry "usage": null, the last one it
        self.continuous_usage = continuous_usage  # stream_options.continuous_usage_stats: each chunk the usage so far
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{plan.request_id}"
        self.created = int(time.time())
        self.tokenizer = tokenizer  # the token texts of logprobs (a request that asks for them)
        self.text_offset = 0  # the legacy logprobs' text_offset: characters of the token texts so far

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """A choice's ``logprobs`` for ``entries`` (the next tokens'); None where the request did not ask."""
        if self.plan.params.logprobs is None:
            return None
        entries = entries or []
        ids = [e.token_id for e in entries] + [t for e in entries for t, _ in e.top]
        pieces = dict(zip(ids, token_pieces(self.tokenizer, ids)))  # id -> (text, bytes)
        if self.chat:
            def described(token: int, logprob: float) -> dict:
                text, raw = pieces[token]
                return {"token": text, "logprob": logprob, "bytes": list(raw)}

            return {"content": [described(e.token_id, e.logprob) | {"top_logprobs": [described(*t) for t in e.top]}
                                for e in entries]}
        offsets = []
        for e in entries:
            offsets.append(self.text_offset)
            self.text_offset += len(pieces[e.token_id][0])
        # the legacy top_logprobs: the position's likeliest tokens and the sampled one, by text
        tops = [{pieces[t][0]: v for t, v in e.top} | {pieces[e.token_id][0]: e.logprob} for e in entries]
        return {"tokens": [pieces[e.token_id][0] for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": tops, "text_offset": offsets}

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def response(self, text: str, finish_reason: str, completion_tokens: int, timings: pb.Timings,
                 logprobs: list[TokenLogprob] | None = None) -> dict:
        """The whole answer; ``logprobs``: its tokens' (where the request asks for them)."""
        content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        if self.chat:
            text, calls = tools.parse_answer(text, self.tools.plan)
            if calls:
                self.called = True
                content["message"] = {"role": "assistant", "content": text or None,
                                      "tool_calls": [call.to_openai() for call in calls]}
        choice = {"index": 0, **content, "logprobs": self.logprobs(logprobs), "finish_reason": self._finish(finish_reason)}
        return {**self._head(False), "choices": [choice], "usage": usage(self.plan, completion_tokens),
                **extensions(self.plan, timings)}

    def chunk(self, text: str | None, finish_reason: str = "", *, role: bool = False, completion_tokens: int = 0,
              logprobs: list[TokenLogprob] | None = None) -> dict:
        """One streamed chunk: new text (chat: ``role`` opens the message) and its tokens' ``logprobs`` (where the
        request asks for them) and, last, the finish reason; ``completion_tokens``: sent so far (with continuous usage)."""
        if self.chat:
            if text and not role:
                text = self.tools.feed(text)  # (the text that may be a tool call is held back)
            delta = {"role": "assistant", "content": text or ""} if role else {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        described = self.logprobs(logprobs) if logprobs is not None else None
        choice |= {"logprobs": described, "finish_reason": self._finish(finish_reason) if finish_reason else None}
        if self.continuous_usage:
            return {**self._head(True), "choices": [choice], "usage": usage(self.plan, completion_tokens)}
        return {**self._head(True), "choices": [choice], **({"usage": None} if self.include_usage else {})}

    def held_back(self) -> list[dict]:
        """A chat stream's last chunks before its finish: the text held back as a possible tool call, then the calls
        (one delta each, as the ``openai`` client assembles them)."""
        if not self.chat:
            return []
        rest, calls = self.tools.finish()
        out = [self._delta({"content": rest})] if rest else []
        self.called = bool(calls)
        out += [self._delta({"tool_calls": [call.to_openai(index)]}) for index, call in enumerate(calls)]
        return out

    def _delta(self, delta: dict) -> dict:
        return {**self._head(True), "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
                **({"usage": None} if self.include_usage else {})}

    def _finish(self, finish_reason: str) -> str:
        return "tool_calls" if self.called else FINISH[finish_reason]

    def usage_chunk(self, completion_tokens: int) -> dict:
        """``stream_options.include_usage``: the last chunk, with no choices."""
        return {**self._head(True), "choices": [], "usage": usage(self.plan, completion_tokens)}


def models(model: str, created: int, max_context: int) -> dict:
    return {"object": "list", "data": [model_card(model, created, max_context)]}


def model_card(model: str, created: int, max_context: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": OWNED_BY, "max_model_len": max_context}


def error(code: grpc.StatusCode, message: str) -> tuple[int, dict]:
    """(HTTP status, OpenAI error JSON) of an error the edge mapped to ``code``."""
    status, kind = HTTP_STATUS.get(code, SERVER_ERROR)
    return status, {"error": {"message": message, "type": kind, "param": None, "code": status}}
