"""The ``config`` argument of the ``opencode`` agent: the user's own OpenCode settings.

OpenCode reads one ``opencode.json``; the agent writes it (provider at the trajectory's URL,
permissions, no update checks). A job adds its settings through ``agent_args.config``, deep-merged
over the agent's: objects merge key by key, anything else replaces. Typical use: an agent's short
``prompt`` and the few ``tools`` a task needs, so the CLI sends a few hundred tokens of system
prompt and tool schemas rather than its default ~20K.

OpenCode itself ignores a top-level key it does not know, so a typo would silently change nothing:
:func:`check_opencode_config` rejects it, naming the key. The trajectory's endpoint and key
(``provider.loongsage.options.baseURL`` / ``apiKey``) belong to the agent and cannot be set.
"""

from __future__ import annotations

import copy
from typing import Any

OPENCODE_CONFIG_KEYS = frozenset({
    "$schema", "shell", "logLevel", "server", "command", "skills", "references", "reference", "watcher", "snapshot",
    "plugin", "share", "autoshare", "autoupdate", "disabled_providers", "enabled_providers", "model", "small_model",
    "default_agent", "subagent_depth", "username", "mode", "agent", "provider", "mcp", "formatter", "lsp",
    "instructions", "layout", "permission", "tools", "attachment", "enterprise", "tool_output", "compaction",
    "experimental"})
"""The top-level keys of OpenCode's config schema (``opencode-ai`` 1.18, the version
``scripts/install_agent_clis.sh`` pins)."""

AGENT_OWNED = ("baseURL", "apiKey")
"""Options of the agent's own provider that the trajectory sets."""


class OpenCodeConfigError(ValueError):
    """``agent_args.config`` of the ``opencode`` agent is not a config this agent can merge."""


def check_opencode_config(config: Any) -> dict[str, Any]:
    """``config`` as a dict (``{}`` for None); :class:`OpenCodeConfigError` naming the bad key."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise OpenCodeConfigError(f"opencode agent: agent_args.config must be a table of opencode.json keys, "
                                  f"got {type(config).__name__}")
    unknown = sorted(str(k) for k in config if k not in OPENCODE_CONFIG_KEYS)
    if unknown:
        raise OpenCodeConfigError(f"opencode agent: agent_args.config.{unknown[0]} is not an OpenCode config key "
                                  f"(OpenCode would ignore it); valid: {', '.join(sorted(OPENCODE_CONFIG_KEYS))}")
    for key in ("agent", "provider", "permission", "tools", "mode"):
        if key in config and not isinstance(config[key], (dict, str) if key == "permission" else dict):
            raise OpenCodeConfigError(f"opencode agent: agent_args.config.{key} must be a table, "
                                      f"got {type(config[key]).__name__}")
    options = ((config.get("provider") or {}).get("loongsage") or {}).get("options") or {}
    owned = [k for k in AGENT_OWNED if k in options]
    if owned:
        raise OpenCodeConfigError(f"opencode agent: agent_args.config.provider.loongsage.options.{owned[0]} is the "
                                  f"trajectory's own (the router's URL and key) and cannot be set")
    return copy.deepcopy(config)


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``extra``: nested dicts merged key by key, other values replaced (copies)."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
