"""The policy-gradient losses and client-side custom losses through the service's train worker."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow


def _rl_datum(tokens: list[int], sampling_logprobs: np.ndarray, advantage: float) -> Any:
    from tinker import types

    n = len(tokens) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": sampling_logprobs.tolist(),
                                       "advantages": [advantage] * n})


def _logprobs(tc: Any, tokens: list[int]) -> np.ndarray:
    from tinker import types

    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    return tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def test_ppo_clips_and_importance_sampling_does_not(client: Any) -> None:
    """With every ratio at e (far above clip_high_threshold) and positive advantages, PPO's
    objective is the clipped constant: no gradient, the step changes nothing. Importance sampling
    on the same data does move the weights, and both report the loss of their formula."""
    from tinker import types

    tc = client.create_lora_training_client(base_model="tiny", rank=0).result()
    tokens = tc.get_tokenizer().encode("one two three four five")
    before = _logprobs(tc, tokens)
    datum = _rl_datum(tokens, before - 1.0, 1.0)
    out = tc.forward_backward([datum], "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).result()
    assert out.metrics["loss:sum"] == pytest.approx(-1.2 * len(before), rel=1e-5)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    np.testing.assert_array_equal(_logprobs(tc, tokens), before)

    out = tc.forward_backward([datum], "importance_sampling").result()
    assert out.metrics["loss:sum"] == pytest.approx(-np.e * len(before), rel=1e-5)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = _logprobs(tc, tokens)
    assert after.sum() > before.sum()  # positive advantages: the sampled tokens got likelier


def test_a_client_side_custom_loss_trains(client: Any) -> None:
    """``forward_backward_custom``: the SDK differentiates the loss itself and sends the gradient
    as cross_entropy weights; the service's backward pass follows it."""
    import torch
    from tinker import types

    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    tokens = tc.get_tokenizer().encode("custom losses run on the client")
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})

    def squared_nll(data: list[Any], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum((lp ** 2).sum() for lp in logprobs)
        return loss, {"squared_nll": float(loss)}

    losses = []
    for _ in range(4):
        out = tc.forward_backward_custom([datum], squared_nll).result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        losses.append(out.metrics["squared_nll"])
    assert losses[-1] < losses[0], losses


def test_sampling_refuses_prompt_logprobs(client: Any) -> None:
    import tinker
    from tinker import types

    sampler = client.create_sampling_client(base_model="tiny")
    with pytest.raises(tinker.RequestFailedError, match="prompt_logprobs is not supported"):
        sampler.sample(prompt=types.ModelInput.from_ints([5, 6, 7]), num_samples=1,
                       sampling_params=types.SamplingParams(max_tokens=2), include_prompt_logprobs=True).result()


def test_forward_needs_only_the_targets(client: Any) -> None:
    """A forward pass (what a client-side custom loss runs first) takes datums with only
    ``target_tokens``; cross_entropy then weighs each token 1."""
    from tinker import types

    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    tokens = tc.get_tokenizer().encode("only the targets")
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:]})
    out = tc.forward([datum], "cross_entropy").result()
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert len(logprobs) == len(tokens) - 1 and (logprobs < 0).all()
    assert out.metrics["loss:sum"] == pytest.approx(-float(logprobs.sum()), rel=1e-5)


def test_seeded_samples_are_reproducible_and_distinct(client: Any) -> None:
    from tinker import types

    sampler = client.create_sampling_client(base_model="tiny")
    params = types.SamplingParams(max_tokens=8, stop=[], seed=11)

    def draw() -> list[list[int]]:
        out = sampler.sample(prompt=types.ModelInput.from_ints([5, 6, 7]), num_samples=3, sampling_params=params)
        return [list(s.tokens) for s in out.result().sequences]

    first = draw()
    assert first == draw()
    assert len({tuple(t) for t in first}) == 3
