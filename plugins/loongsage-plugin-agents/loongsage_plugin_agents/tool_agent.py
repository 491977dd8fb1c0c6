"""The ``tool_agent``: a multi-turn loop that lets the model call tools until it answers.

Each turn sends the conversation and the tool schemas; when the model calls tools, each call is
run and its result appended as a ``tool`` message; the loop ends when the model answers without a
tool call, when a turn ends with ``finish_reason="length"`` (a budget is spent), or after
``max_turns`` model turns. Tool failures (unknown tool, bad JSON arguments, an exception, a
non-zero exit) are reported to the model as the tool's output, never raised: they are part of
the episode the policy learns from.

Tools: Python functions given by import path (see :mod:`.python_tools`; a tool may return
images, which the model sees in its tool message, e.g. :func:`.image_tools.crop`) and, when the
trajectory has a sandbox, a shell tool (``bash``) that runs a command in it.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from loongsage_hookspecs import AgentContext, AgentResult, prompt_messages

from ._chat import message_dict, openai_client
from .python_tools import call_tool, function_schema, load_function

SHELL_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "bash",
    "description": "Run a shell command in your working directory and return its exit code, stdout and stderr.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "the command"}},
                   "required": ["command"]}}}


def format_exec(result: Any, limit: int) -> str:
    """A sandbox :class:`ExecResult` as the text the model reads."""
    def cut(text: str) -> str:
        return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters]"

    head = "timed out" if result.timed_out else f"exit code {result.exit_code}"
    parts = [head]
    if result.stdout:
        parts.append("stdout:\n" + cut(result.stdout))
    if result.stderr:
        parts.append("stderr:\n" + cut(result.stderr))
    return "\n".join(parts)


class ToolAgent:
    """Multi-turn tool-calling agent.

    Args:
        tools: Python tools as ``"module:function"`` / ``"file.py:function"`` import paths.
        shell_tool: offer the ``bash`` tool (default: when the trajectory has a sandbox).
        max_turns: model turns at most.
        system_prompt: prepended when the prompt has no system message.
        tool_timeout_s: time limit of one shell command.
        max_tool_output_chars: tool output beyond this is cut.
        model, request_args, max_retries: as for ``single_turn``.
    """

    def __init__(self, tools: list[str] | None = None, shell_tool: bool | None = None, max_turns: int = 8,
                 system_prompt: str | None = None, tool_timeout_s: float = 30.0, max_tool_output_chars: int = 4000,
                 model: str = "policy", request_args: dict[str, Any] | None = None, max_retries: int = 2) -> None:
        if max_turns < 1:
            raise ValueError(f"tool_agent: max_turns must be >= 1, got {max_turns}")
        self.functions: dict[str, Callable[..., Any]] = {}
        self.schemas: list[dict[str, Any]] = []
        for path in tools or []:
            fn = load_function(path)
            schema = function_schema(fn)
            name = schema["function"]["name"]
            if name in self.functions or name == SHELL_TOOL["function"]["name"]:
                raise ValueError(f"tool_agent: two tools are named {name!r}")
            self.functions[name] = fn
            self.schemas.append(schema)
        self.shell_tool = shell_tool
        self.max_turns = max_turns
        self.system_prompt = system_prompt
        self.tool_timeout_s = tool_timeout_s
        self.max_tool_output_chars = max_tool_output_chars
        self.model = model
        self.request_args = dict(request_args or {})
        self.max_retries = max_retries

    def _tools_for(self, ctx: AgentContext) -> list[dict[str, Any]]:
        shell = self.shell_tool if self.shell_tool is not None else ctx.sandbox is not None
        if shell and ctx.sandbox is None:
            raise ValueError("tool_agent: shell_tool=true needs a sandbox (set the data source's sandbox)")
        return self.schemas + ([SHELL_TOOL] if shell else [])

    async def _run_call(self, call: Any, ctx: AgentContext) -> str | list[dict[str, Any]]:
        name = call.function.name
        try:
            args = json.loads(call.function.arguments or "{}")
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
        except ValueError as exc:
            return f"Error: invalid arguments for {name}: {exc}"
        try:
            if name == "bash" and ctx.sandbox is not None and name not in self.functions:
                command = args.get("command")
                if not isinstance(command, str):
                    return "Error: bash needs a 'command' string"
                result = await ctx.sandbox.exec(command, timeout_s=self.tool_timeout_s)
                return format_exec(result, self.max_tool_output_chars)
            fn = self.functions.get(name)
            if fn is None:
                return f"Error: unknown tool {name!r}; available: {', '.join(self.functions) or 'none'}"
            out = await call_tool(fn, args, sandbox=ctx.sandbox, ctx=ctx)
        except TypeError as exc:
            return f"Error: bad arguments for {name}: {exc}"
        except Exception as exc:
            return f"Error: {name} failed: {type(exc).__name__}: {exc}"
        if isinstance(out, list):  # text and images (a screenshot): the text parts are cut
            return [dict(part, text=self._cut(part["text"])) if part["type"] == "text" else part for part in out]
        return self._cut(out)

    def _cut(self, text: str) -> str:
        limit = self.max_tool_output_chars
        return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters]"

    async def run(self, ctx: AgentContext) -> AgentResult:
        messages = prompt_messages(ctx.prompt, self.system_prompt)
        tools = self._tools_for(ctx)
        client = openai_client(ctx, self.max_retries)
        turns = tool_calls = 0
        finish = None
        answer = ""
        try:
            while turns < self.max_turns:
                kwargs = dict(self.request_args)
                if tools:
                    kwargs["tools"] = tools
                resp = await client.chat.completions.create(model=self.model, messages=messages, **kwargs)
                turns += 1
                choice = resp.choices[0]
                finish = choice.finish_reason
                messages.append(message_dict(choice.message))
                answer = choice.message.content or ""
                calls = choice.message.tool_calls or []
                if not calls or finish == "length":
                    break
                for call in calls:
                    tool_calls += 1
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": await self._run_call(call, ctx)})
        finally:
            await client.close()
        return AgentResult(response_text=answer, messages=messages,
                           metadata={"turns": turns, "tool_calls": tool_calls, "finish_reason": finish})
