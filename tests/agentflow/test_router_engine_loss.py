"""A turn whose engine cannot be reached (it died) is sent to a live engine, token-exact, when the
router is told to retry (``engine_retries``); the host hears of the lost engine."""

from __future__ import annotations

import socket
import threading

import httpx
import openai
import pytest

SAMPLING = {"temperature": 1.0, "max_new_tokens": 12, "seed": 5}
MESSAGES = [{"role": "user", "content": "Say something."}]


def dead_url() -> str:
    """The URL of a port nothing listens on (connections are refused, as after an engine died)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def direct(url: str, renderer, prompt: list[int]) -> dict:
    """The same generation asked of the engine itself."""
    params = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 5,
              "stop_token_ids": list(renderer.turn_end_ids)}
    resp = httpx.post(f"{url}/generate", json={"input_ids": prompt, "sampling_params": params,
                                               "return_logprob": True}, timeout=60)
    resp.raise_for_status()
    return resp.json()


def assert_recorded_as_direct(record, engine_url: str, renderer) -> None:
    """One turn, recorded exactly as the live engine generates it (nothing of the failed call)."""
    prompt = renderer.prompt_tokens(MESSAGES)
    answer = direct(engine_url, renderer, prompt)
    [seg] = record.segments
    assert len(record.turns) == 1 and record.turns[0].engine == engine_url
    assert seg.tokens == prompt + answer["output_ids"]
    assert seg.loss_mask == [0] * len(prompt) + [1] * len(answer["output_ids"])
    lps = [e[0] for e in answer["meta_info"]["output_token_logprobs"]]
    assert seg.logprobs[len(prompt):] == pytest.approx(lps, abs=1e-5)


def test_a_turn_on_a_dead_engine_goes_to_a_live_one(engine_url, router_factory, renderer):
    lost: list[str] = []
    gone = dead_url()
    router = router_factory([gone, engine_url], engine_retries=2, on_engine_lost=lost.append)
    url = router.blocking.register("t-dead", sampling=SAMPLING)
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    resp = client.chat.completions.create(model="policy", messages=MESSAGES)  # the first pick: the dead engine
    assert lost == [gone]
    assert router.stats_now()["engine_retries"] == 1
    assert router.balancer.down == {gone}  # until the host sets the engine list again
    assert_recorded_as_direct(router.blocking.pop("t-dead"), engine_url, renderer)
    assert resp.choices[0].finish_reason in ("stop", "length")
    # a new trajectory is not sent to the engine that is down
    url = router.blocking.register("t-next", sampling=SAMPLING)
    openai.OpenAI(base_url=url, api_key="k", max_retries=0).chat.completions.create(model="policy", messages=MESSAGES)
    assert router.blocking.pop("t-next").turns[0].engine == engine_url and lost == [gone]


def test_with_every_engine_down_a_turn_waits_for_the_replacement(engine_url, router_factory, renderer):
    lost: list[str] = []
    router = None

    def replace(url: str) -> None:  # the host replaces the engine (off the router's thread)
        lost.append(url)
        threading.Timer(0.5, lambda: router.blocking.set_engines([engine_url])).start()

    gone = dead_url()
    router = router_factory([gone], engine_retries=1, engine_wait_s=60, on_engine_lost=replace)
    url = router.blocking.register("t-wait", sampling=SAMPLING)
    openai.OpenAI(base_url=url, api_key="k", max_retries=0).chat.completions.create(model="policy", messages=MESSAGES)
    assert lost == [gone] and router.balancer.urls == [engine_url] and not router.balancer.down
    assert_recorded_as_direct(router.blocking.pop("t-wait"), engine_url, renderer)


def test_without_retries_or_past_them_the_agent_gets_a_503(router_factory):
    gone = dead_url()
    for kwargs in ({}, {"engine_retries": 1, "engine_wait_s": 0.5}):
        router = router_factory([gone], **kwargs)
        url = router.blocking.register("t-503", sampling=SAMPLING)
        with pytest.raises(openai.InternalServerError) as info:
            openai.OpenAI(base_url=url, api_key="k", max_retries=0).chat.completions.create(
                model="policy", messages=MESSAGES)
        assert info.value.status_code == 503 and "unreachable" in str(info.value)
        record = router.blocking.pop("t-503")
        assert record.turns == [] and all(not s.tokens for s in record.segments)
