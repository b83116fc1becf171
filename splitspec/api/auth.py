"""The bearer token a client sends, and the names the server checks it by (deployments.auth)."""

from __future__ import annotations

TOKEN_ENV = "SPLITSPEC_AUTH_TOKEN"
HEADER = "authorization"
SCHEME = "bearer"


def bearer(token: str) -> tuple[str, str]:
    """The metadata pair a client sends."""
    return HEADER, f"Bearer {token}"
