"""LoRA on the torch backend: what trains, the disabled-adapter reference, resume, adapter-only
weight sync into the embedded engine, and the exported adapter and merged model."""

from __future__ import annotations

import base64
import copy
import io
from pathlib import Path

import httpx
import pytest
import torch
from loongsage_plugin_torch.engine import create_engine
from loongsage_plugin_torch.engine.adapter import ADAPTER_NAME
from loongsage_plugin_torch.engine.weights import WeightUpdateError
from loongsage_plugin_torch.lora import is_adapter_tensor
from loongsage_plugin_torch.modeling import TINY_QWEN3
from loongsage_plugin_torch.trainer import create_train_worker

from loongsage_core.algorithms import compute_norm
from loongsage_core.config import AlgorithmConfig, JobConfig, LoraConfig, ModelConfig, TrainConfig
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import (
    Batch,
    EngineContext,
    TrainWorkerContext,
    WeightTransportContext,
)

TOKENIZER = str(Path(__file__).resolve().parents[3] / "tests" / "data" / "tokenizer")


def Components() -> PluginHost:  # noqa: N802 - reads like the registry a backend receives
    """The real component registry of a run with the rl and torch plugins (``reinforce``,
    ``token_mean``, the ``shm`` / ``inprocess`` transports)."""
    return PluginHost.create(enable=["rl", "torch"])


def make_job(lora: LoraConfig | None = LoraConfig(rank=4, alpha=8.0), **train) -> JobConfig:
    # attention dropout makes each step consume random numbers (resume must restore the RNG too)
    model = ModelConfig(config={**TINY_QWEN3, "attention_dropout": 0.1}, tokenizer=TOKENIZER)
    return JobConfig(model=model, train=TrainConfig(**{"lr": 1e-2, "micro_batch_size": 4, "lora": lora, **train}),
                     algorithm=AlgorithmConfig(policy_loss="reinforce", loss_agg="token_mean"))


def make_worker(job: JobConfig):
    return create_train_worker(TrainWorkerContext(job=job, components=Components()))


def make_batch(seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 512, (4, 16), generator=g)
    mask = torch.zeros_like(ids)
    mask[:, 8:] = 1
    return Batch(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask,
                          "advantages": torch.randn(4, 1, generator=g) * mask, "old_logprobs": torch.zeros(4, 16)})


def train(worker, seeds) -> list[dict]:
    out = []
    for seed in seeds:
        batch = make_batch(seed)
        out.append(worker.train_mini_batch(batch, compute_norm(batch)))
    return out


def state(worker) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in worker.model.state_dict().items()}


def test_only_adapter_parameters_train_and_sync():
    worker = make_worker(make_job())
    trainable = {n for n, p in worker.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    before = state(worker)
    train(worker, [1, 2])
    after = state(worker)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and changed <= trainable, sorted(changed - trainable)[:3]
    assert any(".lora_B." in n for n in changed)  # B starts at zero and moves
    # the optimizer holds the adapter alone
    assert sum(p.numel() for g in worker.optimizer.param_groups for p in g["params"]) == \
        sum(p.numel() for n, p in worker.model.named_parameters() if n in trainable)
    # what the engines receive is the adapter, under PEFT's names
    sent = dict(worker.named_weights())
    assert sent and all(is_adapter_tensor(n) and n.startswith("base_model.model.") for n in sent)
    assert sum(t.numel() for t in sent.values()) == sum(p.numel() for n, p in worker.model.named_parameters()
                                                      if n in trainable)


def test_reference_is_the_base_model_with_the_adapter_disabled():
    job = make_job()
    worker = make_worker(job)
    assert worker.serves_reference
    batch = make_batch(9)
    # step 0: the adapter is a no-op, so policy and reference agree exactly (KL = 0)
    torch.testing.assert_close(worker.forward(batch)["logprobs"], worker.reference_forward(batch)["logprobs"],
                               rtol=0, atol=0)
    train(worker, [1, 2, 3])
    policy, reference = worker.forward(batch)["logprobs"], worker.reference_forward(batch)["logprobs"]
    assert (policy - reference).abs().max() > 1e-4
    base = make_worker(make_job(lora=None))  # the same [model] without an adapter
    torch.testing.assert_close(reference, base.forward(batch)["logprobs"], rtol=0, atol=1e-6)


def test_lora_resume_is_bit_identical_and_checkpoints_hold_the_adapter_only(tmp_path):
    job = make_job(lr_schedule="cosine", lr_warmup_steps=1, total_steps=3, lora=LoraConfig(rank=4, dropout=0.1))
    straight = make_worker(job)
    expected = train(straight, [1, 2, 3])

    first = make_worker(job)
    got = train(first, [1])
    first.save_checkpoint(str(tmp_path / "ckpt"))
    saved = torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=True)
    assert saved["weights"] == "adapter" and saved["model"]
    assert all(".lora_" in n for n in saved["model"])
    resumed = make_worker(job)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    got += train(resumed, [2, 3])
    assert got == expected
    for (n, a), (_, b) in zip(straight.named_weights(), resumed.named_weights()):
        assert torch.equal(a, b), n

    full = make_worker(make_job(lora=None))
    with pytest.raises(ValueError, match="holds adapter weights but this policy has no LoRA adapter"):
        full.load_checkpoint(str(tmp_path / "ckpt"))


def generate(url: str, prompt: list[int], **extra) -> dict:
    body = {"input_ids": prompt, "return_logprob": True, **extra,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 3}}
    response = httpx.post(url + "/generate", json=body, trust_env=False, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def direct_payload(named: list) -> dict:
    buffer = io.BytesIO()
    torch.save([(n, t.clone()) for n, t in named], buffer)
    return {"serialized_named_tensors": base64.b64encode(buffer.getvalue()).decode(), "load_format": "direct"}


def scores(worker, prompt: list[int], result: dict, *, reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's log-probs of a result and the trainer's for the same tokens (policy or base)."""
    tokens = torch.tensor([prompt + result["output_ids"]])
    batch = Batch(tensors={"input_ids": tokens, "attention_mask": torch.ones_like(tokens)})
    trainer = (worker.reference_forward if reference else worker.forward)(batch)["logprobs"][0, len(prompt):]
    return torch.tensor([t[0] for t in result["meta_info"]["output_token_logprobs"]]), trainer


@pytest.mark.parametrize("transport", ["shm", "inprocess", "direct"])
def test_engine_scores_like_the_trainer_after_an_adapter_update(transport):
    job = make_job(lr=5e-2)
    worker = make_worker(job)
    train(worker, [1, 2])
    engine = create_engine(EngineContext(job=job, components=Components()))
    url = engine.start()
    try:
        prompt = make_batch(5)["input_ids"][0, :8].tolist()
        before = generate(url, prompt)
        adapter = list(worker.named_weights())
        if transport == "direct":
            body = {**direct_payload(adapter), "weight_version": "7"}
            response = httpx.post(url + "/update_weights_from_tensor", json=body, trust_env=False, timeout=60)
            assert response.status_code == 200 and response.json()["success"], response.text
            stats = {"perf/weight_update_bytes": float(sum(t.numel() * t.element_size() for _, t in adapter))}
        else:
            sender = Components().get("weight_transport", transport).sender(WeightTransportContext(role="sender"))
            stats = sender.send(iter(adapter), 7, [url if transport == "shm" else engine])
            sender.close()
        adapter_bytes = sum(t.numel() * t.element_size() for _, t in adapter)
        model_bytes = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())
        assert stats["perf/weight_update_bytes"] == adapter_bytes < model_bytes / 4

        for lora_path in (None, ADAPTER_NAME):  # the merged adapter serves either way
            out = generate(url, prompt, **({"lora_path": lora_path} if lora_path else {}))
            meta = out["meta_info"]
            assert meta["output_token_weight_versions"] == [7] * len(out["output_ids"])
            engine_logprobs, trainer_logprobs = scores(worker, prompt, out)
            torch.testing.assert_close(engine_logprobs, trainer_logprobs, rtol=0, atol=1e-4)
        assert out["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]

        # a second version is merged from the kept base copy, not on top of the first
        train(worker, [3])
        engine.load_weights(worker.named_weights(), 8)
        out = generate(url, prompt)
        engine_logprobs, trainer_logprobs = scores(worker, prompt, out)
        torch.testing.assert_close(engine_logprobs, trainer_logprobs, rtol=0, atol=1e-4)

        other = httpx.post(url + "/generate", json={"input_ids": prompt, "lora_path": "other"}, trust_env=False)
        assert other.status_code == 400 and other.json()["error"]["param"] == "lora_path"
        assert "names no LoRA adapter" in other.json()["error"]["message"]
    finally:
        engine.shutdown()


def test_unmerged_engine_applies_the_adapter_to_the_requests_that_name_it():
    job = make_job(lr=5e-2)
    job.rollout.engine_args = {"lora_mode": "unmerged"}
    worker = make_worker(job)
    train(worker, [1, 2])
    engine = create_engine(EngineContext(job=job, components=Components()))
    url = engine.start()
    try:
        base_weights = {n: t.clone() for n, t in engine.model.state_dict().items()}
        sender = Components().get("weight_transport", "shm").sender(WeightTransportContext(role="sender"))
        sender.send(worker.named_weights(), 7, [url])
        sender.close()
        # the weights stay the base model's: the adapter is applied per request
        assert all(torch.equal(t, base_weights[n]) for n, t in engine.model.state_dict().items())
        # 24 tokens: long enough for the prefix cache (16-token blocks) to hold and serve them
        prompt = torch.cat([make_batch(5)["input_ids"][0], make_batch(6)["input_ids"][0, :8]]).tolist()
        # one batch mixing the two, the same prompt twice: prefilled and decoded together,
        # each row with its own model (and no KV shared between them)
        body = {"input_ids": [prompt, prompt], "lora_path": [ADAPTER_NAME, None], "return_logprob": True,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 3}}
        response = httpx.post(url + "/generate", json=body, trust_env=False, timeout=60)
        assert response.status_code == 200, response.text
        adapted, base = response.json()
        engine_lp, trainer_lp = scores(worker, prompt, adapted)
        torch.testing.assert_close(engine_lp, trainer_lp, rtol=0, atol=1e-4)
        engine_lp, reference_lp = scores(worker, prompt, base, reference=True)
        torch.testing.assert_close(engine_lp, reference_lp, rtol=0, atol=1e-4)
        assert (scores(worker, prompt, base)[1] - reference_lp).abs().max() > 1e-3  # the two models differ
        # again, one at a time: the prefix cache now holds both prompts' KV, each serves its own
        for lora_path, reference in ((None, True), (ADAPTER_NAME, False)):
            out = generate(url, prompt, **({"lora_path": lora_path} if lora_path else {}))
            assert out["meta_info"]["cached_tokens"] >= 16
            assert out["meta_info"]["output_token_weight_versions"] == [7] * len(out["output_ids"])
            engine_lp, trainer_lp = scores(worker, prompt, out, reference=reference)
            torch.testing.assert_close(engine_lp, trainer_lp, rtol=0, atol=1e-4)

        # a new version replaces the adapter (not added to the first)
        train(worker, [3])
        engine.load_weights(worker.named_weights(), 8)
        out = generate(url, prompt, lora_path=ADAPTER_NAME)
        engine_lp, trainer_lp = scores(worker, prompt, out)
        torch.testing.assert_close(engine_lp, trainer_lp, rtol=0, atol=1e-4)
    finally:
        engine.shutdown()


def test_unmerged_adapter_settings_and_targets_are_checked():
    from loongsage_plugin_torch.engine.settings import EngineConfigError

    job = make_job()
    job.rollout.engine_args = {"lora_mode": "sideways"}
    with pytest.raises(EngineConfigError, match="engine_args.lora_mode must be one of 'merged', 'unmerged'"):
        create_engine(EngineContext(job=job, components=Components()))
    job.rollout.engine_args = {"lora_mode": "unmerged"}
    engine = create_engine(EngineContext(job=job, components=Components()))
    hidden, vocab = TINY_QWEN3["hidden_size"], TINY_QWEN3["vocab_size"]
    head = [("base_model.model.lm_head.lora_A.weight", torch.zeros(4, hidden)),
            ("base_model.model.lm_head.lora_B.weight", torch.zeros(vocab, 4))]
    with pytest.raises(WeightUpdateError, match="'lm_head.weight'; the unmerged adapter applies to attention and MLP"):
        engine.load_weights(iter(head), 1)


def test_engine_refuses_partial_or_misfit_adapters():
    job = make_job()
    worker = make_worker(job)
    adapter = list(worker.named_weights())
    engine = create_engine(EngineContext(job=job, components=Components()))
    only_a = [(n, t) for n, t in adapter if n.endswith("lora_A.weight")][:1]
    with pytest.raises(WeightUpdateError, match="came without lora_B"):
        engine.load_weights(iter(only_a), 1)
    name, a = adapter[0]
    pair = [(n, t) for n, t in adapter if n[: -len("lora_A.weight")] == name[: -len("lora_A.weight")]]
    wrong = [(n, torch.zeros(t.shape[0], t.shape[1] + 1)) if n.endswith("lora_A.weight") else (n, t) for n, t in pair]
    with pytest.raises(WeightUpdateError, match="do not fit its weight"):
        engine.load_weights(iter(wrong), 1)
    plain = create_engine(EngineContext(job=make_job(lora=None), components=Components()))
    with pytest.raises(WeightUpdateError, match="has no \\[train\\] lora"):
        plain.load_weights(iter(adapter), 1)


def test_exported_adapter_loads_with_peft_and_merged_model_matches(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    worker = make_worker(make_job(lr=5e-2))
    train(worker, [1, 2])
    worker.save_adapter(str(tmp_path / "adapter"))
    worker.save_hf(str(tmp_path / "hf"))
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()

    batch = make_batch(11)
    ids = batch["input_ids"]
    worker.model.eval()
    with torch.no_grad():
        expected = worker.model(input_ids=ids).logits
    base = copy.deepcopy(make_worker(make_job(lora=None)).model).eval()  # the same [model], no adapter
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
        assert not any(".lora_" in n or "base_layer" in n for n in merged.state_dict())
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=0, atol=1e-4)
