"""The OpenAI-compatible HTTP API, answered by the ingress through Ray Serve's HTTP proxy (127.0.0.1:8000 by default).

    GET  /v1/models, /v1/models/{model}
    POST /v1/chat/completions, /v1/completions   stream: true -> server-sent events, then "data: [DONE]"
    GET  /health                                 200 when serving, else 503 (no token needed)

The routes are methods of ``SpecDecodeIngress`` (it inherits this mixin: Serve serves a FastAPI app's routes as
methods of the deployment) and drive only its public interface (``Ingress``), as the gRPC methods do;
``deployments.openai_protocol`` translates the JSON. Errors are OpenAI error JSON with their HTTP
status (400 bad input, 401 no token, 404 unknown model, 413 body over limits.max_request_bytes, 429 full, 503 stage
unavailable, 504 deadline).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deployments import api, tools
from deployments import openai_protocol as protocol
from deployments.config import AppConfig
from deployments.metrics import RequestMetrics
from deployments.status import ModelNotFoundError, RequestTooLargeError, to_status
from splitspec.api.v1 import splitspec_pb2 as pb

# no /docs, /redoc or /openapi.json: they would answer without the bearer token (api.md documents the API)
http_app = FastAPI(title="splitspec", version="v1", summary="OpenAI-compatible API of splitspec's speculative decoding",
                   docs_url=None, redoc_url=None, openapi_url=None)
CHAT, TEXT = "ChatCompletions", "Completions"  # their `method` label in splitspec_requests
# a client's request id (as vLLM takes it), else one made up; Serve's proxy echoes the header in the response
REQUEST_ID_HEADER = "x-request-id"


class Ingress(Protocol):
    """What the routes use of the ingress (deployments.ingress.SpecDecodeIngress)."""

    config: AppConfig
    metrics: RequestMetrics
    model_id: str  # the served model's name
    created: int  # when it was started (unix seconds)
    max_context: int  # the target's context window
    tokenizer: object  # the target's: the token texts of logprobs
    tool_format: tools.ToolFormat  # how tools go into prompts and calls come out of answers

    def authenticate(self, metadata) -> None: ...

    async def render_chat(self, messages: list[dict], tool_plan: tools.ToolPlan) -> str: ...

    async def plan(self, request) -> api.Plan: ...

    def text_steps(self, plan: api.Plan, timer: api.Timer, deadline: float) -> AsyncIterator: ...

    async def collect(self, plan: api.Plan, timer: api.Timer, deadline: float) -> api.Answer: ...

    async def serving(self) -> bool: ...


class OpenAIRoutes:
    """The HTTP routes of an ``Ingress`` (``SpecDecodeIngress`` inherits them)."""

    @http_app.get("/v1/models")
    async def list_models(self, request: Request) -> Response:
        try:
            self.authenticate(request.headers.items())
        except Exception as exc:  # noqa: BLE001 - an error becomes its HTTP status here
            return _error_response(exc)
        return JSONResponse(protocol.models(self.model_id, self.created, self.max_context))

    @http_app.get("/v1/models/{model:path}")
    async def retrieve_model(self, model: str, request: Request) -> Response:
        try:
            self.authenticate(request.headers.items())
            self._check_model(model)
        except Exception as exc:  # noqa: BLE001
            return _error_response(exc)
        return JSONResponse(protocol.model_card(self.model_id, self.created, self.max_context))

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    @http_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    @http_app.get("/health")
    async def health(self) -> Response:
        serving = await self.serving()
        return JSONResponse({"status": "SERVING" if serving else "NOT_SERVING"}, status_code=200 if serving else 503)

    # -- a completion, whole or streamed --------------------------------------------------------------------------

    async def _complete(self, request: Request, *, chat: bool) -> Response:
        method = CHAT if chat else TEXT
        timer = api.Timer()
        deadline = time.monotonic() + self.config.limits.request_timeout_s
        try:
            self.authenticate(request.headers.items())
            body = protocol.parse_body(protocol.ChatCompletionRequest if chat else protocol.CompletionRequest,
                                       await _body(request, self.config.limits.max_request_bytes))
            self._check_model(body.model)
            calls, prompt = None, None
            if chat:
                calls, messages = protocol.tool_plan(body, self.tool_format.parser), protocol.chat_messages(body)
                if tools.uses_template(self.tool_format, messages, calls):  # (its size checked before it is rendered)
                    api.check_size(pb.GenerateRequest(messages=[pb.ChatMessage(role=m["role"], content=m["content"])
                                                                for m in messages]), self.config)
                    prompt = await self.render_chat(messages, calls)
            message = protocol.generate_request(body, request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex, calls,
                                                prompt)
            plan = await self.plan(message)
            options = body.stream_options or protocol.StreamOptions()
            completion = protocol.Completion(chat, plan, self.model_id, include_usage=options.include_usage,
                                             continuous_usage=options.include_usage and options.continuous_usage_stats,
                                             tokenizer=self.tokenizer,
                                             tool_plan=calls)
            if body.stream:
                steps = self.text_steps(plan, timer, deadline)
                first = await anext(steps)  # prefill's token: what fails up to here still gets its HTTP status
                return StreamingResponse(self._events(method, completion, first, steps, timer),
                                         media_type="text/event-stream")
            answer = await self.collect(plan, timer, deadline)
        except asyncio.CancelledError:
            self.metrics.finished(method, "CANCELLED")
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes its HTTP status here
            return _error_response(exc, self.metrics, method)
        self.metrics.finished(method, "ok", timer.seconds())
        return JSONResponse(completion.response(answer.text, answer.finish_reason, len(answer.token_ids), timer.timings(),
                                                answer.logprobs))

    async def _events(self, method: str, completion: protocol.Completion, first, steps: AsyncIterator,
                      timer: api.Timer) -> AsyncIterator[str]:
        """Server-sent events: the role (chat), each step's new text, the finish reason with splitspec's stats, the
        usage if asked, then [DONE]. An error after the first event is an error event (the status is sent)."""
        completion_tokens = 0
        try:
            if completion.chat:
                yield _event(completion.chunk("", role=True))
            item = first
            while item is not None:
                step, token_ids, text = item
                completion_tokens += len(token_ids)
                if text or step.logprobs:  # (a step whose text is held back still sends its tokens' logprobs)
                    yield _event(completion.chunk(text, completion_tokens=completion_tokens, logprobs=step.logprobs))
                if step.finish_reason:
                    for held in completion.held_back():  # (text held back as a possible tool call; the calls)
                        yield _event(held)
                    yield _event(completion.chunk(None, step.finish_reason, completion_tokens=completion_tokens)
                                 | protocol.extensions(completion.plan, timer.timings()))
                    if completion.include_usage:
                        yield _event(completion.usage_chunk(completion_tokens))
                    self.metrics.finished(method, "ok", timer.seconds())
                    break
                item = await anext(steps, None)
        except asyncio.CancelledError:  # the client went away
            self.metrics.finished(method, "CANCELLED")
            raise
        except Exception as exc:  # noqa: BLE001
            yield _event(_error(exc, self.metrics, method)[1])
        finally:
            await steps.aclose()  # closes the request's sessions
        yield protocol.DONE

    def _check_model(self, model: str | None) -> None:
        if model and model != self.model_id:
            raise ModelNotFoundError(f"the model {model!r} does not exist: this server serves {self.model_id!r} "
                                     "(GET /v1/models)")


async def _body(request: Request, limit: int) -> bytes:
    """The request's body, read as it arrives: one over ``limit`` bytes is refused (413) as soon as its
    Content-Length or its bytes so far say so, without buffering the rest."""
    too_large = RequestTooLargeError(f"the request body is larger than this server's limit of {limit} bytes "
                                     "(limits.max_request_bytes)")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _error(exc: Exception, metrics=None, method: str = "") -> tuple[int, dict]:
    """(HTTP status, OpenAI error JSON) of ``exc``; with ``metrics``, the request is counted with its outcome."""
    code, message = to_status(exc)
    if metrics is not None:
        metrics.finished(method, code.name)
    return protocol.error(code, message)


def _error_response(exc: Exception, metrics=None, method: str = "") -> JSONResponse:
    status, body = _error(exc, metrics, method)
    if isinstance(exc, RequestTooLargeError):  # (RESOURCE_EXHAUSTED would be 429: retrying will not help)
        status, body = 413, {"error": body["error"] | {"type": "invalid_request_error", "code": 413}}
    return JSONResponse(body, status_code=status)
