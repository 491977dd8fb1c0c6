"""Rendering chats for SFT: the loss is on assistant tokens only, checked token by token."""

from __future__ import annotations

import pytest

from loongsage_core.sft.render import ConversationError, render_conversation

from .conftest import TOKENIZER_DIR

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 14 - 9, twice?"},
        {"role": "assistant", "content": "5 and 5"},
        {"role": "user", "content": "Thanks"}]


@pytest.fixture(scope="module")
def renderer():
    from transformers import AutoTokenizer

    from loongsage_core.agentflow import ChatRenderer

    return ChatRenderer(AutoTokenizer.from_pretrained(str(TOKENIZER_DIR)))


def test_loss_is_on_the_assistant_tokens_only_token_by_token(renderer):
    [ex] = render_conversation(renderer, CHAT)
    tok = renderer.tokenizer
    # the tokens are the template's text of the conversation up to the last answer's turn end
    text = renderer.render(CHAT[:5], add_generation_prompt=False)
    assert ex.tokens == renderer.encode(text[:text.rindex("<|im_end|>") + len("<|im_end|>")])
    # expected mask, derived independently: 1 from after each "<|im_start|>assistant\n" through
    # the next <|im_end|> (included), 0 everywhere else
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    header = renderer.encode("<|im_start|>assistant\n")
    expected, inside = [], False
    for i, t in enumerate(ex.tokens):
        if not inside and i >= len(header) and ex.tokens[i - len(header):i] == header:
            inside = True
        expected.append(1 if inside else 0)
        if inside and t == end:
            inside = False
    assert start in ex.tokens and sum(expected) > 0
    for i, (got, want) in enumerate(zip(ex.loss_mask, expected)):
        assert got == want, f"token {i} {tok.decode([ex.tokens[i]])!r}: mask {got}, expected {want}"
    trained = [tok.decode([t]) for t, m in zip(ex.tokens, ex.loss_mask) if m]
    assert "".join(trained) == "5<|im_end|>5 and 5<|im_end|>"


def test_loss_on_all_trains_every_token_but_the_first(renderer):
    [ex] = render_conversation(renderer, CHAT, loss_on="all")
    assert ex.loss_mask == [0] + [1] * (len(ex.tokens) - 1)


def test_tool_calls_are_rendered_by_the_template_and_trained(renderer):
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    chat = [{"role": "user", "content": "1+?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"}, {"role": "assistant", "content": "2"}]
    [ex] = render_conversation(renderer, chat, tools)
    trained = renderer.decode([t for t, m in zip(ex.tokens, ex.loss_mask) if m])
    assert trained == '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>2<|im_end|>'
    assert "<tool_response>\n2\n</tool_response>" in renderer.decode(ex.tokens)


@pytest.mark.parametrize("messages, error", [
    ([{"role": "user", "content": "hi"}], "no assistant message"),
    ([{"role": "assistant", "content": "hi"}], "starts with an assistant message"),
    ("hello", "non-empty list of chat messages"),
    ([{"content": "no role"}], "not a chat message"),
])
def test_conversations_that_train_nothing_are_errors(renderer, messages, error):
    with pytest.raises(ConversationError, match=error):
        render_conversation(renderer, messages)
