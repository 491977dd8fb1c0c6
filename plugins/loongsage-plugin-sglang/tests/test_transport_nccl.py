"""``sglang_nccl``: bucketing, metadata order, request bodies, and a real broadcast (gloo on CPU).

The receiving side is a stand-in SGLang server in a subprocess that joins the trainer's group on
``/init_weights_update_group`` and receives each announced bucket by broadcast; NCCL itself needs
GPUs (scripts/gpu_check.sh).
"""

from __future__ import annotations

import httpx
import pytest
import torch  # noqa: E402  (a hard dependency of this plugin)
from hypothesis import given, settings
from hypothesis import strategies as st
from loongsage_plugin_sglang.transport_nccl import NcclSender, bucket_metadata, iter_buckets  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), max_size=12), bucket=st.integers(1, 100))
def test_buckets_keep_order_and_respect_the_size(sizes, bucket):
    named = [(f"t{i}", torch.zeros(n, dtype=torch.float16)) for i, n in enumerate(sizes)]
    buckets = list(iter_buckets(iter(named), bucket))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    for b in buckets:
        assert b
        nbytes = sum(t.numel() * 2 for _, t in b)
        assert nbytes <= bucket or len(b) == 1  # only a lone tensor may exceed the bucket
    # greedy: a bucket closes only when the next tensor would not fit
    for b, nxt in zip(buckets, buckets[1:]):
        assert sum(t.numel() * 2 for _, t in b) + nxt[0][1].numel() * 2 > bucket


def test_metadata_and_group_layout():
    bucket = [("a", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(4)),
              ("c", torch.zeros((), dtype=torch.int64))]
    assert bucket_metadata(bucket) == (["a", "b", "c"], ["bfloat16", "float32", "int64"], [[2, 3], [4], []])
    sender = NcclSender(tp_size=2, master_address="10.1.2.3", master_port=29600, group_name="g")
    assert sender.group_layout(3) == (7, [1, 3, 5])
    assert sender.init_requests(["http://a", "http://b"]) == [
        {"master_address": "10.1.2.3", "master_port": 29600, "rank_offset": 1, "world_size": 5, "group_name": "g",
         "backend": "nccl"},
        {"master_address": "10.1.2.3", "master_port": 29600, "rank_offset": 3, "world_size": 5, "group_name": "g",
         "backend": "nccl"}]
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        list(iter_buckets([], 0))


def model_weights(seed):
    g = torch.Generator().manual_seed(seed)
    return [("embed.weight", torch.randn(32, 8, generator=g)),
            ("layers.0.q.weight", torch.randn(8, 8, generator=g).to(torch.bfloat16)),
            ("layers.0.norm.weight", torch.randn(8, generator=g)),
            ("lm_head.weight", torch.randn(32, 8, generator=g))]


def test_broadcast_to_a_stand_in_engine_over_gloo(standin_process):
    url = standin_process
    sender = NcclSender(bucket_bytes=1100, backend="gloo", group_name="loongsage_test_group", init_timeout_s=60)
    try:
        stats1 = sender.send(iter(model_weights(0)), 1, [url])
        stats2 = sender.send(iter(model_weights(1)), 2, [url])  # the group is set up once
        with pytest.raises(ValueError, match="set up for engines"):
            sender.send(iter(model_weights(2)), 3, [url, "http://127.0.0.1:9"])
    finally:
        sender.close()
    rec = httpx.get(url + "/_recorded", timeout=10).json()
    paths = [r["path"] for r in rec["requests"]]
    assert paths.count("/init_weights_update_group") == 1
    init = next(r["body"] for r in rec["requests"] if r["path"] == "/init_weights_update_group")
    assert init["rank_offset"] == 1 and init["world_size"] == 2 and init["backend"] == "gloo"
    assert init["group_name"] == "loongsage_test_group"
    updates = [r["body"] for r in rec["requests"] if r["path"] == "/update_weights_from_distributed"]
    # 1024 + 128 + 32 + 1024 bytes in 1100-byte buckets: [embed], [q, norm], [lm_head]; twice
    assert [u["names"] for u in updates] == [["embed.weight"], ["layers.0.q.weight", "layers.0.norm.weight"],
                                             ["lm_head.weight"]] * 2
    assert updates[1]["dtypes"] == ["bfloat16", "float32"] and updates[1]["shapes"] == [[8, 8], [8]]
    # only the last bucket switches the version and flushes the cache
    assert [u.get("weight_version") for u in updates] == [None, None, "1", None, None, "2"]
    assert [u["flush_cache"] for u in updates] == [False, False, True] * 2
    assert stats1["perf/weight_update_buckets"] == 3 and stats1["perf/weight_update_bytes"] == 1024 + 128 + 32 + 1024
    assert stats1["timing/weight_group_setup_s"] > 0 and stats2["timing/weight_group_setup_s"] == 0
    # the engine received exactly the trainer's tensors, in the announced order
    got = [(r["name"], r["dtype"], r["shape"], r["sum"]) for r in rec["loaded"]]
    want = [(n, str(t.dtype).removeprefix("torch."), list(t.shape), float(t.double().sum()))
            for seed in (0, 1) for n, t in model_weights(seed)]
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert [g[3] for g in got] == pytest.approx([w[3] for w in want], rel=1e-6)
    assert "/destroy_weights_update_group" in paths



def test_sglang_nccl_feeds_an_embedded_engine(embedded_engine_process, trainer_model):
    """SGLang's per-tensor broadcast protocol, received by the torch plugin's embedded engine in another process."""
    from sglang_test_support import assert_engine_scores_like

    url = embedded_engine_process
    sender = NcclSender(bucket_bytes=8192, backend="gloo", group_name="sglang_into_embedded", init_timeout_s=60)
    try:
        stats = sender.send(((n, p.detach()) for n, p in trainer_model.named_parameters()), 3, [url])
        assert stats["perf/weight_update_buckets"] > 1
    finally:
        sender.close()
    # buckets before the last carry no version: the engine switches once, to 3
    assert httpx.get(url + "/get_weight_version", trust_env=False).json()["weight_version"] == "3"
    assert_engine_scores_like(url, trainer_model)
