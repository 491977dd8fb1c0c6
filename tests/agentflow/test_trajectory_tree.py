"""Trajectory trees: a request that extends no recorded segment forks a new one, linked to the
segment it shares the longest token prefix with (real tokenizer and chat template, no engine;
the end-to-end runs through the router and an engine are in test_trajectory_tree_e2e.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loongsage_core.agentflow import ConversationTracker
from loongsage_core.agentflow.conversation import fork_point, shared_prefix
from loongsage_hookspecs import Segment

MAIN = "You are the main agent. Work on the task step by step."
SUB = "You are a research sub-agent. Answer the one question you are given."


def noncanonical(renderer, text: str) -> list[int]:
    """``text`` one character at a time: what a model may write, never what the tokenizer makes
    of the text, so any re-tokenization of model output shows up."""
    return [i for ch in text for i in renderer.encode(ch)]


def answer(renderer, tracker, messages, text, tools=None):
    """Plan ``messages`` and commit a model answer ``text`` (non-canonical tokens + ``<|im_end|>``)."""
    plan = tracker.plan(messages, tools)
    ids = noncanonical(renderer, text) + [renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    tracker.commit(plan, ids, [-0.5] * len(ids), [3] * len(ids), {"role": "assistant", "content": text})
    return plan, ids


def naive_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@given(a=st.lists(st.integers(0, 3), max_size=700), keep=st.integers(0, 700),
       tail=st.lists(st.integers(0, 3), max_size=300))
def test_shared_prefix_is_the_longest_common_prefix(a, keep, tail):
    b = a[:keep] + tail  # shares at least min(keep, len(a)) tokens, across chunk boundaries
    assert shared_prefix(a, b) == shared_prefix(b, a) == naive_prefix(a, b)


def test_fork_point_takes_the_longest_shared_prefix_and_the_earliest_segment_on_a_tie():
    def seg(tokens):
        s = Segment()
        s.append(tokens, generated=False)
        return s

    root, child, other = seg([1, 2, 3, 4, 5]), seg([1, 2, 3, 9, 9, 9]), seg([7, 7])
    assert fork_point([1, 2, 3, 9, 8], [root, child, other]) == (1, 4)
    assert fork_point([1, 2, 3, 4, 6], [root, child, other]) == (0, 4)
    assert fork_point([1, 2, 8], [root, child, other]) == (0, 2)  # child shares as much: it forked from root
    assert fork_point([7, 1], [root, child, other]) == (2, 1)
    assert fork_point([5], [root, child, other]) == (None, 0)
    assert fork_point([1], []) == (None, 0)


def test_segment_tree_fields_are_set_together():
    assert Segment(parent=0, fork_at=3).parent == 0
    with pytest.raises(ValueError, match="set together"):
        Segment(parent=0)
    with pytest.raises(ValueError, match="fork_at >= 1"):
        Segment(parent=0, fork_at=0)


def test_compaction_and_a_sub_agent_make_a_tree(renderer):
    tracker = ConversationTracker(renderer)
    task = [{"role": "system", "content": MAIN}, {"role": "user", "content": "Fix the bug."}]
    main, generated = list(task), []
    for step in range(3):
        plan, ids = answer(renderer, tracker, main, f"step {step} done")
        assert plan.segment_index == 0 and plan.new_segment == (step == 0) and plan.parent is None
        generated.append(ids)
        main += [{"role": "assistant", "content": f"step {step} done"}, {"role": "user", "content": f"obs {step}"}]
    seg0 = list(tracker.segments[0].tokens)

    # compaction: the three turns are replaced by a summary; the prompt forks after the task
    compacted = task + [{"role": "user", "content": "Summary: three steps done."}]
    plan = tracker.plan(compacted)
    task_tokens = renderer.encode(renderer.render(task, add_generation_prompt=False))
    assert plan.new_segment and plan.segment_index == 1 and plan.parent == 0
    assert plan.fork_at == len(task_tokens) + 1  # the task, then the <|im_start|> of the next message
    assert plan.context == renderer.prompt_tokens(compacted)  # mask 0: the template's rendering
    assert plan.reason == "request does not repeat the recorded conversation"
    _, ids4 = answer(renderer, tracker, compacted, "summary read")
    compacted.append({"role": "assistant", "content": "summary read"})

    # a sub-agent: another system prompt; it shares "<|im_start|>system\nYou are" with both main
    # segments and hangs off the first (the compacted one got those tokens from it)
    sub = [{"role": "system", "content": SUB}, {"role": "user", "content": "Which file?"}]
    plan = tracker.plan(sub)
    you_are = len(renderer.encode("<|im_start|>system\nYou are"))
    assert (plan.segment_index, plan.parent, plan.fork_at) == (2, 0, you_are)
    _, ids5 = answer(renderer, tracker, sub, "config.toml")
    sub += [{"role": "assistant", "content": "config.toml"}, {"role": "user", "content": "Sure?"}]
    plan = tracker.plan(sub)
    assert (plan.segment_index, plan.new_segment) == (2, False)  # the sub-agent's second turn extends its own
    _, ids6 = answer(renderer, tracker, sub, "yes")

    # the main agent resumes after the sub-agent's turns: it extends the compacted segment again
    compacted.append({"role": "user", "content": "The sub-agent found: yes"})
    plan = tracker.plan(compacted)
    assert (plan.segment_index, plan.new_segment) == (1, False)
    assert renderer.decode(plan.delta) == ("\n<|im_start|>user\nThe sub-agent found: yes<|im_end|>\n"
                                           "<|im_start|>assistant\n")
    _, ids7 = answer(renderer, tracker, compacted, "fixed")

    segs = tracker.segments
    assert [(s.parent, s.fork_at) for s in segs] == [(None, None), (0, len(task_tokens) + 1), (0, you_are)]
    assert segs[0].tokens == seg0  # later turns left the first segment as it was
    for seg in segs[1:]:
        assert seg.tokens[:seg.fork_at] == segs[seg.parent].tokens[:seg.fork_at]
        assert seg.tokens[seg.fork_at] != segs[seg.parent].tokens[seg.fork_at]
        assert not any(seg.loss_mask[:seg.fork_at])  # shared tokens are trained in the parent only
    # mask 1 exactly on every turn's generated tokens, kept as generated (never re-tokenized)
    turns = {0: generated, 1: [ids4, ids7], 2: [ids5, ids6]}
    for index, seg in enumerate(segs):
        assert [seg.tokens[a:b] for a, b in seg.turns] == turns[index]
        assert sum(seg.loss_mask) == sum(len(ids) for ids in turns[index])
    assert all(renderer.encode(renderer.decode(ids[:-1])) != ids[:-1] for ids in generated)


def test_a_request_after_an_earlier_turn_forks_with_the_models_own_tokens(renderer):
    tracker = ConversationTracker(renderer)
    history = [{"role": "user", "content": "question"}]
    requests = []
    for text in ("first answer", "second answer", "third answer"):
        requests.append(list(history))
        answer(renderer, tracker, history, text)
        history += [{"role": "assistant", "content": text}, {"role": "user", "content": f"after {text}"}]
    seg = tracker.segments[0]
    (s1, e1), (s2, _), _ = seg.turns

    # the harness goes back to after the first answer with another follow-up (a retried tool call)
    branch = history[:2] + [{"role": "user", "content": "something else"}]
    plan = tracker.plan(branch)
    assert plan.new_segment and plan.parent == 0
    assert plan.context[:e1] == seg.tokens[:e1]  # the first answer's own tokens, not re-tokenized
    assert plan.context != renderer.prompt_tokens(branch)  # which a fresh rendering would do
    assert plan.fork_at == e1 + len(renderer.encode("\n<|im_start|>user\n"))
    assert renderer.decode(plan.context[e1:]) == ("\n<|im_start|>user\nsomething else<|im_end|>\n"
                                                  "<|im_start|>assistant\n")
    # the same request as turn 2 again (a retry): the whole prompt is segment 0's up to turn 2
    plan = tracker.plan(requests[1])
    assert plan.new_segment and plan.context == seg.tokens[:s2] and (plan.parent, plan.fork_at) == (0, s2)
    assert s1 > 0


def test_a_turn_without_tools_forks_and_the_next_turn_with_tools_continues_the_first_segment(renderer):
    tools = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                                "parameters": {"type": "object", "properties": {}}}}]
    tracker = ConversationTracker(renderer)
    msgs = [{"role": "user", "content": "hi"}]
    answer(renderer, tracker, msgs, "hello", tools)
    msgs += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "no tools now"}]
    plan, _ = answer(renderer, tracker, msgs, "fine")  # tool_choice "none": rendered without tools
    assert plan.new_segment and plan.parent == 0 and plan.reason == "tools changed"
    msgs += [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "tools again"}]
    plan = tracker.plan(msgs, tools)
    assert (plan.segment_index, plan.new_segment) == (0, False)
    assert plan.context[:len(tracker.segments[0].tokens)] == tracker.segments[0].tokens
