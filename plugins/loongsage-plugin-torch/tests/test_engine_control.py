"""Control endpoints of the embedded engine over real HTTP: abort, pause/continue, weight updates,
cache flush, weight versions and request validation."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import time
from typing import Awaitable, Callable, TypeVar

import httpx
import pytest
import torch  # noqa: E402  (a hard dependency of this plugin)
from loongsage_plugin_torch.engine import create_engine  # noqa: E402
from loongsage_plugin_torch.engine.runner import sequence_logprobs  # noqa: E402
from loongsage_plugin_torch.modeling import TINY_QWEN3, load_model  # noqa: E402

from loongsage_core.config import structure_job  # noqa: E402
from loongsage_core.engine_client import EngineClient, EngineError, encode_direct_tensors  # noqa: E402
from loongsage_core.plugins import PluginHost  # noqa: E402
from loongsage_hookspecs import EngineContext, WeightTransportSpec  # noqa: E402

CONTEXT = 4096
UNTIL_ABORTED = CONTEXT - 16
"""Length of a request a test aborts: tens of seconds of generation, so it is still running when
the test acts on it however long a loaded machine keeps the test's thread waiting."""

T = TypeVar("T")


def ask(client: EngineClient, call: Callable[[EngineClient], Awaitable[T]]) -> T:
    """``call`` (an async engine-client call, e.g. ``lambda c: c.pause("abort")``) run to its end
    from the test's thread, on a client of its own for ``client``'s engine that is closed afterwards:
    the shared ``client`` stays free for the ``generate_sync`` calls of the pool's threads."""

    async def run() -> T:
        own = EngineClient(client.base_url)
        try:
            return await call(own)
        finally:
            await own.aclose()

    return asyncio.run(run())


def update_weights(client: EngineClient, payload: dict) -> dict:
    """``POST /update_weights_from_tensor`` with ``payload``, from the test's thread (see :func:`ask`)."""
    return ask(client, lambda c: c.update_weights_from_tensor(payload))


class DictReceiver:
    """A small weight transport for the test: tensors as a base64 ``torch.save`` of a dict."""

    def receive(self, payload):
        data = base64.b64decode(payload["serialized_named_tensors"])
        yield from torch.load(io.BytesIO(data), weights_only=True).items()


def registry() -> PluginHost:
    """The real component registry an engine receives, with the test's ``dict_b64`` transport."""
    host = PluginHost.create(enable=["torch"])
    host.register_specs(WeightTransportSpec(name="dict_b64", sender=lambda ctx: None,
                                            receiver=lambda ctx: DictReceiver()))
    return host


def make_job(seed=0):
    return structure_job({"model": {"config": dict(TINY_QWEN3), "seed": seed},
                          "rollout": {"max_context_length": CONTEXT,
                                      "engine_args": {"num_threads": 1, "max_batch_size": 8}}})


@pytest.fixture(scope="module")
def served():
    job = make_job()
    engine = create_engine(EngineContext(job=job, components=registry()))
    url = engine.start()
    client = EngineClient(url)
    pool = concurrent.futures.ThreadPoolExecutor(4)
    yield engine, client, pool
    pool.shutdown(wait=True)
    client.close()
    engine.shutdown()


@pytest.fixture(autouse=True)
def engine_left_serving(served):
    """After each test the shared engine is left serving: nothing running, nothing paused, so one
    failing test cannot leave the next ones waiting on a paused engine."""
    yield
    _, client, _ = served
    ask(client, lambda c: c.abort(abort_all=True))
    ask(client, lambda c: c.resume())
    ask(client, lambda c: c.resume_memory_occupation())


def state(client):
    return httpx.get(client.base_url + "/get_server_info").json()["internal_states"][0]


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def long_request(client, pool, prompt, rid, n=UNTIL_ABORTED):
    """Start a long greedy generation in the background; returns its future."""
    return pool.submit(client.generate_sync, [prompt], {"temperature": 0.0, "max_new_tokens": n,
                                                        "ignore_eos": True}, rids=[rid])


def started(client, count=1):
    wait_for(lambda: state(client)["running"] >= count)
    generated = state(client)["generated_tokens"]
    wait_for(lambda: state(client)["generated_tokens"] > generated + 4)


def paused_while_running(client, pool, prompt, rid, mode, n=300, attempts=5):
    """A ``n``-token greedy request paused (``mode``) while it runs; returns its future.

    The request runs to its end in about a second, so a test thread a loaded machine keeps waiting
    can reach the engine after it finished: then the pause met nothing, and the request is sent
    again (the engine's state, not a guessed time, tells which).
    """
    for _ in range(attempts):
        fut = long_request(client, pool, prompt, rid, n=n)
        started(client)
        ask(client, lambda c: c.pause(mode))
        now = state(client)
        if now["running"] + now["waiting"] == 1:
            return fut
        ask(client, lambda c: c.resume())
        assert fut.result(timeout=120)[0].finish_reason == "length"
    raise AssertionError(f"the {n}-token request finished before the pause in {attempts} attempts")


def test_abort_by_rid_returns_the_tokens_so_far(served):
    _, client, pool = served
    fut = long_request(client, pool, [5, 6, 7], "to-abort")
    other = long_request(client, pool, [8, 9], "keeps-going", n=40)
    started(client)
    ask(client, lambda c: c.abort("to-abort"))
    res = fut.result(timeout=120)[0]
    assert res.finish_reason == "abort" and res.rid == "to-abort"
    assert 0 < len(res.output_ids) < UNTIL_ABORTED and len(res.logprobs) == len(res.output_ids)
    assert other.result(timeout=120)[0].finish_reason == "length"


def test_abort_all_and_batch_rid_prefix(served):
    _, client, pool = served
    batch = pool.submit(client.generate_sync, [[3, 4], [5, 6]], {"temperature": 0.0, "max_new_tokens": UNTIL_ABORTED,
                                                                  "ignore_eos": True}, rids=["b_0", "b_1"])
    single = long_request(client, pool, [7, 8], "single")
    started(client, 3)
    ask(client, lambda c: c.abort(abort_all=True))
    results = batch.result(timeout=120) + single.result(timeout=120)
    assert [r.finish_reason for r in results] == ["abort"] * 3
    # a batch sent with one string rid is addressed by that rid
    body = {"input_ids": [[3, 4], [5, 6]], "rid": "grp", "sampling_params": {"max_new_tokens": UNTIL_ABORTED,
                                                                           "ignore_eos": True}}
    fut = pool.submit(httpx.post, client.base_url + "/generate", json=body, timeout=60)
    started(client, 2)
    ask(client, lambda c: c.abort("grp"))
    out = fut.result(timeout=120).json()
    assert [o["meta_info"]["id"] for o in out] == ["grp_0", "grp_1"]
    assert [o["meta_info"]["finish_reason"]["type"] for o in out] == ["abort", "abort"]


def test_pause_in_place_keeps_requests_and_their_kv(served):
    engine, client, pool = served
    ref = load_model(make_job())
    prompt = [11, 12, 13, 14]
    fut = paused_while_running(client, pool, prompt, "paused", "in_place")
    frozen = state(client)
    assert frozen["paused"] and frozen["running"] == 1
    time.sleep(0.1)
    assert state(client)["generated_tokens"] == frozen["generated_tokens"] and not fut.done()
    ask(client, lambda c: c.resume())
    res = fut.result(timeout=120)[0]
    assert res.finish_reason == "length" and len(res.output_ids) == 300
    expected = sequence_logprobs(ref, prompt + res.output_ids)[len(prompt) - 1:]
    assert max(abs(a - b) for a, b in zip(expected, res.logprobs)) < 1e-5


def test_pause_retract_recomputes_and_gives_the_same_sequence(served):
    _, client, pool = served
    prompt = [21, 22, 23]
    straight = client.generate_sync([prompt], {"temperature": 0.0, "max_new_tokens": 300, "ignore_eos": True})[0]
    fut = paused_while_running(client, pool, prompt, "retracted", "retract")
    assert state(client)["running"] == 0 and state(client)["waiting"] == 1
    ask(client, lambda c: c.resume())
    res = fut.result(timeout=120)[0]
    assert res.output_ids == straight.output_ids
    assert max(abs(a - b) for a, b in zip(straight.logprobs, res.logprobs)) < 1e-5


def test_pause_abort_mode_aborts_and_holds_new_requests(served):
    _, client, pool = served
    fut = long_request(client, pool, [31, 32], "pa")
    started(client)
    ask(client, lambda c: c.pause("abort"))
    assert fut.result(timeout=120)[0].finish_reason == "abort"
    queued = pool.submit(client.generate_sync, [[33, 34]], {"max_new_tokens": 5})
    wait_for(lambda: state(client)["waiting"] == 1)
    time.sleep(0.05)
    assert not queued.done()
    ask(client, lambda c: c.resume())
    assert queued.result(timeout=120)[0].finish_reason in ("length", "stop")


def perturbed(engine, seed):
    """Named tensors of a differently seeded model with the engine's parameter names."""
    other = load_model(make_job(seed=seed))
    return other, [(n, p.detach().clone()) for n, p in other.named_parameters()]


def test_weight_update_direct_changes_outputs_and_versions(served):
    engine, client, _ = served
    prompt = [41, 42, 43, 44, 45]
    sampled = {"temperature": 1.0, "sampling_seed": 5, "max_new_tokens": 20, "ignore_eos": True}
    before = client.generate_sync([prompt], sampled)[0]
    base_version = ask(client, lambda c: c.weight_version())
    assert before.weight_versions == [base_version] * 20
    original = [(n, p.detach().clone()) for n, p in load_model(make_job()).named_parameters()]
    other, named = perturbed(engine, seed=1)
    out = update_weights(client, {"serialized_named_tensors": encode_direct_tensors(named),
                                  "load_format": "direct", "flush_cache": True,
                                  "weight_version": 7})
    assert out["success"] and ask(client, lambda c: c.weight_version()) == 7
    after = client.generate_sync([prompt], sampled)[0]
    assert after.output_ids != before.output_ids and after.weight_versions == [7] * 20
    expected = sequence_logprobs(other, prompt + after.output_ids)[len(prompt) - 1:]
    assert max(abs(a - b) for a, b in zip(expected, after.logprobs)) < 1e-5
    # no version given: the engine counts up
    update_weights(client, {"serialized_named_tensors": encode_direct_tensors(original)})
    assert ask(client, lambda c: c.weight_version()) == 8
    assert client.generate_sync([prompt], sampled)[0].output_ids == before.output_ids


def test_weight_update_through_a_transport_receiver(served):
    engine, client, _ = served
    prompt = [51, 52, 53]
    sampled = {"temperature": 1.0, "sampling_seed": 6, "max_new_tokens": 12, "ignore_eos": True}
    before = client.generate_sync([prompt], sampled)[0].output_ids
    _, named = perturbed(engine, seed=2)
    buf = io.BytesIO()
    torch.save(dict(named), buf)
    update_weights(client, {"serialized_named_tensors": base64.b64encode(buf.getvalue()).decode(),
                            "load_format": "dict_b64", "weight_version": 20})
    assert ask(client, lambda c: c.weight_version()) == 20
    changed = client.generate_sync([prompt], sampled)[0].output_ids
    assert changed != before
    with pytest.raises(EngineError) as err:
        update_weights(client, {"serialized_named_tensors": "", "load_format": "nope"})
    assert err.value.status_code == 400 and "nope" in err.value.message and err.value.param == "load_format"
    # the in-process entry point, from another thread while the engine serves
    original = [(n, p.detach().clone()) for n, p in load_model(make_job()).named_parameters()]
    assert engine.load_weights(original, version=21) == len(original)
    assert ask(client, lambda c: c.weight_version()) == 21 and engine.weight_version == 21
    assert client.generate_sync([prompt], sampled)[0].output_ids == before


def test_bad_weight_updates_are_rejected_by_name(served):
    engine, client, _ = served
    version = ask(client, lambda c: c.weight_version())
    for named, needle in ([("model.no_such.weight", torch.zeros(3))], "model.no_such.weight"), \
                         ([("model.norm.weight", torch.zeros(3))], "shape"):
        with pytest.raises(EngineError) as err:
            update_weights(client, {"serialized_named_tensors": encode_direct_tensors(named),
                                    "load_format": "direct"})
        assert err.value.status_code == 400 and needle in err.value.message
    with pytest.raises(EngineError) as err:
        update_weights(client, {"serialized_named_tensors": "!!!", "load_format": "direct"})
    assert "serialized_named_tensors" in err.value.message
    assert ask(client, lambda c: c.weight_version()) == version


def test_weight_update_from_disk_loads_a_hugging_face_directory(served, tmp_path):
    """SGLang's ``/update_weights_from_disk``: a saved model's weights replace the engine's in place
    (its log-probs are the saved model's); a bad directory, a model of another shape and an unknown
    field get a 400 naming what is wrong, and leave the weights as they were."""
    engine, client, _ = served
    prompt = [61, 62, 63, 64]
    sampled = {"temperature": 1.0, "sampling_seed": 9, "max_new_tokens": 12, "ignore_eos": True}
    before = client.generate_sync([prompt], sampled)[0]
    other, _ = perturbed(engine, seed=3)
    other.save_pretrained(tmp_path / "other")
    out = ask(client, lambda c: c.update_weights_from_disk(str(tmp_path / "other"), weight_version=30))
    assert out["success"] and ask(client, lambda c: c.weight_version()) == 30
    after = client.generate_sync([prompt], sampled)[0]
    assert after.output_ids != before.output_ids and after.weight_versions == [30] * 12
    expected = sequence_logprobs(other, prompt + after.output_ids)[len(prompt) - 1:]
    assert max(abs(a - b) for a, b in zip(expected, after.logprobs)) < 1e-5

    wide = load_model(structure_job({"model": {"config": {**TINY_QWEN3, "intermediate_size": 96}}}))
    wide.save_pretrained(tmp_path / "wide")
    for body, param, words in (({"model_path": str(tmp_path / "missing")}, None, "not a directory of safetensors"),
                               ({"model_path": str(tmp_path / "wide")}, None, "shape"),
                               ({"model_path": 3}, "model_path", "Hugging Face directory"),
                               ({"model_path": str(tmp_path / "other"), "bogus": 1}, "bogus", "unknown field")):
        resp = httpx.post(client.base_url + "/update_weights_from_disk", json=body)
        assert resp.status_code == 400 and words in resp.json()["error"]["message"], body
        assert resp.json()["error"].get("param") == param, body
    assert client.generate_sync([prompt], sampled)[0].output_ids == after.output_ids
    original = [(n, p.detach().clone()) for n, p in load_model(make_job()).named_parameters()]
    engine.load_weights(original, version=31)


def test_in_place_update_reports_versions_per_token(served):
    engine, client, pool = served
    fut = paused_while_running(client, pool, [61, 62, 63], "spans", "in_place")
    version = ask(client, lambda c: c.weight_version())
    original = [(n, p.detach().clone()) for n, p in load_model(make_job()).named_parameters()]
    update_weights(client, {"serialized_named_tensors": encode_direct_tensors(original),
                            "weight_version": version + 1, "flush_cache": False})
    ask(client, lambda c: c.resume())
    res = fut.result(timeout=120)[0]
    versions = res.weight_versions
    assert len(versions) == 300 and versions[0] == version and versions[-1] == version + 1
    cut = versions.index(version + 1)
    assert versions == [version] * cut + [version + 1] * (300 - cut)
    spans = res.meta_info["weight_versions"]  # SGLang's own field, string versions
    assert spans == [{"version": str(version), "start": 0, "end": cut},
                     {"version": str(version + 1), "start": cut, "end": 300}]


def test_update_weight_version_endpoint(served):
    _, client, _ = served
    client._request_sync("POST", "/update_weight_version", {"new_version": "33"})
    assert ask(client, lambda c: c.weight_version()) == 33
    res = client.generate_sync([[1, 2, 3]], {"max_new_tokens": 3})[0]
    assert res.weight_version == 33 and res.meta_info["weight_version"] == "33"


def test_flush_cache_drops_cached_prefixes(served):
    _, client, _ = served
    prompt = list(range(100, 140))
    client.generate_sync([prompt], {"max_new_tokens": 2})
    assert state(client)["prefix_cache_entries"] > 0
    assert client.generate_sync([prompt], {"max_new_tokens": 2})[0].cached_tokens >= 32
    ask(client, lambda c: c.flush_cache())
    assert state(client)["prefix_cache_entries"] == 0
    assert httpx.get(client.base_url + "/flush_cache").status_code == 200


def test_health_and_model_info(served):
    _, client, _ = served
    assert ask(client, lambda c: c.health())
    info = httpx.get(client.base_url + "/get_model_info").json()
    assert info["is_generation"] and info["max_context_length"] == CONTEXT and info["vocab_size"] == 512
    client.generate_sync([[1, 2, 3]] * 3, {"max_new_tokens": 3})
    idle = state(client)
    assert idle["running"] == 0 and idle["kv_slots"] == 0  # an idle engine holds no KV memory


def test_an_idle_loop_thread_retires_and_the_next_call_starts_another(served):
    """An idle engine keeps no thread that holds an OpenMP team (a colocated trainer's parallel
    operators slow down beside one): the loop ends after ``IDLE_RETIRE_SECONDS`` without work,
    the engine stays healthy, and requests, commands and a request paused in place while the loop
    retired all run on a new one, with the same results."""
    from loongsage_plugin_torch.engine.scheduler import IDLE_RETIRE_SECONDS

    engine, client, pool = served
    scheduler = engine.scheduler
    greedy = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    first = client.generate_sync([[5, 6, 7]], greedy)[0]
    wait_for(lambda: not scheduler.loop_running, timeout=30 * IDLE_RETIRE_SECONDS + 10)
    assert ask(client, lambda c: c.health()) and scheduler.alive
    assert client.generate_sync([[5, 6, 7]], greedy)[0].output_ids == first.output_ids
    wait_for(lambda: not scheduler.loop_running, timeout=30 * IDLE_RETIRE_SECONDS + 10)
    assert state(client)["running"] == 0  # a command (server info) runs on a new loop too
    fut = paused_while_running(client, pool, [31, 32, 33], "kept", "in_place")
    wait_for(lambda: not scheduler.loop_running, timeout=30 * IDLE_RETIRE_SECONDS + 10)
    assert not fut.done()
    ask(client, lambda c: c.resume())
    res = fut.result(timeout=120)[0]
    assert res.finish_reason == "length" and len(res.output_ids) == 300


def test_an_engine_whose_loop_retired_shuts_down_and_fails_what_stayed_paused():
    engine = create_engine(EngineContext(job=make_job(), components=registry()))
    client = EngineClient(engine.start())
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        fut = paused_while_running(client, pool, [41, 42], "left", "in_place")
        wait_for(lambda: not engine.scheduler.loop_running)
        engine.shutdown()
        assert not engine.scheduler.alive
        with pytest.raises(EngineError):
            fut.result(timeout=60)
    finally:
        pool.shutdown(wait=True)
        client.close()


BAD_REQUESTS = [
    ({"sampling_params": {"max_new_tokens": 3}}, "input_ids", "required"),
    ({"input_ids": [1, 2], "bogus": 1}, "bogus", "unknown field"),
    ({"input_ids": [1, 2], "sampling_params": {"temprature": 0.5}}, "sampling_params.temprature", "unknown field"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature", "number"),
    ({"input_ids": ["a", "b"]}, "input_ids", "integers"),
    ({"input_ids": [[1, 2], []]}, "input_ids[1]", "empty"),
    ({"input_ids": [1, 999]}, "input_ids", "vocabulary"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "sampling_params.top_k", "-1"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "sampling_params.top_p", "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": CONTEXT}}, "sampling_params.max_new_tokens",
     "context length"),
    ({"input_ids": [1] * CONTEXT}, "input_ids", "context length"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 2}}, "sampling_params.n", "batch"),
    ({"input_ids": [1, 2], "sampling_params": {"stop": ["x"]}}, "sampling_params.stop", "stop_token_ids"),
    ({"input_ids": [[1], [2]], "stream": True}, "stream", "single prompt"),
    ({"input_ids": [1, 2], "top_logprobs_num": -1}, "top_logprobs_num", "integer"),
    ({"input_ids": [1, 2], "logprob_start_len": 2}, "logprob_start_len", "prompt position in [0, 1]"),
    ({"input_ids": [[1, 2], [3]], "logprob_start_len": [0, 1]}, "logprob_start_len[1]", "[0, 0]"),
    ({"input_ids": [1, 2], "logprob_start_len": "0"}, "logprob_start_len", "-1"),
    ({"input_ids": [1, 2], "return_logprob": "yes"}, "return_logprob", "boolean"),
    ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "rid", "duplicate"),
    ({"input_ids": [1, 2], "rid": 5}, "rid", "string"),
    ({"input_ids": [1, 2], "lora_path": "x"}, "lora_path", "no [train] lora"),
    ({"input_ids": [[1], [2]], "lora_path": ["policy"]}, "lora_path", "batch of 2"),
    ({"text": "hello"}, "text", "tokenizer"),
    ({"input_ids": [1, 2], "priority": "high"}, "priority", "integer"),
]


@pytest.mark.parametrize("body,param,words", BAD_REQUESTS, ids=[b[1] for b in BAD_REQUESTS])
def test_bad_generate_requests_get_400_naming_the_field(served, body, param, words):
    _, client, _ = served
    resp = httpx.post(client.base_url + "/generate", json=body)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"] and param.split(".")[-1].split("[")[0] in err["message"]


def test_a_more_urgent_request_is_admitted_first_and_holds_back_the_others(served):
    """Admission follows SGLang's ``priority`` (larger first); with ``strict_priority`` (the
    default) a request waits while a more urgent one runs, and starts once none does."""
    _, client, pool = served
    short = {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True}
    held_before = state(client)["priority_held_requests"]
    urgent = pool.submit(client.generate_sync, [[5, 6, 7]], {"temperature": 0.0, "max_new_tokens": UNTIL_ABORTED,
                                                             "ignore_eos": True}, rids=["urgent"], priority=5)
    started(client)
    low = pool.submit(client.generate_sync, [[1, 2, 3]], short, rids=["low"], priority=1)
    wait_for(lambda: state(client)["priority_held_requests"] == held_before + 1)
    # a more urgent request than the running one is admitted beside it at once and finishes
    assert client.generate_sync([[8, 9]], short, rids=["higher"], priority=9)[0].finish_reason == "length"
    now = state(client)
    assert (now["running"], now["waiting"]) == (1, 1) and not low.done()  # the low one still waits
    ask(client, lambda c: c.abort("urgent"))
    assert urgent.result(timeout=120)[0].finish_reason == "abort"
    assert low.result(timeout=120)[0].finish_reason == "length"  # admitted once nothing more urgent runs
    assert state(client)["priority_held_requests"] == held_before + 1  # counted once, however long it waited


def test_client_raises_engine_error_with_the_engine_message(served):
    _, client, _ = served
    with pytest.raises(EngineError) as err:
        client.generate_sync([[1] * (CONTEXT - 4)], {"max_new_tokens": 10})
    assert err.value.status_code == 400 and "context length" in err.value.message
    assert err.value.param == "sampling_params.max_new_tokens"
    resp = httpx.post(client.base_url + "/generate", content=b"{not json")
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    for path, body, param in (("/pause_generation", {"mode": "later"}, "mode"),
                              ("/abort_request", {}, "rid"),
                              ("/update_weight_version", {"new_version": "v2"}, "new_version"),
                              ("/update_weights_from_tensor", {"load_format": "direct"}, "serialized_named_tensors")):
        resp = httpx.post(client.base_url + path, json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, path


def test_a_rid_in_use_is_rejected(served):
    _, client, pool = served
    fut = long_request(client, pool, [71, 72], "dup-rid")
    started(client)
    with pytest.raises(EngineError) as err:
        client.generate_sync([[1, 2]], {"max_new_tokens": 2}, rids=["dup-rid"])
    assert err.value.status_code == 400 and "dup-rid" in err.value.message
    ask(client, lambda c: c.abort("dup-rid"))
    assert fut.result(timeout=120)[0].finish_reason == "abort"


def test_a_streamed_request_refused_before_its_first_token_gets_a_plain_error(served):
    _, client, pool = served
    fut = long_request(client, pool, [73, 74], "dup-stream")
    started(client)
    resp = httpx.post(client.base_url + "/generate", json={"input_ids": [1, 2], "rid": "dup-stream", "stream": True,
                                                           "sampling_params": {"max_new_tokens": 2}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "rid", resp.text
    ask(client, lambda c: c.abort("dup-stream"))
    assert fut.result(timeout=120)[0].finish_reason == "abort"


def test_release_and_resume_memory_occupation(served):
    engine, client, pool = served
    # 4 + 24 tokens: more than one prefix-cache block, so this request alone leaves a cached prefix
    # (the KV cache itself is given back whenever the engine goes idle); no earlier test is needed
    prompt, params = [11, 12, 13, 14], {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    before = client.generate_sync([prompt], params)[0]
    assert state(client)["prefix_cache_entries"] > 0
    # busy: a running request keeps the memory
    fut = long_request(client, pool, [5, 6, 7], "holds-memory")
    started(client)
    assert state(client)["kv_capacity"] > 0
    with pytest.raises(EngineError) as busy:
        ask(client, lambda c: c.release_memory_occupation(["kv_cache"]))
    assert busy.value.status_code == 400 and "running or waiting" in str(busy.value)
    ask(client, lambda c: c.abort("holds-memory"))
    fut.result(timeout=120)

    answer = ask(client, lambda c: c.release_memory_occupation())  # all tags
    assert answer["memory_released"] == ["cuda_graph", "kv_cache", "weights"]
    s = state(client)
    assert s["kv_capacity"] == 0 and s["kv_slots"] == 0 and s["prefix_cache_entries"] == 0
    with pytest.raises(EngineError) as refused:
        client.generate_sync([prompt], params)
    assert refused.value.status_code == 503 and "resume_memory_occupation" in str(refused.value)
    resumed = ask(client, lambda c: c.resume_memory_occupation(["weights", "cuda_graph"]))
    assert resumed["memory_released"] == ["kv_cache"]
    with pytest.raises(EngineError):  # still one tag released
        client.generate_sync([prompt], params)
    assert ask(client, lambda c: c.resume_memory_occupation(["kv_cache"]))["memory_released"] == []
    after = client.generate_sync([prompt], params)[0]
    assert after.output_ids == before.output_ids and after.logprobs == before.logprobs

    bad = httpx.post(client.base_url + "/release_memory_occupation", json={"tags": ["kv", "weights"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tags"
    assert state(client)["memory_released"] == []
