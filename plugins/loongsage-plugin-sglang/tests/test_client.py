"""SGLang control calls: exact request bodies (recorded by a real HTTP stand-in) and error handling."""

from __future__ import annotations

import pytest
from loongsage_plugin_sglang.client import SGLangClient, SGLangRequestError


def test_requests_use_sglang_field_names(standin, tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with SGLangClient(standin.url) as c:
        c.update_weights_from_disk(str(tmp_path), load_format="safetensors", weight_version=3)
        c.init_weights_update_group("10.0.0.1", 29555, 1, 3, group_name="g", backend="nccl")
        c.update_weights_from_distributed(["a", "b"], ["bfloat16", "float32"], [[2, 3], [4]], group_name="g",
                                          weight_version=4, flush_cache=False)
        c.update_weights_from_tensor(["c2VyaWFs"], load_format="flattened_bucket", weight_version=5)
        c.release_memory_occupation(["weights", "kv_cache"])
        c.resume_memory_occupation()
        c.pause_generation("retract")
        c.continue_generation()
        c.flush_cache()
        c.destroy_weights_update_group("g")
    got = [(r["path"], r["body"]) for r in standin.requests]
    assert got == [
        ("/update_weights_from_disk", {"model_path": str(tmp_path), "load_format": "safetensors", "weight_version": "3",
                                       "flush_cache": True, "abort_all_requests": False}),
        ("/init_weights_update_group", {"master_address": "10.0.0.1", "master_port": 29555, "rank_offset": 1,
                                        "world_size": 3, "group_name": "g", "backend": "nccl"}),
        ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["bfloat16", "float32"],
                                              "shapes": [[2, 3], [4]], "group_name": "g", "weight_version": "4",
                                              "flush_cache": False, "abort_all_requests": False}),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["c2VyaWFs"], "load_format": "flattened_bucket",
                                         "weight_version": "5", "flush_cache": True, "abort_all_requests": False}),
        ("/release_memory_occupation", {"tags": ["weights", "kv_cache"]}),
        ("/resume_memory_occupation", {}),
        ("/pause_generation", {"mode": "retract"}),
        ("/continue_generation", {}),
        ("/flush_cache", None),
        ("/destroy_weights_update_group", {"group_name": "g"}),
    ]


def test_weight_version_falls_back_to_model_info(standin):
    with SGLangClient(standin.url) as c:
        c.update_weights_from_tensor([], weight_version=12)
        assert c.get_weight_version() == "12"
    paths = [r["path"] for r in standin.requests]
    assert paths[-3:] == ["/get_weight_version", "/weight_version", "/model_info"]


def test_errors_name_the_server_and_sglang_reason(standin):
    with SGLangClient(standin.url) as c:
        with pytest.raises(SGLangRequestError) as err:
            c.request("POST", "/fail", {})
        assert err.value.status_code == 400 and "bad things" in str(err.value) and standin.url in str(err.value)
        with pytest.raises(ValueError, match="mode must be"):
            c.pause_generation("later")
        with pytest.raises(ValueError, match="2 names, 1 dtypes"):
            c.update_weights_from_distributed(["a", "b"], ["float32"], [[1], [2]])
    with SGLangClient("http://127.0.0.1:9", timeout=2) as dead:
        with pytest.raises(SGLangRequestError, match="ConnectError"):
            dead.flush_cache()
