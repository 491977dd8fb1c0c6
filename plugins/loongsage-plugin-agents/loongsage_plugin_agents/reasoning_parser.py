"""Router middleware that moves the model's reasoning into ``reasoning_content``.

Reasoning models write ``<think>...</think>`` before their answer (templates such as Qwen3's may
put the opening tag in the generation prompt, so the text can start inside the block). The
message's ``content`` keeps only the answer; the reasoning goes to ``reasoning_content``, the
field OpenAI-compatible servers (SGLang, vLLM, DeepSeek) use. An unclosed block (the turn hit
its length limit while thinking) is all reasoning.
"""

from __future__ import annotations

from typing import Any


def split_reasoning(text: str, start: str = "<think>", end: str = "</think>") -> tuple[str | None, str]:
    """``(reasoning, answer)`` of ``text``; ``reasoning`` is ``None`` when there is no block."""
    s = text.find(start)
    e = text.find(end)
    if e >= 0:
        if 0 <= s < e:
            head, inner = text[:s], text[s + len(start):e]
        else:  # the opening tag was in the prompt
            head, inner = "", text[:e]
        return inner.strip(), (head + text[e + len(end):]).strip()
    if s >= 0:
        return text[s + len(start):].strip(), text[:s].strip()
    return None, text


class ReasoningParser:
    """Router middleware: ``<think>`` blocks become ``reasoning_content``.

    Args:
        start, end: the reasoning delimiters the model writes.
    """

    def __init__(self, start: str = "<think>", end: str = "</think>") -> None:
        if not start or not end:
            raise ValueError("reasoning_parser: 'start' and 'end' must be non-empty strings")
        self.start, self.end = start, end

    def on_request(self, trajectory_id: str, request: dict[str, Any]) -> dict[str, Any]:
        return request

    def stream_holdback(self, request: dict[str, Any], text: str) -> int:
        """While streaming: hold back everything until the model wrote a delimiter (text before
        one may be reasoning whose opening tag was in the prompt), then a tail that may be the
        start of one (a proper prefix: a whole delimiter stays in view, so the view is split
        the way the final text will be)."""
        if self.start not in text and self.end not in text:
            return len(text)
        hold = 0
        for delimiter in (self.start, self.end):
            for n in range(min(len(delimiter) - 1, len(text)), hold, -1):
                if delimiter.startswith(text[-n:]):
                    hold = n
                    break
        return hold

    def on_response(self, trajectory_id: str, request: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
        message = response["choices"][0]["message"]
        content = message.get("content")
        if not isinstance(content, str):
            return response
        reasoning, answer = split_reasoning(content, self.start, self.end)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
            message["content"] = answer
        return response
