"""The ``single_turn`` agent: one chat completion for the prompt, its answer is the response."""

from __future__ import annotations

from typing import Any

from loongsage_hookspecs import AgentContext, AgentResult, prompt_messages

from ._chat import message_dict, openai_client


class SingleTurnAgent:
    """Sends the prompt (a string or chat messages) once and returns the model's answer.

    Args:
        system_prompt: prepended as a system message when the prompt has none.
        model: the model name sent to the router (any name works).
        request_args: extra chat-completion fields (e.g. ``{"max_tokens": 256}``).
        max_retries: retries of the OpenAI client on transient errors.
    """

    def __init__(self, system_prompt: str | None = None, model: str = "policy",
                 request_args: dict[str, Any] | None = None, max_retries: int = 2) -> None:
        self.system_prompt = system_prompt
        self.model = model
        self.request_args = dict(request_args or {})
        self.max_retries = max_retries

    async def run(self, ctx: AgentContext) -> AgentResult:
        messages = prompt_messages(ctx.prompt, self.system_prompt)
        client = openai_client(ctx, self.max_retries)
        try:
            resp = await client.chat.completions.create(model=self.model, messages=messages, **self.request_args)
        finally:
            await client.close()
        choice = resp.choices[0]
        answer = message_dict(choice.message)
        return AgentResult(response_text=choice.message.content or "", messages=messages + [answer],
                           metadata={"finish_reason": choice.finish_reason})
