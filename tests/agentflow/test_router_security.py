"""The control plane is closed: the router's admin API and the engines' control endpoints need the
run secret, and an agent's key opens its own trajectory endpoint and nothing else.

Real embedded engines started with the secret (as a run starts them), a real router, real HTTP.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest

from loongsage_core.engine_client import EngineClient, EngineError
from loongsage_core.security import new_secret, read_secret_file, trajectory_key, write_secret_file

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "data" / "tokenizer"
SECRET = new_secret()
AUTH = {"Authorization": f"Bearer {SECRET}"}
PROMPT = [5, 17, 42, 99, 7]




def _engine(api_key: str | None = SECRET) -> Any:
    from loongsage_plugin_torch.engine.engine import EmbeddedEngine
    from loongsage_plugin_torch.modeling import TINY_QWEN3

    from loongsage_core.config import structure_job
    from loongsage_hookspecs import EngineContext

    job = structure_job({"model": {"config": dict(TINY_QWEN3), "tokenizer": str(TOKENIZER_DIR)},
                         "rollout": {"max_context_length": 1024}, "run": {"seed": 0}})
    return EmbeddedEngine(EngineContext(job=job, components=None, api_key=api_key))


@pytest.fixture(scope="module")
def secure_engine() -> Iterator[str]:
    """An embedded engine that requires :data:`SECRET`, as every engine of a run does."""
    engine = _engine()
    try:
        yield engine.start()
    finally:
        engine.shutdown()


@pytest.fixture
def router(secure_engine, router_factory):
    return router_factory([secure_engine], secret=SECRET)


def greedy(url: str) -> list[int]:
    client = EngineClient(url, api_key=SECRET)
    try:
        return client.generate_sync([PROMPT], {"temperature": 0.0, "max_new_tokens": 12})[0].output_ids
    finally:
        client.close()


# ------------------------------------------------------------------------------------- the secret


def test_secret_file_is_private_and_round_trips(tmp_path):
    path = write_secret_file(tmp_path / "run", SECRET)
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_secret_file(tmp_path / "run") == SECRET
    assert trajectory_key(SECRET, "a", 0) != trajectory_key(SECRET, "a", 1) != trajectory_key(SECRET, "b", 1)
    assert trajectory_key(SECRET, "a", 0) != trajectory_key(new_secret(), "a", 0)


# ------------------------------------------------------------------------------------- the router

ADMIN_CALLS = [
    ("GET", "/admin/stats", None),
    ("POST", "/admin/engines", {"urls": "ENGINE"}),
    ("POST", "/admin/trajectories", {"trajectory_id": "victim", "attempt": 3}),
    ("GET", "/admin/trajectories/victim", None),
    ("DELETE", "/admin/trajectories/victim", None),
    ("POST", "/admin/trajectories/victim/abort", None),
    ("GET", "/admin/not-a-route", None),
]


@pytest.mark.parametrize("method,path,body", ADMIN_CALLS)
def test_admin_api_refuses_requests_without_the_secret(router, secure_engine, method, path, body):
    if body == {"urls": "ENGINE"}:
        body = {"urls": [secure_engine]}
    router.blocking.register("victim")
    agent_key = router.trajectory_key("victim")
    for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 403),
                            ({"Authorization": f"Bearer {agent_key}"}, 403), ({"x-api-key": "wrong"}, 403)):
        resp = httpx.request(method, router.base_url + path, json=body, headers=headers)
        assert resp.status_code == status, (headers, resp.text)
        assert resp.json()["error"]["code"] in ("invalid_api_key", "forbidden")
    record = router.blocking.get("victim")  # nothing happened to the trajectory
    assert record.attempt == 0 and record.status.value == "pending"
    assert httpx.get(router.base_url + "/health").status_code == 200
    ok = httpx.request(method, router.base_url + path, json=body, headers=AUTH)
    assert ok.status_code not in (401, 403)


def test_agent_key_opens_its_own_endpoint_only(router):
    url_a = router.blocking.register("a", sampling={"max_new_tokens": 4, "seed": 1})
    url_b = router.blocking.register("b", sampling={"max_new_tokens": 4, "seed": 1})
    key_a = router.trajectory_key("a")
    msgs = [{"role": "user", "content": "hi"}]
    reply = openai.OpenAI(base_url=url_a, api_key=key_a, max_retries=0).chat.completions.create(
        model="policy", messages=msgs)
    assert reply.usage.completion_tokens >= 1
    assert len(router.blocking.get("a").turns) == 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url_b, api_key=key_a, max_retries=0).chat.completions.create(model="p", messages=msgs)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url_b, api_key="guess", max_retries=0).models.list()
    assert router.blocking.get("b").turns == []
    # the key belongs to one attempt: a retried trajectory gets a new key
    url_a1 = router.blocking.register("a", attempt=1, sampling={"max_new_tokens": 4})
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url_a1, api_key=key_a, max_retries=0).models.list()
    assert openai.OpenAI(base_url=url_a1, api_key=router.trajectory_key("a", 1), max_retries=0).models.list()
    # no key at all, and the Anthropic header carrying another trajectory's key
    assert httpx.get(url_b + "/models").status_code == 401
    assert httpx.get(url_b + "/models", headers={"x-api-key": key_a}).status_code == 401
    assert httpx.get(url_b + "/models", headers={"x-api-key": router.trajectory_key("b")}).status_code == 200


def test_a_valid_key_on_a_path_the_router_does_not_serve_is_a_404_not_an_auth_error(router):
    """Only authentication failures are authentication errors: the trajectory's own key on a path
    no route serves gets a 404 in the protocol's error shape; the model endpoints work."""
    url = router.blocking.register("r404")
    key = router.trajectory_key("r404")
    own = {"Authorization": f"Bearer {key}"}
    for path in ("/v1/bogus", "/v1/chat/completions/extra", "/nothing/here", "/v1/responses/resp_1/cancel"):
        resp = httpx.post(url.removesuffix("/v1") + path, json={}, headers=own)
        assert resp.status_code == 404, (path, resp.text)
        assert resp.json()["error"]["code"] == "not_found" and resp.json()["error"]["type"] == "invalid_request_error"
    # Anthropic's shape for the anthropic SDK (its version header) and under /v1/messages
    for path, headers in (("/v1/bogus", {"x-api-key": key, "anthropic-version": "2023-06-01"}),
                          ("/v1/messages/batches/x", {"x-api-key": key})):
        resp = httpx.post(url.removesuffix("/v1") + path, json={}, headers=headers)
        assert resp.status_code == 404 and resp.json()["type"] == "error", resp.text
        assert resp.json()["error"]["type"] == "not_found_error"
    assert httpx.put(url + "/chat/completions", json={}, headers=own).status_code == 405
    # a wrong key there is still an authentication error, and /admin still needs the secret
    assert httpx.post(url + "/bogus", json={}, headers={"Authorization": "Bearer guess"}).status_code == 401
    assert httpx.get(router.base_url + "/admin/bogus", headers=own).status_code == 403
    # the model list and one model, through the SDKs
    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
    assert [m.id for m in client.models.list()] == [router.model_name]
    assert client.models.retrieve("any-name").id == "any-name"
    claude = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key=key, max_retries=0)
    assert [m.id for m in claude.models.list()] == [router.model_name]
    assert claude.models.retrieve("claude-x").id == "claude-x"


def test_registering_over_http_returns_the_trajectory_key(router):
    resp = httpx.post(router.base_url + "/admin/trajectories", json={"trajectory_id": "h", "attempt": 2},
                      headers=AUTH)
    assert resp.status_code == 200
    body = resp.json()
    assert body["api_key"] == trajectory_key(SECRET, "h", 2) == router.trajectory_key("h", 2)
    assert httpx.get(body["base_url"] + "/models", headers={"Authorization": f"Bearer {body['api_key']}"}) \
        .status_code == 200


def test_admin_engines_switches_only_between_engines_the_run_launched(router, secure_engine):
    bad = httpx.post(router.base_url + "/admin/engines", json={"urls": ["http://10.0.0.1:80"]}, headers=AUTH)
    assert bad.status_code == 403 and bad.json()["error"]["code"] == "unknown_engine"
    assert router.balancer.urls == [secure_engine]
    ok = httpx.post(router.base_url + "/admin/engines", json={"urls": [secure_engine + "/"]}, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["urls"] == [secure_engine]


# ------------------------------------------------------------------------------------- engines

ENGINE_CALLS = [
    ("POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}),
    ("POST", "/abort_request", {"rid": "", "abort_all": True}),
    ("POST", "/pause_generation", {"mode": "abort"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/flush_cache", None),
    ("POST", "/update_weight_version", {"new_version": "99"}),
    ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": "", "load_format": "direct"}),
    ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 9, "rank_offset": 1,
                                            "world_size": 2, "group_name": "g", "backend": "gloo"}),
    ("POST", "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]],
                                                  "group_name": "g"}),
    ("POST", "/destroy_weights_update_group", {"group_name": "g"}),
    ("POST", "/release_memory_occupation", {}),
    ("POST", "/resume_memory_occupation", {}),
    ("GET", "/get_server_info", None),
    ("GET", "/get_model_info", None),
    ("GET", "/get_weight_version", None),
    ("POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 4}),
]


@pytest.mark.parametrize("method,path,body", ENGINE_CALLS)
def test_engine_endpoints_refuse_requests_without_the_secret(secure_engine, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": SECRET}):
        resp = httpx.request(method, secure_engine + path, json=body, headers=headers)
        assert resp.status_code == 401, (path, headers, resp.text)
    assert httpx.get(secure_engine + "/health").status_code == 200
    info = httpx.get(secure_engine + "/get_server_info", headers=AUTH).json()["internal_states"][0]
    assert info["paused"] is False and info["memory_released"] == [] and info["weight_version"] == 0


def test_engine_client_sends_the_secret_and_is_refused_without_it(secure_engine, engine_call):
    with pytest.raises(EngineError) as err:
        engine_call(secure_engine, lambda c: c.pause())
    assert err.value.status_code == 401
    assert engine_call(secure_engine, lambda c: c.weight_version(), api_key=SECRET) == 0


def test_weight_overwrite_attempt_fails_and_greedy_outputs_are_unchanged(engine_call):
    import torch

    engine = _engine()
    url = engine.start()
    try:
        before = greedy(url)
        names = [name for name, _ in engine.model.named_parameters()]
        garbage = [(name, torch.full_like(p, 3.0)) for name, p in engine.model.named_parameters()]
        buf = io.BytesIO()
        torch.save(garbage, buf)
        attack = {"serialized_named_tensors": base64.b64encode(buf.getvalue()).decode(), "load_format": "direct",
                  "weight_version": "666", "flush_cache": True}
        for headers in ({}, {"Authorization": "Bearer " + "x" * 43}):
            resp = httpx.post(url + "/update_weights_from_tensor", json=attack, headers=headers, timeout=60)
            assert resp.status_code == 401
        assert greedy(url) == before
        assert engine_call(url, lambda c: c.weight_version(), api_key=SECRET) == 0
        # the same upload with the secret does replace the weights: the refusal above is what protected them
        ok = httpx.post(url + "/update_weights_from_tensor", json=attack, headers=AUTH, timeout=60)
        assert ok.status_code == 200 and names
        assert greedy(url) != before
    finally:
        engine.shutdown()


def test_router_reaches_a_secured_engine_with_the_secret(router, secure_engine, router_factory):
    url = router.blocking.register("ok", sampling={"max_new_tokens": 3})
    reply = openai.OpenAI(base_url=url, api_key=router.trajectory_key("ok"), max_retries=0).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "x"}])
    assert reply.usage.completion_tokens >= 1
    # a router without the secret cannot use the engine: the agent gets an error, never a 5xx
    open_router = router_factory([secure_engine])
    url = open_router.blocking.register("no", sampling={"max_new_tokens": 3})
    resp = httpx.post(url + "/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}, timeout=60)
    assert resp.status_code == 400 and "run secret" in resp.json()["error"]["message"]
