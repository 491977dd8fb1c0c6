"""The agents ``codex``, ``claude_code`` and ``opencode``: the real CLIs, trained as they are.

Each subclass of :class:`~.cli_runner.CliAgent` writes its CLI's configuration into the throwaway
home, pointing it at the trajectory's base URL, and reads the final answer from the CLI's output:

* ``codex`` (OpenAI Codex CLI, ``codex exec``): ``$CODEX_HOME/config.toml`` defines a model
  provider with the Responses wire API at the trajectory's ``.../v1``; no retries, update checks,
  analytics or hosted tools (web search, image generation, sub-agents, goals); commands the model
  runs execute without approval prompts in the working directory (``sandbox_mode`` from the
  ``sandbox`` argument). The answer is the file ``codex exec -o`` writes.
* ``claude_code`` (Anthropic Claude Code, ``claude -p``): ``ANTHROPIC_BASE_URL`` (the base URL
  without ``/v1``: the CLI appends ``/v1/messages``), ``ANTHROPIC_API_KEY`` and every model alias
  set to ``model``; telemetry, error reporting, auto-updates and non-essential traffic off; tools
  run without permission prompts. The answer is ``result`` of ``--output-format json``.
* ``opencode`` (``opencode run``): ``$XDG_CONFIG_HOME/opencode/opencode.json`` defines an
  OpenAI-compatible provider (the AI SDK's chat completions) at the trajectory's ``.../v1`` with
  the model's context window; auto-update, sharing, model-list fetches, LSP downloads and external
  plugins off; tools allowed without prompts. The answer is the text of ``--format json`` events.
  ``config`` (an agent argument) is deep-merged into that file: the user's own settings, e.g. an
  agent's short ``prompt`` and the ``tools`` it may use (see :mod:`.opencode_config`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from loongsage_hookspecs import AgentContext

from .cli_runner import CliAgent, CliAgentError
from .opencode_config import check_opencode_config, deep_merge


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


class CodexAgent(CliAgent):
    """OpenAI Codex CLI over the Responses API. Extra argument: ``sandbox`` (Codex's own
    ``sandbox_mode``: ``workspace-write`` by default; ``danger-full-access`` when the framework's
    sandbox isolates the run already and Codex's own sandboxing cannot work, e.g. in containers)."""

    name = "codex"
    binary_name = "codex"
    package = "@openai/codex"
    DISABLED_FEATURES = ("goals", "image_generation", "view_image", "apps", "shell_snapshot")

    def __init__(self, *args: Any, sandbox: str = "workspace-write", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sandbox = sandbox

    def configure(self, home: str, ctx: AgentContext, workdir: str) -> dict[str, str]:
        codex_home = os.path.join(home, ".codex")
        os.makedirs(codex_home, exist_ok=True)
        features = "\n".join(f"{f} = false" for f in self.DISABLED_FEATURES)
        config = f"""\
model = {_toml_str(self.model)}
model_provider = "loongsage"
model_context_window = {self.context_window}
model_reasoning_summary = "none"
approval_policy = "never"
sandbox_mode = {_toml_str(self.sandbox)}
web_search = "disabled"
check_for_update_on_startup = false
hide_agent_reasoning = true

[model_providers.loongsage]
name = "LoongSage AgentFlow"
base_url = {_toml_str(ctx.base_url)}
wire_api = "responses"
env_key = "LOONGSAGE_API_KEY"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[agents]
enabled = false

[features]
{features}

[projects.{_toml_str(workdir)}]
trust_level = "trusted"
"""
        with open(os.path.join(codex_home, "config.toml"), "w", encoding="utf-8") as f:
            f.write(config)
        return {"CODEX_HOME": codex_home, "LOONGSAGE_API_KEY": ctx.api_key or "loongsage"}

    def command(self, prompt: str, home: str, workdir: str) -> list[str]:
        return ["exec", "--skip-git-repo-check", "--ephemeral", "--color", "never",
                "-o", os.path.join(home, "last_message.txt"), "--", prompt]

    def answer(self, stdout: str, stderr: str, home: str) -> str:
        path = os.path.join(home, "last_message.txt")
        if os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read().strip()
        raise CliAgentError(f"codex agent: codex wrote no final message: {stderr[-2000:]}")


class ClaudeCodeAgent(CliAgent):
    """Anthropic Claude Code over the Messages API (``claude -p``)."""

    name = "claude_code"
    binary_name = "claude"
    package = "@anthropic-ai/claude-code"

    def configure(self, home: str, ctx: AgentContext, workdir: str) -> dict[str, str]:
        base = ctx.base_url.rstrip("/")
        base = base[: -len("/v1")] if base.endswith("/v1") else base
        model = self.model
        return {
            "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": ctx.api_key or "loongsage",
            "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(self.max_output_tokens), "CLAUDE_CODE_MAX_RETRIES": "0",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_UPDATES": "1",
            "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1", "DISABLE_COST_WARNINGS": "1",
            "CLAUDE_CODE_DISABLE_AUTO_MEMORY": "1", "IS_SANDBOX": "1",  # no permission prompts, also as root
        }

    def command(self, prompt: str, home: str, workdir: str) -> list[str]:
        return ["-p", prompt, "--output-format", "json", "--model", self.model,
                "--dangerously-skip-permissions", "--no-session-persistence"]

    def answer(self, stdout: str, stderr: str, home: str) -> str:
        result = _last_json(stdout, lambda d: d.get("type") == "result")
        if result is None:
            raise CliAgentError(f"claude_code agent: no result in claude's output: {(stderr or stdout)[-2000:]}")
        if result.get("is_error"):
            raise CliAgentError(f"claude_code agent: claude reported an error: {str(result.get('result'))[-2000:]}")
        return str(result.get("result") or "").strip()


class OpenCodeAgent(CliAgent):
    """OpenCode over chat completions (``opencode run``). Extra argument: ``config``, OpenCode
    settings (``opencode.json`` keys) deep-merged over the agent's own: e.g. ``{"agent": {"build":
    {"prompt": "...", "tools": {"*": false, "write": true}}}}`` gives the default agent a short
    system prompt and only the ``write`` tool (and ``edit``, which OpenCode grants with it). The
    provider's endpoint and key stay the trajectory's; a key OpenCode does not know is an error."""

    name = "opencode"
    binary_name = "opencode"
    package = "opencode-ai"

    def __init__(self, *args: Any, config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.config = check_opencode_config(config)

    @classmethod
    def check_extra_args(cls, args: dict[str, Any]) -> None:
        """What ``loongsage validate`` checks beyond the argument names: the ``config`` it would merge."""
        check_opencode_config(args.get("config"))

    def configure(self, home: str, ctx: AgentContext, workdir: str) -> dict[str, str]:
        config_dir = os.path.join(home, ".config", "opencode")
        os.makedirs(config_dir, exist_ok=True)
        model_ref = f"loongsage/{self.model}"
        config = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {"loongsage": {
                "npm": "@ai-sdk/openai-compatible", "name": "LoongSage AgentFlow",
                "options": {"baseURL": ctx.base_url, "apiKey": ctx.api_key or "loongsage", "maxRetries": 0},
                "models": {self.model: {"name": self.model, "tool_call": True,
                                        "limit": {"context": self.context_window, "output": self.max_output_tokens}}},
            }},
            "model": model_ref, "small_model": model_ref,
            "autoupdate": False, "share": "disabled",
            "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"},
        }
        config = deep_merge(config, self.config)
        path = os.path.join(config_dir, "opencode.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        return {"OPENCODE_CONFIG": path, "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_SHARE": "1",
                "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
                "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1",
                "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1", "OPENCODE_DISABLE_PROJECT_CONFIG": "1"}

    def command(self, prompt: str, home: str, workdir: str) -> list[str]:
        return ["run", "--format", "json", "--pure", "--title", "loongsage", "--dir", workdir, "--", prompt]

    def answer(self, stdout: str, stderr: str, home: str) -> str:
        texts: list[str] = []
        for event in _json_lines(stdout):
            kind = event.get("type")
            if kind == "error":
                raise CliAgentError(f"opencode agent: opencode reported an error: {json.dumps(event)[-2000:]}")
            part = event.get("part") if isinstance(event.get("part"), dict) else {}
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "step_start":
                texts = []  # the answer is the text of the last step
        return "".join(texts).strip()


def _json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                out.append(value)
    return out


def _last_json(text: str, want: Any) -> dict[str, Any] | None:
    stripped = text.strip()
    try:
        whole = json.loads(stripped) if stripped else None
    except ValueError:
        whole = None
    candidates = whole if isinstance(whole, list) else [whole] if isinstance(whole, dict) else _json_lines(text)
    found = [c for c in candidates if isinstance(c, dict) and want(c)]
    return found[-1] if found else None
