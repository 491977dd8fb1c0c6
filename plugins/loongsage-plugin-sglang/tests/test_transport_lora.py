"""A LoRA run's weight sync into SGLang: every SGLang transport writes the adapter as a PEFT
directory and swaps it in with /unload_lora_adapter + /load_lora_adapter (checked against the
stand-in server, which reads the directory as SGLang would, and against PEFT itself)."""

from __future__ import annotations

import httpx
import pytest
import torch
from loongsage_plugin_sglang.transport_disk import DiskSender
from loongsage_plugin_sglang.transport_nccl import NcclSender
from loongsage_plugin_sglang.transport_tensor import TensorHandleSender
from standin_sglang import tensor_record  # noqa: E402  (on sys.path through conftest.py)

from loongsage_core.config import LoraConfig
from loongsage_core.engine_client import EngineClient
from loongsage_hookspecs import LORA_ADAPTER_NAME

SETTINGS = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])


class Policy:
    """A tiny Qwen3 with a LoRA adapter (the torch plugin's ``apply_lora``) moved away from zero;
    ``named_weights`` are what a LoRA run's trainer sends."""

    def __init__(self) -> None:
        from loongsage_plugin_torch.lora import apply_lora
        from loongsage_plugin_torch.modeling import TINY_QWEN3
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        self.config = AutoConfig.for_model(**TINY_QWEN3)
        self.base_state = AutoModelForCausalLM.from_config(self.config).state_dict()
        base = AutoModelForCausalLM.from_config(self.config)
        base.load_state_dict(self.base_state)
        self.peft = apply_lora(base, SETTINGS)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.peft.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        self.peft.eval()

    def named_weights(self):
        from loongsage_plugin_torch.lora import adapter_weights

        return adapter_weights(self.peft)


SENDERS = {"sglang_disk": DiskSender, "sglang_nccl": NcclSender, "sglang_tensor": TensorHandleSender}


@pytest.mark.parametrize("transport", sorted(SENDERS))
def test_every_sglang_transport_swaps_the_adapter_in_by_name(standin, transport):
    adapter = list(Policy().named_weights())
    sender = SENDERS[transport]()
    sender.configure_lora(SETTINGS)
    try:
        stats = sender.send(iter(adapter), 1, [standin.url])
        assert stats["perf/weight_update_bytes"] == sum(t.numel() * t.element_size() for _, t in adapter)
        loaded = standin.adapters[LORA_ADAPTER_NAME]
        assert loaded["tensors"] == [tensor_record(n, t) for n, t in sorted(adapter)]
        config = loaded["config"]
        assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
        assert config["target_modules"] == ["q_proj", "v_proj"]
        assert standin.weight_version == "1"

        sender.send(iter(adapter), 2, [standin.url])  # the next version replaces the loaded adapter
        paths = [r["path"] for r in standin.requests if "lora" in r["path"]]
        assert paths == ["/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter"]
        assert standin.weight_version == "2" and list(standin.adapters) == [LORA_ADAPTER_NAME]
        # nothing went through the full-weight endpoints
        assert not [r for r in standin.requests if r["path"].startswith("/update_weights")]
    finally:
        sender.close()


def test_the_adapter_directory_loads_with_peft_and_scores_like_the_trainer(standin):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy = Policy()
    sender = DiskSender()
    sender.configure_lora(SETTINGS)
    try:
        sender.send(policy.named_weights(), 3, [standin.url])
        base = AutoModelForCausalLM.from_config(policy.config).eval()
        base.load_state_dict(policy.base_state)
        ids = torch.randint(1, 512, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = policy.peft(input_ids=ids).logits
            assert (expected - base(input_ids=ids).logits).abs().max() > 1e-3  # the adapter matters
            loaded = PeftModel.from_pretrained(base, standin.adapters[LORA_ADAPTER_NAME]["path"]).eval()
            torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
    finally:
        sender.close()


def test_full_weights_are_refused_in_lora_mode(standin):
    sender = DiskSender()
    sender.configure_lora(SETTINGS)
    try:
        with pytest.raises(ValueError, match="not a LoRA adapter tensor"):
            sender.send(iter([("model.norm.weight", torch.ones(4))]), 1, [standin.url])
    finally:
        sender.close()


def test_generation_names_the_adapter_and_sglang_refuses_it_until_loaded(standin):
    client = EngineClient(standin.url, lora_path=LORA_ADAPTER_NAME)
    with pytest.raises(Exception, match="not loaded"):
        client.generate_sync([1, 2, 3], {"max_new_tokens": 2})
    sender = DiskSender()
    sender.configure_lora(SETTINGS)
    try:
        sender.send(Policy().named_weights(), 0, [standin.url])
        client.generate_sync([1, 2, 3], {"max_new_tokens": 2})
    finally:
        sender.close()
        client.close()
    generate = [r["body"] for r in standin.requests if r["path"] == "/generate"]
    assert [b["lora_path"] for b in generate] == [LORA_ADAPTER_NAME, LORA_ADAPTER_NAME]
    assert httpx.get(standin.url + "/_recorded", trust_env=False).json()["adapters"]
