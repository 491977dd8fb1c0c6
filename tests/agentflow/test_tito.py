"""Token-in, token-out: recorded tokens are the engine's tokens plus the template's rendering of
everything else, with loss mask 1 exactly on generated tokens (real tokenizer, no engine)."""

from __future__ import annotations

import json
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loongsage_core.agentflow import ConversationTracker

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                            "parameters": {"type": "object",
                                                           "properties": {"q": {"type": "string"}}}}}]
ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,:;!?()[]{}\"'\n\tüé中"


def noncanonical(renderer, text: str) -> list[int]:
    """Tokens of ``text`` one character at a time: decodes to ``text`` but is not what the
    tokenizer would produce for it, so any re-tokenization of model output shows up."""
    out: list[int] = []
    for ch in text:
        out += renderer.encode(ch)
    return out


def spans(mask: list[int], value: int) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate(mask + [1 - value]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append((start, i))
            start = None
    return out


def tool_call_text(q: str) -> tuple[str, dict]:
    """Model text of a tool call exactly as the test template renders it, and the parsed call."""
    args = {"q": q}
    text = '<tool_call>\n{"name": "lookup", "arguments": ' + json.dumps(args, ensure_ascii=False) + "}\n</tool_call>"
    call = {"id": f"call_{abs(hash(q)) % 10**6}", "type": "function",
            "function": {"name": "lookup", "arguments": json.dumps(args)}}
    return text, call


turn_strategy = st.tuples(
    st.text(alphabet=ALPHABET, min_size=0, max_size=30),      # model answer text
    st.booleans(),                                            # ended with <|im_end|> (else cut by length)
    st.sampled_from(["user", "tool", "tool2"]),               # what the agent sends next
    st.text(alphabet=ALPHABET, min_size=1, max_size=20),      # next message text
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=st.booleans(), use_tools=st.booleans(), first=st.text(alphabet=ALPHABET, min_size=1, max_size=20),
       turns=st.lists(turn_strategy, min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_recorded_tokens_are_generated_tokens_plus_template(renderer, system, use_tools, first, turns, seed):
    rng = random.Random(seed)
    end = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    tools = TOOLS if use_tools else None
    messages = ([{"role": "system", "content": "You are terse."}] if system else []) + \
               [{"role": "user", "content": first}]
    tracker = ConversationTracker(renderer)
    generated: list[list[int]] = []
    gen_logprobs: list[list[float]] = []
    last_closing = ""
    for i, (answer, eos, nxt, nxt_text) in enumerate(turns):
        plan = tracker.plan(messages, tools)
        assert plan.new_segment == (i == 0)
        assert plan.context[:len(tracker.segments[0].tokens) if tracker.segments else 0] == \
            (tracker.segments[0].tokens if tracker.segments else [])
        calls = []
        if nxt.startswith("tool") and use_tools:
            text, call = tool_call_text(answer)
            calls = [call]
            if nxt == "tool2":
                text2, call2 = tool_call_text(answer + "2")
                text, calls = text + "\n" + text2, [call, call2]
            eos = True
            content = None
        else:
            text, content = answer, answer
        ids = noncanonical(renderer, text) + ([end] if eos else [])
        lps = [-rng.random() for _ in ids]
        assistant = {"role": "assistant", "content": content}
        if calls:
            assistant["tool_calls"] = calls
        tracker.commit(plan, ids, lps, [7] * len(ids), assistant)
        generated.append(ids)
        gen_logprobs.append(lps)
        last_closing = "\n" if eos else "<|im_end|>\n"
        # the agent echoes the answer back in its own shape (content "" for None, no ids changes)
        echoed = {"role": "assistant", "content": content if content is not None else ""}
        if calls:
            echoed["tool_calls"] = [{**c, "function": {**c["function"],
                                                       "arguments": json.dumps(json.loads(c["function"]["arguments"]),
                                                                               indent=1)}} for c in calls]
        messages = messages + [echoed]
        if calls:
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": f"result {nxt_text}"} for c in calls]
        else:
            messages += [{"role": "user", "content": nxt_text}]

    assert len(tracker.segments) == 1
    seg = tracker.segments[0]
    # mask 1 exactly on the generated tokens, in order, as recorded turns
    ones = spans(seg.loss_mask, 1)
    nonempty = [g for g in generated if g]
    assert [tuple(s) for s in seg.turns] == ones
    assert [seg.tokens[a:b] for a, b in ones] == nonempty
    assert [seg.logprobs[a:b] for a, b in ones] == [lp for lp, g in zip(gen_logprobs, generated) if g]
    assert all(seg.weight_versions[i] == (7 if m else -1) for i, m in enumerate(seg.loss_mask))
    assert all(seg.logprobs[i] == 0.0 for i, m in enumerate(seg.loss_mask) if not m)
    # every mask-0 span is the tokenizer's own encoding of template text
    for a, b in spans(seg.loss_mask, 0):
        assert renderer.encode(renderer.decode(seg.tokens[a:b])) == seg.tokens[a:b]
    # all tokens together spell the template's rendering of the conversation
    final = messages[: len(tracker.state.messages)]
    final[-1] = tracker.state.messages[-1]
    expected = renderer.render(final, tools, add_generation_prompt=False)
    assert renderer.decode(seg.tokens) + last_closing == expected


def test_generated_tokens_are_never_retokenized(renderer):
    tracker = ConversationTracker(renderer)
    plan = tracker.plan([{"role": "user", "content": "hi"}])
    end = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = noncanonical(renderer, "hello there") + [end]
    assert ids[:-1] != renderer.encode("hello there")  # a tokenization the template would not produce
    tracker.commit(plan, ids, [-0.1] * len(ids), [0] * len(ids), {"role": "assistant", "content": "hello there"})
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "more"}]
    plan2 = tracker.plan(msgs)
    assert not plan2.new_segment
    assert plan2.context[: len(plan.context) + len(ids)] == plan.context + ids
    assert renderer.decode(plan2.delta) == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    # a fresh rendering would tokenize the answer differently: TITO keeps the engine's tokens
    assert renderer.prompt_tokens(msgs) != plan2.context


def _commit_answer(renderer, tracker, messages, text, tools=None):
    end = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    plan = tracker.plan(messages, tools)
    ids = renderer.encode(text) + [end]
    tracker.commit(plan, ids, [-1.0] * len(ids), [1] * len(ids), {"role": "assistant", "content": text})
    return plan


def test_edited_history_starts_a_new_segment(renderer):
    tracker = ConversationTracker(renderer)
    base = [{"role": "user", "content": "question one"}]
    _commit_answer(renderer, tracker, base, "answer one")
    # compaction: the agent replaces its history with a summary
    compacted = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "summary of earlier work"},
                 {"role": "user", "content": "go on"}]
    plan = tracker.plan(compacted)
    assert plan.new_segment and plan.segment_index == 1
    assert "does not repeat" in plan.reason
    assert plan.context == renderer.prompt_tokens(compacted)
    _commit_answer(renderer, tracker, compacted, "answer two")
    assert len(tracker.segments) == 2 and all(s.trainable for s in tracker.segments)
    # edits in the middle of the history also break the prefix
    edited = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "summary of earlier work"},
              {"role": "user", "content": "go on!"},
              {"role": "assistant", "content": "answer two"}, {"role": "user", "content": "x"}]
    assert tracker.plan(edited).new_segment
    # a changed tool list changes the system prompt: new segment
    same_but_tools = compacted + [{"role": "assistant", "content": "answer two"}, {"role": "user", "content": "x"}]
    assert not tracker.plan(same_but_tools).new_segment
    assert tracker.plan(same_but_tools, TOOLS).reason == "tools changed"
    # resending the same request (a retry) does not extend the record
    assert tracker.plan(compacted).new_segment


def test_reasoning_dropped_by_agent_still_extends(renderer):
    tracker = ConversationTracker(renderer)
    msgs = [{"role": "user", "content": "think"}]
    plan = tracker.plan(msgs)
    end = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = renderer.encode("<think>\nhmm\n</think>\n\nyes") + [end]
    tracker.commit(plan, ids, [0.0] * len(ids), [0] * len(ids),
                   {"role": "assistant", "content": "yes", "reasoning_content": "hmm"})
    echoed = msgs + [{"role": "assistant", "content": "yes", "refusal": None}, {"role": "user", "content": "ok"}]
    plan2 = tracker.plan(echoed)
    assert not plan2.new_segment
    assert renderer.decode(plan2.delta) == "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"


HISTORY_RESTYLING_TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and m.get('reasoning_content') and loop.last %}"
    "{{- '<think>' + m['reasoning_content'] + '</think>' }}{%- endif %}"
    "{{- m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_template_that_restyles_history_uses_the_anchor_delta(tokenizer):
    from loongsage_core.agentflow import ChatRenderer

    renderer = ChatRenderer(tokenizer, chat_template=HISTORY_RESTYLING_TEMPLATE)
    tracker = ConversationTracker(renderer)
    msgs = [{"role": "user", "content": "q"}]
    plan = tracker.plan(msgs)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = renderer.encode("<think>r</think>a") + [end]
    tracker.commit(plan, ids, [0.0] * len(ids), [0] * len(ids),
                   {"role": "assistant", "content": "a", "reasoning_content": "r"})
    nxt = msgs + [{"role": "assistant", "content": "a", "reasoning_content": "r"}, {"role": "user", "content": "z"}]
    prev = renderer.render(nxt[:2], add_generation_prompt=False)
    assert not renderer.render(nxt, add_generation_prompt=True).startswith(prev)  # history was restyled
    plan2 = tracker.plan(nxt)
    assert not plan2.new_segment
    assert renderer.decode(plan2.delta) == "\n<|im_start|>user\nz<|im_end|>\n<|im_start|>assistant\n"


def test_content_of_strips_only_the_turn_end(renderer):
    end = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = renderer.encode("<tool_call>\n{}\n</tool_call>") + [end]
    assert renderer.content_of(ids) == "<tool_call>\n{}\n</tool_call>"
    assert renderer.content_of(ids[:-1]) == "<tool_call>\n{}\n</tool_call>"
