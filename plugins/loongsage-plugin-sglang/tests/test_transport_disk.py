"""``sglang_disk``: safetensors written for each version and reloaded through /update_weights_from_disk."""

from __future__ import annotations

import json

import pytest
import torch  # noqa: E402  (a hard dependency of this plugin)
from loongsage_plugin_sglang.transport_disk import DiskSender, write_safetensors  # noqa: E402
from standin_sglang import StandIn  # noqa: E402  (on sys.path through conftest.py)


def weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(64, 16, generator=g)
    return [("model.embed_tokens.weight", emb),
            ("model.layers.0.mlp.up_proj.weight", torch.randn(32, 16, generator=g).to(torch.bfloat16)),
            ("model.norm.weight", torch.ones(16)),
            ("lm_head.weight", emb)]  # tied: the same storage twice


def expected(named):
    return {n: (str(t.dtype).removeprefix("torch."), list(t.shape), float(t.double().sum())) for n, t in named}


def test_each_version_is_written_and_reloaded_by_every_engine(standin, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (model_dir / "model.safetensors").write_bytes(b"old weights are not copied")
    sender = DiskSender(directory=str(tmp_path / "out"), config_from=str(model_dir), load_format="safetensors")
    # two engines reload concurrently: each keeps its own record, so neither's loads interleave with the other's
    other = StandIn().start()
    try:
        second = type("Engine", (), {"base_url": other.url + "/"})()  # an engine object with a base URL
        stats = sender.send(iter(weights(0)), 1, [standin.url, second])
    finally:
        other.stop()
    v1 = tmp_path / "out" / "v1"
    assert sorted(p.name for p in v1.iterdir()) == ["config.json", "model.safetensors"]
    want = expected(weights(0))
    for engine in (standin, other):
        reqs = [r for r in engine.requests if r["path"] == "/update_weights_from_disk"]
        assert [r["body"] for r in reqs] == [{"model_path": str(v1), "load_format": "safetensors",
                                              "weight_version": "1", "flush_cache": True,
                                              "abort_all_requests": False}]
        got = {r["name"]: (r["dtype"], r["shape"], r["sum"]) for r in engine.loaded}
        assert len(engine.loaded) == len(want) and got.keys() == want.keys()
        for name in want:
            assert got[name][:2] == want[name][:2] and got[name][2] == pytest.approx(want[name][2], rel=1e-6)
    assert stats["perf/weight_update_bytes"] == 64 * 16 * 4 * 2 + 32 * 16 * 2 + 16 * 4
    assert stats["timing/weight_update_s"] >= stats["timing/weight_write_s"] > 0

    sender.send(iter(weights(1)), 2, [standin.url])
    assert not v1.exists() and (tmp_path / "out" / "v2").is_dir()  # keep = 1
    assert standin.weight_version == "2"
    sender.close()
    assert not (tmp_path / "out" / "v2").exists() and (tmp_path / "out").exists()  # a given directory stays


def test_sharded_checkpoint_has_an_index(tmp_path):
    info = write_safetensors(weights(0), tmp_path, shard_bytes=4096)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(info["files"]) == len(set(index["weight_map"].values())) > 1
    assert set(index["weight_map"]) == {n for n, _ in weights(0)}
    assert index["metadata"]["total_size"] == info["bytes"]
    from safetensors.torch import load_file
    loaded = {}
    for f in info["files"]:
        loaded.update(load_file(str(tmp_path / f)))
    for name, t in weights(0):
        assert torch.equal(loaded[name], t)


def test_a_failed_reload_raises_and_bad_arguments_are_named(standin, tmp_path):
    sender = DiskSender(directory=str(tmp_path / "out"))
    with pytest.raises(TypeError, match="sglang_disk weight transport: a target must be"):
        sender.send(iter(weights(0)), 1, [object()])
    with pytest.raises(ValueError, match="appears twice"):
        write_safetensors([("a", torch.ones(1)), ("a", torch.ones(1))], tmp_path / "dup")
    with pytest.raises(ValueError, match="config_from"):
        DiskSender(config_from=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="keep must be >= 1"):
        DiskSender(keep=0)
    own = DiskSender()
    own.close()
    assert not own.directory.exists()
