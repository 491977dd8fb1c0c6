"""Serving HTTP from a background thread behind the run secret, and the run secret's rules: control
endpoints need it, and anything listening beyond loopback must require it."""

from __future__ import annotations

from ..http_server import ThreadedServer, secret_middleware
from ..security import (
    OPEN_PATHS,
    check_listen_address,
    engine_headers,
    presented_token,
    process_secret,
    token_matches,
)

__all__ = ["OPEN_PATHS", "ThreadedServer", "check_listen_address", "engine_headers", "presented_token",
           "process_secret", "secret_middleware", "token_matches"]
