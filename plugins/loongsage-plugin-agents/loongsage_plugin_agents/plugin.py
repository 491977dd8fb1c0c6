"""Hook implementations of loongsage-plugin-agents (the module its entry point names).

Only names and descriptions live here; each factory imports its module when first called, so
listing components stays instant. Every factory is ``factory(ctx, **args)``: ``ctx`` the host's
:class:`~loongsage_hookspecs.BuildContext` (these components need nothing from it), ``args`` the
job's ``*_args`` table.
"""

from __future__ import annotations

from typing import Any, Iterator

from loongsage_hookspecs import (
    AgentSpec,
    BuildContext,
    Closeable,
    ConstrainsToolCalls,
    DataSourceSpec,
    ObservingMiddleware,
    ReportsIsolation,
    RouterMiddlewareSpec,
    SandboxSpec,
    StreamingMiddleware,
    hookimpl,
)


def _single_turn(ctx: BuildContext, **args: Any) -> Any:
    from .single_turn import SingleTurnAgent

    return SingleTurnAgent(**args)


def _tool_agent(ctx: BuildContext, **args: Any) -> Any:
    from .tool_agent import ToolAgent

    return ToolAgent(**args)


def _command(ctx: BuildContext, **args: Any) -> Any:
    from .command_agent import CommandAgent

    return CommandAgent(**args)


def _cli_agent(cls_name: str) -> Any:
    from . import cli_agents

    return getattr(cli_agents, cls_name)


def _codex(ctx: BuildContext, **args: Any) -> Any:
    return _cli_agent("CodexAgent")(**args)


def _claude_code(ctx: BuildContext, **args: Any) -> Any:
    return _cli_agent("ClaudeCodeAgent")(**args)


def _opencode(ctx: BuildContext, **args: Any) -> Any:
    return _cli_agent("OpenCodeAgent")(**args)


def _cli_check(cls_name: str) -> Any:
    def check(**args: Any) -> None:
        from .cli_runner import check_cli_args

        check_cli_args(_cli_agent(cls_name), args)

    return check


def _cli_preflight(cls_name: str) -> Any:
    def preflight(agent_args: dict[str, Any], sandbox: str | None, sandbox_args: dict[str, Any]) -> None:
        from .cli_preflight import preflight_cli

        preflight_cli(_cli_agent(cls_name), agent_args, sandbox, sandbox_args)

    return preflight


def _fictional_qa(ctx: BuildContext, **args: Any) -> Any:
    from .fictional_qa import fictional_qa_rows

    return fictional_qa_rows(ctx, **args)


def _fictional_qa_sft(ctx: BuildContext, **args: Any) -> Any:
    from .fictional_transcripts import fictional_qa_transcripts

    return fictional_qa_transcripts(ctx, **args)


def _swe_mini_sft(ctx: BuildContext, **args: Any) -> Any:
    from .swe_mini import mini_repair_transcripts

    return mini_repair_transcripts(ctx, **args)


def _local_sandbox(ctx: BuildContext, **args: Any) -> Any:
    from .local_sandbox import LocalSandboxProvider

    return LocalSandboxProvider(**args)


def _tool_call_parser(ctx: BuildContext, **args: Any) -> Any:
    from .tool_parser import ToolCallParser

    return ToolCallParser(**args)


def _reasoning_parser(ctx: BuildContext, **args: Any) -> Any:
    from .reasoning_parser import ReasoningParser

    return ReasoningParser(**args)


def _request_logger(ctx: BuildContext, **args: Any) -> Any:
    from .request_logger import RequestLogger

    return RequestLogger(**args)


@hookimpl
def loongsage_agents() -> Iterator[AgentSpec]:
    yield AgentSpec(name="single_turn", factory=_single_turn,
                    args_from="loongsage_plugin_agents.single_turn:SingleTurnAgent", fast_path=True,
                    description="one chat completion for the prompt; the answer is the response")
    yield AgentSpec(name="tool_agent", factory=_tool_agent, args_from="loongsage_plugin_agents.tool_agent:ToolAgent",
                    description="multi-turn tool calling: Python tools by import path, plus a bash tool when the "
                                "source has a sandbox")
    yield AgentSpec(name="command", factory=_command, args_from="loongsage_plugin_agents.command_agent:CommandAgent",
                    description="black-box program run as a subprocess with OPENAI_BASE_URL set; "
                                "stdout is the response")
    yield AgentSpec(name="codex", factory=_codex, check_args=_cli_check("CodexAgent"),
                    preflight=_cli_preflight("CodexAgent"),
                    description="OpenAI Codex CLI (codex exec) over the Responses API, in a throwaway home")
    yield AgentSpec(name="claude_code", factory=_claude_code, check_args=_cli_check("ClaudeCodeAgent"),
                    preflight=_cli_preflight("ClaudeCodeAgent"),
                    description="Anthropic Claude Code (claude -p) over the Messages API, in a throwaway home")
    yield AgentSpec(name="opencode", factory=_opencode, check_args=_cli_check("OpenCodeAgent"),
                    preflight=_cli_preflight("OpenCodeAgent"),
                    description="OpenCode (opencode run) over chat completions, in a throwaway home")


@hookimpl
def loongsage_sandboxes() -> Iterator[SandboxSpec]:
    yield SandboxSpec(name="local", factory=_local_sandbox,
                      args_from="loongsage_plugin_agents.local_sandbox:LocalSandboxProvider",
                      description="per-trajectory directory; bubblewrap read-only root and no network "
                                  "where available; rlimits", capabilities=(Closeable, ReportsIsolation))


@hookimpl
def loongsage_router_middlewares() -> Iterator[RouterMiddlewareSpec]:
    yield RouterMiddlewareSpec(name="tool_call_parser", factory=_tool_call_parser,
                               args_from="loongsage_plugin_agents.tool_parser:ToolCallParser",
                               description="model-written tool calls (hermes, llama3_json, mistral) -> "
                                           "OpenAI tool_calls", capabilities=(StreamingMiddleware, ConstrainsToolCalls))
    yield RouterMiddlewareSpec(name="reasoning_parser", factory=_reasoning_parser,
                               args_from="loongsage_plugin_agents.reasoning_parser:ReasoningParser",
                               description="<think>...</think> -> reasoning_content",
                               capabilities=(StreamingMiddleware,))
    yield RouterMiddlewareSpec(name="request_logger", factory=_request_logger,
                               args_from="loongsage_plugin_agents.request_logger:RequestLogger",
                               description="append every request and response to a JSONL file",
                               capabilities=(ObservingMiddleware,))


@hookimpl
def loongsage_data_sources() -> Iterator[DataSourceSpec]:
    yield DataSourceSpec(name="fictional_qa", factory=_fictional_qa,
                         description="one- and two-hop questions about a made-up world, answered with the "
                                     "search_tools over its corpus (train / heldout splits)")
    yield DataSourceSpec(name="fictional_qa_sft", factory=_fictional_qa_sft,
                         description="tool-use transcripts of fictional_qa questions for a loongsage sft warm "
                                     "start, a share of them wrong (p_correct)")
    yield DataSourceSpec(name="swe_mini_sft", factory=_swe_mini_sft,
                         description="view-then-edit repair transcripts of generated one-function repositories "
                                     "for a loongsage sft warm start, a share with a wrong fix (p_correct)")
