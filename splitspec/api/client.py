"""A small gRPC client of splitspec.v1.SpecDecode (what `splitspec generate` uses)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence

import grpc

from splitspec.api import auth
from splitspec.api.v1 import splitspec_pb2 as pb
from splitspec.api.v1 import splitspec_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# A call that finds no ingress replica (UNAVAILABLE: the service is starting or replacing one) or loses its ingress
# replica mid-call is sent again, up to RETRIES times, waiting RETRY_BACKOFF_S[0], doubling, at most
# RETRY_BACKOFF_S[1] between tries (about 23 s in all).
RETRIES = 6
RETRY_BACKOFF_S = (0.5, 8.0)
# An ingress replica that died during the call: UNAVAILABLE where it served the port itself (direct ingress: the
# connection breaks); through Ray 2.60's gRPC proxy, INTERNAL with Ray's actor-death message
# (ray/serve/_private/grpc_util.py maps RayActorError to INTERNAL). splitspec's own INTERNAL errors say "internal
# error (reference ...)" and are not retried.
LOST_INGRESS = "actor died unexpectedly"

MODES = {None: pb.SpeculationPolicy.MODE_UNSPECIFIED, True: pb.SpeculationPolicy.MODE_ON, False: pb.SpeculationPolicy.MODE_OFF}


def make_request(
    prompt: str = "",
    *,
    messages: Sequence[tuple[str, str]] = (),
    request_id: str = "",
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    speculate: bool | None = None,
    num_draft_tokens: int = 0,
    drafter: str = "",
    overlap: bool | None = None,
    stream: bool = False,
    logprobs: bool = False,
    top_logprobs: int = 0,
    json_schema: str = "",
):
    """A GenerateRequest (or GenerateStreamRequest with ``stream``) from keyword arguments."""
    cls = pb.GenerateStreamRequest if stream else pb.GenerateRequest
    request = cls(
        request_id=request_id,
        prompt=prompt,
        messages=[pb.ChatMessage(role=r, content=c) for r, c in messages],
        temperature=temperature,
        top_k=top_k,
        stop=list(stop),
        speculation=pb.SpeculationPolicy(mode=MODES[speculate], num_draft_tokens=num_draft_tokens, drafter=drafter),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        json_schema=json_schema,
    )
    if overlap is not None:
        request.speculation.overlap = overlap
    if max_new_tokens is not None:
        request.max_new_tokens = max_new_tokens
    if top_p is not None:
        request.top_p = top_p
    if seed is not None:
        request.seed = seed
    return request


def _log_retry(exc: grpc.RpcError, attempt: int, delay_s: float) -> None:
    logger.warning("%s: %s; retry %d of %d in %.1fs", exc.code().name, exc.details(), attempt, RETRIES, delay_s)


class SpecDecodeClient:
    """``token``: the server's bearer token (default: ``SPLITSPEC_AUTH_TOKEN``, if set; splitspec.api.auth).

    ``generate`` sends a call again when no ingress replica took it or its ingress replica died (``retryable``;
    ``retries`` times, with backoff, within ``timeout_s``), calling ``on_retry(error, attempt, delay_s)`` before each
    wait; so does ``stream_retrying`` until its first chunk. ``stream`` does not retry.
    """

    def __init__(self, address: str = "127.0.0.1:9000", *, application: str | None = None, timeout_s: float | None = None,
                 token: str | None = None, retries: int = RETRIES,
                 on_retry: Callable[[grpc.RpcError, int, float], None] = _log_retry):
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.SpecDecodeStub(self.channel)
        token = os.environ.get(auth.TOKEN_ENV, "").strip() if token is None else token
        self.metadata = ((("application", application),) if application else ()) + ((auth.bearer(token),) if token else ())
        self.timeout_s = timeout_s
        self.retries, self.on_retry = retries, on_retry

    def generate(self, prompt: str = "", **kwargs) -> pb.GenerateResponse:
        request = make_request(prompt, **kwargs)
        return self._retrying(lambda timeout: self.stub.Generate(request, metadata=self.metadata, timeout=timeout))

    def stream(self, prompt: str = "", **kwargs) -> Iterator[pb.GenerateStreamResponse]:
        """The stream call itself (it has ``cancel()``); no retries."""
        return self.stub.GenerateStream(make_request(prompt, stream=True, **kwargs), metadata=self.metadata,
                                        timeout=self.timeout_s)

    def stream_retrying(self, prompt: str = "", **kwargs) -> Iterator[pb.GenerateStreamResponse]:
        """Like ``stream``, but a stream that fails with UNAVAILABLE before its first chunk is opened again (after a
        chunk, the error is raised: the client has seen part of the answer)."""
        request = make_request(prompt, stream=True, **kwargs)
        first = self._retrying(lambda timeout: _first(self.stub.GenerateStream(request, metadata=self.metadata,
                                                                                timeout=timeout)))
        chunk, rest = first
        if chunk is not None:
            yield chunk
            yield from rest

    def _retrying(self, call: Callable[[float | None], object]):
        deadline = time.monotonic() + self.timeout_s if self.timeout_s is not None else None
        delay = RETRY_BACKOFF_S[0]
        for attempt in range(self.retries + 1):
            timeout = max(0.0, deadline - time.monotonic()) if deadline is not None else None
            try:
                return call(timeout)
            except grpc.RpcError as exc:
                late = deadline is not None and time.monotonic() + delay >= deadline
                if not retryable(exc) or attempt == self.retries or late:
                    raise
                self.on_retry(exc, attempt + 1, delay)
                time.sleep(delay)
                delay = min(2 * delay, RETRY_BACKOFF_S[1])
        raise AssertionError("unreachable")

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "SpecDecodeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def retryable(exc: grpc.RpcError) -> bool:
    """The call may be sent again: no ingress replica took it (UNAVAILABLE), or its ingress replica died."""
    code = exc.code()
    return code == grpc.StatusCode.UNAVAILABLE or (
        code == grpc.StatusCode.INTERNAL and LOST_INGRESS in (exc.details() or "").lower())


def _first(stream) -> tuple:
    """(first chunk or None, the stream): waits for the first chunk, so that an error before it is raised here."""
    return next(stream, None), stream
