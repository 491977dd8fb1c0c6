"""The official tinker SDK against ``loongsage tinker-serve``'s service on a tiny local model:
supervised and RL loops that learn, a save/load round trip, and the refusals."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow

TEXT = "the quick brown fox jumps over the lazy dog"


def _sft_datum(tokenizer: Any) -> Any:
    from tinker import types

    ids = tokenizer.encode(TEXT)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def test_capabilities_list_the_local_model(client: Any, tiny_model_dir: Any) -> None:
    names = [m.model_name for m in client.get_server_capabilities().supported_models]
    assert names == ["tiny"]


def test_sft_loop_lowers_the_loss(client: Any) -> None:
    from tinker import types

    tc = client.create_lora_training_client(base_model="tiny", rank=8).result()
    datum = _sft_datum(tc.get_tokenizer())
    losses = []
    for _ in range(6):
        fwd_bwd = tc.forward_backward([datum], "cross_entropy")
        optim = tc.optim_step(types.AdamParams(learning_rate=2e-2))
        out = fwd_bwd.result()
        optim.result()
        logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
        assert logprobs.shape == (len(datum.loss_fn_inputs["weights"].data),)
        assert out.metrics["loss:sum"] == pytest.approx(-float(logprobs.sum()), rel=1e-4)
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < losses[0] - 1.0, losses


def test_rl_loop_raises_the_reward(client: Any, service: Any) -> None:
    """Sample, score (the share of tokens in the lower half of the vocabulary), train with
    importance_sampling on group-centred advantages: the mean reward rises. Each step samples
    from new weights; only the newest engines keep running."""
    from tinker import types

    tc = client.create_lora_training_client(base_model="tiny", rank=0).result()  # rank 0: full fine-tuning
    vocab = len(tc.get_tokenizer())
    prompt = types.ModelInput.from_ints(tc.get_tokenizer().encode("count:"))
    params = types.SamplingParams(max_tokens=6, temperature=1.0, stop=[])
    rewards = []
    started = service.service.engines.started
    for _ in range(10):
        sampler = tc.save_weights_and_get_sampling_client()
        seqs = sampler.sample(prompt=prompt, num_samples=8, sampling_params=params).result().sequences
        scores = np.array([np.mean([t < vocab // 2 for t in s.tokens]) for s in seqs])
        rewards.append(float(scores.mean()))
        data = []
        for seq, adv in zip(seqs, scores - scores.mean()):
            tokens = prompt.to_ints() + list(seq.tokens)
            n_prompt = prompt.length - 1
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:],
                                "logprobs": [0.0] * n_prompt + list(seq.logprobs),
                                "advantages": [0.0] * n_prompt + [float(adv)] * len(seq.tokens)}))
        tc.forward_backward(data, "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert np.mean(rewards[-2:]) > np.mean(rewards[:2]) + 0.25, rewards
    running = service.service.engines.running
    assert len(running) == 2 and running[-1].endswith("sampler_000010")
    # ten sets of sampler weights, two engines: the others were loaded into a running engine
    assert service.service.engines.started - started <= 2


def test_save_and_load_state_give_identical_logprobs(client: Any, state_round_trip: Any) -> None:
    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    datum = _sft_datum(tc.get_tokenizer())
    path = state_round_trip(tc, datum)
    saved = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    fresh = client.create_training_client_from_state(path).result()
    again = fresh.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(again, saved)


def test_unsupported_requests_are_refused_clearly(client: Any) -> None:
    import tinker
    from tinker import types

    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    datum = _sft_datum(tc.get_tokenizer())
    with pytest.raises(tinker.RequestFailedError, match="loss_fn 'cispo' is not supported"):
        tc.forward_backward([datum], "cispo").result()
    with pytest.raises(tinker.RequestFailedError, match="unknown loss_fn_config keys"):
        tc.forward_backward([datum], "cross_entropy", {"temperature": 2.0}).result()
    with pytest.raises(tinker.RequestFailedError, match="clip_low_threshold <= 1 <= clip_high_threshold"):
        tc.forward_backward([datum], "ppo", {"clip_high_threshold": 0.5}).result()
    bad = types.Datum(model_input=datum.model_input,
                      loss_fn_inputs={"target_tokens": datum.loss_fn_inputs["target_tokens"]})
    with pytest.raises(tinker.RequestFailedError, match="has no 'weights'"):
        tc.forward_backward([bad], "cross_entropy").result()
    with pytest.raises(Exception, match="base_model 'no-such-model' is not served here"):
        client.create_lora_training_client(base_model="no-such-model", rank=4).result()


def test_sampled_logprobs_match_the_trained_lora_model(client: Any, service: Any) -> None:
    """After LoRA steps, the engine samples from the saved (merged) weights: its log-probs of the
    sampled tokens are the training model's own log-probs of them. Three sampler saves in a pool
    of two engines: at least one loads its weights into a running engine (no new engine), and
    samples the new weights all the same."""
    from tinker import types

    pool = service.service.engines
    started, reloaded = pool.started, pool.reloaded
    tc = client.create_lora_training_client(base_model="tiny", rank=8).result()
    datum = _sft_datum(tc.get_tokenizer())
    prompt = datum.model_input.to_ints()[:4]
    for _ in range(3):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        sampler = tc.save_weights_and_get_sampling_client()
        seq = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                             sampling_params=types.SamplingParams(max_tokens=6, stop=[], seed=3)).result().sequences[0]
        assert len(seq.tokens) == 6 and seq.stop_reason == "length"
        tokens = prompt + list(seq.tokens)
        scored = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                             loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        trained = tc.forward([scored], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(trained[len(prompt) - 1:], seq.logprobs, atol=2e-4)
    assert pool.reloaded - reloaded >= 1 and pool.started - started <= 2
    path = tc.save_weights_for_sampler("named").result().path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/named")
    again = client.create_sampling_client(model_path=path).sample(
        prompt=types.ModelInput.from_ints(prompt), num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=6, stop=[], seed=3)).result().sequences[0]
    assert list(again.tokens) == list(seq.tokens)


def test_closing_the_service_client_unloads_its_models(service: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ServiceClient`` as a context manager finishes its session: its training models are freed,
    what it saved stays loadable."""
    import tinker

    monkeypatch.setenv("TINKER_BASE_URL", service.base_url)
    monkeypatch.setenv("TINKER_API_KEY", service.api_key)
    with tinker.ServiceClient() as client:
        tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
        path = tc.save_state("before_close").result().path
        model_id = tc.model_id
        assert model_id in service.service.training
    assert model_id not in service.service.training
    with tinker.ServiceClient() as client:
        fresh = client.create_training_client_from_state(path).result()
        assert fresh.model_id in service.service.training
