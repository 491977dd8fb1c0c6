"""Fuzzing the router's HTTP surface with hypothesis: random and near-valid JSON bodies, random
credentials, every route of the three protocols (Chat Completions, Responses, Anthropic Messages) and
the admin API. The router must answer every request (no 5xx, no dropped connection),
in the OpenAI error shape for 4xx, and log no error or traceback; the counts are printed.

The harness is generic over routes: a protocol adapter added to the router is fuzzed by adding a
:class:`Route` to :data:`ROUTES` (method, path template, auth kind, body strategy). Budgets are
bounded (``LOONGSAGE_FUZZ_EXAMPLES`` scales them, e.g. for a nightly job).
"""

from __future__ import annotations

import collections
import json
import logging
import os
from typing import Any, Callable

import attrs
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loongsage_core.agentflow.openai_api import KNOWN_FIELDS, ROLES
from loongsage_core.security import trajectory_key

SCALE = float(os.environ.get("LOONGSAGE_FUZZ_EXAMPLES", "1"))
TID = "fz"

# --------------------------------------------------------------------------------------------
# value strategies
# --------------------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
numbers = (st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False, allow_infinity=False)
           | st.sampled_from([0, 1, -1, 0.5, 2, 1e308, 2**63, 2**63 - 1, -(2**63)]))
texts = st.text(max_size=60) | st.sampled_from(["<|im_end|>", "<tool_call>{}</tool_call>", "<think>", "\x00", ""])
content = texts | st.none() | st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "input_text", "image_url"]), "text": texts | json_values}), max_size=3) \
    | json_values
function_call = st.fixed_dictionaries({"name": texts | json_values, "arguments": texts | json_values})
tool_calls = st.lists(st.fixed_dictionaries({"id": texts, "type": st.just("function"), "function": function_call}),
                      max_size=2) | json_values
message = st.fixed_dictionaries({"role": st.sampled_from(list(ROLES)) | texts},
                                optional={"content": content, "tool_calls": tool_calls,
                                          "tool_call_id": texts | json_values, "name": texts,
                                          "reasoning_content": texts})
function_spec = st.fixed_dictionaries({"name": texts}, optional={"description": texts, "parameters": json_values})
tools = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "code"]), "function": function_spec}),
                 max_size=2)

unit = st.floats(min_value=0, max_value=1)
plain_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": texts}),
                          min_size=1, max_size=3).map(lambda ms: [*ms, {"role": "user", "content": "go"}])
CHAT_FIELD_VALUES: dict[str, Any] = {
    "temperature": st.floats(min_value=0, max_value=2) | numbers, "top_p": unit | numbers,
    "top_k": st.integers(min_value=-1, max_value=50) | numbers, "min_p": unit | numbers, "n": numbers,
    "seed": numbers, "max_tokens": st.integers(min_value=-2, max_value=6) | numbers,
    "max_completion_tokens": st.integers(min_value=1, max_value=6) | numbers,
    "presence_penalty": numbers, "frequency_penalty": numbers, "repetition_penalty": numbers,
    "stream": st.booleans() | json_values, "logprobs": st.booleans() | json_values,
    "top_logprobs": st.integers(min_value=-2, max_value=25) | json_values,
    "stop": texts | st.lists(texts, max_size=3) | json_values, "tools": tools | json_values,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
}


def chat_bodies() -> st.SearchStrategy[Any]:
    """Near-valid chat-completions bodies (known fields, odd values) and arbitrary JSON."""
    optional = {k: CHAT_FIELD_VALUES.get(k, json_values) for k in sorted(KNOWN_FIELDS) if k != "messages"}
    messages = plain_messages | st.lists(message, min_size=0, max_size=4) | json_values
    near = st.fixed_dictionaries({"messages": messages}, optional=optional)
    valid = st.fixed_dictionaries({"messages": plain_messages}, optional={
        k: CHAT_FIELD_VALUES[k] for k in ("temperature", "top_p", "top_k", "seed", "max_tokens", "stream", "stop",
                                          "logprobs", "stream_options")})
    return valid | near | st.fixed_dictionaries({"messages": plain_messages, "unknown_field": json_values}) \
        | json_values


def register_bodies() -> st.SearchStrategy[Any]:
    sampling = st.dictionaries(st.sampled_from(["temperature", "top_p", "top_k", "max_new_tokens", "seed", "locked",
                                                "stop_token_ids", "max_tokens", "min_p", "other"]), json_values,
                               max_size=4) | json_values
    near = st.fixed_dictionaries({"trajectory_id": texts | json_values},
                                 optional={"attempt": numbers | json_values, "sampling": sampling,
                                           "max_response_tokens": numbers | json_values,
                                           "max_context_length": numbers | json_values, "metadata": json_values,
                                           "priority": numbers | json_values, "extra": json_values})
    return near | json_values


text_part = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "text", "image"]),
                                   "text": texts | json_values})
response_items = st.one_of(
    st.fixed_dictionaries({"type": st.just("message"), "role": st.sampled_from(["user", "assistant", "system",
                                                                                "developer", "tool"]) | texts},
                          optional={"content": texts | st.lists(text_part, max_size=3) | json_values}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": texts, "name": texts | json_values,
                           "arguments": texts | json_values}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": texts | json_values,
                           "output": texts | json_values}),
    st.fixed_dictionaries({"type": st.just("reasoning")},
                          optional={"summary": st.lists(text_part, max_size=2) | json_values,
                                    "content": json_values}),
    st.fixed_dictionaries({"type": texts}, optional={"content": json_values}),
)
response_tools = st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "web_search", "custom"]) | texts},
    optional={"name": texts, "description": texts, "parameters": json_values, "strict": st.booleans()}), max_size=2)
RESPONSES_FIELD_VALUES: dict[str, Any] = {
    "instructions": texts | json_values, "tools": response_tools | json_values,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_values,
    "max_output_tokens": st.integers(min_value=-2, max_value=6) | numbers,
    "previous_response_id": st.sampled_from(["resp_x", ""]) | texts | json_values,
    "stream": st.booleans() | json_values, "temperature": st.floats(min_value=0, max_value=2) | numbers,
    "top_p": unit | numbers, "reasoning": json_values, "store": st.booleans() | json_values,
    "parallel_tool_calls": st.booleans() | json_values, "model": texts, "metadata": json_values,
}


def responses_bodies() -> st.SearchStrategy[Any]:
    """Near-valid Responses API bodies (string or item input, function and other tools) and arbitrary JSON."""
    inputs = texts | st.lists(response_items, max_size=4) | json_values
    near = st.fixed_dictionaries({"input": inputs}, optional=RESPONSES_FIELD_VALUES)
    valid = st.fixed_dictionaries({"input": st.text(min_size=1, max_size=30)},
                                  optional={"max_output_tokens": st.integers(1, 4), "stream": st.booleans()})
    return valid | near | json_values


anthropic_blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts | json_values}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": texts, "name": texts | json_values,
                           "input": json_values}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": texts | json_values},
                          optional={"content": texts | st.lists(st.fixed_dictionaries(
                              {"type": st.just("text"), "text": texts}), max_size=2) | json_values,
                              "is_error": st.booleans() | json_values}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": texts | json_values},
                          optional={"signature": texts}),
    st.fixed_dictionaries({"type": texts}, optional={"source": json_values}),
)
anthropic_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | texts,
                                           "content": texts | st.lists(anthropic_blocks, max_size=3) | json_values})
ANTHROPIC_FIELD_VALUES: dict[str, Any] = {
    "system": texts | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2)
    | json_values,
    "tools": st.lists(st.fixed_dictionaries({"name": texts | json_values},
                                            optional={"description": texts, "input_schema": json_values,
                                                      "type": texts}), max_size=2) | json_values,
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"]) | texts},
                                         optional={"name": texts}) | json_values,
    "stop_sequences": st.lists(texts, max_size=3) | json_values, "stream": st.booleans() | json_values,
    "temperature": st.floats(min_value=0, max_value=1) | numbers, "top_p": unit | numbers,
    "top_k": st.integers(min_value=-1, max_value=50) | numbers, "thinking": json_values, "metadata": json_values,
}


def messages_bodies() -> st.SearchStrategy[Any]:
    """Near-valid Anthropic Messages bodies (every block type, odd roles and values) and arbitrary JSON."""
    near = st.fixed_dictionaries({"model": texts, "max_tokens": st.integers(min_value=-2, max_value=6) | numbers,
                                  "messages": st.lists(anthropic_message, max_size=4) | json_values},
                                 optional=ANTHROPIC_FIELD_VALUES)
    valid = st.fixed_dictionaries({"model": st.just("m"), "max_tokens": st.integers(1, 4),
                                   "messages": st.just([{"role": "user", "content": "go"}])},
                                  optional={"stream": st.booleans(), "system": texts})
    return valid | near | json_values


def count_tokens_bodies() -> st.SearchStrategy[Any]:
    return st.fixed_dictionaries({"model": texts, "messages": st.lists(anthropic_message, max_size=3) | json_values},
                                 optional={k: ANTHROPIC_FIELD_VALUES[k] for k in ("system", "tools")}) | json_values


# --------------------------------------------------------------------------------------------
# routes
# --------------------------------------------------------------------------------------------


@attrs.define
class Route:
    """One route to fuzz: ``path`` may hold ``{tid}`` and ``{attempt}``; ``auth`` is ``"trajectory"``
    (an agent endpoint) or ``"secret"`` (control); ``bodies`` draws JSON bodies (``None``: no body)."""

    name: str
    method: str
    path: str
    auth: str
    bodies: Callable[[], st.SearchStrategy[Any]] | None = None
    examples: int = 25


ROUTES = [
    Route("chat.completions", "POST", "/{tid}/{attempt}/v1/chat/completions", "trajectory", chat_bodies, 120),
    Route("models", "GET", "/{tid}/{attempt}/v1/models", "trajectory"),
    Route("models.one", "GET", "/{tid}/{attempt}/v1/models/{model}", "trajectory"),
    Route("responses", "POST", "/{tid}/{attempt}/v1/responses", "trajectory", responses_bodies, 100),
    Route("messages", "POST", "/{tid}/{attempt}/v1/messages", "trajectory", messages_bodies, 100),
    Route("messages.beta", "POST", "/{tid}/{attempt}/v1/messages?beta=true", "trajectory", messages_bodies, 25),
    Route("messages.count_tokens", "POST", "/{tid}/{attempt}/v1/messages/count_tokens", "trajectory",
          count_tokens_bodies, 40),
    Route("base", "GET", "/{tid}/{attempt}/v1", "trajectory"),
    Route("admin.access_log", "GET", "/admin/access_log", "secret"),
    Route("admin.register", "POST", "/admin/trajectories", "secret", register_bodies, 60),
    Route("admin.engines", "POST", "/admin/engines", "secret",
          lambda: st.fixed_dictionaries({"urls": st.lists(texts, max_size=3) | json_values}) | json_values),
    Route("admin.get", "GET", "/admin/trajectories/{tid}", "secret"),
    Route("admin.abort", "POST", "/admin/trajectories/{tid}/abort", "secret", lambda: json_values),
    Route("admin.pop", "DELETE", "/admin/trajectories/{tid}", "secret"),
    Route("admin.stats", "GET", "/admin/stats", "secret"),
]
"""Every route of the router (checked by :func:`test_every_router_route_is_fuzzed`). Add a protocol
by listing it here."""

# path segments: the registered trajectory most of the time, else anything an attacker might send
tids = st.sampled_from([TID] * 6 + ["other", "..", "%2e%2e", "a" * 300, "ü", "%00"])
attempts = st.sampled_from(["0"] * 6 + ["1", "-1", "x", "99999999999999999999"])
CREDENTIALS = ["none", "wrong", "other-trajectory", "x-api-key", "own", "secret"]


def deep_body(depth: int, where: str, opener: str) -> bytes:
    """A body whose ``where`` nests ``depth`` levels (``opener``: an array or object level)."""
    close = "]" if opener == "[" else "}"
    nest = opener * depth + ("" if opener == "[" else "1") + close * depth
    shapes = {"metadata": '{"model": "m", "max_tokens": 1, "input": "x", "metadata": %s, '
                          '"messages": [{"role": "user", "content": "x"}]}',
              "content": '{"model": "m", "max_tokens": 1, "input": [{"role": "user", "content": %s}], '
                         '"messages": [{"role": "user", "content": %s}]}',
              "root": "%s"}
    template = shapes[where]
    return (template % ((nest,) * template.count("%s"))).encode()


# nesting 50k-120k levels deep (within the fuzz router's 256 KiB body limit) in metadata, content or the root
deep_bodies = st.builds(deep_body, depth=st.integers(50_000, 120_000), where=st.sampled_from(["metadata", "content",
                                                                                                 "root"]),
                        opener=st.just("[")) | st.builds(deep_body, depth=st.integers(65, 40_000),
                                                         where=st.sampled_from(["metadata", "content", "root"]),
                                                         opener=st.sampled_from(["[", '{"a":']))
raw_bodies = st.binary(max_size=64) | st.sampled_from([b"{", b"\xff\xfe", b"null", b"[]", b'{"messages": NaN}',
                                                        b'{"messages": [1e999]}']) | deep_bodies

COUNTS: collections.Counter[tuple[str, int]] = collections.Counter()


@pytest.fixture(scope="module")
def fuzz_router(secure_engine_url, run_secret, tokenizer):
    from loongsage_core.agentflow import AgentFlowRouter

    router = AgentFlowRouter(tokenizer, [secure_engine_url], secret=run_secret, max_prompt_chars=20_000,
                             max_request_bytes=256 * 1024, engine_timeout_s=60)
    router.start()
    yield router
    router.shutdown()


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=120) as client:
        yield client


@pytest.fixture(scope="module", autouse=True)
def print_counts():
    yield
    lines = [f"  {route:20s} {status}: {n}" for (route, status), n in sorted(COUNTS.items())]
    print(f"\nrouter fuzz: {sum(COUNTS.values())} requests, {sum(n for (_, s), n in COUNTS.items() if s >= 500)} "
          f"5xx\n" + "\n".join(lines))


def _headers(kind: str, secret: str, tid: str, attempt: str) -> dict[str, str]:
    own = trajectory_key(secret, tid, int(attempt)) if attempt.lstrip("-").isdigit() else "x"
    return {"own": {"Authorization": f"Bearer {own}"}, "secret": {"Authorization": f"Bearer {secret}"},
            "none": {}, "wrong": {"Authorization": "Bearer wrong"},
            "other-trajectory": {"Authorization": f"Bearer {trajectory_key(secret, 'other', 0)}"},
            "x-api-key": {"x-api-key": own}}[kind]


def _check(route: Route, resp: httpx.Response) -> None:
    COUNTS[(route.name, resp.status_code)] += 1
    assert resp.status_code < 500, f"{route.name}: {resp.status_code} {resp.text[:500]}"
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert isinstance(err["message"], str) and err["message"]


@pytest.mark.parametrize("route", ROUTES, ids=[r.name for r in ROUTES])
def test_fuzz_route(route, fuzz_router, run_secret, http, caplog, capfd):
    caplog.set_level(logging.WARNING)
    router = fuzz_router
    body_strategy = route.bodies() if route.bodies is not None else st.none()

    # mostly the credential the route wants, so the handlers behind the check get fuzzed too
    usual = "own" if route.auth == "trajectory" else "secret"
    credentials = st.sampled_from([usual] * 6 + CREDENTIALS)

    @settings(max_examples=max(5, int(route.examples * SCALE)), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=body_strategy, raw=st.none() | st.none() | raw_bodies, tid=tids, attempt=attempts, cred=credentials)
    def one(body: Any, raw: bytes | None, tid: str, attempt: str, cred: str) -> None:
        router.blocking.register(TID, sampling={"max_new_tokens": 3, "seed": 1}, max_response_tokens=6)
        url = router.base_url + route.path.format(tid=tid, attempt=attempt, model=tid)
        headers = _headers(cred, run_secret, tid, attempt)
        if raw is not None and route.bodies is not None:
            resp = http.request(route.method, url, content=raw, headers={**headers, "Content-Type": "application/json"})
        elif route.bodies is not None:
            resp = http.request(route.method, url, content=json.dumps(body).encode(),
                                headers={**headers, "Content-Type": "application/json"})
        else:
            resp = http.request(route.method, url, headers=headers)
        _check(route, resp)

    one()
    assert httpx.get(router.base_url + "/health").status_code == 200
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert bad == [], [r.getMessage() for r in bad]
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


def test_every_router_route_is_fuzzed(fuzz_router):
    """A route added to the router without a fuzz entry fails here (health is open and has no body)."""
    served = {(r.method, r.resource.canonical) for r in fuzz_router.app.router.routes()
              if r.method != "HEAD" and r.resource is not None}
    fuzzed = {(r.method, r.path.split("?")[0].rstrip("/")) for r in ROUTES}
    served = {(m, p.replace("{model:.+}", "{model}")) for m, p in served}
    missing = {(m, p) for m, p in served if (m, p.rstrip("/")) not in fuzzed and p not in ("/health",)}
    missing -= {("GET", "/{tid}/{attempt}"), ("GET", "/{tid}/{attempt}/")}  # the same handler as ".../v1"
    assert not missing, f"routes without a fuzz entry in ROUTES: {sorted(missing)}"


@pytest.mark.parametrize("route", [r for r in ROUTES if r.bodies is not None and r.name != "admin.abort"],
                         ids=lambda r: r.name)  # abort reads no body
def test_bodies_nested_100k_deep_are_a_clear_400(route, fuzz_router, run_secret, http):
    """JSON nested far deeper than the parser could recurse (in metadata, in content, at the root)
    is measured before it is parsed: a 400 naming the limit, never a 500."""
    cred = "own" if route.auth == "trajectory" else "secret"
    fuzz_router.blocking.register(TID, sampling={"max_new_tokens": 3, "seed": 1})
    url = fuzz_router.base_url + route.path.format(tid=TID, attempt="0", model=TID)
    for where, depth in (("metadata", 100_000), ("content", 60_000), ("root", 120_000)):  # within 256 KiB
        resp = http.request(route.method, url, content=deep_body(depth, where, "["),
                            headers={**_headers(cred, run_secret, TID, "0"), "Content-Type": "application/json"})
        assert resp.status_code == 400, (where, resp.text[:300])
        error = resp.json()["error"]
        assert error["code"] == "json_too_complex" if "code" in error else error["type"] == "invalid_request_error"
        assert "nests deeper than 64 levels" in error["message"]
