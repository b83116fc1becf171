"""Bearer-token authentication through the real gRPC and HTTP APIs: no token or a wrong one is UNAUTHENTICATED / 401
(no detail beyond that), the right one is served; the token itself never reaches the config."""

import grpc
import httpx2 as httpx
import openai
import pytest

from deployments.auth import read_token, token_digest
from splitspec.api.auth import bearer
from deployments.config import AppConfig
from splitspec.api.client import SpecDecodeClient
from tests.serving.conftest import PROMPTS, make_config, serving

TOKEN = "test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def service():
    config = make_config(auth={"token_sha256": token_digest(TOKEN)})
    with serving(config) as client:
        yield client


@pytest.fixture(scope="module")
def address(service):
    return service.address


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789", TOKEN[:-1]])
def test_calls_without_the_token_are_unauthenticated(address, token):
    with SpecDecodeClient(address, token=token, timeout_s=120) as client:
        with pytest.raises(grpc.RpcError) as unary:
            client.generate(messages=[("user", PROMPTS[0])], max_new_tokens=4)
        with pytest.raises(grpc.RpcError) as stream:
            list(client.stream(messages=[("user", PROMPTS[0])], max_new_tokens=4))
    for error in (unary.value, stream.value):
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error.details() == "unauthenticated"


def test_calls_with_the_token_are_served(address):
    with SpecDecodeClient(address, token=TOKEN, timeout_s=120) as client:
        assert len(client.generate(messages=[("user", PROMPTS[0])], max_new_tokens=4).token_ids) == 4
        assert sum(len(c.token_ids) for c in client.stream(messages=[("user", PROMPTS[1])], max_new_tokens=4)) == 4
        assert client.metadata[-1] == bearer(TOKEN)


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
def test_http_calls_without_the_token_get_401(service, token):
    headers = {"authorization": f"Bearer {token}"} if token else {}
    for method, path, body in (("GET", "/models", None), ("POST", "/chat/completions", {
            "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 4}), ("POST", "/completions", {
            "prompt": "Hello", "max_tokens": 4, "stream": True})):
        response = httpx.request(method, service.http_base_url + path, json=body, headers=headers, timeout=60)
        assert response.status_code == 401
        assert response.json()["error"] == {"message": "unauthenticated", "type": "authentication_error",
                                                  "param": None, "code": 401}
    with openai.OpenAI(base_url=service.http_base_url, api_key=token or "none", max_retries=0) as oai:
        with pytest.raises(openai.AuthenticationError):
            oai.models.list()
    assert httpx.get(service.http_base_url.removesuffix("/v1") + "/health", timeout=60).status_code == 200  # a probe


def test_http_calls_with_the_token_are_served(service):
    with openai.OpenAI(base_url=service.http_base_url, api_key=TOKEN, max_retries=0, timeout=120) as oai:
        answer = oai.chat.completions.create(model=oai.models.list().data[0].id, max_tokens=4, temperature=0,
                                             messages=[{"role": "user", "content": PROMPTS[0]}])
    assert answer.usage.completion_tokens == 4


def test_no_api_docs_are_served_around_the_token(service):
    """FastAPI's /docs, /redoc and /openapi.json would answer without the token: they are off."""
    base = service.http_base_url.removesuffix("/v1")
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        for headers in ({}, {"authorization": f"Bearer {TOKEN}"}):
            assert httpx.get(base + path, headers=headers, timeout=60).status_code == 404, path
