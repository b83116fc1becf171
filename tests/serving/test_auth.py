"""Bearer-token authentication through the real gRPC API: no token or a wrong one is UNAUTHENTICATED (no detail
beyond that), the right one is served; the token itself never reaches the config."""

import grpc
import pytest

from deployments.auth import bearer, read_token, token_digest
from deployments.config import AppConfig
from splitspec.client import SpecDecodeClient
from tests.serving.conftest import PROMPTS, make_config, serving

TOKEN = "test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def address():
    config = make_config(auth={"token_sha256": token_digest(TOKEN)})
    with serving(config) as client:
        yield client.address


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
