"""SFT renders a conversation to the very tokens (and loss mask) the router records for it."""

from __future__ import annotations

import openai

from loongsage_core.sft.render import render_conversation


def test_sft_tokens_equal_the_routers_record(tool_engine_url, router_factory, renderer, tool_call):
    """A real router and engine hold a three-turn chat; the finished conversation, rendered for
    SFT, is token for token the router's record, with the loss on the same tokens."""
    router = router_factory([tool_engine_url])
    url = router.blocking.register("sft-1", sampling={"temperature": 1.0, "max_new_tokens": 32})
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    messages: list[dict] = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 1+2?"}]
    for turn in range(3):
        resp = client.chat.completions.create(model="policy", messages=messages)
        assert resp.choices[0].message.content == tool_call["text"]
        messages.append({"role": "assistant", "content": resp.choices[0].message.content})
        if turn < 2:
            messages.append({"role": "user", "content": f"Again ({turn})?"})
    record = router.blocking.pop("sft-1")
    [seg] = record.segments
    [example] = render_conversation(renderer, messages)
    assert example.tokens == seg.tokens
    assert example.loss_mask == seg.loss_mask
    assert sum(seg.loss_mask) == 3 * len(tool_call["pieces"])
