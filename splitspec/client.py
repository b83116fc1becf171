"""A small gRPC client of splitspec.v1.SpecDecode (what `splitspec generate` uses)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import grpc

from deployments import auth
from splitspec.v1 import splitspec_pb2 as pb
from splitspec.v1 import splitspec_pb2_grpc as pb_grpc

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


class SpecDecodeClient:
    """``token``: the server's bearer token (default: ``SPLITSPEC_AUTH_TOKEN``, if set; deployments.auth)."""

    def __init__(self, address: str = "127.0.0.1:9000", *, application: str | None = None, timeout_s: float | None = None,
                 token: str | None = None):
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.SpecDecodeStub(self.channel)
        token = os.environ.get(auth.TOKEN_ENV, "").strip() if token is None else token
        self.metadata = ((("application", application),) if application else ()) + ((auth.bearer(token),) if token else ())
        self.timeout_s = timeout_s

    def generate(self, prompt: str = "", **kwargs) -> pb.GenerateResponse:
        return self.stub.Generate(make_request(prompt, **kwargs), metadata=self.metadata, timeout=self.timeout_s)

    def stream(self, prompt: str = "", **kwargs) -> Iterator[pb.GenerateStreamResponse]:
        return self.stub.GenerateStream(make_request(prompt, stream=True, **kwargs), metadata=self.metadata,
                                        timeout=self.timeout_s)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "SpecDecodeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
