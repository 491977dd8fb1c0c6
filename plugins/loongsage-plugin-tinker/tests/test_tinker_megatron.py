"""The official tinker SDK against a service whose job trains on the Megatron-Core backend
(``[train] backend = "megatron"``, on the CPU with gloo): the backend's ``StepwiseTraining``
capability under the same calls as the torch backend's, LoRA and full fine-tuning, with a
save/load round trip and sampling from the trained weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

try:
    import megatron.core  # noqa: F401
except ImportError as exc:  # fail, never skip: the backend's tests need the real library
    raise ImportError("megatron-core is not installed: bash scripts/install_megatron.sh") from exc

pytestmark = pytest.mark.slow

JOB = """
[plugins]
enable = ["torch", "megatron", "tinker"]
[train]
backend = "megatron"
micro_batch_size = 4
[rollout]
engine = "torch"
max_context_length = 512
"""


@pytest.fixture(scope="module")
def megatron_client(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import tinker
    from loongsage_plugin_tinker.serve import served_models, start_service

    from loongsage_core.cli import load_job_and_host

    job_file = tmp_path_factory.mktemp("job") / "megatron.toml"
    job_file.write_text(JOB)
    job, host = load_job_and_host(str(job_file))
    running = start_service(job, host, served_models(job, [f"tiny={tiny_model_dir}"]),
                            state_dir=str(tmp_path_factory.mktemp("tinker_state")))
    try:  # the client finishes its session before the service stops (no heartbeats left behind)
        with tinker.ServiceClient(base_url=running.base_url, api_key=running.api_key) as client:
            yield client
    finally:
        running.stop()


def _datum(tokenizer: Any, text: str = "the quick brown fox jumps over the lazy dog") -> Any:
    from tinker import types

    ids = tokenizer.encode(text)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


@pytest.mark.parametrize("rank", [0, 8], ids=["full", "lora"])
def test_sft_loop_on_megatron_lowers_the_loss(megatron_client: Any, rank: int) -> None:
    from tinker import types

    tc = megatron_client.create_lora_training_client(base_model="tiny", rank=rank).result()
    datum = _datum(tc.get_tokenizer())
    losses = []
    for _ in range(5):
        # two calls of one step: their gradients add up in Megatron's buffers
        first = tc.forward_backward([datum], "cross_entropy")
        second = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2, beta2=0.99, grad_clip_norm=5.0)).result()
        loss, again = first.result().metrics["loss:sum"], second.result().metrics["loss:sum"]
        assert loss == pytest.approx(again, rel=1e-5)  # no step between the two calls
        losses.append(loss)
    assert losses[-1] < losses[0] - 1.0, losses


def test_megatron_state_round_trip_and_sampling_from_its_weights(megatron_client: Any,
                                                                 state_round_trip: Any) -> None:
    """``save_state`` / ``load_state_with_optimizer`` give bit-identical log-probs; the engine
    samples from the Megatron model's exported (LoRA merged) weights with its log-probs."""
    from tinker import types

    tc = megatron_client.create_lora_training_client(base_model="tiny", rank=4).result()
    datum = _datum(tc.get_tokenizer())
    state_round_trip(tc, datum)

    prompt = datum.model_input.to_ints()[:4]
    sampler = tc.save_weights_and_get_sampling_client()
    seq = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                         sampling_params=types.SamplingParams(max_tokens=6, stop=[], seed=3)).result().sequences[0]
    tokens = prompt + list(seq.tokens)
    scored = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                         loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    trained = tc.forward([scored], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(trained[len(prompt) - 1:], seq.logprobs, atol=2e-4)
