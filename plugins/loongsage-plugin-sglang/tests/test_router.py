"""The real sglang-router (a Rust binary from PyPI) in front of two embedded engines."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from loongsage_plugin_sglang.process import ServerStartError  # noqa: E402
from loongsage_plugin_sglang.router import SGLangRouterProcess, router_command  # noqa: E402
from loongsage_plugin_torch.engine import create_engine  # noqa: E402
from loongsage_plugin_torch.modeling import TINY_QWEN3  # noqa: E402

from loongsage_core.config import structure_job  # noqa: E402
from loongsage_core.engine_client import EngineClient, GenerationResult  # noqa: E402
from loongsage_hookspecs import EngineContext  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
TOKENIZER = REPO / "tests" / "data" / "tokenizer"


@pytest.fixture(scope="module")
def routed(slow_fixture):
    job = structure_job({"model": {"config": dict(TINY_QWEN3), "tokenizer": str(TOKENIZER)},
                         "rollout": {"max_context_length": 128,
                                     "engine_args": {"num_threads": 1, "max_batch_size": 4}}},
                        str(REPO / "x.toml"))
    engines = [create_engine(EngineContext(job=job, components=None, engine_index=i)) for i in range(2)]
    urls = [e.start() for e in engines]
    router = SGLangRouterProcess(urls, policy="round_robin", extra_args={"log_level": "warn"})
    try:
        yield router.start(), urls, router
    finally:
        router.shutdown()
        for e in engines:
            e.shutdown()


def finished(url: str) -> int:
    return int(httpx.get(url + "/get_server_info", timeout=10).json()["internal_states"][0]["finished_requests"])


def test_router_serves_and_fans_out_control_calls(routed):
    url, workers, router = routed
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    info = httpx.get(url + "/get_model_info", timeout=10).json()
    assert info["vocab_size"] == TINY_QWEN3["vocab_size"] and info["max_context_length"] == 128
    flushed = httpx.post(url + "/flush_cache", timeout=10).json()
    assert flushed["workers_flushed"] == len(workers) == 2
    assert router.process is not None and router.process.running()
    assert router.log_path.exists()


def test_generate_through_the_router_reaches_both_engines(routed):
    url, workers, _ = routed
    before = [finished(w) for w in workers]
    for i in range(4):
        resp = httpx.post(url + "/generate", json={
            "input_ids": [5, 6, 7, 10 + i], "rid": f"r{i}", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True}}, timeout=60)
        assert resp.status_code == 200, resp.text
        res = GenerationResult.from_response(resp.json())
        assert len(res.output_ids) == 5 and len(res.logprobs) == 5
        assert all(lp is not None and lp <= 0 for lp in res.logprobs)
    after = [finished(w) for w in workers]
    assert sum(after) - sum(before) == 4
    assert all(a > b for a, b in zip(after, before))  # round robin: both engines served


def test_engine_client_through_the_router(routed):
    url, _, _ = routed
    client = EngineClient(url)
    try:
        (res,) = client.generate_sync([[5, 6, 7]], {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True})
    finally:
        client.close()
    assert len(res.output_ids) == 4 and len(res.logprobs) == 4


def test_router_command_and_errors(tmp_path):
    argv = router_command(["http://127.0.0.1:1/", "http://127.0.0.1:2"], host="127.0.0.1", port=3000,
                          policy="cache_aware", extra_args={"cache_threshold": 0.3})
    assert argv[1:] == ["-m", "sglang_router.launch_router", "--worker-urls", "http://127.0.0.1:1",
                        "http://127.0.0.1:2", "--host", "127.0.0.1", "--port", "3000", "--policy", "cache_aware",
                        "--cache-threshold", "0.3"]
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        router_command(["http://a:1"], host="h", port=1, policy="fastest")
    with pytest.raises(ValueError, match="not an http"):
        router_command(["a:1"], host="h", port=1)
    bad = SGLangRouterProcess(["http://127.0.0.1:1"], extra_args={"no_such_router_flag": 1},
                              log_path=str(tmp_path / "r.log"), startup_timeout_s=30)
    with pytest.raises(ServerStartError, match="no-such-router-flag"):
        bad.start()
    assert not bad.process.running()


def test_engines_are_added_and_removed_while_the_router_runs(routed):
    _, workers, _ = routed
    router = SGLangRouterProcess(workers[:1], policy="round_robin", extra_args={"log_level": "warn"})
    try:
        url = router.start()
        assert router.worker_urls_now() == workers[:1]
        # an engine replaced: the new one added, the old one removed
        router.add_engine(workers[1])
        router.remove_engine(workers[0])
        assert router.worker_urls_now() == [workers[1]] == router.worker_urls
        before = [finished(w) for w in workers]
        for i in range(3):
            resp = httpx.post(url + "/generate", json={"input_ids": [5, 6, 7, i], "sampling_params": {
                "max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}}, timeout=60)
            assert resp.status_code == 200, resp.text
        after = [finished(w) for w in workers]
        assert after[0] == before[0] and after[1] - before[1] == 3  # only the engine still routed to
        router.remove_engine(workers[0])  # not routed to: nothing to do
        # an engine that does not answer is never routed to: a clear error naming it
        with pytest.raises(RuntimeError, match=r"adding worker http://127\.0\.0\.1:1 did not happen within 2s"):
            router.add_engine("http://127.0.0.1:1", timeout_s=2)
        assert router.worker_urls_now() == [workers[1]]
    finally:
        router.shutdown()
