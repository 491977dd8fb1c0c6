"""aiohttp request-storage keys of the router (imported lazily, with the server)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

_key_type: Any = getattr(web, "RequestKey", None)  # aiohttp >= 3.12; plain strings before
STATUS: Any = _key_type("agentflow_status", int) if _key_type is not None else "agentflow_status"
"""The error status a stream reported after its 200 header (for the access log)."""
MAX_NEW_TOKENS: Any = (_key_type("agentflow_max_new_tokens", int) if _key_type is not None
                       else "agentflow_max_new_tokens")
"""How many tokens the turn was allowed to generate (the ``x-loongsage-max-new-tokens`` header)."""
MAX_NEW_TOKENS_HEADER = "x-loongsage-max-new-tokens"
