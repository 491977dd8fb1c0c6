"""The router under abuse: oversized bodies and prompts, bad sampling values, huge requests next
to small ones, clients that hang up. Every answer is a 4xx, never a 5xx, and nothing is logged as
an error. Real embedded engine, real router, real HTTP.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Any

import httpx
import pytest

MSGS = [{"role": "user", "content": "hello"}]


class CountingTokenizer:
    """The test tokenizer, counting how often a chat template is rendered or text tokenized."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._tok.apply_chat_template(*args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._tok.encode(*args, **kwargs)


def chat(url: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/chat/completions", json=body, timeout=timeout)


def test_oversized_body_is_a_413_before_it_is_parsed(engine_url, router_factory):
    router = router_factory([engine_url], max_request_bytes=64 * 1024)
    url = router.blocking.register("big")
    resp = chat(url, {"messages": [{"role": "user", "content": "x" * 200_000}]})
    assert resp.status_code == 413
    err = resp.json()["error"]
    assert err["code"] == "request_too_large" and "max_request_bytes" in err["message"]
    assert chat(url, {"messages": MSGS, "max_tokens": 2}).status_code == 200  # the router still serves


def test_overlong_prompt_is_a_400_before_any_tokenization(engine_url, router_factory, tokenizer):
    counting = CountingTokenizer(tokenizer)
    router = router_factory([engine_url], max_prompt_chars=10_000)
    router.renderer.tokenizer = counting
    url = router.blocking.register("long")
    for messages, tools in (([{"role": "user", "content": "y" * 12_000}], None),
                            ([{"role": "user", "content": "a"}] * 6_000, None),
                            (MSGS, [{"type": "function", "function": {"name": "f", "description": "d" * 12_000}}])):
        body: dict[str, Any] = {"messages": messages}
        if tools:
            body["tools"] = tools
        resp = chat(url, body)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "prompt_too_long", resp.text
    assert counting.calls == 0
    assert chat(url, {"messages": MSGS, "max_tokens": 2}).status_code == 200
    assert counting.calls > 0


BAD_REQUESTS = [
    ({"seed": 2**70}, "seed"),
    ({"seed": -(2**70)}, "seed"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 1e308}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 2**40}, "top_k"),
    ({"top_k": 0}, None),  # the engine refuses it: still the agent's 400
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"presence_penalty": 9}, "presence_penalty"),
    ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
]


@pytest.mark.parametrize("extra,param", BAD_REQUESTS)
def test_bad_sampling_values_are_400s(engine_url, router_factory, extra, param):
    router = router_factory([engine_url])
    url = router.blocking.register("s", sampling={"max_new_tokens": 4})
    resp = chat(url, {"messages": MSGS, **extra})
    assert resp.status_code == 400, resp.text
    if param is not None:
        assert resp.json()["error"]["param"] == param
    assert router.blocking.get("s").turns == []


def test_extreme_but_valid_seeds_are_served(engine_url, router_factory):
    router = router_factory([engine_url])
    url = router.blocking.register("seeds", sampling={"max_new_tokens": 2})
    for seed in (2**63 - 1, -(2**63), 0):
        resp = chat(url, {"messages": MSGS, "seed": seed})
        assert resp.status_code == 200, resp.text


BAD_SAMPLING = [
    {"temperature": -1}, {"temperature": float("nan")}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": 0},
    {"top_k": 1.5}, {"max_new_tokens": 0}, {"max_new_tokens": -1}, {"max_tokens": 0}, {"seed": 2**70},
    {"sampling_seed": "1"}, {"stop_token_ids": [-1]}, {"stop_token_ids": "x"}, {"locked": "yes"},
    {"temperature": True},
]


@pytest.mark.parametrize("sampling", BAD_SAMPLING)
def test_trajectory_with_bad_sampling_is_refused_at_registration(engine_url, router_factory, sampling):
    router = router_factory([engine_url])
    key = next(iter(sampling))
    with pytest.raises(ValueError, match=f"sampling.{key}"):
        router.blocking.register("bad", sampling=sampling)
    if isinstance(sampling[key], float) and sampling[key] != sampling[key]:
        return  # NaN cannot be sent as JSON
    resp = httpx.post(router.base_url + "/admin/trajectories", json={"trajectory_id": "bad", "sampling": sampling})
    assert resp.status_code == 400 and f"sampling.{key}" in resp.json()["error"]["message"]
    assert router.blocking.stats()["trajectories"] == 0


def test_a_huge_request_does_not_stall_health_or_other_trajectories(engine_url, router_factory):
    router = router_factory([engine_url], max_prompt_chars=4_000_000, max_request_bytes=32 * 2**20)
    big_url = router.blocking.register("huge", sampling={"max_new_tokens": 2})
    small_url = router.blocking.register("small", sampling={"max_new_tokens": 2, "seed": 3})
    done: dict[str, float] = {}

    def huge() -> None:
        words = " ".join(f"w{i % 997}" for i in range(600_000))  # about 3 MB of text
        resp = chat(big_url, {"messages": [{"role": "user", "content": words}]}, timeout=600)
        done["huge_status"] = resp.status_code
        done["huge"] = time.monotonic()

    worker = threading.Thread(target=huge)
    worker.start()
    time.sleep(1.0)  # the huge request is being read, rendered and tokenized
    health_latency = []
    small_status = []
    while "huge" not in done and len(health_latency) < 20:
        start = time.monotonic()
        assert httpx.get(router.base_url + "/health", timeout=60).status_code == 200
        health_latency.append(time.monotonic() - start)
        if not small_status:
            small_status.append(chat(small_url, {"messages": MSGS}).status_code)
            done["small"] = time.monotonic()
    worker.join(600)
    # far over the model's context: refused as context_length_exceeded once rendered, never an empty 200
    assert done["huge_status"] == 400 and small_status == [200]
    assert done["small"] < done["huge"], "the small trajectory waited for the huge request"
    assert len(health_latency) >= 2 and min(health_latency) < 0.5, health_latency


def test_client_disconnect_aborts_the_generation_quietly(engine_url, router_factory, caplog, capfd):
    router = router_factory([engine_url], turn_end_ids=[511])
    url = router.blocking.register("gone", sampling={"max_new_tokens": 900, "seed": 4, "ignore_eos": True})
    info = lambda: httpx.get(engine_url + "/get_server_info").json()["internal_states"][0]  # noqa: E731
    aborted_before = info()["aborted_requests"]
    body = json.dumps({"messages": MSGS, "stream": True}).encode()
    path = url.split("//", 1)[1].split("/", 1)[1] + "/chat/completions"
    host, port = router.host, router.port
    caplog.set_level(logging.DEBUG)
    with socket.create_connection((host, port)) as sock:
        sock.sendall(f"POST /{path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 60
        while info()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert info()["running"] == 1
    left = time.monotonic()
    while (info()["running"] or router.blocking.stats()["in_flight"][engine_url]) and time.monotonic() - left < 30:
        time.sleep(0.02)
    state = info()
    assert state["running"] == 0 and router.blocking.stats()["in_flight"][engine_url] == 0
    assert state["aborted_requests"] == aborted_before + 1
    assert router.blocking.get("gone").turns == []  # nothing half-generated was recorded
    # the agent comes back and carries on
    again = chat(url, {"messages": MSGS, "max_tokens": 3})
    assert again.status_code == 200 and len(router.blocking.get("gone").turns) == 1
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert errors == [], [r.getMessage() for r in errors]
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err
