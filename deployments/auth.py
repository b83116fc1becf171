"""Bearer-token authentication of the gRPC API, checked at the edge (the ingress).

The service never holds the token: the app config carries its SHA-256
(``auth.token_sha256``), which is safe to appear in Serve's config, the Ray
dashboard and logs. A call's ``authorization: Bearer <token>`` metadata is
hashed and compared with it in constant time (``hmac.compare_digest``).
`splitspec serve` takes the token from ``SPLITSPEC_AUTH_TOKEN`` or
``--auth-token-file``; clients send it from ``--token`` or the same variable.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from pathlib import Path

from splitspec.api.auth import HEADER, SCHEME, TOKEN_ENV

MIN_TOKEN_CHARS = 16  # a shorter token is refused at start: it could be guessed


def token_digest(token: str) -> str:
    """The hex SHA-256 of a token (what the config holds)."""
    return hashlib.sha256(token.encode()).hexdigest()


def read_token(path: str | None = None) -> str:
    """The server's token: the file's content (stripped) if ``path``, else ``SPLITSPEC_AUTH_TOKEN``, else "" (none)."""
    token = Path(path).read_text().strip() if path else os.environ.get(TOKEN_ENV, "").strip()
    if token and len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the auth token must have at least {MIN_TOKEN_CHARS} characters (e.g. `openssl rand -hex 32`)")
    return token


def authenticated(metadata: Iterable[tuple[str, str]], expected_digest: str) -> bool:
    """Whether a call's metadata carries ``authorization: Bearer <token>`` with the token of ``expected_digest``."""
    presented = next((value for key, value in metadata if key.lower() == HEADER), "")
    scheme, _, token = presented.partition(" ")
    digest = token_digest(token.strip()) if scheme.lower() == SCHEME else ""
    return hmac.compare_digest(digest.encode(), expected_digest.encode())
