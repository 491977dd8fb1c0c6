"""What a weight sender accepts as a target: an engine base URL or an engine object that has one."""

from __future__ import annotations

from typing import Any


def target_url(target: Any, transport: str) -> str:
    """``target`` as an ``http://host:port`` base URL.

    Accepts a URL string or an engine object with a ``base_url`` (the controller passes its local
    :class:`~loongsage_plugin_sglang.server.SGLangServer` in colocated runs).
    """
    if isinstance(target, str) and target.startswith(("http://", "https://")):
        return target.rstrip("/")
    url = getattr(target, "base_url", None)
    if isinstance(url, str) and url.startswith(("http://", "https://")):
        return url.rstrip("/")
    raise TypeError(f"{transport} weight transport: a target must be an SGLang server base URL (http://host:port) "
                    f"or a started engine with a base_url, got {target!r}")
