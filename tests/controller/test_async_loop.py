"""The asynchronous loop without Ray: dispatch, collect through the filters, requeue, weight updates."""

from __future__ import annotations

import json

import pytest


def _answer(prompt_text: str) -> int:
    import re

    m = re.search(r"What is ([-+ 0-9]+)\?", prompt_text)
    return eval(m.group(1))  # noqa: S307 - digits and +/- from our own generator


def test_async_steps_filter_requeue_and_update_weights(controller_factory):
    groups = {"n": 0}

    def responder(prompt_text, sample):
        # the first two groups: every sample wrong (dropped by the filter); later every other one right
        if sample == 0:
            groups["n"] += 1
        right = groups["n"] > 2 and sample % 2 == 0
        return f"The answer is {_answer(prompt_text) + (0 if right else 1)}", "stop"

    c = controller_factory({"async": {"enable": True, "scheduler": "no_window", "stale_steps": 1},
                            "algorithm": {"filters": ["dynamic_sampling"]}}, responder=responder)
    history = c.fit()
    assert len(history) == 2
    for m in history:
        assert m["train/num_mini_batches"] == 1.0 and m["train/adv_abs_mean"] > 0
        assert m["rollout/reward_mean"] == pytest.approx(0.5)  # only groups with a signal were trained
    assert history[-1]["rollout/filter_drop"] == 2  # the two groups without a signal
    # the filtered groups' tokens were generated and never trained: the run's waste
    last = history[-1]
    trained_tokens = sum(m["rollout/response_length_mean"] * m["rollout/num_trajectories"] for m in history)
    assert last["rollout/wasted_tokens_total"] >= 2 * 4  # two groups of 4 samples, >= 1 token each
    assert last["rollout/waste_ratio"] == pytest.approx(
        last["rollout/wasted_tokens_total"] / (last["rollout/wasted_tokens_total"] + trained_tokens))
    assert c.run.version == 2
    # each update: engines paused, weights pushed, engines resumed, in that order
    updates = [e for e in c.events if e.startswith(("engine0.pause", "trainer.push", "engine0.resume"))]
    assert updates[:6] == ["engine0.pause:abort", "trainer.push:1", "engine0.resume",
                           "engine0.pause:abort", "trainer.push:2", "engine0.resume"]
    lines = [json.loads(x) for x in (c.run.output_dir / "trained_prompts.jsonl").read_text().splitlines()]
    trained = [p for line in lines for p in line["prompt_ids"]]
    assert len(trained) == 4 and len(set(trained)) == 4


def test_failed_and_aborted_groups_go_back_to_the_queue(controller_factory):
    def responder(text, sample):
        return f"The answer is {sample}", "abort" if sample == 1 else "stop"

    c = controller_factory({"async": {"enable": True, "scheduler": "no_window", "stale_steps": 0}},
                           responder=responder)

    async def scenario():
        c._dispatch()
        dispatched = c.dispatched
        c.stopping = True  # collect what is in flight, dispatch nothing more
        while c.inflight:
            c.changed.clear()
            await c.changed.wait()
        return dispatched

    dispatched = c.run.loop.run_until_complete(scenario())
    assert dispatched == 2  # capacity: prompts_per_step * (1 + stale_steps)
    assert c.buffer == [] and len(c.requeue) == 2  # aborted samples: the prompts are generated again
    assert c.scheduler.metrics()["rollout/discarded_total"] == 2.0
    assert [p.prompt_id for p in c.pending_prompts()] == [p.prompt_id for p in c.requeue]


def test_surplus_groups_are_evicted_and_their_prompts_requeued(controller_factory):
    # oversampling: 4 groups for a step of 2, no staleness allowed; the 2 the step does not take
    # can never be trained within the bound, so the controller evicts them and requeues their prompts
    c = controller_factory({"async": {"enable": True, "scheduler": "window_gated", "stale_steps": 0,
                                      "scheduler_args": {"oversample": 1.0}}})

    async def scenario():
        c._dispatch()
        c.stopping = True
        while c.inflight:
            c.changed.clear()
            await c.changed.wait()
        assert len(c.buffer) == 4
        chosen = c.scheduler.select(c.buffer, c.run.version, 2)
        for g in chosen:
            c.buffer.remove(g)
        await c._abort_unusable()
        return chosen

    chosen = c.run.loop.run_until_complete(scenario())
    assert len(chosen) == 2 and c.buffer == []
    assert len(c.requeue) == 2
    requeued = {p.prompt_id for p in c.requeue}
    assert requeued.isdisjoint({g.prompt_id for g in chosen})
    assert set(c.group_prompts) == {g.group_id for g in chosen}  # evicted groups forgotten, chosen kept
    # the evicted surplus is waste: every finished token but the chosen groups'
    ledger = c.ledger.metrics()
    chosen_tokens = sum(t.response_length for g in chosen for t in g.trajectories)
    assert ledger["rollout/wasted_tokens_total"] == ledger["rollout/generated_tokens_total"] - chosen_tokens > 0
    # the chosen groups train as a normal step
    metrics, tokens = c.run.learner.learn(chosen, 0)
    assert tokens > 0 and metrics["train/num_mini_batches"] == 1.0


@pytest.mark.parametrize("scheduler,via_router", [("windowed_fifo", False), ("windowed_fifo", True),
                                                  ("no_window", False)],
                         ids=["windowed-fast-path", "windowed-router", "no-window"])
def test_every_engine_call_carries_its_groups_deadline_as_priority(controller_factory, scheduler, via_router):
    """Earliest deadline first: a group's engine calls carry minus the last version allowed to
    train it (a windowed scheduler's deadline; without one, its dispatch version), so the engines
    finish what the next step waits for before what a later step needs."""
    from loongsage_core.controller.async_loop import group_priority

    overrides: dict = {"async": {"enable": True, "scheduler": scheduler, "stale_steps": 1}}
    if via_router:  # an agent request field only the router applies: the groups go through the router
        overrides["data"] = [{"name": "add", "generator": "arithmetic", "generator_args": {"num_samples": 32},
                              "reward": ["exact_match"], "agent": "single_turn",
                              "agent_args": {"request_args": {"max_tokens": 32}}}]
    c = controller_factory(overrides)
    seen: dict[str, int] = {}
    dispatch = c.scheduler.on_dispatch

    def on_dispatch(group_id: str, version: int, *args: object, **kw: object) -> None:
        dispatch(group_id, version, *args, **kw)
        seen[group_id] = group_priority(c.scheduler, group_id, version)

    c.scheduler.on_dispatch = on_dispatch
    c.fit()
    expected = [seen[g] for g in seen]  # dispatch order
    if scheduler == "windowed_fifo":  # 2 groups per slot: deadlines 0, 0, 1, 1, then 2, 2 after an update
        assert expected[:6] == [0, 0, -1, -1, -2, -2]
    else:  # the dispatch version: the first window's groups at version 0, then one per update
        assert expected[:4] == [0, 0, 0, 0] and min(expected) < 0
    # every engine call carried its group's priority: one batched call per group on the fast path,
    # one call per sample (each its own trajectory) through the router
    per_group = 4 if via_router else 1
    calls = c.engine.priorities
    assert None not in calls and set(calls) <= set(expected)
    assert calls.count(0) >= 2 * per_group and calls.count(-1) >= 2 * per_group  # the two trained steps' groups
